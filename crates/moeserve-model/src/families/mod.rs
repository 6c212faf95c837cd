//! The model families: each reads its `config.json` into the family-agnostic
//! [`ModelConfig`](crate::config::ModelConfig), which the one decoder (`models::decoder`) runs.
//! A family differs from the others only in what its config says: the attention variant, which
//! layers are sparse, the router's weighting, shared experts and its tensor names. Adding a
//! family means a file here, its entry in [`Architecture`], and its reference fixtures.

mod deepseek;
mod glm4_moe;
mod gpt_oss;
mod mixtral;
mod olmoe;
mod qwen_moe;

use crate::Result;
use crate::config::{
    AttentionConfig, ConfigFields, ExpertConfig, FusedExperts, ModelConfig, SharedExpertConfig,
    TensorNames,
};
use crate::layers::rope::RopeScaling;
use crate::moe::{GroupLimit, Scoring};

/// The `architectures` entries this crate serves, for error messages.
pub const SUPPORTED_ARCHITECTURES: &str = "MixtralForCausalLM, Qwen3MoeForCausalLM, \
     Qwen2MoeForCausalLM, OlmoeForCausalLM, Glm4MoeForCausalLM, DeepseekV2ForCausalLM, \
     DeepseekV3ForCausalLM, GptOssForCausalLM";

/// A model family, as config.json's `architectures` names it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Architecture {
    Mixtral,
    Qwen3Moe,
    Qwen2Moe,
    Olmoe,
    Glm4Moe,
    DeepseekV2,
    DeepseekV3,
    GptOss,
}

impl Architecture {
    pub const ALL: [Architecture; 8] = [
        Architecture::Mixtral,
        Architecture::Qwen3Moe,
        Architecture::Qwen2Moe,
        Architecture::Olmoe,
        Architecture::Glm4Moe,
        Architecture::DeepseekV2,
        Architecture::DeepseekV3,
        Architecture::GptOss,
    ];

    /// The transformers class name (`architectures` in config.json).
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::Qwen2Moe => "Qwen2MoeForCausalLM",
            Architecture::Olmoe => "OlmoeForCausalLM",
            Architecture::Glm4Moe => "Glm4MoeForCausalLM",
            Architecture::DeepseekV2 => "DeepseekV2ForCausalLM",
            Architecture::DeepseekV3 => "DeepseekV3ForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
        }
    }

    /// config.json's `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::Qwen2Moe => "qwen2_moe",
            Architecture::Olmoe => "olmoe",
            Architecture::Glm4Moe => "glm4_moe",
            Architecture::DeepseekV2 => "deepseek_v2",
            Architecture::DeepseekV3 => "deepseek_v3",
            Architecture::GptOss => "gpt_oss",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.name() == name)
    }

    pub fn from_model_type(model_type: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|a| a.model_type() == model_type)
    }
}

impl std::fmt::Display for Architecture {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Reads `fields` as `architecture`'s config class does.
pub(crate) fn read_config(
    architecture: Architecture,
    fields: &ConfigFields<'_>,
) -> Result<ModelConfig> {
    match architecture {
        Architecture::Mixtral => mixtral::read_config(fields),
        Architecture::Qwen3Moe | Architecture::Qwen2Moe => {
            qwen_moe::read_config(architecture, fields)
        }
        Architecture::Olmoe => olmoe::read_config(fields),
        Architecture::Glm4Moe => glm4_moe::read_config(fields),
        Architecture::DeepseekV2 | Architecture::DeepseekV3 => {
            deepseek::read_config(architecture, fields)
        }
        Architecture::GptOss => gpt_oss::read_config(fields),
    }
}

/// The widths and expert counts of a family's MoE block.
pub(crate) struct MoeShape {
    /// A dense layer's MLP width.
    pub intermediate_size: usize,
    /// A routed expert's width.
    pub moe_intermediate_size: usize,
    pub num_experts: usize,
    pub num_experts_per_tok: usize,
}

/// The config classes' defaults of the MoE block DeepSeek introduced and GLM-4.5 reuses.
pub(crate) struct DeepseekMoeDefaults {
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub first_k_dense_replace: usize,
    pub intermediate_size: usize,
    pub moe_intermediate_size: usize,
    pub n_shared_experts: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub routed_scaling_factor: f64,
}

/// That block as a config describes it: `n_routed_experts` (or `num_local_experts`) of
/// `moe_intermediate_size`, the first `first_k_dense_replace` layers dense (an MLP of
/// `intermediate_size`), `n_shared_experts · moe_intermediate_size` of shared experts
/// (`mlp.shared_experts`, no gate), `topk_group` of `n_group` groups, `routed_scaling_factor`.
pub(crate) struct DeepseekMoe {
    pub shape: MoeShape,
    pub sparse_layers: Vec<bool>,
    pub shared_expert: Option<SharedExpertConfig>,
    /// `None` with one group: it keeps every expert, the same as no limit, which is cheaper.
    pub group_limit: Option<GroupLimit>,
    pub routed_scaling_factor: f32,
}

impl DeepseekMoe {
    pub(crate) fn read(
        fields: &ConfigFields<'_>,
        d: &DeepseekMoeDefaults,
        num_layers: usize,
    ) -> Result<Self> {
        let num_experts = match fields.opt_usize("n_routed_experts")? {
            Some(n) => n,
            None => fields
                .opt_usize("num_local_experts")?
                .unwrap_or(d.n_routed_experts),
        };
        let first_dense = fields
            .opt_usize("first_k_dense_replace")?
            .unwrap_or(d.first_k_dense_replace);
        let moe_intermediate_size = fields
            .opt_usize("moe_intermediate_size")?
            .unwrap_or(d.moe_intermediate_size);
        let shared = fields
            .opt_usize("n_shared_experts")?
            .unwrap_or(d.n_shared_experts);
        let groups = fields.opt_usize("n_group")?.unwrap_or(d.n_group);
        let keep = fields.opt_usize("topk_group")?.unwrap_or(d.topk_group);
        let scale = fields
            .opt_f64("routed_scaling_factor")?
            .unwrap_or(d.routed_scaling_factor);
        Ok(DeepseekMoe {
            shape: MoeShape {
                intermediate_size: fields
                    .opt_usize("intermediate_size")?
                    .unwrap_or(d.intermediate_size),
                moe_intermediate_size,
                num_experts,
                num_experts_per_tok: fields
                    .opt_usize("num_experts_per_tok")?
                    .unwrap_or(d.num_experts_per_tok),
            },
            sparse_layers: (0..num_layers).map(|l| l >= first_dense).collect(),
            shared_expert: (shared > 0).then_some(SharedExpertConfig {
                intermediate_size: shared * moe_intermediate_size,
                gated: false,
            }),
            group_limit: (groups > 1).then_some(GroupLimit { groups, keep }),
            routed_scaling_factor: scale as f32,
        })
    }
}

/// The tensor names of the families whose block is `mlp` with `{gate,up,down}_proj` experts.
pub(crate) const MLP_NAMES: TensorNames = TensorNames {
    moe_block: "mlp",
    router: "gate",
    fused_experts: FusedExperts::GateThenUp,
    expert_proj: ["gate_proj", "up_proj", "down_proj"],
    shared_expert: "shared_expert",
};

/// What every family reads the same way: vocabulary, widths, heads, norms, RoPE, positions,
/// tying and dtype. `rope_theta` is the config class's default.
pub(crate) struct Common {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: RopeScaling,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub dtype: Option<moeserve_core::DType>,
}

impl Common {
    /// A config of `architecture` from these shared fields and the MoE shape, with Mixtral's
    /// plain options (no attention extras, every layer sparse, renormalised top-k, no shared
    /// expert, Mixtral's tensor names); each family overrides what it adds.
    pub(crate) fn config(self, architecture: Architecture, moe: MoeShape) -> ModelConfig {
        ModelConfig {
            architecture,
            vocab_size: self.vocab_size,
            hidden_size: self.hidden_size,
            intermediate_size: moe.intermediate_size,
            moe_intermediate_size: moe.moe_intermediate_size,
            num_hidden_layers: self.num_hidden_layers,
            num_attention_heads: self.num_attention_heads,
            num_key_value_heads: self.num_key_value_heads,
            head_dim: self.head_dim,
            num_local_experts: moe.num_experts,
            num_experts_per_tok: moe.num_experts_per_tok,
            norm_topk_prob: true,
            router_scoring: Scoring::Softmax,
            score_correction_bias: false,
            routed_scaling_factor: 1.0,
            shared_expert: None,
            sparse_layers: vec![true; self.num_hidden_layers],
            attention: AttentionConfig::PLAIN,
            mla: None,
            experts: ExpertConfig::SWIGLU,
            router_bias: false,
            names: TensorNames {
                moe_block: "block_sparse_moe",
                router: "gate",
                fused_experts: FusedExperts::GateThenUp,
                expert_proj: ["w1", "w3", "w2"],
                shared_expert: "shared_expert",
            },
            rms_norm_eps: self.rms_norm_eps,
            rope_theta: self.rope_theta,
            rope_scaling: self.rope_scaling,
            rotary_dim: self.head_dim,
            sliding_window: None,
            window_layers: vec![true; self.num_hidden_layers],
            max_position_embeddings: self.max_position_embeddings,
            tie_word_embeddings: self.tie_word_embeddings,
            dtype: self.dtype,
        }
    }

    pub(crate) fn read(
        fields: &ConfigFields<'_>,
        rope_theta: f64,
        rms_norm_eps: f64,
        max_positions: usize,
    ) -> Result<Self> {
        let hidden_size = fields.usize("hidden_size")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let max_position_embeddings = fields
            .opt_usize("max_position_embeddings")?
            .unwrap_or(max_positions);
        Ok(Common {
            vocab_size: fields.usize("vocab_size")?,
            hidden_size,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: fields
                .opt_usize("num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            head_dim: fields.head_dim(hidden_size, num_attention_heads)?,
            rms_norm_eps: fields.opt_f64("rms_norm_eps")?.unwrap_or(rms_norm_eps) as f32,
            rope_theta: fields.rope_theta(rope_theta)?,
            rope_scaling: fields.rope_scaling(max_position_embeddings)?,
            max_position_embeddings,
            tie_word_embeddings: fields.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            dtype: fields.dtype(),
        })
    }
}
