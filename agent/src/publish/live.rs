//! `live`: what `serve` publishes from the running eBPF pipeline, once a
//! second: process figures for `/api/processes` and `/metrics`, and the
//! recent timeline for `/api/timeline`: thread states and NCCL calls as
//! Chrome-trace slices, the jobs' own activities grouped job → rank, and
//! counter tracks (TCP per connection, GPUs; see `tracks`), all on one clock
//! (CLOCK_MONOTONIC µs).
//!
//! It reads the session's model and builds immutable snapshots; handlers
//! only ever see a finished snapshot, never the model itself.
//!
//! Thread states are by far the most numerous events (tens of thousands a
//! second for a busy job), so they are not turned into JSON once a second
//! for the whole window: each build copies only the intervals that ended
//! since the previous one into a shared chunk ([`ThreadStates`]), and a
//! query builds JSON for the slices it answers with only
//! ([`LiveView::query`]). Building a view costs what arrived in the last
//! second, not the window; the pump loop (and the ring buffer) never waits
//! on a long build.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use serde::Serialize;
use serde_json::{Value, json};

use crate::containers::{self, Container};
use crate::gpu::Gpus;
use crate::jobs::JobSnapshot;
use crate::lod::{self, SummaryEvent};
use crate::model::Interval;
use crate::model::{ProcessSnapshot, cause_name};
use crate::nccl_profiler::{COMMS_PER_PROCESS, NcclProfiler};
use crate::session::Session;
use crate::timeline::{
    AnswerLimits, QueryError, RecordedTrace, TimelineQuery, TraceAnswer, TraceWriter, View,
    downsample_note,
};
use crate::tracks::{self, CounterHistory};

/// One published view of the live pipeline.
#[derive(Debug)]
pub struct LiveView {
    /// Per watched process, over the last refresh period.
    pub processes: Vec<NamedProcess>,
    /// The last `timeline_window` of NCCL calls, job activities, counters
    /// and the process and thread names (thread states are in `states`).
    pub timeline: RecordedTrace,
    /// The thread states of the window, in chunks shared with later views.
    pub states: Vec<Arc<StateChunk>>,
    /// The jobs' activities of the window (their names are in `timeline`).
    pub job_activities: Vec<tracks::JobActivity>,
    /// Records the kernel could not deliver (ring buffer full), since start.
    pub ringbuf_drops: u64,
    /// Scheduling intervals whose record reached the agent after this view
    /// had published their time (not on the live timeline), since start.
    pub intervals_late: u64,
    /// Jobs found through control sockets (with `--jobs`).
    pub jobs: Vec<JobSnapshot>,
    /// Scheduling intervals shorter than this are not on the timeline
    /// (`--min-interval`), ns.
    pub min_interval_ns: u64,
}

/// A process snapshot with its name and container.
#[derive(Debug, Clone, Serialize)]
pub struct NamedProcess {
    /// The process's `comm`.
    pub name: String,
    /// Its container id and pod uid, where its cgroup names them
    /// (`container_id`, `pod_uid`; absent when unknown).
    #[serde(flatten)]
    pub container: Container,
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

/// One thread-state slice, as the model recorded it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StateSlice {
    /// Process.
    pub pid: u32,
    /// Thread.
    pub tid: u32,
    /// The interval.
    pub interval: Interval,
}

impl StateSlice {
    fn start_us(&self) -> f64 {
        self.interval.start_ns as f64 / 1e3
    }

    fn duration_us(&self) -> f64 {
        self.interval.duration_ns as f64 / 1e3
    }

    /// The slice as a Chrome-trace event, serialized as it is written (no
    /// `Value` per slice).
    fn to_event(self) -> StateEvent {
        StateEvent {
            ph: "X",
            cat: "thread_state",
            name: state_name(self.interval.kind),
            pid: self.pid,
            tid: self.tid,
            ts: self.start_us(),
            dur: self.duration_us(),
            args: StateArgs {
                cause: cause_name(self.interval.cause),
            },
        }
    }
}

/// A thread-state slice as a Chrome-trace event.
#[derive(Debug, Serialize)]
struct StateEvent {
    ph: &'static str,
    cat: &'static str,
    name: &'static str,
    pid: u32,
    tid: u32,
    ts: f64,
    dur: f64,
    args: StateArgs,
}

/// Its `args`.
#[derive(Debug, Serialize)]
struct StateArgs {
    cause: &'static str,
}

/// Thread states that ended within one build period.
#[derive(Debug, Default)]
pub struct StateChunk {
    /// Every slice here ended before this (CLOCK_MONOTONIC ns).
    pub until_ns: u64,
    /// The slices.
    pub slices: Vec<StateSlice>,
}

/// The live window's thread states, kept across builds: each build adds the
/// intervals that ended since the previous one (except the last
/// [`ThreadStates::LAG_NS`], whose records may still be on their way out of
/// the kernel) and forgets chunks that fell out of the window.
///
/// It also keeps, across builds, the container of each process shown (read
/// from /proc once per process, not once per build; see
/// [`containers::Cache`]).
#[derive(Debug)]
pub struct ThreadStates {
    chunks: VecDeque<Arc<StateChunk>>,
    cursor_ns: Option<u64>,
    /// Slices kept over all chunks; past it the oldest chunks go, and the
    /// window the view answers for is shorter than `--timeline-window`.
    max_slices: usize,
    /// Slices in `chunks`.
    slices: usize,
    /// Chunks dropped for memory before they left the window.
    pub chunks_dropped: u64,
    /// The containers of the processes shown.
    containers: containers::Cache,
}

impl Default for ThreadStates {
    fn default() -> Self {
        Self::with_budget(usize::MAX)
    }
}

impl ThreadStates {
    /// Keeps at most `bytes` of thread states.
    pub fn with_budget(bytes: usize) -> Self {
        Self {
            chunks: VecDeque::new(),
            cursor_ns: None,
            max_slices: (bytes / std::mem::size_of::<StateSlice>()).max(1),
            slices: 0,
            chunks_dropped: 0,
            containers: containers::Cache::default(),
        }
    }

    /// Intervals ending this close to "now" wait for the next build: their
    /// records may not have been read yet. (An off-CPU interval leaves the
    /// kernel with its thread's next switch in, after the run-queue wait
    /// that follows it: one longer than this misses its build.)
    pub const LAG_NS: u64 = 250_000_000;

    /// Adds the intervals of `pids`' threads that ended in
    /// `[previous cut, now - LAG)`, and drops chunks that ended before
    /// `window_start_ns`.
    fn update(
        &mut self,
        model: &crate::model::Model,
        pids: &std::collections::BTreeSet<u32>,
        window_start_ns: u64,
        now_ns: u64,
    ) {
        let cut = now_ns.saturating_sub(Self::LAG_NS);
        let from = self.cursor_ns.unwrap_or(window_start_ns);
        if cut > from {
            let mut slices = Vec::new();
            for &pid in pids {
                for tid in model.tids(pid) {
                    // Newest first from the model; kept oldest first, so
                    // that a thread's slices are in time order over the
                    // chunks (the level of detail walks them so).
                    let ended = model.intervals_ended_since(tid, from);
                    slices.extend(
                        ended
                            .into_iter()
                            .rev()
                            .filter(|i| i.start_ns + i.duration_ns < cut)
                            .map(|interval| StateSlice { pid, tid, interval }),
                    );
                }
            }
            self.push(StateChunk {
                until_ns: cut,
                slices,
            });
            self.cursor_ns = Some(cut);
            model.published_until(cut);
        }
        self.trim(window_start_ns);
    }

    /// Adds the newest chunk.
    fn push(&mut self, mut chunk: StateChunk) {
        // Kept for a whole window: no spare capacity.
        chunk.slices.shrink_to_fit();
        self.slices += chunk.slices.len();
        self.chunks.push_back(Arc::new(chunk));
    }

    /// Drops the chunks that ended before `window_start_ns`, and the oldest
    /// ones while over the budget.
    fn trim(&mut self, window_start_ns: u64) {
        while let Some(oldest) = self.chunks.front() {
            let expired = oldest.until_ns < window_start_ns;
            // The newest chunk stays even alone over the budget.
            let over = self.slices > self.max_slices && self.chunks.len() > 1;
            if !(expired || over) {
                break;
            }
            if !expired {
                self.chunks_dropped += 1;
            }
            self.slices -= oldest.slices.len();
            self.chunks.pop_front();
        }
    }
}

impl LiveView {
    /// `GET /api/timeline` on the live view: the trace's events (NCCL calls,
    /// job activities, counters, names) and the thread states of the range;
    /// at a level of detail (`query.detail`) the slices shorter than a pixel
    /// merged per track into summaries (see [`lod`]). At most
    /// `limits.max_events` events; over it, refused, or with `downsample`
    /// the longest thread states are kept (as [`RecordedTrace::query`]
    /// does). Written straight to JSON up to `limits.max_bytes` (see
    /// [`TraceWriter`]).
    pub fn query(
        &self,
        query: &TimelineQuery,
        limits: AnswerLimits,
    ) -> Result<TraceAnswer, QueryError> {
        let mut selection = self.timeline.select(query)?;
        // A job's tensor events exist only from when it was asked for them
        // (--job-timeline on-demand): say so, so that an empty past is not
        // read as an idle job.
        if let Some(job) = query
            .job
            .as_ref()
            .and_then(|id| self.jobs.iter().find(|j| &j.job_id == id))
        {
            selection.note(
                "job_timeline",
                json!({
                    "streaming_since_unix_ms": job.timeline_streaming_since_unix_ms,
                    "note": "the job streams its tensor events while someone reads its timeline \
                             (agent --job-timeline); they start at streaming_since_unix_ms \
                             (null: not streaming yet)",
                }),
            );
        }
        if self.min_interval_ns > 0 {
            selection.note(
                "thread_states",
                json!({
                    "min_interval_us": self.min_interval_ns as f64 / 1e3,
                    "note": "scheduling intervals shorter than min_interval_us are not on the \
                             timeline (agent --min-interval); the CPU, off-CPU and run-queue \
                             figures and the totals count them",
                }),
            );
        }
        let mut activities: Vec<&tracks::JobActivity> = match selection.window {
            None => Vec::new(),
            Some((from, to)) => self
                .job_activities
                .iter()
                .filter(|a| a.ts <= to && a.end_us() >= from)
                .filter(|a| self.timeline.wanted_pid(query, &a.pid.key()))
                .collect(),
        };
        // Which pids the query wants, decided once per pid, not per slice.
        let mut wanted: HashMap<u32, bool> = HashMap::new();
        // The overview counts the states where they lie (millions in a
        // minute of a busy job), without copying them first.
        let mut overview = match (query.view, selection.pixel_us, selection.span) {
            (View::Overview, Some(pixel_us), Some((from, to))) => {
                Some(lod::Overview::new(pixel_us, from, to))
            }
            _ => None,
        };
        let mut merged = 0;
        let mut states: Vec<StateSlice> = match (selection.window, overview.as_mut()) {
            (None, _) => Vec::new(),
            (Some((from, to)), Some(overview)) => {
                // Chunks hold each pid's slices together: one lookup per run.
                let mut last: Option<(u32, Option<usize>)> = None;
                for slice in self.states.iter().flat_map(|chunk| chunk.slices.iter()) {
                    if slice.start_us() > to || slice.start_us() + slice.duration_us() < from {
                        continue;
                    }
                    let slot = match last {
                        Some((pid, slot)) if pid == slice.pid => slot,
                        _ => {
                            let want = *wanted.entry(slice.pid).or_insert_with(|| {
                                self.timeline.wanted_pid(query, &slice.pid.to_string())
                            });
                            let slot = want.then(|| {
                                overview.slot(&slice.pid.to_string(), || json!(slice.pid))
                            });
                            last = Some((slice.pid, slot));
                            slot
                        }
                    };
                    if let Some(slot) = slot {
                        let state = match slice.interval.kind {
                            ebpf::IntervalKind::OnCpu => lod::ThreadState::Running,
                            ebpf::IntervalKind::RunQueue => lod::ThreadState::Runnable,
                            ebpf::IntervalKind::OffCpu => lod::ThreadState::Off,
                        };
                        overview.add_state_at(slot, state, slice.start_us(), slice.duration_us());
                        merged += 1;
                    }
                }
                Vec::new()
            }
            (Some((from, to)), None) => self
                .states
                .iter()
                .flat_map(|chunk| chunk.slices.iter())
                .filter(|s| s.start_us() <= to && s.start_us() + s.duration_us() >= from)
                .filter(|s| {
                    *wanted
                        .entry(s.pid)
                        .or_insert_with(|| self.timeline.wanted_pid(query, &s.pid.to_string()))
                })
                .copied()
                .collect(),
        };
        let mut summaries = Summaries::default();
        if let Some(pixel_us) = selection.pixel_us {
            let in_range = selection.events.len() + activities.len() + states.len() + merged;
            let merged = match overview.take() {
                Some(overview) => {
                    let (more, pixel_us) =
                        finish_overview(&mut selection, overview, &mut activities);
                    (merged + more, pixel_us)
                }
                None => (0, pixel_us),
            };
            let (_, others, _) = selection.summarize(pixel_us);
            summaries.states = summarize_states(&mut states, pixel_us);
            summaries.activities = summarize_activities(&mut activities, pixel_us);
            let made = others + summaries.states.len() + summaries.activities.len();
            let kept = selection.events.len() + activities.len() + states.len();
            let mut note = lod::detail_note(pixel_us, in_range, made, kept);
            if query.view == View::Overview {
                note["overview"] = lod::overview_note(merged.0, merged.1);
            }
            selection.note("detail", note);
        }
        let others = selection.events.len()
            + selection.summaries.len()
            + activities.len()
            + summaries.activities.len();
        let total = others + states.len() + summaries.states.len();
        let limit = limits.max_events;
        if total > limit {
            let room = limit.checked_sub(others + summaries.states.len());
            match room {
                Some(room) if query.downsample => {
                    states.sort_by(|a, b| {
                        b.interval
                            .duration_ns
                            .cmp(&a.interval.duration_ns)
                            .then(a.interval.start_ns.cmp(&b.interval.start_ns))
                    });
                    let dropped = states.len() - room;
                    states.truncate(room);
                    let shortest = states.last().map(StateSlice::duration_us);
                    selection.note(
                        "downsampled",
                        downsample_note(total, limit, dropped, states.len(), shortest),
                    );
                }
                _ => {
                    return Err(QueryError::TooLarge {
                        count: total,
                        limit,
                    });
                }
            }
        }
        let mut writer = TraceWriter::new(limits.max_bytes);
        selection.write_events(&mut writer);
        for activity in activities {
            writer.push(activity);
        }
        for (first, summary) in &summaries.activities {
            writer.push(&SummaryEvent::new("job", &first.pid, &first.tid, summary));
        }
        for state in states {
            writer.push(&state.to_event());
        }
        for (pid, tid, summary) in &summaries.states {
            writer.push(&SummaryEvent::new("thread_state", pid, tid, summary));
        }
        Ok(writer.finish(selection.metadata))
    }
}

/// Ends the overview of a live answer (see [`View::Overview`]), whose
/// thread states are counted already: every job activity of a class
/// (tensors', not the cycles') is merged into its process's `activity`
/// counter, and the counters go to the selection's summaries. Returns how
/// many activities were merged, and the overview's pixel (µs).
fn finish_overview(
    selection: &mut crate::timeline::Selection<'_>,
    mut overview: lod::Overview,
    activities: &mut Vec<&tracks::JobActivity>,
) -> (usize, f64) {
    let before = activities.len();
    activities.retain(|a| {
        let Some(dur) = a.dur else { return true };
        if &*a.tid == tracks::CYCLES_TID {
            return true;
        }
        let pid = || serde_json::to_value(&a.pid).unwrap_or(Value::Null);
        !overview.add_activity(&a.pid.key(), pid, &a.name, a.ts, dur)
    });
    let pixel_us = overview.pixel_us();
    selection.summaries.extend(overview.counters());
    (before - activities.len(), pixel_us)
}

/// The summaries of one live answer: thread states per (pid, tid), job
/// activities with the first slice of their track (its pid and tid).
#[derive(Default)]
struct Summaries<'a> {
    states: Vec<(u32, u32, lod::Summary<&'static str>)>,
    activities: Vec<(&'a tracks::JobActivity, lod::Summary<Arc<str>>)>,
}

/// Merges the thread states shorter than `pixel_us` per thread; `states`
/// keeps the others. The chunks hold each thread's slices in time order.
fn summarize_states(
    states: &mut Vec<StateSlice>,
    pixel_us: f64,
) -> Vec<(u32, u32, lod::Summary<&'static str>)> {
    let mut threads: HashMap<(u32, u32), lod::Track<StateSlice, &'static str>> = HashMap::new();
    for slice in states.drain(..) {
        threads
            .entry((slice.pid, slice.tid))
            .or_insert_with(|| lod::Track::new(pixel_us))
            .push(
                slice,
                state_name(slice.interval.kind),
                slice.start_us(),
                slice.duration_us(),
                0.0,
            );
    }
    let mut summaries = Vec::new();
    for ((pid, tid), track) in threads {
        for piece in track.finish() {
            match piece {
                lod::Piece::Keep(slice) => states.push(slice),
                lod::Piece::Summary(summary) => summaries.push((pid, tid, summary)),
            }
        }
    }
    summaries
}

/// Merges the job activities (slices) shorter than `pixel_us` per track
/// (rank, tensor); instants and longer slices stay in `activities`. A
/// summary's `bytes` adds up the `bytes` its slices carried.
fn summarize_activities<'a>(
    activities: &mut Vec<&'a tracks::JobActivity>,
    pixel_us: f64,
) -> Vec<(&'a tracks::JobActivity, lod::Summary<Arc<str>>)> {
    type Track<'a> = lod::Track<&'a tracks::JobActivity, Arc<str>>;
    let mut by_track: HashMap<(String, Arc<str>), (&tracks::JobActivity, Track<'a>)> =
        HashMap::new();
    let mut rest = Vec::new();
    let mut sorted = std::mem::take(activities);
    sorted.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    for activity in sorted {
        let Some(dur) = activity.dur else {
            rest.push(activity);
            continue;
        };
        by_track
            .entry((activity.pid.key(), activity.tid.clone()))
            .or_insert_with(|| (activity, lod::Track::new(pixel_us)))
            .1
            .push(
                activity,
                activity.name.clone(),
                activity.ts,
                dur,
                activity.args.number("bytes").unwrap_or(0.0),
            );
    }
    let mut summaries = Vec::new();
    for (first, track) in by_track.into_values() {
        for piece in track.finish() {
            match piece {
                lod::Piece::Keep(activity) => rest.push(activity),
                lod::Piece::Summary(summary) => summaries.push((first, summary)),
            }
        }
    }
    *activities = rest;
    summaries
}

/// The `args` of a watched process's `process_name` metadata: `name` is
/// `comm (pid N)`, or with its container `comm (pid N, pod 1234abcd…,
/// container 0a1b2c3d4e5f)`, and the full `container_id` and `pod_uid` are
/// args of their own.
fn process_name_args(comm: &str, pid: u32, container: &Container) -> Value {
    let name = match container.short_label() {
        Some(label) => format!("{comm} (pid {pid}, {label})"),
        None => format!("{comm} (pid {pid})"),
    };
    let mut args = json!({ "name": name });
    if let Some(id) = &container.container_id {
        args["container_id"] = json!(id);
    }
    if let Some(uid) = &container.pod_uid {
        args["pod_uid"] = json!(uid);
    }
    args
}

/// The first lane id of a process's NCCL communicators on the timeline
/// (above any real thread id: Linux's pid_max is at most 2^22).
pub const NCCL_LANE_TID_BASE: u32 = 0x4000_0000;

/// `pid`'s collectives from its NCCL profiler plugin in the window: a lane
/// per communicator (the first [`COMMS_PER_PROCESS`], then one for the
/// rest), each collective a slice where [`crate::nccl_profiler::placed`]
/// puts it.
fn plugin_events(events: &mut Vec<Value>, nccl: &NcclProfiler, pid: u32, from_ns: u64, to_ns: u64) {
    let mut lanes: Vec<String> = Vec::new();
    for (c, start, end) in nccl.window(pid, from_ns, to_ns) {
        let lane = match lanes.iter().position(|l| *l == c.comm) {
            Some(i) => i,
            None if lanes.len() < COMMS_PER_PROCESS => {
                lanes.push(c.comm.clone());
                let tid = NCCL_LANE_TID_BASE + lanes.len() as u32 - 1;
                events.push(
                    json!({ "ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                    "args": { "name": format!("NCCL comm {} (profiler plugin)", c.comm) } }),
                );
                lanes.len() - 1
            }
            None => COMMS_PER_PROCESS,
        };
        let tid = NCCL_LANE_TID_BASE + lane as u32;
        let clock = if c.gpu_ns[0] > 0 {
            "gpu"
        } else if c.kernel_cpu_ns[0] > 0 {
            "plugin cpu"
        } else {
            "enqueue"
        };
        events.push(json!({
            "ph": "X", "cat": "nccl_plugin", "name": c.func, "pid": pid, "tid": tid,
            "ts": start as f64 / 1e3,
            "dur": end.saturating_sub(start) as f64 / 1e3,
            "args": {
                "comm": c.comm, "seq": c.seq, "rank": c.rank, "nranks": c.nranks,
                "bytes": c.bytes, "count": c.count, "datatype": c.datatype,
                "algo": c.algo, "proto": c.proto, "channels": c.channels,
                "channels_done": c.channels_done, "clock": clock,
                "enqueue_us": c.enqueue_ns[1].saturating_sub(c.enqueue_ns[0]) as f64 / 1e3,
            },
        }));
    }
    if lanes.len() == COMMS_PER_PROCESS
        && events
            .iter()
            .rev()
            .any(|e| e["tid"] == json!(NCCL_LANE_TID_BASE + COMMS_PER_PROCESS as u32))
    {
        events.push(json!({ "ph": "M", "name": "thread_name", "pid": pid,
            "tid": NCCL_LANE_TID_BASE + COMMS_PER_PROCESS as u32,
            "args": { "name": "NCCL, other communicators (profiler plugin)" } }));
    }
}

/// Builds the view of `[now - window, now]` (CLOCK_MONOTONIC ns), after
/// adding this moment's counter sample (TCP connections, `gpus`) to
/// `counters`.
#[allow(clippy::too_many_arguments)]
pub fn build(
    session: &Session,
    nccl: Option<&NcclProfiler>,
    states: &mut ThreadStates,
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
    // A job's rank is local when it runs on the host its socket here speaks
    // for, under a pid we watch (or saw) here.
    let here = tracks::Here { pids: &pids };
    let job_ranks: Vec<tracks::JobRanks<'_>> = jobs.iter().map(Into::into).collect();
    let mut local_ranks = tracks::local_ranks(&job_ranks, &here);
    // A rank's children (data-loader workers of a job found from its
    // launcher's variables) are shown with their rank.
    for job in &jobs {
        for (pid, rank) in job.local_processes() {
            if let Some(rank) = rank
                && pids.contains(&pid)
            {
                local_ranks
                    .entry(pid)
                    .or_insert_with(|| (job.job_id.clone(), rank));
            }
        }
    }
    states.containers.retain(|pid| pids.contains(&pid));
    for &pid in &pids {
        let name = session.thread_name(pid, pid);
        let container = states.containers.get(pid, now_ns);
        let mut args = process_name_args(&name, pid, &container);
        if let Some((job, rank)) = local_ranks.get(&pid) {
            args["job"] = json!(job);
            args["rank"] = json!(rank);
        }
        events.push(json!({ "ph": "M", "name": "process_name", "pid": pid, "args": args }));
        for tid in model.tids(pid) {
            events.push(json!({ "ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": { "name": session.thread_name(pid, tid) } }));
            for call in model.nccl_calls(tid, window_start_ns, now_ns) {
                events.push(json!({
                    "ph": "X", "cat": "nccl", "name": call.func, "pid": pid, "tid": tid,
                    "ts": call.entry_ns as f64 / 1e3,
                    "dur": call.return_ns.saturating_sub(call.entry_ns) as f64 / 1e3,
                    "args": { "count": call.count, "datatype": call.datatype, "op": call.op, "result": call.result },
                }));
            }
        }
        if let Some(nccl) = nccl {
            plugin_events(&mut events, nccl, pid, window_start_ns, now_ns);
        }
        processes.push(NamedProcess {
            name,
            container,
            snapshot: model.process_snapshot(pid, figures_from_ns, now_ns),
        });
    }
    // Processes whose NCCL profiler plugin reports, though eBPF does not
    // watch them: their collectives alone.
    if let Some(nccl) = nccl {
        for pid in nccl.pids().into_iter().filter(|pid| !pids.contains(pid)) {
            let before = events.len();
            plugin_events(&mut events, nccl, pid, window_start_ns, now_ns);
            if events.len() > before {
                let mut args = json!({ "name": session.thread_name(pid, pid) });
                if let Some((job, rank)) = local_ranks.get(&pid) {
                    args["job"] = json!(job);
                    args["rank"] = json!(rank);
                }
                events.push(json!({ "ph": "M", "name": "process_name", "pid": pid, "args": args }));
            }
        }
    }
    let now_us = now_ns as f64 / 1e3;
    let window_start_us = window_start_ns as f64 / 1e3;
    let mut job_activities = Vec::new();
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
            let stats = registry.recent_stats(&job.job_id).unwrap_or_default();
            let (cycles_name, cycles) = tracks::cycle_slices(
                job.into(),
                job.served_by_rank,
                &stats,
                &here,
                offset_us,
                window_start_us,
                now_us,
            );
            let job = tracks::job_activities(
                job.into(),
                &kept,
                &here,
                offset_us,
                window_start_us,
                now_us,
            );
            events.extend(job.metadata);
            events.extend(cycles_name);
            job_activities.extend(job.activities);
            job_activities.extend(cycles);
        }
    }
    states.update(model, &pids, window_start_ns, now_ns);
    counters.sample(now_us, &model.connections(None), &gpus.snapshot());
    events.extend(counters.events().cloned());
    let timeline = RecordedTrace::from_events(events, Some(now_us), "live eBPF")?;
    Ok(LiveView {
        processes,
        timeline,
        states: states.chunks.iter().cloned().collect(),
        job_activities,
        ringbuf_drops: session.probes().counter(ebpf::Counter::RingbufDrops)?,
        intervals_late: model.stats().intervals_late,
        jobs,
        min_interval_ns: session.probes().min_interval_ns(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::timeline::TimePoint;

    fn slice(pid: u32, start_us: u64, duration_us: u64) -> StateSlice {
        StateSlice {
            pid,
            tid: pid + 1,
            interval: Interval {
                start_ns: start_us * 1_000,
                duration_ns: duration_us * 1_000,
                kind: ebpf::IntervalKind::RunQueue,
                cause: ebpf::IntervalCause::Woken,
            },
        }
    }

    /// A view with a job activity on pid 1 (job j), a counter on pid 2 and
    /// thread states of both, split over two chunks as two builds would.
    fn view() -> LiveView {
        let events = vec![
            json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank", "job": "j", "rank": 0}}),
            json!({"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "other"}}),
            json!({"ph": "C", "name": "tcp", "pid": 2, "ts": 60.0, "args": {"tx": 1}}),
        ];
        LiveView {
            processes: Vec::new(),
            timeline: RecordedTrace::from_events(events, Some(1000.0), "test").unwrap(),
            states: vec![
                Arc::new(StateChunk {
                    until_ns: 500_000,
                    slices: vec![slice(1, 0, 30), slice(2, 10, 5), slice(1, 100, 200)],
                }),
                Arc::new(StateChunk {
                    until_ns: 1_000_000,
                    slices: vec![slice(1, 400, 20), slice(2, 700, 100)],
                }),
            ],
            job_activities: vec![tracks::JobActivity {
                ph: "X",
                s: None,
                cat: "job",
                name: "ALLREDUCE".into(),
                pid: tracks::TracePid::Local(1),
                tid: "t".into(),
                ts: 50.0,
                dur: Some(10.0),
                args: tracks::ActivityArgs::default(),
            }],
            ringbuf_drops: 0,
            intervals_late: 0,
            jobs: Vec::new(),
            min_interval_ns: 0,
        }
    }

    #[test]
    fn a_jobs_answer_says_since_when_its_tensor_events_stream() {
        let mut view = view();
        let job = |since: Option<u64>| -> JobSnapshot {
            serde_json::from_value(json!({
                "job_id": "j", "socket": "/run/ringwatch/j.sock", "protocol_version": 1,
                "world_size": 1, "local_size": 1, "ranks": [], "host": "h", "served_by_rank": 0,
                "ns_pids": {}, "knobs": collectives::control::Knobs::default(), "cycle": 0,
                "autotune": "off", "state": "connected", "lost_reason": null,
                "last_seen_unix_ms": 0, "stats_received": 0, "timeline_events_received": 0,
                "timeline_events_dropped": 0, "timeline_bytes": 0,
                "timeline_streaming_since_unix_ms": since, "owner_uid": 0, "owner_pid": 1,
            }))
            .unwrap()
        };
        view.jobs = vec![job(Some(1_700_000_000_000))];
        let query = TimelineQuery {
            job: Some("j".into()),
            ..TimelineQuery::default()
        };
        let answer = ask(&view, &query, usize::MAX).unwrap();
        assert_eq!(
            answer["metadata"]["job_timeline"]["streaming_since_unix_ms"],
            1_700_000_000_000u64
        );
        view.jobs = vec![job(None)];
        let answer = ask(&view, &query, usize::MAX).unwrap();
        assert!(answer["metadata"]["job_timeline"]["streaming_since_unix_ms"].is_null());
        // Not asked about a job: no such note.
        let answer = ask(&view, &TimelineQuery::default(), usize::MAX).unwrap();
        assert!(answer["metadata"].get("job_timeline").is_none());
    }

    #[test]
    fn an_answer_says_which_thread_states_are_too_short_to_be_on_it() {
        let mut view = view();
        let answer = ask(&view, &TimelineQuery::default(), usize::MAX).unwrap();
        assert!(answer["metadata"].get("thread_states").is_none());
        view.min_interval_ns = 50_000;
        let answer = ask(&view, &TimelineQuery::default(), usize::MAX).unwrap();
        assert_eq!(answer["metadata"]["thread_states"]["min_interval_us"], 50.0);
    }

    /// A query with no byte budget, parsed back.
    fn ask(view: &LiveView, query: &TimelineQuery, limit: usize) -> Result<Value, QueryError> {
        let limits = AnswerLimits {
            max_events: limit,
            max_bytes: usize::MAX,
        };
        view.query(query, limits).map(|answer| answer.to_value())
    }

    fn states_of(answer: &Value) -> Vec<(u64, f64)> {
        let mut v: Vec<(u64, f64)> = answer["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["cat"] == "thread_state")
            .map(|e| (e["pid"].as_u64().unwrap(), e["ts"].as_f64().unwrap()))
            .collect();
        v.sort_by(|a, b| a.1.total_cmp(&b.1));
        v
    }

    #[test]
    fn a_process_name_carries_its_container_and_pod() {
        let plain = process_name_args("collbench", 42, &Container::default());
        assert_eq!(plain, json!({ "name": "collbench (pid 42)" }));
        let id = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
        let uid = "1234abcd-5678-4ef0-9abc-def012345678";
        let container = Container {
            container_id: Some(id.into()),
            pod_uid: Some(uid.into()),
        };
        assert_eq!(
            process_name_args("collbench", 42, &container),
            json!({
                "name": "collbench (pid 42, pod 1234abcd…, container 0a1b2c3d4e5f)",
                "container_id": id,
                "pod_uid": uid,
            })
        );
    }

    #[test]
    fn thread_states_keep_to_their_budget_dropping_the_oldest() {
        let size = std::mem::size_of::<StateSlice>();
        let mut states = ThreadStates::with_budget(10 * size);
        let chunk = |until_ns, n: u64| StateChunk {
            until_ns,
            slices: (0..n).map(|i| slice(1, until_ns / 1_000 + i, 1)).collect(),
        };
        for (until, n) in [(1_000, 4), (2_000, 4), (3_000, 4)] {
            states.push(chunk(until, n));
            states.trim(0);
        }
        // 12 > 10: the oldest chunk went, for memory, not for age.
        let kept: Vec<u64> = states.chunks.iter().map(|c| c.until_ns).collect();
        assert_eq!(kept, [2_000, 3_000]);
        assert_eq!((states.slices, states.chunks_dropped), (8, 1));
        // A chunk alone over the budget stays; expired ones go without counting.
        states.push(chunk(4_000, 30));
        states.trim(2_500);
        let kept: Vec<u64> = states.chunks.iter().map(|c| c.until_ns).collect();
        assert_eq!(kept, [4_000]);
        assert_eq!((states.slices, states.chunks_dropped), (30, 2));
    }

    #[test]
    fn thread_states_are_answered_from_the_chunks_with_the_range_and_filters() {
        let view = view();
        let all = ask(&view, &TimelineQuery::default(), 100).unwrap();
        assert_eq!(
            states_of(&all),
            [(1, 0.0), (2, 10.0), (1, 100.0), (1, 400.0), (2, 700.0)]
        );
        // The slice at 100 µs lasts to 300: it overlaps [250, 450].
        let range = TimelineQuery {
            from: Some(TimePoint::At(250.0)),
            to: Some(TimePoint::At(450.0)),
            ..TimelineQuery::default()
        };
        assert_eq!(
            states_of(&ask(&view, &range, 100).unwrap()),
            [(1, 100.0), (1, 400.0)]
        );
        let job = TimelineQuery {
            job: Some("j".into()),
            ..TimelineQuery::default()
        };
        let answer = ask(&view, &job, 100).unwrap();
        assert_eq!(states_of(&answer), [(1, 0.0), (1, 100.0), (1, 400.0)]);
        assert!(
            answer["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["pid"] == 1),
            "only the job's process: {answer}"
        );
        let pid = TimelineQuery {
            pid: Some("2".into()),
            ..TimelineQuery::default()
        };
        assert_eq!(
            states_of(&ask(&view, &pid, 100).unwrap()),
            [(2, 10.0), (2, 700.0)]
        );
    }

    #[test]
    fn over_the_limit_it_refuses_or_keeps_the_longest_states() {
        let view = view();
        // 2 other events + 5 states = 7.
        assert_eq!(
            ask(&view, &TimelineQuery::default(), 6),
            Err(QueryError::TooLarge { count: 7, limit: 6 })
        );
        let downsample = TimelineQuery {
            downsample: true,
            ..TimelineQuery::default()
        };
        let answer = ask(&view, &downsample, 4).unwrap();
        // Room for 2 states: the 200 µs and 100 µs ones.
        assert_eq!(states_of(&answer), [(1, 100.0), (2, 700.0)]);
        assert_eq!(
            answer["metadata"]["downsampled"]["thread_state_slices_dropped"],
            3
        );
        assert_eq!(answer["metadata"]["downsampled"]["shortest_kept_us"], 100.0);
        assert!(
            ask(&view, &downsample, 1).is_err(),
            "the others alone exceed it"
        );
        assert!(
            ask(&view, &TimelineQuery::default(), 7).unwrap()["metadata"]
                .get("downsampled")
                .is_none()
        );
    }

    #[test]
    fn at_a_resolution_short_states_and_activities_become_summaries_per_track() {
        let mut view = view();
        // Thread 2 of pid 1: 1,000 pixels of 100 µs, each 60 µs running
        // and 40 µs blocked in 10 µs slices; then one 5 ms blocked slice.
        let mut slices = Vec::new();
        for pixel in 0..1000u64 {
            for k in 0..10u64 {
                let kind = if k < 6 {
                    ebpf::IntervalKind::OnCpu
                } else {
                    ebpf::IntervalKind::OffCpu
                };
                let mut s = slice(1, pixel * 100 + k * 10, 10);
                s.interval.kind = kind;
                slices.push(s);
            }
        }
        let mut long = slice(1, 100_000, 5_000);
        long.interval.kind = ebpf::IntervalKind::OffCpu;
        slices.push(long);
        view.states = vec![Arc::new(StateChunk {
            until_ns: 200_000_000,
            slices,
        })];
        // 300 ALLREDUCE slices of 20 µs every 50 µs on one tensor (a pixel
        // with one short slice would keep it as it is).
        let activity = view.job_activities[0].clone();
        view.job_activities = (0..300)
            .map(|i| tracks::JobActivity {
                ts: f64::from(i) * 50.0,
                dur: Some(20.0),
                ..activity.clone()
            })
            .collect();
        view.timeline = RecordedTrace::from_events(
            vec![json!({"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "rank", "job": "j", "rank": 0}})],
            Some(110_000.0),
            "test",
        )
        .unwrap();
        let full = ask(&view, &TimelineQuery::default(), 1_000_000).unwrap();
        assert_eq!(
            full["traceEvents"].as_array().unwrap().len(),
            1 + 10_001 + 300
        );
        let coarse = TimelineQuery {
            detail: lod::Detail::Resolution(100.0),
            ..TimelineQuery::default()
        };
        let answer = ask(&view, &coarse, 1_000_000).unwrap();
        let events = answer["traceEvents"].as_array().unwrap();
        let summaries: Vec<&Value> = events
            .iter()
            .filter(|e| e["args"].get("summary").is_some())
            .collect();
        // Every pixel alike: one summary of the 10,000 short states, one of
        // the 300 activities; the long state stays as it was.
        assert_eq!(summaries.len(), 2, "{summaries:?}");
        let state = summaries
            .iter()
            .find(|e| e["cat"] == "thread_state")
            .unwrap();
        assert_eq!(
            (
                &state["name"],
                &state["pid"],
                &state["tid"],
                &state["ts"],
                &state["dur"]
            ),
            (
                &json!("running"),
                &json!(1),
                &json!(2),
                &json!(0.0),
                &json!(100_000.0)
            )
        );
        assert_eq!(
            state["args"],
            json!({ "summary": 10_000, "running": 0.6, "blocked": 0.4 })
        );
        let job = summaries.iter().find(|e| e["cat"] == "job").unwrap();
        assert_eq!(
            (&job["name"], &job["tid"]),
            (&json!("ALLREDUCE"), &json!("t"))
        );
        assert_eq!(job["args"]["summary"], 300);
        assert_eq!(job["args"]["ALLREDUCE"], 0.4);
        assert!(
            events
                .iter()
                .any(|e| e["dur"] == 5_000.0 && e["name"] == "blocked")
        );
        assert_eq!(events.len(), 1 + 2 + 1);
        let detail = &answer["metadata"]["detail"];
        assert_eq!(
            (
                &detail["pixel_us"],
                &detail["slices_in_range"],
                &detail["summary_slices"]
            ),
            (&json!(100.0), &json!(10_301), &json!(2))
        );
        // Zoomed in to one pixel's worth of window: every slice again.
        let zoomed = TimelineQuery {
            from: Some(TimePoint::At(5_000.0)),
            to: Some(TimePoint::At(5_100.0)),
            detail: lod::Detail::Width(1000),
            ..TimelineQuery::default()
        };
        let answer = ask(&view, &zoomed, 1_000_000).unwrap();
        assert!(
            answer["traceEvents"]
                .as_array()
                .unwrap()
                .iter()
                .all(|e| e["args"].get("summary").is_none())
        );
        assert_eq!(answer["metadata"]["detail"]["pixel_us"], 0.1);
    }

    #[test]
    fn the_overview_answers_counters_per_process_in_place_of_threads_and_tensors() {
        let view = view();
        let overview = TimelineQuery {
            view: View::Overview,
            detail: lod::Detail::Resolution(100.0),
            ..TimelineQuery::default()
        };
        let answer = ask(&view, &overview, 1_000).unwrap();
        let events = answer["traceEvents"].as_array().unwrap();
        assert!(
            !events
                .iter()
                .any(|e| e["cat"] == "thread_state" || e["cat"] == "job"),
            "threads and tensors are merged: {answer}"
        );
        let counters = |name: &str, pid: u64| -> Vec<Value> {
            events
                .iter()
                .filter(|e| e["ph"] == "C" && e["name"] == name && e["pid"] == pid)
                .map(|e| e["args"].clone())
                .collect()
        };
        // Pid 1's states are run-queue waits (slice()): [0,30), [100,300), [400,420).
        let threads = counters("threads", 1);
        assert_eq!(threads[0], json!({ "running": 0.0, "runnable": 0.3 }));
        assert!(threads.contains(&json!({ "running": 0.0, "runnable": 1.0 })));
        // Its ALLREDUCE over [50, 60): a tenth of its pixel.
        assert_eq!(
            counters("activity", 1)[0],
            json!({ "collective": 0.1, "fusion": 0.0, "negotiate": 0.0, "queued": 0.0 })
        );
        assert!(!counters("threads", 2).is_empty());
        assert!(counters("activity", 2).is_empty());
        // The tcp counter stays.
        assert!(events.iter().any(|e| e["name"] == "tcp"));
        let note = &answer["metadata"]["detail"]["overview"];
        assert_eq!(note["slices_merged"], 6, "{note}");
    }
}
