"""mpi4py's buffer-API Allreduce against MPI_Allreduce in C, on the same MPI and the same ranks.

    .venv/bin/python benchmarks/mpi4py_vs_c.py                  # 2 ranks, 8 B … 16 MiB, 5 rounds
    .venv/bin/python benchmarks/mpi4py_vs_c.py --ranks 4 --largest 67108864 --rounds 5
    .venv/bin/python benchmarks/mpi4py_vs_c.py --thread-level single   # both sides MPI_THREAD_SINGLE

The C program (benchmarks/c/allreduce_latency.c) is compiled at run time with the venv's
`mpicc` into a temporary folder. Each round runs the C program and then this script's own
`--worker` mode (`comm.Allreduce(x, out)` on numpy float32 arrays) under `mpiexec -n RANKS`,
with the same sizes, iteration counts and timing rule (per iteration: barrier, clock, call,
clock; median iteration, slowest rank) and the same MPI thread level (mpi4py's default,
MPI_THREAD_MULTIPLE, unless --thread-level single: MPICH takes different paths for the two).
Rounds alternate C and Python so that a busy spell on the machine hits both; the report takes
each size's median over rounds.

Printed: both latencies per size; the added latency of mpi4py up to 1 KiB (goal ≤ 2 µs, judged
on the worst size) and the time ratio mpi4py / C from 1 MiB up (goal within 10%, judged on the
median over those sizes; the range is printed too). Numbers from a machine others are using
at the same time move by tens of percent from run to run: compare runs, not single sizes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BIN = Path(sys.executable).parent


def iterations(nbytes: int, small: int, large: int) -> int:
    """The C program's rule: many iterations for small messages, fewer for large ones."""
    iters = small if nbytes < (64 << 10) else large
    return min(iters, 30) if nbytes >= (8 << 20) else iters


def worker(smallest: int, largest: int, small: int, large: int) -> None:
    """Runs on every rank: the mpi4py side, printed like the C program's output."""
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    allreduce, barrier, clock = comm.Allreduce, comm.Barrier, time.perf_counter
    nbytes = smallest
    while nbytes <= largest:
        count = max(1, nbytes // 4)
        x = np.full(count, rank + 1, np.float32)
        out = np.zeros(count, np.float32)
        iters = iterations(nbytes, small, large)
        for _ in range(max(2, iters // 10)):
            allreduce(x, out)
        times = np.empty(iters)
        for i in range(iters):
            barrier()
            t0 = clock()
            allreduce(x, out)
            times[i] = clock() - t0
        slowest = comm.reduce(float(np.median(times)), op=MPI.MAX, root=0)
        if rank == 0:
            print(f"{count * 4} {slowest:.9e}", flush=True)
        nbytes *= 2


def compile_c(build: Path) -> Path:
    mpicc = shutil.which("mpicc", path=str(BIN)) or shutil.which("mpicc")
    if mpicc is None:
        sys.exit("mpicc not found: it comes with the `mpich` wheel in the venv (.venv/bin/mpicc).")
    exe = build / "allreduce_latency"
    subprocess.run([mpicc, "-O2", "-o", str(exe), str(HERE / "c" / "allreduce_latency.c")], check=True)
    return exe


def run(cmd: list[str], ranks: int, timeout: float, thread_level: str) -> dict[int, float]:
    mpiexec = shutil.which("mpiexec", path=str(BIN)) or "mpiexec"
    env = dict(os.environ, MPI4PY_RC_THREAD_LEVEL=thread_level)
    out = subprocess.run([mpiexec, "-n", str(ranks), *cmd], capture_output=True, text=True, timeout=timeout, env=env)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd[:2])} failed:\n{out.stderr[-2000:]}")
    result = {}
    for line in out.stdout.split("\n"):
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            result[int(parts[0])] = float(parts[1])
    return result


def label(nbytes: int) -> str:
    for unit, scale in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--smallest", type=int, default=8)
    ap.add_argument("--largest", type=int, default=16 << 20)
    ap.add_argument("--rounds", type=int, default=5, help="alternating C / Python runs; medians over rounds")
    ap.add_argument("--iters-small", type=int, default=1000, help="iterations below 64 KiB")
    ap.add_argument("--iters-large", type=int, default=100, help="iterations from 64 KiB (at most 30 from 8 MiB)")
    ap.add_argument("--thread-level", choices=("multiple", "single"), default="multiple",
                    help="MPI thread level on both sides (mpi4py's default is multiple)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes_args = [str(args.smallest), str(args.largest), str(args.iters_small), str(args.iters_large)]
    if args.worker:
        worker(args.smallest, args.largest, args.iters_small, args.iters_large)
        return

    with tempfile.TemporaryDirectory(prefix="hpdl-bench-c-") as build:
        exe = compile_c(Path(build))
        c_runs, py_runs = [], []
        for i in range(args.rounds):
            c_runs.append(run([str(exe), *sizes_args, args.thread_level], args.ranks, 600, args.thread_level))
            py_runs.append(run([sys.executable, __file__, "--worker", "--smallest", sizes_args[0], "--largest",
                                sizes_args[1], "--iters-small", sizes_args[2], "--iters-large", sizes_args[3]],
                               args.ranks, 600, args.thread_level))
            print(f"round {i + 1}/{args.rounds} done", file=sys.stderr, flush=True)

    from mpi4py import MPI

    sizes = sorted(set(c_runs[0]) & set(py_runs[0]))
    c = {n: statistics.median(r[n] for r in c_runs) for n in sizes}
    py = {n: statistics.median(r[n] for r in py_runs) for n in sizes}
    print(f"MPI_Allreduce (float32, sum) on {args.ranks} ranks, {MPI.Get_library_version().splitlines()[0]}, "
          f"thread level {args.thread_level} on both sides")
    print(f"mpi4py {__import__('mpi4py').__version__}; "
          f"median over {args.rounds} alternating rounds of each side's median\n")
    print(f"{'size':>8} {'C (µs)':>10} {'mpi4py (µs)':>12} {'added (µs)':>11} {'mpi4py / C':>11}")
    for n in sizes:
        print(f"{label(n):>8} {c[n] * 1e6:10.2f} {py[n] * 1e6:12.2f} {(py[n] - c[n]) * 1e6:11.2f} {py[n] / c[n]:11.3f}")

    small = [n for n in sizes if n <= 1024]
    large = [n for n in sizes if n >= (1 << 20)]
    if small:
        added = [(py[n] - c[n]) * 1e6 for n in small]
        worst = max(added)
        print(f"\nadded latency up to 1 KiB: median {statistics.median(added):.2f} µs, worst {worst:.2f} µs "
              f"(goal ≤ 2 µs: {'met' if worst <= 2.0 else 'missed'})")
    if large:
        ratios = [py[n] / c[n] for n in large]
        median = statistics.median(ratios)
        every = max(abs(r - 1) for r in ratios) <= 0.10
        print(f"mpi4py / C from 1 MiB up: median {median:.3f} "
              f"(goal within 10%: {'met' if abs(median - 1) <= 0.10 else 'missed'}); "
              f"range {min(ratios):.3f}–{max(ratios):.3f} ({'every size' if every else 'not every size'} within 10%)")


if __name__ == "__main__":
    main()
