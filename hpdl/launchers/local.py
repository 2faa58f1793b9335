"""The engines as ranks of one `mpiexec -n N` job on this machine (the kit's default)."""
from __future__ import annotations

from hpdl.launchers.base import Launcher
from hpdl.launchers.mpiexec import find_mpiexec, launch_flags, mpiexec_implementation


class Local(Launcher):
    name = "local"
    label = "mpiexec"
    priority = -1  # "auto" falls back to it when no other launcher detects its environment
    ranks_are_local = True

    def detect(self) -> bool:
        return True

    def configure(self, config, n: int) -> dict:
        exe = find_mpiexec()
        # ipyparallel adds "-n N" and the engine; the flags make Open MPI and Intel MPI start
        # ranks as MPICH does (hpdl.launchers.mpiexec.mpiexec_flags says which and why)
        config.MPIEngineSetLauncher.mpi_cmd = [exe, *launch_flags(exe)]
        config.MPIEngineSetLauncher.mpi_args = []
        return {"engines": "mpi", "controller_ip": "127.0.0.1"}

    def describe(self) -> str:
        exe = find_mpiexec()
        return f"mpiexec on this machine ({exe}, {mpiexec_implementation(exe)})"
