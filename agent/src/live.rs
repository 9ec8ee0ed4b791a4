//! `live`: what `serve` publishes from the running eBPF pipeline, once a
//! second: process figures for `/api/processes` and `/metrics`, and the
//! recent timeline (thread states and NCCL calls as Chrome-trace slices) for
//! `/api/timeline`.
//!
//! It reads the session's model and builds immutable snapshots; handlers
//! only ever see a finished snapshot, never the model itself.

use serde::Serialize;
use serde_json::{Value, json};

use crate::jobs::JobSnapshot;
use crate::model::{ProcessSnapshot, cause_name};
use crate::session::Session;
use crate::timeline::RecordedTrace;

/// One published view of the live pipeline.
#[derive(Debug)]
pub struct LiveView {
    /// Per watched process, over the last refresh period.
    pub processes: Vec<NamedProcess>,
    /// The last `timeline_window` of thread states and NCCL calls.
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

/// Builds the view of `[now - window, now]` (CLOCK_MONOTONIC ns).
pub fn build(
    session: &Session,
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
    for pid in pids {
        let name = session.thread_name(pid, pid);
        events.push(json!({ "ph": "M", "name": "process_name", "pid": pid, "args": { "name": format!("{name} (pid {pid})") } }));
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
    let timeline = RecordedTrace::from_events(events, Some(now_ns as f64 / 1e3), "live eBPF")?;
    Ok(LiveView {
        processes,
        timeline,
        ringbuf_drops: session.probes().counter(ebpf::Counter::RingbufDrops)?,
        jobs: session.jobs().map(|jobs| jobs.jobs()).unwrap_or_default(),
    })
}
