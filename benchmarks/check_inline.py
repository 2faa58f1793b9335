"""How long a learner waits for an inline check: `hpdl.check("ring_allreduce", fn)`.

Side by side in one run: a bare `mpiexec -n 4 python` that imports numpy and mpi4py (the floor
any fresh-ranks check pays), a check on 4 ranks only, and the default check (1, 2, 3 and 4
ranks, one job each, side by side). Goal: the 4-rank check within 5 s on a 2-core laptop.

    .venv/bin/python benchmarks/check_inline.py --repeats 5
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))

import hpdl  # noqa: E402
from hpdl.check.runner import mpiexec_command  # noqa: E402
from learner_ring import ring_ok  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bare_launch() -> None:
    subprocess.run([*mpiexec_command(4), sys.executable, "-c", "import numpy; from mpi4py import MPI"], check=True)


def check(ranks):
    def run():
        result = hpdl.check("ring_allreduce", ring_ok, ranks=ranks)
        assert result.passed, result
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--goal", type=float, default=5.0, help="seconds a 4-rank check may take")
    args = ap.parse_args()
    rows = {"bare mpiexec -n 4 (numpy + mpi4py)": bare_launch, "check, 4 ranks (6 cases)": check([4]),
            "check, 1-4 ranks (24 cases, 4 jobs)": check(None)}
    times = {name: [] for name in rows}
    for _ in range(args.repeats):  # interleaved, so load from others on the machine hits all alike
        for name, fn in rows.items():
            times[name].append(timed(fn))
    floor = statistics.median(times["bare mpiexec -n 4 (numpy + mpi4py)"])
    print(f"{'what':<40} {'median s':>9} {'min s':>7} {'x bare':>7}")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"{name:<40} {med:>9.2f} {min(ts):>7.2f} {med / floor:>7.1f}")
    four = statistics.median(times["check, 4 ranks (6 cases)"])
    default = statistics.median(times["check, 1-4 ranks (24 cases, 4 jobs)"])
    print(f"goal {args.goal:g} s: 4-rank check {four:.2f} s ({four / args.goal:.0%} of goal); "
          f"default 1-4 ranks {default:.2f} s ({default / args.goal:.0%} of goal); {args.repeats} repeats")


if __name__ == "__main__":
    main()
