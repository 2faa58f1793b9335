"""Checks for lesson 06's exercise: resuming a Horovod training on a different number of ranks.

    def resume_horovod(comm, checkpoint, model) -> tuple[optimizer, int]:
        # Horovod is initialised. `checkpoint` is the path of a file rank 0 saved with torch.save,
        # given on rank 0 only (None elsewhere): {"model": state_dict, "optimizer": the state_dict
        # of SGD(momentum=0.9), "epoch": the last epoch finished, "size": the ranks that wrote it}.
        # Put its parameters and optimizer state (momentum) on every rank, in an SGD(momentum=0.9)
        # wrapped in hvd.DistributedOptimizer, with the learning rate rescaled from "size" ranks to
        # hvd.size(); return that optimizer and the epoch training continues at.

Every rank is handed a model initialised differently, so a rank that keeps its own shows. The
checkpoint was written by more or fewer ranks than the check runs (its learning rate and momentum
are not the defaults). It is drawn with the check's nonce and handed to rank 0 alone, so a rank
that draws it again from the case's seed instead of receiving it holds another one. After the
learner's function returns, the check trains a few more epochs with the optimizer it returned
(DistributedSampler, set_epoch(epoch) from the epoch it returned), and compares with the
reference: the same resume done by hand, trained the same way with DDP.
Decided on what training does: parameters identical on every rank and equal to the reference's (as near
as 16-bit rounding leaves them where the optimizer sends its gradients in fp16, ROUNDED).
What the ranks held right after resuming (parameters, momentum, SGD's settings, learning rate,
epoch) is compared first, exactly, and names the slip.
"""
from __future__ import annotations

import numbers

from hpdl.checker.cases import Case, Wrong, nonce_seed
from hpdl.checker.cases import _dp

SIGNATURE = ("resume_horovod(comm, checkpoint, model) -> (optimizer, next_epoch)   "
             "# checkpoint: a path on rank 0, None elsewhere")
RANKS = (1, 2, 3)
PRIVATE_INPUTS = True  # rank 0 gets the checkpoint as data, drawn with the check's nonce: the others cannot draw it
TIMEOUT = 60.0  # importing torch and Horovod, joining both
WIDTHS = (32, 24, 10)
SAMPLES = 48  # divides by every rank count: equal shards, no padding
BATCH = 4  # per rank
EPOCHS_AFTER = 2  # the check trains this many epochs after the resume
MOMENTUM = 0.9
NEAR = 1e-2  # largest error of a training whose averages were only rounded (fp16 on the wire: 1.3e-4 at most)
# how far from the reference a training may end whose optimizer sends its gradients in 16 bits
# (compression=hvd.Compression.fp16, which lesson 06 teaches): 4.6e-5 to 1.3e-4 here, everything else exact
# (1e-3 hid a learning rate 0.1% off with fp16 on, errors 3.2e-4 to 8.8e-4; so did fp16 set at return only)
ROUNDED = 2.5e-4
# SGD's settings other than the learning rate: the checkpoint's (loaded with its state), the same as the reference's
SETTINGS = ("momentum", "dampening", "weight_decay", "nesterov", "maximize")


def cases(size):
    """Checkpoints written by another number of ranks than `size` (the rescale must show)."""
    writers = {1: (2, 4, 3), 2: (4, 1, 3), 3: (2, 6, 1)}[size] if size in (1, 2, 3) else (size + 1, 1, 2 * size)
    slow = 1e6
    return [
        Case(f"written by {writers[0]} ranks after epoch 1", {"seed": 1, "writers": writers[0], "epoch": 1,
                                                              "base_lr": 0.05}, slow_factor=slow),
        Case(f"written by {writers[1]} ranks after epoch 4", {"seed": 2, "writers": writers[1], "epoch": 4,
                                                              "base_lr": 0.02}, slow_factor=slow),
        Case(f"written by {writers[2]} ranks after epoch 0", {"seed": 3, "writers": writers[2], "epoch": 0,
                                                              "base_lr": 0.03}, hidden=True, slow_factor=slow),
    ]


def checkpoint_state(params: dict) -> dict:
    """What the writing job saved, as plain data: its model's parameters, SGD's momentum (not zero)
    and learning rate (base_lr times the ranks it ran on), the last epoch it finished, and its rank
    count. Drawn with the check's nonce (PRIVATE_INPUTS): only rank 0 is handed it, and no other rank
    can draw it again from the case's seed."""
    import torch

    model = _dp.mlp(WIDTHS, seed=nonce_seed({**params, "seed": 1000 + params["seed"]}))
    g = torch.Generator().manual_seed(nonce_seed({**params, "seed": 2000 + params["seed"]}))
    return {"model": {k: v.detach().numpy().copy() for k, v in model.state_dict().items()},
            "momentum": [(0.1 * torch.randn(p.shape, generator=g)).numpy() for p in model.parameters()],
            "lr": params["base_lr"] * params["writers"], "epoch": params["epoch"], "size": params["writers"]}


def save_checkpoint(state: dict) -> str:
    """The checkpoint file the writing job left, made from its plain data on the rank that reads it:
    {"model": state_dict, "optimizer": SGD(momentum=0.9)'s state_dict, "epoch", "size"}, torch.save'd."""
    import os
    import tempfile

    import torch

    model = _dp.mlp(WIDTHS, seed=0)
    model.load_state_dict({k: torch.from_numpy(v.copy()) for k, v in state["model"].items()})
    opt = torch.optim.SGD(model.parameters(), lr=state["lr"], momentum=MOMENTUM)
    for p, buf in zip(model.parameters(), state["momentum"]):
        opt.state[p]["momentum_buffer"] = torch.from_numpy(buf.copy())
    path = os.path.join(tempfile.mkdtemp(prefix="hpdl-resume-"), "checkpoint.pt")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": state["epoch"],
                "size": state["size"]}, path)
    return path


def inputs(case, rank, size):
    """Rank 0: the checkpoint's data (call() writes it to a file); the others: None. And the seed of
    the data the check trains on afterwards (not the learner's). Each rank's model is made in call()."""
    return (checkpoint_state(case.params) if rank == 0 else None), case.params["seed"]


def _model_and_path(comm, state, seed):
    """A model initialised differently on every rank, and on rank 0 the checkpoint's file."""
    model = _dp.mlp(WIDTHS, seed=100 * seed + comm.Get_rank())
    return model, (save_checkpoint(state) if state is not None else None)


def train(model, opt, first_epoch: int, seed: int, size: int, rank: int) -> None:
    """The check's own training after the resume: EPOCHS_AFTER epochs from `first_epoch`."""
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dataset = TensorDataset(*_dp.batch(SAMPLES, WIDTHS[0], WIDTHS[-1], seed=seed))
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=BATCH, sampler=sampler)
    for epoch in range(first_epoch, first_epoch + EPOCHS_AFTER):
        sampler.set_epoch(epoch)
        for x, y in loader:
            opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            opt.step()


def _momentum(opt, model) -> list | None:
    try:
        bufs = [opt.state[p].get("momentum_buffer") for p in model.parameters()]
    except (AttributeError, TypeError, KeyError):
        return None
    return None if any(b is None for b in bufs) else [b.detach().cpu().numpy().copy() for b in bufs]


def _settings(opt) -> list[dict]:
    return [{k: g.get(k) for k in SETTINGS} for g in opt.param_groups]


def _remove(path) -> None:
    import os
    import shutil

    if path is not None and os.path.isdir(os.path.dirname(path)):
        shutil.rmtree(os.path.dirname(path), ignore_errors=True)


def call(fn, comm, args):
    import horovod.torch as hvd

    _dp.ensure_horovod()
    state, seed = args
    model, path = _model_and_path(comm, state, seed)
    try:
        out = fn(comm, path, model)
    finally:
        _remove(path)
    if not (isinstance(out, (tuple, list)) and len(out) == 2 and hasattr(out[0], "param_groups")
            and isinstance(out[1], numbers.Integral) and not isinstance(out[1], bool)):
        what = (f"({type(out[0]).__name__}, {type(out[1]).__name__})" if isinstance(out, (tuple, list))
                and len(out) == 2 else type(out).__name__)
        return {"error": f"returned {what}; expected a tuple (optimizer, next_epoch): an optimizer and a whole number"}
    opt, epoch = out[0], int(out[1])
    if not _horovods(opt):
        return {"error": f"returned a {type(opt).__name__} that is not Horovod's: its step() would average "
                         "the gradients some other way than the exercise asks",
                "hint": "wrap the optimizer in hvd.DistributedOptimizer(opt, "
                        "named_parameters=model.named_parameters()) and return that."}
    resumed = {"params0": _dp.params(model), "momentum": _momentum(opt, model), "epoch": epoch,
               "lr": [float(g["lr"]) for g in opt.param_groups], "settings": _settings(opt), "error": None,
               "fp16": getattr(opt, "_compression", None) is hvd.Compression.fp16}
    if not 0 <= epoch < 1000:
        return {**resumed, "params": None}
    train(model, opt, epoch, seed, hvd.size(), hvd.rank())
    fp16 = resumed["fp16"] and getattr(opt, "_compression", None) is hvd.Compression.fp16  # all along, not at return
    return {**resumed, "fp16": fp16, "params": _dp.params(model)}


def _horovods(opt) -> bool:
    """Whether `opt` is an optimizer hvd.DistributedOptimizer made: its class, made on the fly from the one it
    wraps, carries every method of Horovod's own (copied, not inherited), none replaced on the object. An SGD
    subclass of the learner's own that borrowed Horovod's `synchronize` alone, its step() averaging over mpi4py,
    scored 9/9."""
    from horovod.torch import optimizer as made

    own = vars(opt) if hasattr(opt, "__dict__") else {}
    for kind in (getattr(made, "_DistributedOptimizer", None), getattr(made, "_DistributedAdasumOptimizer", None)):
        methods = {k: v for k, v in (vars(kind) if kind is not None else {}).items() if callable(v)}
        if methods and not set(methods) & set(own) and all(
                _is_horovods(type(opt).__dict__.get(name), method) for name, method in methods.items()):
            return True
    return False


def _is_horovods(found, method) -> bool:
    """`found` is Horovod's `method`, or torch's wrapper of an optimizer class's step around it (torch wraps
    each optimizer class's step once, Optimizer.profile_hook_step): its code torch's, and all it calls Horovod's."""
    if found is method:
        return True
    import types

    from torch.optim.optimizer import Optimizer

    hook = getattr(Optimizer.profile_hook_step, "__func__", Optimizer.profile_hook_step)
    torchs = [c for c in hook.__code__.co_consts if isinstance(c, types.CodeType)]
    called = [cell.cell_contents for cell in getattr(found, "__closure__", None) or ()
              if callable(getattr(cell, "cell_contents", None))]
    return getattr(found, "__code__", None) in torchs and called == [method]


def reference(comm, state, seed):
    """The resume by hand: rank 0 reads the file and sends it to all (over MPI); every rank loads
    it, rescales the learning rate, and trains as the check does, averaging with DDP (Gloo)."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    _dp.ensure_process_group()
    model, path = _model_and_path(comm, state, seed)
    state = comm.bcast(torch.load(path) if comm.Get_rank() == 0 else None, root=0)
    _remove(path)
    model.load_state_dict(state["model"])
    opt = torch.optim.SGD(model.parameters(), lr=0.0, momentum=MOMENTUM)
    opt.load_state_dict(state["optimizer"])
    saved_lr = opt.param_groups[0]["lr"]
    opt.param_groups[0]["lr"] = saved_lr * comm.Get_size() / state["size"]
    resumed = {"params0": _dp.params(model), "momentum": _momentum(opt, model), "epoch": state["epoch"] + 1,
               "lr": opt.param_groups[0]["lr"], "saved_lr": saved_lr, "settings": _settings(opt)}
    train(DDP(model), opt, state["epoch"] + 1, seed, comm.Get_size(), comm.Get_rank())
    return {**resumed, "params": _dp.params(model)}


def verify(case, ctx):
    got, expected = ctx.got, ctx.expected
    mine = None if got.get("error") else _resume_problem(got, expected, ctx.size)
    everyone = ctx.comm.allgather((_flat(got.get("params0")), _flat(got.get("params")), mine))  # every rank, first
    if got.get("error"):
        return Wrong(got["error"], hint=got.get("hint"))
    if not all(_same(everyone[0][0], other[0]) for other in everyone):
        return Wrong("right after resuming, the ranks hold different parameters",
                     hint="only rank 0 read the checkpoint: after it loads the model, send its parameters "
                          "to every rank with hvd.broadcast_parameters(model.state_dict(), root_rank=0).")
    for rank, (_, _, problem) in enumerate(everyone):  # every rank reports the first rank's slip
        if problem is not None:
            return Wrong(f"rank {rank}: {problem.message}", hint=problem.hint)
    if not all(_same(everyone[0][1], other[1]) for other in everyone):
        return Wrong("the resume was right, but training with the optimizer returned left the ranks with "
                     "different parameters",
                     hint="return the optimizer wrapped in hvd.DistributedOptimizer(opt, "
                          "named_parameters=model.named_parameters()), so gradients are averaged.")
    # gradients sent in 16 bits round every average: compared as near as that rounding leaves a training
    err = _dp.close(got["params"], expected["params"], rtol=1e-4, atol=ROUNDED if got.get("fp16") else 1e-5)
    if err is not None:
        near = err < NEAR  # resumed right (checked above), then each step's average a little off
        return Wrong(f"after training on, the parameters differ from the reference's by up to {err:.3g}",
                     max_error=err,
                     hint="the resume was right and training ended near the reference, not on it: each step's "
                          "average of the gradients was a little off. Return hvd.DistributedOptimizer's plain "
                          "average (op=hvd.Average, the default), with no other gradient arithmetic in the "
                          "optimizer." if near else None)
    return None


def _resume_problem(got, expected, size) -> Wrong | None:
    """What this rank holds right after resuming, against a right resume, in the order a resume
    does it: parameters, momentum, learning rate, epoch."""
    import numpy as np

    if _dp.close(got["params0"], expected["params0"], rtol=0, atol=0) is not None:
        return Wrong("right after resuming, the parameters are not the checkpoint's",
                     hint="on rank 0, model.load_state_dict(state[\"model\"]) before broadcasting them.")
    if got["momentum"] is None or _dp.close(got["momentum"], expected["momentum"], rtol=0, atol=0) is not None:
        return Wrong("right after resuming, the optimizer's momentum is not the checkpoint's",
                     hint="on rank 0, optimizer.load_state_dict(state[\"optimizer\"]) after wrapping it in "
                          "hvd.DistributedOptimizer, then hvd.broadcast_optimizer_state(optimizer, root_rank=0) "
                          "on every rank: the momentum is part of the training's state.")
    settings = got.get("settings") or [{}]
    changed = sorted({k for group in settings for k in SETTINGS if group.get(k) != expected["settings"][0][k]})
    if changed:
        return Wrong(f"the optimizer's {', '.join(changed)} after resuming differ from the checkpoint's",
                     hint="make the optimizer as the checkpoint's was, SGD(momentum=0.9), and load its state with "
                          "optimizer.load_state_dict(state[\"optimizer\"]): its settings come with it.")
    lr = got["lr"][0] if got["lr"] else float("nan")
    if not np.isclose(lr, expected["lr"], rtol=1e-6):
        saved = " (the checkpoint's own: not rescaled)" if np.isclose(lr, expected["saved_lr"]) else ""
        return Wrong(f"the learning rate after resuming is {lr:.6g}{saved}; for {size} rank(s) it is "
                     f"{expected['lr']:.6g}",
                     hint="the checkpoint's learning rate was scaled for state[\"size\"] ranks; multiply it by "
                          "hvd.size() / state[\"size\"] in every param group (the lesson's linear scaling rule).")
    if got["epoch"] != expected["epoch"]:
        restarted = " (training restarts from scratch)" if got["epoch"] == 0 else ""
        return Wrong(f"returned epoch {got['epoch']}{restarted}; the checkpoint finished epoch "
                     f"{expected['epoch'] - 1}, so training continues at {expected['epoch']}",
                     hint="the epoch decides the sampler's shuffle (set_epoch) and any schedule: return "
                          "state[\"epoch\"] + 1, sent from rank 0 with hvd.broadcast_object(..., name=...).")
    return None


def _same(a, b) -> bool:
    import numpy as np

    return a is not None and b is not None and np.array_equal(a, b)


def _flat(arrays):
    import numpy as np

    return None if arrays is None else np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays])
