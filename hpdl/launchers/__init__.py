"""Client side: how engines become MPI ranks — one `Launcher` class per way of starting them.

`hpdl.cluster` decides when to start and stop; a launcher says how, here: whether it is the one
to use (`detect`), how many ranks by default, how to fill in ipyparallel's configuration, a
one-line description, how to cancel a job it submitted, and how to start a separate short MPI
job beside the engines (checks, doctor). Each launcher is one class in one file of this folder
(local.py: `mpiexec`; slurm.py: `srun`/`sbatch`); defining a subclass with a `name` registers
it, so adding PBS or LSF is one new file — see docs/LAUNCHERS.md. Site profiles (partition,
modules, resources per rank) live in hpdl/sites.py.
"""
from __future__ import annotations

import importlib
import os
import pkgutil
import shlex
import shutil
import sys
from pathlib import Path
from typing import ClassVar

from hpdl import settings
from hpdl.errors import HpdlError
from hpdl.sites import SITES_DIR, SlurmSite, load_site  # noqa: F401  (kept importable from here)

_REGISTRY: dict[str, type[Launcher]] = {}


class Launcher:
    """One way of starting `n` engines as the ranks of one MPI job.

    Subclass it with a `name` and it is registered: hpdl.start(launcher=name) uses it, and
    launcher="auto" picks, among those whose `detect()` is true, the one with the highest
    `priority`. Only `configure` must be written; the rest has sensible defaults.
    """

    name: ClassVar[str] = ""         # what hpdl.start(launcher=...) and HPDL_LAUNCHER take
    label: ClassVar[str] = ""        # shown in "4 ranks ready (mpiexec, MPICH 5.0)"
    priority: ClassVar[int] = 0      # "auto": the highest-priority launcher whose detect() is true
    ranks_are_local: ClassVar[bool] = False  # the ranks are processes of this machine (watched by pid)
    queue_hint: ClassVar[str] = ""   # said when ranks are slow to register ("the job may be queued")

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if cls.__dict__.get("name"):
            _REGISTRY[cls.name] = cls

    def detect(self) -> bool:
        """True where this launcher is the natural one (e.g. inside one of its jobs)."""
        return False

    def default_n(self) -> int:
        """Ranks when hpdl.start() is given no n."""
        return min(4, os.cpu_count() or 1)

    def configure(self, config, n: int) -> dict:
        """Fill the traitlets `config` for ipyparallel; return keyword arguments for ipyparallel.Cluster
        (at least `engines`; optionally `controller_ip`, `controller_location`, `start_timeout`)."""
        raise NotImplementedError(f"launcher {self.name!r} does not say how to start engines")

    def describe(self) -> str:
        """One line for `hpdl doctor`: what this launcher would do here."""
        return self.label or self.name

    def cancel(self, job_id: str) -> None:
        """Remove a job this launcher submitted (a batch system's job id); nothing to do by default."""

    def side_job_command(self, n: int) -> list[str]:
        """How to start a separate short MPI job of `n` ranks here (append the program and its args)."""
        return mpiexec_command(n)


def _discover() -> None:
    """Import every launcher file of this folder (files starting with _ are helpers, not launchers)."""
    for mod in pkgutil.iter_modules(__path__):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


def known() -> list[str]:
    """The launcher names hpdl.start() accepts (besides 'auto')."""
    return sorted(_REGISTRY)


def get(name: str) -> Launcher:
    """The launcher called `name` (not 'auto': see resolve); HpdlError listing the known ones."""
    cls = _REGISTRY.get((name or "").lower())
    if cls is None:
        raise HpdlError(
            f"launcher={name!r} is not one we know; use one of {', '.join(known())} or 'auto'. "
            "A new launcher is one class in hpdl/launchers/ (see docs/LAUNCHERS.md)."
        )
    return cls()


def detected() -> Launcher:
    """The launcher that fits where this Python runs, ignoring HPDL_LAUNCHER."""
    for cls in sorted(_REGISTRY.values(), key=lambda c: -c.priority):
        launcher = cls()
        if launcher.detect():
            return launcher
    return get("local")


def resolve(launcher: str) -> str:
    """The launcher's name: 'auto' means $HPDL_LAUNCHER if set, else the detected one
    (Slurm inside a Slurm allocation, the local mpiexec everywhere else)."""
    launcher = (launcher or "auto").lower()
    if launcher == "auto":
        chosen = settings.LAUNCHER.get().lower()
        launcher = chosen if chosen and chosen != "auto" else detected().name
    return get(launcher).name


# -- the module-level API the rest of the kit calls ----------------------------------------------

def default_n(launcher: str) -> int:
    return get(launcher).default_n()


def configure(launcher: str, config, n: int) -> dict:
    """Fill `config` for `launcher`; returns keyword arguments for ipyparallel.Cluster."""
    return get(launcher).configure(config, n)


def describe(launcher: str) -> str:
    return get(launcher).describe()


def side_job_command(n: int) -> list[str]:
    """How to start a separate short MPI job of `n` ranks from here, e.g. a check.

    Locally the venv's `mpiexec -n N`; inside a Slurm allocation `srun --overlap ... -n N`, which
    runs beside the engines' step instead of waiting for its CPUs (an mpiexec there would itself
    go through srun and queue behind the engines). Append the program and its arguments."""
    return detected().side_job_command(n)


def job_command(n: int) -> str:
    """The shell command that starts an `n`-rank MPI job from here, for a notebook's `!` line.

    A lesson shows it rather than a bare `mpiexec`: on a laptop it is this venv's mpiexec with
    the flags its MPI needs; inside a Slurm job (JupyterLab from Open OnDemand, the workshop hub,
    jupyter.sbatch) an `srun --overlap` step, because an mpiexec there would go through srun and
    wait for the CPUs the engines hold. Append the program: `!{hpdl.job_command(2)} python x.py`."""
    return shlex.join(side_job_command(n))


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


_IMPLEMENTATION: dict[str, str] = {}

# Variables a rank needs from the kernel's environment. Hydra (MPICH, Intel MPI) hands every
# rank the whole environment; Open MPI only on this machine, so on other hosts it needs `-x NAME`.
PASSED_ENV = ("PATH", "LD_LIBRARY_PATH", "LD_PRELOAD", "MPI4PY_LIBMPI", "VIRTUAL_ENV", "PYTHONPATH")


def mpiexec_implementation(exe: str | None = None) -> str:
    """Which MPI an mpiexec belongs to ("MPICH", "Open MPI", "Intel MPI", ...), from its --version."""
    import subprocess

    from hpdl.mpilib import implementation

    exe = exe or find_mpiexec()
    if exe not in _IMPLEMENTATION:
        try:
            p = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
            out = p.stdout + p.stderr
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        _IMPLEMENTATION[exe] = implementation(out)
    return _IMPLEMENTATION[exe]


def mpiexec_flags(implementation: str, env_names: list[str] | tuple[str, ...] = (), as_root: bool = False) -> list[str]:
    """The flags the kit gives `mpiexec` of each MPI, so every implementation starts ranks alike:
    more ranks than cores allowed, no pinning (a rank sets its own thread count; two ranks pinned
    to one core would halve both), the engines' environment on every host, and running as root
    (containers, CI) allowed.

    MPICH's Hydra already behaves so. Open MPI refuses more ranks than cores and running as root,
    binds each rank to a core, and passes environment variables to other hosts only when named
    with -x. Intel MPI pins each rank to cores unless I_MPI_PIN=0. Pure, so tested without MPI.
    """
    if implementation == "Open MPI":
        flags = ["--oversubscribe", "--bind-to", "none"]
        flags += ["--allow-run-as-root"] if as_root else []
        for name in env_names:
            flags += ["-x", name]
        return flags
    if implementation == "Intel MPI":
        return ["-genv", "I_MPI_PIN", "0"]
    return []


def launch_flags(exe: str | None = None) -> list[str]:
    """`mpiexec_flags` for the mpiexec found here and this process's environment."""
    names = [k for k in (*engine_env(), *PASSED_ENV) if k in os.environ or k in engine_env()]
    names += sorted(k for k in os.environ if k.startswith((settings.PREFIX, "HOROVOD_", "OMP_", "MPIR_CVAR_")))
    as_root = hasattr(os, "geteuid") and os.geteuid() == 0
    return mpiexec_flags(mpiexec_implementation(exe), list(dict.fromkeys(names)), as_root)


def mpiexec_command(n: int) -> list[str]:
    """`mpiexec -n N` for this Python's MPI, with the flags its implementation needs (mpiexec_flags)."""
    exe = find_mpiexec()
    return [exe, *launch_flags(exe), "-n", str(n)]


def secure_profile(profile_dir: str | os.PathLike) -> None:
    """Connection files hold the key that lets a process run code as you: owner-only modes.

    ipyparallel writes its ipcontroller-*.json 0600 but the cluster file with the umask; on a
    shared cluster file system that matters, so make the security folder 0700 and files 0600.
    """
    security = Path(profile_dir) / "security"
    if not security.is_dir():
        return
    os.chmod(security, 0o700)
    for f in security.iterdir():
        if f.is_file():
            os.chmod(f, 0o600)


_discover()

from hpdl.launchers.slurm import job_state, sbatch_template  # noqa: E402,F401  (kept importable from here)
