//! Privileged: a process in a pid namespace of its own (`unshare --pid`),
//! inside a cgroup named the way the kubelet names a pod's container, is
//! read as that container and pod, and its namespace's pids map to host
//! pids. With eBPF, `serve --pid` shows the container and pod in
//! `/api/processes`, the timeline's process name and the `/metrics` labels.
//! The cgroups are the test's own, under a parent of its own
//! (`ringwatch-test-<pid>.slice`) in the v2 hierarchy, removed afterwards.
//! Skips, saying why, when not root, without `unshare`, or without cgroup v2.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;
#[allow(dead_code)]
#[path = "../src/observe/containers.rs"]
mod containers;

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{ApiServer, skip_unless_privileged};
use containers::Container;
use test_support::eventually_reporting;

/// Where the cgroup v2 hierarchy is mounted: `/sys/fs/cgroup/unified` in
/// hybrid mode, `/sys/fs/cgroup` in unified mode.
fn cgroup2_root() -> Option<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts").ok()?;
    let points: Vec<&str> = mounts
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let point = fields.nth(1)?;
            (fields.next()? == "cgroup2").then_some(point)
        })
        .collect();
    ["/sys/fs/cgroup/unified", "/sys/fs/cgroup"]
        .into_iter()
        .find(|p| points.contains(p))
        .or(points.first().copied())
        .map(PathBuf::from)
}

/// True (after printing why) when this test cannot make namespaces and
/// cgroups here; else the cgroup v2 root.
fn skip_unless_namespaces() -> Option<PathBuf> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIPPED: this test makes pid namespaces and cgroups and needs root");
        return None;
    }
    let unshare = Command::new("unshare")
        .arg("--version")
        .stdout(Stdio::null())
        .status();
    if !unshare.is_ok_and(|s| s.success()) {
        eprintln!("SKIPPED: no `unshare` (util-linux) on PATH");
        return None;
    }
    let root = cgroup2_root();
    if root.is_none() {
        eprintln!("SKIPPED: no cgroup v2 hierarchy mounted");
    }
    root
}

/// A "container": two processes in a new pid namespace, inside
/// `<v2 root>/ringwatch-test-<pid>.slice/kubepods.slice/
/// kubepods-besteffort.slice/kubepods-besteffort-pod<uid>.slice/
/// cri-containerd-<id>.scope`. Killed and its cgroups removed on drop.
struct FakePod {
    uid: String,
    id: String,
    /// The cgroup directories made, outermost first.
    made: Vec<PathBuf>,
    /// `unshare` (host pid; in the host namespace, in the cgroup).
    unshare: Child,
    /// The namespace's init (its pid 1), as host pid.
    init_host_pid: u32,
    /// The init's child: (pid in the namespace, host pid).
    second: (u32, u32),
}

impl FakePod {
    fn start(root: &Path, n: u32) -> Self {
        let me = std::process::id();
        let uid = format!("{me:08x}-{n:04x}-4ef0-9abc-def012345678");
        let id = format!("{me:08x}{n:08x}{}", "0a1b2c3d".repeat(6));
        assert_eq!((uid.len(), id.len()), (36, 64));
        let parent = root.join(format!("ringwatch-test-{me}-{n}.slice"));
        let scope = parent
            .join("kubepods.slice")
            .join("kubepods-besteffort.slice")
            .join(format!(
                "kubepods-besteffort-pod{}.slice",
                uid.replace('-', "_")
            ))
            .join(format!("cri-containerd-{id}.scope"));
        let mut made = Vec::new();
        for dir in scope.ancestors().collect::<Vec<_>>().into_iter().rev() {
            if dir.starts_with(&parent) && !dir.exists() {
                std::fs::create_dir(dir).unwrap();
                made.push(dir.to_owned());
            }
        }
        // The shell joins the cgroup, then becomes `unshare`, whose child is
        // the new namespace's init: it starts a second process (the
        // namespace's pid 2, which it prints) and becomes a sleep.
        let mut unshare = Command::new("sh")
            .args([
                "-c",
                r#"echo $$ > "$1/cgroup.procs" && exec unshare --pid --fork --kill-child --mount-proc sh -c "$2""#,
                "sh",
            ])
            .arg(&scope)
            .arg("sleep infinity & echo $!; exec sleep infinity")
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(unshare.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let second_ns_pid: u32 = line
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("the namespace's init printed {line:?}"));
        let children = common::procs::children_of(unshare.id());
        assert_eq!(children.len(), 1, "unshare's children: {children:?}");
        let init_host_pid = *children.first().unwrap();
        let grandchildren = common::procs::children_of(init_host_pid);
        assert_eq!(grandchildren.len(), 1, "init's children: {grandchildren:?}");
        Self {
            uid,
            id,
            made,
            unshare,
            init_host_pid,
            second: (second_ns_pid, *grandchildren.first().unwrap()),
        }
    }

    fn expected(&self) -> Container {
        Container {
            container_id: Some(self.id.clone()),
            pod_uid: Some(self.uid.clone()),
        }
    }
}

impl Drop for FakePod {
    fn drop(&mut self) {
        // The init's death ends the namespace; unshare then exits.
        // SAFETY: kill has no memory-safety preconditions; the pid is our
        // grandchild, not reaped while `unshare` lives.
        unsafe { libc::kill(self.init_host_pid as i32, libc::SIGKILL) };
        let _ = self.unshare.kill();
        let _ = self.unshare.wait();
        // A cgroup goes once its last process is reaped: retry a while.
        for dir in self.made.iter().rev() {
            let deadline = Instant::now() + Duration::from_secs(5);
            while let Err(e) = std::fs::remove_dir(dir) {
                if Instant::now() > deadline {
                    eprintln!("could not remove {}: {e}", dir.display());
                    break;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

#[test]
fn a_namespaced_process_in_a_kubepods_cgroup_is_named_and_its_pids_map_to_host_pids() {
    let Some(root) = skip_unless_namespaces() else {
        return;
    };
    let pod = FakePod::start(&root, 0);
    let (second_ns_pid, second_host_pid) = pod.second;

    // (a) Both processes are read as the container of the pod.
    for pid in [pod.init_host_pid, second_host_pid] {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        assert_eq!(containers::parse_cgroup(&text), pod.expected(), "{text}");
        assert_eq!(containers::of_pid(pid), pod.expected());
    }
    // Not this test's own process.
    assert!(!containers::of_pid(std::process::id()).is_known());

    // (b) The namespace is another one, and its pids map to the host's.
    let ns = containers::pid_namespace(pod.init_host_pid).unwrap();
    assert_ne!(ns, containers::pid_namespace(std::process::id()).unwrap());
    assert_eq!(
        containers::pid_namespace(second_host_pid).unwrap(),
        ns,
        "the second process is in the init's namespace"
    );
    assert_ne!(second_ns_pid, 1);
    let map = containers::host_pids_in_namespace_of(pod.init_host_pid).unwrap();
    assert_eq!(
        map,
        std::collections::HashMap::from([(1, pod.init_host_pid), (second_ns_pid, second_host_pid)]),
        "ns pid → host pid"
    );
    // Asked through the other process: the same namespace, the same map.
    assert_eq!(
        containers::host_pids_in_namespace_of(second_host_pid).unwrap(),
        map
    );
    // `unshare` itself is in the host's namespace: there, pids are themselves.
    let host = containers::host_pids_in_namespace_of(pod.unshare.id()).unwrap();
    assert_eq!(host.get(&pod.unshare.id()), Some(&pod.unshare.id()));
    assert!(!host.values().any(|&p| p == pod.init_host_pid));
}

#[test]
fn serve_shows_the_container_and_pod_of_a_watched_process() {
    let Some(root) = skip_unless_namespaces() else {
        return;
    };
    if skip_unless_privileged() {
        return;
    }
    let pod = FakePod::start(&root, 1);
    let pid = pod.init_host_pid;
    let agent = ApiServer::start(&["--pid", &pid.to_string()], true);

    // The view is republished every second: poll until the process is in.
    let process = eventually_reporting(
        Duration::from_secs(60),
        &format!("pid {pid} in /api/processes"),
        || {
            let (status, body) = agent.get_json("/api/processes");
            assert_eq!(status, 200, "{body}");
            body["processes"]
                .as_array()
                .unwrap()
                .iter()
                .find(|p| p["pid"] == pid)
                .cloned()
                .ok_or(body)
        },
    );
    assert_eq!(process["container_id"], pod.id.as_str(), "{process}");
    assert_eq!(process["pod_uid"], pod.uid.as_str(), "{process}");

    let (status, trace) = agent.get_json(&format!("/api/timeline?pid={pid}"));
    assert_eq!(status, 200, "{trace}");
    let name = trace["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["name"] == "process_name" && e["pid"] == pid)
        .unwrap_or_else(|| panic!("no process_name for {pid}: {trace}"));
    assert_eq!(
        name["args"]["name"],
        format!(
            "sleep (pid {pid}, pod {}…, container {})",
            &pod.uid[..8],
            &pod.id[..12]
        ),
        "{name}"
    );
    assert_eq!(name["args"]["container_id"], pod.id.as_str());
    assert_eq!(name["args"]["pod_uid"], pod.uid.as_str());

    let (status, _, metrics) = agent.request("GET", "/metrics");
    assert_eq!(status, 200);
    let series = format!(
        // In no job: empty job and rank.
        "ringwatch_process_cpu_ratio{{pid=\"{pid}\",comm=\"sleep\",container_id=\"{}\",pod_uid=\"{}\",job=\"\",rank=\"\"}}",
        pod.id, pod.uid
    );
    assert!(metrics.contains(&series), "no {series} in {metrics}");
}
