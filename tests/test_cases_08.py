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
