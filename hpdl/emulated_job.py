"""One MPI job on emulated nodes, from a shell or a lesson's `!` line (as root, or in a user namespace):

    python -m hpdl.emulated_job --nodes 2 --link 1gbit -n 4 python benchmarks/ddp_overlap.py

Creates the nodes (hpdl.emulated), runs `mpiexec ... -n N COMMAND` on them as a side job
(hpdl.sidejob: a time limit, nothing left running), prints its output, removes the nodes, and
exits with the job's status. Why a module apart from emulated.py: it starts and ends processes,
which only side jobs and the reaper do.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping

from hpdl import emulated, reaper, sidejob
from hpdl.errors import HpdlError


def run(command: list[str], n: int, nodes: int, link: str, timeout: float,
        env: Mapping[str, str] | None = None) -> sidejob.Finished:
    """Run `command` as `n` ranks on `nodes` emulated nodes joined by `link`; removes them after.
    `env`: the job's environment (default this process's), to which the ranks' RANK_ENV is added."""
    with emulated.nodes(n, nodes, link, reaper.end_pids) as net:
        return sidejob.run([*net.job_command(), *command], timeout,
                           env={**(os.environ if env is None else env), **emulated.RANK_ENV})


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpdl.emulated_job", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes (default 2)")
    ap.add_argument("--link", default="1gbit", help="each node's link rate, tc's spelling (default 1gbit)")
    ap.add_argument("-n", type=int, default=4, help="ranks, placed in blocks over the nodes (default 4)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds before the job is ended (default 600)")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="the program and its arguments")
    args = ap.parse_args(argv)
    if not args.command:
        ap.error("name the program to run, e.g. python benchmarks/ddp_overlap.py")
    signal.signal(signal.SIGTERM, _leave)  # told to stop (hpdl.run_job's limit): the nodes go too
    try:
        done = run(args.command, args.n, args.nodes, args.link, args.timeout)
    except HpdlError as exc:
        print(f"hpdl: {exc}", file=sys.stderr)
        return 2
    return finish(done, args.timeout)


def _leave(signum, frame) -> None:
    """SIGTERM ends this process through its `with` blocks: the job's ranks, then the nodes."""
    raise SystemExit(128 + signum)


def finish(done: sidejob.Finished, timeout: float) -> int:
    """Print what the command printed; its exit status, 124 (as timeout(1)) when it was ended."""
    sys.stdout.write(done.output)
    if done.timed_out:
        print(f"hpdl: the command did not finish in {timeout:.0f} s and was ended.", file=sys.stderr)
        return 124
    return done.returncode or 0


if __name__ == "__main__":
    sys.exit(main())
