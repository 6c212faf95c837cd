//! The decoder's operations on the CPU backend ([`CpuStep`]): host buffers of a
//! [`ForwardWorkspace`], the `moeserve_backend::cpu` kernels, the layers' weights as loaded.
//! No family logic lives here: `ops::decode` says what runs.

use moeserve_backend::{Weight, cpu};

use crate::batch::ForwardBatch;
use crate::config::MlaConfig;
use crate::kv_cache::PagedKvCache;
use crate::layers::attention::{Attention, AttentionStep};
use crate::layers::mla::MlaAttention;
use crate::models::decoder::{FeedForward, ForwardTrace, LogitsFor, MoeModel};
use crate::models::ops::{Act, DecoderOps, LayerWeight, Point, read_write, read_write_mut};
use crate::models::workspace::{ForwardWorkspace, zeroed};
use crate::moe::{MoeLayerStep, MoeOptions};
use crate::quantize::Hessians;

/// One CPU step: the model, the batch (its token places already in `ws.places`), the KV cache
/// and the workspace whose buffers every operation uses.
pub(crate) struct CpuStep<'s, 'b> {
    pub model: &'s MoeModel,
    pub batch: &'s ForwardBatch<'b>,
    pub kv: &'s mut PagedKvCache,
    pub ws: &'s mut ForwardWorkspace,
    pub logits_for: LogitsFor,
    pub trace: Option<&'s mut ForwardTrace>,
    pub moe: MoeOptions<'s>,
    pub calibration: Option<&'s mut Hessians>,
}

/// Layer `layer`'s weight of `role`.
fn weight(model: &MoeModel, layer: usize, role: LayerWeight) -> &Weight {
    let l = &model.layers[layer];
    let found = match role {
        LayerWeight::InputNorm => Some(&l.input_layernorm),
        LayerWeight::PostNorm => Some(&l.post_attention_layernorm),
        other => l.self_attn.weight(other),
    };
    found.unwrap_or_else(|| panic!("layer {layer} has no {role:?} (the config says it has)"))
}

/// Layer `layer`'s grouped-query attention.
fn grouped(model: &MoeModel, layer: usize) -> &Attention {
    model.layers[layer].self_attn.grouped().unwrap_or_else(|| {
        panic!("layer {layer} has no grouped-query attention (the config says it has)")
    })
}

/// Layer `layer`'s latent attention.
fn latent(model: &MoeModel, layer: usize) -> &MlaAttention {
    model.layers[layer]
        .self_attn
        .latent()
        .unwrap_or_else(|| panic!("layer {layer} has no latent attention (the config says it has)"))
}

impl CpuStep<'_, '_> {
    fn num_tokens(&self) -> usize {
        self.batch.num_tokens()
    }

    fn eps(&self) -> f32 {
        self.model.config().rms_norm_eps
    }
}

impl DecoderOps for CpuStep<'_, '_> {
    type Error = std::convert::Infallible;

    fn embed(&mut self) -> Result<(), Self::Error> {
        let h = self.model.config().hidden_size;
        let hidden = &mut self.ws.hidden;
        zeroed(hidden, self.batch.num_tokens() * h);
        for (row, id) in hidden.chunks_exact_mut(h).zip(self.batch.token_ids) {
            cpu::convert::widen_row(self.model.embed_tokens.data(), *id as usize, row);
        }
        let len = hidden.len();
        zeroed(&mut self.ws.acts[Act::Normed.index()], len);
        zeroed(&mut self.ws.acts[Act::Delta.index()], len);
        Ok(())
    }

    fn add_rms_norm(&mut self, layer: usize, w: LayerWeight, add: bool) -> Result<(), Self::Error> {
        let (eps, w) = (self.eps(), weight(self.model, layer, w));
        let ws = &mut *self.ws;
        let (delta, normed) = read_write(&mut ws.acts, Act::Delta, Act::Normed);
        match add {
            true => cpu::add_rms_norm(&mut ws.hidden, delta, w, eps, normed),
            false => cpu::rms_norm(&ws.hidden, w, eps, normed),
        }
        Ok(())
    }

    fn linear(
        &mut self,
        layer: usize,
        x: Act,
        w: LayerWeight,
        bias: Option<LayerWeight>,
        y: Act,
    ) -> Result<(), Self::Error> {
        let t = self.num_tokens();
        let w = weight(self.model, layer, w);
        let bias = bias.map(|b| weight(self.model, layer, b));
        let ws = &mut *self.ws;
        let (x, y) = read_write(&mut ws.acts, x, y);
        // Sized, not cleared: the product overwrites every element.
        y.resize(t * w.shape()[0], 0.0);
        cpu::matmul_wt_in(x, t, w, y, &mut ws.tiled);
        if let Some(b) = bias {
            cpu::add_bias(y, b);
        }
        Ok(())
    }

    fn linears<const N: usize>(
        &mut self,
        layer: usize,
        x: Act,
        products: [(LayerWeight, Option<LayerWeight>, Act); N],
    ) -> Result<(), Self::Error> {
        let t = self.num_tokens();
        let model = self.model;
        let ws = &mut *self.ws;
        assert!(
            products.iter().all(|(_, _, y)| *y != x),
            "an operation reads and writes the same activation ({x:?})"
        );
        // The input out of the array while the outputs are borrowed from it (a move, no copy).
        let input = std::mem::take(&mut ws.acts[x.index()]);
        {
            let outs = match ws
                .acts
                .get_disjoint_mut(products.map(|(_, _, y)| y.index()))
            {
                Ok(outs) => outs,
                Err(_) => panic!("linears: an activation written twice"),
            };
            let mut weights = products
                .map(|(w, _, _)| weight(model, layer, w))
                .into_iter();
            let products = outs.map(|y| {
                let w = weights.next().expect("one weight per output");
                // Sized, not cleared: the product overwrites every element.
                y.resize(t * w.shape()[0], 0.0);
                (w, y.as_mut_slice())
            });
            cpu::matmul_wt_many(&input, t, products, &mut ws.tiled);
        }
        ws.acts[x.index()] = input;
        for (_, bias, y) in products {
            if let Some(b) = bias {
                cpu::add_bias(&mut ws.acts[y.index()], weight(model, layer, b));
            }
        }
        Ok(())
    }

    fn rms_norm_rows(&mut self, layer: usize, x: Act, w: LayerWeight) -> Result<(), Self::Error> {
        let (eps, w) = (self.eps(), weight(self.model, layer, w));
        cpu::rms_norm_in_place(&mut self.ws.acts[x.index()], w, eps);
        Ok(())
    }

    fn clamp(&mut self, x: Act, limit: f32) -> Result<(), Self::Error> {
        self.ws.acts[x.index()]
            .iter_mut()
            .for_each(|x| *x = x.clamp(-limit, limit));
        Ok(())
    }

    fn rope(&mut self, layer: usize) -> Result<(), Self::Error> {
        let ws = &mut *self.ws;
        let [_, q, k, ..] = &mut ws.acts;
        grouped(self.model, layer).rope(&ws.places, q, k, &mut ws.angles);
        Ok(())
    }

    fn write_kv(&mut self, layer: usize) -> Result<(), Self::Error> {
        let ws = &*self.ws;
        let step = AttentionStep::new(layer, self.batch, &ws.places);
        let (k, v) = (&ws.acts[Act::K.index()], &ws.acts[Act::V.index()]);
        grouped(self.model, layer).write_kv(&step, self.kv, k, v);
        Ok(())
    }

    fn paged_attention(&mut self, layer: usize) -> Result<(), Self::Error> {
        let c = self.model.config();
        let t = self.num_tokens();
        let ws = &mut *self.ws;
        let step = AttentionStep::new(layer, self.batch, &ws.places);
        let (q, out) = read_write(&mut ws.acts, Act::Q, Act::Attn);
        zeroed(out, t * c.q_dim());
        grouped(self.model, layer).attend_all(&step, self.kv, q, out);
        Ok(())
    }

    fn mla_norm_query(&mut self, layer: usize) -> Result<(), Self::Error> {
        let w = weight(self.model, layer, LayerWeight::QANorm);
        let x = &mut self.ws.acts[Act::QLowRank.index()];
        cpu::rms_norm_in_place(x, w, MlaConfig::LATENT_NORM_EPS);
        Ok(())
    }

    fn mla_norm_latent(&mut self, layer: usize) -> Result<(), Self::Error> {
        latent(self.model, layer).norm_latent(&mut self.ws.acts[Act::Latent.index()]);
        Ok(())
    }

    fn mla_rope(&mut self, layer: usize) -> Result<(), Self::Error> {
        let ws = &mut *self.ws;
        let (q, rows) = read_write_mut(&mut ws.acts, Act::Q, Act::Latent);
        latent(self.model, layer).rope(&ws.places, q, rows, &mut ws.angles);
        Ok(())
    }

    fn mla_absorb_query(&mut self, layer: usize) -> Result<(), Self::Error> {
        let ws = &mut *self.ws;
        let (q, out) = read_write(&mut ws.acts, Act::Q, Act::LatentQ);
        latent(self.model, layer).absorb_query(q, &mut ws.mla, out);
        Ok(())
    }

    fn mla_write_latent(&mut self, layer: usize) -> Result<(), Self::Error> {
        let ws = &*self.ws;
        let step = AttentionStep::new(layer, self.batch, &ws.places);
        let rows = &ws.acts[Act::Latent.index()];
        latent(self.model, layer).write_latent(&step, self.kv, rows);
        Ok(())
    }

    fn mla_attention(&mut self, layer: usize) -> Result<(), Self::Error> {
        let c = self.model.config();
        let mla = c.mla.as_ref().expect("an MLA config");
        let t = self.num_tokens();
        let ws = &mut *self.ws;
        let step = AttentionStep::new(layer, self.batch, &ws.places);
        let (q, out) = read_write(&mut ws.acts, Act::LatentQ, Act::LatentAttn);
        // Sized, not cleared: every head's output is written.
        out.resize(t * c.num_attention_heads * mla.kv_lora_rank, 0.0);
        latent(self.model, layer).attend_all(&step, self.kv, q, out);
        Ok(())
    }

    fn mla_expand_values(&mut self, layer: usize) -> Result<(), Self::Error> {
        let ws = &mut *self.ws;
        let (x, out) = read_write(&mut ws.acts, Act::LatentAttn, Act::Attn);
        latent(self.model, layer).expand_values(x, &mut ws.mla, out);
        Ok(())
    }

    fn sparse_moe(&mut self, layer: usize, moe_layer: usize) -> Result<(), Self::Error> {
        let t = self.num_tokens();
        let block = self.model.layers[layer]
            .moe()
            .unwrap_or_else(|| panic!("layer {layer} has no MoE block (the config says it has)"));
        let ws = &mut *self.ws;
        let (normed, delta) = read_write(&mut ws.acts, Act::Normed, Act::Delta);
        block.router_logits_into(normed, t, &mut ws.router_logits, &mut ws.tiled);
        if let Some(hs) = self.calibration.as_deref_mut() {
            hs.moe_input(layer, block, normed, &ws.router_logits);
        }
        let step = MoeLayerStep {
            layer: moe_layer,
            x: normed,
            router_logits: &ws.router_logits,
            capacity: self.moe.capacity,
            experts: self.moe.experts,
        };
        let summary = self.moe.record.as_deref_mut().map(|r| r.push_layer());
        block.forward_in(&step, &mut ws.moe, delta, summary);
        if let Some(trace) = self.trace.as_deref_mut() {
            trace.router_logits.push(ws.router_logits.clone());
        }
        Ok(())
    }

    fn dense_mlp(&mut self, layer: usize) -> Result<(), Self::Error> {
        let t = self.num_tokens();
        let FeedForward::Dense(mlp) = &self.model.layers[layer].mlp else {
            panic!("layer {layer} has no dense MLP (the config says it has)");
        };
        let ws = &mut *self.ws;
        let (normed, delta) = read_write(&mut ws.acts, Act::Normed, Act::Delta);
        if let Some(hs) = self.calibration.as_deref_mut() {
            hs.dense_input(layer, mlp, normed);
        }
        mlp.forward_in(normed, t, delta, &mut ws.moe.grouped);
        Ok(())
    }

    fn add_last_delta(&mut self) -> Result<(), Self::Error> {
        let ws = &mut *self.ws;
        cpu::add_assign(&mut ws.hidden, &ws.acts[Act::Delta.index()]);
        Ok(())
    }

    fn logits(&mut self) -> Result<(), Self::Error> {
        let c = self.model.config();
        let (t, h, eps) = (self.num_tokens(), c.hidden_size, c.rms_norm_eps);
        let model = self.model;
        let ws = &mut *self.ws;
        if let Some(hs) = self
            .calibration
            .as_deref_mut()
            .filter(|hs| hs.records_lm_head())
        {
            // lm_head's input at every position, not only the rows that get logits.
            let mut all_normed = vec![0.0; ws.hidden.len()];
            cpu::rms_norm(&ws.hidden, &model.norm, eps, &mut all_normed);
            hs.lm_head_input(&all_normed);
        }
        ws.logit_rows.clear();
        match self.logits_for {
            LogitsFor::AllTokens => ws.logit_rows.extend(0..t),
            LogitsFor::LastTokens => ws.logit_rows.extend(
                self.batch
                    .sequences
                    .iter()
                    .map(|s| s.query_start + s.query_len - 1),
            ),
        }
        ws.selected.clear();
        for r in &ws.logit_rows {
            ws.selected
                .extend_from_slice(&ws.hidden[r * h..(r + 1) * h]);
        }
        zeroed(&mut ws.final_normed, ws.selected.len());
        cpu::rms_norm(&ws.selected, &model.norm, eps, &mut ws.final_normed);
        let rows = ws.logit_rows.len();
        zeroed(&mut ws.logits, rows * c.vocab_size);
        cpu::matmul_wt_in(
            &ws.final_normed,
            rows,
            &model.lm_head,
            &mut ws.logits,
            &mut ws.tiled,
        );
        Ok(())
    }

    fn observe(&mut self, at: Point) -> Result<(), Self::Error> {
        let t = self.num_tokens();
        let ws = &*self.ws;
        match at {
            Point::LayerOutput => {
                if let Some(trace) = self.trace.as_deref_mut() {
                    trace.layer_outputs.push(ws.hidden.clone());
                }
            }
            Point::AttentionInput(layer) => {
                if let Some(hs) = self.calibration.as_deref_mut() {
                    hs.attention_input(layer, &ws.acts[Act::Normed.index()]);
                }
            }
            Point::AttentionOutput(layer) => {
                if let Some(hs) = self.calibration.as_deref_mut() {
                    hs.attention_output(layer, &ws.acts[Act::Attn.index()], t);
                }
            }
            Point::QueryLowRank(layer) => {
                if let Some(hs) = self.calibration.as_deref_mut() {
                    hs.query_low_rank_input(layer, &ws.acts[Act::QLowRank.index()], t);
                }
            }
        }
        Ok(())
    }
}
