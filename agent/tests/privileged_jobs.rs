//! Privileged: `ringwatch-agent top`, given no `--pid`, finds a real 2-rank
//! `collbench` job through its control socket in `--runtime-dir` and shows
//! the ranks' processes (the pids the job's `hello` names, which are the
//! launcher's children); `serve`'s eBPF feed for tuning sessions records
//! only once a peer asks. Skips, saying why, when not root or without BTF.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::BTreeSet;
use std::process::{Command, Stdio};
use std::time::Duration;

use common::procs::Job;
use common::{AGENT, ApiServer, skip_unless_privileged, unique_lock_file, wait_within};
use serde_json::Value;
use test_support::eventually_reporting;

fn unix_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_micros() as u64
}

#[test]
fn top_watches_a_job_found_through_its_control_socket_without_any_pid() {
    if skip_unless_privileged() {
        return;
    }
    let job = Job::start("top");
    let (job_id, ranks) = (job.id.clone(), job.ranks.clone());

    let mut top = Command::new(AGENT)
        .args(["top", "--json", "--iterations", "4", "--interval", "500ms"])
        .arg("--runtime-dir")
        .arg(&job.dir)
        .env("RINGWATCH_LOCK_FILE", unique_lock_file())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = top.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        std::io::Read::read_to_string(&mut stdout, &mut text).unwrap();
        text
    });
    let status = wait_within(&mut top, Duration::from_secs(60));
    let text = reader.join().unwrap();
    drop(job);
    assert!(status.success(), "top failed ({status}): {text}");

    let frames: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(frames.len(), 4, "{text}");
    let last = &frames[3];
    let job = last["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|j| j["job_id"] == job_id.as_str())
        .unwrap_or_else(|| panic!("job {job_id} not found: {last:#}"));
    assert_eq!(job["state"], "connected", "{job:#}");
    let hello_pids: BTreeSet<u64> = job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(hello_pids, ranks, "{job:#}");
    let watched: BTreeSet<u64> = last["processes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert!(
        ranks.is_subset(&watched),
        "ranks {ranks:?} not all watched: {last:#}"
    );
    // The ranks were seen doing something: scheduled threads of their own.
    for p in last["processes"].as_array().unwrap() {
        if ranks.contains(&p["pid"].as_u64().unwrap()) {
            assert!(
                !p["threads"].as_array().unwrap().is_empty(),
                "no threads seen for rank process: {p:#}"
            );
        }
    }
}

#[test]
fn the_tuning_feed_records_only_once_a_peer_asks_and_judges_no_window_from_before() {
    if skip_unless_privileged() {
        return;
    }
    let job = Job::start("feed");
    let (job_id, ranks) = (job.id.clone(), job.ranks.clone());
    let display = job.dir.display().to_string();
    let agent = ApiServer::start(
        &["--jobs", "--no-autotune", "--runtime-dir", &display],
        false,
    );
    // The job is found and its ranks watched for a while: with no tuning
    // session here and no peer asking, the feed copies nothing.
    eventually_reporting(
        Duration::from_secs(60),
        &format!("job {job_id} found and connected"),
        || {
            let (_, jobs) = agent.get_json("/api/jobs");
            let connected = jobs["jobs"].as_array().is_some_and(|j| {
                j.iter()
                    .any(|j| j["job_id"] == job_id.as_str() && j["state"] == "connected")
            });
            if connected {
                Ok(())
            } else {
                Err(format!("{jobs:#}"))
            }
        },
    );
    std::thread::sleep(Duration::from_secs(3));
    let load = |from: u64, to: u64| {
        agent.get_json(&format!(
            "/api/jobs/{job_id}/load?from_unix_us={from}&to_unix_us={to}"
        ))
    };
    // The last two seconds: the ranks ran, the agent watched them, but the
    // feed was paused, so the window is not judged (503), not judged empty.
    let now = unix_us();
    let (status, first) = load(now - 2_000_000, now);
    assert_eq!(
        status, 503,
        "a window from before the feed started: {first:#}"
    );
    // The ask started it: a window after the ask is answered, for the
    // job's ranks on this node (a window that began before serve's loop
    // got to the feed, on a slow machine, is still refused: the next one).
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let (status, answer) = loop {
        let from = unix_us();
        std::thread::sleep(Duration::from_millis(1200));
        let (status, answer) = load(from, unix_us());
        if status == 200 || std::time::Instant::now() > deadline {
            break (status, answer);
        }
    };
    drop(job);
    assert_eq!(status, 200, "a window after the ask: {answer:#}");
    let pids: BTreeSet<u64> = answer["pids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["pid"].as_u64().unwrap())
        .collect();
    assert_eq!(pids, ranks, "{answer:#}");
    // A window with something in it (how long depends on the sleep above).
    assert!(answer["span_s"].as_f64().unwrap() > 0.0, "{answer:#}");
}
