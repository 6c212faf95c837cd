//! A loaded model of any family ([`MoeModel`]): its weights per layer (attention with the
//! family's options, then the sparse MoE block, with or without a shared expert, or a dense
//! MLP) and its CPU forward. The layer order itself is written once, in `ops::decode`, over
//! the operations each backend implements (`cpu_step.rs` here, `cuda.rs` on a GPU). Follows HF
//! `modeling_mixtral.py`, `modeling_qwen3_moe.py`, `modeling_qwen2_moe.py` and
//! `modeling_olmoe.py`; on the CPU every activation is f32, weights stay in their stored dtype
//! and are widened inside the kernels.

use std::path::Path;

use moeserve_backend::{Weight, cpu};

use crate::batch::{BatchLimits, ForwardBatch};
use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::kv_cache::{KvCacheLayout, PagedKvCache};
use crate::layers::attention::Attention;
use crate::layers::mla::MlaAttention;
use crate::models::cpu_step::CpuStep;
use crate::models::ops::LayerWeight;
use crate::models::ops::decode;
use crate::models::workspace::ForwardWorkspace;
use crate::moe::experts::check_router_bias;
use crate::moe::{Expert, MoeOptions, SparseMoe};
use crate::quantize::Hessians;
use crate::{ModelError, Result};

pub(crate) struct DecoderLayer {
    pub(crate) input_layernorm: Weight,
    pub(crate) self_attn: SelfAttention,
    pub(crate) post_attention_layernorm: Weight,
    pub(crate) mlp: FeedForward,
}

/// A decoder layer's attention block.
pub(crate) enum SelfAttention {
    /// Grouped-query attention with the family's options.
    Grouped(Box<Attention>),
    /// Multi-head latent attention (DeepSeek-V2/V3).
    Latent(Box<MlaAttention>),
}

impl SelfAttention {
    /// Every matrix a token goes through.
    pub(crate) fn weights(&self) -> Vec<&Weight> {
        match self {
            SelfAttention::Grouped(a) => a.weights().to_vec(),
            SelfAttention::Latent(a) => a.weights(),
        }
    }

    /// The vectors beside the matrices: biases and norm weights.
    pub(crate) fn vectors(&self) -> Vec<&Weight> {
        match self {
            SelfAttention::Grouped(a) => a.vectors(),
            SelfAttention::Latent(a) => a.vectors(),
        }
    }

    pub(crate) fn weight(&self, role: LayerWeight) -> Option<&Weight> {
        match self {
            SelfAttention::Grouped(a) => a.weight(role),
            SelfAttention::Latent(a) => a.weight(role),
        }
    }

    /// The grouped-query attention of this layer (`None` for MLA).
    pub(crate) fn grouped(&self) -> Option<&Attention> {
        match self {
            SelfAttention::Grouped(a) => Some(a),
            SelfAttention::Latent(_) => None,
        }
    }

    /// The latent attention of this layer (`None` for grouped-query attention).
    pub(crate) fn latent(&self) -> Option<&MlaAttention> {
        match self {
            SelfAttention::Latent(a) => Some(a),
            SelfAttention::Grouped(_) => None,
        }
    }
}

/// A decoder layer's feed-forward block.
pub(crate) enum FeedForward {
    /// The sparse MoE block. Its index among the model's sparse layers (what expert
    /// placement, load tracking and the routing record count) is that of its layer among
    /// `ModelConfig::sparse_layers`.
    Sparse(Box<SparseMoe>),
    /// A dense SwiGLU MLP (`mlp_only_layers`, `decoder_sparse_step`).
    Dense(Box<Expert>),
}

impl DecoderLayer {
    pub(crate) fn moe(&self) -> Option<&SparseMoe> {
        match &self.mlp {
            FeedForward::Sparse(moe) => Some(moe.as_ref()),
            FeedForward::Dense(_) => None,
        }
    }
}

/// A loaded model of any family; immutable, shared by all steps.
pub struct MoeModel {
    config: ModelConfig,
    pub(crate) embed_tokens: Weight,
    pub(crate) layers: Vec<DecoderLayer>,
    pub(crate) norm: Weight,
    /// `embed_tokens` again when the embeddings are tied.
    pub(crate) lm_head: Weight,
}

impl DecoderLayer {
    /// The feed-forward matrices every token of this layer goes through: the router and the
    /// shared expert of a sparse block, or the dense MLP.
    fn always_read(&self) -> Vec<&Weight> {
        match &self.mlp {
            FeedForward::Sparse(moe) => {
                let mut all = vec![&moe.gate];
                if let Some(shared) = &moe.shared {
                    let e = &shared.mlp;
                    all.extend([&e.w1, &e.w2, &e.w3]);
                    all.extend(&shared.gate);
                }
                all
            }
            FeedForward::Dense(e) => vec![&e.w1, &e.w2, &e.w3],
        }
    }
}

/// Which positions get logits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LogitsFor {
    /// The last step token of every sequence (what sampling needs): `[num_sequences, vocab]`.
    LastTokens,
    /// Every step token: `[num_tokens, vocab]`.
    AllTokens,
}

/// Intermediate values recorded for reference tests.
#[derive(Debug, Default)]
pub struct ForwardTrace {
    /// Per layer: the residual stream after the layer, `[num_tokens, hidden]`.
    pub layer_outputs: Vec<Vec<f32>>,
    /// Per layer: router logits, `[num_tokens, num_experts]`.
    pub router_logits: Vec<Vec<f32>>,
}

/// Options of one forward pass.
pub struct ForwardOptions<'a> {
    pub logits: LogitsFor,
    pub trace: Option<&'a mut ForwardTrace>,
    /// Routing capacity, expert parallelism and the per-layer routing record.
    pub moe: MoeOptions<'a>,
    /// Logits rows the caller only needs the greedy token of; a backend that reduces them
    /// itself (CUDA) says so in [`GreedyRows::reduced`] and returns only the others' logits.
    pub greedy: Option<&'a mut GreedyRows>,
}

impl Default for ForwardOptions<'_> {
    fn default() -> Self {
        ForwardOptions {
            logits: LogitsFor::LastTokens,
            trace: None,
            moe: MoeOptions::default(),
            greedy: None,
        }
    }
}

/// Which last-token logits rows want only their greedy token, and what the backend made of
/// them. On CUDA the argmax and its log-probability are computed on the device and only the
/// other rows' logits come back; the CPU returns every row and leaves `reduced` empty.
#[derive(Debug, Default)]
pub struct GreedyRows {
    /// `[logits rows]`: whether the row's sequence samples greedily with nothing else to do
    /// on its logits (no penalties, bias, grammar, top logprobs, or forked choices).
    pub wanted: Vec<bool>,
    /// `[logits rows]` when the backend reduced the wanted rows (their rows of the returned
    /// logits are then unspecified), else empty.
    pub reduced: Vec<Greedy>,
}

/// One row's outcome under [`GreedyRows`].
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Greedy {
    /// Not wanted: sample the row of the returned logits.
    Logits,
    /// The argmax (ties to the lower id) and its log-probability under the full softmax.
    Token { id: u32, logprob: f32 },
    /// The row has a NaN or +inf logit, or every logit is -inf: the CPU sampler refuses it.
    NotFinite,
}

impl MoeModel {
    /// Loads `dir/config.json` (its `architectures` picks the family) and the safetensors
    /// weights of `dir`, and puts the matrices into the CPU kernels' layout
    /// ([`MoeModel::prepare_kernels`]).
    pub fn load(dir: &Path) -> Result<Self> {
        let model = Self::load_unprepared(dir)?;
        model.prepare_kernels();
        Ok(model)
    }

    /// As [`MoeModel::load`] without the CPU kernels' layout: for a model that runs on a
    /// GPU (`CudaMoeModel` uploads the stored weights; packing them would only double host memory).
    pub fn load_unprepared(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let ckpt = Checkpoint::open(dir)?;
        Self::from_checkpoint(config, &ckpt)
    }

    /// As [`MoeModel::load`], every weight as stored whatever `--quantization` says and
    /// without the checkpoint's int8 tensors: what `moeserve quantize` calibrates.
    pub fn load_as_stored(dir: &Path) -> Result<Self> {
        let config = ModelConfig::from_dir(dir)?;
        let model = Self::from_checkpoint(config, &Checkpoint::open(dir)?.as_stored())?;
        model.prepare_kernels();
        Ok(model)
    }

    pub fn from_checkpoint(config: ModelConfig, ckpt: &Checkpoint) -> Result<Self> {
        let (h, v) = (config.hidden_size, config.vocab_size);
        let embed_tokens = ckpt.weight("model.embed_tokens.weight", &[v, h])?;
        let lm_head = if config.tie_word_embeddings {
            // A tied head may still have an int8 form of its own (`moeserve quantize`).
            match ckpt.int8_for_kernels("lm_head", v, h)? {
                Some(rows) => embed_tokens.with_int8(rows)?,
                None => embed_tokens.clone(),
            }
        } else {
            ckpt.weight("lm_head.weight", &[v, h])?
        };
        let layers = (0..config.num_hidden_layers)
            .map(|l| {
                let p = format!("model.layers.{l}");
                let block = format!("{p}.{}", config.names.moe_block);
                let mlp = if config.sparse_layers[l] {
                    FeedForward::Sparse(Box::new(SparseMoe::load(ckpt, &block, &config)?))
                } else {
                    FeedForward::Dense(Box::new(Expert::load_mlp(
                        ckpt,
                        &format!("{p}.mlp"),
                        h,
                        config.intermediate_size,
                    )?))
                };
                let attn = format!("{p}.self_attn");
                let self_attn = match config.mla {
                    Some(_) => {
                        SelfAttention::Latent(Box::new(MlaAttention::load(ckpt, &attn, &config)?))
                    }
                    None => {
                        SelfAttention::Grouped(Box::new(Attention::load(ckpt, &attn, &config, l)?))
                    }
                };
                Ok(DecoderLayer {
                    input_layernorm: ckpt.weight(&format!("{p}.input_layernorm.weight"), &[h])?,
                    self_attn,
                    post_attention_layernorm: ckpt
                        .weight(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                    mlp,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let norm = ckpt.weight("model.norm.weight", &[h])?;
        Ok(MoeModel {
            config,
            embed_tokens,
            layers,
            norm,
            lm_head,
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }

    /// The checkpoint's element type (of its embeddings; a GPU model computes in it).
    pub fn weight_dtype(&self) -> moeserve_core::DType {
        self.embed_tokens.dtype()
    }

    /// The MoE block of every sparse layer, in layer order (dense layers have none): MoE layer
    /// `m` of placement, load tracking and routing records is `moe_layers()[m]`.
    pub fn moe_layers(&self) -> Vec<&SparseMoe> {
        self.layers.iter().filter_map(DecoderLayer::moe).collect()
    }

    /// Number of sparse MoE layers.
    pub fn num_moe_layers(&self) -> usize {
        self.config.num_moe_layers()
    }

    /// Adds `bias[e]` to expert `e`'s router logit in every sparse layer, steering tokens
    /// towards some experts (skewed-load tests of expert placement use it); replaces an
    /// earlier bias.
    pub fn add_router_bias(&mut self, bias: &[f32]) -> Result<()> {
        check_router_bias(bias, self.config.num_local_experts)?;
        for layer in &mut self.layers {
            if let FeedForward::Sparse(moe) = &mut layer.mlp {
                moe.router_bias = Some(bias.to_vec());
            }
        }
        Ok(())
    }

    /// A KV cache layout for this model with `num_blocks` blocks of `block_size` tokens.
    pub fn kv_layout(&self, num_blocks: usize, block_size: usize) -> KvCacheLayout {
        KvCacheLayout::for_model(&self.config, num_blocks, block_size)
    }

    /// Every weight matrix that goes through the GEMM (lm_head once even when tied).
    fn matrices(&self) -> Vec<&Weight> {
        let mut all = vec![&self.lm_head];
        for layer in &self.layers {
            all.extend(layer.self_attn.weights());
            all.extend(layer.always_read());
            if let Some(moe) = layer.moe() {
                all.extend(moe.experts.iter().flat_map(|e| [&e.w1, &e.w2, &e.w3]));
            }
        }
        all
    }

    /// Matrices that stay as stored under `--quantization` (routers, shared-expert gates, the
    /// per-head pieces of latent attention's kv_b_proj).
    fn exact_matrices(&self) -> usize {
        let moe: usize = self
            .moe_layers()
            .iter()
            .map(|m| 1 + m.shared.as_ref().map_or(0, |s| s.gate.iter().count()))
            .sum();
        let latent: usize = (self.layers.iter())
            .filter_map(|l| l.self_attn.latent())
            .map(MlaAttention::exact_matrices)
            .sum();
        moe + latent
    }

    /// What `--quantization` makes of the matrices, for logs: `none`, `int8 (rounded at load)`
    /// or `int8 (GPTQ integers of N of M matrices from the checkpoint)`.
    pub fn quantization_summary(&self) -> String {
        let q = cpu::weight_quantization();
        if q != cpu::WeightQuantization::Int8 {
            return q.to_string();
        }
        let matrices = self.matrices();
        let stored = matrices.iter().filter(|w| w.has_stored_int8()).count();
        let quantized = matrices.len() - self.exact_matrices();
        match stored {
            0 => "int8 (rounded at load)".into(),
            _ => format!(
                "int8 (GPTQ integers of {stored} of {quantized} matrices from the checkpoint)"
            ),
        }
    }

    /// Bytes (as the kernels store them) of the matrices every step reads whatever the
    /// routing: attention projections, routers, shared experts, dense MLPs and lm_head (the
    /// embedding rows a step gathers are negligible).
    pub fn dense_matrix_bytes(&self) -> usize {
        let per_layer: usize = self
            .layers
            .iter()
            .map(|l| {
                let attn: usize = l.self_attn.weights().iter().map(|w| w.kernel_bytes()).sum();
                attn + l
                    .always_read()
                    .iter()
                    .map(|w| w.kernel_bytes())
                    .sum::<usize>()
            })
            .sum();
        per_layer + self.lm_head.kernel_bytes()
    }

    /// Bytes of expert `expert` of MoE layer `moe_layer` (its three matrices).
    pub fn expert_bytes(&self, moe_layer: usize, expert: usize) -> usize {
        let e = &self.moe_layers()[moe_layer].experts[expert];
        [&e.w1, &e.w2, &e.w3].iter().map(|w| w.kernel_bytes()).sum()
    }

    /// Matmul parameters one token goes through below lm_head: attention, router and the
    /// `top_k` experts of every layer (for FLOP counts: 2 FLOPs per parameter).
    pub fn active_matmul_params(&self) -> usize {
        self.layers
            .iter()
            .map(|l| {
                let attn: usize = l.self_attn.weights().iter().map(|w| w.numel()).sum();
                let always: usize = l.always_read().iter().map(|w| w.numel()).sum();
                let routed = l.moe().map_or(0, |moe| {
                    let expert: usize = moe
                        .experts
                        .first()
                        .map_or(0, |e| [&e.w1, &e.w2, &e.w3].iter().map(|w| w.numel()).sum());
                    moe.top_k * expert
                });
                attn + always + routed
            })
            .sum()
    }

    /// Parameters of lm_head (a token that gets logits goes through it once).
    pub fn lm_head_params(&self) -> usize {
        self.lm_head.numel()
    }

    /// Bytes of all weights (tied embeddings counted once).
    pub fn weight_bytes(&self) -> usize {
        let mut total = self.norm.size_in_bytes()
            + self
                .matrices()
                .iter()
                .map(|w| w.size_in_bytes())
                .sum::<usize>();
        if !self.config.tie_word_embeddings {
            total += self.embed_tokens.size_in_bytes();
        }
        for layer in &self.layers {
            total += layer.input_layernorm.size_in_bytes()
                + layer.post_attention_layernorm.size_in_bytes();
            total += layer
                .self_attn
                .vectors()
                .iter()
                .map(|w| w.size_in_bytes())
                .sum::<usize>();
        }
        total
    }

    /// Puts every matrix into the kernels' layout now (in parallel) rather than on first use,
    /// so the first request does not pay for it.
    pub fn prepare_kernels(&self) {
        use rayon::prelude::*;
        if cpu::isa().packs_weights() {
            self.matrices().par_iter().for_each(|w| {
                w.packed();
            });
        }
    }

    /// Sizes every kernel thread's per-task buffers for steps of up to `max_tokens` tokens over
    /// contexts of up to `max_context` (the engine's token budget and `--max-model-len`), so
    /// that steps run in a warmed-up [`ForwardWorkspace`] allocate nothing whichever pool
    /// thread runs which task. Without it the buffers grow on first use.
    pub fn reserve_task_scratch(&self, max_tokens: usize, max_context: usize) {
        let c = &self.config;
        cpu::reserve_task_scratch(max_tokens);
        let windows: Option<Vec<usize>> = (0..c.num_hidden_layers)
            .map(|l| c.layer_window(l))
            .collect();
        let visible = match windows {
            Some(w) => w.into_iter().max().unwrap_or(0).min(max_context),
            None => max_context,
        };
        let group = match c.mla {
            Some(_) => crate::layers::mla::MAX_HEADS_PER_TASK,
            None => c.num_attention_heads / c.num_key_value_heads.max(1),
        };
        crate::layers::attention::reserve_task_scratch(group, visible);
    }

    /// Runs one step: writes the step tokens' keys/values into `kv` and returns logits
    /// (`[num_sequences or num_tokens, vocab]`, see [`LogitsFor`]).
    pub fn forward(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut PagedKvCache,
        opts: ForwardOptions<'_>,
    ) -> Result<Vec<f32>> {
        let mut ws = ForwardWorkspace::default();
        self.forward_in(batch, kv, opts, &mut ws)?;
        Ok(std::mem::take(&mut ws.logits))
    }

    /// [`MoeModel::forward`] in the buffers of `ws`, which holds the logits it returns.
    /// Steps run in one workspace allocate nothing once it has seen a step as large (without
    /// expert parallelism or a trace).
    pub fn forward_in<'w>(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut PagedKvCache,
        opts: ForwardOptions<'_>,
        ws: &'w mut ForwardWorkspace,
    ) -> Result<&'w [f32]> {
        // The whole pass runs on a kernel pool thread: each of the step's ~500 parallel kernels
        // then forks from inside the pool instead of waking the pool from outside and sleeping
        // until it is done (a futex round trip per kernel).
        super::pool::with_workers_awake(|| self.forward_on_pool(batch, kv, opts, ws, None))?;
        Ok(&ws.logits)
    }

    /// A forward pass that also adds every quantizable matrix's inputs to `hessians` (the
    /// calibration pass of `moeserve quantize`); returns the last tokens' logits.
    pub fn forward_calibrating(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut PagedKvCache,
        hessians: &mut Hessians,
    ) -> Result<Vec<f32>> {
        let mut ws = ForwardWorkspace::default();
        let opts = ForwardOptions::default();
        rayon::scope(|_| self.forward_on_pool(batch, kv, opts, &mut ws, Some(hessians)))?;
        Ok(std::mem::take(&mut ws.logits))
    }

    fn forward_on_pool(
        &self,
        batch: &ForwardBatch<'_>,
        kv: &mut PagedKvCache,
        opts: ForwardOptions<'_>,
        ws: &mut ForwardWorkspace,
        calibration: Option<&mut Hessians>,
    ) -> Result<()> {
        let c = &self.config;
        let layout = *kv.layout();
        if layout.num_layers != c.num_hidden_layers
            || (layout.key_dim, layout.value_dim) != c.kv_cache_row()
            || layout.kv_heads != c.kv_cache_heads()
        {
            return Err(ModelError::InvalidInput {
                message: format!("KV cache layout {layout:?} does not fit the model"),
            });
        }
        let limits = BatchLimits {
            vocab_size: c.vocab_size,
            max_position_embeddings: c.max_position_embeddings,
            block_size: layout.block_size,
            num_blocks: layout.num_blocks,
        };
        batch.places_into(&limits, &mut ws.places)?;
        opts.moe.check(c)?;
        let mut step = CpuStep {
            model: self,
            batch,
            kv,
            ws,
            logits_for: opts.logits,
            trace: opts.trace,
            moe: opts.moe,
            calibration,
        };
        match decode(c, &mut step) {
            Ok(()) => Ok(()),
        }
    }
}
