//! `containers`: which container and Kubernetes pod a process runs in, read
//! from its cgroup path, and how a pid of another pid namespace (what a rank
//! in a container reports about itself) becomes a pid of the agent's own
//! `/proc` (a host pid, for an agent with `hostPID`).
//!
//! The cgroup path is named by the container runtime, but a process can
//! create and name cgroups below its own, so only what has a runtime's
//! shape is believed, and only bounded, validated parts of it are kept: a
//! container id is hex (12 to 64 digits; 64 where nothing but the digits
//! names it), a pod uid is a UUID. Anything else reads as "not in a
//! container": the path itself is never echoed.

use std::collections::HashMap;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use serde::Serialize;

/// The container and pod of a process, where its cgroup path names them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Container {
    /// The runtime's container id (lowercase hex, 12 to 64 digits).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub container_id: Option<String>,
    /// The Kubernetes pod's uid (a lowercase UUID, with dashes).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
}

impl Container {
    /// Whether the cgroup named a container or a pod.
    pub fn is_known(&self) -> bool {
        self.container_id.is_some() || self.pod_uid.is_some()
    }

    /// The short form a process name carries: `pod 1234abcd…, container
    /// 0a1b2c3d4e5f` (the pod uid's first group, the container id's first 12
    /// digits as `docker ps` shows it), either part alone, or `None`.
    pub fn short_label(&self) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(uid) = &self.pod_uid {
            parts.push(format!("pod {}…", &uid[..8.min(uid.len())]));
        }
        if let Some(id) = &self.container_id {
            parts.push(format!("container {}", &id[..12.min(id.len())]));
        }
        (!parts.is_empty()).then(|| parts.join(", "))
    }
}

/// Lines of a `/proc/<pid>/cgroup` looked at (one per v1 hierarchy, one v2).
const MAX_LINES: usize = 64;
/// Bytes of a `/proc/<pid>/cgroup` read.
const MAX_CGROUP_BYTES: u64 = 64 * 1024;

/// The container and pod named by the content of `/proc/<pid>/cgroup`:
/// v1 lines `N:controllers:/path` and the v2 line `0::/path`. The v2 line is
/// preferred; else the first line that names something.
pub fn parse_cgroup(text: &str) -> Container {
    let mut fallback = None;
    for line in text.lines().take(MAX_LINES) {
        let mut fields = line.splitn(3, ':');
        let (Some(hierarchy), Some(controllers), Some(path)) =
            (fields.next(), fields.next(), fields.next())
        else {
            continue;
        };
        let found = parse_path(path);
        if !found.is_known() {
            continue;
        }
        if hierarchy == "0" && controllers.is_empty() {
            return found;
        }
        fallback.get_or_insert(found);
    }
    fallback.unwrap_or_default()
}

/// The container and pod of one cgroup path. A pod is believed only below a
/// `kubepods` component (`kubepods.slice`, `/kubepods/`, kind's
/// `kubelet-kubepods.slice`); a pod's container only below its pod. The
/// deepest container component wins (a runtime nested in a container, as
/// kind nodes are, names the inner one last).
fn parse_path(path: &str) -> Container {
    let parts: Vec<&str> = path.split('/').filter(|p| !p.is_empty()).collect();
    let pod = parts
        .iter()
        .position(|p| p.contains("kubepods"))
        .and_then(|kube| {
            parts
                .iter()
                .enumerate()
                .skip(kube)
                .find_map(|(i, p)| pod_uid_of(p).map(|uid| (i, uid)))
        });
    let container_id = parts.iter().enumerate().rev().find_map(|(i, part)| {
        if let Some((pod_at, _)) = pod
            && i <= pod_at
        {
            return None;
        }
        scoped_id(part).or_else(|| {
            // Bare digits name a container only below a pod or `/docker/`.
            let bare_allowed = pod.is_some() || (i > 0 && parts[i - 1] == "docker");
            if bare_allowed {
                hex_id(part, 64..=64)
            } else {
                None
            }
        })
    });
    Container {
        container_id,
        pod_uid: pod.map(|(_, uid)| uid),
    }
}

/// The pod uid of a pod's cgroup component: `pod<uid>` (cgroupfs driver) or
/// `kubepods[-<qos>]-pod<uid with _ for ->.slice` (systemd driver).
fn pod_uid_of(part: &str) -> Option<String> {
    let name = part.strip_suffix(".slice").unwrap_or(part);
    // A UUID has no `p`: the last `pod` starts it.
    let at = name.rfind("pod")?;
    if at > 0 && !name[..at].ends_with('-') {
        return None;
    }
    let uid = name[at + 3..].replace('_', "-");
    is_uuid(&uid).then(|| uid.to_ascii_lowercase())
}

/// `8-4-4-4-12` hex digits.
fn is_uuid(s: &str) -> bool {
    s.len() == 36
        && s.bytes().enumerate().all(|(i, b)| match i {
            8 | 13 | 18 | 23 => b == b'-',
            _ => b.is_ascii_hexdigit(),
        })
}

/// The id in a runtime's scope name: `cri-containerd-<id>.scope`,
/// `docker-<id>.scope`, `crio-<id>.scope` (not `crio-conmon-<id>`, the
/// monitor beside it), podman's `libpod-<id>.scope` and
/// `libpod-payload-<id>`.
fn scoped_id(part: &str) -> Option<String> {
    const PREFIXES: [&str; 5] = [
        "cri-containerd-",
        "docker-",
        "crio-",
        "libpod-payload-",
        "libpod-",
    ];
    let name = part.strip_suffix(".scope").unwrap_or(part);
    let rest = PREFIXES.iter().find_map(|p| name.strip_prefix(p))?;
    // `crio-conmon-…`, `libpod-conmon-…`: not hex, so not a container.
    hex_id(rest, 12..=64)
}

/// `s` as a lowercase container id, when it is hex of a length in `lengths`.
fn hex_id(s: &str, lengths: std::ops::RangeInclusive<usize>) -> Option<String> {
    (lengths.contains(&s.len()) && s.bytes().all(|b| b.is_ascii_hexdigit()))
        .then(|| s.to_ascii_lowercase())
}

/// Reads `/proc/<pid>/cgroup` (at most 64 KiB) and parses it.
pub fn read_pid(pid: u32) -> std::io::Result<Container> {
    let mut text = String::new();
    std::fs::File::open(format!("/proc/{pid}/cgroup"))?
        .take(MAX_CGROUP_BYTES)
        .read_to_string(&mut text)?;
    Ok(parse_cgroup(&text))
}

/// The container and pod of process `pid` (nothing known when it is gone or
/// unreadable).
#[allow(
    dead_code,
    reason = "the agent reads through `Cache`; tests ask directly"
)]
pub fn of_pid(pid: u32) -> Container {
    read_pid(pid).unwrap_or_default()
}

/// The containers of the processes a view shows, read once per process:
/// on first sight, and again only while nothing is known, every
/// [`Cache::RECHECK_NS`] (a process may be moved into its container's
/// cgroup just after it starts; a process in a container stays there). A
/// read that fails (the process exited) keeps what was known.
#[derive(Debug, Default)]
pub struct Cache {
    entries: HashMap<u32, CacheEntry>,
}

#[derive(Debug)]
struct CacheEntry {
    container: Container,
    read_ns: u64,
}

impl Cache {
    /// How long a process with no container is believed to have none.
    pub const RECHECK_NS: u64 = 30_000_000_000;

    /// The container of `pid` at `now_ns` (any monotonic clock).
    pub fn get(&mut self, pid: u32, now_ns: u64) -> Container {
        self.get_with(pid, now_ns, read_pid)
    }

    /// [`Cache::get`] with the reader given (tests).
    fn get_with(
        &mut self,
        pid: u32,
        now_ns: u64,
        read: impl FnOnce(u32) -> std::io::Result<Container>,
    ) -> Container {
        if let Some(entry) = self.entries.get(&pid)
            && (entry.container.is_known()
                || now_ns.saturating_sub(entry.read_ns) < Self::RECHECK_NS)
        {
            return entry.container.clone();
        }
        let read = read(pid);
        let entry = self.entries.entry(pid).or_insert(CacheEntry {
            container: Container::default(),
            read_ns: now_ns,
        });
        entry.read_ns = now_ns;
        if let Ok(container) = read {
            entry.container = container;
        }
        entry.container.clone()
    }

    /// Forgets the processes `keep` does not keep (no longer shown).
    pub fn retain(&mut self, keep: impl Fn(u32) -> bool) {
        self.entries.retain(|&pid, _| keep(pid));
    }
}

/// The inode of `pid`'s pid namespace (`/proc/<pid>/ns/pid`): two processes
/// are in the same pid namespace when these are equal.
#[allow(
    dead_code,
    reason = "ground truth for the tests; the agent compares namespaces in scan_namespace"
)]
pub fn pid_namespace(pid: u32) -> std::io::Result<u64> {
    Ok(std::fs::metadata(format!("/proc/{pid}/ns/pid"))?.ino())
}

/// Processes looked at by [`host_pids_in_namespace_of`] at most.
const MAX_SCANNED: usize = 65_536;

/// Every process in the pid namespace of `owner_host_pid`, as its pid there
/// (the last field of `NSpid:` in `/proc/<pid>/status`) → its pid in the
/// agent's `/proc` (the host pid, for an agent with `hostPID`).
///
/// This is how a rank's reported pid becomes a host pid. A rank reports
/// `getpid()`, a pid of its own namespace (its container's); the agent
/// knows the host pid of the process serving the job's control socket
/// from `SO_PEERCRED`, which the kernel translates into the reader's pid
/// namespace. Ranks in that process's namespace are found here by the pid
/// they reported. (A rank in another container of the pod, without a
/// shared process namespace, is in another namespace and is not found.)
///
/// When the owner is in the agent's own namespace, the map is the identity
/// on that namespace's pids. At most 65,536 processes are looked at;
/// processes that vanish during the scan are skipped. Fails only when the
/// owner's namespace or `/proc` cannot be read.
pub fn host_pids_in_namespace_of(owner_host_pid: u32) -> std::io::Result<HashMap<u32, u32>> {
    scan_namespace(Path::new("/proc"), owner_host_pid, MAX_SCANNED)
}

/// [`host_pids_in_namespace_of`] over a `/proc`-like tree at `proc`,
/// looking at `limit` processes at most. Namespaces are compared by their
/// `ns/pid` files when the agent may read them (reading another user's
/// needs `CAP_SYS_PTRACE`); without that, by what every process shows
/// anyone: the depth of its `NSpid:` line and its cgroup (the processes of
/// one container, which share its pid namespace).
fn scan_namespace(proc: &Path, owner: u32, limit: usize) -> std::io::Result<HashMap<u32, u32>> {
    let ns_of = |pid: u32| -> std::io::Result<(u64, u64)> {
        let meta = std::fs::metadata(proc.join(pid.to_string()).join("ns/pid"))?;
        Ok((meta.dev(), meta.ino()))
    };
    let read =
        |pid: u32, file: &str| std::fs::read_to_string(proc.join(pid.to_string()).join(file));
    let visible_key = |pid: u32| -> std::io::Result<(usize, String)> {
        let depth = ns_depth(&read(pid, "status")?).unwrap_or(0);
        Ok((depth, read(pid, "cgroup")?))
    };
    let precise = ns_of(owner);
    let fallback = match &precise {
        Ok(_) => None,
        Err(error)
            if matches!(
                error.kind(),
                std::io::ErrorKind::PermissionDenied | std::io::ErrorKind::NotFound
            ) =>
        {
            Some(visible_key(owner)?)
        }
        Err(error) => return Err(std::io::Error::new(error.kind(), error.to_string())),
    };
    let mut map = HashMap::new();
    let pids = std::fs::read_dir(proc)?
        .filter_map(|entry| entry.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .take(limit);
    for host_pid in pids {
        let same = match (&precise, &fallback) {
            (Ok(owner_ns), _) => ns_of(host_pid).ok().as_ref() == Some(owner_ns),
            (_, Some(key)) => visible_key(host_pid).ok().as_ref() == Some(key),
            _ => false,
        };
        if !same {
            continue;
        }
        let Ok(status) = read(host_pid, "status") else {
            continue;
        };
        if let Some(ns_pid) = ns_pid_of(&status) {
            map.insert(ns_pid, host_pid);
        }
    }
    Ok(map)
}

/// How many pid namespaces deep a process is, from its `/proc/<pid>/status`
/// (the fields of `NSpid:`; 1 in the reader's own namespace).
fn ns_depth(status: &str) -> Option<usize> {
    Some(
        status
            .lines()
            .find_map(|line| line.strip_prefix("NSpid:"))?
            .split_whitespace()
            .count(),
    )
}

/// Whether `pid` (visible in our `/proc`) is in the agent's own pid
/// namespace: it is as deep as we are (a process we see is in our
/// namespace or below it). Reads only world-readable `status` files.
pub fn in_our_pid_namespace(pid: u32) -> std::io::Result<bool> {
    let depth = |path: &str| -> std::io::Result<Option<usize>> {
        Ok(ns_depth(&std::fs::read_to_string(path)?))
    };
    let ours = depth("/proc/self/status")?;
    let theirs = depth(&format!("/proc/{pid}/status"))?;
    Ok(ours.is_some() && ours == theirs)
}

/// The pid in its own namespace, from a `/proc/<pid>/status`: the last
/// field of `NSpid:` (the first is the pid in the reader's namespace).
fn ns_pid_of(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|line| line.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    const ID: &str = "0a1b2c3d4e5f60718293a4b5c6d7e8f90a1b2c3d4e5f60718293a4b5c6d7e8f9";
    const UID: &str = "1234abcd-5678-4ef0-9abc-def012345678";
    const UID_: &str = "1234abcd_5678_4ef0_9abc_def012345678";

    fn both() -> Container {
        Container {
            container_id: Some(ID.into()),
            pod_uid: Some(UID.into()),
        }
    }

    fn id_only() -> Container {
        Container {
            container_id: Some(ID.into()),
            pod_uid: None,
        }
    }

    fn v2(path: &str) -> Container {
        parse_cgroup(&format!("0::{path}\n"))
    }

    #[test]
    fn kubernetes_with_the_systemd_driver() {
        for (qos, runtime) in [
            ("burstable", "cri-containerd"),
            ("besteffort", "crio"),
            ("burstable", "docker"),
        ] {
            let path = format!(
                "/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{UID_}.slice/{runtime}-{ID}.scope"
            );
            assert_eq!(v2(&path), both(), "{path}");
        }
        // Guaranteed QoS: no QoS slice.
        let path = format!("/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope");
        assert_eq!(v2(&path), both());
        // kind: the kubelet's slices under a node container.
        let path = format!(
            "/system.slice/docker-{}.scope/kubelet.slice/kubelet-kubepods.slice/\
             kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{UID_}.slice/\
             cri-containerd-{ID}.scope",
            "f".repeat(64)
        );
        assert_eq!(v2(&path), both());
        // A process in a sub-cgroup of its container.
        let path = format!(
            "/kubepods.slice/kubepods-pod{UID_}.slice/cri-containerd-{ID}.scope/init.scope"
        );
        assert_eq!(v2(&path), both());
        // The pod's own slice: the pod, no container.
        let path = format!(
            "/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
        );
        assert_eq!(
            v2(&path),
            Container {
                container_id: None,
                pod_uid: Some(UID.into())
            }
        );
    }

    #[test]
    fn kubernetes_with_the_cgroupfs_driver() {
        assert_eq!(v2(&format!("/kubepods/burstable/pod{UID}/{ID}")), both());
        assert_eq!(v2(&format!("/kubepods/pod{UID}/{ID}")), both());
        // v1 only (a node without the unified hierarchy).
        let text = format!(
            "12:pids:/kubepods/besteffort/pod{UID}/{ID}\n\
             11:cpu,cpuacct:/kubepods/besteffort/pod{UID}/{ID}\n\
             1:name=systemd:/kubepods/besteffort/pod{UID}/{ID}\n"
        );
        assert_eq!(parse_cgroup(&text), both());
        // kind with cgroupfs: the inner container, not the node's.
        let node = "e".repeat(64);
        assert_eq!(
            v2(&format!("/docker/{node}/kubepods/besteffort/pod{UID}/{ID}")),
            both()
        );
        // Uppercase digits are read as lowercase.
        assert_eq!(
            v2(&format!(
                "/kubepods/pod{}/{}",
                UID.to_uppercase(),
                ID.to_uppercase()
            )),
            both()
        );
    }

    #[test]
    fn docker_crio_and_podman_outside_kubernetes() {
        assert_eq!(v2(&format!("/system.slice/docker-{ID}.scope")), id_only());
        assert_eq!(parse_cgroup(&format!("4:memory:/docker/{ID}\n")), id_only());
        assert_eq!(v2(&format!("/machine.slice/crio-{ID}.scope")), id_only());
        assert_eq!(v2(&format!("/machine.slice/libpod-{ID}.scope")), id_only());
        assert_eq!(
            v2(&format!(
                "/machine.slice/libpod-{ID}.scope/libpod-payload-{ID}"
            )),
            id_only()
        );
        assert_eq!(v2(&format!("/libpod_parent/libpod-{ID}")), id_only());
        // A shorter id in a runtime's scope is still an id.
        assert_eq!(
            v2("/system.slice/cri-containerd-0a1b2c3d4e5f.scope").container_id,
            Some("0a1b2c3d4e5f".into())
        );
    }

    #[test]
    fn a_runtimes_monitor_is_not_a_container() {
        assert_eq!(
            v2(&format!("/machine.slice/crio-conmon-{ID}.scope")),
            Container::default()
        );
        assert_eq!(
            v2(&format!("/machine.slice/libpod-conmon-{ID}.scope")),
            Container::default()
        );
        // The pod of a monitor under kubepods is still its pod.
        let path = format!("/kubepods.slice/kubepods-pod{UID_}.slice/crio-conmon-{ID}.scope");
        assert_eq!(v2(&path).container_id, None);
    }

    #[test]
    fn paths_outside_containers_name_nothing() {
        for path in [
            "/",
            "/user.slice/user-1000.slice/user@1000.service/app.slice/tmux.scope",
            "/user.slice/user-1000.slice/session-3.scope",
            "/system.slice/sshd.service",
            "/system.slice/docker.service",
            "/init.scope",
            // What this test machine's memory hierarchy shows: 32 hex digits.
            "/process_api/1ed48dd1e4398bfe7de3878224a89d88",
        ] {
            assert_eq!(v2(path), Container::default(), "{path}");
        }
        assert_eq!(parse_cgroup(""), Container::default());
        assert_eq!(
            parse_cgroup("garbage without colons\n"),
            Container::default()
        );
    }

    #[test]
    fn the_v2_line_is_preferred_and_v1_lines_are_the_fallback() {
        let other = "f".repeat(64);
        let text = format!(
            "9:name=systemd:/system.slice/docker-{other}.scope\n\
             4:memory:/process_api/1ed48dd1e4398bfe7de3878224a89d88\n\
             0::/kubepods/pod{UID}/{ID}\n"
        );
        assert_eq!(parse_cgroup(&text), both());
        // v2 names nothing: the first v1 line that does.
        let text = format!(
            "9:name=systemd:/\n\
             4:memory:/system.slice/docker-{ID}.scope\n\
             3:pids:/system.slice/docker-{other}.scope\n\
             0::/\n"
        );
        assert_eq!(parse_cgroup(&text), id_only());
    }

    #[test]
    fn hostile_paths_are_not_echoed() {
        // Too long, not hex, in the wrong place, or pretending.
        let long = "a".repeat(100_000);
        for path in [
            format!("/system.slice/docker-{long}.scope"),
            format!("/docker/{long}"),
            format!("/system.slice/docker-{}.scope", "g".repeat(64)),
            format!("/system.slice/docker-{}.scope", "a".repeat(65)),
            format!("/system.slice/docker-{}.scope", "a".repeat(11)),
            format!("/system.slice/docker-{ID}; rm -rf.scope"),
            format!("/kubepods/pod{UID}x/{ID}"),
            format!("/kubepods/pod{long}"),
            // A pod without kubepods above it, a bare id without a runtime.
            format!("/user.slice/pod{UID}/{ID}"),
            format!("/user.slice/{ID}"),
        ] {
            assert_eq!(
                v2(&path),
                Container::default(),
                "{}",
                &path[..path.len().min(200)]
            );
        }
        // A short bare id is not believed, even under a pod.
        let found = v2(&format!("/kubepods/pod{UID}/0a1b2c3d4e5f"));
        assert_eq!(
            (found.pod_uid.as_deref(), found.container_id),
            (Some(UID), None)
        );
        // Megabytes of lines: bounded work, nothing named.
        let many = "1:cpu:/x\n".repeat(200_000);
        assert_eq!(parse_cgroup(&many), Container::default());
    }

    #[test]
    fn short_labels_and_json() {
        assert_eq!(
            both().short_label().as_deref(),
            Some("pod 1234abcd…, container 0a1b2c3d4e5f")
        );
        assert_eq!(
            id_only().short_label().as_deref(),
            Some("container 0a1b2c3d4e5f")
        );
        assert_eq!(Container::default().short_label(), None);
        assert_eq!(
            serde_json::to_value(both()).unwrap(),
            serde_json::json!({ "container_id": ID, "pod_uid": UID })
        );
        assert_eq!(
            serde_json::to_value(Container::default()).unwrap(),
            serde_json::json!({})
        );
    }

    #[test]
    fn the_cache_reads_a_process_once_and_rechecks_only_the_unknown() {
        let mut cache = Cache::default();
        let reads = std::cell::Cell::new(0);
        let read = |answer: std::io::Result<Container>| {
            let reads = &reads;
            move |_pid| {
                reads.set(reads.get() + 1);
                answer
            }
        };
        // Known: read once, kept for good.
        assert_eq!(cache.get_with(1, 0, read(Ok(both()))), both());
        for t in [1, Cache::RECHECK_NS, 10 * Cache::RECHECK_NS] {
            assert_eq!(cache.get_with(1, t, read(Ok(Container::default()))), both());
        }
        assert_eq!(reads.get(), 1);
        // Unknown: read again only after RECHECK_NS.
        assert_eq!(
            cache.get_with(2, 0, read(Ok(Container::default()))),
            Container::default()
        );
        assert_eq!(cache.get_with(2, 5, read(Ok(both()))), Container::default());
        assert_eq!(reads.get(), 2);
        assert_eq!(
            cache.get_with(2, Cache::RECHECK_NS, read(Ok(id_only()))),
            id_only()
        );
        assert_eq!(reads.get(), 3);
        // A failed read keeps what was known (nothing, here).
        let gone = || Err(std::io::Error::from(std::io::ErrorKind::NotFound));
        assert_eq!(cache.get_with(3, 0, read(gone())), Container::default());
        // Forgotten when no longer shown: read again on next sight.
        cache.retain(|pid| pid != 1);
        assert_eq!(cache.get_with(1, 0, read(Ok(id_only()))), id_only());
        assert_eq!(reads.get(), 5);
    }

    #[test]
    fn ns_pid_is_the_last_nspid_field() {
        let status =
            "Name:\tsleep\nTgid:\t4242\nPid:\t4242\nNSpid:\t4242\t7\t1\nNStgid:\t4242\t7\t1\n";
        assert_eq!(ns_pid_of(status), Some(1));
        assert_eq!(ns_pid_of("Pid:\t9\nNSpid:\t9\n"), Some(9));
        assert_eq!(ns_pid_of("Pid:\t9\n"), None);
    }

    /// A `/proc`-like tree: processes whose `ns/pid` are hard links to one
    /// file share its inode, as processes of one namespace do.
    #[test]
    fn the_namespace_scan_maps_ns_pids_to_host_pids_of_the_owners_namespace() {
        let root =
            std::env::temp_dir().join(format!("ringwatch-containers-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        let ns_a = root.join("ns-a");
        let ns_b = root.join("ns-b");
        std::fs::create_dir_all(&root).unwrap();
        std::fs::write(&ns_a, "").unwrap();
        std::fs::write(&ns_b, "").unwrap();
        let process = |host: u32, ns: &Path, nspid: &str| {
            let dir = root.join(host.to_string());
            std::fs::create_dir_all(dir.join("ns")).unwrap();
            std::fs::hard_link(ns, dir.join("ns/pid")).unwrap();
            std::fs::write(
                dir.join("status"),
                format!("Pid:\t{host}\nNSpid:\t{nspid}\n"),
            )
            .unwrap();
        };
        process(100, &ns_a, "100\t1");
        process(101, &ns_a, "101\t7");
        process(102, &ns_b, "102");
        process(103, &ns_a, "103\t9");
        // Vanishing mid-scan: its status is gone.
        std::fs::remove_file(root.join("103/status")).unwrap();
        std::fs::create_dir_all(root.join("self")).unwrap();
        let map = scan_namespace(&root, 101, MAX_SCANNED).unwrap();
        assert_eq!(map, HashMap::from([(1, 100), (7, 101)]));
        let map = scan_namespace(&root, 102, MAX_SCANNED).unwrap();
        assert_eq!(map, HashMap::from([(102, 102)]));
        assert!(scan_namespace(&root, 999, MAX_SCANNED).is_err());
        assert!(scan_namespace(&root, 100, 1).unwrap().len() <= 1);
        // Without readable ns/pid files (no CAP_SYS_PTRACE): the same depth
        // and the same cgroup make a namespace.
        let visible = |host: u32, nspid: &str, cgroup: &str| {
            let dir = root.join(host.to_string());
            std::fs::create_dir_all(&dir).unwrap();
            std::fs::write(
                dir.join("status"),
                format!("Pid:\t{host}\nNSpid:\t{nspid}\n"),
            )
            .unwrap();
            std::fs::write(dir.join("cgroup"), format!("0::{cgroup}\n")).unwrap();
        };
        visible(200, "200\t1", "/pod-a");
        visible(201, "201\t5", "/pod-a");
        visible(202, "202\t5", "/pod-b");
        visible(203, "203", "/pod-a");
        let map = scan_namespace(&root, 201, MAX_SCANNED).unwrap();
        assert_eq!(map, HashMap::from([(1, 200), (5, 201)]));
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn this_process_is_in_its_own_namespace_scan() {
        let me = std::process::id();
        let map = host_pids_in_namespace_of(me).unwrap();
        // Our own pid namespace: its pid maps to itself, as /proc names it.
        let own_ns_pid = ns_pid_of(&std::fs::read_to_string("/proc/self/status").unwrap()).unwrap();
        assert_eq!(map.get(&own_ns_pid), Some(&me));
        assert!(pid_namespace(me).unwrap() > 0);
    }
}
