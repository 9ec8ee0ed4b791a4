//! `cargo xtask demo`: ringwatch's main job, shown on one machine.
//!
//! The agent (`serve --jobs`, with eBPF when root), two pretend nodes
//! (network namespaces joined by rate-limited veth links, so that the
//! topology matters as in a cluster), a 2 × 2-rank `collbench resnet50` job
//! across them started with `RINGWATCH_AUTOTUNE=1`, which the agent finds
//! through its control socket and tunes live; the UI's URL while it runs;
//! at the end the chosen knobs, steps/s on the runtime's defaults and on the
//! chosen knobs (each measured by a separate clean job on the same pretend
//! nodes), and the report's path. `--workload pytorch` makes the job real
//! training instead (torchvision's ResNet-18 through `ringwatch.torch`).
//! Everything it starts is stopped, and the
//! namespaces removed, on return, on error and on Ctrl-C.
//!
//! It only drives the binaries and reads the agent's HTTP API; it decides
//! nothing from hard-coded numbers.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

use crate::multinode::{self, Knobs};
use crate::topology::{self, Topology};

/// Inter-node rate of the demo's pretend nodes (Mbit/s each direction); the
/// tuning grid keeps its own ([`crate::tuning_grid::DEFAULT_RATE_MBIT`]).
/// Since ranks on one node talk through shared memory, at the grid's 4000
/// the runtime's defaults are near the best (quick grid on the 2-core
/// machine: best 1.20x and 1.25x the defaults, load average up to 6), so a
/// demo there shows little. At 3000 the best is 1.41x (4 MiB / 0.5 ms /
/// hierarchical, 3.26 vs 2.30 steps/s), and fusion and cycle time still
/// move the hierarchical points by up to 19%, so the tuner has more than
/// one knob to find. 2000 gives the same 1.41x with steps a third slower,
/// and a tuning sample spans several steps (~8 s each there: the demo took
/// 5 minutes); at 1000 (1.43x) only hierarchical allreduce matters.
pub const DEMO_RATE_MBIT: u32 = 3000;

/// The demo's flags.
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// Address of the agent's API and UI.
    #[arg(long, default_value = "127.0.0.1:9477")]
    pub listen: SocketAddr,
    /// Inter-node bandwidth of the pretend nodes, Mbit/s each way.
    #[arg(long, default_value_t = DEMO_RATE_MBIT)]
    pub rate_mbit: u32,
    /// Give up on the tuning session after this many seconds.
    #[arg(long, default_value_t = 600)]
    pub max_tuning_secs: u64,
    /// Timed resnet50 steps of the before and after measurements.
    #[arg(long, default_value_t = 20)]
    pub measure_steps: usize,
    /// Keep the agent serving (UI, report) after the demo until Ctrl-C.
    #[arg(long)]
    pub keep_serving: bool,
    /// What the tuned job runs: `collbench` (its resnet50 workload, the
    /// gradients of ResNet-50 without the compute) or `pytorch` (real
    /// training: examples/pytorch/train.py, torchvision's ResNet-18 on
    /// ringwatch.torch, 64x64 images, 8 per rank per step).
    #[arg(long, value_enum, default_value = "collbench")]
    pub workload: Workload,
}

/// The demo's job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Workload {
    /// `collbench resnet50`: ResNet-50's gradients, no compute.
    Collbench,
    /// PyTorch training of ResNet-18 through `ringwatch.torch`.
    Pytorch,
}

/// The knobs as the runtime's environment variables (a PyTorch job has no flags for them).
fn knob_env(knobs: &Knobs) -> Vec<(String, String)> {
    vec![
        (
            "RINGWATCH_FUSION_THRESHOLD".into(),
            knobs.fusion_threshold_bytes.to_string(),
        ),
        (
            "RINGWATCH_CYCLE_TIME_MS".into(),
            knobs.cycle_time_ms.to_string(),
        ),
        (
            "RINGWATCH_HIERARCHICAL_ALLREDUCE".into(),
            if knobs.hierarchical_allreduce {
                "1"
            } else {
                "0"
            }
            .into(),
        ),
    ]
}

/// A PyTorch training job's program and arguments (train.py through the venv's python).
fn pytorch_job(python: &Path, script: &Path, extra: &[&str]) -> Result<(PathBuf, Vec<String>)> {
    let mut args = vec![crate::venv::path_str(script)?.to_string()];
    args.extend(["--backend", "ringwatch"].map(String::from));
    args.extend(extra.iter().map(|a| a.to_string()));
    Ok((python.to_path_buf(), args))
}

const JOB_ID: &str = "ringwatch-demo";

/// The agent process; killed (SIGTERM, then SIGKILL) when dropped.
struct Agent {
    child: Child,
    address: SocketAddr,
    log: PathBuf,
}

impl Agent {
    fn start(bin: &Path, args: &Args, run_dir: &Path, reports: &Path, log: &Path) -> Result<Self> {
        let log_file = std::fs::File::create(log)
            .with_context(|| format!("creating the agent's log {}", log.display()))?;
        let mut child = Command::new(bin)
            .arg("serve")
            .arg("--jobs")
            .arg("--listen")
            .arg(args.listen.to_string())
            .arg("--runtime-dir")
            .arg(run_dir)
            .arg("--reports-dir")
            .arg(reports)
            .env("RINGWATCH_LOG", "info")
            .stdin(Stdio::null())
            .stdout(log_file.try_clone().context("agent log")?)
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {}", bin.display()))?;
        topology::register_child(child.id());
        let stderr = child.stderr.take().context("agent stderr")?;
        let (tx, rx) = std::sync::mpsc::channel();
        // Copy everything the agent says to its log; hand the API address
        // over once it is printed.
        std::thread::spawn(move || {
            use std::io::Write;
            let mut log_file = log_file;
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = writeln!(log_file, "{line}");
                if let Some(rest) = line.split("serving the API on http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or_default().to_owned());
                }
                if line.contains("eBPF") || line.contains("WARN") || line.contains("ERROR") {
                    eprintln!("[agent] {line}");
                }
            }
        });
        let address = rx
            .recv_timeout(Duration::from_secs(60))
            .ok()
            .and_then(|text| text.parse::<SocketAddr>().ok());
        let mut agent = Agent {
            child,
            // Replaced below; the guard exists first so that every way out
            // stops the agent.
            address: args.listen,
            log: log.to_path_buf(),
        };
        match address {
            Some(address) => agent.address = address,
            None => bail!(
                "the agent did not start serving within 60 s; its log: {}",
                log.display()
            ),
        }
        Ok(agent)
    }

    fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.address)
    }

    /// GET `path` as JSON: `Ok(None)` on 404.
    fn get(&self, path: &str) -> Result<Option<Value>> {
        match ureq::get(&self.url(path))
            .timeout(Duration::from_secs(10))
            .call()
        {
            Ok(response) => Ok(Some(
                response
                    .into_json()
                    .with_context(|| format!("GET {path}: not JSON"))?,
            )),
            Err(ureq::Error::Status(404, _)) => Ok(None),
            Err(error) => Err(error).with_context(|| format!("GET {}", self.url(path))),
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Ok(pid) = libc::pid_t::try_from(self.child.id()) {
            // SAFETY: signalling our own, not yet reaped, child by its pid.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                topology::unregister_child(self.child.id());
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        topology::unregister_child(self.child.id());
    }
}

/// The knobs of the API's JSON (`cycle_time_us`) as collbench takes them.
fn knobs_of(value: &Value) -> Result<Knobs> {
    let field = |name: &str| {
        value
            .get(name)
            .with_context(|| format!("knobs without {name}: {value}"))
    };
    Ok(Knobs {
        fusion_threshold_bytes: field("fusion_threshold_bytes")?
            .as_u64()
            .context("fusion_threshold_bytes is not a number")?,
        cycle_time_ms: field("cycle_time_us")?
            .as_u64()
            .context("cycle_time_us is not a number")? as f64
            / 1000.0,
        hierarchical_allreduce: field("hierarchical_allreduce")?
            .as_bool()
            .context("hierarchical_allreduce is not a bool")?,
    })
}

fn describe(knobs: &Knobs) -> String {
    let fusion = match knobs.fusion_threshold_bytes {
        0 => "off".to_owned(),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1 << 20) as f64),
        b => format!("{:.0} KiB", b as f64 / 1024.0),
    };
    format!(
        "fusion {fusion}, cycle {:.2} ms, hierarchical {}",
        knobs.cycle_time_ms,
        if knobs.hierarchical_allreduce {
            "on"
        } else {
            "off"
        }
    )
}

/// Runs the demo (root: pretend nodes and eBPF).
pub fn run(root: &Path, args: &Args) -> Result<()> {
    if !crate::is_root() {
        bail!(
            "the demo makes pretend nodes (network namespaces, tc) and loads eBPF, which need root: \
             run it as root (sudo -E cargo xtask demo). Without root you can still run the agent \
             (ringwatch-agent serve --jobs) and tune a local job: see the README."
        );
    }
    crate::setup()?;
    println!("ringwatch demo: building the agent and collbench...");
    crate::run("cargo", &["build", "-p", "agent"])?;
    let agent_bin = root.join("target/debug/ringwatch-agent");
    let collbench = multinode::collbench(root)?;
    let python = if args.workload == Workload::Pytorch {
        crate::ensure_packages(
            &[(
                "python3-torchvision",
                "the PyTorch workload's model (torchvision's ResNet-18)",
            )],
            crate::python::package_present,
        )?;
        Some(
            crate::python::install(root, &crate::cargo_target_dir(root), false)?.join("bin/python"),
        )
    } else {
        None
    };
    let script = root.join("examples/pytorch/train.py");
    topology::install_signal_cleanup()?;

    let demo_dir = root.join("target/demo");
    let run_dir = demo_dir.join("run");
    let reports = demo_dir.join("reports");
    let _ = std::fs::remove_dir_all(&run_dir);
    for dir in [&run_dir, &reports] {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let agent = Agent::start(
        &agent_bin,
        args,
        &run_dir,
        &reports,
        &demo_dir.join("agent.log"),
    )?;
    println!(
        "agent: serving on http://{} (eBPF on: root), finding jobs in {}, log {}",
        agent.address,
        run_dir.display(),
        agent.log.display()
    );

    let topology = Topology::create("rwdemo", 2, args.rate_mbit)?;
    println!(
        "pretend nodes: {} ({}) and {} ({}), {} Mbit/s each way between them (tc tbf)",
        topology.namespace(0),
        topology.address(0),
        topology.namespace(1),
        topology.address(1),
        args.rate_mbit
    );

    let measure = |knobs: Option<Knobs>, job_id: &str| -> Result<f64> {
        if let Some(python) = &python {
            let steps = args.measure_steps.to_string();
            let (program, job_args) =
                pytorch_job(python, &script, &["--steps", &steps, "--warmup", "3"])?;
            let mut env = vec![
                ("RINGWATCH_CONTROL_SOCKET".to_string(), "0".to_string()),
                ("OMP_NUM_THREADS".into(), "1".into()),
            ];
            env.extend(knobs.as_ref().map(knob_env).unwrap_or_default());
            let job = multinode::Job {
                topology: &topology,
                placement: multinode::block_placement(2, 2),
                collbench: program,
                args: job_args,
                env,
                job_id: job_id.into(),
                timeout: Duration::from_secs(120 + 10 * args.measure_steps as u64),
            };
            let output = multinode::run(&job).with_context(|| format!("job {job_id}"))?;
            let value: Value = multinode::last_json(&output, &format!("job {job_id}"))?;
            return value
                .get("steps_per_s")
                .and_then(Value::as_f64)
                .with_context(|| format!("job {job_id}: no steps_per_s in {value}"));
        }
        let spec = multinode::Resnet50 {
            ranks_per_node: 2,
            steps: args.measure_steps,
            warmup: 2,
            env: vec![("RINGWATCH_CONTROL_SOCKET".into(), "0".into())],
        };
        Ok(multinode::resnet50(&topology, &collbench, &spec, knobs, job_id)?.steps_per_sec)
    };
    let workload = match args.workload {
        Workload::Collbench => "collbench resnet50",
        Workload::Pytorch => "PyTorch ResNet-18 training",
    };
    println!(
        "before: a {}-step {workload} job on the runtime's default knobs (Horovod's)...",
        args.measure_steps
    );
    let before = measure(None, "demo-before")?;
    println!("before: {before:.2} steps/s");

    // The job being tuned: long enough for any session; stopped once the
    // session is over.
    let stop = Arc::new(AtomicBool::new(false));
    let (program, job_args) = match &python {
        Some(python) => pytorch_job(python, &script, &["--duration", "1000000"])?,
        None => (
            collbench.clone(),
            vec![
                "--json".into(),
                "resnet50".into(),
                "--steps".into(),
                "1000000".into(),
                "--warmup".into(),
                "0".into(),
            ],
        ),
    };
    let job = multinode::Job {
        topology: &topology,
        placement: multinode::block_placement(2, 2),
        collbench: program,
        args: job_args,
        env: vec![
            ("OMP_NUM_THREADS".into(), "1".into()),
            ("RINGWATCH_AUTOTUNE".into(), "1".into()),
            // The agent claims it within a scan or two; never self-tune here.
            ("RINGWATCH_AUTOTUNE_WAIT_SECS".into(), "60".into()),
            (
                "RINGWATCH_RUNTIME_DIR".into(),
                run_dir.display().to_string(),
            ),
        ],
        job_id: JOB_ID.into(),
        timeout: Duration::from_secs(args.max_tuning_secs + 120),
    };
    let outcome = std::thread::scope(|scope| -> Result<Value> {
        let job_thread = scope.spawn(|| multinode::run_until(&job, &stop));
        let result = follow_session(&agent, args, &job_thread);
        stop.store(true, Ordering::Relaxed);
        let _ = job_thread.join();
        result
    })?;
    // The job was killed: its socket file stays behind; the agent would
    // keep knocking on it.
    let _ = std::fs::remove_file(run_dir.join(format!("{JOB_ID}.sock")));

    let best = outcome
        .get("best")
        .filter(|b| !b.is_null())
        .context("the session ended without a best point")?;
    let chosen = knobs_of(best.get("knobs").context("best without knobs")?)?;
    println!(
        "after: a {}-step {workload} job on the chosen knobs ({})...",
        args.measure_steps,
        describe(&chosen)
    );
    let after = measure(Some(chosen), "demo-after")?;
    drop(topology);

    let report = outcome.get("report_id").and_then(Value::as_str).map(|id| {
        (
            reports.join(format!("{id}.html")),
            agent.url(&format!("/api/reports/{id}")),
        )
    });
    println!();
    println!("== ringwatch demo: done ==");
    println!(
        "samples taken:   {}",
        outcome
            .get("samples")
            .and_then(Value::as_array)
            .map_or(0, Vec::len)
    );
    println!("knobs chosen:    {}", describe(&chosen));
    println!("{}", confirmation_summary(&outcome));
    for line in disturbance_summary(&outcome) {
        println!("{line}");
    }
    println!(
        "steps/s before:  {before:.2}  (runtime defaults: fusion 64 MiB, cycle 1 ms, hierarchical off)"
    );
    println!(
        "steps/s after:   {after:.2}  ({:.2}x)",
        after / before.max(f64::MIN_POSITIVE)
    );
    match report {
        Some((path, url)) => println!("report:          {}  ({url})", path.display()),
        None => println!(
            "report:          none (the session wrote no report; see {})",
            agent.log.display()
        ),
    }
    println!("pretend nodes removed.");
    if args.keep_serving {
        println!(
            "the agent keeps serving on http://{} — Ctrl-C to stop it",
            agent.address
        );
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    }
    Ok(())
}

/// The summary's lines on disturbance: which samples had a window judged
/// disturbed (measured again, or recorded with a noise hint) and why, or
/// that none had; or why nothing was judged.
fn disturbance_summary(session: &Value) -> Vec<String> {
    const HEAD: &str = "disturbed:       ";
    const MORE: &str = "                 ";
    let detection = session
        .get("disturbance_detection")
        .and_then(Value::as_str)
        .unwrap_or("not reported");
    if !detection.starts_with("on") {
        return vec![format!(
            "{HEAD}no window was judged (disturbance detection {detection})"
        )];
    }
    let samples = session
        .get("samples")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    let mut lines = Vec::new();
    for (position, sample) in samples.iter().enumerate() {
        let text = |name: &str| sample.get(name).and_then(Value::as_str);
        let mut why = Vec::new();
        if let Some(reason) = text("remeasured_because") {
            why.push(format!("measured again because {reason}"));
        }
        if let Some(reason) = text("disturbed") {
            let hint = sample
                .get("noise_hint")
                .and_then(Value::as_f64)
                .map(|h| format!(", noise hint {h:.3}"))
                .unwrap_or_default();
            why.push(format!("recorded window disturbed: {reason}{hint}"));
        }
        if why.is_empty() {
            continue;
        }
        let index = sample
            .get("index")
            .and_then(Value::as_u64)
            .map_or(position, |i| i as usize);
        let knobs = sample
            .get("knobs")
            .and_then(|k| knobs_of(k).ok())
            .map(|k| format!(" ({})", describe(&k)))
            .unwrap_or_default();
        let head = if lines.is_empty() { HEAD } else { MORE };
        lines.push(format!("{head}sample {index}{knobs}: {}", why.join("; ")));
    }
    if lines.is_empty() {
        lines.push(format!(
            "{HEAD}no sample's window was judged disturbed (of {} samples)",
            samples.len()
        ));
    }
    let windows = session
        .pointer("/confirmation/windows")
        .and_then(Value::as_array)
        .map(Vec::as_slice)
        .unwrap_or_default();
    for (i, w) in windows.iter().enumerate() {
        if let Some(reason) = w.get("disturbed").and_then(Value::as_str) {
            let whose = w.get("candidate").and_then(Value::as_str).unwrap_or("?");
            lines.push(format!(
                "{MORE}confirmation window {i} ({whose}): disturbed: {reason}"
            ));
        }
    }
    lines
}

/// A score with its unit: the session scores steps per second where the job
/// marks its steps (collbench and `ringwatch.torch` do), else bytes.
fn format_score(session: &Value, score: f64) -> String {
    match session.get("objective").and_then(Value::as_str) {
        Some("steps_per_second") => format!("{score:.3} steps/s"),
        _ => format!("{:.3} GB/s", score / 1e9),
    }
}

/// The summary's line on the confirmation before pinning: the medians of
/// the choice's and the start's fresh windows and what was kept.
fn confirmation_summary(session: &Value) -> String {
    const HEAD: &str = "confirmation:    ";
    let Some(c) = session.get("confirmation").filter(|c| !c.is_null()) else {
        return format!("{HEAD}none (the model's choice was the start)");
    };
    let f = |name: &str| c.get(name).and_then(Value::as_f64);
    let n = c
        .get("windows")
        .and_then(Value::as_array)
        .map_or(0, Vec::len);
    match (
        c.get("kept").and_then(Value::as_str),
        f("choice_median"),
        f("start_median"),
    ) {
        (Some(kept), Some(choice), Some(start)) if start > 0.0 => format!(
            "{HEAD}{n} fresh windows, choice {} vs start {} ({:.3}x, needed > {:.3}x): kept the {kept}",
            format_score(session, choice),
            format_score(session, start),
            choice / start,
            1.0 + f("required_gain").unwrap_or(0.0)
        ),
        _ => format!("{HEAD}not finished ({n} windows)"),
    }
}

/// Waits for the agent to start tuning the job, prints each sample as it
/// arrives, and returns the finished session's JSON.
fn follow_session(
    agent: &Agent,
    args: &Args,
    job: &std::thread::ScopedJoinHandle<'_, Result<String>>,
) -> Result<Value> {
    let path = format!("/api/jobs/{JOB_ID}/tuning");
    let started = Instant::now();
    let deadline = started + Duration::from_secs(args.max_tuning_secs);
    println!(
        "tuning: job {JOB_ID} (2 nodes x 2 ranks) runs with RINGWATCH_AUTOTUNE=1; the agent tunes it live."
    );
    println!(
        "        watch it: {}  (timeline and tuning panel)",
        agent.url(&format!("/?job={JOB_ID}"))
    );
    let mut printed = 0;
    let mut announced = false;
    loop {
        if job.is_finished() {
            bail!(
                "the job ended before the tuning session did (see {})",
                agent.log.display()
            );
        }
        if Instant::now() > deadline {
            bail!(
                "no finished tuning session after {} s (raise --max-tuning-secs; agent log: {})",
                args.max_tuning_secs,
                agent.log.display()
            );
        }
        let Some(session) = agent.get(&path)? else {
            if !announced && started.elapsed() > Duration::from_secs(20) {
                println!("        (still waiting for the agent to find the job...)");
                announced = true;
            }
            std::thread::sleep(Duration::from_millis(500));
            continue;
        };
        if printed == 0 && !announced {
            println!(
                "        {:>6} {:>12} {:>10} {:>5} {:>16}  note",
                "sample", "fusion", "cycle ms", "hier", "score"
            );
            announced = true;
        }
        let samples = session
            .get("samples")
            .and_then(Value::as_array)
            .cloned()
            .unwrap_or_default();
        for sample in samples.iter().skip(printed) {
            let knobs = sample.get("knobs").map(knobs_of).transpose()?;
            let score = sample
                .get("score")
                .and_then(Value::as_f64)
                .unwrap_or(f64::NAN);
            let note = [sample.get("remeasured_because"), sample.get("disturbed")]
                .into_iter()
                .flatten()
                .filter_map(Value::as_str)
                .collect::<Vec<_>>()
                .join("; ");
            if let Some(k) = knobs {
                let fusion = if k.fusion_threshold_bytes == 0 {
                    "off".to_owned()
                } else {
                    format!(
                        "{:.2} MiB",
                        k.fusion_threshold_bytes as f64 / (1 << 20) as f64
                    )
                };
                println!(
                    "        {:>6} {:>12} {:>10.2} {:>5} {:>16}  {}",
                    printed,
                    fusion,
                    k.cycle_time_ms,
                    if k.hierarchical_allreduce {
                        "on"
                    } else {
                        "off"
                    },
                    format_score(&session, score),
                    note
                );
            }
            printed += 1;
        }
        match session.get("state").and_then(Value::as_str) {
            Some("running") | None => {}
            Some("done") | Some("stopped") => return Ok(session),
            Some(other) => bail!(
                "the tuning session ended {other}: {}",
                session
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("no reason given")
            ),
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn sample(index: u64, remeasured: Option<&str>, disturbed: Option<&str>) -> Value {
        json!({
            "index": index,
            "knobs": {"fusion_threshold_bytes": 4 << 20, "cycle_time_us": 500,
                      "hierarchical_allreduce": true},
            "score": 3.0e8,
            "noise_hint": disturbed.map(|_| 0.25),
            "disturbed": disturbed,
            "remeasured_because": remeasured,
        })
    }

    #[test]
    fn the_summary_names_each_disturbed_sample_and_why() {
        let session = json!({
            "disturbance_detection": "on: eBPF run-queue waits and TCP retransmits",
            "samples": [
                sample(0, None, None),
                sample(1, Some("81 TCP retransmits (pid 7)"), None),
                sample(2, Some("run-queue wait 40 ms/s vs 2 ms/s usual (pid 7)"),
                       Some("run-queue wait 35 ms/s vs 2 ms/s usual (pid 7)")),
            ],
        });
        assert_eq!(
            disturbance_summary(&session),
            vec![
                "disturbed:       sample 1 (fusion 4.0 MiB, cycle 0.50 ms, hierarchical on): \
                 measured again because 81 TCP retransmits (pid 7)"
                    .to_owned(),
                "                 sample 2 (fusion 4.0 MiB, cycle 0.50 ms, hierarchical on): \
                 measured again because run-queue wait 40 ms/s vs 2 ms/s usual (pid 7); \
                 recorded window disturbed: run-queue wait 35 ms/s vs 2 ms/s usual (pid 7), \
                 noise hint 0.250"
                    .to_owned(),
            ]
        );
    }

    #[test]
    fn the_summary_says_when_nothing_was_disturbed_or_judged() {
        let quiet = json!({
            "disturbance_detection": "on: eBPF run-queue waits and TCP retransmits",
            "samples": [sample(0, None, None), sample(1, None, None)],
        });
        assert_eq!(
            disturbance_summary(&quiet),
            vec![
                "disturbed:       no sample's window was judged disturbed (of 2 samples)"
                    .to_owned()
            ]
        );
        let off = json!({
            "disturbance_detection": "off: no eBPF (not root)",
            "samples": [sample(0, None, Some("ignored"))],
        });
        assert_eq!(
            disturbance_summary(&off),
            vec![
                "disturbed:       no window was judged (disturbance detection off: no eBPF (not root))"
                    .to_owned()
            ]
        );
    }
}
