"""Exercise cases: one module per exercise, named after it.

`hpdl.check("ring_allreduce", fn)` loads `hpdl/checker/cases/ring_allreduce.py` (or a module of
that name in a folder listed in $HPDL_CASES_PATH) and runs `fn` on fresh MPI ranks, one job
per rank count. The client imports the module too (for its cases and hints): keep imports
light at module level and import torch or mpi4py.MPI inside the functions that run on ranks.

A case module defines

    SIGNATURE = "scale(comm, x: np.ndarray) -> np.ndarray"   # quoted in messages
    RANKS = (1, 2, 3, 4)           # rank counts checked by default (optional)
    GRADED_RANKS = (6,)            # and in grading, these too (optional; larger jobs an inline check is spared)
    TIMEOUT = 5.0                  # seconds per case before it is a HANG (optional)
    FORBIDDEN = {"Allreduce": "build it from Send/Recv"}   # calls rejected (optional;
                                   # hooks.DATA_COLLECTIVES and hooks.REDUCTIONS are ready lists;
                                   # a dotted name is a library's function or class, refused too)

    def cases(size) -> list[Case]            # the cases for `size` ranks (hidden=True: grading only)
    def inputs(case, rank, size) -> tuple    # this rank's arguments after `comm`
    def reference(comm, *args)               # the model solution; its result is `expected`

and may define

    def call(fn, comm, args)                 # how to call the learner's fn (default:
                                             # fn(comm, *args)); e.g. build a model first
    def verify(case, ctx) -> Wrong | None    # default: hooks.compare(ctx.got, ctx.expected)
    def diagnose(case, ctx) -> str | None    # a hint for a wrong result on one rank
    def explain(results) -> str | None       # a hint from the pattern over all cases (client side)
    HINT_ONLY_ROOT = "..."                   # shown when only rank 0 got it right
    ORACLE = True                            # secrets(case, rank, size) (with the check's nonce, if any)
                                             # go to a helper process beside each learner rank, which
                                             # answers serve(request, secrets); inputs() on the learner's
                                             # side hands out proxies that ask it (oracle.py); a stripped
                                             # kit keeps the three, so its public cases run the same way
    VERIFY_TIMEOUT = 95.0                    # seconds for verify() when it runs a job (default 60)
    PRIVATE_INPUTS = True                    # inputs() mixes case.params["nonce"] into its seed:
                                             # each check draws a fresh nonce, and a learner's rank
                                             # gets its own inputs as data, never the nonce, so no
                                             # rank can work out another's without a message
    METERED = True                           # the learner's ranks talk over TCP and the checker counts
                                             # each rank's bytes to each rank from the kernel, outside
                                             # the learner's process (meter.py): ctx.wire, for verify()
                                             # to use: hooks.wire_agrees (the recorded calls account for
                                             # them, or no case of the check counts), received_at_least,
                                             # received_at_most
    LIBRARY_ALGORITHMS = {"MPICH": {...}}     # METERED: per MPI, variables that make its own collective
                                             # run an algorithm unlike the exercise's in the learner's job,
                                             # so MPI's collective called unrecorded under a recording of
                                             # the exercise's messages shows on the wire
    def set_up() -> None                     # run on each learner rank before any learner's code and
                                             # before the meter's first reading (torch.distributed's
                                             # process group): its sockets are counted apart
    def calibrate(comm, case) -> None        # METERED: one all-reduce of the case's size through each
                                             # library, before any learner's code; the meter reads what
                                             # it took (hooks.allreduces_on_wire)
    Case(..., {"hold": True, ...})           # METERED: the last rank is held still (stopped) before its
                                             # code runs, until the others stop sending: ctx.wire["held"]
                                             # is what each rank sent each other meanwhile (hold.py), or
                                             # "never" (it skipped being held); and in every METERED case,
                                             # ctx.wire["memory"]["held"]: the most the job's processes
                                             # held at once over what they held before the case (its
                                             # memory cgroup, where there is one)
    Case(..., {"hold": "here", ...})         # METERED: the same, from where call() says hold_here() on the
                                             # last rank, until every other rank has said passed_here()
                                             # (or MAX_HOLD): ctx.wire["passed_held"], the ranks heard of
                                             # before it was let go, None (not held) or "never"
    Case(..., {"pause": "together", ...})    # METERED: call() reads the wire where it matters with
                                             # read_wire_here(tag): every rank waits there until the
                                             # checker has read what each received so far (their transfers
                                             # in flight done); "alone": the wire is read as this rank gets
                                             # there, the others going on. ctx.wire["paused"][tag]: this
                                             # rank's bytes since the case began {"from": {peer: n}, "to":
                                             # {peer: n}}, None (not read), or no tag (never waited there)
    SELF_REPORTED = "how many ..."           # what verify() still takes from the learner's own process
                                             # (the recorder, a memory count), which a learner who knows
                                             # the kit can rewrite: named in `hpdl grade`'s report header

The learner's function runs in a job of its own (one process per rank, sandboxed where
possible) that holds only inputs() and call() and what they use, cut from this module's source
(split.py) and handed over, never the file, which its sandbox hides (so keep the answer out of
what inputs() and call() use); `reference` and verify() run in the checker's
reference job, on the same inputs, and verify() sees what the learner's ranks returned, as
plain data. `ctx.calls` lists the MPI (and torch.distributed) calls the learner made
(name, dest, source, count: elements sent, nbytes: bytes sent), recorded on every communicator
they could reach.
FORBIDDEN names are refused when called, wherever from (the source is read only for a hint).
`ctx` holds rank, size, args (the pristine inputs), got, expected, calls, learner_seconds,
reference_seconds, and comm: a communicator between the reference job's ranks, for checks
across ranks. Those are collectives, so call them on every rank and
before anything that may return early (a rank that skips one leaves the others waiting):
hooks.same_on_all_ranks (parameters identical after a DDP or Horovod step), hooks.same_as_root
(initial parameters broadcast), hooks.check_shards (sampler shards disjoint, covering, equal),
hooks.gather_calls (every rank's recorded calls, e.g. to check the shape of a tree).
Per-rank helpers: hooks.compare, hooks.only_peers (e.g. ring neighbours), hooks.max_sends
(e.g. a tree's fan-out), hooks.params_of (arrays from a torch module or a list).

Example, `hpdl/checker/cases/scale.py`:

    import numpy as np
    from hpdl.checker import hooks
    from hpdl.checker.cases import Case

    SIGNATURE = "scale(comm, x) -> np.ndarray   # x times the number of ranks"

    def cases(size):
        return [Case(f"n={n}", {"n": n}) for n in (1, 7)] + [Case("n=1000", {"n": 1000}, hidden=True)]

    def inputs(case, rank, size):
        return (np.random.default_rng(rank).random(case.params["n"]),)

    def reference(comm, x):
        return x * comm.Get_size()

    def verify(case, ctx):
        return hooks.compare(ctx.got, ctx.expected) or hooks.only_peers(ctx, set(), "no messages needed")

Each case ends as a report.Verdict: PASS, WRONG (ranks, largest error, hint; `rejected` names the
rule when a forbidden call was refused), ERROR (rank and the learner's line that raised), HANG
(stuck ranks and their lines, finished ranks) or SLOW (right, but more than
slow_factor x the reference's time + 0.25 s: advisory, full points). tests/fixtures/cases has
two small modules of this kind, one with torch on the ranks. load() checks a module against
this API (validate()) and says what is missing or malformed.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
import sys
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from hpdl import settings

HERE = Path(__file__).resolve().parent
LOCKED = False  # set in the learner's process: case modules (reference solutions) stay out of reach
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
    witness: bool = False  # too large for a collective to hide in the wire's slack: where it runs, the other
    #                        cases of its rank count earn points only if it passes (jobs.void_unwitnessed)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Wrong:
    """A wrong result on one rank: what is wrong, optionally a hint and the largest error."""

    message: str
    hint: str | None = None
    max_error: float | None = None
    forged: bool = False  # seen outside the learner's processes, against what was recorded in them: no case counts
    telling: bool = False  # the algorithm, wrong where a case is large enough to tell it (its bytes on the wire,
    #                        say, which smaller cases hide in noise): no case of the check counts either


@dataclass
class Call:
    """One MPI call the learner made on the communicator handed to them."""

    name: str
    dest: int | None = None
    source: int | None = None
    count: int | None = None  # elements sent (point-to-point sends), when known
    nbytes: int | None = None  # bytes of the message sent, when known (a pickled object: its pickle)
    head: tuple | str | None = None  # a send's first values (recording.HEAD): what it carried; bytes as hex (RAW)
    exact: int | None = None  # bytes each value sent needs, where fewer than its own (recording._exact); of a
    #                           pickled message, the bytes each value takes beside its own, where not 1 (_framing)


class Context:
    """What verify() and diagnose() see for one rank after the learner's function returned.

    verify() runs in the checker's own reference job, one process per rank, never in the
    learner's: `got` and `calls` arrived from the learner's rank as plain data (wire.py), and
    `comm` connects the reference job's ranks, so the collective hooks work as before.

    case, rank, size; args (this rank's inputs, untouched by the learner); got (what the
    learner's function returned); expected (what reference() returned on this rank); calls
    (the MPI calls the learner made); learner_seconds, reference_seconds; wire (for a METERED
    module: the bytes this rank sent to each other rank in this case, counted by the kernel
    outside the learner's process (meter.py), else None); and comm, a fresh communicator for
    checks across ranks (made on first use: collective, so when verify() uses it on one rank it
    must use it on all).
    """

    def __init__(self, case: Case, rank: int, size: int, args: tuple, got: Any, expected: Any,
                 calls: list[Call], world: Any = None, learner_seconds: float = 0.0, reference_seconds: float = 0.0,
                 wire: dict[str, int] | None = None):
        self.case, self.rank, self.size, self.args = case, rank, size, args
        self.wire = wire
        self.got, self.expected, self.calls = got, expected, calls
        self.learner_seconds, self.reference_seconds = learner_seconds, reference_seconds
        self._world, self._comm = world, None
        self.waits: list[tuple[int, int]] = []  # (calls before it, an Isend's or Irecv's index): its completion

    @property
    def comm(self) -> Any:
        if self._comm is None:
            self._comm = self._world.Dup()
        return self._comm


def with_nonce(case: Case, nonce: int | None) -> Case:
    """The case as the checker's side sees it: its params with this check's nonce (PRIVATE_INPUTS)."""
    if nonce is None:
        return case
    return Case(**{**case.to_dict(), "params": {**case.params, "nonce": nonce}})


#: set on a learner's rank in a METERED check job for a case with "pause" (learner_job): asks the checker
_read_wire: Callable[[str], None] | None = None


def read_wire_here(tag: str) -> None:
    """Wait here until the checker has read the bytes every rank received so far (every rank stopped at `tag`,
    the transfers they started meanwhile finished; or, where the case's "pause" is "alone", this rank's at
    once; ctx.wire["paused"][tag]). The kit puts it where timing is the exercise: a reading in the middle
    of backward shows which all-reduces had started by then, which the learner's process cannot rewrite.
    Does nothing elsewhere (the reference job, an unmetered check)."""
    if _read_wire is not None:
        _read_wire(tag)


#: set on a learner's rank in a METERED check job for a case whose "hold" is "here" (learner_job): the last
#: rank's asks the checker to hold it still, each other rank's tells it the rank got somewhere
_hold_here: Callable[[], None] | None = None
_passed_here: Callable[[str], None] | None = None


def hold_here() -> None:
    """On the last rank, be held still from here (stopped from outside, hold.py) until every other rank has
    reached passed_here(), or for MAX_HOLD. What the others do meanwhile cannot wait on this rank: an
    all-reduce launched and left to run lets them go on, one waited for at once stops them. Does nothing on
    the other ranks and elsewhere (the reference job, an unmetered check)."""
    if _hold_here is not None:
        _hold_here()


def passed_here(tag: str) -> None:
    """Tell the checker this rank got here; it counts if heard before the held rank is let go, which cannot
    get past its hold_here() until then (ctx.wire["passed_held"]). Does not wait. Does nothing on the held
    rank and elsewhere."""
    if _passed_here is not None:
        _passed_here(tag)


def one_rank_points(size: int) -> float:
    """On one rank doing nothing is right (`return x`, gradients left as they are): the case still runs
    (a function must work there), for no points."""
    return 0.0 if size == 1 else 1.0


def nonce_seed(params: dict) -> int:
    """A torch seed from the case's seed hashed with the check's nonce (PRIVATE_INPUTS), where the
    checker's side has one; from the case's seed alone where it has none (a stripped kit's public cases).
    Hashed, not added: torch's generator keeps only a seed's low 32 bits, so seeds a constant apart
    would let a rank that found its own seed work out every other rank's."""
    import hashlib

    text = f"{params['seed']}:{params.get('nonce', 0)}".encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") % 2**62


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
    extra = settings.CASES_PATH.get()
    return [*key_folders(), HERE, *extra]


def key_folders() -> list[Path]:
    """The instructor's answer keys (`hpdl keys export`), when HPDL_KEYS (or `hpdl grade --keys`)
    names them: full case modules, found before the kit's own (which a shared kit holds public only)."""
    keys = settings.KEYS.get()
    return [Path(keys).resolve()] if keys else []


def is_public_only(module: ModuleType) -> bool:
    """A module `hpdl keys strip` made: public cases, no reference(); expected answers as data."""
    return bool(getattr(module, "PUBLIC_ONLY", False))


def sibling_path(name: str) -> Path | None:
    """A module of the kit's case package by name (a helper such as _dp): the keys' copy first."""
    for folder in [*key_folders(), HERE]:
        candidate = folder / f"{name}.py"
        if candidate.is_file():
            return candidate
    return None


def public_part(name: str, roots: tuple[str, ...] = ("inputs", "call", "serve", "set_up", "calibrate")) -> dict:
    """What a learner's check job may hold of exercise `name`: the module cut down to `roots` and
    what they use (split.shake), as {"module": import name, "sources": {import name: source}, "files":
    {import name: the file it was cut from}}: its code keeps that file's name, so kit code in it is
    known as the kit's (recording.paused), though the file itself stays hidden from the learner."""
    from hpdl.checker import split

    path = path_of(name)
    module_name = f"{__name__}.{name}" if path.parent in (HERE, *key_folders()) else f"hpdl_cases_{path.stem}"
    def find(n: str) -> Path | None:
        return path if n == name else sibling_path(n)

    sources = split.shake(name, set(roots), find, module_name=module_name)
    files = {m: str(find(m.rpartition(".")[2]) if m != module_name else path) for m in sources}
    return {"module": module_name, "sources": sources, "files": files}  # files: the code's own names


def hidden_from_learners() -> list[str]:
    """Paths a learner's check job must not see: the keys folder, every case module's file
    (the package's __init__ stays: it is the API) and the compiled copies beside them."""
    paths = [str(f) for f in key_folders() if f.is_dir()]
    for folder in [HERE, *settings.CASES_PATH.get()]:
        if folder.is_dir():
            paths += [str(p) for p in sorted(folder.glob("*.py")) if p.name != "__init__.py"]
            paths += [str(folder / "__pycache__")] if (folder / "__pycache__").is_dir() else []
    return paths


def known() -> list[str]:
    names = set()
    for folder in _folders():
        names.update(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_"))
    return sorted(names)


def self_reported() -> dict[str, str]:
    """{exercise: what its check still takes from the learner's own process} (SELF_REPORTED), for the
    grading report: where a grade rests on it, a learner who knows the kit can make it up."""
    found = {name: getattr(load(name), "SELF_REPORTED", None) for name in known()}
    return {name: what for name, what in found.items() if what}


#: one case module loaded at a time: the grader checks several submissions at once, in threads, and a
#: module put in sys.modules before its code has run looked, to another thread, like one without
#: SIGNATURE (measured: 8 threads loading a course's case module, a check refused in 5 of 20 trials)
_LOADING = threading.RLock()


def load_file(path: str | Path) -> ModuleType:
    """Import a case module from its file and check its interface (HpdlError saying what is wrong)."""
    _refuse_if_locked()
    path = Path(path).resolve()
    with _LOADING:
        _search_keys_first()
        if path.parent in (HERE, *key_folders()):
            module = importlib.import_module(f"hpdl.checker.cases.{path.stem}")
        else:
            modname = f"hpdl_cases_{path.stem}"
            if modname in sys.modules and getattr(sys.modules[modname], "__file__", None) == str(path):
                module = sys.modules[modname]
            else:
                spec = importlib.util.spec_from_file_location(modname, path)
                module = importlib.util.module_from_spec(spec)
                sys.modules[modname] = module
                spec.loader.exec_module(module)
    validate(module, path)
    return module


def _search_keys_first() -> None:
    """Case modules (and the helpers they import) from the keys folder before the kit's own; when
    that order changed (HPDL_KEYS set in this process), those imported before are imported again."""
    order = [str(f) for f in key_folders()] + [str(HERE)]
    if __path__ == order:
        return
    __path__[:] = order
    for name in [n for n in sys.modules if n.startswith(__name__ + ".")]:
        del sys.modules[name]
        globals().pop(name.rpartition(".")[2], None)


#: What a case module must define, and what it may (see the docstring above).
REQUIRED_FUNCTIONS = ("cases", "inputs", "reference")
OPTIONAL_FUNCTIONS = ("call", "verify", "diagnose", "explain")


def validate(module: ModuleType, path: Path | str | None = None) -> None:
    """Fail at load time, naming the file and the attribute, when a case module breaks the API."""
    from hpdl.errors import HpdlError

    where = str(path or getattr(module, "__file__", module.__name__))
    problems = []
    if not isinstance(getattr(module, "SIGNATURE", None), str):
        problems.append("SIGNATURE must be a string such as \"f(comm, x: np.ndarray) -> np.ndarray\"")
    for name in REQUIRED_FUNCTIONS:
        if name == "reference" and is_public_only(module):
            continue  # stripped (`hpdl keys strip`): expected answers come as data
        if not callable(getattr(module, name, None)):
            problems.append(f"{name}() is missing (or not a function)")
    for name in OPTIONAL_FUNCTIONS:
        if hasattr(module, name) and not callable(getattr(module, name)):
            problems.append(f"{name} must be a function when defined")
    ranks = getattr(module, "RANKS", (1,))
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = (ranks,)
    try:
        ok = bool(ranks) and all(int(r) == r and r >= 1 for r in ranks)
    except (TypeError, ValueError):
        ok = False
    if not ok:
        problems.append(f"RANKS must be rank counts >= 1, e.g. (1, 2, 3, 4); got {getattr(module, 'RANKS', None)!r}")
    timeout = getattr(module, "TIMEOUT", 1.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        problems.append(f"TIMEOUT must be positive seconds; got {timeout!r}")
    forbidden = getattr(module, "FORBIDDEN", None)
    if forbidden is not None:
        names = forbidden if isinstance(forbidden, dict) else None
        if names is None:
            try:
                names = list(forbidden)
            except TypeError:
                names = None
        if names is None or not all(isinstance(n, str) for n in names):
            problems.append("FORBIDDEN must map MPI method names to a reason (or list the names)")
    for name in ("HINT_ONLY_ROOT", "SELF_REPORTED"):
        if getattr(module, name, None) is not None and not isinstance(getattr(module, name), str):
            problems.append(f"{name} must be a string")
    if problems:
        raise HpdlError(f"The checks in {where} do not follow the case-module API (hpdl/checker/cases/__init__.py): "
                        + "; ".join(problems) + ".")


def _refuse_if_locked() -> None:
    if LOCKED:
        raise ImportError("case modules hold the checker's reference solutions: not loadable while your code "
                          "is being checked")


def load(name: str) -> ModuleType:
    _refuse_if_locked()
    return load_file(path_of(name))
