"""Under `hpdl grade`: the submission's kernel asks, the grader checks and keeps the result.

Kernel side (`request`, called by hpdl.check when $HPDL_GRADE_SERVICE names a folder): write
the packed function as JSON (no pickle the grader would have to load: the function's bytes
travel base64-encoded and are only ever unpickled by the learner's own sandboxed ranks) to
req-<id>.json in that folder (the inbox), then wait for answers/resp-<id>.json and show it.
Nothing the kernel writes decides a score.

Grader side (`Service`): pick up requests, check the exercise name against the kit's case
modules, run the check with the exercise's own rank counts, time limits and hidden cases
(whatever the notebook asked for), keep the result, and answer with a copy for the notebook.

The inbox is the submission's to write, so the grader never writes there, and reads there only
through hpdl.safefiles (no link followed, regular files only, a bound on size): a request that
is a link to /dev/zero or a FIFO is refused, not read. Answers go to answers/, a folder the
grader made, which the sandbox binds read-only (sandbox.wrap's `readonly`); both folders are
opened once and used through their descriptors, so renaming them away changes nothing here.
"""
from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import uuid
from pathlib import Path

from hpdl import safefiles, settings

MAX_REQUEST_BYTES = 64 * 2**20
MAX_REQUESTS = 100  # per submission
STOP_WAIT = 15.0  # s for a check stopped at the notebook's end to end its jobs (it notices within 0.02 s)
MAX_SOURCE_CHARS = 4 * 2**20  # a function's source and its notebook's cells, as a check request carries them
MAX_ANSWER_BYTES = 64 * 2**20
ANSWERS = "answers"  # under the inbox: the grader's answers, read-only inside the sandbox
REQUEST_NAME = re.compile(r"req-([A-Za-z0-9_-]{1,64})\.json")
MAX_LISTED = 10_000  # entries of the inbox looked at per poll
MAX_ITEMS = 1_000_000  # values in a request's lists and objects, strings aside (its files' lines, its sources)
MAX_CONTAINERS = 20_000  # lists and objects in a request
MAX_STRINGS = 1_000_000  # strings in a request (keys too): its quotes are counted first


# -- the kernel's side ---------------------------------------------------------------------------

def _jsonable(code: dict) -> dict:
    out = {k: v for k, v in code.items() if k != "pickled"}
    if code.get("pickled"):
        out["pickled_b64"] = base64.b64encode(code["pickled"]).decode()
    return out


def request(name: str, code: dict):
    """Ask the grader to check `code` for exercise `name`; return its result (for display)."""
    from hpdl.checker.report import CheckResult
    from hpdl.errors import HpdlError

    folder = settings.GRADE_SERVICE.get()
    wait = settings.GRADE_CHECK_WAIT.get()
    rid = uuid.uuid4().hex
    tmp = folder / f".req-{rid}.tmp"
    tmp.write_text(json.dumps({"exercise": name, "code": _jsonable(code)}))
    os.replace(tmp, folder / f"req-{rid}.json")
    resp = folder / ANSWERS / f"resp-{rid}.json"
    deadline = time.monotonic() + wait
    pause = 0.05
    while not resp.exists():
        if time.monotonic() > deadline:
            raise HpdlError(f"The grader did not answer the check of {name!r} within {wait:g} s.")
        time.sleep(pause)
        pause = min(pause * 1.5, 0.5)
    data = json.loads(safefiles.read_bounded(resp, MAX_ANSWER_BYTES))
    if "error" in data:
        raise HpdlError(data["error"])
    return CheckResult.from_dict(data["result"])


# -- the grader's side -----------------------------------------------------------------------------

def _parse_request(raw: bytes):
    """A request's JSON, its shape counted before anything is built. Why: 64 MiB of `{"sources": [{}, {}, …]}`
    (22 million objects) had the grader's own process, outside every cap, take 8 GB and a core for minutes,
    on past the submission's time limit, and the next submission timed out. What a request carries is text,
    bounded by its bytes; its lists and objects are few (a function's sources, its files' lines)."""
    try:
        safefiles.refuse_past_shape(raw, MAX_STRINGS, MAX_ITEMS, MAX_CONTAINERS)
    except ValueError as exc:
        raise ValueError(f"a request of {str(exc).removeprefix('JSON of ')}") from None
    return json.loads(raw)


def _code_from(raw) -> dict:
    """The packed function as the kernel sent it, with every field's type checked."""
    if not isinstance(raw, dict):
        raise ValueError("not a packed function")
    code: dict = {}
    for key in ("name", "qualname", "filename"):
        code[key] = str(raw.get(key, ""))[:300]
    code["firstline"] = int(raw.get("firstline") or 1)
    code["line_offset"] = int(raw.get("line_offset") or 0)
    code["from_engines"] = bool(raw.get("from_engines"))
    code["source"] = str(raw["source"]) if isinstance(raw.get("source"), str) else None
    lines = raw.get("lines") if isinstance(raw.get("lines"), dict) else {}
    code["lines"] = {str(k): [str(x) for x in v[:100_000]] for k, v in lines.items() if isinstance(v, list)}
    sources = raw.get("sources") if isinstance(raw.get("sources"), list) else []
    code["sources"] = [{"name": str(s.get("name", "")), "firstline": int(s.get("firstline") or 1),
                        "source": str(s.get("source", ""))} for s in sources if isinstance(s, dict)]
    b64 = raw.get("pickled_b64")
    code["pickled"] = base64.b64decode(b64) if isinstance(b64, str) else None
    text = len(code["source"] or "") + sum(len(s["source"]) for s in code["sources"]) \
        + sum(len(x) for v in code["lines"].values() for x in v)
    if text > MAX_SOURCE_CHARS:  # parsed and searched in the grader's process
        raise ValueError(f"{text} characters of source sent with the function (at most {MAX_SOURCE_CHARS})")
    return code


class Service:
    """One submission's requests, checked one after another in a thread of the grader; results kept here.

    One at a time: a check starts two MPI jobs (the learner's ranks, the reference's), each with a
    cgroup of its own inside the check's (capped at `memory` for all of them), outside the submission's
    caps. A notebook's hpdl.check() waits for its answer, so an honest one never has two under way; a
    hostile one could file MAX_REQUESTS at once (threads, or files written into its inbox) and start
    hundreds of ranks on the grading host.

    `folder` is the inbox the submission writes; `answers` (folder/answers) is the grader's."""

    def __init__(self, folder: Path, hidden: list[str], memory: int | None = None, at_once: int = 1):
        self.folder = folder
        self.hidden = hidden
        self.memory = memory  # what each check's jobs may hold together (None: sandbox.default_memory())
        self.at_once = at_once  # submissions graded at once, each maybe with a check under way (checking.crowding)
        folder.mkdir(parents=True, exist_ok=True)
        self.answers = folder / ANSWERS
        self.answers.mkdir(mode=0o755)  # made before the submission starts: never one it planted
        self.inbox_fd = safefiles.open_dir(folder)
        self.answers_fd = safefiles.open_dir(self.answers)
        self.seen: set[str] = set()
        self.queue: list[str] = []  # request ids not yet started, in the order they were found
        self.worker: threading.Thread | None = None
        self.closing = False  # the submission has ended: what is still queued is not started
        self.stop = threading.Event()  # ... and the check under way is ended (its jobs killed)
        self.results: dict[str, dict] = {}  # exercise -> CheckResult.to_dict(), the last one counts
        self.problems: list[str] = []
        self.lock = threading.Lock()

    def _requests(self) -> list[str]:
        """The request ids in the inbox now (names only: nothing is opened here)."""
        found = []
        try:
            with os.scandir(self.inbox_fd) as entries:
                for n, entry in enumerate(entries):
                    if n >= MAX_LISTED:
                        break
                    m = REQUEST_NAME.fullmatch(entry.name)
                    if m:
                        found.append(m.group(1))
        except OSError as exc:  # the descriptor is closed: the submission is over
            self._problem(f"could not list the check requests: {exc}")
        return sorted(found)

    def poll(self) -> None:
        """Queue the new requests. Past MAX_REQUESTS, each is answered "not run" up to MAX_REQUESTS more, and
        then the inbox is no longer read: 10,000 request files a poll, each answered by a file written from the
        grader's own loop (which keeps every submission's clock), and each id kept, for as long as the
        notebook ran, was the grader's time, disk and memory, spent at a submission's bidding."""
        for rid in self._requests() if len(self.seen) < 2 * MAX_REQUESTS else ():
            if rid in self.seen:
                continue
            self.seen.add(rid)
            if len(self.seen) > MAX_REQUESTS:
                self._answer(rid, {"error": f"more than {MAX_REQUESTS} checks from one notebook; not run"})
                if len(self.seen) >= 2 * MAX_REQUESTS:
                    self._problem(f"more than {2 * MAX_REQUESTS} check requests: the rest were not read")
                    break
                continue
            with self.lock:
                self.queue.append(rid)
        with self.lock:
            if self.queue and not self.closing and (self.worker is None or not self.worker.is_alive()):
                self.worker = threading.Thread(target=self._work, daemon=True, name="hpdl-grade-checks")
                self.worker.start()

    def _work(self) -> None:
        while True:
            with self.lock:
                if self.closing or not self.queue:
                    self.worker = None  # this thread: poll() starts another when requests come
                    return
                rid = self.queue.pop(0)
            self._serve(rid)

    def _serve(self, rid: str) -> None:
        from hpdl.checker import cases
        from hpdl.checker.checking import check_code
        from hpdl.checker.jobs import Stopped

        try:
            raw = safefiles.read_bounded(f"req-{rid}.json", MAX_REQUEST_BYTES, dir_fd=self.inbox_fd)
            req = _parse_request(raw)
            name = req.get("exercise") if isinstance(req, dict) else None
            if not isinstance(name, str) or name not in cases.known():
                raise ValueError(f"no exercise named {name!r}")
            code = _code_from(req.get("code"))
            module = cases.load(name)
            result = check_code(name, module, code, grading=True, progress=False, hidden=self.hidden,
                                stop=self.stop, memory=self.memory, at_once=self.at_once)
        except Stopped:  # answered all the same: every request the grader took up gets its answer
            self._problem(f"the check of {name} under way when the notebook ended was stopped (no result)")
            self._answer(rid, {"error": "the notebook ended while this check ran; it was stopped (no result)"})
            return
        except Exception as exc:  # a malformed request is the submission's problem, recorded
            self._problem(f"check request refused: {type(exc).__name__}: {str(exc)[:200]}")
            self._answer(rid, {"error": f"The grader could not run this check: {str(exc)[:300]}"})
            return
        data = result.to_dict()
        data["function"] = code.get("name")
        data["time"] = time.time()
        with self.lock:
            self.results[name] = data
        self._answer(rid, {"result": data})

    def _problem(self, text: str) -> None:
        with self.lock:
            self.problems.append(text)

    def _answer(self, rid: str, data: dict) -> None:
        """Into answers/ (the grader's folder, pinned by its descriptor): a fresh file, renamed."""
        try:
            safefiles.replace_atomically(f"resp-{rid}.json", json.dumps(data), dir_fd=self.answers_fd, mode=0o644)
        except OSError as exc:  # the submission is over and the folder closed
            self._problem(f"could not answer a check: {exc}")

    def busy(self) -> bool:
        worker = self.worker
        return worker is not None and worker.is_alive()

    def close(self) -> None:
        """The notebook has ended: no check starts any more (those still queued are answered 'not run');
        the one under way, if any, goes on (`busy`) until `finish`."""
        with self.lock:
            self.closing, dropped, self.queue = True, self.queue, []
        for rid in dropped:
            self._answer(rid, {"error": "the notebook ended before this check could start; not run"})
        if dropped:
            self._problem(f"{len(dropped)} check request(s) not run: the notebook ended first "
                          "(one check runs at a time)")

    def finish(self, wait: float = STOP_WAIT) -> None:
        """The submission is over: a check still under way is stopped, not waited for (the grader's loop
        waits here, and every other submission's clock with it: a notebook that left a check of minutes
        behind it once held the batch 120 s, and an honest one beside it timed out). Then the folders go."""
        self.close()
        self.stop.set()
        worker = self.worker
        if worker is not None:
            worker.join(wait)
        if not self.busy():  # a thread still running keeps them (it may yet answer)
            for fd in (self.inbox_fd, self.answers_fd):
                try:
                    os.close(fd)
                except OSError:
                    pass  # closed by an earlier finish()
            self.inbox_fd = self.answers_fd = -1
