//! `ringwatch-bench`: the probes' overhead and throughput, as a table.
//!
//! A/B in one run: a workload alone, then watched by `ringwatch-agent`,
//! alternating, reporting the slowdown as a ratio of medians. Three
//! workloads: `ping-pong`, a loopback TCP ping-pong (a context switch and a
//! send/receive per hop: the worst case, every hop is an event),
//! `collbench`, a real 4-rank `collbench resnet50` job on loopback (what
//! the agent watches in practice; its steps/s is the figure), and `yield`,
//! two threads trading one CPU with sched_yield (what watching adds to one
//! context switch, BPF statistics off and on). For the watched runs it
//! reports the records the pipeline took per second, the ring-buffer
//! drops, and the agent's CPU % and peak RSS (from wait4).
//! Needs root (the agent loads eBPF). Runs the sibling binaries of its own
//! executable, so build them together (`cargo xtask bench probes`).

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use clap::Parser;

/// Overhead and event-rate benchmark of the ringwatch probes.
#[derive(Debug, Parser)]
#[command(name = "ringwatch-bench")]
struct Cli {
    /// Round trips per run.
    #[arg(long, default_value_t = 100_000)]
    rounds: u64,
    /// A/B pairs (medians are reported).
    #[arg(long, default_value_t = 3)]
    pairs: usize,
    /// Concurrent ping-pong processes per run (more load, more events).
    #[arg(long, default_value_t = 1)]
    loads: usize,
    /// What to run under the agent.
    #[arg(long, value_enum, default_value_t = Workload::PingPong)]
    workload: Workload,
    /// collbench: ranks of the job (all on this machine).
    #[arg(long, default_value_t = 4)]
    ranks: usize,
    /// yield: context switches per run.
    #[arg(long, default_value_t = 1_000_000)]
    switches: u64,
    /// collbench: timed resnet50 steps per run.
    #[arg(long, default_value_t = 20)]
    steps: usize,
    /// Run only these variants (comma-separated; default: all of the workload's):
    /// unwatched, 0s, 100us, and for collbench job-connected, job-timeline, serve.
    #[arg(long, value_delimiter = ',')]
    variants: Vec<String>,
    /// collbench: also report the kernel's run time of every ringwatch
    /// program and the agent's CPU during each job, as shares of the job's
    /// own CPU time. Turns on the kernel's BPF statistics for the run,
    /// which adds two clock reads to every program run.
    #[arg(long)]
    bpf_stats: bool,
    /// collbench: the job's gradients in memory its ranks share (collbench resnet50
    /// --shared-tensors), as a PyTorch job's DistributedOptimizer keeps them.
    #[arg(long)]
    shared_gradients: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Workload {
    /// Loopback TCP ping-pong: the most events per unit of work.
    PingPong,
    /// A 4-rank `collbench resnet50` job on loopback (steps/s).
    Collbench,
    /// Two threads pinned to one CPU hand it to each other with
    /// sched_yield: nothing but watched context switches. Measures what
    /// watching adds to one switch from the threads' side, with the
    /// kernel's BPF statistics off (as deployed) and on (as `--bpf-stats`
    /// measures), beside what those statistics say `sched_switch` took.
    Yield,
}

struct Sibling {
    agent: PathBuf,
    testload: PathBuf,
    collbench: PathBuf,
}

impl Sibling {
    fn find() -> Result<Self> {
        let me = std::env::current_exe().context("finding this executable")?;
        let dir = me.parent().context("executable has no directory")?;
        let agent = dir.join("ringwatch-agent");
        let testload = dir.join("ringwatch-testload");
        for p in [&agent, &testload] {
            if !p.exists() {
                bail!(
                    "{} is missing: build the agent's binaries together (cargo build --release -p agent)",
                    p.display()
                );
            }
        }
        // Built by `cargo build --release -p collectives`, beside us in
        // target/release; only the collbench workload needs it.
        let collbench = dir.join("collbench");
        Ok(Self {
            agent,
            testload,
            collbench,
        })
    }
}

struct Load {
    child: Child,
    pid: u32,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
}

fn start_load(sib: &Sibling, rounds: u64) -> Result<Load> {
    start_testload(sib, &["ping-pong", "--rounds", &rounds.to_string()])
}

/// `ringwatch-testload --wait ARGS`, started and its pid read.
fn start_testload(sib: &Sibling, args: &[&str]) -> Result<Load> {
    let mut child = Command::new(&sib.testload)
        .arg("--wait")
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting ringwatch-testload")?;
    let stdout = child.stdout.take().context("no stdout")?;
    let mut lines = BufReader::new(stdout).lines();
    let first = lines.next().context("testload printed nothing")??;
    let info: serde_json::Value = serde_json::from_str(&first).context("testload's JSON")?;
    let pid = info["pid"].as_u64().context("no pid")? as u32;
    Ok(Load { child, pid, lines })
}

fn finish_load(mut load: Load) -> Result<f64> {
    let line = load.lines.next().context("testload printed no result")??;
    let v: serde_json::Value = serde_json::from_str(&line).context("testload's result")?;
    load.child.wait().context("waiting for testload")?;
    v["rounds_per_s"].as_f64().context("no rounds_per_s")
}

/// (round trips per second summed over the loads, agent figures if watched)
fn one_run(sib: &Sibling, cli: &Cli, watched: Option<&str>) -> Result<(f64, Option<AgentRun>)> {
    let mut loads = (0..cli.loads)
        .map(|_| start_load(sib, cli.rounds))
        .collect::<Result<Vec<_>>>()?;
    let agent = match watched {
        // "unwatched": the agent runs with every probe attached but watches
        // only this benchmark process, not the load.
        Some("unwatched") => Some(start_agent(
            sib,
            &["--pid".into(), std::process::id().to_string()],
            "0s",
        )?),
        Some(min_interval) => {
            let pids: Vec<String> = loads.iter().map(|l| l.pid.to_string()).collect();
            Some(start_agent(
                sib,
                &["--pid".into(), pids.join(",")],
                min_interval,
            )?)
        }
        None => None,
    };
    let started = Instant::now();
    for load in &mut loads {
        let mut stdin = load.child.stdin.take().context("no stdin")?;
        stdin.write_all(b"go\n").context("starting the load")?;
    }
    let mut rate = 0.0;
    for load in loads {
        rate += finish_load(load)?;
    }
    let load_s = started.elapsed().as_secs_f64();
    let agent = match agent {
        Some(child) => Some(reap_agent(child, load_s)?),
        None => None,
    };
    Ok((rate, agent))
}

/// Starts the agent watching `target` (agent flags) and returns once it
/// says it is watching.
fn start_agent(sib: &Sibling, target: &[String], min_interval: &str) -> Result<Child> {
    start_agent_with(sib, target, &["--min-interval", min_interval])
}

/// As [`start_agent`], with `flags` instead of a `--min-interval`.
fn start_agent_with(sib: &Sibling, target: &[String], flags: &[&str]) -> Result<Child> {
    let mut child = Command::new(&sib.agent)
        .args(target)
        .args(["--duration", "600s", "--json"])
        .args(flags)
        .env(
            "RINGWATCH_LOCK_FILE",
            std::env::temp_dir().join(format!("ringwatch-bench-{}.lock", std::process::id())),
        )
        .env("RINGWATCH_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting ringwatch-agent")?;
    let stderr = child.stderr.take().context("no stderr")?;
    let mut err_lines = BufReader::new(stderr).lines();
    wait_for_line(&mut err_lines, "watching")?;
    std::thread::spawn(move || for _ in err_lines {});
    Ok(child)
}

/// Reads the agent's stderr up to the first line that contains `needle` and returns
/// it; the lines before are echoed.
fn wait_for_line(
    lines: &mut std::io::Lines<BufReader<std::process::ChildStderr>>,
    needle: &str,
) -> Result<String> {
    loop {
        match lines.next() {
            Some(Ok(line)) if line.contains(needle) => return Ok(line),
            Some(Ok(line)) => eprintln!("[agent] {line}"),
            _ => bail!("the agent exited before it said \"{needle}\""),
        }
    }
}

/// One collbench job (steps/s), watched by an agent started before it when
/// `watched` says how.
fn one_collbench_run(
    sib: &Sibling,
    cli: &Cli,
    watched: Option<&str>,
) -> Result<(f64, Option<AgentRun>)> {
    if !sib.collbench.exists() {
        bail!(
            "{} is missing: build it beside the agent (cargo build --release -p agent -p collectives)",
            sib.collbench.display()
        );
    }
    let mut serve = None;
    let agent = match watched {
        Some(SERVE) => {
            let (child, address, dir) = start_serve_agent(sib)?;
            serve = Some((address, dir));
            Some(child)
        }
        // The agent runs with every probe attached, watching only us.
        Some("unwatched") => Some(start_agent(
            sib,
            &["--pid".into(), std::process::id().to_string()],
            "0s",
        )?),
        // The defaults: the job serves its control socket, the agent
        // connects and streams its cycle statistics and timeline.
        Some(JOB_CONNECTED) => Some(start_agent(
            sib,
            &["--comm".into(), "collbench".into()],
            "0s",
        )?),
        // As while someone watches the job's timeline: every tensor's events
        // built, sent and kept.
        Some(JOB_TIMELINE) => Some(start_agent(
            sib,
            &[
                "--comm".into(),
                "collbench".into(),
                "--job-timeline".into(),
                "always".into(),
            ],
            "0s",
        )?),
        Some(min_interval) => Some(start_agent(
            sib,
            &["--comm".into(), "collbench".into()],
            min_interval,
        )?),
        None => None,
    };
    let agent_pid = agent.as_ref().map(Child::id);
    let cost_before = match (cli.bpf_stats, agent_pid) {
        (true, Some(pid)) => Some(CostReading::take(pid)?),
        _ => None,
    };
    let job_cpu_before = children_cpu_s();
    let started = Instant::now();
    let mut command = Command::new(&sib.collbench);
    command
        .args(["-n", &cli.ranks.to_string(), "--json", "resnet50"])
        .args(["--steps", &cli.steps.to_string(), "--warmup", "2"])
        .args(cli.shared_gradients.then_some("--shared-tensors"));
    if ![Some(JOB_CONNECTED), Some(JOB_TIMELINE), Some(SERVE)].contains(&watched) {
        // The probes alone: no socket for the agent to connect to.
        command.env("RINGWATCH_CONTROL_SOCKET", "0");
    }
    let output = command
        .stderr(Stdio::inherit())
        .output()
        .context("running collbench")?;
    let load_s = started.elapsed().as_secs_f64();
    let job_cpu_s = children_cpu_s() - job_cpu_before;
    let cost = match (cost_before, agent_pid) {
        (Some(before), Some(pid)) => Some(CostReading::take(pid)?.since(&before, job_cpu_s)),
        _ => None,
    };
    if !output.status.success() {
        bail!("collbench failed: {}", output.status);
    }
    let text = String::from_utf8_lossy(&output.stdout);
    let steps_per_sec = text
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .and_then(|v| v["steps_per_sec"].as_f64())
        .with_context(|| format!("collbench printed no steps_per_sec: {text}"))?;
    let agent = match (agent, serve) {
        (Some(child), Some((address, dir))) => {
            // Drops as the agent exports them, before it stops.
            let drops = scrape_counter(&address, "ringwatch_ringbuf_drops_total");
            let (cpu_s, lifetime, peak_rss_mib, _) = stop_agent(child, load_s)?;
            let _ = std::fs::remove_dir_all(dir);
            Some(AgentRun {
                events: 0,
                drops: drops?,
                load_s,
                cpu_pct: 100.0 * cpu_s / lifetime.max(1e-9),
                peak_rss_mib,
                cost,
            })
        }
        (Some(child), None) => Some(AgentRun {
            cost,
            ..reap_agent(child, load_s)?
        }),
        (None, _) => None,
    };
    Ok((steps_per_sec, agent))
}

/// The agent as the DaemonSet runs it (deploy/ringwatch.yaml: `serve --jobs
/// --probes sched,tcp`, every other setting at its default), on a free
/// loopback port, with its reports in a directory of its own. Returns the
/// child, the address it serves on and that directory.
fn start_serve_agent(sib: &Sibling) -> Result<(Child, String, PathBuf)> {
    let dir = std::env::temp_dir().join(format!("ringwatch-bench-serve-{}", std::process::id()));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let mut child = Command::new(&sib.agent)
        .args([
            "serve",
            "--jobs",
            "--probes",
            "sched,tcp",
            "--listen",
            "127.0.0.1:0",
        ])
        .arg("--reports-dir")
        .arg(dir.join("reports"))
        .env("RINGWATCH_LOCK_FILE", dir.join("agent.lock"))
        .env("RINGWATCH_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting ringwatch-agent serve")?;
    let stderr = child.stderr.take().context("no stderr")?;
    let mut err_lines = BufReader::new(stderr).lines();
    const SERVING: &str = "serving the API on http://";
    let line = wait_for_line(&mut err_lines, SERVING)?;
    let address = line
        .split_once(SERVING)
        .and_then(|(_, rest)| rest.split('/').next())
        .unwrap_or_default()
        .to_owned();
    std::thread::spawn(move || for _ in err_lines {});
    Ok((child, address, dir))
}

/// The value of a counter in the agent's /metrics.
fn scrape_counter(address: &str, name: &str) -> Result<u64> {
    use std::io::Read;
    let mut stream = std::net::TcpStream::connect(address)
        .with_context(|| format!("connecting to the agent at {address}"))?;
    stream.set_read_timeout(Some(std::time::Duration::from_secs(10)))?;
    write!(stream, "GET /metrics HTTP/1.0\r\nHost: {address}\r\n\r\n")?;
    let mut text = String::new();
    stream
        .read_to_string(&mut text)
        .context("reading /metrics")?;
    text.lines()
        .find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(' ')?
                .trim()
                .parse::<f64>()
                .ok()
        })
        .map(|v| v as u64)
        .with_context(|| format!("no {name} in the agent's /metrics"))
}

/// The collbench variant in which the job serves its control socket and the
/// agent streams from it, as in a real deployment.
const JOB_CONNECTED: &str = "job-connected";

/// As [`JOB_CONNECTED`], with the job's timeline streamed all along
/// (`--job-timeline always`: as while someone reads it).
const JOB_TIMELINE: &str = "job-timeline";

/// The agent as deployed: `serve` with the DaemonSet's arguments, the job
/// found through its control socket.
const SERVE: &str = "serve";

struct AgentRun {
    events: u64,
    drops: u64,
    load_s: f64,
    cpu_pct: f64,
    peak_rss_mib: f64,
    /// `--bpf-stats`: what watching cost during the job.
    cost: Option<Cost>,
}

/// CPU time (seconds) this process's waited-for children used so far: the
/// job's launcher and its ranks, once reaped.
fn children_cpu_s() -> f64 {
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: RUSAGE_CHILDREN with a valid pointer.
    unsafe { libc::getrusage(libc::RUSAGE_CHILDREN, &mut usage) };
    tv_s(usage.ru_utime) + tv_s(usage.ru_stime)
}

fn tv_s(t: libc::timeval) -> f64 {
    t.tv_sec as f64 + t.tv_usec as f64 / 1e6
}

/// The agent's threads' time on CPU (the kernel's schedstat, ns) and the
/// kernel's run time and run count of each loaded `rw_*` program, by id.
struct CostReading {
    agent_ns: u64,
    programs: std::collections::BTreeMap<u32, (String, u64, u64)>,
}

/// What watching one job cost: the agent's CPU and each program's kernel
/// run time during the job, and the job's own CPU time.
#[derive(Debug, Clone, Default)]
struct Cost {
    job_cpu_s: f64,
    agent_cpu_s: f64,
    /// name → (run time s, runs)
    programs: std::collections::BTreeMap<String, (f64, u64)>,
}

impl Cost {
    fn bpf_s(&self) -> f64 {
        self.programs.values().map(|&(s, _)| s).sum()
    }
}

impl CostReading {
    fn take(agent: u32) -> Result<Self> {
        // The statistics stay on while this fd is open: for the rest of the bench.
        static STATS: std::sync::OnceLock<std::os::fd::OwnedFd> = std::sync::OnceLock::new();
        if STATS.get().is_none() {
            let fd = aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("turning on the kernel's BPF run-time statistics")?;
            let _ = STATS.set(fd);
        }
        let mut agent_ns = 0;
        let tasks = format!("/proc/{agent}/task");
        for task in std::fs::read_dir(&tasks).with_context(|| format!("reading {tasks}"))? {
            let path = task?.path().join("schedstat");
            // A thread that ended in between has nothing to add.
            if let Ok(text) = std::fs::read_to_string(&path) {
                agent_ns += text
                    .split_whitespace()
                    .next()
                    .and_then(|v| v.parse::<u64>().ok())
                    .with_context(|| format!("{}: {text:?}", path.display()))?;
            }
        }
        Ok(Self {
            agent_ns,
            programs: rw_programs()?,
        })
    }

    /// From `before` to this reading, with the job's CPU time.
    fn since(&self, before: &Self, job_cpu_s: f64) -> Cost {
        let mut programs: std::collections::BTreeMap<String, (f64, u64)> = Default::default();
        for (id, (name, ns, runs)) in &self.programs {
            // Programs loaded in between (another agent) are not this one's.
            if let Some((_, ns0, runs0)) = before.programs.get(id) {
                let entry = programs.entry(name.clone()).or_default();
                entry.0 += ns.saturating_sub(*ns0) as f64 / 1e9;
                entry.1 += runs.saturating_sub(*runs0);
            }
        }
        Cost {
            job_cpu_s,
            agent_cpu_s: self.agent_ns.saturating_sub(before.agent_ns) as f64 / 1e9,
            programs,
        }
    }
}

/// Every loaded `rw_*` program: id → (name, run time ns, runs), as far as
/// the kernel's BPF statistics have counted them.
fn rw_programs() -> Result<std::collections::BTreeMap<u32, (String, u64, u64)>> {
    let mut programs = std::collections::BTreeMap::new();
    for info in aya::programs::loaded_programs() {
        let info = info.context("listing the kernel's BPF programs")?;
        let Some(name) = info.name_as_str().filter(|n| n.starts_with("rw_")) else {
            continue;
        };
        programs.insert(
            info.id(),
            (
                name.to_owned(),
                info.run_time().as_nanos() as u64,
                info.run_count(),
            ),
        );
    }
    Ok(programs)
}

/// Interrupts the agent (the load is over; an agent watching a name or only
/// us would not end by itself), then waits for its summary and usage.
fn reap_agent(child: Child, load_s: f64) -> Result<AgentRun> {
    let (cpu_s, lifetime, peak_rss_mib, text) = stop_agent(child, load_s)?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("agent output: {text}"))?;
    Ok(AgentRun {
        cost: None,
        events: v["events"].as_u64().unwrap_or(0),
        drops: v["ringbuf_drops"].as_u64().unwrap_or(0),
        load_s,
        // The agent lives a little longer than the load (startup excluded:
        // it was already watching when the clock started).
        cpu_pct: 100.0 * cpu_s / lifetime.max(1e-9),
        peak_rss_mib,
    })
}

/// SIGINT, then wait4: (CPU seconds, seconds it lived since the load
/// started, peak RSS in MiB, what it printed).
fn stop_agent(mut child: Child, load_s: f64) -> Result<(f64, f64, f64, String)> {
    // SAFETY: signalling our own, not yet reaped, child by its pid.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    // (`serve` prints nothing there: its stdout is not piped.)
    let stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(mut stdout) = stdout {
            let _ = std::io::Read::read_to_string(&mut stdout, &mut text);
        }
        text
    });
    let started = Instant::now();
    let pid = child.id() as libc::pid_t;
    let mut status = 0;
    // SAFETY: zeroed rusage is a valid out-parameter.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: waiting for our own child; pointers are valid.
    let rc = unsafe { libc::wait4(pid, &mut status, 0, &mut usage) };
    if rc != pid {
        bail!(
            "wait4 on the agent failed: {}",
            std::io::Error::last_os_error()
        );
    }
    let lifetime = load_s + started.elapsed().as_secs_f64();
    let text = reader
        .join()
        .map_err(|_| anyhow::anyhow!("reader panicked"))?;
    let cpu_s = tv_s(usage.ru_utime) + tv_s(usage.ru_stime);
    Ok((cpu_s, lifetime, usage.ru_maxrss as f64 / 1024.0, text))
}

fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("ringwatch-bench runs the agent, which loads eBPF: run it as root");
    }
    let sib = Sibling::find()?;
    // Agent attached but the load not watched; watched with every record;
    // and bounded: intervals under 100 µs only in the histograms.
    let mut variants = vec!["unwatched", "0s", "100us"];
    if cli.workload == Workload::Collbench {
        // And everything a deployment has: probes at the defaults plus the
        // job's control socket streamed (cycle statistics, timeline).
        variants.push(JOB_CONNECTED);
        variants.push(JOB_TIMELINE);
        variants.push(SERVE);
    }
    if !cli.variants.is_empty() {
        if let Some(unknown) = cli
            .variants
            .iter()
            .find(|v| !variants.contains(&v.as_str()))
        {
            bail!(
                "--variants: no variant '{unknown}' for this workload (it has: {})",
                variants.join(", ")
            );
        }
        variants.retain(|v| cli.variants.iter().any(|c| c == v));
    }
    if cli.workload == Workload::Yield {
        return yield_bench(&sib, &cli);
    }
    let run = |watched: Option<&str>| match cli.workload {
        Workload::PingPong => one_run(&sib, &cli, watched),
        Workload::Collbench | Workload::Yield => one_collbench_run(&sib, &cli, watched),
    };
    let mut base = Vec::new();
    let mut watched: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    let mut runs: Vec<Vec<AgentRun>> = variants.iter().map(|_| Vec::new()).collect();
    // Each watched run against the run without an agent just before it: the
    // machine drifts less within a pair than across the whole bench.
    let mut slowdowns: Vec<Vec<f64>> = vec![Vec::new(); variants.len()];
    // Warm-up, not counted.
    run(None)?;
    for _ in 0..cli.pairs {
        for (i, v) in variants.iter().enumerate() {
            let alone = run(None)?.0;
            base.push(alone);
            let (rate, agent) = run(Some(v))?;
            watched[i].push(rate);
            slowdowns[i].push(100.0 * (alone - rate) / alone);
            runs[i].extend(agent);
        }
    }
    let b = median(&mut base);
    let unit = match cli.workload {
        Workload::PingPong => {
            println!(
                "ringwatch probes benchmark: {} ping-pong load(s) x {} round trips, {} A/B pairs per variant",
                cli.loads, cli.rounds, cli.pairs
            );
            "round trips/s"
        }
        Workload::Collbench | Workload::Yield => {
            println!(
                "ringwatch probes benchmark: collbench resnet50, {} local ranks x {} steps, {} A/B pairs per variant",
                cli.ranks, cli.steps, cli.pairs
            );
            "steps/s"
        }
    };
    println!();
    println!(
        "| run | {unit} (median) | slowdown | slowdown per pair: median (min to max) | records/s (median) | ring-buffer drops (sum) | agent CPU % (median) | agent peak RSS MiB (max) |"
    );
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    println!("| no agent | {b:.3} | | | | | | |");
    for (i, v) in variants.iter().enumerate() {
        let w = median(&mut watched[i]);
        let mut rates: Vec<f64> = runs[i].iter().map(|r| r.events as f64 / r.load_s).collect();
        let mut cpu: Vec<f64> = runs[i].iter().map(|r| r.cpu_pct).collect();
        let drops: u64 = runs[i].iter().map(|r| r.drops).sum();
        let rss = runs[i].iter().map(|r| r.peak_rss_mib).fold(0.0, f64::max);
        let label = match *v {
            "unwatched" => "agent running, load not watched".to_owned(),
            JOB_CONNECTED => "watched, job connected (the defaults: statistics streamed, timeline on demand, nobody reading)".to_owned(),
            JOB_TIMELINE => "watched, job's timeline streamed (`--job-timeline always`, as while it is read)".to_owned(),
            SERVE => "as deployed: `serve --jobs --probes sched,tcp`, the job found by its socket (records/s not exported)".to_owned(),
            v => format!("watched, --min-interval {v}"),
        };
        let pairs = &mut slowdowns[i];
        let per_pair = median(pairs);
        println!(
            "| {label} | {w:.3} | {:.1} % | {per_pair:.1} % ({:.1} to {:.1}) | {:.0} | {drops} | {:.1} | {rss:.1} |",
            100.0 * (b - w) / b,
            pairs[0],
            pairs[pairs.len() - 1],
            median(&mut rates),
            median(&mut cpu),
        );
    }
    if cli.bpf_stats {
        print_costs(&variants, &runs);
    }
    Ok(())
}

/// How a yield run is watched.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum YieldRun {
    Alone,
    /// The agent watching the threads at its defaults, BPF statistics off.
    Watched,
    /// The same with the kernel's BPF run-time statistics on.
    WatchedStats,
}

/// `--workload yield`: ns per switch of the yielding threads alone and
/// watched, statistics off and on, `--pairs` rounds in this order; each
/// watched run is compared with the run alone of its round.
fn yield_bench(sib: &Sibling, cli: &Cli) -> Result<()> {
    let cpus = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load = load.split_whitespace().next().unwrap_or("?").to_owned();
    eprintln!(
        "yield: {} rounds of 3 runs, {} switches each, on CPU {}",
        cli.pairs,
        cli.switches,
        cpus - 1
    );
    one_yield_run(sib, cli, YieldRun::Alone)?; // warm-up
    let (mut alone, mut off, mut on, mut reported, mut runs_per_switch) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for round in 0..cli.pairs {
        let base = one_yield_run(sib, cli, YieldRun::Alone)?.0;
        let watched = one_yield_run(sib, cli, YieldRun::Watched)?.0;
        let (stats, program) = one_yield_run(sib, cli, YieldRun::WatchedStats)?;
        eprintln!(
            "yield round {}/{}: alone {base:.0} ns, watched {watched:.0} ns, with statistics {stats:.0} ns a switch",
            round + 1,
            cli.pairs
        );
        alone.push(base);
        off.push(watched - base);
        on.push(stats - base);
        if let Some((ns_per_run, per_switch)) = program {
            reported.push(ns_per_run);
            runs_per_switch.push(per_switch);
        }
    }
    let load_after = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load_after = load_after.split_whitespace().next().unwrap_or("?");
    println!(
        "ringwatch probes benchmark: 2 threads pinned to CPU {} trade it with sched_yield, {} switches per run, {} rounds (load {load} before, {load_after} after)",
        cpus - 1,
        cli.switches,
        cli.pairs
    );
    println!();
    println!("| run | ns per switch, added by watching: median (min to max) |");
    println!("|---|---:|");
    let row = |label: &str, values: &mut Vec<f64>| {
        let m = median(values);
        println!(
            "| {label} | {m:.0} ({:.0} to {:.0}) |",
            values[0],
            values[values.len() - 1]
        );
    };
    row("not watched: ns per switch", &mut alone);
    row("watched, BPF statistics off (as deployed)", &mut off);
    row("watched, BPF statistics on (as `--bpf-stats`)", &mut on);
    if !reported.is_empty() {
        row(
            "`sched_switch` run time by the BPF statistics, ns per run",
            &mut reported,
        );
        println!();
        println!(
            "`sched_switch` ran {:.2} times per switch the threads counted (other tasks' switches on that CPU included).",
            median(&mut runs_per_switch)
        );
    }
    Ok(())
}

/// One yield run: (ns per switch, with statistics on: sched_switch's ns
/// per run and runs per counted switch).
fn one_yield_run(sib: &Sibling, cli: &Cli, how: YieldRun) -> Result<(f64, Option<(f64, f64)>)> {
    let Load {
        mut child,
        pid,
        mut lines,
    } = start_testload(sib, &["yield", "--switches", &cli.switches.to_string()])?;
    let stats = match how {
        YieldRun::WatchedStats => Some(
            aya::sys::enable_stats(aya::sys::Stats::RunTime)
                .context("turning on the kernel's BPF run-time statistics")?,
        ),
        _ => None,
    };
    let agent = match how {
        YieldRun::Alone => None,
        // Every setting at its default (RINGWATCH_* in the environment apply).
        _ => Some(start_agent_with(
            sib,
            &["--pid".into(), pid.to_string()],
            &[],
        )?),
    };
    let before = rw_programs()?;
    let started = Instant::now();
    let mut stdin = child.stdin.take().context("no stdin")?;
    stdin.write_all(b"go\n").context("starting the load")?;
    let line = lines.next().context("testload printed no result")??;
    let load_s = started.elapsed().as_secs_f64();
    let after = rw_programs()?;
    // Its threads stay until a second line or the end of its input.
    drop(stdin);
    child.wait().context("waiting for testload")?;
    drop(stats);
    let result: serde_json::Value = serde_json::from_str(&line).context("testload's result")?;
    let ns_per_switch = result["ns_per_switch"]
        .as_f64()
        .context("no ns_per_switch")?;
    let switches = result["switches"].as_f64().context("no switches")?;
    if let Some(agent) = agent {
        reap_agent(agent, load_s)?;
    }
    let mut program = None;
    if how == YieldRun::WatchedStats {
        let (mut ns, mut runs) = (0, 0);
        for (id, (name, ns1, runs1)) in &after {
            if let Some((_, ns0, runs0)) = before.get(id).filter(|_| name == "rw_sched_switch") {
                ns += ns1.saturating_sub(*ns0);
                runs += runs1.saturating_sub(*runs0);
            }
        }
        if runs > 0 {
            program = Some((ns as f64 / runs as f64, runs as f64 / switches.max(1.0)));
        }
    }
    Ok((ns_per_switch, program))
}

/// `--bpf-stats`: what watching cost, as shares of the job's own CPU time
/// (medians over the runs), and where the kernel's part went.
fn print_costs(variants: &[&str], runs: &[Vec<AgentRun>]) {
    println!();
    println!(
        "What watching cost during the job, as a share of the job's own CPU time (medians over the runs; the job's CPU from wait4, the agent's from its threads' schedstat, the programs' from the kernel's BPF statistics, which were on for every run above and add two clock reads to each program run, but leave out the cost of calling the program; `--workload yield` measures what a watched switch costs in all):"
    );
    println!();
    println!(
        "| run | job CPU s | agent CPU, % of the job's | eBPF programs, % of the job's | together |"
    );
    println!("|---|---:|---:|---:|---:|");
    for (i, v) in variants.iter().enumerate() {
        let costs: Vec<&Cost> = runs[i].iter().filter_map(|r| r.cost.as_ref()).collect();
        if costs.is_empty() {
            continue;
        }
        let share = |f: &dyn Fn(&Cost) -> f64| {
            let mut values: Vec<f64> = costs
                .iter()
                .map(|c| 100.0 * f(c) / c.job_cpu_s.max(1e-9))
                .collect();
            median(&mut values)
        };
        let mut job: Vec<f64> = costs.iter().map(|c| c.job_cpu_s).collect();
        println!(
            "| {v} | {:.2} | {:.2} % | {:.2} % | {:.2} % |",
            median(&mut job),
            share(&|c| c.agent_cpu_s),
            share(&|c| c.bpf_s()),
            share(&|c| c.agent_cpu_s + c.bpf_s()),
        );
    }
    println!();
    println!("| run | program | runs per job-CPU-second | ns per run | % of the job's CPU |");
    println!("|---|---|---:|---:|---:|");
    for (i, v) in variants.iter().enumerate() {
        let mut totals: std::collections::BTreeMap<&str, (f64, u64)> = Default::default();
        let mut job_s = 0.0;
        for cost in runs[i].iter().filter_map(|r| r.cost.as_ref()) {
            job_s += cost.job_cpu_s;
            for (name, &(seconds, count)) in &cost.programs {
                let entry = totals.entry(name).or_default();
                entry.0 += seconds;
                entry.1 += count;
            }
        }
        for (name, (seconds, count)) in totals.into_iter().filter(|(_, (_, n))| *n > 0) {
            println!(
                "| {v} | {name} | {:.0} | {:.0} | {:.3} % |",
                count as f64 / job_s.max(1e-9),
                seconds * 1e9 / count as f64,
                100.0 * seconds / job_s.max(1e-9),
            );
        }
    }
}
