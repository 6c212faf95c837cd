//! `moeserve quantize` on a small fixture: the checkpoint it writes, that loading it runs the
//! stored GPTQ integers, that the source is left alone, and that broken int8 tensors are
//! refused by name. Its own process: it runs int8 (the quantization is chosen once).

mod common;

use std::path::Path;

use common::{fixtures_dir, prefill, run_int8};
use moeserve_backend::WeightData;
use moeserve_backend::cpu::quant::quantize_rows_int8;
use moeserve_model::checkpoint::Checkpoint;
use moeserve_model::models::ForwardOptions;
use moeserve_model::models::MoeModel;
use moeserve_model::quantize::{
    INT8_PREFIX, QuantizeOptions, QuantizeReport, int8_file, quantize_checkpoint, stored_int8,
};
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

fn small_run() -> QuantizeOptions {
    QuantizeOptions {
        samples: 4,
        sample_len: 24,
        ..QuantizeOptions::default()
    }
}

fn quantize(src: &Path, dst: &Path) -> QuantizeReport {
    quantize_checkpoint(src, dst, &small_run(), &mut |_| {}).unwrap()
}

#[test]
fn quantized_checkpoint_loads_its_gptq_integers() {
    if !run_int8() {
        return;
    }
    let src = fixtures_dir().join("mixtral-swa");
    let source_bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let out = tempfile::tempdir().unwrap();
    let report = quantize(&src, out.path());

    let model = MoeModel::load_as_stored(&src).unwrap();
    let c = model.config();
    let per_layer = 4 + 3 * c.num_local_experts;
    assert_eq!(report.matrices, c.num_hidden_layers * per_layer + 1);
    assert_eq!(report.calibration_tokens, 4 * 24);
    assert!(stored_int8(out.path()).unwrap() && !stored_int8(&src).unwrap());
    // The quantized releases the server takes as they are: FP8 blocks and MXFP4 experts.
    for case in ["deepseek-v3-fp8", "gpt-oss-mxfp4"] {
        assert!(!stored_int8(&fixtures_dir().join(case)).unwrap(), "{case}");
    }
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    assert_eq!(config["quantization_config"]["desc_act"], true);
    assert_eq!(config["num_hidden_layers"], c.num_hidden_layers);

    // Static groups: RTN's grids, GPTQ's integers (not all the same as rounding's).
    let ckpt = Checkpoint::open(out.path()).unwrap();
    let stored = ckpt
        .tensor_shape("model.layers.0.self_attn.q_proj.weight")
        .unwrap();
    let (n, k) = (stored[0], stored[1]);
    let rows = ckpt
        .int8_rows("model.layers.0.self_attn.q_proj", n, k)
        .unwrap()
        .expect("q_proj has int8 tensors");
    let w = ckpt
        .weight("model.layers.0.self_attn.q_proj.weight", &[n, k])
        .unwrap()
        .to_f32_vec();
    let rtn = quantize_rows_int8(WeightData::F32(&w), n, k);
    assert_eq!((&rows.scales, &rows.offsets), (&rtn.scales, &rtn.offsets));
    assert_ne!(rows.q, rtn.q);

    // Loaded, the int8 model runs the stored integers: its logits differ from rounding at load,
    // and both stay near the stored weights'.
    let prompt = [1u32, 5, 9, 2, 7, 3, 11, 4];
    let opts = || ForwardOptions::default();
    let exact = prefill(&model, &prompt, opts());
    let rounded = prefill(&MoeModel::load(&src).unwrap(), &prompt, opts());
    let gptq = prefill(&MoeModel::load(out.path()).unwrap(), &prompt, opts());
    assert_ne!(gptq, rounded);
    for got in [&rounded, &gptq] {
        let diff = common::max_rel_diff(got, &exact);
        assert!(diff < 0.05, "int8 logits {diff} from the stored weights'");
    }

    // Writing again replaces the int8 file, never through a link into the source.
    quantize(&src, out.path());
    assert_eq!(
        std::fs::read(src.join("model.safetensors")).unwrap(),
        source_bytes
    );
    let names: Vec<String> = std::fs::read_dir(&src)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        !names.iter().any(|n| n.starts_with(INT8_PREFIX)),
        "{names:?}"
    );
}

/// Every family's matrices are quantized and reloaded by their hub names: dense layers' MLPs,
/// the shared expert (its scalar gate stays as stored, like the routers), and experts a
/// checkpoint stores fused (their int8 forms under per-expert names; GPT-OSS's input-major,
/// interleaved ones too, calibrated through its biased, clamped activation).
#[test]
fn every_family_quantizes_its_dense_shared_and_fused_matrices() {
    if !run_int8() {
        return;
    }
    for (case, shared) in [
        ("qwen2-moe", true),
        ("qwen3-moe-fused", false),
        ("olmoe", false),
        ("glm4-moe", true),
        ("gpt-oss", false),
    ] {
        let src = fixtures_dir().join(case);
        let out = tempfile::tempdir().unwrap();
        let report = quantize(&src, out.path());
        let model = MoeModel::load_as_stored(&src).unwrap();
        let c = model.config();
        let (sparse, dense) = (c.num_moe_layers(), c.num_hidden_layers - c.num_moe_layers());
        let per_sparse = 3 * c.num_local_experts + if shared { 3 } else { 0 };
        assert_eq!(
            report.matrices,
            4 * c.num_hidden_layers + sparse * per_sparse + 3 * dense + 1,
            "{case}"
        );
        let ckpt = Checkpoint::open(out.path()).unwrap();
        let has = |prefix: &str| ckpt.contains(&format!("{prefix}.qweight"));
        let first_sparse = c.moe_layers()[0];
        assert!(
            has(&format!(
                "model.layers.{first_sparse}.mlp.experts.1.down_proj"
            )),
            "{case}"
        );
        if let Some(l) = (0..c.num_hidden_layers).find(|l| !c.sparse_layers[*l]) {
            assert!(has(&format!("model.layers.{l}.mlp.gate_proj")), "{case}");
        }
        if shared {
            let p = format!("model.layers.{first_sparse}.mlp");
            let name = c.names.shared_expert;
            assert!(has(&format!("{p}.{name}.up_proj")), "{case}");
            assert!(!has(&format!("{p}.shared_expert_gate")), "{case}");
        }
        let router = c.names.router;
        assert!(
            !has(&format!("model.layers.{first_sparse}.mlp.{router}")),
            "{case}"
        );
        let prompt = [1u32, 5, 9, 2, 7, 3, 11, 4];
        let exact = prefill(&model, &prompt, ForwardOptions::default());
        let rounded = prefill(
            &MoeModel::load(&src).unwrap(),
            &prompt,
            ForwardOptions::default(),
        );
        let quantized = MoeModel::load(out.path()).unwrap();
        assert!(quantized.quantization_summary().contains(&format!(
            "GPTQ integers of {m} of {m} matrices",
            m = report.matrices
        )));
        let gptq = prefill(&quantized, &prompt, ForwardOptions::default());
        assert_ne!(gptq, rounded, "{case}: the stored integers are used");
        for got in [&rounded, &gptq] {
            let diff = common::max_rel_diff(got, &exact);
            assert!(
                diff < 0.05,
                "{case}: int8 logits {diff} from the stored weights'"
            );
        }
    }
}

/// A matrix's name, integers, scales and offsets.
type StoredInt8 = (String, Vec<i8>, Vec<f32>, Vec<f32>);

/// Every int8 tensor of the checkpoint in `dir`, by matrix.
fn int8_tensors(dir: &Path) -> Vec<StoredInt8> {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut names: Vec<&str> = ckpt.tensor_names().collect();
    names.sort();
    names
        .into_iter()
        .filter_map(|n| n.strip_suffix(".qweight"))
        .map(|prefix| {
            let shape = ckpt.tensor_shape(&format!("{prefix}.qweight")).unwrap();
            let rows = ckpt.int8_rows(prefix, shape[0], shape[1]).unwrap().unwrap();
            (prefix.to_string(), rows.q, rows.scales, rows.offsets)
        })
        .collect()
}

#[test]
fn a_small_hessian_budget_quantizes_layer_by_layer_to_the_same_integers() {
    run_int8();
    let src = fixtures_dir().join("mixtral-tied");
    let (whole, by_layer) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let one_pass = quantize(&src, whole.path());
    let opts = QuantizeOptions {
        max_hessian_bytes: 1,
        ..small_run()
    };
    let layered = quantize_checkpoint(&src, by_layer.path(), &opts, &mut |_| {}).unwrap();
    let layers = MoeModel::load_as_stored(&src)
        .unwrap()
        .config()
        .num_hidden_layers;
    assert_eq!((one_pass.passes, layered.passes), (1, layers));
    assert_eq!(one_pass.matrices, layered.matrices);
    assert!(by_layer.path().join(int8_file(layers, layers)).exists());
    let (a, b) = (int8_tensors(whole.path()), int8_tensors(by_layer.path()));
    assert_eq!(a.len(), one_pass.matrices);
    assert!(a == b, "the same Hessians, so the same integers");
}

#[test]
fn output_directory_cannot_be_the_model_directory() {
    // Every test of this process picks int8 first: the choice is made once, on first use.
    run_int8();
    let src = fixtures_dir().join("mixtral-swa");
    let err = quantize_checkpoint(&src, &src, &small_run(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains("output directory"), "{err}");
}

#[test]
fn an_unwritable_output_directory_is_named() {
    run_int8();
    let src = fixtures_dir().join("mixtral-swa");
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("file"), b"").unwrap();
    let dst = tmp.path().join("file").join("out");
    let err = quantize_checkpoint(&src, &dst, &small_run(), &mut |_| {}).unwrap_err();
    assert!(err.to_string().contains(dst.to_str().unwrap()), "{err}");
}

#[test]
fn broken_int8_tensor_is_named() {
    if !run_int8() {
        return;
    }
    let src = fixtures_dir().join("mixtral-swa");
    let out = tempfile::tempdir().unwrap();
    quantize(&src, out.path());
    // q_proj's integers one column short.
    let path = out.path().join(int8_file(1, 1));
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let name = "model.layers.1.self_attn.q_proj.qweight";
    let full = st.tensor(name).unwrap();
    let short_shape = vec![full.shape()[0], full.shape()[1] - 1];
    let short = full.data()[..short_shape[0] * short_shape[1]].to_vec();
    let views: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| match n == name {
            true => (
                n,
                TensorView::new(v.dtype(), short_shape.clone(), &short).unwrap(),
            ),
            false => (n, v),
        })
        .collect();
    std::fs::remove_file(&path).unwrap();
    safetensors::serialize_to_file(views, None, &path).unwrap();
    let err = match MoeModel::load(out.path()) {
        Ok(_) => panic!("a short qweight must not load"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(name) && err.contains(&int8_file(1, 1)),
        "the message names the tensor and its file: {err}"
    );
}

/// Multi-head latent attention's matrices are calibrated too: q_a_proj and kv_a_proj_with_mqa
/// on the attention input, q_b_proj on the normed low-rank query, o_proj on the attention
/// output (kv_b_proj, cut per head at load, stays as stored); the int8 model loads its integers
/// and stays near the stored one.
#[test]
fn latent_attention_models_quantize_their_projections() {
    if !run_int8() {
        return;
    }
    let src = fixtures_dir().join("deepseek-v2");
    let out = tempfile::tempdir().unwrap();
    let report = quantize(&src, out.path());
    let model = MoeModel::load_as_stored(&src).unwrap();
    let c = model.config();
    let (sparse, dense) = (c.num_moe_layers(), c.num_hidden_layers - c.num_moe_layers());
    // q_a, q_b, kv_a, o; routed experts and the shared one; the dense MLP; lm_head.
    let per_sparse = 3 * c.num_local_experts + 3;
    assert_eq!(
        report.matrices,
        4 * c.num_hidden_layers + sparse * per_sparse + 3 * dense + 1,
        "{report:?}"
    );
    let ckpt = moeserve_model::checkpoint::Checkpoint::open(out.path()).unwrap();
    for name in ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"] {
        assert!(
            ckpt.contains(&format!("model.layers.1.self_attn.{name}.qweight")),
            "{name}"
        );
    }
    assert!(!ckpt.contains("model.layers.1.self_attn.kv_b_proj.qweight"));
    let quantized = MoeModel::load(out.path()).unwrap();
    assert!(
        quantized.quantization_summary().contains("GPTQ integers"),
        "{}",
        quantized.quantization_summary()
    );
    let prompt = [1u32, 5, 9, 2, 7, 3, 11, 4];
    let exact = prefill(&model, &prompt, ForwardOptions::default());
    let gptq = prefill(&quantized, &prompt, ForwardOptions::default());
    let diff = common::max_rel_diff(&gptq, &exact);
    assert!(diff < 0.05, "int8 logits {diff} from the stored weights'");
}

/// An FP8 block checkpoint quantizes too: the int8 checkpoint keeps the FP8 tensors it does
/// not replace (kv_b_proj here) and the FP8 config that reads them.
#[test]
fn fp8_checkpoints_quantize_and_keep_their_fp8_storage() {
    if !run_int8() {
        return;
    }
    let src = fixtures_dir().join("deepseek-v3-fp8");
    let out = tempfile::tempdir().unwrap();
    quantize(&src, out.path());
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.path().join("config.json")).unwrap())
            .unwrap();
    let q = &config["quantization_config"];
    assert_eq!(q["quant_method"], "moeserve-int8");
    assert_eq!(
        q["source_quantization_config"]["weight_block_size"],
        serde_json::json!([32, 32])
    );
    let stored = MoeModel::load_as_stored(&src).unwrap();
    let quantized = MoeModel::load(out.path()).unwrap();
    // The FP8 matrices run their GPTQ integers, not a rounding of the FP8 values at load.
    let expert = &quantized.moe_layers()[0].experts[3];
    assert_eq!(expert.w2.dtype(), moeserve_core::DType::F8E4M3);
    assert!(
        [&expert.w1, &expert.w2, &expert.w3]
            .iter()
            .all(|w| w.has_stored_int8())
    );
    let prompt = [1u32, 5, 9, 2, 7, 3, 11, 4];
    let exact = prefill(&stored, &prompt, ForwardOptions::default());
    let gptq = prefill(&quantized, &prompt, ForwardOptions::default());
    let diff = common::max_rel_diff(&gptq, &exact);
    assert!(diff < 0.05, "int8 logits {diff} from the FP8 weights'");
}

/// Experts copied onto other devices for expert parallelism keep the checkpoint's GPTQ
/// integers: the expert-parallel run of the int8 checkpoint equals the one-device run exactly
/// (the copies once dropped them and rounded the stored weights instead).
#[test]
fn expert_parallel_copies_keep_the_stored_int8_rows() {
    use std::sync::Arc;

    use moeserve_core::ExpertPlacement;
    use moeserve_model::moe::{ExpertParallel, InProcessAllToAll, MoeOptions};
    if !run_int8() {
        return;
    }
    let src = fixtures_dir().join("mixtral-swa");
    let out = tempfile::tempdir().unwrap();
    quantize(&src, out.path());
    let model = MoeModel::load(out.path()).unwrap();
    let c = model.config();
    let prompt = [1u32, 5, 9, 2, 7, 3, 11, 4, 8, 6];
    let alone = prefill(&model, &prompt, ForwardOptions::default());
    let placement =
        ExpertPlacement::round_robin(c.num_moe_layers(), c.num_local_experts, 2, 2).unwrap();
    let exchange = Arc::new(InProcessAllToAll::new(2, 2).unwrap());
    let ep = ExpertParallel::new(&model.moe_layers(), placement, exchange).unwrap();
    let opts = ForwardOptions {
        moe: MoeOptions {
            experts: Some(&ep),
            ..MoeOptions::default()
        },
        ..ForwardOptions::default()
    };
    assert_eq!(prefill(&model, &prompt, opts), alone);
}
