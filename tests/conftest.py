"""Shared test set-up: a private HPDL_HOME, the venv's tools on PATH, and no stray processes."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SHM = Path("/dev/shm")
# MPI's shared-memory files between ranks: MPICH's, and Open MPI's (its sm transport)
SHM_PATTERNS = ("mpich_shm_*", "sm_segment.*")


def mpi_shared_memory() -> set[Path]:
    return {f for pattern in SHM_PATTERNS for f in SHM.glob(pattern)}


@pytest.fixture(scope="session", autouse=True)
def _environment(tmp_path_factory):
    home = tmp_path_factory.mktemp("hpdl-home")
    os.environ["HPDL_HOME"] = str(home)
    os.environ["IPP_NONINTERACTIVE"] = "1"
    os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"
    os.environ.setdefault("MPLBACKEND", "Agg")
    yield home


def kit_processes() -> list[psutil.Process]:
    """Live processes started under this test session's HPDL_HOME (engines, controllers,
    MPI launchers, reapers, check workers); others on the machine are not ours to judge."""
    home = os.environ.get("HPDL_HOME")
    found = []
    for p in psutil.process_iter(["pid", "status"]):
        try:
            if p.pid == os.getpid() or p.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            if p.environ().get("HPDL_HOME") == home:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.fixture
def no_strays(request):
    """Fail a test that leaves engines, controllers or MPI launchers behind."""
    me = psutil.Process()
    before = {p.pid for p in kit_processes()} | {c.pid for c in me.children(recursive=True)}
    shm_before = mpi_shared_memory()
    scratch_before = _own_scratch()
    yield
    deadline = psutil.time.time() + 10
    while True:
        left = [p for p in kit_processes() if p.pid not in before]
        if not left or psutil.time.time() > deadline:
            break
        psutil.time.sleep(0.2)
    names = [" ".join(p.cmdline()[:4]) for p in left if p.is_running()]
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            pass
    assert not names, f"processes left behind: {names}"
    # MPI's shared memory between ranks lives in RAM until someone removes it. Ranks that Slurm
    # ends are Slurm's to clean (sites do it in the epilog; see cluster/README.md), so not here.
    shm_left = _new_segments(shm_before)
    for _ in range(10):  # another session's job (or worker's test) may be removing its own just now
        if not shm_left:
            break
        psutil.time.sleep(1.0)
        shm_left = [f for f in _new_segments(shm_before) if f in shm_left]
    for f in shm_left:
        Path(f).unlink(missing_ok=True)
    if not request.node.get_closest_marker("slurm"):
        assert not shm_left, f"MPI shared memory left in /dev/shm: {shm_left}"
    # a check run here removes its folder under $TMPDIR (hpdl.scratch) when it ends, whatever its verdict
    scratch_left = _own_scratch() - scratch_before
    assert not scratch_left, f"a check's folder left in the temporary directory: {sorted(scratch_left)}"


def _own_scratch() -> set[str]:
    """The scratch folders (hpdl.scratch) this test process made that are there now."""
    from hpdl import scratch

    # but the kit's modules without their answers (checking.kit_answer_copies), made once a process
    return {str(p) for p in scratch.made_by(os.getpid()) if not p.name.startswith("hpdl-answers-")}


def _new_segments(before: set[Path]) -> list[str]:
    """MPI segments made since `before` that no process of another test session maps."""
    return sorted(str(f) for f in mpi_shared_memory() - before - _others_shared_memory())


def _others_shared_memory() -> set[Path]:
    """Segments that processes outside this test session map now (another suite or a notebook
    on the same machine): not this test's leak. Ours: this process, its descendants, and the
    processes that carry this session's HPDL_HOME."""
    from hpdl import procs

    me = psutil.Process()
    ours = {me.pid} | {c.pid for c in me.children(recursive=True)} | {p.pid for p in kit_processes()}
    return {Path(f) for f in procs.shared_memory_of(p for p in psutil.pids() if p not in ours)}


# -- `make test TEST_WORKERS=N`: two parts ------------------------------------------------------------
# First the tests not marked `alone` on N workers at once (pytest-xdist), filling the time one test
# waits (a hang's timeout, a job's start, Slurm's polling, a kernel's start: a quarter of a serial run
# here). Then, one at a time, the tests whose assertions read rates or clocks, or drive a browser,
# which another test's load would disturb (ALONE: marked `alone`). Tests of the machine's one local
# Slurm share one worker (its session fixture stops a Slurm it started when that worker ends).
# Not the default: on 2 cores MPI ranks that poll while they wait made two workers barely faster.
ALONE = {"test_benchmarks", "test_emulated_nodes", "test_emulated_overlap", "test_emulated_slurm", "test_traces",
         "test_timeline", "test_course", "test_hub", "test_panel", "test_browser",
         "test_procs"}  # test_procs leaves MPI segments in /dev/shm on purpose: the other worker would see them
ONE_SLURM = {"test_slurm", "test_ood", "test_shared_kit", "test_docs_commands", "test_preflight"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.path.stem
        if module in ALONE:
            item.add_marker(pytest.mark.alone)
        elif module in ONE_SLURM:
            item.add_marker(pytest.mark.xdist_group("slurm"))


EXAMPLE = Path(__file__).parent / "fixtures" / "solutions" / "01_ring_example.ipynb"


def example_kit(kit: Path, monkeypatch) -> Path:
    """A kit folder with one exercise: the example's solution, and the exercise `hpdl build`
    makes from it (kit/exercises/ex.ipynb), as the grader's tests need them. Its check,
    fixture_ring (ring_allreduce at 1 and 3 ranks), is found through HPDL_CASES_PATH, set here
    for the test (and the graders it starts)."""
    import nbformat

    from hpdl import build

    monkeypatch.setenv("HPDL_CASES_PATH", str(Path(__file__).parent / "fixtures" / "cases"))
    (kit / "solutions").mkdir(parents=True)
    nbformat.write(nbformat.read(EXAMPLE, as_version=4), kit / "solutions" / "ex.ipynb")
    assert build.main(["--root", str(kit)]) == 0
    return kit


def deep_tree(top, depth: int, name: str = "d", file: str = "f") -> str:
    """`depth` folders one in another under `top`, made by descriptor (their path may outgrow
    PATH_MAX), and `file` in the last, holding "[1]"; the path of the first folder."""
    import os

    os.makedirs(top, exist_ok=True)
    fd = os.open(top, os.O_RDONLY)
    for _ in range(depth):
        os.mkdir(name, dir_fd=fd)
        fd, old = os.open(name, os.O_RDONLY, dir_fd=fd), fd
        os.close(old)
    with open(f"/proc/self/fd/{fd}/{file}", "w") as f:
        f.write("[1]")
    os.close(fd)
    return os.path.join(top, name)


def learner_copy(*functions):
    """The last of `functions` as a learner would write it: the same source, defined outside the
    kit (checks refuse the kit's own functions) and carrying the helpers it calls with it, so a
    test can show that a model solution passes the checks a learner meets."""
    import inspect
    import linecache
    import textwrap

    source = "\n\n".join(textwrap.dedent(inspect.getsource(f)) for f in functions)
    filename = f"<learner copy of {functions[-1].__name__}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__learner__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[functions[-1].__name__]


def passed(result) -> bool:
    """Every case of a check's result right: PASS, or SLOW (right, far slower than the reference: advisory, full
    points), which a loaded machine's clock can give any case."""
    from hpdl.checker.report import EARNS_POINTS

    return all(c.verdict in EARNS_POINTS for c in result.cases)


def hints(result) -> str:
    """Everything a check's result says to the learner: messages, hints, notes."""
    return " ".join(f"{c.message} {c.hint or ''}" for c in result.cases) + " " + " ".join(result.hints)


def rejected(result, *words: str) -> None:
    """Assert a known-bad implementation failed its check, saying each of `words`."""
    assert not passed(result), f"{result.exercise}: a known-bad implementation passed"
    text = hints(result).lower()
    for w in words:
        assert w.lower() in text, f"{result.exercise}: expected {w!r} in: {text[:800]}"


def pytest_sessionfinish(session, exitstatus):
    """Test modules that stand for a learner's code import mpi4py.MPI into this process, which
    then holds MPI's segment of a process that started MPI by itself. MPICH removes it at exit;
    Open MPI 5 leaves it in RAM (16 MB) even then, so it goes now (the mapping lives until exit)."""
    if "mpi4py.MPI" in sys.modules:
        from hpdl import procs

        procs.remove_shared_memory(procs.shared_memory_of([os.getpid()]))


# -- fresh Unix accounts for the tests that start learners (test_hub.py, test_shared_kit.py) --------

def user_processes(uid: int) -> list[psutil.Process]:
    """The live processes running as `uid` (zombies left out)."""
    found = []
    for p in psutil.process_iter(["uids", "status"]):
        try:
            if p.info["uids"].real == uid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, TypeError):
            continue
    return found


def remove_account(name: str) -> None:
    """The account, its jobs, its processes and its MPI segments: nothing of it outlives the test."""
    try:
        uid = int(subprocess.run(["id", "-u", name], capture_output=True, text=True, check=True).stdout)
    except subprocess.CalledProcessError:
        return
    subprocess.run(["scancel", "-u", name], capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while subprocess.run(["squeue", "-h", "-u", name], capture_output=True, text=True,
                         timeout=30).stdout.strip() and time.monotonic() < deadline:
        time.sleep(0.5)
    left = user_processes(uid)
    for p in left:
        try:
            p.kill()
        except psutil.Error:
            continue
    psutil.wait_procs(left, timeout=30)  # userdel refuses an account a process still runs as
    for seg in Path("/dev/shm").glob("mpich_shm_*"):
        try:
            if seg.stat().st_uid == uid:
                seg.unlink()
        except OSError:
            continue
    for _ in range(10):
        subprocess.run(["userdel", "-r", name], capture_output=True, timeout=60)
        if subprocess.run(["id", "-u", name], capture_output=True).returncode != 0:
            return
        time.sleep(1)
    raise AssertionError(f"could not remove the test's account {name}")


def solution_function(notebook: str, name: str):
    """The function `name` as defined in solutions/`notebook`, with its source lines known (a
    traceback quotes them), in a namespace holding `math` as the solution notebooks import it."""
    import linecache
    import math

    import nbformat

    nb = nbformat.read(ROOT / "solutions" / notebook, as_version=4)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and f"def {name}(" in cell.source:
            filename = f"<{notebook} cell {i}>"
            linecache.cache[filename] = (len(cell.source), None, cell.source.splitlines(True), filename)
            namespace = {"math": math, "__name__": "solution"}
            exec(compile(cell.source, filename, "exec"), namespace)
            return namespace[name]
    raise LookupError(f"no cell defines {name} in {notebook}")


def kill_then_nothing_left(proc: subprocess.Popen, tree: list, timeout: float = 15.0) -> None:
    """SIGKILL `proc` (no finally, no atexit runs in it) and assert that every process of `tree`, what it had
    started, ends within `timeout` s all the same."""
    import signal

    proc.send_signal(signal.SIGKILL)
    proc.wait()
    _, alive = psutil.wait_procs(tree, timeout=timeout)
    assert not alive, f"left behind: {[' '.join(p.cmdline()[:6]) for p in alive if p.is_running()]}"
