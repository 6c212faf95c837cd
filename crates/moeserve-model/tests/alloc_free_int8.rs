//! `--quantization int8` steps allocate nothing either (`alloc_free.rs`, whose note this
//! shares): the integer kernels quantize each product's activations into buffers reused
//! across steps. Its own process: the quantization is chosen once per process.

mod alloc_steps;
mod common;

use alloc_steps::steps_allocate_nothing;
use moeserve_core::alloc_count::CountingAllocator;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn int8_steps_in_a_warm_workspace_allocate_nothing() {
    if !common::run_int8() {
        return;
    }
    // The steps run on a pool thread, as in `alloc_free.rs`. Every family: each routes its
    // matrices (attention, dense and shared MLPs, experts, lm_head) through the int8 kernels.
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
