"""Right answers written otherwise than the model solutions score full marks, graded: each was failed once
by a check that read a way of writing it as a wrong algorithm or a forged record (tests/fixtures/
honest_variants.py). And one that moves more than the statement asks is told exactly why."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import hpdl
from conftest import passed

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import honest_variants as H  # noqa: E402


def test_ring_chunks_sent_with_their_index_are_one_chunk_each(no_strays):
    """(i, chunk) pickled: the index is the message's metadata, not a value of x (recording._elements)."""
    result = hpdl.check("ring_allreduce", H.ring_chunks_with_their_index, ranks=[3], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_a_helper_memoised_with_lru_cache_goes_with_the_function(no_strays):
    result = hpdl.check("ring_allreduce", H.ring_with_a_memoised_plan, ranks=[3], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_a_resume_returning_a_numpy_epoch_in_a_list(no_strays):
    result = hpdl.check("resume_horovod", H.resume_with_a_numpy_epoch, ranks=[2], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_pipeline_tensors_pickled_by_lower_case_calls_are_not_read_as_a_forged_order(no_strays):
    """mpi4py pickles a torch tensor with ~400 bytes beside its values: the readings before each forward
    allow that much a message, never 3/4 of a micro-batch's activations (pipeline_step.PER_MESSAGE)."""
    result = hpdl.check("pipeline_step", H.pipeline_tensors_pickled, ranks=[3], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_pipeline_activations_recomputed_by_hand(no_strays):
    """A forward under no_grad, the stage again with autograd before its backward: 1F1B, as a checkpoint runs it."""
    result = hpdl.check("pipeline_step", H.pipeline_recomputed_by_hand, ranks=[2, 3], grade=True)
    assert passed(result) and result.score == result.max_score, result


@pytest.mark.parametrize("exercise, fn, ranks", [
    ("pipeline_step", H.pipeline_loss_again_without_autograd, [1, 2]),
    ("zero1_step", H.zero1_shards_by_count_and_displacement, [2, 3]),
    ("ps_exchange", H.ps_with_what_it_sends, [2, 3]),
])
def test_what_a_message_or_a_pass_carries_beside_the_work_is_not_counted_as_the_work(exercise, fn, ranks, no_strays):
    result = hpdl.check(exercise, fn, ranks=ranks, grade=True)
    assert passed(result) and result.score == result.max_score, result


@pytest.mark.parametrize("exercise, fn", [
    ("ps_exchange", H.ps_in_bytearrays),  # 0/12: "the server sent worker 1 8 values; the new parameters are 1"
    ("ring_allreduce", H.ring_in_uint8_views),  # 25 of 27 cases WRONG: "a message of 200008 values"
])
def test_a_buffer_viewed_as_bytes_is_counted_in_values_not_bytes(exercise, fn, no_strays):
    result = hpdl.check(exercise, fn, ranks=[3], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_a_vector_sent_as_a_pickled_list_is_counted_in_values(no_strays):
    result = hpdl.check("recursive_doubling", H.recursive_doubling_of_python_lists, ranks=[2], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_an_all_reduce_through_the_process_groups_own_method_is_seen(no_strays):
    result = hpdl.check("allreduce_gradients", H.allreduce_gradients_through_the_process_group, ranks=[2], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_a_column_parallel_layer_that_all_reduces_y_padded_in_float64(no_strays):
    result = hpdl.check("column_parallel_linear", H.column_parallel_y_padded_in_float64, ranks=[3], grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_a_throughput_meter_counting_samples_by_the_inputs_shape(no_strays):
    result = hpdl.check("throughput", H.throughput_counting_by_shape, grade=True)
    assert passed(result) and result.score == result.max_score, result


def test_a_ring_that_sends_float64_chunks_of_a_float32_vector_is_told_so(no_strays):
    result = hpdl.check("ring_allreduce", H.ring_summed_in_float64, ranks=[2])
    wrong = [c for c in result.cases if c.verdict == "WRONG"]
    assert wrong and all("float32" in c.message and "float64 copy" in (c.hint or "") for c in wrong), result
    assert all(c.verdict == "PASS" for c in result.cases if "float64" in c.name), result
