//! Privileged: a PyTorch DDP job with gloo, launched by torchrun across two
//! pretend nodes × 2 ranks (network namespaces joined by a veth link; the
//! script knows nothing of ringwatch and no ringwatch variable is set), is
//! found by an agent per node from the variables torchrun gave each process:
//! agent 0 started before the job, agent 1 after it. Each lists one job of
//! kind `torchrun` with its node's two ranks (the ranks torchrun started, not
//! torchrun itself, which is listed as the launcher); the cluster view holds
//! the four ranks, the cluster timeline their threads; each rank's gloo TCP
//! bytes, as its node's agent counted them, equal the kernel's tcp_info
//! counts; `/metrics` labels the ranks' series with job and rank. Processes
//! that only look like the job's are not merged into it: another user's
//! process that claims rank 0 of the same run, and a stray `MASTER_ADDR`.
//!
//! Each agent counts as its node's only the processes of its node's network
//! namespace (`--node-netns`): pretend nodes share one kernel.
//!
//! And an Open MPI job (`mpirun -np 4` of a small C program doing
//! allreduces) is listed as one job of kind `mpi` with its four ranks and
//! `mpirun` as its launcher; a Horovod 0.28.1 job (`horovodrun --gloo -np 4`)
//! as one job of kind `horovod` with its four ranks.
//!
//! Skips, saying why, when not root, without BTF, without `ip`, `setpriv` or
//! `ss`, without a Python whose torch has torch.distributed (the torchrun
//! test), without `mpicc` and `mpirun` (the MPI test), or without a Horovod
//! build in target/horovod-venv (the Horovod test).
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[path = "../../xtask/src/image.rs"]
#[allow(dead_code)] // `cargo xtask image`'s own entry point and flags
mod image;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::nodes::{Nodes, Ranks};
use common::procs::children_of;
use common::{ApiServer, skip_unless_privileged};
use serde_json::Value;
use test_support::{TempDir, eventually, eventually_reporting, free_port};

/// The training script: DDP over gloo, unchanged by ringwatch. Every rank
/// stops on the same step, once the stop file exists.
const SCRIPT: &str = r#"
import os, subprocess, sys
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
torch.manual_seed(dist.get_rank())
model = DDP(torch.nn.Linear(256, 256))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
stop = sys.argv[1]
# Global rank 0 starts a helper, as a data loader starts its workers: a child
# that inherits the rank's environment.
helper = subprocess.Popen(["sleep", "600"]) if dist.get_rank() == 0 else None
step = 0
while True:
    loss = model(torch.randn(32, 256)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    step += 1
    if step == 1:
        # Connected and training: the test measures from here on.
        open(stop + ".ready-%d" % dist.get_rank(), "w").close()
    flag = torch.tensor([1.0 if os.path.exists(stop) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        break
if helper:
    helper.kill()
    helper.wait()
dist.destroy_process_group()
"#;

/// A Python with torch.distributed (Debian's python3-torch is for 3.11).
fn python_with_torch() -> Option<PathBuf> {
    ["/usr/bin/python3.11", "/usr/bin/python3"]
        .into_iter()
        .map(PathBuf::from)
        .find(|python| {
            Command::new(python)
                .args(["-c", "import torch.distributed.run, torch.distributed"])
                .stderr(Stdio::null())
                .status()
                .is_ok_and(|s| s.success())
        })
}

/// `ringwatch/run.py`: torchrun, with PyTorch 1.13's crash on Python 3.11
/// corrected (see its docstring). Run as a file, so that nothing of the
/// `ringwatch` package (whose native part a fresh checkout has not built)
/// is imported.
fn torchrun_py() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../collectives/python/ringwatch/run.py")
}

/// Starts node `node`'s torchrun (2 ranks) in its network namespace.
fn start_torchrun(
    nodes: &Nodes,
    node: usize,
    python: &Path,
    port: u16,
    script: &Path,
    stop: &Path,
) -> Child {
    Command::new("ip")
        .args(["netns", "exec", &nodes.ns(node), "env"])
        // gloo picks its interface from the host name otherwise, which does
        // not resolve inside the namespace.
        .arg(format!("GLOO_SOCKET_IFNAME={}", nodes.dev(node)))
        .arg(python)
        .arg("-c")
        .arg(format!(
            "import runpy, sys; sys.argv = ['torchrun'] + sys.argv[1:]; \
             runpy.run_path({:?}, run_name='__main__')",
            torchrun_py().display().to_string()
        ))
        .args(["--nnodes", "2", "--nproc_per_node", "2"])
        .args(["--node_rank", &node.to_string()])
        .args(["--master_addr", &Nodes::addr(0)])
        .args(["--master_port", &port.to_string()])
        .arg(script)
        .arg(stop)
        // Nothing in the working directory shadows a module.
        .current_dir(script.parent().unwrap())
        .stdout(Stdio::null())
        .spawn()
        .unwrap()
}

fn jobs_of_kind(answer: &Value, kind: &str) -> Vec<Value> {
    answer["jobs"]
        .as_array()
        .map(|jobs| jobs.iter().filter(|j| j["kind"] == kind).cloned().collect())
        .unwrap_or_default()
}

/// rank -> pid of a job's ranks as an answer lists them.
fn ranks_of(job: &Value) -> BTreeMap<u64, u64> {
    job["ranks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r["rank"].as_u64().unwrap(), r["pid"].as_u64().unwrap()))
        .collect()
}

/// The two tests one after the other: each starts a job that fills the
/// machine's cores.
static ONE_JOB_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn agent_args<'a>(dir: &'a str, node: &'a str, netns: &'a str, peer: &'a str) -> Vec<&'a str> {
    vec![
        "--jobs",
        "--no-autotune",
        "--runtime-dir",
        dir,
        "--node-name",
        node,
        "--node-netns",
        netns,
        "--peers",
        peer,
        "--peer-timeout",
        "20s",
    ]
}

#[test]
fn a_torchrun_job_on_two_pretend_nodes_is_found_whole_without_a_code_change() {
    if skip_unless_privileged() {
        return;
    }
    let _one = ONE_JOB_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for tool in ["ip", "setpriv", "ss"] {
        if Command::new(tool).arg("-V").output().is_err() {
            eprintln!("SKIPPED: `{tool}` is missing (iproute2, util-linux)");
            return;
        }
    }
    let Some(python) = python_with_torch() else {
        eprintln!("SKIPPED: no Python here imports torch.distributed (apt install python3-torch)");
        return;
    };
    let nodes = Nodes::create();
    let dir = TempDir::new(&format!("launchers-{}", std::process::id()));
    let script = dir.path().join("ddp.py");
    std::fs::write(&script, SCRIPT).unwrap();
    let stop = dir.path().join("stop");
    let runtime: Vec<String> = (0..2)
        .map(|n| {
            let d = dir.path().join(format!("run{n}"));
            std::fs::create_dir_all(&d).unwrap();
            d.display().to_string()
        })
        .collect();
    let netns: Vec<String> = (0..2)
        .map(|n| format!("/run/netns/{}", nodes.ns(n)))
        .collect();
    let first = free_port();
    let second = std::iter::repeat_with(free_port)
        .find(|&p| p != first)
        .unwrap();
    let listen = [format!("127.0.0.1:{first}"), format!("127.0.0.1:{second}")];
    let names = ["node-0", "node-1"];

    // Agent 0 before the job.
    let agent0 = ApiServer::start_listening(
        &listen[0],
        &agent_args(&runtime[0], names[0], &netns[0], &listen[1]),
        false,
    );
    let port = free_port();
    let launchers = Ranks(
        (0..2)
            .map(|n| start_torchrun(&nodes, n, &python, port, &script, &stop))
            .collect(),
    );
    let job_id = format!("torchrun/none@{}:{port}/uid0", Nodes::addr(0));
    // Node n's ranks: the children torchrun started.
    let ranks: Vec<BTreeSet<u32>> = launchers
        .0
        .iter()
        .map(|launcher| {
            eventually(Duration::from_secs(120), "torchrun starts 2 ranks", || {
                let ranks = children_of(launcher.id());
                (ranks.len() == 2).then_some(ranks)
            })
        })
        .collect();
    // Agent 1 after it.
    let agent1 = ApiServer::start_listening(
        &listen[1],
        &agent_args(&runtime[1], names[1], &netns[1], &listen[0]),
        false,
    );
    let agents = [&agent0, &agent1];

    for (n, agent) in agents.iter().enumerate() {
        let job = eventually_reporting(
            Duration::from_secs(60),
            "the agent lists the torchrun job with its node's ranks",
            || {
                let (status, answer) = agent.get_json("/api/jobs");
                let found = jobs_of_kind(&answer, "torchrun");
                match found.as_slice() {
                    [job] if status == 200 && ranks_of(job).len() == 2 => Ok(job.clone()),
                    _ => Err(format!("{status} {answer:#}")),
                }
            },
        );
        assert_eq!(job["job_id"], job_id.as_str(), "{job:#}");
        assert_eq!(job["world_size"], 4, "{job:#}");
        assert_eq!(job["host"], names[n], "{job:#}");
        let listed: BTreeSet<u32> = ranks_of(&job).values().map(|&p| p as u32).collect();
        assert_eq!(
            listed, ranks[n],
            "node {n}'s ranks are torchrun's children: {job:#}"
        );
        let numbers: Vec<u64> = ranks_of(&job).keys().copied().collect();
        assert_eq!(numbers, [2 * n as u64, 2 * n as u64 + 1], "{job:#}");
        assert_eq!(
            job["launcher_pids"],
            serde_json::json!([launchers.0[n].id()]),
            "torchrun itself is the launcher, not a rank: {job:#}"
        );
        assert!(job.get("knobs").is_none_or(Value::is_null), "{job:#}");
    }

    // Rank 0's helper is its rank's child: listed and watched with it, and
    // on the timeline with its job and rank.
    let rank0 = ranks_of(&jobs_of_kind(&agent0.get_json("/api/jobs").1, "torchrun")[0])[&0];
    let helper = eventually(Duration::from_secs(120), "rank 0 starts its helper", || {
        children_of(rank0 as u32).into_iter().next()
    });
    eventually_reporting(
        Duration::from_secs(60),
        "the helper listed as rank 0's child",
        || {
            let (_, answer) = agent0.get_json("/api/jobs");
            let job = jobs_of_kind(&answer, "torchrun");
            let children = &job[0]["rank_children"]["0"];
            if *children == serde_json::json!([helper]) {
                Ok(())
            } else {
                Err(format!("{answer:#}"))
            }
        },
    );
    eventually_reporting(
        Duration::from_secs(60),
        "the helper on the job's timeline as rank 0's",
        || {
            let (_, trace) = agent0.get_json(&format!("/api/timeline?job={job_id}"));
            let named = trace["traceEvents"].as_array().and_then(|events| {
                events
                    .iter()
                    .find(|e| e["name"] == "process_name" && e["pid"] == helper)
            });
            match named {
                Some(e) if e["args"]["rank"] == 0 && e["args"]["job"] == job_id.as_str() => Ok(()),
                _ => Err(format!("{named:?}")),
            }
        },
    );

    // One job of four ranks in the cluster view, from either agent.
    for agent in agents {
        let job = eventually_reporting(
            Duration::from_secs(60),
            "the cluster view has the job whole",
            || {
                let (status, merged) = agent.get_json("/api/cluster/jobs");
                let job = merged["jobs"]
                    .as_array()
                    .and_then(|jobs| jobs.iter().find(|j| j["job_id"] == job_id.as_str()));
                match job {
                    Some(job) if status == 200 && job["complete"] == true => Ok(job.clone()),
                    _ => Err(format!("{status} {merged:#}")),
                }
            },
        );
        assert_eq!(job["nodes"].as_array().unwrap().len(), 2, "{job:#}");
    }

    // The cluster timeline holds the four ranks' threads.
    let expected: Vec<String> = (0..2)
        .flat_map(|n| ranks[n].iter().map(move |pid| format!("node-{n}/{pid}")))
        .collect();
    let path = format!(
        "/api/timeline?scope=cluster&job={job_id}&from=now-4s&to=now-1500ms&max_events=20000&downsample=true"
    );
    eventually_reporting(
        Duration::from_secs(90),
        "every rank's thread states on the cluster timeline",
        || {
            let (status, trace) = agent0.get_json(&path);
            if status != 200 {
                return Err(format!("{status} {trace:#}"));
            }
            let seen: BTreeSet<String> = trace["traceEvents"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|e| e["cat"] == "thread_state")
                .filter_map(|e| e["pid"].as_str().map(str::to_owned))
                .collect();
            let missing: Vec<&String> = expected.iter().filter(|k| !seen.contains(*k)).collect();
            if missing.is_empty() {
                Ok(())
            } else {
                Err(format!("missing {missing:?}; seen {seen:?}"))
            }
        },
    );

    // Each rank's gloo TCP bytes: its node's agent = the kernel, once every
    // rank is connected and training (its sockets all open).
    eventually(Duration::from_secs(300), "every rank trains", || {
        (0..4)
            .all(|rank| dir.path().join(format!("stop.ready-{rank}")).exists())
            .then_some(())
    });
    let bases: Vec<String> = agents
        .iter()
        .map(|a| format!("http://{}", a.addr))
        .collect();
    let ns_names: Vec<String> = (0..2).map(|n| nodes.ns(n)).collect();
    let per_node: Vec<image::NodeRanks<'_>> = (0..2)
        .map(|n| image::NodeRanks {
            base: &bases[n],
            ranks: ranks[n].clone(),
            netns: Some(&ns_names[n]),
        })
        .collect();
    let tcp = image::tcp_between_stops(&per_node, &|line| eprintln!("{line}")).unwrap();
    for (pid, (tx, rx)) in &tcp {
        eprintln!("rank pid {pid}: {tx} bytes sent, {rx} read: agent = kernel (tcp_info)");
    }
    assert_eq!(tcp.len(), 4);

    // The ranks' series carry their job and rank.
    let (status, _, metrics) = agent0.request("GET", "/metrics");
    assert_eq!(status, 200);
    let listed = ranks_of(&jobs_of_kind(&agent0.get_json("/api/jobs").1, "torchrun")[0]);
    for (rank, pid) in listed {
        let line = metrics
            .lines()
            .find(|l| {
                l.starts_with("ringwatch_process_cpu_ratio{")
                    && l.contains(&format!("pid=\"{pid}\""))
            })
            .unwrap_or_else(|| panic!("no series of rank pid {pid}: {metrics}"));
        assert!(line.contains(&format!("job=\"{job_id}\"")), "{line}");
        assert!(line.contains(&format!("rank=\"{rank}\"")), "{line}");
    }

    // Look-alikes on node 0: a stray MASTER_ADDR, and another user's process
    // that says it is rank 0 of this very run. Neither joins the job.
    let lookalike = |uid: &str, vars: &[String]| -> Child {
        Command::new("ip")
            .args(["netns", "exec", &nodes.ns(0), "setpriv"])
            .args(["--reuid", uid, "--regid", uid, "--clear-groups"])
            .args(["env", "-i"])
            .args(vars)
            .args(["sleep", "600"])
            .spawn()
            .unwrap()
    };
    let master = [
        format!("MASTER_ADDR={}", Nodes::addr(0)),
        format!("MASTER_PORT={port}"),
    ];
    let stray = lookalike("0", &master);
    let mut claim = vec![
        "TORCHELASTIC_RUN_ID=none".to_owned(),
        "RANK=0".into(),
        "WORLD_SIZE=4".into(),
    ];
    claim.extend(master.iter().cloned());
    let impostor = lookalike("65534", &claim);
    let _lookalikes = Ranks(vec![stray, impostor]);
    let (stray, impostor) = (_lookalikes.0[0].id(), _lookalikes.0[1].id());
    let answer = eventually_reporting(
        Duration::from_secs(60),
        "the other user's process is a job of its own",
        || {
            let (status, answer) = agent0.get_json("/api/jobs");
            let theirs = format!("torchrun/none@{}:{port}/uid65534", Nodes::addr(0));
            let found = jobs_of_kind(&answer, "torchrun").into_iter().any(|j| {
                j["job_id"] == theirs.as_str() && ranks_of(&j).get(&0) == Some(&u64::from(impostor))
            });
            if status == 200 && found {
                Ok(answer)
            } else {
                Err(format!("{status} {answer:#}"))
            }
        },
    );
    let ours = jobs_of_kind(&answer, "torchrun")
        .into_iter()
        .find(|j| j["job_id"] == job_id.as_str())
        .unwrap();
    let ours_ranks: BTreeSet<u32> = ranks_of(&ours).values().map(|&p| p as u32).collect();
    assert_eq!(ours_ranks, ranks[0], "{ours:#}");
    let listed_anywhere = |pid: u32| {
        let pid = Value::from(pid);
        answer["jobs"].as_array().unwrap().iter().any(|j| {
            let in_list = |key: &str| j[key].as_array().is_some_and(|p| p.contains(&pid));
            j["ranks"]
                .as_array()
                .unwrap()
                .iter()
                .any(|r| r["pid"] == pid)
                || in_list("unknown_rank_pids")
                || in_list("launcher_pids")
        })
    };
    assert!(
        !listed_anywhere(stray),
        "a stray MASTER_ADDR is no job: {answer:#}"
    );

    // The job ends on its own once asked.
    std::fs::write(&stop, b"").unwrap();
    let mut launchers = launchers;
    for launcher in &mut launchers.0 {
        let status = common::wait_within(launcher, Duration::from_secs(120));
        assert!(status.success(), "torchrun: {status}");
    }
}

/// The MPI program: allreduces until the stop file exists (every rank stops
/// on the same step).
const MPI_PROGRAM: &str = r#"
#include <mpi.h>
#include <unistd.h>
int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    static float buf[65536], out[65536];
    int stop = 0;
    while (!stop) {
        for (int i = 0; i < 65536; i++) buf[i] = (float)(rank + i);
        MPI_Allreduce(buf, out, 65536, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
        int mine = access(argv[1], F_OK) == 0;
        MPI_Allreduce(&mine, &stop, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    }
    MPI_Finalize();
    return 0;
}
"#;

#[test]
fn an_mpirun_job_is_one_mpi_job_with_its_ranks_and_mpirun_as_launcher() {
    if skip_unless_privileged() {
        return;
    }
    let _one = ONE_JOB_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    for tool in ["mpicc", "mpirun"] {
        if Command::new(tool).arg("--version").output().is_err() {
            eprintln!("SKIPPED: `{tool}` is missing (apt install openmpi-bin libopenmpi-dev)");
            return;
        }
    }
    let dir = TempDir::new(&format!("launchers-mpi-{}", std::process::id()));
    let source = dir.path().join("allreduce.c");
    std::fs::write(&source, MPI_PROGRAM).unwrap();
    let program = dir.path().join("allreduce");
    let built = Command::new("mpicc")
        .arg("-O2")
        .arg("-o")
        .arg(&program)
        .arg(&source)
        .status()
        .unwrap();
    assert!(built.success(), "mpicc: {built}");
    let runtime = dir.path().join("run");
    std::fs::create_dir_all(&runtime).unwrap();
    let agent = ApiServer::start(
        &[
            "--jobs",
            "--no-autotune",
            "--runtime-dir",
            runtime.to_str().unwrap(),
        ],
        false,
    );
    let stop = dir.path().join("stop");
    let mpirun = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "4"])
        // TCP between the ranks, as between nodes (the agent counts it).
        .args(["--mca", "btl", "tcp,self"])
        .arg(&program)
        .arg(&stop)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let launcher = mpirun.id();
    let mut mpirun = Ranks(vec![mpirun]);
    let ranks = eventually(Duration::from_secs(120), "mpirun starts 4 ranks", || {
        let ranks = children_of(launcher);
        (ranks.len() == 4).then_some(ranks)
    });
    let job = eventually_reporting(
        Duration::from_secs(60),
        "the agent lists the MPI job with its four ranks",
        || {
            let (status, answer) = agent.get_json("/api/jobs");
            let job = jobs_of_kind(&answer, "mpi")
                .into_iter()
                .find(|j| j["launcher_pids"] == serde_json::json!([launcher]));
            match job {
                Some(job) if status == 200 && ranks_of(&job).len() == 4 => Ok(job),
                _ => Err(format!("{status} {answer:#}")),
            }
        },
    );
    let job_id = job["job_id"].as_str().unwrap();
    assert!(
        job_id.starts_with("mpi/") && job_id.ends_with("/uid0"),
        "{job:#}"
    );
    assert_eq!(job["world_size"], 4, "{job:#}");
    let numbers: Vec<u64> = ranks_of(&job).keys().copied().collect();
    assert_eq!(numbers, [0, 1, 2, 3], "{job:#}");
    let listed: BTreeSet<u32> = ranks_of(&job).values().map(|&p| p as u32).collect();
    assert_eq!(listed, ranks, "the ranks are mpirun's children: {job:#}");

    std::fs::write(&stop, b"").unwrap();
    let status = common::wait_within(&mut mpirun.0[0], Duration::from_secs(120));
    assert!(status.success(), "mpirun: {status}");
}

/// Horovod 0.28.1 built with Gloo for PyTorch (`target/horovod-venv`, as
/// `cargo xtask bench train` builds it), if it is there.
fn horovod_venv() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    // target/<profile>/deps/<test>: the target directory is three up.
    let venv = exe.parent()?.parent()?.parent()?.join("horovod-venv");
    let works = Command::new(venv.join("bin/python"))
        .args(["-c", "import horovod.torch"])
        .output()
        .is_ok_and(|o| o.status.success());
    works.then_some(venv)
}

/// Every descendant of `pid`.
fn descendants_of(pid: u32) -> BTreeSet<u32> {
    let mut out = BTreeSet::new();
    let mut todo = vec![pid];
    while let Some(p) = todo.pop() {
        for child in children_of(p) {
            if out.insert(child) {
                todo.push(child);
            }
        }
    }
    out
}

const HOROVOD_SCRIPT: &str = r#"
import os, sys, time
import torch
import horovod.torch as hvd

hvd.init()
t = torch.ones(1000)
while not os.path.exists(sys.argv[1]):
    hvd.allreduce(t, name="x")
    time.sleep(0.01)
hvd.shutdown()
"#;

#[test]
fn a_horovodrun_gloo_job_is_one_horovod_job_with_its_ranks() {
    if skip_unless_privileged() {
        return;
    }
    let _one = ONE_JOB_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(venv) = horovod_venv() else {
        eprintln!(
            "SKIPPED: Horovod 0.28.1 is not built here (target/horovod-venv; `cargo xtask bench \
             train` builds it, about 15 minutes on 2 cores)"
        );
        return;
    };
    let dir = TempDir::new(&format!("launchers-horovod-{}", std::process::id()));
    let script = dir.path().join("train.py");
    std::fs::write(&script, HOROVOD_SCRIPT).unwrap();
    let runtime = dir.path().join("run");
    std::fs::create_dir_all(&runtime).unwrap();
    let agent = ApiServer::start(
        &[
            "--jobs",
            "--no-autotune",
            "--runtime-dir",
            runtime.to_str().unwrap(),
        ],
        false,
    );
    let stop = dir.path().join("stop");
    let horovodrun = Command::new(venv.join("bin/horovodrun"))
        .args(["--gloo", "-np", "4", "-H", "localhost:4"])
        .arg(venv.join("bin/python"))
        .arg(&script)
        .arg(&stop)
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    let launcher = horovodrun.id();
    let mut horovodrun = Ranks(vec![horovodrun]);
    let job = eventually_reporting(
        Duration::from_secs(180),
        "the agent lists the Horovod job with its four ranks",
        || {
            let (status, answer) = agent.get_json("/api/jobs");
            let job = jobs_of_kind(&answer, "horovod")
                .into_iter()
                .find(|j| ranks_of(j).len() == 4);
            match job {
                Some(job) if status == 200 => Ok(job),
                _ => Err(format!("{status} {answer:#}")),
            }
        },
    );
    let job_id = job["job_id"].as_str().unwrap();
    assert!(
        job_id.starts_with("horovod/") && job_id.ends_with("/uid0"),
        "{job:#}"
    );
    assert_eq!(job["world_size"], 4, "{job:#}");
    let numbers: Vec<u64> = ranks_of(&job).keys().copied().collect();
    assert_eq!(numbers, [0, 1, 2, 3], "{job:#}");
    // The ranks are horovodrun's (descendants: it starts them through a shell),
    // and horovodrun itself is not a rank.
    let below = descendants_of(launcher);
    for (&rank, &pid) in &ranks_of(&job) {
        assert!(
            below.contains(&(pid as u32)),
            "rank {rank} (pid {pid}) is not horovodrun's: {job:#}"
        );
        assert_ne!(pid as u32, launcher, "{job:#}");
    }
    std::fs::write(&stop, b"").unwrap();
    let status = common::wait_within(&mut horovodrun.0[0], Duration::from_secs(120));
    assert!(status.success(), "horovodrun: {status}");
}
