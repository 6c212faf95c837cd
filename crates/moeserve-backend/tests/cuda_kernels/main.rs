//! CUDA kernels against the scalar CPU reference: same inputs, one tolerance table per dtype
//! (NMSE for tensors, exact match for indices, as ggml's `test-backend-ops`). Split by op
//! family; each test runs for f32, f16 and bf16.
//!
//! They compile with `--features cuda` everywhere (CI) and run where a GPU is. Without one they
//! return early with a note, unless `MOESERVE_REQUIRE_GPU=1` (set by `bench/gpu_check.sh`), which
//! makes a missing GPU a failure, so the GPU run cannot pass vacuously.
#![cfg(feature = "cuda")]

mod attention;
mod common;
mod elementwise;
mod mla;
mod moe;
mod nccl;
mod sampling;
