//! 64 streaming clients at once, batched by the engine, get exactly what each gets alone
//! (greedy decoding is batch-invariant).

use moeserve_e2e::{
    Server, client, engine_idle, post_json, post_stream, scrape_until, tiny_model, tiny_model_path,
};
use serde_json::{Value, json};

const NUM_CLIENTS: usize = 64;

fn request(i: usize) -> Value {
    // Distinct prompts of different lengths, some sharing a prefix (prefix caching in play).
    let prompt = format!("client {} says {}", i % 7, "hello ".repeat(1 + i % 5));
    json!({"prompt": prompt, "max_tokens": 24 + i % 9, "temperature": 0, "ignore_eos": true,
           "logprobs": 0})
}

/// Text, token strings and finish reason of a streamed completion.
async fn streamed(url: String, body: Value) -> (String, Vec<String>, String) {
    let mut body = body;
    body["stream"] = json!(true);
    let chunks = post_stream(&url, &body).await.collect().await;
    let (mut text, mut tokens, mut finish) = (String::new(), Vec::new(), String::new());
    for chunk in chunks {
        let choice = &chunk["choices"][0];
        text.push_str(choice["text"].as_str().unwrap());
        for t in choice["logprobs"]["tokens"].as_array().unwrap() {
            tokens.push(t.as_str().unwrap().to_string());
        }
        if let Some(reason) = choice["finish_reason"].as_str() {
            finish = reason.to_string();
        }
    }
    (text, tokens, finish)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sixty_four_streaming_clients_equal_single_requests() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let url = server.url("/v1/completions");
    let mut alone = Vec::new();
    for i in 0..NUM_CLIENTS {
        let r = post_json(&url, &request(i)).await;
        assert_eq!(r.status, 200, "{}", r.body);
        let choice = &r.body["choices"][0];
        let tokens: Vec<String> = choice["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_str().unwrap().to_string())
            .collect();
        alone.push((
            choice["text"].as_str().unwrap().to_string(),
            tokens,
            choice["finish_reason"].as_str().unwrap().to_string(),
        ));
    }
    let tasks: Vec<_> = (0..NUM_CLIENTS)
        .map(|i| tokio::spawn(streamed(url.clone(), request(i))))
        .collect();
    for (i, task) in tasks.into_iter().enumerate() {
        let together = task.await.expect("client task");
        assert_eq!(together, alone[i], "client {i}");
    }
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    assert!(engine_idle(&samples), "{samples:?}");
}

/// Rendering and tokenizing run on the blocking pool, a bounded number at a time: while 16
/// clients post 1 MiB prompts (each refused as too long only once tokenized: a context of
/// 128 Ki tokens is more than the byte bound can rule out for a megabyte of this tokenizer's
/// text, at most 12 bytes a token), `/health` keeps
/// answering within 100 ms (p99 of one poll every 20 ms; the p50 and p99 are printed for
/// bench/RESULTS.md). Before, the runtime's two workers tokenized and `/health` waited.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn health_answers_promptly_while_large_prompts_are_tokenized() {
    let model = tiny_model(Some(128 << 10));
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--max-request-bytes",
        "2MiB",
        "--max-waiting-requests",
        "64",
    ])
    .await;
    let url = server.url("/v1/completions");
    let prompt = "the quick brown fox ".repeat(1 << 20 >> 4 >> 1);
    assert!(prompt.len() >= 1 << 19);
    let body = json!({"prompt": format!("{prompt}{prompt}"), "max_tokens": 1});
    let posts: Vec<_> = (0..16)
        .map(|_| {
            let (url, body) = (url.clone(), body.clone());
            tokio::spawn(async move { post_json(&url, &body).await.status })
        })
        .collect();
    let health = server.url("/health");
    let c = client();
    let mut latencies = Vec::new();
    while !posts.iter().all(|p| p.is_finished()) {
        let started = std::time::Instant::now();
        let status = c.get(&health).send().await.unwrap().status().as_u16();
        latencies.push(started.elapsed().as_secs_f64() * 1e3);
        assert_eq!(status, 200);
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
    for post in posts {
        assert_eq!(
            post.await.unwrap(),
            400,
            "a 1 MiB prompt is over the context"
        );
    }
    latencies.sort_by(f64::total_cmp);
    let at = |q: f64| latencies[((latencies.len() - 1) as f64 * q).round() as usize];
    eprintln!(
        "/health under 16 × 1 MiB prompts: {} polls, p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
        latencies.len(),
        at(0.5),
        at(0.99),
        at(1.0)
    );
    assert!(
        latencies.len() >= 5,
        "the prompts were tokenized too fast to measure"
    );
    assert!(at(0.99) < 100.0, "{latencies:?}");
}
