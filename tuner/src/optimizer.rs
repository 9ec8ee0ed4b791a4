//! The suggest/observe loop: an initial design, then a GP refitted after
//! every observation and a model-based suggestion; the recommendation by
//! posterior mean; the stopping rule.
//!
//! Two ways to explore ([`Exploration`]):
//! - [`Exploration::Safe`] (the default): the starting knobs, then the start
//!   with each categorical knob at each of its other values, then Expected
//!   Improvement inside a trust region around the incumbent, restricted to
//!   points the model believes are not much worse ([`crate::safe`]). It
//!   costs the job little while it is tuned. It needs a start (the knobs
//!   a job runs with); without one it searches like `Global`.
//! - [`Exploration::Global`]: the starting knobs, a Latin hypercube over the
//!   whole space, then Expected Improvement anywhere (round one's
//!   algorithm, kept as the benchmark's baseline).
//!
//! With `robust` on, a measurement far *below* what its neighbours predict
//! (leave-one-out) is treated as disturbed: its noise is widened to its
//! residual and the model refitted, so one slowed-down window does not drag
//! a good point down. Disturbances only ever slow a job, so only low
//! outliers are discounted.
//!
//! The score is **maximized** (throughput: bytes reduced per second). To
//! minimize a cost, observe its negation.
//!
//! It must never read a clock, do I/O or start threads, and it is a pure
//! function of (space, config, seed, observations): every random draw comes
//! from a ChaCha generator seeded from the seed and the number of
//! observations, so the same history always yields the same suggestion, and
//! calling [`Optimizer::suggest`] twice in a row returns the same point.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use thiserror::Error;

use crate::acquisition::{AcquisitionConfig, expected_improvement, maximize_expected_improvement};
use crate::gp::{Gp, GpError, Hyperparameters, Prediction};
use crate::safe::{self, SafeConfig};
use crate::space::{DimKind, Point, Space, SpaceError, Value};

/// Why an observation or a configuration was refused. A refused observation
/// leaves the optimizer exactly as it was.
#[derive(Debug, Error, PartialEq)]
pub enum OptimizerError {
    /// The point is not in the space (wrong length, kind, or out of bounds).
    #[error("observed point is not in the search space: {0}")]
    PointOutsideSpace(#[from] SpaceError),
    /// The score is NaN or infinite.
    #[error("observed score {score} is not finite; re-measure the window or drop it")]
    ScoreNotFinite {
        /// The score given.
        score: f64,
    },
    /// The noise hint is negative, NaN or infinite.
    #[error("noise hint {hint} must be a finite standard deviation ≥ 0 (score units)")]
    BadNoiseHint {
        /// The hint given.
        hint: f64,
    },
    /// The model could not be refitted with the new observation.
    #[error("Gaussian process could not absorb the observation: {0}")]
    Model(#[from] GpError),
    /// The configuration cannot work (e.g. a zero budget).
    #[error("invalid optimizer configuration: {0}")]
    Config(String),
}

/// How the optimizer explores (see the module documentation).
#[derive(Debug, Clone, PartialEq)]
pub enum Exploration {
    /// Trust region and safe set around the incumbent.
    Safe(SafeConfig),
    /// Latin hypercube design, then EI over the whole space.
    Global,
}

impl Default for Exploration {
    fn default() -> Self {
        Exploration::Safe(SafeConfig::default())
    }
}

/// Settings of a tuning session.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Evaluations allowed in total; [`Optimizer::should_stop`] says stop
    /// once this many observations are in.
    pub budget: usize,
    /// Points of the initial design, including `start` when given. `None`
    /// picks `dims + 2` (at least 3) for [`Exploration::Global`], and the
    /// start with its categorical variants for [`Exploration::Safe`] (the
    /// Global design when there is no start).
    pub initial_points: Option<usize>,
    /// How to explore.
    pub exploration: Exploration,
    /// Points measured right after the start, before the rest of the
    /// design (e.g. the knobs an earlier session pinned).
    pub early_points: Vec<Point>,
    /// Discount measurements far below what their neighbours predict
    /// (one-sided: disturbances only slow a job down).
    pub robust: bool,
    /// The knobs the job runs with now: evaluated first, so the report can
    /// show the speedup over them.
    pub start: Option<Point>,
    /// Stop early once the maximum EI, relative to the magnitude of the best
    /// predicted score, stays below this...
    pub min_relative_improvement: f64,
    /// ...for this many consecutive suggestions (0 disables early stopping).
    pub stop_after_rounds: usize,
    /// Random restarts of the hyperparameter fit (besides the default start
    /// and the previous optimum).
    pub hyperparameter_random_starts: usize,
    /// How the acquisition maximizer searches.
    pub acquisition: AcquisitionConfig,
}

impl Default for OptimizerConfig {
    fn default() -> Self {
        OptimizerConfig {
            seed: 0,
            budget: 30,
            initial_points: None,
            exploration: Exploration::default(),
            early_points: Vec::new(),
            robust: true,
            start: None,
            min_relative_improvement: 1e-3,
            stop_after_rounds: 3,
            hyperparameter_random_starts: 1,
            acquisition: AcquisitionConfig::default(),
        }
    }
}

/// One accepted observation.
#[derive(Debug, Clone, PartialEq)]
pub struct Observation {
    /// Where it was measured.
    pub point: Point,
    /// The measured score (higher is better).
    pub score: f64,
    /// Extra noise standard deviation of this measurement, in score units
    /// (0 when none was hinted).
    pub noise_sd: f64,
}

/// The recommendation: the observed point with the highest posterior mean.
#[derive(Debug, Clone, PartialEq)]
pub struct Best {
    /// Index of the observation (in [`Optimizer::observations`]).
    pub index: usize,
    /// The knobs.
    pub point: Point,
    /// The GP's posterior mean there: the estimate to trust.
    pub predicted_score: f64,
    /// What was measured there (one noisy sample).
    pub observed_score: f64,
}

/// Low outliers are at least this far below their leave-one-out prediction,
/// relative to it: smaller dips are the job's usual noise.
const MIN_OUTLIER_DROP: f64 = 0.05;
/// ...and at least this many robust standard deviations (1.4826 × the median
/// absolute standardized leave-one-out residual) below it.
const OUTLIER_SIGMAS: f64 = 3.0;
/// Nor more than this far below (relative): a window at less than half of
/// what its neighbours say is believed — a collapse (a fusion buffer that
/// no longer fits in memory) is a property of the knobs, not a disturbance.
const MAX_OUTLIER_DROP: f64 = 0.5;
/// Outliers are looked for only with this many observations or more.
const MIN_OBSERVATIONS_FOR_OUTLIERS: usize = 5;

/// Why [`Optimizer::stop_reason`] says to stop.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum StopReason {
    /// The evaluation budget is spent.
    Budget,
    /// Maximum EI stayed below the threshold for the configured rounds.
    Converged,
}

/// A tuning session's optimizer.
#[derive(Debug, Clone)]
pub struct Optimizer {
    space: Space,
    config: OptimizerConfig,
    design: Vec<Point>,
    observations: Vec<Observation>,
    gp: Option<Gp>,
    /// Observations the robust fit discounted as low outliers.
    outliers: Vec<usize>,
    /// `(observations at the time, max EI relative to |best mean|)` of each
    /// model-based suggestion.
    relative_ei: Vec<(usize, f64)>,
}

// Streams of the seeded generator, so design, fits and suggestions never
// share draws.
const STREAM_DESIGN: u64 = 0;
const STREAM_FIT: u64 = 1;
const STREAM_SUGGEST: u64 = 2;

fn rng_for(seed: u64, stream: u64, step: usize) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream + 4 * step as u64);
    rng
}

/// Latin hypercube in the unit cube: each continuous coordinate has one
/// point per stratum; discrete knobs cycle through their values in a random
/// order so every value appears as evenly as possible.
fn latin_hypercube(space: &Space, n: usize, rng: &mut ChaCha8Rng) -> Vec<Point> {
    let free = space.continuous_coordinates();
    let mut columns: Vec<Vec<f64>> = Vec::with_capacity(free.len());
    for _ in &free {
        let mut strata: Vec<usize> = (0..n).collect();
        for i in (1..n).rev() {
            let j = rng.random_range(0..=i);
            strata.swap(i, j);
        }
        columns.push(
            strata
                .into_iter()
                .map(|s| (s as f64 + rng.random::<f64>()) / n as f64)
                .collect(),
        );
    }
    let mut combos = space.discrete_combinations();
    for i in (1..combos.len()).rev() {
        let j = rng.random_range(0..=i);
        combos.swap(i, j);
    }
    (0..n)
        .map(|row| {
            let mut x = vec![0.0; space.encoded_len()];
            for (&coord, column) in free.iter().zip(&columns) {
                x[coord] = column[row];
            }
            for &(coord, v) in &combos[row % combos.len()] {
                x[coord] = v;
            }
            space.decode(&x)
        })
        .collect()
}

impl Optimizer {
    /// A new session over `space`. Refuses a zero budget and a `start` point
    /// outside the space.
    pub fn new(space: Space, config: OptimizerConfig) -> Result<Self, OptimizerError> {
        if config.budget == 0 {
            return Err(OptimizerError::Config("budget must be at least 1".into()));
        }
        if !(config.min_relative_improvement.is_finite() && config.min_relative_improvement >= 0.0)
        {
            return Err(OptimizerError::Config(
                "min_relative_improvement must be finite and ≥ 0".into(),
            ));
        }
        if let Some(start) = &config.start {
            space.validate(start)?;
        }
        for p in &config.early_points {
            space.validate(p)?;
        }
        let mut design = Vec::new();
        if let Some(start) = &config.start {
            design.push(start.clone());
        }
        design.extend(config.early_points.iter().cloned());
        let n_design = match (&config.exploration, &config.start) {
            (Exploration::Safe(_), Some(start)) => {
                design.extend(
                    categorical_variants(&space, start)
                        .into_iter()
                        .filter(|p| !config.early_points.contains(p)),
                );
                config.initial_points.unwrap_or(design.len())
            }
            _ => config
                .initial_points
                .unwrap_or(space.dims().len() + 2)
                .max(design.len()),
        }
        .max(1);
        design.truncate(n_design);
        let mut rng = rng_for(config.seed, STREAM_DESIGN, 0);
        let rest = n_design.saturating_sub(design.len());
        design.extend(latin_hypercube(&space, rest, &mut rng));
        Ok(Optimizer {
            space,
            config,
            design,
            observations: Vec::new(),
            gp: None,
            outliers: Vec::new(),
            relative_ei: Vec::new(),
        })
    }

    /// The search space.
    pub fn space(&self) -> &Space {
        &self.space
    }

    /// The configuration.
    pub fn config(&self) -> &OptimizerConfig {
        &self.config
    }

    /// Accepted observations, in order.
    pub fn observations(&self) -> &[Observation] {
        &self.observations
    }

    /// The next point to evaluate: the next design point while the initial
    /// design lasts, then the model's choice (see [`Exploration`]) with
    /// Expected Improvement over the best posterior mean among observed
    /// points (noisy-EI incumbent).
    pub fn suggest(&mut self) -> Point {
        let n = self.observations.len();
        if n < self.design.len() {
            return self.design[n].clone();
        }
        let Some(gp) = &self.gp else {
            // Unreachable in practice (the design has ≥ 1 point), but keep
            // the function total.
            return self.design[0].clone();
        };
        let Some(best) = self.best() else {
            return self.design[0].clone();
        };
        let incumbent_x = self.space.encode(&best.point);
        let incumbent = gp.standardize(best.predicted_score);
        let mut rng = rng_for(self.config.seed, STREAM_SUGGEST, n);
        // Without a start there is no running job to protect (and no
        // scale to be safe against): the global search.
        let exploration = match (&self.config.exploration, &self.config.start) {
            (Exploration::Safe(safe), Some(_)) => Some(safe),
            _ => None,
        };
        let (encoded, max_ei) = match exploration {
            None => {
                let max = maximize_expected_improvement(
                    gp,
                    &self.space,
                    incumbent,
                    &incumbent_x,
                    &self.config.acquisition,
                    &mut rng,
                );
                (max.encoded, max.expected_improvement)
            }
            Some(safe) => {
                let scores: Vec<f64> = self.observations.iter().map(|o| o.score).collect();
                let length = safe::trust_region_length(safe, &scores, self.design.len());
                let observed: Vec<Vec<f64>> = self
                    .observations
                    .iter()
                    .map(|o| self.space.encode(&o.point))
                    .collect();
                let choice = safe::suggest(
                    gp,
                    &self.space,
                    &incumbent_x,
                    best.predicted_score,
                    &observed,
                    length,
                    self.config.acquisition.xi,
                    safe,
                    &mut rng,
                );
                (choice.encoded, choice.expected_improvement)
            }
        };
        // EI back in score units (it scales with the output std), relative
        // to the best predicted score's magnitude.
        let relative =
            max_ei * gp.output_scale() / best.predicted_score.abs().max(f64::MIN_POSITIVE);
        match self.relative_ei.last_mut() {
            Some(last) if last.0 == n => last.1 = relative,
            _ => self.relative_ei.push((n, relative)),
        }
        self.space.decode(&encoded)
    }

    /// Records a measurement of `score` at `point` (higher is better).
    /// `noise_hint` is an extra noise standard deviation in score units for
    /// this one measurement (e.g. a window that eBPF flagged as disturbed);
    /// `None` means the model's learned noise alone. NaN or infinite scores,
    /// bad hints and points outside the space are refused with an error and
    /// change nothing; so does a model refit that fails.
    pub fn observe(
        &mut self,
        point: Point,
        score: f64,
        noise_hint: Option<f64>,
    ) -> Result<(), OptimizerError> {
        self.space.validate(&point)?;
        if !score.is_finite() {
            return Err(OptimizerError::ScoreNotFinite { score });
        }
        let noise_sd = noise_hint.unwrap_or(0.0);
        if !(noise_sd.is_finite() && noise_sd >= 0.0) {
            return Err(OptimizerError::BadNoiseHint { hint: noise_sd });
        }
        let mut x: Vec<Vec<f64>> = self
            .observations
            .iter()
            .map(|o| self.space.encode(&o.point))
            .collect();
        x.push(self.space.encode(&point));
        let mut y: Vec<f64> = self.observations.iter().map(|o| o.score).collect();
        y.push(score);
        let mut sd: Vec<f64> = self.observations.iter().map(|o| o.noise_sd).collect();
        sd.push(noise_sd);
        let mut rng = rng_for(self.config.seed, STREAM_FIT, self.observations.len());
        let previous: Option<Hyperparameters> =
            self.gp.as_ref().map(|g| g.hyperparameters().clone());
        let mut gp = Gp::fit(
            x.clone(),
            &y,
            &sd,
            previous.as_ref(),
            self.config.hyperparameter_random_starts,
            &mut rng,
        )?;
        let mut outliers = Vec::new();
        if self.config.robust && y.len() >= MIN_OBSERVATIONS_FOR_OUTLIERS {
            outliers = low_outliers(&gp, &y);
            if !outliers.is_empty() {
                let mut widened = sd.clone();
                let loo = gp.leave_one_out();
                for &i in &outliers {
                    widened[i] = widened[i].max(loo[i].mean - y[i]);
                }
                let hyper = gp.hyperparameters().clone();
                gp = Gp::fit(
                    x,
                    &y,
                    &widened,
                    Some(&hyper),
                    self.config.hyperparameter_random_starts,
                    &mut rng,
                )?;
            }
        }
        self.gp = Some(gp);
        self.outliers = outliers;
        self.observations.push(Observation {
            point,
            score,
            noise_sd,
        });
        Ok(())
    }

    /// Observations (indices) the robust fit discounted as measured far below
    /// what their neighbours predict; empty when `robust` is off.
    pub fn low_outliers(&self) -> &[usize] {
        &self.outliers
    }

    /// Points of the initial design (the first observations are these).
    pub fn design_len(&self) -> usize {
        self.design.len()
    }

    /// The GP hyperparameters fitted after the last observation (for logs
    /// and diagnostics); `None` before the first observation.
    pub fn hyperparameters(&self) -> Option<&Hyperparameters> {
        self.gp.as_ref().map(Gp::hyperparameters)
    }

    /// The recommendation: among observed points, the one with the highest
    /// posterior mean (so one lucky noisy sample does not win). `None`
    /// before the first observation.
    pub fn best(&self) -> Option<Best> {
        let gp = self.gp.as_ref()?;
        let mut best: Option<Best> = None;
        for (index, o) in self.observations.iter().enumerate() {
            let predicted = gp.predict(&self.space.encode(&o.point)).mean;
            if best.as_ref().is_none_or(|b| predicted > b.predicted_score) {
                best = Some(Best {
                    index,
                    point: o.point.clone(),
                    predicted_score: predicted,
                    observed_score: o.score,
                });
            }
        }
        best
    }

    /// The GP's posterior at `point` (`None` before the first observation or
    /// for a point outside the space).
    pub fn predict(&self, point: &Point) -> Option<Prediction> {
        self.space.validate(point).ok()?;
        Some(self.gp.as_ref()?.predict(&self.space.encode(point)))
    }

    /// Expected Improvement (score units) at `point` over the current
    /// incumbent, with the configured ξ.
    pub fn expected_improvement(&self, point: &Point) -> Option<f64> {
        let gp = self.gp.as_ref()?;
        let best = self.best()?;
        let p = self.predict(point)?;
        let scale = gp.output_scale();
        Some(
            scale
                * expected_improvement(
                    p.mean / scale,
                    p.variance.sqrt() / scale,
                    best.predicted_score / scale,
                    self.config.acquisition.xi,
                ),
        )
    }

    /// Whether to stop, and why: the budget is spent, or the last
    /// `stop_after_rounds` suggestions all had a maximum EI below
    /// `min_relative_improvement` of the best predicted score.
    pub fn stop_reason(&self) -> Option<StopReason> {
        let n = self.observations.len();
        if n >= self.config.budget {
            return Some(StopReason::Budget);
        }
        let k = self.config.stop_after_rounds;
        if k == 0 || self.relative_ei.len() < k {
            return None;
        }
        let recent = &self.relative_ei[self.relative_ei.len() - k..];
        // Rounds must be consecutive and the last one current or just observed.
        let consecutive = recent.windows(2).all(|w| w[1].0 == w[0].0 + 1);
        let fresh = recent[k - 1].0 + 1 >= n;
        if consecutive
            && fresh
            && recent
                .iter()
                .all(|r| r.1 < self.config.min_relative_improvement)
        {
            Some(StopReason::Converged)
        } else {
            None
        }
    }

    /// `stop_reason().is_some()`.
    pub fn should_stop(&self) -> bool {
        self.stop_reason().is_some()
    }
}

/// The start with one categorical knob changed to each of its other values:
/// both values of every boolean, every choice of every categorical, tried
/// right after the start.
fn categorical_variants(space: &Space, start: &Point) -> Vec<Point> {
    let mut out = Vec::new();
    for (i, dim) in space.dims().iter().enumerate() {
        let others: Vec<Value> = match (&dim.kind, start.0.get(i)) {
            (DimKind::Boolean, Some(Value::Bool(b))) => vec![Value::Bool(!b)],
            (DimKind::Categorical { choices }, Some(Value::Choice(c))) => (0..choices.len())
                .filter(|k| k != c)
                .map(Value::Choice)
                .collect(),
            _ => Vec::new(),
        };
        for v in others {
            let mut p = start.clone();
            p.0[i] = v;
            out.push(p);
        }
    }
    out
}

/// Observations far below their leave-one-out prediction (see
/// [`MIN_OUTLIER_DROP`] and [`OUTLIER_SIGMAS`]).
fn low_outliers(gp: &Gp, y: &[f64]) -> Vec<usize> {
    let loo = gp.leave_one_out();
    if loo.len() != y.len() {
        return Vec::new();
    }
    let z: Vec<f64> = loo
        .iter()
        .zip(y)
        .map(|(p, y)| (y - p.mean) / p.variance.sqrt().max(f64::MIN_POSITIVE))
        .collect();
    let mut abs: Vec<f64> = z.iter().map(|v| v.abs()).collect();
    abs.sort_by(f64::total_cmp);
    let scale = 1.4826 * abs[abs.len() / 2];
    (0..y.len())
        .filter(|&i| {
            z[i] < -OUTLIER_SIGMAS * scale
                && loo[i].mean - y[i] > MIN_OUTLIER_DROP * loo[i].mean.abs()
                && loo[i].mean - y[i] <= MAX_OUTLIER_DROP * loo[i].mean.abs()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::space::CollectiveKnobs;

    fn safe_optimizer(seed: u64) -> Optimizer {
        Optimizer::new(
            Space::collective(),
            OptimizerConfig {
                seed,
                budget: 20,
                start: Some(CollectiveKnobs::default().to_point()),
                stop_after_rounds: 0,
                ..OptimizerConfig::default()
            },
        )
        .unwrap()
    }

    /// A smooth landscape over the encoded collective space, best at
    /// (0.5, 0.4, hierarchical).
    fn truth(space: &Space, p: &Point) -> f64 {
        let x = space.encode(p);
        let h = if x[2] > 0.5 { 1.2 } else { 1.0 };
        h * (1.0 - (x[0] - 0.5).powi(2) - (x[1] - 0.4).powi(2))
    }

    #[test]
    fn safe_design_is_the_start_then_its_other_categorical_value() {
        let mut o = safe_optimizer(0);
        let start = CollectiveKnobs::default().to_point();
        assert_eq!(o.design_len(), 2);
        let first = o.suggest();
        assert_eq!(first, start);
        o.observe(first, 1.0, None).unwrap();
        let second = o.suggest();
        let mut flipped = start.clone();
        flipped.0[2] = Value::Bool(true);
        assert_eq!(second, flipped);
    }

    #[test]
    fn safe_suggestions_stay_in_the_trust_region_around_the_incumbent() {
        let space = Space::collective();
        for seed in 0..5 {
            let mut o = safe_optimizer(seed);
            for _ in 0..6 {
                let p = o.suggest();
                let y = truth(&space, &p);
                o.observe(p, y, None).unwrap();
            }
            let best = space.encode(&o.best().unwrap().point);
            let scores: Vec<f64> = o.observations().iter().map(|o| o.score).collect();
            let length = match &o.config().exploration {
                Exploration::Safe(c) => safe::trust_region_length(c, &scores, o.design_len()),
                Exploration::Global => unreachable!(),
            };
            let next = space.encode(&o.suggest());
            for c in [0, 1] {
                // Half a side, stretched by at most 2 by the length scales.
                assert!(
                    (next[c] - best[c]).abs() <= length + 1e-9,
                    "seed {seed}: coordinate {c} at {} vs incumbent {} (side {length})",
                    next[c],
                    best[c]
                );
            }
        }
    }

    #[test]
    fn a_window_slowed_by_a_third_is_discounted_but_a_collapse_is_believed() {
        let space = Space::collective();
        let grid: Vec<Point> = (0..8)
            .map(|i| space.decode(&[0.2 + 0.08 * i as f64, 0.3 + 0.03 * i as f64, 0.0]))
            .collect();
        let run = |factor: f64| {
            let mut o = Optimizer::new(
                space.clone(),
                OptimizerConfig {
                    budget: 20,
                    ..OptimizerConfig::default()
                },
            )
            .unwrap();
            for (i, p) in grid.iter().enumerate() {
                let y = truth(&space, p) * if i == 4 { factor } else { 1.0 };
                o.observe(p.clone(), y, None).unwrap();
            }
            o
        };
        let slowed = run(0.7);
        assert_eq!(slowed.low_outliers(), &[4]);
        let p = slowed.predict(&grid[4]).unwrap().mean;
        assert!(
            p > 0.9 * truth(&space, &grid[4]),
            "prediction {p} stays near the truth"
        );
        assert!(run(0.2).low_outliers().is_empty(), "a collapse is data");
        assert!(run(1.0).low_outliers().is_empty());
        // Higher than its neighbours is never an outlier: nothing speeds a job up.
        assert!(run(1.3).low_outliers().is_empty());
    }
}
