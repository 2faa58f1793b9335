"""Client side: wait for a cell on the ranks, and say what went wrong when it does not finish.

`wait()` polls rather than blocks, so a dead rank is noticed within a fraction of a second.
Past the time limit it asks the unfinished ranks where they are (hpdl.hang) and raises
RankHang worded by hang.hang_message — the same wording the checker uses; a dead rank
raises RankDied naming the rank that died first.
"""
from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

from hpdl import hang
from hpdl.errors import RankDied, RankHang

if TYPE_CHECKING:
    from hpdl.cluster.lifecycle import Cluster

RESTART_ADVICE = (
    "Stuck ranks cannot be interrupted: run hpdl.restart() for fresh ranks (variables on the "
    "engines are lost), then re-run your set-up cells. To allow more time: %%px --timeout 600.\n"
    + hang.PANEL_HINT
)


def wait(ar, timeout: float, cluster: "Cluster", code: str | None = None, engines: list[int] | None = None,
         what: str = "the cell") -> None:
    """Wait for an AsyncResult on the ranks, raising RankHang or RankDied with details.

    engines: the engine of each of `ar.msg_ids`, in order (default: every engine of the cluster);
    what: what was waited for, as the hang report's headline names it."""
    deadline = time.monotonic() + timeout
    while not ar.ready():
        ar.wait(0.1)
        if ar.ready():
            break
        dead = cluster.dead_ranks()
        if dead:
            raise RankDied(death_report(cluster, dead))
        if time.monotonic() > deadline:
            raise RankHang(hang_report(cluster, ar, code, f"{what} did not finish on every rank within {timeout:g} s.",
                                       engines=engines))
    dead = cluster.dead_ranks()
    if dead:
        raise RankDied(death_report(cluster, dead))


def _engine_to_rank(cluster: "Cluster") -> dict[int, int]:
    return {r["engine_id"]: r["rank"] for r in cluster.ranks}


def _by_engine(cluster: "Cluster", ar, engines: list[int] | None) -> list[tuple[str, int]]:
    """(msg_id, rank) for each rank the cell was sent to."""
    e2r = _engine_to_rank(cluster)
    return [(m, e2r.get(e, e)) for m, e in zip(ar.msg_ids, cluster.client.ids if engines is None else engines)]


def pending_ranks(cluster: "Cluster", ar, engines: list[int] | None = None) -> tuple[list[int], list[int]]:
    """(finished, stuck) ranks of a cell."""
    outstanding = cluster.client.outstanding
    done, stuck = [], []
    for msg_id, rank in _by_engine(cluster, ar, engines):
        (stuck if msg_id in outstanding else done).append(rank)
    return sorted(done), sorted(stuck)


def hang_report(cluster: "Cluster", ar, code: str | None, headline: str, engines: list[int] | None = None) -> str:
    """Under `headline`, name the finished and the stuck ranks (with their lines) and remember the stuck
    cell, so that the cluster refuses more work until restarted."""
    done, stuck = pending_ranks(cluster, ar, engines)
    dumps = {r["rank"] for r in cluster.ranks if r.get("stack_dumps")}  # SIGUSR1 is safe only there
    where = hang.ask(str(cluster.run_dir), stuck, procs={r: p for r, p in cluster.rank_procs.items() if r in dumps})
    for msg_id, rank in _by_engine(cluster, ar, engines):
        if msg_id in cluster.client.outstanding:
            cluster.wedged[msg_id] = rank
    return hang.hang_message(headline, {r: where.get(r) for r in stuck}, done, _errors_by_rank(cluster, ar, engines),
                             code, advice=RESTART_ADVICE)


def _errors_by_rank(cluster: "Cluster", ar, engines: list[int] | None) -> dict[int, str]:
    out = {}
    for msg_id, rank in _by_engine(cluster, ar, engines):
        if msg_id in cluster.client.outstanding:
            continue
        res = cluster.client.results.get(msg_id)
        if isinstance(res, BaseException):
            ename = getattr(res, "ename", type(res).__name__)
            evalue = getattr(res, "evalue", str(res))
            out[rank] = f"{ename}: {evalue}"
    return out


_NANNY_RE = re.compile(r"KernelNanny\.(\d+)\] Pipe closed")
_EXIT_RE = re.compile(r"EXIT STRING: ([^\n]+)|EXIT CODE: (\d+)")


def _launcher_reported(cluster: "Cluster", timeout: float = 1.0) -> str:
    """The launcher's output once the MPI launcher has reported how the job ended (or after
    `timeout` s): each engine's nanny logs the moment its rank goes, mpiexec the exit code."""
    deadline = time.monotonic() + timeout
    while True:
        out = cluster.launcher_output()
        if (_EXIT_RE.search(out) and _NANNY_RE.search(out)) or time.monotonic() > deadline:
            return out
        time.sleep(0.1)


def death_report(cluster: "Cluster", dead: list[int]) -> str:
    """Name the rank that died first, and why the others went with it."""
    out = _launcher_reported(cluster)
    e2r = _engine_to_rank(cluster)
    order = [e2r.get(int(m.group(1)), int(m.group(1))) for m in _NANNY_RE.finditer(out)]
    first = order[0] if order else dead[0]
    m = _EXIT_RE.search(out)
    how = ""
    if m:
        how = f", {m.group(1).strip()}" if m.group(1) else f", exit code {m.group(2)}"
    pid = cluster.engine_pids().get(first, "?")
    lines = [f"rank {first} (pid {pid}{how}) died while this cell was running."]
    others = [r["rank"] for r in cluster.ranks if r["rank"] != first]
    if others:
        lines.append(
            f"Ranks {hang.ranks_text(others)} belong to the same MPI job, which ends when one of its ranks dies."
            if len(others) > 1 else
            f"Rank {others[0]} belongs to the same MPI job, which ends when one of its ranks dies."
        )
    lines.append("Run hpdl.start() for fresh ranks, then re-run your set-up cells.")
    return "\n".join(lines)
