"""The workshop hub (cluster/jupyterhub): JupyterHub + batchspawner's SlurmSpawner on the local Slurm.

The hub as a site deploys it: installed root-owned outside the kit (install.sh into /opt/hpdl-hub-test),
over TLS (a self-signed certificate made here), its API on an internal address, its logs in a folder.
It first refuses to start without TLS. Two local accounts log in at once in a real browser (Debian's
Chromium, Playwright), PAM checking their passwords; each one's JupyterLab is a Slurm job of theirs,
and notebook 00 starts its ranks inside that job (one srun step); each saves it. Then, for real:
neither can read the other's connection files or workspace nor drive the other's ranks; an
instructor lists the servers but cannot open one, and stops one (its job and every process of that
user end); the idle culler stops the other; nothing in the kit changed; the hub-stop command stops
the hub and everything it started.

The whole story is one test (a hub, two jobs, eight ranks: about 3.5 min on two cores shared with
other work, plus the hub's install and the shared kit's environment the first time). `make test` runs it; alone:

    flock /tmp/hpdl-mpi.lock make test-hub

It needs root (accounts, a hub as root), the local Slurm (tests/test_slurm.py's fixture), Chromium,
openssl, and the hub's install (install.sh into /opt/hpdl-hub-test; refreshed each run, rebuilt when
its inputs changed). Where one of them cannot be had,
it skips saying which. The configuration itself is checked by the cheap test at the end.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import ssl
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from conftest import remove_account, user_processes
from test_browser import CHROMIUM_ARGS, chromium, free_port  # noqa: F401  (a fixture, and helpers)
from test_slurm import slurm, wait_until as wait_for  # noqa: F401  (the local Slurm; a wait with a message)

ROOT = Path(__file__).resolve().parents[1]
HUB_DIR = ROOT / "cluster" / "jupyterhub"
HUB_PREFIX = Path("/opt/hpdl-hub-test")  # the hub's root-owned install (a site's is /opt/hpdl-hub)
SHARED_VENV = ROOT / ".venv-shared"  # the kit for learners when ours lives where they cannot enter
GROUP = "hpdl-learners"
LEARNERS = ("hpdl-ada", "hpdl-bob")
INSTRUCTOR = "hpdl-ivy"  # not a learner: HPDL_HUB_INSTRUCTORS lets her in
IDLE_TIMEOUT, CULL_EVERY = 40, 5  # s: short, so the culler acts within the test
AGREEMENT = "all 4 ranks agree: 10 three times over"
NOTEBOOK_TIMEOUT = 480  # s: two notebooks at once, eight ranks with torch and Horovod, on two cores
# runuser lives in /usr/sbin; the learners' commands below run with PATH=/usr/bin:/bin, where
# subprocess would look for it: name it by its full path
RUNUSER = shutil.which("runuser") or "runuser"


# -- what the test needs: root, the learners' kit, the hub's environment, two accounts -------------
def runnable_by_others(python: Path) -> bool:
    return subprocess.run(["runuser", "-u", "nobody", "--", str(python), "-c", "import hpdl"],
                          capture_output=True, timeout=120).returncode == 0


@pytest.fixture(scope="module")
def kit_venv() -> Path:
    """The kit's venv as learners run it: ours if they may, else .venv-shared built from Debian's
    Python (a venv of a Python under /root is closed to every other account)."""
    if os.geteuid() != 0 or not shutil.which("runuser"):
        pytest.skip("the hub test creates accounts and runs the hub as root: run it as root")
    own = Path(sys.prefix)
    if runnable_by_others(own / "bin" / "python"):
        return own
    if not runnable_by_others(SHARED_VENV / "bin" / "python"):
        base = Path("/usr/bin/python3")
        if not base.exists():
            pytest.skip(f"learners cannot run {own}/bin/python and there is no {base} to build a shared kit from")
        p = subprocess.run(["make", "--no-print-directory", "setup", f"VENV={SHARED_VENV.name}", f"PYTHON={base}"],
                           cwd=ROOT, capture_output=True, text=True, timeout=1800)
        assert p.returncode == 0, f"building {SHARED_VENV} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}"
    return SHARED_VENV


@pytest.fixture(scope="module")
def hub_install(kit_venv) -> Path:
    """The hub installed as a site installs it (root-owned, outside the kit); refreshed each run."""
    p = subprocess.run(["bash", str(HUB_DIR / "install.sh")], capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "HPDL_KIT_VENV": str(kit_venv), "HPDL_HUB_PREFIX": str(HUB_PREFIX)})
    if p.returncode == 3:
        pytest.skip(p.stderr.strip().splitlines()[-1])
    assert p.returncode == 0, f"install.sh failed:\n{p.stdout[-3000:]}{p.stderr[-3000:]}"
    return HUB_PREFIX


@dataclass
class Learner:
    name: str
    password: str
    uid: int
    home: Path


def describe(procs: list[psutil.Process]) -> list[str]:
    out = []
    for p in procs:
        try:
            out.append(f"{p.pid}: {' '.join(p.cmdline())[:160]}")
        except psutil.Error:
            continue
    return out


def squeue_user(name: str) -> str:
    return subprocess.run(["squeue", "-h", "-u", name, "-o", "%i %T"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def nothing_left_of(learner: "Learner", after: str, timeout: float = 60) -> None:
    """No process of the learner's runs any more (their JupyterLab, kernels, ranks, watchmen)."""
    deadline = time.monotonic() + timeout
    while (left := user_processes(learner.uid)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"still running as {learner.name} after {after}: {describe(left)}"


@pytest.fixture
def learners(slurm) -> dict[str, Learner]:  # noqa: F811  (the fixture imported above)
    """Two fresh local accounts in the learners' group and an instructor outside it, with passwords;
    removed afterwards."""
    subprocess.run(["groupadd", "-f", GROUP], check=True, timeout=30)
    made = {}
    for name in (*LEARNERS, INSTRUCTOR):
        remove_account(name)  # a fresh home each run
        groups = ["-G", GROUP] if name in LEARNERS else []
        # uids of their own range: no other test's account shares (or inherits) one
        subprocess.run(["useradd", "-m", "-s", "/bin/bash", "-K", "UID_MIN=42100", "-K", "UID_MAX=42199",
                        *groups, name],
                       check=True, timeout=30)
        password = secrets.token_urlsafe(12)
        subprocess.run(["chpasswd"], input=f"{name}:{password}\n", text=True, check=True, timeout=30)
        made[name] = Learner(name, password, int(subprocess.check_output(["id", "-u", name])),
                             Path(os.path.expanduser(f"~{name}")))
    yield made
    for name in (*LEARNERS, INSTRUCTOR):
        remove_account(name)


@dataclass
class Hub:
    url: str
    token: str
    log: Path  # its console output
    log_dir: Path  # HPDL_HUB_LOG_DIR
    state: Path
    cert: Path
    api_port: int
    proc: subprocess.Popen

    def opener(self) -> urllib.request.OpenerDirector:
        """Requests that trust only the hub's own certificate (self-signed here)."""
        return urllib.request.build_opener(urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(
            context=ssl.create_default_context(cafile=str(self.cert))))

    def api(self, path: str, method: str = "GET") -> tuple[int, object]:
        req = urllib.request.Request(f"{self.url}/hub/api{path}", method=method)
        req.add_header("Authorization", f"token {self.token}")
        try:
            with self.opener().open(req, timeout=60) as r:
                body = r.read()
                return r.status, json.loads(body) if body else None
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode(errors="replace")

    def servers(self, name: str) -> dict:
        status, user = self.api(f"/users/{name}")
        assert status == 200, user
        return user["servers"]


def self_signed_certificate(folder: Path) -> tuple[Path, Path]:
    """A certificate for 127.0.0.1 and its key (openssl), as a site's would be for the hub's name."""
    folder.mkdir(mode=0o700)
    cert, key = folder / "hub.crt", folder / "hub.key"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def hub_environment(hub_install: Path, kit_venv: Path, tmp_path: Path, ports: dict[str, int], token: str) -> dict:
    """The hub's settings as a site's hub.env holds them, with this test's ports, folders, certificate
    and short idle timeout, and a site config adding one service: this test's token for the admin API."""
    site = tmp_path / "site_config.py"
    site.write_text(f"""
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{ports['proxy_api']}"
c.JupyterHub.services.append({{"name": "hpdl-test", "api_token": "{token}"}})
c.JupyterHub.load_roles.append({{"name": "hpdl-test", "services": ["hpdl-test"],
                                 "scopes": ["admin:users", "admin:servers", "list:users"]}})
""")
    cert, key = self_signed_certificate(tmp_path / "tls")
    return {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
            "HPDL_KIT_VENV": str(kit_venv), "HPDL_HUB_STATE": str(tmp_path / "state"),
            "HPDL_HUB_LOG_DIR": str(tmp_path / "log"), "HPDL_HUB_SITE_CONFIG": str(site), "HPDL_HUB_GROUP": GROUP,
            "HPDL_HUB_SSL_CERT": str(cert), "HPDL_HUB_SSL_KEY": str(key),
            "HPDL_HUB_BIND_URL": f"https://127.0.0.1:{ports['public']}", "HPDL_HUB_API_PORT": str(ports["api"]),
            "HPDL_HUB_INSTRUCTORS": INSTRUCTOR,
            "HPDL_SITE": "local-slurm",  # this machine's Slurm (cluster/slurm/local-slurm.sh) as a site
            "HPDL_HUB_IDLE_TIMEOUT": str(IDLE_TIMEOUT), "HPDL_HUB_CULL_EVERY": str(CULL_EVERY)}


def refuses_without_tls(hub_install: Path, env: dict) -> None:
    """Without a certificate (and no TLS proxy declared) the hub does not start, and says what to do."""
    plain = {k: v for k, v in env.items() if not k.startswith("HPDL_HUB_SSL_")}
    p = subprocess.run([str(hub_install / "bin" / "hpdl-hub")], env=plain, capture_output=True, text=True,
                       timeout=180, stdin=subprocess.DEVNULL)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert "hpdl hub: cannot start: no TLS" in p.stderr and "HPDL_HUB_TLS_PROXY=1" in p.stderr, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]


def stop_hub(h: Hub, env: dict) -> str:
    """The documented stop (hpdl-hub-stop); SIGKILL to the group only if it failed, then say so."""
    p = subprocess.run([str(HUB_PREFIX / "bin" / "hpdl-hub-stop"), "240"], env=env, capture_output=True, text=True,
                       timeout=300)
    if h.proc.poll() is None:
        os.killpg(h.proc.pid, signal.SIGKILL)
        h.proc.wait(10)
    return "" if p.returncode == 0 and h.proc.returncode == 0 else f"hpdl-hub-stop: {p.returncode} {p.stdout}{p.stderr}"


@pytest.fixture
def hub(hub_install, kit_venv, learners, tmp_path) -> Hub:
    """The hub as an instructor starts it (its bin/hpdl-hub, as root) on free ports, stopped by its
    bin/hpdl-hub-stop; nothing it started may outlive it."""
    ports = {k: free_port() for k in ("public", "api", "proxy_api")}
    token = secrets.token_hex(24)
    env = hub_environment(hub_install, kit_venv, tmp_path, ports, token)
    refuses_without_tls(hub_install, env)
    log = tmp_path / "jupyterhub.out"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(hub_install / "bin" / "hpdl-hub")], cwd=tmp_path, env=env,
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    h = Hub(f"https://127.0.0.1:{ports['public']}", token, log, tmp_path / "log", tmp_path / "state",
            Path(env["HPDL_HUB_SSL_CERT"]), ports["api"], proc)
    family, stopped = [], "not stopped"
    try:
        def up():
            if proc.poll() is not None:
                raise AssertionError(f"the hub exited ({proc.returncode}):\n{log.read_text()[-3000:]}")
            try:
                return h.api("/")[0] == 200
            except OSError:
                return False
        wait_for(up, 90, "the hub did not answer")
        family = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
        yield h
    finally:
        stopped = stop_hub(h, env)
        left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        for p in left:
            p.kill()
        print(f"hub log: {log}")
    assert not stopped, stopped
    assert not (h.state / "jupyterhub.pid").exists(), "the hub left its pid file"
    assert not left, f"left running after the hub stopped: {describe(left)}"


# -- helpers run as a learner ----------------------------------------------------------------------
def as_user(learner: Learner, python: Path, code: str, *args: str, timeout: float = 120) -> dict:
    """Run `code` with the kit's Python as the learner; it prints one JSON object."""
    p = subprocess.run([RUNUSER, "-u", learner.name, "--", str(python), "-c", code, *args],
                       capture_output=True, text=True, timeout=timeout, cwd="/",
                       env={"PATH": "/usr/bin:/bin", "HOME": str(learner.home), "LANG": "C.UTF-8"})
    assert p.returncode == 0, f"as {learner.name}: {p.stderr[-2000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


TRY_READ = """
import json, os, sys
seen = {}
for path in json.loads(sys.argv[1]):
    try:
        if os.path.isdir(path):
            os.listdir(path)
        else:
            open(path, "rb").read(1)
        seen[path] = "read"
    except OSError as e:
        seen[path] = type(e).__name__
print(json.dumps(seen))
"""

TRY_CLIENT = """
import json, os, sys
import ipyparallel as ipp
url_file, timeout = sys.argv[1], float(sys.argv[2])
try:
    c = ipp.Client(url_file, timeout=timeout)  # positional: ipyparallel 9 ignores url_file= (a keyword it keeps)
    c.wait_for_engines(4, timeout=timeout)
    print(json.dumps({"connected": True, "engine_uids": c[:].apply_sync(os.getuid)}))
    c.close()
except Exception as e:
    print(json.dumps({"connected": False, "error": f"{type(e).__name__}: {e}"}))
"""


def secrets_of(learner: Learner, job: str) -> dict[str, list[str]]:
    """What only this learner may read while their ranks run (found as root)."""
    h = learner.home
    server = [p for p in user_processes(learner.uid) if "jupyterhub-singleuser" in " ".join(p.cmdline())]
    found = {
        "controller connection files": sorted(map(str, (h / ".hpdl" / "profile" / "security").glob("*.json"))),
        "kernel connection files": sorted(map(str, (h / ".local/share/jupyter/runtime").glob("kernel-*.json"))),
        "hpdl run folders": sorted(map(str, (h / ".hpdl" / "runs").glob("*"))),
        "workspace": [str(h / "hpdl-workspace"), *map(str, sorted((h / "hpdl-workspace").glob("*/*.ipynb")))],
        "job log": [str(h / f"hpdl-hub-{job}.log")],
        "server's environment (its hub token)": [f"/proc/{p.pid}/environ" for p in server],
    }
    for what, paths in found.items():
        assert paths and all(os.path.exists(p) for p in paths), f"{learner.name}: no {what} found: {paths}"
    return found


# -- the browser -----------------------------------------------------------------------------------
def log_in(page, hub: Hub, learner: Learner, password: str | None = None, then: str = "") -> None:
    page.goto(f"{hub.url}/hub/login" + (f"?next={then}" if then else ""), wait_until="domcontentloaded")
    page.fill("#username_input", learner.name)
    page.fill("#password_input", password or learner.password)
    page.click("#login_submit")


def run_notebook_00_but_its_last_cell(page, learner: Learner) -> None:
    """Open notebook 00, select its last code cell (hpdl.stop()) and Run → Run All Above Selected
    Cell: everything runs, and the ranks stay up for what the test does next."""
    from playwright.sync_api import expect

    from playwright.sync_api import TimeoutError as PageTimeout

    page.wait_for_url(re.compile(rf"/user/{learner.name}/lab"), timeout=300_000)  # spawned: the job runs
    code_cells = page.locator(".jp-NotebookPanel .jp-CodeCell")
    expect(code_cells.last).to_contain_text("hpdl.stop()", timeout=120_000)
    expect(page.locator(".jp-StatusBar-Widget", has_text=re.compile(r"\| Idle"))).to_be_attached(timeout=120_000)
    # A run asked for before the kernel is attached clears the cells and runs nothing (JupyterLab's
    # CodeCell.execute): look for the first cell to start, and ask again if it did not.
    for _ in range(3):
        code_cells.last.locator(".jp-InputPrompt").click()
        page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
        page.locator("#jp-mainmenu-run .lm-Menu-item[data-command='notebook:run-all-above']:not(.lm-mod-disabled)") \
            .click()
        try:
            # "[*]" (queued) shows even when nothing runs; a number only once the kernel ran the cell
            expect(code_cells.first.locator(".jp-InputPrompt")).to_have_text(re.compile(r"\[\d+\]"), timeout=30_000)
            return
        except (AssertionError, PageTimeout):
            continue
    raise AssertionError(f"{learner.name}: Run All Above Selected Cell did not start notebook 00")


def outputs_text(page) -> str:
    return "\n".join(page.locator(".jp-OutputArea-output").all_text_contents())


def job_of(hub: Hub, learner: Learner) -> str:
    return hub.servers(learner.name)[""]["state"]["job_id"]


# -- the kit read-only, the hub root's alone, the instructor -------------------------------------------
KIT_SKIP = (".git", ".pytest_cache", ".ruff_cache", "__pycache__", "node_modules")


def kit_files() -> dict[str, tuple[str, int]]:
    """Every file of the kit (not its venvs, caches or git): its content's hash and its owner."""
    found = {}
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in KIT_SKIP and not d.startswith(".venv")]
        for name in files:
            path = Path(folder) / name
            st = path.lstat()
            data = os.readlink(path).encode() if path.is_symlink() else path.read_bytes()
            found[str(path.relative_to(ROOT))] = (hashlib.sha256(data).hexdigest(), st.st_uid)
    return found


TRY_WRITE = """
import json, os, sys
root, skip, writable = sys.argv[1], set(json.loads(sys.argv[2])), []
for folder, dirs, files in os.walk(root):
    dirs[:] = [d for d in dirs if d not in skip and not d.startswith(".venv")]
    writable += [os.path.join(folder, n) for n in (".", *files) if os.access(os.path.join(folder, n), os.W_OK)]
print(json.dumps(writable))
"""


def saved_notebook(learner: Learner) -> list[Path]:
    """The learner's saved notebook 00 with the ranks' answer in it: theirs, in their home."""
    return [p for p in learner.home.rglob("00_welcome.ipynb") if ".ipynb_checkpoints" not in p.parts
            and p.stat().st_uid == learner.uid and AGREEMENT in p.read_text()]


def hub_runs_only_roots_files(hub: Hub, kit_venv: Path) -> None:
    """What the root hub, its proxy and its culler run (executables, libraries, every file on the hub's
    Python path, its config) is root's alone and outside the kit; and none listens on every interface."""
    family = [psutil.Process(hub.proc.pid), *psutil.Process(hub.proc.pid).children(recursive=True)]
    assert {p.uids().real for p in family} == {0} and len(family) >= 3, describe(family)  # hub, proxy, culler
    files = set()
    for p in family:
        files |= {p.exe(), *(m.path for m in p.memory_maps() if m.path.startswith("/")),
                  *(f.path for f in p.open_files()), *(a for a in p.cmdline() if a.startswith("/"))}
    sys_path = json.loads(subprocess.check_output(  # as the hub's Python sees it: no PYTHONPATH
        [str(HUB_PREFIX / "venv" / "bin" / "python"), "-c", "import json, sys; print(json.dumps(sys.path))"],
        cwd="/", env={"PATH": "/usr/bin:/bin"}))
    for top in [HUB_PREFIX, *sys_path]:
        for folder, _, names in os.walk(top):
            files |= {folder, *(os.path.join(folder, n) for n in names)}
    kit = (f"{ROOT}/", f"{kit_venv.resolve()}/")
    bad = []
    for f in sorted(f for f in files if os.path.exists(f)):
        real, st = os.path.realpath(f), os.stat(f)
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            continue  # /dev/null and the like
        if real.startswith(kit) or st.st_uid != 0 or (st.st_mode & 0o022 and not stat.S_ISVTX & st.st_mode):
            bad.append(f"{f} ({real}, uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})")
    assert len(files) > 1000 and not bad, f"the root hub runs files others can change: {bad[:20]}"
    # its copy of the kit holds the answer keys (the case modules) and the kit's own answers: root's alone (a
    # learner's check read a reference from it: 28/28)
    answers = HUB_PREFIX / "kit" / "hpdl" / "checker" / "cases" / "ring_allreduce.py"
    assert answers.exists() and stat.S_IMODE(os.stat(HUB_PREFIX / "kit").st_mode) == 0o700
    assert subprocess.run([RUNUSER, "-u", "nobody", "--", "cat", str(answers)], capture_output=True).returncode != 0
    listening = {(c.laddr.ip, c.laddr.port) for p in family for c in p.net_connections("inet")
                 if c.status == psutil.CONN_LISTEN}
    assert not {ip for ip, _ in listening} & {"0.0.0.0", "::"}, listening
    # the API on the address the host's name resolves to (HPDL_HUB_API_IP's default), which Slurm's nodes reach
    assert (socket.gethostbyname(socket.gethostname()), hub.api_port) in listening, listening


def instructor_lists_and_stops_but_cannot_enter(page, hub: Hub, instructor: Learner, learner: Learner) -> None:
    """The instructor role: the admin page and every user's servers; a learner's server stopped;
    never inside it (its files) nor a token of the learner's."""
    log_in(page, hub, instructor, then="/hub/home")  # home, not a server of her own (no job for her)
    page.wait_for_url(re.compile(r"/hub/home"), timeout=60_000)
    request = page.context.request
    xsrf = {c["name"]: c["value"] for c in page.context.cookies()}.get("_xsrf", "")
    headers = {"X-XSRFToken": xsrf, "Referer": f"{hub.url}/hub/home"}
    assert request.get(f"{hub.url}/hub/admin").status == 200
    users = request.get(f"{hub.url}/hub/api/users", headers=headers)
    assert users.status == 200, (users.status, users.text()[:300])
    listed = {u["name"]: u for u in users.json()}
    assert set(LEARNERS) <= set(listed) and listed[learner.name]["servers"][""]["ready"], listed
    refused = {"open the learner's files": request.get(f"{hub.url}/user/{learner.name}/api/contents/"),
               "take a token of the learner's": request.post(f"{hub.url}/hub/api/users/{learner.name}/tokens",
                                                              headers=headers, data={})}
    for what, r in refused.items():
        assert r.status == 403, (what, r.status, r.text()[:300])
    stop = request.delete(f"{hub.url}/hub/api/users/{learner.name}/server", headers=headers)
    assert stop.status in (202, 204), (stop.status, stop.text()[:300])


# -- the test --------------------------------------------------------------------------------------
@pytest.mark.hub
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_learners_on_the_hub_each_in_their_own_slurm_job(chromium, hub, learners, kit_venv, tmp_path):  # noqa: F811
    from playwright.sync_api import expect, sync_playwright

    ada, bob = learners["hpdl-ada"], learners["hpdl-bob"]
    python = kit_venv / "bin" / "python"
    hub_runs_only_roots_files(hub, kit_venv)
    kit_before = kit_files()
    # the kit is read-only to learners
    assert as_user(ada, python, TRY_WRITE, str(ROOT), json.dumps(sorted(KIT_SKIP))) == []
    t0 = time.monotonic()
    times = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS, headless=True)
        pages = {}
        try:
            for learner in (ada, bob):
                ctx = browser.new_context(viewport={"width": 1400, "height": 1600}, ignore_https_errors=True)
                pages[learner.name] = ctx.new_page()
                pages[learner.name].set_default_timeout(60_000)
            # PAM checks the password: a wrong one is refused
            log_in(pages[bob.name], hub, bob, password="not-" + bob.password)
            expect(pages[bob.name].locator("body")).to_contain_text("Invalid username or password")
            # both log in, one after the other, without waiting: their jobs start side by side
            for learner in (ada, bob):
                log_in(pages[learner.name], hub, learner)
            for learner in (ada, bob):
                run_notebook_00_but_its_last_cell(pages[learner.name], learner)
            times["log in, spawn, open notebook 00"] = time.monotonic() - t0
            for learner in (ada, bob):
                expect(pages[learner.name].locator(".jp-OutputArea-output").filter(has_text=AGREEMENT).first) \
                    .to_be_attached(timeout=NOTEBOOK_TIMEOUT * 1000)
            times["both notebooks run"] = time.monotonic() - t0
            for learner in (ada, bob):  # each saves the notebook: in their own folder, as themselves
                pages[learner.name].keyboard.press("Control+s")
            for learner in (ada, bob):
                wait_for(lambda: saved_notebook(learner), 60, f"{learner.name}'s notebook 00 was not saved")

            # -- each notebook ran its ranks inside its learner's own Slurm job --------------------
            jobs = {}
            for learner in (ada, bob):
                text = outputs_text(pages[learner.name])
                assert re.search(r"hpdl: 4 ranks ready in [\d.]+ s \(Slurm,", text), text[-2000:]
                for r in range(4):
                    assert f"rank {r} of 4 on " in text
                jobs[learner.name] = job = job_of(hub, learner)
                assert squeue_user(learner.name) == f"{job} RUNNING"
                ranks = {}
                for proc in user_processes(learner.uid):
                    if "ipyparallel.engine" in " ".join(proc.cmdline()) or "ipengine" in " ".join(proc.cmdline()):
                        e = proc.environ()
                        ranks[e["SLURM_PROCID"]] = (e["SLURM_JOB_ID"], e.get("SLURM_STEP_ID"))
                assert sorted(ranks) == ["0", "1", "2", "3"], ranks
                assert {j for j, _ in ranks.values()} == {job}  # the ranks are tasks of this learner's job
                assert len({s for _, s in ranks.values()}) == 1  # ... one srun step of it
            assert jobs[ada.name] != jobs[bob.name]

            # -- neither can read the other's connection files, run folders, workspace, log -----------
            found = {learner.name: secrets_of(learner, jobs[learner.name]) for learner in (ada, bob)}
            for owner, other in ((ada, bob), (bob, ada)):
                paths = [p for ps in found[owner.name].values() for p in ps]
                mine = as_user(owner, python, TRY_READ, json.dumps(paths))
                assert set(mine.values()) == {"read"}, mine  # the owner can: the attempt below means something
                theirs = as_user(other, python, TRY_READ, json.dumps(paths))
                readable = [p for p, v in theirs.items() if v != "PermissionError"]
                assert not readable, f"{other.name} could read {owner.name}'s: {readable}"
                for path in found[owner.name]["controller connection files"]:
                    assert os.stat(path).st_mode & 0o077 == 0, path
                # no secret of the owner on any command line on the machine (`ps` shows them to all)
                # (the signing key is in the ipcontroller-*-client/engine files; cluster-*.json has none)
                infos = [json.loads(Path(f).read_text()) for f in found[owner.name]["controller connection files"]]
                keys = {info["key"] for info in infos if info.get("key")}
                assert keys, f"no signing key in {owner.name}'s connection files"
                environ = Path(found[owner.name]["server's environment (its hub token)"][0]).read_text()
                token = dict(kv.split("=", 1) for kv in environ.split("\0") if "=" in kv)["JUPYTERHUB_API_TOKEN"]
                for proc in psutil.process_iter(["cmdline"]):
                    line = " ".join(proc.info["cmdline"] or [])
                    assert token not in line and not any(k in line for k in keys), \
                        f"a secret of {owner.name} on: {line[:200]}"

            # -- neither can drive the other's ranks: a real client with a guessed key gets nowhere ---
            # Ports are no secret (/proc/net/tcp shows them to everyone); the key in the 0600 file is.
            attempts = {}
            for owner, other in ((ada, bob), (bob, ada)):
                client_file = next(p for p in found[owner.name]["controller connection files"] if "client" in p)
                info = json.loads(Path(client_file).read_text())
                forged = other.home / f"forged-{owner.name}.json"
                forged.write_text(json.dumps({**info, "key": secrets.token_hex(16)}))
                shutil.chown(forged, other.name)
                forged.chmod(0o600)
                attempts[(owner.name, "owner")] = subprocess.Popen(
                    [RUNUSER, "-u", owner.name, "--", str(python), "-c", TRY_CLIENT, client_file, "30"],
                    stdout=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": str(owner.home)})
                attempts[(owner.name, "other")] = subprocess.Popen(
                    [RUNUSER, "-u", other.name, "--", str(python), "-c", TRY_CLIENT, str(forged), "10"],
                    stdout=subprocess.PIPE, text=True, cwd="/", env={"PATH": "/usr/bin:/bin", "HOME": str(other.home)})
            results = {k: json.loads(a.communicate(timeout=120)[0].strip().splitlines()[-1])
                       for k, a in attempts.items()}
            for owner in (ada, bob):
                mine, theirs = results[(owner.name, "owner")], results[(owner.name, "other")]
                assert mine == {"connected": True, "engine_uids": [owner.uid] * 4}, mine
                assert not theirs["connected"] and "timed out" in theirs["error"], theirs

            # -- through the hub, one learner cannot open the other's server ------------------------
            for owner, other in ((ada, bob), (bob, ada)):
                url = f"{hub.url}/user/{owner.name}/api/contents/notebooks"  # JupyterLab's root: the workspace
                mine = pages[owner.name].context.request.get(url)
                assert mine.status == 200 and any(i["name"].endswith(".ipynb") for i in mine.json()["content"])
                theirs = pages[other.name].context.request.get(url)
                assert theirs.status == 403, (theirs.status, theirs.text()[:300])
            times["isolation checked"] = time.monotonic() - t0

            # -- bob runs the notebook's last cell (hpdl.stop()), then leaves: his server goes idle ---
            page = pages[bob.name]
            stop_cell = page.locator(".jp-NotebookPanel .jp-CodeCell").last
            stop_cell.locator(".jp-InputPrompt").click()
            page.keyboard.press("Shift+Enter")
            expect(stop_cell.locator(".jp-OutputArea-output")).to_contain_text("hpdl: stopped 4 ranks", timeout=120_000)
            wait_for(lambda: not [p for p in user_processes(bob.uid) if "ipyparallel.engine" in " ".join(p.cmdline())],
                     30, "bob's ranks did not end after hpdl.stop()")
            assert squeue_user(bob.name) == f"{jobs[bob.name]} RUNNING"  # his JupyterLab still runs
            page.context.close()
            bob_left = time.monotonic()

            # -- an instructor sees everyone's servers, cannot open ada's, and stops it: her job, ------
            # -- JupyterLab, kernel and ranks all end --------------------------------------------------
            assert [p for p in user_processes(ada.uid) if "ipyparallel.engine" in " ".join(p.cmdline())]
            ivy = learners[INSTRUCTOR]
            pages[ivy.name] = browser.new_context(ignore_https_errors=True).new_page()
            instructor_lists_and_stops_but_cannot_enter(pages[ivy.name], hub, ivy, ada)
            wait_for(lambda: not hub.servers(ada.name), 120, "ada's server was not stopped")
            wait_for(lambda: squeue_user(ada.name) == "", 60, f"ada's job {jobs[ada.name]} did not end")
            nothing_left_of(ada, "her server was stopped")
            times["ada's server stopped"] = time.monotonic() - t0

            # -- the idle culler stops bob's server ---------------------------------------------------
            wait_for(lambda: not hub.servers(bob.name), IDLE_TIMEOUT + 4 * CULL_EVERY + 120,
                     "the idle culler did not stop bob's server")
            culled_after = time.monotonic() - bob_left
            culler_log = (hub.log_dir / "idle-culler.log").read_text()  # the culler logs in the hub's log folder
            assert re.search(rf"[Cc]ulling server {bob.name}\b", culler_log), "not culled by the idle culler"
            wait_for(lambda: squeue_user(bob.name) == "", 60, f"bob's job {jobs[bob.name]} did not end")
            nothing_left_of(bob, "the culler stopped his server")
            times["bob's server culled"] = time.monotonic() - t0
            # nobody was culled while working: ada's server was stopped by the API, not the culler
            assert not re.search(rf"[Cc]ulling server {ada.name}\b", culler_log)
            assert f"JupyterHub is now running at {hub.url}" in (hub.log_dir / "jupyterhub.log").read_text()
            # nothing in the kit changed, nothing in it is a learner's
            kit_after = kit_files()
            changed = sorted(k for k in kit_before.keys() | kit_after.keys() if kit_before.get(k) != kit_after.get(k))
            assert not changed, f"the kit changed while learners worked: {changed[:20]}"
        finally:
            for page in pages.values():
                try:
                    page.screenshot(path=str(tmp_path / f"{page.url.split('/user/')[-1].split('/')[0]}.png"))
                except Exception as exc:  # a closed page has nothing to show
                    print(f"no screenshot: {exc}")
            browser.close()
    print("hub test timeline (s from the first page):", {k: round(v, 1) for k, v in times.items()},
          f"bob culled {culled_after:.0f} s after he left (idle timeout {IDLE_TIMEOUT} s)")


# -- the configuration, without a hub (cheap; part of `make test`) ----------------------------------
def load_hub_config(monkeypatch, tmp_path, **env: str):
    """jupyterhub_config.py as JupyterHub loads it (get_config(), then the file's statements)."""
    from traitlets.config import Config

    tls = tmp_path / "tls"
    tls.mkdir(exist_ok=True)
    for name in ("hub.crt", "hub.key"):
        (tls / name).touch(mode=0o600)
    defaults = {"HPDL_HUB_STATE": str(tmp_path / "state"), "HPDL_HUB_LOG_DIR": str(tmp_path / "log"),
                "HPDL_HUB_SSL_CERT": str(tls / "hub.crt"), "HPDL_HUB_SSL_KEY": str(tls / "hub.key"),
                "HPDL_HUB_API_IP": "127.0.0.1"}
    for name, value in {**defaults, **env}.items():
        monkeypatch.setenv(name, value)  # "" unsets a setting
    config = Config()
    path = HUB_DIR / "jupyterhub_config.py"
    exec(compile(path.read_text(), str(path), "exec"),
         {"get_config": lambda: config, "__file__": str(path), "load_subconfig": lambda f: None})
    return config


def render_batch_script(config, **req: str) -> str:
    """singleuser.sbatch as batchspawner fills it: Jinja, the spawner's req_* values by short name."""
    import jinja2

    s = config.SlurmSpawner
    values = {"nprocs": s.req_nprocs, "runtime": s.req_runtime, "partition": s.req_partition,
              "account": s.req_account, "qos": s.req_qos, "options": s.req_options, "prologue": s.req_prologue,
              "reservation": s.req_reservation, "gres": "", "homedir": "/home/ada", "username": "ada",
              "keepvars": "PATH,LANG,JUPYTERHUB_API_TOKEN,HOME,USER,SHELL",
              "cmd": " ".join([s.batchspawner_singleuser_cmd, *s.cmd]), **req}
    return jinja2.Template(s.batch_script).render(**values)


def sbatch_options(script: str) -> list[str]:
    """The options of a job script's #SBATCH lines, one or more a line, as sbatch reads them."""
    return [o for line in re.findall(r"^#SBATCH (.*)$", script, re.M) for o in shlex.split(line)]


def test_hub_configuration_renders_a_job_that_runs_lab_in_the_batch_step(monkeypatch, tmp_path):
    config = load_hub_config(monkeypatch, tmp_path, HPDL_HUB_RANKS="8", HPDL_HUB_PARTITION="gpu",
                             HPDL_HUB_MODULES="mvapich2-gdr/2.3.7", HPDL_HUB_IDLE_TIMEOUT="1800",
                             HPDL_SITE="mvapich2-gdr")
    script = render_batch_script(config)
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0, script
    assert "{{" not in script and "{%" not in script
    sbatch = sbatch_options(script)
    assert "--ntasks=8" in sbatch and "--partition=gpu" in sbatch and "--time=02:00:00" in sbatch
    assert not any(o.startswith(("--account", "--qos", "--gres")) for o in sbatch), sbatch  # only what is set
    # the job holds what its ranks' step asks for: the profile's resources per rank, its sbatch options
    for option in ("--ntasks-per-node=2", "--cpus-per-task=8", "--gpus-per-task=1", "--mem-per-cpu=4G"):
        assert option in sbatch, (option, sbatch)
    assert "module load mvapich2-gdr/2.3.7" in script and 'HPDL_SITE="mvapich2-gdr"' in script
    assert "--exclusive" not in sbatch  # GPU nodes shared by learners (the profile's learners_per_node)
    assert script.index("umask 077") < script.index("hpdl.cli exercises")  # before the job writes anything
    # JupyterLab runs in the batch step (no srun around it): its ranks' srun step gets the job's tasks
    assert script.rstrip().splitlines()[-1] == 'exec "$PY" -m batchspawner.singleuser jupyterhub-singleuser'
    assert config.SlurmSpawner.req_srun == ""
    assert "{username}" in config.SlurmSpawner.exec_prefix  # submitted as the learner
    # idle servers are culled by a hub service holding just the scopes it needs
    culler = next(s for s in config.JupyterHub.services if s["name"] == "idle-culler")
    assert culler["command"][1:3] == ["-m", "jupyterhub_idle_culler"] and "--timeout=1800" in culler["command"]
    role = next(r for r in config.JupyterHub.load_roles if r["name"] == "idle-culler")
    assert set(role["scopes"]) == {"list:users", "read:users:activity", "read:servers", "delete:servers"}
    # the hub learns of activity well inside the timeout
    assert config.JupyterHub.last_activity_interval <= 1800 // 4
    assert config.PAMAuthenticator.allowed_groups == {"hpdl-learners"}


def test_hub_job_follows_the_site_profile_and_its_overrides_reach_the_ranks(monkeypatch, tmp_path):
    """Without HPDL_HUB_* settings the job takes the profile's partition and time; an HPDL_SLURM_*
    override in the hub's environment changes the job and is exported to it, so the ranks' step
    (which loads the profile again inside the job) reads the same profile."""
    for name in ("HPDL_HUB_PARTITION", "HPDL_HUB_TIME", "HPDL_HUB_SBATCH"):
        monkeypatch.delenv(name, raising=False)
    config = load_hub_config(monkeypatch, tmp_path, HPDL_SITE="local-slurm", HPDL_SLURM_CPUS_PER_RANK="2",
                             HPDL_SLURM_SBATCH="--mem=0")
    script = render_batch_script(config)
    sbatch = sbatch_options(script)
    assert {"--ntasks=4", "--partition=debug", "--time=02:00:00", "--cpus-per-task=2", "--mem=0"} <= set(sbatch), sbatch
    exports = re.findall(r"^export (HPDL_SITE|HPDL_SLURM_\w+)=(.*)$", script, re.M)
    assert dict(exports) == {"HPDL_SITE": '"local-slurm"', "HPDL_SLURM_CPUS_PER_RANK": "2",
                             "HPDL_SLURM_SBATCH": "--mem=0"}, exports


def test_hub_refuses_an_open_network_and_instructors_cannot_act_as_learners(monkeypatch, tmp_path, capsys):
    """Before it starts, the hub refuses plain HTTP on an open address, an API on every interface and
    (as root) a file someone else could change, each time saying what to do; instructors get a role
    that lists and stops servers, never opens one; logs rotate in their folder; the reservation."""
    site = tmp_path / "site_config.py"
    site.write_text("")
    site.chmod(0o666)
    no_tls = {"HPDL_HUB_SSL_CERT": "", "HPDL_HUB_SSL_KEY": ""}
    refusals = [
        (no_tls, "no TLS: learners' passwords would cross the network in clear"),
        ({**no_tls, "HPDL_HUB_TLS_PROXY": "1", "HPDL_HUB_BIND_URL": "http://0.0.0.0:8000"}, "behind a TLS proxy"),
        ({"HPDL_HUB_SSL_CERT": ""}, "set both HPDL_HUB_SSL_CERT and HPDL_HUB_SSL_KEY"),
        ({"HPDL_HUB_API_IP": "0.0.0.0"}, "must not listen on every interface"),
        ({"HPDL_HUB_SSL_KEY": str(site)}, "is readable by everyone: `chmod o-r"),
    ]
    if os.geteuid() == 0:
        refusals.append(({"HPDL_HUB_SITE_CONFIG": str(site)}, f"{site} is writable by its group or everyone"))
    for env, said in refusals:
        with pytest.raises(SystemExit) as stopped:
            load_hub_config(monkeypatch, tmp_path, **env)
        err = capsys.readouterr().err
        assert stopped.value.code == 2 and err.startswith("hpdl hub: cannot start: ") and said in err, (env, err)
        for name in env:
            monkeypatch.delenv(name, raising=False)
    # behind a declared TLS proxy: plain HTTP, on this host only
    config = load_hub_config(monkeypatch, tmp_path, **no_tls, HPDL_HUB_TLS_PROXY="1")
    assert config.JupyterHub.bind_url == "http://127.0.0.1:8000" and not config.JupyterHub.get("ssl_cert")
    monkeypatch.delenv("HPDL_HUB_TLS_PROXY")
    config = load_hub_config(monkeypatch, tmp_path, HPDL_HUB_API_IP="10.1.0.5", HPDL_HUB_CONNECT_HOST="login1",
                             HPDL_HUB_INSTRUCTORS="ivy, joe", HPDL_HUB_RESERVATION="workshop")
    assert config.JupyterHub.bind_url == "https://:443" and config.JupyterHub.ssl_cert.endswith("hub.crt")
    assert (config.JupyterHub.hub_bind_url, config.JupyterHub.hub_connect_url) == \
        ("http://10.1.0.5:8081", "http://login1:8081")
    roles = {r["name"]: set(r["scopes"]) for r in config.JupyterHub.load_roles}
    assert roles["user"] == {"self"}
    assert {"admin-ui", "list:users", "read:servers", "delete:servers"} <= roles["instructor"]
    assert not roles["instructor"] & {"access:servers", "admin:servers", "servers", "admin:users", "users", "tokens"}
    assert config.JupyterHub.load_groups == {"instructors": {"users": ["ivy", "joe"]}}
    assert config.Authenticator.admin_users == set() and config.Authenticator.allowed_users == {"ivy", "joe"}
    assert "--reservation=workshop" in sbatch_options(render_batch_script(config))
    # the hub's log and the culler's, each rotated, in the log folder
    handler = config.JupyterHub.logging_config["handlers"]["file"]
    assert handler["filename"] == str(tmp_path / "log" / "jupyterhub.log") and handler["maxBytes"] > 0
    assert "file" in config.JupyterHub.logging_config["loggers"]["JupyterHub"]["handlers"] and handler["backupCount"]
    culler = next(s for s in config.JupyterHub.services if s["name"] == "idle-culler")
    culler_config = Path(next(a for a in culler["command"] if a.startswith("--config=")).split("=", 1)[1])
    assert str(tmp_path / "log" / "idle-culler.log") in culler_config.read_text()
    assert culler["cwd"] == str(tmp_path / "state")  # the culler reads ./idle_culler_config.py: never a shared folder
