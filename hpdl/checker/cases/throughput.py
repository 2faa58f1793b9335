"""Checks for lesson 01's exercise: a throughput meter.

    def throughput(step, batches, warmup=1) -> float:
        # call step(batch) on every batch; return samples per second over the batches after
        # the first `warmup` ones (samples = len(batch[0]); the last batch may be smaller)

The step here is a stand-in whose cost is known: it sleeps a fixed time per sample, its first
calls are slow, as a real first step is (allocations, kernel selection, caches), and the timed
ones vary, as real steps do: most take half their share, one far more (`paces`), so the fastest
batch's rate, or the mean or median of the batches' rates, is not the run's. So the right answer
is known in advance (all the timed samples over their seconds, `true_rate`) to the checker,
never to the learner's process: each check scales the cases' time per sample by a factor drawn
from its nonce (0.4 to 10, so the listed values are not the answer), and the learner's step is
a proxy that asks a helper process (oracle.py) to sleep, the only one that knows how long. The
usual slips land far from it: timing the warm-up too, counting batches instead of samples,
assuming every batch is as large as the first, inverting the ratio, one fast batch for the
whole run. Sleeps can only overrun, so a busy machine reads a little low; the accepted band is
[0.5, 1.15] × the true rate. Which batches step() was called on is the helper's word too: it
notes each call's size and signs the list with a key drawn from the nonce (oracle.signed);
verify() reads that receipt, never a list the learner's process kept. The receipt also says how long
each step really took, from its request to the next one's (the receipt's, for the last), sealed with
that key (the learner's process hands it on and cannot read it: read, it was the answer): a busy
machine's sleeps overrun and its messages wait, the short steps' most, so the hint for a wrong meter
(which slip it looks like) is worked out from the steps as they ran, not as they were planned.

Like train_step, this takes no communicator: `call()` hands the learner's function its inputs.
"""
from __future__ import annotations

import numbers
import statistics
import time

from hpdl.checker import oracle
from hpdl.checker.cases import Case, Wrong

SIGNATURE = "throughput(step, batches, warmup=1) -> float   # samples per second after warm-up"
RANKS = (1,)
TIMEOUT = 20.0
ORACLE = True  # the step's cost lives in a helper process beside the learner's rank
LOW, HIGH = 0.5, 1.15


def cases(size):
    slow = 1e6  # the meter is as slow as the steps it times; that is not the learner's doing
    return [
        Case("equal batches, warmup=1", {"sizes": [32] * 6, "warmup": 1, "per_sample": 0.0005, "first": 0.3},
             slow_factor=slow),
        Case("warmup=3", {"sizes": [16] * 7, "warmup": 3, "per_sample": 0.001, "first": 0.15}, slow_factor=slow),
        Case("smaller batches after the first", {"sizes": [64, 8, 8, 8, 8, 5], "warmup": 1, "per_sample": 0.002,
                                                 "first": 0.3}, slow_factor=slow),
        Case("batches from a generator", {"sizes": [24] * 5, "warmup": 1, "per_sample": 0.0008, "first": 0.3,
                                          "generator": True}, slow_factor=slow),
        # the first timed step carries most samples: left out of the count (i > warmup for i >= warmup), 0.07×;
        # its warm-up as long as the timed steps (0.2 s, half of them: the warm-up timed too read 0.68×, passed)
        Case("a large first batch after warm-up", {"sizes": [16, 300, 8, 8, 8], "warmup": 1, "per_sample": 0.0005,
                                                   "first": 0.6}, slow_factor=slow),
        # the last carries most: its time left out of the clock (read at the top of each step), 8×; or every
        # batch counted as large as the last, 3.6×
        Case("a large last batch", {"sizes": [16, 16, 16, 16, 400], "warmup": 1, "per_sample": 0.0005,
                                    "first": 0.2}, slow_factor=slow),
        Case("warmup=2, uneven", {"sizes": [40, 40, 40, 40, 13], "warmup": 2, "per_sample": 0.0005, "first": 0.2},
             hidden=True, slow_factor=slow),
    ]


class SleepyStep:
    """step(batch): sleeps per_sample × len(batch[0]) × the call's pace; each warm-up call also sleeps `first` s."""

    def __init__(self, per_sample: float, first: float, warmup: int, paces: list[float] = ()):
        self.per_sample, self.first, self.warmup, self.paces = per_sample, first, warmup, list(paces)
        self.calls: list[int] = []

    def __call__(self, batch):
        n = len(batch[0])
        i = len(self.calls)
        extra = self.first if i < self.warmup else 0.0
        self.calls.append(n)
        time.sleep(extra + self.per_sample * n * pace(self.paces, i))


def paces(params: dict) -> list[float]:
    """How long each call takes against its share, in order: 1 for the warm-up calls; of the k timed ones the
    first (k + 1) / 2, the others 0.5 (their mean 1). Most steps fast and one slow: the fastest batch's rate, the
    mean and the median of the batches' rates all read about twice the run's (with one 0.3, one 1.7 and the
    others 1, the median was the run's: 5/5); and the slow one first, a clock started one step late, or the
    first timed step's samples left out, reads twice the run's too (it passed when that step was a fast one)."""
    warmup, timed = params["warmup"], len(params["sizes"]) - params["warmup"]
    if timed < 2:
        return [1.0] * len(params["sizes"])
    return [1.0] * warmup + [(timed + 1) / 2] + [0.5] * (timed - 1)


def pace(paces: list[float], i: int) -> float:
    return paces[i] if 0 <= i < len(paces) else 1.0


def timed_seconds(params: dict, stepped: list[int]) -> list[float]:
    """The seconds each timed call takes (after the first `warmup`), called on these batch sizes in order."""
    ps, pc, w = per_sample(params), paces(params), params["warmup"]
    return [ps * n * pace(pc, i) for i, n in enumerate(stepped)][w:]


def true_rate(params: dict, stepped: list[int]) -> float:
    """Samples per second over the timed calls, as the step was called (`stepped`: the batch sizes, in order)."""
    seconds = sum(timed_seconds(params, stepped))
    return sum(stepped[params["warmup"]:]) / seconds if seconds > 0 else 0.0


class RemoteStep:
    """The learner's step(batch): the helper process sleeps for it; this object knows no cost."""

    def __init__(self, case_name: str):
        self.case = case_name
        self.calls: list[int] = []

    def __call__(self, batch):
        n = len(batch[0])
        self.calls.append(n)
        oracle.ask({"case": self.case, "n": n})

    def receipt(self) -> dict:
        """The helper's signed list of the batch sizes it stepped; it steps nothing after."""
        return oracle.ask({"case": self.case, "receipt": True})


def per_sample(params: dict) -> float:
    """The case's seconds per sample; with the check's nonce (the checker's side), scaled by 0.4-10×, a factor
    drawn anew for every case (log-uniform): the range is 25×, the accepted band 2.3×, so a guess from the
    listed values lands in it for a case one time in four, for all five about one in a thousand; timing
    the steps always does."""
    if "nonce" not in params:
        return params["per_sample"]
    import random

    return params["per_sample"] * 0.4 * 25 ** random.Random(f"{params['nonce']}:{params['sizes']}").random()


def first(params: dict) -> float:
    """The extra seconds of each warm-up call, scaled as the time per sample is (per_sample): left at the listed
    value, the warm-up was a small part of a slow case, and a meter that timed it too (or started its clock one
    step early) landed in the band on a check's slowest cases (3/7, 2/7)."""
    return params["first"] * per_sample(params) / params["per_sample"]


def secrets(case, rank, size) -> dict:
    """What the helper beside the learner's rank knows (jobs.Runner.secrets)."""
    p = case.params
    return {"per_sample": per_sample(p), "first": first(p), "warmup": p["warmup"], "sizes": [], "asked": [],
            "paces": paces(p), "key": oracle.key("throughput", p, case.name), "case": case.name, "closed": False}


def serve(request: dict, known: dict) -> dict:
    """In the helper: sleep for one step of `n` samples of a case (its warm-up calls are slow), noting its
    size and when it was asked; or the signed lists of the sizes and the steps' seconds (the receipt), after
    which it steps no more."""
    s = known[str(request["case"])]
    now = time.perf_counter()
    if request.get("receipt"):
        s["closed"] = True
        seconds = [b - a for a, b in zip(s["asked"], s["asked"][1:] + [now])]  # each step, as the learner saw it
        return oracle.signed({"case": s["case"], "sizes": s["sizes"], "seconds": oracle.sealed(seconds, s["key"])},
                             s["key"])
    n = int(request["n"])
    if not 0 <= n <= 1 << 20:
        raise ValueError(f"a batch of {n} samples")
    if s["closed"] or len(s["sizes"]) >= 1 << 12:
        raise ValueError("no more steps in this case")
    i = len(s["sizes"])
    extra = s["first"] if i < s["warmup"] else 0.0
    s["sizes"].append(n)
    s["asked"].append(now)
    time.sleep(extra + s["per_sample"] * n * pace(s["paces"], i))
    return {}


def _batches(sizes):
    """(inputs, targets) as the lesson's batches and a DataLoader's are: tensors whose first dimension counts
    the samples, so len(), .shape[0] and .size(0) all do (Python lists failed a meter that read .shape[0]: 0/5)."""
    import torch

    # two values a sample: a meter counting batch[0].numel() reads twice the rate (with one it scored 5/5)
    return [(torch.zeros(n, 2), torch.zeros(n, dtype=torch.long)) for n in sizes]


def inputs(case, rank, size):
    """(step, batch sizes, warmup, as a generator?): `call()` turns the sizes into batches."""
    p = case.params
    if "nonce" not in p:  # the learner's side, or a check without a nonce (a stripped kit's public cases)
        step = RemoteStep(case.name) if oracle.running() else SleepyStep(p["per_sample"], p["first"], p["warmup"],
                                                                          paces(p))
    else:
        step = SleepyStep(per_sample(p), first(p), p["warmup"], paces(p))
    return step, p["sizes"], p["warmup"], p.get("generator", False)


def call(fn, comm, args):
    """How the checker calls the learner's meter (no `comm`), recording what `step` saw."""
    step, sizes, warmup, as_generator = args
    batches = _batches(sizes)
    rate = fn(step, (b for b in batches) if as_generator else batches, warmup)
    return {"rate": rate, "calls": step.calls, "receipt": step.receipt() if isinstance(step, RemoteStep) else None}


def reference(comm, step, sizes, warmup, as_generator):
    # No need to time anything: the step's cost is set, so the right rate is known (true_rate, in verify)
    return {"rate": None, "calls": list(sizes)}


def _receipt(case, got) -> dict | None:
    """The helper's signed receipt's body, where the check has a nonce (the checker's side of a real check) or
    the learner's step had a helper; None: missing or altered."""
    secret = oracle.key("throughput", case.params, case.name) if "nonce" in case.params else None
    body = oracle.receipt_body(got.get("receipt"), secret)
    ok = body is not None and body.get("case") == case.name and isinstance(body.get("sizes"), list)
    return body if ok else None


def _stepped(case, got) -> list | None:
    """The sizes of the batches step() was called on: the helper's signed word where the check has a nonce (the
    checker's side of a real check); else, in a check without one, the list the step kept. None: altered."""
    if "nonce" not in case.params and got.get("receipt") is None:
        return got.get("calls")
    body = _receipt(case, got)
    return body["sizes"] if body is not None else None


def step_seconds(case, got, planned: list[float]) -> list[float]:
    """How long each step took, as the helper measured it (its receipt); as planned where it has no word on it."""
    body = _receipt(case, got)  # sealed: the learner's process can read the body, and these are the answer
    ran = oracle.unsealed(body.get("seconds"), oracle.key("throughput", case.params, case.name)) if body else None
    if not isinstance(ran, list) or len(ran) != len(planned) \
            or not all(isinstance(t, numbers.Real) and t > 0 for t in ran):
        return planned
    return [float(t) for t in ran]


def verify(case, ctx):
    got, expected = ctx.got, ctx.expected
    rate, truth = got["rate"], true_rate(case.params, expected["calls"])
    calls = _stepped(case, got)
    if calls is None:
        return Wrong("the checker's record of the steps taken is missing or altered: call step(batch) on each "
                     "batch and return the rate; leave the step object and the checker's helper alone", forged=True)
    if calls != expected["calls"]:
        return Wrong(f"step was called on batches of sizes {calls}; expected each batch once, in order: "
                     f"{expected['calls']}",
                     hint="call step(batch) on every batch, the warm-up ones included (they are run, just not timed).")
    if rate is None or isinstance(rate, bool) or not isinstance(rate, numbers.Real):
        return Wrong(f"returned {type(rate).__name__}; expected a number (samples per second)")
    if not LOW * truth <= rate <= HIGH * truth:
        return Wrong(f"measured {rate:.4g} samples/s; the step runs at {truth:.4g} samples/s",
                     max_error=abs(rate - truth) / truth)
    return None


def diagnose(case, ctx):
    p = case.params
    sizes, w, rate = p["sizes"], p["warmup"], ctx.got["rate"]
    if not isinstance(rate, numbers.Real) or rate <= 0:
        return None
    cost, pc = per_sample(p), paces(p)
    planned = [cost * n * pace(pc, i) + (first(p) if i < w else 0.0) for i, n in enumerate(sizes)]
    ran = step_seconds(case, ctx.got, planned)  # each step as it ran: a busy machine's sleeps overrun
    seconds, warm = ran[w:], sum(ran[:w])
    truth = sum(sizes[w:]) / sum(seconds)
    if rate * truth < 1.0 or rate < 1e-2 * truth:
        return "that looks like seconds per sample: return samples / seconds."
    guesses = {
        "the warm-up batches were timed too: start the clock after the first `warmup` steps.":
            sum(sizes) / (warm + sum(seconds)),
        "the warm-up batches' samples were counted: count only the timed batches.":
            sum(sizes) / sum(seconds),
        "that is batches per second: count samples, len(batch[0]) for each batch.":
            (len(sizes) - w) / sum(seconds),
        "every batch was counted as large as the first: count len(batch[0]) of each batch.":
            sizes[0] * (len(sizes) - w) / sum(seconds),
        "that is one batch's rate (the fastest, or the median of the batches' rates): steps vary, so the run's "
        "throughput is all the timed samples over all the timed seconds, slow steps included.":
            statistics.median(n / t for n, t in zip(sizes[w:], seconds)),
        "that is the mean of the batches' rates, which fast batches pull up: divide all the timed samples by "
        "all the timed seconds.": sum(n / t for n, t in zip(sizes[w:], seconds)) / len(seconds),
    }
    best = min(guesses, key=lambda k: abs(guesses[k] / rate - 1))
    if abs(guesses[best] / rate - 1) < 0.25 and abs(truth / rate - 1) > 0.15:
        return best
    return None

