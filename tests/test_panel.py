"""The live rank panel (hpdl.panel): its state model, the same on real ranks (a rank stuck on a
line, one that finished, one that was killed), and what a learner sees of it in JupyterLab while
a %%px cell holds the kernel."""
from __future__ import annotations

import errno
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
from test_browser import CHROMIUM_ARGS, chromium, lab, log_tail  # noqa: F401  (fixtures)

import hpdl
from hpdl import hang, watch
from hpdl.errors import HpdlError, RankHang
from hpdl.panel import Model

RANKS = [{"rank": 0, "engine_id": 0, "pid": 100, "host": "h"}, {"rank": 1, "engine_id": 1, "pid": 101, "host": "h"}]


def _at(line: int, step: int = 0) -> dict:
    return {"busy": True, "where": {"file": "/tmp/ipykernel_1/cell.py", "line": line, "func": "<module>",
                                    "code": "comm.Recv(buf)"}, "step": {"count": step, "seconds": 0.02, "ago": 0.1},
            "rss": 300 << 20, "gpu": None}


def test_the_state_model_names_each_rank_from_what_was_seen():
    m = Model(stuck_after=5)
    states = lambda rows: [(r.state, r.detail) for r in rows]  # noqa: E731
    idle = {"busy": False, "where": None, "step": {"count": 0}, "rss": 1 << 20, "gpu": None}
    assert [r.state for r in m.rows(RANKS, set(), {0: idle, 1: idle}, {0: 0, 1: 0}, set(), 0.0)] == ["idle", "idle"]
    # the controller says rank 1 still runs the cell (and one more is queued behind it)
    rows = m.rows(RANKS, set(), {0: idle, 1: _at(4)}, {0: 0, 1: 2}, set(), 1.0)
    assert states(rows) == [("finished", "done; waiting for rank 1"),
                            ("running", "line 4 of the cell: comm.Recv(buf) (+1 queued)")]
    assert rows[1].memory == "300 MiB" and rows[1].step == "—"
    # on the same line with no step marked for stuck_after seconds: stuck; a step marked: running again
    assert m.rows(RANKS, set(), {0: idle, 1: _at(4)}, {0: 0, 1: 1}, set(), 6.0)[1].state == "stuck"
    assert m.rows(RANKS, set(), {0: idle, 1: _at(4, step=1)}, {0: 0, 1: 1}, set(), 7.0)[1].state == "running"
    assert "20.0 ms (step 1" in m.rows(RANKS, set(), {1: _at(4, step=1)}, {0: 0, 1: 1}, set(), 7.5)[1].step
    # a cell that timed out on rank 1 is stuck at once
    assert m.rows(RANKS, set(), {1: _at(9)}, {0: 0, 1: 1}, {1}, 8.0)[1].detail.endswith("(the cell timed out)")
    # a killed rank is dead, whatever it answered before; the controller's silence falls back to the answers
    rows = m.rows(RANKS, {1}, {0: _at(2), 1: _at(4)}, None, set(), 9.0)
    assert [r.state for r in rows] == ["running", "dead"] and rows[1].memory == "—"
    assert m.rows(RANKS, set(), {}, None, set(), 10.0)[0].state == "idle"  # nothing known: not invented
    with pytest.raises(HpdlError, match="positive"):
        hpdl.panel(every=0)
    with pytest.raises(HpdlError, match="0.2 or more"):
        hpdl.panel(every=0.05)


def _release(fifo: Path) -> bool:
    """Let a rank waiting to read `fifo` go on; False when no rank is reading it."""
    try:
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ENXIO:
            return False
        raise
    os.write(fd, b"go")
    os.close(fd)
    return True


def _until(panel, what: str, cond, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond({r.rank: r for r in panel.rows}):
        if time.monotonic() > deadline:
            pytest.fail(f"the panel did not show {what} within {timeout:.0f} s; it shows:\n{panel.text()}")
        time.sleep(0.1)


STUCK_CELL = """import hpdl
times = hpdl.dp.step_times(lambda: sum(range(10000)), steps=3, warmup=0)
if rank == 1:
    open({fifo!r}).read()
"""


def test_on_real_ranks_a_stuck_rank_shows_its_line_and_a_killed_rank_dead(tmp_path, no_strays):
    """Two ranks; rank 1 waits on a line of the cell: stuck there, rank 0 finished (with the steps
    hpdl.dp.step_times marked); released, both idle; a cell that times out says where to watch
    the ranks; rank 1 killed: dead. The panel's own thread updates `rows` throughout."""
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()  # before start(), which points its %%px at the ranks
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    c = hpdl.start(n=2, frameworks=(), quiet=True)
    p = hpdl.panel(every=0.2, stuck_after=1.0)
    try:
        _until(p, "both ranks idle, with their memory", lambda rows: len(rows) == 2 and all(
            r.state == "idle" and r.memory.endswith("MiB") for r in rows.values()))
        answered = watch.answers(str(c.run_dir), [0, 1], p._tokens)
        assert [answered[r]["busy"] for r in (0, 1)] == [False, False]  # an idle engine runs none of your code
        ar = c.view.execute(STUCK_CELL.format(fifo=str(fifo)), block=False)
        line = f"line 4 of the cell: open({str(fifo)!r}).read()"
        _until(p, "rank 1 stuck on line 4 and rank 0 finished", lambda rows: (
            rows[1].state == "stuck" and rows[1].detail.startswith(line) and rows[0].state == "finished"))
        assert re.fullmatch(r"\d+\.\d ms \(step 3, \d+ s ago\)", p.rows[0].step), p.rows[0].step
        assert _release(fifo)
        ar.get(timeout=30)
        _until(p, "both ranks idle again", lambda rows: [r.state for r in rows.values()] == ["idle", "idle"])

        res = shell.run_cell(f"%%px --timeout 1\nif rank == 1:\n    open({str(fifo)!r}).read()")
        assert isinstance(res.error_in_exec, RankHang) and hang.PANEL_HINT in str(res.error_in_exec)
        _until(p, "rank 1 stuck in the cell that timed out", lambda rows: (
            rows[1].state == "stuck" and rows[1].detail.endswith("(the cell timed out)")))

        os.kill(c.engine_pids()[1], signal.SIGKILL)
        _until(p, "rank 1 dead", lambda rows: rows[1].state == "dead")
        assert p.live
    finally:
        _release(fifo)
        hpdl.stop(quiet=True)
    _until(p, "no ranks after hpdl.stop()", lambda rows: rows == {})
    p.close()
    assert not p.live


# -- in the browser -----------------------------------------------------------------------------
@pytest.fixture
def lab_root(tmp_path) -> Path:
    """JupyterLab serves a folder of this test's own: the notebook below, nothing of the repository."""
    root = tmp_path / "lab-root"
    root.mkdir()
    return root


def _notebook(fifo: Path) -> dict:
    cells = [
        "import hpdl\nhpdl.start(n=2, frameworks=())",
        "hpdl.panel(every=0.5, stuck_after=2)",
        f"%%px --timeout 300\nimport hpdl; hpdl.panel.step(0.0125)\nif rank == 1:\n    open({str(fifo)!r}).read()\n"
        "print(f'rank {rank} released')",
        "hpdl.stop()",
    ]
    return {"cells": [{"cell_type": "code", "execution_count": None, "id": f"c{i}", "metadata": {}, "outputs": [],
                       "source": src} for i, src in enumerate(cells)],
            "metadata": {"kernelspec": {"display_name": "Python 3 (hpdl)", "language": "python", "name": "python3"}},
            "nbformat": 4, "nbformat_minor": 5}


@pytest.mark.browser
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_panel_updates_in_a_real_browser_while_a_cell_runs(chromium, lab, lab_root, tmp_path):  # noqa: F811
    """In JupyterLab: start 2 ranks, open the panel, run a %%px cell in which rank 1 waits on
    line 3. While the kernel is busy with that cell, the panel shows rank 1 stuck at line 3 and
    rank 0 finished with its step; released, both idle; after hpdl.stop(), no ranks."""
    from playwright.sync_api import TimeoutError as PageTimeout, expect, sync_playwright

    base, token, server, log = lab
    fifo = tmp_path / "release"
    os.mkfifo(fifo)
    (lab_root / "panel.ipynb").write_text(json.dumps(_notebook(fifo)))
    shot = tmp_path / "panel.png"
    with sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, args=CHROMIUM_ARGS, headless=True,
            viewport={"width": 1400, "height": 1000})
        page = browser.pages[0] if browser.pages else browser.new_page()
        page.set_default_timeout(60_000)

        def see(locator, what: str, timeout_s: float = 60) -> None:
            try:
                expect(locator.first).to_be_visible(timeout=timeout_s * 1000)
                return
            except (AssertionError, PageTimeout):
                pass  # fail below, outside the handler, without Playwright's page dump
            page.screenshot(path=str(shot))
            outputs = "\n".join(page.locator(".jp-OutputArea-output").all_text_contents())[-3000:]
            pytest.fail(f"not seen within {timeout_s:.0f} s: {what}\nscreenshot: {shot}\noutputs:\n{outputs}\n"
                        f"JupyterLab log ends:\n{log_tail(log)}")

        def rank(r: int, state: str, text: str = ""):
            row = page.locator(f".hpdl-panel tr[data-rank='{r}'][data-state='{state}']")
            return row.filter(has_text=text) if text else row

        try:
            page.goto(f"{base}/lab/tree/panel.ipynb?token={token}", wait_until="domcontentloaded")
            cells = page.locator(".jp-NotebookPanel .jp-Cell")
            see(cells.nth(3), "the notebook's 4 cells", 120)
            see(page.locator(".jp-Notebook-ExecutionIndicator[data-status='idle']"), "the kernel idle", 120)
            # run the first three cells as a learner does, one Shift+Enter each (they queue). A
            # keystroke sent before the freshly opened notebook has the focus is lost (seen in CI):
            # the first cell's prompt must show it running before the other two are queued
            started = cells.first.locator(".jp-InputPrompt", has_text=re.compile(r"\[(\*|\d+)\]"))
            for attempt in range(3):
                cells.first.click()
                page.keyboard.press("Shift+Enter")
                try:
                    expect(started).to_be_visible(timeout=20_000)
                    break
                except (AssertionError, PageTimeout):
                    print(f"the first cell did not start on Shift+Enter #{attempt + 1}")
            see(started, "the first cell running after Shift+Enter", 1)
            for _ in range(2):
                page.keyboard.press("Shift+Enter")

            panel = page.locator(".hpdl-panel")
            see(panel, "the panel under cell 2", 120)
            # the %%px cell holds the kernel: whatever the panel shows now, its thread sent
            see(rank(1, "stuck", "line 3 of the cell: open("), "rank 1 stuck at line 3 of the %%px cell", 120)
            see(rank(0, "finished", "12.5 ms (step 1"), "rank 0 finished, its last step 12.5 ms")
            busy = page.locator(".jp-Notebook-ExecutionIndicator[data-status='busy']")
            see(busy, "the kernel still busy with the %%px cell while the panel updates", 5)
            page.screenshot(path=str(shot))

            assert _release(fifo), "rank 1 was not waiting on the line the panel showed"
            see(page.locator(".jp-OutputArea-output", has_text="rank 1 released"), "rank 1's output after release")
            see(rank(1, "idle"), "rank 1 idle after its cell finished")
            see(rank(0, "idle"), "rank 0 idle")

            page.keyboard.press("Shift+Enter")  # the last cell: hpdl.stop()
            see(panel.filter(has_text="none running"), "the panel following hpdl.stop(): no ranks", 120)
        finally:
            if not shot.exists():
                try:
                    page.screenshot(path=str(shot))
                except Exception as e:  # the page itself may be what broke
                    print(f"no screenshot: {e}")
            print(f"screenshot: {shot}")
            _release(fifo)
            browser.close()
