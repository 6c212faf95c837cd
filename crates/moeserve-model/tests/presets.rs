//! The presets `moeserve make-model` writes (moeserve-formats) load as their family.

use moeserve_formats::presets::{MakeModelOptions, Preset, make_model};
use moeserve_model::config::{Architecture, ModelConfig};
use moeserve_model::models::MoeModel;

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
