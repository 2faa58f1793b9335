"""Shared by the allreduce-by-hand exercises (ring, recursive doubling): inputs and hints.

Inputs are whole numbers plus a rank-dependent quarter, so every sum is exact in float32
and float64 whatever the order of additions: a wrong value is a wrong algorithm, never
rounding.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, one_rank_points


def sum_cases(size: int) -> list[Case]:
    """Lengths divisible by the rank count, not divisible, shorter than it, and larger."""
    p = size
    wanted = [
        (3 * p, "float64", False, "divisible"),
        (3 * p + 1, "float64", False, "uneven"),
        (10 * p - 1, "float32", False, "uneven"),
        (1, "float64", False, "shorter than p"),
        (max(p - 1, 1), "float32", False, "shorter than p"),
        (100_003, "float32", False, "large"),
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
                                                        "short": n < p}, hidden=hidden, points=one_rank_points(p)))
    return cases


def vector(case: Case, rank: int) -> np.ndarray:
    """This rank's summand. With a check's nonce (PRIVATE_INPUTS) no rank can work out another's."""
    params = case.params
    rng = np.random.default_rng([params.get("nonce", 0), 1000 * params["seed"] + rank])
    # positive: every other rank adds something, so no rank's own vector is ever the sum (with a
    # zero on rank 0, a ring that leaves the sum on rank 0 only passed a one-element case at p = 2)
    x = rng.integers(1, 100, params["n"]).astype(np.float64) + rank / 4
    return x.astype(params["dtype"])


def received_enough(ctx) -> Wrong | None:
    """An allreduce's result on a rank depends on every other rank's vector: at least (p-1)/p of the
    vector must reach it as messages (with ctx.wire, counted by the kernel; hooks.received_at_least)."""
    n = ctx.expected.size
    return hooks.received_for_allreduce(ctx, ctx.expected.nbytes, f"a sum of {n} elements over {ctx.size} ranks")


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
