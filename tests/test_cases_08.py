"""The check of lesson 08 on real ranks: the autotune solution passes at 3 and 4 ranks too (at its own
rank counts the solution notebook run in grade mode tests it), and each known-bad tuner is rejected:
one that exhausts its budget, stops short, searches one knob only, or answers outside the space.

The solution is taken from solutions/08_framework_tuning.ipynb as written there.
"""
from __future__ import annotations

import itertools

import pytest

import hpdl
from conftest import hints, passed, rejected, solution_function

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
NOTEBOOK = "08_framework_tuning.ipynb"


# -- autotune -------------------------------------------------------------------------------------

def tune_exhaustive(measure, space, budget):
    configs = [dict(zip(space, v)) for v in itertools.product(*space.values())]
    return min(configs, key=measure)


def tune_truncated_grid(measure, space, budget):
    configs = [dict(zip(space, v)) for v in itertools.product(*space.values())][:budget]
    return min(configs, key=measure)


def tune_first_knob_only(measure, space, budget):
    knobs = list(space)
    middle = {k: v[len(v) // 2] for k, v in space.items()}
    return min(({**middle, knobs[0]: v} for v in space[knobs[0]]), key=measure)


def tune_no_search(measure, space, budget):
    return {k: v[0] for k, v in space.items()}


def tune_out_of_space(measure, space, budget):
    return {k: max(v) * 2 for k, v in space.items()}


def test_autotune_solution_passes_beyond_its_rank_counts(no_strays):
    result = hpdl.check("autotune", solution_function(NOTEBOOK, "autotune"), ranks=[3, 4], grade=True)
    assert passed(result), hints(result)


@pytest.mark.parametrize("bad, words", [
    (tune_exhaustive, ["more than budget", "don't enumerate"]),
    (tune_truncated_grid, ["the best in the space"]),
    (tune_first_knob_only, ["the best in the space", "first knob"]),
    (tune_no_search, ["the best in the space"]),
    (tune_out_of_space, ["expected a dict with one value from the space"]),
])
def test_autotune_rejects(bad, words, no_strays):
    rejected(hpdl.check("autotune", bad, ranks=[1]), *words)


def test_a_receipt_not_signed_by_the_helper_is_wrong_not_a_crash():
    """verify() on what came back from the learner's process (no MPI needed): a receipt that is not
    JSON (a stripped kit checks no signature), or one signed with another check's key, is WRONG with
    a message, never an exception of the checker's."""
    import hmac
    import json
    from types import SimpleNamespace

    from hpdl.checker import oracle
    from hpdl.checker.cases import Wrong, autotune, with_nonce

    case = autotune.cases(1)[0]
    best = {k: v[7] for k, v in autotune.SPACES[case.params["surface"]].items()}
    body = json.dumps({"case": case.name, "calls": 3, "refused": 0}, sort_keys=True)
    forged = [{"body": "not json", "mac": ""}, {"body": "[1, 2]", "mac": ""},
              {"body": json.dumps({"case": case.name, "calls": "3", "refused": None}), "mac": ""}]
    for receipt in forged:
        got = SimpleNamespace(got={"config": best, "invalid": None, "receipt": receipt})
        assert isinstance(autotune.verify(case, got), Wrong)
    keyed = with_nonce(case, 42)
    other = hmac.new(oracle.key("autotune", {"nonce": 41}, case.name).encode(), body.encode(), "sha256").hexdigest()
    mine = hmac.new(oracle.key("autotune", keyed.params, case.name).encode(), body.encode(), "sha256").hexdigest()
    got = lambda mac: SimpleNamespace(got={"config": best, "invalid": None, "receipt": {"body": body, "mac": mac}})  # noqa: E731
    assert isinstance(autotune.verify(keyed, got(other)), Wrong)
    assert autotune.verify(keyed, got(mine)) is None  # the helper's own signature: the config is judged


def test_noise_alone_never_fails_a_tuner_that_measured_the_best():
    """No MPI: every config whose true cost is past the tolerance reads slower, at its luckiest, than the
    best config at its unluckiest. Otherwise a tuner that measured everything once and kept the fastest
    reading could be failed by the noise, and the solution was, one check in several hundred."""
    from hpdl.checker.cases import autotune

    for case in autotune.cases(1):
        costs, noise = autotune._costs(case.params["surface"]).values(), case.params["noise"]
        best = min(costs)
        for cost in costs:
            if cost > autotune.TOLERANCE * best:
                assert cost * (1 - noise) > best * (1 + noise), (case.name, cost / best)


def test_the_solution_passes_whatever_the_nonce():
    """No MPI: the solution against the helper's own serve(), under 300 nonces per case (the check draws
    a new one each time, and with it the noise): it is never more than the tolerance off."""
    from hpdl.checker.cases import autotune, with_nonce

    solve = solution_function(NOTEBOOK, "autotune")
    for case in autotune.cases(1):
        space = autotune.SPACES[case.params["surface"]]
        costs = autotune._costs(case.params["surface"])
        for nonce in range(300):
            keyed = with_nonce(case, nonce)
            known = {case.name: autotune.secrets(keyed, 0, 1)}

            def measure(config):
                idx = autotune.index_of(space, config)
                return autotune.serve({"case": case.name, "index": list(idx)}, known)["seconds"]

            idx = autotune.index_of(space, solve(measure, {k: list(v) for k, v in space.items()},
                                                 case.params["budget"]))
            assert idx is not None and known[case.name]["refused"] == 0
            got = costs[",".join(map(str, idx))]
            assert got <= autotune.TOLERANCE * min(costs.values()), (case.name, nonce, got / min(costs.values()))
