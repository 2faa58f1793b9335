"""The scaling predictor (hpdl.predict), its published inputs (hpdl.published) and the models
they count: parameter counts equal torchvision's published ones, the cost formulas agree with
each other where they must, and the predictions of the published configurations hold.

No MPI here: pure arithmetic and models on the meta device.
"""
from __future__ import annotations

import math

import pytest
import torch

import hpdl.models as models
from hpdl import predict, published

# torchvision's own numbers (the `num_params` of its weights' metadata)
TORCHVISION_PARAMS = {
    "resnet50": (models.resnet50, 25_557_032),
    "resnet101": (models.resnet101, 44_549_160),
    "vgg16": (models.vgg16, 138_357_544),
    "inception_v3": (models.inception_v3, 27_161_264),
    "inception_v3 without aux": (lambda: models.inception_v3(aux_logits=False), 23_834_568),
}


@pytest.mark.parametrize("name", list(TORCHVISION_PARAMS))
def test_parameter_counts_equal_torchvision(name):
    make, expected = TORCHVISION_PARAMS[name]
    with torch.device("meta"):
        model = make()
    assert models.parameter_count(model) == expected


def test_models_run_on_their_input_sizes():
    with torch.device("meta"):
        for make, size in [(models.vgg16, 224), (models.inception_v3, 299)]:
            model = make()
            out = model(torch.empty(2, 3, size, size))
            logits = out[0] if isinstance(out, tuple) else out
            assert tuple(logits.shape) == (2, 1000)
    with torch.device("meta"):
        inception = models.inception_v3().eval()
        assert tuple(inception(torch.empty(2, 3, 299, 299)).shape) == (2, 1000)


@pytest.mark.parametrize("name", ["resnet50", "vgg16"])
def test_counted_facts_are_up_to_date(name):
    counted = published.count_model_facts(name)
    kept = published.COUNTED[name]
    assert counted["params"] == kept["params"] and counted["tensors"] == kept["tensors"]
    assert counted["flops"] == kept["flops"]
    assert abs(counted["backward_share"] - kept["backward_share"]) < 1e-4


def test_allreduce_formulas():
    n, a, b, g = 1e6, 1e-5, 1e-9, 2e-10
    # at p = 2 ring and halving-doubling are the same exchange: 2α + nβ + nγ/2
    for alg in ("ring", "rabenseifner"):
        assert predict.allreduce_seconds(n, 2, a, b, g, alg) == pytest.approx(2 * a + n * b + n * g / 2)
    assert predict.allreduce_seconds(n, 1, a, b, g) == 0.0
    p = 8
    assert predict.allreduce_seconds(n, p, a, b, g, "ring") == pytest.approx(
        2 * 7 * a + 2 * 7 / 8 * n * b + 7 / 8 * n * g)
    assert predict.allreduce_seconds(n, p, a, b, g, "recursive_doubling") == pytest.approx(3 * (a + n * b + n * g))
    assert predict.allreduce_seconds(n, p, a, b, g, "tree") == pytest.approx(6 * (a + n * b) + 3 * n * g)
    with pytest.raises(ValueError):
        predict.allreduce_seconds(n, p, a, b, g, "butterfly")


def test_hierarchical_reduces_to_flat_cases():
    link = predict.Network("x", 1e-5, 1e-9)
    n = 4e6
    # one rank per node: just the algorithm across nodes
    assert predict.hierarchical_seconds(n, 16, 1, link, link, 0.0, "ring") == pytest.approx(
        predict.allreduce_seconds(n, 16, link.alpha, link.beta, 0.0, "ring"))
    # one node: reduce-scatter + all-gather inside it = a ring all-reduce
    assert predict.hierarchical_seconds(n, 1, 8, link, link, 0.0) == pytest.approx(
        predict.allreduce_seconds(n, 8, link.alpha, link.beta, 0.0, "ring"))


def test_step_time_core():
    c, n, a, b, g = 0.3, 1e8, 1e-5, 1 / 3e9, 1 / 2e11
    assert predict.predict_step_time(c, n, a, b, g, 1, overlap=0.5, buckets=4) == c
    t = predict.allreduce_seconds(n, 16, a, b, g)
    assert predict.predict_step_time(c, n, a, b, g, 16) == pytest.approx(c + t)
    # more buckets: more latency, better overlap; the last bucket always shows
    t4 = 4 * predict.allreduce_seconds(n / 4, 16, a, b, g)
    assert predict.predict_step_time(c, n, a, b, g, 16, overlap=0.5, buckets=4) == pytest.approx(
        c + max(t4 - 0.5 * c, t4 / 4))
    assert predict.predict_step_time(c, 1e3, a, b, g, 16, overlap=0.66, buckets=4) > c


def test_predict_efficiency_and_oversubscription():
    here = predict.System("laptop", predict.Network("shm", 1e-6, 1e-10), predict.Network("shm", 1e-6, 1e-10),
                          gamma=1e-10, per_node=4, cores=2)
    w = predict.Workload("tiny", params=1000, seconds_per_sample=1e-3, batch=32, overlap=False)
    rows = predict.predict(w, here, [1, 2, 3, 4])
    assert rows[0]["efficiency"] == 1.0
    # the busiest core runs ⌈ranks / cores⌉ ranks in turn: 3 ranks on 2 cores are as slow as 4
    assert [r["oversubscribed"] for r in rows] == [1, 1, 2, 2]
    assert rows[3]["efficiency"] == pytest.approx(0.5, rel=0.01)  # 4 ranks take turns on 2 cores
    assert rows[2]["efficiency"] == pytest.approx(0.5, rel=0.01)
    strong = predict.predict(w, here, [1, 2], global_batch=64)
    assert strong[1]["batch"] == 32 and strong[1]["efficiency"] <= 1.0


def test_host_staging_crosses_the_link_twice_across_nodes_only():
    link = predict.Network("net", 1e-5, 1e-10)
    pcie = predict.Network("pcie", 5e-6, 1 / 12e9)
    plain = predict.System("s", link, link, 0.0, per_node=8, algorithm="hierarchical")
    staged = predict.System("s", link, link, 0.0, per_node=8, algorithm="hierarchical", staging=pcie)
    n = 1e8
    assert predict.comm_seconds(n, 64, staged) - predict.comm_seconds(n, 64, plain) == pytest.approx(
        2 * (5e-6 + n / 12e9))
    assert predict.comm_seconds(n, 8, staged) == predict.comm_seconds(n, 8, plain)  # one node: no host copy


def test_measured_contention_slows_compute():
    shm = predict.Network("shm", 1e-6, 1e-10)
    here = predict.System("laptop", shm, shm, gamma=1e-10, per_node=4, cores=2, contention=(1.0, 1.2))
    w = predict.Workload("tiny", params=1000, seconds_per_sample=1e-3, batch=32, overlap=False)
    rows = predict.predict(w, here, [1, 2, 3, 4])
    assert [r["contention"] for r in rows] == [1.0, 1.2, 1.2, 1.2]  # past the cores: the last entry
    assert rows[1]["compute"] == pytest.approx(1.2 * 0.032)
    assert rows[3]["compute"] == pytest.approx(2 * 1.2 * 0.032)  # both cores busy, two turns each
    assert rows[1]["efficiency"] == pytest.approx(1 / 1.2, rel=0.01)


def test_gradient_ready_follows_backward_order_and_its_flops():
    # 64 → 128 → 10: backward's matrix products are 2·b·(1280 for the last layer's input gradient,
    # 1280 for its weight, 8192 for the first layer's weight; the input needs none)
    ready = models.gradient_ready(models.DigitsMLP, (4, 64))
    assert sorted(ready[:2]) == [(10, pytest.approx(2560 / 10752)), (1280, pytest.approx(2560 / 10752))]
    assert sorted(ready[2:]) == [(128, 1.0), (8192, 1.0)]
    resnet = models.gradient_ready(models.resnet50, (2, 3, 224, 224))
    assert len(resnet) == published.model_facts("resnet50")["tensors"]
    assert sum(n for n, _ in resnet) == published.model_facts("resnet50")["params"]
    shares = [f for _, f in resnet]
    assert shares == sorted(shares) and shares[-1] == 1.0 and shares[0] < 0.01
    assert resnet[1][0] == 2048 * 1000  # the classifier's weight is among the first ready


def test_serial_schedule_waits_for_each_gradient_and_for_the_all_reduce_before():
    assert predict.serial_schedule([0.0, 0.0, 5.0], [2.0, 2.0, 1.0]) == 6.0  # idle from 4 to 5
    assert predict.serial_schedule([0.0, 1.0, 2.0], [3.0, 3.0, 3.0]) == 9.0  # queued behind each other
    assert predict.serial_schedule([], []) == 0.0
    with pytest.raises(ValueError):
        predict.serial_schedule([0.0], [1.0, 2.0])


def test_cycle_schedule_fuses_what_is_ready_at_each_wake():
    def cost(nbytes):  # 1 ms a message plus 1 ms a byte
        return 0.001 + 0.001 * nbytes

    # both ready at the first wake (5 ms): one fused all-reduce, or two when the threshold splits them
    assert predict.cycle_schedule([0, 0], [1, 1], cost, 0.005, 2) == pytest.approx(0.008)
    assert predict.cycle_schedule([0, 0], [1, 1], cost, 0.005, 1) == pytest.approx(0.009)
    # ready at 6 ms waits for the wake at 10 ms; a tensor over the threshold goes alone
    assert predict.cycle_schedule([0.006], [1], cost, 0.005, 1) == pytest.approx(0.012)
    assert predict.cycle_schedule([0, 0], [3, 1], cost, 0.005, 2) == pytest.approx(0.011)
    # a wake busy past the next one starts the next as soon as it ends
    assert predict.cycle_schedule([0, 0.006], [9, 1], cost, 0.005, 64) == pytest.approx(0.005 + 0.010 + 0.002)
    with pytest.raises(ValueError):
        predict.cycle_schedule([0], [], cost, 0.005, 1)


def test_published_configurations_predicted():
    rows = published.results()
    assert len(rows) == 7
    deltas = {}
    for r in rows:
        eff = predict.efficiency(r.workload, r.system, r.ranks, r.baseline)
        assert 0 < eff <= 1
        deltas[(r.workload.name, r.ranks)] = abs(eff - r.efficiency)
    # the Horovod benchmark: all six within the 5-point goal, from unfitted inputs
    assert all(d <= 0.05 for (name, _), d in deltas.items() if name != "ResNet-50"), deltas
    # Goyal et al.: the model finds their communication hidden behind backprop (≈100%); the
    # remaining 10 points are outside a communication model (see benchmarks/predict_published.py)
    assert deltas[("ResNet-50", 256)] < 0.11


def test_resnet101_interpolation_between_published_neighbours():
    rate = published.resnet101_images_per_s()
    assert published.P100_IMAGES_PER_S["resnet152"] < rate < published.P100_IMAGES_PER_S["resnet50"]
    assert math.isclose(published.workloads()["resnet101"].seconds_per_sample, 1 / rate)
