//! `ringwatch._native`: the collective runtime as a Python extension module.
//!
//! This is the thin layer under `ringwatch.torch` (the package in `../ringwatch/`): one
//! [`Runtime`] per process, tensors handed over as raw CPU memory (a pointer and a length the
//! Python side takes from a contiguous tensor) and used in place, and the GIL released
//! whenever the runtime works or is waited on. Everything else (knobs, autotune, the control
//! socket, the timeline, faults) is the runtime's own behaviour.
//!
//! # Invariants
//! - The memory of an enqueued tensor stays alive until the runtime is done with it: the
//!   Python object that owns it travels with the tensor ([`Tensor::from_external`]'s owner)
//!   and is released only when the runtime drops it.
//! - No call waits with the GIL held, and no wait is uninterruptible: waits wake every
//!   [`SIGNAL_POLL`] to let Python raise `KeyboardInterrupt`.
//! - Errors surface as Python exceptions carrying the runtime's message (which names the
//!   tensor and the ranks); nothing from Python reaches an `unwrap`.

use std::os::raw::c_int;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use collectives::control::KnobUpdate;
use collectives::tensor::AlignedBuf;
use collectives::{CollectiveError, DType, ReduceOp, Runtime, RuntimeConfig, Tensor};
use pyo3::create_exception;
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::ffi;
use pyo3::prelude::*;
use pyo3::types::PyDict;

create_exception!(
    _native,
    RingwatchError,
    PyRuntimeError,
    "A collective failed (the runtime's message names the tensor and ranks)."
);
create_exception!(
    _native,
    MismatchError,
    RingwatchError,
    "A tensor was submitted differently on different ranks (shape, dtype, op, root)."
);
create_exception!(
    _native,
    RankFailedError,
    RingwatchError,
    "Another rank died, stopped answering or broke its link; the job cannot go on."
);
create_exception!(
    _native,
    NotInitializedError,
    RingwatchError,
    "ringwatch is not initialized (call init() first) or was shut down."
);

/// How often a wait wakes up to let Python deliver signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(100);

/// The process's runtime; `None` before `init()` and after `shutdown()`.
static RUNTIME: Mutex<Option<Runtime>> = Mutex::new(None);

fn runtime() -> PyResult<MutexGuard<'static, Option<Runtime>>> {
    RUNTIME
        .lock()
        .map_err(|_| RingwatchError::new_err("ringwatch's runtime state is poisoned"))
}

/// Runs `f` on the runtime, or raises `NotInitializedError`.
fn with_runtime<T>(f: impl FnOnce(&Runtime) -> PyResult<T>) -> PyResult<T> {
    let guard = runtime()?;
    match guard.as_ref() {
        Some(rt) => f(rt),
        None => Err(NotInitializedError::new_err(
            "ringwatch is not initialized: call ringwatch.torch.init() first",
        )),
    }
}

fn to_py(e: CollectiveError) -> PyErr {
    let message = e.to_string();
    match e {
        CollectiveError::Mismatch { .. } => MismatchError::new_err(message),
        CollectiveError::Link { .. }
        | CollectiveError::PeerTimeout { .. }
        | CollectiveError::RankLost { .. }
        | CollectiveError::RankSilent { .. } => RankFailedError::new_err(message),
        CollectiveError::InvalidTensor { .. } => PyValueError::new_err(message),
        _ => RingwatchError::new_err(message),
    }
}

fn dtype_from(name: &str) -> PyResult<DType> {
    Ok(match name {
        "float32" => DType::F32,
        "float64" => DType::F64,
        "float16" => DType::F16,
        "bfloat16" => DType::BF16,
        "int32" => DType::I32,
        "int64" => DType::I64,
        "uint8" => DType::U8,
        "int8" => DType::I8,
        "int16" => DType::I16,
        other => {
            return Err(PyTypeError::new_err(format!(
                "ringwatch has no dtype {other:?} (float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8)"
            )));
        }
    })
}

fn op_from(name: &str) -> PyResult<ReduceOp> {
    Ok(match name {
        "sum" => ReduceOp::Sum,
        "average" => ReduceOp::Average,
        "min" => ReduceOp::Min,
        "max" => ReduceOp::Max,
        "product" => ReduceOp::Product,
        other => {
            return Err(PyValueError::new_err(format!(
                "no reduction {other:?} (sum, average, min, max, product)"
            )));
        }
    })
}

/// Starts this process's rank: rendezvous from the launcher's variables (torchrun, mpirun,
/// the MPI operator), knobs and autotune from `RINGWATCH_*` / `HOROVOD_*`. `master_port`
/// overrides the rendezvous port. A second call while running does nothing.
#[pyfunction]
#[pyo3(signature = (master_port=None))]
fn init(py: Python<'_>, master_port: Option<u16>) -> PyResult<()> {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("RINGWATCH_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .try_init();
    if runtime()?.is_some() {
        return Ok(());
    }
    let mut config = RuntimeConfig::from_env().map_err(to_py)?;
    if let Some(port) = master_port {
        config.rendezvous.master_port = port;
    }
    // The rendezvous waits for the other ranks: without the GIL, so that other Python
    // threads run, and with the runtime's own connect timeout.
    let rt = py.detach(|| Runtime::new(config)).map_err(to_py)?;
    let mut guard = runtime()?;
    if guard.is_none() {
        *guard = Some(rt);
    }
    Ok(())
}

/// Leaves the job: waits (up to the peer timeout) for every rank to leave too, then stops.
#[pyfunction]
fn shutdown(py: Python<'_>) -> PyResult<()> {
    let rt = runtime()?.take();
    if let Some(rt) = rt {
        py.detach(|| rt.shutdown());
    }
    Ok(())
}

/// Leaves the job at once because this rank failed (an uncaught exception):
/// the other ranks are told `reason` now, instead of finding out when their
/// peer timeout runs out, and this rank's pending operations fail.
#[pyfunction]
fn leave(py: Python<'_>, reason: &str) -> PyResult<()> {
    let interrupter = runtime()?.as_ref().map(Runtime::interrupter);
    if let Some(interrupter) = interrupter {
        py.detach(|| interrupter.interrupt(reason));
    }
    Ok(())
}

/// Whether `init()` ran and `shutdown()` did not.
#[pyfunction]
fn is_initialized() -> PyResult<bool> {
    Ok(runtime()?.is_some())
}

/// Marks the end of a training step: tuning sessions then score the job by steps per
/// second (rank 0's marks are reported).
#[pyfunction]
fn mark_step() -> PyResult<()> {
    with_runtime(|rt| {
        rt.mark_step();
        Ok(())
    })
}

/// Training steps this rank marked so far.
#[pyfunction]
fn steps_marked() -> PyResult<u64> {
    with_runtime(|rt| Ok(rt.totals().steps_marked))
}

/// This process's rank.
#[pyfunction]
fn rank() -> PyResult<usize> {
    with_runtime(|rt| Ok(rt.rank()))
}

/// Ranks in the job.
#[pyfunction]
fn size() -> PyResult<usize> {
    with_runtime(|rt| Ok(rt.world_size()))
}

/// This rank's place on its node.
#[pyfunction]
fn local_rank() -> PyResult<usize> {
    with_runtime(|rt| Ok(rt.ranks()[rt.rank()].local_rank))
}

/// Ranks on this node.
#[pyfunction]
fn local_size() -> PyResult<usize> {
    with_runtime(|rt| Ok(rt.ranks()[rt.rank()].local_size))
}

/// The job's id (its control socket is `<runtime dir>/<job id>.sock`).
#[pyfunction]
fn job_id() -> PyResult<String> {
    with_runtime(|rt| Ok(rt.job_id().to_string()))
}

/// The control socket this rank serves, if any.
#[pyfunction]
fn control_socket() -> PyResult<Option<String>> {
    with_runtime(|rt| {
        Ok(rt
            .control_socket_path()
            .map(|p| p.to_string_lossy().into_owned()))
    })
}

/// The knobs in force and the cycle they took effect, as a dict.
#[pyfunction]
fn knobs(py: Python<'_>) -> PyResult<Py<PyDict>> {
    // One look at the runtime, so the knobs and the autotune state go together.
    let ((k, since), autotune) = with_runtime(|rt| Ok((rt.knobs(), rt.autotune_state())))?;
    let d = PyDict::new(py);
    d.set_item("fusion_threshold", k.fusion_threshold_bytes)?;
    d.set_item("cycle_time_ms", k.cycle_time_us as f64 / 1e3)?;
    d.set_item("hierarchical_allreduce", k.hierarchical_allreduce)?;
    d.set_item("since_cycle", since)?;
    d.set_item("autotune", autotune.as_str())?;
    Ok(d.unbind())
}

/// Asks for knobs (applied by rank 0 at the next cycle boundary, on every rank). A job being
/// tuned by the agent or by itself keeps the tuner's knobs.
#[pyfunction]
#[pyo3(signature = (fusion_threshold=None, cycle_time_ms=None, hierarchical_allreduce=None))]
fn set_knobs(
    fusion_threshold: Option<u64>,
    cycle_time_ms: Option<f64>,
    hierarchical_allreduce: Option<bool>,
) -> PyResult<()> {
    let cycle_time = match cycle_time_ms {
        Some(ms) if !(ms.is_finite() && ms > 0.0 && ms <= 60_000.0) => {
            return Err(PyValueError::new_err(format!(
                "cycle_time_ms={ms} is not in (0, 60000]"
            )));
        }
        Some(ms) => Some((ms * 1e3).round() as u64),
        None => None,
    };
    let update = KnobUpdate {
        fusion_threshold_bytes: fusion_threshold,
        cycle_time_us: cycle_time,
        hierarchical_allreduce,
    };
    with_runtime(|rt| {
        rt.set_knobs(update);
        Ok(())
    })
}

/// Cycles run, bytes reduced and negotiation bytes since start.
#[pyfunction]
fn totals() -> PyResult<(u64, u64, u64)> {
    with_runtime(|rt| {
        let t = rt.totals();
        Ok((t.cycles, t.bytes_reduced, t.negotiation_bytes))
    })
}

/// GPU allreduces since start: fused buffers reduced by NCCL, and those staged through
/// host memory into the rings.
#[pyfunction]
fn gpu_totals() -> PyResult<(u64, u64)> {
    with_runtime(|rt| {
        let t = rt.totals();
        Ok((t.nccl_allreduces, t.staged_allreduces))
    })
}

/// What keeps an enqueued tensor's memory alive: the Python object that owns it. Dropped on
/// whatever thread drops the tensor; PyO3 defers the decref until a thread holds the GIL.
struct Owner(
    #[allow(
        dead_code,
        reason = "held only to be dropped after the runtime's last access"
    )]
    Py<PyAny>,
);

/// Enqueues a collective on memory the caller owns (`ptr`, `nbytes`: a contiguous CPU
/// tensor's `data_ptr()` and byte size; `owner` keeps it alive). `kind` is `allreduce`,
/// `allgather` or `broadcast`. Allreduce and broadcast write their result into that memory;
/// allgather returns a new buffer from `Handle.wait()`.
///
/// The caller (the `ringwatch.torch` layer) promises that `ptr` is valid for `nbytes` and
/// that nothing touches it until the handle is waited on.
#[pyfunction]
#[pyo3(signature = (kind, name, dtype, shape, ptr, nbytes, owner, op="sum", root=0))]
#[allow(
    clippy::too_many_arguments,
    reason = "one flat call per collective, from Python"
)]
fn enqueue(
    kind: &str,
    name: &str,
    dtype: &str,
    shape: Vec<usize>,
    ptr: usize,
    nbytes: usize,
    owner: Py<PyAny>,
    op: &str,
    root: usize,
) -> PyResult<Handle> {
    let dtype = dtype_from(dtype)?;
    if name.is_empty() {
        return Err(PyValueError::new_err("a collective needs a non-empty name"));
    }
    // SAFETY: the caller's promise above; `owner` keeps the memory alive for as long as the
    // tensor (and thus the runtime) may touch it.
    let tensor = unsafe {
        Tensor::from_external(
            dtype,
            &shape,
            ptr as *mut u8,
            nbytes,
            Box::new(Owner(owner)),
        )
    }
    .ok_or_else(|| {
        PyValueError::new_err(format!(
            "tensor '{name}': {nbytes} bytes do not hold shape {shape:?} of {dtype:?}"
        ))
    })?;
    let handle = with_runtime(|rt| {
        match kind {
            "allreduce" => rt.allreduce_async(name, tensor, op_from(op)?),
            "allgather" => rt.allgather_async(name, tensor),
            "broadcast" => rt.broadcast_async(name, tensor, root),
            other => {
                return Err(PyValueError::new_err(format!(
                    "no collective {other:?} (allreduce, allgather, broadcast)"
                )));
            }
        }
        .map_err(to_py)
    })?;
    Ok(Handle::pending(name, handle))
}

/// Joins: this rank has no more data (Horovod's `hvd.join`). `Handle.wait()` returns
/// `(Buffer, [1])`, one int64: the rank that joined last. Until every rank has joined, the
/// others' allreduces go on with zeros from this rank; their allgathers and broadcasts fail.
#[pyfunction]
fn join() -> PyResult<Handle> {
    let handle = with_runtime(|rt| rt.join_async().map_err(to_py))?;
    Ok(Handle::pending("(join)", handle))
}

/// Whether this build takes GPU tensors (the runtime's `cuda` feature). A GPU tensor may
/// still fail on a machine without a driver, with an error that says so.
#[pyfunction]
fn has_cuda() -> bool {
    cfg!(feature = "cuda")
}

/// Enqueues an in-place allreduce of a contiguous CUDA tensor: `ptr` is its `data_ptr()` on
/// GPU `device`, `stream` the `cuda_stream` of the stream that produced it (the runtime
/// waits for that stream first), `owner` keeps it alive until the handle is waited on.
///
/// The caller (the `ringwatch.torch` layer) promises that `ptr` is device memory valid for
/// the tensor's bytes and that nothing touches it until the handle is waited on; the
/// runtime checks with the driver that the memory is on that GPU and long enough.
#[pyfunction]
#[pyo3(signature = (name, dtype, shape, ptr, device, stream, owner, op="sum"))]
#[allow(
    clippy::too_many_arguments,
    reason = "one flat call per collective, from Python"
)]
#[cfg_attr(not(feature = "cuda"), allow(unused_variables))]
fn enqueue_device(
    py: Python<'_>,
    name: &str,
    dtype: &str,
    shape: Vec<usize>,
    ptr: u64,
    device: i32,
    stream: usize,
    owner: Py<PyAny>,
    op: &str,
) -> PyResult<Handle> {
    let dtype = dtype_from(dtype)?;
    let op = op_from(op)?;
    if name.is_empty() {
        return Err(PyValueError::new_err("a collective needs a non-empty name"));
    }
    #[cfg(feature = "cuda")]
    {
        // SAFETY: the caller's promise above; `owner` keeps the memory alive until the
        // handle is waited on.
        let tensor =
            unsafe { collectives::gpu::DeviceTensor::new(ptr, dtype, &shape, device, stream) };
        // The wait for the tensor's stream happens here, without the GIL (and without the
        // runtime's lock); the runtime's own check then finds the stream idle.
        let checked = py.detach(|| collectives::gpu::prepare(&tensor));
        checked.map_err(|m| RingwatchError::new_err(format!("tensor '{name}': {m}")))?;
        // SAFETY: as above.
        // The runtime holds `owner` until it is done with the memory, even if the handle
        // is dropped unwaited (an exception in a training step).
        let handle = with_runtime(|rt| {
            unsafe { rt.allreduce_device_async_owned(name, tensor, op, Box::new(Owner(owner))) }
                .map_err(to_py)
        })?;
        Ok(Handle::pending(name, handle))
    }
    #[cfg(not(feature = "cuda"))]
    Err(PyValueError::new_err(format!(
        "tensor '{name}' is on a GPU, and this ringwatch was built without the cuda feature \
         (maturin build --features cuda), or move it with .cpu()"
    )))
}

/// A collective in flight. `wait()` returns `None` for in-place results (allreduce,
/// broadcast) and `(Buffer, shape)` for an allgather.
#[pyclass(module = "ringwatch._native")]
struct Handle {
    name: String,
    state: Mutex<HandleState>,
}

/// A handle's progress: the runtime's handle until its result is taken.
struct HandleState {
    pending: Option<collectives::Handle>,
    result: Option<collectives::Result<Tensor>>,
}

impl Handle {
    /// The handle of a collective the runtime has taken.
    fn pending(name: &str, handle: collectives::Handle) -> Self {
        Handle {
            name: name.to_string(),
            state: Mutex::new(HandleState {
                pending: Some(handle),
                result: None,
            }),
        }
    }

    fn state(&self) -> PyResult<MutexGuard<'_, HandleState>> {
        self.state
            .lock()
            .map_err(|_| RingwatchError::new_err("a ringwatch handle's state is poisoned"))
    }
}

#[pymethods]
impl Handle {
    /// The tensor's name.
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// Whether the result is there (`wait()` will not block).
    fn poll(&self) -> PyResult<bool> {
        let mut state = self.state()?;
        if state.result.is_none()
            && let Some(r) = state.pending.as_mut().and_then(|h| h.try_wait())
        {
            state.result = Some(r);
        }
        Ok(state.result.is_some())
    }

    /// Waits for the result (without the GIL; Ctrl-C still interrupts). Raises the
    /// collective's error. Never waits forever: the runtime fails every collective within
    /// its peer timeout (`RINGWATCH_COLLECTIVE_TIMEOUT_SECS`) when a rank dies or stops
    /// answering.
    fn wait(&self, py: Python<'_>) -> PyResult<Option<(Buffer, Vec<usize>)>> {
        // The runtime's handle is taken out while waiting, so that no lock is held without
        // the GIL (a `poll` from another thread meanwhile sees "not there yet").
        let (mut pending, mut result) = {
            let mut state = self.state()?;
            (state.pending.take(), state.result.take())
        };
        while result.is_none() {
            let Some(h) = pending.as_mut() else { break };
            match py.detach(|| h.wait_for(SIGNAL_POLL)) {
                Some(r) => result = Some(r),
                None => {
                    if let Err(e) = py.check_signals() {
                        self.state()?.pending = pending;
                        return Err(e);
                    }
                }
            }
        }
        let tensor = match result {
            Some(r) => r.map_err(to_py)?,
            None => {
                return Err(RingwatchError::new_err(format!(
                    "the collective '{}' was already waited on",
                    self.name
                )));
            }
        };
        if tensor.is_external() {
            // The result is in the caller's memory; dropping the tensor releases its owner.
            return Ok(None);
        }
        let shape = tensor.shape().to_vec();
        Ok(Some((
            Buffer {
                data: tensor.into_buf(),
            },
            shape,
        )))
    }
}

/// Bytes of a result the runtime allocated (an allgather's), lent to Python through the
/// buffer protocol, so that `torch.frombuffer` wraps them without a copy.
#[pyclass(module = "ringwatch._native")]
struct Buffer {
    data: AlignedBuf,
}

#[pymethods]
impl Buffer {
    fn __len__(&self) -> usize {
        self.data.len()
    }

    /// # Safety
    /// Called by Python with a valid `view`; the buffer's bytes never move or change size
    /// while the `Buffer` lives, and the view holds a reference to it.
    unsafe fn __getbuffer__(
        mut slf: PyRefMut<'_, Self>,
        view: *mut ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let len = slf.data.len();
        let ptr = slf.data.as_mut_slice().as_mut_ptr();
        let py = slf.py();
        let obj = slf.into_pyobject(py)?;
        // SAFETY: `view` comes from Python; `ptr` is valid for `len` bytes while `obj`, whose
        // reference the view keeps, is alive.
        let rc = unsafe {
            ffi::PyBuffer_FillInfo(
                view,
                obj.as_ptr(),
                ptr.cast(),
                isize::try_from(len).map_err(|_| PyValueError::new_err("buffer too large"))?,
                0,
                flags,
            )
        };
        if rc == -1 {
            return Err(PyErr::fetch(py));
        }
        Ok(())
    }
}

/// Zeroed memory that the ranks of this host share ([`Runtime::shared_tensor`]), for
/// `ringwatch.torch.shared_zeros`: its address and length stay valid while this object
/// lives. `shared` is false where the runtime handed out ordinary memory instead (no rank
/// shares this host's memory, or the arena is full).
#[pyclass(frozen)]
struct SharedMemory {
    #[pyo3(get)]
    address: usize,
    #[pyo3(get)]
    nbytes: usize,
    #[pyo3(get)]
    shared: bool,
    /// Owns the memory; given back when Python drops this object.
    _tensor: Mutex<Tensor>,
}

/// Allocates a [`SharedMemory`] for a tensor of `dtype` and `shape`.
#[pyfunction]
fn shared_memory(dtype: &str, shape: Vec<usize>) -> PyResult<SharedMemory> {
    let dtype = dtype_from(dtype)?;
    with_runtime(|rt| {
        let mut tensor = rt.shared_tensor(dtype, &shape).map_err(to_py)?;
        let bytes = tensor.as_bytes_mut();
        Ok(SharedMemory {
            address: bytes.as_mut_ptr() as usize,
            nbytes: bytes.len(),
            shared: tensor.is_external(),
            _tensor: Mutex::new(tensor),
        })
    })
}

/// The extension module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("RingwatchError", py.get_type::<RingwatchError>())?;
    m.add("MismatchError", py.get_type::<MismatchError>())?;
    m.add("RankFailedError", py.get_type::<RankFailedError>())?;
    m.add("NotInitializedError", py.get_type::<NotInitializedError>())?;
    m.add_class::<Handle>()?;
    m.add_class::<Buffer>()?;
    m.add_class::<SharedMemory>()?;
    m.add_function(wrap_pyfunction!(shared_memory, m)?)?;
    m.add_function(wrap_pyfunction!(init, m)?)?;
    m.add_function(wrap_pyfunction!(shutdown, m)?)?;
    m.add_function(wrap_pyfunction!(leave, m)?)?;
    m.add_function(wrap_pyfunction!(is_initialized, m)?)?;
    m.add_function(wrap_pyfunction!(mark_step, m)?)?;
    m.add_function(wrap_pyfunction!(steps_marked, m)?)?;
    m.add_function(wrap_pyfunction!(rank, m)?)?;
    m.add_function(wrap_pyfunction!(size, m)?)?;
    m.add_function(wrap_pyfunction!(local_rank, m)?)?;
    m.add_function(wrap_pyfunction!(local_size, m)?)?;
    m.add_function(wrap_pyfunction!(job_id, m)?)?;
    m.add_function(wrap_pyfunction!(control_socket, m)?)?;
    m.add_function(wrap_pyfunction!(knobs, m)?)?;
    m.add_function(wrap_pyfunction!(set_knobs, m)?)?;
    m.add_function(wrap_pyfunction!(totals, m)?)?;
    m.add_function(wrap_pyfunction!(enqueue, m)?)?;
    m.add_function(wrap_pyfunction!(enqueue_device, m)?)?;
    m.add_function(wrap_pyfunction!(join, m)?)?;
    m.add_function(wrap_pyfunction!(has_cuda, m)?)?;
    m.add_function(wrap_pyfunction!(gpu_totals, m)?)?;
    Ok(())
}
