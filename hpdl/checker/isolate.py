"""One learner rank in a view of its own: files, /tmp, /proc and PIDs no other rank shares.

The ranks of a learner's check job run in one sandbox (sandbox.py) and talk over its network,
whose bytes the checker counts (meter.py). Whatever else they shared would carry values past that
count: the job folder, /tmp, /dev/shm, the small tmpfs over each hidden place, each other's /proc
entries (a command line rewritten and read back), signals (sigqueue carries a number). So the
first thing a learner rank does (learner_job.py, before MPI starts a thread, long before the
learner's code) is `isolate()`:

- a user, mount, PID and IPC namespace of its own (unshare: the sandbox leaves user namespaces
  allowed for this step; the seccomp filter installed right after refuses them to what follows);
- every writable mount read-only, then fresh sized tmpfs on /tmp, /dev/shm and TMPDIR;
- the job folder covered by an empty read-only tmpfs, with spec.pkl (read-only) and the rank's
  own folder r<R> (writable) bound back: the checker writes the rank's inputs and releases there
  and reads its events and results from there (jobs.Job.rank_dir);
- a fork: the rank goes on as PID 1 of its own PID namespace (no other rank's PID to signal) and
  /proc holds its own entry (as 1) and the machine-wide files only. The first process stays as the
  launcher's view of the rank: it waits, ends the rank if it is ended, and exits as the rank did.

Still shared: the network namespace (TCP between ranks, counted by the meter); its live tables in /proc
(every rank's sockets and counters) are replaced in the rank's /proc by a copy made before MPI starts
(_own_net). No memory is shared:
an isolated job's ranks talk over TCP, metered or not, and Open MPI's PMIx client takes the job's data
by message (meter.tcp_transport); Intel MPI's start-up needs a segment for all of a node's ranks, so
its ranks each start as if on a node of their own (launchers.nodes_apart).
"""
from __future__ import annotations

import ctypes
import os
import select
import signal

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_MOVE, MS_REC, MS_PRIVATE = 32, 4096, 8192, 16384, 1 << 18
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER, CLONE_NEWPID = 0x20000, 0x08000000, 0x10000000, 0x20000000
TMP_BYTES = 256 << 20  # each of /tmp, /dev/shm, TMPDIR: a cap (tmpfs takes memory as it is written)
NET_FILE_BYTES = 64 << 10  # the most of each of /proc/net's files a rank's copy holds
PROC_FILES = ("cpuinfo", "meminfo", "stat", "loadavg", "uptime", "version", "filesystems", "mounts", "net", "sys",
              "driver")  # driver: the NVIDIA driver's files, which CUDA reads
_RANK_VARIABLES = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")  # MPICH and Intel MPI, Open MPI


def rank_from_env(env=os.environ) -> int | None:
    """This process's rank as its launcher told it, before MPI starts (None: not under one we know)."""
    for name in _RANK_VARIABLES:
        value = env.get(name, "")
        if value.isdigit():
            return int(value)
    return None


def rank_dir(job_dir: str, rank: int) -> str:
    return os.path.join(job_dir, f"r{rank}")


def isolate(job_dir: str, rank: int) -> int:
    """Give this process (single-threaded: no MPI yet) a view of its own; see the module's doc.
    Returns its PID as the sandbox sees it: the checker finds the rank's sockets by it (meter.host_pid).
    Raises OSError naming the step that failed; only this process is changed by then."""
    libc = ctypes.CDLL(None, use_errno=True)
    _own_namespaces(libc)
    _own_files(libc, os.path.realpath(job_dir), rank)
    _become_pid_one(libc)
    pid = _own_pid()
    _own_proc(libc, pid)
    return pid


def _own_namespaces(libc) -> None:
    """User, mount, PID (for the next child) and IPC namespaces; this user mapped to itself."""
    uid, gid = os.getuid(), os.getgid()
    _call(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC), "unshare")
    _write("/proc/self/setgroups", "deny")
    _write("/proc/self/uid_map", f"{uid} {uid} 1")
    _write("/proc/self/gid_map", f"{gid} {gid} 1")
    _mount(libc, None, "/", None, MS_REC | MS_PRIVATE)


def _own_files(libc, job: str, rank: int) -> None:
    """Every writable mount read-only; fresh /tmp, /dev/shm (and TMPDIR); the job folder reduced to spec.pkl
    (read-only) and this rank's own folder."""
    fresh = _fresh_places()
    mounts = _mounts()
    # what the sandbox bound inside a place that gets a fresh tmpfs (the kit, its Python, when they live
    # under /tmp): bound back, read-only as they were, on top of it
    carried = _outermost([m for m, _ in mounts if any(m.startswith(p + "/") for p in fresh)
                          and m != job and not m.startswith(job + "/")])
    fds = {path: os.open(path, os.O_PATH) for path in [job, *carried]}
    try:
        for mount_point, writable in mounts:
            if writable and mount_point != job and mount_point not in ("/dev", "/proc") \
                    and not mount_point.startswith(("/dev/", "/proc/")):
                _mount(libc, None, mount_point, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked(mount_point))
        for place in fresh:
            _mount(libc, "tmpfs", place, "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMP_BYTES},mode=0700")
        os.makedirs(job, exist_ok=True)  # a job folder under /tmp: its place in the fresh one
        for path in carried:
            os.makedirs(path, exist_ok=True)
            _mount(libc, f"/proc/self/fd/{fds[path]}", path, None, MS_BIND | MS_REC)
        own, spec = rank_dir(job, rank), os.path.join(job, "spec.pkl")
        _mount(libc, "tmpfs", job, "tmpfs", MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
        os.mkdir(own)
        open(spec, "wb").close()
        _mount(libc, f"/proc/self/fd/{fds[job]}/r{rank}", own, None, MS_BIND)
        _mount(libc, f"/proc/self/fd/{fds[job]}/spec.pkl", spec, None, MS_BIND)
        _mount(libc, None, spec, None, MS_REMOUNT | MS_BIND | MS_RDONLY | _locked(spec))
        _mount(libc, None, job, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV, "size=64k,mode=0755")
    finally:
        for fd in fds.values():
            os.close(fd)


def _become_pid_one(libc) -> None:
    """Fork: the child goes on as PID 1 of the new PID namespace; this process stands in for it."""
    read_end, write_end = os.pipe()  # the stand-in holds the write end until it exits
    child = os.fork()
    if child:
        os.close(read_end)
        _stand_in(child)  # never returns
    os.close(write_end)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG: the stand-in gone, so is the rank
    if select.select([read_end], [], [], 0)[0]:  # gone already, before that took hold (getppid() reads 0 here)
        os._exit(70)
    os.close(read_end)


def _stand_in(child: int) -> None:
    """The launcher's view of the rank: signals that end a process end the rank (PID 1 of its namespace
    ignores those it has no handler for, not SIGKILL); exit as it exited."""
    from hpdl import procs

    def end(signum, frame):
        procs.pass_on(child, signal.SIGKILL)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, end)
    while True:
        try:
            _, status = os.waitpid(child, 0)
            break
        except ChildProcessError:
            os._exit(70)
        except InterruptedError:
            continue
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _own_pid() -> int:
    """This process's PID in the sandbox's namespace: the first of /proc/self/status's NSpid, read through
    the sandbox's /proc (still mounted)."""
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("NSpid:"))
    return int(line.split()[1])


def _own_proc(libc, pid: int) -> None:
    """/proc with this process's entry and the machine-wide files only: built in the fresh /tmp, moved over /proc."""
    stage = os.path.join("/tmp", ".proc")
    os.mkdir(stage)
    _mount(libc, "tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0755")
    for name in (str(pid), *PROC_FILES):
        src, dst = f"/proc/{name}", os.path.join(stage, "1" if name == str(pid) else name)  # PID 1 in here
        if os.path.islink(src):  # mounts, net: this process's own, through self
            os.symlink(os.readlink(src), dst)
            continue
        if not os.path.exists(src):
            continue
        if os.path.isdir(src):
            os.mkdir(dst)
        else:
            open(dst, "w").close()
        _mount(libc, src, dst, None, MS_BIND | MS_REC)
    _own_net(libc, pid, os.path.join(stage, "1"))
    os.symlink("1", os.path.join(stage, "self"))
    os.symlink(f"1/task/{pid}", os.path.join(stage, "thread-self"))  # the main thread's (tasks keep the sandbox's ids)
    _mount(libc, None, stage, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
           "size=64k,mode=0755")
    _mount(libc, stage, "/proc", None, MS_MOVE)
    os.rmdir(stage)


def _own_net(libc, pid: int, own: str) -> None:
    """The network's files in this process's /proc entry (`own`, bound from the sandbox's /proc/`pid`) as they
    are now, never again: the ranks share a network namespace, whose live tables show every rank's sockets
    and counters (a UDP socket connected to an address that spells values, read in /proc/net/udp by another
    rank, carries them with no byte on the wire). Each thread's entry shows its own: task/ holds only this
    thread's, which no other thread has yet, with the same copy."""
    src, copies = f"/proc/{pid}/net", {}
    for name in os.listdir(src):
        path = os.path.join(src, name)
        if os.path.isfile(path):
            try:
                with open(path, "rb") as f:
                    copies[name] = f.read(NET_FILE_BYTES)
            except OSError:
                copies[name] = b""
        elif os.path.isdir(path):
            copies[name] = None
    net, task = os.path.join(own, "net"), os.path.join(own, "task")
    _mount(libc, "tmpfs", net, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4m,mode=0555")
    for name, data in copies.items():
        if data is None:
            os.mkdir(os.path.join(net, name))
        else:
            with open(os.path.join(net, name), "wb") as f:
                f.write(data)
    _mount(libc, None, net, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4m,mode=0555")
    thread = os.path.join(task, str(pid))
    _mount(libc, "tmpfs", task, "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0555")
    os.mkdir(thread)
    _mount(libc, None, task, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64k,mode=0555")
    _mount(libc, f"/proc/{pid}/task/{pid}", thread, None, MS_BIND | MS_REC)
    _mount(libc, net, os.path.join(thread, "net"), None, MS_BIND)


def _fresh_places() -> list[str]:
    places = ["/tmp", "/dev/shm"]
    tmpdir = os.environ.get("TMPDIR", "")
    if tmpdir and os.path.isdir(tmpdir):
        real = os.path.realpath(tmpdir)
        if not any(real == p or real.startswith(p + "/") for p in places):
            places.append(real)
    return [p for p in places if os.path.isdir(p)]


def _mounts() -> list[tuple[str, bool]]:
    """(mount point, read-write) of every mount, outermost first (from /proc/self/mountinfo)."""
    points: dict[str, bool] = {}
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            point = fields[4].encode().decode("unicode_escape")
            points[point] = "rw" in fields[5].split(",")  # the last mounted on a point is the one seen
    return sorted(points.items(), key=lambda item: item[0].count("/"))


def _outermost(points: list[str]) -> list[str]:
    return [p for p in points if not any(p.startswith(q + "/") for q in points if q != p)]


def _locked(path: str) -> int:
    """The flags a remount of `path` must keep (those of a mount made in an outer namespace are locked)."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | 1024 | 2048)  # and NOATIME, NODIRATIME
    return flags | ((1 << 21) if f & 4096 else 0)  # ST_RELATIME -> MS_RELATIME


def _mount(libc, source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None  # noqa: E731
    _call(libc.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _call(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)
