"""The Slurm launcher on a real Slurm: engines are ranks of one Slurm job, collectives work across
them, and stopping (or a killed kernel) leaves no job and no process behind.

A private single-node Slurm is started by cluster/slurm/local-slurm.sh (installing Debian's
slurm-wlm and munge when missing, as root). Where that is impossible the script says why and
these tests skip with its words. Site-profile tests at the end need no Slurm.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest
from IPython.utils.text import EvalFormatter

import hpdl
from hpdl import launchers, sites
from hpdl.errors import HpdlError
from hpdl.launchers import slurm as slurm_launcher

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "cluster" / "slurm" / "local-slurm.sh"
UNAVAILABLE = 3  # local-slurm.sh's exit code for "Slurm cannot run here"
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NTASKS", "SLURM_STEP_ID", "HPDL_SITE", "HPDL_LAUNCHER")


def _local_slurm(verb: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), verb], capture_output=True, text=True,
                          stdin=subprocess.DEVNULL, timeout=timeout)


@pytest.fixture(scope="session")
def slurm():
    """A running single-node Slurm; stopped at the end if this session started it."""
    was_running = _local_slurm("status", 60).returncode == 0
    if not was_running:
        p = _local_slurm("start", 900)
        if p.returncode == UNAVAILABLE:
            pytest.skip(p.stderr.strip().splitlines()[-1] if p.stderr.strip() else "Slurm unavailable")
        assert p.returncode == 0, f"local-slurm.sh start failed:\n{p.stdout}{p.stderr}"
    yield
    if not was_running:
        p = _local_slurm("stop", 120)
        assert p.returncode == 0, p.stderr


@pytest.fixture
def outside_slurm(monkeypatch):
    """The kernel on a 'login node': no allocation in the environment, no site profile."""
    for var in SLURM_VARS:
        monkeypatch.delenv(var, raising=False)
    for var in list(os.environ):
        if var.startswith("HPDL_SLURM_"):
            monkeypatch.delenv(var)


def squeue(*args: str) -> str:
    return subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, timeout=30).stdout.strip()


def wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise AssertionError(f"{what} within {timeout:.0f} s")


def security_modes(home: Path) -> dict[str, int]:
    sec = home / "profile" / "security"
    modes = {"security/": stat.S_IMODE(sec.stat().st_mode)}
    for f in sec.iterdir():
        modes[f.name] = stat.S_IMODE(f.stat().st_mode)
    return modes


RANK_REPORT = textwrap.dedent(
    """
    import os
    import numpy as np
    from mpi4py import MPI
    x = np.array([rank + 1.0, 10.0 * rank])
    comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    report = dict(rank=comm.Get_rank(), size=comm.Get_size(), allreduce=x.tolist(),
                  job=os.environ.get("SLURM_JOB_ID"), step=os.environ.get("SLURM_STEP_ID"),
                  procid=os.environ.get("SLURM_PROCID"))
    """
)


def controller_listening(c) -> set[str]:
    """Addresses the controller's processes accept connections on."""
    proc = psutil.Process(c.ipp.controller.pid)
    found = set()
    for p in [proc, *proc.children(recursive=True)]:
        for conn in p.net_connections(kind="tcp"):
            if conn.status == psutil.CONN_LISTEN:
                found.add(conn.laddr.ip)
    assert found, "the controller listens nowhere?"
    return found


def rank_reports() -> list[dict]:
    view = hpdl.view()
    view.execute(RANK_REPORT, block=True)
    return sorted(view.pull("report", block=True), key=lambda r: r["rank"])


SITE = """
description = "a test site: its set-up lines and variables must reach the ranks"
setup = '''
export HPDL_T_SETUP="ran${HPDL_T_UNSET:-}"
'''
[slurm]
time = "00:10:00"
[env]
HPDL_T_SITE = "from site"
HPDL_T_BOTH = "site"
"""


@pytest.mark.slurm
def test_submitted_job_ranks_allreduce_and_stop_leaves_nothing(slurm, outside_slurm, monkeypatch, tmp_path, no_strays):
    (tmp_path / "site.toml").write_text(SITE)
    monkeypatch.setenv("HPDL_SITE", str(tmp_path / "site.toml"))
    c = hpdl.start(n=2, launcher="slurm", frameworks=("torch",), env={"HPDL_T_BOTH": "learner"}, quiet=True)
    try:
        view = hpdl.view()
        view.execute("import os; seen = [os.environ.get(k) for k in ('HPDL_T_SETUP', 'HPDL_T_SITE', 'HPDL_T_BOTH')]",
                     block=True)
        assert view.pull("seen", block=True) == [["ran", "from site", "learner"]] * 2
        reports = rank_reports()
        assert [r["rank"] for r in reports] == [0, 1]
        assert [r["procid"] for r in reports] == ["0", "1"]  # MPI rank = Slurm task id
        assert {r["size"] for r in reports} == {2}
        assert [r["allreduce"] for r in reports] == [[3.0, 10.0], [3.0, 10.0]]
        jobs = {r["job"] for r in reports}
        assert len(jobs) == 1 and None not in jobs, f"engines are not one Slurm job: {jobs}"
        job = jobs.pop()
        assert squeue("-j", job, "-o", "%T") == "RUNNING"
        assert squeue("-j", job, "-o", "%j") == c.ipp.cluster_id
        # torch.distributed (gloo) across the same ranks
        view = hpdl.view()
        view.execute("t = torch.tensor([float(rank + 1)]); dist.all_reduce(t); tsum = t.item()", block=True)
        assert view.pull("tsum", block=True) == [3.0, 3.0]
        # the reaper knows the job, so a killed kernel cancels it
        assert json.loads(c.state_file.read_text())["jobs"] == [job]
        # connection files: only the user may read them
        modes = security_modes(Path(os.environ["HPDL_HOME"]))
        assert modes.pop("security/") == 0o700
        assert modes and set(modes.values()) == {0o600}, modes
        # the controller listens on the one address the engines are told, not on every interface
        chosen = slurm_launcher.controller_address(sites.load_site())
        assert controller_listening(c) == {chosen}
    finally:
        hpdl.stop(quiet=True)
    assert squeue("-j", job, "-o", "%i") == ""
    assert hpdl.status() == {"running": False}


@pytest.mark.slurm
def test_inside_an_allocation_engines_are_one_srun_step(slurm, outside_slurm, monkeypatch, no_strays):
    alloc = subprocess.run(["salloc", "--no-shell", "-n", "2", "-J", "hpdl-test-alloc"],
                           capture_output=True, text=True, timeout=60)
    m = re.search(r"Granted job allocation (\d+)", alloc.stderr + alloc.stdout)
    assert m, alloc.stderr
    job = m.group(1)
    try:
        monkeypatch.setenv("SLURM_JOB_ID", job)
        monkeypatch.setenv("SLURM_NTASKS", "2")
        assert launchers.resolve("auto") == "slurm"
        with pytest.raises(HpdlError, match=r"has 2 tasks, fewer than n=3"):
            hpdl.start(n=3, frameworks=(), quiet=True)
        c = hpdl.start(frameworks=(), quiet=True)  # n from SLURM_NTASKS
        try:
            reports = rank_reports()
            assert [r["rank"] for r in reports] == [0, 1]
            assert [r["allreduce"] for r in reports] == [[3.0, 10.0], [3.0, 10.0]]
            assert {r["job"] for r in reports} == {job}
            steps = {r["step"] for r in reports}
            assert len(steps) == 1 and None not in steps
            step = f"{job}.{steps.pop()}"
            assert squeue("-s", "-j", job, "-o", "%i %j").splitlines() == [f"{step} {c.ipp.cluster_id}"]
            assert json.loads(c.state_file.read_text())["jobs"] == [step]
        finally:
            hpdl.stop(quiet=True)
        wait_until(lambda: squeue("-s", "-j", job, "-o", "%i") == "", 30, "the engines' step did not end")
        assert squeue("-j", job, "-o", "%T") == "RUNNING"  # the allocation itself is not ours to end
    finally:
        subprocess.run(["scancel", job], timeout=30)
    wait_until(lambda: squeue("-j", job, "-o", "%i") == "", 60, "the allocation was not cancelled")


def salloc(*args: str) -> str:
    """A job allocation with no shell (what jupyter.sbatch or Open OnDemand would hold); its id."""
    p = subprocess.run(["salloc", "--no-shell", "-J", "hpdl-test-alloc", *args], capture_output=True, text=True,
                       timeout=60)
    m = re.search(r"Granted job allocation (\d+)", p.stderr + p.stdout)
    assert m, p.stderr
    return m.group(1)


def inside(monkeypatch, job: str, ntasks: int, cpus_per_task: int = 0, gpus_per_task: int = 0) -> None:
    """This kernel as if it ran in the job's batch step: the variables Slurm sets there."""
    monkeypatch.setenv("SLURM_JOB_ID", job)
    monkeypatch.setenv("SLURM_NTASKS", str(ntasks))
    if cpus_per_task:
        monkeypatch.setenv("SLURM_CPUS_PER_TASK", str(cpus_per_task))
    if gpus_per_task:
        monkeypatch.setenv("SLURM_GPUS_PER_TASK", str(gpus_per_task))


def end_job(job: str) -> None:
    subprocess.run(["scancel", job], timeout=30)
    wait_until(lambda: squeue("-j", job, "-o", "%i") == "", 60, f"job {job} was not cancelled")


RANK_PLACE = textwrap.dedent(
    """
    import os, torch
    place = dict(rank=rank, cpus=sorted(os.sched_getaffinity(0)), threads=torch.get_num_threads(),
                 cpus_per_task=os.environ.get("SLURM_CPUS_PER_TASK"),
                 gpus_per_task=os.environ.get("SLURM_GPUS_PER_TASK"),
                 libmpi=sorted({l.split()[-1] for l in open("/proc/self/maps") if "libmpi.so" in l}),
                 seen=[os.environ.get(k) for k in ("HPDL_T_SETUP", "HPDL_T_SITE", "HPDL_T_BOTH")])
    """
)


def rank_places() -> list[dict]:
    view = hpdl.view()
    view.execute(RANK_PLACE, block=True)
    return sorted(view.pull("place", block=True), key=lambda r: r["rank"])


def stand_in_site_mpi(tmp_path: Path) -> Path:
    """A copy of the venv's libmpi standing in for a site MPI (MVAPICH2-GDR on a GPU cluster)."""
    venv_lib = Path(sys.prefix) / "lib"
    lib64 = tmp_path / "site-mpi" / "lib64"
    lib64.mkdir(parents=True)
    shutil.copy2((venv_lib / "libmpi.so.12").resolve(), lib64 / "libmpi.so.12")
    (lib64 / "mpich").symlink_to(venv_lib / "mpich")  # its dependencies, found through $ORIGIN/mpich
    return lib64 / "libmpi.so.12"


GREEDY_SITE = """
description = "asks more per rank than a plain `sbatch -n 2` job holds; MPI from the site"
setup = '''
export HPDL_T_SETUP="ran${{HPDL_T_UNSET:-}}"
export SITE_MPI_HOME={home}
'''
mpi_library = "$SITE_MPI_HOME/lib64/libmpi.so.12"
[slurm]
ranks_per_node = 2
cpus_per_rank = 2
gpus_per_rank = 1
[env]
HPDL_T_SITE = "from site"
HPDL_T_BOTH = "site"
"""

SIDE_JOB = (
    "import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
    "maps = sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libmpi.so' in l}); "
    "got = c.gather((c.size, c.allreduce(c.rank + 1), os.environ['HPDL_T_SITE'], maps)); "
    "c.rank or print('SIDE', got)"
)


@pytest.mark.slurm
def test_in_job_step_runs_the_site_prologue_and_asks_only_what_the_job_holds(slurm, outside_slurm, monkeypatch,
                                                                             tmp_path, no_strays):
    libmpi = stand_in_site_mpi(tmp_path)
    (tmp_path / "site.toml").write_text(GREEDY_SITE.format(home=tmp_path / "site-mpi"))
    monkeypatch.setenv("HPDL_SITE", str(tmp_path / "site.toml"))
    job = salloc("-n", "2")  # asks for tasks only, as a plain jupyter.sbatch does
    try:
        inside(monkeypatch, job, 2)
        with pytest.warns(UserWarning, match=r"--cpus-per-task=2 \(the job holds 1\), --gpus-per-task=1"):
            hpdl.start(frameworks=("torch",), env={"HPDL_T_BOTH": "learner"}, quiet=True)
        try:
            places = rank_places()
            assert [p["seen"] for p in places] == [["ran", "from site", "learner"]] * 2
            assert [p["libmpi"] for p in places] == [[str(libmpi)]] * 2  # the site's MPI, not the venv's
            # a side job (a check) starts beside the engines' step, which holds every CPU of the job
            cmd = launchers.side_job_command(2) + [sys.executable, "-c", SIDE_JOB]
            assert cmd[:2] == ["srun", "--overlap"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            side = [s for s in out.stdout.splitlines() if s.startswith("SIDE")]
            assert side == [f"SIDE {[(2, 3, 'from site', [str(libmpi)])] * 2}"], out.stderr
            # a tuning sweep's job asks for no GPU, so older Slurm does not queue it behind the engines'
            cpu_only = launchers.side_job_command(2, gpus=False) + [sys.executable, "-c", SIDE_JOB]
            assert "--gres=none" in cpu_only and "--gres=none" not in cmd
            out = subprocess.run(cpu_only, capture_output=True, text=True, timeout=120)
            assert [s for s in out.stdout.splitlines() if s.startswith("SIDE")] == side, out.stderr
        finally:
            hpdl.stop(quiet=True)
    finally:
        end_job(job)


@pytest.mark.slurm
def test_in_job_step_hands_the_ranks_the_kernels_environment_whatever_the_job_exported(
        slurm, outside_slurm, monkeypatch, no_strays):
    """A job submitted with `sbatch --export=LIST` (JupyterHub's SlurmSpawner) or `--export=NONE`
    leaves SLURM_EXPORT_ENV set for every srun in it; the ranks still get the kernel's environment."""
    job = salloc("-n", "2")
    try:
        inside(monkeypatch, job, 2)
        monkeypatch.setenv("SLURM_EXPORT_ENV", "HOME,USER")  # as in a hub job: no PATH, no HPDL_*
        monkeypatch.setenv("HPDL_T_KERNEL_ONLY", "from the kernel")
        hpdl.start(frameworks=(), quiet=True)
        try:
            view = hpdl.view()
            view.execute("import os; seen = os.environ.get('HPDL_T_KERNEL_ONLY')", block=True)
            assert view.pull("seen", block=True) == ["from the kernel"] * 2
            cmd = launchers.side_job_command(2) + [sys.executable, "-c",
                                                   "import os; print(os.environ['HPDL_T_KERNEL_ONLY'])"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            assert out.stdout.splitlines() == ["from the kernel"] * 2, out.stderr
        finally:
            hpdl.stop(quiet=True)
    finally:
        end_job(job)


AFFINITY_SITE = """
description = "{cpus} core(s) and one (stand-in) GPU per rank, bound to its cores"
[slurm]
ranks_per_node = {per_node}
cpus_per_rank = {cpus}
gpus_per_rank = 1
srun = ["--cpu-bind=cores"]
time = "00:10:00"
"""


def _slurm_config(key: str) -> str:
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(rf"^{key}\s*=\s*(.*)$", out, flags=re.M)
    return m.group(1).strip() if m else ""


@pytest.mark.slurm
def test_submitted_job_and_its_step_hold_the_site_resources_and_threads_follow_the_binding(
        slurm, outside_slurm, monkeypatch, tmp_path, no_strays):
    assert "affinity" in _slurm_config("TaskPlugin"), "the test Slurm must bind tasks (task/affinity)"
    (tmp_path / "site.toml").write_text(AFFINITY_SITE.format(cpus=1, per_node=2))
    monkeypatch.setenv("HPDL_SITE", str(tmp_path / "site.toml"))
    hpdl.start(n=2, launcher="slurm", frameworks=("torch",), quiet=True)
    try:
        places = rank_places()
        assert [(p["cpus_per_task"], p["gpus_per_task"]) for p in places] == [("1", "1")] * 2
        assert [len(p["cpus"]) for p in places] == [1, 1]
        assert places[0]["cpus"] != places[1]["cpus"], "ranks not bound to their own cores"
        assert [p["threads"] for p in places] == [1, 1]  # torch threads = the rank's own cores
    finally:
        hpdl.stop(quiet=True)


@pytest.mark.slurm
def test_a_rank_holding_two_cores_runs_two_torch_threads(slurm, outside_slurm, monkeypatch, tmp_path, no_strays):
    (tmp_path / "site.toml").write_text(AFFINITY_SITE.format(cpus=2, per_node=1))
    monkeypatch.setenv("HPDL_SITE", str(tmp_path / "site.toml"))
    job = salloc("-n", "1", *sites.resource_options(sites.load_site()))
    try:
        inside(monkeypatch, job, 1, cpus_per_task=2, gpus_per_task=1)
        hpdl.start(frameworks=("torch",), quiet=True)
        try:
            (place,) = rank_places()
            assert (place["cpus_per_task"], place["gpus_per_task"], len(place["cpus"])) == ("2", "1", 2)
            assert place["threads"] == 2  # its two cores, not divided again
        finally:
            hpdl.stop(quiet=True)
    finally:
        end_job(job)


KERNEL = textwrap.dedent(
    """
    import json, sys, time, hpdl
    c = hpdl.start(n=2, launcher="slurm", frameworks=(), quiet=True)
    print(json.dumps({"job": json.load(open(c.state_file))["jobs"][0],
                      "pids": [r["pid"] for r in c.ranks]}), flush=True)
    time.sleep(600)
    """
)


@pytest.mark.slurm
def test_killed_kernel_gets_its_slurm_job_cancelled(slurm, outside_slurm, no_strays):
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL], stdout=subprocess.PIPE, text=True,
                              stdin=subprocess.DEVNULL)
    try:
        line = kernel.stdout.readline()
        assert line, "the kernel stand-in did not start its ranks"
        job = json.loads(line)["job"]
        assert squeue("-j", job, "-o", "%T") == "RUNNING"
        kernel.send_signal(signal.SIGKILL)  # no exit handlers run: only the reaper can clean up
        kernel.wait(timeout=10)
        wait_until(lambda: squeue("-j", job, "-o", "%i") == "", 60, f"job {job} still queued after the kernel died")
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()


@pytest.mark.slurm
def test_a_job_that_dies_before_its_ranks_register_is_reported(slurm, outside_slurm, monkeypatch, no_strays):
    monkeypatch.setenv("HPDL_SLURM_SRUN", "--no-such-srun-option")
    with pytest.raises(HpdlError) as err:
        hpdl.start(n=2, launcher="slurm", frameworks=(), quiet=True, timeout=120)
    assert "ended before all 2 ranks registered" in str(err.value)
    assert "no-such-srun-option" in str(err.value)  # srun's own complaint, from the job's output
    # hpdl's own jobs: a test's own ("hpdl-test-...") may still be completing beside it (make test TEST_WORKERS=2)
    left = [j for j in squeue("-o", "%j").splitlines() if j.startswith("hpdl-") and not j.startswith("hpdl-test-")]
    assert not left, f"a job was left queued: {left}"


@pytest.mark.slurm
def test_sbatch_refusal_says_why_and_what_was_asked(slurm, outside_slurm, monkeypatch, no_strays):
    monkeypatch.setenv("HPDL_SLURM_PARTITION", "no_such_partition")
    with pytest.raises(HpdlError) as err:
        hpdl.start(n=2, launcher="slurm", frameworks=(), quiet=True)
    assert "invalid partition" in str(err.value).lower()
    assert "#SBATCH --partition=no_such_partition" in str(err.value)


def _submit(args: list[str], cwd: Path, **env: str) -> str:
    p = subprocess.run(["sbatch", "--parsable", *args], capture_output=True, text=True, cwd=cwd, timeout=60,
                       env={**os.environ, "HPDL_DIR": str(ROOT), **env})
    assert p.returncode == 0, p.stderr
    return p.stdout.strip().split(";")[0]


@pytest.mark.slurm
def test_run_sbatch_runs_a_script_and_a_notebook_on_the_jobs_ranks(slurm, outside_slurm, tmp_path, no_strays):
    (tmp_path / "ranks.py").write_text(
        "import os, sys\nfrom mpi4py import MPI\nc = MPI.COMM_WORLD\n"
        "print('RANK', c.rank, c.size, c.allreduce(c.rank + 1), os.environ['SLURM_JOB_ID'], *sys.argv[1:])\n"
    )
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nb.cells = [
        nbformat.v4.new_code_cell("import hpdl\nc = hpdl.start(n=2, frameworks=(), quiet=True)\nprint(c.launcher)"),
        nbformat.v4.new_code_cell("%%px\nimport os\ntotal = comm.allreduce(rank + 1)\n"
                                  "job = os.environ['SLURM_JOB_ID']"),
        nbformat.v4.new_code_cell("print(hpdl.view().pull(['rank', 'total', 'job'], block=True))\n"
                                  "hpdl.stop(quiet=True)"),
    ]
    nbformat.write(nb, tmp_path / "lesson.ipynb")
    run_sbatch = str(ROOT / "cluster/slurm/run.sbatch")
    script_job = _submit(["-n", "2", "-o", "script-%j.out", run_sbatch, "ranks.py", "--flag"], tmp_path)
    nb_job = _submit(["-n", "2", "-o", "nb-%j.out", str(ROOT / "cluster/slurm/run.sbatch"), "lesson.ipynb"], tmp_path)
    for job in (script_job, nb_job):
        wait_until(lambda: squeue("-j", job, "-o", "%i") == "", 240, f"job {job} did not finish")
    lines = sorted(s for s in (tmp_path / f"script-{script_job}.out").read_text().splitlines() if s.startswith("RANK"))
    assert lines == [f"RANK 0 2 3 {script_job} --flag", f"RANK 1 2 3 {script_job} --flag"]
    out = tmp_path / f"lesson-run-{nb_job}.ipynb"
    assert out.exists(), (tmp_path / f"nb-{nb_job}.out").read_text()
    texts = ["".join(o.get("text", "") for o in cell.outputs) for cell in nbformat.read(out, 4).cells]
    assert texts[0].strip() == "slurm"
    assert texts[2].strip() == str([[0, 3, nb_job], [1, 3, nb_job]])


CHECK_IN_JOB = textwrap.dedent(
    """
    import json, os, subprocess, sys, threading, time
    import psutil
    sys.path.insert(0, sys.argv[1])
    import learner_ring as L
    import hpdl
    from hpdl.checker import sandbox
    from hpdl.errors import HpdlError
    from hpdl.launchers import mpiexec

    phase, done = ["local"], threading.Event()
    seen = {"local": set(), "batch": set()}  # programs this kernel stand-in started (sandbox, launcher, ranks)
    steps = {"local": set(), "batch": set()}  # the job's steps

    def watch():
        for n in iter(int, 1):
            if done.is_set():
                return
            where = phase[0]
            for p in psutil.Process().children(recursive=True):
                try:
                    seen[where].add(os.path.basename(p.cmdline()[0]))
                except (psutil.Error, IndexError):
                    pass
            if n % 4 == 0:
                steps[where].update(subprocess.run(["squeue", "-h", "-s", "-j", os.environ["SLURM_JOB_ID"], "-o", "%j"],
                                                   capture_output=True, text=True, timeout=30).stdout.split())
            time.sleep(0.05)

    def no_mpiexec():  # as with Cray MPICH, where only srun starts ranks
        raise HpdlError("No mpiexec found: this Python has no MPI launcher next to it and none is on PATH.")

    def cases(result, hint=False):
        return [[c.verdict.value, f"{c.message} {c.hint if hint else ''}"] for c in result.cases]

    threading.Thread(target=watch, daemon=True).start()
    right = hpdl.check("ring_allreduce", L.ring_ok, ranks=[2])
    wrong = hpdl.check("ring_allreduce", L.ring_root_only, ranks=[2])
    time.sleep(0.5)
    phase[0], mpiexec.find_mpiexec = "batch", no_mpiexec
    batch = hpdl.check("ring_allreduce", L.ring_ok, ranks=[2])
    time.sleep(0.5)
    done.set()
    print("RESULT " + json.dumps(dict(
        right=cases(right), wrong=cases(wrong, hint=True), batch=cases(batch), notes=right.hints + wrong.hints,
        batch_notes=batch.hints, sandboxed=sandbox.available(), programs={k: sorted(v) for k, v in seen.items()},
        steps={k: sorted(v) for k, v in steps.items()})), flush=True)
    """
)


@pytest.mark.slurm
def test_a_check_inside_a_slurm_job_runs_sandboxed_on_the_node_with_no_step(slurm, outside_slurm, tmp_path,
                                                                             no_strays):
    """JupyterLab in a Slurm job (the hub, Open OnDemand, jupyter.sbatch): hpdl.check's jobs run on the
    kernel's node through the local mpiexec, in the sandbox (no network: an srun there could not reach
    slurmctld), never as an srun step queued or squeezed beside the engines'. Where this MPI has no
    mpiexec (Cray MPICH), an srun step it is, its sandbox keeping the network, and the result says so."""
    (tmp_path / "check.py").write_text(CHECK_IN_JOB)
    script = f"{shlex.quote(sys.executable)} check.py {shlex.quote(str(ROOT / 'tests' / 'fixtures'))}"
    p = subprocess.run(["sbatch", "--parsable", "-n", "2", "-J", "hpdl-test-check", "-o", "check-%j.out",
                        "--wrap", script], capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    try:
        wait_until(lambda: squeue("-j", job, "-o", "%i") == "", 400, f"job {job} did not finish")
    finally:
        subprocess.run(["scancel", job], timeout=30)
    out = (tmp_path / f"check-{job}.out").read_text()
    found = [s for s in out.splitlines() if s.startswith("RESULT ")]
    assert found, out[-3000:]
    got = json.loads(found[0][len("RESULT "):])
    assert got["sandboxed"], "bubblewrap does not work inside the Slurm job: " + out[-2000:]
    assert got["right"] and {v for v, _ in got["right"]} == {"PASS"}, got["right"]
    assert {v for v, _ in got["wrong"]} == {"WRONG"} and "only rank 0" in " ".join(m for _, m in got["wrong"])
    programs, steps = got["programs"]["local"], got["steps"]["local"]
    assert "bwrap" in programs and "mpiexec" in programs, programs
    assert "srun" not in programs and "hpdl-side" not in steps, (programs, steps)
    # no fallback note: the network stayed shut (the wrong code's notes may carry a tip to run one case)
    assert not [n for n in got["notes"] if "batch system" in n], got["notes"]
    # no local launcher: srun steps from inside the sandbox, which kept the network for them, and a note
    assert got["batch"] and {v for v, _ in got["batch"]} == {"PASS"}, got["batch"]
    assert {"bwrap", "srun"} <= set(got["programs"]["batch"]) and "hpdl-side" in got["steps"]["batch"], got
    assert any("ran through the batch system (srun)" in n for n in got["batch_notes"]), got["batch_notes"]


@pytest.mark.slurm
def test_jupyter_sbatch_serves_jupyterlab_inside_the_job(slurm, outside_slurm, tmp_path, no_strays):
    home, ws = Path(os.environ["HPDL_HOME"]), tmp_path / "ws"
    job = _submit(["-n", "2", str(ROOT / "cluster/slurm/jupyter.sbatch")], tmp_path, HPDL_WORKSPACE=str(ws))
    info, log = home / f"jupyter-{job}.txt", ws / f"hpdl-jupyter-{job}.log"
    try:
        wait_until(info.exists, 120, "jupyter.sbatch wrote no connection file")
        assert stat.S_IMODE(info.stat().st_mode) == 0o600  # it holds the token
        url = re.search(r"http://127\.0\.0\.1:(\d+)/lab\?token=(\w+)", info.read_text())
        assert url, info.read_text()
        port, token = url.groups()
        assert token not in log.read_text() and f"in {ws}" in log.read_text()
        assert (ws / "notebooks" / "00_welcome.ipynb").is_file() and (ws / "exercises").is_dir()
        assert list(tmp_path.iterdir()) == [ws]  # nothing written where it was submitted from

        def status():
            if squeue("-j", job, "-o", "%i") == "":
                raise AssertionError("the job ended:\n" + log.read_text()[-2000:])
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status?token={token}", timeout=5) as r:
                    return json.loads(r.read())
            except OSError:
                return None

        assert "started" in wait_until(status, 120, "JupyterLab did not answer")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token={token}", timeout=10) as r:
            assert {"notebooks", "exercises"} <= {i["name"] for i in json.loads(r.read())["content"]}  # its root
        on_command_lines = [p.pid for p in psutil.process_iter(["cmdline"])
                            if token in " ".join(p.info["cmdline"] or [])]
        assert not on_command_lines, "the token is on a command line, for anyone to see with ps"
        with pytest.raises(urllib.error.HTTPError) as denied:  # without the token: refused
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/status", timeout=5)
        assert denied.value.code == 403
    finally:
        subprocess.run(["scancel", job], timeout=30)
        wait_until(lambda: squeue("-j", job, "-o", "%i") == "", 60, f"job {job} did not end")
    assert not info.exists() and not list(home.glob(f"jupyter-{job}*"))  # the token's files go with the job


# -- site profiles (no Slurm needed) ------------------------------------------------------------

def _render(site: launchers.SlurmSite, n: int = 4) -> str:
    prefix = shlex.join(sites.rank_wrapper(site, ["HOROVOD_CYCLE_TIME"]))
    return EvalFormatter().format(launchers.sbatch_template(site), n=n, cluster_id="hpdl-x",
                                  output_file="/tmp/o.log", program="/venv/bin/python -m ipyparallel.engine",
                                  program_args="--profile-dir=/p", hpdl_exports="export HOROVOD_CYCLE_TIME=5",
                                  hpdl_rank_prefix=prefix)


# the Slurm sites among the examples (emulated-2x2 is this machine as nodes: tests/test_emulated_nodes.py)
@pytest.mark.parametrize("name", sorted(p.stem for p in launchers.SITES_DIR.glob("*.toml")
                                        if "[emulated]" not in p.read_text()))
def test_example_site_profiles_load_and_render(name, outside_slurm):
    site = launchers.load_site(name)
    script = _render(site)
    assert f"#SBATCH --partition={site.partition}" in script
    assert "#SBATCH --ntasks=4" in script
    # the step passes the batch script's environment on, whatever sbatch was told (--export=NONE)
    assert f"srun --mpi={site.pmi} --kill-on-bad-exit=1 --export=ALL" in script
    assert script.rstrip().endswith("/venv/bin/python -m ipyparallel.engine --mpi --profile-dir=/p")
    for key, value in site.env.items():
        assert f"export {key}={value}" in script
    if site.setup:  # shell text, braces included, reaches the script as written
        assert site.setup.strip() in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_environment_overrides_the_site_profile(outside_slurm, monkeypatch):
    monkeypatch.setenv("HPDL_SITE", "generic")
    monkeypatch.setenv("HPDL_SLURM_PARTITION", "short")
    monkeypatch.setenv("HPDL_SLURM_SBATCH", "--constraint=avx512 --mem=0")
    monkeypatch.setenv("HPDL_SLURM_RANKS_PER_NODE", "2")
    site = launchers.load_site()
    assert (site.partition, site.ranks_per_node, site.sbatch) == ("short", 2, ["--constraint=avx512", "--mem=0"])
    script = _render(site)
    assert "#SBATCH --partition=short" in script and "#SBATCH --constraint=avx512" in script
    assert "#SBATCH --ntasks-per-node=2" in script
    monkeypatch.setenv("HPDL_SLURM_RANKS_PER_NODE", "two")
    with pytest.raises(HpdlError, match="HPDL_SLURM_RANKS_PER_NODE"):
        launchers.load_site()


def test_a_course_reservation_and_shared_gpu_nodes_reach_the_job_and_the_ranks_find_the_shared_kit(
        outside_slurm, monkeypatch, tmp_path):
    monkeypatch.delenv("HPDL_DIR", raising=False)
    for name in ("nccl-gpu", "mvapich2-gdr"):  # shared nodes by default: no learner holds a whole node
        site = launchers.load_site(name)
        assert site.learners_per_node > 1 and "--exclusive" not in site.sbatch and "--mem=0" not in site.sbatch
        assert "$HPDL_DIR/.venv/bin/activate" in site.setup and "$HOME/hpdl" not in site.setup
        assert f"{site.learners_per_node} learner(s) per node" in sites.learner_share(site)
    monkeypatch.setenv("HPDL_SITE", "nccl-gpu")
    monkeypatch.setenv("HPDL_SLURM_RESERVATION", "hpdl-course")
    site = launchers.load_site()
    assert "--reservation=hpdl-course" in sites.sbatch_args(site)
    assert "#SBATCH --reservation=hpdl-course" in _render(site)  # the job a login-node kernel submits
    monkeypatch.setenv("HPDL_SLURM_SBATCH", "--exclusive")  # one learner per node, but two planned
    with pytest.raises(HpdlError, match="learners_per_node = 2 .*--exclusive"):
        launchers.load_site()
    # on the rank: the kit's folder for the profile's set-up, unless the kernel's environment set one
    probe = sites.rank_wrapper(sites.SlurmSite(setup='echo "kit=$HPDL_DIR"'))
    ours = subprocess.run([*probe, "true"], capture_output=True, text=True, env={"PATH": os.environ["PATH"]})
    assert ours.stdout.strip() == f"kit={ROOT}", ours.stderr
    theirs = subprocess.run([*probe, "true"], capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], "HPDL_DIR": str(tmp_path)})
    assert theirs.stdout.strip() == f"kit={tmp_path}"


@pytest.mark.parametrize(
    "text, named",
    [
        ('[slurm]\npartiton = "gpu"\n', "slurm.partiton"),
        ('[slurm]\nranks_per_node = "4"\n', "slurm.ranks_per_node"),
        ('[slurm]\nsbatch = "--exclusive"\n', "slurm.sbatch"),
        ('modules = "cuda"\n', "modules"),
        ('[env]\nMV2_USE_CUDA = true\n', "env.MV2_USE_CUDA"),
        ('colour = "blue"\n', "'colour'"),
        ('[slurm]\npmi = "pmi2; rm -rf ~"\n', "slurm.pmi"),
        ('[slurm\npartition = "gpu"\n', "not valid TOML"),
    ],
)
def test_invalid_site_profile_names_the_key(text, named, tmp_path, outside_slurm):
    path = tmp_path / "site.toml"
    path.write_text(text)
    with pytest.raises(HpdlError) as err:
        launchers.load_site(str(path))
    assert named in str(err.value) and str(path) in str(err.value)


def test_unknown_site_name_lists_the_known_ones(outside_slurm):
    with pytest.raises(HpdlError, match="generic"):
        launchers.load_site("no-such-site")


# -- cluster files (no Slurm needed) ------------------------------------------------------------

def _pins(lines) -> dict[str, str]:
    pins = {}
    for line in lines:
        line = line.split("#")[0].strip().lstrip("- ").strip()
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(==\s*[\w.+]+)?", line)
        if m and not line.startswith("-"):
            pins[m.group(1).lower()] = (m.group(2) or "").replace(" ", "")
    return pins


def test_environment_yml_pins_what_requirements_txt_pins():
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    conda = _pins(pip_section)
    pip = _pins((ROOT / "requirements.txt").read_text().splitlines())
    not_for_clusters = {"mpich", "pytest", "pytest-timeout", "playwright", "ruff"}  # site MPI; tests, lint on CI
    assert {k: v for k, v in pip.items() if k not in not_for_clusters} == conda
    assert "-e ." in pip_section and "mpich" not in conda


def _strip_erb(text: str) -> str:
    text = re.sub(r"^\s*<%-.*?-%>\n", "", text, flags=re.M)
    return re.sub(r"<%=.*?%>", "x", text)


def test_cluster_shell_files_parse():
    scripts = {p: p.read_text() for p in (ROOT / "cluster" / "slurm").glob("*.s*")}
    for p in (ROOT / "cluster" / "ood").rglob("*.sh.erb"):
        scripts[p] = _strip_erb(p.read_text())
    definition = (ROOT / "cluster" / "apptainer" / "hpdl.def").read_text()
    scripts["hpdl.def %post"] = re.search(r"^%post\n(.*?)^%", definition, flags=re.S | re.M).group(1)
    assert len(scripts) >= 6
    for name, text in scripts.items():
        p = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
        assert p.returncode == 0, f"{name}: {p.stderr}"
