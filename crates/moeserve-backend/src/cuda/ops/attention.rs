//! Paged attention over block tables (prefill and decode tokens in one launch): grouped-query
//! attention, and multi-head latent attention over a cache of latent rows, on one kernel. A
//! block computes the query heads of one KV group for a tile of a sequence's tokens
//! ([`rows_per_block`], [`attention_tiles`]), so each cached row is read once per group and
//! tile; long contexts are split over blocks ([`Split`]) and combined by a second kernel.

use cudarc::driver::DeviceRepr;
use cudarc::driver::{LaunchConfig, PushKernelArg};

use super::{ATTENTION_THREADS, check, check_len, typed};
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
    heads_per_block: i32,
    num_partitions: i32,
    partition_len: i32,
}

/// Query rows a block computes (`MAX_ROWS` of paged_attention.cu).
pub const MAX_ROWS: usize = 8;
/// Keys per tile of the kernel (`TILE`), and the widest key it holds in shared memory.
const TILE: usize = 64;
const MAX_HEAD_DIM: usize = 1024;
/// Keys per partition a long context is split into (vLLM's v2 uses 512).
pub const PARTITION_KEYS: usize = 512;
/// Steps of more tokens than this do not split (their blocks fill the GPU already).
const MAX_SPLIT_TOKENS: usize = 512;

/// `(heads_per_block, tokens_per_tile)` for `num_heads` query heads over `num_kv_heads`: a
/// block takes up to [`MAX_ROWS`] heads of one KV group, and as many tokens of a sequence as
/// leave its rows filled (decode tokens are tiles of one).
pub fn rows_per_block(num_heads: usize, num_kv_heads: usize) -> (usize, usize) {
    let group = (num_heads / num_kv_heads.max(1)).max(1);
    let heads = group.min(MAX_ROWS);
    (heads, (MAX_ROWS / heads).max(1))
}

/// The kernel's token tiles, `[(first token, count)]` flattened: runs of up to
/// `tokens_per_tile` consecutive step tokens of one sequence (`token_seq` in step order, each
/// sequence's tokens contiguous).
pub fn attention_tiles(token_seq: &[i32], tokens_per_tile: usize) -> Vec<i32> {
    let mut tiles = Vec::with_capacity(2 * token_seq.len());
    let mut t = 0;
    while t < token_seq.len() {
        let mut end = t + 1;
        while end < token_seq.len() && end - t < tokens_per_tile && token_seq[end] == token_seq[t] {
            end += 1;
        }
        tiles.extend([t as i32, (end - t) as i32]);
        t = end;
    }
    tiles
}

/// How a step's attention splits its keys: `partitions` blocks per row, `len` keys each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Split {
    pub partitions: usize,
    pub len: usize,
}

impl Split {
    /// The split for `num_tokens` tokens of `num_heads` heads whose longest context is
    /// `max_context`, with room for `partial_floats` floats of partial results: one partition
    /// per [`PARTITION_KEYS`] keys while they fit, none for short contexts or large steps.
    pub fn for_step(
        num_tokens: usize,
        num_heads: usize,
        value_dim: usize,
        max_context: usize,
        partial_floats: usize,
    ) -> Split {
        let per_partition = (num_tokens * num_heads * (value_dim + 2)).max(1);
        let wanted = max_context.div_ceil(PARTITION_KEYS);
        let partitions = match num_tokens <= MAX_SPLIT_TOKENS {
            true => wanted.min(partial_floats / per_partition).max(1),
            false => 1,
        };
        let len = max_context.div_ceil(partitions).div_ceil(TILE).max(1) * TILE;
        Split { partitions, len }
    }

    /// Floats of partial results the split writes.
    pub fn partial_floats(&self, num_tokens: usize, num_heads: usize, value_dim: usize) -> usize {
        match self.partitions {
            1 => 0,
            p => num_tokens * num_heads * p * (value_dim + 2),
        }
    }
}

/// Where each step token's keys are, and how the kernel walks them.
pub struct AttentionTiles<'a> {
    /// `[num_seqs, max_blocks_per_seq]`
    pub block_tables: CudaView<'a, i32>,
    /// `[num_tokens]`: the sequence (row of `block_tables`) of each token.
    pub token_seq: CudaView<'a, i32>,
    /// `[num_tokens]`
    pub positions: CudaView<'a, i32>,
    /// [`attention_tiles`] for this attention's [`rows_per_block`].
    pub tiles: CudaView<'a, i32>,
    pub split: Split,
    /// Room for the split's partial results (`Split::partial_floats`; unused without one).
    pub partials: CudaViewMut<'a, f32>,
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
    /// Block tables, positions, tiles and split.
    pub at: AttentionTiles<'a>,
    /// GPT-OSS's sink logit per head (`[num_heads]`): it joins the softmax's denominator.
    pub sinks: Option<CudaView<'a, f32>>,
    pub shape: AttentionShape,
}

pub fn paged_attention<T: CudaElement>(
    b: &CudaBackend,
    a: PagedAttentionArgs<'_, T>,
) -> Result<(), CudaError> {
    let s = a.shape;
    let n = a.at.positions.len();
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
    if let Some(sinks) = &a.sinks {
        check_len("paged_attention", "sinks", sinks.len(), s.num_heads)?;
    }
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
        heads_per_block: rows_per_block(s.num_heads, s.num_kv_heads).0 as i32,
        num_partitions: a.at.split.partitions as i32,
        partition_len: a.at.split.len as i32,
    };
    check_tiles("paged_attention", &a.at, s.max_blocks_per_seq, &params)?;
    launch(b, a.out, a.q, a.k_cache, a.v_cache, a.at, a.sinks, params)
}

/// The lengths the kernel indexes by, and room for the split's partials.
fn check_tiles(
    op: &'static str,
    at: &AttentionTiles<'_>,
    max_blocks_per_seq: usize,
    p: &PagedAttentionParams,
) -> Result<(), CudaError> {
    let n = at.positions.len();
    check_len(op, "token_seq", at.token_seq.len(), n)?;
    check(
        op,
        at.block_tables
            .len()
            .is_multiple_of(max_blocks_per_seq.max(1)),
        || "block_tables is not [num_seqs, max_blocks_per_seq]".into(),
    )?;
    check(
        op,
        at.tiles.len().is_multiple_of(2) && at.tiles.len() <= 2 * n,
        || format!("{} tile entries for {n} tokens", at.tiles.len()),
    )?;
    check(op, (p.head_dim as usize) <= MAX_HEAD_DIM, || {
        format!("key width {} above {MAX_HEAD_DIM}", p.head_dim)
    })?;
    let needed = at
        .split
        .partial_floats(n, p.num_heads as usize, p.value_dim as usize);
    check(op, at.partials.len() >= needed, || {
        format!(
            "{} partial floats for a split needing {needed}",
            at.partials.len()
        )
    })
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
    /// Block tables, positions, tiles (for [`rows_per_block`]`(num_heads, 1)`) and split.
    pub at: AttentionTiles<'a>,
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
    let n = a.at.positions.len();
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
    check(
        "latent_attention",
        a.cache.len().is_multiple_of(a.latent_dim.max(1)),
        || "cache is not [num_slots, latent_dim]".into(),
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
        heads_per_block: rows_per_block(a.num_heads, 1).0 as i32,
        num_partitions: a.at.split.partitions as i32,
        partition_len: a.at.split.len as i32,
    };
    check_tiles("latent_attention", &a.at, a.max_blocks_per_seq, &params)?;
    // Keys and values are the same rows: two views of the one cache.
    let (keys, values) = (a.cache.slice(..), a.cache.slice(..));
    launch(b, a.out, a.q, keys, values, a.at, None, params)
}

#[allow(clippy::too_many_arguments)] // The kernel's own argument list.
fn launch<T: CudaElement>(
    b: &CudaBackend,
    mut out: CudaViewMut<'_, T>,
    q: CudaView<'_, T>,
    k_cache: CudaView<'_, T>,
    v_cache: CudaView<'_, T>,
    mut at: AttentionTiles<'_>,
    sinks: Option<CudaView<'_, f32>>,
    params: PagedAttentionParams,
) -> Result<(), CudaError> {
    let n = at.positions.len();
    let num_tiles = at.tiles.len() / 2;
    if n == 0 || num_tiles == 0 {
        return Ok(());
    }
    let (group, heads) = (
        (params.num_heads / params.num_kv_heads) as u32,
        params.heads_per_block as u32,
    );
    let blocks_per_kv_head = group.div_ceil(heads);
    let cfg = LaunchConfig {
        grid_dim: (
            num_tiles as u32,
            params.num_kv_heads as u32 * blocks_per_kv_head,
            params.num_partitions as u32,
        ),
        block_dim: (ATTENTION_THREADS, 1, 1),
        shared_mem_bytes: ((MAX_ROWS * (params.head_dim as usize + TILE) + 3 * MAX_ROWS) * 4)
            as u32,
    };
    let null = 0u64;
    let f = typed(b, KernelFile::PagedAttention, "paged_attention", T::SUFFIX)?;
    let mut l = b.stream().launch_builder(&f);
    l.arg(&mut out)
        .arg(&mut at.partials)
        .arg(&q)
        .arg(&k_cache)
        .arg(&v_cache)
        .arg(&at.block_tables)
        .arg(&at.token_seq)
        .arg(&at.positions)
        .arg(&at.tiles);
    match &sinks {
        Some(sinks) => l.arg(sinks),
        None => l.arg(&null),
    };
    l.arg(&params);
    // SAFETY: lengths checked by the callers (`check_tiles`); block tables, positions and
    // tiles come from the host's step layout.
    unsafe { l.launch(cfg) }?;
    if params.num_partitions > 1 {
        let f = typed(
            b,
            KernelFile::PagedAttention,
            "paged_attention_reduce",
            T::SUFFIX,
        )?;
        let (num_heads, parts, dv) = (params.num_heads, params.num_partitions, params.value_dim);
        let mut l = b.stream().launch_builder(&f);
        l.arg(&mut out).arg(&mut at.partials);
        match &sinks {
            Some(sinks) => l.arg(sinks),
            None => l.arg(&null),
        };
        l.arg(&num_heads).arg(&parts).arg(&dv);
        let cfg = LaunchConfig {
            grid_dim: (n as u32, params.num_heads as u32, 1),
            block_dim: (ATTENTION_THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: the partials were written by the launch above for every (token, head,
        // partition); `out` is [n, num_heads, value_dim] (checked by the callers).
        unsafe { l.launch(cfg) }?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_block_takes_a_kv_groups_heads_and_as_many_tokens_as_fit() {
        // Mixtral (32 over 8): 4 heads, 2 tokens; Qwen3 (32 over 4): 8 heads; MHA: 8 tokens;
        // MLA (one latent head for 128): 8 of the 128 heads per block.
        assert_eq!(rows_per_block(32, 8), (4, 2));
        assert_eq!(rows_per_block(32, 4), (8, 1));
        assert_eq!(rows_per_block(16, 16), (1, 8));
        assert_eq!(rows_per_block(128, 1), (8, 1));
    }

    #[test]
    fn tiles_are_runs_of_one_sequence() {
        // A decode token (sequence 0), a 5-token prefill (1), a decode (2), two tokens (3).
        let seqs = [0, 1, 1, 1, 1, 1, 2, 3, 3];
        assert_eq!(
            attention_tiles(&seqs, 2),
            [0, 1, 1, 2, 3, 2, 5, 1, 6, 1, 7, 2]
        );
        assert_eq!(attention_tiles(&seqs, 1).len(), 2 * seqs.len());
        assert!(attention_tiles(&[], 4).is_empty());
    }

    #[test]
    fn long_contexts_split_while_the_partials_fit() {
        let room = 1 << 24;
        // Short contexts and large steps do not split.
        assert_eq!(Split::for_step(1, 32, 128, 255, room).partitions, 1);
        assert_eq!(Split::for_step(4096, 32, 128, 16384, room).partitions, 1);
        // 16 384 keys in 32 partitions of 512 for a batch of 64.
        let s = Split::for_step(64, 32, 128, 16384, room);
        assert_eq!(
            s,
            Split {
                partitions: 32,
                len: 512
            }
        );
        assert!(s.partial_floats(64, 32, 128) <= room);
        // Every key is in some partition, and partitions are whole tiles.
        for (tokens, ctx) in [(1, 4097), (8, 300), (64, 16384), (512, 100_000)] {
            let s = Split::for_step(tokens, 32, 128, ctx, room);
            assert!(s.partitions * s.len >= ctx, "{tokens} {ctx}: {s:?}");
            assert_eq!(s.len % TILE, 0);
            assert!(s.partial_floats(tokens, 32, 128) <= room, "{s:?}");
        }
        // Too little room: fewer partitions.
        let small = Split::for_step(64, 32, 128, 16384, 64 * 32 * 130 * 4);
        assert_eq!(small.partitions, 4);
    }
}
