//! Everything loaded from a model directory: weights, tokenizer, chat template, eos ids.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use moeserve_backend::device::Device;
use moeserve_core::{SamplingDefaults, SamplingParams};
use moeserve_model::config::Architecture;
use moeserve_model::models::MoeModel;
use moeserve_structured::{Grammar, GrammarCompiler, StructuredError, StructuredOutput};
use moeserve_text::chat_template::{ChatTemplate, RenderOptions};
use moeserve_text::generation_config::GenerationConfig;
use moeserve_text::harmony::HarmonyTokens;
use moeserve_text::tokenizer::Tokenizer;

use crate::request::{ChatPrompt, Prompt};
use crate::scheduler::AdmissionError;
use crate::{EngineError, Result};

/// A model directory, loaded.
pub struct ModelAssets {
    pub model: MoeModel,
    /// `None` for checkpoints without tokenizer.json (prompts must then be token ids).
    pub tokenizer: Option<Tokenizer>,
    pub chat_template: Option<ChatTemplate>,
    pub generation_config: GenerationConfig,
    /// GPT-OSS with a tokenizer holding the harmony tokens: chat replies are split into
    /// reasoning and content by their channels.
    pub harmony: Option<HarmonyTokens>,
    /// Built at the first constrained request (reading the vocabulary takes a moment).
    grammar_compiler: OnceLock<std::result::Result<Arc<GrammarCompiler>, StructuredError>>,
}

impl ModelAssets {
    /// Loads a model directory for the CPU.
    pub fn load(dir: &Path) -> Result<Self> {
        Self::load_for(dir, &Device::Cpu)
    }

    /// Loads a model directory for `device`: the weights are put into the CPU kernels' layout
    /// only when the CPU runs them.
    pub fn load_for(dir: &Path, device: &Device) -> Result<Self> {
        let model = match device {
            Device::Cpu => MoeModel::load(dir)?,
            Device::Cuda(_) => MoeModel::load_unprepared(dir)?,
        };
        let tokenizer = if dir.join("tokenizer.json").exists() {
            Some(Tokenizer::from_dir(dir)?)
        } else {
            None
        };
        let harmony = match model.config().architecture {
            Architecture::GptOss => tokenizer.as_ref().and_then(HarmonyTokens::from_tokenizer),
            _ => None,
        };
        Ok(ModelAssets {
            model,
            harmony,
            tokenizer,
            chat_template: ChatTemplate::from_dir(dir)?,
            generation_config: GenerationConfig::from_dir(dir)?,
            grammar_compiler: OnceLock::new(),
        })
    }

    /// The sampling defaults its `generation_config.json` recommends (what vLLM's
    /// `--generation-config auto` takes from it).
    pub fn sampling_defaults(&self) -> SamplingDefaults {
        let g = &self.generation_config;
        SamplingDefaults {
            temperature: g.temperature,
            top_p: g.top_p,
            top_k: g.top_k,
            min_p: g.min_p,
            repetition_penalty: g.repetition_penalty,
            max_tokens: g.max_new_tokens,
        }
    }

    /// The compiler of output constraints over this model's vocabulary.
    pub fn grammar_compiler(&self, field: &'static str) -> Result<Arc<GrammarCompiler>> {
        let built = self.grammar_compiler.get_or_init(|| {
            let tokenizer = self.tokenizer.as_ref().ok_or(StructuredError::Tokenizer {
                message: "the model has no tokenizer.json".to_string(),
            })?;
            GrammarCompiler::new(
                tokenizer,
                self.model.config().vocab_size,
                &self.generation_config.eos_token_ids,
            )
            .map(Arc::new)
        });
        built.clone().map_err(|e| EngineError::InvalidRequest {
            field,
            message: e.to_string(),
        })
    }

    /// A fresh grammar state for one request's `output` constraint; `field` names the request
    /// field it came from in errors. Compiling a large schema takes milliseconds: callers on an
    /// async runtime run this on a blocking thread.
    pub fn compile_grammar(
        &self,
        output: &StructuredOutput,
        field: &'static str,
    ) -> Result<Grammar> {
        self.grammar_compiler(field)?
            .compile(output)
            .map_err(|e| EngineError::InvalidRequest {
                field,
                message: e.to_string(),
            })
    }

    /// The tokenizer, or a 400-style error naming `field` when the model has none.
    pub fn tokenizer_for(&self, field: &'static str) -> Result<&Tokenizer> {
        self.tokenizer
            .as_ref()
            .ok_or_else(|| EngineError::InvalidRequest {
                field,
                message: "the model has no tokenizer.json; send token ids instead".to_string(),
            })
    }

    /// The prompt's token ids: text is tokenized as is (no special tokens added, as vLLM does
    /// for models whose tokenizer adds none); chat messages go through the chat template.
    /// Text that surely makes more than `max_model_len` tokens is refused from its length,
    /// before the tokenizer spends time on it.
    pub fn prompt_ids(&self, prompt: &Prompt, max_model_len: usize) -> Result<Vec<u32>> {
        let measured = |tokenizer: &Tokenizer, text: &str| {
            let fewest_tokens = tokenizer.fewest_tokens(text);
            if fewest_tokens > max_model_len {
                return Err(EngineError::Admission(AdmissionError::PromptTextTooLong {
                    max_model_len,
                    bytes: text.len(),
                    fewest_tokens,
                }));
            }
            Ok(())
        };
        let ids = match prompt {
            Prompt::TokenIds(ids) => ids.clone(),
            Prompt::Text(text) => {
                let tokenizer = self.tokenizer_for("prompt")?;
                measured(tokenizer, text)?;
                tokenizer.encode_with_special_tokens(text)?
            }
            Prompt::Chat(chat) => {
                let text = self.render_chat(chat)?;
                let tokenizer = self.tokenizer_for("messages")?;
                measured(tokenizer, &text)?;
                tokenizer.encode(&text)?
            }
        };
        let vocab = self.model.config().vocab_size;
        if ids.is_empty() {
            return Err(EngineError::InvalidRequest {
                field: "prompt",
                message: "the prompt is empty".to_string(),
            });
        }
        if let Some(bad) = ids.iter().find(|id| **id as usize >= vocab) {
            return Err(EngineError::InvalidRequest {
                field: "prompt",
                message: format!("token id {bad} is out of the vocabulary (size {vocab})"),
            });
        }
        Ok(ids)
    }

    /// Refuses `stop_token_ids` and `logit_bias` tokens outside the vocabulary.
    pub fn check_token_ids(&self, params: &SamplingParams) -> Result<()> {
        let vocab = self.model.config().vocab_size;
        let outside = |field, bad: Option<u32>| match bad {
            Some(bad) => Err(EngineError::InvalidRequest {
                field,
                message: format!("token id {bad} is out of the vocabulary (size {vocab})"),
            }),
            None => Ok(()),
        };
        let beyond = |id: &u32| *id as usize >= vocab;
        outside(
            "stop_token_ids",
            params.stop_token_ids.iter().copied().find(beyond),
        )?;
        outside(
            "logit_bias",
            params.logit_bias.iter().map(|(id, _)| *id).find(beyond),
        )
    }

    /// Renders chat messages with the model's template, ending with the assistant's turn.
    pub fn render_chat(&self, chat: &ChatPrompt) -> Result<String> {
        self.render_chat_turn(chat, true)
    }

    /// Renders chat messages with the model's template; `add_generation_prompt` opens the
    /// assistant's turn after them.
    pub fn render_chat_turn(
        &self,
        chat: &ChatPrompt,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self
            .chat_template
            .as_ref()
            .ok_or_else(|| EngineError::InvalidRequest {
                field: "messages",
                message: "the model has no chat template".to_string(),
            })?;
        if chat.messages.is_empty() {
            return Err(EngineError::InvalidRequest {
                field: "messages",
                message: "no messages given".to_string(),
            });
        }
        Ok(template.render_with_tools(
            &chat.messages,
            &RenderOptions {
                add_generation_prompt,
                reasoning_effort: chat.reasoning_effort,
            },
            chat.tools.as_ref(),
        )?)
    }
}
