//! `cargo xtask bench train`: data-parallel training of a real torchvision
//! model (`examples/pytorch/train.py`) on ringwatch, on PyTorch DDP with
//! gloo and on Horovod with gloo, side by side: steps/s and images/s of each
//! (interleaved rounds, medians), and each one's losses against a
//! single-process run on the combined batch (the proof that its gradients
//! are right).
//!
//! Jobs run on pretend nodes (network namespaces, as the other multi-node
//! benches): one node of 4 ranks (shared memory for ringwatch, loopback TCP
//! for gloo) and 2 nodes of 2 ranks joined by a rate-limited link. Horovod is
//! an optional contender: it is built from PyPI into target/horovod-venv on
//! first use (~15 minutes on 2 cores) unless --no-horovod.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::multinode::{self, Job};
use crate::topology::Topology;
use crate::venv::path_str;

/// The flags of `bench train`.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "train")]
pub struct Args {
    /// Timed training steps per job.
    #[arg(long = "train-steps", default_value_t = 20)]
    pub train_steps: usize,
    /// Untimed steps first.
    #[arg(long = "train-warmup", default_value_t = 3)]
    pub train_warmup: usize,
    /// Images per rank per step.
    #[arg(long = "train-batch", default_value_t = 8)]
    pub train_batch: usize,
    /// torchvision model.
    #[arg(long = "train-model", default_value = "resnet18")]
    pub train_model: String,
    /// Interleaved rounds (each contender once per round); medians are reported.
    #[arg(long = "train-rounds", default_value_t = 2)]
    pub train_rounds: usize,
    /// Inter-node rate of the 2 × 2 layout, Mbit/s each way.
    #[arg(long = "train-rate-mbit", default_value_t = 3000)]
    pub train_rate_mbit: u32,
    /// Steps of the float64 runs whose losses are compared with one process's.
    #[arg(long = "train-check-steps", default_value_t = 10)]
    pub train_check_steps: usize,
    /// Leave Horovod out (it builds from PyPI on first use, ~15 minutes).
    #[arg(long)]
    pub no_horovod: bool,
    /// Where the results go as JSON.
    #[arg(long = "train-out", default_value = "target/bench/train.json")]
    pub train_out: PathBuf,
}

/// What train.py prints (rank 0).
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Run {
    backend: String,
    world: usize,
    steps: usize,
    steps_per_s: f64,
    images_per_s: f64,
    losses: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct Row {
    layout: String,
    contender: String,
    steps_per_s: Vec<f64>,
    median_steps_per_s: f64,
    median_images_per_s: f64,
    f32_max_rel_loss_diff: f64,
    f64_losses: Option<Vec<f64>>,
    f64_max_rel_loss_diff: Option<f64>,
    load_average: Vec<f64>,
    failures: Vec<String>,
}

const HOROVOD_PIN: &str = "horovod==0.28.1";

fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next().and_then(|v| v.parse().ok()))
        .unwrap_or(f64::NAN)
}

/// target/horovod-venv with Horovod 0.28.1 over Debian's torch, built on first use.
fn horovod(target_dir: &Path) -> Result<PathBuf> {
    let venv = target_dir.join("horovod-venv");
    let python = venv.join("bin/python");
    let works = |p: &Path| {
        Command::new(p)
            .args(["-c", "import horovod.torch"])
            .output()
            .is_ok_and(|o| o.status.success())
    };
    if python.is_file() && works(&python) {
        return Ok(python);
    }
    crate::ensure_packages(
        &[
            ("cmake", "builds Horovod's C++ core"),
            ("g++", "compiles Horovod's C++ core"),
        ],
        crate::which,
    )?;
    // Debian's python3-torch has no C++ headers; Horovod's extension needs them
    // (and pybind11's, which torch's include).
    crate::ensure_packages(
        &[
            (
                "libtorch-dev",
                "torch's C++ headers (torch/extension.h), which Horovod's PyTorch extension compiles against",
            ),
            (
                "pybind11-dev",
                "pybind11's headers, which torch's C++ headers include",
            ),
        ],
        |package| match package {
            "libtorch-dev" => Path::new("/usr/include/torch/extension.h").exists(),
            _ => Path::new("/usr/include/pybind11/pybind11.h").exists(),
        },
    )?;
    eprintln!(
        "xtask: building {HOROVOD_PIN} from PyPI into {} (gloo, PyTorch; ~15 minutes on 2 cores)",
        venv.display()
    );
    // Debian's Python (its torch is the one the venv sees), not another on PATH.
    crate::run(
        "/usr/bin/python3",
        &[
            "-m",
            "venv",
            "--clear",
            "--system-site-packages",
            path_str(&venv)?,
        ],
    )?;
    let status = Command::new(venv.join("bin/pip"))
        .args(["install", "--no-cache-dir", HOROVOD_PIN])
        .envs([
            ("HOROVOD_WITH_PYTORCH", "1"),
            ("HOROVOD_WITH_GLOO", "1"),
            ("HOROVOD_WITHOUT_MPI", "1"),
            ("HOROVOD_WITHOUT_TENSORFLOW", "1"),
            ("HOROVOD_WITHOUT_MXNET", "1"),
        ])
        .status()
        .context("could not start pip")?;
    if !status.success() || !works(&python) {
        bail!("building {HOROVOD_PIN} failed ({status}); --no-horovod leaves it out");
    }
    Ok(python)
}

/// Horovod's rendezvous server (what horovodrun runs) on node 0; dropped: stopped.
struct HorovodRendezvous {
    child: std::process::Child,
    port: u16,
}

impl HorovodRendezvous {
    fn start(topology: &Topology, python: &Path, script: &Path, spec: &str) -> Result<Self> {
        let mut child = topology
            .command(0, python)
            .arg(script)
            .args(["--horovod-rendezvous", spec])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting Horovod's rendezvous server")?;
        let mut line = String::new();
        BufReader::new(child.stdout.take().context("piped stdout")?)
            .read_line(&mut line)
            .context("reading the rendezvous server's port")?;
        let port = line
            .trim()
            .parse()
            .with_context(|| format!("the rendezvous server printed {line:?}, not a port"));
        match port {
            Ok(port) => Ok(HorovodRendezvous { child, port }),
            Err(e) => {
                let _ = child.kill();
                let _ = child.wait();
                Err(e)
            }
        }
    }
}

impl Drop for HorovodRendezvous {
    fn drop(&mut self) {
        // Its stdin closing ends it; the kill is for one that does not listen.
        drop(self.child.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn median(values: &[f64]) -> f64 {
    let mut v: Vec<f64> = values.iter().copied().filter(|x| x.is_finite()).collect();
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

fn max_rel_diff(got: &[f64], want: &[f64]) -> f64 {
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs() / b.abs().max(1e-12))
        .fold(0.0, f64::max)
}

/// Each pretend node's `/etc/hosts` (`ip netns exec` mounts `/etc/netns/<ns>/hosts`
/// over it) saying that this machine's host name is the node's own address, as on a real
/// node. Horovod's gloo contexts for process sets find their address by the host name,
/// which on this machine resolves to 127.0.0.1: unreachable from the other nodes.
struct NodeHosts(Vec<PathBuf>);

impl NodeHosts {
    fn write(topology: &Topology) -> Result<Self> {
        let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .context("reading the host name")?
            .trim()
            .to_string();
        let mut dirs = Vec::new();
        for node in 0..topology.nodes() {
            let dir = PathBuf::from("/etc/netns").join(topology.namespace(node));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            dirs.push(dir.clone());
            std::fs::write(
                dir.join("hosts"),
                format!("127.0.0.1 localhost\n{} {host}\n", topology.address(node)),
            )
            .with_context(|| format!("writing {}/hosts", dir.display()))?;
        }
        Ok(NodeHosts(dirs))
    }
}

impl Drop for NodeHosts {
    fn drop(&mut self) {
        for dir in &self.0 {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// One contender's job on `topology` with train.py's `extra` flags.
#[allow(clippy::too_many_arguments, reason = "a bench's one job, spelled out")]
fn job(
    topology: &Topology,
    (nodes, per_node): (usize, usize),
    name: &str,
    python: &Path,
    script: &Path,
    extra: &[String],
    job_id: String,
    timeout: Duration,
) -> Result<Run> {
    let mut env = vec![("OMP_NUM_THREADS".to_string(), "1".to_string())];
    let _rendezvous = if name == "horovod" {
        let r = HorovodRendezvous::start(topology, python, script, &format!("{nodes}x{per_node}"))?;
        env.push(("RW_HOROVOD_RENDEZVOUS_PORT".into(), r.port.to_string()));
        Some(r)
    } else {
        None
    };
    let mut args = vec![
        path_str(script)?.to_string(),
        "--backend".into(),
        name.into(),
    ];
    args.extend(extra.iter().cloned());
    let job = Job {
        topology,
        placement: multinode::block_placement(nodes, per_node),
        collbench: python.to_path_buf(),
        args,
        env,
        job_id,
        timeout,
    };
    multinode::run(&job).and_then(|output| multinode::last_json(&output, name))
}

/// The single-process reference on `world` ranks' combined batch.
fn single(python: &Path, script: &Path, extra: &[String]) -> Result<Run> {
    let out = Command::new(python)
        .arg(script)
        .args(["--backend", "single", "--world", "4"])
        .args(extra)
        .env("OMP_NUM_THREADS", "1")
        .stderr(Stdio::inherit())
        .output()
        .context("running the single-process reference")?;
    if !out.status.success() {
        bail!("the single-process reference failed ({})", out.status);
    }
    multinode::last_json(&String::from_utf8_lossy(&out.stdout), "single")
}

/// `cargo xtask bench train` (root: pretend nodes).
pub fn run(root: &Path, args: &Args) -> Result<()> {
    if !crate::is_root() {
        bail!("bench train runs its jobs on pretend nodes (network namespaces), which need root");
    }
    if args.train_steps == 0 || args.train_rounds == 0 || args.train_batch == 0 {
        bail!("--train-steps, --train-rounds and --train-batch must be at least 1");
    }
    let started = Instant::now();
    let target_dir = crate::cargo_target_dir(root);
    crate::ensure_packages(
        &[(
            "python3-torchvision",
            "the bench's model (torchvision's ResNet)",
        )],
        crate::python::package_present,
    )?;
    let venv = crate::python::install(root, &target_dir, false)?;
    let python = venv.join("bin/python");
    let horovod_python = if args.no_horovod {
        None
    } else {
        Some(horovod(&target_dir)?)
    };
    let script = root.join("examples/pytorch/train.py");
    let model = vec![
        "--model".to_string(),
        args.train_model.clone(),
        "--batch-size".into(),
        args.train_batch.to_string(),
    ];
    let timed: Vec<String> = [
        model.clone(),
        vec![
            "--steps".into(),
            args.train_steps.to_string(),
            "--warmup".into(),
            args.train_warmup.to_string(),
        ],
    ]
    .concat();
    let checked: Vec<String> = [
        model,
        vec![
            "--steps".into(),
            args.train_check_steps.to_string(),
            "--warmup".into(),
            "0".into(),
            "--dtype".into(),
            "float64".into(),
        ],
    ]
    .concat();

    eprintln!(
        "xtask: the single-process references (4 ranks' combined batch; float32, float64)..."
    );
    let single32 = single(&python, &script, &timed)?;
    let single64 = single(&python, &script, &checked)?;

    let mut contenders: Vec<(&str, PathBuf)> =
        vec![("ringwatch", python.clone()), ("ddp", python.clone())];
    if let Some(h) = &horovod_python {
        contenders.push(("horovod", h.clone()));
    }
    let mut rows = Vec::new();
    let timeout = Duration::from_secs(120 + 20 * (args.train_steps + args.train_warmup) as u64);
    for (nodes, per_node) in [(1usize, 4usize), (2, 2)] {
        let layout = format!("{nodes} x {per_node}");
        let topology = Topology::create("rwtrain", nodes, args.train_rate_mbit)?;
        let _hosts = NodeHosts::write(&topology)?;
        let n = contenders.len();
        let mut runs: Vec<Vec<Run>> = vec![Vec::new(); n];
        let mut loads: Vec<Vec<f64>> = vec![Vec::new(); n];
        let mut failures: Vec<Vec<String>> = vec![Vec::new(); n];
        let mut checks: Vec<Option<Run>> = vec![None; n];
        let run_one = |name: &str, py: &Path, extra: &[String], id: String| {
            job(
                &topology,
                (nodes, per_node),
                name,
                py,
                &script,
                extra,
                id,
                timeout,
            )
        };
        for round in 0..args.train_rounds {
            for (i, (name, py)) in contenders.iter().enumerate() {
                eprintln!(
                    "xtask: [{layout}] round {}/{} {name}...",
                    round + 1,
                    args.train_rounds
                );
                let load = load_average();
                let id = format!("train-{name}-{nodes}x{per_node}-{round}");
                // A contender that fails is reported as failed; the others still run.
                match run_one(name, py, &timed, id) {
                    Ok(run) => {
                        eprintln!(
                            "xtask: [{layout}] {name}: {:.3} steps/s (load {load:.1})",
                            run.steps_per_s
                        );
                        runs[i].push(run);
                        loads[i].push(load);
                    }
                    Err(e) => {
                        eprintln!("xtask: [{layout}] {name} failed: {e:#}");
                        failures[i].push(format!("round {}: {e:#}", round + 1));
                    }
                }
            }
        }
        for (i, (name, py)) in contenders.iter().enumerate() {
            eprintln!("xtask: [{layout}] {name}: losses in float64...");
            let id = format!("train-{name}-{nodes}x{per_node}-f64");
            match run_one(name, py, &checked, id) {
                Ok(run) => checks[i] = Some(run),
                Err(e) => failures[i].push(format!("float64 check: {e:#}")),
            }
        }
        drop(topology);
        for (i, (name, _)) in contenders.iter().enumerate() {
            let sps: Vec<f64> = runs[i].iter().map(|r| r.steps_per_s).collect();
            let ips: Vec<f64> = runs[i].iter().map(|r| r.images_per_s).collect();
            let diff32 = runs[i]
                .iter()
                .map(|r| max_rel_diff(&r.losses, &single32.losses))
                .fold(f64::NAN, f64::max);
            rows.push(Row {
                layout: layout.clone(),
                contender: name.to_string(),
                median_steps_per_s: median(&sps),
                median_images_per_s: median(&ips),
                steps_per_s: sps,
                f32_max_rel_loss_diff: diff32,
                f64_losses: checks[i].as_ref().map(|r| r.losses.clone()),
                f64_max_rel_loss_diff: checks[i]
                    .as_ref()
                    .map(|r| max_rel_diff(&r.losses, &single64.losses)),
                load_average: loads[i].clone(),
                failures: failures[i].clone(),
            });
        }
    }

    let total = args.train_steps + args.train_warmup;
    println!(
        "# {} (GroupNorm), {} images/rank/step of 64x64, {total} steps ({} timed), \
         {} interleaved rounds, medians; 2 x 2 joined at {} Mbit/s; 2 cores",
        args.train_model,
        args.train_batch,
        args.train_steps,
        args.train_rounds,
        args.train_rate_mbit
    );
    println!(
        "| layout | contender | steps/s | images/s | vs ringwatch | load avg | \
         float64 loss at step {} (single: {:.12}) | max rel. diff, float64 | \
         max rel. diff, float32 ({total} steps) |",
        args.train_check_steps,
        single64.losses.last().copied().unwrap_or(f64::NAN)
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for row in &rows {
        let ours = rows
            .iter()
            .find(|r| r.layout == row.layout && r.contender == "ringwatch")
            .map_or(f64::NAN, |r| r.median_steps_per_s);
        let speed = if row.steps_per_s.is_empty() {
            "failed | | |".to_string()
        } else {
            format!(
                "{:.3} | {:.1} | {:.2}x",
                row.median_steps_per_s,
                row.median_images_per_s,
                row.median_steps_per_s / ours
            )
        };
        let check = match (&row.f64_losses, row.f64_max_rel_loss_diff) {
            (Some(l), Some(d)) => {
                format!("{:.12} | {d:.1e}", l.last().copied().unwrap_or(f64::NAN))
            }
            _ => "failed | ".to_string(),
        };
        println!(
            "| {} | {} | {speed} | {} | {check} | {:.1e} |",
            row.layout,
            row.contender,
            row.load_average
                .iter()
                .map(|l| format!("{l:.1}"))
                .collect::<Vec<_>>()
                .join("/"),
            row.f32_max_rel_loss_diff,
        );
    }
    for row in rows.iter().filter(|r| !r.failures.is_empty()) {
        println!(
            "# {} on {} failed: {}",
            row.contender,
            row.layout,
            row.failures.join("; ")
        );
    }
    let out = crate::under_root(root, &args.train_out);
    crate::write_json_report(
        &out,
        &serde_json::json!({ "single_float32": single32, "single_float64": single64, "rows": rows }),
        started,
    )
}
