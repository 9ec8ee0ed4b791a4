//! Tuning sessions against real jobs: `ringwatch-agent serve --jobs` finds a
//! local `collbench` job through its control socket, a session started with
//! `POST /api/jobs/{id}/tuning` samples knobs, pins the best one on the job
//! and writes a report whose rows are the samples taken; killing the agent
//! mid-session leaves the job running to a clean finish on the knobs it had;
//! and the API's errors and token rules. As root the agent also loads eBPF
//! (disturbance detection); unprivileged it runs without it, and these tests
//! pass either way.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use collectives::control::{AutotuneState, ControlClient, Knobs};
use common::ApiServer;
use common::procs::{collbench, wait_for_job_start};
use serde_json::Value;
use test_support::{TempDir, eventually, eventually_reporting};

/// A job that runs until killed: 4 KiB allreduces, back to back, so that
/// cycles (and tuning windows) come quickly.
/// The endless small sweep on an 8 ms cycle: slow knobs a session can
/// clearly improve on.
fn slow_small_sweep() -> Vec<&'static str> {
    [&["--cycle-time-ms", "8"], ENDLESS_SMALL_SWEEP].concat()
}

const ENDLESS_SMALL_SWEEP: &[&str] = &[
    "sweep",
    "--min-bytes",
    "4096",
    "--max-bytes",
    "4096",
    "--iters",
    "1000000000",
];

/// A local 2-rank collbench job in its own process group (killed whole on
/// drop).
struct Job {
    launcher: Child,
    socket: PathBuf,
}

impl Job {
    fn start(dir: &Path, id: &str, workload: &[&str]) -> Self {
        Self::start_with_env(dir, id, workload, &[])
    }

    fn start_with_env(dir: &Path, id: &str, workload: &[&str], env: &[(&str, &str)]) -> Self {
        Self::start_as(dir, id, workload, env, None)
    }

    /// Starts the job, as user `uid` (and group `uid`) when given.
    fn start_as(
        dir: &Path,
        id: &str,
        workload: &[&str],
        env: &[(&str, &str)],
        uid: Option<u32>,
    ) -> Self {
        let mut command = Command::new(collbench());
        if let Some(uid) = uid {
            command.uid(uid).gid(uid);
        }
        let launcher = command
            .args(["-n", "2", "--json"])
            .args(workload)
            .env("RINGWATCH_RUNTIME_DIR", dir)
            .env("RINGWATCH_JOB_ID", id)
            .env_remove("RANK")
            .env_remove("OMPI_COMM_WORLD_RANK")
            .env_remove("RINGWATCH_AUTOTUNE")
            .env_remove("HOROVOD_AUTOTUNE")
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .process_group(0)
            .spawn()
            .unwrap();
        let socket = dir.join(format!("{id}.sock"));
        wait_for_job_start(launcher.id(), &socket, 2);
        Self { launcher, socket }
    }

    /// The job's knobs and autotune state, asked on a connection of our own.
    fn knobs(&self) -> (Knobs, AutotuneState) {
        let mut client = ControlClient::connect(&self.socket, Duration::from_secs(5)).unwrap();
        let autotune = client.hello().autotune;
        let (knobs, _) = client.get_knobs(Duration::from_secs(10)).unwrap();
        (knobs, autotune)
    }

    /// The job's knobs once its autotune state is `state`: the job learns
    /// of a claim, or of its holder's end, on its own connection's thread,
    /// a moment after the agent acted (60 s: a hang guard, not a timing).
    fn knobs_once(&self, state: AutotuneState) -> (Knobs, AutotuneState) {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let (knobs, now) = self.knobs();
            if now == state || Instant::now() > deadline {
                return (knobs, now);
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Job {
    /// The knobs of a cycle that started after any change already asked
    /// for took effect: two cycles after the one running now.
    fn settled_knobs(&self) -> Knobs {
        let mut client = ControlClient::connect(&self.socket, Duration::from_secs(5)).unwrap();
        let (_, cycle_now) = client.get_knobs(Duration::from_secs(10)).unwrap();
        client.subscribe(true, false).unwrap();
        eventually(
            Duration::from_secs(60),
            &format!("a cycle two after {cycle_now}"),
            || match client.next_message(Duration::from_secs(1)).unwrap() {
                Some(collectives::control::ServerMessage::CycleStats(stats))
                    if stats.cycle >= cycle_now + 2 =>
                {
                    Some(stats.knobs)
                }
                _ => None,
            },
        )
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        // SAFETY: kill has no memory preconditions; the group is the job's.
        unsafe { libc::kill(-(self.launcher.id() as i32), libc::SIGKILL) };
        let _ = self.launcher.wait();
    }
}

/// Polls `GET /api/jobs` until `job_id` is listed.
fn wait_for_job(agent: &ApiServer, job_id: &str) {
    eventually_reporting(
        Duration::from_secs(30),
        &format!("the agent finding job {job_id}"),
        || {
            let (status, jobs) = agent.get_json("/api/jobs");
            assert_eq!(status, 200, "{jobs}");
            if jobs["jobs"]
                .as_array()
                .is_some_and(|jobs| jobs.iter().any(|j| j["job_id"] == job_id))
            {
                Ok(())
            } else {
                Err(jobs)
            }
        },
    );
}

/// Polls the session until `done(session)` or the limit.
fn poll_session(
    agent: &ApiServer,
    job_id: &str,
    limit: Duration,
    done: impl Fn(&Value) -> bool,
) -> Value {
    eventually_reporting(limit, "the session getting there", || {
        let (status, session) = agent.get_json(&format!("/api/jobs/{job_id}/tuning"));
        assert_eq!(status, 200, "{session}");
        if done(&session) {
            Ok(session)
        } else {
            Err(format!("{session:#}"))
        }
    })
}

fn knobs_of(value: &Value) -> Knobs {
    serde_json::from_value(value.clone()).unwrap_or_else(|e| panic!("not knobs ({e}): {value}"))
}

fn agent_args<'a>(runtime: &'a TempDir, reports: &'a TempDir) -> Vec<&'a str> {
    vec![
        "--jobs",
        "--runtime-dir",
        runtime.path().to_str().unwrap(),
        "--reports-dir",
        reports.path().to_str().unwrap(),
        "--no-autotune",
    ]
}

#[test]
fn a_short_session_pins_the_reported_best_and_its_report_matches_the_samples() {
    let runtime = TempDir::new("tuning-test-e2e-run");
    let reports = TempDir::new("tuning-test-e2e-reports");
    let job_id = format!("tune-e2e-{}", std::process::id());
    // One 4 KiB allreduce per cycle, for as long as the test needs: the
    // cycle time decides the throughput, and the job starts on a slow one.
    let job = Job::start(runtime.path(), &job_id, &slow_small_sweep());
    let agent = ApiServer::start(&agent_args(&runtime, &reports), false);
    wait_for_job(&agent, &job_id);

    let body = r#"{"budget":5,"warmup_cycles":2,"measured_cycles":20,"min_window_ms":300,"seed":1,"bounds":{"cycle_time_ms":[0.5,10]}}"#;
    let (status, _, created) = agent.send("POST", &format!("/api/jobs/{job_id}/tuning"), &[], body);
    assert_eq!(status, 201, "{created}");
    let created: Value = serde_json::from_str(&created).unwrap();
    assert_eq!(created["state"], "running", "{created}");
    assert_eq!(created["config"]["budget"], 5);

    let session = poll_session(&agent, &job_id, Duration::from_secs(180), |s| {
        s["state"] != "running"
    });
    assert_eq!(session["state"], "done", "{session:#}");
    assert_eq!(session["error"], Value::Null);
    assert_eq!(knobs_of(&session["start_knobs"]).cycle_time_us, 8_000);
    eprintln!(
        "session: best {} speedup {} disturbance detection {}",
        session["best"], session["speedup_over_start"], session["disturbance_detection"]
    );
    let samples = session["samples"].as_array().unwrap();
    assert_eq!(samples.len(), 5, "{session:#}");
    // A sweep marks no training steps: scored by bytes.
    assert_eq!(session["objective"], "bytes_per_second", "{session:#}");
    // Sample 0 measures the job's starting knobs.
    assert_eq!(samples[0]["knobs"], session["start_knobs"]);
    for (i, sample) in samples.iter().enumerate() {
        assert_eq!(sample["index"], i);
        assert!(sample["score"].as_f64().unwrap() > 0.0, "{sample}");
        assert!(
            sample["window"]["cycles"].as_u64().unwrap() >= 21,
            "{sample}"
        );
        assert!(
            sample["window"]["duration_s"].as_f64().unwrap() >= 0.3,
            "{sample}"
        );
        let cycle_ms = sample["knobs"]["cycle_time_us"].as_f64().unwrap() / 1e3;
        assert!(
            (0.5..=10.0).contains(&cycle_ms),
            "outside the bounds: {sample}"
        );
    }
    let best = &session["best"];
    let best_knobs = knobs_of(&best["knobs"]);
    let best_sample = best["sample"].as_u64().unwrap() as usize;
    assert_eq!(knobs_of(&samples[best_sample]["knobs"]), best_knobs);
    // The speedup is the confirmation's (the choice's fresh windows against the
    // start's, medians; 1 when the start was kept), or, without one (the choice
    // was the start), the chosen sample's score over sample 0's.
    let speedup = session["speedup_over_start"].as_f64().unwrap();
    let confirmation = &session["confirmation"];
    let expected = if confirmation.is_null() {
        samples[best_sample]["score"].as_f64().unwrap() / samples[0]["score"].as_f64().unwrap()
    } else if confirmation["kept"] == "start" {
        assert_eq!(best_sample, 0, "the start was kept: {confirmation}");
        1.0
    } else {
        assert_eq!(confirmation["kept"], "choice", "{confirmation}");
        assert_eq!(knobs_of(&confirmation["choice"]), best_knobs);
        let windows = confirmation["windows"].as_array().unwrap();
        assert!(
            windows.len() >= 2 && windows[0]["candidate"] == "choice",
            "{confirmation}"
        );
        confirmation["choice_median"].as_f64().unwrap()
            / confirmation["start_median"].as_f64().unwrap()
    };
    assert!(
        (speedup - expected).abs() < 1e-9 * expected,
        "{speedup} vs {expected}"
    );

    // The job runs on the reported best knobs, and its claim was released
    // as completed; the registry lists the same knobs.
    let (knobs, autotune) = job.knobs_once(AutotuneState::Done);
    assert_eq!(knobs, best_knobs);
    assert_eq!(knobs_of(&session["current_knobs"]), best_knobs);
    assert_eq!(autotune, AutotuneState::Done);
    eventually_reporting(
        Duration::from_secs(10),
        "GET /api/jobs listing the best knobs",
        || {
            let (_, jobs) = agent.get_json("/api/jobs");
            let listed = jobs["jobs"]
                .as_array()
                .unwrap()
                .iter()
                .find(|j| j["job_id"] == job_id.as_str())
                .map(|j| knobs_of(&j["knobs"]));
            if listed == Some(best_knobs) {
                Ok(())
            } else {
                Err(jobs)
            }
        },
    );

    // The report: listed, its CSV and Parquet rows are the samples.
    let report_id = session["report_id"].as_str().unwrap().to_owned();
    let (status, listing) = agent.get_json("/api/reports");
    assert_eq!(status, 200);
    let listed = listing["reports"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["id"] == report_id.as_str())
        .unwrap_or_else(|| panic!("{report_id} not listed: {listing}"));
    assert_eq!(listed["job_id"], job_id.as_str());
    assert_eq!(listed["samples"], 5);
    assert_eq!(knobs_of(&listed["best"]), best_knobs);
    assert_eq!(listed["html"], format!("/api/reports/{report_id}"));

    let parquet = std::fs::File::open(reports.path().join(format!("{report_id}.parquet"))).unwrap();
    let frame = tuner::report::read_parquet(parquet).unwrap();
    assert_eq!(frame.height(), samples.len());
    let column_f64 = |name: &str| -> Vec<f64> {
        let column = frame
            .column(name)
            .unwrap()
            .cast(&polars::prelude::DataType::Float64)
            .unwrap();
        column.f64().unwrap().into_no_null_iter().collect()
    };
    let scores = column_f64(tuner::report::COL_SCORE);
    let fusion = column_f64("fusion_threshold_bytes");
    let cycle_ms = column_f64("cycle_time_ms");
    for (i, sample) in samples.iter().enumerate() {
        let score = sample["score"].as_f64().unwrap();
        assert!(
            (scores[i] - score).abs() <= 1e-9 * score,
            "row {i}: {} vs {score}",
            scores[i]
        );
        let knobs = knobs_of(&sample["knobs"]);
        assert_eq!(fusion[i], knobs.fusion_threshold_bytes as f64, "row {i}");
        assert!(
            (cycle_ms[i] * 1e3 - knobs.cycle_time_us as f64).abs() <= 0.5,
            "row {i}"
        );
    }
    // The CSV has a header and one row per sample.
    let (status, _, csv) = agent.request("GET", &format!("/api/reports/{report_id}?format=csv"));
    assert_eq!(status, 200);
    assert_eq!(csv.lines().count(), samples.len() + 1, "{csv}");
    let (status, head, html) = agent.request("GET", &format!("/api/reports/{report_id}"));
    assert_eq!(status, 200);
    assert!(head.to_ascii_lowercase().contains("text/html"), "{head}");
    assert!(
        html.contains("<html") || html.contains("<!DOCTYPE"),
        "{html}"
    );
    let (status, meta) = agent.get_json(&format!("/api/reports/{report_id}?format=json"));
    assert_eq!(status, 200);
    assert_eq!(
        meta["disturbance_detection"],
        session["disturbance_detection"]
    );

    // Prometheus: the session's figures.
    let (status, _, metrics) = agent.request("GET", "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains(&format!("ringwatch_tuning_samples{{job=\"{job_id}\"}} 5")),
        "{metrics}"
    );
    assert!(
        metrics.contains(&format!(
            "ringwatch_job_cycle_time_seconds{{job=\"{job_id}\"}} {}",
            best_knobs.cycle_time_us as f64 / 1e6
        )),
        "{metrics}"
    );
    // The page with a job and a session on it passes Prometheus' own checker.
    common::promtool_check_metrics(&metrics);
}

#[test]
fn killing_the_agent_mid_session_leaves_the_job_running_to_a_clean_finish() {
    let runtime = TempDir::new("tuning-test-kill-run");
    let reports = TempDir::new("tuning-test-kill-reports");
    let job_id = format!("tune-kill-{}", std::process::id());
    let mut job = Job::start(
        runtime.path(),
        &job_id,
        // Long enough to outlive two samples (the start alone takes two windows).
        &["resnet50", "--steps", "100", "--warmup", "1"],
    );
    let mut agent = ApiServer::start(&agent_args(&runtime, &reports), false);
    wait_for_job(&agent, &job_id);
    let body = r#"{"budget":20,"warmup_cycles":1,"measured_cycles":3,"min_window_ms":300,"bounds":{"cycle_time_ms":[0.5,5]}}"#;
    let (status, _, created) = agent.send("POST", &format!("/api/jobs/{job_id}/tuning"), &[], body);
    assert_eq!(status, 201, "{created}");
    // Mid-session: after the first samples, while it samples more.
    poll_session(&agent, &job_id, Duration::from_secs(120), |s| {
        s["samples"].as_array().is_some_and(|a| a.len() >= 2)
    });
    agent.child.kill().unwrap();
    agent.child.wait().unwrap();

    // The job saw its claim holder vanish: interrupted, on the knobs it had
    // (a change the agent sent just before it died may still take effect
    // at the next cycle boundary: the knobs of the cycles that start
    // after the one running now are the ones it keeps).
    let (knobs_now, autotune) = job.knobs_once(AutotuneState::Interrupted);
    assert_eq!(autotune, AutotuneState::Interrupted);
    let knobs_at_kill = job.settled_knobs();
    eprintln!("knobs when the agent died: {knobs_now:?}, settled: {knobs_at_kill:?}");
    // An agent that restarts finds the job again, and sees it interrupted
    // (with autotune on it would tune it again; here it only looks).
    let agent = ApiServer::start(&agent_args(&runtime, &reports), false);
    wait_for_job(&agent, &job_id);
    let (_, jobs) = agent.get_json("/api/jobs");
    let listed = jobs["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job_id"] == job_id.as_str())
        .cloned()
        .unwrap();
    assert_eq!(listed["autotune"], "interrupted", "{listed}");
    assert_eq!(agent.get_json(&format!("/api/jobs/{job_id}/tuning")).0, 404);
    let status = common::wait_within(&mut job.launcher, Duration::from_secs(180));
    assert!(
        status.success(),
        "the job failed after the agent died: {status}"
    );
    let mut stdout = String::new();
    std::io::Read::read_to_string(job.launcher.stdout.as_mut().unwrap(), &mut stdout).unwrap();
    let result: Value = stdout
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("collbench printed no JSON: {stdout}"));
    assert_eq!(result["steps"], 100, "{result}");
    assert_eq!(knobs_of(&result["knobs"]), knobs_at_kill, "{result}");
}

#[test]
fn the_tuning_api_refuses_what_it_cannot_do_and_checks_its_token() {
    let runtime = TempDir::new("tuning-test-api-run");
    let reports = TempDir::new("tuning-test-api-reports");
    let job_id = format!("tune-api-{}", std::process::id());
    let _job = Job::start(runtime.path(), &job_id, ENDLESS_SMALL_SWEEP);
    let token_file = runtime.path().join("token");
    std::fs::write(&token_file, "s3cret-token\n").unwrap();
    let mut args = agent_args(&runtime, &reports);
    args.extend(["--token-file", token_file.to_str().unwrap()]);
    let agent = ApiServer::start(&args, false);
    wait_for_job(&agent, &job_id);
    let path = format!("/api/jobs/{job_id}/tuning");
    let auth = "Authorization: Bearer s3cret-token";
    let long = r#"{"budget":50,"measured_cycles":20,"min_window_ms":300}"#;

    // Token: none or wrong -> 401, on POST and DELETE alike.
    assert_eq!(agent.send("POST", &path, &[], long).0, 401);
    assert_eq!(
        agent
            .send("POST", &path, &["Authorization: Bearer nope"], long)
            .0,
        401
    );
    assert_eq!(agent.send("DELETE", &path, &[], "").0, 401);
    // Reading needs no token; there is no session yet.
    assert_eq!(agent.get_json(&path).0, 404);
    // Unknown job, bad bodies.
    assert_eq!(
        agent
            .send("POST", "/api/jobs/no-such-job/tuning", &[auth], "")
            .0,
        404
    );
    let (status, _, body) = agent.send("POST", &path, &[auth], r#"{"budgett":5}"#);
    assert_eq!(status, 400, "{body}");
    assert!(body.contains("budgett"), "{body}");
    assert_eq!(agent.send("POST", &path, &[auth], "{not json").0, 400);
    let (status, _, body) = agent.send("POST", &path, &[auth], r#"{"budget":0}"#);
    assert_eq!(status, 400, "{body}");
    let (status, _, body) = agent.send(
        "POST",
        &path,
        &[auth],
        r#"{"fixed":{"fusion_threshold_bytes":0,"cycle_time_ms":1,"hierarchical_allreduce":false}}"#,
    );
    assert_eq!(status, 400, "everything fixed: {body}");

    // A session runs; a second one is refused.
    let (status, _, body) = agent.send("POST", &path, &[auth], long);
    assert_eq!(status, 201, "{body}");
    let (status, _, body) = agent.send("POST", &path, &[auth], long);
    assert_eq!(status, 409, "{body}");
    // Another client cannot claim the job meanwhile.
    let mut other = ControlClient::connect(
        &runtime.path().join(format!("{job_id}.sock")),
        Duration::from_secs(5),
    )
    .unwrap();
    assert!(other.claim_tuning(Duration::from_secs(5)).is_err());
    drop(other);

    // Stop, keeping the starting knobs.
    let start_knobs = {
        let (_, session) = agent.get_json(&path);
        knobs_of(&session["start_knobs"])
    };
    assert_eq!(
        agent
            .send("DELETE", &format!("{path}?keep=nonsense"), &[auth], "")
            .0,
        400
    );
    let (status, _, body) = agent.send("DELETE", &format!("{path}?keep=start"), &[auth], "");
    assert_eq!(status, 200, "{body}");
    let session = poll_session(&agent, &job_id, Duration::from_secs(60), |s| {
        s["state"] != "running"
    });
    assert_eq!(session["state"], "stopped", "{session:#}");
    assert_eq!(knobs_of(&session["current_knobs"]), start_knobs);
    let (knobs, autotune) = _job.knobs_once(AutotuneState::Done);
    assert_eq!(knobs, start_knobs);
    assert_eq!(autotune, AutotuneState::Done);

    // Reports: unknown id, bad format.
    assert_eq!(agent.request("GET", "/api/reports/no-such-report").0, 404);
    assert_eq!(agent.request("GET", "/api/reports/x?format=pdf").0, 400);
}

#[test]
fn beyond_loopback_without_a_token_changes_are_refused() {
    let runtime = TempDir::new("tuning-test-open-run");
    let reports = TempDir::new("tuning-test-open-reports");
    let agent = ApiServer::start_listening("0.0.0.0:0", &agent_args(&runtime, &reports), false);
    let (status, _, body) = agent.send("POST", "/api/jobs/any/tuning", &[], "");
    assert_eq!(status, 403, "{body}");
    assert!(body.contains("--token-file"), "{body}");
    assert_eq!(agent.send("DELETE", "/api/jobs/any/tuning", &[], "").0, 403);
    // Reading is still allowed.
    assert_eq!(agent.get_json("/api/jobs").0, 200);
}

#[test]
fn a_job_that_asks_to_be_tuned_is_tuned_as_soon_as_it_is_found() {
    let runtime = TempDir::new("tuning-test-auto-run");
    let reports = TempDir::new("tuning-test-auto-reports");
    let job_id = format!("tune-auto-{}", std::process::id());
    let job = Job::start_with_env(
        runtime.path(),
        &job_id,
        ENDLESS_SMALL_SWEEP,
        &[
            ("RINGWATCH_AUTOTUNE", "1"),
            ("RINGWATCH_AUTOTUNE_WAIT_SECS", "120"),
        ],
    );
    assert_eq!(job.knobs().1, AutotuneState::Waiting);
    let mut args = agent_args(&runtime, &reports);
    args.retain(|a| *a != "--no-autotune");
    let agent = ApiServer::start(&args, false);
    let session = eventually_reporting(
        Duration::from_secs(30),
        "a session started on its own",
        || {
            let (status, session) = agent.get_json(&format!("/api/jobs/{job_id}/tuning"));
            if status == 200 {
                Ok(session)
            } else {
                Err(session)
            }
        },
    );
    // Default settings.
    assert_eq!(session["config"]["budget"], 20, "{session:#}");
    assert_eq!(session["state"], "running", "{session:#}");
    assert_eq!(job.knobs_once(AutotuneState::Agent).1, AutotuneState::Agent);
    let (status, _, body) = agent.send("DELETE", &format!("/api/jobs/{job_id}/tuning"), &[], "");
    assert_eq!(status, 200, "{body}");
    let session = poll_session(&agent, &job_id, Duration::from_secs(60), |s| {
        s["state"] != "running"
    });
    assert_eq!(session["state"], "stopped", "{session:#}");
    assert_eq!(job.knobs_once(AutotuneState::Done).1, AutotuneState::Done);
}

#[test]
fn a_job_that_dies_mid_session_fails_the_session_with_a_clear_error() {
    let runtime = TempDir::new("tuning-test-dies-run");
    let reports = TempDir::new("tuning-test-dies-reports");
    let job_id = format!("tune-dies-{}", std::process::id());
    let job = Job::start(runtime.path(), &job_id, ENDLESS_SMALL_SWEEP);
    let agent = ApiServer::start(&agent_args(&runtime, &reports), false);
    wait_for_job(&agent, &job_id);
    let body = r#"{"budget":50,"measured_cycles":20,"min_window_ms":300}"#;
    let (status, _, created) = agent.send("POST", &format!("/api/jobs/{job_id}/tuning"), &[], body);
    assert_eq!(status, 201, "{created}");
    poll_session(&agent, &job_id, Duration::from_secs(60), |s| {
        s["samples"].as_array().is_some_and(|a| !a.is_empty())
    });
    drop(job);
    let session = poll_session(&agent, &job_id, Duration::from_secs(60), |s| {
        s["state"] != "running"
    });
    assert_eq!(session["state"], "failed", "{session:#}");
    let error = session["error"].as_str().unwrap();
    assert!(
        error.contains(&job_id) && error.contains("connection"),
        "{error}"
    );
    assert_eq!(session["report_id"], Value::Null);
}

#[test]
fn sigterm_ends_a_running_session_on_its_best_knobs_with_a_report() {
    let runtime = TempDir::new("tuning-test-term-run");
    let reports = TempDir::new("tuning-test-term-reports");
    let job_id = format!("tune-term-{}", std::process::id());
    let job = Job::start(runtime.path(), &job_id, ENDLESS_SMALL_SWEEP);
    let mut agent = ApiServer::start(&agent_args(&runtime, &reports), false);
    wait_for_job(&agent, &job_id);
    let body = r#"{"budget":50,"measured_cycles":20,"min_window_ms":300}"#;
    let (status, _, created) = agent.send("POST", &format!("/api/jobs/{job_id}/tuning"), &[], body);
    assert_eq!(status, 201, "{created}");
    poll_session(&agent, &job_id, Duration::from_secs(60), |s| {
        s["samples"].as_array().is_some_and(|a| a.len() >= 2)
    });
    // SAFETY: kill has no memory preconditions; the agent is our child.
    unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) };
    let status = common::wait_within(&mut agent.child, Duration::from_secs(60));
    assert!(status.success(), "the agent did not exit cleanly: {status}");

    let (knobs, autotune) = job.knobs_once(AutotuneState::Done);
    assert_eq!(
        autotune,
        AutotuneState::Done,
        "the claim was not released as completed"
    );
    let metas: Vec<Value> = std::fs::read_dir(reports.path())
        .unwrap()
        .flatten()
        .filter(|e| e.path().extension().is_some_and(|x| x == "json"))
        .map(|e| serde_json::from_slice(&std::fs::read(e.path()).unwrap()).unwrap())
        .collect();
    assert_eq!(metas.len(), 1, "{metas:?}");
    assert_eq!(metas[0]["state"], "stopped", "{}", metas[0]);
    assert!(metas[0]["samples"].as_u64().unwrap() >= 2, "{}", metas[0]);
    assert_eq!(knobs_of(&metas[0]["best"]), knobs);
}

#[test]
fn an_unprivileged_agent_tunes_a_job_without_ebpf() {
    // As root, drop to `nobody` for both the job and the agent; otherwise
    // this test already runs unprivileged.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let uid = root.then_some(65534u32);
    let runtime = TempDir::new("tuning-test-unpriv-run");
    let reports = TempDir::new("tuning-test-unpriv-reports");
    // The runtime dir as a root agent makes it (1777: anyone may add a
    // socket, none may replace another's); the reports dir only needs to be
    // writable.
    for (dir, mode) in [(runtime.path(), 0o1777), (reports.path(), 0o777)] {
        std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(mode)).unwrap();
    }
    let job_id = format!("tune-unpriv-{}", std::process::id());
    let job = Job::start_as(runtime.path(), &job_id, &slow_small_sweep(), &[], uid);
    let agent = ApiServer::start_configured(
        "127.0.0.1:0",
        &agent_args(&runtime, &reports),
        false,
        |command| {
            if let Some(uid) = uid {
                command.uid(uid).gid(uid).env("HOME", reports.path());
            }
        },
    );
    wait_for_job(&agent, &job_id);
    let body = r#"{"budget":4,"warmup_cycles":2,"measured_cycles":20,"min_window_ms":300,"bounds":{"cycle_time_ms":[0.5,10]}}"#;
    let (status, _, created) = agent.send("POST", &format!("/api/jobs/{job_id}/tuning"), &[], body);
    assert_eq!(status, 201, "{created}");
    let session = poll_session(&agent, &job_id, Duration::from_secs(120), |s| {
        s["state"] != "running"
    });
    assert_eq!(session["state"], "done", "{session:#}");
    // Root dropped to nobody, or not root from the start: no eBPF either way.
    assert_eq!(session["disturbance_detection"], "off: no eBPF (not root)");
    assert_eq!(session["samples"].as_array().unwrap().len(), 4);
    let best = knobs_of(&session["best"]["knobs"]);
    assert_eq!(job.knobs().0, best);
    let report_id = session["report_id"].as_str().unwrap();
    assert!(
        reports
            .path()
            .join(format!("{report_id}.parquet"))
            .is_file()
    );
}

#[test]
fn the_tune_command_prints_one_row_per_sample_and_the_outcome() {
    let runtime = TempDir::new("tuning-test-cli-run");
    let reports = TempDir::new("tuning-test-cli-reports");
    let job_id = format!("tune-cli-{}", std::process::id());
    let job = Job::start(runtime.path(), &job_id, &slow_small_sweep());
    let token_file = runtime.path().join("token");
    std::fs::write(&token_file, "cli-token\n").unwrap();
    let mut args = agent_args(&runtime, &reports);
    args.extend(["--token-file", token_file.to_str().unwrap()]);
    let agent = ApiServer::start(&args, false);
    wait_for_job(&agent, &job_id);
    let url = format!("http://{}", agent.addr);
    let run = |extra: &[&str]| {
        let output = Command::new(common::AGENT)
            .args(["tune", "--job", &job_id, "--agent", &url, "--token-file"])
            .arg(&token_file)
            .args(extra)
            .env_remove("RINGWATCH_API_TOKEN")
            .output()
            .unwrap();
        (
            output.status,
            String::from_utf8_lossy(&output.stdout).into_owned(),
            String::from_utf8_lossy(&output.stderr).into_owned(),
        )
    };
    let (status, stdout, stderr) = run(&[
        "--budget",
        "4",
        "--warmup-cycles",
        "2",
        "--measured-cycles",
        "20",
        "--min-window-ms",
        "300",
        "--bounds-cycle-time-ms",
        "0.5,10",
    ]);
    assert!(status.success(), "{stdout}\n{stderr}");
    let rows: Vec<&str> = stdout
        .lines()
        .filter(|l| {
            l.split_whitespace()
                .next()
                .is_some_and(|w| w.parse::<usize>().is_ok())
        })
        .collect();
    assert_eq!(rows.len(), 4, "{stdout}");
    assert!(stdout.contains("session done: 4 samples"), "{stdout}");
    assert!(
        stdout.contains("chosen knobs: fusion threshold"),
        "{stdout}"
    );
    assert!(
        stdout.contains("speedup over the starting knobs:"),
        "{stdout}"
    );
    assert!(stdout.contains("/api/reports/"), "{stdout}");
    // The printed knobs are the session's, and the job's now.
    let (_, session) = agent.get_json(&format!("/api/jobs/{job_id}/tuning"));
    let best = knobs_of(&session["best"]["knobs"]);
    assert!(
        stdout.contains(&format!(
            "chosen knobs: fusion threshold {} bytes, cycle time {:.3} ms",
            best.fusion_threshold_bytes,
            best.cycle_time_us as f64 / 1e3
        )),
        "{stdout}"
    );
    assert_eq!(job.knobs().0, best);

    let (status, stdout, _) = run(&["--status"]);
    assert!(status.success());
    assert!(stdout.contains("session done: 4 samples"), "{stdout}");
    // A wrong token: the agent's 401 is the command's error.
    let output = Command::new(common::AGENT)
        .args(["tune", "--job", &job_id, "--agent", &url, "--stop"])
        .env("RINGWATCH_API_TOKEN", "wrong")
        .env_remove("RINGWATCH_API_TOKEN_FILE")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("401"), "{stderr}");
}
