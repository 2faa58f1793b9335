"""hpdl.timeline on timelines that Horovod really wrote (2 MPI ranks), and on broken files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hpdl.timeline as timeline
from hpdl.errors import HpdlError

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
TENSORS = 10

RECORD = """
import os, sys
from mpi4py import MPI
import torch
import horovod.torch as hvd
import hpdl.dp as dp

folder = sys.argv[1]
hvd.init()
tensors = [torch.ones(100) * i for i in range({n})]
for name, threshold in (("fused", None), ("unfused", "0")):
    dp.restart_horovod(HOROVOD_TIMELINE="DYNAMIC", HOROVOD_FUSION_THRESHOLD=threshold)
    hvd.start_timeline(os.path.join(folder, name + ".json"))
    for h in [hvd.allreduce_async(t, name=f"grad.{{i}}") for i, t in enumerate(tensors)]:
        hvd.synchronize(h)
    hvd.stop_timeline()
hvd.shutdown()
"""


@pytest.fixture(scope="module")
def recorded(tmp_path_factory) -> Path:
    """Timelines of one all-reduce of TENSORS tensors, with fusion and without, from Horovod itself."""
    folder = tmp_path_factory.mktemp("timelines")
    script = folder / "record.py"
    script.write_text(textwrap.dedent(RECORD.format(n=TENSORS)))
    proc = subprocess.run([MPIEXEC, "-n", "2", sys.executable, str(script), str(folder)], capture_output=True,
                          text=True, timeout=180, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return folder


@pytest.mark.slow
def test_fusion_shows_as_fewer_collective_calls(recorded):
    fused = timeline.load(recorded / "fused.json")
    unfused = timeline.load(recorded / "unfused.json")
    for tl in (fused, unfused):
        assert sorted(tl.tensors) == sorted(f"allreduce.grad.{i}" for i in range(TENSORS))
        assert tl.collective_tensors() == TENSORS
        # NEGOTIATE_ALLREDUCE shows only when a rank had to wait for another: timing, not asserted
        assert {s.activity for s in tl.spans} >= {"ALLREDUCE", "MPI_ALLREDUCE"}
        # a rank's ready tick is drawn inside a negotiation, so it too shows only when a rank waited
        assert {rank for _, rank, _ in tl.ready} <= {0, 1} and {t for t, _, _ in tl.ready} <= set(tl.tensors)
        assert 0 < tl.busy_ms("ALLREDUCE") <= tl.duration_ms()
    assert unfused.collective_calls() == TENSORS
    assert fused.collective_calls() < TENSORS
    assert "MEMCPY_IN_FUSION_BUFFER" in fused.activities() and "MEMCPY_IN_FUSION_BUFFER" not in unfused.activities()
    assert f"{TENSORS} tensor reductions in {fused.collective_calls()} collective call" in fused.summary()


@pytest.mark.slow
def test_nesting_is_recovered(recorded):
    tl = timeline.load(recorded / "fused.json")
    for s in tl.spans:
        if s.activity == "MPI_ALLREDUCE":
            outer = [o for o in tl.spans if o.tensor == s.tensor and o.activity == "ALLREDUCE"]
            assert s.depth == 1 and outer and outer[0].start <= s.start and s.end <= outer[0].end


@pytest.mark.slow
def test_a_timeline_still_being_written_can_be_read(recorded, tmp_path):
    text = (recorded / "unfused.json").read_text()
    cut = text[: int(len(text) * 0.6)]
    cut = cut[: cut.rfind("},") + 2]                # as Horovod leaves it mid-run: no closing bracket
    partial = timeline.parse(cut)
    assert 0 < len(partial.spans) < len(timeline.parse(text).spans)


@pytest.mark.slow
def test_draw_one_row_per_tensor(recorded):
    import matplotlib

    matplotlib.use("Agg")
    tl = timeline.load(recorded / "fused.json")
    ax = timeline.draw(tl, max_tensors=4)
    assert [t.get_text() for t in ax.get_yticklabels()] == [t.split(".", 1)[-1] for t in tl.tensors[:4]]
    assert len(ax.patches) == sum(1 for s in tl.spans if s.tensor in tl.tensors[:4])
    assert "6 tensors not shown" in ax.get_title()


def test_bad_input_says_what_to_do(tmp_path):
    with pytest.raises(HpdlError, match="rank 0 only"):
        timeline.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("this is not a trace")
    with pytest.raises(HpdlError, match="HOROVOD_TIMELINE"):
        timeline.load(tmp_path / "bad.json")
    with pytest.raises(HpdlError, match="no activities"):
        timeline.draw(timeline.parse("[]"))


def test_overlapping_spans_count_once():
    events = [{"name": "process_name", "ph": "M", "pid": p, "args": {"name": f"allreduce.t{p}"}} for p in (1, 2, 3)]
    for pid, (b, e) in {1: (0, 10), 2: (1, 11), 3: (20, 25)}.items():   # t1 and t2 fused; t3 alone
        events += [{"ph": "B", "name": "MPI_ALLREDUCE", "ts": b, "pid": pid}, {"ph": "E", "ts": e, "pid": pid}]
    tl = timeline.parse(json.dumps(events))
    assert tl.collective_calls() == 2 and tl.collective_tensors() == 3
    assert tl.busy_ms("MPI_ALLREDUCE") == pytest.approx((11 + 5) / 1000)
