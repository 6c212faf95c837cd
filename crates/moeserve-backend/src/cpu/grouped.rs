//! The grouped expert GEMM: all routed experts of one MoE layer computed as one job, each
//! expert's weights read once for all of its rows.
//!
//! `out = w2 · (silu(w1 · x) * (w3 · x))` per expert (HF `MixtralBlockSparseTop2MLP`), or with
//! biases on the three projections and GPT-OSS's clamped activation ([`GatedActivation`]), in two
//! parallel phases over (expert, 32-column panel) tasks: gate and up projections of a panel
//! together with SwiGLU applied while the panel is in cache (one pass over the activations),
//! then the down projection. Two fork-joins per layer instead of three per expert, and the
//! threads balance across experts of different sizes. Every output is the same FMA chain as
//! [`super::matmul_wt`] computes, so grouping changes no result.

use rayon::prelude::*;

use super::intdot::{IntActivations, Quantizer, SERIAL_QUANTIZE, quantized_len};
#[cfg(target_arch = "x86_64")]
use super::matmul::pairs_panels;
use super::matmul::{OutPtr, TiledRows};
use super::packed::PANEL;
use super::{GatedActivation, matmul_wt};
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
    /// Biases of the three projections (GPT-OSS), added before the activation and to the
    /// output.
    pub bias: Option<&'a ExpertBias>,
    pub activation: GatedActivation,
}

/// An expert's projection biases, `[intermediate]`, `[intermediate]` and `[hidden]`, in f32.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertBias {
    pub gate: Vec<f32>,
    pub up: Vec<f32>,
    pub down: Vec<f32>,
}

impl ExpertBias {
    /// Adds `bias[first..first + cols]` to the leading `cols` columns of every `width`-wide row
    /// of `rows`.
    fn add_columns(bias: &[f32], first: usize, cols: usize, width: usize, rows: &mut [f32]) {
        let b = &bias[first..first + cols];
        for row in rows.chunks_exact_mut(width) {
            row[..cols].iter_mut().zip(b).for_each(|(x, b)| *x += b);
        }
    }
}

/// The experts of a grouped SwiGLU in row order: a slice of [`ExpertRows`], or a view that
/// makes them on demand (the MoE layer's segments), so a step builds no list of them.
pub trait ExpertGroup: Sync {
    fn num_experts(&self) -> usize;
    fn expert(&self, i: usize) -> ExpertRows<'_>;
}

impl ExpertGroup for [ExpertRows<'_>] {
    fn num_experts(&self) -> usize {
        self.len()
    }
    fn expert(&self, i: usize) -> ExpertRows<'_> {
        self[i]
    }
}

/// The buffers of a grouped SwiGLU that live across its phases: where each expert's rows sit,
/// the input rows in tile order and the SwiGLU activations. A step's workspace keeps one, so
/// steps allocate nothing once it has seen one as large.
#[derive(Default)]
pub struct GroupedScratch {
    placed: Vec<Placed>,
    tiled: Vec<f32>,
    act: Vec<f32>,
    /// Activations quantized for integer experts (int8, int4), by [`Projection`]: the input
    /// rows for the gate projections, for the up projections where they read them in
    /// another order (int4 act-order), and the SwiGLU activations for the down projections.
    quantized: [IntActivations; 3],
}

/// An expert's three projections, in the order of [`GroupedScratch::quantized`].
#[derive(Clone, Copy, PartialEq, Eq)]
enum Projection {
    Gate = 0,
    Up = 1,
    Down = 2,
}

impl Projection {
    fn weight<'e>(self, e: &ExpertRows<'e>) -> &'e Weight {
        match self {
            Projection::Gate => e.w1,
            Projection::Up => e.w3,
            Projection::Down => e.w2,
        }
    }

    /// How `e`'s rows are quantized for this projection, when it is an integer one.
    #[cfg(target_arch = "x86_64")]
    fn quantizer<'e>(self, e: &ExpertRows<'e>) -> Option<Quantizer<'e>> {
        super::matmul::quantizer(super::isa(), self.weight(e).packed())
    }
}

/// `x: [Σ rows, hidden]`, experts' rows consecutive in `experts` order → `out` of the same shape.
pub fn grouped_swiglu<G: ExpertGroup + ?Sized>(x: &[f32], experts: &G, out: &mut [f32]) {
    // Taken out of the thread-local, not borrowed: while this thread waits for the phases it
    // may run another layer's job (expert-parallel devices, concurrent forwards), which then
    // starts from empty buffers of its own.
    let mut scratch = SCRATCH.take();
    grouped_swiglu_in(x, experts, out, &mut scratch);
    SCRATCH.set(scratch);
}

/// [`grouped_swiglu`] with the caller's buffers.
pub fn grouped_swiglu_in<G: ExpertGroup + ?Sized>(
    x: &[f32],
    experts: &G,
    out: &mut [f32],
    scratch: &mut GroupedScratch,
) {
    let n = experts.num_experts();
    if n == 0 {
        assert!(
            x.is_empty() && out.is_empty(),
            "grouped_swiglu: rows without experts"
        );
        return;
    }
    let hidden = experts.expert(0).w1.shape()[1];
    let total: usize = (0..n).map(|i| experts.expert(i).rows).sum();
    assert_eq!(
        x.len(),
        total * hidden,
        "grouped_swiglu: x is not [rows, hidden]"
    );
    assert_eq!(out.len(), x.len(), "grouped_swiglu: out must match x");
    for e in (0..n).map(|i| experts.expert(i)) {
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
        if let Some(b) = e.bias {
            assert!(
                b.gate.len() == inter && b.up.len() == inter && b.down.len() == hidden,
                "grouped_swiglu: bias lengths {} {} {} for [{inter}, {hidden}]",
                b.gate.len(),
                b.up.len(),
                b.down.len()
            );
        }
    }
    #[cfg(target_arch = "x86_64")]
    if super::isa().packs_weights() {
        by_panels(x, hidden, experts, out, scratch);
        return;
    }
    one_expert_at_a_time(x, hidden, experts, out, scratch);
}

/// The portable path: three GEMMs per expert.
fn one_expert_at_a_time<G: ExpertGroup + ?Sized>(
    x: &[f32],
    hidden: usize,
    experts: &G,
    out: &mut [f32],
    scratch: &mut GroupedScratch,
) {
    // The gate and up projections of one expert at a time in the scratch's two buffers.
    let (gate, up) = (&mut scratch.act, &mut scratch.tiled);
    let mut row = 0;
    for e in (0..experts.num_experts()).map(|i| experts.expert(i)) {
        let rows = row * hidden..(row + e.rows) * hidden;
        let inter = e.w1.shape()[0];
        gate.resize(e.rows * inter, 0.0);
        up.resize(e.rows * inter, 0.0);
        matmul_wt(&x[rows.clone()], e.rows, e.w1, gate);
        matmul_wt(&x[rows.clone()], e.rows, e.w3, up);
        if let Some(b) = e.bias {
            ExpertBias::add_columns(&b.gate, 0, inter, inter, gate);
            ExpertBias::add_columns(&b.up, 0, inter, inter, up);
        }
        e.activation.apply(gate, up);
        let out = &mut out[rows];
        matmul_wt(gate, e.rows, e.w2, out);
        if let Some(b) = e.bias {
            ExpertBias::add_columns(&b.down, 0, hidden, hidden, out);
        }
        row += e.rows;
    }
}

/// Where one expert's rows sit: in `x`/`out` (row offset) and in the SwiGLU buffer.
#[derive(Clone, Copy)]
struct Placed {
    /// Index in the expert group.
    expert: usize,
    first_row: usize,
    /// Offset of its `[rows, intermediate]` block in the SwiGLU buffer.
    act_offset: usize,
    /// Offsets (words, metadata entries) of its rows quantized for each [`Projection`], where
    /// that is an integer one; the up projection's `None` too where it reads the gate's.
    quantized: [Option<(usize, usize)>; 3],
    /// The up projection multiplies the rows quantized for the gate (the same order).
    up_reads_gate: bool,
}

#[cfg(target_arch = "x86_64")]
fn by_panels<G: ExpertGroup + ?Sized>(
    x: &[f32],
    hidden: usize,
    experts: &G,
    out: &mut [f32],
    scratch: &mut GroupedScratch,
) {
    let GroupedScratch {
        placed,
        tiled,
        act,
        quantized,
    } = scratch;
    placed.clear();
    let (mut row, mut act_len) = (0, 0);
    // Words and metadata entries of each projection's quantized rows, all experts.
    let mut lens = [(0, 0); 3];
    for i in 0..experts.num_experts() {
        let e = experts.expert(i);
        if e.rows == 0 {
            continue;
        }
        let inter = e.w1.shape()[0];
        let (gate, up) = (Projection::Gate.quantizer(&e), Projection::Up.quantizer(&e));
        let up_reads_gate = matches!((gate, up), (Some(g), Some(u)) if g.same_as(&u));
        let mut place = |which: Projection, how: Option<Quantizer<'_>>, k: usize| {
            let how = how?;
            let at = lens[which as usize];
            let (words, meta) = quantized_len(how.format, e.rows, how.len(k));
            lens[which as usize] = (at.0 + words, at.1 + meta);
            Some(at)
        };
        let quantized = [
            place(Projection::Gate, gate, hidden),
            place(Projection::Up, up.filter(|_| !up_reads_gate), hidden),
            place(Projection::Down, Projection::Down.quantizer(&e), inter),
        ];
        placed.push(Placed {
            expert: i,
            first_row: row,
            act_offset: act_len,
            quantized,
            up_reads_gate,
        });
        row += e.rows;
        act_len += e.rows * inter;
    }
    // Every element of `act` is written in phase 1, so the buffer is reused unzeroed.
    if act.len() < act_len {
        act.resize(act_len, 0.0);
    }
    tiled.resize(x.len(), 0.0);
    let isa = super::isa();
    for p in placed.iter() {
        let rows = experts.expert(p.expert).rows;
        let range = p.first_row * hidden..(p.first_row + rows) * hidden;
        TiledRows::pack_into(isa, &x[range.clone()], rows, hidden, &mut tiled[range]);
    }
    let groups = Groups { experts, placed };
    two_phases(
        tiled,
        hidden,
        &groups,
        &mut act[..act_len],
        out,
        (quantized, lens),
    );
}

impl<G: ExpertGroup + ?Sized> Groups<'_, G> {
    /// Every expert's rows of `data` (`[rows, k]` at the offset and width `rows` gives, in
    /// tile order) quantized for projection `which` into `buf`, at the offsets placed for it
    /// (sized `len` in all); experts, and a large expert's rows, in parallel. Nothing when no
    /// expert's projection is an integer one.
    #[cfg(target_arch = "x86_64")]
    fn quantize(
        &self,
        which: Projection,
        data: &[f32],
        rows: impl Fn(&Placed, &ExpertRows<'_>) -> (usize, usize) + Sync,
        buf: &mut IntActivations,
        len: (usize, usize),
    ) {
        if len == (0, 0) {
            return;
        }
        let out = buf.prepare(len.0, len.1);
        let isa = super::isa();
        let expert = |p: &Placed| {
            let Some(at) = p.quantized[which as usize] else {
                return;
            };
            let e = self.experts.expert(p.expert);
            let how = which
                .quantizer(&e)
                .expect("placed for an integer projection");
            let (start, k) = rows(p, &e);
            let x = TiledRows::already_tiled(isa, &data[start..start + e.rows * k], e.rows, k);
            // SAFETY: each expert's block lies at its own offsets inside `out` (sized by
            // `len`), and each row is written once.
            let row = |i| unsafe { out.quantize_row(how, x, i, at) };
            if e.rows * k < SERIAL_QUANTIZE {
                (0..e.rows).for_each(row);
            } else {
                (0..e.rows).into_par_iter().for_each(row);
            }
        };
        let size = |p: &Placed| {
            let e = self.experts.expert(p.expert);
            e.rows * rows(p, &e).1
        };
        let total: usize = self.placed.iter().map(size).sum();
        if total < SERIAL_QUANTIZE {
            self.placed.iter().for_each(expert);
        } else {
            self.placed.par_iter().for_each(expert);
        }
    }

    /// Expert `p`'s rows as quantized for projection `which` (`None`: not an integer one).
    #[cfg(target_arch = "x86_64")]
    fn quantized<'b>(
        &self,
        bufs: [&'b IntActivations; 3],
        which: Projection,
        p: &Placed,
        e: &ExpertRows<'_>,
        k: usize,
    ) -> Option<super::intdot::QuantizedRows<'b>> {
        let from = if which == Projection::Up && p.up_reads_gate {
            Projection::Gate
        } else {
            which
        };
        let at = p.quantized[from as usize]?;
        let how = from.quantizer(e)?;
        Some(bufs[from as usize].rows(how.kernel, how.format, at, e.rows, how.len(k)))
    }
}

/// The non-empty experts of a grouped SwiGLU with where their rows sit.
struct Groups<'g, G: ?Sized> {
    experts: &'g G,
    placed: &'g [Placed],
}

impl<G: ExpertGroup + ?Sized> Groups<'_, G> {
    /// The `(expert rows, placement)` of every task of one phase: each non-empty expert's
    /// 32-column panels (`panels_of` counts them).
    fn tasks(
        &self,
        panels_of: fn(&ExpertRows<'_>) -> usize,
    ) -> impl ParallelIterator<Item = (ExpertRows<'_>, Placed, usize)> {
        self.placed.par_iter().flat_map(move |p| {
            let e = self.experts.expert(p.expert);
            (0..panels_of(&e)).into_par_iter().map(move |q| (e, *p, q))
        })
    }
}

/// `x` is in tile order per expert; `act` is written in tile order per expert.
#[cfg(target_arch = "x86_64")]
fn two_phases<G: ExpertGroup + ?Sized>(
    x: &[f32],
    hidden: usize,
    groups: &Groups<'_, G>,
    act: &mut [f32],
    out: &mut [f32],
    (quantized, lens): (&mut [IntActivations; 3], [(usize, usize); 3]),
) {
    use super::matmul::{weight_panel, weight_panel_pair};

    let isa = super::isa();
    // The input rows quantized once for the integer gate and up projections.
    let [gate_q, up_q, down_q] = quantized;
    let rows = |p: &Placed, _: &ExpertRows<'_>| (p.first_row * hidden, hidden);
    groups.quantize(Projection::Gate, x, rows, gate_q, lens[0]);
    groups.quantize(Projection::Up, x, rows, up_q, lens[1]);
    let bufs = [&*gate_q, &*up_q, &*down_q];
    let act_ptr = OutPtr(act.as_mut_ptr());
    let out_ptr = OutPtr(out.as_mut_ptr());
    // Phase 1: act = silu(x · w1ᵀ) * (x · w3ᵀ), one panel of both at a time.
    groups
        .tasks(|e| e.w1.shape()[0].div_ceil(PANEL))
        .for_each(|(e, p, q)| {
            let inter = e.w1.shape()[0];
            let xe = &x[p.first_row * hidden..(p.first_row + e.rows) * hidden];
            let xe = TiledRows::already_tiled(isa, xe, e.rows, hidden);
            let gate_x = groups.quantized(bufs, Projection::Gate, &p, &e, hidden);
            let up_x = groups.quantized(bufs, Projection::Up, &p, &e, hidden);
            GATE_UP.with_borrow_mut(|(gate, up)| {
                gate.resize(e.rows * PANEL, 0.0);
                up.resize(e.rows * PANEL, 0.0);
                let pair = [(e.w1, q, gate_x), (e.w3, q, up_x)];
                weight_panel_pair(isa, xe, pair, gate, up);
                let cols = PANEL.min(inter - q * PANEL);
                if let Some(b) = e.bias {
                    ExpertBias::add_columns(&b.gate, q * PANEL, cols, PANEL, gate);
                    ExpertBias::add_columns(&b.up, q * PANEL, cols, PANEL, up);
                }
                e.activation.apply(gate, up);
                // SAFETY: positions 32q .. 32q + cols of this expert's `[rows, inter]` block are
                // inside `act` and written by this task only.
                unsafe {
                    TiledRows::scatter_columns(
                        isa,
                        gate,
                        (e.rows, inter),
                        (q * PANEL, cols),
                        act_ptr.get().add(p.act_offset),
                    )
                };
            })
        });
    // The activations quantized once for the integer down projections.
    let rows = |p: &Placed, e: &ExpertRows<'_>| (p.act_offset, e.w1.shape()[0]);
    groups.quantize(Projection::Down, act, rows, down_q, lens[2]);
    let bufs = [&*gate_q, &*up_q, &*down_q];
    // Phase 2: out = act · w2ᵀ, a task's panels streamed together where they pair.
    groups
        .tasks(|e| {
            e.w2.shape()[0]
                .div_ceil(PANEL)
                .div_ceil(down_panels_per_task(e))
        })
        .for_each(|(e, p, t)| {
            let inter = e.w1.shape()[0];
            let ae = &act[p.act_offset..p.act_offset + e.rows * inter];
            let ae = TiledRows::already_tiled(isa, ae, e.rows, inter);
            let aq = groups.quantized(bufs, Projection::Down, &p, &e, inter);
            let first = t * down_panels_per_task(&e);
            let panels = (first..hidden.div_ceil(PANEL)).take(down_panels_per_task(&e));
            GATE_UP.with_borrow_mut(|(down, next)| {
                down.resize(e.rows * PANEL, 0.0);
                next.resize(e.rows * PANEL, 0.0);
                if panels.len() == 2 {
                    let pair = [(e.w2, first, aq), (e.w2, first + 1, aq)];
                    weight_panel_pair(isa, ae, pair, down, next);
                } else {
                    weight_panel(isa, ae, aq, e.w2, first, down);
                }
                for (q, sums) in panels.zip([&mut *down, &mut *next]) {
                    let cols = PANEL.min(hidden - q * PANEL);
                    if let Some(b) = e.bias {
                        ExpertBias::add_columns(&b.down, q * PANEL, cols, PANEL, sums);
                    }
                    for (i, d) in sums.chunks_exact(PANEL).enumerate() {
                        // SAFETY: row first_row + i, columns 32q .. 32q + cols are inside `out`
                        // and written by this task only.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                d.as_ptr(),
                                out_ptr.get().add((p.first_row + i) * hidden + q * PANEL),
                                cols,
                            )
                        };
                    }
                }
            })
        });
}

/// Down-projection panels per phase-2 task of expert `e`: two where they stream in pairs
/// ([`pairs_panels`]), else one.
#[cfg(target_arch = "x86_64")]
fn down_panels_per_task(e: &ExpertRows<'_>) -> usize {
    if pairs_panels(super::isa(), e.rows) {
        2
    } else {
        1
    }
}

/// Makes this thread's task buffers hold experts of up to `max_rows` rows without growing
/// (see [`super::reserve_task_scratch`]).
pub(super) fn reserve_task_scratch(max_rows: usize) {
    GATE_UP.with_borrow_mut(|(gate, up)| {
        super::matmul::reserve(gate, max_rows * PANEL);
        super::matmul::reserve(up, max_rows * PANEL);
    });
}

thread_local! {
    /// [`grouped_swiglu`]'s buffers when the caller keeps none.
    static SCRATCH: std::cell::RefCell<GroupedScratch> =
        std::cell::RefCell::new(GroupedScratch::default());
    /// A task's gate and up panels (`rows × PANEL` each); the down panels reuse them.
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

    /// The grouped SwiGLU against one expert at a time (each product its own GEMM), experts'
    /// matrices made by `weight(n, k, seed)`.
    fn equals_three_gemms_per_expert(weight: impl Fn(usize, usize, u32) -> Weight) {
        let (hidden, inter) = (80, 100); // neither a multiple of the 32-column panel
        let weights: Vec<[Weight; 3]> = (0..3)
            .map(|e| {
                [
                    weight(inter, hidden, 10 * e + 1),
                    weight(inter, hidden, 10 * e + 2),
                    weight(hidden, inter, 10 * e + 3),
                ]
            })
            .collect();
        // Row counts spanning one tile, several tiles, none, and one.
        let rows = [5, 30, 0, 1];
        let experts: Vec<ExpertRows<'_>> = rows
            .iter()
            .zip(weights.iter().cycle())
            .map(|(&rows, [w1, w3, w2])| ExpertRows {
                rows,
                w1,
                w3,
                w2,
                bias: None,
                activation: GatedActivation::Silu,
            })
            .collect();
        let total: usize = rows.iter().sum();
        let x = pseudo_random(total * hidden, 7);
        let mut grouped = vec![f32::NAN; x.len()];
        grouped_swiglu(&x, &experts[..], &mut grouped);
        let mut want = vec![0.0; x.len()];
        one_expert_at_a_time(
            &x,
            hidden,
            &experts[..],
            &mut want,
            &mut GroupedScratch::default(),
        );
        assert_eq!(grouped, want);
    }

    #[test]
    fn equals_three_gemms_per_expert_bit_for_bit() {
        equals_three_gemms_per_expert(bf16_weight);
    }

    #[test]
    fn int8_experts_equal_three_integer_gemms_per_expert_bit_for_bit() {
        // The grouped path quantizes x once for every expert's gate and up products and the
        // activations once between the phases; each GEMM alone quantizes its own input.
        if super::super::int8::DotKernel::for_isa(super::super::isa()).is_none() {
            return; // the portable kernels run no int8
        }
        let int8 = |n: usize, k: usize, seed: u32| {
            crate::cpu::reference::int8_weight_of(vec![n, k], &pseudo_random(n * k, seed))
        };
        equals_three_gemms_per_expert(int8);
        // Some matrices int8 and some bf16 (an expert's down projection alone quantized).
        equals_three_gemms_per_expert(|n, k, seed| {
            if seed % 10 == 3 {
                int8(n, k, seed)
            } else {
                bf16_weight(n, k, seed)
            }
        });
    }

    #[test]
    fn int4_experts_equal_three_integer_gemms_per_expert_bit_for_bit() {
        // Act-order gate and down projections read their inputs in their own orders; the up
        // projections here in plain groups, so gate and up quantize x apart.
        let int4 = |n: usize, k: usize, seed: u32| {
            let act_order = seed % 10 != 2;
            let values = pseudo_random(n * k, seed);
            crate::cpu::reference::int4_weight_of(vec![n, k], 32, act_order, &values)
        };
        equals_three_gemms_per_expert(int4);
        // Every projection act-order: gate and up share one order, so one quantization.
        equals_three_gemms_per_expert(|n, k, seed| {
            crate::cpu::reference::int4_weight_of(vec![n, k], 32, true, &pseudo_random(n * k, seed))
        });
        // int4, int8 and bf16 in one layer.
        equals_three_gemms_per_expert(|n, k, seed| match seed % 10 {
            1 => int4(n, k, seed),
            2 => crate::cpu::reference::int8_weight_of(vec![n, k], &pseudo_random(n * k, seed)),
            _ => bf16_weight(n, k, seed),
        });
    }

    #[test]
    fn biases_and_the_clamped_activation_equal_the_definition() {
        // GPT-OSS's expert: (x·w1ᵀ + b1, x·w3ᵀ + b3) → min(g, l) · σ(α·min(g, l)) ·
        // (clamp(u, -l, l) + 1) → ·w2ᵀ + b2, a limit small enough to clamp some values, on the
        // panel path and the portable one alike.
        let (hidden, inter, rows) = (40, 70, 9);
        let [w1, w3, w2] = [
            bf16_weight(inter, hidden, 1),
            bf16_weight(inter, hidden, 2),
            bf16_weight(hidden, inter, 3),
        ];
        let bias = ExpertBias {
            gate: pseudo_random(inter, 4),
            up: pseudo_random(inter, 5),
            down: pseudo_random(hidden, 6),
        };
        let (alpha, limit) = (1.702, 0.6);
        let expert = [ExpertRows {
            rows,
            w1: &w1,
            w3: &w3,
            w2: &w2,
            bias: Some(&bias),
            activation: GatedActivation::ClampedSwiglu { alpha, limit },
        }];
        let x = pseudo_random(rows * hidden, 7);
        let mut got = vec![f32::NAN; x.len()];
        grouped_swiglu(&x, &expert[..], &mut got);
        let (w1, w3, w2) = (w1.to_f32_vec(), w3.to_f32_vec(), w2.to_f32_vec());
        let dot = |a: &[f32], b: &[f32]| a.iter().zip(b).map(|(a, b)| (a * b) as f64).sum::<f64>();
        let mut clamped = 0;
        for r in 0..rows {
            let xr = &x[r * hidden..][..hidden];
            let act: Vec<f64> = (0..inter)
                .map(|i| {
                    let g = dot(xr, &w1[i * hidden..][..hidden]) + bias.gate[i] as f64;
                    let u = dot(xr, &w3[i * hidden..][..hidden]) + bias.up[i] as f64;
                    clamped += usize::from(g > limit as f64 || u.abs() > limit as f64);
                    let g = g.min(limit as f64);
                    let u = u.clamp(-limit as f64, limit as f64);
                    g / (1.0 + (-alpha as f64 * g).exp()) * (u + 1.0)
                })
                .collect();
            for c in 0..hidden {
                let want = (0..inter)
                    .map(|i| act[i] * w2[c * inter + i] as f64)
                    .sum::<f64>()
                    + bias.down[c] as f64;
                let g = got[r * hidden + c] as f64;
                assert!((g - want).abs() < 1e-4, "row {r} col {c}: {g} vs {want}");
            }
        }
        assert!(
            clamped > rows * inter / 4,
            "the limit clamps too little: {clamped}"
        );
        let mut portable = vec![0.0; x.len()];
        one_expert_at_a_time(
            &x,
            hidden,
            &expert[..],
            &mut portable,
            &mut GroupedScratch::default(),
        );
        assert_eq!(got, portable);
    }

    #[test]
    fn mxfp4_experts_equal_their_dequantized_values_bit_for_bit() {
        // GPT-OSS's MXFP4 experts through both phases: the same bits as f32 experts holding
        // the dequantised values, biases and the clamped activation included.
        use crate::cpu::reference::mxfp4_weight_of;
        let (hidden, inter) = (64, 96);
        let mxfp4 = [
            mxfp4_weight_of(vec![inter, hidden], &pseudo_random(inter * hidden, 21)),
            mxfp4_weight_of(vec![inter, hidden], &pseudo_random(inter * hidden, 22)),
            mxfp4_weight_of(vec![hidden, inter], &pseudo_random(hidden * inter, 23)),
        ];
        let f32s = mxfp4
            .each_ref()
            .map(|w| weight_of(DType::F32, w.shape().to_vec(), &w.to_f32_vec()));
        let bias = ExpertBias {
            gate: pseudo_random(inter, 24),
            up: pseudo_random(inter, 25),
            down: pseudo_random(hidden, 26),
        };
        let rows = [1, 13];
        let run = |[w1, w3, w2]: &[Weight; 3]| {
            let experts: Vec<ExpertRows<'_>> = rows
                .iter()
                .map(|&rows| ExpertRows {
                    rows,
                    w1,
                    w3,
                    w2,
                    bias: Some(&bias),
                    activation: GatedActivation::ClampedSwiglu {
                        alpha: 1.702,
                        limit: 0.8,
                    },
                })
                .collect();
            let x = pseudo_random(rows.iter().sum::<usize>() * hidden, 27);
            let mut out = vec![f32::NAN; x.len()];
            grouped_swiglu(&x, &experts[..], &mut out);
            out
        };
        assert_eq!(run(&mxfp4), run(&f32s));
    }
}
