//! The built library, loaded and driven as NCCL does (every plugin version
//! it exports), with a stand-in agent: one record per collective, with the
//! fields of NCCL's descriptors.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use ringwatch_nccl_profiler::harness::{self, Coll, Plugin};
use serde_json::Value;

#[test]
fn every_version_reports_each_collective_once_with_what_nccl_said() {
    let dir = test_support::TempDir::new("nccl-profiler-harness");
    let socket = dir.path().join("agent.socket");
    let lines = common::fake_agent(&socket, "{\"ok\":true,\"proto\":1}\n");
    // SAFETY: set before the plugin's thread (or any other) reads it.
    unsafe { std::env::set_var("RINGWATCH_NCCL_PROFILER_SOCKET", &socket) };

    let plugin = Plugin::open(&common::library()).unwrap();
    for v in 3..=7 {
        assert!(plugin.has(v), "ncclProfiler_v{v} is not exported");
        assert_eq!(plugin.name(v), "ringwatch");
    }
    // NCCL 2.23–2.25 look for v1/v2 only: none, so they run without it.
    assert!(!plugin.has(1) && !plugin.has(2) && !plugin.has(8));

    let per_version = 4u64;
    for v in 3..=7u8 {
        let (rc, comm) = plugin.init(v, 0x1000 + u64::from(v), 2, 1);
        assert_eq!(rc, 0);
        assert!(comm.active(), "v{v}: no context");
        assert_eq!(
            harness::mask() as u64,
            harness::COLL | harness::KERNEL_CH,
            "v{v}: the plugin asks for collectives and their kernel channels"
        );
        for event in [harness::P2P, harness::PROXY_OP, harness::GROUP] {
            assert!(
                comm.other_event(event).is_null(),
                "v{v}: event {event} tracked"
            );
        }
        for seq in 0..per_version {
            let mut c = Coll::allreduce(seq, 256, 2);
            // Once, NCCL stops the collective's event after its kernel.
            c.stop_after_channels = seq == 3;
            assert!(!comm.collective(&c).is_null());
        }
        comm.finalize();
    }

    let records: Vec<Value> = test_support::eventually(
        Duration::from_secs(300),
        "every collective reaches the agent",
        || {
            let lines = lines.lock().unwrap();
            let records: Vec<Value> = lines
                .iter()
                .filter(|l| l.starts_with("{\"seq\""))
                .map(|l| serde_json::from_str(l).unwrap())
                .collect();
            (records.len() as u64 >= 5 * per_version).then_some(records)
        },
    );
    assert_eq!(records.len() as u64, 5 * per_version, "{records:#?}");
    for v in 3..=7u64 {
        let mine: Vec<&Value> = records.iter().filter(|r| r["profiler"] == v).collect();
        assert_eq!(mine.len() as u64, per_version, "v{v}");
        for (seq, r) in mine.iter().enumerate() {
            let seq = seq as u64;
            assert_eq!(r["seq"], seq, "{r}");
            assert_eq!(r["comm"], format!("{:016x}", 0x1000 + v), "{r}");
            assert_eq!(r["rank"], 1, "{r}");
            // v3's init does not say the communicator's size.
            assert_eq!(r["nranks"], if v == 3 { 0 } else { 2 }, "{r}");
            assert_eq!(r["func"], "AllReduce");
            assert_eq!(r["datatype"], "ncclFloat32");
            assert_eq!(r["algo"], "RING");
            assert_eq!(r["proto"], "SIMPLE");
            assert_eq!(r["count"], 256);
            assert_eq!(r["bytes"], 1024);
            assert_eq!(r["channels"], 2);
            assert_eq!(r["channels_done"], 2);
            // GPU times from v4 on: the first channel's start, the last stop.
            let gpu = if v == 3 {
                [0, 0]
            } else {
                [1_000_000 + seq * 1_000, 1_000_500 + seq * 1_000 + 2]
            };
            assert_eq!(r["gpu_ns"], serde_json::json!(gpu), "{r}");
            let e = &r["enqueue_ns"];
            assert!(
                e[0].as_u64().unwrap() > 0 && e[1].as_u64() >= e[0].as_u64(),
                "{r}"
            );
            let k = &r["kernel_cpu_ns"];
            assert!(
                k[0].as_u64().unwrap() > 0 && k[1].as_u64() >= k[0].as_u64(),
                "{r}"
            );
        }
    }
    let counters = test_support::eventually(
        Duration::from_secs(300),
        "the plugin counts them sent",
        || Some(plugin.counters()).filter(|c| c.sent == 5 * per_version),
    );
    assert_eq!(counters.collectives, 5 * per_version);
    assert_eq!(counters.dropped_queue_full + counters.dropped_no_agent, 0);
    assert_eq!(counters.incomplete, 0);
    assert!(!counters.disabled);

    // A kernel channel whose parent is not a handle of the plugin's (NCCL
    // passes NULL when the parent was not tracked) is not tracked either.
    let (_, comm) = plugin.init(6, 0x77, 2, 0);
    let before = plugin.counters().collectives;
    assert!(comm.other_event(harness::KERNEL_CH).is_null());

    // Collectives whose channels never stop hold their slot until it is
    // needed again: then they are sent as they stand, counted incomplete.
    let pool = ringwatch_nccl_profiler::events::POOL_SLOTS as u64;
    for seq in 0..pool + 1 {
        comm.collective_without_kernel_stop(&Coll::allreduce(seq, 4, 1));
    }
    let counters = test_support::eventually(
        Duration::from_secs(300),
        "the oldest unfinished collective is sent incomplete",
        || Some(plugin.counters()).filter(|c| c.incomplete == 1),
    );
    assert_eq!(counters.collectives, before + 1);
    comm.finalize();
}
