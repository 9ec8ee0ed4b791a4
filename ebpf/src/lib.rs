//! `ebpf`: ringwatch's kernel-side programs, compiled and embedded.
//!
//! The C sources live beside this crate (`ebpf/*.bpf.c`, `ebpf/include/`);
//! `build.rs` compiles them with clang into one CO-RE object that
//! [`bpf_object`] returns, ready for `aya::Ebpf::load`. This crate also holds
//! the `#[repr(C)]` mirrors of the records in `include/ringwatch.h`, checked
//! against the C compiler's layout by the `layout` test.
//!
//! It never loads or attaches anything: that is the agent's job.

/// Bytes aligned for the ELF parser (aya reads the object in place).
#[repr(C, align(8))]
struct Aligned<Bytes: ?Sized>(Bytes);

static BPF_OBJECT: &Aligned<[u8]> = &Aligned(*include_bytes!(concat!(
    env!("OUT_DIR"),
    "/ringwatch.bpf.o"
)));

/// The compiled BPF object (ELF, with BTF), 8-byte aligned.
pub fn bpf_object() -> &'static [u8] {
    &BPF_OBJECT.0
}

/// Names of the maps and programs in the object, as the C sources spell them.
pub mod names {
    /// `ARRAY` of `u64`: bitmap of thread-group ids to watch (bit
    /// `tgid % 64` of element `tgid / 64`), [`crate::WATCHED_WORDS`] elements.
    pub const MAP_WATCHED_TGIDS: &str = "watched_tgids";
    /// `RINGBUF` map every record leaves the kernel through.
    pub const MAP_EVENTS: &str = "events";
    /// `PERCPU_ARRAY` of `u64` counters, indexed by [`crate::Counter`].
    pub const MAP_COUNTERS: &str = "counters";
    /// BTF tracepoint program on `sched_switch`.
    pub const PROG_SCHED_SWITCH: &str = "rw_sched_switch";
    /// BTF tracepoint program on `sched_wakeup`.
    pub const PROG_SCHED_WAKEUP: &str = "rw_sched_wakeup";
    /// BTF tracepoint program on `sched_wakeup_new`.
    pub const PROG_SCHED_WAKEUP_NEW: &str = "rw_sched_wakeup_new";
    /// BTF tracepoint program on `sock_send_length`.
    pub const PROG_SOCK_SEND_LENGTH: &str = "rw_sock_send_length";
    /// BTF tracepoint program on `sock_recv_length`.
    pub const PROG_SOCK_RECV_LENGTH: &str = "rw_sock_recv_length";
    /// BTF tracepoint program on `tcp_retransmit_skb`.
    pub const PROG_TCP_RETRANSMIT_SKB: &str = "rw_tcp_retransmit_skb";
    /// BTF tracepoint program on `tcp_probe`.
    pub const PROG_TCP_PROBE: &str = "rw_tcp_probe";
    /// BTF tracepoint program on `inet_sock_set_state`.
    pub const PROG_INET_SOCK_SET_STATE: &str = "rw_inet_sock_set_state";
    /// Uretprobe shared by every NCCL entry point.
    pub const PROG_NCCL_RETURN: &str = "rw_nccl_return";
    /// (uprobe program, NCCL symbol) pairs.
    pub const NCCL_ENTRY_PROGS: &[(&str, &str)] = &[
        ("rw_nccl_all_reduce", "ncclAllReduce"),
        ("rw_nccl_all_gather", "ncclAllGather"),
        ("rw_nccl_reduce_scatter", "ncclReduceScatter"),
        ("rw_nccl_broadcast", "ncclBroadcast"),
        ("rw_nccl_group_start", "ncclGroupStart"),
        ("rw_nccl_group_end", "ncclGroupEnd"),
    ];
    /// `HASH` of per-thread log2 histograms (tid → [`crate::ThreadHist`]).
    pub const MAP_SCHED_HIST: &str = "sched_hist";
    /// `HASH` of per-thread scheduling state and switch counts (tid →
    /// [`crate::ThreadState`]).
    pub const MAP_THREAD_STATE: &str = "thread_state";
    /// `TASK_STORAGE` of the same [`crate::ThreadState`] per thread, used
    /// instead of [`MAP_THREAD_STATE`] when [`GLOBAL_TASK_STORAGE`] is 1;
    /// user space looks an entry up by a pidfd of the thread.
    pub const MAP_TASK_STATE: &str = "task_state";
    /// `ARRAY` of the same [`crate::ThreadState`], a slot per thread id
    /// (`tid & mask`, [`GLOBAL_THREAD_SLOT_MASK`]), used first when
    /// [`GLOBAL_THREAD_SLOTS`] is 1; a thread whose slot another thread
    /// holds uses [`MAP_THREAD_STATE`].
    pub const MAP_THREAD_SLOTS: &str = "thread_slots";
    /// `HASH` [`crate::ThreadKey`] → [`crate::ThreadNet`].
    pub const MAP_THREAD_NET: &str = "thread_net";
    /// `HASH` struct sock address (`u64`) → [`crate::SockStats`].
    pub const MAP_SOCK_STATS: &str = "sock_stats";
    /// `.rodata` global: minimum interval length sent as a record, ns.
    pub const GLOBAL_MIN_INTERVAL_NS: &str = "rw_min_interval_ns";
    /// `.rodata` global (`u32`): interval records per thread per second, 0 = no limit.
    pub const GLOBAL_MAX_INTERVALS_PER_S: &str = "rw_max_intervals_per_s";
    /// `.rodata` global (`u8`): 1 fills [`MAP_SCHED_HIST`], 0 leaves it empty.
    pub const GLOBAL_HISTOGRAMS: &str = "rw_histograms";
    /// `.rodata` global (`u8`): 1 keeps thread state in [`MAP_TASK_STATE`],
    /// 0 in [`MAP_THREAD_STATE`].
    pub const GLOBAL_TASK_STORAGE: &str = "rw_task_storage";
    /// `.rodata` global (`u8`): 1 keeps thread state in [`MAP_THREAD_SLOTS`]
    /// first.
    pub const GLOBAL_THREAD_SLOTS: &str = "rw_thread_slots";
    /// `.rodata` global (`u32`): slots in [`MAP_THREAD_SLOTS`] minus one (a
    /// power of two minus one); a thread's slot is `tid & mask`.
    pub const GLOBAL_THREAD_SLOT_MASK: &str = "rw_thread_slot_mask";
}

/// `enum rw_event_kind`: the first field after the timestamp in every record.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// [`SchedSwitchEvent`].
    SchedSwitch = 1,
    /// [`ThreadExitEvent`].
    ThreadExit = 3,
    /// [`TcpRetransmitEvent`].
    TcpRetransmit = 4,
    /// [`TcpCloseEvent`].
    TcpClose = 5,
    /// [`NcclCallEvent`].
    NcclCall = 6,
}

impl EventKind {
    /// The kind for a raw value read from a record, if known.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Self::SchedSwitch),
            3 => Some(Self::ThreadExit),
            4 => Some(Self::TcpRetransmit),
            5 => Some(Self::TcpClose),
            6 => Some(Self::NcclCall),
            _ => None,
        }
    }
}

/// `enum rw_counter`: slots of the `counters` map.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    /// Records lost because the ring buffer was full.
    RingbufDrops = 0,
    /// Context switches involving a watched process.
    SchedSwitchSeen = 1,
    /// Interval records not sent because shorter than the minimum (still
    /// in the histograms).
    IntervalsSkipped = 2,
    /// A kernel map was full: a thread, socket or call went unaccounted.
    MapFull = 3,
    /// Interval records not sent because their thread hit the per-second
    /// limit (still in the histograms).
    IntervalsRateLimited = 4,
}

impl Counter {
    /// Every counter, for reports.
    pub const ALL: [Counter; 5] = [
        Counter::RingbufDrops,
        Counter::SchedSwitchSeen,
        Counter::IntervalsSkipped,
        Counter::MapFull,
        Counter::IntervalsRateLimited,
    ];
}

/// What an interval of a thread measured (the parts of a [`SchedSwitchEvent`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum IntervalKind {
    /// Switched in → switched out.
    OnCpu,
    /// Runnable (woken, preempted or new) → switched in.
    RunQueue,
    /// Switched out blocked → woken.
    OffCpu,
}

/// `enum rw_interval_cause`.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum IntervalCause {
    /// It blocked (on-CPU end, or the whole off-CPU interval).
    Blocked = 0,
    /// Preempted (on-CPU end, or the run-queue wait after it).
    Preempted = 1,
    /// Run-queue wait after a wakeup.
    Woken = 2,
    /// A new thread's first run-queue wait.
    New = 3,
}

impl IntervalCause {
    /// The cause for a raw value, if known.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            0 => Some(Self::Blocked),
            1 => Some(Self::Preempted),
            2 => Some(Self::Woken),
            3 => Some(Self::New),
            _ => None,
        }
    }
}

/// `enum rw_nccl_func`: which NCCL entry point a call was.
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum NcclFunc {
    /// `ncclAllReduce`.
    AllReduce = 1,
    /// `ncclAllGather`.
    AllGather = 2,
    /// `ncclReduceScatter`.
    ReduceScatter = 3,
    /// `ncclBroadcast`.
    Broadcast = 4,
    /// `ncclGroupStart`.
    GroupStart = 5,
    /// `ncclGroupEnd`.
    GroupEnd = 6,
}

impl NcclFunc {
    /// The function for a raw value, if known.
    pub fn from_raw(raw: u32) -> Option<Self> {
        match raw {
            1 => Some(Self::AllReduce),
            2 => Some(Self::AllGather),
            3 => Some(Self::ReduceScatter),
            4 => Some(Self::Broadcast),
            5 => Some(Self::GroupStart),
            6 => Some(Self::GroupEnd),
            _ => None,
        }
    }

    /// The NCCL symbol.
    pub fn symbol(self) -> &'static str {
        match self {
            Self::AllReduce => "ncclAllReduce",
            Self::AllGather => "ncclAllGather",
            Self::ReduceScatter => "ncclReduceScatter",
            Self::Broadcast => "ncclBroadcast",
            Self::GroupStart => "ncclGroupStart",
            Self::GroupEnd => "ncclGroupEnd",
        }
    }
}

/// Elements of the `watched_tgids` bitmap (`RW_WATCHED_WORDS`): pids up to 2^22.
pub const WATCHED_WORDS: u32 = 1 << 16;

/// Number of slots in the `counters` map (`RW_COUNTER_MAX`).
pub const COUNTER_SLOTS: u32 = 16;

/// `struct rw_event_header`: starts every ring-buffer record.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EventHeader {
    /// `bpf_ktime_get_ns()`: nanoseconds of `CLOCK_MONOTONIC`.
    pub ts_ns: u64,
    /// An [`EventKind`] value.
    pub kind: u32,
    /// The CPU the event happened on.
    pub cpu: u32,
}

/// `struct rw_sched_switch_event`: the intervals one context switch ended
/// for the watched threads in it, all ending at or before `hdr.ts_ns`: the
/// outgoing thread's on-CPU interval; the incoming thread's run-queue wait
/// and, when it had blocked, the off-CPU interval its wakeup ended. Sent
/// only when at least one part is there (switch counts are in
/// [`ThreadState`], not in records); [`SchedSwitchEvent::intervals`] lists
/// them.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedSwitchEvent {
    /// Common header; `kind` is [`EventKind::SchedSwitch`], `ts_ns` the switch.
    pub hdr: EventHeader,
    /// Process of the thread leaving the CPU.
    pub prev_tgid: u32,
    /// Thread leaving the CPU.
    pub prev_tid: u32,
    /// Process of the thread taking the CPU.
    pub next_tgid: u32,
    /// Thread taking the CPU.
    pub next_tid: u32,
    /// Start of the outgoing thread's on-CPU interval (if `has_on_cpu`).
    pub on_cpu_start_ns: u64,
    /// Start of the incoming thread's off-CPU interval (if `has_off_cpu`);
    /// it ended at `runnable_ns`.
    pub off_cpu_start_ns: u64,
    /// When the incoming thread became runnable: start of its run-queue
    /// wait, end of its off-CPU interval.
    pub runnable_ns: u64,
    /// 1 when `prev_tgid` is watched.
    pub prev_watched: u8,
    /// 1 when `next_tgid` is watched.
    pub next_watched: u8,
    /// 1 when the record carries the outgoing thread's on-CPU interval.
    pub has_on_cpu: u8,
    /// 1 when the record carries the incoming thread's off-CPU interval.
    pub has_off_cpu: u8,
    /// 1 when the record carries the incoming thread's run-queue wait.
    pub has_run_queue: u8,
    /// An [`IntervalCause`] value: how the on-CPU interval ended.
    pub on_cpu_cause: u8,
    /// An [`IntervalCause`] value: why the thread was runnable.
    pub run_queue_cause: u8,
    /// Padding, zero.
    pub _pad: u8,
}

/// One interval a [`SchedSwitchEvent`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SwitchInterval {
    /// Process.
    pub tgid: u32,
    /// Thread.
    pub tid: u32,
    /// What it measured.
    pub kind: IntervalKind,
    /// An [`IntervalCause`] value, as the kernel wrote it.
    pub cause: u8,
    /// Start, `CLOCK_MONOTONIC` ns.
    pub start_ns: u64,
    /// End, ns.
    pub end_ns: u64,
}

impl SchedSwitchEvent {
    /// The intervals the record carries, in the order they ended: the
    /// outgoing thread's on-CPU interval, then the incoming thread's
    /// off-CPU interval and its run-queue wait.
    pub fn intervals(&self) -> impl Iterator<Item = SwitchInterval> + use<> {
        let on_cpu = (self.has_on_cpu != 0).then_some(SwitchInterval {
            tgid: self.prev_tgid,
            tid: self.prev_tid,
            kind: IntervalKind::OnCpu,
            cause: self.on_cpu_cause,
            start_ns: self.on_cpu_start_ns,
            end_ns: self.hdr.ts_ns,
        });
        let off_cpu = (self.has_off_cpu != 0).then_some(SwitchInterval {
            tgid: self.next_tgid,
            tid: self.next_tid,
            kind: IntervalKind::OffCpu,
            cause: IntervalCause::Blocked as u8,
            start_ns: self.off_cpu_start_ns,
            end_ns: self.runnable_ns,
        });
        let run_queue = (self.has_run_queue != 0).then_some(SwitchInterval {
            tgid: self.next_tgid,
            tid: self.next_tid,
            kind: IntervalKind::RunQueue,
            cause: self.run_queue_cause,
            start_ns: self.runnable_ns,
            end_ns: self.hdr.ts_ns,
        });
        on_cpu.into_iter().chain(off_cpu).chain(run_queue)
    }
}

/// `struct rw_thread_exit_event`: a watched thread exited (sent at its last
/// switch out), with its final context-switch counts.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadExitEvent {
    /// Common header.
    pub hdr: EventHeader,
    /// Process.
    pub tgid: u32,
    /// Thread.
    pub tid: u32,
    /// Times it left a CPU, its last switch included.
    pub switched_out: u64,
    /// Times it got a CPU.
    pub switched_in: u64,
    /// Of `switched_out`, how many left it runnable (preemptions).
    pub preempted: u64,
    /// Its name (`task->comm`) at that last switch, NUL-padded.
    pub comm: [u8; 16],
    /// Its intervals that stayed in the kernel, its last on-CPU one included.
    pub unsent: Unsent,
}

/// `struct rw_unsent`: the intervals a thread finished that did not leave
/// the kernel as records (shorter than `--min-interval`, or over
/// `--max-interval-rate`), their time and number per kind, cumulative.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Unsent {
    /// On-CPU time, ns.
    pub on_cpu_ns: u64,
    /// Run-queue waiting time, ns.
    pub run_queue_ns: u64,
    /// Off-CPU (blocked) time, ns.
    pub off_cpu_ns: u64,
    /// On-CPU intervals.
    pub on_cpu: u64,
    /// Run-queue waits.
    pub run_queue: u64,
    /// Off-CPU intervals.
    pub off_cpu: u64,
}

impl Unsent {
    /// Field by field `self - earlier`, 0 where a field went down.
    pub fn since(&self, earlier: &Unsent) -> Unsent {
        Unsent {
            on_cpu_ns: self.on_cpu_ns.saturating_sub(earlier.on_cpu_ns),
            run_queue_ns: self.run_queue_ns.saturating_sub(earlier.run_queue_ns),
            off_cpu_ns: self.off_cpu_ns.saturating_sub(earlier.off_cpu_ns),
            on_cpu: self.on_cpu.saturating_sub(earlier.on_cpu),
            run_queue: self.run_queue.saturating_sub(earlier.run_queue),
            off_cpu: self.off_cpu.saturating_sub(earlier.off_cpu),
        }
    }

    /// Field by field `self + other` (saturating).
    pub fn plus(&self, other: &Unsent) -> Unsent {
        Unsent {
            on_cpu_ns: self.on_cpu_ns.saturating_add(other.on_cpu_ns),
            run_queue_ns: self.run_queue_ns.saturating_add(other.run_queue_ns),
            off_cpu_ns: self.off_cpu_ns.saturating_add(other.off_cpu_ns),
            on_cpu: self.on_cpu.saturating_add(other.on_cpu),
            run_queue: self.run_queue.saturating_add(other.run_queue),
            off_cpu: self.off_cpu.saturating_add(other.off_cpu),
        }
    }

    /// Intervals of every kind.
    pub fn intervals(&self) -> u64 {
        self.on_cpu
            .saturating_add(self.run_queue)
            .saturating_add(self.off_cpu)
    }
}

impl ThreadExitEvent {
    /// The thread's name as the kernel had it when it exited (`None`: empty).
    pub fn comm(&self) -> Option<String> {
        let end = self
            .comm
            .iter()
            .position(|&b| b == 0)
            .unwrap_or(self.comm.len());
        (end > 0).then(|| String::from_utf8_lossy(&self.comm[..end]).into_owned())
    }
}

/// `struct rw_thread_state`: value of the `thread_state` map (key: tid):
/// where a watched thread is, since when, and its context-switch counts
/// since the programs were loaded.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadState {
    /// Switched in at (valid while `on_cpu` is 1), ns.
    pub on_ts: u64,
    /// Switched out at, ns.
    pub off_ts: u64,
    /// Became runnable at, ns; 0 when not waiting.
    pub runq_ts: u64,
    /// Start of the current one-second rate window, ns.
    pub rate_window_ns: u64,
    /// Times it left a CPU.
    pub switched_out: u64,
    /// Times it got a CPU.
    pub switched_in: u64,
    /// Of `switched_out`, how many left it runnable (`__state` 0).
    pub preempted: u64,
    /// Interval records sent in the rate window.
    pub rate_count: u32,
    /// Process.
    pub tgid: u32,
    /// 1 while on a CPU.
    pub on_cpu: u8,
    /// An [`IntervalCause`] value: why it is runnable.
    pub runq_cause: u8,
    /// 1 when woken: its off-CPU interval `[off_ts, runq_ts)` is accounted
    /// (histogram, record) at its next switch in.
    pub off_cpu_pending: u8,
    /// 1 once `run_delay_base` was read.
    pub run_delay_known: u8,
    /// Padding.
    pub _pad: [u8; 4],
    /// Its intervals that stayed in the kernel so far.
    pub unsent: Unsent,
    /// The thread whose slot this is, in [`names::MAP_THREAD_SLOTS`] (0: a
    /// free slot); the hash map and task storage leave it 0.
    pub tid: u64,
    /// The kernel's run-queue time of the thread (`sched_info.run_delay`,
    /// ns) at its last switch out or wakeup.
    pub run_delay_base: u64,
}

/// Buckets per histogram (`RW_HIST_SLOTS`): bucket `slot` counts durations
/// in `[2^slot, 2^(slot+1))` ns (slot 0 also 0 ns).
pub const HIST_SLOTS: usize = 64;

/// `struct rw_thread_hist`: value of the `sched_hist` map (key: tid), one
/// thread's log2 histograms.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadHist {
    /// Run-queue waits per log2 bucket.
    pub run_queue: [u64; HIST_SLOTS],
    /// Off-CPU (blocked) intervals per log2 bucket.
    pub off_cpu: [u64; HIST_SLOTS],
}

/// `struct rw_thread_key`: key of the `thread_net` map.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ThreadKey {
    /// Process.
    pub tgid: u32,
    /// Thread.
    pub tid: u32,
}

/// `struct rw_thread_net`: TCP bytes and calls of one thread (exact).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ThreadNet {
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Send calls that moved bytes.
    pub tx_calls: u64,
    /// Receive calls that moved bytes.
    pub rx_calls: u64,
}

/// `struct rw_sock_stats`: one TCP connection used by a watched process.
/// Ports in host order; addresses in network order (IPv4 in the first 4 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SockStats {
    /// The first watched process seen using it.
    pub tgid: u32,
    /// `AF_INET` (2) or `AF_INET6` (10).
    pub family: u16,
    /// Local port.
    pub sport: u16,
    /// Remote port.
    pub dport: u16,
    /// Padding.
    pub _pad: [u16; 3],
    /// Local address.
    pub saddr: [u8; 16],
    /// Remote address.
    pub daddr: [u8; 16],
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Send calls.
    pub tx_calls: u64,
    /// Receive calls.
    pub rx_calls: u64,
    /// Segments retransmitted.
    pub retransmits: u64,
    /// Smoothed RTT, microseconds (last `tcp_probe`).
    pub srtt_us: u32,
    /// Congestion window, segments (last `tcp_probe`).
    pub cwnd: u32,
    /// When it was opened (connect) or first seen, ns.
    pub opened_ns: u64,
    /// Last activity, ns.
    pub last_ns: u64,
}

/// `struct rw_tcp_retransmit_event`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpRetransmitEvent {
    /// Common header.
    pub hdr: EventHeader,
    /// The struct sock address (key of `sock_stats`).
    pub sock: u64,
    /// Owning process.
    pub tgid: u32,
    /// Padding.
    pub _pad: u32,
}

/// `struct rw_tcp_close_event`: a watched connection closed; final figures.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpCloseEvent {
    /// Common header; `ts_ns` is the close time.
    pub hdr: EventHeader,
    /// The struct sock address.
    pub sock: u64,
    /// Final figures.
    pub stats: SockStats,
}

/// `struct rw_nccl_call_event`: one NCCL call, sent at its return.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclCallEvent {
    /// Common header.
    pub hdr: EventHeader,
    /// Process.
    pub tgid: u32,
    /// Thread.
    pub tid: u32,
    /// An [`NcclFunc`] value.
    pub func: u32,
    /// `ncclDataType_t`.
    pub datatype: u32,
    /// `ncclRedOp_t` (all-reduce, reduce-scatter), root (broadcast), else 0.
    pub op: u32,
    /// `ncclResult_t` returned.
    pub result: i32,
    /// Elements.
    pub count: u64,
    /// Entry time, ns.
    pub entry_ns: u64,
    /// Return time, ns.
    pub return_ns: u64,
}

/// `struct rw_nccl_pending`: kernel-private, mirrored for the layout test.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NcclPending {
    /// Entry time.
    pub entry_ns: u64,
    /// Elements.
    pub count: u64,
    /// An [`NcclFunc`] value.
    pub func: u32,
    /// `ncclDataType_t`.
    pub datatype: u32,
    /// op / root.
    pub op: u32,
    /// Padding.
    pub _pad: u32,
}

/// Reads a record of type `T` from the front of a ring-buffer item, or `None`
/// when the item is too short. The kernel writes plain-old-data records, so
/// any bit pattern is a valid `T` for the types in this crate.
pub fn read_record<T: Record>(bytes: &[u8]) -> Option<T> {
    if bytes.len() < std::mem::size_of::<T>() {
        return None;
    }
    // SAFETY: length checked above; `T: Record` is a #[repr(C)] struct of
    // integers, valid for every bit pattern; read_unaligned has no alignment
    // requirement.
    Some(unsafe { std::ptr::read_unaligned(bytes.as_ptr().cast::<T>()) })
}

/// Marker for the `#[repr(C)]` integer-only records that [`read_record`] may
/// produce from raw bytes.
///
/// # Safety
/// Implement only for `#[repr(C)]` structs whose fields are integers (or such
/// structs), so every bit pattern is a valid value.
pub unsafe trait Record: Copy {}

// SAFETY: repr(C), integer fields only.
unsafe impl Record for EventHeader {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for SchedSwitchEvent {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for ThreadExitEvent {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for ThreadState {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for TcpRetransmitEvent {}
// SAFETY: repr(C), integer fields (and a SockStats) only.
unsafe impl Record for TcpCloseEvent {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for SockStats {}
// SAFETY: repr(C), integer fields only.
unsafe impl Record for NcclCallEvent {}

#[cfg(test)]
mod layout {
    //! The C side and the Rust side must agree byte for byte.
    use super::*;
    use std::mem::{offset_of, size_of};

    include!(concat!(env!("OUT_DIR"), "/c_layout.rs"));

    fn rust_layout() -> Vec<(&'static str, usize)> {
        vec![
            ("rw_event_header", size_of::<EventHeader>()),
            ("rw_event_header.ts_ns", offset_of!(EventHeader, ts_ns)),
            ("rw_event_header.kind", offset_of!(EventHeader, kind)),
            ("rw_event_header.cpu", offset_of!(EventHeader, cpu)),
            ("rw_sched_switch_event", size_of::<SchedSwitchEvent>()),
            (
                "rw_sched_switch_event.hdr",
                offset_of!(SchedSwitchEvent, hdr),
            ),
            (
                "rw_sched_switch_event.prev_tgid",
                offset_of!(SchedSwitchEvent, prev_tgid),
            ),
            (
                "rw_sched_switch_event.prev_tid",
                offset_of!(SchedSwitchEvent, prev_tid),
            ),
            (
                "rw_sched_switch_event.next_tgid",
                offset_of!(SchedSwitchEvent, next_tgid),
            ),
            (
                "rw_sched_switch_event.next_tid",
                offset_of!(SchedSwitchEvent, next_tid),
            ),
            (
                "rw_sched_switch_event.on_cpu_start_ns",
                offset_of!(SchedSwitchEvent, on_cpu_start_ns),
            ),
            (
                "rw_sched_switch_event.off_cpu_start_ns",
                offset_of!(SchedSwitchEvent, off_cpu_start_ns),
            ),
            (
                "rw_sched_switch_event.runnable_ns",
                offset_of!(SchedSwitchEvent, runnable_ns),
            ),
            (
                "rw_sched_switch_event.prev_watched",
                offset_of!(SchedSwitchEvent, prev_watched),
            ),
            (
                "rw_sched_switch_event.next_watched",
                offset_of!(SchedSwitchEvent, next_watched),
            ),
            (
                "rw_sched_switch_event.has_on_cpu",
                offset_of!(SchedSwitchEvent, has_on_cpu),
            ),
            (
                "rw_sched_switch_event.has_off_cpu",
                offset_of!(SchedSwitchEvent, has_off_cpu),
            ),
            (
                "rw_sched_switch_event.has_run_queue",
                offset_of!(SchedSwitchEvent, has_run_queue),
            ),
            (
                "rw_sched_switch_event.on_cpu_cause",
                offset_of!(SchedSwitchEvent, on_cpu_cause),
            ),
            (
                "rw_sched_switch_event.run_queue_cause",
                offset_of!(SchedSwitchEvent, run_queue_cause),
            ),
            ("rw_thread_exit_event", size_of::<ThreadExitEvent>()),
            ("rw_thread_exit_event.hdr", offset_of!(ThreadExitEvent, hdr)),
            (
                "rw_thread_exit_event.tgid",
                offset_of!(ThreadExitEvent, tgid),
            ),
            ("rw_thread_exit_event.tid", offset_of!(ThreadExitEvent, tid)),
            (
                "rw_thread_exit_event.switched_out",
                offset_of!(ThreadExitEvent, switched_out),
            ),
            (
                "rw_thread_exit_event.switched_in",
                offset_of!(ThreadExitEvent, switched_in),
            ),
            (
                "rw_thread_exit_event.preempted",
                offset_of!(ThreadExitEvent, preempted),
            ),
            (
                "rw_thread_exit_event.comm",
                offset_of!(ThreadExitEvent, comm),
            ),
            (
                "rw_thread_exit_event.unsent",
                offset_of!(ThreadExitEvent, unsent),
            ),
            ("rw_thread_state", size_of::<ThreadState>()),
            ("rw_thread_state.on_ts", offset_of!(ThreadState, on_ts)),
            ("rw_thread_state.off_ts", offset_of!(ThreadState, off_ts)),
            ("rw_thread_state.runq_ts", offset_of!(ThreadState, runq_ts)),
            (
                "rw_thread_state.rate_window_ns",
                offset_of!(ThreadState, rate_window_ns),
            ),
            (
                "rw_thread_state.switched_out",
                offset_of!(ThreadState, switched_out),
            ),
            (
                "rw_thread_state.switched_in",
                offset_of!(ThreadState, switched_in),
            ),
            (
                "rw_thread_state.preempted",
                offset_of!(ThreadState, preempted),
            ),
            (
                "rw_thread_state.rate_count",
                offset_of!(ThreadState, rate_count),
            ),
            ("rw_thread_state.tgid", offset_of!(ThreadState, tgid)),
            ("rw_thread_state.on_cpu", offset_of!(ThreadState, on_cpu)),
            (
                "rw_thread_state.runq_cause",
                offset_of!(ThreadState, runq_cause),
            ),
            (
                "rw_thread_state.off_cpu_pending",
                offset_of!(ThreadState, off_cpu_pending),
            ),
            ("rw_thread_state.unsent", offset_of!(ThreadState, unsent)),
            ("rw_thread_state.tid", offset_of!(ThreadState, tid)),
            ("rw_unsent", size_of::<Unsent>()),
            ("rw_unsent.on_cpu_ns", offset_of!(Unsent, on_cpu_ns)),
            ("rw_unsent.run_queue_ns", offset_of!(Unsent, run_queue_ns)),
            ("rw_unsent.off_cpu_ns", offset_of!(Unsent, off_cpu_ns)),
            ("rw_unsent.on_cpu", offset_of!(Unsent, on_cpu)),
            ("rw_unsent.run_queue", offset_of!(Unsent, run_queue)),
            ("rw_unsent.off_cpu", offset_of!(Unsent, off_cpu)),
            ("rw_thread_hist", size_of::<ThreadHist>()),
            (
                "rw_thread_hist.run_queue",
                offset_of!(ThreadHist, run_queue),
            ),
            ("rw_thread_hist.off_cpu", offset_of!(ThreadHist, off_cpu)),
            ("rw_thread_key", size_of::<ThreadKey>()),
            ("rw_thread_key.tgid", offset_of!(ThreadKey, tgid)),
            ("rw_thread_key.tid", offset_of!(ThreadKey, tid)),
            ("rw_thread_net", size_of::<ThreadNet>()),
            ("rw_thread_net.tx_bytes", offset_of!(ThreadNet, tx_bytes)),
            ("rw_thread_net.rx_bytes", offset_of!(ThreadNet, rx_bytes)),
            ("rw_thread_net.tx_calls", offset_of!(ThreadNet, tx_calls)),
            ("rw_thread_net.rx_calls", offset_of!(ThreadNet, rx_calls)),
            ("rw_sock_stats", size_of::<SockStats>()),
            ("rw_sock_stats.tgid", offset_of!(SockStats, tgid)),
            ("rw_sock_stats.family", offset_of!(SockStats, family)),
            ("rw_sock_stats.sport", offset_of!(SockStats, sport)),
            ("rw_sock_stats.dport", offset_of!(SockStats, dport)),
            ("rw_sock_stats.saddr", offset_of!(SockStats, saddr)),
            ("rw_sock_stats.daddr", offset_of!(SockStats, daddr)),
            ("rw_sock_stats.tx_bytes", offset_of!(SockStats, tx_bytes)),
            ("rw_sock_stats.rx_bytes", offset_of!(SockStats, rx_bytes)),
            ("rw_sock_stats.tx_calls", offset_of!(SockStats, tx_calls)),
            ("rw_sock_stats.rx_calls", offset_of!(SockStats, rx_calls)),
            (
                "rw_sock_stats.retransmits",
                offset_of!(SockStats, retransmits),
            ),
            ("rw_sock_stats.srtt_us", offset_of!(SockStats, srtt_us)),
            ("rw_sock_stats.cwnd", offset_of!(SockStats, cwnd)),
            ("rw_sock_stats.opened_ns", offset_of!(SockStats, opened_ns)),
            ("rw_sock_stats.last_ns", offset_of!(SockStats, last_ns)),
            ("rw_tcp_retransmit_event", size_of::<TcpRetransmitEvent>()),
            (
                "rw_tcp_retransmit_event.hdr",
                offset_of!(TcpRetransmitEvent, hdr),
            ),
            (
                "rw_tcp_retransmit_event.sock",
                offset_of!(TcpRetransmitEvent, sock),
            ),
            (
                "rw_tcp_retransmit_event.tgid",
                offset_of!(TcpRetransmitEvent, tgid),
            ),
            ("rw_tcp_close_event", size_of::<TcpCloseEvent>()),
            ("rw_tcp_close_event.hdr", offset_of!(TcpCloseEvent, hdr)),
            ("rw_tcp_close_event.sock", offset_of!(TcpCloseEvent, sock)),
            ("rw_tcp_close_event.stats", offset_of!(TcpCloseEvent, stats)),
            ("rw_nccl_call_event", size_of::<NcclCallEvent>()),
            ("rw_nccl_call_event.hdr", offset_of!(NcclCallEvent, hdr)),
            ("rw_nccl_call_event.tgid", offset_of!(NcclCallEvent, tgid)),
            ("rw_nccl_call_event.tid", offset_of!(NcclCallEvent, tid)),
            ("rw_nccl_call_event.func", offset_of!(NcclCallEvent, func)),
            (
                "rw_nccl_call_event.datatype",
                offset_of!(NcclCallEvent, datatype),
            ),
            ("rw_nccl_call_event.op", offset_of!(NcclCallEvent, op)),
            (
                "rw_nccl_call_event.result",
                offset_of!(NcclCallEvent, result),
            ),
            ("rw_nccl_call_event.count", offset_of!(NcclCallEvent, count)),
            (
                "rw_nccl_call_event.entry_ns",
                offset_of!(NcclCallEvent, entry_ns),
            ),
            (
                "rw_nccl_call_event.return_ns",
                offset_of!(NcclCallEvent, return_ns),
            ),
            ("rw_nccl_pending", size_of::<NcclPending>()),
            (
                "rw_nccl_pending.entry_ns",
                offset_of!(NcclPending, entry_ns),
            ),
            ("rw_nccl_pending.count", offset_of!(NcclPending, count)),
            ("rw_nccl_pending.func", offset_of!(NcclPending, func)),
            (
                "rw_nccl_pending.datatype",
                offset_of!(NcclPending, datatype),
            ),
            ("rw_nccl_pending.op", offset_of!(NcclPending, op)),
        ]
    }

    #[test]
    fn rust_mirrors_match_the_c_layout() {
        assert_eq!(rust_layout(), C_LAYOUT.to_vec());
    }

    #[test]
    fn enum_values_match_the_c_header() {
        let rust: Vec<(&str, u32)> = vec![
            ("RW_EVENT_SCHED_SWITCH", EventKind::SchedSwitch as u32),
            ("RW_COUNTER_RINGBUF_DROPS", Counter::RingbufDrops as u32),
            (
                "RW_COUNTER_SCHED_SWITCH_SEEN",
                Counter::SchedSwitchSeen as u32,
            ),
            ("RW_EVENT_THREAD_EXIT", EventKind::ThreadExit as u32),
            ("RW_EVENT_TCP_RETRANSMIT", EventKind::TcpRetransmit as u32),
            ("RW_EVENT_TCP_CLOSE", EventKind::TcpClose as u32),
            ("RW_EVENT_NCCL_CALL", EventKind::NcclCall as u32),
            (
                "RW_COUNTER_INTERVALS_SKIPPED",
                Counter::IntervalsSkipped as u32,
            ),
            ("RW_COUNTER_MAP_FULL", Counter::MapFull as u32),
            ("RW_CAUSE_BLOCKED", IntervalCause::Blocked as u32),
            ("RW_CAUSE_PREEMPTED", IntervalCause::Preempted as u32),
            ("RW_CAUSE_WOKEN", IntervalCause::Woken as u32),
            ("RW_CAUSE_NEW", IntervalCause::New as u32),
            ("RW_NCCL_ALL_REDUCE", NcclFunc::AllReduce as u32),
            ("RW_NCCL_ALL_GATHER", NcclFunc::AllGather as u32),
            ("RW_NCCL_REDUCE_SCATTER", NcclFunc::ReduceScatter as u32),
            ("RW_NCCL_BROADCAST", NcclFunc::Broadcast as u32),
            ("RW_NCCL_GROUP_START", NcclFunc::GroupStart as u32),
            ("RW_NCCL_GROUP_END", NcclFunc::GroupEnd as u32),
            (
                "RW_COUNTER_INTERVALS_RATE_LIMITED",
                Counter::IntervalsRateLimited as u32,
            ),
            ("RW_HIST_SLOTS", HIST_SLOTS as u32),
            ("RW_COUNTER_MAX", COUNTER_SLOTS),
        ];
        assert_eq!(rust, C_CONSTANTS.to_vec());
    }

    #[test]
    fn object_is_an_elf_for_bpf() {
        let object = bpf_object();
        assert_eq!(&object[..4], b"\x7fELF");
        // e_machine at offset 18: EM_BPF = 247.
        assert_eq!(u16::from_le_bytes([object[18], object[19]]), 247);
        assert_eq!(object.as_ptr() as usize % 8, 0);
    }

    #[test]
    fn short_records_are_refused() {
        assert!(read_record::<SchedSwitchEvent>(&[0u8; 8]).is_none());
        let bytes = [1u8; std::mem::size_of::<SchedSwitchEvent>()];
        let event = read_record::<SchedSwitchEvent>(&bytes).unwrap();
        assert_eq!(event.prev_tgid, 0x0101_0101);
    }
}
