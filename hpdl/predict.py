"""Predict a data-parallel training step — and so throughput and scaling efficiency — on any
number of ranks and any network, from a handful of measured or published numbers.

Each rank computes forward and backward on its own batch, then the gradients are all-reduced:

    compute  = batch × seconds per sample                 (forward + backward on one device)
    t_comm   = k · allreduce(n / k)                        (n gradient bytes, fused into k buckets;
                                                            every bucket pays the latency again)
    exposed  = max(t_comm − overlap · compute, t_comm / k) (communication hidden behind backward,
                                                            except the last bucket, ready only
                                                            when backward ends)
    step     = compute + exposed

and `allreduce` is the α-β-γ cost of lesson 04 (α seconds per message, β per byte moved, γ per
byte reduced) for a ring, a tree, recursive doubling, Rabenseifner's halving-doubling, or a
hierarchical all-reduce (reduce-scatter inside each node, all-reduce across nodes, all-gather
inside each node). With k buckets spread evenly over backward, bucket j is ready at
j/k of backward, so the communication can run alongside the last (1 − 1/k) of it:
`overlap = backward share × (1 − 1/k)`; without overlap (one all-reduce after backward) it is 0.

Finer, gradient by gradient: serial_schedule() and cycle_schedule() take when backward produces
each gradient (hpdl.models.gradient_ready) and run the all-reduces one at a time or, as Horovod
does, fused every cycle — a check on the even buckets above (benchmarks/predict_published.py).

Scaling efficiency is throughput per rank with p ranks over throughput per rank on the
baseline (one device, or one node): 1.0 means perfect. The published configurations it is
checked against, with every input and its source, live in hpdl/published.py.

On CPUs, ranks on one node slow each other's compute down (System.contention, measured with
the ranks computing at once) and, once they outnumber the cores, take turns (⌈ranks / cores⌉).

What the model leaves out, on purpose: stragglers (a synchronous step waits for the slowest
rank), the input pipeline, communication slowing compute down (both share memory and, on
GPUs, streaming multiprocessors), ranks that take turns on a core also taking turns to
communicate (a message waits for its receiver's turn), and the negotiation of Horovod's
background thread. Where a prediction misses a measurement, one of these is the first suspect.

Pure Python, no torch: it runs in the notebook's kernel, on the ranks and in the checker.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

ALGORITHMS = ("ring", "tree", "recursive_doubling", "rabenseifner", "hierarchical")


@dataclass(frozen=True)
class Network:
    """One kind of link: α seconds per message step, β seconds per byte (1 / bandwidth)."""

    name: str
    alpha: float
    beta: float
    source: str = ""

    @property
    def gbytes_per_s(self) -> float:
        return 1e-9 / self.beta if self.beta else math.inf


@dataclass(frozen=True)
class System:
    """Where the ranks run: `per_node` ranks share a node (linked by `intra`), nodes are linked
    by `inter`; γ is the seconds per byte of adding two buffers on a device.

    `algorithm` is the all-reduce used across all ranks; "hierarchical" reduces inside nodes
    first and runs `inter_algorithm` across nodes.

    `cores`: on CPUs, the cores of a node. When its ranks outnumber them, they take turns: the
    busiest core runs ⌈ranks / cores⌉ of them, one after another, and a synchronous step waits
    for its last one (the scheduler does not even them out within a step: measured here, 3
    ranks on 2 cores take as long as 4). `contention`: measured, not fitted — compute time per
    step with 1, 2, … ranks of a node computing at once (no communication) over one rank's
    alone; ranks that each have a core still share memory bandwidth, caches and clocks. Entry
    i is for i + 1 ranks; past its end the last entry holds.

    `staging`: a hierarchical all-reduce whose across-node step runs in host memory (Gloo's
    CUDA algorithms with their default host workspace) copies each node's reduced buffer over
    this link to the host before it and back after it — two crossings per all-reduce, in series.
    """

    name: str
    intra: Network
    inter: Network
    gamma: float
    per_node: int = 1
    algorithm: str = "ring"
    inter_algorithm: str = "ring"
    cores: int | None = None
    contention: tuple[float, ...] = ()
    staging: Network | None = None
    source: str = ""

    def __post_init__(self):
        for a in (self.algorithm, self.inter_algorithm):
            if a not in ALGORITHMS:
                raise ValueError(f"algorithm {a!r}: choose one of {', '.join(ALGORITHMS)}")

    def compute_slowdown(self, ranks_here: int) -> tuple[float, int]:
        """(contention, turns) for `ranks_here` ranks on one node: compute per step is multiplied
        by both. contention: the measured slowdown with as many ranks computing at once as the
        node has cores for; turns: ⌈ranks / cores⌉, the ranks the busiest core runs in turn."""
        busy = min(ranks_here, self.cores) if self.cores else ranks_here
        shared = self.contention[min(busy, len(self.contention)) - 1] if self.contention else 1.0
        turns = math.ceil(ranks_here / self.cores) if self.cores else 1
        return shared, turns


@dataclass(frozen=True)
class Workload:
    """One model training with a fixed batch per device.

    seconds_per_sample: forward + backward time of one sample on one device (measured, or
        published images/s inverted); backward_share: the part of that spent in backward
        (≈ 2/3: backward computes two products for every one of forward);
    params, bytes_per_value: the gradient to all-reduce (4 for fp32, 2 for fp16 gradients);
    fusion_bytes: the size of a bucket (DDP's bucket_cap_mb, Horovod's fusion threshold);
        `buckets` overrides the count; overlap: communication starts during backward.
    """

    name: str
    params: int
    seconds_per_sample: float
    batch: int
    bytes_per_value: int = 4
    backward_share: float = 2 / 3
    fusion_bytes: float | None = None
    buckets: int | None = None
    overlap: bool = True
    sources: dict = field(default_factory=dict, compare=False)

    @property
    def grad_bytes(self) -> float:
        return float(self.params * self.bytes_per_value)

    @property
    def bucket_count(self) -> int:
        if self.buckets:
            return int(self.buckets)
        if self.fusion_bytes:
            return max(1, math.ceil(self.grad_bytes / self.fusion_bytes))
        return 1

    def with_(self, **changes) -> "Workload":
        """A copy with some inputs changed: `w.with_(bytes_per_value=2)` for fp16 gradients."""
        return replace(self, **changes)


# -- the α-β-γ cost of one all-reduce --------------------------------------------------------

def allreduce_seconds(nbytes: float, p: int, alpha: float, beta: float, gamma: float,
                      algorithm: str = "ring") -> float:
    """Seconds for an all-reduce of `nbytes` on `p` ranks (lesson 04's models).

    ring:                2(p−1)α + 2(p−1)/p·nβ + (p−1)/p·nγ   (bandwidth-optimal)
    rabenseifner:        2⌈lg p⌉α + 2(p−1)/p·nβ + (p−1)/p·nγ   (halving-doubling)
    recursive_doubling:  ⌈lg p⌉(α + nβ + nγ)                   (latency-optimal)
    tree:                2⌈lg p⌉(α + nβ) + ⌈lg p⌉nγ             (binomial reduce, then broadcast)
    """
    if p <= 1:
        return 0.0
    lg = math.ceil(math.log2(p))
    share = (p - 1) / p
    if algorithm == "ring":
        return 2 * (p - 1) * alpha + 2 * share * nbytes * beta + share * nbytes * gamma
    if algorithm == "rabenseifner":
        return 2 * lg * alpha + 2 * share * nbytes * beta + share * nbytes * gamma
    if algorithm == "recursive_doubling":
        return lg * (alpha + nbytes * beta + nbytes * gamma)
    if algorithm == "tree":
        return 2 * lg * (alpha + nbytes * beta) + lg * nbytes * gamma
    raise ValueError(f"algorithm {algorithm!r}: choose one of {', '.join(ALGORITHMS)}")


def hierarchical_seconds(nbytes: float, nodes: int, per_node: int, intra: Network, inter: Network,
                         gamma: float, inter_algorithm: str = "ring") -> float:
    """Reduce-scatter inside each node (a ring of `per_node` ranks), all-reduce each 1/per_node
    shard across the nodes — all shards at once, so they share the node's network link, whose
    β is therefore paid per_node times — then all-gather inside each node."""
    g = max(1, per_node)
    inside = (g - 1) * intra.alpha + (g - 1) / g * nbytes * intra.beta
    scatter = inside + (g - 1) / g * nbytes * gamma
    across = allreduce_seconds(nbytes / g, nodes, inter.alpha, inter.beta * g, gamma, inter_algorithm)
    return scatter + across + inside


def staging_seconds(nbytes: float, nodes: int, system: System) -> float:
    """Copying a node's reduced buffer to the host and back around the across-node all-reduce
    (System.staging); nothing when the ranks fit in one node or the network reads device memory."""
    if system.staging is None or nodes <= 1 or system.algorithm != "hierarchical":
        return 0.0
    return 2 * (system.staging.alpha + nbytes * system.staging.beta)


def comm_seconds(nbytes: float, p: int, system: System) -> float:
    """One all-reduce of `nbytes` over `p` ranks placed `system.per_node` to a node.

    A flat algorithm across several nodes moves in lock-step, so every step runs at the pace of
    its slowest hop: the network's α and β.
    """
    if p <= 1:
        return 0.0
    nodes = math.ceil(p / system.per_node)
    if system.algorithm == "hierarchical":
        return hierarchical_seconds(nbytes, nodes, min(p, system.per_node), system.intra, system.inter,
                                    system.gamma, system.inter_algorithm) + staging_seconds(nbytes, nodes, system)
    link = system.inter if nodes > 1 else system.intra
    return allreduce_seconds(nbytes, p, link.alpha, link.beta, system.gamma, system.algorithm)


# -- the step --------------------------------------------------------------------------------

def predict_step_time(compute: float, nbytes: float, alpha: float, beta: float, gamma: float, p: int,
                      overlap: float = 0.0, buckets: int = 1) -> float:
    """Seconds per data-parallel step with a ring all-reduce: the core of the predictor.

    compute: forward + backward seconds of one rank's batch; nbytes: gradient bytes;
    overlap: the fraction of `compute` that communication may run alongside (0: none);
    buckets: fused all-reduces per step (each pays the ring's 2(p−1)α again).
    """
    if p <= 1:
        return compute
    k = max(1, int(buckets))
    t_comm = k * allreduce_seconds(nbytes / k, p, alpha, beta, gamma, "ring")
    exposed = max(t_comm - overlap * compute, t_comm / k)
    return compute + exposed


def serial_schedule(ready: list[float], costs: list[float]) -> float:
    """When the last of a series of all-reduces ends, run one at a time in the order given, each
    starting once its gradient is ready (`ready`, seconds into backward) and the one before it
    is done. A finer account of overlap than overlap_fraction's even buckets: with each
    tensor's size and ready time (hpdl.models.gradient_ready) it shows whether backward's order
    leaves the network idle early and busy late. Exposed communication = end − backward."""
    end = 0.0
    for t, c in zip(ready, costs, strict=True):
        end = max(end, t) + c
    return end


def cycle_schedule(ready: list[float], sizes: list[float], cost: Callable[[float], float], cycle: float,
                   fusion_bytes: float) -> float:
    """When the last all-reduce ends under Horovod's background thread: every `cycle` seconds
    (or as soon as its previous all-reduces end, if later) it takes the gradients ready by
    then, in order, fuses them into all-reduces of at most `fusion_bytes` (a larger tensor goes
    alone) and runs those one after another. `cost(nbytes)`: seconds for one all-reduce.
    Why: fusion saves the latency of small tensors, the cycle makes a ready gradient wait."""
    if len(ready) != len(sizes):
        raise ValueError("ready and sizes must have one entry per gradient")
    wake, end, i = cycle, 0.0, 0
    while i < len(ready):
        busy, fused = wake, 0.0
        while i < len(ready) and ready[i] <= wake:
            if fused and fused + sizes[i] > fusion_bytes:
                busy, fused = busy + cost(fused), 0.0
            fused += sizes[i]
            i += 1
        if fused:
            end = busy + cost(fused)
        wake = max(wake + cycle, end)
    return end


def overlap_fraction(workload: Workload) -> float:
    """The share of compute that communication can hide behind: backward after the first bucket."""
    if not workload.overlap:
        return 0.0
    return workload.backward_share * (1 - 1 / workload.bucket_count)


def step(workload: Workload, system: System, p: int, *, global_batch: int | None = None) -> dict:
    """Predicted seconds per step on `p` ranks, split into compute, communication and exposed.

    Weak scaling (default): `workload.batch` samples per rank. Strong scaling: a fixed
    `global_batch` shared by the p ranks (each computes global_batch / p samples — assuming a
    device is as fast per sample on a small batch as on a large one, which GPUs are not).
    """
    batch = workload.batch if global_batch is None else global_batch / p
    shared, turns = system.compute_slowdown(min(p, system.per_node))
    compute = batch * workload.seconds_per_sample * shared * turns
    k = workload.bucket_count
    t_comm = k * comm_seconds(workload.grad_bytes / k, p, system)
    exposed = 0.0 if p <= 1 else max(t_comm - overlap_fraction(workload) * compute, t_comm / k)
    return {"ranks": p, "batch": batch, "compute": compute, "comm": t_comm, "exposed": exposed,
            "hidden": t_comm - exposed, "step": compute + exposed, "contention": shared,
            "oversubscribed": turns}


def predict(workload: Workload, system: System, ranks, *, baseline: int = 1,
            global_batch: int | None = None) -> list[dict]:
    """For each rank count: the step() breakdown plus throughput (samples/s, all ranks) and
    scaling efficiency (throughput per rank over the `baseline` rank count's)."""
    rows = [step(workload, system, p, global_batch=global_batch) for p in ranks]
    base = step(workload, system, baseline, global_batch=global_batch)
    base_rate = base["batch"] / base["step"]  # samples/s of one rank at the baseline
    for r in rows:
        r["throughput"] = r["ranks"] * r["batch"] / r["step"]
        r["efficiency"] = (r["batch"] / r["step"]) / base_rate
    return rows


def efficiency(workload: Workload, system: System, p: int, baseline: int = 1) -> float:
    """Scaling efficiency on p ranks (weak scaling), relative to `baseline` ranks."""
    return predict(workload, system, [p], baseline=baseline)[0]["efficiency"]
