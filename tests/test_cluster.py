"""The cluster's life: real MPI ranks start, run collectives, hang, die, and leave nothing behind."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import hpdl
from hpdl import hang
from hpdl.cluster import reports
from hpdl.errors import HpdlError, RankDied, RankHang


@pytest.fixture
def ip():
    """An in-process IPython shell, so %%px runs through the same magics a notebook uses."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    yield shell


def run(ip, cell: str):
    result = ip.run_cell(cell)
    return result


def wait_gone(pids, timeout=15.0) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


# every thread's nice level on a rank (Linux: a thread id names one thread)
NICES = ("\nimport os\n"
         "nices = sorted({os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir('/proc/self/task')})\n"
         "assert os.getpriority(os.PRIO_PROCESS, 0) == 0  # the cell's own thread\n")


def forked_by(ranks: list[dict]) -> list[str] | None:
    """The command of the one process all ranks are forks of (hpdl.forkserver), or None."""
    parents = {psutil.Process(r["pid"]).ppid() for r in ranks}
    cmd = psutil.Process(parents.pop()).cmdline() if len(parents) == 1 else []
    return cmd if cmd[1:4] == ["-m", "hpdl.forkserver", "serve"] else None


def test_four_ranks_agree_on_three_allreduces(no_strays):
    c = hpdl.start(n=4, quiet=True)
    try:
        assert [r["rank"] for r in c.ranks] == [0, 1, 2, 3]
        assert len({r["pid"] for r in c.ranks}) == 4
        forker = forked_by(c.ranks)  # forks of one process that imported torch
        assert forker is not None and "--preload=torch" in forker, [r["pid"] for r in c.ranks]
        view = hpdl.view()
        view.execute(
            textwrap.dedent(
                """
                import torch
                from mpi4py import MPI
                x = torch.tensor([rank + 1.0, 10.0 * rank])
                a = x.clone(); comm.Allreduce(MPI.IN_PLACE, a.numpy(), op=MPI.SUM)
                b = x.clone(); dist.all_reduce(b)
                h = hvd.allreduce(x, op=hvd.Sum)
                out = (a.tolist(), b.tolist(), h.tolist(), rank, world_size, torch.get_num_threads())
                """
            ) + NICES,
            block=True,
        )
        outs = view.pull("out", block=True)
        assert view.pull("nices", block=True) == [[0]] * 4  # Horovod's thread left as it comes by default
        # an engine waits as long as ipyparallel's default (50 checks of 3.5 s) for the hub's pings before it
        # gives up: learners starting side by side on a small node can leave it 50 s without one
        view.execute("from ipyparallel.engine.app import IPEngine as _E; "
                     "_patience = _E.instance().max_heartbeat_misses * _E.instance().hb_check_period", block=True)
        assert all(ms >= 150_000 for ms in view.pull("_patience", block=True))
        for a, b, h, rank, size, threads in outs:
            assert a == b == h == [10.0, 60.0]
            assert size == 4
            assert threads == max(1, len(os.sched_getaffinity(0)) // 4)
        assert [o[3] for o in outs] == [0, 1, 2, 3]
    finally:
        hpdl.stop(quiet=True)
    assert hpdl.status() == {"running": False}


def test_horovods_thread_is_reniced_on_cpu_ranks_when_asked(no_strays, monkeypatch):
    monkeypatch.setenv("HPDL_FORKSERVER", "0")  # and ranks started afresh by mpiexec work as the forked ones do
    with hpdl.start(n=2, env={"HPDL_HOROVOD_NICE": "10"}, quiet=True) as c:
        assert forked_by(c.ranks) is None
        view = hpdl.view()
        view.execute(NICES + "\nh = hvd.allreduce(torch.ones(3), op=hvd.Sum).tolist()\n", block=True)
        # the threads hvd.init() started at nice 10, the rank's own (the learner's cell) at 0
        assert view.pull("nices", block=True) == [[0, 10]] * 2
        assert view.pull("h", block=True) == [[2.0, 2.0, 2.0]] * 2  # and Horovod still reduces


def test_start_again_reuses_healthy_ranks_and_restarts_on_change(no_strays):
    c1 = hpdl.start(n=2, frameworks=(), quiet=True)
    try:
        pids1 = sorted(c1.engine_pids().values())
        hpdl.view().execute("kept = rank * 7", block=True)
        c2 = hpdl.start(n=2, frameworks=(), quiet=True)
        assert c2 is c1 and sorted(c2.engine_pids().values()) == pids1
        assert hpdl.view().pull("kept", block=True) == [0, 7]
        c3 = hpdl.start(n=3, frameworks=(), quiet=True)
        assert c3.n == 3 and not set(c3.engine_pids().values()) & set(pids1)
        assert wait_gone(pids1) == []
        c4 = hpdl.start(n=3, frameworks=(), env={"HPDL_TEST_KNOB": "42"}, quiet=True)
        assert c4 is not c3  # new settings, new ranks: the knob is set before MPI starts
        assert hpdl.view().apply_sync(os.getenv, "HPDL_TEST_KNOB") == ["42"] * 3
    finally:
        hpdl.stop(quiet=True)


def test_hang_names_stuck_rank_and_line_then_restart_recovers(ip, no_strays):
    hpdl.start(n=3, frameworks=(), quiet=True)
    try:
        t0 = time.monotonic()
        res = run(ip, "%%px --timeout 3\nimport numpy as np\nbuf = np.zeros(1)\n"
                      "if rank == 0:\n    comm.Recv(buf, source=2)\nx = 1")
        elapsed = time.monotonic() - t0
        err = res.error_in_exec
        assert isinstance(err, RankHang), err
        msg = str(err)
        assert "stuck:    rank 0 at line 4 of the cell: comm.Recv(buf, source=2)" in msg, msg
        assert "finished: ranks 1, 2" in msg, msg
        assert elapsed < 3 + 10  # reported after the limit, not never
        assert "still stuck" in hpdl.status()["problem"]
        # the next %%px is refused with advice instead of queueing behind the stuck rank
        res = run(ip, "%%px\nprint(rank)")
        assert isinstance(res.error_in_exec, HpdlError) and "hpdl.restart()" in str(res.error_in_exec)
        old = sorted(hpdl.cluster.current().engine_pids().values())
        hpdl.restart()
        res = run(ip, "%%px\ny = comm.allreduce(rank)")
        assert res.error_in_exec is None
        assert hpdl.view().pull("y", block=True) == [3, 3, 3]
        assert wait_gone(old) == []
        # a plain cell's blocking pull waits as long as a cell may (cell_timeout), not for ever, and names the
        # rank that cannot answer (stuck in code sent without waiting) and those that did
        hpdl.view().execute("import numpy as np\nif rank == 2:\n    comm.Recv(np.zeros(1), source=0)", block=False)
        hpdl.cluster.current().cell_timeout = 3
        with pytest.raises(RankHang) as pulled:
            hpdl.view().pull("y", block=True)
        said = str(pulled.value)
        assert said.startswith("view.pull(...) did not finish on every rank within 3 s."), said
        assert "stuck:    rank 2 at line 3 of the cell: comm.Recv(np.zeros(1), source=0)" in said, said
        assert "finished: ranks 0, 1" in said, said
    finally:
        hpdl.stop(quiet=True)


def test_learner_error_on_one_rank_is_shown_per_rank(ip, no_strays):
    hpdl.start(n=2, frameworks=(), quiet=True)
    try:
        res = run(ip, "%%px\nz = 1 / (rank - 1)")
        from ipyparallel.error import AlreadyDisplayedError, CompositeError

        assert isinstance(res.error_in_exec, (CompositeError, AlreadyDisplayedError))
        assert ("ZeroDivisionError" in str(res.error_in_exec.__cause__ or res.error_in_exec)
                or "1 errors" in str(res.error_in_exec))
        assert hpdl.view().pull("z", targets=0, block=True) == -1.0
    finally:
        hpdl.stop(quiet=True)


def test_killed_rank_is_named_and_next_start_recovers(ip, no_strays, tmp_path):
    c = hpdl.start(n=3, frameworks=(), quiet=True)
    try:
        victim = c.engine_pids()[1]
        others = [p for r, p in c.engine_pids().items() if r != 1]
        running = tmp_path / "rank1-running"  # killed once its cell runs, not after a guessed delay
        killer = subprocess.Popen([sys.executable, "-c", "import os, signal, sys, time\n"
                                   f"while not os.path.exists({str(running)!r}):\n    time.sleep(0.02)\n"
                                   f"os.kill({victim}, signal.SIGKILL)"])
        mark = f"pathlib.Path({str(tmp_path)!r}, f'rank{{rank}}-running').touch()"
        res = run(ip, f"%%px --timeout 60\nimport time, pathlib; {mark}\ntime.sleep(30)")
        killer.wait()
        err = res.error_in_exec
        assert isinstance(err, RankDied), err
        assert str(err).startswith(f"rank 1 (pid {victim}"), str(err)
        assert "hpdl.start()" in str(err)
        assert wait_gone(others) == []  # the MPI job ends with its rank
        c2 = hpdl.start(n=3, frameworks=(), quiet=True)
        assert c2 is not c and c2.problem() is None
        assert sorted(hpdl.view().apply_sync(os.getpid)) == sorted(c2.engine_pids().values())
    finally:
        hpdl.stop(quiet=True)


KERNEL_CODE = ("import hpdl, json\nc = hpdl.start(n=2, frameworks=(), quiet=True)\n"
               "print(json.dumps(sorted(c.engine_pids().values()) + [c.ipp.controller.pid]))")


def _kernel_with_cluster(code: str = KERNEL_CODE):
    from jupyter_client import KernelManager

    km = KernelManager(kernel_name="python3")
    km.start_kernel(env=dict(os.environ))
    kc = km.client()
    kc.start_channels()
    kc.wait_for_ready(timeout=60)
    out = []
    kc.execute_interactive(code, timeout=120,
                           output_hook=lambda m: out.append(m["content"].get("text", ""))
                           if m["msg_type"] == "stream" else None)
    import json

    pids = json.loads([line for line in "".join(out).splitlines() if line.startswith("[")][-1])
    return km, kc, pids


@pytest.mark.parametrize("how", ["restart", "kill"])
def test_no_process_survives_a_kernel_restart_or_kill(how, no_strays):
    """Nor its run folder: the reaper removes it with the processes when the kernel is killed."""
    runs = Path(os.environ["HPDL_HOME"], "runs")
    before = set(runs.glob("*"))
    km, kc, pids = _kernel_with_cluster()
    assert len(pids) == 3 and all(psutil.pid_exists(p) for p in pids)
    run_dirs = set(runs.glob("*")) - before
    assert len(run_dirs) == 1
    try:
        if how == "restart":
            km.restart_kernel(now=False)  # a polite restart: the kernel shuts down, then starts again
        else:
            os.kill(km.provisioner.pid, signal.SIGKILL)  # no exit handlers run; the reaper acts
        assert wait_gone(pids, timeout=20) == [], f"left running after kernel {how}"
        deadline = time.monotonic() + 10  # the reaper removes the folder after the processes
        while any(d.exists() for d in run_dirs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(d.exists() for d in run_dirs), f"run folder left after kernel {how}: {run_dirs}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"n": 0}, "whole number"),
        ({"n": "4"}, "whole number"),
        ({"n": 2, "frameworks": ("tensorflow",)}, "tensorflow unknown"),
        ({"n": 2, "launcher": "kubernetes"}, "launcher='kubernetes'"),
        ({"n": 2, "cell_timeout": -1}, "positive"),
    ],
)
def test_bad_arguments_get_a_message_not_a_traceback(kwargs, words):
    with pytest.raises(HpdlError) as info:
        hpdl.start(**kwargs)
    assert words in str(info.value)
    assert hpdl.status() == {"running": False}


def test_missing_mpiexec_says_what_to_do(tmp_path):
    """A Python with no MPI launcher beside it and none on PATH."""
    import sysconfig

    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    os.symlink(os.path.realpath(sys.executable), fake_bin / "python")
    env = {
        "PATH": "/usr/bin:/bin",
        "PYTHONPATH": os.pathsep.join([sysconfig.get_paths()["purelib"], str(hpdl.__path__[0].rsplit("/", 1)[0])]),
        "HOME": str(tmp_path),
        "HPDL_HOME": str(tmp_path / "home"),
    }
    code = "import hpdl\ntry:\n    hpdl.start(n=2)\nexcept hpdl.errors.HpdlError as e:\n    print('MESSAGE', e)\n"
    p = subprocess.run([str(fake_bin / "python"), "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert "MESSAGE No mpiexec found" in p.stdout, p.stdout + p.stderr
    assert "make lab" in p.stdout


def test_magic_start_and_hang_inside_a_learner_function(ip, no_strays):
    """%hpdl start works like hpdl.start; a hang inside a function names the function's line."""
    from hpdl.magics import register

    register(ip)
    res = run(ip, "%hpdl start -n 2 --frameworks ''")
    assert res.error_in_exec is None and hpdl.status()["n"] == 2
    try:
        assert run(ip, "%%px\ndef exchange(comm, x):\n    import numpy as np\n    got = np.empty_like(x)\n"
                       "    comm.Recv(got, source=(comm.rank + 1) % comm.size)\n"
                       "    comm.Send(x, dest=(comm.rank - 1) % comm.size)\n    return got").error_in_exec is None
        res = run(ip, "%%px --timeout 2\nimport numpy as np\nexchange(comm, np.ones(4))")
        msg = str(res.error_in_exec)
        assert isinstance(res.error_in_exec, RankHang)
        assert ("stuck:    rank 0 at line 4 of exchange(): comm.Recv(got, source=(comm.rank + 1) % comm.size)"
                in msg), msg
        assert "stuck:    rank 1 at line 4 of exchange()" in msg, msg
    finally:
        run(ip, "%hpdl stop")
    assert hpdl.status() == {"running": False}


def _wait_until_ranks_at(lines: dict[int, int], timeout: float = 60.0) -> None:
    """Wait until each rank's main thread sits at the given line of the running cell (asked
    through hpdl.hang, as a hang report would), instead of sleeping for a guessed time."""
    runs = sorted(Path(os.environ["HPDL_HOME"], "runs").glob("*/reaper.json"), key=lambda p: p.stat().st_mtime)
    run_dir = str(runs[-1].parent)
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = hang.ask(run_dir, list(lines), wait=0.5)
        if all(((got.get(r) or {}).get("where") or {}).get("line") == n for r, n in lines.items()):
            return
        time.sleep(0.1)
    raise AssertionError(f"ranks never reached lines {lines}")


def test_interrupting_a_stuck_cell_names_the_rank_that_cannot_stop(no_strays):
    """The notebook's stop button: ranks in Python stop; a rank inside MPI is named."""
    km, kc, pids = _kernel_with_cluster()
    try:
        errors = []
        msg_id = kc.execute("%%px\nimport numpy as np, time\nif rank == 0:\n    comm.Recv(np.zeros(1), source=1)\n"
                            "else:\n    time.sleep(60)")
        _wait_until_ranks_at({0: 3, 1: 5})  # rank 0 in the Recv, rank 1 asleep: press stop
        km.interrupt_kernel()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                m = kc.get_iopub_msg(timeout=1)
            except Exception:
                continue
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            if m["msg_type"] == "error":
                errors.append(m["content"])
            if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                break
        assert errors and errors[-1]["ename"] == "RankHang", errors
        text = errors[-1]["evalue"]
        assert text.startswith("interrupted"), text
        assert "stuck:    rank 0 at line 3 of the cell: comm.Recv(np.zeros(1), source=1)" in text, text
        assert "rank 1" in text and "stuck:    rank 1" not in text, text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    assert wait_gone(pids, timeout=20) == []


def test_px_hang_is_worded_by_hpdl_hang_and_a_with_block_stops_the_ranks(ip, no_strays):
    """The %%px report is hang.hang_message's wording (the checker's too), through the public path."""
    with hpdl.start(n=2, frameworks=(), quiet=True) as c:
        res = run(ip, "%%px --timeout 2\nimport numpy as np\nif rank == 1:\n    comm.Recv(np.zeros(1), source=0)")
        assert isinstance(res.error_in_exec, RankHang), res.error_in_exec
        stuck = {1: {"where": {"line": 3, "func": "<module>", "code": "comm.Recv(np.zeros(1), source=0)"}}}
        assert str(res.error_in_exec) == hang.hang_message(
            "the cell did not finish on every rank within 2 s.", stuck, finished=[0], advice=reports.RESTART_ADVICE)
        assert "  stuck:    rank 1 at line 3 of the cell: comm.Recv(np.zeros(1), source=0)" in str(res.error_in_exec)
        assert repr(c).startswith("<hpdl cluster: 2 ranks via local, started ")  # no probe of the stuck rank
        pids = sorted(c.engine_pids().values())
    assert hpdl.status() == {"running": False} and repr(c).endswith("stopped>")
    assert wait_gone(pids) == []


def test_px_options_keep_their_meaning_and_a_hang_on_some_targets_names_those_ranks(ip, no_strays):
    """%%px runs through ipyparallel's public path: --out keeps its %px-named AsyncResult,
    %pxresult shows the last one, and a hang under --targets names the targeted rank only."""
    with hpdl.start(n=2, frameworks=(), quiet=True):
        res = run(ip, "%%px --out saved\nx = rank * 10\nx")
        assert res.error_in_exec is None
        saved = ip.user_ns["saved"]
        assert repr(saved) == "<AsyncResult(%px): finished>"
        assert [r.data["text/plain"] for r in saved.get()] == ["0", "10"]
        assert run(ip, "%pxresult").error_in_exec is None
        res = run(ip, "%%px --targets 1 --timeout 2\nimport numpy as np\ncomm.Recv(np.zeros(1), source=0)")
        err = res.error_in_exec
        assert isinstance(err, RankHang), err
        assert "stuck:    rank 1 at line 2 of the cell: comm.Recv(np.zeros(1), source=0)" in str(err), str(err)
        assert "finished:" not in str(err) and "rank 0" not in str(err), str(err)
        # a plain cell's blocking pull is refused at once, as the next %%px is, not queued behind the stuck rank
        with pytest.raises(HpdlError, match=r"still stuck in a cell that timed out\. Run hpdl\.restart\(\)"):
            hpdl.view().pull("x", block=True)
        res = run(ip, "%%px --timeout two\nx = 1")
        assert isinstance(res.error_in_exec, HpdlError) and "--timeout 30" in str(res.error_in_exec)
