"""A hostile class, graded: nothing a submission (or the learner's ranks in a check) can write is
ever written through, followed, or read without a bound by the grader and the checker's trusted
side; one submission cannot take the batch down, nor kill the grader; every command's --help
prints help. Each test is an attack class from the security review of `hpdl grade`, not one
copied submission: a planted link where the grader writes, a request or event file that is a
link to /dev/zero or a FIFO, a pid the learner names as its own, an output flood, a submission
that is a link to someone else's notebook."""
from __future__ import annotations

import csv
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from hpdl import build
from hpdl.checker import sandbox

EXAMPLE = Path(__file__).parent / "fixtures" / "solutions" / "01_ring_example.ipynb"
MAX_GRADER_RSS = 2 * 2**30  # bytes: the grader and everything it reaped (kernels included)

# -- in the grade service's folders: a link where the grader writes, requests that are not files ---
PLANT = """import json, os, pathlib, uuid
svc = pathlib.Path(os.environ["HPDL_GRADE_SERVICE"])
for _ in range(2):
    rid = uuid.uuid4().hex
    for where in (svc, svc / "answers"):
        for name in (f".resp-{rid}.tmp", f"resp-{rid}.json"):  # the temporary and the final name
            try:
                os.symlink(VICTIM, where / name)
            except OSError as exc:
                print("refused:", exc)
    # an exercise name holding shell text: what the grader would write into the link's target
    (svc / f"req-{rid}.json").write_text(json.dumps({"exercise": "x\\necho pwned >> ~/.bashrc", "code": {}}))
"""
REQUESTS = """import os, pathlib, uuid
svc = pathlib.Path(os.environ["HPDL_GRADE_SERVICE"])
os.symlink("/dev/zero", svc / f"req-{uuid.uuid4().hex}.json")  # stat says 0 bytes; reading never ends
os.mkfifo(svc / f"req-{uuid.uuid4().hex}.json")  # opening it blocks until a writer comes: none does
"""
FLOOD = "print(('spam ' * 2000 + '\\n') * 8000)  # 80 MB in one cell: more than a saved notebook may hold"


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


@pytest.fixture
def hostile(tmp_path) -> dict:
    """One honest, solved notebook beside hostile ones, and what they aim at outside the sandbox."""
    kit = tmp_path / "kit"
    (kit / "solutions").mkdir(parents=True)
    nbformat.write(nbformat.read(EXAMPLE, as_version=4), kit / "solutions" / "ex.ipynb")
    assert build.main(["--root", str(kit)]) == 0
    subs, elsewhere = tmp_path / "subs", tmp_path / "elsewhere"
    subs.mkdir()
    elsewhere.mkdir()
    victim = tmp_path / "instructor" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text("# the instructor's own\n")
    nbformat.write(nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4), subs / "honest.ipynb")
    _notebook(subs / "plant.ipynb", f"VICTIM = {str(victim)!r}", PLANT)
    _notebook(subs / "requests.ipynb", REQUESTS)
    _notebook(subs / "flood.ipynb", FLOOD)
    # a link to another learner's notebook (readable by the grader only), and a linked folder
    other = elsewhere / "other.ipynb"
    nbformat.write(nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4), other)
    os.chmod(other, 0o600)
    os.symlink(other, subs / "link.ipynb")
    os.symlink(elsewhere, subs / "linked_folder")
    return {"subs": subs, "victim": victim, "out": tmp_path / "report"}


def _grade_in_a_child(subs: Path, out: Path) -> tuple[int, int]:
    """`hpdl grade` as its own process, TMPDIR=/var/tmp as the review had it; its exit code and
    the largest resident size of it and what it reaped. Its address space is capped (6 GiB) so
    that a grader that reads without a bound fails here instead of taking the host down."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    env = dict(os.environ, TMPDIR="/var/tmp", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "hpdl.cli", "grade", str(subs), "--out", str(out),
                             "--timeout", "150", "--jobs", "2", "--exercises", "ring_allreduce"],
                            env=env, preexec_fn=cap, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    print(output.decode(errors="replace"))
    return proc.returncode, usage.ru_maxrss * 1024


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hostile_batch_harms_nothing_outside_and_grades_the_honest_one_fully(hostile, no_strays):
    if not sandbox.available():
        pytest.skip("bubblewrap is not available here")
    before = hostile["victim"].read_text()
    code, rss = _grade_in_a_child(hostile["subs"], hostile["out"])
    assert code == 0
    out = hostile["out"]
    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    harm = []  # every finding at once: each line is one attack class that got through

    def expect(ok: bool, what: str) -> None:
        if not ok:
            harm.append(what)

    honest = rows["honest.ipynb"]
    expect(honest["status"] == "ok" and float(honest["score"]) == float(honest["max_score"]) > 0,
           f"the honest submission was not graded fully: {honest}")
    # a planted link where the grader writes its answer: its target is untouched, nothing new beside it
    expect(hostile["victim"].read_text() == before, "the grader wrote through a planted link: "
           + hostile["victim"].read_text()[:200])
    expect([p.name for p in hostile["victim"].parent.iterdir()] == [".bashrc"], "a file appeared beside the target")
    # requests that are a link to /dev/zero and a FIFO: refused, unread; the grader stayed small
    detail = rows["requests.ipynb"]["detail"]
    expect("symbolic link" in detail and "FIFO" in detail, f"bad requests not refused as such: {detail!r}")
    expect(rss < MAX_GRADER_RSS, f"the grader grew to {rss / 2**30:.1f} GiB")
    # an output flood: the saved notebook is a valid one, its output cut with a note
    try:
        flood = nbformat.read(out / "executed" / "flood.ipynb", as_version=4)
        expect("output cut" in json.dumps(flood.cells[0].outputs), "the flood's output was not cut with a note")
    except Exception as exc:  # noqa: BLE001 - a truncated notebook is the finding itself
        harm.append(f"the flood's saved notebook is not a valid notebook: {type(exc).__name__}: {str(exc)[:100]}")
    # links among the submissions: refused with a reason, not graded as the linker's
    for name in ("link.ipynb", "linked_folder"):
        row = rows.get(name, {})
        expect(row.get("status") == "refused" and float(row.get("score", 0)) == 0
               and "symbolic link" in row.get("detail", ""), f"{name} was not refused as a link: {row}")
    assert not harm, "\n".join(harm)
