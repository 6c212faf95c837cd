//! Random Mixtral, Qwen3-MoE, DeepSeek and GPT-OSS checkpoints for tests and benchmarks,
//! written in Hugging Face format with hub tensor names and a byte-level tokenizer, so they load
//! and take text like a real model. GPT-OSS presets carry the harmony format's special tokens
//! and moeserve's harmony chat template; the others ChatML.
//!
//! Weights are deterministic: every tensor comes from its own ChaCha8 stream keyed by
//! `(seed, tensor name)` (see `convert::TensorRng`), so the same seed gives the same bytes on
//! every machine. Scales keep activations O(1): projections `N(0, 1/fan_in)`, embeddings
//! `N(0, 1)`, norms 1, the router `N(0, 1/hidden)` (router logits of std ≈ 1) and the LM head
//! `N(0, 16/hidden)` (logits of std ≈ 4 after the final norm: peaked but not one-hot).

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use moeserve_core::DType;
use serde_json::Value;

use crate::Result;
use crate::convert::tokenizer::{
    AddedToken, BpeTokenizerSpec, PreTokenizer, TokenizerConfig, byte_to_unicode,
};
use crate::convert::{
    CheckpointSpec, DeepseekPart, DeepseekSpec, GptOssPart, GptOssSpec, MAX_SHARD_BYTES,
    SpecFamily, SpecTensor, TensorRng,
};
use crate::writer::{
    CheckpointWriter, ShardLayout, StagedDir, TensorSource, human_bytes, human_count,
};

/// A named random model shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Preset {
    /// hidden 64, 2 layers, 8 experts top-2, vocab 512: for tests (≈ 1 M parameters).
    MixtralTiny,
    /// hidden 1024, 16 layers, 8 experts top-2, vocab 49152: ≈ 1.55 B parameters, for benchmarks.
    MixtralBench1b,
    /// Mixtral-8x7B's exact layer shapes with only 2 layers (≈ 3.2 B parameters, 6.3 GB).
    Mixtral8x7b2l,
    /// hidden 32, 48 layers, 64 experts top-2, vocab 512 (≈ 10 M parameters): many small experts,
    /// for per-expert views at the scale of large MoE models (the dashboard's 64 × 48 test).
    MixtralWide,
    /// Qwen3-30B-A3B's exact layer shapes (hidden 2048, 32 / 4 heads of 128, 128 experts top-8
    /// of width 768, vocab 151936) with 2 of its 48 layers (≈ 1.87 B parameters, 3.7 GB; the
    /// embeddings and lm_head are a third of them).
    Qwen3Moe30bA3b2l,
    /// A tiny Qwen3-MoE with Qwen3-30B-A3B's routing shape (128 experts top-8) on hidden 64,
    /// 2 layers, head_dim 24 ≠ 64/4 (≈ 1.9 M parameters): for tests.
    Qwen3MoeTiny,
    /// DeepSeek-V2-Lite's exact shapes (hidden 2048, 16 heads of MLA with kv_lora_rank 512 and
    /// no q LoRA, 64 experts top-6 of width 1408 plus 2 shared, YaRN ×40, vocab 102400) with 2
    /// of its 27 layers, the first dense as in V2-Lite (≈ 1.09 B parameters, 2.2 GB).
    DeepseekV2Lite2l,
    /// DeepSeek-V3's exact shapes (hidden 7168, 128 heads of MLA with q_lora_rank 1536 and
    /// kv_lora_rank 512, 256 experts top-8 in 8 groups keep 4, 1 shared, vocab 129280) with
    /// one dense and one MoE layer, in FP8 blocks of 128 × 128 as released (≈ 14.1 B
    /// parameters, 15.8 GB: the embeddings and lm_head in bf16).
    DeepseekV32l,
    /// DeepSeek-V3's layout in small (hidden 64, 4 heads of MLA with q LoRA, 16 experts top-4
    /// in 4 groups keep 2, 1 shared, the first layer dense), in FP8 blocks of 32 × 32: for tests.
    DeepseekV3Tiny,
    /// GPT-OSS-20B's exact shapes (hidden 2880, 64 / 8 heads of 64 with sinks, 32 experts
    /// top-4 of width 2880, window 128, YaRN ×32, vocab 201088) with 2 of its 24 layers (one
    /// sliding, one full), the experts in MXFP4 as released (≈ 2.80 B parameters, 3.3 GB: the
    /// embeddings and lm_head are 1.16 B of them, in bf16).
    GptOss20b2l,
    /// [`Preset::GptOss20b2l`] with the same expert weights in bf16 (their exact values, 5.6
    /// GB): MXFP4 against bf16 on the same model.
    GptOss20b2lBf16,
    /// GPT-OSS's layout in small (hidden 64, 4 heads of 16 with sinks, 8 experts top-2 of
    /// width 64, window 4), MXFP4 experts: for tests.
    GptOssTiny,
    /// [`Preset::GptOssTiny`] with the same expert weights in bf16.
    GptOssTinyBf16,
}

impl Preset {
    pub const ALL: [Preset; 13] = [
        Preset::MixtralTiny,
        Preset::MixtralBench1b,
        Preset::Mixtral8x7b2l,
        Preset::MixtralWide,
        Preset::Qwen3Moe30bA3b2l,
        Preset::Qwen3MoeTiny,
        Preset::DeepseekV2Lite2l,
        Preset::DeepseekV32l,
        Preset::DeepseekV3Tiny,
        Preset::GptOss20b2l,
        Preset::GptOss20b2lBf16,
        Preset::GptOssTiny,
        Preset::GptOssTinyBf16,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::MixtralTiny => "mixtral-tiny",
            Preset::MixtralBench1b => "mixtral-bench-1b",
            Preset::Mixtral8x7b2l => "mixtral-8x7b-2l",
            Preset::MixtralWide => "mixtral-wide",
            Preset::Qwen3Moe30bA3b2l => "qwen3-moe-30b-a3b-2l",
            Preset::Qwen3MoeTiny => "qwen3-moe-tiny",
            Preset::DeepseekV2Lite2l => "deepseek-v2-lite-2l",
            Preset::DeepseekV32l => "deepseek-v3-2l",
            Preset::DeepseekV3Tiny => "deepseek-v3-tiny",
            Preset::GptOss20b2l => "gpt-oss-20b-2l",
            Preset::GptOss20b2lBf16 => "gpt-oss-20b-2l-bf16",
            Preset::GptOssTiny => "gpt-oss-tiny",
            Preset::GptOssTinyBf16 => "gpt-oss-tiny-bf16",
        }
    }

    /// The preset called `name` (as [`Preset::name`]), if any.
    pub fn from_name(name: &str) -> Option<Preset> {
        Preset::ALL.into_iter().find(|p| p.name() == name)
    }

    /// Comma-separated names of all presets, for error messages and `--help`.
    pub fn names() -> String {
        Preset::ALL.map(Preset::name).join(", ")
    }

    pub fn spec(self) -> CheckpointSpec {
        let base = CheckpointSpec {
            family: SpecFamily::Mixtral,
            vocab_size: 512,
            hidden_size: 64,
            intermediate_size: 128,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            head_dim: 16,
            num_local_experts: 8,
            num_experts_per_tok: 2,
            rms_norm_eps: 1e-5,
            rope_theta: 1e6,
            max_position_embeddings: 1024,
            tie_word_embeddings: false,
            bos_token_id: Some(BOS_ID),
            eos_token_id: Some(EOS_ID),
            pad_token_id: None,
            dtype: DType::BF16,
        };
        match self {
            Preset::MixtralTiny => base,
            Preset::MixtralBench1b => CheckpointSpec {
                vocab_size: 49152,
                hidden_size: 1024,
                intermediate_size: 3584,
                num_hidden_layers: 16,
                num_attention_heads: 16,
                num_key_value_heads: 4,
                head_dim: 64,
                max_position_embeddings: 4096,
                ..base
            },
            Preset::Mixtral8x7b2l => CheckpointSpec {
                vocab_size: 32000,
                hidden_size: 4096,
                intermediate_size: 14336,
                num_hidden_layers: 2,
                num_attention_heads: 32,
                num_key_value_heads: 8,
                head_dim: 128,
                max_position_embeddings: 32768,
                ..base
            },
            Preset::MixtralWide => CheckpointSpec {
                hidden_size: 32,
                intermediate_size: 32,
                num_hidden_layers: 48,
                num_attention_heads: 2,
                num_key_value_heads: 1,
                head_dim: 16,
                num_local_experts: 64,
                ..base
            },
            Preset::Qwen3Moe30bA3b2l => CheckpointSpec {
                family: SpecFamily::Qwen3Moe,
                vocab_size: 151936,
                hidden_size: 2048,
                intermediate_size: 768,
                num_hidden_layers: 2,
                num_attention_heads: 32,
                num_key_value_heads: 4,
                head_dim: 128,
                num_local_experts: 128,
                num_experts_per_tok: 8,
                rms_norm_eps: 1e-6,
                max_position_embeddings: 40960,
                ..base
            },
            Preset::Qwen3MoeTiny => CheckpointSpec {
                family: SpecFamily::Qwen3Moe,
                intermediate_size: 32,
                head_dim: 24,
                num_local_experts: 128,
                num_experts_per_tok: 8,
                rms_norm_eps: 1e-6,
                ..base
            },
            // deepseek-ai/DeepSeek-V2-Lite's config.json, num_hidden_layers 2.
            Preset::DeepseekV2Lite2l => CheckpointSpec {
                family: SpecFamily::Deepseek(DeepseekSpec {
                    v3: false,
                    q_lora_rank: None,
                    kv_lora_rank: 512,
                    qk_nope_head_dim: 128,
                    qk_rope_head_dim: 64,
                    v_head_dim: 128,
                    dense_intermediate_size: 10944,
                    first_k_dense_replace: 1,
                    n_shared_experts: 2,
                    n_group: 1,
                    topk_group: 1,
                    topk_method: "greedy",
                    norm_topk_prob: false,
                    routed_scaling_factor: 1.0,
                    yarn: Some((40.0, 4096, 0.707, 0.707)),
                    fp8_block: None,
                }),
                vocab_size: 102400,
                hidden_size: 2048,
                intermediate_size: 1408,
                num_attention_heads: 16,
                num_key_value_heads: 16,
                head_dim: 64,
                num_local_experts: 64,
                num_experts_per_tok: 6,
                rms_norm_eps: 1e-6,
                rope_theta: 1e4,
                max_position_embeddings: 163840,
                ..base
            },
            // deepseek-ai/DeepSeek-V3's config.json, num_hidden_layers 2 with the first dense.
            Preset::DeepseekV32l => CheckpointSpec {
                family: SpecFamily::Deepseek(DeepseekSpec {
                    v3: true,
                    q_lora_rank: Some(1536),
                    kv_lora_rank: 512,
                    qk_nope_head_dim: 128,
                    qk_rope_head_dim: 64,
                    v_head_dim: 128,
                    dense_intermediate_size: 18432,
                    first_k_dense_replace: 1,
                    n_shared_experts: 1,
                    n_group: 8,
                    topk_group: 4,
                    topk_method: "noaux_tc",
                    norm_topk_prob: true,
                    routed_scaling_factor: 2.5,
                    yarn: Some((40.0, 4096, 1.0, 1.0)),
                    fp8_block: Some([128, 128]),
                }),
                vocab_size: 129280,
                hidden_size: 7168,
                intermediate_size: 2048,
                num_attention_heads: 128,
                num_key_value_heads: 128,
                head_dim: 64,
                num_local_experts: 256,
                num_experts_per_tok: 8,
                rms_norm_eps: 1e-6,
                rope_theta: 1e4,
                max_position_embeddings: 163840,
                ..base
            },
            Preset::DeepseekV3Tiny => CheckpointSpec {
                family: SpecFamily::Deepseek(DeepseekSpec {
                    v3: true,
                    q_lora_rank: Some(48),
                    kv_lora_rank: 32,
                    qk_nope_head_dim: 16,
                    qk_rope_head_dim: 16,
                    v_head_dim: 16,
                    dense_intermediate_size: 128,
                    first_k_dense_replace: 1,
                    n_shared_experts: 1,
                    n_group: 4,
                    topk_group: 2,
                    topk_method: "noaux_tc",
                    norm_topk_prob: true,
                    routed_scaling_factor: 2.5,
                    yarn: None,
                    fp8_block: Some([32, 32]),
                }),
                intermediate_size: 32,
                num_key_value_heads: 4,
                num_local_experts: 16,
                num_experts_per_tok: 4,
                rms_norm_eps: 1e-6,
                ..base
            },
            // openai/gpt-oss-20b's config.json, num_hidden_layers 2.
            Preset::GptOss20b2l | Preset::GptOss20b2lBf16 => CheckpointSpec {
                family: SpecFamily::GptOss(GptOssSpec {
                    sliding_window: 128,
                    mxfp4: self == Preset::GptOss20b2l,
                }),
                vocab_size: 201088,
                hidden_size: 2880,
                intermediate_size: 2880,
                num_attention_heads: 64,
                num_key_value_heads: 8,
                head_dim: 64,
                num_local_experts: 32,
                num_experts_per_tok: 4,
                rope_theta: 150000.0,
                max_position_embeddings: 131072,
                ..base
            },
            Preset::GptOssTiny | Preset::GptOssTinyBf16 => CheckpointSpec {
                family: SpecFamily::GptOss(GptOssSpec {
                    sliding_window: 4,
                    mxfp4: self == Preset::GptOssTiny,
                }),
                intermediate_size: 64,
                rope_theta: 150000.0,
                ..base
            },
        }
    }
}

impl std::fmt::Display for Preset {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What to make, where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MakeModelOptions {
    pub preset: Preset,
    /// The checkpoint directory (created if missing, files replaced).
    pub out: PathBuf,
    pub seed: u64,
}

/// What [`make_model`] wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct MadeModel {
    pub preset: Preset,
    pub out: PathBuf,
    pub files: Vec<PathBuf>,
    pub num_parameters: u64,
    pub total_bytes: u64,
}

impl std::fmt::Display for MadeModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "wrote {} ({} parameters = {}, {} in {} file(s)) to {}",
            self.preset,
            self.num_parameters,
            human_count(self.num_parameters),
            human_bytes(self.total_bytes),
            self.files.len(),
            self.out.display()
        )
    }
}

const BOS_ID: u32 = 1;
const EOS_ID: u32 = 2;
/// ChatML, as SmolLM2's template without its default system prompt.
const CHAT_TEMPLATE: &str = "{% for message in messages %}\
     {{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}\
     {% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

/// A preset's special tokens (at ids 0.., before the 256 bytes) and chat template.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ChatFormat {
    pub special_tokens: &'static [&'static str],
    pub template: &'static str,
    /// Indices into `special_tokens`.
    pub bos: usize,
    pub eos: usize,
    pub unk: Option<usize>,
    /// Every id generation stops at (`generation_config.json`'s `eos_token_id`).
    pub stop: &'static [u32],
}

impl ChatFormat {
    pub const CHATML: ChatFormat = ChatFormat {
        special_tokens: &["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"],
        template: CHAT_TEMPLATE,
        bos: BOS_ID as usize,
        eos: EOS_ID as usize,
        unk: Some(0),
        stop: &[EOS_ID],
    };
    /// GPT-OSS's special tokens (o200k_harmony's names); `<|return|>` at [`EOS_ID`], and a
    /// reply also stops at `<|call|>` and `<|endoftext|>`, as the release's generation config
    /// says.
    pub const HARMONY: ChatFormat = ChatFormat {
        special_tokens: &[
            "<|startoftext|>",
            "<|endoftext|>",
            "<|return|>",
            "<|constrain|>",
            "<|channel|>",
            "<|start|>",
            "<|end|>",
            "<|message|>",
            "<|call|>",
        ],
        template: moeserve_text::HARMONY_TEMPLATE,
        bos: 0,
        eos: EOS_ID as usize,
        unk: None,
        stop: &[EOS_ID, 8, 1],
    };

    fn of(spec: &CheckpointSpec) -> ChatFormat {
        match spec.family {
            SpecFamily::GptOss(_) => ChatFormat::HARMONY,
            _ => ChatFormat::CHATML,
        }
    }
}

/// Writes a random checkpoint of `options.preset` to `options.out`.
pub fn make_model(options: &MakeModelOptions) -> Result<MadeModel> {
    let spec = options.preset.spec();
    let sources = spec
        .tensors()
        .into_iter()
        .flat_map(|tensor| random_tensors(&spec, tensor, options.seed))
        .collect();
    let staged = StagedDir::new(&options.out)?;
    let writer = CheckpointWriter::create(staged.path())?;
    let written = writer.write_tensors(sources, ShardLayout::MaxShardBytes(MAX_SHARD_BYTES))?;
    writer.write_config(&spec.config_json())?;
    let format = ChatFormat::of(&spec);
    let mut generation_config = spec.generation_config_json();
    generation_config["eos_token_id"] = match format.stop {
        [one] => (*one).into(),
        many => many.into(),
    };
    writer.write_json("generation_config.json", &generation_config)?;
    let (tokenizer, tokenizer_config) = byte_level_tokenizer(spec.max_position_embeddings, &format);
    writer.write_json("tokenizer.json", &tokenizer)?;
    writer.write_json("tokenizer_config.json", &tokenizer_config)?;
    writer.write_text("chat_template.jinja", format.template)?;
    let files = written.files.iter().map(|f| staged.final_path(f)).collect();
    staged.commit()?;
    Ok(MadeModel {
        preset: options.preset,
        out: options.out.clone(),
        files,
        num_parameters: written.num_parameters,
        total_bytes: written.total_bytes,
    })
}

/// The stored form of `tensor`: one random tensor, or in an FP8 block checkpoint its e4m3
/// values and their `weight_scale_inv` (both made from the same random values).
fn random_tensors(spec: &CheckpointSpec, tensor: SpecTensor, seed: u64) -> Vec<TensorSource> {
    let fp8_block = match spec.family {
        SpecFamily::Deepseek(d) => d.fp8_block.filter(|_| tensor.is_fp8_matrix()),
        _ => None,
    };
    let plain = random_tensor(spec, tensor, seed);
    let Some(block) = fp8_block else {
        return vec![plain];
    };
    let [n, k] = plain.shape[..] else {
        unreachable!("FP8 tensors are matrices")
    };
    // The scales come from the values: whichever of the two tensors is made first computes
    // them, so the (costly) random values are drawn once when the weight is written first.
    let scales = Arc::new(OnceLock::<Vec<f32>>::new());
    let fill = Arc::new(plain.fill);
    let (values, known) = (fill.clone(), scales.clone());
    let scale_fill = move |out: &mut [f32]| {
        if known.get().is_none() {
            let mut v = vec![0.0; n * k];
            values(&mut v)?;
            known.get_or_init(|| moeserve_core::fp8::block_scales(&v, k, block));
        }
        out.copy_from_slice(known.get().expect("set above"));
        Ok(())
    };
    let scaled_fill = move |out: &mut [f32]| {
        fill(out)?;
        let scales = scales.get_or_init(|| moeserve_core::fp8::block_scales(out, k, block));
        let cols = k.div_ceil(block[1]);
        for (i, row) in out.chunks_exact_mut(k).enumerate() {
            for (j, v) in row.iter_mut().enumerate() {
                *v /= scales[i / block[0] * cols + j / block[1]];
            }
        }
        Ok(())
    };
    let scale_shape = vec![n.div_ceil(block[0]), k.div_ceil(block[1])];
    vec![
        TensorSource::new(plain.name.clone(), DType::F8E4M3, plain.shape, scaled_fill),
        TensorSource::new(
            format!("{}_scale_inv", plain.name),
            DType::F32,
            scale_shape,
            scale_fill,
        ),
    ]
}

fn random_tensor(spec: &CheckpointSpec, tensor: SpecTensor, seed: u64) -> TensorSource {
    use SpecTensor::*;
    let name = spec.name(tensor);
    let shape = spec.shape(tensor);
    let fan_in = shape.last().copied().unwrap_or(1) as f32;
    let std = match tensor {
        FinalNorm | InputNorm { .. } | PostAttentionNorm { .. } | QNorm { .. } | KNorm { .. } => {
            return TensorSource::new(name, spec.dtype, shape, |out| {
                out.fill(1.0);
                Ok(())
            });
        }
        EmbedTokens => 1.0,
        LmHead => 4.0 / fan_in.sqrt(),
        QProj { .. } | KProj { .. } | VProj { .. } | OProj { .. } | Router { .. } => {
            1.0 / fan_in.sqrt()
        }
        W1 { .. } | W2 { .. } | W3 { .. } => 1.0 / fan_in.sqrt(),
        GptOss { part, .. } => return gpt_oss_tensor(spec, part, name, shape, seed),
        Deepseek { part, .. } => match part {
            DeepseekPart::QANorm | DeepseekPart::KvANorm => {
                return TensorSource::new(name, spec.dtype, shape, |out| {
                    out.fill(1.0);
                    Ok(())
                });
            }
            // transformers keeps it in f32; small, as trained ones are against sigmoid scores.
            DeepseekPart::CorrectionBias => {
                let rng = TensorRng::new(seed, &name);
                return TensorSource::new(name, DType::F32, shape, move |out| {
                    rng.fill_normal(out, 0.02);
                    Ok(())
                });
            }
            _ => 1.0 / fan_in.sqrt(),
        },
    };
    let rng = TensorRng::new(seed, &name);
    TensorSource::new(name, spec.dtype, shape, move |out| {
        rng.fill_normal(out, std);
        Ok(())
    })
}

/// MXFP4 scale of the presets' random experts: `2^-7` (e8m0 120). Uniform e2m1 codes have a
/// standard deviation of 2.93, so the weights' is 0.023 ≈ 1/√2880 (gpt-oss's fan-in).
const MXFP4_PRESET_SCALE: u8 = 120;

/// A GPT-OSS tensor: biases small, sinks `N(0, 1)`, experts random MXFP4 blocks under one
/// scale or, in bf16, those blocks' exact values (the same bytes: the stream is keyed by the
/// blocks' name either way), input-major as the bf16 copies store them.
fn gpt_oss_tensor(
    spec: &CheckpointSpec,
    part: GptOssPart,
    name: String,
    shape: Vec<usize>,
    seed: u64,
) -> TensorSource {
    use GptOssPart::*;
    let normal = |name: String, std: f32| {
        let rng = TensorRng::new(seed, &name);
        TensorSource::new(name, spec.dtype, shape.clone(), move |out| {
            rng.fill_normal(out, std);
            Ok(())
        })
    };
    match part {
        QBias | KBias | VBias | OBias | RouterBias | GateUpBias | DownBias => normal(name, 0.02),
        Sinks => normal(name, 1.0),
        GateUpScales | DownScales => TensorSource::new(name, DType::Mxfp4, shape, |out| {
            out.fill(f32::from(MXFP4_PRESET_SCALE));
            Ok(())
        }),
        GateUp | Down if name.ends_with("_blocks") => {
            let rng = TensorRng::new(seed, &name);
            TensorSource::new(name, DType::Mxfp4, shape, move |out| {
                rng.fill_bytes(out);
                Ok(())
            })
        }
        GateUp | Down => {
            // bf16 [E, in, out]: the blocks [E, out, in / 32, 16] decoded and transposed.
            let rng = TensorRng::new(seed, &format!("{name}_blocks"));
            let &[experts, cols, rows] = &shape[..] else {
                unreachable!("fused expert tensors are 3-D")
            };
            TensorSource::new(name, spec.dtype, shape, move |out| {
                use moeserve_core::mxfp4::{E2M1, e8m0};
                let mut bytes = vec![0.0; experts * rows * cols / 2];
                rng.fill_bytes(&mut bytes);
                let s = e8m0(MXFP4_PRESET_SCALE);
                for (e, expert) in out.chunks_exact_mut(cols * rows).enumerate() {
                    let stored = &bytes[e * rows * cols / 2..][..rows * cols / 2];
                    for r in 0..rows {
                        for c in 0..cols {
                            let byte = stored[(r * cols + c) / 2] as u8;
                            let code = if c % 2 == 0 { byte & 0xF } else { byte >> 4 };
                            expert[c * rows + r] = E2M1[code as usize] * s;
                        }
                    }
                }
                Ok(())
            })
        }
    }
}

/// `tokenizer.json` and `tokenizer_config.json` of a byte-level BPE without merges: the
/// format's special tokens at ids 0..n, then the 256 bytes (GPT-2 byte-level symbols).
pub fn byte_level_tokenizer(model_max_length: usize, format: &ChatFormat) -> (Value, Value) {
    let specials = format.special_tokens;
    let byte_symbols: Vec<String> = byte_to_unicode().iter().map(char::to_string).collect();
    let tokens: Vec<&str> = specials
        .iter()
        .copied()
        .chain(byte_symbols.iter().map(String::as_str))
        .collect();
    let added_tokens: Vec<AddedToken> = (0u32..)
        .zip(specials)
        .map(|(id, content)| AddedToken {
            id,
            content: content.to_string(),
            special: true,
        })
        .collect();
    let spec = BpeTokenizerSpec {
        tokens: &tokens,
        merges: Vec::new(),
        added_tokens: added_tokens.clone(),
        pre_tokenizer: PreTokenizer::ByteLevel,
        bos_to_add: None,
    };
    let config = TokenizerConfig {
        added_tokens: &added_tokens,
        bos_token: Some(specials[format.bos].to_string()),
        eos_token: Some(specials[format.eos].to_string()),
        unk_token: format.unk.map(|i| specials[i].to_string()),
        pad_token: None,
        add_bos_token: false,
        chat_template: Some(format.template.to_string()),
        model_max_length,
    };
    (spec.to_json(), config.to_json())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn make_tiny(seed: u64) -> (tempfile::TempDir, MadeModel) {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = MakeModelOptions {
            preset: Preset::MixtralTiny,
            out: dir.path().join("tiny"),
            seed,
        };
        let made = make_model(&options).expect("make mixtral-tiny");
        (dir, made)
    }

    #[test]
    fn names_round_trip() {
        for preset in Preset::ALL {
            assert_eq!(Preset::from_name(preset.name()), Some(preset));
        }
        assert_eq!(Preset::from_name("mixtral-huge"), None);
        assert!(Preset::names().contains("mixtral-8x7b-2l"));
    }

    #[test]
    fn parameter_counts_match_the_advertised_sizes() {
        let bench = Preset::MixtralBench1b.spec().num_parameters();
        assert!((1_500_000_000..1_600_000_000).contains(&bench), "{bench}");
        let big = Preset::Mixtral8x7b2l.spec();
        assert_eq!(
            big.num_parameters(),
            2 * (1_409_286_144 + 41_943_040 + 2 * 4096 + 8 * 4096) + 2 * 131_072_000 + 4096
        );
    }

    #[test]
    fn gpt_oss_20b_preset_has_its_exact_parameter_count() {
        // Per layer: attention 2880 × (4096 + 512 + 512) + 4096 × 2880, its biases and 64
        // sinks, two norms, the router and its bias, 32 experts of 3 × 2880² and their biases.
        let layer = 2880 * 9216 + 8000 + 64 + 2 * 2880 + 32 * 2881 + 32 * (3 * 2880 * 2880 + 8640);
        let want = 2 * layer + 2 * 201088 * 2880 + 2880;
        assert_eq!(want, 2_804_643_712);
        for preset in [Preset::GptOss20b2l, Preset::GptOss20b2lBf16] {
            assert_eq!(preset.spec().num_parameters(), want, "{preset}");
        }
        // 24 layers are gpt-oss-20b's 20.9 B.
        assert_eq!((24 * layer + 2 * 201088 * 2880 + 2880) / 100_000_000, 209);
    }

    #[test]
    fn same_seed_gives_identical_bytes_and_another_seed_does_not() {
        let (_a, first) = make_tiny(5);
        let (_b, second) = make_tiny(5);
        let (_c, other) = make_tiny(6);
        let read = |m: &MadeModel| std::fs::read(&m.files[0]).expect("read safetensors");
        assert_eq!(read(&first), read(&second));
        assert_ne!(read(&first), read(&other));
        assert_eq!(
            first.num_parameters,
            Preset::MixtralTiny.spec().num_parameters()
        );
    }

    #[test]
    fn tiny_checkpoint_has_hub_names_config_and_side_files() {
        let (_dir, made) = make_tiny(0);
        let bytes = std::fs::read(made.out.join("model.safetensors")).expect("single file");
        let file = safetensors::SafeTensors::deserialize(&bytes).expect("valid safetensors");
        let router = file
            .tensor("model.layers.1.block_sparse_moe.gate.weight")
            .expect("router");
        assert_eq!(router.shape(), &[8, 64]);
        assert_eq!(router.dtype(), safetensors::Dtype::BF16);
        let w2 = file
            .tensor("model.layers.0.block_sparse_moe.experts.7.w2.weight")
            .expect("w2");
        assert_eq!(w2.shape(), &[64, 128]);
        assert_eq!(
            file.tensor("lm_head.weight").expect("untied head").shape(),
            &[512, 64]
        );
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(made.out.join("config.json")).unwrap())
                .expect("config.json parses");
        assert_eq!(
            (&config["num_local_experts"], &config["num_experts_per_tok"]),
            (&Value::from(8), &Value::from(2))
        );
        for name in [
            "generation_config.json",
            "tokenizer_config.json",
            "chat_template.jinja",
        ] {
            assert!(made.out.join(name).exists(), "{name} missing");
        }
    }

    #[test]
    fn qwen3_30b_a3b_preset_has_its_exact_parameter_count() {
        // Qwen3-30B-A3B's shapes, 2 of its 48 layers.
        let big = Preset::Qwen3Moe30bA3b2l.spec();
        let per_layer = 2 * 2048 * 4096
            + 2 * 2048 * 512
            + 128 * 2048
            + 128 * 3 * 2048 * 768
            + 2 * 2048
            + 2 * 128;
        assert_eq!(
            big.num_parameters() as usize,
            2 * per_layer + 2 * 151936 * 2048 + 2048
        );
    }

    #[test]
    fn deepseek_presets_have_their_models_exact_parameter_counts() {
        // DeepSeek-V2-Lite: q_proj, kv_a, kv_b, o_proj per layer; layer 0 dense, layer 1 with
        // 64 experts of 1408 and 2 shared.
        let attention = 2048 * 16 * 192 + 576 * 2048 + 512 + 16 * 256 * 512 + 2048 * 16 * 128;
        let norms = 2 * 2048;
        let dense = 3 * 2048 * 10944;
        let sparse = 64 * 2048 + 64 * 3 * 2048 * 1408 + 3 * 2048 * 2816;
        let lite = Preset::DeepseekV2Lite2l.spec();
        assert_eq!(
            lite.num_parameters() as usize,
            2 * (attention + norms) + dense + sparse + 2 * 102400 * 2048 + 2048
        );
        // DeepSeek-V3 with q LoRA 1536, 256 experts of 2048, 1 shared, the correction bias.
        let attention = 1536 * 7168
            + 1536
            + 128 * 192 * 1536
            + 576 * 7168
            + 512
            + 128 * 256 * 512
            + 7168 * 128 * 128;
        let norms = 2 * 7168;
        let dense = 3 * 7168 * 18432;
        let sparse = 256 * 7168 + 256 + 256 * 3 * 7168 * 2048 + 3 * 7168 * 2048;
        let v3 = Preset::DeepseekV32l.spec();
        assert_eq!(
            v3.num_parameters() as usize,
            2 * (attention + norms) + dense + sparse + 2 * 129280 * 7168 + 7168
        );
        let config = v3.config_json();
        assert_eq!(config["architectures"][0], "DeepseekV3ForCausalLM");
        assert_eq!(config["n_routed_experts"], 256);
        assert_eq!(config["intermediate_size"], 18432);
        assert_eq!(config["moe_intermediate_size"], 2048);
        assert_eq!(config["rope_scaling"]["type"], "yarn");
    }

    #[test]
    fn chat_template_renders_chatml() {
        let env = minijinja::Environment::new();
        let messages = serde_json::json!([{ "role": "user", "content": "Hi" }]);
        let rendered = env
            .render_str(
                CHAT_TEMPLATE,
                minijinja::context! { messages, add_generation_prompt => true },
            )
            .expect("template renders");
        assert_eq!(
            rendered,
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn gpt_oss_presets_carry_the_harmony_tokens_template_and_stops() {
        let dir = tempfile::tempdir().expect("temp dir");
        let options = MakeModelOptions {
            preset: Preset::GptOssTiny,
            out: dir.path().join("gpt-oss"),
            seed: 0,
        };
        let made = make_model(&options).expect("make gpt-oss-tiny");
        let tokenizer =
            tokenizers::Tokenizer::from_file(made.out.join("tokenizer.json")).expect("loads");
        for (id, token) in (0u32..).zip(ChatFormat::HARMONY.special_tokens) {
            assert_eq!(tokenizer.token_to_id(token), Some(id), "{token}");
        }
        let template = std::fs::read_to_string(made.out.join("chat_template.jinja")).unwrap();
        assert_eq!(template, moeserve_text::HARMONY_TEMPLATE);
        let read = |name: &str| -> Value {
            serde_json::from_str(&std::fs::read_to_string(made.out.join(name)).unwrap()).unwrap()
        };
        // <|return|>, <|call|>, <|endoftext|>.
        assert_eq!(
            read("generation_config.json")["eos_token_id"],
            serde_json::json!([2, 8, 1])
        );
        assert_eq!(read("tokenizer_config.json")["eos_token"], "<|return|>");
    }

    #[test]
    fn byte_level_tokenizer_round_trips_text_and_special_tokens() {
        let (_dir, made) = make_tiny(0);
        let tokenizer =
            tokenizers::Tokenizer::from_file(made.out.join("tokenizer.json")).expect("loads");
        let text = "<|im_start|>user\nHéllo wörld 🤖 12\t<|im_end|>";
        let ids = tokenizer
            .encode(text, false)
            .expect("encode")
            .get_ids()
            .to_vec();
        assert_eq!(ids.first(), Some(&3));
        assert_eq!(ids.last(), Some(&4));
        assert_eq!(ids[1], 5 + u32::from(b'u'));
        assert!(ids.iter().all(|&id| id < 261));
        assert_eq!(tokenizer.decode(&ids, false).expect("decode"), text);
        assert_eq!(tokenizer.token_to_id("</s>"), Some(EOS_ID));
    }
}
