//! `api::tuning`: tuning sessions and their reports (`serve --jobs`), and
//! what a job's ranks here went through in a window, for a peer tuning a
//! multi-node job.
//!
//! Starting and stopping a session needs [`Authorized`]; the sessions run
//! on their own threads (`crate::tuning`), never on the API's.

use std::sync::Arc;
use std::time::Instant;

use axum::extract::{Path, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::ApiState;
use super::auth::Authorized;
use super::extract::{ApiBody, ApiError, ApiPath, ApiQuery, ErrorBody, NoQuery};
use crate::reports::ReportFormat;
use crate::tuning::{KnobsOnStop, StartError, TuningRequest, TuningSessions};

/// `/api/jobs/{id}/load`'s query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct LoadParams {
    /// window start, Unix µs on this agent's clock
    #[param(required = true, nullable = false, pattern = "^(0|[1-9][0-9]{0,18})$")]
    pub from_unix_us: Option<String>,
    /// window end, Unix µs (not after from_unix_us: an empty window; more than 600 s after it: the last 600 s, clamped_to_last_s says so)
    #[param(required = true, nullable = false, pattern = "^(0|[1-9][0-9]{0,18})$")]
    pub to_unix_us: Option<String>,
}

/// `/api/jobs/{id}/load`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct LoadAnswer {
    /// Seconds the figures cover (about the window).
    span_s: f64,
    /// Per process.
    pids: Vec<PidLoad>,
    /// This node's name.
    node: String,
    /// The job's id.
    job_id: String,
    /// The host the job's ranks here are on.
    host: String,
    /// Set when the window was longer than the feed keeps: the seconds
    /// answered for, at its end.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    clamped_to_last_s: Option<u64>,
}

/// One process's load in a window (what peers read back as the tuner's
/// own per-process figures).
#[derive(Debug, Serialize, ToSchema)]
pub struct PidLoad {
    /// The process.
    pid: u32,
    /// Time its threads waited on the run queue, ns.
    run_queue_ns: u64,
    /// TCP segments it retransmitted.
    retransmits: u64,
}

/// `DELETE /api/jobs/{id}/tuning`'s query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct StopParams {
    /// the knobs the job is left on: the best found (default), or its starting ones
    #[param(value_type = Option<KeepName>, nullable = false, default = "best")]
    pub keep: Option<String>,
}

/// `keep`'s values.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // documents the values the handler matches on
pub enum KeepName {
    /// The best knobs found.
    Best,
    /// The job's starting knobs.
    Start,
}

/// `GET /api/reports/{id}`'s query.
#[derive(Debug, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ReportParams {
    /// the file's format
    #[param(value_type = Option<ReportFormatName>, nullable = false, default = "html")]
    pub format: Option<String>,
}

/// `format`'s values.
#[derive(ToSchema)]
#[schema(rename_all = "lowercase")]
#[allow(dead_code)] // documents the values the handler matches on
pub enum ReportFormatName {
    /// The HTML page.
    Html,
    /// The table of samples as CSV.
    Csv,
    /// The table of samples as Parquet.
    Parquet,
    /// The metadata.
    Json,
}

/// A Parquet table's bytes.
#[derive(ToSchema)]
#[schema(value_type = String, format = Binary)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct ParquetFile(Vec<u8>);

/// `GET /api/reports`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReportsAnswer {
    /// Newest first.
    reports: Vec<crate::reports::ListedReport>,
}

/// The longest window `/api/jobs/{id}/load` answers for.
const MAX_LOAD_WINDOW_US: u64 = 600_000_000;
/// How far past this node's clock a window may end (peers' clocks differ by less).
const MAX_FUTURE_US: u64 = 60_000_000;

/// `GET /api/jobs/{id}/load?from_unix_us=&to_unix_us=`: what the job's
/// ranks on this node went through in a window (run-queue waits, TCP
/// retransmits, from eBPF): what a peer tuning the job judges the window
/// by on this node. Waits (a little) until the figures cover the window.
#[utoipa::path(
    get,
    path = "/api/jobs/{id}/load",
    tag = "tuning",
    params(
        ("id" = String, Path, min_length = 1, description = "the job's id"),
        LoadParams,
    ),
    responses(
        (status = 200, description = "the load", body = LoadAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 404, description = "no such job on this node, or no eBPF figures for the window (it ends over 60 s after this node's clock; it began before this node's feed started: the feed records only while a tuning session runs here or for two minutes after a peer's ask, which this is; or records were lost in it)", body = ErrorBody),
        (status = 503, description = "no eBPF figures here (no eBPF, or no --jobs), or not yet up to the window's end (Retry-After)",
            body = ErrorBody,
            headers(("Retry-After" = String, description = "seconds"))),
    )
)]
pub(super) async fn job_load(
    State(state): State<ApiState>,
    Path(id): Path<String>,
    ApiQuery(params): ApiQuery<LoadParams>,
) -> Result<axum::Json<LoadAnswer>, ApiError> {
    let time = |name: &str, value: &Option<String>| -> Result<u64, ApiError> {
        let text = value
            .as_ref()
            .ok_or_else(|| ApiError::bad_request(format!("{name} is required (Unix µs)")))?;
        text.parse::<u64>()
            .ok()
            .filter(|n| n.to_string() == *text)
            .ok_or_else(|| ApiError::bad_request(format!("bad {name}: {text:?} (Unix µs, digits)")))
    };
    let (from, to) = (
        time("from_unix_us", &params.from_unix_us)?,
        time("to_unix_us", &params.to_unix_us)?,
    );
    // A window that ends later than the feed can reach while this request waits has no
    // figures (its client's clock is off by far more than peers' ever are): no waiting.
    let now_us = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    if to > now_us.saturating_add(MAX_FUTURE_US) {
        return Err(ApiError::new(
            StatusCode::NOT_FOUND,
            format!(
                "no eBPF figures for this window: it ends {} s after this node's clock (a \
                 window must have ended, or end within {} s)",
                (to - now_us) / 1_000_000,
                MAX_FUTURE_US / 1_000_000
            ),
        ));
    }
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
        return Ok(axum::Json(LoadAnswer {
            span_s: 0.0,
            pids: Vec::new(),
            node: state.cluster.node_name().to_owned(),
            job_id: id,
            host: job.host,
            clamped_to_last_s: None,
        }));
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
    // What the client asked for does not exist (it is the window, not the agent, that
    // lacks figures): not a server error.
    let load = feed.window(&pids, from, to).ok_or_else(|| {
        ApiError::new(
            StatusCode::NOT_FOUND,
            "no eBPF figures for this window (it began before what this node's feed keeps, \
             the last 30 s since it last started, or records were lost in it)",
        )
    })?;
    Ok(axum::Json(LoadAnswer {
        span_s: load.span_s,
        pids: load
            .pids
            .into_iter()
            .map(|p| PidLoad {
                pid: p.pid,
                run_queue_ns: p.run_queue_ns,
                retransmits: p.retransmits,
            })
            .collect(),
        node: state.cluster.node_name().to_owned(),
        job_id: id,
        host: job.host,
        clamped_to_last_s: clamped.then_some(MAX_LOAD_WINDOW_US / 1_000_000),
    }))
}

fn tunings(state: &ApiState) -> Result<&Arc<TuningSessions>, ApiError> {
    state.tunings.as_ref().ok_or_else(|| {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "this agent does not watch jobs, so it cannot tune them: start it with \
             `serve --jobs`",
        )
    })
}

/// Start a tuning session: claim the job's tuning, sample knobs with
/// Bayesian optimization, pin the best, write a report.
#[utoipa::path(
    post,
    path = "/api/jobs/{id}/tuning",
    tag = "tuning",
    params(
        ("id" = String, Path, min_length = 1, description = "the job's id"),
        NoQuery,
    ),
    request_body(content = Option<TuningRequest>, content_type = "application/json"),
    security(("bearer" = [])),
    responses(
        (status = 201, description = "started (the job's claim is held)", body = crate::tuning::SessionView),
        (status = 400, description = "bad body or configuration (ranges that the tuner refuses, e.g. lo above hi)", body = ErrorBody),
        (status = 401, description = "a token is configured and the request lacks it (or has a wrong one)", body = ErrorBody),
        (status = 403, description = "the agent listens beyond loopback and has no token configured", body = ErrorBody),
        (status = 404, description = "unknown job", body = ErrorBody),
        (status = 409, description = "a session already runs, the job is lost, or the job refused the claim", body = ErrorBody),
        (status = 413, description = "a body over 64 KiB", body = ErrorBody),
        (status = 503, description = "the job's socket cannot be used, or the agent does not watch jobs", body = ErrorBody),
    )
)]
pub(super) async fn tuning_post(
    State(state): State<ApiState>,
    ApiPath(job_id): ApiPath,
    _: Authorized,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
    ApiBody(body): ApiBody,
) -> Result<Response, ApiError> {
    let request: TuningRequest = if body.iter().all(u8::is_ascii_whitespace) {
        TuningRequest::default()
    } else {
        // `null` is no request, as the document's optional body says.
        serde_json::from_slice::<Option<Value>>(&body)
            .map(|value| value.map_or(Value::Object(Default::default()), integral_numbers))
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

/// The job's tuning session (running, or the last one).
#[utoipa::path(
    get,
    path = "/api/jobs/{id}/tuning",
    tag = "tuning",
    params(
        ("id" = String, Path, min_length = 1, description = "the job's id"),
        NoQuery,
    ),
    responses(
        (status = 200, description = "the session", body = crate::tuning::SessionView),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 404, description = "the job never had a session", body = ErrorBody),
        (status = 503, description = "the agent does not watch jobs (serve --jobs)", body = ErrorBody),
    )
)]
pub(super) async fn tuning_get(
    State(state): State<ApiState>,
    ApiPath(job_id): ApiPath,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> Result<Response, ApiError> {
    let view = tunings(&state)?
        .get(&job_id)
        .ok_or_else(|| no_session(&job_id))?;
    Ok(axum::Json(view).into_response())
}

/// Stop the running session; the job is left on the best knobs found (or
/// its starting knobs with keep=start).
#[utoipa::path(
    delete,
    path = "/api/jobs/{id}/tuning",
    tag = "tuning",
    params(
        ("id" = String, Path, min_length = 1, description = "the job's id"),
        StopParams,
    ),
    security(("bearer" = [])),
    responses(
        (status = 200, description = "the session (it ends within a moment)", body = crate::tuning::SessionView),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 401, description = "a token is configured and the request lacks it (or has a wrong one)", body = ErrorBody),
        (status = 403, description = "the agent listens beyond loopback and has no token configured", body = ErrorBody),
        (status = 404, description = "the job never had a session", body = ErrorBody),
    )
)]
pub(super) async fn tuning_delete(
    State(state): State<ApiState>,
    ApiPath(job_id): ApiPath,
    _: Authorized,
    ApiQuery(params): ApiQuery<StopParams>,
) -> Result<Response, ApiError> {
    let keep = match params.keep.as_deref() {
        None | Some("best") => KnobsOnStop::Best,
        Some("start") => KnobsOnStop::Start,
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

/// Tuning reports written by this agent, newest first.
#[utoipa::path(
    get,
    path = "/api/reports",
    tag = "tuning",
    params(NoQuery),
    responses(
        (status = 200, description = "the reports", body = ReportsAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 503, description = "the agent does not watch jobs (serve --jobs)", body = ErrorBody),
    )
)]
pub(super) async fn reports_list(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> Result<axum::Json<ReportsAnswer>, ApiError> {
    let tunings = tunings(&state)?.clone();
    let reports = tokio::task::spawn_blocking(move || tunings.reports().list())
        .await
        .map_err(|e| {
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("listing the reports failed: {e}"),
            )
        })?;
    Ok(axum::Json(ReportsAnswer { reports }))
}

/// One report's file.
#[utoipa::path(
    get,
    path = "/api/reports/{id}",
    tag = "tuning",
    params(
        ("id" = String, Path, min_length = 1, description = "the report's id"),
        ReportParams,
    ),
    responses(
        (status = 200, description = "the file", content(
            (String = "text/html"),
            (String = "text/csv"),
            (ParquetFile = "application/vnd.apache.parquet"),
            (Object = "application/json"),
        )),
        (status = 400, description = "bad query", body = ErrorBody),
        (status = 404, description = "no such report", body = ErrorBody),
        (status = 503, description = "the agent does not watch jobs (serve --jobs)", body = ErrorBody),
    )
)]
pub(super) async fn report_file(
    State(state): State<ApiState>,
    ApiPath(id): ApiPath,
    ApiQuery(params): ApiQuery<ReportParams>,
) -> Result<Response, ApiError> {
    let format = match &params.format {
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

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

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
