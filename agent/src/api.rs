//! `api`: the agent's HTTP API (axum): what the agent knows, as JSON for
//! people and scripts, and as Prometheus exposition at `/metrics`.
//!
//! Handlers only read shared state and format it; they never touch BPF or a
//! job directly. Every error is JSON with the right status; unknown query
//! parameters are rejected, never ignored.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::extract::{Query, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::gpu::Gpus;
use crate::live::LiveView;
use crate::metrics::render_metrics;
use crate::timeline::{QueryError, RecordedTrace, TimePoint, TimelineQuery};

/// What the handlers read. Cheap to clone (everything behind `Arc`).
#[derive(Clone)]
pub struct ApiState {
    /// The node's GPUs (NVML), or why there are none.
    pub gpus: Arc<Gpus>,
    /// When the agent started, for `/api/health`.
    pub started: Instant,
    /// A recorded trace served by `/api/timeline` (`serve --replay`).
    pub recorded: Option<Arc<RecordedTrace>>,
    /// The most events one `/api/timeline` answer may carry.
    pub timeline_event_limit: usize,
    /// The latest view of the live eBPF pipeline (`serve --pid …`), replaced
    /// whole once a second.
    pub live: Arc<Mutex<Option<Arc<LiveView>>>>,
}

impl ApiState {
    /// Replaces the live view.
    pub fn publish(&self, view: LiveView) {
        let mut slot = self
            .live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        *slot = Some(Arc::new(view));
    }

    /// The live view, if the pipeline runs and has published one.
    pub fn live_view(&self) -> Option<Arc<LiveView>> {
        self.live
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone()
    }
}

/// An error answered as `{"error": {"status": …, "message": …}}`.
#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
}

impl ApiError {
    /// A 400 with a message saying what was wrong and what is accepted.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
        }
    }

    fn new(status: StatusCode, message: impl Into<String>) -> Self {
        Self {
            status,
            message: message.into(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "status": self.status.as_u16(), "message": self.message } });
        (self.status, axum::Json(body)).into_response()
    }
}

/// Query parameters, checked against what an endpoint accepts.
type Params = Query<HashMap<String, String>>;

fn reject_unknown(params: &HashMap<String, String>, allowed: &[&str]) -> Result<(), ApiError> {
    let mut unknown: Vec<&str> = params
        .keys()
        .map(String::as_str)
        .filter(|key| !allowed.contains(key))
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

/// The router: every endpoint of the API.
pub fn router(state: ApiState) -> Router {
    Router::new()
        .route("/api/health", get(health))
        .route("/api/gpus", get(gpus))
        .route("/api/jobs", get(jobs))
        .route("/api/processes", get(processes))
        .route("/api/timeline", get(timeline))
        .route("/api/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .route("/", get(ui_index))
        .route("/index.html", get(ui_index))
        .route("/viewer.js", get(ui_script))
        .route("/viewer.css", get(ui_style))
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(state)
}

async fn health(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    Ok(axum::Json(json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": state.started.elapsed().as_secs_f64(),
    }))
    .into_response())
}

async fn gpus(State(state): State<ApiState>, Query(params): Params) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let gpus = state.gpus.clone();
    // NVML calls block (and can take milliseconds per device).
    let snapshot = tokio::task::spawn_blocking(move || gpus.snapshot())
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("reading the GPUs failed: {e}"),
            )
        })?;
    Ok(axum::Json(snapshot).into_response())
}

async fn jobs(State(state): State<ApiState>, Query(params): Params) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    if let Some(live) = state.live_view()
        && !live.jobs.is_empty()
    {
        return Ok(axum::Json(json!({ "jobs": live.jobs, "source": "live" })).into_response());
    }
    let jobs = state
        .recorded
        .as_ref()
        .map(|trace| trace.jobs())
        .unwrap_or_default();
    Ok(axum::Json(json!({ "jobs": jobs })).into_response())
}

async fn processes(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    if let Some(live) = state.live_view() {
        return Ok(
            axum::Json(json!({ "processes": live.processes, "source": "live" })).into_response(),
        );
    }
    let processes = state
        .recorded
        .as_ref()
        .map(|trace| trace.processes())
        .unwrap_or_default();
    Ok(axum::Json(json!({ "processes": processes })).into_response())
}

/// Where `/api/timeline` reads from.
enum TimelineSource {
    Recorded(Arc<RecordedTrace>),
    Live(Arc<LiveView>),
}

impl TimelineSource {
    fn trace(&self) -> &RecordedTrace {
        match self {
            Self::Recorded(trace) => trace,
            Self::Live(live) => &live.timeline,
        }
    }
}

async fn timeline(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &["from", "to", "job", "pid", "downsample"])?;
    let point = |name: &str| -> Result<Option<TimePoint>, ApiError> {
        params
            .get(name)
            .map(|text| {
                TimePoint::parse(text)
                    .map_err(|e| ApiError::bad_request(format!("bad {name}: {e}")))
            })
            .transpose()
    };
    let query = TimelineQuery {
        from: point("from")?,
        to: point("to")?,
        job: params.get("job").cloned(),
        pid: params.get("pid").cloned(),
        downsample: match params.get("downsample").map(String::as_str) {
            None | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "bad downsample: {other:?} (use true or false)"
                )));
            }
        },
    };
    let limit = state.timeline_event_limit;
    // A recorded trace when one was given, else the live view.
    let source = match (state.recorded.clone(), state.live_view()) {
        (Some(trace), _) => TimelineSource::Recorded(trace),
        (None, Some(live)) => TimelineSource::Live(live),
        (None, None) => {
            return Err(ApiError::new(
                StatusCode::SERVICE_UNAVAILABLE,
                "no timeline source: start the agent with --pid/--comm/--cgroup for the live timeline (it appears within a second), or --replay FILE for a recorded one",
            ));
        }
    };
    // Filtering a large trace is CPU work: keep it off the async workers.
    let answer = tokio::task::spawn_blocking(move || source.trace().query(&query, limit))
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("timeline query failed: {e}"),
            )
        })?;
    match answer {
        Ok(trace) => Ok(axum::Json(trace).into_response()),
        Err(error @ QueryError::TooLarge { .. }) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            error.to_string(),
        )),
        Err(error @ QueryError::UnknownJob(_)) => {
            Err(ApiError::new(StatusCode::NOT_FOUND, error.to_string()))
        }
        Err(error @ QueryError::EmptyRange { .. }) => Err(ApiError::bad_request(error.to_string())),
    }
}

async fn metrics(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let gpus = state.gpus.clone();
    let live = state.live_view();
    let text =
        tokio::task::spawn_blocking(move || render_metrics(&gpus.snapshot(), live.as_deref()))
            .await
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("collecting metrics failed: {e}"),
                )
            })?
            .map_err(|e| {
                ApiError::new(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("encoding metrics failed: {e}"),
                )
            })?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn openapi(Query(params): Params) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    Ok(axum::Json(openapi_document()).into_response())
}

// The timeline viewer (ui/), embedded at build time: the agent serves it
// with no files beside the binary and nothing fetched from elsewhere.
const UI_INDEX: &str = include_str!("../../ui/index.html");
const UI_SCRIPT: &str = include_str!("../../ui/viewer.js");
const UI_STYLE: &str = include_str!("../../ui/viewer.css");

fn static_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        body,
    )
        .into_response()
}

async fn ui_index() -> Response {
    static_file("text/html; charset=utf-8", UI_INDEX)
}

async fn ui_script() -> Response {
    static_file("text/javascript; charset=utf-8", UI_SCRIPT)
}

async fn ui_style() -> Response {
    static_file("text/css; charset=utf-8", UI_STYLE)
}

async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!("no such endpoint: {}; see /api/openapi.json", uri.path()),
    )
}

async fn method_not_allowed(method: axum::http::Method, uri: axum::http::Uri) -> ApiError {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        format!(
            "{method} is not allowed on {}; see /api/openapi.json",
            uri.path()
        ),
    )
}

/// The OpenAPI 3.1 description of the endpoints above. Kept beside the
/// router; the `openapi_lists_every_route` test checks they agree.
pub fn openapi_document() -> serde_json::Value {
    let error = json!({ "$ref": "#/components/schemas/Error" });
    let bad_request = json!({ "description": "bad query", "content": { "application/json": { "schema": error } } });
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "ringwatch agent API",
            "version": env!("CARGO_PKG_VERSION"),
            "description": "What one node's ringwatch agent sees: GPUs, watched processes, jobs, timelines, metrics."
        },
        "paths": {
            "/api/health": { "get": {
                "summary": "Liveness and version",
                "responses": {
                    "200": { "description": "the agent is up", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["status", "version", "uptime_s"],
                        "properties": { "status": { "const": "ok" }, "version": { "type": "string" }, "uptime_s": { "type": "number" } }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/gpus": { "get": {
                "summary": "The node's NVIDIA GPUs (empty with a reason when there is no driver)",
                "responses": {
                    "200": { "description": "a snapshot", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["gpus", "unavailable_reason"],
                        "properties": {
                            "gpus": { "type": "array", "items": { "type": "object" } },
                            "unavailable_reason": { "type": ["string", "null"] }
                        }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/jobs": { "get": {
                "summary": "Jobs this agent knows (ranks, pids)",
                "responses": {
                    "200": { "description": "the jobs", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["jobs"], "properties": { "jobs": { "type": "array", "items": { "type": "object" } } }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/processes": { "get": {
                "summary": "Processes this agent watches",
                "responses": {
                    "200": { "description": "the processes", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["processes"], "properties": { "processes": { "type": "array", "items": { "type": "object" } } }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/timeline": { "get": {
                "summary": "The timeline of a range, in the Chrome trace event format (Perfetto and chrome://tracing open it)",
                "parameters": [
                    { "name": "from", "in": "query", "schema": { "type": "string" }, "description": "µs on the trace clock, or now-<duration> (now-10s)" },
                    { "name": "to", "in": "query", "schema": { "type": "string" }, "description": "µs, or now-<duration>; default now" },
                    { "name": "job", "in": "query", "schema": { "type": "string" }, "description": "only this job's ranks" },
                    { "name": "pid", "in": "query", "schema": { "type": "string" }, "description": "only this process" },
                    { "name": "downsample", "in": "query", "schema": { "type": "boolean" }, "description": "over the event limit, keep every job activity, counter and NCCL call and the longest thread-state slices (metadata.downsampled says what was dropped) instead of answering 413" }
                ],
                "responses": {
                    "200": { "description": "a Chrome trace", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["traceEvents", "metadata"],
                        "properties": { "traceEvents": { "type": "array", "items": { "type": "object" } }, "metadata": { "type": "object" } }
                    } } } },
                    "400": bad_request,
                    "404": { "description": "unknown job", "content": { "application/json": { "schema": error } } },
                    "413": { "description": "too many events in the range: narrow it", "content": { "application/json": { "schema": error } } },
                    "503": { "description": "no timeline source", "content": { "application/json": { "schema": error } } }
                }
            } },
            "/api/openapi.json": { "get": {
                "summary": "This document",
                "responses": { "200": { "description": "OpenAPI 3.1", "content": { "application/json": {} } }, "400": bad_request }
            } },
            "/metrics": { "get": {
                "summary": "Prometheus / OpenMetrics exposition",
                "responses": { "200": { "description": "metrics", "content": { "application/openmetrics-text": {} } }, "400": bad_request }
            } }
        },
        "components": { "schemas": { "Error": {
            "type": "object", "required": ["error"],
            "properties": { "error": { "type": "object", "required": ["status", "message"],
                "properties": { "status": { "type": "integer" }, "message": { "type": "string" } } } }
        } } }
    })
}
