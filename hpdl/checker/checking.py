"""Run a packed learner's function on the cases of one exercise and gather a CheckResult.

Shared by the two callers that decide verdicts: the learner's kernel (client.py, inline checks)
and the grader (grade_service.py, checks a submission hands over). Plans the cases per rank
count, runs them (jobs.py: the learner's ranks and the checker's reference ranks side by side),
and adds the hints. Client side: nothing here runs on a rank.
"""
from __future__ import annotations

import dataclasses
import glob
import os
import re
import secrets
import time
from pathlib import Path

from hpdl import forkserver
from hpdl.checker import cases as case_api
from hpdl.checker import source
from hpdl.checker.jobs import UNWITNESSED, Planned, Runner
from hpdl.checker.report import CheckResult, Verdict
from hpdl.errors import HpdlError

DEFAULT_RANKS = (1, 2, 3, 4)
DEFAULT_TIMEOUT = 5.0
MAX_RANKS = 64
DEFAULT_REASON = "this exercise asks you to build it from point-to-point messages (Send/Recv)"


def check_code(name: str, module, code: dict, *, ranks=None, grading: bool = False, timeout=None,
               progress: bool = True, hidden: list[str] = (), stop=None, memory: int | None = None,
               only=None, at_once: int = 1) -> CheckResult:
    """Run the packed function `code` on the cases of exercise `name` (the grader calls this too).
    `only`: the learner's cases= (text, or texts, in the names of the cases to run); never when grading.
    `stop`: a threading.Event that, once set, ends the check's jobs (jobs.Stopped is raised).
    `memory`: what all the check's jobs may hold together (default sandbox.default_memory()).
    `at_once`: checks that may run together on this machine (the grader's --jobs), for the time limits."""
    t0 = time.perf_counter()
    if grading and case_api.is_public_only(module):
        raise HpdlError(f"This kit holds only the public checks of {name!r} (its answer keys were moved out): "
                        "grading needs them. Point the grader at the keys: `hpdl grade --keys DIR`, or set "
                        "HPDL_KEYS=DIR.")
    sizes = graded_sizes(module) if grading and ranks is None else _sizes(ranks, module)
    stored = _sizes(None, module)
    if case_api.is_public_only(module) and not set(sizes) <= set(stored):
        raise HpdlError(f"This kit stores the answers of {name!r} at {stored} ranks only (its reference solution "
                        f"was moved out): check with ranks among those, e.g. ranks={stored}.")
    plan, hidden_not_run = _plan(module, sizes, grading, timeout, at_once)
    plan, left_out = _chosen(name, plan, only, grading)
    forbidden = _forbidden(module)
    spec = {"exercise": name, "module_path": str(case_api.path_of(name)), "code": code, "forbidden": forbidden,
            "public": case_api.public_part(name),
            "hidden": list(hidden) + answer_keys(check_job=True) + _compiled(library_answer_copies(module)),
            "replaced": {**kit_answer_copies(), **library_answer_copies(module)},
            "nonce": _nonce(module), "verify_timeout": getattr(module, "VERIFY_TIMEOUT", None),
            "preload": _preload(module, code), "metered": bool(getattr(module, "METERED", False)),
            "send_waits": bool(getattr(module, "SEND_WAITS", True)),
            "library_algorithms": getattr(module, "LIBRARY_ALGORITHMS", None),
            "calibrate": callable(getattr(module, "calibrate", None))}
    bar = _progress(sum(len(v) for v in plan.values()), name) if progress else None
    try:
        runner = Runner(name, module, spec, plan, progress=bar, every_case=grading, stop=stop, memory=memory)
        results = runner.run()
    finally:
        if bar is not None:
            bar.close()
    ordered = [results[i] for i in sorted(results)]
    hints = list(runner.notes)  # how the jobs ran, where it differs from the usual (no local mpiexec)
    hints += _case_notes(name, ordered, only, left_out, grading)
    explain = getattr(module, "explain", None)
    if explain is not None:
        try:
            hint = explain(right_by_their_values(ordered))
        except Exception:
            hint = None
        if hint:
            hints.append(f"Hint: {hint}")
    mentioned = source.forbidden_calls(code.get("sources", []), forbidden) if forbidden else []
    mentioned = [m for m in mentioned if m["name"][:1].isupper() or "comm" in m["call"].lower()]  # not add.reduce
    if mentioned and not any(c.rejected for c in ordered):  # the AST scan: a hint, never a verdict
        m = mentioned[0]
        hints.append(f"Note: your code mentions {m['call']} (line {m['line']} in {m['func']}), which this exercise "
                     f"forbids; it was not called in these cases, but would be rejected if it were.")
    return CheckResult(name, ordered, grade=grading, hidden_not_run=hidden_not_run,
                       seconds=time.perf_counter() - t0, hints=hints)


def answer_keys(check_job: bool = False) -> list[str]:
    """What a sandboxed learner does not see: the kit's solutions, its tests (whose fixtures hold right
    answers to every exercise), the case modules' files and the instructor's keys (the job gets the public
    part of its exercise in its spec instead); in a `check_job`, the benchmarks too (some call a right
    answer), which a graded notebook's lessons run."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    # a kit run from its clone: git's history holds every case module and solution as they were
    names = ("solutions", ".git", "tests") + (("benchmarks",) if check_job else ())
    kit = [str(root / name) for name in names if (root / name).exists()]
    return kit + case_api.hidden_from_learners() + _compiled(kit_answer_copies())


_ANSWER_COPIES: dict[tuple, dict[str, str]] = {}  # names cut -> {a module's file: this process's copy without them}


def kit_answer_copies() -> dict[str, str]:
    """{file of a kit module: a copy of it without its implementations of exercises (hooks.KIT_ANSWERS)},
    laid over the file in a learner's sandboxed check job, so no learner's code reads them (the job
    replaces the functions in the modules it imports; a module loaded again from its file under another
    name held them whole). Their compiled copies are hidden (answer_keys). Made once per process, in a
    scratch folder of kind "answers" that lives as long as the process."""
    from hpdl.checker.hooks import KIT_ANSWERS

    return _copies_without(tuple(KIT_ANSWERS))


def library_answer_copies(module) -> dict[str, str]:
    """{file of a library module: a copy of it without the classes and functions the exercise's case module names
    in LIBRARY_ANSWERS}, laid over the file as kit_answer_copies' are. Torch's DistributedSampler, refused where it
    was imported, was loaded again from its file under another name (12/12 in shard_indices)."""
    return _copies_without(tuple(getattr(module, "LIBRARY_ANSWERS", ())))


def _copies_without(dotted: tuple[str, ...]) -> dict[str, str]:
    """{each named module's file: a copy without the named functions and classes (split.without)}, made once per
    process, in a scratch folder of kind "answers" that lives as long as the process."""
    import atexit
    import importlib.util

    from hpdl import safefiles, scratch
    from hpdl.checker import split

    if not dotted:
        return {}
    if dotted in _ANSWER_COPIES:
        return dict(_ANSWER_COPIES[dotted])
    wanted: dict[str, set[str]] = {}
    for name in dotted:
        module, _, attr = name.rpartition(".")
        wanted.setdefault(module, set()).add(attr)
    folder = scratch.make("answers")  # one a killed process left is removed by the next (scratch.sweep)
    atexit.register(safefiles.remove_tree, str(folder))
    made: dict[str, str] = {}
    for module, names in sorted(wanted.items()):
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError):
            spec = None
        if spec is None or not spec.origin or not spec.origin.endswith(".py"):
            continue
        why = (f"{module}'s own version of an exercise is not in a check's view: the check takes the function "
               "you wrote")
        copy = Path(folder) / f"{module}.py"
        copy.write_text(split.without(Path(spec.origin).read_text(), names, why))
        made[spec.origin] = str(copy)
    _ANSWER_COPIES[dotted] = made
    return dict(made)


def _compiled(paths) -> list[str]:
    """The compiled copies of these sources that exist (__pycache__), which would hold them whole."""
    import importlib.util

    found = []
    for path in paths:
        try:
            pyc = importlib.util.cache_from_source(path)
        except (NotImplementedError, ValueError):
            continue
        stem = pyc[:-len(".pyc")]  # and its optimised copies (.opt-1.pyc, .opt-2.pyc)
        found += sorted(p for p in glob.glob(glob.escape(stem) + "*.pyc") if os.path.isfile(p))
    return found


# -- planning ----------------------------------------------------------------------------------

_IMPORTS_TORCH = re.compile(r"^[ \t]*(?:import|from)[ \t]+torch\b", re.MULTILINE)
# spaces within a line only (both): `^\s*` spans newlines, and on 200 KB of them the search ran for minutes
# in the grader's process, holding Python's lock: no other submission's time limit was kept meanwhile
_USES_TORCH = re.compile(r"^[ \t]*(?:import|from)[ \t]+torch\b|\btorch\.", re.MULTILINE)
_BUILDS_OPTIMIZER = re.compile(r"\boptim\.[A-Z]\w*\(|DistributedOptimizer\(")


def _preload(module, code: dict) -> dict[str, list[str]]:
    """What every rank of each job of this exercise imports, which a fork server can import once
    for the job (runner.py): torch, and what torch imports at a process's first optimizer where one
    is built (forkserver.OPTIMIZER_IMPORTS). The reference job runs the case module: torch where it
    imports torch. The learner's job runs the case module's public part and the learner's code: torch
    also where that code uses it, imported in its own cell or in another (a global the function
    reaches, which its pickle names). Only ever these modules: the learner's code picks none."""
    try:
        case = Path(module.__file__).read_text()
    except (OSError, TypeError):
        case = ""
    learner = [str(entry.get("source", "")) for entry in code.get("sources", []) if isinstance(entry, dict)]
    pickled = code.get("pickled")
    in_case = bool(_IMPORTS_TORCH.search(case))
    in_learner = (any(_USES_TORCH.search(text) for text in learner)
                  or (isinstance(pickled, bytes) and b"torch" in pickled))

    def modules(torch: bool, texts: list[str]) -> list[str]:
        if not torch:
            return []
        optimizers = any(_BUILDS_OPTIMIZER.search(text) for text in texts)
        return ["torch", *(forkserver.OPTIMIZER_IMPORTS if optimizers else ())]

    return {"reference": modules(in_case, [case]), "learner": modules(in_case or in_learner, [case, *learner])}


def _nonce(module) -> int | None:
    """A fresh secret per check for a module with PRIVATE_INPUTS or ORACLE: only the checker's side and the
    client know it (a stripped kit's stored answers were computed without one)."""
    wanted = getattr(module, "PRIVATE_INPUTS", False) or getattr(module, "ORACLE", False)
    if not wanted or case_api.is_public_only(module):
        return None
    return secrets.randbits(62)


def graded_sizes(module) -> list[int]:
    """The rank counts grading runs an exercise at: its RANKS, and those a learner's inline check is spared
    (GRADED_RANKS: larger jobs)."""
    return sorted(set(_sizes(None, module)) | set(getattr(module, "GRADED_RANKS", ())))


def _sizes(ranks, module) -> list[int]:
    if ranks is None:
        ranks = getattr(module, "RANKS", DEFAULT_RANKS)
    if isinstance(ranks, int) and not isinstance(ranks, bool):
        ranks = [ranks]
    try:
        sizes = sorted({int(r) for r in ranks})
    except (TypeError, ValueError):
        raise HpdlError(f"ranks= takes a rank count or a list of them, e.g. ranks=[2, 4]; got {ranks!r}.") from None
    if not sizes or sizes[0] < 1 or sizes[-1] > MAX_RANKS:
        raise HpdlError(f"ranks must be between 1 and {MAX_RANKS}; got {ranks!r}.")
    return sizes


def _plan(module, sizes, grading: bool, timeout, at_once: int = 1) -> tuple[dict[int, list[Planned]], int]:
    if timeout is not None:
        try:
            timeout = float(timeout)
        except (TypeError, ValueError):
            raise HpdlError(f"timeout is in seconds per case; got {timeout!r}.") from None
        if timeout <= 0:
            raise HpdlError(f"timeout must be positive seconds; got {timeout}.")
    default = float(getattr(module, "TIMEOUT", DEFAULT_TIMEOUT))
    plan, index, hidden = {}, 0, 0
    for size in sizes:
        todo, stretch = [], crowding(size, at_once)
        for case in module.cases(size):
            case.size = size
            if case.hidden and not grading:
                hidden += 1
                continue
            todo.append(Planned(index, case, timeout or (case.timeout or default) * stretch))
            index += 1
        plan[size] = todo
    return plan, hidden


def crowding(size: int, at_once: int = 1) -> float:
    """How many ranks share each core this process may run on, at least 1, with `at_once` checks of `size`
    ranks running together (the grader's --jobs): a case's own time limit stretches by it (the learner's
    timeout= does not), for ranks that outnumber the cores take turns (7 ranks on 2 cores: 3.5×; honest
    pickled sends of 100 003 values at 7 ranks were cut off at 5 s)."""
    from hpdl import devices

    return max(1.0, size * max(1, at_once) / max(1, len(devices.usable_cores())))


def _chosen(name: str, plan: dict[int, list[Planned]], only, grading: bool) -> tuple[dict[int, list[Planned]], int]:
    """The plan cut to the cases whose names hold any of `only` (a learner mending one case runs just it
    again), numbered anew; and how many were left out. Grading runs every case."""
    if only is None:
        return plan, 0
    if grading:
        raise HpdlError("Grading runs every case: leave out cases= (or grade=False to run some of them).")
    words = [only] if isinstance(only, str) else only
    if not isinstance(words, (list, tuple)) or not words or not all(isinstance(w, str) and w for w in words):
        raise HpdlError(f"cases= takes a case's name, or part of it, or a list of them; got {only!r}.")
    chosen, index, total = {}, 0, 0
    for size, todo in plan.items():
        chosen[size] = []
        for p in todo:
            total += 1
            if any(w.lower() in p.case.name.lower() for w in words):
                chosen[size].append(Planned(index, p.case, p.timeout))
                index += 1
    if not index:
        names = sorted({p.case.name for todo in plan.values() for p in todo})
        raise HpdlError(f"No case of {name!r} is named like {only!r}. Its cases: {'; '.join(names)}.")
    return chosen, total - index


def _case_notes(name: str, ordered: list, only, left_out: int, grading: bool) -> list[str]:
    """What the result says of the cases run: those cases= left out; and, where one failed, how to run it alone
    while mending it (not when grading, which runs every case)."""
    notes = []
    if left_out:
        notes.append(f"Note: only the cases named like {only!r} ran; {left_out} other{'s' if left_out > 1 else ''} "
                     "did not. Run the check without cases= to see every one.")
    failed = next((c for c in ordered if not c.verdict.earns_points and c.rejected != UNWITNESSED), None)
    if failed is not None and not grading and not left_out and len(ordered) > 1:
        notes.append(f"Tip: hpdl.check({name!r}, ..., ranks={failed.ranks}, cases={failed.name!r}) runs that case "
                     "alone while you mend it.")
    return notes


def right_by_their_values(ordered: list) -> list:
    """The results as a module's explain() reads them: a case not counted only because its rank count's witness
    did not pass (jobs.void_unwitnessed) was right, and a pattern of right and wrong cases tells the mistake."""
    return [dataclasses.replace(c, verdict=Verdict.PASS) if c.rejected == UNWITNESSED else c for c in ordered]


def _forbidden(module) -> dict[str, str]:
    got = getattr(module, "FORBIDDEN", None) or {}
    if not isinstance(got, dict):
        got = {n: getattr(module, "FORBIDDEN_REASON", DEFAULT_REASON) for n in got}
    return dict(got)


def _progress(total: int, name: str):
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=f"checking {name}", unit="case", delay=1.5, leave=False)
