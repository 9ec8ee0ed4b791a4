//! `tune`: the command-line face of a running agent's tuning API: start a
//! session for a job and follow it (one table row per sample), show one
//! (`--status`) or stop one (`--stop`). Ctrl-C while following stops the
//! session (the job is left on the best knobs found).
//!
//! It only speaks HTTP to the agent (a small blocking client, on a blocking
//! thread); it never talks to a job itself.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use clap::Args;
use collectives::control::Knobs;
use serde_json::{Value, json};

use crate::tuning::{Objective, SessionState, SessionView};

/// What to tune and how.
#[derive(Debug, Clone, Args)]
pub struct TuneArgs {
    /// The job to tune (its id, as `GET /api/jobs` lists it).
    #[arg(long, value_name = "ID")]
    pub job: String,

    /// The agent's API.
    #[arg(
        long,
        value_name = "URL",
        env = "RINGWATCH_AGENT",
        default_value = "http://127.0.0.1:9477"
    )]
    pub agent: String,

    /// A file holding the agent's API token (first line), sent as
    /// `Authorization: Bearer TOKEN`; also RINGWATCH_API_TOKEN.
    #[arg(long, value_name = "FILE", env = "RINGWATCH_API_TOKEN_FILE")]
    pub token_file: Option<PathBuf>,

    /// Show the job's session (running or the last one) and exit.
    #[arg(long, conflicts_with = "stop")]
    pub status: bool,

    /// Stop the job's running session and exit.
    #[arg(long)]
    pub stop: bool,

    /// With --stop (or Ctrl-C): leave the job on its starting knobs instead
    /// of the best found.
    #[arg(long)]
    pub keep_start: bool,

    /// Samples (optimizer observations) [agent default: 20].
    #[arg(long)]
    pub budget: Option<usize>,

    /// Cycles with work skipped after each knob change [agent default: 3].
    #[arg(long)]
    pub warmup_cycles: Option<u64>,

    /// Cycles with work per measured window, at least [agent default: 10].
    #[arg(long)]
    pub measured_cycles: Option<u64>,

    /// Shortest measured window, ms [agent default: 1000].
    #[arg(long)]
    pub min_window_ms: Option<u64>,

    /// Optimizer seed [agent default: 0].
    #[arg(long)]
    pub seed: Option<u64>,

    /// Keep the fusion threshold at this many bytes (0: fusion off).
    #[arg(long, value_name = "BYTES")]
    pub fixed_fusion_threshold_bytes: Option<u64>,

    /// Keep the cycle time at this many ms.
    #[arg(long, value_name = "MS")]
    pub fixed_cycle_time_ms: Option<f64>,

    /// Keep hierarchical allreduce on (true) or off (false).
    #[arg(long, value_name = "BOOL")]
    pub fixed_hierarchical_allreduce: Option<bool>,

    /// Search the fusion threshold only in LO,HI bytes.
    #[arg(long, value_name = "LO,HI", value_parser = parse_pair::<u64>)]
    pub bounds_fusion_threshold_bytes: Option<[u64; 2]>,

    /// Search the cycle time only in LO,HI ms.
    #[arg(long, value_name = "LO,HI", value_parser = parse_pair::<f64>)]
    pub bounds_cycle_time_ms: Option<[f64; 2]>,
}

/// Parses `LO,HI`.
fn parse_pair<T: std::str::FromStr>(text: &str) -> Result<[T; 2], String> {
    let parse = |part: &str| {
        part.trim()
            .parse::<T>()
            .map_err(|_| format!("{part:?} in {text:?} is not a number"))
    };
    match text.split_once(',') {
        Some((lo, hi)) => Ok([parse(lo)?, parse(hi)?]),
        None => Err(format!("{text:?} is not LO,HI")),
    }
}

impl TuneArgs {
    /// The POST body: only what was given (the agent fills the defaults).
    fn request_body(&self) -> Value {
        let mut body = serde_json::Map::new();
        let mut put = |key: &str, value: Option<Value>| {
            if let Some(v) = value {
                body.insert(key.to_owned(), v);
            }
        };
        put("budget", self.budget.map(|v| json!(v)));
        put("warmup_cycles", self.warmup_cycles.map(|v| json!(v)));
        put("measured_cycles", self.measured_cycles.map(|v| json!(v)));
        put("min_window_ms", self.min_window_ms.map(|v| json!(v)));
        put("seed", self.seed.map(|v| json!(v)));
        let mut fixed = serde_json::Map::new();
        if let Some(v) = self.fixed_fusion_threshold_bytes {
            fixed.insert("fusion_threshold_bytes".into(), json!(v));
        }
        if let Some(v) = self.fixed_cycle_time_ms {
            fixed.insert("cycle_time_ms".into(), json!(v));
        }
        if let Some(v) = self.fixed_hierarchical_allreduce {
            fixed.insert("hierarchical_allreduce".into(), json!(v));
        }
        let mut bounds = serde_json::Map::new();
        if let Some(v) = &self.bounds_fusion_threshold_bytes {
            bounds.insert("fusion_threshold_bytes".into(), json!(v));
        }
        if let Some(v) = &self.bounds_cycle_time_ms {
            bounds.insert("cycle_time_ms".into(), json!(v));
        }
        if !fixed.is_empty() {
            body.insert("fixed".into(), Value::Object(fixed));
        }
        if !bounds.is_empty() {
            body.insert("bounds".into(), Value::Object(bounds));
        }
        Value::Object(body)
    }
}

/// Runs the command (its HTTP on a blocking thread; Ctrl-C stops the session).
pub async fn run(args: TuneArgs) -> Result<()> {
    let interrupted = Arc::new(AtomicBool::new(false));
    let flag = interrupted.clone();
    let watcher = tokio::spawn(async move {
        if tokio::signal::ctrl_c().await.is_ok() {
            flag.store(true, Ordering::Release);
        }
    });
    let result = tokio::task::spawn_blocking(move || run_blocking(&args, &interrupted))
        .await
        .context("the tune command's thread failed")?;
    watcher.abort();
    result
}

struct Client {
    http: ureq::Agent,
    base: String,
    token: Option<String>,
}

impl Client {
    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base.trim_end_matches('/'))
    }

    fn send(&self, request: ureq::Request, body: Option<&Value>) -> Result<(u16, Value)> {
        let request = match &self.token {
            Some(token) => request.set("Authorization", &format!("Bearer {token}")),
            None => request,
        };
        let url = request.url().to_owned();
        let answer = match body {
            Some(body) => request.send_json(body),
            None => request.call(),
        };
        let response = match answer {
            Ok(response) => response,
            Err(ureq::Error::Status(_, response)) => response,
            Err(error) => {
                return Err(error).with_context(|| {
                    format!("cannot reach the agent at {url} (is `ringwatch-agent serve --jobs` running?)")
                });
            }
        };
        let status = response.status();
        let value: Value = response
            .into_json()
            .with_context(|| format!("the agent's answer to {url} is not JSON"))?;
        Ok((status, value))
    }

    /// A session view, or the API's error message as an error.
    fn session(&self, request: ureq::Request, body: Option<&Value>) -> Result<SessionView> {
        let (status, value) = self.send(request, body)?;
        if !(200..300).contains(&status) {
            let message = value["error"]["message"]
                .as_str()
                .map_or_else(|| value.to_string(), str::to_owned);
            bail!("the agent answered {status}: {message}");
        }
        serde_json::from_value(value).context("the agent's session JSON is not what this CLI knows")
    }
}

fn run_blocking(args: &TuneArgs, interrupted: &AtomicBool) -> Result<()> {
    let token = match &args.token_file {
        Some(path) => Some(
            std::fs::read_to_string(path)
                .with_context(|| format!("reading the API token file {}", path.display()))?
                .lines()
                .next()
                .unwrap_or("")
                .trim()
                .to_owned(),
        ),
        None => std::env::var("RINGWATCH_API_TOKEN").ok(),
    }
    .filter(|t| !t.is_empty());
    let client = Client {
        http: ureq::AgentBuilder::new()
            .timeout(Duration::from_secs(40))
            .build(),
        base: args.agent.clone(),
        token,
    };
    let path = format!("/api/jobs/{}/tuning", url_segment(&args.job));
    let keep = if args.keep_start { "?keep=start" } else { "" };
    if args.status {
        let view = client.session(client.http.get(&client.url(&path)), None)?;
        print_samples(&view, 0);
        print_outcome(&view, &client);
        return Ok(());
    }
    if args.stop {
        let view = client.session(
            client.http.delete(&client.url(&format!("{path}{keep}"))),
            None,
        )?;
        println!(
            "asked the session of job {} to stop ({} samples so far)",
            view.job_id,
            view.samples.len()
        );
        return Ok(());
    }
    let view = client.session(
        client.http.post(&client.url(&path)),
        Some(&args.request_body()),
    )?;
    println!(
        "tuning job {}: budget {} samples, starting from {} (disturbance detection {})",
        view.job_id,
        view.config.budget,
        describe_knobs(&view.start_knobs),
        view.disturbance_detection
    );
    println!(
        "{:>6} {:>14} {:>10} {:>5} {:>14} {:>6}  disturbed",
        "sample", "fusion(bytes)", "cycle(ms)", "hier", "score", "best"
    );
    let mut shown = 0;
    let mut stop_sent = false;
    loop {
        if interrupted.load(Ordering::Acquire) && !stop_sent {
            stop_sent = true;
            eprintln!(
                "interrupted: stopping the session (the job is left on the best knobs found)"
            );
            client.session(
                client.http.delete(&client.url(&format!("{path}{keep}"))),
                None,
            )?;
        }
        let view = client.session(client.http.get(&client.url(&path)), None)?;
        shown = print_samples(&view, shown);
        if view.state != SessionState::Running {
            print_outcome(&view, &client);
            return match view.state {
                SessionState::Failed => bail!(
                    "the session failed: {}",
                    view.error.as_deref().unwrap_or("no reason given")
                ),
                _ => Ok(()),
            };
        }
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// Prints the samples from `from` on; returns how many are printed in all.
fn print_samples(view: &SessionView, from: usize) -> usize {
    let best = view.best.as_ref().map(|b| b.sample);
    for sample in view.samples.iter().skip(from) {
        println!(
            "{:>6} {:>14} {:>10.3} {:>5} {:>14} {:>6}  {}",
            sample.index,
            sample.knobs.fusion_threshold_bytes,
            sample.knobs.cycle_time_us as f64 / 1e3,
            sample.knobs.hierarchical_allreduce,
            view.objective
                .unwrap_or(Objective::BytesPerSecond)
                .format(sample.score),
            if best == Some(sample.index) { "*" } else { "" },
            sample.disturbed.as_deref().unwrap_or("-")
        );
    }
    view.samples.len().max(from)
}

fn print_outcome(view: &SessionView, client: &Client) {
    let state = match view.state {
        SessionState::Running => "running",
        SessionState::Done => "done",
        SessionState::Stopped => "stopped",
        SessionState::Failed => "failed",
    };
    println!("session {state}: {} samples", view.samples.len());
    if let Some(error) = &view.error {
        println!("error: {error}");
    }
    if let Some(best) = &view.best {
        println!("chosen knobs: {}", describe_knobs(&best.knobs));
    }
    println!("job now on: {}", describe_knobs(&view.current_knobs));
    if let Some(speedup) = view.speedup_over_start {
        println!("speedup over the starting knobs: {speedup:.3}x (measured)");
    }
    if let Some(id) = &view.report_id {
        println!(
            "report: {} (also ?format=csv, ?format=parquet)",
            client.url(&format!("/api/reports/{id}"))
        );
    }
}

fn describe_knobs(knobs: &Knobs) -> String {
    format!(
        "fusion threshold {} bytes, cycle time {:.3} ms, hierarchical allreduce {}",
        knobs.fusion_threshold_bytes,
        knobs.cycle_time_us as f64 / 1e3,
        if knobs.hierarchical_allreduce {
            "on"
        } else {
            "off"
        }
    )
}

/// Percent-encodes a job id for a URL path segment.
fn url_segment(text: &str) -> String {
    text.bytes()
        .map(|b| {
            if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b'~') {
                (b as char).to_string()
            } else {
                format!("%{b:02X}")
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        tune: TuneArgs,
    }

    #[test]
    fn only_given_settings_are_sent() {
        let cli = Cli::parse_from([
            "tune",
            "--job",
            "j",
            "--budget",
            "5",
            "--fixed-hierarchical-allreduce",
            "false",
            "--bounds-cycle-time-ms",
            "0.5,5",
        ]);
        assert_eq!(
            cli.tune.request_body(),
            json!({"budget": 5, "fixed": {"hierarchical_allreduce": false}, "bounds": {"cycle_time_ms": [0.5, 5.0]}})
        );
        let body: crate::tuning::TuningRequest =
            serde_json::from_value(cli.tune.request_body()).unwrap();
        assert_eq!(body.budget, Some(5));
        assert_eq!(url_segment("job 1/x"), "job%201%2Fx");
    }
}
