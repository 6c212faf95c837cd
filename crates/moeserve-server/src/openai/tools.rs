//! Tool calls on `/v1/chat/completions`: `tools`, `tool_choice` and `parallel_tool_calls` as
//! OpenAI defines them, the way vLLM serves them.
//!
//! - The tools go to the chat template (`tools`, as transformers passes them), which writes
//!   them into the prompt in the model's own format.
//! - `tool_choice: "required"` and a named function are enforced through the structured-output
//!   path, as vLLM does: the reply is constrained to a JSON array of `{name, parameters}` (one
//!   of the tools each, their parameters' schema) or to the named function's parameters, so the
//!   calls always parse, whatever the template or the parser.
//! - `"auto"` (needs `--enable-auto-tool-choice` and `--tool-call-parser`, as in vLLM): the
//!   model decides, and the parser picks calls out of its text in the format of its family's
//!   template: `hermes` (`<tool_call>{"name", "arguments"}</tool_call>`, Qwen2/3, Qwen3-MoE,
//!   Hermes), `mistral` (`[TOOL_CALLS][{"name", "arguments"}, …]`, and v11's
//!   `[TOOL_CALLS]name[ARGS]{…}`), `deepseek_v3` (DeepSeek-V3 / R1 / V3.1's `<｜tool▁calls▁begin｜>`
//!   blocks) or `glm45` (GLM-4.5's `<tool_call>name<arg_key>…<arg_value>…</tool_call>`). Text
//!   before the first call is the message's content. `openai`: GPT-OSS's calls are harmony
//!   messages to a recipient, which the harmony parser tells apart (chat.rs).
//! - `"none"`: the tools are still rendered (vLLM's default); nothing is parsed.

use moeserve_structured::{GrammarSpec, StructuredOutput};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use super::call_stream::call_spans;
use crate::error::ApiError;

/// `--tool-call-parser`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ToolCallParser {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>` (Qwen, Hermes).
    Hermes,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}]` (Mistral, Mixtral).
    Mistral,
    /// `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments
    /// in a ```json block (V3 / R1) or directly after `<｜tool▁sep｜>` (V3.1), each call closed
    /// by `<｜tool▁call▁end｜>` (DeepSeek-V3, R1, V3.1).
    #[value(name = "deepseek_v3")]
    #[serde(rename = "deepseek_v3")]
    DeepseekV3,
    /// `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>…</tool_call>`, each
    /// value JSON when it parses as JSON, else a string (GLM-4.5, GLM-4.6).
    Glm45,
    /// GPT-OSS's harmony messages to a recipient (`<|channel|>commentary
    /// to=functions.NAME … <|message|>{…}<|call|>`), read by the harmony parser from the token
    /// ids rather than from text.
    Openai,
}

impl ToolCallParser {
    /// The text that opens the calls; what follows it is held back while streaming.
    pub fn marker(self) -> &'static str {
        match self {
            ToolCallParser::Hermes | ToolCallParser::Glm45 => "<tool_call>",
            ToolCallParser::Mistral => "[TOOL_CALLS]",
            ToolCallParser::DeepseekV3 => DEEPSEEK_CALLS_BEGIN,
            ToolCallParser::Openai => "<|call|>",
        }
    }

    /// The text that closes one call, after which the calls so far parse (none for Mistral's
    /// JSON list, which closes only at its end, and for harmony's structure).
    pub fn call_end(self) -> Option<&'static str> {
        match self {
            ToolCallParser::Hermes | ToolCallParser::Glm45 => Some("</tool_call>"),
            ToolCallParser::DeepseekV3 => Some(DEEPSEEK_CALL_END),
            ToolCallParser::Mistral | ToolCallParser::Openai => None,
        }
    }

    /// Splits a reply (decoded with its special tokens) into content and calls. Text that holds
    /// a marker but no call that parses stays content, as vLLM keeps it.
    pub fn parse(self, text: &str) -> (String, Vec<ToolCall>) {
        let Some(start) = text.find(self.marker()) else {
            return (text.to_string(), Vec::new());
        };
        let calls = match self {
            ToolCallParser::Hermes => parse_hermes(&text[start..]),
            ToolCallParser::Mistral => parse_mistral(&text[start + self.marker().len()..]),
            ToolCallParser::DeepseekV3 => parse_deepseek(&text[start..]),
            ToolCallParser::Glm45 => parse_glm45(&text[start..]),
            // Harmony's calls are in its structure, which text has lost.
            ToolCallParser::Openai => None,
        };
        match calls {
            Some(calls) if !calls.is_empty() => (text[..start].trim_end().to_string(), calls),
            _ => (text.to_string(), Vec::new()),
        }
    }
}

/// The insides of `<tool_call>…</tool_call>` blocks, in order; the last one's closing tag may
/// be missing (the reply ended at the call: eos or max_tokens).
fn tool_call_blocks(text: &str) -> impl Iterator<Item = &str> {
    let mut rest = text;
    std::iter::from_fn(move || {
        let open = rest.find("<tool_call>")?;
        let body = &rest[open + "<tool_call>".len()..];
        let (inside, after) = match body.find("</tool_call>") {
            Some(end) => (&body[..end], &body[end + "</tool_call>".len()..]),
            None => (body, ""),
        };
        rest = after;
        Some(inside)
    })
}

fn parse_hermes(text: &str) -> Option<Vec<ToolCall>> {
    tool_call_blocks(text)
        .map(|inside| {
            let value: Value = serde_json::from_str(inside.trim()).ok()?;
            ToolCall::from_json(&value, "arguments")
        })
        .collect()
}

const DEEPSEEK_CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const DEEPSEEK_CALL_BEGIN: &str = "<｜tool▁call▁begin｜>";
const DEEPSEEK_CALL_END: &str = "<｜tool▁call▁end｜>";
const DEEPSEEK_SEP: &str = "<｜tool▁sep｜>";

fn parse_deepseek(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for call in text.split(DEEPSEEK_CALL_BEGIN).skip(1) {
        let call = call.split(DEEPSEEK_CALL_END).next()?;
        let (head, args) = call.split_once(DEEPSEEK_SEP)?;
        // V3 / R1: `function<｜tool▁sep｜>NAME\n```json\n{…}\n````; V3.1: `NAME<｜tool▁sep｜>{…}`.
        let (name, args) = match args.split_once("```json") {
            Some((name, rest)) => (name.trim(), rest.trim().trim_end_matches("```").trim()),
            None => (head.trim(), args.trim()),
        };
        let arguments: Value = serde_json::from_str(args).ok()?;
        calls.push(ToolCall::new(name, &arguments));
    }
    Some(calls)
}

fn parse_glm45(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    for inside in tool_call_blocks(text) {
        let (name, mut args_text) = match inside.find("<arg_key>") {
            Some(at) => (inside[..at].trim(), &inside[at..]),
            None => (inside.trim(), ""),
        };
        if name.is_empty() {
            return None;
        }
        let mut arguments = serde_json::Map::new();
        while let Some(k) = args_text.find("<arg_key>") {
            let after_key = &args_text[k + "<arg_key>".len()..];
            let (key, after_key) = after_key.split_once("</arg_key>")?;
            let v = after_key.find("<arg_value>")?;
            let (value, after_value) =
                after_key[v + "<arg_value>".len()..].split_once("</arg_value>")?;
            let value = serde_json::from_str(value.trim())
                .unwrap_or_else(|_| Value::String(value.to_string()));
            arguments.insert(key.trim().to_string(), value);
            args_text = after_value;
        }
        calls.push(ToolCall::new(name, &Value::Object(arguments)));
    }
    Some(calls)
}

fn parse_mistral(text: &str) -> Option<Vec<ToolCall>> {
    let text = text.trim();
    if text.starts_with('[') {
        let list: Vec<Value> = serde_json::from_str(text).ok()?;
        return list
            .iter()
            .map(|v| ToolCall::from_json(v, "arguments"))
            .collect();
    }
    // v11 and later: `name[ARGS]{…}`, repeated after further [TOOL_CALLS].
    text.split("[TOOL_CALLS]")
        .map(|call| {
            let (name, args) = call.split_once("[ARGS]")?;
            let arguments: Value = serde_json::from_str(args.trim()).ok()?;
            Some(ToolCall::new(name.trim(), &arguments))
        })
        .collect()
}

/// One call as OpenAI returns it in `message.tool_calls`.
#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: &'static str,
    pub function: FunctionCall,
}

#[derive(Clone, Debug, PartialEq, Serialize, utoipa::ToSchema)]
pub struct FunctionCall {
    pub name: String,
    /// The arguments as a JSON text, as OpenAI sends them.
    pub arguments: String,
}

impl ToolCall {
    /// A call with a fresh id; `arguments` is its JSON text as sent.
    pub fn with_text(name: &str, arguments: &str) -> ToolCall {
        ToolCall {
            id: super::response_id("call"),
            kind: "function",
            function: FunctionCall {
                name: name.to_string(),
                arguments: arguments.to_string(),
            },
        }
    }

    pub fn new(name: &str, arguments: &Value) -> ToolCall {
        ToolCall::with_text(name, &arguments.to_string())
    }

    /// `{"name": …, <args_key>: {…}}`; arguments given as a JSON string are read as JSON.
    fn from_json(value: &Value, args_key: &str) -> Option<ToolCall> {
        let name = value.get("name")?.as_str()?;
        let arguments = match value.get(args_key) {
            None => json!({}),
            Some(Value::String(text)) => serde_json::from_str(text).ok()?,
            Some(args) => args.clone(),
        };
        Some(ToolCall::new(name, &arguments))
    }

    /// A harmony message to `functions.NAME` (another recipient keeps its full name).
    pub fn from_harmony(call: &moeserve_text::harmony::HarmonyCall) -> ToolCall {
        let name = call.function_name().unwrap_or(&call.recipient);
        ToolCall::with_text(name, call.arguments.trim())
    }

    /// The call with its index, as a streamed `delta.tool_calls` entry carries it.
    pub fn delta(&self, index: usize) -> Value {
        json!({
            "index": index,
            "id": self.id,
            "type": self.kind,
            "function": {"name": self.function.name, "arguments": self.function.arguments},
        })
    }
}

/// One entry of `tools`.
#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct ToolDef {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Clone, Debug, Deserialize, Serialize, utoipa::ToSchema)]
pub struct FunctionDef {
    pub name: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parameters: Option<Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub strict: Option<bool>,
}

impl FunctionDef {
    /// Its parameters' schema; a function without one takes an object.
    fn parameters_schema(&self) -> Value {
        self.parameters
            .clone()
            .unwrap_or_else(|| json!({"type": "object", "properties": {}}))
    }
}

/// `tool_choice`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ToolChoice {
    None,
    Auto,
    Required,
    Named(String),
}

/// The tool fields of a chat request, checked.
#[derive(Clone, Debug)]
pub struct ToolRequest {
    pub tools: Vec<ToolDef>,
    pub choice: ToolChoice,
    /// At most one call when false.
    pub parallel: bool,
}

impl ToolRequest {
    /// Reads `tools`, `tool_choice` and `parallel_tool_calls`; `None` when no tools are given.
    pub fn from_fields(
        tools: Option<&[ToolDef]>,
        tool_choice: Option<&Value>,
        parallel_tool_calls: Option<bool>,
    ) -> Result<Option<ToolRequest>, ApiError> {
        let tools = tools.unwrap_or_default();
        for (i, tool) in tools.iter().enumerate() {
            if tool.kind != "function" {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].type"),
                    format!(
                        "tool type {:?} is not supported (only \"function\")",
                        tool.kind
                    ),
                ));
            }
            let name = &tool.function.name;
            let valid = !name.is_empty()
                && name.len() <= 64
                && name
                    .bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-' || b == b'.');
            if !valid {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.name"),
                    format!("function names are 1–64 of a-z, A-Z, 0-9, _, - and ., got {name:?}"),
                ));
            }
            if let Some(p) = &tool.function.parameters
                && !p.is_object()
            {
                return Err(ApiError::invalid(
                    &format!("tools[{i}].function.parameters"),
                    "`parameters` must be a JSON schema object",
                ));
            }
        }
        let choice = match tool_choice {
            None | Some(Value::Null) => match tools.is_empty() {
                true => ToolChoice::None,
                false => ToolChoice::Auto,
            },
            Some(Value::String(s)) if s == "none" => ToolChoice::None,
            Some(Value::String(s)) if s == "auto" => ToolChoice::Auto,
            Some(Value::String(s)) if s == "required" => ToolChoice::Required,
            Some(v) => match v.pointer("/function/name").and_then(Value::as_str) {
                Some(name) if v.get("type").and_then(Value::as_str) == Some("function") => {
                    ToolChoice::Named(name.to_string())
                }
                _ => {
                    return Err(ApiError::invalid(
                        "tool_choice",
                        "`tool_choice` is \"none\", \"auto\", \"required\" or \
                         {\"type\": \"function\", \"function\": {\"name\": …}}",
                    ));
                }
            },
        };
        if tools.is_empty() {
            return match choice {
                ToolChoice::None | ToolChoice::Auto => Ok(None),
                _ => Err(ApiError::invalid(
                    "tool_choice",
                    "`tool_choice` asks for a tool call, but no `tools` are given",
                )),
            };
        }
        if let ToolChoice::Named(name) = &choice
            && !tools.iter().any(|t| &t.function.name == name)
        {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("`tool_choice` names {name:?}, which is not in `tools`"),
            ));
        }
        Ok(Some(ToolRequest {
            tools: tools.to_vec(),
            choice,
            parallel: parallel_tool_calls.unwrap_or(true),
        }))
    }

    /// The tools as the chat template gets them.
    pub fn template_tools(&self) -> Value {
        serde_json::to_value(&self.tools).expect("tool definitions serialize")
    }

    /// The constraint that enforces `required` or a named function.
    pub fn constraint(&self) -> Option<StructuredOutput> {
        let schema = match &self.choice {
            ToolChoice::None | ToolChoice::Auto => return None,
            ToolChoice::Named(name) => self
                .tools
                .iter()
                .find(|t| &t.function.name == name)
                .expect("checked: the named tool exists")
                .function
                .parameters_schema(),
            ToolChoice::Required => {
                let one_of: Vec<Value> = self
                    .tools
                    .iter()
                    .map(|t| {
                        json!({
                            "type": "object",
                            "properties": {
                                "name": {"type": "string", "enum": [t.function.name]},
                                "parameters": t.function.parameters_schema(),
                            },
                            "required": ["name", "parameters"],
                        })
                    })
                    .collect();
                let mut array = json!({"type": "array", "minItems": 1, "items": {"anyOf": one_of}});
                if !self.parallel {
                    array["maxItems"] = 1.into();
                }
                array
            }
        };
        Some(StructuredOutput::new(GrammarSpec::JsonSchema(schema)))
    }

    /// The calls in a constrained reply (`required` or named), their arguments the model's own
    /// text (as streamed); `None` for other choices, or when the reply was cut off.
    pub fn constrained_calls(&self, text: &str) -> Option<Vec<ToolCall>> {
        let call = ToolCall::with_text;
        match &self.choice {
            ToolChoice::Named(name) => {
                serde_json::from_str::<Value>(text).ok()?;
                Some(vec![call(name, text)])
            }
            ToolChoice::Required => {
                let list: Vec<Value> = serde_json::from_str(text).ok()?;
                let spans = call_spans(text, "parameters");
                if spans.len() != list.len() {
                    return None;
                }
                spans
                    .iter()
                    .map(|span| match (&span.name, span.args) {
                        (Some(name), Some((start, Some(end)))) => {
                            Some(call(name, &text[start..end]))
                        }
                        _ => None,
                    })
                    .collect()
            }
            ToolChoice::None | ToolChoice::Auto => None,
        }
    }
}

/// While a reply streams under `auto`: content passes until the parser's marker appears (a
/// possible beginning of it is held back); from there on everything is held for the parse at
/// the end.
#[derive(Debug)]
pub struct ToolStream {
    parser: ToolCallParser,
    /// Text not yet sent: a possible start of the marker.
    pending: String,
    /// The marker has been seen.
    in_calls: bool,
}

impl ToolStream {
    pub fn new(parser: ToolCallParser) -> ToolStream {
        ToolStream {
            parser,
            pending: String::new(),
            in_calls: false,
        }
    }

    /// The part of `text` (the reply's next text, special tokens included) that can be sent as
    /// content now.
    pub fn push(&mut self, text: &str) -> String {
        if self.in_calls {
            return String::new();
        }
        self.pending.push_str(text);
        let marker = self.parser.marker();
        if let Some(at) = self.pending.find(marker) {
            self.in_calls = true;
            let content = self.pending[..at].to_string();
            self.pending.clear();
            return content;
        }
        // Hold back the longest end of the text that could begin the marker.
        let keep = (1..marker.len().min(self.pending.len() + 1))
            .rev()
            .find(|&n| {
                self.pending.is_char_boundary(self.pending.len() - n)
                    && marker.starts_with(&self.pending[self.pending.len() - n..])
            })
            .unwrap_or(0);
        let cut = self.pending.len() - keep;
        let content = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        content
    }

    /// Calls begin here (the marker came as a token of its own); returns what was held back.
    pub fn begin_calls(&mut self) -> String {
        self.in_calls = true;
        std::mem::take(&mut self.pending)
    }

    /// Whether calls began (the rest of the reply goes to the parser).
    pub fn in_calls(&self) -> bool {
        self.in_calls
    }

    /// What is still held back at the end, when no call began.
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::openai::call_stream::CallStreamer;

    fn tools() -> Vec<ToolDef> {
        serde_json::from_value(json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": {
                "type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]}}},
            {"type": "function", "function": {"name": "get_time"}}
        ]))
        .unwrap()
    }

    #[test]
    fn hermes_calls_are_parsed_with_the_content_before_them() {
        let text = "Let me look.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": \
                    {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \
                    \"arguments\": {}}\n</tool_call>";
        let (content, calls) = ToolCallParser::Hermes.parse(text);
        assert_eq!(content, "Let me look.");
        assert_eq!(calls.len(), 2);
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, r#"{"city":"Paris"}"#);
        assert!(calls[0].id.starts_with("call-") && calls[0].id != calls[1].id);
        // Broken JSON stays content.
        let (content, calls) = ToolCallParser::Hermes.parse("<tool_call>{oops</tool_call>");
        assert!(calls.is_empty() && content.contains("oops"));
        let (content, calls) = ToolCallParser::Hermes.parse("no calls");
        assert!(calls.is_empty() && content == "no calls");
    }

    #[test]
    fn mistral_calls_in_both_formats() {
        let (content, calls) = ToolCallParser::Mistral.parse(
            "[TOOL_CALLS][{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Rome\"}}]",
        );
        assert_eq!((content.as_str(), calls.len()), ("", 1));
        assert_eq!(calls[0].function.arguments, r#"{"city":"Rome"}"#);
        let (_, calls) = ToolCallParser::Mistral
            .parse("[TOOL_CALLS]get_weather[ARGS]{\"city\": \"Oslo\"}[TOOL_CALLS]get_time[ARGS]{}");
        let names: Vec<_> = calls.iter().map(|c| c.function.name.as_str()).collect();
        assert_eq!(names, ["get_weather", "get_time"]);
    }

    #[test]
    fn deepseek_v3_and_v3_1_calls() {
        let v3 = "Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>\
                  get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\
                  <｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```\
                  <｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (content, calls) = ToolCallParser::DeepseekV3.parse(v3);
        assert_eq!(content, "Checking.");
        let got: Vec<_> = calls
            .iter()
            .map(|c| (c.function.name.as_str(), c.function.arguments.as_str()))
            .collect();
        assert_eq!(
            got,
            [("get_weather", r#"{"city":"Paris"}"#), ("get_time", "{}")]
        );
        let v31 = "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>\
                   {\"city\": \"Oslo\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let (content, calls) = ToolCallParser::DeepseekV3.parse(v31);
        assert_eq!(
            (content.as_str(), calls[0].function.name.as_str()),
            ("", "get_weather")
        );
        assert_eq!(calls[0].function.arguments, r#"{"city":"Oslo"}"#);
    }

    #[test]
    fn glm45_calls_with_typed_and_string_values() {
        let text = "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n\
                    <arg_value>Paris</arg_value>\n<arg_key>days</arg_key>\n\
                    <arg_value>3</arg_value>\n</tool_call><tool_call>get_time\n</tool_call>";
        let (content, calls) = ToolCallParser::Glm45.parse(text);
        assert_eq!(content, "Let me check.");
        assert_eq!(calls[0].function.name, "get_weather");
        assert_eq!(calls[0].function.arguments, r#"{"city":"Paris","days":3}"#);
        assert_eq!(
            (
                calls[1].function.name.as_str(),
                calls[1].function.arguments.as_str()
            ),
            ("get_time", "{}")
        );
    }

    #[test]
    fn choices_are_checked_and_required_builds_a_schema_over_the_tools() {
        let tools = tools();
        let req = |choice: Value| ToolRequest::from_fields(Some(&tools), Some(&choice), None);
        assert_eq!(
            req(json!("auto")).unwrap().unwrap().choice,
            ToolChoice::Auto
        );
        let named = req(json!({"type": "function", "function": {"name": "get_time"}}))
            .unwrap()
            .unwrap();
        assert_eq!(named.choice, ToolChoice::Named("get_time".into()));
        let Some(StructuredOutput {
            spec: GrammarSpec::JsonSchema(schema),
            ..
        }) = named.constraint()
        else {
            panic!("a schema")
        };
        assert_eq!(schema, json!({"type": "object", "properties": {}}));
        let err = req(json!({"type": "function", "function": {"name": "nope"}})).unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("tool_choice"));
        let required =
            ToolRequest::from_fields(Some(&tools), Some(&json!("required")), Some(false))
                .unwrap()
                .unwrap();
        let Some(StructuredOutput {
            spec: GrammarSpec::JsonSchema(schema),
            ..
        }) = required.constraint()
        else {
            panic!("a schema")
        };
        assert_eq!(schema["maxItems"], 1);
        assert_eq!(schema["items"]["anyOf"].as_array().unwrap().len(), 2);
        let calls = required
            .constrained_calls(r#"[{"name": "get_weather", "parameters": {"city": "Lima"}}]"#)
            .unwrap();
        assert_eq!(calls[0].function.arguments, r#"{"city": "Lima"}"#);
        assert_eq!(calls[0].function.name, "get_weather");
        // No tools: only none / auto pass.
        assert!(
            ToolRequest::from_fields(None, Some(&json!("auto")), None)
                .unwrap()
                .is_none()
        );
        assert!(ToolRequest::from_fields(None, Some(&json!("required")), None).is_err());
        let bad: Vec<ToolDef> = serde_json::from_value(
            json!([{"type": "function", "function": {"name": "has space"}}]),
        )
        .unwrap();
        let err = ToolRequest::from_fields(Some(&bad), None, None).unwrap_err();
        assert_eq!(err.body().param.as_deref(), Some("tools[0].function.name"));
    }

    /// Feeds `text` to a streamer in pieces of `size` characters; returns each call's name and
    /// the concatenation of its streamed arguments.
    fn streamed(choice: &ToolChoice, text: &str, size: usize) -> Vec<(String, String)> {
        let mut streamer = CallStreamer::new(choice).unwrap();
        let chars: Vec<char> = text.chars().collect();
        let mut calls: Vec<(String, String)> = Vec::new();
        for piece in chars.chunks(size) {
            for entry in streamer.push(&piece.iter().collect::<String>()) {
                let index = entry["index"].as_u64().unwrap() as usize;
                if let Some(name) = entry["function"]["name"].as_str() {
                    assert_eq!(index, calls.len(), "calls begin in order");
                    assert!(entry["id"].is_string());
                    calls.push((name.to_string(), String::new()));
                }
                calls[index].1 += entry["function"]["arguments"].as_str().unwrap();
            }
        }
        calls
    }

    #[test]
    fn constrained_calls_stream_their_arguments_piece_by_piece() {
        let text = r#"[{"name": "get_weather", "parameters": {"city": "Pa\"ris", "n": [1, {"x": 2}]}},
                       {"name":"get_time","parameters":{}} ]"#;
        for size in [1, 2, 3, 7, 1000] {
            let calls = streamed(&ToolChoice::Required, text, size);
            assert_eq!(
                calls,
                [
                    (
                        "get_weather".to_string(),
                        r#"{"city": "Pa\"ris", "n": [1, {"x": 2}]}"#.to_string()
                    ),
                    ("get_time".to_string(), "{}".to_string()),
                ],
                "pieces of {size}"
            );
        }
        // Parameters before the name: they go out once the name is known.
        let calls = streamed(
            &ToolChoice::Required,
            r#"[{"parameters": {"a": 1}, "name": "f"}]"#,
            2,
        );
        assert_eq!(calls, [("f".to_string(), r#"{"a": 1}"#.to_string())]);
        // A named function: the whole reply is its arguments.
        let named = ToolChoice::Named("get_time".into());
        let calls = streamed(&named, r#"{"zone": "UTC"}"#, 3);
        assert_eq!(
            calls,
            [("get_time".to_string(), r#"{"zone": "UTC"}"#.to_string())]
        );
    }

    #[test]
    fn streamed_content_stops_at_the_marker_and_holds_back_its_beginning() {
        let mut s = ToolStream::new(ToolCallParser::Hermes);
        assert_eq!(s.push("Hello <to"), "Hello ");
        assert_eq!(s.push("ol"), "");
        assert_eq!(s.push("_call>{\"name\""), "");
        assert!(s.in_calls());
        assert_eq!(s.push("…"), "");
        let mut s = ToolStream::new(ToolCallParser::Hermes);
        assert_eq!(s.push("a <b"), "a <b");
        assert_eq!(s.push("<"), "");
        assert_eq!(s.flush(), "<");
    }
}
