//! `api::extract`: the API's error answer and the extractors that turn a
//! request into typed input, each refusing bad input with a JSON error
//! that says what was wrong and what is accepted.
//!
//! Never answers anything but the JSON error shape ([`ErrorBody`]), and
//! never ignores an unknown query parameter: the names a handler accepts
//! are those of its query type's [`IntoParams`], so what the document lists
//! is what the server takes.

use std::collections::HashMap;

use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request};
use axum::http::request::Parts;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use utoipa::openapi::path::ParameterIn;
use utoipa::{IntoParams, ToSchema};

/// An error answered as `{"error": {"status": …, "message": …}}`.
#[derive(Debug)]
pub struct ApiError {
    pub(super) status: StatusCode,
    message: String,
    /// Seconds for a `Retry-After` header (503 when busy).
    retry_after_s: Option<u32>,
}

/// Every error's body.
#[derive(Debug, Serialize, ToSchema)]
#[schema(as = Error)]
pub struct ErrorBody {
    /// What went wrong.
    pub error: ErrorDetail,
}

/// The status again, and a message naming what was wrong and what to do.
#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// The HTTP status.
    pub status: u16,
    /// What was wrong, and what is accepted.
    pub message: String,
}

impl ApiError {
    /// A 400 with a message saying what was wrong and what is accepted.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// An answer with `status` and `message`.
    pub(crate) fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
            retry_after_s: None,
        }
    }

    /// A 503 that asks the client to come back in `seconds`.
    pub(super) fn busy(message: impl Into<String>, seconds: u32) -> Self {
        Self {
            retry_after_s: Some(seconds),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail {
                status: self.status.as_u16(),
                message: self.message,
            },
        };
        let mut response = (self.status, axum::Json(body)).into_response();
        if let Some(seconds) = self.retry_after_s {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(seconds));
        }
        response
    }
}

/// The framework's rejections, as [`ApiError`]s: same status, its message,
/// in the API's JSON error shape.
fn rejection(status: StatusCode, what: &str, message: String) -> ApiError {
    ApiError::new(status, format!("{what}: {message}"))
}

/// The query string as `T`: a JSON error when it does not parse (axum's
/// own `Query` rejection is plain text) or names a parameter `T` does not
/// declare. `T`'s fields are strings, checked by the handler, so each bad
/// value gets its own message.
#[derive(Debug)]
pub struct ApiQuery<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + IntoParams> FromRequestParts<S> for ApiQuery<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        let Query(params) = Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map_err(|e| rejection(e.status(), "bad query string", e.body_text()))?;
        let allowed: Vec<String> = T::into_params(|| Some(ParameterIn::Query))
            .into_iter()
            .map(|parameter| parameter.name)
            .collect();
        reject_unknown(&params, &allowed)?;
        let fields = params
            .into_iter()
            .map(|(name, value)| (name, serde_json::Value::String(value)))
            .collect();
        T::deserialize(serde_json::Value::Object(fields))
            .map(Self)
            .map_err(|e| ApiError::bad_request(format!("bad query: {e}")))
    }
}

/// The query of an endpoint that takes none.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct NoQuery {}

fn reject_unknown(params: &HashMap<String, String>, allowed: &[String]) -> Result<(), ApiError> {
    let mut unknown: Vec<&str> = params
        .keys()
        .map(String::as_str)
        .filter(|key| !allowed.iter().any(|name| name == key))
        .collect();
    if unknown.is_empty() {
        return Ok(());
    }
    unknown.sort_unstable();
    Err(ApiError::bad_request(format!(
        "unknown query parameter(s) {}; this endpoint accepts {}",
        unknown.join(", "),
        if allowed.is_empty() {
            "none".to_owned()
        } else {
            allowed.join(", ")
        }
    )))
}

/// The one path parameter (`{id}`), with a JSON error when it does not
/// decode.
#[derive(Debug)]
pub struct ApiPath(pub String);

impl<S: Send + Sync> FromRequestParts<S> for ApiPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Path::<String>::from_request_parts(parts, state)
            .await
            .map(|Path(id)| Self(id))
            .map_err(|e| rejection(e.status(), "bad path", e.body_text()))
    }
}

/// The request body, with a JSON error when it cannot be read (over
/// [`MAX_BODY_BYTES`]: 413).
#[derive(Debug)]
pub struct ApiBody(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for ApiBody {
    type Rejection = ApiError;

    async fn from_request(request: Request, state: &S) -> Result<Self, Self::Rejection> {
        Bytes::from_request(request, state)
            .await
            .map(Self)
            .map_err(|e| rejection(e.status(), "bad request body", e.body_text()))
    }
}

/// The largest request body (tuning requests are a few hundred bytes).
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Turns any error answer that is not JSON (from a layer, or a rejection
/// no extractor above saw) into the API's JSON error shape, keeping its
/// status and headers and its text as the message.
pub(super) async fn json_errors(response: Response) -> Response {
    let status = response.status();
    let is_json = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if !(status.is_client_error() || status.is_server_error()) || is_json {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, 16 * 1024)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_owned())
        .unwrap_or_default();
    let message = if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_owned()
    } else {
        text
    };
    let body = ErrorBody {
        error: ErrorDetail {
            status: status.as_u16(),
            message,
        },
    };
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let body = serde_json::to_vec(&body).expect("an error body serializes: two plain fields");
    Response::from_parts(parts, Body::from(body))
}

/// A 404 for a path no route has, pointing at the document.
pub(super) async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {}; see /api/openapi.json", uri.path()),
    )
}

/// A 405 for a method a route does not have, pointing at the document.
pub(super) async fn method_not_allowed(
    method: axum::http::Method,
    uri: axum::http::Uri,
) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{method} is not allowed on {}; see /api/openapi.json",
            uri.path()
        ),
    )
}
