"""How long until every rank is ready: engines registered, torch.distributed and Horovod set up.

    .venv/bin/python benchmarks/start_cluster.py -n 4 --repeat 5

Each repeat is a cold `hpdl.start(n)` followed by `hpdl.stop()`, once with the engines forked
from one process that imported torch (hpdl/forkserver.py, the default) and once started afresh
by mpiexec (HPDL_FORKSERVER=0), alternating so both meet the same load. Printed per way: the
median and spread of the whole start, and how much of it is the per-rank set-up (imports,
process groups, Horovod) after the engines registered; then the ratio of the medians.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import hpdl

WAYS = {"forked from one import of torch": "1", "each engine imports torch": "0"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-n", type=int, default=4, help="ranks")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--frameworks", default="torch,horovod", help="comma list; '' for MPI only")
    args = ap.parse_args()
    frameworks = tuple(f for f in args.frameworks.split(",") if f)

    totals = {way: [] for way in WAYS}
    setups = {way: [] for way in WAYS}
    for i in range(args.repeat):
        for way, flag in WAYS.items():
            os.environ["HPDL_FORKSERVER"] = flag  # read by hpdl.start() when it is called
            t0 = time.perf_counter()
            c = hpdl.start(n=args.n, frameworks=frameworks, quiet=True)
            totals[way].append(time.perf_counter() - t0)
            setups[way].append(max(r["setup_s"] for r in c.ranks))
            hpdl.stop(quiet=True)
            print(f"run {i + 1}, {way}: start {totals[way][-1]:.2f} s (rank set-up {setups[way][-1]:.2f} s)")
    print(f"\nhpdl.start(n={args.n}, frameworks={frameworks}) over {args.repeat} runs each")
    for way in WAYS:
        ts = totals[way]
        print(f"  {way:<33} median {statistics.median(ts):.2f} s (min {min(ts):.2f}, max {max(ts):.2f}), "
              f"rank set-up {statistics.median(setups[way]):.2f} s")
    forked, fresh = (statistics.median(totals[way]) for way in WAYS)
    print(f"forked engines start in {forked:.2f} s against {fresh:.2f} s, {fresh / forked:.2f}x faster")


if __name__ == "__main__":
    main()
