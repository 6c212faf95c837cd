//! Expert parallelism's exchange between GPUs: all-to-all-v over NCCL grouped send / receive
//! (the dispatch and combine of the MoE core's `AllToAll`, see `cuda/README.md`).
//!
//! One process drives every local GPU (one communicator each, `Comm::from_devices`); all ranks'
//! sends and receives are issued inside one NCCL group, which a single thread driving several
//! GPUs needs so that no rank waits on a peer whose calls are not issued yet. `libnccl.so.2` is
//! loaded at run time; [`NcclGroup::new`] checks that it loads.

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

impl NcclGroup {
    pub fn new(streams: Vec<Arc<CudaStream>>) -> Result<Self, CudaError> {
        if !nccl_present() {
            return Err(CudaError::MissingLibrary {
                library: "libnccl.so.2",
                purpose: "exchanges expert rows between GPUs (--expert-parallel-size)",
            });
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
