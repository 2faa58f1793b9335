"""The checker's faces: arguments, messages, the result table, reading source, and the path
that fetches a function defined under %%px from rank 0 of a real cluster."""
from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

import hpdl
from hpdl.checker import source
from hpdl.checker.jobs import UNWITNESSED
from hpdl.checker.report import CaseResult, CheckResult
from hpdl.errors import HpdlError

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import learner_ring as L  # noqa: E402


def _result() -> CheckResult:
    cases = [CaseResult("ring_allreduce", f"n={n}", p, "PASS", 1, 1) for p in (1, 2) for n in (3, 4)]
    cases += [
        CaseResult("ring_allreduce", "n=7", 3, "WRONG", 0, 1, message="Wrong on ranks 1, 2: 3 of 7 values wrong.",
                   wrong_ranks=[1, 2], hint="only rank 0 ends with the full sum", max_error=2.5),
        CaseResult("ring_allreduce", "n=9", 3, "HANG", 0, 1, message="Not finished after 2 s: rank 0 at line 4.",
                   stuck={0: "line 4 in f: comm.Recv(buf)"}, finished=[1, 2]),
        CaseResult("ring_allreduce", "n=10", 3, "SLOW", 1, 1, message="Right result, but slow."),
    ]
    return CheckResult("ring_allreduce", cases, hidden_not_run=3, seconds=1.5, hints=["Hint: look at the chunks."])


def test_result_counts_points_and_shows_a_compact_table():
    r = _result()
    assert r.score == 5 and r.max_score == 7 and not r.passed
    assert r.verdicts["3 ranks · n=9"] == "HANG" and r.verdicts["1 ranks · n=3"] == "PASS"
    assert [c.name for c in r.find(verdict="WRONG")] == ["n=7"]
    html = r._repr_html_()
    assert html.count("<tr>") == 1 + 4  # header, one folded PASS row (1, 2 ranks), WRONG, HANG, SLOW
    for text in ("PASS", "WRONG", "HANG", "SLOW", "5/7 points", "only rank 0", "3 hidden cases", "look at the chunks"):
        assert text in html
    text = repr(r)
    assert "ring_allreduce: 5/7 points" in text and "1, 2 ranks" in text and "HANG" in text


def test_result_survives_json_for_the_grader():
    r = _result()
    back = CheckResult.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back.verdicts == r.verdicts and back.score == r.score
    assert back.cases[5].stuck == {0: "line 4 in f: comm.Recv(buf)"}


def test_messages_are_escaped_in_html():
    r = CheckResult("x", [CaseResult("x", "<b>case</b>", 1, "ERROR", 0, 1, message="raised <script>alert(1)</script>")])
    html = r._repr_html_()
    assert "<script>" not in html and "&lt;script&gt;" in html


def test_hpdl_check_is_a_plain_function_even_after_the_checker_is_imported():
    import inspect

    import hpdl.checker.client  # noqa: F401  (a subpackage binds its name on hpdl: not `check`)
    import hpdl.checker.report  # noqa: F401

    assert inspect.isfunction(hpdl.check) and hpdl.check.__module__ == "hpdl"
    assert "check" in hpdl.__all__
    with pytest.raises(HpdlError, match="No checks for an exercise named 'no_such_exercise'"):
        hpdl.check("no_such_exercise", L.ring_ok)


@pytest.mark.parametrize("kwargs, match", [
    ({"ranks": 0}, "between 1 and"), ({"ranks": "four"}, "rank count"), ({"timeout": -1}, "positive"),
])
def test_bad_arguments_get_a_clear_message(kwargs, match):
    with pytest.raises(HpdlError, match=match):
        hpdl.check("ring_allreduce", L.ring_ok, **kwargs)


def test_cases_runs_again_only_the_cases_named_and_says_so(no_strays):
    """A learner mending the one case that failed runs it alone; the result says the others did not run.
    Grading asked for in the same call runs every case, and a name no case has lists the cases."""
    every = hpdl.check("ring_allreduce", L.ring_bad_chunks, ranks=[3])
    # those right but not counted while the large case is wrong (jobs.void_unwitnessed) are not the ones to mend
    wrong = [c.name for c in every.cases if not c.verdict.earns_points and c.rejected != UNWITNESSED]
    assert wrong and len(wrong) < len(every.cases), every
    assert f"ranks=3, cases={wrong[0]!r}) runs that case alone" in " ".join(every.hints), every.hints
    again = hpdl.check("ring_allreduce", L.ring_bad_chunks, ranks=[3], cases=[wrong[0]])
    assert [c.name for c in again.cases] == [wrong[0]] and not again.passed
    assert f"{len(every.cases) - 1} others did not" in " ".join(again.hints) and "Tip" not in " ".join(again.hints)
    with pytest.raises(HpdlError, match=r"named like 'n=0'\. Its cases: .*n=9 float64"):
        hpdl.check("ring_allreduce", L.ring_bad_chunks, ranks=[3], cases="n=0")
    with pytest.raises(HpdlError, match="Grading runs every case"):
        hpdl.check("ring_allreduce", L.ring_bad_chunks, ranks=[3], grade=True, cases=wrong[0])
    with pytest.raises(HpdlError, match="cases= takes"):
        hpdl.check("ring_allreduce", L.ring_bad_chunks, ranks=[3], cases=[3])


def test_not_a_function_and_no_function_found():
    with pytest.raises(HpdlError, match="needs your function"):
        hpdl.check("ring_allreduce", 42)
    with pytest.raises(HpdlError, match="No function named 'ring_allreduce' found"):
        hpdl.check("ring_allreduce")


def test_missing_mpiexec_says_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    from hpdl import launchers

    launchers._IMPLEMENTATION.clear()  # what each mpiexec is, remembered per path
    with pytest.raises(HpdlError, match="make lab"):
        hpdl.check("ring_allreduce", L.ring_ok, ranks=[1])


def test_source_scan_finds_collectives_but_not_local_numpy_reductions():
    code = source.package(L.ring_uses_allreduce)
    found = source.forbidden_calls(code["sources"], {"Allreduce", "reduce"})
    assert [(f["name"], f["call"]) for f in found] == [("Allreduce", "comm.Allreduce()")]
    line = next(i for i, s in enumerate((FIXTURES / "learner_ring.py").read_text().splitlines(), 1) if "# LIBRARY" in s)
    assert found[0]["line"] == line
    local = textwrap.dedent("""
        def f(comm, chunks):
            total = np.add.reduce(chunks)
            return functools.reduce(lambda a, b: a + b, chunks) + total
    """)
    assert source.forbidden_calls([{"name": "f", "firstline": 1, "source": local}], {"reduce"}) == []
    sneaky = [{"name": "g", "firstline": 10, "source": "def g(c, x):\n    return c.Dup().reduce(x)\n"}]
    assert source.forbidden_calls(sneaky, {"reduce"})[0]["line"] == 11


def test_the_source_scan_parses_no_megabytes_in_the_graders_process():
    """A check request's sources may hold 4 MiB (grade_service.MAX_SOURCE_CHARS): as one list display of two
    million names, ast.parse took the grader 2.9 GB and 8 s holding Python's lock, for a hint. Sources past
    the scan's bound are skipped, the function beside them still scanned."""
    import tracemalloc

    bomb = {"name": "cell", "firstline": 1, "source": "Allreduce; x = [" + "a," * 1_999_990 + "]"}
    sneaky = {"name": "g", "firstline": 10, "source": "def g(c, x):\n    return c.Allreduce(x)\n"}
    tracemalloc.start()
    try:
        found = source.forbidden_calls([bomb, sneaky], {"Allreduce"})
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [f["func"] for f in found] == ["g"] and peak < 64 * 2**20, peak


def test_package_carries_helpers_and_their_lines():
    code = source.package(L.ring_collective_one_rank)  # calls ring_ok, defined elsewhere in the file
    names = {s["name"] for s in code["sources"]}
    assert names == {"ring_collective_one_rank", "ring_ok"}
    assert str(FIXTURES / "learner_ring.py") in code["lines"] and code["pickled"]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_function_defined_under_px_is_fetched_from_rank_0(no_strays):
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    hpdl.start(n=2, frameworks=(), quiet=True)
    try:
        cell = textwrap.dedent("""\
            %%px
            import numpy as np
            def ring_allreduce(comm, x):
                p, r = comm.Get_size(), comm.Get_rank()
                out = x.copy()
                buf = np.empty_like(x)
                for _ in range(p - 1):
                    comm.Recv(buf, source=(r - 1) % p)
                    comm.Send(x, dest=(r + 1) % p)
                    out += buf
                return out
        """)
        assert ip.run_cell(cell).success
        result = hpdl.check("ring_allreduce", ranks=[1, 2], timeout=2)
        assert all(c.verdict.earns_points for c in result.find(ranks=1))
        hang = result.find(ranks=2)[0]
        assert hang.verdict == "HANG" and sorted(hang.stuck) == [0, 1]
        # numbered as JupyterLab shows the cell: %%px is line 1, the Recv is line 8
        assert hang.line["line"] == 8 and "comm.Recv(buf" in hang.line["code"]
        # the engines' own names (rank, world_size) mean each check rank's own values
        assert ip.run_cell(textwrap.dedent("""\
            %%px
            def average_gradients(c, grads):
                for g in grads:
                    c.Allreduce(MPI.IN_PLACE, g)
                    g /= world_size
                return grads if rank >= 0 else None
        """)).success
        assert ip.run_cell("%px from mpi4py import MPI").success
        assert hpdl.check("average_gradients", ranks=[1, 3]).passed
        with pytest.raises(HpdlError, match="No function named 'bcast_binomial' found on rank 0"):
            hpdl.check("bcast_binomial")
    finally:
        hpdl.stop(quiet=True)


def test_a_cases_time_limit_stretches_where_its_ranks_outnumber_the_cores():
    """Ranks that outnumber the cores take turns: right code at 7 ranks on 2 cores (pickled sends of the large
    case's 100 003 values) was cut off at the exercise's 5 s as a hang. A learner's own timeout= stays as given."""
    import os

    from hpdl.checker import cases, checking

    module = cases.load("recursive_doubling")
    cores = len(os.sched_getaffinity(0))
    plan, _ = checking._plan(module, [1, 7], True, None)
    for size, todo in plan.items():
        for planned in todo:
            own = planned.case.timeout or module.TIMEOUT
            assert planned.timeout == own * max(1.0, size / cores), (size, planned.case.name, planned.timeout)
    assert [p.case.timeout for p in plan[7] if "large" in p.case.name] == [15.0]
    assert {p.timeout for todo in checking._plan(module, [7], True, 3)[0].values() for p in todo} == {3.0}
    # the grader's --jobs 4: four checks' ranks may share the cores
    at_once = checking._plan(module, [2], True, None, at_once=4)[0][2]
    assert {p.timeout / (p.case.timeout or module.TIMEOUT) for p in at_once} == {max(1.0, 8 / cores)}


def _ps_by_pickled_irecvs(comm, grads, params, lr):
    """A parameter server whose pickled irecv()s have no buffer: mpi4py gives each room for 32 KiB."""
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        got = MPI.Request.waitall([comm.irecv(source=w, tag=7) for w in range(1, size)])
        new = params - lr * sum(got) / (size - 1)
        for w in range(1, size):
            comm.send(new, dest=w, tag=8)
        return new
    comm.send(grads, dest=0, tag=7)
    return comm.recv(source=0, tag=8)


def test_a_message_longer_than_its_receive_buffer_is_named_with_what_to_do(no_strays):
    """From a waitall, MPI says only 'see the MPI_ERROR field in MPI_Status': the hint says what it was."""
    result = hpdl.check("ps_exchange", _ps_by_pickled_irecvs, ranks=[2], grade=True)  # its large case: hidden
    errors = [c for c in result.cases if c.verdict == "ERROR"]
    assert errors and all("MPI_ERROR" in c.message and "32 KiB" in (c.hint or "") for c in errors), result


def test_a_numpy_scalar_of_raw_bytes_counts_its_bytes_as_values():
    """A structured or void numpy scalar carries any bytes as one item: pickled, a whole gradient in one 'value'
    went by the counts of zero1_step (18/18 for plain data parallelism) and of the ring (a chain, 27/27)."""
    import numpy as np

    from hpdl.checker.recording import _elements

    gradient = np.arange(1000, dtype=np.float32)
    packed = np.frombuffer(gradient.tobytes(), dtype=[("raw", "u1", (gradient.nbytes,))])[0]
    assert _elements(packed) == 1000 and _elements(np.array([packed, packed])) == 2000
    assert _elements(gradient) == 1000 and _elements(np.float64(1.0)) == 1
