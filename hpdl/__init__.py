"""hpdl: a hands-on kit for high-performance distributed deep learning.

A notebook needs only these names:

    import hpdl
    hpdl.start(n=4)        # engines that are MPI ranks; %%px runs a cell on every rank
    hpdl.check("ring_allreduce", ring_allreduce)   # autograded check on fresh ranks
    hpdl.panel()           # a live table of the ranks: state, line, last step, memory
    !{hpdl.job_command(2)} python train.py   # a separate 2-rank job (mpiexec here, srun on Slurm)
    hpdl.run_job([...], timeout=120)          # such a job from code: at its limit, all of it ends
    hpdl.stop()

and the helper modules hpdl.data, hpdl.models, hpdl.plots, hpdl.bench, hpdl.predict, hpdl.tune (imported on first use).
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from hpdl.checker.report import CheckResult

__version__ = "0.1.0"

_FUNCTIONS = {
    "start": "hpdl.cluster",
    "stop": "hpdl.cluster",
    "restart": "hpdl.cluster",
    "status": "hpdl.cluster",
    "view": "hpdl.cluster",
    "nodes_missing": "hpdl.cluster",
    "job_command": "hpdl.launchers",
    "run_job": "hpdl.sidejob",
}
_MODULES = {"data", "models", "plots", "bench", "dp", "timeline", "predict", "published", "tune", "panel"}

__all__ = sorted([*_FUNCTIONS, "check"]) + sorted(_MODULES)


def check(name: str, fn: Callable | None = None, *, ranks: int | list[int] | None = None,
          grade: bool | None = None, timeout: float | None = None,
          cases: str | list[str] | None = None) -> CheckResult:
    """Check the learner's function for exercise `name` on real MPI ranks.

    fn: the function; None fetches the function called `name` from rank 0 of the running
        cluster (defined under %%px), or else from the notebook's own namespace.
    ranks: rank counts to check (an int or a list); default: the exercise's own, e.g. 1–4.
    grade: also run hidden cases (default: the HPDL_GRADE environment variable).
    timeout: seconds per case before it counts as a HANG (default: the exercise's, 5 s).
    cases: only the cases whose names hold this text (or any of these), e.g. the one that failed, to
        run it again quickly while you mend it; the result says what was left out. Not when grading.
    Returns a CheckResult: a table in JupyterLab; `.verdicts`, `.score`, `.cases` in code.

    A plain function here, not in the checker package (hpdl.checker): the check jobs on every
    rank import that package, and `import hpdl` must stay light for them.
    """
    import sys

    from hpdl.checker.client import run_check

    return run_check(name, fn, ranks=ranks, grade=grade, timeout=timeout, cases=cases, caller=sys._getframe(1))


def __getattr__(name: str):
    # Imported on first use so `import hpdl` stays quick and engines never pull in the client.
    if name in _FUNCTIONS:
        return getattr(importlib.import_module(_FUNCTIONS[name]), name)
    if name in _MODULES:
        return importlib.import_module(f"hpdl.{name}")
    raise AttributeError(f"module 'hpdl' has no attribute {name!r}")


def _hpdl_line_magic(line: str):
    """%hpdl start [-n N] [--launcher L] [--frameworks torch,horovod] | stop | restart | status | panel"""
    from hpdl.magics import hpdl_magic

    return hpdl_magic(line)


def _register_magic() -> None:
    # In a notebook, `import hpdl` is enough for `%hpdl start -n 4` to work.
    import sys

    if "IPython" not in sys.modules:
        return
    try:
        ip = sys.modules["IPython"].get_ipython()
        if ip is not None and "hpdl" not in ip.magics_manager.magics["line"]:
            from hpdl.errors import install_handler

            ip.register_magic_function(_hpdl_line_magic, "line", "hpdl")
            install_handler(ip)
    except Exception as exc:  # a shell without magics: `import hpdl` must still work
        import logging

        logging.getLogger(__name__).debug("%%hpdl not registered: %s", exc)


def _finalize_mpi_first_at_exit() -> None:
    # A kernel that imported mpi4py started MPI alone; finalized first at exit, its MPICH segment
    # goes even when the kernel dies later in its shutdown (hpdl.procs.finalize_singleton_mpi).
    import atexit
    import sys

    if "IPython" in sys.modules and sys.modules["IPython"].get_ipython() is not None:
        atexit.register(_finalize_mpi)


def _finalize_mpi() -> None:
    from hpdl.procs import finalize_singleton_mpi

    finalize_singleton_mpi()


_register_magic()
_finalize_mpi_first_at_exit()


def load_ipython_extension(ip) -> None:
    """`%load_ext hpdl` registers the %hpdl magic (start/stop/status/check)."""
    from hpdl.magics import register

    register(ip)
