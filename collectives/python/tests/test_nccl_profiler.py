"""ringwatch's NCCL profiler plugin inside a real PyTorch job on NCCL: every
`all_reduce` the job makes is one record, with NCCL's bytes and, from NCCL
2.27 on, the GPU kernel's own start and stop. The plugin's records go to a
stand-in agent (a Unix socket that answers the hello and keeps the lines);
the agent's side is tested in `agent/tests/nccl_profiler.rs`.

NCCL runs only on CUDA devices: without a GPU this test is skipped, saying
so (CI has none; it runs where a GPU is lent). `RINGWATCH_NCCL_PROFILER_LIB`
names the built library (`cargo xtask test` sets it)."""

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

PLUGIN = os.environ.get("RINGWATCH_NCCL_PROFILER_LIB", "")

pytestmark = [
    pytest.mark.skipif(
        not torch.cuda.is_available(),
        reason="no GPU: NCCL runs only on CUDA devices (this test runs where a GPU is lent)",
    ),
    pytest.mark.skipif(
        not os.path.isfile(PLUGIN),
        reason="RINGWATCH_NCCL_PROFILER_LIB does not name the built plugin (cargo xtask test sets it)",
    ),
]

JOB = r"""
import json, os, sys, time
import torch, torch.distributed as dist
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:" + os.environ["PORT"], rank=0, world_size=1)
t = torch.ones(1 << 20, device="cuda")       # 4 MiB of float32
n = int(os.environ["N"])
for _ in range(3):                            # NCCL's own warm-up
    dist.all_reduce(t)
torch.cuda.synchronize()
start = time.perf_counter()
for _ in range(n):
    dist.all_reduce(t)
torch.cuda.synchronize()
elapsed = time.perf_counter() - start
nccl = ".".join(map(str, torch.cuda.nccl.version()))
dist.destroy_process_group()
print(json.dumps({"calls": n + 3, "seconds": elapsed, "nccl": nccl}))
"""


class FakeAgent:
    """A Unix socket that answers the plugin's hello and keeps every line."""

    def __init__(self, path):
        self.lines = []
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(16)
        threading.Thread(target=self.serve, daemon=True).start()

    def serve(self):
        while True:
            conn, _ = self.sock.accept()
            threading.Thread(target=self.read, args=(conn,), daemon=True).start()

    def read(self, conn):
        f = conn.makefile("rb")
        f.readline()
        conn.sendall(b'{"ok":true,"proto":1}\n')
        for line in f:
            self.lines.append(json.loads(line))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp_path, n, plugin_on):
    env = dict(os.environ, PORT=str(free_port()), N=str(n), NCCL_PROFILER_PLUGIN=PLUGIN,
               RINGWATCH_NCCL_PROFILER_SOCKET=str(tmp_path / "agent.socket"))
    if not plugin_on:
        env["RINGWATCH_NCCL_PROFILER"] = "off"
    out = subprocess.run([sys.executable, "-c", JOB], env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_all_reduce_is_one_record_with_nccls_bytes_and_gpu_times(tmp_path):
    agent = FakeAgent(str(tmp_path / "agent.socket"))
    n = 200
    job = run_job(tmp_path, n, plugin_on=True)
    deadline = time.time() + 300  # a hang guard, not a bound: the loop ends when all are in
    mine = []
    while time.time() < deadline:
        mine = [r for r in agent.lines if "seq" in r and r["func"] == "AllReduce"
                and r["bytes"] == 4 << 20]
        if len(mine) >= job["calls"]:
            break
        time.sleep(0.1)
    # torch's own call count: every call, and nothing more.
    assert len(mine) == job["calls"], (len(mine), job)
    assert sorted(r["seq"] for r in mine) == list(range(job["calls"]))
    assert all(r["datatype"] == "ncclFloat32" and r["count"] == 1 << 20 for r in mine)
    major, minor = (int(x) for x in job["nccl"].split(".")[:2])
    if (major, minor) >= (2, 27):
        assert all(r["gpu_ns"][1] > r["gpu_ns"][0] > 0 for r in mine), mine[:3]
    # The plugin's cost: the same loop with it off, for the note (printed).
    off = run_job(tmp_path, n, plugin_on=False)
    print(f"NCCL {job['nccl']}: {n} allreduces of 4 MiB in {job['seconds']:.4f} s with the "
          f"plugin, {off['seconds']:.4f} s with it off "
          f"({(job['seconds'] - off['seconds']) / n * 1e6:+.2f} us per collective)")
