"""`hpdl exercises`: copy the exercises into the learner's workspace, never overwriting their work.

    hpdl exercises                 # into the kit's workspace/ (or $HPDL_WORKSPACE)
    hpdl exercises --dest ~/mywork

Run it again after the kit is updated: new exercises are added, files the learner has not
touched are updated, and a file the learner changed is left as it is and reported. A small
manifest in the workspace (.hpdl-manifest.json) remembers the hash of every file as it was
copied; a file whose hash still matches is untouched by the learner.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from hpdl import settings
from hpdl.errors import HpdlError

MANIFEST = ".hpdl-manifest.json"
SKIP_DIRS = {".ipynb_checkpoints", "__pycache__"}


@dataclass
class Sync:
    """What one run did, file by file (paths relative to the workspace)."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # changed by the learner: left alone

    def summary(self, dest: Path) -> str:
        lines = [f"hpdl exercises: {dest}: {len(self.added)} added, {len(self.updated)} updated, "
                 f"{len(self.unchanged)} unchanged, {len(self.kept)} kept as you changed them."]
        for name, what in ((self.added, "added"), (self.updated, "updated")):
            lines += [f"  {what}: {n}" for n in name]
        if self.kept:
            lines.append("  These have a newer version in the kit, but you changed them, so they were not touched:")
            lines += [f"    {n}" for n in self.kept]
            lines.append("  To get the new version, rename your file and run `hpdl exercises` again.")
        return "\n".join(lines)


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def default_source() -> Path:
    return Path(__file__).resolve().parents[1] / "exercises"


def default_dest() -> Path:
    """$HPDL_WORKSPACE, else workspace/ at the top of the kit (beside exercises/, wherever the
    command is run from: a notebook's kernel runs in notebooks/), else ./workspace."""
    if settings.WORKSPACE.is_set():
        return settings.WORKSPACE.get()
    kit = Path(__file__).resolve().parents[1]
    if (kit / "exercises").is_dir() and os.access(kit, os.W_OK):
        return kit / "workspace"
    return Path.cwd() / "workspace"


def _files(source: Path) -> list[Path]:
    return [p for p in sorted(source.rglob("*"))
            if p.is_file() and not SKIP_DIRS & set(p.relative_to(source).parts)]


def sync(source: Path, dest: Path) -> Sync:
    """Copy new files, update untouched ones, keep changed ones; record hashes in the manifest."""
    if not source.is_dir():
        raise HpdlError(f"No exercises at {source}. In the kit's folder, run `hpdl build` first (or pass --source).")
    dest.mkdir(parents=True, exist_ok=True)
    manifest_path = dest / MANIFEST
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, ValueError):
        manifest = {}
    result = Sync()
    for src in _files(source):
        rel = src.relative_to(source).as_posix()
        dst = dest / rel
        new = _hash(src)
        if not dst.exists():
            _copy(src, dst)
            result.added.append(rel)
            manifest[rel] = new
            continue
        have = _hash(dst)
        if have == new:
            result.unchanged.append(rel)
            manifest[rel] = new
        elif manifest.get(rel) == have:  # as we copied it: the learner has not touched it
            _copy(src, dst)
            result.updated.append(rel)
            manifest[rel] = new
        else:
            result.kept.append(rel)
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, manifest_path)
    return result


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".hpdl-tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpdl exercises", description="Copy the exercises into your workspace.")
    ap.add_argument("--dest", type=Path, help="your workspace (default: $HPDL_WORKSPACE, else workspace/ in the kit)")
    ap.add_argument("--source", type=Path, help="where the exercises are (default: the kit's exercises/)")
    args = ap.parse_args(argv)
    dest = (args.dest or default_dest()).expanduser()
    source = (args.source or default_source()).expanduser()
    result = sync(source, dest)
    print(result.summary(dest))
    return 0
