//! Batch-1 decode attention from DRAM: one token's query against a cached context in every
//! layer of a `mixtral-bench-1b`-shaped model (16 layers, 4 KV heads of 64, 4 query heads per
//! KV head), the cache evicted before each pass (a 256 MiB read, as a decode step's weights
//! evict it), against the read bandwidth measured in the same run. The engine runs one
//! `attend_kv_head` per (token, KV head), in parallel, as here.
//!
//!   cargo run --release -p moeserve-backend --example attention_decode -- [CONTEXT...]
//!
//! Environment, to tell the kernel from the cache's access pattern:
//! - `ATTN_READ_ONLY=1`: no attention, each task only reads its rows (four lines each, in slot
//!   order): what the access pattern alone allows;
//! - `ATTN_LAYOUT=head`: each KV head's rows contiguous (`[head][slot][head_dim]`) instead of
//!   whole cache rows (`[slot][kv_heads · head_dim]`, a head's 256 bytes a kilobyte apart: the
//!   engine's cache until it kept a block's rows of each head together, between the two);
//! - `ATTN_BLOCKS=sequential`: the sequence's blocks in address order instead of shuffled (a
//!   cache that has served and freed other sequences);
//! - `RAYON_NUM_THREADS=1`: one core.

use std::time::Instant;

use moeserve_backend::cpu::attention::{HeadRows, KvHeadQuery, attend_kv_head};
use moeserve_backend::cpu::probe;
use rayon::prelude::*;

const LAYERS: usize = 16;
const KV_HEADS: usize = 4;
const HEAD_DIM: usize = 64;
const GROUP: usize = 4;
const BLOCK: usize = 16;

fn main() {
    let contexts: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("CONTEXT"))
        .collect();
    let contexts = if contexts.is_empty() {
        vec![256, 1500]
    } else {
        contexts
    };
    let flag = |name: &str, value: &str| std::env::var(name).is_ok_and(|v| v == value);
    let read_only = flag("ATTN_READ_ONLY", "1");
    let by_head = flag("ATTN_LAYOUT", "head");
    let sequential = flag("ATTN_BLOCKS", "sequential");
    let flush = vec![1u8; 256 << 20];
    for ctx in contexts {
        let blocks = ctx.div_ceil(BLOCK);
        let mut table: Vec<usize> = (0..blocks).collect();
        if !sequential {
            for i in 0..blocks {
                table.swap(i, (i * 7919 + 13) % blocks);
            }
        }
        let slots: Vec<usize> = (0..ctx)
            .map(|p| table[p / BLOCK] * BLOCK + p % BLOCK)
            .collect();
        let row = KV_HEADS * HEAD_DIM;
        let cache = |l: usize| -> Vec<f32> {
            (0..blocks * BLOCK * row)
                .map(|i| ((i + l) % 97) as f32 * 1e-3)
                .collect()
        };
        let keys: Vec<Vec<f32>> = (0..LAYERS).map(cache).collect();
        let values: Vec<Vec<f32>> = (0..LAYERS).map(|l| cache(l + 1)).collect();
        let q: Vec<f32> = (0..KV_HEADS * GROUP * HEAD_DIM)
            .map(|i| (i % 13) as f32 * 1e-2)
            .collect();
        let mut out = vec![0f32; KV_HEADS * GROUP * HEAD_DIM];
        let mut times = Vec::new();
        for _ in 0..7 {
            let evict: u64 = flush
                .par_chunks(1 << 20)
                .map(|c| c.iter().step_by(64).map(|&b| b as u64).sum::<u64>())
                .sum();
            std::hint::black_box(evict);
            let start = Instant::now();
            // On a pool thread, as the engine's forward runs.
            rayon::scope(|_| {
                for l in 0..LAYERS {
                    out.par_chunks_mut(GROUP * HEAD_DIM)
                        .enumerate()
                        .for_each(|(h, out)| {
                            let query = KvHeadQuery {
                                q: &q[h * GROUP * HEAD_DIM..][..GROUP * HEAD_DIM],
                                head_dim: HEAD_DIM,
                                value_dim: HEAD_DIM,
                                scale: (HEAD_DIM as f32).powf(-0.5),
                                keys: head_rows(&keys[l], h, by_head),
                                values: head_rows(&values[l], h, by_head),
                                slots: &slots,
                                sinks: None,
                            };
                            if read_only {
                                out[0] = read_rows(&query);
                            } else {
                                // A fresh scores buffer per task (the engine keeps one per
                                // thread): one small allocation against tens of µs.
                                attend_kv_head(&query, &mut Vec::new(), out);
                            }
                        });
                }
            });
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let bw = probe::read_bandwidth_gbps(1 << 30, 3);
        let bytes = (LAYERS * ctx * row * 2 * std::mem::size_of::<f32>()) as f64;
        let gbps = bytes / times[3] / 1e9;
        println!(
            "context {ctx}: {:.0} µs for {LAYERS} layers, {gbps:.1} GB/s of cache, read bandwidth \
             {bw:.1} GB/s → {:.0} %",
            times[3] * 1e6,
            100.0 * gbps / bw
        );
    }
}

/// KV head `h`'s rows of one layer's cache, in either layout (the same bytes).
fn head_rows(data: &[f32], h: usize, by_head: bool) -> HeadRows<'_> {
    if by_head {
        let per = data.len() / KV_HEADS;
        HeadRows {
            data: &data[h * per..(h + 1) * per],
            stride: HEAD_DIM,
            offset: 0,
        }
    } else {
        HeadRows {
            data,
            stride: KV_HEADS * HEAD_DIM,
            offset: h * HEAD_DIM,
        }
    }
}

/// Every line of the query's key and value rows read once, in slot order; a sum so the reads
/// stay.
fn read_rows(a: &KvHeadQuery<'_>) -> f32 {
    let mut sum = [0f32; 4];
    for rows in [&a.keys, &a.values] {
        for &slot in a.slots {
            let r = &rows.data[slot * rows.stride + rows.offset..][..a.head_dim];
            for (s, line) in sum.iter_mut().zip(r.chunks_exact(16)) {
                *s += line[0];
            }
        }
    }
    sum.iter().sum()
}
