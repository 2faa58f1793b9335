"""Checks for lesson 06's exercise: lesson 05's training, ported to Horovod.

    def train_horovod(comm, model, dataset, epochs, lr, batch_size) -> list[float]:
        # Horovod is initialised. Broadcast rank 0's parameters; SGD(lr, momentum=0.9) wrapped in
        # hvd.DistributedOptimizer; broadcast the optimizer state; shard with
        # DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0)
        # and set_epoch(epoch); batch_size per rank; cross-entropy loss. Return, per epoch, the
        # mean training loss over this rank's batches, averaged over the ranks (hvd.allreduce).

The model starts from a different initialisation on every rank, and the data set records which
samples each rank reads. The reference is the same training with PyTorch DDP (Gloo). Checked:
parameters identical on every rank; per-epoch losses and final parameters matching the DDP run;
in every epoch the ranks read disjoint shards that cover the data.
"""
from __future__ import annotations

from hpdl.checker.cases import Case, Wrong
from hpdl.checker.cases import _dp

SIGNATURE = "train_horovod(comm, model, dataset, epochs, lr, batch_size) -> list[float]   # loss per epoch"
RANKS = (1, 2, 3)
TIMEOUT = 60.0  # importing torch and Horovod, joining both
WIDTHS = (64, 32, 10)
SAMPLES = 48


def cases(size):
    slow = 1e6
    return [
        Case("MLP, 2 epochs, batch 4 per rank", {"epochs": 2, "batch": 4, "lr": 0.1, "seed": 1}, slow_factor=slow),
        Case("MLP, 3 epochs, batch 5 (a short last batch)", {"epochs": 3, "batch": 5, "lr": 0.05, "seed": 2},
             slow_factor=slow),
        Case("MLP, 2 epochs, batch 16", {"epochs": 2, "batch": 16, "lr": 0.2, "seed": 3}, hidden=True,
             slow_factor=slow),
    ]


def _recording_dataset_class():
    from torch.utils.data import TensorDataset

    class RecordingDataset(TensorDataset):
        """A TensorDataset that notes which indices were read (to see how the data was sharded)."""

        def __init__(self, *tensors):
            super().__init__(*tensors)
            self.seen: list[int] = []

        def __getitem__(self, index):
            self.seen.append(int(index))
            return super().__getitem__(index)

    return RecordingDataset


def inputs(case, rank, size):
    """A model initialised differently per rank; the same data set on every rank."""
    p = case.params
    model = _dp.mlp(WIDTHS, seed=100 * p["seed"] + rank)
    x, y = _dp.batch(SAMPLES, WIDTHS[0], WIDTHS[-1], seed=p["seed"])
    dataset = _recording_dataset_class()(x, y)
    return model, dataset, p["epochs"], p["lr"], p["batch"]


def ddp_training(model, dataset, epochs, lr, batch_size, summed: bool = False) -> list[float]:
    """The reference: the same training with torch's DDP (and, for a hint, with summed gradients)."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    rank, size = dist.get_rank(), dist.get_world_size()
    ddp = DDP(model)
    if summed:
        def sum_hook(state, bucket):
            return dist.all_reduce(bucket.buffer(), async_op=True).get_future().then(lambda f: f.value()[0])

        ddp.register_comm_hook(None, sum_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=lr, momentum=0.9)
    sampler = DistributedSampler(dataset, num_replicas=size, rank=rank, shuffle=True, seed=0)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    losses = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, batches = 0.0, 0
        for x, y in loader:
            opt.zero_grad()
            loss = F.cross_entropy(ddp(x), y)
            loss.backward()
            opt.step()
            total, batches = total + loss.item(), batches + 1
        mean = torch.tensor([total / max(1, batches)], dtype=torch.float64)
        dist.all_reduce(mean)
        losses.append(mean.item() / size)
    return losses


def _shards(seen: list[int], epochs: int) -> list[list[int]]:
    per = len(seen) // epochs if epochs else 0
    return [seen[e * per:(e + 1) * per] for e in range(epochs)] if per * epochs == len(seen) else [seen]


def call(fn, comm, args):
    _dp.ensure_process_group()
    _dp.ensure_horovod()
    model, dataset, epochs, lr, batch_size = args
    losses = fn(comm, model, dataset, epochs, lr, batch_size)
    if hasattr(losses, "tolist"):
        losses = losses.tolist()
    try:
        losses = [float(v) for v in losses]
    except (TypeError, ValueError):
        losses = None
    return {"losses": losses, "params": _dp.params(model), "seen": list(dataset.seen)}


def reference(comm, model, dataset, epochs, lr, batch_size):
    import copy

    _dp.ensure_process_group()
    _dp.ensure_horovod()
    summed_model = copy.deepcopy(model)
    summed_data = copy.deepcopy(dataset)
    losses = ddp_training(model, dataset, epochs, lr, batch_size)
    summed = ddp_training(summed_model, summed_data, epochs, lr, batch_size, summed=True)
    return {"losses": losses, "params": _dp.params(model), "seen": list(dataset.seen),
            "summed_losses": summed, "summed_params": _dp.params(summed_model)}


def verify(case, ctx):
    import numpy as np

    got, expected, size = ctx.got, ctx.expected, ctx.size
    epochs = case.params["epochs"]
    everyone = ctx.comm.allgather((_flat(got["params"]), got["seen"]))  # collectives first, on every rank
    if got["losses"] is None or len(got["losses"]) != epochs:
        n = "nothing usable" if got["losses"] is None else f"{len(got['losses'])} values"
        return Wrong(f"returned {n}; expected a list of {epochs} losses, one per epoch")
    if any(not np.array_equal(everyone[0][0], other[0]) for other in everyone):
        return Wrong("after training, the ranks hold different parameters",
                     hint="every rank starts from its own random initialisation here: call "
                          "hvd.broadcast_parameters(model.state_dict(), root_rank=0) before training "
                          "(and hvd.broadcast_optimizer_state(optimizer, root_rank=0) after wrapping it).")
    if size > 1 and got["seen"]:
        shard_lists = [_shards(s, epochs) for _, s in everyone]
        if all(len(s) == epochs for s in shard_lists):
            for e in range(epochs):
                shards = [s[e] for s in shard_lists]
                together = [i for s in shards for i in s]
                if len(set(together)) < len(together):  # SAMPLES divides by every rank count: no padding
                    return Wrong(f"in epoch {e}, some samples were read by more than one rank",
                                 hint="shard the data: DistributedSampler(dataset, num_replicas=hvd.size(), "
                                      "rank=hvd.rank(), shuffle=True, seed=0) as the DataLoader's sampler, and "
                                      "sampler.set_epoch(epoch) at the start of each epoch.")
    for e, (g, x) in enumerate(zip(got["losses"], expected["losses"])):
        if not np.isclose(g, x, rtol=1e-4, atol=1e-6):
            return Wrong(f"epoch {e}: loss {g:.6g}, the DDP run had {x:.6g}", max_error=abs(g - x))
    err = _dp.close(got["params"], expected["params"], rtol=1e-4, atol=1e-5)
    if err is not None:
        return Wrong(f"the final parameters differ from the DDP run's by up to {err:.3g}", max_error=err)
    return None


def diagnose(case, ctx):
    import numpy as np

    got, expected, size = ctx.got, ctx.expected, ctx.size
    if got["losses"] is None or size == 1:
        return None
    if _dp.close(got["params"], expected["summed_params"], rtol=1e-4, atol=1e-5) is None:
        return ("this matches a run with gradients summed over the ranks, not averaged: leave "
                "hvd.DistributedOptimizer's op at its default (hvd.Average), and don't scale lr here.")
    if got["seen"] and len(got["seen"]) == case.params["epochs"] * SAMPLES:
        return ("each rank read the whole data set every epoch: use a DistributedSampler so each rank "
                "reads only its shard.")
    epochs = _shards(got["seen"], case.params["epochs"])
    if len(epochs) > 1 and any(a == b for a, b in zip(epochs, epochs[1:])):
        return ("every epoch read the samples in the same order: call sampler.set_epoch(epoch) at the start of "
                "each epoch, so that each one gets its own shuffle.")
    if got["seen"] and sorted(got["seen"]) != sorted(expected["seen"]):
        return ("this rank read other samples than the DDP run: use DistributedSampler(dataset, "
                "num_replicas=hvd.size(), rank=hvd.rank(), shuffle=True, seed=0).")
    if len(got["losses"]) and not np.isclose(got["losses"][0], expected["losses"][0], rtol=1e-4):
        return ("the first epoch's loss already differs: return, per epoch, the mean of loss.item() over this "
                "rank's batches, averaged over ranks with hvd.allreduce (its default op averages).")
    return None


def _flat(arrays):
    import numpy as np

    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays]) if arrays else np.zeros(0)
