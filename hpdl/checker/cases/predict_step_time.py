"""Checks for lesson 09's first exercise: the core of the scaling predictor.

    predict_step_time(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1) -> float
        t_comm  = buckets · ring_allreduce(nbytes / buckets)
                = buckets · 2(p−1)α + 2(p−1)/p · nbytes · β + (p−1)/p · nbytes · γ
        exposed = max(t_comm − overlap · compute, t_comm / buckets)
        step    = compute + exposed            (just compute when p = 1)

The reference is hpdl.predict.predict_step_time. Each rank evaluates its own share of a grid of
inputs (rank counts 1 to 512, with and without overlap, one bucket or many), so together the
ranks cover all of it; the last case feeds the published Horovod configurations and also
requires the efficiencies they give to be within 5 points of the published ones. The usual
slips land far from the reference: a bandwidth term without 2(p−1)/p, overlap taken off the
compute instead of the communication, the latency paid once for all buckets, no last bucket.
"""
from __future__ import annotations

import math
import numbers

from hpdl.checker.cases import Case, Wrong, nonce_seed

SIGNATURE = "predict_step_time(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1) -> float  # seconds"
RANKS = (1, 2, 3, 4)
TIMEOUT = 10.0
RTOL = 1e-6
PRIVATE_INPUTS = True  # each rank gets its points as data, drawn with the check's nonce where there is one
PUBLISHED_TOLERANCE = 0.05  # efficiency points


def _grid(seed, n: int, *, overlap: bool, buckets: bool) -> list[dict]:
    import random

    rng = random.Random(seed)
    points = []
    for i in range(n):
        p = [2, 3, 4, 5, 8, 16, 100, 512][i % 8]
        points.append({
            "compute": round(rng.uniform(0.01, 0.5), 4), "nbytes": float(rng.choice([4e3, 1e6, 1e8, 5.5e8])),
            "alpha": rng.choice([1e-6, 5e-6, 2e-5]), "beta": 1 / rng.choice([3.125e9, 12e9, 50e9]),
            "gamma": 1 / rng.choice([5e9, 244e9]), "p": p,
            "overlap": round(rng.uniform(0.2, 0.66), 3) if overlap else 0.0,
            "buckets": rng.choice([1, 2, 4, 9, 25]) if buckets else 1,
        })
    return points


def _published() -> list[dict]:
    from hpdl import predict, published

    points = []
    for r in published.results():
        s = r.system
        if s.algorithm != "ring":
            continue  # hierarchical systems need more than the ring of this exercise
        w = r.workload
        points.append({"compute": w.batch * w.seconds_per_sample, "nbytes": w.grad_bytes, "alpha": s.inter.alpha,
                       "beta": s.inter.beta, "gamma": s.gamma, "p": r.ranks, "overlap": predict.overlap_fraction(w),
                       "buckets": w.bucket_count, "published": r.efficiency, "label": f"{w.name} on {r.ranks} GPUs"})
    return points


def cases(size: int) -> list[Case]:
    return [
        Case("one rank: no communication", {"points": [
            {"compute": 0.2, "nbytes": 1e8, "alpha": 1e-5, "beta": 1e-9, "gamma": 1e-10, "p": 1, "overlap": 0.5,
             "buckets": 4}]}),
        Case("no overlap, one bucket, 2–512 ranks", {"grid": [1, 16, False, False]}),
        Case("many buckets, no overlap", {"grid": [2, 16, False, True]}),
        Case("overlap with backward", {"grid": [3, 16, True, True]}),
        Case("published: Horovod, 128 and 512 Pascal GPUs", {"points": _published(), "published": True}),
        Case("hidden: more of everything", {"grid": [4, 24, True, True]}, hidden=True),
    ]


def inputs(case: Case, rank: int, size: int) -> tuple:
    """This rank's share of the grid: every size-th point, starting at its rank. A grid is drawn with the
    check's nonce where it has one (grading, PRIVATE_INPUTS): a table of a stripped kit's public answers
    (*.expected) fits no graded case."""
    p = case.params
    if "grid" not in p:
        return (p["points"][rank::size],)
    seed, n, overlap, buckets = p["grid"]
    return (_grid(seed if p.get("nonce") is None else nonce_seed({**p, "seed": seed}), n, overlap=overlap,
                  buckets=buckets)[rank::size],)


def _args(point: dict) -> dict:
    return {k: point[k] for k in ("compute", "nbytes", "alpha", "beta", "gamma", "p", "overlap", "buckets")}


def call(fn, comm, args):
    (points,) = args
    return [fn(**_args(pt)) for pt in points]


def reference(comm, points):
    from hpdl.predict import predict_step_time

    return [predict_step_time(**_args(pt)) for pt in points]


def verify(case: Case, ctx) -> Wrong | None:
    (points,) = ctx.args
    for pt, got, want in zip(points, ctx.got, ctx.expected):
        if got is None or isinstance(got, bool) or not isinstance(got, numbers.Real) or math.isnan(got):
            return Wrong(f"returned {got!r} for {_show(pt)}; expected a number of seconds")
        if abs(got - want) > RTOL * abs(want):
            return Wrong(f"{_show(pt)}: predicted {got:.6g} s, expected {want:.6g} s",
                         hint=_why(pt, float(got)), max_error=abs(got - want) / want)
        if "published" in pt:
            eff = pt["compute"] / got
            if abs(eff - pt["published"]) > PUBLISHED_TOLERANCE:
                return Wrong(f"{pt['label']}: efficiency {eff:.1%}, published {pt['published']:.0%}")
    return None


def _show(pt: dict) -> str:
    return (f"compute={pt['compute']:g} s, nbytes={pt['nbytes']:.3g}, α={pt['alpha']:.2g}, β={pt['beta']:.3g}, "
            f"γ={pt['gamma']:.3g}, p={pt['p']}, overlap={pt['overlap']:g}, buckets={pt['buckets']}")


def _ring(n, p, a, b, g, bw_factor=None):
    share = (p - 1) / p
    return 2 * (p - 1) * a + (2 * share if bw_factor is None else bw_factor) * n * b + share * n * g


def _why(pt: dict, got: float) -> str | None:
    """Name the slip whose prediction lands on what the learner returned."""
    names = ("compute", "nbytes", "alpha", "beta", "gamma", "p", "overlap", "buckets")
    c, n, a, b, g, p, ov, k = (pt[x] for x in names)
    if p <= 1:
        return "one rank has nothing to all-reduce: the step is just the compute."
    t = k * _ring(n / k, p, a, b, g)

    def hidden(t_comm):
        return c + max(t_comm - ov * c, t_comm / k)

    slips = {
        "the bandwidth term misses 2(p−1)/p: in a ring each rank sends and receives 2(p−1)/p · n bytes, "
        "not n (and not 2n).": [hidden(k * _ring(n / k, p, a, b, g, f)) for f in (1.0, 2.0)],
        "overlap hides communication behind backward; it does not shrink the compute: "
        "exposed = max(t_comm − overlap · compute, t_comm / buckets), step = compute + exposed.":
            [(1 - ov) * c + t, max(c, t), c + max(0.0, t - ov * c) * (1 - ov)],
        "every bucket is an all-reduce of its own and pays the latency 2(p−1)α again: "
        "t_comm = buckets · 2(p−1)α + the bandwidth and reduction terms of all the bytes.":
            [hidden(_ring(n, p, a, b, g)), hidden(k * _ring(n, p, a, b, g))],
        "the last bucket is ready only when backward ends, so at least t_comm / buckets stays exposed.":
            [c + max(0.0, t - ov * c)],
        "the reduction term is (p−1)/p · n · γ: each rank adds the (p−1)/p of the data it receives.":
            [hidden(t - k * (p - 1) / p * (n / k) * g), hidden(t + (n - (p - 1) / p * n) * g)],
        "the ring has 2(p−1) steps, each paying α: not 2p, not lg p.":
            [hidden(t - k * 2 * (p - 1) * a + k * 2 * p * a), hidden(t - k * 2 * (p - 1) * a + k * math.log2(p) * a)],
    }
    found = [hint for hint, candidates in slips.items() if any(abs(got - x) <= 1e-6 * abs(x) for x in candidates)]
    return " Or: ".join(found) or None  # some slips give the same number on some inputs: name them all


def explain(results) -> str | None:
    def ok(name):
        return [r.verdict in ("PASS", "SLOW") for r in results if r.name == name]

    plain, overlapped = ok("no overlap, one bucket, 2–512 ranks"), ok("overlap with backward")
    if plain and all(plain) and overlapped and not all(overlapped):
        return ("right without overlap, wrong with it: the overlap fraction of the compute is time during which "
                "communication runs for free — take it off t_comm, never off the compute.")
    return None
