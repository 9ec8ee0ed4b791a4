"""ringwatch.torch's collectives against references computed another way (torch's own
reductions over every rank's inputs, which each rank can rebuild), bit for bit."""

import json

import pytest

from _worker_helpers import WORKER_HELPERS

COLLECTIVES = r"""
import json, hashlib
import torch
import ringwatch.torch as rw

rw.init()
r, n = rw.rank(), rw.size()
""" + WORKER_HELPERS + r"""
# Every dtype and op, in place, with shapes that fuse (small) and one that does not (large).
for dtype in DTYPES:
    for shape in [(), (5,), (3, 17), (70001,)]:
        everyone = torch.stack([inputs(k, dtype, shape) for k in range(n)])
        for op in [rw.Sum, rw.Average, rw.Min, rw.Max]:
            t = inputs(r, dtype, shape)
            ptr = t.data_ptr()
            out = rw.allreduce_(t, name=f"{dtype}.{shape}.{op}", op=op)
            check(out is t and t.data_ptr() == ptr, f"{dtype} {shape} {op}: not in place")
            check(same_bits(t, reference(everyone, op, dtype)), f"{dtype} {shape} {op}: wrong result {t.flatten()[:4]}")

# Many tensors in flight at once (fused into shared buffers), out of place.
handles, originals = [], []
for i in range(40):
    t = inputs(r, torch.float32, (i * 37 + 1,))
    originals.append(t.clone())
    handles.append((i, t, rw.allreduce_async(t, name=f"fused.{i}", op=rw.Sum)))
for i, t, h in handles:
    out = rw.synchronize(h)
    everyone = torch.stack([inputs(k, torch.float32, (i * 37 + 1,)) for k in range(n)])
    check(same_bits(out, everyone.sum(0)), f"fused.{i}: wrong result")
    check(torch.equal(t, originals[i]), f"fused.{i}: out-of-place allreduce changed its input")

# Random floats: every rank gets the same bits, close to a float64 reference.
gens = [torch.Generator().manual_seed(100 + k) for k in range(n)]
rand = [torch.randn(100_003, generator=g) for g in gens]
got = rw.allreduce(rand[r], name="random", op=rw.Sum)
ref = torch.stack(rand).to(torch.float64).sum(0)
check(torch.allclose(got.to(torch.float64), ref, rtol=1e-5, atol=1e-5), "random: far from float64")
gathered = rw.allgather(got.view(1, -1), name="random.gathered")
check(all(same_bits(gathered[k], got) for k in range(n)), "random: ranks disagree")

# Shared tensors: in place, the same bits as the ordinary tensor above (one host: folded
# straight from every rank's tensor; over TCP: an ordinary tensor), again and again.
s = rw.shared_zeros(100_003)
check(s.dtype == torch.float32 and s.shape == (100_003,) and not s.any(), "shared_zeros: not zeros")
for i in range(3):
    s.copy_(rand[r])
    ptr = s.data_ptr()
    out = rw.allreduce_(s, name="random.shared", op=rw.Sum)
    check(out is s and s.data_ptr() == ptr, "shared tensor: not in place")
    check(same_bits(s, got), f"shared tensor, call {i}: not the ordinary tensor's bits")
grads = rw.shared_zeros((3, 40_000), dtype=torch.float64)
grads += r + 1
rw.allreduce_(grads, name="shared.average", op=rw.Average)
check(torch.equal(grads, torch.full((3, 40_000), (n + 1) / 2, dtype=torch.float64)), "shared average")
del s, grads

# Async handles: poll, then synchronize.
h = rw.allreduce_async_(torch.ones(3), name="polled", op=rw.Sum)
while not rw.poll(h):
    pass
check(torch.equal(rw.synchronize(h), torch.full((3,), float(n))), "polled: wrong result")

# Allgather with a first dimension that differs by rank, every dtype.
for dtype in DTYPES:
    mine = torch.full((r + 1, 3), r, dtype=dtype)
    out = rw.allgather(mine, name=f"allgather.{dtype}")
    ref = torch.cat([torch.full((k + 1, 3), k, dtype=dtype) for k in range(n)])
    check(same_bits(out, ref), f"allgather {dtype}: wrong result")
empty = rw.allgather(torch.zeros((0, 2)), name="allgather.empty")
check(empty.shape == (0, 2), f"allgather of empty tensors: shape {tuple(empty.shape)}")

# Broadcast from the last rank, in place and out of place.
root = n - 1
t = torch.arange(10, dtype=torch.int64) * (r + 1)
rw.broadcast_(t, root, name="bcast")
check(torch.equal(t, torch.arange(10) * n), "broadcast_: wrong result")
src = torch.full((4,), float(r))
out = rw.broadcast(src, root, name="bcast.copy")
check(torch.equal(out, torch.full((4,), float(root))) and torch.equal(src, torch.full((4,), float(r))),
      "broadcast: wrong result or changed input")

# broadcast_parameters: every rank ends with rank 0's model.
torch.manual_seed(r)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
rw.broadcast_parameters(model.state_dict(), root_rank=0)
digest = hashlib.sha256()
for name, p in sorted(model.state_dict().items()):
    digest.update(name.encode())
    digest.update(p.detach().numpy().tobytes())

rw.shutdown()
print(json.dumps({"rank": r, "failures": failures, "params": digest.hexdigest()}))
"""


@pytest.mark.parametrize("links", ["shm", "tcp"])
def test_collectives_bitwise_against_torch(run_job, links):
    env = {"RINGWATCH_SHM": "0"} if links == "tcp" else {}
    results = run_job(COLLECTIVES, 4, env=env).results()
    for res in results:
        assert res["failures"] == [], f"rank {res['rank']}: {res['failures']}"
    # broadcast_parameters made every rank's model rank 0's (seeded differently before).
    assert len({res["params"] for res in results}) == 1


ERRORS = r"""
import json, time
import torch
import ringwatch
import ringwatch.torch as rw

rw.init()
r = rw.rank()
seen = {}

def expect(name, exc, fn):
    try:
        fn()
    except exc as e:
        seen[name] = str(e)
    else:
        seen[name] = "no error"

# Refused on this rank alone, before anything is sent.
expect("non_contiguous", ValueError, lambda: rw.allreduce_(torch.ones(4, 4).t(), name="nc"))
expect("dtype", TypeError, lambda: rw.allreduce_(torch.ones(4, dtype=torch.complex64), name="c64"))
expect("not_tensor", TypeError, lambda: rw.allreduce_([1.0, 2.0], name="list"))
h = rw.allreduce_async_(torch.ones(2), name="twice")
expect("in_flight", ValueError, lambda: rw.allreduce_async_(torch.ones(2), name="twice"))
rw.synchronize(h)
expect("waited_twice", ringwatch.RingwatchError, lambda: rw.synchronize(h))
expect("bad_root", ValueError, lambda: rw.broadcast_(torch.ones(2), root_rank=-1, name="root"))

# Shapes that differ across ranks: the runtime's error names the tensor and the ranks.
expect("mismatch", rw.MismatchError,
       lambda: rw.allreduce_(torch.ones(3 + r), name="grad.fc.weight"))
# The job goes on after a mismatch.
ok = rw.allreduce_(torch.ones(2), name="after", op=rw.Sum)
seen["after"] = ok.tolist()
rw.shutdown()
expect("after_shutdown", ringwatch.NotInitializedError, lambda: rw.rank())
print(json.dumps({"rank": r, "seen": seen}))
"""


def test_errors_are_clear_python_exceptions(run_job):
    results = run_job(ERRORS, 2).results()
    for res in results:
        seen = res["seen"]
        assert "contiguous" in seen["non_contiguous"], seen
        assert "complex64" in seen["dtype"], seen
        assert "torch.Tensor" in seen["not_tensor"], seen
        assert "already in flight" in seen["in_flight"], seen
        assert "already waited" in seen["waited_twice"], seen
        assert "root_rank" in seen["bad_root"], seen
        assert "grad.fc.weight" in seen["mismatch"], seen
        assert "[3] on ranks [0]" in seen["mismatch"] and "[4] on ranks [1]" in seen["mismatch"], seen
        assert seen["after"] == [2.0, 2.0], seen
        assert "init()" in seen["after_shutdown"], seen


DEAD_RANK = r"""
import json, os, time
import torch
import ringwatch.torch as rw

rw.init()
r = rw.rank()
rw.allreduce_(torch.ones(8), name="warmup")
# Rank 2 dies only once the others hold the warmup's result (see RAISING_RANK).
ready = os.environ["WARMED_UP"]
if r < 2:
    open(f"{ready}.{r}", "w").close()
if r == 2:
    while not (os.path.exists(f"{ready}.0") and os.path.exists(f"{ready}.1")):
        time.sleep(0.01)
    os._exit(3)  # dies without a word, as a killed process does
start = time.monotonic()
try:
    for i in range(1000):
        rw.allreduce_(torch.ones(1024), name=f"step.{i}")
    outcome = "no error"
except rw.RankFailedError as e:
    outcome = str(e)
print(json.dumps({"rank": r, "error": outcome, "seconds": time.monotonic() - start}))
"""


def test_a_dead_rank_raises_instead_of_hanging(run_job, tmp_path):
    job = run_job(DEAD_RANK, 3, env={"RINGWATCH_COLLECTIVE_TIMEOUT_SECS": "5",
                                     "WARMED_UP": str(tmp_path / "warmed-up")}, check=False)
    assert job.procs[2].returncode == 3, job.describe()
    for rank in (0, 1):
        assert job.procs[rank].returncode == 0, job.describe()
        lines = [l for l in job.outputs[rank][0].splitlines() if l.strip()]
        res = json.loads(lines[-1])
        assert "rank 2" in res["error"], res


RAISING_RANK = r"""
import json, os, time
import torch
import ringwatch.torch as rw

rw.init()
r = rw.rank()
rw.allreduce_(torch.ones(8), name="warmup")
# Rank 1 raises only once rank 0 holds the warmup's result: a rank can finish a collective
# while another still copies its result out, and leaving then fails that one there.
ready = os.environ["WARMED_UP"]
if r == 0:
    open(ready, "w").close()
if r == 1:
    while not os.path.exists(ready):
        time.sleep(0.01)
    raise ValueError("bad batch 17")
try:
    for i in range(1000):
        rw.allreduce_(torch.ones(1024), name=f"step.{i}")
    outcome = "no error"
except rw.RankFailedError as e:
    outcome = str(e)
print(json.dumps({"rank": r, "error": outcome}))
"""


def test_an_exception_on_one_rank_reaches_the_others_with_its_reason(run_job, tmp_path):
    # The peer timeout is long: the others must hear of the exception from the
    # rank itself, not from a timeout (whose message names no exception).
    job = run_job(RAISING_RANK, 2, env={"RINGWATCH_COLLECTIVE_TIMEOUT_SECS": "600",
                                        "WARMED_UP": str(tmp_path / "warmed-up")}, check=False)
    assert job.procs[1].returncode != 0, job.describe()
    assert "ValueError: bad batch 17" in job.outputs[1][1], job.describe()
    assert job.procs[0].returncode == 0, job.describe()
    lines = [l for l in job.outputs[0][0].splitlines() if l.strip()]
    res = json.loads(lines[-1])
    assert "rank 1" in res["error"] and "exception ValueError: bad batch 17" in res["error"], res


AUTOGRAD = r"""
import json
import torch
import ringwatch.torch as rw

rw.init()
r, n = rw.rank(), rw.size()
out = {}
for op in (rw.Sum, rw.Average):
    x = torch.full((3,), float(r + 1), requires_grad=True)
    y = rw.allreduce(x, name="y." + op, op=op)
    # Each rank weighs the result by its own factor; the gradient of the sum of
    # the ranks' losses with respect to x_r is the op of the factors.
    (y * (r + 1)).sum().backward()
    out[op] = {"y": y.tolist(), "grad": x.grad.tolist(), "requires_grad": y.requires_grad}
z = rw.allreduce(torch.ones(2, requires_grad=True), name="z", op=rw.Max)
out["max_requires_grad"] = z.requires_grad
# Allgather: y = [x_0; x_1]; loss_r = sum((k+1) * y) over rows of rank k; the gradient
# of x_r is the average over ranks of their gradients of its rows (Horovod's).
x = torch.full((r + 1, 2), 1.0, requires_grad=True)
g = rw.allgather(x, name="g")
w = torch.cat([torch.full((k + 1, 2), float(k + 1)) for k in range(n)])
(g * w * (r + 1)).sum().backward()
out["allgather_grad"] = x.grad.tolist()
# Broadcast from 0: the root gets the average of the ranks' gradients, the others zero.
b = torch.full((2,), 5.0, requires_grad=True)
rw.broadcast(b, 0, name="b").mul(r + 1).sum().backward()
out["broadcast_grad"] = b.grad.tolist()
rw.shutdown()
print(json.dumps({"rank": r, "out": out}))
"""


def test_allreduce_is_differentiable_like_horovods(run_job):
    for res in run_job(AUTOGRAD, 2).results():
        out = res["out"]
        # Sum: y = x0 + x1 = 3; d(sum_k (k+1) y)/dx_r = 1 + 2 = 3.
        assert out["sum"] == {"y": [3.0] * 3, "grad": [3.0] * 3, "requires_grad": True}, out
        # Average: y = 1.5; gradient (1 + 2) / 2 = 1.5.
        assert out["average"] == {"y": [1.5] * 3, "grad": [1.5] * 3, "requires_grad": True}, out
        # As Horovod: every op goes through autograd (backward reduces with the same op).
        assert out["max_requires_grad"] is True, out
        r = res["rank"]
        # Rows of rank r weigh (r + 1) · (1 + 2) / 2 = 1.5 (r + 1).
        assert out["allgather_grad"] == [[1.5 * (r + 1)] * 2] * (r + 1), out
        assert out["broadcast_grad"] == ([1.5, 1.5] if r == 0 else [0.0, 0.0]), out


HOROVOD_API = r"""
import json, warnings
import torch
import ringwatch.torch as rw

rw.init()
r, n = rw.rank(), rw.size()
out = {}
# Horovod's positional order (tensor, average, name, op) and the deprecated average=.
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    s = rw.allreduce(torch.tensor([r + 1.0]), False, "positional")
out["positional_sum"] = s.tolist()
out["deprecation"] = [str(w.message) for w in caught if w.category is DeprecationWarning]
try:
    rw.allreduce(torch.ones(1), average=True, op=rw.Sum)
    out["both"] = None
except ValueError as e:
    out["both"] = str(e)
# Scale factors: (sum of 3 (r + 1)) / 2.
out["scaled"] = rw.allreduce(torch.tensor([r + 1.0]), name="scaled", op=rw.Sum,
                             prescale_factor=3.0, postscale_factor=0.5).tolist()
t = torch.tensor([r + 2], dtype=torch.int64)
rw.allreduce_(t, name="scaled.int", op=rw.Sum, prescale_factor=1.5)
out["scaled_int"] = t.tolist()
# 16-bit floats scale through float32, as Horovod's (numpy's float32 here).
import numpy as np
h = rw.allreduce(torch.tensor([-55.0], dtype=torch.float16), name="scaled.half", op=rw.Sum,
                 prescale_factor=0.9123)
want = np.float16(np.float32(np.float16(-55.0)) * np.float32(0.9123))
out["scaled_half"] = [h.item(), float(np.float16(want + want))]
out["product"] = rw.allreduce(torch.tensor([r + 2, -(r + 1)], dtype=torch.int16), name="prod",
                              op=rw.Product).tolist()
# Small integer dtypes: wrapping sums, min, allgather and broadcast.
out["u8_sum"] = rw.allreduce(torch.tensor([250, 3], dtype=torch.uint8), name="u8",
                             op=rw.Sum).tolist()
out["i8_min"] = rw.allreduce(torch.tensor([-100 * r, r], dtype=torch.int8), name="i8",
                             op=rw.Min).tolist()
out["i16_gather"] = rw.allgather(torch.full((r + 1,), r, dtype=torch.int16), name="ag16").tolist()
out["u8_bcast"] = rw.broadcast(torch.tensor([r, 200], dtype=torch.uint8), 1, name="bc8").tolist()
# fp16 compression: sent as float16, given back as float32.
c = rw.allreduce(torch.tensor([0.5 * (r + 1)]), name="fp16", op=rw.Sum,
                 compression=rw.Compression.fp16)
out["fp16"] = [c.dtype == torch.float32, c.tolist()]
rw.barrier()
out["object"] = rw.broadcast_object({"epoch": 7, "lr": [0.1, r]} if r == 0 else {}, 0)
out["objects"] = rw.allgather_object(("rank", r, "x" * (100 * r)))
out["queries"] = [rw.mpi_built(), rw.gloo_built(), rw.ccl_built(), rw.nccl_built()]
rw.barrier()
rw.shutdown()
print(json.dumps({"rank": r, "out": out}))
"""


def test_horovods_signatures_dtypes_scale_factors_objects_and_barrier(run_job):
    for res in run_job(HOROVOD_API, 2).results():
        out, r = res["out"], res["rank"]
        assert out["positional_sum"] == [3.0], out
        assert any("average" in m for m in out["deprecation"]), out
        assert "supersedes average" in out["both"], out
        assert out["scaled"] == [(3 * 1 + 3 * 2) * 0.5], out
        # Integers scale through float64, truncated: int(2 · 1.5) + int(3 · 1.5) = 3 + 4.
        assert out["scaled_int"] == [7], out
        assert out["scaled_half"][0] == out["scaled_half"][1], out
        assert out["product"] == [2 * 3, (-1) * (-2)], out
        assert out["u8_sum"] == [(250 * 2) % 256, 6], out
        assert out["i8_min"] == [-100, 0], out
        assert out["i16_gather"] == [0, 1, 1], out
        assert out["u8_bcast"] == [1, 200], out
        assert out["fp16"] == [True, [1.5]], out
        assert out["object"] == {"epoch": 7, "lr": [0.1, 0]}, out
        assert out["objects"] == [["rank", 0, ""], ["rank", 1, "x" * 100]], out
        assert out["queries"][:3] == [False, False, False], out


COMPOSED = r"""
import json
import torch
import ringwatch.torch as rw

rw.init()
r, n = rw.rank(), rw.size()
""" + WORKER_HELPERS + r"""
# Reducescatter: this rank's rows of the reduction (Horovod's split: the first rows % n
# ranks get one more), for rows that divide and rows that do not; every dtype.
def rows_of(rows, k):
    base, extra = divmod(rows, n)
    return k * base + min(k, extra), base + (1 if k < extra else 0)

for dtype in DTYPES:
    for shape in [(n * 4,), (n * 4 + 1, 3), (2 * n - 1, 2, 5), (1, 4)]:
        everyone = torch.stack([inputs(k, dtype, shape) for k in range(n)])
        for op in [rw.Sum, rw.Average]:
            t = inputs(r, dtype, shape)
            before = t.clone()
            got = rw.reducescatter(t, name=f"rs.{dtype}.{shape}.{op}", op=op)
            first, count = rows_of(shape[0], r)
            want = reference(everyone, op, dtype).narrow(0, first, count)
            check(same_bits(got, want), f"reducescatter {dtype} {shape} {op}: {got.flatten()[:4]}")
            check(same_bits(t, before), f"reducescatter {dtype} {shape} {op}: changed its input")

# Grouped: several tensors in one call, each as the single call gives it.
ts = [inputs(r, torch.float32, (i + 1, 3)) for i in range(5)]
everyone = [torch.stack([inputs(k, torch.float32, (i + 1, 3)) for k in range(n)]) for i in range(5)]
for got, e in zip(rw.grouped_allreduce(ts, name="g.ar", op=rw.Sum), everyone):
    check(same_bits(got, e.sum(0)), "grouped_allreduce: wrong result")
inplace = [t.clone() for t in ts]
rw.grouped_allreduce_(inplace, name="g.ar_", op=rw.Max)
for got, e in zip(inplace, everyone):
    check(same_bits(got, e.max(0).values), "grouped_allreduce_: wrong result")
h = rw.grouped_allgather_async(ts, name="g.ag")
for got, e in zip(rw.synchronize(h), everyone):
    check(same_bits(got, torch.cat(list(e), 0)), "grouped_allgather: wrong result")
for i, (got, e) in enumerate(zip(rw.grouped_reducescatter(ts, name="g.rs", op=rw.Sum), everyone)):
    first, count = rows_of(i + 1, r)
    check(same_bits(got, e.sum(0).narrow(0, first, count)), f"grouped_reducescatter {i}")

# Alltoall with uneven splits: rank k sends (k + j + 1) rows to rank j, tagged with
# (sender, receiver, row), and keeps two rows that no one gets.
def block(k):
    rows = [[k, j, i] for j in range(n) for i in range(k + j + 1)]
    return torch.tensor(rows + [[-1, -1, -1]] * 2, dtype=torch.int64)

t = block(r)
splits = torch.tensor([r + j + 1 for j in range(n)], dtype=torch.int32)
got, received = rw.alltoall(t, splits, name="a2a")
want = torch.cat([block(k)[sum(k + j + 1 for j in range(r)):][: k + r + 1] for k in range(n)])
check(same_bits(got, want), f"alltoall: {got.tolist()}")
check(received.dtype == torch.int32 and received.tolist() == [k + r + 1 for k in range(n)],
      f"alltoall received splits: {received}")
# Equal splits, no splits given: only the rows.
eq = torch.arange(n * 2, dtype=torch.float32) + 100 * r
got = rw.alltoall(eq, name="a2a.eq")
check(isinstance(got, torch.Tensor) and got.tolist() == [100.0 * k + 2 * r + i for k in range(n) for i in range(2)],
      f"alltoall equal: {got}")

# Gradients, as Horovod's: reducescatter's is the allgather (times n for Sum); alltoall's
# is the alltoall back.
x = torch.ones(n * 2, 3, requires_grad=True)
rw.reducescatter(x, name="rs.grad", op=rw.Sum).sum().backward()
check(x.grad.tolist() == [[float(n)] * 3] * (n * 2), f"reducescatter grad: {x.grad}")
y = (torch.arange(n * 2, dtype=torch.float64) + 10 * r).requires_grad_()
out = rw.alltoall(y, name="a2a.grad")
(out * (r + 1)).sum().backward()
check(y.grad.tolist() == [float(j + 1) for j in range(n) for _ in range(2)], f"alltoall grad: {y.grad}")

# Errors, as Horovod's: raised on every rank, nothing left in flight.
errors = {}
for what, fn in [
    ("rs_scalar", lambda: rw.reducescatter(torch.tensor(1.0), name="e1")),
    ("rs_min", lambda: rw.reducescatter(torch.ones(n), name="e2", op=rw.Min)),
    ("rs_adasum", lambda: rw.reducescatter(torch.ones(n), name="e3", op=rw.Adasum)),
    ("ar_adasum", lambda: rw.allreduce(torch.ones(n), name="e4", op=rw.Adasum)),
    ("a2a_uneven", lambda: rw.alltoall(torch.ones(n + 1), name="e5")),
    ("a2a_too_many", lambda: rw.alltoall(torch.ones(n - 1), torch.ones(n, dtype=torch.int32), name="e6")),
    ("a2a_float_splits", lambda: rw.alltoall(torch.ones(n), torch.ones(n), name="e7")),
    ("rs_mismatch", lambda: rw.reducescatter(torch.ones(n + r), name="e8")),
    ("a2a_dtype", lambda: rw.alltoall(torch.ones(n, dtype=torch.float32 if r else torch.int32), name="e9")),
]:
    try:
        fn()
        errors[what] = None
    except Exception as e:
        errors[what] = type(e).__name__
# A name still in flight cannot be submitted again (Horovod's ValueError); once
# synchronized, it can.
first = rw.allreduce_async(torch.ones(1), name="dup", op=rw.Sum)
try:
    rw.allreduce_async(torch.ones(1), name="dup", op=rw.Sum)
    errors["dup"] = None
except ValueError as e:
    errors["dup"] = "ValueError"
# Refused even once the first has finished in the runtime: until it is synchronized.
rw.barrier()
try:
    rw.allreduce_async(torch.ones(1), name="dup", op=rw.Sum)
    errors["dup_finished"] = None
except ValueError as e:
    errors["dup_finished"] = "ValueError"
check(rw.synchronize(first).tolist() == [float(n)], "dup: first result")
errors["dup_after"] = rw.allreduce(torch.ones(1), name="dup", op=rw.Sum).tolist()
# A failed collective frees its name too.
try:
    rw.allreduce(torch.ones(1 + r), name="dup.failed", op=rw.Sum)
except rw.MismatchError:
    pass
errors["failed_again"] = rw.allreduce(torch.ones(1), name="dup.failed", op=rw.Sum).tolist()
rw.shutdown()
print(json.dumps({"rank": r, "failures": failures, "errors": errors}))
"""


def test_reducescatter_alltoall_and_grouped_ops_bitwise_against_references(run_job):
    """Horovod's reducescatter, alltoall and grouped collectives (composed of allreduce
    and allgather) on 3 ranks, so rows split unevenly."""
    for res in run_job(COMPOSED, 3).results():
        assert res["failures"] == [], res["failures"]
        assert res["errors"] == {
            "rs_scalar": "ValueError",
            "rs_min": "RuntimeError",
            "rs_adasum": "RuntimeError",
            "ar_adasum": "NotImplementedError",
            "a2a_uneven": "ValueError",
            "a2a_too_many": "ValueError",
            "a2a_float_splits": "ValueError",
            "rs_mismatch": "MismatchError",
            "a2a_dtype": "MismatchError",
            "dup": "ValueError",
            "dup_finished": "ValueError",
            "dup_after": [3.0],
            "failed_again": [3.0],
        }, res["errors"]


JOIN = r"""
import json
import torch
import ringwatch.torch as rw

rw.init()
r, n = rw.rank(), rw.size()
""" + WORKER_HELPERS + r"""
# Uneven data: rank 0 runs out after 1 step, rank 2 after 2, rank 1 after 3.
STEPS = [1, 3, 2]
OPS = [rw.Sum, rw.Average, rw.Min, rw.Max]

def joined_view(i, dtype, shape):
    # What every rank holds at step i: its input, or zeros once it has joined.
    return torch.stack([inputs(k + 3 * i, dtype, shape) if STEPS[k] > i
                        else torch.zeros(shape, dtype=dtype) for k in range(n)])

# A model trained with DistributedOptimizer (shared gradients after its first step);
# integer inputs keep every gradient sum exact.
torch.manual_seed(0)
model = torch.nn.Linear(4, 1, bias=False)
with torch.no_grad():
    model.weight.zero_()
opt = rw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1.0),
                              named_parameters=model.named_parameters())
expected_weight = torch.zeros(1, 4)
errors = {}
for i in range(STEPS[r]):
    handles = []
    for dtype in DTYPES:
        for op in OPS:
            t = inputs(r + 3 * i, dtype, (5, 3))
            handles.append((dtype, op, rw.allreduce_async(t, name=f"s{i}.{dtype}.{op}", op=op)))
    for dtype, op, h in handles:
        check(same_bits(rw.synchronize(h), reference(joined_view(i, dtype, (5, 3)), op, dtype)),
              f"step {i}: {dtype} {op}")
    x = inputs(r + 3 * i, torch.float32, (2, 4))
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    grads = torch.stack([inputs(k + 3 * i, torch.float32, (2, 4)).sum(0, keepdim=True)
                         if STEPS[k] > i else torch.zeros(1, 4) for k in range(n)])
    expected_weight.add_(grads.sum(0) / n, alpha=-1.0)
    check(same_bits(model.weight.detach(), expected_weight), f"step {i}: optimizer")
    if i == 1:
        # Rank 0 has joined: allgather and broadcast fail on the others, naming it.
        for what, fn in [("allgather", lambda: rw.allgather(torch.ones(2), name="g")),
                         ("broadcast", lambda: rw.broadcast(torch.ones(2), 1, name="b"))]:
            try:
                fn()
                errors[what] = None
            except rw.MismatchError as e:
                errors[what] = "[0] have joined" in str(e)
last = rw.join()
# Everything works as before once all have joined, the response cache included.
after = [rw.allreduce(torch.ones(3), name="after", op=rw.Sum).tolist() for _ in range(3)]
again = rw.join()
rw.shutdown()
print(json.dumps({"rank": r, "failures": failures, "errors": errors, "last": last,
                  "after": after, "again": again}))
"""


def test_join_lets_ranks_with_less_data_stop_while_the_others_allreduce_with_their_zeros(run_job):
    """Horovod's join on 3 ranks with uneven data: a joined rank adds zeros to the others'
    allreduces (every dtype and op, fused, and the optimizer's shared gradients) bit for
    bit as the reference says, their allgathers and broadcasts fail naming it, and join
    returns the last rank to join, the same everywhere."""
    results = run_job(JOIN, 3).results()
    for res in results:
        assert res["failures"] == [], res["failures"]
        assert res["errors"] == ({} if res["rank"] == 0 else
                                 {"allgather": True, "broadcast": True}), res["errors"]
        assert res["last"] == 1, res
        assert res["after"] == [[3.0, 3.0, 3.0]] * 3, res
    assert len({res["again"] for res in results}) == 1, results


SPARSE = r"""
import json
import torch
import ringwatch.torch as rw

rw.init()
r, n = rw.rank(), rw.size()
failures = []
def check(ok, what):
    if not ok:
        failures.append(what)

# Each rank's rows of a 10x3 table: a different number of them, some repeated, integer
# values (exact in every order of summation).
def rows(k):
    return [(3 * k + j * j) % 10 for j in range(2 + k)]

def sparse_of(k):
    idx = torch.tensor([rows(k)])
    vals = torch.stack([torch.full((3,), float(k * 10 + j)) for j in range(len(rows(k)))])
    return torch.sparse_coo_tensor(idx, vals, (10, 3))

dense_sum = sum(sparse_of(k).to_dense() for k in range(n))
got = rw.sparse_allreduce_async(sparse_of(r), name="sp", op=rw.Sum)()
check(got.is_sparse and torch.equal(got.to_dense(), dense_sum), "sparse sum")
check(got._nnz() == sum(len(rows(k)) for k in range(n)), "every rank's entries")
avg = rw.sparse_allreduce_async(sparse_of(r), name="sp.avg", op=rw.Average)()
check(torch.equal(avg._values(), got._values() / n), "average divides by size")
errors = {}
for what, fn in [("dense", lambda: rw.sparse_allreduce_async(torch.ones(2), name="x")),
                 ("min", lambda: rw.sparse_allreduce_async(sparse_of(r), name="y", op=rw.Min))]:
    try:
        fn()
        errors[what] = None
    except Exception as e:
        errors[what] = type(e).__name__

# An embedding with sparse gradients, summed over the ranks three ways: sparse (gathered),
# dense, and dense through float16 (small integers: exact).
counts = torch.zeros(10)
for k in range(n):
    for i in rows(k):
        counts[i] += 1
for mode in ["sparse", "sparse_as_dense", "fp16"]:
    emb = torch.nn.Embedding(10, 3, sparse=True)
    with torch.no_grad():
        emb.weight.zero_()
    opt = rw.DistributedOptimizer(
        torch.optim.SGD(emb.parameters(), lr=1.0), named_parameters=emb.named_parameters(),
        op=rw.Sum, sparse_as_dense=mode != "sparse",
        compression=rw.Compression.fp16 if mode == "fp16" else rw.Compression.none)
    opt.zero_grad()
    emb(torch.tensor(rows(r))).sum().backward()
    opt.step()
    check(torch.equal(emb.weight.detach(), -counts[:, None].expand(10, 3)), f"embedding: {mode}")
rw.shutdown()
print(json.dumps({"rank": r, "failures": failures, "errors": errors}))
"""


def test_sparse_gradients_are_summed_over_the_ranks_as_a_dense_reference_says(run_job):
    """Horovod's sparse allreduce (indices and values gathered) and DistributedOptimizer's
    sparse gradients, sparse or as dense, against the dense sum over every rank's input."""
    for res in run_job(SPARSE, 3).results():
        assert res["failures"] == [], res["failures"]
        assert res["errors"] == {"dense": "TypeError", "min": "ValueError"}, res["errors"]
