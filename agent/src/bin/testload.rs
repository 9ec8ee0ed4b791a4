//! `ringwatch-testload`: workloads whose behaviour is known exactly, for the
//! agent's privileged integration tests and the demo.
//!
//! Each workload prints one JSON line describing itself (pid, the tid that
//! does the work) on stdout, then, with `--wait`, waits for a line on stdin
//! before starting, so a test can attach the agent first.

use std::io::{BufRead, Write};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

/// Workloads with known ground truth for testing ringwatch-agent.
#[derive(Debug, Parser)]
#[command(name = "ringwatch-testload", version)]
struct Cli {
    /// Print the JSON line, then wait for a line on stdin before working.
    #[arg(long, global = true)]
    wait: bool,

    #[command(subcommand)]
    workload: Workload,
}

#[derive(Debug, Subcommand)]
enum Workload {
    /// One thread named `rw-sleeper` sleeps COUNT times for INTERVAL each:
    /// at least COUNT switches out (blocked) and COUNT in.
    Sleep {
        /// How many sleeps.
        #[arg(long, default_value_t = 10)]
        count: u32,
        /// How long each sleep lasts, e.g. `100ms`.
        #[arg(long, default_value = "100ms", value_parser = humantime::parse_duration)]
        interval: Duration,
    },
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.workload {
        Workload::Sleep { count, interval } => {
            let (tid_tx, tid_rx) = std::sync::mpsc::channel();
            let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
            let sleeper = std::thread::Builder::new()
                .name("rw-sleeper".into())
                .spawn(move || {
                    // SAFETY: gettid has no preconditions.
                    let tid = unsafe { libc::gettid() };
                    let _ = tid_tx.send(tid);
                    if go_rx.recv().is_ok() {
                        for _ in 0..count {
                            std::thread::sleep(interval);
                        }
                    }
                })
                .context("spawning the sleeper thread")?;
            let tid = tid_rx
                .recv()
                .context("the sleeper thread died before reporting its tid")?;
            announce(&serde_json::json!({
                "workload": "sleep", "pid": std::process::id(), "tid": tid,
                "count": count, "interval_ms": interval.as_millis() as u64,
            }))?;
            wait_for_go(cli.wait)?;
            go_tx.send(()).context("the sleeper thread exited early")?;
            sleeper
                .join()
                .map_err(|_| anyhow::anyhow!("the sleeper thread panicked"))?;
        }
    }
    Ok(())
}

fn announce(description: &serde_json::Value) -> Result<()> {
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{description}").context("writing to stdout")?;
    stdout.flush().context("flushing stdout")
}

fn wait_for_go(wait: bool) -> Result<()> {
    if wait {
        let mut line = String::new();
        std::io::stdin()
            .lock()
            .read_line(&mut line)
            .context("reading the go line from stdin")?;
    }
    Ok(())
}
