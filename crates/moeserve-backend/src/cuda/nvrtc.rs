//! Compiling `cuda/*.cu` with NVRTC: finding the CUDA headers, the options, the version.
//!
//! NVRTC is loaded at run time (cudarc `dynamic-loading`): `libnvrtc.so.13` from the loader's
//! search path (LD_LIBRARY_PATH included). Its `libnvrtc-builtins.so.13.0` must sit on the same
//! path. The toolkit headers it does not bundle (`cuda_bf16.h`, `cuda_fp16.h`) come from the
//! first directory that has them: `$MOESERVE_CUDA_INCLUDE`, `$CUDA_HOME/include`,
//! `$CUDA_PATH/include`, `/usr/local/cuda/include`.

use std::path::PathBuf;

use cudarc::nvrtc::{CompileError, CompileOptions, Ptx};

use super::error::CudaError;
use super::kernels::KernelFile;

/// Whether `libnvrtc` can be loaded; cudarc panics on first use when it cannot.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library candidates.
    unsafe { cudarc::nvrtc::sys::is_culib_present() }
}

/// `(major, minor)` of the loaded NVRTC.
pub fn nvrtc_version() -> Result<(u32, u32), CudaError> {
    if !nvrtc_present() {
        return Err(CudaError::MissingLibrary {
            library: "libnvrtc.so.13",
            purpose: "compiles the kernels at start-up",
        });
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present (checked above); both pointers are valid for the call.
    let status = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    if status != cudarc::nvrtc::sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(CudaError::InvalidArgument {
            op: "nvrtcVersion",
            message: format!("{status:?}"),
        });
    }
    Ok((major as u32, minor as u32))
}

/// The directories searched for `cuda_bf16.h`, in order.
fn header_candidates() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    if let Some(dir) = std::env::var_os("MOESERVE_CUDA_INCLUDE") {
        dirs.push(PathBuf::from(dir));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(PathBuf::from(root).join("include"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/include"));
    dirs
}

/// The include directory holding `cuda_bf16.h` and `cuda_fp16.h`.
pub fn cuda_include_dir() -> Result<PathBuf, CudaError> {
    let candidates = header_candidates();
    candidates
        .iter()
        .find(|d| d.join("cuda_bf16.h").is_file() && d.join("cuda_fp16.h").is_file())
        .cloned()
        .ok_or_else(|| CudaError::NoHeaders {
            tried: candidates
                .iter()
                .map(|d| d.display().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        })
}

/// Compiles one kernel file to PTX for `arch` (a virtual architecture such as `compute_90`, so
/// the driver finishes it for the exact device).
pub fn compile(
    file: KernelFile,
    arch: &str,
    include_dir: &std::path::Path,
) -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        include_paths: vec![include_dir.display().to_string()],
        options: vec![
            format!("--gpu-architecture={arch}"),
            "--std=c++17".into(),
            // The kernels' accuracy is tested against the CPU reference: no fast math.
            "--fmad=true".into(),
        ],
        name: Some(file.file_name().into()),
        ..Default::default()
    };
    cudarc::nvrtc::compile_ptx_with_opts(file.program(), opts).map_err(|e| match e {
        CompileError::CompileError { log, .. } => CudaError::Compile {
            file: file.file_name(),
            arch: arch.into(),
            log: log.to_string_lossy().into_owned(),
        },
        other => CudaError::Compile {
            file: file.file_name(),
            arch: arch.into(),
            log: other.to_string(),
        },
    })
}
