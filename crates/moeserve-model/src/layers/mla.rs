//! One layer's multi-head latent attention on the CPU (DeepSeek-V2/V3, [`MlaConfig`]): its
//! weights, and the operations the decoder (`models/ops.rs`) composes for it.
//!
//! HF `DeepseekV2Attention` expands the cached latent `c` into every head's key
//! `[W_uk[h]·c | k_rope]` and value `W_uv[h]·c`. Here the up-projections are absorbed instead,
//! so attention runs in the latent space over what the cache stores, one
//! `kv_lora_rank + qk_rope_head_dim` row per token whatever the number of heads:
//!
//! ```text
//! score(h, j) = q_nope[h]·(W_uk[h]·c_j) + q_rope[h]·k_rope_j
//!             = (W_uk[h]ᵀ·q_nope[h])·c_j + q_rope[h]·k_rope_j   = [q_lat[h] | q_rope[h]] · row_j
//! out[h]      = Σ_j p(h, j) · W_uv[h]·c_j = W_uv[h] · (Σ_j p(h, j) · c_j)
//! ```
//!
//! `W_uk[h]ᵀ` (`[kv_lora_rank, qk_nope]`) and `W_uv[h]` (`[v_head, kv_lora_rank]`) are cut
//! from `kv_b_proj` once, at load, in its stored dtype (the transpose is exact).

use moeserve_backend::cpu;
use moeserve_backend::{Weight, WeightBytes};
use moeserve_core::DType;
use rayon::prelude::*;

use crate::Result;
use crate::batch::TokenPlace;
use crate::checkpoint::Checkpoint;
use crate::config::{MlaConfig, ModelConfig};
use crate::kv_cache::{PagedKvCache, slot_of};
use crate::layers::attention::{AttentionStep, CachedHead, with_attend_scratch};
use crate::layers::rope::RopeFrequencies;
use crate::models::ops::LayerWeight;

/// Query heads one attention task covers at most: a batch-1 decode still spreads over the
/// cores, and the heads of a task share each latent row they load.
pub const MAX_HEADS_PER_TASK: usize = 4;

/// The most heads up to [`MAX_HEADS_PER_TASK`] that divide `num_heads`.
fn heads_per_task(num_heads: usize) -> usize {
    (1..=MAX_HEADS_PER_TASK)
        .rev()
        .find(|n| num_heads.is_multiple_of(*n))
        .unwrap_or(1)
}

/// How the query is projected.
#[allow(clippy::large_enum_variant)] // One per layer, made once at load.
enum QueryProjection {
    /// `q_proj` (V2-Lite: `q_lora_rank` null).
    Direct(Weight),
    /// `q_a_proj` (+ bias) → `q_a_layernorm` → `q_b_proj`.
    LowRank {
        a: Weight,
        a_bias: Option<Weight>,
        norm: Weight,
        b: Weight,
    },
}

/// The weights of one layer's latent attention.
pub struct MlaAttention {
    query: QueryProjection,
    kv_a_proj: Weight,
    kv_a_bias: Option<Weight>,
    kv_a_norm: Weight,
    /// Per head, `W_uk[h]ᵀ`: `[kv_lora_rank, qk_nope_head_dim]` (absorbed into the query).
    absorb_key: Vec<Weight>,
    /// Per head, `W_uv[h]`: `[v_head_dim, kv_lora_rank]` (expands the latent output).
    expand_value: Vec<Weight>,
    o_proj: Weight,
    o_bias: Option<Weight>,
    mla: MlaConfig,
    num_heads: usize,
    rope: RopeFrequencies,
}

impl MlaAttention {
    /// Loads `{prefix}.{q_proj | q_a_proj, q_a_layernorm, q_b_proj}`, `kv_a_proj_with_mqa`,
    /// `kv_a_layernorm`, `kv_b_proj`, `o_proj` and, with `attention_bias`, the biases of
    /// `q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`.
    pub fn load(ckpt: &Checkpoint, prefix: &str, config: &ModelConfig) -> Result<Self> {
        let mla = config.mla.expect("an MLA config");
        let (h, heads) = (config.hidden_size, config.num_attention_heads);
        let (r, nope, v) = (mla.kv_lora_rank, mla.qk_nope_head_dim, mla.v_head_dim);
        let q_out = heads * mla.qk_head_dim();
        let matrix =
            |name: &str, shape: &[usize]| ckpt.weight(&format!("{prefix}.{name}.weight"), shape);
        let vector = |name: &str, len: usize| ckpt.weight(&format!("{prefix}.{name}"), &[len]);
        let bias = |name: &str, len: usize| {
            mla.bias
                .then(|| vector(&format!("{name}.bias"), len))
                .transpose()
        };
        let query = match mla.q_lora_rank {
            None => QueryProjection::Direct(matrix("q_proj", &[q_out, h])?),
            Some(rank) => QueryProjection::LowRank {
                a: matrix("q_a_proj", &[rank, h])?,
                a_bias: bias("q_a_proj", rank)?,
                norm: vector("q_a_layernorm.weight", rank)?,
                b: matrix("q_b_proj", &[q_out, rank])?,
            },
        };
        let kv_b = matrix("kv_b_proj", &[heads * (nope + v), r])?;
        let (absorb_key, expand_value) = split_kv_b(&kv_b, heads, nope, v)?;
        Ok(MlaAttention {
            query,
            kv_a_proj: matrix("kv_a_proj_with_mqa", &[mla.latent_dim(), h])?,
            kv_a_bias: bias("kv_a_proj_with_mqa", mla.latent_dim())?,
            kv_a_norm: vector("kv_a_layernorm.weight", r)?,
            absorb_key,
            expand_value,
            o_proj: matrix("o_proj", &[h, heads * v])?,
            o_bias: bias("o_proj", h)?,
            mla,
            num_heads: heads,
            rope: config.rope_frequencies(),
        })
    }

    /// Every matrix a token goes through (the per-head pieces of `kv_b_proj` included).
    pub fn weights(&self) -> Vec<&Weight> {
        let mut all = match &self.query {
            QueryProjection::Direct(q) => vec![q],
            QueryProjection::LowRank { a, b, .. } => vec![a, b],
        };
        all.push(&self.kv_a_proj);
        all.extend(&self.absorb_key);
        all.extend(&self.expand_value);
        all.push(&self.o_proj);
        all
    }

    /// Matrices that stay as stored under `--quantization`: the per-head pieces of kv_b_proj.
    pub fn exact_matrices(&self) -> usize {
        self.absorb_key.len() + self.expand_value.len()
    }

    /// The vectors beside the matrices: norm weights and biases.
    pub fn vectors(&self) -> Vec<&Weight> {
        let mut all = vec![&self.kv_a_norm];
        if let QueryProjection::LowRank { a_bias, norm, .. } = &self.query {
            all.push(norm);
            all.extend(a_bias);
        }
        all.extend(&self.kv_a_bias);
        all.extend(&self.o_bias);
        all
    }

    /// The weight of `role`, if this layer has it.
    pub(crate) fn weight(&self, role: LayerWeight) -> Option<&Weight> {
        let low_rank = match &self.query {
            QueryProjection::LowRank { a, a_bias, norm, b } => Some((a, a_bias.as_ref(), norm, b)),
            QueryProjection::Direct(_) => None,
        };
        match role {
            LayerWeight::QProj => match &self.query {
                QueryProjection::Direct(q) => Some(q),
                QueryProjection::LowRank { .. } => None,
            },
            LayerWeight::QAProj => low_rank.map(|l| l.0),
            LayerWeight::QABias => low_rank.and_then(|l| l.1),
            LayerWeight::QANorm => low_rank.map(|l| l.2),
            LayerWeight::QBProj => low_rank.map(|l| l.3),
            LayerWeight::KvAProj => Some(&self.kv_a_proj),
            LayerWeight::KvABias => self.kv_a_bias.as_ref(),
            LayerWeight::KvANorm => Some(&self.kv_a_norm),
            LayerWeight::OProj => Some(&self.o_proj),
            LayerWeight::OBias => self.o_bias.as_ref(),
            _ => None,
        }
    }

    /// Per head, `W_uk[h]ᵀ: [kv_lora_rank, qk_nope_head_dim]` (absorbed into the query); the
    /// CUDA model uploads them stacked.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn absorb_key(&self) -> &[Weight] {
        &self.absorb_key
    }

    /// Per head, `W_uv[h]: [v_head_dim, kv_lora_rank]` (expands the latent output).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn expand_value(&self) -> &[Weight] {
        &self.expand_value
    }

    /// `kv_a_layernorm` over the latent part of every row of `latent: [num_tokens, latent_dim]`
    /// (the rotary key after it is not normed).
    pub(crate) fn norm_latent(&self, latent: &mut [f32]) {
        let r = self.mla.kv_lora_rank;
        for row in latent.chunks_exact_mut(self.mla.latent_dim()) {
            cpu::rms_norm_in_place(&mut row[..r], &self.kv_a_norm, MlaConfig::LATENT_NORM_EPS);
        }
    }

    /// Rotary embeddings on every token's query rotary slices (`q: [num_tokens, heads,
    /// qk_head_dim]`, after `qk_nope_head_dim`) and on its shared rotary key (`latent: [num_tokens,
    /// latent_dim]`, after `kv_lora_rank`), at its position.
    pub(crate) fn rope(
        &self,
        places: &[TokenPlace],
        q: &mut [f32],
        latent: &mut [f32],
        angles: &mut cpu::RopeAngles,
    ) {
        let m = &self.mla;
        let (qk, rope) = (m.qk_head_dim(), m.qk_rope_head_dim);
        let turn = match m.rope_interleave {
            true => cpu::apply_rope_interleaved,
            false => cpu::apply_rope,
        };
        for ((place, q), row) in places
            .iter()
            .zip(q.chunks_exact_mut(self.num_heads * qk))
            .zip(latent.chunks_exact_mut(m.latent_dim()))
        {
            angles.set_scaled(
                place.position,
                &self.rope.inv_freq,
                self.rope.attention_scaling,
            );
            for head in q.chunks_exact_mut(qk) {
                turn(&mut head[m.qk_nope_head_dim..], rope, angles);
            }
            turn(&mut row[m.kv_lora_rank..], rope, angles);
        }
    }

    /// `out: [num_tokens, heads, latent_dim]` ← each head's query in the latent space:
    /// `[W_uk[h]ᵀ · q_nope[h] | q_rope[h]]` of `q: [num_tokens, heads, qk_head_dim]`.
    pub(crate) fn absorb_query(&self, q: &[f32], scratch: &mut MlaScratch, out: &mut Vec<f32>) {
        let m = &self.mla;
        let (qk, nope, r, latent) = (
            m.qk_head_dim(),
            m.qk_nope_head_dim,
            m.kv_lora_rank,
            m.latent_dim(),
        );
        let t = q.len() / (self.num_heads * qk);
        out.resize(t * self.num_heads * latent, 0.0);
        for (h, w) in self.absorb_key.iter().enumerate() {
            scratch.rows.clear();
            for token in q.chunks_exact(self.num_heads * qk) {
                scratch.rows.extend_from_slice(&token[h * qk..][..nope]);
            }
            scratch.product.resize(t * r, 0.0);
            cpu::matmul_wt_in(
                &scratch.rows,
                t,
                w,
                &mut scratch.product,
                &mut scratch.tiled,
            );
            for (i, (token, product)) in q
                .chunks_exact(self.num_heads * qk)
                .zip(scratch.product.chunks_exact(r))
                .enumerate()
            {
                let row = &mut out[(i * self.num_heads + h) * latent..][..latent];
                row[..r].copy_from_slice(product);
                row[r..].copy_from_slice(&token[h * qk + nope..][..m.qk_rope_head_dim]);
            }
        }
    }

    /// Every step token's latent row into `kv` at `layer`, at its slot.
    pub(crate) fn write_latent(
        &self,
        step: &AttentionStep<'_>,
        kv: &mut PagedKvCache,
        latent: &[f32],
    ) {
        let block_size = kv.layout().block_size;
        for (place, row) in step
            .places
            .iter()
            .zip(latent.chunks_exact(self.mla.latent_dim()))
        {
            let table = step.batch.sequences[place.sequence].block_table;
            kv.write(
                step.layer,
                slot_of(table, block_size, place.position),
                row,
                &[],
            );
        }
    }

    /// `out: [num_tokens, heads, kv_lora_rank]` ← causal attention of every step token's
    /// latent queries (`q: [num_tokens, heads, latent_dim]`) over the latent rows its sequence
    /// has in `kv` (this step's included, written first).
    pub(crate) fn attend_all(
        &self,
        step: &AttentionStep<'_>,
        kv: &PagedKvCache,
        q: &[f32],
        out: &mut [f32],
    ) {
        let (latent, r) = (self.mla.latent_dim(), self.mla.kv_lora_rank);
        let per_task = heads_per_task(self.num_heads);
        let tasks_per_token = self.num_heads / per_task;
        // Every head's key is the whole latent row and its value the row's leading part.
        let head = CachedHead {
            stride: latent,
            offset: 0,
            head_dim: latent,
            value_dim: r,
            scale: self.mla.softmax_scale,
        };
        let rows = kv.layer_rows(step.layer).keys_as_values();
        let block_size = kv.layout().block_size;
        out.par_chunks_mut(per_task * r)
            .enumerate()
            .for_each(|(i, out)| {
                let (token, h0) = (i / tasks_per_token, i % tasks_per_token * per_task);
                let place = step.places[token];
                let table = step.batch.sequences[place.sequence].block_table;
                let q = &q[(token * self.num_heads + h0) * latent..][..per_task * latent];
                with_attend_scratch(|(slots, scores)| {
                    slots.clear();
                    slots.extend((0..=place.position).map(|p| slot_of(table, block_size, p)));
                    head.attend(rows, q, slots, None, scores, out);
                });
            });
    }

    /// `out: [num_tokens, heads · v_head_dim]` ← `W_uv[h] · latent_out[h]` of every head of
    /// `latent_out: [num_tokens, heads, kv_lora_rank]`.
    pub(crate) fn expand_values(
        &self,
        latent_out: &[f32],
        scratch: &mut MlaScratch,
        out: &mut Vec<f32>,
    ) {
        let (r, v, heads) = (self.mla.kv_lora_rank, self.mla.v_head_dim, self.num_heads);
        let t = latent_out.len() / (heads * r);
        out.resize(t * heads * v, 0.0);
        for (h, w) in self.expand_value.iter().enumerate() {
            scratch.rows.clear();
            for token in latent_out.chunks_exact(heads * r) {
                scratch.rows.extend_from_slice(&token[h * r..][..r]);
            }
            scratch.product.resize(t * v, 0.0);
            cpu::matmul_wt_in(
                &scratch.rows,
                t,
                w,
                &mut scratch.product,
                &mut scratch.tiled,
            );
            for (token, product) in out
                .chunks_exact_mut(heads * v)
                .zip(scratch.product.chunks_exact(v))
            {
                token[h * v..][..v].copy_from_slice(product);
            }
        }
    }
}

/// The per-head gathers and products of [`MlaAttention`], reused across steps.
#[derive(Default)]
pub struct MlaScratch {
    rows: Vec<f32>,
    product: Vec<f32>,
    tiled: Vec<f32>,
}

/// `kv_b_proj: [heads · (nope + v), r]` → per head `W_uk[h]ᵀ: [r, nope]` and `W_uv[h]: [v, r]`,
/// in its stored dtype (an FP8 or int4 one dequantised to f32: its blocks and groups do not
/// survive the cut, and the matrix is a small one).
fn split_kv_b(
    kv_b: &Weight,
    heads: usize,
    nope: usize,
    v: usize,
) -> Result<(Vec<Weight>, Vec<Weight>)> {
    if matches!(kv_b.dtype(), DType::F8E4M3 | DType::Int4) {
        let widened = Weight::from_f32(kv_b.shape().to_vec(), &kv_b.to_f32_vec())?;
        return split_kv_b(&widened, heads, nope, v);
    }
    let r = kv_b.shape()[1];
    let size = kv_b.dtype().size_in_bytes();
    let bytes = kv_b.as_bytes();
    let element = |row: usize, col: usize| &bytes[(row * r + col) * size..][..size];
    let mut absorb = Vec::with_capacity(heads);
    let mut expand = Vec::with_capacity(heads);
    for h in 0..heads {
        let first = h * (nope + v);
        let mut transposed = Vec::with_capacity(r * nope * size);
        for col in 0..r {
            for row in first..first + nope {
                transposed.extend_from_slice(element(row, col));
            }
        }
        // Kept as stored under `--quantization`: cut from kv_b_proj, they have no int8 form of
        // their own in a `moeserve quantize` checkpoint, and they are a small share.
        let absorb_h = Weight::new(kv_b.dtype(), vec![r, nope], WeightBytes::owned(&transposed))?;
        absorb.push(absorb_h.exact());
        let values = &bytes[(first + nope) * r * size..(first + nope + v) * r * size];
        let expand_h = Weight::new(kv_b.dtype(), vec![v, r], WeightBytes::owned(values))?;
        expand.push(expand_h.exact());
    }
    Ok((absorb, expand))
}
