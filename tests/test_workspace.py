"""`hpdl exercises`: a learner's workspace gets new and updated exercises, never loses an edit."""
from __future__ import annotations

import json

from hpdl import workspace


def test_copy_update_and_never_overwrite_the_learners_changes(tmp_path, monkeypatch, capsys):
    kit = tmp_path / "kit"
    (kit / "sub").mkdir(parents=True)
    (kit / "01.ipynb").write_text("v1 of 01")
    (kit / "02.ipynb").write_text("v1 of 02")
    (kit / "sub" / "03.ipynb").write_text("v1 of 03")
    (kit / ".ipynb_checkpoints").mkdir()
    (kit / ".ipynb_checkpoints" / "01-checkpoint.ipynb").write_text("junk")
    monkeypatch.setenv("HPDL_WORKSPACE", str(tmp_path / "ws"))
    monkeypatch.chdir(tmp_path)

    assert workspace.main(["--source", str(kit)]) == 0  # the default destination: $HPDL_WORKSPACE
    ws = tmp_path / "ws"
    assert sorted(p.relative_to(ws).as_posix() for p in ws.rglob("*.ipynb")) == ["01.ipynb", "02.ipynb", "sub/03.ipynb"]
    assert set(json.loads((ws / ".hpdl-manifest.json").read_text())) == {"01.ipynb", "02.ipynb", "sub/03.ipynb"}

    (ws / "01.ipynb").write_text("my work on 01")  # the learner edits 01
    (kit / "01.ipynb").write_text("v2 of 01")  # the kit updates 01 and 02, and adds 04
    (kit / "02.ipynb").write_text("v2 of 02")
    (kit / "04.ipynb").write_text("v1 of 04")
    capsys.readouterr()
    result = workspace.sync(kit, ws)
    assert result.added == ["04.ipynb"] and result.updated == ["02.ipynb"]
    assert result.kept == ["01.ipynb"] and result.unchanged == ["sub/03.ipynb"]
    assert (ws / "01.ipynb").read_text() == "my work on 01"
    assert (ws / "02.ipynb").read_text() == "v2 of 02" and (ws / "04.ipynb").read_text() == "v1 of 04"
    assert "01.ipynb" in result.summary(ws) and "not touched" in result.summary(ws)

    # still the learner's after another run; a deleted file comes back; nothing else moves
    (ws / "sub" / "03.ipynb").unlink()
    again = workspace.sync(kit, ws)
    assert again.kept == ["01.ipynb"] and again.added == ["sub/03.ipynb"] and again.updated == []
    assert (ws / "01.ipynb").read_text() == "my work on 01"


def test_a_file_already_there_that_we_did_not_copy_is_kept(tmp_path):
    kit, ws = tmp_path / "kit", tmp_path / "ws"
    kit.mkdir()
    ws.mkdir()
    (kit / "01.ipynb").write_text("kit")
    (ws / "01.ipynb").write_text("mine, from before")
    result = workspace.sync(kit, ws)
    assert result.kept == ["01.ipynb"] and (ws / "01.ipynb").read_text() == "mine, from before"


def test_no_exercises_is_a_clear_error(tmp_path):
    import pytest

    from hpdl.errors import HpdlError

    with pytest.raises(HpdlError, match="hpdl build"):
        workspace.sync(tmp_path / "nothing", tmp_path / "ws")


def _kit(root):
    for part, name in (("notebooks", "00_welcome.ipynb"), ("notebooks/scripts", "train.py"),
                       ("exercises", "01.ipynb"), ("benchmarks", "synthetic.py")):
        (root / part).mkdir(parents=True, exist_ok=True)
        (root / part / name).write_text(f"kit's {name}")
    return root


def test_the_kit_goes_to_a_0700_workspace_its_lessons_exercises_and_benchmarks_side_by_side(tmp_path, monkeypatch,
                                                                                            capsys):
    import stat

    import pytest

    from hpdl.errors import HpdlError

    kit = _kit(tmp_path / "kit")
    monkeypatch.setenv("HPDL_DIR", str(kit))
    monkeypatch.delenv("HPDL_WORKSPACE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    # a kit the learner may write (their clone): workspace/ in it, as before
    assert workspace.default_dest() == kit / "workspace"
    # a kit shared read-only (root may write anywhere, so the learner's view is stood in for)
    monkeypatch.setattr(workspace.os, "access", lambda path, mode: not str(path).startswith(str(kit)))
    ws = tmp_path / "home" / "hpdl-workspace"
    assert workspace.default_dest() == ws
    assert workspace.main(["--where"]) == 0 and capsys.readouterr().out.strip() == str(ws)
    assert not ws.exists()  # --where copies nothing
    assert workspace.main([]) == 0
    assert stat.S_IMODE(ws.stat().st_mode) == 0o700
    assert sorted(p.relative_to(ws).as_posix() for p in ws.rglob("*") if p.is_file() and "manifest" not in p.name) \
        == ["benchmarks/synthetic.py", "exercises/01.ipynb", "notebooks/00_welcome.ipynb", "notebooks/scripts/train.py"]
    (ws / "notebooks" / "00_welcome.ipynb").write_text("my notes in the lesson")
    (kit / "notebooks" / "00_welcome.ipynb").write_text("the kit's new lesson")
    again = workspace.sync_kit(kit, ws)
    assert again.kept == ["notebooks/00_welcome.ipynb"] and again.added == []
    assert (ws / "notebooks" / "00_welcome.ipynb").read_text() == "my notes in the lesson"

    ws.chmod(0o755)  # a workspace the learner made themselves keeps its mode
    workspace.sync_kit(kit, ws)
    assert stat.S_IMODE(ws.stat().st_mode) == 0o755
    monkeypatch.setenv("HPDL_DIR", str(tmp_path / "home"))  # not a kit: says what to set
    with pytest.raises(HpdlError, match="HPDL_DIR=.*notebooks"):
        workspace.default_dest()
    monkeypatch.setenv("HPDL_DIR", str(kit))
    (kit / "exercises" / "01.ipynb").unlink()
    (kit / "exercises").rmdir()
    with pytest.raises(HpdlError, match="No exercises/"):
        workspace.sync_kit(kit, ws)


def test_a_renamed_lesson_replaces_an_untouched_copy_and_keeps_a_changed_one(tmp_path):
    """Lesson 07 was split in two and 08-10 became 09-11: a workspace made before gets the new names,
    loses no edit, and is told where the notebook it changed lives now."""
    kit, ws = tmp_path / "kit", tmp_path / "ws"
    kit.mkdir()
    for name in ("07_collective_tuning.ipynb", "08_scaling_studies.ipynb", "09_model_parallelism.ipynb"):
        (kit / name).write_text(f"old kit's {name}")
    workspace.sync(kit, ws)
    (ws / "09_model_parallelism.ipynb").write_text("my pipeline stage")  # the learner's work
    (ws / "07_collective_tuning.ipynb").write_text("my autotune")
    for name in ("08_scaling_studies.ipynb", "09_model_parallelism.ipynb"):
        (kit / name).unlink()
    for name in ("07_collective_tuning.ipynb", "08_framework_tuning.ipynb", "09_scaling_studies.ipynb",
                 "10_model_parallelism.ipynb"):
        (kit / name).write_text(f"new kit's {name}")

    result = workspace.sync(kit, ws)
    assert sorted(p.name for p in ws.glob("*.ipynb")) == [
        "07_collective_tuning.ipynb", "08_framework_tuning.ipynb", "09_model_parallelism.ipynb",
        "09_scaling_studies.ipynb", "10_model_parallelism.ipynb"]
    assert (ws / "09_model_parallelism.ipynb").read_text() == "my pipeline stage"
    assert (ws / "07_collective_tuning.ipynb").read_text() == "my autotune"
    assert (ws / "09_scaling_studies.ipynb").read_text() == "new kit's 09_scaling_studies.ipynb"
    assert result.retired == ["08_scaling_studies.ipynb -> 09_scaling_studies.ipynb"]
    assert result.renamed == ["09_model_parallelism.ipynb -> 10_model_parallelism.ipynb"]
    assert result.kept == ["07_collective_tuning.ipynb"]
    text = result.summary(ws)
    assert "09_model_parallelism.ipynb -> 10_model_parallelism.ipynb" in text and "stays as it is" in text

    # the changed copy is still named on the next run (it is still the learner's); the removed one stays gone
    again = workspace.sync(kit, ws)
    assert again.renamed == result.renamed and again.retired == [] and again.added == []
    assert not (ws / "08_scaling_studies.ipynb").exists()
