"""Rank side, both jobs of a check: what every rank of a check job does besides the cases.

A check runs two MPI jobs per rank count (see jobs.py): the learner's (learner_job.py) and
the checker's own (reference_job.py). Each rank of either reads its spec from JOB_DIR, writes
events to JOB_DIR/rank<R>.jsonl, waits for the other ranks between cases through files
(sleeping, not spinning in MPI, so finished ranks leave the cores to the others), and runs a
side thread that answers stack requests (JOB_DIR/dump-request) and ends the process when the
client is gone or the job's deadline passed, so a killed notebook never leaves ranks behind.
faulthandler on SIGUSR1 is the fallback for code that holds the GIL.
"""
from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import sys
import threading
import time
import traceback

state = {"case": None, "phase": "starting", "offset": 0}


def learner_where(frames, files: set[str]) -> dict | None:
    ours = [f for f in frames if f.filename in files]
    if not ours:
        return None
    f = ours[-1]
    return {"file": f.filename, "line": f.lineno + state["offset"], "func": f.name, "code": (f.line or "").strip()}


def learner_traceback(tb, files: set[str]) -> list[str]:
    frames = [f for f in traceback.extract_tb(tb) if f.filename in files]
    return [f"line {f.lineno + state['offset']} in {f.name}: {(f.line or '').strip()}" for f in frames]


def short(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class RankJob:
    """One rank of a check job."""

    def __init__(self, job_dir: str):
        self.dir = job_dir
        with open(os.path.join(job_dir, "spec.pkl"), "rb") as f:
            self.spec = pickle.load(f)
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.files: set[str] = set()
        self.log = open(os.path.join(job_dir, f"rank{self.rank}.jsonl"), "a", buffering=1)
        self._fault = open(os.path.join(job_dir, f"rank{self.rank}.fault"), "w")
        faulthandler.register(signal.SIGUSR1, file=self._fault, all_threads=True, chain=False)
        threading.Thread(target=self._watch, args=(threading.main_thread().ident,), daemon=True,
                         name="hpdl-check-watch").start()

    def emit(self, **event) -> None:
        event["t"] = time.time()
        self.log.write(json.dumps(event, default=str) + "\n")
        self.log.flush()

    def current_call(self) -> str | None:
        return None

    def _watch(self, main_ident: int) -> None:
        request = os.path.join(self.dir, "dump-request")
        client = int(self.spec.get("client_pid") or 0)  # 0 in a sandbox: bwrap ends us with the client
        deadline = float(self.spec["deadline"])
        seen, tick = None, 0
        while True:
            time.sleep(0.05)
            tick += 1
            if tick % 10 == 0 and (time.time() > deadline or (client and not _alive(client))):
                _unlink_shared_memory(client)  # MPI_Finalize, which would, never comes
                os._exit(70)
            try:
                with open(request) as f:
                    token = f.read().strip()
            except OSError:
                continue
            if not token or token == seen:
                continue
            seen = token
            try:
                frame = sys._current_frames().get(main_ident)
                frames = traceback.extract_stack(frame) if frame is not None else []
                data = {"token": token, "rank": self.rank, "case": state["case"], "phase": state["phase"],
                        "where": learner_where(frames, self.files), "call": self.current_call()}
                out = os.path.join(self.dir, f"stack{self.rank}.json")
                with open(out + ".tmp", "w") as f:
                    json.dump(data, f)
                os.replace(out + ".tmp", out)
            except Exception as exc:  # the watcher must never take the rank down
                print(f"hpdl check: stack report failed: {exc}", file=sys.stderr)

    def barrier(self, tag: str) -> None:
        """Wait for every rank of this job to reach `tag`, sleeping, not spinning in MPI."""
        open(os.path.join(self.dir, f"done-{tag}-{self.rank}"), "w").close()
        names = [os.path.join(self.dir, f"done-{tag}-{r}") for r in range(self.size)]
        pause = 0.0005
        while not all(os.path.exists(n) for n in names):
            time.sleep(pause)
            pause = min(pause * 1.5, 0.02)

    def wait_for(self, path: str) -> None:
        pause = 0.0005
        while not os.path.exists(path):
            time.sleep(pause)
            pause = min(pause * 1.5, 0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _unlink_shared_memory(client: int) -> None:
    """Remove the /dev/shm segments this process maps (MPI's shared-memory transport), and the
    one of a client that started MPI itself and is gone (a killed kernel that imported mpi4py.MPI).
    (The one place on the rank side that removes segments; to move onto hpdl.procs.)"""
    from hpdl.reaper import _alive as alive, shared_memory_of, singleton_shared_memory

    gone = set() if not client or alive(client) else singleton_shared_memory(client)
    for path in shared_memory_of([os.getpid()]) | gone:
        try:
            os.unlink(path)
        except OSError:
            pass


def main(job_cls, argv: list[str]) -> int:
    job = job_cls(argv[0])
    try:
        return job.run()
    except BaseException as exc:  # our own failure: say so on every rank, then leave
        job.emit(ev="crash", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1
