//! Judging a window: eBPF's run-queue waits and retransmits of the job's
//! processes during it ([`LoadFeed`], copied from the model), against the
//! job's usual rates, say whether something outside the job disturbed it.
//!
//! It must never hold the model's lock while judging, nor judge from another
//! clock than the job's.

use std::collections::{BTreeMap, BTreeSet, HashMap, VecDeque};
use std::sync::{Arc, Mutex, MutexGuard};

use serde::{Deserialize, Serialize};

use super::request::unix_us;

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
        // Saturating: the figures may come from a peer, which may say anything.
        let ns = self
            .pids
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.run_queue_ns));
        ns as f64 / 1e6 / self.span_s
    }

    /// TCP segments the job retransmitted during the window.
    pub fn retransmits(&self) -> u64 {
        self.pids
            .iter()
            .fold(0u64, |sum, p| sum.saturating_add(p.retransmits))
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

pub(super) fn median(values: &[f64]) -> Option<f64> {
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
pub(super) const FEED_REREAD_NS: u64 = 2_000_000_000;

/// A stretch in which more than this share of the kernel's records was
/// lost says too little about the job's waits to judge a window by.
pub(super) const MAX_LOST_SHARE: f64 = 0.01;

/// How long the feed keeps waits and retransmits. A busy 4-rank job has
/// ~15k run-queue waits a second; 120 s of them were ~90 MB of the agent
/// (30 s are ~11 MB). Windows that began more than this long ago are not
/// judged, and the log says so.
pub(super) const FEED_KEEP_NS: u64 = 30_000_000_000;

/// One run-queue wait of a watched thread, as the feed keeps it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct FeedWait {
    pub(super) start_ns: u64,
    pub(super) duration_ns: u64,
    pub(super) pid: u32,
}

impl FeedWait {
    pub(super) fn end_ns(&self) -> u64 {
        self.start_ns.saturating_add(self.duration_ns)
    }
}

#[derive(Debug, Default)]
pub(super) struct FeedData {
    /// Run-queue waits of watched threads, in the order they were copied
    /// (within a quarter of a second of the order they ended). Appended
    /// and dropped from the front: a tree keyed by start time cost the
    /// agent ~1% of a core in inserts alone under a busy job.
    pub(super) waits: VecDeque<FeedWait>,
    /// Per watched thread, the end of the newest interval copied
    /// (monotonic ns): each recording copies only what ended after it.
    pub(super) copied_until: HashMap<u32, u64>,
    /// TCP retransmits: (ts ns, pid) → how many at that instant.
    pub(super) retransmits: BTreeMap<(u64, u32), u64>,
    /// The model was read up to here (CLOCK_MONOTONIC ns); 0: never.
    pub(super) covered_until_ns: u64,
    /// CLOCK_REALTIME − CLOCK_MONOTONIC when last read, ns.
    pub(super) unix_minus_monotonic_ns: i128,
    /// Records the kernel could not deliver (ring buffer full) or held
    /// back (per-thread rate limit), at the last reading.
    pub(super) records_lost: u64,
    /// Records delivered (decoded), at the last reading.
    pub(super) records_delivered: u64,
    /// Ranges (monotonic ns) during which records were lost: windows that
    /// overlap one are not judged.
    pub(super) lossy: Vec<(u64, u64)>,
    /// Waits that ended before this are forgotten, and windows that begin
    /// before it are not judged (monotonic ns; 0: none): the last
    /// [`FEED_KEEP_NS`], and nothing before the first recording since the
    /// feed (re)started.
    pub(super) kept_from_ns: u64,
    /// The first recording since the feed (re)started (monotonic ns).
    pub(super) started_ns: u64,
    /// Per watched process, readings (monotonic ns, cumulative ns) of the
    /// run-queue time of its waits that stayed in the kernel
    /// (`--min-interval`): not in `waits`, but part of every window.
    pub(super) unsent_run_queue: BTreeMap<u32, VecDeque<(u64, u64)>>,
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
    pub(super) data: Mutex<FeedData>,
    /// Until when a peer's asks keep the feed recording (monotonic ns).
    pub(super) asked_until_ns: std::sync::atomic::AtomicU64,
}

/// How long a peer's ask for a window keeps the feed recording: a session
/// asks after every window, so this spans many of them.
pub(super) const FEED_ASKED_NS: u64 = 120_000_000_000;

/// The run-queue waits among `intervals` (one thread's, newest first, as
/// the model gives them), for `pid`.
pub(super) fn run_queue_waits(
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
pub(super) fn copy_new_waits(
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

    pub(super) fn lock(&self) -> MutexGuard<'_, FeedData> {
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

/// How a session checks its windows for disturbance: with eBPF, or not at
/// all (and why not).
#[derive(Debug, Clone)]
pub enum DisturbanceCheck {
    /// Judged from this feed.
    Ebpf(Arc<LoadFeed>),
    /// Not judged, for this reason (`off: …`).
    Off(String),
}

impl DisturbanceCheck {
    /// For the session JSON.
    pub fn describe(&self) -> String {
        match self {
            Self::Ebpf(_) => "on: eBPF run-queue waits and TCP retransmits".to_owned(),
            Self::Off(why) => why.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_peers_absurd_figures_saturate_instead_of_overflowing() {
        let absurd = WindowLoad {
            span_s: 1.0,
            pids: vec![
                PidLoad {
                    pid: 1,
                    run_queue_ns: u64::MAX,
                    retransmits: u64::MAX,
                },
                PidLoad {
                    pid: 2,
                    run_queue_ns: u64::MAX,
                    retransmits: 1,
                },
            ],
        };
        assert_eq!(absurd.retransmits(), u64::MAX);
        assert!(absurd.run_queue_ms_per_s().is_finite());
        assert!(disturbance_reason(&absurd, &usual(&[6.0, 5.0, 7.0], 0.0)).is_some());
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
}
