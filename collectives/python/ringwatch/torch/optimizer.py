"""Horovod's ``DistributedOptimizer`` on the ringwatch runtime: every gradient is allreduced
as soon as backward produces it (a hook on its accumulator), so the runtime's cycle time and
tensor fusion shape a training step exactly as they do Horovod's.

Where the ranks of a host share memory, CPU gradients above 64 KiB are moved into shared
tensors (:func:`ringwatch.torch.shared_zeros`) after the first step and kept there:
``zero_grad`` zeroes them in place and backward accumulates into them, so their allreduces
fold in place across the ranks instead of being staged (the same bits either way)."""

import collections
import contextlib
import io
import warnings

import torch

import ringwatch.torch as rw


#: Gradients larger than this many bytes go into shared memory (smaller ones are reduced in
#: one shot, or packed with others, either way through the segment's slots).
SHARED_GRADIENT_MIN_BYTES = 64 << 10


class _DistributedOptimizer(torch.optim.Optimizer):
    """Mixed into the wrapped optimizer's own class (see :func:`DistributedOptimizer`), so
    that ``isinstance`` checks, LR schedulers and ``state_dict`` keep working."""

    def __init__(self, params, named_parameters, compression, op, backward_passes_per_step,
                 sparse_as_dense, shared_gradients):
        super(self.__class__, self).__init__(params)
        if backward_passes_per_step < 1:
            raise ValueError(
                f"backward_passes_per_step must be at least 1, not {backward_passes_per_step}"
            )
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            counts = collections.Counter(name for name, _ in named)
            twice = sorted(name for name, n in counts.items() if n > 1)
            if twice:
                raise ValueError(f"named_parameters names these more than once: {twice}")
            names = {id(p): name for name, p in named}
            unnamed = sum(1 for p in params if id(p) not in names)
            if unnamed:
                raise ValueError(
                    f"named_parameters does not name {unnamed} of the optimizer's "
                    f"{len(params)} parameters: pass model.named_parameters() of the model "
                    "whose parameters the optimizer updates"
                )
        else:
            names = {id(p): f"param.{i}" for i, p in enumerate(params)}
        self._rw_names = {id(p): f"allreduce.{names[id(p)]}" for p in params}
        # Horovod's attribute: each parameter's name (the same on every rank).
        self._parameter_names = {p: names[id(p)] for p in params}
        self._rw_params = [p for p in params if p.requires_grad]
        self._rw_op = op
        self._rw_compression = compression
        self._rw_sparse_as_dense = bool(sparse_as_dense)
        self._rw_passes = backward_passes_per_step
        self._rw_delay = {id(p): backward_passes_per_step for p in self._rw_params}
        self._rw_handles = {}
        self._rw_synchronized = False
        self._rw_grad_accs = []
        # id(p) -> the shared tensor that holds p's gradient from the second step on.
        self._rw_shared = {}
        # id(p) -> how often p's gradient had to be moved in: a gradient that something
        # else (model.zero_grad(set_to_none=True)) replaces at every step is left alone.
        self._rw_moves = collections.Counter()
        self._rw_sharing = bool(shared_gradients) and rw.size() > 1
        if rw.size() > 1:
            self._rw_register_hooks()

    def _rw_register_hooks(self):
        for p in self._rw_params:
            # The gradient accumulator of `p`: its hooks run once `p.grad` is final for this
            # backward pass (Horovod's way; works on every torch version).
            grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
            grad_acc.register_hook(self._rw_make_hook(p))
            self._rw_grad_accs.append(grad_acc)

    def _rw_make_hook(self, p):
        def hook(*_):
            key = id(p)
            if key in self._rw_handles:
                raise RuntimeError(
                    "a gradient was computed more than backward_passes_per_step="
                    f"{self._rw_passes} times before step(): raise backward_passes_per_step "
                    "to accumulate gradients locally"
                )
            self._rw_delay[key] -= 1
            if self._rw_delay[key] == 0:
                self._rw_handles[key] = self._rw_allreduce(p)

        return hook

    def _rw_allreduce(self, p):
        if p.grad is None:
            # Unused on this rank in this step, but maybe not on others: all ranks must
            # submit the same tensors, so it counts as a zero gradient (as in Horovod).
            p.grad = torch.zeros_like(p, memory_format=torch.contiguous_format)
        grad = p.grad
        name = self._rw_names[id(p)]
        if grad.is_sparse:
            if not self._rw_sparse_as_dense:
                # Indices and values gathered from every rank (Horovod's way): the handle
                # is a function that returns the sparse result.
                return p, None, rw.sparse_allreduce_async(grad, name=name, op=self._rw_op)
            grad = grad.to_dense()
        buf, ctx = self._rw_compression.compress(grad)
        if not buf.is_contiguous():
            buf = buf.contiguous()
        return p, (buf, ctx), rw.allreduce_async_(buf, name=name, op=self._rw_op)

    def synchronize(self):
        """Waits until every gradient is allreduced (``step()`` calls it; call it yourself
        before clipping gradients, and ``step()`` will not wait again)."""
        if rw.size() > 1:
            for p in self._rw_params:
                if id(p) not in self._rw_handles:
                    self._rw_handles[id(p)] = self._rw_allreduce(p)
            handles, self._rw_handles = self._rw_handles, {}
            for p, sent, handle in handles.values():
                if sent is None:
                    p.grad = handle()
                    continue
                rw.synchronize(handle)
                buf, ctx = sent
                out = self._rw_compression.decompress(buf, ctx)
                if p.grad.is_sparse:
                    # sparse_as_dense: the optimizer (SparseAdam) still wants it sparse.
                    p.grad = out.to_sparse()
                elif out is not p.grad:
                    p.grad.copy_(out)
                self._rw_share(p)
            for p in self._rw_params:
                self._rw_delay[id(p)] = self._rw_passes
        self._rw_synchronized = True

    def _rw_share(self, p):
        """Moves ``p``'s gradient into shared memory for the steps to come (where it stays:
        see ``zero_grad``), if it is a CPU gradient large enough and this host's ranks
        share memory; the values do not change."""
        grad = p.grad
        if (not self._rw_sharing or grad is None or grad.device.type != "cpu"
                or grad.is_sparse or self._rw_compression is not rw.Compression.none):
            return
        if grad.numel() * grad.element_size() <= SHARED_GRADIENT_MIN_BYTES:
            return
        if self._rw_moves[id(p)] > 2:
            return  # given up on (below)
        shared = self._rw_shared.get(id(p))
        if shared is None:
            if grad.dtype not in rw._DTYPES:
                return
            try:
                shared, is_shared = rw._shared_zeros(list(grad.shape), grad.dtype)
            except (ValueError, rw.RingwatchError) as e:
                # /dev/shm too small (a container's default is 64 MiB): private it is.
                warnings.warn(f"ringwatch: gradients stay private: {e}", RuntimeWarning)
                self._rw_sharing = False
                return
            if not is_shared:
                # No rank shares this host's memory: nothing to gain, stop trying.
                self._rw_sharing = False
                return
            self._rw_shared[id(p)] = shared
        if grad.data_ptr() != shared.data_ptr():
            self._rw_moves[id(p)] += 1
            if self._rw_moves[id(p)] > 2:
                # Replaced again since: a copy every step would cost what sharing saves.
                del self._rw_shared[id(p)]
                return
            shared.copy_(grad)
            p.grad = shared

    @contextlib.contextmanager
    def skip_synchronize(self):
        """Horovod's spelling of "``synchronize()`` was called already": ``step()`` inside
        does not wait for gradients again."""
        self._rw_synchronized = True
        yield

    def step(self, closure=None):
        if not self._rw_synchronized:
            self.synchronize()
        self._rw_synchronized = False
        result = super(self.__class__, self).step(closure)
        # A step ended: tuning sessions score the job by these marks.
        rw.mark_step()
        return result

    def zero_grad(self, *args, **kwargs):
        if self._rw_handles:
            raise RuntimeError(
                "zero_grad() while gradients are being allreduced: call step() or "
                "synchronize() first"
            )
        # Shared gradients stay where they are, zeroed (even with set_to_none): backward
        # then accumulates into them in place. Every parameter gets a gradient at every
        # step anyway (an unused one counts as zero, as in Horovod).
        kept = [
            (p, p.grad)
            for p in self._rw_params
            if p.grad is not None
            and id(p) in self._rw_shared
            and p.grad.data_ptr() == self._rw_shared[id(p)].data_ptr()
        ]
        result = super(self.__class__, self).zero_grad(*args, **kwargs)
        for p, grad in kept:
            if p.grad is None:
                grad.zero_()
                p.grad = grad
        return result


def DistributedOptimizer(
    optimizer, named_parameters=None, compression=None, backward_passes_per_step=1, op=None,
    gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
    *, shared_gradients=True
):
    """Wraps ``optimizer`` so that gradients are averaged over all ranks (``op``, default
    ``rw.Average``) while backward runs; ``step()`` waits for them, then steps. Horovod's
    arguments, in Horovod's order. Pass ``named_parameters=model.named_parameters()`` so
    that tensors carry their names (in the timeline and the agent's view).
    ``compression=rw.Compression.fp16`` sends floating-point gradients as float16. With
    ``backward_passes_per_step=N`` gradients of N backward passes are summed locally before
    one allreduce. Sparse gradients (``nn.Embedding(sparse=True)``) are gathered as indices
    and values from every rank (:func:`ringwatch.torch.sparse_allreduce_async`), or
    allreduced dense with ``sparse_as_dense=True``. ``gradient_predivide_factor``,
    ``num_groups`` and ``groups`` must stay at their defaults (not implemented: the runtime
    fuses by its fusion threshold). With ``shared_gradients`` (default; ringwatch's own,
    keyword only) CPU gradients above 64 KiB live in memory the host's ranks share from the
    second step on, and ``zero_grad`` zeroes them in place rather than dropping them."""
    if gradient_predivide_factor != 1.0 or num_groups != 0 or groups is not None:
        raise NotImplementedError(
            "DistributedOptimizer: gradient_predivide_factor, num_groups and groups are not "
            "implemented in ringwatch (the runtime fuses gradients by its fusion threshold)")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    cls = type(
        optimizer.__class__.__name__,
        (optimizer.__class__,),
        dict(_DistributedOptimizer.__dict__),
    )
    if op is not None and op not in (rw.Sum, rw.Average):
        # Adasum is refused here as everywhere; Min/Max/Product of gradients make no step.
        rw._op(op, None)
        raise ValueError(f"DistributedOptimizer: op must be Sum or Average, not {op!r}")
    return cls(
        optimizer.param_groups,
        named_parameters,
        rw.Compression.none if compression is None else compression,
        rw.Average if op is None else op,
        backward_passes_per_step,
        sparse_as_dense,
        shared_gradients,
    )


def broadcast_optimizer_state(optimizer, root_rank=0):
    """Gives every rank ``root_rank``'s optimizer state (hyperparameters and buffers such
    as momentum), whatever the optimizer: the root's ``state_dict()`` travels serialized."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
    if not optimizer.state_dict()["state"]:
        # A new optimizer has no state (momentum buffers) to send yet: as Horovod, make it
        # on every rank with one step of the wrapped optimizer on zero gradients (the
        # DistributedOptimizer's own step would allreduce). Like Horovod's, it sets every
        # gradient to zero and applies what a zero gradient does (weight decay, for one).
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad:
                    p.grad = torch.zeros_like(p)
        if hasattr(optimizer, "_rw_names"):
            super(optimizer.__class__, optimizer).step()
        else:
            optimizer.step()
    payload = torch.zeros(0, dtype=torch.int64)
    if rw.rank() == root_rank:
        out = io.BytesIO()
        torch.save(optimizer.state_dict(), out)
        data = out.getvalue()
        data += b"\0" * (-len(data) % 8)
        payload = torch.frombuffer(bytearray(data), dtype=torch.int64)
    length = rw.broadcast_(
        torch.tensor([payload.numel()], dtype=torch.int64),
        root_rank,
        name="broadcast.optimizer_state.length",
    )
    if rw.rank() != root_rank:
        payload = torch.zeros(int(length[0]), dtype=torch.int64)
    rw.broadcast_(payload, root_rank, name="broadcast.optimizer_state")
    if rw.rank() != root_rank:
        # On the host: load_state_dict moves each state tensor to its parameter's device
        # (the root's GPU index need not exist here, or be this rank's).
        state = torch.load(io.BytesIO(payload.numpy().tobytes()), map_location="cpu")
        optimizer.load_state_dict(state)
