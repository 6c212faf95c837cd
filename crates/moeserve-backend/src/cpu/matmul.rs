//! `x · Wᵀ` for f32 activations and f32/f16/bf16 weights in HF `Linear` layout (`[out, in]`).
//!
//! Work is split over output rows of the weight, so each row is streamed from memory once per
//! call and reused for all `m` activation rows while it is hot in L1 (the batch-1 decode case is
//! one pass over the weight, split across threads).

use rayon::prelude::*;

use super::dot::{dot_bf16, dot_f16, dot_f32};
use super::isa;
use crate::{Weight, WeightData};

/// Rows of the weight each parallel task takes; large enough to amortise scheduling.
const ROWS_PER_TASK: usize = 32;

/// A raw output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (distinct weight rows = distinct output columns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not a field access) so closures capture the whole `Sync` wrapper.
    fn get(self) -> *mut f32 {
        self.0
    }
}

/// `out[i, j] = Σ_k x[i, k] · w[j, k]` for `x: [m, k]`, `w: [n, k]`, `out: [m, n]`.
pub fn matmul_wt(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    let (n, k) = (w.shape()[0], w.shape()[1]);
    assert_eq!(w.shape().len(), 2, "matmul_wt: weight must be 2-D");
    assert_eq!(
        x.len(),
        m * k,
        "matmul_wt: x has {} elements, want {m}×{k}",
        x.len()
    );
    assert_eq!(
        out.len(),
        m * n,
        "matmul_wt: out has {} elements, want {m}×{n}",
        out.len()
    );
    let isa = isa();
    let data = w.data();
    let out_ptr = OutPtr(out.as_mut_ptr());
    let row_block = |rows: std::ops::Range<usize>| {
        for j in rows {
            for i in 0..m {
                let xi = &x[i * k..(i + 1) * k];
                let v = match data {
                    WeightData::F32(d) => dot_f32(isa, &d[j * k..(j + 1) * k], xi),
                    WeightData::F16(d) => dot_f16(isa, &d[j * k..(j + 1) * k], xi),
                    WeightData::BF16(d) => dot_bf16(isa, &d[j * k..(j + 1) * k], xi),
                };
                // SAFETY: `i * n + j < m * n = out.len()`, and only this task writes column j.
                unsafe { *out_ptr.get().add(i * n + j) = v };
            }
        }
    };
    let num_tasks = n.div_ceil(ROWS_PER_TASK);
    if num_tasks <= 1 || m * n * k < 1 << 16 {
        row_block(0..n);
    } else {
        (0..num_tasks)
            .into_par_iter()
            .for_each(|t| row_block(t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(n)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference;
    use half::{bf16, f16};
    use moeserve_core::DType;

    fn pseudo_random(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| {
                let h = (i as u32)
                    .wrapping_mul(2654435761)
                    .wrapping_add(seed.wrapping_mul(40503));
                ((h >> 8) as f32 / (1u32 << 24) as f32) - 0.5
            })
            .collect()
    }

    fn weight_of(dtype: DType, shape: Vec<usize>, values: &[f32]) -> Weight {
        let bytes: Vec<u8> = match dtype {
            DType::F32 => bytemuck::cast_slice(values).to_vec(),
            DType::F16 => values
                .iter()
                .flat_map(|v| f16::from_f32(*v).to_le_bytes())
                .collect(),
            DType::BF16 => values
                .iter()
                .flat_map(|v| bf16::from_f32(*v).to_le_bytes())
                .collect(),
        };
        Weight::new(dtype, shape, crate::WeightBytes::owned(&bytes)).unwrap()
    }

    #[test]
    fn matches_scalar_reference_for_every_dtype_and_odd_sizes() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (m, n, k) in [(1, 7, 5), (3, 100, 67), (5, 257, 130), (1, 1024, 256)] {
                let x = pseudo_random(m * k, 1);
                let wv = pseudo_random(n * k, 2);
                let w = weight_of(dtype, vec![n, k], &wv);
                let mut out = vec![0.0; m * n];
                matmul_wt(&x, m, &w, &mut out);
                let mut want = vec![0.0; m * n];
                reference::matmul_wt(&x, m, &w.to_f32_vec(), n, &mut want);
                for (a, b) in out.iter().zip(&want) {
                    assert!(
                        (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                        "{dtype} {m}x{n}x{k}: {a} vs {b}"
                    );
                }
            }
        }
    }
}
