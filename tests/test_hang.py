"""hpdl.hang on its own: the ask/answer protocol between threads, the learner-frame filter,
the faulthandler fallback, and the one wording of a hang report."""
from __future__ import annotations

import os
import subprocess
import sys
import threading

from hpdl import hang, procs


def _blocked_thread():
    ready, release = threading.Event(), threading.Event()

    def blocked():
        ready.set()
        release.wait(10)  # the line the answer must name

    t = threading.Thread(target=blocked)
    t.start()
    ready.wait(5)
    return t, release


def test_an_answerer_names_the_line_its_main_thread_waits_on(tmp_path):
    t, release = _blocked_thread()
    answerer = hang.Answerer(str(tmp_path), 3, poll=0.02, extra=lambda: {"case": "n=9"})
    answerer.main_ident = t.ident  # a stand-in for a rank's main thread blocked in MPI
    answerer.start()
    try:
        got = hang.ask(str(tmp_path), [3, 4], wait=1.0)
    finally:
        release.set()
        t.join()
    assert list(got) == [3]  # rank 4 has no answerer: left out, not invented
    where = got[3]["where"]
    assert where["func"] == "blocked" and where["code"] == "release.wait(10)  # the line the answer must name"
    assert got[3]["case"] == "n=9" and got[3]["pid"] == os.getpid()
    # a second request gets a fresh answer, not the old file
    assert hang.ask(str(tmp_path), [3], wait=1.0)[3]["token"] != got[3]["token"]


def test_learner_frames_exclude_libraries_and_the_kit():
    assert hang.is_learner_file("/tmp/ipykernel_12/3456.py")
    assert not hang.is_learner_file(hang.__file__)
    assert not hang.is_learner_file("/venv/lib/python3.11/site-packages/mpi4py/__init__.py")
    assert hang.is_learner_file("/x/ring.py", files={"/x/ring.py"}) and not hang.is_learner_file("/y.py", files=set())


def test_a_rank_holding_the_python_lock_is_found_through_faulthandler(tmp_path):
    """No answerer can run while a C call holds the lock; SIGUSR1 and faulthandler still can."""
    script = tmp_path / "learner.py"
    script.write_text("import sys, time\nfrom hpdl import hang\nhang.install_faulthandler(sys.argv[1], 0)\n"
                      "print('ready', flush=True)\ntime.sleep(60)  # stuck here\n")
    p = subprocess.Popen([sys.executable, str(script), str(tmp_path)], stdout=subprocess.PIPE)
    try:
        assert p.stdout.readline().strip() == b"ready"
        got = hang.ask(str(tmp_path), [0], wait=0.2, procs={0: procs.record(p.pid)})
    finally:
        p.kill()
        p.wait()
    where = {"file": str(script), "line": 5, "func": "<module>", "code": "time.sleep(60)  # stuck here"}
    assert got[0]["where"] == where
    assert hang.stuck_text(got[0]) == "line 5 of the cell: time.sleep(60)  # stuck here"


def test_one_wording_for_a_hang():
    cell = "import numpy as np\nbuf = np.zeros(1)\nif rank == 0:\n    comm.Recv(buf, source=2)"
    stuck = {0: {"where": {"line": 4, "func": "<module>", "code": ""}}, 3: None,
             1: {"where": {"line": 12, "func": "ring", "code": "comm.Recv(buf)"}}}
    assert hang.report_lines(stuck, finished=[2], errors={4: "ValueError: x"}, code=cell) == [
        "  finished: rank 2",
        "  stuck:    rank 0 at line 4 of the cell: comm.Recv(buf, source=2)",
        "  stuck:    rank 1 at line 12 of ring(): comm.Recv(buf)",
        f"  stuck:    rank 3 at {hang.NO_ANSWER}",
        "  error:    rank 4 raised ValueError: x",
    ]
    same = {r: {"where": {"line": 12, "func": "ring", "code": "comm.Recv(buf)"}} for r in (1, 3)}
    assert hang.summary(same, finished=[0]) == (
        "finished: rank 0; stuck: ranks 1, 3 at line 12 of ring(): comm.Recv(buf)")
    msg = hang.hang_message("did not finish.", same, [0, 2], advice="Run hpdl.restart().")
    assert msg.splitlines()[0] == "did not finish." and msg.endswith(hang.DEADLOCK_HINT + "\nRun hpdl.restart().")
    assert hang.ranks_text([3, 1, 2, 0]) == "0–3" and hang.rank_word([5]) == "rank 5"


def test_ask_gives_up_on_ranks_that_do_not_answer(tmp_path):
    assert hang.ask(str(tmp_path), []) == {}
    assert hang.ask(str(tmp_path), [0], wait=0.1) == {}
    assert (tmp_path / hang.REQUEST).read_text()  # the request was made
