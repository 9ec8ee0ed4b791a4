//! A session's settings: its budget, its window, the knobs it starts from,
//! searches (within bounds) or keeps fixed, and how it confirms its choice.
//!
//! It must never hold state of a running session or check anything but the
//! settings themselves.

use super::SessionError;
use crate::optimizer::Exploration;
use crate::space::CollectiveKnobs;

/// Narrower ranges for the searched knobs (`None`: the full range of
/// [`crate::space::Space::collective`]).
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
    /// ...and spans at least this long, in microseconds of the job's clock...
    pub min_window_us: u64,
    /// ...and, where the job marks its steps, holds at least this many
    /// whole steps (see [`super::MAX_STEPS_WINDOW_US`]).
    pub min_window_steps: u64,
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
    /// See [`crate::optimizer::OptimizerConfig::robust`].
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
            min_window_steps: 4,
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

pub(super) fn check_range(
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
