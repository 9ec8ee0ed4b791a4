//! The measurement window: the job's cycles it is made of, how it is scored
//! (steps per second where the job marks its steps, else bytes per second,
//! start to start, or the median rate of sub-windows), and what the driver's
//! judgement of it was.
//!
//! It must never decide what a window is for (a sample, a repeat of the
//! start, a confirmation): that is the state machine's ([`super`]).

/// Step boundaries the job marked (a training step ended) within one
/// cycle's statistics: how many, and when the first and the last were
/// marked (job clock µs; 0 when none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepMarks {
    /// Boundaries marked.
    pub count: u64,
    /// The first's time, µs.
    pub first_unix_us: u64,
    /// The last's time, µs.
    pub last_unix_us: u64,
}

impl StepMarks {
    /// Adds a boundary marked at `unix_us` (after the ones before).
    pub fn mark(&mut self, unix_us: u64) {
        if self.count == 0 {
            self.first_unix_us = unix_us;
        }
        self.last_unix_us = unix_us;
        self.count += 1;
    }
}

/// What a session's windows are scored by, for all of them alike.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Objective {
    /// Training steps per second, over whole steps (the job marks where its
    /// steps end): what the user gets.
    StepsPerSecond,
    /// Bytes reduced per second, where the job marks no steps.
    BytesPerSecond,
}

impl Objective {
    /// The unit of a score.
    pub fn unit(self) -> &'static str {
        match self {
            Objective::StepsPerSecond => "steps/s",
            Objective::BytesPerSecond => "bytes/s",
        }
    }

    /// A sentence for a report: what the scores are and why.
    pub fn describe(self) -> &'static str {
        match self {
            Objective::StepsPerSecond => {
                "Scores are training steps per second over whole steps: the job marks where its \
                 steps end."
            }
            Objective::BytesPerSecond => {
                "Scores are bytes reduced per second: the job marks no steps (call \
                 ringwatch.mark_step() where a step ends, or use DistributedOptimizer, to score \
                 steps)."
            }
        }
    }
}

/// One cycle of the job, as its per-cycle statistics report it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CycleObservation {
    /// The cycle's index (the same on every rank).
    pub cycle: u64,
    /// When it started, microseconds on the job's clock (e.g. Unix time).
    pub start_unix_us: u64,
    /// How long its work took, microseconds.
    pub duration_us: u64,
    /// Bytes reduced by allreduce in it.
    pub bytes_reduced: u64,
    /// The step boundaries marked since the previous cycle's statistics.
    pub steps: StepMarks,
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
    /// Whole steps the window's marks bound (0 when scored by bytes).
    pub steps: u64,
    /// What the score measures.
    pub objective: Objective,
    /// Steps per second: one over the median step (sub-windows ≥ 3), or
    /// whole steps over the time they took. Bytes per second: the median
    /// of the sub-windows' rates, or the whole window's rate when there
    /// are fewer than 3 sub-windows.
    pub score: f64,
    /// The whole window's rate: whole steps over their time, or bytes
    /// reduced over its span.
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

/// The largest number of steps one cycle's marks stand for in
/// [`step_durations`] (a job marking far more is scored by the others'
/// median all the same).
const MAX_STEPS_PER_CYCLE: u64 = 1024;

/// The durations of the whole steps that the cycles' marks bound, µs, in
/// order: from one mark to the next; the steps between a cycle's first and
/// last mark are taken as equally long.
pub(super) fn step_durations(cycles: &[CycleObservation]) -> Vec<f64> {
    let mut durations = Vec::new();
    let mut previous: Option<u64> = None;
    for marks in cycles.iter().map(|c| c.steps).filter(|m| m.count > 0) {
        if let Some(previous) = previous
            && marks.first_unix_us >= previous
        {
            durations.push((marks.first_unix_us - previous) as f64);
        }
        if marks.count > 1 && marks.last_unix_us >= marks.first_unix_us {
            let each = (marks.last_unix_us - marks.first_unix_us) as f64 / (marks.count - 1) as f64;
            let n = (marks.count - 1).min(MAX_STEPS_PER_CYCLE);
            durations.extend(std::iter::repeat_n(each, n as usize));
        }
        previous = Some(marks.last_unix_us);
    }
    durations
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
