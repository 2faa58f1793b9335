"""The checks of lesson 11 on real ranks: the model solutions pass as a learner's copy, and each
known-bad implementation is rejected with the reason named — ZeRO-1: every rank updating the
whole model, shards off by one when the size does not divide, the final all-gather missing;
ZeRO-3: gathered layers never freed (measured while the function runs), shards or layers
gathered in the wrong order. Right answers a check once failed (fixtures/sharding_variants.py) earn
full marks: ZeRO-1 by pickled comm.reduce calls, ZeRO-3 keeping an int64 index beside one layer.

That the solutions of solutions/11_sharding_memory.ipynb, as learners are shown them, earn full
marks at 1–4 ranks (hidden cases included) is tested by running it in grade mode
(test_notebooks.py). Every check runs on fresh MPI ranks (mpiexec jobs).
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import numpy as np
import torch
from mpi4py import MPI

import hpdl
from hpdl.checker.cases import zero1_step as z1_case
from hpdl.checker.cases import zero3_unit as z3_case
from conftest import hints, learner_copy, passed, rejected

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import sharding_variants as V  # noqa: E402  (right answers a check once failed)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def full_marks(result) -> None:
    assert result.passed and result.score == result.max_score, result


# -- exercise 1: zero1_step -------------------------------------------------------------------------


def test_zero1_step_reference_passes(no_strays):
    solution = learner_copy(z1_case.model_solution)
    assert passed(hpdl.check("zero1_step", solution, ranks=[3], grade=True))


def test_zero1_pickled_reduces_score_full_marks(no_strays):
    """A reduce-scatter of one pickled comm.reduce per owner loads rank 0 beyond the large hidden case's bound
    (1.5× ZeRO-1's traffic at 2 ranks, 1.8× at 4), but the other ranks not: an all-reduce, which that case
    is there to tell, loads every rank alike, so the bound holds for the least-loaded rank."""
    full_marks(hpdl.check("zero1_step", V.zero1_by_pickled_reduces, ranks=[2, 4], grade=True))


def test_zero1_gathered_by_one_bcast_per_shard_scores_full_marks(no_strays):
    """One Bcast per shard from its owner is an all-gather: a Bcast of no more than a shard stays allowed."""
    full_marks(hpdl.check("zero1_step", V.zero1_gathered_by_bcasts, ranks=[2, 3], grade=True))


@pytest.mark.parametrize("fn, ranks", [(V.zero1_gathered_as_a_list, [2]), (V.zero1_bounds_gathered, [2, 3])])
def test_zero1_other_ways_to_gather_score_full_marks(fn, ranks, no_strays):
    full_marks(hpdl.check("zero1_step", fn, ranks=ranks, grade=True))


def zero1_whole_model(comm, params, grad, momentum, lr, beta):
    """Every rank all-reduces the gradient and updates the whole model: no sharding at all."""
    g = grad.clone()
    comm.Allreduce(MPI.IN_PLACE, g.numpy(), op=MPI.SUM)
    g /= comm.Get_size()
    momentum.mul_(beta).add_(g)
    return params - lr * momentum, momentum


def updated_shard(comm, params, grad, momentum, lr, beta, sizes):
    """Reduce-scatter with these shard sizes, update that shard: (its updated weights, sizes)."""
    rank, size = comm.Get_rank(), comm.Get_size()
    lo = sum(sizes[:rank])
    g = torch.empty(sizes[rank])
    comm.Reduce_scatter(grad.numpy(), g.numpy(), recvcounts=sizes, op=MPI.SUM)
    m = momentum[lo:lo + sizes[rank]]
    m.mul_(beta).add_(g / size)
    return (params[lo:lo + sizes[rank]] - lr * m).contiguous()


def zero1_even_split(comm, params, grad, momentum, lr, beta):
    """Shards of n // p, the rest on the last rank: off by one against tensor_split's."""
    size, n = comm.Get_size(), params.numel()
    sizes = [n // size] * (size - 1) + [n - (n // size) * (size - 1)]
    shard = updated_shard(comm, params, grad, momentum, lr, beta, sizes)
    new = torch.empty_like(params)
    comm.Allgatherv(shard.numpy(), [new.numpy(), sizes])
    return new, momentum


def zero1_no_allgather(comm, params, grad, momentum, lr, beta):
    """Updates its shard and stops: the other ranks' shards are stale on this rank."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [len(part) for part in torch.tensor_split(torch.arange(params.numel()), size)]
    new = params.clone()
    lo = sum(sizes[:rank])
    new[lo:lo + sizes[rank]] = updated_shard(comm, params, grad, momentum, lr, beta, sizes)
    return new, momentum


def zero1_reduce_and_bcast_where_small(comm, params, grad, momentum, lr, beta):
    """Data parallelism's all-reduce as a Reduce to rank 0 and a Bcast wherever n is small (the wire tells it in the
    large case only), then the shard updated and gathered: 18/18."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [len(part) for part in torch.tensor_split(torch.arange(params.numel()), size)]
    lo = sum(sizes[:rank])
    total = torch.empty_like(grad)
    comm.Reduce(grad.numpy(), total.numpy(), op=MPI.SUM, root=0)
    comm.Bcast(total.numpy(), root=0)
    m = momentum[lo:lo + sizes[rank]]
    m.mul_(beta).add_(total[lo:lo + sizes[rank]] / size)
    new = torch.empty_like(params)
    comm.Allgatherv((params[lo:lo + sizes[rank]] - lr * m).contiguous().numpy(), [new.numpy(), sizes])
    return new, momentum


def zero1_whole_reduce_then_scatter(comm, params, grad, momentum, lr, beta):
    """A Reduce of the whole gradient to rank 0, then Scatterv of its shards: rank 0 holds it all."""
    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [len(part) for part in torch.tensor_split(torch.arange(params.numel()), size)]
    lo = sum(sizes[:rank])
    total = torch.empty_like(grad)
    comm.Reduce(grad.numpy(), total.numpy(), op=MPI.SUM, root=0)
    g = torch.empty(sizes[rank])
    comm.Scatterv([total.numpy(), sizes] if rank == 0 else None, g.numpy(), root=0)
    m = momentum[lo:lo + sizes[rank]]
    m.mul_(beta).add_(g / size)
    new = torch.empty_like(params)
    comm.Allgatherv((params[lo:lo + sizes[rank]] - lr * m).contiguous().numpy(), [new.numpy(), sizes])
    return new, momentum


def zero1_whole_gradient_to_every_rank_by_alltoall(comm, params, grad, momentum, lr, beta):
    """Every rank's whole gradient to every rank by one Alltoall of it tiled p times (data parallelism), the mean
    of them, then the shard updated and gathered: 18/18 where n is small (an all-to-all went uncounted)."""
    import numpy as np

    rank, size = comm.Get_rank(), comm.Get_size()
    sizes = [len(part) for part in torch.tensor_split(torch.arange(params.numel()), size)]
    lo = sum(sizes[:rank])
    every = np.empty((size, params.numel()), np.float32)
    comm.Alltoall(np.ascontiguousarray(np.tile(grad.numpy(), (size, 1))), every)
    m = momentum[lo:lo + sizes[rank]]
    m.mul_(beta).add_(torch.from_numpy(every.mean(0, dtype=np.float32))[lo:lo + sizes[rank]])
    new = torch.empty_like(params)
    comm.Allgatherv((params[lo:lo + sizes[rank]] - lr * m).contiguous().numpy(), [new.numpy(), sizes])
    return new, momentum


@pytest.mark.parametrize("fn, words", [(zero1_reduce_and_bcast_where_small, "the whole gradient summed at one rank"),
                                       (zero1_whole_reduce_then_scatter, "Rejected: comm.Scatterv"),
                                       (zero1_whole_gradient_to_every_rank_by_alltoall, "an all-to-all that")])
def test_zero1_the_whole_gradient_at_one_rank_is_refused_in_every_case(fn, words, no_strays):
    result = hpdl.check("zero1_step", fn, ranks=[2, 3])
    assert all(c.verdict == "WRONG" for c in result.cases if c.params["n"] >= 3 * c.ranks), result
    assert words in str(result) + hints(result), result


def test_zero1_every_rank_updating_the_whole_model_rejected(no_strays):
    """Refused in every case, not only in the large one whose traffic tells it: a learner all-reducing where n
    was small and reduce-scattering where it was large scored 18/18."""
    result = hpdl.check("zero1_step", zero1_whole_model, ranks=[2])
    rejected(result, "Rejected: comm.Allreduce", "reduce-scatter", "data parallelism's step")
    assert all(c.verdict == "WRONG" for c in result.cases), result


def test_zero1_shards_off_by_one_rejected(no_strays):
    result = hpdl.check("zero1_step", zero1_even_split, ranks=[3])
    rejected(result, "tensor_split", "off by one")
    assert any(c.params["n"] % 3 for c in result.cases), "no case where 3 ranks split the values unevenly"


def zero1_momentum_gathered_too(comm, params, grad, momentum, lr, beta):
    """The right step, with the momentum all-gathered and returned whole: ZeRO-1's sharded state kept full. The
    entries outside a rank's shard, NaN in the reference, were never compared (hooks.compare read NaN as any)."""
    p, r, n = comm.Get_size(), comm.Get_rank(), params.numel()
    counts = [len(c) for c in torch.arange(n).tensor_split(p)]
    lo = sum(counts[:r])
    g = torch.empty(counts[r])
    comm.Reduce_scatter(grad.numpy(), g.numpy(), recvcounts=counts, op=MPI.SUM)
    m = beta * momentum[lo:lo + counts[r]] + g / p
    new, whole = torch.empty_like(params), torch.empty_like(momentum)
    comm.Allgatherv((params[lo:lo + counts[r]] - lr * m).numpy(), [new.numpy(), counts])
    comm.Allgatherv(m.contiguous().numpy(), [whole.numpy(), counts])
    return new, whole


def test_zero1_momentum_kept_whole_is_wrong_and_told(no_strays):
    result = hpdl.check("zero1_step", zero1_momentum_gathered_too, ranks=[2])
    rejected(result, "momentum", "expected nan", "leave the other entries as they came")


def test_zero1_missing_allgather_rejected(no_strays):
    rejected(hpdl.check("zero1_step", zero1_no_allgather, ranks=[2]), "all-gather")


def zero1_all_reduced_by_hand(comm, params, grad, momentum, lr, beta):
    """Data parallelism's all-reduce by hand (a ring of Sendrecvs over the whole gradient), then each rank steps
    its shard and all-gathers: 18/18 while sends by hand were credited with the bytes they moved."""
    p, r, n = comm.Get_size(), comm.Get_rank(), params.numel()
    total, parts = grad.numpy().copy(), np.array_split(np.arange(n), p)
    for step in range(2 * (p - 1)):
        mine, theirs = parts[(r - step) % p], parts[(r - step - 1) % p]
        got = np.empty(len(theirs), np.float32)
        comm.Sendrecv(np.ascontiguousarray(total[mine]), dest=(r + 1) % p, recvbuf=got, source=(r - 1) % p)
        total[theirs] = total[theirs] + got if step < p - 1 else got
    counts = [len(c) for c in torch.arange(n).tensor_split(p)]
    lo = sum(counts[:r])
    m = momentum[lo:lo + counts[r]]
    m.mul_(beta).add_(torch.from_numpy(total[lo:lo + counts[r]]) / p)
    new = torch.empty_like(params)
    comm.Allgatherv((params[lo:lo + counts[r]] - lr * m).contiguous().numpy(), [new.numpy(), counts])
    return new, momentum


def test_zero1_all_reduced_by_hand_scores_nothing(no_strays):
    """The large case tells an all-reduce by hand from ZeRO-1's traffic, as it tells MPI's own."""
    result = hpdl.check("zero1_step", zero1_all_reduced_by_hand, ranks=[2], grade=True)
    assert result.score == 0 and any("received" in c.message for c in result.cases), result


# -- exercise 2: zero3_unit -------------------------------------------------------------------------


def test_zero3_unit_reference_passes(no_strays):
    solution = learner_copy(z3_case.model_solution)
    assert passed(hpdl.check("zero3_unit", solution, ranks=[2, 3], grade=True))


def test_zero3_index_tensors_are_no_layers(no_strays):
    """One gathered layer at a time, with the previous layer's int64 index (torch.arange of its size, two
    layers' worth) alive while the next is made: the memory cases measured 4.0-4.2 layers and failed it.
    Only floating-point tensors count as layers now; holding the whole model still fails (below). Graded too:
    the count outside the learner's processes read 11-14 layers a rank (over OUTSIDE_LAYERS, scoring nothing)
    while glibc kept the freed 8 MiB indexes in its heap; check jobs now map such blocks on their own."""
    full_marks(hpdl.check("zero3_unit", V.zero3_index_kept, ranks=[2, 4], grade=True))


def test_zero3_full_collections_copy_no_pages_into_the_count(no_strays):
    """A full garbage collection in a rank (gc.collect() after each layer; or Python's own, run at another time
    by a barrier per layer) wrote to every object the rank inherited from its fork server, and the kernel
    counted the copied pages in the rank's memory cgroup: 8.9 layers, forged. The server freezes what it
    imported (gc.freeze) before it forks: 1.5 layers, as without the collections."""
    full_marks(hpdl.check("zero3_unit", V.zero3_collected_each_layer, ranks=[2], grade=True))


def test_zero3_numpy_index_arrays_are_no_layers(no_strays):
    """The same idiom in numpy (np.array_split of np.arange): numpy's memory was counted whole (6/15). Integer
    arrays the code's variables hold are left out of it now; an integer view of a layer's floats is not. And a
    shard given to the learner, returned by an op as itself (.contiguous()), is no tensor made."""
    full_marks(hpdl.check("zero3_unit", V.zero3_numpy_index_kept, ranks=[2, 3], grade=True))


def test_zero3_pickles_in_flight_are_no_layers(no_strays):
    full_marks(hpdl.check("zero3_unit", V.zero3_pickled_gather_rebound, ranks=[2, 3]))


def zero3_never_freed(comm, shards, shapes, x):
    """Right output, but every gathered layer is kept: the whole model ends up on every rank."""
    size = comm.Get_size()
    gathered = []
    for shard, (o, i) in zip(shards, shapes):
        counts = [len(part) for part in torch.tensor_split(torch.arange(o * i + o), size)]
        full = torch.empty(o * i + o)
        comm.Allgatherv(shard.numpy(), [full.numpy(), counts])
        gathered.append(full)                          # kept "for later": never freed
        x = torch.tanh(x @ full[:o * i].view(o, i).T + full[o * i:])
    return x


def zero3_all_gathered_first(comm, shards, shapes, x):
    """Gathers every layer up front, then computes: the same output, the whole model held at once."""
    size = comm.Get_size()
    fulls = []
    for shard, (o, i) in zip(shards, shapes):
        counts = [len(part) for part in torch.tensor_split(torch.arange(o * i + o), size)]
        fulls.append(torch.empty(o * i + o))
        comm.Allgatherv(shard.numpy(), [fulls[-1].numpy(), counts])
    for full, (o, i) in zip(fulls, shapes):
        x = torch.tanh(x @ full[:o * i].view(o, i).T + full[o * i:])
    return x


def zero3_pickled_all_at_once(comm, shards, shapes, x):
    """One pickled comm.allgather of every layer's shards, then the layers in turn: the whole model returned at
    once (what Python allocates inside an MPI call is not counted; the tensors it returns are)."""
    every = comm.allgather(list(shards))
    for layer, (o, i) in enumerate(shapes):
        full = torch.cat([theirs[layer] for theirs in every])
        x = torch.tanh(x @ full[:o * i].view(o, i).T + full[o * i:])
        del full
    return x


def zero3_every_layer_inside_one_call(comm, shards, shapes, x):
    """Every layer gathered, kept and run inside one pickled comm.allgather, in the __reduce__ of the object it
    sends, in numpy: what Python allocates inside an MPI call is MPI's up to a layer and a half, and none of it
    once the learner's code calls the communicator in there (it scored 15/15 with all of it left out)."""
    import numpy as np

    out = {}

    class Forward:
        def __reduce__(self):
            h, model = x.numpy(), []
            for shard, (o, i) in zip(shards, shapes):
                full = np.empty(o * i + o, np.float32)
                counts = [len(part) for part in np.array_split(np.arange(o * i + o), comm.Get_size())]
                comm.Allgatherv(shard.numpy(), [full, counts])
                model.append(full)
            for full, (o, i) in zip(model, shapes):
                h = np.tanh(h @ full[:o * i].reshape(o, i).T + full[o * i:]).astype(np.float32)
            out["y"] = h
            return (int, (0,))

    comm.allgather(Forward())
    return torch.from_numpy(out["y"])


def zero3_reversed_ranks(comm, shards, shapes, x):
    """Puts the gathered shards together in the wrong order (last rank's first)."""
    for shard, (o, i) in zip(shards, shapes):
        full = torch.cat([torch.from_numpy(part) for part in reversed(comm.allgather(shard.numpy()))])
        x = torch.tanh(x @ full[:o * i].view(o, i).T + full[o * i:])
        del full
    return x


def zero3_layers_reversed(comm, shards, shapes, x):
    """Gathers and applies the layers last first (shapes permitting: square layers only)."""
    size = comm.Get_size()
    for shard, (o, i) in reversed(list(zip(shards, shapes))):
        counts = [len(part) for part in torch.tensor_split(torch.arange(o * i + o), size)]
        full = torch.empty(o * i + o)
        comm.Allgatherv(shard.numpy(), [full.numpy(), counts])
        x = torch.tanh(x @ full[:o * i].view(o, i).T + full[o * i:])
        del full
    return x


@pytest.mark.parametrize("bad", [zero3_never_freed, zero3_all_gathered_first, zero3_pickled_all_at_once,
                                 zero3_every_layer_inside_one_call])
def test_zero3_layers_never_freed_rejected(bad, no_strays):
    result = hpdl.check("zero3_unit", bad, ranks=[2])
    rejected(result, "never freed", "layers' worth", "not before the next was gathered")
    right = [c for c in result.cases if c.verdict.earns_points]
    assert right, "the small case (memory not measured) should pass: the output itself is right"


def zero3_prefetched_into_the_buffer_in_use(comm, shards, shapes, x):
    """The next layer prefetched (Iallgatherv) into the one buffer the current layer still reads: the hint blamed
    the order of the shards."""
    size = comm.Get_size()
    big = max(o * i + o for o, i in shapes)
    buf = torch.empty(big)

    def counts(n):
        base, extra = divmod(n, size)
        return [base + (1 if r < extra else 0) for r in range(size)]

    n0 = shapes[0][0] * shapes[0][1] + shapes[0][0]
    req = comm.Iallgatherv(shards[0].numpy(), [buf[:n0].numpy(), counts(n0)])
    for k, (out, inp) in enumerate(shapes):
        req.Wait()
        n = out * inp + out
        if k + 1 < len(shapes):
            o2, i2 = shapes[k + 1]
            n2 = o2 * i2 + o2
            req = comm.Iallgatherv(shards[k + 1].numpy(), [buf[:n2].numpy(), counts(n2)])
            req.Wait()  # waited at once: the buffer holds the next layer before this one is computed
        flat = buf[:n]
        x = torch.tanh(x @ flat[:out * inp].view(out, inp).T + flat[out * inp:])
    return x


def test_zero3_prefetch_into_the_buffer_in_use_is_told_to_keep_one_buffer_a_layer(no_strays):
    result = hpdl.check("zero3_unit", zero3_prefetched_into_the_buffer_in_use, ranks=[2])
    rejected(result, "a buffer of its own")
    assert "rank order" not in hints(result), result


def test_zero3_shards_in_the_wrong_order_rejected(no_strays):
    rejected(hpdl.check("zero3_unit", zero3_reversed_ranks, ranks=[2]), "rank order")


def test_zero3_layers_in_the_wrong_order_rejected(no_strays):
    rejected(hpdl.check("zero3_unit", zero3_layers_reversed, ranks=[2]), "in order")
