"""Small pieces on their own: argument parsing, messages, the hang module's stack reading, the reaper."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import psutil
import pytest

from hpdl import hang, launchers, procs
from hpdl.errors import HpdlError


def test_ranks_text_compacts_runs():
    assert hang.ranks_text([3, 1, 2, 0]) == "0–3"
    assert hang.ranks_text([0, 2]) == "0, 2"
    assert hang.ranks_text([5]) == "5"


def test_rank_lists_have_one_wording_and_one_dedup_rule():
    """%%px, the panel and the checker's table and verdicts all word rank lists through hang."""
    from hpdl.checker import jobs, report

    assert report.ranks_text is hang.ranks_text and jobs.rank_word is hang.rank_word
    assert hang.ranks_text([2, 0, 1, 1, 0]) == "0–2"  # a rank listed twice counts once
    assert hang.ranks_text([3, 1, 3]) == "1, 3"
    assert hang.rank_word([4, 4]) == "rank 4"
    assert hang.rank_word([3, 1, 3]) == "ranks 1, 3"
    r = report.CheckResult("x", [report.CaseResult("x", "a", n, "PASS", 1, 1) for n in (3, 1, 2, 2)])
    assert "1–3 ranks" in repr(r)


def test_launcher_resolution(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.delenv("HPDL_LAUNCHER", raising=False)
    assert launchers.resolve("auto") == "local"
    monkeypatch.setenv("HPDL_LAUNCHER", "local")
    assert launchers.resolve("auto") == "local"
    with pytest.raises(HpdlError, match="not one we know"):
        launchers.resolve("pbs")


def test_mpiexec_found_beside_this_python():
    path = launchers.find_mpiexec()
    assert os.path.exists(path)
    out = subprocess.run([path, "-n", "2", sys.executable, "-c",
                          "from mpi4py import MPI; print(f'<size={MPI.COMM_WORLD.Get_size()}>')"],
                         capture_output=True, text=True, timeout=60)
    # both ranks write to one pipe, so their lines may interleave: count the markers
    assert out.stdout.count("<size=2>") == 2 and "<size=1>" not in out.stdout, out.stdout


def test_watchdog_reads_a_blocked_main_thread(tmp_path):
    """The side thread sees where the main thread waits, with the source line."""
    rank_dir = tmp_path
    (rank_dir / "stacks").mkdir()
    ready = threading.Event()
    release = threading.Event()

    def blocked():
        ready.set()
        release.wait(10)  # the line the snapshot must name

    worker = threading.Thread(target=blocked)
    worker.start()
    ready.wait(5)
    deadline = time.monotonic() + 5  # until the thread has moved from ready.set() into the wait
    while True:
        snap = hang.snapshot(worker.ident)
        code = (snap.get("where") or {}).get("code") or ""
        if code.startswith("release.wait") or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    release.set()
    worker.join()
    assert snap["where"]["func"] == "blocked"
    assert snap["where"]["code"] == "release.wait(10)  # the line the snapshot must name"


def _first_child(pid: int, timeout: float = 10.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        children = psutil.Process(pid).children()
        if children:
            return children[0].pid
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} started no child within {timeout} s")


def test_reaper_kills_the_tree_when_the_watched_process_dies(tmp_path):
    # a "kernel" (sleep) and a "cluster" (a process with a child) it is responsible for
    kernel = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    tree = subprocess.Popen([sys.executable, "-c",
                             "import subprocess, sys, time; "
                             "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); time.sleep(60)"],
                            start_new_session=True)
    child = _first_child(tree.pid)
    state = tmp_path / "reaper.json"
    record = procs.record(tree.pid).to_dict()
    state.write_text(json.dumps({"watch": procs.record(kernel.pid).to_dict(), "procs": [record], "groups": [record],
                                 "jobs": []}))
    reaper = subprocess.Popen([sys.executable, "-m", "hpdl.reaper", str(state)])
    time.sleep(1.0)
    assert psutil.pid_exists(child) and reaper.poll() is None  # nothing happens while the kernel lives
    kernel.kill()
    kernel.wait()
    assert reaper.wait(timeout=15) == 0
    tree.wait(timeout=5)
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE
    assert not state.exists()


def test_reaper_leaves_quietly_after_a_clean_stop(tmp_path):
    state = tmp_path / "reaper.json"
    state.write_text(json.dumps({"watch": procs.record(os.getpid()).to_dict(), "procs": [], "groups": [],
                                 "jobs": []}))
    reaper = subprocess.Popen([sys.executable, "-m", "hpdl.reaper", str(state)])
    time.sleep(0.8)
    assert reaper.poll() is None
    state.unlink()
    assert reaper.wait(timeout=5) == 0


def test_px_timeout_option_is_validated():
    from IPython.core.interactiveshell import InteractiveShell

    from hpdl.magics import register

    ip = InteractiveShell.instance()
    register(ip)
    res = ip.run_cell("%hpdl start -n two")
    assert isinstance(res.error_in_exec, HpdlError) and "whole number" in str(res.error_in_exec)
    res = ip.run_cell("%hpdl launch")
    assert isinstance(res.error_in_exec, HpdlError) and "no verb 'launch'" in str(res.error_in_exec)


def test_cli_lists_verbs_and_rejects_unknown(capsys):
    from hpdl.cli import main

    assert main([]) == 0
    assert "doctor" in capsys.readouterr().out
    assert main(["fly"]) == 2
    assert "no verb 'fly'" in capsys.readouterr().err


def test_px_timeout_is_parsed_by_magic_arguments():
    from IPython.core.error import UsageError

    from hpdl.cluster import px

    parser = px.RankMagics.cell_px.parser
    args = parser.parse_args(["--timeout", "2.5", "--targets", "0", "--noblock"])
    assert (args.timeout, args.targets, args.block) == (2.5, "0", False)  # ipyparallel's own options still work
    assert parser.parse_args([]).timeout is None
    for bad in ("abc", "0"):
        with pytest.raises(UsageError, match="timeout"):
            parser.parse_args(["--timeout", bad])


def test_scratch_folders_of_a_gone_maker_are_swept_and_no_others(tmp_path, monkeypatch):
    """A folder whose maker (host and pid in its name) is gone goes; a live maker's, another host's,
    another kind's, and a file stay."""
    import socket
    import subprocess
    import sys
    import tempfile

    from hpdl import scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    host = socket.gethostname()
    stale = tmp_path / f"hpdl-check-{host}-{gone.pid}-abc"
    (stale / "r0").mkdir(parents=True)
    kept = [tmp_path / f"hpdl-check-{host}-1-abc", tmp_path / f"hpdl-check-elsewhere-{gone.pid}-abc",
            tmp_path / f"hpdl-grade-{host}-{gone.pid}-abc"]
    for k in kept:
        k.mkdir()
    (tmp_path / f"hpdl-check-{host}-{gone.pid}-file").write_text("x")
    mine = scratch.make("check")
    assert mine.parent == tmp_path and mine.name.startswith(f"hpdl-check-{host}-{os.getpid()}-")
    assert not stale.exists() and all(k.exists() for k in kept) and mine.exists()
    assert (tmp_path / f"hpdl-check-{host}-{gone.pid}-file").exists()
    assert scratch.sweep("check") == []  # its own stays while it runs
