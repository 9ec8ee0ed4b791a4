//! The tuning API's JSON: the request (the body of `POST /api/jobs/{id}/tuning`)
//! resolved into a session's configuration, and the session's view (state,
//! samples, windows, the confirmation and the best knobs) that `GET` returns.
//!
//! It must never drive a session or talk to a job: plain data and its checks.

use std::time::{SystemTime, UNIX_EPOCH};

use collectives::control::Knobs;
use serde::{Deserialize, Serialize};
use tuner::session::{FixedKnobs, KnobBounds, SessionConfig};
use utoipa::ToSchema;

use super::knobs::to_tuner_knobs;

/// Narrower search ranges (`[lo, hi]`).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Bounds)]
pub struct BoundsRequest {
    /// Fusion threshold range in bytes.
    #[schema(value_type = Option<Vec<u64>>, min_items = 2, max_items = 2)]
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::pair"
    )]
    pub fusion_threshold_bytes: Option<[u64; 2]>,
    /// Cycle time range in ms.
    #[schema(value_type = Option<Vec<f64>>, min_items = 2, max_items = 2)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cycle_time_ms: Option<[f64; 2]>,
}

/// Knobs kept fixed (not searched).
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = Fixed)]
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
#[derive(Debug, Clone, Default, Serialize, Deserialize, PartialEq, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(as = TuningRequestBody)]
pub struct TuningRequest {
    /// Samples (optimizer observations), default 20.
    #[schema(value_type = Option<u64>, minimum = 1, maximum = 18446744073709551615_u64, default = 20)]
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::size"
    )]
    pub budget: Option<usize>,
    /// Cycles with work skipped after knobs are applied, default 3.
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 18446744073709551615_u64, default = 3)]
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub warmup_cycles: Option<u64>,
    /// Cycles with work per measured window (at least), default 10.
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 18446744073709551615_u64, default = 10)]
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub measured_cycles: Option<u64>,
    /// Shortest measured window in ms, default 1000.
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 18446744073709551615_u64, default = 1000)]
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "whole::one"
    )]
    pub min_window_ms: Option<u64>,
    /// Seed of the optimizer, default 0.
    #[schema(value_type = Option<u64>, minimum = 0, maximum = 18446744073709551615_u64, default = 0)]
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = SampleWindow)]
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = Sample)]
pub struct SampleView {
    /// Sample index (0 = the starting knobs).
    pub index: usize,
    /// The knobs measured (as sent to the job).
    pub knobs: Knobs,
    /// The window's score, in the session's `objective`: steps/s or bytes/s.
    pub score: f64,
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
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = Best)]
pub struct BestView {
    /// The knobs.
    pub knobs: Knobs,
    /// The GP's predicted score, in the session's `objective`.
    pub predicted_score: f64,
    /// The sample that measured them.
    pub sample: usize,
}

/// The two sides of a confirmation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Candidate {
    /// The optimizer's choice.
    Choice,
    /// The job's starting knobs.
    Start,
}

impl From<tuner::session::Candidate> for Candidate {
    fn from(c: tuner::session::Candidate) -> Self {
        match c {
            tuner::session::Candidate::Choice => Candidate::Choice,
            tuner::session::Candidate::Start => Candidate::Start,
        }
    }
}

/// One window of the confirmation before pinning.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = ConfirmationWindow)]
pub struct ConfirmationWindowView {
    /// Which knobs ran.
    pub candidate: Candidate,
    /// The window's score, in the session's `objective`.
    pub score: f64,
    /// Why it was disturbed, if it was (kept after one re-measurement).
    pub disturbed: Option<String>,
    /// Seconds since the session started.
    pub wall_time_s: f64,
}

/// The optimizer's choice against the start on fresh interleaved windows,
/// before anything is pinned.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = Confirmation)]
pub struct ConfirmationView {
    /// The optimizer's choice.
    pub choice: Knobs,
    /// Its sample.
    pub choice_sample: usize,
    /// The windows, in the order measured.
    pub windows: Vec<ConfirmationWindowView>,
    /// Median score of the choice's windows, once decided.
    pub choice_median: Option<f64>,
    /// Median score of the start's windows, once decided.
    pub start_median: Option<f64>,
    /// The gain over the start the choice had to show (0.03 = 3%).
    pub required_gain: Option<f64>,
    /// What is pinned, once decided.
    pub kept: Option<Candidate>,
}

/// The session JSON (what `GET /api/jobs/{id}/tuning` returns).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, ToSchema)]
#[schema(as = TuningSession)]
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
    /// What every score measures, decided by the first window (`null`
    /// before): training steps per second where the job marks its steps
    /// (`DistributedOptimizer`, the DDP hook, collbench, `mark_step()`),
    /// else bytes reduced per second.
    #[serde(default)]
    pub objective: Option<Objective>,
}

/// What a session's scores measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Training steps per second, over whole steps.
    StepsPerSecond,
    /// Bytes reduced per second (the job marks no steps).
    BytesPerSecond,
}

impl From<tuner::session::Objective> for Objective {
    fn from(o: tuner::session::Objective) -> Self {
        match o {
            tuner::session::Objective::StepsPerSecond => Objective::StepsPerSecond,
            tuner::session::Objective::BytesPerSecond => Objective::BytesPerSecond,
        }
    }
}

impl Objective {
    /// A score as a person reads it, with its unit.
    pub fn format(self, score: f64) -> String {
        match self {
            Objective::StepsPerSecond => format!("{score:.3} steps/s"),
            Objective::BytesPerSecond => format!("{:.1} MB/s", score / 1e6),
        }
    }
}

/// Milliseconds since the Unix epoch.
pub fn unix_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

pub(super) fn unix_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX))
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
