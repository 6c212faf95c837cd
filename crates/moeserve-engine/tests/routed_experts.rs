//! `return_routed_experts`: the routers' choices per token come back with the output, the same
//! whether the request runs alone or batched, and with the prompt's positions on request.

mod common;

use std::sync::Arc;

use common::{repo_root, run_together};
use moeserve_core::SamplingParams;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::EngineConfig;
use moeserve_engine::offline::generate_one;
use moeserve_engine::request::{GenerateRequest, Prompt, RoutedExpertsMode};

fn request(prompt: Vec<u32>, mode: RoutedExpertsMode) -> GenerateRequest {
    GenerateRequest {
        prompt: Prompt::TokenIds(prompt),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(6)
        },
        grammar: None,
        routed_experts: mode,
    }
}

#[test]
fn routed_experts_have_one_entry_per_token_layer_and_k_and_do_not_depend_on_the_batch() {
    // Qwen3-MoE's fixture: several MoE layers, top-k over more experts than k.
    let assets =
        Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures/qwen3-moe")).unwrap());
    let config = assets.model.config();
    let (layers, k, experts) = (
        config.num_moe_layers(),
        config.num_experts_per_tok,
        config.num_local_experts,
    );
    // Two full blocks of 16 and a few more: the prefix cache has something to offer.
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 + 3) % 90 + 5).collect();
    let alone = generate_one(
        assets.clone(),
        request(prompt.clone(), RoutedExpertsMode::WithPrompt),
    )
    .unwrap();
    let routed = alone.routed_experts.as_ref().expect("asked for");
    let prompt_routing = routed.prompt.as_ref().expect("with the prompt");
    assert_eq!(prompt_routing.len(), prompt.len() - 1);
    assert_eq!(routed.generated.len(), 6);
    for token in prompt_routing.iter().chain(&routed.generated) {
        assert_eq!(token.len(), layers);
        for chosen in token {
            assert_eq!(chosen.len(), k);
            assert!(chosen.iter().all(|&e| (e as usize) < experts));
            let mut distinct = chosen.clone();
            distinct.sort_unstable();
            distinct.dedup();
            assert_eq!(distinct.len(), k, "{chosen:?}");
        }
    }
    assert!(
        prompt_routing.windows(2).any(|w| w[0] != w[1]),
        "different tokens route differently"
    );

    // Batched with others, after a request with the same prompt filled the prefix cache: the
    // same routing (the prompt computed again for the one that asked for it).
    let mut requests = vec![
        request(prompt.clone(), RoutedExpertsMode::Off),
        request(prompt.clone(), RoutedExpertsMode::Generated),
        request(prompt.clone(), RoutedExpertsMode::WithPrompt),
    ];
    requests.extend((0..3).map(|i| request(vec![9, 10, 11, 12 + i], RoutedExpertsMode::Generated)));
    let (outputs, _) = run_together(&assets, &requests, EngineConfig::default());
    assert!(outputs[0].routed_experts.is_none());
    let generated_only = outputs[1].routed_experts.as_ref().unwrap();
    assert!(generated_only.prompt.is_none());
    assert_eq!(generated_only.generated, routed.generated);
    assert_eq!(outputs[2].routed_experts.as_ref(), Some(routed));
    for out in &outputs[3..] {
        assert_eq!(out.routed_experts.as_ref().unwrap().generated.len(), 6);
    }
}
