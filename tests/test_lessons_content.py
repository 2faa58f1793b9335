"""What the lessons must (and must not) contain.

* Each lesson asks for at least two predictions before measuring: code cells tagged `prediction`
  that assign a `prediction_NN_*` variable, which a later cell compares with the measurement.
* Each lesson ends with a summary ("What you have seen") and a pointer onward ("Next").
* Lesson 04 does not give its exercise away: no function in notebooks/ or exercises/ is a working
  chunked ring (each rank sends ≈ 2(p−1)/p·n bytes) or recursive doubling (lg p messages per
  rank). Every two-argument function found in those notebooks runs on 4 real MPI ranks with a
  communicator that counts what each rank sends; the same detector must recognise the solutions'
  ring and recursive doubling, and the lesson's naive ring must still be a correct allreduce.
"""
from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[1]
LESSONS = sorted((ROOT / "notebooks").glob("0[0-8]_*.ipynb"))
ALL_LESSONS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
BIN = Path(sys.executable).parent


def _code(nb) -> list[tuple[int, str]]:
    """(index, Python source) of each code cell, IPython magics and shell lines removed."""
    cells = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        lines = [line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        cells.append((i, "\n".join(lines)))
    return cells


@pytest.mark.parametrize("path", ALL_LESSONS, ids=lambda p: p.name)  # every lesson asks for predictions
def test_lesson_has_two_predictions_each_compared_later(path):
    nb = nbformat.read(path, as_version=4)
    number = path.name[:2]
    predictions = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and re.search(rf"^prediction_{number}_\w+\s*=\s*None\b", cell.source, re.M):
            assert "prediction" in cell.metadata.get("tags", []), f"{path.name} cell {i}: tag it `prediction`"
        if "prediction" in cell.metadata.get("tags", []):
            assert cell.cell_type == "code", f"{path.name} cell {i}: a prediction cell must be code"
            names = re.findall(rf"^(prediction_{number}_\w+)\s*=\s*None\b", cell.source, re.M)
            assert names, f"{path.name} cell {i}: assign prediction_{number}_<name> = None  # your answer: …"
            predictions += [(i, name) for name in names]
    assert len(predictions) >= 2, f"{path.name}: {len(predictions)} prediction cells, need at least 2"
    for i, name in predictions:
        on_ranks = [j for j, cell in enumerate(nb.cells) if cell.cell_type == "code" and j > i
                    and cell.source.lstrip().startswith("%%px") and "--local" not in cell.source.split("\n")[0]
                    and name in cell.source]
        assert not on_ranks, f"{path.name}: {name} lives in the notebook's kernel, not on the ranks (cells {on_ranks})"
        later = [j for j, src in _code(nb) if j > i and name in src]
        assert later, f"{path.name}: {name} (cell {i}) is never compared with a measurement"
        assert any(f"{name} is not None" in src or f"{name} is None" in src for j, src in _code(nb) if j in later), (
            f"{path.name}: the comparison of {name} must handle a learner who did not predict (None)")


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.name)
def test_lesson_ends_with_summary_and_next(path):
    nb = nbformat.read(path, as_version=4)
    last = nb.cells[-1]
    assert last.cell_type == "markdown", f"{path.name}: the last cell should be the summary"
    seen, nxt = last.source.find("## What you have seen"), last.source.find("## Next")
    assert seen >= 0 and nxt > seen, f"{path.name}: end with '## What you have seen' and then '## Next'"
    assert len(last.source[nxt:].split()) > 4, f"{path.name}: 'Next' should say where to go"


def test_welcome_lists_every_lesson_with_a_run_time():
    text = nbformat.read(ROOT / "notebooks" / "00_welcome.ipynb", as_version=4).cells[0].source
    rows = re.findall(r"^\| (\d\d) \|.*\| (≈ [\d.]+ min) \|$", text, re.M)
    assert [r[0] for r in rows] == [f"{n:02d}" for n in range(12)], rows
    assert "in preparation" not in text


KIT_LAUNCH = re.compile(r"\b(job_command|side_job_command)\(")


@pytest.mark.parametrize("path", ALL_LESSONS, ids=lambda p: p.name)
def test_a_lessons_own_mpi_jobs_start_as_the_kit_says_wherever_it_runs(path):
    """A cell that starts an MPI job of its own takes the command from hpdl (job_command or
    side_job_command): inside a Slurm job (Open OnDemand, the workshop hub) a bare mpiexec goes
    through srun and waits for the CPUs the engines hold, until its timeout. Only while no ranks
    run (after hpdl.stop()) may a cell call this venv's mpiexec (mpiexec_command: lesson 08's
    placements, whose binding is the point)."""
    nb = nbformat.read(path, as_version=4)
    running = False
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if "hpdl.stop()" in cell.source:
            running = False
        code = "\n".join(line.split("#")[0] for line in cell.source.splitlines())  # comments may name them
        mentions = re.search(r"\bmpiexec\b|\bsrun\b", code)
        if mentions and not KIT_LAUNCH.search(cell.source):
            assert "mpiexec_command(" in cell.source and not running, (
                f"{path.name}, cell {i}: starts an MPI job with a command of its own; use hpdl.job_command(n)")
        if "hpdl.start(" in cell.source:
            running = True


PROCESS_CALLS = re.compile(r"\bsubprocess\.(run|Popen|call|check_call|check_output)\(")


@pytest.mark.parametrize("path", ALL_LESSONS, ids=lambda p: p.name)
def test_a_lessons_jobs_run_through_the_kit_so_a_time_limit_ends_all_of_them(path):
    """A cell that runs a job of its own calls hpdl.run_job, not subprocess: at its time limit
    subprocess.run kills the first process only and raises TimeoutExpired (a traceback); lesson 06's
    emulated-node job then left its ranks running and two network namespaces behind."""
    nb = nbformat.read(path, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            assert not PROCESS_CALLS.search(cell.source), f"{path.name}, cell {i}: use hpdl.run_job(cmd, timeout=...)"


# -- lesson 04 gives no ring away -------------------------------------------------------------

RANKS = 4
CLASSIFY = r'''
import json, pickle, sys
import numpy as np
from mpi4py import MPI

SENDS = {"Send", "Ssend", "Isend", "Issend", "Rsend", "Sendrecv", "send", "isend", "ssend", "sendrecv"}
COLLECTIVES = {"Allreduce", "Reduce", "Bcast", "Allgather", "Gather", "Scatter", "Reduce_scatter",
               "Reduce_scatter_block", "Alltoall", "allreduce", "reduce", "bcast", "allgather", "gather",
               "scatter", "alltoall", "Iallreduce", "Ireduce", "Ibcast"}


class Counting:
    """A communicator that counts what this rank sends and refuses collectives."""

    def __init__(self, comm):
        self.comm, self.messages, self.nbytes = comm, 0, 0

    def __getattr__(self, name):
        attr = getattr(self.comm, name)
        if name in COLLECTIVES:
            raise RuntimeError(f"collective {name}")
        if name in SENDS:
            def counted(*args, **kwargs):
                buf = args[0] if args else kwargs.get("sendbuf", kwargs.get("buf", kwargs.get("obj")))
                self.messages += 1
                self.nbytes += buf.nbytes if hasattr(buf, "nbytes") else len(pickle.dumps(buf))
                return attr(*args, **kwargs)
            return counted
        return attr


world = MPI.COMM_WORLD
sources = json.load(open(sys.argv[1]))
verdicts = {}
for label, (name, source) in sources.items():
    comm = world.Dup()
    namespace = {"np": np, "MPI": MPI}
    verdict = {"correct": False, "messages": None, "sent_per_n": None, "error": None}
    try:
        exec(source, namespace)
        fn = namespace[name]
        x = np.random.default_rng(comm.Get_rank()).standard_normal(1000)
        expected = np.empty_like(x)
        comm.Allreduce(x, expected)
        counting = Counting(comm)
        got = fn(counting, x.copy())
        ok = got is not None and np.shape(got) == x.shape and np.allclose(got, expected)
        verdict.update(correct=bool(ok), messages=counting.messages, sent_per_n=counting.nbytes / x.nbytes)
    except BaseException as exc:  # a candidate that is not an allreduce at all
        verdict["error"] = f"{type(exc).__name__}: {exc}"[:200]
    everyone = comm.allgather(verdict)
    comm.Free()
    verdicts[label] = {
        "correct": all(v["correct"] for v in everyone),
        "messages": max((v["messages"] or 0) for v in everyone),
        "sent_per_n": max((v["sent_per_n"] or 0.0) for v in everyone),
        "errors": sorted({v["error"] for v in everyone if v["error"]}),
    }
if world.Get_rank() == 0:
    print("VERDICTS " + json.dumps(verdicts))
'''


def _two_argument_functions(path: Path) -> dict[str, tuple[str, str]]:
    """Every top-level function of two positional arguments in the notebook's code cells."""
    nb = nbformat.read(path, as_version=4)
    found = {}
    for index, source in _code(nb):
        try:
            tree = ast.parse(textwrap.dedent(source))
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and len(node.args.args) == 2 and not node.args.vararg:
                label = f"{path.parent.name}/{path.name}:cell {index}:{node.name}"
                found[label] = (node.name, ast.get_source_segment(textwrap.dedent(source), node))
    return found


def _kind(verdict: dict) -> str:
    if not verdict["correct"]:
        return "not an allreduce"
    if verdict["sent_per_n"] <= 2 * (RANKS - 1) / RANKS + 0.1:
        return "bandwidth-optimal (chunked ring or similar)"
    if verdict["messages"] <= 2:  # lg 4
        return "recursive doubling"
    return "naive"


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    candidates = {}
    for folder in ("notebooks", "exercises"):
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            candidates.update(_two_argument_functions(path))
    candidates.update(_two_argument_functions(ROOT / "solutions" / "04_ring_allreduce.ipynb"))
    work = tmp_path_factory.mktemp("ring-detector")
    (work / "sources.json").write_text(json.dumps(candidates))
    (work / "classify.py").write_text(CLASSIFY)
    cmd = [str(BIN / "mpiexec"), "-n", str(RANKS), sys.executable, str(work / "classify.py"),
           str(work / "sources.json")]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"a candidate function hung on {RANKS} ranks:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("VERDICTS "))
    return json.loads(line[len("VERDICTS "):])


def _labelled(verdicts: dict, prefix: str, name: str) -> dict:
    hits = [v for label, v in verdicts.items() if label.startswith(prefix) and label.endswith(f":{name}")]
    assert hits, f"no function {name} found in {prefix}"
    return hits[0]


@pytest.mark.slow
def test_detector_recognises_the_solutions(verdicts, no_strays):
    """The detector can fail: it must classify the solutions' ring and recursive doubling as such."""
    ring = _labelled(verdicts, "solutions/04_ring_allreduce.ipynb", "ring_allreduce")
    doubling = _labelled(verdicts, "solutions/04_ring_allreduce.ipynb", "recursive_doubling")
    assert _kind(ring) == "bandwidth-optimal (chunked ring or similar)", ring
    assert _kind(doubling) == "recursive doubling", doubling


@pytest.mark.slow
def test_lesson_04_keeps_a_working_naive_ring(verdicts, no_strays):
    naive = _labelled(verdicts, "notebooks/04_ring_allreduce.ipynb", "naive_ring_allreduce")
    assert _kind(naive) == "naive", naive
    assert naive["sent_per_n"] == pytest.approx(RANKS - 1), naive


@pytest.mark.slow
def test_no_ring_or_recursive_doubling_outside_solutions(verdicts, no_strays):
    given_away = {label: _kind(v) for label, v in verdicts.items()
                  if not label.startswith("solutions/") and _kind(v) not in ("not an allreduce", "naive")}
    assert not given_away, f"complete allreduce algorithms outside solutions/: {given_away}"
    checked = [label for label in verdicts if not label.startswith("solutions/")]
    assert any("exercises/04_ring_allreduce.ipynb" in label for label in checked), (
        "exercise 04's functions were not examined")
