//! `api`: the agent's HTTP API (axum): what the agent knows, as JSON for
//! people and scripts, and as Prometheus exposition at `/metrics`.
//!
//! Handlers only read shared state and format it; they never touch BPF or a
//! job directly (tuning sessions run on their own threads in `tuning`).
//! Every error is JSON with the right status, the framework's own
//! rejections (a malformed query or path, a body over the limit) included;
//! unknown query parameters are rejected, never ignored. Mutating endpoints
//! (POST, DELETE) pass [`Auth`] first: a bearer token when one is
//! configured, and never without one when the API listens beyond loopback.
//! Timeline queries are bounded ([`TimelineLimits`]): a few build at once
//! (more are answered 503 with `Retry-After`), each within a byte budget.

use std::collections::HashMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{FromRequest, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower_http::limit::RequestBodyLimitLayer;

pub mod http;
mod ui;

use crate::cluster::Cluster;
use crate::gpu::Gpus;
use crate::jobs::Jobs;
use crate::live::LiveView;
use crate::lod::Detail;
use crate::metrics::render_metrics;
use crate::reports::ReportFormat;
use crate::timeline::{
    AnswerLimits, QueryError, RecordedTrace, TIME_POINT_PATTERN, TimePoint, TimelineQuery,
    TraceAnswer, View,
};
use crate::tuning::{Keep, StartError, TuningRequest, Tunings};

/// What the handlers read. Cheap to clone (everything behind `Arc`).
#[derive(Clone)]
pub struct ApiState {
    /// This node among its peers (`--node-name`, `--peers`, `--peers-dns`).
    pub cluster: Arc<Cluster>,
    /// The eBPF figures tuning windows are judged by (with eBPF), also
    /// answered to peers tuning a multi-node job (`/api/jobs/{id}/load`).
    pub load_feed: Option<Arc<crate::tuning::LoadFeed>>,
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
    /// Seconds for a `Retry-After` header (503 when busy).
    retry_after_s: Option<u32>,
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
    fn busy(message: impl Into<String>, seconds: u32) -> Self {
        Self {
            retry_after_s: Some(seconds),
            ..Self::new(StatusCode::SERVICE_UNAVAILABLE, message)
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = json!({ "error": { "status": self.status.as_u16(), "message": self.message } });
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

/// The query string as name → value, with a JSON error when it does not
/// parse (axum's own `Query` rejection is plain text).
#[derive(Debug)]
pub struct ApiQuery(pub HashMap<String, String>);

impl<S: Send + Sync> FromRequestParts<S> for ApiQuery {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        Query::<HashMap<String, String>>::from_request_parts(parts, state)
            .await
            .map(|Query(params)| Self(params))
            .map_err(|e| rejection(e.status(), "bad query string", e.body_text()))
    }
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
async fn json_errors(response: Response) -> Response {
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
    let body = json!({ "error": { "status": status.as_u16(), "message": message } });
    parts.headers.remove(header::CONTENT_LENGTH);
    parts.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    Response::from_parts(parts, Body::from(body.to_string()))
}

/// Bounds on `/api/timeline`: how many answers are built (and sent) at
/// once, and the bytes one answer may hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TimelineLimits {
    /// Answers being built or sent at once; more are answered 503 with
    /// `Retry-After` at once, never queued.
    pub max_concurrent: usize,
    /// The most bytes of events in one answer (`metadata.truncated` says
    /// what was left out).
    pub max_bytes: usize,
}

impl Default for TimelineLimits {
    /// Measured on the 2-core machine: building a 100k-event answer (the
    /// viewer's `max_events`, ~15 MB) takes about a core for a fraction of
    /// a second, so four at once is already more than the cores; 64 MiB
    /// holds ~400k thread-state slices.
    fn default() -> Self {
        Self {
            max_concurrent: 4,
            max_bytes: 64 * 1024 * 1024,
        }
    }
}

/// The slots of [`TimelineLimits::max_concurrent`]. A slot is held by the
/// blocking task that builds the answer and then by the answer's body
/// until it is sent, not by the request's future: a client that hangs up,
/// or a request timeout, drops the future while the build goes on, and a
/// slow reader keeps its answer in memory. (tower's `ConcurrencyLimit`
/// frees its slot with the future, so it bounds neither.)
#[derive(Debug, Clone)]
struct TimelineSlots {
    slots: Arc<Semaphore>,
    limits: TimelineLimits,
}

/// An answer's body, sent in chunks, holding its [`TimelineSlots`] slot
/// until the last chunk is taken (hyper takes the next chunk once it has
/// written the previous ones, so the slot lasts about as long as the
/// sending does).
struct SlotBody {
    rest: Bytes,
    _slot: OwnedSemaphorePermit,
}

impl SlotBody {
    const CHUNK_BYTES: usize = 256 * 1024;
}

impl http_body::Body for SlotBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        if self.rest.is_empty() {
            return Poll::Ready(None);
        }
        let n = self.rest.len().min(Self::CHUNK_BYTES);
        let chunk = self.rest.split_to(n);
        Poll::Ready(Some(Ok(http_body::Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.rest.is_empty()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        http_body::SizeHint::with_exact(self.rest.len() as u64)
    }
}

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

/// The router: every endpoint of the API, with the default
/// [`TimelineLimits`].
pub fn router(state: ApiState) -> Router {
    router_with(state, TimelineLimits::default())
}

/// The router with these timeline limits. Every answer that is an error is
/// JSON (`json_errors` is the outermost layer, so the body limit's 413
/// is too).
pub fn router_with(state: ApiState, limits: TimelineLimits) -> Router {
    let slots = TimelineSlots {
        slots: Arc::new(Semaphore::new(limits.max_concurrent.max(1))),
        limits,
    };
    Router::new()
        .route("/api/health", get(health))
        .route("/api/gpus", get(gpus))
        .route("/api/jobs", get(jobs))
        .route("/api/processes", get(processes))
        .route("/api/timeline", get(timeline).layer(axum::Extension(slots)))
        .route("/api/clock", get(clock))
        .route("/api/jobs/{id}/load", get(job_load))
        .route("/api/cluster/jobs", get(cluster_jobs))
        .route(
            "/api/jobs/{id}/tuning",
            get(tuning_get).post(tuning_post).delete(tuning_delete),
        )
        .route("/api/reports", get(reports_list))
        .route("/api/reports/{id}", get(report_file))
        .route("/api/openapi.json", get(openapi))
        .route("/metrics", get(metrics))
        .merge(ui::routes())
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .layer(RequestBodyLimitLayer::new(MAX_BODY_BYTES))
        .layer(axum::middleware::map_response(json_errors))
        .with_state(state)
}

async fn health(
    State(state): State<ApiState>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    Ok(axum::Json(json!({
        "status": "ok",
        "version": env!("CARGO_PKG_VERSION"),
        "uptime_s": state.started.elapsed().as_secs_f64(),
        "node": state.cluster.node_name(),
        "agent_id": state.cluster.agent_id(),
    }))
    .into_response())
}

async fn gpus(
    State(state): State<ApiState>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
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

async fn jobs(
    State(state): State<ApiState>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    if let Some(registry) = &state.jobs {
        let jobs = registry.jobs();
        if !jobs.is_empty() || state.recorded.is_none() {
            return Ok(axum::Json(json!({
                "jobs": jobs,
                "source": "live",
                "node": state.cluster.node_name(),
                "agent_id": state.cluster.agent_id(),
            }))
            .into_response());
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
    ApiQuery(params): ApiQuery,
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
    fn query(
        &self,
        query: &TimelineQuery,
        limits: AnswerLimits,
    ) -> Result<TraceAnswer, QueryError> {
        match self {
            Self::Recorded(trace) => trace.query(query, limits),
            Self::Live(live) => live.query(query, limits),
        }
    }
}

/// `width` (pixels, 1 to [`Detail::MAX_WIDTH`]) or `resolution` (µs per
/// pixel, a positive number; it wins when both are given, as documented):
/// the answer's level of detail; neither, full. Both are checked.
fn detail_param(params: &HashMap<String, String>) -> Result<Detail, ApiError> {
    let width = params.get("width").map(|text| {
        text.parse::<u32>()
            .ok()
            .filter(|n| n.to_string() == *text && (1..=Detail::MAX_WIDTH).contains(n))
            .map(Detail::Width)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "bad width: {text:?} (the pixels the window is drawn on, 1 to {})",
                    Detail::MAX_WIDTH
                ))
            })
    });
    let resolution = params.get("resolution").map(|text| {
        text.parse::<f64>()
            .ok()
            .filter(|us| {
                us.is_finite()
                    && *us > 0.0
                    && text.len() <= MAX_RESOLUTION_CHARS
                    && is_plain_number(text)
            })
            .map(Detail::Resolution)
            .ok_or_else(|| {
                ApiError::bad_request(format!(
                    "bad resolution: {text:?} (µs per pixel, a positive number like 1000 or 0.5, at most {MAX_RESOLUTION_CHARS} characters)"
                ))
            })
    });
    match (width.transpose()?, resolution.transpose()?) {
        (_, Some(resolution)) => Ok(resolution),
        (Some(width), None) => Ok(width),
        (None, None) => Ok(Detail::Full),
    }
}

/// The longest `resolution` the document allows (`maxLength`).
const MAX_RESOLUTION_CHARS: usize = 24;

/// Digits with at most one `.` between digits: what the document's
/// pattern for `resolution` allows (Rust's parser also takes `inf`, `1e3`).
fn is_plain_number(text: &str) -> bool {
    let mut parts = text.splitn(2, '.');
    let digits =
        |p: Option<&str>| p.is_some_and(|p| !p.is_empty() && p.bytes().all(|b| b.is_ascii_digit()));
    let whole = parts.next();
    match parts.next() {
        None => digits(whole),
        Some(frac) => digits(whole) && digits(Some(frac)),
    }
}

/// `max_events`: 1 to this many (the server's own limit caps it further).
const MAX_EVENTS_PARAM: u64 = 1_000_000_000;

/// Which clock an answer is on, and whose timeline it is.
#[derive(Debug, Clone, Copy, PartialEq)]
enum TimelineClock {
    /// The trace's own clock (the live view's: CLOCK_MONOTONIC µs).
    Trace,
    /// CLOCK_REALTIME µs (`clock=unix`): comparable across nodes.
    Unix,
    /// Absolute `from`/`to` in CLOCK_REALTIME µs, the answer left on the
    /// trace's clock (the cluster merge shifts it while it writes).
    UnixQuery,
}

async fn timeline(
    State(state): State<ApiState>,
    axum::Extension(slots): axum::Extension<TimelineSlots>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(
        &params,
        &[
            "from",
            "to",
            "job",
            "pid",
            "downsample",
            "max_events",
            "scope",
            "clock",
            "width",
            "resolution",
            "view",
        ],
    )?;
    // Someone reads the timeline: jobs stream theirs now (--job-timeline).
    if let Some(jobs) = &state.jobs {
        jobs.note_timeline_read();
    }
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
        detail: detail_param(&params)?,
        view: match params.get("view").map(String::as_str) {
            None | Some("full") => View::Full,
            Some("overview") => View::Overview,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "bad view: {other:?} (full: every thread and tensor; overview: per process, \
                     its threads and tensors merged into counters)"
                )));
            }
        },
    };
    // A client may ask for fewer events than the server's limit (the live
    // UI does: a screen cannot show more), never for more. Written as the
    // document's pattern says: digits, no sign or leading zero (Rust's
    // parser would also take `+5` and `05`).
    let limit = match params.get("max_events") {
        None => state.timeline_event_limit,
        Some(text) => match text.parse::<u64>().ok().filter(|n| n.to_string() == *text) {
            Some(n) if (1..=MAX_EVENTS_PARAM).contains(&n) => usize::try_from(n)
                .map_or(state.timeline_event_limit, |n| {
                    n.min(state.timeline_event_limit)
                }),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "bad max_events: {text:?} (a number of events, 1 to {MAX_EVENTS_PARAM})"
                )));
            }
        },
    };
    let clock = match params.get("clock").map(String::as_str) {
        None | Some("trace") => TimelineClock::Trace,
        Some("unix") => TimelineClock::Unix,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "bad clock: {other:?} (trace: the trace's own clock; unix: Unix time in µs)"
            )));
        }
    };
    match params.get("scope").map(String::as_str) {
        None | Some("node") => {}
        Some("cluster") => {
            return cluster_timeline(&state, &slots, query, &params, limit).await;
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "bad scope: {other:?} (node: this agent's; cluster: every node of the job)"
            )));
        }
    }
    let (answer, slot, _) = local_timeline(&state, &slots, query, limit, clock).await?;
    let body = SlotBody {
        rest: Bytes::from(answer),
        _slot: slot,
    };
    Ok((
        [(header::CONTENT_TYPE, "application/json")],
        Body::new(body),
    )
        .into_response())
}

/// This agent's timeline answer as JSON bytes, on `clock`, with the slot it
/// holds while it is sent, and the offset (Unix − trace clock, µs) that
/// `clock` asked for (`None` for a recorded trace: it stays on its clock).
async fn local_timeline(
    state: &ApiState,
    slots: &TimelineSlots,
    mut query: TimelineQuery,
    limit: usize,
    clock: TimelineClock,
) -> Result<(Vec<u8>, OwnedSemaphorePermit, Option<f64>), ApiError> {
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
    // The live clock is CLOCK_MONOTONIC; Unix times asked for are mapped to
    // it, and the answer back. A recorded trace stays on its own clock.
    let offset_us = match (&source, clock) {
        (TimelineSource::Live(_), TimelineClock::Unix | TimelineClock::UnixQuery) => {
            Some(crate::tracks::unix_minus_monotonic_us() as f64)
        }
        _ => None,
    };
    let shift_answer = clock == TimelineClock::Unix;
    if let Some(offset) = offset_us {
        let shift = |point: Option<TimePoint>| match point {
            Some(TimePoint::At(us)) => Some(TimePoint::At(us - offset)),
            other => other,
        };
        query.from = shift(query.from);
        query.to = shift(query.to);
    }
    let slot = slots.slots.clone().try_acquire_owned().map_err(|_| {
        ApiError::busy(
            format!(
                "{} timeline answers are being built or sent, the most this agent builds at \
                 once: retry in a second (and ask for less: a job or pid, a narrower \
                 from/to, or max_events)",
                slots.limits.max_concurrent
            ),
            1,
        )
    })?;
    let limits = AnswerLimits {
        max_events: limit,
        max_bytes: slots.limits.max_bytes,
    };
    // Filtering a large trace is CPU work: keep it off the async workers.
    // The slot goes with the build, then with the body (see TimelineSlots).
    let answer = tokio::task::spawn_blocking(move || {
        let answer = source.query(&query, limits).map(|trace| match offset_us {
            Some(offset) if shift_answer => {
                crate::cluster::to_wall_clock(&trace.json, offset).unwrap_or(trace.json)
            }
            _ => trace.json,
        });
        (answer, slot)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("timeline query failed: {e}"),
        )
    })?;
    match answer {
        (Ok(json), slot) => Ok((json, slot, offset_us)),
        (Err(error @ QueryError::TooLarge { .. }), _) => Err(ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            error.to_string(),
        )),
        (Err(error @ QueryError::UnknownJob(_)), _) => {
            Err(ApiError::new(StatusCode::NOT_FOUND, error.to_string()))
        }
    }
}

/// Percent-encodes a query value (job ids and time points are plain, but a
/// `µs` unit is not ASCII).
fn query_value(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-_.~".contains(&byte) {
            out.push(byte as char);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// `GET /api/timeline?scope=cluster&job=ID`: this node's part and the part
/// of every peer that has the job, each on its wall clock, merged on ours.
async fn cluster_timeline(
    state: &ApiState,
    slots: &TimelineSlots,
    query: TimelineQuery,
    params: &HashMap<String, String>,
    limit: usize,
) -> Result<Response, ApiError> {
    let Some(job) = query.job.clone() else {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            "scope=cluster answers for one job: name it (job=ID; GET /api/cluster/jobs lists them)",
        ));
    };
    if state.recorded.is_some() {
        // A recorded trace is this agent's alone, on its own clock.
        let (answer, slot, _) =
            local_timeline(state, slots, query, limit, TimelineClock::Trace).await?;
        let body = SlotBody {
            rest: Bytes::from(answer),
            _slot: slot,
        };
        return Ok((
            [(header::CONTENT_TYPE, "application/json")],
            Body::new(body),
        )
            .into_response());
    }
    let started = Instant::now();
    let cluster = state.cluster.clone();
    // One window for every node: `now-…` is resolved here, on our clock.
    let now_unix = crate::cluster::unix_now_us();
    let absolute = |point: Option<TimePoint>| match point {
        Some(TimePoint::BeforeNow(d)) => Some(TimePoint::At(now_unix - d.as_secs_f64() * 1e6)),
        other => other,
    };
    let mut query = query;
    query.from = absolute(query.from);
    query.to = Some(absolute(query.to).unwrap_or(TimePoint::At(now_unix)));
    let mut nodes = Vec::new();
    let mut missing = Vec::new();
    let mut local_hosts = Vec::new();
    let mut hosts: Vec<String> = Vec::new();
    if let Some(registry) = &state.jobs
        && let Some(local) = registry.jobs().into_iter().find(|j| j.job_id == job)
    {
        hosts = local.hosts().into_iter().map(str::to_owned).collect();
        local_hosts.push(local.host.clone());
    }
    // The peers that have the job.
    let answers = cluster
        .ask_all("/api/jobs", crate::cluster::MAX_SMALL_ANSWER_BYTES)
        .await;
    let mut holders = Vec::new();
    for answer in answers {
        match &answer.result {
            Ok(value) => {
                let theirs = value
                    .get("jobs")
                    .and_then(Value::as_array)
                    .and_then(|jobs| {
                        jobs.iter()
                            .find(|j| j.get("job_id").and_then(Value::as_str) == Some(&job))
                    });
                if let Some(entry) = theirs {
                    if hosts.is_empty() {
                        hosts = crate::cluster::job_hosts(entry);
                    }
                    let host = entry.get("host").and_then(Value::as_str).unwrap_or("");
                    holders.push((answer.clone(), host.to_owned()));
                }
            }
            Err(why) => {
                missing.push(json!({ "node": answer.addr, "agent": answer.addr, "error": why }))
            }
        }
    }
    // Each node's part gets an equal share of the events.
    let per_node = (limit / (holders.len() + 1)).max(1);
    let mut calls = tokio::task::JoinSet::new();
    for (answer, host) in holders {
        let cluster = cluster.clone();
        let mut path = format!(
            "/api/timeline?clock=unix&job={}&max_events={per_node}",
            query_value(&job)
        );
        for name in ["pid", "downsample", "width", "resolution", "view"] {
            if let Some(value) = params.get(name) {
                path.push_str(&format!("&{name}={}", query_value(value)));
            }
        }
        let points = [("from", query.from), ("to", query.to)];
        calls.spawn(async move {
            let clock = cluster.clock(&answer.addr).await;
            let result = match clock {
                Ok(clock) => {
                    for (name, point) in points {
                        match point {
                            // Our Unix time, on the peer's clock.
                            Some(TimePoint::At(us)) => {
                                path.push_str(&format!(
                                    "&{name}={:.0}",
                                    (us + clock.offset_us).max(0.0)
                                ));
                            }
                            Some(TimePoint::BeforeNow(d)) => {
                                path.push_str(&format!("&{name}=now-{}us", d.as_micros()));
                            }
                            None => {}
                        }
                    }
                    crate::cluster::get_bytes(
                        &answer.addr,
                        &path,
                        cluster_timeout(&cluster),
                        // A node's share of events is about 150 bytes each:
                        // a peer sending far more is cut off (and named), so
                        // the answers held for the merge stay near 512 bytes
                        // an event over all nodes, whatever peers send.
                        (per_node as u64 * 512).clamp(1 << 20, cluster.max_timeline_bytes()),
                    )
                    .await
                    .map(|trace| (clock, trace))
                }
                Err(e) => Err(format!("clock: {e}")),
            };
            (answer, host, result)
        });
    }
    let holders_count = calls.len();
    // This node's part, while the peers build theirs.
    match local_timeline(
        state,
        slots,
        query.clone(),
        per_node,
        TimelineClock::UnixQuery,
    )
    .await
    {
        Ok((json, _slot, offset)) => nodes.push(crate::cluster::NodeTrace {
            node: cluster.node_name().to_owned(),
            agent: "self".into(),
            clock: crate::cluster::ClockEstimate {
                offset_us: 0.0,
                uncertainty_us: 0.0,
            },
            shift_us: offset.unwrap_or(0.0),
            trace: json,
        }),
        // The job has no ranks here: only peers answer.
        Err(error) if error.status == StatusCode::NOT_FOUND => {}
        Err(error) => return Err(error),
    }
    if nodes.is_empty() && holders_count == 0 && missing.is_empty() {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!("no agent of this cluster knows job {job:?}"),
        ));
    }
    while let Some(joined) = calls.join_next().await {
        let Ok((answer, host, result)) = joined else {
            continue;
        };
        let node = answer.node.clone().unwrap_or_else(|| answer.addr.clone());
        match result {
            Ok((clock, trace)) => {
                local_hosts.push(host);
                nodes.push(crate::cluster::NodeTrace {
                    node,
                    agent: answer.addr,
                    clock,
                    shift_us: -clock.offset_us,
                    trace,
                });
            }
            Err(why) => missing
                .push(json!({ "node": node, "agent": answer.addr, "host": host, "error": why })),
        }
    }
    for host in &hosts {
        if !local_hosts.contains(host)
            && !missing
                .iter()
                .any(|m| m.get("host").and_then(Value::as_str) == Some(host))
        {
            missing.push(json!({ "host": host, "error": "no reachable agent speaks for this host of the job" }));
        }
    }
    nodes.sort_by(|a, b| a.node.cmp(&b.node));
    let mut extra = serde_json::Map::new();
    extra.insert("job".into(), json!(job));
    if let Some(error) = cluster.dns_error() {
        extra.insert("peers_dns_error".into(), json!(error));
    }
    let max_bytes = slots.limits.max_bytes;
    let merged = tokio::task::spawn_blocking(move || {
        extra.insert(
            "gather_ms".into(),
            json!(started.elapsed().as_secs_f64() * 1e3),
        );
        crate::cluster::merge_timelines(&nodes, missing, limit, max_bytes, extra)
    })
    .await
    .map_err(|e| {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("merging failed: {e}"),
        )
    })?;
    Ok(([(header::CONTENT_TYPE, "application/json")], merged).into_response())
}

/// A peer timeline call's deadline: a timeline takes longer to build than a
/// small answer.
fn cluster_timeout(cluster: &crate::cluster::Cluster) -> std::time::Duration {
    cluster.timeout() * 5
}

/// The longest window `/api/jobs/{id}/load` answers for.
const MAX_LOAD_WINDOW_US: u64 = 600_000_000;

/// `GET /api/jobs/{id}/load?from_unix_us=&to_unix_us=`: what the job's
/// ranks on this node went through in a window (run-queue waits, TCP
/// retransmits, from eBPF): what a peer tuning the job judges the window
/// by on this node. Waits (a little) until the figures cover the window.
async fn job_load(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &["from_unix_us", "to_unix_us"])?;
    let time = |name: &str| -> Result<u64, ApiError> {
        let text = params
            .get(name)
            .ok_or_else(|| ApiError::bad_request(format!("{name} is required (Unix µs)")))?;
        text.parse::<u64>()
            .ok()
            .filter(|n| n.to_string() == *text)
            .ok_or_else(|| ApiError::bad_request(format!("bad {name}: {text:?} (Unix µs, digits)")))
    };
    let (from, to) = (time("from_unix_us")?, time("to_unix_us")?);
    // A window longer than the feed keeps is answered for its end.
    let clamped = to.saturating_sub(from) > MAX_LOAD_WINDOW_US;
    let from = from.max(to.saturating_sub(MAX_LOAD_WINDOW_US));
    let Some(feed) = state.load_feed.clone() else {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this agent has no eBPF figures (it runs without eBPF, or without --jobs)",
        ));
    };
    let job = state
        .jobs
        .as_ref()
        .and_then(|registry| registry.jobs().into_iter().find(|j| j.job_id == id))
        .ok_or_else(|| {
            ApiError::new(StatusCode::NOT_FOUND, format!("no job {id:?} on this node"))
        })?;
    let pids: std::collections::BTreeSet<u32> = job
        .local_ranks()
        .filter(|r| r.pid != 0)
        .map(|r| r.pid)
        .collect();
    if from >= to {
        // An empty window: nothing happened in it.
        return Ok(axum::Json(json!({
            "span_s": 0.0, "pids": [], "node": state.cluster.node_name(), "job_id": id, "host": job.host,
        }))
        .into_response());
    }
    // A peer judges its windows by ours: keep the feed recording.
    feed.ask();
    let deadline = Instant::now() + std::time::Duration::from_millis(1_500);
    while !feed.covers(to) && Instant::now() < deadline {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    if !feed.covers(to) {
        return Err(ApiError::busy(
            "this node's eBPF figures do not reach the window's end yet",
            1,
        ));
    }
    let load = feed.window(&pids, from, to).ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no eBPF figures for this window (it began before what this node's feed keeps, \
             the last 30 s since it last started, or records were lost in it)",
        )
    })?;
    let mut answer = serde_json::to_value(&load).unwrap_or(Value::Null);
    answer["node"] = json!(state.cluster.node_name());
    answer["job_id"] = json!(id);
    answer["host"] = json!(job.host);
    if clamped {
        answer["clamped_to_last_s"] = json!(MAX_LOAD_WINDOW_US / 1_000_000);
    }
    Ok(axum::Json(answer).into_response())
}

/// `GET /api/clock`: this agent's clocks, for peers' offset estimates.
async fn clock(
    State(state): State<ApiState>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let unix_minus_monotonic = crate::tracks::unix_minus_monotonic_us();
    Ok(axum::Json(json!({
        "unix_us": crate::cluster::unix_now_us(),
        "unix_minus_monotonic_us": unix_minus_monotonic,
        "node": state.cluster.node_name(),
        "agent_id": state.cluster.agent_id(),
    }))
    .into_response())
}

/// `GET /api/cluster/jobs`: this agent's jobs and every peer's, per job.
async fn cluster_jobs(
    State(state): State<ApiState>,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let local: Vec<Value> = state
        .jobs
        .as_ref()
        .map(|registry| {
            registry
                .jobs()
                .iter()
                .filter_map(|job| serde_json::to_value(job).ok())
                .collect()
        })
        .unwrap_or_default();
    let answers = state
        .cluster
        .ask_all("/api/jobs", crate::cluster::MAX_SMALL_ANSWER_BYTES)
        .await;
    let mut merged = crate::cluster::merge_jobs(state.cluster.node_name(), &local, &answers);
    merged["peers_asked"] = json!(answers.len());
    if let Some(error) = state.cluster.dns_error() {
        merged["peers_dns_error"] = json!(error);
    }
    Ok(axum::Json(merged).into_response())
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
    ApiPath(job_id): ApiPath,
    ApiQuery(params): ApiQuery,
    headers: HeaderMap,
    ApiBody(body): ApiBody,
) -> Result<Response, ApiError> {
    state.auth.check(&headers)?;
    reject_unknown(&params, &[])?;
    let request: TuningRequest = if body.iter().all(u8::is_ascii_whitespace) {
        TuningRequest::default()
    } else {
        serde_json::from_slice::<Value>(&body)
            .map(integral_numbers)
            .and_then(serde_json::from_value)
            .map_err(|e| {
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

/// JSON numbers with no fraction (`20.0`, `2e1`) as integers: JSON Schema
/// counts them as integers, so the document's `"type": "integer"` fields
/// must take them, and serde's integer fields take only integer literals.
fn integral_numbers(value: Value) -> Value {
    match value {
        Value::Number(n) if n.is_f64() => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            // 2^64 and -2^63: the ends of u64 and i64, exact as f64.
            if x.fract() != 0.0 || !x.is_finite() {
                Value::Number(n)
            } else if (0.0..18_446_744_073_709_551_616.0).contains(&x) {
                Value::from(x as u64)
            } else if (-9_223_372_036_854_775_808.0..0.0).contains(&x) {
                Value::from(x as i64)
            } else {
                Value::Number(n)
            }
        }
        Value::Array(items) => Value::Array(items.into_iter().map(integral_numbers).collect()),
        Value::Object(fields) => Value::Object(
            fields
                .into_iter()
                .map(|(k, v)| (k, integral_numbers(v)))
                .collect(),
        ),
        other => other,
    }
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
    ApiPath(job_id): ApiPath,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let view = tunings(&state)?
        .get(&job_id)
        .ok_or_else(|| no_session(&job_id))?;
    Ok(axum::Json(view).into_response())
}

async fn tuning_delete(
    State(state): State<ApiState>,
    ApiPath(job_id): ApiPath,
    ApiQuery(params): ApiQuery,
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
    ApiQuery(params): ApiQuery,
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
    ApiPath(id): ApiPath,
    ApiQuery(params): ApiQuery,
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
    headers: HeaderMap,
    ApiQuery(params): ApiQuery,
) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    let format = crate::metrics::Format::negotiate(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
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
    let text = match format {
        crate::metrics::Format::OpenMetrics => text,
        crate::metrics::Format::Classic => crate::metrics::to_classic(&text),
    };
    Ok(([(header::CONTENT_TYPE, format.content_type())], text).into_response())
}

async fn openapi(ApiQuery(params): ApiQuery) -> Result<Response, ApiError> {
    reject_unknown(&params, &[])?;
    Ok(axum::Json(openapi_document()).into_response())
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
    let time_point = json!({ "type": "string", "pattern": TIME_POINT_PATTERN });
    let u64_max = u64::MAX;
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
                        "type": "object", "required": ["processes"], "properties": { "processes": { "type": "array", "items": { "type": "object", "properties": {
                            "container_id": { "type": "string", "pattern": "^[0-9a-f]{12,64}$", "description": "the container runtime's id, from the process's cgroup path; absent outside containers" },
                            "pod_uid": { "type": "string", "format": "uuid", "pattern": "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", "description": "the Kubernetes pod's uid, from the process's cgroup path; absent outside pods" }
                        } } } }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/timeline": { "get": {
                "summary": "The timeline of a range, in the Chrome trace event format (Perfetto and chrome://tracing open it)",
                "parameters": [
                    { "name": "from", "in": "query", "schema": time_point, "description": "start: µs on the trace's clock (metadata.now is the present; the live clock is CLOCK_MONOTONIC), now, or now-<duration> (now-10s, now-1m30s); default: the beginning. A window after now, or with from after to, holds nothing: 200 with no events and metadata.empty_window saying why" },
                    { "name": "to", "in": "query", "schema": time_point, "description": "end, as from; default now" },
                    { "name": "job", "in": "query", "schema": { "type": "string" }, "description": "only this job's ranks (404 when the timeline has no such job)" },
                    { "name": "pid", "in": "query", "schema": { "type": "string" }, "description": "only this process (a number, or a name like gpu0)" },
                    { "name": "max_events", "in": "query", "schema": { "type": "string", "pattern": "^([1-9][0-9]{0,8}|1000000000)$" }, "description": "at most this many events, 1 to 1000000000 (digits, no leading zero) (capped by the server's --timeline-event-limit)" },
                    { "name": "width", "in": "query", "schema": { "type": "string", "pattern": "^([1-9][0-9]{0,4}|100000)$" }, "description": "the pixels the client draws the window on (1 to 100000): slices shorter than a pixel are merged per track into summary slices (args.summary: how many slices; args.<state or activity>: its fraction of the summary's time), so the answer grows with the pixels, not the events; metadata.detail says what was merged" },
                    { "name": "resolution", "in": "query", "schema": { "type": "string", "maxLength": 24, "pattern": "^([0-9]*[1-9][0-9]*(\\.[0-9]+)?|[0-9]+\\.[0-9]*[1-9][0-9]*)$" }, "description": "µs per pixel (a positive number), as width but given directly; when both are given, resolution is used" },
                    { "name": "view", "in": "query", "schema": { "type": "string", "enum": ["full", "overview"], "default": "full" }, "description": "overview: per process, its threads' states and its job's tensor activities merged into two counters per pixel (threads: running and runnable, the average number of its threads; activity: the share of the pixel with some tensor in a collective, fusion copy, negotiation or queued), so an answer's size follows the processes and the pixels only; 1000 pixels unless width or resolution says. full: every thread and tensor (at width/resolution, summarized per pixel)" },
                    { "name": "downsample", "in": "query", "schema": { "type": "string", "enum": ["true", "false", "1", "0"] }, "description": "over the event limit, keep every job activity, counter and NCCL call and the longest thread-state slices (metadata.downsampled says what was dropped) instead of answering 413" },
                    { "name": "clock", "in": "query", "schema": { "type": "string", "enum": ["trace", "unix"], "default": "trace" }, "description": "unix: timestamps (and absolute from/to) in Unix µs, this agent's CLOCK_MONOTONIC mapped to CLOCK_REALTIME (metadata.clock says so), comparable across nodes; a recorded trace stays on its own clock" },
                    { "name": "scope", "in": "query", "schema": { "type": "string", "enum": ["node", "cluster"], "default": "node" }, "description": "cluster (needs job): this node's part and that of every peer agent that has the job, each peer's wall-clock offset estimated from round trips and applied, merged in time order on this agent's Unix clock (whatever clock says); process ids become <node>/<pid>. metadata.nodes gives each node's clock_offset_us and clock_uncertainty_us; metadata.missing names the nodes or hosts that did not answer (metadata.partial)" }
                ],
                "responses": {
                    "200": { "description": "a Chrome trace", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["traceEvents", "metadata"],
                        "properties": {
                            "traceEvents": { "type": "array", "items": { "type": "object" } },
                            "metadata": { "type": "object", "required": ["now", "source"], "properties": {
                                "now": { "type": "number", "description": "the present on the trace's clock (µs)" },
                                "source": { "type": "string" },
                                "empty_window": { "type": "string", "description": "why a window holds nothing (after now, or from after to)" },
                                "downsampled": { "type": "object", "description": "thread-state slices dropped to fit max_events (downsample=true)" },
                                "job_timeline": { "type": "object", "description": "with job=: since when (streaming_since_unix_ms, null: not yet) the job streams its tensor events to this agent, which asks for them while someone reads its timeline (--job-timeline)" },
                                "detail": { "type": "object", "description": "with width or resolution: the pixel's length and what was merged", "required": ["pixel_us", "slices_in_range", "summary_slices", "slices_kept"] },
                                "truncated": { "type": "object", "description": "events left out at the answer's byte budget: narrow the window",
                                    "required": ["reason", "max_bytes", "events_written", "events_left_out"] }
                            } }
                        }
                    } } } },
                    "400": bad_request,
                    "404": { "description": "unknown job", "content": { "application/json": { "schema": error } } },
                    "413": { "description": "too many events in the range: narrow it, or ask for downsample=true", "content": { "application/json": { "schema": error } } },
                    "503": { "description": "no timeline source, or as many answers as the agent builds at once are being built or sent (then Retry-After says when to come back)",
                        "headers": { "Retry-After": { "description": "seconds, when busy", "schema": { "type": "string", "pattern": "^[0-9]+$" } } },
                        "content": { "application/json": { "schema": error } } }
                }
            } },
            "/api/jobs/{id}/load": {
                "parameters": [ { "name": "id", "in": "path", "required": true, "schema": { "type": "string", "minLength": 1 }, "description": "the job's id" } ],
                "get": {
                    "summary": "What the job's ranks on this node went through in a window (eBPF run-queue waits and TCP retransmits): how a peer agent tuning a multi-node job judges the window on this node",
                    "parameters": [
                        { "name": "from_unix_us", "in": "query", "required": true, "schema": { "type": "string", "pattern": "^(0|[1-9][0-9]{0,18})$" }, "description": "window start, Unix µs on this agent's clock" },
                        { "name": "to_unix_us", "in": "query", "required": true, "schema": { "type": "string", "pattern": "^(0|[1-9][0-9]{0,18})$" }, "description": "window end, Unix µs (not after from_unix_us: an empty window; more than 600 s after it: the last 600 s, clamped_to_last_s says so)" }
                    ],
                    "responses": {
                        "200": { "description": "the load", "content": { "application/json": { "schema": {
                            "type": "object", "required": ["span_s", "pids", "node", "job_id", "host"],
                            "properties": {
                                "span_s": { "type": "number" },
                                "pids": { "type": "array", "items": { "type": "object", "required": ["pid", "run_queue_ns", "retransmits"] } },
                                "node": { "type": "string" }, "job_id": { "type": "string" }, "host": { "type": "string" }
                            }
                        } } } },
                        "400": bad_request,
                        "404": { "description": "no such job on this node", "content": { "application/json": { "schema": error } } },
                        "503": { "description": "no eBPF figures here, none for the window (it began before this node's feed started: the feed records only while a tuning session runs here or for two minutes after a peer's ask, which this is), or not yet up to the window's end (Retry-After)",
                            "headers": { "Retry-After": { "description": "seconds", "schema": { "type": "string", "pattern": "^[0-9]+$" } } },
                            "content": { "application/json": { "schema": error } } }
                    }
                }
            },
            "/api/clock": { "get": {
                "summary": "This agent's clocks (for peers' clock-offset estimates)",
                "responses": {
                    "200": { "description": "the clocks", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["unix_us", "unix_minus_monotonic_us", "node", "agent_id"],
                        "properties": {
                            "unix_us": { "type": "number", "description": "CLOCK_REALTIME, µs" },
                            "unix_minus_monotonic_us": { "type": "integer", "description": "CLOCK_REALTIME − CLOCK_MONOTONIC, µs: maps the live timeline's clock to Unix time" },
                            "node": { "type": "string" },
                            "agent_id": { "type": "string" }
                        }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/cluster/jobs": { "get": {
                "summary": "Every job this agent or its peers know, per job: which node speaks for which host, and which hosts no reachable agent speaks for",
                "responses": {
                    "200": { "description": "the jobs", "content": { "application/json": { "schema": {
                        "type": "object", "required": ["node", "jobs", "missing_peers", "peers_asked"],
                        "properties": {
                            "node": { "type": "string" },
                            "peers_asked": { "type": "integer", "minimum": 0 },
                            "peers_dns_error": { "type": "string" },
                            "missing_peers": { "type": "array", "items": { "type": "object", "required": ["agent", "error"] } },
                            "jobs": { "type": "array", "items": { "type": "object",
                                "required": ["job_id", "hosts", "nodes", "missing_hosts", "complete"],
                                "properties": {
                                    "job_id": { "type": "string" },
                                    "hosts": { "type": "array", "items": { "type": "string" } },
                                    "nodes": { "type": "array", "items": { "type": "object", "required": ["node", "agent", "host", "ranks"] } },
                                    "missing_hosts": { "type": "array", "items": { "type": "string" } },
                                    "complete": { "type": "boolean" }
                                } } }
                        }
                    } } } },
                    "400": bad_request
                }
            } },
            "/api/jobs/{id}/tuning": {
                "parameters": [ { "name": "id", "in": "path", "required": true, "schema": { "type": "string", "minLength": 1 }, "description": "the job's id" } ],
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
                            "budget": { "type": "integer", "minimum": 1, "maximum": u64_max, "default": 20, "description": "samples" },
                            "warmup_cycles": { "type": "integer", "minimum": 0, "maximum": u64_max, "default": 3, "description": "cycles with work skipped after knobs are applied" },
                            "measured_cycles": { "type": "integer", "minimum": 0, "maximum": u64_max, "default": 10, "description": "cycles with work per window (at least)" },
                            "min_window_ms": { "type": "integer", "minimum": 0, "maximum": u64_max, "default": 1000, "description": "shortest window" },
                            "seed": { "type": "integer", "minimum": 0, "maximum": u64_max, "default": 0 },
                            "bounds": { "type": "object", "additionalProperties": false, "properties": {
                                "fusion_threshold_bytes": { "type": "array", "items": { "type": "integer", "minimum": 0, "maximum": u64_max }, "minItems": 2, "maxItems": 2 },
                                "cycle_time_ms": { "type": "array", "items": { "type": "number" }, "minItems": 2, "maxItems": 2 }
                            } },
                            "fixed": { "type": "object", "additionalProperties": false, "properties": {
                                "fusion_threshold_bytes": { "type": "integer", "minimum": 0, "maximum": u64_max },
                                "cycle_time_ms": { "type": "number" },
                                "hierarchical_allreduce": { "type": "boolean" }
                            } }
                        }
                    } } } },
                    "responses": {
                        "201": { "description": "started (the job's claim is held)", "content": { "application/json": { "schema": session } } },
                        "400": { "description": "bad body or configuration (ranges that the tuner refuses, e.g. lo above hi)", "content": { "application/json": { "schema": error } } },
                        "413": { "description": "a body over 64 KiB", "content": { "application/json": { "schema": error } } },
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
                    "parameters": [ { "name": "keep", "in": "query", "schema": { "type": "string", "enum": ["best", "start"], "default": "best" } } ],
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
                    { "name": "id", "in": "path", "required": true, "schema": { "type": "string", "minLength": 1 } },
                    { "name": "format", "in": "query", "schema": { "type": "string", "enum": ["html", "csv", "parquet", "json"], "default": "html" } }
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
                "responses": { "200": { "description": "metrics", "content": { "text/plain": {}, "application/openmetrics-text": {} } }, "400": bad_request }
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
                "stop_reason": { "type": ["string", "null"] },
                "confirmation": { "description": "the choice against the start on fresh interleaved windows before pinning; null until it starts and when the choice is the start",
                  "oneOf": [ { "type": "null" }, { "type": "object",
                    "required": ["choice", "choice_sample", "windows", "choice_median_bytes_per_s", "start_median_bytes_per_s", "required_gain", "kept"],
                    "properties": {
                        "choice": knobs, "choice_sample": { "type": "integer" },
                        "windows": { "type": "array", "items": { "type": "object",
                            "required": ["candidate", "score_bytes_per_s", "disturbed", "wall_time_s"],
                            "properties": { "candidate": { "enum": ["choice", "start"] },
                                "score_bytes_per_s": { "type": "number" },
                                "disturbed": { "type": ["string", "null"] },
                                "wall_time_s": { "type": "number" } } } },
                        "choice_median_bytes_per_s": { "type": ["number", "null"] },
                        "start_median_bytes_per_s": { "type": ["number", "null"] },
                        "required_gain": { "type": ["number", "null"] },
                        "kept": { "enum": ["choice", "start", null] } } } ] }
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
            // The scheme is case-insensitive; the token is not.
            assert_eq!(status(&auth, Some("bearer s3cret")), None);
            assert_eq!(status(&auth, Some("BEARER  s3cret ")), None);
            assert_eq!(status(&auth, Some("bearer S3CRET")), Some(401));
            assert_eq!(status(&auth, Some("Bearers3cret")), Some(401));
        }
    }

    use tower::ServiceExt;

    /// A router over a recorded trace of `events` thread-state slices.
    fn app(events: usize, limits: TimelineLimits) -> Router {
        let trace: Vec<Value> = (0..events)
            .map(|i| {
                json!({"ph": "X", "cat": "thread_state", "name": "running",
                "pid": 1, "tid": 1, "ts": i as f64, "dur": 0.5})
            })
            .collect();
        let state = ApiState {
            cluster: crate::cluster::Cluster::new(crate::cluster::ClusterConfig {
                node_name: "test-node".into(),
                peers: Vec::new(),
                peers_dns: None,
                timeout: std::time::Duration::from_secs(1),
                max_timeline_bytes: 1 << 20,
            }),
            load_feed: None,
            gpus: Gpus::shared(),
            started: Instant::now(),
            recorded: Some(Arc::new(
                RecordedTrace::from_events(trace, None, "test").expect("a trace"),
            )),
            timeline_event_limit: 1_000_000,
            live: Arc::new(Mutex::new(None)),
            jobs: None,
            tunings: None,
            auth: Arc::new(Auth {
                token: None,
                loopback_only: true,
            }),
        };
        router_with(state, limits)
    }

    async fn send(app: &Router, method: &str, uri: &str, body: Body) -> Response {
        let request = axum::http::Request::builder()
            .method(method)
            .uri(uri)
            .body(body)
            .expect("a request");
        app.clone().oneshot(request).await.expect("infallible")
    }

    async fn json_of(response: Response) -> Value {
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .expect("a body");
        serde_json::from_slice(&bytes).expect("JSON")
    }

    #[tokio::test]
    async fn over_the_concurrency_limit_a_timeline_query_is_answered_503_with_retry_after() {
        let app = app(
            10,
            TimelineLimits {
                max_concurrent: 1,
                max_bytes: 1 << 20,
            },
        );
        // The first answer holds the one slot until its body is consumed.
        let first = send(&app, "GET", "/api/timeline", Body::empty()).await;
        assert_eq!(first.status(), StatusCode::OK);
        let busy = send(&app, "GET", "/api/timeline", Body::empty()).await;
        assert_eq!(busy.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(busy.headers()[header::RETRY_AFTER], "1");
        let error = json_of(busy).await;
        assert_eq!(error["error"]["status"], 503);
        assert!(
            error["error"]["message"]
                .as_str()
                .unwrap()
                .contains("retry"),
            "{error}"
        );
        // Other endpoints are not limited.
        let health = send(&app, "GET", "/api/health", Body::empty()).await;
        assert_eq!(health.status(), StatusCode::OK);
        // Sent (here: read), the slot is free again.
        assert_eq!(
            json_of(first).await["traceEvents"]
                .as_array()
                .unwrap()
                .len(),
            10
        );
        let again = send(&app, "GET", "/api/timeline", Body::empty()).await;
        assert_eq!(again.status(), StatusCode::OK);
    }

    #[tokio::test]
    async fn a_timeline_answer_stays_within_its_byte_budget_and_says_truncated() {
        let budget = 100 * 1024;
        let app = app(
            50_000,
            TimelineLimits {
                max_concurrent: 4,
                max_bytes: budget,
            },
        );
        let response = send(&app, "GET", "/api/timeline", Body::empty()).await;
        assert_eq!(response.status(), StatusCode::OK);
        let bytes = axum::body::to_bytes(response.into_body(), usize::MAX)
            .await
            .unwrap();
        assert!(bytes.len() <= budget + 1024, "{} bytes", bytes.len());
        let answer: Value = serde_json::from_slice(&bytes).unwrap();
        let written = answer["traceEvents"].as_array().unwrap().len();
        let note = &answer["metadata"]["truncated"];
        assert_eq!(note["events_written"], written);
        assert_eq!(note["events_left_out"], 50_000 - written);
    }

    #[tokio::test]
    async fn the_frameworks_rejections_are_json_errors() {
        let app = app(1, TimelineLimits::default());
        // A body over the limit (declared, and streamed), a query string
        // that does not decode, a path parameter that is not UTF-8, a
        // method not allowed, an unknown path.
        let big = Body::from(vec![b' '; MAX_BODY_BYTES + 1]);
        let cases = [
            ("POST", "/api/jobs/j/tuning", big, 413),
            ("GET", "/api/timeline?from=%FF", Body::empty(), 400),
            ("GET", "/api/jobs/%FF/tuning", Body::empty(), 400),
            ("PUT", "/api/health", Body::empty(), 405),
            ("GET", "/nope", Body::empty(), 404),
            ("GET", "/api/timeline?from=", Body::empty(), 400),
            ("GET", "/api/timeline?max_events=%2B5", Body::empty(), 400),
            ("GET", "/api/timeline?max_events=05", Body::empty(), 400),
            ("GET", "/api/timeline?max_events=0", Body::empty(), 400),
        ];
        for (method, uri, body, status) in cases {
            let response = send(&app, method, uri, body).await;
            assert_eq!(response.status().as_u16(), status, "{method} {uri}");
            let content_type = response.headers()[header::CONTENT_TYPE].clone();
            assert_eq!(content_type, "application/json", "{method} {uri}");
            let error = json_of(response).await;
            assert_eq!(error["error"]["status"], status, "{method} {uri}: {error}");
            assert!(error["error"]["message"].is_string(), "{error}");
        }
    }

    #[tokio::test]
    async fn cluster_questions_are_checked_and_answered_without_peers() {
        let app = app(3, TimelineLimits::default());
        for (uri, status) in [
            ("/api/timeline?scope=cluster", 404),
            ("/api/timeline?scope=galaxy&job=j", 400),
            ("/api/timeline?clock=tai", 400),
            // No agent of this (peerless) cluster knows the job.
            ("/api/timeline?scope=cluster&job=nope", 404),
            ("/api/jobs/j/load", 400),
            ("/api/jobs/j/load?from_unix_us=1&to_unix_us=2&x=1", 400),
            ("/api/jobs/j/load?from_unix_us=1&to_unix_us=2", 503),
        ] {
            let response = send(&app, "GET", uri, Body::empty()).await;
            assert_eq!(response.status().as_u16(), status, "{uri}");
        }
        let clock = json_of(send(&app, "GET", "/api/clock", Body::empty()).await).await;
        assert_eq!(clock["node"], "test-node");
        let unix = clock["unix_us"].as_f64().unwrap();
        assert!(
            (unix - crate::cluster::unix_now_us()).abs() < 60e6,
            "{clock}"
        );
        let jobs = json_of(send(&app, "GET", "/api/cluster/jobs", Body::empty()).await).await;
        assert_eq!(jobs["jobs"], json!([]));
        assert_eq!(jobs["peers_asked"], 0);
        // A recorded trace stays on its own clock: clock=unix moves nothing.
        let trace =
            json_of(send(&app, "GET", "/api/timeline?clock=unix", Body::empty()).await).await;
        assert_eq!(trace["traceEvents"][0]["ts"], 0.0, "{trace}");
    }

    #[tokio::test]
    async fn a_future_window_and_an_empty_one_are_both_empty_answers() {
        let app = app(3, TimelineLimits::default());
        for uri in ["/api/timeline?from=1&to=0", "/api/timeline?from=9999999999"] {
            let response = send(&app, "GET", uri, Body::empty()).await;
            assert_eq!(response.status(), StatusCode::OK, "{uri}");
            let answer = json_of(response).await;
            assert!(
                answer["traceEvents"].as_array().unwrap().is_empty(),
                "{uri}"
            );
            assert!(answer["metadata"]["empty_window"].is_string(), "{answer}");
        }
    }

    #[test]
    fn integral_floats_are_integers_for_the_tuning_body() {
        let body = json!({"budget": 20.0, "bounds": {"cycle_time_ms": [0.5, 2.0]}, "seed": -1.0});
        let fixed = integral_numbers(body);
        assert_eq!(fixed["budget"], json!(20));
        assert!(fixed["budget"].is_u64());
        assert_eq!(fixed["bounds"]["cycle_time_ms"][0], json!(0.5));
        assert!(fixed["seed"].is_i64());
        let request: TuningRequest =
            serde_json::from_value(integral_numbers(json!({"budget": 2e1}))).unwrap();
        assert_eq!(request.budget, Some(20));
    }
}
