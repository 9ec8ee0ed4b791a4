//! `cargo xtask bench tuning-grid`: the exhaustive grid over the tuner's
//! collective knob space, measured with `collbench resnet50` on 2 pretend
//! nodes × 2 ranks whose inter-node links are rate-limited. Its best point
//! is what a tuning session is judged against (issue 7: ≥ 95% of it in at
//! most 20 samples), and its default-knobs row is the baseline of the
//! speedup a tuning report shows.
//!
//! It measures; it never decides anything from hard-coded numbers.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use serde::Serialize;

use crate::multinode::{self, Knobs, Resnet50Result};
use crate::topology::Topology;

/// The bounds of the tuner's collective space (`tuner::space`): the cycle
/// time is searched in [0.5, 50] ms on a log scale; the fusion threshold on a
/// log scale whose bottom means "off". The grid stays within them (a unit
/// test reads tuner/src/space.rs to check the cycle bounds still agree).
pub const CYCLE_TIME_MIN_MS: f64 = 0.5;
/// See [`CYCLE_TIME_MIN_MS`].
pub const CYCLE_TIME_MAX_MS: f64 = 50.0;

/// Default inter-node rate of the pretend nodes (Mbit/s each direction).
/// Measured on the 2-core machine with shared memory inside a node (quick
/// grids, 2026-11-24; README "Pretend nodes and the tuning grid"): at 4000
/// the best point is 1.20–1.25x the runtime defaults; at 3000 and 2000
/// 1.41x (hierarchical allreduce, with fusion and cycle time moving it by up
/// to 20%); at 1000 1.43x and only hierarchical matters. The demo uses 3000
/// (`demo::DEMO_RATE_MBIT`).
pub const DEFAULT_RATE_MBIT: u32 = 4000;

/// The tuning-grid's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// tuning-grid: a coarse grid (4 fusion × 3 cycle × 2 hierarchical = 24
    /// points) instead of the full one (8 × 5 × 2 = 80).
    #[arg(long)]
    pub quick: bool,
    /// tuning-grid: inter-node bandwidth of the pretend nodes, Mbit/s.
    #[arg(long, default_value_t = DEFAULT_RATE_MBIT)]
    pub rate_mbit: u32,
    /// tuning-grid: timed resnet50 steps per measurement.
    #[arg(long, default_value_t = 5)]
    pub steps: usize,
    /// tuning-grid: untimed warm-up steps per measurement.
    #[arg(long, default_value_t = 1)]
    pub warmup: usize,
    /// tuning-grid: measurements of every grid point (the table shows the median).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// tuning-grid: the best this many points, and the defaults, are measured
    /// `--confirm-repeats` more times and ranked by the median of all their
    /// measurements, so that one lucky sample does not make the best point.
    #[arg(long, default_value_t = 5)]
    pub confirm_top: usize,
    /// tuning-grid: extra measurements of each confirmed point.
    #[arg(long, default_value_t = 2)]
    pub confirm_repeats: usize,
    /// tuning-grid: where to write the table as JSON.
    #[arg(long, default_value = "target/bench/tuning-grid.json")]
    pub out: PathBuf,
}

const MIB: u64 = 1 << 20;

/// The fusion thresholds of the grid: off, then ×4 steps from 64 KiB to 256 MiB.
fn fusion_values(quick: bool) -> Vec<u64> {
    if quick {
        vec![0, 4 * MIB, 64 * MIB, 256 * MIB]
    } else {
        let mut values = vec![0];
        values.extend((0..8).map(|k| (64 << 10) << (2 * k)));
        values.retain(|&v| v <= 256 * MIB);
        values
    }
}

/// Cycle times log-spaced over the tuner's bounds, ends included.
fn cycle_values(quick: bool) -> Vec<f64> {
    let count = if quick { 3 } else { 5 };
    let ratio = CYCLE_TIME_MAX_MS / CYCLE_TIME_MIN_MS;
    (0..count)
        .map(|i| {
            let ms = CYCLE_TIME_MIN_MS * ratio.powf(i as f64 / (count - 1) as f64);
            // Three significant digits: what a person would type.
            let scale = 10f64.powi(2 - ms.log10().floor() as i32);
            (ms * scale).round() / scale
        })
        .collect()
}

/// Every point of the grid.
pub fn grid(quick: bool) -> Vec<Knobs> {
    let mut points = Vec::new();
    for hierarchical_allreduce in [false, true] {
        for &fusion_threshold_bytes in &fusion_values(quick) {
            for &cycle_time_ms in &cycle_values(quick) {
                points.push(Knobs {
                    fusion_threshold_bytes,
                    cycle_time_ms,
                    hierarchical_allreduce,
                });
            }
        }
    }
    points
}

/// One row of the table.
#[derive(Debug, Clone, Serialize)]
pub struct Row {
    /// The knobs (`None` in the defaults row: no knob was passed, the runtime
    /// chose; `runtime_knobs` says what it chose).
    pub knobs: Option<Knobs>,
    /// The knobs as the runtime reported them.
    pub runtime_knobs: serde_json::Value,
    /// Median steps/s over `samples`.
    pub steps_per_sec: f64,
    /// Every measurement, steps/s.
    pub samples: Vec<f64>,
    /// Median algorithm bandwidth (gradient bytes per step × steps/s), GB/s.
    pub algbw_gbps: f64,
    /// Median bus bandwidth, GB/s.
    pub busbw_gbps: f64,
}

/// The middle value (the mean of the two middle ones for an even count);
/// NaN for none.
pub(crate) fn median(values: &[f64]) -> f64 {
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    if n == 0 {
        return f64::NAN;
    }
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

struct Measurements {
    knobs: Option<Knobs>,
    results: Vec<Resnet50Result>,
}

impl Measurements {
    fn row(&self) -> Row {
        let pick =
            |f: fn(&Resnet50Result) -> f64| median(&self.results.iter().map(f).collect::<Vec<_>>());
        Row {
            knobs: self.knobs,
            runtime_knobs: self
                .results
                .first()
                .map(|r| r.knobs.clone())
                .unwrap_or_default(),
            steps_per_sec: pick(|r| r.steps_per_sec),
            samples: self.results.iter().map(|r| r.steps_per_sec).collect(),
            algbw_gbps: pick(|r| r.algbw_gbps),
            busbw_gbps: pick(|r| r.busbw_gbps),
        }
    }
}

/// The JSON the bench writes.
#[derive(Debug, Serialize)]
struct Report {
    what: &'static str,
    nodes: usize,
    ranks_per_node: usize,
    rate_mbit: u32,
    steps: usize,
    warmup: usize,
    repeats: usize,
    confirm_top: usize,
    confirm_repeats: usize,
    statistic: &'static str,
    inter_node_link_gbps: f64,
    intra_node_link_gbps: f64,
    wall_seconds: f64,
    rows: Vec<Row>,
    best: Row,
    defaults: Row,
    best_over_defaults: f64,
}

fn describe(knobs: &Option<Knobs>) -> (String, String, String) {
    match knobs {
        Some(k) => (
            if k.fusion_threshold_bytes == 0 {
                "off".to_owned()
            } else if k.fusion_threshold_bytes >= MIB {
                format!("{} MiB", k.fusion_threshold_bytes / MIB)
            } else {
                format!("{} KiB", k.fusion_threshold_bytes >> 10)
            },
            format!("{}", k.cycle_time_ms),
            if k.hierarchical_allreduce {
                "on"
            } else {
                "off"
            }
            .to_owned(),
        ),
        None => ("default".into(), "default".into(), "default".into()),
    }
}

fn print_row(row: &Row) {
    let (fusion, cycle, hier) = describe(&row.knobs);
    let samples: Vec<String> = row.samples.iter().map(|s| format!("{s:.2}")).collect();
    println!(
        "{fusion:>10} {cycle:>8} {hier:>5} {:>9.3} {:>9.3} {:>9.3}  [{}]",
        row.steps_per_sec,
        row.algbw_gbps,
        row.busbw_gbps,
        samples.join(" ")
    );
}

fn print_header() {
    println!(
        "{:>10} {:>8} {:>5} {:>9} {:>9} {:>9}  samples",
        "fusion", "cycle_ms", "hier", "steps/s", "algbw", "busbw"
    );
}

/// Runs the bench: builds collbench, makes the pretend nodes, measures the
/// links, the grid, and the defaults, prints the table and writes the JSON.
pub fn run(root: &std::path::Path, args: &Args) -> Result<()> {
    let started = Instant::now();
    let collbench = multinode::collbench(root)?;
    let (nodes, ranks_per_node) = (2, 2);
    let topology = Topology::create("rwgrid", nodes, args.rate_mbit)?;
    let (inter, _) = multinode::link(&topology, &collbench, (0, 1), "256M")
        .context("measuring the inter-node link")?;
    let (intra, _) = multinode::link(&topology, &collbench, (0, 0), "1G")
        .context("measuring the intra-node loopback")?;
    println!(
        "# pretend nodes: {nodes} × {ranks_per_node} ranks, inter-node limit {} Mbit/s = {:.3} GB/s",
        topology.rate_mbit(),
        topology.rate_mbit() as f64 / 8000.0
    );
    println!(
        "# plain TCP one way: inter-node {inter:.3} GB/s, intra-node (loopback) {intra:.3} GB/s"
    );
    // No control socket: nothing tunes these jobs, and the bench should not
    // pay for or be disturbed by one.
    let spec = multinode::Resnet50 {
        ranks_per_node,
        steps: args.steps,
        warmup: args.warmup,
        env: vec![("RINGWATCH_CONTROL_SOCKET".into(), "0".into())],
    };
    let points = grid(args.quick);
    let mut counter = 0usize;
    let mut measure = |knobs: Option<Knobs>| -> Result<Resnet50Result> {
        counter += 1;
        multinode::resnet50(
            &topology,
            &collbench,
            &spec,
            knobs,
            &format!("tuning-grid-{counter}"),
        )
    };
    println!(
        "# {} points × {} measurement(s) of collbench resnet50 --steps {} --warmup {}",
        points.len(),
        args.repeats.max(1),
        args.steps,
        args.warmup
    );
    print_header();
    let mut all: Vec<Measurements> = Vec::new();
    let mut defaults = Measurements {
        knobs: None,
        results: Vec::new(),
    };
    for _ in 0..args.repeats.max(1) {
        defaults.results.push(measure(None)?);
    }
    print_row(&defaults.row());
    for knobs in points {
        let mut m = Measurements {
            knobs: Some(knobs),
            results: Vec::new(),
        };
        for _ in 0..args.repeats.max(1) {
            m.results.push(measure(Some(knobs))?);
        }
        print_row(&m.row());
        all.push(m);
    }
    if args.confirm_top > 0 && args.confirm_repeats > 0 {
        let mut order: Vec<usize> = (0..all.len()).collect();
        order.sort_by(|&a, &b| {
            all[b]
                .row()
                .steps_per_sec
                .total_cmp(&all[a].row().steps_per_sec)
        });
        println!(
            "# confirming the best {} points and the defaults with {} more measurement(s) each",
            args.confirm_top, args.confirm_repeats
        );
        for _ in 0..args.confirm_repeats {
            defaults.results.push(measure(None)?);
            for &i in order.iter().take(args.confirm_top) {
                let knobs = all[i].knobs;
                all[i].results.push(measure(knobs)?);
            }
        }
        print_header();
        print_row(&defaults.row());
        for &i in order.iter().take(args.confirm_top) {
            print_row(&all[i].row());
        }
    }
    let rows: Vec<Row> = all.iter().map(Measurements::row).collect();
    let best = rows
        .iter()
        .max_by(|a, b| a.steps_per_sec.total_cmp(&b.steps_per_sec))
        .context("the grid is empty")?
        .clone();
    let defaults = defaults.row();
    let best_over_defaults = best.steps_per_sec / defaults.steps_per_sec;
    println!("# best (median steps/s):");
    print_row(&best);
    println!(
        "# runtime defaults {}: {:.3} steps/s; best/defaults = {best_over_defaults:.2}x",
        defaults.runtime_knobs, defaults.steps_per_sec
    );
    let report = Report {
        what: "collbench resnet50 on pretend nodes, exhaustive grid over the tuner's collective space",
        nodes,
        ranks_per_node,
        rate_mbit: args.rate_mbit,
        steps: args.steps,
        warmup: args.warmup,
        repeats: args.repeats.max(1),
        confirm_top: args.confirm_top,
        confirm_repeats: args.confirm_repeats,
        statistic: "steps_per_sec is the median of samples; each sample is one job's mean over its timed steps",
        inter_node_link_gbps: inter,
        intra_node_link_gbps: intra,
        wall_seconds: started.elapsed().as_secs_f64(),
        rows,
        best,
        defaults,
        best_over_defaults,
    };
    drop(topology);
    crate::write_json_report(&crate::under_root(root, &args.out), &report, started)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grids_cover_the_bounds_with_off_and_256_mib() {
        for quick in [true, false] {
            let f = fusion_values(quick);
            assert_eq!(f.first(), Some(&0));
            assert_eq!(f.last(), Some(&(256 * MIB)));
            let c = cycle_values(quick);
            assert_eq!(c.first(), Some(&CYCLE_TIME_MIN_MS));
            assert_eq!(c.last(), Some(&CYCLE_TIME_MAX_MS));
        }
        assert_eq!(grid(true).len(), 24);
        assert_eq!(grid(false).len(), 80);
        assert_eq!(cycle_values(false), vec![0.5, 1.58, 5.0, 15.8, 50.0]);
    }

    #[test]
    fn cycle_bounds_match_the_tuners_space() {
        let space = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tuner/src/space.rs"),
        )
        .expect("tuner/src/space.rs is in the workspace");
        assert!(space.contains("pub const CYCLE_TIME_MIN_MS: f64 = 0.5;"));
        assert!(space.contains("pub const CYCLE_TIME_MAX_MS: f64 = 50.0;"));
    }

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 2.0, 3.0]), 2.5);
    }
}
