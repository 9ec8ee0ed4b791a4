//! Real separate processes through the `collbench` binary: the launcher runs checked
//! sweeps (one host with shared memory, pretend nodes with shared memory inside and TCP
//! between, TCP only), a rank killed with SIGKILL mid-run makes every other rank fail
//! within the timeout with an error naming a rank, and the response cache cuts resnet50's
//! negotiation traffic.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_collbench");

fn wait_with_limit(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let deadline = Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            return Some(status);
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn launcher_runs_a_checked_sweep_on_three_processes() {
    let mut child = Command::new(BIN)
        .args([
            "sweep",
            "-n",
            "3",
            "--min-bytes",
            "4",
            "--max-bytes",
            "1M",
            "--factor",
            "16",
            "--iters",
            "2",
            "--json",
        ])
        .env("RINGWATCH_CONTROL_SOCKET", "0")
        .env("RINGWATCH_TIMEOUT_SECS", "20")
        .env_remove("RANK")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_with_limit(&mut child, Duration::from_secs(60)).expect("collbench hung");
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(status.success(), "collbench failed: {out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    assert_eq!(v["world_size"], 3);
    let rows = v["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 5); // 4 B, 64 B, 1 KiB, 16 KiB, 256 KiB (x16 steps up to 1 MiB)
    assert!(rows.iter().all(|r| r["wrong"] == 0));
}

/// Runs `collbench sweep` through its launcher with `args` and `env`; returns rank 0's JSON.
fn checked_sweep(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let mut cmd = Command::new(BIN);
    cmd.args(["sweep", "--factor", "8", "--iters", "2", "--json"])
        .args(args)
        .env("RINGWATCH_CONTROL_SOCKET", "0")
        .env("RINGWATCH_TIMEOUT_SECS", "20")
        .env_remove("RANK")
        .env_remove("RINGWATCH_SHM")
        .env_remove("RINGWATCH_HOST_ID")
        .stdout(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().unwrap();
    let status = wait_with_limit(&mut child, Duration::from_secs(90)).expect("collbench hung");
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(status.success(), "collbench {args:?} {env:?} failed: {out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    assert!(!rows.is_empty());
    assert!(
        rows.iter().all(|r| r["wrong"] == 0),
        "{args:?} {env:?}: {v}"
    );
    v
}

#[test]
fn shared_memory_within_pretend_nodes_tcp_between_and_tcp_only_all_check_out() {
    // Sizes from 4 B to 16 MiB: past the 2 MiB shared-memory rings and the socket buffers.
    let sizes = ["--min-bytes", "4", "--max-bytes", "16M"];
    let peers = |v: &serde_json::Value| v["shared_memory_peers"].clone();
    // One host: rank 0 shares memory with every other rank.
    let v = checked_sweep(&[&["-n", "4"], &sizes[..]].concat(), &[]);
    assert_eq!(peers(&v), serde_json::json!([1, 2, 3]));
    // Two pretend nodes of 2: the flat ring has shared-memory and TCP links (ranks 1 and 3
    // send over one kind and receive over the other); hierarchical keeps each phase on one.
    for hierarchical in ["false", "true"] {
        let v = checked_sweep(
            &[
                &[
                    "-n",
                    "4",
                    "--local-size",
                    "2",
                    "--hierarchical",
                    hierarchical,
                ],
                &sizes[..],
            ]
            .concat(),
            &[],
        );
        assert_eq!(
            peers(&v),
            serde_json::json!([1]),
            "hierarchical={hierarchical}"
        );
    }
    // Shared memory off: TCP everywhere.
    let v = checked_sweep(
        &[&["-n", "3"], &sizes[..]].concat(),
        &[("RINGWATCH_SHM", "0")],
    );
    assert_eq!(peers(&v), serde_json::json!([]));
}

#[test]
fn a_killed_rank_makes_the_others_fail_within_the_timeout() {
    let n = 3;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut ranks: Vec<Child> = (0..n)
        .map(|rank| {
            Command::new(BIN)
                .args(["resnet50", "--steps", "100000", "--warmup", "0", "--json"])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RINGWATCH_CONTROL_SOCKET", "0")
                .env("RINGWATCH_TIMEOUT_SECS", "3")
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    // Let the job get going, then kill rank 1 in the middle of its allreduces.
    std::thread::sleep(Duration::from_millis(1500));
    for r in ranks.iter_mut() {
        assert!(
            r.try_wait().unwrap().is_none(),
            "a rank exited before the kill"
        );
    }
    ranks[1].kill().unwrap();
    ranks[1].wait().unwrap();
    let killed_at = Instant::now();
    for rank in [0, 2] {
        let status = wait_with_limit(&mut ranks[rank], Duration::from_secs(15))
            .unwrap_or_else(|| panic!("rank {rank} did not fail after rank 1 died"));
        let elapsed = killed_at.elapsed();
        let mut err = String::new();
        std::io::Read::read_to_string(ranks[rank].stderr.as_mut().unwrap(), &mut err).unwrap();
        assert!(!status.success(), "rank {rank} succeeded?");
        assert!(
            elapsed < Duration::from_secs(10),
            "rank {rank} took {elapsed:?}"
        );
        // The error that reaches the caller is the cause, naming a rank, not a shutdown.
        let reported = err.lines().find(|l| l.contains(": error:")).unwrap_or("");
        // Every survivor names the rank that died, not just the neighbour it lost.
        assert!(reported.contains("rank 1 is gone"), "rank {rank}: {err}");
        assert!(!reported.contains("shut down"), "rank {rank}: {reported}");
    }
}

#[test]
fn an_agent_sees_a_running_job_through_its_control_socket() {
    use collectives::control::{ControlClient, KnobUpdate, ServerMessage, socket_path};
    let dir = std::env::temp_dir().join(format!("rw-proc-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let job_id = format!("proc-test-{}", std::process::id());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut ranks: Vec<Child> = (0..2)
        .map(|rank| {
            Command::new(BIN)
                .args([
                    "sweep",
                    "--min-bytes",
                    "4K",
                    "--max-bytes",
                    "4K",
                    "--iters",
                    "1000000",
                    "--json",
                ])
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", "2")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("RINGWATCH_JOB_ID", &job_id)
                .env("RINGWATCH_RUNTIME_DIR", &dir)
                .env("RINGWATCH_TIMEOUT_SECS", "5")
                .stdout(Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let path = socket_path(&dir, &job_id);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut client = loop {
        match ControlClient::connect(&path, Duration::from_secs(5)) {
            Ok(c) => break c,
            Err(_) if Instant::now() < deadline => std::thread::sleep(Duration::from_millis(50)),
            Err(e) => panic!("no control socket at {}: {e}", path.display()),
        }
    };
    let hello = client.hello().clone();
    assert_eq!(hello.job_id, job_id);
    assert_eq!(hello.world_size, 2);
    let pids: Vec<u32> = hello.ranks.iter().map(|r| r.pid).collect();
    assert_eq!(pids, vec![ranks[0].id(), ranks[1].id()]);
    client.subscribe(true, false).unwrap();
    let (knobs, applied) = client
        .set_knobs(
            KnobUpdate {
                cycle_time_us: Some(2500),
                ..Default::default()
            },
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(knobs.cycle_time_us, 2500);
    // Statistics of cycles from `applied` on carry the new knobs.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut seen = false;
    while !seen && Instant::now() < deadline {
        if let Some(ServerMessage::CycleStats(s)) =
            client.next_message(Duration::from_millis(200)).unwrap()
        {
            assert!(s.cycle < applied || s.knobs.cycle_time_us == 2500, "{s:?}");
            seen = s.cycle >= applied;
        }
    }
    assert!(seen, "no statistics after the knob change");
    for r in &mut ranks {
        let _ = r.kill();
        let _ = r.wait();
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// Rank 0's negotiation statistics of `collbench resnet50` on `n` processes.
fn resnet50_negotiation(n: usize, cache_capacity: &str) -> serde_json::Value {
    let mut child = Command::new(BIN)
        .args([
            "resnet50",
            "-n",
            &n.to_string(),
            "--steps",
            "4",
            "--warmup",
            "1",
        ])
        .arg("--json")
        .env("RINGWATCH_CONTROL_SOCKET", "0")
        .env("RINGWATCH_TIMEOUT_SECS", "20")
        .env("RINGWATCH_CACHE_CAPACITY", cache_capacity)
        .env_remove("RANK")
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let status = wait_with_limit(&mut child, Duration::from_secs(60)).expect("collbench hung");
    let mut out = String::new();
    std::io::Read::read_to_string(child.stdout.as_mut().unwrap(), &mut out).unwrap();
    assert!(status.success(), "collbench failed: {out}");
    let v: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
    v["negotiation"].clone()
}

#[test]
fn the_response_cache_sends_resnet50_steps_as_bits() {
    let n = 3;
    let by_name = resnet50_negotiation(n, "0");
    let cached = resnet50_negotiation(n, "1024");
    let per_step = |v: &serde_json::Value| v["bytes_per_step"].as_u64().unwrap();
    // By name a step costs each of the 2 other ranks 161 requests of about 80 bytes; with
    // the cache one run of bits each way, plus what every cycle costs anyway.
    assert!(per_step(&by_name) > 2 * 161 * 70, "{by_name}");
    assert!(
        per_step(&cached) * 10 < per_step(&by_name),
        "with the cache {cached}, by name {by_name}"
    );
}
