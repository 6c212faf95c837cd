//! The MoE core through the engine: expert parallelism (1, 2, 4 devices, with and without
//! replicas) leaves batch outputs bit-identical, capacity counts reach the request outputs and
//! the snapshot, routing traces record every step, placement files are used and checked.

mod common;

use std::path::PathBuf;
use std::sync::Arc;

use common::{FIXTURE_CASES, demo_model_dir, repo_root, run_together};
use moeserve_core::{ExpertPlacement, MoeConfig, OverflowPolicy, SamplingParams, SchedulerConfig};
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::{EngineConfig, RequestEvent};
use moeserve_engine::handle::Engine;
use moeserve_engine::offline::{LlmEngine, generate_one};
use moeserve_engine::placement::RoutingTraceReader;
use moeserve_engine::request::{GenerateOutput, GenerateRequest, Prompt};
use moeserve_text::chat_template::ChatMessage;

fn fixture(case: &str) -> Arc<ModelAssets> {
    Arc::new(ModelAssets::load(&repo_root().join("tests/fixtures").join(case)).unwrap())
}

fn requests(n: u32, vocab: u32) -> Vec<GenerateRequest> {
    (0..n)
        .map(|i| GenerateRequest {
            prompt: Prompt::TokenIds(
                (0..3 + i * 5)
                    .map(|t| 3 + (t * 31 + i * 7) % (vocab - 3))
                    .collect(),
            ),
            params: SamplingParams {
                ignore_eos: true,
                ..SamplingParams::greedy(6 + (i as usize * 3) % 7)
            },
            grammar: None,
            routed_experts: Default::default(),
        })
        .collect()
}

fn with_moe(moe: MoeConfig) -> EngineConfig {
    EngineConfig {
        scheduler: SchedulerConfig {
            max_num_seqs: 8,
            max_num_batched_tokens: 64,
            ..Default::default()
        },
        moe,
        ..Default::default()
    }
}

fn expert_parallel(devices: usize, redundant: usize) -> MoeConfig {
    MoeConfig {
        expert_parallel_size: devices,
        num_redundant_experts: redundant,
        rebalance_interval: 0,
        ..Default::default()
    }
}

fn temp_path(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("moeserve-{}-{name}", std::process::id()))
}

#[test]
fn expert_parallel_batches_equal_solo_runs_on_every_fixture() {
    for case in FIXTURE_CASES {
        let assets = fixture(case);
        let reqs = requests(7, assets.model.config().vocab_size as u32);
        let alone: Vec<GenerateOutput> = reqs
            .iter()
            .map(|r| generate_one(assets.clone(), r.clone()).unwrap())
            .collect();
        for (devices, redundant) in [(1, 0), (1, 2), (2, 0), (2, 2), (4, 0), (4, 3)] {
            let (together, engine) = run_together(
                &assets,
                &reqs,
                with_moe(expert_parallel(devices, redundant)),
            );
            for (r, (a, b)) in alone.iter().zip(&together).enumerate() {
                let at = format!("{case}, EP {devices} + {redundant}, request {r}");
                assert_eq!(a.token_ids, b.token_ids, "{at}");
                assert_eq!(a.logprobs, b.logprobs, "{at}: logprobs are bit-identical");
                assert_eq!(b.moe, None, "{at}: dropless requests carry no counts");
            }
            let moe = engine.core().moe_stats();
            assert_eq!(moe.devices.len(), devices);
            let device_pairs: u64 = moe.devices.iter().map(|d| d.tokens).sum();
            assert_eq!(
                device_pairs,
                moe.total_pairs().0,
                "{case}: every pair ran on a device"
            );
            assert_eq!(
                moe.num_physical_experts,
                assets.model.config().num_local_experts + redundant
            );
        }
    }
}

#[test]
fn capacity_counts_reach_request_outputs_and_the_snapshot() {
    let assets = fixture("mixtral-swa");
    let c = assets.model.config();
    let reqs = requests(6, c.vocab_size as u32);
    for overflow in [
        OverflowPolicy::Drop,
        OverflowPolicy::Reroute,
        OverflowPolicy::Spill,
    ] {
        let moe = MoeConfig {
            capacity_factor: Some(1.0),
            moe_overflow: overflow,
            ..Default::default()
        };
        let (outputs, engine) = run_together(&assets, &reqs, with_moe(moe));
        let stats = engine.core().moe_stats();
        let (pairs, dropped, rerouted, spilled) = stats.total_pairs();
        let per_request = outputs
            .iter()
            .map(|o| o.moe.expect("a capacity factor is set"))
            .fold((0, 0, 0, 0), |t, m| {
                (
                    t.0 + m.pairs,
                    t.1 + m.dropped,
                    t.2 + m.rerouted,
                    t.3 + m.spilled,
                )
            });
        assert_eq!(
            per_request,
            (pairs, dropped, rerouted, spilled),
            "{overflow}"
        );
        let tokens = engine.core().stats().num_batched_tokens;
        assert_eq!(
            pairs,
            tokens * (c.num_experts_per_tok * c.num_moe_layers()) as u64
        );
        match overflow {
            OverflowPolicy::Drop => assert!(dropped > 0 && rerouted == 0 && spilled == 0),
            OverflowPolicy::Reroute => assert!(rerouted > 0 && spilled == 0),
            OverflowPolicy::Spill => assert!(spilled > 0 && dropped == 0),
        }
    }
}

/// A shared expert (Qwen2-MoE) computes every token of every sparse layer whatever the
/// capacity, and its tokens are counted apart from the routed pairs.
#[test]
fn shared_expert_tokens_are_counted_apart_from_the_pairs() {
    for (case, shared) in [("qwen2-moe", true), ("qwen3-moe", false)] {
        let assets = fixture(case);
        let c = assets.model.config();
        let reqs = requests(4, c.vocab_size as u32);
        let drop_most = MoeConfig {
            capacity_factor: Some(0.25),
            moe_overflow: OverflowPolicy::Drop,
            ..Default::default()
        };
        let (_, engine) = run_together(&assets, &reqs, with_moe(drop_most));
        let tokens = engine.core().stats().num_batched_tokens;
        let stats = engine.core().moe_stats();
        assert_eq!(stats.layers.len(), c.num_moe_layers(), "{case}");
        for (l, layer) in stats.layers.iter().enumerate() {
            assert_eq!(
                layer.pairs,
                tokens * c.num_experts_per_tok as u64,
                "{case} {l}"
            );
            assert!(layer.dropped > 0, "{case} layer {l}: α = 0.25 drops pairs");
            let want = if shared { tokens } else { 0 };
            assert_eq!(layer.shared_expert_tokens, want, "{case} layer {l}");
        }
    }
}

#[test]
fn routing_trace_records_every_step_and_layer() {
    let assets = fixture("mixtral-gqa");
    let path = temp_path("routing.jsonl");
    let moe = MoeConfig {
        record_routing: Some(path.clone()),
        ..Default::default()
    };
    let (_, engine) = run_together(&assets, &requests(4, 500), with_moe(moe));
    let records: Vec<_> = RoutingTraceReader::open(&path)
        .unwrap()
        .collect::<Result<_, _>>()
        .unwrap();
    std::fs::remove_file(&path).unwrap();
    let (stats, c) = (engine.core().stats(), assets.model.config());
    assert_eq!(
        records.len() as u64,
        stats.num_steps * c.num_moe_layers() as u64
    );
    let layer0_tokens: usize = records
        .iter()
        .filter(|r| r.layer == 0)
        .map(|r| r.num_tokens)
        .sum();
    assert_eq!(layer0_tokens as u64, stats.num_batched_tokens);
    assert!(
        records
            .iter()
            .all(|r| r.experts.iter().all(|e| e.len() == c.num_experts_per_tok))
    );
    assert_eq!(records.last().unwrap().step, stats.num_steps - 1);
}

#[test]
fn placement_files_are_used_and_mismatches_named() {
    let assets = fixture("mixtral-swa");
    let path = temp_path("placement.json");
    let placement = ExpertPlacement::round_robin(2, 8, 2, 2).unwrap();
    placement.write_json_file(&path).unwrap();
    let moe = MoeConfig {
        expert_placement: Some(path.clone()),
        ..expert_parallel(2, 2)
    };
    let engine = LlmEngine::new(assets.clone(), &with_moe(moe.clone())).unwrap();
    assert_eq!(engine.core().moe_stats().placement, Some(placement));
    let wrong = MoeConfig {
        expert_parallel_size: 4,
        ..moe
    };
    let err = LlmEngine::new(assets, &with_moe(wrong))
        .err()
        .unwrap()
        .to_string();
    std::fs::remove_file(&path).unwrap();
    assert!(
        err.contains(&path.display().to_string()) && err.contains("4"),
        "{err}"
    );
}

#[test]
fn uneven_slots_with_rebalancing_are_refused_at_start() {
    let moe = MoeConfig {
        rebalance_interval: 100,
        ..expert_parallel(4, 2)
    };
    let err = LlmEngine::new(fixture("mixtral-swa"), &with_moe(moe))
        .err()
        .unwrap()
        .to_string();
    assert!(
        err.contains("expert_parallel_size") && err.contains("10 slots"),
        "{err}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_handle_exposes_moe_snapshots() {
    let assets = fixture("mixtral-swa");
    let moe = MoeConfig {
        capacity_factor: Some(1.0),
        ..expert_parallel(2, 0)
    };
    let engine = Engine::start(assets, &with_moe(moe)).unwrap();
    let mut stream = engine.submit(requests(3, 500).remove(2)).await.unwrap();
    let output = loop {
        match stream.next().await.expect("the stream ends with Finished") {
            RequestEvent::Finished { output, .. } => break output,
            RequestEvent::Failed { error, .. } => panic!("{error}"),
            RequestEvent::Token { .. } => {}
        }
    };
    // The snapshot is published right after the step that finished the request.
    let want = output.moe.unwrap().pairs;
    let mut snapshot = engine.moe_snapshot();
    for _ in 0..500 {
        if snapshot.total_pairs().0 == want {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        snapshot = engine.moe_snapshot();
    }
    assert_eq!(snapshot.total_pairs().0, want);
    assert_eq!(snapshot.devices.len(), 2);
    assert!(snapshot.layers.iter().all(|l| l.cumulative_load.len() == 8));
}

/// The demo model through the engine: 2 and 4 device workers, with and without replicas,
/// give the same batch outputs as the default path.
#[test]
fn demo_model_outputs_are_equal_under_expert_parallelism() {
    let assets = Arc::new(ModelAssets::load(&demo_model_dir()).unwrap());
    let reqs: Vec<GenerateRequest> = [
        "What is the capital of France?",
        "Name a primary color.",
        "Say hello in Spanish.",
    ]
    .iter()
    .map(|q| GenerateRequest {
        prompt: Prompt::chat(vec![ChatMessage::new("user", *q)]),
        params: SamplingParams::greedy(8),
        grammar: None,
        routed_experts: Default::default(),
    })
    .collect();
    let (want, _) = run_together(&assets, &reqs, with_moe(MoeConfig::default()));
    for (devices, redundant) in [(2, 0), (2, 2), (4, 0), (4, 4)] {
        let (got, _) = run_together(
            &assets,
            &reqs,
            with_moe(expert_parallel(devices, redundant)),
        );
        for (r, (a, b)) in want.iter().zip(&got).enumerate() {
            assert_eq!(
                a.token_ids, b.token_ids,
                "EP {devices} + {redundant}, request {r}"
            );
            assert_eq!(
                a.logprobs, b.logprobs,
                "EP {devices} + {redundant}, request {r}"
            );
        }
    }
}
