//! The async engine handle: concurrent streams equal solo runs, cancellation frees blocks.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use moeserve_core::SamplingParams;
use moeserve_engine::assets::ModelAssets;
use moeserve_engine::engine_core::{EngineConfig, RequestEvent};
use moeserve_engine::handle::Engine;
use moeserve_engine::offline::generate_one;
use moeserve_engine::request::{GenerateRequest, Prompt};

fn assets() -> Arc<ModelAssets> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/mixtral-swa");
    Arc::new(ModelAssets::load(&dir).unwrap())
}

fn request(i: u32, max_tokens: usize) -> GenerateRequest {
    let prompt = (0..5 + i).map(|t| 3 + (t * 17 + i) % 500).collect();
    GenerateRequest {
        prompt: Prompt::TokenIds(prompt),
        params: SamplingParams {
            ignore_eos: true,
            ..SamplingParams::greedy(max_tokens)
        },
        grammar: None,
        routed_experts: Default::default(),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_streams_equal_solo_runs() {
    let assets = assets();
    let engine = Arc::new(Engine::start(assets.clone(), &EngineConfig::default()).unwrap());
    let tasks: Vec<_> = (0..8)
        .map(|i| {
            let engine = engine.clone();
            tokio::spawn(async move {
                let mut stream = engine.submit(request(i, 12)).await.unwrap();
                let mut streamed = Vec::new();
                while let Some(event) = stream.next().await {
                    match event {
                        RequestEvent::Token { sample, .. } => streamed.push(sample.token_id),
                        RequestEvent::Finished { output, .. } => {
                            return (streamed, output.token_ids);
                        }
                        RequestEvent::Failed { error, .. } => panic!("{error}"),
                    }
                }
                panic!("stream ended without Finished")
            })
        })
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let (streamed, finished) = task.await.unwrap();
        assert_eq!(streamed, finished);
        assert_eq!(
            finished,
            generate_one(assets.clone(), request(i as u32, 12))
                .unwrap()
                .token_ids
        );
    }
    assert_eq!(engine.stats().num_running, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_stream_cancels_its_request_and_frees_its_blocks() {
    let engine = Engine::start(assets(), &EngineConfig::default()).unwrap();
    let mut stream = engine.submit(request(1, 200)).await.unwrap();
    // Read a few tokens so the request is running and holds blocks, then walk away.
    for _ in 0..3 {
        assert!(matches!(
            stream.next().await,
            Some(RequestEvent::Token { .. })
        ));
    }
    drop(stream);
    // A second request keeps the loop stepping; the cancelled one is gone within a step.
    let mut other = engine.submit(request(2, 4)).await.unwrap();
    while let Some(event) = other.next().await {
        if matches!(event, RequestEvent::Finished { .. }) {
            break;
        }
    }
    tokio::time::sleep(Duration::from_millis(50)).await;
    let stats = engine.stats();
    assert_eq!((stats.num_running, stats.num_waiting), (0, 0));
    assert_eq!(stats.kv_cache_usage, 0.0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn refused_request_errors_at_submit_and_others_keep_running() {
    let engine = Engine::start(assets(), &EngineConfig::default()).unwrap();
    let too_long = GenerateRequest {
        prompt: Prompt::TokenIds(vec![5; 10]),
        params: SamplingParams::greedy(1_000_000),
        grammar: None,
        routed_experts: Default::default(),
    };
    let err = engine.submit(too_long).await.err().expect("refused");
    assert!(err.to_string().contains("maximum context length"), "{err}");
    let bad_token = GenerateRequest {
        prompt: Prompt::TokenIds(vec![999_999]),
        params: SamplingParams::greedy(2),
        grammar: None,
        routed_experts: Default::default(),
    };
    assert!(engine.submit(bad_token).await.is_err());
    let mut ok = engine.submit(request(3, 3)).await.unwrap();
    let mut finished = false;
    while let Some(event) = ok.next().await {
        finished |= matches!(event, RequestEvent::Finished { .. });
    }
    assert!(finished);
}
