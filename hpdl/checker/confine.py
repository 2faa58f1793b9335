"""The first process of untrusted code: a whitelisted environment and a seccomp filter, then exec.

    python -m hpdl.checker.confine [--keep-env=NAME,...] [--isolating] CMD ARGS...

The sandbox (sandbox.py) starts a graded submission, or a learner's check ranks, through this
shim inside bubblewrap. Two things happen before CMD runs:

- the environment is rebuilt from a whitelist (`environment`): the kit's own HPDL_* variables,
  MPI's, Jupyter's and ipyparallel's, the locale, PATH, threads... never the grader's other
  variables (a token, a password, a site secret set in the instructor's shell);
- a seccomp filter (`program`) is installed: it holds for CMD and everything it starts, and
  cannot be lifted (no_new_privs).

Why a shim and not `bwrap --clearenv` and `--seccomp FD`: the caller passes the job's
environment to the side job, not to `wrap`; and a side job starts with every other descriptor
closed (sidejob.SideJob). The shim also works where bwrap does not (`hpdl grade --no-sandbox`).

Refused: ptrace (reading another rank's memory or the grader's), mount and the new mount API,
namespaces (unshare, setns, clone with a CLONE_NEW* flag; clone3, whose flags a filter cannot
read, answers ENOSYS so the C library falls back to clone), keyrings, bpf, perf_event_open,
userfaultfd and io_uring (kernel attack surface), kernel modules, kexec, reboot, swap, quotas,
syslog, open_by_handle_at, and every 32-bit or x32 call on x86_64 (other numbers, other rules).
fallocate answers EOPNOTSUPP, as on a file system without it (the C library's posix_fallocate then
writes the space, which MPI's shared memory segments ask for): it reserved 25 GB of disk in 65 ms,
written by nothing, between two readings of a submission's 2 GiB disk cap (sandbox.DiskWatch).
An isolated check rank stacks a socket filter (inet_only_program), and a metered one, once its
sockets are made, a third on every thread: no bind() or listen() (no_new_endpoints_program).
The program is written by hand (struct, a few hundred bytes): no libseccomp to install.
"""
from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

from hpdl.settings import PREFIX  # the kit's own variables (HPDL_*), each declared in hpdl/settings.py

DENIED = ("ptrace", "syslog", "acct", "mount", "umount2", "swapon", "swapoff", "reboot", "sethostname",
          "setdomainname", "iopl", "ioperm", "init_module", "delete_module", "finit_module", "quotactl",
          "pivot_root", "chroot", "lookup_dcookie", "kexec_load", "kexec_file_load", "add_key", "request_key",
          "keyctl", "unshare", "setns", "perf_event_open", "name_to_handle_at", "open_by_handle_at", "bpf",
          "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register", "open_tree", "move_mount",
          "fsopen", "fsconfig", "fsmount", "fspick", "mount_setattr")

# a learner's isolated rank (isolate.py) may open TCP and UDP sockets and the kernel's routing netlink (the
# C library's list of interfaces), nothing else: its ranks share a network namespace, and the checker counts
# what crosses it on their TCP connections (meter.py), and any UDP datagram (Open MPI's ranks ask a UDP
# socket for the list of interfaces: they send nothing on it). An abstract Unix socket, SCTP, UDP-Lite or
# a netlink family that carries data between processes would pass values no count sees. socketpair()
# stays: it reaches no other rank.
AF_UNIX, AF_INET, AF_NETLINK, AF_INET6, SOCK_STREAM, SOCK_DGRAM, IPPROTO_TCP, IPPROTO_UDP, NETLINK_ROUTE = \
    1, 2, 16, 10, 1, 2, 6, 17, 0
SOCKET = {"x86_64": 41, "aarch64": 198}
# and once a metered rank's MPI and torch.distributed have made their sockets, every rank connected to every
# other, before any learner's code: no bind() or listen() more. The ranks share a network namespace, and the
# addresses and ports their sockets take are in it for all to see (/proc/net/tcp, or a bind() refused as
# taken): values spelled in them cross with no byte on any connection
BIND = {"x86_64": 49, "aarch64": 200}
LISTEN = {"x86_64": 50, "aarch64": 201}
SECCOMP_FILTER_FLAG_TSYNC = 1  # every thread of the process at once: MPI's and torch's threads run the learner's
ALU_AND_K = 0x54

# system call numbers (asm/unistd_64.h; asm-generic/unistd.h for aarch64)
_X86_64 = dict(ptrace=101, syslog=103, acct=163, mount=165, umount2=166, swapon=167, swapoff=168, reboot=169,
               sethostname=170, setdomainname=171, iopl=172, ioperm=173, init_module=175, delete_module=176,
               finit_module=313, quotactl=179, pivot_root=155, chroot=161, lookup_dcookie=212, kexec_load=246,
               kexec_file_load=320, add_key=248, request_key=249, keyctl=250, unshare=272, setns=308,
               perf_event_open=298, name_to_handle_at=303, open_by_handle_at=304, bpf=321, userfaultfd=323,
               io_uring_setup=425, io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429,
               fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, clone=56, clone3=435,
               fallocate=285)
_AARCH64 = dict(ptrace=117, syslog=116, acct=89, mount=40, umount2=39, swapon=224, swapoff=225, reboot=142,
                sethostname=161, setdomainname=162, init_module=105, delete_module=106, finit_module=273,
                quotactl=60, pivot_root=41, chroot=51, lookup_dcookie=18, kexec_load=104, kexec_file_load=294,
                add_key=217, request_key=218, keyctl=219, unshare=97, setns=268, perf_event_open=241,
                name_to_handle_at=264, open_by_handle_at=265, bpf=280, userfaultfd=282, io_uring_setup=425,
                io_uring_enter=426, io_uring_register=427, open_tree=428, move_mount=429, fsopen=430,
                fsconfig=431, fsmount=432, fspick=433, mount_setattr=442, clone=220, clone3=435, fallocate=47)
# machine -> (AUDIT_ARCH_*, numbers, refuse numbers from this bit up: x32 on x86_64)
ARCHES = {"x86_64": (0xC000003E, _X86_64, 0x40000000), "aarch64": (0xC00000B7, _AARCH64, None)}

CLONE_NEW = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000
EPERM, ENOSYS, EOPNOTSUPP = 1, 38, 95
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000
# BPF opcodes
LD_W_ABS, JEQ_K, JGE_K, JSET_K, RET_K = 0x20, 0x15, 0x35, 0x45, 0x06
PR_SET_NO_NEW_PRIVS, SECCOMP_SET_MODE_FILTER = 38, 1
_SECCOMP_SYSCALL = {"x86_64": 317, "aarch64": 277}

# what untrusted code may see of the environment it was given
ENV_NAMES = frozenset({
    "PATH", "HOME", "LANG", "LANGUAGE", "TZ", "TERM", "PYTHONPATH", "PYTHONUNBUFFERED", "PYTHONHASHSEED",
    "PYTHONDONTWRITEBYTECODE", "MPLBACKEND", "MPLCONFIGDIR", "IPYTHONDIR", "VIRTUAL_ENV", "LD_LIBRARY_PATH",
    "OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS", "CUDA_VISIBLE_DEVICES",
    "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "MALLOC_MMAP_THRESHOLD_"})  # not TMPDIR: inside, the private /tmp. MALLOC_*: a check job's (jobs.MMAP_FROM)
ENV_PREFIXES = (PREFIX, "LC_", "IPP_", "JUPYTER_", "MPI4PY_", "OMPI_", "PMIX_", "PRTE_", "MPICH_", "MPIR_CVAR_",
                "HYDRA_", "I_MPI_", "FI_", "UCX_", "NCCL_", "KMP_", "TORCH_")


KEEP = "--keep-env="  # first argument: more names to keep (a check job that must run srun: SLURM_*)
# a check job whose ranks isolate themselves (isolate.py): its launcher and ranks may unshare and mount
# until each rank installs the whole filter, before the learner's code
ISOLATING = "--isolating"
ISOLATING_ALLOWS = frozenset({"unshare", "mount"})


def environment(env, keep: frozenset[str] = frozenset()) -> dict[str, str]:
    """The variables of `env` that untrusted code may see: the whitelist above (and `keep`), nothing else."""
    return {k: v for k, v in env.items() if k in ENV_NAMES or k in keep or k.startswith(ENV_PREFIXES)}


def supported() -> bool:
    """Whether a filter can be built for this machine's architecture."""
    return platform.machine() in ARCHES


def program(machine: str | None = None, allow: frozenset[str] = frozenset()) -> bytes:
    """The filter as a BPF program (struct sock_filter[]), for `machine` (default: this one); `allow`:
    names of DENIED left out (ISOLATING's, for the processes that start a check's isolated ranks)."""
    arch, nr, x32 = ARCHES[machine or platform.machine()]
    code: list[tuple] = [(LD_W_ABS, "", "", 4), (JEQ_K, "", "eperm", arch), (LD_W_ABS, "", "", 0)]
    if x32 is not None:
        code.append((JGE_K, "eperm", "", x32))
    code += [(JEQ_K, "enosys", "", nr["clone3"]), (JEQ_K, "", "denylist", nr["clone"]),
             (LD_W_ABS, "", "", 16), (JSET_K, "eperm", "allow", CLONE_NEW), ("denylist",)]
    code += [(JEQ_K, "eperm", "", nr[name]) for name in DENIED if name not in allow]
    code += [(JEQ_K, "unsupported", "", nr["fallocate"])]
    code += [("allow",), (RET_K, "", "", RET_ALLOW), ("eperm",), (RET_K, "", "", RET_ERRNO | EPERM),
             ("enosys",), (RET_K, "", "", RET_ERRNO | ENOSYS),
             ("unsupported",), (RET_K, "", "", RET_ERRNO | EOPNOTSUPP)]
    return _assemble(code)


def inet_only_program(machine: str | None = None) -> bytes:
    """A second filter, stacked on the first in an isolated learner rank: socket() answers EPERM but for
    TCP and UDP over IPv4 or IPv6 and routing netlink (see AF_UNIX above)."""
    machine = machine or platform.machine()
    arch = ARCHES[machine][0]
    code: list[tuple] = [
        (LD_W_ABS, "", "", 4), (JEQ_K, "", "allow", arch), (LD_W_ABS, "", "", 0),
        (JEQ_K, "", "allow", SOCKET[machine]),
        (LD_W_ABS, "", "", 16), (JEQ_K, "inet", "", AF_INET), (JEQ_K, "inet", "", AF_INET6),
        (JEQ_K, "", "eperm", AF_NETLINK), (LD_W_ABS, "", "", 32), (JEQ_K, "allow", "eperm", NETLINK_ROUTE),
        ("inet",), (LD_W_ABS, "", "", 24), (ALU_AND_K, "", "", 0xF), (JEQ_K, "stream", "", SOCK_STREAM),
        (JEQ_K, "", "eperm", SOCK_DGRAM), (LD_W_ABS, "", "", 32), (JEQ_K, "allow", "", 0),
        (JEQ_K, "allow", "eperm", IPPROTO_UDP),
        ("stream",), (LD_W_ABS, "", "", 32), (JEQ_K, "allow", "", 0), (JEQ_K, "allow", "eperm", IPPROTO_TCP),
        ("allow",), (RET_K, "", "", RET_ALLOW), ("eperm",), (RET_K, "", "", RET_ERRNO | EPERM)]
    return _assemble(code)


def no_new_endpoints_program(machine: str | None = None) -> bytes:
    """A third filter, for a metered rank once its sockets are made (learner_job): bind() and listen() answer
    EPERM (see BIND above). A connect() still binds a port the kernel picks, as MPI's lazy connections do."""
    machine = machine or platform.machine()
    code: list[tuple] = [
        (LD_W_ABS, "", "", 4), (JEQ_K, "", "allow", ARCHES[machine][0]), (LD_W_ABS, "", "", 0),
        (JEQ_K, "eperm", "", BIND[machine]), (JEQ_K, "eperm", "allow", LISTEN[machine]),
        ("allow",), (RET_K, "", "", RET_ALLOW), ("eperm",), (RET_K, "", "", RET_ERRNO | EPERM)]
    return _assemble(code)


def _assemble(code: list[tuple]) -> bytes:
    """Resolve labels (1-tuples) to relative jump offsets and pack each instruction."""
    labels, n = {}, 0
    for ins in code:
        if len(ins) == 1:
            labels[ins[0]] = n
        else:
            n += 1
    out, i = [], 0
    for ins in code:
        if len(ins) == 1:
            continue
        op, jt, jf, k = ins
        off = [labels[j] - i - 1 if j else 0 for j in (jt, jf)]
        assert all(0 <= o < 256 for o in off), "a jump too far for classic BPF"
        out.append(struct.pack("=HBBI", op, off[0], off[1], k))
        i += 1
    return b"".join(out)


def install(allow: frozenset[str] = frozenset(), inet_only: bool = False) -> None:
    """Apply the filter to this process and all it will start (raises OSError where refused). Filters
    stack: a process under one that allows some calls can install the whole one (isolate.py's ranks),
    and with `inet_only` the socket filter after it."""
    _install(program(allow=allow))
    if inet_only:
        _install(inet_only_program())


def no_new_endpoints() -> None:
    """no_new_endpoints_program on every thread of this process (raises OSError where one cannot take it)."""
    _install(no_new_endpoints_program(), SECCOMP_FILTER_FLAG_TSYNC)


def _install(prog: bytes, flags: int = 0) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(prog, len(prog))

    class SockFprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = SockFprog(len(prog) // 8, ctypes.cast(buf, ctypes.c_void_p))
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    libc.syscall.restype = ctypes.c_long
    done = libc.syscall(_SECCOMP_SYSCALL[platform.machine()], SECCOMP_SET_MODE_FILTER, flags, ctypes.byref(fprog))
    if done < 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")
    if done > 0:  # TSYNC: this thread could not take it (a filter of its own)
        raise OSError(f"seccomp(SECCOMP_SET_MODE_FILTER, TSYNC): thread {done} could not take the filter")


def main(argv: list[str]) -> int:
    keep: frozenset[str] = frozenset()
    allow: frozenset[str] = frozenset()
    while argv and (argv[0] == ISOLATING or argv[0].startswith(KEEP)):
        arg = argv.pop(0)
        if arg == ISOLATING:
            allow = ISOLATING_ALLOWS
        else:
            keep = frozenset(filter(None, arg[len(KEEP):].split(",")))
    if not argv:
        print("usage: python -m hpdl.checker.confine [--keep-env=NAME,...] [--isolating] CMD [ARGS...]",
              file=sys.stderr)
        return 2
    try:
        install(allow)
    except (OSError, KeyError) as exc:  # the sandbox checked this works before using the shim
        print(f"hpdl: the seccomp filter could not be installed: {exc}", file=sys.stderr)
        return 126
    os.execvpe(argv[0], argv, environment(os.environ, keep))
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
