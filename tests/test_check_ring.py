"""Checking the checker on the ring allreduce: real MPI ranks, right and wrong learner code.

Each known-bad implementation in fixtures/learner_ring.py must get the verdict a teacher
would give it, naming the ranks and the learner's own line; nothing may be left running.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

import hpdl
from hpdl.checker.jobs import UNWITNESSED
from hpdl.procs import shared_memory_of

FIXTURES = Path(__file__).parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
import learner_ring as L  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def line_of(marker: str) -> int:
    """The line number in learner_ring.py of the line carrying `marker`."""
    for number, line in enumerate((FIXTURES / "learner_ring.py").read_text().splitlines(), 1):
        if marker in line:
            return number
    raise AssertionError(marker)


def test_solution_scores_full_marks_on_1_to_4_ranks_hidden_cases_included(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_ok, grade=True)
    assert {c.ranks for c in result.cases} == {1, 2, 3, 4}
    assert any(c.hidden for c in result.cases)
    assert all(c.verdict.earns_points for c in result.cases), result
    assert result.score == result.max_score > 0 and result.passed
    # lengths not divisible by p and shorter than p, float32 and float64, are all among them
    params = [c.params for c in result.cases]
    assert any(p["uneven"] for p in params) and any(p["short"] for p in params)
    assert {p["dtype"] for p in params} == {"float32", "float64"}


def test_blank_exercise_fails_fast_and_never_hangs(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_blank, timeout=60)
    assert set(result.verdicts.values()) == {"ERROR"}
    assert all("NotImplementedError" in c.message for c in result.cases)
    assert result.score == 0
    assert result.seconds < 60  # every case ended by itself; none waited for its time limit


def test_deadlocking_ring_is_a_hang_naming_every_stuck_rank_and_the_line(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_deadlock, ranks=[1, 3], timeout=2)
    assert all(c.verdict.earns_points for c in result.find(ranks=1))  # one rank: no partner to wait for
    first = result.find(ranks=3)[0]
    assert first.verdict == "HANG"
    assert sorted(first.stuck) == [0, 1, 2] and first.finished == []
    line = line_of("# DEADLOCK")
    assert first.line["line"] == line and "comm.Recv(buf, source=left)" in first.line["code"]
    assert f"line {line} of ring_deadlock()" in first.message
    rest = result.find(ranks=3)[1:]
    assert rest and all(c.verdict == "HANG" and c.message.startswith("Not run") for c in rest)


def test_grade_mode_runs_every_case_after_a_hang(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_deadlock, ranks=[2], timeout=2, grade=True)
    cases = result.find(ranks=2)
    assert len(cases) > 3 and all(c.verdict == "HANG" for c in cases)
    assert not any(c.message.startswith("Not run") for c in cases)
    assert all(sorted(c.stuck) == [0, 1] for c in cases)


def test_wrong_chunk_boundaries_are_wrong_only_for_uneven_lengths(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_bad_chunks, ranks=[3, 4])
    for c in result.cases:
        assert c.verdict == "WRONG", c
        # right where the length divides evenly, but not counted while the large case (uneven) is wrong
        assert c.params["uneven"] != (c.rejected == UNWITNESSED), c
    uneven = [c for c in result.cases if c.params["uneven"] and not c.params["short"]]
    assert all("same chunk boundaries" in (c.hint or "") for c in uneven)
    assert any("divides evenly" in h for h in result.hints)


@pytest.mark.parametrize("fn, ranks, says, marker", [
    (L.ring_sends_never_waited, 2, "not finished (comm.Isend() to rank 1 ×2)", "# NEVER WAITED"),
    (L.ring_send_buffer_reused, 3, "changed the buffer of comm.Isend() to rank", "staging[:n], dest"),
    # its large chunks: still in flight when the rank returns (not finished), or landed and the buffer changed
    (L.ring_persistent_sends_never_waited, 3, "comm.Send_init() to rank", "# STARTED, NEVER"),
    (L.ring_isendrecv_buffer_changed, 3, "changed the buffer of comm.Isendrecv() to rank", "# ISENDRECV"),
])
def test_a_send_not_seen_through_is_wrong_naming_the_line(fn, ranks, says, marker, no_strays):
    """Isends never waited on, and one staging buffer for every Isend with the requests waited on at the end:
    here MPI copies each message at the call and the sums come out right (a pipeline written either way
    scored 18/18), but until a request completes MPI may still read its buffer. A rank must not return
    with a request open, and a send's buffer must hold, when the send completes, what it held when it
    began; the line that made the send is named."""
    result = hpdl.check("ring_allreduce", fn, ranks=[ranks])
    assert result.score == 0 and result.cases, result
    for c in result.cases:
        assert c.verdict == "WRONG" and says in c.message, c
        assert c.line["line"] == line_of(marker), c


def test_a_send_freed_in_flight_is_held_to_its_buffer(no_strays):
    """Isend(...).Free() with the staging buffer refilled next step (27/27 once): where the send had not
    completed when it was freed, as the large case's chunks cannot have, the buffer must hold until the
    destination answers or the function returns; small messages, complete at once, may reuse it."""
    result = hpdl.check("ring_allreduce", L.ring_sends_freed_in_flight, ranks=[3])
    large = [c for c in result.cases if c.params["n"] == 100_003]
    assert large and all(c.verdict == "WRONG" and "changed the buffer of comm.Isend()" in c.message
                         and c.line["line"] == line_of("# FREED") for c in large), result


def test_a_job_that_ends_before_its_ranks_are_ready_is_started_again_once(monkeypatch, no_strays):
    """No learner's code has run before every rank is ready: a job that ended before then ended by the host's doing
    (a busy grading host cost an honest check 2 points: "The ranks did not start"). Started again once, it says so;
    ended again, the case is an ERROR, as before."""
    from hpdl.checker import jobs

    real, ended = jobs.Job.__init__, []

    def launch(self, kind, *args, **kwargs):
        real(self, kind, *args, **kwargs)
        if kind == "learner" and len(ended) < kills:
            ended.append(self.dir)
            self.side.end(now=True)  # as the host's OOM killer, or a launcher that failed, would

    monkeypatch.setattr(jobs.Job, "__init__", launch)
    kills = 1
    result = hpdl.check("ring_allreduce", L.ring_ok, ranks=[2])
    assert ended and result.score == result.max_score, result
    assert any("ended before its ranks were ready and was started again" in h for h in result.hints), result
    ended.clear()
    kills = 2
    result = hpdl.check("ring_allreduce", L.ring_ok, ranks=[2])
    assert len(ended) == 2 and result.cases[0].verdict == "ERROR" and "did not start" in result.cases[0].message


def test_chunks_padded_to_equal_widths_pass_where_the_padding_is_not_a_second_vector(no_strays):
    """p chunks of ⌈n/p⌉, the last padded with zeros, is the ring cut otherwise (20/27: the padding counted over
    the budget of the exercise's cut; then 24/27 where the padding makes the values passed on 2n or more: n < p,
    n = 9 at 4 ranks). A chain passing x twice in chunk-sized messages fits there too, and fails the long cases."""
    for p in (3, 4):
        result = hpdl.check("ring_allreduce", L.ring_padded_to_equal_chunks, ranks=[p], grade=True)
        assert result.score == result.max_score, result


def test_a_persistent_pair_restarted_every_step_is_counted_each_start(no_strays):
    """Each start of a persistent request sends its message again: recorded once at Send_init only, a pair
    restarted every step read as traffic the recording hid, and voided the check (0/27). Its padded messages
    are longer than the ring's chunks where n does not divide evenly, and only there."""
    result = hpdl.check("ring_allreduce", L.ring_persistent_pair_restarted, ranks=[3])
    assert not any("Not counted" in c.message for c in result.cases), result
    for c in result.cases:
        assert c.verdict.earns_points or c.params["uneven"] and "at most" in c.message, c
    assert any(c.verdict.earns_points for c in result.cases if c.params["uneven"] is False), result


def test_result_left_on_rank_0_only_is_wrong_naming_the_other_ranks(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_root_only, ranks=[2, 4])
    for c in result.cases:
        assert c.verdict == "WRONG"
        assert c.wrong_ranks == list(range(1, c.ranks))
        assert "only rank 0" in c.hint
        assert c.max_error and c.max_error > 0


def test_collective_called_on_one_rank_hangs_that_rank_only(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_collective_one_rank, ranks=[3], timeout=2)
    first = result.cases[0]
    assert first.verdict == "HANG"
    assert list(first.stuck) == [0] and first.finished == [1, 2]
    assert first.line["line"] == line_of("# COLLECTIVE ON ONE RANK")
    assert "finished: ranks 1, 2" in first.message


def test_exception_on_one_rank_is_an_error_naming_rank_and_line_without_waiting(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_raises_on_one_rank, ranks=[3], timeout=60)
    for c in result.cases:
        assert c.verdict == "ERROR"
        assert c.error_ranks == [2]
        assert c.line["line"] == line_of("# RAISES") and "ValueError" in c.message
        assert "Left waiting for it: ranks 0, 1" in c.message
    assert result.seconds < 60  # the job was aborted at once, not after the time limit


def test_library_allreduce_is_rejected_by_reading_the_source(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_uses_allreduce)
    assert set(result.verdicts.values()) == {"WRONG"}
    msg = result.cases[0].message
    assert "comm.Allreduce()" in msg and f"line {line_of('# LIBRARY ALLREDUCE')}" in msg
    assert "point-to-point" in msg


def test_allreduce_hidden_from_the_source_is_rejected_when_called(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_sneaky_allreduce, ranks=[2])
    assert set(result.verdicts.values()) == {"WRONG"}
    assert all("Allreduce() is not allowed" in c.message for c in result.cases)
    assert result.cases[0].line["line"] == line_of("# HIDDEN FROM THE AST")


def test_right_sum_by_the_wrong_pattern_is_not_a_ring(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_gather_to_root, ranks=[3, 4])
    # with 3 ranks everyone is a neighbour, but whole vectors are not the ring's chunks (with n < p the
    # ring's last chunk is all of x: the same messages)
    three = [c for c in result.find(ranks=3) if c.params["n"] >= 3]
    assert three and all(c.verdict == "WRONG" and "one chunk per message" in c.message for c in three)
    four = result.find(ranks=4)
    assert four and all(c.verdict == "WRONG" and "neighbours" in c.message for c in four)


def _check_ranks(pid: int) -> list[psutil.Process]:
    """The check's rank processes under `pid`; one that ends while listed (a zombie, the fork server's
    stand-ins as they start) is left out, not a failure (psutil.ZombieProcess failed the full run once)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        try:
            if p.name().startswith("python") and "_job" in " ".join(p.cmdline()):
                found.append(p)
        except psutil.Error:
            continue
    return found


def test_killing_the_notebook_mid_check_leaves_no_ranks_behind(tmp_path, no_strays):
    """A kernel killed while its check hangs: the workers notice and end themselves."""
    script = tmp_path / "client.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(FIXTURES)!r})
        import hpdl, learner_ring
        hpdl.check("ring_allreduce", learner_ring.ring_deadlock, ranks=[3], timeout=120)
    """))
    from hpdl.checker import sandbox

    client = subprocess.Popen([sys.executable, str(script)])
    workers, launcher = [], []
    # the learner's 3 ranks and the reference's 3; each isolated learner rank with the process standing in for it
    expected = 6 + (3 if sandbox.ranks_apart() else 0)
    try:
        workers = []
        deadline = time.time() + 60
        while time.time() < deadline and len(workers) < expected:
            workers = _check_ranks(client.pid)
            time.sleep(0.2)
        assert len(workers) == expected, "the check's ranks did not start"
        launcher = [p for p in psutil.Process(client.pid).children()
                    if p.name() in ("mpiexec", "mpiexec.hydra", "bwrap")]
        segments = shared_memory_of([p.pid for p in workers])
        assert any("mpich" in s or "ucx" in s for s in segments)  # MPI's shared memory, in RAM
        client.send_signal(signal.SIGKILL)
        client.wait()
        gone, alive = psutil.wait_procs(workers + launcher, timeout=20)
        assert not alive, f"left behind: {[p.pid for p in alive]}"
        assert not [s for s in segments if Path(s).exists()], "shared memory left in /dev/shm"
        # the killed checker's folders (the check's inputs; its copies of the kit's modules without their
        # answers) stay until the next check removes them (one started elsewhere meanwhile may have already)
        from hpdl import scratch

        left = scratch.made_by(client.pid, "check") + scratch.made_by(client.pid, "answers")
        swept = scratch.sweep("check") + scratch.sweep("answers")
        assert all(str(f) in swept for f in left) and not scratch.made_by(client.pid), (left, swept)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
        for p in workers + launcher:  # should the assertion fail, still leave nothing behind
            try:
                p.kill()
            except psutil.Error:
                pass


def test_right_but_slow_is_advisory_and_keeps_the_points(no_strays):
    result = hpdl.check("ring_allreduce", L.ring_slow, ranks=[2])
    assert set(result.verdicts.values()) == {"SLOW"}
    assert result.score == result.max_score and result.passed
    assert "slow" in result.cases[0].message and "no points lost" in result.cases[0].message


def test_a_hang_in_a_check_reads_as_a_hang_in_a_px_cell(no_strays):
    """hpdl.hang is the one wording: a check's HANG and a %%px cell's hang report name a stuck
    rank's place in the same words (the %%px side builds its report from the same answers)."""
    from hpdl import hang

    result = hpdl.check("ring_allreduce", L.ring_collective_one_rank, ranks=[3], timeout=2)
    case = result.cases[0]
    assert case.verdict == "HANG"
    place = hang.place_text(case.line)
    assert place.startswith(f"line {line_of('# COLLECTIVE ON ONE RANK')} of ring_collective_one_rank(): ")
    check_words = hang.summary({0: {"where": case.line}}, finished=[1, 2])
    px_words = hang.hang_message("the cell did not finish on every rank within 2 s.", {0: {"where": case.line}},
                                 finished=[1, 2])
    assert check_words in case.message
    assert f"stuck:    rank 0 at {place}" in px_words and case.stuck[0] == place
    assert hang.DEADLOCK_HINT == case.hint


def ring_by_a_packed_chain(comm, x):
    """Attack (red team): no ring. The WHOLE vector goes along a chain, reduce 0 → 1 → … → p-1 then
    broadcast p-1 → 0 → … → p-2, each time packed losslessly (the narrowest float that holds every value
    exactly, then zlib if that is shorter) and sent as the case's dtype in segments of at most a chunk,
    then zero padding up to the bytes each rank must receive. It fits the ring's budget of values only
    if the inputs pack into fewer bytes than their dtype holds."""
    import zlib

    import numpy as np
    from mpi4py import MPI

    p, r = comm.Get_size(), comm.Get_rank()
    if p == 1:
        return x.copy()
    n, dt = len(x), x.dtype
    isz, widest = dt.itemsize, n // p + n % p
    right, left = (r + 1) % p, (r - 1) % p
    narrow = [np.dtype(t) for t in ("float16", "float32", "float64") if np.dtype(t).itemsize <= isz]

    def pack(a):
        if n < p:
            return len(narrow) - 1, 0, a.tobytes()
        kind = next(i for i, t in enumerate(narrow) if np.array_equal(a.astype(t).astype(dt), a))
        raw = a.astype(narrow[kind]).tobytes()
        squeezed = zlib.compress(raw, 9)
        return (kind, 1, squeezed) if len(squeezed) < len(raw) else (kind, 0, raw)

    def unpack(kind, zipped, b):
        return np.frombuffer(zlib.decompress(b) if zipped else b, dtype=narrow[kind]).astype(dt)

    sending = []  # sent without waiting (the padding at the end goes both ways at once), waited at the end

    def send_frame(kind, zipped, b):  # an 8-byte header (codec, length), then the bytes in chunk-sized segments
        if n >= p:  # with n < p a chunk is all of x: the raw vector, no header, fits as it is
            sending.append(comm.Isend(np.array([kind * 2 + zipped, len(b)], np.int32).view(dt), dest=right, tag=7))
        v = np.frombuffer(b + b"\0" * (-len(b) % isz), dtype=dt)
        for i in range(0, len(v), max(widest, 1)):
            sending.append(comm.Isend(v[i:i + widest].copy(), dest=right, tag=7))
        return 8 + len(v) * isz

    def recv_frame():
        head = np.array([len(narrow) * 2 - 2, n * isz], np.int32).view(dt)
        if n >= p:
            comm.Recv(head, source=left, tag=7)
        code, length = (int(v) for v in head.view(np.int32))
        v = np.empty(-(-length // isz), dt)
        for i in range(0, len(v), max(widest, 1)):
            seg = np.empty(len(v[i:i + widest]), dt)
            comm.Recv(seg, source=left, tag=7)
            v[i:i + widest] = seg
        return code // 2, code % 2, v.tobytes()[:length]

    sent = 0
    part = x.copy() if r == 0 else unpack(*recv_frame()) + x  # reduce along the chain
    if r < p - 1:
        sent += send_frame(*pack(part))
    total = part if r == p - 1 else unpack(*recv_frame())  # broadcast the total along the chain
    if r != p - 2:
        sent += send_frame(*pack(total))
    if n >= p:  # pad what the right neighbour receives up to the kernel's floor
        send_frame(0, 0, b"\0" * max(0, (p - 1) * n * isz // p - sent))
        recv_frame()
    MPI.Request.Waitall(sending)
    return total


def test_whole_vectors_packed_along_a_chain_do_not_fit_the_rings_budget(no_strays):
    """Inputs as small whole numbers (plus quarters) packed into float16 (2 bytes a value): a chain of
    whole vectors fitted the ring's 2(p-1) chunks and scored full marks. With every bit of the inputs
    drawn from the check's nonce (_sums.vector) nothing packs: a middle rank of the chain passes on x twice,
    p/(p-1) times the ring's 2(p-1) chunks. Where that is within a header of one value a step (n = 9 and 13 at 4
    ranks), the messages that carry no sum void the check all the same."""
    result = hpdl.check("ring_allreduce", ring_by_a_packed_chain, ranks=[3, 4], grade=True)
    assert result.score == 0, result
    longer = [c for c in result.cases if c.params["n"] >= c.ranks]  # with n < p the ring's last chunk is all of x
    assert longer and all(c.verdict == "WRONG" and "values" in c.message for c in longer
                          if not c.message.startswith("Not counted")), result
    assert sum("values in" in c.message for c in longer) >= 6, result  # over the budget: "sent 64 values in 9 ..."


def test_a_chain_is_told_as_another_algorithm_not_as_a_forged_record(no_strays):
    """A chain's first rank sends only its own values: no sum passed on, as in a show of the ring's pattern beside
    a sum made another way. The check still earns nothing, but the learner reads that the algorithm is another,
    not that their record was contradicted or rewritten (which every case but one said)."""
    result = hpdl.check("ring_allreduce", L.chain_in_chunks, ranks=[3])
    assert result.score == 0 and {c.verdict for c in result.cases} == {"WRONG"}, result
    assert any("each of its own values only" in c.message for c in result.cases), result
    assert not any("contradicted" in c.message or "rewritten" in c.message for c in result.cases), result


def _bidirectional_ring_sends(n: int, p: int) -> int:
    """The most values a rank passes on in NCCL's bidirectional ring: x's two halves each all-reduced round
    the ring its own way, each cut in p (cut i at i*h//p), one chunk per step, p - 1 steps of each phase."""
    most = 0
    for r in range(p):
        sent = 0
        for h, me in ((n // 2, r), (n - n // 2, (-r) % p)):
            cuts = [i * h // p for i in range(p + 1)]
            chunk = [cuts[i + 1] - cuts[i] for i in range(p)]
            sent += sum(chunk[(me - k) % p] for k in range(p - 1)) + sum(chunk[(me - k + 1) % p] for k in range(p - 1))
        most = max(most, sent)
    return most


@pytest.mark.parametrize("n", [3, 9, 12, 13, 100003])
@pytest.mark.parametrize("p", [2, 3, 4])
def test_a_bidirectional_ring_passes_on_no_more_than_the_check_allows(n, p):
    """A right algorithm, a ring each way round over x's halves, scored 25/27: the rounding of its two cuts
    came to one value over one ring's budget. It stays under what the check allows; passing x whole around
    the ring (p - 1 times all of it, twice) does not."""
    from hpdl.checker.cases.ring_allreduce import ring_allowance

    assert _bidirectional_ring_sends(n, p) <= ring_allowance(n, p)
    if n >= 2 * p:
        assert 2 * (p - 1) * n > ring_allowance(n, p)


def ring_through_staging_buffers_one_too_wide(comm, x):
    """Each chunk copied into a staging buffer of n // p + 1 values and the whole buffer sent: one value past the
    chunk where p divides n (against the ring's size rule), a value the buffer held before. Every message of a
    rank then started with values found in no sum, and the check read the ring as forged: 0/27, every case void."""
    import numpy as np

    p, r = comm.Get_size(), comm.Get_rank()
    out = x.copy()
    bounds = [i * len(out) // p for i in range(p + 1)]
    send, receive = np.zeros(len(out) // p + 1, out.dtype), np.zeros(len(out) // p + 1, out.dtype)
    for step in range(2 * (p - 1)):
        k = step - (p - 1)  # the all-gather's steps
        mine, into = ((r - step) % p, (r - step - 1) % p) if k < 0 else ((r + 1 - k) % p, (r - k) % p)
        chunk = out[bounds[mine]:bounds[mine + 1]]
        send[:len(chunk)] = chunk
        comm.Sendrecv(send, dest=(r + 1) % p, recvbuf=receive, source=(r - 1) % p)
        width = bounds[into + 1] - bounds[into]
        if step < p - 1:
            out[bounds[into]:bounds[into + 1]] += receive[:width]
        else:
            out[bounds[into]:bounds[into + 1]] = receive[:width]
    return out


def test_a_message_one_value_too_wide_is_too_wide_not_forged(no_strays):
    result = hpdl.check("ring_allreduce", ring_through_staging_buffers_one_too_wide, ranks=[3], grade=True)
    divisible = [c for c in result.cases if c.params["n"] % 3 == 0 and c.params["n"] >= 3]
    assert divisible and all(c.verdict == "WRONG" and "one chunk per message" in c.message for c in divisible), result
    assert not any(c.rejected for c in result.cases), result  # neither forged nor another algorithm: no case void
    assert any(c.verdict == "PASS" for c in result.cases), result
