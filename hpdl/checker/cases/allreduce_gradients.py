"""Checks for lesson 05's second exercise: average the gradients with ONE all-reduce.

    def allreduce_gradients(comm, model) -> None:
        # after loss.backward(): replace every p.grad by its average over all ranks, using one
        # all-reduce of one flat buffer (torch.distributed or comm), not one per tensor

Each rank holds the same model and a different batch; `call()` runs forward and backward, then
the learner's function, and reads back every p.grad. Checked: the gradients equal the average
over the ranks (so the optimizer step is the same everywhere), and exactly one all-reduce was
launched, however many tensors the model has: as the learner's process recorded it, and as the
kernel counted the messages between the ranks (their data segments, on torch.distributed's
connections and on MPI's, over what one all-reduce of the same size took on the same ranks before
the learner's code ran: an MPI picks its algorithm by size). More on the wire, where the recording
holds one all-reduce and nothing else, voids the check. Each rank's batch is drawn with the
check's nonce and the kernel counts what reaches each rank: an average of gradients read from files
the ranks share, with one tiny all-reduce for the count, scores nothing.
"""
from __future__ import annotations

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points
from hpdl.checker.cases import _dp

SIGNATURE = "allreduce_gradients(comm, model) -> None   # p.grad := average over ranks, one all-reduce"
# torch's coalesced all-reduce flattens, all-reduces once and unflattens: the exercise, done for the learner (8/8)
_COALESCED = ("this exercise asks you to flatten the gradients into one buffer yourself, all-reduce it once and copy "
              "the averages back: torch's coalesced all-reduce does all three for you")
# one all-reduce (or the collectives one is made of: a reduce-scatter and an all-gather, a Reduce and a Bcast) and
# no messages by hand: the gradients sent to one rank and back by Send and Recv, beside a torch all-reduce of zeros
# as large as the gradients for the count, scored 8/8 (an Allgather of them so: _shares_only)
_BY_HAND = ("this exercise averages the gradients with one all-reduce of one flat buffer (dist.all_reduce or "
            "comm.Allreduce): messages by hand are another algorithm")
FORBIDDEN = {**hooks.TORCH_DATA_PARALLEL,
             **{name: _COALESCED for name in ("torch.distributed.all_reduce_coalesced",
                                              "torch.distributed.distributed_c10d.all_reduce_coalesced",
                                              "ProcessGroup.allreduce_coalesced")},
             **{name: _BY_HAND for name in hooks.SENDS}}
RANKS = (1, 2, 3)
TIMEOUT = 30.0  # the first case of a job pays for importing torch and joining the process group
PRIVATE_INPUTS = True  # each rank gets its own batch as data: no rank can draw the others'
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): an average needs them
# all-reduces a case's messages may amount to (hooks.allreduces_on_wire): one, and room
MAX_ON_WIRE = 1.5

# At least 16 tensors in each: an MPI all-reduce of a small tensor takes about as many messages as a barrier,
# and the kernel's count allows one all-reduce with a barrier on either side, and half of one more. One
# all-reduce per tensor hidden from the recording amounts to 2 or more of those from 16 tensors on under
# MPICH, Open MPI and Intel MPI (from 8 under MPICH alone).
_MODELS = {
    "mlp": (64,) + (32,) * 7 + (10,),
    "deep": (64, 48, 40, 32, 28, 24, 20, 16, 12, 10),
    "wide": (64, 64, 48, 48, 32, 32, 16, 16, 10),
    "deeper": (32,) + (24,) * 10 + (10,),
}


def cases(size):
    slow = 1e6  # tiny tensors: timing says nothing here
    points = one_rank_points(size)  # on one rank p.grad is its own average: doing nothing is right
    return [
        Case("MLP of 8 layers (16 tensors)", {"model": "mlp", "batch": 8, "seed": 1}, slow_factor=slow,
             points=points),
        Case("MLP of 9 layers (18 tensors)", {"model": "deep", "batch": 5, "seed": 2}, slow_factor=slow, points=points),
        Case("MLP of 8 layers, one sample per rank", {"model": "wide", "batch": 1, "seed": 3}, hidden=True,
             slow_factor=slow, points=points),
        Case("MLP of 11 layers (22 tensors)", {"model": "deeper", "batch": 4, "seed": 4}, hidden=True,
             slow_factor=slow, points=points),
    ]


def inputs(case, rank, size):
    """The model's name and seed (the same model on every rank), and this rank's own batch, as data."""
    widths = _MODELS[case.params["model"]]
    mine = {**case.params, "seed": 1000 * case.params["seed"] + rank}
    x, y = _dp.batch(case.params["batch"], widths[0], widths[-1], seed=nonce_seed(mine))
    return case.params["model"], case.params["seed"], x, y


def _model(name, seed):
    return _dp.mlp(_MODELS[name], seed=seed)


def _backward(model, x, y):
    import torch.nn.functional as F

    model.zero_grad()
    F.cross_entropy(model(x), y).backward()


def set_up():
    """The process group, before the meter's first reading: its connections are counted apart."""
    _dp.ensure_process_group()


def calibrate(comm, case):
    """One all-reduce each way of as many values as the case's model has, for the meter to count."""
    widths = _MODELS[case.params["model"]]
    _dp.calibrate(comm, sum(a * b + b for a, b in zip(widths[:-1], widths[1:])))


def call(fn, comm, args):
    _dp.ensure_process_group()
    name, seed, x, y = args
    model = _model(name, seed)
    _backward(model, x, y)
    own = _dp.grads(model)
    before, elements = _dp.launches(), _dp.launched_elements()
    returned = fn(comm, model)
    reduced = None if elements is None else _dp.launched_elements() - elements
    return {"grads": _dp.grads(model), "own": own, "launches": _dp.launches() - before,
            "returned": type(returned).__name__, "reduced": reduced}


def reference(comm, name, seed, x, y):
    from mpi4py import MPI

    _dp.ensure_process_group()
    model = _model(name, seed)
    _backward(model, x, y)
    own = _dp.grads(model)
    flat = __import__("numpy").concatenate([g.ravel() for g in own])
    comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
    flat /= comm.Get_size()
    grads, offset = [], 0
    for g in own:
        grads.append(flat[offset: offset + g.size].reshape(g.shape))
        offset += g.size
    return {"grads": grads, "own": own, "launches": 1}


_ONE = ("each all-reduce pays the full latency (α) once; for many small tensors that dominates. Concatenate all "
        "gradients into one flat buffer (torch.cat of p.grad.view(-1)), all-reduce it once, divide by the number of "
        "ranks, and copy the slices back.")


def verify(case, ctx):
    got, expected, size = ctx.got, ctx.expected, ctx.size
    err = _dp.close(got["grads"], expected["grads"], rtol=1e-5, atol=1e-7)
    if err is not None:
        return Wrong(f"after your function, p.grad is not the average over the {size} ranks "
                     f"(largest difference {err:.3g})", max_error=err)
    n, tensors = got["launches"], len(expected["grads"])
    if size > 1 and n > 1:
        return Wrong(f"{n} all-reduces for {tensors} gradient tensors; this exercise wants exactly one",
                     hint=_ONE)
    if size > 1 and n == 0:
        return Wrong("the gradients are right but no all-reduce was seen",
                     hint="use dist.all_reduce(flat) or comm.Allreduce(MPI.IN_PLACE, flat.numpy()) on one flat buffer.")
    on_wire = hooks.allreduces_on_wire(ctx)
    if on_wire is not None and on_wire > MAX_ON_WIRE:
        return _more_on_wire(on_wire, tensors, ctx.calls)
    nbytes = sum(g.nbytes for g in expected["own"])
    values, reduced = sum(g.size for g in expected["own"]), got.get("reduced")
    return hooks.received_for_allreduce(ctx, nbytes, "an average of every rank's gradients") or (
        Wrong(f"your all-reduce took {reduced} of the {values} gradient values; the rest reached the other ranks "
              "some other way (a gather, broadcasts)", hint=_ONE)
        if size > 1 and isinstance(reduced, int) and reduced < values else None) or _shares_only(ctx, values)


_TORCH_EVERY_PART = ("all_gather", "all_gather_into_tensor", "_all_gather_base")  # recorded by their output: p parts
_GATHERS = [n for n in hooks.COLLECTIVES if "ather" in n] + ["gather", "all_gather_single", *_TORCH_EVERY_PART]
_WHOLE = {"broadcasts": hooks.BROADCASTS,
          "all-to-alls": (*[n for n in hooks.COLLECTIVES if "lltoall" in n], "all_to_all", "all_to_all_single")}


def _shares_only(ctx, values: int) -> Wrong | None:
    """What the collectives besides the all-reduces carry, by the recorder's counts: an all-gather (or gather) no
    more than a reduce-scatter's share of the gradients from each rank, broadcasts and all-to-alls no more than the
    gradients once (a Reduce then a Bcast, a reduce-scatter by all-to-all). Every rank's whole gradients gathered
    and averaged, beside a torch all-reduce of zeros as large for the count, scored 8/8."""
    p, slack = ctx.size, 16
    counted = [c for c in ctx.calls if isinstance(c.count, int) and c.dest is None]
    parts = max((c.count // (p if c.name in _TORCH_EVERY_PART else 1) for c in counted if c.name in _GATHERS),
                default=0)
    if p > 1 and parts > -(-values // p) + slack:
        return Wrong(f"rank {ctx.rank} all-gathered {parts} values of its own, of {values} gradient values: every "
                     "rank's gradients gathered and averaged is an allgather, not the all-reduce", hint=_ONE)
    for what, names in _WHOLE.items():
        moved = sum(c.count for c in counted if c.name in names)
        if p > 1 and moved > values + slack:
            return Wrong(f"rank {ctx.rank}'s {what} carried {moved} values, of {values} gradient values: more than "
                         "the one all-reduce's worth", hint=_ONE)
    return None


def _more_on_wire(on_wire: float, tensors: int, calls) -> Wrong:
    """More all-reduces on the wire than one. Forged (no case counts) when the learner's process recorded
    its one all-reduce and no other call at all (torch.distributed's barriers included): nothing it
    reported accounts for the rest. Any other call recorded beside it (a barrier, a broadcast) makes
    the case WRONG, not the check void: a few barriers can read just over MAX_ON_WIRE."""
    seen = (f"the messages between the ranks, counted by the system outside your process, amount to about "
            f"{on_wire:.1f} all-reduces for {tensors} gradient tensors")
    if len(calls) <= 1:
        return Wrong(f"{seen}, while your process recorded one and nothing else", forged=True)
    return Wrong(f"{seen}; this exercise wants exactly one (a barrier or a broadcast beside it counts for a part "
                 "of one)", hint=_ONE)


def diagnose(case, ctx):
    got, expected, size = ctx.got, ctx.expected, ctx.size
    if size == 1:
        return None
    k = _dp.ratio_to(got["grads"], expected["grads"])
    if k is not None and abs(k - size) < 1e-3:
        return ("the gradients look summed, not averaged: divide by the number of ranks (comm.Get_size()) "
                "after the all-reduce.")
    if k is not None and abs(k - 1 / size) < 1e-3:
        return "the gradients look divided by the number of ranks twice."
    if _dp.close(got["grads"], got["own"], rtol=0, atol=0) is None:
        return ("p.grad still holds this rank's own gradients: write the averaged values back into p.grad "
                "(e.g. p.grad.copy_(slice.view_as(p.grad))), not into a temporary copy.")
    if k is not None and size == 2 and abs(k - 1.0) > 1e-3:
        return (f"the gradients are {k:.3g} times the average: check the division "
                "(use comm.Get_size(), not a fixed number).")
    return ("the values are not the average over ranks: use comm.Get_size() or dist.get_world_size() for the number "
            "of ranks (a global such as world_size from the notebook is fixed to the notebook's rank count).")
