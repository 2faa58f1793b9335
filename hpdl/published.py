"""Published scaling results, and the published hardware numbers that should predict them.

Every number here is data with its source next to it; nothing is fitted to the results. The
predictor (hpdl/predict.py) turns the inputs into efficiencies; benchmarks/predict_published.py
and lesson 09 print them side by side with the published ones.

Parameter counts and FLOPs come from the model definitions in hpdl/models.py (built on the
meta device: no memory, no download), whose parameter counts equal torchvision's.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from hpdl.predict import Network, System, Workload

GBIT = 1e9 / 8  # bytes per second in one Gbit/s

# -- single-device throughput (images/s, one P100, synthetic data, batch 64 unless noted) -----
TF_BENCHMARKS = ("TensorFlow performance benchmarks, DGX-1 (8x P100), tf_cnn_benchmarks, synthetic data, "
                 "May 2017 (tensorflow/docs_src/performance/benchmarks.md)")
P100_IMAGES_PER_S = {"inception_v3": 142.0, "resnet50": 219.0, "resnet152": 91.8, "vgg16": 154.0}
# Goyal et al. 2017, estimating the bandwidth they need: "backprop on a single P100 for ResNet-50
# takes 120 ms", at 32 images per GPU
GOYAL_BACKPROP_S, GOYAL_BATCH = 0.120, 32

# -- links -------------------------------------------------------------------------------------
NCCL_TUNING = "NCCL src/graph/tuning.cc: per-step latency of the ring, Simple protocol"
ROCE_25G = Network("RoCE 25 Gbit/s", alpha=9.6e-6, beta=1 / (25 * GBIT),
                   source=f"line rate (Horovod benchmark page); α: {NCCL_TUNING}, network hop 9.6 µs")
PCIE3 = Network("PCIe 3.0 x16", alpha=5.7e-6, beta=1 / 12e9,
                source=f"~12 GB/s achievable of 15.75 GB/s; α: {NCCL_TUNING}, PCI hop 5.7 µs")
NVLINK1 = Network("NVLink 1.0 (P100)", alpha=3.4e-6, beta=1 / 20e9,
                  source=f"20 GB/s per link and direction (P100 whitepaper); α: {NCCL_TUNING}, NVLink hop 3.4 µs")
ETH_50G = Network("50 Gbit Ethernet", alpha=9.6e-6, beta=1 / (50 * GBIT),
                  source=f"line rate (Goyal et al.: Mellanox ConnectX-4 50 Gbit Ethernet); α: {NCCL_TUNING}, "
                         "network hop 9.6 µs (Gloo publishes none)")
# Adding two buffers on a P100 reads 2 bytes and writes 1 per byte reduced, at 732 GB/s (HBM2)
P100_GAMMA = 3 / 732e9

HOROVOD_CLUSTER = System(
    "Horovod benchmark: servers of 4 Pascal GPUs, RoCE 25 Gbit/s", intra=PCIE3, inter=ROCE_25G, gamma=P100_GAMMA,
    per_node=4, algorithm="ring",
    source="Horovod docs/benchmarks.rst; NCCL 2 ring over all GPUs (hierarchical all-reduce is off by default)")
GLOO_STAGING = ("Gloo's CudaAllreduceHalvingDoubling (gloo/cuda_allreduce_halving_doubling.h): default workspace "
                "CudaHostWorkspace — the server's reduced buffer is copied to host memory, halved and doubled there, "
                "and copied back before the broadcast")
BIG_BASIN = System(
    "Big Basin: servers of 8 P100 (NVLink), 50 Gbit Ethernet", intra=NVLINK1, inter=ETH_50G, gamma=P100_GAMMA,
    per_node=8, algorithm="hierarchical", inter_algorithm="rabenseifner", staging=PCIE3,
    source="Goyal et al. 2017 §4.1–4.2: reduce within the server (NCCL), recursive halving and doubling across "
           "servers (Gloo), broadcast within the server; one 50 Gbit NIC per server")

# What Goyal et al. publish about their own timing (§5.5, Figs. 7 and 8) — outputs, printed as checks
# of the inputs, never fed into the model
GOYAL_BASELINE_EPOCH_MIN = 16  # "from over 16 minutes" per epoch on 8 GPUs (kn = 256)
GOYAL_IMAGES = 1.28e6          # "∼1.28 million ImageNet training images"
GOYAL_ITERATION_GROWTH = 0.12  # "the time per iteration increases only 12%" from kn = 256 to 11k (352 GPUs)

HOROVOD_FUSION = 64 * 2**20  # bytes; Horovod's default threshold until v0.21 (PRs #15, #2468)
HOROVOD_CYCLE = 0.005  # seconds between the background thread's rounds; Horovod's default until v0.21 (PR #2468)


@dataclass(frozen=True)
class Published:
    """One published result: `efficiency` on `ranks` GPUs relative to `baseline` GPUs, for the
    model named `model` (a key of COUNTED)."""

    workload: Workload
    system: System
    ranks: int
    baseline: int
    efficiency: float
    source: str
    model: str


# What count_model_facts() finds (tests/test_predict.py checks that it still does); kept here
# because counting FLOPs of five ImageNet models takes half a minute on two cores.
COUNTED = {
    "inception_v3": {"params": 27_161_264, "tensors": 292, "flops": 34_275_032_448, "backward_share": 0.66629},
    "resnet50": {"params": 25_557_032, "tensors": 161, "flops": 24_299_077_632, "backward_share": 0.66343},
    "resnet101": {"params": 44_549_160, "tensors": 314, "flops": 46_572_404_736, "backward_share": 0.66498},
    "resnet152": {"params": 60_192_808, "tensors": 467, "flops": 68_845_731_840, "backward_share": 0.66552},
    "vgg16": {"params": 138_357_544, "tensors": 32, "flops": 92_648_177_664, "backward_share": 0.66604},
}


def model_facts(name: str) -> dict:
    """Parameters, parameter tensors, training FLOPs per image (multiply and add counted apart)
    and backward's share of them, for the models of the published benchmarks."""
    return dict(COUNTED[name])


def _model_and_input(name: str):
    import hpdl.models as models

    return {
        "inception_v3": (models.inception_v3, 299), "resnet50": (models.resnet50, 224),
        "resnet101": (models.resnet101, 224), "resnet152": (lambda: models.resnet(152), 224),
        "vgg16": (models.vgg16, 224),
    }[name]


@functools.lru_cache(maxsize=None)
def gradient_ready(name: str) -> tuple[tuple[int, float], ...]:
    """hpdl.models.gradient_ready for a published model on its ImageNet-sized input (~1 s each)."""
    import hpdl.models as models

    make, size = _model_and_input(name)
    return tuple(models.gradient_ready(make, (2, 3, size, size)))


@functools.lru_cache(maxsize=None)
def count_model_facts(name: str) -> dict:
    """model_facts(), counted afresh on the meta device from hpdl.models (ImageNet-sized input)."""
    import hpdl.models as models

    make, size = _model_and_input(name)
    import torch

    with torch.device("meta"):
        model = make()
    shape = (2, 3, size, size)  # two images: batch norm needs more than one value per channel
    total = models.train_flops(make, shape) / 2
    forward = models.train_flops(make, shape, backward=False) / 2
    return {"params": models.parameter_count(model), "tensors": len(list(model.parameters())),
            "flops": total, "backward_share": 1 - forward / total}


def resnet101_images_per_s() -> float:
    """ResNet-101 is not in the TensorFlow table: its time per image is interpolated, linearly in
    training FLOPs, between the published ResNet-50 and ResNet-152 (the same family and code)."""
    f50, f101, f152 = (model_facts(m)["flops"] for m in ("resnet50", "resnet101", "resnet152"))
    t50, t152 = 1 / P100_IMAGES_PER_S["resnet50"], 1 / P100_IMAGES_PER_S["resnet152"]
    return 1 / (t50 + (f101 - f50) / (f152 - f50) * (t152 - t50))


def workloads() -> dict[str, Workload]:
    """The published workloads, each with the sources of its inputs."""
    out = {}
    for name, label in [("inception_v3", "Inception V3"), ("resnet101", "ResNet-101"), ("vgg16", "VGG-16")]:
        facts = model_facts(name)
        if name == "resnet101":
            rate, rate_src = resnet101_images_per_s(), "interpolated in FLOPs between ResNet-50 and ResNet-152 of " + \
                TF_BENCHMARKS
        else:
            rate, rate_src = P100_IMAGES_PER_S[name], TF_BENCHMARKS
        out[name] = Workload(
            label, params=facts["params"], seconds_per_sample=1 / rate, batch=64,
            backward_share=facts["backward_share"], fusion_bytes=HOROVOD_FUSION, overlap=True,
            sources={"images/s on one P100": f"{rate:.1f} — {rate_src}",
                     "parameters": f"{facts['params']:,} — hpdl.models on the meta device (= torchvision)",
                     "backward share": f"{facts['backward_share']:.3f} — training FLOPs counted by torch",
                     "batch per GPU": "64 — Horovod benchmark page",
                     "buckets": f"{HOROVOD_FUSION >> 20} MiB fusion threshold — Horovod's default then (PR #15)"})
    facts = model_facts("resnet50")
    compute = GOYAL_BACKPROP_S / facts["backward_share"]
    out["resnet50"] = Workload(
        "ResNet-50", params=facts["params"], seconds_per_sample=compute / GOYAL_BATCH, batch=GOYAL_BATCH,
        backward_share=facts["backward_share"], buckets=facts["tensors"], overlap=True,
        sources={"compute per step": f"{compute * 1e3:.0f} ms — backprop 120 ms on one P100 (Goyal et al., in their "
                                     "bandwidth estimate) ÷ backward share",
                 "parameters": f"{facts['params']:,} — hpdl.models on the meta device (= torchvision)",
                 "backward share": f"{facts['backward_share']:.3f} — training FLOPs counted by torch",
                 "batch per GPU": "32 — Goyal et al. (k·n = 8192 on 256 GPUs)",
                 "buckets": f"{facts['tensors']} — one all-reduce per gradient tensor, during backprop (Goyal et al.)"})
    return out


def results() -> list[Published]:
    """Every published configuration, in the order the benchmark prints them."""
    w = workloads()
    hv_new = "Horovod docs/benchmarks.rst: 128 servers × 4 Pascal GPUs, RoCE 25 Gbit/s"
    hv_old = "Horovod README (2017): 32 servers × 4 Pascal GPUs, RoCE 25 Gbit/s"
    rows = []
    for name, e512, e128 in [("inception_v3", 0.90, 0.90), ("resnet101", 0.90, 0.90), ("vgg16", 0.68, 0.79)]:
        rows.append(Published(w[name], HOROVOD_CLUSTER, 512, 1, e512, hv_new, name))
        rows.append(Published(w[name], HOROVOD_CLUSTER, 128, 1, e128, hv_old, name))
    rows.append(Published(w["resnet50"], BIG_BASIN, 256, 8, 0.90,
                          "Goyal et al. 2017 (arXiv 1706.02677): ~90% scaling efficiency from 8 to 256 GPUs",
                          "resnet50"))
    return rows
