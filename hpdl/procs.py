"""The one module that signals processes and removes MPI shared memory.

Why one place: ending a cluster, a check job or a graded notebook all come down to the same
three questions — is this process still the one we started, how do we end it and everything
under it, and which MPI shared-memory files did it leave in RAM — and each answer has a trap:

- A PID is only a number. Once a process is gone the kernel hands its PID to a new process,
  and a state file can outlive a reboot or be read on another node of a cluster sharing $HOME.
  So a process is recorded as a `Proc`: pid, start time (clock ticks since boot, from
  /proc/<pid>/stat), host name and boot id. Nothing here signals a record whose host, boot id
  or start time no longer match the running process (`is_same`).
- MPI launchers have children (proxies, ranks) and may be a process group leader: `end` sends
  SIGTERM to the trees and groups, waits `grace` seconds, then SIGKILLs what is left.
- MPICH ranks share memory through files in /dev/shm (mpich_shm_*). MPI_Finalize removes them,
  which a killed rank never reaches, and once every rank is gone nothing maps them any more:
  read them with `shared_memory_of` *before* the kill, then `remove_shared_memory` after.
  What was killed by someone else (a kernel restart) is found later by `orphaned_shared_memory`.

Used on the client side (cluster stop, `hpdl cleanup`, the reaper, the doctor, check jobs and the
grader), and by a check job's fork server (`pass_on`); it imports only the standard library and psutil.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Iterable

log = logging.getLogger(__name__)
_LIBC = ctypes.CDLL(None, use_errno=True)  # made before any fork: die_with runs in a child before exec

SHM_DIR = "/dev/shm"
# MPI's files there: MPICH's, and Open MPI's shared-memory transport (sm; vader before Open MPI 5)
SEGMENT_PREFIXES = ("mpich_shm_", "sm_segment.", "vader_segment.")


# -- who a process is ---------------------------------------------------------------------------

@contextlib.contextmanager
def sigterm_exits():
    """While inside, SIGTERM (e.g. from `timeout` or a batch system) exits with 143 instead of
    killing at once, so the caller's `finally` still cancels the jobs it submitted."""
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


def boot_id() -> str:
    """This boot of this machine (changes at every reboot); '' where Linux does not say."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def start_time(pid: int) -> int | None:
    """When `pid` started, in clock ticks since boot (exact, unlike a float); None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[19])  # field 22 of stat(5); fields[0] here is field 3 (state)
    except (OSError, IndexError, ValueError):
        pass
    try:  # not Linux: psutil's float creation time is the best we have
        import psutil

        return int(psutil.Process(pid).create_time() * 100)
    except Exception:  # psutil.Error, ImportError: gone or unknowable
        return None


@dataclass(frozen=True)
class Proc:
    """A process as recorded when we started it: enough to recognise it later, and only it."""

    pid: int
    start: int | None
    host: str
    boot: str

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Proc":
        return cls(int(d["pid"]), d.get("start"), str(d.get("host", "")), str(d.get("boot", "")))


def record(pid: int) -> Proc | None:
    """Record a running process; None when it is already gone."""
    start = start_time(pid)
    if start is None:
        return None
    return Proc(pid, start, socket.gethostname(), boot_id())


def is_same(proc: Proc) -> bool:
    """True when `proc` was recorded on this host, in this boot, and its pid still runs the
    process that was recorded (same start time). Only such records may be signalled."""
    return (
        proc.host == socket.gethostname()
        and proc.boot == boot_id()
        and proc.start is not None
        and start_time(proc.pid) == proc.start
    )


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return False


def is_alive(proc: Proc) -> bool:
    """The recorded process still runs (a zombie, a reused pid or another host/boot: no)."""
    return is_same(proc) and not _zombie(proc.pid)


def pid_alive(pid: int) -> bool:
    """Whether some process with this pid runs (not a zombie). Prefer `is_alive(record)`:
    a bare pid may have been reused by an unrelated process."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return not _zombie(pid)


# -- ending processes ---------------------------------------------------------------------------

def _tree(procs: Iterable[Proc]) -> dict:
    """psutil handles for the recorded processes that are still themselves, and their descendants."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for rec in procs:
        if not is_same(rec):
            if start_time(rec.pid) is not None:
                log.info("not signalling pid %s: it is not the process recorded (%s)", rec.pid, rec)
            continue
        try:
            p = psutil.Process(rec.pid)
            found[p.pid] = p
            for c in p.children(recursive=True):
                found[c.pid] = c
        except psutil.Error as exc:
            log.debug("pid %s went while listing its tree: %s", rec.pid, exc)
    return found


def _signal_group(leader: Proc, sig: int) -> bool:
    """Signal the process group led by `leader`; True when sent. The leader may be gone while its
    group lives on (Linux never reuses a pid still naming a group), but if the pid now runs a
    different process, or the record is from another host or boot, the group is not ours."""
    if leader.host != socket.gethostname() or leader.boot != boot_id():
        return False
    now = start_time(leader.pid)
    if now is not None and now != leader.start:
        log.info("not signalling group %s: its pid now belongs to another process", leader.pid)
        return False
    try:
        os.killpg(leader.pid, sig)
        return True
    except ProcessLookupError:
        return False
    except OSError as exc:
        log.debug("killpg(%s, %s): %s", leader.pid, sig, exc)
        return False


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def _send(p, sig: int) -> None:
    import psutil

    try:
        p.send_signal(sig)
    except psutil.NoSuchProcess:
        pass
    except psutil.Error as exc:
        log.debug("signal %s to pid %s: %s", sig, p.pid, exc)


def end(procs: Iterable[Proc] = (), groups: Iterable[Proc] = (), grace: float = 2.0,
        before_kill=None) -> set[str]:
    """End recorded processes with all their descendants, and recorded process groups:
    SIGTERM, up to `grace` seconds to exit, then SIGKILL (grace 0: SIGKILL at once). Records
    that are not the same process any more (`is_same`) are left alone. `before_kill`, if given, is called between the
    SIGTERM and the wait (e.g. to cancel Slurm jobs). Returns the /dev/shm files the tree
    mapped (read before the kill) so the caller can `remove_shared_memory` them."""

    procs, groups = list(procs), list(groups)
    tree = _tree(procs)
    shm = shared_memory_of(tree)
    if grace > 0:  # else at once: SIGKILL only (a SIGTERM handler would still get to run)
        termed = {g.pid for g in groups if _signal_group(g, signal.SIGTERM)}
    if before_kill is not None:
        before_kill()
    if grace > 0:
        for p in tree.values():
            if _group_of(p.pid) not in termed:  # one SIGTERM each: a second may land while it exits
                _send(p, signal.SIGTERM)
    left = _wait_gone(list(tree.values()), grace)
    for p in left:
        _send(p, signal.SIGKILL)
    for g in groups:
        _signal_group(g, signal.SIGKILL)
    _wait_gone(left, max(grace, 1.0))
    return shm


def _wait_gone(ps: list, timeout: float) -> list:
    """Wait up to `timeout` s for processes to end; returns those still running.

    A zombie counts as ended: it has run its last instruction and only waits for its parent to
    read its status (psutil.wait_procs would wait the whole timeout on one whose parent is
    another process we are ending, e.g. an ipyparallel engine under its nanny)."""
    import psutil

    deadline = time.monotonic() + timeout
    while True:
        left = []
        for p in ps:
            try:
                if p.status() != psutil.STATUS_ZOMBIE:
                    left.append(p)
            except psutil.NoSuchProcess:
                continue
            except psutil.Error:
                left.append(p)
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


def end_the_rest_of_namespace(outer: str) -> None:
    """SIGKILL to every process of this PID namespace but its first and this one (kill(-1): the kernel signals
    them all at once, so a process that forks meanwhile leaves no child behind), then reap this one's. Only
    where this namespace is not `outer` (the caller's, e.g. the grader's: /proc/self/ns/pid's link there):
    never in the host's, whatever the caller said. A sandboxed notebook's runner, before it writes its files."""
    if os.readlink("/proc/self/ns/pid") == outer:
        return
    try:
        os.kill(-1, signal.SIGKILL)
    except OSError:  # none left
        pass
    try:
        while os.waitpid(-1, 0)[0] > 0:
            pass
    except ChildProcessError:
        pass


def end_popen(proc: subprocess.Popen, grace: float = 3.0) -> int | None:
    """Wait up to `grace` seconds for a child we started to exit, then kill and reap it."""
    try:
        return proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def end_group_now(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of a child started with start_new_session=True (a command that
    timed out, with its children), while it is still our unreaped child (so the pid is ours)."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError as exc:
        log.debug("killpg(%s): %s", proc.pid, exc)


def die_with(parent: int, sig: int = signal.SIGKILL) -> None:
    """Be sent `sig` when the thread that started this process ends (Linux's PR_SET_PDEATHSIG; it
    holds across exec): called in a child between fork and exec, or by a process that would rather
    clean up first (SIGTERM). Why: a process killed with no chance to end its side jobs (SIGKILL, the
    OOM killer, a kernel restarted) left them running for good — an MPI job in its own session, a
    check's ranks waiting for a checker that was gone. `parent`: the starter's pid, read before the
    fork; if it is already gone, exit at once (nobody would send the signal)."""
    prctl = getattr(_LIBC, "prctl", None)
    if prctl is not None:
        prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(70)


def signal_engines(client, targets, sig: int | str = signal.SIGINT) -> None:
    """Ask ipyparallel to deliver `sig` to engines (each engine's nanny signals its own process)."""
    client.send_signal(sig, targets=targets, block=True)


def signal_process(proc: Proc, sig: int) -> bool:
    """Send one signal to one recorded process if it is still itself; True when sent."""
    if not is_same(proc):
        return False
    try:
        os.kill(proc.pid, sig)
        return True
    except OSError as exc:
        log.debug("signal %s to pid %s: %s", sig, proc.pid, exc)
        return False


def hold_still(proc: Proc, timeout: float = 1.0) -> bool:
    """Stop a recorded process (SIGSTOP: every thread of it, whatever it does) and wait until the kernel
    shows it stopped; True when it is. A check's trusted side holds a learner's rank still this way
    (hpdl.checker.hold) and lets it go with `let_go`."""
    if not signal_process(proc, signal.SIGSTOP):
        return False
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("T", "t"):
                    return True
        except (OSError, IndexError):
            return False
        time.sleep(0.002)
    let_go(proc)
    return False


def let_go(proc: Proc) -> bool:
    """Let a process `hold_still` stopped go on (SIGCONT); True when sent."""
    return signal_process(proc, signal.SIGCONT)


def pass_on(pid: int, sig: int) -> bool:
    """Send `sig` to a process known by pid alone, from the one that started it or stands in for
    it (hpdl.forkserver: a rank forked for a launcher's process, which passes its signals on);
    a process already gone is not an error. True when sent."""
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


# -- MPI shared memory --------------------------------------------------------------------------

def shared_memory_of(pids: Iterable[int]) -> set[str]:
    """The /dev/shm files these processes map (MPICH's shared-memory segments between ranks)."""
    found: set[str] = set()
    for pid in pids:
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    i = line.find(SHM_DIR + "/")
                    if i >= 0 and not line.rstrip().endswith("(deleted)"):
                        found.add(line[i:].strip())
        except OSError:
            continue
    return found


def singleton_shared_memory(pid: int) -> set[str]:
    """The segment MPICH makes for a process that started MPI by itself (a notebook's kernel
    that imported mpi4py.MPI): named after its pid, and left behind when that process is killed."""
    path = f"{SHM_DIR}/mpich_shm_{pid:x}_0"
    return {path} if os.path.exists(path) else set()


def exit_finalized(code: int) -> None:
    """End this process now, without the interpreter's shutdown: flush its streams, MPI_Finalize
    if it started MPI, then the C library's exit(). For rank.leave and a forked rank's exit
    (hpdl.forkserver). mpi4py would finalize only at the shutdown's very end, and MPI_Finalize is
    what removes the ranks' /dev/shm segments. Not os._exit: MPICH tells its launcher a rank is
    done from a C atexit handler, and Hydra kills the whole job as soon as one rank is gone
    without saying so, ranks still inside MPI_Finalize included, which then leave their
    segments in RAM (7 jobs in 12 of 4 ranks here, 9 segments left; none with exit())."""
    import ctypes

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    mpi = sys.modules.get("mpi4py.MPI")
    with contextlib.suppress(Exception):
        if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
            mpi.Finalize()
    ctypes.PyDLL(None).exit(code)  # holding the GIL: destructors that exit() runs may touch Python objects


def finalize_singleton_mpi() -> bool:
    """Finalize MPI now if this process started it alone (a notebook kernel that imported
    mpi4py; COMM_WORLD of one) and nothing else here still needs it. Returns whether it did.

    Why: mpi4py finalizes at the very end of the interpreter's shutdown, after every atexit
    handler and after other libraries have been torn down, and MPI_Finalize is what removes
    MPICH's /dev/shm segment of a process that started MPI by itself. A kernel that dies in
    between (libzmq aborts in its context teardown now and then: seen in CI) would leave the
    segment in RAM. Registered as a kernel's first exit step by `import hpdl`."""

    mpi = sys.modules.get("mpi4py.MPI")
    try:
        if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized() or mpi.COMM_WORLD.Get_size() != 1:
            return False
        hvd = sys.modules.get("horovod.torch")
        dist = sys.modules.get("torch.distributed")
        if (hvd is not None and hvd.is_initialized()) or (dist is not None and dist.is_initialized()):
            return False  # their own shutdown still talks to MPI or holds its group
        mpi.Finalize()
        return True
    except Exception as exc:  # at exit: never worse than mpi4py's own finalize later
        log.debug("MPI not finalized early: %s", exc)
        return False


def orphaned_shared_memory(min_age: float = 60.0, since: float | None = None) -> set[str]:
    """Our MPI segments in /dev/shm that no process maps any more and that are older than
    `min_age` seconds: what a kernel killed before MPI_Finalize left behind (a restart that
    waited too long sends SIGTERM, then SIGKILL), or a rank killed outside the kit.

    Why by mapping and not by name: a segment is named after the pid of a process that started
    MPI by itself, or after a hash for a job; neither says whether a rank still uses it, but a
    live user has it mapped. Only our own processes can map our files (MPIs make them 0600).
    Open MPI 5 leaves one behind even after a clean exit of a process that started MPI by itself.
    The age spares a segment in the microseconds between its creation and its first mapping.
    `since` (a time.time()): only segments made or changed since then (a side job's that crashed)."""
    try:
        names = [e for e in os.scandir(SHM_DIR) if e.name.startswith(SEGMENT_PREFIXES)]
    except OSError:
        return set()
    now, uid = time.time(), os.getuid()
    candidates = set()
    for e in names:
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid == uid and now - st.st_mtime >= min_age and (since is None or st.st_mtime >= since):
            candidates.add(e.path)
    if not candidates:
        return set()
    mine = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    return candidates - shared_memory_of(mine)


def remove_orphaned_shared_memory() -> list[str]:
    """Remove what `orphaned_shared_memory` finds (at every hpdl.start and in `hpdl cleanup`):
    RAM that a kernel restarted after it had started MPI would otherwise never give back."""
    return remove_shared_memory(orphaned_shared_memory())


def remove_shared_memory(paths: Iterable[str]) -> list[str]:
    """Remove these /dev/shm files if they are ours (same uid); returns those removed."""
    removed = []
    for path in sorted(set(paths)):
        if os.path.dirname(os.path.abspath(path)) != SHM_DIR:
            log.warning("not removing %s: not in %s", path, SHM_DIR)
            continue
        try:
            if os.stat(path).st_uid == os.getuid():
                os.unlink(path)
                removed.append(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.debug("removing %s: %s", path, exc)
    return removed


__all__ = [
    "Proc", "record", "is_same", "is_alive", "pid_alive", "boot_id", "start_time",
    "end", "end_popen", "end_group_now", "die_with", "signal_engines", "signal_process",
    "shared_memory_of", "singleton_shared_memory", "orphaned_shared_memory",
    "remove_orphaned_shared_memory", "remove_shared_memory", "exit_finalized",
]
