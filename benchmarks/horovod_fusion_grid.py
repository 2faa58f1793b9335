"""Claim: Horovod's fusion threshold × cycle time grid has a best setting; its step time is
reported against the defaults (128 MiB × 1 ms).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/horovod_fusion_grid.py
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/horovod_fusion_grid.py --fusion 1,4,16,64,128 --cycle 0.5,1,2,5

One run; rounds alternate over the whole grid, Horovod restarted between settings (MPI stays
up: mpi4py started it first). Each setting keeps its best round's median training step with
hvd.DistributedOptimizer on a stack of Linear layers (many tensors, so fusion and the cycle
matter). Fusion stays on (threshold ≥ 1 MiB): Horovod 0.28.1 can crash restarting with fusion
off once a cycle time was set.
"""
from __future__ import annotations

import argparse
import statistics

from mpi4py import MPI  # first, so MPI outlives hvd.shutdown()

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from torch import nn

from hpdl import dp


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--fusion", default="1,8,32,128", help="MiB")
    ap.add_argument("--cycle", default="0.5,1,2,5", help="ms")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    fusions = [int(f) for f in args.fusion.split(",")]
    cycles = [float(c) for c in args.cycle.split(",")]
    x, y = torch.randn(64, args.width), torch.randint(0, 10, (64,))
    best = {}
    for _ in range(args.rounds):
        for f in fusions:
            for c in cycles:
                dp.restart_horovod(HOROVOD_FUSION_THRESHOLD=str(f << 20), HOROVOD_CYCLE_TIME=str(c))
                torch.manual_seed(0)
                model = nn.Sequential(*[m for _ in range(args.layers) for m in (nn.Linear(args.width, args.width),
                                                                              nn.ReLU())], nn.Linear(args.width, 10))
                opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                               named_parameters=model.named_parameters())

                def step():
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()
                t = 1000 * statistics.median(dp.step_times(step, steps=args.steps, warmup=3, comm=comm))
                best[f, c] = min(best.get((f, c), float("inf")), t)
    if comm.Get_rank() == 0:
        print(f"Horovod {hvd.size()} ranks, {args.layers + 1} layers ({2 * (args.layers + 1)} tensors), "
              f"ms per step, best of {args.rounds} rounds")
        print("fusion MiB \\ cycle ms" + "".join(f"{c:>8g}" for c in cycles))
        for f in fusions:
            print(f"{f:>20} " + "".join(f"{best[f, c]:8.2f}" for c in cycles))
        top = min(best, key=best.get)
        default = best.get((128, 1.0))
        if default:
            print(f"best {top[0]} MiB × {top[1]:g} ms: {best[top]:.2f} ms, {default / best[top]:.2f}× the default "
                  f"(128 MiB × 1 ms: {default:.2f} ms)")
    hvd.shutdown()


if __name__ == "__main__":
    main()
