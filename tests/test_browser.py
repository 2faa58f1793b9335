"""JupyterLab as a learner meets it: `make lab` serves the notebooks, and a real browser runs
notebook 00 and shows every rank's output.

The browser is Debian's Chromium, headless, driven by Playwright (never `playwright install`:
its own browser download does not work everywhere). Each test starts its own JupyterLab on a
free port with a token it chooses, settings and workspaces in a temporary folder, and stops it
and its kernels at the end; `no_strays` fails the test if anything is left running.
"""
from __future__ import annotations

import json
import os
import pty
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import psutil
import pytest
from conftest import kit_processes

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NOTEBOOK = "notebooks/00_welcome.ipynb"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
SERVE_TIMEOUT = 120  # s until JupyterLab answers; it takes a few seconds when the cores are free
RUN_TIMEOUT = 480  # s for notebook 00 to reach its agreement line (4 ranks with Horovod on 2 cores)
STOP_TIMEOUT = 60  # s for JupyterLab to shut down with its kernels

# Requests to our own server must never go through a proxy from the environment.
_LOCAL = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# -- a JupyterLab of our own ---------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, token: str | None = None, method: str = "GET", timeout: float = 10) -> tuple[int, bytes]:
    """(status, body) of one request; HTTP errors are answers too, not exceptions."""
    req = urllib.request.Request(url, method=method)
    if token:
        req.add_header("Authorization", f"token {token}")
    try:
        with _LOCAL.open(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def lab_env(tmp: Path) -> dict[str, str]:
    """The server's (and so its kernels') environment: the venv's tools first, as `make lab`
    sets them, and every piece of Jupyter/IPython user state in `tmp`, so none leaks in or out."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["JUPYTER_CONFIG_DIR"] = str(tmp / "jupyter-config")
    env["JUPYTER_RUNTIME_DIR"] = str(tmp / "jupyter-runtime")
    env["IPYTHONDIR"] = str(tmp / "ipython")
    env["HPDL_WORKSPACE"] = str(tmp / "workspace")  # `hpdl exercises` in notebook 00 writes here
    env["PYTHONUNBUFFERED"] = "1"
    return env


def lab_settings(tmp: Path) -> list[str]:
    """Lab flags for a fresh user: settings, workspaces and checkpoints in `tmp`. Autosave is off so running
    notebook 00 never writes its outputs into the repository. (No news and no update check: the kit's own
    default, cluster/build/jupyterlab-overrides.json installed in the venv, which the test checks.)"""
    settings, workspaces = tmp / "lab-settings", tmp / "lab-workspaces"
    path = settings / "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"autosave": False}))
    workspaces.mkdir(parents=True, exist_ok=True)
    return [
        f"--LabApp.user_settings_dir={settings}",
        f"--LabApp.workspaces_dir={workspaces}",
        # opening a notebook makes a checkpoint of it: keep that out of the repository too
        f"--FileCheckpoints.checkpoint_dir={tmp / 'checkpoints'}",
    ]


def as_root() -> list[str]:
    """Jupyter refuses to run as root without --allow-root (containers and CI often are root)."""
    return ["--allow-root"] if os.geteuid() == 0 else []


def log_tail(log: Path, chars: int = 3000) -> str:
    try:
        return log.read_text(errors="replace")[-chars:]
    except OSError:
        return "(no log)"


def wait_until_served(proc: subprocess.Popen, base: str, token: str, log: Path,
                      timeout: float = SERVE_TIMEOUT) -> float:
    """Seconds until GET /lab with the token answers 200; fails saying what was not seen."""
    t0 = time.monotonic()
    last = "no answer"
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with code {proc.returncode} before serving {base}/lab; "
                        f"its log ends:\n{log_tail(log)}")
        try:
            status, _ = http(f"{base}/lab?token={token}", timeout=5)
            if status == 200:
                return time.monotonic() - t0
            last = f"HTTP {status}"
        except (urllib.error.URLError, OSError) as e:
            last = str(e)
        time.sleep(0.25)
    pytest.fail(f"JupyterLab did not serve {base}/lab with its token within {timeout} s (last: {last}); "
                f"its log ends:\n{log_tail(log)}")


def wait_for_log(log: Path, words: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if words in log.read_text(errors="replace"):
            return True
        time.sleep(0.1)
    return False


def family(proc: subprocess.Popen) -> list[psutil.Process]:
    """The process and everything it started that is still a descendant."""
    try:
        me = psutil.Process(proc.pid)
        return [me, *me.children(recursive=True)]
    except psutil.Error:
        return []


def still_running(procs: list[psutil.Process]) -> list[psutil.Process]:
    alive = []
    for p in procs:
        try:
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
        except psutil.Error:
            pass
    return alive


def cmdline(p: psutil.Process) -> str:
    try:
        return " ".join(p.cmdline())
    except psutil.Error:
        return ""


def describe(procs: list[psutil.Process]) -> list[str]:
    return [f"{p.pid}: {cmdline(p)[:200]}" for p in still_running(procs)]


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    deadline = time.monotonic() + timeout
    while (alive := still_running(procs)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def kill_all(procs: list[psutil.Process]) -> None:
    """Last resort after a failed shutdown, so one failing test does not leave work running."""
    for p in still_running(procs):
        try:
            p.kill()
        except psutil.Error:
            pass


# -- the browser ---------------------------------------------------------------------------
def chromium_or_skip() -> str:
    """Debian's Chromium; installed with apt-get when missing and we may, else a clear skip."""
    if os.access(CHROMIUM, os.X_OK):
        return CHROMIUM
    why = f"{CHROMIUM} not found"
    if shutil.which("apt-get") and os.geteuid() == 0:
        try:
            p = subprocess.run(
                "apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium",
                shell=True, capture_output=True, text=True, timeout=600,
            )
            why += f"; apt-get install chromium exited {p.returncode}: {(p.stdout + p.stderr)[-500:]}"
        except subprocess.TimeoutExpired:
            why += "; apt-get install chromium took more than 600 s"
        if os.access(CHROMIUM, os.X_OK):
            return CHROMIUM
    else:
        why += " and apt-get cannot install it here (needs root): apt-get install chromium"
    pytest.skip(f"no browser: {why}")


@pytest.fixture
def chromium() -> str:
    """The browser and its driver, checked before any server starts."""
    pytest.importorskip("playwright.sync_api", reason="Playwright for Python is not installed (pip install playwright)")
    return chromium_or_skip()


@pytest.fixture
def lab_root() -> Path:
    """The folder JupyterLab serves: the repository, as `make lab` does. A test module may
    override this fixture to serve a folder of its own (notebooks written for the test)."""
    return ROOT


@pytest.fixture
def lab(tmp_path, no_strays, lab_root):
    """JupyterLab started with `make lab`'s flags (no browser), serving `lab_root` (the repository)
    on a free port with our token. Yields (base_url, token, server process, log path); afterwards
    its kernels are shut down, then the server, and nothing it started may remain."""
    token, port = uuid.uuid4().hex, free_port()
    log = tmp_path / "jupyterlab.log"
    cmd = [
        str(BIN / "jupyter"), "lab",
        # the flags of `make lab`
        "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={port}", f"--ServerApp.root_dir={lab_root}",
        # ours: no browser of its own, our token, this port or fail, a fresh user
        "--no-browser", f"--IdentityProvider.token={token}", "--ServerApp.port_retries=0",
        *as_root(), *lab_settings(tmp_path),
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=lab_env(tmp_path), stdin=subprocess.DEVNULL,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    seen: list[psutil.Process] = []
    try:
        served = wait_until_served(proc, base, token, log)
        print(f"JupyterLab served in {served:.1f} s")
        yield base, token, proc, log
        seen = family(proc)
    finally:
        seen = seen or family(proc)
        if proc.poll() is None:
            # kernels first, politely (each runs its exit handlers, which stop its ranks) ...
            try:
                status, body = http(f"{base}/api/kernels", token)
                for k in json.loads(body) if status == 200 else []:
                    http(f"{base}/api/kernels/{k['id']}", token, method="DELETE", timeout=STOP_TIMEOUT)
            except (urllib.error.URLError, OSError, ValueError):
                pass
            # ... then the server, as `kill` would
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                pass
        left = wait_gone(seen, 15)
        kill_all(seen)
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert not left, f"left running after JupyterLab shut down: {describe(left)}"


# -- the tests -----------------------------------------------------------------------------
def test_make_lab_serves_the_notebooks_and_stops_on_ctrl_c(tmp_path, no_strays):
    """`make lab` (already installed) serves /lab with the token and lists notebook 00; Ctrl-C
    stops it together with its kernels."""
    token, port = uuid.uuid4().hex, free_port()
    lab_args = ["--no-browser", f"--IdentityProvider.token={token}", "--ServerApp.port_retries=0",
                *lab_settings(tmp_path)]
    cmd = ["make", "--no-print-directory", "lab", f"LAB_PORT={port}", "LAB_ARGS=" + shlex.join(lab_args)]
    log = tmp_path / "make-lab.log"
    base = f"http://127.0.0.1:{port}"
    notebook_before = (ROOT / NOTEBOOK).read_bytes()
    terminal, terminal_side = pty.openpty()  # stdin is a terminal, as when a learner types it
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=lab_env(tmp_path), stdin=terminal_side,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    os.close(terminal_side)
    seen: list[psutil.Process] = []
    try:
        served = wait_until_served(proc, base, token, log)
        print(f"make lab served /lab in {served:.1f} s (from `make` to HTTP 200)")

        # token auth is on: the API refuses a request without it
        assert http(f"{base}/api/contents/notebooks")[0] == 403
        status, body = http(f"{base}/api/contents/notebooks", token)
        assert status == 200, body[:300]
        listing = {item["path"]: item["type"] for item in json.loads(body)["content"]}
        assert listing.get(NOTEBOOK) == "notebook", sorted(listing)

        # a kernel, as opening a notebook starts one; Ctrl-C must take it down too
        status, body = http(f"{base}/api/kernels", token, method="POST", timeout=60)
        assert status == 201, body[:300]
        kernel_id = json.loads(body)["id"]
        deadline = time.monotonic() + 60
        kernel = []
        while not kernel and time.monotonic() < deadline:
            kernel = [p for p in family(proc)[1:] if kernel_id in cmdline(p)]
            time.sleep(0.2)
        assert kernel, f"no kernel process for kernel {kernel_id} under make lab: {describe(family(proc))}"
        seen = family(proc)

        # Ctrl-C in the terminal: SIGINT to the foreground process group (make, the shell, the
        # server; kernels run in sessions of their own). On a terminal Jupyter first asks
        # "Shut down this Jupyter server (y/[n])?" for 5 s; a second Ctrl-C in that time confirms.
        os.killpg(proc.pid, signal.SIGINT)
        asked = wait_for_log(log, "Jupyter server (y/[n])?", 10)
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            pytest.fail(f"make lab still running {STOP_TIMEOUT} s after two Ctrl-C; its log ends:\n{log_tail(log)}")
        assert asked, f"no confirmation asked after the first Ctrl-C; log ends:\n{log_tail(log)}"
        # the server itself shut its kernel down (so the kernel's exit handlers stop its ranks),
        # rather than the kernel noticing later that its parent had gone
        assert "Shutting down 1 kernel" in log.read_text(errors="replace"), log_tail(log)
        left = wait_gone(seen, 15)
        assert not left, f"left running after Ctrl-C on make lab: {describe(left)}\n{log_tail(log)}"
        assert (ROOT / NOTEBOOK).read_bytes() == notebook_before, f"make lab changed {NOTEBOOK}"
    finally:
        everything = seen or family(proc)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        kill_all(everything + family(proc))
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        os.close(terminal)
    print(f"make lab exited with code {proc.returncode} after Ctrl-C")


RANK_LINE = "rank {r} of 4 on "
ALLREDUCE_LINE = r"rank {r}: mpi4py 10\s+torch\.distributed 10\s+Horovod 10\b"
AGREEMENT = "all 4 ranks agree: 10 three times over"
ENGINE_WORDS = ("ipengine", "ipyparallel.engine", "ipyparallel.controller", "ipcontroller", "mpiexec",
                "hydra_pmi_proxy", "hpdl.reaper")


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_notebook_00_runs_in_a_real_browser(chromium, lab, tmp_path, record_property):
    """Open notebook 00 in JupyterLab in headless Chromium, Run All Cells, and read on the page
    each rank's line, each rank's three allreduce results and the agreement line; after the last
    cell (hpdl.stop()) no engine remains."""
    from playwright.sync_api import TimeoutError as PageTimeout, expect, sync_playwright

    base, token, server, log = lab
    # a learner is never asked "Would you like to get notified about official Jupyter news?"
    status, body = http(f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}")
    # the kit's overrides are the schema's defaults as the server serves them (JupyterLab's own: "none", ask)
    props = json.loads(body).get("schema", {}).get("properties", {}) if status == 200 else {}
    defaults = {k: props.get(k, {}).get("default") for k in ("fetchNews", "checkForUpdates")}
    assert defaults == {"fetchNews": "false", "checkForUpdates": False}, \
        f"JupyterLab's news prompt is on for learners (defaults: {defaults}); make setup installs the kit's overrides"
    notebook_before = (ROOT / NOTEBOOK).read_bytes()
    shot = tmp_path / "notebook-00.png"
    t0 = time.monotonic()
    with sync_playwright() as p:
        browser = p.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"),  # a fresh user-data dir
            executable_path=chromium,
            args=CHROMIUM_ARGS,
            headless=True,
            viewport={"width": 1400, "height": 1600},
        )
        page = browser.pages[0] if browser.pages else browser.new_page()
        page.set_default_timeout(60_000)
        outputs = page.locator(".jp-OutputArea-output")

        def see(locator, what: str, timeout_s: float) -> None:
            """Wait until `locator` is on the page; otherwise fail naming what was not seen."""
            try:
                expect(locator.first).to_be_attached(timeout=timeout_s * 1000)
                return
            except (AssertionError, PageTimeout):
                pass  # fail below, outside the handler, without Playwright's page dump
            try:
                page.screenshot(path=str(shot))
                texts = "\n".join(outputs.all_text_contents())[-3000:]
            except Exception as e:  # the page itself may be what broke
                texts = f"(page unreadable: {e})"
            pytest.fail(
                f"not seen within {timeout_s:.0f} s: {what}\nscreenshot: {shot}\n"
                f"outputs on the page:\n{texts or '(none)'}\nJupyterLab log ends:\n{log_tail(log)}"
            )

        try:
            page.goto(f"{base}/lab/tree/{NOTEBOOK}?token={token}", wait_until="domcontentloaded")
            cells = page.locator(".jp-NotebookPanel .jp-Cell")
            n_cells = len(json.loads(notebook_before)["cells"])
            see(cells.nth(n_cells - 1), f"the {n_cells} cells of {NOTEBOOK} in the notebook panel", 120)
            see(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']"),
                "the kernel idle, ready to run", 120)
            cells.first.click()  # the notebook has the focus, so the Run menu acts on it

            # Run → Run All Cells, as a learner does
            run_menu = page.locator("#jp-MainMenu .lm-MenuBar-item", has_text=re.compile(r"^Run$"))
            see(run_menu, "the Run menu in the menu bar", 30)
            run_menu.click()
            run_all = page.locator(
                "#jp-mainmenu-run .lm-Menu-item[data-command='runmenu:run-all']:not(.lm-mod-disabled)")
            see(run_all, "Run All Cells, enabled, in the Run menu", 30)
            run_all.click()

            see(outputs.filter(has_text=AGREEMENT), f"the agreement line {AGREEMENT!r}", RUN_TIMEOUT)
            last_prompt = page.locator(".jp-NotebookPanel .jp-CodeCell").last.locator(".jp-InputPrompt")
            see(last_prompt.filter(has_text=re.compile(r"\[\d+\]")), "the last cell (hpdl.stop()) finished", 120)
            ran_in = time.monotonic() - t0

            text = "\n".join(outputs.all_text_contents())
            for r in range(4):
                assert RANK_LINE.format(r=r) in text, f"rank {r} did not print its line; outputs:\n{text[-3000:]}"
                assert re.search(ALLREDUCE_LINE.format(r=r), text), \
                    f"rank {r}'s allreduce results wrong or missing; outputs:\n{text[-3000:]}"
            assert "rank 4 of" not in text
            for name in ("by_mpi", "by_torch", "by_horovod"):
                assert re.search(rf"{name}: \[10\.0, 10\.0, 10\.0, 10\.0\]", text), f"{name} not [10.0]*4 on the page"

            # what a learner sees: the outputs are visible, not just in the page's source
            for r in range(4):
                line = outputs.filter(has_text=RANK_LINE.format(r=r)).first
                line.scroll_into_view_if_needed()
                expect(line, f"rank {r}'s line is not visible").to_be_visible(timeout=10_000)
            agreement = outputs.filter(has_text=AGREEMENT).first
            agreement.scroll_into_view_if_needed()
            expect(agreement, "the agreement line is not visible").to_be_visible(timeout=10_000)
            page.screenshot(path=str(shot))
        finally:
            if not shot.exists():  # a failure above: show the page as it was
                try:
                    page.screenshot(path=str(shot))
                except Exception:
                    pass
            print(f"screenshot: {shot}")
            record_property("screenshot", str(shot))
            browser.close()

    print(f"notebook 00 in the browser: {ran_in:.1f} s from opening the page to the last cell done")

    # The notebook's last cell stopped the cluster: no engine, controller, launcher or reaper
    # remains, under the server or anywhere in this session (its kernel is still running now).
    engines = [q for q in family(server) + kit_processes() if any(w in cmdline(q) for w in ENGINE_WORDS)]
    assert not wait_gone(engines, 20), f"engines still running after hpdl.stop(): {describe(still_running(engines))}"
    assert (ROOT / NOTEBOOK).read_bytes() == notebook_before, f"running it in the browser changed {NOTEBOOK}"
