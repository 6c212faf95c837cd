//! Faults, end to end: a request whose logits turn NaN fails alone with a 500 and a message
//! while the others run on unharmed, and a corrupted checkpoint stops start-up with a message
//! naming the file and what is wrong.
//!
//! The NaN comes from a real checkpoint, not a test hook: `mixtral-tiny` with one embedding row
//! set to NaN, so any prompt holding that token produces NaN logits. That token's `lm_head` row
//! is zeroed, so greedy decoding never picks it for other prompts (its logit is 0, below the
//! largest of 511 random ones).

use std::path::Path;
use std::time::Duration;

use moeserve_e2e::{
    Server, engine_idle, post_json, post_stream, run_to_exit, scrape_until, tiny_model,
    tiny_model_path,
};
use serde_json::{Value, json};

/// The token whose embedding is NaN.
const POISON: usize = 300;

/// Overwrites row `row` of a bf16 matrix `name` in `dir/model.safetensors` with `value`.
fn set_bf16_row(dir: &Path, name: &str, row: usize, value: [u8; 2]) {
    let path = dir.join("model.safetensors");
    let mut bytes = std::fs::read(&path).expect("read checkpoint");
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + header_len]).expect("header JSON");
    let tensor = &header[name];
    assert_eq!(tensor["dtype"], "BF16", "{tensor}");
    let cols = tensor["shape"][1].as_u64().unwrap() as usize;
    let start = 8 + header_len + tensor["data_offsets"][0].as_u64().unwrap() as usize;
    let row_start = start + row * cols * 2;
    for element in bytes[row_start..row_start + cols * 2].chunks_mut(2) {
        element.copy_from_slice(&value);
    }
    std::fs::write(&path, bytes).expect("write checkpoint");
}

fn poisoned_model() -> tempfile::TempDir {
    let model = tiny_model(Some(4096));
    let dir = tiny_model_path(&model);
    const BF16_NAN: [u8; 2] = 0x7fc0u16.to_le_bytes();
    set_bf16_row(&dir, "model.embed_tokens.weight", POISON, BF16_NAN);
    set_bf16_row(&dir, "lm_head.weight", POISON, [0, 0]);
    model
}

fn greedy(prompt: Value, max_tokens: usize) -> Value {
    json!({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn nan_logits_fail_only_their_own_request_with_a_500() {
    let model = poisoned_model();
    let path = tiny_model_path(&model);
    let server = Server::start(&[
        "--model",
        path.to_str().unwrap(),
        "--kv-cache-memory",
        "64MiB",
    ])
    .await;
    let url = server.url("/v1/completions");
    let good = greedy(json!([5, 6, 7, 8]), 24);
    let before = post_json(&url, &good).await;
    assert_eq!(before.status, 200, "{}", before.body);
    let expected = before.body["choices"][0]["text"].clone();

    // A long good request streams while poisoned ones fail next to it in the same batches.
    let mut long = greedy(json!([9, 10, 11]), 400);
    long["stream"] = json!(true);
    let long_alone = {
        let mut body = long.clone();
        body["stream"] = json!(false);
        post_json(&url, &body).await.body["choices"][0]["text"].clone()
    };
    let running = tokio::spawn({
        let url = url.clone();
        async move { post_stream(&url, &long).await.collect().await }
    });
    for prompt in [
        json!([POISON]),
        json!([5, POISON, 7]),
        json!([1, 2, 3, POISON]),
    ] {
        let r = post_json(&url, &greedy(prompt.clone(), 8)).await;
        assert_eq!(r.status, 500, "{prompt}: {}", r.body);
        let message = r.error_message();
        assert!(message.contains("NaN"), "{message}");
        assert_eq!(r.error()["type"], "internal_error");
    }
    // Streamed, the failure is the last chunk before [DONE].
    let mut body = greedy(json!([POISON, 4]), 8);
    body["stream"] = json!(true);
    let chunks = post_stream(&url, &body).await.collect().await;
    let last = chunks.last().expect("chunks");
    assert!(
        last["error"]["message"].as_str().unwrap().contains("NaN"),
        "{last}"
    );

    let chunks = running.await.expect("long request");
    let text: String = chunks
        .iter()
        .filter_map(|c| c["choices"][0]["text"].as_str())
        .collect();
    assert_eq!(
        Value::from(text),
        long_alone,
        "the long request was disturbed"
    );
    let after = post_json(&url, &good).await;
    assert_eq!(after.status, 200, "{}", after.body);
    assert_eq!(after.body["choices"][0]["text"], expected);
    let samples = scrape_until(&server.url("/metrics"), engine_idle).await;
    assert!(engine_idle(&samples), "blocks left behind: {samples:?}");
    assert!(server.logs().contains("ready"));
}

/// Starts `serve` on a broken model directory and returns its log (it must exit non-zero).
fn start_up_failure(dir: &Path) -> String {
    let (status, log) = run_to_exit(
        &["serve", "--model", dir.to_str().unwrap(), "--port", "0"],
        Duration::from_secs(60),
    );
    assert!(!status.success(), "started on a broken checkpoint:\n{log}");
    assert!(log.contains("error:"), "{log}");
    log
}

#[tokio::test]
async fn a_corrupted_checkpoint_fails_start_up_with_a_clear_message() {
    let model = tiny_model(None);
    let dir = tiny_model_path(&model);
    let weights = dir.join("model.safetensors");
    let good = std::fs::read(&weights).unwrap();

    // Cut short: the data the header promises is not there.
    std::fs::write(&weights, &good[..good.len() / 2]).unwrap();
    let log = start_up_failure(&dir);
    assert!(log.contains("model.safetensors"), "{log}");

    // A header length pointing past the end of the file.
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&u64::MAX.to_le_bytes());
    std::fs::write(&weights, &bad).unwrap();
    let log = start_up_failure(&dir);
    assert!(log.contains("model.safetensors"), "{log}");

    // Garbage instead of the JSON header.
    let mut bad = good.clone();
    for b in &mut bad[8..40] {
        *b = b'#';
    }
    std::fs::write(&weights, &bad).unwrap();
    let log = start_up_failure(&dir);
    assert!(log.contains("model.safetensors"), "{log}");

    // An empty file.
    std::fs::write(&weights, b"").unwrap();
    let log = start_up_failure(&dir);
    assert!(log.contains("model.safetensors"), "{log}");

    // A config.json that is not JSON: refused before listening.
    std::fs::write(&weights, &good).unwrap();
    let config = dir.join("config.json");
    let config_text = std::fs::read_to_string(&config).unwrap();
    std::fs::write(&config, &config_text[..config_text.len() / 2]).unwrap();
    let log = start_up_failure(&dir);
    assert!(log.contains("config.json"), "{log}");
    assert!(!log.contains("listening on"), "{log}");

    // A tensor missing from an otherwise valid checkpoint names the tensor.
    std::fs::write(&config, &config_text).unwrap();
    let header_len = u64::from_le_bytes(good[..8].try_into().unwrap()) as usize;
    let header = String::from_utf8(good[8..8 + header_len].to_vec()).unwrap();
    let renamed = header.replacen("lm_head.weight", "lm_hexd.weight", 1);
    let mut bad = good.clone();
    bad[8..8 + header_len].copy_from_slice(renamed.as_bytes());
    std::fs::write(&weights, &bad).unwrap();
    let log = start_up_failure(&dir);
    assert!(log.contains("lm_head.weight"), "{log}");

    // Restored, it serves.
    std::fs::write(&weights, &good).unwrap();
    let server = Server::start(&["--model", dir.to_str().unwrap()]).await;
    let ok = post_json(
        &server.url("/v1/completions"),
        &json!({"prompt": "x", "max_tokens": 1}),
    )
    .await;
    assert_eq!(ok.status, 200);
}

/// A panic inside the engine (here the test hook `MOESERVE_TEST_PANIC_AT_STEP`) is never
/// reported as health: the request in flight ends with a 500 saying the engine failed, new
/// requests and `/health` get 503, the panic message is logged, and the process exits non-zero
/// so a supervisor restarts it.
#[tokio::test]
async fn a_dead_engine_is_unhealthy_fails_its_requests_and_exits_non_zero() {
    let model = tiny_model(None);
    let path = tiny_model_path(&model);
    let mut server = Server::start_with_env(
        &["--model", path.to_str().unwrap()],
        &[("MOESERVE_TEST_PANIC_AT_STEP", "3")],
    )
    .await;
    let completions = server.url("/v1/completions");
    let body = json!({"prompt": "hello", "max_tokens": 20, "ignore_eos": true});
    let failed = post_json(&completions, &body).await;
    assert_eq!(failed.status, 500, "{}", failed.body);
    assert!(
        failed.error_message().contains("the engine failed"),
        "{}",
        failed.body
    );
    let health = moeserve_e2e::status_of(moeserve_e2e::client().get(server.url("/health"))).await;
    assert_eq!(health, 503);
    let refused = post_json(&completions, &body).await;
    assert_eq!(refused.status, 503, "{}", refused.body);
    assert_eq!(refused.error()["code"], "engine_failed");
    let status = server
        .wait_exit(Duration::from_secs(30))
        .expect("the server exits after its engine died");
    assert!(!status.success(), "{status}");
    let log = server.logs();
    assert!(log.contains("asked the engine to panic"), "{log}");
    assert!(log.contains("the engine failed"), "{log}");
}

/// `make-model` writes under a temporary name and renames the directory into place at the end:
/// killed half way, it leaves nothing under the name asked for that `serve` would load (it used
/// to leave half the shards and, depending on where it stopped, a config.json beside them).
#[tokio::test]
async fn a_killed_make_model_leaves_no_model_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("big");
    // mixtral-bench-1b is 3.1 GB of bf16: many seconds of writing.
    let mut child = std::process::Command::new(moeserve_e2e::moeserve_bin())
        .args(["make-model", "--preset", "mixtral-bench-1b", "--out"])
        .arg(&out)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let staging = tmp.path().join(".big.partial");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !staging.exists() && std::time::Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    // Well into the writing of the 3.1 GB.
    std::thread::sleep(Duration::from_millis(1500));
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(staging.exists(), "the run was killed while writing");
    assert!(!out.exists(), "a killed run left {}", out.display());
    let (status, log) = run_to_exit(
        &["serve", "--model", out.to_str().unwrap(), "--port", "0"],
        Duration::from_secs(60),
    );
    assert!(!status.success(), "{log}");
    std::fs::remove_dir_all(&staging).unwrap();
}
