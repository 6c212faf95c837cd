//! `--device` at start-up: resolves it once, before any model is loaded or port bound, and logs
//! the outcome (with `auto`, why the CPU was chosen).

use std::path::Path;

use anyhow::Context;
use moeserve_backend::device::{Device, DeviceRequest, select_device};
use moeserve_model::config::ModelConfig;

/// The device the engine runs `model` on; fails with the backend's message when `--device cuda`
/// cannot be honoured. `auto` takes CUDA only for a model the CUDA backend can serve.
pub fn select(request: DeviceRequest, model: &Path) -> anyhow::Result<Device> {
    let mut selection = select_device(request).with_context(|| format!("--device {request}"))?;
    if request == DeviceRequest::Auto
        && matches!(selection.device, Device::Cuda(_))
        && let Ok(config) = ModelConfig::from_dir(model)
        && let Some(why) = cuda_cannot_serve(&config)
    {
        selection.device = Device::Cpu;
        selection.reason = format!("cpu (--device auto: {why})");
    }
    eprintln!("moeserve: device: {}", selection.reason);
    Ok(selection.device)
}

/// Why the CUDA forward cannot run a model of `config` (it implements Mixtral-shaped models
/// only so far); `None` when it can.
fn cuda_cannot_serve(config: &ModelConfig) -> Option<String> {
    (!config.is_mixtral_shaped()).then(|| {
        format!(
            "the CUDA backend runs Mixtral-shaped models only so far, not {}",
            config.architecture
        )
    })
}

/// What computes the forward on `device`, for start-up logs and reports: the CPU kernels' ISA,
/// or the GPU.
pub fn kernels_name(device: &Device) -> String {
    match device {
        Device::Cpu => moeserve_backend::cpu::isa().to_string(),
        Device::Cuda(info) => format!("cuda:{}", info.ordinal),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(case: &str) -> ModelConfig {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures")
            .join(case);
        ModelConfig::from_dir(&dir).unwrap()
    }

    #[test]
    fn auto_keeps_cuda_for_mixtral_only() {
        assert_eq!(cuda_cannot_serve(&fixture("mixtral-gqa")), None);
        let why = cuda_cannot_serve(&fixture("qwen3-moe")).unwrap();
        assert!(why.contains("Qwen3MoeForCausalLM"), "{why}");
        assert!(cuda_cannot_serve(&fixture("olmoe")).is_some());
    }

    #[test]
    fn auto_on_a_machine_without_cuda_is_the_cpu_for_every_family() {
        // With no usable GPU here, every model runs on the CPU whatever its family.
        if moeserve_backend::cuda::probe().is_ok() {
            return;
        }
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3-moe");
        assert!(matches!(
            select(DeviceRequest::Auto, &dir).unwrap(),
            Device::Cpu
        ));
    }
}
