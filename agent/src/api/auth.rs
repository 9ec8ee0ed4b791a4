//! `api::auth`: who may call the mutating endpoints (POST, DELETE): a
//! bearer token when one is configured, and nobody when the API listens
//! beyond loopback without one.
//!
//! It never logs or echoes a token, and compares them in constant time.

use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, StatusCode, header};

use super::{ApiError, ApiState};

/// Access to the mutating endpoints (POST, DELETE).
#[derive(Debug, Clone)]
pub struct Auth {
    /// The bearer token they need, when one is configured.
    pub token: Option<String>,
    /// True when the API listens on a loopback address only.
    pub loopback_only: bool,
}

impl Auth {
    /// Allows a mutating request with these headers, or says why not: 401
    /// without the configured token, 403 beyond loopback with no token
    /// configured at all.
    pub fn check(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(token) = &self.token else {
            if self.loopback_only {
                return Ok(());
            }
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "this agent listens beyond loopback without an API token, so it refuses to \
                 change anything: configure one with --token-file FILE, \
                 RINGWATCH_API_TOKEN_FILE=FILE or RINGWATCH_API_TOKEN, then send \
                 `Authorization: Bearer TOKEN`",
            ));
        };
        // The scheme is case-insensitive (RFC 9110 §11.1): `bearer` is `Bearer`.
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim_start().split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, token)| token.trim());
        match given {
            Some(given) if constant_time_eq(given.as_bytes(), token.as_bytes()) => Ok(()),
            Some(_) => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "wrong API token in `Authorization: Bearer …`",
            )),
            None => Err(ApiError::new(
                StatusCode::UNAUTHORIZED,
                "this endpoint needs `Authorization: Bearer TOKEN` (the agent's --token-file)",
            )),
        }
    }
}

/// Compares without an early exit, so timing says nothing of the token.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// A mutating request that [`Auth::check`] allowed. Handlers take it as
/// their first extractor, so a refused request is refused before its
/// query or body are looked at.
#[derive(Debug)]
pub struct Authorized;

impl FromRequestParts<ApiState> for Authorized {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut Parts,
        state: &ApiState,
    ) -> Result<Self, Self::Rejection> {
        state.auth.check(&parts.headers).map(|()| Self)
    }
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn headers(authorization: Option<&str>) -> HeaderMap {
        let mut headers = HeaderMap::new();
        if let Some(value) = authorization {
            headers.insert(
                header::AUTHORIZATION,
                HeaderValue::from_str(value).expect("a valid header value"),
            );
        }
        headers
    }

    fn status(auth: &Auth, authorization: Option<&str>) -> Option<u16> {
        auth.check(&headers(authorization))
            .err()
            .map(|e| e.status.as_u16())
    }

    #[test]
    fn loopback_without_a_token_allows_changes() {
        let auth = Auth {
            token: None,
            loopback_only: true,
        };
        assert_eq!(status(&auth, None), None);
        assert_eq!(status(&auth, Some("Bearer anything")), None);
    }

    #[test]
    fn beyond_loopback_without_a_token_refuses_changes() {
        let auth = Auth {
            token: None,
            loopback_only: false,
        };
        assert_eq!(status(&auth, None), Some(403));
        assert_eq!(status(&auth, Some("Bearer anything")), Some(403));
    }

    #[test]
    fn a_configured_token_is_required_everywhere() {
        for loopback_only in [true, false] {
            let auth = Auth {
                token: Some("s3cret".to_owned()),
                loopback_only,
            };
            assert_eq!(status(&auth, None), Some(401));
            assert_eq!(status(&auth, Some("Bearer wrong!")), Some(401));
            assert_eq!(status(&auth, Some("Basic s3cret")), Some(401));
            assert_eq!(status(&auth, Some("Bearer s3cret")), None);
            // The scheme is case-insensitive; the token is not.
            assert_eq!(status(&auth, Some("bearer s3cret")), None);
            assert_eq!(status(&auth, Some("BEARER  s3cret ")), None);
            assert_eq!(status(&auth, Some("bearer S3CRET")), Some(401));
            assert_eq!(status(&auth, Some("Bearers3cret")), Some(401));
        }
    }
}
