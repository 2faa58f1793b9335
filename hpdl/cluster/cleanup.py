"""Client side: the run folders, the watchman (reaper.py), ending a cluster, `hpdl cleanup`.

While a cluster starts, `record()` keeps the reaper's state file up to date with every process
it must end should the kernel die (as hpdl.procs records, so a reused pid is never signalled)
and the MPI shared memory the ranks map. `force_stop()` ends everything a cluster started and
removes its run folder; `main()` is `hpdl cleanup`, for clusters whose kernel is gone (and run
folders that outlived theirs).
It also removes MPI shared memory that processes killed outside the kit left in RAM
(procs.remove_orphaned_shared_memory, also called at every start).
"""
from __future__ import annotations

import logging
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from hpdl import emulated, procs, reaper, settings

if TYPE_CHECKING:
    from hpdl.cluster.lifecycle import Cluster

log = logging.getLogger(__name__)


def home() -> Path:
    """Where the kit keeps its IPython profile and run files ($HPDL_HOME, else ~/.hpdl)."""
    return settings.HOME.get()


def start_reaper(state_file: Path) -> subprocess.Popen:
    """The watchman, in its own session so that an interrupt or the kernel's death spares it."""
    return subprocess.Popen(
        [sys.executable, "-m", "hpdl.reaper", str(state_file)],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def record(cluster: "Cluster") -> None:
    """Tell the reaper what to end should the kernel die: process trees, groups, batch jobs."""
    pids, jobs = [], []
    ctl = getattr(cluster.ipp, "controller", None)
    if ctl is not None and getattr(ctl, "pid", None):
        pids.append(ctl.pid)
    for es in getattr(cluster.ipp, "engines", {}).values():
        if getattr(es, "pid", None):
            pids.append(es.pid)
        job = getattr(es, "job_id", None)
        if job:
            jobs.append(job)
    ranks = [r["pid"] for r in cluster.ranks] if cluster.local else []
    recorded = [p for p in map(procs.record, pids + ranks) if p is not None]
    # the controller and the first MPI launcher lead their own process groups
    groups = [p for p in recorded if p.pid in pids[:2]]
    # MPI's shared-memory segments between ranks: a killed job leaves them in RAM (/dev/shm),
    # and once its ranks are gone nothing maps them any more, so remember them now; also those
    # of a batch job's ranks that run on this host (a site's epilog may not remove them).
    here = [r["pid"] for r in cluster.ranks if r.get("host") == socket.gethostname()]
    shm = sorted(procs.shared_memory_of(ranks or here))
    network = cluster.network.to_dict() if cluster.network is not None else None
    reaper.write_state(cluster.state_file, procs.record(os.getpid()), recorded, groups, jobs, shm, cluster.launcher,
                       network)


def force_stop(cluster: "Cluster") -> None:
    """End everything this cluster started, whatever state it is in, and remove its files."""
    state = reaper.read_state(cluster.state_file) or {}
    if cluster.client is not None:
        try:
            cluster.client.close()
        except Exception as exc:
            log.debug("closing the client: %s", exc)
    reaper.kill_all(state, grace=3.0)
    try:
        cluster.ipp.stop_cluster_sync()
    except Exception as exc:
        log.warning("ipyparallel could not stop cluster %s cleanly: %s", cluster.ipp.cluster_id, exc)
    if cluster.network is not None:  # after its processes: a namespace lives while one runs in it
        emulated.remove(cluster.network.to_dict(), reaper.end_pids)
    cluster.state_file.unlink(missing_ok=True)  # the reaper sees it gone and leaves
    if cluster.reaper is not None:
        # nothing is left for it to do (the processes ended, the state file gone): ended at once, not waited
        # for until its next look at the file (0.5 s apart: 0.25 s a stop)
        procs.end_popen(cluster.reaper, grace=0)
    shutil.rmtree(cluster.run_dir, ignore_errors=True)
    for f in (home() / "profile" / "log").glob(f"*{cluster.ipp.cluster_id}*"):
        f.unlink(missing_ok=True)


def end_orphaned_clusters(everything: bool = False) -> int:
    """End the clusters recorded on this host whose kernel is gone (all of them with
    `everything`), and remove their run folders; returns how many."""
    n = 0
    for state_file in sorted((home() / "runs").glob("*/reaper.json")):
        state = reaper.read_state(state_file)
        if state is None or not reaper.on_this_host(state):
            continue
        if everything or reaper.orphaned(state):
            reaper.kill_all(state)
            reaper.remove_run_folder(state_file)
            n += 1
    return n


def remove_stale_run_folders(age: float = 300.0) -> list[Path]:
    """Run folders with no state file, older than `age` s: left by a cluster whose kernel and
    reaper were both killed, or by a start that failed half-way. A live cluster's folder always
    holds its state file from the first seconds of its start; a shared $HOME's other hosts' too."""
    import time

    removed = []
    for folder in sorted((home() / "runs").glob("*")):
        try:
            stale = folder.is_dir() and not (folder / "reaper.json").exists() \
                and time.time() - folder.stat().st_mtime > age
        except OSError:
            continue
        if stale:
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def sweep_emulated_nodes() -> list[str]:
    """Remove emulated nodes (hpdl.emulated) that no live cluster on this host recorded: those of
    a kernel killed before its reaper knew of them, or left by a crash. Returns their tags."""
    if emulated.missing():  # not root: the kit cannot have made any
        return []
    keep = set()
    for state_file in (home() / "runs").glob("*/reaper.json"):
        state = reaper.read_state(state_file)
        if state and state.get("network") and not reaper.orphaned(state):
            keep.add(state["network"]["tag"])
    return emulated.sweep(keep, reaper.end_pids)


def main(argv: list[str]) -> int:
    """`hpdl cleanup [--all]`: end clusters whose kernel is gone (the reaper normally does this
    by itself). Clusters recorded on another host (a $HOME shared by a cluster's nodes) are left
    alone, even with --all; processes are signalled only if they are still the ones recorded.
    Then MPI shared memory that nothing maps any more is removed (see procs.orphaned_shared_memory).
    Options through argparse: `--help` prints help and ends nothing."""
    import argparse

    ap = argparse.ArgumentParser(prog="hpdl cleanup", description="Stop clusters this kit started whose kernel is "
                                 "gone; remove the run folders of clusters already gone, and MPI shared memory "
                                 "nothing uses any more.")
    ap.add_argument("--all", action="store_true",
                    help="end every cluster of this kit recorded on this host, its kernel gone or not")
    args = ap.parse_args(argv)
    n = end_orphaned_clusters(args.all)
    stale = remove_stale_run_folders()
    nodes = sweep_emulated_nodes()
    removed = procs.remove_orphaned_shared_memory()
    print(f"hpdl cleanup: ended {n} cluster{'s' if n != 1 else ''}"
          + (f"; removed {len(stale)} run folder(s) of clusters already gone" if stale else "")
          + (f"; removed {len(nodes)} set(s) of emulated nodes" if nodes else "")
          + (f"; removed {len(removed)} MPI shared-memory file(s) nothing used any more." if removed else "."))
    return 0
