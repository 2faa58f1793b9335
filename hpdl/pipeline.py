"""Plumbing for lesson 10 (pipeline parallelism): schedules as lists, timelines, bubbles, activation bytes.

The concept — stages, micro-batches, send/recv between neighbours, GPipe and 1F1B — is written
out in the notebook. This module holds what would only distract there:

* `gpipe`, `one_f_one_b`: the order in which one stage runs its forward ("F", i) and backward
  ("B", i) passes. Short, and shown in the lesson; here so benchmarks and checks share them.
* `replay`: rebuild the timeline a schedule *would* have with one core per rank, from each rank's
  own compute times. Why: four ranks on two cores take turns on the processor, so wall-clock
  gaps mix the pipeline's bubble with waiting for a core. CPU time (`time.thread_time`) only
  ticks while a rank computes, so it is what each op costs; the dependencies (F i on stage s
  needs F i from stage s-1; B i needs B i from stage s+1) then give when each op could start.
* `bubble`, `bubble_formula`: the idle fraction of a timeline, and (p-1)/(m+p-1).
* `ActivationMeter`: bytes of tensors autograd holds for backward, now and at the peak.
* `draw_timeline`, `plot_bubbles`: the figures.

Runs on the engines (ranks) and in the notebook's kernel; imports nothing from the client side.
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator, Mapping, Sequence

Op = tuple[str, int]  # ("F", i) or ("B", i): forward or backward of micro-batch i


def gpipe(stages: int, micro: int, stage: int) -> list[Op]:
    """GPipe: all forwards, then all backwards. Every stage holds m micro-batches' activations."""
    return [("F", i) for i in range(micro)] + [("B", i) for i in range(micro)]


def one_f_one_b(stages: int, micro: int, stage: int) -> list[Op]:
    """1F1B (PipeDream-Flush): p-s-1 forwards to fill the pipe, then one forward, one backward.

    A backward frees its micro-batch's activations, so stage s never holds more than p-s.
    """
    warm = min(stages - stage - 1, micro)
    ops = [("F", i) for i in range(warm)]
    f, b = warm, 0
    while f < micro:
        ops += [("F", f), ("B", b)]
        f, b = f + 1, b + 1
    return ops + [("B", i) for i in range(b, micro)]


class _Schedules(dict):
    """{"GPipe": gpipe, "1F1B": one_f_one_b}, looked up by name each time: a check that refuses the
    kit's own 1F1B (hooks.KIT_ANSWERS replaces the module's function) is not bypassed through here."""

    def __getitem__(self, name: str):
        return globals()[super().__getitem__(name)]


SCHEDULES = _Schedules({"GPipe": "gpipe", "1F1B": "one_f_one_b"})


def bubble_formula(stages: int, micro: int) -> float:
    """The idle fraction of GPipe and 1F1B with equal stages and free messages: (p-1)/(m+p-1)."""
    return (stages - 1) / (micro + stages - 1)


class Recorder:
    """One rank's log of its ops: CPU seconds each (for `replay`) and wall-clock start/end."""

    def __init__(self) -> None:
        self.ops: list[dict] = []

    @contextmanager
    def op(self, kind: str, micro: int) -> Iterator[None]:
        c0, w0 = time.thread_time(), time.perf_counter()
        yield
        self.ops.append({"kind": kind, "micro": micro, "cpu": time.thread_time() - c0,
                         "wall": (w0, time.perf_counter())})


def replay(ops_by_rank: Sequence[Sequence[Mapping]]) -> list[list[dict]]:
    """Start and end of every op if each rank had its own core and messages were free.

    ops_by_rank[s] lists stage s's ops in the order it ran them, each with "kind", "micro" and
    "cpu" (seconds). An op starts when its stage is free and its input has arrived: F i needs
    F i of stage s-1, B i needs B i of stage s+1. Raises ValueError if the orders deadlock.
    """
    p = len(ops_by_rank)
    done: dict[tuple[int, str, int], float] = {}
    out: list[list[dict]] = [[] for _ in range(p)]
    nxt, clock = [0] * p, [0.0] * p
    while any(nxt[s] < len(ops_by_rank[s]) for s in range(p)):
        progress = False
        for s in range(p):
            while nxt[s] < len(ops_by_rank[s]):
                op = ops_by_rank[s][nxt[s]]
                kind, i = op["kind"], op["micro"]
                need = None
                if kind == "F" and s > 0:
                    need = (s - 1, "F", i)
                elif kind == "B" and s < p - 1:
                    need = (s + 1, "B", i)
                if need is not None and need not in done:
                    break
                start = max(clock[s], done.get(need, 0.0))
                clock[s] = done[(s, kind, i)] = start + op["cpu"]
                out[s].append({"kind": kind, "micro": i, "start": start, "end": clock[s]})
                nxt[s], progress = nxt[s] + 1, True
        if not progress:
            raise ValueError(f"the stages wait for each other forever at ops {nxt}")
    return out


def wall_timeline(ops_by_rank: Sequence[Sequence[Mapping]]) -> list[list[dict]]:
    """The measured wall-clock timeline (perf_counter is one clock for all processes of a machine)."""
    t0 = min(op["wall"][0] for ops in ops_by_rank for op in ops)
    return [[{"kind": op["kind"], "micro": op["micro"], "start": op["wall"][0] - t0, "end": op["wall"][1] - t0}
             for op in ops] for ops in ops_by_rank]


def bubble(timeline: Sequence[Sequence[Mapping]]) -> float:
    """Idle fraction: 1 - (time computing, summed over ranks) / (ranks x time from first start to last end)."""
    start = min(e["start"] for evs in timeline for e in evs)
    end = max(e["end"] for evs in timeline for e in evs)
    busy = sum(e["end"] - e["start"] for evs in timeline for e in evs)
    return 1.0 - busy / (len(timeline) * (end - start))


class _Held:
    """One saved tensor: counted while autograd keeps it (until backward frees the graph)."""

    def __init__(self, meter: "ActivationMeter", tensor) -> None:
        self.meter, self.tensor = meter, tensor
        self.key = (tensor.data_ptr(), tensor.numel() * tensor.element_size())
        meter._hold(self.key)

    def __del__(self) -> None:
        self.meter._release(self.key)


class ActivationMeter:
    """Bytes autograd keeps for backward (activations), now and at the peak, on this rank.

        with ActivationMeter() as mem:
            ...forward and backward passes...
        mem.peak   # bytes

    Counts each tensor once however many ops saved it (a view counts its own bytes);
    parameters are not activations and are left out. Uses
    torch.autograd.graph.saved_tensors_hooks, so it sees exactly what the backward pass will
    need, on CPU and GPU alike.
    """

    def __init__(self) -> None:
        self.now = self.peak = 0
        self._refs: dict[tuple[int, int], int] = {}

    def _hold(self, key: tuple[int, int]) -> None:
        if self._refs.get(key, 0) == 0:
            self.now += key[1]
            self.peak = max(self.peak, self.now)
        self._refs[key] = self._refs.get(key, 0) + 1

    def _release(self, key: tuple[int, int]) -> None:
        self._refs[key] -= 1
        if self._refs[key] == 0:
            self.now -= key[1]
            del self._refs[key]

    def _pack(self, tensor):
        import torch

        base = tensor if tensor._base is None else tensor._base
        if isinstance(base, torch.nn.Parameter):  # a parameter (or a view of one), not an activation
            return tensor
        return _Held(self, tensor)

    @staticmethod
    def _unpack(held):
        return held.tensor if isinstance(held, _Held) else held

    def __enter__(self) -> "ActivationMeter":
        import torch

        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


_KIND_COLOURS = {"F": "#4c78a8", "B": "#59a14f"}


def draw_timeline(timeline: Sequence[Sequence[Mapping]], *, ax=None, title: str = "", unit: float = 1e3):
    """Which rank computes what, when: one row per stage, forwards blue, backwards green, micro-batch numbers."""
    import matplotlib.pyplot as plt

    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(9, 0.55 * len(timeline) + 1.2))
    for s, events in enumerate(timeline):
        for e in events:
            width = (e["end"] - e["start"]) * unit
            ax.broken_barh([(e["start"] * unit, width)], (s - 0.4, 0.8), color=_KIND_COLOURS[e["kind"]],
                           edgecolor="white", linewidth=0.6)
            ax.text(e["start"] * unit + width / 2, s, str(e["micro"]), ha="center", va="center", color="white",
                    fontsize=8)
    ax.set_yticks(range(len(timeline)), [f"stage {s}" for s in range(len(timeline))])
    ax.invert_yaxis()
    ax.set_xlabel("ms" if unit == 1e3 else "time")
    ax.set_title(title or f"bubble {bubble(timeline):.0%}", fontsize=10)
    if fig is not None:
        handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in _KIND_COLOURS.values()]
        ax.legend(handles, ["forward", "backward"], loc="upper right", fontsize=8)
        fig.tight_layout()
        plt.close(fig)
        return fig
    return ax


def plot_bubbles(measured: Mapping[tuple[str, int], Mapping[int, float]], memory: Mapping | None = None):
    """Measured bubble against (p-1)/(m+p-1) for each (schedule, p) over m; optionally peak activation bytes.

    measured[(schedule, p)][m] = bubble fraction; memory[(schedule, p)][m] = peak bytes on stage 0.
    """
    import matplotlib.pyplot as plt

    from hpdl.plots import log2_axis

    fig, axes = plt.subplots(1, 2 if memory else 1, figsize=(11 if memory else 6, 3.6), squeeze=False)
    a = axes[0][0]
    colours = {}
    for (name, p), by_m in sorted(measured.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        ms = sorted(by_m)
        colour = colours.setdefault(p, f"C{len(colours)}")
        a.plot(ms, [by_m[m] for m in ms], "o-" if name == "GPipe" else "s:", color=colour, label=f"{name}, p={p}")
        if name == "GPipe":
            a.plot(ms, [bubble_formula(p, m) for m in ms], "--", color="grey", lw=1)
    a.plot([], [], "--", color="grey", lw=1, label="(p-1)/(m+p-1)")
    a.set(xlabel="micro-batches m", ylabel="bubble (idle fraction)", ylim=(0, 1), title="bubble")
    log2_axis(a, [m for by_m in measured.values() for m in by_m])
    a.legend(fontsize=8)
    if memory:
        b = axes[0][1]
        for (name, p), by_m in sorted(memory.items(), key=lambda kv: (kv[0][1], kv[0][0])):
            ms = sorted(by_m)
            b.plot(ms, [by_m[m] / 2**10 for m in ms], "o-" if name == "GPipe" else "s:",
                   color=colours.get(p, "C5"), label=f"{name}, p={p}")
        b.set(xlabel="micro-batches m", ylabel="KiB", title="peak activations held, stage 0")
        log2_axis(b, [m for by_m in memory.values() for m in by_m])
        b.legend(fontsize=8)
    fig.tight_layout()
    plt.close(fig)
    return fig
