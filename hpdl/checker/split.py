"""Cut a case module down to the part one side may hold: the answer key stays behind.

An exercise's author writes one case module (API in cases/__init__.py): inputs(), call(),
reference(), verify(), hidden cases. Two places must not hold all of it:

- the learner's check job needs inputs() and call() only (learner_job.py receives this cut,
  never the module's file, which its sandbox hides), and
- a learner-facing kit (`hpdl keys strip`) keeps what an inline check of the public cases needs.

`shake(name, roots, find)` keeps the top-level statements of module `name` that define a root, or
something a kept statement uses, following imports of sibling case modules (shared helpers such
as _dp.py, or a fixture importing a kit module), and returns each module's kept source in its
original order, comments and all. A statement is kept whole: a kept function brings everything
it names. Names in DENY (the reference itself) are never kept: a root that needs one is an error.
The module's docstring and bare top-level expressions are dropped.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Callable

from hpdl.errors import HpdlError

PACKAGE = __name__.rpartition(".")[0] + ".cases"  # the case modules' package
DENY = frozenset({"reference"})
HEADER = ('"""The public part of the checks for {name}, cut from the full module by hpdl.checker.split:\n'
          'its reference solution and hidden cases are in the instructor\'s answer keys."""\n')


class _Module:
    """One module's statements: what each binds, which globals and sibling attributes it uses."""

    def __init__(self, name: str, path: Path):
        self.name, self.path = name, path
        self.text = path.read_text()
        self.lines = self.text.splitlines(keepends=True)
        body = ast.parse(self.text, filename=str(path)).body
        if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant):
            body = body[1:]  # the docstring: it may describe the reference
        self.body = [s for s in body if not isinstance(s, ast.Expr)]
        self.bound = {id(s): _bound(s) for s in self.body}


def _bound(stmt: ast.stmt) -> set[str]:
    if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return {stmt.name}
    names: set[str] = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update(a.asname or a.name.split(".")[0] for a in node.names)
    return names


def _locals(stmt: ast.stmt) -> set[str]:
    """Names a function binds for itself (arguments, assignments): not the module's globals."""
    if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return set()
    found = set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.arg):
            found.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
    declared = {n for node in ast.walk(stmt) if isinstance(node, ast.Global) for n in node.names}
    return found - declared


def _uses(stmt: ast.stmt) -> tuple[set[str], set[tuple[str, str]]]:
    """(global names read, (name, attribute) pairs) in a statement, its body included."""
    names, attrs = set(), set()
    for node in ast.walk(stmt):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Store):
            names.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            attrs.add((node.value.id, node.attr))
    return names - _locals(stmt), attrs


def _siblings(stmt: ast.stmt, exists: Callable[[str], bool]) -> dict[str, tuple[str, str | None]]:
    """Names an import statement binds to sibling case modules: alias -> (module, name or None)."""
    out: dict[str, tuple[str, str | None]] = {}
    if isinstance(stmt, ast.ImportFrom) and stmt.level == 0 and stmt.module:
        for a in stmt.names:
            alias = a.asname or a.name
            if stmt.module == PACKAGE and exists(a.name):
                out[alias] = (a.name, None)
            elif stmt.module.startswith(PACKAGE + ".") and exists(stmt.module[len(PACKAGE) + 1:]):
                out[alias] = (stmt.module[len(PACKAGE) + 1:], a.name)
    return out


def shake(name: str, roots: set[str], find: Callable[[str], Path | None], *, module_name: str | None = None,
          deny: frozenset[str] = DENY) -> dict[str, str]:
    """{import name: kept source} for `name` (a module found by `find`) and the siblings it needs."""
    mods: dict[str, _Module] = {}
    needed: dict[str, set[str]] = {name: set(roots)}

    def load(n: str) -> _Module:
        if n not in mods:
            path = find(n)
            if path is None:
                raise HpdlError(f"case module {n!r} not found")
            mods[n] = _Module(module_name if n == name and module_name else f"{PACKAGE}.{n}", path)
        return mods[n]

    changed = True
    while changed:
        changed = False
        for n in list(needed):
            for mod_name, wanted in _needs(load(n), needed[n], lambda m: find(m) is not None, deny).items():
                target = n if mod_name is None else mod_name
                if not wanted <= needed.setdefault(target, set()):
                    needed[target] |= wanted
                    changed = True
    return {load(n).name: _text(load(n), needed[n], lambda m: find(m) is not None) for n in needed}


def _needs(mod: _Module, wanted: set[str], exists, deny) -> dict[str | None, set[str]]:
    """Names this module's kept statements need: own globals (key None) and siblings' names."""
    out: dict[str | None, set[str]] = {None: set(wanted)}
    for stmt in mod.body:
        if not (mod.bound[id(stmt)] & wanted):
            continue
        names, attrs = _uses(stmt)
        sib = _siblings(stmt, exists)
        for alias, (module, imported) in sib.items():
            if alias in wanted:
                used = {a for (v, a) in _all_attrs(mod, wanted) if v == alias}
                out.setdefault(module, set()).update({imported} if imported else used)
        names = {x for x in names if any(x in mod.bound[id(s)] for s in mod.body)} - mod.bound[id(stmt)]
        if names & deny:
            raise HpdlError(f"{mod.path}: {sorted(mod.bound[id(stmt)])} use {sorted(names & deny)}, which stays "
                            "in the answer keys; give them a helper of their own")
        out[None].update(names)
    return out


def _all_attrs(mod: _Module, wanted: set[str]) -> set[tuple[str, str]]:
    found = set()
    for stmt in mod.body:
        if mod.bound[id(stmt)] & wanted:
            found |= _uses(stmt)[1]
    return found


def _text(mod: _Module, wanted: set[str], exists) -> str:
    parts = [HEADER.format(name=mod.name.rpartition(".")[2])]
    for stmt in mod.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module == "__future__":
            parts.append(ast.unparse(stmt) + "\n")
        elif mod.bound[id(stmt)] & wanted:
            if isinstance(stmt, (ast.Import, ast.ImportFrom)) and len(stmt.names) > 1:
                stmt = _only(stmt, wanted)
                parts.append(ast.unparse(stmt) + "\n")
                continue
            first = min([stmt.lineno, *(d.lineno for d in getattr(stmt, "decorator_list", []))])
            gap = "\n\n" if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) else ""
            parts.append(gap + "".join(mod.lines[first - 1:stmt.end_lineno]))
    return "\n".join(parts)


def _only(stmt, wanted: set[str]):
    """An import statement cut to the names still needed."""
    keep = [a for a in stmt.names if (a.asname or a.name.split(".")[0]) in wanted]
    copy = ast.ImportFrom(stmt.module, keep, stmt.level) if isinstance(stmt, ast.ImportFrom) else ast.Import(keep)
    return ast.fix_missing_locations(copy)


def without(text: str, names: set[str], why: str) -> str:
    """A module's source with the top-level functions in `names` cut to a stub that raises RuntimeError(why), and
    the classes to their header (bases kept: a subclass, or a subscript of the class, still imports) over methods
    that raise it: the copy of an implementation of an exercise (the kit's own, a library's) a learner's
    check job sees in its file's place (checking.kit_answer_copies). Everything else stays as written."""
    lines = text.splitlines(keepends=True)
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
    cut = sorted((s for s in ast.parse(text).body if isinstance(s, kinds) and s.name in names),
                 key=lambda s: s.lineno, reverse=True)
    for s in cut:  # from the end: earlier line numbers stay right
        if isinstance(s, ast.ClassDef):
            pad = " " * s.body[0].col_offset  # its instances, made past __init__ (object.__new__), refuse too
            lines[s.body[0].lineno - 1:s.end_lineno] = [
                line for method in ("__init__", "__iter__", "__call__")
                for line in (f"{pad}def {method}(self, *args, **kwargs):\n", f"{pad}    raise RuntimeError({why!r})\n")]
        else:
            lines[s.lineno - 1:s.end_lineno] = [f"def {s.name}(*args, **kwargs):\n",
                                                f"    raise RuntimeError({why!r})\n"]
    return "".join(lines)

