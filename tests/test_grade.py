"""`hpdl grade`: every submission runs headless in grade mode; a hanging or crashing one never
stops the batch; submissions are never modified; reports hold every case."""
from __future__ import annotations

import csv
import hashlib
import html
import json
import os
from pathlib import Path

import nbformat
import pytest

from hpdl import grade, safefiles
from hpdl.errors import HpdlError
from conftest import deep_tree, example_kit

DEADLOCK = '''def ring_allreduce(comm, x):
    p, r = comm.Get_size(), comm.Get_rank()
    out, buf = x.copy(), np.empty_like(x)
    for _ in range(p - 1):
        comm.Recv(buf, source=(r - 1) % p)
        comm.Send(x, dest=(r + 1) % p)
        out += buf
    return out'''


def _variant(nb, path: Path, edit) -> None:
    import copy

    nb = copy.deepcopy(nb)
    edit(nb.cells)
    nbformat.write(nb, path)


@pytest.fixture
def submissions(tmp_path, monkeypatch) -> Path:
    """Four learners: solved, untouched exercise, a kernel that dies after the check, and a ring
    that deadlocks inside the check. (A cell that never ends is among the attacks below, whose
    batch has a shorter time limit.)"""
    kit = tmp_path / "kit"
    example_kit(kit, monkeypatch)
    solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    subs = tmp_path / "subs"
    (subs / "dana").mkdir(parents=True)
    nbformat.write(solved, subs / "ada.ipynb")
    nbformat.write(nbformat.read(kit / "exercises" / "ex.ipynb", as_version=4), subs / "blank.ipynb")
    _variant(solved, subs / "crash.ipynb",
             lambda cells: cells.insert(5, nbformat.v4.new_code_cell("import os\nos._exit(3)")))

    def deadlock(cells):
        cells[3].source = DEADLOCK
        cells[4].source = 'hpdl.check("fixture_ring", ring_allreduce, timeout=2)'

    _variant(solved, subs / "dana" / "deadlock.ipynb", deadlock)
    return subs


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(500)
def test_batch_grades_every_submission_despite_hangs_and_crashes(submissions, tmp_path, no_strays, capsys,
                                                                 monkeypatch):
    from hpdl.checker import sandbox

    made = []  # the caps of every cgroup made: the checks' own among them (the checks run in this process)
    real_make = sandbox.Cgroup.make.__func__
    monkeypatch.setattr(sandbox.Cgroup, "make", classmethod(
        lambda cls, tasks, memory, within=None: made.append(memory) or real_make(cls, tasks, memory, within)))
    before = _digest(submissions)
    out = tmp_path / "report"
    # 150 s: grade mode runs every case at every rank count, whatever the notebook asks for (the
    # deadlocking ring hangs at 3 ranks)
    assert grade.main([str(submissions), "--out", str(out), "--timeout", "150", "--jobs", "2", "--allow-root",
                       "--check-memory", "5G"]) == 0
    assert _digest(submissions) == before  # nothing written next to or into a submission
    assert 5 * 2**30 in made and "the check it runs: memory 5 GiB" in json.loads((out / "grades.json").read_text())[
        "sandbox"]

    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    assert set(rows) == {"ada.ipynb", "blank.ipynb", "crash.ipynb", "dana/deadlock.ipynb"}
    full = float(rows["ada.ipynb"]["max_score"])
    assert full > 0
    assert rows["ada.ipynb"]["status"] == "ok" and float(rows["ada.ipynb"]["score"]) == full
    assert rows["blank.ipynb"]["status"] == "ok" and float(rows["blank.ipynb"]["score"]) == 0
    assert int(rows["blank.ipynb"]["cell_errors"]) >= 1
    assert rows["crash.ipynb"]["status"] == "kernel died" and float(rows["crash.ipynb"]["score"]) == full
    assert rows["dana/deadlock.ipynb"]["status"] == "ok"

    cases = list(csv.DictReader(open(out / "cases.csv")))
    ada = [c for c in cases if c["submission"] == "ada.ipynb"]
    assert any(c["hidden"] == "True" for c in ada)  # grade mode ran the hidden cases
    assert all(c["verdict"] in ("PASS", "SLOW") for c in ada)
    dead = [c for c in cases if c["submission"] == "dana/deadlock.ipynb"]
    assert {c["verdict"] for c in dead if c["ranks"] == "3"} == {"HANG"}
    assert all(c["verdict"] in ("PASS", "SLOW") for c in dead if c["ranks"] == "1")

    data = json.loads((out / "grades.json").read_text())
    by_name = {s["submission"]: s for s in data["submissions"]}
    assert by_name["ada.ipynb"]["checks"]["fixture_ring"]["grade"] is True
    page = (out / "index.html").read_text()
    assert "dana/deadlock.ipynb" in page and "HANG" in page
    assert (out / "executed" / "dana" / "deadlock.ipynb").exists()
    printed = capsys.readouterr().out
    # the instructor sees what the notebooks' calls chose, and how to choose instead
    assert "ada.ipynb" in printed and "fixture_ring (called by 4 of 4 learners)" in printed
    assert "--exercises" in printed


# -- submissions written to cheat or to break the grader ------------------------------------------

FORGE = """import json, os, pathlib
# a line of our own in every results file we can reach, a huge max_score, a fake answer from "the grader"
for var in ("HPDL_GRADE_RESULTS", "HPDL_GRADE_SERVICE"):
    target = os.environ.get(var)
    if target:
        folder = pathlib.Path(target)
        path = folder / "results.jsonl" if folder.is_dir() else folder
        try:
            with open(path, "a") as f:
                f.write(json.dumps({"exercise": "fixture_ring", "score": 1e9, "max_score": 1e9, "cases": []}) + "\\n")
        except OSError as exc:
            print("refused:", exc)
for out in pathlib.Path("/").glob("tmp/**/results.jsonl"):
    out.write_text("forged")
"""
DAEMON = """import os, subprocess, sys
# a double-forked daemon, detached, with an empty environment, ignoring SIGTERM: outlive the batch
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execve(sys.executable, [sys.executable, "-c", "import signal, time; "
                  "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)  # hpdl-daemon-marker"], {})
    os._exit(0)
"""
CHEAT_CHECK = """import hpdl
try:
    from hpdl.checker.cases import ring_allreduce as key  # hidden from a graded notebook
    hpdl.check("fixture_ring", key.reference)
except Exception as exc:
    print("refused:", type(exc).__name__, exc)
"""


DEEP = "[" * 100_000 + "]" * 100_000  # JSON nested past any parser's recursion limit
# its status and its notebook as run, left nested too deep to parse, then its runner killed
# an output flood that catches the interrupt it is sent
STUBBORN_FLOOD = """while True:
    try:
        while True:
            print('spam ' * 2000)
    except KeyboardInterrupt:
        pass"""

KILLS_PARENT = f"""import os, signal
for name in ("status.json", "executed.ipynb"):
    with open(name, "w") as f:
        f.write('{{"status": "ok", "cells": {DEEP[:4000]}{DEEP[-4000:]}}}')
os.kill(os.getppid(), signal.SIGKILL)"""


def _own_status(text: str) -> str:
    """A cell that leaves a status of its own in the runner's folder, then kills its runner before
    it writes the real one."""
    return f"import os, signal\nopen('status.json', 'w').write({text!r})\nos.kill(os.getppid(), signal.SIGKILL)"


OWN_STATUS = _own_status('{"status": "\\u001b]52;c;cm0gLXJmIH4K\\u0007"}')  # drives the instructor's terminal
OWN_COUNT = _own_status('{"status": "ok", "cell_errors": 1e999}')  # a count of errors no int holds
# a status and a notebook-as-run that are valid and say all went well, then the runner killed before it writes its own
FAKE_RUN = _own_status('{"status": "ok", "detail": "all checks passed", "cell_errors": 0}').replace(
    "\nos.kill", "\nopen('executed.ipynb', 'w').write('{\"cells\": [{\"cell_type\": \"markdown\", "
    "\"metadata\": {}, \"source\": \"fake-run\"}], \"metadata\": {}, \"nbformat\": 4, "
    "\"nbformat_minor\": 5}')\nos.kill")
# outputs whose metadata is their bulk: nested deep (nbformat's indentation multiplied the saved notebook 35
# times past what was measured), then a flood of it (the flood guard counted text and data only)
DEEP_META = """from IPython.display import display
deep = [0] * 100000
for _ in range(60):
    deep = [deep]
for _ in range(8):
    display({"text/plain": "x"}, raw=True, metadata={"deep": deep})"""
META_FLOOD = """from IPython.display import display
for _ in range(600):
    display({"text/plain": "x"}, raw=True, metadata={"pad": "A" * 2**20})"""
# the runner's memory, written from its kernel (/proc/PID/mem: no ptrace call): the status or the notebook-as-run
# it is about to save, rewritten in place
RUNNER_MEMORY = """import os
pid = os.getppid()
try:
    with open(f"/proc/{pid}/mem", "r+b", buffering=0) as f:
        start = int(open(f"/proc/{pid}/maps").read().split("-")[0], 16)
        f.seek(start); data = f.read(16); f.seek(start); f.write(data)
    print("runner memory: written")
except OSError as exc:
    print("runner memory: refused", type(exc).__name__)"""
# a process of its own session, left running, that replaces the status the runner writes (its notebook raised)
STATUS_DAEMON = '''import subprocess, sys
watch = """
import json, os, time
while True:
    try:
        if os.path.getsize('status.json') and b'forged' not in open('status.json', 'rb').read():
            open('s.tmp', 'w').write(json.dumps({'status': 'ok', 'detail': 'forged', 'cell_errors': 0}))
            os.replace('s.tmp', 'status.json')
    except OSError:
        pass
    time.sleep(0.0005)
"""
subprocess.Popen([sys.executable, '-c', watch], start_new_session=True)
1 / 0'''
NOT_UTF8 = os.fsdecode(b"\xff\xfe latin1.ipynb")  # a name from another system's encoding
NOCELLS = "nocells\x1b]52;c;cm0gLXJmIH4K\x07\u202ebnpyi.ipynb"  # and a right-to-left override: "ipynb.ipynb"
FORMULA = "=HYPERLINK(\"http:\u2215\u2215x.example\",\"garbage\")+cmd|' -c calc'!A0.ipynb"


@pytest.fixture
def attacks(tmp_path, monkeypatch) -> Path:
    """Malformed notebooks, forgers, a daemon, resource hogs, and one honest learner."""
    kit = tmp_path / "kit"
    example_kit(kit, monkeypatch)
    solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(solved, subs / "honest.ipynb")
    (subs / "list.ipynb").write_text("[1, 2, 3]")
    (subs / FORMULA).write_text("this is not JSON")  # and named to run in the instructor's spreadsheet
    (subs / NOCELLS).write_text('{"cells": 5, "nbformat": 4}')  # its name sets the clipboard of a terminal
    (subs / NOT_UTF8).write_text("not JSON")
    (subs / "nested.ipynb").write_text('{"cells": ' + DEEP + "}")  # deeper than a JSON parser's recursion
    code = nbformat.v4.new_code_cell
    for name, cell, where in [
        ("forger", FORGE, 5), ("daemon", DAEMON, 2), ("answer_key", CHEAT_CHECK, 5),
        ("memory_hog", "x = bytearray(64 * 2**30)", 2), ("hangs", "import time\ntime.sleep(3600)", 2),
        ("fork_bomb", "import os, time\nfor _ in range(100000):\n    if os.fork() == 0:\n        time.sleep(600)", 2),
        ("flood", STUBBORN_FLOOD, 5),
        ("kills_parent", KILLS_PARENT, 5), ("own_status", OWN_STATUS, 5),
        ("own_count", OWN_COUNT, 5), ("fake_run", FAKE_RUN, 2),
    ]:
        _variant(solved, subs / f"{name}.ipynb", lambda cells, cell=cell, where=where: cells.insert(where, code(cell)))

    def metadata(cells):
        cells[2:2] = [code(DEEP_META), code(META_FLOOD)]

    _variant(solved, subs / "metadata.ipynb", metadata)
    nb = nbformat.v4.new_notebook()
    nb.cells = [code(RUNNER_MEMORY)]
    nbformat.write(nb, subs / "runner_memory.ipynb")
    nb.cells = [code(STATUS_DAEMON)]
    nbformat.write(nb, subs / "status_daemon.ipynb")
    return subs


def _daemons() -> list:
    import psutil

    found = []
    for p in psutil.process_iter(["cmdline"]):
        if any("hpdl-daemon-marker" in part for part in (p.info["cmdline"] or [])):
            found.append(p)
    return found


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_batch_of_attacks_finishes_with_fair_grades_and_no_forged_score(attacks, tmp_path, no_strays, capsys):
    from hpdl.checker import sandbox

    if not sandbox.available():
        pytest.skip("bubblewrap is not available: a submission could reach the grader's files (the report says so)")
    out = tmp_path / "report"
    assert grade.main([str(attacks), "--out", str(out), "--timeout", "30", "--jobs", "2", "--allow-root"]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    assert len(rows) == 20  # every submission recorded, each with a status and a reason
    full = float(rows["honest.ipynb"]["max_score"])
    assert full > 0 and {float(r["max_score"]) for r in rows.values()} == {full}  # max from the case modules
    assert rows["honest.ipynb"]["status"] == "ok" and float(rows["honest.ipynb"]["score"]) == full
    printed = capsys.readouterr().out
    assert "\x1b" not in printed and "nocells\\x1b]52;c;" in printed  # the terminal shows it, never obeys it
    # not notebooks; a formula in a spreadsheet stays text; a name that is not UTF-8 is written out
    shown = "nocells\\x1b]52;c;cm0gLXJmIH4K\\x07\\u202ebnpyi.ipynb"
    for bad in ("list.ipynb", "'" + FORMULA, shown, "nested.ipynb", "\\xff\\xfe latin1.ipynb"):
        assert rows[bad]["status"] == "not a notebook" and float(rows[bad]["score"]) == 0 and rows[bad]["detail"]
    for report in ("grades.csv", "cases.csv"):
        cells = [c for row in csv.reader(open(out / report)) for c in row]
        assert FORMULA[:-6] in " ".join(cells) and not [c for c in cells if c.startswith(grade.FORMULA_START)]
        assert shown in cells and not [c for c in cells if not c.replace("\n", "").isprintable()]  # written out
    page = (out / "index.html").read_text()
    assert "\u202e" not in page and "\x1b" not in page and html.escape(shown) in page
    # forging results, a daemon, a memory hog: the honest check in those notebooks still counts, nothing more
    for name in ("forger.ipynb", "daemon.ipynb", "memory_hog.ipynb"):
        assert float(rows[name]["score"]) == full, rows[name]
    assert float(rows["answer_key.ipynb"]["score"]) == full  # its own ring counts; the kit's reference was refused
    executed = nbformat.read(out / "executed" / "answer_key.ipynb", as_version=4)
    shown = json.dumps(executed.cells[5].outputs)
    assert "refused: ImportError" in shown, shown  # the case file is hidden from a graded notebook
    for name in ("fork_bomb.ipynb", "flood.ipynb", "kills_parent.ipynb"):
        assert rows[name]["status"] and float(rows[name]["score"]) <= full, rows[name]
    # stopped well before the time limit: interrupted, then (the interrupt caught) its kernel killed
    assert rows["flood.ipynb"]["status"] == "kernel died" and "then its kernel killed" in rows["flood.ipynb"]["detail"]
    assert rows["kills_parent.ipynb"]["status"] == "runner failed" and rows["kills_parent.ipynb"]["detail"]
    for name in ("own_status.ipynb", "own_count.ipynb", "fake_run.ipynb"):  # not the status it wrote
        assert rows[name]["status"] == "runner failed" and rows[name]["detail"], rows[name]
    forged = nbformat.read(out / "executed" / "fake_run.ipynb", as_version=4)  # nor the notebook: as submitted
    assert "did not finish" in forged.cells[0].source and "fake-run" not in [c.source for c in forged.cells]
    assert float(rows["fake_run.ipynb"]["score"]) == 0
    # nor by a process it left running, which the runner ends before it writes them (its notebook raised)
    daemon = rows["status_daemon.ipynb"]
    assert daemon["cell_errors"] == "1" and "forged" not in daemon["detail"], daemon
    ran = nbformat.read(out / "executed" / "runner_memory.ipynb", as_version=4)  # nor in the runner's memory
    assert "runner memory: refused PermissionError" in ran.cells[0].outputs[0].text, ran.cells[0].outputs
    # outputs that are metadata: stopped as a flood, saved no larger than the outputs a notebook keeps
    assert "(an output flood)" in rows["metadata.ipynb"]["detail"], rows["metadata.ipynb"]
    assert (out / "executed" / "metadata.ipynb").stat().st_size < grade.MAX_OUTPUT_BYTES + 2**20
    kept = nbformat.read(out / "executed" / "kills_parent.ipynb", as_version=4)  # as submitted, with a note
    assert "could not be kept" in kept.cells[0].source and KILLS_PARENT in [c.source for c in kept.cells]
    # a cell that never ends: stopped at the time limit, its check recorded as not reached
    assert rows["hangs.ipynb"]["status"] == "timeout" and float(rows["hangs.ipynb"]["score"]) == 0
    assert [c["verdict"] for c in csv.DictReader(open(out / "cases.csv"))
            if c["submission"] == "hangs.ipynb"] == ["NOT RUN"]
    # nothing outlives the batch, and the reports are the grader's own, readable by their owner only
    import time

    time.sleep(1)
    assert not _daemons(), "a submission's daemon outlived the batch"
    for f in ("grades.csv", "cases.csv", "grades.json", "index.html", "results.jsonl"):
        assert (out / f).stat().st_mode & 0o077 == 0, f
    data = json.loads((out / "grades.json").read_text())
    assert data["sandbox"].startswith("sandboxed" if sandbox.available() else "NOT sandboxed")
    assert all(s["score"] <= full for s in data["submissions"])
    assert {s["submission"]: s for s in data["submissions"]}["hangs.ipynb"]["not_reached"] == ["fixture_ring"]
    assert "not reached" in (out / "index.html").read_text()
    assert "forged" not in (out / "results.jsonl").read_text()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_killed_batch_leaves_a_valid_report_and_a_rerun_resumes(submissions, tmp_path, no_strays):
    import signal
    import subprocess
    import sys
    import time

    import psutil

    out = tmp_path / "report"
    for p in ("crash.ipynb", "dana/deadlock.ipynb"):
        (submissions / p).unlink()
    proc = subprocess.Popen([sys.executable, "-m", "hpdl.grade", str(submissions), "--out", str(out),
                             "--timeout", "60", "--allow-root"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 200
    while time.time() < deadline and not (out / "results.jsonl").exists():
        time.sleep(0.2)
    children = psutil.Process(proc.pid).children(recursive=True)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    for c in children:  # what the killed grader had running (the sandbox ends with it)
        try:
            c.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=10)
    rows = list(csv.DictReader(open(out / "grades.csv")))  # a valid report, written before the kill
    assert len(rows) == 2 and "pending" in {r["status"] for r in rows}
    first = (out / "results.jsonl").read_text().splitlines()
    assert len(first) == 1
    from hpdl import scratch

    stranded = scratch.made_by(proc.pid, "grade")
    assert len(stranded) == 1  # the killed grader's folder (its copy of the next submission, if made by then)
    assert grade.main([str(submissions), "--out", str(out), "--timeout", "60", "--allow-root"]) == 0
    assert not stranded[0].exists()  # removed by the next grader
    lines = (out / "results.jsonl").read_text().splitlines()
    assert len(lines) == 2 and lines[0] == first[0]  # the first one was not graded again
    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    ada = rows["ada.ipynb"]
    assert ada["status"] == "ok" and float(ada["score"]) == float(ada["max_score"])
    assert rows["blank.ipynb"]["status"] == "ok"


def test_an_output_flood_is_interrupted_and_the_next_cells_still_run(tmp_path, no_strays):
    """A cell that prints without end (a learner's loop, not an attack) would hold its slot until the time
    limit and fill the runner's memory: past grade.FLOOD_BYTES it is interrupted, the next cells run, and
    the notebook kept holds the flood's head and a note. (One that catches the interrupt: the batch above.)"""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("while True:\n    print('spam ' * 2000)"),
                nbformat.v4.new_code_cell("x = 6 * 7")]
    nbformat.write(nb, tmp_path / "flood.ipynb")
    grade.run_one(tmp_path / "flood.ipynb", tmp_path / "run.ipynb", tmp_path / "status.json", cell_timeout=120)
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["status"] == "ok" and status["cell_errors"] == 1, status
    assert status["detail"].startswith("cell 0 interrupted: its outputs passed"), status
    flood, after = nbformat.read(tmp_path / "run.ipynb", as_version=4).cells
    assert [o.output_type for o in flood.outputs] == ["stream", "error", "stream"], flood.outputs
    assert flood.outputs[0].text.startswith("spam spam") and flood.outputs[1].ename == "KeyboardInterrupt"
    assert after.execution_count == 2  # the next cell ran


@pytest.mark.parametrize("stubborn", [False, True], ids=["obeys", "catches_the_interrupt"])
def test_a_flood_the_runner_reads_late_is_judged_by_the_kernel(stubborn, tmp_path, no_strays):
    """On a busy machine the runner reads a flood's messages seconds after the kernel sent them, so the
    cell still looks running here after FLOOD_GRACE. A kernel that obeyed the interrupt must not be killed
    for it (CI did: the learner's next cells were lost), and one that caught it must be, however late its
    output is read (under load it then ran to the time limit). Here the runner stalls FLOOD_GRACE + 2 s just
    after interrupting."""
    import time

    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError

    class Stalling(NotebookClient):
        stalled = False

        def output(self, outs, msg, display_id, cell_index):
            if self.flood and not self.stalled:
                self.stalled = True
                time.sleep(grade.FLOOD_GRACE + 2)
            return super().output(outs, msg, display_id, cell_index)

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(STUBBORN_FLOOD if stubborn else "while True:\n    print('spam ' * 2000)"),
                nbformat.v4.new_code_cell("x = 6 * 7")]
    client = grade._flood_stopping(Stalling)(nb, timeout=120, kernel_name="python3", allow_errors=True)
    if stubborn:
        with pytest.raises(DeadKernelError):
            client.execute()
        assert client.stalled and client.flood == "cell 0 interrupted, then its kernel killed", client.flood
        return
    client.execute()
    assert client.stalled and client.flood == "cell 0 interrupted", client.flood
    assert [o.get("ename") for o in nb.cells[0].outputs if o.output_type == "error"] == ["KeyboardInterrupt"]
    assert nb.cells[1].execution_count == 2  # the same kernel ran the next cell


def test_a_flood_backlog_read_after_the_reply_keeps_the_interrupt(tmp_path, no_strays):
    """On a busy machine the runner reads the kernel's answer to the interrupted cell before the flood's
    backlog, which still holds the cell's KeyboardInterrupt. nbclient waits 4 s for that backlog by default,
    then drops the rest of the cell's outputs (CI: cell_errors 0, the interrupt lost). Here, once the cell is
    interrupted, the runner reads its next output only after the answer, and 6 s later."""
    import asyncio

    from nbclient import NotebookClient

    class ReadingLate(NotebookClient):
        late = False

        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            if not hasattr(self, "answered"):
                self.answered = asyncio.Event()
                shell_get, iopub_get = self.kc.shell_channel.get_msg, self.kc.iopub_channel.get_msg

                async def shell(*a, **k):
                    msg = await shell_get(*a, **k)
                    if self.flood and msg.get("msg_type") == "execute_reply":
                        self.answered.set()
                    return msg

                async def iopub(*a, **k):
                    msg = await iopub_get(*a, **k)
                    if self.flood and not self.late:
                        self.late = True
                        await self.answered.wait()
                        await asyncio.sleep(6)
                    return msg

                self.kc.shell_channel.get_msg, self.kc.iopub_channel.get_msg = shell, iopub
            return await super().async_execute_cell(cell, cell_index, *args, **kwargs)

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("while True:\n    print('spam ' * 2000)"),
                nbformat.v4.new_code_cell("x = 6 * 7")]
    client = grade._flood_stopping(ReadingLate)(nb, timeout=120, kernel_name="python3", allow_errors=True)
    client.execute()
    assert client.late and client.flood == "cell 0 interrupted", client.flood
    assert [o.get("ename") for o in nb.cells[0].outputs if o.output_type == "error"] == ["KeyboardInterrupt"]
    assert nb.cells[1].execution_count == 2


def test_prediction_cells_are_copied_into_the_report_unscored(tmp_path):
    cells = [
        {"cell_type": "markdown", "metadata": {"tags": ["prediction"]}, "source": "I predict 2(p-1) messages."},
        {"cell_type": "code", "metadata": {"tags": ["prediction"]}, "source": ["prediction = ", "6"],
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "6\n"}]},
        {"cell_type": "code", "metadata": {}, "source": "x = 1", "outputs": []},
    ]
    got = grade.predictions_of(cells)
    assert [p["cell"] for p in got] == [0, 1]
    assert got[0]["source"] == "I predict 2(p-1) messages." and got[1]["output"] == "6\n"
    sub = grade.Submission("a.ipynb", tmp_path / "a.ipynb", status="ok", predictions=got)
    grade.write_reports([sub], tmp_path, exercises=[])
    data = json.loads((tmp_path / "grades.json").read_text())
    assert data["submissions"][0]["predictions"][1]["source"] == "prediction = 6"
    assert "I predict 2(p-1) messages." in (tmp_path / "index.html").read_text()
    # a learner's exception text in a detail or a check's message: its escape sequences written out, never raw
    sub.detail = "error: RuntimeError: \x1b]0;PWNED\x07\x1b[31m\u202e"
    grade.write_reports([sub], tmp_path, exercises=[])
    page = (tmp_path / "index.html").read_text()
    assert not [c for c in page if c not in "\n\t" and not c.isprintable()] and "\\x1b]0;PWNED\\x07" in page


def test_prediction_cells_beyond_a_lesson_s_are_not_kept(tmp_path):
    """Every report holds the predictions and is written again after each submission: 3000 tagged cells of
    20,000 characters in each of two notebooks made a 480 MB index.html and a 2.9 GB grader. Kept: the
    first MAX_PREDICTIONS, each cut, and a line saying the rest were not."""
    bloat = [{"cell_type": "markdown", "metadata": {"tags": ["prediction"]}, "source": "<" * 20_000}] * 3000
    got = grade.predictions_of(bloat)
    assert len(got) == grade.MAX_PREDICTIONS + 1 and "not kept" in got[-1]["source"], got[-1]
    assert all(len(p["source"]) <= grade.MAX_PREDICTION_CHARS for p in got)
    sub = grade.Submission("a.ipynb", tmp_path / "a.ipynb", status="ok", predictions=got)
    grade.write_reports([sub], tmp_path, exercises=[])
    assert (tmp_path / "index.html").stat().st_size < 2**20


def test_a_folder_nested_a_thousand_deep_is_refused_not_the_end_of_the_batch(tmp_path):
    """os.walk recursed once per level: a tree deeper than Python's recursion limit (an unpacked
    archive) ended `hpdl grade` for the whole class. Notebooks nearer the top are still found."""
    subs = tmp_path / "subs"
    (subs / "a" / "b").mkdir(parents=True)
    (subs / "a" / "b" / "near.ipynb").write_text("[1]")
    deep_tree(subs, 1100, file="deep.ipynb")
    found = {s.name: s for s in grade.find_submissions(subs)}
    deep = "/".join(["d"] * (grade.MAX_FOLDER_DEPTH + 1))
    assert sorted(found) == ["a/b/near.ipynb", deep]
    assert found["a/b/near.ipynb"].status == "not a notebook"
    assert found[deep].status == "refused" and "not searched" in found[deep].detail
    (tmp_path / "out").mkdir()
    grade.write_reports(list(found.values()), tmp_path / "out")
    assert "not searched" in (tmp_path / "out" / "grades.csv").read_text()
    safefiles.remove_tree(subs / "d")  # pytest's own cleanup recurses once per level


def test_no_two_names_read_alike_in_the_reports(tmp_path):
    """The byte 0xe9 is written out as \\xe9; a learner's own backslash is doubled, so a notebook named
    `a\\xe9.ipynb` stays a row, a learner and an executed notebook of its own (they were merged). Two names the
    same once Unicode-normalised (josé, in one character or two) showed as one name in every report."""
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / os.fsdecode(b"a\xe9.ipynb")).write_text("[1]")
    (subs / "a\\xe9.ipynb").write_text("[2]")
    names = sorted(s.name for s in grade.find_submissions(subs))
    assert names == ["a\\\\xe9.ipynb", "a\\xe9.ipynb"]
    assert len({grade.learner_of(n) for n in names}) == 2
    # names that read alike once Unicode-normalised are written out, so each row shows whose it is
    for name in ("jos\u00e9.ipynb", "jose\u0301.ipynb", "zo\u00eb.ipynb"):
        (subs / name).write_text("[3]")
    names = {s.name for s in grade.find_submissions(subs)}
    assert {"jos\\u00e9.ipynb", "jose\\u0301.ipynb", "zo\u00eb.ipynb"} <= names
    # and once what shows as nothing is dropped and letters drawn as Latin read as Latin (a Cyrillic о); what
    # shows as nothing, or breaks the line (a name holding a CSV row), is written out in every name
    for name in ("alice.ipynb", "alice\u034f.ipynb", "bob.ipynb", "b\u043eb.ipynb", "carol\u3164.ipynb",
                 "eve\nbob.ipynb,36.ipynb"):
        (subs / name).write_text("[4]")
    names = {s.name for s in grade.find_submissions(subs)}
    assert {"alice.ipynb", "alice\\u034f.ipynb", "bob.ipynb", "b\\u043eb.ipynb", "carol\\u3164.ipynb",
            "eve\\x0abob.ipynb,36.ipynb"} <= names, names


def test_what_is_graded_is_what_the_grade_is_kept_under(tmp_path):
    """A notebook replaced between the listing (its fingerprint) and its turn: the bytes run are the ones whose
    fingerprint and checks the grade is kept under, so a resumed batch grades the file again once it changes
    back (the first fingerprint's 36/36 was kept for a trivial notebook)."""
    import hashlib

    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "late.ipynb").write_text('{"cells": [], "nbformat": 4}')
    sub, = grade.find_submissions(subs)
    solved = '{"cells": [{"cell_type": "code", "source": "hpdl.check(\'ring_allreduce\', f)"}], "nbformat": 4}'
    (subs / "late.ipynb").write_text(solved)
    assert grade.graded_bytes(sub) == solved.encode()
    assert sub.digest == hashlib.sha256(solved.encode()).hexdigest() and sub.exercises == ["ring_allreduce"]


def test_more_submissions_at_once_than_the_ram_holds_are_refused_with_what_fits(tmp_path):
    """--jobs N whose submissions and checks, at their caps, would hold more than the machine's RAM: refused
    before anything runs, naming the numbers and the --jobs that fits (the OOM killer would otherwise choose
    among the grader and the submissions). The default check cap shrinks to fit where it can."""
    from hpdl.checker import sandbox

    ram = sandbox.ram()
    usable = ram - grade.host_reserve(ram)  # a sixteenth, at least 1 GiB, stays for the grader and the system
    jobs = usable // (12 * 2**30) + 1  # 8G + 4G each: one more than fits
    with pytest.raises(HpdlError) as refused:
        grade.main([str(tmp_path), "--jobs", str(jobs), "--memory", "8G", "--check-memory", "4G", "--allow-root"])
    assert f"--jobs {jobs}" in str(refused.value) and f"Use --jobs {max(1, jobs - 1)}," in str(refused.value)
    for n in (1, 2, 3):  # the default: half the RAM up to 8G, less where n at once would not fit, never under 3G
        cap = grade.check_memory_for(n, 4 * 2**30)
        assert cap >= grade.MIN_CHECK_MEMORY and cap <= sandbox.default_memory()
        assert cap == grade.MIN_CHECK_MEMORY or n * (4 * 2**30 + cap) <= usable
    # two at once at the default caps summed to the whole RAM of a 24 GiB machine: now they leave its reserve
    assert grade.memory_overcommitted(2, grade.Caps(memory=4 * 2**30, check_memory=int(7.77 * 2**30)),
                                      ram=int(23.54 * 2**30))


def test_one_learners_many_notebooks_are_one_vote_on_what_is_scored():
    """Without --exercises, the exercises scored are those most learners' notebooks call. One learner's folder
    of four stubs, each calling one exercise, outvoted three learners and dropped the other exercise from
    everyone's score (theirs had not solved it): a learner is one vote, whatever their notebooks."""
    sub = grade.Submission
    honest = [sub(f"{who}/03.ipynb", Path("x"), exercises=["bcast_binomial", "average_gradients"])
              for who in ("alice", "bob", "carol")]
    stubs = [sub(f"mallory/{k}.ipynb", Path("x"), exercises=["bcast_binomial"]) for k in "abcd"]
    assert set(grade.scored_exercises(honest + stubs)) == {"bcast_binomial", "average_gradients"}
    flat = [sub(f"{who}.ipynb", Path("x"), exercises=["bcast_binomial"]) for who in ("dan", "eve")]
    assert set(grade.scored_exercises(flat + [sub("fay.ipynb", Path("x"), exercises=["ring_allreduce"])])) == \
        {"bcast_binomial"}
    # files that are not notebooks, a dead link, a blank notebook: no vote (three of them left nothing scored)
    junk = [sub(f"j{k}.ipynb", Path("x"), status="not a notebook") for k in range(3)] + \
        [sub("l.ipynb", Path("x"), status="refused"), sub("blank.ipynb", Path("x"), status="ok")]
    assert set(grade.scored_exercises(honest + junk)) == {"bcast_binomial", "average_gradients"}
    # notebooks that ran to their end vote with the checks they asked for: calls in dead code are none
    ran = {ex: {"score": 1.0} for ex in ("bcast_binomial", "average_gradients")}
    two = [sub(f"{who}.ipynb", Path("x"), exercises=list(ran), status="ok", checks=ran) for who in ("ann", "ben")]
    dead = [sub(f"zz{k}.ipynb", Path("x"), exercises=["train_step"], status="ok") for k in range(3)]
    assert set(grade.scored_exercises(two + dead)) == set(ran)
    timed_out = [sub(f"zz{k}.ipynb", Path("x"), exercises=["train_step"], status="timeout") for k in range(3)]
    assert set(grade.scored_exercises(two + timed_out)) == {"train_step"}  # never reached: its source is its word


def test_a_check_named_in_a_comment_or_a_string_is_not_a_call():
    """A check named only in a comment or a string counted as called: stubs could add an exercise to the
    class's scoring. Calls in cells with IPython magics count."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in (
        '# hpdl.check("bcast_binomial", f)\nprint("hi")', 'x = "check(\'throughput\')"',
        'hpdl.check("ring_allreduce", ring_allreduce)', '%%px\nresult = check("average_gradients", avg, ranks=[2])',
        'hpdl.check("ring_allreduce", other)')]
    nb.cells.append(nbformat.v4.new_markdown_cell('hpdl.check("train_step", f)'))
    assert grade._called_checks(nbformat.writes(nb).encode()) == ["ring_allreduce", "average_gradients"]


def test_reports_go_neither_inside_the_submissions_folder_nor_through_a_link(tmp_path):
    """`cd submissions && hpdl grade .` put the reports (./report) inside the submissions: a learner's folder
    named report/ with a link .grades.csv.tmp -> the instructor's ~/.bashrc had the grader write grades.csv
    there, the learner's file name ("x$(touch …).ipynb") in it as a row that a shell then ran."""
    subs = tmp_path / "subs"
    (subs / "report").mkdir(parents=True)
    for out in (subs / "report", subs, subs / "a" / "b"):
        with pytest.raises(HpdlError, match="inside the submissions folder"):
            grade.grade(subs, out)
    out, victim = tmp_path / "out", tmp_path / "bashrc"
    out.mkdir()
    victim.write_text("mine\n")
    (out / ".grades.csv.tmp").symlink_to(victim)
    (out / "results.jsonl").symlink_to(victim)
    grade._write_private(out / "grades.csv", "submission,score\n")
    with pytest.raises(OSError):
        grade._append(out, grade.Submission("alice.ipynb", Path("x")))
    with pytest.raises(HpdlError, match="results.jsonl is not a regular file"):  # said before any grading
        grade.grade(subs, out)
    assert victim.read_text() == "mine\n" and (out / "grades.csv").read_text() == "submission,score\n"


def test_half_the_learners_add_no_exercise_of_another_lesson(monkeypatch):
    """Of two learners, one who called a check of another lesson (dead code: `if False: check("ring_allreduce",
    None)`) added it to both scores (36/63 for a full solution). An exercise only half call is scored where the
    lesson a majority works on holds it: one learner who skipped it does not drop it for the class."""
    sub = grade.Submission
    alice = sub("alice/03.ipynb", Path("x"), exercises=["bcast_binomial", "average_gradients"])
    mallory = sub("mallory/03.ipynb", Path("x"), exercises=["bcast_binomial", "average_gradients", "ring_allreduce"])
    assert set(grade.scored_exercises([alice, mallory])) == {"bcast_binomial", "average_gradients"}
    bob = sub("bob/03.ipynb", Path("x"), exercises=["bcast_binomial"])  # skipped one of the lesson's two
    assert set(grade.scored_exercises([alice, bob])) == {"bcast_binomial", "average_gradients"}
    monkeypatch.setattr(grade, "lessons_of_exercises", dict)  # a kit without exercises/: half suffice, as before
    assert set(grade.scored_exercises([alice, bob])) == {"bcast_binomial", "average_gradients"}


def test_a_notebook_kept_with_a_note_is_no_larger_than_it_was(monkeypatch):
    """Where the runner did not finish, the notebook as submitted is kept, with a note first. It was written
    again indented: a submission of 200,000 values nested 95 deep (within what is read) grew 50 times,
    10 MB to 500 MB on the instructor's disk and in the grader's memory, and killed a capped grader, again
    at every resume. Now written compact, and past MAX_NOTEBOOK_BYTES (escaping doubles non-ASCII text),
    the note alone."""
    values = [0] * 200_000
    for _ in range(94):
        values = [values]
    data = json.dumps({"cells": [], "metadata": {"x": values}, "nbformat": 4, "nbformat_minor": 5},
                      separators=(",", ":")).encode()
    kept = grade._with_note(data, "kept as submitted")
    assert len(kept) < len(data) + 200, (len(kept), len(data))
    back = json.loads(kept)
    assert back["cells"][0]["source"] == "kept as submitted" and back["metadata"]["x"] == values
    wide = json.dumps({"cells": [], "metadata": {"x": "€" * 100_000}, "nbformat": 4, "nbformat_minor": 5},
                      ensure_ascii=False).encode()
    monkeypatch.setattr(grade, "MAX_NOTEBOOK_BYTES", len(wide) + 1000)
    alone = json.loads(grade._with_note(wide, "kept as submitted."))
    assert [c["source"] for c in alone["cells"]] == ["kept as submitted. It is not kept here: with the note it "
                                                     "passed 0 MiB."] and "x" not in alone["metadata"]


def test_a_notebook_the_grader_died_on_is_graded_alone_then_not_again(tmp_path, no_strays):
    """A notebook that takes the grader itself down (its memory) did so again at every resume, and with
    --jobs 1 no learner after it was ever graded. A resume now grades those an earlier run started and never
    ended first, each alone (a neighbour that died with it is not blamed), and records one the grader died on
    twice, once alone, without running it. A grader stopped in order (Ctrl-C) holds nothing against anyone."""
    subs = tmp_path / "subs"
    subs.mkdir()
    for name in ("ada", "bob", "cyd", "dee"):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("x = 6 * 7")]
        nbformat.write(nb, subs / f"{name}.ipynb")
    digest = {s.name: s.digest for s in grade.find_submissions(subs)}
    out = tmp_path / "report"
    out.mkdir()
    lines = [("bob.ipynb", {"alone": False}), ("cyd.ipynb", {"alone": False}),  # a grader died with both running
             ("cyd.ipynb", {"alone": True}),  # then again, cyd alone
             ("dee.ipynb", {"alone": True}), ("dee.ipynb", {"alone": True}), ("dee.ipynb", {"ended": True})]
    (out / "started.jsonl").write_text("".join(json.dumps({"name": n, "digest": digest[n], **rest}) + "\n"
                                               for n, rest in lines) + '{"name": "cut sho')
    assert grade.main([str(subs), "--out", str(out), "--timeout", "60", "--jobs", "2", "--allow-root"]) == 0
    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    assert rows["cyd.ipynb"]["status"] == "grader died" and "started.jsonl" in rows["cyd.ipynb"]["detail"]
    assert {rows[n]["status"] for n in ("ada.ipynb", "bob.ipynb", "dee.ipynb")} == {"ok"}, rows
    new = [json.loads(line) for line in (out / "started.jsonl").read_text().splitlines()[len(lines) + 1:]]
    assert [(r["name"], r["alone"]) for r in new] == [("bob.ipynb", True), ("ada.ipynb", False),
                                                      ("dee.ipynb", False)], new


def test_a_notebook_is_parsed_for_its_checks_within_a_budget(monkeypatch):
    """Cells just under the longest parsed, each naming check(: a thousand of them cost the grader 7.7 s a
    hundred to list one notebook, outside any sandbox or timer. All the cells parsed hold at most
    MAX_PARSED_NOTEBOOK characters; a lesson's notebook, far below it, is read whole."""
    parsed = []
    real = grade._check_calls
    monkeypatch.setattr(grade, "_check_calls", lambda text: parsed.append(len(text)) or real(text))
    pad = "x = 1\n" * ((grade.MAX_PARSED_CELL - 100) // 6)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(f'{pad}check("ring_allreduce", f)\n')
                                         for _ in range(40)])
    assert grade._called_checks(nbformat.writes(nb).encode()) == ["ring_allreduce"]
    assert 0 < sum(parsed) <= grade.MAX_PARSED_NOTEBOOK, sum(parsed)
    lesson = Path(__file__).parents[1] / "solutions" / "03_mpi_collectives.ipynb"
    parsed.clear()
    assert grade._called_checks(lesson.read_bytes()) and sum(parsed) < grade.MAX_PARSED_NOTEBOOK // 8


def test_outputs_a_submission_brings_are_not_what_it_printed(tmp_path):
    """A cell tagged skip-execution (nbclient skips those by default) kept the outputs the learner wrote into
    the file, a check's "36/36" among them, in the notebook kept; a raw cell tagged prediction brought its own
    outputs into the report. Every code cell runs, and only what ran is kept."""
    forged = nbformat.v4.new_output("stream", name="stdout", text="✔ bcast_binomial: 36/36\n")
    ran = nbformat.v4.new_code_cell("print('ran here')", metadata={"tags": ["skip-execution"]}, outputs=[forged])
    nb = nbformat.v4.new_notebook(cells=[ran])
    nb.cells.append({**nbformat.v4.new_raw_cell("my prediction", metadata={"tags": ["prediction"]}),
                     "outputs": [forged]})  # not valid, as a learner's file need not be
    (tmp_path / "forged.ipynb").write_text(json.dumps(nb))
    grade.run_one(tmp_path / "forged.ipynb", tmp_path / "run.ipynb", tmp_path / "status.json", cell_timeout=60)
    cells = json.loads((tmp_path / "run.ipynb").read_text())["cells"]
    assert [o.get("text") for o in cells[0]["outputs"]] == ["ran here\n"], cells[0]
    assert "outputs" not in cells[1] and "36/36" not in json.dumps(grade.predictions_of(cells))


def test_a_rerun_grades_again_alone_what_a_neighbour_can_make_end(tmp_path):
    """A neighbour of 150 busy processes made an honest notebook time out (0/36), and running the command again
    kept its timeout: a status a neighbour can cause is graded again, alone; an ended run's is kept."""
    out = tmp_path / "out"
    out.mkdir()
    subs = [grade.Submission(name, tmp_path / name, digest=name) for name in ("ok.ipynb", "timed.ipynb")]
    with open(out / "results.jsonl", "w") as f:
        for sub, status in zip(subs, ("ok", "timeout")):
            f.write(json.dumps({"name": sub.name, "digest": sub.digest, "status": status}) + "\n")
    todo, alone = grade._resume(subs, out)
    assert [s.name for _, s in todo] == ["timed.ipynb"] and alone == {1}
    assert subs[0].status == "ok" and subs[1].status == "pending"


def test_a_learners_folder_swapped_for_a_link_after_the_listing_is_not_followed(tmp_path):
    """The listing refuses links, but the notebook is read again minutes later to run it: a learner's folder
    replaced meanwhile by a link to a classmate's had the classmate's notebook graded as its own (36/36)."""
    from hpdl import safefiles

    subs = tmp_path / "subs"
    for learner, text in (("alice", "honest"), ("mallory", "print(1)")):
        (subs / learner).mkdir(parents=True)
        (subs / learner / "sol.ipynb").write_text(json.dumps(nbformat.v4.new_notebook(
            cells=[nbformat.v4.new_code_cell(text)])))
    listed = {s.name: s for s in grade.find_submissions(subs)}
    assert b"print(1)" in grade.graded_bytes(listed["mallory/sol.ipynb"])
    (subs / "mallory").rename(tmp_path / "away")
    (subs / "mallory").symlink_to(subs / "alice")
    with pytest.raises(safefiles.UnsafeFile, match="symbolic link"):
        grade.graded_bytes(listed["mallory/sol.ipynb"])
    assert b"honest" in grade.graded_bytes(listed["alice/sol.ipynb"])


def test_a_flood_of_notebooks_in_one_learners_folder_is_one_row(tmp_path, monkeypatch):
    """300,000 empty notebooks in one learner's folder made a row each: a 2.7 GB grader, reports of 280 MB
    written again after every submission, an honest neighbour near its time limit. A learner's folder lists
    at most MAX_PER_LEARNER notebooks, then one row says the rest were not listed; a class, MAX_LISTED."""
    monkeypatch.setattr(grade, "MAX_PER_LEARNER", 5)
    subs = tmp_path / "subs"
    (subs / "flood" / "deeper").mkdir(parents=True)
    for i in range(8):
        (subs / "flood" / f"{i}.ipynb").write_text("")
        (subs / "flood" / "deeper" / f"{i}.ipynb").write_text("")
    for learner in ("ada", "bob"):
        (subs / learner).mkdir()
        (subs / learner / "sol.ipynb").write_text("{}")
    (subs / "top.ipynb").write_text("{}")
    names = [s.name for s in grade.find_submissions(subs)]
    flood = [n for n in names if n.startswith("flood")]
    assert len(flood) == 6 and "flood" in flood, flood  # five notebooks, and the row saying so
    assert {"ada/sol.ipynb", "bob/sol.ipynb", "top.ipynb"} <= set(names)
    monkeypatch.setattr(grade, "MAX_LISTED", 3)
    listed = grade.find_submissions(subs)
    assert any("grade the class in parts" in s.detail for s in listed) and len(listed) <= 4, listed
    for i in range(6):  # one folder's entries at once: notebooks at the top, each a learner of its own
        (subs / f"top{i}.ipynb").write_text("{}")
    assert len(grade.find_submissions(subs)) <= 4
