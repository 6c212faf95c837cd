//! `--quantization int8` steps allocate nothing either (`alloc_free.rs`, whose note this
//! shares): the integer kernels quantize each product's activations into buffers reused
//! across steps. Its own process: the quantization is chosen once per process.

mod alloc_steps;
mod common;

use alloc_steps::every_family_allocates_nothing;
use moeserve_core::alloc_count::CountingAllocator;

#[global_allocator]
static GLOBAL: CountingAllocator = CountingAllocator;

#[test]
fn int8_steps_in_a_warm_workspace_allocate_nothing() {
    // Every family routes its matrices (attention, dense and shared MLPs, experts, lm_head)
    // through the int8 kernels.
    if common::run_int8() {
        every_family_allocates_nothing();
    }
}
