//! Something that is not the agent answers on the socket: the plugin says
//! so once, turns itself off (NCCL's event mask cleared, new communicators
//! get no context) and every call still returns success.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::time::Duration;

use ringwatch_nccl_profiler::harness::{self, Coll, Plugin};

#[test]
fn a_bad_answer_turns_the_plugin_off_and_nccl_runs_on() {
    let dir = test_support::TempDir::new("nccl-profiler-bad-agent");
    let socket = dir.path().join("agent.socket");
    let _lines = common::fake_agent(&socket, "HTTP/1.1 400 Bad Request\r\n\r\n");
    // SAFETY: set before the plugin's thread (or any other) reads it.
    unsafe { std::env::set_var("RINGWATCH_NCCL_PROFILER_SOCKET", &socket) };
    let plugin = Plugin::open(&common::library()).unwrap();
    let (rc, comm) = plugin.init(6, 0xbad, 2, 0);
    assert_eq!(rc, 0);
    // The answer is read on the plugin's own thread, before or after init
    // returned: either way NCCL got success.
    let counters = test_support::eventually(
        Duration::from_secs(300),
        "the plugin turns itself off",
        || Some(plugin.counters()).filter(|c| c.disabled),
    );
    assert_eq!(counters.sent, 0);
    assert_eq!(harness::mask(), 0, "NCCL is asked for no more events");
    // The communicator made before: its events get no handle now.
    assert!(comm.collective(&Coll::allreduce(0, 4, 1)).is_null());
    comm.finalize();
    // A new communicator: no context, success.
    let (rc, comm) = plugin.init(4, 0xbad2, 2, 0);
    assert_eq!(rc, 0);
    assert!(!comm.active());
    assert!(comm.collective(&Coll::allreduce(0, 4, 1)).is_null());
    comm.finalize();
    assert_eq!(plugin.counters().collectives, 0);
}
