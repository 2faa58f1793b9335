"""`hpdl exercises`: copy the lessons and exercises into the learner's workspace, never overwriting their work.

    hpdl exercises                 # the kit's notebooks/, exercises/, benchmarks/ into your workspace
    hpdl exercises --where         # print where that is (the job scripts cd there)
    hpdl exercises --dest ~/mywork
    hpdl exercises --source DIR --dest DIR    # one folder only

Why a workspace: a kit installed once for a course (a shared folder, an image) is read-only to its
learners, so JupyterLab opens in a folder of their own holding a copy of what they run and edit:
the lessons (with their scripts), the exercises, and the benchmarks lessons 06-09 run. The workspace
is $HPDL_WORKSPACE, else workspace/ inside the kit when the learner may write there (their own
clone: today's layout), else ~/hpdl-workspace; a workspace this command creates is 0700.

Run it again after the kit is updated: new files are added, files the learner has not touched are
updated, and a file the learner changed is left as it is and reported. A small manifest in each
copied folder (.hpdl-manifest.json) remembers the hash of every file as it was copied; a file
whose hash still matches is untouched by the learner. When the kit renames a notebook (RENAMED), the
learner's untouched copy under the old name is removed, since the kit's file arrives under its new
name; a copy they changed stays where it is, and the summary says what it is called now.
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
# the kit's folders a learner works in: (folder, needed) — the lessons and their scripts, the
# exercises, and the benchmarks the lessons run (`../benchmarks/...` from notebooks/)
PARTS = (("notebooks", True), ("exercises", True), ("benchmarks", False))
SHARED_DEFAULT = "~/hpdl-workspace"  # the workspace when the kit is not the learner's to write
LISTED = 12  # added/updated files named one by one up to this many; beyond, counted
# notebooks the kit renamed, old name -> new: lesson 07 was split in two (07 and 08), and the lessons
# after it moved up by one
RENAMED = {"08_scaling_studies.ipynb": "09_scaling_studies.ipynb",
           "09_model_parallelism.ipynb": "10_model_parallelism.ipynb",
           "10_sharding_memory.ipynb": "11_sharding_memory.ipynb"}


@dataclass
class Sync:
    """What one run did, file by file (paths relative to the workspace)."""

    added: list[str] = field(default_factory=list)
    updated: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)  # changed by the learner: left alone
    retired: list[str] = field(default_factory=list)  # "old -> new": untouched copy of a renamed file, removed
    renamed: list[str] = field(default_factory=list)  # "old -> new": changed copy of a renamed file, left alone

    def merge(self, other: Sync, prefix: str) -> None:
        """Add another folder's run, its paths under `prefix`/."""
        for name in ("added", "updated", "unchanged", "kept", "retired", "renamed"):
            getattr(self, name).extend(f"{prefix}/{p}" for p in getattr(other, name))

    def summary(self, dest: Path) -> str:
        lines = [f"hpdl exercises: {dest}: {len(self.added)} added, {len(self.updated)} updated, "
                 f"{len(self.unchanged)} unchanged, {len(self.kept)} kept as you changed them."]
        for name, what in ((self.added, "added"), (self.updated, "updated")):
            if len(name) <= LISTED:
                lines += [f"  {what}: {n}" for n in name]
        if self.kept:
            lines.append("  These have a newer version in the kit, but you changed them, so they were not touched:")
            lines += [f"    {n}" for n in self.kept]
            lines.append("  To get the new version, rename your file and run `hpdl exercises` again.")
        if self.retired:
            lines.append("  Renamed in the kit; your copy under the old name was unchanged, so it was removed:")
            lines += [f"    {n}" for n in self.retired]
        if self.renamed:
            lines.append("  Renamed in the kit; you changed your copy under the old name, so it stays as it is.")
            lines.append("  Carry your work into the new file (or keep using the old one), then delete the old one:")
            lines += [f"    {n}" for n in self.renamed]
        return "\n".join(lines)


def _hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def kit_dir() -> Path:
    """The kit's folder: $HPDL_DIR, else the folder this package was loaded from."""
    kit = settings.DIR.get()
    if kit is None:
        return Path(__file__).resolve().parents[1]
    if not (kit / "notebooks").is_dir():
        raise HpdlError(f"HPDL_DIR={kit}: no notebooks/ there. Set it to the kit's folder (where notebooks/, "
                        "exercises/ and hpdl/ are), or unset it.")
    return kit


def default_source() -> Path:
    return kit_dir() / "exercises"


def default_dest(kit: Path | None = None) -> Path:
    """$HPDL_WORKSPACE; else workspace/ in the kit when this user may write there (a clone of their
    own: it stays beside exercises/); else ~/hpdl-workspace (a kit shared read-only)."""
    if settings.WORKSPACE.is_set():
        return settings.WORKSPACE.get()
    kit = kit_dir() if kit is None else kit
    if (kit / "exercises").is_dir() and os.access(kit, os.W_OK):
        return kit / "workspace"
    return Path(SHARED_DEFAULT).expanduser()


def _files(source: Path) -> list[Path]:
    return [p for p in sorted(source.rglob("*"))
            if p.is_file() and not SKIP_DIRS & set(p.relative_to(source).parts)]


def make_workspace(dest: Path) -> None:
    """The workspace folder, 0700 when this creates it (a learner's work is theirs alone; one
    they made themselves keeps its mode). A folder we cannot write is a clear error."""
    if not dest.exists():
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.mkdir(mode=0o700)
        os.chmod(dest, 0o700)  # whatever the umask
    if not dest.is_dir() or not os.access(dest, os.W_OK | os.X_OK):
        raise HpdlError(f"Cannot write in {dest}. Choose a workspace of your own: "
                        f"HPDL_WORKSPACE=~/hpdl-workspace (or `hpdl exercises --dest DIR`).")


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
    _retire_renamed(source, dest, manifest, result)
    tmp = manifest_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, manifest_path)
    return result


def _retire_renamed(source: Path, dest: Path, manifest: dict, result: Sync) -> None:
    """Copies of files the kit renamed: an untouched one goes (the kit's file is now there under its
    new name), a changed one stays and is reported; only names in RENAMED, only files we copied."""
    for rel in sorted(manifest):
        old = Path(rel)
        new = old.with_name(RENAMED.get(old.name, old.name))
        if new == old or (source / old).exists() or not (source / new).exists():
            continue
        dst, pair = dest / old, f"{rel} -> {new.as_posix()}"
        if not dst.is_file():
            del manifest[rel]  # gone already: nothing to do
        elif _hash(dst) == manifest[rel]:
            dst.unlink()
            del manifest[rel]
            result.retired.append(pair)
        else:
            result.renamed.append(pair)


def sync_kit(kit: Path, dest: Path) -> Sync:
    """The kit's lessons, exercises and benchmarks into the workspace, each in a folder of its own
    named as in the kit, so the lessons' relative paths (../benchmarks/...) hold there too."""
    make_workspace(dest)
    result = Sync()
    for part, needed in PARTS:
        if not (kit / part).is_dir():
            if needed:
                raise HpdlError(f"No {part}/ in the kit at {kit}. Point HPDL_DIR at the kit's folder"
                                + (" (and run `hpdl build` there)." if part == "exercises" else "."))
            continue
        result.merge(sync(kit / part, dest / part), part)
    return result


def _copy(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(dst.name + ".hpdl-tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpdl exercises",
                                 description="Copy the lessons and exercises into your workspace, never "
                                             "overwriting a file you changed.")
    ap.add_argument("--dest", type=Path, help="your workspace (default: $HPDL_WORKSPACE, else workspace/ in "
                                              f"a kit you may write, else {SHARED_DEFAULT})")
    ap.add_argument("--source", type=Path, help="copy this one folder instead of the kit's lessons, "
                                                "exercises and benchmarks")
    ap.add_argument("--where", action="store_true", help="print the workspace's path and copy nothing")
    args = ap.parse_args(argv)
    dest = (args.dest or default_dest()).expanduser()
    if args.where:
        print(dest)
        return 0
    if args.source:
        make_workspace(dest)
        result = sync(args.source.expanduser(), dest)
    else:
        result = sync_kit(kit_dir(), dest)
    print(result.summary(dest))
    return 0
