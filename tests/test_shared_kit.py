"""One kit installed once and read-only; each learner works in a workspace of their own.

A copy of this kit is made read-only (`chmod -R a-w`), as an instructor installs it for a course.
Two fresh Unix accounts each start JupyterLab through cluster/slurm/jupyter.sbatch on the local
Slurm — one submitting from their home, one from inside the kit's folder — and then, through their
own JupyterLab's API (a kernel of their server, as the browser would), save an edit to an exercise;
the first runs lesson 00 on 4 ranks (one srun step of their job), the second its `!hpdl exercises`
cell only (the hub's test runs the lesson for two learners), and `hpdl exercises` must keep the
edit. Then: nothing in the kit changed (every file's hash, mode and mtime, and no file added), each
workspace is ~/hpdl-workspace, 0700, holds the job's log, and the other account can read nothing
of it.

One set-up serves every assertion: two jobs, two JupyterLabs, eight ranks (about 2–4 min on two
busy cores). Root only (accounts), the local Slurm (tests/test_slurm.py's fixture), and a kit venv
other accounts may run (the hub test's .venv-shared; built here as it does when missing).

    flock /tmp/hpdl-mpi.lock .venv/bin/python -m pytest tests/test_shared_kit.py -q
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest

from conftest import remove_account
from test_slurm import slurm, wait_until  # noqa: F401  (the local Slurm; a wait with a message)

ROOT = Path(__file__).resolve().parents[1]
LEARNERS = ("hpdl-sk-ada", "hpdl-sk-bob")
EXERCISE = "exercises/04_ring_allreduce.ipynb"
MINE = "# my own answer, kept whatever the kit does"
LESSON = "notebooks/00_welcome.ipynb"
CELL_TIMEOUT = 420  # s: eight ranks with torch and Horovod starting at once on two busy cores
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- what the test needs: a venv others may run, a read-only kit, two accounts -----------------------
def _runnable_by_others(python: Path) -> bool:
    return python.exists() and subprocess.run(
        ["runuser", "-u", "nobody", "--", str(python), "-c", "import jupyterlab, mpi4py, torch"],
        capture_output=True, timeout=180).returncode == 0


def learners_venv() -> Path:
    """A venv of the kit that other accounts may run: ours, the hub test's .venv-shared (here or
    beside the venv ours links to), else .venv-shared built from Debian's Python as the hub test does."""
    beside = Path(os.path.realpath(ROOT / ".venv")).parent / ".venv-shared"
    candidates = [Path(sys.prefix), ROOT / ".venv-shared", beside]
    for venv in candidates:
        if _runnable_by_others(venv / "bin" / "python"):
            return venv
    if not Path("/usr/bin/python3").exists():
        pytest.skip("learners cannot run this kit's Python and there is no /usr/bin/python3 to build one from")
    p = subprocess.run(["make", "--no-print-directory", "setup", "VENV=.venv-shared", "PYTHON=/usr/bin/python3"],
                       cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, f"building .venv-shared failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    return ROOT / ".venv-shared"


def read_only_kit(venv: Path) -> Path:
    """This kit's tracked files copied to a folder every account can read, its venv linked in as
    .venv (the shared install), then `chmod -R a-w`."""
    top = Path(tempfile.mkdtemp(prefix="hpdl-shared-kit-", dir="/tmp"))
    top.chmod(0o755)
    kit = top / "hpdl"
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split("\0")
    for rel in filter(None, files):
        if (ROOT / rel).is_file():
            (kit / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, kit / rel)
    (kit / ".venv").symlink_to(venv)
    subprocess.run(["chmod", "-R", "a+rX,a-w", str(kit)], check=True, timeout=60)
    return kit


def snapshot(kit: Path) -> dict[str, tuple]:
    """Every entry under the kit (links not followed): mode, size, mtime, and a file's hash."""
    found = {}
    for folder, dirs, files in os.walk(kit):
        for name in dirs + files:
            path = Path(folder) / name
            st = path.lstat()
            digest = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(st.st_mode) else ""
            found[str(path.relative_to(kit))] = (st.st_mode, st.st_size, st.st_mtime_ns, digest)
    return found




def as_user(name: str, *cmd: str, cwd: Path, env: dict[str, str] | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
    home = os.path.expanduser(f"~{name}")
    clean = {"HOME": home, "USER": name, "LOGNAME": name, "PATH": "/usr/local/bin:/usr/bin:/bin",
             "LANG": "C.UTF-8", **(env or {})}
    return subprocess.run(["runuser", "-u", name, "--", "env", "-i", *(f"{k}={v}" for k, v in clean.items()), *cmd],
                          cwd=cwd, capture_output=True, text=True, timeout=timeout)


# -- a learner's JupyterLab, driven through its API ---------------------------------------------------
class Lab:
    """One learner's JupyterLab from jupyter.sbatch: its address and token from ~/.hpdl."""

    def __init__(self, name: str, job: str):
        self.name, self.job = name, job
        self.home = Path(os.path.expanduser(f"~{name}"))
        self.workspace = self.home / "hpdl-workspace"
        self.log = self.workspace / f"hpdl-jupyter-{job}.log"
        self.url = self.token = ""

    def connect(self) -> None:
        info = self.home / ".hpdl" / f"jupyter-{self.job}.txt"

        def ready():
            if not info.exists():
                ended = not subprocess.run(["squeue", "-h", "-j", self.job], capture_output=True, text=True,
                                           timeout=30).stdout.strip()
                assert not ended, f"{self.name}'s job {self.job} ended:\n{self.logs()}"
                return False
            port, self.token = re.search(r"127\.0\.0\.1:(\d+)/lab\?token=(\w+)", info.read_text()).groups()
            self.url = f"http://127.0.0.1:{port}"
            try:
                return "started" in self.api("status")
            except OSError:
                return False

        wait_until(ready, 300, f"{self.name}'s JupyterLab (job {self.job}) did not answer")

    def logs(self) -> str:
        found = [self.log, *sorted((self.home / ".hpdl").glob(f"jupyter-{self.job}.log"))]
        return "".join(f"--- {f}\n{f.read_text()[-3000:]}" for f in found if f.exists())

    def api(self, path: str, method: str = "GET", body: dict | None = None) -> dict:
        req = urllib.request.Request(f"{self.url}/api/{path}", method=method,
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"Authorization": f"token {self.token}",
                                              "Content-Type": "application/json"})
        with _LOCAL.open(req, timeout=60) as r:
            return json.loads(r.read() or b"{}")

    def run_notebook(self, path: str, only: str = "") -> list[str]:
        """Every code cell of the notebook (those holding `only`, if given) in a kernel of this server
        (its folder the kernel's), in order, as Run All does; each cell's text output. A cell that
        errs fails the test."""
        cells = [c for c in self.api(f"contents/{path}?content=1")["content"]["cells"]
                 if c["cell_type"] == "code" and only in "".join(c["source"])]
        session = self.api("sessions", "POST", {"path": path, "type": "notebook", "name": "",
                                                "kernel": {"name": "python3"}})
        try:
            return asyncio.run(self._execute(session["kernel"]["id"], ["".join(c["source"]) for c in cells]))
        finally:
            try:
                self.api(f"sessions/{session['id']}", "DELETE")
            except (OSError, ValueError):
                pass

    async def _execute(self, kernel: str, sources: list[str]) -> list[str]:
        from tornado.websocket import websocket_connect

        ws_url = self.url.replace("http", "ws") + f"/api/kernels/{kernel}/channels?token={self.token}"
        conn = await websocket_connect(ws_url)
        outputs = []
        for source in sources:
            msg_id = uuid.uuid4().hex
            conn.write_message(json.dumps({
                "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": self.name,
                           "session": "hpdl-test", "version": "5.3", "date": ""},
                "parent_header": {}, "metadata": {}, "channel": "shell", "buffers": [],
                "content": {"code": source, "silent": False, "store_history": True, "user_expressions": {},
                            "allow_stdin": False, "stop_on_error": True}}))
            outputs.append(await self._reply(conn, msg_id, source))
        conn.close()
        return outputs

    async def _reply(self, conn, msg_id: str, source: str) -> str:
        text, done, deadline = [], {"reply": None, "idle": False}, time.monotonic() + CELL_TIMEOUT
        while done["reply"] is None or not done["idle"]:
            left = deadline - time.monotonic()
            assert left > 0, f"{self.name}: a cell did not finish in {CELL_TIMEOUT} s:\n{source}\n{''.join(text)}"
            raw = await asyncio.wait_for(conn.read_message(), left)
            assert raw is not None, f"{self.name}: the kernel's connection closed during:\n{source}"
            msg = json.loads(raw)
            if msg.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                text.append(content["text"])
            elif kind in ("execute_result", "display_data"):
                text.append(content["data"].get("text/plain", ""))
            elif kind == "error":
                text.append("\n".join(content["traceback"]))
            elif kind == "execute_reply":
                done["reply"] = content["status"]
            elif kind == "status" and content["execution_state"] == "idle":
                done["idle"] = True
        assert done["reply"] == "ok", f"{self.name}: the cell failed:\n{source}\n{''.join(text)[-3000:]}"
        return "".join(text)


def edit_exercise(lab: Lab) -> None:
    """Save an edit to an exercise through the learner's JupyterLab, as its editor does."""
    model = lab.api(f"contents/{EXERCISE}?content=1")
    cell = next(c for c in model["content"]["cells"] if c["cell_type"] == "code")
    cell["source"] = MINE + "\n" + "".join(cell["source"])
    lab.api(f"contents/{EXERCISE}", "PUT", {"type": "notebook", "format": "json", "content": model["content"]})


# -- the test ------------------------------------------------------------------------------------------
@pytest.fixture
def shared_kit(slurm):  # noqa: F811  (the fixture imported above)
    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("the shared-kit test creates accounts: run it as root")
    kit = read_only_kit(learners_venv())
    for name in LEARNERS:
        remove_account(name)  # a fresh home each run
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", name], check=True, timeout=30)
    try:
        yield kit
    finally:
        for name in LEARNERS:
            remove_account(name)
        subprocess.run(["chmod", "-R", "u+w", str(kit.parent)], timeout=60)
        shutil.rmtree(kit.parent, ignore_errors=True)


@pytest.mark.slurm
@pytest.mark.slow
def test_two_learners_share_one_read_only_kit_each_in_a_workspace_of_their_own(shared_kit):
    kit, t0 = shared_kit, time.monotonic()
    before = snapshot(kit)
    env = {"PYTHONPATH": str(kit)}  # the kit copy's hpdl, not the one the shared venv was installed from
    labs = []
    for name, submit_from in zip(LEARNERS, (None, kit)):  # from their home, and from inside the kit
        home = Path(os.path.expanduser(f"~{name}"))
        p = as_user(name, "sbatch", "--parsable", "-n", "4", str(kit / "cluster/slurm/jupyter.sbatch"),
                    cwd=submit_from or home, env=env)
        assert p.returncode == 0, f"{name}: sbatch failed: {p.stderr}"
        labs.append(Lab(name, p.stdout.strip().split(";")[0]))
    for lab in labs:
        lab.connect()
    for lab in labs:
        edit_exercise(lab)
        # ranks from a read-only kit: the whole lesson once (the hub's test runs it for two learners);
        # the second learner runs only its `!hpdl exercises` cell
        out = lab.run_notebook(LESSON, only="" if lab is labs[0] else "hpdl exercises")
        if lab is labs[0]:
            assert "rank 3 of 4" in "".join(out), f"{lab.name}: lesson 00's ranks did not report:\n{out}"
        synced = next(o for o in out if "hpdl exercises:" in o)
        assert str(lab.workspace) in synced and EXERCISE in synced and "not touched" in synced, synced
        assert MINE in (lab.workspace / EXERCISE).read_text(), f"{lab.name}: the edit was lost"
    print(f"\nset-up, a lesson and an update: {time.monotonic() - t0:.0f} s")

    for lab, other in zip(labs, reversed(labs)):
        uid = int(subprocess.check_output(["id", "-u", lab.name]))
        st = lab.workspace.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (uid, 0o700), f"{lab.workspace}: {oct(st.st_mode)}"
        assert (lab.workspace / LESSON).is_file() and (lab.workspace / "benchmarks" / "synthetic.py").is_file()
        assert lab.log.is_file() and "JupyterLab for job" in lab.log.read_text()  # the job's log is there
        assert not list(lab.home.glob("*.out")), f"{lab.name}: a job output left in the home"
        for what in (lab.workspace, lab.workspace / EXERCISE, lab.log):
            denied = as_user(other.name, "cat" if what.is_file() else "ls", str(what), cwd=Path("/"))
            assert denied.returncode != 0 and "Permission denied" in denied.stderr, f"{other.name} read {what}"
    after = snapshot(kit)
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the kit changed: {changed[:20]}"
