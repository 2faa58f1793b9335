"""A site's launcher as a package of its own, found through the `hpdl.launchers` entry points.

What a site does, done for real: docs/LAUNCHERS.md's PBS launcher (its class and its pyproject.toml,
taken from the page) is built and installed with `pip install --target` into a temporary folder,
beside a second package whose launcher does not import. A fresh Python with that folder on
PYTHONPATH must list `pbs`, pick it by "auto" inside a PBS job, report the broken package by name
without a traceback, and start ranks through it: stub `qsub`/`qstat`/`qdel` scripts on PATH run the
job script on this machine, so `hpdl.start(n=2, launcher="pbs")` really submits, and `hpdl.stop()`
really deletes, a (stub) PBS job.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "LAUNCHERS.md"

BROKEN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=64"]
build-backend = "setuptools.build_meta"

[project]
name = "hpdl-broken"
version = "0.2.0"

[tool.setuptools]
py-modules = ["hpdl_broken"]

[project.entry-points."hpdl.launchers"]
lsf = "hpdl_broken:Lsf"
"""

# The stub batch system: job N runs `bash SCRIPT` here in a session of its own (its id is the
# session's), its output where the script's `#PBS -o` says. Ids start high: the kit's reaper
# still hands every recorded job id to scancel, and a stub scancel keeps it from a real Slurm.
QSUB = '''
"""Stub qsub SCRIPT: run the job here, print its id as PBS does (N.server)."""
import os, re, subprocess, sys
from pathlib import Path
here = Path(__file__).resolve().parent
text = Path(sys.argv[-1]).read_text()
job = f"{8000001 + len(list(here.glob('*.job')))}.stub"
out = re.search(r"^#PBS -o (\\S+)", text, re.M)
(here / f"{job}.sh").write_text(text)
with open(here / "qsub.log", "a") as log:
    log.write(f"{job} {' '.join(sys.argv[1:])}\\n")
with open(out.group(1) if out else here / f"{job}.out", "ab") as f:
    p = subprocess.Popen(["bash", str(here / f"{job}.sh")], start_new_session=True, stdin=subprocess.DEVNULL,
                         stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PBS_JOBID": job})
(here / f"{job}.job").write_text(str(p.pid))
print(job)
'''
JOBS = '''
import os, sys, time
from pathlib import Path
import psutil
here = Path(__file__).resolve().parent

def members(job):
    """The live processes of job `job` ('8000001' or '8000001.stub'): its session's."""
    record = here / f"{job.split('.')[0]}.stub.job"
    if not record.exists():
        return None
    sid = int(record.read_text())
    found = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getsid(p.pid) == sid and p.info["status"] != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (OSError, psutil.Error):
            pass
    return found
'''
QSTAT = JOBS + '''
live = members(sys.argv[-1])
if not live:
    print(f"qstat: Unknown Job Id {sys.argv[-1]}", file=sys.stderr)
    sys.exit(153)
print(f"{sys.argv[-1]} R")
'''
QDEL = JOBS + '''
with open(here / "qdel.log", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
live = members(sys.argv[-1])
if live is None:
    print(f"qdel: Unknown Job Id {sys.argv[-1]}", file=sys.stderr)
    sys.exit(153)
# like a site's epilog, remove the MPI shared memory the job's ranks held (killed, they leave it)
shm = set()
for p in live:
    try:
        shm |= {m.path for m in p.memory_maps() if m.path.startswith(("/dev/shm/mpich_shm_", "/dev/shm/sm_segment"))}
    except psutil.Error:
        pass
for p in live:
    p.terminate()
gone, alive = psutil.wait_procs(live, timeout=10)
for p in alive:
    p.kill()
psutil.wait_procs(alive, timeout=10)
for path in shm:
    Path(path).unlink(missing_ok=True)
'''
SCANCEL = '''
import sys
from pathlib import Path
with open(Path(__file__).resolve().parent / "scancel.log", "a") as log:
    log.write(" ".join(sys.argv[1:]) + "\\n")
'''


def _docs_block(language: str, marker: str) -> str:
    """The code block of docs/LAUNCHERS.md in `language` that contains `marker`."""
    blocks = re.findall(rf"```{language}\n(.*?)```", DOCS.read_text(), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert found, f"docs/LAUNCHERS.md has no ```{language} block with {marker!r}"
    return found[0]


@pytest.fixture(scope="module")
def plugins(tmp_path_factory) -> Path:
    """Two outside packages, pip-installed into a folder of their own (the shared venv untouched)."""
    root = tmp_path_factory.mktemp("plugins")
    pbs, broken = root / "hpdl-pbs", root / "hpdl-broken"
    pbs.mkdir()
    (pbs / "pyproject.toml").write_text(_docs_block("toml", '[project.entry-points."hpdl.launchers"]'))
    (pbs / "hpdl_pbs.py").write_text(_docs_block("python", "class Pbs("))
    broken.mkdir()
    (broken / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (broken / "hpdl_broken.py").write_text("import lsf_batch_api  # a module this machine does not have\n")
    target = root / "site-packages"
    env = {**os.environ, "PIP_NO_CACHE_DIR": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    p = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                        "--no-build-isolation", "--target", str(target), str(pbs), str(broken)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout + p.stderr
    assert (target / "hpdl_pbs.py").exists()
    return target


@pytest.fixture
def stub_pbs(tmp_path) -> Path:
    """qsub, qstat, qdel (and a scancel that only notes what it was asked) in a folder for PATH."""
    bin_dir = tmp_path / "stub-bin"
    bin_dir.mkdir()
    for name, body in (("qsub", QSUB), ("qstat", QSTAT), ("qdel", QDEL), ("scancel", SCANCEL)):
        (bin_dir / name).write_text(f"#!{sys.executable}\n{body}")
        (bin_dir / name).chmod(0o755)
    return bin_dir


def _run(code: str, plugins: Path, stub_bin: Path, **env: str) -> subprocess.CompletedProcess:
    """`code` in a fresh Python that has this kit and the plugin folder on its path."""
    full_env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)]),
                "PATH": f"{stub_bin}{os.pathsep}{os.environ['PATH']}", **env}
    for var in ("SLURM_JOB_ID", "HPDL_LAUNCHER", "PBS_JOBID"):
        full_env.pop(var, None) if var not in env else None
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=300, env=full_env, cwd=stub_bin.parent)


def _last_json(p: subprocess.CompletedProcess):
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


REGISTRY = """
import json
import hpdl
from hpdl import launchers
from hpdl.errors import HpdlError
try:
    launchers.get("lsf")
    broken = None
except HpdlError as exc:
    broken = str(exc)
print(json.dumps({"known": launchers.known(), "auto": launchers.resolve("auto"), "broken": broken,
                  "problems": sorted(launchers.problems()), "module": type(launchers.get("pbs")).__module__}))
"""


def test_an_installed_package_adds_its_launcher_and_a_broken_one_is_named(plugins, stub_pbs):
    p = _run(REGISTRY, plugins, stub_pbs)
    got = _last_json(p)
    assert got["known"] == ["local", "pbs", "slurm"]
    assert got["module"] == "hpdl_pbs" and got["auto"] == "local"  # not inside a PBS job
    assert got["problems"] == ["lsf"]
    for text in (got["broken"], p.stderr):  # asked for by name, and the one warning at load
        assert "hpdl-broken 0.2.0" in text and "lsf_batch_api" in text and "pip uninstall hpdl-broken" in text
    assert "Traceback" not in p.stderr
    inside = _last_json(_run(REGISTRY, plugins, stub_pbs, PBS_JOBID="77.server"))
    assert inside["auto"] == "pbs"  # inside a PBS job it outranks local
    # without the plugin folder only the kit's own remain, and "pbs" is an error naming the group
    alone = subprocess.run([sys.executable, "-c", "from hpdl import launchers\ntry:\n    launchers.get('pbs')\n"
                            "except Exception as e:\n    print(launchers.known(), e)"],
                           capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert alone.stdout.startswith("['local', 'slurm'] launcher='pbs' is not one we know"), alone.stderr
    assert "'hpdl.launchers' entry-point group" in alone.stdout


START = """
import json, os
import hpdl
c = hpdl.start(n=2, launcher="pbs", frameworks=(), quiet=True)
try:
    view = hpdl.view()
    view.execute("import os; who = (rank, comm.allreduce(rank + 1), os.environ.get('PBS_JOBID'))", block=True)
    who = sorted(view.pull("who", block=True))
    status = hpdl.status()["launcher"]
    view.execute("shm = sorted({l.split()[-1] for l in open('/proc/self/maps') if '/dev/shm/' in l})", block=True)
    shm = sorted({path for paths in view.pull("shm", block=True) for path in paths})
finally:
    hpdl.stop(quiet=True)
print(json.dumps({"who": who, "status": status, "shm": shm, "shm_left": [p for p in shm if os.path.exists(p)]}))
"""


def test_hpdl_start_runs_its_ranks_inside_the_plugins_batch_job(plugins, stub_pbs, no_strays):
    got = _last_json(_run(START, plugins, stub_pbs))
    job = "8000001.stub"
    assert got["status"] == "pbs"
    assert got["who"] == [[0, 3, job], [1, 3, job]]  # two ranks of one MPI job, inside the stub's job
    assert got["shm"] and got["shm_left"] == []  # the ranks' MPI segment went with the job
    submitted = (stub_pbs / "qsub.log").read_text().splitlines()
    assert len(submitted) == 1 and submitted[0].startswith(f"{job} ")
    script = (stub_pbs / f"{job}.sh").read_text()
    assert re.search(r"^#PBS -N hpdl-\d+-\w+$", script, re.M) and "-n 2 " in script and " --mpi " in script
    # hpdl.stop() deleted the job (ipyparallel's stop and the kit's own sweep both ask qdel)
    assert set((stub_pbs / "qdel.log").read_text().split()) == {"8000001"}
    gone = subprocess.run([str(stub_pbs / "qstat"), job], capture_output=True, text=True, timeout=60)
    assert gone.returncode == 153 and "Unknown Job Id" in gone.stderr


KILLED = """
import json, sys, time
import hpdl
c = hpdl.start(n=2, launcher="pbs", frameworks=(), quiet=True)
print(json.dumps({"state": str(c.state_file)}), flush=True)
time.sleep(600)
"""


def test_a_killed_kernels_batch_job_is_cancelled_through_its_own_launcher(plugins, stub_pbs, no_strays):
    """The reaper cancels what a launcher submitted through that launcher (here qdel), never by
    assuming Slurm: a site's PBS job must not outlive a dead kernel, nor its id reach scancel."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(plugins)]),
           "PATH": f"{stub_pbs}{os.pathsep}{os.environ['PATH']}"}
    for var in ("SLURM_JOB_ID", "HPDL_LAUNCHER", "PBS_JOBID"):
        env.pop(var, None)
    kernel = subprocess.Popen([sys.executable, "-c", textwrap.dedent(KILLED)], stdout=subprocess.PIPE, text=True,
                              env=env, cwd=stub_pbs.parent)
    try:
        state = json.loads(kernel.stdout.readline())["state"]
        assert json.loads(Path(state).read_text())["launcher"] == "pbs"
        kernel.kill()
        kernel.wait(timeout=30)
        deadline = time.monotonic() + 60
        while not (stub_pbs / "qdel.log").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "8000001" in (stub_pbs / "qdel.log").read_text()
        assert not (stub_pbs / "scancel.log").exists()
    finally:
        if kernel.poll() is None:
            kernel.kill()
            kernel.wait()
