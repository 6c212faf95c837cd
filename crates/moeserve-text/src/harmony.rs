//! GPT-OSS's output in the harmony format, split into the chat response's fields.
//!
//! The chat template's generation prompt ends with `<|start|>assistant`; the model then writes
//! messages of the form `{header}<|message|>{text}<|end|>`, the header naming the channel
//! (`<|channel|>analysis`, or `assistant<|channel|>final` for a message after the first), and
//! the last one ends with `<|return|>` (or `<|call|>` for a tool call) instead of `<|end|>`.
//! As vLLM does for this model, the `analysis` channel's text becomes `reasoning_content` and
//! every other channel's (`final`, `commentary`) the `content`; a message whose header names a
//! recipient (`<|channel|>commentary to=functions.get_weather <|constrain|>json`, or
//! `to=functions.get_weather<|channel|>commentary json`) is a tool call, its text the call's
//! arguments, kept apart in [`ChannelText::calls`].
//!
//! The parser reads token ids, not text: the structure is in the special tokens, and each
//! message's text is decoded apart, so no character of one channel can leak into another.
//! Output that leaves the format (a header that never reaches `<|message|>`, text between
//! messages) is not lost: from there on it is content, decoded as it came.

use crate::Result;
use crate::tokenizer::{IncrementalDecoder, SpecialTokens, Tokenizer};

/// A header longer than this is not one: the model has left the format.
const MAX_HEADER_TOKENS: usize = 32;

/// The ids of the harmony format's structural tokens in a tokenizer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HarmonyTokens {
    pub start: u32,
    pub end: u32,
    pub message: u32,
    pub channel: u32,
    /// Ends the reply.
    pub return_: u32,
    /// Ends a tool call (the reply pauses for the tool's answer).
    pub call: u32,
}

impl HarmonyTokens {
    /// The tokens, if `tokenizer` has every one of them.
    pub fn from_tokenizer(tokenizer: &Tokenizer) -> Option<HarmonyTokens> {
        let id = |token: &str| tokenizer.token_to_id(token);
        Some(HarmonyTokens {
            start: id("<|start|>")?,
            end: id("<|end|>")?,
            message: id("<|message|>")?,
            channel: id("<|channel|>")?,
            return_: id("<|return|>")?,
            call: id("<|call|>")?,
        })
    }
}

/// Text for the response's two fields.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ChannelText {
    pub reasoning: String,
    pub content: String,
    /// Tool calls that completed (their message ended).
    pub calls: Vec<HarmonyCall>,
}

/// One tool call: the message's recipient and its text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HarmonyCall {
    /// What follows `to=` (`functions.get_weather`).
    pub recipient: String,
    pub arguments: String,
}

impl HarmonyCall {
    /// The function's name, for recipients of the `functions.` namespace.
    pub fn function_name(&self) -> Option<&str> {
        self.recipient.strip_prefix("functions.")
    }
}

impl ChannelText {
    pub fn is_empty(&self) -> bool {
        self.reasoning.is_empty() && self.content.is_empty() && self.calls.is_empty()
    }

    fn push(&mut self, field: &mut Field, text: Option<String>) {
        if let Some(text) = text {
            match field {
                Field::Reasoning => self.reasoning.push_str(&text),
                Field::Content => self.content.push_str(&text),
                Field::Call(call) => call.arguments.push_str(&text),
            }
        }
    }

    /// Adds `other`'s text after this one's, field by field.
    pub fn append(&mut self, other: ChannelText) {
        self.reasoning.push_str(&other.reasoning);
        self.content.push_str(&other.content);
        self.calls.extend(other.calls);
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
enum Field {
    Reasoning,
    Content,
    /// A tool call's arguments, until its message ends.
    Call(HarmonyCall),
}

impl Field {
    /// Hands a finished call over to `out`.
    fn close(self, out: &mut ChannelText) {
        if let Field::Call(call) = self {
            out.calls.push(call);
        }
    }
}

enum State {
    /// A message's header, up to `<|message|>`.
    Header(Vec<u32>),
    /// A message's text.
    Body {
        field: Field,
        decoder: IncrementalDecoder,
    },
    /// After `<|end|>`, waiting for the next `<|start|>`.
    Between,
    /// After `<|return|>` or `<|call|>`.
    Done,
    /// Out of the format: the rest is content.
    Raw(IncrementalDecoder),
}

/// Splits one reply, token by token (streaming) or all at once.
pub struct HarmonyParser {
    tokens: HarmonyTokens,
    tokenizer: Tokenizer,
    state: State,
}

impl HarmonyParser {
    /// A parser for a reply whose prompt ended with `<|start|>assistant`.
    pub fn new(tokens: HarmonyTokens, tokenizer: Tokenizer) -> HarmonyParser {
        HarmonyParser {
            tokens,
            tokenizer,
            state: State::Header(Vec::new()),
        }
    }

    /// Splits a whole reply.
    pub fn parse(
        tokens: HarmonyTokens,
        tokenizer: Tokenizer,
        token_ids: &[u32],
    ) -> Result<ChannelText> {
        let mut parser = HarmonyParser::new(tokens, tokenizer);
        let mut text = ChannelText::default();
        for &id in token_ids {
            text.append(parser.push(id)?);
        }
        text.append(parser.finish()?);
        Ok(text)
    }

    /// The text that `token` completes.
    pub fn push(&mut self, token: u32) -> Result<ChannelText> {
        let t = self.tokens;
        let ends_reply = token == t.return_ || token == t.call;
        let mut out = ChannelText::default();
        let state = std::mem::replace(&mut self.state, State::Done);
        self.state = match state {
            State::Header(ids) if token == t.message => {
                let header = self.tokenizer.decode(&ids, SpecialTokens::Keep)?;
                let field = match (recipient_of(&header), channel_of(&header)) {
                    (Some(recipient), _) => Field::Call(HarmonyCall {
                        recipient: recipient.to_string(),
                        arguments: String::new(),
                    }),
                    (None, Some("analysis")) => Field::Reasoning,
                    _ => Field::Content,
                };
                State::Body {
                    field,
                    decoder: self.decoder(),
                }
            }
            State::Header(mut ids) => {
                let structural = [t.start, t.end, t.return_, t.call].contains(&token);
                if !structural && ids.len() < MAX_HEADER_TOKENS {
                    ids.push(token);
                    State::Header(ids)
                } else {
                    // Not a header after all: what it held is content.
                    let mut raw = self.decoder();
                    for id in ids.into_iter().chain(Some(token)) {
                        out.push(&mut Field::Content, raw.push(id)?);
                    }
                    match ends_reply {
                        true => {
                            out.push(&mut Field::Content, raw.flush()?);
                            State::Done
                        }
                        false => State::Raw(raw),
                    }
                }
            }
            State::Body {
                mut field,
                mut decoder,
            } => {
                if token == t.end || token == t.start || ends_reply {
                    out.push(&mut field, decoder.flush()?);
                    field.close(&mut out);
                    if token == t.start {
                        // A new message without the previous one's <|end|>.
                        State::Header(Vec::new())
                    } else if token == t.end {
                        State::Between
                    } else {
                        State::Done
                    }
                } else {
                    out.push(&mut field, decoder.push(token)?);
                    State::Body { field, decoder }
                }
            }
            State::Between if token == t.start => State::Header(Vec::new()),
            State::Between if ends_reply => State::Done,
            State::Between => {
                let mut raw = self.decoder();
                out.push(&mut Field::Content, raw.push(token)?);
                State::Raw(raw)
            }
            State::Raw(mut raw) => {
                out.push(&mut Field::Content, raw.push(token)?);
                State::Raw(raw)
            }
            State::Done => State::Done,
        };
        Ok(out)
    }

    /// Whatever is held back at the end of the reply (a header that never finished is content).
    pub fn finish(&mut self) -> Result<ChannelText> {
        let mut out = ChannelText::default();
        match std::mem::replace(&mut self.state, State::Done) {
            State::Header(ids) => {
                let text = self.tokenizer.decode(&ids, SpecialTokens::Skip)?;
                out.push(&mut Field::Content, Some(text));
            }
            // A call cut off (max_tokens) is still handed over; its arguments may not parse.
            State::Body {
                mut field,
                mut decoder,
            } => {
                out.push(&mut field, decoder.flush()?);
                field.close(&mut out);
            }
            State::Raw(mut raw) => out.push(&mut Field::Content, raw.flush()?),
            State::Between | State::Done => {}
        }
        Ok(out)
    }

    fn decoder(&self) -> IncrementalDecoder {
        IncrementalDecoder::new(self.tokenizer.clone(), SpecialTokens::Skip)
    }
}

/// The channel a header names: the word after `<|channel|>` (`commentary to=functions.f
/// <|constrain|>json` names `commentary`).
fn channel_of(header: &str) -> Option<&str> {
    let (_, rest) = header.split_once("<|channel|>")?;
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

/// The recipient a header names (`to=functions.get_weather`), before or after the channel.
fn recipient_of(header: &str) -> Option<&str> {
    let (_, rest) = header.split_once("to=")?;
    let end = rest
        .find(|c: char| c.is_whitespace() || c == '<')
        .unwrap_or(rest.len());
    (end > 0).then(|| &rest[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_recipient_is_the_word_after_to() {
        assert_eq!(
            recipient_of("<|channel|>commentary to=functions.get <|constrain|>json"),
            Some("functions.get")
        );
        assert_eq!(
            recipient_of(" to=functions.get_weather<|channel|>commentary json"),
            Some("functions.get_weather")
        );
        assert_eq!(recipient_of("<|channel|>final"), None);
    }

    #[test]
    fn the_channel_is_the_word_after_the_channel_token() {
        assert_eq!(channel_of("<|channel|>analysis"), Some("analysis"));
        assert_eq!(channel_of("assistant<|channel|>final"), Some("final"));
        assert_eq!(
            channel_of("<|channel|>commentary to=functions.get <|constrain|>json"),
            Some("commentary")
        );
        assert_eq!(channel_of("assistant"), None);
    }
}
