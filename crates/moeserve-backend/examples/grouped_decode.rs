//! The grouped expert GEMM of a batched decode step from DRAM: `grouped_swiglu` over many
//! distinct layers of bf16 experts (mixtral-bench-1b's shapes: 8 experts of 1024 → 3584 → 1024,
//! 1.4 GiB of layers in all, far past the caches), each expert given `R` rows, against the
//! roofline measured in the same run: max(bytes ÷ read bandwidth, FLOPs ÷ FMA peak).
//!
//!   cargo run --release -p moeserve-backend --example grouped_decode -- [R...]
//!
//! `R` is the rows of every expert (`8` is a 32-sequence top-2 step of 8 experts, evenly
//! routed) or a comma-separated count per expert (`13,9,5,3,9,9,11,5`, as a real step routes).
//! `GROUPED_LAYERS=N` sets the layer count (default 8), `GROUPED_REPS=N` the timed passes
//! (default 7; more for profiling a small shape).

use std::time::Instant;

use half::bf16;
use moeserve_backend::cpu::{ExpertRows, GatedActivation, grouped_swiglu, probe};
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;

/// `GROUPED_SHAPE=experts,hidden,intermediate` (default mixtral-bench-1b's 8,1024,3584); a
/// shape whose layers fit in L2 measures the kernel without DRAM.
fn shape() -> (usize, usize, usize) {
    std::env::var("GROUPED_SHAPE").map_or((8, 1024, 3584), |s| {
        let v: Vec<usize> = s
            .split(',')
            .map(|c| c.parse().expect("GROUPED_SHAPE"))
            .collect();
        (v[0], v[1], v[2])
    })
}

fn matrix(rows: usize, cols: usize, seed: usize) -> Weight {
    let bytes: Vec<u8> = (0..rows * cols)
        .flat_map(|i| bf16::from_f32(((i * 7 + seed) % 251) as f32 * 1e-4 - 0.0125).to_le_bytes())
        .collect();
    let w = Weight::new(DType::BF16, vec![rows, cols], WeightBytes::owned(&bytes)).unwrap();
    w.packed();
    w
}

fn main() {
    let (experts, hidden, inter) = shape();
    // Each argument: one count for every expert, or a comma-separated count per expert.
    let rows: Vec<Vec<usize>> = std::env::args()
        .skip(1)
        .map(|a| {
            let r: Vec<usize> = a.split(',').map(|c| c.parse().expect("R")).collect();
            if r.len() == 1 { vec![r[0]; experts] } else { r }
        })
        .collect();
    let rows = if rows.is_empty() {
        [1, 4, 8].map(|r| vec![r; experts]).to_vec()
    } else {
        rows
    };
    let layers: usize = std::env::var("GROUPED_LAYERS")
        .ok()
        .map_or(8, |v| v.parse().unwrap());
    let reps: usize = std::env::var("GROUPED_REPS")
        .ok()
        .map_or(7, |v| v.parse().unwrap());
    let weights: Vec<[Weight; 3]> = (0..layers * experts)
        .map(|e| {
            [
                matrix(inter, hidden, 3 * e),
                matrix(inter, hidden, 3 * e + 1),
                matrix(hidden, inter, 3 * e + 2),
            ]
        })
        .collect();
    let bytes = (weights.iter().flatten())
        .map(Weight::kernel_bytes)
        .sum::<usize>() as f64;
    let bw = probe::read_bandwidth_gbps(1 << 30, 3);
    let peak = probe::fma_peak_gflops();
    println!(
        "{layers} layers × {experts} experts, {:.2} GB; read bandwidth {bw:.1} GB/s, FMA peak {peak:.0} GFLOP/s",
        bytes / 1e9
    );
    for r in rows {
        assert_eq!(r.len(), experts, "{experts} experts' rows");
        let m: usize = r.iter().sum();
        let x: Vec<f32> = (0..m * hidden)
            .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
            .collect();
        let mut out = vec![0.0f32; m * hidden];
        let mut times = Vec::new();
        for _ in 0..reps {
            let start = Instant::now();
            // On a pool thread, as the engine's forward runs.
            rayon::scope(|_| {
                for layer in weights.chunks_exact(experts) {
                    let experts: Vec<ExpertRows<'_>> = layer
                        .iter()
                        .zip(&r)
                        .map(|([w1, w3, w2], &rows)| ExpertRows {
                            rows,
                            w1,
                            w3,
                            w2,
                            bias: None,
                            activation: GatedActivation::Silu,
                        })
                        .collect();
                    grouped_swiglu(&x, &experts[..], &mut out);
                }
            });
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        let t = times[times.len() / 2];
        let flops = 2.0 * (m * 3 * hidden * inter * layers) as f64;
        let bound = (bytes / (bw * 1e9)).max(flops / (peak * 1e9));
        println!(
            "R={r:?}: {:.2} ms/layer, {:.1} GB/s, {:.0} GFLOP/s → {:.0} % of the roofline ({} bound)",
            1e3 * t / layers as f64,
            bytes / t / 1e9,
            flops / t / 1e9,
            100.0 * bound / t,
            if bytes / bw > flops / peak {
                "bandwidth"
            } else {
                "FMA"
            }
        );
    }
}
