"""The engines as ranks of one `mpiexec -n N` job on this machine (the kit's default)."""
from __future__ import annotations

from hpdl.launchers import Launcher, find_mpiexec


class Local(Launcher):
    name = "local"
    label = "mpiexec"
    priority = -1  # "auto" falls back to it when no other launcher detects its environment
    ranks_are_local = True

    def detect(self) -> bool:
        return True

    def configure(self, config, n: int) -> dict:
        config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]  # ipyparallel adds "-n N" and the engine
        config.MPIEngineSetLauncher.mpi_args = []
        return {"engines": "mpi", "controller_ip": "127.0.0.1"}

    def describe(self) -> str:
        return f"mpiexec on this machine ({find_mpiexec()})"
