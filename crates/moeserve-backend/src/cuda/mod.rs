//! The CUDA backend on cudarc (feature `cuda`): a device, its stream and cuBLAS handle, and the
//! kernels of the top-level `cuda/` folder compiled by NVRTC for the device's compute capability
//! on first use (cached per device, as candle's `get_or_load_func`).
//!
//! - [`kernels`]: the `.cu` files and the entry points each defines.
//! - [`nvrtc`]: compiling them (headers, options, version).
//! - [`ops`]: one launch wrapper per kernel, checked against the CPU reference by
//!   `tests/cuda_kernels/`.
//! - [`gemm`]: dense GEMMs and the per-expert-segment grouped GEMM through cuBLAS.
//! - [`nccl`]: the all-to-all-v of expert parallelism over NCCL.
//!
//! Every library is loaded at run time, so building needs no CUDA toolkit; [`probe`] checks that
//! they load before anything touches them (cudarc panics on a missing library).

mod element;
mod error;
pub mod gemm;
pub mod kernels;
pub mod nccl;
pub mod nvrtc;
pub mod ops;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use cudarc::driver::{CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut};
pub use element::CudaElement;
pub use error::CudaError;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaModule, DeviceRepr, ValidAsZeroBits};
use kernels::KernelFile;

use crate::device::CudaDeviceInfo;

/// Checks that the driver, NVRTC and cuBLAS libraries load (without this cudarc panics).
fn check_libraries() -> Result<(), CudaError> {
    // SAFETY: these only try to dlopen the library candidates.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaError::NoDriver);
    }
    if !nvrtc::nvrtc_present() {
        return Err(CudaError::MissingLibrary {
            library: "libnvrtc.so.13",
            purpose: "compiles the kernels at start-up",
        });
    }
    // SAFETY: as above.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(CudaError::MissingLibrary {
            library: "libcublas.so.13",
            purpose: "runs the dense and expert GEMMs",
        });
    }
    Ok(())
}

/// Finds device 0 and the libraries the backend needs, without compiling anything.
pub fn probe() -> Result<CudaDeviceInfo, CudaError> {
    check_libraries()?;
    let ctx = open_device(0)?;
    device_info(&ctx)
}

fn open_device(ordinal: usize) -> Result<Arc<CudaContext>, CudaError> {
    let count = CudaContext::device_count().map_err(|e| CudaError::NoDevice(e.to_string()))?;
    if ordinal >= count.max(0) as usize {
        return Err(CudaError::NoDevice(format!(
            "asked for device {ordinal}, {count} present"
        )));
    }
    Ok(CudaContext::new(ordinal)?)
}

fn device_info(ctx: &Arc<CudaContext>) -> Result<CudaDeviceInfo, CudaError> {
    let (major, minor) = ctx.compute_capability()?;
    Ok(CudaDeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name()?,
        compute_capability: (major as u32, minor as u32),
        total_memory_bytes: ctx.total_mem()? as u64,
        num_devices: CudaContext::device_count()? as usize,
        nvrtc_version: nvrtc::nvrtc_version()?,
    })
}

/// `file` compiled for `arch`, once per process: a second backend on the same device (tests open
/// one per model) loads the same PTX instead of running NVRTC again.
fn compiled_ptx(
    file: KernelFile,
    arch: &str,
    include_dir: &std::path::Path,
) -> Result<cudarc::nvrtc::Ptx, CudaError> {
    static CACHE: Mutex<Option<HashMap<(KernelFile, String), cudarc::nvrtc::Ptx>>> =
        Mutex::new(None);
    let key = (file, arch.to_string());
    if let Some(ptx) = CACHE
        .lock()
        .expect("no compile panics")
        .get_or_insert_default()
        .get(&key)
    {
        return Ok(ptx.clone());
    }
    let ptx = nvrtc::compile(file, arch, include_dir)?;
    CACHE
        .lock()
        .expect("no compile panics")
        .get_or_insert_default()
        .insert(key, ptx.clone());
    Ok(ptx)
}

/// One CUDA device: its context, one stream, a cuBLAS handle on that stream, and the kernel
/// modules compiled so far.
pub struct CudaBackend {
    info: CudaDeviceInfo,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// `compute_XY` of this device.
    arch: String,
    include_dir: PathBuf,
    modules: Mutex<HashMap<KernelFile, Arc<CudaModule>>>,
}

impl CudaBackend {
    /// Opens device `ordinal`; fails with a clear error when a library, the device or the CUDA
    /// headers are missing.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        check_libraries()?;
        let ctx = open_device(ordinal)?;
        let info = device_info(&ctx)?;
        let include_dir = nvrtc::cuda_include_dir()?;
        let stream = ctx.new_stream()?;
        let blas = CudaBlas::new(stream.clone())?;
        let (major, minor) = info.compute_capability;
        Ok(CudaBackend {
            info,
            stream,
            blas,
            arch: format!("compute_{major}{minor}"),
            include_dir,
            modules: Mutex::new(HashMap::new()),
        })
    }

    pub fn info(&self) -> &CudaDeviceInfo {
        &self.info
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    pub fn blas(&self) -> &CudaBlas {
        &self.blas
    }

    /// The entry point `name` of `file`, compiling the file for this device on first use.
    pub fn function(&self, file: KernelFile, name: &str) -> Result<CudaFunction, CudaError> {
        let module = {
            let mut modules = self.modules.lock().expect("no kernel compile panics");
            match modules.get(&file) {
                Some(m) => m.clone(),
                None => {
                    let ptx = compiled_ptx(file, &self.arch, &self.include_dir)?;
                    let m = self.stream.context().load_module(ptx)?;
                    modules.insert(file, m.clone());
                    m
                }
            }
        };
        Ok(module.load_function(name)?)
    }

    /// Compiles and loads every kernel file now, so the first step does not pay for it.
    pub fn load_all_kernels(&self) -> Result<(), CudaError> {
        for file in KernelFile::ALL {
            self.function(file, &file.entry_points()[0])?;
        }
        Ok(())
    }

    /// Copies `host` to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        device: &CudaSlice<T>,
    ) -> Result<Vec<T>, CudaError> {
        let host = self.stream.clone_dtoh(device)?;
        // A copy into pageable memory completes before it returns; synchronising makes the
        // contract explicit rather than relying on that.
        self.stream.synchronize()?;
        Ok(host)
    }

    /// A zeroed device buffer of `len` elements.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<CudaSlice<T>, CudaError> {
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// Copies `len` elements of `buf` from offset `from` to offset `to` on the device (the two
    /// ranges must not overlap); queued on the stream like the kernels.
    pub fn copy_within<T: DeviceRepr>(
        &self,
        buf: &mut CudaSlice<T>,
        from: usize,
        to: usize,
        len: usize,
    ) -> Result<(), CudaError> {
        assert!(
            from.abs_diff(to) >= len && from.max(to) + len <= buf.len(),
            "copy of {len} from {from} to {to} in {} elements",
            buf.len()
        );
        if len == 0 {
            return Ok(());
        }
        // Two views of one buffer: split it where the later range starts.
        let (mut head, mut tail) = buf.split_at_mut(from.max(to));
        if from < to {
            self.stream
                .memcpy_dtod(&head.slice(from..from + len), &mut tail.slice_mut(..len))?;
        } else {
            self.stream
                .memcpy_dtod(&tail.slice(..len), &mut head.slice_mut(to..to + len))?;
        }
        Ok(())
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        Ok(self.stream.synchronize()?)
    }
}
