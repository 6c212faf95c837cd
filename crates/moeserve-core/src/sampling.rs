//! Per-request sampling parameters, validated once when a request is admitted.
//!
//! Field names and defaults follow vLLM's `SamplingParams` so users' habits carry over.

use serde::{Deserialize, Serialize};

/// How the next token of one request is chosen, and when the request stops.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax); otherwise logits are divided by it before softmax.
    pub temperature: f32,
    /// Nucleus sampling: keep the smallest set of tokens whose mass reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` × the top probability (0 = off).
    pub min_p: f32,
    /// Seed of this request's random stream; `None` draws one.
    pub seed: Option<u64>,
    /// Maximum number of generated tokens.
    pub max_tokens: usize,
    /// Keep generating past end-of-sequence tokens.
    pub ignore_eos: bool,
    /// Number of top alternatives to report per generated token (`None` = no logprobs).
    pub logprobs: Option<usize>,
    /// Extra token ids that end the request (the model's eos ids are added by the engine).
    pub stop_token_ids: Vec<u32>,
    /// Strings that end the request; the stop string is not part of the output text.
    pub stop: Vec<String>,
    /// > 1 discourages repeating tokens of prompt and output (1 = off).
    pub repetition_penalty: f32,
    /// Subtracted from logits of tokens already generated (0 = off).
    pub presence_penalty: f32,
    /// Subtracted per occurrence of tokens already generated (0 = off).
    pub frequency_penalty: f32,
    /// Added to these tokens' logits before any penalty (OpenAI's `logit_bias`, each in
    /// [-100, 100]: -100 bans a token, 100 all but forces it).
    pub logit_bias: Vec<(u32, f32)>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            max_tokens: 16,
            ignore_eos: false,
            logprobs: None,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
        }
    }
}

/// Defaults for the sampling fields a request leaves out: the model's `generation_config.json`
/// values under `--generation-config auto` (vLLM's default), none under `--generation-config
/// vllm`. Unset fields fall back to [`SamplingParams::default`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SamplingDefaults {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub repetition_penalty: Option<f32>,
    /// The model's `max_new_tokens`: caps a chat request that gives no `max_tokens`.
    pub max_tokens: Option<usize>,
}

impl SamplingDefaults {
    /// `name=value` for every default set, for the start-up log; empty when none is.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        let mut add = |name: &str, value: Option<String>| {
            if let Some(v) = value {
                parts.push(format!("{name}={v}"));
            }
        };
        add("temperature", self.temperature.map(|v| v.to_string()));
        add("top_p", self.top_p.map(|v| v.to_string()));
        add("top_k", self.top_k.map(|v| v.to_string()));
        add("min_p", self.min_p.map(|v| v.to_string()));
        add(
            "repetition_penalty",
            self.repetition_penalty.map(|v| v.to_string()),
        );
        add("max_tokens", self.max_tokens.map(|v| v.to_string()));
        parts.join(", ")
    }
}

/// A sampling parameter outside its allowed range; names the field like an API error would.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("invalid `{field}`: {message}")]
pub struct SamplingParamsError {
    pub field: &'static str,
    pub message: String,
}

/// Largest number of alternatives a request may ask for per token (as OpenAI's `top_logprobs`).
pub const MAX_LOGPROBS: usize = 20;

/// Most stop strings one request may give (OpenAI allows 4; vLLM sets no limit): each one is
/// checked after every generated token.
pub const MAX_STOP_STRINGS: usize = 64;

/// Longest stop string, in bytes.
pub const MAX_STOP_STRING_BYTES: usize = 1024;

/// Most `stop_token_ids` one request may give.
pub const MAX_STOP_TOKEN_IDS: usize = 1024;

/// Most `logit_bias` entries one request may give (OpenAI documents none; vLLM sets none).
pub const MAX_LOGIT_BIAS_ENTRIES: usize = 1024;

/// `logit_bias` values lie in `[-LOGIT_BIAS_LIMIT, LOGIT_BIAS_LIMIT]`, as OpenAI's.
pub const LOGIT_BIAS_LIMIT: f32 = 100.0;

impl SamplingParams {
    pub fn greedy(max_tokens: usize) -> Self {
        SamplingParams {
            temperature: 0.0,
            max_tokens,
            ..Default::default()
        }
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    pub fn validate(&self) -> Result<(), SamplingParamsError> {
        let err = |field, message: String| Err(SamplingParamsError { field, message });
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return err(
                "temperature",
                format!("must be a finite number >= 0, got {}", self.temperature),
            );
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return err("top_p", format!("must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return err("min_p", format!("must be in [0, 1], got {}", self.min_p));
        }
        if self.max_tokens == 0 {
            return err("max_tokens", "must be at least 1".to_string());
        }
        if let Some(k) = self.logprobs
            && k > MAX_LOGPROBS
        {
            return err(
                "logprobs",
                format!("must be at most {MAX_LOGPROBS}, got {k}"),
            );
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return err(
                "repetition_penalty",
                format!(
                    "must be a finite number > 0, got {}",
                    self.repetition_penalty
                ),
            );
        }
        for (field, value) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&value) {
                return err(field, format!("must be in [-2, 2], got {value}"));
            }
        }
        if self.stop.iter().any(|s| s.is_empty()) {
            return err("stop", "stop strings must not be empty".to_string());
        }
        if self.stop.len() > MAX_STOP_STRINGS {
            return err(
                "stop",
                format!(
                    "at most {MAX_STOP_STRINGS} stop strings are allowed, got {}",
                    self.stop.len()
                ),
            );
        }
        if let Some(long) = self.stop.iter().find(|s| s.len() > MAX_STOP_STRING_BYTES) {
            return err(
                "stop",
                format!(
                    "stop strings may be at most {MAX_STOP_STRING_BYTES} bytes long, got one of {}",
                    long.len()
                ),
            );
        }
        if self.stop_token_ids.len() > MAX_STOP_TOKEN_IDS {
            return err(
                "stop_token_ids",
                format!(
                    "at most {MAX_STOP_TOKEN_IDS} stop token ids are allowed, got {}",
                    self.stop_token_ids.len()
                ),
            );
        }
        if self.logit_bias.len() > MAX_LOGIT_BIAS_ENTRIES {
            return err(
                "logit_bias",
                format!(
                    "at most {MAX_LOGIT_BIAS_ENTRIES} entries are allowed, got {}",
                    self.logit_bias.len()
                ),
            );
        }
        if let Some((id, bias)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-LOGIT_BIAS_LIMIT..=LOGIT_BIAS_LIMIT).contains(b))
        {
            return err(
                "logit_bias",
                format!(
                    "the bias of token {id} must be in [-{LOGIT_BIAS_LIMIT}, {LOGIT_BIAS_LIMIT}], \
                     got {bias}"
                ),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_params_are_valid() {
        assert!(SamplingParams::default().validate().is_ok());
        assert!(SamplingParams::greedy(4).is_greedy());
    }

    #[test]
    fn out_of_range_fields_are_named() {
        let p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "top_p");
        let p = SamplingParams {
            temperature: f32::NAN,
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "temperature");
        let p = SamplingParams {
            max_tokens: 0,
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "max_tokens");
    }

    #[test]
    fn stop_lists_are_bounded() {
        let p = SamplingParams {
            stop: vec!["x".to_string(); MAX_STOP_STRINGS + 1],
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "stop");
        let p = SamplingParams {
            stop: vec!["x".repeat(MAX_STOP_STRING_BYTES + 1)],
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "stop");
        let p = SamplingParams {
            stop_token_ids: vec![1; MAX_STOP_TOKEN_IDS + 1],
            ..Default::default()
        };
        assert_eq!(p.validate().unwrap_err().field, "stop_token_ids");
        let p = SamplingParams {
            stop: vec!["x".to_string(); MAX_STOP_STRINGS],
            ..Default::default()
        };
        assert!(p.validate().is_ok());
    }
}
