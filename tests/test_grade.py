"""`hpdl grade`: every submission runs headless in grade mode; a hanging or crashing one never
stops the batch; submissions are never modified; reports hold every case."""
from __future__ import annotations

import csv
import hashlib
import json
from pathlib import Path

import nbformat
import pytest

from hpdl import build, grade

EXAMPLE = Path(__file__).parent / "fixtures" / "solutions" / "01_ring_example.ipynb"
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
def submissions(tmp_path) -> Path:
    """Five learners: solved, untouched exercise, a cell that never ends, a kernel that dies
    after the check, and a ring that deadlocks inside the check."""
    kit = tmp_path / "kit"
    (kit / "solutions").mkdir(parents=True)
    nbformat.write(nbformat.read(EXAMPLE, as_version=4), kit / "solutions" / "ex.ipynb")
    assert build.main(["--root", str(kit)]) == 0
    solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    subs = tmp_path / "subs"
    (subs / "dana").mkdir(parents=True)
    nbformat.write(solved, subs / "ada.ipynb")
    nbformat.write(nbformat.read(kit / "exercises" / "ex.ipynb", as_version=4), subs / "blank.ipynb")
    _variant(solved, subs / "hangs.ipynb",
             lambda cells: cells.insert(2, nbformat.v4.new_code_cell("import time\ntime.sleep(3600)")))
    _variant(solved, subs / "crash.ipynb",
             lambda cells: cells.insert(5, nbformat.v4.new_code_cell("import os\nos._exit(3)")))

    def deadlock(cells):
        cells[3].source = DEADLOCK
        cells[4].source = 'hpdl.check("ring_allreduce", ring_allreduce, ranks=[1, 3], timeout=2)'

    _variant(solved, subs / "dana" / "deadlock.ipynb", deadlock)
    return subs


def _digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_batch_grades_every_submission_despite_hangs_and_crashes(submissions, tmp_path, no_strays, capsys):
    before = _digest(submissions)
    out = tmp_path / "report"
    assert grade.main([str(submissions), "--out", str(out), "--timeout", "25", "--jobs", "2"]) == 0
    assert _digest(submissions) == before  # nothing written next to or into a submission

    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    assert set(rows) == {"ada.ipynb", "blank.ipynb", "hangs.ipynb", "crash.ipynb", "dana/deadlock.ipynb"}
    full = float(rows["ada.ipynb"]["max_score"])
    assert full > 0
    assert rows["ada.ipynb"]["status"] == "ok" and float(rows["ada.ipynb"]["score"]) == full
    assert rows["blank.ipynb"]["status"] == "ok" and float(rows["blank.ipynb"]["score"]) == 0
    assert int(rows["blank.ipynb"]["cell_errors"]) >= 1
    assert rows["hangs.ipynb"]["status"] == "timeout" and float(rows["hangs.ipynb"]["score"]) == 0
    assert rows["crash.ipynb"]["status"] == "kernel died" and float(rows["crash.ipynb"]["score"]) == full
    assert rows["dana/deadlock.ipynb"]["status"] == "ok"

    cases = list(csv.DictReader(open(out / "cases.csv")))
    ada = [c for c in cases if c["submission"] == "ada.ipynb"]
    assert any(c["hidden"] == "True" for c in ada)  # grade mode ran the hidden cases
    assert all(c["verdict"] == "PASS" for c in ada)
    dead = [c for c in cases if c["submission"] == "dana/deadlock.ipynb"]
    assert {c["verdict"] for c in dead if c["ranks"] == "3"} == {"HANG"}
    assert {c["verdict"] for c in dead if c["ranks"] == "1"} == {"PASS"}
    assert [c["verdict"] for c in cases if c["submission"] == "hangs.ipynb"] == ["NOT RUN"]

    data = json.loads((out / "grades.json").read_text())
    by_name = {s["submission"]: s for s in data["submissions"]}
    assert by_name["hangs.ipynb"]["not_reached"] == ["ring_allreduce"]
    assert by_name["ada.ipynb"]["checks"]["ring_allreduce"]["grade"] is True
    page = (out / "index.html").read_text()
    assert "dana/deadlock.ipynb" in page and "not reached" in page and "HANG" in page
    assert (out / "executed" / "dana" / "deadlock.ipynb").exists()
    assert "ada.ipynb" in capsys.readouterr().out
