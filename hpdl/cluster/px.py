"""`%%px` with a time limit: ipyparallel's magic (run this cell on every rank), plus
`--timeout SECONDS` (default: the cluster's cell_timeout). When ranks do not finish in time,
or one dies, the learner sees which ranks and which lines (reports.py) instead of a frozen
notebook. Registered by lifecycle.start(); it finds the running cluster through the getter it
is given, so it imports nothing from lifecycle.

Built on ipyparallel's public API only: the cell is submitted by ParallelMagics.parallel_execute
with block=False (the AsyncResult ipyparallel itself would wait on, named %px), and waited for
here with AsyncResult.wait/ready, stream_output, wait_for_output, get and display_outputs. Every
%%px option keeps its meaning (--targets, --noblock, --local, --stream/--no-stream, --group-*,
--out, --signal-on-interrupt); --progress-after is accepted, but the streamed output is the
progress shown.
"""
from __future__ import annotations

import argparse
import signal
import sys
import time
from contextlib import nullcontext
from typing import Callable

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from ipyparallel import error
from ipyparallel.client.magics import ParallelMagics, exec_args, output_args

from hpdl import procs
from hpdl.cluster import reports
from hpdl.errors import HpdlError, RankHang

STOP_WAIT = 3.0  # s: after an interrupt, how long the ranks get to stop before the stuck ones are named


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes seconds, e.g. --timeout 30; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


def engine_ids(view, targets=None) -> list[int]:
    """The engines a view's cell goes to, in the order of its AsyncResult's msg_ids (DirectView.targets,
    or the call's own `targets`: None or 'all', one id, a list, or a slice of the client's ids)."""
    ids = list(view.client.ids)
    targets = view.targets if targets is None else targets
    if targets is None or targets == "all":
        return ids
    if isinstance(targets, int):
        return [ids[targets] if targets < 0 else targets]
    if isinstance(targets, slice):
        return ids[targets]
    return list(targets)


def _signal_name(sig: int | str) -> str:
    if isinstance(sig, str):
        return sig
    try:
        return signal.Signals(sig).name
    except ValueError:
        return str(sig)


class RankMagics(ParallelMagics):
    """ipyparallel's parallel magics whose blocking cells have a deadline."""

    def __init__(self, shell, view, current: Callable, suffix: str = "") -> None:
        super().__init__(shell, view, suffix)
        self._current = current
        self._timeout: float | None = None

    @magic_arguments.magic_arguments()
    @exec_args
    @output_args
    @magic_arguments.argument("--local", action="store_const", const=True, dest="local",
                              help="also execute the cell in the local namespace")
    @magic_arguments.argument("--timeout", type=_seconds, metavar="SECONDS", default=None,
                              help="time limit for this cell (default: the cluster's cell_timeout)")
    def cell_px(self, line="", cell=None):
        """Executes the cell on every rank, with a time limit (see --timeout)."""
        try:
            args = magic_arguments.parse_argstring(self.cell_px, line)
        except UsageError as exc:
            raise HpdlError(f"%%px: {exc}") from None
        self._timeout = args.timeout
        try:
            return super().cell_px(line, cell)  # ipyparallel parses the same line with our parser
        finally:
            self._timeout = None

    def parallel_execute(self, cell, block=None, groupby="type", save_name=None, stream_output=None,
                         progress_after=None, signal_on_interrupt=None):
        """%px and %%px: ipyparallel submits the cell; a blocking cell is waited for here, with a
        deadline, watching for dead ranks (a non-blocking one returns ipyparallel's AsyncResult)."""
        block = self.view.block if block is None else block
        if not block:
            return super().parallel_execute(cell, block=False, groupby=groupby, save_name=save_name,
                                            stream_output=stream_output, progress_after=progress_after,
                                            signal_on_interrupt=signal_on_interrupt)
        c = self._current()
        why = c.problem()
        if why:
            raise HpdlError(f"The ranks can't take this cell: {why}. Run hpdl.restart() for fresh ranks.")
        verbose, self.verbose = self.verbose, False  # its "Async parallel execution" line would be wrong here
        try:
            result = super().parallel_execute(cell, block=False, save_name=save_name)
        finally:
            self.verbose = verbose
        stream_output = self.stream_output if stream_output is None else stream_output
        sig = self.signal_on_interrupt if signal_on_interrupt is None else signal_on_interrupt
        self._wait(c, result, cell, engine_ids(self.view), stream_output, groupby, sig)

    def _wait(self, c, result, cell: str, engines: list[int], stream_output: bool, groupby: str,
              sig: int | str) -> None:
        """Stream (or afterwards show) each rank's output; raise RankHang past the time limit,
        RankDied when a rank dies, and ipyparallel's own errors when the cell raised."""
        try:
            with result.stream_output() if stream_output else nullcontext():
                reports.wait(result, self._timeout or c.cell_timeout, c, code=cell, engines=engines)
                output_ready = result.wait_for_output(1)
                try:
                    result.get()
                except error.CompositeError as e:
                    if stream_output and output_ready:
                        raise error.AlreadyDisplayedError(e) from None  # already streamed: no repeat
                    raise
        except KeyboardInterrupt:
            self._interrupted(c, result, cell, engines, sig)
        finally:
            if not stream_output and result.ready():
                result.wait_for_output(1)
                result.display_outputs(groupby)

    def _interrupted(self, c, result, cell: str, engines: list[int], sig: int | str) -> None:
        """The notebook's stop button: signal the ranks; name the ones that cannot stop (inside MPI)."""
        print(f"Interrupted: sending {_signal_name(sig)} to the ranks…", file=sys.stderr)
        procs.signal_engines(self.view.client, engines, sig)
        deadline = time.monotonic() + STOP_WAIT
        while not result.ready() and time.monotonic() < deadline:
            result.wait(0.1)
        if not result.ready():
            headline = "interrupted, but some ranks did not stop (a rank inside an MPI call cannot be interrupted)."
            raise RankHang(reports.hang_report(c, result, cell, headline, engines=engines)) from None


def register_px(ip, cluster, current: Callable) -> None:
    """Make %px/%%px/%autopx/%pxresult talk to this cluster's ranks; `current()` returns the
    running cluster (or raises ClusterNotRunning) when a cell runs."""
    view = cluster.client[:]
    view.block = True
    ip.magics_manager.register(RankMagics(ip, view, current))
