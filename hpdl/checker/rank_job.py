"""Rank side, both jobs of a check: what every rank of a check job does besides the cases.

A check runs two MPI jobs per rank count (see jobs.py): the learner's (learner_job.py) and
the checker's own (reference_job.py). Each rank of either reads its spec from JOB_DIR, writes
events to JOB_DIR/rank<R>.jsonl, waits for the other ranks between cases through files
(sleeping, not spinning in MPI, so finished ranks leave the cores to the others), and runs
hpdl.hang's Answerer: it answers "where are you?" (the same protocol as `%%px` cells) and
ends the process when the client is gone or the job's deadline passed, so a killed notebook
never leaves ranks behind. faulthandler on SIGUSR1 is the fallback for code that holds the GIL.
"""
from __future__ import annotations

import json
import os
import pickle
import time
import traceback

state = {"case": None, "phase": "starting", "offset": 0}


def learner_where(frames, files: set[str]) -> dict | None:
    from hpdl import hang

    return hang.learner_where(frames, files, state["offset"])


def learner_traceback(tb, files: set[str]) -> list[str]:
    frames = [f for f in traceback.extract_tb(tb) if f.filename in files]
    return [f"line {f.lineno + state['offset']} in {f.name}: {(f.line or '').strip()}" for f in frames]


def short(text: str, limit: int = 400) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


class RankJob:
    """One rank of a check job."""

    def __init__(self, job_dir: str):
        from hpdl import hang

        self.dir = job_dir  # where this rank's own files go (own_dir(), once its rank is known)
        with open(os.path.join(job_dir, "spec.pkl"), "rb") as f:
            self.spec = pickle.load(f)
        self.before_mpi(job_dir)
        from mpi4py import MPI

        self.MPI = MPI
        self.world = MPI.COMM_WORLD
        self.rank, self.size = self.world.Get_rank(), self.world.Get_size()
        self.dir = self.own_dir(job_dir)
        code = self.spec.get("code") or {}
        self.files: set[str] = set(code.get("lines", {})) | ({code["filename"]} if code.get("filename") else set())
        state["offset"] = int(code.get("line_offset", 0))
        self.log = open(os.path.join(self.dir, f"rank{self.rank}.jsonl"), "a", buffering=1)
        self._fault = hang.install_faulthandler(self.dir, self.rank)
        self.client = int(self.spec.get("client_pid") or 0)  # 0 in a sandbox: bwrap ends us with the client
        # the job's whole allowance, counted on this rank's monotonic clock from its start
        self.deadline = time.monotonic() + float(self.spec["lifetime"])
        hang.Answerer(self.dir, self.rank, poll=0.05, files=self.files, line_offset=state["offset"],
                      extra=lambda: {"case": state["case"], "phase": state["phase"], "call": self.current_call()},
                      on_tick=self._tick).start()

    def before_mpi(self, job_dir: str) -> None:
        """What a rank does before MPI starts (and any thread with it): nothing here; see LearnerJob."""

    def own_dir(self, job_dir: str) -> str:
        """The folder of this rank's own files (events, stacks, results): the job's folder here."""
        return job_dir

    def emit(self, **event) -> None:
        event["t"] = time.time()
        self.log.write(json.dumps(event, default=str) + "\n")
        self.log.flush()

    def current_call(self) -> str | None:
        return None

    def _tick(self) -> None:
        """Never outlive the client, nor the job's deadline."""
        from hpdl import procs

        if time.monotonic() > self.deadline or (self.client and not procs.pid_alive(self.client)):
            _unlink_shared_memory(self.client)  # MPI_Finalize, which would, never comes
            os._exit(70)

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


def _unlink_shared_memory(client: int) -> None:
    """Remove the /dev/shm segments this process maps (MPI's shared-memory transport), and the
    one of a client that started MPI itself and is gone (a killed kernel that imported mpi4py.MPI)."""
    from hpdl import procs

    gone = procs.singleton_shared_memory(client) if client and not procs.pid_alive(client) else set()
    procs.remove_shared_memory(procs.shared_memory_of([os.getpid()]) | gone)


def main(job_cls, argv: list[str]) -> int:
    job = job_cls(argv[0])
    try:
        return job.run()
    except BaseException as exc:  # our own failure: say so on every rank, then leave
        job.emit(ev="crash", message=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
        return 1
