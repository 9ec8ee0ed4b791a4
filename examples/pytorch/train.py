#!/usr/bin/env python3
"""Data-parallel training of torchvision's ResNet on synthetic images, on ringwatch, on
PyTorch DDP with gloo, or on Horovod with gloo: the same model, data and seed for all three,
so that their speed and their losses can be set side by side (`cargo xtask bench train`).

Run it as one process per rank with the variables torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), e.g.

    python -m ringwatch.run --nproc_per_node 4 examples/pytorch/train.py --backend ringwatch

(`ringwatch.run` is torchrun, with the fix PyTorch 1.13 needs on Python 3.11; on PyTorch 2.x
`torchrun --nproc_per_node 4 …` works the same), or `--backend single --world 4` for the
single-process reference: one process training on
the batch that the 4 ranks share. Every step's batch is the same whatever the backend; rank
r trains on its r-th slice. The model uses GroupNorm (torchvision's `norm_layer`): each
sample is normalized on its own, so that the combined batch's loss is exactly the mean of
the ranks' losses, and a distributed run must track the single-process one to float
tolerance. Prints one JSON line (rank 0): steps/s, images/s, the losses.
"""

import argparse
import json
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
import torchvision


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", choices=["ringwatch", "ddp", "horovod", "single"], default="ringwatch")
    p.add_argument("--model", default="resnet18", help="a torchvision.models constructor (default resnet18)")
    p.add_argument("--batch-size", type=int, default=8, help="images per rank per step (default 8)")
    p.add_argument("--image-size", type=int, default=64, help="pixels per side (default 64)")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--steps", type=int, default=20, help="timed steps (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--world", type=int, default=None,
                   help="--backend single: the number of ranks whose combined batch to train on")
    p.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                   help="the model's and data's dtype; float64 keeps rounding far below what "
                        "training amplifies, for comparing losses with --backend single")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="where the model and its gradients live (default cpu); cuda: each rank "
                        "on GPU LOCAL_RANK modulo the GPUs it sees. ringwatch then allreduces "
                        "the gradients on the GPU: through NCCL where every rank has a GPU of "
                        "its own, else staged through host memory")
    p.add_argument("--shared-gradients", choices=["on", "off"], default="on",
                   help="ringwatch: keep CPU gradients above 64 KiB in memory the host's ranks "
                        "share, where their allreduce folds in place (default on)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process (default 1)")
    p.add_argument("--horovod-rendezvous", metavar="NODESxRANKS", default=None,
                   help="serve Horovod's gloo rendezvous for the ranks (what horovodrun would)")
    p.add_argument("--duration", type=float, default=None,
                   help="train for this many seconds instead of --steps (a job to be tuned)")
    return p.parse_args()


def gloo_iface():
    """The interface gloo should use: loopback for a job on 127.0.0.1, else the first
    interface with an IPv4 address that is not loopback (a pretend node's veth, a pod's
    eth0)."""
    if os.environ.get("MASTER_ADDR", "127.0.0.1").startswith("127."):
        return "lo"
    out = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True).stdout
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[1] != "lo" and not words[3].startswith("127."):
            return words[1]
    return "lo"


def horovod_env_from_torchrun():
    """Horovod's gloo variables (what horovodrun would set) from torchrun's, with the
    rendezvous server of `--horovod-rendezvous` at MASTER_ADDR:RW_HOROVOD_RENDEZVOUS_PORT;
    nodes are blocks of LOCAL_WORLD_SIZE ranks named node0, node1, ..."""
    if "HOROVOD_RANK" in os.environ:
        return  # started by horovodrun
    rank, size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", size))
    os.environ.update({
        "HOROVOD_GLOO_RENDEZVOUS_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "HOROVOD_GLOO_RENDEZVOUS_PORT": os.environ["RW_HOROVOD_RENDEZVOUS_PORT"],
        "HOROVOD_CONTROLLER": "gloo",
        "HOROVOD_CPU_OPERATIONS": "gloo",
        "HOROVOD_GLOO_IFACE": gloo_iface(),
        "HOROVOD_HOSTNAME": f"node{rank // local}",
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(size),
        "HOROVOD_LOCAL_RANK": str(rank % local),
        "HOROVOD_LOCAL_SIZE": str(local),
        "HOROVOD_CROSS_RANK": str(rank // local),
        "HOROVOD_CROSS_SIZE": str(size // local),
    })


def serve_horovod_rendezvous(spec):
    """`--horovod-rendezvous NODESxRANKS`: Horovod's gloo rendezvous server (what horovodrun
    runs in the launcher) for nodes node0.. of RANKS ranks each; prints its port, then serves
    until stdin closes."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts
    from horovod.runner.http.http_server import RendezvousServer
    nodes, ranks = (int(v) for v in spec.split("x"))
    server = RendezvousServer()
    port = server.start()
    server.init(get_host_assignments(parse_hosts(",".join(f"node{n}:{ranks}" for n in range(nodes))), nodes * ranks))
    print(port, flush=True)
    sys.stdin.read()
    server.stop()


class Backend:
    """rank/size, an averaging allreduce for the reported loss, the optimizer wrapper."""

    def __init__(self, name, world):
        self.name = name
        if name == "single":
            self.rank, self.size = 0, 1
            self.world = world
        elif name == "ringwatch":
            import ringwatch.torch as rw
            rw.init()
            self.rw = rw
            self.rank, self.size = rw.rank(), rw.size()
        elif name == "ddp":
            import torch.distributed as dist
            os.environ.setdefault("GLOO_SOCKET_IFNAME", gloo_iface())
            dist.init_process_group("gloo")
            self.dist = dist
            self.rank, self.size = dist.get_rank(), dist.get_world_size()
        elif name == "horovod":
            horovod_env_from_torchrun()
            import horovod.torch as hvd
            hvd.init()
            self.hvd = hvd
            self.rank, self.size = hvd.rank(), hvd.size()
        if name != "single":
            self.world = self.size

    def wrap(self, model, opt):
        if self.name == "ringwatch":
            self.rw.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = self.rw.DistributedOptimizer(
                opt,
                named_parameters=model.named_parameters(),
                shared_gradients=self.shared_gradients,
            )
        elif self.name == "horovod":
            self.hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = self.hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
        elif self.name == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(model)
        return model, opt

    def mean(self, value, step):
        """The combined batch's loss: the mean of the ranks' (equal-sized) batches' losses."""
        t = torch.tensor([value], dtype=torch.float64)
        if self.name == "ringwatch":
            t = self.rw.allreduce(t, name=f"loss.{step}", op=self.rw.Average)
        elif self.name == "horovod":
            t = self.hvd.allreduce(t, name=f"loss.{step}", op=self.hvd.Average)
        elif self.name == "ddp":
            self.dist.all_reduce(t)
            t /= self.size
        return t.item()

    def barrier(self, step):
        if self.name != "single":
            self.mean(0.0, f"barrier.{step}")

    def shutdown(self):
        if self.name == "ringwatch":
            self.rw.shutdown()
        elif self.name == "horovod":
            self.hvd.shutdown()
        elif self.name == "ddp":
            # Not destroy_process_group(): with torch 1.13's gloo, a rank whose store
            # (hosted by rank 0) closes first spins in its store thread forever. Every
            # rank has passed the final barrier; exit without the destructors.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


_templates = {}


def batch(args, world, step):
    """The combined batch of `step`: the same on every rank and for every backend. Images
    are a class's fixed pattern under noise, so that there is something to learn and the
    loss falls (on pure noise it wanders, and so does any comparison of losses)."""
    if args.seed not in _templates:
        g = torch.Generator().manual_seed(args.seed)
        _templates[args.seed] = torch.randn(args.classes, 3, args.image_size, args.image_size, generator=g)
    g = torch.Generator().manual_seed(args.seed * 1_000_003 + step + 1)
    n = world * args.batch_size
    y = torch.randint(0, args.classes, (n,), generator=g)
    x = 0.5 * _templates[args.seed][y] + torch.randn(n, 3, args.image_size, args.image_size, generator=g)
    return x, y


def main():
    args = parse_args()
    if args.horovod_rendezvous:
        return serve_horovod_rendezvous(args.horovod_rendezvous)
    torch.set_num_threads(args.threads)
    if args.backend == "single" and not args.world:
        sys.exit("--backend single needs --world N (the ranks whose combined batch it trains on)")
    if args.device == "cuda":
        if not torch.cuda.is_available():
            sys.exit("--device cuda: torch sees no GPU (torch.cuda.is_available() is False)")
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local % torch.cuda.device_count())
        # TF32 would round differently for each batch split; keep full precision so that
        # the losses can be compared with --backend single.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" \
        else torch.device("cpu")
    be = Backend(args.backend, args.world)
    be.shared_gradients = args.shared_gradients == "on"
    torch.manual_seed(args.seed)
    build = getattr(torchvision.models, args.model)
    model = build(num_classes=args.classes, norm_layer=lambda c: torch.nn.GroupNorm(32, c))
    dtype = getattr(torch, args.dtype)
    model = model.to(device=device, dtype=dtype)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    model, opt = be.wrap(model, opt)
    if args.backend == "single":
        mine = slice(None)
    else:
        mine = slice(be.rank * args.batch_size, (be.rank + 1) * args.batch_size)
    losses, started, step = [], None, 0
    total = args.warmup + args.steps
    while True:
        if step == args.warmup:
            be.barrier(step)
            started = time.perf_counter()
        if args.duration is None and step >= total:
            break
        if args.duration is not None and started is not None and time.perf_counter() - started >= args.duration:
            break
        x, y = batch(args, be.world, step)
        x, y = x.to(device=device, dtype=dtype), y.to(device)
        opt.zero_grad()
        loss = F.cross_entropy(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        losses.append(be.mean(loss.item(), step) if args.duration is None else loss.item())
        step += 1
        if be.rank == 0 and args.duration is not None and step % 20 == 0:
            print(f"step {step}: {step / (time.perf_counter() - (started or time.perf_counter())):.2f} steps/s",
                  file=sys.stderr, flush=True)
    be.barrier(step + 1)
    elapsed = time.perf_counter() - started
    timed = step - args.warmup
    if be.rank == 0:
        print(json.dumps({
            "backend": args.backend,
            "model": args.model,
            "world": be.world,
            "batch_per_rank": args.batch_size,
            "image_size": args.image_size,
            "steps": timed,
            "seconds": elapsed,
            "steps_per_s": timed / elapsed,
            "images_per_s": timed * be.world * args.batch_size / elapsed,
            "losses": losses,
        }), flush=True)
    be.shutdown()


if __name__ == "__main__":
    main()
