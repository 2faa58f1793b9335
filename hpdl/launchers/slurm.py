"""The engines as ranks of one Slurm job: an `srun` step inside an allocation, else a submitted job.

Two ways onto Slurm, chosen by where the kernel runs:
  inside an allocation (SLURM_JOB_ID set: JupyterLab started by jupyter.sbatch or Open OnDemand,
    or under salloc) -> the engines are one `srun --mpi=pmi2 -n N` step of that job, asking for
    the resources per task the job holds (SLURM_CPUS_PER_TASK, ...), never more;
  outside one (a login node) -> the engines are one submitted batch job whose script runs
    `srun --mpi=pmi2 ipengine --mpi`, the job and the step asking for the same resources, both
    from the site profile; the kernel waits while it queues.
Either way every rank runs the site profile's prologue (modules, set-up, [env], MPI library)
before its engine, and the controller binds the one address engines are told to reach (that of
`controller_host`, else this host's name), not every interface.
"""
from __future__ import annotations

import os
import shlex
import shutil
import socket
import warnings

from hpdl.errors import HpdlError
from hpdl.launchers.base import Launcher
from hpdl.launchers.mpiexec import local_mpiexec_command, mpiexec_command
from hpdl.launchers._slurm_queue import cancel_job, job_state, step_of  # noqa: F401  (importable from here)
from hpdl.sites import (SlurmSite, job_resource_options, load_site, outward_address, rank_wrapper, resource_mismatch,
                        resource_options)

# A step started inside a job hands the ranks this process's whole environment (the kit's venv on
# PATH, HPDL_*, the learner's hpdl.start(env=...)). Without it srun exports what SLURM_EXPORT_ENV
# names, and a job submitted with `sbatch --export=NONE` or `--export=LIST` (batchspawner's
# SlurmSpawner, many sites' advice) sets that for every step in it: the ranks would start with no
# PATH at all (slurmstepd: "execve(): bash: No such file or directory").
STEP_EXPORT = "--export=ALL"

# What tells a process it runs in a Slurm job, or is a rank of one of its steps: a job for this
# node only (a check's) starts without them, else its MPI starts the ranks through srun (Hydra,
# Open MPI) or takes them for the outer step's (PMI, PMIx). With them go the variables a site's
# module sets so that MPI uses srun or Slurm's PMI library (I_MPI_PMI_LIBRARY, HYDRA_LAUNCHER, ...).
BATCH_ENV_PREFIXES = ("SLURM_", "SLURMD_", "SRUN_", "PMI_", "PMIX_")
BATCH_ENV_NAMES = frozenset({"HYDRA_RMK", "HYDRA_LAUNCHER", "HYDRA_HOST_FILE", "HYDRA_BOOTSTRAP",
                             "I_MPI_HYDRA_BOOTSTRAP", "I_MPI_HYDRA_RMK", "I_MPI_HYDRA_HOST_FILE",
                             "I_MPI_PMI_LIBRARY", "I_MPI_PMI", "MPIEXEC_LAUNCHER"})


class Slurm(Launcher):
    name = "slurm"
    label = "Slurm"
    priority = 10
    queue_hint = "On Slurm the job may still be queued (see `squeue --me`); "

    @staticmethod
    def inside() -> bool:
        """True in a Slurm allocation (a batch job, salloc, an Open OnDemand session)."""
        return bool(os.environ.get("SLURM_JOB_ID"))

    def detect(self) -> bool:
        return self.inside() and shutil.which("srun") is not None

    def default_n(self) -> int:
        tasks = os.environ.get("SLURM_NTASKS", "")
        if self.inside() and tasks.isdigit():
            return int(tasks)
        return super().default_n()

    def describe(self) -> str:
        if self.inside():
            return f"srun in Slurm job {os.environ['SLURM_JOB_ID']}"
        return "sbatch: the ranks as one submitted Slurm job"

    def cancel(self, job_id: str) -> None:
        cancel_job(job_id)

    def side_job_command(self, n: int, gpus: bool = True) -> list[str]:
        """Inside an allocation: an srun step sharing the CPUs (--overlap) with the engines' step,
        which holds them all; outside, this machine's mpiexec. A job without GPUs asks for none
        (--gres=none): before Slurm 22.05 --overlap shares CPUs only, so a step that asked for the
        job's GPUs would queue behind the engines that hold them."""
        if not self.detect():
            return mpiexec_command(n)
        site = load_site()
        return ["srun", "--overlap", f"--mpi={site.pmi}", "--kill-on-bad-exit=1", "--job-name=hpdl-side",
                "-n", str(n), *([] if gpus else ["--gres=none"]), STEP_EXPORT, *rank_wrapper(site)]

    def local_job_command(self, n: int) -> list[str]:
        """This node's mpiexec, its ranks forked here, also inside an allocation: a check's jobs
        are small and sandboxed with no network, so never an srun step (which needs slurmctld).
        The site prologue is not run: the ranks run this Python's own MPI, as on a laptop."""
        return local_mpiexec_command(n)

    def local_job_env(self, env: dict[str, str]) -> dict[str, str]:
        """`env` without the outer job's Slurm, PMI and PMIx variables (BATCH_ENV_PREFIXES)."""
        return {k: v for k, v in env.items() if not (k.startswith(BATCH_ENV_PREFIXES) or k in BATCH_ENV_NAMES)}

    def configure(self, config, n: int) -> dict:
        if not shutil.which("srun") or not shutil.which("sbatch"):
            raise HpdlError(
                "launcher='slurm' needs Slurm's commands (srun, sbatch) and none are on PATH. On a "
                "cluster, `module load slurm` (or ask your admins); here, use launcher='local'."
            )
        site = load_site()
        inside = self.inside()
        kwargs = {"controller_ip": controller_address(site, inside),
                  "controller_location": (not inside and site.controller_host) or socket.gethostname()}
        if inside:
            kwargs.update(self._configure_step(config, n, site))
        else:
            from hpdl.launchers._slurm_engines import SbatchEngineSetLauncher

            config.SbatchEngineSetLauncher.batch_template = sbatch_template(site)
            config.SbatchEngineSetLauncher.site = site
            kwargs.update(engines=SbatchEngineSetLauncher, start_timeout=site.start_timeout or 900)
        return kwargs

    def _configure_step(self, config, n: int, site: SlurmSite) -> dict:
        from hpdl.launchers._slurm_engines import SrunEngineSetLauncher

        tasks = os.environ.get("SLURM_NTASKS")
        if tasks and tasks.isdigit() and n > int(tasks):
            raise HpdlError(
                f"This Slurm allocation (job {os.environ['SLURM_JOB_ID']}) has {tasks} tasks, fewer than "
                f"n={n} ranks. Start with hpdl.start(n={tasks}) or ask for more tasks (sbatch -n {n})."
            )
        short = resource_mismatch(site)
        if short:
            warnings.warn(
                f"hpdl: the site profile {site.name} asks per rank for {short}; the ranks get what the job "
                f"holds. Submit the job with the profile's options: `sbatch $(python -m hpdl.sites --sbatch) "
                f"-n {n} ...`.", stacklevel=4)
        args = ["--kill-on-bad-exit=1", STEP_EXPORT]
        if os.environ.get("SLURM_STEP_ID"):  # the kernel itself runs in a step: share its CPUs
            args.append("--overlap")
        config.SrunEngineSetLauncher.mpi_cmd = ["srun", f"--mpi={site.pmi}"]
        config.SrunEngineSetLauncher.mpi_args = args + job_resource_options() + site.srun
        config.SrunEngineSetLauncher.site = site
        return {"engines": SrunEngineSetLauncher, "start_timeout": site.start_timeout or 120 + 5 * n}


def step_command(site: SlurmSite | None = None) -> list[str]:
    """Inside a job: an srun step over the job's tasks, asking for what the job holds, each task
    running the site prologue first. run.sbatch runs scripts with it: `python -m hpdl.launchers srun CMD...`."""
    site = site or load_site()
    return ["srun", f"--mpi={site.pmi}", "--kill-on-bad-exit=1", STEP_EXPORT, *job_resource_options(), *site.srun,
            *rank_wrapper(site)]


def controller_address(site: SlurmSite, inside: bool = False) -> str:
    """The address the controller binds and engines connect to: `controller_host`'s (else this
    host's name's), the first that is not loopback when it has several. `controller_host` names
    the login node: inside an allocation (a hub's or Open OnDemand's kernel) the controller runs
    on the job's compute node, so it is that node's own name's, whatever the profile says."""
    host = (not inside and site.controller_host) or socket.gethostname()
    try:
        return outward_address(host)
    except socket.gaierror as exc:
        raise HpdlError(
            f"controller_host {host!r} does not resolve here ({exc}); set slurm.controller_host in the site "
            "profile (or HPDL_SLURM_CONTROLLER_HOST) to a name or address of this machine."
        ) from None


def _fmt_escape(text: str) -> str:
    """ipyparallel fills the batch template with str.format: keep the site's braces literal."""
    return text.replace("{", "{{").replace("}", "}}")


def sbatch_template(site: SlurmSite) -> str:
    """The engines' batch script, with ipyparallel's {n}, {cluster_id}, {output_file},
    {program} and {program_args} left for it to fill in, and our {hpdl_exports} (the learner's
    variables) and {hpdl_rank_prefix} (the site's per-rank prologue, see sites.rank_wrapper)."""
    opts = ["--job-name={cluster_id}", "--ntasks={n}", "--output={output_file}", "--export=ALL"]
    for flag, value in (("partition", site.partition), ("account", site.account), ("qos", site.qos),
                        ("reservation", site.reservation), ("time", site.time)):
        if value:
            opts.append(f"--{flag}={_fmt_escape(str(value))}")
    resources = resource_options(site)  # the job and its step ask for the same
    opts += resources + [_fmt_escape(o) for o in site.sbatch]
    lines = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in opts]
    lines += [
        f"# hpdl engines for a notebook kernel on {socket.gethostname()}; hpdl.stop() cancels this job.",
        f"# site profile: {_fmt_escape(site.source)}",
        "{hpdl_exports}",  # hpdl.start(env=...): the learner's settings
        "echo \"hpdl: job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NODELIST\"",
    ]
    srun = ["srun", f"--mpi={site.pmi}", "--kill-on-bad-exit=1", STEP_EXPORT, *resources]
    srun += [shlex.quote(_fmt_escape(a)) for a in site.srun]
    wrap = " ".join(shlex.quote(_fmt_escape(w)) for w in site.wrap)
    srun.append("{hpdl_rank_prefix}" + (f" {wrap}" if wrap else ""))
    lines.append(" ".join(srun) + " {program} --mpi {program_args}")
    return "\n".join(lines) + "\n"
