//! `cargo xtask bench tuning-session`: how good is a self-tuned job? On the
//! same pretend-node topology as the tuning grid (2 nodes × 2 ranks, rate-
//! limited inter-node links), it runs S self-tuning sessions of at most
//! `--budget` samples (`RINGWATCH_AUTOTUNE=1`, no agent, seeds 0..S), then
//! measures in the same run, interleaved round by round, the steps/s of the
//! runtime defaults, of each session's chosen knobs and of the grid's best
//! knobs, the way the grid measures a point. Issue 7's goal: a session
//! reaches ≥ 95% of the grid best within 20 samples. Issue 13's: what the
//! job ran at while it was tuned (collbench's steps/s over every step up to
//! the pin) as a fraction of the grid best.
//!
//! It measures and reports; it never decides anything from hard-coded
//! numbers and never edits the grid's results.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

use crate::multinode::{self, Job, Knobs, Resnet50Result};
use crate::topology::Topology;
use crate::tuning_grid;

/// The tuning-session bench's flags (it also uses the grid's `--rate-mbit`,
/// `--steps`, `--warmup`, `--repeats` and, to compute a missing grid,
/// `--quick`).
#[derive(Debug, Clone, clap::Args)]
#[group(id = "tuning_session")]
pub struct Args {
    /// tuning-session: self-tuning sessions to run (seeds 0..N).
    #[arg(long, default_value_t = 3)]
    pub seeds: u64,
    /// tuning-session: samples per session (RINGWATCH_AUTOTUNE_BUDGET).
    #[arg(long, default_value_t = 20)]
    pub budget: usize,
    /// tuning-session: cycles skipped after each knob change
    /// (RINGWATCH_AUTOTUNE_WARMUP_CYCLES).
    #[arg(long, default_value_t = 3)]
    pub session_warmup_cycles: u64,
    /// tuning-session: cycles with work per sample window, at least
    /// (RINGWATCH_AUTOTUNE_MEASURED_CYCLES).
    #[arg(long, default_value_t = 10)]
    pub session_measured_cycles: u64,
    /// tuning-session: time a sample window spans, at least, in ms
    /// (RINGWATCH_AUTOTUNE_MIN_WINDOW_MS).
    #[arg(long, default_value_t = 1000)]
    pub session_min_window_ms: u64,
    /// tuning-session: timed steps after tuning, on the pinned knobs, in the
    /// self-tuned job itself (its own before/after numbers).
    #[arg(long, default_value_t = 5)]
    pub tail_steps: usize,
    /// tuning-session: the grid's best knobs as FUSION_BYTES,CYCLE_MS,HIER
    /// (e.g. 16777216,0.5,true) instead of reading --grid-json.
    #[arg(long, value_parser = parse_knobs)]
    pub grid_best: Option<Knobs>,
    /// tuning-session: the grid's results (`cargo xtask bench tuning-grid`);
    /// when missing, a --quick grid is run first and written there.
    #[arg(long, default_value = "target/bench/tuning-grid.json")]
    pub grid_json: PathBuf,
    /// tuning-session: where to write the results as JSON (the sessions'
    /// reports go beside it).
    #[arg(long, default_value = "target/bench/tuning-session.json")]
    pub session_out: PathBuf,
}

fn parse_knobs(s: &str) -> std::result::Result<Knobs, String> {
    let parts: Vec<&str> = s.split(',').map(str::trim).collect();
    let [f, c, h] = parts.as_slice() else {
        return Err(format!(
            "{s:?}: want FUSION_BYTES,CYCLE_MS,HIER (e.g. 16777216,0.5,true)"
        ));
    };
    Ok(Knobs {
        fusion_threshold_bytes: f
            .parse()
            .map_err(|_| format!("{f:?} is not a number of bytes"))?,
        cycle_time_ms: c
            .parse()
            .map_err(|_| format!("{c:?} is not milliseconds"))?,
        hierarchical_allreduce: h
            .parse()
            .map_err(|_| format!("{h:?} is not true or false"))?,
    })
}

/// What one self-tuned job reported (`collbench --json resnet50 --until-tuned`).
#[derive(Debug, Clone, Serialize)]
struct Session {
    seed: u64,
    chosen: Knobs,
    samples: usize,
    session_wall_s: f64,
    /// The job's own steps/s on its starting knobs (the first steps) and on
    /// the pinned knobs (the last steps), as collbench measured them.
    in_job_first_steps_per_sec: Option<f64>,
    in_job_last_steps_per_sec: Option<f64>,
    /// The job's steps/s over every step it ran while being tuned (up to the
    /// pin): what tuning cost it.
    during_tuning_steps_per_sec: Option<f64>,
    /// That over the grid best's steps/s (measured later in this run).
    during_tuning_of_grid_best: Option<f64>,
    report_csv: Option<String>,
    job_wall_s: f64,
}

/// One measured configuration.
#[derive(Debug, Clone, Serialize)]
struct Measured {
    name: String,
    knobs: Option<Knobs>,
    /// Median steps/s over `samples`.
    steps_per_sec: f64,
    samples: Vec<f64>,
    ratio_to_grid_best: f64,
    ratio_to_defaults: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    what: &'static str,
    nodes: usize,
    ranks_per_node: usize,
    rate_mbit: u32,
    budget: usize,
    session_warmup_cycles: u64,
    session_measured_cycles: u64,
    session_min_window_ms: u64,
    steps: usize,
    warmup: usize,
    repeats: usize,
    statistic: &'static str,
    grid_best_from: String,
    sessions: Vec<Session>,
    defaults: Measured,
    grid_best: Measured,
    chosen: Vec<Measured>,
    goal: &'static str,
    sessions_meeting_goal: usize,
    wall_seconds: f64,
}

fn median(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The grid's best knobs: from the flag, else from the grid's JSON (same
/// rate only), else from a quick grid run now.
fn grid_best(root: &Path, args: &Args, grid: &tuning_grid::Args) -> Result<(Knobs, String)> {
    if let Some(k) = args.grid_best {
        return Ok((k, "--grid-best".into()));
    }
    let path = if args.grid_json.is_absolute() {
        args.grid_json.clone()
    } else {
        root.join(&args.grid_json)
    };
    if path.is_file() {
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        let json: serde_json::Value = serde_json::from_str(&text)
            .with_context(|| format!("{} is not JSON", path.display()))?;
        let rate = json.get("rate_mbit").and_then(serde_json::Value::as_u64);
        if rate == Some(u64::from(grid.rate_mbit)) {
            let knobs = json
                .pointer("/best/knobs")
                .cloned()
                .with_context(|| format!("{} has no best.knobs", path.display()))?;
            let knobs: Knobs = serde_json::from_value(knobs)
                .with_context(|| format!("{}: best.knobs", path.display()))?;
            return Ok((knobs, path.display().to_string()));
        }
        println!(
            "# {} was measured at {rate:?} Mbit/s, not {}: running a quick grid",
            path.display(),
            grid.rate_mbit
        );
    } else {
        println!(
            "# no {}: running a quick grid first (or pass --grid-best)",
            path.display()
        );
    }
    let mut quick = grid.clone();
    quick.quick = true;
    quick.out = path.clone();
    tuning_grid::run(root, &quick)?;
    grid_best(root, args, grid)
}

fn session(
    topology: &Topology,
    collbench: &Path,
    args: &Args,
    seed: u64,
    log: &Path,
) -> Result<Session> {
    let started = Instant::now();
    let env: Vec<(String, String)> = [
        ("RINGWATCH_CONTROL_SOCKET", "0".to_owned()),
        ("RINGWATCH_AUTOTUNE", "1".to_owned()),
        // No agent in this bench: waiting for one only delays the session.
        ("RINGWATCH_AUTOTUNE_WAIT_SECS", "0".to_owned()),
        ("RINGWATCH_AUTOTUNE_BUDGET", args.budget.to_string()),
        ("RINGWATCH_AUTOTUNE_SEED", seed.to_string()),
        (
            "RINGWATCH_AUTOTUNE_WARMUP_CYCLES",
            args.session_warmup_cycles.to_string(),
        ),
        (
            "RINGWATCH_AUTOTUNE_MEASURED_CYCLES",
            args.session_measured_cycles.to_string(),
        ),
        (
            "RINGWATCH_AUTOTUNE_MIN_WINDOW_MS",
            args.session_min_window_ms.to_string(),
        ),
        ("RINGWATCH_AUTOTUNE_LOG", log.display().to_string()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_owned(), v))
    .collect();
    // A sample is a window plus a few warm-up steps; be generous.
    let limit = 120 + args.budget as u64 * (10 + args.session_min_window_ms / 250);
    let job = Job {
        topology,
        placement: multinode::block_placement(topology.nodes(), 2),
        collbench: collbench.to_path_buf(),
        args: vec![
            "--json".into(),
            "resnet50".into(),
            "--until-tuned".into(),
            "--steps".into(),
            args.tail_steps.max(1).to_string(),
            "--warmup".into(),
            "1".into(),
            "--duration".into(),
            limit.to_string(),
        ],
        env,
        job_id: format!("tuning-session-{seed}"),
        timeout: Duration::from_secs(limit + 120),
    };
    let output = multinode::run(&job).with_context(|| format!("self-tuning session {seed}"))?;
    let line = output
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("session {seed}: rank 0 printed no JSON: {output:?}"))?;
    let v: serde_json::Value =
        serde_json::from_str(line).with_context(|| format!("session {seed}: {line:?}"))?;
    let tuned = v
        .get("self_tuning")
        .filter(|t| !t.is_null())
        .with_context(|| {
            format!(
                "session {seed} did not finish tuning within {limit} s (state {}); raise the \
                 limit or shrink the windows",
                v.get("autotune_state").unwrap_or(&serde_json::Value::Null)
            )
        })?;
    let best = tuned
        .get("best")
        .with_context(|| format!("session {seed}: no best knobs in {tuned}"))?;
    let field = |name: &str| best.get(name).cloned().unwrap_or_default();
    let chosen = Knobs {
        fusion_threshold_bytes: field("fusion_threshold_bytes").as_u64().unwrap_or(0),
        cycle_time_ms: field("cycle_time_us").as_f64().unwrap_or(f64::NAN) / 1000.0,
        hierarchical_allreduce: field("hierarchical_allreduce").as_bool().unwrap_or(false),
    };
    let f64_at = |p: &str| v.pointer(p).and_then(serde_json::Value::as_f64);
    Ok(Session {
        seed,
        chosen,
        samples: tuned.get("samples").and_then(|s| s.as_u64()).unwrap_or(0) as usize,
        session_wall_s: tuned
            .get("session_wall_s")
            .and_then(|s| s.as_f64())
            .unwrap_or(f64::NAN),
        in_job_first_steps_per_sec: f64_at("/first/steps_per_sec"),
        in_job_last_steps_per_sec: f64_at("/last/steps_per_sec"),
        during_tuning_steps_per_sec: f64_at("/during_tuning/steps_per_sec"),
        during_tuning_of_grid_best: None,
        report_csv: tuned
            .get("report")
            .and_then(|r| r.as_str())
            .map(str::to_owned),
        job_wall_s: started.elapsed().as_secs_f64(),
    })
}

fn describe(k: &Option<Knobs>) -> String {
    match k {
        None => "defaults".into(),
        Some(k) => {
            let fusion = match k.fusion_threshold_bytes {
                0 => "off".to_owned(),
                b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
                b => format!("{:.0} KiB", b as f64 / 1024.0),
            };
            format!(
                "{fusion} / {:.2} ms / {}",
                k.cycle_time_ms,
                if k.hierarchical_allreduce {
                    "hier"
                } else {
                    "ring"
                }
            )
        }
    }
}

/// Runs the bench (see the module doc).
pub fn run(root: &Path, args: &Args, grid: &tuning_grid::Args) -> Result<()> {
    let started = Instant::now();
    if args.seeds == 0 || args.budget == 0 {
        bail!("--seeds and --budget must be at least 1");
    }
    let (best_knobs, grid_best_from) = grid_best(root, args, grid)?;
    let collbench = multinode::collbench(root)?;
    let out = crate::under_root(root, &args.session_out);
    let dir = out
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let (nodes, ranks_per_node) = (2, 2);
    let topology = Topology::create("rwsess", nodes, grid.rate_mbit)?;
    println!(
        "# pretend nodes: {nodes} × {ranks_per_node} ranks, inter-node limit {} Mbit/s; grid best \
         {} (from {grid_best_from})",
        grid.rate_mbit,
        describe(&Some(best_knobs))
    );
    println!(
        "# {} self-tuning session(s): budget {}, windows ≥ {} cycles and ≥ {} ms, {} warm-up cycles",
        args.seeds,
        args.budget,
        args.session_measured_cycles,
        args.session_min_window_ms,
        args.session_warmup_cycles
    );
    let mut sessions = Vec::new();
    for seed in 0..args.seeds {
        let log = dir.join(format!("tuning-session-seed{seed}.csv"));
        let s = session(&topology, &collbench, args, seed, &log)?;
        println!(
            "session seed {seed}: {} samples in {:.1} s -> {}; in-job steps/s first {:.3}, \
             while tuned {:.3}, last {:.3}",
            s.samples,
            s.session_wall_s,
            describe(&Some(s.chosen)),
            s.in_job_first_steps_per_sec.unwrap_or(f64::NAN),
            s.during_tuning_steps_per_sec.unwrap_or(f64::NAN),
            s.in_job_last_steps_per_sec.unwrap_or(f64::NAN)
        );
        sessions.push(s);
    }

    // Every configuration, measured the grid's way, round by round so that a
    // slow spell of the machine hits all of them alike.
    let spec = multinode::Resnet50 {
        ranks_per_node,
        steps: grid.steps,
        warmup: grid.warmup,
        env: vec![("RINGWATCH_CONTROL_SOCKET".into(), "0".into())],
    };
    let mut configs: Vec<(String, Option<Knobs>)> = vec![
        ("defaults".into(), None),
        ("grid best".into(), Some(best_knobs)),
    ];
    configs.extend(
        sessions
            .iter()
            .map(|s| (format!("session seed {}", s.seed), Some(s.chosen))),
    );
    let mut samples: Vec<Vec<f64>> = vec![Vec::new(); configs.len()];
    let repeats = grid.repeats.max(1);
    println!(
        "# measuring {} configurations × {repeats} rounds of resnet50 --steps {} --warmup {}",
        configs.len(),
        grid.steps,
        grid.warmup
    );
    let mut counter = 0;
    for _ in 0..repeats {
        for (i, (_, knobs)) in configs.iter().enumerate() {
            counter += 1;
            let r: Resnet50Result = multinode::resnet50(
                &topology,
                &collbench,
                &spec,
                *knobs,
                &format!("tuning-session-measure-{counter}"),
            )?;
            samples[i].push(r.steps_per_sec);
        }
    }
    drop(topology);
    let medians: Vec<f64> = samples.iter().map(|s| median(s)).collect();
    let (defaults_sps, best_sps) = (medians[0], medians[1]);
    for s in &mut sessions {
        s.during_tuning_of_grid_best = s.during_tuning_steps_per_sec.map(|d| d / best_sps);
    }
    let measured: Vec<Measured> = configs
        .iter()
        .zip(samples)
        .zip(&medians)
        .map(|(((name, knobs), samples), &m)| Measured {
            name: name.clone(),
            knobs: *knobs,
            steps_per_sec: m,
            samples,
            ratio_to_grid_best: m / best_sps,
            ratio_to_defaults: m / defaults_sps,
        })
        .collect();
    println!(
        "{:<16} {:<28} {:>8} {:>9} {:>9} {:>8} {:>8}  samples",
        "config", "knobs", "steps/s", "/grid", "/default", "tuned_n", "tune_s"
    );
    for (i, m) in measured.iter().enumerate() {
        let (n, wall) = match i.checked_sub(2).and_then(|j| sessions.get(j)) {
            Some(s) => (s.samples.to_string(), format!("{:.1}", s.session_wall_s)),
            None => ("-".into(), "-".into()),
        };
        let samples: Vec<String> = m.samples.iter().map(|s| format!("{s:.2}")).collect();
        println!(
            "{:<16} {:<28} {:>8.3} {:>9.3} {:>9.3} {:>8} {:>8}  [{}]",
            m.name,
            describe(&m.knobs),
            m.steps_per_sec,
            m.ratio_to_grid_best,
            m.ratio_to_defaults,
            n,
            wall,
            samples.join(" ")
        );
    }
    let mut measured = measured.into_iter();
    let defaults = measured.next().context("defaults were measured")?;
    let grid_best = measured.next().context("the grid best was measured")?;
    let chosen: Vec<Measured> = measured.collect();
    let meeting = chosen
        .iter()
        .filter(|m| m.ratio_to_grid_best >= 0.95)
        .count();
    println!(
        "# {meeting} of {} session(s) reach ≥ 95% of the grid best's steps/s",
        chosen.len()
    );
    for s in &sessions {
        println!(
            "# session seed {}: while tuned the job ran at {:.3} steps/s = {:.1}% of the grid best; \
             its pick: {:.1}%",
            s.seed,
            s.during_tuning_steps_per_sec.unwrap_or(f64::NAN),
            100.0 * s.during_tuning_of_grid_best.unwrap_or(f64::NAN),
            100.0
                * chosen
                    .iter()
                    .find(|m| m.knobs == Some(s.chosen))
                    .map_or(f64::NAN, |m| m.ratio_to_grid_best)
        );
    }
    let report = Report {
        what: "self-tuning sessions (RINGWATCH_AUTOTUNE=1, no agent) of collbench resnet50 on pretend nodes, vs the runtime defaults and the grid's best knobs",
        nodes,
        ranks_per_node,
        rate_mbit: grid.rate_mbit,
        budget: args.budget,
        session_warmup_cycles: args.session_warmup_cycles,
        session_measured_cycles: args.session_measured_cycles,
        session_min_window_ms: args.session_min_window_ms,
        steps: grid.steps,
        warmup: grid.warmup,
        repeats,
        statistic: "steps_per_sec is the median of samples; each sample is one fresh job's mean over its timed steps, configurations interleaved round by round",
        grid_best_from,
        sessions,
        defaults,
        grid_best,
        chosen,
        goal: "a session's chosen knobs reach >= 95% of the grid best's steps/s within 20 samples (issue 7)",
        sessions_meeting_goal: meeting,
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    crate::write_json_report(&out, &report, started)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grid_best_flag_parses_and_names_bad_parts() {
        assert_eq!(
            parse_knobs("16777216, 0.5, true").unwrap(),
            Knobs {
                fusion_threshold_bytes: 16 << 20,
                cycle_time_ms: 0.5,
                hierarchical_allreduce: true
            }
        );
        assert!(parse_knobs("1,2").unwrap_err().contains("FUSION_BYTES"));
        assert!(parse_knobs("x,0.5,true").unwrap_err().contains("\"x\""));
        assert!(parse_knobs("1,0.5,maybe").unwrap_err().contains("maybe"));
    }

    #[test]
    fn median_is_the_middle() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[1.0, 2.0]), 1.5);
        assert!(median(&[]).is_nan());
    }
}
