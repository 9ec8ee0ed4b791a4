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
//!    cycles spanning at least `min_window_us`. Where the job marks its
//!    training steps ([`StepMarks`] in the cycles), its score is steps per
//!    second over the whole steps the marks bound (at least
//!    `min_window_steps` of them): what the user measures. Otherwise it is
//!    bytes reduced per second, start to start: the bytes of every cycle but
//!    the last, over the time from the first cycle's start to the last
//!    one's, so that idle time between cycles (a long cycle time) counts
//!    against the knobs that cause it. The first window decides which
//!    ([`Objective`]), for the whole session.
//!    With `sub_windows` ≥ 3 the window is cut into that many runs of
//!    consecutive cycles and scored by the median of their rates (by steps:
//!    one over its median step, as Horovod scores a sample), so a
//!    disturbance in part of a window does not decide it.
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
//!
//! This file is the state machine ([`TuningSession`]); beside it: `config`
//! (the settings and their checks), `window` (cycles, windows and their
//! scores), `confirmation` (the choice against the start, and the rule that
//! decides), `record` (what a session records and hands its report).

use thiserror::Error;

mod config;
mod confirmation;
mod record;
#[cfg(test)]
pub(crate) mod testing;
#[cfg(test)]
mod tests;
mod window;

use config::check_range;
pub use config::{FixedKnobs, KnobBounds, SessionConfig};
pub use confirmation::{
    Candidate, Confirmation, ConfirmationWindow, DECISIVE_GAIN, MIN_CONFIRMED_GAIN,
    OVERWHELMING_GAIN,
};
pub use record::{Best, ReportData, SessionContext, SessionSample};
pub(crate) use window::median;
pub use window::{CycleObservation, Objective, StepMarks, Verdict, Window};
use window::{step_durations, sub_window_median};

/// A window scored by steps waits for `min_window_steps` whole steps at most
/// this long (µs, job clock), then is scored on the steps it has.
pub const MAX_STEPS_WINDOW_US: u64 = 60_000_000;

/// The first window, while the job has marked no step, spans this many times
/// `min_window_us` before the session settles for bytes per second: a job
/// whose steps are longer than a window still shows one.
pub const FIRST_WINDOW_STRETCH: u64 = 3;

use crate::optimizer::{Optimizer, OptimizerConfig, OptimizerError, StopReason};
use crate::space::{
    CYCLE_TIME_MAX_MS, CYCLE_TIME_MIN_MS, CYCLE_TIME_MS, CollectiveKnobs, Dim, DimKind,
    FUSION_OFF_AT_OR_BELOW_BYTES, FUSION_THRESHOLD_BYTES, FUSION_THRESHOLD_CEILING_BYTES,
    FUSION_THRESHOLD_FLOOR_BYTES, HIERARCHICAL_ALLREDUCE, Point, Space, Value,
};

/// Smallest noise hint given to a twice-disturbed sample, relative to its
/// score: two disturbed windows that happen to agree are still not trusted
/// like a clean one.
const MIN_RELATIVE_NOISE_OF_DISTURBED: f64 = 0.1;

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
    /// What windows are scored by, once the first window decided it.
    objective: Option<Objective>,
    /// The job marked a step in some cycle it reported.
    marks_seen: bool,
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
            objective: None,
            marks_seen: false,
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
        self.marks_seen |= cycle.steps.count > 0;
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
        let min_window_us = self.config.min_window_us.max(1);
        if intervals < self.config.measured_cycles || span_us < min_window_us {
            return None;
        }
        if self.objective.is_none()
            && !self.marks_seen
            && span_us < min_window_us.saturating_mul(FIRST_WINDOW_STRETCH)
        {
            return None;
        }
        // The first window that is long enough decides what every window
        // of the session is scored by: steps, if the job marked any since
        // the session began (warm-up cycles included).
        let marks_seen = self.marks_seen;
        let objective = *self.objective.get_or_insert(if marks_seen {
            Objective::StepsPerSecond
        } else {
            Objective::BytesPerSecond
        });
        let bytes: u64 = m.cycles[..m.cycles.len() - 1]
            .iter()
            .map(|c| c.bytes_reduced)
            .sum();
        let (steps, score, overall) = match objective {
            Objective::BytesPerSecond => {
                let overall = bytes as f64 / (span_us as f64 / 1e6);
                let score =
                    sub_window_median(&m.cycles, self.config.sub_windows).unwrap_or(overall);
                (0, score, overall)
            }
            Objective::StepsPerSecond => {
                let durations = step_durations(&m.cycles);
                let steps = durations.len() as u64;
                // A window holds whole steps enough; a job that stopped
                // marking them (or whose steps outgrew the window) is
                // scored on what it did within a bounded span.
                if steps < self.config.min_window_steps && span_us < MAX_STEPS_WINDOW_US {
                    return None;
                }
                let total_us: f64 = durations.iter().sum();
                let overall = if total_us > 0.0 {
                    steps as f64 / (total_us / 1e6)
                } else {
                    0.0
                };
                let score = if self.config.sub_windows >= 3 && steps >= 3 {
                    median(&durations).map_or(overall, |d| if d > 0.0 { 1e6 / d } else { 0.0 })
                } else {
                    overall
                };
                (steps, score, overall)
            }
        };
        let window = Window {
            first_cycle: first.cycle,
            last_cycle: cycle.cycle,
            start_unix_us: first.start_unix_us,
            end_unix_us: cycle.start_unix_us,
            cycles: m.cycles.len() as u64,
            bytes_reduced: bytes,
            steps,
            objective,
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
            objective: self.objective(),
        }
    }

    /// What the session's windows are scored by: decided by its first
    /// window (`None` before), steps per second if the job marks its steps.
    pub fn objective(&self) -> Option<Objective> {
        self.objective
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
