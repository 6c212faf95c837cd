//! What a backend has queued and waited for: kernel launches, cuBLAS calls, copies each way,
//! device allocations and host synchronisations. The model's step plan (`StepPlan` in
//! moeserve-model) says what a step should cost; the GPU tests compare it with these counts.

use std::ops::Sub;
use std::sync::atomic::{AtomicU64, Ordering};

/// Counts of work a backend queued (a snapshot; subtract two to get one step's).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WorkCounts {
    /// Kernels of `cuda/` launched.
    pub kernels: u64,
    /// cuBLAS GEMM calls (a strided batched call counts once).
    pub gemms: u64,
    /// Memsets queued on the stream.
    pub memsets: u64,
    /// Host → device copies.
    pub htod: u64,
    /// Device → host copies.
    pub dtoh: u64,
    /// Device → device copies.
    pub dtod: u64,
    /// Device allocations.
    pub allocations: u64,
    /// Times the host waited for the stream.
    pub syncs: u64,
}

impl WorkCounts {
    /// Everything queued on the stream (what a CUDA graph would capture).
    pub fn launches(&self) -> u64 {
        self.kernels + self.gemms + self.memsets + self.htod + self.dtoh + self.dtod
    }
}

impl Sub for WorkCounts {
    type Output = WorkCounts;
    fn sub(self, o: WorkCounts) -> WorkCounts {
        WorkCounts {
            kernels: self.kernels - o.kernels,
            gemms: self.gemms - o.gemms,
            memsets: self.memsets - o.memsets,
            htod: self.htod - o.htod,
            dtoh: self.dtoh - o.dtoh,
            dtod: self.dtod - o.dtod,
            allocations: self.allocations - o.allocations,
            syncs: self.syncs - o.syncs,
        }
    }
}

/// One kind of work, as [`Tally::add`] counts it.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Work {
    Kernel,
    Gemm,
    Memset,
    HtoD,
    DtoH,
    DtoD,
    Allocation,
    Sync,
}

/// The backend's running counts (relaxed atomics: one stream, read between steps).
#[derive(Default)]
pub(crate) struct Tally([AtomicU64; 8]);

impl Tally {
    pub(crate) fn add(&self, work: Work) {
        self.0[work as usize].fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> WorkCounts {
        let v = |w: Work| self.0[w as usize].load(Ordering::Relaxed);
        WorkCounts {
            kernels: v(Work::Kernel),
            gemms: v(Work::Gemm),
            memsets: v(Work::Memset),
            htod: v(Work::HtoD),
            dtoh: v(Work::DtoH),
            dtod: v(Work::DtoD),
            allocations: v(Work::Allocation),
            syncs: v(Work::Sync),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_kind_of_work_counts_in_its_own_field() {
        let t = Tally::default();
        let before = t.snapshot();
        for w in [
            Work::Kernel,
            Work::Kernel,
            Work::Gemm,
            Work::Memset,
            Work::HtoD,
            Work::DtoH,
            Work::DtoD,
            Work::Allocation,
            Work::Sync,
        ] {
            t.add(w);
        }
        let d = t.snapshot() - before;
        assert_eq!(
            d,
            WorkCounts {
                kernels: 2,
                gemms: 1,
                memsets: 1,
                htod: 1,
                dtoh: 1,
                dtod: 1,
                allocations: 1,
                syncs: 1,
            }
        );
        assert_eq!(d.launches(), 7);
    }
}
