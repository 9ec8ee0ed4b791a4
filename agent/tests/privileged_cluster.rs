//! Privileged: two pretend nodes on this machine (network namespaces joined
//! by a rate-limited veth link, each node's ranks in a UTS namespace of
//! their own so that they report the node's host name, as pods do), an
//! agent per node (its own runtime dir, lock file and port, the other as its
//! peer) and a 2 × 2-rank collbench job across them. Each agent lists the
//! job with its own two ranks watched; the cluster timeline from either
//! agent holds the thread states and job activities of all four ranks in
//! time order; a CPU hog on node 1 while agent 0 tunes the job makes a
//! window re-measured with node 1 named; with agent 1 killed, agent 0 still
//! answers and names what is missing.
//!
//! Skips, saying why, when not root, without BTF, or without `ip`/`unshare`.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::nodes::{Nodes, Ranks};
use common::procs::collbench;
use common::{ApiServer, skip_unless_privileged};
use serde_json::Value;
use test_support::{eventually, eventually_reporting, free_port};

/// Starts rank `rank` of a 2 × 2 job on node `rank / 2`: in the node's
/// network namespace and a UTS namespace named after the node (`ip netns
/// exec`, `unshare` and `sh` all exec, so the child's pid is the rank's).
fn start_rank(nodes: &Nodes, rank: usize, port: u16, job_id: &str, dirs: &[PathBuf]) -> Child {
    let node = rank / 2;
    Command::new("ip")
        // Each node's ranks on a CPU of their own, so a hog on node 1's CPU
        // disturbs node 1 only.
        .args([
            "netns",
            "exec",
            &nodes.ns(node),
            "taskset",
            "-c",
            &node.to_string(),
        ])
        .args(["unshare", "--uts", "sh", "-c"])
        .arg(format!(
            "hostname {} && exec \"$0\" \"$@\"",
            Nodes::host(node)
        ))
        .arg(collbench())
        .args(["sweep", "--min-bytes", "262144", "--max-bytes", "262144"])
        .args(["--iters", "1000000000"])
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "4")
        .env("LOCAL_RANK", (rank % 2).to_string())
        .env("LOCAL_SIZE", "2")
        .env("MASTER_ADDR", Nodes::addr(0))
        .env("MASTER_PORT", port.to_string())
        .env("RINGWATCH_JOB_ID", job_id)
        .env("RINGWATCH_RUNTIME_DIR", &dirs[node])
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits until `agent` watches every one of `pids` (its /api/processes).
fn wait_watched(agent: &ApiServer, pids: &BTreeSet<u64>) {
    eventually(Duration::from_secs(60), "the pids are watched", || {
        let (_, answer) = agent.get_json("/api/processes");
        let watched: BTreeSet<u64> = answer["processes"]
            .as_array()?
            .iter()
            .filter_map(|p| p["pid"].as_u64())
            .collect();
        pids.is_subset(&watched).then_some(())
    });
}

fn job_of<'a>(answer: &'a Value, job_id: &str) -> Option<&'a Value> {
    answer["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["job_id"] == job_id)
}

/// Per merged pid (`node/pid`): thread-state slices and job activities.
fn per_pid(trace: &Value) -> BTreeMap<String, (usize, usize)> {
    let mut out: BTreeMap<String, (usize, usize)> = BTreeMap::new();
    for event in trace["traceEvents"].as_array().unwrap() {
        let Some(pid) = event["pid"].as_str() else {
            continue;
        };
        let entry = out.entry(pid.to_owned()).or_default();
        match event["cat"].as_str() {
            Some("thread_state") => entry.0 += 1,
            Some("job") => entry.1 += 1,
            _ => {}
        }
    }
    out
}

#[test]
fn two_agents_see_a_two_node_job_whole_and_answer_without_each_other() {
    if skip_unless_privileged() {
        return;
    }
    for tool in ["ip", "unshare", "tc", "chrt", "taskset"] {
        if Command::new(tool).arg("-V").output().is_err()
            && Command::new(tool).arg("--version").output().is_err()
        {
            eprintln!("SKIPPED: `{tool}` is missing (iproute2, util-linux)");
            return;
        }
    }
    let nodes = Nodes::create();
    let base = std::env::temp_dir().join(format!("ringwatch-cluster-{}", std::process::id()));
    let dirs: Vec<PathBuf> = (0..2).map(|n| base.join(format!("node{n}"))).collect();
    for dir in &dirs {
        std::fs::create_dir_all(dir).unwrap();
    }
    let first = free_port();
    let second = std::iter::repeat_with(free_port)
        .find(|&p| p != first)
        .unwrap();
    let ports = [first, second];
    let agents: Vec<ApiServer> = (0..2)
        .map(|n| {
            let listen = format!("127.0.0.1:{}", ports[n]);
            let peer = format!("127.0.0.1:{}", ports[1 - n]);
            let node_name = format!("node-{n}");
            let dir = dirs[n].display().to_string();
            ApiServer::start_listening(
                &listen,
                &[
                    "--jobs",
                    "--no-autotune",
                    "--runtime-dir",
                    &dir,
                    "--node-name",
                    &node_name,
                    "--peers",
                    &peer,
                    // Room for a loaded debug build to merge a busy
                    // second of the peer's timeline (seconds): a timeout
                    // is no bound of this test's to hold.
                    "--peer-timeout",
                    "20s",
                ],
                false,
            )
        })
        .collect();

    let job_id = format!("cluster-{}", std::process::id());
    let port = free_port();
    let ranks = Ranks(
        (0..4)
            .map(|rank| start_rank(&nodes, rank, port, &job_id, &dirs))
            .collect(),
    );
    let pids: Vec<u32> = ranks.0.iter().map(Child::id).collect();

    // Each agent lists the job, speaking for its node's host, its two ranks
    // watched by eBPF.
    for (n, agent) in agents.iter().enumerate() {
        let job = eventually(Duration::from_secs(60), "the agent finds the job", || {
            let (status, answer) = agent.get_json("/api/jobs");
            (status == 200)
                .then(|| job_of(&answer, &job_id).cloned())
                .flatten()
        });
        assert_eq!(job["host"], Nodes::host(n).as_str(), "{job:#}");
        assert_eq!(job["served_by_rank"], 2 * n, "{job:#}");
        assert_eq!(job["world_size"], 4);
        let local: BTreeSet<u64> = job["ranks"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|r| r["host"] == Nodes::host(n).as_str())
            .map(|r| r["pid"].as_u64().unwrap())
            .collect();
        let expected: BTreeSet<u64> = [pids[2 * n], pids[2 * n + 1]]
            .into_iter()
            .map(u64::from)
            .collect();
        assert_eq!(local, expected, "node {n}'s ranks are its own processes");
        wait_watched(agent, &expected);
    }
    // Both jobs views agree on the whole job.
    let (status, merged) = agents[0].get_json("/api/cluster/jobs");
    assert_eq!(status, 200, "{merged:#}");
    let job = job_of(&merged, &job_id).expect("the job in the cluster view");
    assert_eq!(job["complete"], true, "{job:#}");
    assert_eq!(job["nodes"].as_array().unwrap().len(), 2, "{job:#}");

    // The cluster timeline from either agent: all four ranks, in time order.
    // Jobs stream their tensor timeline while someone reads it
    // (--job-timeline on-demand): ask once (a cluster request reaches both
    // agents), so that the window below has the ranks' activities.
    let (status, _) = agents[0].get_json(&format!(
        "/api/timeline?scope=cluster&job={job_id}&from=now-100ms&max_events=20000&downsample=true"
    ));
    assert_eq!(status, 200);
    // Streaming starts within a read of the job's socket (250 ms) of that,
    // and a rank's feeder reconnects within a second when load drops it: the
    // window below moves with the present until every rank is in it.
    // A busy job's second is tens of thousands of thread states: a debug
    // build takes seconds to merge them, so the answer is thinned.
    let path = format!(
        "/api/timeline?scope=cluster&job={job_id}&from=now-4s&to=now-1500ms&max_events=20000&downsample=true"
    );
    for (n, agent) in agents.iter().enumerate() {
        let trace = eventually_reporting(
            Duration::from_secs(90),
            "every rank's thread states and activities in the window",
            || {
                let (status, trace) = agent.get_json(&path);
                assert_eq!(status, 200, "{trace:#}");
                let seen = per_pid(&trace);
                let missing: Vec<String> = pids
                    .iter()
                    .enumerate()
                    .map(|(rank, pid)| (rank, format!("node-{}/{pid}", rank / 2)))
                    .filter(|(_, key)| {
                        let (states, activities) = seen.get(key).copied().unwrap_or_default();
                        states == 0 || activities == 0
                    })
                    .map(|(rank, key)| format!("rank {rank} ({key})"))
                    .collect();
                if missing.is_empty() {
                    Ok(trace)
                } else {
                    Err(format!("agent {n}: {missing:?} missing; seen {seen:?}"))
                }
            },
        );
        common::assert_trace_event_format(&trace);
        let metadata = &trace["metadata"];
        assert_eq!(metadata["partial"], false, "{metadata:#}");
        assert_eq!(
            metadata["nodes"].as_array().unwrap().len(),
            2,
            "{metadata:#}"
        );
        let stamps: Vec<f64> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] != "M")
            .filter_map(|e| e["ts"].as_f64())
            .collect();
        assert!(stamps.windows(2).all(|w| w[0] <= w[1]), "time order");
        eprintln!(
            "cluster timeline from agent {n}: {} events, {:.1} ms, offsets {}",
            stamps.len(),
            metadata["gather_ms"].as_f64().unwrap_or(f64::NAN),
            metadata["nodes"]
        );
    }

    // Agent 0 tunes the job; a CPU hog on node 1's CPU disturbs node 1's
    // ranks: agent 0 learns it from agent 1, and the window is measured
    // again with node 1 named.
    let tuning = format!("/api/jobs/{job_id}/tuning");
    let (status, _, body) = agents[0].send("POST", &tuning, &[], r#"{"budget": 60}"#);
    assert_eq!(status, 201, "{body}");
    eventually(
        Duration::from_secs(90),
        "a baseline of judged windows",
        || {
            let (_, session) = agents[0].get_json(&tuning);
            (session["samples"].as_array()?.len() >= 4).then_some(())
        },
    );
    // A real-time hog on node 1's CPU: node 1's ranks (pinned there) wait
    // on the run queue most of every second (RT throttling leaves them 5%),
    // however loaded the machine already is; nothing else is pinned there.
    let hogs = Ranks(vec![
        Command::new("chrt")
            .args([
                "-f",
                "10",
                "taskset",
                "-c",
                "1",
                "sh",
                "-c",
                "while :; do :; done",
            ])
            .spawn()
            .unwrap(),
    ]);
    let named = eventually(
        Duration::from_secs(90),
        "a window re-measured naming node 1",
        || {
            let (_, session) = agents[0].get_json(&tuning);
            let text = session.to_string();
            // The hog's signature (retransmits may name a node on their own).
            (text.contains("node node-1: run-queue wait")).then_some(session)
        },
    );
    drop(hogs);
    let (status, _, _) = agents[0].request("DELETE", &tuning);
    assert_eq!(status, 200);
    let reasons: Vec<String> = named["samples"]
        .as_array()
        .unwrap()
        .iter()
        .flat_map(|s| [s["disturbed"].as_str(), s["remeasured_because"].as_str()])
        .flatten()
        .map(str::to_owned)
        .collect();
    eprintln!("disturbed windows: {reasons:#?}");

    // Agent 1 dies: agent 0 answers alone, naming what is missing.
    let mut agents = agents;
    let gone = agents.pop().unwrap();
    let gone_addr = gone.addr.clone();
    drop(gone);
    let started = Instant::now();
    let (status, trace) = agents[0].get_json(&path);
    assert_eq!(status, 200, "{trace:#}");
    // A hang guard, not a timing: the dead peer is refused at once, and each
    // peer call has --peer-timeout (20 s).
    assert!(started.elapsed() < Duration::from_secs(60));
    let metadata = &trace["metadata"];
    assert_eq!(metadata["partial"], true, "{metadata:#}");
    let missing = metadata["missing"].to_string();
    assert!(
        missing.contains(&gone_addr) || missing.contains("rw-node-1"),
        "{missing}"
    );
    let seen = per_pid(&trace);
    assert!(
        seen.contains_key(&format!("node-0/{}", pids[0])),
        "{seen:?}"
    );
    let (status, merged) = agents[0].get_json("/api/cluster/jobs");
    assert_eq!(status, 200);
    assert!(
        merged["missing_peers"].to_string().contains(&gone_addr),
        "{merged:#}"
    );
    let job = job_of(&merged, &job_id).unwrap();
    assert_eq!(
        job["missing_hosts"],
        serde_json::json!(["rw-node-1"]),
        "{job:#}"
    );

    drop(ranks);
    drop(agents);
    let _ = std::fs::remove_dir_all(&base);
}

/// The last `NSpid:` field of a host process: its pid in its own namespace.
fn ns_pid(host_pid: u64) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{host_pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

#[test]
fn a_job_in_its_own_pid_namespace_is_watched_by_its_host_pids() {
    if skip_unless_privileged() {
        return;
    }
    if Command::new("unshare").arg("--version").output().is_err() {
        eprintln!("SKIPPED: `unshare` is missing (util-linux)");
        return;
    }
    let dir = std::env::temp_dir().join(format!("ringwatch-pidns-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let display = dir.display().to_string();
    let agent = ApiServer::start(
        &["--jobs", "--no-autotune", "--runtime-dir", &display],
        false,
    );
    let job_id = format!("pidns-{}", std::process::id());
    // A container's view: the job's pids are its namespace's (1, 2, …).
    let launcher = Ranks(vec![
        Command::new("unshare")
            .args(["--pid", "--fork", "--kill-child", "--mount-proc"])
            .arg(collbench())
            .args([
                "-n",
                "2",
                "sweep",
                "--min-bytes",
                "65536",
                "--max-bytes",
                "65536",
            ])
            .args(["--iters", "1000000000"])
            .env("RINGWATCH_RUNTIME_DIR", &dir)
            .env("RINGWATCH_JOB_ID", &job_id)
            .env_remove("RANK")
            .stdout(Stdio::null())
            .spawn()
            .unwrap(),
    ]);
    let job = eventually(Duration::from_secs(60), "the agent finds the job", || {
        let (_, answer) = agent.get_json("/api/jobs");
        job_of(&answer, &job_id).cloned()
    });
    let ns_pids = job["ns_pids"]
        .as_object()
        .expect("the reported pids are kept");
    let ranks = job["ranks"].as_array().unwrap();
    assert_eq!(ranks.len(), 2);
    let mut host_pids = BTreeSet::new();
    for rank in ranks {
        let host = rank["pid"].as_u64().unwrap();
        let reported = ns_pids[&rank["rank"].to_string()].as_u64().unwrap();
        assert!(host != 0 && host != reported, "{job:#}");
        // The host pid is the process that reported that pid in its namespace.
        assert_eq!(ns_pid(host), Some(reported), "{job:#}");
        host_pids.insert(host);
    }
    wait_watched(&agent, &host_pids);
    drop(launcher);
    drop(agent);
    let _ = std::fs::remove_dir_all(&dir);
}
