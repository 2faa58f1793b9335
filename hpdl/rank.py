"""Engine side: who am I among the ranks, which device is mine, and the frameworks set up.

This module runs inside every engine (one per MPI rank). It never imports the client side.
`setup()` is what `hpdl.start()` runs on each rank; afterwards a `%%px` cell sees the names
`rank`, `local_rank`, `world_size`, `comm` and `device`, and torch.distributed is initialised.
"""
from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

log = logging.getLogger(__name__)


def _cores_here() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def world() -> dict[str, Any]:
    """Rank, local rank and sizes from MPI, the one source of truth for who is who."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    info = {
        "rank": comm.Get_rank(),
        "world_size": comm.Get_size(),
        "local_rank": node.Get_rank(),
        "local_size": node.Get_size(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "mpi": "{} {}".format(MPI.get_vendor()[0], ".".join(map(str, MPI.get_vendor()[1]))),
    }
    node.Free()
    return info


def pick_device(local_rank: int):
    """One GPU per local rank where there are GPUs; the CPU otherwise."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        index = local_rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def share_cores(local_size: int) -> int:
    """Give each rank on a node its share of the cores, so ranks don't fight over them."""
    import torch

    threads = max(1, _cores_here() // max(1, local_size))
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return threads


def init_torch_distributed(rank: int, world_size: int, device, timeout_s: float = 120.0) -> str:
    """Join a torch.distributed process group: NCCL on GPUs, Gloo on CPUs.

    Stock PyTorch wheels have no MPI backend, so MPI only does the rendezvous: rank 0
    chooses an address and a free port and broadcasts them.
    """
    import datetime

    import torch.distributed as dist
    from mpi4py import MPI

    if dist.is_initialized():
        return dist.get_backend()
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    one_node = len(set(hosts)) == 1
    if comm.Get_rank() == 0:
        addr = "127.0.0.1" if one_node else socket.gethostbyname(socket.gethostname())
        endpoint = (addr, _free_port())
    else:
        endpoint = None
    addr, port = comm.bcast(endpoint, root=0)
    if one_node:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend,
        init_method=f"tcp://{addr}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return backend


def init_horovod() -> dict[str, Any]:
    """Start Horovod on this rank (MPI controller when built with MPI, else Gloo)."""
    import horovod.torch as hvd

    hvd.init()
    return {
        "hvd_rank": hvd.rank(),
        "hvd_size": hvd.size(),
        "mpi_built": bool(hvd.mpi_built()),
        "gloo_built": bool(hvd.gloo_built()),
        "nccl_built": bool(hvd.nccl_built()),
    }


_answerer = None


def _answer_hang_requests(run_dir: str, rank: int) -> bool:
    """Let the client ask where this rank is stuck (hpdl.hang), once per engine. True when
    SIGUSR1 makes faulthandler dump the stack (else the client must not send it: it would kill)."""
    global _answerer
    from hpdl import hang

    if _answerer is None:
        _answerer = hang.Answerer(run_dir, rank)
        _answerer.start()
        try:
            _answerer.fault_file = hang.install_faulthandler(run_dir, rank)
        except (AttributeError, ValueError, OSError) as exc:  # no SIGUSR1 (not POSIX), or no file
            log.info("rank %s: no faulthandler fallback for stack dumps: %s", rank, exc)
    return _answerer.fault_file is not None


def setup(namespace: dict, run_dir: str | None = None,
          frameworks: tuple[str, ...] = ("torch", "horovod")) -> dict[str, Any]:
    """Everything a rank needs before the learner's first cell; names land in `namespace`.

    Returns a small report (rank, host, device, threads, timings) for the client to show.
    """
    t0 = time.perf_counter()
    from mpi4py import MPI

    info = world()
    namespace.update(
        rank=info["rank"],
        world_size=info["world_size"],
        local_rank=info["local_rank"],
        comm=MPI.COMM_WORLD,
    )
    if run_dir:
        info["stack_dumps"] = _answer_hang_requests(run_dir, info["rank"])
    info["threads"] = None
    info["device"] = "cpu"
    if "torch" in frameworks or "horovod" in frameworks:
        import torch

        device = pick_device(info["local_rank"])
        info["threads"] = share_cores(info["local_size"])
        info["device"] = str(device)
        namespace.update(torch=torch, device=device)
        if "torch" in frameworks:
            import torch.distributed as dist

            info["backend"] = init_torch_distributed(info["rank"], info["world_size"], device)
            namespace["dist"] = dist
    if "horovod" in frameworks:
        try:
            info.update(init_horovod())
            import horovod.torch as hvd

            namespace["hvd"] = hvd
        except ImportError as exc:
            info["horovod_error"] = f"Horovod is not installed here ({exc}); run `make horovod`."
    info["setup_s"] = round(time.perf_counter() - t0, 3)
    return info


def teardown() -> None:
    """Let go of Horovod and torch.distributed so the engine can exit promptly on stop."""
    import sys

    if "horovod.torch" in sys.modules:
        try:
            import horovod.torch as hvd

            if hvd.is_initialized():
                hvd.shutdown()
        except Exception as exc:
            log.warning("Horovod did not shut down cleanly: %s", exc)
    if "torch.distributed" in sys.modules:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            log.warning("torch.distributed did not shut down cleanly: %s", exc)
