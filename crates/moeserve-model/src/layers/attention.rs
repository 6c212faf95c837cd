//! Grouped-query self-attention with rotary embeddings over a paged KV cache.
//!
//! Follows HF `MixtralAttention` (eager): q/k/v projections, `apply_rotary_pos_emb` with
//! `rotate_half`, `softmax(q·kᵀ · head_dim^-0.5)` in f32 under a causal (optionally sliding-window)
//! mask, `o_proj`. The window admits keys `j` with `q_pos - j < sliding_window`, as HF's
//! `sliding_window_causal_mask_function` does.

use moeserve_backend::{Weight, cpu};
use rayon::prelude::*;

use crate::Result;
use crate::batch::{ForwardBatch, TokenPlace};
use crate::checkpoint::Checkpoint;
use crate::config::MixtralConfig;
use crate::kv_cache::{PagedKvCache, slot_of};

/// The attention weights of one layer plus the shapes they imply.
pub struct Attention {
    q_proj: Weight,
    k_proj: Weight,
    v_proj: Weight,
    o_proj: Weight,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    sliding_window: Option<usize>,
    inv_freq: Vec<f32>,
}

impl Attention {
    /// Loads `{prefix}.{q,k,v,o}_proj.weight`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &MixtralConfig) -> Result<Self> {
        let (h, q, kv) = (config.hidden_size, config.q_dim(), config.kv_dim());
        Ok(Attention {
            q_proj: ckpt.weight(&format!("{prefix}.q_proj.weight"), &[q, h])?,
            k_proj: ckpt.weight(&format!("{prefix}.k_proj.weight"), &[kv, h])?,
            v_proj: ckpt.weight(&format!("{prefix}.v_proj.weight"), &[kv, h])?,
            o_proj: ckpt.weight(&format!("{prefix}.o_proj.weight"), &[h, q])?,
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

    /// Attention of every step token of `batch`; writes this step's keys and values to `kv` at
    /// `layer` first, so a token sees itself and its sequence's earlier tokens.
    ///
    /// `x: [num_tokens, hidden]` (already normed) → `out: [num_tokens, hidden]`.
    pub fn forward(&self, step: &AttentionStep<'_>, kv: &mut PagedKvCache, out: &mut [f32]) {
        let t = step.places.len();
        let (qd, kvd) = (
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        );
        let mut q = vec![0.0; t * qd]; // [num_tokens, num_heads * head_dim]
        let mut k = vec![0.0; t * kvd]; // [num_tokens, num_kv_heads * head_dim]
        let mut v = vec![0.0; t * kvd];
        cpu::matmul_wt(step.x, t, &self.q_proj, &mut q);
        cpu::matmul_wt(step.x, t, &self.k_proj, &mut k);
        cpu::matmul_wt(step.x, t, &self.v_proj, &mut v);
        let block_size = kv.layout().block_size;
        for (i, place) in step.places.iter().enumerate() {
            cpu::apply_rope(
                &mut q[i * qd..(i + 1) * qd],
                self.head_dim,
                place.position,
                &self.inv_freq,
            );
            cpu::apply_rope(
                &mut k[i * kvd..(i + 1) * kvd],
                self.head_dim,
                place.position,
                &self.inv_freq,
            );
            let table = step.batch.sequences[place.sequence].block_table;
            let slot = slot_of(table, block_size, place.position);
            kv.write(
                step.layer,
                slot,
                &k[i * kvd..(i + 1) * kvd],
                &v[i * kvd..(i + 1) * kvd],
            );
        }
        let mut attn = vec![0.0; t * qd]; // [num_tokens, num_heads * head_dim]
        let kv = &*kv;
        attn.par_chunks_mut(qd)
            .zip(q.par_chunks(qd))
            .zip(step.places.par_iter())
            .for_each(|((o, q), place)| {
                let table = step.batch.sequences[place.sequence].block_table;
                self.attend_one_token(
                    AttendOne {
                        layer: step.layer,
                        q,
                        place: *place,
                        table,
                        kv,
                    },
                    o,
                )
            });
        cpu::matmul_wt(&attn, t, &self.o_proj, out);
    }

    /// All heads of one query token against its visible keys.
    fn attend_one_token(&self, a: AttendOne<'_>, out: &mut [f32]) {
        let d = self.head_dim;
        let group = self.num_heads / self.num_kv_heads;
        let scale = (d as f32).powf(-0.5);
        let first = match self.sliding_window {
            Some(w) => (a.place.position + 1).saturating_sub(w),
            None => 0,
        };
        let block_size = a.kv.layout().block_size;
        let slots: Vec<usize> = (first..=a.place.position)
            .map(|p| slot_of(a.table, block_size, p))
            .collect();
        let mut scores = vec![0.0f32; slots.len()];
        for h in 0..self.num_heads {
            let kvh = h / group;
            let qh = &a.q[h * d..(h + 1) * d];
            for (s, slot) in scores.iter_mut().zip(&slots) {
                let kh = &a.kv.key(a.layer, *slot)[kvh * d..(kvh + 1) * d];
                *s = qh.iter().zip(kh).map(|(x, y)| x * y).sum::<f32>() * scale;
            }
            cpu::softmax_in_place(&mut scores);
            let oh = &mut out[h * d..(h + 1) * d];
            oh.fill(0.0);
            for (p, slot) in scores.iter().zip(&slots) {
                let vh = &a.kv.value(a.layer, *slot)[kvh * d..(kvh + 1) * d];
                oh.iter_mut().zip(vh).for_each(|(o, v)| *o += p * v);
            }
        }
    }
}

/// What one layer's attention needs about the step.
pub struct AttentionStep<'a> {
    pub layer: usize,
    pub batch: &'a ForwardBatch<'a>,
    pub places: &'a [TokenPlace],
    /// `[num_tokens, hidden]`, normed input.
    pub x: &'a [f32],
}

/// One query token's view of the cache.
struct AttendOne<'a> {
    layer: usize,
    q: &'a [f32],
    place: TokenPlace,
    table: &'a [u32],
    kv: &'a PagedKvCache,
}
