"""Client side (the learner's kernel, or the grader): one hpdl.check() call from start to finish.

Find the learner's function (given, on rank 0 of the running cluster, or in the notebook),
refuse the kit's own functions, plan the cases per rank count, run them (jobs.py: the
learner's ranks and the checker's reference ranks, side by side) and gather a CheckResult.

Under `hpdl grade` ($HPDL_GRADE_SERVICE set) the kernel is the submission's, so it decides
nothing: it hands the packed function to the grader (grade_service.py), which runs the
check with the exercise's own rank counts, time limits and hidden cases, keeps the result,
and sends back a copy for the notebook to show. $HPDL_GRADE=1 alone (grade mode without the
grader) also ignores the learner's ranks=, grade=, timeout= and cases=. With $HPDL_GRADE_RESULTS
set (tests), each result is appended there as a JSON line.
"""
from __future__ import annotations

import json
import os
import time
import types

from hpdl.checker import cases as case_api
from hpdl.checker import grade_mode, source
from hpdl.checker.checking import check_code
from hpdl.checker.report import CheckResult
from hpdl import settings
from hpdl.errors import HpdlError


def forced_grade_mode() -> bool:
    """Grading set up by the instructor (the environment), not asked for by the learner's call."""
    return grade_mode(None)


def run_check(name: str, fn=None, *, ranks=None, grade: bool | None = None, timeout: float | None = None,
              cases=None, caller=None) -> CheckResult:
    if forced_grade_mode():  # the exercise's own rank counts, time limits and hidden cases: every case
        ranks, grade, timeout, cases = None, True, None, None
    if settings.GRADE_SERVICE.is_set():  # being graded: the case modules are hidden here, the grader has them
        from hpdl.checker import grade_service

        return grade_service.request(name, learner_code(name, fn, caller))
    module = case_api.load(name)
    code = learner_code(name, fn, caller)
    result = check_code(name, module, code, ranks=ranks, grading=grade_mode(grade), timeout=timeout, only=cases)
    _record(result, code)  # only where $HPDL_GRADE_RESULTS names a file (tests)
    return result


# -- the learner's function ---------------------------------------------------------------------

def _running_cluster():
    """The learner's running cluster, or None (also where ipyparallel is missing: a check needs none)."""
    try:
        from hpdl.cluster import running
    except ImportError:
        return None
    return running()


def learner_code(name: str, fn, caller=None) -> dict:
    """The packed function: `fn` itself, else `name` from rank 0 of the cluster, else from the caller."""
    if fn is not None:
        return _package(fn, name)
    problem = None
    c = _running_cluster()
    running = c is not None
    if running:
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
        "import hpdl.checker.source as _hpdl_source\n"
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


def _record(result: CheckResult, code: dict) -> None:
    path = settings.GRADE_RESULTS.get()
    if not path:
        return
    entry = result.to_dict()
    entry["function"] = code.get("name")
    entry["time"] = time.time()
    with open(path, "a") as f:
        f.write(json.dumps(entry) + "\n")
