"""`hpdl build`: solutions/ is the single source; exercises/ is generated from it.

An author writes each exercise notebook once, solved, in solutions/. In its cells,

    ### BEGIN SOLUTION
    ...the part the learner writes...
    ### END SOLUTION

marks what the learner writes; in exercises/ it becomes a placeholder that raises
NotImplementedError (in markdown cells: "_Your answer here._"). Cell tags: `solution`
blanks a whole cell, `solution-only` leaves it out of the exercise. Both sides are written
normalised: no outputs, no execution counts, no volatile metadata, nbformat 4.5 with stable
cell ids (an exercise cell keeps the id of the solution cell it comes from). Other files
under solutions/ are copied as they are.

    hpdl build            # write exercises/ and normalise solutions/
    hpdl build --check    # change nothing; exit 1 listing every file that differs from a fresh build
"""
from __future__ import annotations

import argparse
import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

from hpdl.errors import HpdlError

BEGIN, END = "### BEGIN SOLUTION", "### END SOLUTION"
CODE_PLACEHOLDER = [
    "# YOUR CODE HERE",
    'raise NotImplementedError("Your code here: replace this line with your solution.")',
]
MARKDOWN_PLACEHOLDER = "_Your answer here._"
TAG_SOLUTION, TAG_SOLUTION_ONLY = "solution", "solution-only"
KEEP_CELL_METADATA = ("tags", "editable", "deletable", "slideshow", "hpdl")
SKIP_DIRS = {".ipynb_checkpoints", "__pycache__"}
_ID = re.compile(r"^[a-zA-Z0-9-_]{1,64}$")


@dataclass
class Planned:
    """One file a build writes, and the text it must have."""

    path: Path
    text: str | bytes


def kit_root() -> Path:
    """The folder with solutions/: the current one if it has it, else the kit's own."""
    here = Path.cwd()
    if (here / "solutions").is_dir():
        return here
    return Path(__file__).resolve().parents[1]


# -- one notebook -------------------------------------------------------------------------------

def _lines(source) -> list[str]:
    text = "".join(source) if isinstance(source, list) else (source or "")
    return text.split("\n")


def blank_regions(source: str, where: str, markdown: bool = False) -> str:
    """Replace each BEGIN/END SOLUTION region by the placeholder, at the marker's indentation."""
    out, inside, indent = [], False, ""
    for number, line in enumerate(_lines(source), 1):
        stripped = line.strip()
        if stripped.startswith(BEGIN):
            if inside:
                raise HpdlError(f"{where}, line {number}: {BEGIN} inside another solution region; "
                                f"close the first with {END}.")
            inside, indent = True, line[: len(line) - len(line.lstrip())]
            if markdown:
                out.append(indent + MARKDOWN_PLACEHOLDER)
            else:
                out.extend(indent + p for p in CODE_PLACEHOLDER)
            continue
        if stripped.startswith(END):
            if not inside:
                raise HpdlError(f"{where}, line {number}: {END} without a {BEGIN} before it.")
            inside = False
            continue
        if not inside:
            out.append(line)
    if inside:
        raise HpdlError(f"{where}: {BEGIN} is never closed; add {END} after the solution.")
    return "\n".join(out)


def _cell_id(rel: str, index: int, taken: set[str]) -> str:
    n = 0
    while True:
        cid = hashlib.sha1(f"{rel}:{index}:{n}".encode()).hexdigest()[:8]
        if cid not in taken:
            return cid
        n += 1


def normalise(nb, rel: str):
    """Outputs and volatile metadata out; nbformat 4.5 with unique, stable cell ids."""
    nb.nbformat, nb.nbformat_minor = 4, max(5, nb.get("nbformat_minor", 5))
    meta = nb.get("metadata", {})
    keep = {}
    if "kernelspec" in meta:
        keep["kernelspec"] = meta["kernelspec"]
    keep["language_info"] = {"name": meta.get("language_info", {}).get("name", "python")}
    for key in ("hpdl", "title", "authors"):
        if key in meta:
            keep[key] = meta[key]
    nb.metadata = keep
    taken: set[str] = set()
    for index, cell in enumerate(nb.cells):
        cid = cell.get("id")
        if not isinstance(cid, str) or not _ID.match(cid) or cid in taken:
            cid = _cell_id(rel, index, taken)
        cell["id"] = cid
        taken.add(cid)
        cell["metadata"] = {k: v for k, v in cell.get("metadata", {}).items() if k in KEEP_CELL_METADATA}
        if isinstance(cell.get("source"), list):
            cell["source"] = "".join(cell["source"])
        if cell.get("cell_type") == "code":
            cell["outputs"] = []
            cell["execution_count"] = None
        else:
            cell.pop("outputs", None)
            cell.pop("execution_count", None)
    return nb


def exercise_of(solution, rel: str):
    """The exercise notebook: solution regions and cells blanked, solution-only cells gone."""
    import copy

    nb = copy.deepcopy(solution)
    cells = []
    for index, cell in enumerate(nb.cells):
        tags = set(cell.get("metadata", {}).get("tags", []))
        where = f"{rel}, cell {index + 1} (id {cell.get('id')})"
        markdown = cell.get("cell_type") == "markdown"
        if TAG_SOLUTION_ONLY in tags:
            continue
        if TAG_SOLUTION in tags:
            cell["source"] = MARKDOWN_PLACEHOLDER if markdown else "\n".join(CODE_PLACEHOLDER)
        elif cell.get("cell_type") in ("code", "markdown"):
            cell["source"] = blank_regions(cell.get("source", ""), where, markdown=markdown)
        cells.append(cell)
    nb.cells = cells
    return nb


def _text(nb) -> str:
    import nbformat

    text = nbformat.writes(nb, version=4)
    return text if text.endswith("\n") else text + "\n"


# -- the whole tree ----------------------------------------------------------------------------

def plan(solutions: Path, exercises: Path) -> tuple[list[Planned], list[Path]]:
    """What a fresh build writes, and the generated files it would remove (stale exercises)."""
    import nbformat

    if not solutions.is_dir():
        return [], []
    out: list[Planned] = []
    wanted: set[Path] = set()
    for src in sorted(solutions.rglob("*")):
        if src.is_dir() or SKIP_DIRS & set(src.relative_to(solutions).parts):
            continue
        rel = src.relative_to(solutions)
        dst = exercises / rel
        wanted.add(dst)
        if src.suffix != ".ipynb":
            out.append(Planned(dst, src.read_bytes()))
            continue
        try:
            nb = nbformat.read(src, as_version=4)
        except Exception as exc:
            raise HpdlError(f"{src}: not a readable notebook ({exc}).") from None
        nb = normalise(nb, rel.as_posix())
        out.append(Planned(src, _text(nb)))
        out.append(Planned(dst, _text(exercise_of(nb, f"solutions/{rel.as_posix()}"))))
    stale = []
    if exercises.is_dir():
        stale = [p for p in sorted(exercises.rglob("*.ipynb"))
                 if p not in wanted and not SKIP_DIRS & set(p.relative_to(exercises).parts)]
    return out, stale


def _differs(p: Planned) -> bool:
    try:
        current = p.path.read_bytes()
    except OSError:
        return True
    want = p.text.encode() if isinstance(p.text, str) else p.text
    return current != want


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpdl build", description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="change nothing; exit 1 if any file differs from a fresh build")
    ap.add_argument("--root", type=Path,
                    help="the kit folder holding solutions/ and exercises/ (default: here, else the kit)")
    ap.add_argument("--solutions", type=Path, help="default: ROOT/solutions")
    ap.add_argument("--exercises", type=Path, help="default: ROOT/exercises")
    args = ap.parse_args(argv)
    root = args.root or kit_root()
    solutions = args.solutions or root / "solutions"
    exercises = args.exercises or root / "exercises"
    if not solutions.is_dir():
        print(f"hpdl build: no {solutions}; nothing to build.")
        return 0
    planned, stale = plan(solutions, exercises)
    drifted = [p for p in planned if _differs(p)]

    def show(path: Path) -> str:
        try:
            return str(path.relative_to(root))
        except ValueError:
            return str(path)

    if args.check:
        if not drifted and not stale:
            print(f"hpdl build --check: {len(planned)} files match a fresh build.")
            return 0
        print("hpdl build --check: these files differ from a fresh build (run `hpdl build`, then commit):")
        for p in drifted:
            print(f"  {show(p.path)}" + ("  (missing)" if not p.path.exists() else ""))
        for p in stale:
            print(f"  {show(p)}  (no source in {show(solutions)}; a build removes it)")
        return 1
    for p in drifted:
        p.path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(p.text, str):
            p.path.write_text(p.text, encoding="utf-8")
        else:
            p.path.write_bytes(p.text)
    for p in stale:
        p.unlink()
    n_ex = sum(1 for p in planned if p.path.is_relative_to(exercises) and p.path.suffix == ".ipynb")
    print(f"hpdl build: {n_ex} exercise notebook{'s' if n_ex != 1 else ''} from {show(solutions)}; "
          f"{len(drifted)} file{'s' if len(drifted) != 1 else ''} written, {len(stale)} stale removed.")
    return 0
