"""How long a check of a torch exercise takes with its ranks forked from one import of torch, and without.

A check runs a learner job and a reference job at each of its rank counts; every rank of a torch
exercise imports torch (~1 s of CPU). With the fork server (hpdl/forkserver.py, the default) each
job imports it once and forks its ranks. Side by side in one run, interleaved so both meet the
same load, each in a fresh Python process as a learner's first call is: column_parallel_linear's
model solution, checked as the grader does (every case, hidden ones too, at 1-4 ranks: 20
processes), with HPDL_FORKSERVER=1 and =0.

    .venv/bin/python benchmarks/check_forkserver.py --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = """
import inspect, linecache, textwrap
import hpdl
from hpdl.checker.cases import column_parallel_linear as case
# the learner's own copy of the model solution: checks refuse the kit's own functions
source = "\\n\\n".join(textwrap.dedent(inspect.getsource(f)) for f in (case.rows_of, case.model_solution))
linecache.cache["<learner>"] = (len(source), None, source.splitlines(True), "<learner>")
space = {{"__name__": "__learner__"}}
exec(compile(source, "<learner>", "exec"), space)
result = hpdl.check("column_parallel_linear", space["model_solution"], ranks={ranks!r}, grade={grade!r})
assert result.passed, result
"""


def timed(code: str, env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT, stdout=subprocess.DEVNULL)
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--ranks", type=int, default=None, help="check at this rank count only (quicker), not as graded")
    args = ap.parse_args()
    code = CHECK.format(ranks=[args.ranks] if args.ranks else None, grade=not args.ranks)
    what = f"{args.ranks} ranks" if args.ranks else "graded, 1-4 ranks"
    env = dict(os.environ, TQDM_DISABLE="1", PYTHONPATH=str(ROOT))
    times: dict[str, list[float]] = {"with the fork server": [], "each rank imports torch": []}
    for _ in range(args.repeats):
        times["with the fork server"].append(timed(code, dict(env, HPDL_FORKSERVER="1")))
        times["each rank imports torch"].append(timed(code, dict(env, HPDL_FORKSERVER="0")))
    print(f"column_parallel_linear, {what}, {args.repeats} run(s) each")
    print(f"{'how the ranks start':<28} {'median s':>9} {'min s':>7}")
    for name, ts in times.items():
        print(f"{name:<28} {statistics.median(ts):>9.2f} {min(ts):>7.2f}")
    served, plain = (statistics.median(ts) for ts in times.values())
    print(f"fork server: the check takes {served:.1f} s against {plain:.1f} s, {plain / served:.2f}x faster")


if __name__ == "__main__":
    main()
