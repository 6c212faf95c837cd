//! Weight streaming of the GEMM from DRAM: `matmul_wt` over many distinct bf16 expert-shaped
//! matrices (1 GiB in all, far past the caches), against the read bandwidth measured in the
//! same run.
//!
//!   cargo run --release -p moeserve-backend --example stream_matmul -- [M...]
//!
//! `STREAM_BYTES=N` sets the total size of the matrices (default 1 GiB); `STREAM_BYTES=1` runs
//! one matrix over and over (7 MiB, from the caches): the kernel's speed without DRAM.
//! `STREAM_DTYPE=int4` streams GPTQ-style int4 matrices (groups of 128) of the same total size
//! in their own bytes instead of bf16; `STREAM_DTYPE=f16` f16 matrices; `STREAM_DTYPE=fp8`
//! e4m3 matrices in blocks of 128 × 128, as DeepSeek-V3 ships them.

use std::time::Instant;

use half::{bf16, f16};
use moeserve_backend::cpu::fp8::{BlockScales, E4m3};
use moeserve_backend::cpu::int4::{GroupOf, Int4Panels, Int4Source};
use moeserve_backend::cpu::{matmul_wt, probe};
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;

fn main() {
    let ms: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("M"))
        .collect();
    let ms = if ms.is_empty() { vec![1, 8, 32] } else { ms };
    let (n, k) = (3584, 1024);
    let total: usize = std::env::var("STREAM_BYTES")
        .ok()
        .map_or(1 << 30, |v| v.parse().unwrap());
    let dtype = std::env::var("STREAM_DTYPE").unwrap_or_default();
    let (int4, f16, fp8) = (dtype == "int4", dtype == "f16", dtype == "fp8");
    // Bytes per two weights.
    let per_two = if int4 {
        1
    } else if fp8 {
        2
    } else {
        4
    };
    let count = (total / (n * k * per_two / 2)).max(1);
    let weights: Vec<Weight> = (0..count)
        .map(|j| {
            let w = if int4 {
                let src = Int4Source {
                    code: |r: usize, p: usize| ((r + p + j) % 16) as u8,
                    // f16, as checkpoints store them (the kernels' 3-byte grids).
                    scale: |g: usize, r: usize| f16::from_f32(((g + r) % 7) as f32 * 1e-3).to_f32(),
                    zero: |_: usize, _: usize| 8,
                };
                let groups = k / 128;
                Weight::int4(Int4Panels::new((n, k), groups, GroupOf::Runs(128), src).unwrap())
            } else if fp8 {
                let bytes: Vec<u8> = (0..n * k)
                    .map(|i| E4m3::from_f32(((i + j) % 251) as f32 * 1e-2 - 1.25).0)
                    .collect();
                let scales = BlockScales {
                    block: [128, 128],
                    k,
                    scales: (0..n.div_ceil(128) * k.div_ceil(128))
                        .map(|b| 1e-3 * (1 + b % 5) as f32)
                        .collect(),
                };
                Weight::fp8(vec![n, k], WeightBytes::owned(&bytes), scales).unwrap()
            } else {
                let value = |i: usize| ((i + j) % 251) as f32 * 1e-3;
                let (dtype, bytes): (DType, Vec<u8>) = if f16 {
                    let bytes = (0..n * k).flat_map(|i| f16::from_f32(value(i)).to_le_bytes());
                    (DType::F16, bytes.collect())
                } else {
                    let bytes = (0..n * k).flat_map(|i| bf16::from_f32(value(i)).to_le_bytes());
                    (DType::BF16, bytes.collect())
                };
                Weight::new(dtype, vec![n, k], WeightBytes::owned(&bytes)).unwrap()
            };
            w.packed();
            w
        })
        .collect();
    let bytes = weights.iter().map(Weight::kernel_bytes).sum::<usize>() as f64;
    for m in ms {
        let x = vec![0.01f32; m * k];
        let mut out = vec![0.0f32; m * n];
        let mut times = Vec::new();
        for _ in 0..5 {
            // On a pool thread, as the engine's forward runs: each product then forks inside
            // the pool instead of waking it from outside (a futex round trip per product).
            let start = Instant::now();
            rayon::scope(|_| {
                for w in &weights {
                    matmul_wt(&x, m, w, &mut out);
                }
            });
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let bw = probe::read_bandwidth_gbps(1 << 30, 3);
        let gbps = bytes / times[2] / 1e9;
        println!(
            "m={m}: {gbps:.1} GB/s of weights ({:.0} GFLOP/s), read bandwidth {bw:.1} GB/s → {:.0} %",
            2.0 * (m * n * k * count) as f64 / times[2] / 1e9,
            100.0 * gbps / bw
        );
    }
}
