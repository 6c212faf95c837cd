//! `--device` at start-up: resolves it once, before any model is loaded or port bound, and logs
//! the outcome (with `auto`, why the CPU was chosen).

use anyhow::Context;
use moeserve_backend::device::{DeviceRequest, select_device};

/// Fails with the backend's message when `--device cuda` cannot be honoured.
pub fn select(request: DeviceRequest) -> anyhow::Result<()> {
    let selection = select_device(request).with_context(|| format!("--device {request}"))?;
    eprintln!("moeserve: device: {}", selection.reason);
    Ok(())
}
