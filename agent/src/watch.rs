//! `watch`: the one-shot command: watch given processes for a duration and
//! print their context switches (per process and thread), plus drops.
//!
//! It owns no state beyond one run; the long-running daemon reuses
//! `probes`/`events`/`model`, not this.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use aya::maps::{MapData, RingBuf};
use clap::Args;
use ebpf::Counter;
use serde::Serialize;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{SignalKind, signal};

use crate::events::decode;
use crate::model::{SwitchCounts, ThreadSwitches};
use crate::probes::Probes;

/// Which processes to watch, and for how long.
#[derive(Debug, Clone, Args)]
pub struct WatchArgs {
    /// Process to watch (all its threads); repeat for several.
    #[arg(
        long = "pid",
        value_name = "PID",
        env = "RINGWATCH_PID",
        value_delimiter = ','
    )]
    pub pids: Vec<u32>,

    /// How long to watch, e.g. `5s`, `1m30s`. Ends early when every watched
    /// process has exited; Ctrl-C ends it too. Without it, runs until Ctrl-C.
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
}

#[derive(Debug, Serialize)]
struct ProcessSummary {
    pid: u32,
    comm: String,
    #[serde(flatten)]
    total: ThreadSwitches,
    threads: Vec<ThreadSummary>,
}

#[derive(Debug, Serialize)]
struct ThreadSummary {
    tid: u32,
    comm: String,
    #[serde(flatten)]
    switches: ThreadSwitches,
}

/// Runs the command.
pub async fn run(args: WatchArgs) -> Result<()> {
    if args.pids.is_empty() {
        bail!("nothing to watch: give --pid PID (see --help)");
    }
    for &pid in &args.pids {
        if !process_exists(pid) {
            bail!("no process with pid {pid} (is it running, and in this PID namespace?)");
        }
    }
    let mut probes = Probes::load()?;
    let ring = probes.take_events()?;
    for &pid in &args.pids {
        probes.watch(pid)?;
    }
    // SAFETY: the RingBuf owns its map's file descriptor, which stays open and
    // unchanged until the RingBuf (inside the AsyncFd) is dropped.
    let mut ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
        .map_err(std::io::Error::from)
        .context("registering the ring buffer with tokio")?;
    let mut sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let started = Instant::now();
    eprintln!(
        "ringwatch-agent: watching pid {} {}",
        args.pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(","),
        args.duration.map_or_else(
            || "until Ctrl-C".to_owned(),
            |d| format!("for {}", humantime::format_duration(d))
        )
    );

    let deadline = args.duration.map(|d| tokio::time::Instant::now() + d);
    let mut exit_check = tokio::time::interval(Duration::from_millis(100));
    let mut counts = SwitchCounts::default();
    let mut undecodable = 0u64;
    let mut names = Names::default();
    let ended_because = loop {
        tokio::select! {
            () = sleep_until(deadline) => break "duration elapsed",
            _ = tokio::signal::ctrl_c() => break "interrupted",
            _ = sigterm.recv() => break "terminated",
            _ = exit_check.tick() => {
                if args.pids.iter().all(|&pid| !process_exists(pid)) {
                    break "every watched process exited";
                }
            }
            guard = ring.readable_mut() => {
                let mut guard = guard.context("waiting on the ring buffer")?;
                drain(guard.get_inner_mut(), &mut counts, &mut undecodable);
                guard.clear_ready();
                names.learn(&counts);
            }
        }
    };
    // Records already in the buffer belong to the window we report.
    drain(ring.get_mut(), &mut counts, &mut undecodable);
    names.learn(&counts);
    let duration = started.elapsed();
    for &pid in &args.pids {
        probes.unwatch(pid)?;
    }

    let summary = Summary {
        duration_s: duration.as_secs_f64(),
        ended_because,
        processes: args
            .pids
            .iter()
            .map(|&pid| summarize(pid, &counts, &names))
            .collect(),
        events: counts.events,
        undecodable_records: undecodable,
        ringbuf_drops: probes.counter(Counter::RingbufDrops)?,
    };
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

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

fn drain(ring: &mut RingBuf<MapData>, counts: &mut SwitchCounts, undecodable: &mut u64) {
    while let Some(item) = ring.next() {
        match decode(&item) {
            Ok(event) => counts.record(&event),
            Err(error) => {
                *undecodable += 1;
                tracing::warn!(%error, "skipping a ring-buffer record");
            }
        }
    }
}

/// Thread names, read from /proc while the threads live (they are gone by
/// the time a short-lived workload's summary is printed).
#[derive(Default)]
struct Names {
    threads: BTreeMap<(u32, u32), String>,
}

impl Names {
    fn learn(&mut self, counts: &SwitchCounts) {
        for (&pid, threads) in &counts.processes {
            for &tid in threads.keys() {
                self.threads
                    .entry((pid, tid))
                    .or_insert_with(|| read_comm(&format!("/proc/{pid}/task/{tid}/comm")));
            }
        }
    }

    fn get(&self, pid: u32, tid: u32) -> String {
        self.threads
            .get(&(pid, tid))
            .cloned()
            .unwrap_or_else(|| read_comm(&format!("/proc/{pid}/task/{tid}/comm")))
    }
}

fn summarize(pid: u32, counts: &SwitchCounts, names: &Names) -> ProcessSummary {
    let threads: BTreeMap<u32, ThreadSwitches> =
        counts.processes.get(&pid).cloned().unwrap_or_default();
    ProcessSummary {
        pid,
        comm: names.get(pid, pid),
        total: counts.process_total(pid),
        threads: threads
            .into_iter()
            .map(|(tid, switches)| ThreadSummary {
                tid,
                comm: names.get(pid, tid),
                switches,
            })
            .collect(),
    }
}

fn print_table(summary: &Summary) {
    println!(
        "watched for {:.2}s ({}); {} events, {} ring-buffer drops",
        summary.duration_s, summary.ended_because, summary.events, summary.ringbuf_drops
    );
    for process in &summary.processes {
        println!(
            "pid {} ({}): {} context switches out ({} preempted), {} in",
            process.pid,
            process.comm,
            process.total.switched_out,
            process.total.preempted,
            process.total.switched_in
        );
        println!(
            "  {:>8}  {:<16} {:>10} {:>10} {:>10}",
            "tid", "comm", "out", "preempted", "in"
        );
        for thread in &process.threads {
            println!(
                "  {:>8}  {:<16} {:>10} {:>10} {:>10}",
                thread.tid,
                thread.comm,
                thread.switches.switched_out,
                thread.switches.preempted,
                thread.switches.switched_in
            );
        }
    }
    if summary.undecodable_records > 0 {
        println!(
            "{} records could not be decoded (see the log)",
            summary.undecodable_records
        );
    }
}

fn process_exists(pid: u32) -> bool {
    // A zombie still has /proc/PID; its threads are gone, so treat it as exited.
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

fn read_comm(path: &str) -> String {
    std::fs::read_to_string(path)
        .map_or_else(|_| "(exited)".to_owned(), |s| s.trim_end().to_owned())
}
