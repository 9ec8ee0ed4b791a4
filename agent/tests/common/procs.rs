//! Process helpers shared by the agent's unit tests (`jobs.rs`, through a
//! `#[path]` module) and its integration tests (`common::procs`): the
//! `collbench` binary, a process's children from /proc, and a 2-rank job that
//! runs until dropped.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

/// The `collbench` binary of the build this test belongs to: the one in
/// the profile directory above this test's executable (`target/debug/`
/// for `target/debug/deps/agent-…`), which `cargo test --workspace
/// --all-targets` (what `cargo xtask test` runs) builds before any test
/// runs, with the workspace's features (collectives' integration tests
/// need it). No nested `cargo build`: one with other features compiled
/// collectives, tuner and polars a second time inside the test run. A test
/// binary cannot use `CARGO_BIN_EXE_collbench`: that exists only for its
/// own package. Run alone (`cargo test -p agent`), build it first with
/// `cargo build -p collectives --bin collbench`, or the test stops saying so.
pub fn collbench() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own executable path");
    // target/<profile>/deps/<test>: the profile directory is two up.
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("a test executable lives in target/<profile>/deps/");
    let collbench = profile_dir.join(format!("collbench{}", std::env::consts::EXE_SUFFIX));
    assert!(
        collbench.is_file(),
        "no collbench at {}: this test runs the collbench that the workspace's test build \
         makes (`cargo xtask test`, or `cargo test --workspace --all-targets`); running the \
         agent's tests alone, build it first with `cargo build -p collectives --bin collbench`",
        collbench.display()
    );
    collbench
}

/// Pids of the live children of `parent`, from /proc.
pub fn children_of(parent: u32) -> BTreeSet<u32> {
    std::fs::read_dir("/proc")
        .unwrap()
        .flatten()
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

/// Waits until a collbench launcher `launcher` has started its job: its
/// control socket `socket` exists and at least `ranks` rank processes run.
/// Returns the ranks' pids. Panics after 60 s.
pub fn wait_for_job_start(launcher: u32, socket: &Path, ranks: usize) -> BTreeSet<u32> {
    test_support::eventually_reporting(
        std::time::Duration::from_secs(60),
        &format!("the job of launcher {launcher} starting"),
        || {
            let children = children_of(launcher);
            if socket.exists() && children.len() >= ranks {
                Ok(children)
            } else {
                Err(format!(
                    "socket {} {}, {} of {ranks} ranks",
                    socket.display(),
                    if socket.exists() { "there" } else { "missing" },
                    children.len()
                ))
            }
        },
    )
}

/// A 2-rank collbench job that runs until killed, found through its socket
/// in its own runtime directory; killed, and its directory removed, on drop
/// (a failing test leaves no job behind).
pub struct Job {
    /// Its runtime directory (`RINGWATCH_RUNTIME_DIR`), with its socket.
    pub dir: PathBuf,
    /// Its job id.
    pub id: String,
    launcher: std::process::Child,
    /// The ranks' pids.
    pub ranks: BTreeSet<u64>,
}

impl Job {
    /// Starts the job, named after `name`, and waits until its ranks run.
    pub fn start(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "ringwatch-privileged-{name}-{}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let id = format!("{name}-test-{}", std::process::id());
        let socket = dir.join(format!("{id}.sock"));
        let launcher = std::process::Command::new(collbench())
            .args(["-n", "2", "sweep", "--min-bytes", "4096", "--max-bytes"])
            .args(["4096", "--iters", "1000000000"])
            .env("RINGWATCH_RUNTIME_DIR", &dir)
            .env("RINGWATCH_JOB_ID", &id)
            .env_remove("RANK")
            .env_remove("OMPI_COMM_WORLD_RANK")
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let ranks = wait_for_job_start(launcher.id(), &socket, 2)
            .into_iter()
            .map(u64::from)
            .collect();
        Self {
            dir,
            id,
            launcher,
            ranks,
        }
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for pid in &self.ranks {
            // SAFETY: kill has no memory preconditions; the pid is our grandchild.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        // Not wait_within: a panic while the test already panics aborts.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while matches!(self.launcher.try_wait(), Ok(None)) && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        let _ = self.launcher.kill();
        let _ = self.launcher.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The NCCL profiler plugin library the workspace's build made; as
/// [`collbench`], never a nested build. Cargo writes a dependency's `cdylib`
/// to `target/<profile>/deps/` and copies it up to `target/<profile>/` only
/// when it was asked for by name, so `deps/` is looked at first.
pub fn nccl_profiler_lib() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's own executable path");
    let deps = exe
        .parent()
        .expect("a test executable lives in target/<profile>/deps/");
    let candidates = [
        deps.join("libringwatch_nccl_profiler.so"),
        deps.parent()
            .unwrap_or(deps)
            .join("libringwatch_nccl_profiler.so"),
    ];
    match candidates.iter().find(|lib| lib.is_file()) {
        Some(lib) => lib.clone(),
        None => panic!(
            "no NCCL profiler plugin at {} or {}: `cargo test --workspace --all-targets` \
             (what `cargo xtask test` runs) builds it; running the agent's tests alone, build \
             it first with `cargo build -p ringwatch-nccl-profiler`",
            candidates[0].display(),
            candidates[1].display()
        ),
    }
}
