//! ringwatch's NCCL profiler plugin: a job loads it with
//! `NCCL_PROFILER_PLUGIN=/path/to/libringwatch_nccl_profiler.so` (NCCL ≥
//! 2.26), and it sends one record per collective — communicator, rank,
//! sequence number, function, datatype, bytes, algorithm, protocol,
//! channels, enqueue times and, from NCCL 2.27 on, the GPU kernel's start
//! and stop — to the node's ringwatch agent.
//!
//! - [`abi`]: NCCL's plugin structs, re-declared (v3…v7).
//! - [`events`]: NCCL's events to one record per collective.
//! - [`sender`]: the bounded, non-blocking queue and the agent's socket.
//!
//! Rules kept on every entry point NCCL calls: it returns `ncclSuccess`
//! (NCCL 2.23–2.27 mishandle an error from `init`), it never blocks, a
//! panic is caught, and a NULL context or handle is a no-op. Opting out
//! (`RINGWATCH_NCCL_PROFILER=off`, or disabled after a bad answer) is a
//! NULL context and a cleared event mask.
//!
//! NCCL `dlclose`s the plugin when its last communicator is destroyed; the
//! plugin pins itself on the first `init` (`RTLD_NODELETE`), so its thread
//! and its statics outlive that.

pub mod abi;
pub mod events;
#[doc(hidden)]
pub mod harness;
pub mod record;
pub mod sender;

use std::ffi::{c_char, c_int, c_void};
use std::panic::AssertUnwindSafe;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use abi::*;
use events::{CollDescr, Comm};

/// The name NCCL logs for the plugin.
const NAME: *const c_char = c"ringwatch".as_ptr();

/// Communicators initialised and not yet finalized.
static LIVE_COMMS: AtomicI64 = AtomicI64::new(0);

/// Runs `f`, catching a panic: NCCL must never see one unwind.
fn guard(f: impl FnOnce()) -> NcclResult {
    let _ = std::panic::catch_unwind(AssertUnwindSafe(f));
    NCCL_SUCCESS
}

/// Keeps the library loaded after NCCL's `dlclose` (its writer thread runs
/// on). False if that could not be done: the plugin then stays off.
fn pin_library() -> bool {
    static PINNED: OnceLock<bool> = OnceLock::new();
    *PINNED.get_or_init(|| {
        let Some(path) = own_path() else {
            return false;
        };
        let Ok(path) = std::ffi::CString::new(path.into_os_string().into_encoded_bytes()) else {
            return false;
        };
        // SAFETY: a C string; dlopen with RTLD_NOLOAD only adds a reference
        // (and NODELETE) to the library already loaded.
        !unsafe {
            libc::dlopen(
                path.as_ptr(),
                libc::RTLD_NOW | libc::RTLD_NODELETE | libc::RTLD_NOLOAD,
            )
        }
        .is_null()
    })
}

/// The path this library was loaded from (`dladdr`).
fn own_path() -> Option<std::path::PathBuf> {
    // SAFETY: a zeroed Dl_info is valid; dladdr fills it for an address
    // inside this library, and dli_fname is then a C string.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let here = own_path as *const c_void;
        if libc::dladdr(here, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        let bytes = std::ffi::CStr::from_ptr(info.dli_fname).to_bytes();
        Some(std::path::PathBuf::from(
            std::ffi::OsStr::from_encoded_bytes_unchecked(bytes),
        ))
    }
}

/// `RINGWATCH_NCCL_PROFILER=off` (or `0`, `false`): loaded, but off.
fn off_by_env() -> bool {
    std::env::var("RINGWATCH_NCCL_PROFILER")
        .map(|v| {
            matches!(
                v.trim().to_ascii_lowercase().as_str(),
                "off" | "0" | "false" | "no"
            )
        })
        .unwrap_or(false)
}

/// What every version's `init` does.
///
/// # Safety
/// `context` and `mask` are NULL or valid, as NCCL passes them.
unsafe fn init_common(
    profiler: u8,
    context: *mut *mut c_void,
    mask: *mut c_int,
    comm_hash: u64,
    nranks: c_int,
    rank: c_int,
) -> NcclResult {
    if context.is_null() {
        return NCCL_SUCCESS;
    }
    // SAFETY: NCCL's slot for the context.
    unsafe { *context = std::ptr::null_mut() };
    guard(|| {
        if sender::disabled() {
            return;
        }
        if off_by_env() {
            sender::disable("RINGWATCH_NCCL_PROFILER is off");
            return;
        }
        if !pin_library() {
            sender::disable("could not keep the library loaded (dladdr/dlopen failed)");
            return;
        }
        if !mask.is_null() {
            sender::set_mask(mask);
            let wanted = (abi::event::COLL | abi::event::KERNEL_CH) as i32;
            // SAFETY: NCCL's process-global mask, read by NCCL atomically.
            unsafe { std::sync::atomic::AtomicI32::from_ptr(mask) }
                .store(wanted, Ordering::Relaxed);
        }
        sender::start(profiler, own_path().as_deref());
        if sender::disabled() {
            return;
        }
        let comm = Box::new(Comm {
            profiler,
            comm_hash,
            nranks,
            rank,
        });
        LIVE_COMMS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: as above.
        unsafe { *context = Box::into_raw(comm).cast() };
    })
}

unsafe extern "C" fn finalize(context: *mut c_void) -> NcclResult {
    guard(|| {
        if context.is_null() {
            return;
        }
        // SAFETY: a context this plugin's init made, finalized once.
        drop(unsafe { Box::from_raw(context.cast::<Comm>()) });
        if LIVE_COMMS.fetch_sub(1, Ordering::Relaxed) == 1 {
            // The process's last communicator: a short wait for the queue,
            // so a short job's last collectives reach the agent.
            sender::flush(Duration::from_millis(200));
        }
    })
}

unsafe extern "C" fn stop_event(handle: *mut c_void) -> NcclResult {
    guard(|| events::stop(handle))
}

unsafe extern "C" fn record_v3(
    _h: *mut c_void,
    _state: c_int,
    _args: *mut StateArgsV3,
) -> NcclResult {
    NCCL_SUCCESS
}

unsafe extern "C" fn record_v4(
    handle: *mut c_void,
    state: c_int,
    args: *mut StateArgsV4,
) -> NcclResult {
    guard(|| {
        if state == STATE_KERNEL_CH_STOP && !args.is_null() {
            // SAFETY: NCCL's arguments for this state.
            let gpu = unsafe { std::ptr::read_unaligned(args.cast::<u64>()) };
            events::kernel_gpu_stop(handle, gpu);
        }
    })
}

/// The context as a communicator, if the plugin made one.
///
/// # Safety
/// `context` is NULL or a context this plugin's init made.
unsafe fn comm<'a>(context: *mut c_void) -> Option<&'a Comm> {
    // SAFETY: the caller's promise.
    unsafe { context.cast::<Comm>().as_ref() }
}

/// The start of every version: NULL unless it is a collective or one of
/// its kernel channels.
///
/// # Safety
/// As NCCL calls `startEvent`: valid pointers or NULL.
unsafe fn start_common(
    context: *mut c_void,
    handle: *mut *mut c_void,
    read: impl FnOnce(&Comm) -> *mut c_void,
) -> NcclResult {
    if handle.is_null() {
        return NCCL_SUCCESS;
    }
    // SAFETY: NCCL's slot for the handle.
    unsafe { *handle = std::ptr::null_mut() };
    guard(|| {
        // SAFETY: NCCL passes back the context init returned.
        let Some(comm) = (unsafe { comm(context) }) else {
            return;
        };
        if sender::disabled() {
            return;
        }
        let h = read(comm);
        // SAFETY: as above.
        unsafe { *handle = h };
    })
}

unsafe extern "C" fn start_v3(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    d: *mut DescrV3,
) -> NcclResult {
    // SAFETY: NCCL's arguments.
    unsafe {
        start_common(ctx, handle, |comm| {
            if d.is_null() {
                return std::ptr::null_mut();
            }
            // A copy: nothing here assumes NCCL's alignment.
            let d = std::ptr::read_unaligned(d);
            match u64::from(d.type_) {
                event::COLL => {
                    let c = d.u.coll;
                    events::start_coll(
                        comm,
                        &CollDescr {
                            rank: d.rank,
                            comm_hash: Some(c.comm_hash).filter(|&h| h != 0),
                            seq: c.seq_number,
                            func: c.func,
                            datatype: c.datatype,
                            algo: c.algo,
                            proto: c.proto,
                            count: c.count as u64,
                            channels: u32::from(c.n_max_channels),
                        },
                    )
                }
                event::KERNEL_CH => events::start_kernel(d.parent_obj, None),
                _ => std::ptr::null_mut(),
            }
        })
    }
}

/// A v4+ collective's descriptor as [`CollDescr`].
fn coll_v4(rank: c_int, c: &CollV4) -> CollDescr {
    CollDescr {
        rank,
        comm_hash: None,
        seq: c.seq_number,
        func: c.func,
        datatype: c.datatype,
        algo: c.algo,
        proto: c.proto,
        count: c.count as u64,
        channels: u32::from(c.n_channels),
    }
}

unsafe extern "C" fn start_v4(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    d: *mut DescrV4,
) -> NcclResult {
    // SAFETY: NCCL's arguments.
    unsafe {
        start_common(ctx, handle, |comm| {
            if d.is_null() {
                return std::ptr::null_mut();
            }
            // A copy: nothing here assumes NCCL's alignment.
            let d = std::ptr::read_unaligned(d);
            match u64::from(d.type_) {
                event::COLL => events::start_coll(comm, &coll_v4(d.rank, &d.u.coll)),
                event::KERNEL_CH => events::start_kernel(d.parent_obj, Some(d.u.kernel_ch.p_timer)),
                _ => std::ptr::null_mut(),
            }
        })
    }
}

unsafe extern "C" fn start_v5(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    d: *mut DescrV5,
) -> NcclResult {
    // SAFETY: NCCL's arguments.
    unsafe {
        start_common(ctx, handle, |comm| {
            if d.is_null() {
                return std::ptr::null_mut();
            }
            // A copy: nothing here assumes NCCL's alignment.
            let d = std::ptr::read_unaligned(d);
            match d.type_ {
                event::COLL => events::start_coll(comm, &coll_v4(d.rank, &d.u.coll.base)),
                event::KERNEL_CH => events::start_kernel(d.parent_obj, Some(d.u.kernel_ch.p_timer)),
                _ => std::ptr::null_mut(),
            }
        })
    }
}

unsafe extern "C" fn start_v7(
    ctx: *mut c_void,
    handle: *mut *mut c_void,
    d: *mut DescrV7,
) -> NcclResult {
    // SAFETY: NCCL's arguments.
    unsafe {
        start_common(ctx, handle, |comm| {
            if d.is_null() {
                return std::ptr::null_mut();
            }
            // A copy: nothing here assumes NCCL's alignment.
            let d = std::ptr::read_unaligned(d);
            match d.type_ {
                event::COLL => events::start_coll(comm, &coll_v4(d.rank, &d.u.coll.base.base)),
                event::KERNEL_CH => events::start_kernel(d.parent_obj, Some(d.u.kernel_ch.p_timer)),
                _ => std::ptr::null_mut(),
            }
        })
    }
}

unsafe extern "C" fn init_v3(context: *mut *mut c_void, mask: *mut c_int) -> NcclResult {
    // SAFETY: NCCL's arguments.
    unsafe { init_common(3, context, mask, 0, 0, -1) }
}

#[allow(clippy::too_many_arguments)]
unsafe extern "C" fn init_v4(
    context: *mut *mut c_void,
    mask: *mut c_int,
    _name: *const c_char,
    comm_hash: u64,
    _n_nodes: c_int,
    nranks: c_int,
    rank: c_int,
    _log: Logger,
) -> NcclResult {
    // SAFETY: NCCL's arguments.
    unsafe { init_common(4, context, mask, comm_hash, nranks, rank) }
}

macro_rules! init_v5_like {
    ($name:ident, $version:expr) => {
        #[allow(clippy::too_many_arguments)]
        unsafe extern "C" fn $name(
            context: *mut *mut c_void,
            comm_id: u64,
            mask: *mut c_int,
            _name: *const c_char,
            _n_nodes: c_int,
            nranks: c_int,
            rank: c_int,
            _log: Logger,
        ) -> NcclResult {
            // SAFETY: NCCL's arguments.
            unsafe { init_common($version, context, mask, comm_id, nranks, rank) }
        }
    };
}
init_v5_like!(init_v5, 5);
init_v5_like!(init_v6, 6);
init_v5_like!(init_v7, 7);

/// NCCL 2.26 (torch 2.7).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclProfiler_v3: Exported<ProfilerV3> = Exported(Profiler {
    name: NAME,
    init: init_v3,
    start_event: start_v3,
    stop_event,
    record_event_state: record_v3,
    finalize,
});

/// NCCL 2.27 (torch 2.8–2.10).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclProfiler_v4: Exported<ProfilerV4> = Exported(Profiler {
    name: NAME,
    init: init_v4,
    start_event: start_v4,
    stop_event,
    record_event_state: record_v4,
    finalize,
});

/// NCCL 2.28 (torch 2.11).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclProfiler_v5: Exported<ProfilerV5> = Exported(Profiler {
    name: NAME,
    init: init_v5,
    start_event: start_v5,
    stop_event,
    record_event_state: record_v4,
    finalize,
});

/// NCCL 2.29 and 2.30 (torch 2.12–2.15).
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclProfiler_v6: Exported<ProfilerV5> = Exported(Profiler {
    name: NAME,
    init: init_v6,
    start_event: start_v5,
    stop_event,
    record_event_state: record_v4,
    finalize,
});

/// NCCL 2.31.
#[unsafe(no_mangle)]
#[allow(non_upper_case_globals)]
pub static ncclProfiler_v7: Exported<ProfilerV7> = Exported(Profiler {
    name: NAME,
    init: init_v7,
    start_event: start_v7,
    stop_event,
    record_event_state: record_v4,
    finalize,
});

/// The plugin's counters, for a harness or a job that wants them (not
/// called by NCCL). `out` receives, in order: collectives, sent, dropped
/// because the queue was full, dropped with no agent, sent incomplete,
/// connections made, and 1 if the plugin is disabled.
///
/// # Safety
/// `out` is NULL or points to 7 writable `u64`s.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ringwatch_nccl_profiler_counters(out: *mut u64) {
    if out.is_null() {
        return;
    }
    let c = sender::counters();
    let l = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
    let values = [
        l(&c.collectives),
        l(&c.sent),
        l(&c.dropped_queue_full),
        l(&c.dropped_no_agent),
        l(&c.incomplete),
        l(&c.connects),
        u64::from(sender::disabled()),
    ];
    // SAFETY: the caller's promise of 7 u64s.
    unsafe { std::ptr::copy_nonoverlapping(values.as_ptr(), out, values.len()) };
}
