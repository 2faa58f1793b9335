"""`%%px` with a time limit: ipyparallel's magic (run this cell on every rank), plus
`--timeout SECONDS` (default: the cluster's cell_timeout). When ranks do not finish in time,
or one dies, the learner sees which ranks and which lines (reports.py) instead of a frozen
notebook. Registered by lifecycle.start(); it finds the running cluster through the getter it
is given, so it imports nothing from lifecycle.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable

from IPython.core import magic_arguments
from IPython.core.error import UsageError
from ipyparallel import error
from ipyparallel.client.magics import ParallelMagics, exec_args, output_args

from hpdl import procs
from hpdl.cluster import reports
from hpdl.errors import HpdlError, RankHang


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"takes seconds, e.g. --timeout 30; got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("must be a positive number of seconds")
    return value


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
        block = self.view.block if block is None else block
        if not block:
            return super().parallel_execute(cell, block=False, groupby=groupby, save_name=save_name,
                                            stream_output=stream_output, progress_after=progress_after,
                                            signal_on_interrupt=signal_on_interrupt)
        c = self._current()
        why = c.problem()
        if why:
            raise HpdlError(f"The ranks can't take this cell: {why}. Run hpdl.restart() for fresh ranks.")
        timeout = self._timeout or c.cell_timeout
        stream_output = self.stream_output if stream_output is None else stream_output
        result = self.view.execute(cell, silent=False, block=False)
        result._fname = "%px"
        self.last_result = result
        if save_name:
            self.shell.user_ns[save_name] = result
        cm = result.stream_output() if stream_output else _null()
        try:
            with cm:
                reports.wait(result, timeout, c, code=cell)
                result.wait_for_output(1)
                try:
                    result.get()
                except error.CompositeError as e:
                    if stream_output and result._output_ready:
                        raise error.AlreadyDisplayedError(e) from None
                    raise
        except KeyboardInterrupt:
            import signal

            print("Interrupted: sending SIGINT to the ranks…", file=sys.stderr)
            procs.signal_engines(self.view.client, self.view.targets, signal.SIGINT)
            deadline = time.monotonic() + 3
            while not result.ready() and time.monotonic() < deadline:
                result.wait(0.1)
            if not result.ready():
                headline = "interrupted, but some ranks did not stop (a rank inside an MPI call cannot be interrupted)."
                raise RankHang(reports.hang_report(c, result, 0, cell, headline)) from None
        finally:
            if not stream_output and result.ready():
                result.wait_for_output(1)
                result.display_outputs(groupby)


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def register_px(ip, cluster, current: Callable) -> None:
    """Make %px/%%px/%autopx/%pxresult talk to this cluster's ranks; `current()` returns the
    running cluster (or raises ClusterNotRunning) when a cell runs."""
    view = cluster.client[:]
    view.block = True
    ip.magics_manager.register(RankMagics(ip, view, current))
