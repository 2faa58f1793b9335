"""Checks for bcast_binomial(comm, x, root) -> the root's array, on every rank.

A binomial tree: counted from the root, rank v receives once from v minus its lowest set bit,
then sends to v + 2^k for the smaller powers of two, the largest first; the root sends at most
⌈lg p⌉ messages, and the broadcast takes ⌈lg p⌉ rounds, counted along the tree the messages form
in the order each rank sent them (graded at 8 ranks too, where a binary heap's tree is not one).
Non-root ranks get x=None: they learn the array from the message (comm.send/recv carry whole
objects).
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, one_rank_points

SIGNATURE = "bcast_binomial(comm, x: np.ndarray | None, root: int) -> np.ndarray"
RANKS = (1, 2, 3, 4)
# and in grading, 8: up to 4 ranks a binary heap's tree (children 2v+1, 2v+2) is one of the binomial trees, and
# scored 18/18; at 8 it takes 4 rounds
GRADED_RANKS = (8,)
TIMEOUT = 5.0
PRIVATE_INPUTS = True  # each rank gets only its own inputs: the others' come by message or not at all
METERED = True  # the bytes each rank sends are counted outside its process (meter.py), against the recorder
FORBIDDEN = {
    name: "the broadcast is to be built from point-to-point messages along a binomial tree, not from "
          "MPI's collectives"
    for name in hooks.DATA_COLLECTIVES
}
# MPI's own broadcast is a binomial tree at these rank counts (MPICH's below 8 ranks): called unrecorded (its
# method taken from the recorder's wrapper), under calls rewritten as a tree's, it sent what the tree sends to
# each peer (18/18). In the learner's job it scatters, then gathers around a ring, where every rank sends
LIBRARY_ALGORITHMS = {
    "MPICH": {"MPIR_CVAR_BCAST_INTRA_ALGORITHM": "scatter_ring_allgather"},
    "Open MPI": {"OMPI_MCA_coll_tuned_use_dynamic_rules": "1", "OMPI_MCA_coll_tuned_bcast_algorithm": "9"},
    "Intel MPI": {"I_MPI_ADJUST_BCAST": "3"},
}


def cases(size: int) -> list[Case]:
    p = size
    out, seen = [], set()
    # every array over 32 KiB, twice the bytes a rank may send a peer unrecorded (hooks.WIRE_SLACK): a linear
    # broadcast hidden from the recorder, its calls rewritten as a tree's, shows on the wire in every case
    # (with arrays of 8 bytes to 4 KB it passed all but the large hidden case, where it was honest: 18/18)
    wanted = [
        (0, 5000, "float64", False), (p - 1, 5000, "float64", False), (p // 2, 10_000, "float32", False),
        (0, 4096, "int64", False), (1 % p, 100_000, "float32", True), ((p + 1) // 2 % p, 9001, "int32", True),
    ]
    for seed, (root, n, dtype, hidden) in enumerate(wanted):
        if (root, n, dtype) in seen:
            continue
        seen.add((root, n, dtype))
        out.append(Case(f"root={root} n={n} {dtype}", {"root": root, "n": n, "dtype": dtype, "seed": seed},
                        hidden=hidden, points=one_rank_points(p)))
    return out


def inputs(case, rank: int, size: int) -> tuple:
    params = case.params
    root = params["root"]
    if rank != root:
        return (None, root)
    rng = np.random.default_rng([params.get("nonce", 0), params["seed"]])
    return (full_entropy(rng, params["n"], np.dtype(params["dtype"])), root)


def full_entropy(rng, n: int, dtype: np.dtype) -> np.ndarray:
    """n values that pack into nothing much smaller (whole numbers of the dtype's range, or normal floats: zlib
    keeps over 90% of them). Whole numbers in ±1000 plus a half packed into 11 bits a value, so a linear
    broadcast called by address in MPI's library hid its copies within the wire's slack (13.8 KB a peer) beside a
    tree of zeros, and scored 20/24."""
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)
    return rng.standard_normal(n).astype(dtype)


def reference(comm, x, root: int):
    """The model solution: receive once from the parent, then send to the children."""
    p, r = comm.Get_size(), comm.Get_rank()
    vr = (r - root) % p  # rank counted from the root
    mask = 1
    while mask < p:
        if vr & mask:
            x = comm.recv(source=(vr - mask + root) % p)
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if vr + mask < p:
            comm.send(x, dest=(vr + mask + root) % p)
        mask >>= 1
    return x


def _lg(p: int) -> int:
    return (p - 1).bit_length()  # ⌈lg p⌉


def verify(case, ctx):
    everyone = hooks.gather_calls(ctx)  # collective: first, on every rank
    wrong = hooks.wire_agrees(ctx) or hooks.compare(ctx.got, ctx.expected) or hooks.max_sends(
        ctx, _lg(ctx.size), "in a binomial tree no rank sends more than ⌈lg p⌉ messages; sending from the root to "
                            "every rank is a linear broadcast")
    if wrong is not None or ctx.rank != case.params["root"]:  # every other rank: the root's array reached it
        nbytes = getattr(ctx.expected, "nbytes", 0)
        return wrong or hooks.received_at_least(ctx, nbytes, "the root's array") or hooks.carried_by_calls(
            ctx, nbytes, "the root's array", everyone)
    rounds = hooks.broadcast_rounds(everyone, case.params["root"])
    if rounds is None:
        return Wrong("the messages do not form a tree from the root: every other rank must receive the array "
                     "exactly once, from a rank that already has it")
    if rounds > _lg(ctx.size):
        return Wrong(f"the messages form a tree that needs {rounds} rounds; a binomial tree needs ⌈lg p⌉ = "
                     f"{_lg(ctx.size)} with {ctx.size} ranks (a chain or a linear broadcast is slower)",
                     hint="rank v (counted from the root) receives once from v minus its lowest set bit, then "
                          "sends to v + 2^k for the smaller powers of two, the largest first: the number of ranks "
                          "holding the data doubles every round.")
    return None


def diagnose(case, ctx) -> str | None:
    if ctx.got is None:
        return "this rank returned None: every rank must return the array it received."
    root = case.params["root"]
    if root != 0 and ctx.rank != root and hooks.compare(ctx.got, ctx.expected) is not None:
        return f"the root here is rank {root}, not 0: count ranks relative to the root, (rank - root) % p."
    return None


def explain(results) -> str | None:
    failed = [r for r in results if r.verdict in ("WRONG", "ERROR", "HANG")]
    passed = [r for r in results if r.verdict in ("PASS", "SLOW")]
    if failed and all(r.params.get("root") != 0 for r in failed) and any(r.params.get("root") == 0 for r in passed):
        return "right for root 0 only: shift ranks by the root, vr = (rank - root) % p, and back when sending."
    return None
