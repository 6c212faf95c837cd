//! Paged attention over block tables, prefill and decode tokens in one step, against a scalar
//! reference written as the CPU attention (`moeserve-model` `layers/attention.rs`) computes it,
//! GPT-OSS's sink logits included; contexts of 1 to 16 384 tokens, split over blocks and not.

use moeserve_backend::cpu;
use moeserve_backend::cuda::CudaElement;
use moeserve_backend::cuda::ops::{
    self, AttentionShape, AttentionTiles, PagedAttentionArgs, Split, attention_tiles,
    rows_per_block,
};
use moeserve_backend::cuda::{CudaBackend, CudaSlice};

use crate::common::*;
use crate::for_each_dtype;

/// One step's query tokens over a filled cache.
struct Case {
    shape: AttentionShape,
    num_blocks: usize,
    /// Per sequence: its block ids (a row of the block table).
    tables: Vec<Vec<i32>>,
    /// Per step token: (sequence, position).
    tokens: Vec<(usize, usize)>,
    /// A sink logit per head (GPT-OSS), in the softmax's denominator.
    sinks: Option<Vec<f32>>,
}

fn case(head_dim: usize, sliding_window: Option<usize>) -> Case {
    // Three sequences of 300, 40 and 5 tokens on shuffled blocks (300 needs 19 blocks, spanning
    // five key tiles of 64). Sequence 0 decodes its last token; 1 prefills its last 6; 2
    // prefills all 5.
    let mut tokens = vec![(0, 299)];
    tokens.extend((34..40).map(|p| (1, p)));
    tokens.extend((0..5).map(|p| (2, p)));
    case_of(&[300, 40, 5], tokens, head_dim, sliding_window)
}

/// Sequences of `lengths` on shuffled blocks of 16, with these step `tokens`.
fn case_of(
    lengths: &[usize],
    tokens: Vec<(usize, usize)>,
    head_dim: usize,
    sliding_window: Option<usize>,
) -> Case {
    let block_size = 16;
    let max_blocks = lengths.iter().max().unwrap().div_ceil(block_size);
    let num_blocks = lengths
        .iter()
        .map(|l| l.div_ceil(block_size))
        .sum::<usize>()
        + 3;
    let mut free: Vec<i32> = (1..num_blocks as i32).rev().collect();
    let order = random(free.len(), 99, 1.0);
    let mut idx: Vec<usize> = (0..free.len()).collect();
    idx.sort_by(|a, b| order[*a].total_cmp(&order[*b]));
    free = idx.iter().map(|i| free[*i]).collect();
    let tables = lengths
        .iter()
        .map(|l| {
            let mut row: Vec<i32> = (0..l.div_ceil(block_size))
                .map(|_| free.pop().unwrap())
                .collect();
            row.resize(max_blocks, 0);
            row
        })
        .collect();
    Case {
        shape: AttentionShape {
            num_heads: 8,
            num_kv_heads: 2,
            head_dim,
            block_size,
            max_blocks_per_seq: max_blocks,
            sliding_window,
        },
        num_blocks,
        tables,
        tokens,
        sinks: None,
    }
}

fn reference(c: &Case, q: &[f32], k_cache: &[f32], v_cache: &[f32]) -> Vec<f32> {
    let s = c.shape;
    let (d, group, kv_dim) = (
        s.head_dim,
        s.num_heads / s.num_kv_heads,
        s.num_kv_heads * s.head_dim,
    );
    let scale = (d as f32).powf(-0.5);
    let mut out = vec![0.0; c.tokens.len() * s.num_heads * d];
    for (t, (seq, pos)) in c.tokens.iter().enumerate() {
        let first = s.sliding_window.map_or(0, |w| (pos + 1).saturating_sub(w));
        let slots: Vec<usize> = (first..=*pos)
            .map(|p| c.tables[*seq][p / s.block_size] as usize * s.block_size + p % s.block_size)
            .collect();
        for h in 0..s.num_heads {
            let kvh = h / group;
            let qh = &q[(t * s.num_heads + h) * d..][..d];
            let mut scores: Vec<f32> = slots
                .iter()
                .map(|slot| {
                    let kh = &k_cache[slot * kv_dim + kvh * d..][..d];
                    qh.iter().zip(kh).map(|(a, b)| a * b).sum::<f32>() * scale
                })
                .collect();
            // The sink joins the softmax as one more score whose value is never read.
            if let Some(sinks) = &c.sinks {
                scores.push(sinks[h]);
            }
            cpu::softmax_in_place(&mut scores);
            let oh = &mut out[(t * s.num_heads + h) * d..][..d];
            for (p, slot) in scores.iter().zip(&slots) {
                let vh = &v_cache[slot * kv_dim + kvh * d..][..d];
                oh.iter_mut().zip(vh).for_each(|(o, v)| *o += p * v);
            }
        }
    }
    out
}

/// `c`'s block tables, token sequences and positions on the device, and the attention kernel's
/// tiles and split for its tokens over `heads` query and `kv_heads` key heads, with `room`
/// floats for the split's partials (0: no split).
struct Layout {
    tables: CudaSlice<i32>,
    token_seq: CudaSlice<i32>,
    positions: CudaSlice<i32>,
    tiles: CudaSlice<i32>,
    split: Split,
    partials: CudaSlice<f32>,
}

impl Layout {
    fn at(&mut self) -> AttentionTiles<'_> {
        AttentionTiles {
            block_tables: self.tables.as_view(),
            token_seq: self.token_seq.as_view(),
            positions: self.positions.as_view(),
            tiles: self.tiles.as_view(),
            split: self.split,
            partials: self.partials.as_view_mut(),
        }
    }
}

fn layout(
    gpu: &CudaBackend,
    c: &Case,
    heads: usize,
    kv_heads: usize,
    dv: usize,
    room: usize,
) -> Layout {
    let token_seq: Vec<i32> = c.tokens.iter().map(|(s, _)| *s as i32).collect();
    let positions: Vec<i32> = c.tokens.iter().map(|(_, p)| *p as i32).collect();
    let (_, tokens_per_tile) = rows_per_block(heads, kv_heads);
    let tiles = attention_tiles(&token_seq, tokens_per_tile);
    let context = c.tokens.iter().map(|(_, p)| p + 1).max().unwrap();
    let split = Split::for_step(c.tokens.len(), heads, dv, context, room);
    let partials = split.partial_floats(c.tokens.len(), heads, dv).max(1);
    Layout {
        tables: gpu.upload(&c.tables.concat()).unwrap(),
        token_seq: gpu.upload(&token_seq).unwrap(),
        positions: gpu.upload(&positions).unwrap(),
        tiles: gpu.upload(&tiles).unwrap(),
        split,
        partials: gpu.zeros(partials).unwrap(),
    }
}

/// Room for any split these tests make.
const ROOM: usize = 1 << 24;

fn run<T: CudaElement>(c: &Case) {
    run_with::<T>(c, ROOM);
}

fn run_with<T: CudaElement>(c: &Case, room: usize) {
    let Some(gpu) = gpu() else { return };
    let s = c.shape;
    let kv_len = c.num_blocks * s.block_size * s.num_kv_heads * s.head_dim;
    let n = c.tokens.len();
    let (q, q_f32) = rounded::<T>(&random(n * s.num_heads * s.head_dim, 20, 1.0));
    let (k, k_f32) = rounded::<T>(&random(kv_len, 21, 1.0));
    let (v, v_f32) = rounded::<T>(&random(kv_len, 22, 1.0));
    let (q_d, k_d, v_d) = (upload(gpu, &q), upload(gpu, &k), upload(gpu, &v));
    let sinks_d = c.sinks.as_ref().map(|s| gpu.upload(s).unwrap());
    let mut l = layout(gpu, c, s.num_heads, s.num_kv_heads, s.head_dim, room);
    let mut out = gpu.zeros::<T>(n * s.num_heads * s.head_dim).unwrap();
    ops::paged_attention(
        gpu,
        PagedAttentionArgs {
            out: out.as_view_mut(),
            q: q_d.as_view(),
            k_cache: k_d.as_view(),
            v_cache: v_d.as_view(),
            at: l.at(),
            sinks: sinks_d.as_ref().map(|s| s.as_view()),
            shape: s,
        },
    )
    .unwrap();
    let want = reference(c, &q_f32, &k_f32, &v_f32);
    let op = format!(
        "paged_attention d={} window={:?} sinks={} split {:?}",
        s.head_dim,
        s.sliding_window,
        c.sinks.is_some(),
        l.split
    );
    assert_close(
        &op,
        T::DTYPE,
        &download_f32(gpu, &out),
        &want,
        chained_tolerance(T::DTYPE),
    );
}

fn paged_attention_matches_the_reference<T: CudaElement>() {
    run::<T>(&case(128, None));
}
for_each_dtype!(
    paged_attention_matches_the_reference,
    paged_attention_matches_the_reference
);

fn paged_attention_with_a_sliding_window_and_odd_head_dim<T: CudaElement>() {
    // head_dim 160 gives threads two output dims each; a window of 100 cuts into the tiles.
    run::<T>(&case(160, Some(100)));
}
for_each_dtype!(
    paged_attention_with_a_sliding_window_and_odd_head_dim,
    paged_attention_with_a_sliding_window_and_odd_head_dim
);

fn paged_attention_with_sinks_and_a_window<T: CudaElement>() {
    // GPT-OSS's head_dim; sinks from well below to well above the scores (the largest one takes
    // most of the softmax), under a window of 128 as the release's sliding layers.
    let mut c = case(64, Some(128));
    let mut sinks = random(c.shape.num_heads, 23, 3.0);
    sinks[0] = 12.0;
    sinks[1] = -12.0;
    c.sinks = Some(sinks);
    run::<T>(&c);
}
for_each_dtype!(
    paged_attention_with_sinks_and_a_window,
    paged_attention_with_sinks_and_a_window
);

/// Contexts of 1, 255, 256, 4 097 and 16 384 tokens (tile and partition edges, and a long
/// decode), each with a short prefill of another sequence in the same step, split over blocks
/// and not; Mixtral's grouping (4 query heads per KV head) and a window on the longest.
fn paged_attention_at_every_context_length<T: CudaElement>() {
    for context in [1usize, 255, 256, 4097, 16384] {
        let mut tokens = vec![(0, context - 1)];
        tokens.extend((17..20).map(|p| (1, p)));
        let mut c = case_of(&[context, 20], tokens, 128, None);
        c.shape.num_heads = 16;
        c.shape.num_kv_heads = 4;
        for room in [ROOM, 0] {
            run_with::<T>(&c, room);
        }
        if context > 4096 {
            c.shape.sliding_window = Some(4096);
            run_with::<T>(&c, ROOM);
        }
    }
}
for_each_dtype!(
    paged_attention_at_every_context_length,
    paged_attention_at_every_context_length
);

/// Multi-head latent attention on the same kernel: every head's latent query scores the whole
/// cached rows (`kv_lora_rank + qk_rope_head_dim`, DeepSeek-V3's 512 + 64) and sums their first
/// `kv_lora_rank` elements, with the config's softmax scale.
fn latent_attention_matches_the_reference<T: CudaElement>() {
    let Some(gpu) = gpu() else { return };
    let c = case(64, None);
    let (heads, rank, latent, scale) = (16, 512, 576, 0.0723f32);
    let (bs, n) = (c.shape.block_size, c.tokens.len());
    let (q, q_f32) = rounded::<T>(&random(n * heads * latent, 30, 1.0));
    let (cache, cache_f32) = rounded::<T>(&random(c.num_blocks * bs * latent, 31, 1.0));
    let (q_d, cache_d) = (upload(gpu, &q), upload(gpu, &cache));
    let mut out = gpu.zeros::<T>(n * heads * rank).unwrap();
    // Split over blocks: the 300-token context is one partition of 512 unless forced smaller.
    let mut l = layout(gpu, &c, heads, 1, rank, ROOM);
    ops::latent_attention(
        gpu,
        ops::LatentAttentionArgs {
            out: out.as_view_mut(),
            q: q_d.as_view(),
            cache: cache_d.as_view(),
            at: l.at(),
            num_heads: heads,
            latent_dim: latent,
            value_dim: rank,
            block_size: bs,
            max_blocks_per_seq: c.shape.max_blocks_per_seq,
            scale,
        },
    )
    .unwrap();
    let mut want = vec![0.0; n * heads * rank];
    for (t, (seq, pos)) in c.tokens.iter().enumerate() {
        let rows: Vec<&[f32]> = (0..=*pos)
            .map(|p| {
                let slot = c.tables[*seq][p / bs] as usize * bs + p % bs;
                &cache_f32[slot * latent..][..latent]
            })
            .collect();
        for h in 0..heads {
            let qh = &q_f32[(t * heads + h) * latent..][..latent];
            let mut scores: Vec<f32> = rows
                .iter()
                .map(|row| qh.iter().zip(*row).map(|(a, b)| a * b).sum::<f32>() * scale)
                .collect();
            cpu::softmax_in_place(&mut scores);
            let oh = &mut want[(t * heads + h) * rank..][..rank];
            for (p, row) in scores.iter().zip(&rows) {
                oh.iter_mut()
                    .zip(&row[..rank])
                    .for_each(|(o, v)| *o += p * v);
            }
        }
    }
    assert_close(
        "latent_attention",
        T::DTYPE,
        &download_f32(gpu, &out),
        &want,
        chained_tolerance(T::DTYPE),
    );
}
for_each_dtype!(
    latent_attention_matches_the_reference,
    latent_attention_matches_the_reference
);
