//! `cargo xtask bench retune`: knobs chosen under one load must not be kept
//! under another (issue 13). A self-tuning `collbench resnet50` job (4
//! local ranks as 2 pretend hosts × 2, `RINGWATCH_AUTOTUNE=1`, no agent)
//! is tuned while CPU hogs run beside it; once it pins its knobs (its report
//! appears) the hogs stay `--hogs-linger-seconds` more (the watch learns the
//! pinned knobs' rate under load), then are killed, and the job keeps
//! running. Its watch should
//! see the throughput move, re-check the pinned knobs against the start and
//! tune again if they lost; the re-check writes `autotune-recheck1.*` with
//! the throughput since the pin. The bench prints what happened when, the
//! job's own log lines about it, and writes target/bench/retune.json.
//!
//! It reports what the job did; it asserts nothing about which knobs win.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::Serialize;

/// The retune bench's flags.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "retune")]
pub struct Args {
    /// retune: busy processes (`yes > /dev/null`) beside the job while it is
    /// first tuned.
    #[arg(long, default_value_t = 4)]
    pub hogs: usize,
    /// retune: seconds the hogs stay after the pin, so that the watch learns
    /// the pinned knobs' rate under load before the load goes.
    #[arg(long, default_value_t = 20)]
    pub hogs_linger_seconds: u64,
    /// retune: how long the job runs in all, seconds.
    #[arg(long, default_value_t = 360)]
    pub job_seconds: u64,
    /// retune: where to write the results (the job's reports and log go
    /// beside it, in retune/).
    #[arg(long, default_value = "target/bench/retune.json")]
    pub retune_out: PathBuf,
}

#[derive(Debug, Serialize)]
struct Report {
    what: &'static str,
    hogs: usize,
    job_seconds: u64,
    first_pin_after_s: Option<f64>,
    hogs_killed_after_s: Option<f64>,
    recheck_report_after_s: Option<f64>,
    first_report: String,
    recheck_report: Option<String>,
    job_log: String,
    /// The job's log lines about tuning, watching and re-checking.
    events: Vec<String>,
    final_json: Option<serde_json::Value>,
    wall_seconds: f64,
}

fn kill_all(children: &mut Vec<Child>) {
    for c in children.iter_mut() {
        let _ = c.kill();
        let _ = c.wait();
    }
    children.clear();
}

/// Runs the bench (see the module doc).
pub fn run(root: &Path, args: &Args) -> Result<()> {
    let started = Instant::now();
    crate::run(
        "cargo",
        &[
            "build",
            "--release",
            "-p",
            "collectives",
            "--bin",
            "collbench",
        ],
    )?;
    let collbench = crate::cargo_target_dir(root).join("release/collbench");
    let out = crate::under_root(root, &args.retune_out);
    let dir = out
        .parent()
        .map_or_else(|| PathBuf::from("retune"), |d| d.join("retune"));
    if dir.exists() {
        std::fs::remove_dir_all(&dir).with_context(|| format!("clearing {}", dir.display()))?;
    }
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let log = dir.join("autotune.csv");
    let recheck = dir.join("autotune-recheck1.csv");
    let job_log = dir.join("collbench.log");
    let stdout = dir.join("collbench.json");

    let mut hogs: Vec<Child> = (0..args.hogs)
        .map(|_| {
            Command::new("yes")
                .stdout(Stdio::null())
                .spawn()
                .context("starting a CPU hog (yes)")
        })
        .collect::<Result<_>>()?;
    println!(
        "# {} CPU hogs started; the job tunes itself beside them (log: {})",
        hogs.len(),
        job_log.display()
    );
    let mut job = Command::new(&collbench)
        .args([
            "-n",
            "4",
            "--local-size",
            "2",
            "--json",
            "resnet50",
            "--warmup",
            "1",
            "--duration",
            &args.job_seconds.to_string(),
        ])
        .env("RINGWATCH_AUTOTUNE", "1")
        .env("RINGWATCH_AUTOTUNE_WAIT_SECS", "0")
        .env("RINGWATCH_AUTOTUNE_LOG", &log)
        .env("RINGWATCH_CONTROL_SOCKET", "0")
        .env(
            "RUST_LOG",
            "collectives=info,collectives::runtime::selftune=debug",
        )
        .stdout(std::fs::File::create(&stdout).context("creating the job's stdout file")?)
        .stderr(std::fs::File::create(&job_log).context("creating the job's log file")?)
        .spawn()
        .with_context(|| format!("starting {}", collbench.display()))?;

    // Times are from the job's start (the build before it does not count).
    let job_started = Instant::now();
    let (mut pinned, mut killed, mut rechecked) = (None, None, None);
    let deadline = job_started + Duration::from_secs(args.job_seconds + 180);
    let status = loop {
        if let Some(status) = job.try_wait().context("waiting for the job")? {
            break status;
        }
        let t = job_started.elapsed().as_secs_f64();
        if pinned.is_none() && log.with_extension("html").exists() {
            pinned = Some(t);
            println!(
                "# {t:.0} s: the first session pinned its knobs; the hogs leave in {} s",
                args.hogs_linger_seconds
            );
        }
        if let Some(p) = pinned
            && killed.is_none()
            && t >= p + args.hogs_linger_seconds as f64
        {
            kill_all(&mut hogs);
            killed = Some(t);
            println!("# {t:.0} s: the hogs are gone");
        }
        if rechecked.is_none() && recheck.with_extension("html").exists() {
            rechecked = Some(t);
            println!("# {t:.0} s: the re-check's report is out");
        }
        if Instant::now() > deadline {
            let _ = job.kill();
            kill_all(&mut hogs);
            bail!(
                "the job did not end in time; its log: {}",
                job_log.display()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    kill_all(&mut hogs);
    if !status.success() {
        bail!("the job failed ({status}); its log: {}", job_log.display());
    }
    let text = std::fs::read_to_string(&job_log).unwrap_or_default();
    let events: Vec<String> = text
        .lines()
        .filter(|l| {
            l.contains("self-tuning done")
                || l.contains("re-check")
                || l.contains("no agent claimed")
                || l.contains("changed")
        })
        .map(str::to_owned)
        .collect();
    println!("# the job's own account:");
    for e in &events {
        println!("  {e}");
    }
    let final_json = std::fs::read_to_string(&stdout)
        .ok()
        .and_then(|s| {
            s.lines()
                .rev()
                .find(|l| l.trim_start().starts_with('{'))
                .map(str::to_owned)
        })
        .and_then(|l| serde_json::from_str(&l).ok());
    match (&rechecked, recheck.with_extension("html").exists()) {
        (_, true) => println!(
            "# re-check report: {} (its 'Why this session' section has the throughput since the pin)",
            recheck.with_extension("html").display()
        ),
        _ => println!(
            "# no re-check happened: the watch saw no change beyond noise after the hogs left"
        ),
    }
    let report = Report {
        what: "a self-tuning collbench resnet50 job (4 local ranks, 2 pretend hosts) tuned beside CPU hogs, the hogs killed at the pin, the job watched",
        hogs: args.hogs,
        job_seconds: args.job_seconds,
        first_pin_after_s: pinned,
        hogs_killed_after_s: killed,
        recheck_report_after_s: rechecked,
        first_report: log.with_extension("html").display().to_string(),
        recheck_report: recheck
            .with_extension("html")
            .exists()
            .then(|| recheck.with_extension("html").display().to_string()),
        job_log: job_log.display().to_string(),
        events,
        final_json,
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    crate::write_json_report(&out, &report, started)
}
