"""What a rank tells the live panel (hpdl.panel), and only when it is watched.

The rank's main thread runs the learner's cells and must not pay for being watched. So a rank
answers from the thread that already answers "where are you stuck?" (hpdl.hang.Answerer, which
wakes every 0.2 s): at each wake-up it reads one small request file, and only when the panel
has written a new token there does it look at the main thread's stack, its memory and its last
training step, and write them down:

    rank side (Reporter.tick, on the Answerer thread)   kernel side (hpdl.panel, a thread)
    -------------------------------------------------   ----------------------------------
    reads folder/panel-request          <-------------   request(folder): a fresh token, every 0.5 s
    writes folder/state<rank>.json      ------------->   answers(folder, ranks, tokens)

A training loop marks its steps with `step()` (or `hpdl.panel.step()`; hpdl.dp.step_times does it
for the steps it times); the panel shows the last step's time. Standard library only: this
module runs on every rank and imports nothing client-side.
"""
from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
import uuid
from typing import Iterable

from hpdl import hang

log = logging.getLogger(__name__)

REQUEST = "panel-request"
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def state_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"state{rank}.json")


# -- the training loop's marks -------------------------------------------------------------------

_steps = {"count": 0, "seconds": None, "at": None}  # this rank's last step: how long, and when it ended


def step(seconds: float | None = None) -> None:
    """Mark the end of a training step on this rank; the panel shows how long it took.

    Without `seconds`, a step lasts from the previous mark to this one (call it once per loop
    iteration). Costs a clock read and three assignments: cheap enough for every step."""
    now = time.perf_counter()
    if seconds is None and _steps["at"] is not None:
        seconds = now - _steps["at"]
    _steps["count"] += 1
    _steps["seconds"] = seconds
    _steps["at"] = now


def last_step() -> dict:
    """{'count', 'seconds', 'ago'}: how many steps were marked, the last one's length, and how
    long ago it ended (None before the first mark)."""
    at = _steps["at"]
    return {"count": _steps["count"], "seconds": _steps["seconds"],
            "ago": None if at is None else time.perf_counter() - at}


# -- what the rank looks like now ---------------------------------------------------------------

def rss_bytes() -> int | None:
    """This process's resident memory (one read of /proc/self/statm; psutil elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        try:
            import psutil

            return psutil.Process().memory_info().rss
        except Exception as exc:  # no /proc and no psutil: the panel shows a dash
            log.debug("no RSS: %s", exc)
            return None


def gpu_bytes(device_index: int | None) -> int | None:
    """Bytes the rank's tensors hold on its GPU, when it has one and CUDA is already started.

    Never starts CUDA itself (that would be work the rank did not ask for), and names the device:
    the current CUDA device is per thread, and this runs on a side thread."""
    torch = sys.modules.get("torch")
    if torch is None or device_index is None:
        return None
    try:
        if not torch.cuda.is_initialized():
            return None
        return int(torch.cuda.memory_allocated(device_index))
    except Exception as exc:  # a CUDA error must not take the rank down
        log.debug("no GPU memory for device %s: %s", device_index, exc)
        return None


def where_now(thread_ident: int) -> dict | None:
    """The innermost of the learner's frames on a thread ({file, line, func, code}), or None.

    Walks the frames itself instead of formatting the whole stack (as hang.snapshot does for a
    report): only the one line shown is looked up, so a sample costs a few microseconds."""
    frame = sys._current_frames().get(thread_ident)
    while frame is not None:
        code = frame.f_code
        if hang.is_learner_file(code.co_filename):
            import linecache

            text = linecache.getline(code.co_filename, frame.f_lineno).strip()
            return {"file": code.co_filename, "line": frame.f_lineno, "func": code.co_name, "code": text}
        frame = frame.f_back
    return None


def state(thread_ident: int, device_index: int | None = None) -> dict:
    """One sample of this rank: where its main thread is, its last step, its memory."""
    where = where_now(thread_ident)
    return {
        "pid": os.getpid(),
        "busy": where is not None,  # a learner's frame on the stack: a cell (or function) is running
        "where": where,
        "step": last_step(),
        "rss": rss_bytes(),
        "gpu": gpu_bytes(device_index),
    }


def _write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, default=str)
    os.replace(tmp, path)


class Reporter:
    """Answers the panel's requests; its `tick` is called by the rank's hang.Answerer thread.

    A tick without a new request costs one small file read."""

    def __init__(self, folder: str, rank: int, device_index: int | None = None) -> None:
        self.folder, self.rank, self.device_index = folder, rank, device_index
        self.main_ident = threading.main_thread().ident
        self.request = os.path.join(folder, REQUEST)
        self.seen: str | None = None

    def tick(self) -> None:
        try:
            with open(self.request) as f:
                token = f.read().strip()
        except OSError:
            return  # no panel has asked yet
        if not token or token == self.seen:
            return
        self.seen = token
        try:
            data = state(self.main_ident, self.device_index)
            data.update(token=token, rank=self.rank)
            _write_json(state_path(self.folder, self.rank), data)
        except Exception:  # being watched must never take the rank down
            log.exception("rank %s could not write its state for the panel", self.rank)


# -- kernel side: ask and read ------------------------------------------------------------------

def request(folder: str) -> str:
    """Ask every rank for a fresh sample; returns the token their answers will carry."""
    token = uuid.uuid4().hex
    path = os.path.join(folder, REQUEST)
    with open(path + ".tmp", "w") as f:
        f.write(token)
    os.replace(path + ".tmp", path)
    return token


def answers(folder: str, ranks: Iterable[int], tokens: Iterable[str]) -> dict[int, dict]:
    """The ranks' latest samples that answer one of `tokens` (recent requests); others are stale."""
    tokens = set(tokens)
    found = {}
    for r in ranks:
        try:
            with open(state_path(folder, r)) as f:
                data = json.load(f)
        except (OSError, ValueError):
            continue
        if data.get("token") in tokens:
            found[r] = data
    return found


__all__ = ["REQUEST", "state_path", "step", "last_step", "rss_bytes", "gpu_bytes", "where_now", "state",
           "Reporter", "request", "answers"]
