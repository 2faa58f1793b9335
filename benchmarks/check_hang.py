"""Time from a hang to the HANG report: a deadlocking ring (every rank receives first).

The learner's function notes the moment it starts (the hang begins right there); the clock
stops when hpdl.check() returns the report naming the stuck ranks and line. The note is a file,
which the sandbox's read-only file system refuses, so that one measurement runs without it
(HPDL_NO_SANDBOX=1). Side by side, sandboxed as a learner's check runs: the same deadlock from
the call to the report, and a passing check on the same ranks. Goal: report within the case time
limit + 2 s.

    .venv/bin/python benchmarks/check_hang.py --timeout 3 --repeats 3
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fixtures"))

import hpdl  # noqa: E402
from learner_ring import ring_deadlock, ring_ok  # noqa: E402


def make_deadlock(stamp_dir: str):
    def ring_allreduce(comm, x):
        path = os.path.join(stamp_dir, f"start-{comm.Get_rank()}")
        if not os.path.exists(path):
            with open(path, "w") as f:
                f.write(repr(time.time()))
        return ring_deadlock(comm, x)
    return ring_allreduce


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--timeout", type=float, default=3.0, help="the case time limit, seconds")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    latencies, totals, startups = [], [], []
    for _ in range(args.repeats):
        with tempfile.TemporaryDirectory() as stamps:
            saved = os.environ.get("HPDL_NO_SANDBOX")
            os.environ["HPDL_NO_SANDBOX"] = "1"
            try:
                result = hpdl.check("ring_allreduce", make_deadlock(stamps), ranks=[args.ranks], timeout=args.timeout)
            finally:
                if saved is None:
                    del os.environ["HPDL_NO_SANDBOX"]
                else:
                    os.environ["HPDL_NO_SANDBOX"] = saved
            t1 = time.time()
            _assert_hang(result, args.ranks)
            hang_began = min(float(Path(stamps, f).read_text()) for f in os.listdir(stamps))
            latencies.append(t1 - hang_began)
        t0 = time.time()
        result = hpdl.check("ring_allreduce", ring_deadlock, ranks=[args.ranks], timeout=args.timeout)
        totals.append(time.time() - t0)
        _assert_hang(result, args.ranks)
        t0 = time.time()
        assert hpdl.check("ring_allreduce", ring_ok, ranks=[args.ranks]).passed
        startups.append(time.time() - t0)
    lat = statistics.median(latencies)
    print(f"{args.ranks} ranks, case time limit {args.timeout:g} s, {args.repeats} repeats (median, min-max)")
    print(f"  hang began -> HANG report        {lat:6.2f} s  ({min(latencies):.2f}-{max(latencies):.2f}; unsandboxed)")
    print(f"  check() call -> HANG report      {statistics.median(totals):6.2f} s  (sandboxed)")
    print(f"  passing check, same ranks        {statistics.median(startups):6.2f} s  (sandboxed)")
    print(f"  report after the limit           {lat - args.timeout:+6.2f} s  (goal: <= +2 s; "
          f"ratio to limit {lat / args.timeout:.2f})")
    print(f"  stuck line: {result.cases[0].line['code']!r} on ranks {sorted(result.cases[0].stuck)}")


def _assert_hang(result, ranks: int) -> None:
    first = result.cases[0]
    assert first.verdict == "HANG" and len(first.stuck) == ranks, result


if __name__ == "__main__":
    main()
