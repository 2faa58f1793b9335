"""Claim: DDP's step time against bucket_cap_mb is a U-curve; the best bucket size is reported
against the default (25 MB), and gradient_as_bucket_view against its default (False).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/ddp_buckets.py
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/ddp_buckets.py --layers 16 --width 1024 --rounds 5

One run; rounds alternate over all settings (each a fresh DDP model on the same process group,
gloo on CPU, NCCL on GPUs), and each setting keeps its best round's median step. The model is
`--layers` Linear(width, width) layers: with the defaults 2.1 M parameters, 8.4 MB of gradients,
so 25 MB is one bucket and 0.05 MB are ~170.
"""
from __future__ import annotations

import argparse
import statistics

from mpi4py import MPI

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from hpdl import dp, rank as ranklib


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--buckets", default="0.05,0.25,1,2,4,8,25,100")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    me, size = comm.Get_rank(), comm.Get_size()
    device, _, _ = ranklib.place()  # a GPU of its own per rank where there are GPUs, else the CPU
    ranklib.init_torch_distributed(me, size, device)
    torch.set_num_threads(1)
    x = torch.randn(args.batch, args.width, device=device)
    y = torch.randint(0, 10, (args.batch,), device=device)

    def model():
        torch.manual_seed(0)
        layers = [m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
        return nn.Sequential(*layers, nn.Linear(args.width, 10)).to(device)

    def ms(**kwargs) -> float:
        ddp = DDP(model(), **kwargs)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def step():
            opt.zero_grad()
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        return 1000 * statistics.median(dp.step_times(step, steps=args.steps, warmup=2))

    settings = {f"bucket_cap_mb={b}": {"bucket_cap_mb": float(b)} for b in args.buckets.split(",")}
    settings["bucket_cap_mb=25, gradient_as_bucket_view=True"] = {"gradient_as_bucket_view": True}
    best = {name: float("inf") for name in settings}
    for _ in range(args.rounds):
        for name, kwargs in settings.items():
            best[name] = min(best[name], ms(**kwargs))
    if me == 0:
        params = sum(p.numel() for p in model().parameters())
        print(f"DDP ({dist.get_backend()}), {size} ranks, {params / 1e6:.1f} M parameters "
              f"({params * 4 / 1e6:.1f} MB of gradients), best of {args.rounds} rounds")
        default = best["bucket_cap_mb=25"]
        for name, t in best.items():
            print(f"{name:<48} {t:8.2f} ms  {default / t:5.2f}× default")
        top = min((n for n in best if "view" not in n), key=best.get)
        print(f"best bucket: {top}, {default / best[top]:.2f}× the default (25 MB)")
    from hpdl.rank import finish

    finish()  # DDP models collected, group let go, then exit without Python's shutdown


if __name__ == "__main__":
    main()
