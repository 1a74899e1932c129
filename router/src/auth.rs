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

/// Who a request is: the SHA-256 digest of its API key (a request extension, for the rate
/// limiter). Its `Debug` shows no bytes of it.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct KeyDigest([u8; 32]);

impl KeyDigest {
    /// Requests when auth is off (no key). Not the digest of any key.
    pub(crate) const ANONYMOUS: KeyDigest = KeyDigest([0; 32]);
}

impl std::fmt::Debug for KeyDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("KeyDigest(..)")
    }
}

/// The digests of the accepted keys; empty = auth disabled.
pub(crate) struct ApiKeys {
    digests: Vec<KeyDigest>,
}

impl ApiKeys {
    pub(crate) fn new(keys: &[String]) -> Self {
        ApiKeys {
            digests: keys.iter().map(|k| digest(k.as_bytes())).collect(),
        }
    }

    pub(crate) fn digests(&self) -> &[KeyDigest] {
        &self.digests
    }

    /// The caller's key digest when it sent an accepted key; [`KeyDigest::ANONYMOUS`] when
    /// auth is disabled.
    pub(crate) fn check(&self, headers: &HeaderMap) -> Result<KeyDigest, ApiError> {
        if self.digests.is_empty() {
            return Ok(KeyDigest::ANONYMOUS);
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
            .fold(Choice::from(0), |acc, stored| acc | stored.0.ct_eq(&d.0));
        if bool::from(matched) {
            Ok(d)
        } else {
            Err(ApiError::Unauthorized)
        }
    }
}

fn digest(bytes: &[u8]) -> KeyDigest {
    KeyDigest(Sha256::digest(bytes).into())
}

/// The token of an `Authorization: Bearer <token>` value (scheme case-insensitive).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.trim().split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// Middleware for the `/v1` routes; leaves the caller's [`KeyDigest`] in the extensions.
pub(crate) async fn require_api_key(
    State(keys): State<Arc<ApiKeys>>,
    mut req: Request,
    next: Next,
) -> Response {
    match keys.check(req.headers()) {
        Ok(key) => {
            req.extensions_mut().insert(key);
            next.run(req).await
        }
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
        assert_eq!(
            keys.check(&headers(Some("Bearer k1"))),
            Ok(keys.digests()[0])
        );
        assert_eq!(
            keys.check(&headers(Some("bearer  k2 "))),
            Ok(keys.digests()[1])
        );
        assert_ne!(keys.digests()[0], KeyDigest::ANONYMOUS);
        assert_eq!(format!("{:?}", keys.digests()[0]), "KeyDigest(..)");
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
