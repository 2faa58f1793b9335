"""The checker: run a learner's function on fresh MPI ranks and say, per case, how it went.

    hpdl.check("ring_allreduce", ring_allreduce)   # a function defined in the notebook
    hpdl.check("ring_allreduce")                   # one defined under %%px: fetched from rank 0

Each rank count gets its own `mpiexec` job (runner.py launches them side by side, worker.py
runs on each rank), so a deadlock never touches the learner's engines. Every case ends as
PASS, WRONG, ERROR, HANG or SLOW (see report.py); the cases of each exercise live in
cases/<exercise>.py (API in cases/__init__.py), the checks on *how* in hooks.py.

Grade mode (grade=True, or HPDL_GRADE=1) adds the hidden cases. With HPDL_GRADE_RESULTS set
to a file, each result is also appended there as a JSON line (that is how `hpdl grade`
collects checks from a notebook it runs, and how the tests see that solutions score full marks).

This package is imported by the check workers on every rank too, so it stays light: the
client machinery is imported inside check().
"""
from __future__ import annotations

import os
import sys
import types
from typing import Callable

_TRUE = ("1", "true", "yes", "on")


def check(name: str, fn: Callable | None = None, *, ranks=None, grade: bool | None = None,
          timeout: float | None = None):
    """Check the learner's function for exercise `name` on real MPI ranks.

    fn: the function; None fetches the function called `name` from rank 0 of the running
        cluster (defined under %%px), or else from the notebook's own namespace.
    ranks: rank counts to check (an int or a list); default: the exercise's own, e.g. 1–4.
    grade: also run hidden cases (default: the HPDL_GRADE environment variable).
    timeout: seconds per case before it counts as a HANG (default: the exercise's, 5 s).
    Returns a CheckResult: a table in JupyterLab; `.verdicts`, `.score`, `.cases` in code.
    """
    from hpdl.check.run import run_check

    return run_check(name, fn, ranks=ranks, grade=grade, timeout=timeout, caller=sys._getframe(1))


def grade_mode(grade: bool | None = None) -> bool:
    if grade is not None:
        return bool(grade)
    return os.environ.get("HPDL_GRADE", "").strip().lower() in _TRUE


class _CallableModule(types.ModuleType):
    """`hpdl.check` is both this package and the function: once the package is imported,
    Python binds the attribute `hpdl.check` to the package, so calling it must still work."""

    def __call__(self, name: str, fn: Callable | None = None, **kwargs):
        from hpdl.check.run import run_check

        return run_check(name, fn, caller=sys._getframe(1), **kwargs)


sys.modules[__name__].__class__ = _CallableModule
