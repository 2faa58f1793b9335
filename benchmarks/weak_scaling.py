"""Claim: two ranks keep ≥ 0.85 of one rank's throughput each (weak scaling, one thread per rank).

    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/weak_scaling.py
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/weak_scaling.py --framework horovod --rounds 9
    .venv/bin/mpiexec -n 2 .venv/bin/python benchmarks/weak_scaling.py --transport mpi     # DDP over MPI

Weak scaling keeps the work per rank fixed (--batch-size images per rank per step) and adds
ranks. In one run, rounds alternate between

* one rank         rank 0 trains alone: plain PyTorch, no communication (the single-device
                   baseline), while the other ranks wait without using a core;
* all, no comm     every rank trains its own copy, no communication: what sharing the machine
                   (cores, memory bandwidth, other programs) costs by itself;
* all ranks        every rank trains with DDP (or Horovod), gradients all-reduced each step.

Every rank uses one torch thread (--threads), so each has one core's worth of compute in every
phase. Printed: images/s of the lone rank, images/s per rank in the other two phases, and the
weak-scaling efficiency (all ranks / one rank; 1.0 = perfect) split into its two factors, from
medians over the rounds.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from synthetic import MODELS, images_per_second, input_shape, make_model, setup, wrap  # benchmarks/synthetic.py


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--framework", choices=["ddp", "horovod"], default="ddp")
    ap.add_argument("--model", choices=list(MODELS), default="resnet_tiny")
    ap.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    ap.add_argument("--image-size", type=int, default=128, help="height and width of the ResNet's input images")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per phase per round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--transport", choices=["gloo", "mpi"], default="gloo",
                    help="DDP's all-reduce: Gloo, or MPI through a communication hook (hpdl.dp.use_mpi_allreduce)")
    args = ap.parse_args()

    from mpi4py import MPI

    from hpdl.bench import idle_wait

    device = setup(args.framework, args.threads)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    shape, classes = input_shape(args.model, args.image_size)
    g = torch.Generator().manual_seed(rank)
    data = torch.randn(args.batch_size, *shape, generator=g).to(device)
    target = torch.randint(0, classes, (args.batch_size,), generator=g).to(device)

    alone_model, alone_opt = wrap(make_model(args.model, device), "none", device)
    dp_model, dp_opt = wrap(make_model(args.model, device), args.framework, device)
    if args.framework == "ddp" and args.transport == "mpi":
        from hpdl.dp import use_mpi_allreduce

        use_mpi_allreduce(dp_model, comm)
    if rank == 0:
        n = sum(p.numel() for p in alone_model.parameters())
        print(f"weak_scaling: {args.model} ({n / 1e6:.2f}M parameters), {args.batch_size} images of "
              f"{'x'.join(map(str, shape))} per rank per step, {args.threads} thread(s) per rank, "
              f"{size} ranks with {args.framework}"
              + (f" over {args.transport}" if args.framework == "ddp" else ""), flush=True)

    alone, apart, together = [], [], []
    for r in range(args.rounds):
        if rank == 0:
            alone.append(statistics.median(images_per_second(
                alone_model, alone_opt, data, target, 1, args.steps, 1, device)))
        idle_wait(comm)  # the other ranks sleep meanwhile
        mine = statistics.median(images_per_second(alone_model, alone_opt, data, target, 1, args.steps, 1, device))
        apart.append(comm.allreduce(mine) / size)
        idle_wait(comm)
        mine = statistics.median(images_per_second(dp_model, dp_opt, data, target, 1, args.steps, 1, device))
        together.append(comm.allreduce(mine) / size)
        if rank == 0:
            print(f"  round {r + 1}/{args.rounds}: one rank {alone[-1]:.1f} img/s; per rank with {size}: "
                  f"{apart[-1]:.1f} without communication, {together[-1]:.1f} with {args.framework}", flush=True)

    if rank == 0:
        a, p, t = statistics.median(alone), statistics.median(apart), statistics.median(together)
        with_what = args.framework + (f" over {args.transport}" if args.framework == "ddp" else "")
        print(f"\n{'one rank alone:':<40}{a:8.1f} images/s")
        print(f"{f'{size} ranks, no communication, each:':<40}{p:8.1f} images/s   (sharing the machine: x{p / a:.2f})")
        print(f"{f'{size} ranks, {with_what}, each:':<40}{t:8.1f} images/s   (communication: x{t / p:.2f})")
        print(f"weak-scaling efficiency {t / a:.2f}  (goal ≥ 0.85; machine shared, numbers are noisy)")
    from hpdl.rank import finish

    finish()  # Horovod or the DDP group let go while Python lives; then exit without its shutdown


if __name__ == "__main__":
    main()
