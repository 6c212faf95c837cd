//! `moeserve bench serve` against the real server (tiny model, small numbers): the result JSON
//! has every level with consistent counts and monotone percentiles, the SVG is well-formed XML
//! with the chart's elements, and `moeserve plan` and `moeserve bench plot` read the result back.

use std::path::Path;
use std::process::Output;
use std::time::Duration;

use moeserve_e2e::{Server, run_with_output, tiny_model, tiny_model_path};
use serde_json::Value;

const PROMPTS_PER_LEVEL: u64 = 4;
const PROMPT_LEN: u64 = 16;
const OUTPUT_LEN: u64 = 8;

fn moeserve(args: &[&str], timeout: Duration) -> Output {
    run_with_output(args, timeout)
}

fn text(output: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn number(v: &Value, field: &str) -> f64 {
    v[field]
        .as_f64()
        .unwrap_or_else(|| panic!("{field} is not a number in {v}"))
}

fn check_summary(level: &Value, name: &str) {
    let s = &level[name];
    let (p50, p90, p99, max) = (
        number(s, "p50"),
        number(s, "p90"),
        number(s, "p99"),
        number(s, "max"),
    );
    assert!(
        0.0 <= p50 && p50 <= p90 && p90 <= p99 && p99 <= max,
        "{name} percentiles are not monotone: {s}"
    );
    assert!(number(s, "mean") >= 0.0 && number(s, "mean") <= max, "{s}");
}

fn check_result(result: &Value) {
    assert!(
        result["tool"]
            .as_str()
            .unwrap()
            .starts_with("moeserve bench serve")
    );
    assert!(result["date"].as_str().unwrap().ends_with('Z'));
    assert_eq!(result["setup"]["model"], "tiny");
    assert_eq!(number(&result["setup"], "prompt_len"), PROMPT_LEN as f64);
    assert_eq!(number(&result["setup"], "output_len"), OUTPUT_LEN as f64);
    let levels = result["levels"].as_array().expect("levels");
    let concurrency: Vec<u64> = levels
        .iter()
        .map(|l| l["concurrency"].as_u64().unwrap())
        .collect();
    assert_eq!(concurrency, [1, 2]);
    for level in levels {
        assert_eq!(level["num_requests"], PROMPTS_PER_LEVEL, "{level}");
        assert_eq!(level["completed"], PROMPTS_PER_LEVEL, "{level}");
        assert_eq!(level["failed"], 0, "{level}");
        // Prompts of exactly PROMPT_LEN token ids; ignore_eos gives exactly OUTPUT_LEN tokens.
        assert_eq!(level["total_input_tokens"], PROMPTS_PER_LEVEL * PROMPT_LEN);
        assert_eq!(level["total_output_tokens"], PROMPTS_PER_LEVEL * OUTPUT_LEN);
        let duration = number(level, "duration_s");
        assert!(duration > 0.0);
        let expected = (PROMPTS_PER_LEVEL * OUTPUT_LEN) as f64 / duration;
        assert!((number(level, "output_throughput") - expected).abs() < 1e-6 * expected);
        for name in ["ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"] {
            check_summary(level, name);
        }
        assert_eq!(level["ttft_ms"]["count"], PROMPTS_PER_LEVEL);
        assert_eq!(level["tpot_ms"]["count"], PROMPTS_PER_LEVEL);
        // TTFT ≤ e2e for every request, so for the medians too.
        assert!(number(&level["ttft_ms"], "p50") <= number(&level["e2e_ms"], "p50"));
        let law = &level["littles_law"];
        let (lambda, w) = (
            number(law, "arrival_rate"),
            number(law, "mean_time_in_system_s"),
        );
        assert!((lambda - PROMPTS_PER_LEVEL as f64 / duration).abs() < 1e-9);
        assert!((number(law, "lambda_w") - lambda * w).abs() < 1e-9);
        // Never more in flight than the concurrency, in the sample or on average.
        let l = number(law, "measured_mean_concurrency");
        let c = level["concurrency"].as_f64().unwrap();
        assert!(l > 0.0 && l <= c, "{law}");
        assert!(number(law, "lambda_w") <= c + 1e-9, "{law}");
    }
}

fn check_svg(path: &Path, num_series: usize) {
    let svg = std::fs::read_to_string(path).expect("read the SVG");
    let doc = roxmltree::Document::parse(&svg).expect("the SVG is well-formed XML");
    let root = doc.root_element();
    assert_eq!(root.tag_name().name(), "svg");
    assert_eq!(
        root.tag_name().namespace(),
        Some("http://www.w3.org/2000/svg")
    );
    let count = |name: &str| doc.descendants().filter(|n| n.has_tag_name(name)).count();
    // Two panels (TPOT, TTFT) × series × (p50 + p99) lines; one point per level and panel.
    assert_eq!(count("polyline"), 2 * num_series * 2, "{svg}");
    assert_eq!(count("circle"), 2 * num_series * 2, "{svg}");
    let labels: Vec<&str> = doc
        .descendants()
        .filter(|n| n.has_tag_name("text"))
        .filter_map(|n| n.text())
        .collect();
    for label in ["TPOT (ms)", "TTFT (ms)", "output tokens/s"] {
        assert!(labels.contains(&label), "missing {label:?} in {labels:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_writes_a_valid_result_and_plot_that_plan_reads() {
    let model = tiny_model(None);
    let model_dir = tiny_model_path(&model);
    let server = Server::start(&["--model", model_dir.to_str().unwrap()]).await;
    let out = tempfile::tempdir().expect("temp dir");
    let (json, svg) = (out.path().join("r.json"), out.path().join("r.svg"));
    let url = server.url("");
    let args: Vec<String> = [
        "bench",
        "serve",
        "--url",
        &url,
        "--model",
        "tiny",
        "--concurrency",
        "1,2",
        "--num-prompts",
        "4",
        "--prompt-len",
        "16",
        "--output-len",
        "8",
        "--vocab-size",
        "512",
        "--out",
        json.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]
    .map(String::from)
    .to_vec();
    let run = tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        moeserve(&args, Duration::from_secs(120))
    });
    let output = run.await.expect("bench task");
    assert!(output.status.success(), "{}", text(&output));
    // The terminal table has a row per level.
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("TPOT p50"), "{}", text(&output));
    let result: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    check_result(&result);
    check_svg(&svg, 1);

    // With --stream-logprobs every token arrives in its own chunk: OUTPUT_LEN − 1 gaps each.
    let logprobs_json = out.path().join("logprobs.json");
    let output = moeserve(
        &[
            "bench",
            "serve",
            "--url",
            &server.url(""),
            "--model",
            "tiny",
            "--concurrency",
            "2",
            "--num-prompts",
            "2",
            "--prompt-len",
            "16",
            "--output-len",
            "8",
            "--vocab-size",
            "512",
            "--stream-logprobs",
            "--out",
            logprobs_json.to_str().unwrap(),
        ],
        Duration::from_secs(120),
    );
    assert!(output.status.success(), "{}", text(&output));
    let result: Value =
        serde_json::from_str(&std::fs::read_to_string(&logprobs_json).unwrap()).unwrap();
    assert_eq!(result["levels"][0]["itl_ms"]["count"], 2 * (OUTPUT_LEN - 1));

    // The planner reads the result: a generous target is met by every level measured.
    let output = moeserve(
        &[
            "plan",
            "--from",
            json.to_str().unwrap(),
            "--target-tpot",
            "10s",
            "--arrival-rate",
            "5",
            "--model",
            model_dir.to_str().unwrap(),
            "--kv-cache-memory",
            "64MiB",
        ],
        Duration::from_secs(30),
    );
    assert!(output.status.success(), "{}", text(&output));
    let plan = String::from_utf8_lossy(&output.stdout);
    assert!(
        plan.contains("max batch B = 2 (limited by measured_range)"),
        "{plan}"
    );
    assert!(plan.contains("--max-num-seqs 2"), "{plan}");
    assert!(plan.contains("--kv-cache-memory"), "{plan}");
    // A multi-head latent attention model's KV bytes are its latent row's: the DeepSeek-V2-Lite
    // fixture's 3 layers × (32 + 16) f32 values, not its 4 heads' keys and values.
    let deepseek = moeserve_e2e::repo_root().join("tests/fixtures/deepseek-v2-lite");
    let output = moeserve(
        &[
            "plan",
            "--from",
            json.to_str().unwrap(),
            "--target-tpot",
            "10s",
            "--model",
            deepseek.to_str().unwrap(),
        ],
        Duration::from_secs(30),
    );
    assert!(output.status.success(), "{}", text(&output));
    let plan = String::from_utf8_lossy(&output.stdout);
    assert!(
        plan.contains("KV cache: 576 bytes per token (latent 32 + rope 16 values per layer)"),
        "{plan}"
    );
    // An impossible target is an error that names the measured figure.
    let output = moeserve(
        &[
            "plan",
            "--from",
            json.to_str().unwrap(),
            "--target-tpot",
            "0.000001ms",
        ],
        Duration::from_secs(30),
    );
    assert!(!output.status.success());
    assert!(
        text(&output).contains("no batch meets them"),
        "{}",
        text(&output)
    );

    // Two results on one chart.
    let both = out.path().join("both.svg");
    let output = moeserve(
        &[
            "bench",
            "plot",
            &format!("first={}", json.display()),
            &format!("second={}", json.display()),
            "--out",
            both.to_str().unwrap(),
        ],
        Duration::from_secs(30),
    );
    assert!(output.status.success(), "{}", text(&output));
    check_svg(&both, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_serve_reports_failed_requests_and_exits_non_zero() {
    let model = tiny_model(None);
    let server = Server::start(&["--model", tiny_model_path(&model).to_str().unwrap()]).await;
    let url = server.url("");
    let out = tempfile::tempdir().expect("temp dir");
    let (json, dataset) = (out.path().join("r.json"), out.path().join("d.jsonl"));
    // The first line is fine (the test request uses it); the second names a token id beyond
    // the tiny model's 512-token vocabulary, which the server refuses.
    std::fs::write(
        &dataset,
        "{\"prompt\": \"hello\"}\n{\"prompt\": [100000]}\n",
    )
    .unwrap();
    let args = |model: &str| {
        vec![
            "bench".to_string(),
            "serve".into(),
            "--url".into(),
            url.clone(),
            "--model".into(),
            model.into(),
            "--concurrency".into(),
            "1".into(),
            "--num-prompts".into(),
            "2".into(),
            "--output-len".into(),
            "4".into(),
            "--stream-logprobs".into(),
            "--dataset".into(),
            dataset.to_str().unwrap().into(),
            "--out".into(),
            json.to_str().unwrap().into(),
        ]
    };
    let run = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        moeserve(&args, Duration::from_secs(60))
    };
    let output = run(args("tiny"));
    assert!(!output.status.success(), "{}", text(&output));
    assert!(
        text(&output).contains("1 requests failed"),
        "{}",
        text(&output)
    );
    let result: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let level = &result["levels"][0];
    assert_eq!(
        (level["completed"].as_u64(), level["failed"].as_u64()),
        (Some(1), Some(1))
    );
    assert!(
        level["errors"][0].as_str().unwrap().contains("HTTP 400"),
        "{level}"
    );
    assert_eq!(result["setup"]["dataset"], dataset.to_str().unwrap());

    // A wrong model name fails at the test request, before any level runs.
    std::fs::remove_file(&json).unwrap();
    let output = run(args("no-such-model"));
    assert!(!output.status.success());
    let message = text(&output);
    assert!(message.contains("the test request to"), "{message}");
    assert!(message.contains("HTTP 404"), "{message}");
    assert!(!json.exists());
}
