"""Checks for lesson 10's first exercise: one micro-batched (GPipe) training step of a pipeline stage.

    def pipeline_step(comm, stage, microbatches, targets) -> float | None:
        # rank s of comm holds stage s of the model (an nn.Module: its consecutive layers).
        # microbatches: m tensors of shape (mb, W). On rank 0 the inputs; on the other ranks
        #   zeros of the shape of what arrives from the previous stage: receive into them.
        # targets: m label tensors; the last stage's loss of micro-batch i is
        #   F.cross_entropy(output_i, targets[i]).
        # Forward all m micro-batches, then backward all m (GPipe), with comm.Send / comm.Recv
        # of tensor.numpy() between neighbouring stages. Afterwards every p.grad of the stage
        # is the gradient of the MEAN of the m losses (the whole batch's loss).
        # Return that mean loss (a float) on the last rank; None on the others.

Every message between stages, forward (activations) and backward (gradients), has the shape
(mb, W) of one micro-batch. The check runs the learner's stage on 1–4 ranks and compares,
on every rank, each gradient with the single-device model's (the whole model on the whole
batch, on one rank), and the loss on the last rank. It requires exactly m messages to the
next stage and m to the previous one (one per micro-batch each way), and none to other ranks.
A send/recv order that deadlocks ends as HANG, naming the stuck ranks and their lines.
Messages go through the mpi4py communicator handed in, so the checker sees each one.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong

SIGNATURE = "pipeline_step(comm, stage, microbatches, targets) -> float | None   # loss on the last rank"
RANKS = (1, 2, 3, 4)
TIMEOUT = 30.0  # the first case of a job pays for importing torch
WIDTH, CLASSES = 16, 10


def cases(size):
    slow = 1e6  # tiny stages: timing says nothing here
    return [
        Case("8 layers, 4 micro-batches of 3", {"layers": 8, "micro": 4, "mb": 3, "seed": 1}, slow_factor=slow),
        Case("4 layers, 2 micro-batches of 5", {"layers": 4, "micro": 2, "mb": 5, "seed": 2}, slow_factor=slow),
        Case("6 layers, 1 micro-batch of 4", {"layers": 6, "micro": 1, "mb": 4, "seed": 3}, slow_factor=slow),
        Case("8 layers, 8 micro-batches of 2", {"layers": 8, "micro": 8, "mb": 2, "seed": 4}, hidden=True,
             slow_factor=slow),
    ]


def model(layers: int, seed: int):
    """The whole model: layers-1 blocks Linear(W, W)+Tanh, then Linear(W, 10). Same seed on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Tanh()) for _ in range(layers - 1)]
    return nn.Sequential(*blocks, nn.Linear(WIDTH, CLASSES))


def layers_of(stage: int, stages: int, layers: int) -> tuple[int, int]:
    """Stage s holds layers [lo, hi): contiguous, as even as can be."""
    bounds = np.linspace(0, layers, stages + 1).round().astype(int)
    return int(bounds[stage]), int(bounds[stage + 1])


def inputs(case, rank, size):
    """(stage, microbatches, targets, hidden): hidden holds what the reference needs and the learner does not."""
    import torch

    p = case.params
    full = model(p["layers"], p["seed"])
    lo, hi = layers_of(rank, size, p["layers"])
    stage = full[lo:hi]
    g = torch.Generator().manual_seed(100 + p["seed"])
    x = [torch.randn(p["mb"], WIDTH, generator=g) for _ in range(p["micro"])]
    y = [torch.randint(0, CLASSES, (p["mb"],), generator=g) for _ in range(p["micro"])]
    micro = x if rank == 0 else [torch.zeros(p["mb"], WIDTH) for _ in range(p["micro"])]
    return stage, micro, y, {"model": full, "x": x, "layers": (lo, hi)}


def _grads(module) -> list:
    return [None if q.grad is None else q.grad.detach().numpy().copy() for q in module.parameters()]


def call(fn, comm, args):
    """The learner's stage, then its gradients: the checker compares them in verify()."""
    stage, micro, targets, _ = args
    for q in stage.parameters():
        q.grad = None
    returned = fn(comm, stage, micro, targets)
    return {"loss": returned, "grads": _grads(stage)}


def reference(comm, stage, micro, targets, hidden):
    """The single-device model on the whole batch; this rank's share of its gradients."""
    import torch
    import torch.nn.functional as F

    full, (lo, hi) = hidden["model"], hidden["layers"]
    loss = F.cross_entropy(full(torch.cat(hidden["x"])), torch.cat(targets))
    loss.backward()
    last = comm.Get_rank() == comm.Get_size() - 1
    return {"loss": loss.item() if last else None, "grads": _grads(full[lo:hi])}


def model_solution(comm, stage, microbatches, targets):
    """The model solution (GPipe over mpi4py), used by the lesson's benchmark and tests."""
    import torch
    import torch.nn.functional as F

    rank, size, m = comm.Get_rank(), comm.Get_size(), len(microbatches)
    first, last = rank == 0, rank == size - 1
    inputs, outputs, losses = [], [], []
    for i, x in enumerate(microbatches):
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            loss = F.cross_entropy(y, targets[i]) / m
            losses.append(loss.item())
            y = loss
        else:
            comm.Send(y.detach().numpy(), dest=rank + 1)
        inputs.append(x)
        outputs.append(y)
    for x, y in zip(inputs, outputs):
        if last:
            y.backward()
        else:
            grad = torch.empty_like(y)
            comm.Recv(grad.numpy(), source=rank + 1)
            y.backward(grad)
        if not first:
            comm.Send(x.grad.numpy(), dest=rank - 1)
    return sum(losses) if last else None


def _messages(ctx) -> Wrong | None:
    r, p, m = ctx.rank, ctx.size, ctx.case.params["micro"]
    w = hooks.only_peers(ctx, {r - 1, r + 1}, "a pipeline stage talks only to its neighbouring stages")
    if w is not None:
        return w
    sent = hooks.sends(ctx.calls)
    received = [c.source for c in ctx.calls if c.source is not None]
    for peer, what, direction in ((r + 1, "activations", "next"), (r - 1, "gradients", "previous")):
        if not 0 <= peer < p:
            continue
        for verb, peers in (("sent", sent), ("received", received)):
            n = peers.count(peer)
            if n != m:
                thing = what if verb == "sent" else ("gradients" if what == "activations" else "activations")
                return Wrong(f"rank {r} {verb} {n} message(s) {'to' if verb == 'sent' else 'from'} the {direction} "
                             f"stage (rank {peer}); with {m} micro-batch(es) it takes exactly {m}, one per "
                             f"micro-batch ({thing})",
                             hint="send each micro-batch's tensor on its own, as soon as it is computed: the next "
                                  "stage can start on micro-batch 0 while this one computes micro-batch 1.")
    return None


def verify(case, ctx):
    got, expected = ctx.got, ctx.expected
    last = ctx.rank == ctx.size - 1
    if last:
        loss = got["loss"]
        if loss is None or not isinstance(loss, (int, float, np.floating)) or isinstance(loss, bool):
            return Wrong(f"the last stage returned {type(loss).__name__}, not the loss as a float",
                         hint="return the mean of the micro-batch losses as a float (loss.item()).")
        if not np.isclose(loss, expected["loss"], rtol=1e-4, atol=1e-6):
            return Wrong(f"the last stage returned loss {loss:.6g}; the single device's is {expected['loss']:.6g}",
                         max_error=abs(loss - expected["loss"]),
                         hint="return the mean over micro-batches of F.cross_entropy(output, targets[i]).")
    if any(g is None for g in got["grads"]):
        return Wrong(f"rank {ctx.rank}: some parameters of the stage have no gradient after the step "
                     f"(p.grad is None)")
    w = hooks.compare(got["grads"], expected["grads"], what=f"rank {ctx.rank}'s gradients", rtol=1e-4, atol=1e-6)
    if w is not None:
        return w
    return _messages(ctx)


def diagnose(case, ctx):
    got, expected = ctx.got["grads"], ctx.expected["grads"]
    m = case.params["micro"]
    if any(g is None for g in got):
        if ctx.rank < ctx.size - 1:
            return ("backward never reached this stage: the next stage must send back the gradient of its input "
                    "(x.grad, after y.backward(grad)), and this stage must receive it and call y.backward(grad).")
        return "call backward on every micro-batch's loss."
    x = np.concatenate([g.ravel() for g in got]).astype(np.float64)
    y = np.concatenate([e.ravel() for e in expected]).astype(np.float64)
    if not np.any(x) and np.any(y):
        return ("this stage's gradients are all zero: backward never reached it. Every stage but the first must "
                "send the gradient of its input (x.grad) back to the previous stage.")
    if np.dot(y, y) > 0:
        k = float(np.dot(x, y) / np.dot(y, y))
        if m > 1 and abs(k - m) < 1e-3 * m and np.allclose(x, k * y, rtol=1e-3, atol=1e-6):
            return (f"the gradients are {m} times the single device's: gradients of the {m} micro-batches "
                    f"add up in p.grad, so scale each micro-batch's loss by 1/{m} (the batch's loss is their mean).")
    return None


def explain(results):
    hung = [r for r in results if getattr(r, "verdict", None) == "HANG"]
    if hung:
        return ("a HANG means two stages wait for each other: each Recv needs a matching Send that the other rank "
                "reaches without first waiting for this one. Forward: receive from the previous stage, compute, "
                "send to the next. Backward: receive the gradient from the next stage, backward, send to the previous.")
    return None
