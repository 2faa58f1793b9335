"""Checks for lesson 11's first exercise: one ZeRO-1 step (optimizer state sharded) with mpi4py.

    def zero1_step(comm, params, grad, momentum, lr, beta):
        # params (n,): the whole model, flat, identical on every rank. grad (n,): this rank's
        # gradient (its own part of the batch). momentum (n,): SGD's momentum buffer, of which this
        # rank holds only its shard, elements torch.tensor_split(torch.arange(n), p)[rank] (the
        # first n % p ranks get one more); the other entries are NaN, as if they lived elsewhere.
        # Average the gradients over the ranks, but only for your shard (a reduce-scatter);
        # update your shard: momentum = beta * momentum + g; params -= lr * momentum;
        # then give every rank every updated shard (an all-gather).
        # Return (params, momentum): the whole updated model, and the momentum buffer (yours updated).

Compared on every rank, 1–4 ranks, with SGD with momentum run on the whole model on one device,
sizes divisible and not divisible by the rank count, and fewer elements than ranks. The momentum
outside a rank's shard is NaN, so a rank that updates the whole model shows; so does a shard cut
differently, or weights that were never gathered. Every rank's gradient and shard are drawn with
the check's nonce, and the kernel counts what reaches each rank (the others' updated shards at
least): a step taken from gradients shared through files, or drawn again, scores nothing.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points
from hpdl.checker.cases.column_parallel_linear import rows_of as shard_of  # tensor_split's cut

SIGNATURE = "zero1_step(comm, params, grad, momentum, lr, beta) -> (params, momentum)"
RANKS = (1, 2, 3, 4)
TIMEOUT = 30.0  # the first case of a job pays for importing torch
PRIVATE_INPUTS = True  # each rank gets its own gradient and shard as data: no rank can draw the others'
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): the others' shards need them
# an all-reduce hands every rank the whole averaged gradient: data parallelism's step, whatever is done after it.
# What reaches a rank tells it only in the large case; refused, it is refused in every case (where it scored 18/18
# from a learner who all-reduced wherever n was small)
FORBIDDEN = {name: "ZeRO-1 reduce-scatters the gradients, so each rank averages its own shard only (Reduce_scatter, "
                   "or a Reduce per shard): an all-reduce is data parallelism's step"
             for name in ("Allreduce", "allreduce", "Iallreduce", "Allreduce_init")}
# a Reduce or a Bcast of more than a shard is WRONG in verify (_beyond_a_shard): a Reduce to one rank and a Bcast
# of the whole make an all-reduce too (18/18 where n was small); one Bcast per shard, from its owner, is an all-gather
REDUCES = ("Reduce", "reduce", "Ireduce", "Reduce_init")
BCASTS = ("Bcast", "bcast", "Ibcast", "Bcast_init")
# and gathering or scattering through one rank (a parameter server's step: every gradient and the whole
# optimizer state at rank 0) is refused outright; no ZeRO-1 step needs it (18/18 once)
FORBIDDEN.update({name: "ZeRO-1 reduce-scatters the gradients and all-gathers the weights: no rank gathers the others' "
                        "gradients or optimizer state, or scatters them"
                  for name in hooks.COLLECTIVES if name.lower().lstrip("i").startswith(("gather", "scatter"))})
# what a collective call carries (the recorder's count: its send buffer; a reduce-scatter's, what this rank
# receives; an all-gather in place, this rank's part) is at most a shard, but for an all-to-all
ALL_TO_ALL = ("Alltoall", "Alltoallv", "Alltoallw", "alltoall", "Ialltoall", "Ialltoallv", "Ialltoallw",
              "Alltoall_init")
# held to a shard for each rank together instead, and a value more each (a whole gradient tiled to every rank
# by one Alltoall: 18/18)
WHOLE_ALLOWED = ("Alltoall", "Alltoallv", "Alltoallw", "alltoall", "Ialltoall", "Ialltoallv", "Ialltoallw",
                 "Alltoall_init", "Reduce_scatter", "Ireduce_scatter", "Reduce_scatter_block", "Ireduce_scatter_block",
                 "Reduce_scatter_init", "Reduce_scatter_block_init")  # a reduce-scatter: by what a rank gets (:mine)


def cases(size):
    slow = 1e6
    points = one_rank_points(size)  # on one rank, code with nothing distributed in it is right
    return [
        Case("n = 12", {"n": 12, "seed": 1}, slow_factor=slow, points=points),
        Case("n = 10: not divisible by 3 or 4", {"n": 10, "seed": 2}, slow_factor=slow, points=points),
        Case("n = 1001", {"n": 1001, "seed": 3}, slow_factor=slow, points=points),
        Case("n = 3: fewer elements than ranks", {"n": 3, "seed": 4}, hidden=True, slow_factor=slow, points=points),
        Case("n = 4099", {"n": 4099, "seed": 5}, hidden=True, slow_factor=slow, points=points),
        Case(f"n = {LARGE}: what reaches a rank tells the algorithm", {"n": LARGE, "seed": 6}, hidden=True,
             slow_factor=slow, points=points, witness=True),
    ]


LARGE = 1 << 18  # values: a reduce-scatter and an all-gather of them (2(p-1)/p·n·4 bytes) far above the wire's noise
TELLS = 1.25  # an all-reduce (2(p-1)/p·n) and then an all-gather take 3(p-1)/p·n: 1.5× what ZeRO-1 needs
# (measured with MPICH at 2 and 4 ranks: 1.50× and 1.50×; the kit's solution and p Reduces then an all-gather
# 1.0×; at 3 ranks the Reduces take 1.75× and an all-reduce 2.0×, too close to tell, so 3 ranks are not judged).
# Held against what the least-loaded rank received: an all-reduce loads every rank alike, but p pickled
# comm.reduce calls (mpi4py reduces at rank 0, then forwards to the root) load rank 0 with 1.50× at 2 ranks and
# 1.84× at 4 (ranks 1 and 2: 1.34×), the least-loaded rank 1.00× and 0.67×


def _problem(params, size):
    """The whole problem, the same on every rank: weights, every rank's gradient, the momentum."""
    import torch

    g = torch.Generator().manual_seed(nonce_seed(params))
    n = params["n"]
    weights = torch.randn(n, generator=g)
    grads = torch.randn(size, n, generator=g)
    momentum = torch.randn(n, generator=g)     # not zero: as after a few steps
    return weights, grads, momentum


def inputs(case, rank, size):
    """params, this rank's grad, the momentum (NaN outside this rank's shard), lr, beta."""
    import torch

    weights, grads, momentum = _problem(case.params, size)
    lo, hi = shard_of(rank, size, case.params["n"])
    mine = torch.full_like(momentum, float("nan"))
    mine[lo:hi] = momentum[lo:hi]
    return weights, grads[rank].clone(), mine, 0.1, 0.9


def reference(comm, params, grad, momentum, lr, beta):
    """SGD with momentum on the whole model, on one device, from every rank's gradient and shard."""
    rank, size = comm.Get_rank(), comm.Get_size()
    n = params.numel()
    g = np.mean(comm.allgather(grad.numpy()), axis=0, dtype=np.float64).astype(np.float32)
    m = np.concatenate(comm.allgather(momentum.numpy()[slice(*shard_of(rank, size, n))]))
    m = beta * m + g
    new_params = (params.numpy() - lr * m).astype(np.float32)
    lo, hi = shard_of(rank, size, n)
    new_momentum = np.full(n, np.nan, dtype=np.float32)
    new_momentum[lo:hi] = m[lo:hi]
    return new_params, new_momentum


def model_solution(comm, params, grad, momentum, lr, beta):
    """The model solution: Reduce_scatter the gradient, update the shard, Allgatherv the weights."""
    import torch
    from mpi4py import MPI

    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [len(part) for part in torch.tensor_split(torch.arange(params.numel()), size)]
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]
    g = torch.empty(sizes[rank])
    comm.Reduce_scatter(grad.numpy(), g.numpy(), recvcounts=sizes, op=MPI.SUM)
    g /= size
    m = momentum[lo:hi]
    m.mul_(beta).add_(g)
    shard = (params[lo:hi] - lr * m).contiguous()
    new = torch.empty_like(params)
    comm.Allgatherv(shard.numpy(), [new.numpy(), sizes])
    return new, momentum


_NAMES = ("params", "momentum")


def verify(case, ctx):
    n, p = case.params["n"], ctx.size
    large = n >= LARGE and p > 1
    least = _least_received(ctx) if large else None  # collective: on every rank, before any early return
    # at 3 ranks p Reduces along trees take 1.75× what ZeRO-1 needs, an all-reduce 2.0×: too close, so there a rank
    # that reduced by Reduce calls is not judged by its bytes (one with a Reduce_scatter, 1.0×, is: an all-reduce
    # by MPI's address beside it scored 6/6 at 3 ranks)
    tells = large and (p & (p - 1) == 0 or not any(c.name in REDUCES and (c.count or 0) > 0 for c in ctx.calls))
    everyone = hooks.gather_calls(ctx) if p > 1 and ctx.wire is not None else None  # and this one
    got = ctx.got
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        return Wrong(f"returned {hooks._describe(got)}; expected a tuple (params, momentum)")
    for name, g, e in zip(_NAMES, got, ctx.expected):
        w = hooks.compare(g, e, what=f"rank {ctx.rank}'s {name}", rtol=1e-5, atol=1e-6)
        if w is not None:
            return w
    lo, hi = shard_of(ctx.rank, p, n)
    return (_beyond_a_shard(ctx, n) or _gathered_once(ctx, n)
            or hooks.received_at_least(ctx, (n - (hi - lo)) * 4, "the other ranks' updated shards")
            or _moved_by_its_calls(ctx, n, everyone) or _another_algorithm(ctx, n, least if tells else None))


def _moved_by_its_calls(ctx, n: int, everyone: list[list] | None) -> Wrong | None:
    """WRONG (forged: no case counts) when this rank's recorded calls could not have brought what its right step
    needs from the other ranks: its shard's sum over their gradients (a reduce-scatter's share, at the least) and
    their updated shards. MPI's all-reduce called at its address in its library, beside a recorded all-gather,
    scored 6/6 at 3 ranks, where the bytes on the wire are too close to tell (_another_algorithm). Counted by the
    recorder's counts, generously (hooks.brought_by_collectives), and by what the other ranks' recorded sends to
    this rank carried (a reduce-scatter by hand)."""
    if everyone is None:  # one rank, or unmetered: no send's bytes noted
        return None
    # its shard's sum (a share from each other rank) and their updated shards: n values; float32 sends
    moved = hooks.brought_by_collectives(ctx.calls, ctx.size) + hooks.brought_by_sends(everyone, ctx.rank, 4)
    return hooks.brought_too_little(ctx, moved, n, "its right step (its shard's sum of their gradients, and their "
                                                    "updated shards) needs")


# what each kind of collective call says when it carries more than a shard (the recorder's count): (message, hint)
_BEYOND_A_SHARD = {
    "reduce": ("reduced {count} values in one comm.{name}: the whole gradient summed at one rank; ZeRO-1 reduces each "
               "shard (at most {shard} values here) to its owner",
               "Reduce_scatter (or one Reduce per shard, to the rank that owns it): no rank holds the whole averaged "
               "gradient."),
    "bcast": ("took part in a comm.{name} of {count} values: ZeRO-1 broadcasts no more than a shard (at most {shard} "
              "values here), from its owner",
              "every rank holds the same weights already: the all-gather moves each updated shard from its owner "
              "(Allgatherv, or one Bcast per shard); a Bcast of the whole vector moves what the others have (after a "
              "Reduce of the gradient, it makes an all-reduce)."),
    "other": ("took part in a comm.{name} of {count} values: in ZeRO-1 each rank contributes or receives no more than "
              "its shard (at most {shard} values here)",
              "Reduce_scatter with tensor_split's counts (each rank gets its own shard), then Allgatherv of the "
              "updated shards: nothing else moves whole vectors."),
}


def _kind(name: str) -> str | None:
    """Which rule of _BEYOND_A_SHARD a recorded call falls under; None: not held against a shard."""
    if name in REDUCES:
        return "reduce"
    if name in BCASTS:
        return "bcast"
    mine = name.endswith(":mine")  # what this rank received of a reduce-scatter (recording._SCATTERS_TO_EACH)
    return "other" if (mine or name in hooks.COLLECTIVES) and name not in WHOLE_ALLOWED else None


def _beyond_a_shard(ctx, n: int) -> Wrong | None:
    """In every case, by the recorder's counts: no collective call carries more than a shard of this rank's own
    (a Reduce or a Bcast of the whole gradient: an all-reduce, or the whole at one rank); and no more values in
    point-to-point messages than a reduce-scatter and an all-gather by hand send (each (p-1) shards): an
    all-reduce by hand sends half as much again."""
    p = ctx.size
    shard = -(-n // p)  # the largest
    for c in _counted(ctx.calls):
        kind = _kind(c.name) if c.dest is None else None
        if kind is not None and isinstance(c.count, int) and c.count > shard:
            message, hint = _BEYOND_A_SHARD[kind]
            return Wrong(f"rank {ctx.rank} " + message.format(count=c.count, name=c.name, shard=shard), hint=hint)
        called = c.name.split(":")[0]  # an all-to-all's send, or what this rank got of it (":mine")
        if called in ALL_TO_ALL and isinstance(c.count, int) and c.count > p * (shard + 1):
            return Wrong(f"rank {ctx.rank} took part in a comm.{called} of {c.count} values: an "
                         f"all-to-all that reduce-scatters sends each rank its shard, {p} × {shard} values at most",
                         hint="a whole gradient to every rank (np.tile) is data parallelism's traffic: send rank q "
                              "only the part of your gradient that q owns, or use Reduce_scatter.")
    sent = sum(sum(values) for values in hooks.values_sent(ctx).values())
    if p > 1 and sent > 2 * (p - 1) * shard + METADATA * 4 * p:
        return Wrong(f"rank {ctx.rank} sent {sent} values in point-to-point messages; a reduce-scatter and an "
                     f"all-gather send {2 * (p - 1)} shards of at most {shard}",
                     hint="ZeRO-1 reduce-scatters the gradients (each rank sums its own shard only), then all-gathers "
                          "the updated weights: all-reducing the gradient first moves half as much again.")
    return None


METADATA = 16  # values a call may carry beside a shard: a shape, a length
BOUNDS_GATHERS = 2  # pickled all-gathers of a value or two each that are a rank's bounds or count, not weights


def _counted(calls: list) -> list:
    """The calls the shard counts hold, less the first BOUNDS_GATHERS pickled all-gathers of at most two values:
    comm.allgather((lo, hi)) tells every rank where each shard starts and ends (two values a rank, more than a
    shard of n = 3 and beyond the all-gathered model's count: 6/18)."""
    out, left = [], BOUNDS_GATHERS
    for c in calls:
        if left and c.name == "allgather" and isinstance(c.count, int) and c.count <= 2:
            left -= 1
            continue
        out.append(c)
    return out


def _gathered_once(ctx, n: int) -> Wrong | None:
    """What every rank ends up with from the all-gathers and broadcasts, by the recorder's counts: one model's
    worth, the updated shards (an all-gather's count is this rank's part, p of them; a broadcast's, all of it),
    and a value or two a rank beside them (a length). Each call held to a shard, the averaged gradient's shards
    all-gathered and then the momentum's, every rank stepping the whole model, scored 18/18."""
    p = ctx.size
    counted = [c for c in _counted(ctx.calls) if c.dest is None and isinstance(c.count, int)]
    parts = sum(c.count for c in counted if c.name in hooks.ALL_GATHERS)
    whole = sum(c.count for c in counted if c.name in hooks.BROADCASTS)
    if p < 2 or p * parts + whole <= n + 2 * p:
        return None
    return Wrong(f"rank {ctx.rank}'s all-gathers and broadcasts hand every rank about {p * parts + whole} values; the "
                 f"updated shards are {n}: ZeRO-1 all-gathers the updated weights once",
                 hint="after the reduce-scatter each rank updates its own shard of the weights and its own momentum, "
                      "then one Allgatherv of the updated weight shards: gathering the averaged gradient or the "
                      "momentum as well makes every rank hold the whole optimizer step, data parallelism's.")


def _least_received(ctx) -> int | None:
    """The fewest bytes any rank received in this case, by the kernel's count; None where the wire was not read.
    Collective on ctx.comm: every rank calls it, or the others wait."""
    every = ctx.comm.allgather(hooks._received(ctx))
    return None if None in every else min(every)


def _another_algorithm(ctx, n: int, least: int | None) -> Wrong | None:
    """WRONG (telling: no case of the check counts) when every rank received more than ZeRO-1's traffic allows.
    Every rank, not any: data parallelism's all-reduce loads each rank alike, while an honest reduce-scatter
    may load some ranks more than others (mpi4py's pickled comm.reduce reduces along a tree to rank 0 and then
    forwards to the root: rank 0 receives about a shard more per owner) and still leave one under the bound."""
    p = ctx.size
    bound = int(TELLS * max(2 * (p - 1) / p * n * 4, _brought(ctx))) + 65536
    if least is None or least <= bound:
        return None
    w = hooks.received_at_most(ctx, bound, "a reduce-scatter of the gradients and an all-gather of the updated shards",
                               hint="ZeRO-1 reduce-scatters the gradients (each rank gets the average of its own "
                                    "shard only), never all-reduces or gathers them whole: that is plain data "
                                    "parallelism's traffic, and its optimizer state on every rank.")
    if w is not None:
        w.message += f" (and every rank received {least} bytes or more)"
        w.telling = True
    return w


# bytes a value of a pickled all-gather may take: a Python float in a list (shard.tolist()), 9; a float64 array's 8.
# At 4 (float32's), right code gathering either scored 0/18: over the large case's bound, which voids every case
PICKLED_VALUE = 9


def _brought(ctx) -> int:
    """Bytes this rank's recorded reduce-scatters and all-gathers bring it (each call already held to a shard by
    _beyond_a_shard): a shard's worth from each other rank, in the dtype the call sent. A reduce-scatter of a
    float64 copy, right, moves twice the bytes ZeRO-1 needs in float32, and scored 0/18; so did a pickled all-gather
    of the shard as a list or in float64. Sized by what a rank receives, never by a send buffer, which could claim
    room for traffic no call accounts for."""
    p = ctx.size
    total = 0
    for c in ctx.calls:
        gets = c.name.endswith(":mine") or c.name in hooks.ALL_GATHERS
        if not gets or not isinstance(c.count, int) or c.count <= 0:
            continue
        sized = isinstance(c.nbytes, int) and c.nbytes > 0
        if c.name[:1].isupper():
            each = min(8, c.nbytes // c.count) if sized else 4  # a value: a float64's at most (a derived type of
            #                                                     n floats, count 1, bought room for an all-reduce)
        else:  # a pickle's bytes a value, its header aside, at most a list's (float64, a Python float's 9, a numpy
            #    scalar's 19: recording._framing)
            most = PICKLED_VALUE if not isinstance(c.exact, int) else c.exact + 8  # numpy scalars' framing beside
            each = min(most, max(4, (c.nbytes - hooks.PICKLE_SLACK) // c.count)) if sized else 4
        total += (p - 1) * c.count * each
    return total


def diagnose(case, ctx):
    got = ctx.got
    if not isinstance(got, (list, tuple)) or len(got) != 2:
        return "return two tensors: the whole updated params and the momentum buffer."
    params, momentum = (hooks._as_array(g) for g in got)
    n, p, r = case.params["n"], ctx.size, ctx.rank
    lo, hi = shard_of(r, p, n)
    if params is None or params.shape != (n,):
        return f"params must be the whole model: {n} values."
    if momentum is not None and momentum.shape == (n,) and not np.isnan(np.delete(momentum, range(lo, hi))).all():
        return (f"the momentum outside your shard (elements {lo}..{hi - 1}) is not this rank's: ZeRO-1 keeps each "
                "rank's shard of the optimizer state only, so leave the other entries as they came (NaN) and gather "
                "the weights, not the momentum.")
    if np.isnan(params).any():
        if any(c.name in ("Allreduce", "allreduce") for c in ctx.calls):
            return ("NaN in the weights: every rank updated the whole model, with momentum it does not hold (NaN). "
                    "In ZeRO-1 a rank updates only its shard — reduce-scatter the gradients, not all-reduce.")
        return (f"NaN in the weights: you used momentum entries this rank does not hold. Rank {r} of {p} holds "
                f"elements {lo}..{hi - 1} of {n} (torch.tensor_split(torch.arange(n), p)[rank]: the first n % p ranks "
                "get one more) — an even split (n // p each, the rest on the last rank) is off by one, and "
                "torch.chunk's (⌈n/p⌉ each, fewer on the last) cuts elsewhere.")
    start = ctx.args[0].numpy()
    others = np.ones(n, dtype=bool)
    others[lo:hi] = False
    if p > 1 and others.any() and np.array_equal(params[others], start[others]):
        return ("only your own shard of the weights changed: after updating it, all-gather the shards "
                "(comm.Allgatherv with every rank's count) so that every rank has the whole new model.")
    return None
