//! `cargo xtask test`'s API fuzzing: Schemathesis, generating requests from
//! the agent's own `/api/openapi.json`, against a real `ringwatch-agent
//! serve` on loopback, with every check (no 5xx, statuses, content types
//! and bodies as documented, schema-valid input accepted, invalid input
//! refused, auth enforced), bounded in examples and time.
//!
//! Schemathesis comes from PyPI, pinned with its whole dependency set
//! (`xtask/api-fuzz/requirements.txt`), into a virtual environment under
//! `target/schemathesis` that is made once and reused while the pins hold.
//! The agent serves the UI test's recorded trace (`--replay`) and watches
//! an empty runtime directory (`--jobs`, so the tuning endpoints answer as
//! they do in production: 404 for an unknown job, not 503), with a token,
//! its lock, reports and runtime directory of its own under `target/`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{Context, Result, bail};

/// Requests per operation (Schemathesis' `--max-examples`).
const MAX_EXAMPLES: &str = "30";
/// The whole run's time budget, in seconds (`--max-time`).
const MAX_TIME_S: &str = "45";
/// A fixed seed: a failure is the same failure when run again.
const SEED: &str = "12";
/// The token the agent under test requires for POST/DELETE.
const TOKEN: &str = "xtask-api-fuzz-token";

/// Runs Schemathesis against the agent at `agent` (a built
/// `ringwatch-agent`), from the workspace at `root`.
pub fn run(root: &Path, target_dir: &Path, agent: &Path) -> Result<()> {
    let st = crate::venv::pinned(
        root,
        target_dir,
        "xtask/api-fuzz/requirements.txt",
        "schemathesis",
        "schemathesis",
    )?
    .join("bin/st");
    let work = target_dir.join("api-fuzz");
    let _ = std::fs::remove_dir_all(&work);
    for dir in ["runtime", "reports"] {
        std::fs::create_dir_all(work.join(dir))
            .with_context(|| format!("creating {}", work.join(dir).display()))?;
    }
    let mut agent = Agent::start(root, agent, &work)?;
    let schema = format!("http://{}/api/openapi.json", agent.address);
    let config = root.join("xtask/api-fuzz/schemathesis.toml");
    let report = work.join("report");
    let authorization = format!("Authorization: Bearer {TOKEN}");
    let args = [
        "--config-file",
        path_str(&config)?,
        "run",
        &schema,
        "--checks",
        "all",
        "--max-examples",
        MAX_EXAMPLES,
        "--max-time",
        MAX_TIME_S,
        "--seed",
        SEED,
        "--workers",
        "1",
        "--header",
        &authorization,
        "--report-dir",
        path_str(&report)?,
        "--report",
        "junit",
    ];
    eprintln!("xtask: $ {} {}", st.display(), args.join(" "));
    let status = Command::new(&st)
        .args(args)
        .current_dir(root)
        .status()
        .with_context(|| format!("could not start {}", st.display()));
    agent.stop();
    let status = status?;
    if !status.success() {
        bail!(
            "schemathesis found failures against /api/openapi.json ({status}); the agent's log \
             is {}, the report {}",
            work.join("agent.log").display(),
            work.join("report").display()
        );
    }
    Ok(())
}

use crate::venv::path_str;

/// The agent under test; stopped (SIGTERM, then SIGKILL) on drop.
struct Agent {
    child: Option<Child>,
    address: String,
}

impl Agent {
    fn start(root: &Path, agent: &Path, work: &Path) -> Result<Self> {
        if !agent.is_file() {
            bail!(
                "no agent at {}: the workspace's tests build it (cargo test --workspace --all-targets)",
                agent.display()
            );
        }
        let log_path = work.join("agent.log");
        let fixture = root.join("ui/tests/fixtures/ringwatch-2ranks.json");
        let mut command = Command::new(agent);
        command
            .args([
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--jobs",
                "--no-gpu-processes",
            ])
            .arg("--replay")
            .arg(&fixture)
            .arg("--runtime-dir")
            .arg(work.join("runtime"))
            .arg("--reports-dir")
            .arg(work.join("reports"))
            .arg("--lock-file")
            .arg(work.join("agent.lock"))
            .env("RINGWATCH_API_TOKEN", TOKEN)
            .env_remove("RINGWATCH_API_TOKEN_FILE")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        eprintln!(
            "xtask: starting {} serve --replay {}",
            agent.display(),
            fixture.display()
        );
        let mut child = command
            .spawn()
            .with_context(|| format!("starting {}", agent.display()))?;
        let stderr = child.stderr.take().context("the agent's stderr")?;
        let mut log = std::fs::File::create(&log_path)
            .with_context(|| format!("creating {}", log_path.display()))?;
        // Copy the log to a file, and hand over the address it prints.
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                let _ = std::io::Write::write_all(&mut log, format!("{line}\n").as_bytes());
                if let Some(rest) = line.split("serving the API on http://").nth(1) {
                    let _ = tx.send(rest.split('/').next().unwrap_or("").to_owned());
                }
            }
        });
        let mut agent = Self {
            child: Some(child),
            address: String::new(),
        };
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(address) if !address.is_empty() => agent.address = address,
            _ => {
                agent.stop();
                bail!(
                    "the agent did not start serving within 60 s; its log: {}",
                    log_path.display()
                );
            }
        }
        Ok(agent)
    }

    fn stop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(pid) = i32::try_from(child.id()) {
            // SAFETY: signalling a child we started and have not reaped.
            unsafe { libc::kill(pid, libc::SIGTERM) };
        }
        for _ in 0..100 {
            if matches!(child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.stop();
    }
}
