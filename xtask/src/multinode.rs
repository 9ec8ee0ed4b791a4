//! Runs one multi-node `collbench` job on the pretend nodes of a
//! [`Topology`]: one process per rank, started inside its node's namespace
//! with the environment a launcher (torchrun, mpirun) would give it, waited
//! for with a timeout, and killed, all of them, on any error.
//!
//! Only rank 0 prints a job's result (collbench's single-rank mode), so the
//! job's output is rank 0's stdout; every rank's stderr is kept for errors.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU16, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::topology::{self, Topology};

/// The collective runtime's knobs, as collbench takes them.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Knobs {
    /// Tensor-fusion threshold in bytes; 0 turns fusion off.
    pub fusion_threshold_bytes: u64,
    /// Cycle time in milliseconds.
    pub cycle_time_ms: f64,
    /// Hierarchical allreduce (reduce on the node, allreduce across nodes).
    pub hierarchical_allreduce: bool,
}

impl Knobs {
    /// collbench's flags for these knobs.
    pub fn flags(&self) -> Vec<String> {
        vec![
            "--fusion-threshold".into(),
            self.fusion_threshold_bytes.to_string(),
            "--cycle-time-ms".into(),
            self.cycle_time_ms.to_string(),
            "--hierarchical".into(),
            self.hierarchical_allreduce.to_string(),
        ]
    }
}

/// One job: which node each rank runs on, and what it runs.
pub struct Job<'a> {
    /// The pretend nodes.
    pub topology: &'a Topology,
    /// `placement[rank]` is the node rank `rank` runs on. Ranks of one node
    /// must be contiguous (as torchrun numbers them).
    pub placement: Vec<usize>,
    /// The collbench binary.
    pub collbench: PathBuf,
    /// collbench's arguments (workload, flags).
    pub args: Vec<String>,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
    /// `RINGWATCH_JOB_ID`.
    pub job_id: String,
    /// The whole job is killed after this long.
    pub timeout: Duration,
}

/// `placement` for `nodes` nodes of `ranks_per_node` ranks each.
pub fn block_placement(nodes: usize, ranks_per_node: usize) -> Vec<usize> {
    (0..nodes * ranks_per_node)
        .map(|rank| rank / ranks_per_node)
        .collect()
}

/// A fresh rendezvous port per job, so that a job never meets a listener
/// (or TIME_WAIT) of the one before.
fn next_port() -> u16 {
    static NEXT: AtomicU16 = AtomicU16::new(0);
    29500 + NEXT.fetch_add(1, Ordering::Relaxed) % 2000
}

/// collbench, built if missing (`cargo build -p collectives`), from cargo's
/// target directory (`CARGO_TARGET_DIR` counts: a stale `target/` binary
/// must not be benchmarked in place of the one just built). The dev
/// profile optimizes `collectives` (opt-level 3) and every dependency, so it
/// runs as fast as a release build (measured: within run-to-run noise on
/// resnet50) and shares the test build instead of a cold release build of
/// polars with LTO.
pub fn collbench(root: &Path) -> Result<PathBuf> {
    let path = crate::cargo_target_dir(root).join("debug/collbench");
    crate::run("cargo", &["build", "-p", "collectives"])?;
    if !path.is_file() {
        bail!("{} is missing after the build", path.display());
    }
    Ok(path)
}

struct Rank {
    rank: usize,
    child: Child,
    stdout: Option<std::thread::JoinHandle<String>>,
    stderr: std::thread::JoinHandle<String>,
}

fn drain(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = from.read_to_string(&mut text);
        text
    })
}

fn kill_all(ranks: &mut [Rank]) {
    for rank in ranks.iter_mut() {
        let _ = rank.child.kill();
        let _ = rank.child.wait();
        topology::unregister_child(rank.child.id());
    }
}

/// Runs `job` to the end and returns rank 0's stdout. Fails, after killing
/// every rank, when one rank fails, when the job outlives its timeout, or
/// when a rank cannot be started.
pub fn run(job: &Job) -> Result<String> {
    run_until(job, &AtomicBool::new(false))
}

/// [`run`], but once `stop` is set every rank is killed and the job counts
/// as failed ("stopped"): for a workload that is only a backdrop (the demo's
/// job being tuned), ended when what it was for is done.
pub fn run_until(job: &Job, stop: &AtomicBool) -> Result<String> {
    let world_size = job.placement.len();
    if world_size == 0 {
        bail!("a job needs at least one rank");
    }
    if let Some(&node) = job.placement.iter().find(|&&n| n >= job.topology.nodes()) {
        bail!(
            "rank placed on node {node}, but there are only {} nodes",
            job.topology.nodes()
        );
    }
    let master_addr = job.topology.address(job.placement[0]);
    let port = next_port().to_string();
    let mut ranks: Vec<Rank> = Vec::with_capacity(world_size);
    for (rank, &node) in job.placement.iter().enumerate() {
        let on_node: Vec<usize> = (0..world_size)
            .filter(|&r| job.placement[r] == node)
            .collect();
        let local_rank = on_node
            .iter()
            .position(|&r| r == rank)
            .expect("a rank is on its own node");
        let mut command = job.topology.command(node, &job.collbench);
        command
            .args(&job.args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local_rank.to_string())
            .env("LOCAL_SIZE", on_node.len().to_string())
            .env("MASTER_ADDR", &master_addr)
            .env("MASTER_PORT", &port)
            .env("RINGWATCH_JOB_ID", &job.job_id)
            .envs(job.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(if rank == 0 {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stderr(Stdio::piped());
        let mut child = match command.spawn() {
            Ok(child) => child,
            Err(error) => {
                kill_all(&mut ranks);
                return Err(error).with_context(|| {
                    format!(
                        "cannot start rank {rank} in {}",
                        job.topology.namespace(node)
                    )
                });
            }
        };
        topology::register_child(child.id());
        let stdout = child.stdout.take().map(drain);
        let stderr = drain(child.stderr.take().expect("stderr is piped"));
        ranks.push(Rank {
            rank,
            child,
            stdout,
            stderr,
        });
    }
    let deadline = Instant::now() + job.timeout;
    let mut done = vec![false; world_size];
    let failure = loop {
        let mut failure = None;
        for (i, rank) in ranks.iter_mut().enumerate() {
            if done[i] {
                continue;
            }
            match rank.child.try_wait() {
                Ok(Some(status)) => {
                    done[i] = true;
                    topology::unregister_child(rank.child.id());
                    if !status.success() {
                        failure.get_or_insert(format!("rank {} failed ({status})", rank.rank));
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    failure.get_or_insert(format!("cannot wait for rank {}: {error}", rank.rank));
                }
            }
        }
        if failure.is_some() || done.iter().all(|&d| d) {
            break failure;
        }
        if stop.load(Ordering::Relaxed) {
            break Some(format!("job {} stopped", job.job_id));
        }
        if Instant::now() > deadline {
            break Some(format!(
                "job {} still running after {:?} (raise the timeout or lower the steps)",
                job.job_id, job.timeout
            ));
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    if let Some(failure) = failure {
        // The other ranks would fail on their own after their peer timeout; no
        // reason to wait for that.
        kill_all(&mut ranks);
        let mut messages = Vec::new();
        for rank in ranks {
            let text = rank.stderr.join().unwrap_or_default();
            let tail: Vec<&str> = text.lines().rev().take(3).collect();
            if !tail.is_empty() {
                let tail: Vec<&str> = tail.into_iter().rev().collect();
                messages.push(format!("rank {}: {}", rank.rank, tail.join(" | ")));
            }
        }
        bail!("{failure}; stderr: {}", messages.join("; "));
    }
    let mut output = String::new();
    for rank in ranks {
        if let Some(stdout) = rank.stdout {
            output = stdout.join().unwrap_or_default();
        }
    }
    Ok(output)
}

/// What `collbench --json resnet50` prints (rank 0 only).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Resnet50Result {
    /// Ranks in the job.
    pub world_size: usize,
    /// The knobs the runtime ran with (as it reports them).
    pub knobs: serde_json::Value,
    /// Gradient bytes allreduced per step.
    pub bytes_per_step: u64,
    /// Timed steps.
    pub steps: usize,
    /// Steps per second over the timed steps.
    pub steps_per_sec: f64,
    /// Algorithm bandwidth: bytes per step × steps/s, GB/s.
    pub algbw_gbps: f64,
    /// Bus bandwidth: algbw × 2(n-1)/n, GB/s.
    pub busbw_gbps: f64,
}

/// How to run `collbench resnet50` across the pretend nodes.
#[derive(Debug, Clone)]
pub struct Resnet50 {
    /// Ranks on each node (the job has `nodes × ranks_per_node` ranks).
    pub ranks_per_node: usize,
    /// Timed steps.
    pub steps: usize,
    /// Untimed warm-up steps.
    pub warmup: usize,
    /// Extra environment for every rank.
    pub env: Vec<(String, String)>,
}

/// Runs `collbench --json [knobs] resnet50 --steps S --warmup W` across every
/// node of `topology`; `knobs: None` runs on the runtime's defaults (no knob
/// flags, no knob variables).
pub fn resnet50(
    topology: &Topology,
    collbench: &Path,
    spec: &Resnet50,
    knobs: Option<Knobs>,
    job_id: &str,
) -> Result<Resnet50Result> {
    let (ranks_per_node, steps, warmup) = (spec.ranks_per_node, spec.steps, spec.warmup);
    let mut args = vec!["--json".to_owned()];
    if let Some(knobs) = knobs {
        args.extend(knobs.flags());
    }
    args.extend([
        "resnet50".into(),
        "--steps".into(),
        steps.to_string(),
        "--warmup".into(),
        warmup.to_string(),
    ]);
    // Generous: even 100 Mbit/s moves a ResNet-50 step in a few seconds.
    let timeout = Duration::from_secs(60 + 10 * (steps + warmup) as u64);
    let job = Job {
        topology,
        placement: block_placement(topology.nodes(), ranks_per_node),
        collbench: collbench.to_path_buf(),
        args,
        env: spec.env.clone(),
        job_id: job_id.to_owned(),
        timeout,
    };
    let output = run(&job).with_context(|| format!("resnet50 job {job_id}"))?;
    last_json(&output, &format!("job {job_id}"))
}

/// The last line of a job's output (rank 0's stdout) that is a JSON object, parsed: how
/// collbench and examples/pytorch/train.py report a result. `what` names the job in errors.
pub fn last_json<T: serde::de::DeserializeOwned>(output: &str, what: &str) -> Result<T> {
    let line = output
        .lines()
        .rev()
        .find(|l| l.trim_start().starts_with('{'))
        .with_context(|| format!("{what}: rank 0 printed no JSON: {output:?}"))?;
    serde_json::from_str(line).with_context(|| format!("{what}: rank 0 printed {line:?}"))
}

/// Plain TCP throughput (one direction, and each direction of both at once),
/// GB/s, between two ranks placed on `nodes.0` and `nodes.1`
/// (`collbench --json link`).
pub fn link(
    topology: &Topology,
    collbench: &Path,
    nodes: (usize, usize),
    bytes: &str,
) -> Result<(f64, f64)> {
    let job = Job {
        topology,
        placement: vec![nodes.0, nodes.1],
        collbench: collbench.to_path_buf(),
        args: vec![
            "--json".into(),
            "link".into(),
            "--bytes".into(),
            bytes.into(),
        ],
        env: Vec::new(),
        job_id: format!("link-{}-{}", nodes.0, nodes.1),
        timeout: Duration::from_secs(120),
    };
    let output = run(&job)?;
    let value: serde_json::Value = output
        .lines()
        .rev()
        .find_map(|l| serde_json::from_str(l).ok())
        .with_context(|| format!("collbench link printed no JSON: {output:?}"))?;
    let field = |name: &str| {
        value
            .get(name)
            .and_then(serde_json::Value::as_f64)
            .with_context(|| format!("collbench link's JSON has no {name}: {value}"))
    };
    Ok((
        field("unidirectional_gbps")?,
        field("bidirectional_gbps_per_direction")?,
    ))
}
