"""`python -m ringwatch.run`: torchrun's flags, every rank started, on the torch installed."""

import subprocess
import sys
import textwrap


def test_it_starts_each_rank_with_torchruns_variables(tmp_path):
    script = tmp_path / "ranks.py"
    script.write_text(textwrap.dedent("""
        import os
        names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
        # One write of the whole line: the two ranks share the pipe, and
        # print() may write its parts one by one (torchrun's ranks run
        # unbuffered), interleaving the ranks' lines.
        line = " ".join(["seen", *(os.environ[n] for n in names[:4])]) + "\\n"
        os.write(1, line.encode())
        assert all(os.environ.get(n) for n in names)
    """))
    done = subprocess.run(
        [sys.executable, "-m", "ringwatch.run", "--nproc_per_node", "2", str(script)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    seen = sorted(line.split()[1:] for line in done.stdout.splitlines() if line.startswith("seen"))
    assert seen == [["0", "2", "0", "2"], ["1", "2", "1", "2"]], done.stdout + done.stderr


def test_an_unknown_flag_is_torchruns_usage_error():
    done = subprocess.run(
        [sys.executable, "-m", "ringwatch.run", "--no-such-flag", "x.py"],
        capture_output=True, text=True, timeout=60,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert "unrecognized arguments" in done.stderr or "error:" in done.stderr, done.stderr
