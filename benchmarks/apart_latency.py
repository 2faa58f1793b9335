"""A check's ranks apart (each as if on a node of its own, over TCP): the time of one small Sendrecv
around a ring, with the MPI's default wait and with Intel MPI's wait mode, side by side in one run.

Intel MPI starts a check's isolated ranks each on a "node" of its own (launchers.nodes_apart). A rank
alone on its node polls for messages without pause; with more ranks than cores the spinning ranks take
the core from the one whose message has come, and a segmented ring of 4 ranks on 2 cores came within
1.5 s of its 5 s limit (MPICH and Open MPI: well under 1 s). meter.APART gives Intel MPI
I_MPI_WAIT_MODE=1. Rounds alternate between the two ways; printed are medians and their ratio.

    PATH=$PWD/.venv-impi/bin:$PATH .venv-impi/bin/python benchmarks/apart_latency.py --ranks 4 --rounds 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hpdl import launchers  # noqa: E402
from hpdl.checker import meter  # noqa: E402

RING = """import time
import numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
x, y = np.ones({values}), np.empty({values})
c.Barrier()
t = time.perf_counter()
for _ in range({iters}):
    c.Sendrecv(x, dest=(c.rank + 1) % c.size, recvbuf=y, source=(c.rank - 1) % c.size)
if c.rank == 0:
    print((time.perf_counter() - t) / {iters} * 1e3, flush=True)
"""


def one_run(args, which: str, env: dict[str, str], shell: str) -> float:
    """Milliseconds per Sendrecv on rank 0, the ranks started as a check starts them."""
    apart = launchers.nodes_apart(which, args.ranks, shell) or []
    cmd = [launchers.find_mpiexec(), *apart, "-n", str(args.ranks), sys.executable, "-c",
           RING.format(values=args.values, iters=args.iters)]
    done = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True, timeout=300)
    if done.returncode:
        sys.exit(f"mpiexec failed ({done.returncode}): {done.stderr[-1500:]}")
    return float(done.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks, each apart (more than the cores shows the cost)")
    ap.add_argument("--values", type=int, default=256, help="float64 values per message (a ring's segment)")
    ap.add_argument("--iters", type=int, default=600, help="Sendrecvs per run (a segmented ring at 4 ranks: ~600)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of each way, alternating")
    args = ap.parse_args()
    which = launchers.mpiexec_implementation()
    tcp = meter.tcp_transport()
    if tcp is None:
        sys.exit(f"{which} here cannot run ranks apart over TCP (meter.tcp_transport): nothing to compare")
    default = {k: v for k, v in tcp.items() if k != "I_MPI_WAIT_MODE"}
    ways = {"default wait": default, "as a check runs (meter.APART)": tcp}
    got: dict[str, list[float]] = {name: [] for name in ways}
    with tempfile.TemporaryDirectory() as tmp:
        shell = os.path.join(tmp, "remote-shell-here")
        Path(shell).write_text(launchers.REMOTE_SHELL_HERE)
        os.chmod(shell, 0o700)
        for _ in range(args.rounds):
            for name, env in ways.items():
                got[name].append(one_run(args, which, env, shell))
    print(f"{which}, {args.ranks} ranks apart on {os.cpu_count()} cores, {args.values} float64 values a message, "
          f"medians of {args.rounds}:")
    med = {name: statistics.median(v) for name, v in got.items()}
    for name, ms in med.items():
        print(f"  {name:32s} {ms:8.3f} ms per Sendrecv")
    print(f"as a check runs, one Sendrecv is {med['default wait'] / med['as a check runs (meter.APART)']:.2f}x faster")


if __name__ == "__main__":
    main()
