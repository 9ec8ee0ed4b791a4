//! `cargo xtask`: every ringwatch workflow that is more than `cargo build`.
//!
//! Building the BPF object, installing prerequisites, the test suite CI runs,
//! the demo and the benchmarks. Each step says what it runs; no workflow
//! lives in scattered shell scripts (`.ci/run` only calls `cargo xtask test`).

mod api_fuzz;
#[path = "../../ebpf/build_support.rs"]
#[allow(dead_code)] // the layout probe is for ebpf/build.rs only
mod build_support;
mod compare;
mod demo;
mod deploy;
mod doc_commands;
mod hostile;
mod image;
#[cfg(test)]
mod module_cycles;
mod multinode;
mod python;
mod retune;
mod timeline_bench;
mod topology;
mod train;
mod tuning_grid;
mod tuning_session;
mod venv;

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};

/// ringwatch's workflows.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask")]
struct Cli {
    #[command(subcommand)]
    task: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Check the prerequisites of the build and the tests (clang, libbpf
    /// headers, iproute2, chromium, podman and runc) and install the missing
    /// ones with apt-get when root on Debian/Ubuntu; otherwise print the
    /// exact command to run.
    Setup,
    /// Compile ebpf/ringwatch.bpf.c (which includes every ebpf/*.bpf.c) with
    /// clang into one BPF object with BTF (-O2 -g -target bpf).
    BuildEbpf {
        /// Where to write the object.
        #[arg(long, default_value = "target/bpf/ringwatch.bpf.o")]
        out: PathBuf,
    },
    /// The test suite, as CI runs it: setup, cargo fmt --check, clippy with
    /// -D warnings on all targets, every crate's unit and integration tests
    /// (the privileged eBPF tests run when root and skip otherwise),
    /// the Python package's pytest suite (`cargo xtask python --test`),
    /// Schemathesis against the agent's OpenAPI document (pinned from PyPI
    /// into target/schemathesis), the Kubernetes manifest's offline check
    /// (check-deploy), and the UI's end-to-end test in headless Chromium.
    Test,
    /// Only the test suite's API fuzzing: Schemathesis against
    /// /api/openapi.json of target/debug/ringwatch-agent (built here first),
    /// served with --replay on loopback.
    ApiFuzz,
    /// Only the test suite's check of the Kubernetes manifest: every
    /// document of deploy/ringwatch.yaml against the Kubernetes schemas
    /// (kubernetes-validate, pinned from PyPI into target/kubernetes-validate;
    /// offline), its invariants, and the check's self-test.
    CheckDeploy,
    /// Only the test suite's run of the docs' commands: every ```sh block of
    /// README.md and docs/guide/*.md marked `<!-- doc-test: run -->` runs as
    /// written (with target/debug and target/python-venv/bin on PATH); those
    /// marked `skip: why` are listed with their reason; an unmarked block
    /// fails. Builds the workspace and the Python venv first.
    DocCommands,
    /// Rewrite the reference pages that are rendered from the code
    /// (docs/reference: every command's flags from its clap definition, the
    /// runtime's environment variables, the HTTP API's OpenAPI document):
    /// runs their tests with RINGWATCH_UPDATE_REFERENCE=1. The suite runs the
    /// same tests without it, so a page that is not current fails CI.
    Reference,
    /// ringwatch's main job on this machine (root): the agent, a 2 x 2-rank
    /// collbench job on two pretend nodes with rate-limited links, tuned live
    /// by the agent, the UI's URL while it runs, then the chosen knobs,
    /// steps/s before and after, and the report's path.
    Demo(demo::Args),
    /// The agent's OCI image, offline: build the agent (release, or
    /// --debug-binary PATH), stage it with its shared libraries on FROM
    /// scratch (deploy/Containerfile.local), podman build, print the size.
    /// --run: run it as the DaemonSet does (least capabilities, --pid=host,
    /// read-only mounts) and check that it traces a collbench job started
    /// on the host. Needs root and podman + runc.
    Image(image::Args),
    /// The Python package (`import ringwatch.torch as rw`) built from
    /// collectives/python and installed into target/python-venv: a venv over
    /// Debian's python3 that sees its python3-torch, with maturin and pytest
    /// pinned from PyPI (installs python3-torch, python3-dev and python3-venv
    /// with apt-get when root). --test runs its pytest suite after.
    Python(python::Args),
    /// Benchmarks, each printing a table.
    #[command(after_long_help = compare::HELP)]
    Bench {
        /// Which benchmark.
        #[arg(value_enum)]
        which: Bench,
        #[command(flatten)]
        grid: tuning_grid::Args,
        #[command(flatten)]
        session: tuning_session::Args,
        #[command(flatten)]
        compare: Box<compare::Args>,
        #[command(flatten)]
        hostile: Box<hostile::Args>,
        #[command(flatten)]
        retune: Box<retune::Args>,
        #[command(flatten)]
        train: Box<train::Args>,
    },
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum Bench {
    /// Bayesian optimization vs random search on test functions.
    Tuner,
    /// eBPF probes: a loopback TCP ping-pong, then a 4-rank collbench
    /// resnet50 job, each with and without the agent (A/B slowdown),
    /// records/s, drops, agent CPU % and peak RSS, and for the job what the
    /// agent and each eBPF program cost as shares of its CPU time. Needs
    /// root.
    Probes,
    /// Exhaustive grid over the tuner's knob space: collbench resnet50 on 2
    /// pretend nodes × 2 ranks (needs root); prints the table, the best
    /// point and the runtime defaults' throughput, writes the table as JSON.
    TuningGrid,
    /// Self-tuning sessions (RINGWATCH_AUTOTUNE=1, no agent) on the grid's
    /// topology (needs root): each session's chosen knobs, the runtime
    /// defaults and the grid's best, measured in the same run; writes
    /// target/bench/tuning-session.json.
    TuningSession,
    /// Allreduce of float32 on -n local ranks at --sizes, side by side:
    /// ours (collbench sweep), Open MPI's MPI_Allreduce with shared
    /// memory and with TCP, and torch.distributed's gloo (TCP); interleaved
    /// --rounds, medians; time, busbw and ours/theirs per size; writes
    /// target/bench/compare.json. Installs openmpi-bin, libopenmpi-dev and
    /// python3-torch with apt-get when root.
    Compare,
    /// Issue #12's reproductions against the real agent and collbench (dev
    /// build; needs root): a job of user nobody naming pids 1 and 2 and
    /// flooding timeline frames, 1,100 slow HTTP clients, 400 timeline
    /// queries at 50 at once, an RSS soak on a busy job (--soak-minutes), a
    /// launcher stopped with SIGTERM, a rank stopped with SIGSTOP, 100
    /// control subscribers that never read. Each asserts a stated bound;
    /// prints the table, writes target/bench/hostile.json, fails if any
    /// bound failed. About 6 minutes.
    Hostile,
    /// A self-tuning job tuned beside CPU hogs that are killed when it pins
    /// its knobs: does its watch re-check the knobs (and tune again if they
    /// lost)? Prints when each thing happened and the job's own log lines;
    /// the reports go to target/bench/retune/, the summary to
    /// target/bench/retune.json. About 7 minutes (--job-seconds).
    Retune,
    /// Data-parallel training of torchvision's ResNet-18 (examples/pytorch/
    /// train.py) on ringwatch, PyTorch DDP + gloo and Horovod 0.28.1 + gloo
    /// (built from PyPI into target/horovod-venv on first use, ~15 minutes;
    /// --no-horovod leaves it out), on 1 x 4 and 2 x 2 pretend nodes (root):
    /// steps/s and images/s, interleaved rounds, and every contender's
    /// losses against single-process training on the combined batch. Writes
    /// target/bench/train.json. About 5 minutes after the first build.
    Train,
    /// `GET /api/timeline` on a live 4-rank collbench job (release agent,
    /// root): 1, 10 and 60 s windows, node and job, asked at full detail,
    /// downsampled as the viewer asked before, at a level of detail
    /// (width=1600) and as the viewer asks now (width=1600&view=overview);
    /// status, events, bytes, time, interleaved over 3 rounds. Writes
    /// target/bench/timeline.json. About 8 minutes.
    Timeline,
    /// What the NCCL profiler plugin costs a job per collective: the
    /// release library driven as NCCL drives it, with the agent reading,
    /// absent, stopped and with the plugin off, alternating, 3 rounds of
    /// 200,000 collectives. Prints a table; writes target/bench/nccl-profiler.json.
    /// About a minute.
    NcclProfiler,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.task {
        Task::Setup => setup(),
        Task::BuildEbpf { out } => build_ebpf(&out),
        Task::Test => test(),
        Task::ApiFuzz => api_fuzz(),
        Task::CheckDeploy => deploy::run(&root(), &cargo_target_dir(&root())),
        Task::DocCommands => doc_commands(),
        Task::Reference => {
            // SAFETY: set before any thread of this process starts.
            unsafe { std::env::set_var("RINGWATCH_UPDATE_REFERENCE", "1") };
            run(
                "cargo",
                &["test", "--workspace", "--all-targets", "reference_"],
            )
        }
        Task::Demo(args) => demo::run(&root(), &args),
        Task::Image(args) => image::run(&root(), &cargo_target_dir(&root()), &args),
        Task::Python(args) => python::run(&root(), &cargo_target_dir(&root()), &args),
        Task::Bench {
            which,
            grid,
            session,
            compare,
            hostile,
            retune,
            train,
        } => bench(which, &grid, &session, &compare, &hostile, &retune, &train),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(error) => {
            eprintln!("xtask: error: {error:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// The workspace root (xtask lives one level below it).
/// Spawns a thread that, on the first SIGINT or SIGTERM, says `message`, runs `cleanup`
/// and exits with 128 + the signal (130 / 143).
fn exit_on_signal(message: &'static str, cleanup: impl FnOnce() + Send + 'static) -> Result<()> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("cannot install the SIGINT/SIGTERM handler")?;
    std::thread::spawn(move || {
        if let Some(signal) = signals.forever().next() {
            eprintln!("xtask: signal {signal}: {message}");
            cleanup();
            std::process::exit(128 + signal);
        }
    });
    Ok(())
}

/// `path`, or `path` under the repository root if it is relative.
fn under_root(root: &std::path::Path, path: &std::path::Path) -> PathBuf {
    if path.is_absolute() {
        path.to_path_buf()
    } else {
        root.join(path)
    }
}

/// Writes a bench's `report` as pretty JSON to `out` (creating its directory) and says
/// so, with the bench's wall time since `started`.
fn write_json_report(
    out: &std::path::Path,
    report: &impl serde::Serialize,
    started: std::time::Instant,
) -> Result<()> {
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(report).context("encoding the results")?;
    std::fs::write(out, json).with_context(|| format!("writing {}", out.display()))?;
    println!(
        "# wrote {} ({:.0} s)",
        out.display(),
        started.elapsed().as_secs_f64()
    );
    Ok(())
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask/ has a parent")
        .to_path_buf()
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

/// Runs a command in the workspace root, echoing it; fails on non-zero exit.
fn run(program: &str, args: &[&str]) -> Result<()> {
    eprintln!("xtask: $ {program} {}", args.join(" "));
    let status = Command::new(program)
        .args(args)
        .current_dir(root())
        .status()
        .with_context(|| format!("could not start {program}"))?;
    if !status.success() {
        bail!("`{program} {}` failed ({status})", args.join(" "));
    }
    Ok(())
}

/// Debian packages the build and the tests need, with what each is for.
const APT_PACKAGES: &[(&str, &str)] = &[
    ("clang", "compiles the BPF programs"),
    ("llvm", "llvm-objdump/strip for inspecting the BPF object"),
    (
        "libbpf-dev",
        "bpf_helpers.h and friends for the BPF programs",
    ),
    ("libc6-dev", "kernel UAPI headers (linux/bpf.h)"),
    (
        "iproute2",
        "`ip netns` and `tc` for the multi-node and retransmit tests",
    ),
    (
        "chromium",
        "the headless browser of the UI's end-to-end test",
    ),
    (
        "podman",
        "builds and runs the agent's image in its privileged test (`cargo xtask image`)",
    ),
    (
        "runc",
        "the OCI runtime podman uses here (crun refuses hybrid cgroups)",
    ),
    (
        "prometheus",
        "promtool, Prometheus' checker of the agent's /metrics in the tests",
    ),
    (
        "openmpi-bin",
        "mpirun, for the test that finds an MPI job from its launcher's variables",
    ),
    (
        "libopenmpi-dev",
        "mpicc, which builds that test's MPI program",
    ),
];

/// Whether one of [`APT_PACKAGES`] is installed (checked by what the build
/// uses from it, not by asking dpkg).
fn package_present(package: &str) -> bool {
    match package {
        "clang" | "libbpf-dev" => build_support::check_toolchain().is_ok(),
        "llvm" => Path::new("/usr/bin/llvm-objdump").exists() || which("llvm-objdump"),
        "libc6-dev" => Path::new("/usr/include/linux/bpf.h").exists(),
        "iproute2" => which("ip") && which("tc"),
        "chromium" => Path::new(&chromium_path()).exists(),
        "podman" | "runc" => which(package),
        "prometheus" => which("promtool"),
        "openmpi-bin" => which("mpirun"),
        "libopenmpi-dev" => which("mpicc"),
        _ => false,
    }
}

fn which(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join(program).is_file()))
}

/// The browser the UI test drives (`RINGWATCH_CHROMIUM` overrides).
fn chromium_path() -> String {
    std::env::var("RINGWATCH_CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".to_owned())
}

/// Where cargo puts the build outputs of the workspace at `root`:
/// `CARGO_TARGET_DIR` when set (relative to `root`, where the builds run),
/// else `root/target`.
fn cargo_target_dir(root: &Path) -> PathBuf {
    match std::env::var_os("CARGO_TARGET_DIR") {
        Some(dir) if !dir.is_empty() => root.join(dir),
        _ => root.join("target"),
    }
}

fn setup() -> Result<()> {
    ensure_packages(APT_PACKAGES, package_present)?;
    ensure_packages(python::APT_PACKAGES, python::package_present)?;
    eprintln!(
        "xtask: prerequisites present ({})",
        APT_PACKAGES
            .iter()
            .chain(python::APT_PACKAGES)
            .map(|(p, _)| *p)
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// Installs the packages of `wanted` (package, what it is for) that
/// `present` says are missing: with apt-get when root on a Debian-like
/// system, saying so; otherwise fails with the exact command to run. Checks
/// again afterwards, so a package that installs but does not provide what
/// `present` looks for is an error, not a silent skip.
fn ensure_packages(wanted: &[(&str, &str)], present: impl Fn(&str) -> bool) -> Result<()> {
    let missing: Vec<(&str, &str)> = wanted
        .iter()
        .copied()
        .filter(|(package, _)| !present(package))
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    for (package, reason) in &missing {
        eprintln!("xtask: missing {package}: {reason}");
    }
    let names: Vec<&str> = missing.iter().map(|(package, _)| *package).collect();
    let apt = Path::new("/usr/bin/apt-get").exists();
    if !(is_root() && apt) {
        bail!(
            "install the missing packages first: {}apt-get install -y {}",
            if is_root() { "" } else { "sudo " },
            names.join(" ")
        );
    }
    eprintln!(
        "xtask: installing {} with apt-get (root on a Debian-like system)",
        names.join(" ")
    );
    run("apt-get", &["update", "-q"])?;
    let status = Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&names)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .status()
        .context("could not start apt-get")?;
    if !status.success() {
        bail!("apt-get install {} failed ({status})", names.join(" "));
    }
    let still: Vec<&str> = names
        .iter()
        .copied()
        .filter(|package| !present(package))
        .collect();
    if !still.is_empty() {
        bail!("still missing after apt-get install: {}", still.join(" "));
    }
    Ok(())
}

fn build_ebpf(out: &Path) -> Result<()> {
    setup()?;
    let out = if out.is_absolute() {
        out.to_path_buf()
    } else {
        root().join(out)
    };
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let arch = std::env::consts::ARCH;
    build_support::compile_bpf(&root().join("ebpf"), &out, arch).map_err(anyhow::Error::msg)?;
    let size = std::fs::metadata(&out).map(|m| m.len()).unwrap_or(0);
    println!("{} ({size} bytes)", out.display());
    Ok(())
}

fn test() -> Result<()> {
    setup()?;
    if !is_root() {
        eprintln!("xtask: not root: the privileged eBPF tests will skip (CI runs as root)");
    }
    run("cargo", &["fmt", "--all", "--", "--check"])?;
    run(
        "cargo",
        &[
            "clippy",
            "--workspace",
            "--all-targets",
            "--",
            "-D",
            "warnings",
        ],
    )?;
    // One build for every test: cargo builds all of it (the binaries of
    // packages with integration tests included: collbench, the agent)
    // before it runs any test, and the agent's tests run that collbench
    // (`agent/tests/common/procs.rs`), never a nested build of their own.
    // With promtool installed by setup, the /metrics tests must run it.
    // SAFETY: set before any thread of this process starts.
    unsafe { std::env::set_var("RINGWATCH_REQUIRE_PROMTOOL", "1") };
    run("cargo", &["test", "--workspace", "--all-targets"])?;
    // Doc tests are not built by --all-targets.
    run("cargo", &["test", "--workspace", "--doc"])?;
    // The NCCL profiler plugin by name, so it lands beside the agent's binary
    // (`target/debug/`), where the GPU test and the image look for it; the
    // test build above left it in `deps/` only.
    run(
        "cargo",
        &["build", "-p", "ringwatch-nccl-profiler", "--lib"],
    )?;
    let target_dir = cargo_target_dir(&root());
    // The PyTorch front end: built into its venv (dev profile, sharing the
    // build above's dependencies) and its pytest suite.
    let venv = python::install(&root(), &target_dir, false)?;
    python::test(
        &root(),
        &venv,
        Some(&target_dir.join("debug/ringwatch-agent")),
    )?;
    api_fuzz::run(
        &root(),
        &target_dir,
        &target_dir.join("debug/ringwatch-agent"),
    )?;
    deploy::run(&root(), &target_dir)?;
    // The README's and the guides' commands, as a user would paste them.
    doc_commands::run(&root(), &target_dir, Some(&venv))?;
    // The timeline viewer in headless Chromium (installs playwright-core from
    // the committed lock file into ui/tests/node_modules on first use).
    // It also loads the page from the real agent (`serve --replay`), built
    // by the cargo test run above.
    let agent = root().join("target/debug/ringwatch-agent");
    eprintln!(
        "xtask: $ RINGWATCH_AGENT_BIN={} node ui/tests/e2e.mjs",
        agent.display()
    );
    let status = Command::new("node")
        .arg("ui/tests/e2e.mjs")
        .env("RINGWATCH_AGENT_BIN", &agent)
        .current_dir(root())
        .status()
        .context("could not start node (the UI test needs Node.js)")?;
    if !status.success() {
        bail!("the UI's end-to-end test failed ({status})");
    }
    eprintln!("xtask: all checks passed");
    Ok(())
}

/// `cargo xtask doc-commands`: the workspace's dev build (the docs' commands
/// run its binaries) and the Python venv, then the docs' commands.
fn doc_commands() -> Result<()> {
    // Unmarked blocks fail before anything is built.
    doc_commands::collect(&root())?;
    run("cargo", &["build", "--workspace"])?;
    let target_dir = cargo_target_dir(&root());
    let venv = python::install(&root(), &target_dir, false)?;
    doc_commands::run(&root(), &target_dir, Some(&venv))
}

/// `cargo xtask api-fuzz`: the agent's dev build, then Schemathesis.
fn api_fuzz() -> Result<()> {
    run(
        "cargo",
        &["build", "-p", "agent", "--bin", "ringwatch-agent"],
    )?;
    let target_dir = cargo_target_dir(&root());
    api_fuzz::run(
        &root(),
        &target_dir,
        &target_dir.join("debug/ringwatch-agent"),
    )
}

fn bench(
    which: Bench,
    grid: &tuning_grid::Args,
    session: &tuning_session::Args,
    compare: &compare::Args,
    hostile: &hostile::Args,
    retune: &retune::Args,
    train: &train::Args,
) -> Result<()> {
    match which {
        Bench::Tuner => run("cargo", &["bench", "-p", "tuner", "--bench", "tuner"]),
        Bench::Probes => {
            run(
                "cargo",
                &["build", "--release", "-p", "agent", "-p", "collectives"],
            )?;
            let bench = root().join("target/release/ringwatch-bench");
            let bench = bench.to_str().context("non-UTF-8 target path")?;
            // The worst case (every hop an event), then what the agent
            // watches in practice: a collective job.
            run(bench, &[])?;
            // What watching adds to one context switch, seen from the
            // switching threads, with the BPF statistics off and on: the
            // statistics leave out the cost of calling a program.
            run(bench, &["--workload", "yield", "--pairs", "5"])?;
            // Jobs of 60 steps (~5 s): with 20, the spread between runs was as large as
            // the overhead being measured. With the kernel's BPF statistics:
            // what the agent and each program cost, as shares of the job's
            // CPU time, which this noisy machine measures far better than
            // a slowdown.
            run(
                bench,
                &[
                    "--workload",
                    "collbench",
                    "--pairs",
                    "7",
                    "--steps",
                    "60",
                    "--bpf-stats",
                ],
            )
        }
        Bench::TuningGrid => {
            if !is_root() {
                bail!(
                    "the tuning grid runs on pretend nodes (network namespaces): run it as root (sudo -E cargo xtask bench tuning-grid)"
                );
            }
            tuning_grid::run(&root(), grid)
        }
        Bench::TuningSession => {
            if !is_root() {
                bail!(
                    "the tuning sessions run on pretend nodes (network namespaces): run it as root (sudo -E cargo xtask bench tuning-session)"
                );
            }
            tuning_session::run(&root(), session, grid)
        }
        Bench::Compare => compare::run(&root(), compare),
        Bench::Hostile => hostile::run(&root(), hostile),
        Bench::Retune => retune::run(&root(), retune),
        Bench::Train => train::run(&root(), train),
        Bench::Timeline => timeline_bench::run(&root(), hostile, 3),
        Bench::NcclProfiler => {
            run(
                "cargo",
                &[
                    "build",
                    "--release",
                    "-p",
                    "ringwatch-nccl-profiler",
                    "--lib",
                    "--example",
                    "plugin_cost",
                ],
            )?;
            let bench = root().join("target/release/examples/plugin_cost");
            run(bench.to_str().context("non-UTF-8 target path")?, &[])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_command_line_is_well_formed() {
        // clap checks flag and group names only when a command is built.
        <Cli as clap::CommandFactory>::command().debug_assert();
    }
}
