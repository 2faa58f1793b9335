"""Checks for lesson 07's first exercise: pick the allreduce algorithm with the least modelled cost.

    def choose_algorithm(nbytes, p, alpha, beta, gamma) -> str
        # "recursive_doubling", "reduce_scatter_allgather" or "ring": the cheapest in the α-β-γ
        # model for `nbytes` per rank on `p` ranks

The model (lesson 04, with the fold-in MPICH uses when p is not a power of two: p' the largest
power of two ≤ p; the p − p' extra ranks first hand their vector to a partner and get the
result back, which costs 2(α + nβ) + nγ more):

    recursive doubling        lg p'·(α + nβ + nγ)                           [+ fold-in]
    reduce-scatter+allgather  2 lg p'·α + 2(p'−1)/p'·nβ + (p'−1)/p'·nγ      [+ fold-in]
    ring                      2(p−1)·α + 2(p−1)/p·nβ + (p−1)/p·nγ

The function takes no communicator: `call()` evaluates it over a grid of sizes and rank counts
(plus points 0.1–3 % either side of every crossover of the model, found by bisection) and
`verify()` accepts any algorithm whose cost is within 1e-9 of the least (ties, e.g. p = 1 or 2).
Graded, each machine gains two rank counts drawn with the check's nonce (one a power of two, one
not), each asked at many sizes drawn too: a table of a stripped kit's public answers (*.expected)
meets rank counts it never saw. (Drawn sizes, not crossovers: inputs() goes to the learner's job,
and finding a crossover takes the answer.)
The usual slips land off the grid's crossovers: a fixed size threshold, a cost off by a factor
(γ forgotten, 2(p−1)/p read as (p−1)/p, lg p read as p), ignoring the fold-in.
"""
from __future__ import annotations


from hpdl.checker.cases import Case, Wrong, nonce_seed

SIGNATURE = 'choose_algorithm(nbytes, p, alpha, beta, gamma) -> str   # "recursive_doubling", ' \
            '"reduce_scatter_allgather" or "ring"'
RANKS = (1, 2)
TIMEOUT = 20.0
PRIVATE_INPUTS = True  # graded, two rank counts more per machine, drawn with the check's nonce (inputs())
DRAWN_SIZES = 96  # per drawn rank count: about three a doubling from 1 B to 1 GiB
ALGORITHMS = ("recursive_doubling", "reduce_scatter_allgather", "ring")
SIZES = [8 << (2 * i) for i in range(13)]  # 8 B … 128 MiB
#: how far either side of each crossover its points lie: a ring's γ term taken as nγ (not (p−1)/p·nγ), or with
#: p' for p, moves a crossover by 0.1–3 %, and with points at ±3 % alone each scored 8/8 (83 and 97 checks in 100)
NEAR = (0.001, 0.003, 0.01, 0.03)
CLUSTERS = {
    "this machine": (2e-6, 1 / 5e9, 1 / 5e9),
    "InfiniBand cluster": (1.5e-6, 1 / 25e9, 1 / 20e9),
    "slow Ethernet": (30e-6, 1 / 1.2e9, 1 / 8e9),
    "NVLink node": (8e-6, 1 / 300e9, 1 / 1000e9),
}


def cost(name: str, n: float, p: int, a: float, b: float, g: float) -> float:
    """Modelled seconds of allreduce `name` for n bytes per rank on p ranks."""
    if p <= 1:
        return 0.0
    if name == "ring":
        return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g
    p2 = 1 << (p.bit_length() - 1)
    lg = p2.bit_length() - 1
    fold = 0.0 if p == p2 else 2 * (a + n * b) + n * g
    if name == "recursive_doubling":
        return lg * (a + n * b + n * g) + fold
    if name == "reduce_scatter_allgather":
        return 2 * lg * a + 2 * (p2 - 1) / p2 * n * b + (p2 - 1) / p2 * n * g + fold
    raise ValueError(name)


def best(n: float, p: int, a: float, b: float, g: float) -> str:
    return min(ALGORITHMS, key=lambda name: cost(name, n, p, a, b, g))


def crossovers(p: int, a: float, b: float, g: float) -> list[int]:
    """Sizes (bytes) where the cheapest algorithm changes, between 1 B and 1 GiB."""
    out, lo = [], 1.0
    grid = [2.0 ** (k / 4) for k in range(0, 121)]
    for x, y in zip(grid, grid[1:]):
        if best(x, p, a, b, g) != best(y, p, a, b, g):
            lo, hi = x, y
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if best(mid, p, a, b, g) == best(x, p, a, b, g) else (lo, mid)
            out.append(int(round(hi)))
    return out


def cases(size):
    def grid(name, ps, hidden=False):
        a, b, g = CLUSTERS[name]
        points = [(n, p) for p in ps for n in SIZES]
        for p in ps:
            for c in crossovers(p, a, b, g):
                points += [(max(1, int(c * (1 - d))), p) for d in NEAR] + [(int(c * (1 + d)) + 1, p) for d in NEAR]
        return Case(f"{name}: p = {', '.join(map(str, ps))}", {"alpha": a, "beta": b, "gamma": g, "points": points,
                                                               "seed": len(ps) * 1000 + ps[-1]},
                    hidden=hidden, slow_factor=1e6)

    return [grid("this machine", [2, 4, 8]), grid("InfiniBand cluster", [16, 64, 1024]),
            grid("slow Ethernet", [3, 6, 12, 48]), grid("NVLink node", [1, 5, 8, 7, 100], hidden=True)]


def inputs(case, rank, size):
    """The case's α, β, γ and points; with the check's nonce (grading) also every size of SIZES and
    DRAWN_SIZES more, at one more power of two and one more other rank count, neither the case's."""
    import random

    params = {k: case.params[k] for k in ("alpha", "beta", "gamma", "points")}
    if "nonce" not in case.params:
        return (params,)
    rng = random.Random(nonce_seed(case.params))
    ps = {p for _, p in params["points"]}
    drawn = [rng.choice([q for q in (1 << k for k in range(1, 11)) if q not in ps]),
             rng.choice([q for q in range(3, 129) if q & (q - 1) and q not in ps])]
    extra = [(n, p) for p in drawn for n in SIZES + [max(1, int(2 ** rng.uniform(0, 30))) for _ in range(DRAWN_SIZES)]]
    return ({**params, "points": params["points"] + extra},)


def call(fn, comm, args):
    (params,) = args
    a, b, g = params["alpha"], params["beta"], params["gamma"]
    return [fn(n, p, a, b, g) for n, p in params["points"]]


def reference(comm, params):
    a, b, g = params["alpha"], params["beta"], params["gamma"]
    return [best(n, p, a, b, g) for n, p in params["points"]]


def verify(case, ctx):
    (params,) = ctx.args  # the points asked (more in grading)
    a, b, g = params["alpha"], params["beta"], params["gamma"]
    got = ctx.got
    if not isinstance(got, list) or len(got) != len(params["points"]):
        return Wrong("the checker could not collect one answer per (nbytes, p)")
    wrong = []
    for (n, p), answer in zip(params["points"], got):
        if answer not in ALGORITHMS:
            return Wrong(f"choose_algorithm({n}, {p}, ...) returned {answer!r}; expected one of {list(ALGORITHMS)}")
        least = min(cost(x, n, p, a, b, g) for x in ALGORITHMS)
        mine = cost(answer, n, p, a, b, g)
        if mine > least * (1 + 1e-9) + 1e-18:
            wrong.append((n, p, answer, best(n, p, a, b, g), mine / least))
    if not wrong:
        return None
    n, p, answer, right, factor = max(wrong, key=lambda w: w[4])
    return Wrong(f"{len(wrong)} of {len(got)} choices are not the cheapest; e.g. {n} B on {p} ranks: {answer} "
                 f"(modelled {factor:.2f}× slower than {right})", max_error=factor - 1)


def diagnose(case, ctx):
    (params,) = ctx.args
    a, b, g = params["alpha"], params["beta"], params["gamma"]
    pts, got = params["points"], ctx.got
    if not isinstance(got, list) or any(x not in ALGORITHMS for x in got):
        return None
    by_p: dict[int, list[tuple[int, str]]] = {}
    for (n, p), x in zip(pts, got):
        by_p.setdefault(p, []).append((n, x))
    # one size that splits recursive doubling from the rest for every p: a fixed threshold, not the model
    below = max((n for v in by_p.values() for n, x in v if x == "recursive_doubling"), default=0)
    above = min((n for v in by_p.values() for n, x in v if x != "recursive_doubling"), default=None)
    if len(by_p) > 1 and above is not None and below < above:
        return ("your switch point does not move with p, α, β or γ: compare the three modelled costs for each "
                "call instead of using a fixed size threshold.")
    right = [best(n, p, a, b, g) == x for (n, p), x in zip(pts, got)]
    odd = [p & (p - 1) != 0 for n, p in pts]
    if not all(odd) and any(o and not r for o, r in zip(odd, right)) and all(r for o, r in zip(odd, right) if not o):
        return ("right for powers of two, wrong for other p: recursive doubling and reduce-scatter + allgather "
                "run on p' = the largest power of two ≤ p, plus the fold-in 2(α + nβ) + nγ.")
    ring_late = any(x != "ring" and best(n, p, a, b, g) == "ring" for (n, p), x in zip(pts, got))
    ring_early = any(x == "ring" and best(n, p, a, b, g) != "ring" for (n, p), x in zip(pts, got))
    if ring_early and not ring_late:
        return ("you pick the ring too early: its latency term is 2(p−1)·α, and its bandwidth term 2(p−1)/p·nβ "
                "(check each term against the model: a factor is off).")
    if ring_late and not ring_early:
        return "you pick the ring too late: check each cost term against the model (a factor is off)."
    return "compare your three cost formulas with the model in the exercise term by term (α, β and γ terms)."
