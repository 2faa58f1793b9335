"""Checks for lesson 05's third exercise: a minimal DDP — buckets all-reduced while backward runs.

    def overlap_allreduce(comm, model, bucket_mb) -> finish:
        # like DDP's constructor: broadcast rank 0's parameters; group the parameters, in reverse
        # order, into buckets of at most bucket_mb MiB (a larger tensor gets a bucket of its own);
        # register hooks that start a bucket's asynchronous all-reduce as soon as backward has
        # produced all of its gradients. Return finish(): wait for them, average, put the
        # results back into p.grad, and get ready for the next step.

`call()` builds it on a model whose initial parameters differ per rank, then trains three steps
on different data per rank (zero_grad, backward, finish(), SGD step), counting all-reduces
launched during backward and in total. Checked: parameters broadcast at the start; after
every finish() the gradients are the average over ranks; parameters identical everywhere; all
buckets but at most one all-reduced while backward ran (counted in values, not calls); no more
all-reduces than buckets. Each rank's initial parameters and batches are drawn with the check's
nonce, and the kernel counts what reaches each rank: gradients averaged through files the ranks
share, behind a recording changed to show all-reduces during backward, score nothing.
"""
from __future__ import annotations

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points
from hpdl.checker.cases import _dp

SIGNATURE = "overlap_allreduce(comm, model, bucket_mb) -> finish   # finish() after each backward"
RANKS = (1, 2, 3)
TIMEOUT = 30.0
PRIVATE_INPUTS = True  # each rank gets its own initial parameters and batches as data: no rank can draw the others'
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): averages need them
SELF_REPORTED = "when the all-reduces ran, during backward or after, as the recorder noted it"
WIDTHS = (64, 48, 32, 24, 16, 10)  # 10 tensors, 24 KiB of gradients
STEPS = 3
LR = 0.1


def cases(size):
    kw = {"slow_factor": 1e6, "points": one_rank_points(size)}  # on one rank a finish() doing nothing is right
    return [
        Case("5-layer MLP, buckets of 0.004 MiB (several buckets)", {"bucket_mb": 0.004, "seed": 1}, **kw),
        Case("5-layer MLP, buckets of 25 MiB (one bucket)", {"bucket_mb": 25.0, "seed": 2}, **kw),
        Case("5-layer MLP, buckets of 1e-6 MiB (one tensor each)", {"bucket_mb": 1e-6, "seed": 3}, **kw),
        Case("5-layer MLP, buckets of 0.01 MiB", {"bucket_mb": 0.01, "seed": 4}, hidden=True, **kw),
    ]


def inputs(case, rank, size):
    """This rank's own initial parameters (they differ on every rank) and batches, as data."""
    def seeded(seed):
        return nonce_seed({**case.params, "seed": seed})

    seed = case.params["seed"]
    model = _dp.mlp(WIDTHS, seed=seeded(100 * seed + rank))
    batches = [_dp.batch(6, WIDTHS[0], WIDTHS[-1], seed=seeded(10_000 * seed + 100 * step + rank))
               for step in range(STEPS)]
    return [p.detach().clone() for p in model.parameters()], case.params["bucket_mb"], batches


def _model(state):
    """The MLP with these parameters."""
    import torch

    model = _dp.mlp(WIDTHS, seed=0)
    with torch.no_grad():
        for p, value in zip(model.parameters(), state):
            p.copy_(torch.as_tensor(value))
    return model


def buckets_of(params, bucket_mb: float) -> list[list]:
    """Parameters in reverse order, cut into buckets of at most bucket_mb MiB."""
    cap = bucket_mb * 2**20
    out, current, used = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and used + nbytes > cap:
            out.append(current)
            current, used = [], 0
        current.append(p)
        used += nbytes
    if current:
        out.append(current)
    return out


def model_solution(comm, model, bucket_mb):
    """The reference: broadcast, buckets, hooks launching async all-reduces, finish()."""
    import torch
    import torch.distributed as dist

    size = comm.Get_size()
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    buckets = buckets_of(model.parameters(), bucket_mb)
    home = {id(p): i for i, b in enumerate(buckets) for p in b}
    state = {"left": [len(b) for b in buckets], "pending": []}

    def ready(p):
        i = home[id(p)]
        state["left"][i] -= 1
        if state["left"][i] == 0:
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
            state["pending"].append((i, flat, _dp.all_reduce(flat, async_op=True)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        for i, flat, work in state["pending"]:
            work.wait()
            flat /= size
            offset = 0
            for q in buckets[i]:
                q.grad.copy_(flat[offset: offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        state["pending"].clear()
        state["left"] = [len(b) for b in buckets]

    finish.buckets = len(buckets)
    return finish


def _train(build, comm, model, bucket_mb, batches) -> dict:
    import torch
    import torch.nn.functional as F

    finish = build(comm, model, bucket_mb)
    if not callable(finish):
        return {"error": f"the function returned {type(finish).__name__}; return finish, a function that "
                         "completes the all-reduces after backward"}
    out = {"init": _dp.params(model), "steps": []}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for x, y in batches:
        opt.zero_grad()
        start, elements = _dp.launches(), _dp.launched_elements()
        F.cross_entropy(model(x), y).backward()
        during = _dp.launches() - start
        values = None if elements is None else _dp.launched_elements() - elements
        finish()
        out["steps"].append({"during": during, "total": _dp.launches() - start, "grads": _dp.grads(model),
                             "values_during": values})
        opt.step()
    out["params"] = _dp.params(model)
    return out


def call(fn, comm, args):
    _dp.ensure_process_group()
    state, bucket_mb, batches = args
    return _train(fn, comm, _model(state), bucket_mb, batches)


def reference(comm, state, bucket_mb, batches):
    _dp.ensure_process_group()
    model = _model(state)
    out = _train(model_solution, comm, model, bucket_mb, batches)
    buckets = buckets_of(model.parameters(), bucket_mb)
    out["buckets"] = len(buckets)
    out["gradient_values"] = sum(p.numel() for p in model.parameters())
    out["largest_bucket"] = max(sum(p.numel() for p in b) for b in buckets)
    return out


def _flat(arrays):
    import numpy as np

    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays]) if arrays else np.zeros(0)


def verify(case, ctx):
    import numpy as np

    got, expected, size = ctx.got, ctx.expected, ctx.size
    mine = None if "error" in got else (_flat(got["init"]), _flat(got["params"]))
    everyone = ctx.comm.allgather(mine)  # one collective, on every rank, before any verdict
    if "error" in got:
        return Wrong(got["error"])
    if any(e is None for e in everyone):
        return Wrong(f"rank {next(r for r, e in enumerate(everyone) if e is None)} could not run the steps")
    root = everyone[0][0]
    apart = [r for r, e in enumerate(everyone) if e[0].shape != root.shape or not np.array_equal(e[0], root)]
    if apart:
        return Wrong(f"right after your function, the parameters of rank{'s' if len(apart) > 1 else ''} "
                     f"{', '.join(map(str, apart))} differ from rank 0's",
                     hint="like DDP's constructor, broadcast rank 0's parameters first "
                          "(dist.broadcast(p.data, src=0) for every p): ranks that start apart stay apart.")
    for i, (g, e) in enumerate(zip(got["steps"], expected["steps"])):
        err = _dp.close(g["grads"], e["grads"], rtol=1e-5, atol=1e-6)
        if err is not None:
            return Wrong(f"after finish() in step {i + 1}, p.grad is not the average over the ranks "
                         f"(largest difference {err:.3g})", max_error=err)
    if any(not np.array_equal(mine[1], other[1]) for other in everyone):
        return Wrong("after three steps the ranks' parameters differ")
    buckets = expected["buckets"]
    if size > 1 and buckets > 1 and not any(s["during"] for s in got["steps"]):
        return Wrong(f"no all-reduce started while backward ran ({buckets} buckets expected)",
                     hint="launch each bucket's all-reduce from a hook (p.register_post_accumulate_grad_hook) with "
                          "async_op=True as soon as its last gradient is ready; only wait for them in finish().")
    wrong = _overlapped(got, expected) if size > 1 and buckets > 1 else None
    if wrong is not None:
        return wrong
    most = max(s["total"] for s in got["steps"])
    if size > 1 and most > buckets + 1:
        return Wrong(f"{most} all-reduces in a step where buckets of ≤ {case.params['bucket_mb']:g} MiB give {buckets}",
                     hint="pack the gradients of a bucket into one flat buffer (torch.cat) and all-reduce that once, "
                          "instead of one all-reduce per tensor.")
    return hooks.received_for_allreduce(ctx, STEPS * 4 * expected["gradient_values"],
                                        f"the average gradient of {STEPS} steps")


def _overlapped(got, expected) -> Wrong | None:
    """All buckets but at most one all-reduced while backward ran, counted in gradient values (one
    tiny all-reduce from a hook, the rest after backward, overlaps nothing)."""
    need = expected["gradient_values"] - expected["largest_bucket"]
    for i, step in enumerate(got["steps"]):
        values = step.get("values_during")
        if isinstance(values, int) and values < need:
            return Wrong(f"in step {i + 1} only {values} of the {expected['gradient_values']} gradient values were "
                         f"all-reduced while backward ran; all buckets but the last start there",
                         hint="start each bucket's all-reduce from the hook that completes it, on the bucket's whole "
                              "flat buffer; finish() only waits for them.")
    return None


def diagnose(case, ctx):
    got, expected, size = ctx.got, ctx.expected, ctx.size
    if "error" in got or size == 1:
        return None
    first_got, first_expected = got["steps"][0]["grads"], expected["steps"][0]["grads"]
    k = _dp.ratio_to(first_got, first_expected)
    if k is not None and abs(k - size) < 1e-3:
        return "the gradients look summed, not averaged: divide each bucket by comm.Get_size() after waiting."
    if _dp.close(got["steps"][0]["grads"], expected["steps"][0]["grads"], rtol=1e-5, atol=1e-6) is None:
        return ("step 1 is right but a later one is not: reset the buckets' state in finish() "
                "(pending work, gradients still to come) for the next step.")
    if any(s["total"] == 0 for s in got["steps"]):
        return "a step launched no all-reduce: are the hooks registered on the model's parameters?"
    return ("wait for each all-reduce before reading its buffer, then copy the averaged slices back into p.grad "
            "(the flat buffer from torch.cat is a copy, not a view).")
