"""A hostile class, graded: nothing a submission (or the learner's ranks in a check) can write is
ever written through, followed, or read without a bound by the grader and the checker's trusted
side; one submission cannot take the batch down, nor kill the grader; every command's --help
prints help. Each test is an attack class from the security review of `hpdl grade`, not one
copied submission: a planted link where the grader writes, a request or event file that is a
link to /dev/zero or a FIFO, a pid the learner names as its own, an output flood, a submission
that is a link to someone else's notebook."""
from __future__ import annotations

import csv
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat
import pytest

from hpdl import cli
from conftest import example_kit
from hpdl.checker import sandbox

MAX_GRADER_RSS = 2 * 2**30  # bytes: the grader and everything it reaped (kernels included)

# -- in the grade service's folders: a link where the grader writes, requests that are not files ---
PLANT = """import json, os, pathlib, uuid
svc = pathlib.Path(os.environ["HPDL_GRADE_SERVICE"])
for _ in range(2):
    rid = uuid.uuid4().hex
    for where in (svc, svc / "answers"):
        for name in (f".resp-{rid}.tmp", f"resp-{rid}.json"):  # the temporary and the final name
            try:
                os.symlink(VICTIM, where / name)
            except OSError as exc:
                print("refused:", exc)
    # an exercise name holding shell text: what the grader would write into the link's target
    (svc / f"req-{rid}.json").write_text(json.dumps({"exercise": "x\\necho pwned >> ~/.bashrc", "code": {}}))
"""
REQUESTS = """import os, pathlib, uuid
svc = pathlib.Path(os.environ["HPDL_GRADE_SERVICE"])
os.symlink("/dev/zero", svc / f"req-{uuid.uuid4().hex}.json")  # stat says 0 bytes; reading never ends
os.mkfifo(svc / f"req-{uuid.uuid4().hex}.json")  # opening it blocks until a writer comes: none does
"""
FLOOD = "print(('spam ' * 2000 + '\\n') * 8000)  # 80 MB in one cell: more than a saved notebook may hold"


def _notebook(path: Path, *sources: str) -> None:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(s) for s in sources]
    nbformat.write(nb, path)


@pytest.fixture
def hostile(tmp_path, monkeypatch) -> dict:
    """One honest, solved notebook beside hostile ones, and what they aim at outside the sandbox."""
    kit = tmp_path / "kit"
    example_kit(kit, monkeypatch)
    subs, elsewhere = tmp_path / "subs", tmp_path / "elsewhere"
    subs.mkdir()
    elsewhere.mkdir()
    victim = tmp_path / "instructor" / ".bashrc"
    victim.parent.mkdir()
    victim.write_text("# the instructor's own\n")
    nbformat.write(nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4), subs / "honest.ipynb")
    _notebook(subs / "plant.ipynb", f"VICTIM = {str(victim)!r}", PLANT)
    _notebook(subs / "requests.ipynb", REQUESTS)
    _notebook(subs / "flood.ipynb", FLOOD)
    # a link to another learner's notebook (readable by the grader only), and a linked folder
    other = elsewhere / "other.ipynb"
    nbformat.write(nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4), other)
    os.chmod(other, 0o600)
    os.symlink(other, subs / "link.ipynb")
    os.symlink(elsewhere, subs / "linked_folder")
    return {"subs": subs, "victim": victim, "out": tmp_path / "report"}


def _grade_in_a_child(subs: Path, out: Path) -> tuple[int, int]:
    """`hpdl grade` as its own process, TMPDIR=/var/tmp as the review had it; its exit code and
    the largest resident size of it and what it reaped. Its address space is capped (6 GiB) so
    that a grader that reads without a bound fails here instead of taking the host down."""
    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))

    env = dict(os.environ, TMPDIR="/var/tmp", PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen([sys.executable, "-m", "hpdl.cli", "grade", str(subs), "--out", str(out),
                             "--timeout", "150", "--jobs", "2", "--exercises", "fixture_ring",
                             *(["--allow-root"] if os.geteuid() == 0 else [])],
                            env=env, preexec_fn=cap, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    output = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    print(output.decode(errors="replace"))
    return proc.returncode, usage.ru_maxrss * 1024


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_hostile_batch_harms_nothing_outside_and_grades_the_honest_one_fully(hostile, no_strays):
    if not sandbox.available():
        pytest.skip("bubblewrap is not available here")
    before = hostile["victim"].read_text()
    code, rss = _grade_in_a_child(hostile["subs"], hostile["out"])
    assert code == 0
    out = hostile["out"]
    rows = {r["submission"]: r for r in csv.DictReader(open(out / "grades.csv"))}
    harm = []  # every finding at once: each line is one attack class that got through

    def expect(ok: bool, what: str) -> None:
        if not ok:
            harm.append(what)

    honest = rows["honest.ipynb"]
    expect(honest["status"] == "ok" and float(honest["score"]) == float(honest["max_score"]) > 0,
           f"the honest submission was not graded fully: {honest}")
    # a planted link where the grader writes its answer: its target is untouched, nothing new beside it
    expect(hostile["victim"].read_text() == before, "the grader wrote through a planted link: "
           + hostile["victim"].read_text()[:200])
    expect([p.name for p in hostile["victim"].parent.iterdir()] == [".bashrc"], "a file appeared beside the target")
    # requests that are a link to /dev/zero and a FIFO: refused, unread; the grader stayed small
    detail = rows["requests.ipynb"]["detail"]
    expect("symbolic link" in detail and "FIFO" in detail, f"bad requests not refused as such: {detail!r}")
    expect(rss < MAX_GRADER_RSS, f"the grader grew to {rss / 2**30:.1f} GiB")
    # an output flood: the saved notebook is a valid one, its output cut with a note
    try:
        flood = nbformat.read(out / "executed" / "flood.ipynb", as_version=4)
        expect("output cut" in json.dumps(flood.cells[0].outputs), "the flood's output was not cut with a note")
    except Exception as exc:  # noqa: BLE001 - a truncated notebook is the finding itself
        harm.append(f"the flood's saved notebook is not a valid notebook: {type(exc).__name__}: {str(exc)[:100]}")
    # links among the submissions: refused with a reason, not graded as the linker's
    for name in ("link.ipynb", "linked_folder"):
        row = rows.get(name, {})
        expect(row.get("status") == "refused" and float(row.get("score", 0)) == 0
               and "symbolic link" in row.get("detail", ""), f"{name} was not refused as a link: {row}")
    assert not harm, "\n".join(harm)


# -- in a check job's folder (the learner's ranks write it): the checker's own files ---------------
CHECK_FILES = '''def ring_allreduce(comm, x):
    import builtins, json, os, time
    job, r = os.environ["HPDL_CHECK_JOB"], comm.Get_rank()
    d = os.path.join(job, "r%d" % r)  # this rank's own folder of the job's
    calls = builtins.__dict__.setdefault("_calls", [])
    calls.append(1)
    if len(calls) == 1:  # first case: our outputs become a link to /dev/zero (through the temporary name)
        os.symlink("/dev/zero", os.path.join(d, "out-%d-%d.bin.tmp" % (CASE0, r)))
        # and every rank "reaches" a barrier whose name climbs out of its folder, to where the checker's
        # release of it would make a file
        os.mkdir(os.path.join(d, "go-x"))
        with open(os.path.join(d, "rank%d.jsonl" % r), "a") as f:
            f.write(json.dumps({"ev": "at", "tag": "x/" + "../" * 16 + PLANT.lstrip("/")}) + "\\n")
        return x.copy()
    if r == 0:  # next case: our event log becomes a FIFO, and a link waits where "where are you?" is written
        import glob  # (once the checker has read the first case's events: it has handed our outputs over)
        while not glob.glob(os.path.join(os.path.dirname(job), "r2-*", "got-%d-0.bin" % CASE0)):
            time.sleep(0.05)
        os.symlink(VICTIM, os.path.join(d, "dump-request.tmp"))
        os.rename(os.path.join(d, "rank0.jsonl"), os.path.join(d, "moved.jsonl"))
        os.mkfifo(os.path.join(d, "rank0.jsonl"))
        time.sleep(3600)
    with open(os.path.join(d, "rank1.jsonl"), "a") as f:  # "my pid is ...": a process that is not ours
        f.write(json.dumps({"ev": "ready", "pid": VICTIM_PID}) + "\\\\n")
    sum(range(10 ** 13))  # hold the Python lock: no answer but through SIGUSR1 to the pid we named
'''


def _learner_function(source: str, **names):
    """A learner's function from its source text (a file of its own, so the checker can quote it)."""
    import linecache

    filename = "<hostile learner>"
    text = "".join(f"{k} = {v!r}\n" for k, v in names.items()) + source
    linecache.cache[filename] = (len(text), None, text.splitlines(True), filename)
    namespace = {"__name__": "__learner__"}
    exec(compile(text, filename, "exec"), namespace)
    return namespace["ring_allreduce"]


@pytest.mark.timeout(300)
def test_the_checker_never_follows_blocks_on_or_signals_what_the_learners_ranks_plant(tmp_path, monkeypatch,
                                                                                     no_strays):
    """Outside a sandbox (where the rank's word is all there is about its pid): outputs that are
    a link to /dev/zero, an event log swapped for a FIFO, a link planted where the asking side
    writes its request, a barrier named to climb out of the rank's folder, and a rank that names
    another process as itself. The check ends, on
    its own time limit, with no point earned; nothing outside changed; the checker stayed small."""
    import hpdl

    monkeypatch.setenv("HPDL_NO_SANDBOX", "1")
    victim = tmp_path / ".bashrc"
    victim.write_text("# the instructor's own\n")
    bystander = subprocess.Popen(["sleep", "600"])  # stands for the grader: SIGUSR1 would end it
    try:
        plant = tmp_path / "planted"
        fn = _learner_function(CHECK_FILES, VICTIM=str(victim), VICTIM_PID=bystander.pid, CASE0=0, PLANT=str(plant))
        rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result = hpdl.check("ring_allreduce", fn, ranks=[2], timeout=3)
        grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - rss_before
        assert result.cases
        assert not any(c.verdict in ("PASS", "SLOW") for c in result.cases), result
        assert result.cases[0].verdict == "WRONG", result.cases[0]  # /dev/zero was not read as outputs
        assert victim.read_text() == "# the instructor's own\n"
        assert not plant.exists(), "the checker made a file where a barrier's name pointed"
        assert bystander.poll() is None, "the checker signalled a process the learner named"
        assert grew < 256 * 2**20, f"the checker grew by {grew / 2**20:.0f} MiB"
    finally:
        bystander.kill()
        bystander.wait()


# outputs made sparse once written: 64 MiB long, next to nothing on the disk its folder's cap counts
HOLES = '''def ring_allreduce(comm, x):
    import glob, os
    job = os.environ["HPDL_CHECK_JOB"]
    held = [os.path.getsize(p) for p in glob.glob(os.path.join(os.path.dirname(job), "r*-*", "got-*"))]
    with open(SEEN, "a") as f:  # what the checker's side holds of our earlier outputs
        f.write("%d\\n" % sum(held))
    if not getattr(os.replace, "holes", False):
        def replace(src, dst, real=os.replace):
            real(src, dst)
            if os.path.basename(dst).startswith("out-"):
                os.truncate(dst, 64 << 20)
        replace.holes = True
        os.replace = replace
    return x.copy()
'''


@pytest.mark.timeout(300)
def test_outputs_with_holes_are_not_copied_to_the_checkers_side(tmp_path, monkeypatch, no_strays):
    """A rank's outputs truncated to 64 MiB take no disk in its folder, whose cap counts blocks; each
    case's copy for the reference ranks took 64 MiB for real, kept to the check's end: 5.6 GiB
    outside every cap in one graded check. Refused unread now, and what the reference ranks read is
    gone once read. (Outside a sandbox, where a rank can see the checker's folders.)"""
    import hpdl

    monkeypatch.setenv("HPDL_NO_SANDBOX", "1")
    seen = tmp_path / "seen"
    result = hpdl.check("ring_allreduce", _learner_function(HOLES, SEEN=str(seen)), ranks=[2])
    assert len(result.cases) > 2 and result.score == 0, result
    assert all("could not be read back" in c.message for c in result.cases), result
    held = [int(n) for n in seen.read_text().split()]
    assert len(held) == 2 * len(result.cases) and max(held) < 2**20, held


# a check's ranks filling their folder on the host's disk: 3 GiB in 64 MiB files (each under the per-file cap)
DISK_FILL = '''def ring_allreduce(comm, x):
    import os
    mine = os.path.join(os.environ["HPDL_CHECK_JOB"], "r%d" % comm.Get_rank())  # the rank's own, writable
    chunk, held = b"x" * (64 << 20), []
    for i in range(48):
        f = open(os.path.join(mine, "fill-%d" % i), "wb")
        f.write(chunk)
        f.flush()
        if UNLINK:  # its name gone, no folder lists it: it takes the disk while held open
            os.unlink(f.name)
            held.append(f)
        else:
            f.close()
    return comm.allreduce(x)
'''


@pytest.mark.timeout(300)
@pytest.mark.parametrize("unlink", [False, True], ids=["named", "unlinked_but_open"])
def test_a_checks_ranks_that_fill_their_folder_are_stopped_at_its_cap(unlink, no_strays):
    """Their folder is the host's and RLIMIT_FSIZE caps one file only: the checker measures it as
    the ranks run (files removed by name but held open too) and stops them at sandbox.DISK_BYTES,
    an error in words, the files gone."""
    import shutil

    import hpdl

    free = shutil.disk_usage(tempfile.gettempdir()).free
    if free < 8 * sandbox.DISK_BYTES:
        pytest.skip(f"needs {8 * sandbox.DISK_BYTES / 2**30:g} GiB free in the temporary directory")
    result = hpdl.check("ring_allreduce", _learner_function(DISK_FILL, UNLINK=unlink), ranks=[2], timeout=30)
    assert result.cases and all(c.verdict == "ERROR" for c in result.cases), result
    first, *rest = result.cases
    assert "of disk (the cap on its folder)" in first.message, first.message
    assert rest and all(c.message.startswith(f"Not run: case {first.name} was stopped") for c in rest), rest[0]
    assert shutil.disk_usage(tempfile.gettempdir()).free > free - sandbox.DISK_BYTES // 2  # nothing of it left


@pytest.mark.timeout(300)
def test_one_submissions_check_requests_run_one_at_a_time(tmp_path, monkeypatch, no_strays):
    """A notebook's hpdl.check() waits for its answer, but a hostile one can file many requests at
    once (threads, or files written into its inbox). Each check starts two MPI jobs, outside the
    submission's caps: started together, MAX_REQUESTS of them were hundreds of ranks on the grading
    host. They run one after another; all are answered; none is left when the notebook has ended."""
    import psutil

    from hpdl.checker import client, grade_service

    monkeypatch.setenv("HPDL_CASES_PATH", str(Path(__file__).parent / "fixtures" / "cases"))
    fn = _learner_function("def ring_allreduce(comm, x):\n    return comm.allreduce(x)\n")
    request = json.dumps({"exercise": "fixture_ring",
                          "code": grade_service._jsonable(client.learner_code("fixture_ring", fn))})
    service = grade_service.Service(tmp_path / "checks", hidden=[])
    rids = [f"{i:032x}" for i in range(3)]
    for rid in rids:
        (tmp_path / "checks" / f"req-{rid}.json").write_text(request)
    me, most = psutil.Process(), 0
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not all((service.answers / f"resp-{r}.json").exists() for r in rids):
        service.poll()
        checks = set()  # a check's folder holds its jobs: learner's and reference ranks at each rank count
        for p in me.children(recursive=True):
            try:
                cmd = p.cmdline() if p.name().startswith("mpiexec") else []
            except psutil.Error:  # gone meanwhile
                continue
            if cmd:  # empty: it has just ended (a zombie's command line reads empty)
                checks.add(os.path.dirname(cmd[-1]))
        most = max(most, len(checks))
        time.sleep(0.05)
    service.finish()
    assert sorted(service.seen) == rids and "fixture_ring" in service.results and not service.problems
    assert most == 1, f"{most} checks at once"
    # filed again with the notebook ended: answered as not run, nothing started
    (tmp_path / "late").mkdir()
    late = grade_service.Service(tmp_path / "late", hidden=[])
    for rid in rids:
        (tmp_path / "late" / f"req-{rid}.json").write_text(request)
    late.poll()
    taken = time.monotonic() + 30
    while late.queue == rids and time.monotonic() < taken:  # the first taken up (the race the suite once lost)
        time.sleep(0.01)
    late.finish()
    answers = [json.loads((late.answers / f"resp-{r}.json").read_text()) for r in rids]
    assert len(late.results) <= 1 and sum("not run" in a.get("error", "") for a in answers) == 2, answers
    assert "result" in answers[0] or "stopped" in answers[0]["error"], answers[0]


@pytest.mark.timeout(60)
def test_a_check_left_running_by_an_ended_notebook_is_stopped_not_waited_for(tmp_path, monkeypatch, no_strays):
    """A notebook that files a slow check and ends: the grader's loop, which serves every submission, once
    waited up to 120 s for it (an honest notebook beside it timed out, its time limit unkept meanwhile).
    Its submission over, the check is stopped: its jobs end at once, it records no result, and says so.
    (Within the submission's time limit the loop polls it instead: grade.Running.poll.)"""
    import psutil

    from hpdl.checker import client, grade_service

    monkeypatch.setenv("HPDL_CASES_PATH", str(Path(__file__).parent / "fixtures" / "cases"))
    fn = _learner_function("def ring_allreduce(comm, x):\n    import time\n    time.sleep(600)\n")
    request = json.dumps({"exercise": "fixture_ring",
                          "code": grade_service._jsonable(client.learner_code("fixture_ring", fn))})
    service = grade_service.Service(tmp_path / "checks", hidden=[])
    (tmp_path / "checks" / f"req-{0:032x}.json").write_text(request)
    me = psutil.Process()
    while not any(p.name().startswith("mpiexec") for p in me.children(recursive=True)):  # its jobs run
        service.poll()
        time.sleep(0.05)
    service.finish()
    assert not service.busy() and not service.results, service.results
    assert any("was stopped" in problem for problem in service.problems), service.problems


# -- what a batch leaves on the host, and the commands' help --------------------------------------
@pytest.mark.timeout(60)
def test_a_check_requests_source_cannot_hold_the_grader(tmp_path):
    """The grader reads a request's source in its own process, where a search that holds Python's lock
    stops every other submission's clock: 200 KB of newlines once took minutes to search for `import
    torch` (a pattern spanning lines), and 64 MiB, the request's cap, hours. Searched in linear time now
    (this test's timeout catches the old one), and more than MAX_SOURCE_CHARS of source is refused."""
    from hpdl.checker import cases, checking, grade_service

    code = grade_service._code_from({"source": "def f(comm, x):\n    return x\n",
                                     "sources": [{"source": "\n" * 200_000}]})
    assert checking._preload(cases.load("ring_allreduce"), code)["learner"] == []
    code["sources"][0]["source"] += "import torch\n"
    assert checking._preload(cases.load("ring_allreduce"), code)["learner"] == ["torch"]
    flood = {"source": "x", "sources": [{"source": "\n" * (grade_service.MAX_SOURCE_CHARS + 1)}]}
    with pytest.raises(ValueError, match="characters of source"):
        grade_service._code_from(flood)


def test_pids_cgroups_left_behind_are_removed_later(tmp_path):
    """A cgroup still holding exiting processes when its job ends cannot be removed then: the
    removal is retried (after each submission, at the end of the batch), and cgroups named after
    a grader that is gone are swept."""
    made = sandbox.Cgroup.make(16, None)
    if made is None:
        pytest.skip("no writable pids cgroup here (not root, or no pids controller)")
    proc = subprocess.Popen(["sleep", "600"], preexec_fn=made.join)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a grader that is gone: its pid in a cgroup's name
    root = os.path.dirname(made.path)
    orphan = os.path.join(root, f"{sandbox.CGROUP_PREFIX}{dead.pid}-0123456789ab")
    os.mkdir(orphan)
    try:
        assert made.remove() is False and os.path.isdir(made.path)  # busy: kept for later
        proc.kill()
        proc.wait()
        removed = sandbox.sweep_cgroups()
        assert made.path in removed and orphan in removed
        assert not os.path.exists(made.path) and not os.path.exists(orphan)
    finally:
        proc.kill()
        proc.wait()
        for path in (made.path, orphan):
            if os.path.isdir(path):
                os.rmdir(path)


@pytest.mark.parametrize("verb", list(cli.VERBS))
def test_every_command_prints_its_help_and_does_nothing_else(verb, capsys):
    """`hpdl VERB --help` prints a usage line and exits 0 (argparse), never runs the verb:
    `hpdl cleanup --help` used to end clusters."""
    try:
        code = cli.main([verb, "--help"])
    except SystemExit as end:  # argparse's way out after printing help
        code = end.code
    assert code in (0, None)
    out = capsys.readouterr().out
    assert out.startswith(f"usage: hpdl {verb}"), out[:300]
    assert "ended" not in out and "removed" not in out


ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["cluster/build/horovod.sh", "cluster/build/horovod-nccl.sh", "cluster/build/horovod-mvapich2-gdr.sh",
           "cluster/build/offline-install.sh", "cluster/jupyterhub/install.sh", "cluster/jupyterhub/stop-hub.sh",
           "cluster/apptainer/start-lab.sh", "cluster/slurm/local-slurm.sh", "cluster/build/relocate_wheel.py"]


def _header(script: Path) -> str:
    """A script's opening comment, as its --help prints it."""
    lines = script.read_text().splitlines()[1:]
    head = [line for line in lines[:next(i for i, line in enumerate(lines) if not line.startswith("#"))]]
    return "".join(line[2:] if line.startswith("# ") else line[1:] for line in head[:3])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_of_the_kit_prints_its_help_and_does_nothing_else(script, tmp_path):
    """`SCRIPT --help` prints the script's opening comment and exits 0. Before, `hpdl-hub-stop --help` stopped
    the hub (every learner's server), `install.sh --help` installed it and the Horovod builds refused
    --help only after looking for CUDA. A hub to stop stands by, a process named jupyterhub in a pid file; the
    rest point at folders that do not exist, so a script that went on would fail, not install."""
    hub = subprocess.Popen(["bash", "-c", "exec -a jupyterhub sleep 60"])
    (tmp_path / "jupyterhub.pid").write_text(f"{hub.pid}\n")
    env = dict(os.environ, HPDL_HUB_STATE=str(tmp_path), HPDL_HUB_PREFIX=str(tmp_path / "hub"),
               HPDL_KIT_VENV=str(tmp_path / "none"), HPDL_DIR=str(tmp_path / "none"), PYTHON=str(tmp_path / "none"))
    try:
        command = [sys.executable, str(ROOT / script)] if script.endswith(".py") else [str(ROOT / script)]
        shown = subprocess.run([*command, "--help"], env=env, capture_output=True, text=True, timeout=60)
        alive = hub.poll() is None
    finally:
        hub.kill()
        hub.wait()
    assert shown.returncode == 0, shown.stderr[-2000:]
    if script.endswith(".py"):  # argparse
        assert shown.stdout.startswith(f"usage: {Path(script).name}"), shown.stdout[:1000]
    else:
        assert "".join(shown.stdout.splitlines()[:3]) == _header(ROOT / script), shown.stdout[:1000]
    assert alive, "the hub was stopped"


# -- graded as an ordinary user, as at a site: the cgroup a user is given, not root's ---------------
PEEK = """import os
for p in ("/etc/shadow", SECRET):
    try:
        print(p, "read:", open(p).read())
    except OSError as exc:
        print(p, "refused:", type(exc).__name__)
print("environment:", sorted(os.environ))
"""


def _delegated_v1_cgroup(tmp: Path) -> list[str]:
    """A memory and a pids cgroup (v1) inside this process's own, given to nobody as a site's systemd or
    batch system delegates one to a user; [] where this host has no such hierarchies."""
    own = {}
    for line in open("/proc/self/cgroup"):
        _, ctls, path = line.rstrip("\n").split(":", 2)
        for c in ctls.split(","):
            own[c] = path
    roots = {ctl: Path("/sys/fs/cgroup") / ctl for ctl in ("memory", "pids")}
    if any(ctl not in own or not (root / "cgroup.procs").exists() for ctl, root in roots.items()):
        return []  # checked before any is made: none is left behind
    made = []
    for ctl, root in roots.items():
        path = root / own[ctl].lstrip("/") / f"delegated-{tmp.name}"
        path.mkdir()
        for f in [path, *path.iterdir()]:
            os.chown(f, 65534, 65534)
        made.append(str(path))
    return made


@pytest.mark.timeout(300)
@pytest.mark.skipif(os.geteuid() != 0 or not sandbox.available(), reason="becomes nobody (root only); bubblewrap")
def test_an_ordinary_user_whose_cgroup_is_delegated_grades_in_the_sandbox(tmp_path, monkeypatch, no_strays):
    """As at a site: the instructor is no root, and the system gave their session a cgroup of its own (v1:
    folders in the memory and pids hierarchies, theirs). The grader makes its caps there and grades in the
    sandbox: the honest notebook in full, the other one reading neither /etc/shadow nor a 0600 file of the
    grader's, nor a variable of the grader's environment. It was refused ("this host lacks: a writable
    cgroup"): the check asked whether the hierarchy's mount point, root's, was writable, not the user's own
    cgroup under it."""
    from test_shared_kit import learners_venv

    venv = learners_venv()
    top = Path(tempfile.mkdtemp(prefix="hpdl-unprivileged-", dir="/tmp"))  # nobody cannot enter our tmp_path
    groups: list[str] = []
    try:
        groups = _delegated_v1_cgroup(top)
        if not groups:
            pytest.skip("no cgroup v1 memory and pids hierarchies here to delegate a cgroup from")
        kit = example_kit(top / "kit", monkeypatch)
        subs = top / "subs"
        subs.mkdir()
        solved = nbformat.read(kit / "solutions" / "ex.ipynb", as_version=4)
        nbformat.write(solved, subs / "honest.ipynb")
        secret = top / "grader-secret"
        _notebook(subs / "peek.ipynb", f"SECRET = {str(secret)!r}\n" + PEEK)
        secret.write_text("grader-only-4f1c")
        subprocess.run(["chown", "-R", "nobody:nogroup", str(top)], check=True)
        secret.chmod(0o600)
        join = "; ".join(f"echo $$ > {g}/cgroup.procs" for g in groups)
        env = ["env", "-i", f"PATH={venv}/bin:/usr/bin:/bin", f"HOME={top}",
               "SECRET_GRADER_VAR=grader-env-9d2a", f"HPDL_CASES_PATH={os.environ['HPDL_CASES_PATH']}"]
        cmd = ["sh", "-c", f'{join}; exec "$@"', "sh", "setpriv", "--reuid=65534", "--regid=65534",
               "--clear-groups", *env, str(venv / "bin" / "hpdl"), "grade", str(subs), "--out", str(top / "out"),
               "--timeout", "120"]
        p = subprocess.run(cmd, cwd=top, capture_output=True, text=True, timeout=280)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        assert "total memory" in p.stdout + p.stderr and "missing" not in p.stdout + p.stderr
        rows = {r["submission"]: r for r in csv.DictReader(open(top / "out" / "grades.csv"))}
        assert float(rows["honest.ipynb"]["score"]) == float(rows["honest.ipynb"]["max_score"]) > 0, rows
        shown = json.dumps(nbformat.read(top / "out" / "executed" / "peek.ipynb", as_version=4).cells[0].outputs)
        assert "/etc/shadow refused" in shown and f"{secret} refused" in shown, shown
        assert "grader-only-4f1c" not in shown and "SECRET_GRADER_VAR" not in shown
        for g in groups:  # what the grader made in the cgroup it was given is gone with it
            assert not [e.name for e in os.scandir(g) if e.is_dir()], g
    finally:
        for g in groups:  # inner first; a cgroup's own files go with it
            for inner in sorted((d for d in Path(g).rglob("*") if d.is_dir()), key=lambda q: -len(str(q))):
                inner.rmdir()
            os.rmdir(g)
        shutil.rmtree(top, ignore_errors=True)


HOLD_FDS = '''import os, sys, time
fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(int(sys.argv[1]))]
if len(sys.argv) > 2:  # a file of 1 MiB in the folder, its name removed, held open
    f = open(os.path.join(sys.argv[2], "held"), "wb")
    f.write(os.urandom(1 << 20))
    f.flush()
    os.unlink(f.name)
print("ready", flush=True)
time.sleep(60)
'''


def test_a_disk_measure_reads_a_bounded_number_of_descriptors(tmp_path, monkeypatch):
    """Hundreds of processes holding thousands of descriptors each (dup2 of /dev/null: no memory) made every
    disk measure stat millions of them, on the loop that serves every submission (an honest neighbour took
    94.6 s for 7.6 s). A measure now looks at processes in turn until sandbox.UNLINKED_FDS descriptors are
    seen; a file held open with its name gone is still found, a few measures later."""
    import subprocess

    monkeypatch.setattr(sandbox, "UNLINKED_FDS", 2500)
    folder = tmp_path / "work"
    folder.mkdir()
    procs = [subprocess.Popen([sys.executable, "-c", HOLD_FDS, "2000", *([str(folder)] if i == 5 else [])],
                              stdout=subprocess.PIPE, text=True) for i in range(6)]
    try:
        assert all(p.stdout.readline().strip() == "ready" for p in procs)
        job = type("Job", (), {"limits": None, "pids": lambda self: [p.pid for p in procs]})()
        watch = sandbox.DiskWatch(folder, job)
        looked, found = [], 0
        for _ in range(len(procs)):
            before = set(watch._held)
            found = watch._unlinked()
            looked.append(len(set(watch._held) - before) or 1)
        assert max(looked) <= 2, looked  # 2000 descriptors each: two processes a measure, at most
        assert found >= 1 << 20, found  # the held file, counted once its process's turn came
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_files_nested_past_the_longest_path_are_not_left_out_of_the_measure(tmp_path):
    """Folders of long names made one inside the other by their descriptors reach past the 4096 characters a
    path may hold: the measure could not list them and counted nothing, and 3 GB and 1.4 million files passed
    a 2 GiB cap and a 20,000-entry one. What cannot be read is now over the cap, with a reason."""
    from hpdl import safefiles

    top = tmp_path / "work"
    top.mkdir()
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(20):  # 20 x 251 characters
            os.mkdir("d" * 250, dir_fd=fd)
            inner = os.open("d" * 250, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = inner
        out = os.open("f", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd)
        os.write(out, b"x" * (1 << 20))
        os.close(out)
    finally:
        os.close(fd)
    assert sandbox.disk_usage(str(top), 1000) == sandbox.UNMEASURED
    job = type("Job", (), {"limits": None, "pids": lambda self: []})()
    assert "cannot be measured" in (sandbox.DiskWatch(top, job).over() or "")
    safefiles.remove_tree(str(top))
    assert not top.exists()


def test_a_folder_filling_the_disk_it_shares_is_stopped_under_its_cap(tmp_path):
    """Each folder's cap alone let a submission fill a small TMPDIR (1.5 GiB under its 2 GiB cap): an honest
    neighbour's runner failed on "No space left on device" and scored 0/36. When the disk has less than its
    floor left, a folder holding HEAVY bytes or more is over; a neighbour holding little is not."""
    import subprocess

    if os.geteuid() != 0:
        pytest.skip("mounts a small file system")
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400m", "tmpfs", str(small)]).returncode != 0:
        pytest.skip("no tmpfs could be mounted here")
    try:
        hog, honest = small / "hog", small / "honest"
        hog.mkdir()
        honest.mkdir()
        (honest / "notebook.ipynb").write_bytes(b"x" * (8 << 20))
        with open(hog / "fill", "wb") as f:
            for _ in range(360):
                f.write(bytes(1 << 20))
        job = type("Job", (), {"limits": None, "pids": lambda self: []})()
        why = sandbox.DiskWatch(hog, job).over()
        assert why and "left (it is shared" in why, why
        assert sandbox.DiskWatch(honest, job).over() is None
    finally:
        subprocess.run(["umount", str(small)], check=True)


def test_a_request_of_millions_of_objects_is_refused_before_it_is_built():
    """64 MiB of {"sources": [{}, {}, …]} dropped into a submission's inbox: 22 million objects built, then copied,
    in the grader's own process (8 GB and a core for minutes, outside every cap, on past the submission's time
    limit; the next, honest submission timed out at 24/36). Refused from its shape; an honest request's text,
    4 MiB of source with its files' lines, is read as before."""
    import tracemalloc

    from hpdl.checker import grade_service

    hostile = b'{"exercise": "bcast_binomial", "code": {"sources": [' + b"{}, " * 3_000_000 + b"{}]}}"
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="lists and objects"):
            grade_service._parse_request(hostile)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, peak
    source = "def f(comm, x):\n    return {'a': [x, x]}, \"q\\\\\"\n" * 80_000  # about 4 MiB
    honest = {"exercise": "ring_allreduce", "code": {"source": source, "sources": [{"name": "f", "source": source}],
                                                      "lines": {"f.py": source.splitlines() + [""] * 20_000}}}
    assert grade_service._parse_request(json.dumps(honest).encode()) == honest


def test_a_flood_of_check_requests_is_answered_a_bounded_number_of_times(tmp_path):
    """A notebook past its MAX_REQUESTS checks is told so for MAX_REQUESTS more; then its inbox is not read. Each
    request file in a flood was answered by a file written from the grader's own loop, 10,000 a poll for as long
    as the notebook ran (and each id kept)."""
    from hpdl.checker import grade_service

    service = grade_service.Service(tmp_path / "inbox", hidden=[])
    service.closing = True  # none of the queued ones is started: this is about the flood alone
    for i in range(10 * grade_service.MAX_REQUESTS):
        (tmp_path / "inbox" / f"req-{i:05d}.json").write_text("{}")
    service.poll()
    service.poll()
    answers = os.listdir(tmp_path / "inbox" / grade_service.ANSWERS)
    assert len(answers) == grade_service.MAX_REQUESTS and len(service.seen) == 2 * grade_service.MAX_REQUESTS
    assert "not run" in (tmp_path / "inbox" / grade_service.ANSWERS / sorted(answers)[0]).read_text()
    assert any("were not read" in p for p in service.problems)
    service.finish(wait=0)


@pytest.mark.timeout(120)
def test_a_request_of_escaped_quotes_is_read_in_linear_time_and_memory():
    """A string that never closes, of 1 MiB of \\" (escaped quotes): the regular expression that emptied a request's
    strings started again at each one, holding Python's lock (the grader's loop, every submission's clock) for
    about an hour at 1 MiB (this test's timeout catches it); 64 MiB of newlines in one string took it 3.8 GB.
    Refused now in a few passes over the bytes, the memory a few copies of them at most."""
    import tracemalloc

    from hpdl.checker import grade_service

    hostile = [b'{"exercise": "train_step", "x": "' + b'\\"' * (1 << 19),
               b'{"exercise": "train_step", "code": {"source": "' + b"\n" * (8 << 20) + b'"}}',
               b'["' + b'", "' * (grade_service.MAX_STRINGS + 1) + b'"]']
    for raw in hostile:
        tracemalloc.start()
        try:
            with pytest.raises(ValueError):
                grade_service._parse_request(raw)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 3 * len(raw) + 2**20, (len(raw), peak)
    nested = json.dumps({"source": 'a = "[{,}]" + \'\\\\"\'\n' * 50_000, "list": [[1, 2]] * 100}).encode()
    assert grade_service._parse_request(nested)["list"] == [[1, 2]] * 100  # brackets in strings are not counted


@pytest.mark.timeout(300)
def test_a_checks_jobs_import_nothing_from_the_working_folder(tmp_path, monkeypatch, no_strays):
    """`python -m` puts the working folder first on the import path, and an instructor grading with
    `hpdl grade .` works in the submissions' folder: a learner's folder named numpy there ran in every
    reference rank of every check, outside the sandbox, as the grader (a daemon of it rewrote grades.csv)."""
    import hpdl

    ran = tmp_path / "planted-module-ran"
    planted = tmp_path / "submissions" / "numpy"
    planted.mkdir(parents=True)
    (planted / "__init__.py").write_text(f"open({str(ran)!r}, 'a').write('imported\\n')\n"
                                         "raise ImportError('a learner folder named numpy')\n")
    monkeypatch.chdir(planted.parent)
    result = hpdl.check("ring_allreduce", _learner_function("def ring_allreduce(comm, x):\n"
                                                            "    return comm.allreduce(x)\n"), ranks=[2], timeout=30)
    assert not ran.exists(), ran.read_text()
    assert result.cases and all(c.rejected == "allreduce" for c in result.cases), result
