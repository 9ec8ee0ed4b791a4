//! `discovery`: decides which processes to watch, from any source of pids.
//!
//! Sources today: explicit `--pid`s, processes whose `comm` matches
//! `--comm`, and processes in a cgroup (`--cgroup`, a cgroup v2 path),
//! rescanned from /proc. The seam for job discovery through control sockets
//! is [`PidSource`]: anything that can list pids (e.g. the `hello` of each
//! job found under /run/ringwatch/) plugs in there. It also finds which
//! watched processes map `libnccl.so`. It never touches BPF: `probes` does.

use std::collections::BTreeSet;
use std::path::PathBuf;

/// Anything that names processes to watch. Called once a second; returns the
/// pids it wants watched now (pids that disappear from every source and
/// have exited are unwatched by the caller).
pub trait PidSource: Send {
    /// A short name for logs (`--pid`, `--comm rw-*`, `control sockets`).
    fn name(&self) -> String;
    /// The pids this source wants watched right now.
    fn pids(&mut self) -> Vec<u32>;
}

/// Fixed pids given on the command line.
pub struct FixedPids(pub Vec<u32>);

impl PidSource for FixedPids {
    fn name(&self) -> String {
        "--pid".to_owned()
    }
    fn pids(&mut self) -> Vec<u32> {
        self.0
            .iter()
            .copied()
            .filter(|&p| process_exists(p))
            .collect()
    }
}

/// Every process whose `comm` (the kernel's 15-byte name) equals the name.
pub struct ByComm(pub String);

impl PidSource for ByComm {
    fn name(&self) -> String {
        format!("--comm {}", self.0)
    }
    fn pids(&mut self) -> Vec<u32> {
        all_pids()
            .into_iter()
            .filter(|&pid| read_comm(pid, pid).as_deref() == Some(self.0.as_str()))
            .collect()
    }
}

/// Every process in a cgroup v2 (the path as in /proc/PID/cgroup, e.g.
/// `/system.slice/job.service`), including its sub-cgroups.
pub struct ByCgroup(pub String);

impl PidSource for ByCgroup {
    fn name(&self) -> String {
        format!("--cgroup {}", self.0)
    }
    fn pids(&mut self) -> Vec<u32> {
        let wanted = self.0.trim_end_matches('/');
        all_pids()
            .into_iter()
            .filter(|&pid| {
                cgroup_of(pid).is_some_and(|cg| {
                    cg == wanted || cg.strip_prefix(wanted).is_some_and(|r| r.starts_with('/'))
                })
            })
            .collect()
    }
}

/// Lists the pids of the compute processes on this node's GPUs (NVML's
/// `gpu::Gpus`; a fake in tests).
pub trait GpuProcessLister: Send + Sync {
    /// Every pid some GPU lists as a compute process now.
    fn compute_pids(&self) -> Vec<u32>;
}

/// The compute processes NVML lists on the node's GPUs (`--gpu-processes`;
/// none without a driver).
pub struct GpuPids(pub std::sync::Arc<dyn GpuProcessLister>);

impl PidSource for GpuPids {
    fn name(&self) -> String {
        "GPU compute processes".to_owned()
    }
    fn pids(&mut self) -> Vec<u32> {
        // NVML's pids are the host's: keep the ones this pid namespace sees.
        self.0
            .compute_pids()
            .into_iter()
            .filter(|&p| process_exists(p))
            .collect()
    }
}

/// The union of several sources.
#[derive(Default)]
pub struct Discovery {
    sources: Vec<Box<dyn PidSource>>,
}

impl Discovery {
    /// Adds a source.
    pub fn add(&mut self, source: Box<dyn PidSource>) {
        self.sources.push(source);
    }

    /// True when no source was given.
    pub fn is_empty(&self) -> bool {
        self.sources.is_empty()
    }

    /// What the sources are, for logs.
    pub fn describe(&self) -> String {
        self.sources
            .iter()
            .map(|s| s.name())
            .collect::<Vec<_>>()
            .join(", ")
    }

    /// Every pid some source wants watched now.
    pub fn scan(&mut self) -> BTreeSet<u32> {
        self.sources.iter_mut().flat_map(|s| s.pids()).collect()
    }
}

/// True while `pid` is a live (not zombie) process.
pub fn process_exists(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !stat
            .rsplit(')')
            .next()
            .is_some_and(|rest| rest.trim_start().starts_with('Z')),
        Err(_) => false,
    }
}

/// The thread's name, if it still exists.
pub fn read_comm(pid: u32, tid: u32) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/comm"))
        .ok()
        .map(|s| s.trim_end().to_owned())
}

/// The path of the `libnccl.so*` file `pid` maps, if any (as the process
/// sees it, through /proc/PID/root so containers work).
pub fn nccl_library(pid: u32) -> Option<PathBuf> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).ok()?;
    maps.lines().find_map(|line| {
        let path = line.split_whitespace().nth(5)?;
        let file = path.rsplit('/').next()?;
        file.starts_with("libnccl.so")
            .then(|| PathBuf::from(format!("/proc/{pid}/root{path}")))
    })
}

fn all_pids() -> Vec<u32> {
    std::fs::read_dir("/proc")
        .map(|dir| {
            dir.flatten()
                .filter_map(|e| e.file_name().to_str()?.parse().ok())
                .collect()
        })
        .unwrap_or_default()
}

fn cgroup_of(pid: u32) -> Option<String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    // cgroup v2: the line "0::/path".
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_end().to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_this_process_by_pid_comm_and_cgroup() {
        let me = std::process::id();
        assert_eq!(FixedPids(vec![me]).pids(), vec![me]);
        let comm = read_comm(me, me).unwrap();
        assert!(ByComm(comm).pids().contains(&me));
        if let Some(cg) = cgroup_of(me) {
            assert!(ByCgroup(cg).pids().contains(&me));
        }
        assert!(FixedPids(vec![99_999_999]).pids().is_empty());
    }

    #[test]
    fn no_nccl_in_the_test_binary() {
        assert_eq!(nccl_library(std::process::id()), None);
    }
}
