"""Client side: how a check's MPI jobs start (command line and environment).

jobs.py runs two jobs per rank count (the learner's ranks and the checker's reference ranks) as
side jobs (hpdl.sidejob); how they start comes from here, through the launcher in use
(`launchers.local_job_command` / `local_job_env`), so a new launcher changes nothing here.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from hpdl.errors import HpdlError


@dataclass
class Launch:
    """How one check job starts. `through_batch`, when not empty, says why the job goes through the
    batch system (no local MPI launcher): its sandbox then keeps the network and `kept` (the batch
    system's variables, by name), and the check's result says so."""

    cmd: list[str]
    env: dict[str, str]
    through_batch: str = ""
    kept: tuple[str, ...] = ()


def job_launch(size: int, module: str, job_dir: str, env: dict[str, str], preload: list[str] = (),
               apart: bool = False, server: str | None = None) -> Launch:
    """One check job: `size` ranks of `python -m <module> <job_dir>`, started from `env`.

    On this node only, through the local mpiexec, with the batch system's variables removed: a
    check's jobs are small and the learner's runs in a sandbox with no network, where srun could
    not reach slurmctld (and an srun step would queue or squeeze beside the engines' step). Where
    this Python's MPI has no local launcher (Cray MPICH: only srun starts ranks), the launcher's
    side job (`srun --overlap`) instead, and the job keeps what it needs of the batch system.

    `preload` (modules every rank imports, e.g. torch): through the local mpiexec, the ranks are
    forked from one process that imported them once (hpdl.forkserver) unless HPDL_FORKSERVER=0.

    `server`: the socket of a fork server already serving (shared_server): the ranks are its forks.

    `apart`: ranks that will share no memory (isolate.py), which Intel MPI starts only each on a node
    of its own (launchers.nodes_apart)."""
    from hpdl import forkserver, launchers

    program = [sys.executable, "-m", module, job_dir]
    try:
        local = launchers.local_job_command(size)
        if apart:
            local = _nodes_apart(local, size, job_dir)
        forked = (([], forkserver.rank_command(server, module, job_dir)) if server
                  else forkserver.commands(job_dir, preload, module, job_dir))
        cmd = [*forked[0], *local, *forked[1]] if forked else [*local, *program]
        return Launch(cmd, launchers.local_job_env(env))
    except HpdlError as exc:
        cmd = launchers.side_job_command(size, gpus=False)  # outside a batch job: the same HpdlError again
        kept = tuple(sorted(set(env) - set(launchers.local_job_env(env))))
        why = (f"Note: this Python's MPI has no launcher of its own here ({str(exc).splitlines()[0]}), so the "
               f"check's jobs ran through the batch system ({cmd[0]}); their sandbox kept the network and the "
               "batch system's variables for it.")
        return Launch([*cmd, *program], dict(env), why, kept)


def shared_server(folder: str, preload: list[str]) -> tuple[list[str], str] | None:
    """One fork server for the jobs of a check that run outside its sandbox (the reference ranks at
    each rank count): torch imported once per check, not once per job. (Its command, its socket in
    `folder`), or None where each job starts its ranks itself: nothing to preload, the setting off,
    or no local launcher. Never for a learner's job: its server must be inside its own sandbox."""
    from hpdl import forkserver, launchers

    path = forkserver.socket_path(folder) if preload else None
    if path is None:
        return None
    try:
        launchers.local_job_command(1)
    except HpdlError:
        return None
    return forkserver.serve_command(path, preload, forkserver.until_gone(os.getpid())), path


def _nodes_apart(cmd: list[str], size: int, job_dir: str) -> list[str]:
    """`cmd` (a local mpiexec) starting each rank as if on a node of its own, where this MPI needs it:
    its flags for forking ranks here (launchers.local_flags) give way to a remote shell that runs each
    rank's proxy here, a file in the job's folder (in the sandbox, the only folder the job sees)."""
    from hpdl import launchers, safefiles

    shell, which = os.path.join(job_dir, "remote-shell-here"), launchers.mpiexec_implementation()
    flags = launchers.nodes_apart(which, size, shell)
    if flags is None or "-n" not in cmd:
        return cmd
    safefiles.create_exclusive(shell, launchers.REMOTE_SHELL_HERE, mode=0o700)
    fork = launchers.local_flags(which)
    at = next((i for i in range(len(cmd)) if cmd[i:i + len(fork)] == fork), None) if fork else None
    if at is not None:
        cmd = cmd[:at] + cmd[at + len(fork):]
    n = cmd.index("-n")
    return cmd[:n] + flags + cmd[n:]


__all__ = ["Launch", "job_launch", "shared_server"]
