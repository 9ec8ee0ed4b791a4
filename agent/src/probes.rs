//! `probes`: loads the embedded BPF object with aya, attaches its programs
//! and owns the maps the agent writes (the watched set) and reads (counters).
//!
//! It never interprets records: decoding is `events`, state is `model`.

use anyhow::{Context, Result, bail};
use aya::maps::{HashMap as BpfHashMap, MapData, PerCpuArray, RingBuf};
use aya::programs::BtfTracePoint;
use aya::{Btf, Ebpf};
use ebpf::{Counter, names};

/// The loaded and attached BPF programs of one agent.
pub struct Probes {
    ebpf: Ebpf,
    watched: BpfHashMap<MapData, u32, u8>,
    counters: PerCpuArray<MapData, u64>,
}

impl Probes {
    /// Loads the object and attaches every program. Needs root, or
    /// CAP_BPF + CAP_PERFMON, and a kernel with BTF (`/sys/kernel/btf/vmlinux`).
    pub fn load() -> Result<Self> {
        check_privileges()?;
        let btf = Btf::from_sys_fs().context(
            "reading the kernel's BTF from /sys/kernel/btf/vmlinux (ringwatch needs a kernel built with CONFIG_DEBUG_INFO_BTF=y, Linux >= 5.15)",
        )?;
        let mut ebpf = Ebpf::load(ebpf::bpf_object())
            .context("loading ringwatch's BPF object into the kernel")?;
        attach_btf_tracepoint(&mut ebpf, &btf, names::PROG_SCHED_SWITCH, "sched_switch")?;

        let watched = take_map(&mut ebpf, names::MAP_WATCHED_TGIDS)?;
        let watched =
            BpfHashMap::try_from(watched).context("map watched_tgids has an unexpected type")?;
        let counters = take_map(&mut ebpf, names::MAP_COUNTERS)?;
        let counters =
            PerCpuArray::try_from(counters).context("map counters has an unexpected type")?;
        Ok(Self {
            ebpf,
            watched,
            counters,
        })
    }

    /// Starts reporting the threads of process `tgid`.
    pub fn watch(&mut self, tgid: u32) -> Result<()> {
        if tgid == 0 {
            bail!("pid 0 is the idle task; give the pid of a real process");
        }
        self.watched
            .insert(tgid, 1, 0)
            .with_context(|| format!("adding pid {tgid} to the watched set"))
    }

    /// Stops reporting process `tgid` (no error if it was not watched).
    pub fn unwatch(&mut self, tgid: u32) -> Result<()> {
        match self.watched.remove(&tgid) {
            Ok(()) | Err(aya::maps::MapError::KeyNotFound) => Ok(()),
            Err(e) => Err(e).with_context(|| format!("removing pid {tgid} from the watched set")),
        }
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
