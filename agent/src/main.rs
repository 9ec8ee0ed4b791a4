//! `ringwatch-agent`: the node daemon of ringwatch.
//!
//! The pipeline runs one way, a folder per stage: `observe` (`discovery`
//! decides what to watch, `probes` loads and attaches BPF, `events` decodes
//! ring-buffer records into the bounded series of `model`; `session` wires
//! them, `lock` keeps one agent per node, `containers` names each process's
//! container and pod) → `jobs` (the jobs' control sockets, each speaking
//! for one host, their ranks mapped to host pids) → `cluster` (the other
//! agents: peers, clock offsets, job-wide merges) → `publish` (the live
//! view, timelines, metrics, GPUs) → `api` (HTTP); `tune` runs tuning
//! sessions over the jobs' control sockets and keeps their reports; `cli`
//! holds the commands (`serve`, `watch`, `top`). The agent only observes
//! and advises: it is never on a job's data path, and a job keeps running
//! if the agent dies.

// The folders follow the flow: observe (kernel -> model), jobs (control
// sockets -> registry), cluster (node -> cluster), publish (model ->
// answers), api (answers -> HTTP), tune (the advisor), cli (the commands).
mod api;
mod cli;
mod cluster;
mod jobs;
mod observe;
mod publish;
mod session;
mod tune;

// Each stage's modules by their own names (`crate::model`, `crate::live`, …).
use api::http;
use cli::{serve, top, watch};
use jobs::trust;
use observe::{
    containers, discovery, events, gpu, lock, model, nccl_profiler, probes, thread_store,
};
use publish::{live, lod, metrics, timeline, tracks};
use tune::{reports, tuning};

use anyhow::Result;
use clap::{Parser, Subcommand};

/// Watches the collective communication of training jobs on this node: CPU
/// scheduling and network traffic of their processes (eBPF), their GPUs
/// (NVML), and tunes their collective runtime's knobs.
///
/// Without a subcommand, counts what the given processes do for a while and
/// prints it (e.g. `ringwatch-agent --pid 1234 --duration 5s`).
///
/// Needs Linux >= 5.15 with BTF, and root or CAP_BPF + CAP_PERFMON.
#[derive(Debug, Parser)]
#[command(
    name = "ringwatch-agent",
    version,
    args_conflicts_with_subcommands = true
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,

    #[command(flatten)]
    watch: watch::WatchArgs,

    /// Log filter (tracing's EnvFilter syntax), e.g. `debug` or `agent=trace`.
    #[arg(long, env = "RINGWATCH_LOG", default_value = "info", global = true)]
    log: String,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Count context switches of the given processes for a while, then print
    /// them (what the agent does when no subcommand is given).
    Watch(watch::WatchArgs),
    /// Live per-process and per-thread view (CPU %, run-queue p50/p99,
    /// off-CPU %, TCP bytes/s, retransmits, NCCL calls/s), refreshed every
    /// second.
    Top(top::TopArgs),
    /// Print this node's NVIDIA GPUs as NVML reports them (or why there are
    /// none), as JSON.
    Gpus,
    /// Run as the node daemon: serve the HTTP API, the timeline viewer and
    /// Prometheus metrics until SIGINT/SIGTERM.
    Serve(Box<serve::ServeArgs>),
    /// Tune a job's collective knobs through a running agent (`serve
    /// --jobs`): start a session and print each sample as it comes, then the
    /// chosen knobs, the speedup over the start and the report. Ctrl-C stops
    /// the session (the job stays on the best knobs found). `--status` and
    /// `--stop` show or stop a session.
    Tune(tune::cli::TuneArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    init_tracing(&cli.log);
    let result: Result<()> = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .map_err(anyhow::Error::from)
        .and_then(|runtime| {
            runtime.block_on(async move {
                match cli.command {
                    Some(Command::Watch(args)) => watch::run(args).await,
                    Some(Command::Top(args)) => top::run(args).await,
                    Some(Command::Gpus) => print_gpus(),
                    Some(Command::Serve(args)) => serve::run(*args).await,
                    Some(Command::Tune(args)) => tune::cli::run(args).await,
                    None => watch::run(cli.watch).await,
                }
            })
        });
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("ringwatch-agent: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn print_gpus() -> Result<()> {
    let snapshot = gpu::Gpus::init().snapshot();
    println!("{}", serde_json::to_string_pretty(&snapshot)?);
    Ok(())
}

fn init_tracing(filter: &str) {
    // aya warns at every load that it has no type for our task-storage map
    // (`task_state`, read by hand in thread_store), which is not news to a
    // user; a filter that names aya decides for itself.
    let quiet_aya = |filter: &str| {
        if filter.contains("aya") {
            filter.to_owned()
        } else {
            format!("{filter},aya::bpf=error")
        }
    };
    let filter = tracing_subscriber::EnvFilter::try_new(quiet_aya(filter)).unwrap_or_else(|e| {
        eprintln!("ringwatch-agent: ignoring bad --log filter {filter:?} ({e}); using `info`");
        tracing_subscriber::EnvFilter::new(quiet_aya("info"))
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
}

/// `docs/reference/cli/ringwatch-agent.md`, rendered from the clap
/// definitions above (`cargo xtask reference` writes it).
#[cfg(test)]
#[path = "../../xtask/src/cli_reference.rs"]
mod cli_reference;

#[cfg(test)]
mod reference {
    use super::cli_reference;
    #[test]
    fn reference_ringwatch_agent_cli_is_current() {
        let page = cli_reference::render_cli(
            &<super::Cli as clap::CommandFactory>::command(),
            "ringwatch-agent",
        );
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../docs/reference/cli/ringwatch-agent.md"
        );
        cli_reference::check_page(std::path::Path::new(path), &page);
    }
}
