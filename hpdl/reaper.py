"""A watchman process: when the notebook's kernel dies, end the ranks it started.

ipyparallel stops its clusters when the kernel exits normally. A killed kernel (SIGKILL,
an out-of-memory kill, a crashed browser tab's forced restart) runs no exit code, and would
leave the controller and every engine running. This small process, started in its own
session, watches the kernel's pid and a state file; when the kernel is gone it kills the
recorded process trees and cancels Slurm jobs. Deleting the state file (a clean stop) lets
it exit quietly.

    python -m hpdl.reaper STATE_FILE
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purpose
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def kill_all(state: dict, grace: float = 2.0) -> None:
    """Kill the recorded trees: TERM first, then KILL what is left after `grace` seconds."""
    import psutil

    procs: dict[int, psutil.Process] = {}
    for pid in state.get("pids", []):
        try:
            p = psutil.Process(pid)
        except psutil.Error:
            continue
        procs[pid] = p
        try:
            for c in p.children(recursive=True):
                procs[c.pid] = c
        except psutil.Error:
            pass
    # read before the kill (a killed MPI rank leaves these in RAM), with those recorded earlier
    shm = shared_memory_of(procs) | set(state.get("shm", []))
    if "watch_pid" in state and not _alive(int(state["watch_pid"])):
        shm |= singleton_shared_memory(int(state["watch_pid"]))
    for pgid in state.get("pgids", []):
        try:
            os.killpg(pgid, signal.SIGTERM)
        except OSError:
            pass
    for job in state.get("slurm_jobs", []):
        subprocess.run(["scancel", str(job)], capture_output=True, timeout=30)
    for p in procs.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(list(procs.values()), timeout=grace)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    for pgid in state.get("pgids", []):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except OSError:
            pass
    psutil.wait_procs(left, timeout=grace)
    for path in shm:
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
        except OSError:
            pass


def singleton_shared_memory(pid: int) -> set[str]:
    """The segment MPICH makes for a process that started MPI by itself (a notebook's kernel
    that imported mpi4py.MPI): named after its pid, and left behind when that process is killed."""
    path = f"/dev/shm/mpich_shm_{pid:x}_0"
    return {path} if os.path.exists(path) else set()


def shared_memory_of(pids) -> set[str]:
    """The /dev/shm files these processes map (MPICH's shared-memory segments between ranks)."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find("/dev/shm/")
                    if i >= 0 and not line.rstrip().endswith("(deleted)"):
                        found.add(line[i:].strip())
        except OSError:
            continue
    return found


def watch(state_file: str, poll: float = 0.5) -> int:
    while True:
        try:
            with open(state_file) as f:
                state = json.load(f)
        except FileNotFoundError:
            return 0  # stopped cleanly by the kit
        except (OSError, ValueError):
            time.sleep(poll)
            continue
        if not _alive(int(state["watch_pid"])):
            kill_all(state)
            try:
                os.unlink(state_file)
            except OSError:
                pass
            return 0
        time.sleep(poll)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a notebook interrupt is not our business
    sys.exit(watch(sys.argv[1]))
