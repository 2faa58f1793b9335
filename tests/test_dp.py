"""hpdl.dp on real ranks: parameter agreement, DDP over MPI, timing across ranks, Horovod restarts.

Rank-side code runs as scripts under `mpiexec -n 2` (real MPI, Gloo and Horovod); each prints
one JSON line from rank 0 that the test asserts on.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hpdl.dp as dp

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")


def on_ranks(tmp_path: Path, code: str, prelude: str = "", n: int = 2, timeout: float = 180) -> dict:
    """Run `prelude` then `code` on n fresh MPI ranks; return the JSON object rank 0 printed last."""
    script = tmp_path / "ranks.py"
    script.write_text(prelude + textwrap.dedent(code))
    proc = subprocess.run([MPIEXEC, "-n", str(n), sys.executable, str(script)], capture_output=True, text=True,
                          timeout=timeout, env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert lines, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads(lines[-1])


PRELUDE = """
import json
import torch, torch.nn as nn, torch.distributed as dist
from mpi4py import MPI
from torch.nn.parallel import DistributedDataParallel as DDP
import hpdl.dp as dp
from hpdl.rank import finish, init_torch_distributed
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()
torch.set_num_threads(1)
init_torch_distributed(rank, size, torch.device("cpu"))

def mlp(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))

def train(model, steps=4):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + rank)
    for _ in range(steps):
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return model
"""


@pytest.mark.slow
def test_spread_digest_and_ddp_over_mpi(tmp_path, no_strays):
    out = on_ranks(tmp_path, prelude=PRELUDE, code="""
    apart = mlp(seed=rank)                                   # different on each rank
    same = mlp(seed=0)
    gloo = train(DDP(mlp(seed=rank)))                        # DDP broadcasts rank 0's model
    mpi = DDP(mlp(seed=rank)); dp.use_mpi_allreduce(mpi, comm); train(mpi)
    alone = train(mlp(seed=0))                               # no averaging: ranks drift apart
    result = {
        "spread_apart": dp.param_spread(apart), "spread_same": dp.param_spread(same),
        "spread_gloo": dp.param_spread(gloo), "spread_mpi": dp.param_spread(mpi),
        "spread_alone": dp.param_spread(alone),
        "gap_mpi_gloo": (dp.flat_params(mpi) - dp.flat_params(gloo)).abs().max().item(),
        "digests": comm.allgather(dp.param_digest(mpi)),
        "digest_same_as_gloo": dp.param_digest(mpi) == dp.param_digest(gloo),
    }
    if rank == 0:
        print(json.dumps(result))
    del gloo, mpi                                            # the DDP models hold the group
    finish()
    """)
    assert out["spread_apart"] > 0 and out["spread_alone"] > 0
    assert out["spread_same"] == 0.0 and out["spread_gloo"] == 0.0 and out["spread_mpi"] == 0.0
    assert out["gap_mpi_gloo"] < 1e-6
    assert len(set(out["digests"])) == 1


@pytest.mark.slow
def test_step_times_agree_across_ranks(tmp_path, no_strays):
    out = on_ranks(tmp_path, prelude=PRELUDE, code="""
    import time
    times = dp.step_times(lambda: time.sleep(0.01 * (rank + 1)), steps=3, warmup=1)
    everyone = comm.allgather(times)
    if rank == 0:
        print(json.dumps({"everyone": everyone}))
    finish()
    """)
    first, second = out["everyone"]
    assert first == second                       # the slowest rank's time, the same on every rank
    assert len(first) == 3 and all(t >= 0.02 for t in first)   # rank 1 sleeps 20 ms per step


@pytest.mark.slow
def test_restart_horovod_changes_and_restores_fusion(tmp_path, no_strays):
    out = on_ranks(tmp_path, """
    import json, os, tempfile
    from mpi4py import MPI
    import torch
    import horovod.torch as hvd
    import hpdl.dp as dp, hpdl.timeline as tl
    rank = MPI.COMM_WORLD.Get_rank()
    hvd.init()
    tensors = [torch.ones(50) * i for i in range(12)]
    calls = []
    for threshold in (None, "0", None):
        dp.restart_horovod(HOROVOD_TIMELINE="DYNAMIC", HOROVOD_FUSION_THRESHOLD=threshold)
        path = os.path.join(tempfile.gettempdir(), f"hpdl-test-fusion-{os.getpid()}.json")
        hvd.start_timeline(path)
        for h in [hvd.allreduce_async(t, name=f"t{i}") for i, t in enumerate(tensors)]:
            hvd.synchronize(h)
        hvd.stop_timeline()
        if rank == 0:
            calls.append(tl.load(path).collective_calls())
            os.remove(path)
    result = hvd.allreduce(torch.tensor([rank + 1.0])).item()
    hvd.shutdown()
    if rank == 0:
        print(json.dumps({"calls": calls, "average": result}))
    """)
    fused, unfused, fused_again = out["calls"]
    assert unfused == 12                         # fusion off: one collective per tensor
    assert fused < 12 and fused_again < 12       # fusion back on after the restart, not stuck at 0
    assert out["average"] == 1.5                 # Horovod works after three restarts


def test_scaling_efficiency_and_throughput():
    assert dp.scaling_efficiency([1, 2, 4], [100.0, 180.0, 300.0]) == pytest.approx([1.0, 0.9, 0.75])
    assert dp.throughput(64, [0.5, 0.1, 0.2]) == pytest.approx(320.0)   # the median step, not the mean


def test_plot_scaling_draws_throughput_and_efficiency():
    import matplotlib

    matplotlib.use("Agg")
    fig = dp.plot_scaling([1, 2], [100.0, 170.0])
    ax_throughput, ax_efficiency = fig.axes
    assert [round(b.get_height(), 2) for b in ax_efficiency.patches] == [1.0, 0.85]
    assert list(ax_throughput.lines[1].get_ydata()) == [100.0, 170.0]


def test_flat_params_and_digest_on_one_process():
    import torch

    a = torch.nn.Linear(3, 2)
    b = torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    assert dp.param_digest(a) == dp.param_digest(b)
    assert dp.flat_params(a).dtype == torch.float64 and dp.flat_params(a).numel() == 8
    with torch.no_grad():
        b.bias[0] += 1e-7
    assert dp.param_digest(a) != dp.param_digest(b)
