"""The Open OnDemand app (cluster/ood/hpdl-jupyter) rendered with Ruby's real ERB and run as a job.

OnDemand renders the app's ERB templates with the learner's form values, copies template/ into
a session folder keeping each file's mode, and submits a job that sources before.sh, runs
./script.sh and writes connection.yml (host, port, password) for the "Open" button (view.html.erb).
Here Debian's `ruby` renders the templates, a small stand-in for OnDemand's job wrapper does the
rest on the local Slurm, and the button's POST is replayed against the JupyterLab it started.

    flock /tmp/hpdl-mpi.lock .venv/bin/python -m pytest tests/test_ood.py -q
"""
from __future__ import annotations

import html
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from http.cookiejar import CookieJar
from pathlib import Path

import psutil
import pytest
import yaml
from test_slurm import outside_slurm, slurm  # noqa: F401  (the local Slurm and a login-node environment)

ROOT = Path(__file__).resolve().parents[1]
APP = ROOT / "cluster" / "ood" / "hpdl-jupyter"
RENDER = ROOT / "tests" / "fixtures" / "render_erb.rb"

FORMS = [
    {"ranks": "4", "gpus_per_rank": "0", "cpus_per_rank": "2", "reservation": "", "modules": "",
     "hpdl_site": "generic", "hpdl_dir": "/shared/courses/hpdl"},
    {"ranks": "2", "gpus_per_rank": "1", "cpus_per_rank": "12", "reservation": "hpdl-course",
     "modules": "cuda/13.0 nccl/2.29", "hpdl_site": "nccl-gpu", "hpdl_dir": "~/courses/hpdl"},
    {"ranks": "8", "gpus_per_rank": "1", "cpus_per_rank": "8", "reservation": " gdr_day1 ",
     "modules": "mvapich2-gdr/2.3.7", "hpdl_site": "mvapich2-gdr", "hpdl_dir": "/shared/courses/hpdl"},
    {"ranks": "", "gpus_per_rank": "", "cpus_per_rank": "", "reservation": "x; rm -rf ~", "modules": "  ",
     "hpdl_site": "generic", "hpdl_dir": "$HOME/hpdl"},
]


def render(template: str, tmp_path: Path, form: dict, **locals_: str) -> str:
    if not shutil.which("ruby"):
        pytest.skip("Debian's ruby is not installed (apt-get install ruby)")
    vars_file = tmp_path / "vars.json"
    vars_file.write_text(json.dumps({"context": form, "locals": locals_}))
    p = subprocess.run(["ruby", str(RENDER), str(APP / template), str(vars_file)],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stdout


def test_script_template_is_committed_executable():
    staged = subprocess.run(["git", "ls-files", "-s", "cluster/ood/hpdl-jupyter/template/script.sh.erb"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert staged.startswith("100755"), staged  # OnDemand copies the mode and runs ./script.sh
    assert os.access(APP / "template" / "script.sh.erb", os.X_OK)


@pytest.mark.parametrize("form", FORMS, ids=["cpu", "nccl", "gdr", "empty"])
def test_templates_render_for_form_values(form, tmp_path):
    submit = yaml.safe_load(render("submit.yml.erb", tmp_path, form))
    native = submit["script"]["native"]
    assert native[0] == f"--ntasks={form['ranks'] or 4}"
    assert ("--gpus-per-task=1" in native) == (form["gpus_per_rank"] == "1")
    assert (f"--cpus-per-task={form['cpus_per_rank']}" in native) == bool(form["cpus_per_rank"])
    reservation = [o for o in native if o.startswith("--reservation")]  # a name, or nothing at all
    named = form["reservation"].strip()
    assert reservation == ([f"--reservation={named}"] if named and " " not in named else [])

    script = render("template/script.sh.erb", tmp_path, form)
    assert script.startswith("#!/bin/bash -l\n")  # a login shell: `module` is defined
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0
    loads = re.findall(r"^module load (.*)$", script, re.M)
    assert loads == ([form["modules"]] if form["modules"].strip() else [])
    assert f'HPDL_SITE="{form["hpdl_site"]}"' in script
    assert 'root_dir="$HPDL_WORKSPACE"' in script and "hpdl.cli exercises --where" in script  # never the kit
    code = "\n".join(line for line in script.splitlines() if not line.lstrip().startswith("#"))
    assert "token" not in code.lower() and "password" not in code  # no secret on the command line

    before = render("template/before.sh.erb", tmp_path, form)
    assert "umask 077" in before and "c.IdentityProvider.token" in before
    assert subprocess.run(["bash", "-n"], input=before, text=True).returncode == 0

    view = render("view.html.erb", tmp_path, form, host="node07", port="8123", password="s3cret")
    forms = re.findall(r'<form action="([^"]+)" method="(\w+)"', view)
    assert len(forms) == 1
    action, method = html.unescape(forms[0][0]), forms[0][1]
    assert method == "post" and "s3cret" not in action and "token" not in action
    assert action.startswith("/node/node07/8123/login?next=")
    assert '<input type="hidden" name="password" value="s3cret">' in view


def test_the_forms_site_choices_carry_each_profiles_cores_and_gpus_per_rank():
    """Choosing a profile fills in the cores and GPUs per rank the form sends: the profile's own."""
    from hpdl import sites

    form = yaml.safe_load((APP / "form.yml").read_text())["attributes"]
    assert form["hpdl_dir"]["value"] != "$HOME/hpdl"  # a shared kit, not a private copy per learner
    choices = form["hpdl_site"]["options"]
    assert {c[1] for c in choices} == {"generic", "mvapich2-gdr", "nccl-gpu"}
    for label, name, *data in choices:
        given = {k: v for d in data for k, v in d.items()}
        site = sites.load_site(name)
        assert given == {"data-set-cpus-per-rank": site.cpus_per_rank,
                         "data-set-gpus-per-rank": site.gpus_per_rank}, (name, given)
    generic = sites.load_site("generic")
    assert (form["cpus_per_rank"]["value"], form["gpus_per_rank"]["value"]) == (generic.cpus_per_rank,
                                                                                   generic.gpus_per_rank)


# -- as a job on the local Slurm --------------------------------------------------------------

# A stand-in for OnDemand's job wrapper ("basic" template): its helpers, then before.sh, the
# connection file, and script.sh in the foreground. As root (this test machine) JupyterLab also
# needs allow_root, which no learner's session has.
WRAPPER = r"""#!/bin/bash
set -e
find_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
create_passwd() { python3 -c 'import secrets, sys; n = int(sys.argv[1]); print(secrets.token_urlsafe(n)[:n])' "$1"; }
host=$(hostname)
source ./before.sh
if [ "$(id -u)" = 0 ]; then echo "c.ServerApp.allow_root = True" >> "$HPDL_JUPYTER_CONFIG"; fi
(umask 077; printf 'host: %s\nport: %s\npassword: %s\n' "$host" "$port" "$password" > connection.yml)
./script.sh > output.log 2>&1
"""


def _stage(tmp_path: Path, form: dict) -> Path:
    """The session folder as OnDemand stages it: rendered templates with the templates' modes."""
    session = tmp_path / "session"
    session.mkdir()
    for name in ("before.sh", "script.sh"):
        src = APP / "template" / f"{name}.erb"
        dst = session / name
        dst.write_text(render(f"template/{name}.erb", tmp_path, form))
        dst.chmod(stat.S_IMODE(src.stat().st_mode))
    (session / "job.sh").write_text(WRAPPER)
    return session


@pytest.mark.slurm
@pytest.mark.slow
@pytest.mark.usefixtures("slurm", "outside_slurm")
def test_app_runs_as_a_slurm_job_and_serves_jupyterlab_with_a_posted_password(tmp_path, no_strays):
    form = {"ranks": "2", "gpus_per_rank": "0", "cpus_per_rank": "1", "reservation": "", "modules": "",
            "hpdl_site": "generic", "hpdl_dir": str(ROOT)}
    session = _stage(tmp_path, form)
    native = yaml.safe_load(render("submit.yml.erb", tmp_path, form))["script"]["native"]
    ws = tmp_path / "ws"
    env = {**os.environ, "HPDL_PYTHON": sys.executable, "HPDL_WORKSPACE": str(ws)}
    p = subprocess.run(["sbatch", "--parsable", f"--chdir={session}", "-o", "job.out", *native, "job.sh"],
                       capture_output=True, text=True, cwd=session, timeout=60, env=env)
    assert p.returncode == 0, p.stderr
    job = p.stdout.strip().split(";")[0]
    conn = session / "connection.yml"
    try:
        wait_until(conn.exists, 120, "the job wrote no connection.yml", job, session)
        c = yaml.safe_load(conn.read_text())
        host, port, password = c["host"], int(c["port"]), str(c["password"])
        config = session / "jupyter_server_config.py"
        assert stat.S_IMODE(config.stat().st_mode) == 0o600 and password in config.read_text()

        view = render("view.html.erb", tmp_path, form, host=host, port=str(port), password=password)
        action = html.unescape(re.search(r'<form action="([^"]+)" method="post"', view).group(1))
        field = re.search(r'name="password" value="([^"]+)"', view).group(1)

        def ready():
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/node/{host}/{port}/api", timeout=5).close()
                return True
            except urllib.error.HTTPError:
                return True
            except OSError:
                return False

        wait_until(ready, 180, "JupyterLab did not answer", job, session)
        # the password is on no command line of the job's processes
        for proc in psutil.process_iter(["cmdline"]):
            try:
                if proc.environ().get("SLURM_JOB_ID") == job:
                    assert password not in " ".join(proc.info["cmdline"] or []), proc.info["cmdline"]
            except psutil.Error:
                continue
        out = (session / "output.log").read_text()
        assert "hpdl: job %s, 2 tasks" % job in out and "site profile generic" in out

        # the button: POST the password to /login, follow to the lesson with the cookie it earned
        jar = CookieJar()
        opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
        body = urllib.parse.urlencode({"password": field}).encode()
        with opener.open(f"http://127.0.0.1:{port}{action}", data=body, timeout=30) as r:
            assert r.status == 200 and r.geturl().endswith("/lab/tree/notebooks/00_welcome.ipynb")
        with opener.open(f"http://127.0.0.1:{port}/node/{host}/{port}/api/contents/notebooks", timeout=30) as r:
            names = {i["name"] for i in json.loads(r.read())["content"]}
        assert "00_welcome.ipynb" in names and (ws / "notebooks" / "00_welcome.ipynb").is_file()  # the workspace
        assert (ws / "exercises").is_dir() and stat.S_IMODE(ws.stat().st_mode) == 0o700
        # a wrong password, or none, gets nothing
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(f"http://127.0.0.1:{port}/node/{host}/{port}/api/contents", timeout=10)
        bad = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
        with pytest.raises(urllib.error.HTTPError) as denied:
            bad.open(f"http://127.0.0.1:{port}{action}", data=b"password=wrong", timeout=30)
        assert denied.value.code == 401
    finally:
        subprocess.run(["scancel", job], timeout=30)
        wait_until(lambda: squeue(job) == "", 60, f"job {job} did not end", job, session)


def squeue(job: str) -> str:
    return subprocess.run(["squeue", "-h", "-j", job, "-o", "%i"], capture_output=True, text=True,
                          timeout=30).stdout.strip()


def wait_until(predicate, timeout: float, what: str, job: str, session: Path):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    logs = "".join(f"\n--- {f.name}\n{f.read_text()[-2000:]}" for f in (session / "job.out", session / "output.log")
                   if f.exists())
    raise AssertionError(f"{what} within {timeout:.0f} s (job {job}){logs}")
