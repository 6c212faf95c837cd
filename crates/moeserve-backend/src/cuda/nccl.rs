//! Expert parallelism's exchange between GPUs: all-to-all-v over NCCL grouped send / receive
//! (the dispatch and combine of the MoE core's `AllToAll`, see `cuda/README.md`).
//!
//! One process drives every local GPU (one communicator each, `Comm::from_devices`); all ranks'
//! sends and receives are issued inside one NCCL group, which a single thread driving several
//! GPUs needs so that no rank waits on a peer whose calls are not issued yet. `libnccl.so.2` is
//! loaded at run time; [`NcclGroup::new`] checks that it loads.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use cudarc::nccl::{Comm, NcclType};

use super::{CudaError, CudaStream, CudaView, CudaViewMut};

/// Communicators over the local GPUs, rank `r` on `streams[r]`.
pub struct NcclGroup {
    comms: Vec<Comm>,
}

// SAFETY: an NCCL communicator may be used from any thread, just not from two at once (NCCL's
// thread-safety rules); `NcclGroup` is not `Sync`, so moving it (e.g. with the engine into its
// thread) hands all its communicators over together.
unsafe impl Send for NcclGroup {}

/// Whether NCCL loads. cudarc looks for `libnccl.so` (and `.so.1`, `.so.10`–`.so.13`), not
/// NCCL's soname `libnccl.so.2` alone: where only that is installed, a `libnccl.so` link to it
/// on `LD_LIBRARY_PATH` makes it load (`bench/gpu_check.sh` makes one; see `cuda/README.md`).
pub fn nccl_present() -> bool {
    // SAFETY: only tries to dlopen the library candidates (cudarc panics on a missing one).
    unsafe { cudarc::nccl::sys::is_culib_present() }
}

/// The file names NCCL goes by, in the order [`locate_nccl`] prefers them in a folder: the one
/// cudarc loads, then NCCL's soname.
pub const NCCL_FILE_NAMES: [&str; 2] = ["libnccl.so", "libnccl.so.2"];

/// The folders [`locate_nccl`] searches, in order: `LD_LIBRARY_PATH`'s (what the dynamic
/// loader searches first), the `nvidia/nccl/lib` of the active virtual environment's and the
/// system Pythons' site-packages (the `nvidia-nccl-cu13` wheel), then the system's library
/// folders (distribution packages, the CUDA toolkit).
pub fn nccl_search_dirs(
    ld_library_path: Option<&OsStr>,
    virtual_env: Option<&OsStr>,
) -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = ld_library_path
        .map(|p| {
            std::env::split_paths(p)
                .filter(|d| !d.as_os_str().is_empty())
                .collect()
        })
        .unwrap_or_default();
    let mut pythons: Vec<PathBuf> = virtual_env
        .map(|v| Path::new(v).join("lib"))
        .into_iter()
        .collect();
    pythons.extend(["/usr/local/lib", "/usr/lib"].map(PathBuf::from));
    for lib in pythons {
        let Ok(entries) = std::fs::read_dir(&lib) else {
            continue;
        };
        let mut versions: Vec<PathBuf> = entries
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().starts_with("python3"))
            .map(|e| e.path())
            .collect();
        versions.sort();
        dirs.extend(
            versions
                .iter()
                .flat_map(|v| ["site-packages", "dist-packages"].map(|s| v.join(s)))
                .map(|site| site.join("nvidia/nccl/lib"))
                .filter(|d| d.is_dir()),
        );
    }
    dirs.extend(
        [
            "/usr/lib/x86_64-linux-gnu",
            "/usr/lib64",
            "/usr/local/cuda/lib64",
            "/usr/local/nccl/lib",
        ]
        .map(PathBuf::from),
    );
    dirs
}

/// NCCL's library in the first of `dirs` that holds one (in each, [`NCCL_FILE_NAMES`] in
/// order).
pub fn locate_nccl(dirs: &[PathBuf]) -> Option<PathBuf> {
    dirs.iter()
        .flat_map(|d| NCCL_FILE_NAMES.map(|name| d.join(name)))
        .find(|p| p.is_file())
}

/// Why NCCL does not load, with the fix: not installed, or installed under the soname alone.
fn nccl_missing() -> CudaError {
    let dirs = nccl_search_dirs(
        std::env::var_os("LD_LIBRARY_PATH").as_deref(),
        std::env::var_os("VIRTUAL_ENV").as_deref(),
    );
    match locate_nccl(&dirs) {
        Some(found) => CudaError::NcclNameOnly { found },
        None => CudaError::MissingLibrary {
            library: "libnccl.so.2",
            purpose: "exchanges expert rows between GPUs (--expert-parallel-size)",
        },
    }
}

impl NcclGroup {
    pub fn new(streams: Vec<Arc<CudaStream>>) -> Result<Self, CudaError> {
        if !nccl_present() {
            return Err(nccl_missing());
        }
        let comms = Comm::from_devices(streams).map_err(|e| CudaError::Nccl(format!("{e:?}")))?;
        Ok(NcclGroup { comms })
    }

    pub fn world_size(&self) -> usize {
        self.comms.len()
    }

    /// Rank `r` sends `send_counts[r][p]` elements of `send[r]` to each peer `p` (contiguous, in
    /// peer order) and receives into `recv[r]`, in source order, the `send_counts[p][r]`
    /// elements each peer sends it. A rank that sends (receives) nothing passes `None`.
    pub fn all_to_all_v<T: NcclType>(
        &self,
        send: &[Option<CudaView<'_, T>>],
        send_counts: &[Vec<usize>],
        recv: &mut [Option<CudaViewMut<'_, T>>],
    ) -> Result<(), CudaError> {
        let n = self.comms.len();
        let shape_ok = send.len() == n
            && recv.len() == n
            && send_counts.len() == n
            && send_counts.iter().all(|c| c.len() == n);
        if !shape_ok {
            return Err(CudaError::InvalidArgument {
                op: "all_to_all_v",
                message: format!("{n} ranks need {n} send / recv buffers and {n}×{n} counts"),
            });
        }
        for r in 0..n {
            let (sent, received): (usize, usize) = (
                send_counts[r].iter().sum(),
                (0..n).map(|p| send_counts[p][r]).sum(),
            );
            let send_len = send[r].as_ref().map_or(0, |b| b.len());
            let recv_len = recv[r].as_ref().map_or(0, |b| b.len());
            if sent > send_len || received > recv_len {
                return Err(CudaError::InvalidArgument {
                    op: "all_to_all_v",
                    message: format!("rank {r} sends {sent} / receives {received} elements"),
                });
            }
        }
        let nccl = |e: cudarc::nccl::result::NcclError| CudaError::Nccl(format!("{e:?}"));
        cudarc::nccl::result::group_start().map_err(nccl)?;
        let issued = (|| {
            for (r, comm) in self.comms.iter().enumerate() {
                // Checked above: a rank with a count to send or receive has that buffer.
                if let Some(buf) = &send[r] {
                    let mut offset = 0;
                    for (p, count) in send_counts[r].iter().enumerate() {
                        if *count > 0 {
                            comm.send(&buf.slice(offset..offset + count), p as i32)?;
                        }
                        offset += count;
                    }
                }
                if let Some(buf) = recv[r].as_mut() {
                    let mut offset = 0;
                    for (p, counts) in send_counts.iter().enumerate() {
                        let count = counts[r];
                        if count > 0 {
                            comm.recv(&mut buf.slice_mut(offset..offset + count), p as i32)?;
                        }
                        offset += count;
                    }
                }
            }
            Ok(())
        })();
        // The group is closed whatever happened inside it.
        let closed = cudarc::nccl::result::group_end().map_err(nccl);
        issued.map_err(nccl)?;
        closed.map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_is_looked_up_in_the_loaders_order_and_by_cudarcs_name_first() {
        let root = std::env::temp_dir().join(format!("moeserve-nccl-{}", std::process::id()));
        let dir = |name: &str| {
            let d = root.join(name);
            std::fs::create_dir_all(&d).unwrap();
            d
        };
        let (ld, wheel, system) = (dir("ld"), dir("wheel"), dir("system"));
        let touch = |d: &Path, name: &str| std::fs::write(d.join(name), b"").unwrap();
        let dirs = vec![ld.clone(), wheel.clone(), system.clone()];
        assert_eq!(locate_nccl(&dirs), None);
        touch(&system, "libnccl.so");
        assert_eq!(locate_nccl(&dirs), Some(system.join("libnccl.so")));
        // An earlier folder wins, even with the soname alone.
        touch(&wheel, "libnccl.so.2");
        assert_eq!(locate_nccl(&dirs), Some(wheel.join("libnccl.so.2")));
        // In one folder, the name cudarc loads comes first.
        touch(&wheel, "libnccl.so");
        assert_eq!(locate_nccl(&dirs), Some(wheel.join("libnccl.so")));
        touch(&ld, "libnccl.so.2");
        assert_eq!(locate_nccl(&dirs), Some(ld.join("libnccl.so.2")));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn the_search_starts_with_ld_library_path_then_the_virtual_environment() {
        let venv = std::env::temp_dir().join(format!("moeserve-venv-{}", std::process::id()));
        let site = venv.join("lib/python3.12/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&site).unwrap();
        let ld = std::env::join_paths(["/opt/a", "", "/opt/b"]).unwrap();
        let dirs = nccl_search_dirs(Some(&ld), Some(venv.as_os_str()));
        assert_eq!(
            dirs[..2],
            [PathBuf::from("/opt/a"), PathBuf::from("/opt/b")]
        );
        let at = |p: &Path| dirs.iter().position(|d| d == p).unwrap();
        assert_eq!(at(&site), 2, "{dirs:?}");
        assert!(at(Path::new("/usr/lib/x86_64-linux-gnu")) > at(&site));
        assert!(dirs.ends_with(&[PathBuf::from("/usr/local/nccl/lib")]));
        std::fs::remove_dir_all(&venv).unwrap();
    }
}
