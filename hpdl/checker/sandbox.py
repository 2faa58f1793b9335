"""Where untrusted code runs: a bubblewrap sandbox, else rlimits and a process group.

The learner's check ranks, and under `hpdl grade` a whole submission, run as

    bwrap --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp --unshare-all --die-with-parent ...

(Debian's `bubblewrap`): the whole file system read-only except the folders named writable,
folders named hidden replaced by empty ones (the kit's solutions, other submissions, the
grader's reports), a private /tmp and /dev/shm, no network (a loopback of its own), its own
PID namespace, so everything it started ends with it, and no capabilities. Inside or not,
resource limits apply to every process: CPU seconds, address space, open processes, file
size (an output flood stops at the limit). Without bwrap `describe()` says so; the caller
then starts its own session (process group) and ends the group.
"""
from __future__ import annotations

import functools
import logging
import os
import resource
import shutil
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hpdl import settings

log = logging.getLogger(__name__)


def file_limit() -> int:
    """Bytes any one file a sandboxed process writes may reach (the captured output included):
    256 MiB, which stops a flood. Intel MPI sizes its shared-memory file between ranks (a sparse
    file in /dev/shm) past 2 GiB on 4 ranks, and the cap would kill its ranks (SIGXFSZ), so
    with Intel MPI's mpiexec the cap is 64 GiB."""
    try:
        from hpdl import launchers

        if launchers.mpiexec_implementation() == "Intel MPI":
            return 64 * 2**30
    except Exception as exc:  # no mpiexec at all: the job will say so itself
        log.debug("which MPI runs the job: %s", exc)
    return 256 * 2**20


@dataclass
class Limits:
    """Per-process limits inside a sandbox (rlimits: they hold with or without bwrap)."""

    cpu_seconds: int = 600
    memory_bytes: int = 8 * 2**30  # address space per process (torch reserves a lot of it)
    processes: int = 1024  # tasks (threads count) in its pids cgroup; beyond the user's own under RLIMIT_NPROC
    file_bytes: int = field(default_factory=file_limit)  # any one file written (see file_limit)

    def start(self) -> "Limits":
        """In the parent, before starting the child: a pids cgroup where one can be made (root,
        where RLIMIT_NPROC does not apply); the child joins it in apply()."""
        self._cgroup = PidsCgroup.make(self.processes)
        self._tasks_now = _tasks_of_this_user()
        return self

    def stop(self) -> None:
        group = getattr(self, "_cgroup", None)
        if group is not None:
            group.remove()

    def apply(self) -> None:
        """In the child, before exec: set the limits (lowering only; never raising a hard limit)."""
        group = getattr(self, "_cgroup", None)
        if group is not None:
            group.join()
        users = getattr(self, "_tasks_now", None) or _tasks_of_this_user()
        for what, value in ((resource.RLIMIT_CPU, self.cpu_seconds), (resource.RLIMIT_AS, self.memory_bytes),
                            (resource.RLIMIT_NPROC, users + self.processes),
                            (resource.RLIMIT_FSIZE, self.file_bytes)):
            soft, hard = resource.getrlimit(what)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            try:
                resource.setrlimit(what, (value, value if hard == resource.RLIM_INFINITY else hard))
            except (ValueError, OSError):
                continue


class PidsCgroup:
    """A cgroup capping the number of processes (cgroup v1 or v2 pids controller), when writable."""

    ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")

    def __init__(self, path: str):
        self.path = path

    @classmethod
    def make(cls, limit: int) -> "PidsCgroup | None":
        for root in cls.ROOTS:
            if not os.path.isfile(os.path.join(root, "cgroup.procs")) or not os.access(root, os.W_OK):
                continue
            path = os.path.join(root, f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
            try:
                os.mkdir(path)
                with open(os.path.join(path, "pids.max"), "w") as f:
                    f.write(str(limit))
                return cls(path)
            except OSError as exc:
                log.debug("no pids cgroup under %s: %s", root, exc)
                try:
                    os.rmdir(path)
                except OSError:
                    pass  # it was never made
        return None

    def join(self) -> None:
        with open(os.path.join(self.path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))

    def remove(self) -> bool:
        """Remove it; one still holding exiting processes is kept for `sweep_cgroups` to retry."""
        try:
            os.rmdir(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:  # processes still in it (exiting): retried by sweep_cgroups()
            log.debug("cgroup %s not removed yet: %s", self.path, exc)
            _unremoved.add(self.path)
            return False
        _unremoved.discard(self.path)
        return True


CGROUP_PREFIX = "hpdl-"  # then the pid of the process that made it: hpdl-<pid>-<random>
_unremoved: set[str] = set()  # our cgroups whose removal failed: retried by sweep_cgroups()


def sweep_cgroups() -> list[str]:
    """Remove the empty pids cgroups this process could not remove before, and those left by a
    grader that is gone (its pid in the name no longer runs; an older name without a pid once it
    is empty). Why: a cgroup still holding exiting processes cannot be removed at once, and
    nothing retried, so every graded submission left one. Returns the cgroups removed."""
    removed = []
    for path in sorted(_unremoved):
        if PidsCgroup(path).remove():
            removed.append(path)
    for root in PidsCgroup.ROOTS:
        try:
            names = [n for n in os.listdir(root) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(root, name)
            if path not in _unremoved and _maker_gone(root, name) and PidsCgroup(path).remove():
                removed.append(path)
    return removed


def _maker_gone(root: str, name: str) -> bool:
    """Whether the process named in a cgroup's name (hpdl-<pid>-...) is gone. A name without a pid
    (an older kit's) counts as gone once a minute old (an empty one made just now may be about to
    be joined); removing a cgroup only ever succeeds when it is empty anyway."""
    import time

    from hpdl import procs

    parts = name[len(CGROUP_PREFIX):].split("-", 1)
    if len(parts) < 2 or not parts[0].isdigit():
        try:
            return time.time() - os.stat(os.path.join(root, name)).st_mtime > 60
        except OSError:
            return False
    return int(parts[0]) != os.getpid() and not procs.pid_alive(int(parts[0]))


def _tasks_of_this_user() -> int:
    """Processes and threads this user runs now (RLIMIT_NPROC counts both, across the user)."""
    uid, n = os.getuid(), 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    n += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return n


def bwrap() -> str | None:
    """The bwrap binary when it works here (user namespaces allowed), else None.
    HPDL_NO_SANDBOX=1 turns the sandbox off (benchmarks compare both)."""
    exe = settings.BWRAP.raw() or shutil.which("bwrap")
    if not exe or settings.NO_SANDBOX.get():
        return None
    return exe if _works(exe) else None


@functools.lru_cache(maxsize=4)
def _works(exe: str) -> bool:
    from hpdl import sidejob

    try:
        return sidejob.run([exe, *_base_args(), "true"], 20, shared_memory=False).returncode == 0
    except OSError:
        return False


def _base_args() -> list[str]:
    return ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            *_kit_under_tmp(), "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL"]


def _kit_under_tmp() -> list[str]:
    """The kit and its Python bound back, read-only, when they live under /tmp (a clone or a venv
    made there): the private /tmp would otherwise hide the very interpreter the sandbox runs."""
    kit = Path(__file__).resolve().parents[2]
    places = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, sys.executable, kit)}
    tmp = os.path.realpath("/tmp")
    under = sorted(p for p in places if p.startswith(tmp + os.sep) and os.path.exists(p))
    keep = [p for p in under if not any(p.startswith(q + os.sep) for q in under if q != p)]
    return [arg for p in keep for arg in ("--ro-bind", p, p)]


def _devices() -> list[str]:
    import glob

    extra = [p for p in ("/dev/dri", "/dev/infiniband", "/dev/kfd") if os.path.exists(p)]
    return sorted(glob.glob("/dev/nvidia*") + extra)


def available() -> bool:
    return bwrap() is not None


def describe() -> str:
    if available():
        return ("sandboxed with bubblewrap: read-only file system, private /tmp and /dev/shm, no network, "
                "own PID namespace; rlimits on CPU, memory, processes and file size")
    return ("NOT sandboxed (bubblewrap is not installed or user namespaces are off: apt-get install bubblewrap): "
            "rlimits on CPU, memory, processes and file size, and a process group per submission only")


def wrap(cmd: list[str], *, writable: list[str] = (), hidden: list[str] = (), cwd: str | None = None,
         readonly: list[str] = ()) -> list[str]:
    """`cmd` inside a sandbox (unchanged when none is available). `readonly`: folders inside a
    writable one that the sandbox may read but not write (the grader's answers to its checks)."""
    exe = bwrap()
    if exe is None:
        return list(cmd)
    args = [exe, *_base_args()]
    for path in _devices():  # GPUs and fast interconnects stay usable inside (CUDA, NCCL, InfiniBand)
        args += ["--dev-bind", path, path]
    for path in hidden:
        if os.path.isdir(path):
            args += ["--tmpfs", os.path.realpath(path)]
    for path in writable:
        real = os.path.realpath(path)
        args += ["--bind", real, real]
    for path in readonly:  # after the writable binds: mounted over them
        real = os.path.realpath(path)
        args += ["--ro-bind", real, real]
    if cwd:
        args += ["--chdir", os.path.realpath(cwd)]
    return [*args, "--", *cmd]
