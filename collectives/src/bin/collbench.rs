//! `collbench`: benchmarks of the collective runtime, nccl-tests style.
//!
//! Run without `RANK` in the environment it is a launcher (like `torchrun
//! --nproc-per-node N`): it starts N copies of itself on this machine with `RANK`,
//! `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_SIZE`, `MASTER_ADDR`, `MASTER_PORT` set, and rank 0
//! prints the table. With `RANK` and `WORLD_SIZE` set (by this launcher, torchrun, mpirun, or
//! by hand inside a network namespace) it runs as that one rank.
//!
//! Signals, as torchrun: the launcher passes SIGINT/SIGTERM on to its ranks, waits for
//! them (SIGKILL after [`STOP_GRACE`], or at a second signal) and exits with 128 + the
//! signal; its ranks get SIGTERM if the launcher itself dies (`PR_SET_PDEATHSIG`). A rank
//! that gets SIGINT/SIGTERM interrupts its runtime (the others are told which rank left,
//! and rank 0's control socket file is removed) and exits with 128 + the signal.
//!
//! It is a measuring tool: it must never change what the library does, only call it.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, ExitCode, Stdio};
use std::sync::Mutex;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::{Args, Parser, Subcommand};
use collectives::Knobs;
use collectives::control::AutotuneState;
use collectives::runtime::RuntimeConfig;
use collectives::transport::configure_stream;
use collectives::{Interrupter, ReduceOp, Runtime, Tensor};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use signal_hook::consts::{SIGINT, SIGTERM};
use signal_hook::iterator::Signals;

/// How long the launcher waits for its ranks after passing a signal on (or after a rank
/// failed) before it kills them, as torchrun's default.
const STOP_GRACE: Duration = Duration::from_secs(30);

/// The SIGINT/SIGTERM a rank got (0: none yet).
static RANK_SIGNAL: AtomicI32 = AtomicI32::new(0);

/// This rank's runtime, once it runs, for the signal thread to interrupt.
static RANK_INTERRUPTER: Mutex<Option<Interrupter>> = Mutex::new(None);

/// Benchmarks for ringwatch's collective runtime.
///
/// Examples:
///   collbench sweep -n 4                  # allreduce sizes 4 KiB..256 MiB on 4 local ranks
///   collbench resnet50 -n 4 --fusion-threshold 0
///   collbench link                        # plain TCP throughput between two processes
///   RANK=1 WORLD_SIZE=2 MASTER_ADDR=10.0.0.1 collbench resnet50   # one rank of a job
#[derive(Parser, Debug)]
#[command(version, verbatim_doc_comment)]
struct Cli {
    #[command(flatten)]
    common: Common,
    #[command(subcommand)]
    workload: Option<Workload>,
}

#[derive(Args, Debug, Clone)]
struct Common {
    /// Ranks to start on this machine (launcher mode; ignored when RANK is set).
    #[arg(
        short = 'n',
        long,
        env = "COLLBENCH_NPROC",
        default_value_t = 4,
        global = true
    )]
    nproc_per_node: usize,
    /// Group the local ranks into pretend nodes of this many ranks (for hierarchical
    /// allreduce); default: all ranks on one node. Ranks of one pretend node exchange data
    /// through shared memory, ranks of different ones over TCP (loopback), as on real
    /// nodes (RINGWATCH_SHM=0: TCP everywhere).
    #[arg(long, global = true)]
    local_size: Option<usize>,
    /// Fusion threshold in bytes (0 disables fusion) [runtime default: 64 MiB].
    #[arg(long, env = "RINGWATCH_FUSION_THRESHOLD", global = true)]
    fusion_threshold: Option<u64>,
    /// Cycle time: a duration (`2ms`, `500us`) or a bare number of milliseconds
    /// [runtime default: 1].
    #[arg(long, env = "RINGWATCH_CYCLE_TIME_MS", global = true, value_parser = cycle_time_ms)]
    cycle_time_ms: Option<f64>,
    /// Use hierarchical allreduce.
    #[arg(long, env = "RINGWATCH_HIERARCHICAL_ALLREDUCE", global = true)]
    hierarchical: Option<bool>,
    /// Print JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    /// Measure plain TCP throughput between two local processes (same as `link`).
    #[arg(long, global = true)]
    link: bool,
}

#[derive(Subcommand, Debug, Clone)]
enum Workload {
    /// Allreduce of one f32 tensor per size, from --min-bytes to --max-bytes by --factor;
    /// prints size, time, algbw and busbw = algbw * 2(n-1)/n.
    Sweep {
        /// Smallest size in bytes.
        #[arg(long, default_value = "4096", value_parser = parse_bytes)]
        min_bytes: u64,
        /// Largest size in bytes.
        #[arg(long, default_value = "256M", value_parser = parse_bytes)]
        max_bytes: u64,
        /// Size multiplier between rows.
        #[arg(long, default_value_t = 2)]
        factor: u64,
        /// Timed iterations per size (default: adaptive, about 1 GiB of data per size).
        #[arg(long)]
        iters: Option<usize>,
        /// Untimed calls per size after the checked one, before the timed ones (the
        /// first calls of a tensor also negotiate its name and fill the response cache).
        #[arg(long, default_value_t = 0)]
        warmup: usize,
        /// Tensors in GPU memory (build with the `cuda` feature): each rank on GPU
        /// LOCAL_RANK modulo the GPUs it sees. Through NCCL where every rank has a GPU of
        /// its own, else staged through host memory (RINGWATCH_NCCL=0 stages always).
        #[arg(long)]
        gpu: bool,
        /// Tensors in memory that the ranks of a host share (Runtime::shared_tensor):
        /// above 64 KiB a one-host job reduces them in place, with no staging copies.
        #[arg(long, conflicts_with = "gpu")]
        shared_tensors: bool,
    },
    /// Each step allreduces ResNet-50's 161 gradient tensors (real sizes, f32) in backward
    /// order, as a framework would; prints steps/s and effective bandwidth.
    ///
    /// With --duration or --until-tuned the number of steps is decided by rank 0 (its
    /// clock, its autotune state) and carried to every rank by a one-element allreduce
    /// enqueued with each step's gradients. The output then also gives steps/s of the first
    /// steps (all on the starting knobs) and of the last steps (all on the final knobs),
    /// leaving out steps during which the knobs changed.
    Resnet50 {
        /// Timed steps (with --until-tuned: timed steps after tuning is over).
        #[arg(long, default_value_t = 10)]
        steps: usize,
        /// Untimed warm-up steps.
        #[arg(long, default_value_t = 2)]
        warmup: usize,
        /// Run timed steps until this many seconds have passed (instead of --steps); with
        /// --until-tuned, a limit.
        #[arg(long, env = "COLLBENCH_DURATION_SECS")]
        duration: Option<f64>,
        /// Run until the job's tuning is over (RINGWATCH_AUTOTUNE=1: rank 0 tunes itself or
        /// an agent tunes it), then --steps more timed steps on the final knobs.
        #[arg(long)]
        until_tuned: bool,
        /// Gradients in memory that the ranks of a host share (Runtime::shared_tensor), as
        /// a training loop that keeps them there would have them.
        #[arg(long)]
        shared_tensors: bool,
    },
    /// Plain TCP throughput between two local processes (the bound a ring cannot beat).
    Link {
        /// Bytes per direction.
        #[arg(long, default_value = "2G", value_parser = parse_bytes)]
        bytes: u64,
    },
}

/// `--cycle-time-ms`: what `RINGWATCH_CYCLE_TIME_MS` takes, as milliseconds.
fn cycle_time_ms(value: &str) -> Result<f64, String> {
    let name = "RINGWATCH_CYCLE_TIME_MS";
    collectives::knobs::parse_duration(name, value, collectives::knobs::BareUnit::Milliseconds)
        .map(|d| d.as_secs_f64() * 1e3)
        .map_err(|e| e.to_string())
}

fn parse_bytes(s: &str) -> std::result::Result<u64, String> {
    let s = s.trim();
    let (num, mult) = match s.chars().last() {
        Some('K' | 'k') => (&s[..s.len() - 1], 1u64 << 10),
        Some('M' | 'm') => (&s[..s.len() - 1], 1 << 20),
        Some('G' | 'g') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<u64>()
        .map(|n| n * mult)
        .map_err(|_| format!("{s:?} is not a size (e.g. 4096, 64K, 256M, 2G)"))
}

fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        // No colour codes in a log that goes to a file or a pipe.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let cli = Cli::parse();
    let workload = match (&cli.workload, cli.common.link) {
        (Some(w), _) => w.clone(),
        (None, true) => Workload::Link { bytes: 2 << 30 },
        (None, false) => {
            eprintln!("collbench: name a workload (sweep, resnet50, link) or --link; see --help");
            return ExitCode::FAILURE;
        }
    };
    let is_rank =
        std::env::var_os("RANK").is_some() || std::env::var_os("OMPI_COMM_WORLD_RANK").is_some();
    let result = if is_rank {
        interrupt_on_signal().and_then(|()| worker(&cli, &workload))
    } else {
        launch(&cli, &workload)
    };
    let signal = match &result {
        Ok(Some(signal)) => Some(*signal),
        _ => Some(RANK_SIGNAL.load(Ordering::Acquire)).filter(|&s| s != 0),
    };
    if let Err(e) = &result {
        let rank = std::env::var("RANK").unwrap_or_else(|_| "launcher".into());
        eprintln!("collbench (rank {rank}): error: {e:#}");
    }
    match (signal, result) {
        (Some(signal), _) => ExitCode::from((128 + signal).clamp(0, 255) as u8),
        (None, Ok(_)) => ExitCode::SUCCESS,
        (None, Err(_)) => ExitCode::FAILURE,
    }
}

/// A rank: on SIGINT/SIGTERM, interrupt the runtime if it runs (the workload then fails
/// with the interruption, the runtime removes its control socket, and `main` exits with
/// 128 + the signal); before it runs there is nothing to clean up: exit at once.
fn interrupt_on_signal() -> Result<()> {
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).context("cannot install the SIGINT/SIGTERM handler")?;
    std::thread::Builder::new()
        .name("collbench-signals".into())
        .spawn(move || {
            for signal in signals.forever() {
                if RANK_SIGNAL
                    .compare_exchange(0, signal, Ordering::AcqRel, Ordering::Acquire)
                    .is_err()
                {
                    continue;
                }
                let name = if signal == SIGINT {
                    "SIGINT"
                } else {
                    "SIGTERM"
                };
                match RANK_INTERRUPTER.lock().ok().and_then(|i| i.clone()) {
                    Some(i) => i.interrupt(name),
                    None => std::process::exit(128 + signal),
                }
            }
        })
        .context("cannot start the signal thread")?;
    Ok(())
}

/// A port for rank 0's rendezvous, below the kernel's ephemeral range
/// (32768 and up by default): a port the kernel handed out and this process
/// gave back can be taken by any outgoing connection before rank 0 binds it,
/// and jobs started side by side (tests) open many.
fn free_port() -> Result<u16> {
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos())
        ^ std::process::id().wrapping_mul(2_654_435_761);
    for i in 0..64u32 {
        let port = 20_000 + (seed.wrapping_add(i.wrapping_mul(7_919)) % 12_000) as u16;
        if TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return Ok(port);
        }
    }
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Sends `signal` to every rank still running, waits for them up to `grace` (less if
/// `signals` brings a second signal), then kills what is left.
fn stop_ranks(running: &mut [(usize, Child)], signal: i32, grace: Duration, signals: &mut Signals) {
    for (_, c) in running.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            // SAFETY: kill(2) with the pid of a child this process has not reaped yet.
            unsafe { libc::kill(c.id() as libc::pid_t, signal) };
        }
    }
    let deadline = Instant::now() + grace;
    while running
        .iter_mut()
        .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
        && Instant::now() < deadline
        && signals.pending().next().is_none()
    {
        std::thread::sleep(Duration::from_millis(20));
    }
    for (rank, c) in running.iter_mut() {
        if matches!(c.try_wait(), Ok(None)) {
            eprintln!(
                "collbench: rank {rank} (pid {}) did not stop; killing it",
                c.id()
            );
            let _ = c.kill();
        }
        let _ = c.wait();
    }
}

/// Starts the ranks as child processes and waits for them; a failed rank stops the rest.
/// Returns the signal that stopped the job, if one did.
fn launch(cli: &Cli, workload: &Workload) -> Result<Option<i32>> {
    // Installed before any rank starts, so that no signal finds a rank unaccounted for.
    let mut signals =
        Signals::new([SIGINT, SIGTERM]).context("cannot install the SIGINT/SIGTERM handler")?;
    let n = match workload {
        Workload::Link { .. } => 2,
        _ => cli.common.nproc_per_node,
    };
    if n == 0 {
        bail!("--nproc-per-node must be at least 1");
    }
    let local_size = cli.common.local_size.unwrap_or(n);
    let port = free_port()?;
    // Each pretend node is a host of its own: shared memory within, TCP between.
    let host_id_base = std::env::var("RINGWATCH_HOST_ID").unwrap_or_default();
    let exe = std::env::current_exe().context("cannot find my own executable")?;
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("LOCAL_RANK", (rank % local_size).to_string())
            .env("LOCAL_SIZE", local_size.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env(
                "RINGWATCH_HOST_ID",
                format!("{host_id_base}collbench-node{}", rank / local_size),
            )
            .stdout(if rank == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        let launcher = std::process::id() as libc::pid_t;
        // SAFETY: runs in the child between fork and exec and calls only prctl(2) and
        // getppid(2), which are async-signal-safe.
        unsafe {
            cmd.pre_exec(move || {
                // A launcher that dies, even by SIGKILL, takes its ranks with it.
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGTERM) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() != launcher {
                    return Err(std::io::Error::other("the launcher is gone"));
                }
                Ok(())
            })
        };
        let child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                let mut started: Vec<(usize, Child)> = children.into_iter().enumerate().collect();
                stop_ranks(&mut started, SIGTERM, STOP_GRACE, &mut signals);
                return Err(e).with_context(|| format!("cannot start rank {rank}"));
            }
        };
        children.push(child);
    }
    let mut failed = None;
    let mut running: Vec<(usize, Child)> = children.into_iter().enumerate().collect();
    while !running.is_empty() {
        if let Some(signal) = signals.pending().next() {
            eprintln!(
                "collbench: signal {signal}: passing it on to {} rank(s) and waiting for them",
                running.len()
            );
            stop_ranks(&mut running, signal, STOP_GRACE, &mut signals);
            return Ok(Some(signal));
        }
        let mut still = Vec::new();
        for (rank, mut child) in running {
            match child.try_wait()? {
                Some(status) if !status.success() => {
                    failed.get_or_insert((rank, status));
                }
                Some(_) => {}
                None => still.push((rank, child)),
            }
        }
        running = still;
        if failed.is_some() {
            // The others fail on their own within their timeout; give them a moment to
            // report, then stop them as a signal would (so that they clean up).
            let deadline = Instant::now() + Duration::from_secs(5);
            while running
                .iter_mut()
                .any(|(_, c)| matches!(c.try_wait(), Ok(None)))
                && Instant::now() < deadline
            {
                std::thread::sleep(Duration::from_millis(50));
            }
            stop_ranks(&mut running, SIGTERM, STOP_GRACE, &mut signals);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    match failed {
        Some((rank, status)) => bail!("rank {rank} failed ({status})"),
        None => Ok(None),
    }
}

fn runtime(cli: &Cli) -> Result<Runtime> {
    let mut cfg = RuntimeConfig::from_env().context("bad configuration in the environment")?;
    let c = &cli.common;
    if let Some(v) = c.fusion_threshold {
        cfg.knobs.fusion_threshold_bytes = v;
    }
    if let Some(v) = c.cycle_time_ms {
        cfg.knobs.cycle_time_us = (v * 1000.0).round() as u64;
    }
    if let Some(v) = c.hierarchical {
        cfg.knobs.hierarchical_allreduce = v;
    }
    let rt = Runtime::new(cfg).context("cannot start the collective runtime")?;
    if let Ok(mut slot) = RANK_INTERRUPTER.lock() {
        *slot = Some(rt.interrupter());
    }
    Ok(rt)
}

/// Runs the workload as one rank; `Ok(None)` when it completed.
fn worker(cli: &Cli, workload: &Workload) -> Result<Option<i32>> {
    let outcome = match workload {
        Workload::Sweep {
            min_bytes,
            max_bytes,
            factor,
            iters,
            warmup,
            gpu,
            shared_tensors,
        } => sweep(
            cli,
            *min_bytes,
            *max_bytes,
            (*factor).max(2),
            *iters,
            *warmup,
            *gpu,
            *shared_tensors,
        ),
        Workload::Resnet50 {
            steps,
            warmup,
            duration,
            until_tuned,
            shared_tensors,
        } => resnet50(
            cli,
            Resnet50Run {
                steps: *steps,
                warmup: *warmup,
                duration: *duration,
                until_tuned: *until_tuned,
                shared_tensors: *shared_tensors,
            },
        ),
        Workload::Link { bytes } => link(cli, *bytes),
    };
    outcome.map(|()| None)
}

fn progress(len: u64, show: bool, what: &str) -> ProgressBar {
    if !show {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:40}] {pos}/{len} {elapsed}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar.set_message(what.to_string());
    bar
}

fn busbw_factor(n: usize) -> f64 {
    if n <= 1 {
        0.0
    } else {
        2.0 * (n - 1) as f64 / n as f64
    }
}

#[derive(Serialize)]
struct SweepRow {
    bytes: u64,
    count: u64,
    time_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    wrong: u64,
    /// Times rank 0's background cycle thread went to sleep during the timed calls
    /// (its voluntary context switches, the kernel's count): about one per cycle time
    /// while the callers run their own cycles.
    cycle_thread_sleeps: u64,
    /// How many of rank 0's cycles in the timed calls its caller ran itself.
    caller_cycles: u64,
    /// How many times in the timed calls rank 0's callers handed the engine back to the
    /// background thread, waking it (`Totals::handoffs`).
    cycle_thread_handoffs: u64,
}

/// Voluntary context switches (sleeps) of this process's background cycle threads
/// ("ringwatch-cycle-N", cut to 15 characters by the kernel), from /proc. Preemptions
/// by other load are left out.
fn cycle_thread_sleeps() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter(|t| {
            std::fs::read_to_string(t.path().join("comm"))
                .is_ok_and(|c| c.starts_with("ringwatch-cycle"))
        })
        .filter_map(|t| std::fs::read_to_string(t.path().join("status")).ok())
        .flat_map(|status| {
            status
                .lines()
                .filter(|l| l.starts_with("voluntary_ctxt_switches:"))
                .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
                .collect::<Vec<_>>()
        })
        .sum()
}

#[allow(clippy::too_many_arguments)] // the sweep's options, each its own
fn sweep(
    cli: &Cli,
    min: u64,
    max: u64,
    factor: u64,
    iters: Option<usize>,
    warmup: usize,
    gpu: bool,
    shared_tensors: bool,
) -> Result<()> {
    let rt = runtime(cli)?;
    let device = if gpu { Some(gpu_of(&rt)?) } else { None };
    let n = rt.world_size();
    let rank = rt.rank();
    let mut sizes = Vec::new();
    let mut s = min.max(4);
    while s <= max {
        sizes.push(s);
        s *= factor;
    }
    let bar = progress(sizes.len() as u64, rank == 0 && !cli.common.json, "sweep");
    let mut rows = Vec::new();
    for &bytes in &sizes {
        let count = (bytes / 4) as usize;
        let iters = iters.unwrap_or_else(|| ((1u64 << 30) / bytes).clamp(3, 50) as usize);
        let name = format!("sweep.{bytes}");
        let (secs, wrong, switches, caller_cycles, handoffs) = match device {
            Some(device) => {
                let (secs, wrong) = gpu_row(&rt, device, &name, count, warmup, iters)?;
                (secs, wrong, 0, 0, 0)
            }
            None => host_row(&rt, &name, count, warmup, iters, shared_tensors)?,
        };
        let algbw = bytes as f64 / secs / 1e9;
        rows.push(SweepRow {
            bytes,
            count: count as u64,
            time_us: secs * 1e6,
            algbw_gbps: algbw,
            busbw_gbps: algbw * busbw_factor(n),
            wrong,
            cycle_thread_sleeps: switches,
            caller_cycles,
            cycle_thread_handoffs: handoffs,
        });
        bar.inc(1);
    }
    bar.finish_and_clear();
    if rank == 0 {
        let (knobs, _) = rt.knobs();
        if cli.common.json {
            println!(
                "{}",
                serde_json::json!({
                    "workload": "sweep",
                    "world_size": n,
                    "knobs": knobs,
                    "shared_memory_peers": rt.shared_memory_peers(),
                    "shared_tensors": shared_tensors,
                    "in_place_allreduces": rt.totals().in_place_allreduces,
                    "cycles": rt.totals().cycles,
                    "settled_cycles": rt.totals().settled_cycles,
                    "quick_cycles": rt.totals().quick_cycles,
                    "gpu": device.map(|d| serde_json::json!({
                        "device": d,
                        "nccl_allreduces": rt.totals().nccl_allreduces,
                        "staged_allreduces": rt.totals().staged_allreduces,
                    })),
                    "rows": rows,
                })
            );
        } else {
            println!(
                "# collbench sweep: allreduce sum f32, {n} ranks, knobs {knobs:?}, rank 0's \
                 shared-memory peers {:?}{}",
                rt.shared_memory_peers(),
                if shared_tensors {
                    ", shared tensors"
                } else {
                    ""
                }
            );
            if let Some(d) = device {
                let t = rt.totals();
                println!(
                    "# GPU tensors on GPU {d}: {} NCCL allreduces, {} staged through host memory",
                    t.nccl_allreduces, t.staged_allreduces
                );
            }
            println!(
                "{:>12} {:>12} {:>12} {:>10} {:>10} {:>6}",
                "size(B)", "count", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "wrong"
            );
            for r in &rows {
                println!(
                    "{:>12} {:>12} {:>12.1} {:>10.3} {:>10.3} {:>6}",
                    r.bytes, r.count, r.time_us, r.algbw_gbps, r.busbw_gbps, r.wrong
                );
            }
        }
    }
    if rows.iter().any(|r| r.wrong > 0) {
        bail!("rank {rank}: some results were wrong");
    }
    rt.shutdown();
    Ok(())
}

/// One sweep row of host tensors: the seconds a call, the wrong elements of the first,
/// the cycle thread's sleeps and the callers' cycles during the timed calls.
fn host_row(
    rt: &Runtime,
    name: &str,
    count: usize,
    warmup: usize,
    iters: usize,
    shared: bool,
) -> Result<(f64, u64, u64, u64, u64)> {
    let (rank, n) = (rt.rank(), rt.world_size());
    // Exact check on the first call: every element sums to n(n+1)/2.
    let value = (rank + 1) as f32;
    let mut t = if shared {
        let mut t = rt.shared_tensor(collectives::DType::F32, &[count])?;
        for chunk in t.as_bytes_mut().chunks_exact_mut(4) {
            chunk.copy_from_slice(&value.to_ne_bytes());
        }
        t
    } else {
        Tensor::from_slice(&vec![value; count])
    };
    // Named once, as a training loop names its tensors: the timed calls measure the
    // allreduce, not the formatting of its name.
    t = rt.allreduce(name, t, ReduceOp::Sum)?;
    let want = (n * (n + 1) / 2) as f32;
    let wrong = t
        .to_vec::<f32>()
        .unwrap_or_default()
        .iter()
        .filter(|&&v| v != want)
        .count() as u64;
    for _ in 0..warmup {
        t = rt.allreduce(name, t, ReduceOp::Sum)?;
    }
    let (switches, before) = (cycle_thread_sleeps(), rt.totals());
    let start = Instant::now();
    for _ in 0..iters {
        t = rt.allreduce(name, t, ReduceOp::Sum)?;
    }
    let secs = start.elapsed().as_secs_f64() / iters as f64;
    let switches = cycle_thread_sleeps().saturating_sub(switches);
    let after = rt.totals();
    let caller_cycles = after.caller_cycles - before.caller_cycles;
    let handoffs = after.handoffs - before.handoffs;
    Ok((secs, wrong, switches, caller_cycles, handoffs))
}

/// The GPU of this rank: LOCAL_RANK modulo the GPUs this process sees.
#[cfg(feature = "cuda")]
fn gpu_of(rt: &Runtime) -> Result<i32> {
    let count = collectives::gpu::device_count().map_err(anyhow::Error::msg)?;
    let local = rt.ranks()[rt.rank()].local_rank;
    Ok(i32::try_from(local % count)?)
}

#[cfg(not(feature = "cuda"))]
fn gpu_of(_: &Runtime) -> Result<i32> {
    bail!("--gpu needs collbench built with the cuda feature (cargo build --features cuda)")
}

/// One sweep row of GPU tensors: the seconds a call and the wrong elements of the first.
#[cfg(feature = "cuda")]
fn gpu_row(
    rt: &Runtime,
    device: i32,
    name: &str,
    count: usize,
    warmup: usize,
    iters: usize,
) -> Result<(f64, u64)> {
    use collectives::DType;
    use collectives::gpu::DeviceBuffer;
    let (rank, n) = (rt.rank(), rt.world_size());
    let host = vec![(rank + 1) as f32; count];
    let buf =
        DeviceBuffer::upload(device, bytemuck::cast_slice(&host)).map_err(anyhow::Error::msg)?;
    // SAFETY: `buf` outlives every call below, each waited for.
    let tensor = || unsafe { buf.tensor(DType::F32, &[count]) };
    // SAFETY: as above.
    let call = || unsafe { rt.allreduce_device(name, tensor(), ReduceOp::Sum) };
    call()?;
    let want = (n * (n + 1) / 2) as f32;
    let got = buf.download().map_err(anyhow::Error::msg)?;
    let wrong = got
        .chunks_exact(4)
        .filter(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]) != want)
        .count() as u64;
    for _ in 0..warmup {
        call()?;
    }
    let start = Instant::now();
    for _ in 0..iters {
        call()?;
    }
    Ok((start.elapsed().as_secs_f64() / iters as f64, wrong))
}

#[cfg(not(feature = "cuda"))]
fn gpu_row(_: &Runtime, _: i32, _: &str, _: usize, _: usize, _: usize) -> Result<(f64, u64)> {
    bail!("--gpu needs collbench built with the cuda feature")
}

/// Parameter tensors of torchvision's ResNet-50, in forward (registration) order:
/// 161 tensors, 25,557,032 parameters.
fn resnet50_shapes() -> Vec<usize> {
    let mut sizes = vec![64 * 3 * 7 * 7, 64, 64];
    let mut in_ch = 64;
    for (blocks, width) in [(3usize, 64usize), (4, 128), (6, 256), (3, 512)] {
        let out = width * 4;
        for b in 0..blocks {
            sizes.extend([width * in_ch, width, width]);
            sizes.extend([width * width * 9, width, width]);
            sizes.extend([out * width, out, out]);
            if b == 0 {
                sizes.extend([out * in_ch, out, out]);
            }
            in_ch = out;
        }
    }
    sizes.extend([1000 * 2048, 1000]);
    sizes
}

/// How many steps `resnet50` runs.
#[derive(Debug, Clone, Copy)]
struct Resnet50Run {
    steps: usize,
    warmup: usize,
    duration: Option<f64>,
    until_tuned: bool,
    shared_tensors: bool,
}

/// One timed step: its wall time and the knobs in force when it started and ended.
#[derive(Debug, Clone, Copy)]
struct StepRecord {
    seconds: f64,
    knobs_before: Knobs,
    knobs_after: Knobs,
}

/// Steps/s of a run of steps that all ran on `knobs`.
#[derive(Debug, Clone, Serialize, PartialEq)]
struct Phase {
    knobs: Knobs,
    steps: usize,
    steps_per_sec: f64,
}

fn phase_of<'a>(records: impl Iterator<Item = &'a StepRecord>, knobs: Knobs) -> Option<Phase> {
    let mut steps = 0;
    let mut seconds = 0.0;
    for r in records {
        if r.knobs_before != knobs || r.knobs_after != knobs {
            break;
        }
        steps += 1;
        seconds += r.seconds;
    }
    (steps > 0 && seconds > 0.0).then(|| Phase {
        knobs,
        steps,
        steps_per_sec: steps as f64 / seconds,
    })
}

/// The leading steps on the first step's knobs, and the trailing steps on the last
/// step's knobs (a step during which the knobs changed belongs to neither).
fn first_and_last(records: &[StepRecord]) -> (Option<Phase>, Option<Phase>) {
    let first = records
        .first()
        .and_then(|r| phase_of(records.iter(), r.knobs_before));
    let last = records
        .last()
        .and_then(|r| phase_of(records.iter().rev(), r.knobs_after));
    (first, last)
}

fn resnet50(cli: &Cli, run: Resnet50Run) -> Result<()> {
    let rt = runtime(cli)?;
    let n = rt.world_size();
    let rank = rt.rank();
    if run.until_tuned && rank == 0 && rt.autotune_state() == AutotuneState::Off {
        bail!("--until-tuned needs RINGWATCH_AUTOTUNE=1 (the job is not being tuned)");
    }
    if let Some(d) = run.duration
        && !(d.is_finite() && d > 0.0)
    {
        bail!("--duration must be a positive number of seconds, got {d}");
    }
    let decided_by_rank0 = run.duration.is_some() || run.until_tuned;
    let shapes = resnet50_shapes();
    let total_bytes: usize = shapes.iter().map(|s| s * 4).sum();
    let grad = |count: usize| -> Result<Tensor> {
        let value = 1.0f32 / n as f32;
        if !run.shared_tensors {
            return Ok(Tensor::from_slice(&vec![value; count]));
        }
        let mut t = rt.shared_tensor(collectives::DType::F32, &[count])?;
        for chunk in t.as_bytes_mut().chunks_exact_mut(4) {
            chunk.copy_from_slice(&value.to_ne_bytes());
        }
        Ok(t)
    };
    let mut grads: Vec<Option<Tensor>> = shapes
        .iter()
        .map(|&s| grad(s).map(Some))
        .collect::<Result<_>>()?;
    let bar = if decided_by_rank0 {
        ProgressBar::hidden()
    } else {
        progress(
            (run.warmup + run.steps) as u64,
            rank == 0 && !cli.common.json,
            "resnet50",
        )
    };
    let mut index = 0usize;
    // One step; `last` is rank 0's vote that it is the last (other ranks vote 0). Returns
    // the step's wall time and whether every rank now stops.
    let mut step = |last: bool| -> Result<(Duration, bool)> {
        let start = Instant::now();
        // Backward order: the last layer's gradients are ready first.
        let mut handles = Vec::with_capacity(grads.len());
        for i in (0..grads.len()).rev() {
            let t = grads[i].take().context("gradient missing")?;
            handles.push((
                i,
                rt.allreduce_async(&format!("grad.{i}"), t, ReduceOp::Average)?,
            ));
        }
        let stop = if decided_by_rank0 {
            let vote = Tensor::from_slice(&[i32::from(last)]);
            Some(rt.allreduce_async(&format!("collbench.stop.{index}"), vote, ReduceOp::Max)?)
        } else {
            None
        };
        index += 1;
        for (i, h) in handles {
            grads[i] = Some(h.wait()?);
        }
        let stop = match stop {
            Some(h) => h.wait()?.to_vec::<i32>().context("stop flag")?[0] == 1,
            None => false,
        };
        // A tuning session scores the job by these marks: steps per second.
        rt.mark_step();
        Ok((start.elapsed(), stop))
    };
    for _ in 0..run.warmup {
        step(false)?;
        bar.inc(1);
    }
    let mut records: Vec<StepRecord> = Vec::new();
    let totals_before = rt.totals();
    let started = Instant::now();
    // The timed step index at whose start rank 0 first saw tuning over.
    let mut tuned_at: Option<usize> = None;
    let mut tuned_after_s: Option<f64> = None;
    loop {
        let k = records.len();
        let last = if !decided_by_rank0 {
            k + 1 >= run.steps
        } else {
            let out_of_time = run
                .duration
                .is_some_and(|d| started.elapsed().as_secs_f64() >= d);
            if run.until_tuned
                && tuned_at.is_none()
                && matches!(
                    rt.autotune_state(),
                    AutotuneState::Done | AutotuneState::Interrupted
                )
            {
                tuned_at = Some(k);
                tuned_after_s = Some(started.elapsed().as_secs_f64());
            }
            let tail_done =
                run.until_tuned && tuned_at.is_some_and(|t| k + 1 >= t + run.steps.max(1));
            rank == 0 && (out_of_time || tail_done)
        };
        if run.steps == 0 && !decided_by_rank0 {
            break;
        }
        let knobs_before = rt.knobs().0;
        let (elapsed, stop) = step(last)?;
        records.push(StepRecord {
            seconds: elapsed.as_secs_f64(),
            knobs_before,
            knobs_after: rt.knobs().0,
        });
        bar.inc(1);
        if stop || (!decided_by_rank0 && last) {
            break;
        }
    }
    bar.finish_and_clear();
    let totals = rt.totals();
    let steps = records.len();
    // Rank 0 takes part in every negotiation, so its count is the whole job's.
    let negotiation_bytes = totals.negotiation_bytes - totals_before.negotiation_bytes;
    let cycles = totals.cycles - totals_before.cycles;
    let per = |n: u64| negotiation_bytes.checked_div(n).unwrap_or(0);
    let settled = totals.settled_cycles - totals_before.settled_cycles;
    let negotiation = serde_json::json!({"bytes": negotiation_bytes, "cycles": cycles,
        "settled_cycles": settled,
        "bytes_per_step": per(steps as u64), "bytes_per_cycle": per(cycles)});
    let total: f64 = records.iter().map(|r| r.seconds).sum();
    let steps_per_sec = if total > 0.0 {
        steps as f64 / total
    } else {
        0.0
    };
    let algbw = total_bytes as f64 * steps_per_sec / 1e9;
    if rank == 0 {
        let (knobs, _) = rt.knobs();
        let (first, last) = first_and_last(&records);
        let tail = tuned_at.and_then(|t| {
            let after = &records[t.min(records.len())..];
            let seconds: f64 = after.iter().map(|r| r.seconds).sum();
            (!after.is_empty() && seconds > 0.0).then(|| {
                serde_json::json!({"steps": after.len(), "steps_per_sec": after.len() as f64 / seconds,
                    "knobs_changed": after.iter().any(|r| r.knobs_before != knobs || r.knobs_after != knobs)})
            })
        });
        // What the job ran at while it was being tuned: its steps up to the pin.
        let during = tuned_at.and_then(|t| {
            let before = &records[..t.min(records.len())];
            let seconds: f64 = before.iter().map(|r| r.seconds).sum();
            (!before.is_empty() && seconds > 0.0).then(|| {
                serde_json::json!({"steps": before.len(), "steps_per_sec": before.len() as f64 / seconds})
            })
        });
        let autotune = rt.self_tune_outcome().map(|o| {
            serde_json::json!({"start": o.start, "best": o.best, "samples": o.samples,
                "session_wall_s": o.wall.as_secs_f64(), "speedup_over_start": o.speedup_over_start,
                "report": o.report})
        });
        if cli.common.json {
            println!(
                "{}",
                serde_json::json!({"workload": "resnet50", "world_size": n, "knobs": knobs,
                    "tensors": shapes.len(), "bytes_per_step": total_bytes, "steps": steps,
                    "steps_per_sec": steps_per_sec, "algbw_gbps": algbw,
                    "busbw_gbps": algbw * busbw_factor(n),
                    "seconds": total, "first": first, "last": last,
                    "autotune_state": rt.autotune_state().as_str(),
                    "tuned_after_s": tuned_after_s, "during_tuning": during, "after_tuning": tail,
                    "self_tuning": autotune, "negotiation": negotiation})
            );
        } else {
            println!(
                "# collbench resnet50: {} tensors, {} bytes per step, {n} ranks, knobs {knobs:?}",
                shapes.len(),
                total_bytes
            );
            println!(
                "{:>8} {:>12} {:>12} {:>12}",
                "steps", "steps/s", "algbw(GB/s)", "busbw(GB/s)"
            );
            println!(
                "{:>8} {:>12.3} {:>12.3} {:>12.3}",
                steps,
                steps_per_sec,
                algbw,
                algbw * busbw_factor(n)
            );
            println!(
                "# negotiation (requests + responses on the wire): {} bytes per step, {} bytes \
                 per cycle ({} cycles, {} of them settled in shared memory without a message)",
                per(steps as u64),
                per(cycles),
                cycles,
                settled
            );
            if decided_by_rank0 {
                for (name, phase) in [("first", &first), ("last", &last)] {
                    match phase {
                        Some(p) => println!(
                            "# {name} {} steps on {:?}: {:.3} steps/s",
                            p.steps, p.knobs, p.steps_per_sec
                        ),
                        None => println!("# {name}: no step ran entirely on one set of knobs"),
                    }
                }
                if let Some(o) = rt.self_tune_outcome() {
                    println!(
                        "# self-tuning: {} samples in {:.1} s, {:?} -> {:?}, report {:?}",
                        o.samples,
                        o.wall.as_secs_f64(),
                        o.start,
                        o.best,
                        o.report
                    );
                } else if run.until_tuned {
                    println!(
                        "# tuning state at the end: {}",
                        rt.autotune_state().as_str()
                    );
                }
            }
        }
    }
    rt.shutdown();
    Ok(())
}

/// Plain TCP between rank 0 and rank 1 with the runtime's socket settings: one direction,
/// then both at once (what each link of a ring does).
fn link(cli: &Cli, bytes: u64) -> Result<()> {
    let rank: usize = std::env::var("RANK")?.parse()?;
    let addr = std::env::var("MASTER_ADDR").unwrap_or_else(|_| "127.0.0.1".into());
    let port: u16 = std::env::var("MASTER_PORT")
        .unwrap_or_else(|_| "29500".into())
        .parse()?;
    let stream = if rank == 0 {
        let listener = TcpListener::bind(("0.0.0.0", port))?;
        listener.accept()?.0
    } else {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            match TcpStream::connect((addr.as_str(), port)) {
                Ok(s) => break s,
                Err(e) if Instant::now() > deadline => return Err(e.into()),
                Err(_) => std::thread::sleep(Duration::from_millis(20)),
            }
        }
    };
    configure_stream(&stream, Duration::from_secs(30))?;
    let chunk = vec![7u8; 4 << 20];
    let send = |mut s: TcpStream| -> Result<()> {
        let mut left = bytes;
        while left > 0 {
            let k = left.min(chunk.len() as u64) as usize;
            s.write_all(&chunk[..k])?;
            left -= k as u64;
        }
        Ok(())
    };
    let recv = |mut s: TcpStream| -> Result<()> {
        let mut buf = vec![0u8; 4 << 20];
        let mut left = bytes;
        while left > 0 {
            let k = left.min(buf.len() as u64) as usize;
            let got = s.read(&mut buf[..k])?;
            if got == 0 {
                bail!("peer closed early");
            }
            left -= got as u64;
        }
        Ok(())
    };
    let sync = |s: &TcpStream| -> Result<()> {
        let mut s = s.try_clone()?;
        s.write_all(&[1])?;
        let mut b = [0u8];
        s.read_exact(&mut b)?;
        Ok(())
    };
    sync(&stream)?;
    let start = Instant::now();
    if rank == 0 {
        send(stream.try_clone()?)?
    } else {
        recv(stream.try_clone()?)?
    }
    sync(&stream)?;
    let uni = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
    let start = Instant::now();
    let s2 = stream.try_clone()?;
    let sender = std::thread::scope(|scope| -> Result<()> {
        let h = scope.spawn(|| send(s2));
        recv(stream.try_clone()?)?;
        h.join().map_err(|_| anyhow::anyhow!("sender panicked"))??;
        Ok(())
    });
    sender?;
    sync(&stream)?;
    let bidir = bytes as f64 / start.elapsed().as_secs_f64() / 1e9;
    if rank == 0 {
        if cli.common.json {
            println!(
                "{}",
                serde_json::json!({"workload": "link", "bytes": bytes,
                "unidirectional_gbps": uni, "bidirectional_gbps_per_direction": bidir})
            );
        } else {
            println!("# collbench link: plain TCP on loopback, {bytes} bytes per direction");
            println!("{:>28} {:>10}", "mode", "GB/s");
            println!("{:>28} {:>10.3}", "one direction", uni);
            println!("{:>28} {:>10.3}", "both directions (each)", bidir);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resnet50_has_161_tensors_and_25_6_million_parameters() {
        let shapes = resnet50_shapes();
        assert_eq!(shapes.len(), 161);
        assert_eq!(shapes.iter().sum::<usize>(), 25_557_032);
    }

    fn rec(seconds: f64, before: u64, after: u64) -> StepRecord {
        let k = |t| Knobs {
            fusion_threshold_bytes: t,
            ..Knobs::default()
        };
        StepRecord {
            seconds,
            knobs_before: k(before),
            knobs_after: k(after),
        }
    }

    #[test]
    fn first_and_last_phases_leave_out_steps_with_a_knob_change() {
        let records = [
            rec(0.5, 1, 1),
            rec(0.5, 1, 1),
            rec(9.0, 1, 2),
            rec(0.1, 2, 3),
            rec(0.25, 3, 3),
            rec(0.25, 3, 3),
            rec(0.25, 3, 3),
        ];
        let (first, last) = first_and_last(&records);
        let (first, last) = (first.unwrap(), last.unwrap());
        assert_eq!((first.steps, first.steps_per_sec), (2, 2.0));
        assert_eq!(first.knobs.fusion_threshold_bytes, 1);
        assert_eq!((last.steps, last.steps_per_sec), (3, 4.0));
        assert_eq!(last.knobs.fusion_threshold_bytes, 3);
        // One step that changed knobs: neither phase exists.
        assert_eq!(first_and_last(&[rec(1.0, 1, 2)]), (None, None));
    }

    #[test]
    fn sizes_parse_with_suffixes() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("256M"), Ok(256 << 20));
        assert!(parse_bytes("lots").is_err());
    }
}

/// The reference pages this binary's crate renders: collbench's flags and the
/// runtime's environment variables (`cargo xtask reference` writes them).
#[cfg(test)]
#[path = "../../../xtask/src/cli_reference.rs"]
mod cli_reference;

#[cfg(test)]
mod reference {
    use super::cli_reference;
    use std::path::Path;

    fn docs() -> &'static Path {
        Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../docs/reference"))
    }

    #[test]
    fn reference_collbench_cli_is_current() {
        let page = cli_reference::render_cli(
            &<super::Cli as clap::CommandFactory>::command(),
            "collbench",
        );
        cli_reference::check_page(&docs().join("cli/collbench.md"), &page);
    }

    #[test]
    fn reference_env_is_current() {
        let page = collectives::env_vars::render_markdown();
        cli_reference::check_page(&docs().join("env.md"), &page);
    }
}
