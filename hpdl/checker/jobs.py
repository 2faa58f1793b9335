"""Client side: run a check's jobs and turn what happens into verdicts.

Per rank count, two MPI jobs side by side, on this node through its mpiexec, also inside a
Slurm allocation (how they start: runner.py):

    learner job    learner_job.py   the learner's function on the cases' inputs, every MPI call
                                    recorded; sandboxed (sandbox.py) where bubblewrap works
    reference job  reference_job.py the same inputs through the case module's reference(); then,
                                    case by case, verify() on the learner's outputs

This process only reads the learner's events (JSON lines, parsed defensively) and copies the
learner's output bytes to the reference job, which reads them as plain data; the verdict of a
case whose ranks all returned comes from the reference job. The rules, polled with deadlines:

- every learner rank returned: its outputs go to the reference job, whose verify() decides PASS,
  WRONG or SLOW;
- a learner rank raised, or made a forbidden call: ERROR or WRONG (rejected), after a short grace
  for the others, whose stacks are read before the learner job is killed;
- the case's time is up: HANG, naming stuck ranks, their lines, and the finished ones;
- the learner job ended early (a rank crashed or exited): ERROR.

A killed learner job is relaunched for the cases it had left (the reference job goes on: it
skips the cases decided without it). After a HANG the cases left at that rank count are reported
as not run in a notebook, and run with a short fuse when grading. Every job's process tree is
killed before returning, also on errors and interrupts; the /dev/shm segments of killed jobs
are removed; and the ranks end themselves should this process die.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hpdl import hang, procs, safefiles, scratch, settings, sidejob
from hpdl.checker import hold, isolate, meter, sandbox
from hpdl.checker.cases import Case, with_nonce
from hpdl.checker.report import CaseResult, Verdict
from hpdl.checker.runner import job_launch, shared_server
from hpdl.hang import rank_word

GRACE_AFTER_ERROR = 0.2  # s: let the other ranks end the case on their own before aborting
SHORT_FUSE = 1.0  # s: the time limit for the cases left at a rank count after one hung
START_TIMEOUT = 60.0  # s: for all ranks of a job to import and report ready
VERIFY_TIMEOUT = 60.0  # s: for the reference job's verify() once the learner's outputs are in
MAX_EVENT_BYTES = 1 << 20  # one event line from a learner's rank; longer ones are cut
MAX_OUTPUT_BYTES = 512 * 2**20  # one rank's packed outputs for one case
POLL = 0.02
SERVER_LISTENS = 10.0  # s for the reference jobs' fork server to listen; else each job starts its ranks
MAX_SOCKETS = 1024  # sockets a rank's set_up() may name (METERED)
_TAG = re.compile(r"[A-Za-z0-9_]{1,32}")  # a barrier's name (learner_job.barrier): the learner's word, so checked
_CALIBRATED = re.compile(r"calibrated_(\d{1,6})")  # the barrier after a case's calibrate() (learner_job)
_PAUSE_TAG = re.compile(r"[a-z][a-z0-9_]{0,15}")  # a reading's name in a case (cases.read_wire_here)
MAX_PAUSES = 32  # readings one case may take (each waits for the wire to be still: ~0.15 s), and other asks
MAX_TAGS = 256  # barriers' names a job may use (its own take ~3 a case): more are the learner's, not answered


def verify_timeout(spec: dict) -> float:
    """The reference job's time for verify(): longer for a module whose verify() runs a job (VERIFY_TIMEOUT)."""
    return max(VERIFY_TIMEOUT, float(spec.get("verify_timeout") or 0))


@dataclass
class Planned:
    index: int
    case: Case
    timeout: float


# -- one mpiexec job -----------------------------------------------------------------------------

class Job:
    """One mpiexec job: `size` ranks of `module` working through `todo` cases in order."""

    def __init__(self, kind: str, spec: dict, size: int, todo: list[Planned], tmp: str, sandboxed: bool,
                 private: dict[int, bytes] | None = None, oracle: dict[int, bytes] | None = None,
                 server: str | None = None, group: sandbox.Cgroup | None = None,
                 disk_bytes: int = sandbox.DISK_BYTES):
        self.kind, self.size, self.todo, self.sandboxed = kind, size, list(todo), sandboxed
        self.dir = tempfile.mkdtemp(prefix=f"{kind[0]}{size}-", dir=tmp)
        os.chmod(self.dir, 0o700)
        slack = verify_timeout(spec) if kind == "reference" else 30
        metered = kind == "learner" and spec.get("metered") and size > 1
        wire_env, unmetered = meter.node_transport(spec.get("library_algorithms")) if metered else (None, None)
        self.spec = dict(spec, size=size, metered=wire_env is not None, client_pid=0 if sandboxed else os.getpid(),
                         lifetime=START_TIMEOUT + sum(p.timeout for p in todo) + slack * len(todo) + 30,
                         cases=[(p.index, p.case.to_dict()) for p in todo])
        if kind == "reference":
            self.spec.pop("code", None)  # the learner's code never enters the reference job
        else:
            self.spec.pop("module_path", None)  # the learner's job holds the public part only
            self.spec.pop("nonce", None)  # each rank gets its own inputs instead (PRIVATE_INPUTS)
            self.spec["private"], self.spec["oracle"] = private is not None, oracle is not None
            for rank in range(size):  # each rank's own folder: in a sandbox, the only one it sees (isolate.py)
                os.mkdir(self.rank_dir(rank), 0o700)
            for name, files in (("in", private), ("oracle", oracle)):  # read and removed before the learner's code
                for rank, data in (files or {}).items():
                    safefiles.create_exclusive(os.path.join(self.rank_dir(rank), f"{name}-{rank}.bin"), data)
        module = "hpdl.checker.learner_job" if kind == "learner" else "hpdl.checker.reference_job"
        # in a sandbox on this node, each learner rank makes a view of its own before any learner's code;
        # sharing no memory, the ranks then talk over TCP
        tcp = meter.tcp_transport() if kind == "learner" and sandboxed and sandbox.isolation_works() else None
        env = {**_job_env(self.dir, keys=kind != "learner"), **(tcp or {}), **(wire_env or {})}  # keys: the reference's
        launch = job_launch(size, module, self.dir, env,  # here
                            preload=(spec.get("preload") or {}).get(kind, []), apart=tcp is not None, server=server)
        cmd, env, self.through_batch = launch.cmd, launch.env, launch.through_batch
        self.isolated = tcp is not None and not launch.through_batch
        self.spec["isolate"] = self.isolated
        safefiles.create_exclusive(os.path.join(self.dir, "spec.pkl"), pickle.dumps(self.spec))
        if kind == "learner":
            cmd = sandbox.wrap(cmd, writable=[self.dir], hidden=spec.get("hidden", []), replaced=spec.get("replaced"),
                               network=bool(launch.through_batch), keep_env=launch.kept, isolating=self.isolated)
        # the reference ranks read what the learner's returned: capped too, so no output can make them take
        # the host's memory (where they are forks of the check's server, they are in its cgroup instead)
        self.limits = limits = job_limits([size], [todo], group) if kind == "learner" or server is None else None
        # a sandbox (own /dev/shm, PIDs) dies with us; outside, ranks watch us and free their MPI memory (rank_job)
        learner = kind == "learner"
        self.side = sidejob.SideJob(cmd, output=os.path.join(self.dir, "output.txt"), env=env, cwd=self.dir,
                                    limits=limits, shared_memory=not sandboxed, sweep=learner and not sandboxed,
                                    ends_with_starter=learner and sandboxed)
        # a learner job's one writable folder is the host's: what its files take on disk is capped as it runs
        self.disk = sandbox.DiskWatch(self.dir, self.side, limit=disk_bytes) if learner else None
        self.launched = time.monotonic()
        self.offsets, self.partial = [0] * size, [""] * size
        self.ready: dict[int, int] = {}  # rank -> pid
        self.rank_procs: dict[int, procs.Proc] = {}  # rank -> recorded process (outside a sandbox)
        self.starts: dict[int, float] = {}  # case index -> earliest start (monotonic clock)
        self.ends: dict[int, dict[int, dict]] = {}  # case index -> rank -> end event
        self.problem_at: dict[int, float] = {}  # case index -> when the first rank raised
        self.crash: dict | None = None
        self.must_stop = self.hung = False
        self.arrived: dict[str, set[int]] = {}  # barrier tag -> ranks that reached it (learner_job.barrier)
        self._metering(unmetered)

    def _metering(self, unmetered: str | None) -> None:
        """METERED: what the checker learns of the learner's ranks from the kernel, before and while they run."""
        self.meter: meter.Meter | None = None  # the learner's bytes on the wire, once its ranks are ready
        self.meter_problem = unmetered  # why the wire could not be read
        self.host_pids: dict[int, int] = {}  # rank -> its pid as this process sees it
        self.grouped: dict[int, set[int]] = {}  # rank -> the sockets its case module's set_up() opened
        self.calibration: dict[int, dict] = {}  # case -> segments one all-reduce took, before any learner's code
        self.window: int | None = None  # the case whose bytes the meter counts now (since its last reading)
        self.holding: hold.Hold | None = None  # a rank held still (hold.py), for the case in the window
        self.held: dict[int, dict | None] = {}  # case -> what each rank sent while its last rank was held
        self.passing: dict[int, set[int]] = {}  # case ("hold": "here") -> ranks past its mark before the let-go
        self.pausing: dict[tuple[int, str], set[int]] = {}  # (case, tag) -> ranks waiting there so far
        self.pauses: list[hold.Pause] = []  # every rank waits at these: read the wire, first come first
        self.paused: dict[int, dict[str, dict | None]] = {}  # case -> tag -> rank -> its bytes (hold.readings)
        self.peak = None  # the job's cgroup's memory peak, reset when the window opened (Cgroup.open_peak)
        self.peak_base: int | None = None  # and what the job held then
        self.rank_groups: dict[int, sandbox.Cgroup] = {}  # rank -> a memory cgroup of its own, inside the job's
        self.rank_peaks: dict[int, tuple] = {}  # rank -> (its cgroup's peak, reset then; what it held then)

    def rank_dir(self, rank: int) -> str:
        """Where rank `rank` of this job keeps its files: its own folder in a learner job, else the job's."""
        return isolate.rank_dir(self.dir, rank) if self.kind == "learner" else self.dir

    def release(self, name: str, ranks: list[int] | None = None) -> None:
        """Let every rank (or these) go on past the point it waits for `name` at (a file in its own folder)."""
        for r in range(self.size) if ranks is None else ranks:
            path = os.path.join(self.rank_dir(r), name)
            if not os.path.lexists(path):  # the rank's folder: the learner may have put one there
                try:
                    safefiles.create_exclusive(path, b"")
                except OSError:
                    pass

    # -- reading the ranks' reports (from the learner's side: untrusted, parsed defensively) -------
    def read(self) -> None:
        for r in range(self.size):
            path = os.path.join(self.rank_dir(r), f"rank{r}.jsonl")
            try:  # the learner's folder: a FIFO or a link to /dev/zero there is not read
                data = safefiles.read_bounded(path, 16 * MAX_EVENT_BYTES, offset=self.offsets[r], too_large="cut")
            except OSError:
                continue
            self.offsets[r] += len(data)
            text = self.partial[r] + data.decode("utf-8", "replace")
            *lines, self.partial[r] = text.split("\n")
            self.partial[r] = self.partial[r][-MAX_EVENT_BYTES:]
            for line in lines:
                try:
                    ev = safefiles.json_of(line[:MAX_EVENT_BYTES]) if line.strip() else None
                except ValueError:
                    ev = None
                if isinstance(ev, dict):
                    self._event(r, ev)

    def _event(self, rank: int, ev: dict) -> None:
        kind = ev.get("ev")
        case = ev.get("case")
        if kind == "ready" and isinstance(ev.get("pid"), int) and rank not in self.ready:
            self.ready[rank] = ev["pid"]
            # a sandbox has its own PIDs and /dev/shm, gone with it. Outside one, the pid is the
            # learner's word: only a process of this job's own tree is recorded (to be signalled
            # by hang.ask, its /dev/shm removed), never another one it names (the grader, say)
            if not self.sandboxed and ev["pid"] in self.side.pids():
                rec = procs.record(ev["pid"])
                if rec is not None:
                    self.rank_procs[rank] = rec
                # remembered now: should the job die before it is ended (MPI aborting every rank
                # when one fails), nothing would map them any more by then
                self.side.segments |= procs.shared_memory_of([ev["pid"]])
            if self.spec.get("metered"):  # written before any learner's code ran (learner_job)
                pid = meter.host_pid(ev["pid"], self.side.pids())
                if pid is not None:
                    self.host_pids[rank] = pid
                sockets = ev.get("set_up_sockets")
                if isinstance(sockets, list) and all(isinstance(i, int) for i in sockets[:MAX_SOCKETS]):
                    self.grouped[rank] = set(sockets[:MAX_SOCKETS])
        elif (kind == "at" and isinstance(ev.get("tag"), str) and _TAG.fullmatch(ev["tag"])  # a file's name
              and (ev["tag"] in self.arrived or len(self.arrived) < MAX_TAGS)):
            arrived = self.arrived.setdefault(ev["tag"], set())
            arrived.add(rank)
            if len(arrived) == self.size:
                calibrated = _CALIBRATED.fullmatch(ev["tag"])
                if calibrated:
                    self.calibrate(int(calibrated.group(1)))
                self.release(f"go-{ev['tag']}")
        elif kind == "hold" and isinstance(case, int):
            self.hold(rank, case)
        elif kind == "pause" and isinstance(case, int) and isinstance(ev.get("tag"), str):
            self.pause(rank, case, ev["tag"])
        elif kind == "passed" and isinstance(case, int):
            self.note_passed(rank, case)
        elif kind == "start" and isinstance(case, int) and isinstance(ev.get("t"), (int, float)):
            self.starts.setdefault(case, time.monotonic())
        elif kind == "end" and isinstance(case, int):
            self.ends.setdefault(case, {})[rank] = ev
            if ev.get("status") in ("error", "forbidden"):
                self.problem_at.setdefault(case, time.monotonic())
        elif kind == "crash" and self.crash is None:
            self.crash = dict(ev, rank=rank)

    def exited(self) -> bool:
        return not self.side.running()

    def stacks(self, ranks: list[int], code: dict, wait: float = 1.0) -> dict[int, dict]:
        """Ask ranks where they are (hpdl.hang's protocol, the same as for `%%px` cells)."""
        self.let_go()  # a rank held still answers nothing
        answers = hang.ask(self.rank_dir, ranks, wait=wait, procs=None if self.sandboxed else self.rank_procs,
                           files=set(code.get("lines", {})) | {code.get("filename", "")},
                           sources=code.get("lines", {}), line_offset=int(code.get("line_offset", 0)))
        return {r: _clean_stack(a) for r, a in answers.items() if isinstance(a, dict)}

    def output_tail(self, lines: int = 12) -> str:
        return "\n".join(self.side.output_text(8192).strip().splitlines()[-lines:])

    def end(self) -> None:
        """End the job now: its result is decided (or it hung), nothing it does next counts."""
        self.let_go()
        self.close_memory_window()
        self.side.end(now=True)

    def wind_down(self, wait: float = 1.0) -> None:
        """All cases decided: let the ranks exit on their own briefly (MPI_Finalize), then end it."""
        self.let_go()
        self.close_memory_window()
        if not self.must_stop:
            self.side.wait(timeout=wait)
        self.side.end(now=self.must_stop)

    @property
    def live(self) -> bool:
        return self.side in sidejob.live()

    def start_meter(self) -> None:
        """METERED: every rank is ready and waiting; read the wire's counters, then let them go on.
        Where they cannot be read (a rank's process not found, no ss), the check decides on the
        recorder alone, as for an MPI the kit does not meter."""
        started = self.meter is not None or self.meter_problem is not None
        if not self.spec.get("metered") or started or len(self.ready) < self.size:
            return
        self.meter_problem = "a rank's process was not found" if len(self.host_pids) < self.size else None
        if self.meter_problem is None:
            try:
                self.meter = meter.Meter(self.host_pids, self.grouped, closed=meter.closed_counted())
            except (OSError, ValueError, subprocess.SubprocessError) as exc:
                self.meter_problem = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        self.window = self.todo[0].index if self.todo else None
        group = self.limits.cgroup if self.limits is not None else None
        if group is not None and len(self.host_pids) == self.size:  # before any learner's code: nothing to hide
            self.rank_groups = group.split(self.host_pids)
        self.open_memory_window()
        self.release(meter.released("start"))

    def calibrate(self, index: int) -> None:
        """METERED with a calibrate(): every rank ran it for case `index` (one all-reduce of that case's size
        each way, before any learner's code) and waits; the segments it took are what one all-reduce takes
        here (hooks.allreduces_on_wire). Once a case: that barrier, reached again later, is the learner's."""
        if self.meter is None or index in self.calibration or not self.spec.get("calibrate") or self.starts:
            return
        try:
            self.calibration[index] = self.meter.take()["0"]["all segments"]
        except (OSError, ValueError, subprocess.SubprocessError):
            self.calibration[index] = {}

    def read_wire(self, index: int) -> dict | None:
        """METERED: the bytes each rank sent to each other in case `index`; then the ranks go on."""
        if self.meter is None:
            if self.spec.get("metered"):
                self.release(meter.released(str(index)))
            return None
        try:
            wire = self.meter.take()
        except (OSError, ValueError, subprocess.SubprocessError):
            wire = None
        self.let_go()
        held = self.memory_held()
        for rank, row in (wire or {}).items():
            row["calibration"], row["mpi"] = self.calibration.get(index), self.meter.mpi
            # not an int: a row's int values are bytes sent to peers (wire_agrees)
            row["memory"] = {"held": held, "rank": self.memory_held_by(int(rank))}
            if self.planned(index, "pause"):  # a tag missing: the ranks never waited there
                row["paused"] = {tag: None if got is None else got[rank]  # None: waited there, not read
                                 for tag, got in self.paused.get(index, {}).items() if got is None or rank in got}
            if self.held_case(index):  # "never": the rank never asked
                row["held"] = (self.held[index] or {}).get(rank) if index in self.held else "never"
            if self.plan(index, "hold") == "here":  # None: it could not be held here
                row["passed_held"] = (sorted(self.passing[index]) if index in self.passing else None) \
                    if index in self.held else "never"
        later = [p.index for p in self.todo if p.index > index]
        self.window = later[0] if later else None
        self.open_memory_window()
        self.release(meter.released(str(index)))
        return wire

    def open_memory_window(self) -> None:
        """Every rank waits between two cases: reset the job's memory peak (its cgroup, outside the learner's
        processes) to what it holds now, for memory_held() at the case's end."""
        group = self.limits.cgroup if self.limits is not None else None
        self.close_memory_window()
        self.peak = group.open_peak() if group is not None else None
        self.peak_base = group.memory() if self.peak is not None else None
        for rank, own in self.rank_groups.items():
            peak = own.open_peak()
            if peak is not None:
                self.rank_peaks[rank] = (peak, own.memory())

    def close_memory_window(self) -> None:
        if self.peak is not None:
            self.peak.close()
            self.peak = None
        for peak, _ in self.rank_peaks.values():
            peak.close()
        self.rank_peaks = {}

    def memory_held_by(self, rank: int) -> int | None:
        """The most rank `rank`'s processes held at once since the window opened, over what they held then, where
        it has a cgroup of its own (Cgroup.split)."""
        peak, base = self.rank_peaks.get(rank, (None, None))
        top = sandbox.Cgroup.read_peak(peak) if peak is not None and base is not None else None
        return None if top is None else max(0, top - base)

    def memory_held(self) -> int | None:
        """The most the job's processes held at once since the window opened, over what they held then."""
        if self.peak is None or self.peak_base is None:
            return None
        top = sandbox.Cgroup.read_peak(self.peak)
        return None if top is None else max(0, top - self.peak_base)

    def hold(self, rank: int, index: int) -> None:
        """The last rank asks to be held still before its code for case `index` runs (learner_job.hold): stop
        it, then let it past its wait; settle_hold() reads the others' bytes and lets it go. Only for the
        case the meter's window is open for, once: a rank that asks early or again is simply let past."""
        wanted = (self.held_case(index) and rank == self.size - 1 and index == self.window
                  and index not in self.held and self.holding is None)
        if wanted and self.meter is not None and rank in self.host_pids:
            here = self.plan(index, "hold") == "here"
            self.holding = hold.Hold.start(self.meter, self.host_pids[rank], index, list(range(self.size - 1)),
                                           passed=self.passing.setdefault(index, set()) if here else None)
            if self.holding is None:
                self.held[index] = None  # could not be stopped here: nothing to say
                self.passing.pop(index, None)
        elif wanted:
            self.held[index] = None
            self.passing.pop(index, None)
        self.release(f"go-hold_{index}", [rank])

    def held_case(self, index: int) -> bool:
        """Case `index` is one of this job's with "hold" in its params (the checker's plan, not the learner's word)."""
        return self.planned(index, "hold")

    def planned(self, index: int, param: str) -> bool:
        """Case `index` is one of this job's with `param` in its params."""
        return self.plan(index, param) not in (None, False)

    def plan(self, index: int, param: str):
        """The value of `param` in case `index`'s params (the checker's plan), None where it has none."""
        return next((p.case.params.get(param) for p in self.todo if p.index == index), None)

    def note_passed(self, rank: int, index: int) -> None:
        """Rank `rank` says it passed the case's mark (cases.passed_here): counted only until the last rank,
        held still for this case, is let go. It cannot get past its hold_here() before that, so a rank that
        waits on it never gets there meanwhile, whichever of the two this process hears of first."""
        if (self.plan(index, "hold") == "here" and index == self.window and index not in self.held
                and 0 <= rank < self.size - 1):
            self.passing.setdefault(index, set()).add(rank)

    def pause(self, rank: int, index: int, tag: str) -> None:
        """Rank `rank` waits at `tag` in case `index` (cases.read_wire_here). Where the case's "pause" is
        "together", once every rank is there, settle_hold() reads the wire and lets them all go on; where
        it is "alone", the wire is read at once and this rank goes on. Only in the case the meter's window is
        open for, each tag once (per rank, alone): asked again, the rank is let past at once, with nothing read;
        any other ask is not answered."""
        mode = self.plan(index, "pause")
        if mode not in ("together", "alone") or index != self.window or not _PAUSE_TAG.fullmatch(tag):
            return  # not the kit's: nothing to answer
        taken = self.paused.setdefault(index, {})
        fresh = tag not in taken if mode == "together" else str(rank) not in (taken.get(tag) or {})
        room = tag in taken or (index, tag) in self.pausing or len(taken) + len(self.pausing) < MAX_PAUSES
        if not room:
            return  # the learner's many asks: the kit's own past them go unanswered (its case ends as HANG)
        if fresh and mode == "alone":
            taken.setdefault(tag, {})[str(rank)] = self.read_now(rank)
        if not fresh or mode == "alone":
            self.release(f"go-pause_{index}_{tag}", [rank])
            return
        waiting = self.pausing.setdefault((index, tag), set())
        waiting.add(rank)
        if len(waiting) < self.size:
            return
        del self.pausing[(index, tag)]
        taken[tag] = None
        if self.meter is None:
            self.release(f"go-pause_{index}_{tag}")
        else:
            self.pauses.append(hold.Pause(self.meter, index, tag))

    def read_now(self, rank: int) -> dict | None:
        """What rank `rank` has received from and sent to each other rank so far in this case (None: unread)."""
        try:
            seen = self.meter.peek() if self.meter is not None else None
        except (OSError, ValueError, subprocess.SubprocessError):
            seen = None
        return hold.readings(seen).get(str(rank)) if seen else None

    def settle_hold(self) -> None:
        """A rank held still, or every rank waiting to be read: once the others have stopped sending (or it
        has been long enough), read and let go."""
        if self.holding is not None and self.holding.settled():
            self.let_go()
        if self.pauses and self.pauses[0].settled():
            p = self.pauses.pop(0)
            self.paused[p.index][p.tag] = hold.readings(p.seen) if p.seen is not None else None
            self.release(f"go-pause_{p.index}_{p.tag}")

    def let_go(self) -> None:
        if self.holding is not None:
            h, self.holding = self.holding, None
            self.held[h.index] = h.let_go()


def job_limits(sizes: list[int], todos: list[list[Planned]], group: sandbox.Cgroup | None) -> sandbox.Limits:
    """The caps on a check's job, or on the fork server whose forks are the ranks of several
    (`sizes`, each with its cases `todos`): CPU time per rank for its cases, tasks for all ranks
    together (threads count too), memory as sandbox.Limits has it; inside the check's `group`, whose
    caps hold for all its jobs together (Runner.run)."""
    seconds = max(START_TIMEOUT + sum(p.timeout for p in todo) + 60 for todo in todos)
    return sandbox.Limits(cpu_seconds=int(seconds), processes=job_tasks(sizes), within=group)


def job_tasks(sizes: list[int]) -> int:
    """Tasks a check's job (or the fork server of several) may run: its ranks' threads count too."""
    return 256 + 64 * sum(sizes)


def _job_env(job_dir: str, keys: bool = True) -> dict[str, str]:
    """A check job's environment: this process's, its job folder named, one thread per rank, the
    venv first on PATH, never the grader's own channels (results file, service folder); where the
    instructor's keys are only where `keys` (a learner's job is told nothing of them, nor where the grader's
    HOME is: its ranks printed it)."""
    env = dict(os.environ)
    env.pop(settings.GRADE_RESULTS.name, None)
    env.pop(settings.GRADE_SERVICE.name, None)
    if not keys:  # a learner's job: HOME its own folder, never the grader's (the whitelist kept it, and said where)
        env.pop(settings.KEYS.name, None)
        env["HOME"] = job_dir
    bindir = str(Path(sys.executable).parent)
    # PYTHONSAFEPATH: `python -m` puts the working folder first on the import path, and the grader's may be the
    # submissions' (`hpdl grade .`): a learner's folder named numpy ran in every reference rank, unsandboxed
    env.update({settings.CHECK_JOB.name: job_dir}, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONSAFEPATH="1",
               PATH=f"{bindir}{os.pathsep}{env.get('PATH', '')}", MALLOC_MMAP_THRESHOLD_=str(MMAP_FROM))
    return env


# glibc's malloc maps blocks of this many bytes and more on their own, and unmaps them when freed. Its default
# threshold rises to the largest block freed (up to 32 MiB): after the first layer is freed, later ones come from
# the heap, which keeps what is freed inside it, and a rank that held one layer at a time showed 11-14 layers'
# worth to its memory cgroup (zero3_unit, graded). Fixed, the count outside the ranks follows what they hold.
MMAP_FROM = 256 * 2**10


def _clean_stack(data: dict) -> dict:
    where = data.get("where") if isinstance(data.get("where"), dict) else None
    if where:
        line = where.get("line") if isinstance(where.get("line"), int) else 0
        where = {"file": str(where.get("file", ""))[:300], "line": line,
                 "func": str(where.get("func", ""))[:100], "code": str(where.get("code", ""))[:300]}
    call = data.get("call")
    return {"phase": str(data.get("phase") or "")[:40], "where": where, "call": str(call)[:200] if call else None}


def where_text(w: dict | None) -> str:
    """'line 12 of ring_allreduce(): comm.Recv(buf, source=left)' (hpdl.hang's wording)."""
    return hang.place_text(w) if w else "(no line found)"


def _stuck(where: dict[int, dict]) -> dict[int, dict | str]:
    """Each stuck rank's answer for hpdl.hang's wording; a ready text outside the learner's code."""
    out: dict[int, dict | str] = {}
    for r, info in where.items():
        phase = (info or {}).get("phase")
        if phase == "waiting":
            out[r] = "(finished the case, waiting for the others)"
        elif phase in ("inputs", "packing") and not (info or {}).get("where"):
            out[r] = f"(in the checker's {phase} step, outside your function)"
        else:
            out[r] = info or None
    return out


def _stuck_text(where: dict | None) -> dict[int, str]:
    if not where:
        return {}
    return {r: hang.stuck_text(a) for r, a in _stuck(where).items()}


# -- one rank count: a learner job (relaunched as needed) and its reference job --------------------

class SizeRun:
    """The cases of one rank count: the reference job for all of them, learner jobs in turn."""

    def __init__(self, runner: "Runner", size: int, todo: list[Planned], tmp: str):
        self.runner, self.size, self.tmp = runner, size, tmp
        self.todo = list(todo)
        self.reference = Job("reference", runner.spec, size, todo, tmp, sandboxed=False, server=runner.server,
                             group=runner.group)
        try:
            self.learner: Job | None = self._learner(todo)
        except BaseException:
            self.reference.end()
            raise
        for job in (self.reference, self.learner):  # no local MPI launcher: the result says so
            if job.through_batch:
                runner.notes[job.through_batch] = None
        self.verifying: dict[int, float] = {}  # case index -> when its outputs went to the reference job
        self.broken: dict | None = None  # the reference job failed: the checker's own fault
        self.restarted = False  # a learner job that ended before any rank was ready is started again, once

    def _learner(self, todo: list[Planned]) -> Job:
        job = Job("learner", self.runner.spec, self.size, todo, self.tmp, sandboxed=self.runner.sandboxed,
                  private=self.runner.private_inputs(self.size, todo), oracle=self.runner.secrets(self.size, todo),
                  group=self.runner.group,
                  # a learner job per rank count, all at once: one check's cap shared among them
                  disk_bytes=sandbox.DISK_BYTES // max(1, len(self.runner.todos)))
        return job

    def _go(self, index: int, verify: bool, seconds: dict | None = None, wire: dict | None = None) -> None:
        path = os.path.join(self.reference.dir, f"go-{index}.json")
        safefiles.replace_atomically(path, json.dumps({"verify": verify, "seconds": seconds or {}, "wire": wire}))

    def finished(self) -> bool:
        return not self.todo

    def step(self) -> list[tuple[Planned, CaseResult]]:
        decided: list[tuple[Planned, CaseResult]] = []
        runner = self.runner
        ref = self.reference
        self._read_jobs()
        while self.todo:
            cur = self.todo[0]
            if cur.index in self.verifying:  # waiting for the reference job's verdict
                ends = ref.ends.get(cur.index, {})
                if len(ends) == self.size:
                    learner_ends = self.learner.ends.get(cur.index, {}) if self.learner else {}
                    decided.append((cur, runner.from_verdicts(cur, self.size, ends, learner_ends)))
                    self.todo.pop(0)
                    self._next_learner()
                    continue
                late = time.monotonic() - self.verifying[cur.index] > verify_timeout(runner.spec)
                if ref.crash or ref.exited() or late:
                    self._checker_failed(decided, ref)
                break
            if ref.crash or (ref.exited() and cur.index not in ref.ends):
                self._checker_failed(decided, ref)
                break
            job = self.learner
            if job is None:
                break
            job.read()
            exited = job.exited()
            if exited:
                job.read()
            job.start_meter()
            if job.meter_problem:
                runner.notes[f"Note: the bytes your ranks sent could not be counted outside their processes "
                             f"here ({job.meter_problem}); this check decided on the MPI calls recorded in them "
                             "alone."] = None
            ends = job.ends.get(cur.index, {})
            if len(ends) == self.size:
                wire = job.read_wire(cur.index)
                if all(e.get("status") == "ok" for e in ends.values()):
                    self._hand_over(cur, job, ends, wire)
                    continue
                result = runner.from_learner(cur, self.size, ends)
                self._go(cur.index, False)
                decided.append((cur, result))
                self.todo.pop(0)
                continue
            result = None if exited and self._started_again(job) else self._stopped(cur, job, ends, exited)
            if result is None:
                break
            decided.append((cur, result))
            self._go(cur.index, False)
            self.todo.pop(0)
            job.must_stop = True
            job.end()
            if job.disk is not None and job.disk.why is not None:
                safefiles.remove_tree(job.dir)  # what it wrote goes now, not with the check
            self._after_stop(job, decided)
            break
        return decided

    def _started_again(self, job: Job) -> bool:
        """The learner job ended before any of its ranks was ready, so before any learner's code ran: the host's
        doing (a busy grading host's, where an honest check lost 2 points to "The ranks did not start"). Once."""
        if job.ready or job.crash is not None or self.restarted:
            return False
        self.restarted = True
        job.end()
        said = _text(job.output_tail(1), 200) or "none"
        safefiles.remove_tree(job.dir)
        self.learner = self._learner(self.todo)
        self.runner.notes[f"Note: the job of {self.size} ranks ended before its ranks were ready and was started "
                          f"again (its last output: {said})."] = None
        return True

    def _read_jobs(self) -> None:
        """The jobs' new events: the learner's at every step too, as its ranks meet at barriers through this
        process (learner_job.barrier), also while a verdict is awaited."""
        self.reference.read()
        if self.reference.exited():
            self.reference.read()
        if self.learner is not None:
            self.learner.read()
            self.learner.settle_hold()  # also while a verdict is awaited: the next case may be running

    def _stopped(self, cur: Planned, job: Job, ends: dict, exited: bool) -> CaseResult | None:
        """The case's result when the learner job must stop before every rank returned (a crash
        of ours, a rank that raised, the time limit, a dead or unstarted job); None: not yet."""
        runner, now = self.runner, time.monotonic()
        if job.crash is not None:
            return runner.internal_error(cur, self.size, job.crash)
        if job.disk is not None and job.disk.over():
            return runner.over_disk(cur, self.size, job.disk.why)
        if cur.index in job.problem_at and now - job.problem_at[cur.index] > GRACE_AFTER_ERROR and not exited:
            where = job.stacks([r for r in range(self.size) if r not in ends], runner.spec["code"])
            return runner.from_learner(cur, self.size, ends, left_waiting=where)
        if cur.index in job.starts and now - job.starts[cur.index] > cur.timeout and not exited:
            where = job.stacks([r for r in range(self.size) if r not in ends], runner.spec["code"])
            job.hung = True
            return runner.hang(cur, self.size, ends, where, now - job.starts[cur.index])
        if exited:
            return runner.died(cur, self.size, ends, job.ready, job.output_tail())
        if cur.index not in job.starts and now - job.launched > START_TIMEOUT:
            return runner.no_start(cur, self.size, job.ready, job.output_tail())
        return None

    def _hand_over(self, cur: Planned, job: Job, ends: dict, wire: dict | None) -> None:
        """The learner's ranks all returned: their output bytes go to the reference job."""
        for r in range(self.size):
            src = os.path.join(job.rank_dir(r), f"out-{cur.index}-{r}.bin")
            dst = os.path.join(self.reference.dir, f"got-{cur.index}-{r}.bin")
            try:  # the learner's folder: regular files only, bounded (a link to /dev/zero is not read), and
                # written (one truncated to 64 MiB of holes takes no disk there, but would in a copy here)
                data = safefiles.read_bounded(src, MAX_OUTPUT_BYTES, written=True)
            except OSError:
                data = b""  # the reference job says the outputs could not be read back
            safefiles.create_exclusive(dst, data)
        seconds = {str(r): e.get("seconds") if isinstance(e.get("seconds"), (int, float)) else 0.0
                   for r, e in ends.items()}
        self._go(cur.index, True, seconds, wire)
        self.verifying[cur.index] = time.monotonic()

    def _next_learner(self) -> None:
        """After a verdict: a learner job that has no case left winds down."""
        job = self.learner
        if not self.todo and job is not None:
            job.wind_down()
            self.learner = None

    def _after_stop(self, job: Job, decided: list) -> None:
        """The learner job was stopped: relaunch it for the cases left (or report them not run)."""
        left = list(self.todo)
        over_disk = job.disk is not None and job.disk.why is not None  # each new job would fill it again
        if left and (over_disk or job.hung and not self.runner.every_case):
            stopped = decided[-1][1]
            for p in left:
                self._go(p.index, False)
                decided.append((p, self.runner.not_run_after(p, self.size, stopped)))
            self.todo = []
            left = []
        if left:
            if job.hung:
                left = [Planned(p.index, p.case, min(p.timeout, SHORT_FUSE)) for p in left]
                self.todo = left
            self.learner = self._learner(left)
        else:
            self.learner = None

    def _checker_failed(self, decided: list, ref: Job) -> None:
        crash = ref.crash or {"rank": "?", "message": "the reference job ended: " + (ref.output_tail(6) or "no output"),
                              "traceback": ref.output_tail(20)}
        for p in self.todo:
            decided.append((p, self.runner.internal_error(p, self.size, crash)))
        self.todo = []

    def close(self) -> None:
        if self.learner is not None and self.learner.live:
            self.learner.end()
        if self.reference.live:
            self.reference.wind_down(wait=0.5)
        self.learner = None


class Stopped(Exception):
    """The check was stopped from outside (Runner.stop): its jobs are ended, it has no result."""


class Runner:
    """Plans the jobs of one check, runs them side by side, and builds the case results."""

    def __init__(self, exercise: str, module, spec: dict, plan: dict[int, list[Planned]], progress=None,
                 every_case: bool = True, sandboxed: bool | None = None, stop=None, memory: int | None = None):
        self.memory = memory or sandbox.default_memory()  # all the check's jobs together (the grader may set it)
        self.every_case = every_case  # grading: run cases left after a HANG too (with a short fuse)
        self.exercise = exercise
        self.module = module
        self.spec = spec
        self.plan = plan
        self.todos = {size: todo for size, todo in plan.items() if todo}  # the rank counts with cases to run
        self.progress = progress
        self.sandboxed = sandbox.available() if sandboxed is None else sandboxed
        self.notes: dict[str, None] = {}  # what the check's result should say about how it ran (in order)
        self.server: str | None = None  # the reference jobs' fork server's socket (runner.shared_server)
        self.group: sandbox.Cgroup | None = None  # every job's cgroup inside it (made in run)
        self.stop = stop  # a threading.Event: once set, the check ends its jobs and raises Stopped

    def run(self) -> dict[int, CaseResult]:
        results: dict[int, CaseResult] = {}
        tmp = str(scratch.make("check"))  # one a killed checker left is removed by the next check
        runs: list[SizeRun] = []
        server = None
        # the jobs of every rank count run at once, each capped: one memory cap for them all besides, so
        # 4 learner jobs of 8 GiB each cannot hold 32 GiB on a host of 24 (one submission's check did)
        sizes = list(self.todos)  # tasks: each rank count's two jobs, and the reference jobs' fork server
        self.group = sandbox.Cgroup.make(2 * sum(job_tasks([size]) for size in sizes) + job_tasks(sizes),
                                         self.memory)
        try:
            server = self._serve(tmp)
            for size, todo in self.todos.items():  # one by one: those started are ended if the next fails
                runs.append(SizeRun(self, size, todo, tmp))
            while runs:
                for run in list(runs):
                    for planned, result in run.step():
                        results[planned.index] = result
                        if self.progress is not None:
                            self.progress.update(1)
                    if run.finished():
                        runs.remove(run)
                        run.close()
                if server is not None:
                    server.running()  # notes the /dev/shm files its forks (the reference ranks) map
                if self.stop is not None and self.stop.is_set():
                    raise Stopped(f"the check of {self.exercise} was stopped before it ended")
                time.sleep(POLL)
        finally:
            for run in runs:
                run.close()
            if server is not None:
                server.end(now=True)
            if self.group is not None:
                self.group.remove()  # its jobs' cgroups first (an exiting one: sandbox.sweep_cgroups retries)
            if not settings.CHECK_KEEP.get():
                safefiles.remove_tree(tmp)
        return void_unwitnessed(void_if_forged(results), self.plan, getattr(self.module, "UNSEEN_IN_SMALL", None))

    def _serve(self, tmp: str) -> sidejob.SideJob | None:
        """One fork server for every reference job of the check, where they preload torch and there are
        several: each reference rank is its fork (runner.shared_server). Its forks' output goes where
        their job's does; its own, to a file beside the jobs' folders."""
        if len(self.todos) < 2:  # one job: its own server starts beside its launcher
            return None
        shared = shared_server(tmp, (self.spec.get("preload") or {}).get("reference", []))
        if shared is None:
            return None
        cmd, self.server = shared
        from hpdl import launchers

        try:  # torch imported under the environment a reference job's ranks have (one thread each)
            server = sidejob.SideJob(cmd, output=os.path.join(tmp, "fork-server.txt"), cwd=tmp,
                                     env=launchers.local_job_env(_job_env(tmp)),
                                     limits=job_limits(list(self.todos), list(self.todos.values()), self.group))
        except OSError:  # no server: each reference job starts its ranks, as without one
            self.server = None
            return None
        # it listens before it imports: until then a rank would not find it and start afresh (slowly)
        deadline = time.monotonic() + SERVER_LISTENS
        while not os.path.exists(self.server) and server.running() and time.monotonic() < deadline:
            time.sleep(POLL)
        if not os.path.exists(self.server):
            server.end(now=True)
            self.server = None
            return None
        return server

    def private_inputs(self, size: int, todo: list[Planned]) -> dict[int, bytes] | None:
        """Each rank's inputs to its cases, as plain data, when the check has a nonce (PRIVATE_INPUTS):
        computed here with the nonce, which the learner's job never sees."""
        return self._per_rank("PRIVATE_INPUTS", size, todo,
                              lambda case, rank: list(self.module.inputs(case, rank, size)), by_name=False)

    def secrets(self, size: int, todo: list[Planned]) -> dict[int, bytes] | None:
        """Each rank's secrets for its oracle helper (ORACLE, oracle.py), by case name."""
        return self._per_rank("ORACLE", size, todo, lambda case, rank: self.module.secrets(case, rank, size),
                              by_name=True)

    def _per_rank(self, flag: str, size: int, todo: list[Planned], make, by_name: bool) -> dict[int, bytes] | None:
        nonce = self.spec.get("nonce")
        if not getattr(self.module, flag, False) or (nonce is None and flag != "ORACLE"):
            return None  # an oracle's helper runs without a nonce too (a stripped kit's public cases)
        from hpdl.checker import wire

        return {rank: wire.pack({(p.case.name if by_name else p.index): make(with_nonce(p.case, nonce), rank)
                                 for p in todo}) for rank in range(size)}

    # -- building results -------------------------------------------------------------------
    def _result(self, planned: Planned, size: int, verdict: Verdict, message: str, **kw) -> CaseResult:
        c = planned.case
        return CaseResult(self.exercise, c.name, size, verdict, c.points if verdict.earns_points else 0.0, c.points,
                          hidden=c.hidden, message=message, params=dict(c.params), **kw)

    def from_learner(self, planned: Planned, size: int, ends: dict[int, dict],
                     left_waiting: dict | None = None) -> CaseResult:
        """A case the learner's ranks ended with an exception or a forbidden call."""
        by = {s: sorted(r for r, e in ends.items() if e.get("status") == s) for s in ("ok", "error", "forbidden")}
        seconds = max((_num(e.get("seconds")) for e in ends.values()), default=0.0)
        waiting = ""
        if left_waiting:
            waiting = " Left waiting for it: " + hang.summary(_stuck(left_waiting)).removeprefix("stuck: ") + \
                      " (the job was aborted)."
        if by["error"]:
            first = ends[by["error"][0]]
            same = all(ends[r].get("message") == first.get("message") for r in by["error"])
            where = _where(first.get("where"))
            if all(ends[r].get("exception") == "NotImplementedError" for r in by["error"]) and len(by["error"]) == size:
                msg = ("Not written yet: your function raises NotImplementedError. "
                       "Replace the placeholder with your code.")
                return self._result(planned, size, Verdict.ERROR, msg, error_ranks=by["error"], line=where,
                                    seconds=seconds)
            who = rank_word(by["error"]) if same else f"rank {by['error'][0]}"
            at = f" at {where_text(where)}" if where else f" when called as {self._signature()}"
            msg = f"{who} raised {_text(first.get('message'))}{at}.{waiting}"
            details = "\n".join(_text(t, 300) for t in (first.get("traceback") or [])[:30])
            return self._result(planned, size, Verdict.ERROR, msg, error_ranks=by["error"], line=where,
                                seconds=seconds, details=details, stuck=_stuck_text(left_waiting),
                                hint=_mpi_error_hint(str(first.get("message") or "")))
        first = ends[by["forbidden"][0]]
        where = _where(first.get("where"))
        at = f" ({where_text(where)})" if where else ""
        msg = f"Rejected: {_text(first.get('message'))}{at}.{waiting}"
        return self._result(planned, size, Verdict.WRONG, msg, wrong_ranks=by["forbidden"], line=where,
                            seconds=seconds, rejected=_text(first.get("name"), 80) or "a forbidden call")

    def from_verdicts(self, planned: Planned, size: int, ends: dict[int, dict], learner_ends: dict) -> CaseResult:
        """A case every learner rank returned from: the reference job's verify() decided."""
        by = {s: sorted(r for r, e in ends.items() if e.get("status") == s) for s in ("ok", "wrong", "unverified")}
        seconds = max((_num(e.get("seconds")) for e in learner_ends.values()), default=0.0)
        if by["wrong"]:
            worst = max(by["wrong"],
                        key=lambda r: (ends[r].get("max_error") is not None, ends[r].get("max_error") or 0))
            w = ends[worst]
            hint = w.get("hint") or next((ends[r].get("hint") for r in by["wrong"] if ends[r].get("hint")), None)
            forged = any(ends[r].get("forged") for r in by["wrong"])  # right values that came no other way
            only_root = getattr(self.module, "HINT_ONLY_ROOT", "only rank 0 ends with the right result; every rank "
                                                               "must return it.")  # None: not this exercise's
            if size > 1 and by["ok"] == [0] and by["wrong"] == list(range(1, size)) and not forged and only_root:
                hint = only_root
            err = w.get("max_error")
            largest = f" Largest error {err:.3g} (rank {worst})." if err is not None else ""
            msg = f"Wrong on {rank_word(by['wrong'])}: {w.get('message')}.{largest}"
            if len(by["wrong"]) > 1 and w.get("message") != ends[by["wrong"][0]].get("message"):
                msg = f"Wrong on {rank_word(by['wrong'])}; rank {worst}: {w.get('message')}.{largest}"
            forged = (FORGED if forged
                      else TELLING if any(ends[r].get("telling") for r in by["wrong"]) else None)
            return self._result(planned, size, Verdict.WRONG, msg, hint=hint, wrong_ranks=by["wrong"],
                                max_error=err, seconds=seconds, rejected=forged)
        ref = max((_num(e.get("reference_seconds")) for e in ends.values()), default=0.0)
        if seconds > planned.case.slow_factor * ref + 0.25:
            msg = (f"Right result, but slow: {seconds:.2f} s where the reference took {ref:.3f} s "
                   "(advisory; no points lost).")
            return self._result(planned, size, Verdict.SLOW, msg, seconds=seconds)
        return self._result(planned, size, Verdict.PASS, "", seconds=seconds)

    def hang(self, planned: Planned, size: int, ends: dict, where: dict[int, dict], elapsed: float) -> CaseResult:
        stuck = sorted(where) if where else sorted(set(range(size)) - set(ends))
        finished = sorted(ends)
        errors = {r: _text(e.get("message"), 200) for r, e in ends.items() if e.get("status") != "ok"}
        answers = _stuck({r: where.get(r, {}) for r in stuck})
        msg = (f"Not finished after {planned.timeout:g} s: "
               + hang.summary(answers, [r for r in finished if r not in errors], errors) + ".")
        if not finished:
            msg += " No rank finished."
        from hpdl.checker.hooks import SYNCHRONOUS  # the sends that wait for their receive (recorder.current's names)

        waiting = tuple(f"comm.{name}(" for name in SYNCHRONOUS)
        calls = [str(w.get("call") or "") for w in where.values() if w]
        sends_wait = getattr(self.module, "SEND_WAITS", True)  # else a blocking Send here went at once
        hint = SENT_FIRST_HINT if sends_wait and any(c.startswith(waiting) for c in calls) else hang.DEADLOCK_HINT
        line = next((w.get("where") for w in where.values() if w and w.get("where")), None)
        return self._result(planned, size, Verdict.HANG, msg, hint=hint, stuck=_stuck_text(where), finished=finished,
                            seconds=elapsed, line=line)

    def not_run_after(self, planned: Planned, size: int, stopped: CaseResult) -> CaseResult:
        """A case left after one that hung (inline) or filled its folder: not run, in the same verdict."""
        if stopped.verdict == Verdict.HANG:
            msg = (f"Not run: case {stopped.name} already hung at {size} ranks "
                   "(fix that first; grading runs every case).")
        else:
            msg = f"Not run: case {stopped.name} was stopped at {size} ranks (above); fix that first."
        return self._result(planned, size, stopped.verdict, msg)

    def died(self, planned: Planned, size: int, ends: dict, ready: dict, output: str) -> CaseResult:
        gone = sorted(set(range(size)) - set(ends))
        msg = (f"The MPI job ended before {rank_word(gone)} finished this case: a rank exited or crashed "
               "(os._exit, a segfault, a limit on memory or CPU time, or MPI Abort); "
               "MPI then ends all ranks of the job.")
        if not ready:
            msg = "The ranks did not start."
        return self._result(planned, size, Verdict.ERROR, msg, error_ranks=gone, details=output)

    def over_disk(self, planned: Planned, size: int, why: str) -> CaseResult:
        msg = (f"Your ranks were stopped: {why}. A check keeps what your function returns; write no more "
               "than that to files.")
        return self._result(planned, size, Verdict.ERROR, msg)

    def no_start(self, planned: Planned, size: int, ready: dict, output: str) -> CaseResult:
        msg = (f"Only {len(ready)} of {size} ranks started within {START_TIMEOUT:g} s; the machine may be busy, "
               "or MPI is broken (run `hpdl doctor`).")
        return self._result(planned, size, Verdict.ERROR, msg, details=output)

    def internal_error(self, planned: Planned, size: int, crash: dict) -> CaseResult:
        msg = (f"The checker itself failed on rank {crash.get('rank')}: {_text(crash.get('message'))} "
               "(not your fault; please report it).")
        return self._result(planned, size, Verdict.ERROR, msg, details=_text(crash.get("traceback", ""), 4000))

    def _signature(self) -> str:
        return getattr(self.module, "SIGNATURE", f"{self.exercise}(comm, ...)")


SENT_FIRST_HINT = (
    "A rank waits in a blocking Send: MPI lets Send wait until the receiving rank posts its Recv (past a small "
    "eager limit it does, on any cluster), and the checker's Send always waits so. If "
    "two ranks each Send to the other before they Recv, both wait forever, whatever the size: exchange with "
    "comm.Sendrecv, or post Irecv/Isend first and Wait after (lesson 03: eager and rendezvous).")
FORGED = "the recorded MPI calls (contradicted by the network, or rewritten)"
TELLING = "the algorithm (seen in a case that tells it)"


def void_if_forged(results: dict[int, CaseResult]) -> dict[int, CaseResult]:
    """A check in which the network contradicted the learner's recorded calls (hooks.wire_agrees), or what
    else the checker saw outside the learner's processes contradicted them (a Wrong with forged=True),
    earns nothing: the recording was changed, so no case's evidence can be trusted. Nor does one in which a
    case large enough to tell showed another algorithm than the one asked (a Wrong with telling=True): the
    smaller cases passed only because their traffic hides in the wire's noise."""
    forged = next((r for r in results.values() if r.rejected == FORGED), None)
    telling = next((r for r in results.values() if r.rejected == TELLING), None)
    if forged is None and telling is None:
        return results
    for r in results.values():
        if r.verdict.earns_points and r is not (forged or telling):
            r.verdict, r.points, r.rejected = Verdict.WRONG, 0.0, FORGED if forged else TELLING
            r.message = (f"Not counted: on {forged.ranks} ranks, case {forged.name}, what was recorded in your "
                         "processes was contradicted by what the checker saw outside them (on the network, or in "
                         "memory), or was rewritten by your code (see that case)." if forged else
                         f"Not counted: on {telling.ranks} ranks, case {telling.name} shows an algorithm other than "
                         "the one asked (see that case); the cases that cannot tell them apart earn nothing either.")
    return results


UNWITNESSED = "the larger case that shows what this one cannot (counted once that one passes)"
# what a case too small cannot show, where a module does not say (its UNSEEN_IN_SMALL)
UNSEEN_IN_SMALL = "how its values moved (a few bytes hide in MPI's own traffic)"


def void_unwitnessed(results: dict[int, CaseResult], plan: dict[int, list[Planned]],
                     unseen: str | None = None) -> dict[int, CaseResult]:
    """A rank count whose witness case (Case.witness: too large for a collective to hide in the wire's slack,
    say) ran and did not pass earns nothing from its other cases: their bytes hide in MPI's own traffic, so a
    collective called where the recorder cannot see it passed them beside a show of the asked messages, while
    the one case that would have shown it raised on purpose (6/27 on the ring). Right code passes its witness;
    code wrong there is told which case to fix first. `unseen`: what the smaller cases cannot show."""
    for size, todo in plan.items():
        witnessed = [results[p.index] for p in todo if p.case.witness and p.index in results]
        if size < 2 or not witnessed or any(w.verdict.earns_points for w in witnessed):
            continue
        w = witnessed[0]
        for p in todo:
            r = results.get(p.index)
            if r is not None and not p.case.witness and r.verdict.earns_points:
                r.verdict, r.points, r.rejected = Verdict.WRONG, 0.0, UNWITNESSED
                r.message = (f"Not counted yet: your result was right, but at {size} ranks this case cannot show "
                             f"{unseen or UNSEEN_IN_SMALL}. It counts once case {w.name} at {size} ranks, which can, "
                             f"passes (it ended {w.verdict}: see that case).")
    return results


def _num(x) -> float:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and x == x else 0.0


def _text(x, limit: int = 400) -> str:
    return "" if x is None else str(x)[:limit]


TRUNCATED = ("A message arrived longer than the buffer it was received into (MPI's 'message truncated'; from a "
             "waitall MPI says only 'see the MPI_ERROR field'). mpi4py's pickled irecv() has room for 32 KiB unless "
             "it is given a buffer: comm.irecv(bytearray(nbytes), source=...), nbytes at least the pickled "
             "message's size; or receive an array with comm.Irecv into an array of its size.")


def _mpi_error_hint(message: str) -> str | None:
    """What to do about an MPI error whose own words do not say it (a request's error, read from a waitall)."""
    return TRUNCATED if "truncated" in message.lower() or "MPI_ERROR field" in message else None


def _where(w) -> dict | None:
    """A learner rank's 'where' (file, line, func, code), validated."""
    if not isinstance(w, dict):
        return None
    line = w.get("line")
    return {"file": _text(w.get("file"), 300), "line": line if isinstance(line, int) else 0,
            "func": _text(w.get("func"), 100), "code": _text(w.get("code"), 300)}


__all__ = ["Runner", "Planned", "Job", "where_text"]
