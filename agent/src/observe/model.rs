//! `model`: per-thread and per-connection state built from decoded events
//! and from the kernel's aggregate maps.
//!
//! Pure bookkeeping: no BPF, no I/O, no clock (time is always passed in, in
//! `CLOCK_MONOTONIC` ns like the kernel's records), so it is tested with
//! synthetic events. Memory is bounded: series older than the retention
//! window are pruned, and each thread keeps at most a fixed number of
//! intervals and NCCL calls (what is pruned early is counted).
//! [`Model`] is what the commands and the HTTP API query.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use ebpf::{
    IntervalCause, IntervalKind, NcclFunc, SockStats, SwitchInterval, ThreadKey, ThreadNet,
    ThreadState, Unsent,
};
use serde::Serialize;

use crate::events::Event;

/// Context-switch counts of one thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct ThreadSwitches {
    /// Times the thread left a CPU.
    pub switched_out: u64,
    /// Times the thread got a CPU.
    pub switched_in: u64,
    /// Of `switched_out`, how many were preemptions (still runnable).
    pub preempted: u64,
}

/// Context switches of the watched processes, per process and thread, as
/// the kernel counts them (read from its `thread_state` map, and from the
/// exit record of a thread that ended).
#[derive(Debug, Default)]
pub struct SwitchCounts {
    /// tgid → tid → counts.
    pub processes: BTreeMap<u32, BTreeMap<u32, ThreadSwitches>>,
}

impl SwitchCounts {
    /// Takes a reading of one thread's cumulative counts. Readings can
    /// arrive out of order (a map read and a record drained around the same
    /// switch), so each count only grows.
    pub fn update(&mut self, tgid: u32, tid: u32, counts: ThreadSwitches) {
        let thread = self
            .processes
            .entry(tgid)
            .or_default()
            .entry(tid)
            .or_default();
        thread.switched_out = thread.switched_out.max(counts.switched_out);
        thread.switched_in = thread.switched_in.max(counts.switched_in);
        thread.preempted = thread.preempted.max(counts.preempted);
    }

    /// Sum over the threads of process `tgid`.
    pub fn process_total(&self, tgid: u32) -> ThreadSwitches {
        let mut total = ThreadSwitches::default();
        for t in self
            .processes
            .get(&tgid)
            .into_iter()
            .flat_map(|threads| threads.values())
        {
            total.switched_out += t.switched_out;
            total.switched_in += t.switched_in;
            total.preempted += t.preempted;
        }
        total
    }
}

/// One finished interval of a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Interval {
    /// Start, `CLOCK_MONOTONIC` ns.
    pub start_ns: u64,
    /// Length, ns.
    pub duration_ns: u64,
    /// What it measured.
    #[serde(serialize_with = "ser_kind")]
    pub kind: IntervalKind,
    /// Why (preempted, blocked, woken, new).
    #[serde(serialize_with = "ser_cause")]
    pub cause: IntervalCause,
}

fn ser_kind<S: serde::Serializer>(k: &IntervalKind, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(match k {
        IntervalKind::OnCpu => "on_cpu",
        IntervalKind::RunQueue => "run_queue",
        IntervalKind::OffCpu => "off_cpu",
    })
}

fn ser_cause<S: serde::Serializer>(c: &IntervalCause, s: S) -> Result<S::Ok, S::Error> {
    s.serialize_str(cause_name(*c))
}

/// How a cause is spelled in JSON and on the timeline.
pub fn cause_name(cause: IntervalCause) -> &'static str {
    match cause {
        IntervalCause::Blocked => "blocked",
        IntervalCause::Preempted => "preempted",
        IntervalCause::Woken => "woken",
        IntervalCause::New => "new",
    }
}

/// One NCCL call of a thread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct NcclCall {
    /// The entry point (`ncclAllReduce`, …).
    pub func: &'static str,
    /// Elements.
    pub count: u64,
    /// `ncclDataType_t`.
    pub datatype: u32,
    /// `ncclRedOp_t`, or the root for broadcast.
    pub op: u32,
    /// `ncclResult_t`.
    pub result: i32,
    /// Entry, ns.
    pub entry_ns: u64,
    /// Return, ns.
    pub return_ns: u64,
}

/// Totals of one thread since the agent first saw it (never pruned). The
/// scheduling figures count every interval the thread finished, also those
/// that stayed in the kernel (`--min-interval`, `--max-interval-rate`): the
/// kernel adds up their time and number per thread.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ThreadTotals {
    /// On-CPU time of finished on-CPU intervals, ns.
    pub on_cpu_ns: u64,
    /// Finished on-CPU intervals.
    pub on_cpu_intervals: u64,
    /// Run-queue waiting time, ns.
    pub run_queue_ns: u64,
    /// Run-queue waits.
    pub run_queue_waits: u64,
    /// Of the waits sent as records, those after a preemption.
    pub run_queue_waits_after_preemption: u64,
    /// Off-CPU (blocked) time, ns.
    pub off_cpu_ns: u64,
    /// Off-CPU intervals.
    pub off_cpu_intervals: u64,
    /// Of the intervals above, those that stayed in the kernel (shorter
    /// than `--min-interval`, or over `--max-interval-rate`): counted, not
    /// on the timeline.
    pub intervals_not_sent: u64,
    /// TCP bytes sent (exact, from the kernel's per-thread counters).
    pub tcp_tx_bytes: u64,
    /// TCP bytes received.
    pub tcp_rx_bytes: u64,
    /// TCP send calls.
    pub tcp_tx_calls: u64,
    /// TCP receive calls.
    pub tcp_rx_calls: u64,
    /// NCCL calls returned.
    pub nccl_calls: u64,
}

impl ThreadTotals {
    fn add(&mut self, o: &ThreadTotals) {
        self.on_cpu_ns += o.on_cpu_ns;
        self.on_cpu_intervals += o.on_cpu_intervals;
        self.run_queue_ns += o.run_queue_ns;
        self.run_queue_waits += o.run_queue_waits;
        self.run_queue_waits_after_preemption += o.run_queue_waits_after_preemption;
        self.off_cpu_ns += o.off_cpu_ns;
        self.off_cpu_intervals += o.off_cpu_intervals;
        self.intervals_not_sent += o.intervals_not_sent;
        self.tcp_tx_bytes += o.tcp_tx_bytes;
        self.tcp_rx_bytes += o.tcp_rx_bytes;
        self.tcp_tx_calls += o.tcp_tx_calls;
        self.tcp_rx_calls += o.tcp_rx_calls;
        self.nccl_calls += o.nccl_calls;
    }
}

#[derive(Debug)]
struct ThreadSeries {
    tgid: u32,
    /// Of the intervals received (and TCP, NCCL); [`ThreadSeries::totals`]
    /// adds those that stayed in the kernel.
    totals: ThreadTotals,
    intervals: VecDeque<Interval>,
    /// The kernel's count of its intervals that stayed there, newest.
    unsent: Unsent,
    /// (time, `unsent`) readings, oldest first, from (first seen, zero):
    /// what stayed in the kernel during a window is read from them.
    unsent_readings: VecDeque<(u64, Unsent)>,
    nccl: VecDeque<NcclCall>,
    /// (time, cumulative counters) samples of the kernel's thread_net map.
    net: VecDeque<(u64, ThreadNet)>,
    /// On a CPU since then (`None`: off CPU, or not known yet).
    on_cpu_since: Option<u64>,
    /// Blocked (off CPU, not runnable) since then, and woken at (its off-CPU
    /// interval then ends, though its record comes only at the next switch
    /// in); `None`: on a CPU, runnable, or not known. The open off-CPU term
    /// of a snapshot, as `on_cpu_since` is the open on-CPU one: a thread
    /// blocked for the whole window has no finished interval in it.
    blocked: Option<(u64, Option<u64>)>,
    /// Time of the newest switch `on_cpu_since` was set from: records and
    /// map readings arrive out of order, an older one must not undo it.
    last_switch_ns: u64,
    exited_ns: Option<u64>,
    /// Its name at exit, from the exit record (`None`: still alive, or empty).
    exit_name: Option<String>,
    last_ns: u64,
}

impl ThreadSeries {
    fn new(tgid: u32, now: u64) -> Self {
        Self {
            tgid,
            totals: ThreadTotals::default(),
            intervals: VecDeque::new(),
            unsent: Unsent::default(),
            unsent_readings: VecDeque::from([(now, Unsent::default())]),
            nccl: VecDeque::new(),
            net: VecDeque::new(),
            on_cpu_since: None,
            blocked: None,
            last_switch_ns: 0,
            exited_ns: None,
            exit_name: None,
            last_ns: now,
        }
    }

    /// Its totals, the intervals that stayed in the kernel included.
    fn totals(&self) -> ThreadTotals {
        let u = &self.unsent;
        let mut totals = self.totals;
        totals.on_cpu_ns += u.on_cpu_ns;
        totals.on_cpu_intervals += u.on_cpu;
        totals.run_queue_ns += u.run_queue_ns;
        totals.run_queue_waits += u.run_queue;
        totals.off_cpu_ns += u.off_cpu_ns;
        totals.off_cpu_intervals += u.off_cpu;
        totals.intervals_not_sent = u.intervals();
        totals
    }

    /// What of its intervals stayed in the kernel during `[from_ns, to_ns)`,
    /// from the readings around the window (linear between readings: the
    /// kernel adds up, it does not say when).
    fn unsent_between(&self, from_ns: u64, to_ns: u64) -> UnsentShare {
        let at = |t: u64| UnsentShare::at(&self.unsent_readings, t);
        at(to_ns).minus(&at(from_ns))
    }
}

/// The value at `t` of a cumulative counter read at times (`readings`,
/// oldest first): linear between the two readings around `t`, the nearest
/// reading's before the first and after the last (the caller reads the
/// kernel right before it asks about "now").
pub fn cumulative_at<T>(readings: &VecDeque<(u64, T)>, t: u64, value: impl Fn(&T) -> f64) -> f64 {
    let after = readings.partition_point(|(ts, _)| *ts <= t);
    match (
        after.checked_sub(1).and_then(|i| readings.get(i)),
        readings.get(after),
    ) {
        (Some((t0, a)), Some((t1, b))) => {
            let (a, b) = (value(a), value(b));
            a + (t - t0) as f64 / (t1 - t0) as f64 * (b - a)
        }
        (Some((_, a)), None) | (None, Some((_, a))) => value(a),
        (None, None) => 0.0,
    }
}

/// Interval time and number (as estimated for a window, so fractional) that
/// stayed in the kernel.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
struct UnsentShare {
    on_cpu_ns: f64,
    run_queue_ns: f64,
    off_cpu_ns: f64,
    run_queue: f64,
}

impl UnsentShare {
    fn of(u: &Unsent) -> Self {
        Self {
            on_cpu_ns: u.on_cpu_ns as f64,
            run_queue_ns: u.run_queue_ns as f64,
            off_cpu_ns: u.off_cpu_ns as f64,
            run_queue: u.run_queue as f64,
        }
    }

    /// The cumulative figures at `t` from readings (oldest first).
    fn at(readings: &VecDeque<(u64, Unsent)>, t: u64) -> Self {
        let field = |f: fn(&Self) -> f64| cumulative_at(readings, t, |u| f(&Self::of(u)));
        Self {
            on_cpu_ns: field(|u| u.on_cpu_ns),
            run_queue_ns: field(|u| u.run_queue_ns),
            off_cpu_ns: field(|u| u.off_cpu_ns),
            run_queue: field(|u| u.run_queue),
        }
    }

    fn minus(&self, earlier: &Self) -> Self {
        Self {
            on_cpu_ns: (self.on_cpu_ns - earlier.on_cpu_ns).max(0.0),
            run_queue_ns: (self.run_queue_ns - earlier.run_queue_ns).max(0.0),
            off_cpu_ns: (self.off_cpu_ns - earlier.off_cpu_ns).max(0.0),
            run_queue: (self.run_queue - earlier.run_queue).max(0.0),
        }
    }
}

/// One TCP connection of a watched process.
#[derive(Debug, Clone, Serialize)]
pub struct Connection {
    /// Owning process.
    pub pid: u32,
    /// `local_addr:port`.
    pub local: String,
    /// `remote_addr:port`.
    pub remote: String,
    /// Bytes sent.
    pub tx_bytes: u64,
    /// Bytes received.
    pub rx_bytes: u64,
    /// Segments retransmitted.
    pub retransmits: u64,
    /// Smoothed RTT, µs (0: no ACK seen yet).
    pub srtt_us: u32,
    /// Congestion window, segments.
    pub cwnd: u32,
    /// Opened (or first seen), ns.
    pub opened_ns: u64,
    /// Closed, ns; `None` while open.
    pub closed_ns: Option<u64>,
}

impl Connection {
    fn from_stats(s: &SockStats, closed_ns: Option<u64>) -> Self {
        Self {
            pid: s.tgid,
            local: endpoint(s.family, &s.saddr, s.sport),
            remote: endpoint(s.family, &s.daddr, s.dport),
            tx_bytes: s.tx_bytes,
            rx_bytes: s.rx_bytes,
            retransmits: s.retransmits,
            srtt_us: s.srtt_us,
            cwnd: s.cwnd,
            opened_ns: s.opened_ns,
            closed_ns,
        }
    }
}

fn endpoint(family: u16, addr: &[u8; 16], port: u16) -> String {
    if family == 10 {
        format!("[{}]:{port}", std::net::Ipv6Addr::from(*addr))
    } else {
        let v4 = std::net::Ipv4Addr::new(addr[0], addr[1], addr[2], addr[3]);
        format!("{v4}:{port}")
    }
}

/// Figures of one thread over a time window, as `top` and the API show them.
#[derive(Debug, Clone, Serialize)]
pub struct ThreadSnapshot {
    /// Thread id.
    pub tid: u32,
    /// On-CPU share of the window, percent of one CPU.
    pub cpu_pct: f64,
    /// Off-CPU (blocked) share of the window, percent.
    pub off_cpu_pct: f64,
    /// Run-queue wait median in the window, µs (`None`: no waits).
    pub run_queue_p50_us: Option<f64>,
    /// Run-queue wait 99th percentile in the window, µs.
    pub run_queue_p99_us: Option<f64>,
    /// TCP bytes sent per second over the window.
    pub tcp_tx_bytes_per_s: f64,
    /// TCP bytes received per second over the window.
    pub tcp_rx_bytes_per_s: f64,
    /// NCCL calls returned per second over the window.
    pub nccl_calls_per_s: f64,
    /// Totals since first seen.
    pub totals: ThreadTotals,
    /// Whether the thread has exited.
    pub exited: bool,
}

/// Figures of one process over a time window.
#[derive(Debug, Clone, Serialize)]
pub struct ProcessSnapshot {
    /// Process id.
    pub pid: u32,
    /// Sum of its threads' CPU shares, percent of one CPU.
    pub cpu_pct: f64,
    /// Mean of its threads' off-CPU shares, percent.
    pub off_cpu_pct: f64,
    /// Run-queue wait median over all its threads, µs.
    pub run_queue_p50_us: Option<f64>,
    /// Run-queue wait 99th percentile over all its threads, µs.
    pub run_queue_p99_us: Option<f64>,
    /// TCP bytes sent per second.
    pub tcp_tx_bytes_per_s: f64,
    /// TCP bytes received per second.
    pub tcp_rx_bytes_per_s: f64,
    /// Retransmits in the window.
    pub retransmits_in_window: u64,
    /// Retransmits since first seen (open and closed connections).
    pub retransmits_total: u64,
    /// NCCL calls per second.
    pub nccl_calls_per_s: f64,
    /// Totals since first seen.
    pub totals: ThreadTotals,
    /// Per thread.
    pub threads: Vec<ThreadSnapshot>,
}

/// What the model holds and how much it dropped to stay bounded.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct ModelStats {
    /// Threads known (live or within retention).
    pub threads: usize,
    /// Intervals held.
    pub intervals: usize,
    /// Intervals dropped before the retention window because a thread hit
    /// its cap.
    pub intervals_dropped_for_memory: u64,
    /// Intervals whose record came in after the live view had published
    /// the time they ended in: held here, missing from the live timeline.
    pub intervals_late: u64,
    /// Connections known.
    pub connections: usize,
}

/// Gives back a deque's memory when it holds less than a quarter of it (a
/// burst's peak is not kept for the rest of the run).
fn shrink_spare<T>(deque: &mut VecDeque<T>) {
    if deque.capacity() > 1024 && deque.len() < deque.capacity() / 4 {
        deque.shrink_to(deque.len() * 2);
    }
}

/// Bounded in-memory series of everything watched: per thread (intervals,
/// NCCL calls, traffic samples) and per connection.
#[derive(Debug)]
pub struct Model {
    retention_ns: u64,
    /// How long intervals and NCCL calls are kept (at most `retention_ns`):
    /// the live view copies what it shows, so it needs only seconds.
    interval_retention_ns: u64,
    max_intervals_per_thread: usize,
    /// Intervals kept over all threads; past it, the busiest threads lose
    /// their oldest first ([`Model::prune`]).
    max_intervals_total: usize,
    threads: BTreeMap<u32, ThreadSeries>,
    live_conns: BTreeMap<u64, SockStats>,
    closed_conns: VecDeque<Connection>,
    closed_keys: BTreeSet<(u64, u64)>,
    retransmits: VecDeque<(u64, u32)>,
    intervals_dropped: u64,
    /// The live view has published every interval that ended before this
    /// (CLOCK_MONOTONIC ns); one recorded later that ended before it is late.
    published_until_ns: std::sync::atomic::AtomicU64,
    /// [`ModelStats::intervals_late`].
    intervals_late: u64,
    /// Per process, what its threads' intervals that stayed in the kernel
    /// add up to (never goes down, also when threads are forgotten), and
    /// when the kernel was last read.
    unsent_by_pid: BTreeMap<u32, Unsent>,
    unsent_read_ns: u64,
    /// Context-switch counts (what the `watch` command reports).
    pub switches: SwitchCounts,
}

impl Model {
    /// A model keeping `retention_ns` of history and at most
    /// `max_intervals_per_thread` intervals per thread.
    pub fn new(retention_ns: u64, max_intervals_per_thread: usize) -> Self {
        Self {
            retention_ns,
            interval_retention_ns: retention_ns,
            max_intervals_per_thread: max_intervals_per_thread.max(1),
            max_intervals_total: usize::MAX,
            threads: BTreeMap::new(),
            live_conns: BTreeMap::new(),
            closed_conns: VecDeque::new(),
            closed_keys: BTreeSet::new(),
            retransmits: VecDeque::new(),
            intervals_dropped: 0,
            published_until_ns: std::sync::atomic::AtomicU64::new(0),
            intervals_late: 0,
            unsent_by_pid: BTreeMap::new(),
            unsent_read_ns: 0,
            switches: SwitchCounts::default(),
        }
    }

    /// Keeps at most `bytes` of scheduling intervals over all threads (the
    /// model's largest part by far on a busy node; per-thread caps alone let
    /// it grow with the number of threads).
    pub fn with_interval_budget(mut self, bytes: usize) -> Self {
        self.max_intervals_total = (bytes / std::mem::size_of::<Interval>()).max(1);
        self
    }

    /// Keeps intervals and NCCL calls only `ns` (threads, connections and
    /// totals still for the whole retention window).
    pub fn set_interval_retention(&mut self, ns: u64) {
        self.interval_retention_ns = ns.min(self.retention_ns);
    }

    fn thread(&mut self, tgid: u32, tid: u32, now: u64) -> &mut ThreadSeries {
        let t = self
            .threads
            .entry(tid)
            .or_insert_with(|| ThreadSeries::new(tgid, now));
        t.last_ns = t.last_ns.max(now);
        t
    }

    /// The thread switched in (`on_cpu`) or out at `ts`, unless something
    /// newer is already known. Switched out, `blocked` says whether it went to
    /// sleep (since `ts`, and woken when) when that is known; what an earlier
    /// source said of the same switch is kept when this one does not know.
    fn switched(
        &mut self,
        tgid: u32,
        tid: u32,
        ts: u64,
        on_cpu: bool,
        blocked: Option<(u64, Option<u64>)>,
    ) {
        let t = self.thread(tgid, tid, ts);
        if ts > t.last_switch_ns || (ts == t.last_switch_ns && (on_cpu || blocked.is_some())) {
            t.last_switch_ns = ts;
            t.on_cpu_since = on_cpu.then_some(ts);
            t.blocked = if on_cpu { None } else { blocked };
        }
    }

    /// The kernel says what of the thread's intervals stayed there until
    /// `at_ns` (cumulative; an older reading never lowers it).
    fn read_unsent(&mut self, tgid: u32, tid: u32, at_ns: u64, unsent: &Unsent) {
        let t = self.thread(tgid, tid, at_ns);
        let grown = unsent.since(&t.unsent);
        t.unsent = t.unsent.plus(&grown);
        let newest = t.unsent;
        match t.unsent_readings.back_mut() {
            // Readings arrive in time order but an exit record may come
            // after a later map reading: keep them sorted by time.
            Some((last, value)) if *last >= at_ns => *value = newest,
            _ => t.unsent_readings.push_back((at_ns, newest)),
        }
        let by_pid = self.unsent_by_pid.entry(tgid).or_default();
        *by_pid = by_pid.plus(&grown);
    }

    /// Per process, the run-queue time of its intervals that stayed in the
    /// kernel (cumulative, ns), as of the last reading of the kernel's
    /// thread states (also returned).
    pub fn unsent_run_queue_ns(&self) -> (u64, BTreeMap<u32, u64>) {
        (
            self.unsent_read_ns,
            self.unsent_by_pid
                .iter()
                .map(|(&pid, u)| (pid, u.run_queue_ns))
                .collect(),
        )
    }

    fn record_interval(&mut self, e: &SwitchInterval) {
        let Some(cause) = IntervalCause::from_raw(u32::from(e.cause)) else {
            tracing::warn!(kind = ?e.kind, cause = e.cause, "unknown interval cause");
            return;
        };
        let kind = e.kind;
        if e.end_ns
            < self
                .published_until_ns
                .load(std::sync::atomic::Ordering::Relaxed)
        {
            self.intervals_late += 1;
        }
        let duration_ns = e.end_ns.saturating_sub(e.start_ns);
        let cap = self.max_intervals_per_thread;
        let t = self.thread(e.tgid, e.tid, e.end_ns);
        let totals = &mut t.totals;
        match kind {
            IntervalKind::OnCpu => {
                totals.on_cpu_ns += duration_ns;
                totals.on_cpu_intervals += 1;
            }
            IntervalKind::RunQueue => {
                totals.run_queue_ns += duration_ns;
                totals.run_queue_waits += 1;
                if cause == IntervalCause::Preempted {
                    totals.run_queue_waits_after_preemption += 1;
                }
            }
            IntervalKind::OffCpu => {
                totals.off_cpu_ns += duration_ns;
                totals.off_cpu_intervals += 1;
            }
        }
        t.intervals.push_back(Interval {
            start_ns: e.start_ns,
            duration_ns,
            kind,
            cause,
        });
        if t.intervals.len() > cap {
            t.intervals.pop_front();
            self.intervals_dropped += 1;
        }
    }

    /// Accounts one kernel record.
    pub fn record(&mut self, event: &Event) {
        match event {
            Event::SchedSwitch(e) => {
                for interval in e.intervals() {
                    self.record_interval(&interval);
                }
                let now = e.hdr.ts_ns;
                if e.prev_watched != 0 {
                    // Its on-CPU part says why it left, when the record has one.
                    let blocked = (e.has_on_cpu != 0
                        && IntervalCause::from_raw(u32::from(e.on_cpu_cause))
                            == Some(IntervalCause::Blocked))
                    .then_some((now, None));
                    self.switched(e.prev_tgid, e.prev_tid, now, false, blocked);
                }
                if e.next_watched != 0 {
                    self.switched(e.next_tgid, e.next_tid, now, true, None);
                }
            }
            Event::ThreadExit(e) => {
                self.switches.update(
                    e.tgid,
                    e.tid,
                    ThreadSwitches {
                        switched_out: e.switched_out,
                        switched_in: e.switched_in,
                        preempted: e.preempted,
                    },
                );
                self.read_unsent(e.tgid, e.tid, e.hdr.ts_ns, &e.unsent);
                let t = self.thread(e.tgid, e.tid, e.hdr.ts_ns);
                t.exited_ns = Some(e.hdr.ts_ns);
                t.exit_name = e.comm();
                t.on_cpu_since = None;
                t.blocked = None;
                t.last_switch_ns = t.last_switch_ns.max(e.hdr.ts_ns);
            }
            Event::TcpRetransmit(e) => self.retransmits.push_back((e.hdr.ts_ns, e.tgid)),
            Event::TcpClose(e) => {
                self.live_conns.remove(&e.sock);
                self.closed_keys.insert((e.sock, e.stats.opened_ns));
                self.closed_conns
                    .push_back(Connection::from_stats(&e.stats, Some(e.hdr.ts_ns)));
            }
            Event::NcclCall(e) => {
                let Some(func) = NcclFunc::from_raw(e.func) else {
                    tracing::warn!(func = e.func, "unknown NCCL function id");
                    return;
                };
                let cap = self.max_intervals_per_thread;
                let t = self.thread(e.tgid, e.tid, e.return_ns);
                t.totals.nccl_calls += 1;
                t.nccl.push_back(NcclCall {
                    func: func.symbol(),
                    count: e.count,
                    datatype: e.datatype,
                    op: e.op,
                    result: e.result,
                    entry_ns: e.entry_ns,
                    return_ns: e.return_ns,
                });
                if t.nccl.len() > cap {
                    t.nccl.pop_front();
                }
            }
        }
    }

    /// Takes a reading of the kernel's per-thread scheduling state (tid →
    /// state): switch counts, and whether each thread is on a CPU since
    /// when (its records may still be on their way; the newest wins).
    pub fn update_thread_states(&mut self, now: u64, entries: &[(u32, ThreadState)]) {
        for (tid, state) in entries {
            self.switches.update(
                state.tgid,
                *tid,
                ThreadSwitches {
                    switched_out: state.switched_out,
                    switched_in: state.switched_in,
                    preempted: state.preempted,
                },
            );
            self.read_unsent(state.tgid, *tid, now, &state.unsent);
            let (ts, on_cpu) = if state.on_cpu != 0 {
                (state.on_ts, true)
            } else {
                (state.off_ts, false)
            };
            // Off CPU and not waiting for one: asleep since it left. Woken, with
            // its off-CPU interval still to be recorded: asleep until then.
            let blocked = if on_cpu {
                None
            } else if state.runq_ts == 0 {
                Some((state.off_ts, None))
            } else if state.off_cpu_pending != 0 {
                Some((state.off_ts, Some(state.runq_ts)))
            } else {
                None
            };
            // 0: woken but never switched yet, nothing to learn.
            if ts != 0 {
                self.switched(state.tgid, *tid, ts, on_cpu, blocked);
            }
        }
        self.unsent_read_ns = self.unsent_read_ns.max(now);
    }

    /// Takes a reading of the kernel's per-thread TCP counters (cumulative).
    pub fn update_thread_net(&mut self, now: u64, entries: &[(ThreadKey, ThreadNet)]) {
        for (key, net) in entries {
            let t = self.thread(key.tgid, key.tid, now);
            t.totals.tcp_tx_bytes = net.tx_bytes;
            t.totals.tcp_rx_bytes = net.rx_bytes;
            t.totals.tcp_tx_calls = net.tx_calls;
            t.totals.tcp_rx_calls = net.rx_calls;
            if t.net.back().is_none_or(|(_, last)| last != net) || t.net.len() < 2 {
                t.net.push_back((now, *net));
            } else if let Some(last) = t.net.back_mut() {
                last.0 = now;
            }
        }
    }

    /// Takes a reading of the kernel's open-connection table (key: the
    /// struct sock address).
    pub fn update_sockets(&mut self, entries: &[(u64, SockStats)]) {
        for (sock, stats) in entries {
            if !self.closed_keys.contains(&(*sock, stats.opened_ns)) {
                self.live_conns.insert(*sock, *stats);
            }
        }
    }

    /// Trims the threads' intervals to [`Model::max_intervals_total`]: every
    /// thread keeps its newest `cap`, the largest cap that fits (threads with
    /// fewer keep all of theirs).
    fn enforce_interval_budget(&mut self) {
        let mut lengths: Vec<usize> = self.threads.values().map(|t| t.intervals.len()).collect();
        let total: usize = lengths.iter().sum();
        if total <= self.max_intervals_total {
            return;
        }
        lengths.sort_unstable();
        let mut budget = self.max_intervals_total;
        let mut cap = 0;
        for (i, &len) in lengths.iter().enumerate() {
            let share = budget / (lengths.len() - i);
            if len > share {
                cap = share;
                break;
            }
            budget -= len;
            cap = len;
        }
        for t in self.threads.values_mut() {
            while t.intervals.len() > cap {
                t.intervals.pop_front();
                self.intervals_dropped += 1;
            }
        }
    }

    /// Forgets what is older than the retention window before `now`: old
    /// intervals and calls, threads that exited before it, closed
    /// connections. Returns the tids forgotten (their kernel histograms can
    /// be deleted).
    pub fn prune(&mut self, now: u64) -> Vec<u32> {
        let horizon = now.saturating_sub(self.retention_ns);
        let interval_horizon = now.saturating_sub(self.interval_retention_ns);
        let mut gone = Vec::new();
        for (&tid, t) in &mut self.threads {
            while t
                .intervals
                .front()
                .is_some_and(|i| i.start_ns + i.duration_ns < interval_horizon)
            {
                t.intervals.pop_front();
            }
            while t
                .nccl
                .front()
                .is_some_and(|c| c.return_ns < interval_horizon)
            {
                t.nccl.pop_front();
            }
            while t.net.len() > 2 && t.net.get(1).is_some_and(|(ts, _)| *ts < horizon) {
                t.net.pop_front();
            }
            while t.unsent_readings.len() > 2
                && t.unsent_readings
                    .get(1)
                    .is_some_and(|(ts, _)| *ts < interval_horizon)
            {
                t.unsent_readings.pop_front();
            }
            if t.exited_ns.is_some_and(|x| x < horizon) || t.last_ns < horizon {
                gone.push(tid);
            }
        }
        for tid in &gone {
            self.threads.remove(tid);
        }
        let pids: BTreeSet<u32> = self.threads.values().map(|t| t.tgid).collect();
        self.unsent_by_pid.retain(|pid, _| pids.contains(pid));
        self.enforce_interval_budget();
        for t in self.threads.values_mut() {
            shrink_spare(&mut t.intervals);
            shrink_spare(&mut t.nccl);
            shrink_spare(&mut t.net);
            shrink_spare(&mut t.unsent_readings);
        }
        while self
            .closed_conns
            .front()
            .is_some_and(|c| c.closed_ns.is_some_and(|x| x < horizon))
        {
            self.closed_conns.pop_front();
        }
        if self.closed_conns.is_empty() {
            self.closed_keys.clear();
        }
        while self
            .retransmits
            .front()
            .is_some_and(|(ts, _)| *ts < horizon)
        {
            self.retransmits.pop_front();
        }
        gone
    }

    /// Processes known, ascending.
    pub fn pids(&self) -> Vec<u32> {
        let set: BTreeSet<u32> = self.threads.values().map(|t| t.tgid).collect();
        set.into_iter().collect()
    }

    /// Threads of `pid` known, ascending.
    pub fn tids(&self, pid: u32) -> Vec<u32> {
        self.threads
            .iter()
            .filter(|(_, t)| t.tgid == pid)
            .map(|(&tid, _)| tid)
            .collect()
    }

    /// Totals of one thread since first seen.
    pub fn thread_totals(&self, tid: u32) -> Option<ThreadTotals> {
        self.threads.get(&tid).map(ThreadSeries::totals)
    }

    /// Totals of one process (its known threads) since first seen.
    pub fn process_totals(&self, pid: u32) -> ThreadTotals {
        let mut total = ThreadTotals::default();
        for t in self.threads.values().filter(|t| t.tgid == pid) {
            total.add(&t.totals());
        }
        total
    }

    /// Intervals of thread `tid` that overlap `[from_ns, to_ns)`, oldest first.
    pub fn intervals(&self, tid: u32, from_ns: u64, to_ns: u64) -> Vec<Interval> {
        self.threads.get(&tid).map_or_else(Vec::new, |t| {
            // A thread's intervals follow each other and are kept in the
            // order they ended: read back from the newest to the first that
            // ended before the window, not the whole retention (the live
            // view asks for the last second once a second).
            let mut found: Vec<Interval> = t
                .intervals
                .iter()
                .rev()
                .take_while(|i| i.start_ns + i.duration_ns > from_ns)
                .filter(|i| i.start_ns < to_ns)
                .copied()
                .collect();
            found.reverse();
            found
        })
    }

    /// Intervals of thread `tid` that ended at or after `from_ns`, newest
    /// first. A thread's intervals follow each other, so this reads only
    /// the newest ones (cheap enough to call several times a second).
    pub fn intervals_ended_since(&self, tid: u32, from_ns: u64) -> Vec<Interval> {
        self.threads.get(&tid).map_or_else(Vec::new, |t| {
            t.intervals
                .iter()
                .rev()
                .take_while(|i| i.start_ns + i.duration_ns >= from_ns)
                .copied()
                .collect()
        })
    }

    /// The live view has taken every interval that ended before `ns`: one
    /// recorded from now on that ended earlier is counted as late.
    pub fn published_until(&self, ns: u64) {
        self.published_until_ns
            .fetch_max(ns, std::sync::atomic::Ordering::Relaxed);
    }

    /// NCCL calls of thread `tid` that returned in `[from_ns, to_ns)`.
    pub fn nccl_calls(&self, tid: u32, from_ns: u64, to_ns: u64) -> Vec<NcclCall> {
        self.threads.get(&tid).map_or_else(Vec::new, |t| {
            t.nccl
                .iter()
                .filter(|c| c.return_ns >= from_ns && c.return_ns < to_ns)
                .copied()
                .collect()
        })
    }

    /// TCP retransmits with `from_ns <= ts < to_ns`, as (ts, pid), oldest
    /// first (within retention).
    pub fn retransmits_between(&self, from_ns: u64, to_ns: u64) -> Vec<(u64, u32)> {
        self.retransmits
            .iter()
            .copied()
            .filter(|(ts, _)| (from_ns..to_ns).contains(ts))
            .collect()
    }

    /// Connections of `pid` (open and closed within retention); every
    /// process's when `pid` is `None`.
    pub fn connections(&self, pid: Option<u32>) -> Vec<Connection> {
        self.live_conns
            .values()
            .map(|s| Connection::from_stats(s, None))
            .chain(self.closed_conns.iter().cloned())
            .filter(|c| pid.is_none_or(|p| c.pid == p))
            .collect()
    }

    /// How big the model is.
    pub fn stats(&self) -> ModelStats {
        ModelStats {
            threads: self.threads.len(),
            intervals: self.threads.values().map(|t| t.intervals.len()).sum(),
            intervals_dropped_for_memory: self.intervals_dropped,
            intervals_late: self.intervals_late,
            connections: self.live_conns.len() + self.closed_conns.len(),
        }
    }

    /// The name an exited thread had when it exited (its exit record's).
    pub fn exited_name(&self, tid: u32) -> Option<&str> {
        self.threads.get(&tid)?.exit_name.as_deref()
    }

    /// Figures of one thread over `[from_ns, to_ns)`.
    pub fn thread_snapshot(&self, tid: u32, from_ns: u64, to_ns: u64) -> Option<ThreadSnapshot> {
        let t = self.threads.get(&tid)?;
        let window = to_ns.saturating_sub(from_ns).max(1) as f64;
        let overlap = |i: &Interval| {
            let start = i.start_ns.max(from_ns);
            let end = (i.start_ns + i.duration_ns).min(to_ns);
            end.saturating_sub(start)
        };
        let mut on_cpu: u64 = 0;
        let mut off_cpu: u64 = 0;
        let mut waits = Vec::new();
        for i in self.intervals(tid, from_ns, to_ns) {
            match i.kind {
                IntervalKind::OnCpu => on_cpu += overlap(&i),
                IntervalKind::OffCpu => off_cpu += overlap(&i),
                IntervalKind::RunQueue => waits.push(i.duration_ns),
            }
        }
        if let Some(since) = t.on_cpu_since {
            on_cpu += to_ns.saturating_sub(since.max(from_ns));
        }
        if let Some((since, woken)) = t.blocked {
            let end = woken.unwrap_or(to_ns).min(to_ns);
            off_cpu += end.saturating_sub(since.max(from_ns));
        }
        let unsent = t.unsent_between(from_ns, to_ns);
        let on_cpu = on_cpu as f64 + unsent.on_cpu_ns;
        let off_cpu = off_cpu as f64 + unsent.off_cpu_ns;
        let (p50, p99) = percentiles_with_unsent(&mut waits, &unsent);
        let (tx, rx) = net_rate(&t.net, from_ns, to_ns);
        let nccl = t
            .nccl
            .iter()
            .filter(|c| c.return_ns >= from_ns && c.return_ns < to_ns)
            .count();
        Some(ThreadSnapshot {
            tid,
            cpu_pct: (100.0 * on_cpu / window).min(100.0),
            off_cpu_pct: (100.0 * off_cpu / window).min(100.0),
            run_queue_p50_us: p50,
            run_queue_p99_us: p99,
            tcp_tx_bytes_per_s: tx,
            tcp_rx_bytes_per_s: rx,
            nccl_calls_per_s: nccl as f64 * 1e9 / window,
            totals: t.totals(),
            exited: t.exited_ns.is_some(),
        })
    }

    /// Figures of one process over `[from_ns, to_ns)`.
    pub fn process_snapshot(&self, pid: u32, from_ns: u64, to_ns: u64) -> ProcessSnapshot {
        let tids = self.tids(pid);
        let threads: Vec<ThreadSnapshot> = tids
            .iter()
            .filter_map(|&tid| self.thread_snapshot(tid, from_ns, to_ns))
            .collect();
        let mut waits: Vec<u64> = tids
            .iter()
            .flat_map(|&tid| self.intervals(tid, from_ns, to_ns))
            .filter(|i| i.kind == IntervalKind::RunQueue)
            .map(|i| i.duration_ns)
            .collect();
        let unsent = tids
            .iter()
            .filter_map(|tid| self.threads.get(tid))
            .map(|t| t.unsent_between(from_ns, to_ns))
            .fold(UnsentShare::default(), |sum, u| UnsentShare {
                run_queue_ns: sum.run_queue_ns + u.run_queue_ns,
                run_queue: sum.run_queue + u.run_queue,
                ..sum
            });
        let (p50, p99) = percentiles_with_unsent(&mut waits, &unsent);
        let live: Vec<&ThreadSnapshot> = threads.iter().filter(|t| !t.exited).collect();
        let retransmits_total = self
            .connections(Some(pid))
            .iter()
            .map(|c| c.retransmits)
            .sum();
        ProcessSnapshot {
            pid,
            cpu_pct: threads.iter().map(|t| t.cpu_pct).sum(),
            off_cpu_pct: if live.is_empty() {
                0.0
            } else {
                live.iter().map(|t| t.off_cpu_pct).sum::<f64>() / live.len() as f64
            },
            run_queue_p50_us: p50,
            run_queue_p99_us: p99,
            tcp_tx_bytes_per_s: threads.iter().map(|t| t.tcp_tx_bytes_per_s).sum(),
            tcp_rx_bytes_per_s: threads.iter().map(|t| t.tcp_rx_bytes_per_s).sum(),
            retransmits_in_window: self
                .retransmits
                .iter()
                .filter(|(ts, p)| *p == pid && *ts >= from_ns && *ts < to_ns)
                .count() as u64,
            retransmits_total,
            nccl_calls_per_s: threads.iter().map(|t| t.nccl_calls_per_s).sum(),
            totals: self.process_totals(pid),
            threads,
        }
    }
}

/// (p50, p99) in µs of durations in ns (nearest rank). Selects the two
/// ranks instead of sorting: this runs once a second over every run-queue
/// wait of the last second (tens of thousands for a busy job), and the
/// sort was the live view's largest single cost.
fn percentiles(values: &mut [u64]) -> (Option<f64>, Option<f64>) {
    if values.is_empty() {
        return (None, None);
    }
    let rank = |q: f64| ((q * values.len() as f64).ceil() as usize).clamp(1, values.len()) - 1;
    let (i50, i99) = (rank(0.50), rank(0.99));
    let p99 = *values.select_nth_unstable(i99).1;
    // Everything before i99 is now <= p99, so the i50-th smallest of all
    // is the i50-th smallest of that prefix.
    let p50 = if i50 < i99 {
        *values[..i99].select_nth_unstable(i50).1
    } else {
        p99
    };
    (Some(p50 as f64 / 1000.0), Some(p99 as f64 / 1000.0))
}

/// (p50, p99) in µs of the run-queue waits of a window: those received
/// (`values`, ns) and those that stayed in the kernel (`unsent`: their
/// number and time in the window). The ones that stayed are shorter than
/// every one sent (`--min-interval`): a percentile whose rank falls among
/// them is their mean, the best the kernel's sum and count tell.
fn percentiles_with_unsent(values: &mut [u64], unsent: &UnsentShare) -> (Option<f64>, Option<f64>) {
    let held = unsent.run_queue.round();
    if held < 1.0 {
        return percentiles(values);
    }
    let held_mean_us = unsent.run_queue_ns / held / 1000.0;
    let n = values.len() as f64 + held;
    let at = |q: f64, values: &mut [u64]| {
        // Nearest rank, 1-based, over the held waits first.
        let rank = (q * n).ceil().clamp(1.0, n);
        if rank <= held {
            held_mean_us
        } else {
            let i = (rank - held) as usize - 1;
            *values.select_nth_unstable(i.min(values.len() - 1)).1 as f64 / 1000.0
        }
    };
    let p99 = at(0.99, values);
    let p50 = at(0.50, values);
    (Some(p50), Some(p99))
}

/// Bytes/s sent and received between the samples bracketing the window.
fn net_rate(samples: &VecDeque<(u64, ThreadNet)>, from_ns: u64, to_ns: u64) -> (f64, f64) {
    let before = samples.iter().rev().find(|(ts, _)| *ts <= from_ns);
    let start = before.or_else(|| samples.front());
    let end = samples.iter().rev().find(|(ts, _)| *ts <= to_ns);
    match (start, end) {
        (Some((t0, a)), Some((t1, b))) if t1 > t0 => {
            let secs = (t1 - t0) as f64 / 1e9;
            (
                b.tx_bytes.saturating_sub(a.tx_bytes) as f64 / secs,
                b.rx_bytes.saturating_sub(a.rx_bytes) as f64 / secs,
            )
        }
        _ => (0.0, 0.0),
    }
}

/// `CLOCK_MONOTONIC` now, in ns: the clock of the kernel's records.
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: valid pointer to a timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;
    use ebpf::{EventHeader, SchedSwitchEvent};

    fn state(tgid: u32, on_cpu_since: Option<u64>, off_ts: u64, counts: [u64; 3]) -> ThreadState {
        ThreadState {
            on_ts: on_cpu_since.unwrap_or(0),
            off_ts,
            tgid,
            on_cpu: u8::from(on_cpu_since.is_some()),
            switched_out: counts[0],
            switched_in: counts[1],
            preempted: counts[2],
            ..ThreadState::default()
        }
    }

    #[test]
    fn percentiles_select_the_ranks_a_full_sort_finds() {
        // A small deterministic generator: many duplicates, every length
        // from 1 to 300 (the p50 == p99 rank of short inputs included).
        let mut x: u64 = 0x9e37_79b9_7f4a_7c15;
        for len in 1..=300usize {
            let values: Vec<u64> = (0..len)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x % 50_000
                })
                .collect();
            let mut sorted = values.clone();
            sorted.sort_unstable();
            let nearest = |q: f64| {
                sorted[((q * len as f64).ceil() as usize).clamp(1, len) - 1] as f64 / 1000.0
            };
            let mut scratch = values.clone();
            assert_eq!(
                percentiles(&mut scratch),
                (Some(nearest(0.50)), Some(nearest(0.99))),
                "{values:?}"
            );
        }
        assert_eq!(percentiles(&mut []), (None, None));
    }

    #[test]
    fn a_thread_blocked_for_the_whole_window_is_off_cpu_for_all_of_it() {
        // A main thread joining its workers: it went to sleep at 1 ms and has
        // not run since, so no interval of it ever closes.
        let mut model = Model::new(10_000 * MS, 1000);
        model.update_thread_states(5 * MS, &[(10, state(10, None, MS, [1, 1, 0]))]);
        let snap = model.thread_snapshot(10, 2 * MS, 1002 * MS).unwrap();
        assert_eq!(snap.off_cpu_pct, 100.0);
        assert_eq!(snap.cpu_pct, 0.0);
        // Woken at 500 ms (its off-CPU interval is recorded only when it runs
        // again): off CPU for the first half of the window only.
        let mut woken = state(10, None, MS, [1, 1, 0]);
        woken.runq_ts = 502 * MS;
        woken.off_cpu_pending = 1;
        model.update_thread_states(600 * MS, &[(10, woken)]);
        let snap = model.thread_snapshot(10, 2 * MS, 1002 * MS).unwrap();
        assert_eq!(snap.off_cpu_pct, 50.0);
        // Preempted (runnable, not asleep): not off CPU.
        let mut preempted = state(11, None, MS, [1, 1, 1]);
        preempted.runq_ts = MS;
        model.update_thread_states(600 * MS, &[(11, preempted)]);
        assert_eq!(
            model
                .thread_snapshot(11, 2 * MS, 1002 * MS)
                .unwrap()
                .off_cpu_pct,
            0.0
        );
        // Once it runs again, the closed interval counts and the open term is gone.
        // 10/10 switches in at 503 ms: blocked [1 ms, 502 ms), runnable until 503 ms.
        let mut e = switch((99, 99, false), (10, 10, true), 503 * MS);
        (e.has_off_cpu, e.off_cpu_start_ns, e.runnable_ns) = (1, MS, 502 * MS);
        (e.has_run_queue, e.run_queue_cause) = (1, IntervalCause::Woken as u8);
        model.record(&Event::SchedSwitch(e));
        let snap = model.thread_snapshot(10, 2 * MS, 1002 * MS).unwrap();
        assert_eq!(snap.off_cpu_pct, 50.0);
        assert!(snap.cpu_pct > 49.0, "{snap:?}");
    }

    #[test]
    fn switch_counts_come_from_the_kernel_readings_and_the_exit_record() {
        let mut model = Model::new(10_000 * MS, 1000);
        model.update_thread_states(
            5 * MS,
            &[
                (11, state(10, Some(4 * MS), 3 * MS, [2, 1, 1])),
                (12, state(10, None, 2 * MS, [1, 1, 0])),
            ],
        );
        assert_eq!(
            model.switches.processes[&10][&11],
            ThreadSwitches {
                switched_out: 2,
                switched_in: 1,
                preempted: 1
            }
        );
        // A reading older than what is known never lowers a count.
        model.update_thread_states(6 * MS, &[(11, state(10, None, 3 * MS, [1, 1, 0]))]);
        assert_eq!(model.switches.processes[&10][&11].switched_out, 2);
        // The exit record carries the final counts, the last switch included.
        model.record(&Event::ThreadExit(ebpf::ThreadExitEvent {
            hdr: EventHeader {
                ts_ns: 7 * MS,
                kind: 3,
                cpu: 0,
            },
            tgid: 10,
            tid: 12,
            switched_out: 3,
            switched_in: 2,
            preempted: 1,
            comm: *b"rw-short\0\0\0\0\0\0\0\0",
            unsent: Unsent::default(),
        }));
        assert_eq!(model.exited_name(12), Some("rw-short"));
        assert_eq!(model.switches.process_total(10).switched_out, 5);
        assert_eq!(model.switches.process_total(10).switched_in, 3);
        assert_eq!(model.switches.process_total(10).preempted, 2);
    }

    fn switch(prev: (u32, u32, bool), next: (u32, u32, bool), ts: u64) -> SchedSwitchEvent {
        SchedSwitchEvent {
            hdr: EventHeader {
                ts_ns: ts,
                kind: 1,
                cpu: 0,
            },
            prev_tgid: prev.0,
            prev_tid: prev.1,
            next_tgid: next.0,
            next_tid: next.1,
            on_cpu_start_ns: 0,
            off_cpu_start_ns: 0,
            runnable_ns: 0,
            prev_watched: u8::from(prev.2),
            next_watched: u8::from(next.2),
            has_on_cpu: 0,
            has_off_cpu: 0,
            has_run_queue: 0,
            on_cpu_cause: 0,
            run_queue_cause: 0,
            _pad: 0,
        }
    }

    #[test]
    fn a_window_of_intervals_is_what_a_scan_of_all_of_them_finds() {
        // Thread 10/11 runs, blocks, is woken and waits, over and over, in
        // steps of uneven length; every window asked for must give exactly
        // the intervals a scan of the whole retention finds.
        let mut model = Model::new(u64::MAX, 100_000);
        let mut t = MS;
        let mut off_since = 0;
        for k in 0..300u64 {
            let on_for = 1 + k % 7;
            let off_for = 1 + (k * 5) % 11;
            let wait_for = k % 3;
            // 10/11 switches out (blocked) after `on_for` on CPU.
            let mut out = switch((10, 11, true), (99, 99, false), t + on_for);
            (out.has_on_cpu, out.on_cpu_start_ns, out.on_cpu_cause) = (1, t, 2);
            model.record(&Event::SchedSwitch(out));
            off_since = t + on_for;
            // Woken after `off_for`, switched in after `wait_for` more.
            let runnable = off_since + off_for;
            t = runnable + wait_for;
            let mut back = switch((99, 99, false), (10, 11, true), t);
            (back.has_off_cpu, back.off_cpu_start_ns) = (1, off_since);
            (back.has_run_queue, back.runnable_ns, back.run_queue_cause) = (1, runnable, 3);
            model.record(&Event::SchedSwitch(back));
        }
        assert!(off_since > 0);
        let all = model.intervals(11, 0, u64::MAX);
        assert_eq!(all.len(), 900);
        for from in (MS - 10..t + 10).step_by(7) {
            for len in [0, 1, 5, 30, 400, 10_000] {
                let to = from + len;
                let scanned: Vec<Interval> = all
                    .iter()
                    .filter(|i| i.start_ns < to && i.start_ns + i.duration_ns > from)
                    .copied()
                    .collect();
                assert_eq!(model.intervals(11, from, to), scanned, "[{from}, {to})");
            }
        }
    }

    #[test]
    fn a_switch_record_carries_every_interval_it_ended() {
        let mut model = Model::new(10_000 * MS, 1000);
        // 10/11 leaves the CPU preempted after 4 ms on it; 10/12 takes it
        // after waiting 1 ms since its wakeup, which ended 7 ms blocked.
        let mut e = switch((10, 11, true), (10, 12, true), 10 * MS);
        (e.has_on_cpu, e.on_cpu_start_ns, e.on_cpu_cause) = (1, 6 * MS, 1);
        (e.has_run_queue, e.runnable_ns, e.run_queue_cause) = (1, 9 * MS, 2);
        (e.has_off_cpu, e.off_cpu_start_ns) = (1, 2 * MS);
        model.record(&Event::SchedSwitch(e));
        let on = model.intervals(11, 0, u64::MAX);
        assert_eq!(
            on,
            [Interval {
                start_ns: 6 * MS,
                duration_ns: 4 * MS,
                kind: IntervalKind::OnCpu,
                cause: IntervalCause::Preempted
            }]
        );
        let incoming = model.intervals(12, 0, u64::MAX);
        assert_eq!(
            incoming,
            [
                Interval {
                    start_ns: 2 * MS,
                    duration_ns: 7 * MS,
                    kind: IntervalKind::OffCpu,
                    cause: IntervalCause::Blocked
                },
                Interval {
                    start_ns: 9 * MS,
                    duration_ns: MS,
                    kind: IntervalKind::RunQueue,
                    cause: IntervalCause::Woken
                }
            ]
        );
        let totals = model.thread_totals(12).unwrap();
        assert_eq!((totals.off_cpu_ns, totals.run_queue_ns), (7 * MS, MS));
        // 12 has been on the CPU since the switch, 11 is off it.
        let snap = model.thread_snapshot(12, 10 * MS, 20 * MS).unwrap();
        assert!((snap.cpu_pct - 100.0).abs() < 1e-9, "{snap:?}");
        let snap = model.thread_snapshot(11, 10 * MS, 20 * MS).unwrap();
        assert!(snap.cpu_pct.abs() < 1e-9, "{snap:?}");
    }

    #[test]
    fn on_cpu_since_follows_the_newest_of_records_and_readings() {
        let mut model = Model::new(10_000 * MS, 1000);
        // A switch in below --min-interval sends no record: the reading says
        // the thread is on the CPU since 10 ms.
        model.update_thread_states(
            15 * MS,
            &[(11, state(10, Some(10 * MS), 5 * MS, [1, 1, 0]))],
        );
        let snap = model.thread_snapshot(11, 10 * MS, 20 * MS).unwrap();
        assert!((snap.cpu_pct - 100.0).abs() < 1e-9, "{snap:?}");
        // A record of an older switch, read after it, changes nothing.
        model.record(&Event::SchedSwitch(switch(
            (10, 11, true),
            (0, 0, false),
            8 * MS,
        )));
        let snap = model.thread_snapshot(11, 10 * MS, 20 * MS).unwrap();
        assert!((snap.cpu_pct - 100.0).abs() < 1e-9, "{snap:?}");
        // A newer one does: off the CPU since 16 ms.
        model.record(&Event::SchedSwitch(switch(
            (10, 11, true),
            (0, 0, false),
            16 * MS,
        )));
        let snap = model.thread_snapshot(11, 10 * MS, 20 * MS).unwrap();
        assert!(snap.cpu_pct.abs() < 1e-9, "{snap:?}");
    }

    /// One interval, as a switch record carries it; `kind` 1: on CPU, 2:
    /// run queue, 3: off CPU.
    fn interval(tgid: u32, tid: u32, kind: u32, cause: u8, start: u64, dur: u64) -> SwitchInterval {
        SwitchInterval {
            tgid,
            tid,
            kind: match kind {
                1 => IntervalKind::OnCpu,
                2 => IntervalKind::RunQueue,
                _ => IntervalKind::OffCpu,
            },
            cause,
            start_ns: start,
            end_ns: start + dur,
        }
    }

    const MS: u64 = 1_000_000;

    #[test]
    fn totals_snapshots_and_time_ranges() {
        let mut model = Model::new(10_000 * MS, 1000);
        // thread 11: on CPU 0..100ms, blocked 100..600ms, waits 1ms, on 601..700.
        model.record_interval(&interval(10, 11, 1, 0, 0, 100 * MS));
        model.record_interval(&interval(10, 11, 3, 0, 100 * MS, 500 * MS));
        model.record_interval(&interval(10, 11, 2, 2, 600 * MS, MS));
        model.record_interval(&interval(10, 11, 1, 1, 601 * MS, 99 * MS));
        model.record_interval(&interval(10, 11, 2, 1, 700 * MS, 3 * MS));
        let t = model.thread_totals(11).unwrap();
        assert_eq!(t.on_cpu_ns, 199 * MS);
        assert_eq!(t.off_cpu_ns, 500 * MS);
        assert_eq!(
            (t.run_queue_waits, t.run_queue_waits_after_preemption),
            (2, 1)
        );
        assert_eq!(model.intervals(11, 550 * MS, 650 * MS).len(), 3);
        // Ended at or after 601 ms: the last three, newest first.
        let ended: Vec<u64> = model
            .intervals_ended_since(11, 601 * MS)
            .iter()
            .map(|i| i.start_ns)
            .collect();
        assert_eq!(ended, [700 * MS, 601 * MS, 600 * MS]);
        let snap = model.thread_snapshot(11, 0, 1000 * MS).unwrap();
        assert!((snap.cpu_pct - 19.9).abs() < 1e-9, "{snap:?}");
        assert!((snap.off_cpu_pct - 50.0).abs() < 1e-9);
        assert_eq!(snap.run_queue_p50_us, Some(1000.0));
        assert_eq!(snap.run_queue_p99_us, Some(3000.0));
        let p = model.process_snapshot(10, 0, 1000 * MS);
        assert_eq!(p.threads.len(), 1);
        assert_eq!(p.totals.on_cpu_ns, 199 * MS);
    }

    fn unsent(on_cpu_ns: u64, run_queue_ns: u64, off_cpu_ns: u64, n: [u64; 3]) -> Unsent {
        Unsent {
            on_cpu_ns,
            run_queue_ns,
            off_cpu_ns,
            on_cpu: n[0],
            run_queue: n[1],
            off_cpu: n[2],
        }
    }

    #[test]
    fn intervals_that_stayed_in_the_kernel_count_in_totals_and_windows() {
        // A thread that trades the CPU every few µs (--min-interval keeps
        // every interval in the kernel), and one long wait that was sent.
        let mut model = Model::new(10_000 * MS, 1000);
        let reading = |ts, u: Unsent| {
            let mut s = state(10, None, ts, [0, 0, 0]);
            s.unsent = u;
            (11, s)
        };
        model.update_thread_states(1000 * MS, &[reading(1000 * MS, Unsent::default())]);
        // Over [1000, 2000) ms: 300 ms on CPU in 30,000 intervals, 600 ms
        // waiting in 30,000 waits of 20 µs, 50 ms blocked in 1,000.
        let second = unsent(300 * MS, 600 * MS, 50 * MS, [30_000, 30_000, 1_000]);
        model.update_thread_states(2000 * MS, &[reading(2000 * MS, second)]);
        // An older reading (records and readings cross) lowers nothing.
        model.update_thread_states(
            1500 * MS,
            &[reading(1500 * MS, unsent(MS, MS, MS, [1, 1, 1]))],
        );
        model.record_interval(&interval(10, 11, 2, 1, 1900 * MS, 40 * MS));
        let t = model.thread_totals(11).unwrap();
        assert_eq!(t.on_cpu_ns, 300 * MS);
        assert_eq!(t.run_queue_ns, 640 * MS);
        assert_eq!(t.off_cpu_ns, 50 * MS);
        assert_eq!(
            (t.on_cpu_intervals, t.run_queue_waits, t.off_cpu_intervals),
            (30_000, 30_001, 1_000)
        );
        assert_eq!(t.intervals_not_sent, 61_000);
        let snap = model.thread_snapshot(11, 1000 * MS, 2000 * MS).unwrap();
        assert!((snap.cpu_pct - 30.0).abs() < 1e-9, "{snap:?}");
        assert!((snap.off_cpu_pct - 5.0).abs() < 1e-9, "{snap:?}");
        // 30,000 waits of 20 µs and one of 40 ms: the median is the short
        // ones' mean, the 99th percentile too (the long one is 1 in 30,001).
        assert_eq!(snap.run_queue_p50_us, Some(20.0));
        assert_eq!(snap.run_queue_p99_us, Some(20.0));
        // Half the window: half of what stayed in the kernel (linear between
        // the readings).
        let half = model.thread_snapshot(11, 1000 * MS, 1500 * MS).unwrap();
        assert!((half.cpu_pct - 30.0).abs() < 1e-9, "{half:?}");
        // Before the first reading and after the last: nothing is known to
        // have stayed in the kernel then.
        let before = model.thread_snapshot(11, 0, 1000 * MS).unwrap();
        assert_eq!(before.cpu_pct, 0.0);
        let p = model.process_snapshot(10, 1000 * MS, 2000 * MS);
        assert!((p.cpu_pct - 30.0).abs() < 1e-9, "{p:?}");
        assert_eq!(p.run_queue_p50_us, Some(20.0));
        assert_eq!(p.totals.intervals_not_sent, 61_000);
        // The process's run-queue time that stayed in the kernel, for the
        // tuning feed, as of the last reading.
        assert_eq!(
            model.unsent_run_queue_ns(),
            (2000 * MS, BTreeMap::from([(10, 600 * MS)]))
        );
        // The exit record brings the last of it.
        model.record(&Event::ThreadExit(ebpf::ThreadExitEvent {
            hdr: EventHeader {
                ts_ns: 2500 * MS,
                kind: 3,
                cpu: 0,
            },
            tgid: 10,
            tid: 11,
            switched_out: 1,
            switched_in: 1,
            preempted: 0,
            comm: [0; 16],
            unsent: unsent(400 * MS, 600 * MS, 50 * MS, [40_000, 30_000, 1_000]),
        }));
        assert_eq!(model.thread_totals(11).unwrap().on_cpu_ns, 400 * MS);
        let last = model.thread_snapshot(11, 2000 * MS, 2500 * MS).unwrap();
        assert!((last.cpu_pct - 20.0).abs() < 1e-9, "{last:?}");
    }

    #[test]
    fn a_run_queue_percentile_among_the_sent_waits_is_theirs() {
        // 10 waits of 1 µs stayed in the kernel, 90 of 100..190 µs were sent.
        let mut sent: Vec<u64> = (0..90).map(|i| (100 + i) * 1000).collect();
        let held = UnsentShare {
            run_queue: 10.0,
            run_queue_ns: 10_000.0,
            ..UnsentShare::default()
        };
        // Rank 50 of 100 is the 40th smallest sent wait, rank 99 the 89th.
        assert_eq!(
            percentiles_with_unsent(&mut sent, &held),
            (Some(139.0), Some(188.0))
        );
        // Nothing held back: the plain percentiles.
        let mut again: Vec<u64> = (0..90).map(|i| (100 + i) * 1000).collect();
        let none = percentiles_with_unsent(&mut again, &UnsentShare::default());
        let mut plain: Vec<u64> = (0..90).map(|i| (100 + i) * 1000).collect();
        assert_eq!(none, percentiles(&mut plain));
    }

    #[test]
    fn a_cumulative_counter_is_linear_between_readings() {
        let readings = VecDeque::from([(10, 0u64), (20, 100), (40, 100)]);
        let at = |t| cumulative_at(&readings, t, |&v| v as f64);
        assert_eq!(at(5), 0.0);
        assert_eq!(at(15), 50.0);
        assert_eq!(at(20), 100.0);
        assert_eq!(at(30), 100.0);
        assert_eq!(at(50), 100.0);
        assert_eq!(
            cumulative_at(&VecDeque::<(u64, u64)>::new(), 5, |&v| v as f64),
            0.0
        );
    }

    #[test]
    fn traffic_rates_and_connections() {
        let mut model = Model::new(10_000 * MS, 1000);
        let key = ThreadKey { tgid: 5, tid: 6 };
        let net = |tx| ThreadNet {
            tx_bytes: tx,
            rx_bytes: 0,
            tx_calls: 1,
            rx_calls: 0,
        };
        model.update_thread_net(0, &[(key, net(0))]);
        model.update_thread_net(1000 * MS, &[(key, net(5000))]);
        model.update_thread_net(2000 * MS, &[(key, net(15000))]);
        let snap = model.thread_snapshot(6, 1000 * MS, 2000 * MS).unwrap();
        assert!((snap.tcp_tx_bytes_per_s - 10000.0).abs() < 1e-6, "{snap:?}");
        assert_eq!(model.process_totals(5).tcp_tx_bytes, 15000);

        let mut stats = SockStats {
            tgid: 5,
            family: 2,
            sport: 40000,
            dport: 80,
            tx_bytes: 7,
            opened_ns: 3,
            ..SockStats::default()
        };
        stats.saddr[..4].copy_from_slice(&[127, 0, 0, 1]);
        stats.daddr[..4].copy_from_slice(&[127, 0, 0, 2]);
        model.update_sockets(&[(0xabc, stats)]);
        let conns = model.connections(Some(5));
        assert_eq!(conns.len(), 1);
        assert_eq!(conns[0].local, "127.0.0.1:40000");
        assert_eq!(conns[0].remote, "127.0.0.2:80");
        stats.tx_bytes = 9;
        stats.retransmits = 2;
        model.record(&Event::TcpClose(ebpf::TcpCloseEvent {
            hdr: EventHeader {
                ts_ns: 50,
                kind: 5,
                cpu: 0,
            },
            sock: 0xabc,
            stats,
        }));
        // A stale reading taken before the close must not bring it back.
        model.update_sockets(&[(0xabc, stats)]);
        let conns = model.connections(None);
        assert_eq!(conns.len(), 1);
        assert_eq!((conns[0].tx_bytes, conns[0].closed_ns), (9, Some(50)));
        assert_eq!(model.process_snapshot(5, 0, 100).retransmits_total, 2);
    }

    #[test]
    fn intervals_recorded_after_their_time_was_published_are_counted_late() {
        let mut model = Model::new(1000 * MS, 100);
        model.record_interval(&interval(1, 2, 1, 0, 0, 10 * MS));
        model.published_until(20 * MS);
        // Ended at 15 ms, recorded after the live view took [.., 20 ms): late.
        model.record_interval(&interval(1, 2, 1, 0, 10 * MS, 5 * MS));
        // Ends at 25 ms: the next view takes it.
        model.record_interval(&interval(1, 2, 1, 0, 15 * MS, 10 * MS));
        // The watermark never goes back.
        model.published_until(5 * MS);
        model.record_interval(&interval(1, 3, 1, 0, 0, 19 * MS));
        assert_eq!(model.stats().intervals_late, 2);
        assert_eq!(model.stats().intervals, 4);
    }

    #[test]
    fn memory_is_bounded_by_cap_and_retention() {
        let mut model = Model::new(1000 * MS, 10);
        for i in 0..100 {
            model.record_interval(&interval(1, 2, 1, 0, i * MS, MS));
        }
        assert_eq!(model.stats().intervals, 10);
        assert_eq!(model.stats().intervals_dropped_for_memory, 90);
        model.record(&Event::ThreadExit(ebpf::ThreadExitEvent {
            hdr: EventHeader {
                ts_ns: 101 * MS,
                kind: 3,
                cpu: 0,
            },
            tgid: 1,
            tid: 2,
            switched_out: 0,
            switched_in: 0,
            preempted: 0,
            comm: [0; 16],
            unsent: Unsent::default(),
        }));
        assert!(model.prune(500 * MS).is_empty());
        assert_eq!(model.prune(2000 * MS), vec![2]);
        assert_eq!(model.stats().threads, 0);
    }

    #[test]
    fn the_interval_budget_trims_the_busiest_threads_first() {
        let size = std::mem::size_of::<Interval>();
        let mut model = Model::new(u64::MAX, 1_000).with_interval_budget(100 * size);
        // Thread 1: 10 intervals, thread 2: 200, thread 3: 50 (260 > 100).
        for (tid, count) in [(1u32, 10u64), (2, 200), (3, 50)] {
            for i in 0..count {
                model.record_interval(&interval(1, tid, 1, 0, i * MS, MS));
            }
        }
        model.prune(0);
        let kept = |tid| model.intervals(tid, 0, u64::MAX).len();
        // 10 fit; the other two share the 90 left, 45 each, the newest.
        assert_eq!((kept(1), kept(2), kept(3)), (10, 45, 45));
        assert_eq!(model.stats().intervals_dropped_for_memory, 155 + 5);
        let newest = model.intervals(2, 0, u64::MAX);
        assert_eq!(newest.last().map(|i| i.start_ns), Some(199 * MS));
    }

    #[test]
    fn intervals_may_be_kept_shorter_than_threads() {
        let mut model = Model::new(10_000 * MS, 1_000);
        model.set_interval_retention(100 * MS);
        for i in 0..50 {
            model.record_interval(&interval(1, 2, 1, 0, i * 10 * MS, 10 * MS));
        }
        // At 500 ms: intervals that ended before 400 ms are gone, the thread
        // (seen at 500 ms) is not.
        assert!(model.prune(500 * MS).is_empty());
        let kept = model.intervals(2, 0, u64::MAX);
        assert_eq!(kept.first().map(|i| i.start_ns), Some(390 * MS));
        assert_eq!(model.stats().threads, 1);
        assert_eq!(model.thread_totals(2).map(|t| t.on_cpu_intervals), Some(50));
    }
}
