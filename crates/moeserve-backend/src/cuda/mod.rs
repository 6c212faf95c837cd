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
mod tally;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

pub use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, CudaView, CudaViewMut, DeviceRepr, PinnedHostSlice,
    ValidAsZeroBits,
};
pub use element::CudaElement;
pub use error::CudaError;
pub use tally::WorkCounts;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaFunction, CudaModule, DevicePtr, DevicePtrMut};
use kernels::KernelFile;
use tally::{Tally, Work};

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

/// An entry point: its file, its name and its element suffix (`""` for untyped kernels).
type EntryPoint = (KernelFile, &'static str, &'static str);

/// One CUDA device: its context, one stream, a cuBLAS handle on that stream, the kernel
/// modules compiled so far and their entry points resolved so far, and the counts of what it
/// queued ([`WorkCounts`]).
///
/// All of a backend's work is on its one stream, so cudarc's per-allocation event tracking
/// (an event recorded and waited on at every use of every buffer) is off for its device:
/// ordering on one stream needs none. Work that crosses devices (expert parallelism's peer
/// copies) synchronises explicitly.
pub struct CudaBackend {
    info: CudaDeviceInfo,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    /// `compute_XY` of this device.
    arch: String,
    include_dir: PathBuf,
    modules: Mutex<HashMap<KernelFile, Arc<CudaModule>>>,
    /// Entry points resolved once (`cuModuleGetFunction`), then looked up here per launch.
    functions: Mutex<HashMap<EntryPoint, CudaFunction>>,
    tally: Tally,
}

impl CudaBackend {
    /// Opens device `ordinal`; fails with a clear error when a library, the device or the CUDA
    /// headers are missing.
    pub fn new(ordinal: usize) -> Result<Self, CudaError> {
        check_libraries()?;
        let ctx = open_device(ordinal)?;
        let info = device_info(&ctx)?;
        let include_dir = nvrtc::cuda_include_dir()?;
        // SAFETY: buffers of this backend are used on its stream only; cross-device work
        // synchronises the source's stream before a peer reads it (see the type's comment).
        unsafe { ctx.disable_event_tracking() };
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
            functions: Mutex::new(HashMap::new()),
            tally: Tally::default(),
        })
    }

    /// What this backend has queued and waited for so far.
    pub fn counts(&self) -> WorkCounts {
        self.tally.snapshot()
    }

    /// Makes this device's context current on the calling thread (cuBLAS and NCCL calls use
    /// the current context; kernel launches and copies bind their own).
    pub fn bind_context(&self) -> Result<(), CudaError> {
        Ok(self.stream.context().bind_to_thread()?)
    }

    pub(crate) fn count(&self, work: Work) {
        self.tally.add(work);
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

    /// The kernel `name` (`{name}_{suffix}` when `suffix` is not empty) of `file`, for one
    /// launch (counted): resolved on first use, then taken from the backend's table.
    pub(crate) fn kernel(
        &self,
        file: KernelFile,
        name: &'static str,
        suffix: &'static str,
    ) -> Result<CudaFunction, CudaError> {
        self.count(Work::Kernel);
        let key = (file, name, suffix);
        if let Some(f) = self.functions.lock().expect("no lookup panics").get(&key) {
            return Ok(f.clone());
        }
        let full = match suffix {
            "" => name.to_string(),
            _ => format!("{name}_{suffix}"),
        };
        let f = self.function(file, &full)?;
        self.functions
            .lock()
            .expect("no lookup panics")
            .insert(key, f.clone());
        Ok(f)
    }

    /// Compiles and loads every kernel file now and resolves every entry point, so the first
    /// step pays for neither.
    pub fn load_all_kernels(&self) -> Result<(), CudaError> {
        let mut functions = HashMap::new();
        for file in KernelFile::ALL {
            for name in file.typed_kernels() {
                for suffix in ["f32", "f16", "bf16"] {
                    let f = self.function(file, &format!("{name}_{suffix}"))?;
                    functions.insert((file, *name, suffix), f);
                }
            }
            for name in file.untyped_kernels() {
                functions.insert((file, *name, ""), self.function(file, name)?);
            }
        }
        self.functions
            .lock()
            .expect("no lookup panics")
            .extend(functions);
        Ok(())
    }

    /// Copies `host` to a new device buffer.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, CudaError> {
        self.count(Work::Allocation);
        self.count(Work::HtoD);
        Ok(self.stream.clone_htod(host)?)
    }

    /// Copies `host` into `dst` (of the same length), queued on the stream; the host memory is
    /// staged by the driver before this returns, so it may be reused at once.
    pub fn copy_htod<T: DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), CudaError> {
        ops::check_len("copy_htod", "host slice", host.len(), dst.len())?;
        if host.is_empty() {
            return Ok(());
        }
        self.count(Work::HtoD);
        Ok(self.stream.memcpy_htod(host, dst)?)
    }

    /// Copies `src` into `dst` (of the same length) on the device, queued on the stream.
    pub fn copy_dtod<T: DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut impl DevicePtrMut<T>,
    ) -> Result<(), CudaError> {
        ops::check_len("copy_dtod", "source", src.len(), dst.len())?;
        if src.len() == 0 {
            return Ok(());
        }
        self.count(Work::DtoD);
        Ok(self.stream.memcpy_dtod(src, dst)?)
    }

    /// Queues a copy of `src` into the start of the pinned `dst` (at least as long); it is there once
    /// the stream is synchronised ([`CudaBackend::pinned_contents`]).
    pub fn copy_dtoh_pinned<T: DeviceRepr>(
        &self,
        src: &impl DevicePtr<T>,
        dst: &mut PinnedHostSlice<T>,
    ) -> Result<(), CudaError> {
        ops::check("copy_dtoh_pinned", dst.len() >= src.len(), || {
            format!("{} elements into {} pinned", src.len(), dst.len())
        })?;
        self.count(Work::DtoH);
        Ok(self.stream.memcpy_dtoh(src, dst)?)
    }

    /// The contents of `pinned` once the copies queued into it are done: call after
    /// [`CudaBackend::synchronize`] (this waits for them too, but is not counted as a sync).
    pub fn pinned_contents<'p, T: DeviceRepr + ValidAsZeroBits>(
        &self,
        pinned: &'p PinnedHostSlice<T>,
    ) -> Result<&'p [T], CudaError> {
        Ok(pinned.as_slice()?)
    }

    /// Page-locked host memory of `len` elements, for copies back that do not stage through
    /// the driver (cached, not write-combined: the host reads it).
    pub fn pinned<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<PinnedHostSlice<T>, CudaError> {
        // SAFETY: T is valid as zero bits; the memory is filled by copies before it is read,
        // and `read_pinned` waits for them.
        let mut host = unsafe { self.stream.context().alloc_pinned_with_flags(len.max(1), 0) }?;
        host.as_mut_slice()?.iter_mut().for_each(|v| {
            // SAFETY: all-zero bits are a valid T.
            *v = unsafe { std::mem::zeroed() }
        });
        Ok(host)
    }

    /// Copies a device buffer back (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        device: &impl DevicePtr<T>,
    ) -> Result<Vec<T>, CudaError> {
        self.count(Work::DtoH);
        self.count(Work::Sync);
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
        self.count(Work::Allocation);
        self.count(Work::Memset);
        Ok(self.stream.alloc_zeros(len)?)
    }

    /// Zeroes `buf` on the stream.
    pub fn memset_zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        buf: &mut impl DevicePtrMut<T>,
    ) -> Result<(), CudaError> {
        self.count(Work::Memset);
        Ok(self.stream.memset_zeros(buf)?)
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
        self.count(Work::DtoD);
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

    /// A timing event recorded on the stream now: the GPU time between two marks is the work
    /// queued between them ([`GpuMark::seconds_until`]).
    pub fn mark(&self) -> Result<GpuMark, CudaError> {
        let flags = cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;
        Ok(GpuMark(self.stream.record_event(Some(flags))?))
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<(), CudaError> {
        self.count(Work::Sync);
        Ok(self.stream.synchronize()?)
    }
}

/// A point on a backend's stream (a CUDA event with timing), from [`CudaBackend::mark`].
pub struct GpuMark(cudarc::driver::CudaEvent);

impl GpuMark {
    /// Seconds of GPU time from this mark to `end` (a later mark on the same stream); waits
    /// for `end` if the stream has not reached it (read them after the step's sync).
    pub fn seconds_until(&self, end: &GpuMark) -> Result<f64, CudaError> {
        Ok(f64::from(self.0.elapsed_ms(&end.0)?) / 1e3)
    }
}
