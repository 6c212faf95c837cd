//! Chat templates: turning a list of messages into the prompt text the model was trained on.
//!
//! Follows HF transformers' `apply_chat_template`: the Jinja template comes from
//! `chat_template.jinja` or `tokenizer_config.json`'s `chat_template`, and is rendered with
//! `trim_blocks` + `lstrip_blocks`, Python string methods (minijinja-contrib's pycompat), the
//! globals `raise_exception` and `strftime_now`, a Python-style `tojson`, and the variables
//! `messages`, `add_generation_prompt`, `tools`/`documents` (none), the special-token strings,
//! and `reasoning_effort` when the request sets it (as vLLM passes it to GPT-OSS's template).

use std::path::Path;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::{Result, TextError};

pub const CHAT_TEMPLATE_FILE: &str = "chat_template.jinja";
pub const TOKENIZER_CONFIG_FILE: &str = "tokenizer_config.json";

/// Marks errors raised by the template itself, so their message is shown as written.
const RAISED_PREFIX: &str = "raise_exception: ";

/// One chat turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant turn's calls, as OpenAI sends them (`[{id, type, function: {name,
    /// arguments}}]`, the arguments an object, as transformers' templates expect).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    /// A `tool` turn answers the call with this id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
        }
    }
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct RenderOptions {
    /// End the prompt with the header of an assistant turn, so the model answers.
    pub add_generation_prompt: bool,
    /// The template's `reasoning_effort`; left undefined when `None` (the template's default).
    pub reasoning_effort: Option<ReasoningEffort>,
}

/// OpenAI's `reasoning_effort` (what GPT-OSS's system message states).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReasoningEffort {
    Low,
    Medium,
    High,
}

impl ReasoningEffort {
    pub const NAMES: &'static str = "low, medium, high";

    pub fn from_name(name: &str) -> Option<ReasoningEffort> {
        match name {
            "low" => Some(ReasoningEffort::Low),
            "medium" => Some(ReasoningEffort::Medium),
            "high" => Some(ReasoningEffort::High),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ReasoningEffort::Low => "low",
            ReasoningEffort::Medium => "medium",
            ReasoningEffort::High => "high",
        }
    }
}

/// Special-token strings the template may print (from `tokenizer_config.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecialTokenStrings {
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
    pub unk_token: Option<String>,
    pub pad_token: Option<String>,
}

impl SpecialTokenStrings {
    /// Reads `bos_token` etc., each a string or an added-token object `{"content": ...}`.
    pub fn from_tokenizer_config(config: &serde_json::Value, path: &Path) -> Result<Self> {
        let token = |key: &str| -> Result<Option<String>> {
            match config.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                Some(serde_json::Value::Object(o)) => match o.get("content") {
                    Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
                    _ => Err(TextError::config(
                        path,
                        format!("`{key}` has no string `content`"),
                    )),
                },
                Some(other) => Err(TextError::config(
                    path,
                    format!("`{key}` must be a string or an object with `content`, got {other}"),
                )),
            }
        };
        Ok(SpecialTokenStrings {
            bos_token: token("bos_token")?,
            eos_token: token("eos_token")?,
            unk_token: token("unk_token")?,
            pad_token: token("pad_token")?,
        })
    }

    fn entries(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("bos_token", &self.bos_token),
            ("eos_token", &self.eos_token),
            ("unk_token", &self.unk_token),
            ("pad_token", &self.pad_token),
        ]
        .into_iter()
        .filter_map(|(name, value)| value.as_deref().map(|v| (name, v)))
    }
}

/// A compiled chat template, ready to render; shareable across threads.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// Template name inside `env`: the file it came from, so errors point at it.
    name: String,
    special_tokens: SpecialTokenStrings,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("name", &self.name)
            .field("special_tokens", &self.special_tokens)
            .finish()
    }
}

impl ChatTemplate {
    /// The model's chat template, or `None` when the model ships none.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Option<ChatTemplate>> {
        let dir = dir.as_ref();
        let config_path = dir.join(TOKENIZER_CONFIG_FILE);
        let config = read_json_if_present(&config_path)?;
        let special_tokens = match &config {
            Some(config) => SpecialTokenStrings::from_tokenizer_config(config, &config_path)?,
            None => SpecialTokenStrings::default(),
        };
        let jinja_path = dir.join(CHAT_TEMPLATE_FILE);
        if jinja_path.is_file() {
            let source =
                std::fs::read_to_string(&jinja_path).map_err(|e| TextError::io(&jinja_path, e))?;
            let name = jinja_path.display().to_string();
            return ChatTemplate::compile(name, source, special_tokens).map(Some);
        }
        let Some(config) = config else {
            return Ok(None);
        };
        let Some(source) = template_from_tokenizer_config(&config, &config_path)? else {
            return Ok(None);
        };
        let name = format!("{}:chat_template", config_path.display());
        ChatTemplate::compile(name, source, special_tokens).map(Some)
    }

    /// Compiles a template given as text (e.g. from a command-line flag).
    pub fn new(source: &str, special_tokens: SpecialTokenStrings) -> Result<ChatTemplate> {
        ChatTemplate::compile(
            "chat_template".to_string(),
            source.to_string(),
            special_tokens,
        )
    }

    fn compile(name: String, source: String, special_tokens: SpecialTokenStrings) -> Result<Self> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", python_tojson);
        let source = rewrite_generation_tags(&source);
        env.add_template_owned(name.clone(), source)
            .map_err(|e| template_error(&e))?;
        Ok(ChatTemplate {
            env,
            name,
            special_tokens,
        })
    }

    pub fn special_tokens(&self) -> &SpecialTokenStrings {
        &self.special_tokens
    }

    /// The prompt text for `messages` (not tokenized; encode it without adding special tokens).
    pub fn render(&self, messages: &[ChatMessage], opts: &RenderOptions) -> Result<String> {
        self.render_with_tools(messages, opts, None)
    }

    /// [`ChatTemplate::render`] with `tools` (OpenAI's list of `{type, function}` definitions)
    /// passed to the template, as transformers' `apply_chat_template(tools=…)` passes them.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        opts: &RenderOptions,
        tools: Option<&serde_json::Value>,
    ) -> Result<String> {
        let template = self
            .env
            .get_template(&self.name)
            .map_err(|e| template_error(&e))?;
        let mut ctx: Vec<(&str, Value)> = vec![
            ("messages", Value::from_serialize(messages)),
            (
                "add_generation_prompt",
                Value::from(opts.add_generation_prompt),
            ),
            (
                "tools",
                tools.map_or(Value::from(()), Value::from_serialize),
            ),
            ("documents", Value::from(())),
        ];
        if let Some(effort) = opts.reasoning_effort {
            ctx.push(("reasoning_effort", Value::from(effort.name())));
        }
        ctx.extend(
            self.special_tokens
                .entries()
                .map(|(k, v)| (k, Value::from(v))),
        );
        template
            .render(Value::from_iter(ctx))
            .map_err(|e| template_error(&e))
    }
}

fn read_json_if_present(path: &Path) -> Result<Option<serde_json::Value>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(TextError::io(path, e)),
    };
    let value = serde_json::from_str(&text)
        .map_err(|e| TextError::config(path, format!("invalid JSON: {e}")))?;
    Ok(Some(value))
}

/// `chat_template` is a string, or a list of `{name, template}` of which "default" is used.
fn template_from_tokenizer_config(
    config: &serde_json::Value,
    path: &Path,
) -> Result<Option<String>> {
    match config.get("chat_template") {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(serde_json::Value::Array(list)) => {
            let default = list
                .iter()
                .find(|t| t.get("name").and_then(|n| n.as_str()) == Some("default"));
            match default
                .and_then(|t| t.get("template"))
                .and_then(|t| t.as_str())
            {
                Some(template) => Ok(Some(template.to_string())),
                None => Err(TextError::config(
                    path,
                    "`chat_template` is a list without a {\"name\": \"default\", \"template\": ...} entry",
                )),
            }
        }
        Some(other) => Err(TextError::config(
            path,
            format!("`chat_template` must be a string or a list of named templates, got {other}"),
        )),
    }
}

fn template_error(err: &Error) -> TextError {
    let location = match (err.name(), err.line()) {
        (Some(name), Some(line)) => format!(" ({name}, line {line})"),
        _ => String::new(),
    };
    if let Some(raised) = err.detail().and_then(|d| d.strip_prefix(RAISED_PREFIX)) {
        return TextError::ChatTemplate {
            message: format!("the template raised an exception: {raised}{location}"),
        };
    }
    let mut message = err.to_string();
    let mut source = std::error::Error::source(err);
    while let Some(cause) = source {
        message.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    TextError::ChatTemplate { message }
}

fn raise_exception(message: String) -> std::result::Result<Value, Error> {
    Err(Error::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED_PREFIX}{message}"),
    ))
}

fn strftime_now(format: String) -> std::result::Result<Value, Error> {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| {
            Error::new(
                ErrorKind::InvalidOperation,
                format!("clock before 1970: {e}"),
            )
        })?;
    Ok(Value::from(format_utc(&format, now.as_secs() as i64)))
}

/// Python's `tojson` of HF (`json.dumps(x, ensure_ascii=False, indent=indent)`): `", "` and
/// `": "` separators, no HTML escaping (minijinja's built-in escapes `<`, `>`, `&`, `'`).
fn python_tojson(
    value: &Value,
    indent: Option<usize>,
    kwargs: Kwargs,
) -> std::result::Result<Value, Error> {
    let indent = match indent {
        Some(indent) => Some(indent),
        None => kwargs.get::<Option<usize>>("indent")?,
    };
    let mut out = Vec::new();
    let written = match indent {
        Some(n) => {
            let spaces = " ".repeat(n);
            let formatter = serde_json::ser::PrettyFormatter::with_indent(spaces.as_bytes());
            value.serialize(&mut serde_json::Serializer::with_formatter(
                &mut out, formatter,
            ))
        }
        None => value.serialize(&mut serde_json::Serializer::with_formatter(
            &mut out,
            PythonCompact,
        )),
    };
    written.map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let json = String::from_utf8(out)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    Ok(Value::from_safe_string(json))
}

/// serde_json formatter with Python `json.dumps`' default separators.
struct PythonCompact;

impl serde_json::ser::Formatter for PythonCompact {
    fn begin_array_value<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_key<W: ?Sized + std::io::Write>(
        &mut self,
        w: &mut W,
        first: bool,
    ) -> std::io::Result<()> {
        if first { Ok(()) } else { w.write_all(b", ") }
    }

    fn begin_object_value<W: ?Sized + std::io::Write>(&mut self, w: &mut W) -> std::io::Result<()> {
        w.write_all(b": ")
    }
}

/// HF's `{% generation %}...{% endgeneration %}` only marks assistant tokens for training masks;
/// rendering-wise it is `{% if true %}...{% endif %}`, which keeps whitespace control identical.
fn rewrite_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        let (before, tag) = rest.split_at(start);
        out.push_str(before);
        let Some(end) = tag.find("%}") else {
            rest = tag;
            break;
        };
        let inner = &tag[2..end];
        let keyword = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match keyword {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(replacement) => {
                out.push_str("{%");
                out.push_str(&inner.replacen(keyword, replacement, 1));
                out.push_str("%}");
            }
            None => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
];

/// A small `strftime` over UTC (no time-zone database here) for the directives chat templates
/// use; `%-d` style drops padding as glibc does. Unknown directives are kept verbatim.
fn format_utc(format: &str, unix_secs: i64) -> String {
    let days = unix_secs.div_euclid(86_400);
    let secs_of_day = unix_secs.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs_of_day / 3600, secs_of_day / 60 % 60, secs_of_day % 60);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let day_of_year = days - days_from_civil(year, 1, 1) + 1;
    let month_name = MONTHS[(month - 1) as usize];
    let hour12 = if hour % 12 == 0 { 12 } else { hour % 12 };

    let mut out = String::with_capacity(format.len() + 16);
    let mut chars = format.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let unpadded = chars.next_if_eq(&'-').is_some();
        let num = |value: i64, width: usize| {
            if unpadded {
                value.to_string()
            } else {
                format!("{value:0width$}")
            }
        };
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&num(year.rem_euclid(100), 2)),
            Some('m') => out.push_str(&num(month, 2)),
            Some('d') => out.push_str(&num(day, 2)),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&num(day_of_year, 3)),
            Some('H') => out.push_str(&num(hour, 2)),
            Some('I') => out.push_str(&num(hour12, 2)),
            Some('M') => out.push_str(&num(minute, 2)),
            Some('S') => out.push_str(&num(second, 2)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('Z') => out.push_str("UTC"),
            Some('z') => out.push_str("+0000"),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                if unpadded {
                    out.push('-');
                }
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

/// Proleptic Gregorian date of a day count since 1970-01-01 (H. Hinnant's algorithm).
fn civil_from_days(days: i64) -> (i64, i64, i64) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let mp = (month + 9) % 12;
    let doy = (153 * mp + 2) / 5 + day - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn chat() -> Vec<ChatMessage> {
        vec![
            ChatMessage::new("system", "Be brief."),
            ChatMessage::new("user", "  Hi there  "),
        ]
    }

    fn render(source: &str, opts: RenderOptions) -> Result<String> {
        let tokens = SpecialTokenStrings {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            ..Default::default()
        };
        ChatTemplate::new(source, tokens)?.render(&chat(), &opts)
    }

    const GENERATE: RenderOptions = RenderOptions {
        add_generation_prompt: true,
        reasoning_effort: None,
    };

    #[test]
    fn chatml_renders_messages_and_generation_prompt() {
        let text = render(CHATML, GENERATE).unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n  Hi there  <|im_end|>\n<|im_start|>assistant\n"
        );
        let text = render(CHATML, RenderOptions::default()).unwrap();
        assert!(text.ends_with("<|im_end|>\n"), "{text:?}");
    }

    #[test]
    fn tools_and_tool_turns_reach_the_template_as_transformers_passes_them() {
        let source = "{% for t in tools %}<tool>{{ t.function.name }}</tool>{% endfor %}\
            {% for m in messages %}[{{ m.role }}]{{ m.content }}\
            {% for c in m.tool_calls or [] %}<call>{{ c.function.name }} \
            {{ c.function.arguments | tojson }}</call>{% endfor %}\
            {% if m.tool_call_id %}({{ m.tool_call_id }}){% endif %}{% endfor %}";
        let template = ChatTemplate::new(source, SpecialTokenStrings::default()).unwrap();
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(serde_json::json!([
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
        ]));
        let mut answer = ChatMessage::new("tool", "18 C");
        answer.tool_call_id = Some("c1".into());
        let messages = [ChatMessage::new("user", "Weather?"), call, answer];
        let tools = serde_json::json!([
            {"type": "function", "function": {"name": "get_weather"}},
            {"type": "function", "function": {"name": "get_time"}}
        ]);
        let text = template
            .render_with_tools(&messages, &RenderOptions::default(), Some(&tools))
            .unwrap();
        assert_eq!(
            text,
            "<tool>get_weather</tool><tool>get_time</tool>[user]Weather?\
             [assistant]<call>get_weather {\"city\": \"Paris\"}</call>[tool]18 C(c1)"
        );
        // Without tools the template sees none.
        let text = template
            .render(&messages[..1], &RenderOptions::default())
            .unwrap();
        assert_eq!(text, "[user]Weather?");
    }

    #[test]
    fn raise_exception_becomes_a_chat_template_error_with_the_message() {
        let source = "{% if messages[0]['role'] == 'system' %}\n{{ raise_exception('System role not supported') }}\n{% endif %}";
        let err = render(source, GENERATE).unwrap_err();
        let TextError::ChatTemplate { message } = err else {
            panic!("wrong error kind: {err}")
        };
        assert!(message.contains("System role not supported"), "{message}");
        assert!(message.contains("line 2"), "{message}");
    }

    #[test]
    fn python_string_methods_loop_last_and_block_trimming_work_like_jinja2() {
        // Expected output checked with Python jinja2 configured as transformers does.
        let source = "{{ bos_token }}\n{% for m in messages %}\n    {% if m.role.startswith('us') %}\n{{ m.content.strip() | upper }}\n    {% else %}\n[{{ m.content.split(' ') | length }}]\n    {% endif %}\n{% if not loop.last %}|{% endif %}\n{% endfor %}\n{{ eos_token }}\n";
        assert_eq!(
            render(source, GENERATE).unwrap(),
            "<s>\n[2]\n|HI THERE\n</s>"
        );
    }

    #[test]
    fn mixtral_and_llama3_templates_match_jinja2() {
        // The hub templates of Mixtral-8x7B-Instruct-v0.1 and Llama 3; expected text from jinja2.
        let mixtral = "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}";
        let llama3 = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
        let tokens = SpecialTokenStrings {
            bos_token: Some("<s>".into()),
            eos_token: Some("</s>".into()),
            ..Default::default()
        };
        let messages = [
            ChatMessage::new("user", "Hi"),
            ChatMessage::new("assistant", "Hello!"),
            ChatMessage::new("user", " 2+2? "),
        ];
        let mixtral = ChatTemplate::new(mixtral, tokens.clone()).unwrap();
        assert_eq!(
            mixtral.render(&messages, &GENERATE).unwrap(),
            "<s>[INST] Hi [/INST]Hello!</s>[INST]  2+2?  [/INST]"
        );
        let err = mixtral.render(&messages[1..], &GENERATE).unwrap_err();
        assert!(
            err.to_string()
                .contains("Conversation roles must alternate"),
            "{err}"
        );
        let llama3 = ChatTemplate::new(llama3, tokens).unwrap();
        assert_eq!(
            llama3.render(&messages, &GENERATE).unwrap(),
            "<s><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2+2?<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
    }

    #[test]
    fn syntax_and_undefined_errors_name_the_line() {
        let err = ChatTemplate::new(
            "ok\n{% for m in messages %}",
            SpecialTokenStrings::default(),
        )
        .unwrap_err();
        assert!(
            matches!(&err, TextError::ChatTemplate { message } if message.contains(":2)")),
            "{err}"
        );
        let err = render("line one\n{{ nothing.here }}", GENERATE).unwrap_err();
        assert!(
            matches!(&err, TextError::ChatTemplate { message } if message.contains("undefined") && message.contains(":2)")),
            "{err}"
        );
    }

    #[test]
    fn tools_is_none_and_tojson_uses_python_separators() {
        let source = "{% if tools is none %}none{% endif %} {{ {'a': [1, 'x<y']} | tojson }} {{ [1] | tojson(indent=2) }}";
        assert_eq!(
            render(source, GENERATE).unwrap(),
            "none {\"a\": [1, \"x<y\"]} [\n  1\n]"
        );
    }

    #[test]
    fn generation_tags_render_their_body() {
        let source = "{% for m in messages %}{% generation %}\n{{ m.role }};{%- endgeneration %}{% endfor %}";
        assert_eq!(render(source, GENERATE).unwrap(), "system;user;");
        assert_eq!(
            rewrite_generation_tags("{%- generation -%}"),
            "{%- if true -%}"
        );
    }

    #[test]
    fn strftime_formats_utc_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(format_utc("%d %b %Y", t), "29 Feb 2024");
        assert_eq!(
            format_utc("%A %B %-d, %H:%M:%S %p %j %y %%", t),
            "Thursday February 29, 13:05:09 PM 060 24 %"
        );
        assert_eq!(format_utc("%I %q", t), "01 %q");
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        let year = render("{{ strftime_now('%Y') }}", GENERATE).unwrap();
        assert!(year.len() == 4 && year.as_str() >= "2024", "{year}");
    }

    #[test]
    fn from_dir_prefers_the_jinja_file_and_reads_special_tokens() {
        let dir = tempfile::tempdir().unwrap();
        assert!(ChatTemplate::from_dir(dir.path()).unwrap().is_none());
        let config = serde_json::json!({
            "bos_token": {"content": "<s>", "lstrip": false, "__type": "AddedToken"},
            "eos_token": "</s>",
            "chat_template": [{"name": "tool_use", "template": "tools"},
                              {"name": "default", "template": "{{ bos_token }}default{{ eos_token }}"}],
        });
        std::fs::write(dir.path().join(TOKENIZER_CONFIG_FILE), config.to_string()).unwrap();
        let template = ChatTemplate::from_dir(dir.path())
            .unwrap()
            .expect("template");
        assert_eq!(
            template.render(&chat(), &GENERATE).unwrap(),
            "<s>default</s>"
        );
        std::fs::write(
            dir.path().join(CHAT_TEMPLATE_FILE),
            "jinja {{ eos_token }}\n",
        )
        .unwrap();
        let template = ChatTemplate::from_dir(dir.path())
            .unwrap()
            .expect("template");
        assert_eq!(template.render(&chat(), &GENERATE).unwrap(), "jinja </s>");
    }

    #[test]
    fn malformed_tokenizer_config_is_reported_with_its_path() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join(TOKENIZER_CONFIG_FILE), "{not json").unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains(TOKENIZER_CONFIG_FILE), "{err}");
        std::fs::write(
            dir.path().join(TOKENIZER_CONFIG_FILE),
            r#"{"chat_template": [{"name": "x", "template": "y"}]}"#,
        )
        .unwrap();
        let err = ChatTemplate::from_dir(dir.path()).unwrap_err();
        assert!(err.to_string().contains("default"), "{err}");
    }

    #[test]
    fn chat_template_is_shareable_across_threads() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<ChatTemplate>();
    }
}
