"""Shared by the allreduce-by-hand exercises (ring, recursive doubling): inputs and hints.

Inputs are random multiples of one power of two, as many significant bits as the dtype holds
less the ⌈lg p⌉ a sum of p of them needs: every sum is exact in float32 and float64 whatever the
order of additions, so results are compared exactly (compare_sum), and a wrong value is a wrong
algorithm, never rounding. Every bit but those few is drawn from the check's nonce, so a vector
cannot be packed into fewer bytes than its dtype holds (whole numbers below 100 fitted in a
uint16: a whole vector passed along a chain, packed, fitted a ring's budget of chunks).
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, one_rank_points

# the large case's time limit, seconds (the module's TIMEOUT for the others): pickled sends of 100 003 values,
# right, took 3.5–4.8 s at 2–4 ranks on a busy 2-core machine
LARGE_TIMEOUT = 15.0


def sum_cases(size: int) -> list[Case]:
    """Lengths divisible by the rank count, not divisible, shorter than it, and larger."""
    p = size
    wanted = [
        (3 * p, "float64", False, "divisible"),
        (3 * p + 1, "float64", False, "uneven"),
        (10 * p - 1, "float32", False, "uneven"),
        (1, "float64", False, "shorter than p"),
        (max(p - 1, 1), "float32", False, "shorter than p"),
        (100_003, "float64", False, "large"),  # float64: a float32 vector has too few spare bits (see vector())
        (p, "float32", True, "one per rank"),
        (2 * p + 1, "float64", True, "uneven"),
        (257, "float64", True, "uneven"),
    ]
    cases, seen = [], set()
    for seed, (n, dtype, hidden, kind) in enumerate(wanted):
        if (n, dtype) in seen:
            continue
        seen.add((n, dtype))
        if kind == "shorter than p" and n >= p:
            kind = "uneven" if n % p else "divisible"
        elif kind != "large" and n % p == 0:
            kind = "divisible"
        cases.append(Case(f"n={n} {dtype} ({kind})", {"n": n, "dtype": dtype, "seed": seed, "uneven": n % p != 0,
                                                        "short": n < p}, hidden=hidden, points=one_rank_points(p),
                          timeout=LARGE_TIMEOUT if kind == "large" else None, witness=kind == "large"))
    return cases


def vector(case: Case, rank: int, size: int) -> np.ndarray:
    """This rank's summand. With a check's nonce (PRIVATE_INPUTS) no rank can work out another's.

    Whole numbers k with 0 < |k| < 2**b, scaled by 2**(1-b) (so within ±2): b is the dtype's
    significand bits less ⌈lg size⌉, so any partial sum of `size` of them is exact, and the
    sign and b bits of each are random (full-entropy mantissas: nothing to pack away)."""
    params = case.params
    dtype = np.dtype(params["dtype"])
    rng = np.random.default_rng([params.get("nonce", 0), 1000 * params["seed"] + rank])
    bits = np.finfo(dtype).nmant + 1 - max(int(size) - 1, 0).bit_length()
    # nonzero: every other rank adds something, so no rank's own vector is ever the sum (with a
    # zero on rank 0, a ring that leaves the sum on rank 0 only passed a one-element case at p = 2)
    k = rng.integers(1, 2**bits, params["n"], dtype=np.int64) * rng.choice(np.array([-1, 1]), params["n"])
    return np.ldexp(k.astype(np.float64), 1 - bits).astype(dtype)


def leave_x_alone(fn, comm, args):
    """The learner's function on this rank's x; {"changed": "x"} instead of its answer when it changed x: the
    exercise returns the sum as a new array and leaves x alone (a ring that summed into x scored 27/27)."""
    (x,) = args
    before = np.array(x, copy=True)
    got = fn(comm, x)
    if not (isinstance(x, np.ndarray) and x.shape == before.shape and np.array_equal(x, before, equal_nan=True)):
        return {"changed": "x"}
    return got


def compare_sum(got, expected) -> Wrong | None:
    """Exact: the inputs (vector) make every order of additions give the same sum, and any
    tolerance would be bits a learner could leave out when packing a whole vector into a chunk."""
    if isinstance(got, dict) and got.get("changed") == "x":
        return Wrong("the function changed x in place; it returns the sum as a new array and leaves x as it was",
                     hint="start from a copy (total = x.copy()) and add into that: the caller's x is still theirs.")
    return hooks.compare(got, expected, rtol=0.0, atol=0.0)


def received_enough(ctx) -> Wrong | None:
    """An allreduce's result on a rank depends on every other rank's vector: at least (p-1)/p of the
    vector must reach it as messages (with ctx.wire, counted by the kernel; hooks.received_at_least), and
    its own vector must leave it in the messages it recorded (hooks.carried_by_calls: point-to-point only)."""
    n, p = ctx.expected.size, ctx.size
    what = f"a sum of {n} elements over {p} ranks"
    return (hooks.received_for_allreduce(ctx, ctx.expected.nbytes, what)
            or hooks.carried_by_calls(ctx, ctx.expected.nbytes * (p - 1) // p, what))


def chunk_bounds(n: int, p: int) -> list[int]:
    return [i * n // p for i in range(p + 1)]


def diagnose_sum(case: Case, ctx, chunks: bool = True) -> str | None:
    """Hints for a wrong sum on one rank, from what the result looks like (`chunks`: the
    algorithm cuts x into one chunk per rank, so uneven lengths are a likely culprit)."""
    got, expected, (x,) = ctx.got, ctx.expected, ctx.args[:1]
    if not isinstance(got, np.ndarray) or got.shape != expected.shape:
        return None
    p, n = ctx.size, expected.size
    if np.array_equal(got, x) and p > 1:
        return "this rank returned its own input unchanged: nothing from the other ranks was added."
    if n and np.allclose(got * p, expected):
        return "this looks averaged, not summed: the exercise asks for the sum."
    if got.dtype != expected.dtype:
        return None
    bad = ~np.isclose(got.astype(np.float64), expected.astype(np.float64))
    if chunks and n % p and bad.any():
        return ("the length does not divide by the number of ranks here, so chunks differ in length: every rank "
                "must use the same chunk boundaries, e.g. bounds = [i * n // p for i in range(p + 1)].")
    if np.isnan(got).any() or np.abs(got).max() > 1e6 * max(1.0, np.abs(expected).max()):
        return "these look like uninitialised memory: a receive buffer of the wrong dtype or length?"
    return None


def explain_sums(results, chunks: bool = True) -> str | None:
    """A pattern across cases: right when n divides by p, wrong otherwise; or short inputs."""
    failed = [r for r in results if r.verdict in ("WRONG", "ERROR")]
    if not failed or any(getattr(r, "rejected", None) for r in failed):
        return None
    passed = [r for r in results if r.verdict in ("PASS", "SLOW")]
    if chunks and all(r.params.get("uneven") for r in failed) and any(not r.params.get("uneven") for r in passed):
        return ("right whenever the length divides evenly by the number of ranks, wrong otherwise: "
                "check how you cut x into chunks (the last chunk, or every chunk, must absorb the remainder).")
    if all(r.params.get("short") for r in failed) and passed:
        return "wrong only when x has fewer elements than there are ranks: some chunks are then empty."
    return None
