"""Checks for lesson 08's exercise: a small autotuner with a measurement budget.

    def autotune(measure, space, budget) -> dict
        # space: {"knob": [value, ...], ...}; measure(config) -> seconds (noisy);
        # return a config (one value per knob) close to the fastest, calling measure ≤ budget times

The checker hands the learner cost surfaces they have not seen, shaped like real tuning knobs
(a U-curve in a bucket size, a fusion threshold × cycle time valley with a tilt, a cliff) and
deterministic noise: measuring the same config again gives another, reproducible reading, as
a real measurement would. A config passes when its true (noise-free) cost is within 5% of the
best in the space. Where the check has a nonce (graded, and the full kit's own checks) each surface
slides (or the cliff's slope folds) along its knobs by an amount drawn from it, so the best config differs
from check to check while the shape stays (MOVES); a stripped kit's public cases keep the surfaces still.
The noise is ±2%, under half the tolerance: a config whose one reading beat the
best config's reading is within (1.02/0.98 =) 1.041× of it, so a tuner that measured the best once
is never failed by noise alone (at ±3% it was, about 1 check in 700). Every call beyond the budget
is refused (the case is WRONG: the tuner exhausted its budget); an exhaustive search never fits
(the spaces are 2-4× the budget). A config outside the space, or a missing knob, is WRONG too.

The learner's `measure` knows the space and the budget, nothing else: the cost table lives in a
helper process beside the rank (ORACLE, oracle.py), which measures, counts and refuses calls past
the budget, and signs its count with a key drawn from the check's nonce; verify() reads that
receipt, never a count the learner's process kept.
"""
from __future__ import annotations

import itertools

from hpdl.checker import oracle
from hpdl.checker.cases import Case, Wrong

SIGNATURE = "autotune(measure, space: dict[str, list], budget: int) -> dict   # a config within 5% of the best"
RANKS = (1,)  # a tuner decides on one rank (Horovod's on rank 0); at more, each rank's helper grants a budget of
#              its own, which ranks that share their readings over MPI would pool
TIMEOUT = 20.0
TOLERANCE = 1.05
QUOTE = 80  # characters of a learner's object a WRONG message quotes at most
ORACLE = True  # the cost table lives in a helper process beside the learner's rank (oracle.py)


class BudgetExhausted(RuntimeError):
    """Raised by measure() on the call after the last one the budget allows."""


# The knobs of each surface: public (the learner's function gets the space).
SPACES = {
    "bucket": {"bucket_cap_mb": [0.25, 0.5, 1, 2, 4, 8, 16, 25, 32, 64, 128, 256]},
    "fusion": {"fusion_mb": [0, 1, 2, 4, 8, 16, 32, 64, 128], "cycle_ms": [0.5, 1, 2, 3.5, 5, 10, 20]},
    "cliff": {"buffsize_kb": [64, 128, 256, 512, 1024, 2048, 4096, 8192], "channels": [1, 2, 4, 8, 16, 32]},
    "corner": {"threads": [1, 2, 3, 4, 6, 8], "ranks_per_node": [1, 2, 4, 8, 16], "chunk_kb": [16, 64, 256, 1024]},
}


def _slides(centre: float, bests, fractions=(-0.2, -0.1, 0.0, 0.1, 0.2)) -> tuple:
    """The moves that put a knob's minimum (the formula's `centre`) at index b + f for each b and f: a best
    that close to a value leaves its neighbours past the tolerance, one config within it (the fraction as
    the formulas' own centres have one; the valley's tilted neighbour is 1.2 off, so its knobs get none)."""
    return tuple((round(centre - b - f, 6), None) for b in bests for f in fractions)


#: With a nonce, each knob's move (offset, fold), drawn from the nonce: index i is the formula's x = i + offset,
#: folded back past `fold` (x = 2·fold − x). The best differs from check to check, the shape stays: the
#: U-curve's and valley's minimum lands anywhere known-bad tuners would not find it (the middle cycle_ms and
#: channels, which a sweep of the first knob keeps; the fusion_mb a truncated grid reaches), the cliff's slope
#: tops out at buffsize index 5, 6 or 7 (a truncated grid stops at 3) and the corner's best stays at the far
#: edge. Bucket: 1 fixed answer in 10 is right by chance, fusion 1 in 30, cliff 1 in 15, corner 1 in 20.
MOVES = {
    "bucket": (_slides(7.3, range(1, 11)),),
    "fusion": (_slides(5.6, range(4, 9), (0.0,)), _slides(1.2, (0, 1, 2, 4, 5, 6), (0.0,))),
    "cliff": (tuple((0.0, b) for b in (5, 6, 7)), _slides(3.8, (0, 1, 2, 4, 5))),
    "corner": (((0.0, None),), _slides(2.2, range(5)), _slides(1.6, range(4))),
}


def _cost(kind: str, moves: tuple = ()):
    """The noise-free cost of the indices (i, j, ...) into a surface's knobs: the checker's side only.
    `moves`: each knob's (offset, fold) (MOVES); none without a nonce."""
    formula = _formula(kind)

    def x(i, move):
        offset, fold = move
        return i + offset if fold is None or i + offset <= fold else 2 * fold - i - offset

    moves = tuple(moves) or ((0.0, None),) * len(SPACES[kind])
    return lambda *idx: formula(*(x(i, m) for i, m in zip(idx, moves)))


def _formula(kind: str):
    if kind == "bucket":  # DDP's bucket_cap_mb: a U-curve, minimum off-centre
        return lambda i: 10.0 + 0.9 * (i - 7.3) ** 2
    if kind == "fusion":  # Horovod fusion threshold × cycle time: a tilted valley
        return lambda i, j: 20 + 1.2 * (i - 5.6) ** 2 + 2.0 * (j - 1.2) ** 2 + 0.8 * (i - 5.6) * (j - 1.2)
    if kind == "cliff":  # too small a buffer falls off a cliff; otherwise a gentle slope
        return lambda i, j: (60.0 if i < 2 else 10.0 + 0.6 * (7 - i)) + 1.5 * (j - 3.8) ** 2
    if kind == "corner":  # the best setting sits at the far end of the first knob
        return lambda i, j, k: 8.0 + 3.0 * (5 - i) + 1.4 * (j - 2.2) ** 2 + 0.7 * (k - 1.6) ** 2
    raise ValueError(kind)


def _moves(params: dict) -> tuple:
    """Each knob's move, drawn from the check's nonce (MOVES); none where there is no nonce (a stripped
    kit's public cases, which the learner's own inline check runs: nothing is at stake there)."""
    import hashlib

    if params.get("nonce") is None:
        return ()
    drawn = []
    for d, choices in enumerate(MOVES[params["surface"]]):
        text = f"autotune:{params['surface']}:{params['seed']}:{params['nonce']}:{d}".encode()
        drawn.append(choices[int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "big") % len(choices)])
    return tuple(drawn)


def _costs(kind: str, moves: tuple = ()) -> dict[str, float]:
    """Every config's cost, keyed "i,j,...": the table the helper serves, never the formulas."""
    cost = _cost(kind, moves)
    return {",".join(map(str, idx)): cost(*idx)
            for idx in itertools.product(*(range(len(v)) for v in SPACES[kind].values()))}


def cases(size):
    slow = 1e6
    return [
        Case("U-curve in one knob, budget 8", {"surface": "bucket", "budget": 8, "noise": 0.02, "seed": 1},
             slow_factor=slow),
        Case("valley in two knobs, budget 24", {"surface": "fusion", "budget": 24, "noise": 0.02, "seed": 2},
             slow_factor=slow),
        Case("a cliff, budget 20", {"surface": "cliff", "budget": 20, "noise": 0.02, "seed": 3}, slow_factor=slow),
        Case("three knobs, best at an edge, budget 30", {"surface": "corner", "budget": 30, "noise": 0.02, "seed": 4},
             hidden=True, slow_factor=slow),
    ]


def index_of(space: dict, config) -> tuple | None:
    """The config's indices into the space's knobs, or None when it is not a config of the space."""
    if not isinstance(config, dict) or set(config) != set(space):
        return None
    try:
        return tuple(space[k].index(config[k]) for k in space)
    except (ValueError, TypeError):
        return None


class RemoteMeasure:
    """measure(config) -> seconds: the helper process measures; this object knows the space and the
    budget, never a cost. A call beyond the budget raises BudgetExhausted (the helper refuses it)."""

    def __init__(self, case_name: str, surface: str, budget: int):
        self.case, self.surface, self.budget = case_name, surface, budget
        self.space = SPACES[surface]
        self.invalid: str | None = None

    def __call__(self, config) -> float:
        idx = index_of(self.space, config)
        if idx is None:
            self.invalid = repr(config)
            raise ValueError(f"measure() got {config!r}: a config is a dict with one value from the space per knob, "
                             f"knobs {list(self.space)}")
        answer = oracle.ask({"case": self.case, "index": list(idx)})
        if "refused" in answer:
            raise BudgetExhausted(f"measure() was called more than budget={self.budget} times")
        return answer["seconds"]

    def receipt(self) -> dict:
        """The helper's signed count of measurements made and refused; it measures nothing after."""
        return oracle.ask({"case": self.case, "receipt": True})


def secrets(case, rank, size) -> dict:
    """What the helper beside the learner's rank knows (jobs.Runner.secrets): the case's cost table,
    noise seeded with the check's nonce, and a key to sign its count of measurements."""
    p = case.params
    return {"costs": _costs(p["surface"], _moves(p)), "shape": [len(v) for v in SPACES[p["surface"]].values()],
            "budget": p["budget"], "noise": p["noise"], "seed": f"{p['seed']}:{p.get('nonce')}",
            "key": oracle.key("autotune", p, case.name), "case": case.name, "calls": 0, "refused": 0, "seen": {},
            "closed": False}


def serve(request: dict, known: dict) -> dict:
    """In the helper: one noisy measurement of a config within the budget, or the signed receipt."""
    import hashlib

    s = known[str(request["case"])]
    if request.get("receipt"):
        s["closed"] = True
        return oracle.signed({"case": s["case"], "calls": s["calls"], "refused": s["refused"]}, s["key"])
    idx = request.get("index")
    if not (isinstance(idx, list) and len(idx) == len(s["shape"])
            and all(type(i) is int and 0 <= i < n for i, n in zip(idx, s["shape"]))):
        raise ValueError("not a config of the space")
    if s["closed"] or s["calls"] >= s["budget"]:
        s["refused"] += 1
        return {"refused": "budget"}
    s["calls"] += 1
    key = ",".join(map(str, idx))
    repeat = s["seen"].get(key, 0)
    s["seen"][key] = repeat + 1
    digest = hashlib.sha256(f"{s['seed']}:{key}:{repeat}".encode()).digest()
    u = int.from_bytes(digest[:8], "big") / 2 ** 64  # in [0, 1): a reading is reproducible, not predictable
    return {"seconds": s["costs"][key] * 1e-3 * (1 + s["noise"] * (2 * u - 1))}


def inputs(case, rank, size):
    p = case.params
    return (RemoteMeasure(case.name, p["surface"], p["budget"]),)


def call(fn, comm, args):
    (measure,) = args
    space = {k: list(v) for k, v in measure.space.items()}  # a copy: the learner may edit theirs
    try:
        config = fn(measure, space, measure.budget)
    except BudgetExhausted:
        config = None
    return {"config": config, "invalid": measure.invalid, "receipt": measure.receipt()}


def reference(comm, measure):
    return {}  # verify() judges the returned config by its true cost, from the table


def _receipt(case, got) -> dict | None:
    """The helper's count of measurements, if its signature holds (checked when the check has a nonce)."""
    secret = oracle.key("autotune", case.params, case.name) if "nonce" in case.params else None
    body = oracle.receipt_body(got.get("receipt") if isinstance(got, dict) else None, secret)
    ok = body is not None and body.get("case") == case.name and all(
        isinstance(body.get(k), int) for k in ("calls", "refused"))
    return body if ok else None


def _quoted(obj, text: bool = False) -> str:
    """What a message quotes of an object from the learner's process: its type and the start of its repr
    (`text`: a string, e.g. the repr the measure took, as it is), never the whole of it: a run could carry
    the readings it took out of the check in what it returns."""
    shown = obj if text and isinstance(obj, str) else repr(obj)
    shown = shown if len(shown) <= QUOTE else shown[:QUOTE] + "…"
    return shown if text and isinstance(obj, str) else f"{type(obj).__name__} {shown}"


def verify(case, ctx):
    got, p = ctx.got, case.params
    budget = p["budget"]
    receipt = _receipt(case, got)
    if receipt is None:
        return Wrong("the checker's record of the measurements made is missing or altered: call measure() "
                     "and return a config; leave the measure object and the checker's helper alone")
    if receipt["refused"]:
        return Wrong(f"the tuner asked for more than budget={budget} measurements",
                     hint="the space has more configs than the budget allows: search, don't enumerate "
                          "(e.g. one knob at a time, keeping the best of each).")
    if got.get("invalid"):
        return Wrong(f"measure() was called with {_quoted(got['invalid'], text=True)}, not a config of the space")
    space = SPACES[p["surface"]]
    idx = index_of(space, got.get("config"))
    if idx is None:
        return Wrong(f"returned {_quoted(got.get('config'))}; expected a dict with one value from the space for "
                     "each knob")
    costs = _costs(p["surface"], _moves(p))
    mine, best = costs[",".join(map(str, idx))], min(costs.values())
    if mine > TOLERANCE * best:
        config = {k: values[i] for (k, values), i in zip(space.items(), idx)}  # the space's values, not the object
        return Wrong(f"returned {config}, whose true cost is {mine / best:.2f}× the best in the space "
                     f"(accepted: within {TOLERANCE:.2f}×); it used {receipt['calls']} of {budget} measurements",
                     max_error=mine / best - 1)
    return None


def diagnose(case, ctx):
    got = ctx.got
    receipt = _receipt(case, got)
    space = SPACES[case.params["surface"]]
    idx = index_of(space, got.get("config"))
    if receipt is None or receipt["refused"] or idx is None:
        return None
    if receipt["calls"] <= 2:
        return "it measured almost nothing: spend the budget on the configs most likely to be fast."
    if len(space) > 1 and idx[1:] == tuple(len(v) // 2 for v in list(space.values())[1:]):
        return "only the first knob seems tuned: the others matter too — sweep each knob in turn."
    # the config's place in the grid's order (itertools.product's): where the best moves with the nonce, this
    # tells what a grid cut off by the budget returns, which the config's first knob alone does not
    rank = 0
    for i, values in zip(idx, space.values()):
        rank = rank * len(values) + i
    if receipt["calls"] >= case.params["budget"] and rank < receipt["calls"]:
        return ("the configs measured look like the start of an exhaustive grid, cut off by the budget: "
                "cover every knob's range instead.")
    return ("noise is ±a few %: a config that looked best once may not be; measure the leaders again, "
            "or search around the best so far.")
