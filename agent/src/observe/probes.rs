//! `probes`: loads the embedded BPF object with aya, attaches its programs
//! and owns the maps the agent writes (the watched set) and reads (counters,
//! histograms, per-thread and per-connection traffic).
//!
//! It never interprets records: decoding is `events`, state is `model`.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use anyhow::{Context, Result, bail};
use aya::maps::{Array, HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::{BtfTracePoint, UProbe};
use aya::{Btf, Ebpf, EbpfLoader, Pod};
use ebpf::{Counter, SockStats, ThreadHist, ThreadKey, ThreadNet, ThreadState, names};

use super::thread_store::{StateMap, ThreadStateStore};

/// Plain-old-data wrappers so aya can read the kernel's map keys/values.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct PodThreadHist(ThreadHist);
#[repr(transparent)]
#[derive(Clone, Copy)]
struct PodThreadKey(ThreadKey);
#[repr(transparent)]
#[derive(Clone, Copy)]
struct PodThreadNet(ThreadNet);
#[repr(transparent)]
#[derive(Clone, Copy)]
struct PodSockStats(SockStats);
// SAFETY: each wraps a #[repr(C)] struct of integers (ebpf crate, layout
// checked against the C header), valid for every bit pattern.
unsafe impl Pod for PodThreadHist {}
// SAFETY: as above.
unsafe impl Pod for PodThreadKey {}
// SAFETY: as above.
unsafe impl Pod for PodThreadNet {}
// SAFETY: as above.
unsafe impl Pod for PodSockStats {}

/// Groups of probes that can be switched on and off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum ProbeSet {
    /// sched_switch, sched_wakeup(_new).
    Sched,
    /// sock_send/recv_length, tcp_retransmit_skb, tcp_probe, inet_sock_set_state.
    Tcp,
    /// uprobes on libnccl.so.
    Nccl,
}

/// How the kernel side should behave; fixed at load time.
#[derive(Debug, Clone, Default)]
pub struct ProbeConfig {
    /// Which probe groups to attach.
    pub sets: Vec<ProbeSet>,
    /// Intervals shorter than this are only counted (and in the histograms),
    /// not sent as records: bounds the event rate.
    pub min_interval_ns: u64,
    /// At most this many intervals per thread per second (0: no
    /// limit); the rest are counted and in the histograms only.
    pub max_intervals_per_s: u32,
    /// Fill the per-thread histograms of run-queue waits and off-CPU time
    /// ([`Probes::histograms`]). Only `watch` reports them; without them
    /// every switch in of a runnable thread saves a hash lookup (about a
    /// fifth of `sched_switch`'s run time under a busy job).
    pub histograms: bool,
    /// Where the kernel keeps each thread's scheduling state.
    pub thread_state: ThreadStateStore,
    /// Slots of the thread-state array (a power of two), when it is used.
    pub thread_slots: u32,
}

/// A log2 histogram of one thread: `buckets[slot]` counts durations in
/// `[2^slot, 2^(slot+1))` ns.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct Log2Histogram {
    /// slot → count (only non-empty slots).
    pub buckets: BTreeMap<u16, u64>,
}

/// Histograms of one thread.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThreadHistograms {
    /// Run-queue waits.
    pub run_queue: Log2Histogram,
    /// Off-CPU (blocked) intervals.
    pub off_cpu: Log2Histogram,
}

/// The loaded and attached BPF programs of one agent.
pub struct Probes {
    ebpf: Ebpf,
    watched: Array<MapData, u64>,
    counters: PerCpuArray<MapData, u64>,
    hist: BpfHashMap<MapData, u32, PodThreadHist>,
    thread_state: StateMap,
    thread_state_store: ThreadStateStore,
    thread_net: BpfHashMap<MapData, PodThreadKey, PodThreadNet>,
    sock_stats: BpfHashMap<MapData, u64, PodSockStats>,
    nccl_attached: BTreeSet<u32>,
    nccl_enabled: bool,
    min_interval_ns: u64,
}

impl Probes {
    /// Loads the object and attaches every tracepoint program. Needs root,
    /// or CAP_BPF + CAP_PERFMON, and a kernel with BTF.
    pub fn load(config: ProbeConfig) -> Result<Self> {
        check_privileges()?;
        let btf = Btf::from_sys_fs().context(
            "reading the kernel's BTF from /sys/kernel/btf/vmlinux (ringwatch needs a kernel built with CONFIG_DEBUG_INFO_BTF=y, Linux >= 5.15)",
        )?;
        let histograms = u8::from(config.histograms);
        let thread_state_store = config.thread_state.resolve()?;
        let task_storage = u8::from(thread_state_store == ThreadStateStore::TaskStorage);
        let slots = thread_state_store == ThreadStateStore::Slots;
        if !config.thread_slots.is_power_of_two() {
            bail!("{} thread slots: not a power of two", config.thread_slots);
        }
        let slot_mask = config.thread_slots - 1;
        let thread_slots = u8::from(slots);
        let mut loader = EbpfLoader::new();
        loader
            .btf(Some(&btf))
            .set_global(names::GLOBAL_MIN_INTERVAL_NS, &config.min_interval_ns, true)
            .set_global(
                names::GLOBAL_MAX_INTERVALS_PER_S,
                &config.max_intervals_per_s,
                true,
            )
            .set_global(names::GLOBAL_HISTOGRAMS, &histograms, true)
            .set_global(names::GLOBAL_TASK_STORAGE, &task_storage, true)
            .set_global(names::GLOBAL_THREAD_SLOTS, &thread_slots, true)
            .set_global(names::GLOBAL_THREAD_SLOT_MASK, &slot_mask, true)
            // task_state: aya has no type for task storage; we read it by hand.
            .allow_unsupported_maps();
        if task_storage == 1 {
            // Never written then: not 10 MiB of preallocated entries.
            loader.set_max_entries(names::MAP_THREAD_STATE, 1);
        }
        if slots {
            loader.set_max_entries(names::MAP_THREAD_SLOTS, config.thread_slots);
            // Only threads whose slot another holds: 2.8 MiB, not 10.
            loader.set_max_entries(names::MAP_THREAD_STATE, 16384);
        } else {
            loader.set_max_entries(names::MAP_THREAD_SLOTS, 1);
        }
        if !config.histograms {
            // Never written then: not 16 MiB of preallocated entries on every node.
            loader.set_max_entries(names::MAP_SCHED_HIST, 1);
        }
        let mut ebpf = loader
            .load(ebpf::bpf_object())
            .context("loading ringwatch's BPF object into the kernel")?;
        for (set, program, tracepoint) in [
            (ProbeSet::Sched, names::PROG_SCHED_SWITCH, "sched_switch"),
            (ProbeSet::Sched, names::PROG_SCHED_WAKEUP, "sched_wakeup"),
            (
                ProbeSet::Sched,
                names::PROG_SCHED_WAKEUP_NEW,
                "sched_wakeup_new",
            ),
            (
                ProbeSet::Tcp,
                names::PROG_SOCK_SEND_LENGTH,
                "sock_send_length",
            ),
            (
                ProbeSet::Tcp,
                names::PROG_SOCK_RECV_LENGTH,
                "sock_recv_length",
            ),
            (
                ProbeSet::Tcp,
                names::PROG_TCP_RETRANSMIT_SKB,
                "tcp_retransmit_skb",
            ),
            (ProbeSet::Tcp, names::PROG_TCP_PROBE, "tcp_probe"),
            (
                ProbeSet::Tcp,
                names::PROG_INET_SOCK_SET_STATE,
                "inet_sock_set_state",
            ),
        ] {
            if config.sets.contains(&set) {
                attach_btf_tracepoint(&mut ebpf, &btf, program, tracepoint)?;
            }
        }
        for program in names::NCCL_ENTRY_PROGS
            .iter()
            .map(|(p, _)| *p)
            .chain([names::PROG_NCCL_RETURN])
        {
            let prog: &mut UProbe = ebpf
                .program_mut(program)
                .with_context(|| format!("the BPF object has no program named {program}"))?
                .try_into()
                .with_context(|| format!("program {program} is not a uprobe"))?;
            prog.load()
                .with_context(|| format!("loading uprobe {program} (the verifier refused it)"))?;
        }

        let watched = Array::try_from(take_map(&mut ebpf, names::MAP_WATCHED_TGIDS)?)
            .context("map watched_tgids has an unexpected type")?;
        let counters = PerCpuArray::try_from(take_map(&mut ebpf, names::MAP_COUNTERS)?)
            .context("map counters has an unexpected type")?;
        let hist = BpfHashMap::try_from(take_map(&mut ebpf, names::MAP_SCHED_HIST)?)
            .context("map sched_hist has an unexpected type")?;
        let thread_state = match thread_state_store {
            ThreadStateStore::TaskStorage => match take_map(&mut ebpf, names::MAP_TASK_STATE)? {
                aya::maps::Map::Unsupported(map) => StateMap::Task {
                    map,
                    pidfds: std::collections::HashMap::new(),
                },
                _ => bail!("map task_state is not task storage"),
            },
            ThreadStateStore::Slots => StateMap::Slots {
                slots: Array::try_from(take_map(&mut ebpf, names::MAP_THREAD_SLOTS)?)
                    .context("map thread_slots has an unexpected type")?,
                mask: slot_mask,
                hash: BpfHashMap::try_from(take_map(&mut ebpf, names::MAP_THREAD_STATE)?)
                    .context("map thread_state has an unexpected type")?,
            },
            _ => StateMap::Hash(
                BpfHashMap::try_from(take_map(&mut ebpf, names::MAP_THREAD_STATE)?)
                    .context("map thread_state has an unexpected type")?,
            ),
        };
        tracing::debug!(store = ?thread_state_store, "thread state");
        let thread_net = BpfHashMap::try_from(take_map(&mut ebpf, names::MAP_THREAD_NET)?)
            .context("map thread_net has an unexpected type")?;
        let sock_stats = BpfHashMap::try_from(take_map(&mut ebpf, names::MAP_SOCK_STATS)?)
            .context("map sock_stats has an unexpected type")?;
        Ok(Self {
            ebpf,
            watched,
            counters,
            hist,
            thread_state,
            thread_state_store,
            thread_net,
            sock_stats,
            nccl_attached: BTreeSet::new(),
            nccl_enabled: config.sets.contains(&ProbeSet::Nccl),
            min_interval_ns: config.min_interval_ns,
        })
    }

    /// Scheduling intervals shorter than this stay in the kernel (added up
    /// per thread, not sent one by one), ns.
    pub fn min_interval_ns(&self) -> u64 {
        self.min_interval_ns
    }

    /// Starts reporting the threads of process `tgid`.
    pub fn watch(&mut self, tgid: u32) -> Result<()> {
        if tgid == 0 {
            bail!("pid 0 is the idle task; give the pid of a real process");
        }
        self.set_watched_bit(tgid, true)
            .with_context(|| format!("adding pid {tgid} to the watched set"))
    }

    /// Stops reporting process `tgid` (no error if it was not watched).
    pub fn unwatch(&mut self, tgid: u32) -> Result<()> {
        self.set_watched_bit(tgid, false)
            .with_context(|| format!("removing pid {tgid} from the watched set"))
    }

    /// Only this agent writes the bitmap, so read-modify-write is safe.
    fn set_watched_bit(&mut self, tgid: u32, on: bool) -> Result<()> {
        let word = tgid / 64;
        if word >= ebpf::WATCHED_WORDS {
            bail!("pid {tgid} is above the kernel's largest pid (2^22)");
        }
        let bits = self.watched.get(&word, 0)?;
        let mask = 1u64 << (tgid % 64);
        let bits = if on { bits | mask } else { bits & !mask };
        self.watched.set(word, bits, 0)?;
        Ok(())
    }

    /// Whether [`Probes::attach_nccl`] would still do something for `pid`:
    /// the NCCL probes are on and not attached to it yet.
    pub fn nccl_wanted(&self, pid: u32) -> bool {
        self.nccl_enabled && !self.nccl_attached.contains(&pid)
    }

    /// Attaches the NCCL uprobes to `library` (a libnccl.so) for process
    /// `pid` only. Returns how many entry points were found; once per pid.
    pub fn attach_nccl(&mut self, pid: u32, library: &Path) -> Result<usize> {
        if !self.nccl_enabled || !self.nccl_attached.insert(pid) {
            return Ok(0);
        }
        let target = i32::try_from(pid).context("pid out of range")?;
        let mut attached = 0;
        for (program, symbol) in names::NCCL_ENTRY_PROGS {
            let entry: &mut UProbe = self
                .ebpf
                .program_mut(program)
                .with_context(|| format!("the BPF object has no program named {program}"))?
                .try_into()
                .with_context(|| format!("program {program} is not a uprobe"))?;
            match entry.attach(Some(symbol), 0, library, Some(target)) {
                Ok(_) => {}
                Err(error) => {
                    tracing::debug!(%error, symbol, pid, library = %library.display(), "NCCL symbol not attached");
                    continue;
                }
            }
            let ret: &mut UProbe = self
                .ebpf
                .program_mut(names::PROG_NCCL_RETURN)
                .context("the BPF object has no NCCL return program")?
                .try_into()
                .context("the NCCL return program is not a uprobe")?;
            ret.attach(Some(symbol), 0, library, Some(target))
                .with_context(|| {
                    format!(
                        "attaching the return probe of {symbol} in {} for pid {pid}",
                        library.display()
                    )
                })?;
            attached += 1;
        }
        tracing::info!(pid, library = %library.display(), attached, "NCCL uprobes attached");
        Ok(attached)
    }

    /// The ring buffer the programs write records into. Can be taken once.
    pub fn take_events(&mut self) -> Result<RingBuf<MapData>> {
        let map = take_map(&mut self.ebpf, names::MAP_EVENTS)?;
        RingBuf::try_from(map).context("map events is not a ring buffer")
    }

    /// A kernel-side counter, summed over CPUs.
    pub fn counter(&self, counter: Counter) -> Result<u64> {
        let per_cpu = self
            .counters
            .get(&(counter as u32), 0)
            .with_context(|| format!("reading counter {counter:?}"))?;
        Ok(per_cpu.iter().sum())
    }

    /// Every counter by name.
    pub fn counters(&self) -> Result<BTreeMap<String, u64>> {
        Counter::ALL
            .iter()
            .map(|&c| Ok((format!("{c:?}"), self.counter(c)?)))
            .collect()
    }

    /// The histograms of the given threads, as the kernel holds them now
    /// (empty unless loaded with [`ProbeConfig::histograms`]).
    pub fn histograms(&self, tids: &BTreeSet<u32>) -> BTreeMap<u32, ThreadHistograms> {
        let buckets = |counts: &[u64]| Log2Histogram {
            buckets: (0u16..)
                .zip(counts)
                .filter(|(_, count)| **count > 0)
                .map(|(slot, count)| (slot, *count))
                .collect(),
        };
        tids.iter()
            .filter_map(|&tid| {
                // Absent: the thread never waited nor blocked (or it was
                // forgotten, or the map was full).
                let PodThreadHist(hist) = self.hist.get(&tid, 0).ok()?;
                Some((
                    tid,
                    ThreadHistograms {
                        run_queue: buckets(&hist.run_queue),
                        off_cpu: buckets(&hist.off_cpu),
                    },
                ))
            })
            .collect()
    }

    /// Deletes the histograms, traffic counters and scheduling
    /// state of threads the model forgot, so the kernel maps stay bounded
    /// on a long run. (The kernel deletes an exiting thread's state itself;
    /// a live thread of a watched process is never forgotten, as its state
    /// is read every refresh.)
    pub fn forget_threads(&mut self, tids: &[u32]) {
        if tids.is_empty() {
            return;
        }
        self.thread_state.forget(tids);
        for tid in tids {
            let _ = self.hist.remove(tid);
        }
        let doomed_net: Vec<PodThreadKey> = self
            .thread_net
            .keys()
            .flatten()
            .filter(|k| tids.contains(&k.0.tid))
            .collect();
        for key in doomed_net {
            let _ = self.thread_net.remove(&key);
        }
    }

    /// Scheduling state and context-switch counts of the threads of
    /// `processes` (tid → state); `known`: threads of each already seen.
    pub fn thread_states(
        &mut self,
        processes: &BTreeSet<u32>,
        known: &BTreeMap<u32, Vec<u32>>,
    ) -> Vec<(u32, ThreadState)> {
        self.thread_state.read(processes, known)
    }

    /// Where thread state is kept (checked against this kernel at load).
    pub fn thread_state_store(&self) -> ThreadStateStore {
        self.thread_state_store
    }

    /// TCP bytes and calls per thread (cumulative, exact).
    pub fn thread_net(&self) -> Vec<(ThreadKey, ThreadNet)> {
        self.thread_net
            .iter()
            .flatten()
            .map(|(k, v)| (k.0, v.0))
            .collect()
    }

    /// Open TCP connections of watched processes (key: struct sock address).
    pub fn sockets(&self) -> Vec<(u64, SockStats)> {
        self.sock_stats
            .iter()
            .flatten()
            .map(|(k, v)| (k, v.0))
            .collect()
    }
}

fn take_map(ebpf: &mut Ebpf, name: &str) -> Result<aya::maps::Map> {
    ebpf.take_map(name).with_context(|| {
        format!("the BPF object has no map named {name} (was it built from this source tree?)")
    })
}

fn attach_btf_tracepoint(
    ebpf: &mut Ebpf,
    btf: &Btf,
    program: &str,
    tracepoint: &str,
) -> Result<()> {
    let prog: &mut BtfTracePoint = ebpf
        .program_mut(program)
        .with_context(|| format!("the BPF object has no program named {program}"))?
        .try_into()
        .with_context(|| format!("program {program} is not a BTF tracepoint"))?;
    prog.load(tracepoint, btf).with_context(|| {
        format!(
            "loading {program} for BTF tracepoint {tracepoint} (the kernel verifier refused it)"
        )
    })?;
    prog.attach()
        .with_context(|| format!("attaching {program} to BTF tracepoint {tracepoint}"))?;
    Ok(())
}

/// Fails early, with what to do, when the agent cannot possibly load BPF.
fn check_privileges() -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    let euid = unsafe { libc::geteuid() };
    if euid == 0 {
        return Ok(());
    }
    // Not root: CAP_BPF (39) and CAP_PERFMON (38) are enough on >= 5.8.
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let effective = status
        .lines()
        .find_map(|line| line.strip_prefix("CapEff:"))
        .and_then(|hex| u64::from_str_radix(hex.trim(), 16).ok())
        .unwrap_or(0);
    const CAP_PERFMON: u64 = 1 << 38;
    const CAP_BPF: u64 = 1 << 39;
    if effective & (CAP_BPF | CAP_PERFMON) == CAP_BPF | CAP_PERFMON {
        return Ok(());
    }
    bail!(
        "ringwatch-agent needs root, or the capabilities CAP_BPF and CAP_PERFMON, to load its eBPF programs (running as uid {euid}); run it with sudo, or `setcap cap_bpf,cap_perfmon+ep` on the binary"
    )
}
