"""Exercise cases: one module per exercise, named after it.

`hpdl.check("ring_allreduce", fn)` loads `hpdl/check/cases/ring_allreduce.py` (or a module of
that name in a folder listed in $HPDL_CASES_PATH) and runs `fn` on fresh MPI ranks, one job
per rank count. A case module is plain Python; the worker imports it on every rank, so keep
its imports light (import torch inside functions that need it).

A case module defines

    SIGNATURE = "scale(comm, x: np.ndarray) -> np.ndarray"   # quoted in messages
    RANKS = (1, 2, 3, 4)           # rank counts checked by default (optional)
    TIMEOUT = 5.0                  # seconds per case before it is a HANG (optional)
    FORBIDDEN = {"Allreduce": "build it from Send/Recv"}   # calls rejected (optional)

    def cases(size) -> list[Case]            # the cases for `size` ranks
    def inputs(case, rank, size) -> tuple    # this rank's arguments after `comm`
    def reference(comm, *args)               # the model solution; its result is expected

and may define

    def verify(case, ctx) -> Wrong | None    # default: hooks.compare(ctx.got, ctx.expected)
    def diagnose(case, ctx) -> str | None    # a hint for a wrong result on one rank
    def explain(results) -> str | None       # a hint from the pattern over all cases

`reference` runs first on its own communicator, then the learner's function on another one
(a `hooks.RecordingComm`, so `ctx.calls` lists the MPI calls it made). Names in FORBIDDEN are
rejected twice: by reading the learner's source (AST) before anything runs, and at run time
when called on the communicator handed to the learner. `ctx` (a Context) holds the rank,
size, the pristine inputs, `got`, `expected`, `calls`, timings and `comm`, a fresh
communicator for checks that talk across ranks: hooks.same_on_all_ranks (parameters equal
after a DDP or Horovod step), hooks.same_as_root (initial parameters broadcast),
hooks.check_shards (a sampler's shards disjoint, covering, equal length). Every rank runs
verify(); when it does collectives on ctx.comm, every rank must reach them.

Example, `hpdl/check/cases/scale.py`:

    import numpy as np
    from hpdl.check import hooks
    from hpdl.check.cases import Case, Wrong

    SIGNATURE = "scale(comm, x) -> np.ndarray   # x times the number of ranks"

    def cases(size):
        return [Case(f"n={n}", {"n": n}) for n in (1, 7)] + [Case("n=1000", {"n": 1000}, hidden=True)]

    def inputs(case, rank, size):
        return (np.random.default_rng(rank).random(case.params["n"]),)

    def reference(comm, x):
        return x * comm.Get_size()

    def verify(case, ctx):
        return hooks.compare(ctx.got, ctx.expected) or hooks.forbid_peers(ctx, allowed=set())

Results come back per case as PASS, WRONG (rank, largest error, hint), ERROR (rank and the
learner's line that raised), HANG (stuck ranks and lines, finished ranks) or SLOW (learner
took > slow_factor x the reference's time + 0.25 s; advisory, full points).
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass
class Case:
    """One input set for one rank count. `params` must be JSON-serialisable."""

    name: str
    params: dict = field(default_factory=dict)
    points: float = 1.0
    hidden: bool = False  # run only when grading
    timeout: float | None = None  # seconds; None: the module's TIMEOUT
    slow_factor: float = 20.0  # SLOW when the learner takes > slow_factor x reference + 0.25 s
    size: int = 0  # number of ranks, filled in by the runner

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Wrong:
    """A wrong result on one rank: what is wrong, optionally a hint and the largest error."""

    message: str
    hint: str | None = None
    max_error: float | None = None


@dataclass
class Call:
    """One MPI call the learner made on the communicator handed to them."""

    name: str
    dest: int | None = None
    source: int | None = None


@dataclass
class Context:
    """What verify() and diagnose() see on one rank after the learner's function returned."""

    case: Case
    rank: int
    size: int
    args: tuple  # this rank's inputs, untouched by the learner
    got: Any  # what the learner's function returned
    expected: Any  # what reference() returned on this rank
    calls: list[Call]
    comm: Any  # a fresh communicator for checks across ranks
    learner_seconds: float = 0.0
    reference_seconds: float = 0.0


def path_of(name: str) -> Path:
    """The file of the case module for exercise `name`; HpdlError names the known ones."""
    from hpdl.errors import HpdlError

    if not isinstance(name, str) or not _NAME.match(name):
        raise HpdlError(f"{name!r} is not an exercise name; known exercises: {', '.join(known())}.")
    for folder in _folders():
        candidate = folder / f"{name}.py"
        if candidate.is_file():
            return candidate
    raise HpdlError(f"No checks for an exercise named {name!r}. Known exercises: {', '.join(known())}.")


def _folders() -> list[Path]:
    extra = [Path(p) for p in os.environ.get("HPDL_CASES_PATH", "").split(os.pathsep) if p]
    return [HERE, *extra]


def known() -> list[str]:
    names = set()
    for folder in _folders():
        names.update(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    return sorted(names)


def load_file(path: str | Path) -> ModuleType:
    """Import a case module from its file (the worker does this with the path it is sent)."""
    path = Path(path).resolve()
    if path.parent == HERE:
        return importlib.import_module(f"hpdl.check.cases.{path.stem}")
    modname = f"hpdl_cases_{path.stem}"
    if modname in sys.modules and getattr(sys.modules[modname], "__file__", None) == str(path):
        return sys.modules[modname]
    spec = importlib.util.spec_from_file_location(modname, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[modname] = module
    spec.loader.exec_module(module)
    return module


def load(name: str) -> ModuleType:
    return load_file(path_of(name))
