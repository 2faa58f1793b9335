"""The CUDA side of the Horovod build through cluster/build/cxx17, without a GPU.

Horovod 0.28.1 makes the C++ compiler nvcc's host compiler, so our compiler front is called by
nvcc too. Here a real nvcc (PyPI's `nvidia-cuda-nvcc`, CUDA 13) and NCCL's headers (`nvidia-nccl-cu13`)
live in a scratch environment kept under ~/.cache/hpdl/cuda-build (never the project's venv);
CMake configures Horovod 0.28.1 for HOROVOD_GPU_OPERATIONS=NCCL and =MPI with CXX=cxx17 and
compiles its CUDA kernels for sm_80/sm_90. No GPU is needed to compile.

    flock /tmp/hpdl-mpi.lock .venv/bin/python -m pytest tests/test_build_cuda.py -q
"""
from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CXX17 = ROOT / "cluster" / "build" / "cxx17"
SCRATCH = Path(os.environ.get("HPDL_CUDA_SCRATCH", Path.home() / ".cache" / "hpdl" / "cuda-build"))
HOROVOD = "0.28.1"
# CUDA 13.0 from PyPI: only the unsuffixed 13.x `nvidia-cuda-nvcc` wheels carry nvcc itself
# (the -cu12 ones hold ptxas alone); nvvm, crt and the runtime are its own dependencies.
WHEELS = ["cmake", "nvidia-cuda-nvcc==13.0.88", "nvidia-nvvm==13.0.88", "nvidia-cuda-crt==13.0.88",
          "nvidia-cuda-runtime==13.0.96", "nvidia-cuda-cccl==13.0.85", "nvidia-nccl-cu13==2.27.7"]


def _fake_compiler(tmp_path: Path) -> Path:
    """A 'g++' that prints the arguments it was given, one per line."""
    fake = tmp_path / "fake-gxx"
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    return fake


def _front(tmp_path: Path, *args: str) -> list[str]:
    env = dict(os.environ, HPDL_REAL_CXX=str(_fake_compiler(tmp_path)))
    out = subprocess.run([str(CXX17), *args], env=env, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


@pytest.mark.parametrize("args", [
    # nvcc identifying its host compiler, preprocessing a .cu, compiling cudafe++'s host code, linking
    ["-E", "/tmp/tmpxft_00003cc3_00000000-2.cpp"],
    ["-D__CUDA_ARCH_LIST__=800", "-E", "-x", "c++", "-D__CUDACC__", "-D__NVCC__", "k.cu", "-o", "k.ii"],
    ["-D__CUDA_ARCH_LIST__=800", "-c", "-x", "c++", "-std=c++11", "tmp/k.cudafe1.cpp", "-o", "k.o"],
    ["-c", "-x", "c++", "-DFATBINFILE=\"a_dlink.fatbin.c\"", "crt/link.stub", "-o", "a_dlink.o"],
    # a preprocessor query and a link: nothing to adjust
    ["-dM", "-E", "-x", "c++", "/dev/null"],
    ["-std=c++14", "a.o", "b.o", "-o", "libx.so"],
])
def test_nvcc_and_non_compile_calls_pass_through_untouched(tmp_path, args):
    assert _front(tmp_path, *args) == args


def test_real_cxx_compilations_get_cxx17_and_the_includes(tmp_path):
    seen = _front(tmp_path, "-fPIC", "-std=c++14", "-c", "horovod/common/operations.cc", "-o", "op.o")
    assert seen == ["-include", "stdexcept", "-include", "string",
                    "-fPIC", "-std=c++17", "-c", "horovod/common/operations.cc", "-o", "op.o"]


# -- the real thing: nvcc + CMake + Horovod's sources ---------------------------------------------

def _pip_install(venv: Path) -> str:
    """'' when the scratch environment has nvcc and NCCL; else why not (the test is then skipped)."""
    nv = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "nvidia"
    if (nv / "cu13" / "bin" / "nvcc").exists() and (nv / "nccl" / "include" / "nccl.h").exists():
        return ""
    if not (venv / "bin" / "python").exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *WHEELS],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        lines = [s for s in (r.stderr or r.stdout).splitlines() if s.strip() and not s.startswith("WARNING")]
        return "cannot install the CUDA wheels: " + (lines[-1] if lines else f"pip exit code {r.returncode}")
    return ""


@pytest.fixture(scope="module")
def cuda_tree():
    """(CUDA home, NCCL home, Horovod source, cmake): built once, kept in SCRATCH."""
    SCRATCH.mkdir(parents=True, exist_ok=True)
    venv = SCRATCH / "venv"
    why = _pip_install(venv)
    if why:
        pytest.skip(why)
    nv = venv / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages" / "nvidia"
    cuda = nv / "cu13"
    # The wheels lay CUDA out as lib/ with versioned names; CMake and nvcc's link step look in
    # lib64/ and for libcudart.so. Adjust only the scratch copy.
    if not (cuda / "lib64").exists():
        (cuda / "lib64").symlink_to("lib")
    if not (cuda / "lib" / "libcudart.so").exists():
        (cuda / "lib" / "libcudart.so").symlink_to("libcudart.so.13")
    # NCCL as cluster/build/README.md describes: include/ and lib/libnccl.so in a folder of one's own
    nccl = SCRATCH / "nccl-home"
    (nccl / "lib").mkdir(parents=True, exist_ok=True)
    for link, target in ((nccl / "include", nv / "nccl" / "include"),
                         (nccl / "lib" / "libnccl.so", nv / "nccl" / "lib" / "libnccl.so.2")):
        if not link.exists():
            link.symlink_to(target)
    src = SCRATCH / f"horovod-{HOROVOD}"
    if not (src / "CMakeLists.txt").exists():
        r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
                            f"horovod=={HOROVOD}", "-d", str(SCRATCH / "sdist")], capture_output=True, text=True)
        if r.returncode:
            pytest.skip(f"cannot download Horovod {HOROVOD}'s source: {r.stderr.strip().splitlines()[-1:]}")
        with tarfile.open(SCRATCH / "sdist" / f"horovod-{HOROVOD}.tar.gz") as tar:
            tar.extractall(SCRATCH, filter="data")
    return cuda, nccl, src, venv / "bin" / "cmake"


@pytest.mark.slow
@pytest.mark.parametrize("ops", ["NCCL", "MPI"])
def test_horovod_cuda_configure_and_kernels_compile_through_cxx17(cuda_tree, ops, tmp_path):
    cuda, nccl, src, cmake = cuda_tree
    env = dict(
        os.environ,
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # mpicc of the kit's MPI
        CXX=str(CXX17), HPDL_REAL_CXX="g++", CMAKE_POLICY_VERSION_MINIMUM="3.5",
        HOROVOD_CUDA_HOME=str(cuda), HOROVOD_GPU_OPERATIONS=ops, HOROVOD_BUILD_CUDA_CC_LIST="80,90",
        HOROVOD_NCCL_HOME=str(nccl), HOROVOD_NCCL_LINK="SHARED", HOROVOD_WITH_MPI="1",
        HOROVOD_WITHOUT_PYTORCH="1", HOROVOD_WITHOUT_TENSORFLOW="1", HOROVOD_WITHOUT_MXNET="1",
    )
    build = tmp_path / "build"
    r = subprocess.run([str(cmake), "-S", str(src), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                        f"-DPYTHON_EXECUTABLE={sys.executable}"], env=env, capture_output=True, text=True, timeout=300)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-4000:]
    assert "The CUDA compiler identification is NVIDIA 13.0" in log
    assert "-gencode arch=compute_80,code=sm_80" in log  # the architectures we asked for reach nvcc
    if ops == "NCCL":
        assert "Found NCCL (include:" in log
    else:
        assert "Found NCCL" not in log and "Found MPI_CXX" in log

    r = subprocess.run([str(cmake), "--build", str(build), "--target", "horovod_cuda_kernels", "--", "-j1"],
                       env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    lib = build / "horovod" / "common" / "ops" / "cuda" / "libhorovod_cuda_kernels.a"
    symbols = subprocess.run(["nm", "-C", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "horovod::common::BatchedD2DMemcpyCudaImpl" in symbols
