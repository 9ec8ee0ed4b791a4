//! `api::openapi`: the OpenAPI 3.1 document, derived from the handlers'
//! `#[utoipa::path]` attributes and their query, body and answer types as
//! [`super::routes`] mounts them, and served at `/api/openapi.json`.
//!
//! Nothing here describes an endpoint by hand: the document's top (title,
//! version, the bearer scheme) is all this module adds. A snapshot is kept
//! at `docs/reference/openapi.json`; the API's tests fail when the served
//! document differs from it.

use std::sync::LazyLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::extract::{ApiQuery, ErrorBody, NoQuery};
use super::timeline::{TimelineClockName, TimelineScope, TimelineView};
use super::tuning::{KeepName, ReportFormatName};
use super::{TimelineLimits, routes};

/// The document's top: what the paths and schemas hang from.
#[derive(OpenApi)]
#[openapi(
    info(
        title = "ringwatch agent API",
        description = "What one node's ringwatch agent sees: GPUs, watched processes, jobs, timelines, metrics."
    ),
    // The enums that query parameters name by `value_type` (routes! collects
    // only the schemas of bodies and answers).
    components(schemas(
        TimelineScope,
        TimelineClockName,
        TimelineView,
        KeepName,
        ReportFormatName
    )),
    modifiers(&BearerScheme)
)]
struct Top;

/// The `bearer` security scheme the mutating endpoints name.
struct BearerScheme;

impl Modify for BearerScheme {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let scheme = HttpBuilder::new()
            .scheme(HttpAuthScheme::Bearer)
            .description(Some(
                "needed by POST/DELETE when the agent has a token (--token-file, \
                 RINGWATCH_API_TOKEN_FILE, RINGWATCH_API_TOKEN)",
            ))
            .build();
        openapi
            .components
            .get_or_insert_with(Default::default)
            .add_security_scheme("bearer", SecurityScheme::Http(scheme));
    }
}

/// The top of the document, for [`super::routes`] to add the paths to.
pub(super) fn top() -> utoipa::openapi::OpenApi {
    let mut top = Top::openapi();
    // The agent's version, not utoipa's default (the crate's at build time,
    // which is the same, but said here so the snapshot's is explicit).
    top.info.version = env!("CARGO_PKG_VERSION").to_owned();
    top.info.license = None;
    top.info.contact = None;
    top
}

/// The OpenAPI 3.1 document of every route [`super::router`] mounts.
pub fn openapi_document() -> serde_json::Value {
    let document = routes(TimelineLimits::default()).into_openapi();
    serde_json::to_value(&document).expect("an OpenAPI document serializes: plain data")
}

/// The served document, built once.
static DOCUMENT: LazyLock<String> = LazyLock::new(|| openapi_document().to_string());

/// This document.
#[utoipa::path(
    get,
    path = "/api/openapi.json",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "OpenAPI 3.1", body = Object),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn openapi(ApiQuery(NoQuery {}): ApiQuery<NoQuery>) -> Response {
    (
        [(header::CONTENT_TYPE, "application/json")],
        DOCUMENT.as_str(),
    )
        .into_response()
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    /// Every `$ref` in `value`, as `#/components/schemas/NAME`.
    fn refs(value: &Value, out: &mut Vec<String>) {
        match value {
            Value::Object(fields) => {
                for (name, field) in fields {
                    match (name.as_str(), field) {
                        ("$ref", Value::String(target)) => out.push(target.clone()),
                        _ => refs(field, out),
                    }
                }
            }
            Value::Array(items) => items.iter().for_each(|item| refs(item, out)),
            _ => {}
        }
    }

    /// A type named only by `value_type` is not collected by `routes!`:
    /// a reference to it must find it among the components all the same.
    #[test]
    fn every_reference_in_the_document_resolves() {
        let document = openapi_document();
        let mut targets = Vec::new();
        refs(&document, &mut targets);
        assert!(!targets.is_empty());
        for target in targets {
            let name = target
                .strip_prefix("#/components/schemas/")
                .unwrap_or_else(|| panic!("{target}: not a schema reference"));
            assert!(
                document["components"]["schemas"][name].is_object(),
                "{target} is referenced but not among the components: list it in \
                 `Top`'s components(schemas(...))"
            );
        }
    }

    /// Every route the router mounts is in the document, and only those.
    #[test]
    fn the_document_has_every_operation() {
        let document = openapi_document();
        let paths = document["paths"].as_object().expect("paths");
        let operations: usize = paths
            .values()
            .map(|item| {
                ["get", "post", "delete"]
                    .iter()
                    .filter(|method| item.get(**method).is_some())
                    .count()
            })
            .sum();
        assert_eq!((paths.len(), operations), (15, 17), "{:?}", paths.keys());
    }
}
