//! The shape of a checkpoint as written by the converter and the presets: its `config.json` and
//! the list of hub tensor names with their shapes, for the families they write (Mixtral, and
//! Qwen3-MoE, DeepSeek-V2/V3 and GPT-OSS for the benchmark presets).
//!
//! Follows transformers' config field names and state-dict names
//! (`model.layers.N.block_sparse_moe.experts.E.w1.weight` for Mixtral,
//! `model.layers.N.mlp.experts.E.gate_proj.weight` and `self_attn.q_norm.weight` for Qwen3-MoE).
//! Shapes are PyTorch's `nn.Linear` layout, `[out_features, in_features]`.

use moeserve_core::DType;
use serde_json::{Value, json};

/// The families a spec can write.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum SpecFamily {
    Mixtral,
    /// Every layer sparse, `norm_topk_prob: true` (as Qwen3-30B-A3B).
    Qwen3Moe,
    /// `DeepseekV2ForCausalLM` or `DeepseekV3ForCausalLM`: multi-head latent attention, dense
    /// first layers, shared experts (the spec's `intermediate_size` is a routed expert's).
    Deepseek(DeepseekSpec),
    /// `GptOssForCausalLM`: biases on q/k/v/o, sinks, alternating sliding and full layers,
    /// `mlp.router` with a bias, fused biased experts (MXFP4 blocks as released, or bf16
    /// input-major `gate_up_proj [E, H, 2I]` / `down_proj [E, I, H]`).
    GptOss(GptOssSpec),
}

/// What a GPT-OSS checkpoint adds to the common shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GptOssSpec {
    pub sliding_window: usize,
    /// Experts stored as MXFP4 `*_blocks` / `*_scales` (the release) rather than bf16.
    pub mxfp4: bool,
}

/// A GPT-OSS layer's tensors beyond the common ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GptOssPart {
    QBias,
    KBias,
    VBias,
    OBias,
    Sinks,
    RouterBias,
    /// `mlp.experts.gate_up_proj` (bf16 `[E, H, 2I]`) or its `_blocks` (u8
    /// `[E, 2I, H / 32, 16]`).
    GateUp,
    /// `gate_up_proj_scales`, u8 `[E, 2I, H / 32]` (MXFP4 only).
    GateUpScales,
    GateUpBias,
    /// `mlp.experts.down_proj` (bf16 `[E, I, H]`) or its `_blocks` (u8 `[E, H, I / 32, 16]`).
    Down,
    /// `down_proj_scales`, u8 `[E, H, I / 32]` (MXFP4 only).
    DownScales,
    DownBias,
}

/// What a DeepSeek checkpoint adds to the common shape.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DeepseekSpec {
    /// V3 (`noaux_tc` router with `e_score_correction_bias`, `rope_interleave`) or V2.
    pub v3: bool,
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    /// The dense layers' MLP width (`intermediate_size`).
    pub dense_intermediate_size: usize,
    pub first_k_dense_replace: usize,
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    /// V2's `topk_method`: `greedy` or `group_limited_greedy`.
    pub topk_method: &'static str,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f64,
    /// YaRN: (factor, original_max_position_embeddings, mscale, mscale_all_dim).
    pub yarn: Option<(f64, usize, f64, f64)>,
    /// Stored as an FP8 block checkpoint with `[rows, cols]` blocks (V3's release: 128 × 128):
    /// every linear weight of the layers but the routers as e4m3 plus `weight_scale_inv`.
    pub fp8_block: Option<[usize; 2]>,
}

impl SpecTensor {
    /// Whether an FP8 block checkpoint stores this tensor in FP8 (the layers' matrices but the
    /// router; the embeddings, lm_head, norms and the correction bias stay as they are).
    pub fn is_fp8_matrix(self) -> bool {
        use SpecTensor::*;
        match self {
            EmbedTokens | FinalNorm | LmHead | InputNorm { .. } | PostAttentionNorm { .. } => false,
            QNorm { .. } | KNorm { .. } | Router { .. } => false,
            QProj { .. } | KProj { .. } | VProj { .. } | OProj { .. } => true,
            W1 { .. } | W2 { .. } | W3 { .. } => true,
            Deepseek { part, .. } => !matches!(
                part,
                DeepseekPart::QANorm | DeepseekPart::KvANorm | DeepseekPart::CorrectionBias
            ),
            GptOss { .. } => false,
        }
    }
}

/// A DeepSeek layer's tensors beyond the common ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeepseekPart {
    /// `q_proj` (no q LoRA) or `q_a_proj`, `q_a_layernorm`, `q_b_proj`.
    QProj,
    QAProj,
    QANorm,
    QBProj,
    KvAProj,
    KvANorm,
    KvBProj,
    OProj,
    /// The dense layers' `mlp.{gate,up,down}_proj`.
    DenseGate,
    DenseUp,
    DenseDown,
    /// `mlp.gate.e_score_correction_bias` (V3; f32).
    CorrectionBias,
    /// `mlp.shared_experts.{gate,up,down}_proj`.
    SharedGate,
    SharedUp,
    SharedDown,
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
    /// A DeepSeek tensor of layer `layer`.
    Deepseek {
        layer: usize,
        part: DeepseekPart,
    },
    /// A GPT-OSS tensor of layer `layer`.
    GptOss {
        layer: usize,
        part: GptOssPart,
    },
}

impl CheckpointSpec {
    /// The hub (state-dict) name of `tensor`.
    pub fn name(&self, tensor: SpecTensor) -> String {
        use SpecTensor::*;
        let layer = |l: usize, rest: &str| format!("model.layers.{l}.{rest}");
        let (block, [w1, w3, w2]) = match self.family {
            SpecFamily::Mixtral => ("block_sparse_moe", ["w1", "w3", "w2"]),
            SpecFamily::Qwen3Moe | SpecFamily::Deepseek(_) | SpecFamily::GptOss(_) => {
                ("mlp", ["gate_proj", "up_proj", "down_proj"])
            }
        };
        let router = match self.family {
            SpecFamily::GptOss(_) => "router",
            _ => "gate",
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
            Router { layer: l } => layer(l, &format!("{block}.{router}.weight")),
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
            Deepseek { layer: l, part } => {
                use DeepseekPart::*;
                let rest = match part {
                    QProj => "self_attn.q_proj.weight",
                    QAProj => "self_attn.q_a_proj.weight",
                    QANorm => "self_attn.q_a_layernorm.weight",
                    QBProj => "self_attn.q_b_proj.weight",
                    KvAProj => "self_attn.kv_a_proj_with_mqa.weight",
                    KvANorm => "self_attn.kv_a_layernorm.weight",
                    KvBProj => "self_attn.kv_b_proj.weight",
                    OProj => "self_attn.o_proj.weight",
                    DenseGate => "mlp.gate_proj.weight",
                    DenseUp => "mlp.up_proj.weight",
                    DenseDown => "mlp.down_proj.weight",
                    CorrectionBias => "mlp.gate.e_score_correction_bias",
                    SharedGate => "mlp.shared_experts.gate_proj.weight",
                    SharedUp => "mlp.shared_experts.up_proj.weight",
                    SharedDown => "mlp.shared_experts.down_proj.weight",
                };
                layer(l, rest)
            }
            GptOss { layer: l, part } => {
                use GptOssPart::*;
                let blocks = match self.family {
                    SpecFamily::GptOss(g) if g.mxfp4 => "_blocks",
                    _ => "",
                };
                let rest = match part {
                    QBias => "self_attn.q_proj.bias".into(),
                    KBias => "self_attn.k_proj.bias".into(),
                    VBias => "self_attn.v_proj.bias".into(),
                    OBias => "self_attn.o_proj.bias".into(),
                    Sinks => "self_attn.sinks".into(),
                    RouterBias => "mlp.router.bias".into(),
                    GateUp => format!("mlp.experts.gate_up_proj{blocks}"),
                    GateUpScales => "mlp.experts.gate_up_proj_scales".into(),
                    GateUpBias => "mlp.experts.gate_up_proj_bias".into(),
                    Down => format!("mlp.experts.down_proj{blocks}"),
                    DownScales => "mlp.experts.down_proj_scales".into(),
                    DownBias => "mlp.experts.down_proj_bias".into(),
                };
                layer(l, &rest)
            }
        }
    }

    /// The shape of a GPT-OSS tensor.
    fn gpt_oss_shape(&self, g: &GptOssSpec, part: GptOssPart) -> Vec<usize> {
        use GptOssPart::*;
        let (h, i, e) = (
            self.hidden_size,
            self.intermediate_size,
            self.num_local_experts,
        );
        match part {
            QBias => vec![self.num_attention_heads * self.head_dim],
            KBias | VBias => vec![self.num_key_value_heads * self.head_dim],
            OBias => vec![h],
            Sinks => vec![self.num_attention_heads],
            RouterBias => vec![e],
            GateUp if g.mxfp4 => vec![e, 2 * i, h / 32, 16],
            GateUp => vec![e, h, 2 * i],
            GateUpScales => vec![e, 2 * i, h / 32],
            GateUpBias => vec![e, 2 * i],
            Down if g.mxfp4 => vec![e, h, i / 32, 16],
            Down => vec![e, i, h],
            DownScales => vec![e, h, i / 32],
            DownBias => vec![e, h],
        }
    }

    /// The tensors of GPT-OSS layer `layer`.
    fn gpt_oss_layer(g: &GptOssSpec, layer: usize) -> Vec<SpecTensor> {
        use GptOssPart::*;
        use SpecTensor::*;
        let part = |part| GptOss { layer, part };
        let mut out = vec![InputNorm { layer }];
        out.extend([QProj { layer }, part(QBias), KProj { layer }, part(KBias)]);
        out.extend([VProj { layer }, part(VBias), OProj { layer }, part(OBias)]);
        out.extend([part(Sinks), PostAttentionNorm { layer }]);
        out.extend([Router { layer }, part(RouterBias), part(GateUp)]);
        if g.mxfp4 {
            out.push(part(GateUpScales));
        }
        out.extend([part(GateUpBias), part(Down)]);
        if g.mxfp4 {
            out.push(part(DownScales));
        }
        out.push(part(DownBias));
        out
    }

    /// The shape of a DeepSeek tensor.
    fn deepseek_shape(&self, d: &DeepseekSpec, part: DeepseekPart) -> Vec<usize> {
        use DeepseekPart::*;
        let (h, heads) = (self.hidden_size, self.num_attention_heads);
        let q_out = heads * (d.qk_nope_head_dim + d.qk_rope_head_dim);
        let q_rank = d.q_lora_rank.unwrap_or(0);
        let shared = d.n_shared_experts * self.intermediate_size;
        match part {
            QProj => vec![q_out, h],
            QAProj => vec![q_rank, h],
            QANorm => vec![q_rank],
            QBProj => vec![q_out, q_rank],
            KvAProj => vec![d.kv_lora_rank + d.qk_rope_head_dim, h],
            KvANorm => vec![d.kv_lora_rank],
            KvBProj => vec![heads * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank],
            OProj => vec![h, heads * d.v_head_dim],
            DenseGate | DenseUp => vec![d.dense_intermediate_size, h],
            DenseDown => vec![h, d.dense_intermediate_size],
            CorrectionBias => vec![self.num_local_experts],
            SharedGate | SharedUp => vec![shared, h],
            SharedDown => vec![h, shared],
        }
    }

    /// The tensors of DeepSeek layer `layer`, in the order the other families list theirs.
    fn deepseek_layer(d: &DeepseekSpec, layer: usize, experts: usize) -> Vec<SpecTensor> {
        use DeepseekPart::*;
        use SpecTensor::*;
        let part = |part| Deepseek { layer, part };
        let mut out = vec![InputNorm { layer }];
        match d.q_lora_rank {
            None => out.push(part(QProj)),
            Some(_) => out.extend([part(QAProj), part(QANorm), part(QBProj)]),
        }
        out.extend([part(KvAProj), part(KvANorm), part(KvBProj), part(OProj)]);
        out.push(PostAttentionNorm { layer });
        if layer < d.first_k_dense_replace {
            out.extend([part(DenseGate), part(DenseUp), part(DenseDown)]);
            return out;
        }
        out.push(Router { layer });
        if d.v3 {
            out.push(part(CorrectionBias));
        }
        for expert in 0..experts {
            out.extend([
                W1 { layer, expert },
                W2 { layer, expert },
                W3 { layer, expert },
            ]);
        }
        if d.n_shared_experts > 0 {
            out.extend([part(SharedGate), part(SharedUp), part(SharedDown)]);
        }
        out
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
            Deepseek { part, .. } => match &self.family {
                SpecFamily::Deepseek(d) => self.deepseek_shape(d, part),
                _ => unreachable!("a DeepSeek tensor of another family"),
            },
            GptOss { part, .. } => match &self.family {
                SpecFamily::GptOss(g) => self.gpt_oss_shape(g, part),
                _ => unreachable!("a GPT-OSS tensor of another family"),
            },
        }
    }

    /// Every tensor of the checkpoint, embeddings first, then layer by layer, then the final
    /// norm and (unless tied) the LM head.
    pub fn tensors(&self) -> Vec<SpecTensor> {
        use SpecTensor::*;
        let mut out = vec![EmbedTokens];
        for layer in 0..self.num_hidden_layers {
            if let SpecFamily::Deepseek(d) = &self.family {
                out.extend(Self::deepseek_layer(d, layer, self.num_local_experts));
                continue;
            }
            if let SpecFamily::GptOss(g) = &self.family {
                out.extend(Self::gpt_oss_layer(g, layer));
                continue;
            }
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

    /// The model's parameters (an MXFP4 block byte holds two; its scales are none).
    pub fn num_parameters(&self) -> u64 {
        self.tensors()
            .into_iter()
            .map(|t| {
                let numel = self.shape(t).iter().product::<usize>() as u64;
                match (t, self.family) {
                    (SpecTensor::GptOss { part, .. }, SpecFamily::GptOss(g)) if g.mxfp4 => {
                        match part {
                            GptOssPart::GateUp | GptOssPart::Down => 2 * numel,
                            GptOssPart::GateUpScales | GptOssPart::DownScales => 0,
                            _ => numel,
                        }
                    }
                    _ => numel,
                }
            })
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
            SpecFamily::Deepseek(d) => deepseek_config(self, &d),
            SpecFamily::GptOss(g) => gpt_oss_config(self, &g),
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

/// A DeepSeek-V2/V3 config's own fields, as the hub's configs write them.
fn deepseek_config(spec: &CheckpointSpec, d: &DeepseekSpec) -> Value {
    let (arch, model_type) = match d.v3 {
        true => ("DeepseekV3ForCausalLM", "deepseek_v3"),
        false => ("DeepseekV2ForCausalLM", "deepseek_v2"),
    };
    let mut config = json!({
        "architectures": [arch],
        "model_type": model_type,
        "intermediate_size": d.dense_intermediate_size,
        "moe_intermediate_size": spec.intermediate_size,
        "n_routed_experts": spec.num_local_experts,
        "n_shared_experts": d.n_shared_experts,
        "first_k_dense_replace": d.first_k_dense_replace,
        "moe_layer_freq": 1,
        "n_group": d.n_group,
        "topk_group": d.topk_group,
        "topk_method": if d.v3 { "noaux_tc" } else { d.topk_method },
        "scoring_func": if d.v3 { "sigmoid" } else { "softmax" },
        "norm_topk_prob": d.norm_topk_prob,
        "routed_scaling_factor": d.routed_scaling_factor,
        "q_lora_rank": d.q_lora_rank,
        "kv_lora_rank": d.kv_lora_rank,
        "qk_nope_head_dim": d.qk_nope_head_dim,
        "qk_rope_head_dim": d.qk_rope_head_dim,
        "v_head_dim": d.v_head_dim,
        "head_dim": d.qk_rope_head_dim,
        "attention_bias": false,
        "num_nextn_predict_layers": 0,
    });
    if d.v3 {
        config["rope_interleave"] = json!(true);
    }
    if let Some([rows, cols]) = d.fp8_block {
        config["quantization_config"] = json!({
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "weight_block_size": [rows, cols],
        });
    }
    if let Some((factor, original, mscale, mscale_all_dim)) = d.yarn {
        config["rope_scaling"] = json!({
            "type": "yarn",
            "factor": factor,
            "original_max_position_embeddings": original,
            "mscale": mscale,
            "mscale_all_dim": mscale_all_dim,
            "beta_fast": 32,
            "beta_slow": 1,
        });
    }
    config
}

/// A GPT-OSS config's own fields, as openai/gpt-oss-20b's config.json writes them (even layers
/// sliding).
fn gpt_oss_config(spec: &CheckpointSpec, g: &GptOssSpec) -> Value {
    let layer_types: Vec<&str> = (0..spec.num_hidden_layers)
        .map(|l| match l % 2 {
            0 => "sliding_attention",
            _ => "full_attention",
        })
        .collect();
    let mut config = json!({
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "num_local_experts": spec.num_local_experts,
        "experts_per_token": spec.num_experts_per_tok,
        "layer_types": layer_types,
        "sliding_window": g.sliding_window,
        "attention_bias": true,
        "swiglu_limit": 7.0,
        "router_aux_loss_coef": 0.9,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": false,
        },
    });
    if g.mxfp4 {
        config["quantization_config"] = json!({
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
            "quant_method": "mxfp4",
        });
    }
    config
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
