"""Batch grading: 10 submitted notebooks, one of which hangs in a cell, each under its time limit.

Submissions are made from the authoring example (tests/fixtures/solutions): solved ones, an
untouched exercise, and one whose extra cell sleeps forever. Printed: the wall time of the
batch, each notebook's time, and how the hanging one compares with its limit. The batch
must finish, with the hanging notebook stopped at its limit and every other one graded.

    .venv/bin/python benchmarks/grade_batch.py --limit 30 --jobs 1
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpdl import build, grade  # noqa: E402


def make_submissions(folder: Path, n: int) -> None:
    kit = folder / "kit"
    (kit / "solutions").mkdir(parents=True)
    src = ROOT / "tests" / "fixtures" / "solutions" / "01_ring_example.ipynb"
    nbformat.write(nbformat.read(src, as_version=4), kit / "solutions" / "ex.ipynb")
    build.main(["--root", str(kit)])
    solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    blank = nbformat.read(kit / "exercises" / "ex.ipynb", as_version=4)
    subs = folder / "subs"
    subs.mkdir()
    for i in range(n - 2):
        nbformat.write(solved, subs / f"learner{i:02d}.ipynb")
    nbformat.write(blank, subs / "untouched.ipynb")
    hanging = copy.deepcopy(solved)
    hanging.cells.insert(2, nbformat.v4.new_code_cell("import time\nwhile True:\n    time.sleep(1)"))
    nbformat.write(hanging, subs / "hangs.ipynb")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10, help="number of submissions (one hangs)")
    ap.add_argument("--limit", type=float, default=30.0, help="seconds each notebook may run")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        make_submissions(tmp, args.n)
        t0 = time.perf_counter()
        subs = grade.grade(tmp / "subs", tmp / "report", limit=args.limit, jobs=args.jobs, progress=False)
        wall = time.perf_counter() - t0
        assert (tmp / "report" / "grades.csv").exists()
    normal = [s for s in subs if s.name != "hangs.ipynb"]
    hung = next(s for s in subs if s.name == "hangs.ipynb")
    per = [s.seconds for s in normal]
    print(f"{args.n} submissions, limit {args.limit:g} s each, jobs={args.jobs}")
    for s in subs:
        print(f"  {s.name:<22} {s.status:<12} {s.score():>5g} points  {s.seconds:6.1f} s")
    print(f"batch wall time            {wall:6.1f} s")
    print(f"per graded notebook        {statistics.median(per):6.1f} s median ({min(per):.1f}-{max(per):.1f})")
    print(f"hanging notebook stopped   {hung.seconds:6.1f} s  ({hung.seconds / args.limit:.2f} x its limit)")
    print(f"wall / (sum of others + limit) = {wall / (sum(per) + args.limit):.2f}")
    assert hung.status == "timeout" and all(s.status == "ok" for s in normal)


if __name__ == "__main__":
    main()
