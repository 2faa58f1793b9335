"""Client side: how engines become MPI ranks — one `Launcher` class per way of starting them.

`hpdl.cluster` decides when to start and stop; a launcher says how: whether it is the one to use
(`detect`), how many ranks by default, how to fill in ipyparallel's configuration, a one-line
description, how to cancel a job it submitted, and how to start a separate short MPI job beside
the engines (checks, doctor). The kit ships two (local.py: `mpiexec`; slurm.py: `srun`/`sbatch`);
a site adds PBS or LSF as a package of its own that declares its class in the `hpdl.launchers`
entry-point group — see docs/LAUNCHERS.md. The class and the registry live in base.py, which
imports no launcher, so this package imports its launchers and they never import it back.
Site profiles (partition, modules, resources per rank) live in hpdl/sites.py.
"""
from __future__ import annotations

from hpdl.launchers.base import (  # noqa: F401  (_REGISTRY: tests add and remove launchers)
    _REGISTRY,
    GROUP,
    Launcher,
    configure,
    default_n,
    describe,
    detected,
    get,
    job_command,
    known,
    load_entry_points,
    local_job_command,
    local_job_env,
    problems,
    resolve,
    secure_profile,
    side_job_command,
)
from hpdl.launchers.local import Local
from hpdl.launchers.mpiexec import (  # noqa: F401  (_IMPLEMENTATION: tests clear what was learnt)
    _IMPLEMENTATION,
    PASSED_ENV,
    REMOTE_SHELL_HERE,
    engine_env,
    find_mpiexec,
    launch_flags,
    local_flags,
    local_mpiexec_command,
    mpiexec_command,
    mpiexec_flags,
    mpiexec_implementation,
    nodes_apart,
)
from hpdl.launchers.slurm import Slurm, job_state, sbatch_template
from hpdl.sites import SITES_DIR, SlurmSite, load_site

__all__ = [
    "GROUP", "Launcher", "Local", "PASSED_ENV", "SITES_DIR", "Slurm", "SlurmSite", "configure", "default_n",
    "describe", "detected", "engine_env", "find_mpiexec", "get", "job_command", "job_state", "known",
    "launch_flags", "load_entry_points", "load_site", "local_flags", "local_job_command", "local_job_env",
    "local_mpiexec_command", "mpiexec_command", "mpiexec_flags",
    "mpiexec_implementation", "problems", "resolve", "sbatch_template", "secure_profile", "side_job_command",
]
