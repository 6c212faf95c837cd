//! Launch wrappers, one per kernel of `cuda/`: they check buffer lengths (a kernel reads what it
//! is told to), pick the launch shape the kernel's comment asks for and queue it on the
//! backend's stream. Index inputs (token ids, slots, block tables) are trusted: the model checks
//! them on the host before upload, as it does for the CPU path.

use cudarc::driver::LaunchConfig;

mod attention;
mod elementwise;
mod mla;
mod moe;
mod rows;
mod sampling;

pub use attention::{
    AttentionShape, AttentionTiles, LatentAttentionArgs, MAX_ROWS, PARTITION_KEYS,
    PagedAttentionArgs, Split, attention_tiles, latent_attention, paged_attention, rows_per_block,
};
pub use elementwise::{
    add_bias, add_gated, add_segment_bias, clamp, rms_norm_row_prefixes, rms_norm_rows,
};
pub use mla::{LatentRopeArgs, LatentShape, mla_copy_rope, mla_rope, write_latent};
pub use moe::{
    DeviceRouting, ExpertTable, MOE_GEMM_ROWS, RouteArgs, RouterGroups, RouterScores,
    moe_grouped_gemm, moe_permute, moe_segment_offsets, moe_unpermute, route_top_k,
    router_kernel_takes,
};
pub use rows::{
    EmbeddingArgs, GatherRowsArgs, RmsNormArgs, RopeArgs, WriteKvArgs, embedding, fill_uniform,
    gated_activation, gather_rows, rms_norm_residual, rope, silu_mul, write_kv,
};
pub use sampling::argmax_logprob;

use super::kernels::KernelFile;
use super::{CudaBackend, CudaError};

/// Threads of the row-wise kernels (a multiple of 32).
pub(super) const ROW_THREADS: u32 = 256;
/// Warps per block of the router (one token per warp).
pub(super) const ROUTER_WARPS: u32 = 4;
/// Threads of the attention kernel; `head_dim` may be up to 4× this (see paged_attention.cu).
pub(super) const ATTENTION_THREADS: u32 = 128;
/// Limits compiled into moe_router.cu.
pub(super) const MAX_EXPERTS: usize = 256;
pub(super) const MAX_TOP_K: usize = 8;
pub(super) const MAX_ROUTER_GROUPS: usize = 32;

pub(super) fn per_row(rows: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (rows as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

pub(super) fn check_len(
    op: &'static str,
    what: &str,
    got: usize,
    expected: usize,
) -> Result<(), CudaError> {
    if got == expected {
        Ok(())
    } else {
        Err(CudaError::length(op, what, expected, got))
    }
}

pub(super) fn check(
    op: &'static str,
    ok: bool,
    message: impl FnOnce() -> String,
) -> Result<(), CudaError> {
    if ok {
        Ok(())
    } else {
        Err(CudaError::InvalidArgument {
            op,
            message: message(),
        })
    }
}

/// `{name}_{f32|f16|bf16}` of `file`, for one launch.
pub(super) fn typed(
    b: &CudaBackend,
    file: KernelFile,
    name: &'static str,
    suffix: &'static str,
) -> Result<cudarc::driver::CudaFunction, CudaError> {
    b.kernel(file, name, suffix)
}

/// The single-instantiation kernel `name` of `file`, for one launch.
pub(super) fn untyped(
    b: &CudaBackend,
    file: KernelFile,
    name: &'static str,
) -> Result<cudarc::driver::CudaFunction, CudaError> {
    b.kernel(file, name, "")
}
