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
from typing import Any, Callable

from hpdl import mpilib, settings
from hpdl.sites import outward_address

log = logging.getLogger(__name__)


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


def _visible_gpus() -> tuple[list[str], bool]:
    """(identities of the CUDA devices torch can use here, torch is a CUDA build)."""
    import torch

    cuda_build = bool(torch.version.cuda)
    if not cuda_build or not torch.cuda.is_available():
        return [], cuda_build
    ids = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        ids.append(str(getattr(props, "uuid", "") or f"{getattr(props, 'pci_bus_id', '')}:{i}"))
    return ids, cuda_build


def place(allgather: Callable[[Any], list] | None = None, policy: str | None = None) -> tuple[Any, int, str]:
    """This rank's device and torch threads, decided with the other ranks (hpdl.devices' rules).

    A collective: `allgather` gathers one object from every rank (default: mpi4py's
    COMM_WORLD.allgather; Horovod jobs pass hvd.allgather_object). Returns (torch.device, threads,
    note); the note says why ranks run on the CPU although GPUs exist. With HPDL_DEVICE=cuda, a
    rank that cannot have a GPU of its own makes every rank raise HpdlError instead.
    """
    import torch

    from hpdl import devices
    from hpdl.errors import HpdlError

    if allgather is None:
        from mpi4py import MPI

        allgather = MPI.COMM_WORLD.allgather
    policy = policy or settings.DEVICE.get()
    visible, cuda_build = _visible_gpus()
    cores = frozenset(devices.usable_cores())
    me = (socket.gethostname(), os.getpid())
    everyone = allgather((me, visible, cores))
    node = [(who, seen, cs) for who, seen, cs in everyone if who[0] == me[0]]  # in rank order
    local_rank = [who for who, _, _ in node].index(me)
    node_visible, node_cores = [seen for _, seen, _ in node], [cs for _, _, cs in node]
    choice = devices.choose(local_rank, node_visible, cuda_build, devices.node_gpus(), policy)
    refusals = [r for r in allgather(choice.refuse) if r]
    if refusals:
        raise HpdlError(f"No GPU of its own for every rank: {refusals[0]} "
                        "(HPDL_DEVICE=auto runs on the CPU instead; HPDL_DEVICE=cpu says so on purpose.)")
    choice = devices.agree(allgather(choice.backend), choice)
    if choice.index is None:
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(choice.index)
        device = torch.device("cuda", choice.index)
    threads = devices.threads_for(cores, node_cores)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    return device, threads, choice.note


def _listening_socket(addr: str) -> socket.socket:
    """A TCP socket listening on `addr` only (a port the kernel picks), for rank 0's store."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((addr, 0))
    sock.listen(256)
    return sock


def init_torch_distributed(rank: int, world_size: int, device, timeout_s: float = 120.0) -> str:
    """Join a torch.distributed process group: NCCL on GPUs, Gloo on CPUs.

    Stock PyTorch wheels have no MPI backend, so MPI only does the rendezvous: rank 0 opens the
    group's key-value store (a TCPStore) on one address — the loopback when all ranks share a
    node, else this host's address — never on all interfaces, and broadcasts where it listens.
    """
    import datetime

    import torch.distributed as dist
    from mpi4py import MPI

    if dist.is_initialized():
        return dist.get_backend()
    comm = MPI.COMM_WORLD
    hosts = comm.allgather(socket.gethostname())
    one_node = len(set(hosts)) == 1
    timeout = datetime.timedelta(seconds=timeout_s)
    listener = None
    if comm.Get_rank() == 0:
        # across nodes, an address the others reach: not the 127.0.1.1 Debian's /etc/hosts gives our name
        addr = "127.0.0.1" if one_node else outward_address(socket.gethostname())
        listener = _listening_socket(addr)
        endpoint = (addr, listener.getsockname()[1])
    else:
        endpoint = None
    addr, port = comm.bcast(endpoint, root=0)
    if one_node:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = addr, str(port)
    if listener is not None:
        store = dist.TCPStore(addr, port, world_size, True, timeout, wait_for_workers=False,
                              master_listen_fd=listener.detach())
    else:
        store = dist.TCPStore(addr, port, world_size, False, timeout)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # device_id: NCCL binds the rank's GPU at once, instead of guessing it at the first collective
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    return backend


def _threads() -> set[int]:
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:  # not Linux: nothing to renice
        return set()


def _renice(threads: set[int], nice: int) -> None:
    for tid in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, nice)  # Linux: a thread id names one thread
        except OSError as exc:
            log.debug("could not renice thread %s: %s", tid, exc)


def init_horovod(device: Any = None) -> dict[str, Any]:
    """Start Horovod on this rank (MPI controller when built with MPI, else Gloo).

    Horovod's background thread meets the other ranks every cycle (HOROVOD_CYCLE_TIME, 1 ms) in
    an MPI_Allreduce, and MPICH waits in it by polling: ranks whose cycles are out of phase keep
    one of them polling most of the time, even with nothing to reduce. Measured here
    (benchmarks/horovod_idle.py, 2 ranks): an idle Horovod makes a torch cell 1.25x slower; at
    nice 10 its thread gives way (1.03x) but Horovod's own steps slow 1.6x, because it then starts
    each all-reduce late while backward computes. So the thread is left as it comes unless
    HPDL_HOROVOD_NICE asks otherwise (CPU ranks only; GPU ranks are never reniced).
    """
    import horovod.torch as hvd

    nice = settings.HOROVOD_NICE.get() if getattr(device, "type", "cpu") == "cpu" else 0
    before = _threads() if nice else set()
    hvd.init()
    if nice:
        _renice(_threads() - before, nice)
    return {
        "hvd_rank": hvd.rank(),
        "hvd_size": hvd.size(),
        "mpi_built": bool(hvd.mpi_built()),
        "gloo_built": bool(hvd.gloo_built()),
        "nccl_built": bool(hvd.nccl_built()),
    }


_answerer = None
_reporter = None


def _answer_hang_requests(run_dir: str, rank: int) -> bool:
    """Let the client ask where this rank is stuck (hpdl.hang), once per engine, and let the live
    panel (hpdl.watch) ask how it is, on the same thread. True when SIGUSR1 makes faulthandler dump
    the stack (else the client must not send it: it would kill)."""
    global _answerer, _reporter
    from hpdl import hang, watch

    if _answerer is None:
        _reporter = watch.Reporter(run_dir, rank)
        _answerer = hang.Answerer(run_dir, rank, on_tick=_reporter.tick)
        _answerer.start()
        try:
            _answerer.fault_file = hang.install_faulthandler(run_dir, rank)
        except (AttributeError, ValueError, OSError) as exc:  # no SIGUSR1 (not POSIX), or no file
            log.info("rank %s: no faulthandler fallback for stack dumps: %s", rank, exc)
    return _answerer.fault_file is not None


def setup(namespace: dict, run_dir: str | None = None,
          frameworks: tuple[str, ...] = ("torch", "horovod")) -> dict[str, Any]:
    """Everything a rank needs before the learner's first cell; names land in `namespace`.

    Returns a small report (rank, host, device, threads, the MPI library file actually loaded and
    whether it is CUDA-aware, timings) for the client to show.
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

        device, info["threads"], note = place(MPI.COMM_WORLD.allgather)
        info["device"] = str(device)
        if _reporter is not None and device.type == "cuda":
            _reporter.device_index = device.index  # the panel reads this GPU's memory
        if note:
            info["device_note"] = note
        namespace.update(torch=torch, device=device)
        if "torch" in frameworks:
            import torch.distributed as dist

            info["backend"] = init_torch_distributed(info["rank"], info["world_size"], device)
            namespace["dist"] = dist
    if "horovod" in frameworks:
        try:
            info.update(init_horovod(namespace.get("device")))
            import horovod.torch as hvd

            namespace["hvd"] = hvd
        except ImportError as exc:
            info["horovod_error"] = f"Horovod is not installed here ({exc}); run `make horovod`."
    # after Horovod: a Horovod built against another MPI maps a second libmpi, visible here
    info["mpi_library"] = mpilib.loaded()
    info["setup_s"] = round(time.perf_counter() - t0, 3)
    return info


def teardown() -> None:
    """Let go of Horovod and torch.distributed so the process can exit promptly and cleanly
    (engines on stop; scripts at their end).

    A DDP model holds its process group, and DDP's objects sit in reference cycles that only the
    garbage collector breaks: left to interpreter shutdown, a Gloo worker thread can drop its
    last tensor after Python has stopped, and the rank aborts ("terminate called without an
    active exception", seen under load). Collected first, the group really goes here."""
    import gc
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
                gc.collect()
                dist.destroy_process_group()
        except Exception as exc:
            log.warning("torch.distributed did not shut down cleanly: %s", exc)


def leave() -> None:
    """End this rank now and cleanly: MPI_Finalize, then exit without the interpreter's shutdown
    (hpdl.stop, after `teardown`, on every rank at once). MPI_Finalize is what removes the
    shared-memory segments between the ranks (also those of communicators freed before, which no
    map shows). A signal cannot promise it: inside a batch job, mpiexec's proxy follows its
    SIGTERM with SIGKILL a moment later, and a rank still in MPI_Finalize then leaves its segment
    in the node's RAM (seen with a PBS job). The exit is the C library's (procs.exit_finalized):
    MPICH's launcher kills the job when a rank ends without telling it, which its atexit does.
    Nothing is left in the interpreter to save once torch.distributed and Horovod have let go."""
    from hpdl import procs

    procs.exit_finalized(0)


def finish() -> None:
    """End a script's rank: `teardown`, then `leave` (MPI_Finalize, then exit without interpreter
    shutdown). A Gloo group that something still holds (a DeviceMesh, a model in a dict) keeps
    its worker threads past destroy_process_group; one that drops a finished collective's work
    while Python shuts down takes the GIL of a dead interpreter and aborts the rank ("terminate
    called without an active exception": 4 runs in 50 of the tensor-parallel test under load;
    torch's own open problem). Skipping the shutdown leaves that thread nothing to trip on."""
    teardown()
    leave()


def exit_on_term() -> None:
    """From now on SIGTERM ends this rank promptly, as `leave` does: for the ranks that a stop's
    `leave` did not reach. Left to ipyparallel's orderly exit, a rank spent 1.5–3 s in interpreter
    shutdown while the stop waited."""
    import signal

    def now(signum, frame) -> None:
        leave()

    try:
        signal.signal(signal.SIGTERM, now)
    except ValueError:  # not the main thread: the orderly exit, as before
        log.debug("SIGTERM handler not set: not in the main thread")
