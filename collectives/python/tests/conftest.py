"""Runs a worker script as N ranks of one job (the variables torchrun sets), the way the
tests of ringwatch.torch exercise a real multi-process job."""

import json
import os
import random
import socket
import subprocess
import sys
import textwrap

import pytest

# Every rank must finish within this; a hang fails the test instead of the suite.
HANG_GUARD_S = 120


def free_port_pair():
    """A port P with P and P + 1 free (torch.distributed's store on P, ours on P + 1), in
    20000-32000, below the kernel's ephemeral range."""
    for _ in range(200):
        port = random.randrange(20000, 32000, 2)
        try:
            for p in (port, port + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError("no free port pair")


class Job:
    def __init__(self, procs, outputs):
        self.procs = procs
        self.outputs = outputs

    def results(self):
        """Each rank's last stdout line, parsed as JSON."""
        out = []
        for rank, (stdout, _) in enumerate(self.outputs):
            lines = [l for l in stdout.splitlines() if l.strip()]
            assert lines, f"rank {rank} printed nothing"
            out.append(json.loads(lines[-1]))
        return out

    def describe(self):
        return "\n".join(
            f"--- rank {r} (exit {p.returncode})\nstdout:\n{o}\nstderr:\n{e}"
            for r, (p, (o, e)) in enumerate(zip(self.procs, self.outputs))
        )


@pytest.fixture
def run_job(tmp_path):
    """run_job(code, n, env={}, per_rank_env=None, check=True) -> Job: runs `code` (a
    script; `import ringwatch.torch as rw` in it) as n ranks and waits for them."""

    def run(code, n, env=None, per_rank_env=None, check=True):
        script = tmp_path / "worker.py"
        script.write_text(textwrap.dedent(code))
        port = free_port_pair()
        procs = []
        for rank in range(n):
            e = dict(os.environ)
            e.update(
                RANK=str(rank),
                WORLD_SIZE=str(n),
                LOCAL_RANK=str(rank),
                LOCAL_WORLD_SIZE=str(n),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RINGWATCH_JOB_ID=f"pytest-{port}",
                RINGWATCH_RUNTIME_DIR=str(tmp_path / "run"),
                OMP_NUM_THREADS="1",
            )
            e.update(env or {})
            if per_rank_env:
                e.update(per_rank_env(rank))
            # Files, not pipes: a rank blocked on a full pipe would stall the others.
            out = open(tmp_path / f"rank{rank}.out", "w+")
            err = open(tmp_path / f"rank{rank}.err", "w+")
            procs.append(
                (subprocess.Popen(
                    [sys.executable, str(script)],
                    env=e,
                    cwd=tmp_path,
                    stdout=out,
                    stderr=err,
                    text=True,
                ), out, err)
            )
        outputs = []
        try:
            for p, _, _ in procs:
                p.wait(timeout=HANG_GUARD_S)
        finally:
            for p, out, err in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
                out.seek(0)
                err.seek(0)
                outputs.append((out.read(), err.read()))
                out.close()
                err.close()
        procs = [p for p, _, _ in procs]
        job = Job(procs, outputs)
        if check:
            assert all(p.returncode == 0 for p in procs), job.describe()
        return job

    return run
