//! The calibration pass of `moeserve quantize`: every quantized matrix's Hessian `H = Σ x xᵀ`
//! over the inputs `x` it sees while the model (in its stored precision) reads sample text.
//!
//! Matrices that read the same input share one Hessian: q, k and v a layer's normed hidden
//! state (multi-head latent attention: q_proj or q_a_proj, and kv_a_proj_with_mqa; q_b_proj
//! reads the normed low-rank query); an expert's w1 and w3 the rows routed to it (its own tokens only, so a rarely chosen
//! expert gets few); w2 the expert's SwiGLU output for those rows, recomputed here from w1 and
//! w3; a dense layer's MLP and a shared expert likewise, over every token; lm_head the final
//! normed hidden state of every position.

use std::ops::Range;

use moeserve_backend::cpu;

use super::gptq::{f32_matrix, transposed};
use crate::moe::router::route_with_bias;
use crate::moe::{Capacity, Expert, SparseMoe};

/// An MLP's intermediate width and its down projection's input `act(w1 x + b1, w3 x + b3)` for
/// the rows of `x: [m, hidden]` (`silu(w1 x) · w3 x` but for GPT-OSS's biased, clamped experts).
fn swiglu_inputs(mlp: &Expert, x: &[f32], hidden: usize) -> (usize, Vec<f32>) {
    let m = x.len() / hidden;
    let inter = mlp.w1.shape()[0];
    let (mut gate, mut up) = (vec![0.0f32; m * inter], vec![0.0f32; m * inter]);
    cpu::matmul_wt(x, m, &mlp.w1, &mut gate);
    cpu::matmul_wt(x, m, &mlp.w3, &mut up);
    if let Some(b) = &mlp.bias {
        for (g, u) in gate.chunks_exact_mut(inter).zip(up.chunks_exact_mut(inter)) {
            g.iter_mut().zip(&b.gate).for_each(|(g, b)| *g += b);
            u.iter_mut().zip(&b.up).for_each(|(u, b)| *u += b);
        }
    }
    mlp.activation.apply(&mut gate, &up);
    (inter, gate)
}

/// `Σ x xᵀ` over the rows seen so far, `[k, k]`; allocated on first use.
#[derive(Debug, Default)]
pub struct Hessian {
    pub sum: Vec<f32>,
    /// Input rows accumulated.
    pub rows: usize,
}

impl Hessian {
    /// Adds the rows of `x: [rows, k]`, as one GEMM (`Xᵀ X`).
    fn add(&mut self, x: &[f32], k: usize) {
        let rows = x.len() / k;
        if rows == 0 {
            return;
        }
        let xt = transposed(x, rows, k);
        let mut out = vec![0.0f32; k * k];
        cpu::matmul_wt(&xt, k, &f32_matrix(vec![k, rows], &xt), &mut out);
        if self.sum.is_empty() {
            self.sum = out;
        } else {
            cpu::add_assign(&mut self.sum, &out);
        }
        self.rows += rows;
    }
}

/// The Hessians of one layer.
#[derive(Debug, Default)]
pub struct LayerHessians {
    /// Input of q, k and v.
    pub attention_in: Hessian,
    /// Input of o_proj.
    pub attention_out: Hessian,
    /// Multi-head latent attention: input of q_b_proj (the normed low-rank query).
    pub query_low_rank_in: Hessian,
    /// Per expert: input of w1 and w3.
    pub expert_in: Vec<Hessian>,
    /// Per expert: input of w2.
    pub expert_hidden: Vec<Hessian>,
    /// The dense MLP's or the shared expert's gate/up input and down input.
    pub mlp_in: Hessian,
    pub mlp_hidden: Hessian,
}

/// The Hessians of the layers in `layers` (and of lm_head when `lm_head` is set), filled by
/// forward passes given `Some(&mut hessians)`; the other layers' inputs are not recorded, so a
/// model is calibrated a group of layers at a time within a memory budget.
#[derive(Debug)]
pub struct Hessians {
    /// Layers `layers.start..layers.end`, in order.
    pub layers: Vec<LayerHessians>,
    pub lm_head: Hessian,
    range: Range<usize>,
    record_lm_head: bool,
    hidden: usize,
}

impl Hessians {
    pub fn new(range: Range<usize>, num_experts: usize, hidden: usize, lm_head: bool) -> Self {
        let layers = range
            .clone()
            .map(|_| LayerHessians {
                expert_in: (0..num_experts).map(|_| Hessian::default()).collect(),
                expert_hidden: (0..num_experts).map(|_| Hessian::default()).collect(),
                ..LayerHessians::default()
            })
            .collect();
        Hessians {
            layers,
            lm_head: Hessian::default(),
            range,
            record_lm_head: lm_head,
            hidden,
        }
    }

    /// The first layer recorded.
    pub fn first_layer(&self) -> usize {
        self.range.start
    }

    fn layer(&mut self, layer: usize) -> Option<&mut LayerHessians> {
        let start = self.range.start;
        self.range
            .contains(&layer)
            .then(|| &mut self.layers[layer - start])
    }

    pub(crate) fn attention_input(&mut self, layer: usize, x: &[f32]) {
        let h = self.hidden;
        if let Some(hs) = self.layer(layer) {
            hs.attention_in.add(x, h);
        }
    }

    pub(crate) fn query_low_rank_input(&mut self, layer: usize, x: &[f32], rows: usize) {
        if let (Some(hs), Some(width)) = (self.layer(layer), x.len().checked_div(rows)) {
            hs.query_low_rank_in.add(x, width);
        }
    }

    pub(crate) fn attention_output(&mut self, layer: usize, x: &[f32], rows: usize) {
        if let (Some(hs), Some(width)) = (self.layer(layer), x.len().checked_div(rows)) {
            hs.attention_out.add(x, width);
        }
    }

    /// Records a dense layer's MLP inputs (every token).
    pub(crate) fn dense_input(&mut self, layer: usize, mlp: &Expert, x: &[f32]) {
        let h = self.hidden;
        if let Some(hs) = self.layer(layer) {
            let (inp, hidden) = swiglu_inputs(mlp, x, h);
            hs.mlp_in.add(x, h);
            hs.mlp_hidden.add(&hidden, inp);
        }
    }

    /// Routes `x`'s rows as the block does (top-k of the router logits, no capacity limit),
    /// then records each expert's rows and its SwiGLU output for them.
    pub(crate) fn moe_input(&mut self, layer: usize, block: &SparseMoe, x: &[f32], logits: &[f32]) {
        if !self.range.contains(&layer) {
            return;
        }
        let h = self.hidden;
        let num_experts = block.experts.len();
        // The layer's own routing (softmax or sigmoid with groups), dropless.
        let config = block.router_config(Capacity::Dropless);
        let routing = route_with_bias(
            logits,
            num_experts,
            &config,
            block.correction_bias.as_deref(),
        );
        // Each expert's rows, gathered in one pass over the (token, expert) pairs.
        let mut routed: Vec<Vec<f32>> = vec![Vec::new(); num_experts];
        for (t, chosen) in routing.chosen_by_token().enumerate() {
            for e in chosen {
                routed[*e as usize].extend_from_slice(&x[t * h..(t + 1) * h]);
            }
        }
        for ((e, expert), rows) in block.experts.iter().enumerate().zip(routed) {
            if rows.is_empty() {
                continue;
            }
            let (inter, gate) = swiglu_inputs(expert, &rows, h);
            let hs = &mut self.layers[layer - self.range.start];
            hs.expert_in[e].add(&rows, h);
            hs.expert_hidden[e].add(&gate, inter);
        }
        if let Some(shared) = &block.shared {
            self.dense_input(layer, &shared.mlp, x);
        }
    }

    /// Whether lm_head's inputs are recorded (the forward skips norming every row otherwise).
    pub(crate) fn records_lm_head(&self) -> bool {
        self.record_lm_head
    }

    pub(crate) fn lm_head_input(&mut self, x: &[f32]) {
        self.lm_head.add(x, self.hidden);
    }
}
