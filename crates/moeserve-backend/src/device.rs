//! Which device runs the model (`--device auto|cpu|cuda`), decided once at start-up.
//!
//! The CUDA side is probed without panicking: cudarc loads libcuda and libnvrtc lazily and
//! panics when they are missing, so [`crate::cuda::probe`] checks that the libraries load before
//! it touches the driver. With the `cuda` feature off the probe returns
//! [`crate::cuda::CudaError::NotCompiled`], so this file has no `cfg`.

use std::fmt;
use std::str::FromStr;

use crate::cuda::{self, CudaError};

/// The `--device` flag.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceRequest {
    /// CUDA when it can serve the model on this machine, else the CPU (with a log line saying
    /// why).
    #[default]
    Auto,
    Cpu,
    /// CUDA or a clear error.
    Cuda,
}

impl FromStr for DeviceRequest {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "auto" => Ok(DeviceRequest::Auto),
            "cpu" => Ok(DeviceRequest::Cpu),
            "cuda" => Ok(DeviceRequest::Cuda),
            other => Err(format!("unknown device {other:?} (use auto, cpu or cuda)")),
        }
    }
}

impl fmt::Display for DeviceRequest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            DeviceRequest::Auto => "auto",
            DeviceRequest::Cpu => "cpu",
            DeviceRequest::Cuda => "cuda",
        })
    }
}

/// What the CUDA probe found about device 0.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CudaDeviceInfo {
    pub ordinal: usize,
    pub name: String,
    /// `(major, minor)`, e.g. `(9, 0)` for an H100 / H200.
    pub compute_capability: (u32, u32),
    pub total_memory_bytes: u64,
    pub num_devices: usize,
    /// `(major, minor)` of the NVRTC library that compiles the kernels.
    pub nvrtc_version: (u32, u32),
}

impl fmt::Display for CudaDeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (major, minor) = self.compute_capability;
        let (nv_major, nv_minor) = self.nvrtc_version;
        write!(
            f,
            "cuda:{} {} (sm_{major}{minor}, {:.1} GiB; {} device(s); NVRTC {nv_major}.{nv_minor})",
            self.ordinal,
            self.name,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64,
            self.num_devices,
        )
    }
}

/// The device the model runs on.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Device {
    #[default]
    Cpu,
    Cuda(CudaDeviceInfo),
}

/// The outcome of `--device`: the device and one line saying why, for the start-up log.
#[derive(Clone, Debug)]
pub struct DeviceSelection {
    pub device: Device,
    pub reason: String,
}

/// Resolves `--device`: `cpu` always works; `cuda` returns an error naming what is missing;
/// `auto` falls back to the CPU and says why.
pub fn select_device(request: DeviceRequest) -> Result<DeviceSelection, CudaError> {
    match request {
        DeviceRequest::Cpu => Ok(DeviceSelection {
            device: Device::Cpu,
            reason: "cpu (--device cpu)".into(),
        }),
        DeviceRequest::Cuda => {
            let info = cuda::probe()?;
            Ok(DeviceSelection {
                reason: format!("{info} (--device cuda)"),
                device: Device::Cuda(info),
            })
        }
        DeviceRequest::Auto => match cuda::probe() {
            Ok(info) => Ok(DeviceSelection {
                reason: format!("{info} (--device auto)"),
                device: Device::Cuda(info),
            }),
            Err(e) => Ok(DeviceSelection {
                device: Device::Cpu,
                reason: format!("cpu (--device auto: CUDA unavailable: {e})"),
            }),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn device_names_parse_and_print_as_the_flag_spells_them() {
        for name in ["auto", "cpu", "cuda"] {
            assert_eq!(name.parse::<DeviceRequest>().unwrap().to_string(), name);
        }
        let err = "gpu".parse::<DeviceRequest>().unwrap_err();
        assert!(err.contains("auto, cpu or cuda"), "{err}");
    }

    #[test]
    fn cpu_is_always_available() {
        let s = select_device(DeviceRequest::Cpu).unwrap();
        assert_eq!(s.device, Device::Cpu);
    }

    #[test]
    fn auto_falls_back_to_the_cpu_and_says_why() {
        let s = select_device(DeviceRequest::Auto).unwrap();
        assert_eq!(s.device, Device::Cpu);
        assert!(s.reason.starts_with("cpu (--device auto: "), "{}", s.reason);
    }
}
