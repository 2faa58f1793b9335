"""The reference ring-allreduce (lesson 04's solution, in Python) against MPI's own Allreduce.

    .venv/bin/python benchmarks/ring_vs_library.py                 # 2 ranks, 8 B … 64 MiB
    .venv/bin/python benchmarks/ring_vs_library.py --ranks 4 --rounds 5

Launches itself under `mpiexec -n RANKS` (or runs directly when started by mpiexec). The ring
is `ring_allreduce` from solutions/04_ring_allreduce.ipynb, executed as written there; the
library is `comm.Allreduce(x, out)` through mpi4py's buffer API. Both get the same float32
arrays on the same ranks in the same run, timed by hpdl.bench.timeit (OSU-style: barrier,
clock, call, clock; median iteration, slowest rank). Each size is measured in `--rounds`
alternating rounds (library, ring, library, ring, …) and each side's median over rounds is
reported, so a busy spell on a shared machine hits both.

Printed per size: latency and bus bandwidth of both, and ring busbw / library busbw; then the
smallest and the median of that ratio from 4 MiB up (goal ≥ 0.7), from the rounds' medians and
from their best (the latter shrugs off bursts of other people's work on a shared machine).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTION = ROOT / "solutions" / "04_ring_allreduce.ipynb"


def load_ring():
    """`ring_allreduce` as defined in the solution notebook (its solution markers are comments)."""
    import nbformat

    nb = nbformat.read(SOLUTION, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code" and "def ring_allreduce(" in cell.source:
            import numpy as np
            from mpi4py import MPI

            namespace = {"np": np, "MPI": MPI}
            exec(compile(cell.source, f"{SOLUTION.name}:ring_allreduce", "exec"), namespace)
            return namespace["ring_allreduce"]
    sys.exit(f"no cell defining ring_allreduce in {SOLUTION}")


def measure(args) -> None:
    import numpy as np
    from mpi4py import MPI

    from hpdl import bench

    comm = MPI.COMM_WORLD
    p, rank = comm.Get_size(), comm.Get_rank()
    ring = load_ring()
    library = bench.library_allreduce()
    rows = []
    for nbytes in bench.message_sizes(args.smallest, args.largest, 2):
        x = np.random.default_rng(rank).random(max(1, nbytes // 4)).astype(np.float32)
        got, expected = ring(comm, x), library(comm, x)
        if not np.allclose(got, expected, rtol=1e-5, atol=1e-6):
            raise SystemExit(f"rank {rank}: the ring's sum differs from MPI's at {nbytes} bytes")
        lib_t, ring_t = [], []
        for _ in range(args.rounds):
            lib_t.append(bench.timeit(lambda: library(comm, x), comm, budget=args.budget))
            ring_t.append(bench.timeit(lambda: ring(comm, x), comm, budget=args.budget))
        rows.append({"bytes": x.nbytes, "library": statistics.median(lib_t), "ring": statistics.median(ring_t),
                     "library_best": min(lib_t), "ring_best": min(ring_t)})
        if rank == 0:
            print(f"  {x.nbytes} bytes done", file=sys.stderr, flush=True)
    if rank == 0:
        report(rows, p, MPI.Get_library_version().splitlines()[0], args)
        if args.json:
            Path(args.json).write_text(json.dumps({"ranks": p, "rows": rows}, indent=1))


def label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def report(rows, p: int, library: str, args) -> None:
    factor = 2 * (p - 1) / p  # allreduce bus bandwidth = algbw · 2(p−1)/p
    print(f"\nallreduce of float32 on {p} ranks, {library}; median of {args.rounds} alternating rounds")
    print(f"{'size':>8} {'library µs':>11} {'ring µs':>11} {'library GB/s':>13} {'ring GB/s':>10} {'ring/library':>13}")
    for r in rows:
        lib_bw = r["bytes"] / r["library"] * factor / 1e9
        ring_bw = r["bytes"] / r["ring"] * factor / 1e9
        print(f"{label(r['bytes']):>8} {r['library'] * 1e6:11.1f} {r['ring'] * 1e6:11.1f} {lib_bw:13.2f} "
              f"{ring_bw:10.2f} {r['library'] / r['ring']:13.2f}")
    big = [r for r in rows if r["bytes"] >= (4 << 20)]
    if big:
        ratios = [r["library"] / r["ring"] for r in big]
        best = [r["library_best"] / r["ring_best"] for r in big]
        print("\nring bus bandwidth / library's from 4 MiB up (goal ≥ 0.7 at every size):")
        print(f"  medians of the rounds:     smallest {min(ratios):.2f}, median {statistics.median(ratios):.2f} "
              f"({'met' if min(ratios) >= 0.7 else 'missed'})")
        print(f"  best of the rounds:        smallest {min(best):.2f}, median {statistics.median(best):.2f} "
              f"({'met' if min(best) >= 0.7 else 'missed'})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--smallest", type=int, default=8)
    ap.add_argument("--largest", type=int, default=64 << 20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--budget", type=float, default=0.1, help="seconds per timing (iterations adapt to it)")
    ap.add_argument("--json", help="also write the numbers here")
    args = ap.parse_args()
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ or "PMI_SIZE" in os.environ:
        measure(args)
        return
    mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or "mpiexec"
    cmd = [mpiexec, "-n", str(args.ranks), sys.executable, __file__, *sys.argv[1:]]
    sys.exit(subprocess.call(cmd))


if __name__ == "__main__":
    main()
