//! NCCL's collectives from ringwatch's profiler plugin
//! (`collectives/nccl-profiler`, loaded by a job with
//! `NCCL_PROFILER_PLUGIN`): the socket the plugins of the node's jobs write
//! to, and what the agent keeps of their records.
//!
//! The socket is `<runtime dir>/nccl-profiler.socket` (mode 0666: a job of
//! any user writes to it). Nothing a plugin says about itself is trusted:
//! its records are the process's the kernel names as the peer
//! (`SO_PEERCRED`); each line is at most [`MAX_LINE`] bytes and must parse
//! in full (names `[A-Za-z0-9_]`, at most 24 bytes), or the connection is
//! closed; a connection silent for [`READ_TIMEOUT`] (the plugin sends its
//! counters every 5 s) is closed; at most [`MAX_CONNECTIONS`] are open.
//! Kept: the last [`RECORDS_PER_PROCESS`] collectives of at most
//! [`MAX_PROCESSES`] processes, and their totals per communicator (the
//! first [`COMMS_PER_PROCESS`] a process names; later ones are `other`),
//! function and size bucket — so the memory and the metric series it makes
//! are bounded whatever the jobs send.
//!
//! Records of one collective on different ranks share the communicator's
//! hash, the function and NCCL's sequence number: [`NcclProfiler::matched`]
//! lines them up.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::{FileTypeExt, PermissionsExt};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::model::monotonic_ns;

/// The socket's name in the runtime directory (not `*.sock`: the jobs
/// registry connects to those).
pub const SOCKET_NAME: &str = "nccl-profiler.socket";
/// The plugin library's file name (as cargo builds it).
pub const LIBRARY_NAME: &str = "libringwatch_nccl_profiler.so";

/// Copies the plugin library `lib` to `<dir>/lib/` (the directory made
/// 0755 and owned by the agent; refused if it is a link or someone else's),
/// by a rename, so a job loading it never sees half a file. Returns where.
pub fn publish_library(lib: &Path, dir: &Path) -> Result<PathBuf> {
    use std::os::unix::fs::MetadataExt;
    let lib_dir = dir.join("lib");
    match std::fs::symlink_metadata(&lib_dir) {
        Ok(meta) => {
            // SAFETY: geteuid cannot fail.
            let me = unsafe { libc::geteuid() };
            if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o022 != 0 {
                bail!(
                    "{} is not a directory of this agent's user that only it can write",
                    lib_dir.display()
                );
            }
        }
        Err(_) => {
            std::fs::create_dir(&lib_dir)
                .with_context(|| format!("creating {}", lib_dir.display()))?;
            std::fs::set_permissions(&lib_dir, std::fs::Permissions::from_mode(0o755))
                .with_context(|| format!("setting the mode of {}", lib_dir.display()))?;
        }
    }
    let target = lib_dir.join(LIBRARY_NAME);
    let tmp = lib_dir.join(format!(".{LIBRARY_NAME}.{}", std::process::id()));
    std::fs::copy(lib, &tmp)
        .with_context(|| format!("copying {} to {}", lib.display(), tmp.display()))?;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o644))
        .with_context(|| format!("setting the mode of {}", tmp.display()))?;
    std::fs::rename(&tmp, &target)
        .with_context(|| format!("renaming {} to {}", tmp.display(), target.display()))?;
    Ok(target)
}

/// The wire protocol's version.
pub const PROTO: u32 = 1;
/// The longest line read.
pub const MAX_LINE: usize = 2048;
/// A connection silent this long is closed.
pub const READ_TIMEOUT: Duration = Duration::from_secs(30);
/// Plugin connections open at once.
pub const MAX_CONNECTIONS: usize = 256;
/// Processes whose records are kept.
pub const MAX_PROCESSES: usize = 256;
/// Collectives kept per process.
pub const RECORDS_PER_PROCESS: usize = 4096;
/// Communicators with their own series per process.
pub const COMMS_PER_PROCESS: usize = 8;
/// Longest name accepted.
const MAX_NAME: usize = 24;

/// A record line as the plugin writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireRecord {
    seq: u64,
    comm: String,
    rank: i32,
    nranks: i32,
    func: String,
    datatype: String,
    count: u64,
    bytes: u64,
    algo: String,
    proto: String,
    channels: u32,
    channels_done: u32,
    enqueue_ns: [u64; 2],
    kernel_cpu_ns: [u64; 2],
    gpu_ns: [u64; 2],
    profiler: u8,
}

/// What a plugin counted since its process loaded it.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PluginCounters {
    /// Collectives completed.
    pub collectives: u64,
    /// Records the agent's socket accepted.
    pub sent: u64,
    /// Dropped because the plugin's queue was full (the agent slow).
    pub dropped_queue_full: u64,
    /// Dropped while no agent was connected.
    pub dropped_no_agent: u64,
    /// Sent with kernel channels missing.
    pub incomplete: u64,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct WireCounters {
    counters: PluginCounters,
}

#[derive(Debug, Deserialize)]
struct Hello {
    hello: String,
    proto: u32,
    #[serde(default)]
    profiler: u8,
}

/// One collective of one rank.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, ToSchema)]
pub struct Collective {
    /// The process that sent it (as the kernel names the socket's peer).
    pub pid: u32,
    /// The communicator's hash, hex.
    pub comm: String,
    pub rank: i32,
    /// Ranks of the communicator (0: NCCL did not say, profiler v3).
    pub nranks: i32,
    /// NCCL's sequence number (per communicator and function).
    pub seq: u64,
    /// `AllReduce`, `AllGather`, …
    pub func: String,
    pub datatype: String,
    /// Elements.
    pub count: u64,
    /// Bytes (elements × the datatype's size).
    pub bytes: u64,
    pub algo: String,
    pub proto: String,
    /// Channels NCCL said it uses, and those seen to stop.
    pub channels: u32,
    pub channels_done: u32,
    /// Enqueue start and stop, CLOCK_MONOTONIC ns.
    pub enqueue_ns: [u64; 2],
    /// When the plugin saw the first kernel channel start and the last stop
    /// (CLOCK_MONOTONIC ns; 0 if never).
    pub kernel_cpu_ns: [u64; 2],
    /// The GPU's own start and stop (`%globaltimer` ns; 0 where NCCL does
    /// not give them, before NCCL 2.27).
    pub gpu_ns: [u64; 2],
    /// The plugin version NCCL loaded.
    pub profiler: u8,
}

impl Collective {
    /// How long it ran: on the GPU where its times are given, else between
    /// the plugin seeing its first channel start and its last stop. None if
    /// neither is known.
    pub fn duration_ns(&self) -> Option<u64> {
        let [gs, ge] = self.gpu_ns;
        if gs > 0 && ge > gs {
            return Some(ge - gs);
        }
        let [ks, ke] = self.kernel_cpu_ns;
        (ks > 0 && ke > ks).then(|| ke - ks)
    }

    /// Bytes as NCCL's bus-bandwidth formula counts them (nccl-tests'
    /// factors; NCCL's count of an AllGather or ReduceScatter is one
    /// rank's part). None where the communicator's size is not known.
    pub fn bus_bytes(&self) -> Option<f64> {
        let n = f64::from(self.nranks);
        if self.nranks <= 0 {
            return None;
        }
        let b = self.bytes as f64;
        Some(match self.func.as_str() {
            "AllReduce" => b * 2.0 * (n - 1.0) / n,
            "AllGather" | "ReduceScatter" => b * (n - 1.0),
            "AlltoAll" => b * (n - 1.0) / n,
            _ => b,
        })
    }
}

/// The size bucket of a collective (label `size`).
pub fn size_bucket(bytes: u64) -> &'static str {
    const KIB: u64 = 1024;
    const MIB: u64 = 1024 * KIB;
    match bytes {
        b if b < 64 * KIB => "0-64KiB",
        b if b < MIB => "64KiB-1MiB",
        b if b < 16 * MIB => "1MiB-16MiB",
        b if b < 256 * MIB => "16MiB-256MiB",
        _ => "256MiB+",
    }
}

/// NCCL functions with their own series; others are `other`.
const FUNCS: [&str; 9] = [
    "AllReduce",
    "AllGather",
    "ReduceScatter",
    "Broadcast",
    "Reduce",
    "AlltoAll",
    "Gather",
    "Scatter",
    "SendRecv",
];

/// Totals of one series (communicator, function, size bucket).
#[derive(Debug, Default, Clone, Copy, PartialEq, Serialize)]
pub struct SeriesTotals {
    pub collectives: u64,
    /// Of them, with a duration.
    pub timed: u64,
    pub seconds: f64,
    pub bytes: u64,
    /// Bus bytes of the timed ones (for bus bandwidth = bus bytes / seconds).
    pub bus_bytes: f64,
}

/// A series' labels: communicator (hex, or `other`), function, size bucket.
pub type SeriesKey = (String, &'static str, &'static str);

#[derive(Debug, Default)]
struct Proc {
    uid: u32,
    connections: usize,
    recent: VecDeque<Collective>,
    series: BTreeMap<SeriesKey, SeriesTotals>,
    comms: Vec<String>,
    counters: PluginCounters,
    last_ns: u64,
    /// min(CPU time the last channel was seen to stop − GPU stop time): the
    /// GPU clock's offset, as tight as the records allow.
    gpu_offset_ns: Option<i64>,
    profiler: u8,
}

#[derive(Debug, Default)]
struct Inner {
    procs: HashMap<u32, Proc>,
    connections: usize,
    /// Connections closed for a bad line, refused at the cap, or whose
    /// process could not be kept.
    refused: u64,
    malformed: u64,
}

/// What one process's plugin sent, for `/metrics`.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessTotals {
    pub pid: u32,
    pub uid: u32,
    pub profiler: u8,
    pub counters: PluginCounters,
    pub series: Vec<(SeriesKey, SeriesTotals)>,
}

/// One collective matched across the ranks that reported it.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct MatchedCollective {
    pub comm: String,
    pub func: String,
    pub seq: u64,
    pub bytes: u64,
    /// Ranks of the communicator (0 if not known).
    pub nranks: i32,
    /// The ranks' records, by rank.
    pub ranks: Vec<Collective>,
    /// The rank whose kernel started last (GPU clock where given, else the
    /// plugin's CPU clock), when at least two ranks are here.
    pub last_to_start: Option<i32>,
    /// Last start − first start, µs.
    pub start_spread_us: Option<f64>,
}

/// The records of the node's plugins (cheap to clone: shared).
#[derive(Debug, Clone, Default)]
pub struct NcclProfiler {
    inner: Arc<Mutex<Inner>>,
}

fn valid_name(s: &str) -> bool {
    s.len() <= MAX_NAME && s.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
}

impl NcclProfiler {
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Listens on `path` (a stale socket there is replaced; anything else
    /// there is an error), mode 0666, and serves plugins on threads of its
    /// own until the process ends.
    pub fn listen(&self, path: &Path) -> Result<PathBuf> {
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => std::fs::remove_file(path)
                .with_context(|| format!("removing the old socket {}", path.display()))?,
            Ok(_) => bail!(
                "{} exists and is not a socket: not replaced",
                path.display()
            ),
            Err(_) => {}
        }
        let listener =
            UnixListener::bind(path).with_context(|| format!("binding {}", path.display()))?;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .with_context(|| format!("making {} writable for jobs", path.display()))?;
        let store = self.clone();
        std::thread::Builder::new()
            .name("nccl-profiler".into())
            .spawn(move || store.accept(&listener))
            .context("starting the NCCL profiler socket's thread")?;
        Ok(path.to_path_buf())
    }

    fn accept(&self, listener: &UnixListener) {
        for stream in listener.incoming() {
            let Ok(stream) = stream else {
                continue;
            };
            {
                let mut inner = self.lock();
                if inner.connections >= MAX_CONNECTIONS {
                    inner.refused += 1;
                    continue;
                }
                inner.connections += 1;
            }
            let store = self.clone();
            let spawned = std::thread::Builder::new()
                .name("nccl-plugin".into())
                .spawn(move || {
                    store.serve(stream);
                    store.lock().connections -= 1;
                });
            if spawned.is_err() {
                self.lock().connections -= 1;
            }
        }
    }

    /// One plugin's connection, until it closes, says something wrong or
    /// falls silent.
    fn serve(&self, stream: UnixStream) {
        let Ok(peer) = collectives::control::peer_credentials(&stream) else {
            return;
        };
        let pid = peer.pid;
        if stream.set_read_timeout(Some(READ_TIMEOUT)).is_err()
            || stream
                .set_write_timeout(Some(Duration::from_secs(2)))
                .is_err()
        {
            return;
        }
        let mut reader = BufReader::new(&stream);
        let mut line = Vec::with_capacity(512);
        if read_line(&mut reader, &mut line) != Line::Read {
            return;
        }
        let answer = match serde_json::from_slice::<Hello>(&line) {
            Ok(h) if h.hello == "ringwatch-nccl-profiler" && h.proto == PROTO => {
                if !self.attach(pid, peer.uid, h.profiler) {
                    self.lock().refused += 1;
                    let _ = (&stream).write_all(
                        b"{\"ok\":false,\"error\":\"the agent keeps the records of too many processes\"}\n",
                    );
                    return;
                }
                "{\"ok\":true,\"proto\":1}\n".to_owned()
            }
            Ok(h) => format!(
                "{{\"ok\":false,\"error\":\"protocol {} of {:?} is not spoken here (ringwatch-nccl-profiler, protocol {PROTO})\"}}\n",
                h.proto,
                h.hello.chars().take(40).collect::<String>()
            ),
            Err(_) => {
                self.lock().malformed += 1;
                "{\"ok\":false,\"error\":\"expected a hello line\"}\n".to_owned()
            }
        };
        let ok = answer.starts_with("{\"ok\":true");
        if (&stream).write_all(answer.as_bytes()).is_err() || !ok {
            return;
        }
        tracing::debug!(pid, uid = peer.uid, "an NCCL profiler plugin connected");
        loop {
            match read_line(&mut reader, &mut line) {
                Line::Read => {}
                Line::End => break,
                Line::TooLong => {
                    self.lock().malformed += 1;
                    tracing::debug!(pid, "closing an NCCL profiler connection: an overlong line");
                    break;
                }
            }
            if !self.take_line(pid, &line) {
                self.lock().malformed += 1;
                tracing::debug!(pid, "closing an NCCL profiler connection: a malformed line");
                break;
            }
        }
        if let Some(p) = self.lock().procs.get_mut(&pid) {
            p.connections = p.connections.saturating_sub(1);
        }
    }

    /// Makes room for `pid`'s records: false when every kept process is
    /// connected and the cap is reached.
    fn attach(&self, pid: u32, uid: u32, profiler: u8) -> bool {
        let mut inner = self.lock();
        if !inner.procs.contains_key(&pid) && inner.procs.len() >= MAX_PROCESSES {
            let oldest = inner
                .procs
                .iter()
                .filter(|(_, p)| p.connections == 0)
                .min_by_key(|(_, p)| p.last_ns)
                .map(|(&pid, _)| pid);
            match oldest {
                Some(old) => {
                    inner.procs.remove(&old);
                }
                None => return false,
            }
        }
        let p = inner.procs.entry(pid).or_default();
        if p.uid != uid && !p.recent.is_empty() {
            // A new process under a reused pid: the old one's records go.
            *p = Proc::default();
        }
        p.uid = uid;
        p.connections += 1;
        p.profiler = profiler;
        p.last_ns = monotonic_ns();
        true
    }

    /// One line after the hello: a record or the plugin's counters. False
    /// if it is neither.
    fn take_line(&self, pid: u32, line: &[u8]) -> bool {
        if line.starts_with(b"{\"counters\"") {
            let Ok(c) = serde_json::from_slice::<WireCounters>(line) else {
                return false;
            };
            if let Some(p) = self.lock().procs.get_mut(&pid) {
                p.counters = c.counters;
                p.last_ns = monotonic_ns();
            }
            return true;
        }
        let Ok(w) = serde_json::from_slice::<WireRecord>(line) else {
            return false;
        };
        let names_ok = [&w.func, &w.datatype, &w.algo, &w.proto]
            .iter()
            .all(|s| valid_name(s));
        let comm_ok = w.comm.len() == 16 && w.comm.bytes().all(|b| b.is_ascii_hexdigit());
        if !(names_ok && comm_ok) {
            return false;
        }
        self.add(Collective {
            pid,
            comm: w.comm,
            rank: w.rank,
            nranks: w.nranks,
            seq: w.seq,
            func: w.func,
            datatype: w.datatype,
            count: w.count,
            bytes: w.bytes,
            algo: w.algo,
            proto: w.proto,
            channels: w.channels,
            channels_done: w.channels_done,
            enqueue_ns: w.enqueue_ns,
            kernel_cpu_ns: w.kernel_cpu_ns,
            gpu_ns: w.gpu_ns,
            profiler: w.profiler,
        });
        true
    }

    /// Keeps one collective (also used by tests).
    pub fn add(&self, c: Collective) {
        let mut inner = self.lock();
        let Some(p) = inner.procs.get_mut(&c.pid) else {
            return;
        };
        p.last_ns = monotonic_ns();
        let comm = if p.comms.contains(&c.comm) {
            c.comm.clone()
        } else if p.comms.len() < COMMS_PER_PROCESS {
            p.comms.push(c.comm.clone());
            c.comm.clone()
        } else {
            "other".to_owned()
        };
        let func = FUNCS
            .iter()
            .find(|&&f| f == c.func)
            .copied()
            .unwrap_or("other");
        let totals = p
            .series
            .entry((comm, func, size_bucket(c.bytes)))
            .or_default();
        totals.collectives += 1;
        totals.bytes = totals.bytes.saturating_add(c.bytes);
        if let Some(ns) = c.duration_ns() {
            totals.timed += 1;
            totals.seconds += ns as f64 / 1e9;
            totals.bus_bytes += c.bus_bytes().unwrap_or(0.0);
        }
        let [_, gpu_stop] = c.gpu_ns;
        let [_, cpu_stop] = c.kernel_cpu_ns;
        if gpu_stop > 0 && cpu_stop > 0 {
            let offset = (i128::from(cpu_stop) - i128::from(gpu_stop))
                .clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64;
            p.gpu_offset_ns = Some(p.gpu_offset_ns.map_or(offset, |o| o.min(offset)));
        }
        p.recent.push_back(c);
        if p.recent.len() > RECORDS_PER_PROCESS {
            p.recent.pop_front();
        }
    }

    /// Registers a process as if its plugin had connected (tests).
    #[cfg(test)]
    pub fn attach_for_test(&self, pid: u32) {
        assert!(self.attach(pid, 0, 6));
        if let Some(p) = self.lock().procs.get_mut(&pid) {
            p.connections = 0;
        }
    }

    /// Per process: its plugin's counters and the series' totals.
    pub fn totals(&self) -> Vec<ProcessTotals> {
        let inner = self.lock();
        let mut out: Vec<ProcessTotals> = inner
            .procs
            .iter()
            .map(|(&pid, p)| ProcessTotals {
                pid,
                uid: p.uid,
                profiler: p.profiler,
                counters: p.counters,
                series: p.series.iter().map(|(k, v)| (k.clone(), *v)).collect(),
            })
            .collect();
        out.sort_by_key(|p| p.pid);
        out
    }

    /// Collectives of `pid` placed in `[from_ns, to_ns)` (CLOCK_MONOTONIC),
    /// each with its start and end there (see [`NcclProfiler::placed`]).
    pub fn window(&self, pid: u32, from_ns: u64, to_ns: u64) -> Vec<(Collective, u64, u64)> {
        let inner = self.lock();
        let Some(p) = inner.procs.get(&pid) else {
            return Vec::new();
        };
        p.recent
            .iter()
            .filter_map(|c| {
                let (s, e) = placed(c, p.gpu_offset_ns)?;
                (e >= from_ns && s < to_ns).then(|| (c.clone(), s, e))
            })
            .collect()
    }

    /// The pids with records.
    pub fn pids(&self) -> Vec<u32> {
        let mut pids: Vec<u32> = self.lock().procs.keys().copied().collect();
        pids.sort_unstable();
        pids
    }

    /// The latest `limit` collectives seen on this node, each with the
    /// records of every rank here that reported it (matched by
    /// communicator, function and sequence number), newest first.
    pub fn matched(&self, comm: Option<&str>, limit: usize) -> Vec<MatchedCollective> {
        let inner = self.lock();
        let mut groups: HashMap<(String, String, u64), Vec<Collective>> = HashMap::new();
        for p in inner.procs.values() {
            for c in p.recent.iter().filter(|c| comm.is_none_or(|x| x == c.comm)) {
                groups
                    .entry((c.comm.clone(), c.func.clone(), c.seq))
                    .or_default()
                    .push(c.clone());
            }
        }
        drop(inner);
        let mut out: Vec<MatchedCollective> = groups
            .into_iter()
            .map(|((comm, func, seq), mut ranks)| {
                ranks.sort_by_key(|c| (c.rank, c.pid));
                // Like with like: GPU clocks if every rank gives one, else
                // the plugins' CPU clocks if every rank saw its kernel.
                let starts: Option<Vec<(i32, u64)>> = if ranks.iter().all(|c| c.gpu_ns[0] > 0) {
                    Some(ranks.iter().map(|c| (c.rank, c.gpu_ns[0])).collect())
                } else if ranks.iter().all(|c| c.kernel_cpu_ns[0] > 0) {
                    Some(ranks.iter().map(|c| (c.rank, c.kernel_cpu_ns[0])).collect())
                } else {
                    None
                };
                let starts = starts.unwrap_or_default();
                let (last_to_start, start_spread_us) = if starts.len() >= 2 {
                    let first = starts.iter().map(|&(_, s)| s).min().unwrap_or(0);
                    let (rank, last) = starts
                        .iter()
                        .copied()
                        .max_by_key(|&(_, s)| s)
                        .unwrap_or((0, first));
                    (Some(rank), Some((last - first) as f64 / 1e3))
                } else {
                    (None, None)
                };
                MatchedCollective {
                    bytes: ranks.first().map_or(0, |c| c.bytes),
                    nranks: ranks.first().map_or(0, |c| c.nranks),
                    comm,
                    func,
                    seq,
                    ranks,
                    last_to_start,
                    start_spread_us,
                }
            })
            .collect();
        out.sort_by_key(|m| {
            std::cmp::Reverse(m.ranks.iter().map(|c| c.enqueue_ns[0]).max().unwrap_or(0))
        });
        out.truncate(limit);
        out
    }

    /// Connections open now, refused, and closed for a malformed line.
    pub fn connection_counts(&self) -> (usize, u64, u64) {
        let inner = self.lock();
        (inner.connections, inner.refused, inner.malformed)
    }
}

/// Where a collective goes on the agent's clock (CLOCK_MONOTONIC ns):
/// its GPU run where NCCL gives GPU times (moved by the process's
/// smallest observed lag between the GPU stop and the plugin seeing it,
/// so never later than it was seen), else from the first channel seen to
/// start to the last seen to stop, else its enqueue.
pub fn placed(c: &Collective, gpu_offset_ns: Option<i64>) -> Option<(u64, u64)> {
    let [gs, ge] = c.gpu_ns;
    if let Some(off) = gpu_offset_ns
        && gs > 0
        && ge >= gs
    {
        let s = (i128::from(gs) + i128::from(off)).max(0) as u64;
        let e = (i128::from(ge) + i128::from(off)).max(0) as u64;
        return Some((s, e));
    }
    let [ks, ke] = c.kernel_cpu_ns;
    if ks > 0 && ke >= ks {
        return Some((ks, ke));
    }
    let [es, ee] = c.enqueue_ns;
    (es > 0 && ee >= es).then_some((es, ee))
}

/// What [`read_line`] read.
#[derive(Debug, PartialEq, Eq)]
enum Line {
    /// A line, in the buffer without its newline.
    Read,
    /// The end, a timeout or an error.
    End,
    /// A line longer than [`MAX_LINE`].
    TooLong,
}

/// Reads one line of at most [`MAX_LINE`] bytes.
fn read_line(reader: &mut BufReader<&UnixStream>, line: &mut Vec<u8>) -> Line {
    line.clear();
    match reader
        .by_ref()
        .take(MAX_LINE as u64 + 1)
        .read_until(b'\n', line)
    {
        Ok(0) | Err(_) => Line::End,
        Ok(_) if line.last() == Some(&b'\n') => {
            line.pop();
            Line::Read
        }
        Ok(n) if n > MAX_LINE => Line::TooLong,
        // The peer closed (or timed out) mid-line.
        Ok(_) => Line::End,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn coll(pid: u32, rank: i32, seq: u64, gpu: [u64; 2]) -> Collective {
        Collective {
            pid,
            comm: "00000000000000ab".into(),
            rank,
            nranks: 2,
            seq,
            func: "AllReduce".into(),
            datatype: "ncclFloat32".into(),
            count: 1024,
            bytes: 4096,
            algo: "RING".into(),
            proto: "SIMPLE".into(),
            channels: 2,
            channels_done: 2,
            enqueue_ns: [100, 110],
            kernel_cpu_ns: [gpu[0] + 1_000, gpu[1] + 5_000],
            gpu_ns: gpu,
            profiler: 6,
        }
    }

    #[test]
    fn totals_are_per_communicator_function_and_size() {
        let store = NcclProfiler::default();
        store.attach_for_test(10);
        store.add(coll(10, 0, 0, [1_000_000, 1_500_000]));
        store.add(coll(10, 0, 1, [2_000_000, 2_250_000]));
        let totals = store.totals();
        assert_eq!(totals.len(), 1);
        let (key, t) = &totals[0].series[0];
        assert_eq!(
            key,
            &("00000000000000ab".to_owned(), "AllReduce", "0-64KiB")
        );
        assert_eq!(t.collectives, 2);
        assert_eq!(t.timed, 2);
        assert!((t.seconds - 750e-6).abs() < 1e-12);
        // 2 × 4096 × 2·(2−1)/2 bus bytes.
        assert!((t.bus_bytes - 8192.0).abs() < 1e-9);
    }

    #[test]
    fn a_process_gets_at_most_eight_communicators_of_its_own() {
        let store = NcclProfiler::default();
        store.attach_for_test(10);
        for i in 0..12u64 {
            let mut c = coll(10, 0, 0, [1, 2]);
            c.comm = format!("{i:016x}");
            store.add(c);
        }
        let series = &store.totals()[0].series;
        assert_eq!(series.len(), COMMS_PER_PROCESS + 1);
        let other = series.iter().find(|(k, _)| k.0 == "other").unwrap();
        assert_eq!(other.1.collectives, 4);
    }

    #[test]
    fn records_are_matched_across_ranks_by_sequence_number() {
        let store = NcclProfiler::default();
        store.attach_for_test(10);
        store.attach_for_test(11);
        store.add(coll(10, 0, 5, [1_000, 2_000]));
        store.add(coll(11, 1, 5, [1_400, 2_000]));
        store.add(coll(11, 1, 6, [3_000, 4_000]));
        let matched = store.matched(None, 10);
        let five = matched.iter().find(|m| m.seq == 5).unwrap();
        assert_eq!(five.ranks.len(), 2);
        assert_eq!(five.last_to_start, Some(1));
        assert_eq!(five.start_spread_us, Some(0.4));
        let six = matched.iter().find(|m| m.seq == 6).unwrap();
        assert_eq!(six.ranks.len(), 1);
        assert_eq!(six.last_to_start, None);
    }

    #[test]
    fn gpu_times_are_placed_by_the_smallest_lag_seen() {
        let store = NcclProfiler::default();
        store.attach_for_test(10);
        // GPU clock = CPU clock − 1 ms; the plugin saw the stops 5 µs and
        // 2 µs late.
        let mut a = coll(10, 0, 0, [9_000_000, 9_100_000]);
        a.kernel_cpu_ns = [10_000_500, 10_105_000];
        let mut b = coll(10, 0, 1, [9_200_000, 9_300_000]);
        b.kernel_cpu_ns = [10_200_500, 10_302_000];
        store.add(a);
        store.add(b);
        let w = store.window(10, 0, u64::MAX);
        assert_eq!(w.len(), 2);
        assert_eq!((w[0].1, w[0].2), (10_002_000, 10_102_000));
        assert_eq!((w[1].1, w[1].2), (10_202_000, 10_302_000));
    }

    fn serve_pair() -> (NcclProfiler, UnixStream) {
        let store = NcclProfiler::default();
        let (a, b) = UnixStream::pair().unwrap();
        let s = store.clone();
        std::thread::spawn(move || s.serve(a));
        (store, b)
    }

    fn answer(stream: &UnixStream) -> String {
        let mut line = String::new();
        BufReader::new(stream).read_line(&mut line).unwrap();
        line
    }

    #[test]
    fn a_peer_that_is_not_a_plugin_is_answered_no_and_keeps_nothing() {
        let (store, mut peer) = serve_pair();
        peer.write_all(b"GET / HTTP/1.1\n").unwrap();
        assert!(answer(&peer).starts_with("{\"ok\":false"));
        let (store2, mut peer2) = serve_pair();
        peer2
            .write_all(b"{\"hello\":\"ringwatch-nccl-profiler\",\"proto\":2}\n")
            .unwrap();
        let a = answer(&peer2);
        assert!(a.contains("protocol 2"), "{a}");
        assert!(store.pids().is_empty() && store2.pids().is_empty());
    }

    #[test]
    fn a_malformed_or_overlong_line_closes_the_connection() {
        for bad in [
            "{\"seq\":1}\n".to_owned(),
            format!("{}\n", "x".repeat(MAX_LINE + 10)),
            // A name with a quote in it.
            coll_line().replace("\"RING\"", "\"RI\\\"NG\""),
        ] {
            let (store, mut peer) = serve_pair();
            peer.write_all(b"{\"hello\":\"ringwatch-nccl-profiler\",\"proto\":1,\"profiler\":6}\n")
                .unwrap();
            assert!(answer(&peer).starts_with("{\"ok\":true"));
            let _ = peer.write_all(bad.as_bytes());
            let _ = peer.write_all(coll_line().as_bytes());
            // The agent closes its end: reading gives EOF.
            let mut rest = Vec::new();
            peer.set_read_timeout(Some(Duration::from_secs(60)))
                .unwrap();
            let _ = peer.read_to_end(&mut rest);
            let (_, _, malformed) = store.connection_counts();
            assert_eq!(malformed, 1);
            assert!(store.window(std::process::id(), 0, u64::MAX).is_empty());
        }
    }

    fn coll_line() -> String {
        "{\"seq\":3,\"comm\":\"00000000000000ab\",\"rank\":0,\"nranks\":2,\"func\":\"AllReduce\",\"datatype\":\"ncclFloat32\",\"count\":4,\"bytes\":16,\"algo\":\"RING\",\"proto\":\"LL\",\"channels\":1,\"channels_done\":1,\"enqueue_ns\":[1,2],\"kernel_cpu_ns\":[3,4],\"gpu_ns\":[0,0],\"profiler\":3}\n".to_owned()
    }

    #[test]
    fn records_are_the_peers_whatever_they_say() {
        let (store, mut peer) = serve_pair();
        peer.write_all(b"{\"hello\":\"ringwatch-nccl-profiler\",\"proto\":1,\"profiler\":3}\n")
            .unwrap();
        assert!(answer(&peer).starts_with("{\"ok\":true"));
        peer.write_all(coll_line().as_bytes()).unwrap();
        drop(peer);
        // The peer of a socket pair is this process.
        let me = std::process::id();
        let seen = test_support::eventually(Duration::from_secs(300), "the record is kept", || {
            Some(store.window(me, 0, u64::MAX)).filter(|w| !w.is_empty())
        });
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].0.pid, me);
        assert_eq!((seen[0].1, seen[0].2), (3, 4));
    }
}
