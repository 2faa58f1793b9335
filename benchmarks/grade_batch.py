"""Batch grading: 10 submitted notebooks (one hangs, one fork-bombs), sandboxed vs not, side by side.

Submissions are made from the authoring example (tests/fixtures/solutions): solved ones, an
untouched exercise, one whose extra cell sleeps forever, and one whose extra cell forks until
the process limit stops it. The same batch is graded twice in one run: in bubblewrap sandboxes
(the default where bwrap works) and without (HPDL_NO_SANDBOX=1: rlimits and process groups
only). Printed: each notebook's time both ways, the sandbox's overhead per graded notebook
(median of the differences), and the whole batch's wall time both ways. The batch must finish
both times, with the hanging notebook stopped at its limit and every solved one at full marks.

    .venv/bin/python benchmarks/grade_batch.py --limit 40 --jobs 1
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpdl import build, grade  # noqa: E402
from hpdl.checker import sandbox  # noqa: E402

FORK_BOMB = ("import os, time\nfor _ in range(100000):\n    if os.fork() == 0:\n"
             "        time.sleep(600)\n        os._exit(0)")


def make_submissions(folder: Path, n: int) -> Path:
    kit = folder / "kit"
    (kit / "solutions").mkdir(parents=True)
    src = ROOT / "tests" / "fixtures" / "solutions" / "01_ring_example.ipynb"
    nbformat.write(nbformat.read(src, as_version=4), kit / "solutions" / "ex.ipynb")
    build.main(["--root", str(kit)])
    solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    blank = nbformat.read(kit / "exercises" / "ex.ipynb", as_version=4)
    subs = folder / "subs"
    subs.mkdir()
    for i in range(n - 3):
        nbformat.write(solved, subs / f"learner{i:02d}.ipynb")
    nbformat.write(blank, subs / "untouched.ipynb")
    for name, code in (("hangs", "import time\nwhile True:\n    time.sleep(1)"), ("fork_bomb", FORK_BOMB)):
        nb = copy.deepcopy(solved)
        nb.cells.insert(2, nbformat.v4.new_code_cell(code))
        nbformat.write(nb, subs / f"{name}.ipynb")
    return subs


def run(subs: Path, out: Path, limit: float, jobs: int, sandboxed: bool) -> tuple[float, list]:
    if sandboxed:
        os.environ.pop("HPDL_NO_SANDBOX", None)
    else:
        os.environ["HPDL_NO_SANDBOX"] = "1"
    t0 = time.perf_counter()
    # the grader refuses to run as root, and without a sandbox, unless told (this benchmark's point)
    result = grade.grade(subs, out, limit=limit, jobs=jobs, progress=False, no_sandbox=not sandboxed,
                         allow_root=os.geteuid() == 0)
    return time.perf_counter() - t0, result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=10, help="number of submissions (one hangs, one fork-bombs)")
    ap.add_argument("--limit", type=float, default=40.0, help="seconds each notebook may run")
    ap.add_argument("--jobs", type=int, default=1)
    args = ap.parse_args()
    if not sandbox.available():
        sys.exit("bubblewrap is not available here (apt-get install bubblewrap): nothing to compare")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        subs = make_submissions(tmp, args.n)
        walls, runs = {}, {}
        for label, sandboxed in (("sandboxed", True), ("not sandboxed", False)):
            walls[label], runs[label] = run(subs, tmp / label.replace(" ", "_"), args.limit, args.jobs, sandboxed)
        os.environ.pop("HPDL_NO_SANDBOX", None)
    by = {label: {s.name: s for s in subs_} for label, subs_ in runs.items()}
    print(f"{args.n} submissions, limit {args.limit:g} s each, jobs={args.jobs}")
    print(f"  {'submission':<20} {'sandboxed':>22} {'not sandboxed':>22}")
    for name in sorted(by["sandboxed"]):
        a, b = by["sandboxed"][name], by["not sandboxed"][name]
        print(f"  {name:<20} {a.status:>9} {a.score():>4g} {a.seconds:6.1f} s   {b.status:>9} {b.score():>4g} "
              f"{b.seconds:6.1f} s")
    graded = [n for n in by["sandboxed"] if n not in ("hangs.ipynb",)]
    diffs = [by["sandboxed"][n].seconds - by["not sandboxed"][n].seconds for n in graded]
    print(f"sandbox overhead per graded notebook: {statistics.median(diffs):+.2f} s median "
          f"({min(diffs):+.2f} to {max(diffs):+.2f}; goal <= 1 s)")
    for label in walls:
        print(f"whole batch, {label:<14} {walls[label]:6.1f} s wall")
    for label, subs_ in by.items():
        assert subs_["hangs.ipynb"].status == "timeout", label
        full = [s for n, s in subs_.items() if n.startswith("learner")]
        assert all(s.status == "ok" and s.score() == full[0].score() > 0 for s in full), label


if __name__ == "__main__":
    main()
