//! `--device` at start-up: resolves it once, before any model is loaded or port bound, and logs
//! the outcome (with `auto`, why the CPU was chosen when it was).

use anyhow::Context;
use moeserve_backend::device::{Device, DeviceRequest, select_device};

/// The device the engine runs on; fails with the backend's message when `--device cuda` cannot
/// be honoured. Every family runs on either backend, so `auto` takes a usable GPU whatever the
/// model.
pub fn select(request: DeviceRequest) -> anyhow::Result<Device> {
    let selection = select_device(request).with_context(|| format!("--device {request}"))?;
    tracing::info!("device: {}", selection.reason);
    Ok(selection.device)
}

/// What computes the forward on `device`, for start-up logs and reports: the CPU kernels' ISA
/// and the integer dot product that int8 (`--quantization int8`) and int4 (GPTQ, AWQ) weights
/// run on (e.g. `avx512, integer weights avx512-vnni`), or the GPU.
pub fn kernels_name(device: &Device) -> String {
    use moeserve_backend::cpu::{self, intdot::DotKernel};
    match device {
        Device::Cpu => match DotKernel::for_isa(cpu::isa()) {
            Some(dot) => format!("{}, integer weights {dot}", cpu::isa()),
            None => cpu::isa().to_string(),
        },
        Device::Cuda(info) => format!("cuda:{}", info.ordinal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_on_a_machine_without_cuda_is_the_cpu() {
        if moeserve_backend::cuda::probe().is_ok() {
            return;
        }
        assert!(matches!(select(DeviceRequest::Auto).unwrap(), Device::Cpu));
    }
}
