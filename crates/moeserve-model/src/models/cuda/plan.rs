//! What one step of [`CudaMoeModel`](super::CudaMoeModel) queues on its GPU and how often the
//! host waits, worked out on the host: the decoder's operations (`ops::decode`, so every
//! family's layer order) each charged what `step.rs` launches for it. The host test below
//! states the counts of a dropless decode step; `tests/cuda_forward.rs` checks on a GPU that
//! the backend's own counts ([`WorkCounts`]) match this plan.
//!
//! Covers one GPU (expert parallelism's exchanges run on the other GPUs' streams too), after
//! [`CudaMoeModel::reserve`](super::CudaMoeModel::reserve) (no allocations).

use std::convert::Infallible;

use super::host_step::{attention_split, experts_on_device_offsets, routes_on_device};
use moeserve_backend::cuda::WorkCounts;

use crate::config::ModelConfig;
use crate::models::ops::{Act, DecoderOps, LayerWeight, Point, decode};
use crate::moe::Capacity;

/// The step a plan is for.
#[derive(Clone, Copy, Debug)]
pub struct StepShape {
    pub tokens: usize,
    /// Rows that get logits.
    pub logit_rows: usize,
    /// Of those, rows reduced to their greedy token on the device (`ForwardOptions::greedy`).
    pub greedy_rows: usize,
    /// The longest context among the step's tokens (long ones split attention over blocks).
    pub max_context: usize,
    /// Layer outputs and router logits read back (a `ForwardTrace`).
    pub trace: bool,
    /// Each MoE layer's routing summary read back (the engine's per-expert load).
    pub routing: bool,
    pub capacity: Capacity,
    /// Experts a host-routed or large layer computes (a cuBLAS call each for `w1 | w3` and
    /// `w2`); the routing decides it, so the plan takes it as given. Unused by small
    /// device-routed steps.
    pub active_experts: usize,
}

impl StepShape {
    /// A dropless decode step of `sequences` sequences with the routing recorded, as the
    /// engine runs it.
    pub fn decode(sequences: usize) -> Self {
        StepShape {
            tokens: sequences,
            logit_rows: sequences,
            greedy_rows: 0,
            max_context: 1,
            trace: false,
            routing: true,
            capacity: Capacity::Dropless,
            active_experts: 0,
        }
    }
}

/// The work of one step of a model of `c` shaped `shape`, on its GPU.
pub fn step_plan(c: &ModelConfig, shape: StepShape) -> WorkCounts {
    let mut plan = Planner {
        c,
        shape,
        counts: WorkCounts::default(),
        device_routed_layers: 0,
    };
    // The index arrays: ids, positions, token sequences, slots, block tables, logit rows, and
    // the attention kernel's token tiles.
    plan.counts.htod += 7;
    let Ok(()) = decode(c, &mut plan);
    plan.counts
}

struct Planner<'c> {
    c: &'c ModelConfig,
    shape: StepShape,
    counts: WorkCounts,
    device_routed_layers: usize,
}

impl Planner<'_> {
    fn kernels(&mut self, n: u64) {
        self.counts.kernels += n;
    }

    fn gemms(&mut self, n: u64) {
        self.counts.gemms += n;
    }

    /// The attention kernel, and its reduction when the step's contexts are split.
    fn attention(&mut self) {
        let split = attention_split(self.c, self.shape.tokens, self.shape.max_context);
        self.kernels(1 + u64::from(split.partitions > 1));
    }

    /// A read back: a copy and a wait.
    fn read_back(&mut self) {
        self.counts.dtoh += 1;
        self.counts.syncs += 1;
    }

    /// `mlp_into`: `[w1; w3]` GEMM, SwiGLU, `w2` GEMM.
    fn mlp(&mut self) {
        self.gemms(2);
        self.kernels(1);
    }
}

impl DecoderOps for Planner<'_> {
    type Error = Infallible;

    fn embed(&mut self) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn add_rms_norm(&mut self, _: usize, _: LayerWeight, _: bool) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn linear(
        &mut self,
        _: usize,
        _: Act,
        _: LayerWeight,
        bias: Option<LayerWeight>,
        _: Act,
    ) -> Result<(), Infallible> {
        self.gemms(1);
        self.kernels(u64::from(bias.is_some()));
        Ok(())
    }

    fn rms_norm_rows(&mut self, _: usize, _: Act, _: LayerWeight) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn mla_norm_query(&mut self, _: usize) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn mla_norm_latent(&mut self, _: usize) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn mla_rope(&mut self, _: usize) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn mla_absorb_query(&mut self, _: usize) -> Result<(), Infallible> {
        // The rotary copy, then one strided batched GEMM over the heads.
        self.kernels(1);
        self.gemms(1);
        Ok(())
    }

    fn mla_write_latent(&mut self, _: usize) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn mla_attention(&mut self, _: usize) -> Result<(), Infallible> {
        self.attention();
        Ok(())
    }

    fn mla_expand_values(&mut self, _: usize) -> Result<(), Infallible> {
        self.gemms(1);
        Ok(())
    }

    fn clamp(&mut self, _: Act, _: f32) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn rope(&mut self, _: usize) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn write_kv(&mut self, _: usize) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn paged_attention(&mut self, _: usize) -> Result<(), Infallible> {
        self.attention();
        Ok(())
    }

    fn sparse_moe(&mut self, _: usize, _: usize) -> Result<(), Infallible> {
        let (c, shape) = (self.c, self.shape);
        self.gemms(1); // router logits
        let device_offsets = if routes_on_device(c, shape.capacity, false) {
            // Zero the counts, top-k, offsets.
            self.counts.memsets += 1;
            self.kernels(2);
            if shape.trace {
                self.read_back();
            }
            self.device_routed_layers += 1;
            let small = experts_on_device_offsets(c, shape.tokens);
            if !small {
                self.read_back();
            }
            small
        } else {
            // The logits back, the routing in: ids, weights, slots, offsets.
            self.read_back();
            self.counts.htod += 4;
            false
        };
        self.kernels(1); // permute
        if device_offsets {
            self.kernels(2);
        } else {
            self.gemms(2 * shape.active_experts as u64);
        }
        if c.experts.bias {
            self.kernels(2);
        }
        self.kernels(2); // activation, unpermute
        if let Some(shared) = c.shared_expert {
            self.mlp();
            self.gemms(u64::from(shared.gated));
            self.kernels(1);
        }
        Ok(())
    }

    fn dense_mlp(&mut self, _: usize) -> Result<(), Infallible> {
        self.mlp();
        self.counts.dtod += 1;
        Ok(())
    }

    fn add_last_delta(&mut self) -> Result<(), Infallible> {
        self.kernels(1);
        Ok(())
    }

    fn logits(&mut self) -> Result<(), Infallible> {
        // Gather the logit rows, the final norm, lm_head; the logits (and the device-routed
        // layers' routing) back, one wait.
        self.kernels(2);
        self.gemms(1);
        let shape = self.shape;
        if shape.greedy_rows > 0 {
            // Argmax and logprob of the greedy rows; their tokens and logprobs back.
            self.kernels(1);
            self.counts.dtoh += 2;
        }
        if shape.greedy_rows < shape.logit_rows {
            self.counts.dtoh += 1;
        }
        if self.shape.routing && self.device_routed_layers > 0 {
            self.counts.dtoh += 2;
        }
        self.counts.syncs += 1;
        Ok(())
    }

    fn observe(&mut self, at: Point) -> Result<(), Infallible> {
        if at == Point::LayerOutput && self.shape.trace {
            self.read_back();
        }
        Ok(())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::config::ModelConfig;
    use crate::moe::OverflowPolicy;
    use moeserve_formats::presets::Preset;
    use std::path::Path;

    /// `preset`'s config with `layers` layers (the presets have 2; the real models' counts
    /// make the plan's figures those of a real step).
    pub(crate) fn config(preset: Preset, layers: usize) -> ModelConfig {
        let mut spec = preset.spec();
        spec.num_hidden_layers = layers;
        let json = spec.config_json().to_string();
        ModelConfig::from_json_str(&json, Path::new(preset.name())).expect("the preset parses")
    }

    /// Mixtral-8x7B's dropless batch-1 decode step: everything stays on the device until the
    /// logits; the step waits for the host once.
    #[test]
    fn a_dropless_decode_step_waits_for_the_host_once() {
        let c = config(Preset::Mixtral8x7b2l, 32);
        let plan = step_plan(&c, StepShape::decode(1));
        let layers = c.num_hidden_layers as u64;
        assert_eq!(layers, 32);
        assert_eq!(plan.syncs, 1, "{plan:?}");
        // The logits, and the step's routing record (each layer's choices and offsets).
        assert_eq!(plan.dtoh, 3, "{plan:?}");
        assert_eq!(plan.htod, 7, "{plan:?}");
        assert_eq!(plan.allocations, 0);
        // Per layer: q, k, v, o and the router; attention: 2 norms, rope, KV write, attention;
        // MoE: top-k, offsets, permute, 2 expert GEMMs, SwiGLU, combine; and the counts' memset.
        assert_eq!(plan.gemms, layers * 5 + 1, "{plan:?}");
        assert_eq!(plan.kernels, 1 + layers * (5 + 7) + 1 + 2, "{plan:?}");
        assert_eq!(plan.memsets, layers);
        assert_eq!(plan.launches(), 7 + 3 + layers * 18 + 5, "{plan:?}");
        // At 16 384 tokens of context the attention splits over blocks: one reduction more
        // per layer, still one wait.
        let long = step_plan(
            &c,
            StepShape {
                max_context: 16384,
                ..StepShape::decode(1)
            },
        );
        assert_eq!(long.kernels, plan.kernels + layers);
        assert_eq!(long.syncs, 1);
    }

    /// Greedy sequences come back as two numbers each: with every row greedy, no logits row
    /// is copied; mixed with sampled rows, the sampled ones come back as one block.
    #[test]
    fn greedy_rows_are_reduced_on_the_device() {
        let c = config(Preset::Mixtral8x7b2l, 32);
        let sampled = step_plan(&c, StepShape::decode(8));
        let greedy = step_plan(
            &c,
            StepShape {
                greedy_rows: 8,
                ..StepShape::decode(8)
            },
        );
        assert_eq!(greedy.syncs, 1);
        assert_eq!(greedy.kernels, sampled.kernels + 1);
        // Tokens and logprobs instead of the logits (and the routing record either way).
        assert_eq!((sampled.dtoh, greedy.dtoh), (3, 4));
        let mixed = step_plan(
            &c,
            StepShape {
                greedy_rows: 5,
                ..StepShape::decode(8)
            },
        );
        assert_eq!(mixed.dtoh, 5);
    }

    /// The same step as it ran before the device-offset GEMM and the step-end read back: the
    /// segment offsets came back every layer (a wait each) and each active expert was its own
    /// cuBLAS call. A batch of 64 on 8 experts is still small enough for the device GEMM.
    #[test]
    fn only_large_steps_read_the_offsets_back_per_layer() {
        let c = config(Preset::Mixtral8x7b2l, 32);
        let layers = c.num_hidden_layers as u64;
        assert_eq!(step_plan(&c, StepShape::decode(64)).syncs, 1);
        let large = StepShape {
            active_experts: 8,
            ..StepShape::decode(65)
        };
        let plan = step_plan(&c, large);
        assert_eq!(plan.syncs, 1 + layers);
        assert_eq!(plan.gemms, layers * (5 + 16) + 1);
        // Traced: every layer's output and router logits come back as well.
        let traced = step_plan(
            &c,
            StepShape {
                trace: true,
                ..StepShape::decode(1)
            },
        );
        assert_eq!(traced.syncs, 1 + 2 * layers);
    }

    /// Every family's dropless router runs on the device: DeepSeek-V3's sigmoid `noaux_tc`
    /// (256 experts in 8 groups, a correction bias, a scale) and DeepSeek-V2-Lite's softmax
    /// make a decode step that waits for the host once, as Mixtral's does.
    #[test]
    fn every_familys_dropless_router_runs_on_the_device() {
        for (preset, layers) in [(Preset::DeepseekV32l, 61), (Preset::DeepseekV2Lite2l, 27)] {
            let c = config(preset, layers);
            let plan = step_plan(&c, StepShape::decode(1));
            assert_eq!(plan.syncs, 1, "{preset:?}: {plan:?}");
            assert_eq!(plan.htod, 7, "{preset:?}: {plan:?}");
            // The logits and the routing record.
            assert_eq!(plan.dtoh, 3, "{preset:?}: {plan:?}");
        }
    }

    /// With a capacity factor the host routes (the overflow is chosen in token order, as on
    /// the CPU): one wait per MoE layer for the logits.
    #[test]
    fn host_routed_layers_wait_once_each() {
        let c = config(Preset::DeepseekV32l, 61);
        let moe_layers = c.sparse_layers.iter().filter(|s| **s).count() as u64;
        assert!(moe_layers > 0);
        let shape = StepShape {
            active_experts: 8,
            capacity: Capacity::Factor {
                alpha: 1.25,
                overflow: OverflowPolicy::Drop,
            },
            ..StepShape::decode(1)
        };
        let plan = step_plan(&c, shape);
        assert_eq!(plan.syncs, 1 + moe_layers, "{plan:?}");
        assert_eq!(plan.htod, 7 + 4 * moe_layers, "{plan:?}");
        // No routing record to read at the end: host-routed layers report as they go.
        assert_eq!(plan.dtoh, 1 + moe_layers, "{plan:?}");
    }
}
