//! API-key authentication: `Authorization: Bearer <key>` against the configured keys.
//!
//! Only SHA-256 digests of the keys are kept; a presented key is hashed and compared with
//! every digest in constant time (no early exit), so neither timing nor memory reveals keys.
//! Keys are never logged.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

use crate::error::ApiError;

/// The digests of the accepted keys; empty = auth disabled.
pub(crate) struct ApiKeys {
    digests: Vec<[u8; 32]>,
}

impl ApiKeys {
    pub(crate) fn new(keys: &[String]) -> Self {
        ApiKeys {
            digests: keys.iter().map(|k| digest(k.as_bytes())).collect(),
        }
    }

    /// Ok when auth is disabled or the request carries an accepted key.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.digests.is_empty() {
            return Ok(());
        }
        let presented = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(bearer_token)
            .ok_or(ApiError::Unauthorized)?;
        let d = digest(presented.as_bytes());
        let matched = self
            .digests
            .iter()
            .fold(Choice::from(0), |acc, stored| acc | stored.ct_eq(&d));
        if bool::from(matched) {
            Ok(())
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}

fn digest(bytes: &[u8]) -> [u8; 32] {
    Sha256::digest(bytes).into()
}

/// The token of an `Authorization: Bearer <token>` value (scheme case-insensitive).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Middleware for the `/v1` routes.
pub(crate) async fn require_api_key(
    State(keys): State<Arc<ApiKeys>>,
    req: Request,
    next: Next,
) -> Response {
    match keys.check(req.headers()) {
        Ok(()) => next.run(req).await,
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    fn headers(auth: Option<&str>) -> HeaderMap {
        let mut h = HeaderMap::new();
        if let Some(a) = auth {
            h.insert(header::AUTHORIZATION, HeaderValue::from_str(a).unwrap());
        }
        h
    }

    #[test]
    fn disabled_without_keys() {
        assert!(ApiKeys::new(&[]).check(&headers(None)).is_ok());
    }

    #[test]
    fn accepts_any_configured_key_and_rejects_others() {
        let keys = ApiKeys::new(&["k1".into(), "k2".into()]);
        assert!(keys.check(&headers(Some("Bearer k1"))).is_ok());
        assert!(keys.check(&headers(Some("bearer  k2 "))).is_ok());
        for bad in [
            None,
            Some("Bearer k3"),
            Some("k1"),
            Some("Basic k1"),
            Some("Bearer "),
        ] {
            assert_eq!(
                keys.check(&headers(bad)).unwrap_err(),
                ApiError::Unauthorized,
                "{bad:?}"
            );
        }
    }
}
