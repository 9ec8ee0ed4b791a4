//! The NCCL entry points the runtime calls, loaded at run time.
//!
//! cudarc's NCCL bindings look the library up under names (`libnccl.so`, `libnccl.so.12`,
//! …) that miss `libnccl.so.2`, the one name NCCL's packages ship (PyPI's `nvidia-nccl-*`
//! included), and panic when none is found. The runtime needs ten symbols, so it loads
//! them itself, without a panic: `RINGWATCH_NCCL_LIBRARY` if set, else the `libnccl.so*`
//! this process has already mapped (PyTorch's, so that one NCCL serves both), else
//! `libnccl.so.2` and `libnccl.so` from the loader's search path.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

/// `ncclUniqueId`: 128 opaque bytes rank 0 makes and every rank passes to init.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    pub internal: [c_char; 128],
}

/// `ncclComm_t`.
pub type Comm = *mut c_void;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut UniqueId) -> c_int;
type CommInitRank = unsafe extern "C" fn(*mut Comm, c_int, UniqueId, c_int) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type Broadcast = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    Comm,
    *mut c_void,
) -> c_int;
type Group = unsafe extern "C" fn() -> c_int;
type CommDestroy = unsafe extern "C" fn(Comm) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;

/// NCCL, loaded: its path and the functions the runtime calls.
pub struct Nccl {
    pub path: PathBuf,
    pub version: i32,
    get_unique_id: GetUniqueId,
    comm_init_rank: CommInitRank,
    all_reduce: AllReduce,
    broadcast: Broadcast,
    group_start: Group,
    group_end: Group,
    comm_destroy: CommDestroy,
    comm_abort: CommDestroy,
    get_error_string: GetErrorString,
    // Keeps the functions above mapped.
    _library: libloading::Library,
}

/// `ncclDataType_t` values.
pub mod dtype {
    pub const INT8: i32 = 0;
    pub const UINT8: i32 = 1;
    pub const INT32: i32 = 2;
    pub const INT64: i32 = 4;
    pub const FLOAT16: i32 = 6;
    pub const FLOAT32: i32 = 7;
    pub const FLOAT64: i32 = 8;
    pub const BFLOAT16: i32 = 9;
}

/// `ncclRedOp_t` values.
pub mod op {
    pub const SUM: i32 = 0;
    pub const PROD: i32 = 1;
    pub const MAX: i32 = 2;
    pub const MIN: i32 = 3;
    pub const AVG: i32 = 4;
}

static NCCL: OnceLock<Result<Nccl, String>> = OnceLock::new();

/// The process's NCCL, loaded on first use; the error says where it was looked for.
pub fn nccl() -> Result<&'static Nccl, String> {
    NCCL.get_or_init(load).as_ref().map_err(Clone::clone)
}

fn candidates() -> Vec<PathBuf> {
    if let Some(p) = std::env::var_os("RINGWATCH_NCCL_LIBRARY").filter(|p| !p.is_empty()) {
        return vec![PathBuf::from(p)];
    }
    let mut out = Vec::new();
    if let Ok(maps) = std::fs::read_to_string("/proc/self/maps") {
        for path in maps.lines().filter_map(|l| l.split_whitespace().nth(5)) {
            let file = path.rsplit('/').next().unwrap_or("");
            if file.starts_with("libnccl.so")
                && !out.iter().any(|p: &PathBuf| p.as_os_str() == path)
            {
                out.push(PathBuf::from(path));
            }
        }
    }
    out.push(PathBuf::from("libnccl.so.2"));
    out.push(PathBuf::from("libnccl.so"));
    out
}

fn load() -> Result<Nccl, String> {
    let mut tried = Vec::new();
    for path in candidates() {
        // SAFETY: loading NCCL runs its initialisers, which only set up its own state.
        match unsafe { libloading::Library::new(&path) } {
            Ok(library) => return bind(library, path),
            Err(e) => tried.push(format!("{}: {e}", path.display())),
        }
    }
    Err(format!(
        "NCCL could not be loaded (set RINGWATCH_NCCL_LIBRARY to a libnccl.so.2, or put its \
         folder in LD_LIBRARY_PATH): {}",
        tried.join("; ")
    ))
}

fn bind(library: libloading::Library, path: PathBuf) -> Result<Nccl, String> {
    fn get<T: Copy>(
        library: &libloading::Library,
        path: &std::path::Path,
        name: &str,
    ) -> Result<T, String> {
        // SAFETY: each symbol is read with the type NCCL's header (nccl.h, 2.x) gives it.
        unsafe { library.get::<T>(name.as_bytes()) }
            .map(|s| *s)
            .map_err(|e| format!("{} has no {name}: {e}", path.display()))
    }
    let get_version: GetVersion = get(&library, &path, "ncclGetVersion")?;
    let mut version = 0;
    // SAFETY: ncclGetVersion writes one int.
    let code = unsafe { get_version(&mut version) };
    if code != 0 {
        return Err(format!(
            "{}: ncclGetVersion failed ({code})",
            path.display()
        ));
    }
    Ok(Nccl {
        version,
        get_unique_id: get(&library, &path, "ncclGetUniqueId")?,
        comm_init_rank: get(&library, &path, "ncclCommInitRank")?,
        all_reduce: get(&library, &path, "ncclAllReduce")?,
        broadcast: get(&library, &path, "ncclBroadcast")?,
        group_start: get(&library, &path, "ncclGroupStart")?,
        group_end: get(&library, &path, "ncclGroupEnd")?,
        comm_destroy: get(&library, &path, "ncclCommDestroy")?,
        comm_abort: get(&library, &path, "ncclCommAbort")?,
        get_error_string: get(&library, &path, "ncclGetErrorString")?,
        path,
        _library: library,
    })
}

impl Nccl {
    fn check(&self, what: &str, code: c_int) -> Result<(), String> {
        if code == 0 {
            return Ok(());
        }
        // SAFETY: ncclGetErrorString returns a static string for any code.
        let text = unsafe {
            let p = (self.get_error_string)(code);
            if p.is_null() {
                String::new()
            } else {
                CStr::from_ptr(p).to_string_lossy().into_owned()
            }
        };
        Err(format!("{what} failed: {text} (NCCL error {code})"))
    }

    /// A new unique id (rank 0, before init).
    pub fn unique_id(&self) -> Result<UniqueId, String> {
        let mut id = UniqueId { internal: [0; 128] };
        // SAFETY: writes the 128-byte id.
        self.check("ncclGetUniqueId", unsafe { (self.get_unique_id)(&mut id) })?;
        Ok(id)
    }

    /// Joins the communicator of `ranks` ranks that `id` names, as `rank`. Blocks until
    /// every rank has joined; the caller's thread must have the GPU's context current.
    pub fn init_rank(&self, ranks: usize, id: UniqueId, rank: usize) -> Result<Comm, String> {
        let mut comm: Comm = std::ptr::null_mut();
        let (n, r) = (c_int::try_from(ranks), c_int::try_from(rank));
        let (Ok(n), Ok(r)) = (n, r) else {
            return Err(format!("{ranks} ranks are more than NCCL takes"));
        };
        // SAFETY: writes the communicator handle.
        self.check("ncclCommInitRank", unsafe {
            (self.comm_init_rank)(&mut comm, n, id, r)
        })?;
        Ok(comm)
    }

    /// Enqueues an in-place allreduce of `count` elements at `buf` on `stream`.
    ///
    /// # Safety
    /// `buf` is device memory of the communicator's GPU, valid for `count` elements of
    /// `datatype`; `stream` belongs to that GPU's context; `comm` is live.
    pub unsafe fn all_reduce(
        &self,
        buf: u64,
        count: usize,
        datatype: i32,
        op: i32,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), String> {
        let p = buf as *mut c_void;
        // SAFETY: the caller's promise.
        self.check("ncclAllReduce", unsafe {
            (self.all_reduce)(p, p, count, datatype, op, comm, stream)
        })
    }

    /// Enqueues, as one group, an in-place broadcast of each `(offset, count)` piece of
    /// `buf` from the piece's index as root: an allgather of unequal pieces.
    ///
    /// # Safety
    /// As [`Nccl::all_reduce`], for every piece.
    pub unsafe fn gather_pieces(
        &self,
        buf: u64,
        pieces: &[(u64, usize)],
        datatype: i32,
        comm: Comm,
        stream: *mut c_void,
    ) -> Result<(), String> {
        // SAFETY: a group around the broadcasts below.
        self.check("ncclGroupStart", unsafe { (self.group_start)() })?;
        let mut first_error = Ok(());
        for (root, &(offset, count)) in pieces.iter().enumerate() {
            let p = (buf + offset) as *mut c_void;
            // SAFETY: the caller's promise; root is a rank of the communicator (one piece
            // per rank).
            let code =
                unsafe { (self.broadcast)(p, p, count, datatype, root as c_int, comm, stream) };
            if first_error.is_ok() {
                first_error = self.check("ncclBroadcast", code);
            }
        }
        // SAFETY: closes the group opened above, whatever happened inside it.
        let end = self.check("ncclGroupEnd", unsafe { (self.group_end)() });
        first_error.and(end)
    }

    /// Frees a communicator.
    ///
    /// # Safety
    /// `comm` came from [`Nccl::init_rank`] and is not used again.
    pub unsafe fn destroy(&self, comm: Comm) {
        // SAFETY: the caller's promise.
        let code = unsafe { (self.comm_destroy)(comm) };
        if let Err(e) = self.check("ncclCommDestroy", code) {
            tracing::warn!(error = %e, "freeing the NCCL communicator");
        }
    }
}

impl Nccl {
    /// Stops a communicator's work in flight and frees it: what a rank does when a peer
    /// stopped taking part, so that its stream (and this thread) are not stuck forever.
    ///
    /// # Safety
    /// `comm` came from [`Nccl::init_rank`] and is not used again.
    pub unsafe fn abort(&self, comm: Comm) {
        // SAFETY: the caller's promise.
        let code = unsafe { (self.comm_abort)(comm) };
        if let Err(e) = self.check("ncclCommAbort", code) {
            tracing::warn!(error = %e, "aborting the NCCL communicator");
        }
    }
}

/// "2.27.3" for NCCL's version code.
pub fn version_text(code: i32) -> String {
    // Since 2.9: major * 10000 + minor * 100 + patch.
    format!("{}.{}.{}", code / 10000, (code / 100) % 100, code % 100)
}
