//! Gaussian-process regression over the unit-cube encoding of a search space:
//! a Matérn 5/2 kernel with one length scale per coordinate (ARD), a learned
//! homoscedastic noise term plus optional per-observation noise (added to the
//! diagonal), standardized outputs, and hyperparameters fitted by maximizing
//! the log marginal likelihood (plus weak log-normal priors on the
//! log-parameters, i.e. MAP) with argmin's L-BFGS on log-parameters from
//! several starts.
//!
//! It must never see knob names or runtime concepts: inputs are plain
//! encoded vectors, outputs plain scores. Linear algebra is nalgebra's
//! Cholesky; nothing here decomposes a matrix by hand.

use std::cell::RefCell;

use argmin::core::{CostFunction, Executor, Gradient, State};
use argmin::solver::linesearch::MoreThuenteLineSearch;
use argmin::solver::quasinewton::LBFGS;
use nalgebra::{Cholesky, DMatrix, DVector, Dyn};
use rand::Rng;
use thiserror::Error;

/// Why a GP could not be built.
#[derive(Debug, Error, PartialEq)]
pub enum GpError {
    /// No observations were given.
    #[error("a Gaussian process needs at least one observation")]
    NoData,
    /// Inputs, outputs and noise hints have different lengths, or inputs
    /// differ in dimension from the hyperparameters.
    #[error("shape mismatch: {0}")]
    Shape(String),
    /// An input, output or noise hint is NaN or infinite (or a noise hint is
    /// negative).
    #[error("observation {index} holds a non-finite or negative value")]
    NotFinite {
        /// Index of the offending observation.
        index: usize,
    },
    /// The kernel matrix stayed indefinite even with the largest jitter.
    #[error("kernel matrix is not positive definite even with jitter {jitter:e}")]
    NotPositiveDefinite {
        /// The largest jitter tried (relative to the mean diagonal).
        jitter: f64,
    },
}

/// Kernel and noise hyperparameters, in standardized output units.
#[derive(Debug, Clone, PartialEq)]
pub struct Hyperparameters {
    /// One length scale per encoded input coordinate.
    pub length_scales: Vec<f64>,
    /// Kernel (signal) variance σ_f².
    pub signal_variance: f64,
    /// Homoscedastic noise variance σ_n².
    pub noise_variance: f64,
}

// Box on the log-parameters during fitting. Inputs live in [0, 1], so a length
// scale far above 1 already means "this coordinate does not matter", and one
// far below the spacing of a few dozen points can only overfit.
const LOG_LENGTH_MIN: f64 = -3.5; // ≈ 0.03
const LOG_LENGTH_MAX: f64 = 2.5; // ≈ 12
const LOG_SIGNAL_MIN: f64 = -3.0; // ≈ 0.05
const LOG_SIGNAL_MAX: f64 = 3.0; // ≈ 20
const LOG_NOISE_MIN: f64 = -13.8; // ≈ 1e-6
const LOG_NOISE_MAX: f64 = 0.7; // ≈ 2
// Weak log-normal priors (MAP instead of plain maximum likelihood): with a
// handful of points the likelihood alone is nearly flat in the length scales
// and jumps between "everything matters at 0.03" and "nothing matters at 12",
// which makes EI erratic. Means and standard deviations of the log-parameters.
const PRIOR_LOG_LENGTH: (f64, f64) = (-0.9, 1.0); // median ℓ ≈ 0.4
const PRIOR_LOG_SIGNAL: (f64, f64) = (0.0, 1.0);
const PRIOR_LOG_NOISE: (f64, f64) = (-6.9, 3.0); // median σ_n² ≈ 1e-3, broad
// Relative jitters tried, in order, when a Cholesky fails.
const JITTERS: [f64; 6] = [0.0, 1e-10, 1e-8, 1e-6, 1e-4, 1e-2];
const SQRT5: f64 = 2.236_067_977_499_79;

impl Hyperparameters {
    /// A neutral start: every length scale 0.3, unit signal, noise 1e-2.
    pub fn default_for(dims: usize) -> Self {
        Hyperparameters {
            length_scales: vec![0.3; dims],
            signal_variance: 1.0,
            noise_variance: 1e-2,
        }
    }

    fn to_log(&self) -> Vec<f64> {
        let mut v: Vec<f64> = self.length_scales.iter().map(|l| l.ln()).collect();
        v.push(self.signal_variance.ln());
        v.push(self.noise_variance.ln());
        v
    }

    fn from_log(theta: &[f64]) -> Self {
        let d = theta.len() - 2;
        Hyperparameters {
            length_scales: theta[..d].iter().map(|t| t.exp()).collect(),
            signal_variance: theta[d].exp(),
            noise_variance: theta[d + 1].exp(),
        }
    }
}

/// Clamps log-parameters into the fitting box.
fn clamp_log(theta: &[f64]) -> Vec<f64> {
    let d = theta.len() - 2;
    theta
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let (lo, hi) = if i < d {
                (LOG_LENGTH_MIN, LOG_LENGTH_MAX)
            } else if i == d {
                (LOG_SIGNAL_MIN, LOG_SIGNAL_MAX)
            } else {
                (LOG_NOISE_MIN, LOG_NOISE_MAX)
            };
            if t.is_finite() { t.clamp(lo, hi) } else { lo }
        })
        .collect()
}

/// The Matérn 5/2 correlation's pieces for scaled distance `r`:
/// `(1 + s + s²/3)·e^{-s}` and `(5/3)(1 + s)·e^{-s}`, with `s = √5·r`.
/// The second is `-(1/r)·d/dr` of the first, finite at `r = 0`.
fn matern52(r: f64) -> (f64, f64) {
    let s = SQRT5 * r;
    let e = (-s).exp();
    ((1.0 + s + s * s / 3.0) * e, (5.0 / 3.0) * (1.0 + s) * e)
}

fn scaled_distance(a: &[f64], b: &[f64], length_scales: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .zip(length_scales)
        .map(|((x, y), l)| {
            let d = (x - y) / l;
            d * d
        })
        .sum::<f64>()
        .sqrt()
}

/// Cholesky of `k`, adding growing jitter to the diagonal on failure.
fn cholesky_with_jitter(k: &DMatrix<f64>) -> Result<Cholesky<f64, Dyn>, GpError> {
    let n = k.nrows();
    let mean_diag = (0..n).map(|i| k[(i, i)]).sum::<f64>() / n.max(1) as f64;
    let scale = if mean_diag.is_finite() && mean_diag > 0.0 {
        mean_diag
    } else {
        1.0
    };
    for jitter in JITTERS {
        let mut m = k.clone();
        for i in 0..n {
            m[(i, i)] += jitter * scale;
        }
        if let Some(c) = Cholesky::new(m) {
            return Ok(c);
        }
    }
    Err(GpError::NotPositiveDefinite {
        jitter: JITTERS[JITTERS.len() - 1],
    })
}

/// A fitted Gaussian process: the data, the hyperparameters, the Cholesky
/// factor of the kernel matrix and the weights `α = K⁻¹ y` (standardized).
#[derive(Debug, Clone)]
pub struct Gp {
    x: Vec<Vec<f64>>,
    y_standardized: DVector<f64>,
    y_mean: f64,
    y_std: f64,
    hyper: Hyperparameters,
    l: DMatrix<f64>,
    alpha: DVector<f64>,
}

/// The GP's belief about the latent (noise-free) score at one point.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Prediction {
    /// Posterior mean, in score units.
    pub mean: f64,
    /// Posterior variance of the latent function, in score units squared.
    pub variance: f64,
}

/// Posterior in standardized units with its gradient in the input.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct StandardizedPosterior {
    pub mean: f64,
    pub variance: f64,
    pub mean_gradient: Vec<f64>,
    pub variance_gradient: Vec<f64>,
}

fn check_data(x: &[Vec<f64>], y: &[f64], noise_sd: &[f64]) -> Result<usize, GpError> {
    if x.is_empty() {
        return Err(GpError::NoData);
    }
    if x.len() != y.len() || x.len() != noise_sd.len() {
        return Err(GpError::Shape(format!(
            "{} inputs, {} outputs, {} noise hints",
            x.len(),
            y.len(),
            noise_sd.len()
        )));
    }
    let d = x[0].len();
    for (i, ((xi, yi), si)) in x.iter().zip(y).zip(noise_sd).enumerate() {
        if xi.len() != d {
            return Err(GpError::Shape(format!(
                "input {i} has {} coordinates, input 0 has {d}",
                xi.len()
            )));
        }
        if !yi.is_finite() || !si.is_finite() || *si < 0.0 || xi.iter().any(|v| !v.is_finite()) {
            return Err(GpError::NotFinite { index: i });
        }
    }
    Ok(d)
}

/// Mean and standard deviation used to standardize outputs; a single point or
/// constant outputs get a unit scale so nothing divides by zero.
fn standardization(y: &[f64]) -> (f64, f64) {
    let n = y.len() as f64;
    let mean = y.iter().sum::<f64>() / n;
    let var = y.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let std = var.sqrt();
    if y.len() < 2 || !std.is_finite() || std < 1e-12 * mean.abs().max(1e-300) || std == 0.0 {
        (mean, 1.0)
    } else {
        (mean, std)
    }
}

impl Gp {
    /// A GP with the given hyperparameters (no fitting). `noise_sd[i]` is an
    /// extra noise standard deviation of observation `i` in score units
    /// (0 for none); its square, standardized, is added to that diagonal entry.
    pub fn with_hyperparameters(
        x: Vec<Vec<f64>>,
        y: &[f64],
        noise_sd: &[f64],
        hyper: Hyperparameters,
    ) -> Result<Self, GpError> {
        let d = check_data(&x, y, noise_sd)?;
        if hyper.length_scales.len() != d {
            return Err(GpError::Shape(format!(
                "{} length scales for {d}-dimensional inputs",
                hyper.length_scales.len()
            )));
        }
        let (y_mean, y_std) = standardization(y);
        let y_standardized =
            DVector::from_iterator(y.len(), y.iter().map(|v| (v - y_mean) / y_std));
        let extra: Vec<f64> = noise_sd.iter().map(|s| (s / y_std).powi(2)).collect();
        let k = kernel_matrix(&x, &hyper, &extra);
        let chol = cholesky_with_jitter(&k)?;
        let alpha = chol.solve(&y_standardized);
        Ok(Gp {
            x,
            y_standardized,
            y_mean,
            y_std,
            hyper,
            l: chol.unpack(),
            alpha,
        })
    }

    /// A GP whose hyperparameters maximize the log marginal likelihood plus
    /// weak log-normal priors (median length scale 0.4 of the unit cube,
    /// signal variance 1, noise variance 1e-3, all broad):
    /// L-BFGS on log-parameters from the default start, from `previous` (if
    /// any) and from `random_starts` random points of the parameter box.
    pub fn fit<R: Rng>(
        x: Vec<Vec<f64>>,
        y: &[f64],
        noise_sd: &[f64],
        previous: Option<&Hyperparameters>,
        random_starts: usize,
        rng: &mut R,
    ) -> Result<Self, GpError> {
        let d = check_data(&x, y, noise_sd)?;
        let (y_mean, y_std) = standardization(y);
        let ys: Vec<f64> = y.iter().map(|v| (v - y_mean) / y_std).collect();
        let extra: Vec<f64> = noise_sd.iter().map(|s| (s / y_std).powi(2)).collect();
        let problem = Likelihood::new(&x, &ys, &extra);

        let mut starts = vec![Hyperparameters::default_for(d).to_log()];
        if let Some(p) = previous.filter(|p| p.length_scales.len() == d) {
            starts.push(clamp_log(&p.to_log()));
        }
        for _ in 0..random_starts {
            let mut t: Vec<f64> = (0..d).map(|_| rng.random_range(-2.5..1.0)).collect();
            t.push(rng.random_range(-1.0..1.5));
            t.push(rng.random_range(-9.0..-1.0));
            starts.push(t);
        }

        let mut best: Option<(f64, Vec<f64>)> = None;
        for start in starts {
            let start_cost = problem.evaluate(&start).0;
            let mut candidate = (start_cost, start.clone());
            // Changes of 1e-6 in the negative log posterior, or gradients
            // below 1e-4, no longer move the hyperparameters meaningfully.
            let solver = LBFGS::new(MoreThuenteLineSearch::new(), 7)
                .with_tolerance_cost(1e-6)
                .and_then(|s| s.with_tolerance_grad(1e-4))
                .expect("tolerances are positive");
            let run = Executor::new(&problem, solver)
                .configure(|s| s.param(start).max_iters(40))
                .run();
            if let Ok(result) = run {
                let state = result.state();
                if let Some(p) = state.get_best_param() {
                    let cost = state.get_best_cost();
                    if cost.is_finite() && cost < candidate.0 {
                        candidate = (cost, p.clone());
                    }
                }
            }
            if candidate.0.is_finite() && best.as_ref().is_none_or(|b| candidate.0 < b.0) {
                best = Some(candidate);
            }
        }
        let theta = best.map_or_else(
            || Hyperparameters::default_for(d).to_log(),
            |(_, t)| clamp_log(&t),
        );
        Gp::with_hyperparameters(x, y, noise_sd, Hyperparameters::from_log(&theta))
    }

    /// The hyperparameters in use.
    pub fn hyperparameters(&self) -> &Hyperparameters {
        &self.hyper
    }

    /// Number of observations.
    pub fn len(&self) -> usize {
        self.x.len()
    }

    /// Whether the GP holds no observations (never true for a built GP).
    pub fn is_empty(&self) -> bool {
        self.x.is_empty()
    }

    /// Log marginal likelihood of the standardized outputs.
    pub fn log_marginal_likelihood(&self) -> f64 {
        let n = self.x.len() as f64;
        let fit = self.y_standardized.dot(&self.alpha);
        let log_det: f64 = (0..self.x.len()).map(|i| self.l[(i, i)].ln()).sum();
        -0.5 * fit - log_det - 0.5 * n * (2.0 * std::f64::consts::PI).ln()
    }

    /// Leave-one-out predictions of every observation, in score units: for
    /// observation `i`, the predictive mean and standard deviation (noise
    /// included) of `y_i` from the others, with the same hyperparameters
    /// (Rasmussen & Williams, eq. 5.12). Used to spot measurements far
    /// below what their neighbours say.
    pub fn leave_one_out(&self) -> Vec<Prediction> {
        let n = self.x.len();
        // K⁻¹ from the Cholesky factor: K⁻¹ = L⁻ᵀ L⁻¹.
        let identity = DMatrix::<f64>::identity(n, n);
        let Some(l_inv) = self.l.solve_lower_triangular(&identity) else {
            return Vec::new();
        };
        let k_inv = l_inv.transpose() * &l_inv;
        (0..n)
            .map(|i| {
                let kii = k_inv[(i, i)].max(f64::MIN_POSITIVE);
                let mean = self.y_standardized[i] - self.alpha[i] / kii;
                Prediction {
                    mean: self.y_mean + self.y_std * mean,
                    variance: self.y_std * self.y_std / kii,
                }
            })
            .collect()
    }

    /// Posterior of the latent score at encoded point `x`, in score units.
    pub fn predict(&self, x: &[f64]) -> Prediction {
        let (mean, variance) = self.predict_standardized(x);
        Prediction {
            mean: self.y_mean + self.y_std * mean,
            variance: variance * self.y_std * self.y_std,
        }
    }

    /// The standard deviation that outputs were divided by (1 when the
    /// outputs are constant or there is one): a standardized quantity times
    /// this is in score units.
    pub fn output_scale(&self) -> f64 {
        self.y_std
    }

    /// Converts a score to standardized units.
    pub(crate) fn standardize(&self, score: f64) -> f64 {
        (score - self.y_mean) / self.y_std
    }

    fn cross_covariance(&self, x: &[f64]) -> (DVector<f64>, Vec<f64>) {
        let mut k = DVector::zeros(self.x.len());
        let mut dk_factor = vec![0.0; self.x.len()];
        for (i, xi) in self.x.iter().enumerate() {
            let r = scaled_distance(x, xi, &self.hyper.length_scales);
            let (c, g) = matern52(r);
            k[i] = self.hyper.signal_variance * c;
            dk_factor[i] = self.hyper.signal_variance * g;
        }
        (k, dk_factor)
    }

    pub(crate) fn predict_standardized(&self, x: &[f64]) -> (f64, f64) {
        let (k, _) = self.cross_covariance(x);
        let mean = k.dot(&self.alpha);
        let v = self
            .l
            .solve_lower_triangular(&k)
            .expect("Cholesky factor has a positive diagonal");
        let floor = 1e-12 * self.hyper.signal_variance;
        (mean, (self.hyper.signal_variance - v.dot(&v)).max(floor))
    }

    /// Posterior mean and variance (standardized) with their gradients in `x`.
    pub(crate) fn posterior_with_gradient(&self, x: &[f64]) -> StandardizedPosterior {
        let (k, dk_factor) = self.cross_covariance(x);
        let mean = k.dot(&self.alpha);
        let v = self
            .l
            .solve_lower_triangular(&k)
            .expect("Cholesky factor has a positive diagonal");
        let w = self
            .l
            .tr_solve_lower_triangular(&v)
            .expect("Cholesky factor has a positive diagonal");
        let floor = 1e-12 * self.hyper.signal_variance;
        let raw_var = self.hyper.signal_variance - v.dot(&v);
        let d = x.len();
        let mut mean_gradient = vec![0.0; d];
        let mut variance_gradient = vec![0.0; d];
        for (i, xi) in self.x.iter().enumerate() {
            for j in 0..d {
                let l2 = self.hyper.length_scales[j] * self.hyper.length_scales[j];
                // d k_i / d x_j
                let dk = -dk_factor[i] * (x[j] - xi[j]) / l2;
                mean_gradient[j] += self.alpha[i] * dk;
                variance_gradient[j] -= 2.0 * w[i] * dk;
            }
        }
        if raw_var <= floor {
            variance_gradient.iter_mut().for_each(|g| *g = 0.0);
        }
        StandardizedPosterior {
            mean,
            variance: raw_var.max(floor),
            mean_gradient,
            variance_gradient,
        }
    }
}

fn kernel_matrix(x: &[Vec<f64>], hyper: &Hyperparameters, extra_diag: &[f64]) -> DMatrix<f64> {
    let n = x.len();
    let mut k = DMatrix::zeros(n, n);
    for a in 0..n {
        k[(a, a)] = hyper.signal_variance + hyper.noise_variance + extra_diag[a];
        for b in 0..a {
            let r = scaled_distance(&x[a], &x[b], &hyper.length_scales);
            let v = hyper.signal_variance * matern52(r).0;
            k[(a, b)] = v;
            k[(b, a)] = v;
        }
    }
    k
}

/// Parameters, cost and gradient of the last likelihood evaluation.
type CachedEvaluation = (Vec<f64>, f64, Vec<f64>);

/// The negative log marginal likelihood as an argmin problem over
/// log-parameters `[ln ℓ_1 … ln ℓ_d, ln σ_f², ln σ_n²]`, with a quadratic
/// penalty outside the parameter box. Cost and gradient come from one
/// evaluation, cached because argmin asks for them separately.
struct Likelihood<'a> {
    x: &'a [Vec<f64>],
    y: DVector<f64>,
    extra_diag: &'a [f64],
    /// Squared coordinate differences per pair and coordinate: `[a][b][k]`
    /// flattened, lower triangle only.
    sq_diff: Vec<f64>,
    cache: RefCell<Option<CachedEvaluation>>,
}

impl<'a> Likelihood<'a> {
    fn new(x: &'a [Vec<f64>], y: &[f64], extra_diag: &'a [f64]) -> Self {
        let n = x.len();
        let d = x.first().map_or(0, Vec::len);
        let mut sq_diff = vec![0.0; n * n * d];
        for a in 0..n {
            for b in 0..a {
                for k in 0..d {
                    let diff = x[a][k] - x[b][k];
                    sq_diff[(a * n + b) * d + k] = diff * diff;
                }
            }
        }
        Likelihood {
            x,
            y: DVector::from_column_slice(y),
            extra_diag,
            sq_diff,
            cache: RefCell::new(None),
        }
    }

    /// Negative log marginal likelihood (plus box penalty) and its gradient.
    fn evaluate(&self, theta_raw: &[f64]) -> (f64, Vec<f64>) {
        if let Some((t, c, g)) = self.cache.borrow().as_ref()
            && t.as_slice() == theta_raw
        {
            return (*c, g.clone());
        }
        let result = self.evaluate_uncached(theta_raw);
        *self.cache.borrow_mut() = Some((theta_raw.to_vec(), result.0, result.1.clone()));
        result
    }

    fn evaluate_uncached(&self, theta_raw: &[f64]) -> (f64, Vec<f64>) {
        let n = self.x.len();
        let d = theta_raw.len() - 2;
        let theta = clamp_log(theta_raw);
        let hyper = Hyperparameters::from_log(&theta);
        let inv_l2: Vec<f64> = hyper.length_scales.iter().map(|l| 1.0 / (l * l)).collect();

        // Kernel matrix and, per pair, the Matérn derivative factor.
        let mut k = DMatrix::zeros(n, n);
        let mut dfactor = vec![0.0; n * n];
        for a in 0..n {
            k[(a, a)] = hyper.signal_variance + hyper.noise_variance + self.extra_diag[a];
            for b in 0..a {
                let base = (a * n + b) * d;
                let r2: f64 = (0..d).map(|j| self.sq_diff[base + j] * inv_l2[j]).sum();
                let (c, g) = matern52(r2.sqrt());
                let v = hyper.signal_variance * c;
                k[(a, b)] = v;
                k[(b, a)] = v;
                dfactor[a * n + b] = hyper.signal_variance * g;
            }
        }
        let Ok(chol) = cholesky_with_jitter(&k) else {
            return (1e10, vec![0.0; theta_raw.len()]);
        };
        let alpha = chol.solve(&self.y);
        let l = chol.l_dirty();
        let log_det: f64 = (0..n).map(|i| l[(i, i)].ln()).sum();
        let nll =
            0.5 * self.y.dot(&alpha) + log_det + 0.5 * n as f64 * (2.0 * std::f64::consts::PI).ln();

        // W = K⁻¹ - ααᵀ;  d nll / dθ = ½ tr(W dK/dθ).
        let k_inv = chol.inverse();
        let mut grad = vec![0.0; d + 2];
        for a in 0..n {
            let w_aa = k_inv[(a, a)] - alpha[a] * alpha[a];
            grad[d] += 0.5 * w_aa * hyper.signal_variance;
            grad[d + 1] += 0.5 * w_aa * hyper.noise_variance;
            for b in 0..a {
                // Off-diagonal pairs appear twice in the trace.
                let w_ab = k_inv[(a, b)] - alpha[a] * alpha[b];
                grad[d] += w_ab * k[(a, b)];
                let base = (a * n + b) * d;
                let f = w_ab * dfactor[a * n + b];
                for j in 0..d {
                    grad[j] += f * self.sq_diff[base + j] * inv_l2[j];
                }
            }
        }

        // Priors, on the clamped parameters.
        let mut cost = nll;
        for (i, t) in theta.iter().enumerate() {
            let (mean, sd) = if i < d {
                PRIOR_LOG_LENGTH
            } else if i == d {
                PRIOR_LOG_SIGNAL
            } else {
                PRIOR_LOG_NOISE
            };
            let z = (t - mean) / sd;
            cost += 0.5 * z * z;
            grad[i] += z / sd;
        }

        // Penalty outside the box; clamped coordinates have no likelihood
        // gradient of their own.
        for (i, (raw, clamped)) in theta_raw.iter().zip(&theta).enumerate() {
            let outside = raw - clamped;
            if outside != 0.0 || !raw.is_finite() {
                grad[i] = 0.0;
            }
            if raw.is_finite() {
                cost += 10.0 * outside * outside;
                grad[i] += 20.0 * outside;
            } else {
                cost = 1e10;
            }
        }
        if !cost.is_finite() {
            return (1e10, vec![0.0; theta_raw.len()]);
        }
        (cost, grad)
    }
}

impl CostFunction for &Likelihood<'_> {
    type Param = Vec<f64>;
    type Output = f64;

    fn cost(&self, param: &Self::Param) -> Result<Self::Output, argmin::core::Error> {
        Ok(self.evaluate(param).0)
    }
}

impl Gradient for &Likelihood<'_> {
    type Param = Vec<f64>;
    type Gradient = Vec<f64>;

    fn gradient(&self, param: &Self::Param) -> Result<Self::Gradient, argmin::core::Error> {
        Ok(self.evaluate(param).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    fn hyper(l: f64, sf2: f64, sn2: f64) -> Hyperparameters {
        Hyperparameters {
            length_scales: vec![l],
            signal_variance: sf2,
            noise_variance: sn2,
        }
    }

    #[test]
    fn one_point_posterior_matches_hand_computation() {
        // One observation y = 5 at x = 0.2: standardization is (mean 5, std 1),
        // so the standardized target is 0 and the posterior mean is 5 everywhere.
        // Variance at x: σf² - k(x)²/(σf² + σn²).
        let gp = Gp::with_hyperparameters(vec![vec![0.2]], &[5.0], &[0.0], hyper(0.5, 2.0, 0.1))
            .unwrap();
        let p = gp.predict(&[0.7]);
        assert!((p.mean - 5.0).abs() < 1e-12);
        // r = 0.5/0.5 = 1, s = √5: k = 2(1 + √5 + 5/3)e^{-√5}
        let k = 2.0 * (1.0 + 5f64.sqrt() + 5.0 / 3.0) * (-(5f64.sqrt())).exp();
        let expected_var = 2.0 - k * k / 2.1;
        assert!(
            (p.variance - expected_var).abs() < 1e-12,
            "{} vs {expected_var}",
            p.variance
        );
        // At the observed point the variance is σf²σn²/(σf²+σn²).
        let at = gp.predict(&[0.2]);
        assert!((at.variance - 2.0 * 0.1 / 2.1).abs() < 1e-12);
    }

    #[test]
    fn two_point_posterior_matches_hand_computation() {
        // y = [1, 3] → mean 2, std 1, standardized [-1, 1].
        // x = [0, 1], ℓ = 1 → k01 = (1 + √5 + 5/3)e^{-√5} with σf² = 1.
        let sn2 = 0.01;
        let gp = Gp::with_hyperparameters(
            vec![vec![0.0], vec![1.0]],
            &[1.0, 3.0],
            &[0.0, 0.0],
            hyper(1.0, 1.0, sn2),
        )
        .unwrap();
        let c = |r: f64| {
            let s = 5f64.sqrt() * r;
            (1.0 + s + s * s / 3.0) * (-s).exp()
        };
        let k01 = c(1.0);
        let a = 1.0 + sn2;
        // K⁻¹ for [[a, k01], [k01, a]].
        let det = a * a - k01 * k01;
        let inv = [[a / det, -k01 / det], [-k01 / det, a / det]];
        let ys = [-1.0, 1.0];
        let alpha = [
            inv[0][0] * ys[0] + inv[0][1] * ys[1],
            inv[1][0] * ys[0] + inv[1][1] * ys[1],
        ];
        let x = 0.25;
        let ks = [c(0.25), c(0.75)];
        let mean_s = ks[0] * alpha[0] + ks[1] * alpha[1];
        let quad = ks[0] * (inv[0][0] * ks[0] + inv[0][1] * ks[1])
            + ks[1] * (inv[1][0] * ks[0] + inv[1][1] * ks[1]);
        let p = gp.predict(&[x]);
        assert!((p.mean - (2.0 + mean_s)).abs() < 1e-10);
        assert!((p.variance - (1.0 - quad)).abs() < 1e-10);
        // Log marginal likelihood by hand.
        let fit = ys[0] * alpha[0] + ys[1] * alpha[1];
        let lml = -0.5 * fit - 0.5 * det.ln() - (2.0 * std::f64::consts::PI).ln();
        assert!((gp.log_marginal_likelihood() - lml).abs() < 1e-10);
    }

    #[test]
    fn noise_hint_widens_the_posterior_at_that_point() {
        let x = vec![vec![0.1], vec![0.5], vec![0.9]];
        let y = [1.0, 2.0, 1.5];
        let h = hyper(0.3, 1.0, 1e-4);
        let quiet = Gp::with_hyperparameters(x.clone(), &y, &[0.0; 3], h.clone()).unwrap();
        let loud = Gp::with_hyperparameters(x, &y, &[0.0, 1.0, 0.0], h).unwrap();
        assert!(loud.predict(&[0.5]).variance > 10.0 * quiet.predict(&[0.5]).variance);
        // The noisy point pulls the mean less.
        assert!(loud.predict(&[0.5]).mean < quiet.predict(&[0.5]).mean);
    }

    #[test]
    fn likelihood_gradient_matches_finite_differences() {
        let x = vec![
            vec![0.1, 0.3],
            vec![0.5, 0.9],
            vec![0.8, 0.2],
            vec![0.4, 0.4],
        ];
        let y = [0.3, -1.0, 0.8, 0.1];
        let extra = [0.0, 0.05, 0.0, 0.0];
        let problem = Likelihood::new(&x, &y, &extra);
        let theta = vec![-0.7, 0.2, 0.3, -3.0];
        let (_, grad) = problem.evaluate_uncached(&theta);
        for i in 0..theta.len() {
            let h = 1e-6;
            let mut up = theta.clone();
            up[i] += h;
            let mut down = theta.clone();
            down[i] -= h;
            let fd =
                (problem.evaluate_uncached(&up).0 - problem.evaluate_uncached(&down).0) / (2.0 * h);
            assert!(
                (fd - grad[i]).abs() < 1e-5,
                "param {i}: fd {fd} vs {}",
                grad[i]
            );
        }
    }

    #[test]
    fn posterior_gradient_matches_finite_differences() {
        let x = vec![vec![0.1, 0.3], vec![0.5, 0.9], vec![0.8, 0.2]];
        let gp = Gp::with_hyperparameters(
            x,
            &[1.0, 2.0, 0.5],
            &[0.0; 3],
            Hyperparameters {
                length_scales: vec![0.4, 0.6],
                signal_variance: 1.3,
                noise_variance: 1e-3,
            },
        )
        .unwrap();
        let at = [0.3, 0.6];
        let p = gp.posterior_with_gradient(&at);
        for j in 0..2 {
            let h = 1e-6;
            let mut up = at;
            up[j] += h;
            let mut down = at;
            down[j] -= h;
            let (mu_up, var_up) = gp.predict_standardized(&up);
            let (mu_down, var_down) = gp.predict_standardized(&down);
            assert!(((mu_up - mu_down) / (2.0 * h) - p.mean_gradient[j]).abs() < 1e-6);
            assert!(((var_up - var_down) / (2.0 * h) - p.variance_gradient[j]).abs() < 1e-6);
        }
    }

    #[test]
    fn fitting_raises_the_likelihood_and_learns_relevance() {
        // y depends on the first coordinate only.
        let mut rng = ChaCha8Rng::seed_from_u64(3);
        let x: Vec<Vec<f64>> = (0..20)
            .map(|_| vec![rng.random::<f64>(), rng.random::<f64>()])
            .collect();
        let y: Vec<f64> = x.iter().map(|p| (6.0 * p[0]).sin()).collect();
        let noise = vec![0.0; x.len()];
        let start =
            Gp::with_hyperparameters(x.clone(), &y, &noise, Hyperparameters::default_for(2))
                .unwrap();
        let fitted = Gp::fit(x, &y, &noise, None, 2, &mut rng).unwrap();
        assert!(fitted.log_marginal_likelihood() > start.log_marginal_likelihood() + 1.0);
        let ls = &fitted.hyperparameters().length_scales;
        assert!(ls[1] > 2.0 * ls[0], "length scales {ls:?}");
        // It interpolates a held-out point well.
        let p = fitted.predict(&[0.33, 0.5]);
        assert!((p.mean - (6.0f64 * 0.33).sin()).abs() < 0.1, "{p:?}");
    }

    #[test]
    fn leave_one_out_matches_refitting_without_the_point() {
        let x = vec![vec![0.1], vec![0.35], vec![0.5], vec![0.8], vec![0.9]];
        let y = [1.0, 2.0, 1.5, 0.2, 0.4];
        let h = hyper(0.3, 1.3, 0.05);
        let gp = Gp::with_hyperparameters(x.clone(), &y, &[0.0; 5], h.clone()).unwrap();
        let loo = gp.leave_one_out();
        for i in 0..5 {
            // The same standardization as the full fit, so the same model.
            let (mean, std) = standardization(&y);
            let xs: Vec<Vec<f64>> = (0..5).filter(|&j| j != i).map(|j| x[j].clone()).collect();
            let ys: Vec<f64> = (0..5)
                .filter(|&j| j != i)
                .map(|j| (y[j] - mean) / std)
                .collect();
            let k = kernel_matrix(&xs, &h, &[0.0; 4]);
            let chol = cholesky_with_jitter(&k).unwrap();
            let alpha = chol.solve(&DVector::from_vec(ys));
            let kx = DVector::from_iterator(
                4,
                xs.iter().map(|xj| {
                    h.signal_variance * matern52(scaled_distance(&x[i], xj, &h.length_scales)).0
                }),
            );
            let m = mean + std * kx.dot(&alpha);
            let v = chol.l().solve_lower_triangular(&kx).unwrap();
            let var = std * std * (h.signal_variance - v.dot(&v) + h.noise_variance);
            assert!(
                (loo[i].mean - m).abs() < 1e-9,
                "mean {i}: {} vs {m}",
                loo[i].mean
            );
            assert!(
                (loo[i].variance - var).abs() < 1e-9,
                "var {i}: {} vs {var}",
                loo[i].variance
            );
        }
    }

    #[test]
    fn bad_data_is_refused() {
        let h = hyper(0.3, 1.0, 0.01);
        assert_eq!(
            Gp::with_hyperparameters(vec![], &[], &[], h.clone()).unwrap_err(),
            GpError::NoData
        );
        assert!(matches!(
            Gp::with_hyperparameters(vec![vec![0.1]], &[f64::NAN], &[0.0], h.clone()),
            Err(GpError::NotFinite { index: 0 })
        ));
        assert!(matches!(
            Gp::with_hyperparameters(vec![vec![0.1]], &[1.0, 2.0], &[0.0], h),
            Err(GpError::Shape(_))
        ));
    }
}
