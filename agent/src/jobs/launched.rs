//! `launched`: finds the training jobs that do not run on ringwatch's runtime
//! (torchrun, `torch.distributed` env:// jobs such as Kubeflow's, Open MPI and
//! MPICH, Slurm's `srun`, Horovod) from what their launcher already told each
//! process: a handful of environment variables.
//!
//! What it reads of a process, and nothing more: `/proc/<pid>/stat` (parent
//! and start time), the `Uid:` line of `/proc/<pid>/status`, the network
//! namespace link, and of `/proc/<pid>/environ` only the variables named in
//! [`LAUNCH_VARS`]. Every other variable of an environment can hold a secret:
//! the reader streams the file, compares each name with the list, and keeps
//! no byte of an entry whose name is not on it (nor of an environment past
//! [`MAX_ENVIRON_BYTES`]). Values are kept only if short and printable.
//!
//! The rules (`docs/guide/jobs.md` explains them to users):
//!
//! - **A job key per launcher**, built from variables every rank of the job
//!   shares on every node, so that the agents of a cluster agree on it
//!   without talking: torchrun `TORCHELASTIC_RUN_ID` + `MASTER_ADDR:MASTER_PORT`;
//!   env:// `MASTER_ADDR:MASTER_PORT` (with `WORLD_SIZE`);
//!   Horovod its gloo rendezvous address; Open MPI `PMIX_NAMESPACE` (or its
//!   job id); MPICH `PMI_KVSNAME`; Slurm `SLURM_JOB_ID.SLURM_STEP_ID`. The
//!   innermost launcher wins: torchrun inside an `sbatch` allocation is a
//!   torchrun job.
//! - **Processes of different users are never one job**: the uid is part of
//!   the job's id.
//! - **A rank's children are its rank's**: a process whose parent is in the
//!   same job (a data-loader worker inherits the environment) belongs to the
//!   parent's rank and is watched with it, never a rank of its own.
//! - **A launcher is the job's, not a rank**: the parent of a rank that is not
//!   in the job itself (torchrun's agent, `mpirun`, `prted`, `slurmstepd`) is
//!   listed as the job's launcher when it runs as the job's user.
//! - **A rank the environment does not say is unknown, not guessed**: a
//!   process with the job's key and no rank variable (nor a parent in the job)
//!   joins the job among `unknown_rank_pids`; two processes that claim the
//!   same rank are both kept, the younger one as unknown, and the job says so.
//!
//! Cost: a process is examined once, when first seen (plus once more if it
//! was younger than a second then: a fork about to exec); later scans only
//! list `/proc`.

use std::collections::{BTreeMap, HashMap};
use std::io::Read;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// How much of one `/proc/<pid>/environ` is read, at most. Linux caps a
/// process's arguments and environment together at a quarter of its stack
/// limit (2 MiB by default, the most anyone sets in practice is far less);
/// an environment longer than this is read up to here.
pub const MAX_ENVIRON_BYTES: usize = 1 << 20;

/// Ranks and sizes at or above this are not believed (the control sockets'
/// limit on a job's ranks).
pub const MAX_RANKS: usize = 16_384;

/// Longest value kept of a named variable; a longer one is ignored.
pub const MAX_VALUE_BYTES: usize = 128;

/// The only variables ever read of a process's environment.
pub const LAUNCH_VARS: &[&str] = &[
    // torchrun / torch elastic, and plain env:// (Kubeflow's training operator).
    "TORCHELASTIC_RUN_ID",
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    // Open MPI / PMIx.
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE",
    "OMPI_MCA_ess_base_jobid",
    "OMPI_MCA_orte_ess_jobid",
    "PMIX_NAMESPACE",
    "PMIX_RANK",
    // MPICH / Hydra.
    "PMI_RANK",
    "PMI_SIZE",
    "PMI_KVSNAME",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    // Slurm.
    "SLURM_JOB_ID",
    "SLURM_STEP_ID",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "SLURM_NTASKS_PER_NODE",
    // Horovod (horovodrun with gloo).
    "HOROVOD_RANK",
    "HOROVOD_SIZE",
    "HOROVOD_LOCAL_RANK",
    "HOROVOD_LOCAL_SIZE",
    "HOROVOD_GLOO_RENDEZVOUS_ADDR",
    "HOROVOD_GLOO_RENDEZVOUS_PORT",
];

/// Who launched a job (`ringwatch` for jobs on ringwatch's own runtime,
/// found through their control socket).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    Default,
    Serialize,
    Deserialize,
    utoipa::ToSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum JobKind {
    /// ringwatch's runtime (`collectives`), found through its control socket.
    #[default]
    Ringwatch,
    /// torchrun (torch elastic): `TORCHELASTIC_RUN_ID`.
    Torchrun,
    /// `torch.distributed` with env:// and no torchrun (Kubeflow's
    /// PyTorchJob, a hand-written launcher): `MASTER_ADDR`, `RANK`, `WORLD_SIZE`.
    Pytorch,
    /// `horovodrun` with gloo: `HOROVOD_RANK`.
    Horovod,
    /// `mpirun` / `mpiexec` (Open MPI, MPICH): `OMPI_COMM_WORLD_RANK`, `PMI_RANK`.
    Mpi,
    /// Slurm's `srun`: `SLURM_STEP_ID`, `SLURM_PROCID`.
    Slurm,
}

impl JobKind {
    /// The kind's name, as in the API.
    pub fn as_str(self) -> &'static str {
        match self {
            JobKind::Ringwatch => "ringwatch",
            JobKind::Torchrun => "torchrun",
            JobKind::Pytorch => "pytorch",
            JobKind::Horovod => "horovod",
            JobKind::Mpi => "mpi",
            JobKind::Slurm => "slurm",
        }
    }
}

/// The named variables of one environment (only those of [`LAUNCH_VARS`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LaunchEnv {
    vars: BTreeMap<&'static str, String>,
}

impl LaunchEnv {
    /// From `NAME=value` pairs: only named, short, printable values are kept.
    #[cfg(test)]
    pub fn from_pairs<'a>(pairs: impl IntoIterator<Item = (&'a str, &'a str)>) -> Self {
        let mut env = LaunchEnv::default();
        for (name, value) in pairs {
            env.offer(name.as_bytes(), value.as_bytes());
        }
        env
    }

    fn offer(&mut self, name: &[u8], value: &[u8]) {
        let Some(&known) = LAUNCH_VARS.iter().find(|v| v.as_bytes() == name) else {
            return;
        };
        // Host names, addresses, ids and numbers: nothing that could mean
        // something in a label, a log or a JSON string.
        let allowed = |b: &u8| b.is_ascii_alphanumeric() || b"._:@-[]".contains(b);
        if value.is_empty() || value.len() > MAX_VALUE_BYTES || !value.iter().all(allowed) {
            return;
        }
        if let Ok(value) = std::str::from_utf8(value) {
            // The first definition wins, as for getenv(3).
            self.vars.entry(known).or_insert_with(|| value.to_owned());
        }
    }

    fn get(&self, name: &str) -> Option<&str> {
        self.vars.get(name).map(String::as_str)
    }

    /// A rank or a size: below [`MAX_RANKS`], or nothing.
    fn number(&self, name: &str) -> Option<usize> {
        self.get(name)?.parse().ok().filter(|&n| n < MAX_RANKS)
    }
}

/// Reads the named variables of `/proc/<pid>/environ` (under `proc_root`),
/// streaming: no byte of another entry is kept.
pub fn read_environ(proc_root: &Path, pid: u32) -> std::io::Result<LaunchEnv> {
    let file = std::fs::File::open(proc_root.join(pid.to_string()).join("environ"))?;
    parse_environ(file.take(MAX_ENVIRON_BYTES as u64))
}

/// The named variables of a NUL-separated environment.
pub fn parse_environ(mut from: impl Read) -> std::io::Result<LaunchEnv> {
    /// Where the reader is in the current entry.
    enum At {
        /// In its name: the bytes so far start some listed name.
        Name,
        /// In the value of this listed name.
        Value(&'static str),
        /// In an entry not kept (its name is not listed, or it is too long):
        /// until its end.
        Skip,
    }
    let mut env = LaunchEnv::default();
    // Only the bytes of a listed name and its value ever land here.
    let mut name: Vec<u8> = Vec::with_capacity(64);
    let mut value: Vec<u8> = Vec::with_capacity(MAX_VALUE_BYTES);
    let mut at = At::Name;
    let mut buf = [0u8; 8192];
    let result = loop {
        let n = match from.read(&mut buf) {
            Ok(0) => break Ok(()),
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => break Err(e),
        };
        for &b in &buf[..n] {
            if b == 0 {
                if let At::Value(known) = at {
                    env.offer(known.as_bytes(), &value);
                }
                name.clear();
                value.clear();
                at = At::Name;
                continue;
            }
            match at {
                At::Skip => {}
                At::Name if b == b'=' => {
                    at = match LAUNCH_VARS.iter().find(|v| v.as_bytes() == name.as_slice()) {
                        Some(known) => At::Value(known),
                        None => At::Skip,
                    };
                }
                At::Name => {
                    name.push(b);
                    if !LAUNCH_VARS.iter().any(|v| v.as_bytes().starts_with(&name)) {
                        at = At::Skip;
                    }
                }
                At::Value(_) => {
                    if value.len() == MAX_VALUE_BYTES {
                        value.clear();
                        at = At::Skip;
                    } else {
                        value.push(b);
                    }
                }
            }
        }
    };
    // An environment cut at the cap ends mid-entry: that entry is dropped.
    result.map(|()| env)
}

/// What one process's environment says about the job it is in.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The launcher.
    pub kind: JobKind,
    /// The job key (without the user): equal on every rank of the job.
    pub key: String,
    /// Its global rank, when the environment says it.
    pub rank: Option<usize>,
    /// The job's ranks in all.
    pub world_size: Option<usize>,
    /// Its rank within the node.
    pub local_rank: Option<usize>,
    /// Ranks on its node.
    pub local_size: Option<usize>,
}

/// What a launcher's variables make of a process; `None` when they make no job
/// (a stray `MASTER_ADDR`, an `sbatch` script's own shell).
pub fn classify(env: &LaunchEnv) -> Option<Launch> {
    let n = |name| env.number(name);
    let addr_port = |addr: &str, port: &str| -> Option<String> {
        let port: u16 = env.get(port)?.parse().ok()?;
        Some(format!("{}:{port}", env.get(addr)?))
    };
    // Innermost launcher first; a launcher whose key is incomplete makes way
    // for the next.
    if let (Some(run_id), Some(master)) = (
        env.get("TORCHELASTIC_RUN_ID"),
        addr_port("MASTER_ADDR", "MASTER_PORT"),
    ) {
        return Some(Launch {
            kind: JobKind::Torchrun,
            key: format!("{run_id}@{master}"),
            rank: n("RANK"),
            world_size: n("WORLD_SIZE"),
            local_rank: n("LOCAL_RANK"),
            local_size: n("LOCAL_WORLD_SIZE"),
        });
    }
    if env.get("HOROVOD_RANK").is_some()
        && let Some(rendezvous) = addr_port(
            "HOROVOD_GLOO_RENDEZVOUS_ADDR",
            "HOROVOD_GLOO_RENDEZVOUS_PORT",
        )
    {
        return Some(Launch {
            kind: JobKind::Horovod,
            key: rendezvous,
            rank: n("HOROVOD_RANK"),
            world_size: n("HOROVOD_SIZE"),
            local_rank: n("HOROVOD_LOCAL_RANK"),
            local_size: n("HOROVOD_LOCAL_SIZE"),
        });
    }
    if env.get("OMPI_COMM_WORLD_RANK").is_some()
        && let Some(key) = env
            .get("PMIX_NAMESPACE")
            .or_else(|| env.get("OMPI_MCA_ess_base_jobid"))
            .or_else(|| env.get("OMPI_MCA_orte_ess_jobid"))
    {
        return Some(Launch {
            kind: JobKind::Mpi,
            key: key.to_owned(),
            rank: n("OMPI_COMM_WORLD_RANK"),
            world_size: n("OMPI_COMM_WORLD_SIZE"),
            local_rank: n("OMPI_COMM_WORLD_LOCAL_RANK"),
            local_size: n("OMPI_COMM_WORLD_LOCAL_SIZE"),
        });
    }
    // MPICH's Hydra (also under Slurm, whose SLURM_PROCID then numbers the
    // proxies, not the ranks).
    if env.get("PMI_RANK").is_some()
        && let Some(kvs) = env.get("PMI_KVSNAME")
    {
        return Some(Launch {
            kind: JobKind::Mpi,
            key: kvs.to_owned(),
            rank: n("PMI_RANK"),
            world_size: n("PMI_SIZE"),
            local_rank: n("MPI_LOCALRANKID"),
            local_size: n("MPI_LOCALNRANKS"),
        });
    }
    if let (Some(job), Some(step)) = (env.get("SLURM_JOB_ID"), env.get("SLURM_STEP_ID"))
        && env.get("SLURM_PROCID").is_some()
    {
        return Some(Launch {
            kind: JobKind::Slurm,
            key: format!("{job}.{step}"),
            rank: n("SLURM_PROCID"),
            world_size: n("SLURM_NTASKS"),
            local_rank: n("SLURM_LOCALID"),
            local_size: n("SLURM_NTASKS_PER_NODE"),
        });
    }
    // env:// wants the world size; a job whose ranks are numbered in code
    // (`mp.spawn`) has no RANK: its processes join with their rank unknown.
    if n("WORLD_SIZE").is_some()
        && let Some(master) = addr_port("MASTER_ADDR", "MASTER_PORT")
    {
        return Some(Launch {
            kind: JobKind::Pytorch,
            key: master,
            rank: n("RANK"),
            world_size: n("WORLD_SIZE"),
            local_rank: n("LOCAL_RANK"),
            local_size: n("LOCAL_WORLD_SIZE"),
        });
    }
    None
}

/// A key whose address is this machine's loopback names a job only within
/// its network namespace (two pods' default `127.0.0.1:29500` are two
/// jobs): the namespace's inode is added to it.
fn localized(mut launch: Launch, netns: Option<u64>) -> Launch {
    let host = launch
        .key
        .rsplit_once('@')
        .map_or(launch.key.as_str(), |(_, at)| at);
    let host = host.rsplit_once(':').map_or(host, |(h, _)| h);
    let loopback = host == "localhost"
        || host == "[::1]"
        || host == "::1"
        || host
            .parse::<std::net::Ipv4Addr>()
            .is_ok_and(|a| a.is_loopback());
    if loopback {
        launch.key = format!("{}~net{}", launch.key, netns.unwrap_or(0));
    }
    launch
}

/// One process as the scanner keeps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Proc {
    /// Its pid (the agent's pid namespace).
    pub pid: u32,
    /// Its parent's pid.
    pub ppid: u32,
    /// Its real uid.
    pub uid: u32,
    /// Start time, clock ticks after boot (with the pid, the process's identity).
    pub start_ticks: u64,
    /// Its network namespace's inode.
    pub netns: Option<u64>,
    /// What its environment says, if it is in a job.
    pub launch: Option<Launch>,
    /// When it was examined, clock ticks after boot.
    pub examined_ticks: u64,
    /// Examined a second time already (it was young the first time).
    pub rechecked: bool,
}

/// A job's id: kind, key and user, e.g. `torchrun/none@10.0.0.1:29500/uid1000`.
pub fn job_id(kind: JobKind, key: &str, uid: u32) -> String {
    format!("{}/{key}/uid{uid}", kind.as_str())
}

/// One job found from its launcher's variables, on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchedJob {
    /// [`job_id`].
    pub job_id: String,
    /// The launcher.
    pub kind: JobKind,
    /// Its user.
    pub uid: u32,
    /// The job's ranks in all, as the first rank's environment says.
    pub world_size: Option<usize>,
    /// Rank -> (pid, local rank, local size), this node's ranks.
    pub ranks: BTreeMap<usize, (u32, Option<usize>, Option<usize>)>,
    /// Processes of the job whose rank the environment does not say (or that
    /// claim a rank another process holds).
    pub unknown_rank_pids: Vec<u32>,
    /// Rank -> its children in the job (data-loader workers).
    pub children: BTreeMap<usize, Vec<u32>>,
    /// Launcher processes (parents of ranks that are not in the job).
    pub launcher_pids: Vec<u32>,
    /// What does not add up (two processes claiming one rank), for people.
    pub notes: Vec<String>,
}

impl LaunchedJob {
    /// Every process of the job on this node: ranks, their children, unknown ones.
    pub fn pids(&self) -> impl Iterator<Item = u32> + '_ {
        self.ranks
            .values()
            .map(|r| r.0)
            .chain(self.children.values().flatten().copied())
            .chain(self.unknown_rank_pids.iter().copied())
    }
}

/// Every pid a job lists on this node (ranks, children, unknown ones), at most.
pub const MAX_JOB_PIDS: usize = 1024;

/// Notes kept per job (the rest are counted).
const MAX_NOTES: usize = 8;

/// Groups `procs` (every process the scanner knows, by pid) into jobs, by the
/// rules of the module doc. `in_scope` says which processes are this node's.
pub fn group(procs: &HashMap<u32, Proc>, in_scope: impl Fn(&Proc) -> bool) -> Vec<LaunchedJob> {
    fn job_of(p: &Proc) -> Option<(JobKind, &str, u32)> {
        p.launch.as_ref().map(|l| (l.kind, l.key.as_str(), p.uid))
    }
    // A launcher started by an outer launcher (torchrun's agent under srun,
    // prted under a PyTorchJob) carries the outer one's variables: it is the
    // inner job's launcher, not a member of the outer job.
    let outer_launchers: std::collections::HashSet<u32> = procs
        .values()
        .filter(|p| p.launch.is_some())
        .filter_map(|p| {
            let parent = procs.get(&p.ppid)?;
            (parent.pid != p.pid
                && parent.uid == p.uid
                && job_of(parent).is_some()
                && job_of(parent) != job_of(p))
            .then_some(parent.pid)
        })
        .collect();
    let member = |p: &Proc| p.launch.is_some() && in_scope(p) && !outer_launchers.contains(&p.pid);
    // The process whose rank `p` is of: itself, or the nearest ancestor in
    // the same job that says a rank (a worker inherits its rank's
    // environment). A child that says another rank than its parent is a rank
    // of its own (a launcher inside the job started it). Bounded walk: a
    // racing pid reuse could make a cycle.
    let root_of = |p: &Proc| -> u32 {
        let mut at = p;
        for _ in 0..64 {
            let Some(parent) = procs.get(&at.ppid) else {
                break;
            };
            let rank = |q: &Proc| q.launch.as_ref().and_then(|l| l.rank);
            if parent.pid == at.pid
                || job_of(parent) != job_of(p)
                || !member(parent)
                || (rank(at).is_some() && rank(parent).is_some() && rank(at) != rank(parent))
            {
                break;
            }
            at = parent;
        }
        at.pid
    };
    let mut members: Vec<&Proc> = procs.values().filter(|p| member(p)).collect();
    // Older first: of two processes that claim one rank, the older keeps it.
    members.sort_by_key(|p| (p.start_ticks, p.pid));
    let roots: Vec<(&Proc, u32)> = members.iter().map(|p| (*p, root_of(p))).collect();
    let mut jobs: BTreeMap<String, LaunchedJob> = BTreeMap::new();
    let mut rank_of_pid: HashMap<u32, usize> = HashMap::new();
    let mut pids_of: HashMap<String, usize> = HashMap::new();
    let mut notes_dropped: HashMap<String, usize> = HashMap::new();
    // Two passes: the ranks first, then their children (a child may sort
    // before its parent: ticks are coarse).
    for pass in [true, false] {
        for &(p, root) in &roots {
            if (root == p.pid) != pass {
                continue;
            }
            let Some(launch) = &p.launch else { continue };
            let id = job_id(launch.kind, &launch.key, p.uid);
            let count = pids_of.entry(id.clone()).or_default();
            if *count >= MAX_JOB_PIDS {
                continue;
            }
            *count += 1;
            let job = jobs.entry(id.clone()).or_insert_with(|| LaunchedJob {
                job_id: id.clone(),
                kind: launch.kind,
                uid: p.uid,
                world_size: None,
                ranks: BTreeMap::new(),
                unknown_rank_pids: Vec::new(),
                children: BTreeMap::new(),
                launcher_pids: Vec::new(),
                notes: Vec::new(),
            });
            if launch.rank.is_some() || job.world_size.is_none() {
                // A rank's word on the world size over an unknown one's.
                job.world_size = launch.world_size.or(job.world_size);
            }
            if !pass {
                match rank_of_pid.get(&root) {
                    Some(&rank) => job.children.entry(rank).or_default().push(p.pid),
                    None => job.unknown_rank_pids.push(p.pid),
                }
                continue;
            }
            match launch.rank {
                Some(rank) if !job.ranks.contains_key(&rank) => {
                    job.ranks
                        .insert(rank, (p.pid, launch.local_rank, launch.local_size));
                    rank_of_pid.insert(p.pid, rank);
                }
                Some(rank) => {
                    let holder = job.ranks[&rank].0;
                    if job.notes.len() < MAX_NOTES {
                        job.notes.push(format!(
                            "pids {holder} and {} both say they are rank {rank}; {} is \
                             listed as of unknown rank",
                            p.pid, p.pid
                        ));
                    } else {
                        *notes_dropped.entry(id.clone()).or_default() += 1;
                    }
                    job.unknown_rank_pids.push(p.pid);
                }
                None => job.unknown_rank_pids.push(p.pid),
            }
            // Its launcher: the parent, when not in the job and of the same
            // user (an outer launcher's member included).
            if let Some(parent) = procs.get(&p.ppid)
                && parent.pid > 1
                && parent.uid == p.uid
                && (job_of(parent) != job_of(p) || !member(parent))
                && in_scope(parent)
                && !job.launcher_pids.contains(&parent.pid)
                && job.launcher_pids.len() < MAX_NOTES
            {
                job.launcher_pids.push(parent.pid);
            }
        }
    }
    for (id, dropped) in notes_dropped {
        if let Some(job) = jobs.get_mut(&id) {
            job.notes.push(format!("and {dropped} more such claims"));
        }
    }
    jobs.into_values().collect()
}

/// One process's `stat`: (ppid, start time in ticks).
fn parse_stat(stat: &str) -> Option<(u32, u64)> {
    // The name may hold spaces and parentheses: fields start after the last `)`.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // After the name: state(3) ppid(4) ... starttime(22), 1-based in proc(5).
    let ppid = fields.get(1)?.parse().ok()?;
    let start = fields.get(19)?.parse().ok()?;
    Some((ppid, start))
}

/// How long one environment read may take before the reader gives it up.
const ENV_READ_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(5);

/// Readers left hung in a read before environments are no longer read.
const MAX_HUNG_READERS: usize = 4;

/// Reads environments on a helper thread, each within [`ENV_READ_TIMEOUT`]:
/// a process can make a read of its memory hang (a FUSE-backed page, as
/// hangs `ps`), and the jobs thread must not hang with it. A reader that
/// hangs is left behind (a pid it hung on is never read again); after
/// [`MAX_HUNG_READERS`] of them, environments are no longer read.
pub struct EnvReader {
    proc_root: PathBuf,
    worker: Option<(
        std::sync::mpsc::Sender<u32>,
        std::sync::mpsc::Receiver<std::io::Result<LaunchEnv>>,
    )>,
    hung: usize,
    /// How long a read may take ([`ENV_READ_TIMEOUT`]).
    timeout: std::time::Duration,
    /// The pids a read hung on (never read again).
    hung_on: std::collections::HashSet<u32>,
}

impl EnvReader {
    /// A reader of `proc_root`'s environments.
    pub fn new(proc_root: PathBuf) -> Self {
        Self {
            proc_root,
            worker: None,
            hung: 0,
            timeout: ENV_READ_TIMEOUT,
            hung_on: std::collections::HashSet::new(),
        }
    }

    /// The named variables of `pid`'s environment.
    pub fn read(&mut self, pid: u32) -> Result<LaunchEnv, String> {
        use std::sync::mpsc::{RecvTimeoutError, channel};
        if self.hung_on.contains(&pid) {
            return Err("an earlier read of it hung".to_owned());
        }
        if self.hung >= MAX_HUNG_READERS {
            return Err(format!(
                "environments are no longer read: {} reads hung",
                self.hung
            ));
        }
        let (requests, results) = match self.worker.take() {
            Some(worker) => worker,
            None => {
                let (request_tx, request_rx) = channel::<u32>();
                let (result_tx, result_rx) = channel();
                let root = self.proc_root.clone();
                std::thread::Builder::new()
                    .name("ringwatch-environ".into())
                    .spawn(move || {
                        for pid in request_rx {
                            if result_tx.send(read_environ(&root, pid)).is_err() {
                                break;
                            }
                        }
                    })
                    .map_err(|e| format!("cannot start the environment reader: {e}"))?;
                (request_tx, result_rx)
            }
        };
        if requests.send(pid).is_err() {
            return Err("the environment reader ended".to_owned());
        }
        match results.recv_timeout(self.timeout) {
            Ok(result) => {
                self.worker = Some((requests, results));
                result.map_err(|e| e.to_string())
            }
            Err(RecvTimeoutError::Timeout) => {
                self.hung += 1;
                self.hung_on.insert(pid);
                tracing::error!(
                    pid,
                    hung = self.hung,
                    "reading a process's environment hung; that process is never read again"
                );
                Err(format!("the read hung for {:?}", self.timeout))
            }
            Err(RecvTimeoutError::Disconnected) => Err("the environment reader ended".to_owned()),
        }
    }
}

/// Reads what the scanner keeps of `pid` (its environment only with a
/// reader) at `now_ticks`; `None` when it is gone (or a zombie), or was
/// replaced by another process while it was read.
pub fn read_proc(
    proc_root: &Path,
    pid: u32,
    env_reader: Option<&mut EnvReader>,
    now_ticks: u64,
) -> Option<(Proc, Option<String>)> {
    let dir = proc_root.join(pid.to_string());
    let stat = || -> Option<(u32, u64)> {
        let stat = std::fs::read_to_string(dir.join("stat")).ok()?;
        if stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'))
        {
            return None;
        }
        parse_stat(&stat)
    };
    let (ppid, start_ticks) = stat()?;
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let uid = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let netns = std::fs::read_link(dir.join("ns/net")).ok().and_then(|l| {
        l.to_str()?
            .strip_prefix("net:[")?
            .strip_suffix(']')?
            .parse()
            .ok()
    });
    let (launch, env_error) = match env_reader.map(|r| r.read(pid)) {
        Some(Ok(env)) => (classify(&env).map(|l| localized(l, netns)), None),
        Some(Err(e)) => (None, Some(e)),
        None => (None, None),
    };
    // The same process from the first read to the last (a pid reused in
    // between would mix two processes).
    if stat()?.1 != start_ticks {
        return None;
    }
    Some((
        Proc {
            pid,
            ppid,
            uid,
            start_ticks,
            netns,
            launch,
            examined_ticks: now_ticks,
            rechecked: false,
        },
        env_error,
    ))
}

/// The start time of `pid` now (`None`: gone).
fn start_ticks(proc_root: &Path, pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(proc_root.join(pid.to_string()).join("stat")).ok()?;
    parse_stat(&stat).map(|(_, start)| start)
}

/// Which processes are this node's.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeScope {
    /// Every process of the kernel (a real node).
    #[default]
    Kernel,
    /// Only the processes in this network namespace (its inode): pretend
    /// nodes that share one kernel.
    NetNamespace(u64),
}

/// The inode of the network namespace at `path` (`/run/netns/NAME`,
/// `/proc/PID/ns/net`); an error if it is no namespace.
pub fn netns_inode(path: &Path) -> std::io::Result<u64> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::MetadataExt;
    // nsfs, the file system of namespace files.
    const NSFS_MAGIC: i64 = 0x6e73_6673;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
    // SAFETY: statfs writes into a zeroed struct we own; the path is a valid C string.
    let mut fs: libc::statfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statfs(c_path.as_ptr(), &mut fs) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    if fs.f_type as i64 != NSFS_MAGIC {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a namespace file (nsfs)",
        ));
    }
    Ok(std::fs::metadata(path)?.ino())
}

/// Keeps what it learned of each process between scans, so that each is
/// examined once.
pub struct Scanner {
    proc_root: PathBuf,
    scope: NodeScope,
    procs: HashMap<u32, Proc>,
    /// Pids whose environment could not be read (and why), logged once.
    unreadable: HashMap<u32, String>,
    /// Reads environments within a deadline.
    env_reader: EnvReader,
    /// Ticks per second and the boot clock, for a process's age.
    ticks_per_s: u64,
}

impl Scanner {
    /// A scanner of `proc_root` (`/proc`).
    pub fn new(proc_root: PathBuf, scope: NodeScope) -> Self {
        // SAFETY: sysconf has no preconditions.
        let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
        Self {
            proc_root: proc_root.clone(),
            scope,
            procs: HashMap::new(),
            unreadable: HashMap::new(),
            env_reader: EnvReader::new(proc_root.clone()),
            ticks_per_s: u64::try_from(ticks).ok().filter(|&t| t > 0).unwrap_or(100),
        }
    }

    /// Seconds since boot (`CLOCK_BOOTTIME`, the clock of a process's start time).
    fn uptime_ticks(&self) -> u64 {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: `ts` is a valid timespec to write.
        unsafe { libc::clock_gettime(libc::CLOCK_BOOTTIME, &mut ts) };
        (ts.tv_sec.max(0) as u64) * self.ticks_per_s
            + (ts.tv_nsec.max(0) as u64) * self.ticks_per_s / 1_000_000_000
    }

    /// Lists `/proc`, examines the processes not seen before, forgets those
    /// gone, and groups the jobs.
    pub fn scan(&mut self) -> Vec<LaunchedJob> {
        let Ok(dir) = std::fs::read_dir(&self.proc_root) else {
            return Vec::new();
        };
        let live: Vec<u32> = dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse().ok())
            .collect();
        let live_set: std::collections::HashSet<u32> = live.iter().copied().collect();
        self.procs.retain(|pid, _| live_set.contains(pid));
        self.unreadable.retain(|pid, _| live_set.contains(pid));
        let now = self.uptime_ticks();
        let second = self.ticks_per_s;
        for pid in live {
            let recheck = match self.procs.get(&pid) {
                None => false,
                // A member: still the same process? (Its pid could be
                // another's now; members are few, so this costs little.)
                Some(p) if p.launch.is_some() => {
                    if start_ticks(&self.proc_root, pid) == Some(p.start_ticks) {
                        continue;
                    }
                    false
                }
                // Examined within its first second (a fork about to exec,
                // `ip netns exec` before its setns): once more.
                Some(p)
                    if !p.rechecked && p.examined_ticks.saturating_sub(p.start_ticks) < second =>
                {
                    true
                }
                Some(_) => continue,
            };
            let Some((mut proc, env_error)) =
                read_proc(&self.proc_root, pid, Some(&mut self.env_reader), now)
            else {
                self.procs.remove(&pid);
                continue;
            };
            proc.rechecked = recheck;
            if let Some(why) = env_error
                && !self.unreadable.contains_key(&pid)
            {
                tracing::debug!(pid, why, "cannot read a process's launcher variables");
                self.unreadable.insert(pid, why);
            }
            self.procs.insert(pid, proc);
        }
        let scope = self.scope;
        group(&self.procs, |p| match scope {
            NodeScope::Kernel => true,
            NodeScope::NetNamespace(ino) => p.netns == Some(ino),
        })
    }

    /// Processes whose environment the agent may not read (another user's,
    /// without CAP_SYS_PTRACE), now.
    pub fn unreadable(&self) -> usize {
        self.unreadable.len()
    }

    /// Processes examined and kept now.
    pub fn known(&self) -> usize {
        self.procs.len()
    }
}

/// A process in a fake `/proc` under `root`: its stat, its uid and its
/// environment.
#[cfg(test)]
pub(crate) fn fake_proc(root: &Path, pid: u32, ppid: u32, uid: u32, environ: &[u8]) {
    let dir = root.join(pid.to_string());
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("stat"),
        format!("{pid} (python3) S {ppid} 1 1 0 -1 0 0 0 0 0 0 0 0 0 20 0 1 0 5 1 2"),
    )
    .unwrap();
    std::fs::write(
        dir.join("status"),
        format!("Name:\tpython3\nUid:\t{uid}\t{uid}\t{uid}\t{uid}\n"),
    )
    .unwrap();
    std::fs::write(dir.join("environ"), environ).unwrap();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> LaunchEnv {
        LaunchEnv::from_pairs(pairs.iter().copied())
    }

    fn torchrun(rank: usize) -> Vec<(&'static str, String)> {
        vec![
            ("TORCHELASTIC_RUN_ID", "none".into()),
            ("MASTER_ADDR", "10.0.0.1".into()),
            ("MASTER_PORT", "29500".into()),
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "4".into()),
            ("LOCAL_RANK", (rank % 2).to_string()),
            ("LOCAL_WORLD_SIZE", "2".into()),
        ]
    }

    fn launch_of(pairs: &[(&'static str, String)]) -> Option<Launch> {
        classify(&LaunchEnv::from_pairs(
            pairs.iter().map(|(k, v)| (*k, v.as_str())),
        ))
    }

    #[test]
    fn only_the_named_variables_are_kept_and_nothing_past_an_overlong_entry() {
        let mut raw = Vec::new();
        raw.extend_from_slice(b"AWS_SECRET_ACCESS_KEY=hunter2\0");
        raw.extend_from_slice(b"RANK=3\0");
        // An entry longer than any kept: skipped whole, even its tail that
        // looks like a variable.
        raw.extend_from_slice(b"X=");
        raw.extend(std::iter::repeat_n(b'a', 10_000));
        raw.extend_from_slice(b"WORLD_SIZE=99\0");
        raw.extend_from_slice(b"MASTER_ADDR=host\x01bad\0");
        raw.extend_from_slice(b"MASTER_PORT=29500\0WORLD_SIZE=8");
        let env = parse_environ(&raw[..]).unwrap();
        assert_eq!(env.get("RANK"), Some("3"));
        assert_eq!(env.get("MASTER_PORT"), Some("29500"));
        // The overlong entry's tail and the cut last entry are not variables.
        assert_eq!(env.get("WORLD_SIZE"), None);
        assert_eq!(
            env.get("MASTER_ADDR"),
            None,
            "unprintable values are dropped"
        );
        assert_eq!(env.vars.len(), 2, "{env:?}");
        assert!(!format!("{env:?}").contains("hunter2"));
    }

    #[test]
    fn each_launcher_has_its_key_and_the_innermost_wins() {
        let t = launch_of(&torchrun(2)).unwrap();
        assert_eq!(t.kind, JobKind::Torchrun);
        assert_eq!(t.key, "none@10.0.0.1:29500");
        assert_eq!(
            (t.rank, t.world_size, t.local_rank),
            (Some(2), Some(4), Some(0))
        );
        // torchrun inside an sbatch allocation is torchrun's.
        let mut in_slurm = torchrun(1);
        in_slurm.push(("SLURM_JOB_ID", "77".into()));
        in_slurm.push(("SLURM_STEP_ID", "0".into()));
        in_slurm.push(("SLURM_PROCID", "0".into()));
        assert_eq!(launch_of(&in_slurm).unwrap().kind, JobKind::Torchrun);

        let mpi = classify(&env(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("PMIX_NAMESPACE", "prterun-n0-1234@1"),
            ("SLURM_JOB_ID", "77"),
            ("SLURM_PROCID", "0"),
        ]))
        .unwrap();
        assert_eq!(
            (mpi.kind, mpi.key.as_str()),
            (JobKind::Mpi, "prterun-n0-1234@1")
        );
        assert_eq!(mpi.rank, Some(1));

        let srun = classify(&env(&[
            ("SLURM_JOB_ID", "77"),
            ("SLURM_STEP_ID", "3"),
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
        ]))
        .unwrap();
        assert_eq!((srun.kind, srun.key.as_str()), (JobKind::Slurm, "77.3"));
        assert_eq!((srun.rank, srun.world_size), (Some(5), Some(8)));
        // An sbatch script's own shell (no step) is no job.
        assert_eq!(
            classify(&env(&[("SLURM_JOB_ID", "77"), ("SLURM_PROCID", "0")])),
            None
        );

        let hvd = classify(&env(&[
            ("HOROVOD_RANK", "0"),
            ("HOROVOD_SIZE", "2"),
            ("HOROVOD_GLOO_RENDEZVOUS_ADDR", "10.0.0.1"),
            ("HOROVOD_GLOO_RENDEZVOUS_PORT", "4711"),
        ]))
        .unwrap();
        assert_eq!(
            (hvd.kind, hvd.key.as_str()),
            (JobKind::Horovod, "10.0.0.1:4711")
        );

        let hydra = classify(&env(&[
            ("PMI_RANK", "2"),
            ("PMI_SIZE", "3"),
            ("PMI_KVSNAME", "kvs_9_0"),
        ]))
        .unwrap();
        assert_eq!((hydra.kind, hydra.key.as_str()), (JobKind::Mpi, "kvs_9_0"));

        let kubeflow = classify(&env(&[
            ("MASTER_ADDR", "job-master-0"),
            ("MASTER_PORT", "23456"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
        ]))
        .unwrap();
        assert_eq!(kubeflow.kind, JobKind::Pytorch);
        assert_eq!(kubeflow.key, "job-master-0:23456");
    }

    #[test]
    fn stray_variables_make_no_job() {
        assert_eq!(
            classify(&env(&[("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "1")])),
            None
        );
        assert_eq!(classify(&env(&[("RANK", "0")])), None);
        assert_eq!(
            classify(&env(&[("TORCHELASTIC_RUN_ID", "x"), ("RANK", "0")])),
            None
        );
        assert_eq!(
            classify(&env(&[
                ("RANK", "0"),
                ("WORLD_SIZE", "2"),
                ("MASTER_ADDR", "a"),
                ("MASTER_PORT", "no")
            ])),
            None
        );
    }

    fn proc(pid: u32, ppid: u32, uid: u32, start: u64, launch: Option<Launch>) -> Proc {
        Proc {
            pid,
            ppid,
            uid,
            start_ticks: start,
            netns: Some(if pid >= 500 { 2 } else { 1 }),
            launch,
            examined_ticks: start + 1000,
            rechecked: false,
        }
    }

    #[test]
    fn ranks_children_launchers_and_users_are_told_apart() {
        let t = |rank| launch_of(&torchrun(rank));
        let mut unknown = t(0).unwrap();
        unknown.rank = None;
        let procs: HashMap<u32, Proc> = [
            proc(1, 0, 0, 0, None),
            // torchrun's agent (no job variables of its own) and two ranks.
            proc(100, 1, 1000, 10, None),
            proc(101, 100, 1000, 11, t(0)),
            proc(102, 100, 1000, 12, t(1)),
            // Two data-loader workers of rank 1, one of them a grandchild.
            proc(103, 102, 1000, 13, t(1)),
            proc(104, 103, 1000, 14, t(1)),
            // Another user's process that says it is rank 0 of the same run.
            proc(200, 1, 1001, 5, t(0)),
            // Same user, same key, rank 0 again: the younger one is unknown.
            proc(300, 1, 1000, 30, t(0)),
            // Same key, no rank.
            proc(301, 1, 1000, 31, Some(unknown)),
            // A rank on another pretend node (network namespace 2).
            proc(502, 1, 1000, 12, t(2)),
        ]
        .into_iter()
        .map(|p| (p.pid, p))
        .collect();
        let jobs = group(&procs, |p| p.netns == Some(1));
        assert_eq!(jobs.len(), 2, "{jobs:#?}");
        let mine = jobs.iter().find(|j| j.uid == 1000).unwrap();
        assert_eq!(mine.job_id, "torchrun/none@10.0.0.1:29500/uid1000");
        assert_eq!(mine.kind, JobKind::Torchrun);
        assert_eq!(mine.world_size, Some(4));
        let ranks: Vec<(usize, u32)> = mine.ranks.iter().map(|(r, v)| (*r, v.0)).collect();
        assert_eq!(ranks, [(0, 101), (1, 102)]);
        assert_eq!(mine.children[&1], [103, 104]);
        assert_eq!(mine.launcher_pids, [100]);
        assert_eq!(mine.unknown_rank_pids, [300, 301]);
        assert_eq!(mine.notes.len(), 1, "{:?}", mine.notes);
        let theirs = jobs.iter().find(|j| j.uid == 1001).unwrap();
        assert_eq!(theirs.job_id, "torchrun/none@10.0.0.1:29500/uid1001");
        assert_eq!(theirs.ranks.len(), 1);
        assert!(theirs.launcher_pids.is_empty(), "init is nobody's launcher");
    }

    #[test]
    fn an_mp_spawn_job_joins_with_its_ranks_unknown() {
        // The parent knows the world size and the address; it numbers the
        // ranks in code, so neither it nor its children say their rank.
        let launch = classify(&env(&[
            ("MASTER_ADDR", "127.0.0.1"),
            ("MASTER_PORT", "29500"),
            ("WORLD_SIZE", "2"),
        ]));
        assert_eq!(
            launch.as_ref().map(|l| (l.kind, l.rank)),
            Some((JobKind::Pytorch, None))
        );
        let procs: HashMap<u32, Proc> = [
            proc(10, 1, 1000, 1, launch.clone()),
            proc(11, 10, 1000, 2, launch.clone()),
            proc(12, 10, 1000, 3, launch),
        ]
        .into_iter()
        .map(|p| (p.pid, p))
        .collect();
        let jobs = group(&procs, |_| true);
        assert_eq!(jobs.len(), 1);
        assert!(jobs[0].ranks.is_empty(), "{jobs:?}");
        assert_eq!(jobs[0].unknown_rank_pids, [10, 11, 12]);
        assert_eq!(jobs[0].world_size, Some(2));
    }

    #[test]
    fn a_loopback_key_is_its_network_namespace_s_and_odd_values_are_dropped() {
        let local = launch_of(&torchrun(0)).map(|mut l| {
            l.key = "none@127.0.0.1:29500".into();
            localized(l, Some(7))
        });
        assert_eq!(local.unwrap().key, "none@127.0.0.1:29500~net7");
        let remote = localized(launch_of(&torchrun(0)).unwrap(), Some(7));
        assert_eq!(remote.key, "none@10.0.0.1:29500");
        // Quotes, commas, braces, spaces: a value that could mean something
        // in a label or a log is not kept; the first definition wins.
        let env = parse_environ(
            &b"TORCHELASTIC_RUN_ID=x\",pid=\"1\0RANK=1\0RANK=2\0MASTER_ADDR=a b\0"[..],
        )
        .unwrap();
        assert_eq!(env.get("TORCHELASTIC_RUN_ID"), None);
        assert_eq!(env.get("MASTER_ADDR"), None);
        assert_eq!(env.get("RANK"), Some("1"));
        // Absurd numbers are no rank.
        assert_eq!(
            LaunchEnv::from_pairs([("RANK", "18446744073709551615")]).number("RANK"),
            None
        );
    }

    #[test]
    fn an_inner_launcher_is_the_inner_job_s_not_a_rank_of_the_outer_one() {
        let slurm = |procid: &str| {
            classify(&env(&[
                ("SLURM_JOB_ID", "7"),
                ("SLURM_STEP_ID", "0"),
                ("SLURM_PROCID", procid),
            ]))
        };
        let mut inner = torchrun(0);
        inner.extend([
            ("SLURM_JOB_ID", "7".to_owned()),
            ("SLURM_STEP_ID", "0".into()),
            ("SLURM_PROCID", "0".into()),
        ]);
        let mut inner1 = torchrun(1);
        inner1.extend(inner[7..].iter().cloned());
        // srun -> torchrun (a Slurm task) -> two torchrun ranks; and a
        // launcher inside a job that numbers its own workers.
        let mut own = launch_of(&torchrun(0)).unwrap();
        own.key = "other".into();
        let mut own1 = own.clone();
        own1.rank = Some(1);
        let procs: HashMap<u32, Proc> = [
            proc(50, 1, 1000, 1, slurm("0")),
            proc(51, 50, 1000, 2, launch_of(&inner)),
            proc(52, 50, 1000, 3, launch_of(&inner1)),
            proc(60, 1, 1000, 1, Some(own.clone())),
            proc(61, 60, 1000, 2, Some(own)),
            proc(62, 60, 1000, 3, Some(own1)),
        ]
        .into_iter()
        .map(|p| (p.pid, p))
        .collect();
        let jobs = group(&procs, |_| true);
        assert!(jobs.iter().all(|j| j.kind != JobKind::Slurm), "{jobs:#?}");
        let t = jobs.iter().find(|j| j.job_id.contains("29500")).unwrap();
        let ranks: Vec<(usize, u32)> = t.ranks.iter().map(|(r, v)| (*r, v.0)).collect();
        assert_eq!(ranks, [(0, 51), (1, 52)]);
        assert_eq!(t.launcher_pids, [50]);
        let o = jobs.iter().find(|j| j.job_id.contains("other")).unwrap();
        let ranks: Vec<(usize, u32)> = o.ranks.iter().map(|(r, v)| (*r, v.0)).collect();
        assert_eq!(
            ranks,
            [(0, 60), (1, 62)],
            "a child that says another rank is that rank"
        );
        assert_eq!(o.children[&0], [61]);
    }

    #[test]
    fn a_read_that_hangs_is_given_up_and_never_tried_again() {
        let root = std::env::temp_dir().join(format!("rw-hungproc-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(root.join("20")).unwrap();
        std::fs::create_dir_all(root.join("21")).unwrap();
        // Opening a FIFO for reading blocks until someone writes: a read
        // that hangs, as one of a FUSE-backed page would.
        let fifo = root.join("20/environ");
        let c_path = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid C string path.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        std::fs::write(root.join("21/environ"), b"RANK=1\0").unwrap();
        let mut reader = EnvReader::new(root.clone());
        // It hangs for good, so any limit is reached.
        reader.timeout = std::time::Duration::from_millis(200);
        assert!(reader.read(20).unwrap_err().contains("hung"));
        assert!(reader.read(20).unwrap_err().contains("earlier read"));
        // A fresh reader thread serves the next process (no time bound on it).
        reader.timeout = std::time::Duration::from_secs(600);
        assert_eq!(reader.read(21).unwrap().get("RANK"), Some("1"));
        // Let the hung thread go.
        drop(std::fs::OpenOptions::new().write(true).open(&fifo).unwrap());
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn stat_is_parsed_past_a_name_with_parentheses() {
        let stat = "4242 (a) b) (c) S 17 4242 4242 0 -1 4194560 1 0 0 0 0 0 0 0 20 0 1 0 98765 1 2";
        assert_eq!(parse_stat(stat), Some((17, 98765)));
    }

    #[test]
    fn this_process_is_read_and_a_fake_proc_is_scanned() {
        let me = std::process::id();
        let (p, err) = read_proc(
            Path::new("/proc"),
            me,
            Some(&mut EnvReader::new("/proc".into())),
            0,
        )
        .unwrap();
        assert_eq!(err, None);
        assert_eq!(p.pid, me);
        // SAFETY: getuid has no preconditions.
        assert_eq!(p.uid, unsafe { libc::getuid() });

        let root = std::env::temp_dir().join(format!("rw-fakeproc-{me}"));
        let _ = std::fs::remove_dir_all(&root);
        for (pid, ppid, environ) in [
            (10u32, 1u32, b"HOME=/root\0".to_vec()),
            (
                11,
                10,
                b"TORCHELASTIC_RUN_ID=r\0MASTER_ADDR=a\0MASTER_PORT=1\0RANK=0\0WORLD_SIZE=1\0"
                    .to_vec(),
            ),
        ] {
            fake_proc(&root, pid, ppid, 1000, &environ);
        }
        let mut scanner = Scanner::new(root.clone(), NodeScope::Kernel);
        let jobs = scanner.scan();
        assert_eq!(jobs.len(), 1, "{jobs:?}");
        assert_eq!(jobs[0].job_id, "torchrun/r@a:1/uid1000");
        assert_eq!(jobs[0].launcher_pids, [10]);
        assert_eq!(scanner.known(), 2);
        std::fs::remove_dir_all(root.join("11")).unwrap();
        assert!(scanner.scan().is_empty());
        assert_eq!(scanner.known(), 1);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
