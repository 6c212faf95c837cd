//! `x · Wᵀ` for f32 activations and f32/f16/bf16 weights in HF `Linear` layout (`[out, in]`).
//!
//! Work is split over output rows of the weight, so each row is streamed from memory once per
//! call and reused for all `m` activation rows while it is hot in L1 (the batch-1 decode case is
//! one pass over the weight, split across threads).

use half::{bf16, f16};
use rayon::prelude::*;

use super::{Isa, isa};
use crate::{Weight, WeightData};

/// Weight rows per parallel task: a 64-row block of a bf16 weight with k = 4096 is 512 KiB,
/// so a task's rows stay in L2 while every activation block passes over them.
const ROWS_PER_TASK: usize = 64;
/// Activation rows per cache block (32 × 4096 f32 = 512 KiB).
const ACT_ROWS_PER_BLOCK: usize = 32;

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

/// The sizes of one `x · Wᵀ`.
#[derive(Clone, Copy)]
struct Dims {
    m: usize,
    n: usize,
    k: usize,
}

/// `out[i, j] = Σ_k x[i, k] · w[j, k]` for `x: [m, k]`, `w: [n, k]`, `out: [m, n]`.
pub fn matmul_wt(x: &[f32], m: usize, w: &Weight, out: &mut [f32]) {
    assert_eq!(w.shape().len(), 2, "matmul_wt: weight must be 2-D");
    let d = Dims {
        m,
        n: w.shape()[0],
        k: w.shape()[1],
    };
    assert_eq!(
        x.len(),
        m * d.k,
        "matmul_wt: x has {} elements, want {m}×{}",
        x.len(),
        d.k
    );
    assert_eq!(
        out.len(),
        m * d.n,
        "matmul_wt: out has {} elements, want {m}×{}",
        out.len(),
        d.n
    );
    let out = OutPtr(out.as_mut_ptr());
    match w.data() {
        WeightData::F32(v) => run(x, v, d, out),
        WeightData::F16(v) => run(x, v, d, out),
        WeightData::BF16(v) => run(x, v, d, out),
    }
}

/// Splits the weight rows into tasks; small products stay on the calling thread.
fn run<T: Element>(x: &[f32], w: &[T], d: Dims, out: OutPtr) {
    let num_tasks = d.n.div_ceil(ROWS_PER_TASK);
    let task = |t: usize| {
        let rows = t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(d.n);
        T::rows(x, w, d, rows, out)
    };
    if num_tasks <= 1 || d.m * d.n * d.k < 1 << 16 {
        (0..num_tasks).for_each(task);
    } else {
        (0..num_tasks).into_par_iter().for_each(task);
    }
}

/// A weight element type with a kernel per instruction set.
trait Element: Copy + Sync + Into<f32> {
    fn rows(x: &[f32], w: &[Self], d: Dims, rows: std::ops::Range<usize>, out: OutPtr);
}

macro_rules! impl_element {
    ($t:ty) => {
        impl Element for $t {
            fn rows(x: &[f32], w: &[Self], d: Dims, rows: std::ops::Range<usize>, out: OutPtr) {
                match isa() {
                    #[cfg(target_arch = "x86_64")]
                    // SAFETY: `Isa::Avx512` is only chosen when the CPU has AVX-512F/BW.
                    Isa::Avx512 => unsafe { tiled_rows(x, w, d, rows, out) },
                    _ => scalar_rows(x, w, d, rows, out),
                }
            }
        }
    };
}
impl_element!(f32);
impl_element!(f16);
impl_element!(bf16);

fn scalar_rows<T: Copy + Into<f32>>(
    x: &[f32],
    w: &[T],
    d: Dims,
    rows: std::ops::Range<usize>,
    out: OutPtr,
) {
    for j in rows {
        let wr = &w[j * d.k..(j + 1) * d.k];
        for i in 0..d.m {
            let xr = &x[i * d.k..(i + 1) * d.k];
            let v: f32 = wr.iter().zip(xr).map(|(a, b)| (*a).into() * b).sum();
            // SAFETY: `i * n + j < m * n`, and only this task writes column j.
            unsafe { *out.get().add(i * d.n + j) = v };
        }
    }
}

/// Weight rows `rows` against every activation row, in register tiles of up to 4 × 4.
///
/// # Safety
/// The CPU supports AVX-512F/BW; slices have the sizes `d` describes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn tiled_rows<T: super::avx512::Lanes>(
    x: &[f32],
    w: &[T],
    d: Dims,
    rows: std::ops::Range<usize>,
    out: OutPtr,
) {
    use super::avx512::{Tile, tile};
    for i0 in (0..d.m).step_by(ACT_ROWS_PER_BLOCK) {
        let i_end = (i0 + ACT_ROWS_PER_BLOCK).min(d.m);
        let mut j = rows.start;
        while j < rows.end {
            let nr = (rows.end - j).min(4);
            let mut i = i0;
            while i < i_end {
                let mr = (i_end - i).min(4);
                // SAFETY: rows i..i+mr of x and j..j+nr of w exist; out has m × n elements.
                let t = Tile {
                    x: unsafe { x.as_ptr().add(i * d.k) },
                    w: unsafe { w.as_ptr().add(j * d.k) },
                    k: d.k,
                    out: unsafe { out.get().add(i * d.n + j) },
                    ldo: d.n,
                };
                unsafe {
                    match (mr, nr) {
                        (4, 4) => tile::<T, 4, 4>(t),
                        (4, 3) => tile::<T, 4, 3>(t),
                        (4, 2) => tile::<T, 4, 2>(t),
                        (4, 1) => tile::<T, 4, 1>(t),
                        (3, 4) => tile::<T, 3, 4>(t),
                        (3, 3) => tile::<T, 3, 3>(t),
                        (3, 2) => tile::<T, 3, 2>(t),
                        (3, 1) => tile::<T, 3, 1>(t),
                        (2, 4) => tile::<T, 2, 4>(t),
                        (2, 3) => tile::<T, 2, 3>(t),
                        (2, 2) => tile::<T, 2, 2>(t),
                        (2, 1) => tile::<T, 2, 1>(t),
                        (1, 4) => tile::<T, 1, 4>(t),
                        (1, 3) => tile::<T, 1, 3>(t),
                        (1, 2) => tile::<T, 1, 2>(t),
                        _ => tile::<T, 1, 1>(t),
                    }
                }
                i += mr;
            }
            j += nr;
        }
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

    #[test]
    fn each_row_is_bit_identical_whatever_the_batch() {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let (m, n, k) = (11, 70, 200);
            let x = pseudo_random(m * k, 3);
            let w = weight_of(dtype, vec![n, k], &pseudo_random(n * k, 4));
            let mut batched = vec![0.0; m * n];
            matmul_wt(&x, m, &w, &mut batched);
            for i in 0..m {
                let mut alone = vec![0.0; n];
                matmul_wt(&x[i * k..(i + 1) * k], 1, &w, &mut alone);
                assert_eq!(&batched[i * n..(i + 1) * n], &alone[..], "{dtype} row {i}");
            }
        }
    }
}
