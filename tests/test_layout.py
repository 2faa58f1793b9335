"""The package's lines, checked by reading its source: no import cycles, engine-side modules that
import nothing client-side, and one module (hpdl/procs.py) that signals processes and removes
MPI shared memory."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "hpdl"

ENGINE_SIDE = ("hpdl.rank", "hpdl.hang", "hpdl.watch", "hpdl.errors")  # run on every rank: no client-side imports
CLIENT_SIDE = ("hpdl.cluster", "hpdl.magics", "hpdl.panel", "hpdl.checker", "hpdl.grade", "hpdl.launchers",
               "hpdl.reaper", "hpdl.cli", "hpdl.doctor")


def _modules(pkg: Path = PKG) -> dict[str, Path]:
    mods = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _packages_around(name: str) -> set[str]:
    """The packages a module lives in: hpdl.launchers.slurm -> {hpdl, hpdl.launchers}."""
    parts = name.split(".")
    return {".".join(parts[:i]) for i in range(1, len(parts))}


def _compared_strings(node: ast.AST) -> list[ast.AST]:
    """Strings a module's name is only compared with (`package == "hpdl.checker"`,
    `name.startswith("hpdl.checker.cases")`): they name a module without importing it."""
    if isinstance(node, ast.Compare):
        operands = [node.left, *node.comparators]
    elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in ("startswith", "endswith"):
        operands = list(node.args)
    else:
        return []
    return [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]


def _imports(name: str, path: Path, mods: dict[str, Path]) -> set[str]:
    """Every module of the package `name` imports, at the top or inside a function, by an import
    statement or by a string naming it (importlib.import_module, `python -m`; not one it is only
    compared with), as Python runs it:
    importing hpdl.launchers.slurm first imports the package hpdl.launchers (its __init__.py), so
    that counts too. Left out: imports for type checkers only (`if TYPE_CHECKING:`), and the packages
    `name` itself lives in when it only passes through them to a sibling (they are loaded, or being
    loaded, before it runs). Naming its own package (`from hpdl.launchers import Launcher` inside
    hpdl.launchers.slurm) counts: that is the half-loaded package, a cycle if its __init__.py
    imports the module back."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):  # drop `if TYPE_CHECKING:` blocks
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            node.body = []
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    top = name.split(".")[0]
    around = _packages_around(name)
    found: set[str] = set()

    def add(target: str) -> None:
        while target and target not in mods:  # `from hpdl.x import function` -> hpdl.x
            target = target.rpartition(".")[0]
        if not target or target == name:
            return
        found.add(target)
        found.update(_packages_around(target) - around - {name})

    compared = {id(c) for node in ast.walk(tree) for c in _compared_strings(node)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == top:
                    add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            if base.split(".")[0] != top:
                continue
            for alias in node.names:
                add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "." in node.value \
                and node.value in mods and id(node) not in compared:
            add(node.value)
    return found


def _graph(pkg: Path = PKG) -> dict[str, set[str]]:
    mods = _modules(pkg)
    return {name: _imports(name, path, mods) for name, path in mods.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_import_walk_sees_lazy_imports():
    graph = _graph()
    assert "hpdl.cluster.lifecycle" in graph["hpdl.magics"]  # top-level import
    assert "hpdl.cluster.px" in graph["hpdl.cluster.lifecycle"]  # inside a function
    assert "hpdl.reaper" in graph["hpdl.cluster.cleanup"]  # `python -m hpdl.reaper` and an import
    assert "hpdl.cluster" in graph["hpdl"]  # importlib by name
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    # importing hpdl.launchers.slurm runs hpdl/launchers/__init__.py first: both count
    assert {"hpdl.launchers.slurm", "hpdl.launchers"} <= graph["hpdl.preflight"]


def _write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root / "pkg"


def test_a_package_and_a_module_importing_each_other_is_a_cycle(tmp_path):
    """The launchers' old shape: the package's __init__.py imports its launchers to register them,
    and each launcher imports Launcher from the half-loaded package. A walk that skips a module's
    own parent packages saw nothing; this one sees the cycle, and not the fixed shape (the class
    in a base module that imports no launcher; a launcher passing through the package to it)."""
    old = _write_package(tmp_path / "old", {
        "pkg/__init__.py": "",
        "pkg/launchers/__init__.py": "class Launcher:\n    pass\n\n\nfrom pkg.launchers.slurm import job_state\n",
        "pkg/launchers/slurm.py": "from pkg.launchers import Launcher\n\n\ndef job_state(): ...\n",
    })
    assert _cycles(_graph(old)) == [["pkg.launchers", "pkg.launchers.slurm"]]
    fixed = _write_package(tmp_path / "new", {
        "pkg/__init__.py": "",
        "pkg/launchers/__init__.py": "from pkg.launchers.base import Launcher\nfrom pkg.launchers.slurm import Slurm\n",
        "pkg/launchers/base.py": "class Launcher:\n    pass\n",
        "pkg/launchers/slurm.py": "from pkg.launchers.base import Launcher\n\n\nclass Slurm(Launcher): ...\n",
        "pkg/check.py": 'def is_launcher(name):\n    return name == "pkg.launchers" or name.startswith(("pkg.x.y",))\n',
    })
    graph = _graph(fixed)
    assert _cycles(graph) == [] and graph["pkg.launchers.slurm"] == {"pkg.launchers.base"}
    assert graph["pkg.check"] == set()  # a module name it only compares with is no import
    # from outside, reaching a launcher imports the package around it first
    (fixed / "user.py").write_text("def start():\n    from pkg.launchers.slurm import Slurm\n")
    assert _graph(fixed)["pkg.user"] == {"pkg.launchers", "pkg.launchers.slurm"}


def test_no_import_cycles_in_hpdl():
    assert _cycles(_graph()) == []


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for w in graph.get(todo.pop(), ()):
            if w not in seen:
                seen.add(w)
                todo.append(w)
    return seen


@pytest.mark.parametrize("module", ENGINE_SIDE)
def test_engine_side_modules_import_nothing_client_side(module):
    reached = _reachable(_graph(), module)
    assert not [m for m in reached if m.startswith(CLIENT_SIDE)], reached


# calls that send a signal: os.kill, os.killpg, signal.pthread_kill, psutil's/Popen's .kill(),
# .terminate(), .send_signal(), and ipyparallel's engine-set .signal()
_SIGNAL = re.compile(r"\bos\.kill(pg)?\(|\bpthread_kill\(|\.kill\(|\.terminate\(|\bsend_signal\(|(?<!signal)\.signal\(")
_UNLINK = {"unlink", "remove", "rmtree"}


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines without comments and docstrings (the prose may mention os.kill)."""
    tree = ast.parse(path.read_text())
    doc_lines: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            doc_lines.update(range(body[0].lineno, body[0].end_lineno + 1))
    return [(i, line.split("#")[0]) for i, line in enumerate(path.read_text().splitlines(), 1) if i not in doc_lines]


def _shm_unlinks(path: Path) -> list[int]:
    """Lines that delete files in a function that deals with MPI shared memory (/dev/shm)."""
    hits = []
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        names = " ".join(ast.unparse(n) for n in ast.walk(fn) if isinstance(n, (ast.Name, ast.Attribute, ast.Constant)))
        if "shm" not in names and "shared_memory" not in names:
            continue
        hits += [n.lineno for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and n.func.attr in _UNLINK]
    return hits


def _offenders() -> tuple[list[str], list[str]]:
    signals, unlinks = [], []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG).as_posix()
        if rel == "procs.py":
            continue
        signals += [f"{rel}:{i}: {line.strip()}" for i, line in _code_lines(path) if _SIGNAL.search(line)]
        unlinks += [f"{rel}:{i}" for i in _shm_unlinks(path)]
    return signals, unlinks


def test_only_procs_signals_processes_and_removes_shared_memory():
    signals, unlinks = _offenders()
    assert signals == []
    assert unlinks == []


def test_the_signal_and_unlink_scan_finds_what_it_looks_for(tmp_path):
    """The scan is not vacuous: code that signals and removes segments is found, prose is not."""
    sample = tmp_path / "sample.py"
    sample.write_text('"""Docs may say os.kill(pid, 9)."""\nimport os\n\n\ndef stop(p, pid, shm):\n'
                      '    p.terminate()  # or os.killpg(pid)\n    os.kill(pid, 9)\n    for s in shm:\n'
                      '        os.unlink(s)\n')
    assert [i for i, line in _code_lines(sample) if _SIGNAL.search(line)] == [6, 7]
    assert _shm_unlinks(sample) == [9]
    assert _shm_unlinks(PKG / "procs.py")


LONGEST_FUNCTION = 60  # lines, decorators and docstring included: one job a reader can hold in mind


def _long_functions(path: Path, limit: int = LONGEST_FUNCTION) -> list[str]:
    tree = ast.parse(path.read_text())
    return [f"{path.name}:{n.lineno} {n.name}() is {n.end_lineno - n.lineno + 1} lines"
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 >= limit]


def test_every_function_in_hpdl_is_under_60_lines(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text("def long():\n" + "    x = 1\n" * 60 + "\n\ndef short():\n    pass\n")
    assert [s.split()[1] for s in _long_functions(sample)] == ["long()"]  # the measure sees one
    assert [f for path in sorted(PKG.rglob("*.py")) for f in _long_functions(path)] == []
