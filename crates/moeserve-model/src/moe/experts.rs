//! The experts of one sparse MoE block, computed grouped: the tokens routed to an expert are
//! gathered into one contiguous matrix and go through that expert's SwiGLU MLP as one GEMM, so
//! each routed expert's weights are read once per step, whatever the number of its tokens.
//!
//! HF `MixtralBlockSparseTop2MLP`: `w2(act_fn(w1(x)) * w3(x))`, outputs weighted by the router
//! and summed per token in expert order (`index_add_`). A shared expert (Qwen2-MoE, GLM-4.5)
//! goes through every token beside the routed ones, scaled by `sigmoid(shared_expert_gate · x)`
//! where the family has that gate, and is added after them (`routed + shared`, as HF sums
//! them); it is never capacity-limited. GPT-OSS's experts add biases to the three projections
//! and clamp their SwiGLU (`GptOssExperts._apply_gate`); its router has a bias. Routing
//! (`router.rs`, with an optional capacity) decides the pairs; `dispatch.rs` groups them and
//! combines the outputs; with expert parallelism (`arena.rs`) the groups run on the devices
//! holding their slots.

use std::sync::Arc;

use moeserve_backend::{Weight, cpu};

use super::arena::ExpertParallel;
use super::capacity::Capacity;
use super::dispatch::{Dispatch, SlotMap};
use super::parallel::{DeviceOutput, compute_segments_into};
use super::record::LayerRouting;
use super::router::{Ranking, RoutedStep, RouterConfig, Scoring, route_into};
use crate::checkpoint::Checkpoint;
use crate::config::{FusedExperts, ModelConfig, SharedExpertConfig};
use crate::models::workspace::zeroed;
use crate::{ModelError, Result};

/// One expert's SwiGLU MLP; clones share the weight bytes.
#[derive(Clone)]
pub struct Expert {
    /// gate projection `[intermediate, hidden]`
    pub w1: Weight,
    /// down projection `[hidden, intermediate]`
    pub w2: Weight,
    /// up projection `[intermediate, hidden]`
    pub w3: Weight,
    /// The projections' biases (GPT-OSS).
    pub bias: Option<Arc<cpu::ExpertBias>>,
    pub activation: cpu::GatedActivation,
}

/// A shared expert and its optional scalar gate (`[1, hidden]`).
pub struct SharedExpert {
    pub mlp: Expert,
    pub gate: Option<Weight>,
}

/// Router plus experts of one layer.
pub struct SparseMoe {
    /// `[num_experts, hidden]`
    pub gate: Weight,
    /// `[num_experts]`: the router's own bias (GPT-OSS's `router.bias`), in f32.
    pub gate_bias: Option<Vec<f32>>,
    pub experts: Vec<Expert>,
    pub top_k: usize,
    /// Whether the top-k weights are renormalised to sum to 1 (`norm_topk_prob`).
    pub renormalize: bool,
    /// Softmax, or sigmoid with groups; and `routed_scaling_factor`.
    pub scoring: Scoring,
    pub scale: f32,
    /// `gate.e_score_correction_bias` (`[num_experts]`, f32): added to the sigmoid scores for
    /// the choice of experts only.
    pub correction_bias: Option<Vec<f32>>,
    pub shared: Option<SharedExpert>,
    /// `[num_experts]`, added to the router logits (see `MoeModel::add_router_bias`).
    pub router_bias: Option<Vec<f32>>,
}

/// The buffers of an MoE layer's step (routing, dispatch, expert outputs), reused across the
/// layers and steps of a forward's workspace so a step allocates nothing once warmed up.
#[derive(Default)]
pub struct MoeWorkspace {
    ranking: Ranking,
    routed: RoutedStep,
    dispatch: Dispatch,
    outputs: Vec<DeviceOutput>,
    pub(crate) grouped: cpu::GroupedScratch,
    shared: SharedScratch,
}

/// The shared expert's outputs and gate logits, `[num_tokens, hidden]` and `[num_tokens]`, and
/// the gate product's tiled activations.
#[derive(Default)]
struct SharedScratch {
    out: Vec<f32>,
    gate: Vec<f32>,
    tiled: Vec<f32>,
}

/// One MoE layer's input for one step.
pub struct MoeLayerStep<'a> {
    pub layer: usize,
    /// `[num_tokens, hidden]`: the normed hidden states.
    pub x: &'a [f32],
    /// `[num_tokens, num_experts]`
    pub router_logits: &'a [f32],
    pub capacity: Capacity,
    /// `None`: this layer's own experts on the caller's threads.
    pub experts: Option<&'a ExpertParallel>,
}

impl SparseMoe {
    /// Loads the router (`{prefix}.gate.weight`, or GPT-OSS's `{prefix}.router.{weight,bias}`)
    /// and the experts, per expert (`{prefix}.experts.{e}.{gate,up,down}` under the family's
    /// names) or fused (`{prefix}.experts.gate_up_proj [E, 2I, H]`,
    /// `{prefix}.experts.down_proj [E, H, I]`, as transformers ≥ 5 writes them; GPT-OSS's
    /// input-major interleaved form), and the shared expert the config declares.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let n = config.num_local_experts;
        let h = config.hidden_size;
        let router = format!("{prefix}.{}", config.names.router);
        let experts = load_experts(ckpt, &format!("{prefix}.experts"), config)?;
        let shared = config
            .shared_expert
            .map(|s| SharedExpert::load(ckpt, prefix, config, s))
            .transpose()?;
        Ok(SparseMoe {
            // The router stays as stored under --quantization: expert choice is sensitive and
            // the matrix is tiny (llama.cpp keeps it unquantized too).
            gate: ckpt.weight(&format!("{router}.weight"), &[n, h])?.exact(),
            gate_bias: config
                .router_bias
                .then(|| ckpt.vector_part(&format!("{router}.bias"), &[n], 0))
                .transpose()?,
            experts,
            top_k: config.num_experts_per_tok,
            renormalize: config.norm_topk_prob,
            scoring: config.router_scoring,
            scale: config.routed_scaling_factor,
            correction_bias: config
                .score_correction_bias
                .then(|| ckpt.weight(&format!("{router}.e_score_correction_bias"), &[n]))
                .transpose()?
                .map(|b| b.to_f32_vec()),
            shared,
            router_bias: None,
        })
    }

    pub fn num_experts(&self) -> usize {
        self.experts.len()
    }

    /// How this layer routes under `capacity`.
    pub fn router_config(&self, capacity: Capacity) -> RouterConfig {
        RouterConfig {
            top_k: self.top_k,
            capacity,
            renormalize: self.renormalize,
            scoring: self.scoring,
            scale: self.scale,
        }
    }

    /// Router logits `[num_tokens, num_experts]` of the normed input `x: [num_tokens, hidden]`.
    pub fn router_logits(&self, x: &[f32], num_tokens: usize) -> Vec<f32> {
        let mut logits = Vec::new();
        self.router_logits_into(x, num_tokens, &mut logits, &mut Vec::new());
        logits
    }

    /// [`SparseMoe::router_logits`] into `logits` (resized); `tiled` is the product's buffer
    /// for the activations in tile order.
    pub fn router_logits_into(
        &self,
        x: &[f32],
        num_tokens: usize,
        logits: &mut Vec<f32>,
        tiled: &mut Vec<f32>,
    ) {
        zeroed(logits, num_tokens * self.num_experts());
        cpu::matmul_wt_in(x, num_tokens, &self.gate, logits, tiled);
        for bias in [&self.gate_bias, &self.router_bias].into_iter().flatten() {
            for row in logits.chunks_exact_mut(bias.len()) {
                row.iter_mut().zip(bias).for_each(|(l, b)| *l += b);
            }
        }
    }

    /// `out[t] = Σ weight(t, e) · expert_e(x[t])` over the pairs routing leaves token `t`, in
    /// expert order; `out: [num_tokens, hidden]`. Returns what routing did and where the
    /// pairs ran. The capacity must be valid (`Capacity::validate`).
    pub fn forward(&self, step: &MoeLayerStep<'_>, out: &mut [f32]) -> LayerRouting {
        let mut summary = LayerRouting::default();
        self.forward_in(step, &mut MoeWorkspace::default(), out, Some(&mut summary));
        summary
    }

    /// [`SparseMoe::forward`] with the buffers of `ws`; the summary goes to `summary` when asked
    /// for. Without expert parallelism nothing is allocated once `ws` has seen a step as large.
    pub fn forward_in(
        &self,
        step: &MoeLayerStep<'_>,
        ws: &mut MoeWorkspace,
        out: &mut [f32],
        summary: Option<&mut LayerRouting>,
    ) {
        let hidden = self.gate.shape()[1];
        let config = self.router_config(step.capacity);
        let routed = &mut ws.routed;
        route_into(
            step.router_logits,
            self.num_experts(),
            &config,
            self.correction_bias.as_deref(),
            &mut ws.ranking,
            routed,
        );
        let slots = step
            .experts
            .map_or(SlotMap::Local, |ep| ep.slot_map(step.layer));
        let dispatch = &mut ws.dispatch;
        dispatch.replan(routed, step.x, hidden, slots);
        match step.experts {
            // The devices' workers own their work (it crosses threads), so this path allocates.
            Some(ep) => ws.outputs = ep.run(step.layer, std::mem::take(&mut dispatch.work)),
            None => {
                ws.outputs.resize_with(1, DeviceOutput::default);
                let expert_for = |s: &super::parallel::Segment| &self.experts[s.expert.0 as usize];
                let (work, out) = (&dispatch.work[0], &mut ws.outputs[0]);
                compute_segments_into(work, expert_for, out, Some(&mut ws.grouped));
            }
        }
        dispatch.combine(routed, &ws.outputs, out);
        if let Some(shared) = &self.shared {
            shared.add_to(step.x, hidden, (&mut ws.shared, &mut ws.grouped), out);
        }
        if let Some(summary) = summary {
            summary.set_routed(routed, &step.capacity);
            if self.shared.is_some() {
                summary.counts.shared_expert_tokens = routed.num_tokens as u64;
            }
            summary.device_seconds.clear();
            summary
                .device_seconds
                .extend(ws.outputs.iter().map(|o| o.compute_seconds));
            summary.device_pairs.clear();
            summary
                .device_pairs
                .extend_from_slice(&dispatch.device_pairs);
        }
    }
}

/// The routed experts of `{prefix}` (`…mlp.experts`), per expert or fused.
fn load_experts(ckpt: &Checkpoint, prefix: &str, config: &ModelConfig) -> Result<Vec<Expert>> {
    let (h, i, n) = (
        config.hidden_size,
        config.moe_intermediate_size,
        config.num_local_experts,
    );
    let [gate, up, down] = config.names.expert_proj;
    let gate_up = format!("{prefix}.gate_up_proj");
    let down_name = format!("{prefix}.down_proj");
    let int8 = |e: usize, proj: &str| format!("{prefix}.{e}.{proj}");
    let (bias, activation) = (config.experts.bias, config.experts.activation);
    let biases = |e: usize| -> Result<Option<Arc<cpu::ExpertBias>>> {
        if !bias {
            return Ok(None);
        }
        // GPT-OSS: `gate_up_proj_bias [E, 2I]` interleaved as its columns, `down_proj_bias`.
        let gate_up = ckpt.vector_part(&format!("{gate_up}_bias"), &[n, 2 * i], e)?;
        Ok(Some(Arc::new(cpu::ExpertBias {
            gate: gate_up.iter().step_by(2).copied().collect(),
            up: gate_up.iter().skip(1).step_by(2).copied().collect(),
            down: ckpt.vector_part(&format!("{down_name}_bias"), &[n, h], e)?,
        })))
    };
    if ckpt.contains(&format!("{gate_up}_blocks")) {
        // MXFP4 (the gpt-oss release): blocks by output row, gate and up rows alternating.
        if config.names.fused_experts != FusedExperts::InterleavedInputMajor {
            return Err(ModelError::config(
                ckpt.dir(),
                format!("`{gate_up}_blocks`: MXFP4 experts are read for GPT-OSS only"),
            ));
        }
        return (0..n)
            .map(|e| {
                Ok(Expert {
                    w1: ckpt.mxfp4_rows(&gate_up, [n, 2 * i, h], e, (0, 2))?,
                    w3: ckpt.mxfp4_rows(&gate_up, [n, 2 * i, h], e, (1, 2))?,
                    w2: ckpt.mxfp4_rows(&down_name, [n, h, i], e, (0, 1))?,
                    bias: biases(e)?,
                    activation,
                })
            })
            .collect();
    }
    if ckpt.contains(&gate_up) {
        return (0..n)
            .map(|e| {
                let (w1, w3, w2) = match config.names.fused_experts {
                    // One [E, 2I, H] tensor (gate rows, then up rows, per expert) and one
                    // [E, H, I]: each expert's matrices are contiguous runs of them, viewed
                    // without a copy.
                    FusedExperts::GateThenUp => (
                        ckpt.weight_part(&gate_up, &[n, 2 * i, h], 2 * e, &[i, h], &int8(e, gate))?,
                        ckpt.weight_part(
                            &gate_up,
                            &[n, 2 * i, h],
                            2 * e + 1,
                            &[i, h],
                            &int8(e, up),
                        )?,
                        ckpt.weight_part(&down_name, &[n, h, i], e, &[h, i], &int8(e, down))?,
                    ),
                    // [E, H, 2I] with gate and up in alternate columns, and [E, I, H]: input-
                    // major, so transposed into output rows.
                    FusedExperts::InterleavedInputMajor => (
                        ckpt.weight_columns(&gate_up, &[n, h, 2 * i], e, (0, 2), &int8(e, gate))?,
                        ckpt.weight_columns(&gate_up, &[n, h, 2 * i], e, (1, 2), &int8(e, up))?,
                        ckpt.weight_columns(&down_name, &[n, i, h], e, (0, 1), &int8(e, down))?,
                    ),
                };
                Ok(Expert {
                    w1,
                    w2,
                    w3,
                    bias: biases(e)?,
                    activation,
                })
            })
            .collect();
    }
    (0..n)
        .map(|e| {
            let p = format!("{prefix}.{e}");
            Ok(Expert {
                w1: ckpt.weight(&format!("{p}.{gate}.weight"), &[i, h])?,
                w2: ckpt.weight(&format!("{p}.{down}.weight"), &[h, i])?,
                w3: ckpt.weight(&format!("{p}.{up}.weight"), &[i, h])?,
                bias: match bias {
                    true => Some(Arc::new(cpu::ExpertBias {
                        gate: ckpt.vector_part(&format!("{p}.{gate}.bias"), &[i], 0)?,
                        up: ckpt.vector_part(&format!("{p}.{up}.bias"), &[i], 0)?,
                        down: ckpt.vector_part(&format!("{p}.{down}.bias"), &[h], 0)?,
                    })),
                    false => None,
                },
                activation,
            })
        })
        .collect()
}

impl SharedExpert {
    /// `{prefix}.{shared_expert}.{gate,up,down}_proj.weight` (the family's name) and, when
    /// gated, `{prefix}.shared_expert_gate.weight`.
    fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        config: &ModelConfig,
        shared: SharedExpertConfig,
    ) -> Result<Self> {
        let h = config.hidden_size;
        let mlp = Expert::load_mlp(
            ckpt,
            &format!("{prefix}.{}", config.names.shared_expert),
            h,
            shared.intermediate_size,
        )?;
        let gate = shared
            .gated
            .then(|| ckpt.weight(&format!("{prefix}.shared_expert_gate.weight"), &[1, h]))
            .transpose()?
            .map(Weight::exact);
        Ok(SharedExpert { mlp, gate })
    }

    /// `out += sigmoid(x · gate) · mlp(x)` for every token of `x: [num_tokens, hidden]`.
    fn add_to(
        &self,
        x: &[f32],
        hidden: usize,
        (ws, grouped): (&mut SharedScratch, &mut cpu::GroupedScratch),
        out: &mut [f32],
    ) {
        let t = x.len() / hidden;
        zeroed(&mut ws.out, t * hidden);
        cpu::grouped_swiglu_in(x, &[self.mlp.rows(t)][..], &mut ws.out, grouped);
        match &self.gate {
            Some(gate) => {
                zeroed(&mut ws.gate, t);
                cpu::matmul_wt_in(x, t, gate, &mut ws.gate, &mut ws.tiled);
                let rows = out
                    .chunks_exact_mut(hidden)
                    .zip(ws.out.chunks_exact(hidden));
                for ((o, s), g) in rows.zip(&ws.gate) {
                    let scale = 1.0 / (1.0 + (-g).exp());
                    o.iter_mut().zip(s).for_each(|(o, s)| *o += scale * s);
                }
            }
            None => cpu::add_assign(out, &ws.out),
        }
    }
}

impl Expert {
    /// A SwiGLU MLP `{prefix}.{gate,up,down}_proj.weight` of width `intermediate` (a dense
    /// layer's MLP, a shared expert).
    pub fn load_mlp(
        ckpt: &Checkpoint,
        prefix: &str,
        hidden: usize,
        intermediate: usize,
    ) -> Result<Self> {
        let (h, i) = (hidden, intermediate);
        Ok(Expert {
            w1: ckpt.weight(&format!("{prefix}.gate_proj.weight"), &[i, h])?,
            w2: ckpt.weight(&format!("{prefix}.down_proj.weight"), &[h, i])?,
            w3: ckpt.weight(&format!("{prefix}.up_proj.weight"), &[i, h])?,
            bias: None,
            activation: cpu::GatedActivation::Silu,
        })
    }

    /// SwiGLU of `x: [n, hidden]` into `out: [n, hidden]`, each weight read once for all rows.
    pub fn forward_in(
        &self,
        x: &[f32],
        n: usize,
        out: &mut [f32],
        scratch: &mut cpu::GroupedScratch,
    ) {
        cpu::grouped_swiglu_in(x, &[self.rows(n)][..], out, scratch);
    }

    /// [`Expert::forward_in`] in this thread's buffers.
    #[cfg(test)]
    pub(crate) fn forward(&self, x: &[f32], n: usize, out: &mut [f32]) {
        cpu::grouped_swiglu(x, &[self.rows(n)][..], out);
    }

    /// This expert applied to `rows` rows of a grouped SwiGLU.
    pub(crate) fn rows(&self, rows: usize) -> cpu::ExpertRows<'_> {
        cpu::ExpertRows {
            rows,
            w1: &self.w1,
            w3: &self.w3,
            w2: &self.w2,
            bias: self.bias.as_deref(),
            activation: self.activation,
        }
    }

    pub fn size_in_bytes(&self) -> usize {
        let bias = self.bias.as_ref().map_or(0, |b| {
            (b.gate.len() + b.up.len() + b.down.len()) * std::mem::size_of::<f32>()
        });
        self.w1.size_in_bytes() + self.w2.size_in_bytes() + self.w3.size_in_bytes() + bias
    }

    /// A copy in fresh owned buffers (what placing the expert on another device means on the
    /// CPU), already in the kernels' layout so its first step does not pay for that.
    pub fn deep_copy(&self) -> Expert {
        let expert = Expert {
            w1: self.w1.deep_copy(),
            w2: self.w2.deep_copy(),
            w3: self.w3.deep_copy(),
            bias: self.bias.as_deref().cloned().map(Arc::new),
            activation: self.activation,
        };
        if cpu::isa().packs_weights() {
            for w in [&expert.w1, &expert.w2, &expert.w3] {
                w.packed();
            }
        }
        expert
    }
}

/// Checks `bias` against a layer of `num_experts` experts.
pub(crate) fn check_router_bias(bias: &[f32], num_experts: usize) -> Result<()> {
    if bias.len() != num_experts || bias.iter().any(|b| !b.is_finite()) {
        return Err(ModelError::InvalidInput {
            message: format!("a router bias needs {num_experts} finite values, got {bias:?}"),
        });
    }
    Ok(())
}

#[cfg(test)]
pub(crate) mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::moe::capacity::OverflowPolicy;
    use crate::moe::parallel::InProcessAllToAll;
    use crate::moe::router::route_top_k;
    use moeserve_core::ExpertPlacement;

    const HIDDEN: usize = 8;
    const INTER: usize = 12;

    pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                ((state >> 40) % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// A random f32 layer with hidden size 8 and intermediate size 12.
    pub(crate) fn layer(num_experts: usize, top_k: usize) -> SparseMoe {
        let w = |shape: [usize; 2], seed| {
            Weight::from_f32(shape.to_vec(), &values(shape[0] * shape[1], seed)).unwrap()
        };
        SparseMoe {
            gate: w([num_experts, HIDDEN], 1),
            gate_bias: None,
            experts: (0..num_experts as u64)
                .map(|e| Expert {
                    w1: w([INTER, HIDDEN], 10 + e),
                    w2: w([HIDDEN, INTER], 20 + e),
                    w3: w([INTER, HIDDEN], 30 + e),
                    bias: None,
                    activation: cpu::GatedActivation::Silu,
                })
                .collect(),
            top_k,
            renormalize: true,
            scoring: Scoring::Softmax,
            scale: 1.0,
            correction_bias: None,
            shared: None,
            router_bias: None,
        }
    }

    /// The grouped HF computation the MoE block always did: `route_top_k`, one GEMM per expert
    /// over its tokens in token order, outputs added per token in expert order.
    fn reference(moe: &SparseMoe, x: &[f32], logits: &[f32]) -> Vec<f32> {
        let routing = route_top_k(logits, moe.num_experts(), moe.top_k);
        let mut out = vec![0.0; x.len()];
        for (e, expert) in moe.experts.iter().enumerate() {
            let pairs: Vec<usize> = (0..routing.expert_ids.len())
                .filter(|p| routing.expert_ids[*p] as usize == e)
                .collect();
            let rows: Vec<f32> = pairs
                .iter()
                .flat_map(|p| &x[p / moe.top_k * HIDDEN..][..HIDDEN])
                .copied()
                .collect();
            let mut y = vec![0.0; rows.len()];
            expert.forward(&rows, pairs.len(), &mut y);
            for (i, p) in pairs.iter().enumerate() {
                let o = &mut out[p / moe.top_k * HIDDEN..][..HIDDEN];
                let w = routing.weights[*p];
                o.iter_mut()
                    .zip(&y[i * HIDDEN..])
                    .for_each(|(o, y)| *o += w * y);
            }
        }
        out
    }

    fn run(
        moe: &SparseMoe,
        x: &[f32],
        capacity: Capacity,
        experts: Option<&ExpertParallel>,
    ) -> (Vec<f32>, LayerRouting) {
        let logits = moe.router_logits(x, x.len() / HIDDEN);
        let mut out = vec![f32::NAN; x.len()];
        let step = MoeLayerStep {
            layer: 0,
            x,
            router_logits: &logits,
            capacity,
            experts,
        };
        let summary = moe.forward(&step, &mut out);
        (out, summary)
    }

    fn spill(alpha: f32) -> Capacity {
        Capacity::Factor {
            alpha,
            overflow: OverflowPolicy::Spill,
        }
    }

    #[test]
    fn dropless_and_spill_equal_the_grouped_hf_computation_exactly() {
        let moe = layer(6, 2);
        let x = values(23 * HIDDEN, 5);
        let want = reference(&moe, &x, &moe.router_logits(&x, 23));
        let (dropless, summary) = run(&moe, &x, Capacity::Dropless, None);
        assert_eq!(dropless, want);
        assert_eq!(summary.device_pairs, vec![46]);
        let (spilled, summary) = run(&moe, &x, spill(0.3), None);
        assert_eq!(spilled, want);
        assert!(summary.counts.spilled > 0);
    }

    #[test]
    fn expert_parallel_runs_equal_one_device_exactly() {
        let moe = layer(6, 2);
        let x = values(31 * HIDDEN, 7);
        let (want, _) = run(&moe, &x, Capacity::Dropless, None);
        for (devices, redundant) in [(1, 0), (2, 0), (2, 2), (3, 3), (4, 2)] {
            let placement = ExpertPlacement::round_robin(1, 6, devices, redundant).unwrap();
            let exchange = Arc::new(InProcessAllToAll::new(devices, 2).unwrap());
            let ep = ExpertParallel::new(&[&moe], placement, exchange).unwrap();
            let (got, summary) = run(&moe, &x, Capacity::Dropless, Some(&ep));
            assert_eq!(got, want, "{devices} devices, {redundant} redundant");
            assert_eq!(summary.device_pairs.iter().sum::<u64>(), 62);
            assert_eq!(summary.device_seconds.len(), devices);
            let (spilled, _) = run(&moe, &x, spill(0.5), Some(&ep));
            assert_eq!(spilled, want, "spill on {devices} devices");
        }
    }

    #[test]
    fn dropped_tokens_get_zero_output() {
        let moe = layer(4, 1);
        let x = values(9 * HIDDEN, 3);
        let drop = Capacity::Factor {
            alpha: 0.25,
            overflow: OverflowPolicy::Drop,
        }; // C = 1: at most 4 tokens keep an expert
        let (out, summary) = run(&moe, &x, drop, None);
        assert!(summary.counts.dropped_tokens >= 5);
        let zero_rows = out
            .chunks_exact(HIDDEN)
            .filter(|r| r.iter().all(|v| *v == 0.0))
            .count();
        assert_eq!(zero_rows as u64, summary.counts.dropped_tokens);
    }

    #[test]
    fn router_bias_shifts_the_logits() {
        let mut moe = layer(4, 2);
        let x = values(2 * HIDDEN, 9);
        let plain = moe.router_logits(&x, 2);
        moe.router_bias = Some(vec![0.0, 5.0, 0.0, -1.0]);
        let biased = moe.router_logits(&x, 2);
        assert_eq!(biased[1], plain[1] + 5.0);
        assert_eq!(biased[7], plain[7] - 1.0);
        assert!(check_router_bias(&[1.0; 3], 4).is_err());
        assert!(check_router_bias(&[0.0, f32::NAN, 0.0, 0.0], 4).is_err());
    }

    #[test]
    fn deep_copies_own_their_bytes_and_compute_the_same() {
        let moe = layer(2, 1);
        let copy = moe.experts[0].deep_copy();
        assert_ne!(
            copy.w1.as_bytes().as_ptr(),
            moe.experts[0].w1.as_bytes().as_ptr()
        );
        assert_eq!(copy.size_in_bytes(), 3 * INTER * HIDDEN * 4);
        let x = values(3 * HIDDEN, 4);
        let (mut a, mut b) = (vec![0.0; x.len()], vec![0.0; x.len()]);
        moe.experts[0].forward(&x, 3, &mut a);
        copy.forward(&x, 3, &mut b);
        assert_eq!(a, b);
    }
}
