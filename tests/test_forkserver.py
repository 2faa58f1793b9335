"""A check job's ranks forked from one server that imported torch once (hpdl.forkserver).

Real jobs: this Python's mpiexec starts the ranks' stand-ins, each rank is a fork of the server,
and they must still be MPI ranks in every way that matters — wired by the launcher (an all-reduce
agrees), each with its own arguments, folder and entropy, exit codes and signals passed both
ways, nothing left when a stand-in dies. The checks that use it (every torch exercise) run
through it in the other tests; test_check_api compares a check with and without it."""
from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from hpdl import forkserver, launchers, settings, sidejob
from hpdl.checker import runner
from conftest import kill_then_nothing_left

FIXTURES = Path(__file__).parent / "fixtures"
pytestmark = pytest.mark.timeout(180)


def _env(**extra: str) -> dict[str, str]:
    return launchers.local_job_env({**os.environ, "PYTHONPATH": str(FIXTURES), "OMP_NUM_THREADS": "1", **extra})


def _mpi_job(tmp_path: Path, n: int, server: bool = True, **extra: str):
    serve, rank = forkserver.commands(str(tmp_path), ["preloaded_marker"], "forked_rank", "arg 1")
    cmd = [*(serve if server else []), *launchers.local_job_command(n), *rank]  # no server: nothing listens
    done = sidejob.run(cmd, 120, env=_env(**extra), cwd=tmp_path)
    lines = sorted((json.loads(line) for line in done.output.splitlines() if line.startswith("{")),
                   key=lambda line: line["rank"])
    return done, lines


def test_forked_ranks_are_mpi_ranks_each_with_its_own_arguments_folder_and_entropy(tmp_path, no_strays):
    done, ranks = _mpi_job(tmp_path, 3)
    assert done.returncode == 0, done.output
    assert [(r["rank"], r["size"], r["total"]) for r in ranks] == [(0, 3, 6), (1, 3, 6), (2, 3, 6)], done.output
    servers = {r["ppid"] for r in ranks}
    assert len(servers) == 1 and len({r["pid"] for r in ranks}) == 3  # three forks of one process...
    assert all(r["imported_by"] == r["ppid"] != r["pid"] for r in ranks)  # ...which imported for them
    assert len({r["draw"] for r in ranks}) == 3  # numpy reseeded in each, as three fresh processes
    assert all(r["argv"] == ["arg 1"] and r["cwd"] == str(tmp_path) for r in ranks)


def test_a_rank_exit_code_reaches_the_launcher(tmp_path, no_strays):
    done, ranks = _mpi_job(tmp_path, 2, FORKED_RANK_EXIT="1:3")
    assert [r["total"] for r in ranks] == [3, 3], done.output
    assert done.returncode not in (0, None), done.output


def test_without_its_server_a_rank_runs_by_itself(tmp_path, no_strays):
    done, ranks = _mpi_job(tmp_path, 2, server=False)
    assert done.returncode == 0 and [r["total"] for r in ranks] == [3, 3], done.output
    assert all(r["imported_by"] == r["pid"] for r in ranks)


def test_a_killed_stand_in_takes_its_rank_along_and_signals_pass_on(tmp_path, no_strays):
    """Two stand-ins under a shell: SIGKILL one (it cannot pass that on: the server sees its
    connection close and kills its rank), SIGTERM the other (passed on: the rank dies of it, and
    its stand-in exits as the rank did, 128 + 15)."""
    serve, a, b = _sleepers(tmp_path, "a", "b")
    shell = f"{a} & A=$!; {b} & B=$!; wait $A; echo a=$?; wait $B; echo b=$?"
    with sidejob.SideJob([*serve, "sh", "-c", shell],
                         env=_env(), timeout=60) as job:
        ranks = _wait_for(lambda: _lines(job, "name"), 2, job)
        stand_ins = {p.cmdline()[-1]: p for p in psutil.Process(job.pid).children(recursive=True)
                     if p.cmdline()[-2:-1] == ["forked_sleeper"]}
        stand_ins["a"].kill()
        _wait_for(lambda: [] if psutil.pid_exists(ranks["a"]["pid"]) else [1], 1, job)
        assert psutil.pid_exists(ranks["b"]["pid"]) and ranks["b"]["ppid"] == job.pid
        stand_ins["b"].terminate()
        assert job.wait(30) == 0, job.output_text()
    assert "a=137" in job.output_text() and "b=143" in job.output_text()
    assert not psutil.pid_exists(ranks["b"]["pid"])


def test_a_killed_server_leaves_no_rank_behind(tmp_path, no_strays):
    """SIGKILL the server itself (nothing of it runs then): its ranks die with it, and the stand-in,
    which hears no status, exits with 70 instead of waiting."""
    serve, stand_in = _sleepers(tmp_path, "a")
    with sidejob.SideJob([*serve, "sh", "-c", f"{stand_in}; echo stand-in=$?"], env=_env(), timeout=60) as job:
        rank = _wait_for(lambda: _lines(job, "name"), 1, job)["a"]
        psutil.Process(job.pid).kill()
        deadline = time.monotonic() + 10
        while psutil.pid_exists(rank["pid"]) and psutil.Process(rank["pid"]).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline, "the rank outlived its server"
            time.sleep(0.05)
        while "stand-in=" not in job.output_text():
            assert time.monotonic() < deadline + 10, job.output_text()
            time.sleep(0.05)
    assert "stand-in=70" in job.output_text()


def test_a_process_in_another_mount_namespace_gets_no_rank_forked(tmp_path, no_strays):
    """The server forks only for processes in its own mount namespace: one in a sandbox (another mount
    namespace) that reached its socket would otherwise have a rank run outside the sandbox. Same uid,
    same socket, same request: beside the server, a fork; from another namespace, refused."""
    import shutil

    if os.geteuid() == 0 and shutil.which("unshare"):
        apart = ["unshare", "--mount", "--propagation", "unchanged"]
    elif shutil.which("bwrap"):
        apart = ["bwrap", "--bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    else:
        pytest.skip("needs unshare (as root) or bwrap to start a process in another mount namespace")
    sock = str(tmp_path / "fork.sock")
    server = forkserver.serve_command(sock, ["preloaded_marker"], forkserver.until_gone(os.getpid()))
    with sidejob.SideJob(server, env=_env(), timeout=60) as job:
        _wait_for(lambda: [sock] if os.path.exists(sock) else [], 1, job)
        rank = forkserver.rank_command(sock, "forked_says", "beside")
        beside = sidejob.run(rank, 60, env=_env(), cwd=tmp_path)
        away = sidejob.run([*apart, *forkserver.rank_command(sock, "forked_says", "apart")], 60, env=_env(),
                           cwd=tmp_path)
    said = json.loads(beside.output.strip().splitlines()[-1])
    assert beside.returncode == 0 and said["ppid"] == said["imported_by"] == job.pid, beside.output
    assert away.returncode != 0 and f"the server at {sock} did not start forked_says" in away.output, away.output
    assert '"argv": ["apart"]' not in away.output


def _sleepers(folder: Path, *names: str) -> list:
    """The server's command, then one stand-in's shell line per name (a rank that waits, no MPI)."""
    found = [forkserver.commands(str(folder), ["preloaded_marker"], "forked_sleeper", name) for name in names]
    return [found[0][0], *(shlex.join(rank) for _, rank in found)]


def _lines(job: sidejob.SideJob, key: str) -> dict:
    """The JSON objects the ranks printed, by `key`. Two ranks share one stream: their lines can run into
    one another ('{...}{...}'), so every object is read where it starts."""
    text, decoder, found = job.output_text(), json.JSONDecoder(), []
    at = text.find("{")
    while at >= 0:
        try:
            obj, end = decoder.raw_decode(text, at)
        except json.JSONDecodeError:  # not (yet) a whole object here
            end = at + 1
        else:
            if isinstance(obj, dict) and key in obj:
                found.append(obj)
        at = text.find("{", end)
    return {line[key]: line for line in found}


def _wait_for(get, count: int, job: sidejob.SideJob):
    deadline = time.monotonic() + 30
    while len(got := get()) < count:
        assert time.monotonic() < deadline and job.running(), job.output_text()
        time.sleep(0.05)
    return got


def test_a_check_job_goes_through_the_server_only_where_it_pays(tmp_path, monkeypatch):
    """torch to preload and a local mpiexec: the server; nothing to preload, the setting off, or a
    job folder too deep for a Unix socket's path: not."""
    env = dict(os.environ)
    sock = str(tmp_path / "fork.sock")
    served = runner.job_launch(2, "hpdl.checker.reference_job", str(tmp_path), env, preload=["torch"]).cmd
    assert served[1:5] == ["-m", "hpdl.forkserver", "serve", sock]
    assert served[-4:] == ["run", sock, "hpdl.checker.reference_job", str(tmp_path)]
    deep = str(tmp_path / ("d" * 100))
    assert "hpdl.forkserver" not in runner.job_launch(2, "hpdl.checker.reference_job", deep, env, preload=["torch"]).cmd
    plain = runner.job_launch(2, "hpdl.checker.reference_job", str(tmp_path), env).cmd
    assert "hpdl.forkserver" not in plain and plain[-3:] == ["-m", "hpdl.checker.reference_job", str(tmp_path)]
    monkeypatch.setenv(settings.FORKSERVER.name, "0")
    off = runner.job_launch(2, "hpdl.checker.reference_job", str(tmp_path), env, preload=["torch"]).cmd
    assert "hpdl.forkserver" not in off and off[-3:] == plain[-3:]


def test_a_check_preloads_what_its_ranks_import_and_what_their_first_optimizer_does():
    """torch where the case module or the learner's code imports it; torch._dynamo besides where either
    builds an optimizer (torch imports it then: ~1.5 s of CPU in each rank); nothing for MPI-only code.
    The reference job preloads what the case module needs only; the learner's job also what the
    learner's function uses through a global another cell imported (shard_indices' torch.randperm)."""
    from hpdl.checker import cases, checking, source

    def learner(source: str) -> dict:
        return {"sources": [{"source": source}]}

    def both(modules: list[str]) -> dict:
        return {"reference": modules, "learner": modules}

    torch, adam = ["torch"], ["torch", *forkserver.OPTIMIZER_IMPORTS]
    assert checking._preload(cases.load("train_step"), {}) == both(adam)
    assert checking._preload(cases.load("resume_horovod"), {}) == both(adam)
    assert checking._preload(cases.load("allreduce_gradients"), {}) == both(torch)
    with_adam = learner("import torch\nopt = torch.optim.Adam(model.parameters())")
    assert checking._preload(cases.load("allreduce_gradients"), with_adam) == {"reference": torch, "learner": adam}
    assert checking._preload(cases.load("ps_exchange"), learner("import numpy as np")) == both([])
    assert checking._preload(cases.load("ps_exchange"), with_adam) == {"reference": [], "learner": adam}
    # torch imported in an earlier cell: the function's source names it, its pickle carries it
    space: dict = {}
    exec("import torch\ndef shard(n, seed):\n    return torch.randperm(n, generator=torch.Generator()"
         ".manual_seed(seed)).tolist()", space)
    packed = source.package(space["shard"])
    assert checking._preload(cases.load("ps_exchange"), packed) == {"reference": [], "learner": torch}
    unsourced = {**packed, "sources": []}
    assert checking._preload(cases.load("ps_exchange"), unsourced) == {"reference": [], "learner": torch}


def test_a_checks_reference_ranks_at_every_rank_count_are_forks_of_one_server(no_strays):
    """The reference job at each rank count runs outside the sandbox: one server per check imports torch
    for all of them (a check of a torch exercise at 1-4 ranks imported it in 4 reference servers); each
    learner job keeps its own server, inside its own sandbox. Seen from outside while a real check runs:
    the servers listening beside the jobs' folders (the shared one) and inside one (a job's own), and
    whose forks the reference ranks are."""
    import threading

    import hpdl

    def allreduce_gradients(comm, model):  # wrong (nothing averaged): the reference ranks run all the same
        return None

    seen: dict[str, set[int]] = {"shared": set(), "reference ranks": set(), "own servers of": set()}
    caps: dict[int, tuple | None] = {}  # rank -> (its address space limit, its cgroups)
    done = threading.Event()

    me = psutil.Process()

    def watch() -> None:
        while not done.is_set():
            for proc in me.children(recursive=True):  # this check's, not another's on the machine
                try:
                    cmd, ppid = proc.cmdline(), proc.ppid()
                except psutil.Error:
                    continue
                if cmd[1:4] != ["-m", "hpdl.forkserver", "serve"]:
                    continue
                folder = os.path.basename(os.path.dirname(cmd[4]))
                is_fork = " ".join(psutil.Process(ppid).cmdline()[1:4]) == "-m hpdl.forkserver serve" \
                    if ppid else False
                if is_fork:  # a rank: the reference's, or a learner job's (its own server's fork)
                    cap = _caps(proc)  # the deepest cgroup it was seen in: leaving, it may be moved up
                    if cap is not None and _depth(cap) >= _depth(caps.get(proc.pid)):
                        caps[proc.pid] = cap
                if not folder.startswith(("r", "l")) or "-" not in folder:  # the check's own folder
                    seen["reference ranks" if is_fork else "shared"].add(proc.pid)
                elif not is_fork:
                    seen["own servers of"].add(folder[0])
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        result = hpdl.check("allreduce_gradients", allreduce_gradients, ranks=[2, 3])
    finally:
        done.set()
        watcher.join()
    assert not result.passed and {c.ranks for c in result.cases} == {2, 3}, result
    assert len(seen["shared"]) == 1, seen
    assert len(seen["reference ranks"]) == 2 + 3, seen  # every reference rank of both jobs: its fork
    assert seen["own servers of"] <= {"l"}, seen  # no reference job starts a server of its own
    # the reference ranks read what the learner's returned: capped as a learner's job is (a hand-written
    # pickle once had each of them make a 3 GiB bytearray, outside every cap); and every job of the check
    # is inside one cgroup whose memory cap holds for them all (4 learner jobs of 8 GiB each once held
    # more than the host had)
    from hpdl.checker import sandbox

    caps = {pid: cap for pid, cap in caps.items() if cap is not None}
    assert len(caps) > 2 + 3 and all(space != psutil.RLIM_INFINITY for space, _ in caps.values()), caps
    probe = sandbox.Limits().start()
    probe.stop()
    if probe.cgroup is not None:  # where this process can make cgroups (root, or one delegated)
        ours = [[part for part in group.split("/") if part.startswith(sandbox.CGROUP_PREFIX)]
                for _, group in caps.values()]
        # a job's cgroup inside the check's (and a metered learner rank's memory in one of its own inside its job's)
        assert all(len(parts) in (2, 3) for parts in ours), caps
        assert len({parts[0] for parts in ours}) == 1 and len({parts[1] for parts in ours}) >= 3, caps
        assert not any(os.path.exists(os.path.join(cgroup, ours[0][0])) for cgroup in sandbox._cgroup_parents())


def _depth(cap: tuple[int, str] | None) -> int:
    """How many of the kit's cgroups a reading of _caps() is nested in (-1: no reading)."""
    from hpdl.checker import sandbox

    return -1 if cap is None else sum(part.startswith(sandbox.CGROUP_PREFIX) for part in cap[1].split("/"))


def _caps(proc: psutil.Process) -> tuple[int, str] | None:
    """A process's address space limit and its memory cgroup (v1; v2: its one cgroup); None when it ended
    before they were read."""
    try:
        with open(f"/proc/{proc.pid}/cgroup") as f:
            lines = [line.strip().split(":", 2) for line in f]
        group = next((path for _, ctl, path in lines if "memory" in ctl.split(",")), None)
        group = group if group is not None else next(path for _, ctl, path in lines if ctl == "")
        return proc.rlimit(psutil.RLIMIT_AS)[0], group
    except (OSError, StopIteration, psutil.Error):
        return None


def _serves(proc: psutil.Process) -> bool:
    """A fork server, of the processes a check starts (one may have ended meanwhile)."""
    try:
        return proc.cmdline()[1:4] == ["-m", "hpdl.forkserver", "serve"]
    except psutil.Error:
        return False


def test_a_check_killed_leaves_no_shared_server_behind(tmp_path, no_strays):
    """The reference jobs' shared server ends with the process that started it: a kernel killed mid-check
    (SIGKILL, or SIGTERM with Python's default handler: no finally runs) left the server, and torch in it,
    running for good. So do the learner's jobs: killed while their ranks ran, their sandbox (or their
    mpiexec) stayed, its ranks waiting for a client that was gone, for good."""

    script = tmp_path / "client.py"
    script.write_text("import time\nimport hpdl\n\n\ndef allreduce_gradients(comm, model):\n    time.sleep(60)\n\n\n"
                      "hpdl.check('allreduce_gradients', allreduce_gradients, ranks=[2, 3], timeout=120)\n")
    client = subprocess.Popen([sys.executable, str(script)])
    try:
        tree: list = []
        deadline = time.time() + 90
        while time.time() < deadline and not (any(_serves(p) for p in tree) and any(_learner_rank(p) for p in tree)):
            tree = psutil.Process(client.pid).children(recursive=True)
            time.sleep(0.2)
        assert any(_serves(p) for p in tree), "no shared fork server started"
        assert any(_learner_rank(p) for p in tree), "no learner rank started"
        kill_then_nothing_left(client, tree)
    finally:
        client.kill()
        client.wait()


def _learner_rank(proc: psutil.Process) -> bool:
    """A learner job's rank (a fork of its own server, running hpdl.checker.learner_job)."""
    try:
        cmd = proc.cmdline()
        return cmd[1:4] == ["-m", "hpdl.forkserver", "serve"] and "learner_job" in " ".join(cmd) \
            and psutil.Process(proc.ppid()).cmdline()[1:4] == cmd[1:4]
    except (psutil.Error, IndexError):
        return False


def test_ranks_a_server_ends_leave_no_shared_memory(tmp_path, no_strays):
    """A server whose job ends (its owner gone: a check's client killed) kills the ranks it still has.
    A rank killed inside MPI_Init, between making MPICH's /dev/shm file and the removal once all ranks
    have mapped it, left the file in RAM (a full run's no_strays found one after a killed check)."""
    owner = subprocess.Popen(["sleep", "600"])
    sock = str(tmp_path / "fork.sock")
    server = forkserver.serve_command(sock, ["preloaded_marker"], forkserver.until_gone(owner.pid))
    try:
        with sidejob.SideJob(server, env=_env(), timeout=60, shared_memory=False) as job:
            _wait_for(lambda: [sock] if os.path.exists(sock) else [], 1, job)
            rank = sidejob.SideJob(forkserver.rank_command(sock, "forked_sleeper", "r0", "segment"), env=_env(),
                                   timeout=60, shared_memory=False)
            with rank:
                said = _wait_for(lambda: _lines(rank, "name"), 1, rank)["r0"]
                assert os.path.exists(said["segment"])
                owner.kill()
                owner.wait()
                deadline = time.monotonic() + 20
                while job.running() and time.monotonic() < deadline:
                    time.sleep(0.1)
                assert not job.running() and not psutil.pid_exists(said["pid"]), job.output_text()
    finally:
        owner.kill()
        owner.wait()
    assert not os.path.exists(said["segment"]), "left in /dev/shm by a rank its server killed"


def test_a_server_told_to_end_with_no_rank_left_ends_as_its_job_did(tmp_path, no_strays):
    """SIGTERM goes to the job; the job gone and no rank to end, the server exits with its code, plainly."""
    import signal

    sock = str(tmp_path / "fork.sock")
    with sidejob.SideJob(forkserver.serve_command(sock, [], ["sleep", "600"]), env=_env(), timeout=60) as job:
        _wait_for(lambda: [sock] if os.path.exists(sock) else [], 1, job)
        os.kill(job.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while job.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not job.running()
    assert job.returncode == 128 + signal.SIGTERM and "Traceback" not in job.output_text(), job.output_text()


def test_help_and_a_missing_command_are_said_plainly():
    cli = [sys.executable, "-m", "hpdl.forkserver", "serve"]
    shown = subprocess.run([*cli, "--help"], capture_output=True, text=True)
    assert shown.returncode == 0 and "--preload" in shown.stdout
    bad = subprocess.run([*cli, "/tmp/x.sock"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no job command" in bad.stderr and "Traceback" not in bad.stderr
