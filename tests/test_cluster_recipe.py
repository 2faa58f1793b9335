"""cluster/README.md's install recipes: the GPU one read against the site profiles here (no GPU to run it);
the CPU one runs as written, wheelhouse then offline install, in tests/test_offline_install.py, which
uses the helpers below.

    .venv/bin/python -m pytest tests/test_cluster_recipe.py -q
"""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "cluster" / "README.md"


def blocks(heading: str) -> str:
    """The first ```bash block after the paragraph starting with `heading`."""
    text = README.read_text()
    start = text.index(heading)
    m = re.search(r"```bash\n(.*?)```", text[start:], re.S)
    assert m, f"no bash block after {heading!r}"
    return m.group(1)


def commands(block: str) -> list[str]:
    return [line.split("  #")[0].strip() for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_gpu_recipe_builds_with_the_profiles_build_modules_and_installs_offline():
    from hpdl import sites

    cmds = commands(blocks("**GPU nodes**"))
    load = next(c for c in cmds if c.startswith("module load"))
    build = next(i for i, c in enumerate(cmds) if c.startswith("make wheelhouse"))
    install = next(i for i, c in enumerate(cmds) if "offline-install.sh" in c)
    assert cmds.index(load) < build < install and cmds[-1].endswith("hpdl doctor")
    assert "--target cuda12" in cmds[build] and "--mpi site" in cmds[build]
    # one CUDA/NCCL recipe: what the README loads to build is the NCCL profile's build_modules; the
    # ranks load the MPI only (torch's wheels bring CUDA and NCCL), never a CUDA or NCCL module
    nccl = sites.load_site(str(ROOT / "cluster" / "sites" / "nccl-gpu.toml"))
    assert load.split()[2:] == nccl.build_modules
    assert not [m for m in nccl.modules if m.startswith(("cuda", "nccl"))] and nccl.modules[0] in nccl.build_modules
    gdr = sites.load_site(str(ROOT / "cluster" / "sites" / "mvapich2-gdr.toml"))
    cuda = [m for m in nccl.build_modules if m.startswith("cuda/")]
    assert cuda and cuda[0] in gdr.build_modules and cuda[0] in gdr.modules  # MVAPICH2-GDR links its CUDA
    text = README.read_text() + (ROOT / "cluster" / "build" / "README.md").read_text()
    text += (ROOT / "docs" / "LAUNCHERS.md").read_text() + (ROOT / "benchmarks" / "synthetic.sbatch").read_text()
    assert "cu124" not in text and "cuda/12.4" not in text and "nccl/2.21" not in text


def _copy_kit(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
