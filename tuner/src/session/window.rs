//! The measurement window: the job's cycles it is made of, how it is scored
//! (bytes per second, start to start, or the median rate of sub-windows),
//! and what the driver's judgement of it was.
//!
//! It must never decide what a window is for (a sample, a repeat of the
//! start, a confirmation): that is the state machine's ([`super`]).

/// One cycle of the job, as its per-cycle statistics report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CycleObservation {
    /// The cycle's index (the same on every rank).
    pub cycle: u64,
    /// When it started, microseconds on the job's clock (e.g. Unix time).
    pub start_unix_us: u64,
    /// How long its work took, microseconds.
    pub duration_us: u64,
    /// Bytes reduced by allreduce in it.
    pub bytes_reduced: u64,
}

/// A finished measurement window.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Window {
    /// First cycle of the window.
    pub first_cycle: u64,
    /// Last cycle (its start closes the window; its bytes are not counted).
    pub last_cycle: u64,
    /// Start of the first cycle, job clock µs.
    pub start_unix_us: u64,
    /// Start of the last cycle, job clock µs.
    pub end_unix_us: u64,
    /// Cycles in the window, the closing one included.
    pub cycles: u64,
    /// Bytes reduced by every cycle but the last.
    pub bytes_reduced: u64,
    /// Bytes reduced per second: the median of the sub-windows' rates, or
    /// the whole window's rate when there are fewer than 3 sub-windows.
    pub score: f64,
    /// The whole window's rate: bytes reduced over its span.
    pub overall_score: f64,
}

impl Window {
    /// The window's span in seconds.
    pub fn duration_s(&self) -> f64 {
        (self.end_unix_us - self.start_unix_us) as f64 / 1e6
    }
}

/// What [`TuningSession::judge`](super::TuningSession::judge) made of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The window was disturbed and is measured again with the same knobs.
    Remeasure,
    /// The start's first window was clean; a second one is measured and the
    /// faster of the two kept (a disturbance only slows a job, and the
    /// start is what every later sample is weighed against).
    Repeat,
    /// A sample was recorded (its index in [`TuningSession::samples`](super::TuningSession::samples)).
    Sample(usize),
    /// A confirmation window was recorded (its index in the confirmation's
    /// windows, see [`TuningSession::confirmation`](super::TuningSession::confirmation)).
    Confirmation(usize),
}

pub(crate) fn median(values: &[f64]) -> Option<f64> {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// The median rate of `k` runs of consecutive cycle intervals (`None` for
/// fewer than 3 runs or too few intervals). A run's rate is the bytes of its
/// cycles over the time from its first cycle's start to the next run's.
pub(super) fn sub_window_median(cycles: &[CycleObservation], k: usize) -> Option<f64> {
    let intervals = cycles.len().checked_sub(1)?;
    if k < 3 || intervals < k {
        return None;
    }
    let mut rates = Vec::with_capacity(k);
    for run in 0..k {
        let from = run * intervals / k;
        let to = (run + 1) * intervals / k;
        let bytes: u64 = cycles[from..to].iter().map(|c| c.bytes_reduced).sum();
        let span_us = cycles[to].start_unix_us - cycles[from].start_unix_us;
        if span_us == 0 {
            return None;
        }
        rates.push(bytes as f64 / (span_us as f64 / 1e6));
    }
    median(&rates)
}
