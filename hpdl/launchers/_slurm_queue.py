"""What Slurm's queue says about a job, and cancelling it: shared by the Slurm launcher and
its ipyparallel engine sets (kept apart so neither imports the other)."""
from __future__ import annotations

import subprocess
import time


def cancel_job(job_id: str) -> None:
    subprocess.run(["scancel", str(job_id)], capture_output=True, timeout=30)


def still_listed(job_ids, seconds: float) -> list[str]:
    """Wait (bounded, monotonic) until Slurm lists none of `job_ids` as live; the ids still listed."""
    deadline, left = time.monotonic() + seconds, [str(j) for j in job_ids]
    while True:
        left = [j for j in left if job_state(j) not in (None, "CANCELLED", "COMPLETED")]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.3)


def cancel_and_wait(job_ids, seconds: float = 30.0) -> list[str]:
    """scancel each job, then wait until Slurm lists none of them; the ids still listed."""
    for job in job_ids:
        cancel_job(job)
    return still_listed(job_ids, seconds)


def _squeue(*args: str) -> tuple[int, str]:
    try:
        p = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return p.returncode, p.stdout.strip() or p.stderr.strip()


def job_state(job_id: str) -> str | None:
    """'PENDING', 'RUNNING', ... while Slurm lists the job; None once it has left the queue;
    '' when squeue could not answer (the controller busy: ask again later)."""
    rc, out = _squeue("-j", str(job_id), "-o", "%T")
    if rc == 0:
        return out.splitlines()[0] if out else None
    return None if "Invalid job id" in out else ""


def step_of(job_id: str, step_name: str) -> str | None:
    """JOB.STEP of the step called `step_name` in job `job_id`, if Slurm lists it."""
    rc, out = _squeue("-s", "-j", str(job_id), "-o", "%i %j")
    for line in out.splitlines() if rc == 0 else []:
        step, _, name = line.partition(" ")
        if name.strip() == step_name:
            return step
    return None
