//! `jobs`: finds the collective jobs on this node through their control
//! sockets (`<runtime dir>/<job_id>.sock`, the `collectives::control`
//! protocol) and keeps a bounded registry of them: each job's `hello` (ranks,
//! hosts, pids, knobs), whether it is still connected, its last per-cycle
//! statistics and a ring of its timeline events.
//!
//! It only observes: it subscribes and reads, and never sends knobs. It must
//! never crash, hang or block a tokio worker because of what it finds in the
//! runtime directory: all client I/O runs on its own threads with timeouts,
//! and a socket that is not a job's (or answers garbage) is logged once and
//! skipped. It believes only what the kernel proves (`trust`): directories
//! that no other user can tamper with, sockets served by their owner, and of
//! a job's ranks only the processes of the job's own user. Memory stays
//! bounded: the number of jobs (in all and per user), the sockets tried per
//! scan, and each job's stats and events, in count and in bytes; lost jobs
//! are forgotten after the retention window.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use collectives::control::{
    AutotuneState, ControlClient, ControlError, CycleStats, Knobs, PeerCredentials, RankInfo,
    ServerMessage, StallReport, TimelineEvent,
};
use serde::Serialize;

pub mod launched;
pub mod trust;

pub use launched::JobKind;

use crate::containers;
use crate::discovery::{self, PidSource};

#[cfg(test)]
#[path = "../../tests/common/procs.rs"]
mod test_procs;

/// What a job's socket name has between its id and random part when the job
/// took an alternate name (`collectives`' runtime does; see the trust model).
pub const ALTERNATE_MARK: &str = ".taken-";

/// How the registry looks for jobs and how much it keeps.
#[derive(Debug, Clone)]
pub struct JobsConfig {
    /// Directories scanned for `*.sock`, in order (the first socket of a job
    /// id wins): only the ones the operator configured; each is checked
    /// ([`trust::check_runtime_dir`]) on every scan.
    pub runtime_dirs: Vec<PathBuf>,
    /// Time between two scans of the directories.
    pub scan_period: Duration,
    /// Limit on connecting and reading `hello`, and on each read after it.
    pub connect_timeout: Duration,
    /// How long a lost job stays in the registry.
    pub retention: Duration,
    /// Per-cycle statistics kept per job (the newest).
    pub max_stats_per_job: usize,
    /// Timeline events kept per job (the newest).
    pub max_timeline_events_per_job: usize,
    /// Bytes of timeline events kept per job (the newest), as they sit in
    /// memory.
    pub max_timeline_bytes_per_job: usize,
    /// Jobs connected at once; more sockets are refused until one ends.
    pub max_jobs: usize,
    /// Jobs connected at once served by one non-root user.
    pub max_jobs_per_user: usize,
    /// New sockets tried in one scan of one directory (each may take up to
    /// `connect_timeout`); the rest wait for the next scans.
    pub max_connects_per_scan: usize,
    /// When jobs stream their tensor timeline (see [`JobTimeline`]).
    pub job_timeline: JobTimeline,
    /// With [`JobTimeline::OnDemand`]: how long a read of a job's timeline
    /// keeps the jobs streaming it.
    pub timeline_interest: Duration,
    /// Also find jobs from their launchers' environment variables
    /// ([`launched`]); `None`: only jobs with a control socket.
    pub launchers: Option<LaunchDiscovery>,
}

/// How jobs are found from their launchers' variables.
#[derive(Debug, Clone)]
pub struct LaunchDiscovery {
    /// The host name given to this node's ranks of such jobs (the agent's
    /// node name: agents of a cluster then agree on where each rank runs).
    pub node_name: String,
    /// Which processes are this node's.
    pub scope: launched::NodeScope,
    /// Where processes are listed (`/proc`).
    pub proc_root: PathBuf,
}

/// When the agent asks jobs for their tensor timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum JobTimeline {
    /// From the moment a job is found: its history is there when someone
    /// looks, at the cost of building and sending every event.
    Always,
    /// While someone reads job timelines (and for `timeline_interest`
    /// after): a job nobody looks at sends only its cycle statistics.
    OnDemand,
}

impl JobsConfig {
    /// Scans `runtime_dirs` (in order), once a second. Nothing else: the
    /// fallback directories an unprivileged job may use when the runtime
    /// directory is not writable (`/tmp/ringwatch-<uid>`) can be created by
    /// any user, so they are scanned only when the operator names them.
    pub fn new(runtime_dirs: Vec<PathBuf>, retention: Duration) -> Self {
        let mut unique = Vec::new();
        for dir in runtime_dirs {
            if !unique.contains(&dir) {
                unique.push(dir);
            }
        }
        Self {
            runtime_dirs: unique,
            scan_period: Duration::from_secs(1),
            connect_timeout: Duration::from_millis(500),
            retention,
            max_stats_per_job: 1_000,
            max_timeline_events_per_job: 100_000,
            max_timeline_bytes_per_job: 16 << 20,
            max_jobs: 64,
            max_jobs_per_user: 8,
            max_connects_per_scan: 16,
            job_timeline: JobTimeline::OnDemand,
            timeline_interest: Duration::from_secs(60),
            launchers: None,
        }
    }
}

/// Whether the agent still talks to a job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// The control connection is open and being read.
    Connected,
    /// The socket disappeared or the connection broke; kept until the
    /// retention window has passed.
    Lost,
}

/// What the registry knows about one job, for the API and the commands.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct JobSnapshot {
    /// The job's id: from its `hello` for a ringwatch job; for a job found
    /// from its launcher's variables, `KIND/KEY/uidUID` (see [`launched`]).
    pub job_id: String,
    /// Who launched it: `ringwatch` (found through its control socket) or
    /// the launcher whose variables its processes carry.
    #[serde(default)]
    pub kind: JobKind,
    /// For a ringwatch job: the launcher whose variables its ranks also
    /// carry (the job is listed once, as a ringwatch job).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub launched_by: Option<JobKind>,
    /// The control socket it was found at (none for other kinds).
    #[serde(default, skip_serializing_if = "path_is_empty")]
    pub socket: PathBuf,
    /// The protocol version the job speaks.
    pub protocol_version: u32,
    /// Number of ranks.
    pub world_size: usize,
    /// Ranks per node (rank 0's node).
    pub local_size: usize,
    /// Every rank: rank, local rank, host and pid. The pids of this node's
    /// ranks are host pids (the agent's pid namespace): a rank in a container
    /// reports its own namespace's pid, which the registry maps (`ns_pids`
    /// keeps what it said); 0 for a local rank that could not be mapped (not
    /// watched). Other hosts' pids are as they reported them.
    pub ranks: Vec<RankInfo>,
    /// The host this socket speaks for (its ranks run on this node).
    pub host: String,
    /// The rank that serves this socket (0: the socket that holds the job's
    /// tuning claim; another: this node's first rank of a multi-node job).
    pub served_by_rank: usize,
    /// The pids the local ranks reported, where they differ from their host
    /// pids (ranks in a container's pid namespace): rank -> reported pid.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub ns_pids: BTreeMap<usize, u32>,
    /// The knobs in force, as last reported (ringwatch jobs only: other
    /// kinds have none that ringwatch knows).
    pub knobs: Option<Knobs>,
    /// The last cycle the job reported.
    pub cycle: u64,
    /// Whether the job asked to be tuned, as its `hello` said when the
    /// registry connected (tuning sessions run on their own connections).
    pub autotune: AutotuneState,
    /// Connected or lost.
    pub state: JobState,
    /// Why it was lost, when it is.
    pub lost_reason: Option<String>,
    /// When the job last said anything, milliseconds since the Unix epoch.
    pub last_seen_unix_ms: u64,
    /// Per-cycle statistics received in all.
    pub stats_received: u64,
    /// Timeline events received in all.
    pub timeline_events_received: u64,
    /// Timeline events pushed out of the bounded ring.
    pub timeline_events_dropped: u64,
    /// Bytes the kept timeline events take in the agent's memory.
    pub timeline_bytes: usize,
    /// Since when (Unix ms) the job streams its tensor timeline to this
    /// agent; `None` while it does not (`--job-timeline on-demand` and no
    /// timeline request in the last minute): its events start there.
    pub timeline_streaming_since_unix_ms: Option<u64>,
    /// The uid of the process that serves the control socket (`SO_PEERCRED`):
    /// of the job's ranks, only processes of this user are watched (any, for root).
    pub owner_uid: u32,
    /// The pid of that process, in the agent's pid namespace.
    pub owner_pid: u32,
    /// Set when another user's socket claims this job's id, or when one job
    /// runs under an alternate name (`<id>.taken-…`) because another user
    /// holds its name: which, and whose.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conflict: Option<String>,
    /// Another user's socket claims this very id: the id names neither job
    /// for sure, so it is not tuned.
    #[serde(skip)]
    pub id_claimed_twice: bool,
    /// Jobs found from launcher variables: the launcher processes on this
    /// node (torchrun's agent, `mpirun`, `prted`), which are not ranks.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub launcher_pids: Vec<u32>,
    /// Jobs found from launcher variables: each local rank's child processes
    /// in the job (data-loader workers), watched as part of their rank.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub rank_children: BTreeMap<usize, Vec<u32>>,
    /// Jobs found from launcher variables: processes of the job whose rank
    /// their environment does not say (or that claim a rank another holds).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unknown_rank_pids: Vec<u32>,
    /// A ringwatch job that is stalled: what rank 0's stall check last said
    /// (the tensors some ranks enqueued and others not, and which ranks are
    /// missing from each). Absent while the job makes progress.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stall: Option<StallReport>,
}

fn path_is_empty(path: &Path) -> bool {
    path.as_os_str().is_empty()
}

struct Job {
    socket: PathBuf,
    socket_inode: u64,
    protocol_version: u32,
    world_size: usize,
    local_size: usize,
    ranks: Vec<RankInfo>,
    host: String,
    served_by_rank: usize,
    ns_pids: BTreeMap<usize, u32>,
    knobs: Knobs,
    cycle: u64,
    autotune: AutotuneState,
    state: JobState,
    lost_reason: Option<String>,
    lost_at: Option<Instant>,
    last_seen: SystemTime,
    stats: VecDeque<CycleStats>,
    stats_received: u64,
    timeline: VecDeque<TimelineEvent>,
    timeline_events_received: u64,
    timeline_events_dropped: u64,
    timeline_bytes: usize,
    timeline_streaming_since: Option<SystemTime>,
    owner: PeerCredentials,
    /// Tells this connection's reader thread to stop.
    stop_reader: Arc<AtomicBool>,
    /// Distinguishes this connection from an earlier one of the same job id.
    connection: u64,
    /// Another user's socket that claims the same job id (its path, its
    /// serving uid and pid), while its file is there.
    claimed_also_by: Option<(PathBuf, u32, u32)>,
    /// Rank 0's last stall report while the job is stalled.
    stall: Option<StallReport>,
}

impl Job {
    /// A stall report from the job: kept while it names stalled tensors, and
    /// logged when the job becomes stalled, when what it waits for changes,
    /// and when it moves again.
    fn stall_changed(&mut self, job_id: &str, report: StallReport) {
        if report.stalled.is_empty() {
            if self.stall.take().is_some() {
                tracing::info!(job_id, "the job is no longer stalled");
            }
            return;
        }
        let summary: Vec<String> = report
            .stalled
            .iter()
            .take(4)
            .map(|t| {
                format!(
                    "{} '{}' missing ranks {:?}",
                    t.kind, t.name, t.missing_ranks
                )
            })
            .collect();
        tracing::warn!(
            job_id,
            tensors = report.stalled.len(),
            "the job is stalled: {}{}",
            summary.join("; "),
            if report.stalled.len() > 4 {
                "; …"
            } else {
                ""
            }
        );
        self.stall = Some(report);
    }

    fn snapshot(&self, job_id: &str) -> JobSnapshot {
        JobSnapshot {
            job_id: job_id.to_owned(),
            kind: JobKind::Ringwatch,
            launched_by: None,
            socket: self.socket.clone(),
            protocol_version: self.protocol_version,
            world_size: self.world_size,
            local_size: self.local_size,
            ranks: self.ranks.clone(),
            host: self.host.clone(),
            served_by_rank: self.served_by_rank,
            ns_pids: self.ns_pids.clone(),
            knobs: Some(self.knobs),
            cycle: self.cycle,
            autotune: self.autotune,
            state: self.state,
            lost_reason: self.lost_reason.clone(),
            last_seen_unix_ms: self
                .last_seen
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            stats_received: self.stats_received,
            timeline_events_received: self.timeline_events_received,
            timeline_events_dropped: self.timeline_events_dropped,
            timeline_bytes: self.timeline_bytes,
            timeline_streaming_since_unix_ms: self.timeline_streaming_since.map(|t| {
                t.duration_since(UNIX_EPOCH)
                    .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
            }),
            owner_uid: self.owner.uid,
            owner_pid: self.owner.pid,
            conflict: self
                .claimed_also_by
                .as_ref()
                .filter(|(path, _, _)| path.exists())
                .map(|(path, uid, pid)| {
                    format!(
                        "job id {job_id:?} is also claimed by uid {uid} (pid {pid}) at {}",
                        path.display()
                    )
                }),
            id_claimed_twice: self
                .claimed_also_by
                .as_ref()
                .is_some_and(|(path, _, _)| path.exists()),
            launcher_pids: Vec::new(),
            rank_children: BTreeMap::new(),
            unknown_rank_pids: Vec::new(),
            stall: self.stall.clone(),
        }
    }

    /// Keeps `events` (the newest), within the job's count and byte bounds.
    fn keep_timeline(&mut self, events: Vec<TimelineEvent>, max_events: usize, max_bytes: usize) {
        self.timeline_events_received += events.len() as u64;
        for event in events {
            self.timeline_bytes += event_bytes(&event);
            self.timeline.push_back(event);
        }
        while self.timeline.len() > max_events || self.timeline_bytes > max_bytes {
            let Some(oldest) = self.timeline.pop_front() else {
                break;
            };
            self.timeline_bytes = self.timeline_bytes.saturating_sub(event_bytes(&oldest));
            self.timeline_events_dropped += 1;
        }
    }

    fn lose(&mut self, reason: String) {
        if self.state == JobState::Connected {
            self.state = JobState::Lost;
            self.lost_reason = Some(reason);
            self.lost_at = Some(Instant::now());
            self.stop_reader.store(true, Ordering::Release);
        }
    }
}

/// What one timeline event takes in memory: the struct, its strings and
/// its arguments (with a B-tree node's share for each).
fn event_bytes(event: &TimelineEvent) -> usize {
    const PER_ARG: usize = 2 * std::mem::size_of::<String>() + 16;
    std::mem::size_of::<TimelineEvent>()
        + event.tensor.capacity()
        + event.activity.capacity()
        + event
            .args
            .iter()
            .map(|(k, v)| PER_ARG + k.capacity() + v.capacity())
            .sum::<usize>()
}

impl JobSnapshot {
    /// True when the job asked to be tuned and no one tunes it: its hello
    /// said `waiting` (RINGWATCH_AUTOTUNE=1) or `interrupted` (an earlier
    /// session broke off).
    pub fn wants_autotune(&self) -> bool {
        self.served_by_rank == 0
            && matches!(
                self.autotune,
                AutotuneState::Waiting | AutotuneState::Interrupted
            )
    }

    /// The ranks that run on this node (the socket's host), with host pids.
    pub fn local_ranks(&self) -> impl Iterator<Item = &RankInfo> {
        self.ranks.iter().filter(|r| r.host == self.host)
    }

    /// Every process of the job on this node, with its rank where known: the
    /// local ranks (those mapped to a host pid), their children, and the
    /// processes of unknown rank.
    pub fn local_processes(&self) -> impl Iterator<Item = (u32, Option<usize>)> + '_ {
        let ranks = self
            .local_ranks()
            .filter(|r| r.pid != 0)
            .map(|r| (r.pid, Some(r.rank)));
        let children = self
            .rank_children
            .iter()
            .flat_map(|(&rank, pids)| pids.iter().map(move |&pid| (pid, Some(rank))));
        let unknown = self.unknown_rank_pids.iter().map(|&pid| (pid, None));
        ranks.chain(children).chain(unknown)
    }

    /// Every host of the job, in rank order, each once.
    pub fn hosts(&self) -> Vec<&str> {
        // A set beside the list: a hello may name thousands of hosts.
        let mut seen = std::collections::BTreeSet::new();
        let mut hosts: Vec<&str> = Vec::new();
        for rank in &self.ranks {
            if seen.insert(rank.host.as_str()) {
                hosts.push(&rank.host);
            }
        }
        hosts
    }
}

/// Rewrites the pids of `hello`'s local ranks (those of its host) from the
/// socket server's pid namespace to ours: the ranks report `getpid()` in
/// their own namespace (a container's), and the kernel told us the server's
/// pid in ours (`SO_PEERCRED`). Returns the ranks and, for the ranks whose
/// pid changed, the pid they reported. A local rank that is not found in the
/// server's namespace gets pid 0 (never watched: its number may be another
/// process's here), with a log line.
fn map_local_pids(
    hello: &collectives::control::Hello,
    owner: PeerCredentials,
) -> (Vec<RankInfo>, BTreeMap<usize, u32>) {
    let mut ranks = hello.ranks.clone();
    let mut ns_pids = BTreeMap::new();
    match containers::in_our_pid_namespace(owner.pid) {
        Ok(true) => return (ranks, ns_pids),
        Ok(false) => {}
        // Gone or unreadable: the mapping below finds nothing, and no rank
        // is watched under a number that may be another process's here.
        Err(error) => {
            tracing::warn!(job_id = hello.job_id, owner_pid = owner.pid, %error,
                "cannot read the job's pid namespace");
        }
    }
    let map = containers::host_pids_in_namespace_of(owner.pid).unwrap_or_else(|error| {
        tracing::warn!(job_id = hello.job_id, owner_pid = owner.pid, %error,
            "cannot map the job's pids from its pid namespace");
        HashMap::new()
    });
    let host = hello.host();
    for rank in ranks.iter_mut().filter(|r| r.host == host) {
        let reported = rank.pid;
        let mapped = map.get(&reported).copied().unwrap_or(0);
        if mapped == 0 {
            tracing::warn!(
                job_id = hello.job_id,
                rank = rank.rank,
                pid = reported,
                "a rank's pid is not in its socket server's pid namespace: not watched"
            );
        }
        if mapped != reported {
            ns_pids.insert(rank.rank, reported);
            rank.pid = mapped;
        }
    }
    (ranks, ns_pids)
}

/// A socket that could not be used, remembered so it is logged once and not
/// retried on every scan.
struct Rejected {
    inode: u64,
    at: Instant,
}

/// New sockets of one owner tried per directory and scan.
const MAX_CONNECTS_PER_OWNER: usize = 4;

/// The most ranks a `hello` may list (each local one costs a /proc read per
/// scan of the watched set).
const MAX_RANKS: usize = 16_384;

/// Why a job's `hello` is not believed: its job id must be the socket's own
/// name (so a socket cannot speak for another job's id), and its rank list
/// bounded.
fn check_hello(path: &Path, hello: &collectives::control::Hello) -> Result<(), String> {
    let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
    if hello.job_id != stem {
        return Err(format!(
            "its hello says job {:?}, but a job's socket is named after its id",
            hello.job_id
        ));
    }
    if hello.ranks.len() > MAX_RANKS {
        return Err(format!(
            "its hello lists {} ranks (at most {MAX_RANKS})",
            hello.ranks.len()
        ));
    }
    Ok(())
}

/// Sockets that failed are retried this rarely (a job may have been starting).
const RETRY_REJECTED: Duration = Duration::from_secs(10);

/// A job found from its launcher's variables, as the registry keeps it.
struct Launched {
    job: launched::LaunchedJob,
    last_seen: SystemTime,
    lost_at: Option<Instant>,
}

impl Launched {
    fn snapshot(&self, node: &str) -> JobSnapshot {
        let job = &self.job;
        let local_size = job.ranks.len();
        let ranks: Vec<RankInfo> = job
            .ranks
            .iter()
            .enumerate()
            .map(|(i, (&rank, &(pid, local_rank, local)))| RankInfo {
                rank,
                local_rank: local_rank.unwrap_or(i),
                local_size: local.unwrap_or(local_size),
                host: node.to_owned(),
                pid,
            })
            .collect();
        let highest = job
            .ranks
            .keys()
            .next_back()
            .map_or(0, |&r| r.saturating_add(1));
        JobSnapshot {
            job_id: job.job_id.clone(),
            kind: job.kind,
            launched_by: None,
            socket: PathBuf::new(),
            protocol_version: 0,
            world_size: job.world_size.unwrap_or(0).max(highest),
            local_size,
            served_by_rank: job.ranks.keys().next().copied().unwrap_or(0),
            ranks,
            host: node.to_owned(),
            ns_pids: BTreeMap::new(),
            knobs: None,
            cycle: 0,
            autotune: AutotuneState::Off,
            state: if self.lost_at.is_some() {
                JobState::Lost
            } else {
                JobState::Connected
            },
            lost_reason: self
                .lost_at
                .map(|_| "its processes on this node are gone".to_owned()),
            last_seen_unix_ms: self
                .last_seen
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            stats_received: 0,
            timeline_events_received: 0,
            timeline_events_dropped: 0,
            timeline_bytes: 0,
            timeline_streaming_since_unix_ms: None,
            owner_uid: job.uid,
            owner_pid: job
                .launcher_pids
                .first()
                .or(job.ranks.values().map(|r| &r.0).next())
                .copied()
                .unwrap_or(0),
            conflict: (!job.notes.is_empty()).then(|| job.notes.join("; ")),
            id_claimed_twice: false,
            launcher_pids: job.launcher_pids.clone(),
            rank_children: job.children.clone(),
            unknown_rank_pids: job.unknown_rank_pids.clone(),
            stall: None,
        }
    }
}

#[derive(Default)]
struct Registry {
    jobs: BTreeMap<String, Job>,
    /// Jobs found from their launchers' variables, by id.
    launched: BTreeMap<String, Launched>,
    /// The scanner's count of unreadable environments that was last logged
    /// (rounded up to a power of two: a log line each time it doubles).
    launcher_unreadable_logged: usize,
    /// Launched jobs left out by the caps now, by id.
    launched_refused: std::collections::BTreeSet<String>,
    /// Launched jobs refused in all, and the count last logged (a line each
    /// time it doubles: a user who makes up ids cannot flood the log).
    launched_refused_total: u64,
    launched_refused_logged: u64,
    rejected: HashMap<PathBuf, Rejected>,
    /// Runtime directories refused by the last scan, and why (logged when
    /// the reason changes).
    refused_dirs: HashMap<PathBuf, String>,
    next_connection: u64,
}

impl Registry {
    /// Makes room for one more job of `uid` within the caps, which count
    /// lost jobs too (they keep their timeline for the retention window):
    /// the oldest lost job of that user (for the per-user cap) or of anyone
    /// (for the total) is forgotten first; `Err` when only connected jobs
    /// fill the cap.
    fn make_room(&mut self, config: &JobsConfig, uid: u32) -> Result<(), String> {
        let per_user = |registry: &Self| {
            registry
                .jobs
                .values()
                .filter(|j| j.owner.uid == uid)
                .count()
        };
        while uid != 0 && per_user(self) >= config.max_jobs_per_user {
            if !self.forget_oldest_lost(Some(uid)) {
                return Err(format!(
                    "uid {uid} already has {} jobs followed (the most per user)",
                    config.max_jobs_per_user
                ));
            }
        }
        while self.jobs.len() >= config.max_jobs {
            if !self.forget_oldest_lost(None) {
                return Err(format!(
                    "the agent already follows {} jobs (the most it follows)",
                    config.max_jobs
                ));
            }
        }
        Ok(())
    }

    /// Forgets the job lost longest ago (of `uid`, when given); false when
    /// there is none.
    fn forget_oldest_lost(&mut self, uid: Option<u32>) -> bool {
        let oldest = self
            .jobs
            .iter()
            .filter(|(_, j)| uid.is_none_or(|uid| j.owner.uid == uid))
            .filter_map(|(id, j)| j.lost_at.map(|at| (at, id.clone())))
            .min();
        match oldest {
            Some((_, id)) => {
                tracing::debug!(job_id = id, "forgetting a lost job to make room");
                self.jobs.remove(&id);
                true
            }
            None => false,
        }
    }
}

/// The registry of jobs found through control sockets. Cloning gives another
/// handle to the same registry; the scanning stops when the last handle is
/// dropped.
#[derive(Clone)]
pub struct Jobs {
    inner: Arc<Shared>,
}

struct Shared {
    config: JobsConfig,
    registry: Mutex<Registry>,
    /// What the launcher scan learned of each process (only the jobs thread
    /// uses it).
    scanner: Mutex<Option<launched::Scanner>>,
    stop: Arc<AtomicBool>,
    /// The clock of `timeline_read_ms`.
    epoch: Instant,
    /// When a job timeline was last read (ms since `epoch`, plus one; 0:
    /// never).
    timeline_read_ms: AtomicU64,
}

impl Drop for Shared {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Ok(registry) = self.registry.get_mut() {
            for job in registry.jobs.values() {
                job.stop_reader.store(true, Ordering::Release);
            }
        }
    }
}

impl Jobs {
    /// Starts scanning (on its own thread, not on tokio's workers).
    pub fn start(config: JobsConfig) -> std::io::Result<Self> {
        let stop = Arc::new(AtomicBool::new(false));
        let jobs = Jobs {
            inner: Arc::new(Shared {
                scanner: Mutex::new(
                    config
                        .launchers
                        .as_ref()
                        .map(|l| launched::Scanner::new(l.proc_root.clone(), l.scope)),
                ),
                config,
                registry: Mutex::new(Registry::default()),
                stop: stop.clone(),
                epoch: Instant::now(),
                timeline_read_ms: AtomicU64::new(0),
            }),
        };
        let weak = Arc::downgrade(&jobs.inner);
        std::thread::Builder::new()
            .name("ringwatch-jobs".into())
            .spawn(move || {
                while !stop.load(Ordering::Acquire) {
                    let Some(inner) = weak.upgrade() else { break };
                    let jobs = Jobs { inner };
                    jobs.scan();
                    let period = jobs.inner.config.scan_period;
                    drop(jobs);
                    std::thread::sleep(period);
                }
            })?;
        Ok(jobs)
    }

    /// The directories scanned for control sockets, in order.
    pub fn runtime_dirs(&self) -> &[PathBuf] {
        &self.inner.config.runtime_dirs
    }

    /// Every job known now (connected, or lost within the retention window),
    /// by job id.
    pub fn jobs(&self) -> Vec<JobSnapshot> {
        let registry = self.lock();
        let mut jobs: Vec<JobSnapshot> = registry
            .jobs
            .iter()
            .map(|(id, job)| job.snapshot(id))
            .collect();
        // A job under an alternate name (its own was held when it started)
        // and the job of another user that holds the name: both listed as a
        // conflict, each naming the other.
        let mut held: Vec<(String, String)> = Vec::new();
        for job in &jobs {
            let Some((wanted, _)) = job.job_id.split_once(ALTERNATE_MARK) else {
                continue;
            };
            if let Some(holder) = registry.jobs.get(wanted)
                && holder.owner.uid != job.owner_uid
            {
                held.push((
                    job.job_id.clone(),
                    format!(
                        "its name {wanted:?} is held by uid {} (pid {}) at {}",
                        holder.owner.uid,
                        holder.owner.pid,
                        holder.socket.display()
                    ),
                ));
                held.push((
                    wanted.to_owned(),
                    format!(
                        "job {:?} of uid {} (pid {}) wanted this name",
                        job.job_id, job.owner_uid, job.owner_pid
                    ),
                ));
            }
        }
        for (id, why) in held {
            if let Some(job) = jobs.iter_mut().find(|j| j.job_id == id) {
                job.conflict.get_or_insert(why);
            }
        }
        // Jobs found from launcher variables; a ringwatch job whose ranks
        // carry a launcher's variables is listed once, as the ringwatch job.
        if let Some(launchers) = &self.inner.config.launchers {
            let ringwatch_pids: HashMap<u32, usize> = jobs
                .iter()
                .enumerate()
                .filter(|(_, j)| j.state == JobState::Connected)
                .flat_map(|(i, j)| j.local_ranks().map(move |r| (r.pid, i)))
                .filter(|(pid, _)| *pid != 0)
                .collect();
            for launched in registry.launched.values() {
                // Only a job of the same user: a hello's word about another
                // user's processes hides nothing.
                let same = launched
                    .job
                    .pids()
                    .filter_map(|pid| ringwatch_pids.get(&pid).copied())
                    .find(|&i| jobs[i].owner_uid == launched.job.uid);
                match same {
                    Some(i) => {
                        // Listed once, as the ringwatch job, with what only
                        // the launcher's variables tell: its workers too.
                        let job = &mut jobs[i];
                        job.launched_by = Some(launched.job.kind);
                        job.launcher_pids = launched.job.launcher_pids.clone();
                        job.rank_children = launched.job.children.clone();
                        job.unknown_rank_pids = launched.job.unknown_rank_pids.clone();
                    }
                    None => jobs.push(launched.snapshot(&launchers.node_name)),
                }
            }
        }
        jobs
    }

    /// The newest per-cycle statistics of `job_id` (oldest first), or `None`
    /// for an unknown job.
    pub fn recent_stats(&self, job_id: &str) -> Option<Vec<CycleStats>> {
        self.lock()
            .jobs
            .get(job_id)
            .map(|job| job.stats.iter().cloned().collect())
    }

    /// The kept timeline events of `job_id` with `from_us <= ts_us < to_us`
    /// (microseconds since the Unix epoch), in arrival order; `None` for an
    /// unknown job.
    pub fn timeline_events(
        &self,
        job_id: &str,
        from_us: u64,
        to_us: u64,
    ) -> Option<Vec<TimelineEvent>> {
        self.lock().jobs.get(job_id).map(|job| {
            job.timeline
                .iter()
                .filter(|e| (from_us..to_us).contains(&e.ts_us))
                .cloned()
                .collect()
        })
    }

    /// Someone reads job timelines (an API request; not the agent's own
    /// once-a-second live view, which reads them whether anyone looks or
    /// not): with [`JobTimeline::OnDemand`], jobs stream theirs for the next
    /// `timeline_interest`.
    pub fn note_timeline_read(&self) {
        let ms = self.inner.epoch.elapsed().as_millis() as u64 + 1;
        self.inner.timeline_read_ms.store(ms, Ordering::Relaxed);
    }

    /// Whether jobs should stream their timeline now.
    pub fn timeline_wanted(&self) -> bool {
        match self.inner.config.job_timeline {
            JobTimeline::Always => true,
            JobTimeline::OnDemand => {
                let read = self.inner.timeline_read_ms.load(Ordering::Relaxed);
                let now = self.inner.epoch.elapsed().as_millis() as u64 + 1;
                read != 0
                    && now.saturating_sub(read)
                        <= self.inner.config.timeline_interest.as_millis() as u64
            }
        }
    }

    fn lock(&self) -> MutexGuard<'_, Registry> {
        // A panic while holding the lock leaves plain data behind: use it.
        self.inner
            .registry
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// One pass over the runtime directories: connect to new sockets, mark
    /// jobs whose socket vanished as lost, forget old lost jobs.
    fn scan(&self) {
        let config = &self.inner.config;
        let agent_uid = trust::agent_uid();
        let mut present: HashMap<PathBuf, u64> = HashMap::new();
        for dir in &config.runtime_dirs {
            if !self.dir_is_trusted(dir, agent_uid) {
                continue;
            }
            let Ok(dir_meta) = std::fs::symlink_metadata(dir) else {
                continue;
            };
            let Ok(entries) = std::fs::read_dir(dir) else {
                continue;
            };
            let mut connects = 0;
            let mut connects_of: HashMap<u32, usize> = HashMap::new();
            for entry in entries.flatten() {
                let path = entry.path();
                if path.extension().is_none_or(|e| e != "sock") {
                    continue;
                }
                // Not followed: a link could point anywhere.
                let Ok(meta) = std::fs::symlink_metadata(&path) else {
                    continue;
                };
                present.insert(path.clone(), meta.ino());
                if self.should_try(&path, meta.ino()) {
                    if !meta.file_type().is_socket() {
                        self.reject(&path, meta.ino(), "not a Unix socket");
                        continue;
                    }
                    // Per directory and per owner: one user's many sockets
                    // cannot use up a scan.
                    let of_owner = connects_of.entry(meta.uid()).or_default();
                    if connects == config.max_connects_per_scan
                        || *of_owner == MAX_CONNECTS_PER_OWNER
                    {
                        continue;
                    }
                    connects += 1;
                    *of_owner += 1;
                    self.connect(&path, meta.ino(), dir_meta.uid());
                }
            }
        }
        let now = Instant::now();
        let mut registry = self.lock();
        for job in registry.jobs.values_mut() {
            if present.get(&job.socket) != Some(&job.socket_inode) {
                job.lose("its control socket is gone".to_owned());
            }
        }
        registry.jobs.retain(|job_id, job| {
            let keep = job
                .lost_at
                .is_none_or(|at| now.duration_since(at) < config.retention);
            if !keep {
                tracing::debug!(job_id, "forgetting a lost job");
            }
            keep
        });
        registry
            .rejected
            .retain(|path, _| present.contains_key(path));
        drop(registry);
        self.scan_launched();
    }

    /// One pass of the launcher scan ([`launched::Scanner`]): new jobs are
    /// kept (within the caps), jobs no longer found are lost, and forgotten
    /// after the retention window.
    fn scan_launched(&self) {
        let found = {
            let mut scanner = self
                .inner
                .scanner
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let Some(scanner) = scanner.as_mut() else {
                return;
            };
            let found = scanner.scan();
            let unreadable = scanner.unreadable();
            let mut registry = self.lock();
            if unreadable > registry.launcher_unreadable_logged {
                // Each time more are unreadable than ever before: rare lines.
                tracing::warn!(
                    unreadable,
                    examined = scanner.known(),
                    "the environments of some processes cannot be read (another user's \
                     processes need CAP_SYS_PTRACE): their jobs are not found from launcher \
                     variables"
                );
                registry.launcher_unreadable_logged = unreadable.next_power_of_two();
            }
            found
        };
        let config = &self.inner.config;
        let now = Instant::now();
        let mut registry = self.lock();
        let mut seen = std::collections::BTreeSet::new();
        for job in found {
            seen.insert(job.job_id.clone());
            if let Some(known) = registry.launched.get_mut(&job.job_id) {
                known.job = job;
                known.last_seen = SystemTime::now();
                known.lost_at = None;
                continue;
            }
            // Room, as for ringwatch jobs: the job of that user (for the
            // per-user cap) or of anyone (for the total) lost longest ago is
            // forgotten first.
            let of_user = |registry: &Registry| {
                registry
                    .launched
                    .values()
                    .filter(|l| l.job.uid == job.uid)
                    .count()
            };
            let forget_oldest_lost = |registry: &mut Registry, uid: Option<u32>| -> bool {
                let oldest = registry
                    .launched
                    .iter()
                    .filter(|(_, l)| uid.is_none_or(|uid| l.job.uid == uid))
                    .filter_map(|(id, l)| l.lost_at.map(|at| (at, id.clone())))
                    .min();
                oldest.is_some_and(|(_, id)| registry.launched.remove(&id).is_some())
            };
            while job.uid != 0
                && of_user(&registry) >= config.max_jobs_per_user
                && forget_oldest_lost(&mut registry, Some(job.uid))
            {}
            while registry.launched.len() >= config.max_jobs
                && forget_oldest_lost(&mut registry, None)
            {}
            if registry.launched.len() >= config.max_jobs
                || (job.uid != 0 && of_user(&registry) >= config.max_jobs_per_user)
            {
                if registry.launched_refused.insert(job.job_id.clone()) {
                    registry.launched_refused_total += 1;
                    if registry.launched_refused_total > registry.launched_refused_logged {
                        tracing::warn!(
                            job_id = job.job_id,
                            uid = job.uid,
                            refused_in_all = registry.launched_refused_total,
                            max_jobs = config.max_jobs,
                            max_jobs_per_user = config.max_jobs_per_user,
                            "not following a job found from its launcher's variables: too many \
                             jobs"
                        );
                        registry.launched_refused_logged =
                            registry.launched_refused_total.saturating_mul(2);
                    }
                }
                continue;
            }
            tracing::info!(
                job_id = job.job_id,
                kind = job.kind.as_str(),
                ranks = job.ranks.len(),
                "found a job from its launcher's variables"
            );
            registry.launched.insert(
                job.job_id.clone(),
                Launched {
                    job,
                    last_seen: SystemTime::now(),
                    lost_at: None,
                },
            );
        }
        registry.launched_refused.retain(|id| seen.contains(id));
        for (id, job) in registry.launched.iter_mut() {
            if !seen.contains(id) && job.lost_at.is_none() {
                job.lost_at = Some(now);
            }
        }
        registry.launched.retain(|_, job| {
            job.lost_at
                .is_none_or(|at| now.duration_since(at) < config.retention)
        });
    }

    /// Whether `dir` may be scanned now; a refusal is logged when it is new
    /// or its reason changed.
    fn dir_is_trusted(&self, dir: &Path, agent_uid: u32) -> bool {
        let verdict = trust::check_runtime_dir(dir, agent_uid);
        let mut registry = self.lock();
        match verdict {
            Ok(()) => {
                if registry.refused_dirs.remove(dir).is_some() {
                    tracing::info!(dir = %dir.display(), "runtime directory is usable again");
                }
                true
            }
            Err(why) => {
                if registry.refused_dirs.get(dir) != Some(&why) {
                    // A directory that does not exist (yet) is normal.
                    if dir.exists() {
                        tracing::warn!(dir = %dir.display(), why, "not scanning a runtime directory");
                    } else {
                        tracing::debug!(dir = %dir.display(), why, "runtime directory absent");
                    }
                    registry.refused_dirs.insert(dir.to_owned(), why);
                }
                false
            }
        }
    }

    /// True when `path` is not served by a connected job and was not
    /// rejected recently (a new file at the same path is tried at once).
    fn should_try(&self, path: &Path, inode: u64) -> bool {
        let registry = self.lock();
        let connected = registry
            .jobs
            .values()
            .any(|job| job.state == JobState::Connected && job.socket == path);
        let recently_rejected = registry
            .rejected
            .get(path)
            .is_some_and(|r| r.inode == inode && r.at.elapsed() < RETRY_REJECTED);
        !connected && !recently_rejected
    }

    /// Remembers that `path` is unusable; logs it the first time only.
    fn reject(&self, path: &Path, inode: u64, why: &str) {
        let mut registry = self.lock();
        let seen = registry
            .rejected
            .get(path)
            .is_some_and(|r| r.inode == inode);
        if !seen {
            tracing::warn!(
                path = %path.display(),
                why,
                "skipping a file in the runtime directory that is not a job's control socket \
                 (or its job is gone); retried every {RETRY_REJECTED:?}"
            );
        }
        registry.rejected.insert(
            path.to_owned(),
            Rejected {
                inode,
                at: Instant::now(),
            },
        );
    }

    fn connect(&self, path: &Path, inode: u64, dir_uid: u32) {
        let config = &self.inner.config;
        let timeout = config.connect_timeout;
        let mut client = match ControlClient::connect(path, timeout) {
            Ok(client) => client,
            Err(error) => return self.reject(path, inode, &error.to_string()),
        };
        let owner = match client.peer_credentials() {
            Ok(owner) => owner,
            Err(error) => {
                return self.reject(
                    path,
                    inode,
                    &format!("cannot read its peer credentials: {error}"),
                );
            }
        };
        if let Err(why) = trust::check_socket(path, dir_uid, owner) {
            return self.reject(path, inode, &format!("untrusted socket: {why}"));
        }
        if let Err(why) = check_hello(path, client.hello()) {
            return self.reject(path, inode, &why);
        }
        if let Err(why) = self.lock().make_room(config, owner.uid) {
            return self.reject(path, inode, &why);
        }
        let timeline = self.timeline_wanted();
        if let Err(error) = client.subscribe(true, timeline) {
            return self.reject(path, inode, &format!("subscribing failed: {error}"));
        }
        let hello = client.hello().clone();
        let (ranks, ns_pids) = map_local_pids(&hello, owner);
        let stop_reader = Arc::new(AtomicBool::new(false));
        let connection = {
            let mut registry = self.lock();
            if let Some(other) = registry.jobs.get_mut(&hello.job_id)
                && other.state == JobState::Connected
            {
                if other.owner.uid != owner.uid {
                    tracing::warn!(
                        job_id = hello.job_id,
                        uid = other.owner.uid,
                        other_uid = owner.uid,
                        socket = %path.display(),
                        "two users' sockets claim one job id: the job is listed as a conflict \
                         and not tuned"
                    );
                    other.claimed_also_by = Some((path.to_owned(), owner.uid, owner.pid));
                }
                let other = other.socket.display().to_string();
                drop(registry);
                return self.reject(
                    path,
                    inode,
                    &format!("job {} is already watched through {other}", hello.job_id),
                );
            }
            registry.rejected.remove(path);
            registry.next_connection += 1;
            let connection = registry.next_connection;
            registry.jobs.insert(
                hello.job_id.clone(),
                Job {
                    socket: path.to_owned(),
                    socket_inode: inode,
                    protocol_version: hello.protocol_version,
                    world_size: hello.world_size,
                    local_size: hello.local_size,
                    ranks,
                    host: hello.host().to_owned(),
                    served_by_rank: hello.served_by_rank(),
                    ns_pids,
                    knobs: hello.knobs,
                    cycle: hello.cycle,
                    autotune: hello.autotune,
                    state: JobState::Connected,
                    lost_reason: None,
                    lost_at: None,
                    last_seen: SystemTime::now(),
                    stats: VecDeque::new(),
                    stats_received: 0,
                    timeline: VecDeque::new(),
                    timeline_streaming_since: None,
                    timeline_events_received: 0,
                    timeline_events_dropped: 0,
                    timeline_bytes: 0,
                    owner,
                    stop_reader: stop_reader.clone(),
                    connection,
                    claimed_also_by: None,
                    stall: None,
                },
            );
            connection
        };
        tracing::info!(
            job_id = hello.job_id,
            socket = %path.display(),
            host = hello.host(),
            served_by_rank = hello.served_by_rank(),
            world_size = hello.world_size,
            owner_uid = owner.uid,
            owner_pid = owner.pid,
            "found a job"
        );
        let weak = Arc::downgrade(&self.inner);
        let job_id = hello.job_id;
        let spawned = std::thread::Builder::new()
            .name("ringwatch-job".into())
            .spawn({
                let job_id = job_id.clone();
                move || read_job(client, &weak, &job_id, connection, &stop_reader)
            });
        if let Err(error) = spawned
            && let Some(job) = self.lock().jobs.get_mut(&job_id)
        {
            job.lose(format!("cannot start its reader thread: {error}"));
        }
    }
}

/// Reads one job's stream until it breaks or the registry stops it.
fn read_job(
    mut client: ControlClient,
    registry: &std::sync::Weak<Shared>,
    job_id: &str,
    connection: u64,
    stop: &AtomicBool,
) {
    let poll = Duration::from_millis(250);
    let mut timeline = None;
    while !stop.load(Ordering::Acquire) {
        let result = client.next_message(poll);
        let Some(inner) = registry.upgrade() else {
            return;
        };
        let jobs = Jobs { inner };
        // Ask for the timeline while someone reads it (--job-timeline).
        let wanted = jobs.timeline_wanted();
        let mut switched = None;
        let result = match result {
            Ok(_) if timeline != Some(wanted) => match client.subscribe(true, wanted) {
                Ok(()) => {
                    tracing::debug!(job_id, timeline = wanted, "job timeline subscription");
                    timeline = Some(wanted);
                    switched = Some(wanted);
                    result
                }
                Err(e) => Err(e),
            },
            other => other,
        };
        let mut registry = jobs.lock();
        let max_stats = jobs.inner.config.max_stats_per_job;
        let max_events = jobs.inner.config.max_timeline_events_per_job;
        let max_bytes = jobs.inner.config.max_timeline_bytes_per_job;
        let Some(job) = registry
            .jobs
            .get_mut(job_id)
            .filter(|job| job.connection == connection)
        else {
            return;
        };
        match switched {
            Some(true) if job.timeline_streaming_since.is_none() => {
                job.timeline_streaming_since = Some(SystemTime::now());
            }
            Some(false) => job.timeline_streaming_since = None,
            _ => {}
        }
        match result {
            Ok(None) => {}
            Ok(Some(message)) => {
                job.last_seen = SystemTime::now();
                match message {
                    ServerMessage::CycleStats(stats) => {
                        job.cycle = job.cycle.max(stats.cycle);
                        job.knobs = stats.knobs;
                        job.stats_received += 1;
                        job.stats.push_back(stats);
                        while job.stats.len() > max_stats {
                            job.stats.pop_front();
                        }
                    }
                    ServerMessage::Timeline { events } => {
                        job.keep_timeline(events, max_events, max_bytes);
                    }
                    ServerMessage::Stall(report) => job.stall_changed(job_id, report),
                    ServerMessage::KnobsApplied {
                        knobs,
                        applied_at_cycle,
                        ..
                    } => {
                        job.knobs = knobs;
                        job.cycle = job.cycle.max(applied_at_cycle);
                    }
                    ServerMessage::Knobs { knobs, cycle, .. } => {
                        job.knobs = knobs;
                        job.cycle = job.cycle.max(cycle);
                    }
                    ServerMessage::Error { message, .. } => {
                        tracing::warn!(job_id, message, "the job reported an error");
                    }
                    ServerMessage::Hello(_)
                    | ServerMessage::TuningClaim { .. }
                    | ServerMessage::TimelineWanted { .. } => {}
                }
            }
            Err(error) => {
                let reason = match error {
                    ControlError::Closed => "the job closed its control connection".to_owned(),
                    other => format!("its control connection failed: {other}"),
                };
                tracing::info!(job_id, reason, "lost a job");
                job.lose(reason);
                return;
            }
        }
    }
}

/// The pids of the local ranks of every connected job: the ranks of the host
/// its socket speaks for (found in this node's runtime dir, so on this node),
/// by their host pids, each a live process of the job's user.
pub struct JobPids {
    jobs: Jobs,
    /// (job, pid) pairs refused and logged already.
    refused: std::collections::HashSet<(String, u32)>,
}

impl JobPids {
    /// A source over `jobs`' registry.
    pub fn new(jobs: Jobs) -> Self {
        Self {
            jobs,
            refused: std::collections::HashSet::new(),
        }
    }
}

impl PidSource for JobPids {
    fn name(&self) -> String {
        let dirs: Vec<String> = self
            .jobs
            .inner
            .config
            .runtime_dirs
            .iter()
            .map(|d| d.display().to_string())
            .collect();
        format!("jobs in {}", dirs.join(", "))
    }

    fn pids(&mut self) -> Vec<u32> {
        let mut pids = Vec::new();
        let jobs = self.jobs.jobs();
        for job in jobs.iter().filter(|job| job.state == JobState::Connected) {
            // Of a job found from launcher variables, also its ranks' children
            // and the processes of unknown rank.
            for (pid, rank) in job.local_processes() {
                if !discovery::process_exists(pid) {
                    continue;
                }
                match trust::check_rank_pid(pid, job.owner_uid) {
                    Ok(()) => pids.push(pid),
                    Err(why) => {
                        if self.refused.insert((job.job_id.clone(), pid)) {
                            tracing::warn!(
                                job_id = job.job_id,
                                rank,
                                pid,
                                why,
                                "not watching a process of a job"
                            );
                        }
                    }
                }
            }
        }
        // Forget refusals of jobs that are gone.
        self.refused
            .retain(|(job_id, _)| jobs.iter().any(|job| &job.job_id == job_id));
        pids.sort_unstable();
        pids.dedup();
        pids
    }
}

/// This machine's host name, as the collectives runtime reports it.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeSet;
    use std::io::Write;
    use std::os::unix::net::UnixListener;
    use std::process::{Command, Stdio};

    use collectives::control::{Hello, Phase, write_message};

    use super::test_procs::{children_of, collbench};
    use super::*;

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(what: &str) -> Self {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .unwrap()
                .as_nanos();
            let dir = std::env::temp_dir().join(format!(
                "ringwatch-jobs-{what}-{}-{nanos}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).unwrap();
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn config(dir: &Path) -> JobsConfig {
        JobsConfig {
            runtime_dirs: vec![dir.to_owned()],
            scan_period: Duration::from_millis(100),
            // No test measures it: a fake job stalled by load must not be
            // rejected (and retried only 10 s later).
            connect_timeout: Duration::from_secs(10),
            retention: Duration::from_secs(2),
            max_stats_per_job: 50,
            max_timeline_events_per_job: 1_000,
            max_timeline_bytes_per_job: 1 << 20,
            max_jobs: 64,
            max_jobs_per_user: 8,
            max_connects_per_scan: 16,
            job_timeline: JobTimeline::OnDemand,
            timeline_interest: Duration::from_secs(60),
            launchers: None,
        }
    }

    /// Polls `check` every 50 ms for at most `limit`.
    fn wait_for<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Option<T>) -> T {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(v) = check() {
                return v;
            }
            assert!(Instant::now() < deadline, "timed out waiting for {what}");
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// An endless job's launcher, killed (and its ranks with it) when a test ends
    /// early: a failed assertion used to leave the job running on the machine.
    struct Launcher(std::process::Child);

    impl Drop for Launcher {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    #[test]
    fn finds_a_real_two_rank_job_follows_it_and_loses_it_when_it_exits() {
        let dir = TempDir::new("collbench");
        let job_id = format!("jobs-test-{}", std::process::id());
        let mut launcher = Launcher(
            Command::new(collbench())
                .args(["-n", "2", "sweep", "--min-bytes", "4096", "--max-bytes"])
                .args(["4096", "--iters", "1000000000"])
                .env("RINGWATCH_RUNTIME_DIR", &dir.0)
                .env("RINGWATCH_JOB_ID", &job_id)
                .env_remove("RANK")
                .env_remove("OMPI_COMM_WORLD_RANK")
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        );
        let jobs = Jobs::start(config(&dir.0)).unwrap();
        let job = wait_for(Duration::from_secs(60), "the job and its stats", || {
            jobs.jobs()
                .into_iter()
                .find(|j| j.job_id == job_id && j.stats_received > 0)
        });
        assert_eq!(job.state, JobState::Connected);
        assert_eq!(job.socket, dir.0.join(format!("{job_id}.sock")));
        assert_eq!((job.world_size, job.local_size), (2, 2));
        let ranks: Vec<usize> = job.ranks.iter().map(|r| r.rank).collect();
        assert_eq!(ranks, vec![0, 1]);
        assert!(job.ranks.iter().all(|r| r.host == host_name()));
        // Ground truth: the ranks are the launcher's children.
        let hello_pids: BTreeSet<u32> = job.ranks.iter().map(|r| r.pid).collect();
        assert_eq!(hello_pids, children_of(launcher.0.id()));
        let mut source = JobPids::new(jobs.clone());
        assert_eq!(
            source.pids().into_iter().collect::<BTreeSet<_>>(),
            hello_pids
        );

        // Every cycle reduces the one 4096-byte tensor "sweep.4096"; cycles
        // microseconds apart come added up, a tensor each.
        let stats = jobs.recent_stats(&job_id).unwrap();
        assert!(!stats.is_empty() && stats.len() <= 50);
        for s in &stats {
            assert!(s.tensors >= 1, "{s:?}");
            assert_eq!(s.bytes_reduced, 4096 * s.tensors, "{s:?}");
        }
        // Nobody has asked for the job's timeline yet: it streams none (on
        // demand), and the agent's own reads (the live view) do not ask.
        assert!(
            jobs.timeline_events(&job_id, 0, u64::MAX)
                .unwrap()
                .is_empty()
        );
        std::thread::sleep(Duration::from_millis(600));
        assert!(!jobs.timeline_wanted());
        assert_eq!(jobs.lock().jobs[&job_id].timeline.len(), 0);
        assert_eq!(jobs.jobs()[0].timeline_streaming_since_unix_ms, None);
        // A request (the API's) asks for it; it comes.
        let asked_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64;
        jobs.note_timeline_read();
        assert!(jobs.timeline_wanted());
        let events = wait_for(Duration::from_secs(60), "timeline events", || {
            Some(jobs.timeline_events(&job_id, 0, u64::MAX).unwrap()).filter(|e| !e.is_empty())
        });
        assert!(events.iter().any(|e| e.tensor == "sweep.4096"));
        // The snapshot says since when: after the request, and no event before.
        let since = jobs.jobs()[0]
            .timeline_streaming_since_unix_ms
            .expect("streaming since");
        assert!(since >= asked_ms, "{since} < {asked_ms}");
        assert!(
            events.iter().all(|e| e.ts_us / 1000 + 1 >= asked_ms),
            "an event from before the request"
        );
        let first = events[0].ts_us;
        assert!(
            jobs.timeline_events(&job_id, first + 1, u64::MAX)
                .unwrap()
                .iter()
                .all(|e| e.ts_us > first)
        );
        assert_eq!(jobs.recent_stats("no-such-job"), None);

        // The job ends (its ranks are killed): lost, no pids, then forgotten.
        for pid in &hello_pids {
            // SAFETY: kill has no memory preconditions; the pid is our grandchild.
            unsafe { libc::kill(*pid as i32, libc::SIGKILL) };
        }
        let _ = launcher.0.wait();
        let lost = wait_for(Duration::from_secs(60), "the job to be lost", || {
            jobs.jobs()
                .into_iter()
                .find(|j| j.job_id == job_id && j.state == JobState::Lost)
        });
        assert!(lost.lost_reason.is_some());
        assert!(source.pids().is_empty());
        wait_for(
            Duration::from_secs(60),
            "the lost job to be forgotten",
            || jobs.jobs().is_empty().then_some(()),
        );
    }

    /// A job's side of the protocol, in-process: sends `hello`, then what
    /// `stream` says, then closes when told.
    fn fake_job(path: &Path, job_id: &str, stream: Vec<ServerMessage>) -> Arc<AtomicBool> {
        let listener = UnixListener::bind(path).unwrap();
        let close = Arc::new(AtomicBool::new(false));
        let hello = Hello {
            protocol_version: collectives::control::PROTOCOL_VERSION,
            job_id: job_id.to_owned(),
            world_size: 1,
            local_size: 1,
            ranks: vec![RankInfo {
                rank: 0,
                local_rank: 0,
                local_size: 1,
                host: host_name(),
                pid: std::process::id(),
            }],
            knobs: Knobs::default(),
            cycle: 0,
            autotune: Default::default(),
            host: None,
            served_by_rank: None,
        };
        let closing = close.clone();
        std::thread::spawn(move || {
            let (mut conn, _) = listener.accept().unwrap();
            write_message(&mut conn, &ServerMessage::Hello(hello)).unwrap();
            for m in &stream {
                write_message(&mut conn, m).unwrap();
            }
            while !closing.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        close
    }

    #[test]
    fn skips_what_is_not_a_job_and_still_finds_the_job_beside_it() {
        let dir = TempDir::new("garbage");
        std::fs::write(dir.0.join("junk.sock"), b"not a socket").unwrap();
        // A socket whose listener is gone (a job that crashed).
        drop(UnixListener::bind(dir.0.join("stale.sock")).unwrap());
        // A socket that answers garbage, and one that never answers.
        let liar = UnixListener::bind(dir.0.join("liar.sock")).unwrap();
        std::thread::spawn(move || {
            for conn in liar.incoming() {
                let _ = conn
                    .unwrap()
                    .write_all(b"\xff\xff\xff\xffHTTP/1.1 200 OK\r\n\r\n");
            }
        });
        let mute = UnixListener::bind(dir.0.join("mute.sock")).unwrap();
        let mut held = Vec::new();
        std::thread::spawn(move || {
            for conn in mute.incoming() {
                held.push(conn);
            }
        });
        let event = |ts_us| TimelineEvent {
            rank: 0,
            tensor: "grad".into(),
            activity: "ALLREDUCE".into(),
            phase: Phase::Begin,
            ts_us,
            args: BTreeMap::new(),
        };
        let stats = CycleStats {
            cycle: 7,
            start_unix_us: 1,
            duration_us: 2,
            bytes_reduced: 4096,
            bytes_total: 4096,
            tensors: 1,
            fused_buffers: 1,
            knobs: Knobs::default(),
            late: Vec::new(),
            tensors_waited: 0,
            steps: Default::default(),
        };
        let mut stream = vec![ServerMessage::CycleStats(stats.clone()); 60];
        stream.push(ServerMessage::Timeline {
            events: (0..1_100).map(event).collect(),
        });
        let close = fake_job(&dir.0.join("fake.sock"), "fake", stream);

        // The mute socket holds each scan for the connect timeout: a short
        // one (a fake job stalled longer is retried 10 s later, well within
        // the wait).
        let jobs = Jobs::start(JobsConfig {
            connect_timeout: Duration::from_secs(2),
            ..config(&dir.0)
        })
        .unwrap();
        let job = wait_for(Duration::from_secs(60), "the fake job's stream", || {
            jobs.jobs()
                .into_iter()
                .find(|j| j.timeline_events_received == 1_100)
        });
        assert_eq!(jobs.jobs().len(), 1, "only the real job is registered");
        assert_eq!((job.job_id.as_str(), job.cycle), ("fake", 7));
        assert_eq!(job.stats_received, 60);
        // Bounded: the newest 50 stats and 1,000 events are kept.
        assert_eq!(jobs.recent_stats("fake").unwrap(), vec![stats; 50]);
        assert_eq!(job.timeline_events_dropped, 100);
        let window = jobs.timeline_events("fake", 500, 510).unwrap();
        assert_eq!(window, (500..510).map(event).collect::<Vec<_>>());
        assert!(jobs.timeline_events("fake", 0, 100).unwrap().is_empty());
        // Our own pid is local: the source names it.
        assert_eq!(JobPids::new(jobs.clone()).pids(), vec![std::process::id()]);

        // The job closes its connection: lost, and its pid is no longer named.
        close.store(true, Ordering::Release);
        wait_for(Duration::from_secs(60), "the fake job to be lost", || {
            (jobs.jobs()[0].state == JobState::Lost).then_some(())
        });
        assert!(JobPids::new(jobs.clone()).pids().is_empty());
    }

    /// A job socket at `path` served by a process running as `uid` (through
    /// setpriv and Debian's python3), whose hello says `hello` with every pid
    /// `u32::MAX` replaced by the server's own; killed on drop.
    struct JobOfAnotherUser(std::process::Child);

    impl JobOfAnotherUser {
        fn start(path: &Path, uid: u32, hello: &Hello) -> Self {
            let frame = serde_json::to_vec(&ServerMessage::Hello(hello.clone())).unwrap();
            let script = "import os,socket,struct,sys\n\
                body=bytes.fromhex(sys.argv[2]).replace(b'4294967295', str(os.getpid()).encode())\n\
                s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.listen(8)\n\
                conns=[]\n\
                while True:\n    c,_=s.accept(); c.sendall(struct.pack('>I',len(body))+body); conns.append(c)\n";
            let child = Command::new("setpriv")
                .args(["--reuid", &uid.to_string(), "--regid", &uid.to_string()])
                .args(["--clear-groups", "/usr/bin/python3", "-c", script])
                .arg(path)
                .arg(frame.iter().map(|b| format!("{b:02x}")).collect::<String>())
                .spawn()
                .unwrap();
            Self(child)
        }
    }

    impl Drop for JobOfAnotherUser {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }

    fn chmod(path: &Path, mode: u32) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    }

    /// The reproduction of issue #12: user `nobody` serves a job socket whose
    /// hello names pids 1 and 2 as ranks, beside its own process. The job is
    /// listed as nobody's, and only nobody's own process is watched.
    #[test]
    fn a_job_of_another_user_cannot_name_other_processes() {
        if trust::agent_uid() != 0 || !Path::new("/usr/bin/python3").exists() {
            eprintln!("skipped: needs root (to serve a socket as nobody) and /usr/bin/python3");
            return;
        }
        let dir = TempDir::new("nobody");
        chmod(&dir.0, 0o1777);
        let rank = |rank, pid| RankInfo {
            rank,
            local_rank: rank,
            local_size: 3,
            host: host_name(),
            pid,
        };
        let hello = Hello {
            protocol_version: collectives::control::PROTOCOL_VERSION,
            job_id: "hostile".to_owned(),
            world_size: 3,
            local_size: 3,
            ranks: vec![rank(0, u32::MAX), rank(1, 1), rank(2, 2)],
            knobs: Knobs::default(),
            cycle: 0,
            autotune: Default::default(),
            host: None,
            served_by_rank: None,
        };
        let server = JobOfAnotherUser::start(&dir.0.join("hostile.sock"), 65534, &hello);
        let jobs = Jobs::start(config(&dir.0)).unwrap();
        let job = wait_for(Duration::from_secs(60), "nobody's job", || {
            jobs.jobs().into_iter().find(|j| j.job_id == "hostile")
        });
        assert_eq!((job.owner_uid, job.owner_pid), (65534, server.0.id()));
        let named: Vec<u32> = job.ranks.iter().map(|r| r.pid).collect();
        assert_eq!(named, vec![server.0.id(), 1, 2]);
        // pids 1 and 2 run as root: only the server itself is watched.
        assert_eq!(JobPids::new(jobs.clone()).pids(), vec![server.0.id()]);
    }

    #[test]
    fn jobs_found_from_launcher_variables_are_listed_once_and_lost_when_gone() {
        use launched::fake_proc;
        let dir = TempDir::new("launched");
        let proc_root = dir.0.join("proc");
        let torchrun = |port: u16, rank: usize| {
            format!(
                "HOME=/root\0TORCHELASTIC_RUN_ID=none\0MASTER_ADDR=10.0.0.1\0\
                 MASTER_PORT={port}\0RANK={rank}\0WORLD_SIZE=2\0"
            )
        };
        // This process: rank 0 of a ringwatch job (the fake job's socket
        // names it) that torchrun started.
        let me = std::process::id();
        fake_proc(&proc_root, me, 1, 0, torchrun(29500, 0).as_bytes());
        // Another torchrun job, with no socket: ranks 0 and 1, a worker of
        // rank 1, and torchrun itself.
        fake_proc(&proc_root, 4000, 1, 0, b"HOME=/root\0");
        fake_proc(&proc_root, 4001, 4000, 0, torchrun(29600, 0).as_bytes());
        fake_proc(&proc_root, 4002, 4000, 0, torchrun(29600, 1).as_bytes());
        fake_proc(&proc_root, 4003, 4002, 0, torchrun(29600, 1).as_bytes());
        let runtime = dir.0.join("run");
        std::fs::create_dir_all(&runtime).unwrap();
        let _job = fake_job(&runtime.join("rw.sock"), "rw", Vec::new());
        let mut config = config(&runtime);
        // Long enough that the lost job is still there when looked at.
        config.retention = Duration::from_secs(600);
        config.launchers = Some(LaunchDiscovery {
            node_name: "node-a".into(),
            scope: launched::NodeScope::Kernel,
            proc_root: proc_root.clone(),
        });
        let jobs = Jobs::start(config).unwrap();
        let other = "torchrun/none@10.0.0.1:29600/uid0";
        let all = wait_for(Duration::from_secs(60), "both jobs", || {
            let all = jobs.jobs();
            let rw = all.iter().find(|j| j.job_id == "rw")?;
            (rw.launched_by.is_some() && all.iter().any(|j| j.job_id == other)).then_some(all)
        });
        assert_eq!(all.len(), 2, "the ringwatch job once: {all:#?}");
        let rw = all.iter().find(|j| j.job_id == "rw").unwrap();
        assert_eq!(rw.kind, JobKind::Ringwatch);
        assert_eq!(rw.launched_by, Some(JobKind::Torchrun));
        let job = all.iter().find(|j| j.job_id == other).unwrap();
        assert_eq!(job.kind, JobKind::Torchrun);
        assert_eq!(job.knobs, None);
        assert_eq!(job.world_size, 2);
        assert_eq!(job.host, "node-a");
        let ranks: Vec<(usize, u32, &str)> = job
            .ranks
            .iter()
            .map(|r| (r.rank, r.pid, r.host.as_str()))
            .collect();
        assert_eq!(ranks, [(0, 4001, "node-a"), (1, 4002, "node-a")]);
        assert_eq!(job.rank_children[&1], [4003]);
        assert_eq!(job.launcher_pids, [4000]);
        assert_eq!(job.state, JobState::Connected);
        let json = serde_json::to_value(job).unwrap();
        assert_eq!(json["kind"], "torchrun");
        assert!(json.get("socket").is_none(), "{json}");
        // Its processes end: the job is lost (and kept for the retention).
        for pid in [4001, 4002, 4003] {
            std::fs::remove_dir_all(proc_root.join(pid.to_string())).unwrap();
        }
        wait_for(Duration::from_secs(60), "the job lost", || {
            let job = jobs.jobs().into_iter().find(|j| j.job_id == other)?;
            (job.state == JobState::Lost).then_some(())
        });
    }

    /// A `hello` of a one-rank job named `job_id` (no ranks listed).
    fn one_rank_hello(job_id: &str) -> Hello {
        Hello {
            protocol_version: collectives::control::PROTOCOL_VERSION,
            job_id: job_id.to_owned(),
            world_size: 1,
            local_size: 1,
            ranks: Vec::new(),
            knobs: Knobs::default(),
            cycle: 0,
            autotune: Default::default(),
            host: None,
            served_by_rank: None,
        }
    }

    #[test]
    fn a_job_under_its_alternate_name_and_the_squatter_are_listed_as_a_conflict() {
        if trust::agent_uid() != 0 || !Path::new("/usr/bin/python3").exists() {
            eprintln!("skipped: needs root (to serve a socket as nobody) and /usr/bin/python3");
            return;
        }
        let shared = TempDir::new("alternate");
        chmod(&shared.0, 0o1777);
        let hello = one_rank_hello("relsq");
        let _squatter = JobOfAnotherUser::start(&shared.0.join("relsq.sock"), 65534, &hello);
        let alternate = "relsq.taken-0123456789ab";
        let _real = fake_job(
            &shared.0.join(format!("{alternate}.sock")),
            alternate,
            Vec::new(),
        );
        let jobs = Jobs::start(config(&shared.0)).unwrap();
        let (real, squatter) = wait_for(Duration::from_secs(60), "both jobs", || {
            let all = jobs.jobs();
            let real = all.iter().find(|j| j.job_id == alternate)?.clone();
            let squatter = all.iter().find(|j| j.job_id == "relsq")?.clone();
            Some((real, squatter))
        });
        let why = real.conflict.expect("the real job listed as a conflict");
        assert!(why.contains("held by uid 65534"), "{why}");
        let why = squatter
            .conflict
            .expect("the squatter listed as a conflict");
        assert!(why.contains(alternate), "{why}");
        // Each id names one job: the real one can be tuned under its name.
        assert!(!real.id_claimed_twice && !squatter.id_claimed_twice);
    }

    #[test]
    fn one_job_id_claimed_by_two_users_is_a_conflict_and_not_tuned() {
        if trust::agent_uid() != 0 || !Path::new("/usr/bin/python3").exists() {
            eprintln!("skipped: needs root (to serve a socket as nobody) and /usr/bin/python3");
            return;
        }
        // nobody's "relsq" in the shared directory; root's in another one.
        let shared = TempDir::new("conflict-shared");
        chmod(&shared.0, 0o1777);
        let own = TempDir::new("conflict-own");
        let hello = one_rank_hello("relsq");
        let _squatter = JobOfAnotherUser::start(&shared.0.join("relsq.sock"), 65534, &hello);
        let _real = fake_job(&own.0.join("relsq.sock"), "relsq", Vec::new());
        let mut config = config(&shared.0);
        config.runtime_dirs.push(own.0.clone());
        let jobs = Jobs::start(config).unwrap();
        let job = wait_for(Duration::from_secs(60), "the conflict", || {
            jobs.jobs()
                .into_iter()
                .find(|j| j.job_id == "relsq" && j.conflict.is_some())
        });
        let conflict = job.conflict.unwrap();
        let other_uid = if job.owner_uid == 0 { 65534 } else { 0 };
        assert!(conflict.contains(&format!("uid {other_uid}")), "{conflict}");
        assert!(job.id_claimed_twice);
        let listed = serde_json::to_value(jobs.jobs()).unwrap();
        assert!(listed.to_string().contains("also claimed by"), "{listed}");
    }

    #[test]
    fn a_world_writable_directory_without_the_sticky_bit_is_not_scanned() {
        let open = TempDir::new("open");
        let safe = TempDir::new("safe");
        chmod(&open.0, 0o777);
        let _planted = fake_job(&open.0.join("planted.sock"), "planted", Vec::new());
        let _real = fake_job(&safe.0.join("real.sock"), "real", Vec::new());
        let mut config = config(&open.0);
        config.runtime_dirs.push(safe.0.clone());
        let jobs = Jobs::start(config).unwrap();
        // One scan reads the open directory, then the safe one: once the
        // real job is found, the open directory was passed over.
        wait_for(Duration::from_secs(60), "the real job", || {
            jobs.jobs().into_iter().find(|j| j.job_id == "real")
        });
        let ids: Vec<String> = jobs.jobs().into_iter().map(|j| j.job_id).collect();
        assert_eq!(ids, vec!["real".to_owned()]);
    }

    #[test]
    fn a_jobs_timeline_is_bounded_in_bytes() {
        let dir = TempDir::new("bytes");
        // 40 frames of 2,000 events with 400-byte tensor names: ~40 MB sent.
        let event = |ts_us| TimelineEvent {
            rank: 0,
            tensor: "g".repeat(400),
            activity: "ALLREDUCE".into(),
            phase: Phase::Begin,
            ts_us,
            args: BTreeMap::new(),
        };
        let stream: Vec<ServerMessage> = (0..40u64)
            .map(|frame| ServerMessage::Timeline {
                events: (0..2_000).map(|i| event(frame * 2_000 + i)).collect(),
            })
            .collect();
        let _job = fake_job(&dir.0.join("big.sock"), "big", stream);
        let mut config = config(&dir.0);
        config.max_timeline_events_per_job = usize::MAX;
        config.max_timeline_bytes_per_job = 4 << 20;
        let jobs = Jobs::start(config).unwrap();
        let job = wait_for(Duration::from_secs(30), "every frame", || {
            jobs.jobs()
                .into_iter()
                .find(|j| j.timeline_events_received == 80_000)
        });
        assert!(job.timeline_bytes <= 4 << 20, "{}", job.timeline_bytes);
        let kept = 80_000 - job.timeline_events_dropped;
        // What is kept is the newest, and it is what the byte count says.
        let events = jobs.timeline_events("big", 0, u64::MAX).unwrap();
        assert_eq!(events.len() as u64, kept);
        assert_eq!(events.last().map(|e| e.ts_us), Some(79_999));
        assert_eq!(
            events.iter().map(event_bytes).sum::<usize>(),
            job.timeline_bytes
        );
        assert!(kept > 1_000 && kept < 80_000, "{kept}");
    }

    #[test]
    fn a_job_whose_socket_disappears_is_lost_then_forgotten() {
        let dir = TempDir::new("vanish");
        let path = dir.0.join("vanishing.sock");
        let close = fake_job(&path, "vanishing", Vec::new());
        let jobs = Jobs::start(config(&dir.0)).unwrap();
        wait_for(Duration::from_secs(60), "the job", || {
            jobs.jobs()
                .first()
                .filter(|j| j.state == JobState::Connected)
                .cloned()
        });
        // The connection stays open; only the socket file goes away.
        std::fs::remove_file(&path).unwrap();
        let lost = wait_for(Duration::from_secs(60), "the job to be lost", || {
            jobs.jobs().into_iter().find(|j| j.state == JobState::Lost)
        });
        assert_eq!(
            lost.lost_reason.as_deref(),
            Some("its control socket is gone")
        );
        wait_for(Duration::from_secs(60), "the job to be forgotten", || {
            jobs.jobs().is_empty().then_some(())
        });
        assert_eq!(jobs.recent_stats("vanishing"), None);
        close.store(true, Ordering::Release);
    }
}
