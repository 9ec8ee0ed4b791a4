//! `cargo xtask bench timeline`: what `GET /api/timeline` costs on a live
//! 4-rank job, at full detail and at the viewer's level of detail.
//!
//! The release agent (`serve --jobs`) watches a `collbench -n 4 resnet50`
//! job until its live window (60 s) is full; then, in interleaved rounds,
//! each window (1 s, 10 s, 60 s) is asked for four ways, for the whole
//! node and for the job alone: as it was before the level of detail (no
//! parameters: every event, up to the server's limits), as the viewer asked
//! before (`downsample=true&max_events=100000`: the longest thread states),
//! at the level of detail (`width=1600`: summaries per pixel and track) and
//! as the viewer asks now (`width=1600&view=overview`: per process, its
//! threads and tensors merged into counters). Each answer's
//! status, events, bytes and time to the last byte; medians over the rounds
//! with the machine's load average beside them. Writes
//! target/bench/timeline.json.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use serde::Serialize;
use serde_json::Value;

use crate::hostile::{self, Agent, Group};

/// The agent's live window (`--timeline-window` default).
const WINDOW: Duration = Duration::from_secs(60);

/// One way of asking.
const MODES: [(&str, &str); 4] = [
    ("full", ""),
    ("downsample", "&downsample=true&max_events=100000"),
    ("width=1600", "&width=1600"),
    ("overview", "&width=1600&view=overview"),
];

/// One answer.
#[derive(Debug, Clone, Serialize)]
struct Answer {
    round: usize,
    window_s: u64,
    scope: &'static str,
    mode: &'static str,
    status: u16,
    events: usize,
    /// Slices in the range (from `metadata.detail`, when summarized).
    slices_in_range: Option<u64>,
    bytes: usize,
    ms: f64,
    load: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    command: String,
    answers: Vec<Answer>,
}

/// Runs it (root: the agent loads eBPF).
pub fn run(root: &Path, args: &hostile::Args, rounds: usize) -> Result<()> {
    let started = Instant::now();
    if !crate::is_root() {
        println!(
            "SKIPPED: bench timeline needs root (the agent loads eBPF): sudo -E cargo xtask bench timeline"
        );
        return Ok(());
    }
    crate::run(
        "cargo",
        &[
            "build",
            "--release",
            "-p",
            "agent",
            "-p",
            "collectives",
            "--bins",
        ],
    )?;
    let target = crate::cargo_target_dir(root);
    let bench = hostile::Bench {
        agent_bin: target.join("release/ringwatch-agent"),
        collbench_bin: target.join("release/collbench"),
        work: target.join("bench/timeline"),
        args: args.clone(),
    };
    std::fs::create_dir_all(&bench.work)
        .with_context(|| format!("creating {}", bench.work.display()))?;
    hostile::install_signal_cleanup()?;
    let agent = Agent::start(&bench, "timeline", &[])?;
    let job_secs = WINDOW.as_secs() + 40 + 30 * rounds as u64;
    let job = Group::spawn(
        "collbench -n 4 resnet50",
        Command::new(&bench.collbench_bin)
            .args(["-n", "4", "resnet50", "--duration", &job_secs.to_string()])
            .env("RINGWATCH_RUNTIME_DIR", &agent.runtime_dir)
            .env("RINGWATCH_JOB_ID", "busy")
            .stdout(Stdio::null())
            .stderr(hostile::file(&bench.work.join("job.log"))?),
    )?;
    let result = measure(&agent, rounds);
    drop(job);
    agent.stop();
    let answers = result?;
    print_table(&answers);
    let report = Report {
        command: std::env::args().collect::<Vec<_>>().join(" "),
        answers,
    };
    crate::write_json_report(&target.join("bench/timeline.json"), &report, started)
}

fn measure(agent: &Agent, rounds: usize) -> Result<Vec<Answer>> {
    agent.wait_for_job("busy", Duration::from_secs(90))?;
    let fill = WINDOW + Duration::from_secs(5);
    println!(
        "   job busy is watched; waiting {} s for the agent's live window to fill",
        fill.as_secs()
    );
    let waited = Instant::now();
    while waited.elapsed() < fill {
        std::thread::sleep(Duration::from_secs(10));
        println!(
            "   … {:.0} s of {} s",
            waited.elapsed().as_secs_f64(),
            fill.as_secs()
        );
    }
    let mut answers = Vec::new();
    for round in 1..=rounds {
        println!("   round {round} of {rounds}");
        for window_s in [1u64, 10, 60] {
            for (scope, filter) in [("node", ""), ("job", "&job=busy")] {
                for (mode, extra) in MODES {
                    let path = format!("/api/timeline?from=now-{window_s}s{filter}{extra}");
                    let load = load_average();
                    let asked = Instant::now();
                    let answer = hostile::http_get(agent.addr, &path, Duration::from_secs(120))
                        .with_context(|| format!("GET {path}"))?;
                    let ms = asked.elapsed().as_secs_f64() * 1e3;
                    let parsed: Value = serde_json::from_slice(&answer.body).unwrap_or(Value::Null);
                    let events = parsed["traceEvents"]
                        .as_array()
                        .map_or(0, |e| e.iter().filter(|e| e["ph"] != "M").count());
                    answers.push(Answer {
                        round,
                        window_s,
                        scope,
                        mode,
                        status: answer.status,
                        events,
                        slices_in_range: parsed["metadata"]["detail"]["slices_in_range"].as_u64(),
                        bytes: answer.body.len(),
                        ms,
                        load,
                    });
                }
            }
        }
    }
    Ok(answers)
}

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

fn print_table(answers: &[Answer]) {
    let mut groups: BTreeMap<(u64, &str, usize), Vec<&Answer>> = BTreeMap::new();
    for a in answers {
        let mode = MODES.iter().position(|(m, _)| *m == a.mode).unwrap_or(0);
        groups
            .entry((a.window_s, a.scope, mode))
            .or_default()
            .push(a);
    }
    println!();
    println!(
        "| window | scope | asked as | status | slices in range | events answered | bytes (median) | ms median (min–max) | load |"
    );
    println!("|---|---|---|---|---:|---:|---:|---:|---:|");
    for ((window_s, scope, mode), list) in groups {
        let statuses: Vec<String> = {
            let mut s: Vec<u16> = list.iter().map(|a| a.status).collect();
            s.dedup();
            s.iter().map(u16::to_string).collect()
        };
        let ms: Vec<f64> = list.iter().map(|a| a.ms).collect();
        let min = ms.iter().copied().fold(f64::INFINITY, f64::min);
        let max = ms.iter().copied().fold(0.0, f64::max);
        let in_range = list
            .iter()
            .find_map(|a| a.slices_in_range)
            .map_or("–".to_owned(), |n| n.to_string());
        println!(
            "| {window_s} s | {scope} | {} | {} | {in_range} | {:.0} | {:.2} MB | {:.0} ({min:.0}–{max:.0}) | {:.2} |",
            MODES[mode].0,
            statuses.join("/"),
            median(list.iter().map(|a| a.events as f64).collect()),
            median(list.iter().map(|a| a.bytes as f64).collect()) / 1e6,
            median(ms),
            median(list.iter().map(|a| a.load).collect()),
        );
    }
}
