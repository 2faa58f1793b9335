"""hpdl.plots: each figure draws what it is given — one line per series, models dashed, the
ceiling flat, bars stacked per phase — and rejects empty input."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import numpy as np
import pytest

from hpdl import plots

SIZES = [8, 1024, 1 << 20]


def sweep(name, ranks=4, scale=1.0):
    return {"name": name, "ranks": ranks, "sizes": SIZES, "seconds": [scale * (1e-6 + s * 1e-10) for s in SIZES]}


def test_size_labels():
    assert plots.size_label(8) == "8 B"
    assert plots.size_label(4096) == "4 KiB"
    assert plots.size_label(64 << 20) == "64 MiB"
    assert plots.size_label(1536) == "1.5 KiB"


def test_latency_bandwidth_draws_measured_models_and_ceiling():
    model = {"sizes": SIZES, "seconds": [1e-6 + s * 5e-11 for s in SIZES]}
    fig = plots.latency_bandwidth([sweep("ring"), sweep("library", scale=0.5)], {"ring model": model},
                                  ceiling=8e9, title="t")
    latency, bandwidth = fig.axes
    assert latency.get_yscale() == "log" and latency.get_xscale() == "log"
    assert [line.get_label() for line in latency.lines] == ["ring (4 ranks)", "library (4 ranks)", "ring model"]
    assert latency.lines[2].get_linestyle() == "--"
    assert np.allclose(latency.lines[0].get_ydata(), np.array(sweep("ring")["seconds"]) * 1e6)
    # bus bandwidth of an allreduce on 4 ranks: n/t · 2·3/4, in GB/s
    expected = np.array(SIZES) / np.array(sweep("ring")["seconds"]) * 1.5 / 1e9
    assert np.allclose(bandwidth.lines[0].get_ydata(), expected)
    ceiling = bandwidth.lines[-1]
    assert ceiling.get_linestyle() == ":" and np.allclose(ceiling.get_ydata(), 8.0)
    assert [t.get_text() for t in latency.get_xticklabels()] == ["8 B", "1 KiB", "1 MiB"]


def test_latency_bandwidth_needs_results():
    with pytest.raises(ValueError):
        plots.latency_bandwidth([])


def test_scaling_plots_each_series_against_ranks():
    measured = {"name": "allreduce", "ranks": [2, 3, 4], "seconds": [1e-3, 2e-3, 3e-3]}
    model = {"ranks": [2, 8, 16], "seconds": [1e-3, 1e-3, 1e-3]}
    (ax,) = plots.scaling([measured], {"model": model}).axes
    assert [list(line.get_xdata()) for line in ax.lines] == [[2, 3, 4], [2, 8, 16]]
    assert np.allclose(ax.lines[0].get_ydata(), [1, 2, 3])  # milliseconds
    assert ax.lines[1].get_linestyle() == "--"


def test_time_breakdown_stacks_phases():
    phases = {"in process": {"data": 0.010, "forward": 0.020, "backward": 0.040},
              "1 worker": {"data": 0.001, "forward": 0.020, "backward": 0.040}}
    (ax,) = plots.time_breakdown(phases).axes
    bars = ax.patches
    assert len(bars) == 6  # 3 phases × 2 configurations
    widths = sorted(round(b.get_width(), 6) for b in bars)
    assert widths == [1.0, 10.0, 20.0, 20.0, 40.0, 40.0]  # in ms
    # the second phase starts where the first ends
    forward = [b for b in bars if round(b.get_width(), 6) == 20.0]
    assert sorted(round(b.get_x(), 6) for b in forward) == [1.0, 10.0]
    (single,) = plots.time_breakdown({"data": 1.0, "forward": 2.0}, unit="s").axes
    assert len(single.patches) == 2
    with pytest.raises(ValueError):
        plots.time_breakdown({})


def test_lines_with_log_axes():
    (ax,) = plots.lines([1, 4, 16], {"a": [1, 2, 3], "b": [3, 2, 1]}, xlabel="batch", ylabel="rate",
                        logx=True, logy=True, markers=False).axes
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert len(ax.lines) == 2 and ax.lines[0].get_marker() in ("None", "", None)
    assert ax.get_legend() is not None


def test_log_axes_label_only_the_values_measured():
    """Over 1, 2, 4, 8 a log axis printed "3×10⁰" and "6×10⁰" between the ticks (lesson 10's bubble plots)."""
    from hpdl.pipeline import plot_bubbles

    measured = {("GPipe", 4): {1: 0.75, 2: 0.6, 4: 0.43, 8: 0.27}, ("1F1B", 4): {1: 0.75, 2: 0.6, 4: 0.43, 8: 0.28}}
    memory = {("GPipe", 4): {1: 1024, 2: 2048, 4: 4096, 8: 8192}}
    fig = plot_bubbles(measured, memory)
    (ax,) = plots.lines([1, 2, 4, 8], {"a": [1, 2, 3, 4]}, xlabel="m", ylabel="t", logx=True).axes
    for axis in [*fig.axes, ax]:
        axis.figure.canvas.draw()
        shown = [t.get_text() for t in axis.get_xticklabels(minor=False) if t.get_text()]
        minor = [t.get_text() for t in axis.get_xticklabels(minor=True) if t.get_text()]
        assert shown == ["1", "2", "4", "8"] and minor == [], (shown, minor)
