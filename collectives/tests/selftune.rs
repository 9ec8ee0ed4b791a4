//! Self-tuning without an agent: a 2 nodes × 2 ranks job (threads over loopback TCP) with
//! autotune on and no claim tunes itself on rank 0 with a short budget, pins the session's
//! best knobs on every rank, writes the report, and every result stays bitwise correct
//! while the knobs change under it. Then: a job whose throughput changes after the pin
//! (once the watch learned the pinned knobs' usual rate, every step is stretched to five
//! times its usual length) is re-checked by a second session with its own report.
#![cfg(feature = "autotune")]
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

use collectives::control::{AutotuneState, ControlClient};
use collectives::knobs::AutotuneConfig;
use collectives::rendezvous::RendezvousConfig;
use collectives::runtime::{RuntimeConfig, SelfTuneOutcome};
use collectives::{Knobs, ReduceOp, Runtime, Tensor};

const WORLD: usize = 4;
const LOCAL: usize = 2;
const BUDGET: usize = 4;

/// Tensor sizes of one step: small and large, so that fusion and the algorithm matter.
const SIZES: [usize; 8] = [1, 7, 1000, 4096, 33_333, 65_536, 100_000, 250_000];

/// Small integers, exact in f32 under any summation order: results compare bitwise.
fn value(rank: usize, step: usize, t: usize, i: usize) -> f32 {
    (((rank * 13 + step * 7 + t * 5 + i * 3) % 23) as i32 - 11) as f32
}

struct RankResult {
    knobs: Knobs,
    state: AutotuneState,
    outcome: Option<SelfTuneOutcome>,
    steps: usize,
    knob_sets_seen: usize,
}

/// With `slow_after_pin`, every rank sleeps between steps once the first session pinned
/// its knobs, and the run ends once a re-check's report is out.
fn run_rank(
    rank: usize,
    port: u16,
    dir: std::path::PathBuf,
    log: std::path::PathBuf,
    slow_after_pin: bool,
) -> RankResult {
    let mut c = RuntimeConfig::new(RendezvousConfig {
        rank,
        world_size: WORLD,
        local_rank: rank % LOCAL,
        local_size: LOCAL,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_id: Some(format!("selftune-{port}")),
        connect_timeout: Duration::from_secs(20),
        host: None,
    });
    c.timeout = Duration::from_secs(30);
    // The re-check runs without a control socket: rank 0 then computes its per-cycle
    // statistics only for its own tuning and watch.
    c.control_socket = !slow_after_pin;
    c.runtime_dir = Some(dir);
    c.autotune = Some(AutotuneConfig {
        wait: Duration::from_millis(300), // `wait` below
        budget: BUDGET,
        warmup_cycles: 1,
        measured_cycles: 3,
        min_window: Duration::from_millis(60),
        seed: 3,
        log: Some(log),
        watch: slow_after_pin,
    });
    let wait = Duration::from_millis(300);
    let created = Instant::now();
    let rt = Runtime::new(c).unwrap();
    if rank == 0 && !slow_after_pin {
        // Before the wait is over, an agent would be welcome (a loaded
        // machine may only get here after it: then it tunes itself).
        let path = rt.control_socket_path().unwrap();
        let client = ControlClient::connect(path, Duration::from_secs(5)).unwrap();
        let state = client.hello().autotune;
        assert!(
            state == AutotuneState::Waiting
                || (state == AutotuneState::SelfTuning && created.elapsed() >= wait),
            "{state:?} {:?} after the runtime was asked for",
            created.elapsed()
        );
    }
    let mut seen: Vec<Knobs> = Vec::new();
    // A hang guard, not a bound on speed: the re-check's path is a fixed number of windows.
    let deadline = Instant::now() + Duration::from_secs(300);
    let mut step = 0;
    // Rank 0, after the pin: how long its steps took while the watch learned the pinned
    // knobs' usual rate.
    let mut pinned_steps: Vec<Duration> = Vec::new();
    // Every rank, once rank 0 said so: the slowed step's period.
    let mut slow_period: Option<Duration> = None;
    loop {
        let work_started = Instant::now();
        let handles: Vec<_> = SIZES
            .iter()
            .enumerate()
            .map(|(t, &n)| {
                let data: Vec<f32> = (0..n).map(|i| value(rank, step, t, i)).collect();
                rt.allreduce_async(&format!("s{t}"), Tensor::from_slice(&data), ReduceOp::Sum)
                    .unwrap()
            })
            .collect();
        for (t, h) in handles.into_iter().enumerate() {
            let got = h.wait().unwrap().to_vec::<f32>().unwrap();
            for (i, g) in got.iter().enumerate() {
                let want: f32 = (0..WORLD).map(|r| value(r, step, t, i)).sum();
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "step {step} tensor {t} element {i}"
                );
            }
        }
        let knobs = rt.knobs().0;
        if seen.last() != Some(&knobs) {
            seen.push(knobs);
        }
        // Rank 0 says where self-tuning is: 0 tuning (or pinned, the watch still learning
        // the pinned knobs' usual rate), 1 slow down to the period it sends, 2 over. Every
        // rank acts on the same step.
        let (phase, period_ms) = match rt.self_tune_outcome() {
            _ if rank != 0 => (0, 0),
            None => (0, 0),
            Some(_) if !slow_after_pin => (2, 0),
            Some(o) => {
                let rechecked = o
                    .report
                    .as_ref()
                    .is_some_and(|p| p.to_string_lossy().contains("recheck1"));
                if rechecked {
                    (2, 0)
                } else if let Some(p) = slow_period {
                    (1, p.as_millis() as i32)
                } else if rt
                    .self_tune_watch()
                    .is_some_and(|w| w.usual_bytes_per_s.is_some())
                {
                    // The usual rate is learned from these steps: from now on every step
                    // takes five times their median, so the rate falls to at most a fifth
                    // of it however the machine's load moves (a faster machine only
                    // sleeps longer).
                    pinned_steps.sort();
                    let median = pinned_steps
                        .get(pinned_steps.len() / 2)
                        .copied()
                        .unwrap_or(Duration::from_millis(20));
                    let p = (5 * median).max(Duration::from_millis(60));
                    (1, p.as_millis() as i32)
                } else {
                    (0, 0)
                }
            }
        };
        let flag = rt
            .allreduce(
                &format!("done{step}"),
                Tensor::from_slice(&[phase, period_ms]),
                ReduceOp::Max,
            )
            .unwrap()
            .to_vec::<i32>()
            .unwrap();
        step += 1;
        match flag[0] {
            2 => break,
            1 => {
                let period = *slow_period.get_or_insert(Duration::from_millis(flag[1] as u64));
                std::thread::sleep(period.saturating_sub(work_started.elapsed()));
            }
            _ => {
                if rt.self_tune_watch().is_some() {
                    pinned_steps.push(work_started.elapsed());
                }
            }
        }
        assert!(
            Instant::now() < deadline,
            "self-tuning did not finish in time"
        );
    }
    let result = RankResult {
        knobs: rt.knobs().0,
        state: rt.autotune_state(),
        outcome: rt.self_tune_outcome(),
        steps: step,
        knob_sets_seen: seen.len(),
    };
    rt.shutdown();
    result
}

/// Runs the 4 ranks; returns their results, the runtime dir and the report's path.
fn run_job(
    name: &str,
    slow_after_pin: bool,
) -> (Vec<RankResult>, std::path::PathBuf, std::path::PathBuf) {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let dir = std::env::temp_dir().join(format!("rw-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("reports").join("autotune.csv");
    let (tx, rx) = mpsc::channel();
    let shared = Arc::new((dir.clone(), log.clone()));
    for rank in 0..WORLD {
        let (tx, shared) = (tx.clone(), shared.clone());
        std::thread::spawn(move || {
            let r = run_rank(
                rank,
                port,
                shared.0.clone(),
                shared.1.clone(),
                slow_after_pin,
            );
            tx.send((rank, r)).unwrap();
        });
    }
    let mut results: Vec<Option<RankResult>> = (0..WORLD).map(|_| None).collect();
    for _ in 0..WORLD {
        let (rank, r) = rx
            .recv_timeout(Duration::from_secs(360))
            .expect("a rank hung or panicked");
        results[rank] = Some(r);
    }
    (results.into_iter().map(Option::unwrap).collect(), dir, log)
}

#[test]
fn a_job_nobody_claims_tunes_itself_pins_the_best_and_writes_the_report() {
    let (results, dir, log) = run_job("selftune", false);

    let outcome = results[0].outcome.clone().expect("rank 0 has the outcome");
    assert_eq!(results[0].state, AutotuneState::Done);
    assert_eq!(outcome.samples, BUDGET);
    assert_eq!(outcome.start, Knobs::default());
    // Every rank ends on the session's best knobs, and they all ran the same steps.
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(r.knobs, outcome.best, "rank {rank}");
        assert_eq!(r.steps, results[0].steps, "rank {rank}");
    }
    // The knobs really changed during the run (sample 1 on differs from the start).
    assert!(results[0].knob_sets_seen >= 2, "knobs never changed");

    // The report: CSV, Parquet and HTML beside each other, one row per sample, and the
    // row marked best carries the pinned knobs.
    let csv_path = outcome.report.clone().expect("the report was written");
    assert_eq!(csv_path, log);
    for ext in ["csv", "parquet", "html"] {
        let p = log.with_extension(ext);
        assert!(std::fs::metadata(&p).unwrap().len() > 0, "{}", p.display());
    }
    let csv = std::fs::read_to_string(&csv_path).unwrap();
    let mut lines = csv.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), BUDGET, "{csv}");
    let col = |name: &str| {
        header
            .iter()
            .position(|h| *h == name)
            .unwrap_or_else(|| panic!("no column {name} in {header:?}"))
    };
    let hier = col("hierarchical_allreduce");
    let (fusion, cycle, best) = (
        col("fusion_threshold_bytes"),
        col("cycle_time_ms"),
        col("chosen"),
    );
    let best_rows: Vec<&Vec<&str>> = rows.iter().filter(|r| r[best] == "true").collect();
    assert_eq!(best_rows.len(), 1, "{csv}");
    let f: f64 = best_rows[0][fusion].parse().unwrap();
    let c: f64 = best_rows[0][cycle].parse().unwrap();
    assert_eq!(
        f.round() as u64,
        outcome.best.fusion_threshold_bytes,
        "{csv}"
    );
    assert_eq!(
        best_rows[0][hier] == "true",
        outcome.best.hierarchical_allreduce,
        "{csv}"
    );
    assert_eq!(
        (c * 1000.0).round() as u64,
        outcome.best.cycle_time_us,
        "{csv}"
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_job_whose_throughput_changes_after_the_pin_is_rechecked() {
    let (results, dir, log) = run_job("recheck", true);
    let outcome = results[0].outcome.clone().expect("rank 0 has the outcome");
    assert_eq!(results[0].state, AutotuneState::Done);
    // The re-check's report is out, beside the first session's.
    let recheck = outcome
        .report
        .clone()
        .expect("the re-check's report was written");
    assert_eq!(recheck, log.with_file_name("autotune-recheck1.csv"));
    assert!(log.exists(), "the first session's report stays");
    let html = std::fs::read_to_string(recheck.with_extension("html")).unwrap();
    assert!(html.contains("Why this session"), "{html}");
    assert!(html.contains("moved from"), "{html}");
    assert!(
        html.contains("Re-check of the knobs pinned before"),
        "{html}"
    );
    // Sample 0 of the re-check is the job's start, sample 1 the knobs pinned before.
    let csv = std::fs::read_to_string(&recheck).unwrap();
    assert!(csv.lines().count() >= 3, "{csv}");
    assert_eq!(outcome.start, Knobs::default());
    // Every rank ends on the re-check's knobs, on the same step; every result was
    // checked bitwise along the way.
    for (rank, r) in results.iter().enumerate() {
        assert_eq!(r.knobs, outcome.best, "rank {rank}");
        assert_eq!(r.steps, results[0].steps, "rank {rank}");
    }
    std::fs::remove_dir_all(&dir).ok();
}
