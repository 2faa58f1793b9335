"""Emulated nodes: does a link set to R carry an all-reduce at R, and what does the network change?

    .venv/bin/python benchmarks/emulated_nodes.py --rates 200mbit 1gbit      (as root)

1. Inter-node: 2 ranks, one per emulated node (hpdl/emulated.py), MPI_Allreduce of float32
   arrays of each `--sizes-mib`; bus bandwidth (at p = 2 the algorithm bandwidth: each rank sends
   and receives n bytes) against the link's rate, per rate.
2. Intra-node: 2 ranks on one emulated node against 2 ranks started as the kit always does:
   the namespaces must not slow shared memory down.
3. Hierarchical against flat on 2 nodes × 2 ranks at `--hier-rate`: reduce in the node, all-reduce
   across the nodes' first ranks, broadcast in the node, against the MPI's ring over all four (MPICH's
   device collectives off, so it is really flat), rounds alternating, median of each; the ratio
   against the α-β-γ prediction, whose α, β come from the 2-rank fits of parts 1 and 2 (inter,
   intra) at the same sizes, and γ from adding two arrays on one core.
The last line reads `max |busbw / link - 1| = X %` over the rates and sizes of part 1.
Each job is a side job (hpdl.sidejob) of its own; the nodes are removed after each part.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

HERE = os.path.abspath(__file__)
# flat = the MPI's ring over all ranks; without this, MPICH's device collectives may already
# compose a node-aware all-reduce (reduce in shared memory, across the network, broadcast). Open
# MPI's and Intel MPI's names for the same (tuned's algorithm 4 and Intel's 8 are the ring: flat
# measured 209.5 ms against the ring's predicted 202.9 ms); each MPI ignores the others'.
FLAT_RING = {"MPIR_CVAR_DEVICE_COLLECTIVES": "none", "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM": "ring",
             "OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_allreduce_algorithm": "4",
             "I_MPI_ADJUST_ALLREDUCE": "8"}


# -- what runs on the ranks -----------------------------------------------------------------------

def _timed(fn, comm, iters: int) -> float:
    """Median seconds of `fn()` over `iters` calls, the slowest rank's, after one warm-up call."""
    from mpi4py import MPI

    fn()
    times = []
    for _ in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return comm.allreduce(statistics.median(times), op=MPI.MAX)


def worker_allreduce(sizes: list[int], iters: int) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for n in sizes:
        x = np.ones(n // 4, np.float32)
        out[n] = _timed(lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), comm, iters)
    return out


def hierarchical(x: np.ndarray, node, leaders) -> None:
    """Reduce in the node to its first rank, all-reduce across nodes' first ranks, broadcast.

    The other ranks of a node wait for the first one asleep (hpdl.bench.idle_wait: a barrier
    tested every 0.5 ms): busy-waiting in the broadcast, they would take the cores the first
    ranks' TCP traffic needs, which on a real node each rank has of its own."""
    from mpi4py import MPI

    from hpdl.bench import idle_wait

    node.Reduce(MPI.IN_PLACE if node.rank == 0 else x, x if node.rank == 0 else None, op=MPI.SUM, root=0)
    if leaders != MPI.COMM_NULL:
        leaders.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    idle_wait(node)
    node.Bcast(x, root=0)


def worker_hier(size: int, iters: int, rounds: int) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    leaders = comm.Split(0 if node.rank == 0 else MPI.UNDEFINED, comm.rank)
    x = np.full(size // 4, comm.rank + 1.0, np.float32)
    hierarchical(x, node, leaders)  # right answer first: every element is the sum of 1..p
    ok = bool(np.all(x == comm.size * (comm.size + 1) / 2))
    times = {"flat": [], "hierarchical": []}
    for _ in range(rounds):  # alternating, so both see the same machine
        times["flat"].append(_timed(lambda: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM), comm, iters))
        times["hierarchical"].append(_timed(lambda: hierarchical(x, node, leaders), comm, iters))
    return {"ok": comm.allreduce(ok, op=MPI.LAND), "nodes": comm.allreduce(int(node.rank == 0)),
            **{k: statistics.median(v) for k, v in times.items()}}


def worker(args) -> None:
    from mpi4py import MPI

    if args.worker == "allreduce":
        out = worker_allreduce(args.sizes, args.iters)
    else:
        out = worker_hier(args.sizes[-1], args.iters, args.rounds)
    if MPI.COMM_WORLD.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


# -- the driver -----------------------------------------------------------------------------------

def result_of(full: list[str], timeout: float, what: str, env: dict | None = None) -> dict:
    """Run an MPI job (`full`: mpiexec and a worker) as a side job; the JSON its rank 0 printed
    after `RESULT `. Exits with the job's output when it failed or printed none."""
    from hpdl import sidejob
    from hpdl.emulated import RANK_ENV

    done = sidejob.run(full, timeout=timeout, env={**os.environ, **RANK_ENV, **(env or {})})
    lines = [s for s in done.output.splitlines() if s.startswith("RESULT ")]
    if done.returncode != 0 or not lines:
        sys.exit(f"{what} job failed ({'timed out' if done.timed_out else done.returncode}):\n{done.output[-3000:]}")
    return json.loads(lines[-1][7:])


def job(cmd: list[str], args, what: str, env: dict | None = None) -> dict:
    """Run this file's worker under `cmd` (an mpiexec) as a side job; its rank 0's result."""
    sizes = [str(s) for s in args.sizes]
    full = [*cmd, sys.executable, HERE, "--worker", what, "--iters", str(args.iters), "--rounds", str(args.rounds),
            "--sizes", *sizes]
    result = result_of(full, args.timeout, what, env)
    return {int(k): v for k, v in result.items()} if what == "allreduce" else result


def mib(n: int) -> str:
    return f"{n / 2**20:g} MiB"


def part_inter(args, end_pids) -> tuple[dict, float]:
    """Bus bandwidth across a link per rate; returns the fits per rate and the worst deviation."""
    from hpdl import emulated

    print("inter-node: 2 ranks, one per node; busbw (MB/s) vs the link's rate")
    worst, fits = 0.0, {}
    for rate in args.rates:
        link = emulated.link_bits_per_second(rate) / 8
        with emulated.nodes(2, 2, rate, end_pids) as net:
            seconds = job(net.job_command(), args, "allreduce")
        fits[rate] = seconds
        for n, t in sorted(seconds.items()):
            dev = (n / t) / link - 1
            if n >= 4 << 20:
                worst = max(worst, abs(dev))
            print(f"  {rate:>9} {mib(n):>9}: busbw {n / t / 1e6:8.1f}  link {link / 1e6:8.1f}  {dev * 100:+6.1f} %"
                  + ("" if n >= 4 << 20 else "  (below 4 MiB: not counted)"))
    return fits, worst


def part_intra(args, end_pids) -> dict:
    from hpdl import emulated
    from hpdl.launchers import mpiexec_command

    print("intra-node: 2 ranks on one node; busbw (MB/s), emulated node vs plain mpiexec (alternating)")
    runs = {"emulated": [], "plain": []}
    with emulated.nodes(2, 1, args.rates[0], end_pids) as net:
        for _ in range(args.rounds):
            runs["emulated"].append(job(net.job_command(), args, "allreduce"))
            runs["plain"].append(job(mpiexec_command(2), args, "allreduce"))
    med = {k: {n: statistics.median(r[n] for r in v) for n in v[0]} for k, v in runs.items()}
    for n in sorted(med["plain"]):
        e, p = n / med["emulated"][n] / 1e6, n / med["plain"][n] / 1e6
        print(f"  {mib(n):>9}: emulated {e:8.1f}  plain {p:8.1f}  ratio {e / p:5.2f}")
    return med["emulated"]


def predicted_ratio(n: int, inter: dict, intra: dict, gamma: float) -> tuple[float, float, float]:
    """(flat, hierarchical, flat / hierarchical) seconds by the α-β-γ model, 2 nodes × 2 ranks.

    At p = 2 every all-reduce costs 2α + n(β + γ/2): the 2-rank fits give α and β + γ/2."""
    from hpdl.bench import fit_line
    from hpdl.predict import allreduce_seconds

    def alpha_beta(seconds: dict) -> tuple[float, float]:
        a, slope = fit_line(list(seconds), list(seconds.values()))
        return a / 2, max(slope - gamma / 2, 0.0)

    a_out, b_out = alpha_beta(inter)
    a_in, b_in = alpha_beta(intra)
    # flat ring over 4 ranks in lock-step: every step waits for the edge that crosses the link
    flat = allreduce_seconds(n, 4, a_out, b_out, gamma, "ring")
    # binomial reduce in the node (2 ranks: one message and one add), across, binomial broadcast
    hier = (a_in + n * b_in + n * gamma) + allreduce_seconds(n, 2, a_out, b_out, gamma, "ring") + (a_in + n * b_in)
    return flat, hier, flat / hier


def part_hier(args, inter: dict, intra: dict, end_pids) -> None:
    from hpdl import emulated
    from hpdl.bench import fit_line, local_reduce

    n = args.sizes[-1]
    with emulated.nodes(4, 2, args.hier_rate, end_pids) as net:
        got = job(net.job_command(), args, "hier", env=FLAT_RING)
    if not got["ok"] or got["nodes"] != 2:
        sys.exit(f"the hierarchical all-reduce gave a wrong sum or did not see 2 nodes: {got}")
    gamma = fit_line(*(lambda r: (r["sizes"], r["seconds"]))(local_reduce([1 << 20, 4 << 20, 16 << 20])))[1]
    flat, hier, ratio = predicted_ratio(n, inter, intra, gamma)
    measured = got["flat"] / got["hierarchical"]
    print(f"hierarchical vs flat ring, 2 nodes × 2 ranks, {args.hier_rate}, {mib(n)} (median of {args.rounds} rounds)")
    print(f"  measured:  flat {got['flat'] * 1e3:8.1f} ms  hierarchical {got['hierarchical'] * 1e3:8.1f} ms  "
          f"flat / hierarchical {measured:5.2f}")
    print(f"  predicted: flat {flat * 1e3:8.1f} ms  hierarchical {hier * 1e3:8.1f} ms  "
          f"flat / hierarchical {ratio:5.2f}")
    print(f"  measured / predicted ratio - 1 = {(measured / ratio - 1) * 100:+.1f} %  (goal within ±15 %)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", nargs="+", default=["200mbit", "1gbit"], help="link rates, tc's spelling")
    ap.add_argument("--hier-rate", default="1gbit", help="link rate for the hierarchical comparison")
    ap.add_argument("--sizes-mib", nargs="+", type=float, default=[1, 4, 16], help="message sizes (MiB)")
    ap.add_argument("--iters", type=int, default=5, help="timed calls per size and job")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (intra-node, hierarchical)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per job")
    ap.add_argument("--worker", choices=["allreduce", "hier"], help=argparse.SUPPRESS)
    ap.add_argument("--sizes", nargs="+", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from hpdl import emulated, reaper

    problem = emulated.missing()
    if problem:
        sys.exit(problem)
    args.sizes = sorted(int(s * 2**20) // 4 * 4 for s in args.sizes_mib)
    if args.hier_rate not in args.rates:
        args.rates.append(args.hier_rate)
    fits, worst = part_inter(args, reaper.end_pids)
    intra = part_intra(args, reaper.end_pids)
    part_hier(args, fits[args.hier_rate], intra, reaper.end_pids)
    print(f"max |busbw / link - 1| = {worst * 100:.1f} %")


if __name__ == "__main__":
    main()
