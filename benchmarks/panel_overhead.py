"""The live panel's cost to the ranks: a 2-rank data-parallel training step, panel off vs on.

Each rank trains a small MLP with DDP (gloo) on synthetic data; a round times `--steps` steps
with hpdl.dp.step_times (between barriers, slowest rank). Rounds alternate: panel closed, then
hpdl.panel() polling every `--every` s (the ranks answer from their hang-answerer thread; this
process's panel thread reads the answers and the controller's queues), and so on. Prints the
median step of each and their ratio. Goal: on / off ≤ 1.02.

    .venv/bin/python benchmarks/panel_overhead.py --rounds 6 --steps 20
"""
from __future__ import annotations

import argparse
import statistics
import time

import hpdl

SETUP = """
import torch, hpdl
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(*[m for _ in range({layers}) for m in (torch.nn.Linear({width}, {width}),
                                                                       torch.nn.ReLU())]))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn({batch}, {width}), torch.randn({batch}, {width})

def train_step():
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per variant (alternating)")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per round")
    ap.add_argument("--every", type=float, default=0.5, help="panel update period, s")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args()
    c = hpdl.start(n=2, frameworks=("torch",), quiet=True)
    try:
        view = c.view
        view.execute(SETUP.format(width=args.width, layers=args.layers, batch=args.batch), block=True)
        view.execute("hpdl.dp.step_times(train_step, steps=5, warmup=3)", block=True)  # warm caches
        medians: dict[str, list[float]] = {"off": [], "on": []}
        updates = 0
        for i in range(2 * args.rounds):
            variant = "off" if i % 2 == 0 else "on"
            panel = hpdl.panel(every=args.every) if variant == "on" else None
            if panel is not None:
                time.sleep(2 * args.every)  # polling and answering in full swing before the clock starts
            view.execute(f"_t = hpdl.dp.step_times(train_step, steps={args.steps}, warmup=1)", block=True)
            times = view.pull("_t", targets=0, block=True)
            medians[variant].append(statistics.median(times))
            if panel is not None:
                updates += panel.updates
                assert panel.rows and all(r.state in ("idle", "running", "stuck") for r in panel.rows), panel.text()
                panel.close()
        off, on = statistics.median(medians["off"]), statistics.median(medians["on"])
        print(f"2 ranks, DDP (gloo) MLP {args.layers}x{args.width}, batch {args.batch}; "
              f"{args.rounds} rounds x {args.steps} steps per variant, alternating")
        print(f"  panel off   median step {off * 1e3:7.2f} ms   (round medians {_ms(medians['off'])})")
        print(f"  panel on    median step {on * 1e3:7.2f} ms   (round medians {_ms(medians['on'])}; "
              f"every {args.every:g} s, {updates} updates)")
        print(f"  on / off    {on / off:.3f}   (goal <= 1.02)")
    finally:
        hpdl.stop(quiet=True)


def _ms(xs: list[float]) -> str:
    return " ".join(f"{x * 1e3:.1f}" for x in xs)


if __name__ == "__main__":
    main()
