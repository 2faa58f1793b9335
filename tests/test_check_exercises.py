"""Checking the checker on recursive doubling, binomial broadcast and gradient averaging, and the
generic hooks (sampler shards; identical, broadcast parameters after a torch step) through
small test exercises of our own in fixtures/cases. Real MPI ranks throughout."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import hpdl
from hpdl.launchers import side_job_command

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import learner_collectives as C  # noqa: E402

pytestmark = pytest.mark.timeout(240)


@pytest.mark.parametrize("size", [3, 4])
def test_references_agree_with_serial_sums_and_copies(size, tmp_path):
    """The model solutions the checker compares against, checked against plain numpy."""
    script = tmp_path / "refs.py"
    script.write_text(textwrap.dedent("""
        import copy
        import numpy as np
        from mpi4py import MPI
        from hpdl.checker.cases import load
        comm = MPI.COMM_WORLD
        rank, p = comm.Get_rank(), comm.Get_size()
        checked = 0
        for name in ("ring_allreduce", "recursive_doubling"):
            m = load(name)
            for case in m.cases(p):
                got = m.reference(comm.Dup(), *copy.deepcopy(m.inputs(case, rank, p)))
                want = sum(m.inputs(case, r, p)[0].astype(np.float64) for r in range(p))
                assert got.dtype == np.dtype(case.params["dtype"]), (name, case)
                assert np.array_equal(got.astype(np.float64), want), (name, case.name)
                checked += 1
        m = load("bcast_binomial")
        for case in m.cases(p):
            got = m.reference(comm.Dup(), *m.inputs(case, rank, p))
            assert np.array_equal(got, m.inputs(case, case.params["root"], p)[0]), case.name
            checked += 1
        m = load("average_gradients")
        for case in m.cases(p):
            got = m.reference(comm.Dup(), *copy.deepcopy(m.inputs(case, rank, p)))
            per_rank = [m.inputs(case, r, p)[0] for r in range(p)]
            for i, g in enumerate(got):
                mean = sum(x[i].astype(np.float64) for x in per_rank) / p
                assert np.allclose(g, mean, rtol=1e-5, atol=1e-6), case.name
            checked += 1
        counts = comm.gather(checked)
        if rank == 0:
            print("checked", *counts, flush=True)
    """))
    out = subprocess.run([*side_job_command(size), sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    counts = [int(n) for line in out.stdout.splitlines() if line.startswith("checked") for n in line.split()[1:]]
    assert len(counts) == size and len(set(counts)) == 1 and counts[0] >= 15


def test_recursive_doubling_power_of_two_only_code(no_strays):
    # the solution's full marks: solutions/04 in grade mode (test_notebooks.py); here another right
    # answer (the top ranks folded in) passes where it differs from power-of-two-only code
    assert hpdl.check("recursive_doubling", C.recursive_doubling_ok, ranks=[3], grade=True).passed
    bad = hpdl.check("recursive_doubling", C.recursive_doubling_pow2_only)
    for c in bad.cases:
        assert c.verdict == ("WRONG" if c.ranks == 3 else "PASS"), c
    assert all(c.wrong_ranks == [1] for c in bad.find(ranks=3))
    assert any("powers of two" in h for h in bad.hints)
    assert not any("chunk" in (c.hint or "") for c in bad.cases)


def test_graded_recursive_doubling_folds_in_more_than_one_extra_rank(no_strays):
    """Graded, 7 ranks too (GRADED_RANKS): at 3, the only count below 4 that is not a power of two, a star
    (everyone to rank 0 and back) sends no more messages than the fold-in does, and scored 27/27."""
    result = hpdl.check("recursive_doubling", C.star_beyond_powers_of_two, grade=True)
    assert {c.ranks for c in result.cases} == {1, 2, 3, 4, 7}, result
    wrong = [c for c in result.cases if c.verdict == "WRONG"]  # (not SLOW, advisory: the suite's load)
    assert {c.ranks for c in wrong} == {7} and result.score < result.max_score, result
    assert all("sent to 6 ranks" in c.message for c in wrong), result


def test_a_chain_up_and_back_down_is_not_recursive_doubling_at_7_ranks(no_strays):
    """Five of its seven ranks swap with two neighbours, as many partners as the fold-in's core has, but the
    chain pairs 6 ranks where recursive doubling pairs 7 (3 folded in, 4 swaps): right at 7 ranks, 27/36."""
    result = hpdl.check("recursive_doubling", C.chain_beyond_powers_of_two, ranks=[7])
    assert result.cases and all(c.verdict == "WRONG" and "6 pairs of ranks" in c.message for c in result.cases), result


def test_recursive_doublings_look_alikes_are_wrong(no_strays):
    """Dissemination (send to r + 2^k, receive from r - 2^k) sums right for powers of two; p' taken as p & (p - 1)
    is right at 3 and 6 ranks: graded, 7 tells it. Both scored full marks."""
    spread = hpdl.check("recursive_doubling", C.recursive_doubling_disseminating, ranks=[4])
    assert {c.verdict for c in spread.cases} == {"WRONG"} and "half of a swap" in spread.cases[0].message, spread
    cleared = hpdl.check("recursive_doubling", C.recursive_doubling_lowest_bit_cleared, grade=True)
    assert {c.ranks for c in cleared.cases if c.verdict == "WRONG"} == {7}, cleared  # (a SLOW one: the load)


def test_binomial_broadcasts_that_take_more_rounds(no_strays):
    """The nearest child first takes 3 rounds at 4 ranks; a binary heap's tree, graded at 8 ranks too, 4."""
    nearest = hpdl.check("bcast_binomial", C.bcast_smallest_subtree_first, ranks=[4])
    assert any(c.verdict == "WRONG" and "3 rounds" in c.message for c in nearest.cases), nearest
    heap = hpdl.check("bcast_binomial", C.bcast_binary_heap, grade=True)
    assert {c.ranks for c in heap.cases if c.verdict == "WRONG"} == {8}, heap  # (a SLOW one: the suite's load)
    assert all("4 rounds" in c.message for c in heap.cases if c.verdict == "WRONG"), heap


def test_binomial_broadcast_typical_mistakes(no_strays):
    # the solution's full marks, roots 0, 2 and 3 at 4 ranks among its cases: solutions/03 in grade mode;
    # another right answer (relative ranks, pickle API) passes where the mistakes below fail
    assert hpdl.check("bcast_binomial", C.bcast_ok, ranks=[4]).passed
    linear = hpdl.check("bcast_binomial", C.bcast_linear, ranks=[3, 4])
    assert all(c.verdict.earns_points for c in linear.find(ranks=3))  # with 3 ranks a linear one looks the same
    four = linear.find(ranks=4)
    assert four and all(c.verdict == "WRONG" and "linear broadcast" in c.message for c in four)
    assert all(c.wrong_ranks == [c.params["root"]] for c in four)

    root0 = hpdl.check("bcast_binomial", C.bcast_root0_only, ranks=[2, 4])
    for c in root0.cases:
        assert c.verdict == ("PASS" if c.params["root"] == 0 else "WRONG"), c
    assert any("root 0 only" in h for h in root0.hints)

    library = hpdl.check("bcast_binomial", C.bcast_uses_bcast, ranks=[2])
    assert set(library.verdicts.values()) == {"WRONG"} and "comm.bcast()" in library.cases[0].message


def test_average_gradients_blank_and_summed(no_strays):
    # the solution's full marks: solutions/03 in grade mode (test_notebooks.py); another right answer
    assert hpdl.check("average_gradients", C.average_ok, ranks=[3]).passed
    blank = hpdl.check("average_gradients", C.average_blank, timeout=60)
    assert set(blank.verdicts.values()) == {"ERROR"} and blank.seconds < 60

    gathered = hpdl.check("average_gradients", C.average_by_an_allgather, ranks=[2])  # 12/12 once
    assert set(gathered.verdicts.values()) == {"WRONG"} and "an all-reduce" in gathered.cases[0].message
    # an allgather as an all-reduce of a slot for every rank; an average gathered and sent back by Send (12/12 each)
    slots = hpdl.check("average_gradients", C.average_in_slots, ranks=[2])
    assert set(slots.verdicts.values()) == {"WRONG"} and "2.0 times" in slots.cases[0].message, slots
    sent = hpdl.check("average_gradients", C.average_gathered_by_send, ranks=[3])  # messages by hand: refused
    assert set(sent.verdicts.values()) == {"WRONG"} and "Rejected: comm.Send" in sent.cases[0].message, sent

    summed = hpdl.check("average_gradients", C.average_summed, ranks=[1, 3])
    assert all(c.verdict.earns_points for c in summed.find(ranks=1))  # one rank: the sum is the average
    three = summed.find(ranks=3)
    assert all(c.verdict == "WRONG" and c.wrong_ranks == [0, 1, 2] for c in three)
    assert all("summed but not averaged" in c.hint for c in three)
    # float64 rounded through float32 on one rank: wrong, but not for want of a division (the hint said so)
    # and told so; the hidden case is float64 too, so it fails half the graded cases, not a quarter (9/12 once)
    rounded = hpdl.check("average_gradients", C.average_through_float32, ranks=[1, 3], grade=True)
    wrong = [c for c in rounded.cases if c.verdict == "WRONG"]
    assert wrong and all("float32 precision" in (c.hint or "") for c in wrong), rounded
    assert rounded.score == rounded.max_score / 2, rounded
    # one flat buffer in the first gradient's dtype: float32 where the hidden case's list starts (12/12 once)
    first = hpdl.check("average_gradients", C.average_in_the_first_gradients_dtype, ranks=[2], grade=True)
    wrong = [c for c in first.cases if c.verdict == "WRONG"]
    assert [c.name for c in wrong] == ["12 gradients, float32 and float64"], first
    assert "float32 precision" in (wrong[0].hint or ""), first


# -- generic hooks, through test exercises of our own ----------------------------------------

@pytest.fixture
def fixture_cases(monkeypatch):
    monkeypatch.setenv("HPDL_CASES_PATH", str(FIXTURES / "cases"))
    import learner_dp

    return learner_dp


def test_sampler_shards_must_be_disjoint_covering_and_equal(fixture_cases, no_strays):
    L = fixture_cases
    good = hpdl.check("fixture_shards", L.shards_ok, ranks=[1, 2, 3], grade=True)
    assert good.passed and len(good.cases) == 6
    overlap = hpdl.check("fixture_shards", L.shards_overlap, ranks=[3])
    assert all(c.verdict == "WRONG" and c.wrong_ranks == [0, 1, 2] for c in overlap.cases)
    assert "shares" in overlap.cases[0].message and "no rank has" in overlap.cases[0].message
    uneven = hpdl.check("fixture_shards", L.shards_uneven, ranks=[3])
    assert all(c.verdict == "WRONG" for c in uneven.cases)


def test_parameters_identical_and_broadcast_after_a_torch_step(fixture_cases, no_strays):
    L = fixture_cases
    good = hpdl.check("fixture_sync_step", L.sync_step_ok)
    assert good.passed and {c.ranks for c in good.cases} == {1, 2}
    skipped = hpdl.check("fixture_sync_step", L.sync_step_no_broadcast, ranks=[2])
    case = skipped.cases[0]
    assert case.verdict == "WRONG" and 1 in case.wrong_ranks
    assert "differ from rank 0's" in case.message
    # one rank returning nothing must not leave the others waiting in the collective check
    none = hpdl.check("fixture_sync_step", L.sync_step_returns_none_on_rank1, ranks=[2])
    assert none.cases[0].verdict == "WRONG" and none.cases[0].wrong_ranks == [1]


def test_a_ring_that_sums_into_x_is_wrong(no_strays):
    """The exercise returns the sum as a new array and leaves x alone: a ring that summed in x's own buffer and
    returned it scored 27/27. On one rank there is nothing to add, and x comes back as it was."""
    result = hpdl.check("ring_allreduce", C.ring_summing_into_x, ranks=[1, 3])
    assert all(c.verdict == ("PASS" if c.ranks == 1 else "WRONG") for c in result.cases), result
    assert all("changed x in place" in c.message and "x.copy()" in (c.hint or "")
               for c in result.cases if c.ranks == 3), result
