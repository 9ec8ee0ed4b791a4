//! One tuning session's sample protocol, as a state machine: which knobs to
//! apply next, which of the job's cycles belong to the measurement window,
//! how a window is scored, what happens to a disturbed window, when to stop
//! and what to pin at the end.
//!
//! It is shared by the two drivers that tune a job — the agent (over the
//! job's control socket) and a job that tunes itself (in-process, on rank 0)
//! — so both measure the same way. It never reads a clock, does I/O or
//! starts threads: cycles and their timestamps come from the job, wall times
//! from the caller; it never builds or writes its report either: it hands
//! the report's data ([`TuningSession::report_data`]) to [`crate::report`].
//!
//! The protocol, per sample:
//! 1. [`Step::Apply`]: the driver sets the knobs on the job and, once the job
//!    confirms them, calls [`TuningSession::applied`] with the first cycle
//!    that runs with them on every rank.
//! 2. [`Step::Measure`]: the driver feeds every per-cycle statistic to
//!    [`TuningSession::observe_cycle`]. The first `warmup_cycles` cycles with
//!    work are skipped; then a window collects at least `measured_cycles`
//!    cycles spanning at least `min_window_us`. Its score is bytes reduced
//!    per second, start to start: the bytes of every cycle but the last,
//!    over the time from the first cycle's start to the last one's, so that
//!    idle time between cycles (a long cycle time) counts against the knobs
//!    that cause it.
//!    With `sub_windows` ≥ 3 the window is cut into that many runs of
//!    consecutive cycles and scored by the median of their rates (Horovod
//!    scores a sample by the median of its steps), so a disturbance in part
//!    of a window does not decide it.
//! 3. The driver judges the window ([`TuningSession::judge`]), saying
//!    whether something outside the job disturbed it. A disturbed window is
//!    measured again once; if the second window is disturbed too, the mean
//!    of both is passed to the optimizer with a noise hint of their spread.
//!
//! When the optimizer stops, the session **confirms** its choice before
//! pinning it: the chosen knobs and the start knobs are measured on fresh
//! windows, interleaved (choice, start, choice, …; `confirm_windows` of
//! each), and the choice is kept only if the median of its windows beats the
//! start's beyond their noise ([`Confirmation`]); two of each suffice when
//! every window of the choice beat every window of the start by
//! [`DECISIVE_GAIN`], one of each when the gain is [`OVERWHELMING_GAIN`]
//! on the fresh windows and the samples alike. Otherwise the start is
//! kept: a session never pins knobs that measured worse than the ones the
//! job came with.

use thiserror::Error;

use crate::optimizer::{Exploration, Optimizer, OptimizerConfig, OptimizerError, StopReason};
use crate::space::{
    CYCLE_TIME_MAX_MS, CYCLE_TIME_MIN_MS, CYCLE_TIME_MS, CollectiveKnobs, Dim, DimKind,
    FUSION_OFF_AT_OR_BELOW_BYTES, FUSION_THRESHOLD_BYTES, FUSION_THRESHOLD_CEILING_BYTES,
    FUSION_THRESHOLD_FLOOR_BYTES, HIERARCHICAL_ALLREDUCE, Point, Space, Value,
};

/// Smallest noise hint given to a twice-disturbed sample, relative to its
/// score: two disturbed windows that happen to agree are still not trusted
/// like a clean one.
const MIN_RELATIVE_NOISE_OF_DISTURBED: f64 = 0.1;

/// A confirmed choice must beat the start by at least this fraction, even
/// when the windows agree perfectly: a change within a percent is not worth
/// the risk of pinning new knobs.
pub const MIN_CONFIRMED_GAIN: f64 = 0.01;

/// The confirmation ends after two windows of each when every window of the
/// choice beat every window of the start by this factor: a gain that large
/// is not noise (a disturbance slows a job by less), and each further
/// window of the start costs the job.
pub const DECISIVE_GAIN: f64 = 1.2;

/// One window of each suffices when the choice's window and its sample
/// beat the start's window and its sample by this factor: for such a gain
/// to be a disturbance, both windows of the start (its sample keeps the
/// faster of two) and its confirmation window would all have had to be
/// slowed by a third.
pub const OVERWHELMING_GAIN: f64 = 1.5;

/// Why a session could not be set up or driven.
#[derive(Debug, Error)]
pub enum SessionError {
    /// The configuration cannot work.
    #[error("invalid tuning session: {0}")]
    Config(String),
    /// The driver called a method that does not fit the current step.
    #[error("tuning session protocol: {0}")]
    Protocol(String),
    /// The optimizer refused the configuration or an observation.
    #[error(transparent)]
    Optimizer(#[from] OptimizerError),
}

/// Narrower ranges for the searched knobs (`None`: the full range of
/// [`Space::collective`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct KnobBounds {
    /// Fusion threshold range in bytes, `(low, high)`.
    pub fusion_threshold_bytes: Option<(u64, u64)>,
    /// Cycle time range in milliseconds, `(low, high)`.
    pub cycle_time_ms: Option<(f64, f64)>,
}

/// Knobs kept at a fixed value instead of being searched.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct FixedKnobs {
    /// Fusion threshold in bytes (0 = fusion off).
    pub fusion_threshold_bytes: Option<u64>,
    /// Cycle time in milliseconds.
    pub cycle_time_ms: Option<f64>,
    /// Hierarchical allreduce on or off.
    pub hierarchical_allreduce: Option<bool>,
}

/// Settings of one session.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionConfig {
    /// Samples (optimizer observations) at most; re-measured windows do not
    /// count.
    pub budget: usize,
    /// Cycles with work skipped after new knobs are applied.
    pub warmup_cycles: u64,
    /// A window holds at least this many cycle-to-cycle intervals...
    pub measured_cycles: u64,
    /// ...and spans at least this long, in microseconds of the job's clock.
    pub min_window_us: u64,
    /// Seed of the optimizer's random choices.
    pub seed: u64,
    /// The knobs the job runs with when the session starts: sample 0, and
    /// the baseline of the speedup a report shows.
    pub start: CollectiveKnobs,
    /// Narrower search ranges.
    pub bounds: KnobBounds,
    /// Knobs not searched.
    pub fixed: FixedKnobs,
    /// A window is scored by the median rate of this many runs of its
    /// cycles (fewer than 3: by its overall rate).
    pub sub_windows: usize,
    /// Windows of the choice and of the start, each, measured interleaved
    /// before pinning (0: pin the model's choice unconfirmed).
    pub confirm_windows: usize,
    /// How the optimizer explores, and whether it discounts low outliers.
    pub exploration: Exploration,
    /// See [`OptimizerConfig::robust`].
    pub robust: bool,
    /// Measure the start on two clean windows and keep the faster.
    pub repeat_start: bool,
    /// Re-check knobs an earlier session pinned (conditions changed since,
    /// see [`crate::watch`]): they are sample 1, right after the start; if
    /// they measure at least as fast as the start, they are confirmed
    /// against it at once and, if they win, kept without tuning again.
    /// Otherwise the session tunes as usual.
    pub recheck: Option<CollectiveKnobs>,
}

impl Default for SessionConfig {
    fn default() -> Self {
        SessionConfig {
            budget: 20,
            warmup_cycles: 3,
            measured_cycles: 10,
            min_window_us: 1_000_000,
            seed: 0,
            start: CollectiveKnobs::default(),
            bounds: KnobBounds::default(),
            fixed: FixedKnobs::default(),
            sub_windows: 1,
            confirm_windows: 3,
            exploration: Exploration::default(),
            robust: true,
            repeat_start: true,
            recheck: None,
        }
    }
}

/// What the driver must do now.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Step {
    /// Set these knobs on the job, then call [`TuningSession::applied`].
    Apply(CollectiveKnobs),
    /// Feed the job's cycles to [`TuningSession::observe_cycle`].
    Measure,
    /// The session is over: pin [`TuningSession::best`].
    Done,
}

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

/// What [`TuningSession::judge`] made of a window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The window was disturbed and is measured again with the same knobs.
    Remeasure,
    /// The start's first window was clean; a second one is measured and the
    /// faster of the two kept (a disturbance only slows a job, and the
    /// start is what every later sample is weighed against).
    Repeat,
    /// A sample was recorded (its index in [`TuningSession::samples`]).
    Sample(usize),
    /// A confirmation window was recorded (its index in the confirmation's
    /// windows, see [`TuningSession::confirmation`]).
    Confirmation(usize),
}

/// One recorded sample.
#[derive(Debug, Clone, PartialEq)]
pub struct SessionSample {
    /// Index, from 0.
    pub index: usize,
    /// The knobs measured.
    pub knobs: CollectiveKnobs,
    /// Bytes reduced per second passed to the optimizer.
    pub score: f64,
    /// The window the score comes from (the second one when re-measured).
    pub window: Window,
    /// Noise standard deviation hinted to the optimizer (score units).
    pub noise_hint: Option<f64>,
    /// Why the kept window was disturbed (`None`: clean).
    pub disturbed: Option<String>,
    /// Why the first window was thrown away (`None`: it was kept).
    pub remeasured_because: Option<String>,
    /// Seconds since the session started, as the driver measured.
    pub wall_time_s: f64,
}

/// Which knobs a confirmation window measured.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Candidate {
    /// The optimizer's choice.
    Choice,
    /// The knobs the job started with.
    Start,
}

/// One window of the confirmation.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfirmationWindow {
    /// Whose window.
    pub candidate: Candidate,
    /// Its score, bytes/s.
    pub score: f64,
    /// The window.
    pub window: Window,
    /// Why it was disturbed, if the driver said so (kept anyway after one
    /// re-measurement: the median copes with one bad window).
    pub disturbed: Option<String>,
    /// Seconds since the session started.
    pub wall_time_s: f64,
}

/// The comparison of the optimizer's choice with the start before pinning.
#[derive(Debug, Clone, PartialEq)]
pub struct Confirmation {
    /// The optimizer's choice (or the knobs being re-checked).
    pub choice: CollectiveKnobs,
    /// Its sample (index into the session's samples).
    pub choice_sample: usize,
    /// The windows, in the order measured.
    pub windows: Vec<ConfirmationWindow>,
    /// Median score of the choice's windows (once decided).
    pub choice_median: Option<f64>,
    /// Median score of the start's windows (once decided).
    pub start_median: Option<f64>,
    /// The gain the choice had to show, relative to the start.
    pub required_gain: Option<f64>,
    /// What is pinned (once decided).
    pub kept: Option<Candidate>,
}

impl Confirmation {
    fn scores(&self, candidate: Candidate) -> Vec<f64> {
        self.windows
            .iter()
            .filter(|w| w.candidate == candidate)
            .map(|w| w.score)
            .collect()
    }

    /// Two windows of each, every one of the choice's at least
    /// [`DECISIVE_GAIN`] × every one of the start's; or one of each, with
    /// the sessions' samples, at least [`OVERWHELMING_GAIN`] × (scores of
    /// the choice's and the start's samples given).
    fn decisive(&self, choice_sample: f64, start_sample: f64) -> bool {
        let choice = self.scores(Candidate::Choice);
        let start = self.scores(Candidate::Start);
        let lowest = choice.iter().copied().fold(f64::INFINITY, f64::min);
        let highest = start.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        if choice.len() >= 2 && start.len() >= 2 {
            return lowest >= DECISIVE_GAIN * highest;
        }
        !choice.is_empty()
            && !start.is_empty()
            && lowest.min(choice_sample) >= OVERWHELMING_GAIN * highest.max(start_sample)
    }

    /// Decides from the windows: the choice wins if its median beats the
    /// start's by more than [`MIN_CONFIRMED_GAIN`] and by more than the
    /// noise of a difference of two medians (1.25 σ·√(2/k), σ from the
    /// pooled median absolute deviation).
    fn decide(&mut self) {
        let choice = self.scores(Candidate::Choice);
        let start = self.scores(Candidate::Start);
        let (Some(c), Some(s)) = (median(&choice), median(&start)) else {
            self.kept = Some(Candidate::Start);
            return;
        };
        let mut deviations: Vec<f64> = choice
            .iter()
            .map(|x| (x - c).abs() / c.abs().max(f64::MIN_POSITIVE))
            .chain(
                start
                    .iter()
                    .map(|x| (x - s).abs() / s.abs().max(f64::MIN_POSITIVE)),
            )
            .collect();
        deviations.retain(|d| d.is_finite());
        let sigma = 1.4826 * median(&deviations).unwrap_or(0.0);
        let k = choice.len().min(start.len()).max(1) as f64;
        let required = MIN_CONFIRMED_GAIN.max(1.25 * sigma * (2.0 / k).sqrt());
        self.choice_median = Some(c);
        self.start_median = Some(s);
        self.required_gain = Some(required);
        self.kept = Some(if c > s * (1.0 + required) {
            Candidate::Choice
        } else {
            Candidate::Start
        });
    }
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

/// The recommendation: the sampled knobs with the highest posterior mean.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Best {
    /// The knobs to pin.
    pub knobs: CollectiveKnobs,
    /// The GP's estimate of their score (bytes/s).
    pub predicted_score: f64,
    /// Index of the sample.
    pub sample: usize,
}

/// What a window being measured is for.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Purpose {
    /// A sample for the optimizer.
    Sample,
    /// A confirmation window.
    Confirm(Candidate),
}

#[derive(Debug, Clone)]
struct Measuring {
    purpose: Purpose,
    knobs: CollectiveKnobs,
    point: Point,
    /// Cycles before this one are ignored (they ran with other knobs).
    first_cycle: u64,
    warmup_left: u64,
    cycles: Vec<CycleObservation>,
    /// The window handed out and not yet judged.
    pending: Option<Window>,
    /// The first, disturbed window of this sample and why.
    disturbed_before: Option<(Window, String)>,
    /// The start's first clean window, while its second is measured.
    repeat_of: Option<Window>,
}

#[derive(Debug, Clone)]
enum State {
    Applying {
        purpose: Purpose,
        knobs: CollectiveKnobs,
        point: Point,
    },
    Measuring(Box<Measuring>),
    Done,
}

/// Which searched dimension of the session's space is which knob.
#[derive(Debug, Clone, Copy, Default)]
struct Layout {
    fusion: Option<usize>,
    cycle: Option<usize>,
    hierarchical: Option<usize>,
}

/// A tuning session (see the module documentation for the protocol).
#[derive(Debug, Clone)]
pub struct TuningSession {
    config: SessionConfig,
    optimizer: Optimizer,
    layout: Layout,
    state: State,
    samples: Vec<SessionSample>,
    confirmation: Option<Confirmation>,
    /// The re-check of `config.recheck` lost (at its sample or its
    /// confirmation): the session tunes.
    recheck_lost: bool,
    /// The re-check's confirmation, once it lost.
    recheck_confirmation: Option<Confirmation>,
    context: Option<SessionContext>,
    stopped: bool,
}

/// Why a session started, for its report (a re-tune after the watch saw the
/// job's throughput change).
#[derive(Debug, Clone, PartialEq)]
pub struct SessionContext {
    /// One sentence.
    pub note: String,
    /// The job's throughput since the previous pin: `(seconds since the
    /// first window, bytes/s)` per watched window.
    pub timeline: Vec<(f64, f64)>,
}

/// What a session's report shows ([`TuningSession::report_data`]): plain
/// data, so that building and writing the report ([`crate::report`]) stays
/// out of the session.
#[derive(Debug, Clone, Copy)]
pub struct ReportData<'a> {
    /// The recorded samples, in order.
    pub samples: &'a [SessionSample],
    /// The recommended sample ([`TuningSession::best`]), if any.
    pub best_sample: Option<usize>,
    /// The confirmation of the choice against the start (or the re-check).
    pub confirmation: Option<&'a Confirmation>,
    /// The re-check's confirmation when the re-checked knobs lost it.
    pub recheck_confirmation: Option<&'a Confirmation>,
    /// Whether the session re-checked knobs pinned before.
    pub rechecked: bool,
    /// Whether that re-check lost (so the session tuned again).
    pub recheck_lost: bool,
    /// Why the session started, if the driver said.
    pub context: Option<&'a SessionContext>,
}

fn check_range(
    name: &str,
    (low, high): (f64, f64),
    min: f64,
    max: f64,
) -> Result<(), SessionError> {
    if !(low.is_finite() && high.is_finite() && low < high && low >= min && high <= max) {
        return Err(SessionError::Config(format!(
            "bounds of {name} must satisfy {min} ≤ low < high ≤ {max}, got [{low}, {high}]"
        )));
    }
    Ok(())
}

impl TuningSession {
    /// A session ready to apply its first sample (the starting knobs,
    /// clamped into the bounds). Refuses a zero budget or window, bounds
    /// outside the collective space, and a configuration with every knob
    /// fixed (nothing to tune).
    pub fn new(config: SessionConfig) -> Result<Self, SessionError> {
        if config.budget == 0 {
            return Err(SessionError::Config(
                "budget must be at least 1 sample".into(),
            ));
        }
        if config.measured_cycles == 0 {
            return Err(SessionError::Config(
                "measured_cycles must be at least 1".into(),
            ));
        }
        let mut dims = Vec::new();
        let mut layout = Layout::default();
        if config.fixed.fusion_threshold_bytes.is_none() {
            let (low, high) = match config.bounds.fusion_threshold_bytes {
                Some((l, h)) => {
                    let range = (l as f64, h as f64);
                    check_range(
                        FUSION_THRESHOLD_BYTES,
                        range,
                        FUSION_THRESHOLD_FLOOR_BYTES,
                        FUSION_THRESHOLD_CEILING_BYTES,
                    )?;
                    range
                }
                None => (FUSION_THRESHOLD_FLOOR_BYTES, FUSION_THRESHOLD_CEILING_BYTES),
            };
            layout.fusion = Some(dims.len());
            dims.push(Dim {
                name: FUSION_THRESHOLD_BYTES.to_owned(),
                kind: DimKind::Continuous {
                    low,
                    high,
                    log_scale: true,
                },
            });
        }
        if config.fixed.cycle_time_ms.is_none() {
            let (low, high) = match config.bounds.cycle_time_ms {
                Some(range) => {
                    check_range(CYCLE_TIME_MS, range, CYCLE_TIME_MIN_MS, CYCLE_TIME_MAX_MS)?;
                    range
                }
                None => (CYCLE_TIME_MIN_MS, CYCLE_TIME_MAX_MS),
            };
            layout.cycle = Some(dims.len());
            dims.push(Dim {
                name: CYCLE_TIME_MS.to_owned(),
                kind: DimKind::Continuous {
                    low,
                    high,
                    log_scale: true,
                },
            });
        }
        if config.fixed.hierarchical_allreduce.is_none() {
            layout.hierarchical = Some(dims.len());
            dims.push(Dim {
                name: HIERARCHICAL_ALLREDUCE.to_owned(),
                kind: DimKind::Boolean,
            });
        }
        if dims.is_empty() {
            return Err(SessionError::Config(
                "every knob is fixed: nothing to tune".into(),
            ));
        }
        if let Some(ms) = config.fixed.cycle_time_ms
            && !(ms.is_finite() && ms > 0.0)
        {
            return Err(SessionError::Config(format!(
                "fixed cycle_time_ms must be a positive number, got {ms}"
            )));
        }
        let space =
            Space::new(dims).map_err(|e| SessionError::Config(format!("search space: {e}")))?;
        let mut session = TuningSession {
            config,
            optimizer: Optimizer::new(space.clone(), OptimizerConfig::default())?,
            layout,
            state: State::Done,
            samples: Vec::new(),
            confirmation: None,
            recheck_lost: false,
            recheck_confirmation: None,
            context: None,
            stopped: false,
        };
        let start = session.point_of(&session.config.start);
        let early_points: Vec<Point> = session
            .config
            .recheck
            .iter()
            .map(|k| session.point_of(k))
            .filter(|p| *p != start)
            .collect();
        // Re-checking the start itself is just tuning.
        session.recheck_lost = session.config.recheck.is_some() && early_points.is_empty();
        session.optimizer = Optimizer::new(
            space,
            OptimizerConfig {
                seed: session.config.seed,
                budget: session.config.budget,
                start: Some(start),
                early_points,
                exploration: session.config.exploration.clone(),
                robust: session.config.robust,
                ..OptimizerConfig::default()
            },
        )?;
        session.state = session.next_apply();
        Ok(session)
    }

    /// The configuration.
    pub fn config(&self) -> &SessionConfig {
        &self.config
    }

    /// The optimizer's search space (only the searched knobs).
    pub fn space(&self) -> &Space {
        self.optimizer.space()
    }

    /// What the driver must do now.
    pub fn next_step(&self) -> Step {
        match &self.state {
            State::Applying { knobs, .. } => Step::Apply(*knobs),
            State::Measuring(_) => Step::Measure,
            State::Done => Step::Done,
        }
    }

    /// The knobs being applied or measured (`None` once done).
    pub fn current_knobs(&self) -> Option<CollectiveKnobs> {
        match &self.state {
            State::Applying { knobs, .. } => Some(*knobs),
            State::Measuring(m) => Some(m.knobs),
            State::Done => None,
        }
    }

    /// The job confirmed the knobs of [`Step::Apply`]: `first_cycle` is the
    /// first cycle every rank runs with them.
    pub fn applied(&mut self, first_cycle: u64) -> Result<(), SessionError> {
        let State::Applying {
            purpose,
            knobs,
            point,
        } = &self.state
        else {
            return Err(SessionError::Protocol(
                "applied() called while no knobs were being applied".into(),
            ));
        };
        self.state = State::Measuring(Box::new(Measuring {
            purpose: *purpose,
            knobs: *knobs,
            point: point.clone(),
            first_cycle,
            warmup_left: self.config.warmup_cycles,
            cycles: Vec::new(),
            pending: None,
            disturbed_before: None,
            repeat_of: None,
        }));
        Ok(())
    }

    /// Takes one cycle of the job; returns the window once it is complete
    /// (judge it with [`TuningSession::judge`]). Cycles before the knobs
    /// took effect, warm-up cycles, cycles that arrive while no window is
    /// being measured, and cycles out of order are ignored.
    pub fn observe_cycle(&mut self, cycle: &CycleObservation) -> Option<Window> {
        let State::Measuring(m) = &mut self.state else {
            return None;
        };
        if m.pending.is_some() || cycle.cycle < m.first_cycle {
            return None;
        }
        if m.warmup_left > 0 {
            m.warmup_left -= 1;
            return None;
        }
        if let Some(last) = m.cycles.last()
            && (cycle.cycle <= last.cycle || cycle.start_unix_us < last.start_unix_us)
        {
            return None;
        }
        m.cycles.push(*cycle);
        let first = m.cycles[0];
        let span_us = cycle.start_unix_us - first.start_unix_us;
        let intervals = m.cycles.len() as u64 - 1;
        if intervals < self.config.measured_cycles || span_us < self.config.min_window_us.max(1) {
            return None;
        }
        let bytes: u64 = m.cycles[..m.cycles.len() - 1]
            .iter()
            .map(|c| c.bytes_reduced)
            .sum();
        let overall = bytes as f64 / (span_us as f64 / 1e6);
        let score = sub_window_median(&m.cycles, self.config.sub_windows).unwrap_or(overall);
        let window = Window {
            first_cycle: first.cycle,
            last_cycle: cycle.cycle,
            start_unix_us: first.start_unix_us,
            end_unix_us: cycle.start_unix_us,
            cycles: m.cycles.len() as u64,
            bytes_reduced: bytes,
            score,
            overall_score: overall,
        };
        m.pending = Some(window);
        Some(window)
    }

    /// Judges the window [`TuningSession::observe_cycle`] returned:
    /// `disturbance` says why something outside the job disturbed it
    /// (`None`: clean); `wall_time_s` is the driver's time since the session
    /// started. The first disturbed window of a sample is measured again;
    /// otherwise a sample is recorded and the next knobs are chosen.
    pub fn judge(
        &mut self,
        window: &Window,
        disturbance: Option<String>,
        wall_time_s: f64,
    ) -> Result<Verdict, SessionError> {
        let State::Measuring(m) = &mut self.state else {
            return Err(SessionError::Protocol(
                "judge() called while no window was being measured".into(),
            ));
        };
        if m.pending.as_ref() != Some(window) {
            return Err(SessionError::Protocol(format!(
                "judge() got a window (cycles {}..{}) that is not the one being judged",
                window.first_cycle, window.last_cycle
            )));
        }
        m.pending = None;
        if self.config.repeat_start
            && m.purpose == Purpose::Sample
            && self.samples.is_empty()
            && disturbance.is_none()
            && m.repeat_of.is_none()
            && m.disturbed_before.is_none()
        {
            // The start's first window was clean: measure a second one.
            m.repeat_of = Some(*window);
            m.first_cycle = window.last_cycle + 1;
            m.warmup_left = 0;
            m.cycles.clear();
            return Ok(Verdict::Repeat);
        }
        let (mut score, noise_hint, disturbed, remeasured_because) =
            match (disturbance, m.disturbed_before.take()) {
                (Some(reason), None) => {
                    // Measure again from the cycle after this window.
                    m.disturbed_before = Some((*window, reason));
                    m.first_cycle = window.last_cycle + 1;
                    m.warmup_left = 0;
                    m.cycles.clear();
                    return Ok(Verdict::Remeasure);
                }
                (None, before) => (window.score, None, None, before.map(|(_, r)| r)),
                (Some(reason), Some((first, first_reason))) => {
                    let mean = (first.score + window.score) / 2.0;
                    let spread = (first.score - window.score)
                        .abs()
                        .max(MIN_RELATIVE_NOISE_OF_DISTURBED * mean.abs());
                    (mean, Some(spread), Some(reason), Some(first_reason))
                }
            };
        let mut window = *window;
        if let Some(first) = m.repeat_of.take()
            && first.score > score
        {
            // Disturbances only slow a job: the faster window is the start.
            score = first.score;
            window = first;
        }
        let window = &window;
        let knobs = m.knobs;
        let point = m.point.clone();
        if let Purpose::Confirm(candidate) = m.purpose {
            let confirmation = self.confirmation.as_mut().ok_or_else(|| {
                SessionError::Protocol("a confirmation window without a confirmation".into())
            })?;
            confirmation.windows.push(ConfirmationWindow {
                candidate,
                score,
                window: *window,
                disturbed: disturbed.or(remeasured_because),
                wall_time_s,
            });
            self.state = self.next_apply();
            return Ok(Verdict::Confirmation(confirmation_index(
                &self.confirmation,
            )));
        }
        if let Err(error) = self.optimizer.observe(point, score, noise_hint) {
            // Nothing was recorded; give the window back so the caller may
            // stop cleanly.
            if let State::Measuring(m) = &mut self.state {
                m.pending = Some(*window);
            }
            return Err(error.into());
        }
        let index = self.samples.len();
        self.samples.push(SessionSample {
            index,
            knobs,
            score,
            window: *window,
            noise_hint,
            disturbed,
            remeasured_because,
            wall_time_s,
        });
        self.state = self.next_apply();
        Ok(Verdict::Sample(index))
    }

    /// Ends the session now: [`TuningSession::next_step`] says
    /// [`Step::Done`] from here on.
    pub fn stop(&mut self) {
        self.stopped = true;
        self.state = State::Done;
    }

    /// Whether the session was ended by [`TuningSession::stop`].
    pub fn was_stopped(&self) -> bool {
        self.stopped
    }

    /// Why the optimizer says to stop (budget spent or converged), if it does.
    pub fn stop_reason(&self) -> Option<StopReason> {
        self.optimizer.stop_reason()
    }

    /// The samples recorded so far.
    pub fn samples(&self) -> &[SessionSample] {
        &self.samples
    }

    /// The recommendation so far (`None` before the first sample): the
    /// model's choice, or, once the confirmation kept the start, the start
    /// (sample 0).
    pub fn best(&self) -> Option<Best> {
        if let Some(Confirmation {
            kept: Some(Candidate::Start),
            start_median,
            ..
        }) = &self.confirmation
        {
            let start = self.samples.first()?;
            return Some(Best {
                knobs: start.knobs,
                predicted_score: start_median.unwrap_or(start.score),
                sample: 0,
            });
        }
        if let Some(Confirmation {
            kept: Some(Candidate::Choice),
            choice,
            choice_sample,
            choice_median,
            ..
        }) = &self.confirmation
        {
            return Some(Best {
                knobs: *choice,
                predicted_score: choice_median.unwrap_or(f64::NAN),
                sample: *choice_sample,
            });
        }
        let best = self.optimizer.best()?;
        Some(Best {
            knobs: self.samples.get(best.index)?.knobs,
            predicted_score: best.predicted_score,
            sample: best.index,
        })
    }

    /// The re-check's confirmation when the re-checked knobs lost it (the
    /// session then tuned again); `None` otherwise.
    pub fn recheck_confirmation(&self) -> Option<&Confirmation> {
        self.recheck_confirmation.as_ref()
    }

    /// Whether this session re-checked earlier knobs and found they no
    /// longer win (so it tuned again).
    pub fn recheck_lost(&self) -> bool {
        self.recheck_lost
    }

    /// Says why the session started, for its report.
    pub fn set_context(&mut self, context: SessionContext) {
        self.context = Some(context);
    }

    /// Why the session started, if the driver said.
    pub fn context(&self) -> Option<&SessionContext> {
        self.context.as_ref()
    }

    /// The comparison of the choice with the start before pinning (`None`
    /// until it begins, and when the choice is the start or confirmation
    /// is off).
    pub fn confirmation(&self) -> Option<&Confirmation> {
        self.confirmation.as_ref()
    }

    /// Measured speedup of the recommended knobs over the starting knobs:
    /// from the confirmation's medians once it decided (1 when it kept the
    /// start), else the recommended sample's score over sample 0's.
    pub fn speedup_over_start(&self) -> Option<f64> {
        if let Some(c) = &self.confirmation
            && let (Some(kept), Some(choice), Some(start)) =
                (c.kept, c.choice_median, c.start_median)
        {
            return Some(match kept {
                Candidate::Start => 1.0,
                Candidate::Choice if start > 0.0 => choice / start,
                Candidate::Choice => return None,
            });
        }
        let best = self.best()?;
        let start = self.samples.first()?.score;
        (start > 0.0).then(|| self.samples[best.sample].score / start)
    }

    /// Low outliers the optimizer discounted (sample indices).
    pub fn low_outliers(&self) -> &[usize] {
        self.optimizer.low_outliers()
    }

    /// What the session's report shows, borrowed from the session:
    /// [`crate::report`] builds and writes the report from it.
    pub fn report_data(&self) -> ReportData<'_> {
        ReportData {
            samples: &self.samples,
            best_sample: self.best().map(|b| b.sample),
            confirmation: self.confirmation.as_ref(),
            recheck_confirmation: self.recheck_confirmation.as_ref(),
            rechecked: self.config.recheck.is_some(),
            recheck_lost: self.recheck_lost,
            context: self.context.as_ref(),
        }
    }

    fn next_apply(&mut self) -> State {
        if self.stopped {
            return State::Done;
        }
        // Re-check mode: once the start (sample 0) and the re-checked knobs
        // (sample 1) are in, confirm at once if the latter kept up.
        let rechecking = self.config.recheck.is_some() && !self.recheck_lost;
        if rechecking
            && self.samples.len() >= 2
            && self.confirmation.is_none()
            && self.samples[1].score < self.samples[0].score
        {
            self.recheck_lost = true;
        }
        let rechecking = self.config.recheck.is_some() && !self.recheck_lost;
        let confirm_now = rechecking && self.samples.len() >= 2;
        if !confirm_now && !self.optimizer.should_stop() {
            let point = self.optimizer.suggest();
            return State::Applying {
                purpose: Purpose::Sample,
                knobs: self.knobs_of(&point),
                point,
            };
        }
        // The optimizer is done: confirm its choice against the start.
        let k = self.config.confirm_windows;
        if k == 0 {
            return State::Done;
        }
        if self.confirmation.is_none() {
            let index = if confirm_now {
                1
            } else {
                let Some(best) = self.optimizer.best() else {
                    return State::Done;
                };
                best.index
            };
            let Some(choice) = self.samples.get(index) else {
                return State::Done;
            };
            let start = self.samples.first().map(|s| s.knobs);
            if index == 0 || Some(choice.knobs) == start {
                return State::Done;
            }
            self.confirmation = Some(Confirmation {
                choice: choice.knobs,
                choice_sample: index,
                windows: Vec::new(),
                choice_median: None,
                start_median: None,
                required_gain: None,
                kept: None,
            });
        }
        let Some(confirmation) = self.confirmation.as_mut() else {
            return State::Done;
        };
        let done = confirmation.windows.len();
        let choice_sample = self
            .samples
            .get(confirmation.choice_sample)
            .map_or(f64::INFINITY, |s| s.score);
        let start_sample = self.samples.first().map_or(f64::INFINITY, |s| s.score);
        if done >= 2 * k || (done % 2 == 0 && confirmation.decisive(choice_sample, start_sample)) {
            if confirmation.kept.is_none() {
                confirmation.decide();
            }
            if confirm_now && confirmation.kept == Some(Candidate::Start) {
                // The re-checked knobs lost: tune again.
                self.recheck_lost = true;
                self.recheck_confirmation = self.confirmation.take();
                return self.next_apply();
            }
            return State::Done;
        }
        // Interleaved: choice, start, choice, start, …
        let (candidate, knobs) = if done % 2 == 0 {
            (Candidate::Choice, confirmation.choice)
        } else {
            // Sample 0's knobs: the start as measured (clamped into bounds).
            let start = self.samples.first().map_or(self.config.start, |s| s.knobs);
            (Candidate::Start, start)
        };
        State::Applying {
            purpose: Purpose::Confirm(candidate),
            point: self.point_of(&knobs),
            knobs,
        }
    }

    /// The point of the session's space for `knobs` (clamped into bounds).
    fn point_of(&self, knobs: &CollectiveKnobs) -> Point {
        let mut values = Vec::new();
        for dim in self.optimizer.space().dims() {
            let clamp = |x: f64| match dim.kind {
                DimKind::Continuous { low, high, .. } => x.clamp(low, high),
                _ => x,
            };
            let value = match dim.name.as_str() {
                FUSION_THRESHOLD_BYTES => Value::Real(clamp(knobs.fusion_threshold_bytes as f64)),
                CYCLE_TIME_MS => Value::Real(clamp(if knobs.cycle_time_ms.is_finite() {
                    knobs.cycle_time_ms
                } else {
                    crate::DEFAULT_CYCLE_TIME_MS
                })),
                _ => Value::Bool(knobs.hierarchical_allreduce),
            };
            values.push(value);
        }
        Point(values)
    }

    /// The knobs of a point of the session's space, fixed knobs filled in.
    fn knobs_of(&self, point: &Point) -> CollectiveKnobs {
        let real = |i: Option<usize>| match i.and_then(|i| point.0.get(i)) {
            Some(Value::Real(x)) => Some(*x),
            _ => None,
        };
        let fusion = match (
            self.config.fixed.fusion_threshold_bytes,
            real(self.layout.fusion),
        ) {
            (Some(bytes), _) => bytes,
            (None, Some(x)) => {
                let bytes = x.round() as u64;
                if bytes <= FUSION_OFF_AT_OR_BELOW_BYTES {
                    0
                } else {
                    bytes
                }
            }
            (None, None) => self.config.start.fusion_threshold_bytes,
        };
        let cycle = self
            .config
            .fixed
            .cycle_time_ms
            .or(real(self.layout.cycle))
            .unwrap_or(self.config.start.cycle_time_ms);
        let hierarchical = match (
            self.config.fixed.hierarchical_allreduce,
            self.layout.hierarchical.and_then(|i| point.0.get(i)),
        ) {
            (Some(h), _) => h,
            (None, Some(Value::Bool(h))) => *h,
            _ => self.config.start.hierarchical_allreduce,
        };
        CollectiveKnobs {
            fusion_threshold_bytes: fusion,
            cycle_time_ms: cycle,
            hierarchical_allreduce: hierarchical,
        }
    }
}

fn confirmation_index(confirmation: &Option<Confirmation>) -> usize {
    confirmation
        .as_ref()
        .map_or(0, |c| c.windows.len().saturating_sub(1))
}

/// The median rate of `k` runs of consecutive cycle intervals (`None` for
/// fewer than 3 runs or too few intervals). A run's rate is the bytes of its
/// cycles over the time from its first cycle's start to the next run's.
fn sub_window_median(cycles: &[CycleObservation], k: usize) -> Option<f64> {
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

/// A pretend job and a driver for the session's tests and the report's.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;

    /// A pretend job: throughput is a known function of the knobs, the
    /// clock advances with each cycle.
    pub(crate) struct FakeJob {
        pub(crate) cycle: u64,
        pub(crate) now_us: u64,
        pub(crate) knobs: CollectiveKnobs,
    }

    impl FakeJob {
        /// A job at `cycle`, at time 0, on the default knobs.
        pub(crate) fn new(cycle: u64) -> Self {
            FakeJob {
                cycle,
                now_us: 0,
                knobs: CollectiveKnobs::default(),
            }
        }

        /// Bytes per second of these knobs: best at 16 MiB, 2 ms,
        /// hierarchical.
        pub(crate) fn rate(knobs: &CollectiveKnobs) -> f64 {
            let f = (knobs.fusion_threshold_bytes.max(1024) as f64).log2() - 24.0;
            let c = knobs.cycle_time_ms.log2() - 1.0;
            let h = if knobs.hierarchical_allreduce {
                1.5
            } else {
                1.0
            };
            1e9 * h / (1.0 + 0.05 * f * f + 0.1 * c * c)
        }

        pub(crate) fn next_cycle(&mut self) -> CycleObservation {
            self.cycle += 1;
            let duration_us = 10_000;
            let bytes = (Self::rate(&self.knobs) * duration_us as f64 / 1e6) as u64;
            let c = CycleObservation {
                cycle: self.cycle,
                start_unix_us: self.now_us,
                duration_us,
                bytes_reduced: bytes,
            };
            self.now_us += duration_us;
            c
        }
    }

    pub(crate) fn config() -> SessionConfig {
        SessionConfig {
            budget: 12,
            warmup_cycles: 2,
            measured_cycles: 5,
            min_window_us: 0,
            ..SessionConfig::default()
        }
    }

    /// Drives a session against the fake job; `disturb(sample, window)` says
    /// which windows were disturbed.
    pub(crate) fn drive(
        session: &mut TuningSession,
        job: &mut FakeJob,
        mut disturb: impl FnMut(usize, u64) -> Option<String>,
    ) {
        let mut windows = 0;
        for _ in 0..100_000 {
            match session.next_step() {
                Step::Apply(knobs) => {
                    job.knobs = knobs;
                    session.applied(job.cycle + 1).unwrap();
                }
                Step::Measure => {
                    let c = job.next_cycle();
                    if let Some(w) = session.observe_cycle(&c) {
                        windows += 1;
                        let d = disturb(session.samples().len(), windows);
                        session.judge(&w, d, windows as f64).unwrap();
                    }
                }
                Step::Done => return,
            }
        }
        panic!("the session never ended");
    }
}

#[cfg(test)]
mod tests {
    use super::testing::*;
    use super::*;

    #[test]
    fn scores_windows_exactly_and_pins_a_near_optimal_point() {
        let mut session = TuningSession::new(config()).unwrap();
        let mut job = FakeJob::new(100);
        drive(&mut session, &mut job, |_, _| None);
        let samples = session.samples();
        assert!(!samples.is_empty() && samples.len() <= 12);
        assert_eq!(samples[0].knobs, config().start, "sample 0 is the start");
        for s in samples {
            // Every cycle of the window ran with the sample's knobs at a
            // constant rate, so the score is that rate (to integer bytes).
            let expected = FakeJob::rate(&s.knobs);
            assert!(
                (s.score - expected).abs() / expected < 1e-6,
                "score {} vs rate {expected}",
                s.score
            );
            assert_eq!(s.window.cycles, 6);
            assert!(s.disturbed.is_none() && s.noise_hint.is_none());
        }
        let best = session.best().unwrap();
        let optimum = FakeJob::rate(&CollectiveKnobs {
            fusion_threshold_bytes: 16 << 20,
            cycle_time_ms: 2.0,
            hierarchical_allreduce: true,
        });
        assert!(best.knobs.hierarchical_allreduce);
        assert!(FakeJob::rate(&best.knobs) > 0.9 * optimum);
        assert!(session.speedup_over_start().unwrap() > 1.3);
        assert_eq!(session.next_step(), Step::Done);
    }

    #[test]
    fn skips_warmup_and_cycles_of_old_knobs() {
        let mut session = TuningSession::new(config()).unwrap();
        assert!(matches!(session.next_step(), Step::Apply(_)));
        session.applied(10).unwrap();
        let cycle = |n: u64, bytes: u64| CycleObservation {
            cycle: n,
            start_unix_us: n * 1000,
            duration_us: 100,
            bytes_reduced: bytes,
        };
        // Old knobs, then 2 warm-up cycles: all ignored (huge bytes).
        for n in [8, 9, 10, 11] {
            assert!(session.observe_cycle(&cycle(n, u64::MAX / 16)).is_none());
        }
        let mut window = None;
        for n in 12..=17 {
            window = session.observe_cycle(&cycle(n, 1000));
        }
        let w = window.expect("5 intervals complete the window");
        assert_eq!((w.first_cycle, w.last_cycle, w.cycles), (12, 17, 6));
        assert_eq!(w.bytes_reduced, 5000);
        // 5000 bytes over 5 ms.
        assert!((w.score - 1e6).abs() < 1e-6);
        // Nothing more is taken until it is judged.
        assert!(session.observe_cycle(&cycle(18, 1000)).is_none());
        assert!(
            session
                .judge(&Window { score: 1.0, ..w }, None, 0.0)
                .is_err()
        );
        // The start is measured on a second window.
        assert_eq!(session.judge(&w, None, 0.0).unwrap(), Verdict::Repeat);
    }

    #[test]
    fn a_disturbed_window_is_measured_again_once() {
        let mut session = TuningSession::new(SessionConfig {
            budget: 3,
            ..config()
        })
        .unwrap();
        let mut job = FakeJob::new(0);
        // Sample 0: first window disturbed, second clean. Sample 1: both
        // disturbed. Sample 2: clean.
        drive(&mut session, &mut job, |sample, _| match sample {
            0 | 1 => Some(format!("retransmits during sample {sample}")),
            _ => None,
        });
        let s = session.samples();
        assert_eq!(s.len(), 3);
        assert_eq!(
            s[0].remeasured_because.as_deref(),
            Some("retransmits during sample 0")
        );
        assert!(s[0].noise_hint.is_some(), "both windows disturbed → hint");
        assert_eq!(
            s[0].disturbed.as_deref(),
            Some("retransmits during sample 0")
        );
        assert!(s[2].disturbed.is_none() && s[2].remeasured_because.is_none());
        // The hint is at least 10% of the score even when both agree.
        assert!(s[0].noise_hint.unwrap() >= 0.1 * s[0].score - 1e-9);
    }

    #[test]
    fn a_clean_remeasure_is_kept_without_a_hint() {
        let mut session = TuningSession::new(SessionConfig {
            budget: 2,
            ..config()
        })
        .unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, window| {
            (window == 1).then(|| "run-queue wait".to_owned())
        });
        let s = session.samples();
        assert_eq!(s[0].remeasured_because.as_deref(), Some("run-queue wait"));
        assert!(s[0].disturbed.is_none() && s[0].noise_hint.is_none());
        assert!(s[1].remeasured_because.is_none());
    }

    #[test]
    fn fixed_knobs_and_bounds_are_respected() {
        let mut session = TuningSession::new(SessionConfig {
            bounds: KnobBounds {
                cycle_time_ms: Some((1.0, 4.0)),
                fusion_threshold_bytes: None,
            },
            fixed: FixedKnobs {
                fusion_threshold_bytes: Some(0),
                ..FixedKnobs::default()
            },
            ..config()
        })
        .unwrap();
        assert_eq!(session.space().dims().len(), 2);
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        for s in session.samples() {
            assert_eq!(s.knobs.fusion_threshold_bytes, 0);
            assert!(
                (1.0..=4.0).contains(&s.knobs.cycle_time_ms),
                "{:?}",
                s.knobs
            );
        }
    }

    #[test]
    fn refuses_configurations_that_cannot_work() {
        let all_fixed = SessionConfig {
            fixed: FixedKnobs {
                fusion_threshold_bytes: Some(1 << 20),
                cycle_time_ms: Some(1.0),
                hierarchical_allreduce: Some(false),
            },
            ..config()
        };
        assert!(TuningSession::new(all_fixed).is_err());
        assert!(
            TuningSession::new(SessionConfig {
                budget: 0,
                ..config()
            })
            .is_err()
        );
        let bad_bounds = SessionConfig {
            bounds: KnobBounds {
                cycle_time_ms: Some((5.0, 2.0)),
                ..KnobBounds::default()
            },
            ..config()
        };
        assert!(TuningSession::new(bad_bounds).is_err());
        let mut session = TuningSession::new(config()).unwrap();
        session.applied(0).unwrap();
        assert!(session.applied(0).is_err(), "applied twice");
    }

    #[test]
    fn stop_ends_the_session_and_keeps_the_samples() {
        let mut session = TuningSession::new(config()).unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        let n = session.samples().len();
        session.stop();
        assert_eq!(session.next_step(), Step::Done);
        assert!(session.was_stopped());
        assert_eq!(session.samples().len(), n);
    }

    #[test]
    fn the_start_keeps_the_faster_of_two_windows() {
        let mut session = TuningSession::new(config()).unwrap();
        session.applied(1).unwrap();
        let mut at = 0;
        // Two warm-up cycles, then a window of 6 cycles 1000 bytes each, 1 ms
        // apart; then one at 2 ms apart (a disturbance nobody reported).
        let mut window = |session: &mut TuningSession, gap_us: u64| {
            let mut out = None;
            for _ in 0..8 {
                at += 1;
                let c = CycleObservation {
                    cycle: at,
                    start_unix_us: at * gap_us,
                    duration_us: 10,
                    bytes_reduced: 1000,
                };
                out = out.or(session.observe_cycle(&c));
            }
            out.expect("a window")
        };
        let fast = window(&mut session, 1000);
        assert_eq!(session.judge(&fast, None, 1.0).unwrap(), Verdict::Repeat);
        let slow = window(&mut session, 2000);
        assert_eq!(session.judge(&slow, None, 2.0).unwrap(), Verdict::Sample(0));
        let s = &session.samples()[0];
        assert_eq!(s.score, fast.score);
        assert_eq!(s.window, fast);
        assert!((fast.score - 1e6).abs() < 1e-6 && (slow.score - 5e5).abs() < 1e-6);
    }

    #[test]
    fn sub_windows_score_by_their_median_rate() {
        // 9 intervals of 1 ms, 1000 bytes each, but the middle three took
        // 10 ms each (a disturbance): the overall rate is dragged down, the
        // median of three runs is not.
        let mut t = 0;
        let cycles: Vec<CycleObservation> = (0..10u64)
            .map(|i| {
                let c = CycleObservation {
                    cycle: i,
                    start_unix_us: t,
                    duration_us: 10,
                    bytes_reduced: 1000,
                };
                t += if (3..6).contains(&i) { 10_000 } else { 1000 };
                c
            })
            .collect();
        assert_eq!(sub_window_median(&cycles, 3), Some(1e6));
        assert_eq!(sub_window_median(&cycles, 1), None);
        assert_eq!(sub_window_median(&cycles[..3], 3), None);
        let mut session = TuningSession::new(SessionConfig {
            sub_windows: 3,
            measured_cycles: 9,
            warmup_cycles: 0,
            ..config()
        })
        .unwrap();
        session.applied(0).unwrap();
        let w = cycles
            .iter()
            .find_map(|c| session.observe_cycle(c))
            .expect("9 intervals make a window");
        assert_eq!(w.score, 1e6);
        assert!((w.overall_score - 9000.0 / 0.036).abs() < 1e-6);
    }

    /// A job whose knobs other than the start lose half their speed once
    /// `slow_after` samples are in (conditions changed under the session).
    fn drive_changing(session: &mut TuningSession, slow_after: usize) {
        let start = session.config().start;
        let mut job = FakeJob::new(0);
        let mut slowed = false;
        for _ in 0..100_000 {
            match session.next_step() {
                Step::Apply(knobs) => {
                    job.knobs = knobs;
                    session.applied(job.cycle + 1).unwrap();
                    slowed = session.samples().len() >= slow_after && knobs != start;
                }
                Step::Measure => {
                    let mut c = job.next_cycle();
                    if slowed {
                        c.bytes_reduced /= 2;
                    }
                    if let Some(w) = session.observe_cycle(&c) {
                        session.judge(&w, None, 0.0).unwrap();
                    }
                }
                Step::Done => return,
            }
        }
        panic!("the session never ended");
    }

    #[test]
    fn the_choice_is_confirmed_against_the_start_before_it_is_pinned() {
        // Nothing changes: hierarchical is 1.5× the start, so one window of
        // each settles it.
        let mut session = TuningSession::new(config()).unwrap();
        drive_changing(&mut session, usize::MAX);
        let c = session.confirmation().expect("the choice is not the start");
        assert_eq!(c.kept, Some(Candidate::Choice));
        let order: Vec<Candidate> = c.windows.iter().map(|w| w.candidate).collect();
        assert_eq!(order, [Candidate::Choice, Candidate::Start]);
        assert_eq!(session.best().unwrap().knobs, c.choice);
        let speedup = session.speedup_over_start().unwrap();
        assert!((speedup - c.choice_median.unwrap() / c.start_median.unwrap()).abs() < 1e-12);
        assert!(speedup > 1.3);

        // The choice halves once the budget is spent: the start is kept,
        // after all the windows (interleaved) it is owed.
        let mut session = TuningSession::new(config()).unwrap();
        drive_changing(&mut session, config().budget);
        let c = session.confirmation().expect("the choice is not the start");
        assert_eq!(c.kept, Some(Candidate::Start));
        assert_eq!(c.windows.len(), 2 * config().confirm_windows);
        assert!(c.windows.iter().enumerate().all(|(i, w)| w.candidate
            == if i % 2 == 0 {
                Candidate::Choice
            } else {
                Candidate::Start
            }));
        let best = session.best().unwrap();
        assert_eq!((best.knobs, best.sample), (config().start, 0));
        assert_eq!(session.speedup_over_start(), Some(1.0));
    }

    #[test]
    fn without_confirmation_the_models_choice_is_pinned() {
        let mut session = TuningSession::new(SessionConfig {
            confirm_windows: 0,
            ..config()
        })
        .unwrap();
        drive_changing(&mut session, config().budget);
        assert!(session.confirmation().is_none());
        assert!(session.best().unwrap().knobs.hierarchical_allreduce);
    }

    #[test]
    fn a_recheck_keeps_knobs_that_still_win_without_tuning_again() {
        let pinned = CollectiveKnobs {
            fusion_threshold_bytes: 16 << 20,
            cycle_time_ms: 2.0,
            hierarchical_allreduce: true,
        };
        let mut session = TuningSession::new(SessionConfig {
            recheck: Some(pinned),
            ..config()
        })
        .unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        assert_eq!(
            session.samples().len(),
            2,
            "the start, then the pinned knobs"
        );
        assert_eq!(session.samples()[1].knobs, pinned);
        assert!(!session.recheck_lost());
        assert_eq!(
            session.confirmation().unwrap().kept,
            Some(Candidate::Choice)
        );
        assert_eq!(session.best().unwrap().knobs, pinned);
    }

    #[test]
    fn a_recheck_that_loses_tunes_again() {
        let stale = CollectiveKnobs {
            fusion_threshold_bytes: 0,
            cycle_time_ms: 50.0,
            hierarchical_allreduce: false,
        };
        let mut session = TuningSession::new(SessionConfig {
            recheck: Some(stale),
            ..config()
        })
        .unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        assert!(session.recheck_lost());
        assert_eq!(session.samples()[1].knobs, stale);
        assert!(session.samples().len() > 2, "it tuned again");
        let best = session.best().unwrap();
        assert_ne!(best.knobs, stale);
        assert!(FakeJob::rate(&best.knobs) > FakeJob::rate(&config().start));
    }
}
