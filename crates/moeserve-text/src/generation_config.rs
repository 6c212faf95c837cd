//! `generation_config.json`: the model's end-of-sequence ids and default sampling settings.
//!
//! Follows HF transformers: `eos_token_id` may be one id or a list (Llama 3 style); when
//! `generation_config.json` lacks it, `config.json`'s value is used. Defaults are read for the
//! same keys vLLM takes from it (temperature, top_p, top_k, min_p, repetition_penalty,
//! max_new_tokens). Missing files are fine; malformed ones are errors naming the file.

use std::path::Path;

use serde_json::Value;

use crate::{Result, TextError};

pub const GENERATION_CONFIG_FILE: &str = "generation_config.json";
pub const MODEL_CONFIG_FILE: &str = "config.json";

#[derive(Clone, Debug, Default, PartialEq)]
pub struct GenerationConfig {
    /// Tokens that end a sequence (empty when the model declares none).
    pub eos_token_ids: Vec<u32>,
    pub bos_token_id: Option<u32>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub max_new_tokens: Option<usize>,
    /// HF's `do_sample`; `Some(false)` means the model's authors expect greedy decoding.
    pub do_sample: Option<bool>,
}

impl GenerationConfig {
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<GenerationConfig> {
        let dir = dir.as_ref();
        let gen_path = dir.join(GENERATION_CONFIG_FILE);
        let model_path = dir.join(MODEL_CONFIG_FILE);
        let mut config = match read_json_object(&gen_path)? {
            Some(json) => GenerationConfig::from_json(&json, &gen_path)?,
            None => GenerationConfig::default(),
        };
        let needs_fallback = config.eos_token_ids.is_empty() || config.bos_token_id.is_none();
        if needs_fallback && let Some(json) = read_json_object(&model_path)? {
            let fields = Fields {
                json: &json,
                path: &model_path,
            };
            if config.eos_token_ids.is_empty() {
                config.eos_token_ids = fields.token_ids("eos_token_id")?;
            }
            if config.bos_token_id.is_none() {
                config.bos_token_id = fields.token_ids("bos_token_id")?.first().copied();
            }
        }
        Ok(config)
    }

    /// Parses the contents of a `generation_config.json`; `path` is only used in errors.
    pub fn from_json(json: &Value, path: &Path) -> Result<GenerationConfig> {
        let fields = Fields { json, path };
        Ok(GenerationConfig {
            eos_token_ids: fields.token_ids("eos_token_id")?,
            bos_token_id: fields.token_ids("bos_token_id")?.first().copied(),
            temperature: fields.float("temperature")?,
            top_p: fields.float("top_p")?,
            top_k: fields.count("top_k")?,
            min_p: fields.float("min_p")?,
            repetition_penalty: fields.float("repetition_penalty")?,
            max_new_tokens: fields.count("max_new_tokens")?,
            do_sample: fields.flag("do_sample")?,
        })
    }

    pub fn is_eos(&self, token_id: u32) -> bool {
        self.eos_token_ids.contains(&token_id)
    }
}

fn read_json_object(path: &Path) -> Result<Option<Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TextError::io(path, e)),
    };
    let json: Value = serde_json::from_str(&text)
        .map_err(|e| TextError::config(path, format!("invalid JSON: {e}")))?;
    if !json.is_object() {
        return Err(TextError::config(
            path,
            "expected a JSON object at the top level",
        ));
    }
    Ok(Some(json))
}

/// Typed access to optional fields of one JSON file, with errors naming file and field.
struct Fields<'a> {
    json: &'a Value,
    path: &'a Path,
}

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.json.get(key).filter(|v| !v.is_null())
    }

    fn bad(&self, key: &str, expected: &str, got: &Value) -> TextError {
        TextError::config(self.path, format!("`{key}` must be {expected}, got {got}"))
    }

    /// One id or a list of ids; absent or null gives an empty list.
    fn token_ids(&self, key: &str) -> Result<Vec<u32>> {
        let as_id = |v: &Value| v.as_u64().and_then(|id| u32::try_from(id).ok());
        match self.get(key) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| as_id(v).ok_or_else(|| self.bad(key, "a list of token ids", v)))
                .collect(),
            Some(v) => as_id(v)
                .map(|id| vec![id])
                .ok_or_else(|| self.bad(key, "a token id", v)),
        }
    }

    fn float(&self, key: &str) -> Result<Option<f32>> {
        self.get(key)
            .map(|v| {
                v.as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| self.bad(key, "a number", v))
            })
            .transpose()
    }

    fn count(&self, key: &str) -> Result<Option<usize>> {
        self.get(key)
            .map(|v| {
                v.as_u64()
                    .and_then(|n| usize::try_from(n).ok())
                    .ok_or_else(|| self.bad(key, "a non-negative integer", v))
            })
            .transpose()
    }

    fn flag(&self, key: &str) -> Result<Option<bool>> {
        self.get(key)
            .map(|v| v.as_bool().ok_or_else(|| self.bad(key, "true or false", v)))
            .transpose()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(dir: &Path, name: &str, text: &str) {
        std::fs::write(dir.join(name), text).expect("write test file");
    }

    #[test]
    fn missing_files_give_an_empty_config() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(
            GenerationConfig::from_dir(dir.path()).unwrap(),
            GenerationConfig::default()
        );
    }

    #[test]
    fn eos_list_and_sampling_defaults_are_read_from_generation_config() {
        let dir = tempfile::tempdir().unwrap();
        write(
            dir.path(),
            GENERATION_CONFIG_FILE,
            r#"{"bos_token_id": 1, "eos_token_id": [2, 32000], "temperature": 0.6, "top_p": 0.9,
                "top_k": 50, "do_sample": true, "pad_token_id": null, "transformers_version": "4.0"}"#,
        );
        write(
            dir.path(),
            MODEL_CONFIG_FILE,
            r#"{"eos_token_id": 7, "bos_token_id": 8}"#,
        );
        let config = GenerationConfig::from_dir(dir.path()).unwrap();
        assert_eq!(config.eos_token_ids, vec![2, 32000]);
        assert_eq!(config.bos_token_id, Some(1));
        assert_eq!(config.temperature, Some(0.6));
        assert_eq!(config.top_p, Some(0.9));
        assert_eq!(config.top_k, Some(50));
        assert_eq!(config.min_p, None);
        assert_eq!(config.do_sample, Some(true));
        assert!(config.is_eos(32000) && !config.is_eos(7));
    }

    #[test]
    fn eos_falls_back_to_config_json() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), GENERATION_CONFIG_FILE, r#"{"temperature": 1}"#);
        write(
            dir.path(),
            MODEL_CONFIG_FILE,
            r#"{"eos_token_id": 2, "bos_token_id": 1}"#,
        );
        let config = GenerationConfig::from_dir(dir.path()).unwrap();
        assert_eq!(config.eos_token_ids, vec![2]);
        assert_eq!(config.bos_token_id, Some(1));
        assert_eq!(config.temperature, Some(1.0));
    }

    #[test]
    fn malformed_json_and_bad_values_name_the_file() {
        let dir = tempfile::tempdir().unwrap();
        write(dir.path(), GENERATION_CONFIG_FILE, "{\"eos_token_id\": ");
        let err = GenerationConfig::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains(GENERATION_CONFIG_FILE), "{err}");
        write(
            dir.path(),
            GENERATION_CONFIG_FILE,
            r#"{"eos_token_id": [2, -1]}"#,
        );
        let err = GenerationConfig::from_dir(dir.path()).unwrap_err();
        assert!(
            matches!(&err, TextError::Config { message, .. } if message.contains("eos_token_id")),
            "{err}"
        );
        write(dir.path(), GENERATION_CONFIG_FILE, "{}");
        write(dir.path(), MODEL_CONFIG_FILE, r#"{"eos_token_id": "two"}"#);
        let err = GenerationConfig::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains(MODEL_CONFIG_FILE), "{err}");
    }
}
