"""Claim: hpdl.predict, fed only published hardware numbers, reproduces published scaling
efficiencies within 5 percentage points.

    .venv/bin/python benchmarks/predict_published.py
    .venv/bin/python benchmarks/predict_published.py --count     # recount parameters and FLOPs (~30 s)
    .venv/bin/python benchmarks/predict_published.py --what-if   # faster network, fp16, more GPUs per node

Printed: for every published configuration the predicted and the published efficiency, then
every input with its source; for Goyal et al. where the all-reduce's time goes, their own timing
(as a check, not an input) and what the model lacks to explain it; and last
`max |predicted − published| = X pp`. Nothing is fitted:
the inputs are line rates, NCCL's own latency table, single-GPU throughputs from the TensorFlow
benchmark page, and parameter counts and FLOPs of the models in hpdl/models.py. The model and
what it leaves out are described in hpdl/predict.py; the data and sources in hpdl/published.py.
"""
from __future__ import annotations

import argparse
import functools
import math
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hpdl import predict, published  # noqa: E402


def table(rows: list[published.Published]) -> tuple[float, list[float]]:
    print(f"{'model':<13}{'GPUs':>5}{'vs':>4}  {'system':<56}{'buckets':>8}{'compute':>9}{'comm':>8}"
          f"{'exposed':>9}{'predicted':>11}{'published':>11}{'Δ pp':>7}{'in order':>10}{'Δ pp':>7}")
    worst, ordered_deltas = 0.0, []
    for r in rows:
        s = predict.predict(r.workload, r.system, [r.ranks], baseline=r.baseline)[0]
        delta = 100 * (s["efficiency"] - r.efficiency)
        worst = max(worst, abs(delta))
        ordered = in_backprop_order(r)
        ordered_deltas.append(100 * (ordered - r.efficiency))
        print(f"{r.workload.name:<13}{r.ranks:>5}{r.baseline:>4}  {r.system.name[:55]:<56}{r.workload.bucket_count:>8}"
              f"{s['compute'] * 1e3:>7.0f}ms{s['comm'] * 1e3:>6.0f}ms{s['exposed'] * 1e3:>7.0f}ms"
              f"{s['efficiency']:>11.1%}{r.efficiency:>11.0%}{delta:>+7.1f}{ordered:>10.1%}"
              f"{ordered_deltas[-1]:>+7.1f}")
    print("predicted: buckets spread evenly over backward, the last one exposed (hpdl.predict.step). in order: "
          "each gradient\nwhen backward produces it (hpdl.models.gradient_ready), fused by Horovod's background thread "
          f"every {published.HOROVOD_CYCLE * 1e3:.0f} ms\n(its default then) or, for Goyal et al., one all-reduce per "
          "tensor, one at a time")
    return worst, ordered_deltas


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
    if s.staging is not None:
        out.append(f"    host staging: {s.staging.name}, α = {s.staging.alpha * 1e6:.1f} µs, "
                   f"β = 1/({s.staging.gbytes_per_s:.2f} GB/s), twice per all-reduce — {published.GLOO_STAGING}")
    out.append(f"    γ = 1/({1e-9 / s.gamma:.0f} GB/s) — a P100 adds two buffers at HBM2's 732 GB/s "
               "(2 bytes read, 1 written per byte)")
    return out


def goyal_account(r: published.Published) -> float:
    """Where the model's time for Goyal et al. goes, what the paper itself says about its timing,
    and what would be needed to explain the gap. Returns the exposed time the published
    efficiency implies, in seconds."""
    w, s = r.workload, r.system
    k, n, g = w.bucket_count, w.grad_bytes, s.per_node
    nodes = r.ranks // g
    lg = (nodes - 1).bit_length()
    row = predict.step(w, s, r.ranks)
    parts = {
        "inside the server: reduce, then broadcast (NVLink)":
            k * predict.hierarchical_seconds(n / k, 1, g, s.intra, s.inter, s.gamma),
        f"host staging: to host memory and back ({s.staging.name})": k * predict.staging_seconds(n / k, nodes, s),
        f"across {nodes} servers, bandwidth: 2(N−1)/N · {n / 1e6:.0f} MB over one {s.inter.name} NIC":
            2 * (nodes - 1) / nodes * n * s.inter.beta + (nodes - 1) / nodes * n / g * s.gamma,
        f"across servers, latency: {k} all-reduces × 2⌈lg {nodes}⌉ = {2 * lg} rounds × α":
            k * 2 * lg * s.inter.alpha,
    }
    assert abs(sum(parts.values()) - row["comm"]) < 1e-9 * row["comm"] + 1e-12
    backprop = w.backward_share * row["compute"]
    print(f"\nGoyal et al. — where the model's {row['comm'] * 1e3:.0f} ms of all-reduce per iteration go:")
    for label, t in parts.items():
        print(f"  {t * 1e3:6.1f} ms  {label}")
    print(f"  all of it can run during backprop ({backprop * 1e3:.0f} ms, their figure), one layer's gradient after "
          f"another, so the model exposes only one all-reduce's share ({row['exposed'] * 1e3:.1f} ms)")
    iterations = published.GOYAL_IMAGES / (w.batch * r.baseline)
    baseline_step = published.GOYAL_BASELINE_EPOCH_MIN * 60 / iterations
    base = predict.step(w, s, r.baseline)
    lost = baseline_step / r.efficiency - baseline_step
    growth = published.GOYAL_ITERATION_GROWTH
    print(f"Their own timing (§5.5, Figs. 7–8; outputs, used only as checks):\n"
          f"  8-GPU iteration ≥ {baseline_step * 1e3:.0f} ms (\"over 16 minutes\" per epoch of {iterations:.0f} "
          f"iterations) — the model's {base['step'] * 1e3:.0f} ms ({base['compute'] * 1e3:.0f} ms compute) is "
          f"{baseline_step / base['step'] - 1:.0%} below it\n"
          f"  ~90% efficiency: ≈ {lost * 1e3:.0f} ms more per iteration on {r.ranks} GPUs; the time per iteration "
          f"grows {growth:.0%} up to 352 GPUs (≈ {growth * baseline_step * 1e3:.0f} ms)")
    what_it_would_take(r, base_step=baseline_step)
    return lost


@functools.lru_cache(maxsize=None)
def expected_max_normal(n: int) -> float:
    """E[max of n independent standard normals]: how many σ the slowest of n ranks lags the mean."""
    if n <= 1:
        return 0.0
    step, total, x = 1e-3, 0.0, -8.0
    while x < 8.0:
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * pdf * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) * step
        x += step
    return total


def in_backprop_order(r: published.Published, system: predict.System | None = None, sigma: float = 0.0) -> float:
    """Efficiency with every gradient tensor all-reduced as backward produces it
    (published.gradient_ready): fused by Horovod's background thread every cycle where the
    workload fuses (Horovod), one tensor at a time where it does not (Goyal et al.: one
    all-reduce per layer); plus, with `sigma`, a synchronous step's wait for its slowest rank
    when per-rank step times spread by sigma seconds."""
    system, w = system or r.system, r.workload
    ready = published.gradient_ready(r.model)
    compute = w.batch * w.seconds_per_sample
    backprop = w.backward_share * compute
    times = [f * backprop for _, f in ready]
    sizes = [n * w.bytes_per_value for n, _ in ready]

    def step_time(p: int) -> float:
        if p <= 1:
            return compute

        def cost(nbytes: float) -> float:
            return predict.comm_seconds(nbytes, p, system)

        if w.fusion_bytes:
            end = predict.cycle_schedule(times, sizes, cost, published.HOROVOD_CYCLE, w.fusion_bytes)
        else:
            end = predict.serial_schedule(times, [cost(b) for b in sizes])
        return compute + max(0.0, end - backprop) + sigma * expected_max_normal(p)

    return step_time(r.baseline) / step_time(r.ranks)


def _solve(efficiency_at, lo: float, hi: float, target: float) -> float:
    """The value between lo and hi (efficiency falling from lo to hi) where efficiency_at = target."""
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if efficiency_at(mid) > target else (lo, mid)
    return mid


def what_it_would_take(r: published.Published, base_step: float) -> None:
    """Gradient by gradient in backprop order, and what input would have to change to lose the
    published points — each alone. Diagnostics, never fed back into the prediction."""
    s, w = r.system, r.workload
    ready = published.gradient_ready(r.model)
    assert len(ready) == w.bucket_count
    first_half = sum(n for n, f in ready if f <= 0.5) / sum(n for n, _ in ready)
    eff = in_backprop_order(r)
    print(f"  In backprop order (hpdl.models.gradient_ready: each tensor's all-reduce once its layer's backward is\n"
          f"  done, one at a time): {first_half:.0%} of the bytes are ready in backprop's first half; "
          f"efficiency {eff:.1%}.")
    alpha = _solve(lambda a: in_backprop_order(r, replace(s, inter=replace(s.inter, alpha=a))),
                   s.inter.alpha, 1e-2, r.efficiency)
    gbit = _solve(lambda g: in_backprop_order(r, replace(s, inter=replace(s.inter, beta=1 / (g * published.GBIT)))),
                  1 / (s.inter.beta * published.GBIT), 0.1, r.efficiency)
    e_base, e_all = expected_max_normal(r.baseline), expected_max_normal(r.ranks)
    sigma = _solve(lambda x: in_backprop_order(r, sigma=x), 1e-6, 1.0, r.efficiency)
    print(f"  What it would take to lose the published {1 - r.efficiency:.0%}, each alone:\n"
          f"   · every round across servers costing ≥ {alpha * 1e6:.0f} µs instead of {s.inter.alpha * 1e6:.1f} µs "
          f"(Gloo over TCP publishes no latency);\n"
          f"   · the NIC carrying ≤ {gbit:.0f} of its {1 / (s.inter.beta * published.GBIT):.0f} Gbit/s (Goyal et al. "
          f"estimate ResNet-50 needs ~15 Gbit/s);\n"
          f"   · stragglers: per-GPU iteration times spread by σ ≥ {sigma * 1e3:.0f} ms ({sigma / base_step:.0%} of "
          f"their iteration): a synchronous step\n     waits for its slowest GPU, {e_all:.2f}σ behind the mean of "
          f"{r.ranks} but only {e_base:.2f}σ of {r.baseline};\n"
          f"   · or the host: Gloo reduces in host memory, on the CPUs that also decode images and launch the GPUs'\n"
          f"     kernels.\n"
          f"  None of these is published (Fig. 7 gives only totals; a timeline of one 256-GPU iteration would tell\n"
          f"  which), so none is added: the miss stays a miss.")


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
    worst, ordered = table(rows)
    inputs(rows)
    for r in rows:
        if r.system.algorithm == "hierarchical":
            goyal_account(r)
    if args.what_if:
        what_if()
    ring = [r for r in rows if r.system.algorithm == "ring"]
    horovod = max(abs(100 * (predict.efficiency(r.workload, r.system, r.ranks, r.baseline) - r.efficiency))
                  for r in ring)
    print(f"\nHorovod benchmark only ({len(ring)} configurations): max |predicted − published| = {horovod:.1f} pp")
    print(f"  Gradient by gradient in backprop order (the last column) all {len(rows)} come out optimistic, by "
          f"{min(ordered):+.1f} to {max(ordered):+.1f} pp:\n  Horovod's cycle hides much of what the even buckets "
          "expose, so the agreement above rests on that\n  simplification. Both published systems lose several "
          "points that a communication model, told in full,\n  does not find — see Goyal et al. above for what it "
          "would take.")
    print(f"goal ≤ 5 pp: {'met' if worst <= 5 else 'not met — Goyal et al., see above'}")
    print(f"max |predicted − published| = {worst:.1f} pp")
    return 0


if __name__ == "__main__":
    sys.exit(main())
