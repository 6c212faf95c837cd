//! GGUF reading and GGUF → Mixtral upcycling against fixtures made with gguf-py and llama.cpp.
//!
//! - `tests/fixtures/gguf-blocks/`: 64 real Q4_1 and Q8_0 blocks from the SmolLM2 GGUF with
//!   the values `gguf.quants.dequantize` gives; ours must equal them bit for bit.
//! - `tests/fixtures/llama-tiny-gguf/`: a 2-layer dense llama GGUF (Q4_1 matrices with
//!   llama.cpp-permuted q/k, Q8_0 tied embeddings, SmolLM2's tokenizer) and the ids llama.cpp's
//!   tokenizer gives for `tokenizer_cases.json`.

use std::path::{Path, PathBuf};

use half::bf16;
use moeserve_core::DType;
use moeserve_formats::convert::{UpcycleOptions, UpcycleReport, upcycle_gguf};
use moeserve_formats::gguf::{GgmlType, GgufBuilder, GgufFile, GgufValue, dequantize};
use safetensors::SafeTensors;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

fn tiny_gguf() -> PathBuf {
    fixtures().join("llama-tiny-gguf/model.gguf")
}

fn read_f32_le(path: &Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("read f32 fixture");
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn assert_bit_identical(ours: &[f32], expected: &[f32], what: &str) {
    assert_eq!(ours.len(), expected.len(), "{what}: length");
    for (i, (a, b)) in ours.iter().zip(expected).enumerate() {
        assert_eq!(
            a.to_bits(),
            b.to_bits(),
            "{what}: element {i}: {a} vs gguf-py {b}"
        );
    }
}

#[test]
fn q4_1_blocks_dequantise_exactly_as_gguf_py() {
    let dir = fixtures().join("gguf-blocks");
    let blocks = std::fs::read(dir.join("q4_1.bin")).expect("q4_1.bin");
    assert_eq!(blocks.len(), 64 * 20);
    let ours = dequantize(GgmlType::Q4_1, &blocks).expect("Q4_1 decodes");
    assert_bit_identical(&ours, &read_f32_le(&dir.join("q4_1.f32")), "Q4_1");
}

#[test]
fn q8_0_blocks_dequantise_exactly_as_gguf_py() {
    let dir = fixtures().join("gguf-blocks");
    let blocks = std::fs::read(dir.join("q8_0.bin")).expect("q8_0.bin");
    assert_eq!(blocks.len(), 64 * 34);
    let ours = dequantize(GgmlType::Q8_0, &blocks).expect("Q8_0 decodes");
    assert_bit_identical(&ours, &read_f32_le(&dir.join("q8_0.f32")), "Q8_0");
}

struct Converted {
    _dir: tempfile::TempDir,
    out: PathBuf,
    report: UpcycleReport,
    bytes: Vec<u8>,
}

impl Converted {
    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("valid safetensors")
    }

    /// A tensor's values as f32, whatever dtype it was written in.
    fn values(&self, name: &str) -> Vec<f32> {
        let tensors = self.tensors();
        let view = tensors
            .tensor(name)
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        match view.dtype() {
            safetensors::Dtype::F32 => view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            safetensors::Dtype::BF16 => view
                .data()
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            other => panic!("{name}: unexpected dtype {other:?}"),
        }
    }

    fn shape(&self, name: &str) -> Vec<usize> {
        self.tensors()
            .tensor(name)
            .expect("tensor present")
            .shape()
            .to_vec()
    }
}

fn convert(options: impl FnOnce(&mut UpcycleOptions)) -> Converted {
    let dir = tempfile::tempdir().expect("temp dir");
    let out = dir.path().join("upcycled");
    let mut opts = UpcycleOptions {
        gguf: tiny_gguf(),
        out: out.clone(),
        num_experts: 4,
        top_k: 2,
        seed: 0,
        expert_jitter: 0.0,
        dtype: DType::F32,
    };
    options(&mut opts);
    let report = upcycle_gguf(&opts).expect("conversion succeeds");
    let bytes = std::fs::read(out.join("model.safetensors")).expect("single safetensors file");
    Converted {
        _dir: dir,
        out,
        report,
        bytes,
    }
}

/// llama.cpp's `LlamaModel.permute`, written from its numpy definition
/// `w.reshape(n_head, 2, rows / n_head / 2, cols).swapaxes(1, 2).reshape(rows, cols)`:
/// output index (h, j, i, c) reads input index (h, i, j, c).
fn llama_cpp_permute(w: &[f32], n_head: usize, cols: usize) -> Vec<f32> {
    let half = w.len() / cols / n_head / 2;
    let mut out = vec![0.0; w.len()];
    for h in 0..n_head {
        for j in 0..half {
            for i in 0..2 {
                for c in 0..cols {
                    let dst = ((h * half + j) * 2 + i) * cols + c;
                    let src = ((h * 2 + i) * half + j) * cols + c;
                    out[dst] = w[src];
                }
            }
        }
    }
    out
}

#[test]
fn converted_tensors_equal_the_dequantised_gguf() {
    let converted = convert(|_| {});
    let gguf = GgufFile::open(tiny_gguf()).expect("fixture opens");
    let deq = |name: &str| gguf.tensor_f32(name).expect("dequantise");
    let same = |hf: &str, gguf_name: &str| {
        assert_bit_identical(&converted.values(hf), &deq(gguf_name), hf)
    };

    same("model.embed_tokens.weight", "token_embd.weight");
    same("model.norm.weight", "output_norm.weight");
    for l in 0..2 {
        let layer = format!("model.layers.{l}");
        same(
            &format!("{layer}.input_layernorm.weight"),
            &format!("blk.{l}.attn_norm.weight"),
        );
        same(
            &format!("{layer}.post_attention_layernorm.weight"),
            &format!("blk.{l}.ffn_norm.weight"),
        );
        same(
            &format!("{layer}.self_attn.v_proj.weight"),
            &format!("blk.{l}.attn_v.weight"),
        );
        same(
            &format!("{layer}.self_attn.o_proj.weight"),
            &format!("blk.{l}.attn_output.weight"),
        );
        for e in 0..4 {
            let expert = format!("{layer}.block_sparse_moe.experts.{e}");
            same(
                &format!("{expert}.w1.weight"),
                &format!("blk.{l}.ffn_gate.weight"),
            );
            same(
                &format!("{expert}.w2.weight"),
                &format!("blk.{l}.ffn_down.weight"),
            );
            same(
                &format!("{expert}.w3.weight"),
                &format!("blk.{l}.ffn_up.weight"),
            );
        }
        // q/k come back in HF order: permuting them as llama.cpp does gives the GGUF tensor.
        for (proj, blk, heads) in [("q_proj", "attn_q", 4), ("k_proj", "attn_k", 2)] {
            let hf = converted.values(&format!("{layer}.self_attn.{proj}.weight"));
            let gguf_values = deq(&format!("blk.{l}.{blk}.weight"));
            assert_ne!(
                hf, gguf_values,
                "{proj} must not be copied in llama.cpp's order"
            );
            assert_bit_identical(&llama_cpp_permute(&hf, heads, 64), &gguf_values, proj);
        }
        assert_eq!(
            converted.shape(&format!("{layer}.block_sparse_moe.gate.weight")),
            vec![4, 64]
        );
        assert_eq!(
            converted.shape(&format!("{layer}.self_attn.k_proj.weight")),
            vec![32, 64]
        );
        assert_eq!(
            converted.shape(&format!("{layer}.block_sparse_moe.experts.0.w2.weight")),
            vec![64, 128]
        );
    }
    assert!(
        converted.tensors().tensor("lm_head.weight").is_err(),
        "tied embeddings: no lm_head"
    );
    assert_eq!(converted.tensors().len(), 1 + 1 + 2 * (7 + 4 * 3));
    assert_eq!(
        converted.report.num_parameters,
        converted.report.spec.num_parameters()
    );
}

#[test]
fn converted_config_describes_the_upcycled_model() {
    let converted = convert(|_| {});
    let text = std::fs::read_to_string(converted.out.join("config.json")).expect("config.json");
    let config: serde_json::Value = serde_json::from_str(&text).expect("json");
    assert_eq!(config["architectures"][0], "MixtralForCausalLM");
    for (key, value) in [
        ("hidden_size", 64),
        ("intermediate_size", 128),
        ("num_hidden_layers", 2),
        ("num_attention_heads", 4),
        ("num_key_value_heads", 2),
        ("head_dim", 16),
        ("num_local_experts", 4),
        ("num_experts_per_tok", 2),
        ("vocab_size", 49152),
        ("max_position_embeddings", 256),
        ("bos_token_id", 1),
        ("eos_token_id", 2),
    ] {
        assert_eq!(config[key], value, "{key}");
    }
    assert_eq!(config["rope_theta"], 100000.0);
    assert_eq!(config["rms_norm_eps"], 1e-5);
    assert_eq!(config["tie_word_embeddings"], true);
    assert_eq!(config["torch_dtype"], "float32");
    assert!(config["sliding_window"].is_null());
    let parsed =
        moeserve_model::config::ModelConfig::from_dir(&converted.out).expect("crate reads it");
    assert!(parsed.tie_word_embeddings);

    let generation: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(converted.out.join("generation_config.json")).expect("read"),
    )
    .expect("json");
    assert_eq!(
        (
            generation["bos_token_id"].as_u64(),
            generation["eos_token_id"].as_u64()
        ),
        (Some(1), Some(2))
    );
    let template =
        std::fs::read_to_string(converted.out.join("chat_template.jinja")).expect("template");
    assert!(template.contains("<|im_start|>"));
    let tokenizer_config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(converted.out.join("tokenizer_config.json")).expect("read"),
    )
    .expect("json");
    assert_eq!(
        tokenizer_config["chat_template"].as_str(),
        Some(template.as_str())
    );
    assert_eq!(tokenizer_config["bos_token"], "<|im_start|>");
    assert_eq!(tokenizer_config["eos_token"], "<|im_end|>");
    assert_eq!(tokenizer_config["add_bos_token"], false);
}

fn read_cases(file: &str) -> Vec<serde_json::Value> {
    let path = fixtures().join("llama-tiny-gguf").join(file);
    serde_json::from_str(&std::fs::read_to_string(&path).expect("read cases")).expect("cases json")
}

fn ids_of(case: &serde_json::Value) -> Vec<u32> {
    let ids = case["ids"].as_array().expect("ids");
    ids.iter()
        .map(|id| id.as_u64().expect("id") as u32)
        .collect()
}

#[test]
fn built_tokenizer_encodes_like_llama_cpp() {
    let converted = convert(|_| {});
    let tokenizer =
        tokenizers::Tokenizer::from_file(converted.out.join("tokenizer.json")).expect("loads");
    let cases = read_cases("tokenizer_cases.json");
    assert!(cases.len() >= 10);
    for case in &cases {
        let text = case["text"].as_str().expect("text");
        let ids = tokenizer
            .encode(text, false)
            .expect("encode")
            .get_ids()
            .to_vec();
        assert_eq!(ids, ids_of(case), "ids of {text:?}");
        let decoded = tokenizer.decode(&ids, false).expect("decode");
        assert_eq!(
            Some(decoded.as_str()),
            case["decoded"].as_str(),
            "decoding {text:?}"
        );
    }
    // Rendered chat prompts mix special tokens, newlines and text.
    for case in read_cases("chat_cases.json") {
        let rendered = case["rendered"].as_str().expect("rendered");
        let ids = tokenizer
            .encode(rendered, false)
            .expect("encode")
            .get_ids()
            .to_vec();
        assert_eq!(ids, ids_of(&case), "ids of {rendered:?}");
    }
}

#[test]
fn jitter_makes_experts_differ_and_zero_jitter_keeps_exact_copies() {
    let plain = convert(|o| o.dtype = DType::BF16);
    let jittered = convert(|o| {
        o.dtype = DType::BF16;
        o.expert_jitter = 0.05;
        o.seed = 11;
    });
    let w1 = |c: &Converted, e: usize| {
        c.values(&format!(
            "model.layers.1.block_sparse_moe.experts.{e}.w1.weight"
        ))
    };
    for e in 1..4 {
        assert_eq!(
            w1(&plain, 0),
            w1(&plain, e),
            "expert {e} is a copy without jitter"
        );
        assert_ne!(
            w1(&jittered, 0),
            w1(&jittered, e),
            "expert {e} differs with jitter"
        );
    }
    // Relative noise of 5 %: every weight keeps its sign, the whole tensor stays close.
    let (dense, noisy) = (w1(&plain, 2), w1(&jittered, 2));
    let norm = |v: &[f32]| v.iter().map(|x| x * x).sum::<f32>().sqrt();
    let diff: Vec<f32> = dense.iter().zip(&noisy).map(|(a, b)| a - b).collect();
    let relative = norm(&diff) / norm(&dense);
    assert!(
        (0.02..0.08).contains(&relative),
        "relative change {relative}"
    );
    assert!(dense.iter().zip(&noisy).all(|(a, b)| a * b >= 0.0));
    // Attention is untouched by jitter; the router depends only on the seed.
    let q = "model.layers.0.self_attn.q_proj.weight";
    assert_eq!(plain.values(q), jittered.values(q));
    let again = convert(|o| {
        o.dtype = DType::BF16;
        o.expert_jitter = 0.05;
        o.seed = 11;
    });
    assert_eq!(again.bytes, jittered.bytes, "same options, same bytes");
}

#[test]
fn bf16_output_is_the_rounded_dequantised_value() {
    let converted = convert(|o| o.dtype = DType::BF16);
    let gguf = GgufFile::open(tiny_gguf()).expect("fixture opens");
    let exact = gguf
        .tensor_f32("blk.0.ffn_down.weight")
        .expect("dequantise");
    let rounded: Vec<f32> = exact.iter().map(|&v| bf16::from_f32(v).to_f32()).collect();
    let ours = converted.values("model.layers.0.block_sparse_moe.experts.3.w2.weight");
    assert_bit_identical(&ours, &rounded, "bf16 w2");
}

#[test]
fn router_logits_have_unit_scale_on_normed_inputs() {
    let converted = convert(|o| o.num_experts = 8);
    let gguf = GgufFile::open(tiny_gguf()).expect("fixture opens");
    let norm = gguf.tensor_f32("blk.0.ffn_norm.weight").expect("norm");
    let router = converted.values("model.layers.0.block_sparse_moe.gate.weight");
    assert_eq!(router.len(), 8 * 64);
    // Logit variance for a unit-RMS input n is Σ_i (w_i g_i)² on average over rows.
    let per_expert: Vec<f32> = router
        .chunks(64)
        .map(|row| {
            row.iter()
                .zip(&norm)
                .map(|(w, g)| (w * g).powi(2))
                .sum::<f32>()
        })
        .collect();
    let mean = per_expert.iter().sum::<f32>() / 8.0;
    assert!((0.5..2.0).contains(&mean), "router logit variance {mean}");
}

#[test]
fn one_expert_conversion_is_the_dense_model() {
    let converted = convert(|o| {
        o.num_experts = 1;
        o.top_k = 1;
    });
    let gguf = GgufFile::open(tiny_gguf()).expect("fixture opens");
    assert_eq!(
        converted.shape("model.layers.0.block_sparse_moe.gate.weight"),
        vec![1, 64]
    );
    assert_bit_identical(
        &converted.values("model.layers.1.block_sparse_moe.experts.0.w3.weight"),
        &gguf.tensor_f32("blk.1.ffn_up.weight").expect("dequantise"),
        "w3",
    );
    assert!(
        converted
            .tensors()
            .tensor("model.layers.0.block_sparse_moe.experts.1.w1.weight")
            .is_err()
    );
}

/// The fixture rebuilt with `edit` applied to each metadata value and tensor.
fn rebuilt_fixture(
    dir: &Path,
    edit_metadata: impl Fn(&str, &GgufValue) -> GgufValue,
    edit_tensor: impl Fn(&str, GgmlType, &[u8]) -> (GgmlType, Vec<u8>),
) -> PathBuf {
    let gguf = GgufFile::open(tiny_gguf()).expect("fixture opens");
    let mut builder = GgufBuilder::new();
    for (key, value) in gguf.metadata() {
        builder.metadata(key, edit_metadata(key, value));
    }
    for info in gguf.tensors() {
        let (ty, data) = edit_tensor(
            &info.name,
            info.ggml_type,
            gguf.tensor_bytes(&info.name).expect("bytes"),
        );
        builder.tensor(&info.name, &info.shape, ty, data);
    }
    let path = dir.join("edited.gguf");
    builder.write(&path).expect("write edited gguf");
    path
}

fn convert_file(gguf: PathBuf, out: PathBuf) -> moeserve_formats::Result<UpcycleReport> {
    upcycle_gguf(&UpcycleOptions {
        gguf,
        out,
        num_experts: 2,
        top_k: 1,
        seed: 0,
        expert_jitter: 0.0,
        dtype: DType::BF16,
    })
}

#[test]
fn rebuilt_fixture_converts_like_the_original() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = rebuilt_fixture(
        dir.path(),
        |_, v| v.clone(),
        |_, ty, data| (ty, data.to_vec()),
    );
    let report = convert_file(path, dir.path().join("out")).expect("unchanged copy converts");
    assert_eq!(report.spec.num_hidden_layers, 2);
}

#[test]
fn unsupported_tensor_type_is_a_clear_error() {
    let dir = tempfile::tempdir().expect("temp dir");
    // blk.0.ffn_up.weight holds 128 × 64 = 8192 values: 32 Q4_K blocks of 144 bytes.
    let path = rebuilt_fixture(
        dir.path(),
        |_, v| v.clone(),
        |name, ty, data| match name {
            "blk.0.ffn_up.weight" => (GgmlType::Q4K, vec![0; 32 * 144]),
            _ => (ty, data.to_vec()),
        },
    );
    let err = convert_file(path, dir.path().join("out"))
        .expect_err("Q4_K is not supported")
        .to_string();
    assert!(
        err.contains("blk.0.ffn_up.weight") && err.contains("Q4_K") && err.contains("edited.gguf"),
        "{err}"
    );
    assert!(!dir.path().join("out/model.safetensors").exists());
}

#[test]
fn unsupported_architecture_and_pre_tokenizer_are_named() {
    let dir = tempfile::tempdir().expect("temp dir");
    let replace = |target: &'static str, with: &'static str| {
        move |key: &str, value: &GgufValue| match key == target {
            true => GgufValue::String(with.to_string()),
            false => value.clone(),
        }
    };
    let keep = |_: &str, ty: GgmlType, data: &[u8]| (ty, data.to_vec());
    let path = rebuilt_fixture(dir.path(), replace("general.architecture", "qwen2"), keep);
    let err = convert_file(path, dir.path().join("a"))
        .expect_err("qwen2")
        .to_string();
    assert!(err.contains("qwen2") && err.contains("llama"), "{err}");

    let path = rebuilt_fixture(dir.path(), replace("tokenizer.ggml.pre", "llama-bpe"), keep);
    let err = convert_file(path, dir.path().join("b"))
        .expect_err("llama-bpe")
        .to_string();
    assert!(
        err.contains("`llama-bpe`") && err.contains("tokenizer.ggml.pre"),
        "{err}"
    );
}

#[test]
fn invalid_options_are_rejected_before_reading() {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut options = UpcycleOptions {
        gguf: tiny_gguf(),
        out: dir.path().join("out"),
        num_experts: 4,
        top_k: 5,
        seed: 0,
        expert_jitter: 0.0,
        dtype: DType::BF16,
    };
    let err = upcycle_gguf(&options)
        .expect_err("top_k > num_experts")
        .to_string();
    assert!(err.contains("top_k"), "{err}");
    options.top_k = 2;
    options.expert_jitter = f32::NAN;
    assert!(upcycle_gguf(&options).is_err());
    assert!(!dir.path().join("out").exists());
}

#[test]
fn truncated_gguf_is_reported_with_its_path() {
    let dir = tempfile::tempdir().expect("temp dir");
    let bytes = std::fs::read(tiny_gguf()).expect("fixture");
    let path = dir.path().join("cut.gguf");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("write truncated copy");
    let err = GgufFile::open(&path).expect_err("truncated").to_string();
    assert!(
        err.contains("cut.gguf") && err.contains("truncated"),
        "{err}"
    );
    std::fs::write(&path, b"GGUF").expect("write header stub");
    let err = GgufFile::open(&path).expect_err("header only").to_string();
    assert!(err.contains("version"), "{err}");
}
