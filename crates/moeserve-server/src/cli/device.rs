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
/// (and with `--quantization int8` the integer dot product, e.g. `avx512 + int8 avx512-vnni`),
/// or the GPU.
pub fn kernels_name(device: &Device) -> String {
    use moeserve_backend::cpu::{self, WeightQuantization, int8::DotKernel};
    match device {
        Device::Cpu => match DotKernel::for_isa(cpu::isa()) {
            Some(dot) if cpu::weight_quantization() == WeightQuantization::Int8 => {
                format!("{} + int8 {dot}", cpu::isa())
            }
            _ => cpu::isa().to_string(),
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
