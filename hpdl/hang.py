"""Where is each rank stuck? One protocol to ask the ranks, one wording to tell the learner.

A rank blocked inside an MPI call cannot run Python code in its main thread, and SIGINT does
not reach it. A small daemon thread on the rank can still read the main thread's stack (MPI
calls release the Python lock) and write it to a file. Both `%%px` cells and check jobs use
this module, so a hang reads the same wherever it happens:

    rank side (engine or check worker)        client side (notebook kernel or checker)
    ----------------------------------        -----------------------------------------
    Answerer(folder, rank).start()            answers = ask(folder, [0, 1])
      polls folder/dump-request  <----------    writes a fresh token to folder/dump-request
      writes folder/stack<rank>.json  ------>   reads the answers carrying that token
    install_faulthandler(folder, rank)        (a rank that holds the Python lock cannot
      SIGUSR1 -> folder/rank<rank>.fault        answer: SIGUSR1 makes faulthandler write it)

    hang_message("the cell did not finish ...", stuck={0: answers.get(0)}, finished=[1, 2])

      the cell did not finish on every rank within 3 s.
        finished: ranks 1, 2
        stuck:    rank 0 at line 4 of the cell: comm.Recv(buf, source=2)
      A rank waiting in an MPI call waits for a partner that never comes: ...

The rank side (`Answerer`, `snapshot`, `learner_where`, `install_faulthandler`) imports the
standard library only (and hpdl.safefiles, itself standard library only); the client side
adds `ask`, the wording functions and `DEADLOCK_HINT`.
"""
from __future__ import annotations

import faulthandler
import json
import logging
import os
import re
import signal
import sys
import threading
import time
import traceback
import uuid
from typing import Callable, Iterable, Mapping

from hpdl import safefiles

log = logging.getLogger(__name__)

REQUEST = "dump-request"
MAX_ANSWER_BYTES = 1 << 20  # one rank's answer (a stack) read by the asking side
_HPDL_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARY = ("site-packages", "dist-packages", "/lib/python", "<frozen")


def answer_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"stack{rank}.json")


def fault_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.fault")


# -- rank side ----------------------------------------------------------------------------------

def is_learner_file(filename: str, files: Iterable[str] | None = None) -> bool:
    """The one filter for the learner's frames. With `files` (a check knows exactly which files
    hold the learner's code) membership decides; otherwise everything but Python's, the
    libraries' and this kit's own files is the learner's (a %%px cell, a notebook function)."""
    if files is not None:
        return filename in files
    return not filename.startswith(_HPDL_DIR) and not any(m in filename for m in _LIBRARY)


def frame_dict(f: traceback.FrameSummary, line_offset: int = 0) -> dict:
    return {"file": f.filename, "line": f.lineno + line_offset, "func": f.name, "code": (f.line or "").strip()}


def learner_where(frames: list[traceback.FrameSummary], files: Iterable[str] | None = None,
                  line_offset: int = 0) -> dict | None:
    """The innermost of the learner's frames as {file, line, func, code}; None if none is theirs."""
    files = set(files) if files is not None else None
    ours = [f for f in frames if is_learner_file(f.filename, files)]
    return frame_dict(ours[-1], line_offset) if ours else None


def snapshot(thread_ident: int, files: Iterable[str] | None = None, line_offset: int = 0) -> dict:
    """A thread's stack now: the learner's innermost frame (`where`) and the last frames."""
    frame = sys._current_frames().get(thread_ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    return {
        "pid": os.getpid(),
        "where": learner_where(stack, files, line_offset),
        "frames": [frame_dict(f) for f in stack[-12:]],
    }


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)


class Answerer(threading.Thread):
    """A daemon thread on a rank that answers `ask()` with the main thread's stack.

    `files`/`line_offset` narrow and shift the learner's frames (see `learner_where`); `extra()`
    adds fields to each answer (a check adds its case and phase); `on_tick()` runs at every poll
    (a check worker ends itself there when its client is gone). Never raises into the rank.
    """

    def __init__(self, folder: str, rank: int, *, poll: float = 0.2, files: Iterable[str] | None = None,
                 line_offset: int = 0, extra: Callable[[], dict] | None = None,
                 on_tick: Callable[[], None] | None = None) -> None:
        super().__init__(name="hpdl-hang-answerer", daemon=True)
        self.folder, self.rank, self.poll = folder, rank, poll
        self.files, self.line_offset = files, line_offset
        self.extra, self.on_tick = extra, on_tick
        self.main_ident = threading.main_thread().ident
        self.fault_file = None  # kept open for faulthandler by whoever calls install_faulthandler

    def answer(self, token: str) -> dict:
        data = snapshot(self.main_ident, self.files, self.line_offset)
        data.update(token=token, rank=self.rank)
        if self.extra is not None:
            data.update(self.extra())
        _write_json(answer_path(self.folder, self.rank), data)
        return data

    def run(self) -> None:
        request = os.path.join(self.folder, REQUEST)
        seen = None
        while True:
            time.sleep(self.poll)
            if self.on_tick is not None:
                self.on_tick()
            try:
                with open(request) as f:
                    token = f.read().strip()
            except OSError:
                continue
            if token and token != seen:
                seen = token
                try:
                    self.answer(token)
                except Exception:  # the answerer must never take the rank down
                    log.exception("rank %s could not write its stack", self.rank)


def install_faulthandler(folder: str, rank: int):
    """SIGUSR1 makes Python write every thread's stack to folder/rank<N>.fault, even while a C
    call holds the Python lock (when the Answerer cannot run). Returns the open file."""
    fh = open(fault_path(folder, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
    return fh


# -- client side --------------------------------------------------------------------------------

def ask(folder: str | Callable[[int], str], ranks: Iterable[int], wait: float = 2.5, poll: float = 0.05,
        procs: Mapping[int, object] | None = None, files: Iterable[str] | None = None,
        sources: Mapping[str, list[str]] | None = None, line_offset: int = 0) -> dict[int, dict]:
    """Ask ranks where they are: {rank: answer} for those that answered within `wait` seconds.
    `folder`: the ranks' folder, or each rank's own (a function of the rank: a check's isolated ranks).

    Ranks that did not answer and have a recorded process in `procs` (hpdl.procs.Proc) get
    SIGUSR1, and their faulthandler dump is read instead (`files`, `sources`: see `parse_fault`).
    """
    ranks = list(ranks)
    if not ranks:
        return {}
    token = uuid.uuid4().hex
    folder_of = folder if callable(folder) else (lambda r, _f=folder: _f)
    for place in {folder_of(r) for r in ranks}:
        _write_text(os.path.join(place, REQUEST), token)
    found: dict[int, dict] = {}
    deadline = time.monotonic() + wait
    while len(found) < len(ranks):
        for r in ranks:
            if r in found:
                continue
            try:  # the ranks' folder (a learner's can write it): no link, no FIFO, bounded
                data = safefiles.json_of(safefiles.read_bounded(answer_path(folder_of(r), r), MAX_ANSWER_BYTES))
            except (OSError, ValueError):
                continue
            if isinstance(data, dict) and data.get("token") == token:
                found[r] = data
        if len(found) == len(ranks) or time.monotonic() > deadline:
            break
        time.sleep(poll)
    missing = [r for r in ranks if r not in found and procs and r in procs]
    if missing:
        from hpdl import procs as _procs

        sent = [r for r in missing if _procs.signal_process(procs[r], signal.SIGUSR1)]
        time.sleep(0.3)
        for r in sent:
            try:
                text = safefiles.read_bounded(fault_path(folder_of(r), r), MAX_ANSWER_BYTES, too_large="cut")
            except OSError:
                continue
            where = parse_fault(text.decode("utf-8", "replace"), files, sources, line_offset)
            if where:
                found[r] = {"rank": r, "where": where, "via": "faulthandler"}
    return found


def _write_text(path: str, text: str) -> None:
    """Into a folder the ranks (a learner's) can write: a fresh name created exclusively, then
    renamed; a `dump-request.tmp` link planted there is never written through."""
    safefiles.replace_atomically(path, text, mode=0o644)


def parse_fault(text: str, files: Iterable[str] | None = None, sources: Mapping[str, list[str]] | None = None,
                line_offset: int = 0) -> dict | None:
    """The learner's innermost frame in a faulthandler dump (which has no source text: it is
    taken from `sources` {file: lines} when given, else from the file if it exists)."""
    files = set(files) if files is not None else None
    hits = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
    ours = [(f, int(n), fn) for f, n, fn in hits if is_learner_file(f, files)]
    if not ours:
        return None
    f, n, fn = ours[0]  # faulthandler lists the innermost frame first
    lines = (sources or {}).get(f)
    if lines is None:
        import linecache

        code = linecache.getline(f, n).strip()
    else:
        code = lines[n - 1].strip() if 0 < n <= len(lines) else ""
    return {"file": f, "line": n + line_offset, "func": fn, "code": code}


NO_ANSWER = "(did not answer; it may be holding the Python lock inside a C call)"

DEADLOCK_HINT = (
    "A rank waiting in an MPI call waits for a partner that never comes: a receive no one sends to, "
    "or a collective not every rank calls. Check that every Send has a matching Recv, and that the "
    "ranks do not all receive (or all send large messages with blocking sends) at the same time: "
    "Sendrecv avoids both."
)

PANEL_HINT = (
    "The rank panel, hpdl.panel() (or %hpdl panel), shows every rank's state and line live while a "
    "cell runs: open it before the cell to watch where each rank stops."
)


def ranks_text(ranks: Iterable[int]) -> str:
    """'0–3' for a run of three or more, else '0, 2'; each rank once, however often it is listed
    (one rule for %%px, the panel and the checker, which all word rank lists with these two)."""
    ranks = sorted(set(ranks))
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}–{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


def rank_word(ranks: Iterable[int]) -> str:
    """'rank 0' or 'ranks 1, 2' (the count is of distinct ranks, as in ranks_text)."""
    ranks = set(ranks)
    return f"rank{'s' if len(ranks) != 1 else ''} {ranks_text(ranks)}"


def place_text(where: Mapping | None, code: str | None = None) -> str:
    """'line 4 of the cell: comm.Recv(buf)' or 'line 12 of ring(): comm.Recv(buf)'.

    `code` is the cell's source, used for the line's text when the rank could not read it."""
    if not where:
        return NO_ANSWER
    func = where.get("func") or "<module>"
    place = "the cell" if func == "<module>" else f"{func}()"
    text = where.get("code") or ""
    if not text and code and func == "<module>":
        lines = code.splitlines()
        if 0 < where["line"] <= len(lines):
            text = lines[where["line"] - 1].strip()
    return f"line {where['line']} of {place}: {text}" if text else f"line {where['line']} of {place}"


def stuck_text(answer: Mapping | str | None, code: str | None = None) -> str:
    """Where one stuck rank is, from its answer to `ask` (or a text the caller already has)."""
    if isinstance(answer, str):
        return answer
    if not answer:
        return NO_ANSWER
    if answer.get("where"):
        return place_text(answer["where"], code)
    inner = (answer.get("frames") or [None])[-1]
    if inner:
        return f"(not in your code: in {inner['func']}() of {os.path.basename(inner['file'])})"
    return NO_ANSWER


def report_lines(stuck: Mapping[int, Mapping | str | None], finished: Iterable[int] = (),
                 errors: Mapping[int, str] | None = None, code: str | None = None,
                 group: bool = False) -> list[str]:
    """The body of every hang report, one line per fact:

        finished: ranks 1, 2
        stuck:    rank 0 at line 4 of the cell: comm.Recv(buf, source=2)
        error:    rank 3 raised ZeroDivisionError: division by zero

    `stuck` maps each unfinished rank to its answer from `ask` (or None, or a ready text);
    with `group`, ranks stuck at the same place share one line ('ranks 0–3 at line 4 ...')."""
    finished = sorted(finished)
    lines = [f"  finished: {rank_word(finished)}"] if finished else []
    places: dict[str, list[int]] = {}
    for r in sorted(stuck):
        places.setdefault(stuck_text(stuck[r], code), []).append(r)
    if group:
        lines += [f"  stuck:    {rank_word(rs)} at {text}" for text, rs in places.items()]
    else:
        lines += [f"  stuck:    rank {r} at {stuck_text(stuck[r], code)}" for r in sorted(stuck)]
    for r, e in sorted((errors or {}).items()):
        lines.append(f"  error:    rank {r} raised {e}")
    return lines


def summary(stuck: Mapping[int, Mapping | str | None], finished: Iterable[int] = (),
            errors: Mapping[int, str] | None = None, code: str | None = None) -> str:
    """`report_lines` on one line, grouped, for a table cell:
    'finished: rank 0; stuck: ranks 1, 3 at line 4 of ring(): comm.Recv(buf)'."""
    lines = report_lines(stuck, finished, errors, code, group=True)
    return "; ".join(re.sub(r"^\s*(\w+):\s+", r"\1: ", s) for s in lines)


def hang_message(headline: str, stuck: Mapping[int, Mapping | str | None], finished: Iterable[int] = (),
                 errors: Mapping[int, str] | None = None, code: str | None = None, advice: str = "",
                 hint: str = DEADLOCK_HINT) -> str:
    """A whole hang report: headline, `report_lines`, the deadlock hint, then what to do."""
    lines = [headline, *report_lines(stuck, finished, errors, code)]
    lines += [s for s in (hint, advice) if s]
    return "\n".join(lines)


__all__ = [
    "REQUEST", "answer_path", "fault_path", "is_learner_file", "frame_dict", "learner_where", "snapshot",
    "Answerer", "install_faulthandler", "ask", "parse_fault", "NO_ANSWER", "DEADLOCK_HINT", "PANEL_HINT",
    "ranks_text", "rank_word", "place_text", "stuck_text", "report_lines", "summary", "hang_message",
]
