//! `serve`: the long-running agent: the HTTP API, and behind it the eBPF
//! pipeline for the processes it is told to watch (`--pid/--comm/--cgroup`),
//! published once a second, until SIGINT/SIGTERM.
//!
//! It wires the parts together; it holds no logic of its own.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use tokio::signal::unix::{SignalKind, signal};

use crate::api::{ApiState, router};
use crate::gpu::Gpus;
use crate::live;
use crate::session::{Session, TargetArgs, monotonic_ns};
use crate::timeline::RecordedTrace;
use crate::tracks::CounterHistory;

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

    /// What to watch live (optional: without targets the API serves GPUs and
    /// --replay only).
    #[command(flatten)]
    pub targets: TargetArgs,
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
    let state = ApiState {
        gpus: gpus.clone(),
        started: Instant::now(),
        recorded,
        timeline_event_limit: args.timeline_event_limit,
        live: Arc::default(),
    };
    // Jobs found through control sockets are watched here only with --jobs
    // (the API's own default is to serve without loading eBPF).
    let has_targets = args.targets.watch_jobs(false)
        || args.targets.watch_gpu_processes(false)
        || !(args.targets.pids.is_empty()
            && args.targets.comm.is_empty()
            && args.targets.cgroup.is_empty());
    // TCP and GPU counter samples of the live window, once a second.
    let mut counters = CounterHistory::new(args.timeline_window.as_secs_f64() * 1e6);
    // Load the probes before serving, so a refusal (no privileges, another
    // agent) is reported before anyone can connect.
    let session = if has_targets {
        let session = Session::start(&args.targets, false)?;
        // Publish an (empty) view at once, so the API never answers "no
        // source" while the first second of events comes in.
        let now = monotonic_ns();
        state.publish(live::build(&session, &mut counters, &gpus, now, now, now)?);
        Some(session)
    } else {
        tracing::info!(
            "no --pid/--comm/--cgroup/--jobs: serving GPUs and --replay only, no live eBPF view"
        );
        None
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| format!("binding the API to {}", args.listen))?;
    let local = listener.local_addr().context("reading the bound address")?;
    let (shutdown_tx, shutdown_rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(state.clone());
    let server = tokio::spawn(async move {
        axum::serve(listener, app)
            .with_graceful_shutdown(async move {
                let _ = shutdown_rx.await;
            })
            .await
    });
    eprintln!("ringwatch-agent: serving the API on http://{local}/ (metrics at /metrics)");
    match session {
        Some(mut session) => {
            eprintln!("ringwatch-agent: watching {} (serve)", session.describe());
            let window_ns = u64::try_from(args.timeline_window.as_nanos()).unwrap_or(u64::MAX);
            let mut figures_from = monotonic_ns();
            loop {
                let until = tokio::time::Instant::now() + std::time::Duration::from_secs(1);
                if let Some(stop) = session.pump(until).await? {
                    tracing::info!(?stop, "shutting down");
                    break;
                }
                session.drain_now();
                session.refresh()?;
                let now = monotonic_ns();
                let view = live::build(
                    &session,
                    &mut counters,
                    &gpus,
                    now.saturating_sub(window_ns),
                    figures_from,
                    now,
                )?;
                state.publish(view);
                figures_from = now;
            }
            session.detach()?;
        }
        None => {
            let mut sigterm =
                signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = sigterm.recv() => {}
            }
            tracing::info!("shutting down");
        }
    }
    let _ = shutdown_tx.send(());
    server
        .await
        .context("the API server task failed")?
        .context("serving the API")
}
