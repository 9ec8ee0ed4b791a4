"""PyTorch on the ringwatch runtime, in Horovod's two lines.

    import ringwatch.torch as rw

    rw.init()                                   # torchrun / mpirun / MPI operator variables
    model = torchvision.models.resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=0.01 * rw.size())
    opt = rw.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    rw.broadcast_parameters(model.state_dict(), root_rank=0)
    for x, y in loader:
        opt.zero_grad()
        loss_fn(model(x), y).backward()         # gradients allreduced as they are produced
        opt.step()                              # waits for them, then steps

Tensors are CPU or CUDA tensors of float32, float64, float16, bfloat16, int32 or int64. A
contiguous tensor is handed to the runtime in place (no copy in or out; the GIL is released
while the runtime works); a non-contiguous one is refused with a message saying so. A CUDA
tensor's allreduce runs on the GPU through NCCL where every rank has a GPU of its own, else
through pinned host memory and the runtime's rings (``RINGWATCH_NCCL=0`` always stages); the
runtime first waits for the tensor's current stream. Broadcast and allgather of CUDA tensors
(parameters at start-up) go through a host copy.

The knobs (``RINGWATCH_FUSION_THRESHOLD``, ``RINGWATCH_CYCLE_TIME_MS``,
``RINGWATCH_HIERARCHICAL_ALLREDUCE`` or Horovod's ``HOROVOD_*``), the control socket the
ringwatch agent watches, the timeline and autotune (``RINGWATCH_AUTOTUNE=1`` or
``HOROVOD_AUTOTUNE=1``) behave as for any ringwatch job.

Rendezvous: rank 0 listens on ``RINGWATCH_MASTER_PORT``, by default ``MASTER_PORT + 1``
(``MASTER_PORT`` itself is torch.distributed's store under torchrun or
``init_process_group``), at ``MASTER_ADDR``.
"""

import atexit
import ctypes
import os
import sys
import threading
import queue
import itertools
import io
import pickle
import warnings

import torch

from ringwatch import _native
from ringwatch._native import (
    MismatchError,
    NotInitializedError,
    RankFailedError,
    RingwatchError,
)

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size",
    "job_id", "knobs", "set_knobs", "mark_step",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "gloo_built", "gloo_enabled",
    "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "Sum", "Average", "Min", "Max", "Product", "Compression", "barrier", "join",
    "broadcast_object", "allgather_object",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "shared_zeros",
    "allgather", "allgather_async", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "synchronize", "poll", "Handle",
    "grouped_allreduce", "grouped_allreduce_", "grouped_allreduce_async",
    "grouped_allreduce_async_", "grouped_allgather", "grouped_allgather_async",
    "reducescatter", "reducescatter_async", "grouped_reducescatter",
    "grouped_reducescatter_async", "alltoall", "alltoall_async", "sparse_allreduce_async",
    "Adasum",
    "broadcast_parameters", "broadcast_optimizer_state", "DistributedOptimizer",
    "ddp_comm_hook",
    "RingwatchError", "MismatchError", "RankFailedError", "NotInitializedError",
    "HorovodInternalError",
]

#: Horovod's name for a failed collective: the same class as :class:`RingwatchError`.
HorovodInternalError = RingwatchError

#: Reductions for ``op=``.
Sum = "sum"
Average = "average"
Min = "min"
Max = "max"
Product = "product"

#: Horovod's Adasum: a name only, so that code naming it imports; every collective refuses
#: it (ringwatch does not implement Adasum).
Adasum = "adasum"

_OPS = (Sum, Average, Min, Max, Product)

_DTYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.int32: "int32",
    torch.int64: "int64",
    torch.int16: "int16",
    torch.int8: "int8",
    torch.uint8: "uint8",
}

_unnamed = itertools.count()
_unnamed_lock = threading.Lock()
# name -> the native handle of the last collective submitted under it (_claim).
_inflight = {}
_inflight_lock = threading.Lock()


def init():
    """Joins the job: rendezvous with the other ranks (``RANK``/``WORLD_SIZE``/
    ``LOCAL_RANK``/``LOCAL_SIZE`` or ``LOCAL_WORLD_SIZE``, or Open MPI's
    ``OMPI_COMM_WORLD_*``; none of them: a job of one rank). Waits up to
    ``RINGWATCH_CONNECT_TIMEOUT_SECS`` (60) for the others. Calling it again does nothing."""
    port = os.environ.get("RINGWATCH_MASTER_PORT")
    if port is None or not port.strip():
        base = os.environ.get("MASTER_PORT", "").strip() or "29500"
        try:
            port = int(base) + 1
        except ValueError:
            raise ValueError(f"MASTER_PORT={base!r} is not a number") from None
    try:
        port = int(port)
    except ValueError:
        raise ValueError(f"RINGWATCH_MASTER_PORT={port!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(
            f"the rendezvous port {port} is not a port (RINGWATCH_MASTER_PORT, else MASTER_PORT + 1)"
        )
    _native.init(master_port=port)
    atexit.register(_shutdown_at_exit)
    _leave_on_uncaught_exceptions()


def _leave_on_uncaught_exceptions():
    """An exception that ends this rank's script tells the other ranks at once (they
    raise naming this rank and the exception), instead of leaving them to wait out their
    peer timeout."""
    previous = sys.excepthook
    if getattr(previous, "_ringwatch_leaves", False):
        return

    def leave_then_report(kind, value, traceback):
        try:
            _native.leave(f"exception {kind.__name__}: {value}"[:300])
        except Exception:  # noqa: BLE001 - the exception below is what matters
            pass
        previous(kind, value, traceback)

    leave_then_report._ringwatch_leaves = True
    sys.excepthook = leave_then_report


def _shutdown_at_exit():
    try:
        _native.shutdown()
    except Exception:  # noqa: BLE001 - nothing to report to at interpreter exit
        pass


def shutdown():
    """Leaves the job (waits, up to the peer timeout, for the other ranks to leave too)."""
    _native.shutdown()


def is_initialized():
    return _native.is_initialized()


def mark_step():
    """Marks the end of a training step (call it once per step, on every rank).

    A tuning session then scores the job by steps per second, what you measure, rather
    than by the bytes its collectives move. ``DistributedOptimizer.step()`` marks its
    steps already; call this where a loop steps without it. Not part of Horovod's API.
    """
    _native.mark_step()


def rank():
    """This process's rank in the job."""
    return _native.rank()


def size():
    """Ranks in the job."""
    return _native.size()


def local_rank():
    """This rank's place among the ranks on its node."""
    return _native.local_rank()


def local_size():
    """Ranks on this node."""
    return _native.local_size()


# Horovod's build queries, answered for ringwatch: its transports are its own (shared memory,
# TCP, and NCCL loaded at run time for GPU tensors), never MPI, Gloo, DDL, oneCCL or ROCm.


def mpi_built():
    """False: ringwatch does not use MPI (an MPI launcher's variables are read, nothing more)."""
    return False


def mpi_enabled():
    """False: ringwatch does not use MPI."""
    return False


def mpi_threads_supported():
    """Raises ``ValueError``, as Horovod does when MPI is not enabled."""
    raise ValueError("Horovod MPI is not enabled; ringwatch does not use MPI.")


def gloo_built():
    """False: ringwatch's own rings replace Gloo."""
    return False


def gloo_enabled():
    """False: ringwatch's own rings replace Gloo."""
    return False


def cuda_built():
    """True when this build handles CUDA tensors (the driver is loaded at run time)."""
    return bool(_native.has_cuda())


def nccl_built():
    """NCCL's version code (e.g. 21805) when this build handles CUDA tensors and a
    ``libnccl.so.2`` loads here, else 0; as Horovod, an int."""
    if not cuda_built():
        return 0
    try:
        nccl = ctypes.CDLL("libnccl.so.2")
        version = ctypes.c_int(0)
        if nccl.ncclGetVersion(ctypes.byref(version)) != 0:
            return 0
        return int(version.value)
    except (OSError, AttributeError):
        return 0


def rocm_built():
    """False."""
    return False


def ddl_built():
    """False."""
    return False


def ccl_built():
    """False."""
    return False


def job_id():
    """The job's id, as the ringwatch agent and its control socket name it."""
    return _native.job_id()


def knobs():
    """The knobs in force: ``fusion_threshold`` (bytes), ``cycle_time_ms``,
    ``hierarchical_allreduce``, ``since_cycle``, ``autotune``."""
    return _native.knobs()


def set_knobs(fusion_threshold=None, cycle_time_ms=None, hierarchical_allreduce=None):
    """Asks for knobs; rank 0 applies them on every rank at the next cycle boundary."""
    _native.set_knobs(fusion_threshold, cycle_time_ms, hierarchical_allreduce)


class Handle:
    """A collective in flight; :func:`synchronize` returns its result."""

    __slots__ = ("_native", "_tensor", "_kind", "_dtype", "_gpu", "_postscale", "_then")

    def __init__(self, native, tensor, kind, gpu=None):
        self._postscale = 1.0
        # What synchronize() makes of the result, for collectives composed of others.
        self._then = None
        self._native = native
        self._tensor = tensor
        self._kind = kind
        self._dtype = tensor.dtype
        # A CUDA tensor staged through the host copy `tensor`: the result goes back to it.
        self._gpu = gpu

    @property
    def name(self):
        return self._native.name

    def __repr__(self):
        return f"<ringwatch Handle {self._kind} '{self.name}'>"


def _name(prefix, name):
    if name is not None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name must be a non-empty string, not {name!r}")
        return name
    with _unnamed_lock:
        return f"{prefix}.noname.{next(_unnamed)}"


def _check(tensor, name, what):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} of '{name}': expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.device.type == "cuda":
        if not _native.has_cuda():
            raise ValueError(
                f"{what} of '{name}': the tensor is on {tensor.device}, and this ringwatch was "
                "built without the cuda feature (maturin build --features cuda): move it "
                "with .cpu()"
            )
    elif tensor.device.type != "cpu":
        raise ValueError(
            f"{what} of '{name}': the tensor is on {tensor.device}; ringwatch takes CPU and "
            "CUDA tensors: move it with .cpu()"
        )
    if tensor.layout != torch.strided:
        raise ValueError(f"{what} of '{name}': {tensor.layout} tensors are not supported")
    if not tensor.is_contiguous():
        raise ValueError(
            f"{what} of '{name}': the tensor is not contiguous (shape {tuple(tensor.shape)}, "
            f"strides {tensor.stride()}); ringwatch works on the tensor's memory in place, "
            "so pass tensor.contiguous()"
        )
    dtype = _DTYPES.get(tensor.dtype)
    if dtype is None:
        raise TypeError(
            f"{what} of '{name}': dtype {tensor.dtype} is not supported "
            "(float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8)"
        )
    return dtype


def _claim(name, kind):
    """Horovod's rule: a name may not be submitted again while a collective of that name
    is in flight on this rank (the ranks would pair the wrong tensors). Here a name is in
    flight until its handle is synchronized, not merely until the runtime finished it, so
    whether a second call is refused does not depend on how fast the first went."""
    with _inflight_lock:
        if len(_inflight) > 1024:
            # Handles nobody synchronized: forget the finished ones.
            for done in [n for n, h in _inflight.items() if h.poll()]:
                del _inflight[done]
        if name in _inflight:
            raise ValueError(
                f"{kind} of '{name}': a collective of that name is already in flight on this "
                "rank; synchronize it first or give this one another name")


def _submit(kind, tensor, name, op=Average, root=0):
    dtype = _check(tensor, name, kind)
    _claim(name, kind)
    handle = _submit_checked(kind, tensor, name, dtype, op, root)
    with _inflight_lock:
        _inflight[name] = handle._native
    return handle


def _submit_checked(kind, tensor, name, dtype, op, root):
    if tensor.device.type == "cuda":
        if kind == "allreduce":
            native = _native.enqueue_device(
                name,
                dtype,
                list(tensor.shape),
                tensor.data_ptr(),
                tensor.device.index,
                torch.cuda.current_stream(tensor.device).cuda_stream,
                tensor,
                op,
            )
            return Handle(native, tensor, kind)
        # Broadcast and allgather (start-up work) go through a host copy.
        host = tensor.cpu()
        handle = _submit_checked(kind, host, name, dtype, op, root)
        handle._gpu = tensor
        return handle
    native = _native.enqueue(
        kind,
        name,
        dtype,
        list(tensor.shape),
        tensor.data_ptr(),
        tensor.numel() * tensor.element_size(),
        tensor,
        op,
        root,
    )
    return Handle(native, tensor, kind)


def shared_zeros(*size, dtype=torch.float32):
    """A zeroed CPU tensor in memory that the ranks of this host share.

    Allreduce it in place (:func:`allreduce_` or :func:`allreduce_async_`), alone and on
    every rank: on a one-host job, above 64 KiB, each rank then folds its part straight
    from the other ranks' tensors and writes the result into all of them, with no copies
    through staging buffers (2 bytes of memory traffic per byte per rank instead of 4.5 to
    5.75; the same bits as an ordinary tensor). Meant for flat buffers reduced over and
    over, such as a model's gradients packed in one tensor. Where no other rank shares this
    host's memory it is an ordinary tensor. Its memory is given back when it is freed.
    """
    if len(size) == 1 and isinstance(size[0], (tuple, list, torch.Size)):
        size = tuple(size[0])
    return _shared_zeros([int(d) for d in size], dtype)[0]


def _shared_zeros(shape, dtype):
    """:func:`shared_zeros`, and whether the memory is shared with other ranks."""
    name = _DTYPES.get(dtype)
    if name is None:
        raise TypeError(
            f"shared_zeros: dtype {dtype} is not supported "
            "(float32, float64, float16, bfloat16, int64, int32, int16, int8, uint8)"
        )
    memory = _native.shared_memory(name, shape)
    if memory.nbytes == 0:
        return torch.zeros(shape, dtype=dtype), memory.shared
    # A bytes view of the memory that keeps it alive: torch.frombuffer holds a reference to
    # its buffer for as long as the tensor (or a view of it) lives.
    raw = type("SharedBytes", (ctypes.c_char * memory.nbytes,), {}).from_address(memory.address)
    raw.memory = memory
    return torch.frombuffer(raw, dtype=torch.uint8).view(dtype).view(shape), memory.shared


def _op(op, average):
    """Horovod's rule for ``op`` and the deprecated ``average``: ``op`` wins, both is an
    error, ``average`` alone warns, neither is Average."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of them.")
        if op == Adasum:
            raise NotImplementedError(
                "op=Adasum: ringwatch does not implement Adasum; use Sum or Average")
        if op not in _OPS:
            raise ValueError(f"op must be one of Sum, Average, Min, Max, Product, not {op!r}")
        return op
    if average is not None:
        warnings.warn("Parameter `average` has been replaced with `op` and will be removed in v1.0",
                      DeprecationWarning, stacklevel=3)
        return Average if average else Sum
    return Average


def _scale(tensor, factor):
    """``tensor *= factor`` in place, as Horovod scales: float32 and float64 in their own
    precision, 16-bit floats through float32, integers through float64 (truncated)."""
    if factor == 1.0:
        return tensor
    with torch.no_grad():
        if tensor.dtype in (torch.float32, torch.float64):
            tensor.mul_(factor)
        elif tensor.dtype in (torch.float16, torch.bfloat16):
            tensor.copy_((tensor.float() * factor).to(tensor.dtype))
        else:
            tensor.copy_((tensor.double() * factor).to(tensor.dtype))
    return tensor


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                     postscale_factor=1.0):
    """Starts an in-place allreduce of ``tensor`` (same name, shape and dtype on every
    rank); :func:`synchronize` returns ``tensor``, holding the result. As Horovod:
    ``op`` defaults to Average; ``prescale_factor`` multiplies the input first (in place),
    ``postscale_factor`` the result."""
    op = _op(op, average)
    name = _name("allreduce", name)
    _check(tensor, name, "allreduce")
    _scale(tensor, prescale_factor)
    handle = _submit("allreduce", tensor, name, op=op)
    handle._postscale = postscale_factor
    return handle


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0,
                    postscale_factor=1.0):
    """Starts an allreduce into a copy of ``tensor``, which is left as it is."""
    return allreduce_async_(_copy(tensor), average, name, op, prescale_factor, postscale_factor)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0,
               postscale_factor=1.0):
    """Allreduces ``tensor`` in place (default op: Average, as Horovod) and returns it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor,
                                        postscale_factor))


class _Allreduce(torch.autograd.Function):
    """An allreduce autograd sees (as Horovod's): the gradient is the same allreduce (op and
    scale factors) of the gradients, over every rank."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.name, ctx.op = name, op
        ctx.scale = (prescale_factor, postscale_factor)
        return synchronize(allreduce_async_(_copy(tensor), name=name, op=op,
                                            prescale_factor=prescale_factor,
                                            postscale_factor=postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        pre, post = ctx.scale
        grad = synchronize(allreduce_async_(_copy(grad), name=ctx.name + ".grad", op=ctx.op,
                                            prescale_factor=pre, postscale_factor=post))
        return grad, None, None, None, None


class _NoneCompressor:
    """No compression (the default)."""

    @staticmethod
    def compress(tensor):
        return tensor, None

    @staticmethod
    def decompress(tensor, ctx):
        return tensor


class _FP16Compressor:
    """Floating-point tensors sent as float16, given back in their own dtype."""

    @staticmethod
    def compress(tensor):
        if tensor.dtype.is_floating_point:
            return tensor.type(torch.float16), tensor.dtype
        return tensor, tensor.dtype

    @staticmethod
    def decompress(tensor, ctx):
        if ctx is not None and ctx.is_floating_point:
            return tensor.type(ctx)
        return tensor


class Compression:
    """Horovod's gradient compression for ``allreduce(compression=…)`` and
    ``DistributedOptimizer``: ``Compression.none`` or ``Compression.fp16``."""

    none = _NoneCompressor
    fp16 = _FP16Compressor


def allreduce(tensor, average=None, name=None, compression=Compression.none, op=None,
              prescale_factor=1.0, postscale_factor=1.0):
    """Returns the allreduce of ``tensor`` (default op: Average, as Horovod) as a new tensor.
    Differentiable, as Horovod's: backward allreduces the gradients the same way (under
    the name ``<name>.grad``), so every rank must run backward through it."""
    op = _op(op, average)
    name = _name("allreduce", name)
    compressed, ctx = compression.compress(tensor)
    if (isinstance(compressed, torch.Tensor) and compressed.requires_grad
            and torch.is_grad_enabled()):
        _check(compressed, name, "allreduce")
        out = _Allreduce.apply(compressed, name, op, prescale_factor, postscale_factor)
    else:
        out = synchronize(allreduce_async(compressed, name=name, op=op,
                                          prescale_factor=prescale_factor,
                                          postscale_factor=postscale_factor))
    return compression.decompress(out, ctx)


def allgather_async(tensor, name=None):
    """Starts an allgather: the ranks' tensors concatenated along the first dimension
    (which may differ across ranks; the others must not)."""
    return _submit("allgather", tensor, _name("allgather", name))


class _Allgather(torch.autograd.Function):
    """Horovod's allgather gradient: the average of the gradients over the ranks, this
    rank's rows of it."""

    @staticmethod
    def forward(ctx, tensor, name):
        ctx.rows = tensor.shape[0] if tensor.dim() > 0 else 1
        return synchronize(allgather_async(tensor, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average)
        rows = allgather(torch.tensor([ctx.rows], dtype=torch.int32))
        offset = int(rows[: rank()].sum().item())
        return reduced.narrow(0, offset, ctx.rows), None


def allgather(tensor, name=None):
    """Returns the ranks' tensors concatenated along the first dimension. Differentiable,
    as Horovod's."""
    name = _name("allgather", name)
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        _check(tensor, name, "allgather")
        return _Allgather.apply(tensor, name)
    return synchronize(allgather_async(tensor, name=name))


def broadcast_async_(tensor, root_rank, name=None):
    """Starts an in-place broadcast: every rank's ``tensor`` gets ``root_rank``'s values."""
    return _submit("broadcast", tensor, _name("broadcast", name), root=_root(root_rank))


def broadcast_async(tensor, root_rank, name=None):
    """Starts a broadcast into a copy of ``tensor``, which is left as it is."""
    return broadcast_async_(_copy(tensor), root_rank, name=name)


def broadcast_(tensor, root_rank, name=None):
    """Broadcasts ``root_rank``'s ``tensor`` into every rank's ``tensor``; returns it."""
    return synchronize(broadcast_async_(tensor, root_rank, name=name))


class _Broadcast(torch.autograd.Function):
    """Horovod's broadcast gradient: the average of the gradients on the root, zero
    elsewhere."""

    @staticmethod
    def forward(ctx, tensor, root_rank, name):
        ctx.root_rank = root_rank
        return synchronize(broadcast_async(tensor, root_rank, name=name))

    @staticmethod
    def backward(ctx, grad):
        reduced = allreduce(grad, op=Average)
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None


def broadcast(tensor, root_rank, name=None):
    """Returns ``root_rank``'s ``tensor`` on every rank, as a new tensor. Differentiable, as
    Horovod's."""
    name = _name("broadcast", name)
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        _check(tensor, name, "broadcast")
        return _Broadcast.apply(tensor, _root(root_rank), name)
    return synchronize(broadcast_async(tensor, root_rank, name=name))


_barriers = itertools.count()


def barrier():
    """Returns once every rank has called it: an allreduce of one int32 that no rank
    finishes before every rank has submitted it."""
    synchronize(allreduce_async_(torch.zeros(1, dtype=torch.int32),
                                 name=f"barrier.{next(_barriers)}", op=Sum))


def join(device=-1):
    """Says that this rank has no more data and waits until every rank has said so
    (Horovod's ``hvd.join``, for ranks with uneven amounts of data). Meanwhile the other
    ranks' allreduces go on, this rank adding zeros to them (an average still divides by
    :func:`size`), and their allgathers and broadcasts fail with :class:`MismatchError`.
    Returns the rank that joined last, the same on every rank. ``device`` is Horovod's
    (the GPU to wait on) and is not needed here."""
    buf, _ = _native.join().wait()
    return int(torch.frombuffer(buf, dtype=torch.int64)[0])


def _dumps(obj):
    try:
        import cloudpickle  # what Horovod uses: lambdas and local classes too
        return cloudpickle.dumps(obj)
    except ImportError:
        return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def broadcast_object(obj, root_rank=0, name=None):
    """Returns ``root_rank``'s ``obj`` (any picklable object) on every rank, as Horovod's:
    its pickled size, then its bytes, broadcast. Only pickles from ranks of this job are
    unpickled."""
    name = name or type(obj).__name__
    root_rank = _root(root_rank)
    if rank() == root_rank:
        data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
        broadcast_(torch.tensor([data.numel()], dtype=torch.int64), root_rank, name=name + ".sz")
    else:
        size_t = broadcast_(torch.zeros(1, dtype=torch.int64), root_rank, name=name + ".sz")
        data = torch.zeros(int(size_t.item()), dtype=torch.uint8)
    broadcast_(data, root_rank, name=name + ".t")
    if rank() == root_rank:
        return obj
    return pickle.load(io.BytesIO(data.numpy().tobytes()))


def allgather_object(obj, name=None):
    """Returns the list of every rank's ``obj`` (any picklable object), by rank, as
    Horovod's: the pickled sizes, then the bytes, allgathered."""
    name = name or type(obj).__name__
    data = torch.frombuffer(bytearray(_dumps(obj)), dtype=torch.uint8)
    sizes = allgather(torch.tensor([data.numel()], dtype=torch.int64), name=name + ".sz")
    gathered = allgather(data, name=name + ".t").numpy().tobytes()
    out, offset = [], 0
    for n in sizes.tolist():
        out.append(pickle.load(io.BytesIO(gathered[offset:offset + n])))
        offset += n
    return out


def _root(root_rank):
    if isinstance(root_rank, bool) or not isinstance(root_rank, int) or root_rank < 0:
        raise ValueError(f"root_rank must be a rank (an int >= 0), not {root_rank!r}")
    return root_rank


def _copy(tensor):
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    with torch.no_grad():
        return tensor.detach().clone(memory_format=torch.contiguous_format)


class _Group(Handle):
    """Several collectives started together; :func:`synchronize` returns their results
    as a list, in order."""

    __slots__ = ("_parts",)

    def __init__(self, parts):  # noqa: super().__init__ is not called: no native handle
        self._parts = parts

    @property
    def name(self):
        return self._parts[0].name if self._parts else "group"

    def __repr__(self):
        return f"<ringwatch Handle group of {len(self._parts)}>"


def _group_names(name, count, prefix):
    base = _name(prefix, name)
    return [f"{base}.{i}" for i in range(count)]


def _tensor_list(tensors, what):
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{what} takes a list of tensors, not {type(tensors).__name__}")
    return list(tensors)


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                             postscale_factor=1.0):
    """Starts in-place allreduces of every tensor in ``tensors``; :func:`synchronize`
    returns the list. Submitted together, so the runtime fuses them as it fuses any
    tensors that arrive in one cycle (Horovod guarantees one fused group; ringwatch
    makes it likely, not certain: the results are the same)."""
    tensors = _tensor_list(tensors, "grouped_allreduce")
    op = _op(op, average)
    names = _group_names(name, len(tensors), "grouped_allreduce")
    return _Group([allreduce_async_(t, name=n, op=op, prescale_factor=prescale_factor,
                                    postscale_factor=postscale_factor)
                   for t, n in zip(tensors, names)])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                            postscale_factor=1.0):
    """As :func:`grouped_allreduce_async_`, into copies; ``tensors`` are left as they are."""
    tensors = _tensor_list(tensors, "grouped_allreduce")
    return grouped_allreduce_async_([_copy(t) for t in tensors], average, name, op,
                                    prescale_factor, postscale_factor)


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0,
                       postscale_factor=1.0):
    """Allreduces every tensor in ``tensors`` in place; returns them."""
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor,
                                                postscale_factor))


def grouped_allreduce(tensors, average=None, name=None, compression=Compression.none, op=None,
                      prescale_factor=1.0, postscale_factor=1.0):
    """The allreduces of ``tensors`` as new tensors, differentiable as :func:`allreduce`."""
    tensors = _tensor_list(tensors, "grouped_allreduce")
    op = _op(op, average)
    names = _group_names(name, len(tensors), "grouped_allreduce")
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allreduce(t, name=n, compression=compression, op=op,
                          prescale_factor=prescale_factor, postscale_factor=postscale_factor)
                for t, n in zip(tensors, names)]
    compressed = [compression.compress(t) for t in tensors]
    handles = [allreduce_async(c, name=n, op=op, prescale_factor=prescale_factor,
                               postscale_factor=postscale_factor)
               for (c, _), n in zip(compressed, names)]
    return [compression.decompress(synchronize(h), ctx)
            for h, (_, ctx) in zip(handles, compressed)]


def grouped_allgather_async(tensors, name=None):
    """Starts the allgathers of ``tensors``; :func:`synchronize` returns the list."""
    tensors = _tensor_list(tensors, "grouped_allgather")
    names = _group_names(name, len(tensors), "grouped_allgather")
    return _Group([allgather_async(t, name=n) for t, n in zip(tensors, names)])


def grouped_allgather(tensors, name=None):
    """The allgathers of ``tensors``, differentiable as :func:`allgather`."""
    tensors = _tensor_list(tensors, "grouped_allgather")
    names = _group_names(name, len(tensors), "grouped_allgather")
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [allgather(t, name=n) for t, n in zip(tensors, names)]
    return synchronize(_Group([allgather_async(t, name=n) for t, n in zip(tensors, names)]))


def _rows_of(rows, ranks, rank_):
    """Horovod's reducescatter split of ``rows`` over ``ranks``: ``(first row, count)``
    of ``rank_``'s part; the first ``rows % ranks`` ranks get one row more."""
    base, extra = divmod(rows, ranks)
    count = base + (1 if rank_ < extra else 0)
    return rank_ * base + min(rank_, extra), count


def _reducescatter_op(op, name):
    """``op`` (None: Average) if reducescatter takes it; Horovod's RuntimeError if not."""
    if op is None:
        return Average
    if op not in (Sum, Average):
        raise RuntimeError(
            f"reducescatter of '{name}' takes op=Sum or op=Average, not {op!r} (as Horovod's)")
    return op


def reducescatter_async(tensor, name=None, op=Average, prescale_factor=1.0,
                        postscale_factor=1.0):
    """Starts a reducescatter: the reduction of ``tensor`` over the ranks (``op`` Sum or
    Average), of which this rank gets its rows of the first dimension (Horovod's split:
    ``rows // size`` each, the first ``rows % size`` ranks one more). ``tensor`` is left
    as it is.

    Composed of an allreduce, so it moves about twice the bytes a native reducescatter
    would; the results are the same."""
    name = _name("reducescatter", name)
    op = _reducescatter_op(op, name)
    _check(tensor, name, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError(
            f"reducescatter of '{name}': a scalar has no first dimension to scatter")
    handle = allreduce_async(tensor, name=name, op=op, prescale_factor=prescale_factor,
                             postscale_factor=postscale_factor)
    first, count = _rows_of(tensor.shape[0], size(), rank())
    handle._then = lambda reduced: reduced.narrow(0, first, count).clone()
    return handle


class _Reducescatter(torch.autograd.Function):
    """Horovod's reducescatter gradient: the allgather of the gradients, times the number
    of ranks for Sum, and the scale factors."""

    @staticmethod
    def forward(ctx, tensor, name, op, prescale_factor, postscale_factor):
        ctx.factor = (size() if op == Sum else 1.0) * prescale_factor * postscale_factor
        return synchronize(reducescatter_async(tensor, name, op, prescale_factor,
                                               postscale_factor))

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        if ctx.factor != 1.0:
            grad = grad * ctx.factor
        return allgather(grad), None, None, None, None


def reducescatter(tensor, name=None, compression=Compression.none, op=Average,
                  prescale_factor=1.0, postscale_factor=1.0):
    """Returns this rank's part of the reduction of ``tensor`` over the ranks (see
    :func:`reducescatter_async`). Differentiable, as Horovod's."""
    name = _name("reducescatter", name)
    op = _reducescatter_op(op, name)
    compressed, ctx = compression.compress(tensor)
    if (isinstance(compressed, torch.Tensor) and compressed.requires_grad
            and torch.is_grad_enabled()):
        _check(compressed, name, "reducescatter")
        out = _Reducescatter.apply(compressed, name, op, prescale_factor, postscale_factor)
    else:
        out = synchronize(reducescatter_async(compressed, name, op, prescale_factor,
                                              postscale_factor))
    return compression.decompress(out, ctx)


def grouped_reducescatter_async(tensors, name=None, op=Average, prescale_factor=1.0,
                                postscale_factor=1.0):
    """Starts the reducescatters of ``tensors``; :func:`synchronize` returns the list."""
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    names = _group_names(name, len(tensors), "grouped_reducescatter")
    return _Group([reducescatter_async(t, n, op, prescale_factor, postscale_factor)
                   for t, n in zip(tensors, names)])


def grouped_reducescatter(tensors, name=None, compression=Compression.none, op=Average,
                          prescale_factor=1.0, postscale_factor=1.0):
    """The reducescatters of ``tensors``, differentiable as :func:`reducescatter`."""
    tensors = _tensor_list(tensors, "grouped_reducescatter")
    names = _group_names(name, len(tensors), "grouped_reducescatter")
    if any(t.requires_grad for t in tensors) and torch.is_grad_enabled():
        return [reducescatter(t, n, compression, op, prescale_factor, postscale_factor)
                for t, n in zip(tensors, names)]
    compressed = [compression.compress(t) for t in tensors]
    handles = [reducescatter_async(c, n, op, prescale_factor, postscale_factor)
               for (c, _), n in zip(compressed, names)]
    return [compression.decompress(synchronize(h), ctx)
            for h, (_, ctx) in zip(handles, compressed)]


def _alltoall_splits(tensor, splits, name):
    rows = tensor.shape[0]
    ranks = size()
    if splits is None:
        if rows % ranks:
            raise ValueError(
                f"alltoall of '{name}': {rows} rows cannot be split equally over {ranks} "
                "ranks; pass splits=")
        return [rows // ranks] * ranks
    if isinstance(splits, torch.Tensor):
        if splits.dtype != torch.int32:
            raise ValueError(
                f"alltoall of '{name}': splits must be a tensor of int32, not {splits.dtype}")
        splits = splits.cpu().tolist()
    splits = [int(n) for n in splits]
    if len(splits) != ranks or any(n < 0 for n in splits):
        raise ValueError(
            f"alltoall of '{name}': splits must give {ranks} counts >= 0, got {splits}")
    if sum(splits) > rows:
        raise ValueError(
            f"alltoall of '{name}': splits send {sum(splits)} rows, the tensor has {rows}")
    return splits


def alltoall_async(tensor, splits=None, name=None):
    """Starts an alltoall: ``tensor``'s rows (first dimension) cut by ``splits`` (int32,
    one count per rank; default: equal parts), part ``i`` to rank ``i``. :func:`synchronize`
    returns ``(received rows, received splits)``.

    Composed of two allgathers (the counts, then the tensors), so every rank receives every
    rank's whole tensor: about ``size`` times the bytes a native alltoall moves; the
    results are the same."""
    name = _name("alltoall", name)
    _check(tensor, name, "alltoall")
    if tensor.dim() == 0:
        raise ValueError(f"alltoall of '{name}': a scalar has no rows to send")
    sends = _alltoall_splits(tensor, splits, name)
    ranks, me = size(), rank()
    # Every rank's counts and its number of rows: allgather carries a rank's whole
    # tensor, which may hold more rows than its splits send.
    counts = synchronize(allgather_async(
        torch.tensor([sends + [tensor.shape[0]]], dtype=torch.int64), name=f"{name}.splits"))
    counts = counts.tolist()
    matrix = [row[:ranks] for row in counts]  # matrix[r][j]: rows rank r sends to rank j
    starts, offset = [], 0
    for row in counts:
        starts.append(offset)
        offset += row[ranks]
    handle = allgather_async(tensor, name=name)

    def pick(gathered):
        parts = [gathered.narrow(0, starts[r] + sum(matrix[r][:me]), matrix[r][me])
                 for r in range(ranks)]
        received = torch.tensor([matrix[r][me] for r in range(ranks)], dtype=torch.int32)
        return torch.cat(parts, 0), received

    handle._then = pick
    return handle


class _Alltoall(torch.autograd.Function):
    """Horovod's alltoall gradient: the alltoall of the gradient with the received splits."""

    @staticmethod
    def forward(ctx, tensor, splits, name):
        out, received = synchronize(alltoall_async(tensor, splits, name))
        ctx.received = received
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _received_grad):
        back, _ = synchronize(alltoall_async(grad.contiguous(), ctx.received))
        return back, None, None


def alltoall(tensor, splits=None, name=None):
    """Sends part ``i`` of ``tensor``'s rows to rank ``i`` and returns the parts received,
    concatenated in rank order; with ``splits``, also the received counts (int32), as
    Horovod. Differentiable. See :func:`alltoall_async` for what it costs."""
    name = _name("alltoall", name)
    if isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled():
        _check(tensor, name, "alltoall")
        out, received = _Alltoall.apply(tensor, splits, name)
    else:
        out, received = synchronize(alltoall_async(tensor, splits, name))
    return out if splits is None else (out, received)


def sparse_allreduce_async(tensor, name=None, op=Average):
    """Starts the allreduce of a sparse COO ``tensor`` (Horovod's): every rank's indices and
    values are gathered, so the result holds every rank's entries (not coalesced: entries
    at the same index add up when it is), values divided by :func:`size` for ``Average``.
    Returns a function that waits and returns the result, as Horovod's does. ``op``: Sum or
    Average."""
    if not isinstance(tensor, torch.Tensor) or not tensor.is_sparse:
        raise TypeError("sparse_allreduce_async expects a sparse COO tensor "
                        f"(torch.sparse_coo_tensor), got {type(tensor).__name__}"
                        + (f" with layout {tensor.layout}" if isinstance(tensor, torch.Tensor)
                           else ""))
    if op not in (Sum, Average):
        _op(op, None)  # Adasum and unknown ops: the usual error
        raise ValueError(f"a sparse allreduce sums or averages; op must be Sum or Average, "
                         f"not {op!r}")
    name = _name("sparse_allreduce", name)
    shape = tensor.size()
    # Rows to gather: one per entry (its indices as a row), and its values.
    indices = allgather_async(tensor._indices().t().contiguous(), name=f"{name}.indices")
    values = allgather_async(tensor._values().contiguous(), name=f"{name}.values")

    def result():
        v = synchronize(values)
        i = synchronize(indices)
        if op == Average:
            v = v / size() if v.dtype.is_floating_point else torch.div(
                v, size(), rounding_mode="trunc")
        return torch.sparse_coo_tensor(i.t(), v, shape)

    return result


def poll(handle):
    """Whether ``handle``'s result is there (:func:`synchronize` will not block)."""
    if isinstance(handle, _Group):
        return all(poll(part) for part in handle._parts)
    return handle._native.poll()


def synchronize(handle):
    """Waits for ``handle`` and returns its result. Raises :class:`MismatchError` when the
    ranks submitted the tensor differently, :class:`RankFailedError` when a rank died or
    stopped answering (within ``RINGWATCH_COLLECTIVE_TIMEOUT_SECS``, never a hang)."""
    if not isinstance(handle, Handle):
        raise TypeError(f"synchronize expects a ringwatch Handle, got {type(handle).__name__}")
    if isinstance(handle, _Group):
        return [synchronize(part) for part in handle._parts]
    result = _result(handle)
    return handle._then(result) if handle._then is not None else result


def _result(handle):
    try:
        out = handle._native.wait()
    finally:
        # Failed or not, the name is free again once its handle is synchronized.
        with _inflight_lock:
            if _inflight.get(handle._native.name) is handle._native:
                del _inflight[handle._native.name]
    post = getattr(handle, "_postscale", 1.0)
    if out is None:
        if handle._gpu is not None:
            # A CUDA tensor's broadcast, staged through a host copy.
            return handle._gpu.copy_(handle._tensor)
        return _scale(handle._tensor, post)
    buf, shape = out
    if len(buf) == 0:
        result = torch.empty(shape, dtype=handle._dtype)
    else:
        result = torch.frombuffer(buf, dtype=handle._dtype).reshape(shape)
    if handle._gpu is not None:
        return result.to(handle._gpu.device)
    return result


def broadcast_parameters(params, root_rank=0):
    """Overwrites every rank's parameters with ``root_rank``'s, in place: ``params`` is a
    ``model.state_dict()``, a dict of tensors or an iterable of ``(name, tensor)`` (such as
    ``model.named_parameters()``). Tensors are broadcast together, fused by the runtime."""
    if isinstance(params, dict):
        items = sorted(params.items())
    else:
        items = list(params)
    handles = []
    for name, p in items:
        if p is None:
            continue
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"broadcast_parameters: '{name}' is a {type(p).__name__}, not a tensor")
        with torch.no_grad():
            handles.append(broadcast_async_(p.data, root_rank, name=f"broadcast.{name}"))
    for h in handles:
        synchronize(h)


class _Completer:
    """One daemon thread that waits for handles (without the GIL) and completes futures:
    how an asynchronous result reaches code that wants a ``torch.futures.Future``."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def submit(self, handle, future, transform):
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="ringwatch-completer", daemon=True
                )
                self._thread.start()
        self._queue.put((handle, future, transform))

    def _run(self):
        while True:
            handle, future, transform = self._queue.get()
            try:
                result = transform(synchronize(handle))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                future.set_exception(e)
            else:
                future.set_result(result)


_completer = _Completer()


# Last: they use the functions above.
from ringwatch.torch.optimizer import DistributedOptimizer, broadcast_optimizer_state  # noqa: E402
from ringwatch.torch.ddp import ddp_comm_hook  # noqa: E402
