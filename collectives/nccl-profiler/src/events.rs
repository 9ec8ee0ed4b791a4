//! From NCCL's events to one [`Record`] per collective.
//!
//! A collective's handle is a slot of a fixed pool allocated once (never
//! freed: the library pins itself), so a handle NCCL hands back late — a
//! kernel channel after its collective was sent — never points to freed
//! memory. Slots are taken round-robin; a slot still busy when its turn
//! comes again (its channels never all stopped, [`POOL_SLOTS`] collectives
//! ago) is sent as it stands, marked incomplete by `channels_done`.
//!
//! A kernel channel's handle is its collective's slot with the low bit set;
//! every other event type gets a NULL handle (NCCL then skips its stop).
//!
//! Cost on NCCL's threads: one uncontended mutex per event and, when a
//! collective completes, one non-blocking `try_send` into the bounded queue
//! ([`crate::sender`]).

use std::ffi::{c_char, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::record::{Name, Record, datatype_size};
use crate::sender;

/// Collectives in flight at most (enqueued, kernel not yet seen to stop).
pub const POOL_SLOTS: usize = 4096;

/// A communicator, as `init` described it: the plugin's context.
#[derive(Debug)]
pub struct Comm {
    pub profiler: u8,
    pub comm_hash: u64,
    pub nranks: i32,
    pub rank: i32,
}

#[derive(Default)]
struct SlotData {
    busy: bool,
    /// NCCL stopped the collective's event (it is enqueued).
    stopped: bool,
    started: u32,
    rec: Record,
}

#[repr(align(64))]
struct Slot(Mutex<SlotData>);

struct Pool {
    slots: Box<[Slot]>,
    next: AtomicU64,
}

fn pool() -> &'static Pool {
    static POOL: OnceLock<Pool> = OnceLock::new();
    POOL.get_or_init(|| Pool {
        slots: (0..POOL_SLOTS)
            .map(|_| Slot(Mutex::new(SlotData::default())))
            .collect(),
        next: AtomicU64::new(0),
    })
}

fn lock(slot: &Slot) -> MutexGuard<'_, SlotData> {
    slot.0
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The slot a handle names, if it is one of the pool's (low bit cleared).
fn slot_of(handle: *mut c_void) -> Option<(&'static Slot, bool)> {
    let addr = handle as usize;
    let kernel = addr & 1 == 1;
    let addr = addr & !1;
    let pool = pool();
    let base = pool.slots.as_ptr() as usize;
    let size = std::mem::size_of::<Slot>();
    if addr < base || addr >= base + size * pool.slots.len() || !(addr - base).is_multiple_of(size)
    {
        return None;
    }
    Some((&pool.slots[(addr - base) / size], kernel))
}

/// What a collective's descriptor says, whatever its version.
pub struct CollDescr {
    pub rank: i32,
    /// From the descriptor where it has one (v3), else the context's.
    pub comm_hash: Option<u64>,
    pub seq: u64,
    pub func: *const c_char,
    pub datatype: *const c_char,
    pub algo: *const c_char,
    pub proto: *const c_char,
    pub count: u64,
    pub channels: u32,
}

/// CLOCK_MONOTONIC in ns (the agent's eBPF clock).
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid timespec; CLOCK_MONOTONIC always exists.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// A collective was enqueued: its slot, as the handle.
///
/// # Safety
/// The descriptor's string pointers are NULL or NUL-terminated.
pub unsafe fn start_coll(comm: &Comm, d: &CollDescr) -> *mut c_void {
    let now = monotonic_ns();
    let pool = pool();
    let n = pool.next.fetch_add(1, Ordering::Relaxed);
    let slot = &pool.slots[(n % POOL_SLOTS as u64) as usize];
    let mut data = lock(slot);
    if data.busy {
        // Its channels never all stopped in POOL_SLOTS collectives: sent
        // as it stands.
        sender::counters()
            .incomplete
            .fetch_add(1, Ordering::Relaxed);
        sender::send(data.rec);
    }
    // SAFETY: the caller's promise on the strings.
    let (func, datatype, algo, proto) = unsafe {
        (
            Name::from_c(d.func),
            Name::from_c(d.datatype),
            Name::from_c(d.algo),
            Name::from_c(d.proto),
        )
    };
    *data = SlotData {
        busy: true,
        stopped: false,
        started: 0,
        rec: Record {
            profiler: comm.profiler,
            comm: d.comm_hash.unwrap_or(comm.comm_hash),
            rank: if d.rank >= 0 { d.rank } else { comm.rank },
            nranks: comm.nranks,
            seq: d.seq,
            func,
            datatype,
            algo,
            proto,
            count: d.count,
            bytes: d.count.saturating_mul(datatype_size(datatype.as_str())),
            channels: d.channels,
            enqueue_start_ns: now,
            ..Record::default()
        },
    };
    slot as *const Slot as *mut c_void
}

/// A kernel channel of collective `parent` started; `gpu_ns` is its GPU
/// start time where NCCL gives one (v4+).
pub fn start_kernel(parent: *mut c_void, gpu_ns: Option<u64>) -> *mut c_void {
    let Some((slot, false)) = slot_of(parent) else {
        return std::ptr::null_mut();
    };
    let now = monotonic_ns();
    let mut data = lock(slot);
    if !data.busy {
        return std::ptr::null_mut();
    }
    data.started += 1;
    let rec = &mut data.rec;
    if rec.kernel_cpu_start_ns == 0 || now < rec.kernel_cpu_start_ns {
        rec.kernel_cpu_start_ns = now;
    }
    if let Some(gpu) = gpu_ns.filter(|&t| t != 0)
        && (rec.gpu_start_ns == 0 || gpu < rec.gpu_start_ns)
    {
        rec.gpu_start_ns = gpu;
    }
    (slot as *const Slot as usize | 1) as *mut c_void
}

/// A kernel channel's GPU stop time (state `KernelChStop`).
pub fn kernel_gpu_stop(handle: *mut c_void, gpu_ns: u64) {
    let Some((slot, true)) = slot_of(handle) else {
        return;
    };
    let mut data = lock(slot);
    if data.busy && gpu_ns > data.rec.gpu_stop_ns {
        data.rec.gpu_stop_ns = gpu_ns;
    }
}

/// NCCL stopped an event of ours: a collective (enqueued) or a kernel
/// channel (done). The collective is sent once both are true of it.
pub fn stop(handle: *mut c_void) {
    let Some((slot, kernel)) = slot_of(handle) else {
        return;
    };
    let now = monotonic_ns();
    let mut data = lock(slot);
    if !data.busy {
        return;
    }
    if kernel {
        data.rec.channels_done += 1;
        data.rec.kernel_cpu_stop_ns = data.rec.kernel_cpu_stop_ns.max(now);
    } else {
        data.stopped = true;
        data.rec.enqueue_stop_ns = now;
    }
    if data.stopped
        && data.rec.channels_done >= data.rec.channels
        && data.started >= data.rec.channels
    {
        data.busy = false;
        let rec = data.rec;
        drop(data);
        sender::send(rec);
    }
}
