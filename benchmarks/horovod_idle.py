"""What an idle Horovod costs the ranks' other work, and what lowering its thread's priority does.

Horovod's background thread meets the other ranks every cycle (1 ms) in an MPI_Allreduce, and
MPICH waits in it by polling: with nothing to reduce, one rank of a pair can poll most of the time.
The engines can give that thread a lower priority on CPU ranks (hpdl.rank.init_horovod,
HPDL_HOROVOD_NICE; off by default). Three set-ups, started afresh and alternated round by round:

    torch only     hpdl.start(n, frameworks=("torch",))       no Horovod thread at all
    horovod        hpdl.start(n)                                Horovod's thread as it comes (the default)
    horovod nice N hpdl.start(n, env={"HPDL_HOROVOD_NICE": N})  its thread at nice N

Printed per set-up: a torch compute cell (slowest rank, median of the round's repeats) as a ratio
to torch only, and for the Horovod set-ups the median step of a small DistributedOptimizer loop.

    python benchmarks/horovod_idle.py --ranks 2 --rounds 4
"""
from __future__ import annotations

import argparse
import statistics

import hpdl

COMPUTE = """
import time, torch
torch.manual_seed(0)
a = torch.randn(256, 256)
t0 = time.perf_counter()
for _ in range(400):
    a = torch.tanh(a @ a / 16)
elapsed = time.perf_counter() - t0
"""
HOROVOD_STEPS = """
import statistics, time, torch
torch.manual_seed(0)
net = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(8)])
opt = hvd.DistributedOptimizer(torch.optim.SGD(net.parameters(), lr=0.01), named_parameters=net.named_parameters())
x = torch.randn(64, 256)
times = []
for i in range(45):
    t0 = time.perf_counter()
    opt.zero_grad(); net(x).square().mean().backward(); opt.step()
    times.append(time.perf_counter() - t0)
elapsed = statistics.median(times[5:])
"""


def slowest(view, cell: str, repeats: int) -> float:
    """Median over `repeats` runs of the cell of its slowest rank's `elapsed`."""
    out = []
    for _ in range(repeats):
        view.execute(cell, block=True)
        out.append(max(view.pull("elapsed", block=True)))
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5, help="runs of each cell per round")
    ap.add_argument("--nice", type=int, default=10, help="the nice level to compare with Horovod as it comes")
    args = ap.parse_args()
    setups = {
        "torch only": dict(frameworks=("torch",)),
        "horovod": {},
        f"horovod nice {args.nice}": dict(env={"HPDL_HOROVOD_NICE": str(args.nice)}),
    }
    compute: dict[str, list[float]] = {name: [] for name in setups}
    steps: dict[str, list[float]] = {name: [] for name in setups if "horovod" in name}
    for r in range(args.rounds):
        for name, kwargs in setups.items():
            with hpdl.start(n=args.ranks, **kwargs) as _:
                view = hpdl.view()
                compute[name].append(slowest(view, COMPUTE, args.repeats))
                if name in steps:
                    steps[name].append(slowest(view, HOROVOD_STEPS, max(1, args.repeats // 2)))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{n} {compute[n][-1]:.3f} s" for n in setups), flush=True)
    base = statistics.median(compute["torch only"])
    print(f"\n{args.ranks} ranks, {args.rounds} rounds alternated; medians over rounds")
    print(f"{'set-up':<16} {'compute cell':>13} {'vs torch only':>14} {'Horovod step':>13}")
    for name in setups:
        c = statistics.median(compute[name])
        step = f"{statistics.median(steps[name]) * 1e3:.2f} ms" if name in steps else "—"
        print(f"{name:<16} {c:>11.3f} s {c / base:>13.2f}x {step:>13}")


if __name__ == "__main__":
    main()
