"""Checks for ring_allreduce(comm, x) -> the elementwise sum of x over all ranks, on every rank.

The ring: cut x into p chunks; p-1 steps of reduce-scatter (pass a chunk to the right, add
the one from the left), then p-1 steps of allgather (pass the finished chunks around). Only
point-to-point messages between ring neighbours, 2(p-1) chunks per rank, each at most one chunk
(⌈n/p⌉ values, or n//p + n%p where the last chunk takes the remainder; sent in segments if you
like): passing the whole vector around the ring is not the ring algorithm.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Wrong
from hpdl.checker.cases._sums import (chunk_bounds, compare_sum, diagnose_sum, explain_sums, leave_x_alone,
                                      received_enough, sum_cases, vector)

SIGNATURE = "ring_allreduce(comm, x: np.ndarray) -> np.ndarray"
RANKS = (1, 2, 3, 4)
TIMEOUT = 5.0
PRIVATE_INPUTS = True  # each rank gets only its own inputs: the others' come by message or not at all
METERED = True  # the bytes each rank sends are counted outside its process (meter.py), against the recorder
FORBIDDEN = {
    name: "the ring allreduce is to be built from point-to-point messages (Send/Recv/Sendrecv), "
          "not from MPI's own collectives"
    for name in hooks.DATA_COLLECTIVES
}


def cases(size: int):
    return sum_cases(size)


def inputs(case, rank: int, size: int) -> tuple:
    return (vector(case, rank, size),)


def call(fn, comm, args):
    return leave_x_alone(fn, comm, args)


def reference(comm, x: np.ndarray) -> np.ndarray:
    """The model solution: reduce-scatter then allgather around the ring."""
    p, r = comm.Get_size(), comm.Get_rank()
    x = np.array(x, copy=True)
    bounds = chunk_bounds(len(x), p)

    def chunk(i: int) -> np.ndarray:
        i %= p
        return x[bounds[i]:bounds[i + 1]]

    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):  # reduce-scatter: after it, rank r owns the full sum of chunk r+1
        incoming = np.empty_like(chunk(r - step - 1))
        comm.Sendrecv(chunk(r - step), dest=right, recvbuf=incoming, source=left)
        chunk(r - step - 1)[:] += incoming
    for step in range(p - 1):  # allgather: pass the finished chunks around
        comm.Sendrecv(chunk(r - step + 1), dest=right, recvbuf=chunk(r - step), source=left)
    return x


def verify(case, ctx):
    p, r = ctx.size, ctx.rank
    wrong = compare_sum(ctx.got, ctx.expected)
    everyone_right = all(ctx.comm.allgather(wrong is None))  # collective: on every rank, first
    vectors = hooks.vectors_to_read(ctx)  # and this one
    # the recorded calls against the bytes the kernel saw this rank send; what they carried against the ranks' sums
    forged = hooks.wire_agrees(ctx) or hooks.passed_on(ctx, vectors, "a ring", apart=case_n(ctx) // p)
    if forged is not None:
        return forged
    if wrong is not None or not everyone_right:
        return wrong  # values first: "only rank 0 has the sum" says more than the message pattern
    return (hooks.only_peers(ctx, {(r + 1) % p, (r - 1) % p}, "a ring passes chunks only between neighbours")
            or chunked(ctx) or received_enough(ctx))


def chunked(ctx):
    """The ring algorithm, not just a ring: one chunk of x per message (a chunk in segments too), 2(p-1)
    chunks in all. A chunk is at most n//p + n%p values (the last one taking the remainder; ⌈n/p⌉ with even
    cuts), and the 2(p-1) chunks a rank passes on are all of x but one chunk, twice (ring_budget).
    Counted in values moved (hooks.values_sent), not messages. With n < p the last chunk is all of x:
    there the ring moves what passing x around does, and only longer cases tell them apart. x padded to p
    chunks of ⌈n/p⌉ passes on 2(p-1) of them, its padding too: where that comes to 2n or more (n < p, n = 9
    at 4 ranks) a chain passing x twice in chunk-sized messages fits it as well, and fails the long cases. A
    header of one value a step (the coming chunk's length) is allowed (without it: 2/27)."""
    p, n, r = ctx.size, case_n(ctx), ctx.rank
    widest = n // p + n % p
    moved = [v for messages in hooks.values_sent(ctx).values() for v in messages]
    largest = max(moved, default=0)
    if largest > widest:
        return Wrong(f"rank {r} sent a message of {largest} values (of x's dtype, {ctx.expected.dtype}); the ring "
                     f"sends one chunk per message, at most {widest} values when x has {n} and there are {p} ranks",
                     hint="cut x into p chunks and pass one chunk per step (reduce-scatter, then allgather); "
                          "passing the whole vector around costs p times the bandwidth.")
    budget = ring_allowance(n, p)
    if largest <= -(-n // p):  # x padded to p chunks of ⌈n/p⌉: 2(p-1) full chunks, however short x is
        budget = max(budget, 2 * (p - 1) * -(-n // p))
    # a message of one value a step beside the chunk: its length sent ahead of it (where chunks are one value too,
    # x is too short for any count to tell a ring from passing x around)
    budget += min(2 * (p - 1), sum(1 for v in moved if v == 1))
    if sum(moved) > budget:
        return Wrong(f"rank {r} sent {sum(moved)} values in {len(moved)} messages; the ring's 2(p-1) = {2 * (p - 1)} "
                     f"steps pass on one chunk each, at most {budget} values",
                     hint="p-1 steps of reduce-scatter, then p-1 steps of allgather: one chunk (one Sendrecv) per "
                          "step.")
    return None


def ring_budget(n: int, p: int) -> int:
    """The most values one rank passes on in the ring's 2(p-1) steps: all of x but one chunk in each
    phase (two chunks next to each other in the ring's order), for the cut that makes that most, of
    the two the docstring allows: even cuts (n//p each, the last one taking the remainder) or ⌈n/p⌉
    each (the last ones shorter, or empty: n = 13 at 4 ranks cuts 4, 4, 4, 1 and a rank may pass on
    all but the 1 and a 4)."""
    s = -(-n // p)
    ceil = [max(0, min(s, n - i * s)) for i in range(p)]
    return max(2 * (n - n // p), 2 * n - min(ceil[i] + ceil[(i + 1) % p] for i in range(p)))


def ring_allowance(n: int, p: int) -> int:
    """What a rank may pass on: one ring's budget, or two rings' over the halves of x, each going its own way
    round (NCCL's bidirectional ring: each half cut in p, the rounding of the two cuts came to one value over
    one ring's budget at n = 3 and 9 on 3 ranks, and a right algorithm scored 25/27)."""
    return max(ring_budget(n, p), ring_budget(-(-n // 2), p) + ring_budget(n // 2, p))


def case_n(ctx) -> int:
    return int(ctx.case.params["n"])


diagnose = diagnose_sum
explain = explain_sums
HINT_ONLY_ROOT = ("only rank 0 ends with the full sum: after the reduce-scatter, the allgather phase must "
                  "pass the finished chunks around so every rank returns the whole result.")
