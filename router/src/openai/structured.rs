//! `response_format` (chat, completions) or `text.format` (Responses) -> a structured-output
//! [`Constraint`], checked by compiling it against the model's vocabulary so a bad schema,
//! regex or grammar is a 400 that says what is wrong before any work is queued. The engines
//! enforce it (docs/api.md, "Structured outputs").

use kvmesh_common::Constraint;
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;
use crate::prompt::Prompts;

/// Where a request carries its format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Field {
    /// Chat and completions: `response_format`, with `json_schema`'s fields nested in it.
    ResponseFormat,
    /// The Responses API: `text.format`, with `json_schema`'s fields beside `type`.
    TextFormat,
}

impl Field {
    fn param(self) -> &'static str {
        match self {
            Field::ResponseFormat => "response_format",
            Field::TextFormat => "text.format",
        }
    }

    fn schema_param(self) -> &'static str {
        match self {
            Field::ResponseFormat => "response_format.json_schema.schema",
            Field::TextFormat => "text.format.schema",
        }
    }
}

/// OpenAI's `response_format`, and kvmesh's extensions (`regex`, `choice`, `grammar`).
#[derive(Debug, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case", deny_unknown_fields)]
enum ResponseFormat {
    Text,
    JsonObject,
    JsonSchema { json_schema: JsonSchemaFormat },
    Regex { pattern: String },
    Choice { choices: Vec<String> },
    Grammar { grammar: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct JsonSchemaFormat {
    #[allow(dead_code)]
    name: String,
    #[allow(dead_code)]
    #[serde(default)]
    description: Option<String>,
    schema: Option<Value>,
    /// Always enforced here: the output follows the schema whether or not this is set.
    #[allow(dead_code)]
    #[serde(default)]
    strict: Option<bool>,
}

/// The constraint a request's `response_format` asks for (`None`: free text).
pub(crate) fn constraint(
    value: Option<Value>,
    prompts: &Prompts,
) -> Result<Option<Constraint>, ApiError> {
    parse(Field::ResponseFormat, value, prompts)
}

/// The constraint a Responses request's `text.format` asks for (`None`: free text). Its
/// `json_schema` is flat: `{"type": "json_schema", "name": ..., "schema": {...}}`.
pub(crate) fn text_format_constraint(
    value: Option<Value>,
    prompts: &Prompts,
) -> Result<Option<Constraint>, ApiError> {
    let nested = value.map(|mut v| {
        let flat_schema = v.get("type").and_then(Value::as_str) == Some("json_schema");
        match v.as_object_mut() {
            Some(map) if flat_schema => {
                let kind = map.remove("type").unwrap_or(Value::Null);
                let fields = std::mem::take(map);
                serde_json::json!({"type": kind, "json_schema": fields})
            }
            _ => v,
        }
    });
    parse(Field::TextFormat, nested, prompts)
}

fn parse(
    field: Field,
    value: Option<Value>,
    prompts: &Prompts,
) -> Result<Option<Constraint>, ApiError> {
    let param = field.param();
    let format = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(v) => serde_json::from_value::<ResponseFormat>(v).map_err(|e| {
            ApiError::invalid(
                param,
                format!(
                    "invalid `{param}`: {e} (types: text, json_object, json_schema, \
                     and kvmesh's regex, choice, grammar)"
                ),
            )
        })?,
    };
    let constraint = match format {
        ResponseFormat::Text => return Ok(None),
        ResponseFormat::JsonObject => Constraint::JsonObject,
        ResponseFormat::JsonSchema { json_schema } => Constraint::JsonSchema {
            schema: json_schema.schema.ok_or_else(|| {
                ApiError::invalid(param, format!("`{}` is required", field.schema_param()))
            })?,
        },
        ResponseFormat::Regex { pattern } => Constraint::Regex { pattern },
        ResponseFormat::Choice { choices } => Constraint::Choice { options: choices },
        ResponseFormat::Grammar { grammar } => Constraint::Grammar { lark: grammar },
    };
    prompts
        .check_constraint(&constraint)
        .map_err(|e| ApiError::invalid(param, format!("invalid `{param}`: {e}")))?;
    Ok(Some(constraint))
}
