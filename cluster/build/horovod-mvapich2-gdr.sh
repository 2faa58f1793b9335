#!/usr/bin/env bash
# Horovod for GPU nodes with MVAPICH2-GDR: GPU tensors are reduced by MVAPICH2-GDR's CUDA-aware
# MPI_Allreduce (HOROVOD_GPU_OPERATIONS=MPI), not by NCCL. A thin wrapper: it checks CUDA and
# MVAPICH2-GDR, sets Horovod's build variables and calls horovod.sh.
#
#   module load cuda/12.6 mvapich2-gdr/2.3.7               # or: MV2_PATH=/opt/mvapich2-gdr/...
#   PYTHON=$HOME/hpdl/.venv/bin/python cluster/build/horovod-mvapich2-gdr.sh
#
# Horovod compiles against the MPI beside $PYTHON when there is one (the kit's `mpich` wheel:
# MPICH's ABI, which MVAPICH2-GDR shares) and otherwise against the mpicc on PATH. Either way it
# runs over MVAPICH2-GDR's library, loaded first with LD_PRELOAD; the run settings are printed
# at the end and explained in cluster/build/README.md.
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
die() { echo "horovod-mvapich2-gdr: $*" >&2; exit 1; }

mv2="${MV2_PATH:-}"   # MVAPICH2-GDR's folder: the one name the kit uses (its user guide's too)
if [ -z "$mv2" ] && command -v mpiname >/dev/null; then mv2="$(dirname "$(dirname "$(command -v mpiname)")")"; fi
[ -n "$mv2" ] || die "no MVAPICH2-GDR found: module load mvapich2-gdr, or set MV2_PATH to its folder."
lib="$(ls "$mv2"/lib64/libmpi.so "$mv2"/lib/libmpi.so 2>/dev/null | head -n1 || true)"
[ -n "$lib" ] || die "$mv2 has no lib64/libmpi.so: is MV2_PATH the MVAPICH2-GDR installation folder?"
if [ -x "$mv2/bin/mpiname" ] && ! "$mv2/bin/mpiname" -a 2>/dev/null | grep -qi "gdr\|cuda"; then
  echo "horovod-mvapich2-gdr: warning: $("$mv2/bin/mpiname" -a 2>/dev/null | head -n1) does not say GDR/CUDA;" \
       "a plain MVAPICH2 cannot reduce GPU memory." >&2
fi

if "$PYTHON" -c "import horovod.torch as h" 2>/dev/null; then
  # cuda_built() says how Horovod was compiled, not that the MPI is CUDA-aware: that is checked below
  if "$PYTHON" -c "import sys, horovod.torch as h; sys.exit(0 if h.cuda_built() and h.mpi_built() and not h.nccl_built() else 1)"; then
    echo "horovod-mvapich2-gdr: Horovod built with CUDA and MPI (no NCCL) is already installed for $PYTHON"
  else
    die "a different Horovod build is installed for $PYTHON; remove it first: $PYTHON -m pip uninstall -y horovod"
  fi
else
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null \
    || die "the torch in $PYTHON's environment is a CPU build; install a CUDA build of torch first."
  cuda_home="${HOROVOD_CUDA_HOME:-${CUDA_HOME:-${CUDA_PATH:-}}}"
  if [ -z "$cuda_home" ] && command -v nvcc >/dev/null; then cuda_home="$(dirname "$(dirname "$(command -v nvcc)")")"; fi
  [ -n "$cuda_home" ] && [ -x "$cuda_home/bin/nvcc" ] || die "no CUDA toolkit found: module load cuda, or set CUDA_HOME."
  if [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
    caps="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | sort -u | paste -sd, - || true)"
    HOROVOD_BUILD_CUDA_CC_LIST="${caps:-$(default_ccs "$cuda_home/bin/nvcc")}"
  fi
  export HOROVOD_GPU_OPERATIONS=MPI
  export HOROVOD_CUDA_HOME="$cuda_home" HOROVOD_BUILD_CUDA_CC_LIST
  export PATH="$cuda_home/bin:$PATH:$mv2/bin"   # mpicc from MVAPICH2-GDR if none sits beside Python
  echo "horovod-mvapich2-gdr: CUDA $cuda_home, MVAPICH2-GDR $mv2, compute capabilities $HOROVOD_BUILD_CUDA_CC_LIST"
  PYTHON="$PYTHON" "$here/horovod.sh" "$@"
fi

# Is the MPI the ranks will load CUDA-aware? Ask the library itself, loaded as the jobs will load it.
aware="$(LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}" MV2_USE_CUDA=1 MV2_SUPPORT_DL=1 MV2_ENABLE_AFFINITY=0 \
  "$PYTHON" -c "from mpi4py import MPI; from hpdl import mpilib; print(mpilib.describe(mpilib.loaded()))" 2>&1 | tail -n1 || true)"
echo "horovod-mvapich2-gdr: with MVAPICH2-GDR preloaded, the MPI library: $aware"
case "$aware" in
  *"$mv2"*"CUDA-aware: yes"*) ;;
  *) echo "horovod-mvapich2-gdr: warning: that is not MVAPICH2-GDR with CUDA: GPU tensors need a CUDA-aware MPI" >&2 ;;
esac

cat <<RUN
horovod-mvapich2-gdr: run jobs with (cluster/sites/mvapich2-gdr.toml sets these for hpdl.start):
  export LD_PRELOAD=$lib\${LD_PRELOAD:+:\$LD_PRELOAD}
  export MV2_USE_CUDA=1 MV2_SUPPORT_DL=1 MV2_ENABLE_AFFINITY=0
  srun --mpi=pmi2 python benchmarks/synthetic.py --framework horovod --model resnet50
RUN
