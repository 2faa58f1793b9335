"""Checks for average_gradients(comm, grads) -> the gradients averaged over all ranks.

What a data-parallel step does after backward(): every rank holds its own gradients; after
an Allreduce (sum) and a division by the number of ranks, every rank holds the average.
Using MPI's Allreduce is the point here; returning the same list updated in place is fine.
Each rank's gradients are drawn with the check's nonce, and the kernel counts what reaches each
rank: an average read from files the ranks share, or from gradients drawn again, scores nothing.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, one_rank_points

SIGNATURE = "average_gradients(comm, grads: list[np.ndarray]) -> list[np.ndarray]"
RANKS = (1, 2, 3, 4)
TIMEOUT = 5.0
PRIVATE_INPUTS = True  # each rank gets its own gradients as data: no rank can draw the others'
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): an average needs them
# the exercise is the all-reduce: every other collective that moves data is refused (an allgather of every rank's
# gradients and a mean of them scored 12/12)
_ALL_REDUCE = ("Allreduce", "allreduce", "Iallreduce", "Allreduce_init")
MORE = 1.5  # times the gradients' values the all-reduces may carry (a flag or two beside them: +4)
FORBIDDEN = {name: "this exercise averages with an all-reduce (comm.Allreduce, then a division): each rank needs "
                   "the sum, not every rank's gradients"
             for name in hooks.DATA_COLLECTIVES if name not in _ALL_REDUCE}
# and every message by hand: the average gathered to one rank by Send and sent back, beside an all-reduce of
# zeros as large as the gradients for the count, scored 12/12
FORBIDDEN.update({name: "this exercise averages with an all-reduce (comm.Allreduce, then a division): messages "
                        "by hand (Send, Recv) are another algorithm" for name in hooks.SENDS})

_SHAPES = {
    "small model": ([(4, 3), (3,), (2, 2, 2)], "float32"),
    "one large gradient": ([(100_000,)], "float32"),
    "float64": ([(5,), (3, 3)], "float64"),
    # float32 first, then float64 ones: one flat buffer in the first gradient's dtype rounds the rest (12/12 once)
    "many tensors": ([(i + 1,) for i in range(12)], ["float32", "float64"] * 6),
}


def cases(size: int) -> list[Case]:
    points = one_rank_points(size)  # on one rank the gradients are their own average
    return [
        Case("small model (3 float32 gradients)", {"shapes": "small model", "seed": 1}, points=points),
        Case("one gradient of 100000 float32", {"shapes": "one large gradient", "seed": 2}, points=points),
        Case("2 float64 gradients", {"shapes": "float64", "seed": 3}, points=points),
        # float64 as well: a float32 wire for float64 gradients fails half the graded cases, not a quarter (9/12)
        Case("12 gradients, float32 and float64", {"shapes": "many tensors", "seed": 4}, hidden=True, points=points),
    ]


def inputs(case, rank: int, size: int) -> tuple:
    shapes, dtype = _SHAPES[case.params["shapes"]]
    dtypes = dtype if isinstance(dtype, list) else [dtype] * len(shapes)
    rng = np.random.default_rng([case.params.get("nonce", 0), 100 * case.params["seed"] + rank])
    return ([rng.standard_normal(s).astype(d) for s, d in zip(shapes, dtypes)],)


def reference(comm, grads):
    """The model solution: sum in place across ranks, then divide by their number."""
    from mpi4py import MPI

    for g in grads:
        comm.Allreduce(MPI.IN_PLACE, g, op=MPI.SUM)
        g /= comm.Get_size()
    return grads


def verify(case, ctx):
    wrong = hooks.compare(ctx.got, ctx.expected, what="gradients")
    if wrong is not None:
        return wrong
    nbytes = sum(np.asarray(g).nbytes for g in ctx.args[0])
    return hooks.received_for_allreduce(ctx, nbytes, "an average of every rank's gradients") or _all_reduced(ctx)


def _all_reduced(ctx) -> Wrong | None:
    """The all-reduces carry the gradients' values: all of them (an average gathered to one rank by Send and
    sent back scored 12/12), and not p times them (each rank's gradients in a slot of their own in a buffer p
    times as large, summed: an allgather in an all-reduce's clothes, 12/12)."""
    if ctx.size < 2:
        return None
    values = sum(np.asarray(g).size for g in ctx.args[0])
    counts = [c.count for c in ctx.calls if c.name in _ALL_REDUCE]
    if not all(isinstance(n, int) for n in counts):
        return None
    carried = sum(counts)
    if carried < values:
        return Wrong(f"rank {ctx.rank}'s all-reduces carried {carried} values; its gradients hold {values}: "
                     "some of the average came another way than an all-reduce",
                     hint="sum every gradient with comm.Allreduce (in place, or into a new array), then divide "
                          "by comm.Get_size(): that is the exercise.")
    if carried > MORE * values + 4:
        return Wrong(f"rank {ctx.rank}'s all-reduces carried {carried} values for gradients of {values}: "
                     f"{carried / values:.1f} times what an average needs",
                     hint="all-reduce the gradients themselves (each rank's own, summed), not a buffer with a "
                          "slot for every rank: that moves every rank's gradients, an allgather.")
    return None


def diagnose(case, ctx) -> str | None:
    got, expected, (mine,) = ctx.got, ctx.expected, ctx.args
    p = ctx.size
    if got is None:
        return "the function returned None: return the list of averaged gradients."
    if not isinstance(got, (list, tuple)) or len(got) != len(expected):
        return None
    try:
        g = [np.asarray(a, dtype=np.float64) for a in got]
        e = [np.asarray(a, dtype=np.float64) for a in expected]
        own = [np.asarray(a, dtype=np.float64) for a in mine]
        if any(a.shape != b.shape for a, b in zip(g, e)):
            return None
        # on one rank the sum is the average: whatever is wrong there, it is not the division
        if p > 1 and all(np.allclose(a, b * p, rtol=1e-4, atol=1e-5) for a, b in zip(g, e)):
            return "looks summed but not averaged: divide by comm.Get_size() after the Allreduce."
        if p > 1 and all(np.allclose(a * p, b, rtol=1e-4, atol=1e-5) for a, b in zip(g, e)):
            return "looks divided by the number of ranks twice (or averaged before summing and again after)."
        if p > 1 and all(np.allclose(a, b) for a, b in zip(g, own)):
            return "these are this rank's own gradients, unchanged: nothing was exchanged with the other ranks."
        if any(np.asarray(a).dtype == np.float64 for a in expected) and \
                all(np.allclose(a, b, rtol=1e-6, atol=1e-7) for a, b in zip(g, e)):
            return ("right to float32 precision only: these float64 gradients went through float32 on the way (a "
                    "float32 buffer: torch's default dtype, or the first gradient's); keep each gradient's own dtype "
                    "on the wire.")
    except (TypeError, ValueError):
        return None
    return None
