"""Claims: a pipeline's bubble is (p-1)/(m+p-1) for GPipe and 1F1B alike, and 1F1B holds at most p/m of
GPipe's activation memory once m >= 2p.

    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/pipeline_bubble.py
    .venv/bin/mpiexec -n 4 .venv/bin/python benchmarks/pipeline_bubble.py --stages 2 4 --micro 1 2 4 8 --repeat 5

An MLP of --layers Linear(W, W)+Tanh blocks is cut into p equal stages on ranks 0..p-1 (the other
ranks wait); one training step runs over m micro-batches of a fixed batch, with torch.distributed
send/recv (Gloo here, NCCL on GPUs), sends non-blocking as in lesson 10. The formula assumes equal
stages, so they are made equal: no narrower first or last layer, the loss is a cross-entropy over
W classes, and stage 0 also computes the gradient of its input, as every other stage must. The
column "stage max/mean" (the busiest stage's compute over the average stage's) shows what is left
of imbalance; with unequal stages the busiest one sets the pace and the bubble grows (lesson 10's
model shows that).

Method. Each rank times each forward and backward of a micro-batch in CPU time
(time.thread_time: it ticks only while the rank computes, one thread per rank), and
hpdl.pipeline.replay rebuilds the timeline the schedule would have with one core per rank and
free messages: an op starts when its stage is free and its input has arrived. The bubble is the
idle fraction of that timeline, 1 - busy / (p x span); the median over --repeat steps is printed
beside (p-1)/(m+p-1). This stays meaningful when 4 ranks share 2 cores, where wall-clock gaps
would mostly be waiting for a core. The wall-clock bubble is printed too, for reference: it
includes message time (Gloo over loopback, ~0.1-1 ms a message) and, at p > cores, core sharing.
Peak activation memory is exact: bytes autograd holds for backward on stage 0
(hpdl.pipeline.ActivationMeter), which holds the most.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpdl.pipeline import SCHEDULES, ActivationMeter, Recorder, bubble, bubble_formula, replay, wall_timeline
from hpdl.rank import init_torch_distributed


def model(width: int, layers: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])


def step(stage, order, m, batch, width, prev, nxt, x, y, record) -> None:
    """One training step of one stage (as in lesson 10): recv blocking, sends non-blocking."""
    inputs, outputs, sends = {}, {}, []
    for kind, i in order:
        if kind == "F":
            if prev is None:
                inp = x[i].requires_grad_()  # the same backward work as every other stage
            else:
                inp = torch.empty(batch // m, width)
                dist.recv(inp, src=prev)
                inp.requires_grad_()
            with record.op("F", i):
                out = stage(inp)
                if nxt is None:
                    out = F.cross_entropy(out, y[i]) / m
            if nxt is not None:
                sends.append(dist.isend(out.detach(), dst=nxt))
            inputs[i], outputs[i] = inp, out
        else:
            grad = None
            if nxt is not None:
                grad = torch.empty_like(outputs[i])
                dist.recv(grad, src=nxt)
            with record.op("B", i):
                outputs.pop(i).backward(grad)
            inp = inputs.pop(i)
            if prev is not None:
                sends.append(dist.isend(inp.grad, dst=prev))
    for work in sends:
        work.wait()


def measure(comm, schedule: str, p: int, m: int, args) -> dict | None:
    """Run `repeat` steps on ranks 0..p-1; on rank 0, the median bubbles and stage 0's peak bytes."""
    rank = comm.Get_rank()
    results = []
    for r in range(args.repeat + 1):  # the first step warms up
        ops, peak = None, 0
        if rank < p:
            per = args.layers // p
            stage = model(args.width, args.layers)[rank * per:(rank + 1) * per]
            g = torch.Generator().manual_seed(r)
            x = [c.clone() for c in torch.randn(args.batch, args.width, generator=g).chunk(m)]
            y = torch.randint(0, args.width, (args.batch,), generator=g).chunk(m)
            record = Recorder()
            with ActivationMeter() as meter:
                step(stage, SCHEDULES[schedule](p, m, rank), m, args.batch, args.width,
                     rank - 1 if rank > 0 else None, rank + 1 if rank < p - 1 else None, x, y, record)
            ops, peak = record.ops, meter.peak
        everyone = comm.gather((ops, peak), root=0)
        if rank == 0 and r > 0:
            ops_by_rank = [everyone[s][0] for s in range(p)]
            busy = [sum(op["cpu"] for op in ops) for ops in ops_by_rank]
            results.append((bubble(replay(ops_by_rank)), bubble(wall_timeline(ops_by_rank)), everyone[0][1],
                            max(busy) / statistics.mean(busy)))
    if rank != 0:
        return None
    return {"cpu": statistics.median(r[0] for r in results), "wall": statistics.median(r[1] for r in results),
            "peak": max(r[2] for r in results), "imbalance": statistics.median(r[3] for r in results)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8, help="divisible by every stage count")
    ap.add_argument("--batch", type=int, default=512, help="divisible by every micro-batch count")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--tolerance", type=float, default=0.10, help="relative, for the memory claim")
    args = ap.parse_args()

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    torch.set_num_threads(1)
    if max(args.stages) > size:
        need = max(args.stages)
        raise SystemExit(f"--stages up to {need} needs as many ranks; run with mpiexec -n {need}")
    init_torch_distributed(rank, size, torch.device("cpu"))
    t0 = time.perf_counter()
    cores = len(__import__("os").sched_getaffinity(0))
    if rank == 0:
        print(f"# pipeline bubble and activation memory: MLP {args.layers} x Linear({args.width}), batch {args.batch}, "
              f"{size} ranks on {cores} cores, median of {args.repeat} steps")
        print(f"{'schedule':<7}{'p':>3}{'m':>3}  {'bubble':>8}{'(p-1)/(m+p-1)':>15}{'diff':>8}{'stage max/mean':>16}"
              f"  {'wall':>6}{'peak KiB':>10}{'1F1B/GPipe':>12}{'p/m':>6}")
    table, claims = {}, []
    for p in args.stages:
        for m in args.micro:
            for name in SCHEDULES:
                table[name, p, m] = measure(comm, name, p, m, args)
            if rank != 0:
                continue
            for name in SCHEDULES:
                row, formula = table[name, p, m], bubble_formula(p, m)
                ratio = row["peak"] / table["GPipe", p, m]["peak"]
                flag = " (oversubscribed)" if p > cores else ""
                print(f"{name:<7}{p:>3}{m:>3}  {row['cpu']:>8.3f}{formula:>15.3f}{row['cpu'] - formula:>+8.3f}"
                      f"{row['imbalance']:>16.2f}  {row['wall']:>6.3f}{row['peak'] / 1024:>10.0f}{ratio:>12.2f}"
                      f"{p / m:>6.2f}{flag}", flush=True)
                if name == "1F1B" and m >= 2 * p:
                    claims.append((p, m, ratio, ratio <= p / m * (1 + args.tolerance)))
    if rank == 0:
        worst = max(abs(table[k]["cpu"] - bubble_formula(k[1], k[2])) for k in table)
        print(f"\nlargest |measured - (p-1)/(m+p-1)|: {worst:.3f}   ({time.perf_counter() - t0:.0f} s)")
        for p, m, ratio, ok in claims:
            print(f"1F1B peak activations at p={p}, m={m}: {ratio:.2f} of GPipe's, claim <= p/m = {p / m:.2f} "
                  f"(+{args.tolerance:.0%}): {'holds' if ok else 'FAILS'}")
    dist.barrier()
    from hpdl.rank import finish

    finish()  # DDP models collected, group let go, then exit without Python's shutdown


if __name__ == "__main__":
    main()
