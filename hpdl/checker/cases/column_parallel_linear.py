"""Checks for lesson 10's second exercise: a column-parallel Linear (Megatron style), forward and backward.

    def column_parallel_linear(comm, x, weight, bias, grad_y):
        # The layer y = x @ weight.T + bias, with its OUTPUT features (rows of weight) split
        # over the ranks: rank r holds rows torch.tensor_split(torch.arange(out), p)[r] (the
        # first out % p ranks get one row more). weight and bias have the full layer's shape,
        # but only this rank's rows are filled; the others are NaN, as if they lived elsewhere.
        # x (B, in): the same input on every rank; grad_y (B, out): dLoss/dy, the same on every rank.
        # Return (y, grad_x, grad_weight, grad_bias):
        #   y (B, out): the whole output, this rank's columns gathered with everyone else's;
        #   grad_x (B, in): dLoss/dx, which needs every rank's rows (an all-reduce);
        #   grad_weight (rows, in), grad_bias (rows,): the gradients of this rank's rows only.

Compared on every rank, 1–4 ranks, with torch.nn.Linear's forward and autograd backward on
the full layer, including widths not divisible by the number of ranks and a layer with fewer
output features than ranks. A rank that uses rows it does not hold gets NaN, so computing the
whole layer locally, or splitting the rows differently, shows.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points

SIGNATURE = "column_parallel_linear(comm, x, weight, bias, grad_y) -> (y, grad_x, grad_weight, grad_bias)"
RANKS = (1, 2, 3, 4)
PRIVATE_INPUTS = True  # each rank gets its own rows as data: with the check's nonce no rank can draw the others'
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): gathered weights show
TIMEOUT = 30.0  # the first case of a job pays for importing torch
# the layer's two collectives: y's columns gathered, grad_x all-reduced. Messages by hand are refused: grad_x's
# parts sent to every rank by Sendrecv and summed there (an allgather where the layer needs an all-reduce)
# scored 15/15, counted by the collectives alone
FORBIDDEN = {name: "this exercise builds the layer from MPI's collectives (gather y's columns, all-reduce grad_x): "
                   "messages by hand (Send, Recv, Sendrecv) are refused here" for name in hooks.SENDS}


def cases(size):
    slow, points = 1e6, one_rank_points(size)  # on one rank the whole layer is the rank's: nothing to reduce
    return [
        # every layer but the one with fewer outputs than ranks has far more weight than activations (out·fan_in
        # at least TELLING_WEIGHT, the batch small): a rank that gathers the weight shows on the wire in each.
        # With small layers it hid among the activations, and a learner gathering the weight wherever the layer
        # was small, and honest in the one large layer, scored 15/15
        Case("Linear(48, 1024), batch 4", {"batch": 4, "fan_in": 48, "out": 1024, "seed": 1}, slow_factor=slow,
             points=points),
        Case("Linear(72, 511), batch 3: 511 not divisible by 2, 3 or 4", {"batch": 3, "fan_in": 72, "out": 511,
                                                                          "seed": 2}, slow_factor=slow, points=points),
        Case("Linear(96, 382), batch 2", {"batch": 2, "fan_in": 96, "out": 382, "seed": 3}, slow_factor=slow,
             points=points),
        Case("Linear(3, 3), batch 5: fewer outputs than ranks", {"batch": 5, "fan_in": 3, "out": 3, "seed": 4},
             hidden=True, slow_factor=slow, points=points),
        Case("Linear(64, 512), batch 2: far more weight than activations",
             {"batch": 2, "fan_in": 64, "out": 512, "seed": 5}, slow_factor=slow, points=points),
    ]


def rows_of(rank: int, size: int, out: int) -> tuple[int, int]:
    """This rank's rows [lo, hi), as torch.tensor_split cuts range(out) into `size` parts."""
    base, extra = divmod(out, size)
    lo = rank * base + min(rank, extra)
    return lo, lo + base + (1 if rank < extra else 0)


def _full(params):
    import torch

    g = torch.Generator().manual_seed(nonce_seed(params))
    layer = torch.nn.Linear(params["fan_in"], params["out"])
    with torch.no_grad():
        layer.weight.copy_(torch.randn(params["out"], params["fan_in"], generator=g))
        layer.bias.copy_(torch.randn(params["out"], generator=g))
    x = torch.randn(params["batch"], params["fan_in"], generator=g)
    grad_y = torch.randn(params["batch"], params["out"], generator=g)
    return layer, x, grad_y


def inputs(case, rank, size):
    """x, this rank's view of the weight and bias (others' rows NaN), grad_y; all float32 tensors."""
    import torch

    layer, x, grad_y = _full(case.params)
    lo, hi = rows_of(rank, size, case.params["out"])
    weight = torch.full_like(layer.weight, float("nan"))
    bias = torch.full_like(layer.bias, float("nan"))
    weight[lo:hi], bias[lo:hi] = layer.weight.detach()[lo:hi], layer.bias.detach()[lo:hi]
    return x, weight, bias, grad_y


def call(fn, comm, args):
    got = fn(comm, *args)
    if isinstance(got, (list, tuple)) and len(got) == 4:
        return tuple(hooks._as_array(g) if hooks._as_array(g) is not None else g for g in got)
    return got


def reference(comm, x, weight, bias, grad_y):
    """torch.nn.Linear on the whole layer (rebuilt from the case's seed), autograd for the backward."""
    import torch

    size, rank = comm.Get_size(), comm.Get_rank()
    out = weight.shape[0]
    # every rank's rows, put together: the single-device layer
    w = np.concatenate(comm.allgather(weight.numpy()[slice(*rows_of(rank, size, out))]))
    b = np.concatenate(comm.allgather(bias.numpy()[slice(*rows_of(rank, size, out))]))
    layer = torch.nn.Linear(weight.shape[1], out)
    with torch.no_grad():
        layer.weight.copy_(torch.from_numpy(w))
        layer.bias.copy_(torch.from_numpy(b))
    x = x.clone().requires_grad_()
    y = layer(x)
    y.backward(grad_y)
    lo, hi = rows_of(rank, size, out)
    return (y.detach().numpy(), x.grad.numpy(), layer.weight.grad[lo:hi].numpy(), layer.bias.grad[lo:hi].numpy())


def model_solution(comm, x, weight, bias, grad_y):
    """The model solution with mpi4py: gather the columns forward, all-reduce grad_x backward."""
    import torch
    from mpi4py import MPI

    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(part) for part in comm.allgather((x @ w.T + b).numpy())], dim=1)
    g = grad_y[:, lo:hi]
    grad_x = g @ w
    comm.Allreduce(MPI.IN_PLACE, grad_x.numpy(), op=MPI.SUM)
    return y, grad_x, g.T @ x, g.sum(0)


_NAMES = ("y", "grad_x", "grad_weight", "grad_bias")


def verify(case, ctx):
    got, expected = ctx.got, ctx.expected
    if not isinstance(got, (list, tuple)) or len(got) != 4:
        return Wrong(f"returned {hooks._describe(got)}; expected a tuple (y, grad_x, grad_weight, grad_bias)")
    for name, g, e in zip(_NAMES, got, expected):
        w = hooks.compare(g, e, what=f"rank {ctx.rank}'s {name}", rtol=1e-4, atol=_atol(e))
        if w is not None:
            return w
    w = hooks.received_at_most(
        ctx, wire_budget(case.params, ctx.size), "a column-parallel layer (the other ranks' columns of y, and grad_x "
        "all-reduced)", hint="each rank keeps its own rows of the weight: gather the outputs (y) and all-reduce "
                             "grad_x, never the weight itself, which is what tensor parallelism keeps apart.")
    if w is not None and case.params["out"] * case.params["fan_in"] >= TELLING_WEIGHT:
        w.telling = True  # the weight gathered shows here; in the small cases it hides among the activations
    return w or _moved_by_its_calls(case, ctx) or _grad_x_not_gathered(case, ctx)


def _moved_by_its_calls(case, ctx) -> Wrong | None:
    """WRONG (forged: no case counts) when this rank's recorded collectives could not have brought what its right
    results need from the other ranks: their columns of y, and grad_x's sum (a reduce-scatter's share from each,
    at the least). MPI's collectives called at their address in its library have no Python name to record:
    every value all-gathered so (15/15 with no call recorded), or grad_x's parts gathered so and summed here
    beside y's recorded all-gather (15/15)."""
    p = ctx.size
    if p < 2 or ctx.wire is None:  # unmetered: the calls' sizes were not noted
        return None
    batch, fan_in, out = case.params["batch"], case.params["fan_in"], case.params["out"]
    lo, hi = rows_of(ctx.rank, p, out)
    needed = batch * (out - (hi - lo)) + batch * fan_in * (p - 1) // p
    moved = hooks.brought_by_collectives(ctx.calls, p, part_slack=batch)  # another rank's part: a row more
    return hooks.brought_too_little(ctx, moved, needed, "its right y and grad_x need")


_GATHERS = hooks.ALL_GATHERS  # every rank receives every rank's part
_TO_ALL = [name for name in hooks.COLLECTIVES if "lltoall" in name]  # a block for each rank: the same, tiled
_GATHERED = {*_GATHERS, *_TO_ALL}
BESIDE_Y = 8  # small numbers an allgather may carry beside y's columns: a shape, each rank's width


def _grad_x_not_gathered(case, ctx) -> Wrong | None:
    """What a rank all-gathers is its columns of y, not its part of grad_x too: every rank's parts gathered
    and summed here give the right grad_x, by an allgather (p - 1 parts received by every rank) where the layer
    needs an all-reduce (15/15 once: grad_x's parts are small beside y, so the bytes could not tell; and by an
    all-to-all of the part tiled for every rank, 15/15 too)."""
    if ctx.size < 2:
        return None
    batch, out = case.params["batch"], case.params["out"]
    counts = [c.count if c.name in _GATHERS else c.count // ctx.size for c in ctx.calls
              if c.name in _GATHERED and isinstance(c.count, int)]  # an all-to-all's: one rank's block
    columns = batch * -(-out // ctx.size)  # this rank's columns of y, padded to the widest rank's
    # and its share of a reduce-scatter (grad_x all-reduced as a reduce-scatter, then an all-gather of the
    # reduced shares: right, and 3/15 when that all-gather counted as grad_x's raw parts gathered)
    reduced = sum(c.count for c in ctx.calls if c.name.endswith(":mine") and isinstance(c.count, int))
    if sum(counts) <= columns + reduced + BESIDE_Y:
        return None
    return Wrong(f"rank {ctx.rank} all-gathered {sum(counts)} values; its columns of y are at most {columns}: "
                 "grad_x's parts gathered from every rank and summed here is an allgather, not the all-reduce "
                 "the layer's backward needs",
                 hint="all-reduce grad_x (comm.Allreduce(MPI.IN_PLACE, grad_x.numpy(), op=MPI.SUM)): an "
                      "allgather makes every rank receive p - 1 parts, an all-reduce about two whatever p is.")


TELLING_WEIGHT = 1 << 15  # values of weight from which gathering it shows on the wire beyond doubt


def _atol(expected) -> float:
    """Sums of hundreds of float32 products, taken in another order (each rank's part, then the
    all-reduce), differ by a small fraction of the array's largest values, not of each value: a value
    near zero carries the rounding of the large terms that cancel in it. (A fixed 1e-5 once failed a
    right solution: 0.0491247 for 0.0491078 in a grad_x whose values reach a few units.)"""
    e = hooks._as_array(expected)
    scale = float(np.max(np.abs(e))) if e is not None and e.size else 0.0
    return max(1e-5, 1e-4 * scale)


def wire_budget(params: dict, size: int) -> int:
    """Bytes a rank may receive in this case, with room: the other ranks' columns of y (any allgather,
    pickled or not, or y zero-padded and all-reduced, in float64 too: 0/10 when it was held to float32),
    grad_x all-reduced by any algorithm (⌈lg p⌉ rounds of the whole), and MPI's own messages. Gathering
    the weight instead moves (p-1)/p of out × fan_in floats: still more in every case of TELLING_WEIGHT
    (the least, Linear(48, 1024) on 2 ranks: 100 KB against 89 KB)."""
    batch, fan_in, out = params["batch"], params["fan_in"], params["out"]
    rounds = max(1, (size - 1).bit_length())
    return 2 * batch * out * 8 + 4 * rounds * batch * fan_in * 4 + 4096 * (size - 1) + hooks.WIRE_SLACK


def diagnose(case, ctx):
    got, expected = ctx.got, ctx.expected
    if not isinstance(got, (list, tuple)) or len(got) != 4:
        return "return four tensors: y, grad_x, grad_weight, grad_bias."
    arrays = [hooks._as_array(g) for g in got]
    out, p, r = case.params["out"], ctx.size, ctx.rank
    lo, hi = rows_of(r, p, out)
    if any(a is not None and np.isnan(a).any() for a in arrays):
        return (f"NaN in your results: you used rows of the weight this rank does not hold. Rank {r} of {p} holds rows "
                f"{lo}..{hi - 1} of {out} (torch.tensor_split(torch.arange(out), p)[rank]: the first out % p ranks get "
                f"one more) — an even split (out // p each) drops the last out % p rows, and torch.chunk's (⌈out/p⌉ "
                f"each, fewer on the last) cuts them elsewhere.")
    y, grad_x = arrays[0], arrays[1]
    if y is not None and y.ndim == 2 and y.shape[1] < out:
        return (f"y has {y.shape[1]} of {out} columns: the split dropped some. With {out} outputs on {p} ranks the "
                f"shards are uneven (torch.tensor_split), so gather shards of different widths (comm.allgather).")
    if grad_x is not None and grad_x.shape == expected[1].shape:
        x, weight, _, grad_y = ctx.args
        partial = (grad_y[:, lo:hi] @ weight[lo:hi]).numpy()
        if p > 1 and np.allclose(grad_x, partial, rtol=1e-4, atol=1e-5):
            return ("grad_x is only this rank's part, grad_y[:, rows] @ weight[rows]: x feeds every rank's rows, "
                    "so its gradient is the SUM of all ranks' parts — all-reduce it (Megatron's f: identity forward, "
                    "all-reduce backward).")
        if p > 1 and np.allclose(grad_x * p, expected[1], rtol=1e-4, atol=1e-5):
            return ("grad_x is the all-reduced sum divided by the number of ranks: here the ranks' parts are pieces "
                    "of one gradient, not copies of it to average (as data parallelism's are), so keep the sum.")
    return None
