//! `api::timeline`: `GET /api/timeline`, the timeline of a range as a
//! Chrome trace, this node's or (`scope=cluster`) every node's of a job,
//! merged on this agent's clock.
//!
//! Answers are bounded ([`TimelineLimits`]): a few build at once (more are
//! answered 503 with `Retry-After`, never queued), each within a byte
//! budget. It never builds an answer on an async worker: filtering a large
//! trace is CPU work.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use utoipa::openapi::schema::{Object, ObjectBuilder, Type};
use utoipa::{IntoParams, ToSchema};

use super::ApiState;
use super::extract::{ApiError, ApiQuery, ErrorBody};
use super::shapes::ChromeTrace;
use crate::live::LiveView;
use crate::lod::Detail;
use crate::timeline::{
    AnswerLimits, QueryError, RecordedTrace, TIME_POINT_PATTERN, TimePoint, TimelineQuery,
    TraceAnswer, View,
};

/// `/api/timeline`'s query. Every value is a string checked by the handler
/// (each bad one answered 400 with its own message); the patterns here are
/// what the handler accepts.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct TimelineParams {
    /// start: µs on the trace's clock (metadata.now is the present; the live clock is CLOCK_MONOTONIC), now, or now-<duration> (now-10s, now-1m30s); default: the beginning. A window after now, or with from after to, holds nothing: 200 with no events and metadata.empty_window saying why
    #[param(schema_with = time_point, nullable = false)]
    pub from: Option<String>,
    /// end, as from; default now
    #[param(schema_with = time_point, nullable = false)]
    pub to: Option<String>,
    /// only this job's ranks (404 when the timeline has no such job)
    #[param(nullable = false)]
    pub job: Option<String>,
    /// only this process (a number, or a name like gpu0)
    #[param(nullable = false)]
    pub pid: Option<String>,
    /// over the event limit, keep every job activity, counter and NCCL call and the longest thread-state slices (metadata.downsampled says what was dropped) instead of answering 413
    #[param(schema_with = downsample_values, nullable = false)]
    pub downsample: Option<String>,
    /// at most this many events, 1 to 1000000000 (digits, no leading zero) (capped by the server's --timeline-event-limit)
    #[param(pattern = "^([1-9][0-9]{0,8}|1000000000)$", nullable = false)]
    pub max_events: Option<String>,
    /// cluster (needs job): this node's part and that of every peer agent that has the job, each peer's wall-clock offset estimated from round trips and applied, merged in time order on this agent's Unix clock (whatever clock says); process ids become <node>/<pid>. metadata.nodes gives each node's clock_offset_us and clock_uncertainty_us; metadata.missing names the nodes or hosts that did not answer (metadata.partial)
    #[param(value_type = Option<TimelineScope>, nullable = false, default = "node")]
    pub scope: Option<String>,
    /// unix: timestamps (and absolute from/to) in Unix µs, this agent's CLOCK_MONOTONIC mapped to CLOCK_REALTIME (metadata.clock says so), comparable across nodes; a recorded trace stays on its own clock
    #[param(value_type = Option<TimelineClockName>, nullable = false, default = "trace")]
    pub clock: Option<String>,
    /// the pixels the client draws the window on (1 to 100000): slices shorter than a pixel are merged per track into summary slices (args.summary: how many slices; args.<state or activity>: its fraction of the summary's time), so the answer grows with the pixels, not the events; metadata.detail says what was merged
    #[param(pattern = "^([1-9][0-9]{0,4}|100000)$", nullable = false)]
    pub width: Option<String>,
    /// µs per pixel (a positive number), as width but given directly; when both are given, resolution is used
    #[param(
        max_length = 24,
        pattern = "^([0-9]*[1-9][0-9]*(\\.[0-9]+)?|[0-9]+\\.[0-9]*[1-9][0-9]*)$",
        nullable = false
    )]
    pub resolution: Option<String>,
    /// overview: per process, its threads' states and its job's tensor activities merged into two counters per pixel (threads: running and runnable, the average number of its threads; activity: the share of the pixel with some tensor in a collective, fusion copy, negotiation or queued), so an answer's size follows the processes and the pixels only; 1000 pixels unless width or resolution says. full: every thread and tensor (at width/resolution, summarized per pixel)
    #[param(value_type = Option<TimelineView>, nullable = false, default = "full")]
    pub view: Option<String>,
}

/// A time point as `from`/`to` take it: the timeline's own pattern.
fn time_point() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .pattern(Some(TIME_POINT_PATTERN))
        .build()
}

/// `downsample`'s spellings.
fn downsample_values() -> Object {
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(["true", "false", "1", "0"]))
        .build()
}

/// `scope`: whose timeline.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // documents the values the handler matches on
pub enum TimelineScope {
    /// This agent's.
    Node,
    /// Every node's of the job.
    Cluster,
}

/// `clock`: which clock the answer's timestamps are on.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // documents the values the handler matches on
pub enum TimelineClockName {
    /// The trace's own clock.
    Trace,
    /// Unix µs.
    Unix,
}

/// `view`: every thread and tensor, or per process counters.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // documents the values the handler matches on
pub enum TimelineView {
    /// Every thread and tensor.
    Full,
    /// Per process, counters.
    Overview,
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
pub(super) struct TimelineSlots {
    slots: Arc<Semaphore>,
    limits: TimelineLimits,
}

impl TimelineSlots {
    /// `limits.max_concurrent` slots (at least one).
    pub(super) fn new(limits: TimelineLimits) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(limits.max_concurrent.max(1))),
            limits,
        }
    }
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
fn detail_param(params: &TimelineParams) -> Result<Detail, ApiError> {
    let width = params.width.as_ref().map(|text| {
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
    let resolution = params.resolution.as_ref().map(|text| {
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

/// The timeline of a range, in the Chrome trace event format (Perfetto
/// and chrome://tracing open it).
#[utoipa::path(
    get,
    path = "/api/timeline",
    tag = "timeline",
    params(TimelineParams),
    responses(
        (status = 200, description = "a Chrome trace", body = ChromeTrace),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 404, description = "unknown job", body = ErrorBody),
        (status = 413, description = "too many events in the range: narrow it, or ask for downsample=true", body = ErrorBody),
        (status = 503, description = "no timeline source, or as many answers as the agent builds at once are being built or sent (then Retry-After says when to come back)",
            body = ErrorBody,
            headers(("Retry-After" = String, description = "seconds, when busy"))),
    )
)]
pub(super) async fn timeline(
    State(state): State<ApiState>,
    axum::Extension(slots): axum::Extension<TimelineSlots>,
    ApiQuery(params): ApiQuery<TimelineParams>,
) -> Result<Response, ApiError> {
    // Someone reads the timeline: jobs stream theirs now (--job-timeline).
    if let Some(jobs) = &state.jobs {
        jobs.note_timeline_read();
    }
    let point = |name: &str, value: &Option<String>| -> Result<Option<TimePoint>, ApiError> {
        value
            .as_ref()
            .map(|text| {
                TimePoint::parse(text)
                    .map_err(|e| ApiError::bad_request(format!("bad {name}: {e}")))
            })
            .transpose()
    };
    let query = TimelineQuery {
        from: point("from", &params.from)?,
        to: point("to", &params.to)?,
        job: params.job.clone(),
        pid: params.pid.clone(),
        downsample: match params.downsample.as_deref() {
            None | Some("0") | Some("false") => false,
            Some("1") | Some("true") => true,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "bad downsample: {other:?} (use true or false)"
                )));
            }
        },
        detail: detail_param(&params)?,
        view: match params.view.as_deref() {
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
    let limit = match &params.max_events {
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
    let clock = match params.clock.as_deref() {
        None | Some("trace") => TimelineClock::Trace,
        Some("unix") => TimelineClock::Unix,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "bad clock: {other:?} (trace: the trace's own clock; unix: Unix time in µs)"
            )));
        }
    };
    match params.scope.as_deref() {
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
    params: &TimelineParams,
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
        let forwarded = [
            ("pid", &params.pid),
            ("downsample", &params.downsample),
            ("width", &params.width),
            ("resolution", &params.resolution),
            ("view", &params.view),
        ];
        for (name, value) in forwarded {
            if let Some(value) = value {
                path.push_str(&format!("&{name}={}", query_value(value)));
            }
        }
        let points = [("from", query.from), ("to", query.to)];
        calls.spawn(async move {
            // One deadline for all of this peer's calls (its clock, then its
            // timeline): a slow peer costs the request one deadline.
            let deadline = std::time::Instant::now() + cluster_timeout(&cluster);
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
                        deadline
                            .saturating_duration_since(std::time::Instant::now())
                            .max(std::time::Duration::from_millis(1)),
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
