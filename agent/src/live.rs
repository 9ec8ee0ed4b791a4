//! `live`: what `serve` publishes from the running eBPF pipeline, once a
//! second: process figures for `/api/processes` and `/metrics`, and the
//! recent timeline for `/api/timeline`: thread states and NCCL calls as
//! Chrome-trace slices, the jobs' own activities grouped job → rank, and
//! counter tracks (TCP per connection, GPUs; see `tracks`), all on one clock
//! (CLOCK_MONOTONIC µs).
//!
//! It reads the session's model and builds immutable snapshots; handlers
//! only ever see a finished snapshot, never the model itself.

use serde::Serialize;
use serde_json::{Value, json};

use crate::gpu::Gpus;
use crate::jobs::JobSnapshot;
use crate::model::{ProcessSnapshot, cause_name};
use crate::session::Session;
use crate::timeline::RecordedTrace;
use crate::tracks::{self, CounterHistory};

/// One published view of the live pipeline.
#[derive(Debug)]
pub struct LiveView {
    /// Per watched process, over the last refresh period.
    pub processes: Vec<NamedProcess>,
    /// The last `timeline_window` of thread states, NCCL calls, job
    /// activities and counters.
    pub timeline: RecordedTrace,
    /// Records the kernel could not deliver (ring buffer full), since start.
    pub ringbuf_drops: u64,
    /// Jobs found through control sockets (with `--jobs`).
    pub jobs: Vec<JobSnapshot>,
}

/// A process snapshot with its name.
#[derive(Debug, Clone, Serialize)]
pub struct NamedProcess {
    /// The process's `comm`.
    pub name: String,
    /// Its figures.
    #[serde(flatten)]
    pub snapshot: ProcessSnapshot,
}

/// Chrome-trace name of an interval, as the viewer colours them: `running`,
/// `runnable` (waiting on the run queue) and `blocked`.
fn state_name(kind: ebpf::IntervalKind) -> &'static str {
    match kind {
        ebpf::IntervalKind::OnCpu => "running",
        ebpf::IntervalKind::RunQueue => "runnable",
        ebpf::IntervalKind::OffCpu => "blocked",
    }
}

/// Builds the view of `[now - window, now]` (CLOCK_MONOTONIC ns), after
/// adding this moment's counter sample (TCP connections, `gpus`) to
/// `counters`.
pub fn build(
    session: &Session,
    counters: &mut CounterHistory,
    gpus: &Gpus,
    window_start_ns: u64,
    figures_from_ns: u64,
    now_ns: u64,
) -> anyhow::Result<LiveView> {
    let model = &session.model;
    let mut events: Vec<Value> = Vec::new();
    let mut processes = Vec::new();
    // Processes that exited stay on the timeline until the model's
    // retention forgets them.
    let mut pids: std::collections::BTreeSet<u32> = model.pids().into_iter().collect();
    pids.extend(session.watched().iter().copied());
    let jobs = session.jobs().map(|jobs| jobs.jobs()).unwrap_or_default();
    // A job's rank is local when it runs on this host under a pid we watch
    // (or saw) here.
    let host = crate::jobs::host_name();
    let here = tracks::Here {
        host: &host,
        pids: &pids,
    };
    let job_ranks: Vec<tracks::JobRanks<'_>> = jobs.iter().map(Into::into).collect();
    let local_ranks = tracks::local_ranks(&job_ranks, &here);
    for &pid in &pids {
        let name = session.thread_name(pid, pid);
        let mut args = json!({ "name": format!("{name} (pid {pid})") });
        if let Some((job, rank)) = local_ranks.get(&pid) {
            args["job"] = json!(job);
            args["rank"] = json!(rank);
        }
        events.push(json!({ "ph": "M", "name": "process_name", "pid": pid, "args": args }));
        for tid in model.tids(pid) {
            events.push(json!({ "ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": { "name": session.thread_name(pid, tid) } }));
            for interval in model.intervals(tid, window_start_ns, now_ns) {
                events.push(json!({
                    "ph": "X", "cat": "thread_state", "name": state_name(interval.kind),
                    "pid": pid, "tid": tid,
                    "ts": interval.start_ns as f64 / 1e3, "dur": interval.duration_ns as f64 / 1e3,
                    "args": { "cause": cause_name(interval.cause) },
                }));
            }
            for call in model.nccl_calls(tid, window_start_ns, now_ns) {
                events.push(json!({
                    "ph": "X", "cat": "nccl", "name": call.func, "pid": pid, "tid": tid,
                    "ts": call.entry_ns as f64 / 1e3,
                    "dur": call.return_ns.saturating_sub(call.entry_ns) as f64 / 1e3,
                    "args": { "count": call.count, "datatype": call.datatype, "op": call.op, "result": call.result },
                }));
            }
        }
        processes.push(NamedProcess {
            name,
            snapshot: model.process_snapshot(pid, figures_from_ns, now_ns),
        });
    }
    let now_us = now_ns as f64 / 1e3;
    let window_start_us = window_start_ns as f64 / 1e3;
    if let Some(registry) = session.jobs() {
        let offset_us = tracks::unix_minus_monotonic_us();
        // Also a window before the start, to find the begin of a slice that
        // ends inside it.
        let span_us = now_ns.saturating_sub(window_start_ns) / 1_000;
        let from_unix = (window_start_ns / 1_000)
            .saturating_sub(span_us)
            .saturating_add_signed(offset_us);
        let to_unix = (now_ns / 1_000).saturating_add_signed(offset_us) + 1;
        for job in &jobs {
            let kept = registry
                .timeline_events(&job.job_id, from_unix, to_unix)
                .unwrap_or_default();
            events.extend(tracks::job_activities(
                job.into(),
                &kept,
                &here,
                offset_us,
                window_start_us,
                now_us,
            ));
        }
    }
    counters.sample(now_us, &model.connections(None), &gpus.snapshot());
    events.extend(counters.events().cloned());
    let timeline = RecordedTrace::from_events(events, Some(now_us), "live eBPF")?;
    Ok(LiveView {
        processes,
        timeline,
        ringbuf_drops: session.probes().counter(ebpf::Counter::RingbufDrops)?,
        jobs,
    })
}
