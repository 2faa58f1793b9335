"""The grading sandbox holds against a hostile class (issue 21, items 2-4).

Attack classes, each tried the way a submission would:
- reading the grader: its environment (a variable set only in the grader's shell), a 0600 file
  in its HOME (~/.ssh), wherever HOME and TMPDIR point;
- reading a neighbour: another submission's notebook in the batch's work folders (TMPDIR=/var/tmp);
- escaping the limits: a fork bomb and a memory bomb spread over many processes, each under the
  per-process limits, together over the total (one cgroup per submission);
- leaving the sandbox's rules: a nested user namespace (`unshare -U`), ptrace, mount;
- acting as the grader through a daemon: a Unix socket of the host's (read-only mounts do not stop connect());
- reading what only the grader may read beyond HOME (as root: /etc/shadow);
- grading without a sandbox that holds, or as root: refused, naming what is missing.
One hostile batch, graded with an honest solved notebook in it, covers the first four at once.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import nbformat
import pytest

from hpdl import grade
from conftest import example_kit
from hpdl.errors import HpdlError

SECRET = "grader-only-" + uuid.uuid4().hex  # in the grader's environment, never in a submission's
KEY = "-----BEGIN PRIVATE " + uuid.uuid4().hex  # the grader's ~/.ssh/id_rsa, 0600


def _sandbox():
    from hpdl.checker import sandbox

    return sandbox


def _plant_home(where: Path) -> Path:
    home = where / f"grader-home-{uuid.uuid4().hex[:8]}"
    (home / ".ssh").mkdir(parents=True, mode=0o700)
    key = home / ".ssh" / "id_rsa"
    key.write_text(KEY)
    key.chmod(0o600)
    return home


# -- the environment and the sandbox's rules, without a grading run -------------------------------

def test_the_environment_is_a_whitelist():
    from hpdl.checker import confine

    given = {"PATH": "/usr/bin", "LANG": "C.UTF-8", "LC_ALL": "C", "HPDL_GRADE": "1", "OMP_NUM_THREADS": "1",
             "OMPI_MCA_btl": "self", "PMI_RANK": "0", "MPI4PY_RC_THREADS": "0", "IPP_NONINTERACTIVE": "1",
             "JUPYTER_RUNTIME_DIR": "/w", "PYTHONUNBUFFERED": "1", "LD_LIBRARY_PATH": "/opt/mpi/lib",
             # the grader's own: secrets, agents, cloud credentials, its temporary folder
             "GITHUB_TOKEN": "t", "AWS_SECRET_ACCESS_KEY": "k", "SSH_AUTH_SOCK": "/run/agent", "PASSWORD": "p",
             "DBUS_SESSION_BUS_ADDRESS": "unix:path=/x", "TMPDIR": "/var/tmp", "LD_PRELOAD": "/x.so",
             "PYTHONSTARTUP": "/home/i/.pythonrc", "MY_SITE_SECRET": SECRET}
    kept = confine.environment(given)
    assert set(kept) == {"PATH", "LANG", "LC_ALL", "HPDL_GRADE", "OMP_NUM_THREADS", "OMPI_MCA_btl",
                         "MPI4PY_RC_THREADS", "IPP_NONINTERACTIVE", "JUPYTER_RUNTIME_DIR", "PYTHONUNBUFFERED",
                         "LD_LIBRARY_PATH"}
    assert SECRET not in json.dumps(kept)


def test_a_learners_check_job_is_not_told_where_the_graders_home_is(monkeypatch, tmp_path):
    """The whitelist keeps HOME (a notebook's kernel gets its own folder): a learner's check ranks printed the
    grader's. A learner's job gets its job folder; the reference's (trusted) keeps it."""
    from hpdl.checker import confine, jobs

    monkeypatch.setenv("HOME", "/home/instructor")
    learner = confine.environment(jobs._job_env(str(tmp_path), keys=False))
    assert learner["HOME"] == str(tmp_path) and "/home/instructor" not in json.dumps(learner)
    assert jobs._job_env(str(tmp_path))["HOME"] == "/home/instructor"


def test_a_sandboxed_command_sees_no_grader_secret_home_or_namespace(monkeypatch):
    """What every sandboxed process gets, graded notebook or learner check job alike: HOME
    hidden wherever it lives (here outside /home), TMPDIR hidden, the environment filtered, no
    nested user namespace, no ptrace, no fallocate, /tmp sized."""
    sandbox = _sandbox()
    if not sandbox.available():
        pytest.skip("bubblewrap does not work here")
    places = [Path("/var/lib"), Path("/var/tmp")]
    homes = [_plant_home(p) for p in places if os.access(p, os.W_OK)]
    try:
        monkeypatch.setenv("HOME", str(homes[0]))
        monkeypatch.setenv("MY_SITE_SECRET", SECRET)
        probe = ("import os, subprocess, ctypes\n"
                 "for h in " + repr([str(h) for h in homes]) + ":\n"
                 "    try: print(open(h + '/.ssh/id_rsa').read())\n"
                 "    except OSError as e: print('refused', type(e).__name__)\n"
                 "print(dict(os.environ))\n"
                 "print('unshare', subprocess.run(['unshare', '-U', 'true'], capture_output=True).returncode)\n"
                 "print('unshare-net', subprocess.run(['unshare', '-n', 'true'], capture_output=True).returncode)\n"
                 "libc = ctypes.CDLL(None, use_errno=True)\n"
                 "print('ptrace', libc.ptrace(16, 1, 0, 0), ctypes.get_errno())\n"
                 "print([l for l in open('/proc/self/status') if l.startswith('Seccomp:')])\n"
                 "st = os.statvfs('/tmp'); print('tmp bytes', st.f_blocks * st.f_frsize)\n"
                 "print('infiniband', os.path.exists('/dev/infiniband'))\n"
                 "fd = os.open('/tmp/space', os.O_CREAT | os.O_RDWR)\n"
                 "print('fallocate', libc.fallocate(fd, 0, 0, 2**20), ctypes.get_errno())\n"
                 "os.posix_fallocate(fd, 0, 2**20); print('written', os.fstat(fd).st_blocks * 512)\n")
        cmd = sandbox.wrap([sys.executable, "-c", probe])
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    finally:
        import shutil

        for h in homes:
            shutil.rmtree(h, ignore_errors=True)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert KEY not in text and text.count("refused") == len(homes)
    assert SECRET not in text and "MY_SITE_SECRET" not in text
    assert "unshare 0" not in text and "unshare-net 0" not in text  # nested user namespaces refused
    assert "ptrace -1 1" in text  # EPERM from the seccomp filter
    assert "'Seccomp:\\t2\\n'" in text
    assert "infiniband False" in text
    # no space reserved unwritten (25 GB in 65 ms passed the disk cap's readings); the C library writes it instead
    assert "fallocate -1 95" in text and "written 1048576" in text
    if "--size" in sandbox.features(sandbox.bwrap()):
        assert f"tmp bytes {sandbox.TMP_BYTES}" in text


SOCKET_PROBE = """import socket, sys
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        s.sendall(b"from the sandbox")
        print(path, "connected")
    except OSError as e:
        print(path, "refused", e.errno)
"""


def test_a_sandboxed_command_reaches_no_unix_socket_of_the_host(monkeypatch):
    """A read-only mount does not stop connect(), and the daemon behind a socket sees the grader's
    uid (a container engine, the system bus, munge, a screen session, slurmstepd). Listening
    sockets planted where daemons keep theirs: none is reached from inside, but a name service's
    (who is uid N?), which any user may ask and an LDAP site needs."""
    import socket
    import threading

    sandbox = _sandbox()
    if not sandbox.available() or not os.access("/run", os.W_OK):
        pytest.skip("needs bubblewrap, and root to plant daemons' sockets")
    tag = uuid.uuid4().hex[:8]
    folders = [Path(f"/run/hpdl-{tag}"), Path(f"/var/spool/hpdl-{tag}"), Path(f"/var/lib/hpdl-{tag}"),
               Path(f"/opt/hpdl-{tag}")]
    names = [f / "daemon.sock" for f in folders]
    nscd = Path("/run/nscd/socket")
    if not nscd.exists():  # a stand-in for a site's name service
        names.append(nscd)
    reached, listeners = [], []
    try:
        for path in names:
            path.parent.mkdir(exist_ok=True)
            s = socket.socket(socket.AF_UNIX)
            s.bind(str(path))
            s.listen()
            s.settimeout(0.2)
            listeners.append((path, s))
        monkeypatch.setattr(sandbox, "_covering", True)  # as `hpdl grade` does (cover_the_host)
        sandbox.host_covered.cache_clear()  # found once per process: these are new
        stop = threading.Event()

        def accept():
            while not stop.is_set():
                for path, s in listeners:
                    try:
                        c, _ = s.accept()
                        reached.append((str(path), c.recv(64)))
                    except OSError:
                        pass

        t = threading.Thread(target=accept, daemon=True)
        t.start()
        out = subprocess.run(sandbox.wrap([sys.executable, "-c", SOCKET_PROBE, *map(str, names)]),
                             capture_output=True, text=True, timeout=60)
        stop.set()
        t.join(5)
    finally:
        for path, s in listeners:
            s.close()
            path.unlink(missing_ok=True)
        for f in (*folders, *([nscd.parent] if nscd in names else [])):
            if f.is_dir() and not any(f.iterdir()):
                f.rmdir()
        # a daemon stopped since they were found, its socket gone: a sandbox still starts
        after = subprocess.run(sandbox.wrap(["true"]), capture_output=True, text=True, timeout=60)
        sandbox.host_covered.cache_clear()
    assert out.returncode == 0, out.stdout + out.stderr
    assert after.returncode == 0, after.stderr
    for path in names[:4]:
        assert f"{path} refused" in out.stdout, out.stdout
    assert [p for p, _ in reached if p != str(nscd)] == [], reached
    if nscd in names:
        assert f"{nscd} connected" in out.stdout and reached == [(str(nscd), b"from the sandbox")]


def test_a_sandboxed_command_reads_nothing_only_the_grader_may_read(monkeypatch):
    """Beyond HOME: files and folders in the system's trees that grant the grader's user what they
    grant nobody else (as root: /etc/shadow, host keys, a hub's secret environment), and the
    grader's own folder in a scratch tree at the root, are covered; what any user may read stays,
    and the kit and its Python are still there."""
    sandbox = _sandbox()
    if not sandbox.available() or not os.access("/etc", os.W_OK):
        pytest.skip("needs bubblewrap, and root to plant files in /etc and /var/lib")
    tag = uuid.uuid4().hex[:8]
    secret, public = f"/etc/hpdl-{tag}.key", f"/opt/hpdl-{tag}-public.txt"
    folder = Path(f"/var/lib/hpdl-{tag}")
    folder.mkdir(mode=0o700)
    (folder / "note.txt").write_text(SECRET + "-folder")  # 0644 itself, in a folder only the grader enters
    # a cluster's scratch tree at the root: the grader's own folder in it (0700), a shared one (0755)
    scratch = Path(f"/hpdl-scratch-{tag}")
    (scratch / "grader").mkdir(parents=True, mode=0o700)
    (scratch / "grader" / "roster.csv").write_text(SECRET + "-scratch")
    (scratch / "shared").mkdir(mode=0o755)
    (scratch / "shared" / "data.txt").write_text("shared data")
    Path(secret).write_text(SECRET + "-file")
    os.chmod(secret, 0o600)
    Path(public).write_text("anyone may read this")
    os.chmod(public, 0o644)
    shadow = Path("/etc/shadow").read_text().splitlines()[0] if os.geteuid() == 0 else None
    probe = ("import sys\nfor p in sys.argv[1:]:\n    try: print(p, repr(open(p).read()))\n"
             "    except OSError as e: print(p, 'refused', type(e).__name__)\n")
    try:
        monkeypatch.setattr(sandbox, "_covering", True)  # as `hpdl grade` does (cover_the_host)
        sandbox.host_covered.cache_clear()
        out = subprocess.run(sandbox.wrap([sys.executable, "-c", probe, secret, str(folder / "note.txt"), public,
                                           "/etc/shadow", str(scratch / "grader" / "roster.csv"),
                                           str(scratch / "shared" / "data.txt")]),
                             capture_output=True, text=True, timeout=60)
    finally:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(scratch, ignore_errors=True)
        Path(secret).unlink(missing_ok=True)
        Path(public).unlink(missing_ok=True)
        sandbox.host_covered.cache_clear()
    assert out.returncode == 0, out.stdout + out.stderr  # its Python (under /root here) still runs
    assert SECRET not in out.stdout, out.stdout
    assert f"{secret} refused" in out.stdout and f"{folder}/note.txt refused FileNotFoundError" in out.stdout
    assert f"{public} 'anyone may read this'" in out.stdout
    assert f"{scratch}/grader/roster.csv refused" in out.stdout and "'shared data'" in out.stdout
    if shadow:
        assert shadow not in out.stdout, out.stdout


def test_the_look_for_what_to_cover_stops_at_its_time_limit_and_says_so(monkeypatch):
    """A slow or hung network file system under the look must not stop grading: past COVER_SECONDS
    it keeps what it found, a sandbox still starts, and the report's header says the look stopped.
    A learner's own check (no cover_the_host) does not look at all."""
    sandbox = _sandbox()
    if not sandbox.available():
        pytest.skip("bubblewrap does not work here")
    sandbox.host_covered.cache_clear()
    assert sandbox.host_covered() == sandbox.Covered()  # not grading: nothing looked for
    monkeypatch.setattr(sandbox, "COVER_SECONDS", 0.0)
    monkeypatch.setattr(sandbox, "_covering", True)
    sandbox.host_covered.cache_clear()
    try:
        assert sandbox.host_covered().complete is False
        assert "the look stopped after 0 s" in sandbox.describe()
        assert subprocess.run(sandbox.wrap(["true"]), timeout=60).returncode == 0
        if os.geteuid() == 0:  # a budget /etc alone fits in: spent on /etc before a large /var or /opt
            monkeypatch.setattr(sandbox, "COVER_SECONDS", 60.0)
            monkeypatch.setattr(sandbox, "COVER_SCAN_ENTRIES", sum(1 + len(d) + len(f) for _, d, f in os.walk("/etc")))
            sandbox.host_covered.cache_clear()
            assert "/etc/shadow" in sandbox.host_covered().files
    finally:
        sandbox.host_covered.cache_clear()


def test_grading_covers_the_host_only_while_it_runs(tmp_path, monkeypatch):
    """`hpdl grade` turns the look on for its batch and off after, even when the batch fails (here
    its report folder cannot be made), so a learner's checks later in the same process skip it."""
    sandbox = _sandbox()
    example_kit(tmp_path / "kit", monkeypatch)
    (tmp_path / "subs").mkdir()
    nbformat.write(nbformat.v4.new_notebook(), tmp_path / "subs" / "a.ipynb")
    (tmp_path / "a_file").write_text("")
    with pytest.raises(OSError):
        grade.grade(tmp_path / "subs", tmp_path / "a_file" / "report", progress=False, allow_root=True,
                    no_sandbox=not sandbox.available())
    assert sandbox._covering is False


def test_one_total_cap_holds_processes_spread_over_many():
    """Each process under the per-process limits, together over the total: the cgroup stops them."""
    sandbox = _sandbox()
    if not sandbox.cgroup_works():
        pytest.skip("no writable cgroup with the pids and memory controllers here")
    from hpdl import sidejob

    limits = sandbox.Limits(processes=40, memory_total=256 * 2**20)
    bomb = ("import os, time\n"
            "n = 0\n"
            "try:\n"
            "    for _ in range(200):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(5); os._exit(0)\n"
            "        n += 1\n"
            "except OSError:\n"
            "    pass\n"
            "print('forked', n, flush=True)\n"
            "hold = [b'x' * (64 * 2**20) for _ in range(8)]\n"
            "print('held 512 MiB', flush=True)\n")
    job = sidejob.SideJob([sys.executable, "-c", bomb], timeout=60, limits=limits)
    try:
        assert limits.applied() | {"cpu": None} == {"memory": 256 * 2**20, "tasks": 40, "cpu": None}
        job.wait()
    finally:
        job.end(now=True)
    text = job.output_text()
    forked = int(text.split("forked ")[1].split()[0])
    assert forked < 40, text
    assert "held 512 MiB" not in text and job.returncode != 0, text  # killed at the memory cap


SPREAD = """import os, sys, time
kids = []
for _ in range(12):
    pid = os.fork()
    if pid == 0:
        os.setsid()  # a session of its own: the kernel's autogroup would give it a share of its own
        time.sleep(30)
        os._exit(0)
    kids.append(pid)
print(*kids, flush=True)
time.sleep(30)
"""


def _cpu_cgroup(pid: int) -> str:
    for line in open(f"/proc/{pid}/cgroup"):
        _, ctls, path = line.rstrip("\n").split(":", 2)
        if "cpu" in ctls.split(",") or ctls == "":
            return path
    return ""


def test_a_submission_of_many_processes_weighs_on_the_cpu_as_one(tmp_path):
    """A neighbour's hundred busy children, each in a session of its own, slowed an honest notebook graded
    beside it about tenfold: the kernel weighed each session (autogroup) as much as the honest one. Each
    sandboxed job's processes now sit in one cgroup of the cpu controller, whatever sessions they make, with
    the same weight as every other job's, and a job inside a check's shares the check's weight."""
    sandbox = _sandbox()
    probe = sandbox.Cgroup.make(64, 2**30)
    if probe is None:
        pytest.skip("no writable cgroup here")
    probe.remove()
    if not any(sandbox.SHARE in opts for _, _, opts in sandbox._mounts()) and not os.path.exists(
            "/sys/fs/cgroup/cgroup.controllers"):
        pytest.skip("no cpu controller on this host")
    from hpdl import sidejob

    check = sandbox.Cgroup.make(200, 2**30)
    limits = sandbox.Limits(processes=40, memory_total=2**30)
    inner = sandbox.Limits(processes=40, memory_total=2**30, within=check)
    jobs = [sidejob.SideJob([sys.executable, "-c", SPREAD], timeout=60, limits=lim) for lim in (limits, inner)]
    try:
        kids = [[int(p) for p in _first_line(job).split()] for job in jobs]
        assert limits.applied()["cpu"] == inner.applied()["cpu"] == check.share() is not None
        for job, lim, own in zip(jobs, (limits, inner), kids):
            where = {_cpu_cgroup(p) for p in own + [job.proc.pid]}
            assert len(where) == 1 and lim.cgroup.dirs["cpu"].endswith(where.pop()), lim.cgroup.dirs
        assert inner.cgroup.dirs["cpu"].startswith(check.dirs["cpu"] + os.sep)
        assert _cpu_cgroup(os.getpid()) != _cpu_cgroup(kids[0][0])
    finally:
        for job in jobs:
            job.end(now=True)
        check.remove()


def _first_line(job, timeout: float = 30.0) -> str:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = job.output_text()
        if "\n" in text:
            return text.split("\n")[0]
        time.sleep(0.1)
    raise AssertionError(f"no line from the job in {timeout:g} s: {job.output_text()!r}")



def test_jobs_each_under_their_own_cap_are_held_together_by_their_checks(tmp_path):
    """A check runs its jobs at every rank count at once, each with a cgroup of its own (8 GiB here): four
    learner jobs once held 6.3 GiB against a submission's 512 MiB, and could hold 32 GiB on a host of 24.
    Inside the check's cgroup, two jobs of 300 MiB, each under its own cap of 1 GiB, together pass the
    check's 400 MiB: one is stopped; and the check's cgroups are gone with it."""
    sandbox = _sandbox()
    if not sandbox.cgroup_works():
        pytest.skip("no writable cgroup with the pids and memory controllers here")
    from hpdl import sidejob

    check = sandbox.Cgroup.make(200, 400 * 2**20)
    hold = ("import time\nheld = [b'x' * (50 * 2**20) for _ in range(6)]\n"
            "print('held 300 MiB', flush=True)\ntime.sleep(3)\n")
    jobs = []
    try:
        for _ in range(2):
            limits = sandbox.Limits(processes=40, memory_total=2**30, within=check)
            jobs.append(sidejob.SideJob([sys.executable, "-c", hold], timeout=60, limits=limits))
            assert limits.applied()["memory"] == 2**30 and limits.cgroup.path.startswith(check.path + os.sep)
        for job in jobs:
            job.wait()
    finally:
        for job in jobs:
            job.end(now=True)
        check.remove()
    held = [job.returncode == 0 and "held 300 MiB" in job.output_text() for job in jobs]
    assert held.count(True) == 1, [job.output_text() for job in jobs]  # each alone fits its own cap
    assert not os.path.exists(check.path)


def test_a_crash_under_the_limits_leaves_no_core_dump(tmp_path):
    """A core dump is as large as the process and no other cap counts it (or the host's collector
    takes it, outside them all): under the sandbox's limits none is written, even where the grader's
    own shell allows them."""
    import resource

    from hpdl import sidejob

    sandbox = _sandbox()
    soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (hard, hard))  # as in a shell with `ulimit -c unlimited`
    try:
        crash = ("import os, resource; print('core limit', resource.getrlimit(resource.RLIMIT_CORE)[0], "
                 "'files', resource.getrlimit(resource.RLIMIT_NOFILE), flush=True); os.abort()")
        job = sidejob.SideJob([sys.executable, "-c", crash], timeout=60, cwd=tmp_path, limits=sandbox.Limits())
        try:
            job.wait()
        finally:
            job.end(now=True)
    finally:
        resource.setrlimit(resource.RLIMIT_CORE, (soft, hard))
    assert "core limit 0" in job.output_text() and job.returncode != 0, job.output_text()
    # descriptors capped, the hard limit too (a disk measure reads each: DiskWatch)
    assert "files (4096, 4096)" in job.output_text(), job.output_text()
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("core")]


def _tiny_batch(tmp_path: Path) -> Path:
    subs = tmp_path / "subs"
    subs.mkdir()
    (subs / "a.ipynb").write_text("not a notebook")
    return subs


def test_grading_refuses_without_a_sandbox_that_holds(tmp_path, monkeypatch):
    from hpdl.checker import sandbox

    monkeypatch.setenv("HPDL_BWRAP", str(tmp_path / "no-such-bwrap"))
    monkeypatch.setattr(sandbox, "cgroup_works", lambda: False)
    with pytest.raises(HpdlError) as err:
        grade.main([str(_tiny_batch(tmp_path)), "--out", str(tmp_path / "out"), "--allow-root"])
    text = str(err.value)
    assert "bubblewrap" in text and "apt-get install bubblewrap" in text and "cgroup" in text
    assert "--no-sandbox" in text
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


def test_grading_refuses_root_unless_told(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("this test runs as root only")
    with pytest.raises(HpdlError, match="--allow-root"):
        grade.main([str(_tiny_batch(tmp_path)), "--out", str(tmp_path / "out")])


def test_without_a_sandbox_the_instructor_may_still_grade_and_the_report_says_so(tmp_path, monkeypatch):
    from hpdl.checker import sandbox

    monkeypatch.setenv("HPDL_BWRAP", str(tmp_path / "no-such-bwrap"))
    out = tmp_path / "out"
    assert grade.main([str(_tiny_batch(tmp_path)), "--out", str(out), "--allow-root", "--no-sandbox"]) == 0
    assert not sandbox.available()
    data = json.loads((out / "grades.json").read_text())
    assert data["sandbox"].startswith("NOT sandboxed") and "--no-sandbox" in data["sandbox"]
    assert any("bubblewrap" in m for m in data["sandbox_limits"]["missing"])


def test_grade_help_names_the_flags():
    out = subprocess.run([sys.executable, "-m", "hpdl.cli", "grade", "--help"], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0 and "--no-sandbox" in out.stdout and "--allow-root" in out.stdout
    assert "--memory" in out.stdout and "--tasks" in out.stdout and "--disk" in out.stdout


# -- one hostile batch, with an honest learner in it --------------------------------------------------

SNOOP = f'''import glob, os, subprocess
found = []
for pattern in ("/var/tmp/*/*/*.ipynb", "/var/tmp/*/*/*/*.ipynb", "/tmp/*/*/*.ipynb", "../*/*.ipynb",
                os.path.expanduser("~") + "/../*/*.ipynb"):
    for p in glob.glob(pattern):
        try:
            text = open(p).read()
        except OSError:
            continue
        if "NEIGHBOUR" + "-MARKER" in text:
            found.append(p)
print("neighbours read:", found)
print("own folder's parent holds:", sorted(os.listdir("..")))
for p in ({str(Path('/var/tmp'))!r} + "/*/.ssh/id_rsa", "/root/.ssh/id_rsa", "/home/*/.ssh/id_rsa"):
    for k in glob.glob(p):
        try:
            print("key", open(k).read())
        except OSError as e:
            print("key refused", type(e).__name__)
print("environment:", dict(os.environ))
print("unshare -U:", subprocess.run(["unshare", "-U", "true"], capture_output=True).returncode)
import inspect, hpdl.predict
print("kit's answer read:", "t_comm" in inspect.getsource(hpdl.predict.predict_step_time))
'''

FORK_BOMB = '''import os, time
n = 0
try:
    for _ in range(5000):
        pid = os.fork()
        if pid == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError:
    pass
print("forked", n)
'''

# four children of 768 MiB each, every one under the per-process limit, 3 GiB together; the
# children ask the OOM killer to take them first, so the notebook's kernel lives to report
MEMORY_BOMB = '''import os, time
r, w = os.pipe()
kids = []
for i in range(4):
    pid = os.fork()
    if pid == 0:
        os.close(r)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
        hold = [b"x" * (64 * 2**20) for _ in range(12)]
        os.write(w, b"D")
        time.sleep(60)
        os._exit(0)
    kids.append(pid)
os.close(w)
os.set_blocking(r, False)
done, dead, t0 = 0, set(), time.monotonic()
while done + len(dead) < len(kids) and time.monotonic() - t0 < 40:
    try:
        done += len(os.read(r, 64))
    except BlockingIOError:
        pass
    for k in kids:
        if k not in dead and os.waitpid(k, os.WNOHANG)[0]:
            dead.add(k)
    time.sleep(0.1)
held = 0
for k in kids:
    try:
        held += int([l for l in open(f"/proc/{k}/status") if l.startswith("VmRSS")][0].split()[1]) * 1024
    except (OSError, IndexError):
        pass
print("held together MiB", held // 2**20)
for k in kids:
    try:
        os.kill(k, 9)
    except ProcessLookupError:
        pass
'''

# 64 MiB files in its folder (its HOME and working folder, the host's disk),
# 3 GiB in all, each under the per-file cap
DISK_BOMB = '''import os
chunk = b"x" * (64 << 20)
for i in range(48):
    with open(f"fill-{i}", "wb") as f:
        f.write(chunk)
print("wrote", (i + 1) * 64, "MiB")
'''

MEMORY = 1536 * 2**20
TASKS = 512


@pytest.fixture
def hostile(tmp_path, monkeypatch) -> Path:
    kit = tmp_path / "kit"
    example_kit(kit, monkeypatch)
    solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    subs = tmp_path / "subs"
    subs.mkdir()
    honest = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
    honest.cells.append(nbformat.v4.new_markdown_cell("NEIGHBOUR-MARKER: my own answer, not yours"))
    nbformat.write(honest, subs / "a_honest.ipynb")
    for name, code in (("snoop", SNOOP), ("fork_bomb", FORK_BOMB), ("memory_bomb", MEMORY_BOMB)):
        nb = nbformat.from_dict(json.loads(json.dumps(solved)))
        nb.cells.append(nbformat.v4.new_code_cell(code))  # after its own honest check
        nbformat.write(nb, subs / f"{name}.ipynb")
    disk = nbformat.v4.new_notebook()
    disk.cells = [nbformat.v4.new_code_cell(DISK_BOMB)]  # no check of its own: it only tries the cap
    nbformat.write(disk, subs / "disk_bomb.ipynb")
    return subs


def _outputs(out: Path, name: str) -> str:
    nb = nbformat.read(out / "executed" / name, as_version=4)
    return json.dumps([c.get("outputs", []) for c in nb.cells])


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_hostile_batch_reads_nothing_of_the_grader_or_a_neighbour_and_stays_in_its_caps(
        hostile, tmp_path, monkeypatch, no_strays):
    import tempfile

    sandbox = _sandbox()
    if not sandbox.available() or not sandbox.cgroup_works():
        pytest.skip("needs bubblewrap and a writable cgroup")
    home = _plant_home(Path("/var/tmp"))
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("TMPDIR", "/var/tmp")  # as on many clusters: the review read a neighbour there
    monkeypatch.setattr(tempfile, "tempdir", None)
    monkeypatch.setenv("MY_SITE_SECRET", SECRET)
    out = tmp_path / "report"
    try:
        assert grade.main([str(hostile), "--out", str(out), "--timeout", "120", "--jobs", "2", "--allow-root",
                           "--memory", str(MEMORY), "--tasks", str(TASKS), "--disk", "1G"]) == 0
    finally:
        import shutil

        shutil.rmtree(home, ignore_errors=True)
    data = json.loads((out / "grades.json").read_text())
    rows = {s["submission"]: s for s in data["submissions"]}
    full = data["max_score"]
    assert full > 0
    for name in ("a_honest.ipynb", "snoop.ipynb", "fork_bomb.ipynb", "memory_bomb.ipynb"):
        assert rows[name]["score"] == full, rows[name]  # each one's own check, graded right
        assert rows[name]["limits"] == {"memory": MEMORY, "tasks": TASKS, "cpu": data["sandbox_limits"]["cpu_weight"]}
    assert rows["a_honest.ipynb"]["status"] == "ok"
    # the header says once which sandbox ran and each limit, read back from the kernel
    limits = data["sandbox_limits"]
    assert limits["memory_total_bytes"] == MEMORY and limits["tasks_total"] == TASKS and not limits["missing"]
    assert limits["seccomp"] and "refused" in limits["nested_user_namespaces"]
    assert limits["cpu_weight"] and "CPU: one share for all its processes together (cgroup weight " in data["sandbox"]
    assert "1.5 GiB" in data["sandbox"] and "1.5 GiB" in (out / "index.html").read_text()
    assert limits["messages_counted"] and "counted by the kernel" in data["sandbox"]  # checker/meter.py
    assert "zero3_unit" in limits["self_reported"] and "zero3_unit: the memory held" in data["sandbox"]

    snoop = _outputs(out, "snoop.ipynb")
    assert "neighbours read: []" in snoop, snoop
    assert "own folder's parent holds: [" in snoop and snoop.count("hpdl-home") <= 1
    assert KEY not in snoop and SECRET not in snoop and "MY_SITE_SECRET" not in snoop
    assert "unshare -U: 0" not in snoop and "unshare -U:" in snoop
    assert "kit's answer read: False" in snoop, snoop  # its source, retyped as a cell, passed as the learner's own
    # a fork bomb stops at the task cap, or its forked kernels fill the memory cap and the
    # OOM killer ends its runner: either way it alone pays, after its check was graded
    if (out / "executed" / "fork_bomb.ipynb").exists():
        forked = int(_outputs(out, "fork_bomb.ipynb").split("forked ")[1].split("\\")[0])
        assert 0 < forked < TASKS
    else:
        assert rows["fork_bomb.ipynb"]["status"] in ("runner failed", "kernel died", "timeout", "error")
    held = int(_outputs(out, "memory_bomb.ipynb").split("held together MiB ")[1].split("\\")[0])
    assert held * 2**20 <= MEMORY, held
    # files in its folder on the host's disk: stopped at the folder's cap, which the header names
    assert rows["disk_bomb.ipynb"]["status"] == "disk limit", rows["disk_bomb.ipynb"]
    assert "more than 1 GiB of disk" in rows["disk_bomb.ipynb"]["detail"], rows["disk_bomb.ipynb"]
    assert "its folder on disk: 1 GiB" in data["sandbox"]
    # the snoop's work folder (its HOME, a 0700 folder of the batch's) is gone, the batch's too
    import re

    work = Path(re.search(r"'HOME': '([^']+)'", snoop).group(1))
    assert work.parent.name.startswith("hpdl-grade-") and str(work).startswith("/var/tmp/")
    assert not work.exists() and not work.parent.exists()


def test_tasks_capped_by_a_cgroup_are_not_capped_per_user_too():
    """RLIMIT_NPROC counts every process and thread of the user, and every submission graded at once runs as
    the grader: a neighbour's 2012 idle threads, under its own cap, left an honest submission started before
    them no room (OpenBLAS could not start its threads: 0/36). Where a cgroup caps a sandbox's tasks, that
    cap is the one; without a cgroup the per-user limit stays."""
    import resource

    from hpdl.checker import sandbox

    show = [sys.executable, "-c", "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])"]
    limits = sandbox.Limits(processes=64).start()
    try:
        if limits.cgroup is None or limits.applied()["tasks"] is None:
            pytest.skip("no cgroup capping tasks can be made here")
        capped = subprocess.run(show, preexec_fn=limits.apply, capture_output=True, text=True, check=True)
        assert int(capped.stdout) == resource.getrlimit(resource.RLIMIT_NPROC)[0], capped.stdout
    finally:
        limits.stop()
    alone = sandbox.Limits(processes=64)
    alone._tasks_now = 10
    uncapped = subprocess.run(show, preexec_fn=alone.apply, capture_output=True, text=True, check=True)
    assert int(uncapped.stdout) == 74, uncapped.stdout
