//! Grouped-query self-attention with rotary embeddings over a paged KV cache, with each family's
//! options ([`AttentionConfig`]): projection biases, q/k RMSNorm per head (Qwen3-MoE) or over the
//! whole projection (OLMoE), q/k/v clamped (OLMoE's `clip_qkv`).
//!
//! Follows HF `MixtralAttention` (eager): q/k/v projections, `apply_rotary_pos_emb` with
//! `rotate_half`, `softmax(q·kᵀ · head_dim^-0.5)` in f32 under a causal (optionally sliding-window)
//! mask, `o_proj`. The window admits keys `j` with `q_pos - j < sliding_window`, as HF's
//! `sliding_window_causal_mask_function` does.

use moeserve_backend::Weight;
use moeserve_backend::cpu::{self, attention};
use rayon::prelude::*;

use crate::Result;
use crate::batch::{ForwardBatch, TokenPlace};
use crate::checkpoint::Checkpoint;
use crate::config::{AttentionConfig, ModelConfig, QkNorm};
use crate::kv_cache::{PagedKvCache, slot_of};
use crate::models::workspace::zeroed;

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
    clip_qkv: Option<f32>,
    rms_norm_eps: f32,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    inv_freq: Vec<f32>,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj.weight` and what `config.attention` adds: the
    /// projections' `.bias`, `{prefix}.{q,k}_norm.weight`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let (h, q, kv) = (config.hidden_size, config.q_dim(), config.kv_dim());
        let AttentionConfig {
            qkv_bias,
            o_bias,
            qk_norm,
            clip_qkv,
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
            clip_qkv,
            rms_norm_eps: config.rms_norm_eps,
            num_heads: config.num_attention_heads,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            sliding_window: config.sliding_window,
            inv_freq: cpu::rope_inv_freq(config.head_dim, config.rope_theta),
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

    /// Attention of every step token of `batch`; writes this step's keys and values to `kv` at
    /// `layer` first, so a token sees itself and its sequence's earlier tokens.
    ///
    /// `x: [num_tokens, hidden]` (already normed) → `out: [num_tokens, hidden]`; `bufs` holds
    /// the step's queries, keys, values and attention outputs, `tiled` the projections'
    /// activations in tile order (both reused across layers and steps).
    pub fn forward(
        &self,
        step: &AttentionStep<'_>,
        kv: &mut PagedKvCache,
        bufs: &mut AttentionBuffers,
        tiled: &mut Vec<f32>,
        out: &mut [f32],
    ) {
        let t = step.places.len();
        let (qd, kvd) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let AttentionBuffers {
            q,
            k,
            v,
            attn,
            angles,
        } = bufs;
        zeroed(q, t * qd);
        zeroed(k, t * kvd);
        zeroed(v, t * kvd);
        cpu::matmul_wt_in(step.x, t, &self.q_proj, q, tiled);
        cpu::matmul_wt_in(step.x, t, &self.k_proj, k, tiled);
        cpu::matmul_wt_in(step.x, t, &self.v_proj, v, tiled);
        if let Some([qb, kb, vb]) = &self.qkv_bias {
            cpu::add_bias(q, qb);
            cpu::add_bias(k, kb);
            cpu::add_bias(v, vb);
        }
        if let Some((q_norm, k_norm)) = &self.qk_norm {
            // Rows of `head_dim` (per head) or of the whole projection (flat): the norm's
            // width says which.
            cpu::rms_norm_in_place(q, q_norm, self.rms_norm_eps);
            cpu::rms_norm_in_place(k, k_norm, self.rms_norm_eps);
        }
        if let Some(clip) = self.clip_qkv {
            for x in [&mut *q, &mut *k, &mut *v] {
                x.iter_mut().for_each(|x| *x = x.clamp(-clip, clip));
            }
        }
        let block_size = kv.layout().block_size;
        for (i, place) in step.places.iter().enumerate() {
            angles.set(place.position, &self.inv_freq);
            cpu::apply_rope(&mut q[i * qd..(i + 1) * qd], self.head_dim, angles);
            cpu::apply_rope(&mut k[i * kvd..(i + 1) * kvd], self.head_dim, angles);
            let table = step.batch.sequences[place.sequence].block_table;
            let slot = slot_of(table, block_size, place.position);
            kv.write(
                step.layer,
                slot,
                &k[i * kvd..(i + 1) * kvd],
                &v[i * kvd..(i + 1) * kvd],
            );
        }
        zeroed(attn, t * qd);
        let kv = &*kv;
        let d = self.head_dim;
        let group = self.num_heads / self.num_kv_heads;
        // One task per (token, KV head): the heads of a group share their K/V rows, and a
        // batch-1 decode still spreads over the cores.
        attn.par_chunks_mut(group * d)
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
        cpu::matmul_wt_in(attn, t, &self.o_proj, out, tiled);
        if let Some(ob) = &self.o_bias {
            cpu::add_bias(out, ob);
        }
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
        let first = match self.sliding_window {
            Some(w) => (place.position + 1).saturating_sub(w),
            None => 0,
        };
        let block_size = kv.layout().block_size;
        slots.clear();
        slots.extend((first..=place.position).map(|p| slot_of(table, block_size, p)));
        let (keys, values) = kv.layer_rows(layer);
        let rows = |data| attention::HeadRows {
            data,
            stride: kv.layout().kv_dim,
            offset: kvh * d,
        };
        let query = attention::KvHeadQuery {
            q,
            head_dim: d,
            scale: (d as f32).powf(-0.5),
            keys: rows(keys),
            values: rows(values),
            slots,
        };
        attention::attend_kv_head(&query, scores, out);
    }
}

/// The buffers of a step's attention, reused across layers and steps.
#[derive(Default)]
pub struct AttentionBuffers {
    /// `[num_tokens, num_heads * head_dim]`
    q: Vec<f32>,
    /// `[num_tokens, num_kv_heads * head_dim]`
    k: Vec<f32>,
    v: Vec<f32>,
    /// `[num_tokens, num_heads * head_dim]`: attention outputs before `o_proj`.
    attn: Vec<f32>,
    angles: cpu::RopeAngles,
}

impl AttentionBuffers {
    /// The last step's attention outputs before `o_proj`, `[num_tokens, num_heads * head_dim]`.
    pub fn outputs(&self) -> &[f32] {
        &self.attn
    }
}

thread_local! {
    /// A kernel thread's visible slots and scores of its current (token, KV head) task; kept
    /// per thread so the tasks of a step allocate nothing once the threads have seen a context
    /// as long.
    static ATTEND_SCRATCH: std::cell::RefCell<(Vec<usize>, Vec<f32>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
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
    /// `[num_tokens, hidden]`, normed input.
    pub x: &'a [f32],
}
