"""cluster/build/horovod.sh keeps each Horovod wheel under a key: a GPU wheel must not be reused for
another CUDA version, other compute capabilities (an sm_80 wheel has no kernels for an H100) or
another NCCL. The key is computed by the script's own Python lines, run here as the script runs them."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def key(tmp_path: Path, **env: str) -> str:
    text = (ROOT / "cluster" / "build" / "horovod.sh").read_text()
    code = re.search(r"key=\$\(\"\$PYTHON\" - <<'PY'\n(.*?)\nPY\n\)", text, re.S).group(1)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HOROVOD_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**clean, **env},
                       timeout=120)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip()


def test_gpu_wheels_are_kept_per_cuda_capabilities_and_nccl(tmp_path):
    nccl = tmp_path / "nccl"
    (nccl / "include").mkdir(parents=True)
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 21\n#define NCCL_PATCH 5\n")
    cpu = key(tmp_path)
    assert cpu.endswith("-cpu") and "cuda" not in cpu  # the CPU key is unchanged: kept wheels stay found
    a100 = key(tmp_path, HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_NCCL_HOME=str(nccl), HOROVOD_BUILD_CUDA_CC_LIST="80")
    h100 = key(tmp_path, HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_NCCL_HOME=str(nccl), HOROVOD_BUILD_CUDA_CC_LIST="90")
    assert a100.endswith("-sm80-nccl2.21.5") and h100.endswith("-sm90-nccl2.21.5")
    (nccl / "include" / "nccl.h").write_text("#define NCCL_MAJOR 2\n#define NCCL_MINOR 27\n#define NCCL_PATCH 3\n")
    newer = key(tmp_path, HOROVOD_GPU_OPERATIONS="NCCL", HOROVOD_NCCL_HOME=str(nccl), HOROVOD_BUILD_CUDA_CC_LIST="80")
    assert len({cpu, a100, h100, newer}) == 4 and "-cuda" in a100
