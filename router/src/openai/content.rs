//! Message content as clients send it: a string, or an array of parts of which only text
//! parts are read, joined with newlines. Chat's text parts are `{"type": "text"}`, the
//! Responses API's `{"type": "input_text"}` and `{"type": "output_text"}`; any other part
//! (an image, a file, audio) is a 400 `unsupported_parameter` naming it.

use serde_json::Value;

use crate::error::ApiError;

/// The text of `content`, found at `param` in the request (`messages[0].content`), whose
/// parts of a type in `text_types` hold text; `None` when it is absent or `null`.
pub(crate) fn text(
    param: &str,
    content: Option<Value>,
    text_types: &[&str],
) -> Result<Option<String>, ApiError> {
    match content {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(Value::Array(parts)) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, part) in parts.iter().enumerate() {
                let kind = part.get("type").and_then(Value::as_str);
                match kind {
                    Some(kind) if text_types.contains(&kind) => {
                        let text = part.get("text").and_then(Value::as_str).ok_or_else(|| {
                            ApiError::invalid(
                                format!("{param}[{j}].text"),
                                "a text part needs a string `text`",
                            )
                        })?;
                        texts.push(text);
                    }
                    Some(other) => {
                        return Err(ApiError::unsupported(
                            format!("{param}[{j}].type"),
                            format!(
                                "content parts of type {other:?} are not supported: only text \
                                 parts ({text_types:?}) are read"
                            ),
                        ))
                    }
                    None => {
                        return Err(ApiError::invalid(
                            format!("{param}[{j}]"),
                            "a content part must be an object with a `type`",
                        ))
                    }
                }
            }
            Ok(Some(texts.join("\n")))
        }
        Some(_) => Err(ApiError::invalid(
            param,
            "`content` must be a string or an array of text parts",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const TYPES: &[&str] = &["input_text", "output_text"];

    fn text_of(content: Value) -> Result<Option<String>, ApiError> {
        text("input[1].content", Some(content), TYPES)
    }

    #[test]
    fn strings_and_text_parts() {
        assert_eq!(text_of(json!("hi")).unwrap().as_deref(), Some("hi"));
        assert_eq!(
            text_of(json!([
                {"type": "input_text", "text": "a"},
                {"type": "output_text", "text": "b", "annotations": []}
            ]))
            .unwrap()
            .as_deref(),
            Some("a\nb")
        );
        assert_eq!(text_of(json!([])).unwrap().as_deref(), Some(""));
        assert_eq!(text("p", None, TYPES).unwrap(), None);
        assert_eq!(text_of(Value::Null).unwrap(), None);
    }

    #[test]
    fn other_parts_and_shapes_name_the_field() {
        let e = text_of(json!([{"type": "input_text", "text": "a"}, {"type": "input_image"}]))
            .unwrap_err();
        assert!(matches!(e, ApiError::UnsupportedParameter { .. }), "{e:?}");
        assert_eq!(e.param(), Some("input[1].content[1].type"));
        // A chat part type is not a Responses one.
        assert_eq!(
            text_of(json!([{"type": "text", "text": "a"}]))
                .unwrap_err()
                .param(),
            Some("input[1].content[0].type")
        );
        assert_eq!(
            text_of(json!([{"type": "input_text"}]))
                .unwrap_err()
                .param(),
            Some("input[1].content[0].text")
        );
        assert_eq!(
            text_of(json!([{"text": "a"}])).unwrap_err().param(),
            Some("input[1].content[0]")
        );
        assert_eq!(
            text_of(json!(3)).unwrap_err().param(),
            Some("input[1].content")
        );
    }
}
