"""`hpdl.view()`: ipyparallel's DirectView on every rank, whose blocking calls have a time limit.

A notebook reads results back from the ranks with `hpdl.view().pull("name", block=True)` in a
plain cell, outside `%%px`. ipyparallel waits for such a call without end: a rank that never
answers (stuck in a collective, or a reply lost on the way) freezes the notebook. Here a blocking
call waits as long as a `%%px` cell may (the cluster's cell_timeout), then names the ranks that have
not answered and where they are (reports.py), as `%%px` does; and, as `%%px` does, it is refused at
once while a rank is dead or still stuck in a cell that timed out (it would only queue behind it).
Calls with block=False are ipyparallel's own.
"""
from __future__ import annotations

from typing import Callable

from ipyparallel.client.view import DirectView

from hpdl.cluster import reports
from hpdl.cluster.px import engine_ids
from hpdl.errors import HpdlError


class RankView(DirectView):
    """A DirectView whose blocking apply, push, pull and execute wait at most the cell time limit."""

    current_cluster: Callable  # set by rank_view(): the running cluster, found when a call waits

    def _really_apply(self, f, args=None, kwargs=None, targets=None, block=None, track=None, label=None):
        block = self.block if block is None else block
        if block:
            self._refuse_if_stuck()
        ar = super()._really_apply(f, args, kwargs, targets=targets, block=False, track=track, label=label)
        if not block:
            return ar
        name = getattr(f, "__name__", "f")
        what = {"_pull": "view.pull(...)", "_push": "view.push(...)"}.get(name, f"view.apply({name}, ...)")
        return self._waited(ar, targets, None, what).get()

    def execute(self, code, silent=True, targets=None, block=None, label=None):
        block = self.block if block is None else block
        if block:
            self._refuse_if_stuck()
        ar = super().execute(code, silent=silent, targets=targets, block=False, label=label)
        if block:
            self._waited(ar, targets, code, "view.execute(...)").get()
            ar.wait_for_output(1)
        return ar

    def _refuse_if_stuck(self) -> None:
        why = self.current_cluster().problem()
        if why:
            raise HpdlError(f"The ranks can't take this call: {why}. Run hpdl.restart() for fresh ranks.")

    def _waited(self, ar, targets, code: str | None, what: str):
        """`ar` once every rank has answered; RankHang naming the others past the time limit, RankDied
        when a rank died meanwhile."""
        cluster = self.current_cluster()
        reports.wait(ar, cluster.cell_timeout, cluster, code=code, engines=engine_ids(self, targets), what=what)
        return ar


def rank_view(client, current: Callable) -> RankView:
    """Every engine of `client` (ipyparallel's client[:]), as a RankView; `current()` returns the running
    cluster (its time limit and ranks) when a call waits, as for %%px (px.register_px)."""
    view = client[:]
    view.__class__ = RankView  # the same object, built by ipyparallel as it builds its own
    view.current_cluster = current
    return view
