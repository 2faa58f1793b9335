"""The checks of lesson 10 on real ranks: the model solutions pass as a learner's copy, and each
known-bad implementation is rejected with the reason named — GPipe's order (right gradients, too
much memory), a pipe never filled, gradients not accumulated over micro-batches, micro-batch
losses unscaled or weighted 1/m when their sizes differ, chunk(m) where m does not divide the
batch, a send/recv order that deadlocks (HANG, with the stuck rank and line), one that finishes only
while MPI sends small messages at once (blocking Sends both ways, or Isends waited for at once: WRONG,
by the replay), a stage that skips the backward send, the kit's own 1F1B order (refused), a
tensor-parallel layer missing its all-reduce, an uneven split dropping columns, a layer that gathers
the whole weight first (seen in the bytes the kernel counted reaching each rank).

That the solutions of solutions/10_model_parallelism.ipynb, as learners are shown them, earn
full marks at 1–4 ranks (hidden cases included) is tested by running it in grade mode
(test_notebooks.py). Every check runs on fresh MPI ranks (mpiexec jobs).
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI

import hpdl
from hpdl.checker.cases import Wrong
from hpdl.checker.cases import column_parallel_linear as cpl_case
from hpdl.checker.cases import pipeline_step as pipe_case
from conftest import hints, learner_copy, passed, rejected

rows_of = learner_copy(cpl_case.rows_of)  # the learner's own copy: case modules are not importable in a check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = "10_model_parallelism.ipynb"


# -- exercise 1: pipeline_step (1F1B over mpi4py) ---------------------------------------------------

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
from learner_pipeline import run_order  # noqa: E402  (a learner's step in any order)

one_f_one_b = learner_copy(pipe_case.one_f_one_b)  # the learner's own copy of the order (the kit's is refused)


def test_pipeline_step_reference_passes(no_strays):
    assert passed(hpdl.check("pipeline_step", learner_copy(pipe_case.model_solution), ranks=[3]))


def stage_blocking_sends(comm, stage, batch, targets, m):
    """Right gradients, 1F1B's order, every message a blocking Send: right only while MPI sends them at once
    (eager, small messages); stage s sends an activation while stage s+1 sends it a gradient, and once each
    Send waits for its Recv both wait for ever (18/18 once: the pipeline's checks keep MPI's eager sends)."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch))


def stage_isend_waited_at_once(comm, stage, batch, targets, m):
    """The same with each message an Isend waited for at once: a Send by another name (10/10 once)."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch),
                     send_by="Isend")


def stage_persistent_send_waited_at_once(comm, stage, batch, targets, m):
    """The same with each message a persistent send (Send_init) started and waited for at once (10/10 once)."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch),
                     send_by="Send_init")


def stage_gpipe(comm, stage, batch, targets, m):
    """Right gradients, GPipe's order: all forwards, then all backwards."""
    order = [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch))


def stage_no_warmup(comm, stage, batch, targets, m):
    """Right gradients, one micro-batch at a time on every stage: the pipe never fills."""
    order = [op for i in range(m) for op in (("F", i), ("B", i))]
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch))


def stage_not_accumulated(comm, stage, batch, targets, m):
    """1F1B, but p.grad zeroed before each backward: only the last micro-batch's gradient is left."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch), True)


def stage_unscaled(comm, stage, batch, targets, m):
    """1F1B, micro-batch losses summed: each backpropagated without its share of the batch."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: 1.0)


def stage_equal_weights(comm, stage, batch, targets, m):
    """1F1B, each micro-batch's mean loss weighted 1/m: wrong when the micro-batches differ in size."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: 1 / m)


def stage_loss_everywhere(comm, stage, batch, targets, m):
    """Right 1F1B, returning 0.0 where the statement says None: a driver that finds the loss stage by
    `loss is not None` logs zeros (18/18 once: only the last stage's return was read)."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    loss = run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch))
    return 0.0 if loss is None else loss


def stage_chunk(comm, stage, batch, targets, m):
    """1F1B over batch.chunk(m): fewer than m micro-batches, or other sizes, when m does not divide B."""
    parts = batch.chunk(m)
    order = one_f_one_b(comm.Get_size(), len(parts), comm.Get_rank())
    return run_order(comm, stage, parts, targets, order, lambda rows: rows / len(batch))


def stage_no_backward_send(comm, stage, batch, targets, m):
    """Forgets to send x.grad back: the previous stage waits for it forever."""
    order = one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch),
                     send_back=False)


def stage_deadlock(comm, stage, batch, targets, m):
    """Waits for the gradient before sending the activation it depends on: ranks 0 and 1 wait for each other."""
    rank, size = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == size - 1
    loss = 0.0
    for x, t in zip(batch.tensor_split(m), targets.tensor_split(m)):
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            out = F.cross_entropy(y, t) * len(x) / len(batch)
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


def stage_forward_only_comm(comm, stage, batch, targets, m):
    """No backward messages at all: the earlier stages never get a gradient."""
    rank, size = comm.Get_rank(), comm.Get_size()
    loss = 0.0
    for x, t in zip(batch.tensor_split(m), targets.tensor_split(m)):
        if rank > 0:
            comm.Recv(x.numpy(), source=rank - 1)
        y = stage(x)
        if rank == size - 1:
            out = F.cross_entropy(y, t) * len(x) / len(batch)
            loss += out.item()
            out.backward()
        else:
            comm.Send(y.detach().numpy(), dest=rank + 1)
    return loss if rank == size - 1 else None


def stage_whole_batch(comm, stage, batch, targets, m):
    """Right gradients, but one message for the whole batch: no pipelining."""
    return run_order(comm, stage, [batch], targets, [("F", 0), ("B", 0)], lambda rows: 1.0)


def stage_kit_schedule(comm, stage, batch, targets, m):
    """The kit's own 1F1B order (hpdl.pipeline.one_f_one_b): refused inside a check."""
    import hpdl.pipeline

    order = hpdl.pipeline.one_f_one_b(comm.Get_size(), m, comm.Get_rank())
    return run_order(comm, stage, batch.tensor_split(m), targets, order, lambda rows: rows / len(batch))


@pytest.mark.parametrize("bad, ranks, words", [
    (stage_gpipe, 2, ["held 4 micro-batches", "at most p - s", "GPipe"]),
    (stage_blocking_sends, 2, ["rank 0 waits in a Send to rank 1; rank 1 waits in a Send to rank 0", "Isend"]),
    (stage_isend_waited_at_once, 2, ["rank 0 waits for its Isend to rank 1", "an Isend waited for at once is a Send"]),
    (stage_persistent_send_waited_at_once, 2, ["rank 0 waits for its Isend to rank 1", "Isend"]),
    (stage_no_warmup, 3, ["1F1B runs F0 F1", "fill the pipe"]),
    (stage_not_accumulated, 2, ["last micro-batch's gradients alone", "accumulate"]),
    (stage_unscaled, 2, ["4 times the single device", "share of the batch"]),
    (stage_equal_weights, 2, ["weighted 1/4", "rows / B"]),
    (stage_chunk, 2, ["tensor_split"]),
    (stage_loss_everywhere, 3, ["rank 0 returned a float", "every other stage returns None"]),
    (stage_forward_only_comm, 2, ["backward never reached"]),
    (stage_whole_batch, 2, ["one per micro-batch"]),
])
def test_pipeline_step_known_bad_rejected(bad, ranks, words, no_strays):
    rejected(hpdl.check("pipeline_step", bad, ranks=[ranks]), *words)


def test_pipeline_step_kit_schedule_refused(no_strays):
    result = hpdl.check("pipeline_step", stage_kit_schedule, ranks=[2])
    assert result.score == 0 and all(c.rejected == "hpdl.pipeline.one_f_one_b" for c in result.cases), result
    assert "exercise" in hints(result)


def _calls(*spec: str) -> list:
    """'S1' a Send to rank 1, 'R0' a Recv from rank 0, 'I1' an Isend, 'J0' an Irecv, 'X1' Sendrecv to/from 1."""
    from hpdl.checker.cases import Call

    names = {"S": "Send", "R": "Recv", "I": "Isend", "J": "Irecv", "X": "Sendrecv"}
    return [Call(names[k], int(r) if k in "SIX" else None, int(r) if k in "RJX" else None) for k, r in spec]


@pytest.mark.parametrize("everyone, left", [
    ([_calls("S1", "S1", "R1", "R1"), _calls("R0", "S0", "R0", "S0")], {0: ("send", 1), 1: ("send", 0)}),  # 1F1B
    ([_calls("I1", "I1", "R1", "R1"), _calls("R0", "I0", "R0", "I0")], None),  # 1F1B by Isend
    ([_calls("S1", "R2"), _calls("S2", "R0"), _calls("S0", "R1")], {0: ("send", 1), 1: ("send", 2), 2: ("send", 0)}),
    ([_calls("X1", "X1"), _calls("X0", "X0")], None),  # Sendrecv both ways
    ([_calls("S1", "R2"), _calls("R0", "S2"), _calls("S0", "R1")], None),  # a ring where one rank receives first
    ([_calls("S1", "S1", "R1", "R1"), _calls("R0", "S2", "R0", "S2", "R2", "S0", "R2", "S0"),
      _calls("R1", "R1", "S1", "S1")], None),  # GPipe by blocking Sends waits but finishes
    # an Irecv from any source is recorded when it completes (after the Send here): posted from the start
    ([_calls("S1", "J1"), _calls("S0", "J0")], None),
    ([_calls("S1"), []], None),  # a receive the recorder did not see: nothing to say
])
def test_the_rendezvous_replay_finds_sends_that_wait_for_each_other(everyone, left):
    """checker/rendezvous.py: every rank's recorded calls replayed with each blocking Send waiting for its
    receive; lenient where the record is not exact, so an honest order is never called a hang."""
    from hpdl.checker import rendezvous

    assert rendezvous.stuck(everyone) == left


@pytest.mark.parametrize("everyone, waits, left", [
    # Isend waited for at once, both ways: a Send by another name
    ([_calls("I1", "R1"), _calls("I0", "R0")], [[(1, 0)], [(1, 0)]], {0: ("wait-post", 1), 1: ("wait-post", 0)}),
    ([_calls("I1", "R1"), _calls("I0", "R0")], [[(2, 0)], [(2, 0)]], None),  # waited for after the Recv
    # a Send, then an Irecv waited for at once: the receive is posted after the Send it must meet
    ([_calls("S1", "J1"), _calls("S0", "J0")], [[(2, 1)], [(2, 1)]], {0: ("send", 1), 1: ("send", 0)}),
    ([_calls("J1", "S1"), _calls("J0", "S0")], [[(2, 0)], [(2, 0)]], None),  # the Irecv posted first
    ([_calls("I1", "J1"), _calls("I0", "J0")], [[(2, 0), (2, 1)], [(2, 0), (2, 1)]], None),  # Waitall of both
    # a Sendrecv returns only once its send was received: here after the second Send it cannot get past
    ([_calls("X1", "R1"), _calls("S0", "S0", "R0")], [[], []], {0: ("wait-post", 1), 1: ("send", 0)}),
    ([_calls("X1", "R1"), _calls("S0", "R0", "S0")], [[], []], None),
])
def test_the_rendezvous_replay_reads_where_requests_completed(everyone, waits, left):
    """Where each Isend's and Irecv's request completed (Context.waits, noted by the recorder): an Isend
    waited for at once, or an Irecv posted after the Send it must meet, waits as a blocking call does (the
    pipeline's 1F1B written so scored 10/10)."""
    from hpdl.checker import rendezvous

    assert rendezvous.stuck(everyone, waits) == left


def test_the_completions_a_learners_rank_sends_back_are_read_as_plain_pairs():
    """Context.waits comes from the learner's process: anything but (calls before it, an earlier call's index)
    within the calls sent is left out, and the replay is then lenient for that request."""
    from hpdl.checker.reference_job import _waits

    sent = [[1, 0], [0, 0], ["1", 0], [5, 2], [True, 0], [2, 1, 0], "x", [3, 2]]
    assert _waits(sent, 3) == [(1, 0), (3, 2)]
    assert _waits({"1": 0}, 3) == [] and _waits(None, 3) == []


@pytest.mark.parametrize("bad, stuck", [(stage_deadlock, {0, 1}), (stage_no_backward_send, {0})])
def test_pipeline_step_hang_names_rank_and_line(bad, stuck, no_strays):
    result = hpdl.check("pipeline_step", bad, ranks=[3], timeout=6)
    hung = [c for c in result.cases if c.verdict == "HANG"]
    assert hung, [c.verdict for c in result.cases]
    first = hung[0]
    assert stuck <= set(first.stuck), first.stuck
    where = " ".join(first.stuck.values())
    assert "line" in where and "comm.Recv" in where, where


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


def tp_grad_x_averaged(comm, x, weight, bias, grad_y):
    """grad_x all-reduced, then divided by p: data parallelism's habit, where the parts are not copies (no hint)."""
    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(p) for p in comm.allgather((x @ w.T + b).numpy())], dim=1)
    g = grad_y[:, lo:hi]
    grad_x = (g @ w).contiguous()
    comm.Allreduce(MPI.IN_PLACE, grad_x.numpy(), op=MPI.SUM)
    return y, grad_x / comm.Get_size(), g.T @ x, g.sum(0)


def test_column_parallel_grad_x_averaged_is_told_to_keep_the_sum(no_strays):
    rejected(hpdl.check("column_parallel_linear", tp_grad_x_averaged, ranks=[2]), "grad_x", "keep the sum")


def tp_whole_layer_here(comm, x, weight, bias, grad_y):
    return x @ weight.T + bias, grad_y @ weight, grad_y.T @ x, grad_y.sum(0)


def tp_gathers_the_weight_first(comm, x, weight, bias, grad_y):
    """Every rank's rows gathered, then the whole layer here: right values, and no tensor parallelism."""
    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    w = torch.cat([torch.from_numpy(a) for a in comm.allgather(weight[lo:hi].numpy())])
    b = torch.cat([torch.from_numpy(a) for a in comm.allgather(bias[lo:hi].numpy())])
    return x @ w.T + b, grad_y @ w, (grad_y.T @ x)[lo:hi], grad_y.sum(0)[lo:hi]


def test_column_parallel_rounding_is_judged_against_the_arrays_scale():
    """A value near zero in a sum of large terms differs by their rounding, not its own: the numbers of
    a right solution once marked WRONG (0.0491247 for 0.0491078, grad_x reaching a few units) pass, and
    an error a thousand times that is still wrong."""
    from hpdl.checker.cases import Context

    case = cpl_case.cases(2)[0]
    expected = [np.array([[4.0, 0.0491078]], np.float32) for _ in range(4)]

    def verdict(value):
        got = [e.copy() for e in expected]
        got[1][0, 1] = value  # grad_x
        return cpl_case.verify(case, Context(case, 0, 2, (), got, expected, []))

    assert verdict(0.0491247) is None
    wrong = verdict(0.0491078 + 0.02)
    assert isinstance(wrong, Wrong) and "grad_x" in wrong.message


def test_column_parallel_missing_allreduce_rejected(no_strays):
    """And no points on one rank, where the rank's rows are the whole layer and there is nothing to reduce:
    a layer computed with no message at all scored 5/20 there."""
    result = hpdl.check("column_parallel_linear", tp_no_allreduce, ranks=[1, 2])
    rejected(result, "grad_x", "all-reduce")
    assert result.score == 0, result


def test_column_parallel_uneven_split_dropping_columns_rejected(no_strays):
    result = hpdl.check("column_parallel_linear", tp_even_split, ranks=[3])
    rejected(result, "tensor_split")
    even = [c for c in result.cases if c.params["out"] % 3 == 0]
    assert not even, "a case where 3 ranks split the outputs evenly would not tell the two splits apart"


def tp_gathers_the_weight_but_in_the_largest_layer(comm, x, weight, bias, grad_y):
    """Honest in the layer of 512 outputs only, once the one whose weight showed on the wire (15/15)."""
    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    if weight.shape[0] != 512:
        w = torch.cat([torch.from_numpy(a) for a in comm.allgather(weight[lo:hi].numpy())])
        b = torch.cat([torch.from_numpy(a) for a in comm.allgather(bias[lo:hi].numpy())])
        return x @ w.T + b, grad_y @ w, (grad_y.T @ x)[lo:hi], grad_y.sum(0)[lo:hi]
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(a) for a in comm.allgather((x @ w.T + b).numpy())], dim=1)
    grad_x = (grad_y[:, lo:hi] @ w).numpy().copy()
    comm.Allreduce(MPI.IN_PLACE, grad_x)
    return y, torch.from_numpy(grad_x), grad_y[:, lo:hi].T @ x, grad_y[:, lo:hi].sum(0)


@pytest.mark.parametrize("fn", [tp_gathers_the_weight_first, tp_gathers_the_weight_but_in_the_largest_layer])
def test_column_parallel_that_gathers_the_weight_is_rejected_by_the_bytes_it_receives(fn, no_strays):
    """Right values on every case; the kernel's count of the bytes reaching each rank gives it away wherever
    the weight outweighs the activations, which is every layer but the one with fewer outputs than ranks,
    and then no case counts. Small layers hid the weight's bytes among the activations' (17/20), and then a
    learner gathering the weight in all but the one large layer scored 15/15."""
    from hpdl.checker.jobs import TELLING

    result = hpdl.check("column_parallel_linear", fn, ranks=[2])
    told = [c for c in result.cases if c.params["out"] * c.params["fan_in"] >= cpl_case.TELLING_WEIGHT]
    assert result.score == 0 and {c.rejected for c in result.cases} == {TELLING}, result
    assert "received" in told[0].message and "weight" in (told[0].hint or ""), told[0]


def tp_grad_x_all_gathered(comm, x, weight, bias, grad_y):
    """Every rank's part of grad_x gathered and summed here: the right sum by an allgather, not an all-reduce."""
    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(p) for p in comm.allgather((x @ w.T + b).numpy())], dim=1)
    g = grad_y[:, lo:hi]
    return y, torch.from_numpy(np.sum(comm.allgather((g @ w).numpy()), axis=0)), g.T @ x, g.sum(0)


def tp_grad_x_all_to_all(comm, x, weight, bias, grad_y):
    """The same allgather by an all-to-all: this rank's part of grad_x tiled, one block for every rank."""
    lo, hi = rows_of(comm.Get_rank(), comm.Get_size(), weight.shape[0])
    w, b = weight[lo:hi], bias[lo:hi]
    y = torch.cat([torch.from_numpy(p) for p in comm.allgather((x @ w.T + b).numpy())], dim=1)
    g = grad_y[:, lo:hi]
    tiled = np.stack([(g @ w).numpy()] * comm.Get_size())
    parts = np.empty_like(tiled)
    comm.Alltoall(tiled, parts)
    return y, torch.from_numpy(parts.sum(axis=0)), g.T @ x, g.sum(0)


@pytest.mark.parametrize("fn", [tp_grad_x_all_gathered, tp_grad_x_all_to_all])
def test_column_parallel_grad_x_all_gathered_and_summed_is_rejected(fn, no_strays):
    """grad_x's parts are small beside y's columns, so the bytes on the wire could not tell an allgather of them
    from an all-reduce (15/15, and 15/15 by an all-to-all); what the rank all-gathers beyond its columns of y
    does."""
    result = hpdl.check("column_parallel_linear", fn, ranks=[2], grade=True)
    rejected(result, "all-gathered", "all-reduce")
    assert result.score == 0, result


def test_column_parallel_whole_layer_on_one_rank_rejected(no_strays):
    rejected(hpdl.check("column_parallel_linear", tp_whole_layer_here, ranks=[2]), "nan", "does not hold")
