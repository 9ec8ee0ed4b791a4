//! `serve`: the long-running agent: the HTTP API (and, as the pipeline
//! grows, the probes and job discovery behind it) until SIGINT/SIGTERM.
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
use crate::timeline::RecordedTrace;

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
    let gpus = tokio::task::spawn_blocking(Gpus::init)
        .await
        .context("loading NVML")?;
    let state = ApiState {
        gpus: Arc::new(gpus),
        started: Instant::now(),
        recorded,
        timeline_event_limit: args.timeline_event_limit,
    };
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .with_context(|| {
            format!(
                "binding the API to {} (is another agent running?)",
                args.listen
            )
        })?;
    let local = listener.local_addr().context("reading the bound address")?;
    eprintln!("ringwatch-agent: serving the API on http://{local}/ (metrics at /metrics)");
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    axum::serve(listener, router(state))
        .with_graceful_shutdown(async move {
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = sigterm.recv() => {}
            }
            tracing::info!("shutting down");
        })
        .await
        .context("serving the API")
}
