"""Right answers written otherwise than the model solutions score full marks, graded: each was failed once
by a check that read a way of writing it as a wrong algorithm or a forged record (tests/fixtures/
honest_variants.py)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import hpdl
from conftest import passed

sys.path.insert(0, str(Path(__file__).parent / "fixtures"))
import honest_variants as H  # noqa: E402


# exercise, the right answer, rank counts (None: the exercise's own), and what it once got or why it is right
WRITTEN_OTHERWISE = [
    # (i, chunk) pickled: the index is the message's metadata, not a value of x (recording._elements)
    ("ring_allreduce", H.ring_chunks_with_their_index, [3]),
    ("ring_allreduce", H.ring_with_a_memoised_plan, [3]),  # a helper memoised with lru_cache goes with the function
    ("ring_allreduce", H.ring_sent_as_lists_of_numpy_scalars, [3]),  # each numpy scalar 11 bytes beside its value
    ("ring_allreduce", H.ring_by_count_and_displacement, [3]),  # only the part of x a send names is checksummed
    ("ring_allreduce", H.ring_waiting_on_copies_of_its_requests, [3]),  # "not finished": the copies were waited on
    ("recursive_doubling", H.recursive_doubling_freed_then_acknowledged, [2, 3]),  # the reply acknowledges
    ("resume_horovod", H.resume_with_a_numpy_epoch, [2]),  # a numpy epoch in a list
    # mpi4py pickles a torch tensor with ~400 bytes beside its values: the readings before each forward allow that
    # much a message, never 3/4 of a micro-batch's activations (pipeline_step.PER_MESSAGE)
    ("pipeline_step", H.pipeline_tensors_pickled, [3]),
    # a forward under no_grad, the stage again with autograd before its backward: 1F1B, as a checkpoint runs it
    ("pipeline_step", H.pipeline_recomputed_by_hand, [2, 3]),
    # what a message or a pass carries beside the work is not counted as the work
    ("pipeline_step", H.pipeline_loss_again_without_autograd, [1, 2]),
    ("pipeline_step", H.pipeline_receiving_from_any_source, [2, 3]),  # every receive from nobody: 0/18
    ("pipeline_step", H.pipeline_with_shapes_first_in_two_parts, [3]),  # one message a micro-batch: 0/18
    ("zero1_step", H.zero1_shards_by_count_and_displacement, [2, 3]),
    ("zero1_step", H.zero1_summed_in_float64, [2]),  # the large hidden case reads the bytes its calls bring
    # a float64 copy of float32 values: each still one value (recording._exact), twice the bytes
    ("ring_allreduce", H.ring_summed_in_float64, [2, 3]),
    ("recursive_doubling", H.recursive_doubling_summed_in_float64, [3, 4]),
    ("zero1_step", H.zero1_gathering_a_torch_slice_pickled, [2]),
    ("ps_exchange", H.ps_with_what_it_sends, [2, 3]),
    # a buffer viewed as bytes is counted in values, not bytes
    ("ps_exchange", H.ps_in_bytearrays, [3]),  # 0/12: "the server sent worker 1 8 values; the new parameters are 1"
    ("ps_exchange", H.ps_in_float64_on_the_wire, [3]),  # 6/12: float64 messages counted as 2n float32 values
    ("ring_allreduce", H.ring_in_uint8_views, [3]),  # 25 of 27 cases WRONG: "a message of 200008 values"
    ("recursive_doubling", H.recursive_doubling_of_python_lists, [2]),  # pickled lists: 9 bytes a float (32/36)
    # dist.group.WORLD.allreduce: "no all-reduce was seen" (0/8)
    ("allreduce_gradients", H.allreduce_gradients_through_the_process_group, [2]),
    ("column_parallel_linear", H.column_parallel_y_padded_in_float64, [3]),  # read as the weight gathered (0/10)
    ("throughput", H.throughput_counting_by_shape, None),  # inputs.shape[0] of batches that were lists (0/5)
    # mpi4py's other ways to say a message: a typecode, keywords, (count, displ) with no type (each once 0)
    ("ring_allreduce", H.ring_with_typecode_specs, [3]),
    ("ring_allreduce", H.ring_by_keywords, [3]),
    ("ring_allreduce", H.ring_by_count_and_displacement_untyped, [3]),
    ("allreduce_gradients", H.allreduce_gradients_in_place_by_keyword, [2]),
    ("column_parallel_linear", H.column_parallel_grad_x_reduce_scattered_then_gathered, [2]),
    # mpi4py.util.pkl5: a header of lengths, the pickle, its out-of-band buffers, read as the object's values
    ("ring_allreduce", H.ring_through_pkl5, [3]),
    ("ps_exchange", H.ps_through_pkl5, [3]),
    ("ring_allreduce", H.ring_by_numpy_counts_and_displacements, [3]),  # numpy's integers in a message spec
    ("ring_allreduce", H.ring_of_interleaved_chunks, [3]),  # chunks of every p-th value
    ("ring_allreduce", H.ring_with_each_chunks_length_sent_first, [3]),  # a header of one value a step
    # pickled bytes (tobytes) are counted in values of x's dtype by their bytes, pickle's few around them aside
    ("ring_allreduce", H.ring_pickled_as_bytes, [3]),  # 0/27: "a message of 24 values" for 3 float64
    ("recursive_doubling", H.recursive_doubling_pickled_as_bytes, [3]),
    ("ps_exchange", H.ps_pickled_as_bytes, [3]),  # 0/12: "the server sent worker 1 40 values"
    # a worker may receive what the server's messages to it were recorded to carry: 19 bytes a numpy scalar
    ("ps_exchange", H.ps_new_parameters_as_numpy_scalars, [3]),  # 0/12 with the large case's 1.9 MB
    ("pipeline_step", H.pipeline_receives_sized_by_probe, [2, 3]),  # a probe counted as a message received: 0/18
]


@pytest.mark.parametrize("exercise, fn, ranks", WRITTEN_OTHERWISE, ids=[f[1].__name__ for f in WRITTEN_OTHERWISE])
def test_right_answers_written_otherwise_get_full_marks(exercise, fn, ranks, no_strays):
    result = hpdl.check(exercise, fn, ranks=ranks, grade=True)
    assert passed(result) and result.score == result.max_score, result


@pytest.mark.xfail(strict=True, reason="zero1's bound counts the bytes reduce-scatters and all-gathers bring; a "
                                       "Reduce's, a Bcast's or a send's credited so bought room for an all-reduce "
                                       "(by hand, or hidden on COMM_SELF): held to float32 until a rank's traffic is "
                                       "told per communicator")
@pytest.mark.parametrize("fn", [H.zero1_reduces_and_bcasts_in_float64, H.zero1_by_hand_in_float64])
def test_zero1_in_float64_by_reduces_or_by_hand_gets_full_marks(fn, no_strays):
    result = hpdl.check("zero1_step", fn, ranks=[2], grade=True)
    assert passed(result) and result.score == result.max_score, result
