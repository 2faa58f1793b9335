"""`python -m hpdl.launchers srun PROGRAM [ARGS...]` inside a Slurm job: PROGRAM on every task of it.

The step asks for what the job holds and each task runs the site profile's prologue first, as the
kit's own ranks do (cluster/slurm/run.sbatch runs scripts this way).
"""
from __future__ import annotations

import os
import sys

from hpdl.errors import HpdlError
from hpdl.launchers.slurm import step_command


def main(argv: list[str]) -> int:
    if len(argv) < 2 or argv[0] != "srun":
        print("usage: python -m hpdl.launchers srun PROGRAM [ARGS...]   (inside a Slurm job)", file=sys.stderr)
        return 2
    try:
        cmd = step_command() + argv[1:]
    except HpdlError as exc:
        print(f"hpdl: {exc}", file=sys.stderr)
        return 2
    os.execvp(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
