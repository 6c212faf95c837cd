//! Log-probabilities in OpenAI's two shapes: legacy completions
//! (`{tokens, token_logprobs, top_logprobs, text_offset}`) and chat
//! (`{content: [{token, logprob, bytes, top_logprobs}]}`), with token strings from the tokenizer.
//!
//! As in vLLM, each completions `top_logprobs` entry holds the requested alternatives plus the
//! chosen token; chat's holds exactly the alternatives.

use moeserve_text::tokenizer::{SpecialTokens, Tokenizer};
use serde::Serialize;
use serde::ser::SerializeMap;

/// Token ids to strings and bytes.
#[derive(Clone)]
pub struct TokenStrings {
    tokenizer: Option<Tokenizer>,
}

impl TokenStrings {
    pub fn new(tokenizer: Option<Tokenizer>) -> TokenStrings {
        TokenStrings { tokenizer }
    }

    /// The token's text; `token_id:N` without a tokenizer (vLLM's `return_tokens_as_token_ids`).
    pub fn text(&self, id: u32) -> String {
        match &self.tokenizer {
            Some(t) => t
                .decode(&[id], SpecialTokens::Keep)
                .unwrap_or_else(|_| format!("token_id:{id}")),
            None => format!("token_id:{id}"),
        }
    }

    /// The token's raw bytes: exact for byte-level BPE and `<0xNN>` byte tokens, even when the
    /// token is part of a multi-byte character (its text then shows U+FFFD).
    pub fn bytes(&self, id: u32) -> Vec<u8> {
        let text = self.text(id);
        let Some(piece) = self.tokenizer.as_ref().and_then(|t| t.id_to_token(id)) else {
            return text.into_bytes();
        };
        if let Some(byte) = byte_fallback_token(&piece) {
            return vec![byte];
        }
        if text.contains('\u{FFFD}')
            && let Some(bytes) = byte_level_bytes(&piece)
        {
            return bytes;
        }
        text.into_bytes()
    }
}

/// `<0x41>` → 0x41 (SentencePiece byte fallback).
fn byte_fallback_token(piece: &str) -> Option<u8> {
    let hex = piece.strip_prefix("<0x")?.strip_suffix('>')?;
    (hex.len() == 2).then(|| u8::from_str_radix(hex, 16).ok())?
}

/// Undoes GPT-2's byte-to-unicode mapping of byte-level BPE pieces (`Ġ` → space).
fn byte_level_bytes(piece: &str) -> Option<Vec<u8>> {
    piece.chars().map(byte_of_char).collect()
}

fn byte_of_char(c: char) -> Option<u8> {
    let printable = |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || b >= 174;
    let code = c as u32;
    if code < 256 && printable(code) {
        return Some(code as u8);
    }
    // Unprintable bytes were moved to 256.. in ascending byte order.
    let index = code.checked_sub(256)?;
    (0u32..256)
        .filter(|b| !printable(*b))
        .nth(index as usize)
        .map(|b| b as u8)
}

/// A JSON object whose keys keep the given order (most likely first).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OrderedLogprobs(pub Vec<(String, f32)>);

impl Serialize for OrderedLogprobs {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let mut map = s.serialize_map(Some(self.0.len()))?;
        for (token, logprob) in &self.0 {
            map.serialize_entry(token, logprob)?;
        }
        map.end()
    }
}

/// Legacy completions `logprobs`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, utoipa::ToSchema)]
pub struct CompletionLogprobs {
    pub tokens: Vec<String>,
    pub token_logprobs: Vec<f32>,
    /// Per token, `{token text: logprob}`, most likely first.
    #[schema(value_type = Vec<std::collections::HashMap<String, f32>>)]
    pub top_logprobs: Vec<OrderedLogprobs>,
    pub text_offset: Vec<usize>,
}

/// One generated token as the logprobs builders need it.
pub struct TokenLogprob<'a> {
    pub token_id: u32,
    pub logprob: f32,
    pub top: &'a [(u32, f32)],
}

impl CompletionLogprobs {
    /// Appends tokens; `offset` is the running text offset (in characters), advanced here.
    pub fn push(&mut self, strings: &TokenStrings, token: TokenLogprob<'_>, offset: &mut usize) {
        let text = strings.text(token.token_id);
        self.text_offset.push(*offset);
        *offset += text.chars().count();
        let mut top: Vec<(String, f32)> = token
            .top
            .iter()
            .map(|(id, lp)| (strings.text(*id), *lp))
            .collect();
        if !token.top.iter().any(|(id, _)| *id == token.token_id) {
            top.push((text.clone(), token.logprob));
        }
        self.tokens.push(text);
        self.token_logprobs.push(token.logprob);
        self.top_logprobs.push(OrderedLogprobs(top));
    }
}

/// Chat `logprobs`.
#[derive(Clone, Debug, Default, Serialize, PartialEq, utoipa::ToSchema)]
pub struct ChatLogprobs {
    pub content: Vec<ChatTokenLogprob>,
}

#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct ChatTokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
    pub top_logprobs: Vec<ChatTopLogprob>,
}

#[derive(Clone, Debug, Serialize, PartialEq, utoipa::ToSchema)]
pub struct ChatTopLogprob {
    pub token: String,
    pub logprob: f32,
    pub bytes: Vec<u8>,
}

impl ChatLogprobs {
    pub fn push(&mut self, strings: &TokenStrings, token: TokenLogprob<'_>) {
        let top_logprobs = token
            .top
            .iter()
            .map(|(id, lp)| ChatTopLogprob {
                token: strings.text(*id),
                logprob: *lp,
                bytes: strings.bytes(*id),
            })
            .collect();
        self.content.push(ChatTokenLogprob {
            token: strings.text(token.token_id),
            logprob: token.logprob,
            bytes: strings.bytes(token.token_id),
            top_logprobs,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_level_pieces_map_back_to_bytes() {
        assert_eq!(byte_level_bytes("Ġhi"), Some(b" hi".to_vec()));
        assert_eq!(byte_level_bytes("Ċ"), Some(b"\n".to_vec()));
        // U+00E2 is printable and stands for itself: the first byte of "€".
        assert_eq!(byte_level_bytes("â"), Some(vec![0xE2]));
        assert_eq!(byte_level_bytes("\u{4e2d}"), None);
        assert_eq!(byte_fallback_token("<0x0A>"), Some(b'\n'));
        assert_eq!(byte_fallback_token("<0x0AB>"), None);
    }

    #[test]
    fn ids_without_a_tokenizer_read_as_token_ids() {
        let strings = TokenStrings::new(None);
        assert_eq!(strings.text(7), "token_id:7");
        let mut lp = CompletionLogprobs::default();
        let mut offset = 0;
        let top = [(7, -0.1), (9, -2.5)];
        let token = |token_id, logprob| TokenLogprob {
            token_id,
            logprob,
            top: &top,
        };
        lp.push(&strings, token(7, -0.1), &mut offset);
        lp.push(&strings, token(11, -4.0), &mut offset);
        assert_eq!(lp.text_offset, vec![0, 10]);
        assert_eq!(lp.top_logprobs[0].0.len(), 2);
        assert_eq!(lp.top_logprobs[1].0.len(), 3, "the chosen token is added");
        let json = serde_json::to_string(&lp.top_logprobs[1]).unwrap();
        assert!(json.starts_with(r#"{"token_id:7":"#), "{json}");
    }
}
