"""Claim: the overlap read from every rank's merged profiler trace agrees with DDP's own account.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/trace_overlap.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/trace_overlap.py --steps 8 --out ddp.trace.json

Each rank trains a plain MLP under DDP (small buckets, so backward fills several), profiles a few
steps with torch.profiler and marks the instant after a barrier that every rank shares
(`hpdl.traces.mark_start`); rank 0 gathers the traces onto one clock (`hpdl.traces.gather`).
From the merged trace, per rank and step: the span of backward's compute, the span of the bucket
all-reduces, and where they meet (`hpdl.traces.step_overlap`, DDP's own definitions). DDP measures
the same three itself (`_get_ddp_logging_data`, every step sampled); it records a step's
communication when the next step begins, so step i of the trace is paired with DDP's sample after
step i + 1.

Printed per rank: medians of both accounts and the overlap fraction (overlap / communication span);
last line `max |trace / DDP - 1| = X %` over the ranks' communication spans.
`--out` writes the merged trace (open it at ui.perfetto.dev) and both accounts, as JSON beside it.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn as nn
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import profile, record_function

from hpdl import traces
from hpdl.rank import finish, init_torch_distributed

KEYS = ("compute_ms", "comm_ms", "overlap_ms", "fraction")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="profiled steps (after 3 warm-up steps)")
    ap.add_argument("--width", type=int, default=512, help="width of each Linear layer")
    ap.add_argument("--depth", type=int, default=6, help="Linear layers (one bucket each at 1 MB)")
    ap.add_argument("--bucket-mb", type=float, default=1.0, help="DDP's bucket_cap_mb")
    ap.add_argument("--out", type=Path, help="write the merged trace here, and both accounts beside it")
    args = ap.parse_args()
    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_torch_distributed(comm.rank, comm.size, torch.device("cpu"))
    torch.manual_seed(0)
    layers = [m for _ in range(args.depth) for m in (nn.Linear(args.width, args.width), nn.ReLU())]
    model = DDP(nn.Sequential(*layers), bucket_cap_mb=args.bucket_mb)
    model._set_ddp_runtime_logging_sample_rate(1)  # DDP's own timings on every step, not every 100th
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, args.width)

    def step() -> None:
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()

    for _ in range(3):
        step()
    own = []
    with profile(activities=traces.activities()) as prof:
        traces.mark_start(comm)
        for i in range(args.steps + 1):
            with record_function(f"step {i}"):
                step()
            own.append(traces.ddp_overlap(model))
    trace = traces.gather(prof, comm)
    accounts = comm.gather({"ddp": own[1:], "buckets": model._get_ddp_logging_data().get("num_buckets_reduced")})
    if comm.rank == 0:
        report(trace, accounts, args.steps, args.out)
    finish()  # the group let go, then exit without Python's shutdown (a Gloo thread could abort it)


def report(trace: dict, accounts: list[dict], n: int, out: Path | None) -> None:
    worst = 0.0
    print(f"{len(accounts)} ranks, {n} steps; medians in ms "
          "(compute, communication, overlap; fraction = overlap / comm)")
    rows = {}
    from_trace = traces.overlap(trace, first=n)
    for rank, acc in enumerate(accounts):
        mine = from_trace[rank]
        ddp = {k: statistics.median(s[k] for s in acc["ddp"][:n]) for k in KEYS[:3]}
        ddp["fraction"] = ddp["overlap_ms"] / ddp["comm_ms"] if ddp["comm_ms"] else 0.0
        rows[rank] = {"trace": mine, "ddp": ddp, "buckets": acc["buckets"]}
        for name, d in (("trace", mine), ("DDP's own", ddp)):
            print(f"rank {rank} {name:<10} " + "  ".join(f"{k} {d[k]:6.2f}" for k in KEYS))
        worst = max(worst, abs(mine["comm_ms"] / ddp["comm_ms"] - 1) if ddp["comm_ms"] else 1.0)
    if out:
        traces.save(trace, out)
        out.with_suffix(".accounts.json").write_text(json.dumps(rows))
        print(f"merged trace: {out} (open it at ui.perfetto.dev)")
    print(f"max |trace / DDP - 1| = {100 * worst:.1f} %")


if __name__ == "__main__":
    main()
