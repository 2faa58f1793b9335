"""Lesson 10's tensor and sequence parallelism on real ranks: the lesson's own cells (read from the
notebook, run as %%px runs them) pass on 2 ranks and, by hand, on 3 (4 heads and 256 MLP features
that do not divide evenly), and the check cell rejects the mistakes a learner makes — g without its
all-reduce, f without its backward all-reduce, the fused qkv matrix cut in N contiguous blocks."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

LESSON = Path(__file__).resolve().parents[1] / "notebooks" / "11_sharding_memory.ipynb"

SCRIPT = """
import faulthandler, json, sys
import nbformat, torch
from mpi4py import MPI
from hpdl.rank import init_torch_distributed

faulthandler.dump_traceback_later(LIMIT, exit=True)          # a stuck rank prints where it is, then ends
comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
init_torch_distributed(rank, world, torch.device("cpu"))
cells = {c.id: c.source for c in nbformat.read(LESSON, as_version=4).cells}
ns = {"rank": rank, "world_size": world}
exec("import copy\\nfrom torch import nn\\nfrom torch.distributed.device_mesh import init_device_mesh\\n"
     "from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module", ns)

def run(cid):
    exec(cells[cid].removeprefix("%%px --local\\n").removeprefix("%%px\\n"), ns)

def rejected(cid):
    try:
        run(cid)
    except (AssertionError, RuntimeError):   # the cell's assert, or shapes that no longer fit
        return True
    return False

run("sm-03")
run("sm-tp-hand")
run("sm-tp-check")
if (64 // 16) % world == 0:                   # DTensor's even split must give whole heads
    run("sm-dt-attn")
if 32 % world == 0:                           # sequence parallelism: the sequence divides evenly
    run("sm-sp")

class Pass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()
    @staticmethod
    def backward(ctx, grad):
        return grad

good, attention = ns["TPBlock"].__init__.__defaults__, ns["TPAttention"]

class Contiguous(attention):
    \"\"\"The fused qkv matrix's rows cut in N contiguous blocks, as ColwiseParallel would cut it.\"\"\"
    def __init__(self, attn, *args):
        super().__init__(attn, *args)
        self.rows = torch.tensor_split(torch.arange(3 * attn.proj.in_features), world)[rank]
        self.qkv_w, self.qkv_b = ns["keep"](attn.qkv.weight[self.rows]), ns["keep"](attn.qkv.bias[self.rows])

verdicts = {}
ns["TPBlock"].__init__.__defaults__ = (good[0], Pass)
verdicts["g without all-reduce"] = rejected("sm-tp-check")
ns["TPBlock"].__init__.__defaults__ = (Pass, good[1])
verdicts["f without backward all-reduce"] = rejected("sm-tp-check")
ns["TPBlock"].__init__.__defaults__ = good
ns["TPAttention"] = Contiguous
verdicts["qkv cut contiguously"] = rejected("sm-tp-check") if world > 1 else True
ns["TPAttention"] = attention
verdicts["good again"] = not rejected("sm-tp-check")
faulthandler.cancel_dump_traceback_later()
if rank == 0:
    print(json.dumps(verdicts))
from hpdl.rank import finish
finish()   # the DeviceMesh still holds its groups: end without interpreter shutdown
"""


def lesson_cells_on(n: int, limit: float = 150) -> dict:
    """The verdicts rank 0 prints after running the lesson's cells and the known-bad variants on n ranks."""
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    script = f"LESSON = {str(LESSON)!r}\nLIMIT = {limit}\n" + SCRIPT
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    proc = subprocess.Popen([mpiexec, "-n", str(n), sys.executable, "-c", script], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=limit + 30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{n} ranks did not finish within {limit + 30} s:\n{err[-3000:]}")
    assert proc.returncode == 0, err[-3000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert len(lines) == 1, out + err[-3000:]
    return json.loads(lines[0])


@pytest.mark.parametrize("n", [2, 3])
def test_lesson_tensor_parallel_checks_pass_and_reject_mistakes(n, no_strays):
    verdicts = lesson_cells_on(n)
    assert verdicts == {"g without all-reduce": True, "f without backward all-reduce": True,
                        "qkv cut contiguously": True, "good again": True}
