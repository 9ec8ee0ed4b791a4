//! `api::node`: what this node's agent knows, read-only: liveness, GPUs,
//! jobs and watched processes, its clocks, the jobs of the cluster, and the
//! Prometheus exposition.
//!
//! Handlers only read shared state and format it; they never touch BPF or
//! a job, and never change anything.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use utoipa::{IntoParams, ToSchema};

use super::ApiState;
use super::extract::{ApiError, ApiQuery, ErrorBody, NoQuery};
use crate::jobs::{JobSnapshot, Jobs};
use crate::live::NamedProcess;
use crate::metrics::render_metrics;
use crate::nccl_profiler::{MatchedCollective, PluginCounters};

/// `GET /api/health`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// Always `ok`: the agent answers.
    status: HealthStatus,
    /// The agent's version.
    version: &'static str,
    /// Seconds since the agent started.
    uptime_s: f64,
    /// This node's name among its peers.
    node: String,
    /// This agent's id (it changes when the agent restarts).
    agent_id: String,
}

/// The one status `/api/health` answers.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum HealthStatus {
    /// Up.
    Ok,
}

/// Liveness and version.
#[utoipa::path(
    get,
    path = "/api/health",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "the agent is up", body = Health),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn health(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> axum::Json<Health> {
    axum::Json(Health {
        status: HealthStatus::Ok,
        version: env!("CARGO_PKG_VERSION"),
        uptime_s: state.started.elapsed().as_secs_f64(),
        node: state.cluster.node_name().to_owned(),
        agent_id: state.cluster.agent_id().to_owned(),
    })
}

/// `GET /api/gpus`'s answer: one reading per GPU, or why there are none.
#[derive(ToSchema)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct GpusAnswer {
    /// One reading per GPU; empty without a driver.
    #[schema(value_type = Vec<Object>)]
    gpus: Vec<Value>,
    /// Why there are no readings, when NVML is not usable here.
    unavailable_reason: Option<String>,
}

/// The node's NVIDIA GPUs (empty with a reason when there is no driver).
#[utoipa::path(
    get,
    path = "/api/gpus",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "a snapshot", body = GpusAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn gpus(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> Result<Response, ApiError> {
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

/// Where a list of jobs or processes comes from.
#[derive(Debug, Serialize, ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum Source {
    /// The live pipeline or the jobs' control sockets (absent: a recorded
    /// trace).
    Live,
}

/// Jobs as the registry or the live view has them, or as a recorded trace
/// names them.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum JobList {
    Live(Vec<JobSnapshot>),
    Recorded(Vec<Value>),
}

/// `GET /api/jobs`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct JobsAnswer {
    /// The jobs (ranks, pids).
    #[schema(value_type = Vec<Object>)]
    jobs: JobList,
    /// `live` unless the jobs come from a recorded trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    source: Option<Source>,
    /// This node's name, when the jobs come from control sockets.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    node: Option<String>,
    /// This agent's id, when the jobs come from control sockets.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    agent_id: Option<String>,
}

/// Jobs this agent knows (ranks, pids).
#[utoipa::path(
    get,
    path = "/api/jobs",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "the jobs", body = JobsAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn jobs(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> axum::Json<JobsAnswer> {
    if let Some(registry) = &state.jobs {
        let jobs = registry.jobs();
        if !jobs.is_empty() || state.recorded.is_none() {
            return axum::Json(JobsAnswer {
                jobs: JobList::Live(jobs),
                source: Some(Source::Live),
                node: Some(state.cluster.node_name().to_owned()),
                agent_id: Some(state.cluster.agent_id().to_owned()),
            });
        }
    }
    if let Some(live) = state.live_view()
        && !live.jobs.is_empty()
    {
        return axum::Json(JobsAnswer {
            jobs: JobList::Live(live.jobs.clone()),
            source: Some(Source::Live),
            node: None,
            agent_id: None,
        });
    }
    let jobs = state
        .recorded
        .as_ref()
        .map(|trace| trace.jobs())
        .unwrap_or_default();
    axum::Json(JobsAnswer {
        jobs: JobList::Recorded(jobs),
        source: None,
        node: None,
        agent_id: None,
    })
}

/// Processes as the live view has them, or as a recorded trace names them.
#[derive(Debug, Serialize)]
#[serde(untagged)]
enum ProcessList {
    Live(Vec<NamedProcess>),
    Recorded(Vec<Value>),
}

/// `GET /api/processes`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProcessesAnswer {
    /// The processes.
    #[schema(value_type = Vec<ProcessEntry>)]
    processes: ProcessList,
    /// `live` unless the processes come from a recorded trace.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(nullable = false)]
    source: Option<Source>,
}

/// A watched process (its other fields are the live view's).
#[derive(ToSchema)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct ProcessEntry {
    /// the container runtime's id, from the process's cgroup path; absent outside containers
    #[schema(nullable = false, pattern = "^[0-9a-f]{12,64}$")]
    container_id: Option<String>,
    /// the Kubernetes pod's uid, from the process's cgroup path; absent outside pods
    #[schema(
        nullable = false,
        format = "uuid",
        pattern = "^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$"
    )]
    pod_uid: Option<String>,
}

/// Processes this agent watches.
#[utoipa::path(
    get,
    path = "/api/processes",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "the processes", body = ProcessesAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn processes(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> axum::Json<ProcessesAnswer> {
    if let Some(live) = state.live_view() {
        return axum::Json(ProcessesAnswer {
            processes: ProcessList::Live(live.processes.clone()),
            source: Some(Source::Live),
        });
    }
    let processes = state
        .recorded
        .as_ref()
        .map(|trace| trace.processes())
        .unwrap_or_default();
    axum::Json(ProcessesAnswer {
        processes: ProcessList::Recorded(processes),
        source: None,
    })
}

/// `GET /api/clock`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct ClockAnswer {
    /// CLOCK_REALTIME, µs
    unix_us: f64,
    /// CLOCK_REALTIME − CLOCK_MONOTONIC, µs: maps the live timeline's clock to Unix time
    unix_minus_monotonic_us: i64,
    /// This node's name.
    node: String,
    /// This agent's id.
    agent_id: String,
}

/// This agent's clocks (for peers' clock-offset estimates).
#[utoipa::path(
    get,
    path = "/api/clock",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "the clocks", body = ClockAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn clock(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> axum::Json<ClockAnswer> {
    axum::Json(ClockAnswer {
        unix_us: crate::cluster::unix_now_us(),
        unix_minus_monotonic_us: crate::tracks::unix_minus_monotonic_us(),
        node: state.cluster.node_name().to_owned(),
        agent_id: state.cluster.agent_id().to_owned(),
    })
}

/// `GET /api/cluster/jobs`'s answer: every job, per host and node.
#[derive(ToSchema)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct ClusterJobsAnswer {
    /// This node's name.
    node: String,
    /// How many peers were asked.
    peers_asked: u64,
    /// Why the peers' DNS name did not resolve, when it did not.
    #[schema(nullable = false)]
    peers_dns_error: Option<String>,
    /// The peers that did not answer.
    missing_peers: Vec<MissingPeer>,
    /// Every job, with the nodes that speak for its hosts.
    jobs: Vec<ClusterJob>,
}

/// A peer that did not answer.
#[derive(ToSchema)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct MissingPeer {
    /// The peer's address.
    agent: String,
    /// Why it did not answer.
    error: String,
}

/// One job across the cluster.
#[derive(ToSchema)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct ClusterJob {
    /// The job's id.
    job_id: String,
    /// Every host of the job.
    hosts: Vec<String>,
    /// The nodes that speak for its hosts.
    nodes: Vec<ClusterJobNode>,
    /// Hosts no reachable agent speaks for.
    missing_hosts: Vec<String>,
    /// True when every host has an agent.
    complete: bool,
}

/// A node that speaks for one host of a job.
#[derive(ToSchema)]
#[allow(dead_code)] // the answer's shape, for the document only
pub struct ClusterJobNode {
    /// The node's name.
    node: String,
    /// Its agent's address (`self` for this one).
    agent: String,
    /// The host it speaks for.
    host: String,
    /// The job's ranks on it.
    #[schema(value_type = Vec<Object>)]
    ranks: Vec<Value>,
}

/// Every job this agent or its peers know, per job: which node speaks for
/// which host, and which hosts no reachable agent speaks for.
#[utoipa::path(
    get,
    path = "/api/cluster/jobs",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "the jobs", body = ClusterJobsAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn cluster_jobs(
    State(state): State<ApiState>,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> axum::Json<Value> {
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
    // Off the async workers: peers' answers may list many jobs and hosts.
    let node = state.cluster.node_name().to_owned();
    let peers_asked = answers.len();
    let mut merged =
        tokio::task::spawn_blocking(move || crate::cluster::merge_jobs(&node, &local, &answers))
            .await
            .unwrap_or_else(|e| serde_json::json!({ "error": format!("merging failed: {e}") }));
    merged["peers_asked"] = Value::from(peers_asked);
    if let Some(error) = state.cluster.dns_error() {
        merged["peers_dns_error"] = Value::from(error);
    }
    axum::Json(merged)
}

/// Prometheus / OpenMetrics exposition.
#[utoipa::path(
    get,
    path = "/metrics",
    tag = "node",
    params(NoQuery),
    responses(
        (status = 200, description = "metrics", content(
            (String = "text/plain"),
            (String = "application/openmetrics-text"),
        )),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn metrics(
    State(state): State<ApiState>,
    headers: HeaderMap,
    ApiQuery(NoQuery {}): ApiQuery<NoQuery>,
) -> Result<Response, ApiError> {
    let format = crate::metrics::Format::negotiate(
        headers.get(header::ACCEPT).and_then(|v| v.to_str().ok()),
    );
    let gpus = state.gpus.clone();
    let live = state.live_view();
    let jobs = state.jobs.as_ref().map(Jobs::jobs).unwrap_or_default();
    let sessions = state.tunings.as_ref().map(|t| t.all()).unwrap_or_default();
    let nccl = state
        .nccl
        .as_ref()
        .map(crate::nccl_profiler::NcclProfiler::totals)
        .unwrap_or_default();
    let text = tokio::task::spawn_blocking(move || {
        render_metrics(&gpus.snapshot(), live.as_deref(), &jobs, &sessions, &nccl)
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

/// `/api/nccl/collectives`'s query.
#[derive(Debug, Default, Deserialize, IntoParams)]
#[into_params(parameter_in = Query)]
pub struct NcclQuery {
    /// only this communicator: its hash as the records give it (16 hex digits)
    #[param(pattern = "^[0-9a-fA-F]{16}$", nullable = false)]
    pub comm: Option<String>,
    /// the most collectives answered, newest first: 1 to 1000 (default 100)
    #[param(pattern = "^([1-9][0-9]{0,2}|1000)$", nullable = false)]
    pub limit: Option<String>,
}

/// One process's NCCL profiler plugin.
#[derive(Debug, Serialize, ToSchema)]
pub struct NcclPlugin {
    /// The process (as the kernel names the socket's peer).
    pid: u32,
    /// The plugin version NCCL loaded (3 to 7).
    profiler: u8,
    /// What the plugin counted, as it last reported.
    counters: PluginCounters,
}

/// `GET /api/nccl/collectives`'s answer.
#[derive(Debug, Serialize, ToSchema)]
pub struct NcclAnswer {
    /// Whether this agent listens for plugins (`serve --jobs`, without
    /// `--no-nccl-profiler`).
    listening: bool,
    /// Plugin connections open now.
    connections: usize,
    /// Connections refused (at the cap) or closed for a malformed line.
    refused: u64,
    /// Lines that were not a record, counters or a hello.
    malformed: u64,
    /// The processes whose plugin reported.
    plugins: Vec<NcclPlugin>,
    /// The latest collectives, each with every local rank's record of it
    /// (matched by communicator, function and NCCL's sequence number).
    collectives: Vec<MatchedCollective>,
}

/// NCCL's collectives as the jobs' profiler plugins reported them
/// (`NCCL_PROFILER_PLUGIN`), matched across this node's ranks.
#[utoipa::path(
    get,
    path = "/api/nccl/collectives",
    tag = "node",
    params(NcclQuery),
    responses(
        (status = 200, description = "the collectives", body = NcclAnswer),
        (status = 400, description = "bad query", body = ErrorBody),
    )
)]
pub(super) async fn nccl_collectives(
    State(state): State<ApiState>,
    ApiQuery(query): ApiQuery<NcclQuery>,
) -> Result<axum::Json<NcclAnswer>, ApiError> {
    let limit = match query.limit.as_deref() {
        None => 100,
        Some(v) => match v.parse::<usize>() {
            Ok(n) if (1..=1000).contains(&n) => n,
            _ => {
                return Err(ApiError::bad_request(format!(
                    "limit {v:?}: expected a number from 1 to 1000"
                )));
            }
        },
    };
    if let Some(comm) = &query.comm
        && !(comm.len() == 16 && comm.bytes().all(|b| b.is_ascii_hexdigit()))
    {
        return Err(ApiError::bad_request(format!(
            "comm {comm:?}: expected a communicator hash of 16 hex digits"
        )));
    }
    let Some(nccl) = &state.nccl else {
        return Ok(axum::Json(NcclAnswer {
            listening: false,
            connections: 0,
            refused: 0,
            malformed: 0,
            plugins: Vec::new(),
            collectives: Vec::new(),
        }));
    };
    let comm = query.comm.map(|c| c.to_ascii_lowercase());
    let (connections, refused, malformed) = nccl.connection_counts();
    Ok(axum::Json(NcclAnswer {
        listening: true,
        connections,
        refused,
        malformed,
        plugins: nccl
            .totals()
            .into_iter()
            .map(|p| NcclPlugin {
                pid: p.pid,
                profiler: p.profiler,
                counters: p.counters,
            })
            .collect(),
        collectives: nccl.matched(comm.as_deref(), limit),
    }))
}
