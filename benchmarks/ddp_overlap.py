"""Claim: all-reducing gradients in buckets while backward runs beats one all-reduce after backward.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/ddp_overlap.py
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/ddp_overlap.py --buckets 1 25 --rounds 2

The model is a plain MLP of ≥ 20M parameters (84 MB of float32 gradients). In one run, with the
same model, data and transport, rounds alternate between:

* compute only       forward + backward + step, no communication (the floor);
* one all-reduce     backward, then every gradient flattened into one buffer, one all-reduce,
                     averaged and copied back (no overlap);
* DDP, bucket X MB   torch's DistributedDataParallel with bucket_cap_mb=X: each bucket is
                     all-reduced asynchronously as soon as backward has filled it (overlap).

Printed: median step time per variant, communication left exposed (step − compute only), and the
ratio (one all-reduce step) / (variant step): above 1 means overlap pays. `--transport mpi` sends
the same buckets with MPI_Allreduce through a DDP communication hook (faster here, but blocking,
so it buckets without overlapping). One thread per rank unless --threads says otherwise.

Overlap hides communication only where something else does the communicating: on GPU nodes the
GPU computes while NCCL moves data over NVLink or the network. On a CPU-only machine whose cores
all compute, Gloo's threads take their cycles from the same cores, so expect no gain here (or a
loss, when other programs also want the cores); the ratio is the point of the comparison.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP

from hpdl import dp
from hpdl.rank import init_torch_distributed


def big_mlp(width: int, depth: int) -> nn.Module:
    torch.manual_seed(0)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


class OneAllreduce:
    """No overlap: gradients live as views into one flat buffer; after backward, one all-reduce.

    Views avoid copying 80 MB in and out around the all-reduce, so the comparison with DDP
    (also run with gradient_as_bucket_view=True) is about overlap, not about copies.
    """

    def __init__(self, model, comm, transport):
        self.model, self.comm, self.transport = model, comm, transport
        params = list(model.parameters())
        self.flat = torch.zeros(sum(p.numel() for p in params))
        offset = 0
        for p in params:
            p.grad = self.flat[offset: offset + p.numel()].view_as(p)
            offset += p.numel()

    def after_backward(self):
        if self.transport == "mpi":
            self.comm.Allreduce(MPI.IN_PLACE, self.flat.numpy(), op=MPI.SUM)
        else:
            dist.all_reduce(self.flat)
        self.flat /= self.comm.Get_size()


def one_allreduce_step(model, opt, x, y, reducer):
    opt.zero_grad(set_to_none=False)  # zeroes the views in place: they stay views
    nn.functional.cross_entropy(model(x), y).backward()
    reducer.after_backward()
    opt.step()


def plain_step(model, opt, x, y):
    opt.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(x), y).backward()
    opt.step()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=5, help="hidden Linear(width, width) layers")
    ap.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    ap.add_argument("--buckets", type=float, nargs="+", default=[1, 5, 25, 100], help="DDP bucket_cap_mb values")
    ap.add_argument("--steps", type=int, default=4, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=3, help="rounds alternating all variants")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--transport", choices=["gloo", "mpi"], default="gloo")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(args.threads)
    init_torch_distributed(rank, size, torch.device("cpu"))

    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randn(args.batch, args.width, generator=g)
    y = torch.randint(0, 10, (args.batch,), generator=g)

    base = big_mlp(args.width, args.depth)
    n_params = sum(p.numel() for p in base.parameters())
    variants = {"compute only": None, "one all-reduce after backward": None}
    variants.update({f"DDP, bucket {b:g} MB": b for b in args.buckets})

    def make(name):
        model = big_mlp(args.width, args.depth)
        if name.startswith("DDP"):
            model = DDP(model, bucket_cap_mb=variants[name], gradient_as_bucket_view=True)
            if args.transport == "mpi":
                dp.use_mpi_allreduce(model, comm)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if name.startswith("one"):
            reducer = OneAllreduce(model, comm, args.transport)
            return lambda: one_allreduce_step(model, opt, x, y, reducer)
        return lambda: plain_step(model, opt, x, y)

    steps = {name: make(name) for name in variants}
    times = {name: [] for name in variants}
    if rank == 0:
        print(f"ddp_overlap: {size} ranks, {args.threads} thread(s) each, MLP {args.depth}x{args.width} = "
              f"{n_params / 1e6:.1f}M parameters ({4 * n_params / 2**20:.0f} MiB of gradients), "
              f"batch {args.batch}/rank, transport {args.transport}", flush=True)
    for r in range(args.rounds):
        for name, step in steps.items():
            times[name] += dp.step_times(step, steps=args.steps, warmup=1 if r == 0 else 0, comm=comm)
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds} done", flush=True)

    if rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        compute, flat = med["compute only"], med["one all-reduce after backward"]
        print(f"\n{'variant':<32}{'step ms':>10}{'exposed comm ms':>17}{'speed-up vs one all-reduce':>28}")
        for name, t in med.items():
            ratio = "" if name == "compute only" else f"{flat / t:.2f}x"
            exposed = "" if name == "compute only" else f"{1000 * (t - compute):.1f}"
            print(f"{name:<32}{1000 * t:>10.1f}{exposed:>17}{ratio:>28}")
        best = min((k for k in med if k.startswith("DDP")), key=med.get)
        print(f"\nbest: {best}, {flat / med[best]:.2f}x the step speed of one all-reduce after backward "
              f"(medians of {args.rounds * args.steps} steps; machine shared, numbers are noisy)")
    from hpdl.rank import finish

    finish()  # DDP models collected, group let go, then exit without Python's shutdown


if __name__ == "__main__":
    main()
