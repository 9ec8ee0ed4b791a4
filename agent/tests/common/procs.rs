//! Process helpers shared by the agent's unit tests (`jobs.rs`, through a
//! `#[path]` module) and its integration tests (`common::procs`): the
//! `collbench` binary, and a process's children from /proc.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The `collbench` binary, built by cargo the way this test was built:
/// `cargo build -p collectives --bin collbench`, asking cargo (its JSON
/// messages) where the executable is, so it works for any target dir
/// and profile and never runs a stale binary. A test binary cannot use
/// `CARGO_BIN_EXE_collbench`: that exists only for its own package.
pub fn collbench() -> PathBuf {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.toml");
    let output = Command::new(env!("CARGO"))
        .args([
            "build",
            "--quiet",
            "-p",
            "collectives",
            "--bin",
            "collbench",
        ])
        .arg("--message-format=json-render-diagnostics")
        .arg("--manifest-path")
        .arg(&manifest)
        .stderr(Stdio::inherit())
        .output()
        .expect("running cargo to build collbench");
    assert!(output.status.success(), "building collbench failed");
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find_map(|m| {
            (m["target"]["name"] == "collbench")
                .then(|| m["executable"].as_str().map(PathBuf::from))
                .flatten()
        })
        .expect("cargo named no collbench executable")
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
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let children = children_of(launcher);
        if socket.exists() && children.len() >= ranks {
            return children;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the job did not start within 60 s (socket {}, {} of {ranks} ranks)",
            socket.display(),
            children.len()
        );
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
}
