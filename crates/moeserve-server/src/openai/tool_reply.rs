//! A chat reply of a tool request: how its calls are read out of it when it has finished
//! ([`CallReader`]) and while it streams ([`StreamedCalls`]), and GPT-OSS's harmony calls.

use moeserve_text::harmony::HarmonyCall;
use moeserve_text::tokenizer::{SpecialTokens, Tokenizer};

use super::call_stream::{CallStreamer, HermesStreamer};
use super::chat::non_empty;
use super::tools::{ToolCall, ToolCallParser, ToolRequest, ToolStream};

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
/// content goes out until the calls begin; then Hermes's calls stream as the constrained ones
/// do (name, then arguments piece by piece), the other formats' each whole as soon as it
/// closes (GLM-4.5's `</tool_call>`, DeepSeek's call end; Mistral's list at the end of the
/// reply). A later call that does not parse is dropped once earlier ones went out (unstreamed,
/// such a reply is all content, as vLLM keeps it: a streamed call cannot be taken back).
pub(super) struct StreamedCalls {
    reader: CallReader,
    specials: SpecialText,
    /// Under `auto`: what of the text may go out as content.
    content: Option<ToolStream>,
    /// Under a constraint: the calls as they are written.
    constrained: Option<CallStreamer>,
    /// The parser's marker as one token (Mistral's special `[TOOL_CALLS]`).
    marker_token: Option<u32>,
    /// Under `auto` with Hermes's format: its calls as they are written.
    hermes: Option<HermesStreamer>,
    /// Under `auto` otherwise: the call end as one token (DeepSeek's), the ends seen in the
    /// text so far, and how many calls went out.
    end_token: Option<u32>,
    ends_seen: usize,
    emitted: usize,
    ids: Vec<u32>,
    /// The whole text so far, and how much of it went out as content.
    text: String,
    sent: usize,
    /// Whether any call went out.
    called: bool,
}

impl StreamedCalls {
    pub(super) fn new(reader: CallReader, specials: SpecialText) -> StreamedCalls {
        let (content, constrained, marker_token, end_token) = match &reader {
            CallReader::Parsed(parser) => (
                Some(ToolStream::new(*parser)),
                None,
                specials.token_id(parser.marker()),
                parser.call_end().and_then(|end| specials.token_id(end)),
            ),
            CallReader::Constrained(tools) => (None, CallStreamer::new(&tools.choice), None, None),
        };
        let hermes = matches!(reader, CallReader::Parsed(ToolCallParser::Hermes))
            .then(HermesStreamer::default);
        StreamedCalls {
            reader,
            specials,
            content,
            constrained,
            marker_token,
            hermes,
            end_token,
            ends_seen: 0,
            emitted: 0,
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
        let in_calls = self.content.as_ref().is_some_and(ToolStream::in_calls);
        let marker_at = self.text.find(ToolCallParser::Hermes.marker());
        if in_calls && marker_at.is_none() {
            // The tags are special tokens of this tokenizer, absent from the text: each call
            // goes out whole as it closes, read from the text with its special tokens.
            self.hermes = None;
        }
        if let Some(hermes) = self.hermes.as_mut() {
            let deltas = match marker_at {
                Some(at) if in_calls => hermes.push(&self.text[at..]),
                _ => Vec::new(),
            };
            self.called = hermes.called();
            if !last {
                self.sent += now.len();
                return (now, deltas);
            }
            match self.content.as_mut() {
                Some(stream) if !in_calls => now.push_str(&stream.flush()),
                // Nothing parsed: what was held back is content after all.
                _ if !self.called => now = self.text[self.sent..].to_string(),
                _ => {}
            }
            return (now, deltas);
        }
        if !last {
            self.sent += now.len();
            let deltas = match in_calls && self.call_closed(token_id) {
                true => self.new_calls(),
                false => Vec::new(),
            };
            return (now, deltas);
        }
        if let Some(stream) = self.content.as_mut()
            && !in_calls
        {
            now.push_str(&stream.flush());
            return (now, Vec::new());
        }
        let deltas = self.new_calls();
        if self.emitted == 0 {
            // Nothing parsed: what was held back is content after all.
            now = self.text[self.sent..].to_string();
        }
        (now, deltas)
    }

    /// Whether `token_id` (just pushed) closed a call.
    fn call_closed(&mut self, token_id: u32) -> bool {
        if Some(token_id) == self.end_token {
            return true;
        }
        let CallReader::Parsed(parser) = &self.reader else {
            return false;
        };
        let Some(end) = parser.call_end() else {
            return false;
        };
        let ends = self.text.matches(end).count();
        let closed = ends > self.ends_seen;
        self.ends_seen = ends;
        closed
    }

    /// The calls that parse now and have not gone out, as `delta.tool_calls` entries.
    fn new_calls(&mut self) -> Vec<serde_json::Value> {
        let (_, calls) = self.reader.read(&self.text, &self.specials.text(&self.ids));
        let deltas: Vec<_> = (self.emitted..calls.len())
            .map(|i| calls[i].delta(i))
            .collect();
        self.emitted = self.emitted.max(calls.len());
        self.called = self.emitted > 0;
        deltas
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::tools::ToolCallParser;
    use moeserve_formats::presets::{ChatFormat, byte_level_tokenizer};

    /// A byte-level tokenizer (one token per byte, ChatML's specials).
    fn specials() -> SpecialText {
        let dir = tempfile::tempdir().unwrap();
        let (tokenizer, _) = byte_level_tokenizer(1024, &ChatFormat::CHATML);
        std::fs::write(dir.path().join("tokenizer.json"), tokenizer.to_string()).unwrap();
        SpecialText {
            tokenizer: Some(Tokenizer::from_dir(dir.path()).unwrap()),
            eos: Vec::new(),
        }
    }

    /// Streams `reply` one byte-token at a time; returns the content and, per token, how many
    /// `delta.tool_calls` entries it carried, with the entries.
    fn stream(parser: ToolCallParser, reply: &str) -> (String, Vec<(usize, serde_json::Value)>) {
        let specials = specials();
        let ids = specials.tokenizer.as_ref().unwrap().encode(reply).unwrap();
        let mut calls = StreamedCalls::new(CallReader::Parsed(parser), specials);
        let (mut content, mut deltas) = (String::new(), Vec::new());
        for (i, (id, byte)) in ids.iter().zip(reply.chars()).enumerate() {
            let (text, out) = calls.push(*id, &byte.to_string(), i + 1 == ids.len());
            content.push_str(&text);
            deltas.extend(out.into_iter().map(|d| (i, d)));
        }
        (content, deltas)
    }

    /// Per call index: its name, its arguments put together, and the tokens of its first
    /// and last entries.
    fn calls_of(deltas: &[(usize, serde_json::Value)]) -> Vec<(String, String, usize, usize)> {
        let mut calls: Vec<(String, String, usize, usize)> = Vec::new();
        for (token, d) in deltas {
            let index = d["index"].as_u64().unwrap() as usize;
            if index == calls.len() {
                let name = d["function"]["name"].as_str().unwrap().to_string();
                assert!(d["id"].is_string(), "{d}");
                calls.push((name, String::new(), *token, *token));
            }
            let call = &mut calls[index];
            call.1
                .push_str(d["function"]["arguments"].as_str().unwrap());
            call.3 = *token;
        }
        calls
    }

    #[test]
    fn hermes_auto_calls_stream_their_name_then_their_arguments_piece_by_piece() {
        let first = "<tool_call>\n{\"name\": \"a\", \"arguments\": {\"x\": 1}}\n</tool_call>";
        let second = "\n<tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let reply = format!("Let me look.\n{first}{second}");
        let (content, deltas) = stream(ToolCallParser::Hermes, &reply);
        assert_eq!(content, "Let me look.\n");
        let calls = calls_of(&deltas);
        assert_eq!(calls.len(), 2, "{deltas:?}");
        assert_eq!(
            (calls[0].0.as_str(), calls[0].1.as_str()),
            ("a", "{\"x\": 1}")
        );
        assert_eq!((calls[1].0.as_str(), calls[1].1.as_str()), ("b", "{}"));
        // Piece by piece: the arguments took several entries, all before the second call.
        let pieces = deltas.iter().filter(|(_, d)| d["index"] == 0).count();
        assert!(pieces > 3, "{deltas:?}");
        assert!(calls[0].3 < calls[1].2, "{calls:?}");
        // The name went out as soon as it was written, long before the block closed.
        let name_written = "Let me look.\n<tool_call>\n{\"name\": \"a\"".len() - 1;
        assert_eq!(calls[0].2, name_written);
    }

    #[test]
    fn glm_auto_calls_go_out_whole_as_each_closes() {
        let first = "<tool_call>a\n<arg_key>x</arg_key>\n<arg_value>1</arg_value>\n</tool_call>";
        let second = "\n<tool_call>b\n</tool_call>";
        let reply = format!("Let me look.\n{first}{second}");
        let (content, deltas) = stream(ToolCallParser::Glm45, &reply);
        assert_eq!(content, "Let me look.\n");
        assert_eq!(deltas.len(), 2, "{deltas:?}");
        // The first call went out at the token closing it, before the second began.
        assert_eq!(deltas[0].0, "Let me look.\n".len() + first.len() - 1);
        assert_eq!(deltas[0].1["function"]["name"], "a");
        assert_eq!(deltas[0].1["function"]["arguments"], "{\"x\":1}");
        assert_eq!(
            (deltas[1].0, &deltas[1].1["index"]),
            (reply.len() - 1, &1.into())
        );
    }

    #[test]
    fn an_unclosed_last_call_still_goes_out_and_no_call_is_content() {
        let reply = "<tool_call>{\"name\": \"a\", \"arguments\": {}}";
        let (content, deltas) = stream(ToolCallParser::Hermes, reply);
        assert_eq!(content, "");
        assert_eq!(calls_of(&deltas)[0].1, "{}");
        // A marker with nothing that parses: all of it is content, as unstreamed.
        let reply = "So <tool_call> is a tag.";
        let (content, deltas) = stream(ToolCallParser::Hermes, reply);
        assert_eq!((content.as_str(), deltas.len()), (reply, 0));
    }
}
