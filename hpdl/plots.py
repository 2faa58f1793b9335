"""The figures the lessons show. Client side: each function returns a matplotlib Figure.

- `latency_bandwidth(results, ...)`: latency and bus bandwidth against message size, one line
  per measured algorithm, dashed lines for cost models, a flat line for a bandwidth ceiling.
- `scaling(results, ...)`: time (or speed-up) against the number of ranks.
- `time_breakdown(phases, ...)`: where a training step's time goes, as stacked bars.
- `lines(x, series, ...)`: a few named series against one variable (batch size, threads...).

Measured results are `hpdl.bench` dicts: {"name", "ranks", "sizes", "seconds"}.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

_COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]


def _figure(ncols: int = 1, width: float = 6.0, height: float = 3.8):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width * ncols, height), squeeze=False)
    return fig, list(axes[0])


def _done(fig):
    # Closed so a notebook shows it once (as the returned value), not twice.
    import matplotlib.pyplot as plt

    fig.tight_layout()
    plt.close(fig)
    return fig


def size_label(nbytes: float) -> str:
    """8 → '8 B', 4096 → '4 KiB', 64<<20 → '64 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            v = nbytes / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{nbytes:.0f} B"


def log2_axis(ax, values: Sequence[float], labels: Sequence[str] | None = None) -> None:
    """A log₂ x axis ticked at the values measured, labelled plainly ("8", not "8×10⁰"), no minor ticks.

    Matplotlib's log axes add minor ticks labelled in scientific notation between the major ones
    ("3×10⁰", "6×10⁰" over 1, 2, 4, 8); a learner reads the values that were run, nothing else.
    """
    from matplotlib.ticker import NullFormatter, NullLocator

    ticks = sorted(set(values))
    ax.set_xscale("log", base=2)
    ax.set_xticks(ticks, [str(t) for t in ticks] if labels is None else list(labels))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())


def _size_axis(ax, sizes: Sequence[float]) -> None:
    ticks = sorted(set(sizes))
    if len(ticks) > 9:  # every k-th measured size, always including the largest
        k = int(np.ceil(len(ticks) / 9))
        ticks = ticks[::-1][::k][::-1]
    log2_axis(ax, ticks, [size_label(t) for t in ticks])
    for label in ax.get_xticklabels():
        label.set(rotation=45, ha="right")
    ax.set_xlabel("message size")
    ax.grid(True, which="major", alpha=0.3)


def _bus_factor(collective: str, p: int) -> float:
    return {"allreduce": 2 * (p - 1) / p, "allgather": (p - 1) / p, "reduce_scatter": (p - 1) / p,
            "alltoall": (p - 1) / p}.get(collective, 1.0)


def latency_bandwidth(results: Sequence[Mapping], models: Mapping[str, Mapping] | None = None, *,
                      ceiling: float | None = None, ceiling_label: str = "memory copy",
                      collective: str = "allreduce", title: str | None = None):
    """Two panels: latency (µs, log-log) and bus bandwidth (GB/s) against message size.

    `models` maps a label to {"sizes", "seconds"} (and optionally "ranks") drawn dashed;
    `ceiling` (bytes/s) is drawn as a flat dotted line on the bandwidth panel.
    """
    if not results:
        raise ValueError("results: give at least one measured sweep")
    fig, (lat, bw) = _figure(2)
    all_sizes: list[float] = []
    for i, r in enumerate(results):
        color = _COLORS[i % len(_COLORS)]
        s, t, p = np.asarray(r["sizes"], float), np.asarray(r["seconds"], float), int(r.get("ranks", 2))
        all_sizes += list(s)
        label = f"{r['name']} ({p} ranks)" if p > 1 else r["name"]
        lat.plot(s, t * 1e6, "o-", ms=3, color=color, label=label)
        bw.plot(s, s / t * _bus_factor(collective, p) / 1e9, "o-", ms=3, color=color, label=label)
    for j, (label, m) in enumerate((models or {}).items()):
        color = _COLORS[(len(results) + j) % len(_COLORS)]
        s, t = np.asarray(m["sizes"], float), np.asarray(m["seconds"], float)
        p = int(m.get("ranks", results[0].get("ranks", 2)))
        lat.plot(s, t * 1e6, "--", color=color, label=label)
        bw.plot(s, s / t * _bus_factor(collective, p) / 1e9, "--", color=color, label=label)
    if ceiling:
        bw.axhline(ceiling / 1e9, color="k", ls=":", label=f"{ceiling_label} {ceiling / 1e9:.1f} GB/s")
    lat.set_yscale("log")
    lat.set_ylabel("latency (µs)")
    bw.set_ylabel("bus bandwidth (GB/s)")
    for ax in (lat, bw):
        _size_axis(ax, all_sizes)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    return _done(fig)


def scaling(results: Sequence[Mapping], models: Mapping[str, Mapping] | None = None, *,
            ylabel: str = "time per exchange (ms)", scale: float = 1e3, title: str | None = None):
    """Time against ranks: results are {"name", "ranks": [...], "seconds": [...]}; models the
    same, drawn dashed (and may extend beyond the measured rank counts)."""
    fig, (ax,) = _figure(1)
    for i, r in enumerate(results):
        ax.plot(r["ranks"], np.asarray(r["seconds"]) * scale, "o-", color=_COLORS[i % len(_COLORS)],
                label=f"{r['name']} (measured)")
    for j, (label, m) in enumerate((models or {}).items()):
        ax.plot(m["ranks"], np.asarray(m["seconds"]) * scale, "--", color=_COLORS[j % len(_COLORS)], label=label)
    ax.set_xlabel("ranks")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _done(fig)


def time_breakdown(phases: Mapping[str, Mapping[str, float]] | Mapping[str, float], *, unit: str = "ms",
                   title: str | None = None):
    """Stacked horizontal bars: for each configuration, seconds per phase (data, forward, ...).

    Accepts {"config": {"phase": seconds}} or a single {"phase": seconds}.
    """
    if phases and all(isinstance(v, (int, float)) for v in phases.values()):
        phases = {"step": phases}
    if not phases:
        raise ValueError("phases: give at least one {phase: seconds}")
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "µs": 1e6}[unit]
    names = list(dict.fromkeys(k for d in phases.values() for k in d))
    fig, (ax,) = _figure(1, width=8.0, height=1.4 + 0.55 * len(phases))
    configs = list(phases)
    left = np.zeros(len(configs))
    for i, name in enumerate(names):
        vals = np.array([phases[c].get(name, 0.0) for c in configs]) * scale
        ax.barh(configs, vals, left=left, color=_COLORS[i % len(_COLORS)], label=name)
        for y, (start, v) in enumerate(zip(left, vals)):
            total = sum(phases[configs[y]].values()) * scale
            if total > 0 and v / total > 0.08:
                ax.text(start + v / 2, y, f"{v / total:.0%}", ha="center", va="center", color="white", fontsize=8)
        left += vals
    ax.invert_yaxis()
    ax.set_xlabel(f"time per step ({unit})")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    if title:
        ax.set_title(title)
    return _done(fig)


def lines(x: Sequence[float], series: Mapping[str, Sequence[float]], *, xlabel: str, ylabel: str,
          logx: bool = False, logy: bool = False, markers: bool = True, title: str | None = None):
    """A few named series against one variable."""
    fig, (ax,) = _figure(1)
    for i, (name, ys) in enumerate(series.items()):
        ax.plot(x, ys, "o-" if markers else "-", color=_COLORS[i % len(_COLORS)], label=name)
    if logy:
        ax.set_yscale("log")
    if logx:
        log2_axis(ax, x)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    return _done(fig)
