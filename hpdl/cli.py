"""The `hpdl` command: one verb per job, each handled by the module that owns it."""
from __future__ import annotations

import importlib
import sys

VERBS = {
    "doctor": ("hpdl.doctor", "report the environment and what to fix"),
    "settings": ("hpdl.settings", "every HPDL_* setting: its value here, what it takes, who reads it"),
    "build": ("hpdl.build", "generate exercises/ from solutions/ (--check: fail on drift)"),
    "exercises": ("hpdl.workspace", "copy the exercises into your workspace, never overwriting your edits"),
    "grade": ("hpdl.grade", "grade a folder of submitted notebooks"),
    "keys": ("hpdl.keys", "move the answer keys out of a shared kit (export --to DIR, then strip --keys DIR)"),
    "cleanup": ("hpdl.cluster.cleanup", "stop clusters this kit started and left behind"),
    "preflight": ("hpdl.preflight", "one short job on a site's nodes: GPUs, MPI, allreduce; a go/no-go report"),
    "rehearse": ("hpdl.rehearse", "the day before: N learners' jobs run lesson 00 and a check; a pass/fail table"),
    "course": ("hpdl.course", "after the course (`course end`): cancel its jobs, stop the hub, archive then remove"),
    "tune": ("hpdl.tune", "measure MPI_Allreduce algorithms, write MPICH's tuning file and a report folder"),
    "wheelhouse": ("hpdl.wheelhouse", "build a folder of every wheel the kit needs, for an install with no network"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print("usage: hpdl VERB [options]\n")
        for verb, (_, text) in VERBS.items():
            print(f"  {verb:<10} {text}")
        return 0
    verb, rest = argv[0], argv[1:]
    if verb not in VERBS:
        print(f"hpdl: no verb {verb!r}; try one of: {', '.join(VERBS)}", file=sys.stderr)
        return 2
    module = importlib.import_module(VERBS[verb][0])
    from hpdl.errors import HpdlError

    try:
        return int(module.main(rest) or 0)
    except HpdlError as exc:
        print(f"hpdl {verb}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"hpdl {verb}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
