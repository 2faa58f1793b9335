"""cluster/README.md's install recipe, executed as written in a fresh venv, ends with `hpdl doctor` green.

Stand-ins: a copy of this checkout for `git clone <the kit>`, a `module` that only echoes (no
module system here), the `mpich` wheel for the site's MPI, and the CPU torch (2.13.0+cpu) from
the pip cache. Horovod comes from the kept wheel (~/.cache/hpdl/wheels), as on a second install.

    flock /tmp/hpdl-mpi.lock .venv/bin/python -m pytest tests/test_cluster_recipe.py -q
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

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


def test_gpu_recipe_removes_mpich_only_after_the_requirements_that_install_it():
    cmds = commands(blocks("**GPU nodes**"))
    req = next(i for i, c in enumerate(cmds) if "install -r requirements.txt" in c)
    uninstall = next(i for i, c in enumerate(cmds) if "uninstall -y mpich" in c)
    rebuild = next(i for i, c in enumerate(cmds) if "--no-binary mpi4py" in c)
    assert req < uninstall < rebuild
    torch = next(c for c in cmds if "install torch" in c)
    assert "torch==2.13.0" in torch and "cu124" not in README.read_text()
    assert any("horovod-nccl.sh" in c for c in cmds) and cmds[-1].endswith("hpdl doctor")


def _copy_kit(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\0")
    for rel in filter(None, files):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_cpu_recipe_runs_as_written_and_doctor_is_green(tmp_path, no_strays):
    kit = tmp_path / "hpdl"
    _copy_kit(kit)
    lines = []
    for cmd in commands(blocks("**pip (a venv in the kit's folder)**")):
        if cmd.startswith("git clone"):
            lines.append(f"cd {kit}  # stands in for: {cmd}")
        else:
            lines.append(cmd)
    script = "set -euo pipefail\nmodule() { echo \"(module $*: no module system here)\"; }\n" + "\n".join(lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "HPDL_SITE"))}
    p = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=580)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-4000:]
    assert (kit / ".venv" / "bin" / "hpdl").exists()
    assert "everything the kit needs is here." in p.stdout, out[-4000:]
    assert " FAIL " not in p.stdout
