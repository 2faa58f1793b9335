"""The Launcher base class and the registry of launchers: imported by every launcher, importing none.

Why a module of its own: the package (`hpdl/launchers/__init__.py`) imports the kit's launchers to
register them, and they import `Launcher` from here, so no module ever imports a half-loaded one.

A launcher is found in two ways:
  * a subclass of `Launcher` with a `name` registers itself when it is defined (the kit's own
    local.py and slurm.py, a class in a notebook or a test);
  * an installed package names its launcher in the entry-point group `hpdl.launchers`
    (`pbs = "hpdl_pbs:Pbs"` in its pyproject.toml), so a site adds PBS or LSF without changing
    the kit. Entry points are read the first time anyone asks which launchers exist; one that
    does not load is reported by name and package and leaves the others working.
"""
from __future__ import annotations

import inspect
import logging
import os
import shlex
import warnings
from importlib import metadata
from pathlib import Path
from typing import ClassVar

from hpdl import settings
from hpdl.errors import HpdlError
from hpdl.launchers.mpiexec import mpiexec_command

log = logging.getLogger(__name__)

# The entry-point group a launcher package declares its class in: "hpdl.launchers", named after
# this package (spelt so, the layout test does not take the name for an import of it).
GROUP = __package__
_REGISTRY: dict[str, type[Launcher]] = {}
_PROBLEMS: dict[str, str] = {}  # entry-point name -> why its launcher is not available
_ENTRY_POINTS_READ = False


class Launcher:
    """One way of starting `n` engines as the ranks of one MPI job.

    Subclass it with a `name` and it is registered: hpdl.start(launcher=name) uses it, and
    launcher="auto" picks, among those whose `detect()` is true, the one with the highest
    `priority`. Only `configure` must be written; the rest has sensible defaults.
    """

    name: ClassVar[str] = ""         # what hpdl.start(launcher=...) and HPDL_LAUNCHER take (lowercase)
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

    def side_job_command(self, n: int, gpus: bool = True) -> list[str]:
        """How to start a separate short MPI job of `n` ranks here (append the program and its args).
        `gpus=False`: the job uses no GPU (tuning sweeps, probes), so a batch system may start it
        without asking for the ranks' GPUs, which the engines hold."""
        return mpiexec_command(n)

    def local_job_command(self, n: int) -> list[str]:
        """A short job of `n` ranks on this node only, outside the batch system: the checker's jobs,
        small, needing no other node, and sandboxed with no network (so no srun, no qsub in them).
        Start it with `local_job_env` of its environment. HpdlError where no local launcher exists."""
        return mpiexec_command(n)

    def local_job_env(self, env: dict[str, str]) -> dict[str, str]:
        """The environment for `local_job_command`: with what would make its MPI ask the batch
        system for the ranks removed (nothing by default; Slurm's variables in the Slurm launcher)."""
        return dict(env)


# -- entry points: launchers other packages provide ------------------------------------------------

def _package(ep: metadata.EntryPoint) -> str:
    """'hpdl-pbs 1.0' for the message about a broken entry point (the module when unknown)."""
    try:
        name, version = ep.dist.name, ep.dist.version
    except Exception:  # no dist recorded, or a *.dist-info without METADATA
        name = version = None
    if name:
        return f"{name} {version}" if version else name
    return ep.value.split(":")[0].split(".")[0]


def _load(ep: metadata.EntryPoint) -> str | None:
    """Import one entry point's launcher and register it; why not, worded for whoever installed it."""
    package = _package(ep)
    where = f"launcher {ep.name!r} (entry point `{ep.name} = {ep.value}` of the package {package})"
    before = dict(_REGISTRY)
    try:
        cls = ep.load()
    except Exception as exc:  # any error in someone else's package: reported, never raised
        problem = f"{where} did not load: {type(exc).__name__}: {exc}."
    else:
        if not (isinstance(cls, type) and issubclass(cls, Launcher)):
            problem = f"{where} names {cls!r}, which is not a subclass of hpdl.launchers.Launcher."
        elif cls.name != ep.name:
            problem = f"{where} names a class whose name is {cls.name!r}: give both the same name."
        elif before.get(ep.name, cls) is not cls:
            taken = before[ep.name]
            problem = f"{where} takes the name of {taken.__module__}.{taken.__qualname__}: rename one of them."
        else:
            _REGISTRY[ep.name] = cls
            return None
    _REGISTRY.clear()  # whatever the broken package registered while it was imported goes again
    _REGISTRY.update(before)
    return (f"{problem} The other launchers work; fix or reinstall that package, or remove it "
            f"(pip uninstall {package.split()[0]}). See docs/LAUNCHERS.md.")


def load_entry_points(again: bool = False) -> None:
    """Register the launchers installed packages declare in the `hpdl.launchers` group, once per
    process (`again` reads them anew, e.g. after a pip install in a running kernel)."""
    global _ENTRY_POINTS_READ
    if _ENTRY_POINTS_READ and not again:
        return
    _ENTRY_POINTS_READ = True
    try:
        found = metadata.entry_points(group=GROUP)
    except Exception as exc:  # a damaged *.dist-info on sys.path
        found = []
        log.warning("could not read the installed packages' %s entry points: %s", GROUP, exc)
    for ep in found:
        problem = _load(ep)
        if problem:
            _PROBLEMS[ep.name] = problem
            log.warning("%s", problem)
            warnings.warn(f"hpdl: {problem}", RuntimeWarning, stacklevel=3)
        else:
            _PROBLEMS.pop(ep.name, None)


def problems() -> dict[str, str]:
    """Launchers installed packages declare but that could not be loaded: name -> what to do."""
    load_entry_points()
    return dict(_PROBLEMS)


# -- the registry ----------------------------------------------------------------------------------

def known() -> list[str]:
    """The launcher names hpdl.start() accepts (besides 'auto')."""
    load_entry_points()
    return sorted(_REGISTRY)


def get(name: str) -> Launcher:
    """The launcher called `name` (not 'auto': see resolve); HpdlError listing the known ones."""
    load_entry_points()
    key = (name or "").lower()
    cls = _REGISTRY.get(key)
    if cls is None:
        if key in _PROBLEMS:
            raise HpdlError(_PROBLEMS[key])
        raise HpdlError(
            f"launcher={name!r} is not one we know; use one of {', '.join(known())} or 'auto'. "
            f"A site's launcher is a package of its own that declares it in the {GROUP!r} entry-point "
            "group (see docs/LAUNCHERS.md); is it installed in this Python?"
        )
    return cls()


def detected() -> Launcher:
    """The launcher that fits where this Python runs, ignoring HPDL_LAUNCHER. A launcher whose
    detect() fails is passed over (and logged), so one broken package cannot stop the others."""
    load_entry_points()
    for cls in sorted(_REGISTRY.values(), key=lambda c: -c.priority):
        launcher = cls()
        try:
            here = launcher.detect()
        except Exception as exc:
            log.warning("launcher %r (%s): detect() failed, passed over: %s", cls.name, cls.__module__, exc)
            continue
        if here:
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
    """Ranks hpdl.start() starts with no n given (Slurm: the allocation's tasks)."""
    return get(launcher).default_n()


def configure(launcher: str, config, n: int) -> dict:
    """Fill `config` for `launcher`; returns keyword arguments for ipyparallel.Cluster."""
    return get(launcher).configure(config, n)


def describe(launcher: str) -> str:
    """One line for `hpdl doctor`."""
    return get(launcher).describe()


def side_job_command(n: int, gpus: bool = True) -> list[str]:
    """How to start a separate short MPI job of `n` ranks from here, e.g. a check.

    Locally the venv's `mpiexec -n N`; inside a Slurm allocation `srun --overlap ... -n N`, which
    runs beside the engines' step instead of waiting for its CPUs (an mpiexec there would itself
    go through srun and queue behind the engines). `gpus=False` for a job that uses no GPU (see
    Launcher.side_job_command). Append the program and its arguments."""
    launcher = detected()
    if gpus or "gpus" not in inspect.signature(launcher.side_job_command).parameters:
        return launcher.side_job_command(n)  # a site's launcher written before `gpus` existed
    return launcher.side_job_command(n, gpus=False)


def local_job_command(n: int) -> list[str]:
    """How to start a short job of `n` ranks on this node only, outside any batch system: a check's
    two jobs. Everywhere the local `mpiexec -n N`; inside a Slurm allocation too, its ranks forked
    here (not an srun step: the learner's job runs in a sandbox with no network, where srun cannot
    reach slurmctld). Start it with `local_job_env(env)`. HpdlError where this Python's MPI has no
    mpiexec (Cray MPICH): then only `side_job_command` starts ranks."""
    return detected().local_job_command(n)


UCX_SHARED_MEMORY = ("sm", "shm", "posix", "sysv", "cma", "xpmem", "knem", "all")


def local_job_env(env: dict[str, str]) -> dict[str, str]:
    """`env` for a `local_job_command` job: inside a Slurm allocation without SLURM_*, PMI_*, PMIX_*
    (else the MPI would see the outer job and start its ranks through srun, or as its step's).
    Its ranks share this node and, sandboxed, have no network: a UCX_TLS naming no shared-memory
    transport (emulated nodes' `tcp,self`) would leave them unable to reach each other, so UCX
    chooses for itself there."""
    env = detected().local_job_env(env)
    tls = env.get("UCX_TLS", "")
    if tls and not tls.startswith("^") and not set(tls.replace(" ", "").split(",")) & set(UCX_SHARED_MEMORY):
        del env["UCX_TLS"]
    return env


def job_command(n: int) -> str:
    """The shell command that starts an `n`-rank MPI job from here, for a notebook's `!` line.

    A lesson shows it rather than a bare `mpiexec`: on a laptop it is this venv's mpiexec with
    the flags its MPI needs; inside a Slurm job (JupyterLab from Open OnDemand, the workshop hub,
    jupyter.sbatch) an `srun --overlap` step, because an mpiexec there would go through srun and
    wait for the CPUs the engines hold. Append the program: `!{hpdl.job_command(2)} python x.py`."""
    return shlex.join(side_job_command(n))


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
