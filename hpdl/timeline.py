"""Read a Horovod timeline and draw it, so a lesson can look at what Horovod did and when.

Horovod writes a timeline when started with `HOROVOD_TIMELINE=/path/file.json` (the whole run),
or with `HOROVOD_TIMELINE=DYNAMIC` and then `hvd.start_timeline(path)` / `hvd.stop_timeline()`
around the steps of interest. Rank 0 writes it, in Chrome's trace format (chrome://tracing or
Perfetto open it too): one "process" per tensor, and on it nested begin/end events for each
activity — NEGOTIATE_ALLREDUCE (waiting until every rank has the tensor ready), then ALLREDUCE,
inside which MEMCPY_IN_FUSION_BUFFER, MPI_ALLREDUCE (or NCCL_ALLREDUCE), MEMCPY_OUT_FUSION_BUFFER.

    tl = hpdl.timeline.load("timeline.json")
    print(tl.summary())          # time per activity, and how many collectives really ran
    hpdl.timeline.draw(tl)       # one row per tensor, a coloured bar per activity
"""
from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from hpdl.errors import HpdlError

# Activities whose span is a real collective call (a fused call shows on every tensor it carries).
COLLECTIVES = ("MPI_ALLREDUCE", "NCCL_ALLREDUCE", "GLOO_ALLREDUCE", "MPI_ALLGATHER", "NCCL_ALLGATHER",
               "GLOO_ALLGATHER", "MPI_BCAST", "NCCL_BCAST", "GLOO_BCAST", "MPI_ALLTOALL", "NCCL_REDUCESCATTER",
               "MPI_REDUCESCATTER", "NCCL_ALLREDUCE_HIERARCHICAL", "MPI_ADASUM_ALLREDUCE")

COLOURS = {
    "NEGOTIATE": "#d0d0d0",
    "QUEUE": "#e8e8e8",
    "ALLREDUCE": "#c6dbef", "ALLGATHER": "#c6dbef", "BROADCAST": "#c6dbef", "REDUCESCATTER": "#c6dbef",
    "MEMCPY_IN_FUSION_BUFFER": "#fd8d3c",
    "MEMCPY_OUT_FUSION_BUFFER": "#31a354",
    "INIT_FUSION_BUFFER": "#e31a1c",
    "COLLECTIVE": "#08519c",
}


@dataclass(frozen=True)
class Span:
    """One activity on one tensor, in µs since the timeline started."""

    tensor: str
    activity: str
    start: float
    end: float
    depth: int  # 0: top level (NEGOTIATE_*, ALLREDUCE …); 1 and more: inside it
    args: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class Timeline:
    spans: list[Span]
    tensors: list[str]  # in order of first appearance
    ready: list[tuple[str, int, float]]  # (tensor, rank, µs): rank `rank` reported the tensor ready
    path: str = ""

    def activities(self) -> dict[str, tuple[int, float]]:
        """activity -> (how many spans, total µs)."""
        out: dict[str, list] = defaultdict(lambda: [0, 0.0])
        for s in self.spans:
            out[s.activity][0] += 1
            out[s.activity][1] += s.duration
        return {k: (n, t) for k, (n, t) in out.items()}

    def collective_calls(self) -> int:
        """Collective calls actually made. A fused call appears on every tensor it carries, as spans
        that overlap in time (Horovod's background thread runs one collective at a time), so
        overlapping spans of a collective count once."""
        calls = 0
        for activity in {s.activity for s in self.spans if s.activity in COLLECTIVES}:
            end = None
            for s in sorted((s for s in self.spans if s.activity == activity), key=lambda s: s.start):
                if end is None or s.start >= end:
                    calls += 1
                    end = s.end
                else:
                    end = max(end, s.end)
        return calls

    def collective_tensors(self) -> int:
        """Tensor-collectives requested (one per tensor per reduction)."""
        return sum(1 for s in self.spans if s.activity in COLLECTIVES)

    def busy_ms(self, activity: str = "ALLREDUCE") -> float:
        """Wall time during which some tensor was inside `activity` (overlapping spans counted once):
        for "ALLREDUCE", the time Horovod spent doing reductions, without negotiation or waiting."""
        total, start, end = 0.0, None, None
        for s in sorted((s for s in self.spans if s.activity == activity), key=lambda s: s.start):
            if end is None or s.start > end:
                if end is not None:
                    total += end - start
                start, end = s.start, s.end
            else:
                end = max(end, s.end)
        if end is not None:
            total += end - start
        return total / 1000

    def duration_ms(self) -> float:
        if not self.spans:
            return 0.0
        return (max(s.end for s in self.spans) - min(s.start for s in self.spans)) / 1000

    def summary(self) -> str:
        lines = [f"{len(self.tensors)} tensors, {self.collective_tensors()} tensor reductions in "
                 f"{self.collective_calls()} collective calls, {self.duration_ms():.1f} ms recorded"]
        lines.append(f"  {'activity':<28}{'spans':>7}{'busy ms':>10}   (time with at least one tensor in it)")
        busy = {name: self.busy_ms(name) for name in self.activities()}
        for name, n in sorted(((k, v[0]) for k, v in self.activities().items()), key=lambda kv: -busy[kv[0]]):
            lines.append(f"  {name:<28}{n:>7}{busy[name]:>10.2f}")
        return "\n".join(lines)


def _events(text: str, path: str) -> list[dict]:
    """Parse the trace, also while Horovod is still writing it (no closing bracket yet)."""
    text = text.strip()
    if not text:
        return []
    for candidate in (text, text.rstrip(",") + "]", text.rstrip(",").rsplit("}", 1)[0] + "}]"):
        try:
            data = json.loads(candidate)
            return data["traceEvents"] if isinstance(data, dict) else data
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    raise HpdlError(f"{path} is not a Horovod timeline (Chrome trace JSON). Record one with "
                    "HOROVOD_TIMELINE=file.json, or HOROVOD_TIMELINE=DYNAMIC and hvd.start_timeline(file).")


def load(path: str | Path) -> Timeline:
    """Read a timeline file into spans (nested begin/end events paired per tensor)."""
    p = Path(path)
    if not p.exists():
        raise HpdlError(f"No timeline at {p}: Horovod writes it on rank 0 only, once hvd.start_timeline() "
                        "(or HOROVOD_TIMELINE) is in effect and some collective has run.")
    return parse(p.read_text(), str(p))


def parse(text: str, path: str = "<timeline>") -> Timeline:
    """A timeline from its JSON text (e.g. read on rank 0 and sent to the notebook)."""
    events = _events(text, path)
    names: dict[int, str] = {}
    stacks: dict[int, list] = defaultdict(list)
    spans: list[Span] = []
    ready: list[tuple[str, int, float]] = []
    order: list[str] = []
    for e in events:
        ph, pid = e.get("ph"), e.get("pid")
        if ph == "M":
            if e.get("name") == "process_name" and "name" in e.get("args", {}):
                names[pid] = e["args"]["name"]
            continue
        tensor = names.get(pid, f"tensor {pid}")
        if ph == "B":
            stacks[pid].append((e.get("name", "?"), float(e["ts"])))
            if tensor not in order:
                order.append(tensor)
        elif ph == "E" and stacks[pid]:
            activity, start = stacks[pid].pop()
            spans.append(Span(tensor, activity, start, float(e["ts"]), len(stacks[pid]), e.get("args", {})))
        elif ph == "X":
            if e.get("dur", 0) == 0 and str(e.get("name", "")).isdigit():
                ready.append((tensor, int(e["name"]), float(e["ts"])))
            else:
                spans.append(Span(tensor, e.get("name", "?"), float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)),
                                  len(stacks[pid]), e.get("args", {})))
    spans.sort(key=lambda s: (s.start, s.depth))
    return Timeline(spans, order, ready, path)


def _colour(activity: str) -> str:
    if activity in COLLECTIVES:
        return COLOURS["COLLECTIVE"]
    if activity in COLOURS:
        return COLOURS[activity]
    if activity.startswith("NEGOTIATE"):
        return COLOURS["NEGOTIATE"]
    return "#9e9ac8"


def draw(timeline: Timeline | str | Path, ax=None, max_tensors: int = 40, title: str | None = None):
    """One row per tensor (the first `max_tensors`), time in ms across; returns the matplotlib Axes.

    Tall pale bars are top-level phases (grey: negotiation, blue: the operation), thin bars inside
    them are what the operation did (orange: copy into the fusion buffer, dark blue: the
    collective itself, green: copy out). Tensors whose dark-blue bars line up were fused. Black
    ticks mark when each rank reported a tensor ready: negotiation lasts until the last one.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    tl = load(timeline) if isinstance(timeline, (str, Path)) else timeline
    if not tl.spans:
        raise HpdlError("This timeline has no activities yet: "
                        "run a few steps between start_timeline and stop_timeline.")
    shown = tl.tensors[:max_tensors]
    row = {t: i for i, t in enumerate(shown)}
    t0 = min([s.start for s in tl.spans] + [ts for _, _, ts in tl.ready])
    if ax is None:
        _, ax = plt.subplots(figsize=(10, 0.6 + 0.22 * len(shown)))
    seen = {}
    for s in tl.spans:
        if s.tensor not in row:
            continue
        height = 0.8 if s.depth == 0 else 0.4
        colour = _colour(s.activity)
        ax.barh(row[s.tensor], max(s.duration, 1) / 1000, left=(s.start - t0) / 1000, height=height,
                color=colour, edgecolor="none")
        seen.setdefault("collective (MPI/NCCL/Gloo)" if s.activity in COLLECTIVES else s.activity, colour)
    marks = [((ts - t0) / 1000, row[t]) for t, _, ts in tl.ready if t in row]
    if marks:
        ax.plot(*zip(*marks), "|", color="black", markersize=6, label="a rank reported it ready")
    ax.set_yticks(range(len(shown)))
    ax.set_yticklabels([t.split(".", 1)[-1][:28] for t in shown], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("ms since the timeline started")
    hidden = len(tl.tensors) - len(shown)
    calls = tl.collective_calls()
    ax.set_title(title or f"Horovod timeline: {len(tl.tensors)} tensors, "
                          f"{calls} collective call{'s' if calls != 1 else ''}"
                 + (f" ({hidden} tensors not shown)" if hidden > 0 else ""))
    handles = [Patch(color=c, label=n) for n, c in seen.items()]
    if marks:
        from matplotlib.lines import Line2D

        handles.append(Line2D([], [], marker="|", ls="none", color="black", label="a rank reports it ready"))
    ax.legend(handles=handles, fontsize=7, loc="upper left",
              bbox_to_anchor=(1.01, 1.0))
    ax.figure.tight_layout()
    return ax
