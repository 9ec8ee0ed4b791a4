//! The NCCL profiler plugin against a real agent (`serve --jobs`): this
//! test process plays a 2-rank NCCL job (the plugin loaded and driven as
//! NCCL does, `ringwatch_nccl_profiler::harness`) while the agent is
//! absent, then up, then stopped (slow), then restarted.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::{Duration, Instant};

use common::ApiServer;
use ringwatch_nccl_profiler::harness::{Coll, Comm, Plugin};
use serde_json::Value;
use test_support::{TempDir, eventually_reporting};

const COMM: &str = "000000000000feed";
const HANG_GUARD: Duration = Duration::from_secs(300);

fn agent(runtime: &TempDir, reports: &TempDir) -> ApiServer {
    ApiServer::start(
        &[
            "--jobs",
            "--runtime-dir",
            runtime.path().to_str().unwrap(),
            "--reports-dir",
            reports.path().to_str().unwrap(),
            "--no-autotune",
            "--no-launchers",
        ],
        false,
    )
}

/// Both ranks' collectives `seqs`; the longest call, for the note.
fn run(ranks: &[&Comm<'_>], seqs: std::ops::Range<u64>) -> Duration {
    let mut longest = Duration::ZERO;
    for seq in seqs {
        for rank in ranks {
            let start = Instant::now();
            assert!(!rank.collective(&Coll::allreduce(seq, 256, 2)).is_null());
            longest = longest.max(start.elapsed());
        }
    }
    longest
}

fn collectives(agent: &ApiServer) -> Value {
    let (status, body) = agent.get_json(&format!("/api/nccl/collectives?comm={COMM}&limit=1000"));
    assert_eq!(status, 200, "{body}");
    body
}

/// Waits until the agent has every seq of `seqs`, each from both ranks.
fn wait_for(agent: &ApiServer, seqs: std::ops::Range<u64>) -> Value {
    eventually_reporting(HANG_GUARD, "the agent has both ranks' records", || {
        let body = collectives(agent);
        let all = seqs.clone().all(|seq| {
            body["collectives"]
                .as_array()
                .unwrap()
                .iter()
                .any(|c| c["seq"] == seq && c["ranks"].as_array().unwrap().len() == 2)
        });
        if all { Ok(body) } else { Err(body) }
    })
}

#[test]
fn records_reach_the_agent_and_none_are_lost_unaccounted_when_it_is_absent_slow_or_restarted() {
    let runtime = TempDir::new("nccl-profiler-runtime");
    let reports = TempDir::new("nccl-profiler-reports");
    let socket = runtime.path().join("nccl-profiler.socket");
    // SAFETY: set before the plugin's thread (or any other) reads them.
    unsafe {
        std::env::set_var("RINGWATCH_NCCL_PROFILER_SOCKET", &socket);
        std::env::set_var("RINGWATCH_NCCL_PROFILER_QUEUE", "64");
    }
    // A C++ job does not ignore SIGPIPE as Rust and Python do: when the agent
    // goes away (step 4) the plugin's writes must fail, not kill the job (std's
    // UnixStream sends with MSG_NOSIGNAL; this holds it to that).
    // SAFETY: before any thread of the plugin starts.
    unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    let plugin = Plugin::open(&common::procs::nccl_profiler_lib()).unwrap();
    let (rc0, rank0) = plugin.init(6, 0xfeed, 2, 0);
    let (rc1, rank1) = plugin.init(6, 0xfeed, 2, 1);
    assert_eq!((rc0, rc1), (0, 0));
    let ranks = [&rank0, &rank1];
    let me = std::process::id();

    // 1. No agent: every collective is dropped, and counted.
    run(&ranks, 0..50);
    let c = eventually_reporting(
        HANG_GUARD,
        "the plugin accounts for 100 collectives",
        || {
            let c = plugin.counters();
            if c.accounted() == 100 {
                Ok(c)
            } else {
                Err(format!("{c:?}"))
            }
        },
    );
    assert_eq!((c.collectives, c.sent), (100, 0), "{c:?}");

    // 2. The agent starts: the plugin connects (it retries each second)
    // and its records arrive, matched across the two ranks.
    let first = agent(&runtime, &reports);
    eventually_reporting(HANG_GUARD, "the plugin connects", || {
        let c = plugin.counters();
        if c.connects >= 1 {
            Ok(())
        } else {
            Err(format!("{c:?}"))
        }
    });
    let quiet_longest = run(&ranks, 50..80);
    let body = wait_for(&first, 50..80);
    let plugins = body["plugins"].as_array().unwrap();
    assert!(
        plugins.iter().any(|p| p["pid"] == me && p["profiler"] == 6),
        "{body}"
    );
    let c79 = body["collectives"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["seq"] == 79)
        .unwrap();
    assert_eq!(c79["func"], "AllReduce");
    assert_eq!(c79["bytes"], 1024);
    assert_eq!(c79["ranks"][0]["rank"], 0);
    assert_eq!(c79["ranks"][1]["rank"], 1);
    assert_eq!(c79["ranks"][0]["pid"], me);
    // The same scripted GPU times on both ranks.
    assert_eq!(c79["start_spread_us"], 0.0);
    // /metrics: the collectives of this communicator, by function and size.
    let (status, _, metrics) = first.request("GET", "/metrics");
    assert_eq!(status, 200);
    let series = format!(
        "ringwatch_nccl_collectives_total{{pid=\"{me}\",job=\"\",rank=\"\",comm=\"{COMM}\",func=\"AllReduce\",size=\"0-64KiB\"}} 60"
    );
    assert!(metrics.contains(&series), "no {series} in\n{metrics}");
    common::promtool_check_metrics(&metrics);

    // 3. The agent stops reading (SIGSTOP): NCCL's calls go on, the queue
    // (64) and the socket's buffer fill, and the rest is dropped, counted.
    let agent_pid = first.child.id() as i32;
    // SAFETY: a signal to our own child.
    assert_eq!(unsafe { libc::kill(agent_pid, libc::SIGSTOP) }, 0);
    eventually_reporting(HANG_GUARD, "the agent is stopped", || {
        let stat = std::fs::read_to_string(format!("/proc/{agent_pid}/stat")).unwrap();
        let state = stat.rsplit_once(") ").unwrap().1.chars().next().unwrap();
        if state == 'T' { Ok(()) } else { Err(state) }
    });
    let before = plugin.counters();
    // 2 × 5,000 records of ~450 bytes: far more than a socket's buffer.
    let stopped_longest = run(&ranks, 1_000..6_000);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(agent_pid, libc::SIGCONT) }, 0);
    let after = eventually_reporting(HANG_GUARD, "every collective is sent or dropped", || {
        let c = plugin.counters();
        if c.accounted() == c.collectives {
            Ok(c)
        } else {
            Err(format!("{c:?}"))
        }
    });
    assert_eq!(after.collectives, before.collectives + 10_000);
    let dropped = (after.dropped_queue_full + after.dropped_no_agent)
        - (before.dropped_queue_full + before.dropped_no_agent);
    assert!(dropped > 0, "{before:?} → {after:?}");
    eprintln!(
        "longest collective call: {quiet_longest:?} with the agent reading, {stopped_longest:?} with it stopped; dropped {dropped} of 10000 while stopped ({after:?})"
    );

    // 4. The agent restarts while the plugin is connected to it (its records
    // arrive there): the plugin's next write, its heartbeat, fails with EPIPE
    // (not SIGPIPE) and it connects to the new agent.
    run(&ranks, 6_000..6_005);
    wait_for(&first, 6_000..6_005);
    let connects = plugin.counters().connects;
    drop(first);
    let second = agent(&runtime, &reports);
    eventually_reporting(HANG_GUARD, "the plugin connects to the new agent", || {
        let c = plugin.counters();
        if c.connects > connects {
            Ok(())
        } else {
            Err(format!("{c:?}"))
        }
    });
    run(&ranks, 7_000..7_010);
    wait_for(&second, 7_000..7_010);
    rank0.finalize();
    rank1.finalize();
}
