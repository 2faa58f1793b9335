"""Shared rank-side helpers for the data-parallel exercises (lessons 05 and 06).

The check jobs start as plain MPI ranks; these exercises also need torch.distributed (and
Horovod for 06), started here on first use. They also count the all-reduces a learner
launches, whether through torch.distributed or through the mpi4py communicator handed in,
so a case can tell "one all-reduce after backward" from "one per tensor", and "launched while
backward ran" from "all sent afterwards". Nothing here is imported on the client side.
"""
from __future__ import annotations

from typing import Callable

# MPI calls on the learner's communicator that all-reduce data (a Reduce is one when a Bcast
# follows: counted too, so Reduce+Bcast per tensor is as many all-reduces as tensors)
MPI_REDUCES = {"Allreduce", "allreduce", "Iallreduce", "Allreduce_init", "Reduce_scatter",
               "Reduce_scatter_block", "Ireduce_scatter", "Ireduce_scatter_block", "Reduce", "reduce", "Ireduce",
               "Reduce_init"}
TORCH_REDUCES = ("all_reduce", "all_reduce_coalesced", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                 "_reduce_scatter_base")  # a reduce-scatter (then an all-gather) is an all-reduce too


def _unrecorded():
    """The checker's own MPI use in a learner's process (the rendezvous) is not the learner's."""
    import contextlib

    recording = __import__("sys").modules.get("hpdl.checker.recording")
    if recording is None or not recording.recorder.installed:
        return contextlib.nullcontext()
    return recording.paused()


def ensure_process_group() -> None:
    """torch.distributed over Gloo for this job's ranks (rendezvous over MPI); once per process."""
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    if not dist.is_initialized():
        from hpdl.rank import init_torch_distributed

        world = MPI.COMM_WORLD
        torch.set_num_threads(1)
        with _unrecorded():
            init_torch_distributed(world.Get_rank(), world.Get_size(), torch.device("cpu"), timeout_s=60)
    _install_counter()


def calibrate(comm, values: int) -> None:
    """One all-reduce of `values` float32 through torch.distributed, then one through MPI, before any
    learner's code: the meter reads how many messages each took here (hooks.allreduces_on_wire),
    whatever this torch's Gloo or this MPI does for one of that size (an MPI picks its algorithm by it).
    Each is the costliest honest one, with a barrier on either side, which a learner may well write and
    which costs as much as an all-reduce of a small tensor; MPI's is mpi4py's pickled allreduce (its own
    reduce and broadcast, on a communicator mpi4py duplicates at its first use: `comm` is as fresh as
    the learner's)."""
    import numpy as np
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    dist.barrier()
    all_reduce(torch.ones(values))
    dist.barrier()
    comm.Barrier()
    comm.allreduce(np.ones(values, np.float32), op=MPI.SUM)
    comm.Barrier()


def ensure_horovod() -> None:
    """Horovod on this job's ranks (MPI controller); once per process."""
    import horovod.torch as hvd

    if not hvd.is_initialized():
        with _unrecorded():
            hvd.init()


class _Counter:
    def __init__(self) -> None:
        self.torch_calls = 0
        self.original = None


counter = _Counter()


def _install_counter() -> None:
    """Wrap torch.distributed.all_reduce so calls are counted (the learner's and anyone's)."""
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    if counter.original is not None:
        return
    counter.original = c10d.all_reduce

    def all_reduce(*args, **kwargs):
        counter.torch_calls += 1
        return counter.original(*args, **kwargs)

    all_reduce.__wrapped__ = counter.original
    dist.all_reduce = all_reduce
    c10d.all_reduce = all_reduce


def all_reduce(tensor, async_op: bool = False):
    """The uncounted torch all-reduce, for reference solutions."""
    import torch.distributed.distributed_c10d as c10d

    fn = counter.original or c10d.all_reduce
    return fn(tensor, async_op=async_op)


def launches() -> int:
    """All-reduces launched so far through torch.distributed or MPI (on the learner's ranks,
    as recording.py noted them, however the learner reached them)."""
    import sys

    recording = sys.modules.get("hpdl.checker.recording")
    if recording is not None and recording.recorder.torch_hooked:
        calls = recording.recorder.calls
        return sum(1 for c in calls if c.name in MPI_REDUCES or c.name in TORCH_REDUCES)
    calls = recording.recorder.calls if recording is not None else []
    return counter.torch_calls + sum(1 for c in calls if c.name in MPI_REDUCES)


ALLREDUCES = {"Allreduce", "allreduce", "Iallreduce", "Allreduce_init", "all_reduce"}  # one call, the whole sum


def calls_so_far() -> int | None:
    """How many calls the recorder has noted on this learner's rank (None outside a learner's check job)."""
    import sys

    recording = sys.modules.get("hpdl.checker.recording")
    if recording is None or not recording.recorder.torch_hooked:
        return None
    return len(recording.recorder.calls)


def reductions_since(start: int | None) -> list[tuple[str, int | None]] | None:
    """Each reduction noted since call `start` (calls_so_far()), in order: its name and elements."""
    import sys

    recording = sys.modules.get("hpdl.checker.recording")
    if start is None or recording is None:
        return None
    names = {*MPI_REDUCES, *TORCH_REDUCES}
    return [(c.name, c.count) for c in recording.recorder.calls[start:] if c.name in names]


def launched_elements(mpi: bool = True) -> int | None:
    """Elements all-reduced so far through torch.distributed, and MPI unless `mpi` is False (as recording.py
    noted them); None outside a learner's check job (the reference's own all-reduces are not recorded)."""
    import sys

    recording = sys.modules.get("hpdl.checker.recording")
    if recording is None or not recording.recorder.torch_hooked:
        return None
    names = {*TORCH_REDUCES, *(MPI_REDUCES if mpi else ())}
    return sum(c.count or 0 for c in recording.recorder.calls if c.name in names)


def _in_backward(x, then: Callable[[], None]):
    """x, unchanged; once backward reaches it, then() runs there: by then backward has made the gradients of
    every layer after this point (torch runs a parameter's gradient accumulation, and its hooks, as soon as it
    can) and none before."""
    import torch

    class At(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, grad):
            then()
            return grad

    return At.apply(x)


def read_wire_in_backward(x, tag: str):
    """x; once backward reaches it, the rank waits there for the checker's reading of the wire
    (cases.read_wire_here)."""
    from hpdl.checker.cases import read_wire_here

    return _in_backward(x, lambda: read_wire_here(tag))


def passed_in_backward(x, tag: str):
    """x; once backward reaches it, the rank tells the checker so and goes on (cases.passed_here)."""
    from hpdl.checker.cases import passed_here

    return _in_backward(x, lambda: passed_here(tag))


def params(model) -> list:
    return [p.detach().cpu().numpy().copy() for p in model.parameters()]


def grads(model) -> list:
    import numpy as np

    return [np.zeros(p.shape, dtype=np.float32) if p.grad is None else p.grad.detach().cpu().numpy().copy()
            for p in model.parameters()]


def mlp(widths, seed: int):
    """A small MLP seeded per rank (different seeds: a missing broadcast shows)."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    layers = [nn.Flatten()]
    for a, b in zip(widths[:-1], widths[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def batch(n: int, features: int, classes: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, features, generator=g), torch.randint(0, classes, (n,), generator=g)


def close(a, b, rtol=1e-4, atol=1e-6) -> float | None:
    """None when the lists of arrays match; else the largest difference."""
    import numpy as np

    worst = 0.0
    for x, y in zip(a, b):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        if x.shape != y.shape:
            return float("inf")
        err = np.abs(x - y)
        if (err > atol + rtol * np.abs(y)).any():
            worst = max(worst, float(err.max()))
    return worst or None


def ratio_to(a, b) -> float | None:
    """The single factor k with a ≈ k·b over all arrays (None when there is none)."""
    import numpy as np

    x = np.concatenate([np.asarray(v, np.float64).ravel() for v in a])
    y = np.concatenate([np.asarray(v, np.float64).ravel() for v in b])
    if x.shape != y.shape or not np.any(y):
        return None
    k = float(np.dot(x, y) / np.dot(y, y))
    return k if np.allclose(x, k * y, rtol=1e-3, atol=1e-6) else None
