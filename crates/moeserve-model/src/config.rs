//! HF `config.json` of Mixtral-class models (`MixtralForCausalLM`).
//!
//! Follows transformers' `MixtralConfig`: `rope_theta` may sit at the top level or, as in
//! transformers ≥ 5, inside `rope_parameters`; `head_dim` defaults to `hidden_size / heads`.

use std::path::Path;

use moeserve_core::DType;
use serde_json::Value;

use crate::{ModelError, Result};

/// Architectures this crate implements.
pub const SUPPORTED_ARCHITECTURES: &str = "MixtralForCausalLM";

/// The model hyper-parameters the forward pass needs.
#[derive(Clone, Debug, PartialEq)]
pub struct MixtralConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: usize,
    pub num_local_experts: usize,
    pub num_experts_per_tok: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    /// Attend to at most this many most recent positions (the query's own included).
    pub sliding_window: Option<usize>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    /// `torch_dtype` / `dtype` as declared; the tensors' own dtypes are what is used.
    pub dtype: Option<DType>,
}

impl MixtralConfig {
    /// Reads and validates `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| ModelError::io(&path, e))?;
        Self::from_json_str(&text, &path)
    }

    /// Parses config JSON; `path` is only used in error messages.
    pub fn from_json_str(text: &str, path: &Path) -> Result<Self> {
        let json: Value = serde_json::from_str(text)
            .map_err(|e| ModelError::config(path, format!("invalid JSON: {e}")))?;
        let fields = ConfigFields { json: &json, path };
        fields.check_architecture()?;
        let hidden_size = fields.usize("hidden_size")?;
        let num_attention_heads = fields.usize("num_attention_heads")?;
        let head_dim = match fields.opt_usize("head_dim")? {
            Some(d) => d,
            None => hidden_size / num_attention_heads.max(1),
        };
        let config = MixtralConfig {
            vocab_size: fields.usize("vocab_size")?,
            hidden_size,
            intermediate_size: fields.usize("intermediate_size")?,
            num_hidden_layers: fields.usize("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: fields
                .opt_usize("num_key_value_heads")?
                .unwrap_or(num_attention_heads),
            head_dim,
            num_local_experts: fields.usize("num_local_experts")?,
            num_experts_per_tok: fields.usize("num_experts_per_tok")?,
            rms_norm_eps: fields.opt_f64("rms_norm_eps")?.unwrap_or(1e-5) as f32,
            rope_theta: fields.rope_theta()?,
            sliding_window: fields.opt_usize("sliding_window")?,
            max_position_embeddings: fields
                .opt_usize("max_position_embeddings")?
                .unwrap_or(4096 * 32),
            tie_word_embeddings: fields.opt_bool("tie_word_embeddings")?.unwrap_or(false),
            dtype: fields.dtype(),
        };
        config.validate(path)?;
        Ok(config)
    }

    fn validate(&self, path: &Path) -> Result<()> {
        let bad = |msg: String| Err(ModelError::config(path, msg));
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
            ("num_local_experts", self.num_local_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
        ] {
            if v == 0 {
                return bad(format!("`{name}` must be at least 1"));
            }
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "`num_attention_heads` ({}) must be a multiple of `num_key_value_heads` ({})",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "`head_dim` ({}) must be even for rotary embeddings",
                self.head_dim
            ));
        }
        if self.num_experts_per_tok > self.num_local_experts {
            return bad(format!(
                "`num_experts_per_tok` ({}) exceeds `num_local_experts` ({})",
                self.num_experts_per_tok, self.num_local_experts
            ));
        }
        if self.sliding_window == Some(0) {
            return bad("`sliding_window` must be at least 1 or null".to_string());
        }
        Ok(())
    }

    /// Key/value width of one token in one layer: `num_key_value_heads * head_dim`.
    pub fn kv_dim(&self) -> usize {
        self.num_key_value_heads * self.head_dim
    }

    /// Query width: `num_attention_heads * head_dim`.
    pub fn q_dim(&self) -> usize {
        self.num_attention_heads * self.head_dim
    }
}

/// Typed access to config fields with errors that name the field.
struct ConfigFields<'a> {
    json: &'a Value,
    path: &'a Path,
}

impl ConfigFields<'_> {
    fn err(&self, msg: String) -> ModelError {
        ModelError::config(self.path, msg)
    }

    fn check_architecture(&self) -> Result<()> {
        let archs = self.json.get("architectures").and_then(Value::as_array);
        let model_type = self.json.get("model_type").and_then(Value::as_str);
        let found: Vec<&str> = archs
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if found.contains(&"MixtralForCausalLM")
            || (found.is_empty() && model_type == Some("mixtral"))
        {
            return Ok(());
        }
        let found = if found.is_empty() {
            format!("model_type {}", model_type.unwrap_or("<missing>"))
        } else {
            found.join(", ")
        };
        Err(ModelError::UnsupportedArchitecture {
            path: self.path.to_path_buf(),
            found,
            supported: SUPPORTED_ARCHITECTURES,
        })
    }

    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_u64().map(|n| Some(n as usize)).ok_or_else(|| {
                self.err(format!(
                    "field `{key}` must be a non-negative integer, got {v}"
                ))
            }),
        }
    }

    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| self.err(format!("missing field `{key}`")))
    }

    fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be a number, got {v}"))),
        }
    }

    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.json.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| self.err(format!("field `{key}` must be true or false, got {v}"))),
        }
    }

    /// `rope_theta`, or `rope_parameters.rope_theta` (transformers ≥ 5); default 1e6 as Mixtral.
    fn rope_theta(&self) -> Result<f64> {
        if let Some(t) = self.opt_f64("rope_theta")? {
            return Ok(t);
        }
        if let Some(params) = self.json.get("rope_parameters").filter(|v| !v.is_null()) {
            if let Some(kind) = params.get("rope_type").and_then(Value::as_str)
                && kind != "default"
            {
                return Err(self.err(format!(
                    "rope_parameters.rope_type {kind:?} is not supported (only \"default\")"
                )));
            }
            return params
                .get("rope_theta")
                .and_then(Value::as_f64)
                .ok_or_else(|| {
                    self.err("field `rope_parameters.rope_theta` must be a number".to_string())
                });
        }
        Ok(1e6)
    }

    fn dtype(&self) -> Option<DType> {
        ["torch_dtype", "dtype"].iter().find_map(|k| {
            self.json
                .get(*k)
                .and_then(Value::as_str)
                .and_then(DType::parse)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str = r#"{"architectures":["MixtralForCausalLM"],"vocab_size":32,"hidden_size":16,
        "intermediate_size":32,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,
        "num_local_experts":4,"num_experts_per_tok":2,"rms_norm_eps":1e-5,"rope_theta":10000.0,
        "sliding_window":null,"tie_word_embeddings":false,"torch_dtype":"bfloat16"}"#;

    fn parse(text: &str) -> Result<MixtralConfig> {
        MixtralConfig::from_json_str(text, Path::new("dir/config.json"))
    }

    #[test]
    fn parses_mixtral_fields_with_defaults() {
        let c = parse(BASE).unwrap();
        assert_eq!(c.head_dim, 4);
        assert_eq!(c.kv_dim(), 8);
        assert_eq!(c.sliding_window, None);
        assert_eq!(c.dtype, Some(DType::BF16));
    }

    #[test]
    fn reads_rope_theta_from_rope_parameters() {
        let text = BASE.replace(
            r#""rope_theta":10000.0,"#,
            r#""rope_parameters":{"rope_theta":5e5,"rope_type":"default"},"#,
        );
        assert_eq!(parse(&text).unwrap().rope_theta, 5e5);
    }

    #[test]
    fn missing_field_is_named_with_path() {
        let text = BASE.replace(r#""hidden_size":16,"#, "");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(
            msg.contains("dir/config.json") && msg.contains("missing field `hidden_size`"),
            "{msg}"
        );
    }

    #[test]
    fn other_architecture_is_refused() {
        let text = BASE.replace("MixtralForCausalLM", "BertModel");
        let msg = parse(&text).unwrap_err().to_string();
        assert!(
            msg.contains("BertModel") && msg.contains("not supported"),
            "{msg}"
        );
    }

    #[test]
    fn wrong_type_and_inconsistent_heads_are_refused() {
        let msg = parse(&BASE.replace(r#""vocab_size":32"#, r#""vocab_size":"big""#))
            .unwrap_err()
            .to_string();
        assert!(
            msg.contains("`vocab_size` must be a non-negative integer"),
            "{msg}"
        );
        let msg = parse(&BASE.replace(r#""num_key_value_heads":2"#, r#""num_key_value_heads":3"#))
            .unwrap_err()
            .to_string();
        assert!(msg.contains("multiple of `num_key_value_heads`"), "{msg}");
    }
}
