//! `--quantization int8` accuracy against the transformers references, teacher-forced: the
//! reference's greedy tokens are fed one by one and, at each position, the int8 model's
//! logprob of the reference token is compared with the reference's (mean |Δlogprob|) and its
//! argmax with the reference token (greedy agreement). Its own process: the quantization is
//! chosen once per process.

mod common;

use common::{demo_model_dir, fixtures_dir, load_demo, run_int8, teacher_forced};
use moeserve_model::models::MoeModel;
use moeserve_model::quantize::{QuantizeOptions, quantize_checkpoint};

/// Checks the demo model's (fixture, most mean |Δlogprob|, least greedy agreement) cases.
fn check_demo(label: &str, model: &MoeModel, cases: [(&str, f64, f64); 2]) {
    for (case, max_delta, min_agree) in cases {
        let (delta, agree, n) = teacher_forced(model, &fixtures_dir().join(case));
        eprintln!(
            "demo model {label}, {case}: mean |Δlogprob| {delta:.4}, greedy agreement \
             {agree:.3} ({n} positions)"
        );
        assert!(
            delta <= max_delta,
            "{label}, {case}: mean |Δlogprob| {delta}"
        );
        assert!(
            agree >= min_agree,
            "{label}, {case}: greedy agreement {agree}"
        );
    }
}

/// The accuracy target: `moeserve quantize` (GPTQ in act-order with static groups,
/// calibrated on 32 × 256 tokens the model samples itself, its defaults) then int8 with the
/// stored integers: mean |Δlogprob| ≤ 0.02 on the demo model. Measured 2026-12-04 with the
/// integer dot products (15-bit activations, `cpu/int8.rs`): 0.0168 on smolmoe-demo (agreement
/// 97.5 %), 0.0180 on smolmoe-eval (98.6 %) — 2026-11-30's f32 activations gave 0.0167 / 0.0179,
/// 8-bit activations 0.060 on smolmoe-demo. bench/int8_accuracy.py's simulation on the dense
/// twin gave 0.0158 / 0.0183. Takes ≈ 3 minutes (sampling, calibration, GPTQ on 841 matrices).
#[test]
fn gptq_checkpoint_stays_within_the_target() {
    if !run_int8() {
        return;
    }
    let src = demo_model_dir();
    // Beside the build, so the shards are hard-linked rather than copied.
    let out = tempfile::tempdir_in(env!("CARGO_TARGET_TMPDIR")).unwrap();
    let opts = QuantizeOptions::default();
    let mut progress = |what: &str| eprintln!("quantize: {what}");
    let report = quantize_checkpoint(&src, out.path(), &opts, &mut progress)
        .unwrap_or_else(|e| panic!("{}: {e} (run models/smolmoe-8x135m.sh)", src.display()));
    eprintln!("{report:?}");
    assert!(report.round_to_nearest.is_empty(), "{report:?}");
    let model = load_demo(out.path());
    check_demo(
        "GPTQ int8",
        &model,
        [("smolmoe-demo", 0.02, 0.95), ("smolmoe-eval", 0.02, 0.975)],
    );
}

#[test]
fn int8_weights_stay_close_to_the_references() {
    if !run_int8() {
        return;
    }

    // The demo model (real SmolLM2 weights, bf16) is the accuracy case: the issue asks for mean
    // |Δlogprob| ≤ 0.02. Fixture smolmoe-eval (16 chat turns, up to 64 greedy tokens each, 883
    // positions) is the measure; smolmoe-demo's 79 positions are reported too, but there one
    // near-tie position moves greedy agreement by 1.3 points. Measured 2026-11-30 (the same on
    // 2026-12-04 with the integer dot products): symmetric
    // 64-position groups 0.0276 on smolmoe-demo (0.030 on smolmoe-eval in bench/int8_accuracy.py's
    // simulation); groups spanning their own range 0.0196 / 0.0231, greedy agreement 93.7 % /
    // 98.3 %. Rounding at load does not reach ≤ 0.02 on smolmoe-eval; a `moeserve quantize`
    // checkpoint does (the test above). These bounds guard against regressions.
    let model = load_demo(&demo_model_dir());
    let stored: usize = model.weight_bytes();
    let read = model.dense_matrix_bytes();
    eprintln!("demo model: {read} bytes of dense matrices read as int8 (stored {stored} in all)");
    check_demo(
        "int8",
        &model,
        [("smolmoe-demo", 0.022, 0.9), ("smolmoe-eval", 0.025, 0.97)],
    );

    // The random fixtures have near-flat distributions, so they are only a sanity bound.
    for case in ["mixtral-swa", "mixtral-tied", "mixtral-gqa"] {
        let dir = fixtures_dir().join(case);
        let model = MoeModel::load(&dir).unwrap();
        let (delta, agree, n) = teacher_forced(&model, &dir);
        eprintln!("{case} int8: mean |Δlogprob| {delta:.4}, greedy agreement {agree:.3} ({n})");
        assert!(delta <= 0.1, "{case}: mean |Δlogprob| {delta}");
    }
}
