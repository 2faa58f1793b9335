"""Checks decide on evidence the learner's process cannot make up, and pass right answers.

Classes of attack, each on real ranks (fixtures/evidence_attacks.py):
- inputs a rank can work out for itself: the case's seed is found from the rank's own vector, every
  rank's vector rebuilt, the sum returned without a message. Each check now draws a fresh nonce,
  known to the checker's side only; each learner's rank gets its own inputs as data.
- inputs that carry the answer: the throughput step's time per sample was an attribute of the step
  (and the case's params a frame away). The step is now a proxy asking a helper process to sleep,
  and each check scales the listed times by a factor drawn from its nonce.
- inputs that carry the answer, again: the column-parallel layer's generator (inputs() uses it, so the
  learner's job holds it) drew every rank's rows from the case's seed; the pipeline stage's inputs
  carried the whole model and batch for the reference. Both now hand each rank its own part as data,
  drawn with the check's nonce, and the reference gathers the rest from its own ranks.
- inputs that carry the answer, and a count the learner keeps: the autotune measure held the cost
  formulas and counted its own calls (a tuner could read the best config, or reset the count and
  measure everything). The cost table now lives in the oracle helper, which refuses calls past the
  budget and signs its count; verify() reads the signed count.
- judging code in the learner's process: the tuning-file check ran MPICH through hpdl.tune from the
  learner's rank, where the learner can replace hpdl.tune's functions. MPICH now runs in verify().
- the recorder in the learner's process (its pause flag, its list of calls): rewritable. It keeps a tally of
  what it noted and of the kit's own pauses apart from its attributes, so an ordinary rewrite (a call removed
  or appended, a pause set by hand) voids the check; the tally is in the learner's process too (the attacks
  below that get past it first, _past_the_tally, test the wire behind it). So for the
  exercises built from messages (METERED; the pipeline stage too, whose other stages' layers could come
  by a collective hidden from the recorder) the ranks talk over TCP and the checker reads the kernel's
  byte counters of their connections (checker/meter.py); a rank whose bytes on the wire to any rank
  are not what its recorded calls account for scores nothing in that check, nor do calls that move
  nothing (probes, receives never matched, communicators) buy room for hidden bytes past a cap.
- values moved outside MPI (files every rank of the job can read), or worked out without a message (the
  parameter server's gradients drawn again from their seeds): the kernel's count of what reached each
  rank is below what its result needs; such a check scores nothing. So too for the gradients of the
  data-parallel exercises and the shards of the ZeRO ones, now drawn with the check's nonce.
Tests too weak: on one rank `return x` is right, as is leaving the gradients alone (those cases now run for
no points); a shuffle
seeded by the epoch alone passed (epoch 0 is now also asked with another seed); one tiny
all-reduce from a hook counted as overlap (values all-reduced during backward are now counted);
Reduce+Bcast was no all-reduce to the count (a Reduce now counts as one).
Right answers a check failed: a tree that sends each child its shape first, recursive doubling in
segments (ranks a rank sends to are counted, not messages), and a ring on a communicator of the
learner's own, numbered otherwise (peers are recorded as ranks of the world).
Values moved through files while junk of the right size crosses the wire: each rank now has a view of its own
(checker/isolate.py: its own folder, /tmp, /dev/shm, /proc and PID namespace), so no file of another rank
appears; where that cannot be had, the count of bytes is what tells (the tests marked shared_files).
One all-reduce per gradient tensor, struck from the recording down to one (through torch.distributed or
MPI): the kernel's count of the messages between the ranks (data segments, on torch.distributed's
connections and on MPI's) is held against what one all-reduce of the same size took there before the
learner's code ran (MPI's: mpi4py's pickled allreduce on a fresh communicator with a barrier on either
side, the most messages of the honest ways, so they all pass).
A pipeline stage's order (GPipe's) rewritten to 1F1B's in the list its hooks keep: in one case the checker
holds the last stage still (SIGSTOP, checker/hold.py) and reads from the kernel how many micro-batches'
activations each stage sends before any gradient can come back; a last stage that skips being held
scores nothing too.
Not caught yet (a strict xfail, so a fix shows): ZeRO-3's memory held in arrays the count in the learner's
process never sees, in an inline check; in grading, a hidden case of 4 MiB layers reads what the job held at
once from its memory cgroup.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

import hpdl
from hpdl.checker import sandbox
from hpdl.checker.jobs import FORGED, TELLING, UNWITNESSED

FIXTURES = Path(__file__).parent / "fixtures"
ALONE = "decided on the MPI calls recorded in them alone"  # the check's note when the wire was not read
sys.path.insert(0, str(FIXTURES))
import evidence_attacks as E  # noqa: E402
from test_cases_05_06 import grads_over_mpi  # noqa: E402
from test_check_attacks import no_points  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def all_points(result) -> None:
    assert result.passed and result.score == result.max_score, result


@pytest.mark.parametrize("exercise", ["ring_allreduce", "recursive_doubling"])
def test_a_rank_cannot_rebuild_the_other_ranks_inputs(exercise, no_strays):
    result = hpdl.check(exercise, E.sum_without_messages, ranks=[3])
    no_points(result)
    assert all(c.verdict == "WRONG" for c in result.cases), result


@pytest.mark.parametrize("meter, timed", [(E.throughput_read_from_the_step, False),
                                          (E.throughput_guessed_from_the_listed_costs, False),
                                          (E.throughput_timed, True)])  # a meter that times the steps
def test_the_steps_cost_is_not_in_the_learners_process(meter, timed, no_strays):
    """The listed cost per sample read (from the step, or the case's params a frame away), or guessed from it
    (twice it: the middle of the scales once drawn, 1.3-1.8×, landed in the band for every case): the cost
    is scaled per case by a factor of 0.4-10 drawn with the check's nonce, so a rate not timed lands in
    the band for one case in four, for all five about one check in a thousand."""
    result = hpdl.check("throughput", meter, grade=True)
    if timed:
        all_points(result)
    else:
        assert not result.passed, result


def test_the_steps_seconds_in_the_helpers_receipt_are_sealed(no_strays):
    """The receipt the step hands back is the learner's to read: the seconds the helper measured for each step
    in it were the rate, with no clock (7/7). Sealed with the case's key, they are read on the checker's side."""
    no_points(hpdl.check("throughput", E.throughput_read_from_the_receipt, grade=True))
    from hpdl.checker import oracle

    seconds = [0.25, 1e-3, 3.0]
    assert oracle.unsealed(oracle.sealed(seconds, "key"), "key") == seconds
    assert oracle.unsealed(oracle.sealed(seconds, "key"), "another") != seconds


def test_which_batches_were_stepped_is_the_helpers_word(no_strays):
    """One batch timed, the step's own list of calls rewritten to every batch: the helper that sleeps for the
    step notes each call and signs the list (5/5 before, on the list kept in the learner's process)."""
    result = hpdl.check("throughput", E.throughput_from_one_step_recorded_as_all, grade=True)
    assert not any(c.verdict.earns_points for c in result.cases), result
    assert all("step was called on batches of sizes" in c.message for c in result.cases), result


@pytest.mark.parametrize("attack", [E.autotune_from_the_cost, E.autotune_resets_its_count,
                                    E.autotune_swallows_the_refusal, E.autotune_forges_the_receipt])
def test_the_tuners_costs_and_count_are_not_in_the_learners_process(attack, no_strays):
    no_points(hpdl.check("autotune", attack, ranks=[1], grade=True))


def test_a_tuner_gets_one_budget_not_one_per_rank(no_strays):
    """Graded on one rank: at two, each rank's helper granted a budget of its own, and ranks that split one
    grid and shared their readings over MPI found the valley's best with twice the measurements."""
    result = hpdl.check("autotune", E.autotune_pooled_over_ranks, grade=True)
    assert {c.ranks for c in result.cases} == {1} and result.score < result.max_score, result


def test_the_tuning_file_is_judged_by_mpich_outside_the_learners_process(no_strays):
    result = hpdl.check("tuning_file", E.tuning_file_patched_probe, ranks=[1])
    no_points(result)


@pytest.mark.parametrize("exercise, fn", [("ring_allreduce", E.returns_its_input),
                                          ("average_gradients", E.returns_its_input),
                                          ("allreduce_gradients", E.leaves_the_gradients_alone),
                                          ("overlap_allreduce", E.finish_does_nothing)])
def test_returning_the_input_earns_nothing_on_one_rank_or_more(exercise, fn, no_strays):
    result = hpdl.check(exercise, fn, ranks=[1, 2])
    assert result.score == 0 and result.max_score > 0, result
    assert all(c.verdict.earns_points for c in result.cases if c.ranks == 1), result  # right there, for no points


def test_a_shuffle_that_ignores_the_seed_is_wrong(no_strays):
    result = hpdl.check("shard_indices", E.shard_ignores_seed, ranks=[2])
    assert all(c.verdict == "WRONG" and "seed" in c.message for c in result.cases if c.params["n"] >= 10), result
    assert result.score < result.max_score


@pytest.mark.parametrize("attack, says", [
    (E.overlap_after_backward_recorded_as_overlap, "when backward returned"),
    (E.overlap_after_backward_readings_skipped, "without waiting where the checker reads the wire"),
    (E.overlap_after_backward_readings_moved, "more than the"),
])
def test_all_reduces_after_backward_recorded_as_during_score_nothing(attack, says, no_strays):
    """When the all-reduces ran is read from the wire in backward, outside the learner's process
    (overlap_allreduce's "pause" cases): a recording that says otherwise, a reading skipped or one put
    off until the step's all-reduces are done voids the check."""
    result = hpdl.check("overlap_allreduce", attack, ranks=[2])
    no_points(result)
    assert any(says in (c.message or "") for c in result.cases), result


def test_all_reduces_launched_from_backwards_last_hook_score_nothing_in_the_hidden_case_too(no_strays):
    """Every bucket launched from the hook of backward's last gradient: the recording says all during
    backward, the wire at the cut says none had started. The hidden case was not read and passed (4/8).
    One bucket (25 MiB) has nothing to overlap: right there."""
    result = hpdl.check("overlap_allreduce", E.overlap_launched_from_the_last_hook, ranks=[2], grade=True)
    wrong = [c for c in result.cases if c.params["bucket_mb"] < 25]
    assert len(wrong) == 3 and all(c.verdict == "WRONG" and "when backward reached" in c.message for c in wrong), result


def test_mpi_all_reduces_launched_in_backward_that_did_not_move_are_wrong_not_forged(no_strays):
    """Iallreduce from the hooks, through MPI: launched during backward (its values are counted since the
    MPI collectives' are), but MPICH moves nothing until finish() calls into MPI. No overlap, said so,
    with MPI's progress as the hint; never read as a recording forged (that voided the check: 0/8)."""
    result = hpdl.check("overlap_allreduce", E.overlap_with_mpi_iallreduce, ranks=[3])
    assert FORGED not in {c.rejected for c in result.cases}, result
    wrong = [c for c in result.cases if c.verdict == "WRONG"]
    assert wrong and all("had not moved" in c.message and "progress" in (c.hint or "") for c in wrong), result


def test_mpi_all_reduces_that_crossed_too_late_are_told_of_mpis_progress(no_strays):
    """At two ranks MPICH moves a small Iallreduce's values while launching it, so the hidden case of uneven
    buckets fails on the bytes at the cut instead; its hint said to launch each bucket's all-reduce from the
    hook that completes it, which the code already did. It names MPI's progress now, as at three ranks."""
    result = hpdl.check("overlap_allreduce", E.overlap_with_mpi_iallreduce, ranks=[2], grade=True)
    wrong = [c for c in result.cases if c.verdict == "WRONG"]
    assert wrong and all("had not crossed" in c.message and "progress thread" in (c.hint or "") for c in wrong), \
        result


@pytest.mark.parametrize("slip", [E.overlap_blocking_in_the_hook, E.overlap_waited_for_at_once])
def test_a_hook_that_waits_for_its_all_reduce_is_no_overlap(slip, no_strays):
    """Every bucket crosses during backward and the recording says so, but backward stalls on each one: the
    wire cannot tell (Gloo runs a group's collectives in turn), the checker's clock can. With the last rank
    held back, the others' backward must get past the hooks of every bucket but the first Linear's (8/8
    before)."""
    result = hpdl.check("overlap_allreduce", slip, ranks=[2])
    held = [c for c in result.cases if c.params.get("hold")]
    assert held and all(c.verdict == "WRONG" and "was held back" in c.message for c in held), result
    # every case of more than one bucket holds a rank back (the bucket-per-tensor one passed it: 4/8)
    assert [c.name for c in result.cases if c not in held] == ["5-layer MLP, buckets of 25 MiB (one bucket)"]


def test_one_tiny_allreduce_during_backward_is_not_overlap(no_strays):
    result = hpdl.check("overlap_allreduce", E.overlap_one_tiny_allreduce, ranks=[2])
    several = [c for c in result.cases if "one bucket" not in c.name]
    assert several and all(c.verdict == "WRONG" and "while backward ran" in c.message for c in several), result


@pytest.mark.parametrize("exercise, fn", [("overlap_allreduce", E.overlap_by_torchs_ddp),
                                          ("overlap_allreduce", E.overlap_by_torchs_fsdp),
                                          ("allreduce_gradients", E.allreduce_gradients_coalesced)])
def test_torchs_own_data_parallelism_doing_the_exercise_is_refused(exercise, fn, no_strays):
    """DDP (8/8 with its bucket caps set to the exercise's: its hooks go through the recorded all-reduce), FSDP
    without sharding (a case) and torch's coalesced all-reduce (8/8: one all-reduce of every value) do what the
    exercise asks."""
    result = hpdl.check(exercise, fn, ranks=[2])
    no_points(result)
    assert all("not allowed here" in c.message for c in result.cases), result


def test_reduce_and_bcast_per_tensor_count_as_all_reduces(no_strays):
    result = hpdl.check("allreduce_gradients", E.reduce_then_bcast_per_tensor, ranks=[2])
    assert all(c.verdict == "WRONG" and "all-reduces for" in c.message for c in result.cases), result


def test_the_layer_cannot_be_drawn_again_from_the_case_generator(no_strays):
    no_points(hpdl.check("column_parallel_linear", E.column_parallel_from_the_seed, ranks=[2]))


def test_the_pipeline_stage_arguments_carry_no_other_stage_nor_the_batch(no_strays):
    no_points(hpdl.check("pipeline_step", E.pipeline_from_the_arguments, ranks=[2]))

def test_a_stage_that_took_the_model_by_messages_hidden_from_the_recorder_scores_nothing(no_strays):
    """Right gradients, 1F1B's order and one recorded message per micro-batch each way; the other stages'
    layers and the batch came by collectives the recorder was told to skip, which the kernel counted."""
    result = hpdl.check("pipeline_step", E.pipeline_model_by_hidden_messages, ranks=[2])
    no_points(result)
    assert {c.rejected for c in result.cases if c.ranks > 1} == {FORGED}, result
    assert any("outside your process" in c.message for c in result.cases), result


@pytest.mark.parametrize("fn, words", [
    (E.pipeline_gpipe_recorded_as_1f1b, "before any gradient could come back"),
    (E.pipeline_last_stage_never_held, "not the order it ran in"),  # the readings before forwards tell too
    (E.pipeline_gpipe_after_1f1b_warm_up, "had come back from stage"),
    (E.pipeline_gpipe_after_warm_up_readings_put_off, "reading was not taken before that forward"),
])
def test_a_stage_order_rewritten_in_its_hooks_shows_on_the_wire(fn, words, no_strays):
    """GPipe's order, its hooks' list rewritten to 1F1B's: with the last stage held still, stage 0 of 3
    sends all 4 micro-batches' activations, where 1F1B sends 3 and waits for a gradient. A last stage
    that unhooks its hold gets nothing either. Nor does GPipe run after 1F1B's first forwards and a wait
    (the bytes are 1F1B's while the last stage is held): when its next forward began, read from the wire
    outside its process, no gradient had come back; readings put off until the step is done show more
    activations sent than that forward's stage had made."""
    result = hpdl.check("pipeline_step", fn, ranks=[3])
    no_points(result)
    assert {c.rejected for c in result.cases} == {FORGED} and any(words in c.message for c in result.cases), result


def test_a_stage_order_rewritten_where_the_last_stage_is_not_held_shows_on_the_wire_too(no_strays):
    """1F1B in the one case whose last stage is held, GPipe with its hooks' list rewritten in the others (18/18
    while the wire was read before the forwards in that case alone): every case of more than one micro-batch
    reads it now, and the readings put off to the end show too, in small micro-batches as in large."""
    result = hpdl.check("pipeline_step", E.pipeline_gpipe_but_where_held, ranks=[3])
    no_points(result)
    small = [c for c in result.cases if "width" not in c.name and c.params["micro"] > 1]
    assert small and all(c.rejected == FORGED and "had come back from stage" in c.message for c in small), result


def test_a_stage_that_first_waits_for_the_held_last_stage_is_told_so(no_strays):
    """GPipe behind a barrier: nothing crosses while the last stage is held, so its order is not seen there;
    but no 1F1B stage sends nothing then, as its first forward needs nothing from the stages after it.
    The held case is WRONG, a wrong order and not a forged one (an honest 1F1B behind a barrier waits too),
    with a hint that names the wait."""
    result = hpdl.check("pipeline_step", E.pipeline_gpipe_after_a_barrier, ranks=[3])
    held = [c for c in result.cases if "width 128" in c.name]
    assert held and all(c.verdict == "WRONG" and "not one micro-batch's activations" in c.message for c in held), result
    assert "a barrier" in (held[0].hint or "") and result.score < result.max_score, result


@pytest.mark.skipif(not sandbox.cgroup_works(), reason="no cgroup can be made here to count a check job's memory")
@pytest.mark.parametrize("fn", [E.zero3_every_layer_at_once_peak_reset, E.zero3_every_layer_in_an_arena,
                                E.zero3_one_rank_holds_every_layer])
def test_the_whole_model_held_at_once_is_counted_outside_the_learners_process_in_grading(fn, no_strays):
    """Every layer gathered into arrays the count in the learner's process never sees: in grading, a hidden
    case of 4 MiB layers reads what the job's ranks held at once from its memory cgroup (16 layers each,
    where an honest rank holds 2-6), and the check scores nothing. Its attempt to reset the cgroup's peak
    afterwards, as the checker does between cases, finds it read-only. An arena made in the job's first call
    and kept is counted too: that case is the job's first, counted from before the learner's code is unpacked
    (it was the last, and the arena, made in an earlier case, was in what it counted from: 19/19). One rank
    holding every layer while the others hold one at a time is counted on that rank: each rank's memory has a
    cgroup of its own (counted for the whole job, 16 + 1.4 layers fitted the room of 2 × 10: 5/5)."""
    result = hpdl.check("zero3_unit", fn, ranks=[2], grade=True)
    no_points(result)
    assert {c.rejected for c in result.cases} == {FORGED} and any("memory cgroup" in c.message for c in result.cases)


@pytest.mark.parametrize("fn, says", [(E.zero3_with_the_count_stopped, "stopped or started afresh"),
                                      (E.zero3_in_mpi_memory, "never freed")])
def test_the_memory_counted_in_the_learners_process_is_not_stopped_nor_bypassed_by_mpi_memory(fn, says, no_strays):
    """The cases counted in the learner's process only (layers of 100-150 KiB): the count stopped and started
    afresh scores nothing; memory from MPI.Alloc_mem is counted."""
    result = hpdl.check("zero3_unit", fn, ranks=[2])
    measured = [c for c in result.cases if "memory measured" in c.name]
    assert measured and all(c.verdict == "WRONG" and says in c.message for c in measured), result


def test_a_paused_recorder_does_not_hide_a_forbidden_collective(no_strays):
    no_points(hpdl.check("ring_allreduce", E.paused_recorder_allreduce, ranks=[2]))

def test_a_linear_broadcast_recorded_as_a_tree_shows_on_the_wire_in_every_case(no_strays):
    """Honest in the large hidden case only, linear and hidden from the recorder in the others, whose arrays
    fitted in the bytes a rank may send a peer unrecorded (hooks.WIRE_SLACK): 18/18. Every array is larger now."""
    result = hpdl.check("bcast_binomial", E.bcast_linear_recorded_as_a_tree, ranks=[4], grade=True)
    no_points(result)
    assert FORGED in {c.rejected for c in result.cases}, result


def test_rewritten_calls_do_not_make_a_linear_exchange_a_ring(no_strays):
    no_points(hpdl.check("ring_allreduce", E.forged_ring_calls, ranks=[3]))


@pytest.mark.parametrize("fn", [E.paused_allreduce_recorded_as_a_ring, E.paused_allreduce_with_room_bought])
def test_a_hidden_collective_recorded_as_a_ring_is_seen_on_the_wire(fn, no_strays):
    """The recorder says ring, sizes included (and, bought with calls that move nothing, room for more);
    the kernel saw rank 0 send MPI's Allreduce to rank 2, its non-neighbour."""
    result = hpdl.check("ring_allreduce", fn, ranks=[4])
    no_points(result)
    assert FORGED in {c.rejected for c in result.cases}  # the others WRONG too, or not counted
    assert any("outside your process" in c.message for c in result.cases)


def test_persistent_sends_never_started_move_nothing_and_buy_nothing(no_strays):
    """A persistent request is recorded at each start, not where it is made: sends made and never started were
    the ring's messages to the recorder, and MPI's all-reduce called by its address moved the same bytes."""
    result = hpdl.check("ring_allreduce", E.ring_sends_made_never_started, ranks=[2])
    no_points(result)
    assert FORGED in {c.rejected for c in result.cases}, result
    assert all("moved some other way" in c.message or "outside your process" in c.message
               for c in result.cases), result


def test_small_cases_count_only_beside_a_large_case_that_passes(no_strays):
    """A case too small to show a hidden collective on the wire earns points only if its rank count's large case,
    which would show one, passes: a ring shown beside MPI's all-reduce called by its address passed every small
    case while its large case raised on purpose."""
    result = hpdl.check("ring_allreduce", E.ring_beside_a_large_case_that_raises, ranks=[2])
    no_points(result)
    large = [c for c in result.cases if c.params["n"] > 4096]
    assert [c.verdict for c in large] == ["ERROR"], result
    small = [c for c in result.cases if c not in large]
    assert {c.rejected for c in small} == {UNWITNESSED}, result
    assert all(f"once case {large[0].name} at 2 ranks" in c.message for c in small), result


def test_memory_unseen_in_the_small_cases_counts_only_beside_the_case_counted_outside(no_strays):
    """zero3_unit's smaller cases follow memory in the learner's process, where memory mapped apart is unseen; the
    case of 16 layers counts it outside the ranks, and raised on purpose (12/15)."""
    result = hpdl.check("zero3_unit", E.zero3_unseen_where_the_large_case_raises, ranks=[2], grade=True)
    no_points(result)
    assert {c.rejected for c in result.cases if c.verdict != "ERROR"} == {UNWITNESSED}, result
    assert all("counted in their own processes" in c.message for c in result.cases if c.verdict != "ERROR"), result


@pytest.mark.parametrize("attack", [E.column_parallel_grad_x_gathered_by_address,
                                    E.column_parallel_with_no_call_recorded])
def test_a_column_parallel_layers_values_come_by_its_recorded_collectives(attack, no_strays):
    """MPI_Allgather called at its address in MPI's library: grad_x's parts gathered so and summed, beside y's
    recorded all-gather, or every value moved so with no call recorded (15/15 each). What the right results
    need from the other ranks must be what the recorded collectives could bring."""
    result = hpdl.check("column_parallel_linear", attack, ranks=[2])
    no_points(result)
    assert FORGED in {c.rejected for c in result.cases}, result
    assert any("moved some other way than your MPI calls" in c.message for c in result.cases), result


def test_zero1s_step_comes_by_its_recorded_calls_where_the_bytes_cannot_tell(no_strays):
    """At 3 ranks a ZeRO-1 step's bytes are too close to data parallelism's to judge: MPI's all-reduce called at
    its address, beside the recorded all-gather of the updated shards, scored 6/6. The shard's sum must come
    by a recorded call."""
    result = hpdl.check("zero1_step", E.zero1_all_reduced_by_address, ranks=[3])
    no_points(result)
    assert FORGED in {c.rejected for c in result.cases}, result


def test_the_broadcast_arrays_pack_into_nothing_much_smaller():
    """bcast_binomial's arrays were whole numbers in ±1000 plus a half: packed to 11 bits a value, a linear
    broadcast called at MPI_Send's address hid its copies within the wire's slack beside a tree of zeros
    (20/24). Each array now keeps most of its bytes under compression, above the slack in every case."""
    import zlib

    from hpdl.checker.cases import bcast_binomial, with_nonce
    from hpdl.checker.hooks import WIRE_SLACK

    for p in (2, 3, 4, 8):
        for case in bcast_binomial.cases(p):
            case = with_nonce(case, 20261208)
            x, root = bcast_binomial.inputs(case, case.params["root"], p)
            packed = len(zlib.compress(x.tobytes(), 9))
            assert packed > 0.9 * x.nbytes and packed > 2 * WIRE_SLACK, (case.name, packed, x.nbytes)


@pytest.mark.parametrize("attack", [
    E.ring_decoys_of_a_count_that_reads_zero, E.ring_decoys_of_a_type_as_wide_as_the_chunk, E.ring_decoys_mpi_refused,
    E.ring_decoys_to_itself_on_a_communicator_that_says_inter, E.ring_decoys_pickled_to_nothing,
    E.ring_decoys_pickled_otherwise_for_mpi, E.ring_decoys_to_a_peer_read_two_ways, E.ring_decoys_of_a_spec_subclass,
    E.ring_decoys_exported_empty, E.ring_decoys_pickled_uncounted])
def test_sends_recorded_bigger_than_they_moved_cover_no_hidden_all_reduce(attack, no_strays):
    """A send is recorded as MPI moves it: its count read once, as mpi4py reads it, and handed to MPI so; a type's
    items by its extent; a call MPI refused, not at all; its peers by MPI's own numbering; a pickled one by the
    bytes mpi4py pickled. Each of these decoys was a ring's message to the record, and MPI's all-reduce called by
    its address moved the bytes (27/27 at 2-4 ranks with MPICH switched to its ring through MPI_T)."""
    result = hpdl.check("ring_allreduce", attack, ranks=[2])
    no_points(result)
    assert FORGED in {c.rejected for c in result.cases}, result


def test_a_send_the_recorder_cannot_size_buys_no_room_on_the_wire(no_strays):
    """An object that pickles on the second try only: the recorder's pickle fails, mpi4py's works, so its send
    was recorded with no size, and any bytes to that peer passed: MPI's Allreduce, taken from behind the
    recorder, ran unrecorded between ring neighbours. Such a send now counts nothing."""
    result = hpdl.check("ring_allreduce", E.ring_by_an_allreduce_beside_unsized_sends, ranks=[4])
    no_points(result)
    assert {c.rejected for c in result.cases} == {FORGED} and any("outside your process" in c.message
                                                                 for c in result.cases), result


@pytest.mark.parametrize("exercise, fn, ranks, words", [
    ("ring_allreduce", E.ring_whole_vector_in_a_dict, 3, "one chunk per message"),
    ("ring_allreduce", E.ring_whole_vector_in_ints, 3, "the ring sends"),
    ("recursive_doubling", E.recursive_doubling_by_a_ring, 4, "with each partner once"),
    ("recursive_doubling", E.recursive_doubling_by_a_ring, 3, "with each partner once"),  # not "at the fold-in"
    ("recursive_doubling", E.recursive_doubling_by_a_tree, 4, "one per round"),
    ("recursive_doubling", E.recursive_doubling_by_a_tree, 7, "ranks that each swap with lg p' = 2"),
    ("recursive_doubling", E.recursive_doubling_by_halving, 4, "not the whole vector"),
])
def test_the_message_pattern_is_told_by_the_values_moved(exercise, fn, ranks, words, no_strays):
    """The naive ring, its whole vector in a dict (one key: one element to the recorder's count of the
    message), or in big Python ints (each one value, once); the naive ring where recursive doubling is
    asked (one partner, so never more than lg p); a tree's reduce and broadcast (a partner too few on half
    its ranks at 4; at 7, where the fold-in leaves ranks with one partner too, fewer than p' ranks with lg p',
    where it scored 36/36); recursive halving then gathering (Rabenseifner's: a partner gets half the vector,
    36/36 too). Values are counted per message and per partner, from what each message moved (its bytes
    held against the wire's)."""
    result = hpdl.check(exercise, fn, ranks=[ranks])
    assert result.score < result.max_score and all(c.verdict == "WRONG" for c in result.cases
                                                    if c.params["n"] >= ranks), result  # n < p: all the same
    assert all(words in c.message for c in result.cases if c.params["n"] >= 4 * ranks), result


def test_a_swap_at_the_fold_in_is_told_by_its_second_vector(no_strays):
    """The sums are right, but the rank that sits out was sent its partner's vector as well as the sum: the
    message says so (it said the ring's and the dtype's before, which it is neither)."""
    result = hpdl.check("recursive_doubling", E.recursive_doubling_swapping_at_the_fold_in, ranks=[3])
    twice = [c for c in result.cases if c.params["n"] > 16]  # below, two vectors fit in one and its metadata
    assert twice and all(c.verdict == "WRONG" and "twice" in c.message and "fold-in" in c.hint for c in twice), result


@pytest.mark.parametrize("fn", [E.gradients_gathered_beside_a_tiny_allreduce,
                                E.gradients_gathered_over_mpi_beside_a_tiny_allreduce])
def test_the_one_all_reduce_must_carry_every_gradient_value(fn, no_strays):
    """The gradients all-gathered (p times the data each rank receives, and no reduction), an all-reduce of
    one value beside it for the count of all-reduces: the values all-reduced are counted too."""
    result = hpdl.check("allreduce_gradients", fn, ranks=[2])
    no_points(result)
    assert all("gradient values" in c.message for c in result.cases), result


@pytest.mark.parametrize("ranks", [2, 3])  # at 3 ranks only a rank that reduced by Reduce calls is not judged
def test_an_algorithm_a_large_case_tells_apart_scores_nothing(ranks, no_strays):
    """Traffic that only the large hidden case can tell: an all-reduce of the whole gradient that no record shows
    (MPI_Allreduce called by its address) beside ZeRO-1's recorded calls, a shard's worth each. The small cases
    hide it in the wire's noise; the large case tells, and then no case counts, with a hint that names data
    parallelism's traffic (so too for a column-parallel layer whose weight is gathered, test_cases_10). An
    all-reduce by mpi4py, a Reduce or a Bcast of the whole, a gather through one rank, are refused in every case
    by the recorder's counts (test_cases_11). Right answers still pass: p Reduces, then an all-gather
    (test_right_answers_pass); sums in float64, whose calls bring twice the bytes (test_honest_variants)."""
    result = hpdl.check("zero1_step", E.zero1_allreduced_by_address_beside_a_reduce_scatter, ranks=[ranks], grade=True)
    no_points(result)
    assert {c.rejected for c in result.cases} == {TELLING} and any("received" in c.message for c in result.cases)
    assert any("all-reduces" in (c.hint or "") for c in result.cases), result


def test_float64_reduces_and_bcasts_buy_no_room_for_a_hidden_all_reduce(no_strays):
    """Reduces and Bcasts in float64 bring twice float32's bytes, and right code sent so passes
    (test_honest_variants); beside them, an all-reduce no record shows is still more than they bring."""
    result = hpdl.check("zero1_step", E.zero1_allreduced_by_address_beside_float64_reduces_and_bcasts, ranks=[2],
                        grade=True)
    no_points(result)
    assert {c.rejected for c in result.cases} == {TELLING}, result


@pytest.fixture
def shared_files(monkeypatch):
    """A node where a check's ranks cannot each have a view of their own (a bubblewrap that cannot nest user
    namespaces): they share the job's folder and /tmp, and the wire's count is what tells."""
    from hpdl.checker import sandbox

    monkeypatch.setattr(sandbox, "isolation_works", lambda: False)


apart = pytest.mark.skipif("not hpdl.checker.sandbox.ranks_apart()",  # asked when a marked test runs
                           reason="this node's MPI or sandbox cannot give each rank a view of its own (Intel MPI)")


@apart
def test_a_rank_sees_no_other_ranks_files_nor_processes(no_strays):
    """Each rank writes a file wherever it can and connects a UDP socket to an address naming it, then looks
    for the other ranks' files, sockets and processes. (The ranks share a network namespace: its live tables
    in /proc showed each rank's sockets to the others, an address spelling values with no byte on the wire;
    a rank's /proc holds a copy of them made before MPI started.)"""
    import json

    result = hpdl.check("ring_allreduce", E.what_a_rank_sees, ranks=[3])
    seen = [json.JSONDecoder().raw_decode(c.message.split("SEEN ", 1)[1])[0] for c in result.cases
            if "SEEN " in c.message]
    assert seen, result
    for rank in seen:  # the first rank to raise speaks for its case
        assert rank["wrote"] >= 2, rank  # its own /tmp and /dev/shm at least
        assert rank["others"] == 0 and rank["pid"] == 1 and rank["proc"] == ["1"] and rank["signalled"] == [], rank
        assert rank["sockets"] == 0 and rank["tables"] >= 3, rank
        assert rank["userns"] == "Operation not permitted", rank  # the seccomp filter, installed once isolated


@apart
@pytest.mark.parametrize("exercise, fn", [("ring_allreduce", E.sum_through_files),
                                          ("average_gradients", E.average_through_files_with_junk)])
def test_values_passed_through_files_reach_no_other_rank(exercise, fn, no_strays):
    """Attacks below, where each rank has a view of its own: no file of another rank appears (also when zeros
    of the right size cross the wire, which the count of bytes let through); the check ends as a HANG that
    names the line waiting for it."""
    result = hpdl.check(exercise, fn, ranks=[2], timeout=3)
    no_points(result)
    assert result.cases[0].verdict == "HANG" and "_wait_for" in result.cases[0].message, result


@pytest.mark.parametrize("exercise, fn", [("ring_allreduce", E.sum_through_files),
                                          ("recursive_doubling", E.sum_through_files),
                                          ("bcast_binomial", E.bcast_through_files)])
def test_values_passed_through_files_the_ranks_share_score_nothing(exercise, fn, shared_files, no_strays):
    """Right values, no MPI message: the kernel saw nothing reach the ranks over the network."""
    result = hpdl.check(exercise, fn, ranks=[2, 3])
    no_points(result)
    assert {c.rejected for c in result.cases if c.ranks > 1} == {FORGED}, result


@pytest.mark.parametrize("exercise, fn", [("average_gradients", E.average_through_files),
                                          ("allreduce_gradients", E.allreduce_gradients_through_files),
                                          ("zero1_step", E.zero1_through_files),
                                          ("zero3_unit", E.zero3_through_files),
                                          ("overlap_allreduce", E.overlap_through_files_recorded_as_overlap)])
def test_gradients_and_shards_passed_through_files_score_nothing(exercise, fn, shared_files, no_strays):
    """Data parallelism and sharding without the data moving: right values (the all-reduce exercise's
    count of one satisfied by one all-reduce of one number), and the kernel saw too little reach each rank."""
    result = hpdl.check(exercise, fn, ranks=[3])
    no_points(result)
    assert {c.rejected for c in result.cases} == {FORGED}, result
    assert any("some other way than messages between the ranks" in c.message for c in result.cases), result


@apart
@pytest.mark.parametrize("fn, says", [(E.column_parallel_beside_mpi, "Operation not permitted"),
                                      (E.column_parallel_over_udp, "the checker could not count"),
                                      (E.column_parallel_over_unix_sockets, "Operation not permitted")])
def test_values_moved_beside_the_counted_connections_score_nothing(fn, says, no_strays):
    """The ranks share a network namespace, and the checker lists their TCP connections: the whole weight
    gathered over UDP or an abstract Unix socket (which no listing of TCP shows), or over TCP connections opened
    and closed within the call (gone before any listing), passed every case (no MPI message at all). An
    isolated rank may now open sockets over IP only, and the kernel's counts of connections established and
    UDP datagrams sent in the namespace tell what the checker never listed. Nor may the learner's code listen
    for connections of its own any more (confine.no_new_endpoints)."""
    result = hpdl.check("column_parallel_linear", fn, ranks=[2], grade=True)
    no_points(result)
    assert all(says in c.message for c in result.cases), result


@apart
@pytest.mark.parametrize("fn", [E.ring_through_listening_addresses, E.ring_through_bound_ports_probed])
def test_values_in_the_names_of_sockets_score_nothing(fn, no_strays):
    """No byte on any connection: each rank binds a socket per byte of its vector at an address and port
    that spell it, and the others read them from /proc/net/tcp (listening) or by trying to bind there (taken),
    the ranks sharing one network namespace; a ring of zeros for the recorder and the kernel's count. Every
    case of a vector of up to 512 bytes passed (7/9). Once the learner's code runs, a rank may bind and listen
    no more (MPI's and torch's sockets are made before, every rank connected to every other)."""
    result = hpdl.check("ring_allreduce", fn, ranks=[2], grade=True)
    no_points(result)
    said = [c.message or "" for c in result.cases if "Operation not permitted" in (c.message or "")]
    assert said and all("may open no socket of their own" in m for m in said), result  # and what to do


@pytest.mark.parametrize("exercise, fn", [("zero1_step", E.zero1_on_this_rank_alone),
                                          ("zero3_unit", E.zero3_on_this_rank_alone),
                                          ("pipeline_step", E.pipeline_on_this_rank_alone)])
def test_nothing_distributed_earns_nothing_on_one_rank(exercise, fn, no_strays):
    """On one rank, code with nothing distributed in it is right: its cases still run, for no points (they
    paid 6/24, 6/24 and 4/19, graded), as for the collectives by hand."""
    result = hpdl.check(exercise, fn, ranks=[1, 2])
    assert result.score == 0 < result.max_score, result
    assert all(c.verdict.earns_points for c in result.cases if c.ranks == 1), result


@pytest.mark.parametrize("resume", [E.resume_without_horovod, E.resume_without_horovod_under_its_synchronize,
                                    E.resume_without_horovod_under_its_methods_but_step])
def test_a_resume_without_horovod_scores_nothing(resume, no_strays):
    """The exercise is Horovod's resume: an optimizer of the learner's own that averages over mpi4py trained on
    as the reference did (9/9), also in a class that carries Horovod's synchronize (9/9), or all its methods but
    step(). The optimizer returned must be one hvd.DistributedOptimizer made: every method Horovod's."""
    result = hpdl.check("resume_horovod", resume, ranks=[1, 2])
    no_points(result)
    assert all("not Horovod's" in c.message and "hvd.DistributedOptimizer" in (c.hint or "") for c in result.cases)


def test_a_parameter_server_step_taken_from_the_seeds_without_a_message_scores_nothing(no_strays):
    result = hpdl.check("ps_exchange", E.ps_from_the_seed, ranks=[2, 3])
    no_points(result)
    # its gradients drawn with the check's nonce, which no rank has: wrong values, before the wire is asked
    assert all(c.verdict == "WRONG" and "values wrong" in c.message for c in result.cases), result


def test_a_parameter_server_step_drawn_again_behind_zeros_on_the_wire_scores_nothing(no_strays):
    """The pattern and the bytes of a parameter server, zeros in them, the step from gradients drawn again with
    the case module's own function: the gradients are drawn with the check's nonce, which no rank has."""
    result = hpdl.check("ps_exchange", E.ps_zeros_on_the_wire, ranks=[2, 3])
    no_points(result)
    assert all(c.verdict == "WRONG" and "values wrong" in c.message for c in result.cases), result


def test_where_ranks_do_not_talk_over_tcp_the_check_says_so_and_decides_on_the_recorder(monkeypatch, no_strays):
    """An MPI the kit cannot put on TCP (here: told nothing, so MPICH shares memory, and its ranks cannot
    be isolated): the meter finds no connection at start-up, and the check says it decided on the recorder
    alone, with right answers right."""
    from hpdl.checker import meter

    monkeypatch.setattr(meter, "transport_env", lambda *a, **k: {})
    monkeypatch.setattr(meter, "tcp_transport", lambda: None)
    right = hpdl.check("ring_allreduce", E.ring_on_reversed_split, ranks=[2])
    all_points(right)
    assert any(ALONE in h for h in right.hints), right.hints


def test_mpis_own_collective_unrecorded_under_a_recording_of_the_exercises_messages_scores_nothing(no_strays):
    """MPI's broadcast is a binomial tree below 8 ranks (MPICH's): taken unrecorded from the recorder's
    wrapper, under a recording rewritten as the tree's sends, the wire agreed with every case (18/18). In the
    learner's job MPI's own broadcast now scatters and gathers around a ring (LIBRARY_ALGORITHMS)."""
    result = hpdl.check("bcast_binomial", E.bcast_by_mpis_own_under_a_trees_recording, ranks=[2, 3])
    no_points(result)
    assert any(c.rejected == FORGED for c in result.cases), result


def test_a_recording_rewritten_where_the_wire_would_agree_scores_nothing(no_strays):
    """MPICH's Gatherv and Scatterv send a parameter server's messages: called with the recording paused by hand,
    under sends and receives appended to it, the wire agreed (12/12). The recorder keeps a tally of what it noted
    and of the kit's own pauses apart from its attributes (recording._tally): the case's calls go out altered."""
    result = hpdl.check("ps_exchange", E.ps_by_mpis_gather_and_scatter_under_a_forged_recording, ranks=[3])
    no_points(result)
    assert any("changed by code other than the checker's" in c.message for c in result.cases), result


def test_a_check_voided_by_a_rewritten_record_says_so_in_every_case():
    """The cases a rewritten record voids name the rewrite, not only the network (the tally is no network)."""
    from hpdl.checker.jobs import void_if_forged
    from hpdl.checker.reference_job import ALTERED
    from hpdl.checker.report import CaseResult

    altered = CaseResult("ps_exchange", "n=10", 3, "WRONG", 0.0, 1.0, message=ALTERED, rejected=FORGED)
    right = CaseResult("ps_exchange", "n=1", 3, "PASS", 1.0, 1.0)
    void_if_forged({0: altered, 1: right})
    assert right.points == 0 and "rewritten by your code" in right.message, right


def test_all_reduces_struck_from_the_recording_are_counted_on_the_wire(no_strays):
    """One all-reduce per tensor, recorded as one: the messages between the ranks, counted by the kernel
    against one all-reduce of the same size before the learner's code, say how many ran; through MPI too,
    where an all-reduce of a small tensor takes a barrier's messages (every case's model has 16 tensors
    or more), at 3 ranks, where MPICH's count per tensor is the smallest."""
    result = hpdl.check("allreduce_gradients", E.allreduce_per_tensor_recorded_as_one, ranks=[2])
    no_points(result)
    assert all("outside your process" in c.message for c in result.cases), result
    over_mpi = hpdl.check("allreduce_gradients", E.allreduce_per_tensor_over_mpi_recorded_as_one, ranks=[3])
    no_points(over_mpi)
    assert over_mpi.cases and all("while your process recorded one" in c.message for c in over_mpi.cases), over_mpi


@pytest.mark.parametrize("exercise, fn, ranks", [
    ("allreduce_gradients", grads_over_mpi, [3]),
    ("allreduce_gradients", E.gradients_by_pickled_allreduce, [2, 4]),
    ("allreduce_gradients", E.gradients_between_torch_barriers, [3]),
    ("allreduce_gradients", E.gradients_by_reduce_scatter_then_all_gather, [2]),
    ("bcast_binomial", E.bcast_shape_first, [3, 4]),
    ("recursive_doubling", E.recursive_doubling_segmented, [3, 4]),
    ("ring_allreduce", E.ring_on_reversed_split, [4]),
    ("ring_allreduce", E.ring_last_chunk_takes_the_remainder, [3, 4]),
    ("ring_allreduce", E.ring_of_ceiling_chunks, [4]),
    ("ring_allreduce", E.ring_in_segments, [3]),
    ("average_gradients", E.average_with_allreduce, [2, 4]),
    ("zero1_step", E.zero1_by_reduces, [2, 4]),
    ("pipeline_step", E.pipeline_1f1b_reentrant_checkpoint, [3]),
    ("overlap_allreduce", E.overlap_waited_for_at_the_end_of_backward, [3]),
    # by name, torch's functional collectives call its operators: recorded as the all-reduce they are
    ("allreduce_gradients", E.gradients_all_reduced_by_functional_collectives, [2, 3]),
])
def test_right_answers_pass(exercise, fn, ranks, no_strays):
    # the large cases are hidden: zero1_step's telling one, ring_allreduce's 257 values
    result = hpdl.check(exercise, fn, ranks=ranks, grade=exercise in ("zero1_step", "ring_allreduce"))
    all_points(result)
    assert not any(ALONE in h for h in result.hints), result.hints  # their bytes on the wire were counted


_MEMORY = ("in an inline check, the memory zero3_unit's function holds at once is followed in the learner's process "
           "(tracemalloc, the tensors torch made, MPI.Alloc_mem): memory mapped apart holds every layer unseen. "
           "Grading counts it outside, in its case of 4 MiB layers")


# each gap: (exercise, attack, why it is not caught); what the grading report's header names (the case
# modules' SELF_REPORTED)
_FIRST_STAGE = ("the first pipeline stage sends no gradient: when it ran its backwards shows only in its hooks, in "
                "its process (1F1B's sends and GPipe's backwards); a graded count of the job's memory did not tell it "
                "from an honest 1F1B with activation checkpoints (319 MiB against 276 MiB, 2 stages)")
GAPS = [("zero3_unit", E.zero3_every_layer_at_once_unseen, _MEMORY, 2),
        ("pipeline_step", E.pipeline_first_stage_defers_its_backwards, _FIRST_STAGE, 2)]


@pytest.mark.parametrize("exercise, fn, ranks", [
    pytest.param(exercise, fn, ranks, marks=pytest.mark.xfail(strict=True, raises=AssertionError, reason=why))
    for exercise, fn, why, ranks in GAPS])
def test_not_caught_yet(exercise, fn, ranks, no_strays):
    """Known gaps, written as a learner would exploit them: each scores full marks today (so each fails
    here); the day a check catches one, its strict xfail fails and this list is to be cut."""
    no_points(hpdl.check(exercise, fn, ranks=[ranks]))


def test_the_grading_report_names_what_checks_take_from_the_learners_process():
    """An instructor reads, once, at the top of the report, which exercises' grades rest on what the
    learner's process reports, and that a check's ranks can share files."""
    from hpdl import grade

    st: dict = {}
    text = grade.self_reported_text(st)
    assert set(st["self_reported"]) == {exercise for exercise, *_ in GAPS}
    assert all(f"{name}: {what}" in text for name, what in st["self_reported"].items()), text
    from hpdl.checker import sandbox

    assert ("share one network" in text) == sandbox.ranks_apart() != ("files they share" in text), text


def test_a_checkpoint_drawn_again_on_every_rank_scores_nothing(no_strays):
    """Each rank draws the checkpoint again with the case module's function instead of taking rank 0's by
    broadcast (9/9 while it came from the case's seed): it is drawn with the check's nonce, rank 0's alone."""
    result = hpdl.check("resume_horovod", E.resume_drawn_again_on_every_rank, ranks=[1, 2])
    no_points(result)
    assert all(c.verdict == "WRONG" and "not the checkpoint's" in c.message for c in result.cases), result


def test_pkl5s_messages_are_the_values_they_carry_not_those_its_send_names(no_strays):
    """mpi4py.util.pkl5's messages are read as a pickled send of the object its send was handed (the pickle's own
    header is no values), where the pickle is the recorder's own of that object. With pkl5's pickling replaced, a
    send naming one value carries the whole vector; its messages are read by their bytes, and passing x round the
    ring is no ring (with n < p the ring's last chunk is all of x)."""
    result = hpdl.check("ring_allreduce", E.ring_passing_x_through_pkl5_under_another_name, ranks=[3], grade=True)
    longer = [c for c in result.cases if c.params["n"] >= c.ranks]
    assert len(longer) >= 7 and all(c.verdict == "WRONG" and "values" in c.message for c in longer), result


@pytest.mark.parametrize("exercise, attack, refused", [
    ("average_gradients", E.average_by_messages_beside_an_allreduce_of_zeros, "comm.Send"),
    ("allreduce_gradients", E.gradients_gathered_beside_a_torch_allreduce_of_zeros, "is an allgather"),
    ("allreduce_gradients", E.gradients_by_torch_messages_beside_a_torch_allreduce_of_zeros, "torch.distributed.send"),
    ("allreduce_gradients", E.gradients_by_process_group_messages_beside_an_allreduce_of_zeros, "ProcessGroup.send"),
    ("allreduce_gradients", E.gradients_gathered_by_functional_collectives_beside_an_allreduce_of_zeros,
     "is an allgather"),
])
def test_an_average_moves_by_its_all_reduce_alone(exercise, attack, refused, no_strays):
    """An all-reduce of zeros as large as the gradients beside the real average moved another way (messages to one
    rank and back, an allgather; MPI's or torch.distributed's): the all-reduce's count and the wire's both looked
    like one all-reduce (12/12, 8/8). Messages by hand are refused in these exercises, and an all-gather may carry
    a reduce-scatter's share."""
    result = hpdl.check(exercise, attack, ranks=[2])
    no_points(result)
    assert all(refused in c.message for c in result.cases), result


def test_torch_operators_are_recorded_in_ranks_that_import_torch_themselves(monkeypatch, no_strays):
    """Without the fork server each rank imports torch itself, and torch.distributed is imported while torch still
    is, before torch.ops exists: wrapping the operators then broke every torch check (AttributeError: partially
    initialized module 'torch'). They are wrapped just before the learner's function runs."""
    monkeypatch.setenv("HPDL_FORKSERVER", "0")
    attack = E.gradients_gathered_by_functional_collectives_beside_an_allreduce_of_zeros
    result = hpdl.check("allreduce_gradients", attack, ranks=[2])
    no_points(result)
    assert all("is an allgather" in c.message for c in result.cases), result


def test_a_column_parallel_layer_all_reduces_grad_x_by_a_collective(no_strays):
    """grad_x's parts gathered by Sendrecv from every rank and summed (an allgather, where the layer's backward is
    an all-reduce): the count of what was all-gathered read collectives alone (15/15). Messages by hand are
    refused in this exercise."""
    result = hpdl.check("column_parallel_linear", E.column_parallel_grad_x_gathered_by_sendrecv, ranks=[3])
    no_points(result)
    assert all("comm.Sendrecv" in c.message for c in result.cases), result


def test_zero1_all_gathers_the_updated_weights_once(no_strays):
    """Every call within a shard, the averaged gradient and the momentum all-gathered, each rank stepping the whole
    model: what every rank ends up with is two models' worth (a collective at a time, 18/18)."""
    result = hpdl.check("zero1_step", E.zero1_with_the_whole_step_on_every_rank, ranks=[2])
    no_points(result)
    assert all("all-gathers the updated weights once" in c.message for c in result.cases if c.ranks > 1), result


@pytest.mark.parametrize("attack, words", [
    (E.overlap_of_zeros_then_the_average_another_way, "comm.Allgather"),
    (E.overlap_of_zeros_then_the_average_by_broadcasts, "broadcasts carried"),
    (E.overlap_of_zeros_then_the_average_by_functional_collectives, "_c10d_functional.all_gather_into_tensor"),
])
def test_a_minimal_ddp_averages_by_its_buckets_all_reduces(attack, words, no_strays):
    """Buckets of zeros all-reduced on time in float64 (twice the bytes, so the wire looked like the buckets), the
    average taken after backward by an allgather (8/8) or a broadcast from every rank: the other collectives are
    refused, and the broadcasts may carry the parameters once."""
    result = hpdl.check("overlap_allreduce", attack, ranks=[2])
    no_points(result)
    assert all(words in c.message for c in result.cases if c.ranks > 1), result
