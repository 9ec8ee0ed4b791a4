"""Training on ringwatch.torch gives the model that single-process training on the combined
batch gives (same seed, same data): the proof that the gradients are right."""

import json
import os
import subprocess
import sys

import pytest
import torch

TRAIN = r"""
import json, os, sys
import torch
import torch.nn.functional as F

MODE = os.environ["MODE"]          # single | optimizer | accumulate | ddp
DEVICE = os.environ.get("DEVICE", "cpu")
WIDE = os.environ.get("WIDE") == "1"    # a layer whose gradient (512 KiB) is reduced alone
SHARED = os.environ.get("SHARED", "1") == "1"
# Gradients dropped by the model rather than zeroed by the optimizer at every step.
ZERO_MODEL = os.environ.get("ZERO") == "model"
STEPS, PER_RANK = 6, 8
if DEVICE == "cuda":
    # TF32 rounds differently for different batch splits; the comparison needs full f32.
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.deterministic = True

def model_and_data(world):
    torch.manual_seed(0)
    head = [torch.nn.Linear(8 * 4 * 4, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)] \
        if WIDE else [torch.nn.Linear(8 * 4 * 4, 10)]
    model = torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(), torch.nn.Flatten(),
        *head,
    )
    g = torch.Generator().manual_seed(1)
    x = torch.randn(STEPS, world * PER_RANK, 3, 8, 8, generator=g)
    y = torch.randint(0, 10, (STEPS, world * PER_RANK), generator=g)
    return model.to(DEVICE), x.to(DEVICE), y.to(DEVICE)

if MODE == "single":
    world = int(os.environ["COMBINED"])
    model, x, y = model_and_data(world)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for s in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x[s]), y[s])
        loss.backward()
        opt.step()
        losses.append(loss.item())
else:
    import ringwatch.torch as rw
    if MODE == "ddp":
        import torch.distributed as dist
        dist.init_process_group("gloo")   # MASTER_PORT; ringwatch takes MASTER_PORT + 1
    rw.init()
    r, world = rw.rank(), rw.size()
    model, x, y = model_and_data(world)
    if r != 0:
        with torch.no_grad():             # broadcast_parameters must undo this
            for p in model.parameters():
                p.add_(1.0)
    rw.broadcast_parameters(model.state_dict(), root_rank=0)
    mine = slice(r * PER_RANK, (r + 1) * PER_RANK)
    if MODE == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(model, bucket_cap_mb=0.002)   # several buckets
        model.register_comm_hook(None, rw.ddp_comm_hook)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        passes = 2 if MODE == "accumulate" else 1
        opt = rw.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                      backward_passes_per_step=passes, shared_gradients=SHARED)
    losses = []
    for s in range(STEPS):
        if ZERO_MODEL:
            model.zero_grad(set_to_none=True)
        else:
            opt.zero_grad()
        if MODE == "accumulate":
            # Two micro-batches, gradients summed locally, one allreduce per step.
            half = PER_RANK // 2
            xs, ys = x[s][mine], y[s][mine]
            loss = 0
            for part in (slice(0, half), slice(half, PER_RANK)):
                part_loss = F.cross_entropy(model(xs[part]), ys[part]) / 2
                part_loss.backward()
                loss = loss + part_loss.detach()
        else:
            loss = F.cross_entropy(model(x[s][mine]), y[s][mine])
            loss.backward()
        opt.step()
        # The combined batch's loss: the mean of the ranks' means (equal shards).
        losses.append(rw.allreduce(loss.detach(), name=f"loss.{s}", op=rw.Average).item())
    if MODE == "ddp":
        model = model.module
    # Gradients that live in shared tensors now (DistributedOptimizer's shared_gradients).
    kept = getattr(opt, "_rw_shared", {})
    shared_grads = sum(1 for p in model.parameters()
                       if id(p) in kept and p.grad.data_ptr() == kept[id(p)].data_ptr())
    if MODE == "optimizer":
        # Optimizer state from rank 0 reaches every rank (momentum buffers included).
        opt2 = torch.optim.SGD(model.parameters(), lr=0.5 if r else 0.1, momentum=0.9)
        if r == 0:
            opt2.load_state_dict(opt.state_dict())
        rw.broadcast_optimizer_state(opt2, root_rank=0)
        assert opt2.param_groups[0]["lr"] == 0.1, opt2.param_groups[0]["lr"]
        for a, b in zip(opt2.state_dict()["state"].values(), opt.state_dict()["state"].values()):
            assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
    from ringwatch import _native
    steps_marked = _native.steps_marked()
    rw.shutdown()
params = [p.detach().double().flatten().tolist() for p in model.parameters()]
print(json.dumps({"losses": losses, "params": params,
                  "shared_grads": 0 if MODE == "single" else shared_grads,
                  "steps_marked": 0 if MODE == "single" else steps_marked}))
"""


def single_process(tmp_path, combined, device="cpu", wide=False):
    script = tmp_path / "single.py"
    script.write_text(TRAIN)
    env = dict(os.environ, MODE="single", COMBINED=str(combined), OMP_NUM_THREADS="1",
               DEVICE=device, WIDE="1" if wide else "0")
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


def assert_same_training(got, want):
    assert len(got["losses"]) == len(want["losses"])
    for s, (a, b) in enumerate(zip(got["losses"], want["losses"])):
        assert a == pytest.approx(b, rel=1e-5, abs=1e-6), f"step {s}: loss {a} vs {b}"
    for a, b in zip(got["params"], want["params"]):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), rtol=1e-4, atol=1e-5)
    # The model learned something, so the comparison is not between two untrained nets.
    assert got["losses"][-1] < got["losses"][0]


def test_distributed_optimizer_trains_like_one_process(run_job, tmp_path):
    results = run_job(TRAIN, 4, env={"MODE": "optimizer"}).results()
    want = single_process(tmp_path, 4)
    for res in results:
        assert_same_training(res, want)
        # Each step() marked a training step, which tuning sessions score.
        assert res["steps_marked"] == len(res["losses"]), res["steps_marked"]
    # Every rank holds the same model, bit for bit.
    assert all(res["params"] == results[0]["params"] for res in results)


@pytest.mark.parametrize("links", ["shm", "tcp"])
def test_shared_gradients_train_like_one_process_and_like_private_ones(run_job, tmp_path, links):
    # A layer's 512 KiB gradient is reduced alone: from the second step on it lives in
    # shared memory and folds in place across the ranks (over TCP it stays private).
    # Either way the same training as one process, and the same bits as private gradients.
    env = {"MODE": "optimizer", "WIDE": "1"}
    if links == "tcp":
        env["RINGWATCH_SHM"] = "0"
    shared = run_job(TRAIN, 2, env=env).results()
    private = run_job(TRAIN, 2, env=dict(env, SHARED="0")).results()
    want = single_process(tmp_path, 2, wide=True)
    for res in shared:
        assert_same_training(res, want)
        assert res["shared_grads"] == (1 if links == "shm" else 0), res["shared_grads"]
    assert [r["params"] for r in shared] == [r["params"] for r in private]
    assert [r["losses"] for r in shared] == [r["losses"] for r in private]
    assert all(r["shared_grads"] == 0 for r in private)
    if links == "shm":
        # A gradient that the model drops at every step is moved in twice, then left
        # private (a copy every step would cost what sharing saves): the same training.
        dropped = run_job(TRAIN, 2, env=dict(env, ZERO="model")).results()
        assert [r["params"] for r in dropped] == [r["params"] for r in private]
        assert all(r["shared_grads"] == 0 for r in dropped), dropped[0]["shared_grads"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
@pytest.mark.parametrize("mode", ["optimizer", "ddp"])
def test_training_on_a_gpu_is_like_one_process(run_job, tmp_path, mode):
    # Two ranks on the one GPU, the model there throughout: DistributedOptimizer's
    # gradients, or DDP's CUDA gradient buckets through the hook, staged through host
    # memory (the ranks share the GPU); the runtime waits for the producing stream first.
    # The optimizer state is broadcast through a host copy.
    results = run_job(TRAIN, 2, env={"MODE": mode, "DEVICE": "cuda"}).results()
    want = single_process(tmp_path, 2, device="cuda")
    for res in results:
        assert_same_training(res, want)
    assert results[0]["params"] == results[1]["params"]


def test_ddp_comm_hook_trains_like_one_process(run_job, tmp_path):
    results = run_job(TRAIN, 2, env={"MODE": "ddp"}).results()
    want = single_process(tmp_path, 2)
    for res in results:
        assert_same_training(res, want)
        # The last bucket of each backward pass marked a step.
        assert res["steps_marked"] == len(res["losses"]), res["steps_marked"]


def test_backward_passes_per_step_accumulates_locally(run_job, tmp_path):
    results = run_job(TRAIN, 2, env={"MODE": "accumulate"}).results()
    want = single_process(tmp_path, 2)
    for res in results:
        assert_same_training(res, want)
        # One step per step(), not per backward pass.
        assert res["steps_marked"] == len(res["losses"]), res["steps_marked"]
