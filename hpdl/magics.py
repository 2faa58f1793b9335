"""The faces in a notebook: `%%px` with a time limit, and the `%hpdl` line magic.

`%%px` is ipyparallel's own magic (run this cell on every rank), with one addition:
`--timeout SECONDS` (default: the cluster's cell_timeout). When ranks do not finish in time,
or one dies, the learner sees which ranks and which lines instead of a frozen notebook.
"""
from __future__ import annotations

import re
import shlex
import signal
import sys
import time

from ipyparallel import error
from ipyparallel.client.magics import ParallelMagics

from hpdl.errors import HpdlError

_TIMEOUT = re.compile(r"(?:^|\s)--timeout(?:=|\s+)(\S+)")


class RankMagics(ParallelMagics):
    """ipyparallel's parallel magics whose blocking cells have a deadline."""

    _timeout: float | None = None

    def cell_px(self, line="", cell=None):
        m = _TIMEOUT.search(line)
        if m:
            try:
                self._timeout = float(m.group(1))
            except ValueError:
                raise HpdlError(f"%%px --timeout takes seconds, e.g. --timeout 30; got {m.group(1)!r}.") from None
            if self._timeout <= 0:
                raise HpdlError("%%px --timeout must be a positive number of seconds.")
            line = (line[: m.start()] + " " + line[m.end():]).strip()
        try:
            return super().cell_px(line, cell)
        finally:
            self._timeout = None

    def parallel_execute(self, cell, block=None, groupby="type", save_name=None, stream_output=None,
                         progress_after=None, signal_on_interrupt=None):
        from hpdl import cluster as _cl

        block = self.view.block if block is None else block
        if not block:
            return super().parallel_execute(cell, block=False, groupby=groupby, save_name=save_name,
                                            stream_output=stream_output, progress_after=progress_after,
                                            signal_on_interrupt=signal_on_interrupt)
        c = _cl.current()
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
                _cl.wait(result, timeout, c, code=cell)
                result.wait_for_output(1)
                try:
                    result.get()
                except error.CompositeError as e:
                    if stream_output and result._output_ready:
                        raise error.AlreadyDisplayedError(e) from None
                    raise
        except KeyboardInterrupt:
            print("Interrupted: sending SIGINT to the ranks…", file=sys.stderr)
            self.view.client.send_signal(signal.SIGINT, targets=self.view.targets, block=True)
            deadline = time.monotonic() + 3
            while not result.ready() and time.monotonic() < deadline:
                result.wait(0.1)
            if not result.ready():
                headline = "interrupted, but some ranks did not stop (a rank inside an MPI call cannot be interrupted)."
                raise _cl.RankHang(_cl._hang_report(c, result, 0, cell, headline)) from None
        finally:
            if not stream_output and result.ready():
                result.wait_for_output(1)
                result.display_outputs(groupby)


# ipyparallel parses the remaining options with the parser attached to its own method.
RankMagics.cell_px.parser = ParallelMagics.cell_px.parser  # type: ignore[attr-defined]
RankMagics.cell_px.__doc__ = (ParallelMagics.cell_px.__doc__ or "") + "\n--timeout SECONDS: time limit for this cell."


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def register_px(ip, cluster) -> None:
    """Make %px/%%px/%autopx/%pxresult talk to this cluster's ranks."""
    view = cluster.client[:]
    view.block = True
    ip.magics_manager.register(RankMagics(ip, view, ""))
    register(ip)


def _hpdl_magic(line: str):
    """%hpdl start [-n N] [--launcher L] [--frameworks torch,horovod] | stop | restart | status"""
    import hpdl

    args = shlex.split(line)
    if not args:
        print(_hpdl_magic.__doc__)
        return None
    verb, rest = args[0], args[1:]
    opts: dict = {}
    i = 0
    while i < len(rest):
        key = rest[i]
        val = rest[i + 1] if i + 1 < len(rest) else None
        if key in ("-n", "--n"):
            try:
                opts["n"] = int(val)
            except (TypeError, ValueError):
                raise HpdlError(f"%hpdl {verb} -n takes a whole number of ranks; got {val!r}.") from None
        elif key in ("-l", "--launcher"):
            opts["launcher"] = val
        elif key == "--frameworks":
            opts["frameworks"] = tuple(x for x in (val or "").split(",") if x)
        elif key == "--timeout":
            opts["cell_timeout"] = float(val)
        else:
            raise HpdlError(f"%hpdl {verb}: unknown option {key!r}. {_hpdl_magic.__doc__}")
        i += 2
    if verb == "start":
        hpdl.start(**opts)
    elif verb == "stop":
        hpdl.stop()
    elif verb == "restart":
        hpdl.restart(**opts)
    elif verb == "status":
        return hpdl.status()
    else:
        raise HpdlError(f"%hpdl: no verb {verb!r}. {_hpdl_magic.__doc__}")
    return None


def register(ip) -> None:
    from hpdl.errors import install_handler

    install_handler(ip)
    ip.register_magic_function(_hpdl_magic, "line", "hpdl")
