"""`hpdl keys`: move the answer keys (reference solutions, hidden cases) out of a shared kit.

In a clone, each exercise's case module (hpdl/checker/cases/<exercise>.py) holds everything:
public and hidden cases, inputs(), reference(), verify(). That is right for self-study, and a
learner's check job never sees those files (its sandbox hides them; learner_job.py gets only
the part inputs() and call() use). A kit shared by a class needs more: its files are readable
by every learner, so the instructor

    hpdl keys export --to ~/hpdl-keys     # a 0700 folder of the full case modules, owner only
    hpdl keys strip --keys ~/hpdl-keys    # the kit keeps public cases, inputs/call/verify and,
                                          # as data, the expected answers of its public cases
    hpdl grade --keys ~/hpdl-keys DIR     # the grader reads the keys (or HPDL_KEYS=DIR)

`strip` refuses unless every module it would change has an identical copy in the keys folder,
so nothing is lost; it runs each reference once per rank count (expected.py) before removing it.
A case module written in the usual format needs no change: the cut is made from its source
(checker/split.py), following the helpers it imports.
"""
from __future__ import annotations

import argparse
import ast
import os
import pprint
import stat
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType

from hpdl import safefiles
from hpdl.errors import HpdlError

CASES = Path(__file__).resolve().parent / "checker" / "cases"
#: What the public part of an exercise keeps (besides what these use): no reference, no cases()
PUBLIC_ROOTS = ("SIGNATURE", "RANKS", "TIMEOUT", "VERIFY_TIMEOUT", "FORBIDDEN", "FORBIDDEN_REASON", "HINT_ONLY_ROOT",
                "LIBRARY_ANSWERS",
                "inputs", "call", "ORACLE", "secrets", "serve", "set_up", "calibrate")
JUDGING = ("verify", "diagnose", "explain")
MARKER = "PUBLIC_ONLY = True"


def modules(folder: Path = CASES) -> list[Path]:
    return sorted(p for p in folder.glob("*.py") if p.name != "__init__.py")


def is_stripped(path: Path) -> bool:
    return any(line.startswith(MARKER) for line in path.read_text().splitlines())


# -- export ---------------------------------------------------------------------------------------

def export(to: Path, folder: Path = CASES) -> list[Path]:
    """Copy the full case modules into `to` (created 0700; files 0600, created exclusively)."""
    full = [p for p in modules(folder) if not is_stripped(p)]
    if not full:
        raise HpdlError(f"{folder} holds no full case modules (the kit is stripped already): nothing to export.")
    to = to.expanduser()
    if to.is_symlink() or (to.exists() and (not to.is_dir() or any(to.iterdir()) or to.stat().st_uid != os.getuid())):
        raise HpdlError(f"{to} exists: export into a new folder, or an empty one of yours (nothing is overwritten).")
    to.mkdir(parents=True, mode=0o700, exist_ok=True)
    os.chmod(to, 0o700)
    for p in full:
        safefiles.create_exclusive(str(to / p.name), p.read_bytes(), mode=0o600)
    return [to / p.name for p in full]


def check_folder(folder: Path) -> None:
    """A keys folder must be a real folder of ours that nobody else can read or change."""
    try:
        st = os.lstat(folder)
    except OSError:
        raise HpdlError(f"{folder}: no such folder; make one with `hpdl keys export --to {folder}`.") from None
    if not stat.S_ISDIR(st.st_mode):
        raise HpdlError(f"{folder} is not a folder (a link is refused): give the folder itself.")
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise HpdlError(f"{folder} must be yours and closed to others (chmod 700 {folder}): it holds the answers.")


# -- strip ----------------------------------------------------------------------------------------

def strip(keys: Path, folder: Path = CASES, progress=print) -> list[str]:
    """Replace each full case module in `folder` by its public part; the notes on what was kept."""
    from hpdl.checker import cases as case_api

    check_folder(keys)
    todo = [p for p in modules(folder) if not is_stripped(p)]
    missing = [p.name for p in todo if not (keys / p.name).is_file() or (keys / p.name).read_bytes() != p.read_bytes()]
    if missing:
        raise HpdlError(f"{keys} has no identical copy of {', '.join(missing)}: run `hpdl keys export` first "
                        "(strip removes the reference solutions from this kit).")
    from hpdl.checker import split

    def find(name: str) -> Path | None:
        return folder / f"{name}.py" if (folder / f"{name}.py").is_file() else None

    written, helper_roots, notes = {}, {}, []
    for p in [p for p in todo if not p.stem.startswith("_")]:
        progress(f"hpdl keys: {p.stem}: computing the expected answers of its public cases")
        module = case_api.load_file(p)
        text, siblings, note = public_module(p.stem, module, find)
        written[p] = (text, expected_answers(p, module))
        for name, names in siblings.items():
            helper_roots.setdefault(name, set()).update(names)
        notes += [note] if note else []
    for p in [p for p in todo if p.stem.startswith("_")]:  # helpers: what the public parts use of them
        roots = helper_roots.get(f"{split.PACKAGE}.{p.stem}")
        written[p] = (split.shake(p.stem, roots, find)[f"{split.PACKAGE}.{p.stem}"] if roots else None, None)
    _write(written, folder)
    return notes


def expected_answers(path: Path, module: ModuleType) -> bytes:
    """Run the reference on every public case at every rank count; the packed answers (expected.py)."""
    from hpdl.checker import wire
    from hpdl.checker.checking import _plan, _sizes

    name = path.stem
    plan, _ = _plan(module, _sizes(None, module), False, None)
    spec = {"exercise": name, "module_path": str(path), "expected_only": True, "forbidden": {}, "hidden": []}
    answers: dict = {}
    with tempfile.TemporaryDirectory(prefix="hpdl-expected-") as tmp:
        for size, todo in plan.items():
            if todo:
                answers.update(_reference_job(name, spec, size, todo, tmp))
    return wire.pack(answers)


def _reference_job(name: str, spec: dict, size: int, todo: list, tmp: str) -> dict:
    from hpdl.checker import expected, wire
    from hpdl.checker.jobs import START_TIMEOUT, Job

    job = Job("reference", spec, size, todo, tmp, sandboxed=False)
    deadline = time.monotonic() + START_TIMEOUT + sum(p.timeout for p in todo) + 60
    try:
        while not job.exited() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        job.wind_down()
    out = {}
    for p in todo:
        entries = []
        for rank in range(size):
            try:
                with open(os.path.join(job.dir, f"expected-{p.index}-{rank}.bin"), "rb") as f:
                    entries.append(wire.unpack(f.read()))
            except (OSError, ValueError, wire.NotPlainData) as exc:
                raise HpdlError(f"{name}: the reference gave no answer to {p.case.name!r} on rank {rank} of "
                                f"{size} ({exc}); its output:\n{job.output_tail()}") from None
        out[expected.key(size, p.case.name)] = {"expected": [e["expected"] for e in entries],
                                        "seconds": [e["seconds"] for e in entries]}
    return out


def public_module(name: str, module, find) -> tuple[str, dict[str, set[str]], str | None]:
    """(the public module's source, {sibling: names it needs}, a note when verify() had to go)."""
    from hpdl.checker import split

    judging = [n for n in JUDGING if callable(getattr(module, n, None))]
    answer = _names(split.shake(name, {"reference"}, find, deny=frozenset()), defs_only=True)
    learner = _names(split.shake(name, {"inputs", "call", "set_up", "calibrate"}, find), defs_only=True)
    judged = _names(split.shake(name, set(judging), find), defs_only=True) if judging else set()
    leaks = (judged & answer) - learner  # functions of the reference that verify() would bring along
    note = None
    if leaks:
        note = (f"{name}: its verify() uses {', '.join(sorted(n for _, n in leaks))}, part of the reference: "
                "the stripped kit compares results with the expected answers instead")
        judging = []
    cut = split.shake(name, {*PUBLIC_ROOTS, *judging}, find)
    own = f"{split.PACKAGE}.{name}"
    siblings = {m: {n for _, n in _names({m: text})} for m, text in cut.items() if m != own}
    return cut[own] + _generated(name, module), siblings, note


def _names(sources: dict[str, str], defs_only: bool = False) -> set[tuple[str, str]]:
    """(module, name) of every top-level function and class (and, unless `defs_only`, constant and
    import) in some modules' sources."""
    found = set()
    for mod, text in sources.items():
        for stmt in ast.parse(text).body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add((mod, stmt.name))
            elif not defs_only and isinstance(stmt, (ast.Assign, ast.AnnAssign, ast.Import, ast.ImportFrom)):
                targets = stmt.targets if isinstance(stmt, ast.Assign) else [getattr(stmt, "target", None)]
                found.update((mod, t.id) for t in targets if isinstance(t, ast.Name))
                found.update((mod, a.asname or a.name) for a in getattr(stmt, "names", []))
    return found


def _generated(name: str, module) -> str:
    """cases() as data: the public cases whole, the hidden ones by name and points only."""
    from hpdl.checker.checking import _sizes

    table = {}
    for size in _sizes(None, module):
        rows = []
        for c in module.cases(size):
            c.size = size
            rows.append(c.to_dict() if not c.hidden else {"name": c.name, "points": c.points, "hidden": True,
                                                          "size": size})
        table[str(size)] = rows
    return (f"\n\n{MARKER}  # `hpdl keys strip`: no reference() here; the public cases' expected answers are in "
            f"{name}.expected\n_CASES = {pprint.pformat(table, width=110, sort_dicts=False)}\n\n\n"
            "def cases(size):\n"
            "    from hpdl.checker.cases import Case\n\n"
            "    return [Case(**c) for c in _CASES.get(str(size), [])]\n")


def _write(written: dict, folder: Path) -> None:
    from hpdl.checker import expected

    for path, (text, answers) in written.items():
        if text is None:
            path.unlink()
        else:
            safefiles.replace_atomically(str(path), text, mode=0o644)
        if answers is not None:
            safefiles.replace_atomically(str(expected.path_for(path)), answers, mode=0o644)
        for pyc in (folder / "__pycache__").glob(f"{path.stem}.*.pyc"):
            pyc.unlink()  # a compiled copy of the full module


# -- the command ----------------------------------------------------------------------------------

def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="hpdl keys", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:3]))
    sub = ap.add_subparsers(dest="action", required=True)
    ex = sub.add_parser("export", help="copy the full case modules into a folder only you can read")
    ex.add_argument("--to", type=Path, required=True, help="a new (or empty) folder; made 0700")
    st = sub.add_parser("strip", help="leave this kit the public part of each exercise's checks")
    st.add_argument("--keys", type=Path, required=True, help="the folder `hpdl keys export` made (checked first)")
    return ap


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if args.action == "export":
        done = export(args.to)
        print(f"hpdl keys: {len(done)} case modules exported to {args.to} (0700). Grade with "
              f"`hpdl grade --keys {args.to} ...`; then `hpdl keys strip --keys {args.to}` in the shared kit.")
        return 0
    for note in strip(args.keys):
        print(f"hpdl keys: note: {note}")
    print(f"hpdl keys: {CASES} now holds the public checks only; grade with `hpdl grade --keys {args.keys}`.")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
