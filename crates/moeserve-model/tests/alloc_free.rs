//! A forward step allocates nothing on the heap once its workspace has seen a step as large
//! and the kernel threads' task buffers are reserved (the CPU-performance issue: "no heap
//! allocation inside the step loop"). `CountingAllocator` counts every allocation of any
//! thread (the kernels run on the pool's threads) while the measured steps run; this binary
//! holds one test so no other test's threads allocate meanwhile. `MOESERVE_ALLOC_TRACE=1`
//! prints a backtrace of each counted allocation, to find the one that crept in.

mod alloc_steps;
mod common;

use alloc_steps::every_family_allocates_nothing;
use moeserve_core::alloc_count::CountingAllocator;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn steps_in_a_warm_workspace_allocate_nothing() {
    every_family_allocates_nothing();
}
