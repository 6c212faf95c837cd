//! Hugging Face tokenizer files (`tokenizer.json`, `tokenizer_config.json`) built from a GGUF
//! vocabulary, and the byte-level tokenizer of the random presets.
//!
//! Follows llama.cpp's `llama-vocab.cpp` for what a GGUF "gpt2" vocabulary means: tokens are
//! already GPT-2 byte-level strings (`Ġthe`), merges are `"left right"` split at the first
//! space after the first byte, token types 3 (control) and 4 (user-defined) are matched in raw
//! text before pre-tokenization, and `tokenizer.ggml.pre` picks the split regexes. The JSON
//! follows the `tokenizers` crate's serialization (a BPE model, ByteLevel decoder).

use serde_json::{Map, Value, json};

use crate::gguf::GgufFile;
use crate::{FormatError, Result};

/// llama.cpp token types (`llama_token_type`).
const TOKEN_TYPE_CONTROL: i64 = 3;
const TOKEN_TYPE_USER_DEFINED: i64 = 4;

/// How text is split before BPE.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex (llama.cpp pre types `gpt2`, `mpt`, `olmo`, `jais`).
    ByteLevel,
    /// Every digit on its own, then GPT-2's regex (llama.cpp `smollm`, `starcoder`, `refact`,
    /// `command-r`, `codeshell`, `exaone`, `minerva`).
    DigitsThenByteLevel,
}

impl PreTokenizer {
    /// The pre-tokenizer matching llama.cpp's `tokenizer.ggml.pre` value, if it has an exact
    /// Hugging Face equivalent.
    pub fn from_gguf_pre(pre: &str) -> Option<Self> {
        match pre {
            "gpt2" | "mpt" | "olmo" | "jais" => Some(PreTokenizer::ByteLevel),
            "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone"
            | "minerva" => Some(PreTokenizer::DigitsThenByteLevel),
            _ => None,
        }
    }

    fn to_json(self) -> Value {
        let byte_level = byte_level_json(ByteLevelRole::PreTokenizer);
        match self {
            PreTokenizer::ByteLevel => byte_level,
            PreTokenizer::DigitsThenByteLevel => json!({
                "type": "Sequence",
                "pretokenizers": [{ "type": "Digits", "individual_digits": true }, byte_level]
            }),
        }
    }
}

/// A token matched verbatim in the input before BPE runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AddedToken {
    pub id: u32,
    pub content: String,
    /// Control tokens are special (skipped when decoding with `skip_special_tokens`).
    pub special: bool,
}

impl AddedToken {
    fn to_json(&self) -> Value {
        json!({
            "id": self.id, "content": self.content, "single_word": false, "lstrip": false,
            "rstrip": false, "normalized": !self.special, "special": self.special
        })
    }
}

/// The inputs of a byte-level BPE `tokenizer.json`.
pub struct BpeTokenizerSpec<'a> {
    /// Token strings by id (already byte-level encoded).
    pub tokens: &'a [&'a str],
    pub merges: Vec<(String, String)>,
    pub added_tokens: Vec<AddedToken>,
    pub pre_tokenizer: PreTokenizer,
    /// Prepended by the post-processor when encoding with special tokens.
    pub bos_to_add: Option<AddedToken>,
}

impl BpeTokenizerSpec<'_> {
    /// `tokenizer.json` in the `tokenizers` crate's format.
    pub fn to_json(&self) -> Value {
        let mut vocab = Map::with_capacity(self.tokens.len());
        for (id, token) in self.tokens.iter().enumerate() {
            // Later duplicates win, as in llama.cpp's `token_to_id`.
            vocab.insert((*token).to_string(), json!(id));
        }
        let merges: Vec<Value> = self.merges.iter().map(|(a, b)| json!([a, b])).collect();
        let post_processor = match &self.bos_to_add {
            None => byte_level_json(ByteLevelRole::PostProcessor),
            Some(bos) => prepend_bos_json(bos),
        };
        json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": self.added_tokens.iter().map(AddedToken::to_json).collect::<Vec<_>>(),
            "normalizer": null,
            "pre_tokenizer": self.pre_tokenizer.to_json(),
            "post_processor": post_processor,
            "decoder": byte_level_json(ByteLevelRole::Decoder),
            "model": {
                "type": "BPE",
                "dropout": null,
                "unk_token": null,
                "continuing_subword_prefix": null,
                "end_of_word_suffix": null,
                "fuse_unk": false,
                "byte_fallback": false,
                "ignore_merges": false,
                "vocab": vocab,
                "merges": merges
            }
        })
    }
}

/// Where a `ByteLevel` component sits; each place has the settings GPT-2-style tokenizers
/// (SmolLM2's `tokenizer.json` among them) use there.
#[derive(Clone, Copy)]
enum ByteLevelRole {
    /// Splits with GPT-2's regex, adds no space in front.
    PreTokenizer,
    /// Only fixes offsets; adds no tokens.
    PostProcessor,
    Decoder,
}

fn byte_level_json(role: ByteLevelRole) -> Value {
    let (add_prefix_space, trim_offsets) = match role {
        ByteLevelRole::PreTokenizer => (false, true),
        ByteLevelRole::PostProcessor => (true, false),
        ByteLevelRole::Decoder => (true, true),
    };
    json!({
        "type": "ByteLevel",
        "add_prefix_space": add_prefix_space,
        "trim_offsets": trim_offsets,
        "use_regex": true
    })
}

/// A `TemplateProcessing` post-processor that puts `bos` before each sequence.
fn prepend_bos_json(bos: &AddedToken) -> Value {
    let special =
        |type_id: u32| json!({ "SpecialToken": { "id": bos.content, "type_id": type_id } });
    let sequence = |id: &str, type_id: u32| json!({ "Sequence": { "id": id, "type_id": type_id } });
    let mut special_tokens = Map::new();
    special_tokens.insert(
        bos.content.clone(),
        json!({ "id": bos.content, "ids": [bos.id], "tokens": [bos.content] }),
    );
    json!({
        "type": "TemplateProcessing",
        "single": [special(0), sequence("A", 0)],
        "pair": [special(0), sequence("A", 0), special(1), sequence("B", 1)],
        "special_tokens": special_tokens
    })
}

/// GPT-2's `bytes_to_unicode`: printable bytes map to themselves, the others to U+0100 onwards.
pub fn byte_to_unicode() -> [char; 256] {
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next_unprintable = 256u32;
    std::array::from_fn(|b| {
        let b = b as u32;
        let code = if printable(b) {
            b
        } else {
            next_unprintable += 1;
            next_unprintable - 1
        };
        char::from_u32(code).expect("codes below U+0200 are valid chars")
    })
}

/// Tokenizer files derived from a GGUF's `tokenizer.*` metadata.
#[derive(Clone, Debug)]
pub struct GgufTokenizer {
    pub tokenizer_json: Value,
    pub tokenizer_config: Value,
    pub chat_template: Option<String>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub pad_token_id: Option<u32>,
}

/// Builds the HF tokenizer of a GGUF with a `gpt2` (byte-level BPE) vocabulary.
pub fn tokenizer_from_gguf(gguf: &GgufFile, model_max_length: usize) -> Result<GgufTokenizer> {
    let err = |message: String| FormatError::Tokenizer {
        path: gguf.path().to_path_buf(),
        message,
    };
    let model = gguf.get_str("tokenizer.ggml.model")?;
    if model != "gpt2" {
        return Err(err(format!(
            "tokenizer model `{model}` is not supported (only `gpt2`, byte-level BPE)"
        )));
    }
    let pre = gguf.opt_str("tokenizer.ggml.pre")?.unwrap_or("default");
    let pre_tokenizer = PreTokenizer::from_gguf_pre(pre).ok_or_else(|| {
        err(format!(
            "pre-tokenizer type `{pre}` (tokenizer.ggml.pre) is not supported: only gpt2-style \
             (gpt2, mpt, olmo, jais) and smollm-style (smollm, starcoder, refact, command-r, \
             codeshell, exaone, minerva) splitting have exact Hugging Face equivalents"
        ))
    })?;
    let tokens = gguf.get_str_array("tokenizer.ggml.tokens")?;
    let token_types = match gguf.get("tokenizer.ggml.token_type") {
        Some(_) => gguf.get_int_array("tokenizer.ggml.token_type")?,
        None => vec![1; tokens.len()],
    };
    if token_types.len() != tokens.len() {
        return Err(err(format!(
            "{} token types for {} tokens",
            token_types.len(),
            tokens.len()
        )));
    }
    let merges = gguf
        .get_str_array("tokenizer.ggml.merges")?
        .into_iter()
        .enumerate()
        .map(|(i, merge)| {
            split_merge(merge).ok_or_else(|| err(format!("merge {i} {merge:?} has no space")))
        })
        .collect::<Result<Vec<_>>>()?;
    let added_tokens: Vec<AddedToken> = (0u32..)
        .zip(tokens.iter().zip(&token_types))
        .filter(|(_, (_, ty))| matches!(**ty, TOKEN_TYPE_CONTROL | TOKEN_TYPE_USER_DEFINED))
        .map(|(id, (content, ty))| AddedToken {
            id,
            content: (*content).to_string(),
            special: *ty == TOKEN_TYPE_CONTROL,
        })
        .collect();

    let token_id = |key: &str| -> Result<Option<u32>> {
        let Some(id) = gguf.opt_u64(key)? else {
            return Ok(None);
        };
        match u32::try_from(id) {
            Ok(id) if (id as usize) < tokens.len() => Ok(Some(id)),
            _ => Err(err(format!(
                "`{key}` = {id} is not a token id (vocabulary of {})",
                tokens.len()
            ))),
        }
    };
    let bos = token_id("tokenizer.ggml.bos_token_id")?;
    let eos = token_id("tokenizer.ggml.eos_token_id")?;
    let unk = token_id("tokenizer.ggml.unknown_token_id")?;
    let pad = token_id("tokenizer.ggml.padding_token_id")?;
    let add_bos = gguf
        .opt_bool("tokenizer.ggml.add_bos_token")?
        .unwrap_or(false);
    let chat_template = gguf.opt_str("tokenizer.chat_template")?.map(str::to_string);
    let text = |id: Option<u32>| id.map(|id| tokens[id as usize].to_string());

    let bos_to_add = match (add_bos, bos) {
        (true, Some(id)) => Some(AddedToken {
            id,
            content: tokens[id as usize].to_string(),
            special: true,
        }),
        (true, None) => {
            return Err(err(
                "add_bos_token is set but there is no bos_token_id".to_string()
            ));
        }
        (false, _) => None,
    };
    let spec = BpeTokenizerSpec {
        tokens: &tokens,
        merges,
        added_tokens,
        pre_tokenizer,
        bos_to_add,
    };
    let config = TokenizerConfig {
        added_tokens: &spec.added_tokens,
        bos_token: text(bos),
        eos_token: text(eos),
        unk_token: text(unk),
        pad_token: text(pad),
        add_bos_token: add_bos,
        chat_template: chat_template.clone(),
        model_max_length,
    };
    Ok(GgufTokenizer {
        tokenizer_json: spec.to_json(),
        tokenizer_config: config.to_json(),
        chat_template,
        bos_token_id: bos,
        eos_token_id: eos,
        pad_token_id: pad,
    })
}

/// Splits `"left right"` at the first space after the first byte (llama.cpp's rule).
fn split_merge(merge: &str) -> Option<(String, String)> {
    // Bytes, not chars: a space byte is never inside a multi-byte UTF-8 sequence.
    let at = merge.bytes().skip(1).position(|b| b == b' ')? + 1;
    Some((merge[..at].to_string(), merge[at + 1..].to_string()))
}

/// The fields of `tokenizer_config.json` moeserve and transformers read.
pub struct TokenizerConfig<'a> {
    pub added_tokens: &'a [AddedToken],
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
    pub add_bos_token: bool,
    pub chat_template: Option<String>,
    pub model_max_length: usize,
}

impl TokenizerConfig<'_> {
    pub fn to_json(&self) -> Value {
        let decoder: Map<String, Value> = self
            .added_tokens
            .iter()
            .map(|t| {
                let mut entry = t.to_json();
                if let Some(obj) = entry.as_object_mut() {
                    obj.remove("id");
                }
                (t.id.to_string(), entry)
            })
            .collect();
        let mut config = json!({
            "add_bos_token": self.add_bos_token,
            "add_eos_token": false,
            "added_tokens_decoder": decoder,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "unk_token": self.unk_token,
            "pad_token": self.pad_token,
            "clean_up_tokenization_spaces": false,
            "model_max_length": self.model_max_length,
            "tokenizer_class": "GPT2Tokenizer",
        });
        if let (Some(template), Some(obj)) = (&self.chat_template, config.as_object_mut()) {
            obj.insert("chat_template".to_string(), Value::String(template.clone()));
        }
        config
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_map_matches_gpt2() {
        let map = byte_to_unicode();
        assert_eq!(map[b'a' as usize], 'a');
        assert_eq!(map[b' ' as usize], 'Ġ');
        assert_eq!(map[b'\n' as usize], 'Ċ');
        assert_eq!(map[0], 'Ā');
        assert_eq!(map[173], 'Ń');
        let distinct: std::collections::HashSet<char> = map.iter().copied().collect();
        assert_eq!(distinct.len(), 256);
    }

    #[test]
    fn merges_split_at_the_first_space_after_the_first_byte() {
        assert_eq!(split_merge("Ġ t"), Some(("Ġ".into(), "t".into())));
        assert_eq!(split_merge("  x"), Some((" ".into(), "x".into())));
        assert_eq!(split_merge("ab"), None);
        assert_eq!(split_merge(""), None);
    }

    #[test]
    fn unknown_pre_tokenizers_have_no_equivalent() {
        assert_eq!(
            PreTokenizer::from_gguf_pre("smollm"),
            Some(PreTokenizer::DigitsThenByteLevel)
        );
        assert_eq!(
            PreTokenizer::from_gguf_pre("gpt2"),
            Some(PreTokenizer::ByteLevel)
        );
        assert_eq!(PreTokenizer::from_gguf_pre("default"), None);
        assert_eq!(PreTokenizer::from_gguf_pre("llama-bpe"), None);
    }

    #[test]
    fn bos_is_prepended_only_when_asked_for_special_tokens() {
        let tokens = ["<s>", "a"];
        let bos = AddedToken {
            id: 0,
            content: "<s>".into(),
            special: true,
        };
        let spec = BpeTokenizerSpec {
            tokens: &tokens,
            merges: Vec::new(),
            added_tokens: vec![bos.clone()],
            pre_tokenizer: PreTokenizer::DigitsThenByteLevel,
            bos_to_add: Some(bos),
        };
        let tokenizer: tokenizers::Tokenizer =
            serde_json::from_value(spec.to_json()).expect("tokenizers accepts the JSON");
        assert_eq!(
            tokenizer.encode("aa", true).expect("encode").get_ids(),
            &[0, 1, 1]
        );
        assert_eq!(
            tokenizer.encode("aa", false).expect("encode").get_ids(),
            &[1, 1]
        );
    }

    #[test]
    fn built_json_loads_and_merges_apply() {
        let tokens = ["<s>", "a", "b", "ab", "Ġ", "Ġab"];
        let spec = BpeTokenizerSpec {
            tokens: &tokens,
            merges: vec![("a".into(), "b".into()), ("Ġ".into(), "ab".into())],
            added_tokens: vec![AddedToken {
                id: 0,
                content: "<s>".into(),
                special: true,
            }],
            pre_tokenizer: PreTokenizer::ByteLevel,
            bos_to_add: None,
        };
        let tokenizer: tokenizers::Tokenizer =
            serde_json::from_value(spec.to_json()).expect("tokenizers accepts the JSON");
        let encoding = tokenizer.encode("<s>ab ab", false).expect("encode");
        assert_eq!(encoding.get_ids(), &[0, 3, 5]);
        assert_eq!(tokenizer.decode(&[3, 5], false).expect("decode"), "ab ab");
    }
}
