//! GPTQ and AWQ int4 checkpoints, read as transformers and vLLM read them.
//!
//! `config.json`'s `quantization_config` names the format; a linear layer `{prefix}` quantized
//! in it has no `{prefix}.weight` but, for the `[n, k]` matrix (n outputs, k inputs):
//!
//! | tensor | GPTQ (`quant_method: "gptq"`) | AWQ GEMM (`quant_method: "awq"`) |
//! |---|---|---|
//! | `qweight` | i32 `[k / 8, n]`: 8 inputs per word, input `8i + j` in bits `4j..` | i32 `[k, n / 8]`: 8 outputs per word in AWQ's order |
//! | `qzeros` | i32 `[groups, n / 8]`, outputs in bits `4j..`; v1 (`checkpoint_format: "gptq"`) stores zero − 1 | i32 `[groups, n / 8]`, AWQ's order |
//! | `scales` | f16 `[groups, n]` | f16 `[groups, n]` |
//! | `g_idx` | i32 `[k]`: each input's group (act-order, `desc_act`, scatters them) | — |
//!
//! and `w[r][p] = (q[r][p] − zero[g][r]) · scale[g][r]`, `g` the group of input `p`. AWQ packs
//! output `8w + c` of word `w` in nibble `AWQ_NIBBLE[c]` (its pack order `[0, 2, 4, 6, 1, 3, 5,
//! 7]` inverted). Layers left in float (routers, `lm_head`, embeddings, what
//! `modules_to_not_convert` names) keep their `weight`. The matrices load into the kernels'
//! 4-bit panels ([`Int4Panels`]), never widened.

use std::borrow::Cow;
use std::path::Path;

use moeserve_backend::Weight;
use moeserve_backend::cpu::int4::{GroupOf, Int4Panels, Int4Source};
use safetensors::Dtype;
use serde_json::Value;

use super::{Checkpoint, typed};
use crate::{ModelError, Result};

/// Where AWQ keeps output `8w + c` within word `w`: nibble `AWQ_NIBBLE[c]`.
const AWQ_NIBBLE: [usize; 8] = [0, 4, 1, 5, 2, 6, 3, 7];

/// An int4 checkpoint format and its settings.
#[derive(Clone, Debug, PartialEq)]
pub enum Int4Format {
    /// GPTQ (AutoGPTQ, GPTQModel, optimum). `group_size: None` is one group per row (`-1`).
    /// `v1`: zero points stored minus one (`checkpoint_format: "gptq"`, the default), as
    /// opposed to `"gptq_v2"`.
    Gptq { group_size: Option<usize>, v1: bool },
    /// AWQ in its GEMM packing (AutoAWQ's `version: "gemm"`, which the exllama and IPEX
    /// kernels load too).
    Awq { group_size: usize },
}

impl Int4Format {
    /// The format `quantization_config` (of `path`) names, `None` for other methods or none.
    /// Settings the kernels cannot run are refused naming the field.
    pub fn from_config(path: &Path, config: &Value) -> Result<Option<Self>> {
        let Some(q) = config.get("quantization_config") else {
            return Ok(None);
        };
        let method = q.get("quant_method").and_then(Value::as_str);
        if !matches!(method, Some("gptq" | "awq")) {
            return Ok(None);
        }
        let method = method.unwrap_or_default();
        let bad = |message: String| {
            ModelError::config(path, format!("quantization_config ({method}): {message}"))
        };
        // AutoAWQ's own names (`w_bit`, `q_group_size`) beside transformers' ones.
        let field = |names: &[&str]| names.iter().find_map(|n| q.get(*n));
        let bits = field(&["bits", "w_bit"]).and_then(Value::as_i64);
        if bits != Some(4) {
            return Err(bad(format!(
                "`bits` is {}; 4-bit checkpoints are supported (8-bit ones are what `moeserve \
                 quantize` makes in its own format)",
                bits.map_or("missing".into(), |b| b.to_string())
            )));
        }
        let group_size = match field(&["group_size", "q_group_size"]).and_then(Value::as_i64) {
            Some(-1) if method == "gptq" => None,
            Some(g) if g > 0 => Some(g as usize),
            other => {
                return Err(bad(format!(
                    "`group_size` must be a positive integer{}, got {other:?}",
                    if method == "gptq" { " or -1" } else { "" }
                )));
            }
        };
        if method == "gptq" {
            let v1 = match q.get("checkpoint_format").and_then(Value::as_str) {
                None | Some("gptq") => true,
                Some("gptq_v2") => false,
                Some(other) => {
                    return Err(bad(format!(
                        "`checkpoint_format` {other:?} is not supported (\"gptq\" or \"gptq_v2\")"
                    )));
                }
            };
            return Ok(Some(Int4Format::Gptq { group_size, v1 }));
        }
        if q.get("zero_point").and_then(Value::as_bool) == Some(false) {
            return Err(bad(
                "`zero_point: false` is not supported (AWQ GEMM checkpoints \
                            carry zero points)"
                    .into(),
            ));
        }
        let version = q.get("version").and_then(Value::as_str).unwrap_or("gemm");
        if !["gemm", "exllama", "ipex"].contains(&version.to_ascii_lowercase().as_str()) {
            return Err(bad(format!(
                "`version` {version:?} is not supported (the GEMM packing: \"gemm\", which \
                 \"exllama\" and \"ipex\" load too)"
            )));
        }
        Ok(Some(Int4Format::Awq {
            group_size: group_size.expect("AWQ's group size was checked positive"),
        }))
    }
}

impl Checkpoint {
    /// The int4 matrix `{prefix}.weight` (`[n, k]`) of a GPTQ or AWQ checkpoint, when the
    /// checkpoint quantized that layer (it has `{prefix}.qweight`).
    pub(super) fn int4_weight(&self, name: &str, shape: &[usize]) -> Result<Option<Weight>> {
        let (Some(format), Some(prefix)) = (&self.int4, name.strip_suffix(".weight")) else {
            return Ok(None);
        };
        let qweight_name = format!("{prefix}.qweight");
        if !self.tensors.contains_key(&qweight_name) {
            return Ok(None);
        }
        let path = &self.files[self.tensors[&qweight_name].file].0;
        let bad = |message: String| ModelError::config(path, format!("`{prefix}`: {message}"));
        let &[n, k] = shape else {
            return Err(bad(format!(
                "an int4 layer is a matrix, expected shape {shape:?}"
            )));
        };
        if !n.is_multiple_of(8) || !k.is_multiple_of(8) {
            return Err(bad(format!(
                "[{n}, {k}]: int4 layers pack 8 values per i32 word, so both sides are \
                 multiples of 8"
            )));
        }
        let group_size = match format {
            Int4Format::Gptq { group_size, .. } => group_size.unwrap_or(k),
            Int4Format::Awq { group_size } => *group_size,
        };
        let groups = k.div_ceil(group_size);
        let (qweight_shape, awq) = match format {
            Int4Format::Gptq { .. } => ([k / 8, n], false),
            Int4Format::Awq { .. } => ([k, n / 8], true),
        };
        let qweight: Cow<[u32]> = typed(self.raw(&qweight_name, Dtype::I32, &qweight_shape)?);
        let qzeros_name = format!("{prefix}.qzeros");
        let qzeros: Cow<[u32]> = typed(self.raw(&qzeros_name, Dtype::I32, &[groups, n / 8])?);
        // f16 as released (bf16 or f32 read too), widened through the float loader.
        let scales = self
            .weight(&format!("{prefix}.scales"), &[groups, n])?
            .to_f32_vec();
        let group_of = match format {
            Int4Format::Gptq { .. } => self.gptq_groups(prefix, k, group_size)?,
            Int4Format::Awq { .. } => GroupOf::Runs(group_size),
        };
        // Nibble of output r in a word of 8 outputs, and of input p in GPTQ's word of 8 inputs.
        let out_shift = |r: usize| 4 * if awq { AWQ_NIBBLE[r % 8] } else { r % 8 } as u32;
        let nibble = |word: u32, shift: u32| (word >> shift) & 0xF;
        let stored_zero_plus = match format {
            Int4Format::Gptq { v1: true, .. } => 1,
            _ => 0,
        };
        let src = Int4Source {
            code: |r: usize, p: usize| {
                let word = if awq {
                    nibble(qweight[p * (n / 8) + r / 8], out_shift(r))
                } else {
                    nibble(qweight[(p / 8) * n + r], 4 * (p % 8) as u32)
                };
                word as u8
            },
            scale: |g: usize, r: usize| scales[g * n + r],
            zero: |g: usize, r: usize| {
                nibble(qzeros[g * (n / 8) + r / 8], out_shift(r)) + stored_zero_plus
            },
        };
        let panels = Int4Panels::new((n, k), groups, group_of, src).map_err(bad)?;
        Ok(Some(Weight::int4(panels)))
    }

    /// The groups of a GPTQ layer's inputs: its `g_idx` when it has one that is not plain runs
    /// of `group_size` (act-order), else those runs.
    fn gptq_groups(&self, prefix: &str, k: usize, group_size: usize) -> Result<GroupOf> {
        let name = format!("{prefix}.g_idx");
        if !self.tensors.contains_key(&name) {
            return Ok(GroupOf::Runs(group_size));
        }
        let g_idx: Cow<[i32]> = typed(self.raw(&name, Dtype::I32, &[k])?);
        if let Some(p) = g_idx.iter().position(|&g| g < 0) {
            let path = &self.files[self.tensors[&name].file].0;
            let message = format!("`{name}`[{p}] = {} is negative", g_idx[p]);
            return Err(ModelError::config(path, message));
        }
        if g_idx
            .iter()
            .enumerate()
            .all(|(p, &g)| g as usize == p / group_size)
        {
            return Ok(GroupOf::Runs(group_size));
        }
        Ok(GroupOf::Index(g_idx.iter().map(|&g| g as u32).collect()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;
    use safetensors::tensor::TensorView;

    /// The `[n, k]` test matrix: codes, zero points and scales of groups of `group` inputs.
    struct Quantized {
        n: usize,
        k: usize,
        group: usize,
        g_idx: Vec<usize>,
    }

    impl Quantized {
        fn groups(&self) -> usize {
            self.k.div_ceil(self.group)
        }
        fn code(&self, r: usize, p: usize) -> u32 {
            ((r * 5 + p * 3 + r * p / 7) % 16) as u32
        }
        fn zero(&self, g: usize, r: usize) -> u32 {
            ((g * 7 + r * 3) % 15 + 1) as u32
        }
        fn scale(&self, g: usize, r: usize) -> f16 {
            f16::from_f32(0.01 + ((g * 31 + r) % 13) as f32 * 0.003)
        }
        fn value(&self, r: usize, p: usize) -> f32 {
            let g = self.g_idx[p];
            (self.code(r, p) as f32 - self.zero(g, r) as f32) * self.scale(g, r).to_f32()
        }
    }

    fn words(values: impl Iterator<Item = u32>) -> Vec<u8> {
        values.flat_map(u32::to_le_bytes).collect()
    }

    fn write(dir: &Path, config: &str, tensors: Vec<(&str, Dtype, Vec<usize>, Vec<u8>)>) {
        std::fs::write(dir.join("config.json"), config).unwrap();
        let views: Vec<(String, TensorView)> = tensors
            .iter()
            .map(|(name, dtype, shape, data)| {
                let view = TensorView::new(*dtype, shape.clone(), data).unwrap();
                (name.to_string(), view)
            })
            .collect();
        safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    }

    /// GPTQ's tensors of `m`, packed as its description says (v1: zeros stored minus one).
    fn gptq_tensors(m: &Quantized, v1: bool) -> Vec<(&'static str, Dtype, Vec<usize>, Vec<u8>)> {
        let (n, k, g) = (m.n, m.k, m.groups());
        let qweight = (0..k / 8).flat_map(|i| {
            (0..n).map(move |r| (0..8).fold(0, |w, j| w | m.code(r, 8 * i + j) << (4 * j)))
        });
        let stored = |g, r| (m.zero(g, r) - u32::from(v1)) & 0xF;
        let qzeros = (0..g).flat_map(|gr| {
            (0..n / 8).map(move |w| (0..8).fold(0, |acc, j| acc | stored(gr, 8 * w + j) << (4 * j)))
        });
        let scales = (0..g).flat_map(|gr| (0..n).flat_map(move |r| m.scale(gr, r).to_le_bytes()));
        vec![
            ("l.qweight", Dtype::I32, vec![k / 8, n], words(qweight)),
            ("l.qzeros", Dtype::I32, vec![g, n / 8], words(qzeros)),
            ("l.scales", Dtype::F16, vec![g, n], scales.collect()),
            (
                "l.g_idx",
                Dtype::I32,
                vec![k],
                words(m.g_idx.iter().map(|&x| x as u32)),
            ),
        ]
    }

    fn assert_loads_as(dir: &Path, m: &Quantized) {
        let ckpt = Checkpoint::open(dir).unwrap();
        assert!(
            ckpt.contains("l.weight"),
            "the int4 layer stands for its weight"
        );
        let w = ckpt.weight("l.weight", &[m.n, m.k]).unwrap();
        assert_eq!(w.dtype(), moeserve_core::DType::Int4);
        for r in 0..m.n {
            for p in 0..m.k {
                assert_eq!(w.get_f32(r * m.k + p), m.value(r, p), "({r}, {p})");
            }
        }
    }

    #[test]
    fn gptq_layers_unpack_as_the_format_says_with_and_without_act_order() {
        let (n, k, group) = (40, 48, 32); // a partial last group
        let runs = (0..k).map(|p| p / group).collect();
        let act_order = (0..k).map(|p| (p * 29) % k / group).collect();
        for (g_idx, v1) in [(runs, true), (act_order, true)] {
            let m = Quantized { n, k, group, g_idx };
            let dir = tempfile::tempdir().unwrap();
            let config = r#"{"quantization_config": {"quant_method": "gptq", "bits": 4,
                "group_size": 32, "desc_act": true, "sym": false}}"#;
            write(dir.path(), config, gptq_tensors(&m, v1));
            assert_loads_as(dir.path(), &m);
        }
        // gptq_v2 stores the zero points themselves; group_size -1 is one group per row.
        let m = Quantized {
            n,
            k,
            group: k,
            g_idx: vec![0; k],
        };
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"quantization_config": {"quant_method": "gptq", "bits": 4,
            "group_size": -1, "checkpoint_format": "gptq_v2"}}"#;
        write(dir.path(), config, gptq_tensors(&m, false));
        assert_loads_as(dir.path(), &m);
    }

    #[test]
    fn awq_layers_unpack_in_awqs_nibble_order() {
        let (n, k, group) = (24, 64, 32);
        let m = &Quantized {
            n,
            k,
            group,
            g_idx: (0..k).map(|p| p / group).collect(),
        };
        // AutoAWQ's pack: nibble j of a word holds output 8w + ORDER[j].
        const ORDER: [usize; 8] = [0, 2, 4, 6, 1, 3, 5, 7];
        let pack = |value: &dyn Fn(usize) -> u32, w: usize| {
            (0..8).fold(0u32, |acc, j| acc | value(8 * w + ORDER[j]) << (4 * j))
        };
        let qweight = (0..k).flat_map(|p| (0..n / 8).map(move |w| pack(&|r| m.code(r, p), w)));
        let qzeros: Vec<u32> = (0..m.groups())
            .flat_map(|g| (0..n / 8).map(move |w| (g, w)))
            .map(|(g, w)| pack(&|r| m.zero(g, r), w))
            .collect();
        let qweight: Vec<u32> = qweight.collect();
        let scales =
            (0..m.groups()).flat_map(|g| (0..n).flat_map(move |r| m.scale(g, r).to_le_bytes()));
        let dir = tempfile::tempdir().unwrap();
        let config = r#"{"quantization_config": {"quant_method": "awq", "bits": 4,
            "group_size": 32, "zero_point": true, "version": "GEMM"}}"#;
        let tensors = vec![
            (
                "l.qweight",
                Dtype::I32,
                vec![k, n / 8],
                words(qweight.into_iter()),
            ),
            (
                "l.qzeros",
                Dtype::I32,
                vec![2, n / 8],
                words(qzeros.into_iter()),
            ),
            ("l.scales", Dtype::F16, vec![2, n], scales.collect()),
            ("r.weight", Dtype::F16, vec![8, 8], vec![0; 128]),
        ];
        write(dir.path(), config, tensors);
        assert_loads_as(dir.path(), m);
        // A layer left in float loads as stored.
        let ckpt = Checkpoint::open(dir.path()).unwrap();
        assert_eq!(
            ckpt.weight("r.weight", &[8, 8]).unwrap().dtype(),
            moeserve_core::DType::F16
        );
    }

    #[test]
    fn unsupported_settings_and_broken_layers_are_named() {
        let config = |q: &str| {
            serde_json::from_str::<Value>(&format!(r#"{{"quantization_config": {q}}}"#)).unwrap()
        };
        let refuse = |q: &str| {
            Int4Format::from_config(Path::new("m/config.json"), &config(q))
                .unwrap_err()
                .to_string()
        };
        let e = refuse(r#"{"quant_method": "gptq", "bits": 8, "group_size": 128}"#);
        assert!(
            e.contains("m/config.json") && e.contains("`bits` is 8"),
            "{e}"
        );
        let e =
            refuse(r#"{"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}"#);
        assert!(e.contains("`version` \"gemv\""), "{e}");
        let e = refuse(r#"{"quant_method": "awq", "bits": 4, "group_size": -1}"#);
        assert!(e.contains("`group_size` must be a positive integer"), "{e}");
        let e = refuse(
            r#"{"quant_method": "gptq", "bits": 4, "group_size": 64, "checkpoint_format": "marlin"}"#,
        );
        assert!(e.contains("\"marlin\""), "{e}");
        assert_eq!(
            Int4Format::from_config(Path::new("c"), &config(r#"{"quant_method": "fp8"}"#)).unwrap(),
            None
        );

        // A g_idx naming a group past the scales' rows, and qzeros of the wrong shape.
        let (n, k, group) = (8, 16, 8);
        let m = Quantized {
            n,
            k,
            group,
            g_idx: (0..k).map(|p| p / group).collect(),
        };
        let gptq =
            r#"{"quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 8}}"#;
        let dir = tempfile::tempdir().unwrap();
        let load_error = |tensors| {
            write(dir.path(), gptq, tensors);
            let ckpt = Checkpoint::open(dir.path()).unwrap();
            ckpt.weight("l.weight", &[n, k]).unwrap_err().to_string()
        };
        let mut tensors = gptq_tensors(&m, true);
        tensors[3].3 = words((0..k as u32).map(|p| if p == 5 { 9 } else { p / 8 }));
        let e = load_error(tensors);
        assert!(
            e.contains("`l`: g_idx[5] = 9 but there are 2 groups"),
            "{e}"
        );
        let mut tensors = gptq_tensors(&m, true);
        tensors[1].2 = vec![1, 1];
        tensors[1].3.truncate(4);
        let e = load_error(tensors);
        assert!(
            e.contains("`l.qzeros` has shape [1, 1], expected [2, 1]"),
            "{e}"
        );
    }
}
