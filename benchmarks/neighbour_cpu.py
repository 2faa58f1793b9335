"""Grading a class: how much a CPU hog slows the honest submission graded beside it, with and without
one cgroup weight on the CPU per submission (sandbox.SHARE), side by side in one run.

Each round starts two sandboxed jobs at once, as `hpdl grade --jobs 2` does: a hog that forks
`--hogs` busy children, each in a session of its own (which defeats the kernel's autogroup), and
an honest job that spins through a fixed amount of work and prints how long it took. Rounds
alternate between the two ways; printed are the honest job's medians alone, beside the hog with
shares, and beside it without, and the slowdowns as ratios.

    .venv/bin/python benchmarks/neighbour_cpu.py --hogs 100 --rounds 3
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpdl import sidejob  # noqa: E402
from hpdl.checker import sandbox  # noqa: E402

HOG = """import os, sys, time
for _ in range({hogs}):
    if os.fork() == 0:
        os.setsid()
        end = time.monotonic() + {seconds}
        while time.monotonic() < end:
            pass
        os._exit(0)
time.sleep({seconds})
"""
HONEST = """import time
t = time.perf_counter()
n = 0
for i in range({work}):
    n += i * i
print(f"{{time.perf_counter() - t:.4f}}", flush=True)
"""


def honest_seconds(work: int, hogs: int, shares: bool) -> float:
    """Wall time of the honest job's work, beside a hog of `hogs` children (0: alone)."""
    saved = sandbox.SHARE
    sandbox.SHARE = saved if shares else "no-such-controller"
    jobs = []
    try:
        if hogs:
            hog = HOG.format(hogs=hogs, seconds=60)
            jobs.append(sidejob.SideJob([sys.executable, "-c", hog], timeout=90,
                                        limits=sandbox.Limits(processes=hogs + 16)))
            time.sleep(1.0)  # its children busy before the honest job starts
        honest = sidejob.SideJob([sys.executable, "-c", HONEST.format(work=work)], timeout=90, limits=sandbox.Limits())
        jobs.append(honest)
        honest.wait()
        return float(honest.output_text().split()[-1])
    finally:
        for job in jobs:
            job.end(now=True)
        sandbox.SHARE = saved


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hogs", type=int, default=100, help="busy children of the hog, each in its own session")
    ap.add_argument("--work", type=int, default=3_000_000, help="loop iterations of the honest job")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs all three ways, in turn")
    args = ap.parse_args()
    probe = sandbox.Cgroup.make(64, 2**30)
    if probe is None or probe.share() is None:
        sys.exit("This host gives this user no cgroup with the cpu controller: nothing to compare.")
    probe.remove()
    ways = {"alone": (0, True), "hog, one weight each": (args.hogs, True), "hog, no cpu cgroup": (args.hogs, False)}
    times: dict[str, list[float]] = {w: [] for w in ways}
    for r in range(args.rounds):
        for way, (hogs, shares) in ways.items():
            times[way].append(honest_seconds(args.work, hogs, shares))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{w} {t[-1]:.2f} s" for w, t in times.items()), flush=True)
    med = {w: statistics.median(t) for w, t in times.items()}
    print(f"{args.hogs} busy children beside it, medians of {args.rounds}:")
    for way, m in med.items():
        print(f"  {way:22s} {m:7.3f} s   {m / med['alone']:6.2f}x alone")
    print(f"slowdown beside the hog: {med['hog, one weight each'] / med['alone']:.2f}x with one cpu weight per "
          f"submission, {med['hog, no cpu cgroup'] / med['alone']:.2f}x without")


if __name__ == "__main__":
    main()
