"""`hpdl wheelhouse build`: every file a learner's kit needs, in one folder, for an install with no network.

Compute nodes rarely reach a package index. On a machine that does (a login node), this builds a
wheelhouse for one target; cluster/build/offline-install.sh then installs the kit from that folder
alone, with nothing but python3 (the kit is not installed yet when it runs):

    hpdl wheelhouse build --target cpu --out /shared/hpdl-wheels             # MPI from the mpich wheel
    module load cuda/12.6 openmpi/5.0                                         # the build modules
    hpdl wheelhouse build --target cuda12 --mpi site --out /shared/hpdl-wheels-gpu
    /shared/hpdl-wheels/offline-install.sh --prefix /opt/hpdl                 # on the shared file system

What goes in: the learner set of requirements.txt with torch from PyTorch's index for the target,
mpi4py (the PyPI wheel over the `mpich` wheel, or built against the site's `mpicc`), Horovod built for
that torch, MPI and GPU flavour (cluster/build/horovod*.sh, whose kept wheel is reused), the hub's
environment (cluster/jupyterhub/requirements.txt) resolved together with the kit's, its proxy
(configurable-http-proxy and its npm dependencies, packed), the kit's own tree, the install script,
and MANIFEST.json (target, versions, sha256 of every file), which the install checks first.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from hpdl.errors import HpdlError

ROOT = Path(__file__).resolve().parents[1]
BUILD = ROOT / "cluster" / "build"
HUB = ROOT / "cluster" / "jupyterhub"
MANIFEST = "MANIFEST.json"
INSTALLER = "offline-install.sh"
PIP_TIMEOUT = 3600.0  # s: a full resolution and download, or building mpi4py from source
HOROVOD_TIMEOUT = 5400.0  # s: a first Horovod build with CUDA kernels on a busy login node
NPM_TIMEOUT = 900.0


@dataclass(frozen=True)
class Target:
    """What a node needs to run one flavour of torch, and where pip finds that torch."""

    name: str
    local: str  # torch's local version label on PyTorch's index
    index: str
    needs: str


TARGETS = {
    "cpu": Target("cpu", "cpu", "https://download.pytorch.org/whl/cpu", "any node; no GPU is used"),
    "cuda12": Target("cuda12", "cu126", "https://download.pytorch.org/whl/cu126",
                     "CUDA 12.6 in torch's wheels: NVIDIA driver >= 525 (CUDA 12 minor-version compatibility; "
                     ">= 560 for all of 12.6); Horovod built with a CUDA 12.x nvcc"),
    "cuda13": Target("cuda13", "cu130", "https://download.pytorch.org/whl/cu130",
                     "CUDA 13.0 in torch's wheels: NVIDIA driver >= 580; Horovod built with a CUDA 13.x nvcc "
                     "(no V100: CUDA 13 dropped compute capability 7.0)"),
}
HOROVOD_VERSION = "0.28.1"  # as cluster/build/horovod.sh builds it
# what building Horovod imports from the learner set (horovod.sh adds its build tools itself)
BUILD_NEEDS = ("torch", "mpich", "mpi4py", "numpy", "cloudpickle", "psutil", "pyyaml", "packaging")
HOROVOD_SCRIPTS = {"cpu": "horovod.sh", "nccl": "horovod-nccl.sh", "mpi": "horovod-mvapich2-gdr.sh"}


def _run(cmd: list[str], what: str, timeout: float, env: dict[str, str] | None = None) -> str:
    """One step of the build as a side job; its output when it worked, else an error quoting its end."""
    from hpdl import sidejob

    print(f"hpdl wheelhouse: {what} ...", flush=True)
    done = sidejob.run(cmd, timeout, env=env, shared_memory=False)
    if done.timed_out:
        raise HpdlError(f"{what}: still running after {timeout:.0f} s, stopped. Its last output:\n"
                        + "\n".join(done.output.splitlines()[-20:]))
    if done.returncode:
        raise HpdlError(f"{what} failed (exit code {done.returncode}). Its last output:\n"
                        + "\n".join(done.output.splitlines()[-30:]))
    print(f"hpdl wheelhouse: {what}: done in {done.seconds:.0f} s", flush=True)
    return done.output


def requirement_lines(target: Target, mpi: str, path: Path = ROOT / "requirements.txt") -> list[str]:
    """The learner set for this target: torch with the target's local label; for the site's MPI,
    no `mpich` wheel and no mpi4py here (it is built against the site's mpicc apart)."""
    lines = []
    for raw in path.read_text().splitlines():
        line = raw.split("#")[0].strip()
        if not line or line.startswith("-"):
            continue
        name = re.split(r"[=<>!~\[ ;]", line, maxsplit=1)[0].lower()
        if name == "torch":
            version = line.split("==", 1)[1].split("+")[0].strip()
            line = f"torch=={version}+{target.local}"
        elif mpi == "site" and name in ("mpich", "mpi4py"):
            continue
        lines.append(line)
    return lines


def _pin(name: str, path: Path = ROOT / "requirements.txt") -> str:
    for line in path.read_text().splitlines():
        if line.lower().startswith(name + "=="):
            return line.split("#")[0].strip()
    raise HpdlError(f"{path} pins no {name}: it must (name==version).")


def _prepare_out(out: Path, target: str, mpi: str) -> None:
    """An empty folder, or an earlier wheelhouse of the same kind (emptied); never someone's folder."""
    if out.exists() and any(out.iterdir()):
        old = out / MANIFEST
        if not old.is_file():
            raise HpdlError(f"{out} is not empty and holds no {MANIFEST}: give --out a new or empty folder.")
        meta = json.loads(old.read_text())
        if (meta.get("target"), meta.get("mpi")) != (target, mpi):
            raise HpdlError(f"{out} is a wheelhouse for --target {meta.get('target')} --mpi {meta.get('mpi')}: "
                            "give another --out for this one.")
        for child in out.iterdir():
            shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
    out.mkdir(parents=True, exist_ok=True)


def torch_index(target: Target, index: str | None) -> str:
    """The index to give pip for torch: the target's (or --torch-index) when it answers from here. One
    that does not answer is left out with a note, not retried by pip for every package: torch is
    pinned with its label (2.13.0+cpu), so pip's own indexes and find-links can only supply that build."""
    import urllib.error
    import urllib.request

    url = target.index if index is None else index
    if not url:
        return ""
    try:
        with urllib.request.urlopen(url.rstrip("/") + "/torch/", timeout=20):
            return url
    except (urllib.error.URLError, OSError) as exc:
        print(f"hpdl wheelhouse: {url} does not answer from here ({getattr(exc, 'reason', exc)}); torch "
              f"{target.local} must come from pip's own indexes or find-links", flush=True)
        return ""


def pip_wheels(python: str, out: Path, target: Target, mpi: str, index: str, hub: bool) -> list[str]:
    """Every wheel of the learner set (and the hub's), resolved together; mpi4py built against the
    site's mpicc for --mpi site. Returns the requirement lines the install will ask for."""
    lines = requirement_lines(target, mpi)
    hub_lines = requirement_lines(target, mpi, HUB / "requirements.txt") if hub else []
    reqs = out / ".requirements.txt"
    reqs.write_text("\n".join(lines + hub_lines + ["setuptools>=64"]) + "\n")  # setuptools: the kit's install
    cmd = [python, "-m", "pip", "wheel", "-q", "--disable-pip-version-check", "-w", str(out), "-r", str(reqs)]
    if index:
        cmd += ["--extra-index-url", index]
    _run(cmd, f"wheels of the learner set{' and the hub' if hub else ''} (torch {target.local})", PIP_TIMEOUT)
    reqs.unlink()
    if mpi == "site":
        mpicc = shutil.which(os.environ.get("MPICC", "mpicc"))
        if not mpicc:
            raise HpdlError("--mpi site: no mpicc on PATH. Load the site's MPI module first (the profile's "
                            "build_modules), or set MPICC to its compiler wrapper.")
        pin = _pin("mpi4py")
        # --no-cache-dir: pip's cache keys a built sdist by its URL only, not by the MPI it was built against
        _run([python, "-m", "pip", "wheel", "-q", "--no-cache-dir", "--no-deps", "--no-binary", "mpi4py",
              "-w", str(out), pin], f"{pin} against {mpicc}", PIP_TIMEOUT, env=dict(os.environ, MPICC=mpicc))
        lines.append(pin)
    return lines


def check_complete(python: str, out: Path, lines: list[str], work: Path) -> None:
    """Resolve the learner set against the wheelhouse alone, as the offline install will (no install:
    --dry-run): a missing wheel is found here, where the index is still reachable."""
    reqs = work / "learner.txt"
    reqs.write_text("\n".join(lines) + "\n")
    _run([python, "-m", "pip", "install", "-q", "--dry-run", "--ignore-installed", "--no-index",
          "--find-links", str(out), "-r", str(reqs)], "the learner set resolves from the wheelhouse alone",
         PIP_TIMEOUT, env=dict(_offline_pip_env(), PIP_BREAK_SYSTEM_PACKAGES="1"))  # a dry run changes nothing


def kept_horovod(out: Path, gpu_ops: str, tag: dict) -> Path | None:
    """The Horovod wheel cluster/build/horovod.sh kept for this Python, torch and `mpich` wheel (its
    key), already relocated; None when there is none or the MPI is the site's (known only once loaded).
    A GPU build is always made afresh: its key also names the CUDA version, compute capabilities and
    NCCL it was compiled for (horovod.sh), which are known only inside the build."""
    from hpdl import settings

    versions = wheel_versions(out)
    if gpu_ops != "cpu" or "mpich" not in versions or "torch" not in versions:
        return None
    if settings.WHEELHOUSE.var in os.environ:
        cache = Path(str(settings.WHEELHOUSE.get())).expanduser()
    else:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hpdl" / "wheels"
    torch = re.sub(r"[^A-Za-z0-9.]+", "_", versions["torch"])
    key = f"py{tag['python'].replace('.', '')}-torch{torch}-MPICH{versions['mpich']}-{gpu_ops}"
    found = sorted((cache / key).glob(f"horovod-{HOROVOD_VERSION}-*.whl"))
    return found[0] if found and (cache / key / ".relocatable").exists() else None


def horovod_wheel(python: str, out: Path, lines: list[str], gpu_ops: str, tag: dict, work: Path) -> str:
    """Horovod for this target: the kept wheel when one matches, else built by cluster/build/horovod*.sh
    in a scratch venv holding what the build needs, installed from the wheelhouse alone."""
    kept = kept_horovod(out, gpu_ops, tag)
    if kept:
        shutil.copy2(kept, out / kept.name)
        print(f"hpdl wheelhouse: Horovod: the kept wheel {kept}", flush=True)
        return f"horovod=={HOROVOD_VERSION}"
    venv = work / "build-venv"
    _run([python, "-m", "venv", str(venv)], "a scratch venv for building Horovod", 600)
    vpy = str(venv / "bin" / "python")
    needs = [line for line in lines if line.split("=")[0].lower() in BUILD_NEEDS]
    _run([vpy, "-m", "pip", "install", "-q", "--no-index", "--find-links", str(out), *needs],
         "torch and MPI for the Horovod build, from the wheelhouse", PIP_TIMEOUT, env=_offline_pip_env())
    script = BUILD / HOROVOD_SCRIPTS[gpu_ops]
    _run(["bash", str(script), "--copy-to", str(out)], f"Horovod ({script.name})", HOROVOD_TIMEOUT,
         env=dict(os.environ, PYTHON=vpy))
    if not sorted(out.glob("horovod-*.whl")):
        raise HpdlError(f"{script.name} ran but left no horovod wheel in {out}.")
    return f"horovod=={HOROVOD_VERSION}"


def _offline_pip_env() -> dict[str, str]:
    """pip told nothing but the command line: no config file, no PIP_* (find-links, extra indexes)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def proxy_tarball(out: Path, work: Path) -> str | None:
    """configurable-http-proxy at the version cluster/jupyterhub/install.sh pins, with its npm
    dependencies, as a node_modules tree the hub host unpacks (plain JavaScript: any Node.js >= 18).
    None, and a note, when there is no npm here."""
    m = re.search(r"^CHP_VERSION=(\S+)", (HUB / "install.sh").read_text(), re.M)
    version = m.group(1) if m else "5.3.0"
    npm = shutil.which("npm")
    if not npm:
        print("hpdl wheelhouse: no npm here: the hub's proxy is not packed; the hub host then needs "
              f"`npm install configurable-http-proxy@{version}` (or this build run where npm is)", flush=True)
        return None
    prefix = work / "chp"
    _run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--loglevel=error",
          f"configurable-http-proxy@{version}"], f"configurable-http-proxy {version} (npm)", NPM_TIMEOUT)
    name = f"configurable-http-proxy-{version}-node_modules.tar.gz"
    with tarfile.open(out / name, "w:gz") as tar:
        tar.add(prefix / "node_modules", arcname="node_modules")
    return name


def kit_version() -> str:
    m = re.search(r'^version\s*=\s*"([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    return m.group(1) if m else "0"


def kit_files() -> list[str]:
    """The kit's files, relative: git's (tracked and not ignored) in a clone, else the tree without
    venvs, caches and dot-folders."""
    from hpdl import sidejob

    if (ROOT / ".git").exists() and shutil.which("git"):
        done = sidejob.run(["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           120, shared_memory=False, errors_apart=True)
        if done.returncode == 0:
            names = [n for n in done.output.split("\0") if n]
            return sorted(n for n in names if not n.startswith(".venv") and (ROOT / n).is_file()
                          and not (ROOT / n).is_symlink())
    found = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if path.is_file() and not path.is_symlink() and not any(
                part.startswith(".") or part in ("__pycache__", "workspace") or part.endswith(".egg-info")
                for part in rel.parts):
            found.append(rel.as_posix())
    return sorted(found)


def kit_tarball(out: Path) -> str:
    """The kit's own tree (code, notebooks, exercises, cluster/): what learners open, and what the
    kit's package finds beside itself (exercises/, requirements.txt); the install unpacks it."""
    name = f"hpdl-kit-{kit_version()}.tar.gz"
    with tarfile.open(out / name, "w:gz") as tar:
        for rel in kit_files():
            tar.add(ROOT / rel, arcname=rel, recursive=False)
    return name


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def wheel_versions(out: Path) -> dict[str, str]:
    """{distribution: version} of the wheels in `out` (from their file names, PEP 427)."""
    found = {}
    for whl in out.glob("*.whl"):
        name, version = whl.name.split("-")[:2]
        found[name.lower().replace("_", "-")] = version
    return dict(sorted(found.items()))


def write_manifest(out: Path, meta: dict) -> dict:
    """MANIFEST.json: what the wheelhouse is for, the versions in it, and every file's sha256."""
    files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
             for p in sorted(out.iterdir()) if p.is_file() and p.name != MANIFEST}
    meta = dict(meta, versions=wheel_versions(out), files=files)
    (out / MANIFEST).write_text(json.dumps(meta, indent=1) + "\n")
    return meta


def _python_tag(python: str) -> dict:
    """The interpreter the wheels are for: the install refuses another (cp311 wheels need a 3.11)."""
    from hpdl import sidejob

    code = ("import json, platform, sys, sysconfig; print(json.dumps({'python': '%d.%d' % sys.version_info[:2], "
            "'python_full': platform.python_version(), 'machine': platform.machine(), "
            "'platform': sysconfig.get_platform()}))")
    done = sidejob.run([python, "-c", code], 60, shared_memory=False, errors_apart=True)
    if done.returncode != 0:
        raise HpdlError(f"--python {python} does not run: {done.errors.strip()[-300:]}")
    return json.loads(done.output.strip().splitlines()[-1])


def build(target: str, out: Path, *, mpi: str = "kit", gpu_ops: str = "", index: str | None = None,
          python: str = sys.executable, hub: bool = True) -> dict:
    """Build the wheelhouse for `target` into `out`; returns its manifest."""
    spec = TARGETS[target]
    gpu_ops = gpu_ops or ("cpu" if target == "cpu" else "nccl")
    if (target == "cpu") != (gpu_ops == "cpu"):
        raise HpdlError(f"--gpu-ops {gpu_ops} does not go with --target {target}: "
                        "cpu targets build Horovod for the CPU; cuda targets with nccl or mpi.")
    out = out.expanduser().resolve()
    _prepare_out(out, target, mpi)
    index = torch_index(spec, index)
    started = time.monotonic()
    tag = _python_tag(python)
    with tempfile.TemporaryDirectory(prefix="hpdl-wheelhouse-") as tmp:
        work = Path(tmp)
        lines = pip_wheels(python, out, spec, mpi, index, hub)
        check_complete(python, out, lines, work)
        lines.append(horovod_wheel(python, out, lines, gpu_ops, tag, work))
        proxy = proxy_tarball(out, work) if hub else None
    kit = kit_tarball(out)
    shutil.copy2(BUILD / INSTALLER, out / INSTALLER)
    hub_lines = requirement_lines(spec, mpi, HUB / "requirements.txt") if hub else []
    meta = write_manifest(out, {
        "kit": kit_version(), "target": target, "needs": spec.needs, "mpi": mpi, "gpu_ops": gpu_ops,
        "torch_index": index or "(pip's own configuration)", **tag,
        "built": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "built_on": socket.gethostname(),
        "install": lines, "hub_install": hub_lines, "kit_tree": kit, "proxy": proxy})
    size = sum(f["bytes"] for f in meta["files"].values()) / 2**20
    print(f"hpdl wheelhouse: {out}: {len(meta['files'])} files, {size:.0f} MiB, for Python {tag['python']} on "
          f"{tag['platform']}, in {time.monotonic() - started:.0f} s.\n"
          f"  install with no network:  {out / INSTALLER} --prefix /path/for/the/kit")
    return meta


EPILOG = "targets (torch from PyTorch's index for each; --torch-index to use another, '' for pip's own settings):\n" + \
    "\n".join(f"  {t.name:<7} {t.index}\n          {t.needs}" for t in TARGETS.values())


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpdl wheelhouse", description=__doc__.split("\n\n")[0],
                                 epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="action", required=True)
    b = sub.add_parser("build", help="build a wheelhouse for one target (run where the package index is reachable)",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    b.add_argument("--target", required=True, choices=sorted(TARGETS), help="the torch flavour the nodes run")
    b.add_argument("--mpi", choices=("kit", "site"), default="kit",
                   help="kit: the `mpich` wheel (MPICH ABI; MVAPICH2, Intel MPI, Cray MPICH load in its place); "
                        "site: mpi4py and Horovod built against the loaded MPI module's mpicc")
    b.add_argument("--gpu-ops", choices=("nccl", "mpi"), default="",
                   help="cuda targets: Horovod's GPU collectives over NCCL (default) or CUDA-aware MPI (MVAPICH2-GDR)")
    b.add_argument("--torch-index", default=None, metavar="URL",
                   help="where pip finds torch (default: the target's PyTorch index; '' for pip's own configuration)")
    b.add_argument("--python", default=sys.executable,
                   help="the Python the nodes will run (its version and platform decide the wheels; default: this one)")
    b.add_argument("--no-hub", action="store_true", help="leave out the workshop hub's environment and proxy")
    b.add_argument("--out", required=True, type=Path, help="the wheelhouse folder (new, empty, or an earlier one)")
    args = ap.parse_args(argv)
    build(args.target, args.out, mpi=args.mpi, gpu_ops=args.gpu_ops, index=args.torch_index, python=args.python,
          hub=not args.no_hub)
    return 0
