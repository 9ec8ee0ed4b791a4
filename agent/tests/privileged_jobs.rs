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
use common::{AGENT, ApiServer, skip_unless_privileged, unique_lock_file};
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

    // Frames until one shows the job whole (the scanner finds it within a
    // second or two; a loaded machine may take longer), then top is stopped.
    let mut top = Command::new(AGENT)
        .args([
            "top",
            "--json",
            "--iterations",
            "100000",
            "--interval",
            "500ms",
        ])
        .arg("--runtime-dir")
        .arg(&job.dir)
        .env("RINGWATCH_LOCK_FILE", unique_lock_file())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = top.stdout.take().unwrap();
    let (tx, frames) = std::sync::mpsc::channel::<String>();
    std::thread::spawn(move || {
        for line in std::io::BufRead::lines(std::io::BufReader::new(stdout)) {
            let Ok(line) = line else { break };
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let mut last_seen = String::new();
    let whole = eventually_reporting(
        Duration::from_secs(90),
        "a frame with the job whole",
        || {
            while let Ok(line) = frames.try_recv() {
                let frame: Value = serde_json::from_str(&line).unwrap();
                if let Some(why) = job_not_whole(&frame, &job_id, &ranks) {
                    last_seen = format!("{why}: {frame:#}");
                } else {
                    return Ok(frame);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
            Err(last_seen.clone())
        },
    );
    let _ = top.kill();
    let _ = top.wait();
    drop(job);
    assert!(job_not_whole(&whole, &job_id, &ranks).is_none());
}

/// Why `frame` does not show job `job_id` connected, with its hello's pids
/// the job's `ranks` and every rank watched; `None` when it does.
fn job_not_whole(frame: &Value, job_id: &str, ranks: &BTreeSet<u64>) -> Option<String> {
    let Some(job) = frame["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["job_id"] == job_id)
    else {
        return Some(format!("job {job_id} not found"));
    };
    if job["state"] != "connected" {
        return Some(format!("job state {}", job["state"]));
    }
    let hello_pids: BTreeSet<u64> = job["ranks"]
        .as_array()?
        .iter()
        .filter_map(|r| r["pid"].as_u64())
        .collect();
    if hello_pids != *ranks {
        return Some(format!("hello pids {hello_pids:?}, ranks {ranks:?}"));
    }
    let watched: BTreeSet<u64> = frame["processes"]
        .as_array()?
        .iter()
        .filter_map(|p| p["pid"].as_u64())
        .collect();
    if !ranks.is_subset(&watched) {
        return Some(format!("ranks {ranks:?} not all watched"));
    }
    // The ranks were seen doing something: scheduled threads of their own.
    for p in frame["processes"].as_array()? {
        let pid = p["pid"].as_u64().unwrap_or(0);
        if ranks.contains(&pid) && p["threads"].as_array().is_none_or(Vec::is_empty) {
            return Some(format!("no threads seen for rank {pid}"));
        }
    }
    None
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
    // feed was paused, so the window is not judged (404: no figures for it;
    // or 503 while the just-started feed has not reached its end), not judged
    // empty.
    let now = unix_us();
    let (status, first) = load(now - 2_000_000, now);
    assert!(
        status == 404 || status == 503,
        "a window from before the feed started: {status} {first:#}"
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
