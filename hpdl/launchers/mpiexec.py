"""`mpiexec` on this machine: which one belongs to this Python, which MPI it is, and the flags that
make every MPI implementation start ranks alike.

A module of its own, importing no launcher, because the local launcher, the Slurm launcher's
fallback, side jobs, benchmarks and a site's own launcher package all start `mpiexec` the same way.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hpdl import settings
from hpdl.errors import HpdlError

_IMPLEMENTATION: dict[str, str] = {}
_VERSION: dict[str, str] = {}  # mpiexec -> what its --version printed

# Variables a rank needs from the kernel's environment. Hydra (MPICH, Intel MPI) hands every
# rank the whole environment; Open MPI only on this machine, so on other hosts it needs `-x NAME`.
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "MPI4PY_LIBMPI", "VIRTUAL_ENV", "PYTHONPATH")


def engine_env() -> dict[str, str]:
    """Environment every engine starts with: one thread until the rank sets its share."""
    env = {"OMP_NUM_THREADS": "1", "IPP_NONINTERACTIVE": "1", "PYTHONUNBUFFERED": "1"}
    # The venv's bin first, so ranks find the same MPI and Python as the kernel.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


def find_mpiexec() -> str:
    """The mpiexec that belongs to this Python's MPI (the venv's first), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise HpdlError(
        "No mpiexec found: this Python has no MPI launcher next to it and none is on PATH.\n"
        "Run `make lab` from the kit's folder (it installs MPI into .venv), or on a cluster "
        "`module load` your site's MPI before starting JupyterLab."
    )


def mpiexec_implementation(exe: str | None = None) -> str:
    """Which MPI an mpiexec belongs to ("MPICH", "Open MPI", "Intel MPI", ...), from its --version."""
    from hpdl.mpilib import implementation

    exe = exe or find_mpiexec()
    if exe not in _IMPLEMENTATION:
        _IMPLEMENTATION[exe] = implementation(mpiexec_version(exe))
    return _IMPLEMENTATION[exe]


def mpiexec_version(exe: str | None = None) -> str:
    """What `mpiexec --version` prints (read once per mpiexec): its MPI, and for Hydra its build's
    configure options (`--with-device=ch4:ucx,ofi`)."""
    import subprocess

    exe = exe or find_mpiexec()
    if exe not in _VERSION:
        try:
            p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
            _VERSION[exe] = p.stdout + p.stderr
        except (OSError, subprocess.TimeoutExpired):
            _VERSION[exe] = ""
    return _VERSION[exe]


def mpiexec_flags(implementation: str, env_names: list[str] | tuple[str, ...] = (), as_root: bool = False,
                  bind: str | None = None) -> list[str]:
    """The flags the kit gives `mpiexec` of each MPI, so every implementation starts ranks alike:
    more ranks than cores allowed, no pinning (a rank sets its own thread count; two ranks pinned
    to one core would halve both), the engines' environment on every host, and running as root
    (containers, CI) allowed. `bind` ("core", "none"): pin each rank as asked instead, in this
    MPI's spelling (lesson 08 measures what binding does).

    MPICH's Hydra already behaves so. Open MPI refuses more ranks than cores and running as root,
    binds each rank to a core, and passes environment variables to other hosts only when named
    with -x; it reads `-bind-to none` as the program `none`. Intel MPI pins each rank to cores
    unless I_MPI_PIN=0. Pure, so tested without MPI.
    """
    if implementation == "Open MPI":
        flags = ["--oversubscribe", "--bind-to", bind or "none"]
        flags += ["--allow-run-as-root"] if as_root else []
        for name in env_names:
            flags += ["-x", name]
        return flags
    if implementation == "Intel MPI":
        if bind and bind != "none":
            return ["-genv", "I_MPI_PIN", "1", "-genv", "I_MPI_PIN_DOMAIN", bind]
        return ["-genv", "I_MPI_PIN", "0"]
    return ["-bind-to", bind] if bind else []


def launch_flags(exe: str | None = None, bind: str | None = None) -> list[str]:
    """`mpiexec_flags` for the mpiexec found here and this process's environment."""
    names = [k for k in (*engine_env(), *PASSED_ENV) if k in os.environ or k in engine_env()]
    names += sorted(k for k in os.environ if k.startswith((settings.PREFIX, "HOROVOD_", "OMP_", "MPIR_CVAR_")))
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    return mpiexec_flags(mpiexec_implementation(exe), list(dict.fromkeys(names)), as_root, bind)


def mpiexec_command(n: int, bind: str | None = None) -> list[str]:
    """`mpiexec -n N` for this Python's MPI, with the flags its implementation needs (mpiexec_flags);
    `bind`: "core" or "none" to pin the ranks so, whichever MPI this is."""
    exe = find_mpiexec()
    return [exe, *launch_flags(exe, bind), "-n", str(n)]


def local_flags(implementation: str) -> list[str]:
    """Flags that keep an mpiexec's ranks on this machine, forked, whatever its environment says.

    Why: inside a batch job Hydra (MPICH, MVAPICH2; Intel MPI's own) starts its ranks through the
    batch system (srun), and a site's module may name that launcher outright (HYDRA_LAUNCHER,
    I_MPI_HYDRA_BOOTSTRAP): a job meant for this node only, in a sandbox with no network, must
    fork them. Open MPI has no such flag: it decides from the environment alone (SLURM_JOBID,
    PMIX_*), which local_job_env removes. Pure, so tested without MPI."""
    if implementation in ("MPICH", "MVAPICH2"):
        return ["-launcher", "fork"]
    if implementation == "Intel MPI":
        return ["-bootstrap", "fork"]
    return []


# Intel MPI's "remote shell" for ranks on nodes of their own (nodes_apart): each node is this one. Called
# as `SCRIPT [-q] [-x] HOST COMMAND...`, as ssh would be; runs COMMAND here, as ssh's remote shell would
REMOTE_SHELL_HERE = '#!/bin/sh\nwhile [ "${1#-}" != "$1" ]; do shift; done\nshift\nexec sh -c "$*"\n'


def nodes_apart(implementation: str, n: int, remote_shell: str) -> list[str] | None:
    """Flags that start `n` ranks here each as if on a node of its own, for ranks that share no memory
    (a check's isolated learner ranks, hpdl.checker.isolate); None where no flags are needed (MPICH,
    Open MPI). Why: Intel MPI's start-up maps one shared-memory segment for all of a node's ranks
    (MPIDU_Init_shm_init), whatever the fabric. One name per rank and one rank per name: each rank
    under a proxy of its own, started through `remote_shell` (REMOTE_SHELL_HERE, a file), which
    runs it here. Pure, so tested without MPI."""
    if implementation != "Intel MPI":
        return None
    return ["-bootstrap", "ssh", "-bootstrap-exec", remote_shell,
            "-hosts", ",".join(f"hpdl-rank{i}" for i in range(n)), "-ppn", "1"]


def local_mpiexec_command(n: int) -> list[str]:
    """`mpiexec_command(n)` whose ranks are forked on this machine (local_flags); HpdlError where
    this Python's MPI has no mpiexec (Cray MPICH: only srun starts its ranks)."""
    exe = find_mpiexec()
    return [exe, *launch_flags(exe), *local_flags(mpiexec_implementation(exe)), "-n", str(n)]
