//! Exploration that costs the job little: every sample of a tuning session
//! runs the live job, so a sample the model believes is much worse than the
//! incumbent is paid for in the job's throughput. This module chooses the
//! next point the way people do for that (TuRBO's trust region, SafeOpt's
//! safe set):
//!
//! - **A trust region** around the incumbent (the observed point with the
//!   best posterior mean): a box in the unit cube whose side grows after
//!   successes and shrinks after failures, replayed from the history so the
//!   choice stays a pure function of the observations.
//! - **A safe set**: only candidates whose lower confidence bound
//!   (`mean − β·sd`) is within `safety_margin` of the incumbent's predicted
//!   score are eligible; among them, the one with the highest Expected
//!   Improvement is run. When none is (the model is unsure everywhere), the
//!   candidate with the best lower bound is run: the safest step, not a
//!   leap.
//! - **No re-sampling of a spot**: candidates within `min_distance` of an
//!   observed point are dropped, so a knob at its bound is not measured
//!   over and over.
//!
//! Every value of every categorical knob is inside the trust region: with
//! one boolean knob the choice between its values is always open.

use rand::Rng;

use crate::acquisition::expected_improvement;
use crate::gp::Gp;
use crate::space::Space;

/// Settings of the safe exploration.
#[derive(Debug, Clone, PartialEq)]
pub struct SafeConfig {
    /// Side of the trust region at the start, in unit-cube coordinates.
    pub initial_length: f64,
    /// The region never shrinks below this side...
    pub min_length: f64,
    /// ...nor grows beyond it.
    pub max_length: f64,
    /// Consecutive improvements of the best observed score that double the
    /// side.
    pub success_tolerance: usize,
    /// Consecutive samples without an improvement that halve it.
    pub failure_tolerance: usize,
    /// An improvement must beat the best observed score by this fraction.
    pub improvement_fraction: f64,
    /// A candidate is safe when `mean − beta·sd` ≥ (1 − `safety_margin`) ×
    /// the incumbent's predicted score.
    pub safety_margin: f64,
    /// Width of the lower confidence bound, in posterior standard deviations.
    pub beta: f64,
    /// Candidates drawn uniformly in the region, per discrete combination.
    pub candidates: usize,
    /// Candidates drawn around the incumbent, per discrete combination.
    pub local_candidates: usize,
    /// Candidates closer than this (Euclidean, unit cube) to an observed
    /// point are not run.
    pub min_distance: f64,
}

impl Default for SafeConfig {
    fn default() -> Self {
        SafeConfig {
            initial_length: 0.4,
            min_length: 0.05,
            max_length: 1.0,
            success_tolerance: 2,
            failure_tolerance: 3,
            improvement_fraction: 1e-3,
            safety_margin: 0.1,
            beta: 1.0,
            candidates: 384,
            local_candidates: 64,
            min_distance: 0.02,
        }
    }
}

/// The trust region's side after `scores` (in observation order), of which
/// the first `design` were the initial design: replayed, so the same history
/// always gives the same region.
pub fn trust_region_length(config: &SafeConfig, scores: &[f64], design: usize) -> f64 {
    let mut length = config.initial_length;
    let (mut successes, mut failures) = (0, 0);
    let mut best = f64::NEG_INFINITY;
    for (i, &y) in scores.iter().enumerate() {
        let improved = y > best + config.improvement_fraction * best.abs();
        if i >= design {
            if improved {
                successes += 1;
                failures = 0;
            } else {
                failures += 1;
                successes = 0;
            }
            if successes >= config.success_tolerance {
                length = (2.0 * length).min(config.max_length);
                successes = 0;
            }
            if failures >= config.failure_tolerance {
                length = (0.5 * length).max(config.min_length);
                failures = 0;
            }
        }
        best = best.max(y);
    }
    length
}

/// What [`suggest`] chose.
#[derive(Debug, Clone, PartialEq)]
pub struct SafeChoice {
    /// The encoded point to run.
    pub encoded: Vec<f64>,
    /// Its Expected Improvement, standardized.
    pub expected_improvement: f64,
    /// Whether it was in the safe set (false: the safest candidate).
    pub safe: bool,
}

fn euclidean(a: &[f64], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y) * (x - y))
        .sum::<f64>()
        .sqrt()
}

/// The next point inside the trust region of side `length` around
/// `incumbent_x` (encoded), whose predicted score is `incumbent_score`
/// (score units). `observed` are the encoded points measured so far.
#[allow(clippy::too_many_arguments)]
pub fn suggest<R: Rng>(
    gp: &Gp,
    space: &Space,
    incumbent_x: &[f64],
    incumbent_score: f64,
    observed: &[Vec<f64>],
    length: f64,
    xi: f64,
    config: &SafeConfig,
    rng: &mut R,
) -> SafeChoice {
    let free = space.continuous_coordinates();
    // Length scales stretch the box along the coordinates that matter less
    // (TuRBO), within a factor of two either way.
    let scales = &gp.hyperparameters().length_scales;
    let geo_mean = if free.is_empty() {
        1.0
    } else {
        (free.iter().map(|&c| scales[c].ln()).sum::<f64>() / free.len() as f64).exp()
    };
    let half: Vec<f64> = free
        .iter()
        .map(|&c| 0.5 * length * (scales[c] / geo_mean).clamp(0.5, 2.0))
        .collect();
    let incumbent_std = gp.standardize(incumbent_score);
    let floor = gp.standardize(incumbent_score - config.safety_margin * incumbent_score.abs());

    let mut best_safe: Option<(f64, Vec<f64>)> = None;
    let mut safest: Option<(f64, f64, Vec<f64>)> = None;
    let mut consider = |x: Vec<f64>| {
        let snapped = space.encode(&space.decode(&x));
        if observed
            .iter()
            .any(|o| euclidean(o, &snapped) < config.min_distance)
        {
            return;
        }
        let (mean, variance) = gp.predict_standardized(&snapped);
        let sd = variance.sqrt();
        let ei = expected_improvement(mean, sd, incumbent_std, xi);
        let lower = mean - config.beta * sd;
        if lower >= floor {
            if best_safe.as_ref().is_none_or(|b| ei > b.0) {
                best_safe = Some((ei, snapped));
            }
        } else if safest.as_ref().is_none_or(|s| lower > s.0) {
            safest = Some((lower, ei, snapped));
        }
    };
    for combo in space.discrete_combinations() {
        let mut base = incumbent_x.to_vec();
        for &(i, v) in &combo {
            base[i] = v;
        }
        let draw = |u: &mut dyn FnMut(usize, f64, f64) -> f64| {
            let mut x = base.clone();
            for (k, &c) in free.iter().enumerate() {
                let lo = (incumbent_x[c] - half[k]).max(0.0);
                let hi = (incumbent_x[c] + half[k]).min(1.0);
                x[c] = u(c, lo, hi);
            }
            x
        };
        consider(base.clone());
        for _ in 0..config.candidates {
            consider(draw(&mut |_, lo, hi| lo + (hi - lo) * rng.random::<f64>()));
        }
        for _ in 0..config.local_candidates {
            consider(draw(&mut |c, lo, hi| {
                (incumbent_x[c] + 0.25 * (hi - lo) * normal(rng)).clamp(lo, hi)
            }));
        }
    }
    match (best_safe, safest) {
        (Some((ei, encoded)), _) => SafeChoice {
            encoded,
            expected_improvement: ei,
            safe: true,
        },
        (None, Some((_, ei, encoded))) => SafeChoice {
            encoded,
            expected_improvement: ei,
            safe: false,
        },
        // Every candidate was too close to an observed point: the region is
        // exhausted; a uniform draw anywhere keeps the session moving.
        (None, None) => {
            let u: Vec<f64> = (0..space.encoded_len()).map(|_| rng.random()).collect();
            let encoded = space.encode(&space.decode(&u));
            let (mean, variance) = gp.predict_standardized(&encoded);
            SafeChoice {
                expected_improvement: expected_improvement(
                    mean,
                    variance.sqrt(),
                    incumbent_std,
                    xi,
                ),
                encoded,
                safe: false,
            }
        }
    }
}

/// One draw from `N(0, 1)` (Box–Muller).
fn normal<R: Rng>(rng: &mut R) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_region_doubles_after_successes_and_halves_after_failures() {
        let c = SafeConfig::default();
        // Design of 2, then two improvements: doubled.
        assert_eq!(trust_region_length(&c, &[1.0, 1.1, 1.2, 1.3], 2), 0.8);
        // Three samples without improvement: halved.
        assert_eq!(trust_region_length(&c, &[1.0, 1.1, 0.9, 1.0, 1.05], 2), 0.2);
        // Never below the floor, never above the ceiling.
        let flat = vec![1.0; 40];
        assert_eq!(trust_region_length(&c, &flat, 2), c.min_length);
        let rising: Vec<f64> = (0..40).map(f64::from).collect();
        assert_eq!(trust_region_length(&c, &rising, 2), c.max_length);
    }
}
