"""Client side (the learner's kernel, or the grader): one hpdl.check() call from start to finish.

Find the learner's function (given, on rank 0 of the running cluster, or in the notebook),
refuse the kit's own functions, plan the cases per rank count, run them (jobs.py: the
learner's ranks and the checker's reference ranks, side by side) and gather a CheckResult.

Under `hpdl grade` ($HPDL_GRADE_SERVICE set) the kernel is the submission's, so it decides
nothing: it hands the packed function to the grader (grade_service.py), which runs the
check with the exercise's own rank counts, time limits and hidden cases, keeps the result,
and sends back a copy for the notebook to show. $HPDL_GRADE=1 alone (grade mode without the
grader) also ignores the learner's ranks=, grade= and timeout=. With $HPDL_GRADE_RESULTS
set (tests), each result is appended there as a JSON line.
"""
from __future__ import annotations

import json
import os
import time
import types

from hpdl.check import cases as case_api
from hpdl.check import grade_mode, source
from hpdl.check.jobs import Planned, Runner
from hpdl.check.report import CheckResult
from hpdl.errors import HpdlError

DEFAULT_RANKS = (1, 2, 3, 4)
DEFAULT_TIMEOUT = 5.0
MAX_RANKS = 64
DEFAULT_REASON = "this exercise asks you to build it from point-to-point messages (Send/Recv)"


def forced_grade_mode() -> bool:
    """Grading set up by the instructor (the environment), not asked for by the learner's call."""
    return grade_mode(None)


def run_check(name: str, fn=None, *, ranks=None, grade: bool | None = None, timeout: float | None = None,
              caller=None) -> CheckResult:
    module = case_api.load(name)
    if forced_grade_mode():  # the exercise's own rank counts, time limits and hidden cases
        ranks, grade, timeout = None, True, None
    code = learner_code(name, fn, caller)
    if os.environ.get("HPDL_GRADE_SERVICE"):
        from hpdl.check import grade_service

        return grade_service.request(name, code)
    result = check_code(name, module, code, ranks=ranks, grading=grade_mode(grade), timeout=timeout)
    _record(result, code)  # only where $HPDL_GRADE_RESULTS names a file (tests)
    return result


def check_code(name: str, module, code: dict, *, ranks=None, grading: bool = False, timeout=None,
               progress: bool = True, hidden: list[str] = ()) -> CheckResult:
    """Run the packed function `code` on the cases of exercise `name` (the grader calls this too)."""
    t0 = time.perf_counter()
    sizes = _sizes(ranks, module)
    plan, hidden_not_run = _plan(module, sizes, grading, timeout)
    forbidden = _forbidden(module)
    spec = {"exercise": name, "module_path": str(case_api.path_of(name)), "code": code, "forbidden": forbidden,
            "hidden": list(hidden) + _answer_keys()}
    bar = _progress(sum(len(v) for v in plan.values()), name) if progress else None
    try:
        results = Runner(name, module, spec, plan, progress=bar, every_case=grading).run()
    finally:
        if bar is not None:
            bar.close()
    ordered = [results[i] for i in sorted(results)]
    hints = []
    explain = getattr(module, "explain", None)
    if explain is not None:
        try:
            hint = explain(ordered)
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


def _answer_keys() -> list[str]:
    """Folders a sandboxed learner job does not see: the kit's solutions."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    return [str(root / "solutions")] if (root / "solutions").is_dir() else []


# -- the learner's function ---------------------------------------------------------------------

def learner_code(name: str, fn, caller=None) -> dict:
    """The packed function: `fn` itself, else `name` from rank 0 of the cluster, else from the caller."""
    if fn is not None:
        return _package(fn, name)
    problem = None
    try:
        from hpdl import cluster
    except Exception:  # the cluster module is optional for checking
        cluster = None
    running = cluster is not None and getattr(cluster, "_current", None) is not None
    if running:
        c = cluster._current
        problem = c.problem()
        if problem is None:
            code = _from_rank0(c, name)
            if code is not None:
                return code
    namespace = _caller_namespace(caller)
    if isinstance(namespace.get(name), types.FunctionType):
        return _package(namespace[name], name)
    where = ("on rank 0 of the running cluster nor in this notebook" if running
             else "in this notebook (and no ranks are running)")
    extra = f" (the ranks cannot be asked: {problem}; run hpdl.restart())" if problem else ""
    raise HpdlError(
        f"No function named {name!r} found {where}{extra}.\n"
        f"Define it, then pass it: hpdl.check({name!r}, {name}); or define it in a %%px cell after "
        f"hpdl.start() and call hpdl.check({name!r})."
    )


def _package(fn, name: str) -> dict:
    if not callable(fn):
        raise HpdlError(f"hpdl.check({name!r}, ...) needs your function as the second argument; "
                        f"got {type(fn).__name__}.")
    code = getattr(fn, "__code__", None)
    if code is not None and source.kit_file(code.co_filename):
        raise HpdlError(
            f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)} is defined in the kit itself "
            f"({os.path.basename(code.co_filename)}), not by you: checks take the function you wrote, "
            f"e.g. hpdl.check({name!r}, {name}).")
    try:
        return source.package(fn)
    except TypeError as exc:
        raise HpdlError(f"hpdl.check({name!r}, ...) needs a function written with `def`: {exc}.") from None


def _from_rank0(c, name: str) -> dict | None:
    """Ask rank 0 for its function `name`, packed exactly as a local one would be."""
    engine = next((r["engine_id"] for r in c.ranks if r["rank"] == 0), None)
    if engine is None:
        return None
    view = c.client[engine]
    code = (
        "import hpdl.check.source as _hpdl_source\n"
        f"try:\n    _hpdl_packed = _hpdl_source.package_named({name!r})\n"
        "except LookupError:\n    _hpdl_packed = None\n"
    )
    try:
        view.execute(code, silent=True, block=False).get(timeout=20)
        packed = view.pull("_hpdl_packed", block=False).get(timeout=20)
        view.execute("del _hpdl_packed, _hpdl_source", silent=True, block=False).get(timeout=10)
        if packed is not None:
            packed["from_engines"] = True  # rank, world_size, comm: the worker rebinds them per rank
            packed["line_offset"] = 1  # %%px sends the cell without its first line
            for entry in packed.get("sources", []):
                entry["firstline"] += 1
    except Exception as exc:
        if "Timeout" in type(exc).__name__:
            raise HpdlError(
                "Rank 0 did not answer within 20 s (is a %%px cell still running?). Wait for it, or "
                "run hpdl.restart(); or pass your function: hpdl.check(name, fn)."
            ) from None
        raise HpdlError(f"Could not fetch {name!r} from rank 0: {exc}") from None
    return packed


def _caller_namespace(caller) -> dict:
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            return ip.user_ns
    except ImportError:
        pass
    return dict(caller.f_globals) if caller is not None else {}


# -- planning ----------------------------------------------------------------------------------

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


def _plan(module, sizes, grading: bool, timeout) -> tuple[dict[int, list[Planned]], int]:
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
        todo = []
        for case in module.cases(size):
            case.size = size
            if case.hidden and not grading:
                hidden += 1
                continue
            todo.append(Planned(index, case, timeout or case.timeout or default))
            index += 1
        plan[size] = todo
    return plan, hidden


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


def _record(result: CheckResult, code: dict) -> None:
    path = os.environ.get("HPDL_GRADE_RESULTS")
    if not path:
        return
    entry = result.to_dict()
    entry["function"] = code.get("name")
    entry["time"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
