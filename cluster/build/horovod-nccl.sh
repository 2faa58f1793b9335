#!/usr/bin/env bash
# Horovod for GPU nodes whose collectives run over NCCL (NVLink inside a node, InfiniBand or
# RoCE between nodes). A thin wrapper: it finds CUDA and NCCL, sets Horovod's build variables
# and calls horovod.sh, which builds (once, the wheel is kept) and installs.
#
#   module load cuda/12.6                                 # nvcc of torch's CUDA major (12 for cu126)
#   PYTHON=$HOME/hpdl/.venv/bin/python cluster/build/horovod-nccl.sh
#   # or name the folders yourself (a site NCCL instead of torch's):
#   NCCL_HOME=/opt/nccl CUDA_HOME=/usr/local/cuda PYTHON=... cluster/build/horovod-nccl.sh
#
# Needs: a CUDA build of torch in $PYTHON's environment, nvcc, NCCL (include/nccl.h and
# lib/libnccl.so; by default torch's own nvidia-nccl wheel, the NCCL the ranks load at run time).
# Variables you may set: NCCL_HOME (or HOROVOD_NCCL_HOME: a site NCCL instead), CUDA_HOME,
# HOROVOD_BUILD_CUDA_CC_LIST (default: the GPUs seen by nvidia-smi, else those of 70,80,90 nvcc supports),
# HOROVOD_NCCL_LINK (SHARED by default). See cluster/build/README.md.
case "${1:-}" in -h|--help) sed -n '2,/^[^#]/s/^# \{0,1\}//p' "${BASH_SOURCE[0]}"; exit 0 ;; esac  # the comment above
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
# Without GPUs to ask (a login node): V100 (70), A100 (80) and H100 (90), keeping only those this
# nvcc can build for (CUDA 13 dropped 70; it stops the whole build with "Unsupported gpu architecture").
default_ccs() {
  local have out="" cc
  have=" $("$1" --list-gpu-arch 2>/dev/null | sed -n 's/^compute_//p' | tr '\n' ' ')"
  for cc in 70 80 90; do
    case "$have" in *" $cc "*) out="${out:+$out,}$cc" ;; esac
  done
  echo "${out:-80,90}"
}
die() { echo "horovod-nccl: $*" >&2; exit 1; }

if "$PYTHON" -c "import horovod.torch as h" 2>/dev/null; then
  if "$PYTHON" -c "import sys, horovod.torch as h; sys.exit(0 if h.nccl_built() else 1)"; then
    echo "horovod-nccl: Horovod with NCCL is already installed for $PYTHON"; exit 0
  fi
  die "Horovod is installed for $PYTHON but without NCCL; remove it first: $PYTHON -m pip uninstall -y horovod"
fi

"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null \
  || die "the torch in $PYTHON's environment is a CPU build; install a CUDA build of torch first."

nvcc="$(command -v nvcc || true)"
cuda_home="${HOROVOD_CUDA_HOME:-${CUDA_HOME:-${CUDA_PATH:-}}}"
if [ -z "$cuda_home" ] && [ -n "$nvcc" ]; then cuda_home="$(dirname "$(dirname "$nvcc")")"; fi
[ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ] || die "no CUDA toolkit found: module load cuda, or set CUDA_HOME."

nccl_home="${HOROVOD_NCCL_HOME:-${NCCL_HOME:-${NCCL_ROOT:-${NCCL_DIR:-}}}}"
if [ -z "$nccl_home" ]; then
  # torch's own NCCL (the nvidia-nccl-cu12/-cu13 wheel it depends on): the library the ranks load at
  # run time whatever Horovod was built against, so building against it needs no NCCL module at all.
  # Its lib/ holds only libnccl.so.2: link it as libnccl.so in a folder of our own.
  torch_nccl="$("$PYTHON" -c "import os, nvidia.nccl as n; print(os.path.dirname(n.__file__) if n.__file__ else list(n.__path__)[0])" 2>/dev/null || true)"
  if [ -n "$torch_nccl" ] && [ -f "$torch_nccl/include/nccl.h" ] && [ -e "$torch_nccl/lib/libnccl.so.2" ]; then
    nccl_home="${XDG_CACHE_HOME:-$HOME/.cache}/hpdl/nccl-from-torch/$(echo "$torch_nccl" | cksum | cut -d' ' -f1)"
    mkdir -p "$nccl_home/lib"
    ln -sfn "$torch_nccl/include" "$nccl_home/include"
    ln -sf "$torch_nccl/lib/libnccl.so.2" "$nccl_home/lib/libnccl.so"
    echo "horovod-nccl: building against torch's own NCCL ($torch_nccl)"
  fi
fi
if [ -z "$nccl_home" ]; then
  for d in "$cuda_home" /usr /usr/local; do
    if [ -f "$d/include/nccl.h" ]; then nccl_home="$d"; break; fi
  done
fi
[ -n "$nccl_home" ] && [ -f "$nccl_home/include/nccl.h" ] \
  || die "no NCCL found (include/nccl.h): module load nccl, or set NCCL_HOME."
ls "$nccl_home"/lib*/libnccl.so >/dev/null 2>&1 \
  || die "$nccl_home has no lib/libnccl.so (only a versioned libnccl.so.2?): link it as libnccl.so in a folder of your own."

if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
  caps="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | paste -sd, - || true)"
  HOROVOD_BUILD_CUDA_CC_LIST="${caps:-$(default_ccs "$cuda_home/bin/nvcc")}"
fi

export HOROVOD_GPU_OPERATIONS=NCCL
export HOROVOD_NCCL_HOME="$nccl_home" HOROVOD_NCCL_LINK="${HOROVOD_NCCL_LINK:-SHARED}"
export HOROVOD_CUDA_HOME="$cuda_home" HOROVOD_BUILD_CUDA_CC_LIST
export PATH="$cuda_home/bin:$PATH"
echo "horovod-nccl: CUDA $cuda_home, NCCL $nccl_home, compute capabilities $HOROVOD_BUILD_CUDA_CC_LIST"
PYTHON="$PYTHON" "$here/horovod.sh" "$@"
"$PYTHON" -c "import sys, horovod.torch as h; print('horovod-nccl: NCCL built:', bool(h.nccl_built())); sys.exit(0 if h.nccl_built() else 1)"
