"""`hpdl grade`: run every submitted notebook headless and collect its checks.

    hpdl grade SUBMISSIONS_DIR --out report [--timeout 600] [--jobs 1]

Each notebook (SUBMISSIONS_DIR/*.ipynb, or one folder per learner) is copied to a temporary
folder and executed there by nbclient in its own process, in grade mode: every
hpdl.check() in it also runs the hidden cases and appends its result to a file this command
reads. The submission itself is never modified. Each gets its own time limit and its own
HPDL_HOME; when it runs over, or when it ends, its whole process tree is killed (kernel,
engines, check jobs), and anything still carrying its HPDL_HOME, so one hanging or crashing
notebook never stops the batch.

Writes to --out: grades.csv (one row per submission), cases.csv (one row per case),
grades.json (everything), index.html (a summary with details per submission) and
executed/ (each notebook as it ran, with outputs).
"""
from __future__ import annotations

import argparse
import csv
import html
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpdl.errors import HpdlError

CHECK_CALL = re.compile(r"""check\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""")
SKIP_DIRS = {".ipynb_checkpoints", "__pycache__"}


@dataclass
class Submission:
    """One notebook, and what running it gave."""

    name: str  # path relative to the submissions folder
    path: Path
    exercises: list[str] = field(default_factory=list)  # checks the notebook calls
    status: str = "pending"  # ok, timeout, kernel died, error
    detail: str = ""
    seconds: float = 0.0
    checks: dict[str, dict] = field(default_factory=dict)  # exercise -> CheckResult.to_dict()
    cell_errors: int = 0

    def score(self) -> float:
        return sum(c["score"] for c in self.checks.values())


def find_submissions(folder: Path) -> list[Submission]:
    if not folder.is_dir():
        raise HpdlError(f"{folder} is not a folder of submitted notebooks.")
    from hpdl.check.cases import known

    exercises = set(known())
    subs = []
    for path in sorted(folder.rglob("*.ipynb")):
        if SKIP_DIRS & set(path.relative_to(folder).parts):
            continue
        called = [name for name in _called_checks(path) if name in exercises]
        subs.append(Submission(path.relative_to(folder).as_posix(), path, exercises=called))
    if not subs:
        raise HpdlError(f"No notebooks (*.ipynb) in {folder}.")
    return subs


def _called_checks(path: Path) -> list[str]:
    try:
        nb = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    names = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            src = "".join(cell.get("source", "")) if isinstance(cell.get("source"), list) else cell.get("source", "")
            for name in CHECK_CALL.findall(src):
                if name not in names:
                    names.append(name)
    return names


# -- running one notebook (in its own process) ------------------------------------------------

def run_one(notebook: Path, executed: Path, status_file: Path, cell_timeout: float) -> int:
    """Executed in a child process: run the notebook, keep going past failing cells."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    nb = nbformat.read(notebook, as_version=4)
    client = NotebookClient(nb, timeout=int(cell_timeout), kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(notebook.parent)}})
    status = {"status": "ok", "detail": ""}
    try:
        client.execute()
    except CellTimeoutError as exc:
        status = {"status": "timeout", "detail": f"a cell ran longer than {cell_timeout:g} s: {str(exc)[:300]}"}
    except DeadKernelError as exc:
        status = {"status": "kernel died", "detail": str(exc)[:300]}
    except Exception as exc:
        status = {"status": "error", "detail": f"{type(exc).__name__}: {str(exc)[:300]}"}
    errors = sum(1 for c in nb.cells if c.get("cell_type") == "code"
                 for o in c.get("outputs", []) if o.get("output_type") == "error")
    status["cell_errors"] = errors
    nbformat.write(nb, executed)
    status_file.write_text(json.dumps(status))
    return 0


# -- the batch -----------------------------------------------------------------------------------

class Running:
    def __init__(self, sub: Submission, work: Path, out: Path, limit: float, cell_timeout: float):
        self.sub, self.work, self.limit = sub, work, limit
        self.home = work / "hpdl-home"
        self.home.mkdir(parents=True)
        self.copy = work / Path(sub.name).name
        shutil.copyfile(sub.path, self.copy)
        self.results = work / "checks.jsonl"
        self.status = work / "status.json"
        self.executed = out / "executed" / sub.name
        self.executed.parent.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, HPDL_GRADE="1", HPDL_GRADE_RESULTS=str(self.results), HPDL_HOME=str(self.home),
                   IPP_NONINTERACTIVE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1")
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        self.log = open(work / "run.log", "wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpdl.grade", "--run-one", str(self.copy), str(self.executed), str(self.status),
             str(cell_timeout)],
            cwd=work, env=env, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.started = time.time()

    def poll(self) -> bool:
        """True when finished (by itself or by the time limit)."""
        if self.proc.poll() is not None:
            self.finish(timed_out=False)
            return True
        if time.time() - self.started > self.limit:
            self.finish(timed_out=True)
            return True
        return False

    def finish(self, timed_out: bool) -> None:
        sub = self.sub
        sub.seconds = time.time() - self.started
        kill_tree(self.proc.pid, self.home)
        self.proc.wait()
        self.log.close()
        if timed_out:
            sub.status, sub.detail = "timeout", f"stopped after {self.limit:g} s (the submission's time limit)"
        else:
            try:
                st = json.loads(self.status.read_text())
                sub.status, sub.detail, sub.cell_errors = st["status"], st.get("detail", ""), st.get("cell_errors", 0)
            except (OSError, ValueError, KeyError):
                tail = (self.work / "run.log").read_text(errors="replace").strip().splitlines()[-5:]
                sub.status, sub.detail = "error", "the notebook runner failed: " + " | ".join(tail)
        try:
            for line in self.results.read_text().splitlines():
                if line.strip():
                    entry = json.loads(line)
                    sub.checks[entry["exercise"]] = entry  # the last check of an exercise counts
        except (OSError, ValueError):
            pass


def kill_tree(pid: int, home: Path) -> None:
    """Kill a process, everything under it, and any process still carrying this HPDL_HOME
    (a watchman in its own session, engines a killed kernel left behind)."""
    import psutil

    procs = {}
    try:
        root = psutil.Process(pid)
        procs[root.pid] = root
        procs.update({c.pid: c for c in root.children(recursive=True)})
    except psutil.Error:
        pass
    mine = os.getpid()
    for p in psutil.process_iter():
        try:
            if p.pid != mine and p.environ().get("HPDL_HOME") == str(home):
                procs[p.pid] = p
                procs.update({c.pid: c for c in p.children(recursive=True)})
        except psutil.Error:
            continue
    from hpdl.reaper import shared_memory_of

    segments = shared_memory_of(procs)
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    for p in procs.values():
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(list(procs.values()), timeout=5)
    for path in segments:  # MPI ranks killed here never reach MPI_Finalize, which removes these
        try:
            os.unlink(path)
        except OSError:
            pass


def grade(folder: Path, out: Path, limit: float = 600.0, jobs: int = 1, progress: bool = True) -> list[Submission]:
    subs = find_submissions(folder)
    out.mkdir(parents=True, exist_ok=True)
    work_root = Path(tempfile.mkdtemp(prefix="hpdl-grade-"))
    todo = list(enumerate(subs))
    running: list[Running] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(subs), desc="grading", unit="notebook")
    try:
        while todo or running:
            while todo and len(running) < max(1, jobs):
                i, sub = todo.pop(0)
                running.append(Running(sub, work_root / f"{i:04d}", out, limit, cell_timeout=limit))
            for r in list(running):
                if r.poll():
                    running.remove(r)
                    if bar is not None:
                        bar.update(1)
            time.sleep(0.1)
    finally:
        for r in running:
            r.finish(timed_out=True)
        if bar is not None:
            bar.close()
        shutil.rmtree(work_root, ignore_errors=True)
    write_reports(subs, out)
    return subs


# -- reports -------------------------------------------------------------------------------------

def _max_points(subs: list[Submission]) -> dict[str, float]:
    """The points an exercise is worth: as reached by any submission, else from its cases."""
    best: dict[str, float] = {}
    for s in subs:
        for ex, c in s.checks.items():
            best[ex] = max(best.get(ex, 0.0), c["max_score"])
    for ex in {e for s in subs for e in s.exercises} - set(best):
        best[ex] = _planned_points(ex)
    return best


def _planned_points(exercise: str) -> float:
    try:
        from hpdl.check import cases

        module = cases.load(exercise)
        return float(sum(c.points for p in getattr(module, "RANKS", (1, 2, 3, 4)) for c in module.cases(p)))
    except Exception:
        return 0.0


def write_reports(subs: list[Submission], out: Path) -> None:
    worth = _max_points(subs)
    exercises = sorted(worth)
    total = sum(worth.values())
    rows = []
    for s in subs:
        row = {"submission": s.name, "status": s.status, "score": s.score(), "max_score": total,
               "seconds": round(s.seconds, 1), "cell_errors": s.cell_errors, "detail": s.detail}
        for ex in exercises:
            row[ex] = s.checks[ex]["score"] if ex in s.checks else 0.0
        rows.append(row)
    with open(out / "grades.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["submission", "status", "score", "max_score", *exercises, "seconds",
                                          "cell_errors", "detail"])
        w.writeheader()
        w.writerows(rows)
    with open(out / "cases.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["submission", "exercise", "ranks", "case", "hidden", "verdict", "points", "max_points", "message"])
        for s in subs:
            for ex in exercises:
                if ex not in s.checks:
                    w.writerow([s.name, ex, "", "(not reached)", "", "NOT RUN", 0, worth[ex], s.status])
                    continue
                for c in s.checks[ex]["cases"]:
                    w.writerow([s.name, ex, c["ranks"], c["name"], c["hidden"], c["verdict"], c["points"],
                                c["max_points"], c["message"]])
    data = {
        "exercises": {ex: {"max_score": worth[ex]} for ex in exercises},
        "max_score": total,
        "submissions": [
            {"submission": s.name, "status": s.status, "detail": s.detail, "seconds": round(s.seconds, 2),
             "score": s.score(), "max_score": total, "cell_errors": s.cell_errors,
             "checks": s.checks, "not_reached": [ex for ex in exercises if ex not in s.checks]}
            for s in subs
        ],
    }
    (out / "grades.json").write_text(json.dumps(data, indent=1))
    (out / "index.html").write_text(_html(subs, exercises, worth, total))


def _html(subs: list[Submission], exercises: list[str], worth: dict[str, float], total: float) -> str:
    from hpdl.check.report import CheckResult

    e = html.escape
    td = "style='padding:3px 8px;border-bottom:1px solid #d0d7de;text-align:left'"
    head = "".join(f"<th {td}>{e(x)}</th>" for x in ["submission", "status", "score", *exercises, "time"])
    body, details = [], []
    for i, s in enumerate(subs):
        colour = "#1a7f37" if s.status == "ok" else "#cf222e"
        cells = [f"<a href='#s{i}'>{e(s.name)}</a>", f"<span style='color:{colour}'>{e(s.status)}</span>",
                 f"<b>{s.score():g}</b> / {total:g}"]
        for ex in exercises:
            c = s.checks.get(ex)
            cells.append(f"{c['score']:g} / {worth[ex]:g}" if c else f"<span style='color:#57606a'>not reached</span>")
        cells.append(f"{s.seconds:.0f} s")
        body.append("<tr>" + "".join(f"<td {td}>{c}</td>" for c in cells) + "</tr>")
        parts = [f"<h3 id='s{i}'>{e(s.name)} — {s.score():g} / {total:g}</h3>"]
        if s.detail:
            parts.append(f"<p>{e(s.status)}: {e(s.detail)}</p>")
        if s.cell_errors:
            parts.append(f"<p>{s.cell_errors} cell{'s' if s.cell_errors > 1 else ''} raised an error.</p>")
        for ex in exercises:
            if ex in s.checks:
                parts.append(CheckResult.from_dict(s.checks[ex])._repr_html_())
            else:
                parts.append(f"<p>{e(ex)}: not reached (0 / {worth[ex]:g}).</p>")
        details.append("\n".join(parts))
    return (
        "<!doctype html><html><head><meta charset='utf-8'><title>hpdl grades</title></head>"
        "<body style='font-family:system-ui,sans-serif;font-size:14px;margin:20px'>"
        f"<h1>Grades</h1><p>{len(subs)} submissions · {time.strftime('%Y-%m-%d %H:%M')}</p>"
        f"<table style='border-collapse:collapse'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
        + "".join(f"<section>{d}</section>" for d in details)
        + "</body></html>\n"
    )


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--run-one":
        return run_one(Path(argv[1]), Path(argv[2]), Path(argv[3]), float(argv[4]))
    ap = argparse.ArgumentParser(prog="hpdl grade", description="Grade a folder of submitted notebooks.")
    ap.add_argument("submissions", type=Path, help="a folder of notebooks (or of one folder per learner)")
    ap.add_argument("--out", type=Path, default=Path("report"), help="where the reports go (default: ./report)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each notebook may run (default 600)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1; each may start MPI ranks)")
    args = ap.parse_args(argv)
    if args.timeout <= 0 or args.jobs < 1:
        raise HpdlError("--timeout must be positive seconds and --jobs at least 1.")
    subs = grade(args.submissions, args.out, limit=args.timeout, jobs=args.jobs)
    total = _max_points(subs)
    worth = sum(total.values())
    for s in subs:
        print(f"  {s.name:<40} {s.status:<12} {s.score():g} / {worth:g}")
    print(f"hpdl grade: {len(subs)} submissions; reports in {args.out}/ (grades.csv, cases.csv, grades.json, index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
