//! `moeserve tune capacity-factor` on a real tiny model: the prompts run dropless (recording
//! the routing) and per α × policy, and the recorded trace replays to the same drop counts.

use std::time::Duration;

use moeserve_e2e::{run_with_output, tiny_model, tiny_model_path};
use serde_json::Value;

const ALPHAS: [f64; 3] = [0.5, 1.0, 8.0];

fn tune(args: &[&str]) -> Value {
    let dir = tempfile::tempdir().expect("temp dir");
    let json = dir.path().join("tune.json");
    let mut all = vec!["tune", "capacity-factor"];
    all.extend_from_slice(args);
    all.extend_from_slice(&["--json", json.to_str().unwrap()]);
    let output = run_with_output(&all, Duration::from_secs(120));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{all:?}: {}\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.starts_with("| α | policy |"), "{stdout}");
    assert!(
        stdout.contains("recommended: --capacity-factor"),
        "{stdout}"
    );
    serde_json::from_str(&std::fs::read_to_string(&json).expect("tune JSON")).expect("JSON")
}

/// `(α, policy)` → row.
fn row<'a>(report: &'a Value, alpha: f64, policy: &str) -> &'a Value {
    report["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["alpha"].as_f64() == Some(alpha) && r["policy"] == policy)
        .unwrap_or_else(|| panic!("no row for {alpha} {policy}: {report}"))
}

#[test]
fn prompts_and_their_trace_give_drop_rates_quality_and_a_recommendation() {
    let model = tiny_model(None);
    let model_dir = tiny_model_path(&model);
    let dir = tempfile::tempdir().expect("temp dir");
    let (prompts, trace) = (dir.path().join("p.jsonl"), dir.path().join("t.jsonl"));
    let lines: Vec<String> = (0..8u32)
        .map(|i| {
            let ids: Vec<u32> = (0..24).map(|j| 4 + (i * 37 + j * 11) % 500).collect();
            serde_json::json!({ "prompt_ids": ids }).to_string()
        })
        .collect();
    std::fs::write(&prompts, lines.join("\n")).unwrap();
    let alphas = "0.5,1.0,8.0";
    let common = [
        "--model",
        model_dir.to_str().unwrap(),
        "--alphas",
        alphas,
        "--policies",
        "drop,reroute",
        "--quality-budget",
        "0.01",
    ];
    let mut args = common.to_vec();
    args.extend_from_slice(&[
        "--prompts",
        prompts.to_str().unwrap(),
        "--max-tokens",
        "6",
        "--record-routing",
        trace.to_str().unwrap(),
    ]);
    let ran = tune(&args);
    let rows = ran["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 1 + ALPHAS.len() * 2);
    let dropless = &rows[0]["measured"];
    assert_eq!(rows[0]["policy"], "dropless");
    assert_eq!(dropless["quality"]["greedy_agreement"], 1.0);
    assert_eq!(dropless["dropped_rate"], 0.0);
    // α = 8 gives every expert room for every token (C = T·k/N·8 ≥ T): exactly dropless.
    for policy in ["drop", "reroute"] {
        let m = &row(&ran, 8.0, policy)["measured"];
        assert_eq!(m["dropped_rate"], 0.0, "{m}");
        assert_eq!(m["quality"]["greedy_agreement"], 1.0, "{m}");
        assert_eq!(m["quality"]["mean_abs_delta_logprob"], 0.0, "{m}");
    }
    // α = 0.5 halves the slots: pairs must be dropped, and drop drops the most.
    let tight = row(&ran, 0.5, "drop");
    assert!(
        tight["measured"]["dropped_rate"].as_f64().unwrap() > 0.0,
        "{tight}"
    );
    assert!(
        tight["replayed"]["dropped"].as_u64().unwrap() > 0,
        "{tight}"
    );
    let rerouted = &row(&ran, 0.5, "reroute")["measured"];
    assert!(
        rerouted["rerouted_rate"].as_f64().unwrap() > 0.0,
        "{rerouted}"
    );
    assert!(row(&ran, 0.5, "reroute")["replayed"].is_null());
    // Drop rates fall as α grows.
    let replayed: Vec<u64> = ALPHAS
        .iter()
        .map(|a| {
            row(&ran, *a, "drop")["replayed"]["dropped"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert!(replayed.windows(2).all(|w| w[0] >= w[1]), "{replayed:?}");
    let pick = &ran["recommendation"];
    assert!(pick["value"].as_f64().unwrap() <= 0.01, "{pick}");
    assert!(ALPHAS.contains(&pick["alpha"].as_f64().unwrap()), "{pick}");

    // Replaying the recorded trace gives the same counts without running the model.
    let mut args = common.to_vec();
    args.extend_from_slice(&["--trace", trace.to_str().unwrap()]);
    let replay = tune(&args);
    for alpha in ALPHAS {
        assert_eq!(
            row(&replay, alpha, "drop")["replayed"],
            row(&ran, alpha, "drop")["replayed"]
        );
        assert!(row(&replay, alpha, "drop")["measured"].is_null());
    }
    assert_eq!(
        replay["recommendation"]["measure"],
        "replayed dropped-pair rate"
    );
}
