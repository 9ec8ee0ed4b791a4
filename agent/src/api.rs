//! `api`: the agent's HTTP API (axum): what the agent knows, as JSON for
//! people and scripts, and as Prometheus exposition at `/metrics`.
//!
//! Handlers only read shared state and format it; they never touch BPF or a
//! job directly (tuning sessions run on their own threads in `tuning`).
//! Every error is JSON with the right status; unknown query parameters are
//! rejected, never ignored. Mutating endpoints (POST, DELETE) pass [`Auth`]
//! first: a bearer token when one is configured, and never without one when
//! the API listens beyond loopback.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::json;

use crate::gpu::Gpus;
use crate::jobs::Jobs;
use crate::live::LiveView;
use crate::metrics::render_metrics;
use crate::reports::ReportFormat;
use crate::timeline::{QueryError, RecordedTrace, TimePoint, TimelineQuery};
use crate::tuning::{Keep, StartError, TuningRequest, Tunings};

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
    /// The jobs found through control sockets (`serve --jobs`), with or
    /// without eBPF.
    pub jobs: Option<Jobs>,
    /// Tuning sessions and their reports (`serve --jobs`).
    pub tunings: Option<Arc<Tunings>>,
    /// Who may call the mutating endpoints.
    pub auth: Arc<Auth>,
}

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
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
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
        .route(
            "/api/jobs/{id}/tuning",
            get(tuning_get).post(tuning_post).delete(tuning_delete),
        )
        .route("/api/reports", get(reports_list))
        .route("/api/reports/{id}", get(report_file))
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
    if let Some(registry) = &state.jobs {
        let jobs = registry.jobs();
        if !jobs.is_empty() || state.recorded.is_none() {
            return Ok(axum::Json(json!({ "jobs": jobs, "source": "live" })).into_response());
        }
    }
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
    fn query(&self, query: &TimelineQuery, limit: usize) -> Result<serde_json::Value, QueryError> {
        match self {
            Self::Recorded(trace) => trace.query(query, limit),
            Self::Live(live) => live.query(query, limit),
        }
    }
}

async fn timeline(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(
        &params,
        &["from", "to", "job", "pid", "downsample", "max_events"],
    )?;
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
    // A client may ask for fewer events than the server's limit (the live
    // UI does: a screen cannot show more), never for more.
    let limit = match params.get("max_events") {
        None => state.timeline_event_limit,
        Some(text) => match text.parse::<usize>() {
            Ok(n) if n > 0 => n.min(state.timeline_event_limit),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "bad max_events: {text:?} (a positive number of events)"
                )));
            }
        },
    };
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
    let answer = tokio::task::spawn_blocking(move || source.query(&query, limit))
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

fn tunings(state: &ApiState) -> Result<&Arc<Tunings>, ApiError> {
    state.tunings.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this agent does not watch jobs, so it cannot tune them: start it with \
             `serve --jobs`",
        )
    })
}

async fn tuning_post(
    State(state): State<ApiState>,
    Path(job_id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    state.auth.check(&headers)?;
    reject_unknown(&params, &[])?;
    let request: TuningRequest = if body.iter().all(u8::is_ascii_whitespace) {
        TuningRequest::default()
    } else {
        serde_json::from_slice(&body).map_err(|e| {
            ApiError::bad_request(format!(
                "bad tuning request body ({e}); expected JSON with any of budget, \
                 warmup_cycles, measured_cycles, min_window_ms, seed, bounds \
                 {{fusion_threshold_bytes: [lo, hi], cycle_time_ms: [lo, hi]}}, fixed \
                 {{fusion_threshold_bytes, cycle_time_ms, hierarchical_allreduce}}"
            ))
        })?
    };
    let tunings = tunings(&state)?.clone();
    let ready = tunings.start(&job_id, &request).map_err(start_error)?;
    // The session's thread answers once it holds the job's claim.
    let answer = tokio::time::timeout(std::time::Duration::from_secs(30), ready)
        .await
        .map_err(|_| {
            ApiError::new(
                StatusCode::GATEWAY_TIMEOUT,
                format!("job {job_id} did not answer the tuning claim within 30 s"),
            )
        })?
        .map_err(|_| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("the tuning session of job {job_id} ended before it started"),
            )
        })?
        .map_err(start_error)?;
    Ok((StatusCode::CREATED, axum::Json(answer)).into_response())
}

fn start_error(error: StartError) -> ApiError {
    let status = match &error {
        StartError::NotFound(_) => StatusCode::NOT_FOUND,
        StartError::Conflict(_) => StatusCode::CONFLICT,
        StartError::BadRequest(_) => StatusCode::BAD_REQUEST,
        StartError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
    };
    ApiError::new(status, error.to_string())
}

fn no_session(job_id: &str) -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        format!(
            "job {job_id:?} never had a tuning session on this agent; \
             POST /api/jobs/{job_id}/tuning starts one"
        ),
    )
}

async fn tuning_get(
    State(state): State<ApiState>,
    Path(job_id): Path<String>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let view = tunings(&state)?
        .get(&job_id)
        .ok_or_else(|| no_session(&job_id))?;
    Ok(axum::Json(view).into_response())
}

async fn tuning_delete(
    State(state): State<ApiState>,
    Path(job_id): Path<String>,
    Query(params): Params,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    state.auth.check(&headers)?;
    reject_unknown(&params, &["keep"])?;
    let keep = match params.get("keep").map(String::as_str) {
        None | Some("best") => Keep::Best,
        Some("start") => Keep::Start,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "bad keep={other:?}: use keep=best (default) or keep=start"
            )));
        }
    };
    let view = tunings(&state)?
        .stop(&job_id, keep)
        .ok_or_else(|| no_session(&job_id))?;
    Ok(axum::Json(view).into_response())
}

async fn reports_list(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let tunings = tunings(&state)?.clone();
    let reports = tokio::task::spawn_blocking(move || tunings.reports().list())
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("listing the reports failed: {e}"),
            )
        })?;
    Ok(axum::Json(json!({ "reports": reports })).into_response())
}

async fn report_file(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &["format"])?;
    let format = match params.get("format") {
        None => ReportFormat::Html,
        Some(text) => ReportFormat::parse(text).ok_or_else(|| {
            ApiError::bad_request(format!(
                "bad format={text:?}: use html (default), csv, parquet or json"
            ))
        })?,
    };
    let path = tunings(&state)?
        .reports()
        .file(&id, format)
        .ok_or_else(|| {
            ApiError::new(
                StatusCode::NOT_FOUND,
                format!(
                    "no report {id:?} in {}; GET /api/reports lists them",
                    format.extension()
                ),
            )
        })?;
    let bytes = tokio::fs::read(&path).await.map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("reading {}: {e}", path.display()),
        )
    })?;
    Ok((
        [
            (header::CONTENT_TYPE, format.content_type()),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        bytes,
    )
        .into_response())
}

async fn metrics(
    State(state): State<ApiState>,
    Query(params): Params,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let gpus = state.gpus.clone();
    let live = state.live_view();
    let jobs = state.jobs.as_ref().map(Jobs::jobs).unwrap_or_default();
    let sessions = state.tunings.as_ref().map(|t| t.all()).unwrap_or_default();
    let text = tokio::task::spawn_blocking(move || {
        render_metrics(&gpus.snapshot(), live.as_deref(), &jobs, &sessions)
    })
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
    let unauthorized = json!({ "description": "a token is configured and the request lacks it (or has a wrong one)", "content": { "application/json": { "schema": error } } });
    let forbidden = json!({ "description": "the agent listens beyond loopback and has no token configured", "content": { "application/json": { "schema": error } } });
    let knobs = json!({ "$ref": "#/components/schemas/Knobs" });
    let session = json!({ "$ref": "#/components/schemas/TuningSession" });
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
                    { "name": "max_events", "in": "query", "schema": { "type": "integer", "minimum": 1 }, "description": "at most this many events (capped by the server's --timeline-event-limit)" },
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
            "/api/jobs/{id}/tuning": {
                "parameters": [ { "name": "id", "in": "path", "required": true, "schema": { "type": "string" }, "description": "the job's id" } ],
                "get": {
                    "summary": "The job's tuning session (running, or the last one)",
                    "responses": {
                        "200": { "description": "the session", "content": { "application/json": { "schema": session } } },
                        "400": bad_request,
                        "404": { "description": "the job never had a session", "content": { "application/json": { "schema": error } } },
                        "503": { "description": "the agent does not watch jobs (serve --jobs)", "content": { "application/json": { "schema": error } } }
                    }
                },
                "post": {
                    "summary": "Start a tuning session: claim the job's tuning, sample knobs with Bayesian optimization, pin the best, write a report",
                    "security": [ { "bearer": [] } ],
                    "requestBody": { "required": false, "content": { "application/json": { "schema": {
                        "type": "object", "additionalProperties": false,
                        "properties": {
                            "budget": { "type": "integer", "minimum": 1, "default": 20, "description": "samples" },
                            "warmup_cycles": { "type": "integer", "default": 3, "description": "cycles with work skipped after knobs are applied" },
                            "measured_cycles": { "type": "integer", "default": 10, "description": "cycles with work per window (at least)" },
                            "min_window_ms": { "type": "integer", "default": 1000, "description": "shortest window" },
                            "seed": { "type": "integer", "default": 0 },
                            "bounds": { "type": "object", "additionalProperties": false, "properties": {
                                "fusion_threshold_bytes": { "type": "array", "items": { "type": "integer" }, "minItems": 2, "maxItems": 2 },
                                "cycle_time_ms": { "type": "array", "items": { "type": "number" }, "minItems": 2, "maxItems": 2 }
                            } },
                            "fixed": { "type": "object", "additionalProperties": false, "properties": {
                                "fusion_threshold_bytes": { "type": "integer" },
                                "cycle_time_ms": { "type": "number" },
                                "hierarchical_allreduce": { "type": "boolean" }
                            } }
                        }
                    } } } },
                    "responses": {
                        "201": { "description": "started (the job's claim is held)", "content": { "application/json": { "schema": session } } },
                        "400": { "description": "bad body or configuration", "content": { "application/json": { "schema": error } } },
                        "401": unauthorized,
                        "403": forbidden,
                        "404": { "description": "unknown job", "content": { "application/json": { "schema": error } } },
                        "409": { "description": "a session already runs, the job is lost, or the job refused the claim", "content": { "application/json": { "schema": error } } },
                        "503": { "description": "the job's socket cannot be used, or the agent does not watch jobs", "content": { "application/json": { "schema": error } } }
                    }
                },
                "delete": {
                    "summary": "Stop the running session; the job is left on the best knobs found (or its starting knobs with keep=start)",
                    "security": [ { "bearer": [] } ],
                    "parameters": [ { "name": "keep", "in": "query", "schema": { "enum": ["best", "start"], "default": "best" } } ],
                    "responses": {
                        "200": { "description": "the session (it ends within a moment)", "content": { "application/json": { "schema": session } } },
                        "400": bad_request,
                        "401": unauthorized,
                        "403": forbidden,
                        "404": { "description": "the job never had a session", "content": { "application/json": { "schema": error } } }
                    }
                }
            },
            "/api/reports": { "get": {
                "summary": "Tuning reports written by this agent, newest first",
                "responses": {
                    "200": { "description": "the reports", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["reports"],
                        "properties": { "reports": { "type": "array", "items": {
                            "type": "object",
                            "required": ["id", "job_id", "created_unix_ms", "samples", "best", "speedup_over_start", "html", "csv", "parquet"],
                            "properties": {
                                "id": { "type": "string" }, "job_id": { "type": "string" },
                                "created_unix_ms": { "type": "integer" }, "samples": { "type": "integer" },
                                "best": { "oneOf": [ knobs, { "type": "null" } ] },
                                "speedup_over_start": { "type": ["number", "null"] },
                                "html": { "type": "string" }, "csv": { "type": "string" }, "parquet": { "type": "string" }
                            }
                        } } }
                    } } } },
                    "400": bad_request,
                    "503": { "description": "the agent does not watch jobs (serve --jobs)", "content": { "application/json": { "schema": error } } }
                }
            } },
            "/api/reports/{id}": { "get": {
                "summary": "One report's file",
                "parameters": [
                    { "name": "id", "in": "path", "required": true, "schema": { "type": "string" } },
                    { "name": "format", "in": "query", "schema": { "enum": ["html", "csv", "parquet", "json"], "default": "html" } }
                ],
                "responses": {
                    "200": { "description": "the file", "content": { "text/html": {}, "text/csv": {}, "application/vnd.apache.parquet": {}, "application/json": {} } },
                    "400": bad_request,
                    "404": { "description": "no such report", "content": { "application/json": { "schema": error } } }
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
        "components": {
          "securitySchemes": { "bearer": { "type": "http", "scheme": "bearer",
              "description": "needed by POST/DELETE when the agent has a token (--token-file, RINGWATCH_API_TOKEN_FILE, RINGWATCH_API_TOKEN)" } },
          "schemas": {
          "Knobs": {
            "type": "object", "required": ["fusion_threshold_bytes", "cycle_time_us", "hierarchical_allreduce"],
            "properties": { "fusion_threshold_bytes": { "type": "integer" }, "cycle_time_us": { "type": "integer" }, "hierarchical_allreduce": { "type": "boolean" } }
          },
          "TuningSession": {
            "type": "object",
            "required": ["job_id", "state", "error", "started_unix_ms", "config", "start_knobs", "current_knobs", "samples", "best", "speedup_over_start", "report_id"],
            "properties": {
                "job_id": { "type": "string" },
                "state": { "enum": ["running", "done", "stopped", "failed"] },
                "error": { "type": ["string", "null"] },
                "started_unix_ms": { "type": "integer" },
                "config": { "type": "object" },
                "start_knobs": knobs, "current_knobs": knobs,
                "samples": { "type": "array", "items": {
                    "type": "object",
                    "required": ["index", "knobs", "score_bytes_per_s", "noise_hint", "disturbed", "remeasured_because", "wall_time_s", "window"],
                    "properties": {
                        "index": { "type": "integer" }, "knobs": knobs,
                        "score_bytes_per_s": { "type": "number" },
                        "noise_hint": { "type": ["number", "null"] },
                        "disturbed": { "type": ["string", "null"] },
                        "remeasured_because": { "type": ["string", "null"] },
                        "wall_time_s": { "type": "number" },
                        "window": { "type": "object", "properties": {
                            "first_cycle": { "type": "integer" }, "last_cycle": { "type": "integer" },
                            "cycles": { "type": "integer" }, "duration_s": { "type": "number" } } }
                    }
                } },
                "best": { "oneOf": [ { "type": "null" }, { "type": "object", "properties": {
                    "knobs": knobs, "predicted_score_bytes_per_s": { "type": "number" }, "sample": { "type": "integer" } } } ] },
                "speedup_over_start": { "type": ["number", "null"] },
                "report_id": { "type": ["string", "null"] },
                "disturbance_detection": { "type": "string", "description": "on, or off with the reason" },
                "stop_reason": { "type": ["string", "null"] }
            }
          },
          "Error": {
            "type": "object", "required": ["error"],
            "properties": { "error": { "type": "object", "required": ["status", "message"],
                "properties": { "status": { "type": "integer" }, "message": { "type": "string" } } } }
        } } }
    })
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
        }
    }
}
