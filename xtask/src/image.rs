//! `cargo xtask image`: the agent's OCI image, built offline from the repo,
//! and (`--run`) a check that it works the way the DaemonSet runs it.
//!
//! The image is `deploy/Containerfile.local`: `FROM scratch` plus a staged
//! root filesystem (the agent binary, the shared libraries `ldd` lists and
//! the dynamic loader). The BPF object and the UI are embedded in the
//! binary (`include_bytes!`/`include_str!`), so nothing else is needed. It
//! is built with Debian's podman, which on this kind of machine works only
//! with `--runtime runc --cgroup-manager=cgroupfs` (cgroups v1/hybrid: crun
//! refuses) and with explicit `--ulimit`s no higher than the caller's hard
//! limits. No image is pulled: `deploy/Containerfile` (the users' multi-stage
//! build) needs a registry and is not built here.
//!
//! The check ([`check`]) runs the image as the DaemonSet does: not
//! privileged, `--cap-drop=all` plus [`LEAST_CAPS`] only (measured: see
//! deploy/CAPABILITIES.md), the host's pid namespace, a read-only root
//! filesystem, `/sys/kernel/btf` and `/sys/kernel/tracing` read-only, the
//! jobs' runtime directory read-only and a writable reports directory. It
//! starts a 2-rank `collbench` job on the host (as user nobody when nobody
//! may run the binary, so the capability that reaches another user's socket
//! is exercised), and asserts through the container's API that the agent
//! lists the job with its ranks' host pids, shows the ranks' thread states
//! on the timeline, and counts exactly the TCP bytes the kernel says the
//! ranks sent and read (tcp_info of their sockets, from `ss`, between two
//! moments the ranks are stopped).
//!
//! Shared with `agent/tests/privileged_image.rs` through `#[path]`: this
//! file uses only crates both have (std, anyhow, clap, serde_json, ureq,
//! libc) and nothing of the xtask crate (`crate::…`).

use std::collections::{BTreeMap, BTreeSet};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use serde_json::Value;

/// The tag `cargo xtask image` gives the image.
pub const DEFAULT_TAG: &str = "localhost/ringwatch-agent:dev";

/// The capabilities the agent's container gets (after `--cap-drop=all`),
/// measured on kernel 6.18 (deploy/CAPABILITIES.md): BPF and PERFMON load and
/// attach the BTF tracepoint programs; DAC_OVERRIDE connects to the control
/// socket of a job of another user (connect(2) wants write permission on the
/// socket, and a job's socket is its owner's, mode 0755). Not needed:
/// SYS_PTRACE (the agent tells a job's pid namespace from the world-readable
/// NSpid depth and cgroup when it may not read `/proc/<pid>/ns/pid`; it was
/// needed while it read only that), SYS_RESOURCE (BPF memory is charged to
/// the memory cgroup since 5.11, not to RLIMIT_MEMLOCK), DAC_READ_SEARCH (the
/// other /proc files the agent reads are world-readable). NCCL uprobes would
/// need SYS_ADMIN (and SYS_PTRACE for `/proc/<pid>/root`): they are left out
/// (`--probes sched,tcp`).
pub const LEAST_CAPS: &[&str] = &["BPF", "PERFMON", "DAC_OVERRIDE"];

/// The probe groups the least-privilege container attaches: NCCL's uprobes
/// need CAP_SYS_ADMIN on kernels with "perf: Require CAP_SYS_ADMIN for
/// uprobes" (6.18 has it).
pub const LEAST_PROBES: &str = "sched,tcp";

/// The container engine's default seccomp profile (containers-common), from
/// which [`write_seccomp_profile`] derives the agent's.
pub const ENGINE_SECCOMP: &str = "/usr/share/containers/seccomp.json";

/// `cargo xtask image`'s flags.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Package the release build (the default; `cargo build --release -p
    /// agent --bin ringwatch-agent` runs first).
    #[arg(long, conflicts_with = "debug_binary")]
    pub release: bool,
    /// Package this already-built agent binary instead (no cargo build),
    /// e.g. target/debug/ringwatch-agent. With --run, the collbench next to
    /// it runs the job.
    #[arg(long, value_name = "PATH")]
    pub debug_binary: Option<PathBuf>,
    /// The image's tag.
    #[arg(long, default_value = DEFAULT_TAG)]
    pub tag: String,
    /// Then run the image as the DaemonSet does (least capabilities,
    /// --pid=host, read-only mounts), start a 2-rank collbench job on the
    /// host, and check the container's API: the job, its ranks' TCP bytes
    /// against the kernel's, thread states, /api/health. The container is
    /// removed afterwards; the image stays.
    #[arg(long)]
    pub run: bool,
}

/// `podman` with the options this machine needs (runc, cgroupfs).
pub fn podman() -> Command {
    let mut command = Command::new("podman");
    command.args(["--runtime", "runc", "--cgroup-manager", "cgroupfs"]);
    command
}

/// Why no image can be built or run here (podman or runc missing), if so.
pub fn engine_missing() -> Option<String> {
    for (program, package) in [("podman", "podman"), ("runc", "runc")] {
        let works = Command::new(program)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !works {
            return Some(format!(
                "no container engine: `{program} --version` does not run (install Debian's \
                 {package}: apt-get install -y podman runc)"
            ));
        }
    }
    None
}

/// Stages the image's build context in `context`: `Containerfile` (a copy of
/// `containerfile`) and `rootfs/` with `binary` (its debug info stripped) at
/// /usr/local/bin/ringwatch-agent, every library `ldd` lists (at the path it
/// lists, so the loader's default search finds it), the loader, the NCCL
/// profiler plugin where it lies beside `binary`, and empty /tmp, /run and
/// /var/lib/ringwatch/reports.
pub fn stage_context(binary: &Path, containerfile: &Path, context: &Path) -> Result<()> {
    if context.exists() {
        std::fs::remove_dir_all(context)
            .with_context(|| format!("removing the old context {}", context.display()))?;
    }
    let rootfs = context.join("rootfs");
    let bin_dir = rootfs.join("usr/local/bin");
    std::fs::create_dir_all(&bin_dir).with_context(|| format!("creating {}", bin_dir.display()))?;
    std::fs::copy(containerfile, context.join("Containerfile"))
        .with_context(|| format!("copying {}", containerfile.display()))?;
    let staged = bin_dir.join("ringwatch-agent");
    // Without its debug info (the release profile keeps line tables: 234 MB
    // with them, 33 MB without); symbols stay, for backtraces. Where strip
    // (binutils) is missing, the binary as it is.
    let stripped = Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(&staged)
        .arg(binary)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !stripped && std::fs::hard_link(binary, &staged).is_err() {
        std::fs::copy(binary, &staged)
            .with_context(|| format!("copying {} into the context", binary.display()))?;
    }
    // The NCCL profiler plugin, beside the binary: the agent publishes it
    // for training pods (`serve --nccl-profiler-dir`).
    let plugin = binary.with_file_name("libringwatch_nccl_profiler.so");
    if plugin.is_file() {
        std::fs::copy(&plugin, bin_dir.join("libringwatch_nccl_profiler.so"))
            .with_context(|| format!("copying {} into the context", plugin.display()))?;
    }
    for library in shared_libraries(binary)? {
        let relative = library
            .strip_prefix("/")
            .with_context(|| format!("ldd listed a relative path {}", library.display()))?;
        let dest = rootfs.join(relative);
        if let Some(dir) = dest.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        // fs::copy follows symlinks: the file itself, under the listed name.
        std::fs::copy(&library, &dest)
            .with_context(|| format!("copying {} into the context", library.display()))?;
    }
    use std::os::unix::fs::PermissionsExt;
    for (dir, mode) in [
        ("tmp", 0o1777),
        ("run", 0o755),
        ("var/lib/ringwatch/reports", 0o755),
    ] {
        let path = rootfs.join(dir);
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("chmod {}", path.display()))?;
    }
    Ok(())
}

/// The absolute paths of the shared libraries and the loader `ldd` lists for
/// `binary` (the vDSO has none and is skipped).
pub fn shared_libraries(binary: &Path) -> Result<Vec<PathBuf>> {
    let out = Command::new("ldd")
        .arg(binary)
        .output()
        .context("could not run ldd (libc-bin)")?;
    if !out.status.success() {
        bail!(
            "ldd {} failed: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut libraries = Vec::new();
    for line in text.lines() {
        // "libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)", or the
        // loader "/lib64/ld-linux-x86-64.so.2 (0x…)".
        let path = match line.split_once("=>") {
            Some((_, rest)) => rest.split_whitespace().next(),
            None => line.split_whitespace().next(),
        };
        if let Some(path) = path.filter(|p| p.starts_with('/')) {
            libraries.push(PathBuf::from(path));
        } else if line.contains("not found") {
            bail!("ldd: a library of {} is missing: {line}", binary.display());
        }
    }
    if libraries.is_empty() {
        bail!(
            "ldd listed no libraries for {} (a static binary needs no staging; this one is \
             expected to be dynamic): {text}",
            binary.display()
        );
    }
    Ok(libraries)
}

/// `podman build -t tag context`, quietly; fails with its output.
pub fn build_image(context: &Path, tag: &str) -> Result<()> {
    let out = podman()
        .args(["build", "--quiet", "-t", tag, "-f"])
        .arg(context.join("Containerfile"))
        .arg(context)
        .output()
        .context("could not run podman build")?;
    if !out.status.success() {
        bail!(
            "podman build -t {tag} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}

/// The image's size in bytes, as `podman image inspect` reports it.
pub fn image_size(tag: &str) -> Result<u64> {
    let out = podman()
        .args(["image", "inspect", "--format", "{{.Size}}", tag])
        .output()
        .context("could not run podman image inspect")?;
    if !out.status.success() {
        bail!(
            "podman image inspect {tag} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .with_context(|| format!("podman image inspect {tag}: not a size"))
}

/// An image removed when dropped (the test's; `cargo xtask image` keeps its own).
#[allow(dead_code)] // used by agent/tests/privileged_image.rs only
pub struct ImageGuard(pub String);

impl Drop for ImageGuard {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rmi", "--force", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

/// A container removed (killed first) when dropped.
pub struct ContainerGuard(pub String);

impl ContainerGuard {
    /// Its log so far (stdout and stderr), without colour codes.
    pub fn logs(&self) -> String {
        let out = podman().args(["logs", &self.0]).output();
        let text = out.map_or_else(
            |e| format!("(podman logs failed: {e})"),
            |o| {
                format!(
                    "{}{}",
                    String::from_utf8_lossy(&o.stdout),
                    String::from_utf8_lossy(&o.stderr)
                )
            },
        );
        strip_ansi(&text)
    }

    /// Whether it is still running.
    pub fn running(&self) -> bool {
        podman()
            .args(["inspect", "--format", "{{.State.Running}}", &self.0])
            .output()
            .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "true")
    }
}

impl Drop for ContainerGuard {
    fn drop(&mut self) {
        let _ = podman()
            .args(["rm", "--force", "--time", "2", &self.0])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
}

fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            // CSI: ESC [ parameters final-byte.
            for c in chars.by_ref() {
                if c.is_ascii_alphabetic() {
                    break;
                }
            }
        } else {
            out.push(c);
        }
    }
    out
}

/// How the container's seccomp filter is set.
#[derive(Debug, Clone)]
pub enum Seccomp {
    /// A profile file: the engine's default plus `bpf` allowed under
    /// CAP_BPF and `perf_event_open` under CAP_PERFMON, as containerd's and
    /// Docker's RuntimeDefault do since 2022.
    Profile(PathBuf),
    /// No filter (the engine's default profile is not there to derive from).
    Unconfined,
}

impl Seccomp {
    /// podman's `--security-opt` value.
    pub fn option(&self) -> String {
        match self {
            Self::Profile(path) => format!("seccomp={}", path.display()),
            Self::Unconfined => "seccomp=unconfined".to_owned(),
        }
    }
}

/// Writes to `out` the engine's default seccomp profile ([`ENGINE_SECCOMP`])
/// with `bpf` and `perf_event_open` allowed to a container that has CAP_BPF
/// and CAP_PERFMON. podman's own default (containers-common 0.50, Debian 12)
/// allows them only with CAP_SYS_ADMIN and answers EPERM otherwise: the
/// agent's first map fails to be created ("failed to create map … Operation
/// not permitted"), exactly as without CAP_BPF. Returns
/// [`Seccomp::Unconfined`] when there is no default profile to start from.
pub fn write_seccomp_profile(out: &Path) -> Result<Seccomp> {
    let Ok(text) = std::fs::read_to_string(ENGINE_SECCOMP) else {
        return Ok(Seccomp::Unconfined);
    };
    let mut profile: Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {ENGINE_SECCOMP}"))?;
    let syscalls = profile["syscalls"]
        .as_array_mut()
        .with_context(|| format!("{ENGINE_SECCOMP} has no syscalls list"))?;
    // A rule that denies them (the one for containers without
    // CAP_SYS_ADMIN) would win over an added allow rule: take them out of
    // every deny rule, then allow each under its own capability.
    for rule in syscalls.iter_mut() {
        if rule["action"] == "SCMP_ACT_ALLOW" {
            continue;
        }
        if let Some(names) = rule["names"].as_array_mut() {
            names.retain(|n| n != "bpf" && n != "perf_event_open");
        }
    }
    syscalls.retain(|rule| rule["names"].as_array().is_none_or(|n| !n.is_empty()));
    for (name, cap) in [("bpf", "CAP_BPF"), ("perf_event_open", "CAP_PERFMON")] {
        syscalls.push(serde_json::json!({
            "names": [name],
            "action": "SCMP_ACT_ALLOW",
            "includes": { "caps": [cap] }
        }));
    }
    std::fs::write(out, serde_json::to_vec_pretty(&profile)?)
        .with_context(|| format!("writing {}", out.display()))?;
    Ok(Seccomp::Profile(out.to_path_buf()))
}

/// The `--ulimit`s to pass: podman on this machine sets them explicitly, and
/// without CAP_SYS_RESOURCE no higher than this process's hard limits.
fn ulimits() -> Vec<String> {
    let hard = |resource| {
        let mut limit = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: `limit` is a valid rlimit to write to.
        if unsafe { libc::getrlimit(resource, &raw mut limit) } == 0 {
            limit.rlim_max
        } else {
            1024
        }
    };
    let nofile = hard(libc::RLIMIT_NOFILE).min(65_536);
    let nproc = hard(libc::RLIMIT_NPROC).min(4096);
    vec![
        format!("nofile={nofile}:{nofile}"),
        format!("nproc={nproc}:{nproc}"),
    ]
}

/// What [`check`] runs and where.
pub struct CheckOptions {
    /// The image to run.
    pub image: String,
    /// The host's collbench (the job).
    pub collbench: PathBuf,
    /// A fresh scratch directory (runtime dir, reports, seccomp profile, the
    /// job's log); removed by the caller.
    pub work: PathBuf,
    /// Say what happens, as it happens.
    pub verbose: bool,
}

/// What [`check`] saw.
#[derive(Debug)]
pub struct CheckReport {
    pub container: String,
    pub capabilities: Vec<String>,
    pub seccomp: String,
    pub job_id: String,
    pub job_user: String,
    /// Per rank pid: (TCP bytes sent, read) between the two stops, as the
    /// agent counted them, equal to the kernel's.
    pub tcp: BTreeMap<u32, (u64, u64)>,
    /// Per rank pid: its thread-state slices on the last 5 s of the timeline.
    pub thread_states: BTreeMap<u32, usize>,
    /// Seconds from `podman run` to /api/health answering.
    pub start_s: f64,
    /// Seconds the whole check took.
    pub total_s: f64,
}

impl std::fmt::Display for CheckReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "container {}: --cap-drop=all --cap-add={} --security-opt {} (API up in {:.1} s)",
            self.container,
            self.capabilities.join(","),
            self.seccomp,
            self.start_s
        )?;
        writeln!(
            f,
            "job {} (ranks run as {}) listed by the container's agent with its ranks' host pids",
            self.job_id, self.job_user
        )?;
        for (pid, (tx, rx)) in &self.tcp {
            writeln!(
                f,
                "rank pid {pid}: {tx} bytes sent, {rx} read between the two stops: agent = kernel \
                 (tcp_info); {} thread-state slices in the last 5 s",
                self.thread_states.get(pid).copied().unwrap_or(0)
            )?;
        }
        write!(f, "checked in {:.1} s", self.total_s)
    }
}

/// A unique name for this process's containers, jobs and tags.
pub fn unique_suffix() -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.subsec_nanos());
    format!("{}-{nanos:x}", std::process::id())
}

/// A port that was free on loopback a moment ago.
fn free_port() -> Result<u16> {
    let listener =
        std::net::TcpListener::bind("127.0.0.1:0").context("binding a free loopback port")?;
    Ok(listener.local_addr()?.port())
}

/// A running collbench job: its launcher and ranks are killed when dropped.
struct Job {
    launcher: std::process::Child,
}

impl Job {
    fn ranks(&self) -> BTreeSet<u32> {
        children_of(self.launcher.id())
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for pid in self.ranks() {
            // SAFETY: kill has no memory preconditions; the pid is our grandchild.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
    }
}

/// Pids of the live children of `parent`, from /proc.
fn children_of(parent: u32) -> BTreeSet<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return BTreeSet::new();
    };
    dir.flatten()
        .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
                stat.rsplit(')')
                    .next()
                    .and_then(|rest| rest.split_whitespace().nth(1))
                    .and_then(|ppid| ppid.parse::<u32>().ok())
                    == Some(parent)
            })
        })
        .collect()
}

/// GET `path` from the agent at `base`; the status and the body as JSON.
fn get_json(base: &str, path: &str) -> Result<(u16, Value)> {
    let response = match ureq::get(&format!("{base}{path}"))
        .timeout(Duration::from_secs(30))
        .call()
    {
        Ok(r) => r,
        Err(ureq::Error::Status(_, r)) => r,
        Err(e) => return Err(e).with_context(|| format!("GET {path}")),
    };
    let status = response.status();
    let body: Value = response
        .into_json()
        .with_context(|| format!("GET {path}: not JSON"))?;
    Ok((status, body))
}

/// Polls `probe` every 300 ms until it returns Some, for at most `limit` (a
/// hang guard: on a loaded machine the agent may take seconds to answer). A
/// probe's error (an answer that timed out, a 503) is tried again; the last
/// one is the result when the limit passes without an answer.
fn wait_for<T>(limit: Duration, mut probe: impl FnMut() -> Result<Option<T>>) -> Result<Option<T>> {
    let deadline = Instant::now() + limit;
    loop {
        let error = match probe() {
            Ok(Some(value)) => return Ok(Some(value)),
            Ok(None) => None,
            Err(error) => Some(error),
        };
        if Instant::now() > deadline {
            return match error {
                Some(error) => Err(error.context(format!("still failing after {limit:?}"))),
                None => Ok(None),
            };
        }
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// One TCP socket as `ss -tinp` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Socket {
    pids: BTreeSet<u32>,
    recv_q: u64,
    send_q: u64,
    bytes_acked: u64,
    bytes_received: u64,
}

/// Every TCP socket of the host's network namespace, or of the named one
/// (`ss -tinpH`), by (local, peer) address.
fn tcp_sockets(netns: Option<&str>) -> Result<BTreeMap<(String, String), Socket>> {
    let out = match netns {
        None => Command::new("ss").args(["-tinpH"]).output(),
        Some(ns) => Command::new("ip")
            .args(["netns", "exec", ns, "ss", "-tinpH"])
            .output(),
    }
    .context("could not run ss (iproute2)")?;
    if !out.status.success() {
        bail!("ss -tinpH failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let mut sockets = BTreeMap::new();
    let mut current: Option<(String, String)> = None;
    let counter = |line: &str, name: &str| -> u64 {
        line.split_whitespace()
            .find_map(|field| field.strip_prefix(name)?.strip_prefix(':')?.parse().ok())
            .unwrap_or(0)
    };
    for line in text.lines() {
        if line.starts_with(char::is_whitespace) {
            // The info line of the socket above it.
            if let Some(socket) = current.as_ref().and_then(|k| sockets.get_mut(k)) {
                let socket: &mut Socket = socket;
                socket.bytes_acked = counter(line, "bytes_acked");
                socket.bytes_received = counter(line, "bytes_received");
            }
            continue;
        }
        // State Recv-Q Send-Q Local Peer users:((…,pid=N,fd=M),…)
        let fields: Vec<&str> = line.split_whitespace().collect();
        if fields.len() < 5 {
            current = None;
            continue;
        }
        let pids = line
            .split("pid=")
            .skip(1)
            .filter_map(|rest| {
                rest.split(|c: char| !c.is_ascii_digit())
                    .next()?
                    .parse()
                    .ok()
            })
            .collect();
        let key = (fields[3].to_owned(), fields[4].to_owned());
        sockets.insert(
            key.clone(),
            Socket {
                pids,
                recv_q: fields[1].parse().unwrap_or(0),
                send_q: fields[2].parse().unwrap_or(0),
                bytes_acked: 0,
                bytes_received: 0,
            },
        );
        current = Some(key);
    }
    Ok(sockets)
}

/// What the kernel says `pid`'s TCP sockets carried: the sockets, the bytes
/// the peers acknowledged (all sent bytes, once the process is stopped and
/// its data delivered) and the bytes the process read (received minus still
/// queued).
fn kernel_tcp(
    sockets: &BTreeMap<(String, String), Socket>,
    pid: u32,
) -> (BTreeSet<(String, String)>, u64, u64) {
    let mine: Vec<(&(String, String), &Socket)> = sockets
        .iter()
        .filter(|(_, s)| s.pids.contains(&pid))
        .collect();
    (
        mine.iter().map(|(k, _)| (*k).clone()).collect(),
        mine.iter().map(|(_, s)| s.bytes_acked).sum(),
        mine.iter()
            .map(|(_, s)| s.bytes_received.saturating_sub(s.recv_q))
            .sum(),
    )
}

/// The agent's TCP totals for `pid` (sent, read), summed over its threads.
fn agent_tcp(processes: &Value, pid: u32) -> Option<(u64, u64)> {
    let process = processes["processes"]
        .as_array()?
        .iter()
        .find(|p| p["pid"] == pid)?;
    let threads = process["threads"].as_array()?;
    let sum = |key: &str| {
        threads
            .iter()
            .map(|t| t["totals"][key].as_u64().unwrap_or(0))
            .sum::<u64>()
    };
    Some((sum("tcp_tx_bytes"), sum("tcp_rx_bytes")))
}

/// Sends `signal` to every pid of `pids`.
fn signal_all(pids: &BTreeSet<u32>, signal: i32) {
    for &pid in pids {
        // SAFETY: kill has no memory preconditions; the pids are our job's ranks.
        unsafe { libc::kill(pid as i32, signal) };
    }
}

/// Per rank pid: its sockets, the kernel's bytes acknowledged and read, the
/// agent's bytes sent and read.
type Snapshot = BTreeMap<u32, (BTreeSet<(String, String)>, u64, u64, u64, u64)>;

/// Where some of a job's ranks run: the agent that watches them, their pids,
/// and the network namespace their sockets are in (`None`: the host's).
pub struct NodeRanks<'a> {
    pub base: &'a str,
    pub ranks: BTreeSet<u32>,
    pub netns: Option<&'a str>,
}

/// Stops the ranks of every node (the caller continues them), then takes the
/// kernel's counts, then each agent's once they stop changing (it
/// republishes its view every second).
fn stopped_snapshot(nodes: &[NodeRanks<'_>]) -> Result<Snapshot> {
    for node in nodes {
        signal_all(&node.ranks, libc::SIGSTOP);
    }
    let mut snapshot = Snapshot::new();
    for node in nodes {
        let ranks = &node.ranks;
        // Wait until every byte the ranks sent is acknowledged (Send-Q 0 on
        // all their sockets): then tcp_info's bytes_acked is all they sent.
        let deadline = Instant::now() + Duration::from_secs(10);
        let sockets = loop {
            std::thread::sleep(Duration::from_millis(200));
            let sockets = tcp_sockets(node.netns)?;
            let unacked: u64 = sockets
                .values()
                .filter(|s| s.pids.iter().any(|pid| ranks.contains(pid)))
                .map(|s| s.send_q)
                .sum();
            if unacked == 0 {
                break sockets;
            }
            if Instant::now() > deadline {
                bail!(
                    "the stopped ranks' sockets still hold {unacked} unacknowledged bytes after \
                     10 s"
                );
            }
        };
        // Three equal reads 1.2 s apart: the view is republished every
        // second, so an agent slow to drain its ring buffer on a loaded
        // machine is given two republications to catch up.
        let mut previous: Option<Vec<(u64, u64)>> = None;
        let mut equal_reads = 0;
        let deadline = Instant::now() + Duration::from_secs(20);
        let agent = loop {
            let (status, processes) = get_json(node.base, "/api/processes")?;
            if status != 200 {
                bail!("/api/processes answered {status}: {processes}");
            }
            let now: Vec<(u64, u64)> = ranks
                .iter()
                .map(|&pid| agent_tcp(&processes, pid).unwrap_or((0, 0)))
                .collect();
            if previous.as_ref() == Some(&now) {
                equal_reads += 1;
                if equal_reads == 2 {
                    break now;
                }
            } else {
                equal_reads = 0;
            }
            if Instant::now() > deadline {
                bail!(
                    "the agent's TCP totals of the stopped ranks kept changing for 20 s: {now:?}"
                );
            }
            previous = Some(now);
            std::thread::sleep(Duration::from_millis(1200));
        };
        for (&pid, (tx, rx)) in ranks.iter().zip(agent) {
            let (keys, acked, read) = kernel_tcp(&sockets, pid);
            snapshot.insert(pid, (keys, acked, read, tx, rx));
        }
    }
    Ok(snapshot)
}

/// Runs `image` as the DaemonSet runs it and checks it traces a collbench job
/// started on the host (see the module's documentation).
pub fn check(options: &CheckOptions) -> Result<CheckReport> {
    let started = Instant::now();
    let say = |line: &str| {
        if options.verbose {
            eprintln!("xtask: {line}");
        }
    };
    let suffix = unique_suffix();
    let runtime = options.work.join("runtime");
    let reports = options.work.join("reports");
    std::fs::create_dir_all(&runtime).with_context(|| format!("creating {}", runtime.display()))?;
    std::fs::create_dir_all(&reports).with_context(|| format!("creating {}", reports.display()))?;
    use std::os::unix::fs::PermissionsExt;
    // Like the node's /run/ringwatch: root's, 1777, every user's jobs put
    // their sockets there.
    std::fs::set_permissions(&runtime, std::fs::Permissions::from_mode(0o1777))
        .context("chmod 1777 the runtime directory")?;
    let seccomp = write_seccomp_profile(&options.work.join("seccomp.json"))?;
    let port = free_port()?;
    let base = format!("http://127.0.0.1:{port}");
    let name = format!("ringwatch-image-check-{suffix}");

    let mut run = podman();
    run.args(["run", "--detach", "--name", &name])
        .args(["--pid=host", "--network=host", "--read-only"])
        .arg("--cap-drop=all")
        .arg(format!("--cap-add={}", LEAST_CAPS.join(",")))
        .args(["--security-opt", &seccomp.option()])
        .args(["--security-opt", "no-new-privileges"]);
    for limit in ulimits() {
        run.args(["--ulimit", &limit]);
    }
    let mut mounts = vec![("/sys/kernel/btf".to_owned(), "/sys/kernel/btf", "ro")];
    if Path::new("/sys/kernel/tracing/events").exists() {
        mounts.push((
            "/sys/kernel/tracing".to_owned(),
            "/sys/kernel/tracing",
            "ro",
        ));
    }
    mounts.push((runtime.display().to_string(), "/run/ringwatch", "ro"));
    mounts.push((
        reports.display().to_string(),
        "/var/lib/ringwatch/reports",
        "rw",
    ));
    for (host, inside, mode) in &mounts {
        run.args(["--volume", &format!("{host}:{inside}:{mode}")]);
    }
    run.arg(&options.image).args([
        "serve",
        "--jobs",
        "--listen",
        &format!("127.0.0.1:{port}"),
        "--no-gpu-processes",
        "--probes",
        LEAST_PROBES,
        "--runtime-dir",
        "/run/ringwatch",
        "--reports-dir",
        "/var/lib/ringwatch/reports",
    ]);
    say(&format!(
        "starting the agent's container {name} (--cap-drop=all --cap-add={}, {}, --pid=host, \
         read-only)",
        LEAST_CAPS.join(","),
        seccomp.option()
    ));
    let run_started = Instant::now();
    let out = run.output().context("could not run podman run")?;
    if !out.status.success() {
        bail!(
            "podman run failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let container = ContainerGuard(name.clone());
    let up = wait_for(Duration::from_secs(180), || {
        if !container.running() {
            bail!("the agent's container exited:\n{}", container.logs());
        }
        Ok(get_json(&base, "/api/health")
            .ok()
            .filter(|(status, body)| *status == 200 && body["status"] == "ok"))
    })?;
    if up.is_none() {
        bail!(
            "the container's /api/health did not answer within 180 s:\n{}",
            container.logs()
        );
    }
    let start_s = run_started.elapsed().as_secs_f64();
    let logs = container.logs();
    if logs.contains("without eBPF") || logs.contains("no eBPF view") {
        bail!(
            "the agent in the container could not load its eBPF programs with --cap-add={} and \
             {}:\n{logs}",
            LEAST_CAPS.join(","),
            seccomp.option()
        );
    }
    say(&format!("the API answers on {base} ({start_s:.1} s)"));

    // The job: as user nobody when nobody may run collbench (a training pod
    // that is not root), else as root.
    let nobody = Command::new(&options.collbench)
        .arg("--help")
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    let job_id = format!("image-check-{suffix}");
    let job_log = options.work.join("job.log");
    let mut command = Command::new(&options.collbench);
    command
        .args(["-n", "2", "sweep", "--min-bytes", "4096", "--max-bytes"])
        .args(["4096", "--iters", "1000000000"])
        .env("RINGWATCH_RUNTIME_DIR", &runtime)
        .env("RINGWATCH_JOB_ID", &job_id)
        // Every byte between the ranks on TCP, where the probes see it.
        .env("RINGWATCH_SHM", "0")
        .env_remove("RANK")
        .env_remove("OMPI_COMM_WORLD_RANK")
        .env_remove("RINGWATCH_AUTOTUNE")
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&job_log).context("creating the job's log")?);
    if nobody {
        command.uid(65534).gid(65534);
    }
    let job_user = if nobody { "nobody (65534)" } else { "root" }.to_owned();
    say(&format!(
        "starting job {job_id}: collbench -n 2 sweep on TCP, as {job_user}"
    ));
    let job = Job {
        launcher: command.spawn().context("starting collbench")?,
    };

    // The container's agent finds the job and names its ranks' host pids.
    let found = wait_for(Duration::from_secs(180), || {
        let ranks = job.ranks();
        let (status, jobs) = get_json(&base, "/api/jobs")?;
        if status != 200 {
            bail!("/api/jobs answered {status}: {jobs}");
        }
        let Some(entry) = jobs["jobs"]
            .as_array()
            .and_then(|all| all.iter().find(|j| j["job_id"] == job_id.as_str()))
        else {
            return Ok(None);
        };
        let listed: BTreeSet<u32> = entry["ranks"]
            .as_array()
            .map(|r| {
                r.iter()
                    .filter_map(|r| r["pid"].as_u64().map(|p| p as u32))
                    .collect()
            })
            .unwrap_or_default();
        Ok(
            (entry["state"] == "connected" && listed.len() == 2 && listed == ranks)
                .then_some(listed),
        )
    })?;
    let Some(ranks) = found else {
        let (_, jobs) = get_json(&base, "/api/jobs").unwrap_or((0, Value::Null));
        bail!(
            "the container's agent did not list job {job_id} with ranks {:?} within 180 s: {jobs}\n\
             agent log:\n{}\njob log:\n{}",
            job.ranks(),
            container.logs(),
            std::fs::read_to_string(&job_log).unwrap_or_default()
        );
    };
    say(&format!(
        "the container lists job {job_id} with ranks {ranks:?}"
    ));

    // Thread states of both ranks on the timeline, asked for as the viewer
    // asks (a pixel grid: slices under a pixel summarized), so that the
    // answer stays small however busy the job is: every event of 5 s of
    // this 4 KiB sweep is tens of MB, which a debug agent took longer than
    // the request timeout to write, and with the job's own events beside
    // them more than the event limit.
    let timeline_path = format!("/api/timeline?job={job_id}&from=now-5s&width=1000");
    let states = wait_for(Duration::from_secs(180), || {
        let (status, trace) = get_json(&base, &timeline_path)?;
        if status != 200 {
            return Ok(None);
        }
        let counts: BTreeMap<u32, usize> = ranks
            .iter()
            .map(|&pid| {
                let n = trace["traceEvents"].as_array().map_or(0, |events| {
                    events
                        .iter()
                        .filter(|e| e["cat"] == "thread_state" && e["pid"] == pid)
                        .count()
                });
                (pid, n)
            })
            .collect();
        Ok(counts.values().all(|&n| n > 0).then_some(counts))
    })?;
    let Some(thread_states) = states else {
        bail!("no thread states of both ranks of {job_id} on {timeline_path} within 180 s");
    };
    let (status, processes) = get_json(&base, "/api/processes")?;
    if status != 200 || processes["source"] != "live" {
        bail!("/api/processes answered {status}: {processes}");
    }
    for &pid in &ranks {
        if agent_tcp(&processes, pid).is_none() {
            bail!("rank pid {pid} is not in /api/processes: {processes}");
        }
    }

    // TCP bytes, exact: what the agent counted between two moments the
    // ranks are stopped equals what the kernel's tcp_info says they sent
    // and read in between (the agent saw the job only after its start, so
    // totals since the start cannot be compared; differences can).
    let node = NodeRanks {
        base: &base,
        ranks: ranks.clone(),
        netns: None,
    };
    let tcp = tcp_between_stops(&[node], &say)?;
    say("TCP bytes of both ranks: the agent's equal the kernel's");
    drop(job);
    drop(container);
    Ok(CheckReport {
        container: name,
        capabilities: LEAST_CAPS.iter().map(|c| (*c).to_owned()).collect(),
        seccomp: seccomp.option(),
        job_id,
        job_user,
        tcp,
        thread_states,
        start_s,
        total_s: started.elapsed().as_secs_f64(),
    })
}

/// Per rank pid: the TCP bytes (sent, read) its node's agent counted between
/// two moments every rank of the job is stopped, checked equal to what the
/// kernel's tcp_info says the rank sent and read in between. Totals since a
/// job's start cannot be compared (an agent may see it only later);
/// differences can. Tried 3 times when the ranks' sockets change in between.
pub fn tcp_between_stops(
    nodes: &[NodeRanks<'_>],
    say: &dyn Fn(&str),
) -> Result<BTreeMap<u32, (u64, u64)>> {
    let continue_all = || {
        for node in nodes {
            signal_all(&node.ranks, libc::SIGCONT);
        }
    };
    let all: BTreeSet<u32> = nodes.iter().flat_map(|n| n.ranks.iter().copied()).collect();
    for attempt in 1..=3 {
        let first = stopped_snapshot(nodes);
        continue_all();
        let first = first?;
        // Until every rank sent something (the kernel says), however long a
        // loaded machine takes: a hang guard, not a rate.
        let deadline = Instant::now() + Duration::from_secs(120);
        loop {
            std::thread::sleep(Duration::from_millis(500));
            let mut idle: Vec<u32> = Vec::new();
            for node in nodes {
                let sockets = tcp_sockets(node.netns)?;
                idle.extend(
                    node.ranks
                        .iter()
                        .filter(|pid| kernel_tcp(&sockets, **pid).1 <= first[*pid].1)
                        .copied(),
                );
            }
            if idle.is_empty() {
                break;
            }
            if Instant::now() > deadline {
                bail!("rank pids {idle:?} sent nothing in 120 s: is the job running?");
            }
        }
        let second = stopped_snapshot(nodes);
        continue_all();
        let second = second?;
        let changed: Vec<String> = all
            .iter()
            .filter(|pid| first[*pid].0 != second[*pid].0)
            .map(|pid| {
                let (before, after) = (&first[pid].0, &second[pid].0);
                format!(
                    "pid {pid}: gone {:?}, new {:?}",
                    before.difference(after).collect::<Vec<_>>(),
                    after.difference(before).collect::<Vec<_>>()
                )
            })
            .collect();
        if !changed.is_empty() {
            say(&format!(
                "attempt {attempt}: the ranks' sockets changed in between ({}); again",
                changed.join("; ")
            ));
            continue;
        }
        let mut tcp = BTreeMap::new();
        for &pid in &all {
            let (_, acked1, read1, tx1, rx1) = &first[&pid];
            let (_, acked2, read2, tx2, rx2) = &second[&pid];
            let kernel = (acked2 - acked1, read2 - read1);
            let agent = (tx2.saturating_sub(*tx1), rx2.saturating_sub(*rx1));
            if agent != kernel {
                bail!(
                    "rank pid {pid}: the agent counted {} bytes sent and {} read, the kernel \
                     (tcp_info: bytes_acked, bytes_received - Recv-Q) {} and {}",
                    agent.0,
                    agent.1,
                    kernel.0,
                    kernel.1
                );
            }
            tcp.insert(pid, agent);
        }
        return Ok(tcp);
    }
    bail!("the ranks' sockets changed during each of 3 measurements")
}

/// `cargo xtask image`: build (release by default), stage, `podman build`,
/// the size; with `--run`, [`check`].
pub fn run(root: &Path, target_dir: &Path, args: &Args) -> Result<()> {
    if let Some(why) = engine_missing() {
        bail!("{why}");
    }
    let started = Instant::now();
    let (binary, collbench) = match &args.debug_binary {
        Some(binary) => {
            let binary = if binary.is_absolute() {
                binary.clone()
            } else {
                root.join(binary)
            };
            if !binary.is_file() {
                bail!("no agent binary at {}", binary.display());
            }
            let collbench = binary.with_file_name("collbench");
            (binary, collbench)
        }
        None => {
            let mut cargo = vec![
                "build",
                "--release",
                "-p",
                "agent",
                "--bin",
                "ringwatch-agent",
                "-p",
                "ringwatch-nccl-profiler",
            ];
            if args.run {
                cargo.extend(["-p", "collectives", "--bin", "collbench"]);
            }
            eprintln!(
                "xtask: building the release agent{} ($ cargo {}; minutes on a cold build)",
                if args.run { " and collbench" } else { "" },
                cargo.join(" ")
            );
            let build_started = Instant::now();
            let status = Command::new("cargo")
                .args(&cargo)
                .current_dir(root)
                .status()
                .context("could not start cargo")?;
            if !status.success() {
                bail!("`cargo {}` failed ({status})", cargo.join(" "));
            }
            eprintln!(
                "xtask: built in {:.0} s",
                build_started.elapsed().as_secs_f64()
            );
            (
                target_dir.join("release/ringwatch-agent"),
                target_dir.join("release/collbench"),
            )
        }
    };
    let context = target_dir.join("image/context");
    eprintln!(
        "xtask: staging {} and its libraries ({}) in {}",
        binary.display(),
        shared_libraries(&binary)?
            .iter()
            .map(|l| l.display().to_string())
            .collect::<Vec<_>>()
            .join(", "),
        context.display()
    );
    stage_context(&binary, &root.join("deploy/Containerfile.local"), &context)?;
    eprintln!(
        "xtask: $ podman --runtime runc --cgroup-manager cgroupfs build -t {} {}",
        args.tag,
        context.display()
    );
    let build_started = Instant::now();
    build_image(&context, &args.tag)?;
    let size = image_size(&args.tag)?;
    println!(
        "image {}: {:.1} MB ({size} bytes; binary {:.1} MB, {:.1} MB without debug info), \
         podman build {:.1} s",
        args.tag,
        size as f64 / 1e6,
        std::fs::metadata(&binary).map_or(0.0, |m| m.len() as f64 / 1e6),
        std::fs::metadata(context.join("rootfs/usr/local/bin/ringwatch-agent"))
            .map_or(0.0, |m| m.len() as f64 / 1e6),
        build_started.elapsed().as_secs_f64()
    );
    if args.run {
        if !collbench.is_file() {
            bail!(
                "no collbench at {} to run the job (build it: cargo build -p collectives --bin \
                 collbench, in the agent binary's profile)",
                collbench.display()
            );
        }
        let work = target_dir.join(format!("image/check-{}", unique_suffix()));
        let _ = std::fs::remove_dir_all(&work);
        std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;
        let result = check(&CheckOptions {
            image: args.tag.clone(),
            collbench,
            work: work.clone(),
            verbose: true,
        });
        let _ = std::fs::remove_dir_all(&work);
        println!("{}", result?);
    }
    eprintln!(
        "xtask: image done in {:.0} s",
        started.elapsed().as_secs_f64()
    );
    Ok(())
}
