//! Errors of the CUDA backend: what is missing on this machine, what the driver, cuBLAS or
//! NVRTC reported, and arguments that do not fit a kernel.

use cudarc::cublas::result::CublasError;
use cudarc::driver::DriverError;

#[derive(Debug, thiserror::Error)]
pub enum CudaError {
    /// Only the stub returns it; kept here so callers match the same variants either way.
    #[error(
        "this moeserve was built without CUDA support; rebuild with \
         `cargo build --release --bin moeserve --features cuda`"
    )]
    NotCompiled,
    #[error(
        "no NVIDIA driver on this machine: libcuda.so could not be loaded (install the NVIDIA \
         driver, or run with --device cpu)"
    )]
    NoDriver,
    #[error(
        "{library} (CUDA 13.0) could not be loaded; it {purpose}: install it, or put its \
         directory on LD_LIBRARY_PATH"
    )]
    MissingLibrary {
        library: &'static str,
        purpose: &'static str,
    },
    #[error(
        "NCCL is installed as {found}, a name cudarc does not load (it asks for libnccl.so): \
         link it as libnccl.so in a folder on LD_LIBRARY_PATH, e.g. `mkdir -p ~/.local/nccl && \
         ln -sf {found} ~/.local/nccl/libnccl.so && export LD_LIBRARY_PATH=~/.local/nccl:$LD_LIBRARY_PATH` \
         (bench/gpu_check.sh does this itself)",
        found = found.display()
    )]
    NcclNameOnly { found: std::path::PathBuf },
    #[error("the NVIDIA driver reports no CUDA device ({0})")]
    NoDevice(String),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("NCCL: {0}")]
    Nccl(String),
    #[error("cuBLAS: {0}")]
    Blas(#[from] CublasError),
    #[error("NVRTC could not compile cuda/{file} for {arch}:\n{log}")]
    Compile {
        file: &'static str,
        arch: String,
        log: String,
    },
    #[error(
        "cannot find the CUDA headers (cuda_bf16.h) that NVRTC needs: set MOESERVE_CUDA_INCLUDE \
         or CUDA_HOME (tried {tried})"
    )]
    NoHeaders { tried: String },
    #[error("{op}: {message}")]
    InvalidArgument { op: &'static str, message: String },
}

impl CudaError {
    /// A buffer of the wrong length for `op`.
    pub(crate) fn length(op: &'static str, what: &str, expected: usize, got: usize) -> Self {
        CudaError::InvalidArgument {
            op,
            message: format!("{what} has {got} elements, expected {expected}"),
        }
    }
}
