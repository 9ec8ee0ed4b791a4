"""A PyTorch job started with RINGWATCH_AUTOTUNE=1 is found and tuned live by the ringwatch
agent, like any job of the runtime: the agent claims it, samples knobs while it trains, and
the knobs it pins are the ones the training processes then run with.

Needs the agent's binary: RINGWATCH_AGENT_BIN (`cargo xtask test` sets it to the one its
cargo build made). Without the variable the test is skipped, saying so."""

import json
import os
import subprocess
import threading
import time
import urllib.request

import pytest

AGENT = os.environ.get("RINGWATCH_AGENT_BIN")

TRAINING = r"""
import json, os, time
import torch
import torch.nn.functional as F
import ringwatch.torch as rw

rw.init()
r = rw.rank()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
opt = rw.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                              named_parameters=model.named_parameters())
rw.broadcast_parameters(model.state_dict(), root_rank=0)
states, steps = [], 0
stop = os.environ["STOP_FILE"]
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    # Every rank decides to stop at the same step: rank 0's view of the stop file.
    flag = torch.tensor([1 if (r == 0 and os.path.exists(stop)) else 0], dtype=torch.int32)
    if rw.allreduce(flag, name="stop", op=rw.Max).item():
        break
    x = torch.randn(32, 64)
    y = torch.randint(0, 10, (32,))
    opt.zero_grad()
    F.cross_entropy(model(x), y).backward()
    opt.step()
    steps += 1
    state = rw.knobs()["autotune"]
    if not states or states[-1] != state:
        states.append(state)
    if r == 0:
        with open(os.environ["STATE_FILE"], "w") as f:
            json.dump({"states": states, "steps": steps}, f)
knobs = rw.knobs()
rw.shutdown()
print(json.dumps({"rank": r, "steps": steps, "states": states, "knobs": knobs}))
"""


def get_json(addr, path):
    try:
        with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as e:
        return e.code, None


def request(addr, method, path):
    req = urllib.request.Request(f"http://{addr}{path}", method=method)
    with urllib.request.urlopen(req, timeout=10) as resp:
        return resp.status


def wait_for(what, fn, limit=90):
    deadline = time.monotonic() + limit
    while True:
        value = fn()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what}: not within {limit} s"
        time.sleep(0.25)


@pytest.mark.skipif(not AGENT, reason="RINGWATCH_AGENT_BIN is not set (cargo xtask test sets it)")
def test_the_agent_tunes_a_pytorch_job_live(run_job, tmp_path):
    assert os.path.isfile(AGENT), f"RINGWATCH_AGENT_BIN={AGENT} is not a file"
    runtime, reports = tmp_path / "run", tmp_path / "reports"
    runtime.mkdir()
    reports.mkdir()
    agent = subprocess.Popen(
        [AGENT, "serve", "--listen", "127.0.0.1:0", "--jobs", "--runtime-dir", str(runtime),
         "--reports-dir", str(reports)],
        env=dict(os.environ, RINGWATCH_LOCK_FILE=str(tmp_path / "agent.lock")),
        stderr=subprocess.PIPE, text=True,
    )
    found = threading.Event()
    addr = []
    log = []

    def read_log():
        for line in agent.stderr:
            log.append(line)
            if "serving the API on http://" in line and not addr:
                addr.append(line.split("http://")[1].split("/")[0])
                found.set()

    threading.Thread(target=read_log, daemon=True).start()
    stop = tmp_path / "stop"
    state_file = tmp_path / "state.json"
    job_result = {}

    def run():
        job_result["job"] = run_job(
            TRAINING, 2,
            env={
                "RINGWATCH_AUTOTUNE": "1",
                "RINGWATCH_AUTOTUNE_WAIT_SECS": "120",  # the agent, not the job itself
                "STOP_FILE": str(stop),
                "STATE_FILE": str(state_file),
            },
        )

    trainer = threading.Thread(target=run)
    try:
        assert found.wait(60), "the agent did not start serving:\n" + "".join(log)
        a = addr[0]
        trainer.start()
        job_id = wait_for("the job's socket", lambda: next(
            (p.stem for p in runtime.glob("*.sock")), None))
        # The agent claims it on its own and samples while it trains.
        session = wait_for("a session with two samples", lambda: (
            lambda s: s[1] if s[0] == 200 and len(s[1].get("samples", [])) >= 2 else None
        )(get_json(a, f"/api/jobs/{job_id}/tuning")))
        assert session["state"] == "running", session
        # Stopping the session pins its best knobs on the job.
        assert request(a, "DELETE", f"/api/jobs/{job_id}/tuning") == 200
        session = wait_for("the session's end", lambda: (
            lambda s: s[1] if s[0] == 200 and s[1]["state"] != "running" else None
        )(get_json(a, f"/api/jobs/{job_id}/tuning")))
        best = session["best"]["knobs"]
        # Train on a moment with the pinned knobs, then stop.
        time.sleep(1.0)
        stop.write_text("")
        trainer.join(timeout=180)
        assert not trainer.is_alive(), "the training job did not stop"
    finally:
        stop.write_text("")
        agent.terminate()
        try:
            agent.wait(timeout=20)
        except subprocess.TimeoutExpired:
            agent.kill()
    results = job_result["job"].results()
    # The job asked, waited, was tuned by the agent, and ended tuned (rank 0 holds the
    # job's autotune state)...
    states = results[0]["states"]
    assert states[0] in ("waiting", "agent") and "agent" in states, results[0]
    assert states[-1] == "done", results[0]
    # ...and every rank runs the knobs the session chose.
    for res in results:
        assert res["knobs"]["fusion_threshold"] == best["fusion_threshold_bytes"], (res, best)
        assert res["knobs"]["cycle_time_ms"] == pytest.approx(best["cycle_time_us"] / 1e3), (res, best)
        assert res["knobs"]["hierarchical_allreduce"] == best["hierarchical_allreduce"], (res, best)
    assert results[0]["steps"] == results[1]["steps"] > 0
