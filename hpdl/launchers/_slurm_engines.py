"""ipyparallel's side of the Slurm launcher: the two engine-set classes it starts and stops.

Kept apart from slurm.py because importing ipyparallel is slow and only needed once engines
start. ipyparallel records these classes by import path in its cluster files.
"""
from __future__ import annotations

import os
import shlex
import subprocess
import threading
import time

from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
from traitlets import Any, CRegExp, Integer

from hpdl import settings
from hpdl.errors import HpdlError
from hpdl.launchers.base import secure_profile
from hpdl.launchers._slurm_queue import cancel_and_wait, job_state, step_of
from hpdl.sites import rank_wrapper


def _exports(environment: dict) -> dict[str, str]:
    """The engines' variables (the learner's included) that a rank's prologue must not override."""
    return {k: str(v) for k, v in environment.items() if k != "PATH"}


class SrunEngineSetLauncher(MPIEngineSetLauncher):
    """Engines as one `srun` step of the allocation this kernel runs in."""

    site = Any(None, config=True, help="the hpdl.sites.SlurmSite in force")

    @property
    def program(self):
        prefix = rank_wrapper(self.site, _exports(self.environment).keys()) if self.site else []
        wrap = list(self.site.wrap) if self.site else []
        return prefix + wrap + self.engine_cmd + ["--mpi"]

    def find_args(self):
        # name the step after the cluster so it can be found (and cancelled) by name
        cmd = super().find_args()
        return cmd[:1] + [f"--job-name={self.cluster_id}"] + cmd[1:]

    def start(self, n):
        secure_profile(self.profile_dir)
        return super().start(n)

    @property
    def job_id(self) -> str | None:
        """JOB.STEP of the engines' step, for scancel should the kernel die."""
        if getattr(self, "_step", None) is None and self.state == "running":
            self._step = step_of(os.environ.get("SLURM_JOB_ID", ""), self.cluster_id)
        return getattr(self, "_step", None)


class SbatchEngineSetLauncher(SlurmEngineSetLauncher):
    """Engines as one submitted batch job; notices when the job ends or is cancelled."""

    site = Any(None, config=True, help="the hpdl.sites.SlurmSite in force")
    job_id_regexp = CRegExp(r"Submitted batch job (\d+)")
    job_id_regexp_group = Integer(1)
    poll_seconds = 2.0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        # the script beside the engines' log, not in the notebook's folder
        self.batch_file = os.path.join(self.profile_dir, "log", f"{self.cluster_id}-engines.sbatch")

    def _run_command(self, command, **kwargs):
        # ipyparallel's version lets sbatch's stderr (the reason it refused) go to the terminal
        p = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, **kwargs)
        if p.returncode != 0 and command[:1] == self.submit_command[:1]:
            site = settings.SITE.get()
            raise HpdlError(
                f"sbatch refused the engines' job: {(p.stderr or p.stdout).strip()}\n"
                "Check the partition/account/time settings (HPDL_SLURM_* variables"
                + (f" or the site profile {site}" if site else ", or a site profile via HPDL_SITE")
                + "). It asked for:\n    " + "\n    ".join(self._directives())
            )
        return p.stdout

    def _directives(self) -> list[str]:
        try:
            with open(self.batch_file) as f:
                return [line.strip() for line in f if line.startswith("#SBATCH")]
        except OSError:
            return []

    def start(self, n=1):
        secure_profile(self.profile_dir)
        os.makedirs(os.path.dirname(self.batch_file), exist_ok=True)
        exports = _exports(self.environment)
        prefix = rank_wrapper(self.site, exports.keys()) if self.site else []
        self.namespace = {**self.namespace,
                          "hpdl_exports": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in exports.items()),
                          "hpdl_rank_prefix": shlex.join(prefix)}
        job = super().start(n)
        self.queue_state = "PENDING"
        threading.Thread(target=self._watch, daemon=True, name=f"hpdl-watch-{job}").start()
        return job

    def _watch(self) -> None:
        """Mark the engines stopped as soon as Slurm no longer lists the job: every 2 s
        while it queues and starts, every 30 s once it has run a while (squeue is shared)."""
        running_since = None
        while self.state == "running":
            state = job_state(self.job_id)
            if state is None:
                self.notify_stop({"job_id": self.job_id, "state": self.queue_state})
                return
            if state:
                self.queue_state = state
            if state == "RUNNING" and running_since is None:
                running_since = time.monotonic()
            settled = running_since is not None and time.monotonic() - running_since > 60
            time.sleep(30 if settled else self.poll_seconds)

    def signal(self, sig):
        subprocess.run(["scancel", "-s", str(sig), str(self.job_id)], capture_output=True, timeout=30)

    def stop(self):
        """Cancel the job and wait (bounded) until it has left the queue."""
        if self.job_id:
            cancel_and_wait([self.job_id], 30)
        return self.notify_stop({"job_id": self.job_id})
