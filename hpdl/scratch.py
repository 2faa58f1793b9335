"""Scratch folders under the temporary directory that a killed process cannot strand.

A check's jobs and a grading batch each work in a 0700 folder of their own under $TMPDIR, removed
when they end. A process killed outright (a kernel restarted mid-check, a grader stopped with
SIGKILL) never reaches that `finally`: its folder stayed, holding a check's inputs or every
submission's copy. So each folder's name carries the host and pid that made it, and the next
folder made of the same kind first removes those whose maker is gone.

    work = scratch.make("grade")      # $TMPDIR/hpdl-grade-<host>-<pid>-<random>

Only this host's folders are judged (a $TMPDIR shared by a cluster's nodes holds other nodes'),
only this user's, and only when no process has the pid: a pid reused since is left alone.
"""
from __future__ import annotations

import os
import socket
import stat
import tempfile
from pathlib import Path

from hpdl import procs, safefiles


def _prefix(kind: str) -> str:
    return f"hpdl-{kind}-{socket.gethostname()}-"


def make(kind: str) -> Path:
    """A new 0700 folder for `kind` ("check", "grade"), after removing those left by makers now gone."""
    sweep(kind)
    return Path(tempfile.mkdtemp(prefix=f"{_prefix(kind)}{os.getpid()}-"))


def made_by(pid: int, kind: str = "*") -> list[Path]:
    """The folders of `kind` (any kind: "*") that process `pid` made on this host and that are there now."""
    return sorted(Path(tempfile.gettempdir()).glob(f"{_prefix(kind)}{pid}-*"))


def sweep(kind: str) -> list[str]:
    """Remove this host's and user's `kind` folders whose maker no longer runs. Returns what was removed."""
    root, prefix, removed = tempfile.gettempdir(), _prefix(kind), []
    try:
        names = [n for n in os.listdir(root) if n.startswith(prefix)]
    except OSError:
        return removed
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or procs.pid_alive(int(pid)):
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid():
            safefiles.remove_tree(path)
            removed.append(path)
    return removed


__all__ = ["make", "made_by", "sweep"]
