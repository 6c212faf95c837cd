//! `x · Wᵀ` for f32 activations and f32/f16/bf16 weights in HF `Linear` layout (`[out, in]`).
//!
//! Work is split over output rows of the weight, so each row is streamed from memory once per
//! call and reused for all `m` activation rows while it is hot in L1 (the batch-1 decode case is
//! one pass over the weight, split across threads).

use rayon::prelude::*;

use super::fp8::{BlockScales, E4m3};
use super::intdot::{DotKernel, Format, IntActivations, QuantizedRows, Quantizer};
use super::packed::{PANEL, PackedPanels, PackedWeight};
use super::{Isa, isa};
use crate::{Weight, WeightData};

mod many;
mod tiled_rows;
pub use many::matmul_wt_many;
pub(super) use tiled_rows::{TiledRows, row_tiles, tile_of};

/// Weight rows per parallel task on the scalar path.
const ROWS_PER_TASK: usize = 64;
/// Activation rows per microkernel call on the AVX-512 path: 2 × MR accumulators + 2 weight
/// vectors + 1 broadcast within the 32 vector registers, with room to spare.
const MAX_MR: usize = 12;

/// A raw output pointer shared by tasks that write disjoint columns.
#[derive(Clone, Copy)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements (distinct weight rows = distinct output columns).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// A method (not a field access) so closures capture the whole `Sync` wrapper.
    pub(super) fn get(self) -> *mut f32 {
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
    // Taken out of the thread-local, not borrowed: while this thread waits for the tasks it
    // may run another product's task, which then packs into a buffer of its own.
    let mut tiled = TILED_X.take();
    matmul_wt_on(isa(), x, m, w, out, &mut tiled);
    TILED_X.set(tiled);
}

/// [`matmul_wt`] with the caller's buffer for the activations in tile order (`m · k`
/// elements; a step's workspace keeps one, so steps allocate nothing).
pub fn matmul_wt_in(x: &[f32], m: usize, w: &Weight, out: &mut [f32], tiled: &mut Vec<f32>) {
    matmul_wt_on(isa(), x, m, w, out, tiled)
}

/// [`matmul_wt`] on the kernels of `isa`, which the CPU must support.
fn matmul_wt_on(isa: Isa, x: &[f32], m: usize, w: &Weight, out: &mut [f32], tiled: &mut Vec<f32>) {
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
    if m == 0 || d.k == 0 {
        out.fill(0.0);
        return;
    }
    let out = OutPtr(out.as_mut_ptr());
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 | Isa::Avx2 => {
            let packed = w.packed();
            if let Some(how) = quantizer(isa, packed) {
                return run_integer(how, x, d, packed, out);
            }
            let x = TiledRows::pack(isa, x, m, d.k, tiled);
            let scales = PanelScales::of(packed);
            match packed {
                PackedWeight::F32(p) => run_packed(isa, x, d, p, out, scales),
                PackedWeight::F16(p) => run_packed(isa, x, d, p, out, scales),
                PackedWeight::BF16(p) => run_packed(isa, x, d, p, out, scales),
                PackedWeight::F8 { panels, .. } => run_packed(isa, x, d, panels, out, scales),
                PackedWeight::Mxfp4(p) => run_panels(p.num_panels(), d, out, |q, acc| {
                    widened_panel_product(isa, x, d, q, acc, |k0, kc, dst| {
                        p.widen_block(isa, q, k0, kc, dst)
                    })
                }),
                PackedWeight::Int4(_) | PackedWeight::I8(_) => {
                    unreachable!("integer weights run above")
                }
            }
        }
        _ => match w.data() {
            WeightData::F32(v) => run_scalar(x, v, d, out),
            WeightData::F16(v) => run_scalar(x, v, d, out),
            WeightData::BF16(v) => run_scalar(x, v, d, out),
            WeightData::F8E4M3(v, blocks) => run_scalar_fp8(x, v, blocks, d, out),
            WeightData::Mxfp4(p) => run_scalar_rows(x, d, out, |j, row| p.row_into(j, row)),
            WeightData::Int4(p) => run_scalar_rows(x, d, out, |j, row| p.row_into(j, row)),
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

/// [`run_scalar`] of an FP8 block weight: each element times its block's scale.
fn run_scalar_fp8(x: &[f32], w: &[E4m3], blocks: &BlockScales, d: Dims, out: OutPtr) {
    for_each_task(d.n.div_ceil(ROWS_PER_TASK), d, |t| {
        for j in t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(d.n) {
            let wr = &w[j * d.k..(j + 1) * d.k];
            for i in 0..d.m {
                let xr = &x[i * d.k..(i + 1) * d.k];
                let v: f32 = (wr.iter().zip(xr).enumerate())
                    .map(|(p, (a, b))| a.to_f32() * blocks.at(j, p) * b)
                    .sum();
                // SAFETY: `i * n + j < m * n`, and only this task writes column j.
                unsafe { *out.get().add(i * d.n + j) = v };
            }
        }
    });
}

/// [`run_scalar`] of a 4-bit weight (MXFP4, int4), a row widened at a time by `row_into`.
fn run_scalar_rows(
    x: &[f32],
    d: Dims,
    out: OutPtr,
    row_into: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    for_each_task(d.n.div_ceil(ROWS_PER_TASK), d, |t| {
        let mut wr = vec![0.0; d.k];
        for j in t * ROWS_PER_TASK..((t + 1) * ROWS_PER_TASK).min(d.n) {
            row_into(j, &mut wr);
            for i in 0..d.m {
                let xr = &x[i * d.k..(i + 1) * d.k];
                let v: f32 = wr.iter().zip(xr).map(|(a, b)| a * b).sum();
                // SAFETY: `i * n + j < m * n`, and only this task writes column j.
                unsafe { *out.get().add(i * d.n + j) = v };
            }
        }
    });
}

/// How a packed panel's products are scaled.
#[derive(Clone, Copy)]
enum PanelScales<'a> {
    /// Not at all: the elements are the weights.
    None,
    /// FP8 blocks: one scale per (panel, `block_cols` positions), `[num_panels, blocks]`.
    Blocks {
        scales: &'a [f32],
        block_cols: usize,
    },
}

impl<'a> PanelScales<'a> {
    /// The scales of a packed weight's panels.
    fn of(w: &'a PackedWeight) -> Self {
        match w {
            // MXFP4's scales are applied as its blocks are widened.
            PackedWeight::F32(_)
            | PackedWeight::F16(_)
            | PackedWeight::BF16(_)
            | PackedWeight::Mxfp4(_)
            | PackedWeight::Int4(_)
            | PackedWeight::I8(_) => PanelScales::None,
            PackedWeight::F8 {
                scales, block_cols, ..
            } => PanelScales::Blocks {
                scales,
                block_cols: *block_cols,
            },
        }
    }
}

/// Panel `q` of `x · Wᵀ` for `x: [m, k]` into `acc: [m, PANEL]`, whatever the weight's stored
/// type, on the calling thread (the AVX-512 path's unit of work, for kernels that schedule
/// panels of several matrices themselves). An integer weight (int8, int4) multiplies `xq`, `x`
/// quantized once by the caller as [`quantizer`] says (required then: not once per panel).
#[cfg(target_arch = "x86_64")]
pub(super) fn weight_panel(
    isa: Isa,
    x: TiledRows<'_>,
    xq: Option<QuantizedRows<'_>>,
    w: &Weight,
    q: usize,
    acc: &mut [f32],
) {
    let d = Dims {
        m: x.m,
        n: w.shape()[0],
        k: w.shape()[1],
    };
    debug_assert!(
        x.k == d.k
            && x.max_mr == max_rows_per_tile(isa)
            && acc.len() == d.m * PANEL
            && q < d.n.div_ceil(PANEL)
    );
    let packed = w.packed();
    let scales = PanelScales::of(packed);
    match packed {
        PackedWeight::F32(p) => panel_product(isa, x, d, p, q, scales, acc),
        PackedWeight::F16(p) => panel_product(isa, x, d, p, q, scales, acc),
        PackedWeight::BF16(p) => panel_product(isa, x, d, p, q, scales, acc),
        PackedWeight::F8 { panels, .. } => panel_product(isa, x, d, panels, q, scales, acc),
        PackedWeight::Mxfp4(p) => widened_panel_product(isa, x, d, q, acc, |k0, kc, dst| {
            p.widen_block(isa, q, k0, kc, dst)
        }),
        PackedWeight::Int4(_) | PackedWeight::I8(_) => {
            let xq = xq.expect("an integer weight's caller brings its rows quantized");
            integer_panel_product(packed, xq, q, acc)
        }
    }
}

/// Whether products of `m` activation rows on `isa` run their panels two at a time
/// ([`weight_panel_pair`]): one row on AVX2 or AVX-512, whose 1-row tile alone is too few FMA
/// chains to keep up with memory on Zen 3 (see [`super::avx2::panel_pair_row`]; on Zen 4, with
/// AVX-512 or AVX2, pairs and single panels stream alike, bench/RESULTS.md).
pub(super) fn pairs_panels(isa: Isa, m: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if matches!(isa, Isa::Avx2 | Isa::Avx512) {
        return m == 1;
    }
    let _ = (isa, m);
    false
}

/// Panels `qa` of `wa` and `qb` of `wb` (the same `k`) of one product's rows `x` into
/// `acc_a` and `acc_b` (`[m, PANEL]` each), as [`weight_panel`] twice gives them: streamed
/// together where [`pairs_panels`] says so and both are floats of one type, else one after
/// the other (integer weights multiplying their `xq` as in [`weight_panel`]).
#[cfg(target_arch = "x86_64")]
pub(super) fn weight_panel_pair(
    isa: Isa,
    x: TiledRows<'_>,
    [(wa, qa, xqa), (wb, qb, xqb)]: [(&Weight, usize, Option<QuantizedRows<'_>>); 2],
    acc_a: &mut [f32],
    acc_b: &mut [f32],
) {
    if pairs_panels(isa, x.m) && wa.shape()[1] == wb.shape()[1] {
        let acc = [&mut *acc_a, &mut *acc_b];
        match (wa.packed(), wb.packed()) {
            (PackedWeight::BF16(a), PackedWeight::BF16(b)) => {
                return panel_pair_row(isa, x, [a.panel(qa), b.panel(qb)], acc);
            }
            (PackedWeight::F16(a), PackedWeight::F16(b)) => {
                return panel_pair_row(isa, x, [a.panel(qa), b.panel(qb)], acc);
            }
            (PackedWeight::F32(a), PackedWeight::F32(b)) => {
                return panel_pair_row(isa, x, [a.panel(qa), b.panel(qb)], acc);
            }
            _ => {}
        }
    }
    weight_panel(isa, x, xqa, wa, qa, acc_a);
    weight_panel(isa, x, xqb, wb, qb, acc_b);
}

/// One row of `x` through two whole panels at once ([`super::avx512::panel_pair_row`],
/// [`super::avx2::panel_pair_row`]).
#[cfg(target_arch = "x86_64")]
fn panel_pair_row<T: Element>(isa: Isa, x: TiledRows<'_>, panels: [&[T]; 2], acc: [&mut [f32]; 2]) {
    // `isa` is one the CPU supports (the callers').
    assert!(
        pairs_panels(isa, x.m)
            && panels.iter().all(|p| p.len() == x.k * PANEL)
            && acc.iter().all(|a| a.len() == PANEL)
    );
    let w = panels.map(<[T]>::as_ptr);
    let acc = acc.map(|a| a.as_mut_ptr());
    // SAFETY: `isa` is supported; one row of k activations, two panels of k positions, two
    // panels' sums (asserted).
    unsafe {
        if isa == Isa::Avx512 {
            super::avx512::panel_pair_row(x.data.as_ptr(), x.k, w, acc)
        } else {
            super::avx2::panel_pair_row(x.data.as_ptr(), x.k, w, acc)
        }
    }
}

/// One task per 32-row panel (see [`panel_product`]), written to its 32 output columns.
#[cfg(target_arch = "x86_64")]
fn run_packed<T: Element + Sync>(
    isa: Isa,
    x: TiledRows<'_>,
    d: Dims,
    w: &PackedPanels<T>,
    out: OutPtr,
    scales: PanelScales<'_>,
) {
    let panel = |q, acc: &mut [f32]| panel_product(isa, x, d, w, q, scales, acc);
    if pairs_panels(isa, d.m) && matches!(scales, PanelScales::None) {
        run_panel_pairs(w.num_panels(), d, out, panel, |q, acc| {
            panel_pair_row(isa, x, [w.panel(q), w.panel(q + 1)], acc)
        });
    } else {
        run_panels(w.num_panels(), d, out, panel);
    }
}

/// One task per panel: `panel(q, acc)` fills panel `q`'s `[m, PANEL]` sums, which go to its
/// output columns.
#[cfg(target_arch = "x86_64")]
fn run_panels(
    num_panels: usize,
    d: Dims,
    out: OutPtr,
    panel: impl Fn(usize, &mut [f32]) + Sync + Send,
) {
    for_each_task(num_panels, d, |q| {
        PANEL_OUT.with_borrow_mut(|acc| {
            acc.resize(d.m * PANEL, 0.0);
            panel(q, acc);
            // SAFETY: only this task computes panel q.
            unsafe { write_panel(acc, d, q, out) };
        })
    });
}

/// [`run_panels`] two panels to a task (the last alone when their number is odd), for
/// products whose panels stream in pairs ([`pairs_panels`]): `pair(q, [acc_q, acc_q+1])`.
#[cfg(target_arch = "x86_64")]
fn run_panel_pairs(
    num_panels: usize,
    d: Dims,
    out: OutPtr,
    panel: impl Fn(usize, &mut [f32]) + Sync + Send,
    pair: impl Fn(usize, [&mut [f32]; 2]) + Sync + Send,
) {
    for_each_task(num_panels.div_ceil(2), d, |t| {
        PANEL_OUT.with_borrow_mut(|acc| {
            acc.resize(2 * d.m * PANEL, 0.0);
            let (a, b) = acc.split_at_mut(d.m * PANEL);
            let q = 2 * t;
            if q + 1 < num_panels {
                pair(q, [&mut *a, &mut *b]);
                // SAFETY: only this task computes panels q and q + 1.
                unsafe { write_panel(b, d, q + 1, out) };
            } else {
                panel(q, a);
            }
            // SAFETY: as above.
            unsafe { write_panel(a, d, q, out) };
        })
    });
}

/// Panel `q`'s sums `acc: [m, PANEL]` to its output columns.
///
/// # Safety
/// `out` is the product's `[m, n]` output, whose panel-`q` columns no other thread writes.
unsafe fn write_panel(acc: &[f32], d: Dims, q: usize, out: OutPtr) {
    let cols = PANEL.min(d.n - q * PANEL);
    for (i, row) in acc.chunks_exact(PANEL).enumerate() {
        // SAFETY: row i, columns q*32 .. q*32 + cols are inside out (caller).
        unsafe {
            std::ptr::copy_nonoverlapping(row.as_ptr(), out.get().add(i * d.n + q * PANEL), cols)
        };
    }
}

/// Panel `q` of `x · Wᵀ` (output columns `32q .. 32q + 32`) for all `m` rows into
/// `acc: [m, PANEL]`, on the calling thread.
///
/// The panel is walked in blocks of `KC` positions; each block (16–32 KiB) stays in L1 while
/// every tile of activation rows runs through it, the tiles' running sums carried in `acc`
/// between blocks. With more than one tile, the first tile stores a 16-bit block widened to
/// f32 as it streams it, so the other tiles' inner loop is loads and FMAs only. Every output is
/// the same FMA chain over `p = 0..k` in order whatever the tiling, so results do not depend on
/// the batch. With FP8 block scales a block is
/// one block of the weight (or a `KC` part of a wider one): its sums start from zero and are
/// added to the running sums as `partial · scale`.
#[cfg(target_arch = "x86_64")]
fn panel_product<T: Element>(
    isa: Isa,
    x: TiledRows<'_>,
    d: Dims,
    w: &PackedPanels<T>,
    q: usize,
    scales: PanelScales<'_>,
    acc: &mut [f32],
) {
    let blocks = match scales {
        PanelScales::Blocks { scales, block_cols } => {
            let per_panel = d.k.div_ceil(block_cols);
            Some((&scales[q * per_panel..(q + 1) * per_panel], block_cols))
        }
        PanelScales::None => None,
    };
    let widen = d.m > max_rows_per_tile(isa)
        && std::mem::size_of::<T>() < 4
        && (isa != Isa::Avx2 || <T as super::avx2::Lanes8>::WIDEN_ONCE);
    let panel = w.panel(q);
    let passes = passes_over_block(isa, x, d.m);
    // FP8: per weight block, in KC parts when it is wider.
    let step = match blocks {
        Some((_, cols)) if cols > KC && cols.is_multiple_of(KC) => KC,
        Some((_, cols)) => cols,
        None => KC,
    };
    BLOCK_SCRATCH.with_borrow_mut(|s| {
        let BlockScratch { wide, part } = s;
        for k0 in (0..d.k).step_by(step) {
            let kc = step.min(d.k - k0);
            let block = &panel[k0 * PANEL..(k0 + kc) * PANEL];
            let b = Block {
                x,
                d,
                k0,
                kc,
                first: k0 == 0 || blocks.is_some(),
                passes,
            };
            let sums = if blocks.is_some() {
                part.resize(d.m * PANEL, 0.0);
                &mut part[..]
            } else {
                &mut *acc
            };
            if widen {
                wide.resize(block.len(), 0.0);
                b.run_tiles_widening(isa, block, wide, sums);
            } else {
                b.run_tiles(isa, block, true, sums);
            }
            if let Some((scales, cols)) = blocks {
                let scale = scales[k0 / cols];
                for (a, p) in acc.iter_mut().zip(part.iter()) {
                    let base = if k0 == 0 { 0.0 } else { *a };
                    *a = base + p * scale;
                }
            }
        }
    })
}

/// How the activations of a product with `w` are quantized on `isa`, for the integer weights
/// (int8, int4) that multiply in integers; `None` for the others.
#[cfg(target_arch = "x86_64")]
pub(super) fn quantizer(isa: Isa, w: &PackedWeight) -> Option<Quantizer<'_>> {
    let kernel = || DotKernel::for_isa(isa).expect("integer weights run on the packed kernels");
    match w {
        PackedWeight::I8(_) => Some(Quantizer {
            kernel: kernel(),
            format: Format::Int8,
            order: None,
        }),
        PackedWeight::Int4(p) => Some(p.quantizer(kernel())),
        _ => None,
    }
}

/// `x · Wᵀ` for an integer weight: `x` quantized once into this thread's buffers (see
/// `intdot.rs`), then one task per panel.
#[cfg(target_arch = "x86_64")]
fn run_integer(how: Quantizer<'_>, x: &[f32], d: Dims, w: &PackedWeight, out: OutPtr) {
    let mut buf = QUANTIZED_X.take();
    let xq = buf.quantize(how, TiledRows::rows(x, d.m, d.k));
    run_panels(d.n.div_ceil(PANEL), d, out, |q, acc| {
        integer_panel_product(w, xq, q, acc)
    });
    QUANTIZED_X.set(buf);
}

/// Panel `q` of an integer weight's product with `xq`, its activations quantized as
/// [`quantizer`] says, into `acc: [m, PANEL]`.
#[cfg(target_arch = "x86_64")]
fn integer_panel_product(w: &PackedWeight, xq: QuantizedRows<'_>, q: usize, acc: &mut [f32]) {
    match w {
        PackedWeight::I8(p) => p.panel_product(xq, q, acc),
        PackedWeight::Int4(p) => p.panel_product(xq, q, acc),
        _ => unreachable!("not an integer weight"),
    }
}

/// Panel `q` of `x · Wᵀ` for a 4-bit weight (MXFP4) into `acc: [m, PANEL]`: each `KC`
/// block of positions widened by `widen(k0, kc, dst)` to the f32 of the dequantised weights,
/// then every row tile through it as through an f32 panel — the same FMA chain, so the same
/// bits as the dequantised weights give, whatever the batch.
#[cfg(target_arch = "x86_64")]
fn widened_panel_product(
    isa: Isa,
    x: TiledRows<'_>,
    d: Dims,
    q: usize,
    acc: &mut [f32],
    widen: impl Fn(usize, usize, &mut [f32]),
) {
    // MXFP4's blocks of 32 never straddle a KC block.
    const _: () = assert!(KC.is_multiple_of(super::mxfp4::BLOCK));
    debug_assert!(q < d.n.div_ceil(PANEL));
    let passes = passes_over_block(isa, x, d.m);
    BLOCK_SCRATCH.with_borrow_mut(|s| {
        for k0 in (0..d.k).step_by(KC) {
            let kc = KC.min(d.k - k0);
            s.wide.resize(kc * PANEL, 0.0);
            widen(k0, kc, &mut s.wide);
            let b = Block {
                x,
                d,
                k0,
                kc,
                first: k0 == 0,
                passes,
            };
            b.run_tiles(isa, &s.wide, false, acc);
        }
    })
}

/// Panel positions per block: a bf16 block is 8 KiB, widened 16 KiB, beside ≤ 6 KiB of
/// activations, well inside a 48 KiB L1. 128 beat 256 (whose widened block and activations
/// filled 44 of the 48 KiB) by ≈ 8 % in prefill and 5 % in 8-sequence decode steps (alternating
/// runs, tiled activations).
pub(super) const KC: usize = 128;

/// Per-thread buffers of [`panel_product`] reused across calls: a widened block
/// (`KC × PANEL`) and one block's sums before scaling (FP8, `m × PANEL`).
#[derive(Default)]
struct BlockScratch {
    wide: Vec<f32>,
    part: Vec<f32>,
}

/// Makes this thread's task buffers hold products of up to `max_rows` rows without growing
/// (see [`super::reserve_task_scratch`]).
pub(super) fn reserve_task_scratch(max_rows: usize) {
    BLOCK_SCRATCH.with_borrow_mut(|s| {
        reserve(&mut s.wide, KC * PANEL);
        reserve(&mut s.part, max_rows * PANEL);
    });
    // Two panels of one row where they stream in pairs.
    PANEL_OUT.with_borrow_mut(|acc| reserve(acc, max_rows.max(2) * PANEL));
}

/// `buf` with room for `len` elements.
pub(super) fn reserve(buf: &mut Vec<f32>, len: usize) {
    buf.reserve(len.saturating_sub(buf.len()));
}

thread_local! {
    static BLOCK_SCRATCH: std::cell::RefCell<BlockScratch> =
        std::cell::RefCell::new(BlockScratch::default());
    /// A panel's `m × PANEL` sums in [`run_packed`].
    static PANEL_OUT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The activations of [`matmul_wt`] in tile order.
    static TILED_X: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The activations of an integer [`matmul_wt`], quantized.
    static QUANTIZED_X: std::cell::RefCell<IntActivations> =
        std::cell::RefCell::new(IntActivations::default());
}

/// An element type both SIMD microkernels widen.
#[cfg(target_arch = "x86_64")]
pub(super) trait Element: super::avx512::Lanes + super::avx2::Lanes8 {}
#[cfg(target_arch = "x86_64")]
impl<T: super::avx512::Lanes + super::avx2::Lanes8> Element for T {}

/// The most activation rows one microkernel call of `isa` takes.
fn max_rows_per_tile(isa: Isa) -> usize {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => super::avx2::MAX_MR,
        _ => MAX_MR,
    }
}

/// The weight-stream lines one block's row tiles prefetch: the block's own size in bytes,
/// [`PREFETCH_BYTES`](super::avx512::PREFETCH_BYTES) ahead of it, shared out evenly over every
/// pass the tiles make over the block (a tile of more than three rows makes two on AVX2).
///
/// A product of many rows reads a block from memory in its first pass and from L1 in the
/// others; prefetching only in the first pass asked for a block's worth of lines in a burst,
/// at the rate of the FMAs, then nothing while the other passes ran — bursts beyond what the
/// memory delivers. Spread over every pass the requests arrive at the average rate. With one
/// pass (batch 1) it is the same stream as before: `PREFETCH_BYTES` ahead of each position.
#[derive(Clone, Copy)]
struct StreamShare {
    /// The first byte to prefetch.
    start: *const u8,
    /// Bytes between two prefetches (0: none), equal for every position of every pass.
    step: usize,
    /// Positions per pass.
    kc: usize,
}

#[cfg(target_arch = "x86_64")]
impl StreamShare {
    fn of_block<U>(b: Block<'_>, block: &[U], prefetch: bool) -> Self {
        debug_assert_eq!(block.len(), b.kc * PANEL);
        // The block's bytes over its passes' positions: a position's bytes over the passes.
        let position = PANEL * std::mem::size_of::<U>();
        let step = match b.passes {
            _ if !prefetch => 0,
            1 => position,
            passes => position.div_ceil(passes),
        };
        let start = block.as_ptr().cast::<u8>();
        Self {
            start: start.wrapping_add(super::avx512::PREFETCH_BYTES),
            step,
            kc: b.kc,
        }
    }

    /// Where the prefetches of a tile whose first pass is the block's `pass`-th begin, and
    /// their step.
    fn starting_at_pass(&self, pass: usize) -> (*const u8, usize) {
        (
            self.start.wrapping_add(pass * self.kc * self.step),
            self.step,
        )
    }
}

/// Passes all row tiles of `m` rows of `x` make over a block.
#[cfg(target_arch = "x86_64")]
fn passes_over_block(isa: Isa, x: TiledRows<'_>, m: usize) -> usize {
    row_tiles(m, x.max_mr)
        .map(|(_, mr)| passes_per_tile(isa, mr))
        .sum()
}

/// Passes a tile of `mr` rows makes over a block: two for AVX2's half-panel tiles.
#[cfg(target_arch = "x86_64")]
fn passes_per_tile(isa: Isa, mr: usize) -> usize {
    if isa == Isa::Avx2 && mr > super::avx2::MAX_FULL_WIDTH_MR {
        2
    } else {
        1
    }
}

/// One block of positions `k0 .. k0 + kc` of a panel.
#[derive(Clone, Copy)]
struct Block<'a> {
    x: TiledRows<'a>,
    d: Dims,
    k0: usize,
    kc: usize,
    first: bool,
    /// The passes its row tiles make over it ([`passes_over_block`], once per product).
    passes: usize,
}

#[cfg(target_arch = "x86_64")]
impl Block<'_> {
    /// Every row tile through `block` (`kc × PANEL` elements), sums carried in `acc`.
    /// `prefetch`: `block` is the weight stream itself (not a widened copy), whose lines ahead
    /// the tiles prefetch ([`StreamShare`]).
    fn run_tiles<U: Element>(self, isa: Isa, block: &[U], prefetch: bool, acc: &mut [f32]) {
        let share = StreamShare::of_block(self, block, prefetch);
        let mut pass = 0;
        for tile in row_tiles(self.d.m, self.x.max_mr) {
            // SAFETY: the caller's `isa` is supported; the block is kc × 32 elements.
            unsafe {
                self.tile::<U, false>(
                    isa,
                    tile,
                    block.as_ptr(),
                    share.starting_at_pass(pass),
                    std::ptr::null_mut(),
                    acc,
                )
            };
            pass += passes_per_tile(isa, tile.1);
        }
    }

    /// [`Self::run_tiles`] of a 16- or 8-bit `block` for more rows than one tile: the first
    /// tile reads the weight stream and writes each position widened to f32 into `wide` as it
    /// goes, the others read `wide` from L1 — the stream's misses overlap the first tile's
    /// FMAs instead of stalling a separate widening pass, and the widening is done once. On
    /// AVX2 only for element types whose conversion costs several instructions
    /// ([`super::avx2::Lanes8::WIDEN_ONCE`]).
    fn run_tiles_widening<U: Element>(
        self,
        isa: Isa,
        block: &[U],
        wide: &mut [f32],
        acc: &mut [f32],
    ) {
        debug_assert_eq!(block.len(), wide.len());
        let wide = wide.as_mut_ptr();
        let share = StreamShare::of_block(self, block, true);
        let mut pass = 0;
        for (t, tile) in row_tiles(self.d.m, self.x.max_mr).enumerate() {
            // SAFETY: the caller's `isa` is supported; the block and `wide` are kc × 32
            // elements, and the first tile writes `wide` before the others read it.
            unsafe {
                if t == 0 {
                    self.tile::<U, true>(
                        isa,
                        tile,
                        block.as_ptr(),
                        share.starting_at_pass(0),
                        wide,
                        acc,
                    )
                } else {
                    self.tile::<f32, false>(
                        isa,
                        tile,
                        wide.cast_const(),
                        share.starting_at_pass(pass),
                        std::ptr::null_mut(),
                        acc,
                    )
                }
            }
            pass += passes_per_tile(isa, tile.1);
        }
    }

    /// The row tile `(i0, mr)` through the block at `w`; with `WIDEN`, also the block
    /// widened into `widen_to`.
    ///
    /// # Safety
    /// `isa` is supported; `w` (and `widen_to` with `WIDEN`) cover kc × 32 elements.
    unsafe fn tile<U: Element, const WIDEN: bool>(
        self,
        isa: Isa,
        (i0, mr): (usize, usize),
        w: *const U,
        (prefetch, prefetch_step): (*const u8, usize),
        widen_to: *mut f32,
        acc: &mut [f32],
    ) {
        use super::avx512::{PanelTile, panel_tile};
        let t = PanelTile {
            x: self.x.data[i0 * self.d.k + self.k0 * mr..].as_ptr(),
            w,
            kc: self.kc,
            acc: acc[i0 * PANEL..(i0 + mr) * PANEL].as_mut_ptr(),
            first: self.first,
            prefetch,
            prefetch_step,
            widen_to,
        };
        // SAFETY: the caller's `isa` is supported; x holds the tile's kc positions from k0
        // (mr each), the block kc × 32 elements (caller), acc mr × 32.
        unsafe {
            if isa == Isa::Avx2 {
                use super::avx2::{half_panel_tile as half, panel_tile as full};
                // A widening tile is a product's first, of more rows than a full-width tile
                // (which would not widen, and the others would read an unwritten block).
                assert!(!WIDEN || mr > super::avx2::MAX_FULL_WIDTH_MR);
                return match mr {
                    6 => half::<U, 6, WIDEN>(t),
                    5 => half::<U, 5, WIDEN>(t),
                    4 => half::<U, 4, WIDEN>(t),
                    3 => full::<U, 3>(t),
                    2 => full::<U, 2>(t),
                    1 => full::<U, 1>(t),
                    _ => unreachable!("AVX2 row tiles hold 1..=6 rows"),
                };
            }
            match mr {
                12 => panel_tile::<U, 12, WIDEN>(t),
                11 => panel_tile::<U, 11, WIDEN>(t),
                10 => panel_tile::<U, 10, WIDEN>(t),
                9 => panel_tile::<U, 9, WIDEN>(t),
                8 => panel_tile::<U, 8, WIDEN>(t),
                7 => panel_tile::<U, 7, WIDEN>(t),
                6 => panel_tile::<U, 6, WIDEN>(t),
                5 => panel_tile::<U, 5, WIDEN>(t),
                4 => panel_tile::<U, 4, WIDEN>(t),
                3 => panel_tile::<U, 3, WIDEN>(t),
                2 => panel_tile::<U, 2, WIDEN>(t),
                1 => panel_tile::<U, 1, WIDEN>(t),
                _ => unreachable!("row tiles hold 1..={MAX_MR} rows"),
            }
        }
    }
}

#[cfg(test)]
mod tests;
