//! What a session records and hands out: its samples, its recommendation,
//! why it started, and the data its report shows ([`ReportData`]).
//!
//! It must never build or write the report ([`crate::report`] does, from
//! [`ReportData`]), and never change a record once made.

use super::confirmation::Confirmation;
use super::window::Window;
use crate::space::CollectiveKnobs;

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

/// What a session's report shows ([`TuningSession::report_data`](super::TuningSession::report_data)): plain
/// data, so that building and writing the report ([`crate::report`]) stays
/// out of the session.
#[derive(Debug, Clone, Copy)]
pub struct ReportData<'a> {
    /// The recorded samples, in order.
    pub samples: &'a [SessionSample],
    /// The recommended sample ([`TuningSession::best`](super::TuningSession::best)), if any.
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
    /// What the scores measure (`None`: no window finished).
    pub objective: Option<super::Objective>,
}
