//! One tuning session's sample protocol, as a state machine: which knobs to
//! apply next, which of the job's cycles belong to the measurement window,
//! how a window is scored, what happens to a disturbed window, when to stop
//! and what to pin at the end.
//!
//! It is shared by the two drivers that tune a job — the agent (over the
//! job's control socket) and a job that tunes itself (in-process, on rank 0)
//! — so both measure the same way. It never reads a clock, does I/O or
//! starts threads: cycles and their timestamps come from the job, wall times
//! from the caller. The one exception is [`write_report`], which writes the
//! finished report's files where the caller says.
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
//! 3. The driver judges the window ([`TuningSession::judge`]), saying
//!    whether something outside the job disturbed it. A disturbed window is
//!    measured again once; if the second window is disturbed too, the mean
//!    of both is passed to the optimizer with a noise hint of their spread.

use std::path::{Path, PathBuf};

use polars::prelude::DataFrame;
use thiserror::Error;

use crate::optimizer::{Optimizer, OptimizerConfig, OptimizerError, StopReason};
use crate::report::{self, ReportError, SampleRecord};
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
    /// Bytes reduced per second.
    pub score: f64,
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
    /// A sample was recorded (its index in [`TuningSession::samples`]).
    Sample(usize),
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

/// The files [`write_report`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    /// The table of samples as CSV.
    pub csv: PathBuf,
    /// The same table as Parquet (re-render with `ringwatch-report`).
    pub parquet: PathBuf,
    /// The self-contained HTML page.
    pub html: PathBuf,
}

#[derive(Debug, Clone)]
struct Measuring {
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
}

#[derive(Debug, Clone)]
enum State {
    Applying {
        knobs: CollectiveKnobs,
        point: Point,
    },
    Measuring(Measuring),
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
    stopped: bool,
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
            stopped: false,
        };
        let start = session.point_of(&session.config.start);
        session.optimizer = Optimizer::new(
            space,
            OptimizerConfig {
                seed: session.config.seed,
                budget: session.config.budget,
                start: Some(start),
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
        let State::Applying { knobs, point } = &self.state else {
            return Err(SessionError::Protocol(
                "applied() called while no knobs were being applied".into(),
            ));
        };
        self.state = State::Measuring(Measuring {
            knobs: *knobs,
            point: point.clone(),
            first_cycle,
            warmup_left: self.config.warmup_cycles,
            cycles: Vec::new(),
            pending: None,
            disturbed_before: None,
        });
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
        let window = Window {
            first_cycle: first.cycle,
            last_cycle: cycle.cycle,
            start_unix_us: first.start_unix_us,
            end_unix_us: cycle.start_unix_us,
            cycles: m.cycles.len() as u64,
            bytes_reduced: bytes,
            score: bytes as f64 / (span_us as f64 / 1e6),
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
        let (score, noise_hint, disturbed, remeasured_because) =
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
        let knobs = m.knobs;
        let point = m.point.clone();
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

    /// The recommendation so far (`None` before the first sample).
    pub fn best(&self) -> Option<Best> {
        let best = self.optimizer.best()?;
        Some(Best {
            knobs: self.samples.get(best.index)?.knobs,
            predicted_score: best.predicted_score,
            sample: best.index,
        })
    }

    /// Measured speedup of the recommended knobs' sample over sample 0 (the
    /// starting knobs).
    pub fn speedup_over_start(&self) -> Option<f64> {
        let best = self.best()?;
        let start = self.samples.first()?.score;
        (start > 0.0).then(|| self.samples[best.sample].score / start)
    }

    /// The report's table (see [`report::session_frame`]): one row per
    /// sample with all three knobs, whether searched or fixed.
    pub fn report_frame(&self) -> Result<DataFrame, ReportError> {
        let records: Vec<SampleRecord> = self
            .samples
            .iter()
            .map(|s| SampleRecord {
                knobs: report_point(&s.knobs),
                score: s.score,
                noise_hint: s.noise_hint,
                disturbed: s.disturbed.clone(),
                remeasured_because: s.remeasured_because.clone(),
                wall_time_s: s.wall_time_s,
            })
            .collect();
        report::session_frame(&report_space(), &records, self.best().map(|b| b.sample))
    }

    fn next_apply(&mut self) -> State {
        if self.stopped || self.optimizer.should_stop() {
            return State::Done;
        }
        let point = self.optimizer.suggest();
        State::Applying {
            knobs: self.knobs_of(&point),
            point,
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

/// The report shows every knob, searched or fixed, over ranges wide enough
/// for any value a session can apply (fusion off is the 0 of the column).
fn report_space() -> Space {
    Space::new(vec![
        Dim {
            name: FUSION_THRESHOLD_BYTES.to_owned(),
            kind: DimKind::Continuous {
                low: 0.0,
                high: f64::MAX,
                log_scale: false,
            },
        },
        Dim {
            name: CYCLE_TIME_MS.to_owned(),
            kind: DimKind::Continuous {
                low: 0.0,
                high: f64::MAX,
                log_scale: false,
            },
        },
        Dim {
            name: HIERARCHICAL_ALLREDUCE.to_owned(),
            kind: DimKind::Boolean,
        },
    ])
    .expect("the report space is declared with valid, distinct dimensions")
}

fn report_point(knobs: &CollectiveKnobs) -> Point {
    Point(vec![
        Value::Real(knobs.fusion_threshold_bytes as f64),
        Value::Real(knobs.cycle_time_ms),
        Value::Bool(knobs.hierarchical_allreduce),
    ])
}

/// Writes the session's report as `<dir>/<stem>.csv`, `.parquet` and
/// `.html` (the directory must exist). This is the one function of the
/// crate that opens files: the agent and a self-tuning job both call it so
/// that their reports are the same.
pub fn write_report(
    session: &TuningSession,
    dir: &Path,
    stem: &str,
    title: &str,
) -> Result<ReportFiles, ReportError> {
    let frame = session.report_frame()?;
    let files = ReportFiles {
        csv: dir.join(format!("{stem}.csv")),
        parquet: dir.join(format!("{stem}.parquet")),
        html: dir.join(format!("{stem}.html")),
    };
    let create = |path: &Path| std::fs::File::create(path).map(std::io::BufWriter::new);
    report::write_csv(&frame, create(&files.csv)?)?;
    report::write_parquet(&frame, create(&files.parquet)?)?;
    std::fs::write(&files.html, report::render_html(&frame, title)?)?;
    Ok(files)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A pretend job: throughput is a known function of the knobs, the
    /// clock advances with each cycle.
    struct FakeJob {
        cycle: u64,
        now_us: u64,
        knobs: CollectiveKnobs,
    }

    impl FakeJob {
        /// A job at `cycle`, at time 0, on the default knobs.
        fn new(cycle: u64) -> Self {
            FakeJob {
                cycle,
                now_us: 0,
                knobs: CollectiveKnobs::default(),
            }
        }

        /// Bytes per second of these knobs: best at 16 MiB, 2 ms,
        /// hierarchical.
        fn rate(knobs: &CollectiveKnobs) -> f64 {
            let f = (knobs.fusion_threshold_bytes.max(1024) as f64).log2() - 24.0;
            let c = knobs.cycle_time_ms.log2() - 1.0;
            let h = if knobs.hierarchical_allreduce {
                1.5
            } else {
                1.0
            };
            1e9 * h / (1.0 + 0.05 * f * f + 0.1 * c * c)
        }

        fn next_cycle(&mut self) -> CycleObservation {
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

    fn config() -> SessionConfig {
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
    fn drive(
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
        assert_eq!(session.judge(&w, None, 0.0).unwrap(), Verdict::Sample(0));
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
        let frame = session.report_frame().unwrap();
        assert_eq!(frame.height(), session.samples().len());
        let fusion = frame.column(FUSION_THRESHOLD_BYTES).unwrap().f64().unwrap();
        assert!((0..fusion.len()).all(|i| fusion.get(i) == Some(0.0)));
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
    fn writes_csv_parquet_and_html_whose_rows_are_the_samples() {
        let mut session = TuningSession::new(SessionConfig {
            budget: 4,
            ..config()
        })
        .unwrap();
        let mut job = FakeJob::new(0);
        drive(&mut session, &mut job, |_, _| None);
        let dir = std::env::temp_dir().join(format!("tuner-session-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = write_report(&session, &dir, "job-1", "job 1").unwrap();
        let frame = report::read_parquet(std::fs::File::open(&files.parquet).unwrap()).unwrap();
        let column = frame.column(report::COL_SCORE).unwrap().f64().unwrap();
        let scores: Vec<f64> = (0..column.len()).filter_map(|i| column.get(i)).collect();
        let expected: Vec<f64> = session.samples().iter().map(|s| s.score).collect();
        assert_eq!(scores, expected);
        let csv = std::fs::read_to_string(&files.csv).unwrap();
        assert_eq!(csv.lines().count(), 1 + session.samples().len());
        assert!(
            std::fs::read_to_string(&files.html)
                .unwrap()
                .contains("job 1")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
