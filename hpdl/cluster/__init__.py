"""Client side: the learner's MPI ranks, from start to stop.

    lifecycle.py   start / reuse / restart / stop the engines, status, the running cluster
    reports.py     wait for a cell; RankHang / RankDied messages (worded by hpdl.hang)
    px.py          %%px with a time limit (ipyparallel's magic, plus --timeout)
    cleanup.py     run folders, the reaper's state (hpdl.reaper), ending a cluster, `hpdl cleanup`

Only lifecycle.py calls into hpdl.launchers. Other modules find the running cluster with
`running()` (None when there is none) or `current()` (raises ClusterNotRunning).
"""
from __future__ import annotations

from hpdl.cluster.cleanup import home
from hpdl.cluster.lifecycle import (
    DEFAULT_CELL_TIMEOUT,
    Cluster,
    current,
    nodes_missing,
    restart,
    running,
    start,
    status,
    stop,
    view,
)
from hpdl.cluster.reports import wait

__all__ = ["Cluster", "DEFAULT_CELL_TIMEOUT", "current", "home", "nodes_missing", "restart", "running", "start",
           "status", "stop", "view", "wait"]

