"""Claim: per-rank model-state memory of DDP, ZeRO stages 1–3 (built by hand in lesson 11) and FSDP2
follows ZeRO's accounting — 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N, 16Ψ/N bytes with mixed-precision Adam — within
10 %, and each rank sends 2(N−1)/N·Ψ elements per step (DDP, stages 1–2) or 3(N−1)/N·Ψ (stage 3, FSDP2).

    .venv/bin/python benchmarks/sharding_memory.py
    .venv/bin/python benchmarks/sharding_memory.py --ranks 2 3 4 --steps 5

The trainers are the lesson's own: the classes DDP, Zero1, Zero2, Zero3 and FSDPTrainer/fsdp_model, and
the running model, are read from notebooks/11_sharding_memory.ipynb and executed as written there (only
their definitions: imports, functions, classes and upper-case constants). For each rank count the
script starts itself under `mpiexec -n N`; each trainer runs one step, then --steps measured steps of
the lesson's task.

Method. Memory is exact, not sampled: the bytes of every distinct tensor storage a trainer reaches
(parameters, gradients, optimizer state, the gathered units), counted just before the optimizer
step, when all of them exist (hpdl.sharding.held_bytes). Traffic counts what each torch.distributed
collective moves per rank at the ring's lower bound ((N−1)/N of an all-gathered or reduce-scattered
tensor, twice that for an all-reduce; hpdl.sharding.count_traffic), FSDP2's own calls included.
Activations are left out of both the measurement and the formulas.

FSDP2's knobs, each beside the default in the same run: `reshard_after_forward=False` and an explicit
prefetch of two units (`set_modules_to_forward_prefetch` / `set_modules_to_backward_prefetch`). For
each, the state a rank holds between forward and backward (where resharding matters: 16Ψ/N, or
16Ψ/N + 2Ψ when every unit stays gathered), the traffic per step, and the median step time (slowest
rank; on a shared CPU a ratio, not a speed). The last line is the largest |measured / formula − 1|
over every memory figure above it.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LESSON = ROOT / "notebooks" / "11_sharding_memory.ipynb"
NAMES = ("DDP", "Zero1", "Zero2", "Zero3", "FSDP2")
KNOBS = {"default": {}, "no reshard": {"reshard_after_forward": False}, "prefetch 2": {"prefetch": 2}}


def lesson_definitions(namespace: dict) -> None:
    """Run the lesson's imports, functions, classes and UPPER_CASE constants into `namespace`."""
    import nbformat

    nb = nbformat.read(LESSON, as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        tree = ast.parse("\n".join(lines))
        keep = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom, ast.FunctionDef,
                                                                 ast.ClassDef))
                or (isinstance(node, ast.Assign) and all(isinstance(t, (ast.Name, ast.Tuple)) and all(
                    n.id.isupper() for n in ast.walk(t) if isinstance(n, ast.Name)) for t in node.targets))]
        exec(compile(ast.Module(body=keep, type_ignores=[]), str(LESSON), "exec"), namespace)


def measure(args) -> None:
    """On every rank: each trainer's state bytes and traffic per step; rank 0 prints one JSON line each."""
    import torch
    from mpi4py import MPI

    from hpdl.rank import init_torch_distributed

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    init_torch_distributed(rank, world, torch.device("cpu"))
    ns = {"rank": rank, "world_size": world}
    lesson_definitions(ns)
    x, y = ns["X"][rank::world], ns["Y"][rank::world]
    psi = ns["PSI"]
    make = {name: (lambda n=name: ns[n](ns["new_model"]())) for name in NAMES[:4]}
    make["FSDP2"] = lambda: ns["FSDPTrainer"](ns["fsdp_model"]())
    formula = {"DDP": 16 * psi, "Zero1": 4 * psi + 12 * psi / world, "Zero2": 2 * psi + 14 * psi / world,
               "Zero3": 16 * psi / world, "FSDP2": 16 * psi / world}
    passes = {"DDP": 2, "Zero1": 2, "Zero2": 2, "Zero3": 3, "FSDP2": 3}
    import hpdl.sharding

    for name in NAMES:
        trainer, probe = make[name](), {}
        ns["train_step"](trainer, x, y)                 # a first step: torch's Adam makes its state lazily
        with hpdl.sharding.count_traffic(world) as traffic:
            for _ in range(args.steps):
                ns["train_step"](trainer, x, y, probe)
        states = comm.gather(probe["state"], root=0)
        if rank == 0:
            print(json.dumps({"ranks": world, "name": name, "psi": psi, "state": max(states),
                              "formula": formula[name], "elements": traffic.elements / args.steps,
                              "elements_formula": passes[name] * (world - 1) / world * psi}), flush=True)
    measure_knobs(ns, comm, x, y, args.steps)
    from hpdl.rank import finish

    finish()  # the trainers still hold their groups: end without interpreter shutdown


def measure_knobs(ns: dict, comm, x, y, steps: int) -> None:
    """FSDP2 with each of KNOBS: state between forward and backward, traffic, median step time."""
    from mpi4py import MPI

    import hpdl.sharding

    world, psi = comm.Get_size(), ns["PSI"]
    for name, kwargs in KNOBS.items():
        trainer, probe, times = ns["FSDPTrainer"](ns["fsdp_model"](**kwargs)), {}, []
        trainer.model.register_forward_hook(lambda *_: probe.__setitem__("after", ns["state_bytes"](trainer)))
        ns["train_step"](trainer, x, y)
        with hpdl.sharding.count_traffic(world) as traffic:
            for _ in range(steps):
                t0 = time.perf_counter()
                ns["train_step"](trainer, x, y)
                times.append(time.perf_counter() - t0)
        after = comm.allreduce(probe["after"], op=MPI.MAX)
        seconds = comm.allreduce(sorted(times)[len(times) // 2], op=MPI.MAX)
        gathered = 2 * psi if kwargs.get("reshard_after_forward") is False else 0
        if comm.Get_rank() == 0:
            print(json.dumps({"ranks": world, "knob": name, "psi": psi, "after": after, "seconds": seconds,
                              "formula": 16 * psi / world + gathered, "elements": traffic.elements / steps}),
                  flush=True)


def report(rows: list[dict]) -> None:
    knobs = [r for r in rows if "knob" in r]
    rows = [r for r in rows if "knob" not in r]
    print(f"{'ranks':>5} {'trainer':<7}{'state MiB':>10}{'formula':>9}{'error':>8}{'sent/Ψ':>8}{'formula':>8}")
    worst = 0.0
    for r in rows:
        err = r["state"] / r["formula"] - 1
        worst = max(worst, abs(err))
        print(f"{r['ranks']:>5} {r['name']:<7}{r['state'] / 2**20:>10.3f}{r['formula'] / 2**20:>9.3f}{err:>8.2%}"
              f"{r['elements'] / r['psi']:>8.3f}{r['elements_formula'] / r['psi']:>8.3f}")
    print(f"\nFSDP2's knobs\n{'ranks':>5} {'knob':<11}{'after fwd MiB':>14}{'formula':>9}{'error':>8}{'sent/Ψ':>8}"
          f"{'ms/step':>9}{'÷ default':>10}")
    default = {r["ranks"]: r for r in knobs if r["knob"] == "default"}
    for r in knobs:
        err = r["after"] / r["formula"] - 1
        worst = max(worst, abs(err))
        print(f"{r['ranks']:>5} {r['knob']:<11}{r['after'] / 2**20:>14.3f}{r['formula'] / 2**20:>9.3f}{err:>8.2%}"
              f"{r['elements'] / r['psi']:>8.3f}{1e3 * r['seconds']:>9.0f}"
              f"{r['seconds'] / default[r['ranks']]['seconds']:>10.2f}")
    print(f"max memory error = {100 * worst:.2f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args()
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_SIZE" in os.environ:
        measure(args)
        return
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    rows = []
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    for n in args.ranks:
        cmd = [mpiexec, "-n", str(n), sys.executable, __file__, "--steps", str(args.steps)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if done.returncode != 0:
            sys.exit(f"{n} ranks failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}")
        rows += [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    report(rows)


if __name__ == "__main__":
    main()
