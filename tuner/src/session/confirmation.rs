//! The confirmation of the optimizer's choice against the start before it
//! is pinned: their windows, interleaved, and the rule that decides (the
//! medians, beyond their noise, or a decisive or overwhelming gain).
//!
//! It must never schedule windows or touch the optimizer: the state machine
//! ([`super`]) feeds it windows and asks it to decide.

use super::window::{Window, median};
use crate::space::CollectiveKnobs;

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
    pub(super) fn scores(&self, candidate: Candidate) -> Vec<f64> {
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
    pub(super) fn decisive(&self, choice_sample: f64, start_sample: f64) -> bool {
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
    pub(super) fn decide(&mut self) {
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
