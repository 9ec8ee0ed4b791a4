//! Helpers for the agent's integration tests: start a workload, start the
//! agent on it, and collect the agent's JSON, with watchdogs so a bug fails
//! the test instead of hanging it.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// The agent binary built for these tests.
pub const AGENT: &str = env!("CARGO_BIN_EXE_ringwatch-agent");
/// The workload binary built for these tests.
pub const TESTLOAD: &str = env!("CARGO_BIN_EXE_ringwatch-testload");

/// True (after printing why) when this test cannot load BPF here.
pub fn skip_unless_privileged() -> bool {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: this test loads eBPF programs and needs root (CI runs as root)");
        return true;
    }
    if !std::path::Path::new("/sys/kernel/btf/vmlinux").exists() {
        eprintln!("SKIPPED: the kernel has no BTF (/sys/kernel/btf/vmlinux)");
        return true;
    }
    false
}

/// A running `ringwatch-testload --wait …` (or any program that follows its
/// protocol: one JSON line, then wait for a line on stdin).
pub struct Testload {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    /// The JSON line the workload printed about itself.
    pub info: serde_json::Value,
}

impl Testload {
    /// Starts the workload and reads its description line.
    pub fn start(args: &[&str]) -> Self {
        let mut command = Command::new(TESTLOAD);
        command.arg("--wait").args(args);
        Self::start_command(command)
    }

    /// Starts `command` (which must follow the `--wait` protocol).
    pub fn start_command(mut command: Command) -> Self {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let line = lines
            .recv_timeout(Duration::from_secs(10))
            .expect("the workload printed no description within 10 s");
        let info = serde_json::from_str(&line).unwrap();
        Self {
            child,
            stdin,
            lines,
            info,
        }
    }

    /// The workload's pid.
    pub fn pid(&self) -> u32 {
        self.info["pid"].as_u64().unwrap() as u32
    }

    /// Lets the workload start working.
    pub fn go(&mut self) {
        let mut stdin = self.stdin.take().expect("go() is called once");
        stdin.write_all(b"go\n").unwrap();
    }

    /// Waits for the workload to finish (it is killed after 30 s).
    pub fn wait(self) {
        let _ = self.wait_output();
    }

    /// Waits for the workload to finish and returns the JSON lines it
    /// printed after its description.
    pub fn wait_output(mut self) -> Vec<serde_json::Value> {
        let status = wait_within(&mut self.child, Duration::from_secs(30));
        assert!(status.success(), "workload failed: {status}");
        let mut out = Vec::new();
        while let Ok(line) = self.lines.recv_timeout(Duration::from_secs(2)) {
            out.push(serde_json::from_str(&line).unwrap());
        }
        out
    }
}

impl Drop for Testload {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A running `ringwatch-agent …` whose stdout is the result.
pub struct Agent {
    child: Child,
}

impl Agent {
    /// Starts the agent and waits until it says it is watching. Each test
    /// agent gets its own lock file (tests run in parallel) unless the test
    /// sets `RINGWATCH_LOCK_FILE` through [`Agent::start_with_lock`].
    pub fn start(args: &[&str]) -> Self {
        Self::start_with_lock(args, &unique_lock_file())
    }

    /// Starts the agent with the given lock file.
    pub fn start_with_lock(args: &[&str], lock_file: &str) -> Self {
        let mut child = Command::new(AGENT)
            .args(args)
            .env("RINGWATCH_LOCK_FILE", lock_file)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut ready = false;
            for line in BufReader::new(stderr).lines() {
                let Ok(line) = line else { break };
                eprintln!("[agent] {line}");
                if !ready && line.contains("watching pid") {
                    ready = true;
                    let _ = tx.send(());
                }
            }
        });
        if rx.recv_timeout(Duration::from_secs(60)).is_err() {
            let _ = child.kill();
            panic!("the agent did not start watching within 60 s (see its log above)");
        }
        Self { child }
    }

    /// Waits for the agent to exit and parses its JSON output.
    pub fn finish(mut self, limit: Duration) -> serde_json::Value {
        let mut stdout = self.child.stdout.take().unwrap();
        let reader = std::thread::spawn(move || {
            let mut text = String::new();
            std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
            text
        });
        let status = wait_within(&mut self.child, limit);
        let text = reader.join().unwrap();
        assert!(status.success(), "agent failed ({status}); stdout: {text}");
        serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("agent printed bad JSON ({e}): {text}"))
    }
}

/// A lock-file path no other test agent uses.
pub fn unique_lock_file() -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static NEXT: AtomicU32 = AtomicU32::new(0);
    std::env::temp_dir()
        .join(format!(
            "ringwatch-test-{}-{}.lock",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ))
        .display()
        .to_string()
}

/// Waits for `child` to exit; kills it and fails the test after `limit`.
pub fn wait_within(child: &mut Child, limit: Duration) -> std::process::ExitStatus {
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("process {} did not exit within {limit:?}", child.id());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
