//! A chat reply of a tool request: how its calls are read out of it when it has finished
//! ([`CallReader`]) and while it streams ([`StreamedCalls`]), and GPT-OSS's harmony calls.

use moeserve_text::harmony::HarmonyCall;
use moeserve_text::tokenizer::{SpecialTokens, Tokenizer};

use super::chat::non_empty;
use super::tools::{CallStreamer, ToolCall, ToolCallParser, ToolRequest, ToolStream};

/// A harmony reply's calls as `tool_calls` when they are asked for; otherwise their text stays
/// in the content, as it was before calls were told apart.
pub(super) fn harmony_calls(
    mut content: String,
    calls: &[HarmonyCall],
    as_tool_calls: bool,
) -> (String, Vec<ToolCall>) {
    if as_tool_calls {
        return (content, calls.iter().map(ToolCall::from_harmony).collect());
    }
    calls.iter().for_each(|c| content.push_str(&c.arguments));
    (content, Vec::new())
}

/// How a tool request's calls are read out of its reply.
#[derive(Clone, Debug)]
pub(super) enum CallReader {
    /// `required` or a named function: the reply is the calls' constrained JSON.
    Constrained(ToolRequest),
    /// `auto`: the parser finds the calls the model chose to make.
    Parsed(ToolCallParser),
}

impl CallReader {
    /// The content and the calls of a finished reply; `text` is its text, `with_specials` the
    /// same with special tokens kept (Mistral's `[TOOL_CALLS]` is one).
    pub(super) fn read(&self, text: &str, with_specials: &str) -> (Option<String>, Vec<ToolCall>) {
        match self {
            CallReader::Constrained(tools) => match tools.constrained_calls(text) {
                Some(calls) => (None, calls),
                // Cut off by max_tokens before the JSON closed: it stays text.
                None => (Some(text.to_string()), Vec::new()),
            },
            CallReader::Parsed(parser) => match parser.parse(with_specials) {
                (_, calls) if calls.is_empty() => (Some(text.to_string()), calls),
                (content, calls) => (non_empty(content), calls),
            },
        }
    }
}

/// A reply's text with its special tokens, its end-of-sequence token left out.
#[derive(Clone)]
pub(super) struct SpecialText {
    tokenizer: Option<Tokenizer>,
    eos: Vec<u32>,
}

impl SpecialText {
    pub(super) fn new(assets: &moeserve_engine::assets::ModelAssets) -> SpecialText {
        SpecialText {
            tokenizer: assets.tokenizer.clone(),
            eos: assets.generation_config.eos_token_ids.clone(),
        }
    }

    pub(super) fn text(&self, ids: &[u32]) -> String {
        let ids = match ids.split_last() {
            Some((last, rest)) if self.eos.contains(last) => rest,
            _ => ids,
        };
        self.tokenizer
            .as_ref()
            .and_then(|t| t.decode(ids, SpecialTokens::Keep).ok())
            .unwrap_or_default()
    }

    pub(super) fn token_id(&self, token: &str) -> Option<u32> {
        self.tokenizer.as_ref()?.token_to_id(token)
    }
}

/// A tool request's reply while it streams. Under a constraint the reply is the calls: each
/// goes out as it is written (its name, then its arguments piece by piece). Under `auto`,
/// content goes out until the calls begin, and the calls go out whole in the last chunk.
pub(super) struct StreamedCalls {
    reader: CallReader,
    specials: SpecialText,
    /// Under `auto`: what of the text may go out as content.
    content: Option<ToolStream>,
    /// Under a constraint: the calls as they are written.
    constrained: Option<CallStreamer>,
    /// The parser's marker as one token (Mistral's special `[TOOL_CALLS]`).
    marker_token: Option<u32>,
    ids: Vec<u32>,
    /// The whole text so far, and how much of it went out as content.
    text: String,
    sent: usize,
    /// Whether any call went out.
    called: bool,
}

impl StreamedCalls {
    pub(super) fn new(reader: CallReader, specials: SpecialText) -> StreamedCalls {
        let (content, constrained, marker_token) = match &reader {
            CallReader::Parsed(parser) => (
                Some(ToolStream::new(*parser)),
                None,
                specials.token_id(parser.marker()),
            ),
            CallReader::Constrained(tools) => (None, CallStreamer::new(&tools.choice), None),
        };
        StreamedCalls {
            reader,
            specials,
            content,
            constrained,
            marker_token,
            ids: Vec::new(),
            text: String::new(),
            sent: 0,
            called: false,
        }
    }

    /// Whether any call went out.
    pub(super) fn called(&self) -> bool {
        self.called
    }

    /// The content to send for one token, and the `delta.tool_calls` entries.
    pub(super) fn push(
        &mut self,
        token_id: u32,
        text: &str,
        last: bool,
    ) -> (String, Vec<serde_json::Value>) {
        self.ids.push(token_id);
        self.text.push_str(text);
        if let Some(streamer) = self.constrained.as_mut() {
            let deltas = streamer.push(text);
            self.called = streamer.called();
            // Cut off (max_tokens) before any call began: the text is content after all.
            let content = match last && !self.called {
                true => std::mem::take(&mut self.text),
                false => String::new(),
            };
            return (content, deltas);
        }
        let mut now = match self.content.as_mut() {
            Some(stream) if Some(token_id) == self.marker_token => stream.begin_calls(),
            Some(stream) => stream.push(text),
            None => String::new(),
        };
        if !last {
            self.sent += now.len();
            return (now, Vec::new());
        }
        if let Some(stream) = self.content.as_mut()
            && !stream.in_calls()
        {
            now.push_str(&stream.flush());
            return (now, Vec::new());
        }
        let (_, calls) = self.reader.read(&self.text, &self.specials.text(&self.ids));
        if calls.is_empty() {
            // Nothing parsed: what was held back is content after all.
            now = self.text[self.sent..].to_string();
        }
        self.called = !calls.is_empty();
        let deltas = calls.iter().enumerate().map(|(i, c)| c.delta(i)).collect();
        (now, deltas)
    }
}
