//! The prompts of a benchmark: random token ids of exactly `--prompt-len` tokens, or a JSONL
//! file.
//!
//! NOTE: random prompts are sent as token ids (`"prompt": [ids]` in `/v1/completions`, which
//! moeserve and vLLM accept), so every request has exactly the asked prompt length without a
//! tokenizer on the client or a `/tokenize` endpoint on the server. Ids are drawn uniformly from
//! `[first_id, vocab_size)`, skipping the low ids where special tokens usually sit.

use std::path::Path;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

use crate::{BenchError, Result};

/// The lowest random token id (ids below are often special tokens: BOS, EOS, padding).
pub const FIRST_RANDOM_ID: u32 = 4;

/// A prompt as sent in `"prompt"`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    TokenIds(Vec<u32>),
}

/// One request of the benchmark.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchPrompt {
    pub prompt: PromptInput,
    /// Output tokens asked for (`max_tokens`, with `ignore_eos`).
    pub max_tokens: usize,
}

/// How random prompts are drawn.
#[derive(Clone, Copy, Debug)]
pub struct RandomPrompts {
    pub num_prompts: usize,
    pub prompt_len: usize,
    pub output_len: usize,
    pub vocab_size: u32,
    pub seed: u64,
}

impl RandomPrompts {
    pub fn generate(&self) -> Result<Vec<BenchPrompt>> {
        if self.vocab_size <= FIRST_RANDOM_ID {
            return Err(BenchError::invalid(
                "vocab_size",
                format!("must exceed {FIRST_RANDOM_ID}, got {}", self.vocab_size),
            ));
        }
        let mut rng = StdRng::seed_from_u64(self.seed);
        Ok((0..self.num_prompts)
            .map(|_| BenchPrompt {
                prompt: PromptInput::TokenIds(
                    (0..self.prompt_len)
                        .map(|_| rng.random_range(FIRST_RANDOM_ID..self.vocab_size))
                        .collect(),
                ),
                max_tokens: self.output_len,
            })
            .collect())
    }
}

/// One line of `--dataset`.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct DatasetLine {
    prompt: PromptInput,
    max_tokens: Option<usize>,
}

/// Reads `num_prompts` prompts from a JSONL file of `{"prompt": "text" | [ids], "max_tokens"?: n}`
/// lines, cycling through the file when it holds fewer; `max_tokens` defaults to `output_len`.
pub fn read_dataset(
    path: &Path,
    num_prompts: usize,
    output_len: usize,
) -> Result<Vec<BenchPrompt>> {
    let text = std::fs::read_to_string(path).map_err(|e| BenchError::io(path, e))?;
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let parsed: DatasetLine = serde_json::from_str(line).map_err(|e| BenchError::Parse {
            origin: format!("{}:{}", path.display(), n + 1),
            message: e.to_string(),
        })?;
        lines.push(BenchPrompt {
            prompt: parsed.prompt,
            max_tokens: parsed.max_tokens.unwrap_or(output_len),
        });
    }
    if lines.is_empty() {
        return Err(BenchError::Parse {
            origin: path.display().to_string(),
            message: "holds no prompts".into(),
        });
    }
    Ok(lines.iter().cycle().take(num_prompts).cloned().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random_prompts_have_the_exact_length_and_are_reproducible() {
        let spec = RandomPrompts {
            num_prompts: 3,
            prompt_len: 17,
            output_len: 5,
            vocab_size: 100,
            seed: 1,
        };
        let a = spec.generate().unwrap();
        assert_eq!(a, spec.generate().unwrap());
        for p in &a {
            let PromptInput::TokenIds(ids) = &p.prompt else {
                panic!("random prompts are token ids")
            };
            assert_eq!(ids.len(), 17);
            assert!(ids.iter().all(|id| (FIRST_RANDOM_ID..100).contains(id)));
            assert_eq!(p.max_tokens, 5);
        }
        assert_ne!(a[0], a[1]);
    }

    #[test]
    fn dataset_lines_cycle_and_default_their_output_length() {
        let dir = tempfile_dir();
        let path = dir.join("prompts.jsonl");
        std::fs::write(
            &path,
            "{\"prompt\": \"hi\"}\n\n{\"prompt\": [5, 6], \"max_tokens\": 3}\n",
        )
        .unwrap();
        let p = read_dataset(&path, 3, 8).unwrap();
        assert_eq!(p[0].prompt, PromptInput::Text("hi".into()));
        assert_eq!((p[0].max_tokens, p[1].max_tokens), (8, 3));
        assert_eq!(p[2], p[0]);
        std::fs::write(&path, "{\"text\": 1}\n").unwrap();
        let err = read_dataset(&path, 1, 8).unwrap_err().to_string();
        assert!(err.contains("prompts.jsonl:1"), "{err}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("moeserve-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
