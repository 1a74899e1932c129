//! Request ids: `x-request-id` is accepted when it is 1 to 128 printable ASCII characters,
//! else one is generated; it is echoed in the response and carried by the request's
//! tracing span (`request_id`).
//!
//! The [`RequestId`] sent to the backend is always freshly generated (and logged in the
//! same span as `rid`): a client may reuse its header value (retries, a fixed string), but
//! the mesh needs an id that names exactly one request.

use std::time::Instant;

use axum::extract::Request;
use axum::http::{HeaderName, HeaderValue};
use axum::middleware::Next;
use axum::response::Response;
use kvmesh_common::RequestId;
use tracing::Instrument;

pub(crate) const X_REQUEST_ID: HeaderName = HeaderName::from_static("x-request-id");
const MAX_LEN: usize = 128;

/// Who a request is, for handlers (an axum request extension).
#[derive(Clone, Debug)]
pub(crate) struct RequestContext {
    /// The id the backend sees.
    pub(crate) id: RequestId,
    pub(crate) span: tracing::Span,
    pub(crate) received: Instant,
}

fn is_valid(value: &str) -> bool {
    (1..=MAX_LEN).contains(&value.len()) && value.bytes().all(|b| (0x20..=0x7e).contains(&b))
}

/// Middleware (outermost): assigns the request id and runs the rest inside its span.
pub(crate) async fn assign(mut req: Request, next: Next) -> Response {
    let id = RequestId::random();
    let header = req
        .headers()
        .get(&X_REQUEST_ID)
        .and_then(|v| v.to_str().ok())
        .filter(|v| is_valid(v))
        .map(str::to_string)
        .unwrap_or_else(|| format!("{:016x}", id.0));
    let span = tracing::info_span!(
        "request",
        request_id = %header,
        rid = %id,
        method = %req.method(),
        path = %req.uri().path(),
    );
    let ctx = RequestContext {
        id,
        span: span.clone(),
        received: Instant::now(),
    };
    req.extensions_mut().insert(ctx);
    let mut resp = next.run(req).instrument(span).await;
    if let Ok(v) = HeaderValue::from_str(&header) {
        resp.headers_mut().insert(X_REQUEST_ID, v);
    }
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates_length_and_charset() {
        assert!(is_valid("abc-123 x"));
        assert!(is_valid(&"a".repeat(128)));
        assert!(!is_valid(&"a".repeat(129)));
        assert!(!is_valid(""));
        assert!(!is_valid("tab\there"));
        assert!(!is_valid("é"));
    }
}
