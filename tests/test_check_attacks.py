"""Checks that cannot be fooled, escaped or crashed: cheating and breaking learner code on real ranks.

Each function in fixtures/learner_attacks.py is what a learner might write to cheat or to break
the checker; each must get the verdict a fair instructor would give, and leave nothing running.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

import hpdl
from hpdl.checker import sandbox
from hpdl.checker.jobs import FORGED, TELLING
from hpdl.errors import HpdlError

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import learner_attacks as A  # noqa: E402
from learner_ring import ring_ok  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def no_points(result) -> None:
    assert result.score == 0 and result.cases, result
    assert not any(c.verdict in ("PASS", "SLOW") for c in result.cases), result


@pytest.mark.parametrize("attack", [A.patch_verify_then_return_input, A.read_expected_from_frames, A.forge_events])
def test_the_verdict_is_out_of_the_learners_reach(attack, no_strays):
    result = hpdl.check("ring_allreduce", attack, ranks=[2], grade=True)
    no_points(result)  # hidden cases included: nothing the learner's process does earns a point


@pytest.mark.parametrize("attack", [A.import_reference, A.load_reference_by_path])
def test_reference_solutions_are_not_importable_while_checked(attack, no_strays):
    result = hpdl.check("ring_allreduce", attack, ranks=[2])
    no_points(result)
    assert all(c.verdict == "ERROR" and "not" in c.message and "checked" in c.message for c in result.cases)


@pytest.mark.skipif(not sandbox.available(), reason="needs the sandbox (bubblewrap)")
@pytest.mark.skipif(not (Path(hpdl.__file__).resolve().parents[1] / ".git").exists(),
                    reason="a kit with no git history")
def test_the_reference_is_not_in_reach_through_the_kits_git_history(no_strays):
    """A kit run from its clone carries every case module in .git: hidden from the learner's ranks as
    the case modules and solutions/ are (`git show HEAD:hpdl/checker/cases/...` printed them)."""
    result = hpdl.check("ring_allreduce", A.reads_the_kits_git_history, ranks=[2])
    assert result.cases and all("SEEN reference=False" in c.message for c in result.cases), result


def test_a_function_of_the_kit_is_refused_with_a_clear_message():
    from hpdl.checker.cases import ring_allreduce

    with pytest.raises(HpdlError, match="defined in the kit itself"):
        hpdl.check("ring_allreduce", ring_allreduce.reference)


def test_grade_mode_from_the_environment_ignores_ranks_grade_timeout_and_cases(monkeypatch, no_strays):
    monkeypatch.setenv("HPDL_GRADE", "1")
    result = hpdl.check("ring_allreduce", ring_ok, ranks=[1], grade=False,
                        timeout=0.001, cases="n=1 ")
    assert {c.ranks for c in result.cases} == {1, 2, 3, 4} and any(c.hidden for c in result.cases)
    assert len({c.name for c in result.cases}) > 2 and "did not" not in " ".join(result.hints)
    assert result.passed and result.score == result.max_score


@pytest.mark.parametrize("attack, called", [
    (A.world_allreduce, "Allreduce"), (A.alias_allreduce, "Allreduce"), (A.class_level_allreduce, "Allreduce"),
    (A.derived_comm_allreduce, "Allreduce"), (A.window_accumulate, "Win.Create"),
    (A.c_library_allreduce, "ctypes.MPI_Allreduce"), (A.c_library_allreduce_by_cffi, "ctypes.MPI_Allreduce"),
    (A.file_allgather, "File.Open"),
])
def test_every_route_to_a_library_collective_is_refused_at_run_time(attack, called, no_strays):
    result = hpdl.check("ring_allreduce", attack, ranks=[2])
    no_points(result)
    for c in result.cases:
        assert c.verdict == "WRONG" and c.rejected == called, c
        assert "not allowed" in c.message and "point-to-point" in c.message


@pytest.mark.parametrize("exercise, attack, ranks", [
    ("ring_allreduce", A.c_allreduce_by_address, 3),
    ("bcast_binomial", A.c_bcast_by_address_under_a_tree_of_headers, 3),
])
def test_values_more_than_the_recorded_messages_carry_are_forged(exercise, attack, ranks, no_strays):
    """MPI's C functions called by address have no name to refuse: the values they move are more than the
    messages recorded could carry."""
    result = hpdl.check(exercise, attack, ranks=[ranks], grade=True)
    assert result.score == 0 and FORGED in {c.rejected for c in result.cases}, result
    assert any("moved some other way than your MPI calls" in (c.message or "") for c in result.cases), result


@pytest.mark.parametrize("exercise, attack, ranks, grade, mark", [
    ("recursive_doubling", A.c_allreduce_by_address_beside_doublings_pattern, [3, 4], True, TELLING),
    ("ring_allreduce", A.c_allreduce_by_address_beside_a_rings_pattern, [3, 4], True, TELLING),
    ("recursive_doubling", A.c_allreduce_by_address_beside_doublings_pattern_of_zeros, [3], False, FORGED),
    ("recursive_doubling", A.c_allreduce_by_address_beside_doublings_pattern_in_bytes, [3], False, TELLING),
    ("ring_allreduce", A.c_allreduce_by_address_beside_a_rings_pattern_in_text, [3], False, FORGED),
])
def test_decoy_messages_that_pass_nothing_on_are_forged(exercise, attack, ranks, grade, mark, no_strays):
    """The algorithm's messages, right partners and sizes, beside the sum from MPI_Allreduce called by address
    (recursive doubling 36/36, the ring 18/18 at 3 and 4 ranks: within the wire's slack, every message of the right
    size). After its first message a rank passes on partial sums: its messages' first values, recorded, tell. Each
    cut from the rank's own x; then, once that was told, of zeros (18/18 at 3 and 4 ranks), the rank's own x as
    bytes, or text: a message that carries no sum is no sum passed on, whatever it is."""
    result = hpdl.check(exercise, attack, ranks=ranks, grade=grade)
    # each of the rank's own x (as values or bytes): another algorithm's messages, or a show of this one (TELLING);
    # zeros or text: no values at all (FORGED). Either way nothing counts
    assert result.score == 0 and mark in {c.rejected for c in result.cases}, result
    assert any("none carried a sum" in (c.message or "") for c in result.cases), result


@pytest.mark.parametrize("exercise, attack", [
    ("ps_exchange", A.ps_by_gather_and_bcast_once_the_forbidden_list_is_emptied),
    ("ps_exchange", A.ps_by_gather_and_bcast_once_the_installed_list_is_emptied_too),
    ("ring_allreduce", A.ring_by_allreduce_with_a_rings_calls_made_up_as_it_is_packed),
])
def test_a_record_rewritten_in_the_learners_process_is_not_counted(exercise, attack, no_strays):
    """The record of calls lives in the learner's process: its list of forbidden calls emptied (ps_exchange 9/12),
    or the calls swapped as the learner job packs them (the module's wire.pack rebound: the ring 27/27 where
    MPICH was set to run its own ring). The list is held to what was installed, and packing uses wire.pack as it
    was before the learner's code ran."""
    result = hpdl.check(exercise, attack, ranks=[3])
    assert result.score == 0 and FORGED in {c.rejected for c in result.cases}, result


def test_communicators_made_buy_only_the_room_their_mpi_takes_on_the_wire(no_strays):
    """MPICH spends ~200-800 bytes to each peer making a communicator (hooks.WIRE_PER_COMMUNICATOR_OF), not the
    8 KiB Intel MPI's Split takes: eight Dups let 48 KiB pass unrecorded beside a right ring (9/9)."""
    from hpdl.launchers.mpiexec import mpiexec_implementation

    if mpiexec_implementation() != "MPICH":
        pytest.skip("measured for MPICH")
    result = hpdl.check("ring_allreduce", A.ring_beside_48_kib_hidden_under_eight_dups, ranks=[2], grade=True)
    assert result.score == 0 and FORGED in {c.rejected for c in result.cases}, result


def test_ranks_that_all_send_before_they_receive_hang_as_mpi_allows(no_strays):
    """Send may wait for its Recv (hooks.SYNCHRONOUS): every rank sending first waits forever, with a hint.
    A 2 s limit, as test_check_ring's deadlocks have: no case can finish, so the limit only sets the wait; one
    case (each is a 2 s wait)."""
    result = hpdl.check("ring_allreduce", A.ring_sends_before_it_receives, ranks=[2], timeout=2, cases="n=19 ")
    assert len(result.cases) == 1 and {c.verdict for c in result.cases} == {"HANG"}, result
    assert all("comm.Send(" in c.message and "Sendrecv" in c.hint for c in result.cases), result


def test_every_collective_mpi4py_offers_is_one_the_recorder_knows():
    """An exercise refuses or counts collectives by the names in hooks.COLLECTIVES: one left out goes unseen
    (Allgatherv_init of every rank's gradients, then a mean, scored 12/12 where Allgather is refused)."""
    from mpi4py import MPI

    from hpdl.checker import hooks

    stems = ("gather", "scatter", "reduce", "bcast", "alltoall", "barrier", "scan")
    offered = {name for cls in (MPI.Comm, MPI.Intracomm, MPI.Intercomm, MPI.Topocomm) for name in vars(cls)
               if not name.startswith("_") and any(stem in name.lower() for stem in stems)}
    assert len(offered) > 60 and offered <= set(hooks.COLLECTIVES), sorted(offered - set(hooks.COLLECTIVES))


def test_harmless_local_reductions_and_dead_code_are_not_rejected(no_strays):
    result = hpdl.check("ring_allreduce", A.harmless_numpy_reduce, ranks=[2, 3])
    assert result.passed and result.score == result.max_score, result
    assert any("mentions comm.Allreduce()" in h for h in result.hints)  # the source scan: a note, not a verdict


def test_peers_given_as_numpy_integers_are_recorded(no_strays):
    result = hpdl.check("ring_allreduce", A.numpy_int_peers, ranks=[4])
    no_points(result)
    assert all("neighbours" in c.message for c in result.cases)


def test_the_ring_must_pass_chunks_not_the_whole_vector(no_strays):
    result = hpdl.check("ring_allreduce", A.unchunked_ring, ranks=[2, 3, 4])
    for c in result.cases:
        if c.params["n"] >= c.ranks:  # with n < p the ring's last chunk is all of x: the same messages
            assert c.verdict == "WRONG" and "one chunk per message" in c.message, c


def test_a_chain_broadcast_is_not_a_binomial_tree(no_strays):
    result = hpdl.check("bcast_binomial", A.bcast_chain, ranks=[4])
    no_points(result)
    assert all("rounds" in c.message for c in result.cases)


def test_what_a_learner_returns_is_read_as_data_never_run(no_strays):
    marker = Path("/tmp/hpdl-attack-pwned")
    marker.unlink(missing_ok=True)
    result = hpdl.check("ring_allreduce", A.returns_code, ranks=[1])
    no_points(result)
    assert not marker.exists()


class _Sized:
    """A pickle written by hand: a call that builds far more than the pickle holds."""

    def __init__(self, call, *args):
        self.call, self.args = call, args

    def __reduce__(self):
        return self.call, self.args


def test_what_a_learner_returns_cannot_make_the_checker_build_more_than_it_sent():
    """The reference ranks unpack the learner's outputs outside every sandbox: a 60-byte pickle once had
    each of them make a 3 GiB bytearray; an empty array with a shape of 4 GiB, made real by a copy
    (wire.tensor), would do the same. Refused, and nothing large is built; plain data still reads back."""
    import pickle

    import numpy as np

    from hpdl.checker import wire

    multiarray = (getattr(np, "_core", None) or np.core).multiarray  # numpy 2's name, or 1's
    empty = _Sized(multiarray._reconstruct, np.ndarray, (1 << 30,), b"f")
    bombs = (_Sized(bytearray, 3 << 30), _Sized(wire.tensor, empty, "float32"), _Sized(list, _Sized(range, 1 << 40)),
             _Sized(multiarray.scalar, np.dtype(("V", 1 << 30)), b""))
    for bomb in bombs:
        data = pickle.dumps({"got": bomb})
        assert len(data) < 300
        with pytest.raises(wire.NotPlainData):
            wire.unpack(data)
    plain = {"x": np.arange(1000.0), "s": {1, 2}, "c": 1 + 2j, "k": np.float32(2.5), "n": np.empty((0, 7))}
    back = wire.unpack(wire.pack(plain))
    assert np.array_equal(back["x"], plain["x"]) and back["s"] == {1, 2} and back["c"] == 1 + 2j
    assert back["k"] == np.float32(2.5) and back["n"].shape == (0, 7)


@pytest.mark.parametrize("attack, verdicts", [
    (A.fork_bomb, {"WRONG", "ERROR", "HANG"}),
    (A.memory_hog, {"ERROR", "HANG"}),  # MemoryError at the limit, or still allocating at the timeout
    (A.output_flood, {"ERROR", "HANG"}),
    (A.ignores_sigterm, {"HANG"}),
    (A.kills_its_parent, {"ERROR", "WRONG", "HANG"}),
])
def test_submissions_that_break_things_get_no_points_and_leave_nothing(attack, verdicts, no_strays):
    if attack is A.fork_bomb and not sandbox.available():
        pytest.skip("a fork bomb is only contained by the sandbox's process limit here (bubblewrap missing)")
    result = hpdl.check("ring_allreduce", attack, ranks=[2], timeout=3)
    no_points(result)
    assert {c.verdict for c in result.cases} <= verdicts, result


@pytest.mark.skipif(not sandbox.available(), reason="needs bubblewrap (apt-get install bubblewrap)")
def test_a_kit_installed_under_tmp_still_runs_in_the_sandbox(tmp_path):
    """The sandbox's /tmp is private; a venv made under /tmp must still be there inside it."""
    import subprocess
    import tempfile

    venv = Path(tempfile.mkdtemp(dir="/tmp", prefix="hpdl-venv-")) / "venv"
    try:
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        kit = str(Path(sandbox.__file__).resolve().parents[2])
        code = ("import subprocess, sys\nfrom hpdl.checker import sandbox\n"
                "cmd = sandbox.wrap([sys.executable, '-c', 'import sys; print(sys.prefix)'])\n"
                "done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)\n"
                "print(done.returncode, done.stdout.strip(), done.stderr.strip()[-300:])\n")
        import psutil  # a dependency of the kit (its side jobs), found where this venv keeps it

        deps = str(Path(psutil.__file__).resolve().parents[1])
        out = subprocess.run([str(venv / "bin" / "python"), "-c", code], capture_output=True, text=True,
                             timeout=120, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{kit}:{deps}"})
        assert out.stdout.split()[:2] == ["0", str(venv)], out.stdout + out.stderr
    finally:
        subprocess.run(["rm", "-rf", str(venv.parent)], check=False)


class _Slotted:
    __slots__ = ("chunk",)

    def __init__(self, chunk):
        self.chunk = chunk


def test_a_pickled_object_counts_what_pickle_takes_of_it():
    """A chunk wrapped in an object of another class (a SimpleNamespace, a class with __slots__, a partial)
    counted as 1 value, and its first values were not noted: grad_x's parts all-gathered beside y's columns
    passed for y's alone (15/15), and a parameter server sent the average gradient boxed (12/12)."""
    import functools
    import types

    from hpdl.checker import recording

    chunk = np.arange(100.0)
    for boxed in (types.SimpleNamespace(gx=chunk), _Slotted(chunk), functools.partial(np.negative, chunk)):
        assert recording._elements(boxed) >= 100, boxed
        assert recording._head(boxed, pickled=True)[:3] == (0.0, 1.0, 2.0), boxed
    assert recording._elements((3, chunk)) == 100  # an index beside a chunk: its metadata, as before
    assert [recording._elements(v) for v in (None, 2.5, object(), True)] == [1, 1, 1, 1]
    # an object's own `size` is not its values (SimpleNamespace(size=1, grad=...) said 1); a buffer's message
    # spec that starts at its array's start ([avg, MPI.DOUBLE]) notes its first values (12/12 with no head)
    assert recording._elements(types.SimpleNamespace(size=1, grad=chunk)) >= 100
    assert recording._head([chunk, "a type"])[:3] == (0.0, 1.0, 2.0)
    assert recording._head([chunk, 2, "a type"]) == (0.0, 1.0)
    assert recording._head([chunk, (2, 5), "a type"]) == (5.0, 6.0)  # a part further on: from its displacement
