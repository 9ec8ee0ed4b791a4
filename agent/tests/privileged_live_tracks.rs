//! Privileged: the live timeline's tracks beyond thread states, through a
//! real `ringwatch-agent serve` on loopback:
//! - a job's own activities (read from its control socket) come back from
//!   `GET /api/timeline` grouped job → rank, on the same clock as the eBPF
//!   thread states, and `?job=` selects them with the rank's threads;
//! - a real `collbench` job's activities land on its ranks' pids, beside
//!   their threads' states;
//! - TCP throughput per connection is a counter track whose samples add up
//!   to exactly the bytes sent.
//!
//! Skips, saying why, when not root.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::os::unix::net::UnixListener;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use collectives::control::{Hello, Phase, ServerMessage, TimelineEvent, write_message};
use serde_json::{Value, json};

use common::{ApiServer, Testload, skip_unless_privileged};
use test_support::eventually_reporting;

fn clock_ns(clock: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid pointer to a timespec.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap()
        .trim()
        .to_owned()
}

fn events(trace: &Value) -> &Vec<Value> {
    trace["traceEvents"].as_array().unwrap()
}

/// A job's side of the control protocol, in this test process: `hello`
/// (rank 0 is this process, rank 1 on another host), then `events`; keeps
/// the connection open until dropped.
struct FakeJob {
    dir: PathBuf,
    close: Arc<AtomicBool>,
}

impl FakeJob {
    fn start(job_id: &str, events: Vec<TimelineEvent>) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "ringwatch-live-tracks-{}-{job_id}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let listener = UnixListener::bind(dir.join(format!("{job_id}.sock"))).unwrap();
        // Built from JSON so fields the protocol adds later keep their defaults.
        let hello: Hello = serde_json::from_value(json!({
            "protocol_version": collectives::control::PROTOCOL_VERSION,
            "job_id": job_id, "world_size": 2, "local_size": 1,
            "ranks": [
                {"rank": 0, "local_rank": 0, "local_size": 1, "host": host_name(), "pid": std::process::id()},
                {"rank": 1, "local_rank": 0, "local_size": 1, "host": "elsewhere.invalid", "pid": 4242},
            ],
            "knobs": serde_json::to_value(collectives::control::Knobs::default()).unwrap(),
            "cycle": 0,
        }))
        .unwrap();
        let close = Arc::new(AtomicBool::new(false));
        let closing = close.clone();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            write_message(&mut conn, &ServerMessage::Hello(hello)).unwrap();
            write_message(&mut conn, &ServerMessage::Timeline { events }).unwrap();
            while !closing.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self { dir, close }
    }
}

impl Drop for FakeJob {
    fn drop(&mut self) {
        self.close.store(true, Ordering::Release);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn job_activities_are_on_the_live_timeline_grouped_job_rank_on_the_ebpf_clock() {
    if skip_unless_privileged() {
        return;
    }
    let job_id = format!("tracks{}", std::process::id());
    // Two seconds ago on the Unix clock: a 5 ms ALLREDUCE of rank 0 with a
    // QUEUE inside, and rank 1's.
    // The present on the agent's (monotonic) clock as the test starts: the
    // slices lie 2 s before it.
    let started_monotonic_us = clock_ns(libc::CLOCK_MONOTONIC) as f64 / 1e3;
    let t0 = u64::try_from(clock_ns(libc::CLOCK_REALTIME) / 1_000).unwrap() - 2_000_000;
    let event = |rank, activity: &str, phase, ts_us| TimelineEvent {
        rank,
        tensor: "grad.w".into(),
        activity: activity.into(),
        phase,
        ts_us,
        args: [("bytes".to_owned(), "4096".to_owned())].into(),
    };
    let job = FakeJob::start(
        &job_id,
        vec![
            event(0, "ALLREDUCE", Phase::Begin, t0),
            event(0, "QUEUE", Phase::Begin, t0 + 1_000),
            event(0, "QUEUE", Phase::End, t0 + 1_250),
            event(0, "ALLREDUCE", Phase::End, t0 + 5_000),
            event(1, "ALLREDUCE", Phase::Begin, t0 + 100),
            event(1, "ALLREDUCE", Phase::End, t0 + 4_100),
        ],
    );
    // Another watched process, not in the job.
    let mut other = Testload::start(&["sleep", "--count", "200", "--interval", "50ms"]);
    let other_pid = other.pid();
    let server = ApiServer::start(
        &[
            "--jobs",
            "--no-gpu-processes",
            "--pid",
            &other_pid.to_string(),
            "--runtime-dir",
            job.dir.to_str().unwrap(),
        ],
        true,
    );
    other.go();
    let me = u64::from(std::process::id());
    let trace = eventually_reporting(
        Duration::from_secs(30),
        &format!("job activities and thread states of job {job_id}"),
        || {
            let (status, trace) = server.get_json(&format!("/api/timeline?job={job_id}"));
            let ready = status == 200
                && events(&trace)
                    .iter()
                    .any(|e| e["name"] == "ALLREDUCE" && e["pid"] == me)
                && events(&trace)
                    .iter()
                    .any(|e| e["cat"] == "thread_state" && e["pid"] == me);
            if ready {
                Ok(trace)
            } else {
                Err(format!("{status} {trace}"))
            }
        },
    );
    // A job's tracks (tensor rows, remote ranks) hold to the format too.
    common::assert_trace_event_format(&trace);
    // The offset between the two clocks, read now (as the agent did): only
    // printed. How far the agent's own reading of it is off depends on
    // how long it was preempted between two clock reads, which a loaded
    // machine makes anything; so the checks below are of order, membership
    // and exact differences (one conversion for the whole answer), never a
    // tolerance around a wall-clock figure.
    let before = clock_ns(libc::CLOCK_REALTIME);
    let monotonic = clock_ns(libc::CLOCK_MONOTONIC);
    let after = clock_ns(libc::CLOCK_REALTIME);
    let offset_us = ((before + after) / 2 - monotonic) as f64 / 1e3;

    let slice = |pid: &Value, name: &str| -> Value {
        events(&trace)
            .iter()
            .find(|e| e["ph"] == "X" && &e["pid"] == pid && e["name"] == name)
            .unwrap_or_else(|| panic!("no {name} on {pid}: {trace:#}"))
            .clone()
    };
    let allreduce = slice(&json!(me), "ALLREDUCE");
    let allreduce_ts = allreduce["ts"].as_f64().unwrap();
    eprintln!(
        "job slice vs the test's own clock conversion: {:+.1} µs",
        allreduce_ts - (t0 as f64 - offset_us)
    );
    assert_eq!(allreduce["dur"], 5_000.0, "{allreduce}");
    assert_eq!(allreduce["tid"], "tensor grad.w");
    assert_eq!(allreduce["cat"], "job");
    assert_eq!(allreduce["args"]["bytes"], "4096");
    let queue = slice(&json!(me), "QUEUE");
    assert_eq!(queue["ts"].as_f64().unwrap() - allreduce_ts, 1_000.0);
    assert_eq!(queue["dur"], 250.0);
    // Same clock as the thread states: this process's scheduling slices are
    // from the window before the answer's present, and so is the job's
    // slice, which began (2 s) before the test did, and the answer was
    // built after the test started.
    let now = trace["metadata"]["now"].as_f64().unwrap();
    let states: Vec<f64> = events(&trace)
        .iter()
        .filter(|e| e["cat"] == "thread_state" && e["pid"] == me)
        .map(|e| e["ts"].as_f64().unwrap())
        .collect();
    assert!(states.iter().all(|&ts| ts <= now && ts > now - 60e6));
    assert!(
        now > started_monotonic_us,
        "the answer's now {now} µs is before the test started ({started_monotonic_us} µs)"
    );
    assert!(
        allreduce_ts < started_monotonic_us && allreduce_ts > now - 60e6,
        "the slice of 2 s before the test began is at {allreduce_ts} µs: not before the \
         test's start ({started_monotonic_us} µs) or not in the window before now ({now} µs)"
    );
    // Rank 1 runs elsewhere: a process of its own, in the job.
    let remote = json!(format!("{job_id} rank 1"));
    let remote_allreduce = slice(&remote, "ALLREDUCE");
    assert_eq!(remote_allreduce["dur"], 4_000.0);
    // 100 µs after rank 0's, exactly: both converted with one offset.
    assert_eq!(
        remote_allreduce["ts"].as_f64().unwrap() - allreduce_ts,
        100.0,
        "{remote_allreduce} vs {allreduce}"
    );
    let names: Vec<&Value> = events(&trace)
        .iter()
        .filter(|e| e["name"] == "process_name")
        .collect();
    for (pid, rank) in [(json!(me), 0), (remote.clone(), 1)] {
        let name = names
            .iter()
            .find(|e| e["pid"] == pid)
            .unwrap_or_else(|| panic!("no process_name for {pid}: {names:?}"));
        assert_eq!(name["args"]["job"], job_id.as_str(), "{name}");
        assert_eq!(name["args"]["rank"], rank, "{name}");
    }
    assert!(
        events(&trace)
            .iter()
            .any(|e| e["name"] == "thread_name" && e["pid"] == me && e["tid"] == "tensor grad.w"),
        "no thread_name for the tensor track"
    );
    // ?job= keeps the job's ranks only: the other watched process is out.
    assert!(
        !events(&trace).iter().any(|e| e["pid"] == other_pid),
        "process {other_pid} is not in job {job_id}"
    );
    let (status, all) = server.get_json("/api/timeline");
    assert_eq!(status, 200);
    assert!(events(&all).iter().any(|e| e["pid"] == other_pid));
    assert!(
        events(&all)
            .iter()
            .any(|e| e["name"] == "ALLREDUCE" && e["pid"] == remote)
    );
    let (status, _) = server.get_json("/api/timeline?job=no-such-job");
    assert_eq!(status, 404);
    drop(job);
}

#[test]
fn tcp_throughput_is_a_counter_track_per_connection_that_adds_up_to_the_bytes() {
    if skip_unless_privileged() {
        return;
    }
    const N: u64 = 3_000_017;
    let mut receiver = Testload::start(&["tcp-recv"]);
    let port = receiver.info["port"].as_u64().unwrap();
    let mut sender = Testload::start(&[
        "tcp-send",
        "--to",
        &format!("127.0.0.1:{port}"),
        "--bytes",
        &N.to_string(),
        "--writes",
        "8",
        "--pause",
        "300ms",
    ]);
    let (rpid, spid) = (receiver.pid(), sender.pid());
    let server = ApiServer::start(
        &[
            "--no-jobs",
            "--no-gpu-processes",
            "--pid",
            &format!("{rpid},{spid}"),
        ],
        true,
    );
    receiver.go();
    sender.go();
    let received = receiver.wait_output();
    sender.wait();
    assert_eq!(received[0]["received"], N);

    // The sender's connection to the port: samples until the closing zero.
    let suffix = format!("\u{2192}127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (trace, samples) = loop {
        let (status, trace) = server.get_json(&format!("/api/timeline?pid={spid}"));
        assert_eq!(status, 200, "{trace}");
        let samples: Vec<Value> = events(&trace)
            .iter()
            .filter(|e| {
                e["ph"] == "C"
                    && e["name"]
                        .as_str()
                        .is_some_and(|n| n.starts_with("tcp 127.0.0.1:") && n.ends_with(&suffix))
            })
            .cloned()
            .collect();
        let closed = samples
            .last()
            .is_some_and(|s| s["args"]["tx_bytes_per_s"] == 0.0);
        if closed || Instant::now() > deadline {
            break (trace, samples);
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    assert!(samples.len() >= 2, "tcp counter samples: {samples:?}");
    // Well-formed counters: pid of the sender, numeric args, time order.
    for s in &samples {
        assert_eq!(s["pid"], spid);
        assert!(s["ts"].as_f64().is_some());
        assert!(s["args"]["tx_bytes_per_s"].as_f64().unwrap() >= 0.0);
        assert!(s["args"]["rx_bytes_per_s"].as_f64().unwrap() >= 0.0);
    }
    assert!(
        samples
            .windows(2)
            .all(|w| w[0]["ts"].as_f64() < w[1]["ts"].as_f64())
    );
    // Each rate holds until the next sample: the integral is the bytes sent.
    let sent: f64 = samples
        .windows(2)
        .map(|w| {
            w[0]["args"]["tx_bytes_per_s"].as_f64().unwrap()
                * (w[1]["ts"].as_f64().unwrap() - w[0]["ts"].as_f64().unwrap())
                / 1e6
        })
        .sum();
    assert!(
        (sent - N as f64).abs() < 1.0,
        "the tx counter integrates to {sent} bytes, {N} were sent: {samples:?}"
    );
    // Spread over several seconds: more than one non-zero sample.
    assert!(
        samples
            .iter()
            .filter(|s| s["args"]["tx_bytes_per_s"].as_f64().unwrap() > 0.0)
            .count()
            >= 2,
        "{samples:?}"
    );
    // Retransmits of the same connection: a counter too (none on loopback).
    let retransmits: Vec<&Value> = events(&trace)
        .iter()
        .filter(|e| {
            e["ph"] == "C"
                && e["name"]
                    .as_str()
                    .is_some_and(|n| n.starts_with("tcp retransmits ") && n.ends_with(&suffix))
        })
        .collect();
    assert_eq!(retransmits.len(), samples.len());
    assert!(retransmits.iter().all(|e| e["args"]["retransmits"] == 0));
}

#[test]
fn a_real_collbench_job_shows_its_activities_on_its_ranks_with_their_threads() {
    if skip_unless_privileged() {
        return;
    }
    // Killed, and its directory removed, when the test ends, failing or not.
    let job = common::procs::Job::start("live");
    let (dir, job_id) = (job.dir.clone(), job.id.clone());
    let ranks: Vec<u64> = job.ranks.iter().copied().collect();
    let server = ApiServer::start(
        &[
            "--jobs",
            "--no-gpu-processes",
            "--runtime-dir",
            dir.to_str().unwrap(),
        ],
        true,
    );
    let deadline = Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        let (status, trace) = server.get_json(&format!("/api/timeline?job={job_id}&from=now-3s"));
        let has = |pred: &dyn Fn(&Value) -> bool| events(&trace).iter().any(pred);
        let ready = status == 200
            && has(&|e| e["cat"] == "job" && e["name"] == "ALLREDUCE")
            && ranks
                .iter()
                .all(|&pid| has(&|e| e["cat"] == "thread_state" && e["pid"] == pid));
        if ready || Instant::now() > deadline {
            break (status, trace);
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    drop(job);
    let (status, trace) = outcome;
    assert_eq!(status, 200, "{trace}");
    // The job's activities: the sweep's one tensor, on a rank's real pid,
    // inside the range asked for, each ALLREDUCE a well-formed slice.
    let now = trace["metadata"]["now"].as_f64().unwrap();
    let allreduces: Vec<&Value> = events(&trace)
        .iter()
        .filter(|e| e["cat"] == "job" && e["name"] == "ALLREDUCE")
        .collect();
    assert!(
        !allreduces.is_empty(),
        "no ALLREDUCE of job {job_id}: {trace}"
    );
    for e in &allreduces {
        assert!(ranks.contains(&e["pid"].as_u64().unwrap()), "{e}");
        assert_eq!(e["tid"], "tensor sweep.4096", "{e}");
        let (ts, dur) = (e["ts"].as_f64().unwrap(), e["dur"].as_f64().unwrap());
        assert!(
            dur >= 0.0 && ts + dur >= now - 3.5e6 && ts <= now,
            "{e} (now {now})"
        );
    }
    // Both ranks are processes of the job, with their ranks.
    let mut seen: Vec<u64> = ranks
        .iter()
        .map(|&pid| {
            let name = events(&trace)
                .iter()
                .find(|e| e["name"] == "process_name" && e["pid"] == pid)
                .unwrap_or_else(|| panic!("no process_name for rank pid {pid}"));
            assert_eq!(name["args"]["job"], job_id.as_str(), "{name}");
            name["args"]["rank"].as_u64().unwrap()
        })
        .collect();
    seen.sort_unstable();
    assert_eq!(seen, [0, 1]);
}
