"""GPU paths decided without a GPU: device choice, threads per rank, the MPI library report,
the doctor's GPU warning, CUDA timing, and the metric reduction of benchmarks/synthetic.py.

The rules are pure functions fed with what ranks would see on a GPU node (0, 1 or N devices,
bound or not); the parts that need MPI run on real ranks (mpiexec, Gloo on the CPU).
"""
from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl import devices, doctor, mpilib

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def node(n_ranks: int, gpus: int, bound: bool = False) -> list[list[str]]:
    """What each local rank sees: all GPUs (no binding) or one each (srun --gpus-per-task=1)."""
    uuids = [f"GPU-{i:04d}" for i in range(gpus)]
    if bound:
        return [[uuids[r]] if r < gpus else [] for r in range(n_ranks)]
    return [list(uuids) for _ in range(n_ranks)]


def choices(node_visible, **kw) -> list[devices.Choice]:
    return [devices.choose(r, node_visible, **kw) for r in range(len(node_visible))]


def physical(node_visible, picks) -> list[str]:
    return [node_visible[r][c.index] for r, c in enumerate(picks) if c.index is not None]


# -- device choice -------------------------------------------------------------------------

def test_no_gpu_means_cpu_and_gloo_silently():
    for c in choices(node(4, 0)):
        assert (c.device, c.backend, c.note, c.refuse) == ("cpu", "gloo", "", "")


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_one_gpu_per_rank_when_there_are_enough(n):
    vis = node(n, 8)
    picks = choices(vis)
    assert all(c.backend == "nccl" and not c.note for c in picks)
    assert [c.index for c in picks] == list(range(n))  # rank r -> GPU r on an unbound node
    assert len(set(physical(vis, picks))) == n


def test_bound_ranks_each_use_their_only_visible_device():
    vis = node(4, 4, bound=True)
    picks = choices(vis)
    assert [c.device for c in picks] == ["cuda:0"] * 4  # index 0 of each rank's own list...
    assert sorted(physical(vis, picks)) == ["GPU-0000", "GPU-0001", "GPU-0002", "GPU-0003"]  # ...4 GPUs


@pytest.mark.parametrize("ranks,gpus", [(2, 1), (4, 1), (4, 2), (3, 2)])
def test_more_ranks_than_gpus_falls_back_to_cpu_for_all_and_says_why(ranks, gpus):
    picks = choices(node(ranks, gpus))
    assert {c.device for c in picks} == {"cpu"} and {c.backend for c in picks} == {"gloo"}
    for c in picks:
        assert f"{ranks} ranks on a node with {gpus} usable GPU(s)" in c.note
        assert f"hpdl.start(n={gpus})" in c.note and "--gpus-per-task=1" in c.note


def test_policy_cuda_refuses_with_the_fix_instead_of_falling_back():
    picks = choices(node(4, 2), policy="cuda")
    assert all(c.refuse and "Start at most 2 rank(s) per node" in c.refuse for c in picks)
    assert choices(node(2, 0), gpus_on_node=2, cuda_build=False, policy="cuda")[0].refuse


def test_gpus_on_node_but_cpu_torch_is_never_silent():
    c = devices.choose(0, node(2, 0), cuda_build=False, gpus_on_node=4)
    assert c.device == "cpu" and "torch is a CPU build" in c.note
    c = devices.choose(0, node(2, 0), cuda_build=True, gpus_on_node=4)
    assert c.device == "cpu" and "torch sees none" in c.note


def test_never_two_ranks_on_one_gpu_in_any_small_configuration():
    for ranks, gpus, bound in itertools.product(range(1, 7), range(0, 5), (False, True)):
        vis = node(ranks, gpus, bound)
        picks = choices(vis)
        used = physical(vis, picks)
        assert len(used) == len(set(used)), (ranks, gpus, bound)
        assert len({c.backend for c in picks}) == 1  # one backend on the whole node
        if used:
            assert len(used) == ranks and all(c.backend == "nccl" for c in picks)


def test_one_node_without_gpus_for_all_sends_every_rank_to_the_cpu():
    gpu_rank = devices.Choice(0, "nccl")
    after = devices.agree(["nccl", "nccl", "gloo", "gloo"], gpu_rank)
    assert (after.device, after.backend) == ("cpu", "gloo") and after.note
    assert devices.agree(["nccl"] * 4, gpu_rank) == gpu_rank


def test_unknown_policy_is_refused():
    assert "HPDL_DEVICE='gpu'" in devices.choose(0, node(1, 1), policy="gpu").refuse


# -- threads -----------------------------------------------------------------------------

def test_threads_divide_shared_cores_but_not_cores_bound_to_the_rank():
    all16 = frozenset(range(16))
    assert devices.threads_for(all16, [all16] * 4) == 4  # no binding: 16 cores shared by 4 ranks
    own = [frozenset(range(4 * r, 4 * r + 4)) for r in range(4)]  # srun --cpu-bind: 4 cores each
    assert [devices.threads_for(own[r], own) for r in range(4)] == [4, 4, 4, 4]
    assert devices.threads_for(frozenset({0}), [frozenset({0})] * 3) == 1  # never 0


# -- the MPI library report --------------------------------------------------------------

MAPS = """\
7f00 r-xp 00000000 fd:01 1 /usr/lib/x86_64-linux-gnu/libc.so.6
7f01 r--p 00000000 fd:01 2 /opt/mvapich2-gdr/lib64/libmpi.so.12.1.1
7f02 r-xp 00001000 fd:01 2 /opt/mvapich2-gdr/lib64/libmpi.so.12.1.1
7f03 r-xp 00000000 fd:01 3 /venv/lib/libmpi.so.12
7f04 r-xp 00000000 fd:01 4 /venv/lib/python3.11/site-packages/mpi4py/MPI.cpython-311-x86_64-linux-gnu.so
7f05 rw-p 00000000 00:00 0
"""


def test_library_files_in_load_order_once_each():
    assert mpilib.library_files(MAPS) == ["/opt/mvapich2-gdr/lib64/libmpi.so.12.1.1", "/venv/lib/libmpi.so.12"]


# MPI_Get_library_version as MVAPICH2 2.3.x writes it (src/mpi/init/library_version.c: "MVAPICH2 Version
# :\t%s", release date, device, configure line; the form MPI.jl's and Spack's MVAPICH2 checks match). The
# configure lines: a plain InfiniBand build, and a CUDA build as MVAPICH2's user guide configures one.
MV2_PLAIN = ("MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022\n"
             "MVAPICH2 Device       :\tch3:mrail\n"
             "MVAPICH2 configure    :\t--prefix=/opt/mvapich2 --with-device=ch3:mrail --with-rdma=gen2\n"
             "MVAPICH2 CC  :\tgcc    -DNDEBUG -DNVALGRIND -O2")
MV2_CUDA = MV2_PLAIN.replace("--with-rdma=gen2", "--with-rdma=gen2 --enable-cuda --with-cuda=/usr/local/cuda-12.6")


def test_cuda_awareness_from_the_library_else_from_what_mvapich2_says_of_its_build(tmp_path):
    assert mpilib.cuda_awareness("MPICH Version: 5.0.2", False, {}) == (False, "MPIX_Query_cuda_support()")
    assert mpilib.cuda_awareness("Open MPI v5.0.3", True, {}) == (True, "MPIX_Query_cuda_support()")
    # MVAPICH2 2.3.x has no MPIX_Query_cuda_support: its configure line says, and MV2_USE_CUDA switches it on
    assert mpilib.cuda_awareness(MV2_CUDA, None, {"MV2_USE_CUDA": "1"}) == (
        True, "MVAPICH2 built with CUDA, MV2_USE_CUDA=1")
    assert mpilib.cuda_awareness(MV2_CUDA, None, {})[0] is False  # built for CUDA, not switched on
    assert mpilib.cuda_awareness(MV2_PLAIN, None, {"MV2_USE_CUDA": "1"})[0] is False  # no CUDA in the build
    # a build whose configure line is not printed: libmpi linking the CUDA runtime tells
    lib = tmp_path / "libmpi.so.12"
    lib.write_bytes(b"\x7fELF" + b"\0" * 64 + b"libibverbs.so.1\0libcudart.so.12\0libc.so.6\0")
    first_line = MV2_PLAIN.splitlines()[0]
    assert mpilib.cuda_awareness(first_line, None, {"MV2_USE_CUDA": "1"}, [str(lib)])[0] is True
    assert mpilib.cuda_awareness(first_line, None, {"MV2_USE_CUDA": "1"}, [])[0] is False
    assert mpilib.cuda_awareness("Intel(R) MPI Library 2021.9", None, {}) == (None, "")
    line = mpilib.describe({"files": ["/x/libmpi.so.12"], "cuda_aware": None, "how": ""})
    assert line == "/x/libmpi.so.12 · CUDA-aware: unknown"


# -- doctor: GPUs on the node, torch a CPU build ------------------------------------------

def test_doctor_warns_when_gpus_exist_but_torch_is_a_cpu_build():
    cpu_torch = {"version": "2.13.0+cpu", "cuda_build": None, "gpus": 0}
    status, fix = doctor.gpu_torch_check(4, cpu_torch)
    assert status == "warn" and "4 GPU(s)" in fix and "CPU build" in fix and "torch==2.13.0" in fix
    cuda_torch_blind = {"version": "2.13.0", "cuda_build": "13.0", "gpus": 0}
    assert "CUDA_VISIBLE_DEVICES" in doctor.gpu_torch_check(2, cuda_torch_blind)[1]
    assert doctor.gpu_torch_check(0, cpu_torch) is None  # a laptop: nothing to say
    assert doctor.gpu_torch_check(4, {"version": "2.13.0", "cuda_build": "13.0", "gpus": 4}) is None


# -- CUDA timing ---------------------------------------------------------------------------

def test_step_times_synchronises_cuda_devices_only():
    import torch

    from hpdl import dp

    dp._synchronize(torch.device("cpu"))  # nothing to wait for
    dp._synchronize(None)  # CUDA never started here
    with pytest.raises((AssertionError, RuntimeError), match="CUDA|cuda"):
        dp._synchronize(torch.device("cuda", 0))  # a CPU build can't: proves the call is made


# -- on real ranks: placement, the bound store, the report, synthetic's reduction -----------

RANKS_SCRIPT = r"""
import json, os, sys
import psutil, torch, torch.distributed as dist
from mpi4py import MPI
sys.path.insert(0, os.path.join(sys.argv[1], "benchmarks"))
import synthetic
from hpdl import mpilib, rank as hr

comm = MPI.COMM_WORLD
device, threads, note = hr.place()
hr.init_torch_distributed(comm.Get_rank(), comm.Get_size(), device)
store_port = int(os.environ["MASTER_PORT"])  # rank 0's TCPStore (MPI's own sockets are not ours to judge)
listening = sorted({c.laddr.ip for c in psutil.Process().net_connections("tcp")
                    if c.status == "LISTEN" and c.laddr.port == store_port})

# a device-only group reduces tensors on its device: record every tensor the benchmark reduces
seen = []
real = dist.all_reduce
def recording(t, *a, **k):
    seen.append(str(t.device))
    return real(t, *a, **k)
dist.all_reduce = recording
mean = synthetic._mean_over_ranks("ddp", float(comm.Get_rank() + 1), device)
out = synthetic.run("ddp", "digits_cnn", batch_size=8, warmup=1, batches_per_iter=1, iters=2,
                    scaling=True, device=device, verbose=False)
dist.all_reduce = real
report = {"rank": comm.Get_rank(), "device": str(device), "threads": threads, "note": note,
          "affinity": len(os.sched_getaffinity(0)), "listening": listening, "mean": mean,
          "seen": sorted(set(seen)), "alone": out["alone"], "per_rank": out["per_rank"],
          "lib": mpilib.loaded()}
os.write(1, (json.dumps(report) + "\n").encode())
hr.finish()
"""


@pytest.mark.slow
def test_two_ranks_place_bind_report_and_reduce_on_the_device(tmp_path, no_strays):
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = dict(os.environ, HPDL_DEVICE="auto")
    r = subprocess.run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script), str(ROOT)],
                       capture_output=True, text=True, timeout=240, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    reports = sorted((json.loads(s) for s in r.stdout.splitlines() if s.startswith("{")), key=lambda d: d["rank"])
    assert [d["rank"] for d in reports] == [0, 1]
    for d in reports:
        assert d["device"] == "cpu" and d["note"] == ""  # no GPU here, none expected: nothing to say
        assert d["threads"] == max(1, d["affinity"] // 2)  # two ranks share this machine's cores
        assert d["mean"] == pytest.approx(1.5)
        assert d["seen"] == ["cpu"]  # every reduced tensor was on the group's device
        assert d["alone"] > 0 and d["per_rank"] > 0
        lib = d["lib"]
        assert lib["files"] and Path(lib["files"][0]).resolve().parent == (BIN.parent / "lib").resolve()
        assert lib["cuda_aware"] is False and lib["how"] == "MPIX_Query_cuda_support()"
    # rank 0's store listens on the loopback only, never on all interfaces
    assert reports[0]["listening"] and set(reports[0]["listening"]) == {"127.0.0.1"}
