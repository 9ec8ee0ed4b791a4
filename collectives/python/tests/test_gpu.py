"""CUDA tensors through ringwatch.torch, bit for bit against references computed on the CPU
(small integers, exact in every dtype whatever the order of reduction) and, for random
floats, against the same allreduce of CPU tensors (staged GPU tensors go through the same
rings). Skipped where torch sees no GPU; the CPU-only checks run everywhere."""

import pytest
import torch

import ringwatch.torch as rw
from ringwatch import _native

from _worker_helpers import WORKER_HELPERS

GPU = r"""
import json, os
import torch
import ringwatch.torch as rw
from ringwatch import _native

rw.init()
r, n = rw.rank(), rw.size()
dev = torch.device("cuda", 0)
""" + WORKER_HELPERS + r"""
for dtype in DTYPES:
    for shape in [(), (5,), (3, 17), (70001,)]:
        everyone = torch.stack([inputs(k, dtype, shape) for k in range(n)])
        for op in [rw.Sum, rw.Average, rw.Min, rw.Max]:
            t = inputs(r, dtype, shape).to(dev)
            out = rw.allreduce_(t, name=f"{dtype}.{shape}.{op}", op=op)
            check(out is t and t.is_cuda, f"{dtype} {shape} {op}: not in place")
            check(same_bits(t.cpu(), reference(everyone, op, dtype)),
                  f"{dtype} {shape} {op}: wrong {t.flatten()[:4].tolist()}")

# Many in flight at once, fused.
handles = [rw.allreduce_async_(inputs(r, torch.float32, (i + 1, 3)).to(dev), name=f"f{i}", op=rw.Sum)
           for i in range(30)]
for i, h in enumerate(handles):
    everyone = torch.stack([inputs(k, torch.float32, (i + 1, 3)) for k in range(n)])
    check(same_bits(rw.synchronize(h).cpu(), everyone.sum(0)), f"fused {i}")

# Random floats: the GPU tensor's bits are the CPU tensor's.
x = torch.randn(100003, generator=torch.Generator().manual_seed(r))
a = rw.allreduce(x.to(dev), name="rand.gpu", op=rw.Sum)
b = rw.allreduce(x, name="rand.cpu", op=rw.Sum)
if os.environ.get("EXPECT") == "staged" or n == 1:
    check(same_bits(a.cpu(), b), "random floats differ from the CPU path")

# A tensor written on a side stream: the runtime waits for the current stream.
s = torch.cuda.Stream()
with torch.cuda.stream(s):
    t = torch.full((1 << 22,), float(r + 1), device=dev)
    for _ in range(50):
        t = t * 1.0
    rw.allreduce_(t, name="stream", op=rw.Sum)
    check(bool((t == n * (n + 1) / 2).all().item()), "the side stream's work was not waited for")

# Broadcast and allgather of CUDA tensors (through a host copy).
bc = torch.full((7,), float(r), device=dev)
rw.broadcast_(bc, 0, name="bc")
check(bc.is_cuda and bool((bc == 0).all().item()), f"broadcast {bc.tolist()}")
g = rw.allgather(torch.full((r + 1, 2), float(r), device=dev), name="ag")
check(g.is_cuda and g.shape == (n * (n + 1) // 2, 2), f"allgather {g.shape} {g.device}")

nccl, staged = _native.gpu_totals()
rw.shutdown()
print(json.dumps({"failures": failures, "nccl": nccl, "staged": staged}))
"""

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@needs_gpu
def test_cuda_tensors_staged_with_two_ranks_on_one_gpu(run_job):
    results = run_job(GPU, 2, env={"EXPECT": "staged"}).results()
    for res in results:
        assert res["failures"] == [], res["failures"]
        assert res["staged"] > 0 and res["nccl"] == 0, res


@needs_gpu
def test_cuda_tensors_through_nccl_with_one_rank_per_gpu(run_job):
    n = torch.cuda.device_count()
    env = {} if n == 1 else {"CUDA_VISIBLE_DEVICES": "0"}
    results = run_job(GPU, 1, env=env).results()
    assert results[0]["failures"] == [], results[0]["failures"]
    assert results[0]["nccl"] > 0, results[0]


def test_a_cuda_tensor_without_a_gpu_gets_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert _native.has_cuda()
    # torch without CUDA cannot make a CUDA tensor; the native call with a made-up device
    # pointer must fail with the driver's absence named, before anything is enqueued.
    rw_native_error = None
    try:
        _native.enqueue_device("g", "float32", [4], 0x1000, 0, 0, object(), "sum")
    except Exception as e:  # noqa: BLE001 - any exception type, checked below
        rw_native_error = e
    assert rw_native_error is not None
    assert "libcuda.so" in str(rw_native_error), rw_native_error
