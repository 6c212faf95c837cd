//! Structured outputs: constrain a sequence's tokens to a JSON schema, a regex, a choice of
//! strings or a grammar, through llguidance (the constrained-decoding library that vLLM,
//! SGLang and llama.cpp use).
//!
//! - [`GrammarCompiler`] is built once per model from its `tokenizer.json` (llguidance's
//!   token trie over the model's vocabulary) and compiles a [`StructuredOutput`] into a
//!   per-sequence [`Grammar`]; an invalid schema or grammar is a [`StructuredError`].
//! - [`Grammar`] computes the token mask for the next position (which tokens keep the output
//!   inside the grammar), applies it to a row of logits before sampling, and advances by the
//!   token that was sampled; it is finished when the grammar is.

mod ebnf;

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use moeserve_text::tokenizer::Tokenizer;
use serde_json::{Value, json};

pub use ebnf::ebnf_to_lark;

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StructuredError {
    /// The schema, regex or grammar of a request cannot be compiled.
    #[error("{kind}: {message}")]
    Invalid { kind: &'static str, message: String },
    /// The model's tokenizer cannot be turned into a token trie.
    #[error("structured outputs are unavailable for this tokenizer: {message}")]
    Tokenizer { message: String },
    /// The grammar refused a token or failed while computing a mask.
    #[error("structured output: {message}")]
    Matcher { message: String },
}

pub type Result<T> = std::result::Result<T, StructuredError>;

/// What a request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (`response_format: json_schema`, vLLM's `guided_json`).
    JsonSchema(Value),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A regular expression, in Rust's `regex` syntax (vLLM's `guided_regex`).
    Regex(String),
    /// Exactly one of these strings (vLLM's `guided_choice`).
    Choice(Vec<String>),
    /// A grammar (vLLM's `guided_grammar`): Lark, or GBNF / EBNF (`rule ::= …`), told apart by
    /// `::=`.
    Grammar(String),
}

impl GrammarSpec {
    /// The name of the kind, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "json schema",
            GrammarSpec::JsonObject => "json object",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Choice(_) => "choice",
            GrammarSpec::Grammar(_) => "grammar",
        }
    }
}

/// How JSON output may be spaced (vLLM's `disable_any_whitespace` and `whitespace_pattern`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct JsonWhitespace {
    /// No whitespace at all between JSON tokens (`{"a":1}`).
    pub compact: bool,
    /// A regex for the whitespace between JSON tokens.
    pub pattern: Option<String>,
}

/// A request's output constraint.
#[derive(Debug, Clone, PartialEq)]
pub struct StructuredOutput {
    pub spec: GrammarSpec,
    pub whitespace: JsonWhitespace,
}

impl StructuredOutput {
    pub fn new(spec: GrammarSpec) -> StructuredOutput {
        StructuredOutput {
            spec,
            whitespace: JsonWhitespace::default(),
        }
    }

    /// llguidance's grammar for it.
    fn to_grammar(&self) -> Result<TopLevelGrammar> {
        let invalid = |message: String| StructuredError::Invalid {
            kind: self.spec.kind(),
            message,
        };
        Ok(match &self.spec {
            GrammarSpec::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(invalid(format!(
                        "a schema is a JSON object or boolean, not {}",
                        json_kind(schema)
                    )));
                }
                TopLevelGrammar::from_json_schema(self.with_json_options(schema.clone()))
            }
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(self.with_json_options(json!({"type": "object"})))
            }
            GrammarSpec::Regex(regex) => {
                if regex.is_empty() {
                    return Err(invalid("the regex is empty".to_string()));
                }
                TopLevelGrammar::from_regex(regex)
            }
            GrammarSpec::Choice(choices) => {
                if choices.is_empty() {
                    return Err(invalid("no choices given".to_string()));
                }
                // Each choice a JSON-quoted Lark string literal (Lark reads JSON escapes).
                let alternatives: Vec<String> = choices
                    .iter()
                    .map(|c| serde_json::to_string(c).expect("a string serializes"))
                    .collect();
                TopLevelGrammar::from_lark(format!("start: {}", alternatives.join(" | ")))
            }
            GrammarSpec::Grammar(text) => {
                if text.trim().is_empty() {
                    return Err(invalid("the grammar is empty".to_string()));
                }
                let lark = match text.contains("::=") {
                    true => ebnf_to_lark(text).map_err(invalid)?,
                    false => text.clone(),
                };
                TopLevelGrammar::from_lark(lark)
            }
        })
    }

    /// The schema with llguidance's JSON options (`x-guidance`) for the whitespace asked for.
    fn with_json_options(&self, mut schema: Value) -> Value {
        let ws = &self.whitespace;
        if !ws.compact && ws.pattern.is_none() {
            return schema;
        }
        // Compact: exactly `,` and `:` between tokens; a pattern: flexible spacing under it.
        let options = match ws.compact {
            true => {
                json!({"whitespace_flexible": false, "item_separator": ",", "key_separator": ":"})
            }
            false => json!({"whitespace_flexible": true, "whitespace_pattern": ws.pattern}),
        };
        match &mut schema {
            Value::Object(map) => {
                map.insert("x-guidance".to_string(), options);
                schema
            }
            // `true` (anything): the same, as an object.
            Value::Bool(true) => json!({"x-guidance": options}),
            _ => schema,
        }
    }
}

fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The model's tokenizer as llguidance sees it: the token trie, and the tokenizer for the
/// strings a grammar forces.
struct TokenizerBridge {
    trie: TokTrie,
    tokenizer: Tokenizer,
}

impl TokenizerEnv for TokenizerBridge {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        let vocab = self.trie.vocab_size() as u32;
        self.trie.tokenize_with_greedy_fallback(s, |text| {
            let ids = self.tokenizer.encode(text).unwrap_or_default();
            // A tokenizer larger than the model's vocabulary (rare): fall back to the trie.
            match ids.iter().all(|&t| t < vocab) {
                true => ids,
                false => self.trie.greedy_tokenize(text.as_bytes()),
            }
        })
    }
}

/// Compiles requests' constraints for one model; built once, shared by every request.
pub struct GrammarCompiler {
    factory: ParserFactory,
    vocab_size: usize,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl GrammarCompiler {
    /// The compiler for a model of `vocab_size` logits whose generation ends with one of
    /// `eos_token_ids` (a grammar that is complete allows exactly those).
    pub fn new(
        tokenizer: &Tokenizer,
        vocab_size: usize,
        eos_token_ids: &[u32],
    ) -> Result<GrammarCompiler> {
        let unusable = |message: String| StructuredError::Tokenizer { message };
        let text = std::fs::read_to_string(tokenizer.path())
            .map_err(|e| unusable(format!("{}: {e}", tokenizer.path().display())))?;
        let json: Value = serde_json::from_str(&text)
            .map_err(|e| unusable(format!("{}: {e}", tokenizer.path().display())))?;
        // llguidance asserts on some malformed vocabularies; a panic here is an error.
        let words = std::panic::catch_unwind(|| llguidance::token_bytes_from_tokenizer_json(&json))
            .map_err(|_| unusable("the vocabulary cannot be read as bytes".to_string()))?
            .map_err(|e| unusable(e.to_string()))?;
        let mut words = words;
        // The model's logits may cover padding ids beyond the tokenizer's; those never match.
        words.resize(vocab_size, Vec::new());
        let eos = eos_token_ids
            .iter()
            .copied()
            .filter(|&t| (t as usize) < vocab_size)
            .collect::<Vec<_>>();
        let Some(&first_eos) = eos.first() else {
            return Err(unusable(
                "the model names no end-of-sequence token within its vocabulary".to_string(),
            ));
        };
        let info = TokRxInfo::new(vocab_size as u32, first_eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(TokenizerBridge {
            trie,
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| unusable(e.to_string()))?;
        factory.quiet();
        Ok(GrammarCompiler {
            factory,
            vocab_size,
        })
    }

    /// A fresh grammar state for one sequence.
    pub fn compile(&self, output: &StructuredOutput) -> Result<Grammar> {
        let grammar = output.to_grammar()?;
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| StructuredError::Invalid {
                kind: output.spec.kind(),
                message: e.to_string(),
            })?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(message) = matcher.get_error() {
            return Err(StructuredError::Invalid {
                kind: output.spec.kind(),
                message,
            });
        }
        Ok(Grammar {
            matcher,
            mask: None,
            vocab_size: self.vocab_size,
            trigger: Vec::new(),
            recent: Vec::new(),
        })
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

/// One sequence's position in its grammar.
pub struct Grammar {
    matcher: Matcher,
    /// The allowed tokens of the next position, once computed.
    mask: Option<SimpleVob>,
    vocab_size: usize,
    /// While not empty, the grammar sleeps until the sequence has generated these tokens in a
    /// row (GPT-OSS's `<|channel|>final<|message|>`: the reasoning before it is free).
    trigger: Vec<u32>,
    /// The last tokens generated while asleep, at most the trigger's length.
    recent: Vec<u32>,
}

impl Clone for Grammar {
    /// An independent copy at the same position (e.g. for `n` sequences of one request).
    fn clone(&self) -> Grammar {
        Grammar {
            matcher: self.matcher.deep_clone(),
            mask: self.mask.clone(),
            vocab_size: self.vocab_size,
            trigger: self.trigger.clone(),
            recent: self.recent.clone(),
        }
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .field("mask_ready", &self.mask.is_some())
            .finish()
    }
}

impl Grammar {
    /// This grammar, applied only after the sequence has generated `trigger` (every token
    /// allowed until then, the trigger's own included). An empty trigger applies it at once.
    pub fn after(mut self, trigger: Vec<u32>) -> Grammar {
        self.trigger = trigger;
        self.recent.clear();
        self
    }

    /// Whether the grammar is still waiting for its trigger.
    pub fn is_asleep(&self) -> bool {
        !self.trigger.is_empty()
    }

    /// Computes the next position's mask (the costly part: run it off the forward's path).
    pub fn compute_mask(&mut self) -> Result<()> {
        if self.is_asleep() {
            return Ok(());
        }
        let mask = self
            .matcher
            .compute_mask()
            .map_err(|e| StructuredError::Matcher {
                message: e.to_string(),
            })?;
        self.mask = Some(mask);
        Ok(())
    }

    /// Sets the logits of tokens the grammar forbids to -inf; computes the mask first when
    /// [`Grammar::compute_mask`] has not.
    pub fn apply_mask(&mut self, logits: &mut [f32]) -> Result<()> {
        if self.is_asleep() {
            return Ok(());
        }
        if self.mask.is_none() {
            self.compute_mask()?;
        }
        let mask = self.mask.as_ref().expect("mask computed");
        let n = logits.len().min(self.vocab_size);
        for (id, logit) in logits[..n].iter_mut().enumerate() {
            if !mask.is_allowed(id as TokenId) {
                *logit = f32::NEG_INFINITY;
            }
        }
        logits[n..].fill(f32::NEG_INFINITY);
        Ok(())
    }

    /// Whether the grammar allows `token` next (computes the mask when needed).
    pub fn allows(&mut self, token: u32) -> Result<bool> {
        if self.is_asleep() {
            return Ok(true);
        }
        if self.mask.is_none() {
            self.compute_mask()?;
        }
        Ok(self
            .mask
            .as_ref()
            .is_some_and(|m| (token as usize) < self.vocab_size && m.is_allowed(token)))
    }

    /// Advances by the sampled token; the next mask is stale until recomputed.
    pub fn accept(&mut self, token: u32) -> Result<()> {
        if self.is_asleep() {
            self.recent.push(token);
            if self.recent.len() > self.trigger.len() {
                self.recent.remove(0);
            }
            if self.recent == self.trigger {
                self.trigger.clear();
                self.recent.clear();
            }
            return Ok(());
        }
        self.mask = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| StructuredError::Matcher {
                message: e.to_string(),
            })
    }

    /// The grammar is complete and admits nothing more (the sequence ends here).
    pub fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
