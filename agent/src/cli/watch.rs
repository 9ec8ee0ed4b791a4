//! `watch`: the one-shot command: watch given processes for a duration and
//! print, per process and thread, context switches, on-CPU / run-queue /
//! off-CPU totals and histograms, TCP traffic and connections, NCCL calls,
//! plus every drop counter.
//!
//! It owns no state beyond one run; the long-running commands reuse
//! `session`/`model`, not this.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use clap::Args;
use serde::Serialize;

use crate::model::{Connection, ModelStats, NcclCall, ThreadSwitches, ThreadTotals};
use crate::probes::ThreadHistograms;
use crate::session::{Session, Stop, TargetArgs};
use crate::thread_store::ThreadStateStore;

/// Which processes to watch, and for how long.
#[derive(Debug, Clone, Args)]
pub struct WatchArgs {
    #[command(flatten)]
    pub targets: TargetArgs,

    /// How long to watch, e.g. `5s`, `1m30s`. Ends early when every watched
    /// process (given by --pid) has exited; Ctrl-C ends it too. Without it,
    /// runs until Ctrl-C.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,

    /// Print the result as one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// What one run saw, as printed with `--json`.
#[derive(Debug, Serialize)]
struct Summary {
    duration_s: f64,
    ended_because: &'static str,
    processes: Vec<ProcessSummary>,
    events: u64,
    undecodable_records: u64,
    ringbuf_drops: u64,
    kernel_counters: BTreeMap<String, u64>,
    /// Where the kernel kept thread state (task storage or the hash map).
    thread_state: ThreadStateStore,
    model: ModelStats,
}

#[derive(Debug, Serialize)]
struct ProcessSummary {
    pid: u32,
    comm: String,
    #[serde(flatten)]
    total: ThreadSwitches,
    sched: ThreadTotals,
    retransmits: u64,
    connections: Vec<Connection>,
    threads: Vec<ThreadSummary>,
}

#[derive(Debug, Serialize)]
struct ThreadSummary {
    tid: u32,
    comm: String,
    #[serde(flatten)]
    switches: ThreadSwitches,
    sched: ThreadTotals,
    histograms: ThreadHistograms,
    nccl_calls: Vec<NcclCall>,
}

/// How often `watch` rescans its targets.
const REFRESH_PERIOD: Duration = Duration::from_secs(1);

/// Runs the command.
pub async fn run(args: WatchArgs) -> Result<()> {
    let mut session = Session::start(&args.targets, args.targets.pids.is_empty(), true)?;
    let started = Instant::now();
    eprintln!(
        "ringwatch-agent: watching {} {}",
        session.describe(),
        args.duration.map_or_else(
            || "until Ctrl-C".to_owned(),
            |d| format!("for {}", humantime::format_duration(d))
        )
    );
    let deadline = args.duration.map(|d| tokio::time::Instant::now() + d);
    let mut seen: BTreeSet<u32> = session.watched().clone();
    // New targets are picked up every step; the rest of a refresh (walking the kernel's
    // hash maps, whose iteration visits every bucket, and each watched process's memory
    // maps for libnccl) runs once a second, as in `top` and `serve`: ten a second took
    // the agent to ~5% of a core on 2 cores, out of the watched job's time.
    let mut next_refresh = tokio::time::Instant::now() + REFRESH_PERIOD;
    let ended_because = loop {
        let step = tokio::time::Instant::now() + Duration::from_millis(100);
        let until = deadline.map_or(step, |d| d.min(step));
        match session.pump(until).await? {
            Some(Stop::Interrupted) => break "interrupted",
            Some(Stop::Terminated) => break "terminated",
            None => {}
        }
        if tokio::time::Instant::now() >= next_refresh {
            next_refresh = tokio::time::Instant::now() + REFRESH_PERIOD;
            session.refresh()?;
        } else {
            session.rescan()?;
        }
        seen.extend(session.watched().iter().copied());
        if deadline.is_some_and(|d| tokio::time::Instant::now() >= d) {
            break "duration elapsed";
        }
        if session.all_fixed_targets_exited() {
            break "every watched process exited";
        }
    };
    if ended_because == "every watched process exited" {
        // A leader is a zombie before its threads have all made their last
        // switch (a thread leaves /proc/PID/task a little before it): give
        // them a moment, so that their exit records are in the summary.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Records already in the buffer belong to the window we report; a
    // thread that made its last switch while the maps were read has left
    // its exit record since.
    session.drain_now();
    session.poll_maps();
    session.drain_now();
    let duration = started.elapsed();

    let mut processes = Vec::new();
    for pid in seen {
        processes.push(summarize(&session, pid));
    }
    let summary = Summary {
        duration_s: duration.as_secs_f64(),
        ended_because,
        processes,
        events: session.events,
        undecodable_records: session.undecodable,
        ringbuf_drops: session.probes().counter(ebpf::Counter::RingbufDrops)?,
        kernel_counters: session.probes().counters()?,
        thread_state: session.probes().thread_state_store(),
        model: session.model.stats(),
    };
    session.detach()?;
    if args.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&summary).context("serializing the summary")?
        );
    } else {
        print_table(&summary);
    }
    Ok(())
}

fn summarize(session: &Session, pid: u32) -> ProcessSummary {
    let model = &session.model;
    let switch_threads = model.switches.processes.get(&pid);
    let mut tids: BTreeSet<u32> = model.tids(pid).into_iter().collect();
    tids.extend(switch_threads.into_iter().flat_map(|t| t.keys().copied()));
    let histograms = session.probes().histograms(&tids);
    let connections = model.connections(Some(pid));
    ProcessSummary {
        pid,
        comm: session.thread_name(pid, pid),
        total: model.switches.process_total(pid),
        sched: model.process_totals(pid),
        retransmits: connections.iter().map(|c| c.retransmits).sum(),
        connections,
        threads: tids
            .into_iter()
            .map(|tid| ThreadSummary {
                tid,
                comm: session.thread_name(pid, tid),
                switches: switch_threads
                    .and_then(|t| t.get(&tid))
                    .copied()
                    .unwrap_or_default(),
                sched: model.thread_totals(tid).unwrap_or_default(),
                histograms: histograms.get(&tid).cloned().unwrap_or_default(),
                nccl_calls: model.nccl_calls(tid, 0, u64::MAX),
            })
            .collect(),
    }
}

fn ms(ns: u64) -> f64 {
    ns as f64 / 1e6
}

fn print_table(summary: &Summary) {
    println!(
        "watched for {:.2}s ({}); {} events, {} ring-buffer drops",
        summary.duration_s, summary.ended_because, summary.events, summary.ringbuf_drops
    );
    for process in &summary.processes {
        println!(
            "pid {} ({}): {} context switches out ({} preempted), {} in; tcp tx {} B rx {} B, {} retransmits",
            process.pid,
            process.comm,
            process.total.switched_out,
            process.total.preempted,
            process.total.switched_in,
            process.sched.tcp_tx_bytes,
            process.sched.tcp_rx_bytes,
            process.retransmits,
        );
        println!(
            "  {:>8}  {:<16} {:>8} {:>9} {:>8} {:>10} {:>10} {:>10} {:>10} {:>10} {:>6}",
            "tid",
            "comm",
            "out",
            "preempted",
            "in",
            "on-cpu ms",
            "runq ms",
            "off-cpu ms",
            "tx B",
            "rx B",
            "nccl"
        );
        for t in &process.threads {
            println!(
                "  {:>8}  {:<16} {:>8} {:>9} {:>8} {:>10.1} {:>10.1} {:>10.1} {:>10} {:>10} {:>6}",
                t.tid,
                t.comm,
                t.switches.switched_out,
                t.switches.preempted,
                t.switches.switched_in,
                ms(t.sched.on_cpu_ns),
                ms(t.sched.run_queue_ns),
                ms(t.sched.off_cpu_ns),
                t.sched.tcp_tx_bytes,
                t.sched.tcp_rx_bytes,
                t.sched.nccl_calls,
            );
        }
        for c in &process.connections {
            println!(
                "  tcp {} -> {}: tx {} B rx {} B, {} retransmits, srtt {} us, cwnd {}{}",
                c.local,
                c.remote,
                c.tx_bytes,
                c.rx_bytes,
                c.retransmits,
                c.srtt_us,
                c.cwnd,
                if c.closed_ns.is_some() {
                    " (closed)"
                } else {
                    ""
                }
            );
        }
    }
    for (name, value) in &summary.kernel_counters {
        if *value > 0 && name != "SchedSwitchSeen" {
            println!("kernel counter {name}: {value}");
        }
    }
    if summary.undecodable_records > 0 {
        println!(
            "{} records could not be decoded (see the log)",
            summary.undecodable_records
        );
    }
}
