//! `moeserve`: the command-line entry point. Each subcommand lives in `cli/`.

use clap::{CommandFactory, FromArgMatches};
use moeserve_server::cli;

fn main() -> std::process::ExitCode {
    let matches = cli::Cli::command().get_matches();
    let result = cli::Cli::from_arg_matches(&matches)
        .map_err(anyhow::Error::from)
        .and_then(|args| cli::run(args, &matches));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
