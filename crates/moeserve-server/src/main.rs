//! `moeserve`: the command-line entry point. Each subcommand lives in `cli/`.

use clap::{CommandFactory, FromArgMatches};
use moeserve_server::cli;

fn main() -> std::process::ExitCode {
    return_large_frees_to_the_os();
    let matches = cli::Cli::command().get_matches();
    let result = cli::Cli::from_arg_matches(&matches)
        .map_err(anyhow::Error::from)
        .and_then(|args| cli::run(args, &matches));
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            if moeserve_server::logging::is_json() {
                tracing::error!("{e:#}");
            } else {
                eprintln!("error: {e:#}");
            }
            std::process::ExitCode::FAILURE
        }
    }
}

/// glibc raises its mmap threshold each time a large block is freed, up to 32 MiB: after the
/// first long prompts, a request's multi-megabyte buffers (a long prompt's text, its encoding,
/// its logprobs) come from the heap arenas of whichever thread served it and stay resident once
/// freed, so the server's memory climbs to the busiest moment's and stays there. A fixed
/// threshold keeps every block from 256 KiB up in its own mapping, returned when freed.
fn return_large_frees_to_the_os() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 256 << 10);
    }
}
