"""Claim: on this machine hpdl.predict gets weak-scaling efficiency within 10% for 1…N ranks,
from α, β, γ and the compute per sample measured here — while each rank has a core.

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/predict_here.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/predict_here.py --batch-size 16 --rounds 5

On the first k ranks (k = 1…N; the others sleep) DDP trains resnet_tiny on 3×64×64 images,
reducing its gradient over MPI (hpdl.dp.use_mpi_allreduce); rounds alternate over k, and each
k keeps the median over rounds. α and β are fitted to MPI's all-reduce around the gradient's
size on the ranks that have a core (lesson 07's calibration; a ping-pong's are printed beside
them, with what they would predict), γ comes from a local add, the compute
per step from the same forward, backward and update without the all-reduce (DDP's no_sync), on
k ranks at once: one rank alone gives the time per sample, k ≤ cores ranks at once the
contention between ranks that each have a core (memory bandwidth, caches, clocks) — a measured
input, printed as such. Beyond the cores the model's own time-sharing (⌈k / cores⌉ turns) is
printed next to the measured compute as its check. Printed per k: measured and predicted
efficiency and their ratio. Left out, and visible when ranks outnumber cores: ranks that take
turns on a core also take turns to communicate (see lesson 09).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from mpi4py import MPI
    from torch.nn.parallel import DistributedDataParallel as DDP

    import hpdl.bench as bench
    import hpdl.dp
    import hpdl.models
    from hpdl import predict
    from hpdl.rank import init_torch_distributed

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    init_torch_distributed(rank, size, torch.device("cpu"))
    cores = len(os.sched_getaffinity(0))

    groups = {k: (dist.new_group(list(range(k))), bench.first_ranks(comm, k)) for k in range(1, size + 1)}
    models = {}
    for k, (group, sub) in groups.items():
        if rank < k:
            torch.manual_seed(0)
            model = DDP(hpdl.models.resnet_tiny(), process_group=group)
            hpdl.dp.use_mpi_allreduce(model, sub)
            models[k] = (model, torch.optim.SGD(model.parameters(), lr=0.01))
        bench.idle_wait(comm)
    x = torch.randn(args.batch_size, 3, args.image_size, args.image_size)
    y = torch.randint(0, 1000, (args.batch_size,))

    def step_seconds(k: int, *, communicate: bool = True) -> float | None:
        """Median seconds per step on the first k ranks (the slowest rank's, step by step).
        communicate=False: the same forward and backward without DDP's all-reduce (no_sync), so
        k ranks compute at once and share only the machine — the measured compute input."""
        group, sub = groups[k]
        out = None
        if rank < k:
            model, opt = models[k]

            def train_step():
                opt.zero_grad()
                F.cross_entropy(model(x), y).backward()
                opt.step()

            def compute_step():
                with model.no_sync():
                    opt.zero_grad()
                    F.cross_entropy(model(x), y).backward()
                    opt.step()

            fn = train_step if communicate else compute_step
            out = statistics.median(hpdl.dp.step_times(fn, steps=args.steps, warmup=1, comm=sub))
        bench.idle_wait(comm)
        return comm.bcast(out, root=0)

    times: dict[int, list[float]] = {k: [] for k in groups}
    computes: dict[int, list[float]] = {k: [] for k in groups}
    for r in range(args.rounds):
        for k in groups:
            times[k].append(step_seconds(k))
            computes[k].append(step_seconds(k, communicate=False))
        if rank == 0:
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(
                f"{k} ranks {times[k][-1] * 1e3:.0f} ms (compute only {computes[k][-1] * 1e3:.0f})" for k in groups),
                flush=True)

    # inputs of the model, measured here: γ from a local add; α and β two ways, from a ping-pong
    # and fitted to MPI's own all-reduce around the gradient's size on the ranks that have a core
    params = sum(p.numel() for p in hpdl.models.resnet_tiny().parameters())
    pair = min(cores, size)
    local = bench.local_reduce()
    fit = bench.fit_alpha_beta_gamma(bench.pingpong(comm), local)
    calibrated = None
    if pair >= 2:
        sizes = bench.message_sizes(8, 512, 8) + bench.message_sizes(4 * params // 4, 4 * params * 4, 2)
        sweep = bench.sweep(bench.library("allreduce"), groups[pair][1], sizes, budget=0.1) if rank < pair else None
        bench.idle_wait(comm)
        calibrated = bench.fit_allreduce(comm.bcast(sweep, root=0), local)

    if rank == 0:
        compute = {k: statistics.median(computes[k]) for k in groups}
        busy = [k for k in groups if k <= cores]
        contention = tuple(compute[k] / compute[1] for k in busy)
        def system(f: dict, how: str) -> predict.System:
            link = predict.Network(f"MPI over shared memory ({how})", f["alpha"], f["beta"])
            return predict.System("this machine", link, link, fit["gamma"], per_node=size, cores=cores,
                                  contention=contention)

        work = predict.Workload("resnet_tiny", params, compute[1] / args.batch_size, args.batch_size, overlap=False)
        by_pingpong = predict.predict(work, system(fit, "ping-pong"), list(groups))
        rows = predict.predict(work, system(calibrated or fit, "all-reduce"), list(groups))
        base = statistics.median(times[1])
        print(f"\nInputs, all measured here: γ = 1/({1e-9 / fit['gamma']:.1f} GB/s) (local add); "
              f"{work.grad_bytes / 1e6:.2f} MB of gradients; {cores} cores;")
        for how, f in (("ping-pong", fit), (f"MPI_Allreduce on {pair} ranks, fitted to the ring model", calibrated)):
            if f:
                gradient = predict.allreduce_seconds(work.grad_bytes, max(2, pair), f["alpha"], f["beta"], fit["gamma"])
                print(f"  α = {f['alpha'] * 1e6:.1f} µs, β = 1/({1e-9 / f['beta']:.1f} GB/s) from a {how}: "
                      f"an all-reduce of the gradient on {max(2, pair)} ranks takes {gradient * 1e3:.2f} ms")
        print(f"  compute per step of {args.batch_size} (forward, backward, update; no all-reduce), median of "
              f"{args.rounds} rounds, k ranks computing at once: "
              + ", ".join(f"{k}: {compute[k] * 1e3:.1f} ms" for k in groups))
        print("  contention (compute with k ranks at once ÷ one rank alone), a measured input: "
              + ", ".join(f"{k}: {c:.2f}" for k, c in zip(busy, contention)))
        print("\nEfficiency; predicted with α and β from the all-reduce (and, for comparison, the ping-pong)")
        print(f"{'ranks':>5}{'measured':>10}{'predicted':>11}{'ratio':>8}{'(ping-pong)':>13}   "
              f"{'compute: predicted':>18}{'measured':>10}   {'step − compute: predicted':>25}{'measured':>10}")
        worst = 0.0
        for k, row, pp in zip(groups, rows, by_pingpong):
            measured = base / statistics.median(times[k])
            ratio = row["efficiency"] / measured
            if k <= cores:
                worst = max(worst, abs(ratio - 1))
            print(f"{k:>5}{measured:10.2f}{row['efficiency']:11.2f}{ratio:8.2f}{pp['efficiency']:13.2f}   "
                  f"{row['compute'] * 1e3:16.1f}ms{compute[k] * 1e3:8.1f}ms"
                  f"{row['exposed'] * 1e3:26.2f}ms{(statistics.median(times[k]) - compute[k]) * 1e3:8.2f}ms"
                  + (f"   ranks outnumber cores: {row['oversubscribed']} turns per core" if k > cores else ""))
        print("\n(compute for k ≤ cores is the measured input itself; beyond, the model's ⌈k / cores⌉ turns "
              "are checked against the measured compute. step − compute: the all-reduce the model exposes, against "
              "what the measured step spends beyond the measured compute — communication, DDP's own work and ranks "
              "waiting for each other)")
        print(f"largest |predicted / measured − 1| while each rank has a core: {worst:.0%} (goal ≤ 10%)")
    for k, (group, sub) in groups.items():
        if sub != MPI.COMM_NULL:
            sub.Free()
    models.clear()  # the DDP models hold the groups
    from hpdl.rank import finish

    finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
