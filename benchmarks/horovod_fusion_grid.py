"""Claim: Horovod's fusion threshold × cycle time grid has a best setting; its step time is
reported against the defaults (128 MiB × 1 ms).

    .venv/bin/python benchmarks/horovod_fusion_grid.py
    .venv/bin/python benchmarks/horovod_fusion_grid.py --fusion 1,4,16,64,128 --cycle 0.5,1,2,5 --rounds 3
    .venv/bin/python benchmarks/horovod_fusion_grid.py --autotune 300   # Horovod's own search instead

Each setting is a fresh `mpiexec -n RANKS` job with HOROVOD_FUSION_THRESHOLD and
HOROVOD_CYCLE_TIME in its environment, as on a cluster: restarting Horovod inside one job with
another cycle time can crash Horovod 0.28.1 (a segmentation fault in its background thread).
Rounds alternate over the whole grid; each setting keeps its best round. A job times the median
training step of hvd.DistributedOptimizer on a stack of Linear layers (many tensors, so fusion
and the cycle matter) and prints one JSON line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path


def one_setting(layers: int, width: int, steps: int, untimed: bool = False) -> None:
    """Run on the ranks of one job: time training steps under this job's Horovod settings."""
    from mpi4py import MPI  # first, so MPI is MPICH's and outlives Horovod

    import horovod.torch as hvd
    import torch
    import torch.nn.functional as F
    from torch import nn

    from hpdl import dp

    hvd.init()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())],
                          nn.Linear(width, 10))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01),
                                   named_parameters=model.named_parameters())
    x, y = torch.randn(64, width), torch.randint(0, 10, (64,))

    def step():
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
    if untimed:  # the autotuner measures (and logs) by itself
        for _ in range(steps):
            step()
        hvd.shutdown()
        return
    ms = 1000 * statistics.median(dp.step_times(step, steps=steps, warmup=3, comm=MPI.COMM_WORLD))
    if hvd.rank() == 0:
        print(json.dumps({"ms": ms}), flush=True)
    hvd.shutdown()


def _job(ranks: int, args, steps: int, *extra: str) -> list[str]:
    """One fresh job of RANKS ranks of this script: the kit's mpiexec with its MPI's flags, or inside
    a Slurm job an `srun --overlap` step beside the engines (an mpiexec there would go through srun
    and wait for the CPUs they hold). Its tensors stay on the CPU, so it asks for no GPU."""
    from hpdl.launchers import side_job_command

    return [*side_job_command(ranks, gpus=False), sys.executable, __file__, "--one", *extra,
            "--layers", str(args.layers), "--width", str(args.width), "--steps", str(steps)]


def run(ranks: int, fusion_mib: float, cycle_ms: float, args) -> float:
    env = dict(os.environ, HOROVOD_FUSION_THRESHOLD=str(int(fusion_mib * 2**20)), HOROVOD_CYCLE_TIME=str(cycle_ms),
               OMP_NUM_THREADS="1")
    cmd = _job(ranks, args, args.steps)
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise SystemExit(f"the job for {fusion_mib} MiB × {cycle_ms} ms failed:\n{(out.stdout + out.stderr)[-2000:]}")
    return json.loads(lines[-1])["ms"]


def autotune(ranks: int, steps: int, args) -> list[list[str]]:
    """One job trained with HOROVOD_AUTOTUNE=1; the rows of its log (header first).

    Horovod's autotuner scores samples of HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE steps each (Bayesian
    optimisation over fusion threshold, cycle time and more) and writes one CSV row per sample.
    """
    import csv
    import tempfile

    with tempfile.TemporaryDirectory(prefix="hpdl-autotune-") as tmp:
        log = Path(tmp) / "autotune.csv"
        env = dict(os.environ, HOROVOD_AUTOTUNE="1", HOROVOD_AUTOTUNE_LOG=str(log), OMP_NUM_THREADS="1",
                   HOROVOD_AUTOTUNE_WARMUP_SAMPLES="1", HOROVOD_AUTOTUNE_STEPS_PER_SAMPLE="5")
        cmd = _job(ranks, args, steps, "--untimed")
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        if out.returncode != 0:
            raise SystemExit(f"the autotuned job failed:\n{(out.stdout + out.stderr)[-2000:]}")
        return list(csv.reader(log.open())) if log.exists() else []


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--fusion", default="1,8,32,128", help="MiB")
    ap.add_argument("--cycle", default="0.5,1,2,5", help="ms")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print the grid as one JSON line at the end")
    ap.add_argument("--autotune", type=int, metavar="STEPS", help="instead of the grid: train STEPS steps with "
                    "HOROVOD_AUTOTUNE=1 and print its log (one JSON line of rows, header first)")
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--untimed", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        return one_setting(args.layers, args.width, args.steps, args.untimed)
    if args.autotune:
        rows = autotune(args.ranks, args.autotune, args)
        print(f"HOROVOD_AUTOTUNE, {args.ranks} ranks, {args.autotune} steps: {max(len(rows) - 1, 0)} samples logged")
        print(json.dumps(rows))
        return None
    fusions = [float(f) for f in args.fusion.split(",")]
    cycles = [float(c) for c in args.cycle.split(",")]
    best: dict[tuple[float, float], float] = {}
    for r in range(args.rounds):
        for f in fusions:
            for c in cycles:
                t = run(args.ranks, f, c, args)
                best[f, c] = min(best.get((f, c), float("inf")), t)
    print(f"Horovod, {args.ranks} ranks, {args.layers + 1} layers ({2 * (args.layers + 1)} tensors): "
          f"ms per training step, best of {args.rounds} rounds")
    print("fusion MiB \\ cycle ms" + "".join(f"{c:>8g}" for c in cycles))
    for f in fusions:
        print(f"{f:>20g} " + "".join(f"{best[f, c]:8.2f}" for c in cycles))
    top = min(best, key=best.get)
    default = best.get((128.0, 1.0))
    if default:
        print(f"best {top[0]:g} MiB × {top[1]:g} ms: {best[top]:.2f} ms, {default / best[top]:.2f}× the default "
              f"(128 MiB × 1 ms: {default:.2f} ms)")
    if args.json:
        print(json.dumps({f"{f:g},{c:g}": t for (f, c), t in best.items()}))


if __name__ == "__main__":
    main()
