//! `tuning`: the agent's tuning sessions. For one job (found by the `jobs`
//! registry) a session opens its own control connection on a dedicated std
//! thread, claims the job's tuning, and runs `tuner::session::TuningSession`
//! over it: apply knobs (`set_knobs`, waiting for `knobs_applied`), feed the
//! job's per-cycle statistics into the session, judge each window (with
//! eBPF's view of run-queue waits and TCP retransmits when the agent has
//! one), and at the end pin the best knobs, release the claim and write the
//! report.
//!
//! It must never block a tokio worker (all socket I/O is on the session's
//! own thread), and never touch a job after its connection broke: a job
//! whose agent dies or whose socket breaks keeps the knobs it has (that is
//! the job's side of the protocol).

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::path::PathBuf;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use collectives::control::{ControlClient, ControlError, KnobUpdate, Knobs, ServerMessage};
use serde::{Deserialize, Serialize};
use tuner::session::{
    CycleObservation, FixedKnobs, KnobBounds, SessionConfig, Step, TuningSession, Verdict, Window,
};
use tuner::space::CollectiveKnobs;

use crate::cluster::Cluster;
use crate::jobs::{JobSnapshot, JobState, Jobs};
use crate::reports::{ReportMeta, Reports, report_id};

// ---------------------------------------------------------------------------
// Knobs: the wire's and the tuner's, converted here and nowhere else.

/// The tuner's view of the job's knobs (cycle time in ms).
pub fn to_tuner_knobs(knobs: &Knobs) -> CollectiveKnobs {
    CollectiveKnobs {
        fusion_threshold_bytes: knobs.fusion_threshold_bytes,
        cycle_time_ms: knobs.cycle_time_us as f64 / 1_000.0,
        hierarchical_allreduce: knobs.hierarchical_allreduce,
    }
}

/// The wire's knobs for the tuner's (cycle time rounded to whole µs, at
/// least 1 µs).
pub fn to_wire_knobs(knobs: &CollectiveKnobs) -> Knobs {
    let cycle_time_us = if knobs.cycle_time_ms.is_finite() {
        (knobs.cycle_time_ms * 1_000.0).round().max(1.0) as u64
    } else {
        collectives::control::DEFAULT_CYCLE_TIME_US
    };
    Knobs {
        fusion_threshold_bytes: knobs.fusion_threshold_bytes,
        cycle_time_us,
        hierarchical_allreduce: knobs.hierarchical_allreduce,
    }
}

fn full_update(knobs: &Knobs) -> KnobUpdate {
    KnobUpdate {
        fusion_threshold_bytes: Some(knobs.fusion_threshold_bytes),
        cycle_time_us: Some(knobs.cycle_time_us),
        hierarchical_allreduce: Some(knobs.hierarchical_allreduce),
    }
}

// ---------------------------------------------------------------------------
// The request (Contract C's POST body) and the session JSON.

/// Narrower search ranges (`[lo, hi]`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BoundsRequest {
    /// Fusion threshold range in bytes.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::pair"
    )]
    pub fusion_threshold_bytes: Option<[u64; 2]>,
    /// Cycle time range in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cycle_time_ms: Option<[f64; 2]>,
}

/// Knobs kept fixed (not searched).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct FixedRequest {
    /// Fixed fusion threshold in bytes.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub fusion_threshold_bytes: Option<u64>,
    /// Fixed cycle time in ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cycle_time_ms: Option<f64>,
    /// Fixed hierarchical-allreduce switch.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub hierarchical_allreduce: Option<bool>,
}

/// Whole numbers as JSON Schema counts them: `154985.0` is the integer
/// 154985 (clients that write every number as a float send it so), and
/// `1.5` or `-1` is refused, naming the value.
mod whole {
    use serde::de::Error;
    use serde::{Deserialize, Deserializer};

    fn to_u64<E: Error>(n: &serde_json::Number) -> Result<u64, E> {
        n.as_u64()
            .or_else(|| {
                // serde_json's float parsing may land one unit in the last
                // place off the text's value (4085693372319842.0 reads as
                // …841.5): within that, the text was whole.
                n.as_f64()
                    .filter(|f| {
                        (f - f.round()).abs() <= f.abs() * f64::EPSILON
                            && (0.0..18_446_744_073_709_551_616.0).contains(f)
                    })
                    .map(|f| f.round() as u64)
            })
            .ok_or_else(|| E::custom(format!("{n} is not a whole number of 0 or more")))
    }

    pub fn one<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Option::<serde_json::Number>::deserialize(d)?
            .map(|n| to_u64(&n))
            .transpose()
    }

    pub fn size<'de, D: Deserializer<'de>>(d: D) -> Result<Option<usize>, D::Error> {
        one(d)?
            .map(|n| usize::try_from(n).map_err(|_| D::Error::custom(format!("{n} is too large"))))
            .transpose()
    }

    pub fn pair<'de, D: Deserializer<'de>>(d: D) -> Result<Option<[u64; 2]>, D::Error> {
        Option::<[serde_json::Number; 2]>::deserialize(d)?
            .map(|[a, b]| Ok([to_u64(&a)?, to_u64(&b)?]))
            .transpose()
    }
}

/// `POST /api/jobs/{id}/tuning`'s body; every field is optional.
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct TuningRequest {
    /// Samples (optimizer observations), default 20.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::size"
    )]
    pub budget: Option<usize>,
    /// Cycles with work skipped after knobs are applied, default 3.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub warmup_cycles: Option<u64>,
    /// Cycles with work per measured window (at least), default 10.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub measured_cycles: Option<u64>,
    /// Shortest measured window in ms, default 1000.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub min_window_ms: Option<u64>,
    /// Seed of the optimizer, default 0.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub seed: Option<u64>,
    /// Narrower ranges.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bounds: Option<BoundsRequest>,
    /// Knobs not searched.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fixed: Option<FixedRequest>,
}

/// The request with every default filled in (the session JSON's `config`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ResolvedConfig {
    /// Samples.
    pub budget: usize,
    /// Warm-up cycles per sample.
    pub warmup_cycles: u64,
    /// Measured cycles per window (at least).
    pub measured_cycles: u64,
    /// Shortest window, ms.
    pub min_window_ms: u64,
    /// Optimizer seed.
    pub seed: u64,
    /// Narrower ranges.
    pub bounds: BoundsRequest,
    /// Knobs not searched.
    pub fixed: FixedRequest,
}

impl TuningRequest {
    /// Fills in the defaults.
    pub fn resolve(&self) -> ResolvedConfig {
        ResolvedConfig {
            budget: self.budget.unwrap_or(20),
            warmup_cycles: self.warmup_cycles.unwrap_or(3),
            measured_cycles: self.measured_cycles.unwrap_or(10),
            min_window_ms: self.min_window_ms.unwrap_or(1_000),
            seed: self.seed.unwrap_or(0),
            bounds: self.bounds.clone().unwrap_or_default(),
            fixed: self.fixed.clone().unwrap_or_default(),
        }
    }
}

impl ResolvedConfig {
    /// The tuner's configuration, starting from the job's `start` knobs.
    pub fn session_config(&self, start: &Knobs) -> SessionConfig {
        let bounds = KnobBounds {
            fusion_threshold_bytes: self.bounds.fusion_threshold_bytes.map(|[lo, hi]| (lo, hi)),
            cycle_time_ms: self.bounds.cycle_time_ms.map(|[lo, hi]| (lo, hi)),
        };
        let fixed = FixedKnobs {
            fusion_threshold_bytes: self.fixed.fusion_threshold_bytes,
            cycle_time_ms: self.fixed.cycle_time_ms,
            hierarchical_allreduce: self.fixed.hierarchical_allreduce,
        };
        SessionConfig {
            budget: self.budget,
            warmup_cycles: self.warmup_cycles,
            measured_cycles: self.measured_cycles,
            min_window_us: self.min_window_ms.saturating_mul(1_000),
            seed: self.seed,
            start: to_tuner_knobs(start),
            bounds,
            fixed,
            ..SessionConfig::default()
        }
    }
}

/// Where a session is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Sampling.
    Running,
    /// Ended by its budget or convergence; best knobs pinned.
    Done,
    /// Ended by a stop request.
    Stopped,
    /// Ended by an error (see `error`); the job was left as it was.
    Failed,
}

/// A measured window, as the session JSON shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct WindowView {
    /// First cycle in the window.
    pub first_cycle: u64,
    /// Last cycle in the window.
    pub last_cycle: u64,
    /// Cycles with work in it.
    pub cycles: u64,
    /// Its length, seconds (job clock).
    pub duration_s: f64,
}

/// One sample, as the session JSON shows it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SampleView {
    /// Sample index (0 = the starting knobs).
    pub index: usize,
    /// The knobs measured (as sent to the job).
    pub knobs: Knobs,
    /// Bytes reduced per second in the window.
    pub score_bytes_per_s: f64,
    /// Extra observation noise given to the GP (disturbed windows).
    pub noise_hint: Option<f64>,
    /// Why the recorded window was disturbed, if it was.
    pub disturbed: Option<String>,
    /// Why an earlier window of this sample was measured again, if it was.
    pub remeasured_because: Option<String>,
    /// Seconds since the session started.
    pub wall_time_s: f64,
    /// The window.
    pub window: WindowView,
}

/// The best knobs (by the GP's posterior mean).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct BestView {
    /// The knobs.
    pub knobs: Knobs,
    /// The GP's predicted score, bytes/s.
    pub predicted_score_bytes_per_s: f64,
    /// The sample that measured them.
    pub sample: usize,
}

/// One window of the confirmation before pinning.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ConfirmationWindowView {
    /// `choice` (the optimizer's) or `start` (the job's first knobs).
    pub candidate: String,
    /// Bytes reduced per second in the window.
    pub score_bytes_per_s: f64,
    /// Why it was disturbed, if it was (kept after one re-measurement).
    pub disturbed: Option<String>,
    /// Seconds since the session started.
    pub wall_time_s: f64,
}

/// The optimizer's choice against the start on fresh interleaved windows,
/// before anything is pinned.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ConfirmationView {
    /// The optimizer's choice.
    pub choice: Knobs,
    /// Its sample.
    pub choice_sample: usize,
    /// The windows, in the order measured.
    pub windows: Vec<ConfirmationWindowView>,
    /// Median score of the choice's windows, once decided.
    pub choice_median_bytes_per_s: Option<f64>,
    /// Median score of the start's windows, once decided.
    pub start_median_bytes_per_s: Option<f64>,
    /// The gain over the start the choice had to show (0.03 = 3%).
    pub required_gain: Option<f64>,
    /// `choice` or `start`: what is pinned, once decided.
    pub kept: Option<String>,
}

/// The session JSON (Contract C).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct SessionView {
    /// The job tuned.
    pub job_id: String,
    /// Where the session is.
    pub state: SessionState,
    /// Why it failed.
    pub error: Option<String>,
    /// When it started, ms since the Unix epoch.
    pub started_unix_ms: u64,
    /// The configuration, defaults filled in.
    pub config: ResolvedConfig,
    /// The job's knobs when the session started.
    pub start_knobs: Knobs,
    /// The knobs in force now (as last confirmed by the job).
    pub current_knobs: Knobs,
    /// The samples so far.
    pub samples: Vec<SampleView>,
    /// The best knobs so far.
    pub best: Option<BestView>,
    /// The best sample's measured score over sample 0's.
    pub speedup_over_start: Option<f64>,
    /// The report, once written.
    pub report_id: Option<String>,
    /// Whether eBPF judges the windows, or why not.
    pub disturbance_detection: String,
    /// Why the optimizer stopped (`budget`, `converged`), or `stopped`.
    pub stop_reason: Option<String>,
    /// The confirmation before pinning (`null` until it starts, and when the
    /// choice is the start).
    #[serde(default)]
    pub confirmation: Option<ConfirmationView>,
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
}

// ---------------------------------------------------------------------------
// Disturbance: eBPF's run-queue waits and retransmits during a window.

/// Sub-windows a window is scored by (their median rate) when no eBPF
/// tells the session which windows were disturbed.
pub const UNOBSERVED_SUB_WINDOWS: usize = 3;

/// Run-queue waits below this many ms per second of window never count as
/// a disturbance (a quiet job's baseline can be near zero).
pub const RUN_QUEUE_FLOOR_MS_PER_S: f64 = 5.0;

/// A window is disturbed when the job's run-queue wait rate (or its TCP
/// retransmit rate) exceeds this many times its usual (median) rate.
pub const RUN_QUEUE_FACTOR: f64 = 3.0;

/// Earlier judged windows a session needs before any window can be judged
/// disturbed, by either signal. "Disturbed" means "unlike this job's usual",
/// and with fewer windows there is no usual: the first window of a job on a
/// saturated link retransmits as much as every later one will, and calling
/// it disturbed only gave a good point a noise hint. Three is the fewest
/// whose median one odd window cannot set; the windows before them are
/// scored as measured (in a tuning session, usually the start point and
/// the next two samples: a few seconds of the job).
pub const MIN_USUAL_WINDOWS: usize = 3;

/// What one process of the job did during a window (from eBPF).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PidLoad {
    /// The process.
    pub pid: u32,
    /// Time its threads waited on the run queue, ns.
    pub run_queue_ns: u64,
    /// TCP segments it retransmitted.
    pub retransmits: u64,
}

/// The job's processes during one window.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowLoad {
    /// Seconds the figures cover (about the window).
    pub span_s: f64,
    /// Per process.
    pub pids: Vec<PidLoad>,
}

impl WindowLoad {
    /// The job's run-queue wait, ms per second of window (all its processes).
    pub fn run_queue_ms_per_s(&self) -> f64 {
        if self.span_s <= 0.0 {
            return 0.0;
        }
        let ns: u64 = self.pids.iter().map(|p| p.run_queue_ns).sum();
        ns as f64 / 1e6 / self.span_s
    }

    /// TCP segments the job retransmitted during the window.
    pub fn retransmits(&self) -> u64 {
        self.pids.iter().map(|p| p.retransmits).sum()
    }

    /// The window's rates, for the session's notion of "usual".
    pub fn rates(&self) -> WindowRates {
        WindowRates {
            run_queue_ms_per_s: self.run_queue_ms_per_s(),
            retransmits_per_s: if self.span_s > 0.0 {
                self.retransmits() as f64 / self.span_s
            } else {
                0.0
            },
        }
    }
}

/// One judged window's rates.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct WindowRates {
    /// Run-queue wait, ms per second.
    pub run_queue_ms_per_s: f64,
    /// TCP retransmits per second.
    pub retransmits_per_s: f64,
}

/// Why a window was disturbed, or `None`. `usual` holds the rates of this
/// session's earlier judged windows; "usual" is their median, so a
/// minority of disturbed windows does not move it. With fewer than
/// [`MIN_USUAL_WINDOWS`] of them there is no usual rate and nothing is
/// judged: never disturbed for lack of a baseline.
/// - Run-queue waits: disturbed above [`RUN_QUEUE_FACTOR`] × the usual
///   rate and above [`RUN_QUEUE_FLOOR_MS_PER_S`].
/// - TCP retransmits: disturbed above [`RUN_QUEUE_FACTOR`] × the usual
///   rate, so a job that retransmits all the time (a saturated or
///   rate-limited link, loopback under CPU starvation) is disturbed only
///   by a burst well above its own rate; while the usual rate is zero any
///   retransmit disturbs. There is deliberately no floor (such as 1/s, as
///   run-queue waits have 5 ms/s): a job whose median window has none has
///   shown that its links do not drop, and one segment that times out
///   stalls the ring for Linux's minimum RTO (200 ms), 10–20% of a 1–2 s
///   window, more than the gaps between good points; a floor per second
///   would pass exactly that lone timeout in a window over 1 s. A false
///   alarm costs one window measured again, a missed one a wrong score.
pub fn disturbance_reason(load: &WindowLoad, usual: &[WindowRates]) -> Option<String> {
    if usual.len() < MIN_USUAL_WINDOWS {
        return None;
    }
    let mut reasons = Vec::new();
    let rates = load.rates();
    let usual_run_queue: Vec<f64> = usual.iter().map(|r| r.run_queue_ms_per_s).collect();
    if let Some(usual) = median(&usual_run_queue)
        && rates.run_queue_ms_per_s > RUN_QUEUE_FLOOR_MS_PER_S
        && rates.run_queue_ms_per_s > RUN_QUEUE_FACTOR * usual
    {
        let worst = load
            .pids
            .iter()
            .max_by_key(|p| p.run_queue_ns)
            .map(|p| format!(" (pid {})", p.pid))
            .unwrap_or_default();
        reasons.push(format!(
            "run-queue wait {:.0} ms/s vs {usual:.0} ms/s usual{worst}",
            rates.run_queue_ms_per_s
        ));
    }
    let retransmits = load.retransmits();
    let usual_retransmits: Vec<f64> = usual.iter().map(|r| r.retransmits_per_s).collect();
    let usual_retransmits = median(&usual_retransmits).unwrap_or(0.0);
    if retransmits > 0 && rates.retransmits_per_s > RUN_QUEUE_FACTOR * usual_retransmits {
        let pids: Vec<String> = load
            .pids
            .iter()
            .filter(|p| p.retransmits > 0)
            .map(|p| format!("pid {}", p.pid))
            .collect();
        let plural = if retransmits == 1 { "" } else { "s" };
        let versus = if usual_retransmits > 0.0 {
            format!(
                "{:.1}/s vs {usual_retransmits:.1}/s usual; ",
                rates.retransmits_per_s
            )
        } else {
            String::new()
        };
        reasons.push(format!(
            "{retransmits} TCP retransmit{plural} ({versus}{})",
            pids.join(", ")
        ));
    }
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

fn median(values: &[f64]) -> Option<f64> {
    let mut sorted: Vec<f64> = values.iter().copied().filter(|v| v.is_finite()).collect();
    if sorted.is_empty() {
        return None;
    }
    sorted.sort_by(f64::total_cmp);
    let mid = sorted.len() / 2;
    Some(if sorted.len() % 2 == 1 {
        sorted[mid]
    } else {
        (sorted[mid - 1] + sorted[mid]) / 2.0
    })
}

/// How far back the first recording, and the first copy of a thread the
/// feed has not copied before, reads the model (intervals are recorded
/// when they end, so a wait that began before the last recording may only
/// appear now).
const FEED_REREAD_NS: u64 = 2_000_000_000;

/// A stretch in which more than this share of the kernel's records was
/// lost says too little about the job's waits to judge a window by.
const MAX_LOST_SHARE: f64 = 0.01;

/// How long the feed keeps waits and retransmits. A busy 4-rank job has
/// ~15k run-queue waits a second; 120 s of them were ~90 MB of the agent
/// (30 s are ~11 MB). Windows that began more than this long ago are not
/// judged, and the log says so.
const FEED_KEEP_NS: u64 = 30_000_000_000;

/// One run-queue wait of a watched thread, as the feed keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct FeedWait {
    start_ns: u64,
    duration_ns: u64,
    pid: u32,
}

impl FeedWait {
    fn end_ns(&self) -> u64 {
        self.start_ns.saturating_add(self.duration_ns)
    }
}

#[derive(Debug, Default)]
struct FeedData {
    /// Run-queue waits of watched threads, in the order they were copied
    /// (within a quarter of a second of the order they ended). Appended
    /// and dropped from the front: a tree keyed by start time cost the
    /// agent ~1% of a core in inserts alone under a busy job.
    waits: VecDeque<FeedWait>,
    /// Per watched thread, the end of the newest interval copied
    /// (monotonic ns): each recording copies only what ended after it.
    copied_until: HashMap<u32, u64>,
    /// TCP retransmits: (ts ns, pid) → how many at that instant.
    retransmits: BTreeMap<(u64, u32), u64>,
    /// The model was read up to here (CLOCK_MONOTONIC ns); 0: never.
    covered_until_ns: u64,
    /// CLOCK_REALTIME − CLOCK_MONOTONIC when last read, ns.
    unix_minus_monotonic_ns: i128,
    /// Records the kernel could not deliver (ring buffer full) or held
    /// back (per-thread rate limit), at the last reading.
    records_lost: u64,
    /// Records delivered (decoded), at the last reading.
    records_delivered: u64,
    /// Ranges (monotonic ns) during which records were lost: windows that
    /// overlap one are not judged.
    lossy: Vec<(u64, u64)>,
    /// Waits that ended before this are forgotten, and windows that begin
    /// before it are not judged (monotonic ns; 0: none): the last
    /// [`FEED_KEEP_NS`], and nothing before the first recording since the
    /// feed (re)started.
    kept_from_ns: u64,
    /// The first recording since the feed (re)started (monotonic ns).
    started_ns: u64,
    /// Per watched process, readings (monotonic ns, cumulative ns) of the
    /// run-queue time of its waits that stayed in the kernel
    /// (`--min-interval`): not in `waits`, but part of every window.
    unsent_run_queue: BTreeMap<u32, VecDeque<(u64, u64)>>,
}

/// The live eBPF pipeline's run-queue waits and TCP retransmits of the
/// watched processes, copied out of the model several times a second by
/// `serve` (the model itself stays on serve's loop), so a tuning session
/// can say exactly what happened to the job's threads during a window
/// given in the job's Unix-time microseconds.
///
/// Only while someone judges windows by it: a tuning session on this agent,
/// or a peer's (`/api/jobs/{id}/load`, [`LoadFeed::ask`]) in the last
/// [`FEED_ASKED_NS`]. Otherwise `serve` pauses it ([`LoadFeed::pause`]):
/// copying a busy job's waits four times a second was ~12% of the agent's
/// CPU, and kept ~11 MB, for nobody. Windows that began before it started
/// again are not judged.
#[derive(Debug, Default)]
pub struct LoadFeed {
    data: Mutex<FeedData>,
    /// Until when a peer's asks keep the feed recording (monotonic ns).
    asked_until_ns: std::sync::atomic::AtomicU64,
}

/// How long a peer's ask for a window keeps the feed recording: a session
/// asks after every window, so this spans many of them.
const FEED_ASKED_NS: u64 = 120_000_000_000;

/// The run-queue waits among `intervals` (one thread's, newest first, as
/// the model gives them), for `pid`.
fn run_queue_waits(
    pid: u32,
    intervals: &[crate::model::Interval],
) -> impl Iterator<Item = FeedWait> + '_ {
    intervals
        .iter()
        .filter(|i| i.kind == ebpf::IntervalKind::RunQueue)
        .map(move |i| FeedWait {
            start_ns: i.start_ns,
            duration_ns: i.duration_ns,
            pid,
        })
}

/// The run-queue waits of `threads` ((pid, tid) pairs) that ended after
/// the newest interval of theirs already copied (`copied_until`, per tid),
/// or at or after `from` for a thread not copied before; `intervals_since`
/// gives a thread's intervals that ended at or after a time, newest first.
/// Returns them with the new per-thread marks, for the threads given only.
fn copy_new_waits(
    copied_until: &HashMap<u32, u64>,
    from: u64,
    threads: impl Iterator<Item = (u32, u32)>,
    intervals_since: impl Fn(u32, u64) -> Vec<crate::model::Interval>,
) -> (Vec<FeedWait>, HashMap<u32, u64>) {
    let mut waits = Vec::new();
    let mut marks = HashMap::with_capacity(copied_until.len());
    for (pid, tid) in threads {
        let before = copied_until.get(&tid).copied();
        let since = before.map_or(from, |end| end.saturating_add(1));
        let intervals = intervals_since(tid, since);
        waits.extend(run_queue_waits(pid, &intervals));
        let newest = intervals.first().map(|i| i.start_ns + i.duration_ns);
        if let Some(end) = newest.or(before) {
            marks.insert(tid, end);
        }
    }
    (waits, marks)
}

impl LoadFeed {
    /// Copies what the session's model learned since the last call: for
    /// each watched thread, the intervals that ended after the newest one
    /// already copied (a thread seen for the first time: those that ended
    /// in the last [`FEED_REREAD_NS`] before the last recording).
    pub fn record(&self, session: &crate::session::Session) {
        let now = crate::session::monotonic_ns();
        let unix_minus_monotonic_ns = i128::from(unix_us()) * 1_000 - i128::from(now);
        let (from, copied_until) = {
            let mut data = self.lock();
            let from = if data.covered_until_ns == 0 {
                data.started_ns = now;
                now.saturating_sub(FEED_REREAD_NS)
            } else {
                data.covered_until_ns.saturating_sub(FEED_REREAD_NS)
            };
            (from, std::mem::take(&mut data.copied_until))
        };
        let model = &session.model;
        let threads = session
            .watched()
            .iter()
            .flat_map(|&pid| model.tids(pid).into_iter().map(move |tid| (pid, tid)));
        let (waits, now_copied_until) =
            copy_new_waits(&copied_until, from, threads, |tid, since| {
                model.intervals_ended_since(tid, since)
            });
        let retransmits = model.retransmits_between(from, now);
        let (unsent_read_ns, unsent_run_queue) = model.unsent_run_queue_ns();
        let probes = session.probes();
        let records_lost = [
            ebpf::Counter::RingbufDrops,
            ebpf::Counter::IntervalsRateLimited,
        ]
        .into_iter()
        .map(|counter| probes.counter(counter).unwrap_or(0))
        .sum::<u64>();
        let records_delivered = session.events;
        let mut data = self.lock();
        data.copied_until = now_copied_until;
        let lost = records_lost.saturating_sub(data.records_lost);
        let delivered = records_delivered.saturating_sub(data.records_delivered);
        if lost as f64 > MAX_LOST_SHARE * (lost + delivered) as f64 {
            let lost_from = if data.covered_until_ns == 0 {
                0
            } else {
                data.covered_until_ns
            };
            tracing::debug!(
                lost,
                delivered,
                "the kernel lost records: windows across this stretch are not judged"
            );
            data.lossy.push((lost_from, now));
        }
        data.records_lost = records_lost;
        data.records_delivered = records_delivered;
        data.waits.extend(waits);
        // The model is the truth for [from, now): replace that range.
        let stale: Vec<(u64, u32)> = data
            .retransmits
            .range((from, 0)..)
            .map(|(k, _)| *k)
            .collect();
        for key in stale {
            data.retransmits.remove(&key);
        }
        for (ts, pid) in retransmits {
            *data.retransmits.entry((ts, pid)).or_default() += 1;
        }
        let keep_from = now.saturating_sub(FEED_KEEP_NS).max(data.started_ns);
        // Nearly in the order they ended: whatever ended before `keep_from`
        // and is still behind a newer one only goes at the next recording.
        while data.waits.front().is_some_and(|w| w.end_ns() < keep_from) {
            data.waits.pop_front();
        }
        data.retransmits = data.retransmits.split_off(&(keep_from, 0));
        for (pid, ns) in unsent_run_queue {
            let readings = data.unsent_run_queue.entry(pid).or_default();
            if readings.back().is_none_or(|(ts, _)| *ts < unsent_read_ns) {
                readings.push_back((unsent_read_ns, ns));
            }
        }
        data.unsent_run_queue.retain(|_, readings| {
            while readings.len() > 1 && readings.get(1).is_some_and(|(ts, _)| *ts < keep_from) {
                readings.pop_front();
            }
            readings.back().is_some_and(|(ts, _)| *ts >= keep_from)
        });
        data.lossy.retain(|&(_, end)| end >= keep_from);
        data.kept_from_ns = keep_from;
        data.covered_until_ns = now;
        data.unix_minus_monotonic_ns = unix_minus_monotonic_ns;
    }

    fn lock(&self) -> MutexGuard<'_, FeedData> {
        self.data
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A peer judges a window by this feed: keep recording for
    /// [`FEED_ASKED_NS`] from now.
    pub fn ask(&self) {
        let until = crate::session::monotonic_ns().saturating_add(FEED_ASKED_NS);
        self.asked_until_ns
            .fetch_max(until, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a peer asked within the last [`FEED_ASKED_NS`] (at `now`,
    /// monotonic ns).
    pub fn asked(&self, now: u64) -> bool {
        now < self
            .asked_until_ns
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Stops the feed: what it kept goes, and the next recording starts it
    /// afresh (windows before that are not judged).
    pub fn pause(&self) {
        let mut data = self.lock();
        if data.covered_until_ns != 0 {
            *data = FeedData::default();
            tracing::debug!("no tuning session reads the eBPF feed: paused");
        }
    }

    /// Whether the feed has read the model past `unix_us` (µs since the
    /// Unix epoch).
    pub fn covers(&self, unix_us: u64) -> bool {
        let data = self.lock();
        data.covered_until_ns != 0
            && i128::from(data.covered_until_ns)
                >= i128::from(unix_us) * 1_000 - data.unix_minus_monotonic_ns
    }

    /// What `pids` went through between `from_us` and `to_us` (µs since
    /// the Unix epoch), as far as the feed has read the model; `None` when
    /// it has read nothing of that range.
    pub fn window(&self, pids: &BTreeSet<u32>, from_us: u64, to_us: u64) -> Option<WindowLoad> {
        let data = self.lock();
        if data.covered_until_ns == 0 {
            return None;
        }
        let to_monotonic = |unix_us: u64| {
            let ns = i128::from(unix_us) * 1_000 - data.unix_minus_monotonic_ns;
            u64::try_from(ns.max(0)).unwrap_or(u64::MAX)
        };
        let from_ns = to_monotonic(from_us);
        let to_ns = to_monotonic(to_us).min(data.covered_until_ns);
        if to_ns <= from_ns {
            return None;
        }
        if from_ns < data.kept_from_ns {
            tracing::info!(
                window_s = (to_ns - from_ns) as f64 / 1e9,
                "this window began before what the eBPF feed keeps (the last 30 s, since it \
                 last started): it is not judged"
            );
            return None;
        }
        if data
            .lossy
            .iter()
            .any(|&(start, end)| start < to_ns && end > from_ns)
        {
            tracing::debug!("records were lost during this window: it is not judged");
            return None;
        }
        let mut per_pid: BTreeMap<u32, PidLoad> = pids
            .iter()
            .map(|&pid| {
                (
                    pid,
                    PidLoad {
                        pid,
                        run_queue_ns: 0,
                        retransmits: 0,
                    },
                )
            })
            .collect();
        // A few hundred thousand at most, read a few times a window.
        for wait in &data.waits {
            let overlap = wait
                .end_ns()
                .min(to_ns)
                .saturating_sub(wait.start_ns.max(from_ns));
            if overlap > 0
                && let Some(load) = per_pid.get_mut(&wait.pid)
            {
                load.run_queue_ns += overlap;
            }
        }
        for (pid, load) in &mut per_pid {
            if let Some(readings) = data.unsent_run_queue.get(pid) {
                let at = |t| crate::model::cumulative_at(readings, t, |&ns| ns as f64);
                load.run_queue_ns += (at(to_ns) - at(from_ns)).max(0.0).round() as u64;
            }
        }
        for (&(_, pid), &count) in data.retransmits.range((from_ns, 0)..(to_ns, 0)) {
            if let Some(load) = per_pid.get_mut(&pid) {
                load.retransmits += count;
            }
        }
        Some(WindowLoad {
            span_s: (to_ns - from_ns) as f64 / 1e9,
            pids: per_pid.into_values().collect(),
        })
    }
}

/// Whether windows are judged with eBPF.
#[derive(Debug, Clone)]
pub enum Disturbance {
    /// Judged from this feed.
    Ebpf(Arc<LoadFeed>),
    /// Not judged, for this reason (`off: …`).
    Off(String),
}

impl Disturbance {
    /// For the session JSON.
    pub fn describe(&self) -> String {
        match self {
            Self::Ebpf(_) => "on: eBPF run-queue waits and TCP retransmits".to_owned(),
            Self::Off(why) => why.clone(),
        }
    }
}

// ---------------------------------------------------------------------------
// The sessions.

/// Limits on talking to a job.
#[derive(Debug, Clone)]
pub struct TuningLimits {
    /// Connecting and reading `hello`; also claim/release answers.
    pub connect_timeout: Duration,
    /// Waiting for `knobs_applied`.
    pub apply_timeout: Duration,
    /// A job that reports no cycle with work for this long fails the session.
    pub idle_timeout: Duration,
}

impl Default for TuningLimits {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            apply_timeout: Duration::from_secs(30),
            idle_timeout: Duration::from_secs(60),
        }
    }
}

/// Why a session could not start (mapped to HTTP statuses by the API).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// No such job.
    #[error("{0}")]
    NotFound(String),
    /// A session already runs, the job is lost, or the job refused the claim.
    #[error("{0}")]
    Conflict(String),
    /// The request is not a valid session configuration.
    #[error("{0}")]
    BadRequest(String),
    /// The job's control socket could not be used.
    #[error("{0}")]
    Unavailable(String),
}

/// How a stop request leaves the job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keep {
    /// On the best knobs found.
    Best,
    /// On the knobs it had when the session started.
    Start,
}

struct Handle {
    view: Mutex<SessionView>,
    stop: Mutex<Option<Keep>>,
}

impl Handle {
    fn view(&self) -> MutexGuard<'_, SessionView> {
        self.view
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn stop_request(&self) -> Option<Keep> {
        *self
            .stop
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// Every tuning session of this agent (one per job at a time; the last one
/// of each job is kept for `GET`).
pub struct Tunings {
    jobs: Jobs,
    reports: Reports,
    disturbance: Disturbance,
    limits: TuningLimits,
    sessions: Mutex<BTreeMap<String, Arc<Handle>>>,
    /// The agent's peers, and the runtime their calls run on: a multi-node
    /// job's windows are judged on every node.
    cluster: Mutex<Option<(Arc<Cluster>, tokio::runtime::Handle)>>,
}

/// A node of a multi-node job whose agent judges the job's windows there.
struct PeerNode {
    addr: String,
    node: String,
    usual: Vec<WindowRates>,
}

impl Tunings {
    /// Sessions over `jobs`' jobs, reports into `reports`.
    pub fn new(
        jobs: Jobs,
        reports: Reports,
        disturbance: Disturbance,
        limits: TuningLimits,
    ) -> Self {
        Self {
            jobs,
            reports,
            disturbance,
            limits,
            sessions: Mutex::new(BTreeMap::new()),
            cluster: Mutex::new(None),
        }
    }

    /// Judges multi-node jobs' windows on every node too, asking `cluster`'s
    /// peers (calls run on `runtime`).
    pub fn set_cluster(&self, cluster: Arc<Cluster>, runtime: tokio::runtime::Handle) {
        if let Ok(mut slot) = self.cluster.lock() {
            *slot = Some((cluster, runtime));
        }
    }

    /// The agents of `job`'s other hosts (those that list it), when it has
    /// other hosts and this agent has peers.
    fn peer_nodes(&self, job: &JobSnapshot) -> Vec<PeerNode> {
        if job.hosts().len() < 2 {
            return Vec::new();
        }
        let Some((cluster, runtime)) = self.cluster.lock().ok().and_then(|c| c.clone()) else {
            return Vec::new();
        };
        if !cluster.has_peers() {
            tracing::info!(
                job_id = job.job_id,
                hosts = ?job.hosts(),
                "a multi-node job, but this agent has no peers (--peers, --peers-dns): only \
                 this node's ranks are judged"
            );
            return Vec::new();
        }
        let answers =
            runtime.block_on(cluster.ask_all("/api/jobs", crate::cluster::MAX_SMALL_ANSWER_BYTES));
        let mut nodes = Vec::new();
        for answer in answers {
            let lists_job = answer.result.as_ref().ok().is_some_and(|v| {
                v.get("jobs")
                    .and_then(serde_json::Value::as_array)
                    .is_some_and(|jobs| {
                        jobs.iter().any(|j| {
                            j.get("job_id").and_then(serde_json::Value::as_str)
                                == Some(job.job_id.as_str())
                        })
                    })
            });
            if lists_job {
                nodes.push(PeerNode {
                    node: answer.node.clone().unwrap_or_else(|| answer.addr.clone()),
                    addr: answer.addr,
                    usual: Vec::new(),
                });
            } else if let Err(why) = &answer.result {
                tracing::warn!(
                    peer = answer.addr,
                    why,
                    "a peer did not answer: its node's windows are not judged"
                );
            }
        }
        tracing::info!(
            job_id = job.job_id,
            nodes = ?nodes.iter().map(|n| n.node.as_str()).collect::<Vec<_>>(),
            "the job's windows are judged on these nodes too"
        );
        nodes
    }

    /// One peer's verdict on a window: its node's load (asked on its clock),
    /// judged against that node's usual rates.
    fn judge_on_peer(&self, peer: &mut PeerNode, job_id: &str, window: &Window) -> Option<String> {
        let (cluster, runtime) = self.cluster.lock().ok().and_then(|c| c.clone())?;
        let answer = runtime.block_on(async {
            let clock = cluster.clock(&peer.addr).await?;
            let shift = |us: u64| (us as f64 + clock.offset_us).max(0.0) as u64;
            let path = format!(
                "/api/jobs/{job_id}/load?from_unix_us={}&to_unix_us={}",
                shift(window.start_unix_us),
                shift(window.end_unix_us)
            );
            crate::cluster::get_json(&peer.addr, &path, cluster.timeout() * 2, 1 << 20).await
        });
        let load: WindowLoad = match answer.and_then(|v| {
            serde_json::from_value(v).map_err(|e| format!("its load answer is malformed: {e}"))
        }) {
            Ok(load) => load,
            Err(why) => {
                tracing::info!(
                    node = peer.node,
                    why,
                    "no figures from this node for the window: judged without them"
                );
                return None;
            }
        };
        let reason = disturbance_reason(&load, &peer.usual);
        peer.usual.push(load.rates());
        reason.map(|r| format!("node {}: {r}", peer.node))
    }

    /// The reports directory.
    pub fn reports(&self) -> &Reports {
        &self.reports
    }

    fn sessions(&self) -> MutexGuard<'_, BTreeMap<String, Arc<Handle>>> {
        self.sessions
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The session of `job_id` (running or the last one), if any.
    pub fn get(&self, job_id: &str) -> Option<SessionView> {
        self.sessions().get(job_id).map(|h| h.view().clone())
    }

    /// Whether any session is running.
    pub fn any_running(&self) -> bool {
        self.sessions()
            .values()
            .any(|h| h.view().state == SessionState::Running)
    }

    /// Every job's latest session.
    pub fn all(&self) -> Vec<SessionView> {
        self.sessions().values().map(|h| h.view().clone()).collect()
    }

    /// Asks the running session of `job_id` to stop (the job left as `keep`
    /// says); returns its view, `None` when the job never had a session.
    pub fn stop(&self, job_id: &str, keep: Keep) -> Option<SessionView> {
        let handle = self.sessions().get(job_id).cloned()?;
        if handle.view().state == SessionState::Running {
            let mut stop = handle
                .stop
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            stop.get_or_insert(keep);
        }
        let view = handle.view().clone();
        Some(view)
    }

    /// Stops every running session (best knobs kept) and waits up to
    /// `limit` for them to end (the agent is shutting down).
    pub fn stop_all(&self, limit: Duration) {
        let running: Vec<String> = self
            .sessions()
            .iter()
            .filter(|(_, h)| h.view().state == SessionState::Running)
            .map(|(job_id, _)| job_id.clone())
            .collect();
        if running.is_empty() {
            return;
        }
        tracing::info!(
            sessions = running.len(),
            "stopping the running tuning sessions (best knobs kept)"
        );
        for job_id in &running {
            self.stop(job_id, Keep::Best);
        }
        let deadline = Instant::now() + limit;
        while self.all().iter().any(|v| v.state == SessionState::Running) {
            if Instant::now() >= deadline {
                tracing::warn!(
                    "tuning sessions still running after {limit:?}; their jobs keep the knobs \
                     they have"
                );
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Checks the request, reserves the job's session slot and starts the
    /// session's thread; the receiver answers once the session holds the
    /// job's claim (or why it could not).
    pub fn start(
        self: &Arc<Self>,
        job_id: &str,
        request: &TuningRequest,
    ) -> Result<tokio::sync::oneshot::Receiver<Result<SessionView, StartError>>, StartError> {
        let job = self
            .jobs
            .jobs()
            .into_iter()
            .find(|j| j.job_id == job_id)
            .ok_or_else(|| {
                StartError::NotFound(format!(
                    "no job {job_id:?} on this node (GET /api/jobs lists the jobs found)"
                ))
            })?;
        if job.state != JobState::Connected {
            return Err(StartError::Conflict(format!(
                "job {job_id} is lost ({}); it cannot be tuned",
                job.lost_reason.as_deref().unwrap_or("no reason known")
            )));
        }
        let config = request.resolve();
        // Checked now (with the knobs the registry last saw) so a bad body
        // is a 400 at once; the session proper starts from the knobs the
        // job names on its own connection.
        TuningSession::new(config.session_config(&job.knobs))
            .map_err(|e| StartError::BadRequest(format!("bad tuning configuration: {e}")))?;
        let handle = {
            let mut sessions = self.sessions();
            if let Some(running) = sessions
                .get(job_id)
                .filter(|h| h.view().state == SessionState::Running)
            {
                let started = running.view().started_unix_ms;
                return Err(StartError::Conflict(format!(
                    "a tuning session of job {job_id} already runs (started at {started} ms \
                     since the epoch); DELETE /api/jobs/{job_id}/tuning stops it"
                )));
            }
            let handle = Arc::new(Handle {
                view: Mutex::new(SessionView {
                    job_id: job_id.to_owned(),
                    state: SessionState::Running,
                    error: None,
                    started_unix_ms: unix_ms(),
                    config: config.clone(),
                    start_knobs: job.knobs,
                    current_knobs: job.knobs,
                    samples: Vec::new(),
                    best: None,
                    speedup_over_start: None,
                    report_id: None,
                    disturbance_detection: self.disturbance.describe(),
                    stop_reason: None,
                    confirmation: None,
                }),
                stop: Mutex::new(None),
            });
            sessions.insert(job_id.to_owned(), handle.clone());
            forget_oldest_finished(&mut sessions);
            handle
        };
        let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
        let this = self.clone();
        let spawned = std::thread::Builder::new()
            .name("ringwatch-tune".into())
            .spawn(move || this.drive(&handle, &job, &config, ready_tx));
        if let Err(error) = spawned {
            let message = format!("cannot start the tuning thread: {error}");
            if let Some(handle) = self.sessions().get(job_id) {
                fail(handle, message.clone());
            }
            return Err(StartError::Unavailable(message));
        }
        Ok(ready_rx)
    }

    /// The session's thread: runs it to the end and records how it ended.
    fn drive(
        &self,
        handle: &Handle,
        job: &JobSnapshot,
        config: &ResolvedConfig,
        ready: tokio::sync::oneshot::Sender<Result<SessionView, StartError>>,
    ) {
        let job_id = job.job_id.clone();
        let span = tracing::info_span!("tuning", job_id);
        let _entered = span.enter();
        let mut ready = Some(ready);
        let result = self.run_session(handle, job, config, &mut ready);
        match result {
            Ok(()) => {}
            Err(SessionFailure::BeforeStart(error)) => {
                fail(handle, error.to_string());
                if let Some(ready) = ready.take() {
                    let _ = ready.send(Err(error));
                }
            }
            Err(SessionFailure::Failed(message)) => {
                tracing::warn!(message, "tuning session failed; the job keeps its knobs");
                fail(handle, message);
            }
        }
    }

    fn run_session(
        &self,
        handle: &Handle,
        job: &JobSnapshot,
        config: &ResolvedConfig,
        ready: &mut Option<tokio::sync::oneshot::Sender<Result<SessionView, StartError>>>,
    ) -> Result<(), SessionFailure> {
        let job_id = &job.job_id;
        let limits = &self.limits;
        let mut client =
            ControlClient::connect(&job.socket, limits.connect_timeout).map_err(|e| {
                SessionFailure::BeforeStart(StartError::Unavailable(format!(
                    "cannot connect to job {job_id}'s control socket {}: {e}",
                    job.socket.display()
                )))
            })?;
        client
            .claim_tuning(limits.connect_timeout)
            .map_err(|e| match e {
                ControlError::Server(message) => SessionFailure::BeforeStart(StartError::Conflict(
                    format!("job {job_id} refused the tuning claim: {message}"),
                )),
                other => SessionFailure::BeforeStart(StartError::Unavailable(format!(
                    "claiming job {job_id}'s tuning failed: {other}"
                ))),
            })?;
        // From here on the claim is ours: every way out releases it (or the
        // connection breaks, which the job sees as an interrupted claim).
        let result = self.run_claimed(&mut client, handle, job, config, ready);
        if result.is_err() {
            // Best effort: a broken connection already ended the claim.
            let _ = client.release_tuning(false, Duration::from_secs(2));
        }
        result
    }

    /// The session proper, with the job's claim held on `client`.
    fn run_claimed(
        &self,
        client: &mut ControlClient,
        handle: &Handle,
        job: &JobSnapshot,
        config: &ResolvedConfig,
        ready: &mut Option<tokio::sync::oneshot::Sender<Result<SessionView, StartError>>>,
    ) -> Result<(), SessionFailure> {
        let job_id = &job.job_id;
        let limits = &self.limits;
        let broken = |what: &str, e: ControlError| match e {
            ControlError::Server(message) => SessionFailure::Failed(format!(
                "job {job_id} refused a request while {what}: {message}; it keeps the knobs it has"
            )),
            e => SessionFailure::Failed(format!(
                "lost the control connection to job {job_id} while {what}: {e}; the job keeps \
                 the knobs it had"
            )),
        };
        let (start_knobs, _) = client
            .get_knobs(limits.connect_timeout)
            .map_err(|e| broken("reading its knobs", e))?;
        client
            .subscribe(true, false)
            .map_err(|e| broken("subscribing to its statistics", e))?;
        let mut session_config = config.session_config(&start_knobs);
        if !matches!(self.disturbance, Disturbance::Ebpf(_)) {
            // Nothing tells this session which windows were disturbed:
            // score each by the median of three runs of its cycles.
            session_config.sub_windows = UNOBSERVED_SUB_WINDOWS;
        }
        let mut session = match TuningSession::new(session_config) {
            Ok(session) => session,
            Err(e) => {
                let _ = client.release_tuning(false, limits.connect_timeout);
                return Err(SessionFailure::BeforeStart(StartError::BadRequest(
                    format!("bad tuning configuration: {e}"),
                )));
            }
        };
        {
            let mut view = handle.view();
            view.start_knobs = start_knobs;
            view.current_knobs = start_knobs;
        }
        if let Some(ready) = ready.take() {
            let _ = ready.send(Ok(handle.view().clone()));
        }
        tracing::info!(
            budget = config.budget,
            ?start_knobs,
            "tuning session started"
        );

        let started = Instant::now();
        // The job's ranks on this node (eBPF sees only those).
        let pids: BTreeSet<u32> = job
            .local_ranks()
            .filter(|r| r.pid != 0)
            .map(|r| r.pid)
            .collect();
        let mut usual: Vec<WindowRates> = Vec::new();
        // The job's other nodes (a multi-node job, with peers), judged there.
        let mut peers = if matches!(self.disturbance, Disturbance::Ebpf(_)) {
            self.peer_nodes(job)
        } else {
            Vec::new()
        };
        let mut last_work = Instant::now();
        let mut stopped: Option<Keep> = None;
        loop {
            if let Some(keep) = handle.stop_request() {
                session.stop();
                stopped = Some(keep);
                break;
            }
            match session.next_step() {
                Step::Done => break,
                Step::Apply(knobs) => {
                    let wire = to_wire_knobs(&knobs);
                    let (applied, first_cycle) = client
                        .set_knobs(full_update(&wire), limits.apply_timeout)
                        .map_err(|e| broken("applying knobs", e))?;
                    tracing::debug!(?applied, first_cycle, "knobs applied");
                    handle.view().current_knobs = applied;
                    session.applied(first_cycle).map_err(|e| {
                        SessionFailure::Failed(format!("the tuner refused the applied knobs: {e}"))
                    })?;
                    last_work = Instant::now();
                }
                Step::Measure => {
                    let message = client
                        .next_message(Duration::from_millis(250))
                        .map_err(|e| broken("reading its statistics", e))?;
                    let Some(ServerMessage::CycleStats(stats)) = message else {
                        if last_work.elapsed() > limits.idle_timeout {
                            return Err(SessionFailure::Failed(format!(
                                "job {job_id} reported no cycle with work for {:?} (is it idle \
                                 or finishing?); the session ends, the job keeps its knobs",
                                limits.idle_timeout
                            )));
                        }
                        continue;
                    };
                    last_work = Instant::now();
                    let observation = CycleObservation {
                        cycle: stats.cycle,
                        start_unix_us: stats.start_unix_us,
                        duration_us: stats.duration_us,
                        bytes_reduced: stats.bytes_reduced,
                    };
                    let Some(window) = session.observe_cycle(&observation) else {
                        continue;
                    };
                    let mut disturbed = self.judge_window(handle, &window, &pids, &mut usual);
                    if !peers.is_empty() {
                        // Every node's verdict, each named.
                        let mut reasons: Vec<String> = disturbed
                            .take()
                            .map(|r| format!("node {}: {r}", self.node_name()))
                            .into_iter()
                            .collect();
                        for peer in &mut peers {
                            reasons.extend(self.judge_on_peer(peer, job_id, &window));
                        }
                        disturbed = (!reasons.is_empty()).then(|| reasons.join("; "));
                    }
                    let wall_time_s = started.elapsed().as_secs_f64();
                    let verdict = session
                        .judge(&window, disturbed.clone(), wall_time_s)
                        .map_err(|e| {
                            SessionFailure::Failed(format!("the tuner refused a window: {e}"))
                        })?;
                    match verdict {
                        Verdict::Remeasure => {
                            tracing::info!(
                                reason = disturbed.as_deref().unwrap_or(""),
                                "window disturbed; measuring again"
                            );
                        }
                        Verdict::Repeat => {
                            tracing::info!(
                                score_bytes_per_s = window.score,
                                "the start's first window; measuring a second (the faster is kept)"
                            );
                        }
                        Verdict::Sample(index) => {
                            if let Some(sample) = session.samples().get(index) {
                                tracing::info!(
                                    index,
                                    score_bytes_per_s = sample.score,
                                    knobs = ?to_wire_knobs(&sample.knobs),
                                    "sample"
                                );
                            }
                        }
                        Verdict::Confirmation(index) => {
                            if let Some(c) = session.confirmation() {
                                log_confirmation(c, index);
                            }
                        }
                    }
                    update_view(&mut handle.view(), &session);
                }
            }
        }

        // The end: pin the chosen knobs, release the claim, write the report.
        let keep = stopped.unwrap_or(Keep::Best);
        let pinned = match keep {
            Keep::Start => Some(start_knobs),
            Keep::Best => session.best().map(|best| to_wire_knobs(&best.knobs)),
        };
        if let Some(knobs) = pinned {
            let (applied, _) = client
                .set_knobs(full_update(&knobs), limits.apply_timeout)
                .map_err(|e| broken("pinning the chosen knobs", e))?;
            handle.view().current_knobs = applied;
            tracing::info!(?applied, "pinned the chosen knobs");
        }
        client
            .release_tuning(true, limits.connect_timeout)
            .map_err(|e| broken("releasing the tuning claim", e))?;
        let state = if stopped.is_some() {
            SessionState::Stopped
        } else {
            SessionState::Done
        };
        {
            let mut view = handle.view();
            update_view(&mut view, &session);
            view.stop_reason = match (stopped, session.stop_reason()) {
                (Some(_), _) => Some("stopped".to_owned()),
                (None, Some(reason)) => Some(format!("{reason:?}").to_lowercase()),
                (None, None) => None,
            };
        }
        let report = if session.samples().is_empty() {
            None
        } else {
            match self.write_report(&session, &handle.view(), state) {
                Ok(id) => Some(id),
                Err(error) => {
                    return Err(SessionFailure::Failed(format!(
                        "the session ended (knobs pinned) but its report could not be written: \
                         {error:#}"
                    )));
                }
            }
        };
        let mut view = handle.view();
        view.report_id = report;
        view.state = state;
        tracing::info!(state = ?state, report = view.report_id.as_deref().unwrap_or("none"), speedup = view.speedup_over_start, "tuning session ended");
        Ok(())
    }

    /// This node's name among its peers.
    fn node_name(&self) -> String {
        self.cluster
            .lock()
            .ok()
            .and_then(|c| c.as_ref().map(|(c, _)| c.node_name().to_owned()))
            .unwrap_or_else(crate::jobs::host_name)
    }

    /// eBPF's verdict on a window; also keeps the run-queue baseline.
    fn judge_window(
        &self,
        handle: &Handle,
        window: &Window,
        pids: &BTreeSet<u32>,
        usual: &mut Vec<WindowRates>,
    ) -> Option<String> {
        let Disturbance::Ebpf(feed) = &self.disturbance else {
            return None;
        };
        // The feed copies the model a few times a second: wait (a little)
        // until it has read past the window's end. A window it has not
        // read whole (serve's loop is behind) is not judged: a verdict on
        // part of it would be noise. A session asked to stop does not wait:
        // an agent that is stopping reads no more figures, and meanwhile
        // the job's statistics pile up unread (a job closes a client that
        // falls 4 MiB behind, which a fast job reaches within a second).
        let deadline = Instant::now() + Duration::from_millis(1_500);
        while !feed.covers(window.end_unix_us) {
            if Instant::now() >= deadline || handle.stop_request().is_some() {
                tracing::info!(
                    first_cycle = window.first_cycle,
                    last_cycle = window.last_cycle,
                    "the eBPF figures for this window are not read yet (serve's loop is \
                     behind): the window is not judged"
                );
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let load = feed.window(pids, window.start_unix_us, window.end_unix_us)?;
        let reason = disturbance_reason(&load, usual);
        tracing::debug!(
            run_queue_ms_per_s = load.run_queue_ms_per_s(),
            retransmits = load.retransmits(),
            span_s = load.span_s,
            pids = load.pids.len(),
            disturbed = reason.as_deref().unwrap_or("no"),
            "window load (eBPF)"
        );
        usual.push(load.rates());
        reason
    }

    fn write_report(
        &self,
        session: &TuningSession,
        view: &SessionView,
        state: SessionState,
    ) -> anyhow::Result<String> {
        use anyhow::Context;
        let created_unix_ms = unix_ms();
        let id = report_id(&view.job_id, created_unix_ms);
        let title = format!("ringwatch tuning of job {}", view.job_id);
        let files =
            tuner::report::write_report(&session.report_data(), self.reports.dir(), &id, &title)
            .with_context(|| {
                format!("writing report {id} into {}", self.reports.dir().display())
            })?;
        let state_name = match state {
            SessionState::Running => "running",
            SessionState::Done => "done",
            SessionState::Stopped => "stopped",
            SessionState::Failed => "failed",
        };
        self.reports.write_meta(&ReportMeta {
            id: id.clone(),
            job_id: view.job_id.clone(),
            created_unix_ms,
            samples: view.samples.len(),
            best: view.best.as_ref().map(|b| b.knobs),
            speedup_over_start: view.speedup_over_start,
            state: state_name.to_owned(),
            disturbance_detection: view.disturbance_detection.clone(),
            start_knobs: view.start_knobs,
        })?;
        tracing::info!(html = %files.html.display(), "tuning report written");
        Ok(id)
    }

    /// Starts, once per appearance of a job, a default session for every
    /// job that asks to be tuned (`autotune: waiting|interrupted`). Runs on
    /// its own thread until the last other handle to `self` is gone.
    pub fn autotune(self: &Arc<Self>) -> std::io::Result<()> {
        let weak = Arc::downgrade(self);
        std::thread::Builder::new()
            .name("ringwatch-autotune".into())
            .spawn(move || {
                let mut started: BTreeMap<String, PathBuf> = BTreeMap::new();
                loop {
                    std::thread::sleep(Duration::from_millis(500));
                    let Some(this) = weak.upgrade() else { break };
                    let jobs = this.jobs.jobs();
                    started.retain(|id, socket| {
                        jobs.iter().any(|j| {
                            &j.job_id == id && &j.socket == socket && j.state == JobState::Connected
                        })
                    });
                    for job in jobs {
                        if job.state != JobState::Connected
                            || !job.wants_autotune()
                            || started.contains_key(&job.job_id)
                        {
                            continue;
                        }
                        started.insert(job.job_id.clone(), job.socket.clone());
                        match this.start(&job.job_id, &TuningRequest::default()) {
                            Ok(_) => tracing::info!(
                                job_id = job.job_id,
                                "the job asks to be tuned: started a tuning session"
                            ),
                            Err(error) => tracing::warn!(
                                job_id = job.job_id,
                                %error,
                                "the job asks to be tuned, but no session could start"
                            ),
                        }
                    }
                }
            })?;
        Ok(())
    }
}

/// Finished sessions kept for `GET` (the newest; running ones always stay).
const FINISHED_SESSIONS_KEPT: usize = 100;

/// Keeps memory bounded: forgets the oldest finished sessions beyond
/// [`FINISHED_SESSIONS_KEPT`].
fn forget_oldest_finished(sessions: &mut BTreeMap<String, Arc<Handle>>) {
    let mut finished: Vec<(u64, String)> = sessions
        .iter()
        .filter_map(|(job_id, h)| {
            let view = h.view();
            (view.state != SessionState::Running).then(|| (view.started_unix_ms, job_id.clone()))
        })
        .collect();
    if finished.len() <= FINISHED_SESSIONS_KEPT {
        return;
    }
    finished.sort();
    let excess = finished.len() - FINISHED_SESSIONS_KEPT;
    for (_, job_id) in finished.into_iter().take(excess) {
        sessions.remove(&job_id);
    }
}

enum SessionFailure {
    /// Before the claim was ours: answered to the starter.
    BeforeStart(StartError),
    /// After: the session failed.
    Failed(String),
}

fn fail(handle: &Handle, message: String) {
    let mut view = handle.view();
    view.state = SessionState::Failed;
    view.error = Some(message);
}

/// Logs one confirmation window, and the verdict once it is in.
fn log_confirmation(c: &tuner::session::Confirmation, index: usize) {
    if let Some(w) = c.windows.get(index) {
        tracing::info!(
            index,
            candidate = ?w.candidate,
            score_bytes_per_s = w.score,
            "confirmation window (the choice and the start, interleaved)"
        );
    }
    if let (Some(kept), Some(choice), Some(start)) = (c.kept, c.choice_median, c.start_median) {
        tracing::info!(
            ?kept,
            choice_median_bytes_per_s = choice,
            start_median_bytes_per_s = start,
            required_gain = c.required_gain.unwrap_or(0.0),
            "confirmation decided"
        );
    }
}

/// Copies the session's samples and best into the view.
fn update_view(view: &mut SessionView, session: &TuningSession) {
    view.samples = session
        .samples()
        .iter()
        .map(|s| SampleView {
            index: s.index,
            knobs: to_wire_knobs(&s.knobs),
            score_bytes_per_s: s.score,
            noise_hint: s.noise_hint,
            disturbed: s.disturbed.clone(),
            remeasured_because: s.remeasured_because.clone(),
            wall_time_s: s.wall_time_s,
            window: WindowView {
                first_cycle: s.window.first_cycle,
                last_cycle: s.window.last_cycle,
                cycles: s.window.cycles,
                duration_s: s.window.duration_s(),
            },
        })
        .collect();
    view.best = session.best().map(|b| BestView {
        knobs: to_wire_knobs(&b.knobs),
        predicted_score_bytes_per_s: b.predicted_score,
        sample: b.sample,
    });
    view.speedup_over_start = session.speedup_over_start();
    view.confirmation = session.confirmation().map(|c| {
        let name = |k: tuner::session::Candidate| match k {
            tuner::session::Candidate::Choice => "choice".to_owned(),
            tuner::session::Candidate::Start => "start".to_owned(),
        };
        ConfirmationView {
            choice: to_wire_knobs(&c.choice),
            choice_sample: c.choice_sample,
            windows: c
                .windows
                .iter()
                .map(|w| ConfirmationWindowView {
                    candidate: name(w.candidate),
                    score_bytes_per_s: w.score,
                    disturbed: w.disturbed.clone(),
                    wall_time_s: w.wall_time_s,
                })
                .collect(),
            choice_median_bytes_per_s: c.choice_median,
            start_median_bytes_per_s: c.start_median,
            required_gain: c.required_gain,
            kept: c.kept.map(name),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_numbers_written_as_floats_are_whole_numbers() {
        let request: TuningRequest = serde_json::from_str(
            r#"{"seed": 4085693372319842.0, "budget": 20.0, "warmup_cycles": 3,
                "bounds": {"fusion_threshold_bytes": [1024.0, 2048]},
                "fixed": {"fusion_threshold_bytes": 4096.0}}"#,
        )
        .unwrap();
        assert_eq!(request.seed, Some(4_085_693_372_319_842));
        assert_eq!(request.budget, Some(20));
        assert_eq!(
            request.bounds.unwrap().fusion_threshold_bytes,
            Some([1024, 2048])
        );
        assert_eq!(request.fixed.unwrap().fusion_threshold_bytes, Some(4096));
        for bad in [r#"{"budget": 1.5}"#, r#"{"seed": -1}"#, r#"{"seed": "7"}"#] {
            let error = serde_json::from_str::<TuningRequest>(bad).unwrap_err();
            assert!(!error.to_string().is_empty(), "{bad}");
        }
    }

    fn load(span_s: f64, pids: &[(u32, u64, u64)]) -> WindowLoad {
        WindowLoad {
            span_s,
            pids: pids
                .iter()
                .map(|&(pid, run_queue_ms, retransmits)| PidLoad {
                    pid,
                    run_queue_ns: run_queue_ms * 1_000_000,
                    retransmits,
                })
                .collect(),
        }
    }

    #[test]
    fn knobs_convert_both_ways() {
        let wire = Knobs {
            fusion_threshold_bytes: 8 << 20,
            cycle_time_us: 2_500,
            hierarchical_allreduce: true,
        };
        let tuner = to_tuner_knobs(&wire);
        assert_eq!(tuner.cycle_time_ms, 2.5);
        assert_eq!(to_wire_knobs(&tuner), wire);
        let odd = CollectiveKnobs {
            fusion_threshold_bytes: 0,
            cycle_time_ms: 0.6004,
            hierarchical_allreduce: false,
        };
        assert_eq!(to_wire_knobs(&odd).cycle_time_us, 600);
    }

    fn usual(run_queue_ms_per_s: &[f64], retransmits_per_s: f64) -> Vec<WindowRates> {
        run_queue_ms_per_s
            .iter()
            .map(|&r| WindowRates {
                run_queue_ms_per_s: r,
                retransmits_per_s,
            })
            .collect()
    }

    #[test]
    fn a_run_queue_spike_over_three_times_the_usual_is_a_disturbance() {
        // 2 s window: pid 7 waited 60 ms, pid 8 22 ms: 41 ms/s.
        let spiky = load(2.0, &[(7, 60, 0), (8, 22, 0)]);
        assert_eq!(
            disturbance_reason(&spiky, &usual(&[6.0, 5.0, 7.0], 0.0)).as_deref(),
            Some("run-queue wait 41 ms/s vs 6 ms/s usual (pid 7)")
        );
        // A disturbed minority does not move the usual rate (median).
        assert!(disturbance_reason(&spiky, &usual(&[6.0, 50.0, 7.0], 0.0)).is_some());
        // Just under 3x the median: not disturbed.
        assert_eq!(
            disturbance_reason(&load(1.0, &[(7, 17, 0)]), &usual(&[6.0, 6.0, 6.0], 0.0)),
            None
        );
        // Fewer than MIN_USUAL_WINDOWS earlier windows: not judged.
        assert_eq!(disturbance_reason(&spiky, &[]), None);
        assert_eq!(disturbance_reason(&spiky, &usual(&[6.0, 5.0], 0.0)), None);
    }

    #[test]
    fn tiny_waits_never_count_even_against_a_zero_baseline() {
        let quiet = load(1.0, &[(7, 4, 0)]);
        assert_eq!(
            disturbance_reason(&quiet, &usual(&[0.0, 0.0, 0.0], 0.0)),
            None
        );
        let busy = load(1.0, &[(7, 6, 0)]);
        assert!(disturbance_reason(&busy, &usual(&[0.0, 0.0, 0.0], 0.0)).is_some());
    }

    #[test]
    fn retransmits_disturb_unless_the_job_always_retransmits_that_much() {
        let quiet_3 = usual(&[1.0, 1.0, 1.0], 0.0);
        assert_eq!(
            disturbance_reason(&load(1.0, &[(7, 1, 3), (8, 1, 0)]), &quiet_3).as_deref(),
            Some("3 TCP retransmits (pid 7)")
        );
        // A usually quiet job: one retransmit disturbs (no floor).
        assert!(disturbance_reason(&load(2.0, &[(7, 1, 1)]), &quiet_3).is_some());
        // No baseline yet: not even retransmits are judged.
        assert_eq!(disturbance_reason(&load(1.0, &[(7, 1, 1)]), &[]), None);
        assert_eq!(
            disturbance_reason(&load(1.0, &[(7, 1, 81)]), &usual(&[1.0, 1.0], 0.0)),
            None
        );
        assert_eq!(
            disturbance_reason(
                &load(1.0, &[(7, 100, 1), (9, 0, 1)]),
                &usual(&[5.0, 5.0, 5.0], 0.0)
            )
            .as_deref(),
            Some(
                "run-queue wait 100 ms/s vs 5 ms/s usual (pid 7); 2 TCP retransmits (pid 7, pid 9)"
            )
        );
        // A job that usually retransmits 4/s: 10 in 2 s is its usual.
        let usual_4 = usual(&[1.0, 1.0, 1.0], 4.0);
        assert_eq!(
            disturbance_reason(&load(2.0, &[(7, 2, 10)]), &usual_4),
            None
        );
        assert_eq!(
            disturbance_reason(&load(2.0, &[(7, 2, 30)]), &usual_4).as_deref(),
            Some("30 TCP retransmits (15.0/s vs 4.0/s usual; pid 7)")
        );
    }

    /// Judges windows one after another as a session does: every judged
    /// window joins the usual rates of the ones after it.
    fn judge_in_turn(loads: &[WindowLoad]) -> Vec<Option<String>> {
        let mut usual = Vec::new();
        loads
            .iter()
            .map(|load| {
                let reason = disturbance_reason(load, &usual);
                usual.push(load.rates());
                reason
            })
            .collect()
    }

    #[test]
    fn a_job_that_retransmits_from_its_first_window_on_is_never_disturbed() {
        // A rate-limited link: tens of retransmits in every window from
        // the very first, varying within 3x of each other (issue 13: the
        // first window's 81 was called a disturbance).
        let loads: Vec<WindowLoad> = [81, 40, 120, 95, 60, 110, 45, 88, 130, 70]
            .iter()
            .map(|&r| load(1.0, &[(7, 2, r), (8, 1, r / 3)]))
            .collect();
        assert_eq!(judge_in_turn(&loads), vec![None; loads.len()]);
        // The same from a job that also waits on the run queue a lot from
        // its first window on.
        let busy: Vec<WindowLoad> = [300, 250, 400, 280]
            .iter()
            .map(|&ms| load(1.0, &[(7, ms, 50)]))
            .collect();
        assert_eq!(judge_in_turn(&busy), vec![None; busy.len()]);
    }

    #[test]
    fn after_three_quiet_windows_a_burst_is_a_disturbance() {
        let quiet = load(1.0, &[(7, 1, 0), (8, 1, 0)]);
        // A burst as the first, second or third window: no baseline yet.
        for earlier in 0..MIN_USUAL_WINDOWS {
            let mut loads = vec![quiet.clone(); earlier];
            loads.push(load(1.0, &[(7, 1, 81)]));
            assert_eq!(judge_in_turn(&loads).last(), Some(&None), "{earlier}");
        }
        // The fourth: disturbed, by either signal.
        let mut loads = vec![quiet.clone(); MIN_USUAL_WINDOWS];
        loads.push(load(1.0, &[(7, 1, 81)]));
        loads.push(load(1.0, &[(7, 40, 0)]));
        loads.push(quiet);
        assert_eq!(
            judge_in_turn(&loads),
            vec![
                None,
                None,
                None,
                Some("81 TCP retransmits (pid 7)".to_owned()),
                Some("run-queue wait 40 ms/s vs 2 ms/s usual (pid 7)".to_owned()),
                None,
            ]
        );
    }

    #[test]
    fn the_feed_copies_every_wait_once_across_overlapping_readings() {
        use crate::model::Interval;
        use ebpf::IntervalCause;
        // Two threads of pid 7 and one of pid 8 alternate on CPU and on the
        // run queue; every 250 ms the feed reads what ended since (with the
        // 2 s re-read for threads it has not copied before). Thread 72
        // appears only half-way.
        let ms = 1_000_000u64;
        let mut intervals: BTreeMap<u32, Vec<Interval>> = BTreeMap::new();
        let mut expected = Vec::new();
        let mut marks = HashMap::new();
        let mut copied = Vec::new();
        let threads = [(7, 70), (7, 71), (8, 80), (7, 72)];
        for step in 0..40u64 {
            // 250 ms of activity: each thread a 3 ms wait then 7 ms on CPU.
            for (i, &(pid, tid)) in threads.iter().enumerate() {
                if tid == 72 && step < 20 {
                    continue;
                }
                for k in 0..25u64 {
                    let start = step * 250 * ms + k * 10 * ms + i as u64;
                    let list = intervals.entry(tid).or_default();
                    list.push(Interval {
                        start_ns: start,
                        duration_ns: 3 * ms,
                        kind: ebpf::IntervalKind::RunQueue,
                        cause: IntervalCause::Woken,
                    });
                    list.push(Interval {
                        start_ns: start + 3 * ms,
                        duration_ns: 7 * ms,
                        kind: ebpf::IntervalKind::OnCpu,
                        cause: IntervalCause::Blocked,
                    });
                    expected.push(FeedWait {
                        start_ns: start,
                        duration_ns: 3 * ms,
                        pid,
                    });
                }
            }
            let now = (step + 1) * 250 * ms;
            let from = now.saturating_sub(250 * ms + 2_000 * ms);
            let present = threads
                .iter()
                .copied()
                .filter(|&(_, tid)| intervals.contains_key(&tid));
            let (waits, next) = copy_new_waits(&marks, from, present, |tid, since| {
                let mut ended: Vec<Interval> = intervals[&tid]
                    .iter()
                    .filter(|i| i.start_ns + i.duration_ns >= since)
                    .copied()
                    .collect();
                ended.reverse();
                ended
            });
            marks = next;
            copied.extend(waits);
        }
        let key = |w: &FeedWait| (w.start_ns, w.pid);
        copied.sort_by_key(key);
        expected.sort_by_key(key);
        assert_eq!(copied.len(), expected.len(), "each wait copied once");
        assert_eq!(copied, expected);
        // A thread the model no longer has leaves the marks.
        let (_, next) = copy_new_waits(&marks, 0, [(7, 70)].into_iter(), |_, _| Vec::new());
        assert_eq!(next.keys().copied().collect::<Vec<_>>(), [70]);
    }

    #[test]
    fn the_feed_counts_what_overlaps_a_window_in_the_jobs_clock() {
        let feed = LoadFeed::default();
        {
            let mut data = feed.lock();
            // Unix time = monotonic time + 1000 s.
            data.unix_minus_monotonic_ns = 1_000_000_000_000;
            data.covered_until_ns = 20_000_000_000;
            let s = 1_000_000_000u64;
            // pid 7: a 2 s wait across the window's start (1 s inside), a
            // 0.5 s wait inside, one after it; pid 99 is not the job's.
            let wait = |start_ns, duration_ns, pid| FeedWait {
                start_ns,
                duration_ns,
                pid,
            };
            data.waits.push_back(wait(9 * s, 2 * s, 7));
            data.waits.push_back(wait(11 * s, s / 2, 7));
            data.waits.push_back(wait(16 * s, s, 7));
            data.waits.push_back(wait(11 * s, s, 99));
            data.retransmits.insert((12 * s, 7), 2);
            data.retransmits.insert((13 * s, 99), 1);
            data.retransmits.insert((15 * s, 7), 1);
            // pid 7's waits that stayed in the kernel: 0.2 s between the
            // readings at 10 and 12 s, none after; 0.1 s of it in 11..12 s.
            data.unsent_run_queue.insert(
                7,
                VecDeque::from([
                    (10 * s, 5 * s),
                    (12 * s, 5 * s + s / 5),
                    (16 * s, 5 * s + s / 5),
                ]),
            );
        }
        let pids = BTreeSet::from([7, 8]);
        // Window: monotonic 10 s .. 15 s.
        let w = feed.window(&pids, 1_010_000_000, 1_015_000_000).unwrap();
        assert_eq!(w.span_s, 5.0);
        assert_eq!(
            w.pids,
            [
                PidLoad {
                    pid: 7,
                    run_queue_ns: 1_700_000_000,
                    retransmits: 2
                },
                PidLoad {
                    pid: 8,
                    run_queue_ns: 0,
                    retransmits: 0
                },
            ]
        );
        assert_eq!(w.run_queue_ms_per_s(), 340.0);
        let w = feed.window(&pids, 1_011_000_000, 1_012_000_000).unwrap();
        // The 2 s wait's last 0 s, the 0.5 s wait, half the unsent 0.2 s.
        assert_eq!(w.pids[0].run_queue_ns, 600_000_000);
        // Only what the feed has read counts: up to 20 s.
        assert!(feed.covers(1_020_000_000));
        assert!(!feed.covers(1_020_000_001));
        let w = feed.window(&pids, 1_018_000_000, 1_030_000_000).unwrap();
        assert_eq!(w.span_s, 2.0);
        assert!(feed.window(&pids, 1_021_000_000, 1_030_000_000).is_none());
        // Records lost from 14 s to 14.5 s: windows across that say nothing.
        feed.lock().lossy.push((14_000_000_000, 14_500_000_000));
        assert!(feed.window(&pids, 1_010_000_000, 1_015_000_000).is_none());
        assert!(feed.window(&pids, 1_014_500_000, 1_015_000_000).is_some());
        // Waits that ended before 14.8 s are forgotten: a window from 15 s
        // still sees everything that could overlap it, one from 14.5 s does
        // not, and is not judged.
        feed.lock().kept_from_ns = 14_800_000_000;
        assert!(feed.window(&pids, 1_015_000_000, 1_015_500_000).is_some());
        assert!(feed.window(&pids, 1_014_500_000, 1_015_000_000).is_none());
        assert!(LoadFeed::default().window(&pids, 0, 1).is_none());
    }

    #[test]
    fn the_request_rejects_unknown_fields_and_fills_defaults() {
        let request: TuningRequest =
            serde_json::from_str(r#"{"budget":5,"bounds":{"cycle_time_ms":[0.5,5]}}"#).unwrap();
        let config = request.resolve();
        assert_eq!(config.budget, 5);
        assert_eq!(config.warmup_cycles, 3);
        assert_eq!(config.bounds.cycle_time_ms, Some([0.5, 5.0]));
        assert!(serde_json::from_str::<TuningRequest>(r#"{"budgett":5}"#).is_err());
        assert!(serde_json::from_str::<TuningRequest>(r#"{"fixed":{"x":1}}"#).is_err());
    }
}
