"""Claim: MPICH with a learner-style tuning file is never slower than its default (≥ 0.95× at every
size from 8 B to 64 MiB) and clearly faster somewhere (best size ≥ 1.2×).

    .venv/bin/python benchmarks/tuned_vs_default.py                 # 4 ranks, 8 B … 64 MiB
    .venv/bin/python benchmarks/tuned_vs_default.py --ranks 2 --rounds 3 --largest 16M

The learner's path, end to end: each of MPICH's allreduce algorithms is forced in turn
(MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM, one fresh `mpiexec` job each, --rounds times, best round
per size), the fastest per size makes a selection table, hpdl.tune writes it as MPICH's tuning
file (the same JSON the exercise `tuning_file` builds), and MPICH reads it from
MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE. The table keeps MPICH's own pick
(`hpdl.tune.mpich_choice`) wherever no forced algorithm is --switch times faster: a table built
on noise switches on noise. Then default and tuned jobs alternate for --rounds rounds on the
same sizes; per size the best round of each is compared (a burst of someone else's work spoils
one round, not the answer).
Printed: the table, the file, and per size default µs, tuned µs, and default/tuned (> 1: tuned
faster). Sizes are bytes per rank of float32 sums.
"""
from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from hpdl import bench, tune
from hpdl.plots import size_label


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--largest", default="64M")
    ap.add_argument("--rounds", type=int, default=3, help="alternating default/tuned rounds")
    ap.add_argument("--budget", type=float, default=0.05, help="seconds of timing per size")
    ap.add_argument("--switch", type=float, default=1.1,
                    help="leave MPICH's own pick unless a forced algorithm is this much faster (default 1.1)")
    ap.add_argument("--algorithms", default="recursive_doubling,reduce_scatter_allgather,ring")
    args = ap.parse_args()
    sizes = bench.message_sizes(8, tune._parse_size(args.largest), 2)
    algorithms = args.algorithms.split(",")
    print(f"MPI_Allreduce, {args.ranks} ranks, {size_label(sizes[0])} … {size_label(sizes[-1])}", flush=True)
    sweeps = {}
    for r in range(args.rounds):
        for alg in algorithms:
            print(f"  round {r + 1}/{args.rounds}: forcing {alg}", flush=True)
            s = tune.sweep_algorithm(alg, ranks=args.ranks, sizes=sizes, budget=args.budget)
            if alg in sweeps:
                s["seconds"] = [min(a, b) for a, b in zip(sweeps[alg]["seconds"], s["seconds"])]
            sweeps[alg] = s
    # MPICH's own pick stays wherever nothing forced is --switch times faster
    table = tune.selection_table([s for s in sweeps.values() if s["name"] in tune.TABLE_ALGORITHMS], keep=args.switch,
                                 incumbent=lambda n: tune.mpich_choice(n, args.ranks))
    path = tune.write_tuning_file(table, Path(tempfile.mkdtemp(prefix="hpdl-tuned-")) / "mpich-allreduce.json")
    print("selection table:", table)
    default = [float("inf")] * len(sizes)
    tuned = [float("inf")] * len(sizes)
    for r in range(args.rounds):
        print(f"  round {r + 1}/{args.rounds}: default, then tuned", flush=True)
        d = tune.sweep_algorithm(None, ranks=args.ranks, sizes=sizes, budget=args.budget)
        t = tune.sweep_algorithm(None, ranks=args.ranks, sizes=sizes, budget=args.budget, tuning_file=path)
        default = [min(a, b) for a, b in zip(default, d["seconds"])]
        tuned = [min(a, b) for a, b in zip(tuned, t["seconds"])]
    print(f"\n{'size':>8} {'default µs':>11} {'tuned µs':>10} {'ratio':>7}  table's algorithm")
    ratios = []
    for n, dd, tt in zip(sizes, default, tuned):
        ratios.append(dd / tt)
        print(f"{size_label(n):>8} {dd * 1e6:11.1f} {tt * 1e6:10.1f} {dd / tt:6.2f}×  {tune.algorithm_for(table, n)}")
    worst, best = min(ratios), max(ratios)
    print(f"\nworst {worst:.2f}× (goal ≥ 0.95), best {best:.2f}× (goal ≥ 1.2) at "
          f"{size_label(sizes[ratios.index(best)])}; tuning file: {path}")


if __name__ == "__main__":
    main()
