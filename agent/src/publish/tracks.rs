//! `tracks`: the live timeline's tracks that do not come from the scheduler
//! probes: job activities (the jobs' own timeline events, read from their
//! control sockets) and counter tracks (TCP throughput and retransmits per
//! connection, GPU figures), as Chrome-trace events on the live trace's
//! clock (CLOCK_MONOTONIC µs).
//!
//! Pure: it is given what the registry, the model and NVML hold and returns
//! JSON events; the only clock it reads is in [`unix_minus_monotonic_us`].
//! It must never hold more than one live window of counter samples.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::Arc;

use collectives::control::{Phase, RankInfo, TimelineEvent};
use serde::Serialize;
use serde_json::{Map, Value, json};

use crate::gpu::GpuSnapshot;
use crate::jobs::JobSnapshot;
use crate::model::Connection;

/// The offset from CLOCK_MONOTONIC to the Unix clock now, in µs:
/// `unix_us - offset` is the same instant on the live trace's clock.
/// Read as the midpoint of two realtime reads around one monotonic read.
pub fn unix_minus_monotonic_us() -> i64 {
    fn read(clock: libc::clockid_t) -> i128 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: a valid pointer to a timespec; both clocks always exist.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
    }
    let before = read(libc::CLOCK_REALTIME);
    let monotonic = read(libc::CLOCK_MONOTONIC);
    let after = read(libc::CLOCK_REALTIME);
    let offset_ns = (before + after) / 2 - monotonic;
    i64::try_from(offset_ns / 1_000).unwrap_or(i64::MAX)
}

/// This node: the pids the live view has (watched now or seen within
/// retention).
#[derive(Debug, Clone, Copy)]
pub struct Here<'a> {
    /// Pids with threads or watched here.
    pub pids: &'a BTreeSet<u32>,
}

impl Here<'_> {
    /// Whether a rank of `job` runs here: on the host the job's socket here
    /// speaks for, and its (host) pid one of ours (a rank on another host
    /// may have the same pid number).
    fn is_local(&self, job: JobRanks<'_>, rank: &RankInfo) -> bool {
        rank.host == job.host && self.pids.contains(&rank.pid)
    }
}

/// A job as the tracks need it: its id, its ranks and this node's host.
#[derive(Debug, Clone, Copy)]
pub struct JobRanks<'a> {
    /// The job's id.
    pub job_id: &'a str,
    /// Every rank (host, pid; host pids for this node's ranks).
    pub ranks: &'a [RankInfo],
    /// The host the job's socket on this node speaks for.
    pub host: &'a str,
}

impl<'a> From<&'a JobSnapshot> for JobRanks<'a> {
    fn from(job: &'a JobSnapshot) -> Self {
        Self {
            job_id: &job.job_id,
            ranks: &job.ranks,
            host: &job.host,
        }
    }
}

/// The Chrome-trace pid of a job's rank: its real pid when the rank runs on
/// this node (so its activities group with its threads' states), else a
/// name of its own (`<job> rank <n>`).
fn rank_pid(job: JobRanks<'_>, rank: usize, here: &Here<'_>) -> Value {
    match job.ranks.iter().find(|r| r.rank == rank) {
        Some(info) if here.is_local(job, info) => json!(info.pid),
        _ => json!(format!("{} rank {rank}", job.job_id)),
    }
}

/// The `job`/`rank` every local rank's pid carries in its `process_name`
/// (`pid → (job, rank)`), so a `?job=` query keeps its threads too.
pub fn local_ranks(jobs: &[JobRanks<'_>], here: &Here<'_>) -> BTreeMap<u32, (String, usize)> {
    let mut out = BTreeMap::new();
    for job in jobs {
        for rank in job.ranks {
            if here.is_local(*job, rank) {
                out.insert(rank.pid, (job.job_id.to_owned(), rank.rank));
            }
        }
    }
    out
}

/// The Chrome-trace pid of a job activity: a local rank's real pid, or a
/// remote rank's name of its own.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum TracePid {
    /// A process of this node.
    Local(u32),
    /// `<job> rank <n>`.
    Remote(Arc<str>),
}

impl TracePid {
    /// As the timeline's filters key pids (`4101`, `j1 rank 1`).
    pub fn key(&self) -> String {
        match self {
            TracePid::Local(pid) => pid.to_string(),
            TracePid::Remote(name) => name.to_string(),
        }
    }
}

/// One job activity of the live window, kept typed until a query writes it
/// (as a `Value` it took ~1 KiB, and the live view rebuilt tens of
/// thousands of them every second). Serializes as the Chrome-trace event.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct JobActivity {
    /// `X` (a slice) or `i` (an instant).
    pub ph: &'static str,
    /// Instants are thread-scoped (`t`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub s: Option<&'static str>,
    /// Always `job`.
    pub cat: &'static str,
    /// The activity (ALLREDUCE, QUEUE, …), shared between the slices.
    pub name: Arc<str>,
    /// The rank's pid on the trace.
    pub pid: TracePid,
    /// The tensor's track (`tensor <name>`), shared by its slices.
    pub tid: Arc<str>,
    /// Start, µs on the live trace's clock.
    pub ts: f64,
    /// Length of a slice, µs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dur: Option<f64>,
    /// The job's own arguments (begin's and end's), and `open` for a slice
    /// still running at the end of the window.
    pub args: ActivityArgs,
}

impl JobActivity {
    /// Its end, µs (its start for an instant).
    pub fn end_us(&self) -> f64 {
        self.ts + self.dur.unwrap_or(0.0)
    }
}

/// A job activity's arguments: the job's strings, plus `open: true`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ActivityArgs {
    /// The job's arguments, begin's then end's (an end's value wins).
    pub pairs: Vec<(String, String)>,
    /// Still running at the end of the window.
    pub open: bool,
}

impl ActivityArgs {
    /// The value of `key` as a number (an end's value wins), if it is one.
    pub fn number(&self, key: &str) -> Option<f64> {
        self.pairs
            .iter()
            .rev()
            .find(|(k, _)| k == key)
            .and_then(|(_, v)| v.parse().ok())
    }
}

impl Serialize for ActivityArgs {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeMap;
        let mut map = serializer.serialize_map(None)?;
        let mut seen = BTreeMap::new();
        for (key, value) in &self.pairs {
            seen.insert(key.as_str(), value.as_str());
        }
        for (key, value) in seen {
            map.serialize_entry(key, value)?;
        }
        if self.open {
            map.serialize_entry("open", &true)?;
        }
        map.end()
    }
}

/// A job's part of the live timeline: the names (`ph: "M"`, few, as JSON)
/// and the activities (many, typed).
#[derive(Debug, Default)]
pub struct JobActivities {
    /// `process_name` of remote ranks, `thread_name` of each tensor track.
    pub metadata: Vec<Value>,
    /// The slices and instants.
    pub activities: Vec<JobActivity>,
}

impl JobActivities {
    /// Everything as JSON events (for tests and small traces).
    #[cfg(test)]
    pub fn to_values(&self) -> Vec<Value> {
        let mut out = self.metadata.clone();
        out.extend(
            self.activities
                .iter()
                .map(|a| serde_json::to_value(a).expect("plain data serializes")),
        );
        out
    }
}

/// A job's activities as Chrome-trace events: every begin/end pair of one
/// (rank, tensor, activity) becomes one `X` slice on the rank's pid and a
/// thread named after the tensor; instants stay `i`. `events` are the job's
/// kept events (Unix µs, any order); `offset_us` comes from
/// [`unix_minus_monotonic_us`]. A slice that began before `window_start_us`
/// is kept when it ends inside the window; one still open at `now_us` lasts
/// until then (`args.open: true`). The metadata holds the `process_name`
/// of remote ranks (local ranks are named with their threads) and the
/// `thread_name` of each tensor track.
pub fn job_activities(
    job: JobRanks<'_>,
    events: &[TimelineEvent],
    here: &Here<'_>,
    offset_us: i64,
    window_start_us: f64,
    now_us: f64,
) -> JobActivities {
    let to_trace = |unix_us: u64| -> f64 {
        // Exact in i128, then one rounding to f64 (monotonic µs are small).
        (i128::from(unix_us) - i128::from(offset_us)) as f64
    };
    let mut out = JobActivities::default();
    for rank in job.ranks {
        if !here.is_local(job, rank) {
            out.metadata.push(json!({
                "ph": "M", "name": "process_name", "pid": rank_pid(job, rank.rank, here),
                "args": { "name": format!("{} rank {} ({} pid {})", job.job_id, rank.rank, rank.host, rank.pid), "job": job.job_id, "rank": rank.rank },
            }));
        }
    }
    // Per (rank, tensor): time order, then pair B with E of the same activity.
    let mut tracks: BTreeMap<(usize, &str), Vec<&TimelineEvent>> = BTreeMap::new();
    for event in events {
        tracks
            .entry((event.rank, event.tensor.as_str()))
            .or_default()
            .push(event);
    }
    // Activity names, one allocation each.
    let mut names: HashMap<String, Arc<str>> = HashMap::new();
    let mut name_of = |activity: &str| -> Arc<str> {
        if let Some(name) = names.get(activity) {
            return name.clone();
        }
        let name: Arc<str> = Arc::from(activity);
        names.insert(activity.to_owned(), name.clone());
        name
    };
    let args_of = |event: &TimelineEvent| -> Vec<(String, String)> {
        event
            .args
            .iter()
            .map(|(k, v)| (k.clone(), v.clone()))
            .collect()
    };
    let mut pids: HashMap<usize, TracePid> = HashMap::new();
    for ((rank, tensor), mut list) in tracks {
        list.sort_by_key(|e| e.ts_us);
        let pid = pids
            .entry(rank)
            .or_insert_with(|| match rank_pid(job, rank, here) {
                Value::Number(n) => {
                    TracePid::Local(n.as_u64().and_then(|p| u32::try_from(p).ok()).unwrap_or(0))
                }
                other => TracePid::Remote(Arc::from(other.as_str().unwrap_or_default())),
            })
            .clone();
        let tid: Arc<str> = Arc::from(format!("tensor {tensor}"));
        let mut any = false;
        let mut open: Vec<(&TimelineEvent, f64)> = Vec::new();
        let mut push_slice = |out: &mut JobActivities, name: &str, start: f64, dur: f64, args| {
            if start + dur < window_start_us || start > now_us {
                return;
            }
            any = true;
            out.activities.push(JobActivity {
                ph: "X",
                s: None,
                cat: "job",
                name: name_of(name),
                pid: pid.clone(),
                tid: tid.clone(),
                ts: start,
                dur: Some(dur),
                args,
            });
        };
        let mut instants = Vec::new();
        for event in list {
            let ts = to_trace(event.ts_us);
            match event.phase {
                Phase::Begin => open.push((event, ts)),
                Phase::End => {
                    let Some(at) = open.iter().rposition(|(b, _)| b.activity == event.activity)
                    else {
                        // Its begin was pushed out of the registry's ring.
                        continue;
                    };
                    let (begin, start) = open.remove(at);
                    let mut pairs = args_of(begin);
                    pairs.extend(args_of(event));
                    let args = ActivityArgs { pairs, open: false };
                    push_slice(&mut out, &begin.activity, start, ts - start, args);
                }
                Phase::Instant => {
                    if ts >= window_start_us {
                        instants.push((event, ts));
                    }
                }
            }
        }
        for (begin, start) in open {
            let args = ActivityArgs {
                pairs: args_of(begin),
                open: true,
            };
            push_slice(
                &mut out,
                &begin.activity,
                start,
                (now_us - start).max(0.0),
                args,
            );
        }
        for (event, ts) in instants {
            any = true;
            out.activities.push(JobActivity {
                ph: "i",
                s: Some("t"),
                cat: "job",
                name: name_of(&event.activity),
                pid: pid.clone(),
                tid: tid.clone(),
                ts,
                dur: None,
                args: ActivityArgs {
                    pairs: args_of(event),
                    open: false,
                },
            });
        }
        if any {
            out.metadata.push(json!({ "ph": "M", "name": "thread_name", "pid": pid, "tid": &*tid, "args": { "name": tensor } }));
        }
    }
    out
}

/// The track of a job's cycles, on the pid of the rank that serves the
/// node's control socket (it sends its cycles' statistics; every rank runs
/// the same cycles).
pub const CYCLES_TID: &str = "cycles";

/// A job's cycles (the statistics of `rank`, the rank serving this node's
/// control socket) as slices on that rank's `cycles` track: one per cycle
/// that did work, as long as the cycle's work took, with its fused bytes
/// and tensors in `args` (`bytes` is what the level of detail adds up), and
/// the knobs it ran with. Only cycles overlapping `[window_start_us,
/// now_us]`. Returns the track's name and its slices.
pub fn cycle_slices(
    job: JobRanks<'_>,
    rank: usize,
    stats: &[collectives::control::CycleStats],
    here: &Here<'_>,
    offset_us: i64,
    window_start_us: f64,
    now_us: f64,
) -> (Option<Value>, Vec<JobActivity>) {
    let pid = match rank_pid(job, rank, here) {
        Value::Number(n) => {
            TracePid::Local(n.as_u64().and_then(|p| u32::try_from(p).ok()).unwrap_or(0))
        }
        other => TracePid::Remote(Arc::from(other.as_str().unwrap_or_default())),
    };
    let tid: Arc<str> = Arc::from(CYCLES_TID);
    let name: Arc<str> = Arc::from("cycle");
    let slices: Vec<JobActivity> = stats
        .iter()
        .filter_map(|s| {
            let ts = (i128::from(s.start_unix_us) - i128::from(offset_us)) as f64;
            let dur = s.duration_us as f64;
            if ts + dur < window_start_us || ts > now_us {
                return None;
            }
            let pairs = vec![
                ("cycle".to_owned(), s.cycle.to_string()),
                ("bytes".to_owned(), s.bytes_total.to_string()),
                ("tensors".to_owned(), s.tensors.to_string()),
                ("fused_buffers".to_owned(), s.fused_buffers.to_string()),
                (
                    "fusion_threshold_bytes".to_owned(),
                    s.knobs.fusion_threshold_bytes.to_string(),
                ),
                (
                    "cycle_time_us".to_owned(),
                    s.knobs.cycle_time_us.to_string(),
                ),
                (
                    "hierarchical".to_owned(),
                    s.knobs.hierarchical_allreduce.to_string(),
                ),
            ];
            Some(JobActivity {
                ph: "X",
                s: None,
                cat: "job",
                name: name.clone(),
                pid: pid.clone(),
                tid: tid.clone(),
                ts,
                dur: Some(dur),
                args: ActivityArgs { pairs, open: false },
            })
        })
        .collect();
    let meta = (!slices.is_empty()).then(|| {
        json!({ "ph": "M", "name": "thread_name", "pid": &pid, "tid": CYCLES_TID,
                "args": { "name": format!("cycles (rank {rank}: each cycle's work and fused bytes)") } })
    });
    (meta, slices)
}

/// A connection's identity: its process and 4-tuple.
type ConnKey = (u32, String, String);

/// What a connection had sent, received and retransmitted at the last sample.
#[derive(Debug, Clone, Copy)]
struct ConnTotals {
    tx: u64,
    rx: u64,
    retransmits: u64,
    closed: bool,
}

/// Counter samples of the live window, taken once a second: TCP throughput
/// and retransmits per connection, GPU utilization, memory, power and
/// temperature. Bounded: samples older than the window are dropped.
#[derive(Debug)]
pub struct CounterHistory {
    window_us: f64,
    first_sample_us: Option<f64>,
    last_sample_us: Option<f64>,
    last: HashMap<ConnKey, ConnTotals>,
    samples: VecDeque<Value>,
    /// GPU pid → its `process_name` metadata.
    gpu_names: BTreeMap<String, Value>,
}

impl CounterHistory {
    /// An empty history keeping `window_us` of samples.
    pub fn new(window_us: f64) -> Self {
        Self {
            window_us,
            first_sample_us: None,
            last_sample_us: None,
            last: HashMap::new(),
            samples: VecDeque::new(),
            gpu_names: BTreeMap::new(),
        }
    }

    /// Takes one sample at `now_us` (monotonic µs): the connections' totals
    /// as the model has them (`opened_ns`/`closed_ns` on the same clock),
    /// and the GPUs' figures.
    pub fn sample(&mut self, now_us: f64, connections: &[Connection], gpus: &GpuSnapshot) {
        let previous_us = self.last_sample_us;
        let mut seen = HashMap::new();
        for conn in connections {
            let key = (conn.pid, conn.local.clone(), conn.remote.clone());
            let totals = ConnTotals {
                tx: conn.tx_bytes,
                rx: conn.rx_bytes,
                retransmits: conn.retransmits,
                closed: conn.closed_ns.is_some(),
            };
            let before = match (self.last.get(&key), self.first_sample_us) {
                (Some(before), _) => Some(*before),
                // Opened (or first seen by the kernel) while we were
                // sampling: it started from nothing, all its bytes are new.
                (None, Some(first)) if conn.opened_ns as f64 / 1e3 >= first => Some(ConnTotals {
                    tx: 0,
                    rx: 0,
                    retransmits: 0,
                    closed: false,
                }),
                _ => None,
            };
            seen.insert(key.clone(), totals);
            let (Some(before), Some(prev)) = (before, previous_us) else {
                continue;
            };
            if before.closed {
                continue;
            }
            let seconds = (now_us - prev) / 1e6;
            if seconds <= 0.0 {
                continue;
            }
            let tuple = format!("{}\u{2192}{}", conn.local, conn.remote);
            // A counter's value holds from its timestamp to the next one: the
            // rate of (prev, now] is stamped at prev.
            self.samples.push_back(json!({
                "ph": "C", "cat": "tcp", "name": format!("tcp {tuple}"), "pid": conn.pid, "ts": prev,
                "args": {
                    "tx_bytes_per_s": totals.tx.saturating_sub(before.tx) as f64 / seconds,
                    "rx_bytes_per_s": totals.rx.saturating_sub(before.rx) as f64 / seconds,
                },
            }));
            self.samples.push_back(json!({
                "ph": "C", "cat": "tcp", "name": format!("tcp retransmits {tuple}"), "pid": conn.pid, "ts": prev,
                "args": { "retransmits": totals.retransmits.saturating_sub(before.retransmits) },
            }));
            if totals.closed {
                // Closed: back to zero from now on, and no more samples.
                self.samples.push_back(json!({
                    "ph": "C", "cat": "tcp", "name": format!("tcp {tuple}"), "pid": conn.pid, "ts": now_us,
                    "args": { "tx_bytes_per_s": 0.0, "rx_bytes_per_s": 0.0 },
                }));
                self.samples.push_back(json!({
                    "ph": "C", "cat": "tcp", "name": format!("tcp retransmits {tuple}"), "pid": conn.pid, "ts": now_us,
                    "args": { "retransmits": 0 },
                }));
            }
        }
        self.last = seen;
        for gpu in &gpus.gpus {
            let pid = format!("gpu{}", gpu.index);
            let label = match &gpu.name {
                Some(name) => format!("GPU {} ({name})", gpu.index),
                None => format!("GPU {}", gpu.index),
            };
            self.gpu_names.insert(
                pid.clone(),
                json!({ "ph": "M", "name": "process_name", "pid": pid, "args": { "name": label } }),
            );
            let mut counter = |name: &str, args: Value| {
                self.samples.push_back(
                    json!({ "ph": "C", "cat": "gpu", "name": name, "pid": pid, "ts": now_us, "args": args }),
                );
            };
            if gpu.utilization_gpu_percent.is_some() || gpu.utilization_memory_percent.is_some() {
                let mut args = Map::new();
                if let Some(v) = gpu.utilization_gpu_percent {
                    args.insert("gpu_percent".into(), json!(v));
                }
                if let Some(v) = gpu.utilization_memory_percent {
                    args.insert("memory_percent".into(), json!(v));
                }
                counter("utilization", Value::Object(args));
            }
            if let Some(used) = gpu.memory_used_bytes {
                counter("memory used", json!({ "bytes": used }));
            }
            if let Some(watts) = gpu.power_watts {
                counter("power", json!({ "watts": watts }));
            }
            if let Some(celsius) = gpu.temperature_celsius {
                counter("temperature", json!({ "celsius": celsius }));
            }
        }
        self.last_sample_us = Some(now_us);
        self.first_sample_us.get_or_insert(now_us);
        let oldest = now_us - self.window_us;
        while self
            .samples
            .front()
            .and_then(|e| e["ts"].as_f64())
            .is_some_and(|ts| ts < oldest)
        {
            self.samples.pop_front();
        }
    }

    /// The kept samples and the GPUs' `process_name` metadata.
    pub fn events(&self) -> impl Iterator<Item = &Value> {
        self.gpu_names.values().chain(self.samples.iter())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::fake::FakeDevice;
    use crate::gpu::read_device;

    fn ranks(list: &[(usize, u32, &str)]) -> Vec<RankInfo> {
        list.iter()
            .map(|&(rank, pid, host)| RankInfo {
                rank,
                local_rank: rank,
                local_size: list.len(),
                host: host.into(),
                pid,
            })
            .collect()
    }

    fn job(ranks: &[RankInfo]) -> JobRanks<'_> {
        JobRanks {
            job_id: "j1",
            ranks,
            host: "n1",
        }
    }

    fn event(rank: usize, tensor: &str, activity: &str, phase: Phase, ts_us: u64) -> TimelineEvent {
        TimelineEvent {
            rank,
            tensor: tensor.into(),
            activity: activity.into(),
            phase,
            ts_us,
            args: [("bytes".to_owned(), "4096".to_owned())].into(),
        }
    }

    fn timed(events: &[Value]) -> Vec<String> {
        events
            .iter()
            .filter(|e| e["ph"] != "M")
            .map(|e| {
                format!(
                    "{} {} {} {}@{}+{}",
                    e["ph"].as_str().unwrap(),
                    e["pid"],
                    e["tid"].as_str().unwrap(),
                    e["name"].as_str().unwrap(),
                    e["ts"],
                    e["dur"]
                )
            })
            .collect()
    }

    #[test]
    fn job_events_pair_per_tensor_and_land_on_the_monotonic_clock() {
        // Unix 1_700_000_000_000_000 µs is monotonic 5_000_000 µs.
        let offset = 1_700_000_000_000_000 - 5_000_000;
        let base = 1_700_000_000_000_000u64;
        // Rank 2 runs on another host under a pid number that is also ours.
        let list = ranks(&[(0, 4101, "n1"), (1, 4202, "n2"), (2, 4101, "n2")]);
        let j = job(&list);
        let pids: BTreeSet<u32> = [4101].into();
        let local = Here { pids: &pids };
        let events = vec![
            // Arrival order is not time order across ranks.
            event(1, "grad.w", "ALLREDUCE", Phase::Begin, base + 300),
            event(0, "grad.w", "ALLREDUCE", Phase::Begin, base + 100),
            event(0, "grad.w", "QUEUE", Phase::Begin, base + 120),
            event(0, "grad.w", "QUEUE", Phase::End, base + 150),
            event(0, "grad.w", "ALLREDUCE", Phase::End, base + 600),
            event(
                0,
                "grad.b",
                "NEGOTIATE_ALLREDUCE",
                Phase::Instant,
                base + 90,
            ),
            // An end whose begin is gone is dropped.
            event(
                0,
                "grad.b",
                "MEMCPY_IN_FUSION_BUFFER",
                Phase::End,
                base + 95,
            ),
        ];
        let out = job_activities(j, &events, &local, offset, 0.0, 5_001_000.0).to_values();
        let mut got = timed(&out);
        got.sort();
        assert_eq!(
            got,
            [
                "X \"j1 rank 1\" tensor grad.w ALLREDUCE@5000300.0+700.0",
                "X 4101 tensor grad.w ALLREDUCE@5000100.0+500.0",
                "X 4101 tensor grad.w QUEUE@5000120.0+30.0",
                "i 4101 tensor grad.b NEGOTIATE_ALLREDUCE@5000090.0+null",
            ]
        );
        // The open slice says so; args are kept.
        let open = out
            .iter()
            .find(|e| e["pid"] == "j1 rank 1" && e["ph"] == "X")
            .unwrap();
        assert_eq!(open["args"]["open"], true);
        assert_eq!(open["args"]["bytes"], "4096");
        // The remote rank gets its own process, with job and rank.
        let remote = out.iter().find(|e| e["name"] == "process_name").unwrap();
        assert_eq!(remote["pid"], "j1 rank 1");
        assert_eq!(remote["args"]["job"], "j1");
        assert_eq!(remote["args"]["rank"], 1);
        assert!(out.iter().any(|e| e["name"] == "thread_name"
            && e["pid"] == 4101
            && e["tid"] == "tensor grad.w"
            && e["args"]["name"] == "grad.w"));
        assert_eq!(
            local_ranks(&[j], &local),
            [(4101, ("j1".to_owned(), 0))].into()
        );
    }

    #[test]
    fn slices_outside_the_window_are_left_out() {
        let list = ranks(&[(0, 1, "n1")]);
        let j = job(&list);
        let pids: BTreeSet<u32> = [1].into();
        let local = Here { pids: &pids };
        let events = vec![
            event(0, "t", "ALLREDUCE", Phase::Begin, 100),
            event(0, "t", "ALLREDUCE", Phase::End, 200),
            event(0, "t", "ALLREDUCE", Phase::Begin, 900),
            event(0, "t", "ALLREDUCE", Phase::End, 1_100),
        ];
        let out = job_activities(j, &events, &local, 0, 1_000.0, 2_000.0).to_values();
        assert_eq!(timed(&out), ["X 1 tensor t ALLREDUCE@900.0+200.0"]);
    }

    #[test]
    fn cycles_are_slices_on_the_serving_ranks_cycles_track_with_their_bytes() {
        let list = ranks(&[(0, 7, "n1"), (1, 8, "n2")]);
        let pids: BTreeSet<u32> = [7].into();
        let here = Here { pids: &pids };
        let stat =
            |cycle: u64, start: u64, dur: u64, bytes: u64| collectives::control::CycleStats {
                cycle,
                start_unix_us: start,
                duration_us: dur,
                bytes_reduced: bytes,
                bytes_total: bytes,
                tensors: 3,
                fused_buffers: 1,
                knobs: collectives::control::Knobs::default(),
                late: Vec::new(),
                tensors_waited: 0,
                steps: Default::default(),
            };
        // Unix µs 10_000 is trace µs 1_000 (offset 9_000); the window is [1_000, 2_000].
        let stats = [
            stat(1, 9_500, 100, 64),
            stat(2, 10_200, 300, 4096),
            stat(3, 12_000, 10, 1),
        ];
        let (meta, slices) = cycle_slices(job(&list), 0, &stats, &here, 9_000, 1_000.0, 2_000.0);
        assert_eq!(slices.len(), 1, "{slices:?}");
        let c = &slices[0];
        assert_eq!(
            (c.pid.key(), &*c.tid, &*c.name, c.ts, c.dur),
            ("7".to_owned(), CYCLES_TID, "cycle", 1_200.0, Some(300.0))
        );
        assert_eq!(c.args.number("bytes"), Some(4096.0));
        assert_eq!(c.args.number("cycle"), Some(2.0));
        let meta = meta.unwrap();
        assert_eq!((&meta["pid"], &meta["tid"]), (&json!(7), &json!("cycles")));
        // Served by rank 1 (pid 8, not on this node): its track, by its name.
        let (_, other) = cycle_slices(job(&list), 1, &stats, &here, 9_000, 1_000.0, 2_000.0);
        assert_eq!(other[0].pid.key(), "j1 rank 1");
    }

    fn conn(
        pid: u32,
        tx: u64,
        rx: u64,
        retransmits: u64,
        opened_ns: u64,
        closed: bool,
    ) -> Connection {
        Connection {
            pid,
            local: "10.0.0.1:5000".into(),
            remote: "10.0.0.2:6000".into(),
            tx_bytes: tx,
            rx_bytes: rx,
            retransmits,
            srtt_us: 0,
            cwnd: 0,
            opened_ns,
            closed_ns: closed.then_some(opened_ns + 1),
        }
    }

    fn no_gpus() -> GpuSnapshot {
        GpuSnapshot {
            gpus: Vec::new(),
            unavailable_reason: Some("none here".into()),
        }
    }

    #[test]
    fn tcp_counters_are_rates_per_second_per_connection() {
        let mut history = CounterHistory::new(10e6);
        // Before the first sample: no baseline for a connection that already
        // existed, so nothing yet.
        history.sample(1e6, &[conn(7, 1_000, 0, 0, 0, false)], &no_gpus());
        assert_eq!(history.events().count(), 0);
        // 2 s later: 4,000 bytes more sent, 1 retransmit.
        history.sample(3e6, &[conn(7, 5_000, 600, 1, 0, false)], &no_gpus());
        let events: Vec<&Value> = history.events().collect();
        assert_eq!(events.len(), 2);
        let rate = events
            .iter()
            .find(|e| e["name"] == "tcp 10.0.0.1:5000\u{2192}10.0.0.2:6000")
            .unwrap();
        assert_eq!(rate["ph"], "C");
        assert_eq!(rate["pid"], 7);
        assert_eq!(rate["ts"], 1e6);
        assert_eq!(rate["args"]["tx_bytes_per_s"], 2_000.0);
        assert_eq!(rate["args"]["rx_bytes_per_s"], 300.0);
        let retrans = events
            .iter()
            .find(|e| e["name"] == "tcp retransmits 10.0.0.1:5000\u{2192}10.0.0.2:6000")
            .unwrap();
        assert_eq!(retrans["args"]["retransmits"], 1);
        // A connection opened (monotonic 3.5 s) and closed since: counted
        // from zero, then a zero sample at the close; nothing afterwards.
        let mut other = conn(8, 1_000_000, 0, 0, 3_500_000_000, true);
        other.remote = "10.0.0.3:1".into();
        history.sample(
            4e6,
            &[conn(7, 5_000, 600, 1, 0, false), other.clone()],
            &no_gpus(),
        );
        history.sample(5e6, &[conn(7, 5_000, 600, 1, 0, false), other], &no_gpus());
        let closed: Vec<(f64, f64)> = history
            .events()
            .filter(|e| {
                e["pid"] == 8 && e["cat"] == "tcp" && e["args"].get("tx_bytes_per_s").is_some()
            })
            .map(|e| {
                (
                    e["ts"].as_f64().unwrap(),
                    e["args"]["tx_bytes_per_s"].as_f64().unwrap(),
                )
            })
            .collect();
        assert_eq!(closed, [(3e6, 1_000_000.0), (4e6, 0.0)]);
        // The window keeps 10 s: an old sample goes.
        history.sample(14.5e6, &[], &no_gpus());
        assert!(history.events().all(|e| e["ts"].as_f64().unwrap() >= 4.5e6));
    }

    #[test]
    fn gpu_figures_become_counter_tracks_per_gpu() {
        let device = FakeDevice {
            power_mw: Some(312_500),
            ..FakeDevice::default()
        };
        let gpus = GpuSnapshot {
            gpus: vec![read_device(&device, 0)],
            unavailable_reason: None,
        };
        let mut history = CounterHistory::new(60e6);
        history.sample(2e6, &[], &gpus);
        let events: Vec<&Value> = history.events().collect();
        let name = events.iter().find(|e| e["ph"] == "M").unwrap();
        assert_eq!(name["pid"], "gpu3");
        assert_eq!(name["args"]["name"], "GPU 3 (Fake H100)");
        let counter = |n: &str| {
            events
                .iter()
                .find(|e| e["ph"] == "C" && e["name"] == n)
                .unwrap_or_else(|| panic!("no {n} counter: {events:?}"))
        };
        assert_eq!(
            counter("utilization")["args"],
            json!({"gpu_percent": 87, "memory_percent": 41})
        );
        assert_eq!(counter("memory used")["args"]["bytes"], 10u64 << 30);
        assert_eq!(counter("power")["args"]["watts"], 312.5);
        assert_eq!(counter("temperature")["args"]["celsius"], 64);
        assert!(
            events
                .iter()
                .filter(|e| e["ph"] == "C")
                .all(|e| e["pid"] == "gpu3" && e["ts"] == 2e6)
        );
        // An unsupported figure is simply absent.
        let device = FakeDevice::default();
        let mut history = CounterHistory::new(60e6);
        let gpus = GpuSnapshot {
            gpus: vec![read_device(&device, 0)],
            unavailable_reason: None,
        };
        history.sample(1e6, &[], &gpus);
        assert!(!history.events().any(|e| e["name"] == "power"));
        // No GPU: no GPU tracks.
        let mut history = CounterHistory::new(60e6);
        history.sample(1e6, &[], &no_gpus());
        assert_eq!(history.events().count(), 0);
    }
}
