//! Paged attention over block tables (prefill and decode tokens in one launch): grouped-query
//! attention, and multi-head latent attention over a cache of latent rows, on one kernel.

use cudarc::driver::DeviceRepr;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{ATTENTION_THREADS, ATTENTION_TILE, check, check_len, typed};
use crate::cuda::kernels::KernelFile;
use crate::cuda::{CudaBackend, CudaElement, CudaError, CudaView, CudaViewMut};

/// The shape of one layer's attention over the paged cache.
#[derive(Clone, Copy, Debug)]
pub struct AttentionShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
    pub sliding_window: Option<usize>,
}

/// `PagedAttentionParams` of paged_attention.cu, field for field.
#[repr(C)]
#[derive(Clone, Copy)]
struct PagedAttentionParams {
    num_heads: i32,
    num_kv_heads: i32,
    head_dim: i32,
    value_dim: i32,
    k_row: i32,
    v_row: i32,
    block_size: i32,
    max_blocks_per_seq: i32,
    sliding_window: i32,
    scale: f32,
}

// SAFETY: a `#[repr(C)]` struct of 4-byte scalars, the layout of the C struct it mirrors.
unsafe impl DeviceRepr for PagedAttentionParams {}

/// Attention of every step token over its sequence's cached keys (the step's own included).
pub struct PagedAttentionArgs<'a, T> {
    /// `[num_tokens, num_heads * head_dim]`
    pub out: CudaViewMut<'a, T>,
    pub q: CudaView<'a, T>,
    /// One layer: `[num_slots, num_kv_heads * head_dim]`.
    pub k_cache: CudaView<'a, T>,
    pub v_cache: CudaView<'a, T>,
    /// `[num_seqs, max_blocks_per_seq]`
    pub block_tables: CudaView<'a, i32>,
    /// `[num_tokens]`: the sequence (row of `block_tables`) of each token.
    pub token_seq: CudaView<'a, i32>,
    /// `[num_tokens]`
    pub positions: CudaView<'a, i32>,
    /// GPT-OSS's sink logit per head (`[num_heads]`): it joins the softmax's denominator.
    pub sinks: Option<CudaView<'a, f32>>,
    pub shape: AttentionShape,
}

pub fn paged_attention<T: CudaElement>(
    b: &CudaBackend,
    a: PagedAttentionArgs<'_, T>,
) -> Result<(), CudaError> {
    let s = a.shape;
    let n = a.positions.len();
    check(
        "paged_attention",
        s.num_kv_heads > 0 && s.num_heads.is_multiple_of(s.num_kv_heads),
        || {
            format!(
                "{} heads do not group over {} kv heads",
                s.num_heads, s.num_kv_heads
            )
        },
    )?;
    check(
        "paged_attention",
        s.head_dim <= 4 * ATTENTION_THREADS as usize,
        || format!("head_dim {} above {}", s.head_dim, 4 * ATTENTION_THREADS),
    )?;
    check_len(
        "paged_attention",
        "q",
        a.q.len(),
        n * s.num_heads * s.head_dim,
    )?;
    check_len(
        "paged_attention",
        "out",
        a.out.len(),
        n * s.num_heads * s.head_dim,
    )?;
    check_len("paged_attention", "token_seq", a.token_seq.len(), n)?;
    if let Some(sinks) = &a.sinks {
        check_len("paged_attention", "sinks", sinks.len(), s.num_heads)?;
    }
    check(
        "paged_attention",
        a.block_tables
            .len()
            .is_multiple_of(s.max_blocks_per_seq.max(1)),
        || "block_tables is not [num_seqs, max_blocks_per_seq]".into(),
    )?;
    let params = PagedAttentionParams {
        num_heads: s.num_heads as i32,
        num_kv_heads: s.num_kv_heads as i32,
        head_dim: s.head_dim as i32,
        value_dim: s.head_dim as i32,
        k_row: (s.num_kv_heads * s.head_dim) as i32,
        v_row: (s.num_kv_heads * s.head_dim) as i32,
        block_size: s.block_size as i32,
        max_blocks_per_seq: s.max_blocks_per_seq as i32,
        sliding_window: s.sliding_window.unwrap_or(0) as i32,
        scale: (s.head_dim as f32).powf(-0.5),
    };
    let tables = Tables {
        block_tables: a.block_tables,
        token_seq: a.token_seq,
        positions: a.positions,
    };
    launch(b, a.out, a.q, a.k_cache, a.v_cache, tables, a.sinks, params)
}

/// Multi-head latent attention (DeepSeek-V2/V3) of every step token over its sequence's cached
/// latent rows: each head's query in the latent space, `[num_heads, latent_dim]`, scores the
/// whole rows and sums their first `value_dim` (`kv_lora_rank`) elements.
pub struct LatentAttentionArgs<'a, T> {
    /// `[num_tokens, num_heads * value_dim]`
    pub out: CudaViewMut<'a, T>,
    /// `[num_tokens, num_heads * latent_dim]`
    pub q: CudaView<'a, T>,
    /// One layer: `[num_slots, latent_dim]`.
    pub cache: CudaView<'a, T>,
    pub block_tables: CudaView<'a, i32>,
    pub token_seq: CudaView<'a, i32>,
    pub positions: CudaView<'a, i32>,
    pub num_heads: usize,
    pub latent_dim: usize,
    pub value_dim: usize,
    pub block_size: usize,
    pub max_blocks_per_seq: usize,
    pub scale: f32,
}

pub fn latent_attention<T: CudaElement>(
    b: &CudaBackend,
    a: LatentAttentionArgs<'_, T>,
) -> Result<(), CudaError> {
    let n = a.positions.len();
    check(
        "latent_attention",
        a.value_dim <= a.latent_dim && a.value_dim <= 4 * ATTENTION_THREADS as usize,
        || {
            format!(
                "value_dim {} above latent_dim {} or {}",
                a.value_dim,
                a.latent_dim,
                4 * ATTENTION_THREADS
            )
        },
    )?;
    check_len(
        "latent_attention",
        "q",
        a.q.len(),
        n * a.num_heads * a.latent_dim,
    )?;
    check_len(
        "latent_attention",
        "out",
        a.out.len(),
        n * a.num_heads * a.value_dim,
    )?;
    check_len("latent_attention", "token_seq", a.token_seq.len(), n)?;
    check(
        "latent_attention",
        a.cache.len().is_multiple_of(a.latent_dim.max(1))
            && a.block_tables
                .len()
                .is_multiple_of(a.max_blocks_per_seq.max(1)),
        || "cache is not [num_slots, latent_dim] or block_tables not [num_seqs, max_blocks]".into(),
    )?;
    let params = PagedAttentionParams {
        num_heads: a.num_heads as i32,
        num_kv_heads: 1,
        head_dim: a.latent_dim as i32,
        value_dim: a.value_dim as i32,
        k_row: a.latent_dim as i32,
        v_row: a.latent_dim as i32,
        block_size: a.block_size as i32,
        max_blocks_per_seq: a.max_blocks_per_seq as i32,
        sliding_window: 0,
        scale: a.scale,
    };
    let tables = Tables {
        block_tables: a.block_tables,
        token_seq: a.token_seq,
        positions: a.positions,
    };
    // Keys and values are the same rows: two views of the one cache.
    let (keys, values) = (a.cache.slice(..), a.cache.slice(..));
    launch(b, a.out, a.q, keys, values, tables, None, params)
}

/// Where each step token's keys are: its sequence's block table and its position.
struct Tables<'a> {
    block_tables: CudaView<'a, i32>,
    token_seq: CudaView<'a, i32>,
    positions: CudaView<'a, i32>,
}

#[allow(clippy::too_many_arguments)] // The kernel's own argument list.
fn launch<T: CudaElement>(
    b: &CudaBackend,
    mut out: CudaViewMut<'_, T>,
    q: CudaView<'_, T>,
    k_cache: CudaView<'_, T>,
    v_cache: CudaView<'_, T>,
    tables: Tables<'_>,
    sinks: Option<CudaView<'_, f32>>,
    params: PagedAttentionParams,
) -> Result<(), CudaError> {
    let n = tables.positions.len();
    if n == 0 {
        return Ok(());
    }
    let f = typed(b, KernelFile::PagedAttention, "paged_attention", T::SUFFIX)?;
    let cfg = LaunchConfig {
        grid_dim: (n as u32, params.num_heads as u32, 1),
        block_dim: (ATTENTION_THREADS, 1, 1),
        shared_mem_bytes: (params.head_dim as u32 + ATTENTION_TILE + 32) * 4,
    };
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut out)
        .arg(&q)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&tables.block_tables);
    let null = 0u64;
    l.arg(&tables.token_seq).arg(&tables.positions);
    match &sinks {
        Some(sinks) => l.arg(sinks),
        None => l.arg(&null),
    };
    l.arg(&params);
    // SAFETY: lengths checked by the callers; block tables and positions come from the KV
    // manager.
    unsafe { l.launch(cfg) }?;
    Ok(())
}
