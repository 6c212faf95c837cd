//! Text in and out: the HF `tokenizer.json` tokenizer, streaming detokenization and stop strings.
//!
//! - [`Tokenizer`] wraps the `tokenizers` crate. `encode` adds no special tokens, because chat
//!   prompts are rendered by the chat template (as HF `apply_chat_template(tokenize=True)` does).
//! - [`IncrementalDecoder`] turns one sequence's token stream into text pieces with the
//!   prefix/read offsets of vLLM's `detokenize_incrementally` and TGI's `decode_token`, so a
//!   multi-byte character split over several byte tokens is emitted only once it is complete.
//! - [`StopChecker`] finds stop strings in the streamed text and holds back any suffix that could
//!   still become a stop string, so text is never emitted and then retracted.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::token_bound::TokenBound;
use crate::{Result, TextError};

/// File name of the tokenizer inside a model directory.
pub const TOKENIZER_FILE: &str = "tokenizer.json";

/// Whether decoding drops special tokens (`<|im_end|>`, `</s>`, ...) from the text.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SpecialTokens {
    Skip,
    Keep,
}

impl SpecialTokens {
    fn skip(self) -> bool {
        self == SpecialTokens::Skip
    }
}

/// A loaded HF tokenizer; cheap to clone (the tokenizer itself is shared).
#[derive(Clone)]
pub struct Tokenizer {
    inner: Arc<tokenizers::Tokenizer>,
    path: PathBuf,
    /// `None` when the pipeline may drop text (then only tokenizing measures a prompt).
    bound: Option<TokenBound>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("path", &self.path)
            .field("vocab_size", &self.vocab_size())
            .field("bound", &self.bound)
            .finish()
    }
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Tokenizer> {
        Tokenizer::from_file(dir.as_ref().join(TOKENIZER_FILE))
    }

    pub fn from_file(path: impl AsRef<Path>) -> Result<Tokenizer> {
        let path = path.as_ref().to_path_buf();
        let json = std::fs::read_to_string(&path).map_err(|e| TextError::io(&path, e))?;
        let inner: tokenizers::Tokenizer = json.parse().map_err(|e| TextError::Tokenizer {
            path: path.clone(),
            message: format!("invalid tokenizer file: {e}"),
        })?;
        let bound = serde_json::from_str(&json)
            .ok()
            .and_then(|v| TokenBound::from_json(&v));
        Ok(Tokenizer {
            inner: Arc::new(inner),
            path,
            bound,
        })
    }

    /// At least this many tokens come out of `text`, known without tokenizing it (0 when the
    /// tokenizer gives no sure bound); see [`TokenBound`].
    pub fn fewest_tokens(&self, text: &str) -> usize {
        self.bound.map_or(0, |b| b.fewest_tokens(text))
    }

    pub fn token_bound(&self) -> Option<TokenBound> {
        self.bound
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Token ids of `text` without BOS/EOS or other post-processor tokens. Special tokens written
    /// in the text (`<|im_start|>`) are still recognised, as in HF.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_inner(text, false)
    }

    /// Token ids of `text` with the post-processor's special tokens (e.g. a leading BOS), as HF
    /// `tokenizer(text)` does; for plain completions, never for rendered chat prompts.
    pub fn encode_with_special_tokens(&self, text: &str) -> Result<Vec<u32>> {
        self.encode_inner(text, true)
    }

    fn encode_inner(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| self.error(format!("cannot encode text: {e}")))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Text of `ids`. Ids the tokenizer does not know (e.g. padded vocab rows) decode to nothing,
    /// as in HF.
    pub fn decode(&self, ids: &[u32], special: SpecialTokens) -> Result<String> {
        self.inner
            .decode(ids, special.skip())
            .map_err(|e| self.error(format!("cannot decode {} tokens: {e}", ids.len())))
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Number of tokens including added tokens (HF `len(tokenizer)`).
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    fn error(&self, message: String) -> TextError {
        TextError::Tokenizer {
            path: self.path.clone(),
            message,
        }
    }
}

/// How many prompt tokens seed an [`IncrementalDecoder`] (vLLM's initial offset), so decoders
/// that strip a leading space see the output as a continuation of the prompt.
const PROMPT_CONTEXT_TOKENS: usize = 5;

/// Streams one sequence's tokens into text, emitting text only once it is complete UTF-8.
///
/// `ids[prefix_offset..read_offset]` is text already emitted, kept as context;
/// `ids[read_offset..]` is not emitted yet (e.g. the first bytes of an emoji).
#[derive(Debug, Clone)]
pub struct IncrementalDecoder {
    tokenizer: Tokenizer,
    special: SpecialTokens,
    ids: Vec<u32>,
    prefix_offset: usize,
    read_offset: usize,
    /// Decoded `ids[prefix_offset..read_offset]`.
    prefix_text: String,
}

impl IncrementalDecoder {
    /// A decoder for output that starts a new text (no prompt context).
    pub fn new(tokenizer: Tokenizer, special: SpecialTokens) -> IncrementalDecoder {
        IncrementalDecoder {
            tokenizer,
            special,
            ids: Vec::new(),
            prefix_offset: 0,
            read_offset: 0,
            prefix_text: String::new(),
        }
    }

    /// A decoder whose output continues `prompt_ids`: the last few prompt tokens serve as
    /// context (never emitted), as vLLM does.
    pub fn after_prompt(
        tokenizer: Tokenizer,
        prompt_ids: &[u32],
        special: SpecialTokens,
    ) -> Result<IncrementalDecoder> {
        let start = prompt_ids.len().saturating_sub(PROMPT_CONTEXT_TOKENS);
        let ids = prompt_ids[start..].to_vec();
        let prefix_text = tokenizer.decode(&ids, special)?;
        Ok(IncrementalDecoder {
            tokenizer,
            special,
            read_offset: ids.len(),
            ids,
            prefix_offset: 0,
            prefix_text,
        })
    }

    /// Adds one token; returns the new text if it completes at least one character.
    pub fn push(&mut self, token_id: u32) -> Result<Option<String>> {
        self.ids.push(token_id);
        let text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.special)?;
        // A byte-level BPE decoder turns an incomplete UTF-8 sequence into U+FFFD: wait for more.
        if text.len() <= self.prefix_text.len() || text.ends_with(char::REPLACEMENT_CHARACTER) {
            return Ok(None);
        }
        let new_text = new_suffix(&self.prefix_text, &text).to_string();
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        self.prefix_text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.special)?;
        // Tokens before the prefix are never decoded again.
        self.ids.drain(..self.prefix_offset);
        self.read_offset -= self.prefix_offset;
        self.prefix_offset = 0;
        Ok(Some(new_text))
    }

    /// Emits whatever is held back (an incomplete character becomes U+FFFD); call at the end.
    pub fn flush(&mut self) -> Result<Option<String>> {
        if self.read_offset == self.ids.len() {
            return Ok(None);
        }
        let text = self
            .tokenizer
            .decode(&self.ids[self.prefix_offset..], self.special)?;
        let new_text = new_suffix(&self.prefix_text, &text).to_string();
        self.ids.drain(..self.read_offset);
        self.prefix_offset = 0;
        self.read_offset = self.ids.len();
        self.prefix_text = self.tokenizer.decode(&self.ids, self.special)?;
        Ok((!new_text.is_empty()).then_some(new_text))
    }
}

/// The part of `text` after `prefix`. Decoders normally extend the prefix unchanged; when one
/// does not (a cleanup rule rewrote it), everything after the common part is new.
fn new_suffix<'t>(prefix: &str, text: &'t str) -> &'t str {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest;
    }
    let common = prefix
        .char_indices()
        .zip(text.chars())
        .find(|((_, a), b)| a != b)
        .map_or(prefix.len().min(text.len()), |((i, _), _)| i);
    let mut start = common;
    while !text.is_char_boundary(start) {
        start -= 1;
    }
    &text[start..]
}

/// Where the earliest stop string occurs in `text[search_from..]`: (byte start, index into
/// `stop`). At equal starts the first listed stop string wins.
pub fn find_stop(text: &str, stop: &[String], search_from: usize) -> Option<(usize, usize)> {
    let mut from = search_from.min(text.len());
    while !text.is_char_boundary(from) {
        from -= 1;
    }
    stop.iter()
        .enumerate()
        .filter(|(_, s)| !s.is_empty())
        .filter_map(|(i, s)| text[from..].find(s.as_str()).map(|at| (from + at, i)))
        .min()
}

/// Length in bytes of the longest suffix of `text` that is a proper prefix of a stop string:
/// the text that must not be emitted yet.
pub fn stop_prefix_len(text: &str, stop: &[String]) -> usize {
    let longest = stop.iter().map(String::len).max().unwrap_or(0);
    let earliest_start = text.len().saturating_sub(longest.saturating_sub(1));
    text.char_indices()
        .map(|(i, _)| i)
        .filter(|&i| i >= earliest_start)
        .find(|&i| {
            stop.iter()
                .any(|s| s.len() > text.len() - i && s.starts_with(&text[i..]))
        })
        .map_or(0, |i| text.len() - i)
}

/// What one [`StopChecker::push`] lets through.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct StopUpdate {
    /// Text safe to send to the client now.
    pub emit: String,
    /// Index into the stop list when a stop string matched; the request should finish.
    pub matched_stop: Option<usize>,
}

/// Per-sequence stop-string state over the streamed output text.
#[derive(Debug, Clone)]
pub struct StopChecker {
    stop: Vec<String>,
    longest_stop: usize,
    /// Output text so far (cut before the stop string once one matched).
    text: String,
    /// Bytes of `text` already emitted.
    emitted: usize,
    matched_stop: Option<usize>,
}

impl StopChecker {
    /// Empty stop strings are ignored (validation rejects them earlier).
    pub fn new(stop: &[String]) -> StopChecker {
        let stop: Vec<String> = stop.iter().filter(|s| !s.is_empty()).cloned().collect();
        let longest_stop = stop.iter().map(String::len).max().unwrap_or(0);
        StopChecker {
            stop,
            longest_stop,
            text: String::new(),
            emitted: 0,
            matched_stop: None,
        }
    }

    /// Appends newly decoded text. After a match, further text is ignored.
    pub fn push(&mut self, new_text: &str) -> StopUpdate {
        if self.matched_stop.is_some() {
            return StopUpdate {
                emit: String::new(),
                matched_stop: self.matched_stop,
            };
        }
        // A new match must end inside `new_text`, so it starts at most longest-1 bytes earlier.
        let search_from = self
            .text
            .len()
            .saturating_sub(self.longest_stop.saturating_sub(1));
        self.text.push_str(new_text);
        if let Some((at, index)) = find_stop(&self.text, &self.stop, search_from) {
            self.text.truncate(at);
            self.matched_stop = Some(index);
            return StopUpdate {
                emit: self.take_until(at),
                matched_stop: Some(index),
            };
        }
        let held = stop_prefix_len(&self.text[self.emitted..], &self.stop);
        let until = self.text.len() - held;
        StopUpdate {
            emit: self.take_until(until),
            matched_stop: None,
        }
    }

    /// Releases held-back text when the sequence ends for another reason (eos, length).
    pub fn finish(&mut self) -> String {
        self.take_until(self.text.len())
    }

    /// Output text so far, without the stop string.
    pub fn text(&self) -> &str {
        &self.text
    }

    pub fn matched_stop(&self) -> Option<&str> {
        self.matched_stop.map(|i| self.stop[i].as_str())
    }

    fn take_until(&mut self, until: usize) -> String {
        let until = until.max(self.emitted);
        let piece = self.text[self.emitted..until].to_string();
        self.emitted = until;
        piece
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GPT-2's byte → printable char table (the byte-level BPE alphabet).
    fn byte_chars() -> Vec<char> {
        let mut printable: Vec<u32> = (b'!' as u32..=b'~' as u32).collect();
        printable.extend(0xA1..=0xAC);
        printable.extend(0xAE..=0xFF);
        let mut extra = 0;
        (0u32..256)
            .map(|b| {
                if printable.contains(&b) {
                    char::from_u32(b).expect("latin-1 is valid")
                } else {
                    extra += 1;
                    char::from_u32(255 + extra).expect("small code point")
                }
            })
            .collect()
    }

    fn byte_token(bytes: &[u8]) -> String {
        let table = byte_chars();
        bytes.iter().map(|&b| table[b as usize]).collect()
    }

    /// A byte-level BPE tokenizer: ids 0..256 are bytes, 256..261 merges, 261/262 special tokens.
    fn write_tiny_tokenizer(dir: &Path) {
        let mut vocab = serde_json::Map::new();
        for b in 0..=255u8 {
            vocab.insert(byte_token(&[b]), (b as u32).into());
        }
        // "he", "hel", "hello" and the first half of 😀 (F0 9F) as merged tokens.
        let merges = [
            (byte_token(b"h"), byte_token(b"e")),
            (byte_token(b"he"), byte_token(b"l")),
            (byte_token(b"hel"), byte_token(b"lo")),
            (byte_token(b"l"), byte_token(b"o")),
            (byte_token(&[0xF0]), byte_token(&[0x9F])),
        ];
        for (i, (a, b)) in merges.iter().enumerate() {
            vocab.insert(format!("{a}{b}"), (256 + i as u32).into());
        }
        let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        let special = |id: u32, content: &str| {
            serde_json::json!({"id": id, "content": content, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        };
        let json = serde_json::json!({
            "version": "1.0",
            "added_tokens": [special(261, "<|im_start|>"), special(262, "<|im_end|>")],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                "use_regex": true},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [261],
                    "tokens": ["<|im_start|>"]}}},
            "decoder": {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true,
                "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                "continuing_subword_prefix": null, "end_of_word_suffix": null,
                "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": merges}
        });
        std::fs::write(dir.join(TOKENIZER_FILE), json.to_string()).expect("write tokenizer");
    }

    fn tiny_tokenizer() -> (tempfile::TempDir, Tokenizer) {
        let dir = tempfile::tempdir().expect("tempdir");
        write_tiny_tokenizer(dir.path());
        let tokenizer = Tokenizer::from_dir(dir.path()).expect("load tiny tokenizer");
        (dir, tokenizer)
    }

    #[test]
    fn encode_uses_merges_and_recognises_special_tokens_without_adding_any() {
        let (_dir, tok) = tiny_tokenizer();
        assert_eq!(tok.encode("hello").unwrap(), vec![258]);
        assert_eq!(
            tok.encode("<|im_start|>hello<|im_end|>").unwrap(),
            vec![261, 258, 262]
        );
        assert_eq!(
            tok.encode_with_special_tokens("hello").unwrap(),
            vec![261, 258]
        );
        assert_eq!(tok.token_to_id("<|im_end|>"), Some(262));
        assert_eq!(tok.id_to_token(258).as_deref(), Some("hello"));
        assert_eq!(tok.vocab_size(), 263);
    }

    #[test]
    fn decode_keeps_or_skips_special_tokens() {
        let (_dir, tok) = tiny_tokenizer();
        let ids = tok.encode("<|im_start|>hello 😀<|im_end|>").unwrap();
        assert_eq!(
            tok.decode(&ids, SpecialTokens::Keep).unwrap(),
            "<|im_start|>hello 😀<|im_end|>"
        );
        assert_eq!(tok.decode(&ids, SpecialTokens::Skip).unwrap(), "hello 😀");
    }

    #[test]
    fn missing_and_invalid_tokenizer_files_are_named() {
        let dir = tempfile::tempdir().unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TextError::Io { .. }));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
        std::fs::write(dir.path().join(TOKENIZER_FILE), "{\"model\": 3}").unwrap();
        let err = Tokenizer::from_dir(dir.path()).unwrap_err();
        assert!(matches!(err, TextError::Tokenizer { .. }));
        assert!(err.to_string().contains("tokenizer.json"), "{err}");
    }

    fn stream(decoder: &mut IncrementalDecoder, ids: &[u32]) -> Vec<Option<String>> {
        ids.iter().map(|&id| decoder.push(id).unwrap()).collect()
    }

    #[test]
    fn incremental_decoder_holds_back_split_emoji_and_cjk() {
        let (_dir, tok) = tiny_tokenizer();
        let text = "hi 😀你好!";
        let ids = tok.encode(text).unwrap();
        // 😀 is [F0 9F merged] 98 80; 你 and 好 are three byte tokens each.
        assert_eq!(ids.len(), 3 + 3 + 6 + 1);
        let mut decoder = IncrementalDecoder::new(tok.clone(), SpecialTokens::Skip);
        let pieces = stream(&mut decoder, &ids);
        let expected: Vec<Option<&str>> = vec![
            Some("h"),
            Some("i"),
            Some(" "),
            None,
            None,
            Some("😀"),
            None,
            None,
            Some("你"),
            None,
            None,
            Some("好"),
            Some("!"),
        ];
        assert_eq!(
            pieces.iter().map(Option::as_deref).collect::<Vec<_>>(),
            expected
        );
        assert_eq!(decoder.flush().unwrap(), None);
        let joined: String = pieces.into_iter().flatten().collect();
        assert_eq!(joined, text);
    }

    #[test]
    fn incremental_decoder_flush_releases_an_incomplete_character() {
        let (_dir, tok) = tiny_tokenizer();
        let mut decoder = IncrementalDecoder::new(tok.clone(), SpecialTokens::Keep);
        let ids = tok.encode("a你").unwrap();
        let pieces = stream(&mut decoder, &ids[..3]);
        assert_eq!(pieces, vec![Some("a".to_string()), None, None]);
        assert_eq!(decoder.flush().unwrap().as_deref(), Some("\u{FFFD}"));
        assert_eq!(decoder.flush().unwrap(), None);
    }

    #[test]
    fn incremental_decoder_after_prompt_emits_only_new_text() {
        let (_dir, tok) = tiny_tokenizer();
        let prompt = tok.encode("<|im_start|>hello world").unwrap();
        let mut decoder =
            IncrementalDecoder::after_prompt(tok.clone(), &prompt, SpecialTokens::Skip).unwrap();
        let ids = tok.encode(" ok<|im_end|>").unwrap();
        let joined: String = stream(&mut decoder, &ids).into_iter().flatten().collect();
        assert_eq!(joined, " ok");
    }

    fn stops(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn stop_checker_truncates_before_the_earliest_stop_string() {
        let mut checker = StopChecker::new(&stops(&["END", "ND!"]));
        assert_eq!(checker.push("abc E").emit, "abc ");
        let update = checker.push("ND! tail");
        assert_eq!(
            update,
            StopUpdate {
                emit: String::new(),
                matched_stop: Some(0)
            }
        );
        assert_eq!(checker.text(), "abc ");
        assert_eq!(checker.matched_stop(), Some("END"));
        assert_eq!(checker.push("more").emit, "");
    }

    #[test]
    fn stop_checker_holds_back_a_possible_stop_prefix_and_releases_it() {
        let mut checker = StopChecker::new(&stops(&["<stop>"]));
        assert_eq!(checker.push("x <st").emit, "x ");
        assert_eq!(checker.push("o").emit, "");
        // "<sto" + "x" can no longer become "<stop>".
        assert_eq!(checker.push("x <").emit, "<stox ");
        assert_eq!(checker.finish(), "<");
        assert_eq!(checker.text(), "x <stox <");
        assert_eq!(checker.matched_stop(), None);
    }

    #[test]
    fn stop_checker_handles_multibyte_stop_strings_split_across_pushes() {
        let mut checker = StopChecker::new(&stops(&["。\n"]));
        let mut out = checker.push("你好。").emit;
        let update = checker.push("\n再见");
        out.push_str(&update.emit);
        assert_eq!(update.matched_stop, Some(0));
        assert_eq!(out, "你好");
    }

    #[test]
    fn find_stop_prefers_the_earliest_position() {
        let list = stops(&["world", "lo w"]);
        assert_eq!(find_stop("hello world", &list, 0), Some((3, 1)));
        assert_eq!(find_stop("hello world", &list, 4), Some((6, 0)));
        assert_eq!(stop_prefix_len("abc wor", &list), 3);
        assert_eq!(stop_prefix_len("abc", &list), 0);
    }

    #[test]
    fn new_suffix_falls_back_to_the_common_prefix() {
        assert_eq!(new_suffix("ab", "abcd"), "cd");
        assert_eq!(new_suffix("a你", "a好x"), "好x");
    }
}
