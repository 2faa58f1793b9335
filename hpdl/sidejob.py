"""The one supervisor of a short job beside the learner's ranks: start, poll, end.

A check's MPI jobs, a graded notebook, a tuning sweep, preflight's local job and the doctor's
probes are all the same thing seen from here: a command we start, whose output goes to a file,
which we poll until it is done or its time is up, and which must leave nothing behind — no
process (its tree, its process group, and a daemon that left both), and no MPI shared memory
(a killed rank never reaches MPI_Finalize, which is what removes MPICH's /dev/shm files).

    with SideJob(cmd, output=path, timeout=60) as job:   # started in a session of its own
        while job.running():                             # polls; notes the tree's /dev/shm files
            if job.expired(): ...                        # monotonic: a clock step changes nothing
    # leaving the block ends it: one grace policy, below

One grace policy. A job that has done its work (`end()`) gets GRACE seconds after SIGTERM to
exit by itself; one past its time, interrupted, or whose result is already decided
(`end(now=True)`) is killed at once — nothing it could still do is worth waiting for.

Deadlines use time.monotonic(): a wall-clock step (NTP, a suspended laptop) must not turn a
running case into a HANG. Signals go through hpdl.procs, the one module that sends them.
"""
from __future__ import annotations

import atexit
import functools
import logging
import os
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass
from typing import IO, Mapping, Sequence

from hpdl import procs, settings

log = logging.getLogger(__name__)

GRACE = 3.0  # s after SIGTERM for a job whose work is done (MPI_Finalize, files flushed)
REAP = 5.0  # s to reap the job's first process once its tree was killed
SEGMENT_SCAN = 0.25  # s between two looks at which /dev/shm files the job's processes map
MARKER = settings.SIDE_JOB.name  # set in every side job's environment: how `sweep` finds its daemons

_live: set["SideJob"] = set()


@dataclass
class Finished:
    """How a job started by `run` ended."""

    returncode: int | None  # None: it was killed at its time limit
    output: str  # stdout, and stderr interleaved as written unless errors_apart
    errors: str  # stderr, with errors_apart
    timed_out: bool
    seconds: float

    @property
    def stdout(self) -> str:  # the names subprocess.run's result has, for a lesson's cell
        return self.output

    @property
    def stderr(self) -> str:
        return self.errors


def _child_setup(starter: int, limits) -> None:
    """In the job's first process before exec: it ends with the thread that started it (`starter`, its
    pid; 0: not), even one killed with no chance to end it (procs.die_with); then the sandbox's limits."""
    if starter:
        procs.die_with(starter)
    if limits is not None:
        limits.apply()


class SideJob:
    """One short job: started in its own session, output to a file, ended with all it started.

    cmd: the command (for an MPI job, from `hpdl.launchers.side_job_command`, or for a check's jobs,
         which stay on this node, `local_job_command`).
    output: a file path for stdout+stderr (kept), else a private temporary file (read by `output_text`).
    timeout: seconds from start after which `expired()` is true (None: never).
    limits: an object with start() (in this process), apply() (in the child, before exec) and
        stop() — the grading sandbox's `Limits` — or None.
    shared_memory: note the /dev/shm files the job's processes map and remove them when it ends
        (False for a sandboxed job: its /dev/shm is private and goes with it).
    sweep: when ending, also end every process whose environment carries this job's marker (a
        daemon that left the tree and the process group; for untrusted code outside a sandbox).
    errors_apart: stderr to a temporary file of its own (`error_text`), for a probe whose stdout
        is parsed; otherwise it goes with stdout.
    ends_with_starter: SIGKILLed when the thread that started it ends (procs.die_with), even one killed
        with no chance to end it. False for a job whose processes watch their starter themselves and
        clean up as they go (a check's ranks outside a sandbox remove their MPI shared memory first).
    """

    def __init__(self, cmd: Sequence[str], *, output: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 timeout: float | None = None, limits=None, shared_memory: bool = True, sweep: bool = False,
                 errors_apart: bool = False, ends_with_starter: bool = True):
        self.cmd = [str(c) for c in cmd]
        self.marker = uuid.uuid4().hex
        self.shared_memory, self.sweep = shared_memory, sweep
        self.segments: set[str] = set()  # /dev/shm files its processes mapped, removed when it ends
        self.limits = limits.start() if limits is not None else None
        # a named output file is closed when the job ends; a temporary one stays readable until
        # this object goes (output_text after end, as `run` does)
        self._named = output is not None
        self._out: IO[bytes] = open(output, "wb") if output is not None else tempfile.TemporaryFile()
        self._err: IO[bytes] | None = tempfile.TemporaryFile() if errors_apart else None
        child_env = dict(os.environ if env is None else env)
        child_env[MARKER] = self.marker
        preexec = functools.partial(_child_setup, os.getpid() if ends_with_starter else 0, self.limits)
        self.began = time.time()  # wall clock: a segment made since then is this job's, or a newer one's
        try:
            self.proc = subprocess.Popen(self.cmd, stdout=self._out, stderr=self._err or subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, env=child_env, cwd=cwd,
                                         start_new_session=True, preexec_fn=preexec)
        except BaseException:
            self._out.close()
            if self.limits is not None:
                self.limits.stop()
            raise
        self.started = time.monotonic()
        self.deadline = None if timeout is None else self.started + timeout
        self.record = procs.record(self.proc.pid)
        self.returncode: int | None = None
        self._ended = False
        self._scanned = 0.0
        _live.add(self)

    # -- while it runs -------------------------------------------------------------------------
    @property
    def pid(self) -> int:
        return self.proc.pid

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def expired(self) -> bool:
        """Past its time limit (monotonic clock)."""
        return self.deadline is not None and time.monotonic() > self.deadline

    def running(self) -> bool:
        """Whether it still runs; while it does, notes the /dev/shm files its processes map."""
        if self.proc.poll() is not None:
            return False
        if self.shared_memory and time.monotonic() - self._scanned >= SEGMENT_SCAN:
            self._scanned = time.monotonic()
            self.segments |= procs.shared_memory_of(self.pids())
        return True

    def pids(self) -> list[int]:
        """The job's first process and everything under it now."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            return [root.pid, *(c.pid for c in root.children(recursive=True))]
        except psutil.Error:
            return []

    def wait(self, timeout: float | None = None, poll: float = 0.05) -> int | None:
        """Wait until it exits (its exit code), its own time limit or `timeout` s pass (None)."""
        until = None if timeout is None else time.monotonic() + timeout
        while self.running():
            if self.expired() or (until is not None and time.monotonic() > until):
                return None
            time.sleep(poll)
        return self.proc.returncode

    def output_text(self, tail_bytes: int | None = None) -> str:
        """What it wrote so far (the last `tail_bytes` only, if given)."""
        if not self._out.closed:
            self._out.flush()
        if self._named:  # opened write-only: read it by its name
            with open(self._out.name, "rb") as f:
                return _tail(f, tail_bytes)
        with os.fdopen(os.dup(self._out.fileno()), "rb") as f:
            return _tail(f, tail_bytes)

    def error_text(self) -> str:
        """What it wrote to stderr (with errors_apart; else it is in output_text)."""
        if self._err is None:
            return ""
        self._err.flush()
        with os.fdopen(os.dup(self._err.fileno()), "rb") as f:
            return _tail(f, None)

    # -- ending --------------------------------------------------------------------------------
    def end(self, now: bool = False) -> int | None:
        """End it and everything it started; reap it; remove the MPI shared memory it held.

        now=False: SIGTERM, GRACE s to exit, then SIGKILL (its work is done). now=True: SIGKILL at
        once (past its time, interrupted, or its result already decided). Safe to call twice."""
        if self._ended:
            return self.returncode
        self._ended = True
        try:
            self.segments |= self._kill(0.0 if now else GRACE)
            try:
                self.returncode = self.proc.wait(timeout=REAP)
            except subprocess.TimeoutExpired:
                procs.end_group_now(self.proc)
                self.returncode = procs.end_popen(self.proc, grace=0)
        finally:
            _live.discard(self)
            if self._named:
                self._out.close()
            if self.shared_memory and self.returncode != 0:  # a rank that stopped before MPI_Finalize (MPICH's
                # assertion) may have left a segment made after the last look: one made since the job began
                # that no process maps any more
                self.segments |= procs.orphaned_shared_memory(min_age=0.0, since=self.began - 1)
            if self.shared_memory:
                for path in procs.remove_shared_memory(self.segments):
                    log.info("removed %s, left by a side job that did not end by itself", path)
            if self.limits is not None:
                self.limits.stop()
        return self.returncode

    def _kill(self, grace: float) -> set[str]:
        records = [self.record] if self.record else []
        if self.sweep:
            records += _carrying(MARKER, self.marker)
        if not records and self.proc.poll() is not None:
            return set()
        return procs.end(records, groups=records[:1], grace=grace)

    def __enter__(self) -> "SideJob":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.end(now=exc_type is not None)


def _tail(f: IO[bytes], tail_bytes: int | None) -> str:
    f.seek(0, os.SEEK_END)
    size = f.tell()
    f.seek(0 if tail_bytes is None else max(0, size - tail_bytes))
    return f.read().decode("utf-8", "replace")


def _carrying(name: str, value: str) -> list[procs.Proc]:
    """Recorded processes (not this one) whose environment has name=value."""
    import psutil

    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.environ().get(name) == value:
                rec = procs.record(p.pid)
                if rec is not None:
                    found.append(rec)
        except psutil.Error:
            continue
    return found


# Variables of the MPI job this process may be part of (a rank, a Slurm step): a side job started
# from here must not inherit them, or its mpiexec or srun would take itself for part of that job.
JOB_VARS = ("PMI_", "HYDRA_", "HYDI_", "PMIX_", "OMPI_", "MPIR_CVAR_", "SLURM_STEP", "I_MPI_")


def job_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a fresh MPI side job: without the variables of an MPI job
    it may be part of, this Python's bin first on PATH (its mpiexec), one thread per rank."""
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(JOB_VARS)}
    env["PATH"] = f"{os.path.dirname(sys.executable)}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update(extra or {})
    return env


def run(cmd: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike | None = None, shared_memory: bool = True, errors_apart: bool = False,
        tidy_at_limit: bool = False) -> Finished:
    """Run a short command to its end or its time limit; never leaves a process behind.

    The doctor's probes, a tuning sweep's MPI job, preflight's local job: like subprocess.run
    with a timeout, except that at the limit it ends the whole tree and process group (not only
    the first process), and an MPI job's /dev/shm files go with it. tidy_at_limit: at the limit,
    SIGTERM first and GRACE s, for a command that tidies up when told (an srun, whose step would
    outlive a SIGKILL; the emulated nodes' wrapper, whose network namespaces would), and so on an
    interrupt (KeyboardInterrupt: the notebook's stop button)."""
    with SideJob(cmd, env=env, cwd=cwd, timeout=timeout, shared_memory=shared_memory,
                 errors_apart=errors_apart) as job:
        try:
            timed_out = job.wait() is None
        except BaseException:
            job.end(now=not tidy_at_limit)
            raise
        job.end(now=timed_out and not tidy_at_limit)
        return Finished(None if timed_out else job.returncode, job.output_text(), job.error_text(), timed_out,
                        job.elapsed())


def run_job(cmd: Sequence[str], *, timeout: float) -> Finished:
    """A lesson's job of its own (a benchmark script, an MPI job from hpdl.job_command), run to its end.

    What subprocess.run(cmd, capture_output=True, text=True, timeout=...) does, except at the time
    limit: subprocess.run kills the first process only (mpiexec, srun, the emulated nodes' wrapper)
    and raises TimeoutExpired, which can leave the ranks running, still holding the cores. Here the
    whole job goes, ranks and /dev/shm files included, on an interrupt too, and the learner reads
    what happened and what to do (HpdlError), not a traceback. stdout and stderr come apart."""
    import shlex

    from hpdl.errors import HpdlError

    done = run(cmd, timeout, errors_apart=True, tidy_at_limit=True)
    if done.timed_out:
        last = (done.output + done.errors).strip()[-800:]
        raise HpdlError(f"The job did not finish within {timeout:g} s, so it was ended with every process it "
                        f"started: {shlex.join(map(str, cmd))[:300]}\nOn a busy machine jobs run slower: run "
                        "the cell again when it is quieter, or give the job a longer timeout."
                        + (f"\nIts last output:\n{last}" if last else ""))
    return done


def live() -> set["SideJob"]:
    """The side jobs started here and not yet ended."""
    return set(_live)


@atexit.register
def end_all() -> None:
    """At exit (or when the caller gives up): end every side job still running, at once."""
    for job in list(_live):
        try:
            job.end(now=True)
        except Exception as exc:  # at exit: end the others all the same
            log.debug("ending side job %s: %s", job.pid, exc)


__all__ = ["SideJob", "Finished", "run", "run_job", "job_env", "live", "end_all", "GRACE", "MARKER"]
