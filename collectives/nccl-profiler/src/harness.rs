//! Plays NCCL for tests: loads the built library as NCCL does (`dlopen`
//! with `RTLD_NOW | RTLD_LOCAL`, `dlsym` of the versioned struct, its six
//! members called through the struct) and scripts collectives with
//! descriptors written byte by byte at the offsets of NCCL's own headers
//! (not through [`crate::abi`]: the harness checks those declarations, it
//! does not share them).
//!
//! Not used by the plugin itself; public for the agent's tests.
// Handles go to the plugin as NCCL passes them: checking them is the
// plugin's job, and what the tests exercise.
#![allow(clippy::missing_safety_doc, clippy::not_unsafe_ptr_arg_deref)]

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::Path;
use std::sync::atomic::{AtomicI32, Ordering};

/// NCCL's process-global event mask (`ncclProfilerEventMask`).
pub static MASK: AtomicI32 = AtomicI32::new(0);

/// NCCL's `ncclProfileColl` and `ncclProfileKernelCh` bits.
pub const COLL: u64 = 1 << 1;
pub const KERNEL_CH: u64 = 1 << 6;
/// `ncclProfileP2p`, `ncclProfileProxyOp`, `ncclProfileGroup`: events the
/// plugin does not track.
pub const P2P: u64 = 1 << 2;
pub const PROXY_OP: u64 = 1 << 3;
pub const GROUP: u64 = 1 << 0;

/// The library, opened.
#[derive(Debug)]
pub struct Plugin {
    lib: *mut c_void,
}

// SAFETY: the handle is only passed to dlsym, which is thread-safe.
unsafe impl Send for Plugin {}
unsafe impl Sync for Plugin {}

type InitV3 = unsafe extern "C" fn(*mut *mut c_void, *mut c_int) -> c_int;
type InitV4 = unsafe extern "C" fn(
    *mut *mut c_void,
    *mut c_int,
    *const c_char,
    u64,
    c_int,
    c_int,
    c_int,
    *const c_void,
) -> c_int;
type InitV5 = unsafe extern "C" fn(
    *mut *mut c_void,
    u64,
    *mut c_int,
    *const c_char,
    c_int,
    c_int,
    c_int,
    *const c_void,
) -> c_int;
type Start = unsafe extern "C" fn(*mut c_void, *mut *mut c_void, *mut u8) -> c_int;
type Stop = unsafe extern "C" fn(*mut c_void) -> c_int;
type Record = unsafe extern "C" fn(*mut c_void, c_int, *mut u8) -> c_int;
type Finalize = unsafe extern "C" fn(*mut c_void) -> c_int;
type CountersFn = unsafe extern "C" fn(*mut u64);

/// `ncclProfiler_vN_t`: six pointer-sized members.
#[derive(Clone, Copy)]
struct Members([*const c_void; 6]);

/// One script of a collective: what NCCL would say about it.
#[derive(Debug, Clone)]
pub struct Coll {
    pub seq: u64,
    pub func: &'static CStr,
    pub datatype: &'static CStr,
    pub algo: &'static CStr,
    pub proto: &'static CStr,
    pub count: u64,
    /// Each channel's GPU start and stop (`%globaltimer` ns).
    pub channels: Vec<(u64, u64)>,
    /// Stop the collective's event (enqueued) after its channels ran,
    /// rather than before (NCCL's usual order).
    pub stop_after_channels: bool,
}

impl Coll {
    /// An AllReduce of `count` floats over `channels` channels.
    pub fn allreduce(seq: u64, count: u64, channels: usize) -> Coll {
        Coll {
            seq,
            func: c"AllReduce",
            datatype: c"ncclFloat32",
            algo: c"RING",
            proto: c"SIMPLE",
            count,
            channels: (0..channels as u64)
                .map(|c| (1_000_000 + seq * 1_000 + c, 1_000_500 + seq * 1_000 + c * 2))
                .collect(),
            stop_after_channels: false,
        }
    }
}

/// The plugin's counters (`ringwatch_nccl_profiler_counters`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counters {
    pub collectives: u64,
    pub sent: u64,
    pub dropped_queue_full: u64,
    pub dropped_no_agent: u64,
    pub incomplete: u64,
    pub connects: u64,
    pub disabled: bool,
}

impl Counters {
    /// Every collective is sent or dropped (or still queued).
    pub fn accounted(&self) -> u64 {
        self.sent + self.dropped_queue_full + self.dropped_no_agent
    }
}

impl Plugin {
    /// `dlopen(path, RTLD_NOW | RTLD_LOCAL)`, as NCCL opens a plugin.
    pub fn open(path: &Path) -> Result<Plugin, String> {
        let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: a valid C string.
        let lib = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if lib.is_null() {
            // SAFETY: dlerror's answer is a C string or NULL.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                "unknown".to_owned()
            } else {
                // SAFETY: as above.
                unsafe { CStr::from_ptr(why) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(format!("dlopen {}: {why}", path.display()));
        }
        Ok(Plugin { lib })
    }

    fn sym(&self, name: &CStr) -> *mut c_void {
        // SAFETY: an open handle and a C string.
        unsafe { libc::dlsym(self.lib, name.as_ptr()) }
    }

    /// Whether the library exports `ncclProfiler_v{version}`.
    pub fn has(&self, version: u8) -> bool {
        let name = CString::new(format!("ncclProfiler_v{version}")).expect("no NUL");
        !self.sym(&name).is_null()
    }

    fn members(&self, version: u8) -> Members {
        let name = CString::new(format!("ncclProfiler_v{version}")).expect("no NUL");
        let p = self.sym(&name);
        assert!(!p.is_null(), "no symbol ncclProfiler_v{version}");
        // SAFETY: NCCL reads the symbol as a struct of six pointers.
        Members(unsafe { *(p as *const [*const c_void; 6]) })
    }

    /// The name the struct gives (NCCL logs it).
    pub fn name(&self, version: u8) -> String {
        let m = self.members(version);
        // SAFETY: member 0 is a C string.
        unsafe { CStr::from_ptr(m.0[0] as *const c_char) }
            .to_string_lossy()
            .into_owned()
    }

    /// The plugin's counters.
    pub fn counters(&self) -> Counters {
        let f = self.sym(c"ringwatch_nccl_profiler_counters");
        assert!(!f.is_null(), "no ringwatch_nccl_profiler_counters");
        let mut v = [0u64; 7];
        // SAFETY: the function's signature, and 7 u64s.
        unsafe { std::mem::transmute::<*mut c_void, CountersFn>(f)(v.as_mut_ptr()) };
        Counters {
            collectives: v[0],
            sent: v[1],
            dropped_queue_full: v[2],
            dropped_no_agent: v[3],
            incomplete: v[4],
            connects: v[5],
            disabled: v[6] != 0,
        }
    }

    /// A communicator's `init` through `ncclProfiler_v{version}`, with
    /// [`MASK`] as NCCL's mask. Returns NCCL's result and the context.
    pub fn init(&self, version: u8, comm_hash: u64, nranks: i32, rank: i32) -> (c_int, Comm<'_>) {
        let m = self.members(version);
        let mut ctx: *mut c_void = std::ptr::null_mut();
        let mask = MASK.as_ptr();
        // SAFETY: member 1 is init, with this version's signature.
        let rc = unsafe {
            match version {
                3 => std::mem::transmute::<*const c_void, InitV3>(m.0[1])(&mut ctx, mask),
                4 => std::mem::transmute::<*const c_void, InitV4>(m.0[1])(
                    &mut ctx,
                    mask,
                    c"test".as_ptr(),
                    comm_hash,
                    1,
                    nranks,
                    rank,
                    std::ptr::null(),
                ),
                _ => std::mem::transmute::<*const c_void, InitV5>(m.0[1])(
                    &mut ctx,
                    comm_hash,
                    mask,
                    std::ptr::null(),
                    1,
                    nranks,
                    rank,
                    std::ptr::null(),
                ),
            }
        };
        (
            rc,
            Comm {
                m,
                version,
                ctx,
                comm_hash,
                rank,
                _plugin: std::marker::PhantomData,
            },
        )
    }
}

/// One communicator's context, as `init` returned it.
pub struct Comm<'a> {
    m: Members,
    version: u8,
    ctx: *mut c_void,
    comm_hash: u64,
    rank: i32,
    #[allow(dead_code)]
    _plugin: std::marker::PhantomData<&'a Plugin>,
}

/// A descriptor's bytes (8-aligned, as NCCL's structs are), and its size.
pub struct Descr([u64; 17], usize);

fn put<T: Copy>(d: &mut Descr, offset: usize, value: T) {
    let size = std::mem::size_of::<T>();
    assert!(
        offset + size <= d.1,
        "offset {offset} past the descriptor's {} bytes",
        d.1
    );
    // SAFETY: in bounds (checked), unaligned write of a Copy value.
    unsafe {
        std::ptr::write_unaligned(d.0.as_mut_ptr().cast::<u8>().add(offset).cast::<T>(), value)
    };
}

impl Comm<'_> {
    /// Whether `init` gave a context (NULL: the plugin is off).
    pub fn active(&self) -> bool {
        !self.ctx.is_null()
    }

    fn descr_size(&self) -> usize {
        match self.version {
            3 => 120,
            4 => 104,
            5 | 6 => 112,
            _ => 136,
        }
    }

    /// A descriptor with the header NCCL writes: type (u8 before v5, u64
    /// from v5), parentObj at 8, rank at 16.
    fn descr(&self, event: u64, parent: *mut c_void, rank: i32) -> Descr {
        let mut d = Descr([0u64; 17], self.descr_size());
        if self.version >= 5 {
            put(&mut d, 0, event);
        } else {
            put(&mut d, 0, event as u8);
        }
        put(&mut d, 8, parent);
        put(&mut d, 16, rank);
        d
    }

    /// `startEvent` with a descriptor; the handle the plugin wrote.
    pub fn start(&self, descr: &mut Descr) -> *mut c_void {
        let mut handle: *mut c_void = std::ptr::dangling_mut::<c_void>(); // the plugin must write it
        // SAFETY: member 2 is startEvent; the descriptor has its version's size.
        let rc = unsafe {
            std::mem::transmute::<*const c_void, Start>(self.m.0[2])(
                self.ctx,
                &mut handle,
                descr.0.as_mut_ptr().cast::<u8>(),
            )
        };
        assert_eq!(rc, 0, "startEvent returned {rc}");
        handle
    }

    /// `stopEvent`.
    pub fn stop(&self, handle: *mut c_void) {
        // SAFETY: member 3 is stopEvent.
        let rc = unsafe { std::mem::transmute::<*const c_void, Stop>(self.m.0[3])(handle) };
        assert_eq!(rc, 0);
    }

    /// `recordEventState` with the v4+ arguments (`pTimer`) or v3's.
    pub fn record(&self, handle: *mut c_void, state: c_int, p_timer: u64) {
        let mut args = [p_timer, 0u64];
        // SAFETY: member 4 is recordEventState.
        let rc = unsafe {
            std::mem::transmute::<*const c_void, Record>(self.m.0[4])(
                handle,
                state,
                args.as_mut_ptr().cast::<u8>(),
            )
        };
        assert_eq!(rc, 0);
    }

    /// An event the plugin does not track: its handle (NULL expected).
    pub fn other_event(&self, event: u64) -> *mut c_void {
        let mut d = self.descr(event, std::ptr::null_mut(), self.rank);
        self.start(&mut d)
    }

    /// One collective as NCCL reports it: the Coll event (enqueue), a
    /// KernelCh event per channel (GPU start in the descriptor, stop in
    /// state 22 from v4), each stopped. The collective's handle.
    pub fn collective(&self, c: &Coll) -> *mut c_void {
        let mut d = self.descr(COLL, std::ptr::null_mut(), self.rank);
        let ptr = |s: &CStr| s.as_ptr();
        if self.version == 3 {
            put(&mut d, 24, std::ptr::null::<c_char>()); // name
            put(&mut d, 32, self.comm_hash);
            put(&mut d, 40, c.seq);
            put(&mut d, 48, ptr(c.func));
            put(&mut d, 72, c.count as usize);
            put(&mut d, 80, -1i32);
            put(&mut d, 88, ptr(c.datatype));
            put(&mut d, 96, c.channels.len() as u8);
            put(&mut d, 97, 8u8);
            put(&mut d, 104, ptr(c.algo));
            put(&mut d, 112, ptr(c.proto));
        } else {
            put(&mut d, 24, c.seq);
            put(&mut d, 32, ptr(c.func));
            put(&mut d, 56, c.count as usize);
            put(&mut d, 64, -1i32);
            put(&mut d, 72, ptr(c.datatype));
            put(&mut d, 80, c.channels.len() as u8);
            put(&mut d, 81, 8u8);
            put(&mut d, 88, ptr(c.algo));
            put(&mut d, 96, ptr(c.proto));
        }
        let coll = self.start(&mut d);
        if !c.stop_after_channels {
            self.stop(coll);
        }
        for (i, &(gpu_start, gpu_stop)) in c.channels.iter().enumerate() {
            // KernelCh: NCCL leaves the rank unset (zero).
            let mut k = self.descr(KERNEL_CH, coll, 0);
            put(&mut k, 24, i as u8);
            if self.version >= 4 {
                put(&mut k, 32, gpu_start);
            }
            let h = self.start(&mut k);
            if self.version >= 4 {
                self.record(h, 22, gpu_stop);
            }
            self.stop(h);
        }
        if c.stop_after_channels {
            self.stop(coll);
        }
        coll
    }

    /// A collective whose single kernel channel starts but never stops (a
    /// kernel event NCCL lost).
    pub fn collective_without_kernel_stop(&self, c: &Coll) -> *mut c_void {
        let mut d = self.descr(COLL, std::ptr::null_mut(), self.rank);
        put(&mut d, 24, c.seq);
        put(&mut d, 32, c.func.as_ptr());
        put(&mut d, 56, c.count as usize);
        put(&mut d, 72, c.datatype.as_ptr());
        put(&mut d, 80, 1u8);
        put(&mut d, 88, c.algo.as_ptr());
        put(&mut d, 96, c.proto.as_ptr());
        let coll = self.start(&mut d);
        self.stop(coll);
        let mut k = self.descr(KERNEL_CH, coll, 0);
        put(&mut k, 32, 1u64);
        let _ = self.start(&mut k);
        coll
    }

    /// `finalize`.
    pub fn finalize(self) {
        // SAFETY: member 5 is finalize.
        let rc = unsafe { std::mem::transmute::<*const c_void, Finalize>(self.m.0[5])(self.ctx) };
        assert_eq!(rc, 0);
    }
}

/// The mask NCCL would now use.
pub fn mask() -> i32 {
    MASK.load(Ordering::Relaxed)
}
