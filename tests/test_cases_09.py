"""The checks of lesson 09 on real ranks: each known-bad implementation is rejected with a hint
naming the slip — a bandwidth term without 2(p−1)/p, overlap taken off the compute, the latency
paid once for all buckets; LARS without the trust ratio, with one ratio for the whole model, or
dividing by a zero norm. That the solutions of solutions/09_scaling_studies.ipynb earn full marks
at 1–4 ranks (hidden cases included) is tested by running it in grade mode (test_notebooks.py).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import hpdl
from conftest import rejected

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
ROOT = Path(__file__).resolve().parents[1]


# -- exercise 1: predict_step_time ---------------------------------------------------------------

def _ring(n, p, a, b, g):
    return 2 * (p - 1) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g


def step_no_bus_factor(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1):
    if p <= 1:
        return compute
    n = nbytes / buckets
    t = buckets * (2 * (p - 1) * alpha + n * beta + (p - 1) / p * n * gamma)   # nβ: no 2(p−1)/p
    return compute + max(t - overlap * compute, t / buckets)


def step_overlap_on_compute(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1):
    if p <= 1:
        return compute
    t = buckets * _ring(nbytes / buckets, p, alpha, beta, gamma)
    return (1 - overlap) * compute + t                                           # shrinks the compute


def step_latency_once(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1):
    if p <= 1:
        return compute
    t = _ring(nbytes, p, alpha, beta, gamma)                                     # buckets cost nothing
    return compute + max(t - overlap * compute, t / buckets)


def step_no_last_bucket(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1):
    if p <= 1:
        return compute
    t = buckets * _ring(nbytes / buckets, p, alpha, beta, gamma)
    return compute + max(0.0, t - overlap * compute)                            # all of it can hide


def test_predict_step_time_calling_the_kits_predictor_is_refused():
    def predict_step_time(*args, **kwargs):  # the kit's own answer: refused inside a check (hooks.KIT_ANSWERS)
        from hpdl.predict import predict_step_time

        return predict_step_time(*args, **kwargs)

    result = hpdl.check("predict_step_time", predict_step_time, ranks=[2])
    assert result.score == 0 and all(c.rejected == "hpdl.predict.predict_step_time" for c in result.cases), result


def test_the_kits_predictor_rebuilt_from_its_code_object_is_refused():
    """The kit's predict_step_time and allreduce_seconds made anew from their code objects in the notebook (their
    __module__ the learner's): pickled by value, they passed as the learner's own code (24/24)."""
    import math
    import types

    import hpdl.predict as kit

    def clone(f, namespace):
        g = types.FunctionType(f.__code__, namespace, f.__name__, f.__defaults__)
        g.__module__ = __name__
        return g

    ring = clone(kit.allreduce_seconds, {"math": math, "ALGORITHMS": kit.ALGORITHMS})
    step = clone(kit.predict_step_time, {"allreduce_seconds": ring, "max": max, "int": int})

    def predict_step_time(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1):
        return step(compute, nbytes, alpha, beta, gamma, p, overlap, buckets)

    result = hpdl.check("predict_step_time", predict_step_time, ranks=[2], grade=True)
    assert result.score == 0 and all("carries the kit's own code (hpdl/predict.py" in c.message
                                     for c in result.cases), result


def test_a_table_of_the_public_answers_fits_no_graded_grid():
    """A stripped kit publishes its public cases' answers (*.expected), drawn without a nonce: a table of
    them, looked up by the arguments, with no model of a step, scored 20/24 graded. Graded grids are drawn
    with the check's nonce; what the table still fits is the fixed points (one rank, the published runs)."""
    from hpdl.checker.cases import predict_step_time as case
    from hpdl.predict import predict_step_time as kit

    table = {}
    for c in case.cases(2):
        for pt in case.inputs(c, 0, 1)[0]:  # every point, as a stripped kit's learner draws it (no nonce)
            args = case._args(pt)
            table[tuple(args.values())] = kit(**args)

    def predict_step_time(compute, nbytes, alpha, beta, gamma, p, overlap=0.0, buckets=1, _table=table):
        return _table.get((compute, nbytes, alpha, beta, gamma, p, overlap, buckets), 0.0)

    result = hpdl.check("predict_step_time", predict_step_time, ranks=[2], grade=True)
    passed = {c.name for c in result.cases if c.verdict.earns_points}
    assert passed == {"one rank: no communication", "published: Horovod, 128 and 512 Pascal GPUs"}, result


@pytest.mark.parametrize("bad, words", [
    (step_no_bus_factor, ["2(p−1)/p"]),
    (step_overlap_on_compute, ["does not shrink the compute"]),
    (step_latency_once, ["pays the latency"]),
    (step_no_last_bucket, ["last bucket"]),
])
def test_predict_step_time_known_bad_rejected(bad, words):
    rejected(hpdl.check("predict_step_time", bad, ranks=[3]), *words)


# -- exercise 2: lars_step ----------------------------------------------------------------------

def lars_without_trust_ratio(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    return [w - lr * (g + weight_decay * w) for w, g in zip(params, grads)]


def lars_dividing_by_zero(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    out = []
    for w, g in zip(params, grads):
        ratio = trust_coef * w.norm() / (g.norm() + weight_decay * w.norm())      # 0/0 and x/0 unguarded
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def lars_zero_layer_stuck(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    out = []
    for w, g in zip(params, grads):
        denominator = g.norm() + weight_decay * w.norm()
        ratio = trust_coef * w.norm() / denominator if denominator > 0 else 1.0     # ‖w‖ = 0: ratio 0
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def lars_guarding_the_denominator(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    out = []
    for w, g in zip(params, grads):
        denominator = g.norm() + weight_decay * w.norm()
        ratio = trust_coef * w.norm() / denominator if w.norm() > 0 and denominator > 0 else 1.0  # ‖g‖ = 0: wd
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def lars_one_ratio(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    w_all = torch.sqrt(sum(w.norm() ** 2 for w in params))
    g_all = torch.sqrt(sum(g.norm() ** 2 for g in grads))
    ratio = trust_coef * w_all / (g_all + weight_decay * w_all)
    return [w - lr * ratio * (g + weight_decay * w) for w, g in zip(params, grads)]


def lars_without_weight_decay(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    return [w - lr * (trust_coef * w.norm() / g.norm() if w.norm() > 0 and g.norm() > 0 else 1.0) * g
            for w, g in zip(params, grads)]


def lars_decay_inside_the_norm(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    out = []
    for w, g in zip(params, grads):
        d = g + weight_decay * w
        ratio = trust_coef * w.norm() / d.norm() if w.norm() > 0 and g.norm() > 0 else 1.0  # ‖g + wd·w‖
        out.append(w - lr * ratio * d)
    return out


def lars_ratio_through_float32(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    """The ratio made a tensor from a Python float: float32, 1e-9 off on float64 layers."""
    out = []
    for w, g in zip(params, grads):
        wn, gn = w.norm().item(), g.norm().item()
        ratio = torch.tensor(trust_coef * wn / (gn + weight_decay * wn) if wn > 0 and gn > 0 else 1.0)
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def lars_with_an_eps(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    """The eps LARC implementations add to the denominator."""
    out = []
    for w, g in zip(params, grads):
        wn, gn = w.norm(), g.norm()
        ratio = trust_coef * wn / (gn + weight_decay * wn + 1e-9) if wn > 0 and gn > 0 else 1.0
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def lars_decay_decoupled(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    """Weight decay applied apart (AdamW's way), outside the trust ratio's scaling."""
    out = []
    for w, g in zip(params, grads):
        wn, gn = w.norm(), g.norm()
        ratio = trust_coef * wn / (gn + weight_decay * wn) if wn > 0 and gn > 0 else 1.0
        out.append(w - lr * ratio * g - lr * weight_decay * w)
    return out


def lars_decay_in_the_step_only(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    """Decay in the step, but the ratio's denominator is ‖g‖ alone."""
    out = []
    for w, g in zip(params, grads):
        wn, gn = w.norm(), g.norm()
        ratio = trust_coef * wn / gn if wn > 0 and gn > 0 else 1.0
        out.append(w - lr * ratio * (g + weight_decay * w))
    return out


def lars_ratio_clipped_at_one(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    """LARC's clipping: the ratio capped at 1."""
    out = []
    for w, g in zip(params, grads):
        wn, gn = w.norm(), g.norm()
        ratio = trust_coef * wn / (gn + weight_decay * wn) if wn > 0 and gn > 0 else 1.0
        out.append(w - lr * min(float(ratio), 1.0) * (g + weight_decay * w))
    return out


@pytest.mark.parametrize("bad, words, most", [
    (lars_decay_decoupled, ["decay is scaled by the ratio"], 3),  # the three cases without a decay
    (lars_ratio_clipped_at_one, ["capped at 1"], 2),  # the two whose every ratio is below 1
])
def test_lars_step_a_slip_passes_only_the_cases_it_cannot_change(bad, words, most):
    """A decay of 1e-4 in the cases with zeros hid a decay outside the ratio's scaling (24/32), and with a ratio
    above 1 in one case alone LARC's clipping passed 28/32. Those cases now have a decay of 0.05 and a layer whose
    ratio is above 1."""
    result = hpdl.check("lars_step", bad, ranks=[1], grade=True)
    assert result.score <= most and result.max_score == 8, result
    rejected(result, *words)


@pytest.mark.parametrize("fn", [lars_ratio_through_float32, lars_with_an_eps])
def test_lars_step_within_a_hair_of_the_formula_on_float64_layers_passes(fn):
    """Graded, the hidden float64 case held them to 200 ulp (24/28), quoting the same value as got and expected."""
    result = hpdl.check("lars_step", fn, grade=True)
    assert result.score == result.max_score, result


def test_a_values_difference_is_shown_in_as_many_digits_as_it_takes():
    import numpy as np

    from hpdl.checker import hooks

    wrong = hooks.compare(np.array([-1.2686400023]), np.array([-1.2686400001]))
    assert "got -1.26864000, expected -1.26864000" not in wrong.message and "-1.2686400023" in wrong.message


def lars_in_place(params, grads, lr, trust_coef=0.001, weight_decay=0.0):
    """Right new values, taken as an optimizer's step: the caller's parameters and gradients are overwritten."""
    for w, g in zip(params, grads):
        w_norm, g_norm = w.norm(), g.norm()
        ratio = trust_coef * w_norm / (g_norm + weight_decay * w_norm) if w_norm > 0 and g_norm > 0 else 1.0
        w.sub_(lr * ratio * (g + weight_decay * w))
        g.zero_()
    return params


@pytest.mark.parametrize("bad, words", [
    (lars_in_place, ["changed its inputs in place", "rather than w.sub_"]),  # 28/28: only the values were compared
    (lars_without_weight_decay, ["weight_decay is left out"]),  # 24/28: a decay of 5e-4 hid in the tolerance
    (lars_decay_inside_the_norm, ["not ‖g + weight_decay · w‖"]),  # 24/28 too
    (lars_without_trust_ratio, ["plain sgd", "trust ratio"]),
    (lars_dividing_by_zero, ["nan", "ratio of 1"]),
    (lars_zero_layer_stuck, ["never moves"]),
    (lars_guarding_the_denominator, ["gradient is zero", "not the denominator"]),  # 24/28: a hidden case alone
    (lars_one_ratio, ["per layer"]),
    (lars_decay_decoupled, ["decay is scaled by the ratio", "lr · ratio · (g + weight_decay · w)"]),  # no hint
    (lars_decay_in_the_step_only, ["denominator", "‖g‖ + weight_decay · ‖w‖"]),  # no hint
])
def test_lars_step_known_bad_rejected(bad, words):
    rejected(hpdl.check("lars_step", bad, ranks=[2]), *words)
