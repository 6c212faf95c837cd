//! One layer's grouped-query self-attention on the CPU: its weights with each family's options
//! ([`AttentionConfig`]: projection biases, q/k RMSNorm per head (Qwen3-MoE) or over the whole
//! projection (OLMoE)), and the attention operations the decoder (`models/ops.rs`) composes:
//! rotary embeddings, the paged KV cache write, and attention over it.
//!
//! Follows HF `MixtralAttention` (eager): `apply_rotary_pos_emb` with `rotate_half`,
//! `softmax(q·kᵀ · head_dim^-0.5)` in f32 under a causal (optionally sliding-window) mask. The
//! window admits keys `j` with `q_pos - j < sliding_window`, as HF's
//! `sliding_window_causal_mask_function` does. GPT-OSS adds a sink logit per head to each
//! softmax's denominator (its `eager_attention_forward`).

use moeserve_backend::Weight;
use moeserve_backend::cpu::{self, attention};
use rayon::prelude::*;

use crate::Result;
use crate::batch::{ForwardBatch, TokenPlace};
use crate::checkpoint::Checkpoint;
use crate::config::{AttentionConfig, ModelConfig, QkNorm};
use crate::kv_cache::{LayerRows, PagedKvCache, slot_of};
use crate::layers::rope::RopeFrequencies;
use crate::models::ops::LayerWeight;

/// The attention weights of one layer plus the shapes they imply.
pub struct Attention {
    q_proj: Weight,
    k_proj: Weight,
    v_proj: Weight,
    o_proj: Weight,
    /// `[q, k, v]` biases (Qwen2-MoE; Qwen3-MoE and OLMoE with `attention_bias`).
    qkv_bias: Option<[Weight; 3]>,
    o_bias: Option<Weight>,
    /// `q_norm`, `k_norm`: `[head_dim]` each (per head) or the projections' widths (flat).
    qk_norm: Option<(Weight, Weight)>,
    /// `[num_heads]`: each head's sink logit (GPT-OSS's `sinks`), in f32.
    sinks: Option<Vec<f32>>,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    rope: RopeFrequencies,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj.weight` of decoder layer `layer` and what
    /// `config.attention` adds: the projections' `.bias`, `{prefix}.{q,k}_norm.weight`,
    /// `{prefix}.sinks`.
    pub fn load(
        ckpt: &Checkpoint,
        prefix: &str,
        config: &ModelConfig,
        layer: usize,
    ) -> Result<Self> {
        let (h, q, kv) = (config.hidden_size, config.q_dim(), config.kv_dim());
        let AttentionConfig {
            qkv_bias,
            o_bias,
            qk_norm,
            clip_qkv: _,
            sinks,
        } = config.attention;
        let vector = |name: &str, len: usize| ckpt.weight(&format!("{prefix}.{name}"), &[len]);
        let qkv_bias = match qkv_bias {
            true => Some([
                vector("q_proj.bias", q)?,
                vector("k_proj.bias", kv)?,
                vector("v_proj.bias", kv)?,
            ]),
            false => None,
        };
        let norm_widths = match qk_norm {
            QkNorm::None => None,
            QkNorm::PerHead => Some((config.head_dim, config.head_dim)),
            QkNorm::Flat => Some((q, kv)),
        };
        let qk_norm = norm_widths
            .map(|(qw, kw)| {
                Result::Ok((vector("q_norm.weight", qw)?, vector("k_norm.weight", kw)?))
            })
            .transpose()?;
        Ok(Attention {
            q_proj: ckpt.weight(&format!("{prefix}.q_proj.weight"), &[q, h])?,
            k_proj: ckpt.weight(&format!("{prefix}.k_proj.weight"), &[kv, h])?,
            v_proj: ckpt.weight(&format!("{prefix}.v_proj.weight"), &[kv, h])?,
            o_proj: ckpt.weight(&format!("{prefix}.o_proj.weight"), &[h, q])?,
            qkv_bias,
            o_bias: o_bias.then(|| vector("o_proj.bias", h)).transpose()?,
            qk_norm,
            sinks: sinks
                .then(|| vector("sinks", config.num_attention_heads))
                .transpose()?
                .map(|s| s.to_f32_vec()),
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            sliding_window: config.layer_window(layer),
            // Over the rotated part of a head only (`partial_rotary_factor`), YaRN's if set.
            rope: config.rope_frequencies(),
        })
    }

    pub fn weights(&self) -> [&Weight; 4] {
        [&self.q_proj, &self.k_proj, &self.v_proj, &self.o_proj]
    }

    /// The vectors beside the matrices: biases and q/k norm weights.
    pub fn vectors(&self) -> Vec<&Weight> {
        let mut all: Vec<&Weight> = self.qkv_bias.iter().flatten().collect();
        all.extend(&self.o_bias);
        if let Some((q, k)) = &self.qk_norm {
            all.extend([q, k]);
        }
        all
    }

    /// The weight of `role`, if this layer has it (biases and q/k norms are options).
    /// Each head's sink logit, if the family has them (GPT-OSS); the CUDA model uploads them.
    #[cfg(feature = "cuda")]
    pub(crate) fn sinks(&self) -> Option<&[f32]> {
        self.sinks.as_deref()
    }

    pub(crate) fn weight(&self, role: LayerWeight) -> Option<&Weight> {
        let [qb, kb, vb] = match &self.qkv_bias {
            Some([q, k, v]) => [Some(q), Some(k), Some(v)],
            None => [None; 3],
        };
        let (qn, kn) = match &self.qk_norm {
            Some((q, k)) => (Some(q), Some(k)),
            None => (None, None),
        };
        match role {
            LayerWeight::QProj => Some(&self.q_proj),
            LayerWeight::KProj => Some(&self.k_proj),
            LayerWeight::VProj => Some(&self.v_proj),
            LayerWeight::OProj => Some(&self.o_proj),
            LayerWeight::QBias => qb,
            LayerWeight::KBias => kb,
            LayerWeight::VBias => vb,
            LayerWeight::OBias => self.o_bias.as_ref(),
            LayerWeight::QNorm => qn,
            LayerWeight::KNorm => kn,
            // Norms of the decoder layer, and multi-head latent attention's weights.
            _ => None,
        }
    }

    /// Rotary embeddings on every step token's queries and keys, at its position.
    pub(crate) fn rope(
        &self,
        places: &[TokenPlace],
        q: &mut [f32],
        k: &mut [f32],
        angles: &mut cpu::RopeAngles,
    ) {
        let (qd, kvd) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        for ((place, q), k) in places
            .iter()
            .zip(q.chunks_exact_mut(qd))
            .zip(k.chunks_exact_mut(kvd))
        {
            angles.set_scaled(
                place.position,
                &self.rope.inv_freq,
                self.rope.attention_scaling,
            );
            cpu::apply_rope(q, self.head_dim, angles);
            cpu::apply_rope(k, self.head_dim, angles);
        }
    }

    /// Every step token's key and value into `kv` at `layer`, at its slot.
    pub(crate) fn write_kv(
        &self,
        step: &AttentionStep<'_>,
        kv: &mut PagedKvCache,
        k: &[f32],
        v: &[f32],
    ) {
        let kvd = self.num_kv_heads * self.head_dim;
        let block_size = kv.layout().block_size;
        for (i, place) in step.places.iter().enumerate() {
            let table = step.batch.sequences[place.sequence].block_table;
            let slot = slot_of(table, block_size, place.position);
            let rows = i * kvd..(i + 1) * kvd;
            kv.write(step.layer, slot, &k[rows.clone()], &v[rows]);
        }
    }

    /// Attention of every step token's queries `q` over the keys and values its sequence has
    /// in `kv` (this step's included, written first), into `out: [num_tokens, q_dim]`.
    pub(crate) fn attend_all(
        &self,
        step: &AttentionStep<'_>,
        kv: &PagedKvCache,
        q: &[f32],
        out: &mut [f32],
    ) {
        let d = self.head_dim;
        let qd = self.num_heads * d;
        let group = self.num_heads / self.num_kv_heads;
        // One task per (token, KV head): the heads of a group share their K/V rows, and a
        // batch-1 decode still spreads over the cores.
        out.par_chunks_mut(group * d)
            .enumerate()
            .for_each(|(i, out)| {
                let (token, kvh) = (i / self.num_kv_heads, i % self.num_kv_heads);
                let place = step.places[token];
                let table = step.batch.sequences[place.sequence].block_table;
                let q = &q[token * qd + kvh * group * d..][..group * d];
                ATTEND_SCRATCH.with_borrow_mut(|scratch| {
                    self.attend(step.layer, kv, (place, table, kvh), q, scratch, out)
                });
            });
    }

    /// The query heads of KV head `kvh` of one token against its visible keys; `scratch` holds
    /// the visible slots and the scores, reused across a thread's tasks.
    fn attend(
        &self,
        layer: usize,
        kv: &PagedKvCache,
        (place, table, kvh): (TokenPlace, &[u32], usize),
        q: &[f32],
        (slots, scores): &mut (Vec<usize>, Vec<f32>),
        out: &mut [f32],
    ) {
        let d = self.head_dim;
        let group = self.num_heads / self.num_kv_heads;
        let first = match self.sliding_window {
            Some(w) => (place.position + 1).saturating_sub(w),
            None => 0,
        };
        slots.clear();
        // This head's rows of the visible positions (a block's rows of one head lie together).
        kv.layout()
            .extend_head_rows(table, first..=place.position, kvh, slots);
        let sinks = (self.sinks.as_deref()).map(|s| &s[kvh * group..(kvh + 1) * group]);
        let head = CachedHead {
            stride: d,
            offset: 0,
            head_dim: d,
            value_dim: d,
            scale: (d as f32).powf(-0.5),
        };
        head.attend(kv.layer_rows(layer), q, slots, sinks, scores, out);
    }
}

/// Where one KV head's rows sit in a layer's cache rows, and the widths and scale of its
/// attention: what [`attention::KvHeadQuery`] needs beyond the rows' element type.
#[derive(Clone, Copy)]
pub(crate) struct CachedHead {
    /// Elements from one of the head's cached rows to the next: `head_dim` where the rows are
    /// head rows (`KvCacheLayout::head_row`), the latent row's width for MLA.
    pub stride: usize,
    /// The head's first element in its row.
    pub offset: usize,
    pub head_dim: usize,
    pub value_dim: usize,
    pub scale: f32,
}

impl CachedHead {
    /// `out` ← attention of the query heads `q` over the rows at `slots` of a layer's keys and
    /// values, in the element type the cache stores them in.
    pub(crate) fn attend(
        self,
        rows: LayerRows<'_>,
        q: &[f32],
        slots: &[usize],
        sinks: Option<&[f32]>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        match rows {
            LayerRows::F32(k, v) => self.attend_rows((k, v), q, slots, sinks, scores, out),
            LayerRows::Bf16(k, v) => self.attend_rows((k, v), q, slots, sinks, scores, out),
        }
    }

    fn attend_rows<T: attention::KvElement>(
        self,
        (keys, values): (&[T], &[T]),
        q: &[f32],
        slots: &[usize],
        sinks: Option<&[f32]>,
        scores: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let rows = |data| attention::HeadRows {
            data,
            stride: self.stride,
            offset: self.offset,
        };
        let query = attention::KvHeadQuery {
            q,
            head_dim: self.head_dim,
            value_dim: self.value_dim,
            scale: self.scale,
            keys: rows(keys),
            values: rows(values),
            slots,
            sinks,
        };
        attention::attend_kv_head(&query, scores, out);
    }
}

thread_local! {
    /// A kernel thread's visible slots and scores of its current (token, KV head) task; kept
    /// per thread so the tasks of a step allocate nothing once the threads have seen a context
    /// as long.
    static ATTEND_SCRATCH: std::cell::RefCell<(Vec<usize>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
}

/// Runs `f` on this kernel thread's attention scratch (visible slots, scores).
pub(crate) fn with_attend_scratch<R>(f: impl FnOnce(&mut (Vec<usize>, Vec<f32>)) -> R) -> R {
    ATTEND_SCRATCH.with_borrow_mut(f)
}

/// Makes every kernel thread's attention scratch hold a query of up to `group` heads against
/// `max_context` keys without growing (with `cpu::reserve_task_scratch`, what lets a step
/// allocate nothing whichever thread runs a task).
pub fn reserve_task_scratch(group: usize, max_context: usize) {
    rayon::broadcast(|_| {
        ATTEND_SCRATCH.with_borrow_mut(|(slots, scores)| {
            slots.reserve(max_context.saturating_sub(slots.len()));
            scores.reserve((group * max_context).saturating_sub(scores.len()));
        })
    });
}

/// What one layer's attention needs about the step.
pub struct AttentionStep<'a> {
    pub layer: usize,
    pub batch: &'a ForwardBatch<'a>,
    pub places: &'a [TokenPlace],
}

impl<'a> AttentionStep<'a> {
    pub fn new(layer: usize, batch: &'a ForwardBatch<'a>, places: &'a [TokenPlace]) -> Self {
        AttentionStep {
            layer,
            batch,
            places,
        }
    }
}
