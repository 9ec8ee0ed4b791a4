//! `top`: a terminal view for people without the UI, like the bcc tools:
//! per process and thread, CPU %, run-queue p50/p99, off-CPU %, TCP tx/rx
//! bytes/s, retransmits and NCCL calls/s over the last interval, refreshed
//! every interval; `--json` prints one JSON object per refresh.
//!
//! Read-only over the model: it never changes what is watched beyond the
//! session's discovery.

use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;

use crate::jobs::JobSnapshot;
use crate::model::ProcessSnapshot;
use crate::session::{Session, TargetArgs, monotonic_ns};

/// `ringwatch-agent top` options.
#[derive(Debug, Clone, Args)]
pub struct TopArgs {
    #[command(flatten)]
    pub targets: TargetArgs,

    /// Refresh period (and the window each figure covers).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub interval: Duration,

    /// Stop after this many refreshes (default: until Ctrl-C).
    #[arg(long)]
    pub iterations: Option<u64>,

    /// One JSON object per refresh instead of a table.
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Serialize)]
struct Frame<'a> {
    iteration: u64,
    window_s: f64,
    processes: &'a [ProcessSnapshot],
    /// Jobs found through control sockets (empty with `--no-jobs`).
    jobs: &'a [JobSnapshot],
    ringbuf_drops: u64,
    events: u64,
}

/// Runs the command.
pub async fn run(args: TopArgs) -> Result<()> {
    let mut session = Session::start(&args.targets, true, false)?;
    eprintln!("ringwatch-agent: watching {} (top)", session.describe());
    let mut iteration = 0u64;
    let mut window_start = monotonic_ns();
    loop {
        let until = tokio::time::Instant::now() + args.interval;
        if let Some(stop) = session.pump(until).await? {
            tracing::info!(?stop, "stopping");
            break;
        }
        session.drain_now();
        session.refresh()?;
        let now = monotonic_ns();
        let processes: Vec<ProcessSnapshot> = session
            .watched()
            .iter()
            .map(|&pid| session.model.process_snapshot(pid, window_start, now))
            .collect();
        let jobs = session.jobs().map(|j| j.jobs()).unwrap_or_default();
        iteration += 1;
        let drops = session.probes().counter(ebpf::Counter::RingbufDrops)?;
        let window_s = (now - window_start) as f64 / 1e9;
        if args.json {
            let frame = Frame {
                iteration,
                window_s,
                processes: &processes,
                jobs: &jobs,
                ringbuf_drops: drops,
                events: session.events,
            };
            println!(
                "{}",
                serde_json::to_string(&frame).context("serializing a frame")?
            );
        } else {
            print_frame(&session, &processes, &jobs, window_s, drops);
        }
        window_start = now;
        if args.iterations.is_some_and(|n| iteration >= n) {
            break;
        }
        if session.all_fixed_targets_exited() {
            break;
        }
    }
    session.detach()
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".to_owned(), |v| format!("{v:.0}"))
}

fn print_frame(
    session: &Session,
    processes: &[ProcessSnapshot],
    jobs: &[JobSnapshot],
    window_s: f64,
    drops: u64,
) {
    // Clear the screen like top(1) when writing to a terminal.
    use std::io::IsTerminal;
    if std::io::stdout().is_terminal() {
        print!("\x1b[2J\x1b[H");
    }
    println!(
        "ringwatch top: {:.1}s window, {} events, {} ring-buffer drops",
        window_s, session.events, drops
    );
    for job in jobs {
        let pids: Vec<String> = job.ranks.iter().map(|r| r.pid.to_string()).collect();
        let knobs = job.knobs.map_or_else(String::new, |k| {
            format!(
                ", cycle {}, fusion {} B, cycle time {} µs{}",
                job.cycle,
                k.fusion_threshold_bytes,
                k.cycle_time_us,
                if k.hierarchical_allreduce {
                    ", hierarchical"
                } else {
                    ""
                }
            )
        });
        println!(
            "job {} ({}, {:?}): {} ranks, pids {}{knobs}",
            job.job_id,
            job.kind.as_str(),
            job.state,
            job.world_size,
            pids.join(","),
        );
    }
    println!(
        "{:>8} {:>8} {:<16} {:>7} {:>9} {:>9} {:>8} {:>12} {:>12} {:>6} {:>8}",
        "pid",
        "tid",
        "comm",
        "cpu%",
        "runq p50",
        "runq p99",
        "off%",
        "tx B/s",
        "rx B/s",
        "retx",
        "nccl/s"
    );
    for p in processes {
        println!(
            "{:>8} {:>8} {:<16} {:>7.1} {:>9} {:>9} {:>8.1} {:>12.0} {:>12.0} {:>6} {:>8.1}",
            p.pid,
            "-",
            session.thread_name(p.pid, p.pid),
            p.cpu_pct,
            opt(p.run_queue_p50_us),
            opt(p.run_queue_p99_us),
            p.off_cpu_pct,
            p.tcp_tx_bytes_per_s,
            p.tcp_rx_bytes_per_s,
            p.retransmits_in_window,
            p.nccl_calls_per_s
        );
        for t in p.threads.iter().filter(|t| !t.exited) {
            println!(
                "{:>8} {:>8} {:<16} {:>7.1} {:>9} {:>9} {:>8.1} {:>12.0} {:>12.0} {:>6} {:>8.1}",
                "",
                t.tid,
                session.thread_name(p.pid, t.tid),
                t.cpu_pct,
                opt(t.run_queue_p50_us),
                opt(t.run_queue_p99_us),
                t.off_cpu_pct,
                t.tcp_tx_bytes_per_s,
                t.tcp_rx_bytes_per_s,
                "",
                t.nccl_calls_per_s
            );
        }
    }
    println!("(run-queue percentiles in µs)");
}
