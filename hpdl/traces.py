"""Every rank's torch.profiler trace merged onto one clock: one file Perfetto opens, one picture.

One rank's profile shows its own step; a distributed step is only seen whole with every rank on
one time axis — where each bucket's all-reduce runs against backward, and where one rank waits for
another. Each rank's profiler counts time from a base of its own (on other nodes, another clock),
so the ranks first agree on an instant: a barrier, then an event every rank records just after it
(`mark_start`). `gather` moves each rank's events so that its mark is at 0 and gives each rank its
own row (pid = rank), on rank 0.

On the ranks:

    with torch.profiler.profile(activities=hpdl.traces.activities()) as prof:
        hpdl.traces.mark_start(comm)
        for i in range(3):
            with torch.profiler.record_function(f"step {i}"):
                train_step()
    trace = hpdl.traces.gather(prof, comm)            # the merged trace on rank 0, None elsewhere

In the notebook: `hpdl.traces.save(trace, "ddp.trace.json")` (open it at ui.perfetto.dev),
`hpdl.traces.draw(trace)`, and `hpdl.traces.overlap(trace)`: per rank, how much of the all-reduce
time ran while backward was still computing.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
from pathlib import Path

from hpdl.errors import HpdlError

MARK = "hpdl.traces.start"
# what a backward step's compute and a gradient all-reduce are called in a torch.profiler trace
BACKWARD = "autograd::engine::evaluate_function"
ALLREDUCE = ("gloo:all_reduce", "nccl:all_reduce", "ncclDevKernel_AllReduce", "ncclKernel_AllReduce")


def activities() -> list:
    """CPU, and CUDA where this rank has a GPU and torch can trace it (kernels and NCCL's own events
    then show). A torch built without CUDA tracing (the CPU wheels) asked for CUDA events takes
    seconds per step and may not stop, so what it supports decides, not only the GPU."""
    import torch
    from torch.profiler import ProfilerActivity, supported_activities

    cuda = torch.cuda.is_available() and ProfilerActivity.CUDA in supported_activities()
    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])


def mark_start(comm) -> None:
    """The instant every rank shares: the end of a barrier, recorded as an event right after it."""
    from torch.profiler import record_function

    comm.Barrier()
    with record_function(MARK):
        pass


def gather(prof, comm, root: int = 0) -> dict | None:
    """This rank's events to `root`, merged there onto one clock (see `merge`); None on other ranks."""
    fd, path = tempfile.mkstemp(suffix=".json", prefix="hpdl-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        mine = json.loads(Path(path).read_text())
    finally:
        os.unlink(path)
    traces = comm.gather(mine, root=root)
    return merge(traces) if comm.Get_rank() == root else None


def merge(traces: list[dict]) -> dict:
    """One Chrome trace from one per rank (in rank order): each rank's events moved so that its
    `mark_start` event is at 0 µs, each rank one process row named "rank r (host)"."""
    events: list[dict] = []
    for rank, trace in enumerate(traces):
        own = [e for e in trace.get("traceEvents", []) if isinstance(e, dict)]
        marks = [e["ts"] for e in own if e.get("name") == MARK and e.get("ph") == "X"]
        if not marks:
            raise HpdlError(f"rank {rank}'s trace has no start mark: call hpdl.traces.mark_start(comm) inside "
                            "the profiler, before the steps, on every rank.")
        shift = float(marks[0])
        host = trace.get("host_name", "")
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank} ({host})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "args": {"sort_index": rank}})
        for e in own:
            if "ts" not in e or e.get("ph") == "M":
                continue
            events.append({**e, "pid": rank, "ts": float(e["ts"]) - shift})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": len(traces)}}


def save(trace: dict, path: str | Path) -> Path:
    """Write the merged trace; ui.perfetto.dev or chrome://tracing open it."""
    path = Path(path)
    path.write_text(json.dumps(trace))
    return path


def spans(trace: dict, rank: int, names: tuple[str, ...]) -> list[tuple[float, float]]:
    """(start, end) in µs of rank `rank`'s complete events whose name starts with one of `names`."""
    return sorted((e["ts"], e["ts"] + e.get("dur", 0)) for e in trace["traceEvents"]
                  if e.get("pid") == rank and e.get("ph") == "X" and str(e.get("name", "")).startswith(names))


def steps(trace: dict, rank: int, prefix: str = "step ") -> list[tuple[float, float]]:
    """The spans of the `record_function("step i")` blocks of one rank, in order."""
    return spans(trace, rank, (prefix,))


def _within(items: list[tuple[float, float]], start: float, end: float) -> list[tuple[float, float]]:
    return [(a, b) for a, b in items if start <= a < end]


def step_overlap(trace: dict, rank: int, step: tuple[float, float]) -> dict[str, float]:
    """One step of one rank, as DDP itself accounts it: backward compute runs from its first to its
    last gradient function, communication from the first bucket's all-reduce to the last one's end;
    overlap is where the two spans meet. Milliseconds."""
    compute = _within(spans(trace, rank, (BACKWARD,)), *step)
    comm = _within(spans(trace, rank, ALLREDUCE), *step)
    if not compute or not comm:
        return {"compute_ms": 0.0, "comm_ms": 0.0, "overlap_ms": 0.0, "allreduces": len(comm)}
    c0, c1 = compute[0][0], max(b for _, b in compute)
    m0, m1 = comm[0][0], max(b for _, b in comm)
    return {"compute_ms": (c1 - c0) / 1e3, "comm_ms": (m1 - m0) / 1e3,
            "overlap_ms": max(0.0, min(c1, m1) - max(c0, m0)) / 1e3, "allreduces": len(comm)}


def overlap(trace: dict, first: int | None = None) -> dict[int, dict[str, float]]:
    """Per rank, the median over its steps (the `first` ones, if given) of `step_overlap`, and
    `fraction`: the share of the communication span that ran while backward was still computing
    (1.0: all of it hidden)."""
    out = {}
    for rank in range(trace.get("otherData", {}).get("ranks", 0)):
        per_step = [step_overlap(trace, rank, s) for s in _steps_of(trace, rank)[:first]]
        med = {k: statistics.median(s[k] for s in per_step) for k in per_step[0]}
        med["fraction"] = med["overlap_ms"] / med["comm_ms"] if med["comm_ms"] else 0.0
        out[rank] = med
    return out


def _steps_of(trace: dict, rank: int) -> list[tuple[float, float]]:
    found = steps(trace, rank)
    if not found:
        raise HpdlError(f"rank {rank}'s trace has no steps: wrap each step in "
                        "torch.profiler.record_function(f'step {i}').")
    return found


def ddp_overlap(model) -> dict[str, float]:
    """DDP's own account of its last sampled step (ms): backward compute, communication, and their
    overlap, the numbers `overlap` computes from the trace. Call `model._set_ddp_runtime_logging_sample_rate(1)`
    before the steps so that every step is sampled."""
    data = model._get_ddp_logging_data()
    keys = {"compute_ms": "backward_compute_time", "comm_ms": "backward_comm_time",
            "overlap_ms": "backward_compute_comm_overlap_time"}
    if not all(k in data for k in keys.values()):
        raise HpdlError("DDP has not sampled a step yet: call model._set_ddp_runtime_logging_sample_rate(1) "
                        "before training, then run a step.")
    out = {k: data[v] / 1e6 for k, v in keys.items()}
    out["fraction"] = out["overlap_ms"] / out["comm_ms"] if out["comm_ms"] else 0.0
    return out


def draw(trace: dict, step: int = -1, ax=None, title: str | None = None):
    """One step on every rank: two rows per rank, backward compute above (orange) and the bucket
    all-reduces below (blue), on the shared clock in ms. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = trace.get("otherData", {}).get("ranks", 0)
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.7 * ranks))
    chosen = [_steps_of(trace, r) for r in range(ranks)]
    if not all(-len(c) <= step < len(c) for c in chosen):
        raise HpdlError(f"step={step}: the trace holds {min(len(c) for c in chosen)} step(s) on every rank; "
                        "pick one of those (0 is the first, -1 the last).")
    first = min((c[step][0] for c in chosen), default=0.0)
    for r in range(ranks):
        s = chosen[r][step]
        for row, names, colour in ((2 * r, (BACKWARD,), "#fd8d3c"), (2 * r + 0.8, ALLREDUCE, "#08519c")):
            bars = [((a - first) / 1e3, (b - a) / 1e3) for a, b in _within(spans(trace, r, names), *s)]
            ax.broken_barh(bars, (row, 0.7), color=colour)
    ax.set_yticks([2 * r + 0.75 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
    ax.invert_yaxis()
    ax.set_xlabel("ms since the step began on the first rank (one clock for all ranks)")
    ax.legend(handles=[Patch(color="#fd8d3c", label="backward compute"),
                       Patch(color="#08519c", label="bucket all-reduce")], fontsize=8, loc="upper right")
    ax.set_title(title or "one DDP step on every rank")
    ax.figure.tight_layout()
    return ax
