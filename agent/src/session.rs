//! `session`: one running agent pipeline shared by the commands: the node
//! lock, the probes, the ring buffer on tokio, discovery of what to watch,
//! (fixed pids, names, cgroups, and the jobs found through their control
//! sockets), and the model fed from both.
//!
//! It prints nothing: the commands (`watch`, `top`) decide what to show.

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use aya::maps::{MapData, RingBuf};
use clap::Args;
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::signal::unix::{Signal, SignalKind, signal};

use crate::discovery::{self, ByCgroup, ByComm, Discovery, FixedPids, GpuPids};
use crate::events::decode;
use crate::gpu::Gpus;
use crate::jobs::launched::{self, NodeScope};
use crate::jobs::{JobPids, JobTimeline, Jobs, JobsConfig, LaunchDiscovery};
use crate::lock::{AgentLock, DEFAULT_LOCK_FILE};
use crate::model::Model;
use crate::probes::{ProbeConfig, ProbeSet, Probes};
use crate::thread_store::ThreadStateStore;

/// What to watch and how much to keep: shared by every command.
#[derive(Debug, Clone, Args)]
pub struct TargetArgs {
    /// Process to watch (all its threads); repeat or comma-separate.
    #[arg(
        long = "pid",
        value_name = "PID",
        env = "RINGWATCH_PID",
        value_delimiter = ','
    )]
    pub pids: Vec<u32>,

    /// Watch every process with this name (its `comm`, 15 bytes at most);
    /// new ones are picked up within a second.
    #[arg(long, value_name = "NAME")]
    pub comm: Vec<String>,

    /// Watch every process in this cgroup v2 (path as in /proc/PID/cgroup,
    /// e.g. `/system.slice/job.service`), sub-cgroups included.
    #[arg(long, value_name = "PATH")]
    pub cgroup: Vec<String>,

    /// Also watch the local ranks of every job found through its control
    /// socket in --runtime-dir (and the fallback dirs). On by default,
    /// except for the one-shot `watch --pid` mode.
    #[arg(long, overrides_with = "no_jobs")]
    pub jobs: bool,

    /// Do not look for jobs' control sockets.
    #[arg(long, overrides_with = "jobs")]
    pub no_jobs: bool,

    /// Also find the training jobs that do not run on ringwatch's runtime
    /// (torchrun, env:// jobs, MPI, Slurm's srun, Horovod) from the
    /// variables their launcher set in each process's environment: only
    /// those variables are read (docs/guide/jobs.md lists them and the
    /// rules). On whenever jobs are watched.
    #[arg(long, overrides_with = "no_launchers")]
    pub launchers: bool,

    /// Find jobs only through their control sockets.
    #[arg(long, overrides_with = "launchers")]
    pub no_launchers: bool,

    /// Count as this node's only the processes in this network namespace
    /// (`/run/netns/NAME`, `/proc/PID/ns/net`), when finding jobs from
    /// launcher variables: for pretend nodes that share one kernel. Default:
    /// every process of the kernel is this node's.
    #[arg(long, value_name = "PATH", env = "RINGWATCH_NODE_NETNS")]
    pub node_netns: Option<PathBuf>,

    /// This node's name: the host of the ranks found from launcher variables,
    /// and the node cluster answers name (a DaemonSet passes
    /// `spec.nodeName`). Default: the host name.
    #[arg(long, env = "RINGWATCH_NODE_NAME")]
    pub node_name: Option<String>,

    /// Also watch the compute processes NVML lists on this node's GPUs
    /// (they join the watched set within a second). On by default whenever
    /// jobs are watched; finds nothing without an NVIDIA driver.
    #[arg(
        long,
        overrides_with = "no_gpu_processes",
        env = "RINGWATCH_GPU_PROCESSES"
    )]
    pub gpu_processes: bool,

    /// Do not watch GPU compute processes (not even with --jobs).
    #[arg(long, overrides_with = "gpu_processes")]
    pub no_gpu_processes: bool,

    /// Where jobs put their control sockets (`<job_id>.sock`). The agent
    /// creates it if missing: root's agent as mode 1777 like /tmp (every
    /// user's jobs may add a socket, none may remove another's). It is
    /// refused, with a logged reason, if another user owns it or others may
    /// write to it without the sticky bit.
    #[arg(long, value_name = "DIR", env = "RINGWATCH_RUNTIME_DIR", default_value_os_t = collectives::control::default_runtime_dir())]
    pub runtime_dir: PathBuf,

    /// More directories to scan for control sockets, e.g. the fallback
    /// `/tmp/ringwatch-<uid>` of a user whose jobs start before the agent;
    /// each is checked as --runtime-dir is (never created).
    #[arg(
        long,
        value_name = "DIR",
        env = "RINGWATCH_ALSO_SCAN",
        value_delimiter = ','
    )]
    pub also_scan: Vec<PathBuf>,

    /// How long to keep per-thread and per-connection series in memory.
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration, env = "RINGWATCH_RETENTION")]
    pub retention: Duration,

    /// When jobs stream their tensor timeline (negotiate, queue, allreduce
    /// per tensor) to the agent: `on-demand` while someone reads it (a
    /// timeline request in the last minute; the viewer asks every second),
    /// `always` to keep its history from the start. Streaming costs the job:
    /// 4-rank collbench resnet50 on 2 cores ran ~13% slower with `always`
    /// (README, "Using the agent"). Cycle statistics always stream.
    #[arg(
        long,
        value_enum,
        default_value = "on-demand",
        env = "RINGWATCH_JOB_TIMELINE"
    )]
    pub job_timeline: JobTimeline,

    /// Scheduling intervals (on CPU, waiting for one, blocked) shorter than
    /// this stay in the kernel: their time and number are added up per
    /// thread (so CPU %, run-queue time and the totals still count them;
    /// `watch` also keeps them in histograms), but they are not sent one
    /// by one, so they are not on the timeline. A job that trades cores
    /// every few µs makes one record per switch otherwise: `0s` sends every
    /// interval, at about twice what watching costs the job.
    #[arg(long, default_value = "50us", value_parser = humantime::parse_duration, env = "RINGWATCH_MIN_INTERVAL")]
    pub min_interval: Duration,

    /// At most this many intervals per thread per second leave the
    /// kernel (0: no limit); the rest are counted (and, in `watch`, in the
    /// kernel's histograms).
    #[arg(long, default_value_t = 0, env = "RINGWATCH_MAX_INTERVAL_RATE")]
    pub max_interval_rate: u32,

    /// Where the kernel keeps each watched thread's scheduling state, which
    /// every context switch of the job reads and writes: `slots`, an array
    /// with a slot per thread id (cheapest, any kernel; see
    /// --thread-slots), `task-storage` on the task itself (the agent reads
    /// it back by a pidfd of the thread, Linux 6.9 or later), `hash-map`
    /// keyed by thread id (any kernel).
    #[arg(
        long,
        value_enum,
        default_value = "slots",
        env = "RINGWATCH_THREAD_STATE"
    )]
    pub thread_state: ThreadStateStore,

    /// Slots of the thread-state array (`--thread-state slots`), a power of
    /// two, 128 bytes each: a thread's slot is its id modulo this, and a
    /// thread whose slot another live thread holds is kept in a hash map
    /// instead (a little slower). The default, 65536 (8 MiB), gives every
    /// thread its own slot where /proc/sys/kernel/pid_max is at most that.
    #[arg(
        long,
        default_value_t = crate::thread_store::DEFAULT_THREAD_SLOTS,
        value_parser = crate::thread_store::parse_thread_slots,
        env = "RINGWATCH_THREAD_SLOTS"
    )]
    pub thread_slots: u32,

    /// Which probe groups to attach (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "sched,tcp,nccl",
        env = "RINGWATCH_PROBES"
    )]
    pub probes: Vec<ProbeSet>,

    /// At most this many intervals (and NCCL calls) kept per thread.
    #[arg(long, default_value_t = 100_000)]
    pub max_intervals_per_thread: usize,

    /// Scheduling intervals kept in memory over all threads, in MiB (past
    /// it the busiest threads forget their oldest first; the kernel's
    /// totals and histograms are not affected).
    #[arg(long, default_value_t = 64, env = "RINGWATCH_MAX_INTERVAL_MIB", value_parser = clap::value_parser!(u32).range(1..=65_536))]
    pub max_interval_mib: u32,

    /// The node-wide lock that keeps a second agent from attaching twice.
    #[arg(long, default_value = DEFAULT_LOCK_FILE, env = "RINGWATCH_LOCK_FILE")]
    pub lock_file: PathBuf,
}

impl TargetArgs {
    /// Whether to watch jobs found through control sockets: `--jobs` or
    /// `--no-jobs` if given, else `default`.
    pub fn watch_jobs(&self, default: bool) -> bool {
        if self.no_jobs {
            false
        } else {
            self.jobs || default
        }
    }

    /// This node's name (`--node-name`, else the host name).
    pub fn node_name(&self) -> String {
        self.node_name
            .clone()
            .filter(|n| !n.trim().is_empty())
            .unwrap_or_else(crate::jobs::host_name)
    }

    /// Whether to watch GPU compute processes: `--gpu-processes` or
    /// `--no-gpu-processes` if given, else whether jobs are watched.
    pub fn watch_gpu_processes(&self, jobs_watched: bool) -> bool {
        !self.no_gpu_processes && (self.gpu_processes || jobs_watched)
    }
}

/// CLOCK_MONOTONIC in ns (`observe::model`'s, used across the agent).
pub use crate::model::monotonic_ns;

/// Starts the registry of jobs found through control sockets in
/// `--runtime-dir` (and the fallback directories).
pub fn start_jobs(args: &TargetArgs) -> Result<Jobs> {
    if let Err(why) = crate::trust::ensure_runtime_dir(&args.runtime_dir, crate::trust::agent_uid())
    {
        // Not fatal: the directory may be fixed (or created) while the agent
        // runs; every scan checks it again.
        tracing::warn!(dir = %args.runtime_dir.display(), why, "the runtime directory is not usable now");
    }
    let mut dirs = vec![args.runtime_dir.clone()];
    dirs.extend(args.also_scan.iter().cloned());
    let mut config = JobsConfig::new(dirs, args.retention);
    config.job_timeline = args.job_timeline;
    if !args.no_launchers {
        let scope = match &args.node_netns {
            None => NodeScope::Kernel,
            Some(path) => {
                NodeScope::NetNamespace(launched::netns_inode(path).with_context(|| {
                    format!("--node-netns {}: not a network namespace", path.display())
                })?)
            }
        };
        config.launchers = Some(LaunchDiscovery {
            node_name: args.node_name(),
            scope,
            proc_root: PathBuf::from("/proc"),
        });
    }
    Jobs::start(config).context("starting the control-socket scanner thread")
}

/// How often the ring buffer is drained without a wakeup from the kernel (which comes
/// once 256 KiB wait). Every drain wakes the agent, and on a machine whose cores the job
/// fills, a wakeup takes a core from a rank that the others may be waiting for: at 10 ms
/// the watched 4-rank collbench job ran ~4% slower, at 100 ms ~2%. The live view lags
/// 250 ms behind and the tuning feed reads 4 times a second, so 100 ms is soon enough.
const DRAIN_PERIOD: Duration = Duration::from_millis(100);

/// Why a session's loop stopped early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stop {
    /// SIGINT.
    Interrupted,
    /// SIGTERM.
    Terminated,
}

/// A running pipeline.
pub struct Session {
    _lock: AgentLock,
    probes: Probes,
    ring: AsyncFd<RingBuf<MapData>>,
    // Both signals are streams created once, at start: a fresh
    // `tokio::signal::ctrl_c()` per pump would miss a SIGINT that arrives
    // between two pumps (tokio's handler, installed by then, swallows it).
    sigint: Signal,
    sigterm: Signal,
    discovery: Discovery,
    jobs: Option<Jobs>,
    only_fixed_pids: Vec<u32>,
    watched: BTreeSet<u32>,
    names: BTreeMap<(u32, u32), String>,
    /// Everything seen.
    pub model: Model,
    /// Records decoded.
    pub events: u64,
    /// Records that could not be decoded.
    pub undecodable: u64,
}

impl Session {
    /// Takes the node lock, loads and attaches the probes, and starts
    /// watching what the arguments name; `jobs_by_default` says whether
    /// jobs found through control sockets are watched when neither `--jobs`
    /// nor `--no-jobs` is given; `histograms` whether the kernel fills
    /// per-thread histograms ([`Probes::histograms`]; they cost a hash
    /// lookup per switch, so only a caller that reports them asks).
    pub fn start(args: &TargetArgs, jobs_by_default: bool, histograms: bool) -> Result<Self> {
        let jobs = if args.watch_jobs(jobs_by_default) {
            Some(start_jobs(args)?)
        } else {
            None
        };
        Self::start_with_jobs(args, jobs, histograms)
    }

    /// Like [`Session::start`], with the jobs registry made by the caller
    /// (`serve` keeps it running, for tuning, also when eBPF cannot load).
    pub fn start_with_jobs(
        args: &TargetArgs,
        jobs: Option<Jobs>,
        histograms: bool,
    ) -> Result<Self> {
        let mut discovery = Discovery::default();
        if !args.pids.is_empty() {
            for &pid in &args.pids {
                if !discovery::process_exists(pid) {
                    bail!("no process with pid {pid} (is it running, and in this PID namespace?)");
                }
            }
            discovery.add(Box::new(FixedPids(args.pids.clone())));
        }
        for name in &args.comm {
            discovery.add(Box::new(ByComm(name.clone())));
        }
        for path in &args.cgroup {
            discovery.add(Box::new(ByCgroup(path.clone())));
        }
        if let Some(jobs) = &jobs {
            discovery.add(Box::new(JobPids::new(jobs.clone())));
        }
        let gpu_processes = args.watch_gpu_processes(jobs.is_some());
        if gpu_processes {
            discovery.add(Box::new(GpuPids(Gpus::shared())));
        }
        if discovery.is_empty() {
            bail!(
                "nothing to watch: give --pid PID, --comm NAME, --cgroup PATH or --jobs (see --help)"
            );
        }
        let only_fixed_pids =
            if args.comm.is_empty() && args.cgroup.is_empty() && jobs.is_none() && !gpu_processes {
                args.pids.clone()
            } else {
                Vec::new()
            };
        let lock = AgentLock::acquire(&args.lock_file)?;
        tracing::debug!(lock = %lock.path().display(), "holding the agent lock");
        let min_interval_ns = u64::try_from(args.min_interval.as_nanos()).unwrap_or(u64::MAX);
        let mut probes = Probes::load(ProbeConfig {
            sets: args.probes.clone(),
            min_interval_ns,
            max_intervals_per_s: args.max_interval_rate,
            histograms,
            thread_state: args.thread_state,
            thread_slots: args.thread_slots,
        })?;
        let ring = probes.take_events()?;
        // SAFETY: the RingBuf owns its map's file descriptor, which stays
        // open and unchanged until the RingBuf (inside the AsyncFd) is dropped.
        let ring = unsafe { AsyncFd::register_with_interest(ring, Interest::READABLE) }
            .map_err(std::io::Error::from)
            .context("registering the ring buffer with tokio")?;
        let sigint = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let sigterm = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let retention_ns = u64::try_from(args.retention.as_nanos()).unwrap_or(u64::MAX);
        let mut session = Self {
            _lock: lock,
            probes,
            ring,
            sigint,
            sigterm,
            discovery,
            jobs,
            only_fixed_pids,
            watched: BTreeSet::new(),
            names: BTreeMap::new(),
            model: Model::new(retention_ns, args.max_intervals_per_thread)
                .with_interval_budget(args.max_interval_mib as usize * (1 << 20)),
            events: 0,
            undecodable: 0,
        };
        session.refresh()?;
        Ok(session)
    }

    /// What is watched, for the "watching …" line.
    pub fn describe(&self) -> String {
        let pids: Vec<String> = self.watched.iter().map(u32::to_string).collect();
        let what = if pids.is_empty() {
            "no process yet".to_owned()
        } else {
            format!("pid {}", pids.join(","))
        };
        format!("{what} ({})", self.discovery.describe())
    }

    /// The jobs found through control sockets, when they are watched.
    pub fn jobs(&self) -> Option<&Jobs> {
        self.jobs.as_ref()
    }

    /// Processes watched now.
    pub fn watched(&self) -> &BTreeSet<u32> {
        &self.watched
    }

    /// True when the only targets are fixed pids and all have exited.
    pub fn all_fixed_targets_exited(&self) -> bool {
        !self.only_fixed_pids.is_empty()
            && self
                .only_fixed_pids
                .iter()
                .all(|&p| !discovery::process_exists(p))
    }

    /// Rescans the targets (watch/unwatch), attaches NCCL probes where
    /// libnccl.so appeared, reads the kernel's traffic tables into the
    /// model, and prunes it.
    pub fn refresh(&mut self) -> Result<()> {
        self.rescan()?;
        for &pid in &self.watched {
            // Reading /proc/PID/maps costs a few % of the agent per process
            // each second: only while it could still lead to an attach.
            if self.probes.nccl_wanted(pid)
                && let Some(library) = discovery::nccl_library(pid)
                && let Err(error) = self.probes.attach_nccl(pid, &library)
            {
                tracing::warn!(
                    pid,
                    error = format!("{error:#}"),
                    "NCCL uprobes not attached"
                );
            }
        }
        self.poll_maps();
        let forgotten = self.model.prune(monotonic_ns());
        self.probes.forget_threads(&forgotten);
        if !forgotten.is_empty() {
            // Names live as long as the model remembers their threads (a job
            // that starts threads all day must not grow this map all day).
            let forgotten: BTreeSet<u32> = forgotten.into_iter().collect();
            self.names.retain(|(_, tid), _| !forgotten.contains(tid));
        }
        Ok(())
    }

    /// Only the first step of [`Session::refresh`]: starts watching new targets, stops
    /// watching those that exited, and learns new threads' names. Cheaper (no kernel map walks, no reading of every
    /// watched process's maps), for callers that want new processes picked up quickly.
    pub fn rescan(&mut self) -> Result<()> {
        let wanted = self.discovery.scan();
        for &pid in wanted.difference(&self.watched.clone()) {
            self.probes.watch(pid)?;
            self.watched.insert(pid);
            tracing::debug!(pid, "watching");
        }
        let gone: Vec<u32> = self
            .watched
            .iter()
            .copied()
            .filter(|p| !wanted.contains(p) && !discovery::process_exists(*p))
            .collect();
        for pid in gone {
            self.probes.unwatch(pid)?;
            self.watched.remove(&pid);
        }
        // Names of threads first seen since: read now, while they still exist (a
        // short-lived thread is gone by the next full refresh).
        self.learn_names();
        Ok(())
    }

    /// Reads only the kernel's per-thread scheduling state into the model
    /// (switch counts, where each thread is, the time of its intervals
    /// that stayed in the kernel): cheaper than [`Session::poll_maps`], for
    /// readers that need those figures more often than once a second.
    pub fn poll_thread_states(&mut self) {
        let now = monotonic_ns();
        let known = self
            .watched
            .iter()
            .map(|&pid| (pid, self.model.tids(pid)))
            .collect();
        let states = self.probes.thread_states(&self.watched, &known);
        self.model.update_thread_states(now, &states);
    }

    /// Reads the kernel's aggregate maps into the model: per-thread
    /// scheduling state and switch counts (of watched processes only: a
    /// process no longer watched keeps its last figures), TCP traffic,
    /// connections.
    pub fn poll_maps(&mut self) {
        self.poll_thread_states();
        let now = monotonic_ns();
        let net = self.probes.thread_net();
        self.model.update_thread_net(now, &net);
        let socks = self.probes.sockets();
        self.model.update_sockets(&socks);
    }

    /// Processes ring-buffer records until `until`, or a signal. The kernel
    /// wakes us only when a batch is waiting, so we also drain on a short
    /// timer.
    pub async fn pump(&mut self, until: tokio::time::Instant) -> Result<Option<Stop>> {
        let mut tick = tokio::time::interval(DRAIN_PERIOD);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                () = tokio::time::sleep_until(until) => {
                    self.drain_now();
                    return Ok(None);
                }
                _ = tick.tick() => self.drain_now(),
                _ = self.sigint.recv() => return Ok(Some(Stop::Interrupted)),
                _ = self.sigterm.recv() => return Ok(Some(Stop::Terminated)),
                guard = self.ring.readable_mut() => {
                    let mut guard = guard.context("waiting on the ring buffer")?;
                    drain(guard.get_inner_mut(), &mut self.model, &mut self.events, &mut self.undecodable);
                    guard.clear_ready();
                }
            }
        }
    }

    /// Processes every record already in the ring buffer.
    pub fn drain_now(&mut self) {
        drain(
            self.ring.get_mut(),
            &mut self.model,
            &mut self.events,
            &mut self.undecodable,
        );
    }

    /// The probes (counters, histograms).
    pub fn probes(&self) -> &Probes {
        &self.probes
    }

    /// A thread's name, remembered while it lived.
    pub fn thread_name(&self, pid: u32, tid: u32) -> String {
        self.names
            .get(&(pid, tid))
            .cloned()
            .or_else(|| discovery::read_comm(pid, tid))
            .or_else(|| self.model.exited_name(tid).map(str::to_owned))
            .unwrap_or_else(|| "(exited)".to_owned())
    }

    fn learn_names(&mut self) {
        for pid in self.model.pids() {
            for tid in self.model.tids(pid) {
                if let std::collections::btree_map::Entry::Vacant(slot) =
                    self.names.entry((pid, tid))
                    && let Some(name) = discovery::read_comm(pid, tid)
                {
                    slot.insert(name);
                }
            }
        }
    }

    /// Stops watching everything; the programs detach when the session drops.
    pub fn detach(mut self) -> Result<()> {
        for pid in std::mem::take(&mut self.watched) {
            self.probes.unwatch(pid)?;
        }
        Ok(())
    }
}

fn drain(ring: &mut RingBuf<MapData>, model: &mut Model, events: &mut u64, undecodable: &mut u64) {
    while let Some(item) = ring.next() {
        match decode(&item) {
            Ok(event) => {
                *events += 1;
                model.record(&event);
            }
            Err(error) => {
                *undecodable += 1;
                tracing::warn!(%error, "skipping a ring-buffer record");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        targets: TargetArgs,
    }

    fn parse(args: &[&str]) -> TargetArgs {
        Cli::parse_from(std::iter::once("ringwatch-agent").chain(args.iter().copied())).targets
    }

    #[test]
    fn jobs_are_watched_by_the_mode_default_unless_a_flag_says_otherwise() {
        assert!(parse(&[]).watch_jobs(true));
        assert!(!parse(&["--pid", "1"]).watch_jobs(false));
        assert!(parse(&["--pid", "1", "--jobs"]).watch_jobs(false));
        assert!(!parse(&["--no-jobs"]).watch_jobs(true));
        // The last of the two flags wins.
        assert!(parse(&["--no-jobs", "--jobs"]).watch_jobs(false));
        assert!(!parse(&["--jobs", "--no-jobs"]).watch_jobs(true));
        // GPU compute processes follow the jobs unless a flag says otherwise.
        assert!(parse(&[]).watch_gpu_processes(true));
        assert!(!parse(&[]).watch_gpu_processes(false));
        assert!(parse(&["--gpu-processes"]).watch_gpu_processes(false));
        assert!(!parse(&["--no-gpu-processes"]).watch_gpu_processes(true));
        assert!(!parse(&["--gpu-processes", "--no-gpu-processes"]).watch_gpu_processes(true));
        let dir = parse(&["--runtime-dir", "/srv/jobs"]).runtime_dir;
        assert_eq!(dir, PathBuf::from("/srv/jobs"));
    }
}
