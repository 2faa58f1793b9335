"""Checks for lesson 05's first exercise: a distributed sampler, by hand.

    def shard_indices(comm, n, epoch, seed=0) -> list[int]:
        # this rank's sample indices for this epoch: one shuffle of range(n), the same on every
        # rank (seeded with seed + epoch), of which each rank takes its own part

`call()` asks each rank for epochs 0, 0 again, 1 and 2, and epoch 0 with another seed; the
checks look at all ranks' answers together: every rank the same number of indices (else ranks
run different numbers of steps and DDP waits forever for the missing one); no index on two
ranks except the few repeated to pad (DistributedSampler) — or none dropped except the tail
(drop_last); the same answer when asked twice; shuffled; a different order every epoch (what
set_epoch does) and for another seed; and then DistributedSampler's own list, as the exercise asks.
Each call must leave torch's global random state as it found it: DistributedSampler draws from a
generator of its own, and a sampler that reseeds the global one repeats the training's dropout and
augmentation every epoch.
"""
from __future__ import annotations

import math

from hpdl.checker.cases import Case, Wrong, nonce_seed

SIGNATURE = "shard_indices(comm, n, epoch, seed=0) -> list[int]   # this rank's samples for this epoch"
RANKS = (1, 2, 3)
# the exercise is the sampler itself: torch's, called, scored 12/12. Refused in the check (a dotted name: a library's
# function or class, replaced in the learner's ranks by one that refuses, learner_job.refuse_kit_answers)
_OWN_SAMPLER = "this exercise is DistributedSampler written by hand: torch's own is not available while it is checked"
# torch's elastic subclass first: loaded while its base is whole, then refused with it (its own __iter__ is the base's
# list, and it scored 12/12 loaded with the base put back for the import)
FORBIDDEN = {"torch.distributed.elastic.utils.data.elastic_distributed_sampler.ElasticDistributedSampler": _OWN_SAMPLER,
             "torch.utils.data.distributed.DistributedSampler": _OWN_SAMPLER,
             "torch.utils.data.DistributedSampler": _OWN_SAMPLER}
# and in their files' place in the learner's view, copies without them (checking.library_answer_copies): loaded
# again from torch's file under another name, the sampler was whole (12/12)
LIBRARY_ANSWERS = ("torch.utils.data.distributed.DistributedSampler",
                   "torch.distributed.elastic.utils.data.elastic_distributed_sampler.ElasticDistributedSampler")
TIMEOUT = 20.0
PRIVATE_INPUTS = True  # the seed drawn with the check's nonce where there is one (inputs())
EPOCHS = (0, 0, 1, 2)  # epoch 0 twice: the same question must get the same answer
OTHER_SEED = 1000  # epoch 0 is asked once more with seed + OTHER_SEED: the order must depend on the seed


def cases(size):
    return [
        Case("n=12", {"n": 12, "seed": 0}),
        Case("n=1438 (the digits), seed 0", {"n": 1438, "seed": 0}),
        Case("n=10, seed 3: not a multiple of every rank count", {"n": 10, "seed": 3}),
        Case("n=1001, seed 7", {"n": 1001, "seed": 7}, hidden=True),
    ]


def inputs(case, rank, size):
    """n and the seed: with the check's nonce (grading, PRIVATE_INPUTS) the seed is drawn from it, so a table
    of a stripped kit's public answers (*.expected) fits no case; any seed is as good a question."""
    seed = case.params["seed"]
    if case.params.get("nonce") is not None:
        seed = nonce_seed(case.params) % 100_000
    return case.params["n"], seed


def reference_shard(n: int, rank: int, size: int, epoch: int, seed: int, drop_last: bool = False) -> list[int]:
    """DistributedSampler's list (shuffle=True): torch.randperm seeded with seed + epoch, topped up from its
    start (or its tail dropped, drop_last), every size-th index from the rank's."""
    import torch

    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    total = (n // size) * size if drop_last else math.ceil(n / size) * size
    order = order[:total] if drop_last else order + order[: total - n]
    return order[rank:total:size]


def _as_list(x):
    if hasattr(x, "tolist"):
        x = x.tolist()
    return [int(i) for i in x]


def call(fn, comm, args):
    import torch

    n, seed = args
    out = []
    for epoch, s in [(e, seed) for e in EPOCHS] + [(0, seed + OTHER_SEED)]:
        state = torch.random.get_rng_state()
        got = fn(comm, n, epoch, s)
        if not torch.equal(state, torch.random.get_rng_state()):  # torch.manual_seed(seed + epoch) scored 12/12
            return {"error": f"epoch {epoch}: the function changed torch's global random state (torch.manual_seed, "
                             "or a draw without a generator): a sampler must leave the training's random numbers "
                             "alone (its dropout, its augmentation), or every epoch repeats them. Draw from a "
                             "generator of its own: torch.Generator().manual_seed(seed + epoch)"}
        if got is None:
            return {"error": f"epoch {epoch}: the function returned None; return this rank's list of indices"}
        try:
            out.append(_as_list(got))
        except (TypeError, ValueError):
            return {"error": f"epoch {epoch}: returned {type(got).__name__}, not a list of whole numbers"}
    return {"epochs": out[:-1], "other_seed": out[-1]}


def reference(comm, n, seed):
    """DistributedSampler's lists for what call() asks, padded and drop_last (either is right)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    asked = [(e, seed) for e in EPOCHS] + [(0, seed + OTHER_SEED)]  # what call() asks, in its order
    return {way: [reference_shard(n, rank, size, e, s, way == "drop_last") for e, s in asked]
            for way in ("padded", "drop_last")}


def _problems(shards: list[list[int]], n: int) -> Wrong | None:
    """All ranks' shards for one epoch."""
    size = len(shards)
    lengths = [len(s) for s in shards]
    if len(set(lengths)) > 1:
        return Wrong(f"the ranks got different numbers of indices: {lengths}",
                     hint="every rank must run the same number of steps, or the one with an extra batch waits "
                          "forever for the others in its all-reduce. Pad the shuffled list by repeating its first "
                          "indices until its length divides by the number of ranks (DistributedSampler does), "
                          "or drop the tail (drop_last).")
    if any(not 0 <= i < n for s in shards for i in s):
        bad = next(i for s in shards for i in s if not 0 <= i < n)
        return Wrong(f"index {bad} is outside 0..{n - 1}")
    everything = [i for s in shards for i in s]
    distinct = set(everything)
    padded = math.ceil(n / size) * size
    dropped = (n // size) * size
    if len(everything) == padded and len(distinct) == n:
        return None  # padded: all covered, only the padding repeated
    if len(everything) == dropped and len(distinct) == dropped:
        return None  # drop_last: disjoint, only the tail left out
    shared = len(everything) - len(distinct)
    if shared > padded - n:
        owners = {}
        for r, s in enumerate(shards):
            for i in s:
                owners.setdefault(i, set()).add(r)
        example = next(i for i, rs in owners.items() if len(rs) > 1)
        return Wrong(f"{shared} indices are on more than one rank (e.g. {example} on ranks {sorted(owners[example])})",
                     hint="the ranks must cut up ONE shuffle: every rank shuffles with the same seed (seed + epoch, "
                          "never the rank), then takes its own part, e.g. order[rank::size].")
    missing = n - len(distinct)
    return Wrong(f"{missing} of the {n} samples are on no rank",
                 hint="together the ranks must cover the data set: each takes every size-th index of the "
                      "(padded) shuffled order, starting at its rank.")


def verify(case, ctx):
    answers = ctx.comm.allgather(ctx.got)  # first, on every rank: verify's collectives must match
    expected = ctx.comm.allgather(ctx.expected)
    if "error" in ctx.got:
        return Wrong(ctx.got["error"])
    failed = [r for r, a in enumerate(answers) if "error" in a]
    if failed:
        return Wrong(f"rank {failed[0]} could not answer: {answers[failed[0]]['error']}")
    n, seed = ctx.args  # the seed asked (drawn with the nonce in grading)
    everyone = [a["epochs"] for a in answers]  # everyone[rank][k] = that rank's answer for EPOCHS[k]
    for k, epoch in enumerate(EPOCHS[1:], start=1):
        if EPOCHS[k] == EPOCHS[k - 1] and any(r[k] != r[k - 1] for r in everyone):
            changed = next(i for i, r in enumerate(everyone) if r[k] != r[k - 1])
            return Wrong(f"asked twice for epoch {epoch}, rank {changed} "
                         "answered differently",
                         hint="the shuffle must depend only on seed and epoch: seed a generator of your own with "
                              "seed + epoch instead of using the global random state.")
    for k, epoch in enumerate(EPOCHS):
        wrong = _problems([r[k] for r in everyone], n)
        if wrong is not None:
            wrong.message = f"epoch {epoch}: {wrong.message}"
            return wrong
    unpadded = n // len(everyone)  # padding may wrap around to the start: look before it
    if n >= 10 and all(r[0][:unpadded] == sorted(r[0][:unpadded]) for r in everyone):
        return Wrong("epoch 0 is not shuffled: every rank's indices are in increasing order",
                     hint="shuffle range(n) first, as DistributedSampler does (g = torch.Generator(); "
                          "g.manual_seed(seed + epoch); torch.randperm(n, generator=g)), then split it.")
    if n >= 10 and (everyone_same(everyone, 0, 2) or everyone_same(everyone, 2, 3)):
        return Wrong("two different epochs gave the same order",
                     hint="seed the shuffle with seed + epoch (that is what sampler.set_epoch(epoch) is for): "
                          "with the same order every epoch, the model sees the batches in the same order forever.")
    if n >= 10 and all(a.get("other_seed") == a["epochs"][0] for a in answers):
        return Wrong(f"seed {seed} and seed {seed + OTHER_SEED} gave the same order "
                     "in epoch 0", hint="the shuffle must depend on the seed too: seed + epoch, not the epoch alone.")
    return _not_the_samplers(answers, expected, seed)


def _not_the_samplers(answers: list[dict], expected: list[dict], seed: int) -> Wrong | None:
    """The exercise asks for DistributedSampler's own list (the check compares, as the notebook says): a
    fair split of some other order is not it. Either of its two ways with a tail (padded, or drop_last),
    as the reference job made them (a stripped kit: its stored answers), every rank's."""
    mine = [[*a["epochs"], a["other_seed"]] for a in answers]
    if any(all(m == e.get(way) for m, e in zip(mine, expected)) for way in ("padded", "drop_last")):
        return None
    rank, k = next((r, k) for r, m in enumerate(mine) for k, got in enumerate(m) if got != expected[r]["padded"][k])
    epoch, s = ([(e, seed) for e in EPOCHS] + [(0, seed + OTHER_SEED)])[k]
    return Wrong(f"rank {rank}'s indices for epoch {epoch} (seed {s}) are a fair split, but not the list "
                 f"DistributedSampler(…, shuffle=True, seed={s}) gives after set_epoch({epoch})",
                 hint="draw the order as DistributedSampler does: torch.randperm(n, generator="
                      "torch.Generator().manual_seed(seed + epoch)), top it up from its start, then take "
                      "order[rank::size] (every size-th index: a rank's share spread over the whole shuffle).")


def everyone_same(everyone, a: int, b: int) -> bool:
    return all(r[a] == r[b] for r in everyone)
