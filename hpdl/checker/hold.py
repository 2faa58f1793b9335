"""Checker's side: hold one learner rank still while the others run a case, and read what they send;
or read the wire while every rank waits at a point the case chose (Pause).

Some behaviour shows only in what a rank does *before* an answer from another rank could reach it:
a 1F1B pipeline stage sends min(p - s, m) micro-batches' activations and then waits for the first
gradient to come back; GPipe's stage sends all m first. The learner's own process can note its
order and rewrite the note. So, for a case whose params carry "hold" (learner_job.hold), the
learner's last rank stops itself before its code for that case runs, and asks the checker to hold it
still: the checker stops the whole process (SIGSTOP, which no code in it can catch or undo), lets the
other ranks run, and reads from the kernel (meter.py) the bytes each rank sends to each other while
nothing can come back from the held one. Once those bytes have stopped changing (or MAX_HOLD has
passed) it reads them and lets the rank go on (SIGCONT). The reading goes to the deciding side with the
case's wire row (`held`); the case module's verify() reads it.

What it cannot tell: a stage that sends just what 1F1B sends before a gradient could come back,
then waits on purpose (for a message the held rank sends once let go) and runs GPipe's order after,
reads as 1F1B here; the case's readings before each later forward (a Pause, below) tell. A stage that
sends nothing meanwhile waited on a later stage first: the case module says so (a wrong order, not a
forged one: an honest 1F1B behind a barrier waits too).

A Pause: a case's call() asks for a reading at a point of its own (cases.read_wire_here: in the middle
of backward, say). Every rank waits there, with its other threads running, until the bytes stop changing
and the checker has read them; then all go on. (Where the case's "pause" is "alone", jobs.Job reads the
wire as soon as one rank asks, and only that rank waited: a pipeline stage before a forward.) What the
reading shows happened before the point; where the learner's process moves the point, the bytes show
that too (the case module bounds them both ways).
"""
from __future__ import annotations

import subprocess
import time

from hpdl import procs

STILL = 0.25  # s: the bytes between the ranks unchanged this long, every rank having sent: they wait
MAX_HOLD = 4.0  # s: the longest one rank is held still (honest stages all send within 0.4 s; one that waits, never)
EVERY = 0.05  # s between two readings of the wire
PAUSE_STILL = 0.1  # s: the same for ranks that wait of their own accord (a Pause): their transfers end within ms


class Settling:
    """The wire read every EVERY seconds until the bytes between the ranks stop changing."""

    still = STILL

    def __init__(self, meter, senders: list[int]):
        self.meter = meter
        self.senders = senders  # ranks that should have sent something before the bytes count as settled
        self.since = self.changed = time.monotonic()
        self.read_at = self.since - EVERY  # the first reading at once
        self.seen: dict | None = None
        self.key: tuple = ()

    def settled(self) -> bool:
        """Read the wire (at most every EVERY seconds); True once the others have stopped sending."""
        now = time.monotonic()
        if now - self.read_at < EVERY:
            return now - self.since >= MAX_HOLD
        self.read_at = now
        try:
            self.seen = self.meter.peek()
        except (OSError, ValueError, subprocess.SubprocessError):
            self.seen = None
            return True
        key = tuple(sorted((r, k, v) for r, row in self.seen.items() for k, v in row.items() if isinstance(v, int)))
        if key != self.key:
            self.key, self.changed = key, now
        everyone = all(any(isinstance(v, int) and v > 0 and k.isdigit() for k, v in self.seen.get(str(r), {}).items())
                       for r in self.senders)
        return (everyone and now - self.changed >= self.still) or now - self.since >= MAX_HOLD


class Hold(Settling):
    """One rank of a learner job held still for case `index`, from the moment it asked. With `passed` (a
    case's hold_here(); the job adds to it the ranks that say they passed the case's mark, cases.passed_here):
    until every other rank is in it, or MAX_HOLD, however still the wire is. A rank that waits on the held
    one never gets there; one that does not gets there in ms, but a loaded machine may keep it off its core
    for longer than STILL."""

    def __init__(self, meter, proc: procs.Proc, index: int, senders: list[int], passed: set[int] | None = None):
        super().__init__(meter, senders)
        self.proc, self.index, self.passed = proc, index, passed

    @classmethod
    def start(cls, meter, pid: int, index: int, senders: list[int], passed: set[int] | None = None) -> "Hold | None":
        """Stop the process `pid` (a rank of this job, as this process sees it); None where it could not be."""
        proc = procs.record(pid)
        if proc is None or not procs.hold_still(proc):
            return None
        return cls(meter, proc, index, senders, passed)

    def settled(self) -> bool:
        still = super().settled()  # the wire read meanwhile either way: what the others sent while held
        if self.passed is None:
            return still
        return set(self.senders) <= self.passed or time.monotonic() - self.since >= MAX_HOLD

    def let_go(self) -> dict | None:
        """Let the rank go on; what each rank had sent to each other while it was held (None: not read)."""
        procs.let_go(self.proc)
        if self.seen is None:
            return None
        return {r: {k: v for k, v in row.items() if k.isdigit() and isinstance(v, int)} for r, row in self.seen.items()}


class Pause(Settling):
    """Every rank of a learner job waiting at `tag` in case `index` (cases.read_wire_here), not stopped: the
    transfers they started before (torch.distributed's, on threads of their own) finish meanwhile."""

    still = PAUSE_STILL

    def __init__(self, meter, index: int, tag: str):
        super().__init__(meter, [])
        self.index, self.tag = index, tag


def readings(seen: dict) -> dict[str, dict]:
    """A reading of the wire (meter.peek()) as each rank's: {rank: {"from": {peer: bytes the peer sent it},
    "to": {peer: bytes it sent the peer}}} since the case began."""
    ranks = [r for r in seen if r.isdigit()]
    return {r: {"from": {q: seen[q].get(r, 0) for q in ranks if q != r},
                "to": {q: seen[r].get(q, 0) for q in ranks if q != r}} for r in ranks}
