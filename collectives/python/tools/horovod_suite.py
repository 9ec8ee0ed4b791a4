"""Horovod's own PyTorch test suite (``test/parallel/test_torch.py``) against ringwatch.

Horovod's tests are read from a Horovod checkout at a tag (``git show``; they are not in the
PyPI sdist and are never copied into this repository) into a scratch directory, and run with
``compat/`` first on ``PYTHONPATH``, so that their ``import horovod.torch as hvd`` is
``ringwatch.torch``. Each test runs alone, on ``--ranks`` processes started the way torchrun
starts them (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and,
with ``--horovodrun-env``, with ``HOROVOD_RANK``/``HOROVOD_SIZE`` as ``horovodrun --gloo``
sets them (then every test's ``tearDown`` calls ``hvd.barrier()``). A test passes when every
rank passes, is skipped when every rank skips, and fails otherwise (a hang past
``--timeout`` is a failure). Prints a line per test and a summary; writes JSON.

    python collectives/python/tools/horovod_suite.py --horovod-repo ~/src/horovod --ranks 2

Needs ``pytest``, ``numpy``, ``packaging``, ``cloudpickle`` and ``mock`` beside ringwatch
(``cargo xtask horovod-suite`` installs them, pinned).
"""

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
COMPAT = HERE.parent / "compat"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def extract(repo, ref, work):
    """Horovod's test file and its utilities at ``ref``, into ``work``."""
    for rel in ["test/parallel/test_torch.py", "test/utils/common.py"]:
        text = subprocess.run(["git", "-C", str(repo), "show", f"{ref}:{rel}"],
                              check=True, capture_output=True, text=True).stdout
        dest = work / rel.split("/", 1)[1]
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_text(text)
    return work / "parallel" / "test_torch.py"


def test_names(path):
    return re.findall(r"^    def (test_\w+)\(self", path.read_text(), flags=re.M)


def outcome(returncode, output):
    """One rank's result: passed, skipped, failed (with a short reason)."""
    if returncode == 0:
        if re.search(r"\b1 skipped\b", output) and not re.search(r"\b1 passed\b", output):
            m = re.search(r"SKIPPED \[\d+\] [^:]+:\d+: (.*)", output)
            return "skipped", (m.group(1).strip() if m else "")
        return "passed", ""
    errors = re.findall(r"^E +(.+)$", output, flags=re.M)
    reason = errors[0] if errors else (output.strip().splitlines() or ["?"])[-1]
    return "failed", reason[:200]


def run_test(test_file, name, ranks, timeout, horovodrun_env):
    port = free_port()
    procs = []
    for rank in range(ranks):
        env = dict(os.environ)
        env.update({
            "RANK": str(rank), "WORLD_SIZE": str(ranks), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(ranks), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
            "PYTHONPATH": os.pathsep.join([str(COMPAT), env.get("PYTHONPATH", "")]),
        })
        if horovodrun_env:
            env.update({"HOROVOD_RANK": str(rank), "HOROVOD_SIZE": str(ranks),
                        "HOROVOD_LOCAL_RANK": str(rank), "HOROVOD_LOCAL_SIZE": str(ranks)})
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
             f"{test_file.name}::TorchTests::{name}"],
            cwd=test_file.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True))
    results = []
    deadline = time.time() + timeout
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, deadline - time.time()))
            results.append(outcome(p.returncode, out))
        except subprocess.TimeoutExpired:
            for q in procs:
                try:
                    os.killpg(q.pid, 9)
                except ProcessLookupError:
                    pass
            p.communicate()
            results.append(("failed", f"hung: no result within {timeout} s"))
    kinds = {k for k, _ in results}
    if kinds == {"passed"}:
        return "passed", ""
    if kinds == {"skipped"}:
        return "skipped", results[0][1]
    return "failed", next(r for k, r in results if k == "failed") if "failed" in kinds \
        else "ranks disagree: " + ", ".join(k for k, _ in results)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--horovod-repo", required=True, type=Path, help="a git checkout of Horovod")
    ap.add_argument("--ref", default="v0.28.1", help="the tag or commit to read the tests at")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=120, help="seconds per test")
    ap.add_argument("-k", "--select", default="", help="only tests whose name contains this")
    ap.add_argument("--horovodrun-env", action="store_true",
                    help="also set HOROVOD_RANK/SIZE as horovodrun --gloo does")
    ap.add_argument("--work", type=Path, default=Path("target/horovod-suite"))
    ap.add_argument("--out", type=Path, default=Path("target/bench/horovod-suite.json"))
    args = ap.parse_args()
    test_file = extract(args.horovod_repo, args.ref, args.work)
    names = [n for n in test_names(test_file) if args.select in n]
    results = {}
    started = time.time()
    for i, name in enumerate(names, 1):
        t = time.time()
        kind, reason = run_test(test_file, name, args.ranks, args.timeout, args.horovodrun_env)
        results[name] = {"outcome": kind, "reason": reason, "seconds": round(time.time() - t, 1)}
        print(f"[{i}/{len(names)}] {name}: {kind} ({time.time() - t:.1f} s)"
              + (f" {reason}" if reason else ""), flush=True)
    counts = {k: sum(1 for r in results.values() if r["outcome"] == k)
              for k in ["passed", "failed", "skipped"]}
    print(f"{len(names)} tests on {args.ranks} ranks: {counts['passed']} passed, "
          f"{counts['failed']} failed, {counts['skipped']} skipped "
          f"({time.time() - started:.0f} s)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"ref": args.ref, "ranks": args.ranks,
                                    "horovodrun_env": args.horovodrun_env,
                                    "counts": counts, "tests": results}, indent=1))


if __name__ == "__main__":
    main()
