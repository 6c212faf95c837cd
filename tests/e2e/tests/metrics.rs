//! `/metrics` end to end: every series (colons intact) with values that add up after traffic,
//! the `vllm:` copies under `--metrics-compat vllm`, and a client that disconnects mid-stream
//! has its request cancelled and its KV blocks freed.

use moeserve_e2e::{
    Sample, Server, SseData, engine_idle, metric_sum, post_json, post_stream, scrape, scrape_until,
    tiny_model, tiny_model_path,
};
use serde_json::json;

const GAUGES: [&str; 3] = [
    "moeserve:num_requests_running",
    "moeserve:num_requests_waiting",
    "moeserve:kv_cache_usage_perc",
];
const COUNTERS: [&str; 7] = [
    "moeserve:prefix_cache_queries_total",
    "moeserve:prefix_cache_hits_total",
    "moeserve:num_preemptions_total",
    "moeserve:prompt_tokens_total",
    "moeserve:generation_tokens_total",
    "moeserve:request_success_total",
    "moeserve:request_errors_total",
];
const HISTOGRAMS: [&str; 9] = [
    "moeserve:time_to_first_token_seconds",
    "moeserve:time_per_output_token_seconds",
    "moeserve:inter_token_latency_seconds",
    "moeserve:e2e_request_latency_seconds",
    "moeserve:request_queue_time_seconds",
    "moeserve:request_prefill_time_seconds",
    "moeserve:request_decode_time_seconds",
    "moeserve:request_prompt_tokens",
    "moeserve:request_generation_tokens",
];

fn value(samples: &[Sample], name: &str) -> f64 {
    metric_sum(samples, name).unwrap_or_else(|| panic!("{name} is missing"))
}

fn labelled(samples: &[Sample], name: &str, label: (&str, &str)) -> f64 {
    samples
        .iter()
        .filter(|s| s.name == name)
        .filter(|s| {
            s.labels
                .iter()
                .any(|(k, v)| (k.as_str(), v.as_str()) == label)
        })
        .map(|s| s.value)
        .sum()
}

#[tokio::test]
async fn every_series_is_listed_with_sane_values_after_traffic() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let completions = server.url("/v1/completions");
    let (mut prompt_tokens, mut generated, mut itl_gaps) = (0, 0, 0);
    for max_tokens in [4, 9] {
        let r = post_json(
            &completions,
            &json!({"prompt": "metrics", "max_tokens": max_tokens, "temperature": 0,
                    "ignore_eos": true}),
        )
        .await;
        prompt_tokens += r.body["usage"]["prompt_tokens"].as_u64().unwrap();
        generated += max_tokens;
        itl_gaps += max_tokens - 1;
    }
    let chunks = post_stream(
        &server.url("/v1/chat/completions"),
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6,
                "temperature": 0, "ignore_eos": true, "stream": true,
                "stream_options": {"include_usage": true}}),
    )
    .await
    .collect()
    .await;
    prompt_tokens += chunks.last().unwrap()["usage"]["prompt_tokens"]
        .as_u64()
        .unwrap();
    generated += 6;
    itl_gaps += 5;

    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    for name in GAUGES.iter().chain(&COUNTERS) {
        assert!(metric_sum(&samples, name).is_some(), "{name} is missing");
    }
    for name in HISTOGRAMS {
        assert_eq!(
            value(&samples, &format!("{name}_count")),
            match name {
                "moeserve:inter_token_latency_seconds" => itl_gaps as f64,
                _ => 3.0,
            },
            "{name}"
        );
        let inf = labelled(&samples, &format!("{name}_bucket"), ("le", "+Inf"));
        assert!(inf >= 3.0, "{name} has buckets");
    }
    for s in samples.iter().filter(|s| s.name.starts_with("moeserve:")) {
        assert!(
            s.labels
                .contains(&("model_name".to_string(), "tiny".to_string())),
            "{s:?}"
        );
        assert!(s.value.is_finite() && s.value >= 0.0, "{s:?}");
    }
    assert_eq!(value(&samples, "moeserve:num_requests_running"), 0.0);
    assert_eq!(value(&samples, "moeserve:num_requests_waiting"), 0.0);
    assert_eq!(value(&samples, "moeserve:kv_cache_usage_perc"), 0.0);
    assert_eq!(
        value(&samples, "moeserve:prompt_tokens_total"),
        prompt_tokens as f64
    );
    assert_eq!(
        value(&samples, "moeserve:generation_tokens_total"),
        generated as f64
    );
    assert_eq!(value(&samples, "moeserve:num_preemptions_total"), 0.0);
    let success = "moeserve:request_success_total";
    assert_eq!(
        labelled(&samples, success, ("finished_reason", "length")),
        3.0
    );
    assert_eq!(
        labelled(&samples, success, ("finished_reason", "stop")),
        0.0
    );
    let queries = value(&samples, "moeserve:prefix_cache_queries_total");
    assert!(queries >= value(&samples, "moeserve:prefix_cache_hits_total"));
    assert!(queries > 0.0);
    assert_eq!(
        value(&samples, "moeserve:request_generation_tokens_sum"),
        generated as f64
    );
    assert_eq!(
        value(&samples, "moeserve:request_prompt_tokens_sum"),
        prompt_tokens as f64
    );
    assert!(value(&samples, "moeserve:e2e_request_latency_seconds_sum") > 0.0);
}

#[tokio::test]
async fn vllm_compat_exports_the_same_series_under_vllm_names() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--metrics-compat",
        "vllm",
    ])
    .await;
    let r = post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "compat", "max_tokens": 3, "ignore_eos": true}),
    )
    .await;
    assert_eq!(r.status, 200);
    let samples = scrape(&server.url("/metrics")).await;
    let histogram_counts = HISTOGRAMS.map(|h| format!("{h}_count"));
    for name in GAUGES
        .iter()
        .chain(&COUNTERS)
        .map(|n| n.to_string())
        .chain(histogram_counts)
    {
        let vllm = name.replacen("moeserve:", "vllm:", 1);
        assert_eq!(value(&samples, &vllm), value(&samples, &name), "{vllm}");
    }
    assert_eq!(
        value(&samples, "vllm:gpu_cache_usage_perc"),
        value(&samples, "vllm:kv_cache_usage_perc")
    );
}

#[tokio::test]
async fn a_client_that_disconnects_mid_stream_frees_its_blocks() {
    let model = tiny_model(Some(32768));
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let max_tokens = 30000;
    let mut reader = post_stream(
        &server.url("/v1/completions"),
        &json!({"prompt": "a long one", "max_tokens": max_tokens, "ignore_eos": true,
                "stream": true}),
    )
    .await;
    for _ in 0..3 {
        assert!(matches!(reader.next().await, Some(SseData::Json(_))));
    }
    let samples = scrape(&server.url("/metrics")).await;
    assert_eq!(value(&samples, "moeserve:num_requests_running"), 1.0);
    assert!(value(&samples, "moeserve:kv_cache_usage_perc") > 0.0);
    // Walk away: dropping the response closes the connection.
    drop(reader);
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    assert_eq!(value(&samples, "moeserve:num_requests_running"), 0.0);
    assert_eq!(value(&samples, "moeserve:kv_cache_usage_perc"), 0.0);
    // Cancelled, not finished: counted as an abort by a client that went away, with the time
    // it had run; far fewer tokens than asked for.
    let success = "moeserve:request_success_total";
    assert_eq!(
        labelled(&samples, success, ("finished_reason", "length")),
        0.0
    );
    assert_eq!(
        labelled(&samples, success, ("finished_reason", "abort")),
        1.0
    );
    let errors = "moeserve:request_errors_total";
    assert_eq!(
        labelled(&samples, errors, ("cause", "client_disconnect")),
        1.0
    );
    assert_eq!(value(&samples, errors), 1.0);
    assert_eq!(
        value(&samples, "moeserve:e2e_request_latency_seconds_count"),
        1.0
    );
    assert_eq!(
        value(&samples, "moeserve:time_to_first_token_seconds_count"),
        1.0
    );
    let generated = value(&samples, "moeserve:generation_tokens_total");
    assert!(
        generated < f64::from(max_tokens) / 2.0,
        "{generated} tokens"
    );
}

/// A request that ends early is counted whatever its end: here a `--request-timeout` (504).
#[tokio::test]
async fn a_timed_out_request_is_counted_as_an_abort_by_cause() {
    let model = tiny_model(Some(32768));
    let server = Server::start(&[
        "--model",
        tiny_model_path(&model).to_str().unwrap(),
        "--request-timeout",
        "0.3",
    ])
    .await;
    let long = json!({"prompt": "a long one", "max_tokens": 30000, "ignore_eos": true});
    let r = post_json(&server.url("/v1/completions"), &long).await;
    assert_eq!(r.status, 504, "{}", r.body);
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    let success = "moeserve:request_success_total";
    assert_eq!(
        labelled(&samples, success, ("finished_reason", "abort")),
        1.0
    );
    let errors = "moeserve:request_errors_total";
    assert_eq!(labelled(&samples, errors, ("cause", "timeout")), 1.0);
    // Its end-to-end time is at least the timeout.
    assert!(value(&samples, "moeserve:e2e_request_latency_seconds_sum") >= 0.3);
    assert_eq!(
        value(&samples, "moeserve:time_to_first_token_seconds_count"),
        1.0
    );
}

/// Requests the server refuses are counted too (`cause="rejected"`): a full queue (429), a
/// prompt too long for the context (400, found by the tokenizer or from its bytes alone).
#[tokio::test]
async fn refused_requests_are_counted_as_rejected() {
    let model = tiny_model(Some(32768));
    let server = Server::start(&[
        "--model",
        tiny_model_path(&model).to_str().unwrap(),
        "--max-model-len",
        "1024",
        "--max-num-seqs",
        "1",
        "--max-waiting-requests",
        "1",
    ])
    .await;
    let url = server.url("/v1/completions");
    let long = json!({"prompt": "run", "max_tokens": 1000, "ignore_eos": true, "stream": true});
    let mut running = post_stream(&url, &long).await;
    assert!(matches!(running.next().await, Some(SseData::Json(_))));
    let waiting = post_stream(&url, &long).await;
    let full = post_json(&url, &json!({"prompt": "x", "max_tokens": 1})).await;
    assert_eq!(full.status, 429, "{}", full.body);
    drop(running);
    drop(waiting);
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    let errors = "moeserve:request_errors_total";
    assert_eq!(labelled(&samples, errors, ("cause", "rejected")), 1.0);
    for prompt in ["y".repeat(1100), "z".repeat(100_000)] {
        let r = post_json(&url, &json!({"prompt": prompt, "max_tokens": 1})).await;
        assert_eq!(r.status, 400, "{}", r.body);
    }
    let samples = scrape(&server.url("/metrics")).await;
    assert_eq!(labelled(&samples, errors, ("cause", "rejected")), 3.0);
}
