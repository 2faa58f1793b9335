"""Ranks × threads × binding: total training throughput of a small data-parallel loop.

    .venv/bin/mpiexec -n 2 -bind-to core .venv/bin/python benchmarks/placement.py --threads 1

Every rank trains its own copy of an MLP on synthetic data with `--threads` torch threads and
all-reduces its gradients with MPI (mpi4py, in place) each step, so both the compute and the
communication feel a rank that is descheduled. Rank 0 prints one JSON line last:
{"ranks", "threads", "samples_per_s", "step_ms"} (samples over all ranks per second, median step).
Lesson 08 runs it under several placements; compare lines from one run, not across runs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--steps", type=int, default=20, help="timed steps (after 3 warm-up steps)")
    ap.add_argument("--batch", type=int, default=128, help="samples per rank per step")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    comm = MPI.COMM_WORLD
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10))
    x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
    flat = [p for p in model.parameters()]

    def step() -> None:
        model.zero_grad()
        F.cross_entropy(model(x), y).backward()
        for p in flat:
            comm.Allreduce(MPI.IN_PLACE, p.grad.numpy(), op=MPI.SUM)
        with torch.no_grad():  # plain SGD by hand: torch.optim's first optimizer costs each rank ~1.5 s to import
            for p in flat:
                p.add_(p.grad, alpha=-0.01)

    for _ in range(3):
        step()
    times = []
    for _ in range(args.steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step()
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    median = statistics.median(times)
    if comm.Get_rank() == 0:
        print(json.dumps({"ranks": comm.Get_size(), "threads": args.threads, "step_ms": round(median * 1e3, 3),
                          "samples_per_s": round(args.batch * comm.Get_size() / median, 1)}), flush=True)


if __name__ == "__main__":
    main()
