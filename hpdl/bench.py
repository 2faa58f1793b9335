"""Collective micro-benchmarks on the ranks, OSU-style, and the α-β-γ fit.

Runs on the engines (or under plain `mpiexec`); imports nothing client-side. Every function
that takes `comm` must be called on all of its ranks, and returns the same result on each.

Timing follows the OSU Micro-Benchmarks: warm up, then for each iteration a barrier, the
clock, the operation, the clock. We report the median iteration (robust on a shared machine)
of the slowest rank (a collective is as late as its last rank). The number of iterations
adapts to the message size so that a sweep from 8 B to 64 MiB takes seconds, not minutes.

Results are plain dicts of lists, so they travel from engines to the notebook unchanged:
    {"name": "ring", "ranks": 4, "sizes": [8, 16, ...], "seconds": [2.1e-6, ...]}
"""
from __future__ import annotations

import time
from typing import Callable, Sequence

import numpy as np


def message_sizes(smallest: int = 8, largest: int = 64 << 20, step: int = 2) -> list[int]:
    """Message sizes in bytes: smallest, smallest·step, ... up to largest (OSU's -m MIN:MAX)."""
    if smallest < 1 or largest < smallest or step < 2:
        raise ValueError("need 1 ≤ smallest ≤ largest and step ≥ 2")
    out, n = [], smallest
    while n <= largest:
        out.append(n)
        n *= step
    return out


def timeit(fn: Callable[[], object], comm, *, warmup: int = 2, budget: float = 0.2,
           min_iters: int = 5, max_iters: int = 1000, iters: int | None = None) -> float:
    """Median seconds per call of `fn()` on the slowest rank; all ranks of `comm` call it.

    Without `iters`, the count is chosen from one timed call so the loop lasts about
    `budget` seconds (and the ranks agree on it).
    """
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    if iters is None:
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        once = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        iters = int(min(max_iters, max(min_iters, budget / max(once, 1e-7))))
    times = np.empty(iters)
    for i in range(iters):
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        times[i] = time.perf_counter() - t0
    return comm.allreduce(float(np.median(times)), op=MPI.MAX)


def sweep(fn: Callable, comm, sizes: Sequence[int] = (), *, name: str | None = None,
          dtype=np.float32, budget: float = 0.2, warmup: int = 2, progress: bool = False) -> dict:
    """Time `fn(comm, x)` for float arrays `x` of each size in bytes (at least one element).

    `fn` is anything with the learner's allreduce signature: a ring written by hand, or
    `lambda comm, x: comm.Allreduce(x, out)` with `out` of the right size.
    """
    sizes = list(sizes) or message_sizes()
    itemsize = np.dtype(dtype).itemsize
    rng = np.random.default_rng(comm.Get_rank())
    seconds, actual = [], []
    steps = sizes
    if progress and comm.Get_rank() == 0:
        from tqdm.auto import tqdm

        steps = tqdm(sizes, desc=name or getattr(fn, "__name__", "sweep"), leave=False)
    for nbytes in steps:
        count = max(1, nbytes // itemsize)
        x = rng.random(count).astype(dtype)
        seconds.append(timeit(lambda: fn(comm, x), comm, warmup=warmup, budget=budget))
        actual.append(count * itemsize)
    return {"name": name or getattr(fn, "__name__", "fn"), "ranks": comm.Get_size(), "sizes": actual,
            "seconds": seconds}


def library_allreduce() -> Callable:
    """MPI's own Allreduce with the (comm, x) -> result signature (receive buffer reused)."""
    from mpi4py import MPI

    buffers: dict = {}

    def allreduce(comm, x):
        out = buffers.get((x.shape, x.dtype))
        if out is None:
            out = buffers.setdefault((x.shape, x.dtype), np.empty_like(x))
        comm.Allreduce(x, out, op=MPI.SUM)
        return out

    allreduce.__name__ = "MPI Allreduce"
    return allreduce


COLLECTIVES = ("allreduce", "bcast", "reduce", "allgather", "reduce_scatter", "alltoall")


def library(collective: str = "allreduce") -> Callable:
    """MPI's own `collective` with the (comm, x) signature, for `sweep`; x is the whole message.

    Sizes follow nccl-tests, so bus bandwidth (`busbw`) compares across collectives: allreduce,
    bcast and reduce move x (root 0); allgather gathers x from p pieces of len(x)/p;
    reduce_scatter reduces x and leaves each rank len(x)/p; alltoall sends len(x)/p to each rank.
    Buffers are made once per size and reused, as OSU's benchmarks do.
    """
    from mpi4py import MPI

    if collective not in COLLECTIVES:
        raise ValueError(f"collective must be one of {COLLECTIVES}")
    if collective == "allreduce":
        return library_allreduce()
    buffers: dict = {}

    def run(comm, x):
        p = comm.Get_size()
        key = (x.shape, x.dtype, p)
        if key not in buffers:
            piece = max(1, x.size // p)
            send = x[:piece * p] if x.size >= piece * p else np.ones(piece * p, x.dtype)
            buffers[key] = (np.empty_like(x), send, np.empty(piece * p, x.dtype), np.empty(piece, x.dtype), piece)
        out, send, whole, part, piece = buffers[key]
        if collective == "bcast":
            comm.Bcast(x, root=0)
            return x
        if collective == "reduce":
            comm.Reduce(x, out, op=MPI.SUM, root=0)
            return out
        if collective == "allgather":
            comm.Allgather(send[:piece], whole)
            return whole
        if collective == "reduce_scatter":
            comm.Reduce_scatter_block(send, part, op=MPI.SUM)
            return part
        comm.Alltoall(send, whole)
        return whole

    run.__name__ = f"MPI {collective}"
    return run


def pingpong(comm, sizes: Sequence[int] = (), *, budget: float = 0.1) -> dict:
    """One-way time of a message of each size between ranks 0 and 1 (half a round trip).

    Other ranks wait quietly; every rank returns the result. This is the α + nβ of the model.
    """
    from mpi4py import MPI

    sizes = list(sizes) or message_sizes(8, 16 << 20, 4)
    pair = first_ranks(comm, 2)
    result = None
    if pair != MPI.COMM_NULL:
        me = pair.Get_rank()
        seconds = []
        for nbytes in sizes:
            buf = np.zeros(max(1, nbytes), np.uint8)

            def round_trip():
                if me == 0:
                    pair.Send(buf, dest=1, tag=7)
                    pair.Recv(buf, source=1, tag=7)
                else:
                    pair.Recv(buf, source=0, tag=7)
                    pair.Send(buf, dest=0, tag=7)

            seconds.append(timeit(round_trip, pair, budget=budget) / 2)
        result = {"name": "ping-pong (one way)", "ranks": 2, "sizes": list(sizes), "seconds": seconds}
        pair.Free()
    idle_wait(comm)
    return comm.bcast(result, root=0)


def local_reduce(sizes: Sequence[int] = (), *, dtype=np.float32, repeats: int = 5) -> dict:
    """Seconds to add one array of each size into another on this core (the γ of the model)."""
    sizes = list(sizes) or message_sizes(8, 16 << 20, 4)
    itemsize = np.dtype(dtype).itemsize
    seconds = []
    for nbytes in sizes:
        a = np.ones(max(1, nbytes // itemsize), dtype)
        b = np.ones_like(a)
        np.add(a, b, out=a)
        iters = max(3, min(1000, (64 << 20) // max(nbytes, 1) // 8))
        best = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            for _ in range(iters):
                np.add(a, b, out=a)
            best.append((time.perf_counter() - t0) / iters)
        seconds.append(float(np.median(best)))
    return {"name": "local add", "ranks": 1, "sizes": [max(1, n // itemsize) * itemsize for n in sizes],
            "seconds": seconds}


def memcpy_bandwidth(nbytes: int = 64 << 20, repeats: int = 7) -> float:
    """Bytes per second of a large memory copy on one core (np.copyto), the best of `repeats`.

    The ceiling for anything that moves data between ranks of one machine through memory.
    """
    src = np.ones(nbytes, np.uint8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return nbytes / best


def fit_line(sizes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """(intercept, slope) of seconds ≈ intercept + slope·size, both ≥ 0.

    Fitted on relative error, so the microsecond points at small sizes count as much as the
    milliseconds at large ones.
    """
    n = np.asarray(sizes, float)
    t = np.asarray(seconds, float)
    if len(n) < 2 or len(n) != len(t):
        raise ValueError("need at least two (size, seconds) pairs of equal length")
    w = 1.0 / t
    A = np.stack([np.ones_like(n), n], axis=1) * w[:, None]
    (a, b), *_ = np.linalg.lstsq(A, t * w, rcond=None)
    if a < 0:  # no negative latency: refit the slope alone
        a, b = 0.0, float(np.sum(n * t * w * w) / np.sum(n * n * w * w))
    if b < 0:
        a, b = float(np.median(t)), 0.0
    return float(a), float(b)


def fit_alpha_beta_gamma(pingpong_result: dict, reduce_result: dict) -> dict[str, float]:
    """α (s per message) and β (s per byte) from a ping-pong, γ (s per byte) from a local add."""
    alpha, beta = fit_line(pingpong_result["sizes"], pingpong_result["seconds"])
    _, gamma = fit_line(reduce_result["sizes"], reduce_result["seconds"])
    return {"alpha": alpha, "beta": beta, "gamma": gamma}


def fit_allreduce(sweep_result: dict, reduce_result: dict) -> dict[str, float]:
    """α and β of lesson 04's ring model fitted to a measured all-reduce on p ≥ 2 ranks
    (a `sweep` of `library("allreduce")`), γ from a local add (`local_reduce`):
    seconds ≈ 2(p−1)·α + (2(p−1)/p·β + (p−1)/p·γ)·n.

    Why not the ping-pong's: a ping-pong times one message between two otherwise idle ranks,
    while an all-reduce's messages take turns with additions that evict them from the caches,
    and go through the library's own algorithm. Fitted on the collective itself (over the sizes
    that matter, e.g. around a model's gradient), α and β predict that collective — the
    per-algorithm calibration of lesson 07."""
    p = int(sweep_result["ranks"])
    if p < 2:
        raise ValueError("an all-reduce sweep on one rank says nothing about α and β: use 2 or more ranks")
    a, b = fit_line(sweep_result["sizes"], sweep_result["seconds"])
    _, gamma = fit_line(reduce_result["sizes"], reduce_result["seconds"])
    share = (p - 1) / p
    return {"alpha": a / (2 * (p - 1)), "beta": max(0.0, (b - share * gamma) / (2 * share)), "gamma": gamma}


_BUS_FACTOR = {
    "allreduce": lambda p: 2 * (p - 1) / p,
    "allgather": lambda p: (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "alltoall": lambda p: (p - 1) / p,
    "broadcast": lambda p: 1.0,
    "bcast": lambda p: 1.0,
    "reduce": lambda p: 1.0,
}


def algbw(sizes: Sequence[float], seconds: Sequence[float]) -> np.ndarray:
    """Algorithm bandwidth: message bytes over time (bytes/s)."""
    return np.asarray(sizes, float) / np.asarray(seconds, float)


def busbw(sizes: Sequence[float], seconds: Sequence[float], ranks: int, collective: str = "allreduce") -> np.ndarray:
    """Bus bandwidth (nccl-tests): algbw times the share of the data each rank must move,
    so it is comparable across rank counts and to the links' speed."""
    if collective not in _BUS_FACTOR:
        raise ValueError(f"collective must be one of {sorted(_BUS_FACTOR)}")
    return algbw(sizes, seconds) * _BUS_FACTOR[collective](ranks)


def first_ranks(comm, k: int):
    """A communicator of ranks 0..k-1 of `comm` (MPI.COMM_NULL on the others). Collective."""
    from mpi4py import MPI

    if not 1 <= k <= comm.Get_size():
        raise ValueError(f"k={k} must be between 1 and {comm.Get_size()}")
    inside = comm.Get_rank() < k
    return comm.Split(0 if inside else MPI.UNDEFINED, comm.Get_rank())


def idle_wait(comm, poll: float = 0.0005) -> None:
    """A barrier that sleeps while it waits, so idle ranks leave the cores to busy ones."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(poll)


def scaling(fn: Callable, comm, nbytes: int, ranks: Sequence[int] | None = None, *,
            name: str | None = None, dtype=np.float32, budget: float = 0.3, repeats: int = 1) -> dict:
    """Time `fn(sub, x)` on the first k ranks for each k in `ranks`, others waiting quietly.

    With `repeats` > 1 each point is the best of that many timings: on a shared machine a
    burst of someone else's work then spoils one timing, not the curve.
    Returns {"name", "ranks": [k...], "nbytes", "seconds": [...]} on every rank.
    """
    from mpi4py import MPI

    ranks = list(ranks or range(2, comm.Get_size() + 1))
    itemsize = np.dtype(dtype).itemsize
    x = np.random.default_rng(comm.Get_rank()).random(max(1, nbytes // itemsize)).astype(dtype)
    seconds = []
    for k in ranks:
        sub = first_ranks(comm, k)
        t = None
        if sub != MPI.COMM_NULL:
            t = min(timeit(lambda: fn(sub, x), sub, budget=budget) for _ in range(max(1, repeats)))
            sub.Free()
        idle_wait(comm)
        seconds.append(comm.bcast(t, root=0))
    return {"name": name or getattr(fn, "__name__", "fn"), "ranks": ranks, "nbytes": nbytes, "seconds": seconds}
