"""The side-job supervisor (hpdl.sidejob): real processes, real MPI jobs, real signals.

One grace policy, deadlines on the monotonic clock, nothing left behind (tree, group, a daemon
that left both, MPI shared memory), and one place in the package that starts side jobs."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import hpdl
from conftest import kill_then_nothing_left
from hpdl import launchers, procs, sidejob

PKG = Path(__file__).resolve().parents[1] / "hpdl"
FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import learner_ring as L  # noqa: E402  (a learner's ring: it starts MPI in this process, once)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(code)]


def test_a_job_that_exits_by_itself_gives_its_code_and_output(no_strays):
    done = sidejob.run(_py("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"), 30,
                       errors_apart=True)
    assert (done.returncode, done.output.strip(), done.errors.strip(), done.timed_out) == (3, "out", "err", False)


def test_a_named_output_file_is_read_back_while_it_runs_and_after(no_strays, tmp_path):
    job = sidejob.SideJob(_py("print('first', flush=True); import time; time.sleep(600)"), output=tmp_path / "out")
    deadline = time.monotonic() + 30
    while "first" not in job.output_text(8192):
        assert time.monotonic() < deadline and job.running()
        time.sleep(0.05)
    job.end(now=True)
    assert job.output_text().strip() == "first" == (tmp_path / "out").read_text().strip()


def test_past_its_time_the_whole_tree_and_group_end_at_once(no_strays, tmp_path):
    # a child in the job's group and a grandchild: both gone when the time is up
    pids = tmp_path / "pids"
    done = sidejob.run(_py(f"""
        import os, subprocess, sys, time
        kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
        open({str(pids)!r}, "w").write(" ".join(str(k.pid) for k in kids))
        time.sleep(600)
    """), 3)
    assert done.timed_out and done.returncode is None and 2.5 < done.seconds < 20
    for pid in map(int, pids.read_text().split()):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_one_grace_policy_done_work_gets_sigterm_then_grace_decided_work_is_killed(no_strays, tmp_path):
    code = """
        import signal, sys, time
        def bye(*_):
            open(sys.argv[1], "w").write("cleaned up")
            sys.exit(0)
        signal.signal(signal.SIGTERM, bye)
        open(sys.argv[1] + ".ready", "w").close()
        time.sleep(600)
    """
    for now, expect in ((False, True), (True, False)):
        mark = tmp_path / f"now-{now}"
        job = sidejob.SideJob([*_py(code), str(mark)])
        deadline = time.monotonic() + 30
        while not Path(str(mark) + ".ready").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        job.end(now=now)
        assert mark.exists() is expect, f"end(now={now})"
        assert job.returncode == (0 if expect else -9)


def test_sweep_ends_a_daemon_that_left_the_tree_and_the_group(no_strays, tmp_path):
    pidfile = tmp_path / "daemon"
    daemon = f"""
        import os, time
        if os.fork():
            os._exit(0)
        os.setsid()
        if os.fork():
            os._exit(0)
        open({str(pidfile)!r}, "w").write(str(os.getpid()))
        time.sleep(600)
    """
    job = sidejob.SideJob(_py(daemon), sweep=True)
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline, "the daemon never started"
        time.sleep(0.05)
    pid = int(pidfile.read_text())
    assert psutil.Process(pid).ppid() != job.pid and psutil.Process(pid).pid not in job.pids()
    job.end()
    psutil.wait_procs([psutil.Process(pid)] if psutil.pid_exists(pid) else [], timeout=5)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_an_mpi_job_killed_mid_run_leaves_no_rank_and_no_shared_memory(no_strays):
    # no_strays fails the test if a rank or an MPICH /dev/shm segment is left
    program = _py("""
        from mpi4py import MPI
        import numpy as np, time
        a = np.ones(1 << 16)
        MPI.COMM_WORLD.Allreduce(MPI.IN_PLACE, a)
        print("reduced", MPI.COMM_WORLD.Get_rank(), flush=True)
        time.sleep(600)
    """)
    with sidejob.SideJob([*launchers.side_job_command(2), *program], env=sidejob.job_env(), timeout=60) as job:
        deadline = time.monotonic() + 60
        while job.output_text().count("reduced") < 2:
            assert job.running() and time.monotonic() < deadline, job.output_text()
            time.sleep(0.1)
        ranks = job.pids()
        assert len(ranks) >= 3  # mpiexec, (its proxy,) two ranks
        job.end(now=True)
        assert job.returncode == -9 and not [p for p in ranks if procs.pid_alive(p)]


def test_an_mpi_job_that_aborts_before_the_first_look_leaves_no_shared_memory(no_strays):
    """MPICH stopping on an assertion (a tuning file with no rule for a call) ends the ranks before
    MPI_Finalize, so their segment stays; made and left between two of the supervisor's looks at what the
    ranks map, it was left in /dev/shm. Ended with an error, the job's leftovers are found by their age."""
    program = _py("""
        import os
        from mpi4py import MPI
        MPI.COMM_WORLD.Barrier()
        os.abort()
    """)
    before = set(os.listdir(procs.SHM_DIR))
    done = sidejob.run([*launchers.side_job_command(2), *program], 60, env=sidejob.job_env())
    assert done.returncode != 0 and not done.timed_out, done
    assert not {f for f in os.listdir(procs.SHM_DIR) if f.startswith(procs.SEGMENT_PREFIXES)} - before


def test_side_jobs_end_with_the_process_that_started_them(no_strays, tmp_path):
    """A process killed with no chance to end its jobs (SIGKILL: a kernel restarted, the OOM killer)
    left them for good: a check's sandboxed learner job, its ranks waiting for a checker that was gone,
    ran on (seen 10 minutes on, in its sandbox); an MPI job started in its own session, likewise."""

    from hpdl.checker import sandbox

    starter = tmp_path / "starter.py"
    starter.write_text(textwrap.dedent("""
        import sys, time
        from hpdl import launchers, sidejob
        from hpdl.checker import sandbox
        program = [sys.executable, "-c", "from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); print('up', flush=True); "
                   "import time; time.sleep(600)"]
        jobs = [sidejob.SideJob([*launchers.side_job_command(2), *program], env=sidejob.job_env(), timeout=600),
                sidejob.SideJob(sandbox.wrap(["sleep", "600"]), timeout=600, shared_memory=False)]
        while jobs[0].output_text().count("up") < 2:
            time.sleep(0.1)
        print("started", flush=True)
        time.sleep(600)
    """))
    shm_before = {str(f) for f in Path(procs.SHM_DIR).glob("mpich_shm_*")}
    parent = subprocess.Popen([sys.executable, str(starter)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "started"
        deadline = time.monotonic() + 30
        tree = psutil.Process(parent.pid).children(recursive=True)
        while not any(p.name() == "sleep" for p in tree):
            assert time.monotonic() < deadline, [p.name() for p in tree]
            time.sleep(0.1)
            tree = psutil.Process(parent.pid).children(recursive=True)
        assert sum("Barrier" in " ".join(p.cmdline()) for p in tree) >= 2
        assert sandbox.bwrap() is None or any(p.name() == "bwrap" for p in tree)
        kill_then_nothing_left(parent, tree)
    finally:
        parent.kill()
        parent.wait()
    # the killed ranks' MPICH file: nobody was left to remove it; the next hpdl.start or hpdl cleanup does
    left = {str(f) for f in Path(procs.SHM_DIR).glob("mpich_shm_*")} - shm_before
    assert left <= procs.orphaned_shared_memory(min_age=0.0)
    procs.remove_shared_memory(left)


@pytest.mark.alone  # every emulated node on the machine is compared: another test's would count
@pytest.mark.parametrize("ended_by", ["its limit", "an interrupt"])
def test_a_lessons_job_ends_with_its_emulated_nodes_and_says_so(ended_by, no_strays):
    """hpdl.run_job, as lesson 06 runs a job on emulated nodes: at the limit the learner reads what
    happened (HpdlError, not subprocess's TimeoutExpired), and nothing is left, nor after the stop
    button (KeyboardInterrupt). subprocess.run's timeout killed the nodes' wrapper only: its ranks ran
    on in two network namespaces nobody removed."""
    import signal
    import threading

    from hpdl import emulated
    from hpdl.errors import HpdlError

    if os.geteuid() != 0 or emulated.missing():
        pytest.skip("the nodes' namespaces are listed as root only: " + (emulated.missing() or "not root"))
    before = set(emulated.leftovers())
    job = [sys.executable, "-m", "hpdl.emulated_job", "--nodes", "2", "-n", "2",
           *_py("print('started', flush=True); import time; time.sleep(600)")]
    if ended_by == "its limit":
        with pytest.raises(HpdlError, match=r"(?s)not finish within 8 s, so it was ended with every process.*started"):
            hpdl.run_job(job, timeout=8)
    else:
        stop = threading.Timer(6, os.kill, (os.getpid(), signal.SIGINT))
        stop.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                hpdl.run_job(job, timeout=120)
        finally:
            stop.cancel()  # a job that ended early must not leave a SIGINT for the next test
    assert set(emulated.leftovers()) == before  # no_strays: no rank, launcher or shared memory either


def test_a_lessons_job_gives_what_subprocess_run_would(no_strays):
    done = hpdl.run_job(_py("import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"), timeout=30)
    assert (done.returncode, done.stdout, done.stderr, done.timed_out) == (3, "out\n", "err\n", False)


def test_a_wall_clock_step_during_a_check_changes_no_verdict(no_strays, monkeypatch):
    """Deadlines that decide grades count on the monotonic clock: a wall clock that steps ahead
    mid-check (NTP, a resumed laptop) is no HANG and no 'ranks did not start'. Here it runs a
    thousand times fast, a step at every look."""
    real, t0 = time.time, time.time()
    monkeypatch.setattr(time, "time", lambda: t0 + (real() - t0) * 1000)
    result = hpdl.check("ring_allreduce", L.ring_ok, ranks=[2], timeout=5)
    assert all(c.verdict.earns_points for c in result.cases), result


def test_only_the_supervisor_starts_or_polls_side_jobs():
    """Processes are started in one place per kind: side jobs by hpdl/sidejob.py, the reaper by
    cluster/cleanup.py (a watchman, not a side job), engines by ipyparallel (cluster/lifecycle.py)."""
    allowed = {"sidejob.py": "side jobs", "cluster/cleanup.py": "the reaper",
               "launchers/__main__.py": "a rank's prologue, which becomes its engine (exec)",
               "checker/confine.py": "untrusted code's first process, which becomes the command (exec)",
               "forkserver.py": "a job's first process (a check's, the engines'), which forks the job's "
                                "ranks on request (inside the job's tree and sandbox) and starts its launcher",
               "checker/oracle.py": "a learner rank's helper holding the case's secrets, forked before the "
                                    "learner's code and ending with the rank (no command, no side job)",
               "checker/isolate.py": "a learner rank's first step: it forks the rank into a PID namespace of its "
                                     "own and stands in for it (no command, no side job)"}
    found = {}
    for path in PKG.rglob("*.py"):
        rel = path.relative_to(PKG).as_posix()
        text = path.read_text()
        if re.search(r"subprocess\.Popen\(|os\.(spawn|fork|exec)\w*\(", text) and rel not in allowed:
            found[rel] = "starts a process"
        if re.search(r"\.communicate\(|procs\.end\(|procs\.end_popen\(|procs\.end_group_now\(", text) \
                and rel not in ("sidejob.py", "reaper.py", "cluster/cleanup.py", "procs.py"):
            found[rel] = "ends a process itself"
    assert not found, f"start side jobs through hpdl.sidejob: {found}"
