"""Client side: run a learner's function on fresh MPI ranks and turn what happens into verdicts.

One `mpiexec -n P python -m hpdl.check.worker` job per rank count, all launched at once; each
runs its cases in order. The learner's own engines are never used, so a deadlock cannot
wedge them. This side polls the ranks' status files with deadlines:

- every rank ended the case: PASS, SLOW, WRONG or ERROR from what the ranks reported;
- one rank raised (or made a forbidden call) while others have not ended: a short grace,
  then the others' stacks are read and the job is killed: ERROR without waiting for the
  timeout;
- the case's time is up: the unfinished ranks' stacks are read (their own side thread writes
  them) and the job is killed: HANG, naming stuck ranks, their lines, and the finished ones;
- the job itself ended early (a rank crashed or exited): ERROR.

A killed job is relaunched for the cases it had left. After a HANG at a rank count, the cases
left there are reported as not run in a notebook (the learner fixes the hang first), and run
with a short fuse when grading (correct code finishes these inputs in milliseconds). Every
job's process tree is killed before returning, also on errors and interrupts, the /dev/shm
segments of a killed job are removed, and the workers end themselves should this process die.
"""
from __future__ import annotations

import atexit
import json
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from hpdl.check.cases import Case
from hpdl.check.report import CaseResult, rank_word
from hpdl.launchers import side_job_command
from hpdl.reaper import shared_memory_of

GRACE_AFTER_ERROR = 0.2  # s: let the other ranks end the case on their own before aborting
SHORT_FUSE = 1.0  # s: the time limit for the cases left at a rank count after one hung
START_TIMEOUT = 60.0  # s: for all ranks of a job to import and report ready
POLL = 0.02

_live_jobs: set["Job"] = set()


@dataclass
class Planned:
    index: int
    case: Case
    timeout: float


def _kill_tree(proc: subprocess.Popen, grace: float = 1.0) -> None:
    """End mpiexec and everything under it (proxies, ranks), and reap mpiexec.

    The ranks go first: MPI's process manager then sees them die, reaps them and exits by
    itself, so nothing is left as a zombie. With grace > 0 (a finished job winding down) they
    get SIGTERM first; an aborted job (a HANG, or ranks stuck after one raised) gets SIGKILL.
    """
    import psutil

    try:
        root = psutil.Process(proc.pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        tree = []
    leaves = [p for p in tree if p.pid != proc.pid and not _children(p)]
    steps = [(signal.SIGTERM, leaves, grace)] if grace > 0 else []
    steps += [(signal.SIGKILL, leaves, 1.0), (signal.SIGKILL, tree, 5.0)]
    for sig, targets, wait in steps:
        for p in targets:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        if targets is tree:
            try:
                os.killpg(proc.pid, sig)
            except OSError:
                pass
        deadline = time.time() + wait
        while time.time() < deadline and any(_running(p) for p in tree):
            proc.poll()  # reap mpiexec as soon as it goes
            time.sleep(0.01)
        if not any(_running(p) for p in tree):
            break
    try:
        proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _children(p) -> list:
    import psutil

    try:
        return p.children()
    except psutil.Error:
        return []


def _shared_memory(pid: int) -> set[str]:
    """The /dev/shm segments mapped by the processes under `pid` (MPI's shared-memory transport)."""
    import psutil

    try:
        return shared_memory_of([p.pid for p in psutil.Process(pid).children(recursive=True)])
    except psutil.Error:
        return set()


def _running(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@atexit.register
def _kill_leftovers() -> None:
    for job in list(_live_jobs):
        job.kill()


_MPI_FLAVOUR: dict[str, str] = {}


def mpiexec_command(size: int) -> list[str]:
    """`mpiexec -n size` for this Python's MPI (HpdlError saying what to do when there is none)."""
    from hpdl.launchers import find_mpiexec

    exe = find_mpiexec()
    if exe not in _MPI_FLAVOUR:
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10).stdout
        except (OSError, subprocess.TimeoutExpired):
            out = ""
        _MPI_FLAVOUR[exe] = "openmpi" if "Open MPI" in out or "OpenRTE" in out else "other"
    extra = ["--oversubscribe"] if _MPI_FLAVOUR[exe] == "openmpi" else []
    return [exe, *extra, "-n", str(size)]


class Job:
    """One mpiexec job: `size` ranks working through `todo` cases in order."""

    def __init__(self, spec: dict, size: int, todo: list[Planned], tmp: str):
        self.size = size
        self.todo = list(todo)
        self.dir = tempfile.mkdtemp(prefix=f"p{size}-", dir=tmp)
        self.spec = dict(spec, size=size, client_pid=os.getpid(),
                         deadline=time.time() + START_TIMEOUT + sum(p.timeout for p in todo) + 30,
                         cases=[(p.index, p.case.to_dict()) for p in todo])
        with open(os.path.join(self.dir, "spec.pkl"), "wb") as f:
            pickle.dump(self.spec, f)
        env = dict(os.environ)
        env.pop("HPDL_GRADE_RESULTS", None)
        bindir = str(Path(sys.executable).parent)
        env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HPDL_CHECK_JOB=self.dir,
                   PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}")
        self.output = open(os.path.join(self.dir, "output.txt"), "wb")
        cmd = [*side_job_command(size), sys.executable, "-m", "hpdl.check.worker", self.dir]
        self.proc = subprocess.Popen(cmd, stdout=self.output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        _live_jobs.add(self)
        self.launched = time.time()
        self.offsets = [0] * size
        self.partial = [""] * size
        self.ready: dict[int, int] = {}  # rank -> pid
        self.segments: set[str] = set()  # /dev/shm files of its ranks, removed when it is killed
        self.starts: dict[int, float] = {}  # case index -> earliest start (wall clock)
        self.ends: dict[int, dict[int, dict]] = {}  # case index -> rank -> end event
        self.problem_at: dict[int, float] = {}  # case index -> when the first rank raised
        self.crash: dict | None = None
        self.must_stop = False
        self.hung = False

    # -- reading the ranks' reports ---------------------------------------------------------
    def read(self) -> None:
        for r in range(self.size):
            path = os.path.join(self.dir, f"rank{r}.jsonl")
            try:
                with open(path, "rb") as f:
                    f.seek(self.offsets[r])
                    data = f.read()
            except OSError:
                continue
            self.offsets[r] += len(data)
            text = self.partial[r] + data.decode("utf-8", "replace")
            *lines, self.partial[r] = text.split("\n")
            for line in lines:
                if line.strip():
                    self._event(r, json.loads(line))

    def _event(self, rank: int, ev: dict) -> None:
        kind = ev.get("ev")
        if kind == "ready":
            self.ready[rank] = ev["pid"]
            # remembered now: should the job die before kill() (MPI aborting every rank when
            # one fails), nothing would map them any more by then
            self.segments |= shared_memory_of([ev["pid"]])
        elif kind == "start":
            self.starts[ev["case"]] = min(ev["t"], self.starts.get(ev["case"], ev["t"]))
        elif kind == "end":
            self.ends.setdefault(ev["case"], {})[rank] = ev
            if ev.get("status") in ("error", "forbidden"):
                self.problem_at.setdefault(ev["case"], time.time())
        elif kind == "crash" and self.crash is None:
            self.crash = dict(ev, rank=rank)

    # -- deciding ---------------------------------------------------------------------------
    def step(self, runner: "Runner") -> list[tuple[Planned, CaseResult]]:
        """Read reports and decide what can be decided; may mark the job for stopping."""
        decided = []
        self.read()
        exited = self.proc.poll() is not None
        if exited:
            self.read()
        while self.todo and not self.must_stop:
            cur = self.todo[0]
            ends = self.ends.get(cur.index, {})
            now = time.time()
            if len(ends) == self.size:
                decided.append((cur, runner.from_ends(cur, self.size, ends)))
                self.todo.pop(0)
                continue
            if self.crash is not None:
                decided.append((cur, runner.internal_error(cur, self.size, self.crash)))
                self.todo.pop(0)
                self.must_stop = True
            elif cur.index in self.problem_at and now - self.problem_at[cur.index] > GRACE_AFTER_ERROR and not exited:
                where = self.stacks([r for r in range(self.size) if r not in ends])
                decided.append((cur, runner.from_ends(cur, self.size, ends, left_waiting=where)))
                self.todo.pop(0)
                self.must_stop = True
            elif cur.index in self.starts and now - self.starts[cur.index] > cur.timeout and not exited:
                stuck = [r for r in range(self.size) if r not in ends]
                where = self.stacks(stuck)
                decided.append((cur, runner.hang(cur, self.size, ends, where, now - self.starts[cur.index])))
                self.todo.pop(0)
                self.must_stop = self.hung = True
            elif exited:
                decided.append((cur, runner.died(cur, self.size, ends, self.ready, self.output_tail())))
                self.todo.pop(0)
                self.must_stop = True
            elif cur.index not in self.starts and now - self.launched > START_TIMEOUT:
                decided.append((cur, runner.no_start(cur, self.size, self.ready, self.output_tail())))
                self.todo.pop(0)
                self.must_stop = True
            break
        return decided

    def stacks(self, ranks: list[int], wait: float = 1.0) -> dict[int, dict]:
        """Ask ranks where they are; their side thread answers within ~50 ms."""
        if not ranks:
            return {}
        token = uuid.uuid4().hex
        req = os.path.join(self.dir, "dump-request")
        with open(req + ".tmp", "w") as f:
            f.write(token)
        os.replace(req + ".tmp", req)
        found: dict[int, dict] = {}
        deadline = time.time() + wait
        while time.time() < deadline and len(found) < len(ranks):
            for r in ranks:
                if r in found:
                    continue
                try:
                    with open(os.path.join(self.dir, f"stack{r}.json")) as f:
                        data = json.load(f)
                except (OSError, ValueError):
                    continue
                if data.get("token") == token:
                    found[r] = data
            time.sleep(0.02)
        missing = [r for r in ranks if r not in found and r in self.ready]
        if missing:  # the side thread could not run: ask faulthandler (works while the GIL is held)
            for r in missing:
                try:
                    os.kill(self.ready[r], signal.SIGUSR1)
                except OSError:
                    pass
            time.sleep(0.3)
            for r in missing:
                found[r] = _parse_faulthandler(os.path.join(self.dir, f"rank{r}.fault"), self.spec["code"])
        return found

    def output_tail(self, lines: int = 12) -> str:
        try:
            text = Path(self.dir, "output.txt").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def finished(self) -> bool:
        return not self.todo or self.must_stop

    def kill(self) -> None:
        segments = _shared_memory(self.proc.pid) | self.segments
        try:
            _kill_tree(self.proc, grace=0.0 if self.must_stop else 0.5)
        finally:
            self.output.close()
            _live_jobs.discard(self)
            for path in segments:  # MPI unlinks these at MPI_Finalize, which a killed rank never reaches
                try:
                    os.unlink(path)
                except OSError:
                    pass

    def wind_down(self, wait: float = 1.0) -> None:
        """All cases decided: let the ranks exit on their own briefly, then end the tree."""
        if not self.must_stop:
            try:
                self.proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        self.kill()


def _parse_faulthandler(path: str, code: dict) -> dict:
    files = set(code.get("lines", {})) | {code["filename"]}
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return {}
    hits = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
    ours = [(f, int(n), fn) for f, n, fn in hits if f in files]
    if not ours:
        return {}
    f, n, fn = ours[0]  # faulthandler lists the innermost frame first
    lines = code.get("lines", {}).get(f, [])
    text_line = lines[n - 1].strip() if 0 < n <= len(lines) else ""
    n += int(code.get("line_offset", 0))
    return {"where": {"file": f, "line": n, "func": fn, "code": text_line}, "phase": "learner"}


def where_text(w: dict | None) -> str:
    """'line 12 in ring_allreduce: comm.Recv(buf, source=left)'."""
    if not w:
        return "(no line found)"
    code = f": {w['code']}" if w.get("code") else ""
    return f"line {w['line']} in {w['func']}{code}"


def _group(where: dict[int, dict], with_call: bool = True) -> list[str]:
    """Group ranks that sit on the same line: ['ranks 0–3 at line 12 in f: comm.Recv(...)']."""
    groups: dict[str, list[int]] = {}
    for r, info in sorted(where.items()):
        phase = (info or {}).get("phase")
        if phase == "waiting":
            text = "(finished the case, waiting for the others)"
        elif phase == "verify" and not (info or {}).get("where"):
            text = "(your function returned; the checker's comparison across ranks waits for the others)"
        elif phase in ("reference", "inputs") and not (info or {}).get("where"):
            text = f"(in the checker's {phase} step, before your function ran)"
        else:
            w = (info or {}).get("where")
            text = where_text(w)
            call = (info or {}).get("call")
            name = call.split("(")[0] if call else ""
            if with_call and name and name.split(".")[-1] not in ((w or {}).get("code") or ""):
                text += f" (inside {name}())"
        groups.setdefault(text, []).append(r)
    return [f"{rank_word(rs)} at {text}" for text, rs in groups.items()]


class Runner:
    """Plans the jobs of one check, runs them side by side, and builds the case results."""

    def __init__(self, exercise: str, module, spec: dict, plan: dict[int, list[Planned]], progress=None,
                 every_case: bool = True):
        self.every_case = every_case  # grading: run cases left after a HANG too (with a short fuse)
        self.exercise = exercise
        self.module = module
        self.spec = spec
        self.plan = plan
        self.progress = progress

    def run(self) -> dict[int, CaseResult]:
        results: dict[int, CaseResult] = {}
        tmp = tempfile.mkdtemp(prefix="hpdl-check-")
        jobs: list[Job] = []
        try:
            jobs = [Job(self.spec, size, todo, tmp) for size, todo in self.plan.items() if todo]
            while jobs:
                for job in list(jobs):
                    for planned, result in job.step(self):
                        results[planned.index] = result
                        if self.progress is not None:
                            self.progress.update(1)
                    if job.finished():
                        jobs.remove(job)
                        job.wind_down()
                        todo = job.todo
                        if todo and job.hung and not self.every_case:
                            hung = results[max(i for i in results if results[i].ranks == job.size and results[i].verdict == "HANG")]
                            for p in todo:
                                results[p.index] = self.not_run_after_hang(p, job.size, hung)
                                if self.progress is not None:
                                    self.progress.update(1)
                            todo = []
                        if todo:
                            if job.hung:
                                todo = [Planned(p.index, p.case, min(p.timeout, SHORT_FUSE)) for p in todo]
                            jobs.append(Job(self.spec, job.size, todo, tmp))
                time.sleep(POLL)
        finally:
            for job in jobs:
                job.kill()
            if not os.environ.get("HPDL_CHECK_KEEP"):
                shutil.rmtree(tmp, ignore_errors=True)
        return results

    # -- building results -------------------------------------------------------------------
    def _result(self, planned: Planned, size: int, verdict: str, message: str, **kw) -> CaseResult:
        c = planned.case
        earns = verdict in ("PASS", "SLOW")
        return CaseResult(self.exercise, c.name, size, verdict, c.points if earns else 0.0, c.points,
                          hidden=c.hidden, message=message, params=dict(c.params), **kw)

    def from_ends(self, planned: Planned, size: int, ends: dict[int, dict], left_waiting: dict | None = None) -> CaseResult:
        by = {s: sorted(r for r, e in ends.items() if e.get("status") == s) for s in ("ok", "wrong", "error", "forbidden")}
        seconds = max((e.get("seconds") or 0.0 for e in ends.values()), default=0.0)
        waiting = ""
        if left_waiting:
            waiting = " Left waiting for it: " + "; ".join(_group(left_waiting)) + " (the job was aborted)."
        if by["error"]:
            first = ends[by["error"][0]]
            same = all(ends[r].get("message") == first.get("message") for r in by["error"])
            if all(ends[r].get("exception") == "NotImplementedError" for r in by["error"]) and len(by["error"]) == size:
                msg = "Not written yet: your function raises NotImplementedError. Replace the placeholder with your code."
                return self._result(planned, size, "ERROR", msg, error_ranks=by["error"], line=first.get("where"),
                                    seconds=seconds)
            who = rank_word(by["error"]) if same else f"rank {by['error'][0]}"
            where = first.get("where")
            at = f" at {where_text(where)}" if where else f" when called as {self._signature()}"
            msg = f"{who} raised {first.get('message')}{at}.{waiting}"
            details = "\n".join(first.get("traceback") or [])
            return self._result(planned, size, "ERROR", msg, error_ranks=by["error"], line=where,
                                seconds=seconds, details=details, stuck=_stuck_text(left_waiting))
        if by["forbidden"]:
            first = ends[by["forbidden"][0]]
            at = f" ({where_text(first.get('where'))})" if first.get("where") else ""
            msg = f"Rejected: {first.get('message')}{at}.{waiting}"
            return self._result(planned, size, "WRONG", msg, wrong_ranks=by["forbidden"], line=first.get("where"),
                                seconds=seconds)
        if by["wrong"]:
            worst = max(by["wrong"], key=lambda r: (ends[r].get("max_error") is not None, ends[r].get("max_error") or 0))
            w = ends[worst]
            hint = w.get("hint") or next((ends[r].get("hint") for r in by["wrong"] if ends[r].get("hint")), None)
            if size > 1 and by["ok"] == [0] and by["wrong"] == list(range(1, size)):
                hint = getattr(self.module, "HINT_ONLY_ROOT", None) or (
                    "only rank 0 ends with the right result; every rank must return it.")
            err = w.get("max_error")
            largest = f" Largest error {err:.3g} (rank {worst})." if err is not None else ""
            msg = f"Wrong on {rank_word(by['wrong'])}: {w.get('message')}.{largest}"
            if len(by["wrong"]) > 1 and w.get("message") != ends[by["wrong"][0]].get("message"):
                msg = f"Wrong on {rank_word(by['wrong'])}; rank {worst}: {w.get('message')}.{largest}"
            return self._result(planned, size, "WRONG", msg, hint=hint, wrong_ranks=by["wrong"],
                                max_error=err, seconds=seconds)
        ref = max((e.get("reference_seconds") or 0.0 for e in ends.values()), default=0.0)
        if seconds > planned.case.slow_factor * ref + 0.25:
            msg = (f"Right result, but slow: {seconds:.2f} s where the reference took {ref:.3f} s "
                   "(advisory; no points lost).")
            return self._result(planned, size, "SLOW", msg, seconds=seconds)
        return self._result(planned, size, "PASS", "", seconds=seconds)

    def hang(self, planned: Planned, size: int, ends: dict, where: dict[int, dict], elapsed: float) -> CaseResult:
        stuck = sorted(where) if where else sorted(set(range(size)) - set(ends))
        finished = sorted(ends)
        lines = _group({r: where.get(r, {}) for r in stuck})
        msg = f"Not finished after {planned.timeout:g} s: " + "; ".join(lines) + "."
        msg += f" Finished: {rank_word(finished)}." if finished else " No rank finished."
        problems = [r for r, e in ends.items() if e.get("status") != "ok"]
        if problems:
            msg += f" ({rank_word(problems)} ended with: {ends[problems[0]].get('message')})"
        hint = ("a rank waits for a message no one sends, or in a collective that not every rank calls. "
                "Check that every Send has a matching Recv, and that the ranks do not all wait to receive "
                "(or all send large messages with blocking sends) at the same time: Sendrecv avoids both.")
        return self._result(planned, size, "HANG", msg, hint=hint, stuck=_stuck_text(where), finished=finished,
                            seconds=elapsed, line=next((w.get("where") for w in where.values() if w and w.get("where")), None))

    def not_run_after_hang(self, planned: Planned, size: int, hung: CaseResult) -> CaseResult:
        msg = (f"Not run: case {hung.name} already hung at {size} ranks (fix that first; grading runs every case).")
        return self._result(planned, size, "HANG", msg)

    def died(self, planned: Planned, size: int, ends: dict, ready: dict, output: str) -> CaseResult:
        gone = sorted(set(range(size)) - set(ends))
        msg = (f"The MPI job ended before {rank_word(gone)} finished this case: a rank exited or crashed "
               "(os._exit, a segfault, or MPI Abort); MPI then ends all ranks of the job.")
        if not ready:
            msg = "The ranks did not start."
        return self._result(planned, size, "ERROR", msg, error_ranks=gone, details=output)

    def no_start(self, planned: Planned, size: int, ready: dict, output: str) -> CaseResult:
        msg = (f"Only {len(ready)} of {size} ranks started within {START_TIMEOUT:g} s; the machine may be busy, "
               "or MPI is broken (run `hpdl doctor`).")
        return self._result(planned, size, "ERROR", msg, details=output)

    def internal_error(self, planned: Planned, size: int, crash: dict) -> CaseResult:
        msg = f"The checker itself failed on rank {crash.get('rank')}: {crash.get('message')} (not your fault; please report it)."
        return self._result(planned, size, "ERROR", msg, details=crash.get("traceback", ""))

    def _signature(self) -> str:
        return getattr(self.module, "SIGNATURE", f"{self.exercise}(comm, ...)")


def _stuck_text(where: dict | None) -> dict[int, str]:
    if not where:
        return {}
    return {r: where_text((w or {}).get("where")) for r, w in where.items()}


__all__ = ["Runner", "Planned", "Job", "mpiexec_command", "where_text"]
