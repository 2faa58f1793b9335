"""The checker: run a learner's function on fresh MPI ranks and say, per case, how it went.

    hpdl.check("ring_allreduce", ring_allreduce)   # a function defined in the notebook
    hpdl.check("ring_allreduce")                   # one defined under %%px: fetched from rank 0

Which side each module runs on:

    client.py         the caller (the learner's kernel, or the grader): find the function, plan, report
    jobs.py           the caller: per rank count, the learner's job and the reference job, verdicts
    runner.py         the caller: the one spot that launches a check's MPI jobs
    learner_job.py    the learner's ranks (sandboxed where possible): inputs, the learner's function,
                      recording.py (every MPI/torch.distributed call noted, forbidden ones refused)
    reference_job.py  the checker's ranks: reference(), then verify()/diagnose() on the learner's outputs
    rank_job.py       both jobs' ranks: events, stack reports, barriers, never outliving the caller
    wire.py           the learner's outputs as plain data, read back without running their code
    sandbox.py        bubblewrap + rlimits around untrusted processes
    grade_service.py  under `hpdl grade`: the kernel asks the grader to check; the grader decides
    report.py         Verdict, CaseResult, CheckResult and their tables
    cases/            one module per exercise (API and its validation in cases/__init__.py)

Every case ends as a report.Verdict: PASS, WRONG, ERROR, HANG or SLOW; a WRONG that broke a
rule of the exercise carries CaseResult.rejected. Grade mode (grade=True, or HPDL_GRADE=1)
adds the hidden cases; set by the environment, it also ignores ranks= and timeout=.

This package is imported by the check jobs on every rank too, so it stays light: the client
machinery is imported inside check().
"""
from __future__ import annotations

import sys
import types
from typing import Callable

from hpdl import settings


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
    from hpdl.check.client import run_check

    return run_check(name, fn, ranks=ranks, grade=grade, timeout=timeout, caller=sys._getframe(1))


def grade_mode(grade: bool | None = None) -> bool:
    if grade is not None:
        return bool(grade)
    return settings.GRADE.get()


class _CallableModule(types.ModuleType):
    """`hpdl.check` is both this package and the function: once the package is imported,
    Python binds the attribute `hpdl.check` to the package, so calling it must still work."""

    def __call__(self, name: str, fn: Callable | None = None, **kwargs):
        from hpdl.check.client import run_check

        return run_check(name, fn, caller=sys._getframe(1), **kwargs)


sys.modules[__name__].__class__ = _CallableModule
