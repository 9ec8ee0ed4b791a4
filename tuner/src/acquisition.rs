//! Expected Improvement (for maximization) and its maximization over a search
//! space: every combination of the discrete knobs is enumerated, the
//! continuous coordinates are optimized with argmin's L-BFGS from the best of
//! many random candidates and of candidates around the incumbent.
//!
//! It must never fit a model or keep state between calls: it is handed a
//! fitted GP, an incumbent and a random generator, and returns one point.

use argmin::core::{CostFunction, Executor, Gradient, State};
use argmin::solver::linesearch::MoreThuenteLineSearch;
use argmin::solver::quasinewton::LBFGS;
use rand::Rng;
use rand_distr_free::normal;

use crate::gp::Gp;
use crate::space::Space;

/// Standard normal density.
pub fn normal_pdf(z: f64) -> f64 {
    (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt()
}

/// Standard normal cumulative distribution.
pub fn normal_cdf(z: f64) -> f64 {
    0.5 * libm::erfc(-z / std::f64::consts::SQRT_2)
}

/// Expected Improvement of a Gaussian belief `N(mean, sd²)` over `incumbent`
/// for a score that is maximized, with exploration margin `xi` (the
/// improvement counted is over `incumbent + xi`):
/// `EI = (μ − f* − ξ)·Φ(z) + σ·φ(z)`, `z = (μ − f* − ξ)/σ`.
/// With `sd = 0` it is the plain improvement `max(μ − f* − ξ, 0)`.
pub fn expected_improvement(mean: f64, sd: f64, incumbent: f64, xi: f64) -> f64 {
    let gain = mean - incumbent - xi;
    if sd <= 0.0 || !sd.is_finite() {
        return gain.max(0.0);
    }
    let z = gain / sd;
    (gain * normal_cdf(z) + sd * normal_pdf(z)).max(0.0)
}

/// How hard the maximizer searches.
#[derive(Debug, Clone, PartialEq)]
pub struct AcquisitionConfig {
    /// Exploration margin ξ, in standardized score units (multiples of the
    /// observed scores' standard deviation).
    pub xi: f64,
    /// Uniform random candidates per discrete combination.
    pub random_candidates: usize,
    /// Candidates drawn around the incumbent per discrete combination.
    pub local_candidates: usize,
    /// Standard deviation of those local draws, in unit-cube coordinates.
    pub local_spread: f64,
    /// How many of the best candidates are polished with L-BFGS (at least the
    /// best of each discrete combination is, in addition).
    pub polished: usize,
    /// L-BFGS iterations per polish.
    pub max_iters: u64,
    /// At most this many discrete combinations are searched per call; spaces
    /// with more get a random subset (always including the incumbent's).
    pub max_combinations: usize,
}

impl Default for AcquisitionConfig {
    fn default() -> Self {
        AcquisitionConfig {
            xi: 0.01,
            random_candidates: 256,
            local_candidates: 32,
            local_spread: 0.05,
            polished: 4,
            max_iters: 30,
            max_combinations: 64,
        }
    }
}

/// The maximizer's answer: an encoded point (decoded and re-encoded, so
/// integers are whole and categories one-hot) and its EI in standardized
/// units.
#[derive(Debug, Clone, PartialEq)]
pub struct Maximum {
    /// Encoded point.
    pub encoded: Vec<f64>,
    /// Expected Improvement there, standardized.
    pub expected_improvement: f64,
}

/// EI in standardized units at an encoded point.
fn ei_at(gp: &Gp, x: &[f64], incumbent: f64, xi: f64) -> f64 {
    let p = gp.posterior_with_gradient(x);
    expected_improvement(p.mean, p.variance.sqrt(), incumbent, xi)
}

/// Negative EI over the continuous coordinates of one discrete combination,
/// with a quadratic penalty outside `[0, 1]`.
struct NegativeEi<'a> {
    gp: &'a Gp,
    base: &'a [f64],
    free: &'a [usize],
    incumbent: f64,
    xi: f64,
}

impl NegativeEi<'_> {
    fn full_point(&self, u: &[f64]) -> Vec<f64> {
        let mut x = self.base.to_vec();
        for (&coord, v) in self.free.iter().zip(u) {
            x[coord] = v.clamp(0.0, 1.0);
        }
        x
    }

    fn evaluate(&self, u: &[f64]) -> (f64, Vec<f64>) {
        let x = self.full_point(u);
        let p = self.gp.posterior_with_gradient(&x);
        let sd = p.variance.sqrt();
        let gain = p.mean - self.incumbent - self.xi;
        let z = gain / sd;
        let ei = expected_improvement(p.mean, sd, self.incumbent, self.xi);
        let (dmu, dsd) = (normal_cdf(z), normal_pdf(z));
        let mut cost = -ei;
        let mut grad: Vec<f64> = self
            .free
            .iter()
            .map(|&c| -(dmu * p.mean_gradient[c] + dsd * p.variance_gradient[c] / (2.0 * sd)))
            .collect();
        for (g, v) in grad.iter_mut().zip(u) {
            let outside = v - v.clamp(0.0, 1.0);
            if outside != 0.0 {
                *g = 2.0 * outside;
                cost += outside * outside;
            }
        }
        if !cost.is_finite() || grad.iter().any(|g| !g.is_finite()) {
            return (0.0, vec![0.0; u.len()]);
        }
        (cost, grad)
    }
}

impl CostFunction for &NegativeEi<'_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, param: &Self::Param) -> Result<Self::Output, argmin::core::Error> {
        Ok(self.evaluate(param).0)
    }
}

impl Gradient for &NegativeEi<'_> {
    type Param = Vec<f64>;
    type Gradient = Vec<f64>;

    fn gradient(&self, param: &Self::Param) -> Result<Self::Gradient, argmin::core::Error> {
        Ok(self.evaluate(param).1)
    }
}

/// Tiny private normal sampler (Box–Muller) so no extra crate is needed.
mod rand_distr_free {
    use rand::Rng;

    /// One draw from `N(0, 1)`.
    pub fn normal<R: Rng>(rng: &mut R) -> f64 {
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }
}

/// Maximizes EI (standardized) over `space`. `incumbent` is the standardized
/// incumbent value (the best posterior mean among observed points) and
/// `incumbent_x` its encoded point.
pub fn maximize_expected_improvement<R: Rng>(
    gp: &Gp,
    space: &Space,
    incumbent: f64,
    incumbent_x: &[f64],
    config: &AcquisitionConfig,
    rng: &mut R,
) -> Maximum {
    let free = space.continuous_coordinates();
    let mut combos = space.discrete_combinations();
    if combos.len() > config.max_combinations.max(1) {
        // Keep the incumbent's combination, then a random subset of the rest.
        let own = combos
            .iter()
            .position(|c| c.iter().all(|&(i, v)| incumbent_x.get(i) == Some(&v)));
        let mut kept = Vec::with_capacity(config.max_combinations.max(1));
        if let Some(own) = own {
            kept.push(combos.swap_remove(own));
        }
        while kept.len() < config.max_combinations.max(1) && !combos.is_empty() {
            let pick = rng.random_range(0..combos.len());
            kept.push(combos.swap_remove(pick));
        }
        combos = kept;
    }

    // (ei, combination index, continuous coordinates)
    let mut candidates: Vec<(f64, usize, Vec<f64>)> = Vec::new();
    let mut bases = Vec::with_capacity(combos.len());
    for (ci, combo) in combos.iter().enumerate() {
        let mut base = vec![0.0; space.encoded_len()];
        for &(i, v) in combo {
            base[i] = v;
        }
        let mut starts: Vec<Vec<f64>> = Vec::new();
        starts.push(
            free.iter()
                .map(|&c| incumbent_x.get(c).copied().unwrap_or(0.5))
                .collect(),
        );
        if !free.is_empty() {
            for _ in 0..config.random_candidates {
                starts.push(free.iter().map(|_| rng.random::<f64>()).collect());
            }
            for _ in 0..config.local_candidates {
                starts.push(
                    free.iter()
                        .map(|&c| {
                            let at = incumbent_x.get(c).copied().unwrap_or(0.5);
                            (at + config.local_spread * normal(rng)).clamp(0.0, 1.0)
                        })
                        .collect(),
                );
            }
        }
        for u in starts {
            let mut x = base.clone();
            for (&c, v) in free.iter().zip(&u) {
                x[c] = *v;
            }
            candidates.push((ei_at(gp, &x, incumbent, config.xi), ci, u));
        }
        bases.push(base);
    }
    candidates.sort_by(|a, b| b.0.total_cmp(&a.0));

    // Polish the overall best few and the best of each combination.
    let mut to_polish: Vec<usize> = (0..candidates.len().min(config.polished)).collect();
    for ci in 0..combos.len() {
        if let Some(first) = candidates.iter().position(|c| c.1 == ci)
            && !to_polish.contains(&first)
        {
            to_polish.push(first);
        }
    }

    let mut best: Option<Maximum> = None;
    let mut consider = |x: Vec<f64>| {
        // Snap to the space (round integers, one-hot categories).
        let snapped = space.encode(&space.decode(&x));
        let ei = ei_at(gp, &snapped, incumbent, config.xi);
        if best.as_ref().is_none_or(|b| ei > b.expected_improvement) {
            best = Some(Maximum {
                encoded: snapped,
                expected_improvement: ei,
            });
        }
    };
    for idx in to_polish {
        let (_, ci, u0) = &candidates[idx];
        let problem = NegativeEi {
            gp,
            base: &bases[*ci],
            free: &free,
            incumbent,
            xi: config.xi,
        };
        let mut u_best = u0.clone();
        if !free.is_empty() {
            let start_cost = problem.evaluate(u0).0;
            let solver = LBFGS::new(MoreThuenteLineSearch::new(), 5);
            let run = Executor::new(&problem, solver)
                .configure(|s| s.param(u0.clone()).max_iters(config.max_iters))
                .run();
            if let Ok(result) = run {
                let state = result.state();
                if let Some(p) = state.get_best_param()
                    && state.get_best_cost() < start_cost
                {
                    u_best = p.clone();
                }
            }
        }
        consider(problem.full_point(&u_best));
    }
    best.unwrap_or_else(|| Maximum {
        encoded: incumbent_x.to_vec(),
        expected_improvement: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gp::Hyperparameters;
    use crate::space::{Dim, DimKind};
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn ei_matches_its_closed_form() {
        // μ = 1.2, σ = 0.5, f* = 1, ξ = 0.05 → z = 0.3.
        // Φ(0.3) = 0.617911422188953, φ(0.3) = 0.381387815460524.
        let ei = expected_improvement(1.2, 0.5, 1.0, 0.05);
        let expected = 0.15 * 0.617_911_422_188_953 + 0.5 * 0.381_387_815_460_524;
        assert!((ei - expected).abs() < 1e-12, "{ei} vs {expected}");
        // At μ = f*, ξ = 0: EI = σ/√(2π).
        let at = expected_improvement(3.0, 2.0, 3.0, 0.0);
        assert!((at - 2.0 / (2.0 * std::f64::consts::PI).sqrt()).abs() < 1e-12);
        // No uncertainty: plain improvement.
        assert_eq!(expected_improvement(2.0, 0.0, 1.5, 0.1), 0.4);
        assert_eq!(expected_improvement(1.0, 0.0, 1.5, 0.1), 0.0);
    }

    #[test]
    fn ei_agrees_with_monte_carlo() {
        let (mu, sd, best, xi) = (0.3, 0.8, 0.5, 0.02);
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let n = 200_000;
        let mc: f64 = (0..n)
            .map(|_| (mu + sd * normal(&mut rng) - best - xi).max(0.0))
            .sum::<f64>()
            / n as f64;
        let ei = expected_improvement(mu, sd, best, xi);
        assert!((mc - ei).abs() < 0.005, "mc {mc} vs closed form {ei}");
    }

    #[test]
    fn ei_gradient_matches_finite_differences() {
        let gp = Gp::with_hyperparameters(
            vec![vec![0.1, 0.0], vec![0.6, 1.0], vec![0.9, 0.0]],
            &[1.0, 2.0, 0.5],
            &[0.0; 3],
            Hyperparameters {
                length_scales: vec![0.3, 0.8],
                signal_variance: 1.0,
                noise_variance: 1e-4,
            },
        )
        .unwrap();
        let base = [0.0, 1.0];
        let problem = NegativeEi {
            gp: &gp,
            base: &base,
            free: &[0],
            incumbent: 0.8,
            xi: 0.01,
        };
        for u in [0.2, 0.45, 0.75] {
            let (_, g) = problem.evaluate(&[u]);
            let h = 1e-6;
            let fd = (problem.evaluate(&[u + h]).0 - problem.evaluate(&[u - h]).0) / (2.0 * h);
            assert!((fd - g[0]).abs() < 1e-6, "at {u}: fd {fd} vs {}", g[0]);
        }
    }

    #[test]
    fn maximizer_finds_the_interior_peak_and_the_right_category() {
        // A GP through a peak at x = 0.4 on the "true" side of a boolean knob;
        // the "false" side is flat and low.
        let space = Space::new(vec![
            Dim {
                name: "x".into(),
                kind: DimKind::Continuous {
                    low: 0.0,
                    high: 1.0,
                    log_scale: false,
                },
            },
            Dim {
                name: "flag".into(),
                kind: DimKind::Boolean,
            },
        ])
        .unwrap();
        let mut x = Vec::new();
        let mut y = Vec::new();
        for i in 0..6 {
            let u = i as f64 / 5.0;
            x.push(vec![u, 1.0]);
            y.push(-(u - 0.4) * (u - 0.4) * 10.0);
            x.push(vec![u, 0.0]);
            y.push(-3.0);
        }
        let gp = Gp::with_hyperparameters(
            x,
            &y,
            &[0.0; 12],
            Hyperparameters {
                length_scales: vec![0.3, 0.5],
                signal_variance: 1.0,
                noise_variance: 1e-6,
            },
        )
        .unwrap();
        let incumbent = gp.standardize(-0.0);
        let mut rng = ChaCha8Rng::seed_from_u64(9);
        let m = maximize_expected_improvement(
            &gp,
            &space,
            incumbent,
            &[0.4, 1.0],
            &AcquisitionConfig {
                xi: 0.0,
                ..AcquisitionConfig::default()
            },
            &mut rng,
        );
        assert_eq!(m.encoded[1], 1.0);
        assert!((m.encoded[0] - 0.4).abs() < 0.15, "{:?}", m.encoded);
        // No random candidate beats the polished maximum.
        for _ in 0..200 {
            let u: f64 = rng.random();
            for flag in [0.0, 1.0] {
                assert!(ei_at(&gp, &[u, flag], incumbent, 0.0) <= m.expected_improvement + 1e-12);
            }
        }
    }
}
