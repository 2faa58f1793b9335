"""A watchman process: when the notebook's kernel dies, end the ranks it started.

ipyparallel stops its clusters when the kernel exits normally. A killed kernel (SIGKILL,
an out-of-memory kill, a crashed browser tab's forced restart) runs no exit code, and would
leave the controller and every engine running. This small process, started in its own
session, watches the kernel and a state file; when the kernel is gone it ends the recorded
process trees, cancels Slurm jobs, removes the ranks' MPI shared memory and the run folder. Deleting the state
file (a clean stop) lets it exit quietly.

The state file (JSON, written by hpdl.cluster) records processes as hpdl.procs records — pid,
start time, host, boot id — so a pid reused after the kernel died, or a state file read on
another node or after a reboot, never gets a signal:

    {"watch": PROC, "procs": [PROC, ...], "groups": [PROC, ...], "launcher": "slurm", "jobs": ["123"],
     "shm": [PATH, ...], "network": {"tag": ..., "subnet": ..., ...} or null}

    python -m hpdl.reaper STATE_FILE
"""
from __future__ import annotations

import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path

from hpdl import procs

log = logging.getLogger(__name__)


def write_state(path: Path, watch: procs.Proc | None, recorded: list[procs.Proc], groups: list[procs.Proc],
                jobs: list[str], shm: list[str], launcher: str = "local", network: dict | None = None) -> None:
    """Write the state atomically (the reaper may read it at any moment). `jobs` are the batch
    jobs `launcher` submitted for the ranks: the reaper cancels them through that launcher;
    `network` the emulated nodes the ranks run on (hpdl.emulated.Network.to_dict()), removed after them."""
    state = {
        "watch": watch.to_dict() if watch else None,
        "procs": [p.to_dict() for p in recorded],
        "groups": [p.to_dict() for p in groups],
        "launcher": launcher,
        "jobs": list(jobs),
        "shm": sorted(shm),
        "network": network,
    }
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, path)


def read_state(path: Path | str) -> dict | None:
    """The state, or None when there is none (stopped cleanly) or it cannot be read."""
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        log.debug("cannot read %s: %s", path, exc)
        return None


def _watched(state: dict) -> procs.Proc | None:
    w = state.get("watch")
    return procs.Proc.from_dict(w) if w else None


def on_this_host(state: dict) -> bool:
    """Recorded here? A $HOME shared by a cluster's nodes holds other nodes' clusters too."""
    w = _watched(state)
    return w is not None and w.host == socket.gethostname()


def orphaned(state: dict) -> bool:
    """The kernel that started this cluster is gone (on this host: dead, or from an earlier boot)."""
    w = _watched(state)
    return w is not None and w.host == socket.gethostname() and not procs.is_alive(w)


def kill_all(state: dict, grace: float = 2.0) -> None:
    """End the recorded trees and groups (TERM, then KILL after `grace` s), cancel the batch
    jobs through the launcher that submitted them (Slurm's, or a site's own: hpdl.launchers),
    and remove the MPI shared memory the ranks mapped or were recorded with."""
    def cancel() -> None:
        jobs = state.get("jobs", [])
        if not jobs:
            return
        from hpdl import launchers
        from hpdl.errors import HpdlError

        try:
            launcher = launchers.get(str(state.get("launcher", "")))
        except HpdlError as exc:
            log.warning("could not cancel jobs %s: %s", jobs, exc)
            return
        for job in jobs:
            try:
                launcher.cancel(str(job))
            except Exception as exc:  # one job that cannot be cancelled must not spare the others
                log.warning("could not cancel %s job %s: %s", launcher.name, job, exc)

    recorded = [procs.Proc.from_dict(d) for d in state.get("procs", [])]
    groups = [procs.Proc.from_dict(d) for d in state.get("groups", [])]
    shm = procs.end(recorded, groups, grace=grace, before_kill=cancel) | set(state.get("shm", []))
    w = _watched(state)
    if w is not None and w.host == socket.gethostname() and procs.start_time(w.pid) is None:
        shm |= procs.singleton_shared_memory(w.pid)  # a dead kernel that had started MPI itself
    procs.remove_shared_memory(shm)
    _remove_nodes(state)  # after the processes: a namespace lives while one runs in it


def _remove_nodes(state: dict) -> None:
    """The emulated nodes the ranks ran on (hpdl.emulated), if any."""
    if state.get("network"):
        from hpdl import emulated

        emulated.remove(state["network"], end_pids)


def end_pids(pids: list[int], grace: float = 1.0) -> None:
    """End these processes and their descendants (left in an emulated node's namespace)."""
    procs.end([p for p in map(procs.record, pids) if p is not None], grace=grace)


def remove_run_folder(state_file: Path) -> None:
    """A dead cluster's state file, then its run folder (hang requests, engines' sockets, emulated
    nodes' scripts and namespace files), as a clean stop removes it: only a folder of the kit's
    runs/ folder, whatever path the reaper was handed."""
    import shutil

    state_file.unlink(missing_ok=True)  # first: `hpdl cleanup` no longer lists the cluster
    if state_file.parent.parent.name == "runs":
        shutil.rmtree(state_file.parent, ignore_errors=True)


def watch(state_file: str, poll: float = 0.5) -> int:
    while True:
        state = read_state(state_file)
        if state is None and not os.path.exists(state_file):
            return 0  # stopped cleanly by the kit
        if state is not None and orphaned(state):
            kill_all(state)
            remove_run_folder(Path(state_file))
            return 0
        time.sleep(poll)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook interrupt is not our business
    sys.exit(watch(sys.argv[1]))
