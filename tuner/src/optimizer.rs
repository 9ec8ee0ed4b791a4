//! The suggest/observe loop: an initial design (the starting knobs, then a
//! Latin hypercube), then Expected Improvement on a GP refitted after every
//! observation; the recommendation by posterior mean; the stopping rule.
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
use crate::space::{Point, Space, SpaceError};

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

/// Settings of a tuning session.
#[derive(Debug, Clone, PartialEq)]
pub struct OptimizerConfig {
    /// Seed of every random choice.
    pub seed: u64,
    /// Evaluations allowed in total; [`Optimizer::should_stop`] says stop
    /// once this many observations are in.
    pub budget: usize,
    /// Points of the initial design, including `start` when given. `None`
    /// picks `dims + 2` (at least 3).
    pub initial_points: Option<usize>,
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
        let n_design = config
            .initial_points
            .unwrap_or(space.dims().len() + 2)
            .max(1);
        let mut design = Vec::with_capacity(n_design);
        if let Some(start) = &config.start {
            design.push(start.clone());
        }
        let mut rng = rng_for(config.seed, STREAM_DESIGN, 0);
        let rest = n_design.saturating_sub(design.len());
        design.extend(latin_hypercube(&space, rest, &mut rng));
        Ok(Optimizer {
            space,
            config,
            design,
            observations: Vec::new(),
            gp: None,
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
    /// design lasts, then the maximizer of Expected Improvement over the
    /// best posterior mean among observed points (noisy-EI incumbent).
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
        let max = maximize_expected_improvement(
            gp,
            &self.space,
            incumbent,
            &incumbent_x,
            &self.config.acquisition,
            &mut rng,
        );
        // EI back in score units (it scales with the output std), relative
        // to the best predicted score's magnitude.
        let relative = max.expected_improvement * gp.output_scale()
            / best.predicted_score.abs().max(f64::MIN_POSITIVE);
        match self.relative_ei.last_mut() {
            Some(last) if last.0 == n => last.1 = relative,
            _ => self.relative_ei.push((n, relative)),
        }
        self.space.decode(&max.encoded)
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
        let gp = Gp::fit(
            x,
            &y,
            &sd,
            previous.as_ref(),
            self.config.hyperparameter_random_starts,
            &mut rng,
        )?;
        self.gp = Some(gp);
        self.observations.push(Observation {
            point,
            score,
            noise_sd,
        });
        Ok(())
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
