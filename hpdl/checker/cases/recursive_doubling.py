"""Checks for recursive_doubling(comm, x) -> the elementwise sum of x over all ranks, on every rank.

In round k each rank swaps its partial sum with the rank whose number differs in bit k, so
lg p rounds suffice when p is a power of two: every message is half of a swap (a rank receives
from each rank it sends to; sending on to r + 2^k and receiving from r − 2^k is another algorithm).
For other p the standard fold-in: the first 2·(p − p') ranks pair up (p' the largest power of two
≤ p), one of each pair hands its data to the other and sits out, and gets the result back at the end.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Wrong
from hpdl.checker.cases._sums import (compare_sum, diagnose_sum, explain_sums, leave_x_alone, received_enough,
                                      sum_cases, vector)

SIGNATURE = "recursive_doubling(comm, x: np.ndarray) -> np.ndarray"
RANKS = (1, 2, 3, 4)
# and in grading, 7: the only count below it that is not a power of two is 3, whose fold-in is one pair, where a
# star (everyone to rank 0 and back) sends as many messages, and a fold-in that pairs ranks wrongly for more than
# one extra rank (partner = (vr ^ mask) + extra) is right: both scored 27/27. At 6 (two extra ranks) p' taken as
# p & (p - 1) is still 4, right: it scored 27/27 too; at 7 it is 6
GRADED_RANKS = (7,)
TIMEOUT = 5.0
PRIVATE_INPUTS = True  # each rank gets only its own inputs: the others' come by message or not at all
METERED = True  # the bytes each rank sends are counted outside its process (meter.py), against the recorder
FORBIDDEN = {
    name: "recursive doubling is to be built from point-to-point exchanges (Sendrecv), not from MPI's collectives"
    for name in hooks.DATA_COLLECTIVES
}


def cases(size: int):
    return sum_cases(size)


def inputs(case, rank: int, size: int) -> tuple:
    return (vector(case, rank, size),)


def call(fn, comm, args):
    return leave_x_alone(fn, comm, args)


def reference(comm, x: np.ndarray) -> np.ndarray:
    """The model solution, with the fold-in of extra ranks for p not a power of two."""
    p, r = comm.Get_size(), comm.Get_rank()
    x = np.array(x, copy=True)
    p2 = 1 << (p.bit_length() - 1)  # largest power of two <= p
    extra = p - p2
    incoming = np.empty_like(x)
    if r < 2 * extra:  # fold in: even ranks hand their data to the odd neighbour and wait
        if r % 2 == 0:
            comm.Send(x, dest=r + 1)
            comm.Recv(x, source=r + 1)
            return x
        comm.Recv(incoming, source=r - 1)
        x += incoming
        vr = r // 2
    else:
        vr = r - extra
    mask = 1
    while mask < p2:
        vpartner = vr ^ mask
        partner = 2 * vpartner + 1 if vpartner < extra else vpartner + extra
        comm.Sendrecv(x, dest=partner, recvbuf=incoming, source=partner)
        x += incoming
        mask <<= 1
    if r < 2 * extra:
        comm.Send(x, dest=r - 1)
    return x


def verify(case, ctx):
    p = ctx.size
    p2 = 1 << (p.bit_length() - 1)
    limit = p2.bit_length() - 1 + (1 if p != p2 else 0)
    # collective on ctx.comm: every rank, before any early return
    partners = ctx.comm.allgather(sorted(set(hooks.values_sent(ctx)) - {ctx.rank})) if p != p2 else None
    vectors = hooks.vectors_to_read(ctx)
    return hooks.wire_agrees(ctx) or compare_sum(ctx.got, ctx.expected) or hooks.max_sends(
        ctx, limit, "recursive doubling needs one exchange per round (lg p rounds, one more for ranks folded in)"
    ) or received_enough(ctx) or exchanges(ctx, p2) or folded_in(ctx, p2, partners) or \
        hooks.passed_on(ctx, vectors, "recursive doubling")


METADATA = 16  # values a rank may send a partner beside the vector: its shape or length first
def exchanges(ctx, p2: int):
    """Recursive doubling's pattern in what a rank sent: the vector to each partner once (in segments if
    you like: values counted, not messages); with p a power of two, a partner in each of the lg p rounds.
    A ring passes the vector to one neighbour p-1 times; a tree's leaves send to one rank only."""
    r, n = ctx.rank, int(ctx.case.params["n"])
    sent = hooks.values_sent(ctx)
    per = {peer: sum(values) for peer, values in sorted(sent.items())}
    receives = [c for c in ctx.calls if "recv" in c.name.lower() or "probe" in c.name.lower()]
    received = {c.source for c in receives}
    for peer, values in per.items():
        twice = n + METADATA < values <= 2 * (n + METADATA) and max(sent[peer]) <= n + METADATA  # (not a float64 copy)
        if twice and ctx.size != p2 and peer in received:  # a swap at the fold-in (a ring at 3 sends on, not back)
            return Wrong(f"rank {r} sent {values} values (of x's dtype, {ctx.expected.dtype}) to rank {peer}: the "
                         f"vector ({n} values) twice; recursive doubling sends each partner the vector once",
                         hint="at the fold-in, the rank that sits out hands its vector over (Send) and gets the sum "
                              "back at the end (Recv): swapping vectors there (Sendrecv) sends it one it never "
                              "uses.")
        if values < n:
            return Wrong(f"rank {r} sent {values} values to rank {peer}, not the whole vector ({n} values): "
                         "recursive doubling swaps the whole partial sum with each partner",
                         hint="one Sendrecv of the whole vector per round, with partner r ^ 2**k in round k: "
                              "swapping halves, then quarters (recursive halving, then gathering the pieces "
                              "back) is Rabenseifner's algorithm, another one.")
        if values > n + METADATA:
            return Wrong(f"rank {r} sent {values} values (of x's dtype, {ctx.expected.dtype}) to rank {peer}; "
                         f"recursive doubling swaps the vector ({n} values) with each partner once",
                         hint="one Sendrecv per round, with partner r ^ 2**k in round k: passing the vector around "
                              "a ring sends it to the same rank p-1 times.")
    named = all(isinstance(c.source, int) and 0 <= c.source < ctx.size for c in receives)  # no wildcard source
    if named and set(per) - {r} != received - {r}:
        return Wrong(f"rank {r} sent to rank(s) {sorted(set(per) - {r})} and received from {sorted(received - {r})}; "
                     "in recursive doubling every message is half of a swap: a rank receives from each partner it "
                     "sends to",
                     hint="Sendrecv with the same partner both ways, r ^ 2**k in round k: sending to r + 2**k and "
                          "receiving from r - 2**k sums right for powers of two, but is another algorithm.")
    rounds = p2.bit_length() - 1
    if ctx.size == p2 and len(per) != rounds:
        return Wrong(f"rank {r} sent to {len(per)} rank(s) {sorted(per)}; with {ctx.size} ranks (a power of two) "
                     f"every rank swaps with lg p = {rounds} partners, one per round",
                     hint="in round k every rank swaps with r ^ 2**k: no rank sits out when p is a power of two "
                          "(a tree's reduce then broadcast leaves some ranks with one partner).")
    return None


def folded_in(ctx, p2: int, partners: list[list[int]] | None) -> Wrong | None:
    """For p not a power of two, the fold-in's shape across the ranks (`partners`: the ranks each sent to):
    p' of them swap with lg p' partners or more, and the pairs that exchanged are the p - p' folded in and
    the p'·lg p' / 2 of the swaps. A tree's reduce then broadcast leaves fewer ranks with that many partners
    (at 7 ranks: 3 of 7), though each rank's own messages look like swaps; a chain up and back down leaves
    enough (5 of 7 with 2), but only p - 1 pairs (27/36 once: right at 7 ranks)."""
    if partners is None:
        return None
    rounds = p2.bit_length() - 1
    core = sum(1 for k in partners if len(k) >= rounds)
    pairs = {frozenset((r, q)) for r, peers in enumerate(partners) for q in peers}
    needed = ctx.size - p2 + p2 * rounds // 2
    if core >= p2 and len(pairs) >= needed:
        return None
    if core >= p2:
        return Wrong(f"{len(pairs)} pairs of ranks exchanged; with {ctx.size} ranks recursive doubling's "
                     f"fold-in makes {ctx.size - p2} pairs and its {rounds} rounds of swaps among p' = {p2} ranks "
                     f"{p2 * rounds // 2} more",
                     hint="in round k rank r swaps with r ^ 2**k among the first p' ranks (after the fold-in): a "
                          "chain that sums up the ranks and hands the sum back down pairs each rank with its "
                          "neighbours only.")
    return Wrong(f"{core} of {ctx.size} ranks exchanged with {rounds} partner(s) or more; with {ctx.size} ranks, "
                 f"recursive doubling's fold-in leaves p' = {p2} ranks that each swap with lg p' = {rounds}, one "
                 "per round",
                 hint="fold in the last p - p' ranks first (each hands its vector to a partner among the first p' "
                      "and sits out), run lg p' rounds of swaps among the first p', then hand the sum back: a "
                      "tree's reduce and broadcast leave ranks with fewer partners.")


def diagnose(case, ctx) -> str | None:
    return diagnose_sum(case, ctx, chunks=False)


def explain(results) -> str | None:
    hint = explain_sums(results, chunks=False)
    if hint:
        return hint
    failed = {r.ranks for r in results if r.verdict in ("WRONG", "ERROR", "HANG")}
    passed = {r.ranks for r in results if r.verdict in ("PASS", "SLOW")}
    odd = {p for p in failed if p & (p - 1)}
    if failed and odd == failed and passed:
        return ("right for powers of two, not for other rank counts: fold the extra ranks in first "
                "(pair ranks 0..2·(p−p')−1, one of each pair sends its data to the other and waits for the result).")
    return None
