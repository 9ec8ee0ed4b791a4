"""Who holds a job back. A rank that is late at every step (its data loader sleeps) is named
by the node's agent with how late it is. A job whose ranks enqueue different tensors
(uneven data: one rank runs out of batches a step early) stalls. Rank 0's stall check names the tensors and the missing ranks: with
RINGWATCH_STALL_SHUTDOWN_SECS every rank fails with that error instead of waiting forever,
and the node's agent shows the stall (`/api/jobs/{id}/diagnosis`, `/metrics`, its log)."""

import json
import os
import signal
import subprocess
import threading
import time
import urllib.request

import pytest

from test_agent import AGENT, get_json, wait_for

SLOW_LOADER = r"""
import json, os, time
import torch
import ringwatch.torch as rw

rw.init()
r = rw.rank()
if "PID_DIR" in os.environ:
    with open(os.path.join(os.environ["PID_DIR"], f"rank{r}.pid"), "w") as f:
        f.write(str(os.getpid()))
stop = os.environ["STOP_FILE"]
steps = 0
while True:
    flag = torch.tensor([1 if (r == 0 and os.path.exists(stop)) else 0], dtype=torch.int32)
    if rw.allreduce(flag, name="stop", op=rw.Max).item() or steps > 5000:
        break
    if r == 1:
        time.sleep(0.2)  # its data loader
    a = rw.allreduce_async(torch.ones(1000), name="grad.a", op=rw.Sum)
    b = rw.allreduce_async(torch.ones(10), name="grad.b", op=rw.Sum)
    rw.synchronize(a), rw.synchronize(b)
    steps += 1
rw.shutdown()
print(json.dumps({"rank": r, "steps": steps}))
"""


def start_agent(tmp_path):
    runtime = tmp_path / "run"
    runtime.mkdir()
    agent = subprocess.Popen(
        [AGENT, "serve", "--listen", "127.0.0.1:0", "--jobs", "--runtime-dir", str(runtime),
         "--reports-dir", str(tmp_path / "reports")],
        env=dict(os.environ, RINGWATCH_LOCK_FILE=str(tmp_path / "agent.lock")),
        stderr=subprocess.PIPE, text=True,
    )
    found = threading.Event()
    addr, log = [], []

    def read_log():
        for line in agent.stderr:
            log.append(line)
            if "serving the API on http://" in line and not addr:
                addr.append(line.split("http://")[1].split("/")[0])
                found.set()

    threading.Thread(target=read_log, daemon=True).start()
    assert found.wait(60), "the agent did not start serving:\n" + "".join(log)
    return agent, addr[0], runtime, log


def stop_agent(agent):
    agent.terminate()
    try:
        agent.wait(timeout=20)
    except subprocess.TimeoutExpired:
        agent.kill()


@pytest.mark.skipif(not AGENT, reason="RINGWATCH_AGENT_BIN is not set (cargo xtask test sets it)")
def test_the_agent_names_the_rank_the_others_wait_for_and_how_late_it_is(run_job, tmp_path):
    agent, a, runtime, log = start_agent(tmp_path)
    stop = tmp_path / "stop"
    result = {}
    trainer = threading.Thread(target=lambda: result.update(job=run_job(
        SLOW_LOADER, 2, env={"STOP_FILE": str(stop)})))
    try:
        trainer.start()
        job_id = wait_for("the job's socket", lambda: next(
            (p.stem for p in runtime.glob("*.sock")), None))
        diagnosis = wait_for("a verdict", lambda: (
            lambda s: s[1] if s[0] == 200 and s[1].get("verdict") else None
        )(get_json(a, f"/api/jobs/{job_id}/diagnosis")), limit=240)
    finally:
        stop.write_text("")
        trainer.join(timeout=180)
        stop_agent(agent)
    print("verdict:", diagnosis["verdict"])
    print("lateness:", json.dumps(diagnosis["lateness"]))
    assert diagnosis["progress"] == "progressing", diagnosis
    lateness = diagnosis["lateness"]
    top = lateness["ranks"][0]
    # Its main thread was sampled, and seen in time.sleep (its "data loader"). How often
    # is load's to move; that it was seen there at all is not: 25 samples span at least
    # half a second, and every step sleeps 200 ms.
    main = top["main_thread"]
    assert main["samples"] >= 10 and main["sleeping"] >= 1, main
    assert top["rank"] == 1 and top["last_share"] >= 0.6, lateness
    assert top["last_tensors"] >= 20 and top["late_ms_p50"] > 0, lateness
    assert diagnosis["verdict"].startswith("rank 1 ("), diagnosis["verdict"]
    assert all(r["rank"] != 0 or r["last_tensors"] < top["last_tensors"]
               for r in lateness["ranks"]), lateness
    steps = [res["steps"] for res in result["job"].results()]
    assert steps[0] == steps[1] > 0, steps

UNEVEN = r"""
import json, os
import torch
import ringwatch.torch as rw

rw.init()
r = rw.rank()
with open(os.path.join(os.environ["PID_DIR"], f"rank{r}.pid"), "w") as f:
    f.write(str(os.getpid()))
rw.allreduce(torch.ones(3), name="grad.step0", op=rw.Sum)
out = {"rank": r, "error": None}
try:
    if r == 0:
        # One batch more than rank 1 had.
        rw.allreduce(torch.ones(3), name="grad.step1", op=rw.Sum)
    else:
        rw.barrier()
except rw.RingwatchError as e:
    out.update(error=str(e), type=type(e).__name__)
print(json.dumps(out), flush=True)
os._exit(0)
"""


def test_the_stall_shutdown_fails_every_rank_naming_the_tensor_and_the_missing_rank(
        run_job, tmp_path):
    job = run_job(UNEVEN, 2, env={
        "PID_DIR": str(tmp_path),
        "RINGWATCH_STALL_CHECK_SECS": "1",
        "RINGWATCH_STALL_SHUTDOWN_SECS": "3",
    })
    for res in job.results():
        assert res["type"] == "RingwatchError", res
        error = res["error"]
        assert "allreduce 'grad.step1' enqueued on ranks [0] but not on ranks [1]" in error, error
        assert "RINGWATCH_STALL_SHUTDOWN_SECS" in error and "uneven data" in error, error


def test_a_bad_stall_setting_is_refused_at_init(run_job, tmp_path):
    job = run_job("import ringwatch.torch as rw\nrw.init()\n", 1, check=False, env={
        "RINGWATCH_STALL_CHECK_SECS": "30",
        "RINGWATCH_STALL_SHUTDOWN_SECS": "5",
    })
    assert job.procs[0].returncode != 0
    assert "shorter than the stall check" in job.outputs[0][1], job.describe()


@pytest.mark.skipif(not AGENT, reason="RINGWATCH_AGENT_BIN is not set (cargo xtask test sets it)")
def test_the_agent_names_a_stalled_jobs_tensor_its_missing_rank_and_what_that_rank_does(
        run_job, tmp_path):
    agent, a, runtime, log = start_agent(tmp_path)
    result = {}
    # No stall shutdown: the job waits until the test kills it.
    trainer = threading.Thread(target=lambda: result.update(job=run_job(
        UNEVEN, 2, check=False,
        env={"PID_DIR": str(tmp_path), "RINGWATCH_STALL_CHECK_SECS": "1"})))
    try:
        trainer.start()
        job_id = wait_for("the job's socket", lambda: next(
            (p.stem for p in runtime.glob("*.sock")), None))
        diagnosis = wait_for("a stalled diagnosis", lambda: (
            lambda s: s[1] if s[0] == 200 and s[1]["progress"] == "stalled"
            and len(s[1]["stall"]["tensors"]) == 2 else None
        )(get_json(a, f"/api/jobs/{job_id}/diagnosis")), limit=180)
        stall = diagnosis["stall"]
        tensors = {t["name"]: t for t in stall["tensors"]}
        assert tensors["grad.step1"]["missing_ranks"] == [1], stall
        assert tensors["grad.step1"]["waiting_ranks"] == [0], stall
        assert tensors["grad.step1"]["kind"] == "allreduce", stall
        rank1_pid = int((tmp_path / "rank1.pid").read_text())
        missing = {m["rank"]: m for m in stall["missing_ranks"]}
        assert missing[1]["pid"] == rank1_pid, stall
        assert missing[1]["waits_in"] != [] and "grad.step1" not in missing[1]["waits_in"], stall
        threads = missing[1]["threads"]
        assert threads and all(t["state"] in "RSD" for t in threads), threads
        assert rank1_pid in [t["tid"] for t in threads], threads
        verdict = diagnosis["verdict"]
        print("verdict:", verdict)
        assert "allreduce 'grad.step1' is enqueued on rank 0 and waits for rank 1" in verdict, verdict
        assert "uneven data" in verdict and f"rank 1 (pid {rank1_pid})" in verdict, verdict
        with urllib.request.urlopen(f"http://{a}/metrics", timeout=10) as resp:
            metrics = resp.read().decode()
        assert f'ringwatch_job_stalled_tensors{{job="{job_id}"}} 2' in metrics, metrics
        wait_for("the stall in the agent's log",
                 lambda: any("the job is stalled" in line and "grad.step1" in line
                             for line in log))
    finally:
        for r in (0, 1):
            pid_file = tmp_path / f"rank{r}.pid"
            if pid_file.exists():
                try:
                    os.kill(int(pid_file.read_text()), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        trainer.join(timeout=120)
        stop_agent(agent)


@pytest.mark.skipif(not AGENT, reason="RINGWATCH_AGENT_BIN is not set (cargo xtask test sets it)")
def test_a_stopped_rank_is_named_at_once_and_the_job_goes_on_after_sigcont(run_job, tmp_path):
    """A SIGSTOPped rank sends nothing, so rank 0's stall check (between cycles) never runs:
    the agent names it from its threads' state, and the job resumes on SIGCONT."""
    agent, a, runtime, log = start_agent(tmp_path)
    stop = tmp_path / "stop"
    result = {}
    # The peer timeout far away: this test decides when the stop ends, not the load.
    trainer = threading.Thread(target=lambda: result.update(job=run_job(
        SLOW_LOADER, 2, env={"STOP_FILE": str(stop), "PID_DIR": str(tmp_path),
                             "RINGWATCH_COLLECTIVE_TIMEOUT_SECS": "600"})))
    pid = None
    try:
        trainer.start()
        job_id = wait_for("the job's socket", lambda: next(
            (p.stem for p in runtime.glob("*.sock")), None))
        pid = int(wait_for("rank 1's pid", lambda: (tmp_path / "rank1.pid").exists()
                           and (tmp_path / "rank1.pid").read_text()))
        os.kill(pid, signal.SIGSTOP)
        diagnosis = wait_for("the stopped rank", lambda: (
            lambda s: s[1] if s[0] == 200 and s[1]["progress"] == "stopped" else None
        )(get_json(a, f"/api/jobs/{job_id}/diagnosis")), limit=120)
        print("verdict:", diagnosis["verdict"])
        assert diagnosis["stopped_ranks"] == [1], diagnosis
        assert diagnosis["verdict"].startswith("rank 1 ("), diagnosis["verdict"]
        assert f"pid {pid}" in diagnosis["verdict"], diagnosis["verdict"]
        os.kill(pid, signal.SIGCONT)
        pid = None
        wait_for("the job going on", lambda: (
            lambda s: s[0] == 200 and s[1]["progress"] == "progressing"
        )(get_json(a, f"/api/jobs/{job_id}/diagnosis")), limit=120)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        stop.write_text("")
        trainer.join(timeout=180)
        stop_agent(agent)
    steps = [res["steps"] for res in result["job"].results()]
    assert steps[0] == steps[1] > 0, steps
