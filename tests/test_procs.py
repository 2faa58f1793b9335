"""hpdl.procs: a recorded process is signalled only while it is still itself, trees end whole,
and MPI's shared-memory files are removed only from /dev/shm and only when ours."""
from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from hpdl import procs

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
PARENT = [sys.executable, "-c",
          "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
          " print('ready', flush=True); time.sleep(60)"]


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _children(pid: int, n: int, timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        kids = [c.pid for c in psutil.Process(pid).children()]
        if len(kids) >= n:
            return kids
        time.sleep(0.02)
    raise AssertionError(f"pid {pid} did not start {n} children")


@pytest.fixture
def sleeper():
    p = subprocess.Popen(SLEEPER)
    yield p
    p.kill()
    p.wait()


def test_a_record_names_the_running_process(sleeper):
    rec = procs.record(sleeper.pid)
    assert rec is not None and rec.pid == sleeper.pid
    assert procs.is_same(rec) and procs.is_alive(rec)
    assert procs.Proc.from_dict(rec.to_dict()) == rec
    sleeper.kill()
    sleeper.wait()
    assert not procs.is_alive(rec) and procs.record(sleeper.pid) is None


@pytest.mark.parametrize("field, value", [("start", -1), ("boot", "another-boot"), ("host", "another-host")])
def test_a_record_that_differs_is_never_signalled(sleeper, field, value):
    """A reused pid (other start time), a record from before a reboot or from another node."""
    stale = dataclasses.replace(procs.record(sleeper.pid), **{field: value})
    assert not procs.is_same(stale) and not procs.is_alive(stale)
    procs.end([stale], groups=[stale], grace=0.2)
    assert not procs.signal_process(stale, 9)
    assert sleeper.poll() is None and _running(sleeper.pid)
    procs.end([procs.record(sleeper.pid)], grace=2)  # the true record ends it
    assert sleeper.wait(timeout=10) is not None


def test_end_takes_the_whole_tree_and_its_group():
    root = subprocess.Popen(PARENT, stdout=subprocess.PIPE, start_new_session=True)
    assert root.stdout.readline().strip() == b"ready"
    child = _children(root.pid, 1)[0]
    rec = procs.record(root.pid)
    procs.end([rec], groups=[rec], grace=2)
    assert root.wait(timeout=10) is not None
    assert not _running(child)


def test_end_kills_what_ignores_sigterm():
    stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                 "signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    assert stubborn.stdout.readline().strip() == b"ready"
    procs.end([procs.record(stubborn.pid)], grace=0.3)
    assert not _running(stubborn.pid)  # (psutil reaped our child: Popen cannot see the -9)
    stubborn.wait(timeout=10)


def test_a_zombie_counts_as_ended_but_its_living_parent_does_not():
    """Stopping ranks waits for the tree to end; a child that has exited but whose parent has not
    yet read its status (an engine's nanny) must not hold that wait until the grace runs out."""
    parent = subprocess.Popen([sys.executable, "-c", "import os, time\nif os.fork() == 0:\n    os._exit(0)\n"
                               "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE)
    try:
        assert parent.stdout.readline().strip() == b"ready"
        zombie = psutil.Process(_children(parent.pid, 1)[0])
        deadline = time.monotonic() + 10
        while zombie.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.02)
        me = psutil.Process(parent.pid)
        assert procs._wait_gone([zombie], 0) == []
        assert procs._wait_gone([me, zombie], 0) == [me]
    finally:
        parent.kill()
        parent.wait()


def _holding(path: str) -> subprocess.Popen:
    """A process that creates `path` and keeps it mapped, as an MPI rank keeps its segment."""
    holder = subprocess.Popen([sys.executable, "-c", f"import mmap, os, time\nfd = os.open({path!r}, os.O_CREAT | "
                               "os.O_RDWR, 0o600)\nos.ftruncate(fd, 4096)\nm = mmap.mmap(fd, 4096)\n"
                               "print('ready', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE)
    assert holder.stdout.readline().strip() == b"ready"
    return holder


def test_shared_memory_is_found_through_maps_and_removed_only_in_dev_shm(tmp_path):
    name = f"/dev/shm/mpich_shm_hpdltest_{uuid.uuid4().hex[:8]}"
    holder = _holding(name)
    try:
        segments = procs.end([procs.record(holder.pid)], grace=1)
        assert segments == {name}
        assert os.path.exists(name)  # a killed MPI rank leaves its segment behind ...
        outside = tmp_path / "mpich_shm_not_in_dev_shm"
        outside.write_text("x")
        assert procs.remove_shared_memory(segments | {str(outside)}) == [name]  # ... removed here
        assert not os.path.exists(name) and outside.exists()
    finally:
        holder.kill()
        holder.wait()
        if os.path.exists(name):
            os.unlink(name)


def test_end_popen_reaps_a_child_that_will_not_exit(sleeper):
    assert procs.end_popen(sleeper, grace=0.1) == -9


def test_hpdl_cleanup_ends_an_orphaned_cluster_but_never_a_stale_record(tmp_path, monkeypatch, sleeper):
    """`hpdl cleanup`: the kernel is gone, so its recorded process ends; a record whose pid now
    runs another process (start time differs) survives; another host's cluster is not touched.
    A run folder with no state file (its kernel and reaper both killed) goes once it is old; a
    young one, perhaps a start under way, stays."""
    from hpdl import reaper
    from hpdl.cluster import cleanup

    monkeypatch.setenv("HPDL_HOME", str(tmp_path))
    kernel = subprocess.Popen(SLEEPER)
    gone_kernel = procs.record(kernel.pid)
    kernel.kill()
    kernel.wait()
    ours = subprocess.Popen(SLEEPER)
    reused = dataclasses.replace(procs.record(sleeper.pid), start=-1)
    here, elsewhere = tmp_path / "runs" / "hpdl-here", tmp_path / "runs" / "hpdl-elsewhere"
    here.mkdir(parents=True)
    elsewhere.mkdir(parents=True)
    reaper.write_state(here / "reaper.json", gone_kernel, [procs.record(ours.pid), reused], [reused], [], [])
    other_host = dataclasses.replace(gone_kernel, host="another-node")
    reaper.write_state(elsewhere / "reaper.json", other_host, [procs.record(sleeper.pid)], [], [], [])
    stale, starting = tmp_path / "runs" / "hpdl-stale", tmp_path / "runs" / "hpdl-starting"
    for folder in (stale, starting):
        (folder / "nodes").mkdir(parents=True)
    os.utime(stale, (time.time() - 3600,) * 2)
    try:
        assert cleanup.main([]) == 0
        assert not _running(ours.pid) and not here.exists()
        assert not stale.exists() and starting.exists() and elsewhere.exists()
        assert cleanup.main(["--all"]) == 0  # not even --all reaches into another node's cluster
        assert sleeper.poll() is None and _running(sleeper.pid) and elsewhere.exists()
    finally:
        ours.kill()
        ours.wait()


def test_a_killed_kernels_mpi_shared_memory_is_swept_and_a_live_ones_is_kept(tmp_path, monkeypatch):
    """A kernel that imported mpi4py.MPI (lesson 03's exercises do) holds MPICH's segment
    /dev/shm/mpich_shm_<pid>_0; a restart that kills it leaves the file in RAM. `hpdl cleanup`
    (and every hpdl.start) removes it once nothing maps it, never while its process lives."""
    monkeypatch.setenv("HPDL_HOME", str(tmp_path))
    code = ("from mpi4py import MPI\nimport os, sys, time\nprint('ready', flush=True)\n"
            "sys.stdin.readline()\nos._exit(0)")  # a real MPI start; exits as a kill would: no Finalize
    kernels = [subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
               for _ in range(2)]
    try:
        for k in kernels:
            assert k.stdout.readline().strip() == b"ready"
        killed, alive = ({f"/dev/shm/mpich_shm_{k.pid:x}_0"} for k in kernels)
        assert procs.shared_memory_of([k.pid for k in kernels]) == killed | alive
        kernels[0].kill()
        kernels[0].wait()
        assert all(os.path.exists(s) for s in killed | alive)  # nothing removed the dead one's file
        assert not procs.orphaned_shared_memory(min_age=3600)  # too young to judge
        assert procs.orphaned_shared_memory(min_age=0) >= killed
        assert not procs.orphaned_shared_memory(min_age=0) & alive
        old = time.time() - 120
        for s in killed | alive:
            os.utime(s, (old, old))
        out = subprocess.run([sys.executable, "-m", "hpdl.cli", "cleanup"], capture_output=True, text=True, timeout=60)
        assert "removed 1 MPI shared-memory file" in out.stdout, out.stdout + out.stderr
        assert not any(os.path.exists(s) for s in killed) and all(os.path.exists(s) for s in alive)
    finally:
        for k in kernels:
            k.kill()
            k.wait()
        for s in (f"/dev/shm/mpich_shm_{k.pid:x}_0" for k in kernels):
            if os.path.exists(s):
                os.unlink(s)


def test_open_mpis_segments_are_swept_too_and_only_when_nothing_maps_them():
    """Open MPI 5 leaves a process that started MPI by itself its sm_segment.* file in RAM even
    after a clean exit; the sweep takes those too, and never one still mapped."""
    tag = uuid.uuid4().hex[:8]
    left, held = f"/dev/shm/sm_segment.hpdltest.{tag}.0", f"/dev/shm/sm_segment.hpdltest.{tag}.1"
    holder = _holding(held)
    try:
        with open(left, "wb") as f:
            f.write(b"\0" * 4096)
        old = time.time() - 120
        for s in (left, held):
            os.utime(s, (old, old))
        found = procs.orphaned_shared_memory()
        assert left in found and held not in found
        assert left in procs.remove_orphaned_shared_memory() and not os.path.exists(left) and os.path.exists(held)
    finally:
        holder.kill()
        holder.wait()
        for s in (left, held):
            if os.path.exists(s):
                os.unlink(s)


# A kernel that started MPI by itself, then dies in its interpreter's teardown (after the atexit
# handlers, before mpi4py's own finalize), as a kernel does when libzmq aborts at exit.
DIES_IN_TEARDOWN = """
from mpi4py import MPI
import os, sys
{hpdl}
class _DiesInTeardown:
    def __del__(self, _exit=os._exit):  # bound now: the kernel clears its namespace on the way out
        _exit(0)
sys.modules["_dies_in_teardown"] = _DiesInTeardown()
print(f"/dev/shm/mpich_shm_{{os.getpid():x}}_0")
"""


def _kernel_segment(code: str) -> str:
    """Run `code` in a real Jupyter kernel, shut it down politely; the segment path it printed."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3")
    printed = []
    try:
        kc.execute_interactive(code, timeout=60, output_hook=lambda m: printed.append(m["content"].get("text", "")))
        path = "".join(printed).strip().splitlines()[-1]
        assert os.path.exists(path), f"MPI did not start a singleton segment: {printed}"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=False)
    return path


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_a_kernel_with_hpdl_frees_its_mpi_segment_even_when_it_dies_in_teardown(no_strays):
    leaked = _kernel_segment(DIES_IN_TEARDOWN.format(hpdl=""))  # the premise: without hpdl it leaks
    try:
        assert os.path.exists(leaked), "a kernel dying in teardown no longer leaks: this test proves nothing"
    finally:
        procs.remove_shared_memory([leaked])
    kept = _kernel_segment(DIES_IN_TEARDOWN.format(hpdl="import hpdl"))
    assert not os.path.exists(kept), "hpdl did not finalize the kernel's MPI before its teardown"


# Ranks that made communicators after start-up (as Horovod and the lessons' Split do), then leave
# as hpdl.stop has them leave: each job's status and every segment it made.
LEAVING = """
from mpi4py import MPI
from hpdl import rank
world = MPI.COMM_WORLD
dup, half = world.Dup(), world.Split(world.rank % 2)
dup.Barrier(); half.Barrier(); world.Barrier()
rank.leave()
"""


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm")
def test_ranks_that_leave_end_their_job_cleanly_and_free_its_shared_memory(no_strays):
    """rank.leave ended with os._exit: MPICH's launcher killed the job when the first rank was gone
    (it says so from a C atexit handler), ranks still in MPI_Finalize with it (7 jobs in 12 here,
    each leaving a segment; one did in CI after lesson 06's stop). Three jobs: each must end 0."""
    from conftest import mpi_shared_memory

    from hpdl import launchers

    before = mpi_shared_memory()
    for _ in range(3):
        job = subprocess.run([*launchers.mpiexec_command(4), sys.executable, "-c", LEAVING],
                             capture_output=True, text=True, timeout=120)
        assert job.returncode == 0, f"a job whose ranks left ended {job.returncode}:\n{job.stderr[-2000:]}"
    left = sorted(map(str, mpi_shared_memory() - before))
    procs.remove_shared_memory(left)
    assert not left, f"segments left by ranks that left: {left}"
