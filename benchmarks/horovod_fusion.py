"""Claim: Horovod's tensor fusion makes the communication of many small gradients several times faster.

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/horovod_fusion.py
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/horovod_fusion.py --layers 200 --width 32 --rounds 5

The model is a deep stack of small Linear layers: hundreds of small gradient tensors, the case
fusion exists for. In one run, rounds alternate between two Horovod settings, restarting Horovod
in between (MPI stays up because mpi4py started it):

* fusion on    HOROVOD_FUSION_THRESHOLD at its default (128 MiB): the tensors ready in a cycle
               are copied into one buffer and reduced with one collective;
* fusion off   HOROVOD_FUSION_THRESHOLD=0: one collective per tensor.

Per setting, the step's communication is measured three ways:

* all gradients submitted at once (allreduce_async_, then synchronize), the time Horovod spends
  inside its reductions, read from its own timeline (the union of the ALLREDUCE spans: memory
  copies and collectives, not negotiation or cycle waits);
* the same, as wall time from the first submission to the last result (this also holds Python's
  loop submitting hundreds of tensors and the wait for the next cycle, alike with and without
  fusion);
* in real training steps with hvd.DistributedOptimizer, the time spent in opt.step(): backward
  has submitted every gradient by then, so this is the communication the step could not hide.

Printed: medians and the ratios fusion off / fusion on. On a small machine, Horovod's background
thread busy-waits in MPI while it waits for the other ranks, taking cycles from the ranks' own
threads: expect noisy numbers when the ranks have fewer cores than threads.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

from mpi4py import MPI  # first, so MPI outlives hvd.shutdown() and Horovod can start again

import horovod.torch as hvd
import torch
import torch.nn as nn

SETTINGS = {"fusion on": None, "fusion off": "0"}


def many_small_tensors(layers: int, width: int) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.Tanh())])


def start_horovod(threshold: str | None) -> None:
    """(Re)start Horovod with a fusion threshold (read only in hvd.init()), timeline on demand."""
    from hpdl.dp import restart_horovod

    restart_horovod(HOROVOD_FUSION_THRESHOLD=threshold, HOROVOD_TIMELINE="DYNAMIC")


def reduction_ms(grads, comm, repeats: int) -> float | None:
    """Per step, the time Horovod spent inside reductions, from its timeline (rank 0; None elsewhere)."""
    from hpdl import timeline

    path = os.path.join(tempfile.gettempdir(), f"hpdl-fusion-{os.getpid()}.json")
    hvd.start_timeline(path)
    time_communication(grads, comm, repeats)
    hvd.stop_timeline()
    if comm.Get_rank() != 0:
        return None
    busy = timeline.load(path).busy_ms("ALLREDUCE")
    os.remove(path)
    return busy / repeats


def time_communication(grads, comm, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        handles = [hvd.allreduce_async_(g, name=f"grad.{i}", op=hvd.Average) for i, g in enumerate(grads)]
        for h in handles:
            hvd.synchronize(h)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return times


def time_training(model, x, y, comm, repeats: int) -> tuple[list[float], list[float]]:
    """Whole DistributedOptimizer steps, and the part spent in opt.step(): there it waits for the
    all-reduces that backward started, so that part is the step's exposed communication."""
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=1e-3),
                                   named_parameters=model.named_parameters())
    steps, waits = [], []
    for i in range(repeats + 1):
        comm.Barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        if i:  # the first step registers the tensors' names: not timed
            steps.append(comm.allreduce(t2 - t0, op=MPI.MAX))
            waits.append(comm.allreduce(t2 - t1, op=MPI.MAX))
    return steps, waits


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=200, help="Linear layers (2 tensors each)")
    ap.add_argument("--width", type=int, default=32)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=10, help="timed steps per setting per round")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    # Horovod 0.28.1 can crash (SIGSEGV in its parameter manager) when restarted with fusion off
    # after a start with HOROVOD_CYCLE_TIME set: the cycle time stays at its 1 ms default here.
    os.environ.pop("HOROVOD_CYCLE_TIME", None)
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()

    model = many_small_tensors(args.layers, args.width)
    x = torch.randn(args.batch, args.width)
    y = torch.randn(args.batch, args.width)
    nn.functional.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    if rank == 0:
        print(f"horovod_fusion: {comm.Get_size()} ranks, {len(grads)} gradient tensors "
              f"({nbytes / 1024:.0f} KiB in all, {nbytes / len(grads):.0f} B on average), "
              "cycle time 1 ms", flush=True)

    comm_t = {k: [] for k in SETTINGS}
    busy_t = {k: [] for k in SETTINGS}
    step_t = {k: [] for k in SETTINGS}
    wait_t = {k: [] for k in SETTINGS}
    for r in range(args.rounds):
        for name, threshold in SETTINGS.items():
            start_horovod(threshold)
            time_communication(grads, comm, 2)  # warm-up: negotiation of new names
            comm_t[name] += time_communication(grads, comm, args.repeats)
            busy_t[name].append(reduction_ms(grads, comm, 3))
            steps, waits = time_training(many_small_tensors(args.layers, args.width), x, y, comm, args.repeats)
            step_t[name] += steps
            wait_t[name] += waits
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds} done", flush=True)
    hvd.shutdown()

    if rank == 0:
        med = lambda d, scale=1000: {k: scale * statistics.median(v) for k, v in d.items()}  # noqa: E731
        c, b, s, w = med(comm_t), med(busy_t, 1), med(step_t), med(wait_t)
        rows = [("all gradients at once: time inside reductions (timeline)", b),
                ("all gradients at once: first submission to last result", c),
                ("training step: waiting in opt.step() (exposed communication)", w),
                ("training step: whole", s)]
        print(f"\n{'ms per step':<64}{'fusion on':>10}{'fusion off':>11}{'off/on':>8}")
        for label, d in rows:
            print(f"{label:<64}{d['fusion on']:>10.2f}{d['fusion off']:>11.2f}"
                  f"{d['fusion off'] / d['fusion on']:>7.1f}x")
        print(f"\nwith fusion, step communication is {b['fusion off'] / b['fusion on']:.1f}x faster inside Horovod's "
              f"reductions and {w['fusion off'] / w['fusion on']:.1f}x less exposed in a training step; medians over "
              f"{args.rounds} rounds (machine shared, numbers are noisy)")

if __name__ == "__main__":
    main()
