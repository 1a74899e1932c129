//! The one error classifier: every failure a client can see is an [`ApiError`], which maps
//! to an HTTP status, an OpenAI error body `{"error": {"message", "type", "param", "code"}}`
//! and the `status` label of the request metrics.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kvmesh_common::WorkerError;
use serde_json::{json, Value};

/// Why a request failed, one variant per cause.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ApiError {
    /// The body is not JSON, or not a JSON object.
    #[error("{0}")]
    InvalidJson(String),
    /// A parameter has the wrong type or a value out of range.
    #[error("{message}")]
    InvalidParameter {
        param: Option<String>,
        message: String,
    },
    /// A top-level field this API does not have.
    #[error("unrecognized request argument supplied: {param}")]
    UnknownParameter { param: String },
    /// A real OpenAI parameter (or value) this server does not implement.
    #[error("{message}")]
    UnsupportedParameter { param: String, message: String },
    #[error("the model `{model}` does not exist (this server serves `{served}`)")]
    ModelNotFound { model: String, served: String },
    #[error("this model's maximum context length is {max_context} tokens; the request needs {prompt_tokens} prompt tokens plus {max_tokens} completion tokens")]
    ContextLengthExceeded {
        param: &'static str,
        prompt_tokens: usize,
        max_tokens: usize,
        max_context: usize,
    },
    #[error("invalid or missing API key (send `Authorization: Bearer <key>`)")]
    Unauthorized,
    #[error("invalid URL ({method} {path})")]
    NotFound { method: String, path: String },
    #[error("method {method} is not allowed for {path}")]
    MethodNotAllowed { method: String, path: String },
    #[error("request body exceeds the limit of {limit} bytes")]
    PayloadTooLarge { limit: usize },
    /// The backend's queues are full: retry later (429).
    #[error("the server is overloaded: {message}")]
    Overloaded {
        message: String,
        retry_after_secs: u64,
    },
    /// The caller's API key (or, without auth, everyone) exceeded its request rate (429).
    #[error("rate limit exceeded: retry after {retry_after_secs} s")]
    RateLimited { retry_after_secs: u64 },
    /// The backend is starting, draining or gone (503).
    #[error("the server is unavailable: {message}")]
    Unavailable {
        message: String,
        retry_after_secs: u64,
    },
    #[error("internal server error: {0}")]
    Internal(String),
}

impl ApiError {
    /// A 400 for `param`.
    pub fn invalid(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::InvalidParameter {
            param: Some(param.into()),
            message: message.into(),
        }
    }

    /// A 400 for a parameter this server does not implement.
    pub fn unsupported(param: impl Into<String>, message: impl Into<String>) -> Self {
        ApiError::UnsupportedParameter {
            param: param.into(),
            message: message.into(),
        }
    }

    /// Maps a backend failure; `retry_after_secs` goes into `Retry-After` for 429/503.
    pub fn from_worker(err: WorkerError, retry_after_secs: u64) -> Self {
        match err {
            WorkerError::InvalidRequest(m) => ApiError::InvalidParameter {
                param: None,
                message: m,
            },
            WorkerError::Overloaded(message) => ApiError::Overloaded {
                message,
                retry_after_secs,
            },
            WorkerError::Unavailable(message) => ApiError::Unavailable {
                message,
                retry_after_secs,
            },
            WorkerError::Internal(m) => ApiError::Internal(m),
        }
    }

    pub fn status(&self) -> StatusCode {
        match self {
            ApiError::InvalidJson(_)
            | ApiError::InvalidParameter { .. }
            | ApiError::UnknownParameter { .. }
            | ApiError::UnsupportedParameter { .. }
            | ApiError::ModelNotFound { .. }
            | ApiError::ContextLengthExceeded { .. } => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::NotFound { .. } => StatusCode::NOT_FOUND,
            ApiError::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            ApiError::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::Overloaded { .. } | ApiError::RateLimited { .. } => {
                StatusCode::TOO_MANY_REQUESTS
            }
            ApiError::Unavailable { .. } => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// OpenAI's `error.type`.
    pub fn kind(&self) -> &'static str {
        match self {
            ApiError::Overloaded { .. } | ApiError::RateLimited { .. } => "rate_limit_error",
            ApiError::Unavailable { .. } | ApiError::Internal(_) => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// OpenAI's `error.code`.
    pub fn code(&self) -> Option<&'static str> {
        Some(match self {
            ApiError::InvalidJson(_) => "invalid_json",
            ApiError::InvalidParameter { .. } => "invalid_value",
            ApiError::UnknownParameter { .. } => "unknown_parameter",
            ApiError::UnsupportedParameter { .. } => "unsupported_parameter",
            ApiError::ModelNotFound { .. } => "model_not_found",
            ApiError::ContextLengthExceeded { .. } => "context_length_exceeded",
            ApiError::Unauthorized => "invalid_api_key",
            ApiError::NotFound { .. } => "not_found",
            ApiError::MethodNotAllowed { .. } => "method_not_allowed",
            ApiError::PayloadTooLarge { .. } => "request_too_large",
            ApiError::Overloaded { .. } => "overloaded",
            ApiError::RateLimited { .. } => "rate_limit_exceeded",
            ApiError::Unavailable { .. } => "unavailable",
            ApiError::Internal(_) => "internal_error",
        })
    }

    /// OpenAI's `error.param`: the offending request field.
    pub fn param(&self) -> Option<&str> {
        match self {
            ApiError::InvalidParameter { param, .. } => param.as_deref(),
            ApiError::UnknownParameter { param } | ApiError::UnsupportedParameter { param, .. } => {
                Some(param)
            }
            ApiError::ModelNotFound { .. } => Some("model"),
            ApiError::ContextLengthExceeded { param, .. } => Some(param),
            _ => None,
        }
    }

    /// The `status` label of `kvmesh_router_requests_total`.
    pub fn metric_label(&self) -> &'static str {
        status_label(self.status())
    }

    fn retry_after_secs(&self) -> Option<u64> {
        match self {
            ApiError::Overloaded {
                retry_after_secs, ..
            }
            | ApiError::Unavailable {
                retry_after_secs, ..
            }
            | ApiError::RateLimited { retry_after_secs } => Some(*retry_after_secs),
            _ => None,
        }
    }

    /// The OpenAI error object, as sent in a response body or an SSE `data:` event.
    pub fn body(&self) -> Value {
        json!({
            "error": {
                "message": self.to_string(),
                "type": self.kind(),
                "param": self.param(),
                "code": self.code(),
            }
        })
    }

    /// Logs server-side failures (inside the request's span, so with its id).
    pub(crate) fn log(&self) {
        match self.status() {
            s if s.is_server_error() && s != StatusCode::SERVICE_UNAVAILABLE => {
                tracing::error!(status = s.as_u16(), error = %self, "request failed")
            }
            s if s.is_server_error() => {
                tracing::warn!(status = s.as_u16(), error = %self, "request refused")
            }
            // 429s come in floods exactly when the server is busiest: debug only (the
            // rejections counter has them).
            s if s == StatusCode::TOO_MANY_REQUESTS => {
                tracing::debug!(status = s.as_u16(), error = %self, "request refused")
            }
            s => tracing::debug!(status = s.as_u16(), error = %self, "bad request"),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        self.log();
        let mut resp = (self.status(), axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after_secs() {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// A status code as a static metric label.
pub(crate) fn status_label(status: StatusCode) -> &'static str {
    match status.as_u16() {
        200 => "200",
        400 => "400",
        401 => "401",
        404 => "404",
        405 => "405",
        413 => "413",
        429 => "429",
        499 => "499",
        500 => "500",
        503 => "503",
        s if s < 300 => "2xx",
        s if s < 500 => "4xx",
        _ => "5xx",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_errors_map_to_status_and_retry_after() {
        let cases = [
            (WorkerError::InvalidRequest("x".into()), 400, None),
            (WorkerError::Overloaded("x".into()), 429, Some(2)),
            (WorkerError::Unavailable("x".into()), 503, Some(2)),
            (WorkerError::Internal("x".into()), 500, None),
        ];
        for (w, status, retry) in cases {
            let e = ApiError::from_worker(w, 2);
            assert_eq!(e.status().as_u16(), status);
            assert_eq!(e.retry_after_secs(), retry);
            let resp = e.into_response();
            assert_eq!(
                resp.headers()
                    .get(header::RETRY_AFTER)
                    .map(|v| v.to_str().unwrap().to_string()),
                retry.map(|r: u64| r.to_string())
            );
        }
    }

    #[test]
    fn body_has_openai_shape() {
        let b = ApiError::invalid("temperature", "must be in [0, 2]").body();
        assert_eq!(b["error"]["param"], "temperature");
        assert_eq!(b["error"]["type"], "invalid_request_error");
        assert_eq!(b["error"]["code"], "invalid_value");
        assert_eq!(b["error"]["message"], "must be in [0, 2]");
        let b = ApiError::Unauthorized.body();
        assert!(b["error"]["param"].is_null());
    }
}
