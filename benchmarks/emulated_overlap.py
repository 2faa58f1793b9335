"""Claim: across a network, DDP's overlapped buckets take ≤ 0.85× the step of one all-reduce after
backward, and hpdl.predict gets the weak-scaling efficiency within 10 %.

    .venv/bin/python benchmarks/emulated_overlap.py                    (as root)
    .venv/bin/python benchmarks/emulated_overlap.py --share 1 --buckets 1 5 25 --rounds 7

Two emulated nodes (hpdl/emulated.py), one rank each, one torch thread each: every rank has a
core to compute on, and Gloo's thread waits on the link, not on a core. That is what overlap
needs; on one machine (benchmarks/ddp_overlap.py) communication is a memory copy that wants the
same cores as compute, so there is nothing to overlap with.

1. The link's rate: unless `--link` names one, the model's compute per step is timed here on one
   core first, and the rate set so that all-reducing the gradient (n bytes each way at p = 2)
   takes `--share` of it (0.5: communication about half of compute).
2. On the nodes, rounds alternate between: compute only (no communication: a rank alone on its
   node, the weak-scaling baseline), one all-reduce after backward (no overlap), and DDP with
   each `--buckets` size (overlap), `--steps` steps each. Per round the ratio DDP / one
   all-reduce; the median of the rounds' ratios is the claim (pairs taken seconds apart: on a
   shared machine other programs come and go). `--nice -10` (root) puts the ranks ahead of them.
3. The predictor (hpdl.predict.predict_step_time) is fed what the same job measured: compute and
   forward alone, α and β fitted to Gloo's all-reduce across the link, γ an add on one core,
   DDP's real bucket count. Its weak-scaling efficiency (compute / step) against the measured one
   (the median over rounds of compute only / step: 1 node = a rank alone on its node).

The last line reads `DDP overlapped / one all-reduce after backward = X× step time at link R`.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

HERE = os.path.abspath(__file__)
sys.path.insert(0, os.path.dirname(HERE))  # ddp_overlap.py and emulated_nodes.py, beside this file


# -- the arithmetic (tests/test_emulated_overlap.py checks it) --------------------------------------

def link_for(grad_bytes: float, compute: float, share: float) -> str:
    """tc's rate at which a 2-rank all-reduce of `grad_bytes` (each rank sends and receives them
    once) takes `share` of `compute` seconds; in whole Mbit/s."""
    return f"{max(1, round(grad_bytes * 8 / (share * compute) / 1e6))}mbit"


def paired_ratio(rounds: list[dict], name: str, reference: str) -> float:
    """Median over rounds of (name's step / reference's step), each round's pair taken together."""
    return statistics.median(r[name] / r[reference] for r in rounds)


def predicted(compute: float, forward: float, grad_bytes: float, alpha: float, beta: float, gamma: float,
              buckets: int) -> float:
    """Step seconds by hpdl.predict on 2 ranks: `buckets` all-reduces, hidden behind backward
    (compute − forward) after the first; one bucket means no overlap."""
    from hpdl.predict import predict_step_time

    overlap = (1 - forward / compute) * (1 - 1 / buckets)
    return predict_step_time(compute, grad_bytes, alpha, beta, gamma, 2, overlap=overlap, buckets=buckets)


# -- what runs on the ranks -------------------------------------------------------------------------

def gloo_fit(sizes: list[int], comm) -> tuple[float, float]:
    """(α, β + γ/2) of Gloo's all-reduce on these 2 ranks: at p = 2 it costs 2α + n(β + γ/2)."""
    import torch
    import torch.distributed as dist

    from hpdl import dp
    from hpdl.bench import fit_line

    seconds = []
    for n in sizes:
        x = torch.ones(n // 4)
        seconds.append(statistics.median(dp.step_times(lambda: dist.all_reduce(x), steps=3, warmup=1, comm=comm)))
    a, slope = fit_line(sizes, seconds)
    return a / 2, slope


def variants(args, comm) -> tuple[dict, dict]:
    """name -> one training step, and name -> DDP's bucket count; the models start equal."""
    import torch
    from ddp_overlap import OneAllreduce, big_mlp, one_allreduce_step, plain_step
    from torch.nn.parallel import DistributedDataParallel as DDP

    g = torch.Generator().manual_seed(1 + comm.rank)
    x, y = torch.randn(args.batch, args.width, generator=g), torch.randint(0, 10, (args.batch,), generator=g)
    steps, buckets = {}, {}
    for name, cap in [("compute only", None), ("one all-reduce", None), *((f"DDP {b:g} MB", b) for b in args.buckets)]:
        model = big_mlp(args.width, args.depth)
        if cap:
            model = DDP(model, bucket_cap_mb=cap, gradient_as_bucket_view=True)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        if name == "one all-reduce":
            reducer = OneAllreduce(model, comm, "gloo")
            steps[name] = lambda m=model, o=opt, r=reducer: one_allreduce_step(m, o, x, y, r)
        else:
            steps[name] = lambda m=model, o=opt: plain_step(m, o, x, y)
        if cap:
            for _ in range(3):  # DDP rebuilds its buckets in backward's order by the third step
                steps[name]()
            buckets[name] = len(model._get_ddp_logging_data()["rebuilt_bucket_sizes"].split(","))
        if name == "compute only":
            steps["forward"] = lambda m=model: m(x)
    return steps, buckets


def worker(args) -> None:
    import torch
    from mpi4py import MPI

    from hpdl import dp
    from hpdl.rank import finish, init_torch_distributed

    comm = MPI.COMM_WORLD
    torch.set_num_threads(1)
    init_torch_distributed(comm.rank, comm.size, torch.device("cpu"))
    steps, buckets = variants(args, comm)
    names = [k for k in steps if k != "forward"]
    rounds = []
    for r in range(args.rounds):  # every other round in reverse: no variant always follows the same one
        order = names if r % 2 == 0 else names[::-1]
        got = {k: statistics.median(dp.step_times(steps[k], args.steps, int(r == 0), comm)) for k in order}
        rounds.append({k: got[k] for k in names})
    forward = statistics.median(dp.step_times(steps["forward"], args.steps, 1, comm))
    # sizes past tbf's burst (10 ms of traffic): a smaller message rides the bucket at line speed
    alpha, slope = gloo_fit([4 << 20, 8 << 20, 16 << 20], comm)
    if comm.rank == 0:
        print("RESULT " + json.dumps({"rounds": rounds, "buckets": buckets, "forward": forward,
                                      "alpha": alpha, "slope": slope}), flush=True)
    finish()


# -- the driver -------------------------------------------------------------------------------------

def calibrate(args) -> tuple[float, int]:
    """(compute seconds per step on one core, gradient bytes) of the model, here, alone."""
    import torch
    from ddp_overlap import big_mlp, plain_step

    torch.set_num_threads(1)
    model = big_mlp(args.width, args.depth)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(args.batch, args.width), torch.randint(0, 10, (args.batch,))
    plain_step(model, opt, x, y)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        plain_step(model, opt, x, y)
        times.append(time.perf_counter() - t0)
    return statistics.median(times), 4 * sum(p.numel() for p in model.parameters())


def run_job(args, link: str) -> dict:
    """This file's worker on 2 emulated nodes × 1 rank joined by `link`, as a side job."""
    from emulated_nodes import result_of

    from hpdl import emulated, reaper

    cmd = ["--worker", "--width", str(args.width), "--depth", str(args.depth), "--batch", str(args.batch),
           "--steps", str(args.steps), "--rounds", str(args.rounds), "--buckets", *map(str, args.buckets)]
    with emulated.nodes(2, 2, link, reaper.end_pids) as net:
        return result_of([*net.job_command(), sys.executable, HERE, *cmd], args.timeout, "overlap")


def report_overlap(got: dict, link: str, grad_bytes: int) -> tuple[str, float]:
    """The step table and the overlap ratio; returns the best DDP variant and its ratio."""
    rounds = got["rounds"]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    compute, flat = med["compute only"], med["one all-reduce"]
    print(f"\nstep times on 2 emulated nodes x 1 rank, link {link}, medians of {len(rounds)} rounds")
    print(f"{'variant':<18}{'buckets':>8}{'step ms':>10}{'exposed comm ms':>17}{'step / one all-reduce':>23}")
    for k, t in med.items():
        ratio = "" if k == "compute only" else f"{paired_ratio(rounds, k, 'one all-reduce'):.2f}x"
        exposed = "" if k == "compute only" else f"{1e3 * (t - compute):.1f}"
        print(f"{k:<18}{got['buckets'].get(k, 1 if k != 'compute only' else ''):>8}{1e3 * t:>10.1f}{exposed:>17}"
              f"{ratio:>23}")
    print(f"communication / compute: {(flat - compute) / compute:.2f} ({grad_bytes / 2**20:.0f} MiB of gradients)")
    best = min((k for k in med if k.startswith("DDP")), key=lambda k: paired_ratio(rounds, k, "one all-reduce"))
    return best, paired_ratio(rounds, best, "one all-reduce")


def report_prediction(got: dict, grad_bytes: int, gamma: float) -> None:
    """Weak-scaling efficiency (compute only / step) per variant: predicted against measured."""
    rounds = got["rounds"]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    compute = med["compute only"]
    alpha, beta = got["alpha"], max(got["slope"] - gamma / 2, 0.0)
    print(f"\npredictor (hpdl.predict) fed: compute {compute * 1e3:.1f} ms, forward {got['forward'] * 1e3:.1f} ms, "
          f"α {alpha * 1e6:.0f} µs, β {beta * 1e9:.3f} ns/B ({1e-6 / beta if beta else math.inf:.0f} MB/s) "
          f"from Gloo across the link, γ {gamma * 1e9:.3f} ns/B")
    print(f"{'variant':<18}{'predicted eff':>15}{'measured eff':>14}{'pred / meas - 1':>17}")
    worst = 0.0
    for k in (k for k in med if k != "compute only"):
        k_buckets = got["buckets"].get(k, 1)
        pred = compute / predicted(compute, got["forward"], grad_bytes, alpha, beta, gamma, k_buckets)
        meas = 1 / paired_ratio(rounds, k, "compute only")
        worst = max(worst, abs(pred / meas - 1))
        print(f"{k:<18}{pred:>15.3f}{meas:>14.3f}{(pred / meas - 1) * 100:>16.1f}%")
    print(f"weak-scaling efficiency, 2 emulated nodes vs 1: max |predicted / measured - 1| = {worst * 100:.1f} %")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--link", help="the link's rate, tc's spelling (default: the rate that makes "
                                   "communication --share of compute)")
    ap.add_argument("--share", type=float, default=0.5, help="communication / compute the rate aims at")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--depth", type=int, default=24, help="hidden Linear(width, width) layers: 1 MiB each at 512")
    ap.add_argument("--batch", type=int, default=512, help="samples per rank per step")
    ap.add_argument("--buckets", type=float, nargs="+", default=[1, 5], help="DDP bucket_cap_mb values")
    ap.add_argument("--steps", type=int, default=1, help="timed steps per variant per round")
    ap.add_argument("--rounds", type=int, default=9, help="rounds alternating the variants")
    ap.add_argument("--timeout", type=float, default=600, help="seconds for the job on the nodes")
    ap.add_argument("--nice", type=int, default=0, help="the ranks' niceness (negative, as root: ahead of "
                                                        "other programs on a shared machine)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    from hpdl import emulated
    from hpdl.bench import fit_line, local_reduce

    if problem := emulated.missing():
        sys.exit(problem)
    os.nice(args.nice)  # this process, the calibration and the job's ranks
    compute, grad_bytes = calibrate(args)
    link = args.link or link_for(grad_bytes, compute, args.share)
    print(f"MLP {args.depth}x{args.width}, batch {args.batch}: compute {compute * 1e3:.0f} ms per step on one core "
          f"here; link {link}" + ("" if args.link else f" (communication ≈ {args.share:g} of compute)"), flush=True)
    got = run_job(args, link)
    gamma = fit_line(*(lambda r: (r["sizes"], r["seconds"]))(local_reduce([1 << 20, 4 << 20, 16 << 20])))[1]
    report_prediction(got, grad_bytes, gamma)
    best, ratio = report_overlap(got, link, grad_bytes)
    print(f"{best} overlapped / one all-reduce after backward = {ratio:.2f}x step time at link {link}")


if __name__ == "__main__":
    main()
