//! Privileged: `ringwatch-agent serve --pid P` publishes the live eBPF view:
//! the process in /api/processes, its thread states on /api/timeline (a
//! thread that sleeps 50 ms K times shows K blocked slices of ~50 ms), and
//! its figures in /metrics. Skips, saying why, when not root.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{AGENT, Testload, skip_unless_privileged};

/// Kills the agent if the test fails half-way.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn get(addr: &str, path: &str) -> (u16, String) {
    let mut stream = TcpStream::connect(addr).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(
        stream,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .unwrap();
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response);
    let (head, body) = response.split_once("\r\n\r\n").unwrap();
    (
        head.split_whitespace().nth(1).unwrap().parse().unwrap(),
        body.to_owned(),
    )
}

#[test]
fn serve_publishes_the_live_view_of_a_watched_process() {
    if skip_unless_privileged() {
        return;
    }
    const SLEEPS: usize = 12;
    let mut load = Testload::start(&["sleep", "--count", "12", "--interval", "50ms"]);
    let pid = load.info["pid"].as_u64().unwrap();
    let tid = load.info["tid"].as_u64().unwrap();
    let lock =
        std::env::temp_dir().join(format!("ringwatch-serve-test-{}.lock", std::process::id()));
    let mut agent = Command::new(AGENT)
        .args([
            "serve",
            "--listen",
            "127.0.0.1:0",
            "--pid",
            &pid.to_string(),
        ])
        .arg("--lock-file")
        .arg(&lock)
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let stderr = agent.stderr.take().unwrap();
    let mut agent = KillOnDrop(agent);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            eprintln!("[agent] {line}");
            if let Some(rest) = line.split("http://").nth(1) {
                let _ = tx.send(Some(rest.split('/').next().unwrap().to_owned()));
            }
            if line.contains("watching pid") {
                let _ = tx.send(None);
            }
        }
    });
    let mut addr = None;
    let mut watching = false;
    while addr.is_none() || !watching {
        match rx
            .recv_timeout(Duration::from_secs(60))
            .expect("the agent did not start within 60 s")
        {
            Some(a) => addr = Some(a),
            None => watching = true,
        }
    }
    let addr = addr.unwrap();
    load.go();
    load.wait();

    // The view is republished every second: poll until the sleeps are in.
    let deadline = Instant::now() + Duration::from_secs(20);
    let blocked = loop {
        let (status, body) = get(&addr, &format!("/api/timeline?pid={pid}"));
        assert_eq!(status, 200, "{body}");
        let trace: serde_json::Value = serde_json::from_str(&body).unwrap();
        let blocked: Vec<f64> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["cat"] == "thread_state" && e["tid"] == tid && e["name"] == "blocked")
            .map(|e| e["dur"].as_f64().unwrap())
            .collect();
        if blocked.iter().filter(|&&d| d >= 45_000.0).count() >= SLEEPS || Instant::now() > deadline
        {
            break blocked;
        }
        std::thread::sleep(Duration::from_millis(300));
    };
    // Each sleep is one blocked interval of 50 ms (µs on the timeline),
    // within scheduling slack.
    let sleeps: Vec<f64> = blocked.iter().copied().filter(|&d| d >= 45_000.0).collect();
    assert!(
        sleeps.len() >= SLEEPS,
        "blocked slices of the sleeper: {blocked:?}"
    );
    assert!(
        sleeps.iter().all(|&d| d < 80_000.0),
        "implausible sleep lengths: {sleeps:?}"
    );

    let (status, body) = get(&addr, "/api/processes");
    assert_eq!(status, 200);
    let processes: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(processes["source"], "live", "{processes}");
    assert!(
        processes["processes"]
            .as_array()
            .unwrap()
            .iter()
            .any(|p| p["pid"] == pid),
        "{processes}"
    );

    let (status, metrics) = get(&addr, "/metrics");
    assert_eq!(status, 200);
    assert!(
        metrics.contains(&format!("ringwatch_process_cpu_ratio{{pid=\"{pid}\"")),
        "{metrics}"
    );
    assert!(
        metrics.contains("ringwatch_ringbuf_drops_total 0"),
        "{metrics}"
    );

    // SIGTERM: a clean exit.
    // SAFETY: kill has no memory-safety preconditions.
    unsafe { libc::kill(agent.0.id() as i32, libc::SIGTERM) };
    let deadline = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(status) = agent.0.try_wait().unwrap() {
            break status;
        }
        assert!(
            Instant::now() < deadline,
            "the agent did not exit on SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status}");
    let _ = std::fs::remove_file(&lock);
}
