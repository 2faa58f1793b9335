"""hpdl.bench: the pure helpers exactly, the MPI ones on real ranks under mpiexec."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from hpdl import bench


def test_message_sizes():
    assert bench.message_sizes(8, 64) == [8, 16, 32, 64]
    assert bench.message_sizes(8, 100, 4) == [8, 32]
    assert bench.message_sizes()[-1] == 64 << 20
    with pytest.raises(ValueError):
        bench.message_sizes(0, 10)


def test_fit_line_recovers_alpha_and_beta():
    n = np.array(bench.message_sizes(8, 1 << 24, 4), float)
    alpha, beta = bench.fit_line(n, 2e-6 + n * 1e-10)
    assert alpha == pytest.approx(2e-6, rel=1e-6) and beta == pytest.approx(1e-10, rel=1e-6)
    # never a negative latency: a line through the origin instead
    a, b = bench.fit_line([1, 2, 4], [0.5, 1.5, 3.5])
    assert a == 0.0 and b > 0
    with pytest.raises(ValueError):
        bench.fit_line([1], [1.0])


def test_fit_alpha_beta_gamma_combines_two_measurements():
    n = [8, 1024, 1 << 20]
    fit = bench.fit_alpha_beta_gamma({"sizes": n, "seconds": [1e-6 + s * 2e-10 for s in n]},
                                     {"sizes": n, "seconds": [5e-8 + s * 3e-11 for s in n]})
    assert fit["alpha"] == pytest.approx(1e-6) and fit["beta"] == pytest.approx(2e-10)
    assert fit["gamma"] == pytest.approx(3e-11)


def test_fit_allreduce_recovers_the_ring_models_alpha_and_beta():
    from hpdl import predict

    n = bench.message_sizes(1 << 16, 4 << 20, 2)
    local = {"sizes": n, "seconds": [s * 4e-11 for s in n]}
    for p in (2, 3, 4):
        seconds = [predict.allreduce_seconds(s, p, 3e-6, 1e-10, 4e-11, "ring") for s in n]
        fit = bench.fit_allreduce({"ranks": p, "sizes": n, "seconds": seconds}, local)
        assert fit["alpha"] == pytest.approx(3e-6, rel=1e-6) and fit["beta"] == pytest.approx(1e-10, rel=1e-6)
        assert fit["gamma"] == pytest.approx(4e-11, rel=1e-6)
    # an all-reduce no slower than its own additions leaves β at 0, never negative
    slow_add = {"sizes": n, "seconds": [s * 1e-10 for s in n]}
    fast = {"ranks": 2, "sizes": n, "seconds": [1e-5 + s * 1e-12 for s in n]}
    assert bench.fit_allreduce(fast, slow_add)["beta"] == 0
    with pytest.raises(ValueError, match="2 or more ranks"):
        bench.fit_allreduce({"ranks": 1, "sizes": n, "seconds": [1.0] * len(n)}, local)


def test_bus_bandwidth_factors():
    assert bench.busbw([1e9], [1.0], 2)[0] == pytest.approx(1e9)  # 2(p-1)/p = 1 at p = 2
    assert bench.busbw([1e9], [1.0], 4)[0] == pytest.approx(1.5e9)
    assert bench.busbw([1e9], [1.0], 4, "allgather")[0] == pytest.approx(0.75e9)
    assert bench.busbw([1e9], [2.0], 8, "broadcast")[0] == pytest.approx(0.5e9)
    assert bench.busbw([1e9], [1.0], 4, "alltoall")[0] == pytest.approx(0.75e9)  # (p-1)/p, as nccl-tests
    with pytest.raises(ValueError):
        bench.busbw([1], [1], 2, "scatter_gather")


def test_local_measurements_are_positive():
    red = bench.local_reduce([8, 4096])
    assert red["sizes"] == [8, 4096] and all(t > 0 for t in red["seconds"])
    assert bench.memcpy_bandwidth(1 << 20, repeats=2) > 0


def run_ranks(n: int, code: str, timeout: float = 120) -> dict:
    """Run COMMON + `code` on n MPI ranks; rank 0 prints one JSON line, which is returned."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    script = COMMON + textwrap.dedent(code)
    proc = subprocess.Popen([mpiexec, "-n", str(n), sys.executable, "-c", script],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"{n} ranks did not finish within {timeout} s")
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out + err
    return json.loads(lines[0])


COMMON = """
import json
import numpy as np
from mpi4py import MPI
from hpdl import bench
comm = MPI.COMM_WORLD
rank, p = comm.Get_rank(), comm.Get_size()
def same_everywhere(obj):
    return all(o == obj for o in comm.allgather(obj))
"""


@pytest.mark.slow
def test_sweeps_and_fits_on_three_ranks(no_strays):
    got = run_ranks(3, """
    sizes = [8, 4096, 1 << 16]
    lib = bench.library_allreduce()
    x = np.arange(10, dtype=np.float32) + rank
    total = lib(comm, x)
    sweep = bench.sweep(lib, comm, sizes, name="lib", budget=0.02)
    pp = bench.pingpong(comm, [8, 1 << 16], budget=0.02)
    scal = bench.scaling(lambda c, g: lib(c, g), comm, 4096, name="ar", budget=0.02)
    pair = bench.first_ranks(comm, 2)
    in_pair = pair != MPI.COMM_NULL
    pair_size = pair.Get_size() if in_pair else 0
    bench.idle_wait(comm)
    result = {"total": total.tolist(), "sweep": sweep, "pp": pp, "scaling": scal,
              "same": [same_everywhere(sweep), same_everywhere(pp), same_everywhere(scal)],
              "pairs": comm.allgather([in_pair, pair_size])}
    if rank == 0:
        print(json.dumps(result))
    """)
    assert got["total"] == [3.0 * i + 3 for i in range(10)]  # 0+1+2 added to 3·i
    assert got["same"] == [True, True, True]  # every rank reports the same numbers
    sweep = got["sweep"]
    assert sweep["ranks"] == 3 and sweep["sizes"] == [8, 4096, 1 << 16] and sweep["name"] == "lib"
    assert all(t > 0 for t in sweep["seconds"])
    assert got["pp"]["sizes"] == [8, 1 << 16] and all(t > 0 for t in got["pp"]["seconds"])
    assert got["scaling"]["ranks"] == [2, 3] and len(got["scaling"]["seconds"]) == 2
    assert got["pairs"] == [[True, 2], [True, 2], [False, 0]]


@pytest.mark.slow
def test_sweep_passes_the_learners_signature(no_strays):
    got = run_ranks(2, """
    seen = []
    def allreduce_by_hand(comm, x):
        seen.append((x.dtype.str, x.size))
        out = np.empty_like(x)
        comm.Sendrecv(x, dest=1 - comm.Get_rank(), recvbuf=out, source=1 - comm.Get_rank())
        return out + x
    s = bench.sweep(allreduce_by_hand, comm, [2, 64], budget=0.01)
    if rank == 0:
        print(json.dumps({"name": s["name"], "sizes": s["sizes"], "seen": sorted(set(seen))}))
    """)
    assert got["name"] == "allreduce_by_hand"
    assert got["sizes"] == [4, 64]  # at least one float32 element
    assert got["seen"] == [["<f4", 1], ["<f4", 16]]
