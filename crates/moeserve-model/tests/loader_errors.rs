//! A broken checkpoint is refused with a message that names the file and what is wrong.

mod common;

use std::path::Path;

use common::fixtures_dir;
use moeserve_model::models::MoeModel;
use safetensors::SafeTensors;
use safetensors::tensor::TensorView;

/// A copy of the `mixtral-swa` fixture whose tensors pass through `edit` first.
fn broken_copy(
    edit: impl for<'a> Fn(&str, TensorView<'a>) -> Option<(String, TensorView<'a>)>,
) -> tempfile::TempDir {
    let src = fixtures_dir().join("mixtral-swa");
    let dir = tempfile::tempdir().unwrap();
    std::fs::copy(src.join("config.json"), dir.path().join("config.json")).unwrap();
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let views: Vec<(String, TensorView)> = st
        .tensors()
        .into_iter()
        .filter_map(|(n, v)| edit(&n, v))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.path().join("model.safetensors")).unwrap();
    dir
}

fn load_error(dir: &Path) -> String {
    match MoeModel::load(dir) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn missing_tensor_is_named() {
    let dir = broken_copy(|n, v| {
        (n != "model.layers.1.block_sparse_moe.experts.3.w2.weight").then(|| (n.to_string(), v))
    });
    let msg = load_error(dir.path());
    assert!(
        msg.contains("missing tensor `model.layers.1.block_sparse_moe.experts.3.w2.weight`"),
        "{msg}"
    );
}

#[test]
fn wrong_shape_is_named_with_both_shapes() {
    let dir = broken_copy(|n, v| {
        if n == "model.layers.0.self_attn.q_proj.weight" {
            let shape = v.shape().iter().rev().copied().collect::<Vec<_>>();
            let t = TensorView::new(v.dtype(), vec![shape[0] / 2, shape[1] * 2], v.data()).unwrap();
            Some((n.to_string(), t))
        } else {
            Some((n.to_string(), v))
        }
    });
    let msg = load_error(dir.path());
    assert!(
        msg.contains("model.safetensors")
            && msg.contains("`model.layers.0.self_attn.q_proj.weight` has shape"),
        "{msg}"
    );
}

#[test]
fn unsupported_dtype_is_named() {
    let dir = broken_copy(|n, v| {
        let dtype = if n == "model.norm.weight" {
            safetensors::Dtype::I16
        } else {
            v.dtype()
        };
        Some((
            n.to_string(),
            TensorView::new(dtype, v.shape().to_vec(), v.data()).unwrap(),
        ))
    });
    let msg = load_error(dir.path());
    assert!(
        msg.contains("`model.norm.weight` has unsupported dtype I16"),
        "{msg}"
    );
}

#[test]
fn missing_config_field_is_named() {
    let dir = broken_copy(|n, v| Some((n.to_string(), v)));
    let path = dir.path().join("config.json");
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    config.as_object_mut().unwrap().remove("num_local_experts");
    std::fs::write(&path, config.to_string()).unwrap();
    let msg = load_error(dir.path());
    assert!(
        msg.contains("config.json") && msg.contains("missing field `num_local_experts`"),
        "{msg}"
    );
}

#[test]
fn truncated_safetensors_is_reported() {
    let dir = broken_copy(|n, v| Some((n.to_string(), v)));
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let msg = load_error(dir.path());
    assert!(
        msg.contains("model.safetensors") && msg.contains("invalid safetensors file"),
        "{msg}"
    );
}

#[test]
fn missing_shard_is_named() {
    let src = fixtures_dir().join("mixtral-sharded");
    let dir = tempfile::tempdir().unwrap();
    for f in [
        "config.json",
        "model.safetensors.index.json",
        "model-00001-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    ] {
        std::fs::copy(src.join(f), dir.path().join(f)).unwrap();
    }
    let msg = load_error(dir.path());
    assert!(msg.contains("model-00002-of-00003.safetensors"), "{msg}");
}
