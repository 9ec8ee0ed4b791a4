//! `serve`: the long-running agent: the HTTP API, and behind it the eBPF
//! pipeline for the processes it is told to watch (`--pid/--comm/--cgroup`,
//! and with `--jobs` the jobs found through control sockets), published
//! once a second, and the jobs' tuning sessions, until SIGINT/SIGTERM.
//! With `--jobs` only, the jobs registry and tuning also run without eBPF
//! (not root): the eBPF part then says what is missing and is skipped.
//!
//! It wires the parts together; it holds no logic of its own.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tokio::signal::unix::{SignalKind, signal};

use crate::api::{ApiState, Auth, router};
use crate::cluster::{Cluster, ClusterConfig};
use crate::gpu::Gpus;
use crate::http::{self, HttpLimits};
use crate::live;
use crate::nccl_profiler::NcclProfiler;
use crate::reports::{DEFAULT_REPORTS_DIR, Reports};
use crate::session::{Session, TargetArgs, monotonic_ns, start_jobs};
use crate::timeline::RecordedTrace;
use crate::tracks::CounterHistory;
use crate::tuning::{DisturbanceCheck, LoadFeed, TuningLimits, TuningSessions};

/// How often the eBPF figures tuning sessions judge windows by are copied
/// out of the model.
const FEED_PERIOD: std::time::Duration = std::time::Duration::from_millis(250);

/// How long `serve`'s model keeps scheduling intervals (its live view keeps
/// its own window of them): the feed's re-read and a second of figures, with
/// room to spare.
const SERVE_INTERVAL_RETENTION_NS: u64 = 15_000_000_000;

/// Where to serve.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// Address for the HTTP API, the UI and /metrics. Loopback by default;
    /// a DaemonSet sets 0.0.0.0:9477 for Prometheus to scrape. Port 0 picks
    /// a free port (printed on start).
    #[arg(long, env = "RINGWATCH_LISTEN", default_value = "127.0.0.1:9477")]
    pub listen: SocketAddr,

    /// Serve this recorded Chrome-trace file (a RINGWATCH_TIMELINE file, a
    /// Horovod timeline, a saved /api/timeline answer) at /api/timeline and
    /// in the UI.
    #[arg(long, value_name = "FILE")]
    pub replay: Option<std::path::PathBuf>,

    /// The most events one /api/timeline answer may carry; a larger range is
    /// refused (413) with a request to narrow it.
    #[arg(
        long,
        env = "RINGWATCH_TIMELINE_EVENT_LIMIT",
        default_value_t = 500_000
    )]
    pub timeline_event_limit: usize,

    /// How much recent timeline (thread states, NCCL calls, job activities,
    /// TCP and GPU counters) the live view keeps for /api/timeline, e.g. `60s`.
    #[arg(long, default_value = "60s", value_parser = humantime::parse_duration, env = "RINGWATCH_TIMELINE_WINDOW")]
    pub timeline_window: std::time::Duration,

    /// Memory the live window's thread states may take, in MiB; past it the
    /// oldest seconds go first (the window answered is then shorter than
    /// --timeline-window, and the log says so once).
    #[arg(long, default_value_t = 64, env = "RINGWATCH_TIMELINE_STATE_MIB", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub timeline_state_mib: u32,

    /// Where finished tuning sessions write their reports (CSV, Parquet,
    /// HTML, JSON). When it is not writable: `$XDG_STATE_HOME/ringwatch/reports`
    /// or `~/.local/state/ringwatch/reports` (logged).
    #[arg(long, value_name = "DIR", env = "RINGWATCH_REPORTS_DIR", default_value = DEFAULT_REPORTS_DIR)]
    pub reports_dir: std::path::PathBuf,

    /// A file holding the bearer token that POST/DELETE requests must send
    /// (`Authorization: Bearer TOKEN`); the token may also be given in
    /// RINGWATCH_API_TOKEN. Without a token, changes are allowed only when
    /// listening on loopback.
    #[arg(long, value_name = "FILE", env = "RINGWATCH_API_TOKEN_FILE")]
    pub token_file: Option<std::path::PathBuf>,

    /// Do not start tuning sessions on their own for jobs that ask for one
    /// (RINGWATCH_AUTOTUNE=1 on the job's side); they can still be started
    /// through the API.
    #[arg(long, env = "RINGWATCH_NO_AUTOTUNE")]
    pub no_autotune: bool,

    /// Most API connections open at once. At the cap the oldest connection
    /// that is not inside a request (idle, or still sending its headers) is
    /// closed to make room; when all are inside a request, new ones are refused.
    #[arg(long, env = "RINGWATCH_MAX_CONNECTIONS", default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_connections: u32,

    /// Time an API client has to send a request's headers (also how long an
    /// idle keep-alive connection stays open), e.g. `10s`.
    #[arg(long, default_value = "10s", value_parser = humantime::parse_duration, env = "RINGWATCH_HEADER_TIMEOUT")]
    pub header_timeout: std::time::Duration,

    /// Time from a request's headers to its answer, reading its body
    /// included; a slower request is answered 408, e.g. `30s`.
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration, env = "RINGWATCH_REQUEST_TIMEOUT")]
    pub request_timeout: std::time::Duration,

    /// The other agents of the cluster, `host:port,…`: job-wide answers
    /// (`/api/cluster/jobs`, `/api/timeline?scope=cluster`, tuning windows of
    /// multi-node jobs) ask them. Read-only calls, each with --peer-timeout.
    #[arg(
        long,
        env = "RINGWATCH_PEERS",
        value_delimiter = ',',
        value_name = "HOST:PORT"
    )]
    pub peers: Vec<String>,

    /// A DNS name that resolves to every agent (a headless Service), with
    /// the agents' port, e.g. `ringwatch-agents.ringwatch.svc.cluster.local:9477`;
    /// resolved again every 30 s. This agent's own address among them is
    /// recognised and skipped.
    #[arg(long, env = "RINGWATCH_PEERS_DNS", value_name = "NAME:PORT")]
    pub peers_dns: Option<String>,

    /// Deadline of one call to a peer, e.g. `2s`: a slower or dead peer makes
    /// a cluster answer partial (and named), never late.
    #[arg(long, default_value = "2s", value_parser = humantime::parse_duration, env = "RINGWATCH_PEER_TIMEOUT")]
    pub peer_timeout: std::time::Duration,

    /// With --jobs, do not open `<runtime-dir>/nccl-profiler.socket`, where
    /// the NCCL profiler plugin of a job (`NCCL_PROFILER_PLUGIN`) sends one
    /// record per collective.
    #[arg(long, env = "RINGWATCH_NO_NCCL_PROFILER")]
    pub no_nccl_profiler: bool,

    /// Where the NCCL profiler plugins' socket (`nccl-profiler.socket`) and
    /// the plugin library for jobs (`lib/libringwatch_nccl_profiler.so`)
    /// go. A job's plugin loaded from `<DIR>/lib/` finds the socket in
    /// `<DIR>` by itself. The DaemonSet uses a hostPath of its own
    /// (/run/ringwatch-nccl) that training pods mount read-only. Default:
    /// --runtime-dir.
    #[arg(long, value_name = "DIR", env = "RINGWATCH_NCCL_PROFILER_DIR")]
    pub nccl_profiler_dir: Option<std::path::PathBuf>,

    /// The NCCL profiler plugin library to publish in
    /// `<--nccl-profiler-dir>/lib/`. Default: the one beside the agent's
    /// binary, if there is one.
    #[arg(long, value_name = "FILE", env = "RINGWATCH_NCCL_PROFILER_LIB")]
    pub nccl_profiler_lib: Option<std::path::PathBuf>,

    /// What to watch live (optional: without targets the API serves GPUs and
    /// --replay only).
    #[command(flatten)]
    pub targets: TargetArgs,
}

/// Opens the NCCL profiler plugins' socket in the runtime directory and
/// publishes the plugin library beside it. A failure is logged, not fatal:
/// the agent serves on without the plugins' records.
fn start_nccl_profiler(args: &ServeArgs) -> Option<NcclProfiler> {
    let dir = args
        .nccl_profiler_dir
        .as_ref()
        .unwrap_or(&args.targets.runtime_dir);
    if !dir.exists() {
        use std::os::unix::fs::DirBuilderExt;
        if let Err(error) = std::fs::DirBuilder::new().mode(0o755).create(dir) {
            tracing::warn!(dir = %dir.display(), %error, "no NCCL profiler directory: the plugins' records are not received");
            return None;
        }
    }
    let store = NcclProfiler::default();
    let path = dir.join(crate::nccl_profiler::SOCKET_NAME);
    match store.listen(&path) {
        Ok(path) => tracing::info!(socket = %path.display(), "listening for NCCL profiler plugins"),
        Err(error) => {
            tracing::warn!(
                error = format!("{error:#}"),
                "no NCCL profiler socket: the plugins' records are not received"
            );
            return None;
        }
    }
    let lib = args.nccl_profiler_lib.clone().or_else(|| {
        let beside = std::env::current_exe()
            .ok()?
            .with_file_name(crate::nccl_profiler::LIBRARY_NAME);
        beside.is_file().then_some(beside)
    });
    match lib {
        Some(lib) => match crate::nccl_profiler::publish_library(&lib, dir) {
            Ok(at) => {
                tracing::info!(library = %at.display(), "the NCCL profiler plugin is published for jobs")
            }
            Err(error) => tracing::warn!(
                error = format!("{error:#}"),
                "the NCCL profiler plugin is not published"
            ),
        },
        None => tracing::debug!("no NCCL profiler plugin beside the agent to publish"),
    }
    Some(store)
}

/// Checks `host:port` peer addresses before anything starts.
fn check_peer_addr(flag: &str, addr: &str) -> Result<()> {
    let ok = addr
        .rsplit_once(':')
        .is_some_and(|(host, port)| !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0));
    if ok {
        Ok(())
    } else {
        anyhow::bail!("{flag} {addr:?}: expected HOST:PORT (e.g. node-1:9477)")
    }
}

/// Runs until SIGINT or SIGTERM.
pub async fn run(args: ServeArgs) -> Result<()> {
    let recorded = match &args.replay {
        Some(path) => {
            let trace = RecordedTrace::load(path)?;
            tracing::info!(events = trace.len(), path = %path.display(), "serving a recorded trace");
            Some(Arc::new(trace))
        }
        None => None,
    };
    let gpus = tokio::task::spawn_blocking(Gpus::shared)
        .await
        .context("loading NVML")?;
    let token = api_token(args.token_file.as_deref())?;
    // Jobs found through control sockets are watched here only with --jobs
    // (the API's own default is to serve without loading eBPF).
    let watch_jobs = args.targets.watch_jobs(false);
    let fixed_targets = !(args.targets.pids.is_empty()
        && args.targets.comm.is_empty()
        && args.targets.cgroup.is_empty());
    // GPU processes are watched beside the jobs (eBPF only, like the jobs'
    // ranks): without eBPF they are skipped with the rest of the live view.
    let watch_gpu_processes = args.targets.watch_gpu_processes(false);
    let jobs = if watch_jobs {
        Some(start_jobs(&args.targets)?)
    } else {
        None
    };
    // Load the probes before serving, so a refusal (no privileges, another
    // agent) is reported before anyone can connect. With --jobs alone the
    // agent goes on without them.
    let mut ebpf_off: Option<String> = None;
    let session = if !(watch_jobs || watch_gpu_processes || fixed_targets) {
        tracing::info!(
            "no --pid/--comm/--cgroup/--jobs: serving GPUs and --replay only, no live eBPF view"
        );
        None
    } else if !fixed_targets && !is_root() {
        let reason = "off: no eBPF (not root)".to_owned();
        tracing::warn!(
            "not root: no eBPF view (run as root, or with CAP_BPF and CAP_PERFMON, for thread \
             states, TCP figures and disturbance detection); jobs are listed and tuned without it"
        );
        ebpf_off = Some(reason);
        None
    } else {
        match Session::start_with_jobs(&args.targets, jobs.clone(), false) {
            Ok(session) => Some(session),
            Err(error) if !fixed_targets => {
                tracing::warn!(
                    error = format!("{error:#}"),
                    "no eBPF view; jobs are listed and tuned without it (no disturbance detection)"
                );
                ebpf_off = Some(format!("off: no eBPF ({error:#})"));
                None
            }
            Err(error) => return Err(error),
        }
    };
    let feed = Arc::new(LoadFeed::default());
    let tunings = match &jobs {
        Some(jobs) => {
            let reports = Reports::open(&args.reports_dir)?;
            tracing::info!(dir = %reports.dir().display(), "tuning reports go here");
            let disturbance = match &ebpf_off {
                None => DisturbanceCheck::Ebpf(feed.clone()),
                Some(reason) => {
                    tracing::info!(reason, "tuning sessions will not detect disturbed windows");
                    DisturbanceCheck::Off(reason.clone())
                }
            };
            let tunings = Arc::new(TuningSessions::new(
                jobs.clone(),
                reports,
                disturbance,
                TuningLimits::default(),
            ));
            if args.no_autotune {
                tracing::info!(
                    "--no-autotune: jobs that ask to be tuned are not tuned on their own"
                );
            } else {
                tunings.autotune().context("starting the autotune thread")?;
            }
            Some(tunings)
        }
        None => None,
    };
    for peer in &args.peers {
        check_peer_addr("--peers", peer)?;
    }
    if let Some(name) = &args.peers_dns {
        check_peer_addr("--peers-dns", name)?;
    }
    let cluster = Cluster::new(ClusterConfig {
        node_name: args.targets.node_name(),
        peers: args.peers.clone(),
        peers_dns: args.peers_dns.clone(),
        timeout: args.peer_timeout,
        // A peer's part of a cluster timeline: one answer's budget.
        max_timeline_bytes: 64 << 20,
    });
    if cluster.has_peers() {
        tracing::info!(node = cluster.node_name(), peers = ?args.peers, peers_dns = ?args.peers_dns, "cluster peers configured");
    }
    if let Some(tunings) = &tunings {
        tunings.set_cluster(cluster.clone(), tokio::runtime::Handle::current());
    }
    let nccl = if watch_jobs && !args.no_nccl_profiler {
        start_nccl_profiler(&args)
    } else {
        None
    };
    let state = ApiState {
        nccl: nccl.clone(),
        cluster: cluster.clone(),
        load_feed: (ebpf_off.is_none() && session.is_some()).then(|| feed.clone()),
        gpus: gpus.clone(),
        started: Instant::now(),
        recorded,
        timeline_event_limit: args.timeline_event_limit,
        live: Arc::default(),
        jobs: jobs.clone(),
        tunings,
        auth: Arc::new(Auth {
            token,
            loopback_only: args.listen.ip().is_loopback(),
        }),
    };
    // TCP and GPU counter samples of the live window, once a second.
    let mut counters = CounterHistory::new(args.timeline_window.as_secs_f64() * 1e6);
    let mut states = live::ThreadStates::with_budget(args.timeline_state_mib as usize * (1 << 20));
    if let Some(session) = &session {
        // Publish an (empty) view at once, so the API never answers "no
        // source" while the first second of events comes in.
        let now = monotonic_ns();
        let view = live::build(
            session,
            nccl.as_ref(),
            &mut states,
            &mut counters,
            &gpus,
            now,
            now,
            now,
        )?;
        state.publish(view);
    }
    match http::raise_open_file_limit() {
        Ok(files) if files < 2 * u64::from(args.max_connections) => tracing::warn!(
            open_files = files,
            max_connections = args.max_connections,
            "the open-file limit is low for --max-connections; raise it (ulimit -n) or lower the cap"
        ),
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "cannot raise the open-file limit"),
    }
    give_back_free_memory_periodically();
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the API to {}", args.listen))?;
    let local = listener.local_addr().context("reading the bound address")?;
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(state.clone());
    let limits = HttpLimits {
        max_connections: args.max_connections as usize,
        header_read_timeout: args.header_timeout,
        request_timeout: args.request_timeout,
    };
    let server = tokio::spawn(http::serve(
        listener,
        app,
        limits,
        Arc::default(),
        async move {
            let _ = shutdown_rx.await;
        },
    ));
    eprintln!("ringwatch-agent: serving the API on http://{local}/ (metrics at /metrics)");
    match session {
        Some(mut session) => {
            // The live view copies the thread states it shows into its own
            // window; the model needs only the last seconds (the per-second
            // figures and the tuning feed), not the whole retention.
            session
                .model
                .set_interval_retention(SERVE_INTERVAL_RETENTION_NS);
            eprintln!("ringwatch-agent: watching {} (serve)", session.describe());
            let window_ns = u64::try_from(args.timeline_window.as_nanos()).unwrap_or(u64::MAX);
            let mut figures_from = monotonic_ns();
            let mut said_window_short = false;
            let publish_period = std::time::Duration::from_secs(1);
            let mut next_publish = tokio::time::Instant::now() + publish_period;
            loop {
                // Tuning sessions read the job's run-queue waits from the
                // feed: copy them out often, so a window is judged soon
                // after it ends; the view itself is published once a second.
                let until = (tokio::time::Instant::now() + FEED_PERIOD).min(next_publish);
                if let Some(stop) = session.pump(until).await? {
                    tracing::info!(?stop, "shutting down");
                    break;
                }
                session.drain_now();
                if let Some(tunings) = &state.tunings {
                    let here = tunings.any_running();
                    if here || feed.asked(monotonic_ns()) {
                        // The run-queue time that stayed in the kernel
                        // (--min-interval) is in its thread states, read
                        // once a second otherwise.
                        if here {
                            session.poll_thread_states();
                        }
                        feed.record(&session);
                    } else {
                        feed.pause();
                    }
                }
                if tokio::time::Instant::now() < next_publish {
                    continue;
                }
                next_publish = tokio::time::Instant::now() + publish_period;
                session.refresh()?;
                let now = monotonic_ns();
                let view = live::build(
                    &session,
                    nccl.as_ref(),
                    &mut states,
                    &mut counters,
                    &gpus,
                    now.saturating_sub(window_ns),
                    figures_from,
                    now,
                )?;
                tracing::debug!(
                    took_ms = monotonic_ns().saturating_sub(now) / 1_000_000,
                    "built the live view"
                );
                state.publish(view);
                figures_from = now;
                if states.chunks_dropped > 0 && !said_window_short {
                    said_window_short = true;
                    tracing::warn!(
                        budget_mib = args.timeline_state_mib,
                        "the live window's thread states outgrew --timeline-state-mib: the \
                         oldest seconds are dropped, so the timeline covers less than \
                         --timeline-window"
                    );
                }
            }
            session.detach()?;
        }
        None => {
            if let Some(jobs) = &jobs {
                eprintln!(
                    "ringwatch-agent: watching jobs in {} without eBPF",
                    jobs_dirs(jobs)
                );
            }
            let mut sigterm =
                signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = sigterm.recv() => {}
            }
            tracing::info!("shutting down");
        }
    }
    if let Some(tunings) = state.tunings.clone() {
        // Running sessions end the way a stop request ends them: the best
        // knobs pinned, the claim released, the report written.
        tokio::task::spawn_blocking(move || tunings.stop_all(std::time::Duration::from_secs(15)))
            .await
            .context("stopping the tuning sessions")?;
    }
    let _ = shutdown_tx.send(());
    server.await.context("the API server task failed")
}

/// Every [`TRIM_PERIOD`], hands the allocator's free memory back to the
/// system, on a task of its own. glibc keeps what a burst freed (a flood of
/// timeline answers, a busy second's views) inside its heaps and arenas; RSS
/// then stays at the burst's peak although nothing uses it.
fn give_back_free_memory_periodically() {
    tokio::spawn(async {
        let mut tick = tokio::time::interval(TRIM_PERIOD);
        loop {
            tick.tick().await;
            #[cfg(target_env = "gnu")]
            // SAFETY: malloc_trim only releases free memory; no preconditions.
            unsafe {
                libc::malloc_trim(0);
            }
        }
    });
}

/// How often [`give_back_free_memory_periodically`] trims (a trim walks the
/// heap: a few ms).
const TRIM_PERIOD: std::time::Duration = std::time::Duration::from_secs(10);

/// The API token: the first line of `file` (`--token-file`), else
/// RINGWATCH_API_TOKEN; `None` when neither is given.
fn api_token(file: Option<&std::path::Path>) -> Result<Option<String>> {
    let token = match file {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading the API token file {}", path.display()))?;
            let token = text.lines().next().unwrap_or("").trim().to_owned();
            if token.is_empty() {
                anyhow::bail!(
                    "the API token file {} is empty; put the token on its first line",
                    path.display()
                );
            }
            Some(token)
        }
        None => std::env::var("RINGWATCH_API_TOKEN")
            .ok()
            .map(|t| t.trim().to_owned())
            .filter(|t| !t.is_empty()),
    };
    Ok(token)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn jobs_dirs(jobs: &crate::jobs::Jobs) -> String {
    jobs.runtime_dirs()
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ")
}
