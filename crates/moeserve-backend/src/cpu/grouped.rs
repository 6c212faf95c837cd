//! The grouped expert GEMM: all routed experts of one MoE layer computed as one job, each
//! expert's weights read once for all of its rows.
//!
//! `out = w2 · (silu(w1 · x) * (w3 · x))` per expert (HF `MixtralBlockSparseTop2MLP`) in two
//! parallel phases over (expert, 32-column panel) tasks: gate and up projections of a panel
//! together with SwiGLU applied while the panel is in cache (one pass over the activations),
//! then the down projection. Two fork-joins per layer instead of three per expert, and the
//! threads balance across experts of different sizes. Every output is the same FMA chain as
//! [`super::matmul_wt`] computes, so grouping changes no result.

use rayon::prelude::*;

use super::matmul::{OutPtr, TiledRows};
use super::packed::PANEL;
use super::{matmul_wt, silu_mul};
use crate::Weight;

/// One expert's share of a grouped SwiGLU: the next `rows` rows of the input.
#[derive(Clone, Copy)]
pub struct ExpertRows<'a> {
    pub rows: usize,
    /// gate projection `[intermediate, hidden]`
    pub w1: &'a Weight,
    /// up projection `[intermediate, hidden]`
    pub w3: &'a Weight,
    /// down projection `[hidden, intermediate]`
    pub w2: &'a Weight,
}

/// `x: [Σ rows, hidden]`, experts' rows consecutive in `experts` order → `out` of the same shape.
pub fn grouped_swiglu(x: &[f32], experts: &[ExpertRows<'_>], out: &mut [f32]) {
    let Some(first) = experts.first() else {
        assert!(
            x.is_empty() && out.is_empty(),
            "grouped_swiglu: rows without experts"
        );
        return;
    };
    let hidden = first.w1.shape()[1];
    let total: usize = experts.iter().map(|e| e.rows).sum();
    assert_eq!(
        x.len(),
        total * hidden,
        "grouped_swiglu: x is not [rows, hidden]"
    );
    assert_eq!(out.len(), x.len(), "grouped_swiglu: out must match x");
    for e in experts {
        let inter = e.w1.shape()[0];
        assert!(
            e.w1.shape() == [inter, hidden]
                && e.w3.shape() == [inter, hidden]
                && e.w2.shape() == [hidden, inter],
            "grouped_swiglu: expert shapes {:?} {:?} {:?} for hidden {hidden}",
            e.w1.shape(),
            e.w3.shape(),
            e.w2.shape()
        );
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa().packs_weights() {
        by_panels(x, hidden, experts, out);
        return;
    }
    one_expert_at_a_time(x, hidden, experts, out);
}

/// The portable path: three GEMMs per expert.
fn one_expert_at_a_time(x: &[f32], hidden: usize, experts: &[ExpertRows<'_>], out: &mut [f32]) {
    let mut row = 0;
    for e in experts {
        let rows = row * hidden..(row + e.rows) * hidden;
        let inter = e.w1.shape()[0];
        let mut gate = vec![0.0; e.rows * inter];
        let mut up = vec![0.0; e.rows * inter];
        matmul_wt(&x[rows.clone()], e.rows, e.w1, &mut gate);
        matmul_wt(&x[rows.clone()], e.rows, e.w3, &mut up);
        silu_mul(&mut gate, &up);
        matmul_wt(&gate, e.rows, e.w2, &mut out[rows]);
        row += e.rows;
    }
}

/// Where one expert's rows sit: in `x`/`out` (row offset) and in the SwiGLU buffer.
#[derive(Clone, Copy)]
struct Placed<'a> {
    e: ExpertRows<'a>,
    first_row: usize,
    /// Offset of its `[rows, intermediate]` block in the SwiGLU buffer.
    act_offset: usize,
}

#[cfg(target_arch = "x86_64")]
fn by_panels(x: &[f32], hidden: usize, experts: &[ExpertRows<'_>], out: &mut [f32]) {
    let mut placed = Vec::with_capacity(experts.len());
    let (mut row, mut act_len) = (0, 0);
    for e in experts.iter().filter(|e| e.rows > 0) {
        placed.push(Placed {
            e: *e,
            first_row: row,
            act_offset: act_len,
        });
        row += e.rows;
        act_len += e.rows * e.w1.shape()[0];
    }
    // Every element of `act` is written in phase 1, so the buffer is reused unzeroed. It is
    // taken out of the thread-local, not borrowed: while this thread waits for the phases it
    // may run another layer's job (expert-parallel devices, concurrent forwards), which then
    // starts from an empty buffer of its own.
    let (mut act, mut tiled) = (ACT.take(), TILED_X.take());
    if act.len() < act_len {
        act.resize(act_len, 0.0);
    }
    tiled.resize(x.len(), 0.0);
    let isa = super::isa();
    for p in &placed {
        let rows = p.first_row * hidden..(p.first_row + p.e.rows) * hidden;
        TiledRows::pack_into(isa, &x[rows.clone()], p.e.rows, hidden, &mut tiled[rows]);
    }
    two_phases(&tiled, hidden, &placed, &mut act[..act_len], out);
    ACT.set(act);
    TILED_X.set(tiled);
}

/// `x` is in tile order per expert; `act` is written in tile order per expert.
#[cfg(target_arch = "x86_64")]
fn two_phases(x: &[f32], hidden: usize, placed: &[Placed<'_>], act: &mut [f32], out: &mut [f32]) {
    use super::matmul::weight_panel;

    let isa = super::isa();
    let act_ptr = OutPtr(act.as_mut_ptr());
    let out_ptr = OutPtr(out.as_mut_ptr());
    let tasks = |panels_of: fn(&ExpertRows<'_>) -> usize| {
        placed
            .par_iter()
            .flat_map(move |p| (0..panels_of(&p.e)).into_par_iter().map(move |q| (*p, q)))
    };
    // Phase 1: act = silu(x · w1ᵀ) * (x · w3ᵀ), one panel of both at a time.
    tasks(|e| e.w1.shape()[0].div_ceil(PANEL)).for_each(|(p, q)| {
        let inter = p.e.w1.shape()[0];
        let xe = &x[p.first_row * hidden..(p.first_row + p.e.rows) * hidden];
        let xe = TiledRows::already_tiled(isa, xe, p.e.rows, hidden);
        GATE_UP.with_borrow_mut(|(gate, up)| {
            gate.resize(p.e.rows * PANEL, 0.0);
            up.resize(p.e.rows * PANEL, 0.0);
            weight_panel(isa, xe, p.e.w1, q, gate);
            weight_panel(isa, xe, p.e.w3, q, up);
            silu_mul(gate, up);
            let cols = PANEL.min(inter - q * PANEL);
            // SAFETY: positions 32q .. 32q + cols of this expert's `[rows, inter]` block are
            // inside `act` and written by this task only.
            unsafe {
                TiledRows::scatter_columns(
                    isa,
                    gate,
                    (p.e.rows, inter),
                    (q * PANEL, cols),
                    act_ptr.get().add(p.act_offset),
                )
            };
        })
    });
    // Phase 2: out = act · w2ᵀ.
    tasks(|e| e.w2.shape()[0].div_ceil(PANEL)).for_each(|(p, q)| {
        let inter = p.e.w1.shape()[0];
        let ae = &act[p.act_offset..p.act_offset + p.e.rows * inter];
        let ae = TiledRows::already_tiled(isa, ae, p.e.rows, inter);
        GATE_UP.with_borrow_mut(|(down, _)| {
            down.resize(p.e.rows * PANEL, 0.0);
            weight_panel(isa, ae, p.e.w2, q, down);
            let cols = PANEL.min(hidden - q * PANEL);
            for (i, d) in down.chunks_exact(PANEL).enumerate() {
                // SAFETY: row first_row + i, columns 32q .. 32q + cols are inside `out` and
                // written by this task only.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        d.as_ptr(),
                        out_ptr.get().add((p.first_row + i) * hidden + q * PANEL),
                        cols,
                    )
                };
            }
        })
    });
}

thread_local! {
    /// The SwiGLU activations `[rows, intermediate]` of every expert (tile order), between
    /// the phases.
    static ACT: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// The input rows of every expert in tile order.
    static TILED_X: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    /// A task's gate and up panels (`rows × PANEL` each); the down panel reuses the first.
    static GATE_UP: std::cell::RefCell<(Vec<f32>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::reference::{pseudo_random, weight_of};
    use moeserve_core::DType;

    fn bf16_weight(n: usize, k: usize, seed: u32) -> Weight {
        weight_of(DType::BF16, vec![n, k], &pseudo_random(n * k, seed))
    }

    #[test]
    fn equals_three_gemms_per_expert_bit_for_bit() {
        let (hidden, inter) = (80, 100); // neither a multiple of the 32-column panel
        let weights: Vec<[Weight; 3]> = (0..3)
            .map(|e| {
                [
                    bf16_weight(inter, hidden, 10 * e + 1),
                    bf16_weight(inter, hidden, 10 * e + 2),
                    bf16_weight(hidden, inter, 10 * e + 3),
                ]
            })
            .collect();
        // Row counts spanning one tile, several tiles, none, and one.
        let rows = [5, 30, 0, 1];
        let experts: Vec<ExpertRows<'_>> = rows
            .iter()
            .zip(weights.iter().cycle())
            .map(|(&rows, [w1, w3, w2])| ExpertRows { rows, w1, w3, w2 })
            .collect();
        let total: usize = rows.iter().sum();
        let x = pseudo_random(total * hidden, 7);
        let mut grouped = vec![f32::NAN; x.len()];
        grouped_swiglu(&x, &experts, &mut grouped);
        let mut want = vec![0.0; x.len()];
        one_expert_at_a_time(&x, hidden, &experts, &mut want);
        assert_eq!(grouped, want);
    }
}
