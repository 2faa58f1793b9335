"""Claim: hpdl.predict, fed only published hardware numbers, reproduces published scaling
efficiencies within 5 percentage points.

    .venv/bin/python benchmarks/predict_published.py
    .venv/bin/python benchmarks/predict_published.py --count     # recount parameters and FLOPs (~30 s)
    .venv/bin/python benchmarks/predict_published.py --what-if   # faster network, fp16, more GPUs per node

Printed: for every published configuration the predicted and the published efficiency, then
every input with its source, and last `max |predicted − published| = X pp`. Nothing is fitted:
the inputs are line rates, NCCL's own latency table, single-GPU throughputs from the TensorFlow
benchmark page, and parameter counts and FLOPs of the models in hpdl/models.py. The model and
what it leaves out are described in hpdl/predict.py; the data and sources in hpdl/published.py.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpdl import predict, published  # noqa: E402


def table(rows: list[published.Published]) -> float:
    print(f"{'model':<13}{'GPUs':>5}{'vs':>4}  {'system':<56}{'buckets':>8}{'compute':>9}{'comm':>8}"
          f"{'exposed':>9}{'predicted':>11}{'published':>11}{'Δ pp':>7}")
    worst = 0.0
    for r in rows:
        s = predict.predict(r.workload, r.system, [r.ranks], baseline=r.baseline)[0]
        delta = 100 * (s["efficiency"] - r.efficiency)
        worst = max(worst, abs(delta))
        print(f"{r.workload.name:<13}{r.ranks:>5}{r.baseline:>4}  {r.system.name[:55]:<56}{r.workload.bucket_count:>8}"
              f"{s['compute'] * 1e3:>7.0f}ms{s['comm'] * 1e3:>6.0f}ms{s['exposed'] * 1e3:>7.0f}ms"
              f"{s['efficiency']:>11.1%}{r.efficiency:>11.0%}{delta:>+7.1f}")
    return worst


def inputs(rows: list[published.Published]) -> None:
    print("\nInputs and their sources")
    seen = set()
    for r in rows:
        for obj, lines in [(r.system, _system_lines(r.system)), (r.workload, _workload_lines(r.workload))]:
            if id(obj) in seen:
                continue
            seen.add(id(obj))
            for line in lines:
                print(line)
    print("  results:")
    for r in rows:
        print(f"    {r.workload.name} on {r.ranks} GPUs (vs {r.baseline}): {r.efficiency:.0%} — {r.source}")


def _system_lines(s: predict.System) -> list[str]:
    out = [f"  system {s.name}: {s.per_node} GPUs per node, all-reduce {s.algorithm}"
           + (f" ({s.inter_algorithm} across nodes)" if s.algorithm == "hierarchical" else "") + f" — {s.source}"]
    for label, link in [("within a node", s.intra), ("between nodes", s.inter)]:
        out.append(f"    {label}: {link.name}: α = {link.alpha * 1e6:.1f} µs, β = 1/({link.gbytes_per_s:.2f} GB/s)"
                   f" — {link.source}")
    out.append(f"    γ = 1/({1e-9 / s.gamma:.0f} GB/s) — a P100 adds two buffers at HBM2's 732 GB/s "
               "(2 bytes read, 1 written per byte)")
    return out


def _workload_lines(w: predict.Workload) -> list[str]:
    out = [f"  workload {w.name}: {w.params:,} parameters = {w.grad_bytes / 1e6:.1f} MB of fp32 gradients, "
           f"batch {w.batch} per GPU, {w.batch * w.seconds_per_sample * 1e3:.0f} ms compute per step"]
    out += [f"    {key}: {value}" for key, value in w.sources.items()]
    return out


def what_if() -> None:
    """The learner's questions: what would change the VGG-16 result at 512 GPUs?"""
    w = published.workloads()["vgg16"]
    base = published.HOROVOD_CLUSTER
    fast = predict.Network("InfiniBand EDR 100 Gbit/s", 9.6e-6, 1 / (100 * published.GBIT))
    cases = {
        "as published": (w, base),
        "fp16 gradients (half the bytes)": (w.with_(bytes_per_value=2), base),
        "4× faster network (100 Gbit/s)": (w, predict.System(base.name, base.intra, fast, base.gamma, base.per_node)),
        "hierarchical all-reduce": (w, predict.System(base.name, base.intra, base.inter, base.gamma, base.per_node,
                                                      "hierarchical")),
        "one 553 MB bucket (no overlap left)": (w.with_(fusion_bytes=None, buckets=1), base),
        "8 GPUs per node, same NIC": (w, predict.System(base.name, base.intra, base.inter, base.gamma, 8,
                                                        "hierarchical")),
    }
    print("\nWhat if — VGG-16 on 512 GPUs:")
    for label, (wl, system) in cases.items():
        print(f"  {label:<38}{predict.efficiency(wl, system, 512):7.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", action="store_true", help="recount parameters and FLOPs on the meta device")
    ap.add_argument("--what-if", action="store_true", help="also print what faster networks or fp16 would give")
    args = ap.parse_args()
    if args.count:
        for name in published.COUNTED:
            published.COUNTED[name] = published.count_model_facts(name)
    rows = published.results()
    worst = table(rows)
    inputs(rows)
    if args.what_if:
        what_if()
    print(f"\nmax |predicted − published| = {worst:.1f} pp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
