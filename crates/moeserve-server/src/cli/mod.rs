//! Command-line arguments, one module per subcommand; flag names follow vLLM where the concept
//! is the same.

mod bench_offline;
mod bench_serve;
pub(crate) mod device;
pub mod engine_args;
mod generate;
mod make_model;
pub mod model_source;
pub mod moe_args;
mod plan;
mod quantize;
pub mod serve;
mod tune;

use clap::{ArgMatches, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "moeserve",
    version,
    about = "A serving engine for mixture-of-experts language models"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Generate text for one prompt (offline, no server).
    Generate(generate::GenerateArgs),
    /// Write a checkpoint: a random preset (Mixtral, Qwen3-MoE, DeepSeek, GPT-OSS), or a dense
    /// GGUF upcycled into a Mixtral.
    MakeModel(make_model::MakeModelArgs),
    /// Write an int8 checkpoint made with GPTQ, calibrated on text sampled from the model.
    Quantize(quantize::QuantizeArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::ServeArgs>),
    /// Benchmarks: `serve` load-tests any OpenAI-compatible server; `plot` compares results.
    #[command(subcommand)]
    Bench(BenchCommand),
    /// Size a deployment from a `bench serve` result: max batch within a TPOT target and the KV
    /// cache, replicas by Little's law, recommended flags.
    Plan(plan::PlanArgs),
    /// Tune engine settings with data: `capacity-factor`.
    #[command(subcommand)]
    Tune(tune::TuneCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Load-test an OpenAI-compatible server over concurrency levels (TTFT, TPOT, ITL, e2e).
    Serve(bench_serve::BenchServeArgs),
    /// Draw several `bench serve` results on one latency-versus-throughput chart.
    Plot(bench_serve::BenchPlotArgs),
    /// Time prefill and decode of B sequences through the engine, no server (tokens/s, GB/s,
    /// GFLOP/s).
    Offline(Box<bench_offline::BenchOfflineArgs>),
}

/// Runs the chosen subcommand; `matches` tells which flags were given explicitly (the config
/// file of `serve` fills in only the others).
pub fn run(cli: Cli, matches: &ArgMatches) -> anyhow::Result<()> {
    // `serve` starts its logging from its flags (`--log-level`, `--log-format`).
    if !matches!(cli.command, Command::Serve(_)) {
        crate::logging::init_for_tools();
    }
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::MakeModel(args) => make_model::run(args),
        Command::Quantize(args) => quantize::run(args),
        Command::Serve(_) => {
            let serve_matches = matches
                .subcommand_matches("serve")
                .expect("the serve subcommand was parsed from these matches");
            serve::run(serve_matches)
        }
        Command::Bench(BenchCommand::Serve(args)) => bench_serve::run(args),
        Command::Bench(BenchCommand::Plot(args)) => bench_serve::plot(args),
        Command::Bench(BenchCommand::Offline(args)) => bench_offline::run(*args),
        Command::Plan(args) => plan::run(args),
        Command::Tune(command) => tune::run(command),
    }
}
