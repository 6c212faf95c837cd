//! `--device auto|cpu|cuda` through the real `moeserve` binary (built with or without the `cuda`
//! feature, whichever this test is built with): on a machine without a usable CUDA setup (CI: no
//! driver) `auto` runs on the CPU and says why, and `cuda` fails before loading anything with
//! the backend's reason; the expected reason comes from the same probe the binary runs. Where
//! CUDA works (the GPU check), `auto` must pick it and generate there.

use std::path::Path;
use std::process::{Command, Output};

use moeserve_backend::device::{DeviceRequest, select_device};

fn moeserve(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_moeserve"))
        .args(args)
        .env_remove("MOESERVE_DEVICE")
        .output()
        .expect("the moeserve binary runs")
}

fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

fn tiny_model(dir: &Path) -> String {
    let model = dir.join("mixtral-tiny");
    let model = model.to_str().unwrap().to_string();
    let out = moeserve(&["make-model", "--preset", "mixtral-tiny", "--out", &model]);
    assert!(out.status.success(), "make-model failed: {}", stderr(&out));
    model
}

/// Why the CUDA backend cannot serve here, as the binary will say it; `None` where it can.
fn cuda_refusal() -> Option<String> {
    select_device(DeviceRequest::Cuda)
        .err()
        .map(|e| e.to_string())
}

#[test]
fn auto_runs_on_the_cpu_and_logs_why() {
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(dir.path());
    let out = moeserve(&[
        "generate",
        "--model",
        &model,
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "2",
        "--ignore-eos",
        "--json",
        "--device",
        "auto",
    ]);
    let err = stderr(&out);
    assert!(out.status.success(), "{err}");
    // The log line's message, after its level.
    let line = err
        .lines()
        .find_map(|l| {
            l.split_once("INFO device: ")
                .map(|(_, m)| format!("device: {m}"))
        })
        .unwrap_or_else(|| panic!("no device line in:\n{err}"));
    match cuda_refusal() {
        Some(refusal) => {
            assert!(line.starts_with("device: cpu (--device auto: "), "{line}");
            assert!(line.contains(&refusal), "{line}");
        }
        None => assert!(line.starts_with("device: cuda:"), "{line}"),
    }
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(json["token_ids"].as_array().unwrap().len(), 2, "{json}");
    if !cfg!(feature = "cuda") {
        assert!(line.contains("built without CUDA support"), "{line}");
    }
}

#[test]
fn cuda_fails_with_the_reason_before_loading_the_model() {
    let Some(refusal) = cuda_refusal() else {
        eprintln!("CUDA is usable on this machine: nothing to refuse");
        return;
    };
    // The model directory does not exist: the device is checked first, so the error is about it.
    for sub in ["generate", "serve"] {
        let out = moeserve(
            &[
                sub,
                "--model",
                "/nonexistent/model",
                "--prompt-ids",
                "1",
                "--device",
                "cuda",
            ]
            .into_iter()
            .filter(|a| sub == "generate" || !matches!(*a, "--prompt-ids" | "1"))
            .collect::<Vec<_>>(),
        );
        let err = stderr(&out);
        assert!(!out.status.success(), "{sub}: {err}");
        assert!(err.contains("error: --device cuda: "), "{sub}: {err}");
        assert!(err.contains(&refusal), "{sub}: {err}");
        assert!(
            !err.contains("/nonexistent/model"),
            "{sub} looked at the model first: {err}"
        );
        assert!(!err.contains("listening on"), "{sub}: {err}");
    }
    if cfg!(feature = "cuda") {
        // Built with CUDA on a machine without a driver (the CI machine): the message says so.
        assert!(
            refusal.contains("no NVIDIA driver")
                || refusal.contains("could not be loaded")
                || refusal.contains("no CUDA device"),
            "{refusal}"
        );
    } else {
        assert!(refusal.contains("--features cuda"));
    }
}

#[test]
fn an_unknown_device_is_a_usage_error() {
    let out = moeserve(&[
        "generate",
        "--model",
        "m",
        "--prompt-ids",
        "1",
        "--device",
        "gpu",
    ]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("auto, cpu or cuda"),
        "{}",
        stderr(&out)
    );
}
