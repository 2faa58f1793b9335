"""Client side: how engines become MPI ranks — `mpiexec` here, `srun` on Slurm.

Each launcher fills in the ipyparallel configuration for one way of starting engines.
`hpdl.cluster` decides when to start and stop; this module only says how.
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from hpdl.errors import HpdlError

LAUNCHERS = ("local", "slurm")


def find_mpiexec() -> str:
    """The mpiexec that belongs to this Python's MPI (the venv's first), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise HpdlError(
        "No mpiexec found: this Python has no MPI launcher next to it and none is on PATH.\n"
        "Run `make lab` from the kit's folder (it installs MPI into .venv), or on a cluster "
        "`module load` your site's MPI before starting JupyterLab."
    )


def resolve(launcher: str) -> str:
    """'auto' means Slurm inside a Slurm allocation, the local mpiexec everywhere else."""
    launcher = (launcher or "auto").lower()
    if launcher == "auto":
        launcher = os.environ.get("HPDL_LAUNCHER", "").lower() or (
            "slurm" if os.environ.get("SLURM_JOB_ID") and shutil.which("srun") else "local"
        )
    if launcher not in LAUNCHERS:
        raise HpdlError(f"launcher={launcher!r} is not one we know; use one of {', '.join(LAUNCHERS)} or 'auto'.")
    return launcher


def default_n(launcher: str) -> int:
    if launcher == "slurm" and os.environ.get("SLURM_NTASKS"):
        return int(os.environ["SLURM_NTASKS"])
    return min(4, os.cpu_count() or 1)


def engine_env() -> dict[str, str]:
    """Environment every engine starts with: one thread until the rank sets its share."""
    env = {"OMP_NUM_THREADS": "1", "IPP_NONINTERACTIVE": "1", "PYTHONUNBUFFERED": "1"}
    # The venv's bin first, so ranks find the same MPI and Python as the kernel.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


def configure_local(config, n: int) -> dict:
    """Engines as ranks of one `mpiexec -n N` job on this machine."""
    config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
    config.MPIEngineSetLauncher.mpi_args = []
    return {"engines": "mpi", "controller_ip": "127.0.0.1"}


def configure_slurm(config, n: int) -> dict:
    """Engines as ranks of one Slurm job step (srun inside an allocation, or a submitted job)."""
    raise HpdlError("The Slurm launcher is not available in this version of the kit.")


def configure(launcher: str, config, n: int) -> dict:
    """Fill `config` for `launcher`; returns keyword arguments for ipyparallel.Cluster."""
    if launcher == "local":
        return configure_local(config, n)
    return configure_slurm(config, n)
