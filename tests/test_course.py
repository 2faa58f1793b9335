"""The day before and after the course, on the local Slurm: `hpdl rehearse` runs learners' jobs as
the hub would (lesson 00 and one exercise check each) and tables them; `hpdl course end` lists,
waits for its date, then stops the hub, cancels the course's jobs and archives before it removes.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import uuid
from pathlib import Path

import psutil
import pytest
from test_slurm import outside_slurm, slurm, squeue, wait_until  # noqa: F401  (the local Slurm, a login node)

from hpdl import course

ROOT = Path(__file__).resolve().parents[1]


def hpdl_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpdl.cli", *args], capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, stdin=subprocess.DEVNULL)


@pytest.mark.slow
@pytest.mark.slurm
@pytest.mark.usefixtures("slurm", "outside_slurm")
def test_rehearsal_of_three_learners_two_pass_and_a_cancelled_one_is_named(tmp_path, no_strays):
    """One rehearsal: two learners run lesson 00 and the check, with their node and times; the
    third, whose job is cancelled as soon as Slurm lists it, fails with its job and what it was
    doing; exit 1; no job left. Three, not more: each runs four ranks and a kernel, and on a 2-core machine
    more learners only time out hpdl.start without telling anything new."""
    out = tmp_path / "rehearsal"
    proc = subprocess.Popen([sys.executable, "-m", "hpdl.cli", "rehearse", "--site", "local-slurm", "--learners", "3",
                             "--out", str(out), "--timeout", "450"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdin=subprocess.DEVNULL)
    try:
        last = wait_until(lambda: squeue("-n", "hpdl-rehearse-3", "-o", "%i"), 120, "learner 3's job was not listed")
        subprocess.run(["scancel", last], timeout=30)
        printed, _ = proc.communicate(timeout=520)  # its own limit ends it first, naming where each learner was
    finally:
        if proc.poll() is None:  # the command cancels its jobs on SIGTERM
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=60)
    assert proc.returncode == 1, printed
    assert squeue("-n", ",".join(f"hpdl-rehearse-{n}" for n in range(1, 4)), "-o", "%i") == ""
    left = [p.pid for p in psutil.process_iter() if _environ(p).get("HPDL_HOME", "").startswith(str(out))]
    assert not left, f"learners' processes left: {left}"
    result = json.loads((out / "rehearsal.json").read_text())
    rows = {r["learner"]: r for r in result["rows"]}
    assert sorted(rows) == [1, 2, 3] and result["ranks"] == 4 and not result["passed"]
    assert not rows[3]["passed"]
    assert re.search(rf"Slurm job {last} ended \(CANCELLED, exit [^)]*\) before the learner finished: it was ",
                     rows[3]["reason"]), rows[3]["reason"]
    assert f"    → Slurm job {last} ended" in printed
    assert all(rows[n]["passed"] for n in (1, 2)), [rows[n]["reason"] for n in (1, 2)]
    page = (out / "index.html").read_text()
    assert "<h1>hpdl rehearse: <span class=\"fail\">FAIL</span></h1>" in page and "src=" not in page
    assert page.count("<tr class='fail'>") == 1
    for n in (1, 2):
        r = rows[n]
        assert r["node"] == socket.gethostname() and r["ranks"] == 4, r
        assert 0 <= r["queue_wait_s"] < 450 and r["queue_wait_from"], r
        assert 0 < r["ranks_ready_s"] < r["lesson_s"] + 60 and r["check_s"] > 0, r
        assert "ranks agree" in (Path(r["folder"]) / "lesson_00-run.ipynb").read_text()
        assert re.search(rf"^{n} +\d+ +{re.escape(socket.gethostname())} +[\d.]+ +[\d.]+ +[\d.]+ +[\d.]+ +"
                         + ("PASS" if r["passed"] else "FAIL"), printed, re.M), printed
    assert "FAIL: 1 of 3 learner(s) failed" in printed


def _environ(p: psutil.Process) -> dict:
    try:
        return p.environ()
    except psutil.Error:
        return {}


def _tree(root: Path) -> dict[str, bytes | str]:
    """Every file under root: its bytes (a link: where it points)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = str(p.relative_to(root))
        out[rel] = ("-> " + os.readlink(p)) if p.is_symlink() else p.read_bytes() if p.is_file() else \
            "dir" if p.is_dir() else "special"
    return out


def _learners(homes: Path, outside: Path) -> None:
    for name in ("alice", "bob"):
        home = homes / name
        (home / "hpdl" / "workspace").mkdir(parents=True)
        (home / "hpdl" / "workspace" / "03_mpi_collectives.ipynb").write_text(f'{{"cells": ["{name} wrote this"]}}')
        (home / "hpdl" / "notebooks").mkdir()
        (home / "hpdl" / "notebooks" / "00_welcome.ipynb").write_bytes(os.urandom(3000))
        (home / ".hpdl" / "runs" / "hpdl-1-abcdef").mkdir(parents=True)
        (home / ".hpdl" / "runs" / "hpdl-1-abcdef" / "reaper.json").write_text("{}")
        (home / "hpdl-hub-12.log").write_text(f"{name}'s job log\n")
        (home / "notes.txt").write_text("not the kit's: stays")
    (homes / "alice" / "hpdl" / "elsewhere").symlink_to(outside)  # archived as a link; its target stays
    os.mkfifo(homes / "bob" / "hpdl" / "pipe")  # holds no data: never archived, so never removed


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm", "outside_slurm")
def test_course_end_lists_then_waits_for_its_date_then_stops_cancels_archives_and_removes(tmp_path, monkeypatch,
                                                                                          no_strays):
    account = f"hpdl-test-{uuid.uuid4().hex[:8]}"  # only this test's jobs are the course's
    site = tmp_path / "course.toml"
    site.write_text(f'[slurm]\npartition = "debug"\naccount = "{account}"\ntime = "00:10:00"\n')
    homes, outside, archive = tmp_path / "homes", tmp_path / "outside.txt", tmp_path / "archive"
    outside.write_text("a learner's link points here")
    _learners(homes, outside)
    hub_state = tmp_path / "hub-state"
    hub_state.mkdir()
    (hub_state / "jupyterhub.sqlite").write_bytes(b"SQLite format 3\0" + os.urandom(100))
    monkeypatch.setenv("HPDL_HUB_STATE", str(hub_state))
    fake_hub = tmp_path / "bin" / "jupyterhub"  # a process that looks like this kit's hub
    fake_hub.parent.mkdir()
    fake_hub.write_text("import time\ntime.sleep(600)\n")
    hub = subprocess.Popen([sys.executable, str(fake_hub), "-f", str(course.HUB_CONFIG)])
    jobs = {}
    for name in ("hpdl-jupyter", "someone-elses"):
        p = subprocess.run(["sbatch", "--parsable", "-A", account, "-J", name, "-o", "/dev/null", "-t", "10",
                            "--wrap", "sleep 600"], capture_output=True, text=True, timeout=60)
        assert p.returncode == 0, p.stderr
        jobs[name] = p.stdout.strip().split(";")[0]
    args = ["course", "end", "--site", str(site), "--homes", str(homes / "*"), "--archive", str(archive)]
    try:
        before = _tree(tmp_path / "homes"), _tree(hub_state)
        dry = hpdl_cli(*args)
        assert dry.returncode == 0, dry.stderr
        assert f"stop the hub: SIGTERM to the hub, pid {hub.pid}" in dry.stdout
        assert f"cancel Slurm job {jobs['hpdl-jupyter']} hpdl-jupyter" in dry.stdout
        assert jobs["someone-elses"] not in dry.stdout
        for who in ("alice", "bob", "hub-state"):
            assert f"archive {who}: " in dry.stdout
        assert f"{homes / 'alice' / 'hpdl-hub-12.log'}" in dry.stdout and "notes.txt" not in dry.stdout
        assert dry.stdout.rstrip().endswith("Dry run: nothing was changed. Run again with --yes to do it.")
        later = hpdl_cli(*args, "--date", "2999-01-01", "--yes")
        assert later.returncode == 0 and "on 2999-01-01 or later" in later.stdout
        assert later.stdout.rstrip().endswith("Nothing done before that date.")
        assert (_tree(tmp_path / "homes"), _tree(hub_state)) == before and not archive.exists()
        assert hub.poll() is None and squeue("-j", jobs["hpdl-jupyter"], "-o", "%i") == jobs["hpdl-jupyter"]

        done = hpdl_cli(*args, "--date", "2020-01-01", "--yes")
        assert done.returncode == 1, done.stdout + done.stderr  # bob's fifo could not be archived: left, named
        assert "bob: archived" in done.stdout and "hpdl/pipe (a socket or fifo)" in done.stdout
        assert hub.wait(timeout=30) == -signal.SIGTERM
        assert squeue("-j", jobs["hpdl-jupyter"], "-o", "%i") == ""
        assert squeue("-j", jobs["someone-elses"], "-o", "%i") == jobs["someone-elses"]
    finally:
        subprocess.run(["scancel", *jobs.values()], timeout=30)
        if hub.poll() is None:
            hub.kill()
            hub.wait()
    _archived_equal_then_gone(archive, homes, hub_state, before, outside)


def _archived_equal_then_gone(archive: Path, homes: Path, hub_state: Path, before: tuple, outside: Path) -> None:
    """Each archive (0600, in a 0700 folder) holds exactly what was there, byte for byte; the
    kit's files are gone, the learner's own notes, a fifo and a link's target are not."""
    homes_before, hub_before = before
    assert stat.S_IMODE(archive.stat().st_mode) == 0o700
    assert sorted(p.name for p in archive.iterdir()) == ["alice.tar.gz", "bob.tar.gz", "hub-state.tar.gz"]
    wanted = {name: {k[len(name) + 1:]: v for k, v in homes_before.items() if k.startswith(name + "/")
                     and k != f"{name}/notes.txt" and not k.endswith("/pipe")} for name in ("alice", "bob")}
    wanted["hub-state"] = {"hub-state": "dir", **{f"hub-state/{k}": v for k, v in hub_before.items()}}
    for name, want in wanted.items():
        path = archive / f"{name}.tar.gz"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600 and path.stat().st_uid == os.getuid()
        with tarfile.open(path) as tar:
            got = {m.name: ("-> " + m.linkname) if m.issym() else tar.extractfile(m).read() if m.isfile() else "dir"
                   for m in tar}
        assert got == want, name
    assert _tree(homes) == {"alice": "dir", "alice/notes.txt": b"not the kit's: stays", "bob": "dir",
                            "bob/hpdl": "dir", "bob/hpdl/pipe": "special", "bob/notes.txt": b"not the kit's: stays"}
    assert not hub_state.exists() and outside.read_text() == "a learner's link points here"
