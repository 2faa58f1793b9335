"""benchmarks/emulated_overlap.py's arithmetic, without a network: the rate it sets, the paired
ratio it claims, and the step the predictor is asked for. Its run on emulated nodes is the
benchmark's own (root, minutes); these take milliseconds and fail on a wrong formula."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import emulated_overlap as bench  # noqa: E402

from hpdl import emulated  # noqa: E402


def test_the_rate_makes_communication_the_share_of_compute_asked_for():
    grad, compute = 25 << 20, 0.4
    for share in (0.5, 1.0):
        link = bench.link_for(grad, compute, share)
        seconds = grad * 8 / emulated.link_bits_per_second(link)  # each rank sends n bytes at p = 2
        assert seconds == pytest.approx(share * compute, rel=2e-3), link
    assert bench.link_for(25 << 20, 0.4, 0.5) == "1049mbit"


def test_the_ratio_is_the_median_of_pairs_not_a_ratio_of_medians():
    # a burst of someone else's work slows both variants of round 2: pairs cancel it
    rounds = [{"ddp": 1.0, "flat": 2.0}, {"ddp": 10.0, "flat": 10.0}, {"ddp": 3.0, "flat": 4.0}]
    assert bench.paired_ratio(rounds, "ddp", "flat") == pytest.approx(0.75)
    assert bench.paired_ratio(rounds, "flat", "flat") == 1.0


def test_the_prediction_hides_all_but_the_last_bucket_behind_backward():
    compute, forward, n, alpha, beta, gamma = 1.0, 0.25, 10e6, 1e-3, 2e-8, 1e-9
    one = 2 * alpha + n * beta + n * gamma / 2  # 2-rank all-reduce of n bytes
    assert bench.predicted(compute, forward, n, alpha, beta, gamma, 1) == pytest.approx(compute + one)
    # 4 buckets: 4 all-reduces of n/4, 0.75 × 0.75 s of backward to hide them behind
    four = 4 * (2 * alpha + n / 4 * beta + n / 4 * gamma / 2)
    assert bench.predicted(compute, forward, n, alpha, beta, gamma, 4) == pytest.approx(compute + four / 4)
    slow = 100 * beta  # communication longer than backward: what does not fit shows
    four_slow = 4 * (2 * alpha + n / 4 * slow + n / 4 * gamma / 2)
    assert bench.predicted(compute, forward, n, alpha, slow, gamma, 4) == pytest.approx(
        compute + four_slow - 0.75 * 0.75 * compute)
