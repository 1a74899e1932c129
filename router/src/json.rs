//! Request bodies: bytes -> typed request, every failure an OpenAI 400 (or 413) naming the
//! offending parameter. Replaces axum's `Json` extractor and its plain-text rejections.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::error::ApiError;

/// What an endpoint does with top-level fields its request type does not read.
pub(crate) struct FieldPolicy {
    /// OpenAI fields that do not apply to this server, with why: accepted with no effect
    /// and named back to the client ([`Parsed::ignored`]).
    pub(crate) ignored: &'static [(&'static str, &'static str)],
    /// OpenAI features this server lacks, with why: a 400 `unsupported_parameter` (a
    /// `null` value counts as absent).
    pub(crate) unsupported: &'static [(&'static str, &'static str)],
}

/// A request and the top-level fields it carried that had no effect.
#[derive(Debug)]
pub(crate) struct Parsed<T> {
    pub(crate) request: T,
    /// The policy's ignored fields, then (unless strict) unknown ones in the body's order.
    pub(crate) ignored: Vec<String>,
}

/// Parses a request body into `T` (which denies unknown fields). Top-level fields `T` does
/// not know are ignored and listed, or with `strict` refused (400 `unknown_parameter`);
/// unknown fields inside objects are always refused.
pub(crate) fn parse_body<T: DeserializeOwned>(
    body: Result<Bytes, BytesRejection>,
    limit: usize,
    policy: &FieldPolicy,
    strict: bool,
) -> Result<Parsed<T>, ApiError> {
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
    for (field, reason) in policy.unsupported {
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
    let known = struct_fields::<T>();
    let is_policys = |k: &str| policy.ignored.iter().any(|(f, _)| *f == k);
    // In the body's order (taken before any removal reorders the map).
    let unknown: Vec<String> = map
        .keys()
        .filter(|k| !known.contains(&k.as_str()) && !is_policys(k))
        .cloned()
        .collect();
    let mut ignored = Vec::new();
    for (field, _) in policy.ignored {
        if map.remove(*field).is_some() {
            ignored.push(field.to_string());
        }
    }
    if let (true, Some(param)) = (strict, unknown.first()) {
        return Err(ApiError::UnknownParameter {
            param: param.clone(),
        });
    }
    for field in unknown {
        map.remove(&field);
        ignored.push(field);
    }
    let request = serde_path_to_error::deserialize(Value::Object(map)).map_err(|e| {
        let path = e.path().to_string();
        let message = e.into_inner().to_string();
        classify(&path, &message)
    })?;
    Ok(Parsed { request, ignored })
}

/// Deserializes `value`, found at `at` in the request (`input[2]`), into `T` (which denies
/// unknown fields); errors name the parameter as [`parse_body`]'s do (`input[2].role`).
pub(crate) fn parse_value<T: DeserializeOwned>(value: Value, at: &str) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = match e.path().to_string() {
            inner if inner == "." => at.to_string(),
            inner if inner.starts_with('[') => format!("{at}{inner}"),
            inner => format!("{at}.{inner}"),
        };
        classify(&path, &e.into_inner().to_string())
    })
}

/// The field names the struct `T` deserializes, read by handing its `Deserialize` a
/// deserializer that only records what `deserialize_struct` is asked for.
fn struct_fields<T: DeserializeOwned>() -> &'static [&'static str] {
    use serde::de::{self, Visitor};
    struct FieldNames<'a>(&'a mut &'static [&'static str]);
    impl<'de> de::Deserializer<'de> for FieldNames<'_> {
        type Error = de::value::Error;
        fn deserialize_any<V: Visitor<'de>>(self, _: V) -> Result<V::Value, Self::Error> {
            Err(de::Error::custom("not a struct"))
        }
        fn deserialize_struct<V: Visitor<'de>>(
            self,
            _name: &'static str,
            fields: &'static [&'static str],
            _: V,
        ) -> Result<V::Value, Self::Error> {
            *self.0 = fields;
            Err(de::Error::custom("fields recorded"))
        }
        serde::forward_to_deserialize_any! {
            bool i8 i16 i32 i64 i128 u8 u16 u32 u64 u128 f32 f64 char str string bytes
            byte_buf option unit unit_struct newtype_struct seq tuple tuple_struct map enum
            identifier ignored_any
        }
    }
    let mut fields: &'static [&'static str] = &[];
    let _ = T::deserialize(FieldNames(&mut fields));
    fields
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

    const POLICY: FieldPolicy = FieldPolicy {
        ignored: &[("store", "nothing is stored")],
        unsupported: &[("tools", "no tool use")],
    };

    fn parse_with(s: &str, strict: bool) -> Result<Parsed<Req>, ApiError> {
        parse_body(Ok(Bytes::from(s.to_string())), 100, &POLICY, strict)
    }

    fn parse(s: &str) -> Result<Req, ApiError> {
        parse_with(s, true).map(|p| p.request)
    }

    #[test]
    fn fields_that_do_not_apply_are_ignored_and_named() {
        let p = parse_with(r#"{"store": true, "model": "m", "zz": 1, "aa": {}}"#, false).unwrap();
        assert_eq!(p.request.model, "m");
        assert_eq!(p.ignored, ["store", "zz", "aa"]);
        // Strict: a field of the policy's ignored list still passes, an unknown one is refused.
        assert_eq!(
            parse_with(r#"{"model": "m", "store": 1}"#, true)
                .unwrap()
                .ignored,
            ["store"]
        );
        assert_eq!(
            parse_with(r#"{"model": "m", "zz": 1}"#, true).unwrap_err(),
            ApiError::UnknownParameter { param: "zz".into() }
        );
        // Inside an object an unknown field is an error either way.
        assert_eq!(
            parse_with(r#"{"model": "m", "inner": {"flag": true, "x": 1}}"#, false).unwrap_err(),
            ApiError::UnknownParameter {
                param: "inner.x".into()
            }
        );
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

    #[test]
    fn values_inside_a_request_are_named_by_their_place() {
        let at = |v: Value| parse_value::<Req>(v, "input[2]").unwrap_err();
        assert!(parse_value::<Req>(serde_json::json!({"model": "m"}), "input[2]").is_ok());
        assert_eq!(
            at(serde_json::json!({"model": "m", "x": 1})),
            ApiError::UnknownParameter {
                param: "input[2].x".into()
            }
        );
        assert_eq!(at(serde_json::json!({})).param(), Some("input[2].model"));
        assert_eq!(
            at(serde_json::json!({"model": 1})).param(),
            Some("input[2].model")
        );
        assert_eq!(
            at(serde_json::json!({"model": "m", "inner": {"flag": 3}})).param(),
            Some("input[2].inner.flag")
        );
        assert_eq!(at(serde_json::json!("text")).param(), Some("input[2]"));
    }
}
