//! Calls streamed as OpenAI streams them: a call's first `delta.tool_calls` entry carries its
//! `index`, `id`, `type` and name with empty arguments, the following ones the next pieces of
//! its arguments' JSON text as the model writes them. [`CallStreamer`] reads a constrained reply
//! (`required` or a named function); [`HermesStreamer`] the `<tool_call>{…}</tool_call>` blocks
//! of an `auto` reply.

use serde_json::{Value, json};

use super::tools::ToolChoice;

/// Streams the calls of a constrained reply (`required` or a named function) as OpenAI streams
/// them: a call's first `delta.tool_calls` entry carries its `index`, `id`, `type` and name with
/// empty arguments, the following ones the next pieces of its arguments' JSON text as the model
/// writes them. The constraint guarantees the JSON's shape, so the text so far is scanned again
/// at each piece (replies are short) and only what is new is sent.
#[derive(Debug)]
pub struct CallStreamer {
    /// `Some(name)`: the whole reply is this function's arguments; `None`: a JSON array of
    /// `{"name": …, "parameters": {…}}` (`required`).
    named: Option<String>,
    text: String,
    /// Per call begun: its id and how much of its arguments text has gone out.
    sent: Vec<(String, usize)>,
}

/// Where one call of a `required` reply is in its text.
#[derive(Debug, Default, PartialEq)]
pub(super) struct CallSpan {
    pub(super) name: Option<String>,
    /// The arguments value's byte range; the end is open while the value is being written.
    pub(super) args: Option<(usize, Option<usize>)>,
}

impl CallStreamer {
    pub fn new(choice: &ToolChoice) -> Option<CallStreamer> {
        let named = match choice {
            ToolChoice::Named(name) => Some(name.clone()),
            ToolChoice::Required => None,
            ToolChoice::None | ToolChoice::Auto => return None,
        };
        Some(CallStreamer {
            named,
            text: String::new(),
            sent: Vec::new(),
        })
    }

    /// Whether any call has begun.
    pub fn called(&self) -> bool {
        !self.sent.is_empty()
    }

    /// The `delta.tool_calls` entries that `piece` (the reply's next text) adds.
    pub fn push(&mut self, piece: &str) -> Vec<Value> {
        self.text.push_str(piece);
        let spans = match &self.named {
            Some(name) => vec![CallSpan {
                name: Some(name.clone()),
                args: Some((0, None)),
            }],
            None => call_spans(&self.text, "parameters"),
        };
        deltas(&spans, &self.text, &mut self.sent)
    }
}

/// The entries that `spans` of `text` add to what `sent` says went out (per call begun: its id
/// and how much of its arguments text).
fn deltas(spans: &[CallSpan], text: &str, sent: &mut Vec<(String, usize)>) -> Vec<Value> {
    let mut out = Vec::new();
    for (index, span) in spans.iter().enumerate() {
        let Some(name) = &span.name else { break };
        if index == sent.len() {
            let id = super::response_id("call");
            out.push(json!({"index": index, "id": id, "type": "function",
                            "function": {"name": name, "arguments": ""}}));
            sent.push((id, 0));
        }
        let Some((start, end)) = span.args else {
            continue;
        };
        let end = end.unwrap_or(text.len());
        let done = &mut sent[index].1;
        let from = start + *done;
        if end > from {
            out.push(json!({"index": index, "function": {"arguments": &text[from..end]}}));
            *done = end - start;
        }
    }
    out
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";

/// The calls of an `auto` reply in Hermes's format (Qwen's `<tool_call>{"name": …,
/// "arguments": {…}}</tool_call>` blocks), streamed as they are written: the blocks so far are
/// read as one JSON list of their insides.
#[derive(Debug, Default)]
pub struct HermesStreamer {
    sent: Vec<(String, usize)>,
}

impl HermesStreamer {
    /// The entries that the reply's text so far (`text`, from its first `<tool_call>` on) adds.
    pub fn push(&mut self, text: &str) -> Vec<Value> {
        let list = hermes_list(text);
        deltas(&call_spans(&list, "arguments"), &list, &mut self.sent)
    }

    /// Whether any call has begun.
    pub fn called(&self) -> bool {
        !self.sent.is_empty()
    }
}

/// `[inside,inside,…` of the blocks in `text`. An open block's end that may begin the closing
/// tag is held back, so each list is a prefix of the next but for space the close trims.
fn hermes_list(text: &str) -> String {
    let mut list = String::from("[");
    let mut rest = text;
    while let Some(open) = rest.find(HERMES_OPEN) {
        if list.len() > 1 {
            list.push(',');
        }
        let body = &rest[open + HERMES_OPEN.len()..];
        let Some(end) = body.find(HERMES_CLOSE) else {
            let body = body.trim_start();
            let keep = (1..HERMES_CLOSE.len())
                .rev()
                .find(|&n| {
                    body.len() >= n
                        && body.is_char_boundary(body.len() - n)
                        && HERMES_CLOSE.starts_with(&body[body.len() - n..])
                })
                .unwrap_or(0);
            list.push_str(&body[..body.len() - keep]);
            break;
        };
        list.push_str(body[..end].trim());
        rest = &body[end + HERMES_CLOSE.len()..];
    }
    list
}

/// The calls of a (possibly unfinished) `[{"name": …, ARGS_KEY: …}, …]` text.
pub(super) fn call_spans(text: &str, args_key: &str) -> Vec<CallSpan> {
    let mut spans: Vec<CallSpan> = Vec::new();
    let (mut depth, mut in_string, mut escaped) = (0usize, false, false);
    // Inside a call's object: the last key, whether a key (vs a value) comes next, and where
    // the current string began.
    let (mut key, mut key_next, mut string_start) = (String::new(), true, 0);
    let mut value_start: Option<usize> = None;
    for (i, c) in text.char_indices() {
        if in_string {
            match (escaped, c) {
                (true, _) => escaped = false,
                (false, '\\') => escaped = true,
                (false, '"') => {
                    in_string = false;
                    if depth == 2 && value_start.is_none() {
                        let s = &text[string_start + 1..i];
                        if key_next {
                            key = s.to_string();
                        } else if key == "name"
                            && let Some(span) = spans.last_mut()
                        {
                            span.name = serde_json::from_str(&text[string_start..=i]).ok();
                        }
                    }
                }
                _ => {}
            }
            continue;
        }
        // A value at the call's level begins with its first character after the colon.
        if depth == 2 && !key_next && value_start.is_none() && !c.is_whitespace() && key == args_key
        {
            value_start = Some(i);
            if let Some(span) = spans.last_mut() {
                span.args = Some((i, None));
            }
        }
        match c {
            '"' => {
                in_string = true;
                string_start = i;
            }
            '{' | '[' => {
                depth += 1;
                if depth == 2 && c == '{' {
                    spans.push(CallSpan::default());
                    key_next = true;
                }
            }
            '}' | ']' => {
                if depth == 2 {
                    close_value(&mut spans, &mut value_start, text, i);
                }
                depth = depth.saturating_sub(1);
            }
            ':' if depth == 2 => key_next = false,
            ',' if depth == 2 => {
                close_value(&mut spans, &mut value_start, text, i);
                key_next = true;
            }
            _ => {}
        }
    }
    spans
}

/// Ends the arguments value that was being written at byte `at` (trailing space left out).
fn close_value(spans: &mut [CallSpan], value_start: &mut Option<usize>, text: &str, at: usize) {
    if let Some(start) = value_start.take()
        && let Some(span) = spans.last_mut()
    {
        let end = start + text[start..at].trim_end().len();
        span.args = Some((start, Some(end)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hermes_blocks_read_as_one_growing_list() {
        assert_eq!(
            hermes_list("<tool_call>\n{\"a\": 1}\n</tool_call>\n<tool_call>{"),
            "[{\"a\": 1},{"
        );
        assert_eq!(hermes_list("<tool_call>{\"a\": 1}</tool"), "[{\"a\": 1}");
        assert_eq!(hermes_list("no call"), "[");
        // Each step's list is a prefix of the next (space aside).
        let text = "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"k\": \"v\"}}\n</tool_call>";
        let mut previous = String::new();
        for end in 1..=text.len() {
            let list = hermes_list(&text[..end]);
            assert!(
                list.starts_with(previous.trim_end()),
                "{previous:?} then {list:?}"
            );
            previous = list;
        }
    }
}
