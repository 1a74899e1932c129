//! Request bodies: bytes -> typed request, every failure an OpenAI 400 (or 413) naming the
//! offending parameter. Replaces axum's `Json` extractor and its plain-text rejections.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// Parses a request body into `T` (which denies unknown fields). `unsupported` lists real
/// OpenAI fields this server does not implement, with the reason: they get a clearer 400
/// than "unrecognized argument" (a `null` value is accepted as absent).
pub(crate) fn parse_body<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
    unsupported: &[(&str, &str)],
) -> Result<T, ApiError> {
    let bytes = body.map_err(|rejection| {
        if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::PayloadTooLarge { limit }
        } else {
            ApiError::InvalidJson(format!("failed to read the request body: {rejection}"))
        }
    })?;
    let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
        ApiError::InvalidJson(format!(
            "we could not parse the JSON body of your request: {e}"
        ))
    })?;
    let Value::Object(mut map) = value else {
        return Err(ApiError::InvalidJson(
            "the request body must be a JSON object".into(),
        ));
    };
    for (field, reason) in unsupported {
        match map.get(*field) {
            Some(Value::Null) => {
                map.remove(*field);
            }
            Some(_) => {
                return Err(ApiError::unsupported(
                    *field,
                    format!("`{field}` is not supported: {reason}"),
                ))
            }
            None => {}
        }
    }
    serde_path_to_error::deserialize(Value::Object(map)).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        classify(&path, &message)
    })
}

/// Turns a serde error at `path` into an `ApiError` with the right `param`.
fn classify(path: &str, message: &str) -> ApiError {
    // Depending on where it failed, the path may already end with the field's name.
    let join = |name: &str| {
        if path == "." {
            name.to_string()
        } else if path == name || path.ends_with(&format!(".{name}")) {
            path.to_string()
        } else {
            format!("{path}.{name}")
        }
    };
    if let Some(name) = backticked(message, "unknown field `") {
        return ApiError::UnknownParameter { param: join(name) };
    }
    if let Some(name) = backticked(message, "missing field `") {
        return ApiError::invalid(join(name), format!("`{}` is required", join(name)));
    }
    let param = (path != ".").then(|| path.to_string());
    let message = match &param {
        Some(p) => format!("invalid value for `{p}`: {message}"),
        None => message.to_string(),
    };
    ApiError::InvalidParameter { param, message }
}

/// The name in "<prefix>name` ..." messages.
fn backticked<'a>(message: &'a str, prefix: &str) -> Option<&'a str> {
    message.strip_prefix(prefix)?.split('`').next()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Req {
        model: String,
        #[serde(default)]
        temperature: Option<f32>,
        #[serde(default)]
        inner: Option<Inner>,
    }

    #[derive(Debug, Deserialize)]
    #[serde(deny_unknown_fields)]
    #[allow(dead_code)]
    struct Inner {
        flag: bool,
    }

    fn parse(s: &str) -> Result<Req, ApiError> {
        parse_body(
            Ok(Bytes::from(s.to_string())),
            100,
            &[("tools", "no tool use")],
        )
    }

    #[test]
    fn errors_name_the_parameter() {
        assert!(parse(r#"{"model": "m"}"#).is_ok());
        assert!(matches!(parse("{"), Err(ApiError::InvalidJson(_))));
        assert!(matches!(parse("[1]"), Err(ApiError::InvalidJson(_))));
        assert_eq!(
            parse(r#"{"model": "m", "foo": 1}"#).unwrap_err(),
            ApiError::UnknownParameter {
                param: "foo".into()
            }
        );
        assert_eq!(
            parse(r#"{"model": "m", "inner": {"flag": true, "x": 1}}"#).unwrap_err(),
            ApiError::UnknownParameter {
                param: "inner.x".into()
            }
        );
        assert_eq!(parse("{}").unwrap_err().param(), Some("model"));
        assert_eq!(
            parse(r#"{"model": "m", "temperature": "hot"}"#)
                .unwrap_err()
                .param(),
            Some("temperature")
        );
        assert_eq!(
            parse(r#"{"model": "m", "inner": {"flag": 3}}"#)
                .unwrap_err()
                .param(),
            Some("inner.flag")
        );
        let e = parse(r#"{"model": "m", "tools": []}"#).unwrap_err();
        assert!(matches!(e, ApiError::UnsupportedParameter { .. }), "{e:?}");
        assert!(parse(r#"{"model": "m", "tools": null}"#).is_ok());
    }
}
