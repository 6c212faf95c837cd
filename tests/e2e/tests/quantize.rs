//! `moeserve quantize` from the command line, then `moeserve serve` on what it wrote: the
//! server runs int8 with the checkpoint's GPTQ integers without being told, answers, and
//! `--quantization none` still runs the stored weights.

use std::time::Duration;

use moeserve_e2e::{Server, post_json, run_to_exit, tiny_model, tiny_model_path};
use serde_json::json;

#[tokio::test]
async fn a_quantized_checkpoint_is_served_in_int8() {
    let dir = tiny_model(None);
    let src = tiny_model_path(&dir);
    let out = dir.path().join("tiny-int8");
    let (status, log) = run_to_exit(
        &[
            "quantize",
            "--model",
            src.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
            "--calibration-samples",
            "4",
            "--calibration-len",
            "32",
        ],
        Duration::from_secs(300),
    );
    assert!(status.success(), "moeserve quantize failed:\n{log}");
    assert!(log.contains("128 calibration tokens"), "{log}");

    for (extra, want) in [
        (None, "quantization: int8 (GPTQ integers of"),
        (Some("none"), "quantization: none"),
    ] {
        let mut args = vec!["--model", out.to_str().unwrap()];
        if let Some(q) = extra {
            args.extend(["--quantization", q]);
        }
        let server = Server::start(&args).await;
        assert!(
            server.logs().contains(want),
            "{want:?} in:\n{}",
            server.logs()
        );
        let r = post_json(
            &server.url("/v1/completions"),
            &json!({"model": "tiny-int8", "prompt": "hello", "max_tokens": 4, "temperature": 0}),
        )
        .await;
        assert_eq!(r.status, 200, "{}", r.body);
        assert_eq!(r.body["usage"]["completion_tokens"], 4);
    }
}

#[test]
fn quantize_names_a_missing_model_directory() {
    let (status, log) = run_to_exit(
        &[
            "quantize",
            "--model",
            "/nonexistent/model",
            "--out",
            "/tmp/never-written",
        ],
        Duration::from_secs(60),
    );
    assert!(!status.success());
    assert!(log.contains("/nonexistent/model"), "{log}");
}
