"""How long until every rank is ready: engines registered, torch.distributed and Horovod set up.

    .venv/bin/python benchmarks/start_cluster.py -n 4 --repeat 5

Each repeat is a cold `hpdl.start(n)` followed by `hpdl.stop()`. Printed: the median and the
spread of the whole start, and how it splits into launching/registering engines and the
per-rank set-up (imports, process groups, Horovod).
"""
from __future__ import annotations

import argparse
import statistics
import time

import hpdl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="ranks")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--frameworks", default="torch,horovod", help="comma list; '' for MPI only")
    args = ap.parse_args()
    frameworks = tuple(f for f in args.frameworks.split(",") if f)

    totals, setups, stops = [], [], []
    for i in range(args.repeat):
        t0 = time.perf_counter()
        c = hpdl.start(n=args.n, frameworks=frameworks, quiet=True)
        totals.append(time.perf_counter() - t0)
        setups.append(max(r["setup_s"] for r in c.ranks))
        t1 = time.perf_counter()
        hpdl.stop(quiet=True)
        stops.append(time.perf_counter() - t1)
        print(f"run {i + 1}: start {totals[-1]:.2f} s (rank set-up {setups[-1]:.2f} s), stop {stops[-1]:.2f} s")
    med = statistics.median(totals)
    print(f"\nhpdl.start(n={args.n}, frameworks={frameworks}) over {args.repeat} runs")
    print(f"  median start  {med:.2f} s   (min {min(totals):.2f}, max {max(totals):.2f})")
    print(f"  of which rank set-up (imports, process group, Horovod) median {statistics.median(setups):.2f} s")
    print(f"  median stop   {statistics.median(stops):.2f} s")


if __name__ == "__main__":
    main()
