"""`hpdl grade`: run every submitted notebook headless, sandboxed, and check its exercises.

    hpdl grade SUBMISSIONS_DIR --out report [--timeout 600] [--jobs 1] [--exercises a,b]

Each notebook (SUBMISSIONS_DIR/*.ipynb, or one folder per learner) is copied to a folder of
its own and executed there by nbclient, in a bubblewrap sandbox (checker/sandbox.py: the kit and
everything else read-only, other submissions and the reports invisible, private /tmp, no
network, its own PID namespace, rlimits on CPU, memory, processes and file size) or, where
there is none, under the same rlimits in a process group of its own; the report says which.

The submission's kernel decides nothing: each hpdl.check() in it hands the learner's function
to this process (checker/grade_service.py), which runs the check in grade mode (the exercise's
own rank counts, time limits and hidden cases) and keeps the result. Points per exercise come
from the case modules; the exercises scored are those named with --exercises, else those called
(in code, not comments) by the notebooks of most learners, and by half of them where the exercise
is of the same lesson (a learner: a folder of the submissions folder, or a notebook directly in it).
The reports go to a folder outside the submissions (refused inside), written under fresh names.

Every submission ends with a status and a reason (ok, timeout, kernel died, runner failed,
not a notebook, ...). Results are appended to OUT/results.jsonl as each submission finishes and
the reports are rewritten, so a batch killed midway leaves a valid partial report, and running
the same command again resumes with the submissions not yet graded (a changed notebook is
graded again). Those that were running when the grader itself died are graded first, each alone; one
it died on twice, once alone, is not run again (status "grader died"). Writes (all readable by
their owner only): grades.csv (one row per submission), cases.csv (one row per case), grades.json
(everything, predictions included), index.html, and executed/ (each notebook as it ran).
"""
from __future__ import annotations

import argparse
import csv
import functools
import hashlib
import html
import json
import os
import re
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from hpdl import safefiles, scratch, settings
from hpdl.checker.sandbox import DISK_BYTES, default_memory
from hpdl.errors import HpdlError

CHECK_CALL = re.compile(r"""check\(\s*["']([A-Za-z_][A-Za-z0-9_]*)["']""")
MAX_PARSED_CELL = 64 * 1024  # characters: a longer code cell is not read for the checks it calls
# characters of a notebook's cells parsed for the checks it calls, all together: a thousand cells of 64 KiB
# that name check( cost the grader 7.7 s a hundred, before any sandbox or timer, again on each resume
MAX_PARSED_NOTEBOOK = 1024 * 1024
SKIP_DIRS = {".ipynb_checkpoints", "__pycache__"}
MAX_PER_LEARNER = 64  # notebooks listed in one learner's folder (a flood of empty ones made a row each)
MAX_LISTED = 20_000  # and in all: each is a row of every report, written again after each submission
MAX_FOLDER_DEPTH = 16  # levels of folders searched for notebooks under the submissions folder
MAX_NOTEBOOK_BYTES = 64 * 2**20
MAX_OUTPUT_BYTES = 8 * 2**20  # a saved notebook's outputs, all cells together; the rest is cut with a note
MAX_ONE_OUTPUT = 2**20  # one output (a stream's text, an image)
# what a notebook may send as output while it runs: past it, an output flood that would hold its slot until
# the time limit (and fill the runner's memory) is interrupted; if it goes on (the interrupt caught), its
# kernel is killed. Output past it is not kept.
FLOOD_BYTES = 4 * MAX_OUTPUT_BYTES
FLOOD_GRACE = 5.0  # s for an interrupted cell to end, then for its kernel to say it has, before it is killed
# s the runner keeps reading a cell's outputs after the kernel has answered it (nbclient: 4, then the rest is
# dropped): a flood's backlog, read late on a busy machine, holds the cell's KeyboardInterrupt last
IOPUB_WAIT = 60
MAX_STATUS_BYTES = 100_000


@dataclass
class Submission:
    """One notebook, and what running it gave."""

    name: str  # path relative to the submissions folder
    path: Path
    digest: str = ""
    exercises: list[str] = field(default_factory=list)  # checks the notebook calls
    status: str = "pending"  # ok, timeout, kernel died, runner failed, not a notebook, ...
    detail: str = ""
    seconds: float = 0.0
    checks: dict[str, dict] = field(default_factory=dict)  # exercise -> CheckResult.to_dict(), from the grader
    predictions: list[dict] = field(default_factory=list)  # cells tagged "prediction": not scored
    cell_errors: int = 0
    sandboxed: bool = False
    limits: dict = field(default_factory=dict)  # its total caps, read back: {"memory": bytes, "tasks": n}
    root: Path | None = None  # the submissions folder, from which `path` is read again through no link

    def score(self, scored: dict[str, float] | None = None) -> float:
        return sum(float(c.get("score", 0.0)) for ex, c in self.checks.items() if scored is None or ex in scored)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["path"] = str(self.path)
        d.pop("root", None)
        return d


def find_submissions(folder: Path) -> list[Submission]:
    """Every notebook under `folder`; a symbolic link (to a notebook or a folder) is listed as
    refused, never followed: it could name another learner's notebook, or any file we can read."""
    if not folder.is_dir():
        raise HpdlError(f"{folder} is not a folder of submitted notebooks.")
    from hpdl.checker.cases import known

    exercises = set(known())
    subs = []
    for path, refused in _candidates(folder):
        name = _text_of_name(path.relative_to(folder).as_posix())
        if refused:
            subs.append(Submission(name, path, status="refused", detail=refused, root=folder))
            continue
        try:
            data = safefiles.read_bounded(path, MAX_NOTEBOOK_BYTES + 1, too_large="cut")
        except OSError as exc:
            subs.append(Submission(name, path, status="unreadable", detail=str(exc), root=folder))
            continue
        sub = Submission(name, path, hashlib.sha256(data).hexdigest(), exercises=_known_checks(data, exercises),
                         root=folder)
        if len(data) > MAX_NOTEBOOK_BYTES:
            sub.status, sub.detail = "too large", f"more than {MAX_NOTEBOOK_BYTES // 2**20} MiB"
        elif _cells(data) is None:
            sub.status, sub.detail = "not a notebook", "not a Jupyter notebook: no list of cells in its JSON"
        subs.append(sub)
    if not subs:
        raise HpdlError(f"No notebooks (*.ipynb) in {folder}.")
    return _alike_written_out(subs)


def _alike_written_out(subs: list[Submission]) -> list[Submission]:
    """Names that read alike with every character beyond ASCII written out as \\uNNNN: the same once
    Unicode-normalised (`josé` typed as one character or as e and a combining accent), or once characters that
    show as nothing are dropped and letters that look Latin read as Latin (`alice` with a combining grapheme
    joiner, `bоb` with a Cyrillic о). Each showed as one name in every report, one 36/36 and one 0/36, so a
    learner could put a row under another's name. Characters that show as nothing, and line breaks (a name
    holding a CSV row), are written out in every name."""
    from collections import Counter

    for s in subs:
        s.name = "".join(_written_out(c) if c in _INVISIBLE or not c.isprintable() else c for c in s.name)
    keys = [_skeleton(s.name) for s in subs]
    seen = Counter(keys)
    for s, key in zip(subs, keys):
        if seen[key] > 1:
            s.name = "".join(c if ord(c) < 128 else _written_out(c) for c in s.name)
    return subs


def _written_out(c: str) -> str:
    return f"\\x{ord(c):02x}" if ord(c) < 128 else f"\\u{ord(c):04x}" if ord(c) < 65536 else f"\\U{ord(c):08x}"


# characters a name shows as nothing: format characters (joiners, marks of direction), fillers, blanks
_INVISIBLE = set("\u034f\u115f\u1160\u17b4\u17b5\u180e\u2800\u3164\uffa0") | {
    chr(c) for c in (*range(0x200b, 0x2010), *range(0x2060, 0x2070), *range(0xfe00, 0xfe10), 0xfeff, 0xad)}
# letters of other scripts drawn as Latin ones
_LOOK_LATIN = str.maketrans("аеорсухіјѕԁɡοαντκιυϲ", "aeopcyxijsdgoavtkiuc")


def _skeleton(name: str) -> str:
    import unicodedata

    name = unicodedata.normalize("NFKD", name).casefold()
    name = "".join(c for c in name if c not in _INVISIBLE and unicodedata.category(c) not in ("Mn", "Me", "Cf"))
    return unicodedata.normalize("NFKC", name.translate(_LOOK_LATIN))


def submitted_bytes(sub: Submission) -> bytes:
    """The submission's file as it is now, reached from the submissions folder through no link (a learner's
    folder swapped for a link to another's, after the listing, was graded with the other's notebook: 36/36)."""
    if sub.root is None:
        return safefiles.read_bounded(sub.path, MAX_NOTEBOOK_BYTES)
    return safefiles.read_beneath(sub.root, sub.path.relative_to(sub.root), MAX_NOTEBOOK_BYTES)


def graded_bytes(sub: Submission) -> bytes:
    """The notebook's bytes as they are now, which are what is graded; its fingerprint and the checks it calls are
    taken from them again where it changed since it was listed. The file was read once at listing, for those, and
    again minutes later to run it: a notebook replaced in between was graded, and its grade kept on a resumed
    batch, under the fingerprint of the first one (a trivial notebook resumed at 36/36)."""
    data = submitted_bytes(sub)
    digest = hashlib.sha256(data).hexdigest()
    if digest != sub.digest:
        sub.digest, sub.exercises = digest, _known_checks(data)
    return data


def _text_of_name(name: str) -> str:
    """A file name as text: bytes that are not UTF-8 (an archive unpacked from another system's
    encoding, or a learner's choice) written out as \\xNN. Python keeps them as lone surrogates,
    which no report can encode: one such name ended the whole batch. A backslash of the name's own is
    doubled first, so two names never read alike: a notebook named `a\\xe9.ipynb` beside one whose
    name holds the byte 0xe9 were one row, one learner and one executed notebook, the second's."""
    return name.replace("\\", "\\\\").encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")


def _candidates(folder: Path) -> list[tuple[Path, str]]:
    """(path, "" or why it is refused) for each *.ipynb under `folder`, sorted. Refused, never
    followed nor searched: a symbolic link (to a notebook or a folder: it could name another
    learner's notebook, or any file we can read), a folder deeper than MAX_FOLDER_DEPTH (os.walk
    recursed once per level: a tree a thousand deep, from an unpacked archive, ended the batch),
    a folder that cannot be read."""
    found, todo, per = [], [(folder, 0)], {}
    while todo:
        base, depth = todo.pop()
        learner = base.relative_to(folder).parts[:1]
        if per.get(learner, 0) > MAX_PER_LEARNER:
            continue
        try:
            entries = list(os.scandir(base))
        except OSError as exc:
            found.append((base, f"a folder that could not be read ({exc.strerror})"))
            continue
        for e in entries:
            path, is_folder = base / e.name, e.is_dir()  # a link to a folder too, as os.walk sorts them
            if e.name in SKIP_DIRS if is_folder else not e.name.endswith(".ipynb"):
                continue
            if len(found) >= MAX_LISTED:  # a class's: one folder of 300,000 notebooks at the top, too
                found.append((folder, f"more than {MAX_LISTED} notebooks in the submissions folder: the rest were "
                                      "not listed (grade the class in parts)"))
                return sorted(found)
            mine = learner or (e.name,)
            if not is_folder or e.is_symlink():
                per[mine] = per.get(mine, 0) + 1
                if per[mine] > MAX_PER_LEARNER:  # 300,000 empty notebooks, a row each: a 2.7 GB grader
                    if per[mine] == MAX_PER_LEARNER + 1:
                        found.append((folder / mine[0], f"more than {MAX_PER_LEARNER} notebooks in this learner's "
                                                        "folder: the rest were not listed"))
                    continue
            if e.is_symlink():
                found.append((path, f"a symbolic link (to {_text_of_name(os.readlink(path))[:200]}), not "
                                    "followed: submit the notebook itself"))
            elif not is_folder:
                found.append((path, ""))
            elif depth < MAX_FOLDER_DEPTH:
                todo.append((path, depth + 1))
            else:
                found.append((path, f"a folder more than {MAX_FOLDER_DEPTH} folders deep, not searched: "
                                    "submit notebooks nearer the top"))
    return sorted(found)


def _cells(data: bytes) -> list[dict] | None:
    """The cells of a notebook's JSON, or None when it is not a notebook."""
    try:
        nb = safefiles.json_of(data)  # too deep to parse is not a notebook either, never an exception
    except ValueError:
        return None
    cells = nb.get("cells") if isinstance(nb, dict) else None
    if not isinstance(cells, list):
        return None
    return [c for c in cells if isinstance(c, dict)]


def _text(src) -> str:
    if isinstance(src, list):
        return "".join(s for s in src if isinstance(s, str))
    return src if isinstance(src, str) else ""


def _known_checks(data: bytes, exercises: set[str] | None = None) -> list[str]:
    """The exercises of the kit (`exercises`, else its case modules) that a notebook calls a check of."""
    if exercises is None:
        from hpdl.checker.cases import known

        exercises = set(known())
    return [ex for ex in _called_checks(data) if ex in exercises]


def _called_checks(data: bytes) -> list[str]:
    """The exercises a notebook's code calls a check of: `check("name", ...)` as a call in a code cell, not
    in a comment or a string (a notebook's text must not add an exercise to the class's scoring)."""
    names, parsed = [], 0
    for cell in _cells(data) or []:
        text = _text(cell.get("source")) if cell.get("cell_type") == "code" else ""
        if len(text) <= MAX_PARSED_CELL and CHECK_CALL.search(text):  # the cheap test first: few cells parse
            parsed += len(text)
            if parsed > MAX_PARSED_NOTEBOOK:
                break
            for name in _check_calls(text):
                if name not in names:
                    names.append(name)
    return names


def _check_calls(text: str) -> list[str]:
    """First arguments of the calls to something named `check` in a cell's code (IPython's magic lines and
    shell escapes read as blank lines); none where the cell is not Python."""
    import ast

    code = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in text.splitlines())
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return []
    return [n.args[0].value for n in ast.walk(tree)
            if isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == "check"
            and n.args and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)]


MAX_PREDICTIONS = 32  # cells tagged "prediction" kept per notebook (a lesson has at most 6)
MAX_PREDICTION_CHARS = 4_000  # of each one's source, and of its output


def predictions_of(cells: list[dict]) -> list[dict]:
    """Cells a lesson tags "prediction": the learner's written prediction, and any text it printed.
    Bounded: every report holds them and is written again after each submission, so 3000 tagged cells
    of 20,000 characters each, in two notebooks, once made a 480 MB index.html and a 2.9 GB grader."""
    out = []
    for i, cell in enumerate(cells):
        meta = cell.get("metadata") if isinstance(cell.get("metadata"), dict) else {}
        tags = meta.get("tags") if isinstance(meta.get("tags"), list) else []
        if "prediction" not in tags:
            continue
        if len(out) == MAX_PREDICTIONS:
            out.append({"cell": i, "source": f"[cells tagged prediction from here on not kept: at most "
                                              f"{MAX_PREDICTIONS} a notebook]", "output": ""})
            break
        texts = []
        outputs = cell.get("outputs") if cell.get("cell_type") == "code" else None  # a raw cell's are not its run's
        for o in outputs if isinstance(outputs, list) else []:
            if not isinstance(o, dict):
                continue
            if o.get("output_type") == "stream":
                texts.append(_text(o.get("text")))
            elif isinstance(o.get("data"), dict) and "text/plain" in o["data"]:
                texts.append(_text(o["data"]["text/plain"]))
        out.append({"cell": i, "source": _text(cell.get("source"))[:MAX_PREDICTION_CHARS],
                    "output": "".join(texts)[:MAX_PREDICTION_CHARS]})
    return out


# -- running one notebook (in its own process, inside the sandbox) --------------------------------

#: what run_one writes as a notebook's status; the grader takes no other from the folder it writes in
RUNNER_STATUSES = ("ok", "not a notebook", "timeout", "kernel died", "error")


def _undumpable() -> None:
    """The runner, before it starts the notebook's kernel: a process of the same user may not write its
    memory (/proc/PID/mem, process_vm_writev: a kernel rewriting the status or the notebook-as-run the
    runner is about to save) nor read it. Seccomp refuses ptrace; this is the rest (PR_SET_DUMPABLE 0).
    The kernel is a new program, dumpable again: it may read and write its own."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE


OWN_PIDS = "--outside-pid-namespace"  # the runner's last argument in a sandbox: the grader's PID namespace


def run_one(notebook: Path, executed: Path, status_file: Path, cell_timeout: float, outer: str | None = None) -> int:
    """Executed in a child process: run the notebook, keep going past failing cells. `outer` (in a sandbox: the
    grader's PID namespace, which the runner's is not): once the notebook has run, every other process in the
    runner's namespace is ended before it writes the status and the notebook-as-run, so nothing the notebook
    left running (a process of a new session, say) can replace them between those writes and the runner's exit."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellTimeoutError, DeadKernelError

    status = {"status": "ok", "detail": ""}
    try:
        nb = nbformat.read(notebook, as_version=4)
        if not isinstance(nb.get("cells"), list) or not all(isinstance(c, dict) and "cell_type" in c for c in nb.cells):
            raise ValueError("no list of cells")
    except Exception as exc:  # valid JSON that is not a notebook, or not JSON at all
        status_file.write_text(json.dumps({"status": "not a notebook", "detail": f"{type(exc).__name__}: "
                                                                                 f"{str(exc)[:300]}"}))
        return 0
    for cell in nb.cells:  # what the submission brought as outputs is not what it printed here
        if cell.get("cell_type") == "code":
            cell["outputs"], cell["execution_count"] = [], None
        else:
            cell.pop("outputs", None)
    # every code cell runs: one tagged skip-execution (nbclient's default skip) kept its submitted outputs, a
    # check's "36/36" among them
    client = _flood_stopping(NotebookClient)(nb, timeout=int(cell_timeout), kernel_name="python3",
                                              skip_cells_with_tag=f"hpdl-runs-every-cell-{os.urandom(8).hex()}",
                                              allow_errors=True, resources={"metadata": {"path": str(notebook.parent)}})
    try:
        client.execute()
    except CellTimeoutError as exc:
        status = {"status": "timeout", "detail": f"a cell ran longer than {cell_timeout:g} s: {str(exc)[:300]}"}
    except DeadKernelError as exc:
        status = {"status": "kernel died", "detail": str(exc)[:300]}
    except Exception as exc:
        status = {"status": "error", "detail": f"{type(exc).__name__}: {str(exc)[:300]}"}
    if client.flood:
        status["detail"] = (f"{client.flood}: its outputs passed {FLOOD_BYTES // 2**20} MiB (an output flood)"
                            + (f"; {status['detail']}" if status["detail"] else ""))
    if outer:
        from hpdl import procs

        procs.end_the_rest_of_namespace(outer)
    errors = sum(1 for c in nb.cells if c.get("cell_type") == "code"
                 for o in c.get("outputs", []) if o.get("output_type") == "error")
    status["cell_errors"] = errors
    cut = cut_outputs(nb.cells)
    if cut:
        status["detail"] += f" (outputs over {MAX_OUTPUT_BYTES // 2**20} MiB: {cut} bytes cut, with a note)"
    try:  # without nbformat's indentation, which grew deeply nested outputs 35 times past what cut_outputs measured
        executed.write_text(json.dumps(nb, default=str))
    except Exception as exc:
        status["detail"] += f" (the executed notebook could not be written: {type(exc).__name__})"
    status_file.write_text(json.dumps(status))
    return 0


def _flood_stopping(base: type) -> type:
    """nbclient's client, counting what the notebook sends: a cell that sends over FLOOD_BYTES is
    interrupted (it ends with KeyboardInterrupt, the next cells run), and its kernel killed if FLOOD_GRACE s
    later it is still running that cell (the interrupt caught). Asked of the kernel itself, on a connection
    of its own: on a busy machine this client reads a flood's backlog seconds late, so the cell still looks
    running here long after a kernel that obeyed has ended it; and it reads the backlog after the kernel's
    answer, so it waits IOPUB_WAIT s for it, not nbclient's 4. Past FLOOD_BYTES in all, only errors are
    kept. `flood` says what was done."""
    import signal
    import threading

    import traitlets

    from hpdl import procs

    class FloodStopping(base):
        sent, flood, running = 0, "", None
        iopub_timeout = traitlets.Integer(IOPUB_WAIT, help="s to read outputs after a reply").tag(config=True)

        async def async_execute_cell(self, cell, cell_index, *args, **kwargs):
            self.running, self.cell_sent = cell_index, 0
            try:
                return await super().async_execute_cell(cell, cell_index, *args, **kwargs)
            finally:
                self.running = None

        def output(self, outs, msg, display_id, cell_index):
            size = _output_bytes(msg.get("content"))
            self.sent += size
            if self.running == cell_index:
                self.cell_sent += size
                if self.cell_sent > FLOOD_BYTES and self.cell_sent - size <= FLOOD_BYTES:  # once per cell
                    self.flood = f"cell {cell_index} interrupted"
                    self._signal(signal.SIGINT)
                    later = threading.Timer(FLOOD_GRACE, self._kill_if_running, args=(cell_index,))
                    later.daemon = True
                    later.start()
            left = FLOOD_BYTES - (self.sent - size)  # what may still be kept, before this message
            content = msg.get("content") if isinstance(msg.get("content"), dict) else {}
            if 0 < left < size and msg.get("msg_type") == "stream" and isinstance(content.get("text"), str):
                content["text"] = content["text"][:left]  # a flood's first message: its head says what it was
            elif size > left and not (msg.get("msg_type") == "error" and size <= MAX_ONE_OUTPUT):
                return None
            return super().output(outs, msg, display_id, cell_index)

        def _kill_if_running(self, cell_index: int) -> None:
            if self.running == cell_index and not _kernel_answers(self.km):
                self.flood = f"cell {cell_index} interrupted, then its kernel killed"
                self._signal(signal.SIGKILL)

        def _signal(self, sig: int) -> None:
            pid = getattr(getattr(self.km, "provisioner", None), "pid", None)
            if isinstance(pid, int) and pid > 0:  # the kernel's own process: this runner started it
                procs.pass_on(pid, sig)

    return FloodStopping


def _kernel_answers(km) -> bool:
    """Whether the kernel `km` runs answers a kernel_info request within FLOOD_GRACE s, on a connection of
    its own: it does between cells, never while a cell runs (it takes one shell request at a time)."""
    from jupyter_client import BlockingKernelClient

    other = None
    try:
        other = BlockingKernelClient()
        other.load_connection_info(km.get_connection_info())
        other.start_channels(shell=True, iopub=False, stdin=False, hb=False, control=False)
        other.kernel_info(reply=True, timeout=FLOOD_GRACE)
        return True
    except Exception:  # no answer in time (TimeoutError), or no connection to ask on
        return False
    finally:
        if other is not None:
            other.stop_channels()


def _output_bytes(content) -> int:
    """About how large one output message is: its text, its data's values, its traceback, its metadata."""
    if not isinstance(content, dict):
        return 0
    data, traceback = content.get("data"), content.get("traceback")
    parts = [content.get("text"), *(data.values() if isinstance(data, dict) else [data]),
             *(traceback if isinstance(traceback, list) else [traceback]), content.get("metadata") or None]
    try:
        return sum(len(p) if isinstance(p, str) else len(str(p)) for p in parts if p is not None)
    except RecursionError:  # nested past what repr() follows: as large as a flood
        return FLOOD_BYTES


def cut_outputs(cells: list[dict]) -> int:
    """Keep a notebook's outputs under MAX_OUTPUT_BYTES (each under MAX_ONE_OUTPUT): what is over
    is cut, with a note in its place, so an output flood still saves a small, valid notebook
    (never a file cut short by the size limit, which is no JSON). Returns the bytes cut."""
    left, cut_total = MAX_OUTPUT_BYTES, 0
    for cell in cells:
        outputs = cell.get("outputs") if cell.get("cell_type") == "code" else None
        if not isinstance(outputs, list):
            continue
        kept, cut = [], 0
        for out in outputs:
            size = len(json.dumps(out, default=str))
            if size <= min(left, MAX_ONE_OUTPUT):
                kept.append(out)
                left -= size
                continue
            cut += size
            if out.get("output_type") == "stream" and left > 8192:  # the head of a flood says what it was
                kept.append(dict(out, text=_text(out.get("text"))[:4096]))
                left -= 8192
        if cut:
            note = (f"[hpdl grade: {cut} bytes of this cell's output cut: a graded notebook keeps "
                    f"{MAX_ONE_OUTPUT // 2**20} MiB per output, {MAX_OUTPUT_BYTES // 2**20} MiB in all]\n")
            kept.append({"output_type": "stream", "name": "stderr", "text": note})
            cell["outputs"] = _as_outputs(cell, kept)
            cut_total += cut
    return cut_total


def _as_outputs(cell, outputs: list[dict]) -> list:
    """Outputs in the kind of node the cell holds (nbformat's NotebookNode when it is one)."""
    try:
        from nbformat import from_dict

        return [from_dict(o) for o in outputs] if type(cell) is not dict else outputs
    except ImportError:
        return outputs


# -- the batch -----------------------------------------------------------------------------------

class Running:
    """One submission under way: its sandboxed runner process and its check service."""

    index = -1  # its place in the batch (_batch sets it)

    def __init__(self, sub: Submission, work: Path, out: Path, limit: float, hidden: list[str],
                 caps: "Caps | None" = None):
        from hpdl import sidejob
        from hpdl.checker import checking, confine, sandbox
        from hpdl.checker.grade_service import Service

        caps = caps or Caps()
        self.sub, self.work, self.limit = sub, work, limit
        work.mkdir(mode=0o700)  # its own folder, under the batch's 0700 one; removed when it ends
        self.home = work / "hpdl-home"
        self.home.mkdir()
        self.copy = work / Path(sub.name).name
        safefiles.create_exclusive(self.copy, graded_bytes(sub))
        self.status = work / "status.json"
        self.executed_here = work / "executed.ipynb"
        self.executed = out / "executed" / sub.name
        self.service = Service(work / "checks", hidden=hidden, memory=caps.check_memory, at_once=caps.at_once)
        env = dict(os.environ, IPP_NONINTERACTIVE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1", HOME=str(work),
                   JUPYTER_RUNTIME_DIR=str(work / "runtime"), IPYTHONDIR=str(work / "ipython"))
        env.update({settings.GRADE.name: "1", settings.GRADE_SERVICE.name: str(work / "checks"),
                    settings.HOME.name: str(self.home)})
        env.pop(settings.GRADE_RESULTS.name, None)
        env.pop(settings.KEYS.name, None)  # its checks are the grader's: the keys' folder is none of its business
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
        env = confine.environment(env)  # the grader's other variables never reach the submission
        sub.sandboxed = sandbox.available()
        outside = [f"{OWN_PIDS}={os.readlink('/proc/self/ns/pid')}"] if sub.sandboxed else []
        cmd = [sys.executable, "-m", "hpdl.grade", "--run-one", str(self.copy), str(self.executed_here),
               str(self.status), str(limit), *outside]
        # the kit's own implementations of exercises, as in a check's job: read in the notebook and retyped as a
        # cell, one passed its check as the learner's own (24/24)
        cmd = sandbox.wrap(cmd, writable=[str(work)], readonly=[str(self.service.answers)], hidden=hidden,
                           cwd=str(work), replaced=checking.kit_answer_copies())
        self.limits = sandbox.Limits(cpu_seconds=int(limit * 2) + 60, processes=caps.tasks,
                                     memory_total=caps.memory)
        # Outside a sandbox a daemon can leave the process group: the job's marker finds it (sweep).
        self.job = sidejob.SideJob(cmd, output=work / "run.log", env=env, cwd=work, timeout=limit,
                                   limits=self.limits, shared_memory=not sub.sandboxed, sweep=True)
        sub.limits = self.limits.applied()  # the total caps as the kernel holds them, read back
        # its folder is on the host's disk: capped as it runs
        self.disk = sandbox.DiskWatch(work, self.job, limit=caps.disk)

    def poll(self) -> bool:
        """True when finished (by itself, by the time limit or by its folder's cap on disk)."""
        self.service.poll()
        if not self.job.running():
            self.service.poll()
            self.service.close()
            if self.service.busy() and not self.job.expired():  # its last check, still under way: polled, not
                return False  # waited for (the loop serves every submission), within the time limit
            self.finish(stopped=self.service.busy())
            return True
        if self.job.expired() or self.disk.over():
            self.finish(stopped=True)
            return True
        return False

    def finish(self, stopped: bool) -> None:
        """Its results in; `stopped`: ended by us (time limit, disk cap, an interrupt), not by itself."""
        from hpdl.checker import sandbox

        sub = self.sub
        sub.seconds = self.job.elapsed()
        self.job.end(now=True)  # its result is in; whatever it still runs is ended with it
        self.service.finish()
        if self.disk.why is not None:
            sub.status, sub.detail = "disk limit", f"stopped: {self.disk.why}"
        elif stopped:
            sub.status, sub.detail = "timeout", f"stopped after {self.limit:g} s (the submission's time limit)"
        else:
            try:  # the submission's folder: no link followed, a regular file, bounded
                if self.job.returncode != 0:  # a runner that did not finish (a kernel can kill its runner)
                    raise ValueError("the runner did not finish: its status is not its own")
                st = safefiles.json_of(safefiles.read_bounded(self.status, MAX_STATUS_BYTES))
                errors = st.get("cell_errors", 0)  # the runner's folder: the submission can write it too
                if st["status"] not in RUNNER_STATUSES or type(errors) is not int or not 0 <= errors < 2**31:
                    raise ValueError("not a status the runner writes")
                sub.status, sub.detail, sub.cell_errors = st["status"], str(st.get("detail", ""))[:600], errors
            except (OSError, ValueError, KeyError, TypeError):
                tail = _tail(self.work / "run.log")
                code = self.job.returncode
                why = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                sub.status, sub.detail = "runner failed", f"the notebook's runner ended ({why}): {tail}"
        sub.checks = dict(self.service.results)  # the grader's own results, never the kernel's
        if self.service.problems:
            sub.detail = (sub.detail + " | " if sub.detail else "") + "; ".join(self.service.problems[:3])
        data = self._save_executed(finished=not stopped and self.job.returncode == 0)
        sub.predictions = predictions_of(_cells(data) or [])
        safefiles.remove_tree(self.work)  # gone as soon as it ends, not with the batch
        sandbox.sweep_cgroups()  # a cgroup still emptying when its job ended goes now

    def _save_executed(self, finished: bool = True) -> bytes:
        """Keep the notebook as it ran (a valid notebook, bounded, never through a link); when
        the runner left none that is valid, or did not finish (then the file is the kernel's word:
        it can write the runner's folder, and kill the runner), the submitted one (from the
        submissions folder, which the sandbox cannot write) with a note saying why."""
        try:
            data = safefiles.read_bounded(self.executed_here, MAX_NOTEBOOK_BYTES)
            why = "" if _cells(data) is not None else "what the runner saved is not a valid notebook"
            if not finished:
                why = "its runner did not finish, so what it left was the notebook's own to write"
        except FileNotFoundError:  # it never got that far (a timeout): nothing to keep
            return self._submitted()
        except OSError as exc:
            data, why = b"", str(exc)
        if why:
            data = _with_note(self._submitted(), f"hpdl grade: the notebook as it ran could not be kept "
                                                 f"({why[:300]}); this is the notebook as submitted.")
        try:
            self.executed.parent.mkdir(parents=True, exist_ok=True)
            _write_private(self.executed, data)
        except OSError as exc:
            self.sub.detail += f" (the executed notebook was not saved: {exc})"
        return data

    def _submitted(self) -> bytes:
        try:
            return submitted_bytes(self.sub)
        except OSError:
            return b"{}"


def _with_note(data: bytes, note: str) -> bytes:
    """A notebook's JSON with a markdown cell first holding `note`. Written compact: indented, a notebook of
    values nested 95 deep grew 50 times (10 MB kept as 500 MB, and as much again in the grader's memory).
    No larger than MAX_NOTEBOOK_BYTES (escaping can double it): past that, the note alone."""
    try:
        nb = safefiles.json_of(data)
        nb["cells"].insert(0, {"cell_type": "markdown", "metadata": {}, "source": note})
        out = json.dumps(nb, separators=(",", ":")).encode()
        if len(out) <= MAX_NOTEBOOK_BYTES:
            return out
        note += f" It is not kept here: with the note it passed {MAX_NOTEBOOK_BYTES // 2**20} MiB."
    except (ValueError, KeyError, TypeError, AttributeError):  # changed since it was found: the note alone
        pass
    return json.dumps({"cells": [{"cell_type": "markdown", "metadata": {}, "source": note}], "metadata": {},
                       "nbformat": 4, "nbformat_minor": 5}).encode()


def _tail(path: Path, lines: int = 5) -> str:
    try:  # in the submission's folder: a regular file only (a FIFO there would block for ever)
        with os.fdopen(safefiles.open_regular(path), "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])[:600]


def _write_private(path: Path, data: bytes | str) -> None:
    """Write a file readable by its owner only, atomically (a reader never sees half of it), never through a
    link: a fresh name of its own, renamed over `path` (safefiles.replace_atomically)."""
    safefiles.replace_atomically(os.fspath(path), data.encode("utf-8", "backslashreplace")  # a lone surrogate too
                                 if isinstance(data, str) else data)


def _previous(out: Path) -> dict[tuple[str, str], dict]:
    """Submissions graded by an earlier run into `out` (name, digest) -> their record."""
    done = {}
    try:
        text = (out / "results.jsonl").read_text()
    except OSError:
        return done
    for line in text.splitlines():
        try:
            rec = json.loads(line)
            done[(rec["name"], rec["digest"])] = rec
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when an earlier run was killed
    return done


def _append(out: Path, sub: Submission) -> None:
    path = out / "results.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)  # a link: refused
    with os.fdopen(fd, "a") as f:
        f.write(json.dumps(sub.to_dict(), default=str) + "\n")


@dataclass
class Caps:
    """One total cap per submission on everything it starts: memory and tasks (its cgroup), disk (its folder)."""

    memory: int = 4 * 2**30
    tasks: int = 2048  # threads count: a kernel, ipyparallel, 4 ranks of torch
    disk: int = DISK_BYTES  # what its folder holds on the host's disk (sandbox.DiskWatch), as a check's
    # the check under way (one at a time): all its ranks, the learner's and the reference's, in a cgroup of its own
    check_memory: int = field(default_factory=default_memory)
    # submissions graded at once (--jobs): as many checks may run together, and their time limits stretch with the
    # ranks all of them start on this machine's cores (checking.crowding)
    at_once: int = 1


MIN_CHECK_MEMORY = 3 * 2**30  # a check's ranks at its heaviest (zero3_unit graded, 1-4 ranks at once) held 2.9 GiB


def check_memory_for(jobs: int, memory: int) -> int:
    """The default cap of a submission's check: half this machine's RAM, at most 8 GiB (sandbox.default_memory),
    less where `jobs` submissions at once, each holding `memory` and its check, would need more than the RAM;
    never below MIN_CHECK_MEMORY (then memory_overcommitted says what to change)."""
    from hpdl.checker import sandbox

    ram = sandbox.ram()
    share = default_memory() if ram is None else (ram - host_reserve(ram)) // jobs - memory
    return max(MIN_CHECK_MEMORY, min(default_memory(), share))


def host_reserve(ram: int) -> int:
    """What submissions at once leave of the RAM for the grader, its reference ranks' start and the system:
    a sixteenth, at least 1 GiB (two at their caps summed to all of a 24 GiB machine)."""
    return max(2**30, ram // 16)


def memory_overcommitted(jobs: int, caps: Caps, ram: int | None = None) -> str:
    """Why `jobs` > 1 submissions at once could hold more memory than this machine has ('' if they cannot):
    each may hold caps.memory, and the check it runs caps.check_memory besides. A hostile class at the
    caps would then have the kernel's OOM killer pick victims on the grading host, the grader among them.
    One at a time is the instructor's caps as given, whatever the RAM."""
    from hpdl.checker import sandbox

    ram = sandbox.ram() if ram is None else ram
    each = caps.memory + caps.check_memory
    if jobs < 2 or ram is None or jobs * each <= ram - host_reserve(ram):
        return ""
    size = sandbox.size_text
    fits = (ram - host_reserve(ram)) // each
    return (f"--jobs {jobs}: each submission may hold {size(caps.memory)} (--memory) and the check it runs "
            f"{size(caps.check_memory)} more (--check-memory), {size(jobs * each)} for {jobs} at once, on a machine "
            f"with {size(ram)} of RAM, of which {size(host_reserve(ram))} stays for the grader and the system. "
            f"Use --jobs {max(1, fits)}, or lower --memory or --check-memory.")


def refusals(no_sandbox: bool = False, allow_root: bool = False) -> list[str]:
    """Why grading may not start here (empty: it may): as root without allow_root; without a
    sandbox that holds without no_sandbox, naming each missing part and what to install."""
    from hpdl.checker import sandbox

    why = []
    if os.geteuid() == 0 and not allow_root:
        why.append("hpdl grade does not run as root: a submission would run as root too, and root's files "
                   "(/etc/shadow, /root) would be its own. Run it as an ordinary user, or pass --allow-root "
                   "(a container, a CI runner) to grade as root all the same.")
    gaps = sandbox.missing()
    if gaps and not no_sandbox:
        why.append("hpdl grade needs a sandbox that holds, and this host lacks: " + "; ".join(gaps) + ". "
                   "Install what is missing, or pass --no-sandbox to grade with what there is (the report says "
                   "what was missing; hostile submissions could then reach your files, environment and network).")
    return why


def sandbox_header(caps: Caps, no_sandbox: bool = False) -> tuple[str, dict]:
    """The report's header: which sandbox runs and each limit as applied. The total caps are read
    back from a cgroup made with this batch's values (each submission's own read-back is in its record)."""
    from hpdl.checker import sandbox

    probe = sandbox.Limits(processes=caps.tasks, memory_total=caps.memory).start()
    try:
        st = sandbox.status(probe)
    finally:
        probe.stop()
    st["disk_bytes"] = caps.disk
    st["check_memory_bytes"] = caps.check_memory
    text = sandbox.describe(st) + (f"; the check it runs: memory {sandbox.size_text(caps.check_memory)} for all "
                                   "its ranks (cgroup)")
    from hpdl.checker import meter

    unmetered = meter.unavailable()
    st["messages_counted"] = unmetered is None
    text += ("; bytes sent by the ranks of exercises built from messages: counted by the kernel" if unmetered is None
             else f"; bytes sent by the ranks of exercises built from messages: NOT counted ({unmetered})")
    text += "; " + self_reported_text(st)
    if no_sandbox:
        text += "; graded with --no-sandbox"
    return text, st


def self_reported_text(st: dict) -> str:
    """What checks still take from the learner's own processes (cases.SELF_REPORTED, and the files a
    check's ranks share), said in the header so an instructor knows which grades to read behind."""
    from hpdl.checker import cases

    try:
        st["self_reported"] = cases.self_reported()
    except Exception as exc:  # a course's case module that does not load: its check will say so
        st["self_reported"] = {}
        return f"not known what the checks take from the learners' own processes ({exc})"
    from hpdl.checker import sandbox

    named = "; ".join(f"{name}: {what}" for name, what in sorted(st["self_reported"].items()))
    shared = ("and a check's ranks share one network, where the kernel counts the TCP bytes between them"
              if sandbox.ranks_apart() else "and a check's ranks can pass values through files they share")
    return ("taken from the learner's own processes, which a learner who knows the kit can rewrite: "
            + (named + "; " if named else "") + shared + " (cluster/README.md, section 4)")


def grade(folder: Path, out: Path, limit: float = 600.0, jobs: int = 1, progress: bool = True,
          exercises: list[str] | None = None, caps: Caps | None = None, no_sandbox: bool = False,
          allow_root: bool = False) -> list[Submission]:
    from hpdl.checker import sandbox

    _refuse_out_inside(folder, out)
    why = refusals(no_sandbox, allow_root)
    if why:
        raise HpdlError("\n".join(why))
    sandbox.cover_the_host()  # the code is the learners', the user is you: what only you may read stays yours
    try:
        return _batch(folder, out, limit, jobs, progress, exercises, caps or Caps(), no_sandbox)
    finally:
        sandbox.cover_the_host(False)


def _refuse_out_inside(folder: Path, out: Path) -> None:
    """The reports never go inside the submissions: there a learner's folder can stand where they are written
    (`cd submissions && hpdl grade .` put ./report there, and a learner's report/ with a link in it had the
    grader write grades.csv over the instructor's ~/.bashrc)."""
    top, where = Path(os.path.realpath(folder)), Path(os.path.realpath(out))
    if where == top or top in where.parents:
        raise HpdlError(f"--out {out} is inside the submissions folder {folder}: a learner's files could stand "
                        "where the reports are written. Choose a folder outside it, e.g. --out ../report.")
    kept = Path(out) / "results.jsonl"  # an earlier run's, appended to: never through a link, never a FIFO
    if kept.is_symlink() or (os.path.lexists(kept) and not kept.is_file()):
        raise HpdlError(f"{kept} is not a regular file (a link?): the grader appends to it. Remove it, or choose "
                        "another --out.")


def _batch(folder: Path, out: Path, limit: float, jobs: int, progress: bool, exercises: list[str] | None,
           caps: Caps, no_sandbox: bool) -> list[Submission]:
    """grade()'s batch, once it may run: each submission in a sandbox of its own, `jobs` at a time,
    the reports rewritten as each ends."""
    from hpdl.checker import sandbox

    subs = find_submissions(folder)
    caps = replace(caps, at_once=jobs)
    sandbox.sweep_cgroups()  # those left by graders that are gone
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    todo, alone = _resume(subs, out)
    header = sandbox_header(caps, no_sandbox)
    write_reports(subs, out, exercises, *header)  # valid from the start: the rest "pending"
    # one 0700 folder for the batch, one 0700 folder per submission in it; inside a sandbox the
    # batch folder is an empty one with only the submission's own folder bound back
    from hpdl.checker.checking import answer_keys

    work_root = scratch.make("grade")  # one a killed grader left is removed here
    os.chmod(work_root, 0o700)
    hidden = [str(folder.resolve()), str(out.resolve()), str(work_root), *answer_keys()]
    running: list[Running] = []
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(subs), initial=len(subs) - len(todo), desc="grading", unit="notebook")
    try:
        while todo or running:
            # a notebook the grader died on before runs alone, nothing beside it (see _resume)
            while todo and len(running) < max(1, jobs) and not (running and (todo[0][0] in alone
                                                                             or running[0].index in alone)):
                i, sub = todo.pop(0)
                try:
                    _started(out, sub, alone=jobs <= 1 or i in alone)
                    running.append(Running(sub, work_root / f"{i:04d}", out, limit, hidden, caps))
                    running[-1].index = i
                except OSError as exc:
                    sub.status, sub.detail = "not started", f"{type(exc).__name__}: {exc}"
                    _done(out, subs, sub, exercises, bar, header)
            for r in list(running):
                if r.poll():
                    running.remove(r)
                    _done(out, subs, r.sub, exercises, bar, header)
            time.sleep(0.1)
    finally:
        for r in running:
            r.finish(stopped=True)
            r.sub.status, r.sub.detail = "interrupted", "the grader was stopped while this submission ran"
            _started(out, r.sub, ended=True)  # stopped in order (Ctrl-C): not held against it
        if bar is not None:
            bar.close()
        safefiles.remove_tree(work_root)
        sandbox.sweep_cgroups()
    write_reports(subs, out, exercises, *header)
    return subs


# what a neighbour graded beside a submission can cause (a CPU hog of 150 processes: an honest notebook timed out,
# 0/36, and each rerun kept the 0): graded again, alone, when the command is run again
REGRADED = ("timeout", "runner failed", "kernel died", "error")


def _resume(subs: list[Submission], out: Path) -> tuple[list[tuple[int, Submission]], set[int]]:
    """Submissions still to grade: those graded by an earlier run into `out` are taken as they were, but those
    that ended as a neighbour can make them end (REGRADED), graded again alone. And
    those an earlier run started and never ended (the grader itself died: out of memory, killed), by index:
    graded alone, first, so that a neighbour is not blamed; one the grader died on twice, once alone, is
    recorded as such and not run again (it took the grader down at every resume, and no one after it was
    graded)."""
    done, starts = _previous(out), _unended_starts(out)
    todo, alone = [], set()
    for i, sub in enumerate(subs):
        rec = done.get((sub.name, sub.digest))
        if rec is not None and rec.get("status") in REGRADED:  # maybe a neighbour's doing: graded again, alone
            alone.add(i)
        elif rec is not None:  # graded by an earlier run of this command: resume after it
            for key in ("status", "detail", "seconds", "checks", "predictions", "cell_errors", "sandboxed", "limits"):
                if key in rec:
                    setattr(sub, key, rec[key])
        elif sub.status != "pending":  # refused before running (not a notebook, too large, unreadable): recorded
            _append(out, sub)
        elif len(starts.get((sub.name, sub.digest), [])) >= 2 and any(starts[(sub.name, sub.digest)]):
            sub.status = "grader died"
            sub.detail = ("the grader itself stopped while grading this notebook, twice, once with no other beside "
                          "it (out of memory, or killed), so it is not run again. To try it once more, delete "
                          f"{out / 'started.jsonl'} and run the same command.")
            _append(out, sub)
        elif (sub.name, sub.digest) in starts:
            alone.add(i)
        else:
            todo.append((i, sub))
    return [(i, subs[i]) for i in sorted(alone)] + todo, alone


def _started(out: Path, sub: Submission, alone: bool = False, ended: bool = False) -> None:
    """Note in OUT/started.jsonl that `sub` starts (with nothing beside it, if `alone`), or that a grader
    stopped in order ended it unfinished: what _resume reads when a grader died."""
    line = {"name": sub.name, "digest": sub.digest, "alone": alone} if not ended else {
        "name": sub.name, "digest": sub.digest, "ended": True}
    fd = os.open(out / "started.jsonl", os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "r+b") as f:
        size = os.fstat(fd).st_size
        cut = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a line a dying grader cut short: not this one too
        f.write((b"\n" if cut else b"") + json.dumps(line).encode() + b"\n")


def _unended_starts(out: Path) -> dict[tuple[str, str], list[bool]]:
    """(name, digest) -> whether each start since the last clean end was alone, from OUT/started.jsonl."""
    starts: dict[tuple[str, str], list[bool]] = {}
    try:
        with os.fdopen(safefiles.open_regular(out / "started.jsonl"), "rb") as f:
            lines = f.read(64 * 2**20).decode("utf-8", "replace").splitlines()
    except OSError:
        return starts
    for line in lines:
        try:
            rec = json.loads(line)
            key = (rec["name"], rec["digest"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short when the grader died
        if rec.get("ended"):
            starts.pop(key, None)
        else:
            starts.setdefault(key, []).append(rec.get("alone") is True)
    return starts


def _done(out: Path, subs: list[Submission], sub: Submission, exercises, bar, header: tuple[str, dict]) -> None:
    """One submission finished: keep it, and rewrite the reports so far (a valid partial report)."""
    _append(out, sub)
    write_reports(subs, out, exercises, *header)
    if bar is not None:
        bar.update(1)


# -- reports -------------------------------------------------------------------------------------

def scored_exercises(subs: list[Submission], exercises: list[str] | None = None) -> dict[str, float]:
    """Exercise -> points it is worth, from its case module (never from a submission): those
    named, else those called in the notebooks of more than half of the learners, and those of exactly
    half that belong to a lesson of one of those (lessons_of_exercises). A learner is a folder of the
    submissions folder (or a notebook directly in it), whatever the notebooks it holds: one learner's
    many notebooks are one vote. Why the lesson: of two learners, one calling another lesson's check
    (dead code would do) added it to both scores; one who skipped an exercise must not drop it either.
    Where no exercise has a majority (two learners, nothing in common), or the kit has no exercises/ notebooks to
    tell the lessons, half the learners suffice. A learner whose notebooks call no check has no vote: three
    files of junk (not notebooks, dead links) beside two learners' full solutions left nothing scored, 0/0."""
    if exercises is None:
        counts, voters = exercise_votes(subs)
        most = {ex for ex, n in counts.items() if 2 * n > voters}
        half = {ex for ex, n in counts.items() if 2 * n == voters}
        lesson = lessons_of_exercises()
        if most and lesson:  # a kit without its exercises/ notebooks: half the learners, as before
            theirs = {lesson.get(ex) for ex in most} - {None}
            half = {ex for ex in half if lesson.get(ex) in theirs}
        exercises = sorted(most | half)
    return {ex: planned_points(ex) for ex in exercises}


def exercise_votes(subs: list[Submission]) -> tuple[dict[str, int], int]:
    """(exercise -> how many learners' notebooks call it, how many learners call any): one learner, one vote. A
    notebook that ran to its end calls what it asked the grader to check, of the calls in its source: a call in
    dead code (`if False: hpdl.check(...)`) is no vote, so three such notebooks beside two learners no longer
    swapped the class's exercises for theirs (both full solutions scored 0/4)."""
    called: dict[str, set[str]] = {}
    for s in subs:
        ran = set(s.exercises) & set(s.checks) if s.status == "ok" else set(s.exercises)
        called.setdefault(learner_of(s.name), set()).update(ran)
    voters = [names for names in called.values() if names]  # junk files, links, blank notebooks: no vote
    counts: dict[str, int] = {}
    for names in voters:
        for ex in names:
            counts[ex] = counts.get(ex, 0) + 1
    return counts, len(voters)


@functools.lru_cache(maxsize=1)
def lessons_of_exercises() -> dict[str, str]:
    """Exercise -> the lesson whose notebook checks it: the kit's own exercises/ notebooks, generated from
    its lessons (never a submission's); {} where the kit has none."""
    found: dict[str, str] = {}
    for path in sorted((Path(__file__).resolve().parents[1] / "exercises").glob("*.ipynb")):
        try:
            data = safefiles.read_bounded(path, MAX_NOTEBOOK_BYTES)
        except OSError:
            continue
        for ex in _called_checks(data):
            found.setdefault(ex, path.stem)
    return found


def learner_of(name: str) -> str:
    """Whose a submission is: its first folder under the submissions folder, else the notebook itself."""
    return name.split("/", 1)[0] if "/" in name else name


def planned_points(exercise: str) -> float:
    """All points of an exercise in grade mode: every case, hidden ones included, at its rank counts."""
    from hpdl.checker import cases
    from hpdl.checker.checking import graded_sizes

    module = cases.load(exercise)
    return float(sum(c.points for p in graded_sizes(module) for c in module.cases(p)))


def write_reports(subs: list[Submission], out: Path, exercises: list[str] | None = None,
                  sandbox_text: str = "", sandbox_status: dict | None = None) -> None:
    worth = scored_exercises(subs, exercises)
    names = sorted(worth)
    total = sum(worth.values())
    rows = []
    for s in subs:
        row = {"submission": s.name, "status": s.status, "score": s.score(worth), "max_score": total,
               "seconds": round(s.seconds, 1), "cell_errors": s.cell_errors, "detail": s.detail}
        for ex in names:
            row[ex] = float(s.checks[ex]["score"]) if ex in s.checks else 0.0
        rows.append(row)
    _write_private(out / "grades.csv", _csv([["submission", "status", "score", "max_score", *names, "seconds",
                                              "cell_errors", "detail"]], rows))
    case_rows = [["submission", "exercise", "ranks", "case", "hidden", "verdict", "points", "max_points", "message"]]
    for s in subs:
        for ex in names:
            if ex not in s.checks:
                case_rows.append([s.name, ex, "", "(not reached)", "", "NOT RUN", 0, worth[ex], s.status])
                continue
            for c in s.checks[ex]["cases"]:
                case_rows.append([s.name, ex, c["ranks"], c["name"], c["hidden"], c["verdict"], c["points"],
                                  c["max_points"], c["message"]])
    _write_private(out / "cases.csv", _csv(case_rows))
    data = {
        "sandbox": sandbox_text,
        "sandbox_limits": sandbox_status or {},
        "exercises": {ex: {"max_score": worth[ex]} for ex in names},
        "max_score": total,
        "submissions": [
            {"submission": s.name, "status": s.status, "detail": s.detail, "seconds": round(s.seconds, 2),
             "score": s.score(worth), "max_score": total, "cell_errors": s.cell_errors, "sandboxed": s.sandboxed,
             "limits": s.limits,
             "checks": s.checks, "not_reached": [ex for ex in names if ex not in s.checks],
             "unscored_checks": sorted(set(s.checks) - set(names)), "predictions": s.predictions}
            for s in subs
        ],
    }
    _write_private(out / "grades.json", json.dumps(data, indent=1))
    _write_private(out / "index.html", _html(subs, names, worth, total, sandbox_text))


# a spreadsheet runs a cell that starts like a formula (=HYPERLINK(...), =cmd|...): a submission's
# file name and the text a learner's code puts in a message are the learner's to choose
FORMULA_START = ("=", "+", "-", "@", "\t", "\r")


def _printable(name: str, keep: str = "") -> str:
    """A learner's file name (or text) as the instructor's terminal, spreadsheet or browser shows it and never
    obeys it: control characters (an escape sequence that sets the clipboard or the title; a right-to-left
    override, which shows one learner's row under another's name) written out as \\xNN or \\uNNNN, but those
    in `keep`."""
    return "".join(c if c.isprintable() or c in keep else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}"
                   for c in name)


def _cell(value):
    """`value` as a spreadsheet shows it and never runs it: text that starts like a formula gets a
    leading apostrophe (the spreadsheets' own mark for text); control characters are written out."""
    if not isinstance(value, str):
        return value
    value = _printable(value, keep="\n")
    return "'" + value if value.startswith(FORMULA_START) else value


def _csv(header_rows: list[list], dict_rows: list[dict] | None = None) -> str:
    import io

    buf = io.StringIO()
    if dict_rows is None:
        csv.writer(buf).writerows([[_cell(v) for v in row] for row in header_rows])
    else:
        w = csv.DictWriter(buf, fieldnames=header_rows[0])
        w.writeheader()
        w.writerows({k: _cell(v) for k, v in row.items()} for row in dict_rows)
    return buf.getvalue()


def _html(subs: list[Submission], exercises: list[str], worth: dict[str, float], total: float,
          sandbox_text: str) -> str:
    from hpdl.checker.report import CheckResult
    from hpdl.tables import Html, html_table

    e = html.escape
    td = {"style": "padding:3px 8px;border-bottom:1px solid #d0d7de;text-align:left"}
    body, details = [], []
    for i, s in enumerate(subs):
        colour = "#1a7f37" if s.status == "ok" else "#cf222e"
        name = e(_printable(s.name))
        cells = [Html(f"<a href='#s{i}'>{name}</a>"), Html(f"<span style='color:{colour}'>{e(s.status)}</span>"),
                 Html(f"<b>{s.score(worth):g}</b> / {total:g}")]
        for ex in exercises:
            c = s.checks.get(ex)
            cells.append(f"{float(c['score']):g} / {worth[ex]:g}" if c
                         else Html("<span style='color:#57606a'>not reached</span>"))
        cells.append(f"{s.seconds:.0f} s")
        body.append(cells)
        parts = [f"<h3 id='s{i}'>{name} — {s.score(worth):g} / {total:g}</h3>"]
        if s.detail:
            parts.append(f"<p>{e(s.status)}: {e(s.detail)}</p>")
        if s.cell_errors:
            parts.append(f"<p>{s.cell_errors} cell{'s' if s.cell_errors > 1 else ''} raised an error.</p>")
        for ex in exercises:
            if ex in s.checks:
                parts.append(CheckResult.from_dict(s.checks[ex])._repr_html_())
            else:
                parts.append(f"<p>{e(ex)}: not reached (0 / {worth[ex]:g}).</p>")
        for p in s.predictions:
            parts.append(f"<p><i>Prediction (cell {p['cell']}, not scored):</i></p><pre>{e(p['source'])}</pre>"
                         + (f"<pre>{e(p['output'])}</pre>" if p["output"] else ""))
        details.append("\n".join(parts))
    weak = not sandbox_text.startswith("sandboxed") or "missing:" in sandbox_text or "--no-sandbox" in sandbox_text
    warn = "color:#cf222e;font-weight:600" if weak else ""
    return _controls_written_out(
        "<!doctype html><html><head><meta charset='utf-8'><title>hpdl grades</title></head>"
        "<body style='font-family:system-ui,sans-serif;font-size:14px;margin:20px'>"
        f"<h1>Grades</h1><p style='{warn}'>{e(sandbox_text)}</p>"
        f"<p>{len(subs)} submissions · {time.strftime('%Y-%m-%d %H:%M')}</p>"
        + html_table(["submission", "status", "score", *exercises, "time"], body,
                     attrs={"style": "border-collapse:collapse"}, th=td, td=td)
        + "".join(f"<section>{d}</section>" for d in details)
        + "</body></html>\n"
    )


def _controls_written_out(text: str) -> str:
    """`text` with every control or format character but newline and tab written out as \\xNN or \\uNNNN (as
    _printable does): a check's message or a status detail carries a learner's exception text, and its escape
    sequences reached index.html raw (`cat` or `less -R` on it set a terminal's title, or its clipboard)."""
    return _controls().sub(lambda m: _printable(m.group()), text)


@functools.lru_cache(maxsize=1)
def _controls() -> re.Pattern:
    """Every control and format character (Unicode's Cc and Cf) but newline and tab, as one character class."""
    import unicodedata

    found = [chr(i) for i in range(0x110000) if unicodedata.category(chr(i)) in ("Cc", "Cf") and chr(i) not in "\n\t"]
    return re.compile("[" + "".join(re.escape(c) for c in found) + "]")


def use_keys(folder: Path | None) -> None:
    """Point this grader's checks at the instructor's answer keys (a folder `hpdl keys export` made)."""
    if folder is None:
        return
    from hpdl import keys

    keys.check_folder(folder)
    os.environ[settings.KEYS.name] = str(folder.resolve())


def _bytes(text: str, flag: str = "--memory") -> int:
    """'4G', '512M', '1.5GiB' or a number of bytes."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if not m:
        raise HpdlError(f"{flag} {text!r}: give a size such as 4G, 512M or a number of bytes.")
    return int(float(m.group(1)) * 1024 ** " KMGT".index(m.group(2).upper() or " "))


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="hpdl grade", description="Grade a folder of submitted notebooks, each in a sandbox of its own.",
        epilog="Each notebook runs in bubblewrap (file system read-only, homes, temporary folders and daemons' "
               "sockets hidden, no network, a whitelisted environment, a seccomp filter, no nested user "
               "namespaces) with one total cap on its memory and tasks (a cgroup). Without all of that, or as "
               "root, hpdl grade refuses and "
               "says what is missing, unless --no-sandbox or --allow-root says otherwise.")
    ap.add_argument("submissions", type=Path, help="a folder of notebooks (or of one folder per learner)")
    ap.add_argument("--out", type=Path, default=Path("report"), help="where the reports go (default: ./report)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds each notebook may run (default 600)")
    ap.add_argument("--jobs", type=int, default=1, help="notebooks run at once (default 1; each may start MPI ranks)")
    ap.add_argument("--exercises", default=None,
                    help="comma-separated exercises to score (default: those the notebooks of most learners "
                         "call, and of half of them where the lesson is the same; a learner is a folder, or a "
                         "notebook directly in SUBMISSIONS)")
    ap.add_argument("--memory", default="4G", help="total memory of one submission, all its processes together "
                                                   "(default 4G; the check it runs is capped by --check-memory)")
    ap.add_argument("--check-memory", default=None,
                    help="total memory of the check a submission runs, its learner's and reference ranks together "
                         "(default: half this machine's RAM, at most 8G, less where --jobs submissions at once "
                         "would need more than the RAM less a sixteenth (at least 1G) for the grader and the "
                         f"system, at least {MIN_CHECK_MEMORY >> 30}G)")
    ap.add_argument("--tasks", type=int, default=2048,
                    help="total processes and threads of one submission (default 2048)")
    ap.add_argument("--disk", default=None, help="what the files in one submission's folder may hold on this "
                                                 f"host's disk, measured as it runs (default {DISK_BYTES >> 20}M)")
    ap.add_argument("--no-sandbox", action="store_true",
                    help="grade even where the sandbox is incomplete (no bubblewrap, no seccomp, no cgroup): "
                         "the parts that work are used, the report names the missing ones. Submissions may "
                         "then reach your files, environment and network: only for trusted notebooks")
    ap.add_argument("--keys", type=Path, default=None,
                    help="the answer keys (`hpdl keys export --to DIR`): reference solutions and hidden cases, "
                         "needed where the kit was stripped (`hpdl keys strip`); sets HPDL_KEYS for this run")
    ap.add_argument("--allow-root", action="store_true",
                    help="grade as root all the same (a container or a CI runner): the sandbox hides homes and "
                         "/root, but a submission runs as root inside it")
    return ap


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--run-one":
        _undumpable()
        outer = next((a.split("=", 1)[1] for a in argv[5:] if a.startswith(OWN_PIDS + "=")), None)
        return run_one(Path(argv[1]), Path(argv[2]), Path(argv[3]), float(argv[4]), outer=outer)
    args = _parser().parse_args(argv)
    if args.timeout <= 0 or args.jobs < 1 or args.tasks < 16:
        raise HpdlError("--timeout must be positive seconds, --jobs at least 1 and --tasks at least 16.")
    caps = Caps(memory=_bytes(args.memory), tasks=args.tasks)
    caps.check_memory = (_bytes(args.check_memory, "--check-memory") if args.check_memory is not None
                         else check_memory_for(args.jobs, caps.memory))
    if args.disk is not None:
        caps.disk = _bytes(args.disk, "--disk")
    if caps.memory < 256 * 2**20:
        raise HpdlError(f"--memory {args.memory}: a notebook's kernel needs at least 256M.")
    if caps.disk < 64 * 2**20:
        raise HpdlError(f"--disk {args.disk}: a notebook's folder needs at least 64M.")
    if caps.check_memory < 512 * 2**20:
        raise HpdlError(f"--check-memory {args.check_memory}: a check's ranks need at least 512M.")
    overcommitted = memory_overcommitted(args.jobs, caps)
    if overcommitted:
        raise HpdlError(overcommitted)
    use_keys(args.keys)
    wanted = None
    if args.exercises:
        from hpdl.checker.cases import known

        wanted = [x.strip() for x in args.exercises.split(",") if x.strip()]
        unknown = sorted(set(wanted) - set(known()))
        if unknown:
            raise HpdlError(f"No checks for {', '.join(unknown)}. Known exercises: {', '.join(known())}.")
    why = refusals(args.no_sandbox, args.allow_root)
    if why:
        raise HpdlError("\n".join(why))
    print(f"hpdl grade: {sandbox_header(caps, args.no_sandbox)[0]}")
    subs = grade(args.submissions, args.out, limit=args.timeout, jobs=args.jobs, exercises=wanted, caps=caps,
                 no_sandbox=args.no_sandbox, allow_root=args.allow_root)
    worth = scored_exercises(subs, wanted)
    total = sum(worth.values())
    for s in subs:
        print(f"  {_printable(s.name):<40} {s.status:<14} {s.score(worth):g} / {total:g}")
    if wanted is None:  # what the notebooks call decided it: a class's junk or a learner's many notebooks can sway it
        counts, voters = exercise_votes(subs)
        print("hpdl grade: scored " + (", ".join(f"{ex} (called by {counts.get(ex, 0)} of {voters} learners)"
                                                for ex in worth) or "nothing")
              + ": chosen by what the notebooks call; name them with --exercises to decide")
    print(f"hpdl grade: {len(subs)} submissions; reports in {args.out}/ "
          "(grades.csv, cases.csv, grades.json, index.html)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
