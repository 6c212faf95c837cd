//! Expert visibility end to end: the MoE series of `/metrics` and `GET /v1/moe/load` agree with
//! drop counts recomputed here from the `--record-routing` trace (the router's top-k before
//! capacity) and the capacity rule `C = ceil(T·k/N·α)` with slots taken in token order; the
//! load report's shape under expert parallelism with replicas (and the same greedy text as
//! without); `usage.moe` only with a capacity factor; per-expert series only with
//! `--expert-metrics full`.

use moeserve_e2e::{
    Sample, Server, client, post_json, post_stream, scrape_until, send, tiny_model, tiny_model_path,
};
use serde_json::{Value, json};

/// Distinct prompts (no prefix-cache hits), sent one at a time so each step holds one request.
const PROMPTS: [&str; 4] = [
    "The quick brown fox jumps over the lazy dog",
    "Mixture of experts routes every token",
    "capacity factor one, overflow dropped",
    "zz",
];

/// What the capacity limit does to one layer, summed over steps.
#[derive(Clone, Debug, Default, PartialEq)]
struct LayerCounts {
    pairs: u64,
    dropped: u64,
    dropped_tokens: u64,
    /// `[num_experts]`: pairs kept per expert.
    kept: Vec<u64>,
}

/// `C = ceil(T·k/N·α)`, at least 1 with tokens (α = 1 here, so no rounding subtleties).
fn capacity(num_tokens: usize, top_k: usize, num_experts: usize, alpha: f64) -> u64 {
    let exact = (num_tokens * top_k) as f64 * alpha / num_experts as f64;
    (exact.ceil() as u64).max(1)
}

/// Replays the `drop` policy over every trace line.
fn recompute_drops(trace: &str, num_layers: usize, num_experts: usize) -> Vec<LayerCounts> {
    let mut layers = vec![
        LayerCounts {
            kept: vec![0; num_experts],
            ..LayerCounts::default()
        };
        num_layers
    ];
    for line in trace.lines().filter(|l| !l.trim().is_empty()) {
        let record: Value = serde_json::from_str(line).expect("trace line is JSON");
        let layer = record["layer"].as_u64().expect("layer") as usize;
        let tokens: Vec<Vec<usize>> = record["experts"]
            .as_array()
            .expect("experts")
            .iter()
            .map(|t| {
                t.as_array()
                    .expect("a token's experts")
                    .iter()
                    .map(|e| e.as_u64().expect("expert id") as usize)
                    .collect()
            })
            .collect();
        assert_eq!(tokens.len() as u64, record["num_tokens"].as_u64().unwrap());
        let top_k = tokens.first().map_or(0, Vec::len);
        let c = capacity(tokens.len(), top_k, num_experts, 1.0);
        let mut load = vec![0u64; num_experts];
        let counts = &mut layers[layer];
        for chosen in &tokens {
            let mut kept_any = false;
            for &e in chosen {
                counts.pairs += 1;
                if load[e] < c {
                    load[e] += 1;
                    kept_any = true;
                } else {
                    counts.dropped += 1;
                }
            }
            counts.dropped_tokens += u64::from(!kept_any);
        }
        counts.kept.iter_mut().zip(&load).for_each(|(k, l)| *k += l);
    }
    layers
}

fn labelled(samples: &[Sample], name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    samples
        .iter()
        .find(|s| {
            s.name == name
                && labels.iter().all(|(k, v)| {
                    s.labels
                        .iter()
                        .any(|(sk, sv)| (sk.as_str(), sv.as_str()) == (*k, *v))
                })
        })
        .map(|s| s.value)
}

async fn moe_load(server: &Server) -> Value {
    let r = send(client().get(server.url("/v1/moe/load"))).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

async fn greedy(server: &Server, prompt: &str) -> Value {
    let body = json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": true});
    let r = post_json(&server.url("/v1/completions"), &body).await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body
}

fn model_arg(dir: &tempfile::TempDir) -> String {
    tiny_model_path(dir)
        .to_str()
        .expect("UTF-8 path")
        .to_string()
}

#[tokio::test]
async fn drop_counts_match_a_replay_of_the_routing_trace() {
    let model = tiny_model(None);
    let trace_path = model.path().join("routing.jsonl");
    let trace_arg = trace_path.to_str().unwrap().to_string();
    let args = [
        "--model",
        &model_arg(&model),
        "--capacity-factor",
        "1.0",
        "--moe-overflow",
        "drop",
        "--record-routing",
        &trace_arg,
    ];
    let server = Server::start(&args).await;
    let mut usage_dropped = 0;
    let mut usage_routed = 0;
    for prompt in PROMPTS {
        let body = greedy(&server, prompt).await;
        let moe = &body["usage"]["moe"];
        usage_dropped += moe["dropped_pairs"]
            .as_u64()
            .expect("usage.moe.dropped_pairs");
        usage_routed += moe["routed_pairs"]
            .as_u64()
            .expect("usage.moe.routed_pairs");
        assert_eq!(moe["rerouted_pairs"], 0);
    }
    let load = moe_load(&server).await;
    let (num_layers, num_experts) = (
        load["num_layers"].as_u64().unwrap() as usize,
        load["num_experts"].as_u64().unwrap() as usize,
    );
    let trace = std::fs::read_to_string(&trace_path).expect("routing trace");
    let expected = recompute_drops(&trace, num_layers, num_experts);
    let total_pairs: u64 = expected.iter().map(|l| l.pairs).sum();
    let total_dropped: u64 = expected.iter().map(|l| l.dropped).sum();
    assert!(total_dropped > 0, "α = 1 should drop some prefill pairs");
    assert_eq!((usage_routed, usage_dropped), (total_pairs, total_dropped));

    let samples = scrape_until(&server.url("/metrics"), |s| {
        labelled(s, "moeserve:moe_pairs_total", &[("layer", "0")]) == Some(expected[0].pairs as f64)
    })
    .await;
    for (l, want) in expected.iter().enumerate() {
        let layer = l.to_string();
        let at = [("layer", layer.as_str()), ("model_name", "tiny")];
        let report = &load["layers"][l];
        for (series, field, value) in [
            ("moeserve:moe_pairs_total", "pairs", want.pairs),
            ("moeserve:moe_dropped_pairs_total", "dropped", want.dropped),
            ("moeserve:moe_rerouted_pairs_total", "rerouted", 0),
            (
                "moeserve:moe_dropped_tokens_total",
                "dropped_tokens",
                want.dropped_tokens,
            ),
        ] {
            assert_eq!(
                labelled(&samples, series, &at),
                Some(value as f64),
                "{series}{at:?}"
            );
            assert_eq!(report[field], value, "layers[{l}].{field}");
        }
        let kept: Vec<u64> = serde_json::from_value(report["cumulative_load"].clone()).unwrap();
        assert_eq!(kept, want.kept, "layer {l} per-expert load");
        for (e, &k) in want.kept.iter().enumerate() {
            let expert = e.to_string();
            let at = [("layer", layer.as_str()), ("expert", expert.as_str())];
            let series = "moeserve:moe_expert_tokens_total";
            assert_eq!(
                labelled(&samples, series, &at),
                Some(k as f64),
                "{series}{at:?}"
            );
        }
        assert!(labelled(&samples, "moeserve:moe_load_imbalance", &at).is_some());
    }
    let computed: u64 = expected.iter().map(|l| l.kept.iter().sum::<u64>()).sum();
    assert_eq!(
        labelled(
            &samples,
            "moeserve:moe_device_tokens_total",
            &[("device", "0")]
        ),
        Some(computed as f64)
    );
    assert_eq!(
        labelled(&samples, "moeserve:moe_rebalances_total", &[]),
        Some(0.0)
    );
    assert_eq!(load["model"], "tiny");
    assert!(load["num_steps"].as_u64().unwrap() > 0);
}

#[tokio::test]
async fn load_report_shows_placement_with_replicas_and_ep_keeps_greedy_text() {
    let model = tiny_model(None);
    let path = model_arg(&model);
    let ep = Server::start(&[
        "--model",
        &path,
        "--expert-parallel-size",
        "2",
        "--num-redundant-experts",
        "2",
    ])
    .await;
    let mut ep_texts = Vec::new();
    for prompt in PROMPTS {
        ep_texts.push(greedy(&ep, prompt).await["choices"][0]["text"].clone());
    }
    let load = moe_load(&ep).await;
    assert_eq!(load["object"], "moe.load");
    assert_eq!(load["expert_parallel_size"], 2);
    assert_eq!(load["num_physical_experts"], 10);
    let (layers, experts) = (load["num_layers"].as_u64().unwrap(), 8);
    assert_eq!(load["num_experts"], experts);
    assert_eq!(load["layers"].as_array().unwrap().len() as u64, layers);
    for layer in load["layers"].as_array().unwrap() {
        assert_eq!(layer["windowed_load"].as_array().unwrap().len(), 8);
        assert_eq!(layer["cumulative_load"].as_array().unwrap().len(), 8);
        assert!(layer["windowed_imbalance"].as_f64().unwrap() >= 1.0);
    }
    let placement = &load["placement"];
    assert_eq!(placement["num_devices"], 2);
    for layer in placement["layers"].as_array().unwrap() {
        assert_eq!(layer["physical_to_logical"].as_array().unwrap().len(), 10);
        let devices = layer["physical_to_device"].as_array().unwrap();
        assert!(devices.iter().any(|d| d == 0) && devices.iter().any(|d| d == 1));
    }
    let devices = load["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 2);
    let tokens: u64 = devices.iter().map(|d| d["tokens"].as_u64().unwrap()).sum();
    let pairs: u64 = load["layers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|l| l["pairs"].as_u64().unwrap())
        .sum();
    assert_eq!(
        tokens, pairs,
        "dropless: every routed pair is computed once"
    );
    assert!(
        devices
            .iter()
            .all(|d| d["experts_held"].as_u64().unwrap() > 0)
    );
    drop(ep);

    let single = Server::start(&["--model", &path]).await;
    for (prompt, ep_text) in PROMPTS.iter().zip(&ep_texts) {
        assert_eq!(
            &greedy(&single, prompt).await["choices"][0]["text"],
            ep_text
        );
    }
}

#[tokio::test]
async fn usage_moe_is_reported_with_a_capacity_factor_only() {
    let model = tiny_model(None);
    let path = model_arg(&model);
    let capped = Server::start(&["--model", &path, "--capacity-factor", "1.0"]).await;
    let plain = greedy(&capped, PROMPTS[0]).await;
    let moe = &plain["usage"]["moe"];
    // 6 tokens run = prompt + 5 fed-back tokens, each through top-2 of 2 layers.
    let tokens_run = plain["usage"]["prompt_tokens"].as_u64().unwrap() + 5;
    assert_eq!(moe["routed_pairs"], tokens_run * 2 * 2);
    for field in ["dropped_pairs", "rerouted_pairs", "spilled_pairs"] {
        assert!(moe[field].is_u64(), "usage.moe.{field}: {moe}");
    }
    let chat = post_json(
        &capped.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                "temperature": 0}),
    )
    .await;
    assert!(chat.body["usage"]["moe"]["routed_pairs"].as_u64().unwrap() > 0);
    let streamed = json!({"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0,
                          "stream": true, "stream_options": {"include_usage": true}});
    let chunks = post_stream(&capped.url("/v1/completions"), &streamed)
        .await
        .collect()
        .await;
    let usage = chunks
        .iter()
        .find_map(|c| c.get("usage").filter(|u| !u.is_null()))
        .expect("a usage chunk");
    assert!(
        usage["moe"]["routed_pairs"].as_u64().unwrap() > 0,
        "{usage}"
    );
    drop(capped);

    let dropless = Server::start(&["--model", &path]).await;
    let body = greedy(&dropless, PROMPTS[0]).await;
    assert!(body["usage"].get("moe").is_none(), "{}", body["usage"]);
}

#[tokio::test]
async fn expert_series_are_absent_with_expert_metrics_off() {
    let model = tiny_model(None);
    let args = ["--model", &model_arg(&model), "--expert-metrics", "off"];
    let server = Server::start(&args).await;
    greedy(&server, PROMPTS[2]).await;
    let samples = scrape_until(&server.url("/metrics"), |s| {
        labelled(s, "moeserve:moe_pairs_total", &[("layer", "1")]).is_some_and(|v| v > 0.0)
    })
    .await;
    assert!(labelled(&samples, "moeserve:moe_pairs_total", &[("layer", "1")]).unwrap() > 0.0);
    assert!(
        samples
            .iter()
            .all(|s| !s.name.starts_with("moeserve:moe_expert_")),
        "per-expert series with --expert-metrics off"
    );
    let load = moe_load(&server).await;
    assert_eq!(load["expert_metrics"], "off");
    assert_eq!(load["layers"][0]["cumulative_load"], json!([]));
}

#[tokio::test]
async fn the_load_report_needs_the_api_key() {
    let model = tiny_model(None);
    let args = ["--model", &model_arg(&model), "--api-key", "sekrit"];
    let server = Server::start(&args).await;
    let url = server.url("/v1/moe/load");
    assert_eq!(send(client().get(&url)).await.status, 401);
    let r = send(client().get(&url).bearer_auth("sekrit")).await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["top_k"], 2);
}
