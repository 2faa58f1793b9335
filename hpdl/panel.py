"""A live panel of the ranks: each rank's state, line, last step and memory, while cells run.

    hpdl.panel()             # or %hpdl panel: a table under the cell, updated twice a second
    %%px
    for batch in batches:
        train_step(batch)
        hpdl.panel.step()    # on the ranks: mark a step ("last step"; hpdl.dp.step_times marks its own)

A rank is idle, running (at a line of your code), stuck (on one line for `stuck_after` seconds
with no step marked, or in a cell that timed out), finished (done with the cell while other ranks
still run it) or dead. Each fact comes from where it is true, none is guessed:

    dead                   the rank's process is gone (hpdl.procs), or it left the controller (Slurm)
    running / idle         ipyparallel's controller: requests queued or running on the rank's engine
    line, step, memory     the rank itself (hpdl.watch), answered from the thread that answers hangs

The panel polls from a daemon thread in the kernel, so it keeps updating while a %%px cell holds
the kernel's main thread: a widget's update is a comm message, and those may be sent from any
thread. The ranks' main threads do no extra work (benchmarks/panel_overhead.py measures it).
"""
from __future__ import annotations

import html
import logging
import sys
import threading
import time
import types
from collections import deque
from concurrent.futures import Future, TimeoutError as FutureTimeout
from dataclasses import dataclass

from hpdl import hang, watch
from hpdl.errors import HpdlError
from hpdl.tables import Html, html_table
from hpdl.watch import step

log = logging.getLogger(__name__)

STATES = ("idle", "running", "stuck", "finished", "dead")
COLOURS = {"idle": "#6b7280", "running": "#15803d", "stuck": "#c2410c", "finished": "#1d4ed8", "dead": "#b91c1c"}
QUEUE_WAIT = 1.0  # s the panel waits for the controller's answer before showing what the ranks said


@dataclass
class Row:
    """One rank's line in the panel."""

    rank: int
    state: str
    detail: str = ""
    step: str = "—"
    memory: str = "—"
    gpu: str = ""
    process: str = ""


def _bytes(n: int | None) -> str:
    if n is None:
        return "—"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit in ("B", "KiB", "MiB") else f"{n:.2f} {unit}"
        n /= 1024
    return "—"


def _seconds(s: float) -> str:
    return f"{s * 1e3:.1f} ms" if s < 1 else f"{s:.2f} s"


def _step_text(step_info: dict | None) -> str:
    if not step_info or not step_info.get("count"):
        return "—"
    n, s, ago = step_info["count"], step_info.get("seconds"), step_info.get("ago")
    head = _seconds(s) if s is not None else "marked"
    return f"{head} (step {n}, {ago:.0f} s ago)" if ago is not None else f"{head} (step {n})"


class Model:
    """Turns what was seen into each rank's state. Remembers since when each running rank has
    been on the same line of the learner's code (and its step count), for 'stuck'."""

    def __init__(self, stuck_after: float = 10.0) -> None:
        self.stuck_after = stuck_after
        self._place: dict[int, tuple[tuple, float]] = {}  # rank -> ((file, line, func, steps), since)

    def rows(self, ranks: list[dict], dead: set[int], answers: dict[int, dict], queues: dict[int, int] | None,
             wedged: set[int], now: float) -> list[Row]:
        """`ranks`: the cluster's rank records (rank, engine_id, pid, host); `dead`: ranks whose
        process is gone; `answers`: fresh samples from hpdl.watch; `queues`: requests on each
        engine (from the controller; None when it did not answer); `wedged`: ranks in a cell
        that timed out; `now`: time.monotonic()."""
        busy: dict[int, bool] = {}
        for info in ranks:
            r = info["rank"]
            if r in dead:
                continue
            if queues is not None and info.get("engine_id") in queues:
                busy[r] = queues[info["engine_id"]] > 0
            else:
                a = answers.get(r)
                busy[r] = bool(a and a.get("busy")) or r in wedged
        running = sorted(r for r, b in busy.items() if b)
        rows = []
        for info in ranks:
            r = info["rank"]
            a = answers.get(r) or {}
            row = Row(r, "idle", step=_step_text(a.get("step")), memory=_bytes(a.get("rss")),
                      gpu=_bytes(a["gpu"]) if a.get("gpu") is not None else "",
                      process=f"pid {info.get('pid', '?')} on {info.get('host', '?')}")
            if r in dead:
                row.state, row.detail = "dead", "its process is gone: hpdl.restart() starts fresh ranks"
                row.step = row.memory = "—"
                self._place.pop(r, None)
            elif busy[r]:
                row.state, row.detail = self._running(r, a, r in wedged, now)
                queued = (queues or {}).get(info.get("engine_id"), 0) - 1
                if queued > 0:
                    row.detail += f" (+{queued} queued)"
            else:
                self._place.pop(r, None)
                others = [o for o in running if o != r]
                if others:
                    row.state, row.detail = "finished", f"done; waiting for {hang.rank_word(others)}"
            rows.append(row)
        return rows

    def _running(self, r: int, answer: dict, wedged: bool, now: float) -> tuple[str, str]:
        where = answer.get("where")
        if not answer:
            return ("stuck" if wedged else "running"), "not answering (busy in a call that holds Python's lock?)"
        if not where:
            return ("stuck" if wedged else "running"), "in the kit or a library, outside your code"
        key = (where.get("file"), where.get("line"), where.get("func"), (answer.get("step") or {}).get("count"))
        old = self._place.get(r)
        since = old[1] if old and old[0] == key else now
        self._place[r] = (key, since)
        place = hang.place_text(where)
        if wedged:
            return "stuck", f"{place} (the cell timed out)"
        if now - since >= self.stuck_after:
            return "stuck", f"{place} (for {now - since:.0f} s)"
        return "running", place


def _render(rows: list[Row], header: str, note: str = "", updates: int = 0) -> str:
    gpu = any(row.gpu for row in rows)
    cols = ["rank", "state", "where", "last step", "memory (RSS)"] + (["GPU memory"] if gpu else []) + ["process"]
    body, marks = [], []
    for row in rows:
        colour = COLOURS.get(row.state, "#000")
        state = Html(f"<b style='color:{colour}'>● {html.escape(row.state)}</b>")
        body.append([row.rank, state, row.detail, row.step, row.memory] + ([row.gpu or "—"] if gpu else [])
                    + [row.process])
        marks.append({"class": "hpdl-rank", "data-rank": row.rank, "data-state": row.state})
    table = html_table(cols, body, th={"style": "text-align:left;padding:2px 10px"},
                       td={"style": "padding:2px 10px"}, row_attrs=marks) if rows else ""
    foot = f"<div style='color:#6b7280;font-size:90%'>{html.escape(note)}</div>" if note else ""
    return (f"<div class='hpdl-panel' data-updates='{updates}' style='font-family:monospace;font-size:12px'>"
            f"<div><b>{html.escape(header)}</b></div>{table}{foot}</div>")


def _in_thread(fn) -> Future:
    """Run `fn` on a throwaway daemon thread: a controller that never answers cannot freeze the panel."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:  # handed to whoever reads the future
            fut.set_exception(exc)

    threading.Thread(target=run, name="hpdl-panel-queue", daemon=True).start()
    return fut


NOTE = ("stuck: on one line for {after:g} s with no step marked, or in a cell that timed out · "
        "finished: done, the other ranks still run the cell · hpdl.panel.step() in a training loop fills 'last step'")


class Panel:
    """The widget and the thread that keeps it current. `refresh()` takes one sample (the thread
    calls it every `every` seconds); `rows` holds the last one; `close()` stops it."""

    def __init__(self, every: float = 0.5, stuck_after: float = 10.0) -> None:
        import ipywidgets

        self.every = every
        self.model = Model(stuck_after)
        self.rows: list[Row] = []
        self.updates = 0
        self.widget = ipywidgets.HTML(_render([], "hpdl ranks: starting the panel…"))
        self._cluster = None
        self._tokens: deque[str] = deque(maxlen=3)  # answers to the last three requests are fresh
        self._queue_job: Future | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hpdl-panel", daemon=True)

    # -- one sample --------------------------------------------------------------------------
    def refresh(self) -> list[Row]:
        """Read the ranks' answers, the controller's queues and the processes; show them; ask again."""
        from hpdl.cluster import running

        c = running()
        if c is not self._cluster:  # started, restarted or stopped since the last sample
            self._cluster, self._tokens, self._queue_job = c, deque(maxlen=3), None
            self.model = Model(self.model.stuck_after)
        if c is None or c.stopped:
            self.rows = []
            self._show("hpdl ranks: none running. hpdl.start(n=2) starts them; this panel follows.")
            return self.rows
        folder = str(c.run_dir)
        ranks = list(c.ranks)
        answers = watch.answers(folder, [r["rank"] for r in ranks], self._tokens)
        queues = self._queues(c)
        dead = set(c.dead_ranks())
        outstanding = set(c.client.outstanding) if c.client is not None else set()
        wedged = {r for msg_id, r in c.wedged.copy().items() if msg_id in outstanding}
        self.rows = self.model.rows(ranks, dead, answers, queues, wedged, time.monotonic())
        if len(dead) < len(ranks):
            self._tokens.append(watch.request(folder))
        counts = {s: sum(row.state == s for row in self.rows) for s in STATES}
        summary = ", ".join(f"{n} {s}" for s, n in counts.items() if n)
        self._show(f"hpdl ranks: {c.n} via {c.launcher} · {summary} · {time.strftime('%H:%M:%S')}, "
                   f"every {self.every:g} s", NOTE.format(after=self.model.stuck_after))
        return self.rows

    def _queues(self, c) -> dict[int, int] | None:
        """{engine id: requests queued or running}, from ipyparallel's controller; None if it is slow."""
        if c.client is None:
            return None
        if self._queue_job is None:
            self._queue_job = _in_thread(c.client.queue_status)
        try:
            status = self._queue_job.result(timeout=QUEUE_WAIT)
        except FutureTimeout:
            return None  # keep waiting for the same answer next time
        except Exception as exc:  # the client was closed (ranks stopped) or the controller refused
            log.debug("no queue status from the controller: %s", exc)
            self._queue_job = None
            return None
        self._queue_job = None
        return {k: v["queue"] for k, v in status.items() if isinstance(k, int) and isinstance(v, dict)}

    def _show(self, header: str, note: str = "") -> None:
        self.updates += 1
        self.widget.value = _render(self.rows, header, note, self.updates)

    # -- the thread --------------------------------------------------------------------------
    def start(self) -> "Panel":
        self._thread.start()
        return self

    def _run(self) -> None:
        from hpdl.cluster import running

        c = running()
        if c is not None and not c.stopped:  # a first request, so the first table has answers
            self._cluster = c
            self._tokens.append(watch.request(str(c.run_dir)))
            self._stop.wait(min(0.3, self.every))
        while not self._stop.is_set():
            try:
                self.refresh()
            except Exception as exc:  # keep watching: the next sample may work
                log.warning("the rank panel could not update: %s", exc)
                self._show(f"hpdl ranks: could not update ({type(exc).__name__}: {exc}); retrying")
            self._stop.wait(self.every)

    def close(self, why: str = "closed") -> None:
        """Stop polling; the table stays as it was last seen, marked `why`."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.every + QUEUE_WAIT + 1)
        self._show(f"hpdl ranks: {why} (hpdl.panel() opens a live one)")

    @property
    def live(self) -> bool:
        return self._thread.is_alive()

    # -- how it shows ------------------------------------------------------------------------
    def text(self) -> str:
        """The last sample as plain text, one line per rank (scripts, logs, tests)."""
        return "\n".join(f"rank {r.rank}: {r.state:<8} {r.detail}  step {r.step}  rss {r.memory}" for r in self.rows)

    def __repr__(self) -> str:
        return f"<hpdl panel, {'live' if self.live else 'closed'}>\n{self.text()}"

    def _repr_mimebundle_(self, **kwargs):
        return self.widget._repr_mimebundle_(**kwargs)


_open: Panel | None = None


def show(every: float = 0.5, stuck_after: float = 10.0) -> Panel:
    """Open the live panel of the ranks (it replaces one opened before). It follows whatever
    hpdl.start() runs, so it can be opened before the ranks start or kept across restarts.

    every: seconds between updates (≤ 1 keeps it live; the ranks' cost does not grow with it).
    stuck_after: seconds on one line, with no step marked, before a running rank shows as stuck.
    """
    global _open
    for name, value in (("every", every), ("stuck_after", stuck_after)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise HpdlError(f"hpdl.panel({name}=...) takes seconds, a positive number; got {value!r}.")
    if every < 0.2:
        raise HpdlError(f"hpdl.panel(every={every}) asks faster than the ranks answer (every 0.2 s); use 0.2 or more.")
    if _open is not None:
        _open.close("replaced by a newer panel")
    _open = Panel(float(every), float(stuck_after)).start()
    return _open


def opened() -> Panel | None:
    """The panel that is open now, if any."""
    return _open if _open is not None and _open.live else None


class _CallableModule(types.ModuleType):
    """`hpdl.panel()` opens the panel and `hpdl.panel.step()` marks a step: one name for both."""

    def __call__(self, every: float = 0.5, stuck_after: float = 10.0) -> Panel:
        return show(every, stuck_after)


sys.modules[__name__].__class__ = _CallableModule

__all__ = ["Model", "Panel", "Row", "STATES", "opened", "show", "step"]
