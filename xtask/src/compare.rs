//! `cargo xtask bench compare`: our allreduce beside other runtimes' on this
//! machine. Allreduce (sum) of float32 on N local ranks at a few sizes, for
//! each contender: time per call, algbw = bytes / time and busbw = algbw ·
//! 2(n−1)/n (collbench's and nccl-tests' formulas), and ours' busbw over
//! theirs.
//!
//! The contenders: ours (`collbench sweep --json`, on the runtime's own
//! transport between local ranks: TCP over loopback unless it reports
//! shared-memory peers; `RINGWATCH_SHM` in the environment passes through), Open
//! MPI's `MPI_Allreduce` with its default transports (shared memory within
//! the node) and forced to TCP over loopback (`--mca btl tcp,self`, the
//! transport ours uses), and torch.distributed's gloo backend (TCP over
//! loopback). The MPI and gloo programs live in `xtask/bench/`; each checks
//! its results and prints one `allreduce bytes=… time_us=… wrong=…` line per
//! size. The contenders run interleaved, round by round, so that a slow
//! spell of the machine hits all of them alike; the table shows the median
//! over rounds.
//!
//! It measures and reports; it never changes collbench, the runtime or what
//! the other programs time, and decides nothing from hard-coded numbers.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Once;
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};

use crate::tuning_grid::median;

/// The compare bench's flags.
#[derive(Debug, Clone, clap::Args)]
#[group(id = "compare")]
pub struct Args {
    /// compare: ranks, all on this machine.
    #[arg(short = 'n', long, default_value_t = 4)]
    pub ranks: usize,
    /// compare: allreduce sizes in bytes of float32, comma-separated; K, M, G
    /// mean KiB, MiB, GiB.
    #[arg(long, value_delimiter = ',', value_parser = parse_bytes, default_value = "64K,1M,16M,64M")]
    pub sizes: Vec<u64>,
    /// compare: rounds; each round runs every contender once at every size,
    /// and the table shows the median over rounds.
    #[arg(long, default_value_t = 5)]
    pub rounds: usize,
    /// compare: timed calls per size and round, the same for every contender
    /// [default: 1 GiB / size within 3..=1000].
    #[arg(long)]
    pub iters: Option<usize>,
    /// compare: untimed calls per size before the timed ones, after the one
    /// checked call, for every contender (collbench sweep --warmup for ours).
    #[arg(long, default_value_t = 5)]
    pub warmup_iters: usize,
    /// compare: which contenders to run, comma-separated, in round order.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "ours,ours-shared,mpi-shm,mpi-tcp,gloo"
    )]
    pub contenders: Vec<Contender>,
    /// compare: ours' cycle time in ms (collbench --cycle-time-ms)
    /// [default: the runtime's, 1 ms].
    #[arg(long)]
    pub ours_cycle_time_ms: Option<f64>,
    /// compare: the Python that runs the gloo contender; it must import
    /// torch. The default is Debian's, which python3-torch installs into.
    #[arg(long, default_value = "/usr/bin/python3")]
    pub python: PathBuf,
    /// compare: where to write the results as JSON.
    #[arg(long, default_value = "target/bench/compare.json")]
    pub compare_out: PathBuf,
    /// compare: busy compute beside every contender, as a framework's
    /// compute threads share the cores with its collectives: N busy
    /// processes per rank (a floating-point loop each, `nice 10`), started
    /// before each contender's run and killed after it. 0: none.
    #[arg(long, default_value_t = 0)]
    pub contention: usize,
}

/// Busy compute processes (see `--contention`), killed on drop.
struct Contention {
    group: Option<i32>,
}

impl Contention {
    /// `count` busy processes in one process group of their own, niced.
    fn start(count: usize) -> Result<Self> {
        use std::os::unix::process::CommandExt;
        if count == 0 {
            return Ok(Self { group: None });
        }
        // One shell leads the group; each child spins on floating point
        // (awk: a multiply-add loop that never ends, no I/O).
        let script = format!(
            "for i in $(seq {count}); do awk 'BEGIN {{ x = 1; while (1) {{ x = x * 1.0000001 + 0.5; if (x > 1e9) x = 1 }} }}' & done; wait"
        );
        let child = Command::new("nice")
            .args(["-n", "10", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .context("starting the --contention processes (nice, sh, awk)")?;
        let group = i32::try_from(child.id()).context("pid out of range")?;
        // Let them reach the CPU before the contender starts.
        std::thread::sleep(Duration::from_millis(200));
        Ok(Self { group: Some(group) })
    }
}

impl Drop for Contention {
    fn drop(&mut self) {
        if let Some(group) = self.group {
            kill_group(group);
        }
    }
}

/// One allreduce implementation under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Contender {
    /// ringwatch's runtime: collbench sweep --json, on the runtime's own
    /// transport (TCP over loopback; shared memory where it has and reports
    /// it).
    Ours,
    /// ringwatch's runtime on tensors the ranks of a host share
    /// (Runtime::shared_tensor; collbench sweep --shared-tensors): on one
    /// host, reduced in place without staging copies.
    OursShared,
    /// Open MPI's MPI_Allreduce, default transports (shared memory here).
    MpiShm,
    /// Open MPI's MPI_Allreduce over TCP on loopback (--mca btl tcp,self).
    MpiTcp,
    /// torch.distributed all_reduce with the gloo backend, TCP on loopback.
    Gloo,
}

impl Contender {
    fn name(self) -> &'static str {
        match self {
            Contender::Ours => "ours",
            Contender::OursShared => "ours-shared",
            Contender::MpiShm => "mpi-shm",
            Contender::MpiTcp => "mpi-tcp",
            Contender::Gloo => "gloo",
        }
    }

    fn description(self) -> &'static str {
        match self {
            Contender::Ours => {
                "ringwatch collectives (collbench sweep --json), the runtime's own transport (TCP over loopback unless ours_runtime lists shared-memory peers), knobs as reported"
            }
            Contender::OursShared => {
                "ringwatch collectives on shared tensors (Runtime::shared_tensor, collbench sweep --shared-tensors --json): above 64 KiB folded in place from the ranks' tensors, no staging copies"
            }
            Contender::MpiShm => {
                "Open MPI MPI_Allreduce, default transports (shared memory within the node), out of place"
            }
            Contender::MpiTcp => {
                "Open MPI MPI_Allreduce, --mca pml ob1 --mca btl tcp,self on lo, out of place"
            }
            Contender::Gloo => {
                "torch.distributed all_reduce, gloo backend, TCP over loopback (GLOO_SOCKET_IFNAME=lo), in place"
            }
        }
    }
}

/// Sizes as collbench takes them: a number of bytes, or K/M/G for KiB/MiB/GiB.
fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let text = text.trim();
    let (number, unit) = match text.char_indices().last() {
        Some((i, 'K' | 'k')) => (&text[..i], 1u64 << 10),
        Some((i, 'M' | 'm')) => (&text[..i], 1 << 20),
        Some((i, 'G' | 'g')) => (&text[..i], 1 << 30),
        _ => (text, 1),
    };
    let bytes = number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("{text:?} is not a size (e.g. 65536, 64K, 16M, 1G)"))?;
    if bytes < 4 || bytes % 4 != 0 {
        return Err(format!(
            "{text:?}: a size must be a whole number of float32s (a multiple of 4 bytes)"
        ));
    }
    Ok(bytes)
}

/// Timed calls per size: `--iters`, else 1 GiB's worth within 3..=1000. (collbench's
/// own rule stops at 50 calls: 150 µs of 4 KiB calls on 2 ranks, which measured where
/// the scheduler had put the ranks at start, 3 µs or 27 µs a call from run to run, more
/// than the contenders.)
fn iterations(bytes: u64, iters: Option<usize>) -> usize {
    iters.unwrap_or_else(|| ((1u64 << 30) / bytes).clamp(3, 1000) as usize)
}

/// One size's result as the MPI and gloo programs print it.
#[derive(Debug, Clone, PartialEq)]
struct ResultLine {
    bytes: u64,
    count: u64,
    warmup: usize,
    iters: usize,
    time_us: f64,
    wrong: u64,
}

/// The `allreduce key=value …` lines of a program's stdout; other lines
/// (launcher chatter) are skipped, a malformed result line is an error.
fn parse_result_lines(stdout: &str) -> Result<Vec<ResultLine>> {
    let mut lines = Vec::new();
    for line in stdout.lines() {
        if line.split_whitespace().next() != Some("allreduce") {
            continue;
        }
        let field = |name: &str| -> Result<&str> {
            line.split_whitespace()
                .skip(1)
                .find_map(|word| word.strip_prefix(name)?.strip_prefix('='))
                .with_context(|| format!("no {name}= in {line:?}"))
        };
        let number = |name: &str, text: &str| -> Result<u64> {
            text.parse()
                .with_context(|| format!("{name}={text} is not a whole number in {line:?}"))
        };
        let time_us: f64 = field("time_us")?
            .parse()
            .with_context(|| format!("time_us is not a number in {line:?}"))?;
        if !(time_us.is_finite() && time_us > 0.0) {
            bail!("time_us must be positive in {line:?}");
        }
        lines.push(ResultLine {
            bytes: number("bytes", field("bytes")?)?,
            count: number("count", field("count")?)?,
            warmup: number("warmup", field("warmup")?)? as usize,
            iters: number("iters", field("iters")?)? as usize,
            time_us,
            wrong: number("wrong", field("wrong")?)?,
        });
    }
    Ok(lines)
}

/// What `collbench --json sweep` prints (rank 0).
#[derive(Debug, Deserialize)]
struct CollbenchSweep {
    world_size: usize,
    knobs: serde_json::Value,
    /// Rank 0's peers over shared memory, from a collbench that has that
    /// transport (absent from one that has only TCP).
    #[serde(default)]
    shared_memory_peers: Option<serde_json::Value>,
    /// Allreduces rank 0 folded in place from shared tensors (absent from an
    /// older collbench).
    #[serde(default)]
    in_place_allreduces: Option<u64>,
    rows: Vec<CollbenchRow>,
}

#[derive(Debug, Deserialize)]
struct CollbenchRow {
    bytes: u64,
    count: u64,
    time_us: f64,
    wrong: u64,
}

/// One size to measure: bytes and timed calls.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
struct Size {
    bytes: u64,
    iters: usize,
}

/// Checks a contender's results against the plan: every size once, the
/// asked-for calls, no wrong element. Returns the times in plan order.
fn check_results(
    contender: Contender,
    plan: &[Size],
    warmup: Option<usize>,
    lines: &[ResultLine],
) -> Result<Vec<f64>> {
    if lines.len() != plan.len() {
        bail!(
            "{}: expected {} result lines, got {}",
            contender.name(),
            plan.len(),
            lines.len()
        );
    }
    let mut times = Vec::with_capacity(plan.len());
    for (size, line) in plan.iter().zip(lines) {
        let what = format!("{} at {} bytes", contender.name(), size.bytes);
        if line.bytes != size.bytes || line.count != size.bytes / 4 {
            bail!(
                "{what}: the program reported {} bytes / {} floats",
                line.bytes,
                line.count
            );
        }
        if line.iters != size.iters || warmup.is_some_and(|w| w != line.warmup) {
            bail!(
                "{what}: ran {} timed and {} warm-up calls, asked for {} and {warmup:?}",
                line.iters,
                line.warmup,
                size.iters
            );
        }
        if line.wrong > 0 {
            bail!(
                "{what}: {} wrong elements (every rank gives rank+1, the sum must be n(n+1)/2): not timing a wrong allreduce",
                line.wrong
            );
        }
        times.push(line.time_us);
    }
    Ok(times)
}

/// The process group of the contender now running, killed on Ctrl-C.
static RUNNING_GROUP: AtomicI32 = AtomicI32::new(0);

/// On SIGINT or SIGTERM: kill the running contender's process group (its
/// launcher and every rank) and exit 130 / 143.
fn install_signal_handler() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = crate::exit_on_signal("stopping the running contender", || {
            kill_group(RUNNING_GROUP.load(Ordering::SeqCst))
        });
    });
    result
}

fn kill_group(group: i32) {
    if group > 0 {
        // SAFETY: a plain kill(2) of a process group this process created
        // (the contender's launcher leads it); no memory is involved.
        unsafe { libc::kill(-group, libc::SIGKILL) };
    }
}

fn drain(mut from: impl Read + Send + 'static) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut text = String::new();
        let _ = from.read_to_string(&mut text);
        text
    })
}

/// Runs a contender's launcher in its own process group and returns its
/// stdout; on failure or timeout the whole group (every rank) is killed and
/// the error carries the end of its stderr.
fn run_program(what: &str, command: &mut Command, timeout: Duration) -> Result<String> {
    use std::os::unix::process::CommandExt;
    command
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0);
    let mut child: Child = command
        .spawn()
        .with_context(|| format!("cannot start {what}: {command:?}"))?;
    let group = i32::try_from(child.id()).context("pid out of range")?;
    RUNNING_GROUP.store(group, Ordering::SeqCst);
    let stdout = drain(child.stdout.take().expect("stdout is piped"));
    let stderr = drain(child.stderr.take().expect("stderr is piped"));
    let deadline = Instant::now() + timeout;
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break Ok(status),
            Ok(None) if Instant::now() > deadline => {
                break Err(format!("still running after {timeout:?}"));
            }
            Ok(None) => std::thread::sleep(Duration::from_millis(20)),
            Err(error) => break Err(format!("cannot wait for it: {error}")),
        }
    };
    let failure = match status {
        Ok(status) if status.success() => None,
        Ok(status) => Some(format!("exited with {status}")),
        Err(failure) => Some(failure),
    };
    if failure.is_some() {
        // The launcher, and ranks it left behind (they would hold the pipes
        // open, and the cores, until their peer timeout).
        kill_group(group);
        let _ = child.wait();
    }
    RUNNING_GROUP.store(0, Ordering::SeqCst);
    let stdout = stdout.join().unwrap_or_default();
    let stderr = stderr.join().unwrap_or_default();
    let Some(failure) = failure else {
        return Ok(stdout);
    };
    let tail: Vec<&str> = stderr.lines().rev().take(12).collect();
    let tail: Vec<&str> = tail.into_iter().rev().collect();
    bail!(
        "{what} {failure}: {command:?}\n--- end of its stderr ---\n{}",
        tail.join("\n")
    )
}

/// Generous time for one run of a contender over every size: a minute to
/// start, plus every byte moved at 20 MB/s.
fn timeout(plan: &[Size], warmup: usize) -> Duration {
    let bytes: u64 = plan
        .iter()
        .map(|s| s.bytes * (s.iters + warmup + 1) as u64)
        .sum();
    Duration::from_secs(60 + bytes / 20_000_000)
}

/// The programs and settings every round uses.
struct Setup {
    root: PathBuf,
    collbench: Option<PathBuf>,
    mpi_program: Option<PathBuf>,
    ranks: usize,
    warmup: usize,
    cycle_time_ms: Option<f64>,
    python: PathBuf,
}

impl Setup {
    fn mpirun(&self, tcp: bool, plan: &[Size]) -> Result<Command> {
        let program = self
            .mpi_program
            .as_ref()
            .context("the MPI program was not built")?;
        let mut command = Command::new("mpirun");
        command.args([
            "--allow-run-as-root",
            "--oversubscribe",
            // Ours and gloo are not pinned; with more ranks than cores,
            // pinning would only hurt.
            "--bind-to",
            "none",
            "-np",
            &self.ranks.to_string(),
        ]);
        if tcp {
            // ob1 is the PML that honours --mca btl (UCX would not); loopback
            // is excluded by default, so name it.
            command.args([
                "--mca",
                "pml",
                "ob1",
                "--mca",
                "btl",
                "tcp,self",
                "--mca",
                "btl_tcp_if_include",
                "lo",
            ]);
        }
        command.arg(program).arg(self.warmup.to_string());
        command.args(plan.iter().map(|s| format!("{}:{}", s.bytes, s.iters)));
        command.current_dir(&self.root);
        Ok(command)
    }

    /// One run of a contender at every size: the mean time per call of each,
    /// in plan order, and (for ours) what the runtime reported about itself.
    fn run(&self, contender: Contender, plan: &[Size]) -> Result<(Vec<f64>, Option<OursRuntime>)> {
        let limit = timeout(plan, self.warmup);
        match contender {
            Contender::Ours | Contender::OursShared => {
                let collbench = self.collbench.as_ref().context("collbench was not built")?;
                let mut times = Vec::new();
                let mut runtime = None;
                // collbench sweep takes a geometric range; one run per size
                // takes any list.
                for size in plan {
                    let mut command = Command::new(collbench);
                    command.args(["-n", &self.ranks.to_string(), "--json"]);
                    if let Some(ms) = self.cycle_time_ms {
                        command.args(["--cycle-time-ms", &ms.to_string()]);
                    }
                    command
                        .args(["sweep", "--min-bytes", &size.bytes.to_string()])
                        .args(["--max-bytes", &size.bytes.to_string()])
                        .args(["--iters", &size.iters.to_string()])
                        .args(["--warmup", &self.warmup.to_string()])
                        .args((contender == Contender::OursShared).then_some("--shared-tensors"))
                        // No agent involved: no control socket, no tuning.
                        .env("RINGWATCH_CONTROL_SOCKET", "0")
                        .env_remove("RINGWATCH_AUTOTUNE")
                        .env_remove("HOROVOD_AUTOTUNE")
                        .current_dir(&self.root);
                    let out =
                        run_program("collbench", &mut command, timeout(&[*size], self.warmup))?;
                    let json = out
                        .lines()
                        .find(|l| l.trim_start().starts_with('{'))
                        .with_context(|| format!("collbench printed no JSON: {out:?}"))?;
                    let sweep: CollbenchSweep = serde_json::from_str(json)
                        .with_context(|| format!("collbench's JSON: {json}"))?;
                    if sweep.world_size != self.ranks {
                        bail!(
                            "collbench ran {} ranks, asked for {}",
                            sweep.world_size,
                            self.ranks
                        );
                    }
                    // ours-shared must have taken the path it is named for wherever
                    // it can: every rank on shared memory, above the one-shot size.
                    if contender == Contender::OursShared
                        && all_ranks_share_memory(sweep.shared_memory_peers.as_ref(), self.ranks)
                        && size.bytes > OURS_ONE_SHOT_MAX_BYTES
                        && sweep.in_place_allreduces == Some(0)
                    {
                        bail!(
                            "ours-shared at {} was staged, not folded in place (collbench: {json})",
                            human(size.bytes)
                        );
                    }
                    let lines: Vec<ResultLine> = sweep
                        .rows
                        .iter()
                        .map(|r| ResultLine {
                            bytes: r.bytes,
                            count: r.count,
                            warmup: self.warmup,
                            iters: size.iters,
                            time_us: r.time_us,
                            wrong: r.wrong,
                        })
                        .collect();
                    times.extend(check_results(
                        contender,
                        &[*size],
                        Some(self.warmup),
                        &lines,
                    )?);
                    runtime = Some(OursRuntime {
                        knobs: sweep.knobs,
                        shared_memory_peers: sweep.shared_memory_peers,
                    });
                }
                Ok((times, runtime))
            }
            Contender::MpiShm | Contender::MpiTcp => {
                let mut command = self.mpirun(contender == Contender::MpiTcp, plan)?;
                let out = run_program(contender.name(), &mut command, limit)?;
                let lines = parse_result_lines(&out)
                    .with_context(|| format!("{}'s output", contender.name()))?;
                Ok((
                    check_results(contender, plan, Some(self.warmup), &lines)?,
                    None,
                ))
            }
            Contender::Gloo => {
                let mut command = Command::new(&self.python);
                command
                    .arg(self.root.join("xtask/bench/gloo_allreduce.py"))
                    .args(["-n", &self.ranks.to_string(), &self.warmup.to_string()])
                    .args(plan.iter().map(|s| format!("{}:{}", s.bytes, s.iters)))
                    .current_dir(&self.root);
                let out = run_program("gloo", &mut command, limit)?;
                let lines = parse_result_lines(&out).context("gloo's output")?;
                Ok((
                    check_results(contender, plan, Some(self.warmup), &lines)?,
                    None,
                ))
            }
        }
    }
}

/// `cargo xtask bench --help`'s words on compare, beyond its flags.
pub const HELP: &str = "\
compare, in detail (cargo xtask bench compare [-n 4] [--sizes 64K,1M,16M,64M] [--rounds 5]):
  Every contender allreduces (sum) one float32 tensor per size on the same number of local
  ranks. Each rank fills it with rank+1 and the first call is checked: every element must be
  n(n+1)/2 (MPI and gloo check again after the timed calls); a wrong element stops the bench
  rather than timing a wrong allreduce. A size's time is rank 0's mean over its timed calls;
  a round runs every contender once (in --contenders order), and the table shows, per size,
  the median over rounds: time per call, busbw = bytes/time * 2(n-1)/n in GB/s, and ours/X =
  ours' busbw over X's (above 1: ours is faster). Every contender makes --warmup-iters untimed
  calls after the checked one.
  ours:    collbench -n N --json sweep --min-bytes S --max-bytes S --iters I --warmup W, one run per size
           (collbench from `cargo build -p collectives`, the dev profile other benches use), on
           the runtime's own transport; RINGWATCH_* in the environment passes through.
  mpi-shm: xtask/bench/mpi_allreduce.c, built with mpicc into <target>/bench/, run by
           mpirun --allow-run-as-root --oversubscribe --bind-to none -np N.
  mpi-tcp: the same with --mca pml ob1 --mca btl tcp,self --mca btl_tcp_if_include lo.
  gloo:    xtask/bench/gloo_allreduce.py under --python: N processes, env:// rendezvous on
           127.0.0.1, GLOO_SOCKET_IFNAME=lo. Skipped, with the reason, if torch lacks gloo.
  Missing tools (openmpi-bin, libopenmpi-dev, gcc, python3-torch) are installed with apt-get
  when run as root; otherwise it stops with the apt-get command to run. Results:
  target/bench/compare.json (--compare-out), with every round's time.";

/// Debian packages the other contenders need, with what each is for.
const MPI_PACKAGES: &[(&str, &str)] = &[
    ("openmpi-bin", "mpirun, for the MPI contenders"),
    (
        "libopenmpi-dev",
        "mpicc and mpi.h, to build xtask/bench/mpi_allreduce.c",
    ),
    ("gcc", "the C compiler mpicc drives"),
];
const GLOO_PACKAGES: &[(&str, &str)] = &[(
    "python3-torch",
    "torch.distributed with gloo, for the gloo contender",
)];

/// Whether `python` can import torch.distributed.
fn imports_torch(python: &Path) -> bool {
    Command::new(python)
        .args(["-c", "import torch.distributed"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// First line of a command's output, if it runs.
fn first_line(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8_lossy(&out.stdout);
    text.lines()
        .find(|l| !l.trim().is_empty())
        .map(|l| l.trim().to_owned())
}

/// Installs what the chosen contenders need (root, apt-get) or says what
/// to run; gloo is dropped, with the reason, when torch lacks it.
fn prerequisites(args: &Args) -> Result<Vec<(Contender, String)>> {
    let wants_mpi = args
        .contenders
        .iter()
        .any(|c| matches!(c, Contender::MpiShm | Contender::MpiTcp));
    let wants_gloo = args.contenders.contains(&Contender::Gloo);
    let debian_python = args.python == Path::new("/usr/bin/python3");
    let mut wanted: Vec<(&str, &str)> = Vec::new();
    if wants_mpi {
        wanted.extend_from_slice(MPI_PACKAGES);
    }
    if wants_gloo {
        if debian_python {
            wanted.extend_from_slice(GLOO_PACKAGES);
        } else if !imports_torch(&args.python) {
            bail!(
                "{} cannot import torch.distributed: install torch for it, leave --python out to use Debian's python3-torch, or leave gloo out (--contenders ours,mpi-shm,mpi-tcp)",
                args.python.display()
            );
        }
    }
    crate::ensure_packages(&wanted, |package| match package {
        "openmpi-bin" => crate::which("mpirun"),
        "libopenmpi-dev" => crate::which("mpicc"),
        "gcc" => crate::which("gcc"),
        "python3-torch" => imports_torch(&args.python),
        _ => false,
    })
    .context("the MPI and gloo contenders need these (or leave them out: --contenders ours)")?;
    let mut skipped = Vec::new();
    if wants_gloo {
        let gloo = first_line(
            &args.python.to_string_lossy(),
            &[
                "-c",
                "import torch.distributed as d; print(d.is_available() and d.is_gloo_available())",
            ],
        );
        if gloo.as_deref() != Some("True") {
            let reason = format!(
                "{}'s torch has no gloo backend (torch.distributed.is_gloo_available() is not True)",
                args.python.display()
            );
            eprintln!("xtask: skipping gloo: {reason}");
            skipped.push((Contender::Gloo, reason));
        }
    }
    Ok(skipped)
}

/// What collbench said about the runtime it measured (last run).
#[derive(Debug, Clone, Serialize)]
struct OursRuntime {
    knobs: serde_json::Value,
    /// Rank 0's shared-memory peers; None: this collbench reports none
    /// (TCP only).
    shared_memory_peers: Option<serde_json::Value>,
}

/// Whether rank 0's `peers` (collbench's `shared_memory_peers`) are every
/// other rank of `ranks`: the job ran over shared memory alone.
fn all_ranks_share_memory(peers: Option<&serde_json::Value>, ranks: usize) -> bool {
    peers
        .and_then(|p| p.as_array())
        .is_some_and(|p| p.len() + 1 == ranks)
}

/// One contender's figures at one size.
#[derive(Debug, Serialize)]
struct Measured {
    contender: Contender,
    /// Median over rounds of the mean time per call.
    time_us: f64,
    algbw_gbps: f64,
    busbw_gbps: f64,
    /// Ours' busbw over this one's (> 1: ours is faster); absent for ours
    /// and when ours did not run.
    ours_over_this: Option<f64>,
    /// Each round's mean time per call.
    samples_time_us: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct Row {
    bytes: u64,
    iters: usize,
    results: Vec<Measured>,
    /// Ours over shared memory: bytes of memory traffic per call as the
    /// algorithm moves them (all ranks; see `ours_shared_memory_traffic`;
    /// folds run on chunks that stay in cache, so this may exceed what
    /// reaches memory) and that over ours' time. Absent when ours ran over
    /// TCP or not at all.
    ours_traffic_bytes: Option<f64>,
    ours_traffic_gbps: Option<f64>,
    /// The memory bound's time for this size (`floor_traffic_bytes` at the
    /// measured copy rate) over ours' time: 1.0 is as fast as the machine's
    /// memory allows any allreduce to be. Absent when ours did not run.
    ours_of_memory_bound: Option<f64>,
    /// The same two for ours on shared tensors (`ours-shared`), when it ran
    /// over shared memory.
    ours_shared_traffic_bytes: Option<f64>,
    ours_shared_of_memory_bound: Option<f64>,
}

/// The least memory traffic any allreduce of `bytes` on `n` ranks of one
/// host moves: every rank reads its input once and writes its result once
/// (2·S each), all else staying in cache.
fn floor_traffic_bytes(bytes: u64, n: usize) -> f64 {
    2.0 * n as f64 * bytes as f64
}

/// The memory bound beside the contenders (see [`copy_bandwidth`]).
#[derive(Debug, Serialize)]
struct MemoryBound {
    threads: usize,
    what: &'static str,
    /// Median over rounds.
    traffic_gbps: f64,
    samples_gbps: Vec<f64>,
}

#[derive(Debug, Serialize)]
struct ContenderReport {
    name: Contender,
    description: &'static str,
    /// Why it did not run, if it did not.
    skipped: Option<String>,
    version: Option<String>,
}

#[derive(Debug, Serialize)]
struct Report {
    what: &'static str,
    ranks: usize,
    cores: usize,
    rounds: usize,
    /// Busy processes per rank beside every contender (`--contention`).
    contention: usize,
    warmup_iters: usize,
    statistic: &'static str,
    busbw: &'static str,
    contenders: Vec<ContenderReport>,
    ours_runtime: Option<OursRuntime>,
    memory_bound: MemoryBound,
    rows: Vec<Row>,
    wall_seconds: f64,
}

/// The machine's memory bound, measured in the same run as the contenders:
/// `threads` threads (one per core) each copy a buffer of [`COPY_BYTES`]
/// into another, [`COPY_PASSES`] times; traffic counts every byte read and
/// every byte written (a copy of B bytes moves 2B), per second, all threads
/// together.
const COPY_BYTES: usize = 64 << 20;
const COPY_PASSES: usize = 4;

fn copy_bandwidth(threads: usize) -> f64 {
    let threads = threads.max(1);
    let mut buffers: Vec<(Vec<u8>, Vec<u8>)> = (0..threads)
        .map(|t| (vec![t as u8 + 1; COPY_BYTES], vec![0u8; COPY_BYTES]))
        .collect();
    // Every page touched once before the clock starts.
    for (src, dst) in &mut buffers {
        dst.copy_from_slice(src);
    }
    let start = Instant::now();
    std::thread::scope(|scope| {
        for (src, dst) in &mut buffers {
            scope.spawn(move || {
                for pass in 0..COPY_PASSES {
                    dst.copy_from_slice(src);
                    src[pass] = dst[COPY_BYTES - 1 - pass];
                }
            });
        }
    });
    let seconds = start.elapsed().as_secs_f64();
    std::hint::black_box(&buffers);
    (2 * COPY_BYTES * COPY_PASSES * threads) as f64 / seconds / 1e9
}

/// Largest allreduce ours does in one shot over shared memory (the
/// runtime's `ONE_SHOT_MAX_BYTES`).
const OURS_ONE_SHOT_MAX_BYTES: u64 = 64 << 10;

/// Bytes of memory traffic (reads + writes, all ranks) of one of ours'
/// shared-memory allreduces of `bytes` on `n` ranks, as docs/BENCHMARKS.md
/// counts them. Per rank, with S = bytes:
/// - one shot (S ≤ 64 KiB): copy in (2S), start each segment from its
///   owner's copy (2S), n−1 folds of every segment (read both, write one:
///   3(n−1)S): (3n+1)S.
/// - chunked fold: copy in the n−1 parts for the others (2(n−1)S/n), n−1
///   folds of its own part (3(n−1)S/n), publish it (2S/n), copy out the
///   others' results (2(n−1)S/n): (7(n−1)+2)S/n.
fn ours_shared_memory_traffic(bytes: u64, n: usize) -> f64 {
    let (s, n) = (bytes as f64, n as f64);
    if bytes <= OURS_ONE_SHOT_MAX_BYTES {
        n * (3.0 * n + 1.0) * s
    } else {
        (7.0 * (n - 1.0) + 2.0) * s
    }
}

/// The same for ours on shared tensors (`ours-shared`): one shot as above up
/// to 64 KiB; above, each rank reads its part of every rank's tensor and
/// writes its result into every tensor, nothing staged: 2S per rank, the
/// floor.
fn ours_shared_tensor_traffic(bytes: u64, n: usize) -> f64 {
    if bytes <= OURS_ONE_SHOT_MAX_BYTES {
        ours_shared_memory_traffic(bytes, n)
    } else {
        floor_traffic_bytes(bytes, n)
    }
}

fn busbw_factor(ranks: usize) -> f64 {
    if ranks <= 1 {
        0.0
    } else {
        2.0 * (ranks - 1) as f64 / ranks as f64
    }
}

/// 65536 -> "64 KiB".
fn human(bytes: u64) -> String {
    for (unit, shift) in [("GiB", 30), ("MiB", 20), ("KiB", 10)] {
        if bytes >= 1 << shift && bytes.is_multiple_of(1 << shift) {
            return format!("{} {unit}", bytes >> shift);
        }
    }
    format!("{bytes} B")
}

/// Runs the bench (see the module doc).
pub fn run(root: &Path, args: &Args) -> Result<()> {
    let started = Instant::now();
    if args.ranks < 2 {
        bail!("-n/--ranks must be at least 2 (busbw is 0 for one rank)");
    }
    if args.rounds == 0 || args.sizes.is_empty() || args.contenders.is_empty() {
        bail!("--rounds, --sizes and --contenders must not be empty");
    }
    if args.iters == Some(0) {
        bail!("--iters must be at least 1");
    }
    let mut contenders: Vec<Contender> = Vec::new();
    for &c in &args.contenders {
        if !contenders.contains(&c) {
            contenders.push(c);
        }
    }
    let plan: Vec<Size> = args
        .sizes
        .iter()
        .map(|&bytes| Size {
            bytes,
            iters: iterations(bytes, args.iters),
        })
        .collect();
    install_signal_handler()?;
    let skipped = prerequisites(args)?;
    contenders.retain(|c| !skipped.iter().any(|(s, _)| s == c));
    if contenders.is_empty() {
        bail!("no contender left to run (see above)");
    }

    let collbench = if contenders
        .iter()
        .any(|c| matches!(c, Contender::Ours | Contender::OursShared))
    {
        Some(crate::multinode::collbench(root)?)
    } else {
        None
    };
    let mpi_program = if contenders
        .iter()
        .any(|c| matches!(c, Contender::MpiShm | Contender::MpiTcp))
    {
        let dir = crate::cargo_target_dir(root).join("bench");
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let program = dir.join("mpi_allreduce");
        let source = root.join("xtask/bench/mpi_allreduce.c");
        let (source_text, program_text) = (
            source.to_str().context("non-UTF-8 path")?,
            program.to_str().context("non-UTF-8 path")?,
        );
        crate::run("mpicc", &["-O2", "-Wall", "-o", program_text, source_text])?;
        Some(program)
    } else {
        None
    };
    let setup = Setup {
        root: root.to_path_buf(),
        collbench,
        mpi_program,
        ranks: args.ranks,
        warmup: args.warmup_iters,
        cycle_time_ms: args.ours_cycle_time_ms,
        python: args.python.clone(),
    };
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    for (contender, reason) in &skipped {
        println!("# skipped {}: {reason}", contender.name());
    }
    println!(
        "# allreduce sum float32, {} ranks on this machine ({cores} cores), {} round(s), contenders {}",
        args.ranks,
        args.rounds,
        contenders
            .iter()
            .map(|c| c.name())
            .collect::<Vec<_>>()
            .join(", ")
    );
    if args.contention > 0 {
        println!(
            "# contention: {} busy process(es) per rank ({} in all, nice 10) beside every contender",
            args.contention,
            args.contention * args.ranks
        );
    }
    println!(
        "# timed calls per size: {}; every contender warms up with {} more calls",
        plan.iter()
            .map(|s| format!("{} x{}", human(s.bytes), s.iters))
            .collect::<Vec<_>>()
            .join(", "),
        args.warmup_iters
    );

    // samples[contender][size] = one time per round.
    let mut samples: Vec<Vec<Vec<f64>>> = vec![vec![Vec::new(); plan.len()]; contenders.len()];
    let mut ours_runtime = None;
    let mut copy_samples = Vec::new();
    for round in 0..args.rounds {
        let mut spent = Vec::new();
        // The memory bound, under the same contention as the contenders.
        let busy = Contention::start(args.contention * args.ranks)?;
        copy_samples.push(copy_bandwidth(cores));
        drop(busy);
        for (i, &contender) in contenders.iter().enumerate() {
            let t0 = Instant::now();
            let busy = Contention::start(args.contention * args.ranks)?;
            let ran = setup.run(contender, &plan);
            drop(busy);
            let (times, runtime) =
                ran.with_context(|| format!("round {}: {}", round + 1, contender.name()))?;
            for (k, time) in times.into_iter().enumerate() {
                samples[i][k].push(time);
            }
            if runtime.is_some() {
                ours_runtime = runtime;
            }
            spent.push(format!(
                "{} {:.1} s",
                contender.name(),
                t0.elapsed().as_secs_f64()
            ));
        }
        eprintln!(
            "xtask: round {}/{}: memory {:.1} GB/s; {}",
            round + 1,
            args.rounds,
            copy_samples.last().copied().unwrap_or(0.0),
            spent.join(", ")
        );
    }
    let memory_bound = MemoryBound {
        threads: cores.max(1),
        what: "memcpy of 64 MiB buffers, one thread per core; traffic = bytes read + bytes written per second, all threads",
        traffic_gbps: median(&copy_samples),
        samples_gbps: copy_samples,
    };

    let factor = busbw_factor(args.ranks);
    let ours_index = contenders.iter().position(|&c| c == Contender::Ours);
    let shared_index = contenders.iter().position(|&c| c == Contender::OursShared);
    let rows: Vec<Row> = plan
        .iter()
        .enumerate()
        .map(|(k, size)| {
            let busbw = |time_us: f64| size.bytes as f64 / (time_us * 1e-6) / 1e9 * factor;
            let ours_busbw = ours_index.map(|i| busbw(median(&samples[i][k])));
            let results = contenders
                .iter()
                .enumerate()
                .map(|(i, &contender)| {
                    let time_us = median(&samples[i][k]);
                    let algbw = size.bytes as f64 / (time_us * 1e-6) / 1e9;
                    Measured {
                        contender,
                        time_us,
                        algbw_gbps: algbw,
                        busbw_gbps: algbw * factor,
                        ours_over_this: ours_busbw
                            .filter(|_| contender != Contender::Ours)
                            .map(|ours| ours / (algbw * factor)),
                        samples_time_us: samples[i][k].clone(),
                    }
                })
                .collect();
            let ours_shm = ours_runtime.as_ref().is_some_and(|o: &OursRuntime| {
                all_ranks_share_memory(o.shared_memory_peers.as_ref(), args.ranks)
            });
            let ours_time_us = ours_index.map(|i| median(&samples[i][k]));
            let shared_time_us = shared_index.map(|i| median(&samples[i][k]));
            let traffic = ours_time_us
                .filter(|_| ours_shm)
                .map(|time_us| (ours_shared_memory_traffic(size.bytes, args.ranks), time_us));
            let bound_us =
                floor_traffic_bytes(size.bytes, args.ranks) / (memory_bound.traffic_gbps * 1e3);
            Row {
                bytes: size.bytes,
                iters: size.iters,
                results,
                ours_traffic_bytes: traffic.map(|(bytes, _)| bytes),
                ours_traffic_gbps: traffic.map(|(bytes, time_us)| bytes / (time_us * 1e-6) / 1e9),
                ours_of_memory_bound: ours_time_us.map(|t| bound_us / t),
                ours_shared_traffic_bytes: shared_time_us
                    .filter(|_| ours_shm)
                    .map(|_| ours_shared_tensor_traffic(size.bytes, args.ranks)),
                ours_shared_of_memory_bound: shared_time_us.map(|t| bound_us / t),
            }
        })
        .collect();
    if let Some(ours) = &ours_runtime {
        println!(
            "# ours: knobs {}; rank 0's shared-memory peers: {}",
            ours.knobs,
            ours.shared_memory_peers
                .as_ref()
                .map_or_else(|| "none reported (TCP)".to_owned(), ToString::to_string)
        );
    }
    print!("{}", table(&contenders, &rows));
    println!(
        "# memory bound: {:.1} GB/s of traffic (memcpy, {} threads, median over rounds); \
         an allreduce moves at least 2·n·size (each rank reads its input, writes its result)",
        memory_bound.traffic_gbps, memory_bound.threads
    );
    for row in &rows {
        let shared = row
            .ours_shared_of_memory_bound
            .map(|of| (Contender::OursShared, of, row.ours_shared_traffic_bytes));
        let plain = row
            .ours_of_memory_bound
            .map(|of| (Contender::Ours, of, row.ours_traffic_bytes));
        for (contender, of, traffic) in plain.into_iter().chain(shared) {
            let time_us = row
                .results
                .iter()
                .find(|m| m.contender == contender)
                .map(|m| m.time_us);
            let moved = match (traffic, time_us) {
                (Some(bytes), Some(time_us)) => format!(
                    "; the algorithm moves {:.1} MB per call ({:.1} GB/s, cache included)",
                    bytes / 1e6,
                    bytes / (time_us * 1e-6) / 1e9
                ),
                _ => String::new(),
            };
            println!(
                "# {:<11} {:>9}: {:.0}% of the memory bound{moved}",
                contender.name(),
                human(row.bytes),
                of * 100.0
            );
        }
    }

    let version = |c: Contender| match c {
        Contender::Ours | Contender::OursShared => first_line(
            "git",
            &[
                "-C",
                &root.to_string_lossy(),
                "describe",
                "--always",
                "--dirty",
            ],
        )
        .map(|commit| format!("ringwatch {commit}")),
        Contender::MpiShm | Contender::MpiTcp => first_line("mpirun", &["--version"]),
        Contender::Gloo => {
            let torch = first_line(
                &args.python.to_string_lossy(),
                &["-c", "import torch; print('torch', torch.__version__)"],
            )?;
            // Debian's build calls itself 1.13.0a0; the package says which it is.
            Some(
                match first_line("dpkg-query", &["-W", "-f", "${Version}", "python3-torch"]) {
                    Some(package) if args.python == Path::new("/usr/bin/python3") => {
                        format!("{torch} (python3-torch {package})")
                    }
                    _ => torch,
                },
            )
        }
    };
    let mut reports: Vec<ContenderReport> = contenders
        .iter()
        .map(|&c| ContenderReport {
            name: c,
            description: c.description(),
            skipped: None,
            version: version(c),
        })
        .collect();
    reports.extend(skipped.into_iter().map(|(c, reason)| ContenderReport {
        name: c,
        description: c.description(),
        skipped: Some(reason),
        version: None,
    }));
    let report = Report {
        what: "allreduce (sum, float32) on local ranks: ringwatch collectives vs Open MPI and torch gloo, interleaved rounds",
        ranks: args.ranks,
        cores,
        rounds: args.rounds,
        contention: args.contention,
        warmup_iters: args.warmup_iters,
        statistic: "time_us is the median over rounds of each round's mean time per call (rank 0's wall clock), after the checked call and --warmup-iters untimed ones",
        busbw: "algbw = bytes / time; busbw = algbw * 2(n-1)/n (GB/s = 1e9 B/s)",
        contenders: reports,
        ours_runtime,
        memory_bound,
        rows,
        wall_seconds: started.elapsed().as_secs_f64(),
    };
    crate::write_json_report(
        &crate::under_root(root, &args.compare_out),
        &report,
        started,
    )
}

/// The table: size, then per contender time per call and busbw, and ours'
/// busbw over each other contender's.
fn table(contenders: &[Contender], rows: &[Row]) -> String {
    let with_ratio = contenders.contains(&Contender::Ours);
    let ratio_shown = |c: Contender| with_ratio && c != Contender::Ours;
    let mut header = format!("{:>9}", "");
    let mut units = format!("{:>9}", "size");
    for &c in contenders {
        let width = if ratio_shown(c) { 24 } else { 17 };
        header.push_str(&format!(" | {:^width$}", c.name()));
        units.push_str(&format!(" | {:>9} {:>7}", "time(us)", "busbw"));
        if ratio_shown(c) {
            units.push_str(&format!(" {:>6}", "ours/"));
        }
    }
    let mut text = format!(
        "# median over rounds; busbw in GB/s = bytes/time * 2(n-1)/n; ours/ = ours' busbw over that contender's (> 1: ours faster)\n{}\n{}\n",
        header.trim_end(),
        units
    );
    for row in rows {
        let mut line = format!("{:>9}", human(row.bytes));
        for m in &row.results {
            line.push_str(&format!(" | {:>9.1} {:>7.3}", m.time_us, m.busbw_gbps));
            if let Some(ratio) = m.ours_over_this {
                line.push_str(&format!(" {ratio:>6.2}"));
            }
        }
        text.push_str(&line);
        text.push('\n');
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_lines_parse_and_other_lines_are_skipped() {
        let out = "Warning: something from mpirun\n\
                   allreduce bytes=65536 count=16384 warmup=5 iters=50 time_us=123.456 wrong=0\n\
                   \n\
                   allreduce bytes=1048576 count=262144 warmup=5 iters=50 time_us=2000 wrong=3\n";
        let lines = parse_result_lines(out).unwrap();
        assert_eq!(
            lines,
            vec![
                ResultLine {
                    bytes: 65536,
                    count: 16384,
                    warmup: 5,
                    iters: 50,
                    time_us: 123.456,
                    wrong: 0
                },
                ResultLine {
                    bytes: 1 << 20,
                    count: 1 << 18,
                    warmup: 5,
                    iters: 50,
                    time_us: 2000.0,
                    wrong: 3
                },
            ]
        );
        // Field order does not matter; a field name is not a prefix match.
        let reordered = "allreduce wrong=0 time_us=1.5 iters=3 warmup=0 count=1 bytes=4";
        assert_eq!(parse_result_lines(reordered).unwrap()[0].bytes, 4);
        assert!(parse_result_lines("allreduce bytesx=4 count=1").is_err());
    }

    #[test]
    fn the_mpi_and_gloo_programs_print_every_field_the_parser_reads() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR"));
        for program in ["bench/mpi_allreduce.c", "bench/gloo_allreduce.py"] {
            let source = std::fs::read_to_string(root.join(program)).unwrap();
            for field in [
                "allreduce bytes=",
                " count=",
                " warmup=",
                " iters=",
                " time_us=",
                " wrong=",
            ] {
                assert!(source.contains(field), "{program} prints no {field:?}");
            }
        }
    }

    #[test]
    fn malformed_result_lines_are_errors_that_quote_the_line() {
        let missing = parse_result_lines("allreduce bytes=4 count=1 warmup=0 iters=1 wrong=0");
        assert!(format!("{:#}", missing.unwrap_err()).contains("no time_us="));
        let bad =
            parse_result_lines("allreduce bytes=4k count=1 warmup=0 iters=1 time_us=1.0 wrong=0");
        assert!(format!("{:#}", bad.unwrap_err()).contains("bytes=4k"));
        let zero =
            parse_result_lines("allreduce bytes=4 count=1 warmup=0 iters=1 time_us=0 wrong=0");
        assert!(zero.is_err());
        assert!(parse_result_lines("no results here\n").unwrap().is_empty());
    }

    #[test]
    fn collbench_sweep_json_parses_with_and_without_shared_memory_peers() {
        let tcp_only = r#"{"workload":"sweep","world_size":4,"knobs":{"cycle_time_us":1000},
            "rows":[{"bytes":65536,"count":16384,"time_us":1087.4,"algbw_gbps":0.06,
            "busbw_gbps":0.09,"wrong":0}]}"#;
        let sweep: CollbenchSweep = serde_json::from_str(tcp_only).unwrap();
        assert_eq!((sweep.world_size, sweep.rows.len()), (4, 1));
        assert_eq!((sweep.rows[0].bytes, sweep.rows[0].count), (65536, 16384));
        assert_eq!(sweep.rows[0].time_us, 1087.4);
        assert!(sweep.shared_memory_peers.is_none());
        let with_shm = r#"{"world_size":2,"knobs":{},"shared_memory_peers":[1],"rows":[]}"#;
        let sweep: CollbenchSweep = serde_json::from_str(with_shm).unwrap();
        assert_eq!(sweep.shared_memory_peers, Some(serde_json::json!([1])));
    }

    fn line(bytes: u64, iters: usize, wrong: u64) -> ResultLine {
        ResultLine {
            bytes,
            count: bytes / 4,
            warmup: 5,
            iters,
            time_us: 10.0,
            wrong,
        }
    }

    #[test]
    fn results_must_match_the_plan_and_be_right() {
        let plan = [
            Size {
                bytes: 64 << 10,
                iters: 50,
            },
            Size {
                bytes: 64 << 20,
                iters: 16,
            },
        ];
        let good = [line(64 << 10, 50, 0), line(64 << 20, 16, 0)];
        assert_eq!(
            check_results(Contender::MpiShm, &plan, Some(5), &good).unwrap(),
            vec![10.0, 10.0]
        );
        let wrong = [line(64 << 10, 50, 0), line(64 << 20, 16, 7)];
        let error = check_results(Contender::Gloo, &plan, Some(5), &wrong).unwrap_err();
        assert!(
            error
                .to_string()
                .contains("gloo at 67108864 bytes: 7 wrong")
        );
        let short = [line(64 << 10, 50, 0)];
        assert!(check_results(Contender::MpiTcp, &plan, Some(5), &short).is_err());
        let other_iters = [line(64 << 10, 49, 0), line(64 << 20, 16, 0)];
        assert!(check_results(Contender::MpiTcp, &plan, Some(5), &other_iters).is_err());
        assert!(check_results(Contender::MpiTcp, &plan, Some(4), &good).is_err());
    }

    #[test]
    fn sizes_parse_with_binary_suffixes_and_whole_floats() {
        assert_eq!(parse_bytes("64K"), Ok(64 << 10));
        assert_eq!(parse_bytes("16M"), Ok(16 << 20));
        assert_eq!(parse_bytes("1g"), Ok(1 << 30));
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert!(parse_bytes("6").is_err());
        assert!(parse_bytes("0").is_err());
        assert!(parse_bytes("lots").is_err());
        assert!(parse_bytes("99999999999999999G").is_err());
    }

    #[test]
    fn iterations_are_a_gib_worth_within_3_to_1000_unless_given() {
        assert_eq!(iterations(4 << 10, None), 1000);
        assert_eq!(iterations(1 << 20, None), 1000);
        assert_eq!(iterations(16 << 20, None), 64);
        assert_eq!(iterations(64 << 20, None), 16);
        assert_eq!(iterations(1 << 30, None), 3);
        assert_eq!(iterations(64 << 20, Some(7)), 7);
    }

    #[test]
    fn sizes_read_as_people_write_them() {
        assert_eq!(human(64 << 10), "64 KiB");
        assert_eq!(human(16 << 20), "16 MiB");
        assert_eq!(human(1000), "1000 B");
        assert_eq!(human(1536), "1536 B");
    }

    #[test]
    fn memory_traffic_counts_each_copy_and_fold_of_ours_algorithms() {
        // 4 ranks, chunked fold: per rank 2·3/4 in + 3·3/4 folds + 2/4
        // publish + 2·3/4 out = 23/4 S; all ranks 23 S.
        let s = 64u64 << 20;
        assert_eq!(ours_shared_memory_traffic(s, 4), 23.0 * s as f64);
        // 2 ranks: (7 + 2)/2 S per rank, 9 S in all.
        assert_eq!(ours_shared_memory_traffic(s, 2), 9.0 * s as f64);
        // One shot, 4 KiB on 4 ranks: (3·4 + 1) S per rank.
        assert_eq!(ours_shared_memory_traffic(4096, 4), 4.0 * 13.0 * 4096.0);
        assert_eq!(
            ours_shared_memory_traffic(OURS_ONE_SHOT_MAX_BYTES + 4, 4),
            23.0 * (OURS_ONE_SHOT_MAX_BYTES + 4) as f64
        );
    }

    #[test]
    fn the_floor_is_one_read_and_one_write_per_rank() {
        assert_eq!(floor_traffic_bytes(1 << 20, 4), 8.0 * (1 << 20) as f64);
    }

    #[test]
    fn the_copy_bound_is_a_positive_rate() {
        let gbps = copy_bandwidth(1);
        assert!(gbps.is_finite() && gbps > 0.0, "{gbps}");
    }

    #[test]
    fn busbw_is_nccl_tests_factor() {
        assert_eq!(busbw_factor(4), 1.5);
        assert_eq!(busbw_factor(2), 1.0);
        assert_eq!(busbw_factor(1), 0.0);
    }
}
