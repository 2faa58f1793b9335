"""The checks of lesson 10 on real ranks: the model solutions pass as a learner's copy, and each
known-bad implementation is rejected with the reason named — micro-batch gradients summed
without scaling, a send/recv order that deadlocks (HANG, with the stuck rank and line), a stage
that skips the backward send, a tensor-parallel layer missing its all-reduce, an uneven split
dropping columns.

That the solutions of solutions/10_model_parallelism.ipynb, as learners are shown them, earn
full marks at 1–4 ranks (hidden cases included) is tested by running it in grade mode
(test_notebooks.py). Every check runs on fresh MPI ranks (mpiexec jobs).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpdl
from hpdl.checker.cases import column_parallel_linear as cpl_case
from hpdl.checker.cases import pipeline_step as pipe_case
from conftest import learner_copy, passed, rejected

rows_of = learner_copy(cpl_case.rows_of)  # the learner's own copy: case modules are not importable in a check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "10_model_parallelism.ipynb"


# -- exercise 1: pipeline_step ----------------------------------------------------------------------


def test_pipeline_step_reference_passes(no_strays):
    assert passed(hpdl.check("pipeline_step", learner_copy(pipe_case.model_solution), ranks=[3]))


def stage_unscaled(comm, stage, microbatches, targets):
    """Micro-batch gradients summed: each loss backpropagated without the 1/m."""
    rank, size = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == size - 1
    kept = []
    for i, x in enumerate(microbatches):
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = F.cross_entropy(y, targets[i])
        else:
            comm.Send(y.detach().numpy(), dest=rank + 1)
        kept.append((x, y))
    for x, y in kept:
        if last:
            y.backward()
        else:
            g = torch.empty_like(y)
            comm.Recv(g.numpy(), source=rank + 1)
            y.backward(g)
        if not first:
            comm.Send(x.grad.numpy(), dest=rank - 1)
    return sum(y.item() for _, y in kept) / len(kept) if last else None


def stage_deadlock(comm, stage, microbatches, targets):
    """Waits for the gradient before sending the activation it depends on: rank 0 and 1 wait for each other."""
    rank, size = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == size - 1
    m = len(microbatches)
    loss = 0.0
    for i, x in enumerate(microbatches):
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            out = F.cross_entropy(y, targets[i]) / m
            loss += out.item()
            out.backward()
        else:
            g = torch.empty_like(y)
            comm.Recv(g.numpy(), source=rank + 1)   # the gradient first ...
            comm.Send(y.detach().numpy(), dest=rank + 1)   # ... then the activation it needs
            y.backward(g)
        if not first:
            comm.Send(x.grad.numpy(), dest=rank - 1)
    return loss if last else None


def stage_no_backward_send(comm, stage, microbatches, targets):
    """Forgets to send x.grad back: the previous stage waits for it forever."""
    rank, size = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == size - 1
    m = len(microbatches)
    kept = []
    for i, x in enumerate(microbatches):
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = F.cross_entropy(y, targets[i]) / m
        else:
            comm.Send(y.detach().numpy(), dest=rank + 1)
        kept.append((x, y))
    for x, y in kept:
        if last:
            y.backward()
        else:
            g = torch.empty_like(y)
            comm.Recv(g.numpy(), source=rank + 1)
            y.backward(g)
    return sum(y.item() for _, y in kept) if last else None


def stage_forward_only_comm(comm, stage, microbatches, targets):
    """No backward messages at all: the earlier stages never get a gradient."""
    rank, size = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == size - 1
    m = len(microbatches)
    loss = 0.0
    for i, x in enumerate(microbatches):
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
        y = stage(x)
        if last:
            out = F.cross_entropy(y, targets[i]) / m
            loss += out.item()
            out.backward()
        else:
            comm.Send(y.detach().numpy(), dest=rank + 1)
    return loss if last else None


def stage_whole_batch(comm, stage, microbatches, targets):
    """Right gradients, but one message for the whole batch: no pipelining."""
    rank, size = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == size - 1
    x = torch.cat(microbatches)
    if not first:
        comm.Recv(x.numpy(), source=rank - 1)
        x.requires_grad_()
    y = stage(x)
    if last:
        loss = F.cross_entropy(y, torch.cat(targets))
        loss.backward()
    else:
        comm.Send(y.detach().numpy(), dest=rank + 1)
        g = torch.empty_like(y)
        comm.Recv(g.numpy(), source=rank + 1)
        y.backward(g)
    if not first:
        comm.Send(x.grad.numpy(), dest=rank - 1)
    return loss.item() if last else None


def test_pipeline_step_unscaled_microbatch_grads_rejected(no_strays):
    rejected(hpdl.check("pipeline_step", stage_unscaled, ranks=[2]), "times the single device", "1/")


@pytest.mark.parametrize("bad, stuck", [(stage_deadlock, {0, 1}), (stage_no_backward_send, {0})])
def test_pipeline_step_hang_names_rank_and_line(bad, stuck, no_strays):
    result = hpdl.check("pipeline_step", bad, ranks=[3], timeout=12)
    hung = [c for c in result.cases if c.verdict == "HANG"]
    assert hung, [c.verdict for c in result.cases]
    first = hung[0]
    assert stuck <= set(first.stuck), first.stuck
    where = " ".join(first.stuck.values())
    assert "line" in where and "comm.Recv" in where, where


def test_pipeline_step_no_backward_messages_rejected(no_strays):
    rejected(hpdl.check("pipeline_step", stage_forward_only_comm, ranks=[2]), "backward never reached")


def test_pipeline_step_one_message_per_batch_rejected(no_strays):
    rejected(hpdl.check("pipeline_step", stage_whole_batch, ranks=[2]), "one per micro-batch")


# -- exercise 2: column_parallel_linear -------------------------------------------------------------


def test_column_parallel_linear_reference_passes(no_strays):
    solution = learner_copy(cpl_case.rows_of, cpl_case.model_solution)
    assert passed(hpdl.check("column_parallel_linear", solution, ranks=[3], grade=True))


def tp_no_allreduce(comm, x, weight, bias, grad_y):
    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(p) for p in comm.allgather((x @ w.T + b).numpy())], dim=1)
    g = grad_y[:, lo:hi]
    return y, g @ w, g.T @ x, g.sum(0)           # grad_x: this rank's part only


def tp_even_split(comm, x, weight, bias, grad_y):
    k = weight.shape[0] // comm.Get_size()       # drops the last out % p rows
    lo, hi = comm.Get_rank() * k, (comm.Get_rank() + 1) * k
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(p) for p in comm.allgather((x @ w.T + b).numpy())], dim=1)
    g = grad_y[:, lo:hi]
    grad_x = (g @ w).contiguous()
    comm.Allreduce(MPI.IN_PLACE, grad_x.numpy(), op=MPI.SUM)
    return y, grad_x, g.T @ x, g.sum(0)


def tp_whole_layer_here(comm, x, weight, bias, grad_y):
    return x @ weight.T + bias, grad_y @ weight, grad_y.T @ x, grad_y.sum(0)


def test_column_parallel_missing_allreduce_rejected(no_strays):
    rejected(hpdl.check("column_parallel_linear", tp_no_allreduce, ranks=[2]), "grad_x", "all-reduce")


def test_column_parallel_uneven_split_dropping_columns_rejected(no_strays):
    result = hpdl.check("column_parallel_linear", tp_even_split, ranks=[3])
    rejected(result, "tensor_split")
    even = [c for c in result.cases if c.params["out"] % 3 == 0]
    assert not even, "a case where 3 ranks split the outputs evenly would not tell the two splits apart"


def test_column_parallel_whole_layer_on_one_rank_rejected(no_strays):
    rejected(hpdl.check("column_parallel_linear", tp_whole_layer_here, ranks=[2]), "nan", "does not hold")
