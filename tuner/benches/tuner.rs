//! Benchmark of the tuner: Bayesian optimization against random search on
//! the same budget, over many seeds, on Branin (regret), Hartmann-6 (regret)
//! and a noisy 3-knob collective-throughput landscape (% of the true
//! optimum), plus the time of `suggest()` and `observe()` with 50
//! observations. Prints tables; asserts nothing.
//!
//! Then what a job pays while it is tuned: whole tuning sessions against a
//! simulated job on four landscapes (see `tuner/cost.rs`), session mean and
//! pick at 10 and 20 samples, beside random search and round one's
//! algorithm.
//!
//! Run: `cargo bench -p tuner --bench tuner` (or `cargo xtask bench tuner`).
//! Quick run: `--quick` or `RINGWATCH_BENCH_SEEDS=5`. Only the session
//! table: `--cost-only`; one session's windows:
//! `RINGWATCH_BENCH_TRACE="<landscape>/<contender>/<seed>/<samples>"`.

use std::time::Instant;

#[path = "tuner/cost.rs"]
mod cost;

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tuner::space::{CollectiveKnobs, Dim, DimKind, Point, Space, Value};
use tuner::{Optimizer, OptimizerConfig};

const CHECKPOINTS: [usize; 3] = [10, 20, 30];
const BUDGET: usize = 30;

fn reals(point: &Point) -> Vec<f64> {
    point
        .values()
        .iter()
        .map(|v| match v {
            Value::Real(x) => *x,
            Value::Integer(i) => *i as f64,
            Value::Bool(b) => f64::from(u8::from(*b)),
            Value::Choice(c) => *c as f64,
        })
        .collect()
}

fn real_dim(name: &str, low: f64, high: f64) -> Dim {
    Dim {
        name: name.into(),
        kind: DimKind::Continuous {
            low,
            high,
            log_scale: false,
        },
    }
}

// ---------------------------------------------------------------- Branin

const BRANIN_MIN: f64 = 0.397_887_357_729_738;

fn branin(x: &[f64]) -> f64 {
    let (x1, x2) = (x[0], x[1]);
    let pi = std::f64::consts::PI;
    let b = 5.1 / (4.0 * pi * pi);
    let c = 5.0 / pi;
    let t = 1.0 / (8.0 * pi);
    (x2 - b * x1 * x1 + c * x1 - 6.0).powi(2) + 10.0 * (1.0 - t) * x1.cos() + 10.0
}

// ------------------------------------------------------------ Hartmann-6

const HARTMANN6_MAX: f64 = 3.322_368_011_415_51;

fn hartmann6(x: &[f64]) -> f64 {
    const ALPHA: [f64; 4] = [1.0, 1.2, 3.0, 3.2];
    const A: [[f64; 6]; 4] = [
        [10.0, 3.0, 17.0, 3.5, 1.7, 8.0],
        [0.05, 10.0, 17.0, 0.1, 8.0, 14.0],
        [3.0, 3.5, 1.7, 10.0, 17.0, 8.0],
        [17.0, 8.0, 0.05, 10.0, 0.1, 14.0],
    ];
    const P: [[f64; 6]; 4] = [
        [0.1312, 0.1696, 0.5569, 0.0124, 0.8283, 0.5886],
        [0.2329, 0.4135, 0.8307, 0.3736, 0.1004, 0.9991],
        [0.2348, 0.1451, 0.3522, 0.2883, 0.3047, 0.6650],
        [0.4047, 0.8828, 0.8732, 0.5743, 0.1091, 0.0381],
    ];
    (0..4)
        .map(|i| {
            let inner: f64 = (0..6).map(|j| A[i][j] * (x[j] - P[i][j]).powi(2)).sum();
            ALPHA[i] * (-inner).exp()
        })
        .sum()
}

// ------------------------------------------- collective throughput landscape

/// Allreduce throughput (GB/s) of a 2-node × 4-rank job over a slow
/// inter-node link, where hierarchical allreduce wins (see
/// `cost::hierarchical_flip`).
fn collective_truth(point: &Point) -> f64 {
    cost::hierarchical_flip(
        &CollectiveKnobs::from_point(point).expect("benchmark points come from the space"),
    )
}

// ---------------------------------------------------------------- driver

/// A (possibly noisy) measurement of a point's score.
type Measure = Box<dyn Fn(&Point, &mut ChaCha8Rng) -> f64>;

struct Problem {
    name: &'static str,
    metric: &'static str,
    space: Space,
    start: Option<Point>,
    /// Measured score (maximized), possibly noisy.
    measure: Measure,
    /// What the table shows for a recommended point (lower is better when
    /// `lower_is_better`).
    quality: Box<dyn Fn(&Point) -> f64>,
    lower_is_better: bool,
    /// Recommend by posterior mean (noisy problems) or best observed.
    by_posterior_mean: bool,
}

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

fn random_point(space: &Space, rng: &mut ChaCha8Rng) -> Point {
    let u: Vec<f64> = (0..space.encoded_len()).map(|_| rng.random()).collect();
    space.decode(&u)
}

/// Quality of the recommendation after each checkpoint, for BO and random.
fn run_seed(problem: &Problem, seed: u64) -> ([f64; 3], [f64; 3]) {
    let mut noise_rng = ChaCha8Rng::seed_from_u64(1_000_003 * seed + 7);
    let mut optimizer = Optimizer::new(
        problem.space.clone(),
        OptimizerConfig {
            seed,
            budget: BUDGET,
            start: problem.start.clone(),
            stop_after_rounds: 0,
            ..OptimizerConfig::default()
        },
    )
    .expect("benchmark configuration is valid");
    let mut bo = [0.0; 3];
    for n in 1..=BUDGET {
        let p = optimizer.suggest();
        let y = (problem.measure)(&p, &mut noise_rng);
        optimizer
            .observe(p, y, None)
            .expect("benchmark observations are finite and in the space");
        if let Some(k) = CHECKPOINTS.iter().position(|&c| c == n) {
            let pick = if problem.by_posterior_mean {
                optimizer.best().map(|b| b.point)
            } else {
                optimizer
                    .observations()
                    .iter()
                    .max_by(|a, b| a.score.total_cmp(&b.score))
                    .map(|o| o.point.clone())
            }
            .expect("there are observations");
            bo[k] = (problem.quality)(&pick);
        }
    }

    // Random search: same budget, same start, recommends its best measurement.
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_5eed);
    let mut noise_rng = ChaCha8Rng::seed_from_u64(1_000_003 * seed + 7);
    let mut random = [0.0; 3];
    let mut best: Option<(f64, Point)> = None;
    for n in 1..=BUDGET {
        let p = match (&problem.start, n) {
            (Some(s), 1) => s.clone(),
            _ => random_point(&problem.space, &mut rng),
        };
        let y = (problem.measure)(&p, &mut noise_rng);
        if best.as_ref().is_none_or(|b| y > b.0) {
            best = Some((y, p));
        }
        if let Some(k) = CHECKPOINTS.iter().position(|&c| c == n) {
            random[k] = (problem.quality)(&best.as_ref().expect("sampled").1);
        }
    }
    (bo, random)
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    }
}

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    // `cargo test --all-targets` runs this binary too, without `--bench`:
    // then it is a one-seed smoke run that checks the benchmark works, not a
    // measurement.
    let smoke = !std::env::args().any(|a| a == "--bench");
    let seeds: u64 = if smoke {
        println!("smoke run (no --bench: run by cargo test): one seed, not a measurement");
        1
    } else {
        std::env::var("RINGWATCH_BENCH_SEEDS")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(if quick { 5 } else { 20 })
    };

    let started = Instant::now();
    cost_table(seeds, smoke);
    println!(
        "\n(tuning sessions took {:.1} s)\n",
        started.elapsed().as_secs_f64()
    );
    if std::env::args().any(|a| a == "--cost-only") {
        return;
    }

    let optimum = cost::optimum(cost::hierarchical_flip);
    let problems = vec![
        Problem {
            name: "Branin",
            metric: "regret",
            space: Space::new(vec![real_dim("x1", -5.0, 10.0), real_dim("x2", 0.0, 15.0)])
                .expect("valid space"),
            start: None,
            measure: Box::new(|p, _| -branin(&reals(p))),
            quality: Box::new(|p| branin(&reals(p)) - BRANIN_MIN),
            lower_is_better: true,
            by_posterior_mean: false,
        },
        Problem {
            name: "Hartmann-6",
            metric: "regret",
            space: Space::new(
                (0..6)
                    .map(|i| real_dim(&format!("x{i}"), 0.0, 1.0))
                    .collect(),
            )
            .expect("valid space"),
            start: None,
            measure: Box::new(|p, _| hartmann6(&reals(p))),
            quality: Box::new(|p| HARTMANN6_MAX - hartmann6(&reals(p))),
            lower_is_better: true,
            by_posterior_mean: false,
        },
        Problem {
            name: "collective (5% noise)",
            metric: "% of optimum",
            space: Space::collective(),
            start: Some(CollectiveKnobs::default().to_point()),
            measure: Box::new(|p, rng| collective_truth(p) * (1.0 + 0.05 * normal(rng))),
            quality: Box::new(move |p| 100.0 * collective_truth(p) / optimum),
            lower_is_better: false,
            by_posterior_mean: true,
        },
    ];

    println!("tuner benchmark: {seeds} seeds, budget {BUDGET}; median over seeds");
    println!(
        "(BO recommends its best observation on noiseless problems and its best posterior mean on the noisy one; random search recommends its best measurement)\n"
    );
    println!("| problem | metric | evals | BO median | random median | seeds BO better |");
    println!("|---|---|---:|---:|---:|---:|");
    let started = Instant::now();
    for problem in &problems {
        let results: Vec<([f64; 3], [f64; 3])> = (0..seeds).map(|s| run_seed(problem, s)).collect();
        for (k, evals) in CHECKPOINTS.iter().enumerate() {
            let bo: Vec<f64> = results.iter().map(|r| r.0[k]).collect();
            let random: Vec<f64> = results.iter().map(|r| r.1[k]).collect();
            let wins = bo
                .iter()
                .zip(&random)
                .filter(|(b, r)| {
                    if problem.lower_is_better {
                        b < r
                    } else {
                        b > r
                    }
                })
                .count();
            println!(
                "| {} | {} | {evals} | {:.4} | {:.4} | {wins}/{seeds} |",
                problem.name,
                problem.metric,
                median(bo),
                median(random)
            );
        }
    }
    println!(
        "\n(optimization runs took {:.1} s)\n",
        started.elapsed().as_secs_f64()
    );

    // Time suggest() and observe() with 50 observations on the collective
    // space, as a session runs them (safe exploration from a start, robust).
    let space = Space::collective();
    let mut rng = ChaCha8Rng::seed_from_u64(42);
    let mut optimizer = Optimizer::new(
        space.clone(),
        OptimizerConfig {
            seed: 42,
            budget: 100,
            start: Some(CollectiveKnobs::default().to_point()),
            stop_after_rounds: 0,
            ..OptimizerConfig::default()
        },
    )
    .expect("valid configuration");
    let mut observe_ms = Vec::new();
    for _ in 0..50 {
        let p = random_point(&space, &mut rng);
        let y = collective_truth(&p) * (1.0 + 0.05 * normal(&mut rng));
        let t = Instant::now();
        optimizer
            .observe(p, y, None)
            .expect("finite score in the space");
        observe_ms.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut suggest_ms = Vec::new();
    for _ in 0..10 {
        let t = Instant::now();
        let p = optimizer.suggest();
        suggest_ms.push(t.elapsed().as_secs_f64() * 1e3);
        std::hint::black_box(p);
    }
    // One more observation (the 51st) to time a refit at that size.
    let p = random_point(&space, &mut rng);
    let y = collective_truth(&p);
    let t = Instant::now();
    optimizer
        .observe(p, y, None)
        .expect("finite score in the space");
    let observe_51 = t.elapsed().as_secs_f64() * 1e3;
    println!("| timing (collective space) | median ms |");
    println!("|---|---:|");
    println!(
        "| suggest() with 50 observations (10 calls) | {:.2} |",
        median(suggest_ms)
    );
    println!("| observe() #51 (GP hyperparameter refit) | {observe_51:.2} |");
    println!("| observe() #1..#50 (median) | {:.2} |", median(observe_ms));
}

fn percentile(mut v: Vec<f64>, q: f64) -> f64 {
    v.sort_by(f64::total_cmp);
    let at = (q * (v.len() - 1) as f64).round() as usize;
    v[at.min(v.len() - 1)]
}

/// The session table: every contender on every landscape, at 10 and 20
/// samples, `seeds` seeds each.
fn cost_table(seeds: u64, smoke: bool) {
    use cost::{Contender, Landscape};
    let landscapes = [
        Landscape {
            name: "defaults near optimum",
            truth: cost::near_defaults,
            disturbed: false,
        },
        Landscape {
            name: "hierarchical flips the optimum",
            truth: cost::hierarchical_flip,
            disturbed: false,
        },
        Landscape {
            name: "near optimum, 10% disturbed",
            truth: cost::near_defaults,
            disturbed: true,
        },
        Landscape {
            name: "memory cliff above 96 MiB",
            truth: cost::memory_cliff,
            disturbed: false,
        },
    ];
    let contenders = [
        Contender {
            name: "random search",
            config: None,
            signal: false,
        },
        Contender {
            name: "round one (global EI)",
            config: Some(cost::round_one),
            signal: false,
        },
        Contender {
            name: "safe (agent: whole windows)",
            config: Some(cost::today),
            signal: false,
        },
        Contender {
            name: "safe + sub-window median",
            config: Some(cost::today_sub_windows),
            signal: false,
        },
        Contender {
            name: "safe, disturbance signal",
            config: Some(cost::today),
            signal: true,
        },
    ];
    let budgets: &[usize] = if smoke { &[10] } else { &[10, 20] };
    println!(
        "tuning sessions against a simulated job: {seeds} seeds; % of each landscape's optimum; \
         session mean = mean true throughput of every window measured (samples, re-measures, \
         confirmation); pick = the pinned knobs; < start = seeds whose pick is truly worse \
         than the start (the runtime's defaults)\n"
    );
    println!(
        "| landscape (defaults at) | contender | samples | session mean | pick median | pick p25 | pick min | < start | windows |"
    );
    println!("|---|---|---:|---:|---:|---:|---:|---:|---:|");
    for landscape in &landscapes {
        let optimum = cost::optimum(landscape.truth);
        let defaults = 100.0 * (landscape.truth)(&CollectiveKnobs::default()) / optimum;
        for contender in &contenders {
            if contender.signal && !landscape.disturbed {
                continue;
            }
            for &budget in budgets {
                let runs: Vec<cost::Outcome> = (0..seeds)
                    .map(|seed| cost::run(landscape, contender, budget, seed, optimum))
                    .collect();
                let means: Vec<f64> = runs.iter().map(|r| r.session_mean).collect();
                let picks: Vec<f64> = runs.iter().map(|r| r.pick).collect();
                let worse = runs.iter().filter(|r| r.worse_than_start).count();
                let windows: Vec<f64> = runs.iter().map(|r| r.windows as f64).collect();
                println!(
                    "| {} ({defaults:.1}%) | {} | {budget} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {worse}/{seeds} | {:.0} |",
                    landscape.name,
                    contender.name,
                    median(means),
                    median(picks.clone()),
                    percentile(picks.clone(), 0.25),
                    percentile(picks, 0.0),
                    median(windows),
                );
            }
        }
    }
}
