"""Start a job's ranks by forking them from one process that has already imported torch.

Why: `import torch` costs about a second of CPU. A check runs a learner job and a reference job
at each of its rank counts — at 1 to 4 ranks that is 20 processes each importing torch on the
same cores, most of a check's time — and hpdl.start(n) has every engine import it to set up
torch.distributed. Here torch is imported once per job and each rank is a fork of that process,
which shares the imported pages instead of rebuilding them.

    serve:  python -m hpdl.forkserver serve SOCKET --preload=torch -- mpiexec -n P \
                python -m hpdl.forkserver run SOCKET MODULE ARGS...

The server listens, starts the job command and imports the modules named meanwhile. mpiexec
starts P small `run` processes as usual; each connects to SOCKET and hands over what makes it
rank i — its standard streams and the launcher's PMI descriptor (SCM_RIGHTS), its environment,
folder and CPU set. The server forks; the fork takes those, runs MODULE as `python -m MODULE
ARGS` would, and exits without tearing down every module (`_exit`). The `run` process stays as
the launcher's view of the rank: it passes signals on and exits as the rank did. If it is killed,
its connection closes and the server kills the rank; if the server is killed, its ranks die with
it. Signals sent to the server go to the job command, as they would to a launcher. When the job
command ends, the server ends what is left and exits with its code.

Nothing changes for the ranks' MPI: the launcher still starts every process it knows and wires
them (tested with MPICH's and Intel MPI's Hydra and Open MPI's PRRTE). The server runs inside
the job's sandbox when the job has one (it is part of the job's command), so a fork is confined
exactly as the rank it replaces. A `run` that cannot reach its server runs MODULE itself. Used
only where every rank is a process of this machine under its own mpiexec: a check's jobs, and
the engines of hpdl.start() without emulated nodes (HPDL_FORKSERVER=0: never). A check's reference
jobs, outside its sandbox, share one server for all its rank counts (serve_command with until_gone(owner),
each rank started by rank_command); each learner job has its own, inside its own sandbox.
"""
from __future__ import annotations

import argparse
import array
import gc
import json
import os
import runpy
import selectors
import signal
import socket
import struct
import sys
import time

from hpdl import procs

# torch imports torch._dynamo when a process builds its first optimizer (Optimizer.__init__ runs under
# torch._disable_dynamo): ~1.5 s of CPU in every rank that builds one, on top of `import torch`'s ~1.7 s
OPTIMIZER_IMPORTS = ("torch._dynamo",)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2,
             signal.SIGCONT)
MAX_REQUEST = 4 << 20  # bytes of one rank's request (its environment, mostly)
REQUEST_TIMEOUT = 10.0  # s for a connected `run` to send its request


def commands(folder: str, preload: list[str] | tuple[str, ...], module: str,
             *args: str) -> tuple[list[str], list[str]] | None:
    """How to start ranks of `python -m MODULE ARGS` as forks of a server that imported `preload`,
    listening in `folder` (0700, the job's own): (what goes before the launcher's command, what the
    launcher starts for each rank). None where the ranks are to start afresh: nothing to preload,
    HPDL_FORKSERVER=0, or a folder too deep for a Unix socket's path (108 bytes)."""
    path = socket_path(folder)
    if not preload or path is None:
        return None
    return serve_command(path, preload, []), rank_command(path, module, *args)


def socket_path(folder: str) -> str | None:
    """Where a server in `folder` listens; None where none is to: HPDL_FORKSERVER=0, or a folder
    too deep for a Unix socket's path (108 bytes)."""
    from hpdl import settings

    path = os.path.join(folder, "fork.sock")
    return path if settings.FORKSERVER.get() and len(os.fsencode(path)) < 100 else None


def serve_command(path: str, preload: list[str] | tuple[str, ...], job: list[str]) -> list[str]:
    """A server at `path` that imports `preload` and serves until the job command `job` ends (empty:
    the launcher's command, to follow)."""
    return [sys.executable, "-m", "hpdl.forkserver", "serve", path, *(f"--preload={m}" for m in preload), "--", *job]


def until_gone(owner: int) -> list[str]:
    """The job of a server for several jobs (each rank started by rank_command): it lasts until ended, or
    until `owner`, the process that started it, is gone. An owner killed before it could end its server
    (SIGTERM, SIGKILL: no finally runs) once left the server and its torch behind for good."""
    watch = ("import sys\nsys.flags.safe_path or sys.path.pop(0)\n"  # no module of the working folder's
             "import os, time\nwhile os.path.exists(f'/proc/{sys.argv[1]}'):\n    time.sleep(1)")
    return [sys.executable, "-c", watch, str(owner)]


def rank_command(path: str, module: str, *args: str) -> list[str]:
    """What a launcher starts for each rank that the server at `path` is to fork."""
    return [sys.executable, "-m", "hpdl.forkserver", "run", path, module, *args]


# -- the rank's stand-in --------------------------------------------------------------------------

def run(path: str, module: str, args: list[str]) -> None:
    """Have the server fork this rank; stand in for it until it exits, then exit the same way."""
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(path)
    except OSError:  # no server (it was not started, or is gone): be the rank ourselves
        conn.close()
        os.execv(sys.executable, [sys.executable, "-m", module, *args])
    fds = [0, 1, 2]
    pmi = os.environ.get("PMI_FD", "")  # Hydra's (MPICH, MVAPICH, Intel MPI) connection to its proxy
    if pmi.isdigit() and int(pmi) not in fds:
        fds.append(int(pmi))
    request = json.dumps({"argv": [module, *args], "env": dict(os.environ), "cwd": os.getcwd(),
                          "fds": fds, "cpus": sorted(os.sched_getaffinity(0))}).encode()
    replies = conn.makefile("r")
    try:
        conn.sendmsg([struct.pack("!I", len(request)) + request],
                     [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
        rank = int(json.loads(replies.readline() or '{"pid": 0}')["pid"])
    except OSError:  # refused: the server closed the connection (not this uid, not its namespace)
        rank = 0
    if not rank:
        sys.exit(f"hpdl.forkserver: the server at {path} did not start {module}")
    for sig in FORWARDED:
        signal.signal(sig, lambda number, _frame: procs.pass_on(rank, number))
    line = replies.readline()
    if not line:  # the server is gone, and its ranks with it (PR_SET_PDEATHSIG)
        os._exit(70)
    status = json.loads(line)["status"]
    if os.WIFSIGNALED(status):
        signal.signal(os.WTERMSIG(status), signal.SIG_DFL)
        procs.pass_on(os.getpid(), os.WTERMSIG(status))
    os._exit(os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 70)


# -- the server ---------------------------------------------------------------------------------

class Server:
    """Imports, then serves fork requests until the job command ends."""

    def __init__(self, path: str, command: list[str]):
        # what the server is sent, its job is sent (as a launcher does), from before the socket is there to be
        # seen and the job started: a SIGTERM in between killed the server and left its job running
        self.job: int | None = None
        self.pending: list[int] = []  # signals sent before the job was started: passed on once it is
        self.told = False  # sent a signal (passed on to its job)
        for sig in FORWARDED:
            signal.signal(sig, self.pass_on)
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        os.chmod(path, 0o600)
        self.listener.listen(128)
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector = selectors.DefaultSelector()
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.ranks: dict[int, socket.socket] = {}  # rank pid -> its stand-in's connection
        self.began = time.time()  # wall clock, as /dev/shm files' times
        self.killed: set[str] | None = None  # the /dev/shm files of the ranks it killed, once it killed one
        self.returncode: int | None = None
        self.job = os.posix_spawnp(command[0], command, os.environ)
        for number in self.pending:
            procs.pass_on(self.job, number)

    def pass_on(self, number: int, _frame) -> None:
        self.told = True
        if self.job is None:
            self.pending.append(number)
        else:
            procs.pass_on(self.job, number)

    def serve(self) -> dict | None:
        """Until the job ends (returns None), or, in a fork, the request it is to run."""
        while self.returncode is None:
            for key, _ in self.selector.select(timeout=1.0):
                if key.data == "accept":
                    request = self.accept()
                    if request is not None:
                        return request
                elif key.data == "wake":
                    os.read(self.wake_r, 512)
                else:  # a stand-in sends nothing after its request: this is its end, and its rank's
                    self.end_ranks([key.data])
                    self.selector.unregister(key.fileobj)
            self.reap()
        self.end_ranks(list(self.ranks))
        while self.ranks:
            self.reap(block=True)
        if self.killed is not None or self.told:  # ranks that a signal ended may have left theirs too
            left = procs.orphaned_shared_memory(min_age=0.0, since=self.began)
            procs.remove_shared_memory((self.killed or set()) | left)
        return None

    def end_ranks(self, pids: list[int]) -> None:
        """Kill these ranks, noting the /dev/shm files they map, to remove when the server ends: a rank
        killed inside MPI_Init, between making MPICH's file and its removal once every rank has mapped
        it, leaves it in RAM (a killed check left one). Stopped first, so none makes one after the look;
        one opened but not yet mapped is found at the end as made since the server began, mapped by none."""
        if not pids:
            return
        for pid in pids:
            procs.pass_on(pid, signal.SIGSTOP)
        self.killed = (self.killed or set()) | procs.shared_memory_of(pids)
        for pid in pids:
            procs.pass_on(pid, signal.SIGKILL)

    def accept(self) -> dict | None:
        conn, _ = self.listener.accept()
        try:
            conn.settimeout(REQUEST_TIMEOUT)
            pid, uid = _peer(conn)
            if uid != os.getuid():
                raise OSError(f"connection from uid {uid}")
            if _mount_namespace(pid) != _mount_namespace(os.getpid()):  # a sandbox's (inside: another's)
                raise OSError(f"connection from pid {pid}, in another mount namespace")
            request, fds = _receive(conn)
        except (OSError, ValueError, KeyError):
            conn.close()
            return None
        sys.stdout.flush()
        sys.stderr.flush()
        server = os.getpid()
        pid = os.fork()
        if pid == 0:
            _die_with_parent(server)
            self.close_in_fork(conn)
            _place(fds, request["fds"])
            return request
        for fd in fds:
            os.close(fd)
        conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        self.ranks[pid] = conn
        self.selector.register(conn, selectors.EVENT_READ, pid)
        return None

    def reap(self, block: bool = False) -> None:
        while True:
            try:
                pid, status = os.waitpid(-1, 0 if block else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            if pid == self.job:
                self.returncode = os.waitstatus_to_exitcode(status)
            elif pid in self.ranks:
                conn = self.ranks.pop(pid)
                if conn in self.selector.get_map():
                    self.selector.unregister(conn)
                try:
                    conn.sendall(json.dumps({"status": status}).encode() + b"\n")
                except OSError:
                    pass
                conn.close()
            if block:
                return

    def close_in_fork(self, conn: socket.socket) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, *FORWARDED):
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
        self.selector.close()
        for sock in (self.listener, conn, *self.ranks.values()):
            sock.close()
        os.close(self.wake_r)
        os.close(self.wake_w)
        self.ranks.clear()


def freeze_imported() -> None:
    """What the server imported, kept out of every later garbage collection (gc.freeze), in it and in its forks.
    A fork shares the server's pages until it writes to one; a full collection in a rank writes to every object it
    inherited, and the kernel copies each page so written into the rank: ~30 MiB of pages charged to the rank's
    memory cgroup at a time set by how much it allocated, which a check's count of what a rank held at once read as
    seven more layers of a model (zero3_unit)."""
    gc.collect()
    gc.freeze()


def _die_with_parent(server: int) -> None:
    """A rank is killed when its server dies (Linux's PR_SET_PDEATHSIG), so a server killed
    before it could end them leaves no rank behind."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != server:  # the server died before the call: nobody would tell us
        os._exit(70)


def _peer(conn: socket.socket) -> tuple[int, int]:
    """The connecting process's pid (as this process sees it) and uid."""
    pid, uid, _gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
    return pid, uid


def _mount_namespace(pid: int) -> str:
    """Which mount namespace `pid` is in. A server forks only for processes in its own: its socket is
    in a folder no sandbox shows, but where one did (TMPDIR under a tree the sandbox keeps), a learner's
    process could otherwise have a rank forked outside its sandbox. Its own stand-ins are always in its
    namespace (the launcher starts them beside it)."""
    try:
        return os.readlink(f"/proc/{pid}/ns/mnt")
    except OSError:
        return f"unknown ({pid})"


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    data, ancillary, _, _ = conn.recvmsg(65536, socket.CMSG_SPACE(16 * fds.itemsize))
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    if len(data) < 4 or struct.unpack("!I", data[:4])[0] > MAX_REQUEST:
        raise ValueError("not a request")
    size = struct.unpack("!I", data[:4])[0]
    while len(data) < 4 + size:
        more = conn.recv(min(1 << 20, 4 + size - len(data)))
        if not more:
            raise ValueError("a request cut short")
        data += more
    request = json.loads(data[4:4 + size])
    if len(request["fds"]) != len(fds):
        raise ValueError("descriptors missing")
    return request, list(fds)


def _place(got: list[int], want: list[int]) -> None:
    """Put the received descriptors at the numbers the stand-in had them (first all out of the
    way, so that placing one never overwrites another not yet placed)."""
    import fcntl

    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, max(want) + 1) for fd in got]
    for fd in got:
        os.close(fd)
    for fd, number in zip(high, want):
        os.dup2(fd, number)  # inheritable, as the stand-in's were
        os.close(fd)


def become(request: dict) -> None:
    """In the fork: take the stand-in's environment, folder and CPUs, then run its module."""
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    try:
        os.sched_setaffinity(0, request["cpus"])
    except OSError:
        pass
    if "numpy.random" in sys.modules:  # each rank its own entropy, as a fresh process would have
        sys.modules["numpy.random"].seed()
    module, *args = request["argv"]
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else _say(stop.code))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    _exit(code)


def _say(message) -> int:
    print(message, file=sys.stderr)
    return 1


def _exit(code: int) -> None:
    """Exit as the interpreter would — its threads joined, atexit run, MPI finalized, streams
    flushed — but without tearing down every module: with torch loaded that alone costs a rank
    ~0.45 s of CPU, and a Gloo thread still running then can abort the process (hpdl.rank.finish).
    The C library's exit() ends it, as it ends rank.leave (procs.exit_finalized says why)."""
    import atexit
    import threading

    threading._shutdown()  # what Py_FinalizeEx does first: wait for the non-daemon threads
    atexit._run_exitfuncs()
    procs.exit_finalized(code)  # mpi4py finalizes in Py_AtExit, which comes after teardown


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m hpdl.forkserver", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb", required=True)
    serve = sub.add_parser("serve", help="import, start the job command, fork its ranks on request")
    serve.add_argument("socket")
    serve.add_argument("--preload", action="append", default=[], help="a module to import once (repeatable)")
    serve.epilog = "then -- and the job command"
    rank = sub.add_parser("run", help="one rank: have the server fork it, and stand in for it")
    rank.add_argument("socket")
    rank.add_argument("module")
    rank.add_argument("args", nargs=argparse.REMAINDER)
    argv = sys.argv[1:] if argv is None else list(argv)
    command: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:
        argv, command = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    ns = parser.parse_args(argv)
    if ns.verb == "run":
        run(ns.socket, ns.module, ns.args)
    if not command:
        parser.error("serve: no job command after --")
    import importlib

    # its starter gone with no chance to end it (killed): end as when told to — the job, then the ranks,
    # then their /dev/shm files — not at once, as a side job's first process would (procs.die_with)
    procs.die_with(os.getppid(), signal.SIGTERM)
    server = Server(ns.socket, command)  # listening first: the launcher starts while we import
    for name in ns.preload:
        importlib.import_module(name)
    freeze_imported()
    request = server.serve()
    if request is None:
        sys.stdout.flush()
        os._exit(server.returncode if server.returncode >= 0 else 128 - server.returncode)
    del server
    become(request)


if __name__ == "__main__":
    main()
