//! Command-line arguments, one module per subcommand; flag names follow vLLM where the concept
//! is the same.

mod engine_args;
mod generate;
mod make_model;

use clap::{Parser, Subcommand};

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
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(args) => generate::run(args),
        Command::MakeModel(args) => make_model::run(args),
    }
}
