//! A forward step allocates nothing on the heap once its workspace has seen a step as large
//! and the kernel threads' task buffers are reserved (the CPU-performance issue: "no heap
//! allocation inside the step loop"). `CountingAllocator` counts every allocation of any
//! thread (the kernels run on the pool's threads) while the measured steps run; this binary
//! holds one test so no other test's threads allocate meanwhile. `MOESERVE_ALLOC_TRACE=1`
//! prints a backtrace of each counted allocation, to find the one that crept in.

mod alloc_steps;
mod common;

use alloc_steps::steps_allocate_nothing;
use moeserve_core::alloc_count::CountingAllocator;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn steps_in_a_warm_workspace_allocate_nothing() {
    // One model per family option: plain GQA, q/k norms per head with a dense layer, q/k/v
    // biases with a shared expert, flat q/k norms with clipping, fused expert tensors, the
    // sigmoid router with groups and partial rotary.
    // The steps run on a pool thread: a forward started from outside the pool injects one job
    // into rayon's queue, whose lock-free blocks (crossbeam's `Injector`) are allocated every 63
    // jobs — rayon's amortised cost, not the forward's, which 40 steps of these models would hit.
    let pool = rayon::ThreadPoolBuilder::new().build().unwrap();
    for case in [
        "mixtral-gqa",
        "qwen3-moe",
        "qwen2-moe",
        "olmoe",
        "qwen3-moe-fused",
        "glm4-moe",
        "deepseek-v2",
        "deepseek-v3",
    ] {
        pool.install(|| steps_allocate_nothing(case));
    }
}
