"""Checks for lesson 08's exercise: a small autotuner with a measurement budget.

    def autotune(measure, space, budget) -> dict
        # space: {"knob": [value, ...], ...}; measure(config) -> seconds (noisy);
        # return a config (one value per knob) close to the fastest, calling measure ≤ budget times

The checker hands the learner cost surfaces they have not seen, shaped like real tuning knobs
(a U-curve in a bucket size, a fusion threshold × cycle time valley with a tilt, a cliff) and
deterministic noise: measuring the same config again gives another, reproducible reading, as
a real measurement would. A config passes when its true (noise-free) cost is within 5% of the
best in the space. Every call beyond the budget is refused (the case is WRONG: the tuner
exhausted its budget); an exhaustive search never fits (the spaces are 2-4× the budget).
A config outside the space, or a missing knob, is WRONG too.
"""
from __future__ import annotations

import hashlib
import itertools

from hpdl.checker.cases import Case, Wrong

SIGNATURE = "autotune(measure, space: dict[str, list], budget: int) -> dict   # a config within 5% of the best"
RANKS = (1, 2)
TIMEOUT = 20.0
TOLERANCE = 1.05


class BudgetExhausted(RuntimeError):
    """Raised by measure() on the call after the last one the budget allows."""


# Each surface: the knobs' values and a noise-free cost of the indices (i, j, ...) into them.
def _surface(kind: str):
    if kind == "bucket":  # DDP's bucket_cap_mb: a U-curve, minimum off-centre
        space = {"bucket_cap_mb": [0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128, 256]}
        return space, lambda i: 10.0 + 0.9 * (i - 7.3) ** 2
    if kind == "fusion":  # Horovod fusion threshold × cycle time: a tilted valley
        space = {"fusion_mb": [0, 1, 2, 4, 8, 16, 32, 64, 128], "cycle_ms": [0.5, 1, 2, 3.5, 5, 10, 20]}
        return space, lambda i, j: 20 + 1.2 * (i - 5.6) ** 2 + 2.0 * (j - 1.2) ** 2 + 0.8 * (i - 5.6) * (j - 1.2)
    if kind == "cliff":  # too small a buffer falls off a cliff; otherwise a gentle slope
        space = {"buffsize_kb": [64, 128, 256, 512, 1024, 2048, 4096, 8192],
                 "channels": [1, 2, 4, 8, 16, 32]}
        return space, lambda i, j: (60.0 if i < 2 else 10.0 + 0.6 * (7 - i)) + 1.5 * (j - 3.8) ** 2
    if kind == "corner":  # the best setting sits at the far end of the first knob
        space = {"threads": [1, 2, 3, 4, 6, 8], "ranks_per_node": [1, 2, 4, 8, 16], "chunk_kb": [16, 64, 256, 1024]}
        return space, lambda i, j, k: 8.0 + 3.0 * (5 - i) + 1.4 * (j - 2.2) ** 2 + 0.7 * (k - 1.6) ** 2
    raise ValueError(kind)


def cases(size):
    slow = 1e6
    return [
        Case("U-curve in one knob, budget 8", {"surface": "bucket", "budget": 8, "noise": 0.02, "seed": 1},
             slow_factor=slow),
        Case("valley in two knobs, budget 24", {"surface": "fusion", "budget": 24, "noise": 0.03, "seed": 2},
             slow_factor=slow),
        Case("a cliff, budget 20", {"surface": "cliff", "budget": 20, "noise": 0.02, "seed": 3}, slow_factor=slow),
        Case("three knobs, best at an edge, budget 30", {"surface": "corner", "budget": 30, "noise": 0.03, "seed": 4},
             hidden=True, slow_factor=slow),
    ]


class Measure:
    """measure(config) -> seconds: the surface's cost times deterministic noise; counts its calls."""

    def __init__(self, surface: str, budget: int, noise: float, seed: int):
        self.surface = surface
        self.space, self.cost = _surface(surface)
        self.budget, self.noise, self.seed = budget, noise, seed
        self.calls = 0
        self.seen: dict[tuple, int] = {}
        self.exhausted = False
        self.invalid: str | None = None

    def index(self, config) -> tuple | None:
        if not isinstance(config, dict) or set(config) != set(self.space):
            return None
        try:
            return tuple(self.space[k].index(config[k]) for k in self.space)
        except ValueError:
            return None

    def __call__(self, config) -> float:
        if self.calls >= self.budget:
            self.exhausted = True
            raise BudgetExhausted(f"measure() was called more than budget={self.budget} times")
        idx = self.index(config)
        if idx is None:
            self.invalid = repr(config)
            raise ValueError(f"measure() got {config!r}: a config is a dict with one value from the space per knob, "
                             f"knobs {list(self.space)}")
        self.calls += 1
        repeat = self.seen.get(idx, 0)
        self.seen[idx] = repeat + 1
        digest = hashlib.sha256(f"{self.seed}:{idx}:{repeat}".encode()).digest()
        u = int.from_bytes(digest[:8], "big") / 2 ** 64  # in [0, 1)
        return self.cost(*idx) * 1e-3 * (1 + self.noise * (2 * u - 1))


def truth(surface: str) -> dict:
    space, cost = _surface(surface)
    costs = {idx: cost(*idx) for idx in itertools.product(*(range(len(v)) for v in space.values()))}
    return {"space": space, "best": min(costs.values()), "costs": {",".join(map(str, k)): v for k, v in costs.items()}}


def inputs(case, rank, size):
    p = case.params
    return (Measure(p["surface"], p["budget"], p["noise"], p["seed"]),)


def call(fn, comm, args):
    (measure,) = args
    space = {k: list(v) for k, v in measure.space.items()}  # a copy: the learner may edit theirs
    try:
        config = fn(measure, space, measure.budget)
    except BudgetExhausted:
        config = None
    return {"config": config, "calls": measure.calls, "exhausted": measure.exhausted, "invalid": measure.invalid,
            "index": measure.index(config) if config is not None else None}


def reference(comm, measure):
    return {"best": truth(measure.surface)["best"]}


def verify(case, ctx):
    got, p = ctx.got, case.params
    budget = p["budget"]
    if got["exhausted"]:
        return Wrong(f"the tuner asked for more than budget={budget} measurements",
                     hint="the space has more configs than the budget allows: search, don't enumerate "
                          "(e.g. one knob at a time, keeping the best of each).")
    if got["invalid"]:
        return Wrong(f"measure() was called with {got['invalid']}, not a config of the space")
    if got["config"] is None or got["index"] is None:
        return Wrong(f"returned {got['config']!r}; expected a dict with one value from the space for each knob")
    space, cost = _surface(p["surface"])
    mine, best = cost(*got["index"]), ctx.expected["best"]
    if mine > TOLERANCE * best:
        return Wrong(f"returned {got['config']}, whose true cost is {mine / best:.2f}× the best in the space "
                     f"(accepted: within {TOLERANCE:.2f}×); it used {got['calls']} of {budget} measurements",
                     max_error=mine / best - 1)
    return None


def diagnose(case, ctx):
    got = ctx.got
    if got["exhausted"] or got["index"] is None:
        return None
    if got["calls"] <= 2:
        return "it measured almost nothing: spend the budget on the configs most likely to be fast."
    space, _ = _surface(case.params["surface"])
    if len(space) > 1 and got["index"][1:] == tuple(len(v) // 2 for v in list(space.values())[1:]):
        return "only the first knob seems tuned: the others matter too — sweep each knob in turn."
    first = list(space.values())[0]
    if got["index"][0] <= 2 and len(first) > 5:
        return ("the configs measured look like the start of an exhaustive grid, cut off by the budget: "
                "cover every knob's range instead.")
    return ("noise is ±a few %: a config that looked best once may not be; measure the leaders again, "
            "or search around the best so far.")
