//! The presets `moeserve make-model` writes (moeserve-formats) load as their family.

mod common;

use moeserve_formats::presets::{MakeModelOptions, Preset, make_model};
use moeserve_model::config::{Architecture, ModelConfig};
use moeserve_model::models::{ForwardOptions, MoeModel};

fn make(preset: Preset) -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let options = MakeModelOptions {
        preset,
        out: dir.path().join(preset.name()),
        seed: 0,
    };
    let made = make_model(&options).expect("make the preset");
    (dir, made.out)
}

#[test]
fn mixtral_tiny_loads_as_mixtral() {
    let (_dir, out) = make(Preset::MixtralTiny);
    let config = ModelConfig::from_dir(&out).expect("config.json parses");
    assert_eq!(config.architecture, Architecture::Mixtral);
    assert_eq!(
        (config.num_local_experts, config.num_experts_per_tok),
        (8, 2)
    );
}

#[test]
fn qwen3_moe_tiny_loads_as_qwen3_moe_with_128_experts() {
    let (_dir, out) = make(Preset::Qwen3MoeTiny);
    let model = MoeModel::load(&out).expect("loads");
    let c = model.config();
    assert_eq!(c.architecture, Architecture::Qwen3Moe);
    assert_eq!((c.num_local_experts, c.num_experts_per_tok), (128, 8));
    assert_eq!(
        (c.head_dim, c.hidden_size / c.num_attention_heads),
        (24, 16)
    );
    assert!(c.norm_topk_prob && c.sparse_layers.iter().all(|s| *s));
    assert_eq!(model.moe_layers().len(), 2);
}

#[test]
fn deepseek_v3_tiny_loads_as_an_fp8_block_checkpoint_and_runs() {
    use moeserve_core::DType;
    let (_dir, out) = make(Preset::DeepseekV3Tiny);
    let names: Vec<String> = moeserve_model::checkpoint::Checkpoint::open(&out)
        .unwrap()
        .tensor_names()
        .map(str::to_string)
        .collect();
    let scale = "model.layers.1.mlp.experts.3.down_proj.weight_scale_inv";
    assert!(names.iter().any(|n| n == scale), "{scale} missing");
    assert!(
        !names
            .iter()
            .any(|n| n == "model.layers.1.mlp.gate.weight_scale_inv")
    );
    let model = MoeModel::load(&out).expect("loads");
    let c = model.config();
    assert_eq!(c.architecture, Architecture::DeepseekV3);
    assert_eq!(c.sparse_layers, [false, true]);
    assert_eq!(model.moe_layers()[0].experts[3].w2.dtype(), DType::F8E4M3);
    let logits = common::prefill(&model, &[1, 5, 9, 42], ForwardOptions::default());
    assert!(logits.iter().all(|x| x.is_finite()) && logits.iter().any(|x| *x != 0.0));
}

/// The MXFP4 preset and its bf16 twin hold the same expert weights: the MXFP4 experts load as
/// 4-bit and the two give the same logits bit for bit (the kernels widen MXFP4 to the exact
/// values the bf16 copy stores, then run the same FMA chain).
#[test]
fn gpt_oss_tiny_mxfp4_and_its_bf16_twin_give_the_same_logits() {
    use moeserve_core::DType;
    let (_a, mxfp4) = make(Preset::GptOssTiny);
    let (_b, bf16) = make(Preset::GptOssTinyBf16);
    let (q, b) = (
        MoeModel::load(&mxfp4).unwrap(),
        MoeModel::load(&bf16).unwrap(),
    );
    assert_eq!(q.config().architecture, Architecture::GptOss);
    assert_eq!(q.config().window_layers, [true, false]);
    assert_eq!(q.moe_layers()[1].experts[5].w2.dtype(), DType::Mxfp4);
    assert_eq!(b.moe_layers()[1].experts[5].w2.dtype(), DType::BF16);
    let prompt = [1, 5, 9, 42, 7, 300, 11, 64];
    let logits = |m: &MoeModel| common::prefill(m, &prompt, ForwardOptions::default());
    let (lq, lb) = (logits(&q), logits(&b));
    assert!(lq.iter().all(|x| x.is_finite()) && lq.iter().any(|x| *x != 0.0));
    assert_eq!(lq, lb);
}
