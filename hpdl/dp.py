"""Plumbing for the data-parallel lessons (05 DDP, 06 Horovod): compare, time, reduce over MPI.

The concepts — sharding, averaging gradients, buckets, overlap — are written out in the
notebooks. This module holds what would only distract there:

* `param_spread` / `param_digest`: are the parameters the same on every rank?
* `use_mpi_allreduce`: let DDP reduce its buckets with MPI (mpi4py) instead of Gloo.
* `step_times`, `throughput`: time training steps fairly across ranks.
* `plot_scaling`: images/s and scaling efficiency against the number of ranks.
* `restart_horovod`: start Horovod again with other HOROVOD_* settings (fusion, timeline).

Runs on the engines (ranks) and imports nothing from the client side.
"""
from __future__ import annotations

import hashlib
import statistics
import time
from typing import Callable, Iterable

import numpy as np


def _params(model_or_params) -> list:
    if hasattr(model_or_params, "parameters"):
        return list(model_or_params.parameters())
    return list(model_or_params)


def flat_params(model_or_params):
    """All parameters as one float64 CPU vector (a copy), for comparing runs exactly."""
    import torch

    ps = _params(model_or_params)
    if not ps:
        return torch.zeros(0, dtype=torch.float64)
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float64) for p in ps])


def param_digest(model_or_params) -> str:
    """A short fingerprint of the exact parameter bits: equal digests mean identical models."""
    h = hashlib.sha1()
    for p in _params(model_or_params):
        h.update(p.detach().to("cpu").contiguous().numpy().tobytes())
    return h.hexdigest()[:12]


def param_spread(model_or_params, comm=None) -> float:
    """Largest |difference| between this rank's parameters and rank 0's (the same answer on all ranks).

    0.0 means every rank holds bit-identical parameters. A collective: call it on every rank.
    """
    from mpi4py import MPI

    comm = comm or MPI.COMM_WORLD
    mine = flat_params(model_or_params).numpy()
    sizes = comm.allgather(mine.size)
    if len(set(sizes)) != 1:
        return float("inf")  # different models on different ranks
    ref = mine.copy() if comm.Get_rank() == 0 else np.empty_like(mine)
    comm.Bcast(ref, root=0)
    local = float(np.max(np.abs(mine - ref))) if mine.size else 0.0
    return comm.allreduce(local, op=MPI.MAX)


# -- DDP over MPI -------------------------------------------------------------------------

def _mpi_allreduce_hook(comm, bucket):
    """A DDP communication hook: average one bucket with MPI_Allreduce, in place.

    DDP hands over each bucket (a flat buffer holding many gradients) as soon as backward has
    filled it and expects a Future holding the averaged buffer.
    """
    import torch
    from mpi4py import MPI

    buf = bucket.buffer()
    if buf.device.type != "cpu":  # NCCL does this on GPUs; staging through the host is slow but correct
        host = buf.to("cpu")
        comm.Allreduce(MPI.IN_PLACE, host.numpy(), op=MPI.SUM)
        buf.copy_(host)
    else:
        comm.Allreduce(MPI.IN_PLACE, buf.numpy(), op=MPI.SUM)
    buf.div_(comm.Get_size())
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def use_mpi_allreduce(ddp_model, comm=None) -> None:
    """Make a DistributedDataParallel model reduce its gradient buckets over MPI.

    torch.distributed's own `mpi` backend exists only when PyTorch is built from source against
    an MPI library; the pip and conda packages are built without it. This hook sends DDP's
    buckets through mpi4py instead. Here (MPICH, shared memory) it is faster than Gloo over TCP
    loopback. On GPUs keep NCCL: don't call this.
    """
    from mpi4py import MPI

    ddp_model.register_comm_hook(comm or MPI.COMM_WORLD, _mpi_allreduce_hook)


# -- Horovod ------------------------------------------------------------------------------

# Horovod 0.28.1's defaults, for settings a restart must put back explicitly
HOROVOD_DEFAULTS = {"HOROVOD_FUSION_THRESHOLD": str(128 * 1024 * 1024)}


def restart_horovod(**env: str | None) -> None:
    """Shut Horovod down on this rank and start it again with other HOROVOD_* settings.

    Horovod reads its settings (HOROVOD_FUSION_THRESHOLD, HOROVOD_TIMELINE, ...) only in
    hvd.init(). Call on every rank (it is collective). MPI stays up because mpi4py started it
    before Horovod did. A value of None means Horovod's default. (Horovod keeps a tuned value
    across a restart unless told otherwise, so the default is written out where we know it.)
    Horovod 0.28.1 may crash in this restart when HOROVOD_CYCLE_TIME was set in the first
    start and fusion is now turned off; set the cycle time only when launching a job.
    """
    import os

    import horovod.torch as hvd

    if hvd.is_initialized():
        hvd.shutdown()
    for key, value in env.items():
        if value is None and key in HOROVOD_DEFAULTS:
            os.environ[key] = HOROVOD_DEFAULTS[key]
        elif value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = str(value)
    hvd.init()


# -- timing ---------------------------------------------------------------------------------

def _synchronize(device=None) -> None:
    """Wait for the GPU's queued work: CUDA calls return before the kernels have run.

    Without it a timed GPU step measures kernel launches, not the work. `device` None means
    whatever this process has started CUDA on (nothing on a CPU-only run).
    """
    import sys

    torch = sys.modules.get("torch")
    if torch is None:
        return
    if device is not None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)
    elif torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def step_times(step: Callable[[], object], steps: int = 10, warmup: int = 2, comm=None,
               device=None) -> list[float]:
    """Seconds per call of `step()`, each measured between barriers so all ranks time the same thing.

    The slowest rank decides a data-parallel step, so each time is the maximum over ranks. On a
    GPU each step is timed until its kernels have finished (CUDA synchronised), not just launched.
    Each step is also marked for the live panel (hpdl.panel), which shows the last one.
    """
    from mpi4py import MPI

    from hpdl import watch

    comm = comm or MPI.COMM_WORLD
    for _ in range(warmup):
        step()
    _synchronize(device)
    times = []
    for _ in range(steps):
        comm.Barrier()
        t0 = time.perf_counter()
        step()
        _synchronize(device)
        times.append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        watch.step(times[-1])
    return times


def throughput(samples_per_step: int, times: Iterable[float]) -> float:
    """Samples per second from the median step time (robust to a noisy neighbour)."""
    return samples_per_step / statistics.median(list(times))


def scaling_efficiency(ranks: list[int], per_second: list[float]) -> list[float]:
    """Throughput with k ranks over k times the throughput with the fewest ranks (1.0 = perfect)."""
    k0, t0 = ranks[0], per_second[0]
    return [t / (t0 * k / k0) for k, t in zip(ranks, per_second)]


def plot_scaling(ranks: list[int], per_second: list[float], unit: str = "images/s", title: str = ""):
    """Two panels: measured throughput against ideal linear scaling, and scaling efficiency."""
    import matplotlib.pyplot as plt

    eff = scaling_efficiency(ranks, per_second)
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.2))
    ideal = [per_second[0] * k / ranks[0] for k in ranks]
    a.plot(ranks, ideal, "--", color="grey", label="ideal (linear)")
    a.plot(ranks, per_second, "o-", label="measured")
    a.set(xlabel="ranks", ylabel=unit, title="throughput", xticks=ranks)
    a.legend()
    b.bar([str(k) for k in ranks], eff, color="tab:green")
    b.axhline(1.0, ls="--", color="grey")
    for i, e in enumerate(eff):
        b.text(i, e, f"{e:.2f}", ha="center", va="bottom")
    b.set(xlabel="ranks", ylabel="efficiency", title="scaling efficiency", ylim=(0, 1.15))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
