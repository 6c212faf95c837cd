//! Kernel microbenchmarks on `mixtral-bench-1b` shapes (hidden 1024, expert FFN 3584, vocab
//! 49152), bf16 weights. Throughput is reported in FLOP (elements = 2·m·n·k for a matmul), so
//! criterion's "elem/s" reads as FLOP/s; for m = 1 the weight bytes per second is what counts
//! (n·k·2 bytes per iteration).
//!
//!   cargo bench -p moeserve-backend --bench kernels -- --warm-up-time 1 --measurement-time 3

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use half::bf16;
use moeserve_backend::cpu::{matmul_wt, rms_norm, silu_mul};
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;

fn bf16_weight(n: usize, k: usize) -> Weight {
    let bytes: Vec<u8> = (0..n * k)
        .flat_map(|i| bf16::from_f32(((i * 7919) % 1000) as f32 * 1e-3 - 0.5).to_le_bytes())
        .collect();
    Weight::new(DType::BF16, vec![n, k], WeightBytes::owned(&bytes)).unwrap()
}

fn activations(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 31) % 97) as f32 * 0.01 - 0.48)
        .collect()
}

fn matmul(c: &mut Criterion) {
    // (name, n, k): an expert's gate/up projection, its down projection, attention q/o, lm_head.
    let shapes = [
        ("expert_up", 3584, 1024),
        ("expert_down", 1024, 3584),
        ("attn_q", 1024, 1024),
        ("lm_head", 49152, 1024),
    ];
    for (name, n, k) in shapes {
        let w = bf16_weight(n, k);
        w.packed(); // pack outside the timed loop, as the model does at load
        let mut group = c.benchmark_group(format!("matmul_bf16/{name}"));
        for m in [1usize, 8, 32, 256, 2048] {
            if (name == "lm_head" && m > 32) || (m > 256 && name != "attn_q") {
                continue;
            }
            let x = activations(m * k);
            let mut out = vec![0.0f32; m * n];
            group.throughput(Throughput::Elements((2 * m * n * k) as u64));
            group.bench_with_input(BenchmarkId::from_parameter(m), &m, |b, &m| {
                b.iter(|| matmul_wt(&x, m, &w, &mut out))
            });
        }
        group.finish();
    }
}

fn elementwise(c: &mut Criterion) {
    let (m, hidden, ffn) = (32, 1024, 3584);
    let mut group = c.benchmark_group("elementwise");
    let gain = Weight::from_f32(vec![hidden], &vec![1.0f32; hidden]).unwrap();
    let x = activations(m * hidden);
    let mut out = vec![0.0f32; m * hidden];
    group.throughput(Throughput::Elements((m * hidden) as u64));
    group.bench_function("rms_norm_32x1024", |b| {
        b.iter(|| rms_norm(&x, &gain, 1e-5, &mut out))
    });
    let up = activations(m * ffn);
    let mut gate = activations(m * ffn);
    group.throughput(Throughput::Elements((m * ffn) as u64));
    // Gate values drift over iterations; silu_mul's cost does not depend on them.
    group.bench_function("silu_mul_32x3584", |b| b.iter(|| silu_mul(&mut gate, &up)));
    group.finish();
}

/// One decode token's attention for one KV head of mixtral-bench-1b (4 query heads of 64 over
/// its cached rows), f32 and bf16 rows, contexts of 256 and 4,096 (the rows of 8 KV heads
/// interleaved as in the cache, slots scattered over its blocks).
fn attention(c: &mut Criterion) {
    use moeserve_backend::cpu::attention::{HeadRows, KvElement, KvHeadQuery, attend_kv_head};
    let (d, group, kv_heads) = (64, 4, 4);
    let stride = kv_heads * d;
    let num_slots = 8192;
    let keys = activations(num_slots * stride);
    let values: Vec<f32> = keys.iter().map(|x| 0.5 - x).collect();
    let narrow = |v: &[f32]| v.iter().map(|x| bf16::from_f32(*x)).collect::<Vec<_>>();
    let (keys16, values16) = (narrow(&keys), narrow(&values));
    let q = activations(group * d);
    fn run<T: KvElement>(q: &[f32], rows: (&[T], &[T]), slots: &[usize], stride: usize) {
        let head = |data| HeadRows {
            data,
            stride,
            offset: 64,
        };
        let a = KvHeadQuery {
            q,
            head_dim: 64,
            value_dim: 64,
            scale: 0.125,
            keys: head(rows.0),
            values: head(rows.1),
            slots,
            sinks: None,
        };
        let mut out = vec![0.0f32; q.len()];
        attend_kv_head(&a, &mut Vec::new(), &mut out);
        std::hint::black_box(out);
    }
    let mut g = c.benchmark_group("attention_decode");
    for context in [256usize, 4096] {
        // Blocks of 16 slots in a scattered order.
        let slots: Vec<usize> = (0..context)
            .map(|p| ((p / 16) * 37 % (num_slots / 16)) * 16 + p % 16)
            .collect();
        g.throughput(Throughput::Elements(context as u64));
        g.bench_function(BenchmarkId::new("f32", context), |b| {
            b.iter(|| run(&q, (&keys, &values), &slots, stride))
        });
        g.bench_function(BenchmarkId::new("bf16", context), |b| {
            b.iter(|| run(&q, (&keys16, &values16), &slots, stride))
        });
    }
    g.finish();
}

criterion_group!(benches, matmul, elementwise, attention);
criterion_main!(benches);
