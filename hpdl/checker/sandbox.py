"""Where untrusted code runs: a bubblewrap sandbox, else rlimits and a process group.

The learner's check ranks, and under `hpdl grade` a whole submission, run as

    bwrap --ro-bind / / --dev /dev --proc /proc --tmpfs /tmp --unshare-all --die-with-parent ...

(Debian's `bubblewrap`): the whole file system read-only except the folders named writable,
folders named hidden replaced by empty ones (the kit's solutions, other submissions, the
grader's reports), a private /tmp and /dev/shm, no network (a loopback of its own) and no
host daemon's Unix socket (read-only mounts do not stop connect()), its own PID namespace,
so everything it started ends with it, and no capabilities. Inside or not,
resource limits apply to every process: CPU seconds, address space, open processes, file
size (an output flood stops at the limit). Without bwrap `describe()` says so; the caller
then starts its own session (process group) and ends the group.
"""
from __future__ import annotations

import errno
import functools
import logging
import os
import resource
import shutil
import stat
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from hpdl import safefiles, settings

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


def ram() -> int | None:
    """This machine's RAM in bytes, where the system says."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def default_memory() -> int:
    """Total memory one sandbox may hold by default: half the machine's RAM, at most 8 GiB."""
    total = ram()
    return 8 * 2**30 if total is None else max(2**30, min(8 * 2**30, total // 2))


@dataclass
class Limits:
    """Limits on untrusted code: per process (rlimits: they hold with or without bwrap) and one
    total cap on memory and tasks for everything it starts (a cgroup, where one can be made):
    a fork bomb or a memory bomb spread over many processes stops at the total, not at the host."""

    cpu_seconds: int = 600
    memory_bytes: int = 8 * 2**30  # address space per process (torch reserves a lot of it)
    open_files: int = 4096  # descriptors per process, hard limit too: a disk measure reads each (DiskWatch)
    processes: int = 1024  # tasks (threads count) in its cgroup; without one, beyond the user's own (RLIMIT_NPROC)
    file_bytes: int = field(default_factory=file_limit)  # any one file written (see file_limit)
    memory_total: int | None = field(default_factory=default_memory)  # all its processes together (cgroup)
    within: "Cgroup | None" = None  # a cgroup of several jobs, whose own caps hold for all of them together

    def start(self) -> "Limits":
        """In the parent, before starting the child: a cgroup capping tasks and memory where one
        can be made (root, or a delegated cgroup), inside `within` where given; the child joins it in
        apply()."""
        self._cgroup = Cgroup.make(self.processes, self.memory_total, within=self.within)
        self._tasks_now = _tasks_of_this_user()
        # tasks capped by the cgroup: no RLIMIT_NPROC, which counts the whole user's, every submission graded
        # beside this one too (a neighbour's 2012 idle threads, under its own cap, left an honest one none: 0/36)
        self._tasks_capped = self._cgroup is not None and self._cgroup.read_back()["tasks"] is not None
        return self

    def stop(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()

    @property
    def cgroup(self) -> "Cgroup | None":
        """The cgroup capping everything it starts (where one could be made)."""
        return getattr(self, "_cgroup", None)

    def pids(self) -> list[int]:
        """Its processes now, from its cgroup (empty where none could be made: ask the job instead)."""
        return self.cgroup.pids() if self.cgroup is not None else []

    def applied(self) -> dict[str, int | None]:
        """The total caps as the kernel holds them (read back from the cgroup; None: no cap)."""
        return self.cgroup.read_back() if self.cgroup is not None else dict(UNCAPPED)

    def apply(self) -> None:
        """In the child, before exec: set the limits (lowering only; never raising a hard limit)."""
        group = getattr(self, "_cgroup", None)
        if group is not None:
            group.join()
        # no core dumps: a crash would write one as large as the process (no other cap counts it), or
        # hand it to the host's collector (core_pattern |systemd-coredump), outside every cap here
        per_user = () if getattr(self, "_tasks_capped", False) else (
            (resource.RLIMIT_NPROC, (getattr(self, "_tasks_now", None) or _tasks_of_this_user()) + self.processes),)
        for what, value in ((resource.RLIMIT_CPU, self.cpu_seconds), (resource.RLIMIT_AS, self.memory_bytes), *per_user,
                            (resource.RLIMIT_FSIZE, self.file_bytes), (resource.RLIMIT_CORE, 0),
                            (resource.RLIMIT_NOFILE, self.open_files)):
            soft, hard = resource.getrlimit(what)
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)
            # the descriptors' hard limit too: a soft one alone, the code raises again (to 20,000 a process)
            top = value if hard == resource.RLIM_INFINITY or what == resource.RLIMIT_NOFILE else hard
            try:
                resource.setrlimit(what, (value, top))
            except (ValueError, OSError):
                continue


class Cgroup:
    """One cgroup per sandboxed job capping its tasks and memory: cgroup v2 (one folder with pids.max
    and memory.max) or v1 (a folder in the pids and in the memory hierarchy), made under the
    cgroup this process is in, when writable. `dirs` maps each controller to its folder."""

    def __init__(self, dirs: dict[str, str]):
        self.dirs = dirs

    @classmethod
    def make(cls, tasks: int | None, memory: int | None, within: "Cgroup | None" = None) -> "Cgroup | None":
        """A new cgroup inside `within` (its caps then hold for all its cgroups together: a check's jobs,
        each capped, and the check capped as one), or, where none is given or it cannot be, under this
        process's own: a job keeps its own caps when the check's cgroup cannot hold it."""
        name = f"{CGROUP_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}"
        want = {"pids": tasks, "memory": memory}
        dirs = (within.nested(name, want) if within is not None else {}) or _v2_dirs(name, want) or _v1_dirs(name, want)
        return cls(dirs) if dirs else None

    def share(self) -> int | None:
        """Its weight on the CPU, one for all its processes together (cpu.weight, v2; cpu.shares, v1), where
        the cpu controller is its; None: its processes each compete alone."""
        return self._number("cpu", ("cpu.weight", "cpu.shares"))

    def nested(self, name: str, want: dict[str, int | None]) -> dict[str, str]:
        """Folders of a cgroup `name` inside this one, for the controllers this one has: in cgroup v2 one
        folder (this one's controllers handed down to it first), in v1 one in each hierarchy."""
        if len(set(self.dirs.values())) == 1 and os.path.exists(os.path.join(self.path, "cgroup.controllers")):
            files = {f: str(want[c]) for c, f in (("pids", "pids.max"), ("memory", "memory.max"))
                     if c in self.dirs and want.get(c) is not None}
            try:
                with open(os.path.join(self.path, "cgroup.subtree_control"), "w") as f:
                    f.write(" ".join(f"+{c}" for c in self.dirs))  # the cpu controller too, where it has it
            except OSError as exc:
                log.debug("cgroup v2 at %s: %s", self.path, exc)
                return {}
            path = _make_dir(self.path, name, files)
            return {c: path for c in self.dirs} if path else {}
        dirs: dict[str, str] = {}
        for ctl, parent in self.dirs.items():
            value = want.get(ctl)
            files = {} if value is None else {"pids.max" if ctl == "pids" else "memory.limit_in_bytes": str(value)}
            path = _make_dir(parent, name, files)
            if path is None:
                for made in dirs.values():
                    _remove_dir(made)
                return {}
            dirs[ctl] = path
        return dirs

    @property
    def path(self) -> str:
        return next(iter(self.dirs.values()))

    def join(self) -> None:
        for path in dict.fromkeys(self.dirs.values()):
            with open(os.path.join(path, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

    def read_back(self) -> dict[str, int | None]:
        """What the kernel holds: {"memory": bytes, "tasks": n, "cpu": its one weight}, None where not capped."""
        tasks = self._number("pids", ("pids.max",))
        memory = self._number("memory", ("memory.max", "memory.limit_in_bytes"))  # v2, v1
        caps = {key: n if n is not None and n < 2**62 else None for key, n in (("memory", memory), ("tasks", tasks))}
        return {**caps, "cpu": self.share()}

    def pids(self) -> list[int]:
        """Its processes now (host pids), as the kernel lists them: cheaper than walking the process tree."""
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(line) for line in f if line.strip().isdigit()]
        except OSError:
            return []

    def memory(self) -> int | None:
        """The bytes its processes hold now, as the kernel counts them (None: no memory controller)."""
        return self._number("memory", ("memory.current", "memory.usage_in_bytes"))  # v2, v1

    def _number(self, ctl: str, names: tuple[str, ...]) -> int | None:
        """The first of these files of controller `ctl` that exists, as a number (None: none, or "max")."""
        for name in names:
            try:
                with open(os.path.join(self.dirs[ctl], name)) as f:
                    text = f.read().strip()
            except (KeyError, OSError):
                continue
            return int(text) if text.isdigit() else None
        return None

    def open_peak(self):
        """The most its processes hold at once from now on: a file, reset now, that `read_peak` reads (v1:
        memory.max_usage_in_bytes; v2: memory.peak, reset for this open file, Linux 6.12 on). None: cannot."""
        for name, reset in (("memory.peak", "reset\n"), ("memory.max_usage_in_bytes", "0")):
            try:
                f = open(os.path.join(self.dirs["memory"], name), "r+")
            except (KeyError, OSError):
                continue
            try:
                f.write(reset)
                f.flush()
                return f
            except OSError:
                f.close()
        return None

    @staticmethod
    def read_peak(f) -> int | None:
        try:
            f.seek(0)
            text = f.read().strip()
        except (OSError, ValueError):
            return None
        return int(text) if text.isdigit() else None

    def split(self, pids: dict[int, int]) -> dict[int, "Cgroup"]:
        """A memory cgroup of its own inside this one for each of these processes (key -> pid), each moved
        into it: what each holds from now on is counted apart (a job's ranks: one rank holding the whole
        model fits the room all of them have together), and this one's cap still holds for them all. In
        cgroup v1 only, whose cgroups hold processes at every level; in v2 every other process would have
        to leave this one first: {} there, as wherever a folder or a move is refused."""
        path = self.dirs.get("memory")
        if path is None or os.path.exists(os.path.join(path, "cgroup.controllers")):
            return {}
        made: dict[int, Cgroup] = {}
        for key, pid in pids.items():
            inner = _make_dir(path, f"{CGROUP_PREFIX}{os.getpid()}-{key}-{uuid.uuid4().hex[:6]}", {})
            try:
                if inner is None:
                    return {}  # those made are removed with this one
                made[key] = Cgroup({"memory": inner})
                with open(os.path.join(inner, "cgroup.procs"), "w") as f:
                    f.write(str(pid))
            except OSError as exc:
                log.debug("cgroup %s: %s", inner, exc)
                return {}
        return made

    def remove(self) -> bool:
        """Remove it; one still holding exiting processes is kept for `sweep_cgroups` to retry."""
        return all([_remove_dir(path) for path in dict.fromkeys(self.dirs.values())])


def _remove_dir(path: str) -> bool:
    """Remove a cgroup of ours, the cgroups of ours inside it first (a check's jobs' inside the check's)."""
    try:
        inner = [e.path for e in os.scandir(path) if e.is_dir() and e.name.startswith(CGROUP_PREFIX)]
    except OSError:
        inner = []
    for sub in inner:
        _remove_dir(sub)
    try:
        os.rmdir(path)
    except FileNotFoundError:
        pass
    except OSError as exc:  # processes still in it (exiting): retried by sweep_cgroups()
        log.debug("cgroup %s not removed yet: %s", path, exc)
        _unremoved.add(path)
        return False
    _unremoved.discard(path)
    return True


PidsCgroup = Cgroup  # the name it had when it capped tasks only
CGROUP_PREFIX = "hpdl-"  # then the pid of the process that made it: hpdl-<pid>-<random>
# the controller that gives each cgroup of ours one weight on the CPU, however many processes it holds in however
# many sessions: a neighbour's hundred busy children, each in a session of its own (which defeats the kernel's
# autogroup), slowed an honest notebook about tenfold; in a cgroup of their own they count as one
SHARE = "cpu"
UNCAPPED = {"memory": None, "tasks": None, "cpu": None}
_unremoved: set[str] = set()  # our cgroups whose removal failed: retried by sweep_cgroups()
_OLD_ROOTS = ("/sys/fs/cgroup/pids", "/sys/fs/cgroup")  # where an older kit made its pids cgroups


def sweep_cgroups() -> list[str]:
    """Remove the empty cgroups this process could not remove before, and those left by a grader
    that is gone (its pid in the name no longer runs; an older name without a pid once it is
    empty). Why: a cgroup still holding exiting processes cannot be removed at once, and nothing
    retried, so every graded submission left one. Returns the cgroups removed."""
    removed = [path for path in sorted(_unremoved, key=len, reverse=True) if _remove_dir(path)]  # inner first
    for parent in dict.fromkeys([*_cgroup_parents(), *_OLD_ROOTS]):
        try:
            names = [n for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            continue
        for name in names:
            path = os.path.join(parent, name)
            if path not in _unremoved and _maker_gone(parent, name) and _remove_dir(path):
                removed.append(path)
    return removed


def _cgroup_parents() -> list[str]:
    """The folders `Cgroup.make` makes its cgroups in: this process's own cgroup in each hierarchy."""
    own, out = _own_cgroups(), []
    for point, kind, opts in _mounts():
        ctl = "" if kind == "cgroup2" else next((c for c in ("pids", "memory", SHARE) if c in opts), None)
        if ctl is not None and ctl in own:
            out.append(os.path.join(point, own[ctl].lstrip("/")))
    return out


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


def _mounts() -> list[tuple[str, str, set[str]]]:
    """(mount point, type, options) of the cgroup file systems."""
    out = []
    try:
        for line in open("/proc/self/mounts"):
            _, point, kind, opts, *_ = line.split()
            if kind in ("cgroup", "cgroup2"):
                out.append((point, kind, set(opts.split(","))))
    except OSError:
        pass
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller (or "" for v2) -> this process's cgroup path in that hierarchy."""
    own = {}
    try:
        for line in open("/proc/self/cgroup"):
            _, ctls, path = line.rstrip("\n").split(":", 2)
            for c in ctls.split(",") if ctls else [""]:
                own[c] = path
    except OSError:
        pass
    return own


def _make_dir(parent: str, name: str, limits: dict[str, str]) -> str | None:
    """mkdir parent/name and write each limit file; None (and nothing left) when refused."""
    path = os.path.join(parent, name)
    try:
        os.mkdir(path)
    except OSError as exc:
        log.debug("no cgroup under %s: %s", parent, exc)
        return None
    try:
        for f, value in limits.items():
            with open(os.path.join(path, f), "w") as fh:
                fh.write(value)
        return path
    except OSError as exc:
        log.debug("cgroup %s refused a limit: %s", path, exc)
        try:
            os.rmdir(path)
        except OSError:
            pass  # it was just made, empty
        return None


def _v2_dirs(name: str, want: dict[str, int | None]) -> dict[str, str]:
    own = _own_cgroups().get("")
    for point, kind, _ in _mounts():
        if kind != "cgroup2" or own is None:
            continue
        parent = os.path.join(point, own.lstrip("/"))
        ctls = [c for c, v in want.items() if v is not None]
        try:
            have = open(os.path.join(parent, "cgroup.controllers")).read().split()
            if not set(ctls) <= set(have) or not os.access(parent, os.W_OK):
                continue
            with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
                f.write(" ".join(f"+{c}" for c in ctls))
        except OSError as exc:
            log.debug("cgroup v2 at %s: %s", parent, exc)
            continue
        ctls += _v2_share(parent, have)
        files = {"pids.max": str(want["pids"])}
        if want["memory"] is not None:
            files.update({"memory.max": str(want["memory"]), "memory.swap.max": "0"})
        path = _make_dir(parent, name, files) or _make_dir(parent, name, {k: v for k, v in files.items()
                                                                          if k != "memory.swap.max"})
        if path:
            return {c: path for c in ctls}
    return {}


def _v2_share(parent: str, have: list[str]) -> list[str]:
    """["cpu"] where the cpu controller could be handed down from `parent` (its cgroups then each get one
    weight on the CPU), else []: the caps on tasks and memory hold without it."""
    if SHARE not in have:
        return []
    try:
        with open(os.path.join(parent, "cgroup.subtree_control"), "w") as f:
            f.write(f"+{SHARE}")
    except OSError as exc:  # e.g. a real-time process in the cgroup
        log.debug("no cpu controller under %s: %s", parent, exc)
        return []
    return [SHARE]


def _v1_dirs(name: str, want: dict[str, int | None]) -> dict[str, str]:
    own, dirs = _own_cgroups(), {}
    for ctl, value in want.items():
        if value is None:
            continue
        files = {"pids.max": str(value)} if ctl == "pids" else {"memory.limit_in_bytes": str(value)}
        for point, kind, opts in _mounts():
            # the folder it is made in is this process's own cgroup: delegated to its user, where the mount
            # point above it is root's
            if kind == "cgroup" and ctl in opts and ctl in own:
                path = _make_dir(os.path.join(point, own[ctl].lstrip("/")), name, files)
                if path:
                    dirs[ctl] = path
                    break
    return {**dirs, **_v1_share(name, own)} if dirs else {}


def _v1_share(name: str, own: dict[str, str]) -> dict[str, str]:
    """A folder of the same name in the cpu hierarchy, where this process's cgroup there is writable: one
    weight on the CPU for all the job's processes together. {} where not (the caps hold without it)."""
    for point, kind, opts in _mounts():
        if kind == "cgroup" and SHARE in opts and SHARE in own:
            path = _make_dir(os.path.join(point, own[SHARE].lstrip("/")), name, {})
            return {SHARE: path} if path else {}
    return {}


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


TMP_BYTES = 512 * 2**20  # the private /tmp inside
SHM_BYTES = 2**30  # the private /dev/shm inside (MPI's shared memory between ranks)
HIDDEN_BYTES = 2**20  # each empty folder laid over a private place
DISK_BYTES = 2 * 2**30  # all files in the one writable folder of a submission or a check's job, together
DISK_ENTRIES = 20_000  # files and folders in it: past this, over the cap whatever their size
DISK_EVERY = 0.25  # s between two measures
# the disk a folder is on, shared by every submission at once and the host's users: when what is left of it falls
# below this (a share of the file system, at least FREE_FLOOR bytes), a folder holding HEAVY bytes or more is over
# its cap too. Each folder's cap alone left a submission free to fill a small TMPDIR, and an honest neighbour's
# runner failed on "No space left on device" (0/36)
FREE_SHARE, FREE_FLOOR, HEAVY = 0.02, 256 * 2**20, 64 * 2**20
# descriptors a disk measure looks at (DiskWatch): hundreds of processes each holding thousands (dup2 of
# /dev/null: no memory) made each measure take seconds, on the loop that serves every submission's checks
UNLINKED_FDS = 20_000


class DiskWatch:
    """What the files in a sandbox's writable folder hold on the host's disk, measured as it runs.

    Why: that folder is the host's (the grader reads what the submission leaves there), and no
    rlimit caps it: RLIMIT_FSIZE bounds one file, not how many. Whoever runs the job asks over()
    as it polls and ends the job on an answer; between two measures a writer gains at most what
    the disk takes in DISK_EVERY. Counted: every file under the folder (a folder closed to its
    owner is opened again: a chmod cannot hide files), and the files the processes of `job` (a
    sidejob.SideJob) hold open on the folder's file system after removing their names."""

    def __init__(self, folder: str | os.PathLike, job, limit: int = DISK_BYTES, entries: int = DISK_ENTRIES,
                 every: float = DISK_EVERY):
        self.folder, self.job, self.limit, self.entries, self.every = str(folder), job, limit, entries, every
        self._next = 0.0
        self.why: str | None = None
        self._held: dict[int, int] = {}  # pid -> bytes of unlinked files it held open when last looked at
        self._turn = 0  # where the next measure starts among the job's processes

    def pids(self) -> list[int]:
        """The job's processes: as its cgroup lists them where it has one, else its process tree."""
        return (self.job.limits.pids() if self.job.limits is not None else []) or self.job.pids()

    def over(self) -> str | None:
        """Why the folder is over its cap (then for good), or None; measured at most every `every` s."""
        if self.why is not None or time.monotonic() < self._next:
            return self.why
        self._next = time.monotonic() + self.every
        used = disk_usage(self.folder, self.entries)
        if used is None:
            self.why = f"it made more than {self.entries} files and folders in its folder"
        elif used == UNMEASURED:
            self.why = "it made files that cannot be measured (folders nested past the longest path the " \
                       "kernel takes, 4096 characters)"
        elif used + self._unlinked() > self.limit:
            self.why = f"its files took more than {size_text(self.limit)} of disk (the cap on its folder)"
        elif used >= HEAVY and (left := disk_left(self.folder)) is not None:
            self.why = (f"its files took {size_text(used)} while the disk they are on had {size_text(left)} left "
                        "(it is shared: other submissions and the host need it)")
        return self.why

    def _unlinked(self) -> int:
        """Bytes of the unlinked files the job's processes hold open: each measure looks at processes in turn
        until UNLINKED_FDS descriptors are seen, and counts the others as they were when last looked at."""
        pids = sorted(self.pids())
        alive = set(pids)
        self._held = {pid: held for pid, held in self._held.items() if pid in alive}
        budget, start = UNLINKED_FDS, self._turn
        for k in range(len(pids)):
            if budget <= 0:
                break
            pid = pids[(start + k) % len(pids)]
            self._held[pid], seen = _unlinked_open(self.folder, [pid])
            budget -= seen
            self._turn = (start + k + 1) % len(pids)
        return sum(self._held.values())



def disk_left(folder: str) -> int | None:
    """The bytes left on the file system `folder` is on, where that is under its floor (FREE_SHARE of it, at
    least FREE_FLOOR); None where more is left, or where it cannot be read."""
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    left = st.f_bavail * st.f_frsize
    return left if left < max(FREE_FLOOR, FREE_SHARE * st.f_blocks * st.f_frsize) else None


UNMEASURED = -1  # disk_usage: a folder or file under the folder that could not be read (a path too long, ...)


def disk_usage(folder: str, max_entries: int) -> int | None:
    """Bytes the files under `folder` take on disk (blocks allocated: a sparse file counts what it
    uses), no link followed; None when it holds more than `max_entries` entries. A folder its
    owner closed to itself is opened (u+rwx) and read: it is ours, and so is removing it later.
    UNMEASURED where something under it cannot be read but is there: folders nested past the longest
    path (4096 characters) once held 3 GB and 1.4 million files that no measure counted."""
    total, entries, todo = 0, 0, [folder]
    while todo:
        path = todo.pop()
        try:
            listing = _scandir_opened(path)
        except OSError as exc:
            if exc.errno in (errno.ENOENT, errno.ENOTDIR):  # gone: nothing of it counts
                continue
            return UNMEASURED
        with listing:
            for entry in listing:
                entries += 1
                if entries > max_entries:
                    return None
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                except OSError:
                    return UNMEASURED
                total += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    todo.append(entry.path)
    return total


def _scandir_opened(path: str):
    try:
        return os.scandir(path)
    except PermissionError:
        safefiles.open_to_owner(path)
        return os.scandir(path)


def _unlinked_open(folder: str, pids) -> tuple[int, int]:
    """Bytes of the files `pids` hold open on `folder`'s file system whose names are gone (no
    folder lists them, yet they take the disk until closed), and how many descriptors were looked at."""
    try:
        dev = os.stat(folder).st_dev
    except OSError:
        return 0, 0
    seen: set[int] = set()
    total = looked = 0
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours to read
            continue
        looked += len(fds)
        for fd in fds:
            try:
                st = os.stat(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if st.st_dev == dev and st.st_nlink == 0 and st.st_ino not in seen and stat.S_ISREG(st.st_mode):
                seen.add(st.st_ino)
                total += st.st_blocks * 512
    return total, looked


# other users' and the grader's own files: each replaced by an empty folder inside (the grader's
# HOME and TMPDIR too, wherever they are); the kit, its Python and MPI are bound back read-only
# /run and /var/spool too: they hold the daemons' Unix sockets (below)
PRIVATE = ("/home", "/root", "/tmp", "/var/tmp", "/run", "/var/run", "/var/mail", "/var/spool", "/mnt", "/media")
SYSTEM = frozenset({"/", "/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/opt", "/proc", "/sys",
                    "/dev", "/var", "/boot", "/srv"})
# A read-only mount does not stop connect() on a Unix socket, and its daemon sees the grader's uid:
# a container engine's socket (root), the system bus (power off a laptop), munge (credentials as
# the grader), a screen session's or slurmstepd's (the grader's own shells and jobs). /run and
# /var/spool are hidden whole; sockets elsewhere in these trees are each covered by /dev/null, and
# so is what only the grader may read there (as root: /etc/shadow, host keys, a hub's secrets).
COVER_TREES = ("/etc", "/boot", "/srv", "/var", "/opt")  # the small and telling first: /opt is often vast
COVER_SCAN_ENTRIES = 200_000  # a bound on the walks together (one file system per tree, no link followed)
# the other trees at the root (/scratch, /work, /project: often shared and large) are looked at to
# their first level only, at most this many entries each, and the grader's own name in each
COVER_TOP_ENTRIES = 10_000
COVER_SECONDS = 20.0  # the look's time limit (a slow or hung network file system): what it found by then is covered
# name lookups (who is uid N?), which any user may ask and a site with LDAP needs: kept
NAME_SERVICE = ("/var/lib/sss/pipes/nss", "/run/nscd/socket", "/run/nslcd/socket")
# what srun needs from /run, for the one kind of job that must go through the batch system
BATCH_SYSTEM = ("/run/munge", "/run/slurm")
MISSING_BWRAP = "bubblewrap (apt-get install bubblewrap, or dnf install bubblewrap; or HPDL_BWRAP=/path/to/bwrap)"


def bwrap() -> str | None:
    """The bwrap binary when it works here (user namespaces allowed), else None.
    HPDL_NO_SANDBOX=1 turns the sandbox off (benchmarks compare both)."""
    exe = settings.BWRAP.raw() or shutil.which("bwrap")
    if not exe or settings.NO_SANDBOX.get():
        return None
    return exe if _works(exe) else None


@functools.lru_cache(maxsize=4)
def features(exe: str) -> frozenset[str]:
    """The options this bwrap knows among those the sandbox uses when it can (older ones lack some)."""
    from hpdl import sidejob

    try:
        text = sidejob.run([exe, "--help"], 20, shared_memory=False).output
    except OSError:
        return frozenset()
    return frozenset(opt for opt in ("--disable-userns", "--size", "--perms") if opt in text)


@functools.lru_cache(maxsize=4)
def _works(exe: str) -> bool:
    from hpdl import sidejob

    try:
        return sidejob.run([exe, *_base_args(exe), "true"], 20, shared_memory=False).returncode == 0
    except OSError:
        return False


def _sized(exe: str, size: int, path: str) -> list[str]:
    return [*(["--size", str(size)] if "--size" in features(exe) else []), "--tmpfs", path]


def _base_args(exe: str, isolating: bool = False) -> list[str]:
    args = ["--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    places = private_places()
    for path in places:
        args += _sized(exe, TMP_BYTES if path == os.path.realpath("/tmp") else HIDDEN_BYTES, path)
    covered = host_covered()  # as found: each still there and of its kind, or bwrap could not start
    args += [*_sized(exe, SHM_BYTES, "/dev/shm")]
    files = [p for p in covered.files if os.path.lexists(p) and not os.path.isdir(p)]
    args += [a for p in files for a in ("--ro-bind", "/dev/null", p)]
    for path in filter(os.path.isdir, covered.folders):
        args += _sized(exe, HIDDEN_BYTES, path)
    args += [*_kit_back([*places, *covered.folders]), *_bound_back(NAME_SERVICE, places)]
    userns = ["--disable-userns"] if "--disable-userns" in features(exe) and not isolating else []
    # as root, a user namespace may map root only if its maker held CAP_SETFCAP (a rank's, isolate.py)
    caps = ["--cap-add", "CAP_SETFCAP"] if isolating and os.geteuid() == 0 else []
    args += ["--unshare-all", "--unshare-user", *userns, "--die-with-parent", "--new-session", "--cap-drop", "ALL",
             *caps]
    return args


def private_places() -> list[str]:
    """Folders every sandbox sees empty: homes, /root, temporary folders, the grader's HOME and
    TMPDIR wherever they point (a cluster's TMPDIR is often a shared scratch folder)."""
    import tempfile

    real: list[str] = []
    for p in (*PRIVATE, os.environ.get("HOME", ""), tempfile.gettempdir()):
        if p and os.path.isdir(p):
            r = os.path.realpath(p)
            if r not in SYSTEM and r not in real:  # HOME=/ or TMPDIR=/var: not the whole tree
                real.append(r)
    return sorted(p for p in real if not any(p.startswith(q + os.sep) for q in real if q != p))


@dataclass(frozen=True)
class Covered:
    """What of the host's a sandbox must not reach though the read-only file system shows it."""
    files: tuple[str, ...] = ()  # daemons' Unix sockets and files only the grader may read: /dev/null over each
    folders: tuple[str, ...] = ()  # folders only the grader may enter: an empty one over each
    complete: bool = True  # False: the look ran out of time (COVER_SECONDS)


_covering = False


def cover_the_host(on: bool = True) -> None:
    """From now on (until called with False), every sandbox this process makes covers the host's
    sockets and what only this user may read (host_covered). The batch grader calls it: there the
    code is a learner's and the user the instructor. A learner's own check runs their own code as
    them, and skips the look."""
    global _covering
    _covering = on
    host_covered.cache_clear()


def _to_cover(path: str, st: os.stat_result, uid: int, gids: set[int]) -> str | None:
    """"files" or "folders" when `path` is to be covered: a Unix socket (not a name service's), a
    file or folder that grants this user or its groups what it grants nobody else."""
    only_ours = st.st_uid == uid or st.st_gid in gids
    if stat.S_ISDIR(st.st_mode):
        return "folders" if only_ours and not st.st_mode & stat.S_IXOTH else None
    if (stat.S_ISSOCK(st.st_mode) and path not in NAME_SERVICE
            or stat.S_ISREG(st.st_mode) and only_ours and not st.st_mode & stat.S_IROTH):
        return "files"
    return None


def _listing(folder: str, limit: int) -> list[tuple[str, os.stat_result]]:
    """Up to `limit` entries of `folder` with their own status (no link followed, none mounted)."""
    out: list[tuple[str, os.stat_result]] = []
    try:
        with os.scandir(folder) as it:
            for entry in it:
                if len(out) >= limit:
                    break
                try:
                    if not entry.is_symlink():
                        out.append((entry.path, entry.stat(follow_symlinks=False)))
                except OSError:
                    continue
    except OSError:
        pass
    return out


@functools.lru_cache(maxsize=1)
def host_covered() -> Covered:
    """What to cover, found once per process (only once cover_the_host() was called): in
    COVER_TREES, whole, and in the root's other trees, to their first level, Unix sockets (a name
    service's kept) and files or folders that grant the grader what they grant nobody else. A
    submission then reads only what any user here could. No walk follows a link; a system tree's
    stays on its file system; the look stops after COVER_SECONDS with what it found."""
    if not _covering:
        return Covered()
    import threading

    hidden, found = private_places(), {"files": [], "folders": []}
    look = threading.Thread(target=_look, args=(hidden, found), name="hpdl-host-cover", daemon=True)
    look.start()
    look.join(COVER_SECONDS)

    def shown(paths: list[str]) -> tuple[str, ...]:
        return tuple(sorted({p for p in list(paths) if not any(p.startswith(q + os.sep) for q in hidden)}))

    return Covered(shown(found["files"]), shown(found["folders"]), complete=not look.is_alive())


def _look(hidden: list[str], found: dict[str, list[str]]) -> None:
    uid, gids, budget = os.geteuid(), {os.getegid(), *os.getgroups()}, COVER_SCAN_ENTRIES
    for top in COVER_TREES:
        device = os.lstat(top).st_dev if os.path.isdir(top) and not os.path.islink(top) else None
        stack = [top] if device is not None else []
        while stack and budget > 0:
            entries = _listing(stack.pop(), budget)
            budget -= len(entries)
            for path, st in entries:
                if path in hidden:
                    continue
                kind = _to_cover(path, st, uid, gids)
                if kind:
                    found[kind].append(path)
                elif stat.S_ISDIR(st.st_mode) and st.st_dev == device:
                    stack.append(path)
    own = _user_name()
    for top, st in _listing("/", 1000):  # the root's other trees: each itself, else its first level
        if top in SYSTEM or top in hidden:
            continue
        kind = _to_cover(top, st, uid, gids)
        if kind:
            found[kind].append(top)
        if kind or not stat.S_ISDIR(st.st_mode):
            continue
        firsts = _listing(top, COVER_TOP_ENTRIES)
        mine = os.path.join(top, own) if own else None  # /scratch/<name>, should it lie past the first entries
        try:
            if mine:
                firsts.append((mine, os.lstat(mine)))
        except OSError:
            pass
        for path, sub in firsts:
            if path not in hidden and (k := _to_cover(path, sub, uid, gids)):
                found[k].append(path)


def _user_name() -> str | None:
    import pwd

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return None


def _kit_back(places: list[str]) -> list[str]:
    """The kit, its Python and its MPI bound back, read-only, when they live in a private place (a
    clone in a home folder or under /tmp, a venv there): hiding it would hide the very interpreter
    the sandbox runs."""
    kit = Path(__file__).resolve().parents[2]
    mpiexec = shutil.which("mpiexec")
    wanted = [sys.prefix, sys.base_prefix, Path(os.path.realpath(sys.executable)).parents[1], kit]
    if mpiexec:
        wanted.append(Path(os.path.realpath(mpiexec)).parents[1])
    return _bound_back([os.path.realpath(p) for p in wanted], places)


def _bound_back(paths, places: list[str]) -> list[str]:
    """bwrap's arguments that bind back, read-only, those of `paths` that exist and lie in (or are)
    one of the hidden or covered `places`; a path inside another one bound back goes with it."""
    under = sorted({p for p in paths if any(p == q or p.startswith(q + os.sep) for q in places) and os.path.exists(p)})
    keep = [p for p in under if not any(p.startswith(q + os.sep) for q in under if q != p)]
    return [arg for p in keep for arg in ("--ro-bind", p, p)]


def _devices() -> list[str]:
    """GPUs stay usable inside (CUDA, ROCm); RDMA devices (/dev/infiniband) never: no network."""
    import glob

    extra = [p for p in ("/dev/dri", "/dev/kfd") if os.path.exists(p)]
    return sorted(glob.glob("/dev/nvidia*") + extra)


@functools.lru_cache(maxsize=1)
def confinement_works() -> bool:
    """Whether the shim (confine.py: whitelisted environment, seccomp filter) runs here."""
    from hpdl import sidejob
    from hpdl.checker import confine

    if not confine.supported():
        return False
    try:
        return sidejob.run([*_confine_prefix(), "true"], 30, shared_memory=False).returncode == 0
    except OSError:
        return False


def _confine_prefix(keep_env: tuple[str, ...] = (), isolating: bool = False) -> list[str]:
    from hpdl.checker import confine

    # -c with sys.path[0] (the working folder, which untrusted code may write) removed first
    keep = [f"{confine.KEEP}{','.join(keep_env)}"] if keep_env else []  # names only: `ps` shows them
    keep += [confine.ISOLATING] if isolating else []
    return [sys.executable, "-c", "import sys, runpy; sys.flags.safe_path or sys.path.pop(0); "
            "sys.argv = sys.argv[1:]; runpy.run_module('hpdl.checker.confine', run_name='__main__')", "-", *keep]


@functools.lru_cache(maxsize=1)
def isolation_works() -> bool:
    """Whether a check's learner ranks can each make a view of their own here (isolate.py): tried once,
    in a sandbox made as a check job's is. Where not (a bubblewrap that is setuid, user namespaces refused
    inside one), the ranks of a check share the job's folder and /tmp, and the report says so."""
    import tempfile

    from hpdl import sidejob

    if bwrap() is None or not confinement_works():  # the filter a rank installs once isolated is what refuses
        return False                                 # it namespaces (bwrap's --disable-userns cannot be used)
    code = ("import os, sys; sys.flags.safe_path or sys.path.pop(0); "  # not the working folder's modules
            "from hpdl.checker import isolate; isolate.isolate(sys.argv[1], 0); "
            "sys.exit(0 if sorted(os.listdir(sys.argv[1])) == ['r0', 'spec.pkl'] and os.getpid() == 1 else 1)")
    with tempfile.TemporaryDirectory(prefix="hpdl-isolate-") as job:
        os.mkdir(os.path.join(job, "r0"))
        open(os.path.join(job, "spec.pkl"), "wb").close()
        cmd = wrap([sys.executable, "-c", code, job], writable=[job], isolating=True)
        try:
            return sidejob.run(cmd, 30, shared_memory=False).returncode == 0
        except OSError:
            return False


def ranks_apart() -> bool:
    """Whether a check's learner ranks here each get a view of their own: isolation works, and this node's
    MPI can run ranks that share no memory (meter.tcp_transport: MPICH with libfabric, Open MPI, Intel MPI)."""
    from hpdl.checker import meter

    return isolation_works() and meter.tcp_transport() is not None


@functools.lru_cache(maxsize=1)
def cgroup_works() -> bool:
    """Whether a cgroup capping both tasks and memory can be made here (made, read back, removed)."""
    group = Cgroup.make(64, 2**30)
    if group is None:
        return False
    try:
        caps = group.read_back()
        return caps["tasks"] == 64 and caps["memory"] == 2**30
    finally:
        group.remove()


def available() -> bool:
    return bwrap() is not None


def missing() -> list[str]:
    """What a sandbox that holds needs and this host lacks, each with what to install or do."""
    out = []
    exe = bwrap()
    if exe is None:
        out.append(MISSING_BWRAP + ("; HPDL_NO_SANDBOX is set" if settings.NO_SANDBOX.get() else ""))
    elif "--disable-userns" not in features(exe):
        out.append("a bubblewrap that knows --disable-userns (0.8 or later; HPDL_BWRAP=/path/to/bwrap)")
    if not confinement_works():
        out.append("a seccomp filter (Linux on x86_64 or aarch64, with seccomp in its kernel)")
    if not cgroup_works():
        out.append("a writable cgroup for one total cap on memory and tasks (run as a user whose cgroup is "
                   "delegated, or as root in a container, with the pids and memory controllers)")
    return out


def status(limits: "Limits | None" = None) -> dict:
    """The sandbox as applied, for the report: each part and each limit's value (caps read back
    from the kernel through `limits`, when given)."""
    exe = bwrap()
    feats = features(exe) if exe else frozenset()
    caps = limits.applied() if limits is not None else dict(UNCAPPED)
    per = limits or Limits()
    covered = host_covered() if exe else Covered()
    return {
        "bubblewrap": exe, "bubblewrap_version": _version(exe) if exe else None,
        "nested_user_namespaces": "refused (--disable-userns)" if "--disable-userns" in feats
        else ("refused by the seccomp filter only" if confinement_works() else "allowed"),
        "seccomp": f"{len(_denied())} system calls refused" if confinement_works() else None,
        "environment": "whitelist (hpdl.checker.confine.environment)" if confinement_works() else "inherited",
        "tmp_bytes": (TMP_BYTES if "--size" in feats else None) if exe else None,
        "shm_bytes": (SHM_BYTES if "--size" in feats else None) if exe else None,
        "hidden": private_places() if exe else [], "network": "none (loopback only)" if exe else "host",
        "host_covered": len(covered.files) + len(covered.folders) if exe and _covering else None,
        "host_look_complete": covered.complete,
        "check_ranks": "each in a view of its own" if ranks_apart() else "sharing the job's files",
        "memory_total_bytes": caps["memory"], "tasks_total": caps["tasks"], "cpu_weight": caps.get("cpu"),
        "memory_per_process_bytes": per.memory_bytes, "cpu_seconds_per_process": per.cpu_seconds,
        "file_bytes": per.file_bytes, "disk_bytes": DISK_BYTES, "disk_entries": DISK_ENTRIES, "missing": missing(),
    }


def _denied() -> tuple[str, ...]:
    from hpdl.checker import confine

    return confine.DENIED


def _version(exe: str) -> str | None:
    from hpdl import sidejob

    try:
        return sidejob.run([exe, "--version"], 20, shared_memory=False).output.strip().split()[-1]
    except (OSError, IndexError):
        return None


def describe(st: dict | None = None) -> str:
    """One paragraph for the report's header: which sandbox ran and each limit's value."""
    st = st or status()
    if st["bubblewrap"] is None:
        head = (f"NOT sandboxed (missing: {'; '.join(st['missing'])}): the submission runs as this user, "
                "sees the file system and the network")
    else:
        head = (f"sandboxed with bubblewrap {st['bubblewrap_version']}: file system read-only, "
                f"{', '.join(st['hidden'])} hidden, no network, {_covered_text(st)}, own PID namespace, "
                "nested user namespaces "
                f"{st['nested_user_namespaces']}, /tmp {size_text(st['tmp_bytes'])}, "
                f"/dev/shm {size_text(st['shm_bytes'])}")
    parts = [head, f"seccomp: {st['seccomp'] or 'none'}", f"environment: {st['environment']}",
             f"a check's ranks: {st.get('check_ranks', 'sharing the job files')} (files, /tmp, /dev/shm, processes)",
             f"total memory {size_text(st['memory_total_bytes'])}, total tasks {st['tasks_total'] or 'uncapped'} "
             "(cgroup, read back)", _cpu_text(st.get("cpu_weight")),
             f"per process: address space {size_text(st['memory_per_process_bytes'])}, "
             f"CPU {st['cpu_seconds_per_process']} s, files {size_text(st['file_bytes'])}, no core dumps",
             f"its folder on disk: {size_text(st['disk_bytes'])} and {st['disk_entries']} files in all "
             "(measured as it runs)"]
    if st["bubblewrap"] is not None and st["missing"]:
        parts.append(f"missing: {'; '.join(st['missing'])}")
    return "; ".join(parts)


def _cpu_text(weight: int | None) -> str:
    if weight is None:
        return ("CPU: no share of its own (no cpu controller in the cgroup given to the grader): a submission "
                "of many processes slows the others graded beside it")
    return f"CPU: one share for all its processes together (cgroup weight {weight}, as each other submission's)"


def _covered_text(st: dict) -> str:
    if st["host_covered"] is None:
        return "no Unix socket in /run"
    text = (f"no host Unix socket and nothing only this user may read in {', '.join(COVER_TREES)} or atop the "
            f"root's other trees ({st['host_covered']} covered")
    return text + (")" if st["host_look_complete"] else f"; the look stopped after {COVER_SECONDS:g} s: what it "
                   "found by then)")


def size_text(n: int | None) -> str:
    """A size as the report says it: GiB from 1 GiB up, else MiB; None is uncapped."""
    if n is None:
        return "uncapped"
    return f"{n / 2**30:g} GiB" if n >= 2**30 else f"{n / 2**20:g} MiB"


def wrap(cmd: list[str], *, writable: list[str] = (), hidden: list[str] = (), cwd: str | None = None,
         readonly: list[str] = (), network: bool = False, keep_env: tuple[str, ...] = (),
         isolating: bool = False, replaced: dict[str, str] | None = None) -> list[str]:
    """`cmd` inside a sandbox: bubblewrap where it works, and in any case through the confining
    shim (whitelisted environment, seccomp filter) where that works; unchanged when neither does.
    `readonly`: folders inside a writable one that the sandbox may read but not write (the
    grader's answers to its checks). `network` and `keep_env` (variable names the whitelist would
    drop) only for a check job that must go through the batch system (srun talks to slurmctld):
    where this Python's MPI has no local launcher, see checker/runner.py. `isolating`: a learner's
    check job whose ranks each make a view of their own (isolate.py): user namespaces stay allowed
    (and, as root, the capability a user namespace's map of root needs) until each rank installs
    the whole seccomp filter, before the learner's code. `replaced`: {file: the file seen in its place}
    (the kit's modules without their implementations of exercises, checking.kit_answer_copies)."""
    exe = bwrap()
    isolating = isolating and exe is not None
    inner = [*_confine_prefix(keep_env, isolating), *cmd] if confinement_works() else list(cmd)
    if exe is None:
        return inner
    args = [exe, *_base_args(exe, isolating)]
    if network:  # after --unshare-all; and srun's daemon (munge), its configuration and DNS from /run
        resolv = os.path.realpath("/etc/resolv.conf")
        args += ["--share-net", *_bound_back((*BATCH_SYSTEM, resolv), private_places())]
    for path in _devices():
        args += ["--dev-bind", path, path]
    for path in hidden:  # a folder: an empty tmpfs over it; a file (an answer key): /dev/null over it
        if os.path.isdir(path):
            args += _sized(exe, HIDDEN_BYTES, os.path.realpath(path))
        elif os.path.isfile(path):
            args += ["--ro-bind", "/dev/null", os.path.realpath(path)]
    for path, copy in (replaced or {}).items():
        if os.path.isfile(path) and os.path.isfile(copy):
            args += ["--ro-bind", copy, os.path.realpath(path)]
    for path in writable:
        real = os.path.realpath(path)
        args += ["--bind", real, real]
    for path in readonly:  # after the writable binds: mounted over them
        real = os.path.realpath(path)
        args += ["--ro-bind", real, real]
    if cwd:
        args += ["--chdir", os.path.realpath(cwd)]
    return [*args, "--", *inner]
