//! GPU tensors (feature `cuda`): allreduce of tensors in GPU memory, inside the runtime's
//! cycles.
//!
//! A GPU tensor is negotiated like any other (its request says it is on a GPU, so it is
//! fused only with GPU tensors of its dtype and op, and a tensor on a GPU on one rank and
//! in host memory on another is a mismatch). Its cycle then runs it one of two ways,
//! chosen once per job at the first GPU allreduce, the same way on every rank:
//!
//! - **NCCL**, when every rank has a GPU of its own (their UUIDs differ) and NCCL loads
//!   on every rank: rank 0 makes NCCL's unique id and sends it to the others over the
//!   job's own links; fused tensors are packed into a device fusion buffer, reduced by
//!   one `ncclAllReduce` and unpacked, all on the runtime's own stream. NCCL reduces in
//!   its own order, so its float results are NCCL's, not the rings'.
//! - **staged** (Horovod's CPU path for GPU tensors), otherwise: the tensors are copied
//!   into pinned host memory, reduced by the host rings (the same bits as host tensors)
//!   and copied back. Integer averages also go this way on an NCCL job (NCCL's average
//!   of integers is not the runtime's truncating one).
//!
//! The CUDA driver is loaded at run time (`cudarc`'s dynamic loading), so a build with
//! this feature runs on machines without one; the first GPU tensor then fails with an
//! error that says so. NCCL is loaded by [`nccl`] (see there why not through cudarc).
//! The caller's stream is respected by waiting for it when the tensor is enqueued: the
//! runtime reads the tensor only after the work that produced it, and the tensor holds
//! the result when its handle is waited on.

pub mod nccl;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

use cudarc::driver::{result, sys};

use crate::algorithms::{NodeLayout, ring_allgather, ring_allreduce_among, segment_bounds};
use crate::error::{CollectiveError, Result};
use crate::tensor::{DType, ReduceOp};
use crate::transport::Transport;

/// A tensor in GPU memory, lent to the runtime until its handle is waited on.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceTensor {
    ptr: u64,
    dtype: DType,
    shape: Vec<usize>,
    device: i32,
    stream: usize,
}

impl DeviceTensor {
    /// A tensor of `dtype` and `shape` at device address `ptr` on GPU `device`, produced
    /// on `stream` (a `CUstream` of that GPU's primary context, as PyTorch's
    /// `torch.cuda.current_stream().cuda_stream`; 0: the legacy default stream).
    ///
    /// # Safety
    /// `ptr` must stay valid for the tensor's bytes, and nothing may read or write them,
    /// until the collective's handle has been waited on. The runtime checks what it can
    /// (that the memory is the driver's, on that GPU, and long enough) when it is enqueued.
    pub unsafe fn new(ptr: u64, dtype: DType, shape: &[usize], device: i32, stream: usize) -> Self {
        DeviceTensor {
            ptr,
            dtype,
            shape: shape.to_vec(),
            device,
            stream,
        }
    }

    /// Its dtype.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Its shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The GPU it is on.
    pub fn device(&self) -> i32 {
        self.device
    }

    /// Its size in bytes.
    pub fn byte_len(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

struct Driver {
    count: i32,
    /// Primary contexts retained so far, by GPU (`CUcontext` as an address: it is
    /// process-wide and usable from any thread).
    contexts: Mutex<HashMap<i32, usize>>,
}

static DRIVER: OnceLock<std::result::Result<Driver, String>> = OnceLock::new();

fn driver() -> std::result::Result<&'static Driver, String> {
    DRIVER
        .get_or_init(|| {
            // SAFETY: only tries to open the library.
            if !unsafe { sys::is_culib_present() } {
                return Err(
                    "the CUDA driver library (libcuda.so.1) could not be loaded: this \
                            machine has no NVIDIA driver, or it is not on the library search \
                            path; GPU tensors need it (host tensors do not)"
                        .to_string(),
                );
            }
            result::init().map_err(|e| format!("the CUDA driver did not start: {e}"))?;
            let count = result::device::get_count()
                .map_err(|e| format!("the CUDA driver could not count the GPUs: {e}"))?;
            if count == 0 {
                return Err("the CUDA driver sees no GPU".to_string());
            }
            Ok(Driver {
                count,
                contexts: Mutex::new(HashMap::new()),
            })
        })
        .as_ref()
        .map_err(Clone::clone)
}

/// How many GPUs this process can use, or why it can use none.
pub fn device_count() -> std::result::Result<usize, String> {
    driver().map(|d| d.count as usize)
}

/// Makes GPU `device`'s primary context (the one PyTorch and the CUDA runtime use)
/// current on this thread.
fn bind(device: i32) -> std::result::Result<sys::CUcontext, String> {
    let d = driver()?;
    if !(0..d.count).contains(&device) {
        return Err(format!(
            "there is no GPU {device} (this process sees {})",
            d.count
        ));
    }
    let ctx = {
        let mut contexts = d
            .contexts
            .lock()
            .map_err(|_| "the GPU context table is poisoned".to_string())?;
        match contexts.get(&device) {
            Some(&c) => c as sys::CUcontext,
            None => {
                let dev = result::device::get(device).map_err(|e| format!("GPU {device}: {e}"))?;
                // SAFETY: retained once per process and GPU, never released (the driver
                // frees it at exit).
                let c = unsafe { result::primary_ctx::retain(dev) }
                    .map_err(|e| format!("GPU {device}: its context: {e}"))?;
                contexts.insert(device, c as usize);
                c
            }
        }
    };
    // SAFETY: a retained primary context.
    unsafe { result::ctx::set_current(ctx) }
        .map_err(|e| format!("GPU {device}: making its context current: {e}"))?;
    Ok(ctx)
}

/// A 32-bit attribute of the memory at `ptr` (memory type, GPU ordinal).
fn pointer_attribute(
    ptr: u64,
    attribute: sys::CUpointer_attribute,
) -> std::result::Result<u32, result::DriverError> {
    let mut value: u32 = 0;
    // SAFETY: the attributes asked for are one 32-bit value; the driver checks the address.
    unsafe { sys::cuPointerGetAttribute((&raw mut value).cast::<c_void>(), attribute, ptr) }
        .result()?;
    Ok(value)
}

/// Checks a tensor being enqueued (the driver knows its memory, on its GPU, as long as
/// the tensor) and waits for the work on its stream, so that the cycle, on whatever
/// thread runs it, reads what the caller's kernels wrote. The runtime calls it on every
/// enqueue; a caller that must not wait while holding a lock (Python's GIL) may call it
/// first without that lock, and the runtime's own call then finds the stream idle.
pub fn prepare(t: &DeviceTensor) -> std::result::Result<(), String> {
    bind(t.device)?;
    let bytes = t.byte_len();
    if bytes > 0 {
        let kind = pointer_attribute(
            t.ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
        )
        .map_err(|e| format!("{:#x} is not memory the CUDA driver knows ({e})", t.ptr))?;
        if kind != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u32 {
            return Err(format!(
                "{:#x} is not GPU memory (CUDA memory type {kind})",
                t.ptr
            ));
        }
        let ordinal = pointer_attribute(
            t.ptr,
            sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
        )
        .map_err(|e| format!("{:#x}: its GPU: {e}", t.ptr))?;
        if i32::try_from(ordinal).ok() != Some(t.device) {
            return Err(format!(
                "the memory is on GPU {ordinal}, not GPU {}",
                t.device
            ));
        }
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: writes the allocation's start and size.
        unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, t.ptr) }
            .result()
            .map_err(|e| format!("{:#x}: its allocation: {e}", t.ptr))?;
        if t.ptr + bytes as u64 > base + size as u64 {
            return Err(format!(
                "{bytes} bytes from {:#x} run past the end of its allocation ({size} bytes \
                 from {base:#x})",
                t.ptr
            ));
        }
    }
    // SAFETY: the caller's stream of this context (DeviceTensor::new's contract).
    unsafe { result::stream::synchronize(t.stream as sys::CUstream) }
        .map_err(|e| format!("waiting for the tensor's stream: {e}"))
}

/// Device memory of its own (for benchmarks and tests that need a GPU tensor without a
/// framework): `len` bytes on GPU `device`, freed on drop.
#[derive(Debug)]
pub struct DeviceBuffer {
    ptr: u64,
    len: usize,
    device: i32,
}

impl DeviceBuffer {
    /// A copy of `bytes` on GPU `device`.
    pub fn upload(device: i32, bytes: &[u8]) -> std::result::Result<Self, String> {
        bind(device)?;
        // SAFETY: a fresh allocation (at least one byte, so that the pointer is real).
        let ptr = unsafe { result::malloc_sync(bytes.len().max(1)) }
            .map_err(|e| format!("GPU {device}: allocating {} bytes: {e}", bytes.len()))?;
        let buf = DeviceBuffer {
            ptr,
            len: bytes.len(),
            device,
        };
        if !bytes.is_empty() {
            // SAFETY: `ptr` holds `bytes.len()` bytes.
            unsafe { result::memcpy_htod_sync(ptr, bytes) }
                .map_err(|e| format!("GPU {device}: copying to the GPU: {e}"))?;
        }
        Ok(buf)
    }

    /// A copy of its bytes in host memory.
    pub fn download(&self) -> std::result::Result<Vec<u8>, String> {
        bind(self.device)?;
        let mut out = vec![0u8; self.len];
        if self.len > 0 {
            // SAFETY: `ptr` holds `len` bytes; `out` is as long.
            unsafe { result::memcpy_dtoh_sync(&mut out, self.ptr) }
                .map_err(|e| format!("GPU {}: copying from the GPU: {e}", self.device))?;
        }
        Ok(out)
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Its device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// This memory as a tensor of `dtype` and `shape`, on the legacy default stream.
    ///
    /// # Safety
    /// The buffer must outlive every collective the tensor is given to, and be at least
    /// the tensor's size (the runtime checks the size against the allocation).
    pub unsafe fn tensor(&self, dtype: DType, shape: &[usize]) -> DeviceTensor {
        // SAFETY: the caller's promise.
        unsafe { DeviceTensor::new(self.ptr, dtype, shape, self.device, 0) }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if bind(self.device).is_ok() {
            // SAFETY: ours; every copy into or out of it was waited for.
            if let Err(e) = unsafe { result::free_sync(self.ptr) } {
                tracing::warn!(error = %e, "freeing GPU memory");
            }
        }
    }
}

/// Which way a GPU allreduce went.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Path {
    /// One `ncclAllReduce` over every rank per fused buffer.
    Nccl,
    /// Hierarchical: NCCL within each node, the host rings across nodes.
    NcclHierarchical,
    /// Through pinned host memory and the host rings.
    Staged,
}

/// Pinned host memory, grown as needed.
struct Pinned {
    ptr: *mut u8,
    cap: usize,
}

/// Device memory, grown as needed.
struct DeviceBuf {
    ptr: u64,
    cap: usize,
}

/// An NCCL communicator and the library it came from.
#[derive(Clone, Copy)]
struct Comm {
    lib: &'static nccl::Nccl,
    comm: nccl::Comm,
}

/// One rank's GPU side: its GPU, its stream, NCCL's communicators, buffers.
pub(crate) struct GpuEngine {
    rank: usize,
    /// How long NCCL's work may take before the peers are taken for gone (the runtime's
    /// peer timeout).
    timeout: Duration,
    device: i32,
    stream: sys::CUstream,
    /// Over every rank: where every rank has a GPU of its own.
    world: Option<Comm>,
    /// Over this rank's node (a job with a node layout): where the ranks of each node
    /// have GPUs of their own. Made by the first hierarchical item (every rank runs it),
    /// so that a job that never turns the knob on has one communicator, not two.
    local: Option<Comm>,
    /// NCCL can serve every node (the same answer on every rank), and `local` is not made
    /// yet.
    local_pending: Option<&'static nccl::Nccl>,
    pinned: Pinned,
    fused: DeviceBuf,
    /// NCCL work failed or timed out: the communicators were aborted, not to be used or
    /// destroyed (the job is over).
    failed: bool,
}

// SAFETY: CUDA handles are process-wide; the engine is used by one cycle at a time, under
// the runtime's engine lock, binding its context on whatever thread that is.
unsafe impl Send for GpuEngine {}

fn gpu_error(rank: usize, message: String) -> CollectiveError {
    CollectiveError::Gpu { rank, message }
}

/// Descriptor bytes each rank contributes when the path is chosen: NCCL loads here (1
/// byte), then the GPU's UUID.
const DESCRIPTOR: usize = 32;

/// How long a failed engine waits for its stream to drain after aborting NCCL.
const DRAIN_LIMIT: Duration = Duration::from_secs(5);

/// A unique id slot: a flag byte (the id is there), then the id.
const ID_SLOT: usize = 129;

/// Why NCCL cannot serve `ranks` (`None`: it can): it is off, a GPU is shared, or NCCL did
/// not load somewhere.
fn why_not(descriptors: &[&[u8]], ranks: &[usize], nccl_allowed: bool) -> Option<String> {
    if !nccl_allowed {
        return Some("RINGWATCH_NCCL=0".to_string());
    }
    let mut uuids: Vec<&[u8]> = ranks.iter().map(|&r| &descriptors[r][8..24]).collect();
    uuids.sort_unstable();
    if uuids.windows(2).any(|w| w[0] == w[1]) {
        return Some("ranks share a GPU, which NCCL refuses".to_string());
    }
    let without: Vec<usize> = ranks
        .iter()
        .copied()
        .filter(|&r| descriptors[r][0] == 0)
        .collect();
    (!without.is_empty()).then(|| format!("NCCL did not load on ranks {without:?}"))
}

/// Makes the communicators of groups of ranks: `leader_of(r)` is the first rank of r's
/// group, `members` its size and `index` this rank's place in it. Every group leader makes
/// an id, every rank learns its leader's over `t` (one allgather), and joins. `None`
/// where a leader got no id.
#[allow(
    clippy::too_many_arguments,
    reason = "who joins which group, on which GPU, for how long"
)]
fn make_comm(
    t: &dyn Transport,
    lib: &'static nccl::Nccl,
    rank: usize,
    leader: usize,
    members: usize,
    index: usize,
    device: i32,
    timeout: Duration,
) -> Result<Option<Comm>> {
    let err = |m: String| gpu_error(rank, m);
    let n = t.world_size();
    let mut slots = vec![0u8; n * ID_SLOT];
    if rank == leader {
        match lib.unique_id() {
            Ok(id) => {
                let mine = &mut slots[rank * ID_SLOT..(rank + 1) * ID_SLOT];
                mine[0] = 1;
                for (d, s) in mine[1..].iter_mut().zip(id.internal) {
                    *d = s as u8;
                }
            }
            Err(e) => tracing::warn!(rank, error = %e, "NCCL gave no unique id"),
        }
    }
    let blocks: Vec<_> = (0..n).map(|r| r * ID_SLOT..(r + 1) * ID_SLOT).collect();
    ring_allgather(t, &mut slots, &blocks)?;
    let slot = &slots[leader * ID_SLOT..(leader + 1) * ID_SLOT];
    if slot[0] != 1 {
        return Ok(None);
    }
    let mut id = nccl::UniqueId { internal: [0; 128] };
    for (d, s) in id.internal.iter_mut().zip(&slot[1..]) {
        *d = *s as std::ffi::c_char;
    }
    let comm = init_within(lib, members, id, index, device, timeout).map_err(err)?;
    Ok(Some(Comm { lib, comm }))
}

/// `ncclCommInitRank` on a thread of its own, waited for at most `timeout`: it blocks
/// until every member has joined, and a member whose own init failed, or that left,
/// would otherwise hold this rank forever. On timeout the thread is left behind (NCCL
/// gives no way to stop it) and the job fails.
fn init_within(
    lib: &'static nccl::Nccl,
    members: usize,
    id: nccl::UniqueId,
    index: usize,
    device: i32,
    timeout: Duration,
) -> std::result::Result<nccl::Comm, String> {
    struct Made(nccl::Comm);
    // SAFETY: a communicator handle is usable from any thread (NCCL's own rule).
    unsafe impl Send for Made {}
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("rw-nccl-init".into())
        .spawn(move || {
            let made = bind(device).and_then(|_| lib.init_rank(members, id, index));
            let _ = tx.send(made.map(Made));
        })
        .map_err(|e| format!("starting NCCL's init: {e}"))?;
    match rx.recv_timeout(timeout) {
        Ok(made) => made.map(|m| m.0),
        Err(_) => Err(format!(
            "NCCL's communicator of {members} ranks was not made within {timeout:?}: a rank \
             did not join (its NCCL init failed, or it left)"
        )),
    }
}

impl GpuEngine {
    /// Starts the GPU side of `rank` on GPU `device`, on every rank at the same item of
    /// the same cycle: the ranks tell each other over `t` whether NCCL loads and which GPU
    /// they have, and make the communicators NCCL can serve: one over every rank, and one
    /// per node of `layout` for the hierarchical schedule. `nccl_allowed`: `RINGWATCH_NCCL`
    /// (off: always staged).
    pub fn start(
        t: &dyn Transport,
        rank: usize,
        device: i32,
        nccl_allowed: bool,
        layout: Option<NodeLayout>,
        timeout: Duration,
    ) -> Result<Self> {
        let err = |m: String| gpu_error(rank, m);
        bind(device).map_err(err)?;
        let dev = result::device::get(device).map_err(|e| err(format!("GPU {device}: {e}")))?;
        let uuid = result::device::get_uuid(dev).map_err(|e| err(format!("GPU {device}: {e}")))?;
        let stream = result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| err(format!("GPU {device}: creating a stream: {e}")))?;
        let mut engine = GpuEngine {
            rank,
            timeout,
            device,
            stream,
            world: None,
            local: None,
            local_pending: None,
            pinned: Pinned {
                ptr: std::ptr::null_mut(),
                cap: 0,
            },
            fused: DeviceBuf { ptr: 0, cap: 0 },
            failed: false,
        };
        let loaded = if nccl_allowed {
            nccl::nccl().ok()
        } else {
            None
        };
        let n = t.world_size();
        let mut all = vec![0u8; n * DESCRIPTOR];
        let mine = &mut all[rank * DESCRIPTOR..(rank + 1) * DESCRIPTOR];
        mine[0] = u8::from(loaded.is_some());
        for (d, s) in mine[8..24].iter_mut().zip(uuid.bytes) {
            *d = s as u8;
        }
        let blocks: Vec<_> = (0..n)
            .map(|r| r * DESCRIPTOR..(r + 1) * DESCRIPTOR)
            .collect();
        ring_allgather(t, &mut all, &blocks)?;
        let descriptors: Vec<&[u8]> = all.chunks(DESCRIPTOR).collect();
        let everyone: Vec<usize> = (0..n).collect();
        let world_why = why_not(&descriptors, &everyone, nccl_allowed);
        // Every node must be servable for the hierarchical schedule to use NCCL.
        let local_why = match layout {
            None => Some("the job has no node layout".to_string()),
            Some(l) => (0..l.nodes).find_map(|node| {
                why_not(
                    &descriptors,
                    &l.node_ranks(node * l.local_size),
                    nccl_allowed,
                )
                .map(|why| format!("node {node}: {why}"))
            }),
        };
        if let Some(lib) = loaded {
            if world_why.is_none() {
                engine.world = make_comm(t, lib, rank, 0, n, rank, device, timeout)?;
            }
            if local_why.is_none() {
                engine.local_pending = Some(lib);
            }
        }
        if rank == 0 {
            let text = |comm: &Option<Comm>, why: Option<String>| match (comm, why) {
                (Some(c), _) => format!("NCCL {}", nccl::version_text(c.lib.version)),
                (None, Some(why)) => format!("staged ({why})"),
                (None, None) => "staged (NCCL gave no unique id)".to_string(),
            };
            let within_nodes = match (engine.local_pending, local_why) {
                (Some(lib), _) => format!("NCCL {}", nccl::version_text(lib.version)),
                (None, why) => text(&None, why),
            };
            tracing::info!(
                flat = %text(&engine.world, world_why),
                hierarchical_within_nodes = %within_nodes,
                library = %loaded.map_or_else(String::new, |l| l.path.display().to_string()),
                "GPU tensors: how allreduces will run (staged: pinned host memory and the \
                 host rings)"
            );
        }
        Ok(engine)
    }

    /// Allreduces `tensors` (this item's, in fusion order) in place. `hierarchical`: the
    /// item's schedule is hierarchical over this layout. The staged path hands the pinned
    /// host copies to `host` (the host rings, on the item's schedule). Returns the path.
    pub fn allreduce(
        &mut self,
        t: &dyn Transport,
        tensors: &[DeviceTensor],
        dtype: DType,
        op: ReduceOp,
        hierarchical: Option<NodeLayout>,
        host: impl FnOnce(&mut [&mut [u8]]) -> Result<()>,
    ) -> Result<Path> {
        let rank = self.rank;
        if self.failed {
            return Err(gpu_error(
                rank,
                "an earlier GPU allreduce failed and NCCL was aborted".into(),
            ));
        }
        bind(self.device).map_err(|m| gpu_error(rank, m))?;
        let integer_average = dtype.is_integer() && op == ReduceOp::Average;
        // NCCL has no int16: such a tensor is staged.
        let nccl_has_it = nccl_dtype(dtype).is_some();
        if let (Some(l), Some(lib)) = (hierarchical, self.local_pending.take()) {
            let leader = rank / l.local_size * l.local_size;
            let index = rank - leader;
            let made = make_comm(
                t,
                lib,
                rank,
                leader,
                l.local_size,
                index,
                self.device,
                self.timeout,
            )?;
            // Every node must have its communicator, or no node uses one: the ranks agree.
            let n = t.world_size();
            let mut made_here = vec![0u8; n];
            made_here[rank] = u8::from(made.is_some());
            let blocks: Vec<_> = (0..n).map(|r| r..r + 1).collect();
            ring_allgather(t, &mut made_here, &blocks)?;
            if made_here.iter().all(|&m| m == 1) {
                self.local = made;
            } else if let Some(c) = made {
                // SAFETY: just made, never used.
                unsafe { c.lib.destroy(c.comm) };
                if rank == 0 {
                    tracing::warn!(
                        "a node got no NCCL communicator: hierarchical GPU allreduces are staged"
                    );
                }
            }
        }
        let outcome = match (hierarchical, self.local, self.world) {
            (Some(layout), Some(local), _) if nccl_has_it => self
                .nccl_hierarchical(t, local, layout, tensors, dtype, op)
                .map(|()| Path::NcclHierarchical),
            (None, _, Some(world)) if !integer_average && nccl_has_it => self
                .nccl_flat(world, tensors, dtype, op)
                .map(|()| Path::Nccl),
            _ => {
                return self.staged_allreduce(tensors, host).map(|()| Path::Staged);
            }
        };
        if outcome.is_err() {
            self.abandon_nccl();
        }
        outcome
    }

    /// After a failure with NCCL work queued (a timeout, a peer gone from the host ring,
    /// a CUDA error): every communicator is aborted, which ends its kernels, and the
    /// stream drained (for at most a few seconds), so that no queued copy writes into a
    /// tensor after its allreduce has failed. The job is over; nothing NCCL is used again.
    fn abandon_nccl(&mut self) {
        self.failed = true;
        self.local_pending = None;
        for c in [self.world.take(), self.local.take()].into_iter().flatten() {
            // SAFETY: ours, never used again.
            unsafe { c.lib.abort(c.comm) };
        }
        let start = Instant::now();
        // SAFETY: our stream; any answer but "not ready" ends the wait.
        while unsafe { sys::cuStreamQuery(self.stream) } == sys::CUresult::CUDA_ERROR_NOT_READY
            && start.elapsed() < DRAIN_LIMIT
        {
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// One `ncclAllReduce` over every rank of the item's buffer, waited for.
    fn nccl_flat(
        &mut self,
        world: Comm,
        tensors: &[DeviceTensor],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let rank = self.rank;
        let buf = self.pack(tensors)?;
        let count = tensors.iter().map(DeviceTensor::byte_len).sum::<usize>() / dtype.size();
        if count > 0 {
            // SAFETY: `buf` holds `count` elements of `dtype` on this GPU; the stream and
            // the communicator are ours.
            unsafe {
                world.lib.all_reduce(
                    buf,
                    count,
                    nccl_dtype_of(rank, dtype)?,
                    nccl_op(op),
                    world.comm,
                    self.stream.cast::<c_void>(),
                )
            }
            .map_err(|m| gpu_error(rank, m))?;
        }
        self.unpack(tensors)?;
        self.wait_for_nccl()
    }

    /// NCCL allreduce within the node (sums for an average), this rank's segment of the
    /// result through pinned memory into the host ring among the ranks of its local rank
    /// on the other nodes (the average divided there, by the job's size), and the node's
    /// segments back to every rank of the node by grouped NCCL broadcasts.
    fn nccl_hierarchical(
        &mut self,
        t: &dyn Transport,
        local: Comm,
        layout: NodeLayout,
        tensors: &[DeviceTensor],
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        let rank = self.rank;
        let err = |m: String| gpu_error(rank, m);
        let elem = dtype.size();
        let count = tensors.iter().map(DeviceTensor::byte_len).sum::<usize>() / elem;
        let buf = self.pack(tensors)?;
        let stream = self.stream;
        if count > 0 {
            let within = if op == ReduceOp::Average {
                nccl::op::SUM
            } else {
                nccl_op(op)
            };
            // SAFETY: as for the flat allreduce, on the node's communicator.
            unsafe {
                local.lib.all_reduce(
                    buf,
                    count,
                    nccl_dtype_of(rank, dtype)?,
                    within,
                    local.comm,
                    stream.cast::<c_void>(),
                )
            }
            .map_err(err)?;
            let segments = segment_bounds(count, layout.local_size);
            let mine = segments[rank % layout.local_size].clone();
            let bytes = mine.len() * elem;
            self.grow_pinned(bytes)?;
            if bytes > 0 {
                // SAFETY: our pinned memory of at least `bytes`.
                let host = unsafe { std::slice::from_raw_parts_mut(self.pinned.ptr, bytes) };
                let at = buf + (mine.start * elem) as u64;
                // SAFETY: the segment lies in `buf`; the copy is waited for below.
                unsafe { result::memcpy_dtoh_async(&mut host[..], at, stream) }
                    .map_err(|e| err(format!("copying a segment to host memory: {e}")))?;
                // The node's NCCL allreduce comes first on the stream.
                self.wait_for_nccl()?;
                ring_allreduce_among(
                    t,
                    &layout.cross_ranks(rank),
                    host,
                    dtype,
                    op,
                    t.world_size(),
                )?;
                // SAFETY: as above, the other way.
                unsafe { result::memcpy_htod_async(at, &host[..], stream) }
                    .map_err(|e| err(format!("copying a segment back to the GPU: {e}")))?;
            }
            let pieces: Vec<(u64, usize)> = segments
                .iter()
                .map(|s| ((s.start * elem) as u64, s.len()))
                .collect();
            // SAFETY: the pieces tile `buf`; one per rank of the node, in local-rank order.
            unsafe {
                local.lib.gather_pieces(
                    buf,
                    &pieces,
                    nccl_dtype_of(rank, dtype)?,
                    local.comm,
                    stream.cast::<c_void>(),
                )
            }
            .map_err(err)?;
        }
        self.unpack(tensors)?;
        self.wait_for_nccl()
    }

    /// The item's device buffer: a lone tensor itself, else the tensors packed into the
    /// device fusion buffer (copies queued on our stream).
    fn pack(&mut self, tensors: &[DeviceTensor]) -> Result<u64> {
        if let [only] = tensors {
            return Ok(only.ptr);
        }
        let rank = self.rank;
        let total: usize = tensors.iter().map(DeviceTensor::byte_len).sum();
        self.grow_fused(total)?;
        let mut at = 0u64;
        for t in tensors.iter().filter(|t| t.byte_len() > 0) {
            // SAFETY: both ranges are in live device allocations (checked at enqueue, and
            // ours), on this context.
            unsafe {
                result::memcpy_dtod_async(self.fused.ptr + at, t.ptr, t.byte_len(), self.stream)
            }
            .map_err(|e| gpu_error(rank, format!("packing the device fusion buffer: {e}")))?;
            at += t.byte_len() as u64;
        }
        Ok(self.fused.ptr)
    }

    /// Waits for everything queued on our stream, NCCL's work among it, at most the peer
    /// timeout: NCCL waits for its peers without end, so a rank that died would otherwise
    /// hold this one forever. On timeout the cycle fails (and [`GpuEngine::allreduce`]
    /// aborts the communicators); the runtime then names the rank that left where its
    /// fault channel knows it.
    fn wait_for_nccl(&mut self) -> Result<()> {
        let rank = self.rank;
        let start = Instant::now();
        let mut pause = Duration::from_micros(1);
        loop {
            // SAFETY: our stream.
            match unsafe { sys::cuStreamQuery(self.stream) } {
                sys::CUresult::CUDA_SUCCESS => return Ok(()),
                sys::CUresult::CUDA_ERROR_NOT_READY => {}
                e => {
                    return Err(gpu_error(
                        rank,
                        format!("waiting for NCCL: {}", result::DriverError(e)),
                    ));
                }
            }
            if start.elapsed() > self.timeout {
                return Err(gpu_error(
                    rank,
                    format!(
                        "NCCL's allreduce did not finish within {:?}: a rank stopped taking \
                         part (the communicators are aborted)",
                        self.timeout
                    ),
                ));
            }
            // Short waits are polled closely, long ones (hundreds of MiB) every 50 µs.
            std::thread::sleep(pause);
            pause = (pause * 2).min(Duration::from_micros(50));
        }
    }

    /// Queues the copies of the device fusion buffer back into the tensors (nothing for a
    /// lone tensor) on our stream; [`GpuEngine::wait_for_nccl`] waits for them.
    fn unpack(&mut self, tensors: &[DeviceTensor]) -> Result<()> {
        let rank = self.rank;
        if tensors.len() > 1 {
            let mut at = 0u64;
            for t in tensors.iter().filter(|t| t.byte_len() > 0) {
                // SAFETY: as when packing.
                unsafe {
                    result::memcpy_dtod_async(t.ptr, self.fused.ptr + at, t.byte_len(), self.stream)
                }
                .map_err(|e| gpu_error(rank, format!("unpacking the device fusion buffer: {e}")))?;
                at += t.byte_len() as u64;
            }
        }
        Ok(())
    }

    fn staged_allreduce(
        &mut self,
        tensors: &[DeviceTensor],
        host: impl FnOnce(&mut [&mut [u8]]) -> Result<()>,
    ) -> Result<()> {
        let rank = self.rank;
        let err = |m: String| gpu_error(rank, m);
        let total: usize = tensors.iter().map(DeviceTensor::byte_len).sum();
        self.grow_pinned(total)?;
        let stream = self.stream;
        let pinned: &mut [u8] = if total == 0 {
            &mut []
        } else {
            // SAFETY: our pinned allocation of at least `total` bytes, used by nothing else.
            unsafe { std::slice::from_raw_parts_mut(self.pinned.ptr, total) }
        };
        let mut views: Vec<&mut [u8]> = Vec::with_capacity(tensors.len());
        let mut rest = pinned;
        for t in tensors {
            let (view, tail) = rest.split_at_mut(t.byte_len());
            if !view.is_empty() {
                // SAFETY: `view` is pinned host memory of the tensor's size; the tensor's
                // memory was checked at enqueue.
                unsafe { result::memcpy_dtoh_async(view, t.ptr, stream) }
                    .map_err(|e| err(format!("copying a GPU tensor to host memory: {e}")))?;
            }
            views.push(view);
            rest = tail;
        }
        // SAFETY: our stream.
        unsafe { result::stream::synchronize(stream) }
            .map_err(|e| err(format!("copying GPU tensors to host memory: {e}")))?;
        host(&mut views)?;
        for (t, view) in tensors.iter().zip(&views) {
            if !view.is_empty() {
                // SAFETY: as above, the other way.
                unsafe { result::memcpy_htod_async(t.ptr, &view[..], stream) }
                    .map_err(|e| err(format!("copying a result back to the GPU: {e}")))?;
            }
        }
        // SAFETY: our stream.
        unsafe { result::stream::synchronize(stream) }
            .map_err(|e| err(format!("copying results back to the GPU: {e}")))
    }

    fn grow_pinned(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.pinned.cap {
            return Ok(());
        }
        let rank = self.rank;
        self.free_pinned();
        // SAFETY: a new allocation, freed in `free_pinned`.
        let ptr = unsafe { result::malloc_host(bytes, 0) }
            .map_err(|e| gpu_error(rank, format!("pinning {bytes} bytes of host memory: {e}")))?;
        self.pinned = Pinned {
            ptr: ptr.cast::<u8>(),
            cap: bytes,
        };
        Ok(())
    }

    fn grow_fused(&mut self, bytes: usize) -> Result<()> {
        if bytes <= self.fused.cap {
            return Ok(());
        }
        let rank = self.rank;
        self.free_fused();
        // SAFETY: a new allocation, freed in `free_fused`.
        let ptr = unsafe { result::malloc_sync(bytes) }.map_err(|e| {
            gpu_error(
                rank,
                format!("allocating a {bytes}-byte device fusion buffer: {e}"),
            )
        })?;
        self.fused = DeviceBuf { ptr, cap: bytes };
        Ok(())
    }

    fn free_pinned(&mut self) {
        if !self.pinned.ptr.is_null() {
            // SAFETY: ours, from malloc_host, no copy in flight (every copy is waited for).
            if let Err(e) = unsafe { result::free_host(self.pinned.ptr.cast::<c_void>()) } {
                tracing::warn!(error = %e, "freeing pinned host memory");
            }
            self.pinned = Pinned {
                ptr: std::ptr::null_mut(),
                cap: 0,
            };
        }
    }

    fn free_fused(&mut self) {
        if self.fused.ptr != 0 {
            // SAFETY: ours, from malloc_sync, nothing in flight.
            if let Err(e) = unsafe { result::free_sync(self.fused.ptr) } {
                tracing::warn!(error = %e, "freeing the device fusion buffer");
            }
            self.fused = DeviceBuf { ptr: 0, cap: 0 };
        }
    }
}

/// NCCL's name for `dtype`; None for int16, which NCCL lacks.
fn nccl_dtype(dtype: DType) -> Option<i32> {
    Some(match dtype {
        DType::F16 => nccl::dtype::FLOAT16,
        DType::BF16 => nccl::dtype::BFLOAT16,
        DType::F32 => nccl::dtype::FLOAT32,
        DType::F64 => nccl::dtype::FLOAT64,
        DType::I32 => nccl::dtype::INT32,
        DType::I64 => nccl::dtype::INT64,
        DType::U8 => nccl::dtype::UINT8,
        DType::I8 => nccl::dtype::INT8,
        DType::I16 => return None,
    })
}

/// [`nccl_dtype`] where the path was chosen for NCCL (never int16).
fn nccl_dtype_of(rank: usize, dtype: DType) -> Result<i32> {
    nccl_dtype(dtype).ok_or_else(|| gpu_error(rank, format!("NCCL has no {dtype:?}")))
}

fn nccl_op(op: ReduceOp) -> i32 {
    match op {
        ReduceOp::Sum => nccl::op::SUM,
        ReduceOp::Average => nccl::op::AVG,
        ReduceOp::Min => nccl::op::MIN,
        ReduceOp::Max => nccl::op::MAX,
        ReduceOp::Product => nccl::op::PROD,
    }
}

impl Drop for GpuEngine {
    fn drop(&mut self) {
        if bind(self.device).is_err() {
            return;
        }
        // A failed engine's communicators were aborted already (`abandon_nccl`).
        for c in [self.world.take(), self.local.take()].into_iter().flatten() {
            // SAFETY: ours, not used again.
            unsafe { c.lib.destroy(c.comm) };
        }
        self.free_pinned();
        self.free_fused();
        // SAFETY: ours, nothing in flight.
        if let Err(e) = unsafe { result::stream::destroy(self.stream) } {
            tracing::warn!(error = %e, "destroying the runtime's GPU stream");
        }
    }
}
