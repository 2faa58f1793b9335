"""Answer keys out of learners' reach (issue 21, item 5).

- The learner's check job never holds a case module: it gets the part inputs() and call() use
  (checker/split.py), its sandbox hides the case files, their compiled copies and the keys folder.
- The kit's own implementation of an exercise refuses to run inside a check.
- `hpdl keys export` + `hpdl keys strip` leave a shared kit whose inline checks run the public cases
  against stored answers and name the hidden ones as not run; `hpdl grade --keys` grades with the
  full cases: a solved notebook earns full marks, one that goes after the reference earns nothing.
"""
from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

import hpdl
from hpdl import keys
from hpdl.checker import cases, sandbox
from hpdl.errors import HpdlError

FIXTURES = Path(__file__).parent / "fixtures"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(FIXTURES))
import key_attacks as K  # noqa: E402
import learner_attacks as A  # noqa: E402

pytestmark = pytest.mark.timeout(300)
needs_sandbox = pytest.mark.skipif(not sandbox.available(), reason="bubblewrap is not available here: a check job "
                                   "without a sandbox can read the kit's files (self-study in one's own clone)")


def no_points(result) -> None:
    assert result.cases and result.score == 0, result
    assert not any(c.verdict in ("PASS", "SLOW") for c in result.cases), result


# -- the learner's check job -------------------------------------------------------------------

def test_the_learners_part_of_every_case_module_holds_no_reference():
    """What a learner job receives of each exercise: inputs() and call() and what they use, never
    reference() or the model solutions it calls (a class of its own in several modules)."""
    for name in cases.known():
        part = cases.public_part(name)
        text = "\n".join(part["sources"].values())
        assert part["module"] in part["sources"], name
        for word in ("def reference", "def model_solution", "def ddp_training", "def reference_shard", "def best("):
            assert word not in text, (name, word)


def test_a_stripped_module_keeps_verify_unless_it_would_carry_the_reference():
    """What `hpdl keys strip` leaves of each kit exercise (no MPI: the answers are computed apart).
    choose_algorithm's verify() judges with best() and cost(), the reference's own functions: that
    one alone falls back to comparing with the stored answers."""
    def find(n):
        return cases.HERE / f"{n}.py" if (cases.HERE / f"{n}.py").is_file() else None

    fallbacks = []
    for name in cases.known():
        text, _, note = keys.public_module(name, cases.load(name), find)
        assert "def reference" not in text and "def model_solution" not in text and "def best(" not in text, name
        assert "PUBLIC_ONLY = True" in text and "def cases(size)" in text, name
        compile(text, name, "exec")
        fallbacks += [name] if note else []
    assert fallbacks == ["choose_algorithm"]


@needs_sandbox
@pytest.mark.parametrize("attack", [A.import_reference, K.exec_case_file, K.ring_from_the_kits_tests])
def test_the_learner_job_cannot_import_or_read_the_case_module(attack, no_strays):
    """Nor the kit's tests and benchmarks, which hold right answers (checking.answer_keys)."""
    result = hpdl.check("ring_allreduce", attack, ranks=[2])
    no_points(result)
    assert all(c.verdict == "ERROR" for c in result.cases), result


def test_the_kits_own_predictor_is_refused_inside_a_check(no_strays):
    for attack in (K.kit_predictor, K.kit_predictor_caught):
        result = hpdl.check("predict_step_time", attack, ranks=[1])
        no_points(result)
        for c in result.cases:
            assert c.verdict == "WRONG" and c.rejected == "hpdl.predict.predict_step_time", c
            assert "write it yourself" in c.message, c.message
    result = hpdl.check("predict_step_time", K.kit_predictor_reloaded, ranks=[1])
    no_points(result)
    assert all("cannot be loaded again" in c.message for c in result.cases), result
    if sandbox.available():  # in a sandbox the module's file is a copy without the kit's own predictor
        result = hpdl.check("predict_step_time", K.kit_predictor_from_its_file, ranks=[1])
        no_points(result)
        assert all("not in a check's view" in c.message for c in result.cases), result
    honest = hpdl.check("predict_step_time", K.honest_predictor, ranks=[1])
    assert honest.score == honest.max_score > 0, honest


@pytest.mark.skipif(not sandbox.available(), reason="the library's file is laid over in the sandbox only")
def test_a_librarys_own_answer_loaded_from_its_file_is_not_in_view(no_strays):
    """shard_indices refuses torch's DistributedSampler where it is imported; loaded again from torch's file under
    another name it was whole (12/12). In the learner's view that file is a copy without it (LIBRARY_ANSWERS)."""
    result = hpdl.check("shard_indices", K.torch_sampler_from_its_file, ranks=[2])
    no_points(result)
    assert all("not in a check's view" in c.message for c in result.cases), result


# -- export, strip, grade with the keys ----------------------------------------------------------

def test_export_and_strip_refuse_what_would_lose_or_overwrite_a_key(tmp_path):
    folder = tmp_path / "cases"
    folder.mkdir()
    for name in ("__init__.py", "ring_allreduce.py", "_sums.py"):
        shutil.copy(cases.HERE / name, folder / name)
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "notes.txt").write_text("mine")
    with pytest.raises(HpdlError, match="exists"):
        keys.export(taken, folder)
    assert (taken / "notes.txt").read_text() == "mine"
    out = keys.export(tmp_path / "keys", folder)
    assert sorted(p.name for p in out) == ["_sums.py", "ring_allreduce.py"]
    assert (tmp_path / "keys").stat().st_mode & 0o777 == 0o700
    assert all(p.stat().st_mode & 0o077 == 0 for p in out)
    (tmp_path / "keys" / "_sums.py").write_text("# changed\n")
    before = (folder / "ring_allreduce.py").read_text()
    with pytest.raises(HpdlError, match="no identical copy of _sums.py"):
        keys.strip(tmp_path / "keys", folder)
    assert (folder / "ring_allreduce.py").read_text() == before  # nothing stripped


def _run(kit: Path, *args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_")}
    full_env.update(PYTHONPATH=str(kit), IPP_NONINTERACTIVE="1", **env)
    proc = subprocess.run([sys.executable, *args], cwd=kit, env=full_env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def shared_kit(tmp_path_factory) -> tuple[Path, Path]:
    """A copy of the kit with two exercises (ring_allreduce at 1 and 3 ranks; autotune, whose measure is
    a helper process's, at 1), its keys exported into
    a folder inside the kit (so only the hiding of the keys keeps a sandbox from them), then stripped."""
    kit = tmp_path_factory.mktemp("shared") / "kit"
    shutil.copytree(ROOT / "hpdl", kit / "hpdl", ignore=shutil.ignore_patterns("__pycache__"))
    for p in (kit / "hpdl" / "checker" / "cases").glob("*.py"):
        if p.name not in ("__init__.py", "ring_allreduce.py", "_sums.py", "autotune.py"):
            p.unlink()
    ring = kit / "hpdl" / "checker" / "cases" / "ring_allreduce.py"
    ring.write_text(ring.read_text().replace("RANKS = (1, 2, 3, 4)", "RANKS = (1, 3)"))
    tune = kit / "hpdl" / "checker" / "cases" / "autotune.py"
    tune.write_text(tune.read_text().replace("RANKS = (1, 2)", "RANKS = (1,)"))
    key_dir = kit / "instructor-keys"
    _run(kit, "-m", "hpdl.cli", "keys", "export", "--to", str(key_dir))
    _run(kit, "-m", "hpdl.cli", "keys", "strip", "--keys", str(key_dir))
    return kit, key_dir


def test_a_stripped_kit_checks_public_cases_and_names_the_hidden_ones(shared_kit, no_strays):
    kit, key_dir = shared_kit
    stripped = (kit / "hpdl" / "checker" / "cases" / "ring_allreduce.py").read_text()
    assert "def reference" not in stripped and "PUBLIC_ONLY = True" in stripped
    assert "def reference" in (key_dir / "ring_allreduce.py").read_text()
    script = textwrap.dedent(f"""
        import json, os, sys
        sys.path.insert(0, {str(FIXTURES)!r})
        import hpdl
        import key_attacks
        from hpdl.errors import HpdlError
        from learner_ring import ring_ok
        good = hpdl.check("ring_allreduce", ring_ok)
        bad = hpdl.check("ring_allreduce", lambda comm, x: x * 0)
        try:
            hpdl.check("ring_allreduce", ring_ok, grade=True)
            refused = ""
        except HpdlError as exc:
            refused = str(exc)
        try:
            hpdl.check("ring_allreduce", ring_ok, ranks=[2])
        except HpdlError as exc:
            refused += " | " + str(exc)
        os.environ["HPDL_KEYS"] = {str(key_dir)!r}  # self-study with the keys: the full check again
        keyed = hpdl.check("ring_allreduce", ring_ok, grade=True)
        thief = hpdl.check("ring_allreduce", key_attacks.exec_keys_file({str(key_dir)!r}))
        sys.path.insert(0, {str(FIXTURES.parent)!r})
        from conftest import solution_function
        from test_cases_08 import tune_exhaustive
        tuned = hpdl.check("autotune", solution_function("08_framework_tuning.ipynb", "autotune"))
        greedy = hpdl.check("autotune", tune_exhaustive)
        print(json.dumps({{"good": good.to_dict(), "text": repr(good), "bad": bad.score, "refused": refused,
                          "keyed": [keyed.score, keyed.max_score], "thief": thief.score,
                          "tuned": [tuned.score, tuned.max_score, len(tuned.cases)], "greedy": greedy.score}}))
    """)
    out = json.loads(_run(kit, "-c", script).stdout.strip().splitlines()[-1])
    good = out["good"]
    assert good["score"] == good["max_score"] > 0 and all(c["verdict"] in ("PASS", "SLOW") for c in good["cases"])
    assert not any(c["hidden"] for c in good["cases"]) and good["hidden_not_run"] == 4
    assert "4 hidden cases not run here: hidden cases run when your instructor grades" in out["text"]
    assert out["bad"] == 0
    assert "grading needs them" in out["refused"] and "--keys" in out["refused"]
    assert "at [1, 3] ranks only" in out["refused"]  # no stored answers at 2 ranks: said, not a crash
    assert out["keyed"] == [9, 9]  # the hidden cases from the keys: 7 at 1 rank (no points: return x is right
    # there), 9 at 3
    assert out["tuned"] == [3, 3, 3] and out["greedy"] == 0  # the oracle's helper measures in a stripped kit too
    if sandbox.available():  # the keys folder sits inside the kit, which the sandbox shows: hidden all the same
        assert out["thief"] == 0


THIEF = """import glob, os
import hpdl

KIT = os.path.dirname(os.path.dirname(os.path.abspath(hpdl.__file__)))
stolen = {}
for path in glob.glob(os.path.join(KIT, "*", "ring_allreduce.py")) + \\
        glob.glob(os.path.join(KIT, "hpdl", "checker", "cases", "ring_allreduce.py")):
    try:
        exec(open(path).read(), stolen)  # the instructor's keys, or the kit's case module
    except Exception as exc:
        print("could not read", path, type(exc).__name__)
print("reference stolen:", "reference" in stolen)
print("keys named:", any("keys" in v for k, v in os.environ.items() if k.startswith("HPDL")))


def ring_allreduce(comm, x, _paths=glob.glob(os.path.join(KIT, "*", "ring_allreduce.py"))):
    ns = dict(stolen)
    for path in _paths:  # and again from inside the check
        try:
            exec(open(path).read(), ns)
        except Exception:
            pass
    return ns["reference"](comm, x) if "reference" in ns else None


hpdl.check("ring_allreduce", ring_allreduce)
"""


@needs_sandbox
def test_grading_with_exported_keys_full_marks_and_nothing_for_a_thief(shared_kit, tmp_path, no_strays):
    kit, key_dir = shared_kit
    solved = nbformat.read(FIXTURES / "solutions" / "01_ring_example.ipynb", as_version=4)
    solved.cells[4].source = 'hpdl.check("ring_allreduce", ring_allreduce)'
    subs = tmp_path / "subs"
    subs.mkdir()
    nbformat.write(solved, subs / "solved.ipynb")
    solved.cells[3].source, solved.cells[4].source = THIEF, "print('done')"
    nbformat.write(solved, subs / "thief.ipynb")
    out = tmp_path / "report"
    flags = ["--allow-root"] if os.geteuid() == 0 else []
    _run(kit, "-m", "hpdl.cli", "grade", str(subs), "--out", str(out), "--keys", str(key_dir), "--timeout", "120",
         *flags, timeout=280)
    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    full = float(rows["solved.ipynb"]["max_score"])
    assert full == 9  # every case at 3 ranks, the hidden ones from the keys included (1 rank: no points)
    assert float(rows["solved.ipynb"]["score"]) == full, rows["solved.ipynb"]
    assert float(rows["thief.ipynb"]["score"]) == 0, rows["thief.ipynb"]
    executed = json.dumps(nbformat.read(out / "executed" / "thief.ipynb", as_version=4).cells[3].outputs)
    assert "reference stolen: False" in executed and "keys named: False" in executed, executed


def test_a_course_case_module_loaded_by_threads_at_once_is_whole_in_each(monkeypatch):
    """The grader checks submissions side by side (--jobs), in threads. A course's module went into
    sys.modules before its code ran, and another thread took it for one without SIGNATURE: an
    honest submission's check was refused. Twenty rounds of eight threads, each a fresh import."""
    import threading

    monkeypatch.setenv("HPDL_CASES_PATH", str(Path(__file__).parent / "fixtures" / "cases"))
    errors = []

    def load():
        try:
            assert cases.load("fixture_ring").SIGNATURE
        except Exception as exc:  # noqa: BLE001 - what a thread met is the finding
            errors.append(exc)

    for _ in range(20):
        sys.modules.pop("hpdl_cases_fixture_ring", None)
        threads = [threading.Thread(target=load) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors[:2]
