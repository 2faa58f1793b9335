"""Engine side: let a stuck rank say where it is stuck.

A rank blocked inside an MPI call cannot run Python code in its main thread, and SIGINT
does not reach it. A small daemon thread can still read the main thread's stack (MPI calls
release the GIL) and write it, with source lines, to a file the client reads. The client
asks for a dump by touching `<run_dir>/dump-request`; each rank answers in
`<run_dir>/stacks/rank<N>.txt`. A faulthandler dump on SIGUSR1 is the fallback for code
that holds the GIL.
"""
from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback

_state = {"busy_since": None, "cell": 0, "installed": False}


def _ours(filename: str) -> bool:
    """Frames from Python's and the libraries' own files are plumbing, not the learner's code."""
    skip = ("site-packages", "dist-packages", "/lib/python", "<frozen")
    return not any(s in filename for s in skip)


def snapshot(main_ident: int) -> dict:
    """The main thread's stack, innermost learner frame first picked out."""
    frame = sys._current_frames().get(main_ident)
    stack = traceback.extract_stack(frame) if frame is not None else []
    frames = [
        {"file": f.filename, "line": f.lineno, "func": f.name, "code": (f.line or "").strip()}
        for f in stack
    ]
    learner = [f for f in frames if _ours(f["file"]) and "/hpdl/" not in f["file"]]
    busy = _state["busy_since"]
    return {
        "pid": os.getpid(),
        "busy": busy is not None,
        "busy_for_s": round(time.time() - busy, 1) if busy else 0.0,
        "cell": _state["cell"],
        "where": learner[-1] if learner else (frames[-1] if frames else None),
        "frames": frames[-12:],
    }


def _write(path: str, data: dict) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def _loop(run_dir: str, rank: int, main_ident: int) -> None:
    request = os.path.join(run_dir, "dump-request")
    out = os.path.join(run_dir, "stacks", f"rank{rank}.json")
    seen = None
    while True:
        time.sleep(0.2)
        try:
            token = open(request).read().strip()
        except OSError:
            continue
        if token and token != seen:
            seen = token
            try:
                data = snapshot(main_ident)
                data["token"] = token
                data["rank"] = rank
                _write(out, data)
            except Exception:  # the watchdog must never take the engine down
                pass


def _pre(*_a, **_k) -> None:
    _state["busy_since"] = time.time()
    _state["cell"] += 1


def _post(*_a, **_k) -> None:
    _state["busy_since"] = None


def install(run_dir: str, rank: int) -> None:
    """Start the dump thread once per engine and follow which cell is running."""
    if _state["installed"]:
        return
    os.makedirs(os.path.join(run_dir, "stacks"), exist_ok=True)
    try:
        from IPython import get_ipython

        ip = get_ipython()
        if ip is not None:
            ip.events.register("pre_run_cell", _pre)
            ip.events.register("post_run_cell", _post)
    except Exception:
        pass
    try:
        fh = open(os.path.join(run_dir, "stacks", f"rank{rank}.faulthandler.txt"), "w")
        faulthandler.register(signal.SIGUSR1, file=fh, all_threads=True, chain=False)
        _state["fh"] = fh
    except (AttributeError, ValueError, OSError):
        pass
    t = threading.Thread(
        target=_loop, args=(run_dir, rank, threading.main_thread().ident), name="hpdl-watchdog", daemon=True
    )
    t.start()
    _state["installed"] = True
