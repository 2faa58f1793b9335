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
    meter.py          the caller: for METERED exercises, the bytes each learner rank sent, from the kernel
    rank_job.py       both jobs' ranks: events, stack reports, barriers, never outliving the caller
    wire.py           the learner's outputs as plain data, read back without running their code
    sandbox.py        bubblewrap + rlimits around untrusted processes
    grade_service.py  under `hpdl grade`: the kernel asks the grader to check; the grader decides
    report.py         Verdict, CaseResult, CheckResult and their tables
    cases/            one module per exercise (API and its validation in cases/__init__.py)

Every case ends as a report.Verdict: PASS, WRONG, ERROR, HANG or SLOW; a WRONG that broke a
rule of the exercise carries CaseResult.rejected. Grade mode (grade=True, or HPDL_GRADE=1)
adds the hidden cases; set by the environment, it also ignores ranks= and timeout=.

This package is imported by the check jobs on every rank too, so it stays light. The learner's
call, hpdl.check(), is a plain function in hpdl/__init__.py: a package called hpdl.check would
rebind that attribute to itself on its first import.
"""
from __future__ import annotations


from hpdl import settings


def grade_mode(grade: bool | None = None) -> bool:
    if grade is not None:
        return bool(grade)
    return settings.GRADE.get()
