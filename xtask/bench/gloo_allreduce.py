#!/usr/bin/env python3
"""gloo_allreduce: times torch.distributed all_reduce (sum of float32) with the
gloo backend for `cargo xtask bench compare`, the way collbench sweep times ours.

Usage: gloo_allreduce.py -n RANKS WARMUP BYTES:ITERS [BYTES:ITERS ...]

Run without RANK in the environment it is a launcher (as collbench is): it
starts RANKS copies of itself with RANK, WORLD_SIZE, MASTER_ADDR=127.0.0.1,
MASTER_PORT and GLOO_SOCKET_IFNAME=lo set (env:// rendezvous; TCP over
loopback, as ours), waits for them and stops the rest when one fails.

For every size: each rank fills a tensor with rank+1; one checked call (every
element must be n(n+1)/2), WARMUP untimed calls, a barrier, then ITERS timed
calls. all_reduce works in place, so the values grow by n each call; after the
timed calls every element is checked against n(n+1)/2 * n^(WARMUP+ITERS)
(relative 1e-4; once that is past float32's range, only that every element
equals the first). Rank 0 prints one line per size,
  allreduce bytes=B count=C warmup=W iters=I time_us=T wrong=K
where T is rank 0's mean wall time per call and K the wrong elements over
every rank (xtask/src/compare.rs parses it). It measures; it never changes
what it times.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def size_and_iters(text):
    try:
        size, iters = (int(part) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not BYTES:ITERS")
    if size < 4 or size % 4 != 0 or iters < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: BYTES a multiple of 4, ITERS at least 1")
    return size, iters


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--ranks", type=int, default=4, help="ranks to start")
    parser.add_argument("warmup", type=int, help="untimed calls per size after the checked one")
    parser.add_argument("sizes", type=size_and_iters, nargs="+", metavar="BYTES:ITERS")
    args = parser.parse_args()
    if args.ranks < 1 or args.warmup < 0:
        parser.error("--ranks must be at least 1 and WARMUP at least 0")
    return args


def launch(args):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    children = []

    def stop(signum, _frame):
        for child in children:
            child.kill()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    for rank in range(args.ranks):
        env = dict(
            os.environ,
            RANK=str(rank),
            WORLD_SIZE=str(args.ranks),
            LOCAL_RANK=str(rank),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            GLOO_SOCKET_IFNAME="lo",
        )
        children.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__)] + sys.argv[1:],
                env=env,
                stdout=None if rank == 0 else subprocess.DEVNULL,
            )
        )
    failed = None
    running = list(enumerate(children))
    while running and failed is None:
        still = []
        for rank, child in running:
            code = child.poll()
            if code is None:
                still.append((rank, child))
            elif code != 0:
                failed = (rank, code)
        running = still
        time.sleep(0.02)
    if failed is not None:
        # The others fail on their own within their timeout; give them a
        # moment to report, then stop them.
        deadline = time.monotonic() + 5
        while any(c.poll() is None for _, c in running) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _, child in running:
            child.kill()
            child.wait()
        print(f"gloo_allreduce: rank {failed[0]} failed (exit {failed[1]})", file=sys.stderr)
        return 1
    return 0


def worker(args):
    import datetime

    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    ranks = int(os.environ["WORLD_SIZE"])
    dist.init_process_group(
        "gloo",
        init_method="env://",
        rank=rank,
        world_size=ranks,
        timeout=datetime.timedelta(seconds=60),
    )
    want = ranks * (ranks + 1) / 2
    for size, iters in args.sizes:
        count = size // 4
        values = torch.full((count,), float(rank + 1), dtype=torch.float32)
        dist.all_reduce(values)
        wrong = int((values != want).sum())
        for _ in range(args.warmup):
            dist.all_reduce(values)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(values)
        seconds = (time.perf_counter() - start) / iters
        try:
            expected = want * float(ranks) ** (args.warmup + iters)
        except OverflowError:  # past any float: checked as "all the same" below
            expected = float("inf")
        if expected < 1e38:
            close = torch.isclose(
                values, torch.tensor(expected, dtype=torch.float32), rtol=1e-4, atol=0.0
            )
            wrong += int((~close).sum())
        else:
            wrong += int((values != values[0]).sum())
        wrong_everywhere = torch.tensor([wrong], dtype=torch.int64)
        dist.reduce(wrong_everywhere, dst=0)
        if rank == 0:
            print(
                f"allreduce bytes={size} count={count} warmup={args.warmup} iters={iters} "
                f"time_us={seconds * 1e6:.3f} wrong={int(wrong_everywhere[0])}",
                flush=True,
            )
    dist.destroy_process_group()
    return 0


def main():
    args = parse_args()
    if "RANK" in os.environ:
        return worker(args)
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
