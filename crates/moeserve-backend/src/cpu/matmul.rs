//! `x · Wᵀ` for f32 activations and f32/f16/bf16 weights in HF `Linear` layout (`[out, in]`).
//!
//! Work is split over output rows of the weight, so each row is streamed from memory once per
//! call and reused for all `m` activation rows while it is hot in L1 (the batch-1 decode case is
//! one pass over the weight, split across threads).

use rayon::prelude::*;

use super::packed::{PANEL, PackedPanels, PackedWeight};
use super::{Isa, isa};
use crate::{Weight, WeightData};

/// Weight rows per parallel task on the scalar path.
const ROWS_PER_TASK: usize = 64;
/// Activation rows per microkernel call on the AVX-512 path (2 × MR accumulators + 3 registers).
const MAX_MR: usize = 8;

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
    match isa() {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => match w.packed() {
            PackedWeight::F32(p) => run_packed(x, d, p, out),
            PackedWeight::F16(p) => run_packed(x, d, p, out),
            PackedWeight::BF16(p) => run_packed(x, d, p, out),
        },
        _ => match w.data() {
            WeightData::F32(v) => run_scalar(x, v, d, out),
            WeightData::F16(v) => run_scalar(x, v, d, out),
            WeightData::BF16(v) => run_scalar(x, v, d, out),
        },
    }
}

/// Runs `task(t)` for `t < num_tasks`, in parallel unless the product is small.
fn for_each_task(num_tasks: usize, d: Dims, task: impl Fn(usize) + Sync + Send) {
    if num_tasks <= 1 || d.m * d.n * d.k < 1 << 16 {
        (0..num_tasks).for_each(task);
    } else {
        (0..num_tasks).into_par_iter().for_each(task);
    }
}

fn run_scalar<T: Copy + Sync + Into<f32>>(x: &[f32], w: &[T], d: Dims, out: OutPtr) {
    for_each_task(d.n.div_ceil(ROWS_PER_TASK), d, |t| {
        for j in t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(d.n) {
            let wr = &w[j * d.k..(j + 1) * d.k];
            for i in 0..d.m {
                let xr = &x[i * d.k..(i + 1) * d.k];
                let v: f32 = wr.iter().zip(xr).map(|(a, b)| (*a).into() * b).sum();
                // SAFETY: `i * n + j < m * n`, and only this task writes column j.
                unsafe { *out.get().add(i * d.n + j) = v };
            }
        }
    });
}

/// One task per 32-row panel; each task runs every activation row through its panel. With
/// many activation rows (prefill) a 16-bit panel is widened to f32 once into a per-thread
/// scratch, so the inner loop is loads and FMAs only; the values and the FMA order are the same
/// either way, so results do not depend on the batch.
#[cfg(target_arch = "x86_64")]
fn run_packed<T: super::avx512::Lanes + Sync + Into<f32>>(
    x: &[f32],
    d: Dims,
    w: &PackedPanels<T>,
    out: OutPtr,
) {
    let widen = d.m > WIDEN_ABOVE_ROWS && std::mem::size_of::<T>() < 4;
    for_each_task(w.num_panels(), d, |q| {
        let panel = w.panel(q);
        if !widen {
            return panel_rows(x, d, panel, q, out);
        }
        WIDE_PANEL.with_borrow_mut(|wide| {
            wide.clear();
            wide.extend(panel.iter().map(|v| (*v).into()));
            panel_rows(x, d, wide, q, out)
        })
    });
}

/// Activation rows above which widening a 16-bit panel once pays for itself.
const WIDEN_ABOVE_ROWS: usize = 8 * MAX_MR;

thread_local! {
    /// A widened panel (`k × PANEL` f32), reused across calls on this thread.
    static WIDE_PANEL: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// All activation rows against panel `q`, `MAX_MR` rows per microkernel call.
#[cfg(target_arch = "x86_64")]
fn panel_rows<U: super::avx512::Lanes>(x: &[f32], d: Dims, panel: &[U], q: usize, out: OutPtr) {
    use super::avx512::{PanelTile, panel_tile};
    let cols = PANEL.min(d.n - q * PANEL);
    let mut tmp = [0.0f32; MAX_MR * PANEL];
    for i0 in (0..d.m).step_by(MAX_MR) {
        let mr = MAX_MR.min(d.m - i0);
        let t = PanelTile {
            x: x[i0 * d.k..].as_ptr(),
            w: panel.as_ptr(),
            k: d.k,
            out: tmp.as_mut_ptr(),
        };
        // SAFETY: `Isa::Avx512` was detected; x holds rows i0..i0+mr, the panel k × 32
        // elements, tmp MAX_MR × 32.
        unsafe {
            match mr {
                8 => panel_tile::<U, 8>(t),
                7 => panel_tile::<U, 7>(t),
                6 => panel_tile::<U, 6>(t),
                5 => panel_tile::<U, 5>(t),
                4 => panel_tile::<U, 4>(t),
                3 => panel_tile::<U, 3>(t),
                2 => panel_tile::<U, 2>(t),
                _ => panel_tile::<U, 1>(t),
            }
        }
        for i in 0..mr {
            let src = &tmp[i * PANEL..i * PANEL + cols];
            // SAFETY: row i0 + i, columns q*32 .. q*32 + cols are inside out and only this
            // task writes them.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    src.as_ptr(),
                    out.get().add((i0 + i) * d.n + q * PANEL),
                    cols,
                )
            };
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
            for (m, n, k) in [
                (1, 7, 5),
                (3, 100, 67),
                (5, 257, 130),
                (1, 1024, 256),
                (37, 65, 96),
            ] {
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
            let (m, n, k) = (40, 70, 200);
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
