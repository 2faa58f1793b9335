"""Checks for lesson 01's exercise: one training step.

    def train_step(model, batch, loss_fn, optimizer) -> float:
        # forward on batch[0], loss against batch[1], backward, update; return the loss as a float

The function runs on one device and takes no communicator, so this module defines `call()`:
the checker hands it the learner's function and this rank's inputs instead of calling
`fn(comm, *args)`. Each case takes three steps in a row on one model (so gradients left over
from one step would spoil the next) and compares, after every step, the returned loss and
the model's parameters with those of the reference step on an identical copy. The model's first
weights and the batches are drawn with the check's nonce (PRIVATE_INPUTS), so a table of a stripped
kit's public answers (*.expected) fits no graded case.
"""
from __future__ import annotations

import numbers

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed

SIGNATURE = "train_step(model, batch, loss_fn, optimizer) -> float   # the loss before the update"
RANKS = (1,)
TIMEOUT = 30.0  # the first case of a job pays for importing torch
STEPS = 3
PRIVATE_INPUTS = True  # the first weights and the batches, drawn with the check's nonce, as data (inputs())


def cases(size):
    slow = 1e6  # a single step is fast whatever the learner writes; timing is not the point
    return [
        Case("MLP, SGD with momentum", {"model": "mlp", "optimizer": "sgd", "batch": 16}, slow_factor=slow),
        # a loss other than plain cross-entropy: a step that ignores loss_fn shows (4/4 with one loss everywhere)
        Case("CNN, Adam, label smoothing", {"model": "cnn", "optimizer": "adam", "batch": 8, "smoothing": 0.1},
             slow_factor=slow),
        Case("one sample per batch, inputs up to 16", {"model": "mlp", "optimizer": "sgd", "batch": 1, "x_scale": 16.0},
             slow_factor=slow),
        # large inputs: gradients past a norm of 5, where Adam moves each weight by about lr whatever its gradient's
        # size. A penalty of 1e-5 · ‖w‖² added before backward, or gradients clipped at a norm of 5, moved the
        # weights by less than the tolerance in every SGD case and scored 3/4
        Case("MLP, Adam, inputs up to 16", {"model": "mlp", "optimizer": "adam", "batch": 16, "x_scale": 16.0},
             slow_factor=slow),
        # batch norm here too: a step that minds the mode, or runs forward twice, fails two cases, not one (3/4)
        Case("wide MLP with batch norm, SGD", {"model": "mlp", "optimizer": "sgd", "batch": 32, "hidden": 64,
                                                "norm": True}, hidden=True, slow_factor=slow),
    ]


def inputs(case, rank, size):
    """(the case's params, the model's first weights, three batches of digits-like data), as plain data
    drawn with the check's nonce where there is one; call() builds the model and optimizer from them."""
    import torch

    p = case.params
    torch.manual_seed(nonce_seed({**p, "seed": 1234}))
    model = _model(p)
    g = torch.Generator().manual_seed(nonce_seed({**p, "seed": 99}))
    batches = [((torch.rand(p["batch"], 1, 8, 8, generator=g) * p.get("x_scale", 1.0)).numpy(),
                torch.randint(0, 10, (p["batch"],), generator=g).numpy()) for _ in range(STEPS)]
    return p, [q.detach().numpy().copy() for q in model.parameters()], batches


def _model(p: dict):
    from torch import nn

    if p["model"] == "cnn":
        # batch norm: training mode normalises by the batch's statistics, evaluation mode by the running ones, so a
        # step taken after model.eval() shows (without a layer that minds the mode it scored 4/4)
        return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                             nn.Linear(4 * 64, 10))
    width = p.get("hidden", 32)
    norm = [nn.BatchNorm1d(width)] if p.get("norm") else []
    return nn.Sequential(nn.Flatten(), nn.Linear(64, width), *norm, nn.ReLU(), nn.Linear(width, 10))


def build(p: dict, weights: list, batches: list) -> tuple:
    """(model, batches, loss_fn, optimizer) as the learner's function is handed them."""
    import torch
    from torch import nn

    model = _model(p)
    with torch.no_grad():
        for q, w in zip(model.parameters(), weights):
            q.copy_(torch.from_numpy(w))
    if p["optimizer"] == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    else:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    return model, tensors, nn.CrossEntropyLoss(label_smoothing=p.get("smoothing", 0.0)), optimizer


def model_step(model, batch, loss_fn, optimizer) -> float:
    """The reference training step."""
    inputs, targets = batch
    optimizer.zero_grad()
    loss = loss_fn(model(inputs), targets)
    loss.backward()
    optimizer.step()
    return loss.item()


def _run(step, model, batches, loss_fn, optimizer) -> dict:
    """Each step's loss, and after it the parameters, the buffers (BatchNorm's running statistics and count)
    and whether the model is still in training mode."""
    losses, params, buffers, training = [], [], [], []
    model.train()
    for batch in batches:
        losses.append(step(model, batch, loss_fn, optimizer))
        params.append([q.detach().numpy().copy() for q in model.parameters()])
        buffers.append([b.detach().numpy().reshape(-1).copy() for b in model.buffers()])  # a count is 0-d
        training.append(bool(model.training))
    return {"losses": losses, "params": params, "buffers": buffers, "training": training}


def call(fn, comm, args):
    """How the checker calls the learner's function: once per batch, without `comm`."""
    return _run(fn, *build(*args))


def reference(comm, *args):
    return _run(model_step, *build(*args))


def verify(case, ctx):
    got, expected = ctx.got, ctx.expected
    for i, loss in enumerate(got["losses"]):
        if loss is None:
            return Wrong(f"step {i + 1} returned None", hint="return the loss: `return loss.item()`.")
        if not isinstance(loss, numbers.Real) or isinstance(loss, bool):
            kind = type(loss).__name__
            return Wrong(f"step {i + 1} returned a {kind}, not a float",
                         hint="return a plain number with loss.item(): a tensor keeps the whole graph alive "
                              "and forces a device sync wherever it is printed.")
    for i, (g, e) in enumerate(zip(got["losses"], expected["losses"])):
        if not np.isclose(g, e, rtol=1e-5, atol=1e-6):
            hint = None if i else ("compute the loss with the loss_fn you are given (here it smooths the labels), "
                                   "not a loss of your own." if _own_loss(case, ctx, g) else
                                   _IN_EVAL if _eval_loss(case, ctx, g) else
                                   "return the loss computed *before* optimizer.step(), on this batch.")
            return Wrong(f"step {i + 1} returned loss {g:.6g}; expected {e:.6g}", hint=hint, max_error=abs(g - e))
        w = hooks.compare(got["params"][i], expected["params"][i], what=f"after step {i + 1}, parameters",
                          rtol=1e-4, atol=1e-6) or _buffers(i, got, expected)
        if w is not None:
            return w
    return None


_TWICE = ("run the model forward once per step, in training mode: each such pass updates BatchNorm's running "
          "statistics, which evaluation uses; for the loss before the update, return the loss of the pass you "
          "take backward through (loss.item()).")


def _buffers(i: int, got: dict, expected: dict) -> Wrong | None:
    """BatchNorm's running mean, variance and count after step i: a second forward pass (a loss recomputed under
    no_grad) moves them again while the parameters come out right (4/4 before they were compared)."""
    g, e = got.get("buffers"), expected["buffers"]
    if not e[i]:
        return None
    w = hooks.compare(g[i] if isinstance(g, list) and len(g) > i else g, e[i],
                      what=f"after step {i + 1}, BatchNorm's running statistics", rtol=1e-4, atol=1e-6)
    if w is not None and not w.hint:
        left_in_eval = not all(got.get("training", [True])[:i])  # the step ran in evaluation mode: BN kept still
        w.hint = _LEFT_IN_EVAL if left_in_eval else _TWICE
    return w


def _first_loss(ctx, evaluate: bool = False, plain: bool = False) -> float:
    """The first batch's loss on the first weights, as two slips compute it: in evaluation mode, or with plain
    cross-entropy in place of the loss_fn handed in."""
    import torch
    import torch.nn.functional as F

    model, batches, loss_fn, _ = build(*ctx.args)
    model.train(not evaluate)
    with torch.no_grad():
        out = model(batches[0][0])
        return float((F.cross_entropy if plain else loss_fn)(out, batches[0][1]))


def _own_loss(case, ctx, loss: float) -> bool:
    """Whether a first step's loss is plain cross-entropy where the case's loss_fn smooths the labels."""
    return bool(case.params.get("smoothing")) and bool(np.isclose(loss, _first_loss(ctx, plain=True), rtol=1e-5,
                                                                  atol=1e-6))


_LEFT_IN_EVAL = ("your step left the model in evaluation mode (model.eval()), so the next step trained in it: "
                 "batch norm then normalises by its running statistics, not the batch's, and keeps them still. "
                 "Leave the mode as you found it (model.train() is set before the first step).")
_IN_EVAL = ("the loss returned was computed in evaluation mode (model.eval()), where batch norm uses its running "
            "statistics: return the loss of the training pass you take backward through.")


def _eval_loss(case, ctx, loss) -> bool:
    """Whether a first step's loss is the model's loss in evaluation mode, where a layer minds the mode."""
    minds = case.params["model"] == "cnn" or case.params.get("norm")  # the models with batch norm (_model)
    return bool(minds) and isinstance(loss, numbers.Real) and bool(
        np.isclose(loss, _first_loss(ctx, evaluate=True), rtol=1e-5, atol=1e-6))


def diagnose(case, ctx):
    got, expected = ctx.got, ctx.expected
    if not all(got.get("training", [True])):
        return _LEFT_IN_EVAL
    before = ctx.args[1]  # the first weights
    if all(np.array_equal(a, b) for a, b in zip(got["params"][0], before)):
        return ("the parameters did not change: call optimizer.step() after loss.backward(), "
                "and optimizer.zero_grad() before the backward pass, not between backward and step.")
    first_ok = hooks.compare(got["params"][0], expected["params"][0], rtol=1e-4, atol=1e-6) is None
    if first_ok:
        return ("step 1 is right but later steps are not: gradients add up across backward passes "
                "unless you clear them with optimizer.zero_grad() in every step.")
    return None
