//! A sure lower bound on how many tokens a text becomes, read off `tokenizer.json` once, so a
//! prompt that can never fit the context is refused from its length in bytes, before any of it
//! is tokenized (a 1 MiB prompt costs the tokenizer about half a second of CPU).
//!
//! A token stands for at most [`TokenBound::bytes_per_token`] bytes of the text when:
//! - no step drops text: the normalizer only rewrites (Unicode forms, lowercase, prepend,
//!   string replacements), the pre-tokenizer only splits (no `Whitespace`, no `Removed`
//!   behaviour), and the model turns every character it does not know into tokens (byte-level
//!   BPE with all 256 byte symbols, `byte_fallback`, or an unfused unknown token);
//! - no added token swallows whitespace around it (`lstrip` / `rstrip`), and no truncation is
//!   set.
//!
//! Then `bytes_per_token` is the longest vocabulary entry in UTF-8 bytes (an entry's text is
//! never shorter than the bytes it stands for: a byte-level symbol is one character for one
//! byte, `▁` three bytes for a space, `<0x41>` six for one byte) times how much the normalizer
//! can shrink text: 3 for NFC / NFD and lowercase (a Hangul syllable from three jamo, the Kelvin
//! sign to `k`), 4 for NFKC / NFKD (`𝐀` to `A`), and the ratio of a replacement's lengths.
//! Anything else and there is no bound: such prompts are tokenized to be measured.

use serde_json::Value;

/// A lower bound on the token count of any text; see the module comment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBound {
    /// The most bytes of input text one token can stand for.
    pub bytes_per_token: usize,
}

impl TokenBound {
    /// The bound for a parsed `tokenizer.json`, or `None` when some step may drop text.
    pub fn from_json(tokenizer: &Value) -> Option<TokenBound> {
        if !tokenizer.get("truncation").is_none_or(Value::is_null) {
            return None;
        }
        let added = tokenizer.get("added_tokens").and_then(Value::as_array);
        let added = added.map_or(&[][..], Vec::as_slice);
        let strips = |t: &Value| {
            let flag = |name| t.get(name).and_then(Value::as_bool).unwrap_or(false);
            flag("lstrip") || flag("rstrip")
        };
        if added.iter().any(strips) {
            return None;
        }
        let shrink = normalizer_shrink(tokenizer.get("normalizer").unwrap_or(&Value::Null))?;
        let pre_tokenizer = tokenizer.get("pre_tokenizer").unwrap_or(&Value::Null);
        if !pre_tokenizer_keeps_text(pre_tokenizer) {
            return None;
        }
        let model = tokenizer.get("model")?;
        let vocab = model.get("vocab")?.as_object()?;
        if !model_keeps_text(model, vocab, has_byte_level(pre_tokenizer)) {
            return None;
        }
        let longest = vocab
            .keys()
            .map(String::as_str)
            .chain(added.iter().filter_map(|t| t.get("content")?.as_str()))
            .map(str::len)
            .max()?
            // An unknown character (up to 4 bytes) may become a single token.
            .max(4);
        Some(TokenBound {
            bytes_per_token: longest.checked_mul(shrink)?,
        })
    }

    /// At least this many tokens come out of `text`.
    pub fn fewest_tokens(&self, text: &str) -> usize {
        text.len().div_ceil(self.bytes_per_token)
    }
}

fn kind(v: &Value) -> Option<&str> {
    v.get("type")?.as_str()
}

/// How many times shorter the normalizer can make a text, or `None` when it may drop text.
fn normalizer_shrink(normalizer: &Value) -> Option<usize> {
    if normalizer.is_null() {
        return Some(1);
    }
    match kind(normalizer)? {
        "NFC" | "NFD" | "Lowercase" => Some(3),
        "NFKC" | "NFKD" => Some(4),
        "Prepend" | "ByteLevel" => Some(1),
        "Replace" => {
            let pattern = normalizer.get("pattern")?.get("String")?.as_str()?;
            let content = normalizer.get("content")?.as_str()?;
            (!content.is_empty()).then(|| pattern.len().div_ceil(content.len()).max(1))
        }
        "Sequence" => normalizer
            .get("normalizers")?
            .as_array()?
            .iter()
            .try_fold(1usize, |acc, n| acc.checked_mul(normalizer_shrink(n)?)),
        // Strip, StripAccents, BertNormalizer, Precompiled, regex replacements: may drop text.
        _ => None,
    }
}

fn pre_tokenizer_keeps_text(pre: &Value) -> bool {
    if pre.is_null() {
        return true;
    }
    let behaviour_keeps = || pre.get("behavior").and_then(Value::as_str) != Some("Removed");
    match kind(pre) {
        Some("ByteLevel" | "Metaspace" | "Digits" | "UnicodeScripts") => true,
        Some("Split" | "Punctuation") => behaviour_keeps(),
        Some("Sequence") => pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|all| all.iter().all(pre_tokenizer_keeps_text)),
        // Whitespace, WhitespaceSplit, BertPreTokenizer, CharDelimiterSplit drop characters.
        _ => false,
    }
}

fn has_byte_level(pre: &Value) -> bool {
    match kind(pre) {
        Some("ByteLevel") => true,
        Some("Sequence") => pre
            .get("pretokenizers")
            .and_then(Value::as_array)
            .is_some_and(|all| all.iter().any(has_byte_level)),
        _ => false,
    }
}

/// Whether the model makes tokens of every character (BPE drops those it has no symbol for
/// when it has neither byte fallback nor an unknown token).
fn model_keeps_text(
    model: &Value,
    vocab: &serde_json::Map<String, Value>,
    byte_level: bool,
) -> bool {
    if kind(model) != Some("BPE") {
        // Unigram and WordPiece fuse unknown spans into one token; WordLevel maps a whole
        // unknown word to one.
        return false;
    }
    let flag = |name| model.get(name).and_then(Value::as_bool).unwrap_or(false);
    let has_unk = model.get("unk_token").is_some_and(|u| !u.is_null());
    let all_byte_symbols = || {
        (0..=255u8).all(|b| {
            let mut symbol = [0u8; 4];
            vocab.contains_key(byte_symbol(b).encode_utf8(&mut symbol) as &str)
        })
    };
    flag("byte_fallback") || (has_unk && !flag("fuse_unk")) || (byte_level && all_byte_symbols())
}

/// GPT-2's byte-level symbol for `byte`: printable Latin-1 bytes stand for themselves, the
/// others are shifted to U+0100 and up in order.
fn byte_symbol(byte: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(byte) {
        return char::from(byte);
    }
    let shifted = (0..byte).filter(|&b| !printable(b)).count() as u32;
    char::from_u32(256 + shifted).expect("U+0100..U+0143 are characters")
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn byte_level_vocab(extra: &[&str]) -> Value {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_symbol(b).to_string(), json!(vocab.len()));
        }
        for e in extra {
            vocab.insert(e.to_string(), json!(vocab.len()));
        }
        Value::Object(vocab)
    }

    fn tokenizer(normalizer: Value, pre_tokenizer: Value, model: Value) -> Value {
        json!({
            "version": "1.0", "truncation": null, "padding": null,
            "added_tokens": [{"id": 0, "content": "<|endoftext|>", "single_word": false,
                              "lstrip": false, "rstrip": false, "normalized": false,
                              "special": true}],
            "normalizer": normalizer, "pre_tokenizer": pre_tokenizer,
            "post_processor": null, "decoder": null, "model": model
        })
    }

    fn bpe(vocab: Value) -> Value {
        json!({"type": "BPE", "dropout": null, "unk_token": null,
               "continuing_subword_prefix": null, "end_of_word_suffix": null,
               "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []})
    }

    #[test]
    fn byte_symbols_are_gpt2s() {
        assert_eq!(byte_symbol(b' '), 'Ġ');
        assert_eq!(byte_symbol(b'\n'), 'Ċ');
        assert_eq!(byte_symbol(b'a'), 'a');
        assert_eq!(byte_symbol(0xAD), 'Ń');
        let all: std::collections::HashSet<char> = (0..=255u8).map(byte_symbol).collect();
        assert_eq!(all.len(), 256);
    }

    #[test]
    fn a_byte_level_bpe_is_bounded_by_its_longest_token() {
        let t = tokenizer(
            json!({"type": "NFC"}),
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": true}),
            bpe(byte_level_vocab(&["ĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠĠ"])),
        );
        // 16 two-byte symbols; NFC may shrink text three times.
        let bound = TokenBound::from_json(&t).unwrap();
        assert_eq!(bound.bytes_per_token, 32 * 3);
        assert_eq!(bound.fewest_tokens(&"x".repeat(96 * 10 + 1)), 11);
    }

    #[test]
    fn whatever_may_drop_text_has_no_bound() {
        let byte_level = json!({"type": "ByteLevel"});
        let vocab = byte_level_vocab(&[]);
        let mut missing_byte = vocab.clone();
        missing_byte.as_object_mut().unwrap().remove("Ġ");
        let cases = [
            // A byte-level BPE missing a byte's symbol drops that byte.
            tokenizer(Value::Null, byte_level.clone(), bpe(missing_byte)),
            tokenizer(
                json!({"type": "Strip"}),
                byte_level.clone(),
                bpe(vocab.clone()),
            ),
            tokenizer(
                json!({"type": "Sequence", "normalizers": [{"type": "NFC"}, {"type": "StripAccents"}]}),
                byte_level.clone(),
                bpe(vocab.clone()),
            ),
            tokenizer(
                json!({"type": "Replace", "pattern": {"Regex": "\\s+"}, "content": " "}),
                byte_level.clone(),
                bpe(vocab.clone()),
            ),
            tokenizer(
                Value::Null,
                json!({"type": "Whitespace"}),
                bpe(vocab.clone()),
            ),
            tokenizer(
                Value::Null,
                json!({"type": "Split", "pattern": {"String": " "}, "behavior": "Removed",
                       "invert": false}),
                bpe(vocab.clone()),
            ),
            tokenizer(
                Value::Null,
                byte_level.clone(),
                json!({"type": "Unigram", "unk_id": 0, "vocab": [["<unk>", 0.0]]}),
            ),
        ];
        for (i, case) in cases.iter().enumerate() {
            assert_eq!(TokenBound::from_json(case), None, "case {i}");
        }
        let mut stripping = tokenizer(Value::Null, byte_level.clone(), bpe(vocab.clone()));
        stripping["added_tokens"][0]["rstrip"] = json!(true);
        assert_eq!(TokenBound::from_json(&stripping), None);
        let mut truncating = tokenizer(Value::Null, byte_level, bpe(vocab));
        truncating["truncation"] = json!({"max_length": 8});
        assert_eq!(TokenBound::from_json(&truncating), None);
    }

    /// The bound holds for what the real tokenizer makes of random text: a byte-level BPE
    /// with long merged tokens, NFC, and a special token written in the text.
    #[test]
    fn the_real_tokenizer_never_makes_fewer_tokens() {
        let long = ["ĠĠ", "ĠĠĠĠ", "ĠĠĠĠĠĠĠĠ", "aa", "aaaa", "aaaaaaaa", "Ã©"];
        let merges = [
            "Ġ Ġ",
            "ĠĠ ĠĠ",
            "ĠĠĠĠ ĠĠĠĠ",
            "a a",
            "aa aa",
            "aaaa aaaa",
            "Ã ©",
        ];
        let mut model = bpe(byte_level_vocab(&long));
        model["merges"] = json!(merges);
        let mut json = tokenizer(
            json!({"type": "NFC"}),
            json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                   "use_regex": false}),
            model,
        );
        json["added_tokens"][0]["id"] = json!(300);
        json["model"]["vocab"]["<|endoftext|>"] = json!(300);
        let bound = TokenBound::from_json(&json).unwrap();
        let tokenizer: tokenizers::Tokenizer = json.to_string().parse().unwrap();
        let pieces = [
            "a",
            "aaaaaaaa",
            " ",
            "        ",
            "é",
            "e\u{301}",
            "\u{1100}\u{1161}\u{11a8}",
            "<|endoftext|>",
            "\n",
            "𝐀",
            "\u{212a}",
        ];
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..300 {
            let mut text = String::new();
            for _ in 0..(seed % 64) {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                text.push_str(pieces[(seed >> 33) as usize % pieces.len()]);
            }
            let tokens = tokenizer.encode_fast(text.as_str(), false).unwrap().len();
            assert!(
                bound.fewest_tokens(&text) <= tokens,
                "{text:?}: {tokens} tokens"
            );
        }
    }

    #[test]
    fn sentencepiece_style_replacements_and_byte_fallback_are_bounded() {
        let mut model = bpe(json!({"<unk>": 0, "▁the": 1, "<0x41>": 2}));
        model["byte_fallback"] = json!(true);
        let t = tokenizer(
            json!({"type": "Sequence", "normalizers": [
                {"type": "Prepend", "prepend": "▁"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]}),
            Value::Null,
            model,
        );
        // "<|endoftext|>" (13 bytes) is the longest entry; " " → "▁" only grows text.
        assert_eq!(TokenBound::from_json(&t).unwrap().bytes_per_token, 13);
    }
}
