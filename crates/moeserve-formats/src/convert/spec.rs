//! The shape of a checkpoint as written by the converter and the presets: its `config.json` and
//! the list of hub tensor names with their shapes, for the families they write (Mixtral, and
//! Qwen3-MoE for the benchmark presets).
//!
//! Follows transformers' config field names and state-dict names
//! (`model.layers.N.block_sparse_moe.experts.E.w1.weight` for Mixtral,
//! `model.layers.N.mlp.experts.E.gate_proj.weight` and `self_attn.q_norm.weight` for Qwen3-MoE).
//! Shapes are PyTorch's `nn.Linear` layout, `[out_features, in_features]`.

use moeserve_core::DType;
use serde_json::{Value, json};

/// The families a spec can write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecFamily {
    Mixtral,
    /// Every layer sparse, `norm_topk_prob: true` (as Qwen3-30B-A3B).
    Qwen3Moe,
}

/// Everything needed to name, shape and describe a checkpoint.
#[derive(Clone, Debug, PartialEq)]
pub struct CheckpointSpec {
    pub family: SpecFamily,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
    pub dtype: DType,
}

/// One tensor of a checkpoint, by role.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecTensor {
    EmbedTokens,
    FinalNorm,
    LmHead,
    InputNorm {
        layer: usize,
    },
    PostAttentionNorm {
        layer: usize,
    },
    QProj {
        layer: usize,
    },
    KProj {
        layer: usize,
    },
    VProj {
        layer: usize,
    },
    OProj {
        layer: usize,
    },
    /// Qwen3-MoE's per-head RMSNorm of the queries, `[head_dim]`.
    QNorm {
        layer: usize,
    },
    /// Qwen3-MoE's per-head RMSNorm of the keys, `[head_dim]`.
    KNorm {
        layer: usize,
    },
    /// `block_sparse_moe.gate`: the router, `[num_experts, hidden]`.
    Router {
        layer: usize,
    },
    /// SwiGLU gate projection `w1`, `[intermediate, hidden]`.
    W1 {
        layer: usize,
        expert: usize,
    },
    /// Down projection `w2`, `[hidden, intermediate]`.
    W2 {
        layer: usize,
        expert: usize,
    },
    /// Up projection `w3`, `[intermediate, hidden]`.
    W3 {
        layer: usize,
        expert: usize,
    },
}

impl CheckpointSpec {
    /// The hub (state-dict) name of `tensor`.
    pub fn name(&self, tensor: SpecTensor) -> String {
        use SpecTensor::*;
        let layer = |l: usize, rest: &str| format!("model.layers.{l}.{rest}");
        let (block, [w1, w3, w2]) = match self.family {
            SpecFamily::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            SpecFamily::Qwen3Moe => ("mlp", ["gate_proj", "up_proj", "down_proj"]),
        };
        let expert =
            |l: usize, e: usize, w: &str| layer(l, &format!("{block}.experts.{e}.{w}.weight"));
        match tensor {
            EmbedTokens => "model.embed_tokens.weight".to_string(),
            FinalNorm => "model.norm.weight".to_string(),
            LmHead => "lm_head.weight".to_string(),
            InputNorm { layer: l } => layer(l, "input_layernorm.weight"),
            PostAttentionNorm { layer: l } => layer(l, "post_attention_layernorm.weight"),
            QProj { layer: l } => layer(l, "self_attn.q_proj.weight"),
            KProj { layer: l } => layer(l, "self_attn.k_proj.weight"),
            VProj { layer: l } => layer(l, "self_attn.v_proj.weight"),
            OProj { layer: l } => layer(l, "self_attn.o_proj.weight"),
            QNorm { layer: l } => layer(l, "self_attn.q_norm.weight"),
            KNorm { layer: l } => layer(l, "self_attn.k_norm.weight"),
            Router { layer: l } => layer(l, &format!("{block}.gate.weight")),
            W1 {
                layer: l,
                expert: e,
            } => expert(l, e, w1),
            W2 {
                layer: l,
                expert: e,
            } => expert(l, e, w2),
            W3 {
                layer: l,
                expert: e,
            } => expert(l, e, w3),
        }
    }

    /// Row-major shape of a tensor (`[out, in]` for projections).
    pub fn shape(&self, tensor: SpecTensor) -> Vec<usize> {
        use SpecTensor::*;
        let (h, i) = (self.hidden_size, self.intermediate_size);
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        match tensor {
            EmbedTokens | LmHead => vec![self.vocab_size, h],
            FinalNorm | InputNorm { .. } | PostAttentionNorm { .. } => vec![h],
            QNorm { .. } | KNorm { .. } => vec![self.head_dim],
            QProj { .. } => vec![q, h],
            KProj { .. } | VProj { .. } => vec![kv, h],
            OProj { .. } => vec![h, q],
            Router { .. } => vec![self.num_local_experts, h],
            W1 { .. } | W3 { .. } => vec![i, h],
            W2 { .. } => vec![h, i],
        }
    }

    /// Every tensor of the checkpoint, embeddings first, then layer by layer, then the final
    /// norm and (unless tied) the LM head.
    pub fn tensors(&self) -> Vec<SpecTensor> {
        use SpecTensor::*;
        let mut out = vec![EmbedTokens];
        for layer in 0..self.num_hidden_layers {
            out.extend([
                InputNorm { layer },
                QProj { layer },
                KProj { layer },
                VProj { layer },
                OProj { layer },
            ]);
            if self.family == SpecFamily::Qwen3Moe {
                out.extend([QNorm { layer }, KNorm { layer }]);
            }
            out.extend([PostAttentionNorm { layer }, Router { layer }]);
            for expert in 0..self.num_local_experts {
                out.extend([
                    W1 { layer, expert },
                    W2 { layer, expert },
                    W3 { layer, expert },
                ]);
            }
        }
        out.push(FinalNorm);
        if !self.tie_word_embeddings {
            out.push(LmHead);
        }
        out
    }

    pub fn num_parameters(&self) -> u64 {
        self.tensors()
            .into_iter()
            .map(|t| self.shape(t).iter().product::<usize>() as u64)
            .sum()
    }

    /// `config.json` for the family's `…ForCausalLM`, with every field transformers writes.
    pub fn config_json(&self) -> Value {
        let dtype = self.dtype.to_string();
        let mut config = json!({
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "initializer_range": 0.02,
            "rms_norm_eps": shortest_f64(self.rms_norm_eps),
            "rope_theta": self.rope_theta,
            "sliding_window": null,
            "attention_dropout": 0.0,
            "num_experts_per_tok": self.num_experts_per_tok,
            "output_router_logits": false,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_cache": true,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            // transformers < 5 reads `torch_dtype`, transformers ≥ 5 writes `dtype`.
            "torch_dtype": dtype,
            "dtype": dtype,
        });
        let family = match self.family {
            SpecFamily::Mixtral => json!({
                "architectures": ["MixtralForCausalLM"],
                "model_type": "mixtral",
                "num_local_experts": self.num_local_experts,
                "router_aux_loss_coef": 0.02,
                "router_jitter_noise": 0.0,
            }),
            SpecFamily::Qwen3Moe => json!({
                "architectures": ["Qwen3MoeForCausalLM"],
                "model_type": "qwen3_moe",
                // Every layer sparse: the routed experts are the spec's `intermediate_size`.
                "moe_intermediate_size": self.intermediate_size,
                "num_experts": self.num_local_experts,
                "norm_topk_prob": true,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [],
                "attention_bias": false,
                "use_sliding_window": false,
                "router_aux_loss_coef": 0.001,
            }),
        };
        let (Value::Object(config_map), Value::Object(family)) = (&mut config, family) else {
            unreachable!("both are JSON objects");
        };
        config_map.extend(family);
        config
    }

    /// `generation_config.json`: the token ids generation starts and stops with.
    pub fn generation_config_json(&self) -> Value {
        json!({ "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id })
    }
}

/// The f64 with the shortest decimal that reads back as `value` (GGUF stores `1e-5` as the
/// f32 `9.99999974e-6`; the config should say `1e-5` as the original did).
fn shortest_f64(value: f32) -> f64 {
    value.to_string().parse().unwrap_or(f64::from(value))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(tie: bool) -> CheckpointSpec {
        CheckpointSpec {
            family: SpecFamily::Mixtral,
            vocab_size: 10,
            hidden_size: 8,
            intermediate_size: 12,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 2,
            num_local_experts: 3,
            num_experts_per_tok: 2,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            max_position_embeddings: 64,
            tie_word_embeddings: tie,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            pad_token_id: None,
            dtype: DType::BF16,
        }
    }

    #[test]
    fn tensor_list_has_hub_names_and_linear_shapes() {
        let spec = spec(false);
        let tensors = spec.tensors();
        assert_eq!(tensors.len(), 1 + 2 * (7 + 3 * 3) + 2);
        let w2 = SpecTensor::W2 {
            layer: 1,
            expert: 2,
        };
        assert_eq!(
            spec.name(w2),
            "model.layers.1.block_sparse_moe.experts.2.w2.weight"
        );
        assert_eq!(spec.shape(w2), vec![8, 12]);
        assert_eq!(spec.shape(SpecTensor::KProj { layer: 0 }), vec![4, 8]);
        assert_eq!(spec.shape(SpecTensor::Router { layer: 0 }), vec![3, 8]);
        assert_eq!(tensors.last(), Some(&SpecTensor::LmHead));
        assert!(
            !super::CheckpointSpec::tensors(&self::tests::spec(true)).contains(&SpecTensor::LmHead)
        );
        let qwen3 = CheckpointSpec {
            family: SpecFamily::Qwen3Moe,
            ..spec
        };
        assert_eq!(
            qwen3.name(w2),
            "model.layers.1.mlp.experts.2.down_proj.weight"
        );
        assert_eq!(qwen3.tensors().len(), tensors.len() + 2 * 2);
        assert_eq!(qwen3.shape(SpecTensor::QNorm { layer: 1 }), vec![2]);
        assert_eq!(qwen3.config_json()["model_type"], "qwen3_moe");
    }

    #[test]
    fn config_uses_transformers_field_names() {
        let config = spec(true).config_json();
        assert_eq!(config["architectures"][0], "MixtralForCausalLM");
        assert_eq!(config["num_local_experts"], 3);
        assert_eq!(config["rms_norm_eps"], 1e-5);
        assert_eq!(config["torch_dtype"], "bfloat16");
        assert_eq!(config["tie_word_embeddings"], true);
        assert!(config["sliding_window"].is_null());
    }

    #[test]
    fn gguf_epsilon_is_written_as_its_shortest_decimal() {
        // The f32 nearest 1e-5 is 9.99999974e-6, which is what f64::from would keep.
        assert_ne!(f64::from(1e-5f32), 1e-5);
        assert_eq!(shortest_f64(1e-5), 1e-5);
        assert_eq!(shortest_f64(1e-6), 1e-6);
    }
}
