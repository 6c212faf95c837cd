//! Paths shared by the engine's integration tests.

#![allow(dead_code)] // Each test binary uses a different subset.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::offline::LlmEngine;
use moeserve_engine::request::{GenerateOutput, GenerateRequest};

/// The transformers reference checkpoints under tests/fixtures.
pub const FIXTURE_CASES: [&str; 16] = [
    "mixtral-swa",
    "mixtral-tied",
    "mixtral-gqa",
    "mixtral-sharded",
    "qwen3-moe",
    "qwen3-moe-fused",
    "qwen3-moe-yarn",
    "qwen2-moe",
    "olmoe",
    "glm4-moe",
    "deepseek-v2-lite",
    "deepseek-v2",
    "deepseek-v3",
    "deepseek-v3-fp8",
    "gpt-oss",
    "gpt-oss-mxfp4",
];

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The demo model: `MOESERVE_DEMO_MODEL`, else `models/smolmoe-8x135m` (made by
/// `models/smolmoe-8x135m.sh`, which scripts/test.sh runs first).
pub fn demo_model_dir() -> PathBuf {
    let dir = std::env::var_os("MOESERVE_DEMO_MODEL")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join("models/smolmoe-8x135m"));
    assert!(
        dir.join("config.json").exists(),
        "{} is missing: run models/smolmoe-8x135m.sh",
        dir.display()
    );
    dir
}

/// Runs `requests` together through one engine; panics on any failed request.
pub fn run_together(
    assets: &Arc<ModelAssets>,
    requests: &[GenerateRequest],
    config: EngineConfig,
) -> (Vec<GenerateOutput>, LlmEngine) {
    let mut engine = LlmEngine::new(assets.clone(), &config).unwrap();
    let outputs = engine
        .generate(requests.to_vec(), |_, _| {})
        .into_iter()
        .map(|r| r.unwrap())
        .collect();
    (outputs, engine)
}
