"""cluster/README.md's CPU recipe as written: a wheelhouse built where the index is reachable, then the
kit installed from it with no network at all, `hpdl doctor` green and lesson 00 run on 4 ranks.

The install, the doctor and the lesson run inside a network namespace of their own (`unshare -n`, loopback
only: MPI and ipyparallel talk over it), so any download would fail. Stand-ins: a copy of this checkout
for `git clone <the kit>`, a `module` that only echoes, folders under tmp_path for the shared ones, the
CPU torch (2.13.0+cpu) that pip finds through PIP_FIND_LINKS on this machine, and Horovod's kept wheel
(~/.cache/hpdl/wheels), as on a second build. One expensive set-up, several checks.

    flock /tmp/hpdl-mpi.lock .venv/bin/python -m pytest tests/test_offline_install.py -q
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from test_cluster_recipe import _copy_kit, blocks

ROOT = Path(__file__).resolve().parents[1]
DEV_ONLY = ("pytest", "ruff", "playwright", "pytest-timeout")

# Run inside the namespace by the installed kit's Python: lesson 00 headless, then what the venv holds.
RUN_LESSON = textwrap.dedent("""
    import importlib.metadata as md, json, socket, sys
    import hpdl, nbformat, torch
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient
    try:
        socket.create_connection(("151.101.0.223", 443), timeout=5).close()  # pypi.org's address
        net = "reached the internet"
    except OSError as exc:
        net = f"no route out ({exc.strerror or exc})"
    path = sys.argv[1]
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": sys.argv[2]}},
                   allow_errors=False).execute()
    outputs = [o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    installed = {d.metadata["Name"].lower() for d in md.distributions()}
    kernel = KernelSpecManager().get_kernel_spec("python3").argv[0]
    print("RESULT " + json.dumps({"net": net, "hpdl": hpdl.__file__, "torch": torch.__version__, "kernel": kernel,
                                  "outputs": outputs, "installed": sorted(installed)}))
""")


def _can_unshare() -> str:
    """'' when this process may make a network namespace; else why not."""
    if os.geteuid() != 0:
        return "needs root for `unshare -n` (a network namespace with no route out)"
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "needs unshare (util-linux) and ip (iproute2)"
    p = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True, text=True)
    return "" if p.returncode == 0 else f"`unshare -n` is not allowed here: {p.stderr.strip()}"


def _scripts(kit_src: Path, wheels: Path, kit: Path) -> tuple[str, str]:
    """The README block split at its "with no network" comment: (build part, install part), each with the
    block's variables, and the stand-ins for the clone and the shared folders."""
    head = ["set -euo pipefail", 'module() { echo "(module $*: no module system here)"; }']
    online: list[str] = []
    offline: list[str] = []
    part = online
    for line in blocks("**CPU nodes**").splitlines():
        cmd = line.split("  #")[0].strip()
        if line.startswith("#"):
            part = offline if "with no network" in line else part
        elif cmd.startswith("WHEELS="):
            head.append(f"WHEELS={wheels} KIT={kit}  # stands in for: {cmd}")
        elif re.match(r"[A-Z_]+=\S+$", cmd):
            head.append(cmd)
        elif cmd.startswith("git clone"):
            part.append(f"cd {kit_src}  # stands in for: {cmd}")
        elif cmd:
            part.append(cmd)
    assert online and offline, "the README block lost its build / no-network split"
    return "\n".join(head + online), "\n".join(head + offline)


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_wheelhouse_installs_with_no_network_then_doctor_and_lesson_00(tmp_path, no_strays):
    why = _can_unshare()
    if why:
        pytest.skip(why)
    # the shared file system: a folder every user can enter (tmp_path is root's own), removed at the end
    shared = Path(tempfile.mkdtemp(prefix="hpdl-offline-", dir="/tmp"))
    shared.chmod(0o755)
    try:
        _build_install_run(tmp_path, shared)
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def _build_install_run(tmp_path: Path, shared: Path) -> None:
    kit_src, wheels, kit = tmp_path / "hpdl-src", shared / "hpdl-wheels", shared / "hpdl"
    _copy_kit(kit_src)
    build, install = _scripts(kit_src, wheels, kit)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHONPATH", "HPDL_SITE"))}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p != str(Path(sys.executable).parent))
    t0 = time.monotonic()
    p = subprocess.run(["bash", "-c", build], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=1500)
    t1 = time.monotonic()
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    manifest = json.loads((wheels / "MANIFEST.json").read_text())
    assert manifest["target"] == "cpu" and manifest["versions"]["torch"].endswith("+cpu"), manifest["versions"]
    assert {"mpich", "mpi4py", "horovod", "jupyterlab", "jupyterhub"} <= set(manifest["versions"])
    assert not set(DEV_ONLY) & set(manifest["versions"]), "the wheelhouse carries developer tools"
    assert set(manifest["files"]) == {f.name for f in wheels.iterdir()} - {"MANIFEST.json"}

    # Offline: the install, the doctor, then lesson 00 with the installed Python, in one namespace.
    runner = tmp_path / "run_lesson.py"
    runner.write_text(RUN_LESSON)
    env["HPDL_WORKSPACE"] = str(tmp_path / "workspace")
    offline = (f"ip link set lo up\n{install}\n"
               # the venv active, as the profiles' `setup` and jupyter.sbatch have it: `!hpdl exercises` finds hpdl
               f'PATH="$KIT/.venv/bin:$PATH" $KIT/.venv/bin/python {runner} $KIT/notebooks/00_welcome.ipynb '
               "$KIT/notebooks")
    p = subprocess.run(["unshare", "-n", "bash", "-c", offline], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1500)
    out = p.stdout + p.stderr
    print(f"wheelhouse built in {t1 - t0:.0f} s; offline: install, doctor, lesson 00 in {time.monotonic() - t1:.0f} s")
    assert p.returncode == 0, out[-5000:]
    assert "everything the kit needs is here." in p.stdout and " FAIL " not in p.stdout, out[-5000:]
    result = json.loads(re.search(r"^RESULT (.*)$", p.stdout, re.M).group(1))
    assert result["net"].startswith("no route out"), result["net"]
    assert result["hpdl"] == str(kit / "hpdl" / "__init__.py") and result["torch"].endswith("+cpu")
    assert result["kernel"].startswith(str(kit / ".venv")), result["kernel"]  # the lesson ran the installed kit
    text = "".join(result["outputs"])
    assert "rank 3 of 4" in text and re.search(r"by_horovod: \[10\.0, 10\.0, 10\.0, 10\.0\]", text), text[-2000:]
    # `!hpdl exercises` copied the installed kit's exercises into the learner's workspace
    assert any((tmp_path / "workspace").rglob("*.ipynb")), text[-2000:]
    assert not set(DEV_ONLY) & set(result["installed"]), "a learner's venv got developer tools"
    assert {"torch", "horovod", "mpi4py", "jupyterlab", "hpdl"} <= set(result["installed"])


def test_install_refuses_a_wheelhouse_it_cannot_trust_and_build_picks_torch_per_target(tmp_path):
    """Cheap: a hand-made wheelhouse of one file, and the build's choices, without building anything."""
    from hpdl import wheelhouse
    from hpdl.errors import HpdlError

    wheels = tmp_path / "wh"
    wheels.mkdir()
    (wheels / "a-1.0-py3-none-any.whl").write_bytes(b"not really a wheel")
    meta = {"python": "%d.%d" % sys.version_info[:2], "machine": os.uname().machine, "kit": "0", "target": "cpu",
            "needs": "-", "mpi": "kit", "files": {"a-1.0-py3-none-any.whl": {"sha256": "0" * 64}}}
    script = ROOT / "cluster" / "build" / "offline-install.sh"

    def install(*args: str, manifest: dict | None = meta) -> subprocess.CompletedProcess:
        if manifest is not None:
            (wheels / "MANIFEST.json").write_text(json.dumps(manifest))
        return subprocess.run(["bash", str(script), "--from", str(wheels), "--prefix", str(tmp_path / "kit"),
                               "--python", sys.executable, *args], capture_output=True, text=True, timeout=60)

    p = install()
    assert p.returncode == 2 and "a-1.0-py3-none-any.whl: damaged (sha256 differs)" in p.stderr, p.stderr
    p = install(manifest=dict(meta, files={"b-2.0-py3-none-any.whl": {"sha256": "0" * 64}}))
    assert p.returncode == 2 and "b-2.0-py3-none-any.whl: missing" in p.stderr and "rebuild" in p.stderr, p.stderr
    p = install(manifest=dict(meta, python="3.99"))
    assert p.returncode == 2 and "is for Python 3.99" in p.stderr and "--python" in p.stderr, p.stderr
    (wheels / "MANIFEST.json").unlink()
    p = install(manifest=None)
    assert p.returncode == 2 and "has no MANIFEST.json" in p.stderr, p.stderr
    assert not (tmp_path / "kit").exists()  # nothing made before the wheelhouse was judged

    cuda = wheelhouse.requirement_lines(wheelhouse.TARGETS["cuda12"], "site")
    assert "torch==2.13.0+cu126" in cuda and not [r for r in cuda if r.startswith(("mpich", "mpi4py"))]
    cpu = wheelhouse.requirement_lines(wheelhouse.TARGETS["cpu"], "kit")
    assert "torch==2.13.0+cpu" in cpu and "mpich==5.0.2" in cpu and not [r for r in cpu if "pytest" in r]
    with pytest.raises(HpdlError, match="holds no MANIFEST.json"):
        wheelhouse.build("cpu", tmp_path, index="")  # tmp_path is not empty: never someone's folder
    with pytest.raises(HpdlError, match="does not go with --target cpu"):
        wheelhouse.build("cpu", tmp_path / "new", gpu_ops="nccl", index="")
