//! What a job pays while it is tuned: whole tuning sessions
//! ([`tuner::session::TuningSession`], the protocol the agent and a
//! self-tuning job run) against a simulated job, on landscapes written for
//! this benchmark (not fitted to by the tuner's settings).
//!
//! The simulated job runs cycles of a fixed size; a cycle's duration is its
//! bytes over the landscape's true throughput at the knobs in force, times
//! a per-window factor (3% sd: what changes between windows) and a
//! per-cycle factor (5% sd). On the "disturbed" landscapes, disturbance
//! episodes (each 5–15 cycles long, ×0.7 throughput, ~10% of all cycles)
//! start at random and nothing tells the session about them unless the
//! row says "signal".
//!
//! Per session it records:
//! - **session mean**: the mean true throughput, as % of the landscape's
//!   optimum, of every window the session measured (samples, re-measured
//!   windows, confirmation windows): what the job ran at while tuned;
//! - **pick**: the true throughput of the knobs the session pins, % of the
//!   optimum;
//! - **< start**: whether the pick is truly worse than the start knobs.

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use tuner::optimizer::Exploration;
use tuner::session::{CycleObservation, SessionConfig, Step, TuningSession, Verdict};
use tuner::space::{CollectiveKnobs, Space};

/// A landscape: true throughput (GB/s) of the job at some knobs.
pub struct Landscape {
    pub name: &'static str,
    pub truth: fn(&CollectiveKnobs) -> f64,
    /// Disturbance episodes on.
    pub disturbed: bool,
}

/// The smooth-max message size and the step time shared by the landscapes:
/// `messages × latency + bytes / bandwidth + one fusion buffer's copy`.
fn step_throughput(
    knobs: &CollectiveKnobs,
    gradient_bytes: f64,
    tensor_bytes: f64,
    (latency_s, bandwidth): (f64, f64),
    copy_bandwidth: f64,
) -> f64 {
    let threshold = knobs.fusion_threshold_bytes as f64;
    let message_bytes = (threshold.powi(4) + tensor_bytes.powi(4)).powf(0.25);
    let messages = gradient_bytes / message_bytes;
    let copy_s = message_bytes.min(gradient_bytes) / copy_bandwidth;
    gradient_bytes / (messages * latency_s + gradient_bytes / bandwidth + copy_s) / 1e9
}

/// Cycle-time efficiency with an interior optimum at `sqrt(overhead / delay)`.
fn cycle_efficiency(cycle_ms: f64, overhead_ms: f64, delay_per_ms: f64) -> f64 {
    1.0 / (1.0 + overhead_ms / cycle_ms + delay_per_ms * cycle_ms)
}

/// Defaults near the optimum: a fast flat ring, hierarchical slightly worse,
/// the best fusion threshold a few times below the default and the best
/// cycle time a few ms.
pub fn near_defaults(k: &CollectiveKnobs) -> f64 {
    let link = if k.hierarchical_allreduce {
        (0.6e-3, 2.4e9)
    } else {
        (0.3e-3, 3.0e9)
    };
    step_throughput(k, 100e6, 1e6, link, 12e9) * cycle_efficiency(k.cycle_time_ms, 0.3, 0.03)
}

/// Hierarchical allreduce wins far from the defaults (a slow inter-node
/// link): round one's benchmark landscape. Shaped like what `collbench`
/// measures: fewer, larger messages amortize per-message latency, but one
/// fusion buffer's copy cannot overlap; short cycles burn coordinator
/// overhead, long ones delay ready tensors; hierarchical allreduce pays more
/// latency per message but moves fewer bytes over the slow link.
pub fn hierarchical_flip(k: &CollectiveKnobs) -> f64 {
    let link = if k.hierarchical_allreduce {
        (2.0e-3, 3.0e9)
    } else {
        (1.0e-3, 1.2e9)
    };
    step_throughput(k, 256.0 * 1024.0 * 1024.0, 2.0 * 1024.0 * 1024.0, link, 8e9)
        * cycle_efficiency(k.cycle_time_ms, 0.5, 0.02)
}

/// Bigger fusion buffers keep paying until memory runs out: above 96 MiB
/// the job swaps and its throughput collapses to a fifth.
pub fn memory_cliff(k: &CollectiveKnobs) -> f64 {
    let link = if k.hierarchical_allreduce {
        (2.5e-3, 2.2e9)
    } else {
        (2.0e-3, 2.5e9)
    };
    let base =
        step_throughput(k, 400e6, 1e6, link, 60e9) * cycle_efficiency(k.cycle_time_ms, 0.4, 0.02);
    if k.fusion_threshold_bytes > 96 * 1024 * 1024 {
        0.2 * base
    } else {
        base
    }
}

/// The landscape's optimum by a fine grid over the collective space.
pub fn optimum(truth: fn(&CollectiveKnobs) -> f64) -> f64 {
    let space = Space::collective();
    let mut best = f64::NEG_INFINITY;
    for h in [0.0, 1.0] {
        for i in 0..=300 {
            for j in 0..=300 {
                let p = space.decode(&[i as f64 / 300.0, j as f64 / 300.0, h]);
                let k = CollectiveKnobs::from_point(&p).expect("decoded points are in the space");
                best = best.max(truth(&k));
            }
        }
    }
    best
}

fn normal(rng: &mut ChaCha8Rng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

const CYCLE_BYTES: u64 = 64 << 20;
const WINDOW_SD: f64 = 0.03;
const CYCLE_SD: f64 = 0.05;
const EPISODE_START_PROBABILITY: f64 = 0.011;
const EPISODE_FACTOR: f64 = 0.7;

/// The simulated job: a clock, the knobs in force, the noise and the
/// disturbance episodes.
struct Job {
    truth: fn(&CollectiveKnobs) -> f64,
    disturbed: bool,
    rng: ChaCha8Rng,
    knobs: CollectiveKnobs,
    window_factor: f64,
    cycle: u64,
    now_us: u64,
    episode_left: u32,
}

impl Job {
    fn new(landscape: &Landscape, start: CollectiveKnobs, seed: u64) -> Self {
        Job {
            truth: landscape.truth,
            disturbed: landscape.disturbed,
            rng: ChaCha8Rng::seed_from_u64(0xc057 ^ seed.wrapping_mul(0x9e37_79b9)),
            knobs: start,
            window_factor: 1.0,
            cycle: 0,
            now_us: 0,
            episode_left: 0,
        }
    }

    /// New knobs in force from the next cycle (and a new window's factor).
    fn apply(&mut self, knobs: CollectiveKnobs) -> u64 {
        self.knobs = knobs;
        self.window_factor = (1.0 + WINDOW_SD * normal(&mut self.rng)).max(0.5);
        self.cycle + 1
    }

    /// The next cycle and whether a disturbance slowed it.
    fn next_cycle(&mut self) -> (CycleObservation, bool) {
        if self.disturbed
            && self.episode_left == 0
            && self.rng.random::<f64>() < EPISODE_START_PROBABILITY
        {
            self.episode_left = self.rng.random_range(5..=15);
        }
        let hit = self.episode_left > 0;
        self.episode_left = self.episode_left.saturating_sub(1);
        let mut rate = (self.truth)(&self.knobs) * 1e9 * self.window_factor;
        rate *= (1.0 + CYCLE_SD * normal(&mut self.rng)).max(0.5);
        if hit {
            rate *= EPISODE_FACTOR;
        }
        let duration_us = (CYCLE_BYTES as f64 / rate * 1e6).max(1.0) as u64;
        self.cycle += 1;
        let c = CycleObservation {
            cycle: self.cycle,
            start_unix_us: self.now_us,
            duration_us,
            bytes_reduced: CYCLE_BYTES,
            ..Default::default()
        };
        self.now_us += duration_us;
        (c, hit)
    }
}

/// What one session did.
pub struct Outcome {
    /// Mean true throughput of every measured window, % of optimum.
    pub session_mean: f64,
    /// True throughput of the pinned knobs, % of optimum.
    pub pick: f64,
    /// The pick is truly worse than the start.
    pub worse_than_start: bool,
    /// Windows measured.
    pub windows: usize,
}

/// A named way to tune.
pub struct Contender {
    pub name: &'static str,
    /// `None`: random search (not a session).
    pub config: Option<fn(usize, u64) -> SessionConfig>,
    /// The driver tells the session which windows a disturbance hit.
    pub signal: bool,
}

fn base_config(budget: usize, seed: u64) -> SessionConfig {
    SessionConfig {
        budget,
        warmup_cycles: 2,
        measured_cycles: 12,
        min_window_us: 0,
        seed,
        start: CollectiveKnobs::default(),
        ..SessionConfig::default()
    }
}

/// Round one's algorithm: Latin hypercube, global EI, plain likelihood,
/// whole-window score, the model's pick pinned unconfirmed.
pub fn round_one(budget: usize, seed: u64) -> SessionConfig {
    SessionConfig {
        exploration: Exploration::Global,
        robust: false,
        confirm_windows: 0,
        sub_windows: 1,
        repeat_start: false,
        ..base_config(budget, seed)
    }
}

/// Today's defaults, as the agent runs them (whole-window score).
pub fn today(budget: usize, seed: u64) -> SessionConfig {
    base_config(budget, seed)
}

/// Today's defaults with the self-tuning path's sub-window median.
pub fn today_sub_windows(budget: usize, seed: u64) -> SessionConfig {
    SessionConfig {
        sub_windows: 3,
        ..base_config(budget, seed)
    }
}

/// Runs one session (or random search) of `budget` samples.
pub fn run(
    landscape: &Landscape,
    contender: &Contender,
    budget: usize,
    seed: u64,
    optimum: f64,
) -> Outcome {
    let start = CollectiveKnobs::default();
    let truth = landscape.truth;
    let mut job = Job::new(landscape, start, seed);
    let mut measured: Vec<f64> = Vec::new();
    let Some(make) = contender.config else {
        return random_search(&mut job, budget, seed, optimum);
    };
    let config = make(budget, seed);
    let mut session = TuningSession::new(config).expect("benchmark configuration is valid");
    let mut hit_in_window = false;
    // RINGWATCH_BENCH_TRACE="<landscape>/<contender>/<seed>/<budget>" prints
    // that session's windows.
    let trace = std::env::var("RINGWATCH_BENCH_TRACE")
        .is_ok_and(|t| t == format!("{}/{}/{seed}/{budget}", landscape.name, contender.name));
    loop {
        match session.next_step() {
            Step::Done => break,
            Step::Apply(k) => {
                let first = job.apply(k);
                session.applied(first).expect("applying in Apply");
                hit_in_window = false;
            }
            Step::Measure => {
                let (c, hit) = job.next_cycle();
                hit_in_window |= hit;
                if let Some(w) = session.observe_cycle(&c) {
                    measured.push(truth(&job.knobs));
                    if trace {
                        eprintln!(
                            "{:>3} {:>10.0} KiB {:>6.2} ms hier {:5} | true {:5.1}% measured {:5.1}% | disturbed {}",
                            measured.len(),
                            job.knobs.fusion_threshold_bytes as f64 / 1024.0,
                            job.knobs.cycle_time_ms,
                            job.knobs.hierarchical_allreduce,
                            100.0 * truth(&job.knobs) / optimum,
                            100.0 * w.score / 1e9 / optimum,
                            hit_in_window
                        );
                    }
                    let signal = (contender.signal && hit_in_window)
                        .then(|| "disturbance episode".to_owned());
                    hit_in_window = false;
                    let verdict = session
                        .judge(&w, signal, job.now_us as f64 / 1e6)
                        .expect("judging the window just returned");
                    if matches!(verdict, Verdict::Remeasure | Verdict::Repeat) {
                        job.window_factor = (1.0 + WINDOW_SD * normal(&mut job.rng)).max(0.5);
                    }
                }
            }
        }
    }
    let pinned = session.best().map_or(start, |b| b.knobs);
    if trace {
        eprintln!(
            "pinned {pinned:?} ({:.1}%); confirmation kept {:?}; low outliers {:?}",
            100.0 * truth(&pinned) / optimum,
            session.confirmation().and_then(|c| c.kept),
            session.low_outliers()
        );
    }
    Outcome {
        session_mean: 100.0 * measured.iter().sum::<f64>() / measured.len().max(1) as f64 / optimum,
        pick: 100.0 * truth(&pinned) / optimum,
        worse_than_start: truth(&pinned) < truth(&start),
        windows: measured.len(),
    }
}

/// Random search through the same job: the start, then uniform points, each
/// scored by one window's overall rate; pins its best measurement.
fn random_search(job: &mut Job, budget: usize, seed: u64, optimum: f64) -> Outcome {
    let space = Space::collective();
    let mut rng = ChaCha8Rng::seed_from_u64(seed ^ 0x5eed_5eed);
    let truth = job.truth;
    let start = job.knobs;
    let mut measured = Vec::new();
    let mut best: Option<(f64, CollectiveKnobs)> = None;
    for n in 0..budget {
        let knobs = if n == 0 {
            start
        } else {
            let u: Vec<f64> = (0..space.encoded_len()).map(|_| rng.random()).collect();
            CollectiveKnobs::from_point(&space.decode(&u)).expect("decoded points are in the space")
        };
        job.apply(knobs);
        for _ in 0..2 {
            job.next_cycle();
        }
        let (first, _) = job.next_cycle();
        let mut bytes = 0;
        let mut last = first;
        for _ in 0..12 {
            bytes += last.bytes_reduced;
            last = job.next_cycle().0;
        }
        let score = bytes as f64 / ((last.start_unix_us - first.start_unix_us) as f64 / 1e6);
        measured.push(truth(&knobs));
        if best.is_none_or(|b| score > b.0) {
            best = Some((score, knobs));
        }
    }
    let pinned = best.map_or(start, |b| b.1);
    Outcome {
        session_mean: 100.0 * measured.iter().sum::<f64>() / measured.len().max(1) as f64 / optimum,
        pick: 100.0 * truth(&pinned) / optimum,
        worse_than_start: truth(&pinned) < truth(&start),
        windows: measured.len(),
    }
}
