//! Parity with Hugging Face transformers on the committed fixtures (made by
//! tests/reference/generate.py): per-layer outputs and router logits, final logits, 24 greedy
//! tokens with their logprobs and top-5 alternatives, for every case and prompt of every family
//! (Mixtral, Qwen3-MoE, Qwen2-MoE, OLMoE, GLM-4.5, DeepSeek-V2/V3, GPT-OSS in bf16 and MXFP4).

mod common;

use common::*;
use moeserve_model::models::{ForwardTrace, MoeModel};

/// Largest |Δlogprob| allowed between moeserve and transformers (both f32 on the same weights;
/// the difference is summation order only).
const LOGPROB_TOLERANCE: f32 = 1e-4;
/// Largest |Δ| for hidden states and logits, relative to the tensor's largest magnitude.
const ACTIVATION_TOLERANCE: f32 = 1e-4;

/// Compares layer by layer so a failure names the first bad layer.
fn check_layers(case: &str) {
    let dir = fixtures_dir().join(case);
    let model = MoeModel::load(&dir).unwrap_or_else(|e| panic!("{case}: {e}"));
    let reference = read_reference(&dir);
    let expected = read_expected(&dir);
    let prompt = &reference.prompts[2].prompt_ids;
    let mut trace = ForwardTrace::default();
    let logits = prefill_all_logits(&model, prompt, Some(&mut trace));
    check_trace(case, &trace, &logits, &expected, ACTIVATION_TOLERANCE);
}

/// Identical greedy tokens; chosen and top-5 logprobs within tolerance.
pub fn check_greedy(case: &str, dir: &std::path::Path, model: &MoeModel) -> f32 {
    let reference = read_reference(dir);
    let mut worst = 0.0f32;
    for (p, want) in reference.prompts.iter().enumerate() {
        let n = want.greedy_ids.len();
        let mut seq = SoloSequence::new(model, want.prompt_ids.len() + n, 16);
        let steps = seq.greedy(&want.prompt_ids, n);
        let got: Vec<u32> = steps.iter().map(|s| s.token).collect();
        assert_eq!(
            got, want.greedy_ids,
            "{case} prompt {p}: greedy tokens differ"
        );
        for (i, step) in steps.iter().enumerate() {
            let d = (step.logprobs[got[i] as usize] - want.greedy_logprobs[i]).abs();
            worst = worst.max(d);
            assert!(
                d < LOGPROB_TOLERANCE,
                "{case} prompt {p} token {i}: logprob differs by {d}"
            );
            for (id, lp) in want.top_logprobs.get(i).into_iter().flatten() {
                let d = (step.logprobs[*id as usize] - lp).abs();
                worst = worst.max(d);
                assert!(
                    d < LOGPROB_TOLERANCE,
                    "{case} prompt {p} token {i}: top logprob of {id} differs by {d}"
                );
            }
        }
    }
    worst
}

#[test]
fn layer_outputs_match_transformers() {
    for case in all_cases() {
        check_layers(case);
    }
}

#[test]
fn greedy_tokens_and_logprobs_match_transformers() {
    for case in all_cases() {
        let dir = fixtures_dir().join(case);
        let model = MoeModel::load(&dir).unwrap();
        let worst = check_greedy(case, &dir, &model);
        eprintln!("{case}: max |Δlogprob| = {worst:e}");
    }
}

/// Decoding with the KV cache gives bit-identical logits to recomputing the whole sequence, for
/// every block size (the kernels' reduction order does not depend on the batch).
#[test]
fn incremental_decode_equals_full_recompute() {
    for case in all_cases() {
        let dir = fixtures_dir().join(case);
        let model = MoeModel::load(&dir).unwrap();
        let prompt = &read_reference(&dir).prompts[2].prompt_ids;
        for block_size in [1, 8, 16] {
            let mut incremental = SoloSequence::new(&model, prompt.len() + 8, block_size);
            let mut logits = incremental.feed(prompt);
            for _ in 0..8 {
                let next = argmax(&logits);
                logits = incremental.feed(&[next]);
                let mut fresh = SoloSequence::new(&model, incremental.tokens.len(), block_size);
                let recomputed = fresh.feed(&incremental.tokens);
                assert_eq!(
                    logits,
                    recomputed,
                    "{case} block size {block_size} at {} tokens",
                    incremental.tokens.len()
                );
            }
        }
    }
}

/// A bf16 KV cache (`--kv-cache-dtype bfloat16`), on every family (MLA's latent rows too):
/// decoding over it equals recomputing the sequence over a fresh bf16 cache bit for bit (a row
/// is rounded once, when written, whatever the step); teacher-forced along transformers'
/// greedy tokens, each token's logprob is within [`BF16_KV_TOLERANCE`] of transformers' (f32)
/// and differs from the f32 cache's somewhere (the rows really are rounded).
#[test]
fn a_bf16_kv_cache_decodes_as_it_recomputes_and_near_the_f32_cache() {
    use moeserve_model::kv_cache::KvDtype;
    for case in all_cases() {
        let dir = fixtures_dir().join(case);
        let model = MoeModel::load(&dir).unwrap();
        let reference = read_reference(&dir);
        let want = &reference.prompts[2];
        let (prompt, n) = (&want.prompt_ids, want.greedy_ids.len());
        let bf16 = |len| SoloSequence::with_kv_dtype(&model, len, 8, KvDtype::Bf16);
        let mut incremental = bf16(prompt.len() + n);
        let mut f32_cache = SoloSequence::new(&model, prompt.len() + n, 8);
        let (mut logits, mut exact) = (incremental.feed(prompt), f32_cache.feed(prompt));
        let (mut worst, mut rounded) = (0.0f32, false);
        for (i, &token) in want.greedy_ids.iter().enumerate() {
            let d = (log_softmax(&logits)[token as usize] - want.greedy_logprobs[i]).abs();
            worst = worst.max(d);
            rounded |= logits != exact;
            if i + 1 == n {
                break;
            }
            logits = incremental.feed(&[token]);
            exact = f32_cache.feed(&[token]);
            if i % 4 == 0 {
                let recomputed = bf16(incremental.tokens.len()).feed(&incremental.tokens);
                assert_eq!(
                    logits,
                    recomputed,
                    "{case} at {} tokens",
                    incremental.tokens.len()
                );
            }
        }
        eprintln!("{case}: bf16 KV cache, max |Δlogprob| against transformers = {worst:e}");
        assert!(worst < BF16_KV_TOLERANCE, "{case}: |Δlogprob| {worst}");
        assert!(
            rounded,
            "{case}: a bf16 cache gave the f32 cache's logits exactly"
        );
    }
}

/// Largest |Δlogprob| a bf16 KV cache may add (keys and values rounded to 8 bits of mantissa;
/// the fixtures measured at most 2.0e-2, mixtral-tied, the others 4e-3 to 1.9e-2).
const BF16_KV_TOLERANCE: f32 = 5e-2;

/// The family is what config.json names, and each family's checkpoint has the shape its
/// fixture was made with (dense layers, shared experts, fused experts read as per-expert ones).
#[test]
fn each_family_fixture_loads_as_its_family() {
    use moeserve_model::config::Architecture;
    let want = [
        ("qwen3-moe", Architecture::Qwen3Moe, vec![true, false, true]),
        (
            "qwen3-moe-fused",
            Architecture::Qwen3Moe,
            vec![false, true, false, true],
        ),
        ("qwen2-moe", Architecture::Qwen2Moe, vec![false, true, true]),
        (
            "qwen3-moe-gptq",
            Architecture::Qwen3Moe,
            vec![true, false, true],
        ),
        (
            "qwen2-moe-awq",
            Architecture::Qwen2Moe,
            vec![false, true, true],
        ),
        ("olmoe", Architecture::Olmoe, vec![true, true, true]),
        ("glm4-moe", Architecture::Glm4Moe, vec![false, true, true]),
        (
            "deepseek-v2-lite",
            Architecture::DeepseekV2,
            vec![false, true, true],
        ),
        (
            "deepseek-v2",
            Architecture::DeepseekV2,
            vec![false, true, true],
        ),
        (
            "deepseek-v3",
            Architecture::DeepseekV3,
            vec![false, true, true],
        ),
        (
            "deepseek-v3-fp8",
            Architecture::DeepseekV3,
            vec![false, true, true],
        ),
        ("gpt-oss", Architecture::GptOss, vec![true, true, true]),
        (
            "gpt-oss-mxfp4",
            Architecture::GptOss,
            vec![true, true, true],
        ),
    ];
    for (case, arch, sparse) in want {
        let model = MoeModel::load(&fixtures_dir().join(case)).unwrap();
        let c = model.config();
        assert_eq!(c.architecture, arch, "{case}");
        assert_eq!(c.sparse_layers, sparse, "{case}");
        assert_eq!(model.moe_layers().len(), c.num_moe_layers(), "{case}");
        let shared = model.moe_layers().iter().all(|m| m.shared.is_some());
        let with_shared = [
            "qwen2-moe",
            "qwen2-moe-awq",
            "glm4-moe",
            "deepseek-v2-lite",
            "deepseek-v2",
            "deepseek-v3",
            "deepseek-v3-fp8",
        ];
        assert_eq!(shared, with_shared.contains(&case), "{case}");
    }
}

/// The tiny dense llama GGUF, upcycled into 8 identical experts (top-2, f32 so the stored
/// weights are exactly the dequantised ones), computes the dense model's function: its logits
/// and greedy tokens equal transformers' dense LlamaForCausalLM on the same weights.
#[test]
fn upcycled_gguf_matches_dense_transformers() {
    use moeserve_core::DType;
    use moeserve_formats::convert::{UpcycleOptions, upcycle_gguf};

    let dir = fixtures_dir().join("llama-tiny-gguf");
    let out = tempfile::tempdir().unwrap();
    upcycle_gguf(&UpcycleOptions {
        gguf: dir.join("model.gguf"),
        out: out.path().to_path_buf(),
        num_experts: 8,
        top_k: 2,
        seed: 0,
        expert_jitter: 0.0,
        dtype: DType::F32,
    })
    .unwrap();
    let model = MoeModel::load(out.path()).unwrap();
    let prompt = &read_reference(&dir).prompts[0].prompt_ids;
    let logits = prefill_all_logits(&model, prompt, None);
    let d = max_rel_diff(&logits, &read_expected(&dir)["logits"].1);
    assert!(
        d < ACTIVATION_TOLERANCE,
        "upcycled logits differ from the dense ones by {d}"
    );
    let worst = check_greedy("llama-tiny-gguf upcycled", &dir, &model);
    eprintln!("llama-tiny-gguf upcycled: max |Δlogprob| = {worst:e}");
}

/// An FP8 block checkpoint stays one byte per FP8 weight in the kernels' layout: nothing widens
/// its matrices to bf16 or f32 at load (kv_b_proj aside, cut per head into small f32 pieces).
#[test]
fn fp8_matrices_stay_one_byte_per_weight() {
    let fp8 = MoeModel::load(&fixtures_dir().join("deepseek-v3-fp8")).unwrap();
    let bf16 = MoeModel::load(&fixtures_dir().join("deepseek-v3")).unwrap();
    // The same shapes: an expert's packed matrices are half the bf16 bytes, plus the scales.
    let (e8, e16) = (fp8.expert_bytes(0, 0), bf16.expert_bytes(0, 0));
    assert!(e8 * 100 < e16 * 55, "FP8 expert {e8} bytes vs bf16 {e16}");
}

/// GPTQ and AWQ checkpoints keep their quantized layers 4-bit in the kernels' layout (the
/// experts' and the attention's matrices), and the layers they left in float (routers,
/// lm_head, Qwen2-MoE's shared-expert gate) as stored.
#[test]
fn gptq_and_awq_layers_stay_4_bit() {
    use moeserve_core::DType;
    for (case, float_twin) in [
        ("qwen3-moe-gptq", "qwen3-moe"),
        ("qwen2-moe-awq", "qwen2-moe"),
    ] {
        let model = MoeModel::load(&fixtures_dir().join(case)).unwrap();
        let twin = MoeModel::load(&fixtures_dir().join(float_twin)).unwrap();
        let layer = model.moe_layers()[0];
        for e in &layer.experts {
            for w in [&e.w1, &e.w2, &e.w3] {
                assert_eq!(w.dtype(), DType::Int4, "{case}");
            }
        }
        assert_eq!(layer.gate.dtype(), DType::F16, "{case}: the router");
        if let Some(shared) = &layer.shared {
            assert_eq!(
                shared.mlp.w2.dtype(),
                DType::Int4,
                "{case}: the shared expert"
            );
            let gate = shared.gate.as_ref().map(|g| g.dtype());
            assert_eq!(gate, Some(DType::F16), "{case}: its one-output gate");
        }
        // The same shapes as the float twin (bf16 or f16): under 0.6 of its bytes even with
        // these tiny matrices' padded panels and groups of 32.
        let (e4, e16) = (model.expert_bytes(1, 0), twin.expert_bytes(1, 0));
        assert!(e4 * 10 < e16 * 6, "{case}: int4 expert {e4} bytes vs {e16}");
    }
}

/// GPT-OSS as released, MXFP4 experts: they load as 4-bit panels (17/64 of the bf16 copy's
/// expert bytes, the same weights quantised), their values are transformers' dequantisation
/// of the blocks bit for bit (every byte value under scales 0..254), and a NaN scale is
/// refused naming the tensor, the expert and the row.
#[test]
fn gpt_oss_mxfp4_experts_stay_4_bit_and_decode_as_transformers_does() {
    use moeserve_core::DType;
    use moeserve_model::checkpoint::Checkpoint;
    use safetensors::SafeTensors;
    use safetensors::tensor::TensorView;

    let dir = fixtures_dir().join("gpt-oss-mxfp4");
    let model = MoeModel::load(&dir).unwrap();
    let bf16 = MoeModel::load(&fixtures_dir().join("gpt-oss")).unwrap();
    let matrix_bytes = |m: &MoeModel, dtype: DType| {
        let experts = m.moe_layers().into_iter().flat_map(|l| l.experts.iter());
        experts
            .flat_map(|e| [&e.w1, &e.w2, &e.w3])
            .map(|w| {
                assert_eq!(w.dtype(), dtype);
                w.size_in_bytes()
            })
            .sum::<usize>()
    };
    let (packed, wide) = (
        matrix_bytes(&model, DType::Mxfp4),
        matrix_bytes(&bf16, DType::BF16),
    );
    assert_eq!(packed * 64, wide * 17, "{packed} vs {wide} bytes");

    let probe = std::fs::read(dir.join("dequant_probe.safetensors")).unwrap();
    let tensors = SafeTensors::deserialize(&probe).unwrap();
    let want = tensors.tensor("probe_dequantized").unwrap();
    assert_eq!(want.shape(), [2, 128, 32]);
    let want: Vec<f32> = bytemuck::pod_collect_to_vec(want.data());
    let tmp = tempfile::tempdir().unwrap();
    std::fs::write(tmp.path().join("model.safetensors"), &probe).unwrap();
    let ckpt = Checkpoint::open(tmp.path()).unwrap();
    for e in 0..2 {
        let got = ckpt.mxfp4_rows("probe", [2, 32, 128], e, (0, 1)).unwrap();
        let got = got.to_f32_vec();
        for (r, c) in (0..32).flat_map(|r| (0..128).map(move |c| (r, c))) {
            let w = want[(e * 128 + c) * 32 + r];
            assert_eq!(
                got[r * 128 + c].to_bits(),
                w.to_bits(),
                "expert {e} ({r}, {c})"
            );
        }
    }

    let scales = tensors.tensor("probe_scales").unwrap();
    let mut bad = scales.data().to_vec();
    bad[2 * 32 * 4 - 1] = 255; // expert 1, row 31, elements 96..128
    let views = [
        ("probe_blocks", tensors.tensor("probe_blocks").unwrap()),
        (
            "probe_scales",
            TensorView::new(scales.dtype(), scales.shape().to_vec(), &bad).unwrap(),
        ),
    ];
    let broken = tempfile::tempdir().unwrap();
    safetensors::serialize_to_file(views, None, &broken.path().join("model.safetensors")).unwrap();
    let ckpt = Checkpoint::open(broken.path()).unwrap();
    assert!(ckpt.mxfp4_rows("probe", [2, 32, 128], 0, (0, 1)).is_ok());
    let msg = ckpt
        .mxfp4_rows("probe", [2, 32, 128], 1, (0, 1))
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("`probe` expert 1: row 31, elements 96..128: scale 255 is e8m0's NaN"),
        "{msg}"
    );
}
