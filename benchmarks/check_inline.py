"""How long a learner waits for an inline check: `hpdl.check("ring_allreduce", fn)` (or, with
--exercise allreduce_gradients, lesson 05's one flat all-reduce of the gradients; with --exercise
pipeline_step, lesson 10's 1F1B stage, one case of which holds the last stage still; with --exercise
overlap_allreduce, lesson 05's bucketed all-reduce during backward, whose ranks build optimizers).

Side by side in one run: a bare `mpiexec -n 4 python` that imports numpy and mpi4py (the floor
any fresh-ranks check pays), a check on 4 ranks only, and the default check (1, 2, 3 and 4
ranks). With --against REF, the same two checks are also timed with the kit as it was at git
commit REF (exported to a temporary folder), interleaved, so "before" and "after" share the
machine's load. Each check runs in a fresh Python process, as a learner's first call would.
Goal: the 4-rank check within 5 s on a 2-core laptop.

    .venv/bin/python benchmarks/check_inline.py --repeats 5 --against HEAD~1
    .venv/bin/python benchmarks/check_inline.py --repeats 3 --against HEAD~1 --exercise allreduce_gradients
    .venv/bin/python benchmarks/check_inline.py --repeats 3 --against HEAD --exercise overlap_allreduce
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
CHECK = """
import sys
sys.path.insert(0, {fixtures!r})
import hpdl
from learner_ring import ring_ok
r = hpdl.check("ring_allreduce", ring_ok, ranks={ranks!r})
assert r.passed, r
"""
FLAT = """
import hpdl
import torch
import torch.distributed as dist


def allreduce_gradients(comm, model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= comm.Get_size()
    for g, v in zip(grads, torch.split(flat, [g.numel() for g in grads])):
        g.copy_(v.view_as(g))


r = hpdl.check("allreduce_gradients", allreduce_gradients, ranks={ranks!r})
assert r.passed, r
"""
PIPE = """
import sys
sys.path.insert(0, {fixtures!r})
import hpdl
from learner_pipeline import run_order


def pipeline_step(comm, stage, batch, targets, m):
    p, s = comm.Get_size(), comm.Get_rank()
    warm = min(p - s - 1, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch))


r = hpdl.check("pipeline_step", pipeline_step, ranks={ranks!r})
assert r.passed, r
"""
SOLVED = """
import linecache, nbformat
import hpdl
nb = nbformat.read({solutions!r} + "/{notebook}", as_version=4)
cell = next(c.source for c in nb.cells if c.cell_type == "code" and "def {exercise}(" in c.source)
# as on the ranks, where the lesson imported these: the cell without its %%px
cell = "import torch\\nimport torch.distributed as dist\\n" + "\\n".join(
    line for line in cell.splitlines() if not line.startswith("%"))
linecache.cache["<solution>"] = (len(cell), None, cell.splitlines(True), "<solution>")
space = {{"__name__": "solution"}}
exec(compile(cell, "<solution>", "exec"), space)
r = hpdl.check("{exercise}", space["{exercise}"], ranks={ranks!r})
assert r.passed, r
"""
CHECKS = {"ring_allreduce": (CHECK, "4 ranks (6 cases)", "1-4 ranks (24 cases)"),
          "allreduce_gradients": (FLAT, "4 ranks (2 cases)", "1-3 ranks (6 cases)"),
          "pipeline_step": (PIPE, "4 ranks (5 cases)", "1-4 ranks (20 cases)"),
          # lesson 05's solution as learners are shown it; its ranks build torch optimizers
          "overlap_allreduce": (SOLVED.replace("{notebook}", "05_data_parallel.ipynb").replace(
              "{exercise}", "overlap_allreduce"), "4 ranks (3 cases)", "1-3 ranks (9 cases)")}


def timed(cmd: list[str], env: dict, cwd: str) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - t0


def export(ref: str, folder: Path) -> None:
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "hpdl"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--goal", type=float, default=5.0, help="seconds a 4-rank check may take")
    ap.add_argument("--against", default=None, help="a git commit to time beside the working tree")
    ap.add_argument("--exercise", choices=sorted(CHECKS), default="ring_allreduce", help="the exercise checked")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    from hpdl.launchers import mpiexec_command

    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, TQDM_DISABLE="1")
        env.pop("PYTHONPATH", None)
        variants = {"now": (env, tmp)}
        if args.against:
            before = Path(tmp) / "before"
            before.mkdir()
            export(args.against, before)
            variants[f"at {args.against}"] = (dict(env, PYTHONPATH=str(before)), str(before))
        env_now = dict(env, PYTHONPATH=str(ROOT))
        variants["now"] = (env_now, tmp)
        rows = {"bare mpiexec -n 4 (numpy + mpi4py)":
                ([*mpiexec_command(4), sys.executable, "-c", "import numpy; from mpi4py import MPI"], env, tmp)}
        template, four, default = CHECKS[args.exercise]
        for label, (venv, cwd) in variants.items():
            for ranks, what in (([4], four), (None, default)):
                code = template.format(fixtures=str(FIXTURES), solutions=str(ROOT / "solutions"), ranks=ranks)
                rows[f"check {what}, {label}"] = ([sys.executable, "-c", code], venv, cwd)
        times = {name: [] for name in rows}
        for _ in range(args.repeats):  # interleaved, so load from others on the machine hits all alike
            for name, (cmd, venv, cwd) in rows.items():
                times[name].append(timed(cmd, venv, cwd))
    floor = statistics.median(times["bare mpiexec -n 4 (numpy + mpi4py)"])
    print(f"{'what':<46} {'median s':>9} {'min s':>7} {'x bare':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<46} {med:>9.2f} {min(ts):>7.2f} {med / floor:>7.1f}")
    four = statistics.median(times[f"check {CHECKS[args.exercise][1]}, now"])
    print(f"goal {args.goal:g} s: 4-rank check now {four:.2f} s ({four / args.goal:.0%} of goal); "
          f"{args.repeats} repeats"
          " (each check in a fresh Python process: imports included)")
    if args.against:
        old = statistics.median(times[f"check {CHECKS[args.exercise][1]}, at {args.against}"])
        print(f"4-rank check: {old:.2f} s at {args.against} -> {four:.2f} s now ({four / old:.2f} x)")


if __name__ == "__main__":
    main()
