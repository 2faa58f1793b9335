"""Client side: the command line of a check's MPI jobs.

jobs.py runs two jobs per rank count (the learner's ranks and the checker's reference ranks) as
side jobs (hpdl.sidejob); their command comes from here, through `launchers.side_job_command`,
so a new launcher changes nothing here.
"""
from __future__ import annotations

import sys


def job_command(size: int, module: str, job_dir: str) -> list[str]:
    """The command line of one check job: `size` ranks of `python -m <module> <job_dir>`.

    Started the way the launcher in use starts a side job: this machine's mpiexec, or inside a
    Slurm allocation an srun step that overlaps the engines' step instead of queueing behind it."""
    from hpdl.launchers import side_job_command

    return [*side_job_command(size), sys.executable, "-m", module, job_dir]


__all__ = ["job_command"]
