//! The request fields that constrain the output: OpenAI's `response_format`, vLLM's
//! `structured_outputs` object and its older `guided_*` fields. At most one constraint per
//! request; each is read into a [`StructuredOutput`] and compiled against the model's
//! vocabulary before the request is queued, so an invalid schema is a 400, not a failed stream.

use moeserve_structured::{GrammarSpec, JsonWhitespace, StructuredOutput};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

/// `response_format`.
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema {
        json_schema: Option<JsonSchemaFormat>,
    },
    /// vLLM's structural tags (constraints inside tagged regions) are not implemented.
    StructuralTag {},
}

/// `response_format.json_schema`.
#[derive(Clone, Debug, Deserialize, utoipa::ToSchema)]
pub struct JsonSchemaFormat {
    pub name: Option<String>,
    pub description: Option<String>,
    pub schema: Option<Value>,
    /// OpenAI's strict mode; the schema is always enforced exactly here.
    pub strict: Option<bool>,
}

/// vLLM's `structured_outputs` (`StructuredOutputsParams`).
#[derive(Clone, Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct StructuredOutputsField {
    /// A JSON schema, as an object or as a string holding one.
    pub json: Option<Value>,
    pub regex: Option<String>,
    pub choice: Option<Vec<String>>,
    pub grammar: Option<String>,
    pub json_object: Option<bool>,
    pub disable_any_whitespace: Option<bool>,
    pub whitespace_pattern: Option<String>,
    pub structural_tag: Option<Value>,
    /// Backend choices of vLLM: there is one backend here (llguidance), so they change nothing.
    pub disable_fallback: Option<bool>,
    pub disable_additional_properties: Option<bool>,
}

/// The constraint fields of a completions or chat request.
#[derive(Clone, Debug, Default, Deserialize, utoipa::ToSchema)]
pub struct StructuredFields {
    pub response_format: Option<ResponseFormat>,
    pub structured_outputs: Option<StructuredOutputsField>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
    pub guided_whitespace_pattern: Option<String>,
    /// vLLM's backend name (`xgrammar`, `guidance`, `outlines`, `auto`): accepted, one backend.
    pub guided_decoding_backend: Option<String>,
}

/// A request's constraint and the field it came from (named in compile errors).
#[derive(Clone, Debug, PartialEq)]
pub struct StructuredRequest {
    pub output: StructuredOutput,
    pub field: &'static str,
}

impl StructuredFields {
    /// The one constraint the fields ask for, if any; two at once are refused.
    pub fn to_request(&self) -> Result<Option<StructuredRequest>, ApiError> {
        let mut found: Vec<(GrammarSpec, &'static str)> = Vec::new();
        match &self.response_format {
            None | Some(ResponseFormat::Text) => {}
            Some(ResponseFormat::JsonObject) => {
                found.push((GrammarSpec::JsonObject, "response_format"))
            }
            Some(ResponseFormat::JsonSchema { json_schema }) => {
                let field = "response_format.json_schema";
                let format = json_schema.as_ref().ok_or_else(|| {
                    ApiError::invalid(field, "`json_schema` is required for type json_schema")
                })?;
                if format.name.as_deref().is_none_or(str::is_empty) {
                    return Err(ApiError::invalid(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` is required",
                    ));
                }
                let spec = match &format.schema {
                    Some(schema) => GrammarSpec::JsonSchema(schema_value(
                        schema,
                        "response_format.json_schema.schema",
                    )?),
                    None => GrammarSpec::JsonObject,
                };
                found.push((spec, "response_format.json_schema.schema"));
            }
            Some(ResponseFormat::StructuralTag {}) => {
                return Err(ApiError::invalid(
                    "response_format",
                    "response_format type structural_tag is not supported; use json_schema, \
                     json_object or structured_outputs",
                ));
            }
        }
        let mut whitespace = JsonWhitespace {
            compact: false,
            pattern: self.guided_whitespace_pattern.clone(),
        };
        if let Some(so) = &self.structured_outputs {
            if so.structural_tag.is_some() {
                return Err(ApiError::invalid(
                    "structured_outputs.structural_tag",
                    "structural tags are not supported; use json, regex, choice or grammar",
                ));
            }
            let names = [
                "structured_outputs.json",
                "structured_outputs.regex",
                "structured_outputs.choice",
                "structured_outputs.grammar",
            ];
            let fields = (&so.json, &so.regex, &so.choice, &so.grammar);
            push_constraints(&mut found, fields, names)?;
            if so.json_object == Some(true) {
                found.push((GrammarSpec::JsonObject, "structured_outputs.json_object"));
            }
            whitespace.compact = so.disable_any_whitespace.unwrap_or(false);
            if so.whitespace_pattern.is_some() {
                whitespace.pattern = so.whitespace_pattern.clone();
            }
        }
        let names = [
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
        ];
        let fields = (
            &self.guided_json,
            &self.guided_regex,
            &self.guided_choice,
            &self.guided_grammar,
        );
        push_constraints(&mut found, fields, names)?;
        if found.len() > 1 {
            let names: Vec<_> = found.iter().map(|(_, f)| format!("`{f}`")).collect();
            return Err(ApiError::invalid(
                found[1].1,
                format!(
                    "one output constraint per request, got {}: {}",
                    names.len(),
                    names.join(", ")
                ),
            ));
        }
        // Whitespace options alone constrain nothing (as in vLLM).
        let Some((spec, field)) = found.pop() else {
            return Ok(None);
        };
        if let GrammarSpec::Choice(choices) = &spec
            && choices.is_empty()
        {
            return Err(ApiError::invalid(field, "the list of choices is empty"));
        }
        Ok(Some(StructuredRequest {
            output: StructuredOutput { spec, whitespace },
            field,
        }))
    }
}

/// The JSON schema, regex, choice and grammar fields of one family (vLLM's
/// `structured_outputs.*` or its `guided_*`), each that is set with its field's name in `names`.
type ConstraintFields<'a> = (
    &'a Option<Value>,
    &'a Option<String>,
    &'a Option<Vec<String>>,
    &'a Option<String>,
);

fn push_constraints(
    found: &mut Vec<(GrammarSpec, &'static str)>,
    (json, regex, choice, grammar): ConstraintFields<'_>,
    names: [&'static str; 4],
) -> Result<(), ApiError> {
    if let Some(json) = json {
        found.push((
            GrammarSpec::JsonSchema(schema_value(json, names[0])?),
            names[0],
        ));
    }
    if let Some(regex) = regex {
        found.push((GrammarSpec::Regex(regex.clone()), names[1]));
    }
    if let Some(choice) = choice {
        found.push((GrammarSpec::Choice(choice.clone()), names[2]));
    }
    if let Some(grammar) = grammar {
        found.push((GrammarSpec::Grammar(grammar.clone()), names[3]));
    }
    Ok(())
}

/// A schema given as an object (or `true` / `false`), or as a string holding one (vLLM takes
/// both).
fn schema_value(value: &Value, field: &'static str) -> Result<Value, ApiError> {
    let schema = match value {
        Value::String(text) => serde_json::from_str(text).map_err(|e| {
            ApiError::invalid(field, format!("`{field}` is a string but not JSON: {e}"))
        })?,
        other => other.clone(),
    };
    match schema {
        Value::Object(_) | Value::Bool(_) => Ok(schema),
        other => Err(ApiError::invalid(
            field,
            format!("`{field}` must be a JSON schema object, got {other}"),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(json: &str) -> Result<Option<StructuredRequest>, ApiError> {
        serde_json::from_str::<StructuredFields>(json)
            .unwrap()
            .to_request()
    }

    #[test]
    fn response_format_json_schema_and_json_object() {
        let r = read(
            r#"{"response_format": {"type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": true}}}"#,
        )
        .unwrap()
        .unwrap();
        assert_eq!(
            r.output.spec,
            GrammarSpec::JsonSchema(serde_json::json!({"type": "object"}))
        );
        assert_eq!(r.field, "response_format.json_schema.schema");
        let r = read(r#"{"response_format": {"type": "json_object"}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(r.output.spec, GrammarSpec::JsonObject);
        assert_eq!(
            read(r#"{"response_format": {"type": "text"}}"#).unwrap(),
            None
        );
        assert_eq!(read("{}").unwrap(), None);
    }

    #[test]
    fn vllm_fields_old_and_new() {
        let r = read(r#"{"structured_outputs": {"regex": "a+", "disable_any_whitespace": true}}"#)
            .unwrap()
            .unwrap();
        assert_eq!(r.output.spec, GrammarSpec::Regex("a+".into()));
        assert!(r.output.whitespace.compact);
        let r = read(r#"{"guided_json": "{\"type\": \"string\"}"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(r.field, "guided_json");
        assert!(matches!(r.output.spec, GrammarSpec::JsonSchema(_)));
        let r = read(r#"{"guided_choice": ["a", "b"], "guided_whitespace_pattern": " ?"}"#)
            .unwrap()
            .unwrap();
        assert_eq!(r.output.whitespace.pattern.as_deref(), Some(" ?"));
        let r = read(r#"{"guided_grammar": "root ::= \"x\""}"#)
            .unwrap()
            .unwrap();
        assert!(matches!(r.output.spec, GrammarSpec::Grammar(_)));
    }

    #[test]
    fn conflicts_and_bad_values_are_400s_naming_the_field() {
        let param = |json: &str| read(json).unwrap_err().body().param;
        assert_eq!(
            param(r#"{"guided_regex": "a", "guided_choice": ["b"]}"#).as_deref(),
            Some("guided_choice")
        );
        assert_eq!(
            param(r#"{"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}"#)
                .as_deref(),
            Some("response_format.json_schema.name")
        );
        assert_eq!(
            param(r#"{"guided_json": "{not json"}"#).as_deref(),
            Some("guided_json")
        );
        assert_eq!(
            param(r#"{"structured_outputs": {"json": 5}}"#).as_deref(),
            Some("structured_outputs.json")
        );
        assert_eq!(
            param(r#"{"guided_choice": []}"#).as_deref(),
            Some("guided_choice")
        );
        assert_eq!(
            param(r#"{"response_format": {"type": "structural_tag"}}"#).as_deref(),
            Some("response_format")
        );
        // An unknown type is a deserialization error, caught by the body parser.
        assert!(
            serde_json::from_str::<StructuredFields>(r#"{"response_format": {"type": "xml"}}"#)
                .is_err()
        );
    }
}
