"""`hpdl build`: exercises generated from the single source in solutions/, and drift caught."""
from __future__ import annotations

import shutil
from pathlib import Path

import nbformat
import pytest

from hpdl import build
from hpdl.errors import HpdlError

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = Path(__file__).parent / "fixtures" / "solutions" / "01_ring_example.ipynb"


def test_repository_has_no_drift(capsys):
    """CI's gate: committed exercises/ and solutions/ equal a fresh build."""
    code = build.main(["--check", "--root", str(ROOT)])
    assert code == 0, capsys.readouterr().out


pytestmark = pytest.mark.filterwarnings("ignore:Cell is missing an id field")


@pytest.fixture
def kit(tmp_path) -> Path:
    """A kit folder whose solution notebook has been run and saved: outputs, counts, metadata."""
    (tmp_path / "solutions" / "part2").mkdir(parents=True)
    nb = nbformat.read(EXAMPLE, as_version=4)
    nb.metadata["language_info"] = {"name": "python", "version": "3.11.7", "mimetype": "text/x-python"}
    nb.metadata["widgets"] = {"state": {}}
    code = nb.cells[1]
    code.outputs = [nbformat.v4.new_output("stream", text="hello\n")]
    code.execution_count = 7
    code.metadata["execution"] = {"iopub.status.busy": "2024-01-01"}
    del nb.cells[2]["id"]
    nbformat.write(nb, tmp_path / "solutions" / "01_ring_example.ipynb")
    shutil.copy(EXAMPLE, tmp_path / "solutions" / "part2" / "02_copy.ipynb")
    (tmp_path / "solutions" / "part2" / "data.txt").write_text("1 2 3\n")
    return tmp_path


def _cells(path: Path):
    return nbformat.read(path, as_version=4).cells


def test_build_blanks_solutions_and_normalises_both_sides(kit, capsys):
    assert build.main(["--root", str(kit)]) == 0
    sol, ex = kit / "solutions" / "01_ring_example.ipynb", kit / "exercises" / "01_ring_example.ipynb"
    assert (kit / "exercises" / "part2" / "02_copy.ipynb").exists()
    assert (kit / "exercises" / "part2" / "data.txt").read_text() == "1 2 3\n"

    solution, exercise = _cells(sol), _cells(ex)
    assert all(c.get("outputs", []) == [] and c.get("execution_count") is None for c in solution)
    assert "execution" not in solution[1].metadata
    meta = nbformat.read(sol, as_version=4).metadata
    assert meta["language_info"] == {"name": "python"} and "widgets" not in meta
    assert all(c.get("id") for c in solution) and len({c.id for c in solution}) == len(solution)

    text = ex.read_text()
    assert "comm.Sendrecv(chunks" not in text and "2(p − 1)" not in text and "Instructor's note" not in text
    assert "answer = 2 * (4 - 1)" not in text
    ring = next(c for c in exercise if "def ring_allreduce" in c.source)
    assert ring.source.splitlines()[-1] == \
        '    raise NotImplementedError("Your code here: replace this line with your solution.")'
    assert "_Your answer here._" in text
    assert len(exercise) == len(solution) - 1  # the solution-only cell is gone
    by_id = {c.id: c for c in solution}
    assert all(c.id in by_id and by_id[c.id].cell_type == c.cell_type for c in exercise)

    class OneRank:  # just enough of a communicator for the lines above the placeholder
        def Get_size(self):
            return 1

        def Get_rank(self):
            return 0

    namespace: dict = {}
    exec(compile(ring.source, "exercise", "exec"), namespace)
    with pytest.raises(NotImplementedError):
        namespace["ring_allreduce"](OneRank(), None)


def test_a_second_build_changes_nothing_and_ids_are_stable(kit):
    build.main(["--root", str(kit)])
    first = {p: p.read_bytes() for p in kit.rglob("*.ipynb")}
    assert build.main(["--root", str(kit)]) == 0
    assert {p: p.read_bytes() for p in kit.rglob("*.ipynb")} == first
    assert build.main(["--check", "--root", str(kit)]) == 0


def test_check_fails_and_lists_every_drifted_file(kit, capsys):
    build.main(["--root", str(kit)])
    capsys.readouterr()
    ex = kit / "exercises" / "01_ring_example.ipynb"
    ex.write_text(ex.read_text().replace("YOUR CODE HERE", "my edit"))
    (kit / "exercises" / "part2" / "02_copy.ipynb").unlink()
    (kit / "exercises" / "99_orphan.ipynb").write_text("{}")
    sol = kit / "solutions" / "part2" / "data.txt"
    sol.write_text("changed\n")
    before = {p: p.read_bytes() for p in kit.rglob("*") if p.is_file()}
    assert build.main(["--check", "--root", str(kit)]) == 1
    out = capsys.readouterr().out
    for name in ("exercises/01_ring_example.ipynb", "exercises/part2/02_copy.ipynb  (missing)",
                 "exercises/99_orphan.ipynb", "exercises/part2/data.txt"):
        assert name in out
    assert {p: p.read_bytes() for p in kit.rglob("*") if p.is_file()} == before  # --check writes nothing
    assert build.main(["--root", str(kit)]) == 0
    assert build.main(["--check", "--root", str(kit)]) == 0
    assert not (kit / "exercises" / "99_orphan.ipynb").exists()


@pytest.mark.parametrize("source, match", [
    ("x = 1\n### BEGIN SOLUTION\ny = 2\n", "never closed"),
    ("### END SOLUTION\n", "without a"),
    ("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION\n", "inside another"),
])
def test_broken_markers_are_named_with_file_and_cell(tmp_path, source, match):
    (tmp_path / "solutions").mkdir()
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    nbformat.write(nb, tmp_path / "solutions" / "bad.ipynb")
    with pytest.raises(HpdlError, match=match) as err:
        build.main(["--root", str(tmp_path)])
    assert "solutions/bad.ipynb, cell 1" in str(err.value)
