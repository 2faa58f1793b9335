"""`hpdl rehearse`: the day before the course, N learners' sessions started as the hub or Open OnDemand would.

    hpdl rehearse --site local-slurm --learners 4 [--ranks 4] [--out hpdl-rehearsal] [--timeout 1800]

Each learner is one Slurm job asking what a learner's job asks (cluster/jupyterhub/singleuser.sbatch):
--ranks tasks (default HPDL_HUB_RANKS, as many as lesson 00 starts) with the site profile's
resources per rank, its partition, account, QoS, time and extra sbatch options (a reservation
among them). In the job's batch step, where a learner's JupyterLab runs, a headless kernel runs
lesson 00 (its ranks one srun step of the job, as in JupyterLab), then one exercise's check (the
solution's cells up to its hpdl.check, lesson 03's average_gradients by default); after each cell
the job writes learner-N/result.json.

The table: learner, Slurm job, node, queue wait (Slurm's SubmitTime to StartTime, else the job's
first line), time to ranks ready (job start to the end of the cell where hpdl.start said its ranks
were ready), lesson and check times, pass/fail with the reason (the failing cell named; a learner
out of time named with its job and what it was doing). Printed, and written as index.html and
rehearsal.json in --out; exit status 1 on any failure.

Every job runs as whoever runs the command: the rehearsal tests the site (queue, nodes, modules,
MPI, the kit), not the learners' accounts, homes or quotas. Jobs are named hpdl-rehearse-<n>, a
name `hpdl course end` cancels too; on Ctrl-C, SIGTERM or --timeout every job still listed is
cancelled, and the command waits until Slurm lists none of them.
"""
from __future__ import annotations

import argparse
import html
import json
import os
import pwd
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from datetime import datetime
from pathlib import Path

from hpdl import procs, settings
from hpdl.errors import HpdlError
from hpdl.sites import SlurmSite, load_site, rank_prologue, sbatch_args
from hpdl.tables import html_table

JOB_PREFIX = "hpdl-rehearse-"  # + the learner's number: what `hpdl course end` finds
LESSON = "00_welcome.ipynb"
EXERCISE = "average_gradients"  # lesson 03: quick, and its check runs 1 to 4 ranks as srun steps
KIT = Path(__file__).resolve().parents[1]
CHECK_CALL = re.compile(r"""hpdl\.check\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""")
READY = re.compile(r"hpdl: (\d+) ranks? ready in ([\d.]+) s")
POLL = 2.0  # s between two looks at the jobs
GONE_WAIT = 60.0  # s to wait for cancelled jobs to leave the queue


# -- in each learner's job ---------------------------------------------------------------------------

def _note(folder: Path, state: dict, **fields) -> None:
    """The learner's progress, as a whole file (the command never reads half of one)."""
    state.update(fields, updated=time.time())
    tmp = folder / ".result.tmp"
    tmp.write_text(json.dumps(state))
    os.replace(tmp, folder / "result.json")


def _first_line(cell) -> str:
    line = next((s.strip() for s in cell.source.splitlines() if s.strip()), "")
    return line if len(line) <= 60 else line[:57] + "..."


def _printed_problem(nb, label: str) -> str:
    """A cell that 'worked' but printed that a command is missing (`!hpdl exercises` off PATH)."""
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []) if cell.cell_type == "code" else []:
            text = out.get("text", "") if out.get("output_type") == "stream" else ""
            bad = next((s for s in text.splitlines() if "command not found" in s), "")
            if bad:
                return f"{label}, cell [{i}] ({_first_line(cell)}) printed: {bad.strip()}"
    return ""


def run_notebook(nb, folder: Path, label: str, state: dict, cell_timeout: float) -> str:
    """Run `nb` headless in a fresh kernel, as JupyterLab would; '' or why it failed (the cell named).
    The executed copy is kept in `folder` for a look afterwards."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    at: dict = {"index": None, "line": ""}

    def started(cell, cell_index, **_):
        at.update(index=cell_index, line=_first_line(cell), since=time.time())
        _note(folder, state, phase=f"{label}, cell [{cell_index}]: {at['line']}", phase_since=time.time())

    def executed(cell, cell_index, **_):
        for out in cell.get("outputs", []):
            ready = READY.search(out.get("text", "")) if out.get("output_type") == "stream" else None
            if ready and "ranks_ready_s" not in state:
                _note(folder, state, ranks_ready_s=round(time.time() - state["started"], 1),
                      ranks=int(ready.group(1)), start_reported_s=float(ready.group(2)))

    from hpdl.grade import IOPUB_WAIT  # a busy node's outputs, read after the cell's reply: not dropped at 4 s

    client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3", allow_errors=False,
                            iopub_timeout=IOPUB_WAIT,
                            resources={"metadata": {"path": str(folder)}}, on_cell_start=started,
                            on_cell_executed=executed)
    where = lambda: f"{label}, cell [{at['index']}] ({at['line']})"  # noqa: E731
    try:
        client.execute()
        reason = _printed_problem(nb, label)
    except CellExecutionError as exc:
        reason = f"{where()}: {exc.ename}: {' '.join(str(exc.evalue).split())[:400]}"
    except CellTimeoutError:
        reason = f"{where()} ran longer than {cell_timeout:.0f} s"
    except DeadKernelError as exc:
        reason = f"{where()}: the kernel died ({exc})"
    except Exception as exc:  # the kernel did not start, a notebook that is no notebook: said, not raised
        reason = f"{label}: {type(exc).__name__}: {str(exc)[:400]}"
    nbformat.write(nb, folder / f"{label.replace(' ', '_')}-run.ipynb")
    return reason


def exercise_notebook(exercise: str, kit: Path = KIT):
    """A notebook of the solution's code cells up to the one that checks `exercise` (other checks
    left out): what a learner who solved it runs. Found by the hpdl.check call, not by lesson."""
    import nbformat

    for path in sorted((kit / "solutions").glob("[0-9][0-9]_*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        cells = []
        for cell in (c for c in nb.cells if c.cell_type == "code"):
            called = CHECK_CALL.findall(cell.source)
            if called and exercise not in called:
                continue
            cells.append(cell)
            if exercise in called:
                nb.cells = cells
                return nb
    raise HpdlError(f"no notebook in {kit / 'solutions'} calls hpdl.check({exercise!r}): name an exercise "
                    "whose solution ships with the kit (--exercise), e.g. average_gradients.")


def _check_verdict(results: Path, exercise: str) -> str:
    """'' when every case of the exercise's check passed, else what the check said."""
    lines = results.read_text().splitlines() if results.exists() else []
    mine = [json.loads(s) for s in lines if s.strip() and json.loads(s).get("exercise") == exercise]
    if not mine:
        return f"check {exercise}: the cell ran but hpdl.check recorded no result"
    r = mine[-1]
    if r["passed"]:
        return ""
    bad = next((c for c in r["cases"] if c["verdict"] != "PASS"), {})
    last = next((s.strip() for s in reversed(str(bad.get("details") or "").splitlines()) if s.strip()), "")
    counts = ", ".join(f"{n} {verdict}" for verdict, n in r["counts"].items())
    return (f"check {exercise}: {r['score']:g}/{r['max_score']:g} ({counts}); first failing case "
            f"{bad.get('key', '?')}: {bad.get('verdict', '?')} {' '.join(str(bad.get('message', '')).split())[:300]}"
            + (f" ({last[:200]})" if last else ""))


def learner_main(folder: Path, started: float, exercise: str, cell_timeout: float) -> int:
    """What each learner's job runs in its batch step: lesson 00, then one exercise's check."""
    import nbformat

    state = {"job": os.environ.get("SLURM_JOB_ID", ""), "node": os.environ.get("SLURMD_NODENAME") or
             socket.gethostname(), "tasks": os.environ.get("SLURM_NTASKS", ""), "started": started}
    _note(folder, state, phase="starting the lesson's kernel")
    t0 = time.time()
    reason = run_notebook(nbformat.read(KIT / "notebooks" / LESSON, as_version=4), folder, "lesson 00", state,
                          cell_timeout)
    state["lesson_s"] = round(time.time() - t0, 1)
    if not reason:
        t0 = time.time()
        results = folder / "checks.jsonl"
        os.environ[settings.GRADE_RESULTS.name] = str(results)  # each hpdl.check() result, appended
        try:
            reason = run_notebook(exercise_notebook(exercise), folder, f"check {exercise}", state, cell_timeout)
        except HpdlError as exc:
            reason = str(exc)
        reason = reason or _check_verdict(results, exercise)
        state["check_s"] = round(time.time() - t0, 1)
    _note(folder, state, phase="done", passed=not reason, reason=reason, finished=time.time())
    return 0


# -- the learners' jobs, seen from the command ---------------------------------------------------------

@dataclass
class Learner:
    """One rehearsed learner: its folder, its Slurm job, and what became of it."""

    n: int
    folder: Path
    job: str = ""
    submitted: float = 0.0  # time.time() when sbatch returned
    slurm: dict = field(default_factory=dict)  # the last `scontrol show job` fields seen
    result: dict = field(default_factory=dict)  # the job's result.json
    failure: str = ""  # decided here: never started, ended without a result, out of time
    done: bool = False


def batch_script(site: SlurmSite, learner: Learner, ranks: int, exercise: str, cell_timeout: float,
                 minutes: int) -> str:
    """One learner's job: the hub's resources from the profile, its set-up, the kit's Python."""
    job = replace(site, time=site.time or str(minutes))
    opts = [f"--job-name={JOB_PREFIX}{learner.n}", f"--ntasks={ranks}", f"--output={learner.folder / 'job.out'}",
            f"--chdir={learner.folder}", *sbatch_args(job)]
    folder, bindir = shlex.quote(str(learner.folder)), shlex.quote(os.path.dirname(sys.executable))
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts),
             "hpdl_started=$(date +%s.%N)  # the job's first line: when it left the queue", "umask 077"]
    if site.source != "built-in defaults":
        lines.append(f"export {settings.SITE.name}={shlex.quote(site.source)}")
    prologue = rank_prologue(site)  # the modules and set-up a learner's session gets, as on its ranks
    lines += [prologue] if prologue else []
    lines += [f'export PYTHONPATH={shlex.quote(str(KIT))}${{PYTHONPATH:+:$PYTHONPATH}}  # this kit',
              f"export {settings.HOME.name}={folder}/home {settings.WORKSPACE.name}={folder}/workspace",
              f'export PATH={bindir}:"$PATH" IPP_NONINTERACTIVE=1 PYTHONUNBUFFERED=1 MPLBACKEND=Agg',
              f'echo "hpdl: rehearsal learner {learner.n}: job $SLURM_JOB_ID, $SLURM_NTASKS tasks on '
              f'$SLURM_JOB_NODELIST"',
              f"exec {shlex.quote(sys.executable)} -m hpdl.rehearse _learner {folder} \"$hpdl_started\" "
              f"{shlex.quote(exercise)} {cell_timeout:g}"]
    return "\n".join(lines) + "\n"


def _submit(learner: Learner, script: str, site: SlurmSite) -> None:
    path = learner.folder / "learner.sbatch"
    path.write_text(script)
    p = subprocess.run(["sbatch", "--parsable", str(path)], capture_output=True, text=True, timeout=120)
    if p.returncode:
        asked = "\n    ".join(s for s in script.splitlines() if s.startswith("#SBATCH"))
        raise HpdlError(f"sbatch refused learner {learner.n}'s job: {(p.stderr or p.stdout).strip()}\nFix the "
                        f"[slurm] settings of {site.source}; the job asked for:\n    {asked}")
    learner.job, learner.submitted = p.stdout.strip().split(";")[0], time.time()


def slurm_job(job: str) -> dict | None:
    """`scontrol show job` as fields (JobState, SubmitTime, StartTime, NodeList, Reason, ...);
    None once Slurm has forgotten the job (MinJobAge after it ended); {} if it could not answer."""
    try:
        p = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if p.returncode:
        return None if "Invalid job id" in p.stderr else {}
    return dict(f.split("=", 1) for f in p.stdout.split() if "=" in f)


def _read_result(learner: Learner) -> dict:
    try:
        return json.loads((learner.folder / "result.json").read_text())
    except (OSError, ValueError):
        return learner.result


def _job_tail(learner: Learner, lines: int = 6) -> str:
    path = learner.folder / "job.out"
    text = path.read_text(errors="replace") if path.exists() else ""
    tail = [s for s in text.strip().splitlines() if s.strip()][-lines:]
    return (f"; its output ({path}) ends: " + " | ".join(tail)) if tail else ""


def _doing(learner: Learner) -> str:
    """What a learner's job was doing, for a message: queued (and why), or its last phase."""
    state = learner.slurm.get("JobState", "")
    if state == "PENDING" or not learner.result:
        return f"still pending in the queue (reason: {learner.slurm.get('Reason', '?')})" if state == "PENDING" \
            else f"{(state or 'its state unknown').lower()}, before the learner wrote a word"
    since = learner.result.get("phase_since") or learner.result.get("updated", time.time())
    return f"running {learner.result.get('phase', '?')} (for {time.time() - since:.0f} s)"


def _look(learner: Learner) -> None:
    """One look at one learner: its result, else what Slurm says; decides `done` and `failure`."""
    from hpdl.preflight import NEVER_STARTS

    learner.result = _read_result(learner)
    if learner.result.get("phase") == "done":
        learner.done = True
        learner.slurm = slurm_job(learner.job) or learner.slurm  # its times, before Slurm forgets them
        return
    info = slurm_job(learner.job)
    if info:
        learner.slurm = info
    gone = info is None or info.get("JobState", "") not in ("", "PENDING", "RUNNING", "CONFIGURING", "COMPLETING")
    if gone:
        learner.result = _read_result(learner)  # it may have finished between the two looks
        if learner.result.get("phase") == "done":
            learner.done = True
            return
        learner.failure = (f"Slurm job {learner.job} ended ({learner.slurm.get('JobState', 'gone')}, exit "
                           f"{learner.slurm.get('ExitCode', '?')}) before the learner finished: it was "
                           f"{_doing(learner)}{_job_tail(learner)}")
    elif info.get("JobState") == "PENDING" and info.get("Reason") in NEVER_STARTS:
        learner.failure = (f"Slurm job {learner.job} can never start as asked (reason: {info['Reason']}): fix the "
                           "profile's [slurm] settings or ask for fewer --ranks")
    learner.done = bool(learner.failure)


def watch(team: list[Learner], timeout: float, say=print) -> None:
    """Look at every learner until each is done or `timeout` s (monotonic) have passed."""
    deadline = time.monotonic() + timeout
    while not all(learner.done for learner in team):
        for learner in (x for x in team if not x.done):
            _look(learner)
            if learner.done:
                say(f"  learner {learner.n}: " + ("PASS" if learner.result.get("passed") and not learner.failure
                                                  else "FAIL") + f" (job {learner.job})")
        if time.monotonic() > deadline:
            for learner in (x for x in team if not x.done):
                learner.result = _read_result(learner)
                learner.failure = (f"out of time after {timeout:.0f} s: Slurm job {learner.job} was "
                                   f"{_doing(learner)}; cancelled")
                learner.done = True
            return
        time.sleep(POLL)


def cancel_all(team: list[Learner], wait: float = GONE_WAIT) -> list[str]:
    """Cancel every learner's job Slurm still lists (one that has finished gets 30 s to leave by
    itself: its ranks are stopping); wait until Slurm lists none. Returns the jobs still listed."""
    from hpdl.launchers.slurm import cancel_job, job_state

    listed = {x.job: x for x in team if x.job and job_state(x.job) is not None}
    now = time.monotonic()
    finished_by, deadline, cancelled = now + 30, now + 30 + wait, set()
    while listed and time.monotonic() < deadline:
        for job, learner in listed.items():
            if job not in cancelled and (learner.result.get("phase") != "done" or time.monotonic() > finished_by):
                cancel_job(job)
                cancelled.add(job)
        time.sleep(0.5)
        listed = {j: x for j, x in listed.items() if job_state(j) is not None}
    return list(listed)


# -- the table ------------------------------------------------------------------------------------------

def _slurm_seconds(stamp: str | None) -> float | None:
    try:
        return datetime.fromisoformat(stamp).timestamp() if stamp else None
    except ValueError:  # "Unknown", "None"
        return None


def row(learner: Learner) -> dict:
    """One learner's line of the table, as plain data."""
    r, s = learner.result, learner.slurm
    submit, start = _slurm_seconds(s.get("SubmitTime")), _slurm_seconds(s.get("StartTime"))
    if submit is not None and start is not None and s.get("JobState") != "PENDING":
        wait, source = start - submit, "Slurm SubmitTime → StartTime"
    elif r.get("started"):
        wait, source = float(r["started"]) - learner.submitted, "sbatch → the job's first line"
    else:
        wait, source = None, ""
    reason = learner.failure or r.get("reason", "")
    return {"learner": learner.n, "job": learner.job, "node": r.get("node") or s.get("NodeList") or "",
            "queue_wait_s": None if wait is None else round(max(wait, 0.0), 1), "queue_wait_from": source,
            "ranks_ready_s": r.get("ranks_ready_s"), "ranks": r.get("ranks"), "lesson_s": r.get("lesson_s"),
            "check_s": r.get("check_s"), "passed": bool(r.get("passed")) and not learner.failure,
            "reason": reason, "folder": str(learner.folder)}


COLUMNS = (("learner", "learner"), ("job", "Slurm job"), ("node", "node"), ("queue_wait_s", "queue wait s"),
           ("ranks_ready_s", "ranks ready s"), ("lesson_s", "lesson 00 s"), ("check_s", "check s"))


def _cell(v) -> str:
    return "—" if v is None or v == "" else str(v)


def render(result: dict) -> str:
    """The table for the terminal: one line per learner, the reason under a failing one."""
    head = [h for _, h in COLUMNS] + ["result"]
    body = [[_cell(r[k]) for k, _ in COLUMNS] + ["PASS" if r["passed"] else "FAIL"] for r in result["rows"]]
    widths = [max(len(x) for x in col) for col in zip(head, *body)]
    lines = [f"hpdl rehearse · {result['site']} · {result['learners']} learner(s) × {result['ranks']} ranks as "
             f"{result['user']} · {result['when']}", ""]
    lines.append("  ".join(h.ljust(w) for h, w in zip(head, widths)))
    for r, cells in zip(result["rows"], body):
        lines.append("  ".join(c.ljust(w) for c, w in zip(cells, widths)))
        if not r["passed"]:
            lines.append(f"    → {r['reason']}")
    bad = sum(not r["passed"] for r in result["rows"])
    lines += ["", f"FAIL: {bad} of {len(result['rows'])} learner(s) failed (reasons above)." if bad
              else f"PASS: all {len(result['rows'])} learners ran lesson 00 and the {result['exercise']} check."]
    return "\n".join(lines)


def write_html(result: dict, folder: Path) -> Path:
    """One page, nothing to fetch: the verdict and the table."""
    verdict = "PASS" if result["passed"] else "FAIL"
    head = [h for _, h in COLUMNS] + ["result", "reason"]
    body = [[_cell(r[k]) for k, _ in COLUMNS] + ["PASS" if r["passed"] else "FAIL", r["reason"] or "—"]
            for r in result["rows"]]
    table = html_table(head, body, row_attrs=[{"class": "pass" if r["passed"] else "fail"} for r in result["rows"]])
    page = f"""<!doctype html><meta charset="utf-8"><title>hpdl rehearse: {verdict}</title>
<style>body{{font-family:sans-serif;max-width:90em;margin:2em auto}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}
.pass{{background:#e3f4e3}}.fail{{background:#fbe0e0}}</style>
<h1>hpdl rehearse: <span class="{verdict.lower()}">{verdict}</span></h1>
<p>{html.escape(result['site'])} · {result['learners']} learner(s), one Slurm job each with {result['ranks']} tasks,
all as {html.escape(result['user'])} (the rehearsal tests the site, not the learners' accounts) ·
lesson 00 and the {html.escape(result['exercise'])} check · {html.escape(result['when'])}</p>
{table}
<p>Queue wait: Slurm's SubmitTime to StartTime (else sbatch to the job's first line). Ranks ready: from the
job's start to the end of the cell where hpdl.start reported its ranks ready. Each learner's folder holds
its job script, output, result.json and the executed notebooks.</p>
"""
    (folder / "index.html").write_text(page)
    return folder / "index.html"


# -- the command ------------------------------------------------------------------------------------------

def _prepare(out: Path, learners: int) -> list[Learner]:
    team = []
    for n in range(1, learners + 1):
        folder = out / f"learner-{n}"
        if folder.exists():
            shutil.rmtree(folder)  # the rehearsal's own folder from an earlier run
        (folder / "home").mkdir(parents=True, mode=0o700)
        team.append(Learner(n, folder))
    return team


def run(site: SlurmSite, *, learners: int = 4, ranks: int | None = None, out: Path = Path("hpdl-rehearsal"),
        timeout: float = 1800.0, exercise: str = EXERCISE, say=print) -> dict:
    """Submit the learners' jobs, watch them, cancel what is left; write the report. Returns it."""
    ranks = ranks or settings.HUB_RANKS.get()
    if learners < 1 or ranks < 1 or timeout <= 0:
        raise HpdlError("use --learners ≥ 1, --ranks ≥ 1 and a --timeout in seconds > 0.")
    if not shutil.which("sbatch"):
        raise HpdlError("no Slurm here (sbatch is not on PATH): run this on the cluster's login node "
                        "(or `module load slurm`).")
    exercise_notebook(exercise)  # a name with no solution is said now, not in every job
    out = Path(out).resolve()
    team = _prepare(out, learners)
    user = pwd.getpwuid(os.getuid()).pw_name
    say(f"hpdl rehearse: {learners} learner(s), one Slurm job each ({ranks} tasks), all as {user}: this tests "
        f"the site, not the learners' accounts. Jobs {JOB_PREFIX}1..{learners}; folders in {out}")
    cell_timeout = min(timeout, 900.0)
    try:
        for learner in team:
            _submit(learner, batch_script(site, learner, ranks, exercise, cell_timeout, int(timeout // 60) + 10),
                    site)
        watch(team, timeout, say)
    finally:
        left = cancel_all(team)
    rows = [row(x) for x in team]
    for r in rows:
        if r["job"] in left:
            r["passed"], r["reason"] = False, f"{r['reason']}; Slurm still lists job {r['job']} after scancel"
    result = {"site": f"{site.name} ({site.source})", "learners": learners, "ranks": ranks, "exercise": exercise,
              "user": user, "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
              "passed": all(r["passed"] for r in rows), "rows": rows}
    (out / "rehearsal.json").write_text(json.dumps(result, indent=1))
    return {**result, "html": str(write_html(result, out))}


def main(argv: list[str]) -> int:
    if argv[:1] == ["_learner"]:  # in each learner's job
        return learner_main(Path(argv[1]), float(argv[2]), argv[3], float(argv[4]))
    ap = argparse.ArgumentParser(prog="hpdl rehearse", description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", help="site profile: a name in cluster/sites or a .toml path (default: $HPDL_SITE)")
    ap.add_argument("--learners", type=int, default=4, help="learners to rehearse, one Slurm job each (default 4)")
    ap.add_argument("--ranks", type=int, default=0, help="tasks per learner's job (default: $HPDL_HUB_RANKS, "
                    f"{settings.HUB_RANKS.get()} here; lesson 00 starts 4 ranks)")
    ap.add_argument("--exercise", default=EXERCISE, help=f"the exercise whose check each learner runs ({EXERCISE})")
    ap.add_argument("--out", type=Path, default=Path("hpdl-rehearsal"),
                    help="report folder, on a file system the compute nodes see (default ./hpdl-rehearsal)")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for the whole rehearsal, queue included "
                    "(default 1800); then every job still listed is cancelled")
    args = ap.parse_args(argv)
    site = load_site(args.site)
    with procs.sigterm_exits():  # e.g. `timeout`: cancel the jobs first
        result = run(site, learners=args.learners, ranks=args.ranks or None, out=args.out, timeout=args.timeout,
                     exercise=args.exercise)
    print(render(result) + f"\nreport: {result['html']} (and rehearsal.json)")
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
