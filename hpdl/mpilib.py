"""Which MPI library this process really loaded, and whether it is CUDA-aware.

Why: on a cluster the MPI a rank runs is decided late (LD_PRELOAD, LD_LIBRARY_PATH, mpi4py's
own search, MPI4PY_LIBMPI), and a wrong one is silent: the ranks run the `mpich` wheel (not
CUDA-aware) while the notebook says MVAPICH2-GDR. So each rank reports the library file the
kernel mapped (/proc/self/maps) and what that library says about CUDA, and `hpdl doctor` shows
the same report. Horovod's `cuda_built()` says nothing about this: it is how Horovod was compiled.
"""
from __future__ import annotations

import ctypes
import logging
import os
from typing import Mapping

log = logging.getLogger(__name__)

# name -> ABI family. MPICH, Intel MPI, MVAPICH2 and Cray MPICH share the MPICH ABI (libmpi.so.12):
# code built against one runs on the others, and Hydra, mpirun_rsh or srun can start any of them.
# Open MPI has its own ABI (libmpi.so.40) and its own launcher (prterun behind mpiexec).
IMPLEMENTATIONS = {"MPICH": "MPICH", "Intel MPI": "MPICH", "MVAPICH2": "MPICH", "Cray MPICH": "MPICH",
                   "Open MPI": "Open MPI"}


def implementation(text: str) -> str:
    """Which MPI a version text names: `MPI.Get_library_version()` or `mpiexec --version` output.

    One of IMPLEMENTATIONS' names, or "unknown". Pure, so it is tested on texts of MPIs this
    machine does not have (MVAPICH2, Cray MPICH).
    """
    t = text.upper()
    if "OPEN MPI" in t or "OPENRTE" in t or "PRTE" in t.replace("-", " ").split() or "OPEN-MPI" in t:
        return "Open MPI"
    if "INTEL" in t and "MPI" in t:
        return "Intel MPI"
    if "MVAPICH" in t:
        return "MVAPICH2"
    if "CRAY" in t and "MPICH" in t:
        return "Cray MPICH"
    if "MPICH" in t or "HYDRA" in t:
        return "MPICH"
    return "unknown"


def abi(name: str) -> str:
    """The ABI family of an implementation name ("MPICH" or "Open MPI"; "unknown" if we cannot tell)."""
    return IMPLEMENTATIONS.get(name, "unknown")


def library_files(maps: str) -> list[str]:
    """The MPI library files (libmpi*.so*) in a /proc/PID/maps text, in load order, once each."""
    seen: list[str] = []
    for line in maps.splitlines():
        parts = line.split()
        path = parts[-1] if len(parts) >= 6 else ""
        if path.startswith("/") and os.path.basename(path).startswith("libmpi") and path not in seen:
            seen.append(path)
    return seen


def _query_cuda(path: str) -> bool | None:
    """MPIX_Query_cuda_support() of an already loaded library (MPICH >= 4, Open MPI); None if absent."""
    try:
        fn = ctypes.CDLL(path).MPIX_Query_cuda_support
    except (OSError, AttributeError):
        return None
    fn.restype = ctypes.c_int
    return bool(fn())


def links_cuda(path: str, limit: int = 256 * 2**20) -> bool:
    """Whether a library file names the CUDA runtime among what it needs (libcudart/libcuda in
    its dynamic string table): how a CUDA build of MVAPICH2, which has no MPIX_Query_cuda_support
    in 2.3.x, shows itself without a GPU."""
    try:
        with open(path, "rb") as f:
            data = f.read(limit)
    except OSError:
        return False
    return b"libcudart.so" in data or b"libcuda.so" in data


def _mvapich2_cuda_build(text: str, files: list[str]) -> bool:
    """MVAPICH2's own words (`MVAPICH2 configure : ... --enable-cuda ...`, or a GDR release's name),
    else the library file linking the CUDA runtime."""
    configure = next((line for line in text.splitlines() if "configure" in line.lower()), "")
    if "GDR" in text.upper() or "--enable-cuda" in configure or "--with-cuda" in configure:
        return True
    return any(links_cuda(f) for f in files)


def cuda_awareness(library_version: str, query: bool | None, env: Mapping[str, str],
                   files: list[str] = ()) -> tuple[bool | None, str]:
    """(CUDA-aware?, how we know) from the library's own answer, else what MVAPICH2 says of its build.

    MVAPICH2 prints "MVAPICH2 Version :\t2.3.5", then its release date, device and configure line
    (MPI_Get_library_version; 2.3.x has no MPIX_Query_cuda_support): a CUDA build (configure line,
    a GDR release, or libmpi linking libcudart) is CUDA-aware when MV2_USE_CUDA=1 at run time.
    None means unknown (say so rather than guess).
    """
    if query is not None:
        return query, "MPIX_Query_cuda_support()"
    if "MVAPICH" in library_version.upper():
        if not _mvapich2_cuda_build(library_version, list(files)):
            return False, "MVAPICH2 built without CUDA (its configure line; libmpi links no libcudart)"
        on = env.get("MV2_USE_CUDA") == "1"
        return on, f"MVAPICH2 built with CUDA, MV2_USE_CUDA={env.get('MV2_USE_CUDA', '(unset)')}"
    return None, ""


def loaded(env: Mapping[str, str] | None = None) -> dict:
    """This process's MPI library: {"files", "library_version", "cuda_aware", "how"}.

    Call after `from mpi4py import MPI` has started MPI (that loads the library; MPICH answers
    the CUDA question only once MPI runs).
    """
    from mpi4py import MPI

    env = os.environ if env is None else env
    with open("/proc/self/maps") as f:
        files = library_files(f.read())
    version = MPI.Get_library_version().strip()
    query = None
    started = MPI.Is_initialized() and not MPI.Is_finalized()
    for path in files if started else ():  # MPICH aborts the process when asked before MPI_Init
        query = _query_cuda(path)
        if query is not None:
            break
    cuda, how = cuda_awareness(version, query, env, files)
    if cuda is None and not started:
        how = "ask after MPI has started"
    return {"files": files, "library_version": " ".join(version.splitlines()[0].split()) if version else "",
            "cuda_aware": cuda, "how": how}


def describe(report: dict) -> str:
    """One line: 'libmpi.so.12 at /path · CUDA-aware: no (MPIX_Query_cuda_support())'."""
    where = report["files"][0] if report["files"] else "(no libmpi mapped)"
    aware = {None: "unknown", True: "yes", False: "no"}[report["cuda_aware"]]
    return f"{where} · CUDA-aware: {aware}" + (f" ({report['how']})" if report["how"] else "")
