"""Errors a learner may meet, worded as what happened and what to do next.

These are shown without our internals' traceback: `install_handler()` teaches IPython to
print an HpdlError as its message alone.
"""
from __future__ import annotations


class HpdlError(Exception):
    """Something the learner or instructor can act on; the message says what to do."""


class ClusterNotRunning(HpdlError):
    pass


class RankHang(HpdlError):
    """Ranks did not finish within the time limit; the message names them and their lines."""


class RankDied(HpdlError):
    """An engine (an MPI rank) exited while work was running."""


class CheckFailed(HpdlError):
    pass


def install_handler(shell=None) -> None:
    """Show HpdlError subclasses in notebooks as a short red message, not a traceback."""
    if shell is None:
        try:
            from IPython import get_ipython

            shell = get_ipython()
        except ImportError:
            return
    if shell is None:
        return

    def _show(self, etype, value, tb, tb_offset=None):
        lines = [f"\x1b[31m{etype.__name__}\x1b[0m: {str(value).splitlines()[0] if str(value) else ''}"]
        lines += str(value).splitlines()[1:]
        self._showtraceback(etype, value, lines)
        return lines

    shell.set_custom_exc((HpdlError,), _show)
