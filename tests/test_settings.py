"""The one list of settings: every HPDL_* variable the kit reads is declared in hpdl/settings.py and
read through it, a bad value is an HpdlError naming the variable, values are read when asked for
(not at import), `hpdl settings` prints them, and docs/SETTINGS.md is generated from them."""
from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl import settings
from hpdl.errors import HpdlError

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "hpdl"
# Python outside hpdl/ that reads settings through the module too
OTHER_PYTHON = (ROOT / "cluster" / "jupyterhub" / "jupyterhub_config.py",)
# where the shell scripts, job scripts and build recipes name variables (tests/ makes up its own)
SCRIPTS = [ROOT / "Makefile", *ROOT.glob(".ci/*"), *ROOT.glob("cluster/**/*"), *ROOT.glob("benchmarks/*")]
NAME = re.compile(r"HPDL_[A-Z0-9_]*")


def _python_files() -> list[Path]:
    return [p for p in sorted(PKG.rglob("*.py")) if p != PKG / "settings.py"] + list(OTHER_PYTHON)


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes: prose may name variables."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            found.add(id(body[0].value))
    return found


def bypasses(path: Path) -> list[str]:
    """Places that name an HPDL_* variable in code instead of through hpdl.settings: a string that
    is exactly a variable's name (or a prefix, as in f"HPDL_SLURM_{key}") and a keyword argument
    named like one (dict(os.environ, HPDL_GRADE="1")). Messages that mention a variable are fine."""
    tree = ast.parse(path.read_text())
    skip = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip \
                and NAME.fullmatch(node.value):
            found.append(f"{path.name}:{node.lineno}: {node.value!r}")
        elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith(settings.PREFIX):
            found.append(f"{path.name}:{node.value.lineno}: {node.arg}=")
    return found


def setting_names_used(path: Path) -> list[tuple[int, str]]:
    """(line, NAME) of every `settings.NAME` in the file (NAME in capitals: a declaration)."""
    tree = ast.parse(path.read_text())
    return [(n.lineno, n.attr) for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and isinstance(n.value, ast.Name) and n.value.id == "settings" and n.attr.isupper()]


def test_every_hpdl_variable_is_read_through_settings():
    found = [hit for path in _python_files() for hit in bypasses(path)]
    assert found == [], "read or set these through hpdl.settings (declare them there if new):\n" + "\n".join(found)


def test_the_bypass_scan_finds_what_it_looks_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""HPDL_DOCS may be named in prose."""\nimport os\n\n\n'
                      'def f(key, spec):\n'
                      '    a = os.environ.get("HPDL_A")\n'
                      '    b = os.environ["HPDL_B"]\n'
                      '    env = dict(os.environ, HPDL_C="1")\n'
                      '    d = os.environ.get(f"HPDL_SLURM_{key.upper()}")\n'
                      '    raise ValueError(f"HPDL_SITE={spec!r}: no such file")\n')
    assert [hit.split(":")[1] for hit in bypasses(sample)] == ["6", "7", "8", "9"]


def test_code_reads_only_declared_settings(tmp_path):
    undeclared = [f"{path.name}:{line}: settings.{name}" for path in [*_python_files()]
                  for line, name in setting_names_used(path) if name != "PREFIX"
                  and not isinstance(getattr(settings, name, None), settings.Setting)]
    assert undeclared == [], undeclared
    # the scan sees a setting that is not declared
    sample = tmp_path / "sample.py"
    sample.write_text("from hpdl import settings\n\nx = settings.NOT_DECLARED.get()\ny = settings.HOME.get()\n")
    assert setting_names_used(sample) == [(3, "NOT_DECLARED"), (4, "HOME")]
    assert not hasattr(settings, "NOT_DECLARED")
    with pytest.raises(HpdlError, match="HPDL_NOT_DECLARED is not a setting of the kit"):
        settings.lookup("HPDL_NOT_DECLARED")


def test_every_variable_the_scripts_name_is_declared():
    """The shell scripts keep reading their variables themselves, but the list documents them all."""
    missing = set()
    for path in SCRIPTS:
        if not path.is_file():
            continue
        for name in NAME.findall(path.read_text(errors="replace")):
            if name.endswith("_"):  # a prefix, e.g. "HPDL_SLURM_*" or "HPDL_HUB_*" in a comment
                ok = any(s.name.startswith(name) for s in settings.declared())
            else:
                try:
                    ok = bool(settings.lookup(name))
                except HpdlError:
                    ok = False
            if not ok:
                missing.add(f"{name} ({path.relative_to(ROOT)})")
    assert not missing, sorted(missing)


def test_declarations_are_complete():
    names = [s.name for s in settings.declared()]
    assert len(names) == len(set(names)) and all(n.startswith("HPDL_") for n in names)
    for s in settings.declared():
        assert s.help and s.readers and set(s.readers) <= set(settings.READERS), s
        assert s.default is not None or s.default_text or s.internal, f"{s.name}: say what unset means"
        if s.default is not None:
            s.parse(s.default)  # every default is a value the setting takes
    assert settings.lookup("HPDL_SLURM_PARTITION").name == "HPDL_SLURM_PARTITION"  # a family's member


@pytest.mark.parametrize("name, value, words", [
    ("HPDL_CELL_TIMEOUT", "soon", "a number of seconds > 0"),
    ("HPDL_CELL_TIMEOUT", "-5", "a number of seconds > 0"),
    ("HPDL_DEVICE", "gpu", "one of auto, cuda, cpu"),
    ("HPDL_HOROVOD_NICE", "25", "a whole number from 0 to 19"),
    ("HPDL_NO_SANDBOX", "maybe", "a flag: 1, true, yes, on (or 0, false, no, off)"),
    ("HPDL_GRADE_CHECK_WAIT", "an hour", "a number of seconds > 0"),
])
def test_a_bad_value_is_an_hpdl_error_naming_the_variable(monkeypatch, name, value, words):
    monkeypatch.setenv(name, value)
    with pytest.raises(HpdlError) as err:
        settings.lookup(name).get()
    assert str(err.value).startswith(f"{name}={value!r}: it takes {words}; unset it for the default")


def test_values_parse_to_their_types(monkeypatch, tmp_path):
    monkeypatch.setenv("HPDL_NO_SANDBOX", "0")  # was read as "set", so the sandbox was off
    assert settings.NO_SANDBOX.get() is False
    monkeypatch.setenv("HPDL_NO_SANDBOX", " Yes ")
    assert settings.NO_SANDBOX.get() is True
    monkeypatch.setenv("HPDL_CASES_PATH", f"{tmp_path}{os.pathsep}{os.pathsep}~/cases")
    assert settings.CASES_PATH.get() == [tmp_path, Path.home() / "cases"]
    monkeypatch.setenv("HPDL_HOME", "")  # empty is unset: the default, not the current folder
    assert settings.HOME.get() == Path.home() / ".hpdl"
    monkeypatch.delenv("HPDL_WORKSPACE", raising=False)
    assert settings.WORKSPACE.get() is None and not settings.WORKSPACE.is_set()


def test_settings_are_read_when_asked_for_not_at_import(monkeypatch):
    from hpdl.checker import grade_mode
    from hpdl.cluster import lifecycle

    monkeypatch.setenv("HPDL_CELL_TIMEOUT", "7.5")  # after hpdl.cluster was imported
    assert lifecycle._check_args(2, (), None)[2] == 7.5
    assert lifecycle._check_args(2, (), 3)[2] == 3.0  # the argument wins
    monkeypatch.setenv("HPDL_CELL_TIMEOUT", "never")
    with pytest.raises(HpdlError, match="HPDL_CELL_TIMEOUT='never'"):
        lifecycle._check_args(2, (), None)
    monkeypatch.setenv("HPDL_GRADE", "1")
    assert grade_mode() is True
    monkeypatch.setenv("HPDL_GRADE", "off")
    assert grade_mode() is False


def run_settings(*args: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("HPDL_")}
    return subprocess.run([sys.executable, "-m", "hpdl.cli", "settings", *args], capture_output=True, text=True,
                          env={**clean, **env}, timeout=60, cwd=ROOT)


def test_hpdl_settings_prints_every_setting_with_its_value_here():
    p = run_settings(HPDL_DEVICE="cpu", HPDL_SLURM_PARTITION="short", HPDL_GRADE_SERVICE="/tmp/x")
    assert p.returncode == 0, p.stderr
    for s in settings.declared():
        assert f"  {s.var} = " in p.stdout, s.name
    assert "  HPDL_DEVICE = cpu  (set)" in p.stdout
    assert "  HPDL_CELL_TIMEOUT = 300  (default)" in p.stdout
    assert "  HPDL_SLURM_<KEY> = HPDL_SLURM_PARTITION=short (set)" in p.stdout
    # internal settings are listed apart, after the ones users set
    internal = p.stdout.index("Set by the kit for its own processes")
    assert p.stdout.index("HPDL_GRADE_SERVICE = /tmp/x") > internal > p.stdout.index("HPDL_DEVICE = cpu")
    only = run_settings("--set", HPDL_DEVICE="cpu")
    assert [line for line in only.stdout.splitlines() if " = " in line] == ["  HPDL_DEVICE = cpu  (set)"]


def test_hpdl_settings_fails_on_a_bad_value_and_names_a_misspelt_one():
    p = run_settings(HPDL_HOROVOD_NICE="high", HPDL_DEVCE="cpu")
    assert p.returncode == 1
    assert "HPDL_HOROVOD_NICE='high': it takes a whole number from 0 to 19" in p.stdout
    assert "HPDL_DEVCE is not a setting of the kit: a misspelling?" in p.stdout
    helped = run_settings("--help")
    assert helped.returncode == 0 and "--markdown" in helped.stdout and "usage: hpdl settings" in helped.stdout


def test_docs_page_is_generated_from_the_declarations():
    page = ROOT / "docs" / "SETTINGS.md"
    p = run_settings("--markdown", HPDL_DEVICE="cpu")  # the page does not depend on this environment
    assert p.returncode == 0, p.stderr
    assert page.read_text() == p.stdout == settings.render_markdown(), \
        "docs/SETTINGS.md drifted from hpdl/settings.py: run `hpdl settings --markdown > docs/SETTINGS.md`"
    for s in settings.declared():
        assert f"| `{s.var}` |" in p.stdout
    internal = p.stdout.index("## Set by the kit for its own processes")
    assert p.stdout.index("`HPDL_CHECK_JOB`") > internal > p.stdout.index("`HPDL_HOME`")
    assert "](docs/SETTINGS.md)" in (ROOT / "README.md").read_text()
