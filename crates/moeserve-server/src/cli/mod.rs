//! Command-line arguments, one module per subcommand; flag names follow vLLM where the concept
//! is the same.

pub mod engine_args;
mod generate;
mod make_model;
pub mod moe_args;
pub mod serve;

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
    /// Write a Mixtral checkpoint: a random preset, or a dense GGUF upcycled into experts.
    MakeModel(make_model::MakeModelArgs),
    /// Serve a model over an OpenAI-compatible HTTP API.
    Serve(Box<serve::ServeArgs>),
}

/// Runs the chosen subcommand; `matches` tells which flags were given explicitly (the config
/// file of `serve` fills in only the others).
pub fn run(cli: Cli, matches: &ArgMatches) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::MakeModel(args) => make_model::run(args),
        Command::Serve(args) => {
            let serve_matches = matches
                .subcommand_matches("serve")
                .expect("the serve subcommand was parsed from these matches");
            serve::run(*args, serve_matches)
        }
    }
}
