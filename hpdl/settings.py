"""Every HPDL_* environment variable the kit knows, declared once: type, default, help, who reads it.

Why one list: the settings used to be read in twenty files, several documented nowhere but in the
code. Here each is declared once; code reads it through its declaration (`settings.HOME.get()`)
and names it through it when it sets one for a child process (`env[settings.GRADE.name] = "1"`),
so adding or renaming a setting is one line here. `hpdl settings` prints them with their values
here, `hpdl settings --markdown` writes docs/SETTINGS.md, and `hpdl doctor` shows the ones set.

Values are read when asked for, never at import: a notebook that sets os.environ before
hpdl.start() is heard. A value that does not parse raises HpdlError naming the variable and what
it takes. Ranks read settings too, so this module imports only the standard library and
hpdl.errors.

    hpdl settings              # every setting: its value here (set or default), type and help
    hpdl settings --markdown   # the same as the docs page
"""
from __future__ import annotations

import argparse
import os
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from hpdl.errors import HpdlError

PREFIX = "HPDL_"  # every setting's name starts so; launchers pass all of them on to the ranks

# who reads a setting, in the words the list uses
READERS = {
    "kernel": "the notebook's kernel and the `hpdl` commands",
    "rank": "every MPI rank (an engine)",
    "check": "a check's MPI jobs",
    "grader": "`hpdl grade` and the submissions' kernels",
    "hub": "the workshop hub (cluster/jupyterhub/jupyterhub_config.py)",
    "scripts": "the shell scripts under cluster/ and benchmarks/, and the Makefile",
    "tests": "the test suite and CI",
}

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ValueError(raw)


def _seconds(raw: str) -> float:
    value = float(raw)
    if not value > 0:
        raise ValueError(raw)
    return value


def _paths(raw: str) -> list[Path]:
    return [Path(p).expanduser() for p in raw.split(os.pathsep) if p.strip()]


# kind: (what the value must be, in words; the parser, which raises ValueError on a bad value)
KINDS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "text": ("text", str),
    "flag": ("a flag: 1, true, yes, on (or 0, false, no, off)", _flag),
    "int": ("a whole number", int),
    "seconds": ("a number of seconds > 0", _seconds),
    "path": ("a path", lambda raw: Path(raw).expanduser()),
    "paths": (f"paths separated by {os.pathsep!r}", _paths),
    "choice": ("one of", str),
}


@dataclass(frozen=True)
class Setting:
    """One environment variable: what it takes, its default, what it is for and who reads it.

    `default` is text as it would be set (parsed like a set value); None means the code that reads
    it decides, as `default_text` says. `internal`: set by the kit for its own processes, not by
    users. `family`: `name` is a prefix, one variable per key (HPDL_SLURM_<KEY>)."""

    name: str
    kind: str
    default: str | None
    help: str
    readers: tuple[str, ...]
    internal: bool = False
    choices: tuple[str, ...] = ()
    bounds: tuple[int, int | None] | None = None  # (least, most or None)
    default_text: str = ""
    family: bool = False

    @property
    def var(self) -> str:
        """The variable as written in the docs (a family's with <KEY>)."""
        return f"{self.name}<KEY>" if self.family else self.name

    def raw(self, env: Mapping[str, str] | None = None) -> str | None:
        """The value as set (stripped); None when unset or empty."""
        value = (os.environ if env is None else env).get(self.name)
        return value.strip() if value is not None and value.strip() else None

    def is_set(self, env: Mapping[str, str] | None = None) -> bool:
        """Set to something (an empty value counts as unset, as `VAR= command` means in a shell)."""
        return self.raw(env) is not None

    def get(self, env: Mapping[str, str] | None = None) -> Any:
        """The value, parsed: the set one, else the default (None where the reader decides)."""
        raw = self.raw(env)
        return self.default_value() if raw is None else self.parse(raw)

    def default_value(self) -> Any:
        """The default, parsed (None where the reader decides)."""
        return None if self.default is None else self.parse(self.default)

    def parse(self, raw: str) -> Any:
        """`raw` as this setting's type; HpdlError naming the variable and what it takes."""
        parser = KINDS[self.kind][1]
        try:
            value = parser(raw)
            if self.choices and value not in self.choices:
                raise ValueError(raw)
            low, high = self.bounds or (value, value)
            if value < low or (high is not None and value > high):
                raise ValueError(raw)
        except ValueError:
            raise HpdlError(f"{self.name}={raw!r}: it takes {self.takes()}; "
                            f"unset it for the default ({self.shown_default()}).") from None
        return value

    def takes(self) -> str:
        """What a value must be, in the words the error messages and the docs use."""
        if self.choices:
            return "one of " + ", ".join(self.choices)
        if self.bounds:
            low, high = self.bounds
            return f"{KINDS[self.kind][0]} " + (f"from {low} to {high}" if high is not None else f"≥ {low}")
        return KINDS[self.kind][0]

    def shown_default(self) -> str:
        """The default as a reader sees it: the declared text, else the value, else "unset"."""
        if self.default_text:
            return self.default_text
        return "unset" if not self.default else self.default

    def of(self, key: str) -> Setting:
        """A family's variable for one key: HPDL_SLURM_ and "partition" give HPDL_SLURM_PARTITION."""
        if not self.family:
            raise TypeError(f"{self.name} is one variable, not a family")
        return Setting(self.name + key.upper(), self.kind, None, f"{self.help} ({key})", self.readers,
                       self.internal)

    def members(self, env: Mapping[str, str] | None = None) -> dict[str, str]:
        """A family's variables that are set (not empty): {name: value}."""
        env = os.environ if env is None else env
        return {k: v for k, v in sorted(env.items()) if k.startswith(self.name) and k != self.name and v.strip()}


_ALL: dict[str, Setting] = {}


def _declare(name: str, kind: str, default: str | None, help: str, readers: tuple[str, ...], **more: Any) -> Setting:
    if kind not in KINDS or not name.startswith(PREFIX) or name in _ALL:
        raise TypeError(f"bad declaration of {name} ({kind})")
    if set(readers) - set(READERS):
        raise TypeError(f"{name}: readers are among {', '.join(READERS)}")
    _ALL[name] = Setting(name, kind, default, help, readers, **more)
    return _ALL[name]


# -- the kit (Python) --------------------------------------------------------------------------------
HOME = _declare("HPDL_HOME", "path", "~/.hpdl", "where the kit keeps its IPython profile, the clusters' run "
                "folders and the reaper's state", ("kernel", "rank", "grader", "scripts"))
SITE = _declare("HPDL_SITE", "text", None, "the site profile: a name in cluster/sites (generic, ...) or a .toml "
                "path; its Slurm settings, modules and environment for the ranks", ("kernel", "hub", "scripts"),
                default_text="none (the hub: generic)")
SLURM = _declare("HPDL_SLURM_", "text", None, "overrides one [slurm] key of the site profile, e.g. "
                 "HPDL_SLURM_PARTITION, HPDL_SLURM_ACCOUNT (keys and types: `python -m hpdl.sites`)",
                 ("kernel", "hub", "scripts"), family=True, default_text="the site profile's")
LAUNCHER = _declare("HPDL_LAUNCHER", "text", "auto", "how hpdl.start() starts ranks when not told: a launcher's "
                    "name (local, slurm, ...); auto: Slurm inside an allocation, else the local mpiexec",
                    ("kernel",))
CELL_TIMEOUT = _declare("HPDL_CELL_TIMEOUT", "seconds", "300", "the time limit of a %%px cell, and of a blocking "
                        "call on hpdl.view() (pull, push, apply_sync), when neither hpdl.start(cell_timeout=...) nor "
                        "%%px --timeout gives one", ("kernel",))
NODES = _declare("HPDL_NODES", "int", "0", "emulated nodes hpdl.start() puts its ranks on when not told "
                 "(nodes=...): network namespaces joined by rate-limited links, as root or in a user namespace "
                 "(docs/EMULATED_NODES.md; a site profile's [emulated] nodes when unset); "
                 "0: none", ("kernel",), bounds=(0, 64))
LINK = _declare("HPDL_LINK", "text", "1gbit", "each emulated node's link rate when hpdl.start(link=...) does not "
                "say, in tc's spelling (200mbit, 1gbit); unset: the site profile's [emulated] link, else 1gbit",
                ("kernel",))
DEVICE = _declare("HPDL_DEVICE", "choice", "auto", "each rank's device: auto uses one GPU per rank when every "
                  "rank can have its own, else the CPU (and says why); cuda refuses to start without; cpu on "
                  "purpose", ("rank",), choices=("auto", "cuda", "cpu"))
HOROVOD_NICE = _declare("HPDL_HOROVOD_NICE", "int", "0", "niceness of Horovod's background thread on CPU ranks: "
                        "10 when timing other work on ranks that have Horovod started (0 leaves it alone)",
                        ("rank",), bounds=(0, 19))
WORKSPACE = _declare("HPDL_WORKSPACE", "path", None, "the learner's own folder: `hpdl exercises` copies the "
                     "lessons, exercises and benchmarks there, and the job scripts, the Open OnDemand app, the "
                     "hub's job and the container open JupyterLab in it", ("kernel", "scripts"),
                     default_text="workspace/ in the kit when the learner may write there (their own clone), "
                     "else ~/hpdl-workspace")
CASES_PATH = _declare("HPDL_CASES_PATH", "paths", "", "more folders of exercise checks (a course's own "
                      "cases), searched after hpdl/checker/cases", ("kernel", "grader"))
KEYS = _declare("HPDL_KEYS", "path", None, "the instructor's answer keys (`hpdl keys export --to DIR`): full "
                "case modules with reference solutions and hidden cases, searched before hpdl/checker/cases; "
                "`hpdl grade --keys DIR` sets it", ("kernel", "grader"), default_text="none: the kit's own cases")
NO_SANDBOX = _declare("HPDL_NO_SANDBOX", "flag", "0", "run learners' check jobs without the bubblewrap sandbox "
                      "(rlimits and a process group only); benchmarks compare both", ("kernel", "grader"))
BWRAP = _declare("HPDL_BWRAP", "path", None, "the bubblewrap binary for the sandbox", ("kernel", "grader"),
                 default_text="bwrap on PATH")
FORKSERVER = _declare("HPDL_FORKSERVER", "flag", "1", "start ranks that use torch as forks of one process that "
                      "imported torch once (hpdl/forkserver.py): a check's jobs, and hpdl.start()'s engines on this "
                      "machine (not on emulated nodes or through a batch system); 0 starts each rank afresh",
                      ("kernel", "grader"))
CHECK_KEEP = _declare("HPDL_CHECK_KEEP", "flag", "0", "keep each check's job folders (inputs, outputs, logs) "
                      "instead of removing them: for debugging a check", ("kernel", "grader"))
GRADE = _declare("HPDL_GRADE", "flag", "0", "grade mode: hpdl.check() runs the hidden cases with the "
                 "exercise's own rank counts and time limits, whatever the call asks; `hpdl grade` sets it",
                 ("kernel", "grader"))
GRADE_CHECK_WAIT = _declare("HPDL_GRADE_CHECK_WAIT", "seconds", "3600", "under `hpdl grade`: how long a "
                            "submission's hpdl.check() waits for the grader's answer", ("grader",))
GRADE_RESULTS = _declare("HPDL_GRADE_RESULTS", "path", None, "a file every hpdl.check() result is appended to "
                         "as a JSON line (the notebook tests read it)", ("kernel", "tests"),
                         default_text="none")

# -- set by the kit for its own processes -------------------------------------------------------------
GRADE_SERVICE = _declare("HPDL_GRADE_SERVICE", "path", None, "set by `hpdl grade` for a submission's kernel: "
                         "the folder its hpdl.check() calls send their requests to", ("grader",), internal=True)
SIDE_JOB = _declare("HPDL_SIDE_JOB", "text", None, "set by hpdl.sidejob in every side job it starts: the job's "
                    "marker, by which it finds a process that left the job's tree and group",
                    ("check", "grader"), internal=True)
CHECK_JOB = _declare("HPDL_CHECK_JOB", "path", None, "set by the checker for a check's ranks: the job's folder",
                     ("check",), internal=True)
HUB_ENV = _declare("HPDL_HUB_ENV", "path", None, "set by the hub in each learner's job: the hub's packages for "
                   "the learner's side (bin/jupyterhub-singleuser) for singleuser.sbatch", ("scripts",), internal=True)
HUB_SITE_PACKAGES = _declare("HPDL_HUB_SITE_PACKAGES", "path", None, "set by the hub in each learner's job: "
                             "the hub venv's packages (batchspawner) for singleuser.sbatch", ("scripts",),
                             internal=True)
JUPYTER_CONFIG = _declare("HPDL_JUPYTER_CONFIG", "path", None, "set by the Open OnDemand app's before.sh: "
                          "JupyterLab's config file for script.sh", ("scripts",), internal=True)

# -- the workshop hub and the job scripts ---------------------------------------------------------------
DIR = _declare("HPDL_DIR", "path", None, "the kit's folder, installed once and shared (read-only is fine) "
               "with the compute nodes: the job scripts, the hub, `hpdl exercises` and the site profiles' "
               "`setup` lines read the kit through it", ("kernel", "rank", "hub", "scripts"),
               default_text="the kit the running hpdl package belongs to (job scripts: the one the job's "
               "script is in, else the submit folder)")
PYTHON = _declare("HPDL_PYTHON", "path", None, "the Python a job script runs the kit with", ("scripts",),
                  default_text="$HPDL_DIR/.venv/bin/python")
KIT_VENV = _declare("HPDL_KIT_VENV", "path", None, "the kit's venv the hub's learners run, runnable by all",
                    ("hub", "scripts"), default_text="$HPDL_DIR/.venv")
HUB_PREFIX = _declare("HPDL_HUB_PREFIX", "path", "/opt/hpdl-hub", "where cluster/jupyterhub/install.sh installs "
                      "the hub: root-owned, outside the kit (its venv, config, proxy and the learners' hub packages)",
                      ("scripts",))
HUB_PYTHON = _declare("HPDL_HUB_PYTHON", "path", None, "the Python install.sh makes the hub's venv from: root-owned, "
                      "the kit's Python version", ("scripts",), default_text="the kit venv's base Python")
HUB_STATE = _declare("HPDL_HUB_STATE", "path", "/var/lib/hpdl-hub", "the hub's database, cookie secret and pid "
                     "file (root only)", ("hub",))
HUB_LOG_DIR = _declare("HPDL_HUB_LOG_DIR", "path", "/var/log/hpdl-hub", "the hub's and the idle culler's logs "
                       "(jupyterhub.log, idle-culler.log; rotated at 20 MB, 10 kept)", ("hub",))
HUB_SSL_CERT = _declare("HPDL_HUB_SSL_CERT", "path", None, "the hub's TLS certificate (PEM, with its chain); the "
                        "hub refuses to start without one unless HPDL_HUB_TLS_PROXY=1", ("hub",), default_text="none")
HUB_SSL_KEY = _declare("HPDL_HUB_SSL_KEY", "path", None, "the private key of HPDL_HUB_SSL_CERT (root only)", ("hub",),
                       default_text="none")
HUB_TLS_PROXY = _declare("HPDL_HUB_TLS_PROXY", "flag", "0", "a TLS-terminating proxy is in front: the hub serves "
                         "plain HTTP, on a loopback or internal address only", ("hub",))
HUB_BIND_URL = _declare("HPDL_HUB_BIND_URL", "text", None, "where learners' browsers (or the TLS proxy) reach the "
                        "hub", ("hub",), default_text="https://:443; behind a TLS proxy http://127.0.0.1:8000")
HUB_API_IP = _declare("HPDL_HUB_API_IP", "text", None, "the internal address the hub's API listens on, which the "
                      "compute nodes reach (never 0.0.0.0)", ("hub",),
                      default_text="the address HPDL_HUB_CONNECT_HOST resolves to")
HUB_API_PORT = _declare("HPDL_HUB_API_PORT", "int", "8081", "the hub API's port", ("hub",), bounds=(1, 65535))
HUB_GROUP = _declare("HPDL_HUB_GROUP", "text", "hpdl-learners", "the Unix group whose members may log in",
                     ("hub",))
HUB_INSTRUCTORS = _declare("HPDL_HUB_INSTRUCTORS", "text", "", "instructors' user names, comma-separated: they "
                           "may log in, list and stop learners' servers, never open them", ("hub",))
HUB_RANKS = _declare("HPDL_HUB_RANKS", "int", "4", "Slurm tasks per learner (the ranks hpdl.start may use)",
                     ("hub",), bounds=(1, None))
HUB_TIME = _declare("HPDL_HUB_TIME", "text", None, "a learner's job's time limit", ("hub",),
                    default_text="the site profile's, else 02:00:00")
HUB_PARTITION = _declare("HPDL_HUB_PARTITION", "text", None, "the learners' jobs' partition", ("hub",),
                         default_text="the site profile's")
HUB_ACCOUNT = _declare("HPDL_HUB_ACCOUNT", "text", None, "the account the learners' jobs are charged to",
                       ("hub",), default_text="the site profile's")
HUB_QOS = _declare("HPDL_HUB_QOS", "text", None, "the learners' jobs' quality of service", ("hub",),
                   default_text="the site profile's")
HUB_RESERVATION = _declare("HPDL_HUB_RESERVATION", "text", None, "the Slurm reservation the learners' jobs run "
                           "in (sbatch --reservation)", ("hub",), default_text="none")
HUB_SBATCH = _declare("HPDL_HUB_SBATCH", "text", "", "extra #SBATCH options, after the profile's", ("hub",))
HUB_MODULES = _declare("HPDL_HUB_MODULES", "text", "", "what the learners' jobs `module load`", ("hub",))
HUB_IDLE_TIMEOUT = _declare("HPDL_HUB_IDLE_TIMEOUT", "int", "3600", "seconds without use before a learner's "
                            "server is stopped (its job cancelled)", ("hub",), bounds=(1, None))
HUB_CULL_EVERY = _declare("HPDL_HUB_CULL_EVERY", "int", "300", "how often the idle culler looks, in seconds",
                          ("hub",), bounds=(1, None))
HUB_CONNECT_HOST = _declare("HPDL_HUB_CONNECT_HOST", "text", None, "the hub's name as compute nodes reach it",
                            ("hub",), default_text="this host's name")
HUB_SITE_CONFIG = _declare("HPDL_HUB_SITE_CONFIG", "path", None, "a Python file the hub's config loads last, for "
                           "anything else (an LDAP or OAuth authenticator, more services); root's alone",
                           ("hub",),
                           default_text="none")
LAB_PORT = _declare("HPDL_LAB_PORT", "int", None, "JupyterLab's port in cluster/slurm/jupyter.sbatch",
                    ("scripts",), default_text="a free port", bounds=(1, 65535))
WHEELHOUSE = _declare("HPDL_WHEELHOUSE", "path", "~/.cache/hpdl/wheels", "where cluster/build/horovod.sh keeps "
                      "the Horovod wheels it built, one per MPI", ("scripts",))
REAL_CXX = _declare("HPDL_REAL_CXX", "text", "g++", "the C++ compiler behind cluster/build/cxx17 (the wrapper "
                    "Horovod's build uses)", ("scripts",))

# -- the test suite and CI --------------------------------------------------------------------------------
TEST_MPI = _declare("HPDL_TEST_MPI", "choice", None, "set by `make test-mpi MPI=...`: the MPI the suite checks "
                    "it runs on", ("tests",), choices=("mpich", "openmpi", "impi"), default_text="unset")
TEST_CELL_TIMEOUT = _declare("HPDL_TEST_CELL_TIMEOUT", "int", "300", "the notebook tests' time limit per cell",
                             ("tests",), bounds=(1, None))
CUDA_SCRATCH = _declare("HPDL_CUDA_SCRATCH", "path", "~/.cache/hpdl/cuda-build", "the CUDA build test's "
                        "cache of nvcc and NCCL", ("tests",))
CI_OPENMPI_BEFORE_MIN = _declare("HPDL_CI_OPENMPI_BEFORE_MIN", "int", "33", "CI runs its Open MPI set only when "
                                 "the rest took less than this many minutes", ("tests",), bounds=(0, None))


def declared() -> list[Setting]:
    """Every setting, in the order of the list above."""
    return list(_ALL.values())


def lookup(name: str) -> Setting:
    """The declaration of `name` (a family's member too); HpdlError when it is not a setting."""
    if name in _ALL:
        return _ALL[name]
    family = next((s for s in _ALL.values() if s.family and name.startswith(s.name)), None)
    if family is None:
        raise HpdlError(f"{name} is not a setting of the kit; `hpdl settings` lists them.")
    return family.of(name[len(family.name):])


def user_set(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The settings set here (not internal ones), {name: value as set}, family members included."""
    found: dict[str, str] = {}
    for s in declared():
        if s.family:
            found.update(s.members(env))
        elif not s.internal and s.is_set(env):
            found[s.name] = s.raw(env) or ""
    return found


def problems(env: Mapping[str, str] | None = None) -> tuple[list[str], list[str]]:
    """(bad values, unknown names) among the HPDL_* variables set here: one message per bad value,
    and the names that are no setting (a misspelt name is otherwise silently ignored)."""
    env = os.environ if env is None else env
    bad, unknown = [], []
    for name in sorted(k for k in env if k.startswith(PREFIX)):
        try:
            setting = lookup(name)
        except HpdlError:
            unknown.append(name)
            continue
        try:
            setting.get(env)
        except HpdlError as exc:
            bad.append(str(exc))
    return bad, unknown


# -- `hpdl settings` ------------------------------------------------------------------------------------
GROUPS = {
    "kit": "The kit",
    "hub": "The workshop hub and the job scripts",
    "tests": "The test suite and CI",
    "internal": "Set by the kit for its own processes (not for you to set)",
}


def group(s: Setting) -> str:
    """Which part of the list a setting is shown in, from whom it is for."""
    if s.internal:
        return "internal"
    if set(s.readers) & {"kernel", "rank", "check", "grader"}:
        return "kit"
    return "tests" if set(s.readers) <= {"tests"} else "hub"


def _value(s: Setting, env: Mapping[str, str] | None) -> str:
    if s.family:
        members = s.members(env)
        return " ".join(f"{k}={v}" for k, v in members.items()) + " (set)" if members else "(none set)"
    raw = s.raw(env)
    return f"{raw}  (set)" if raw is not None else f"{s.shown_default()}  (default)"


def render_text(env: Mapping[str, str] | None = None, only_set: bool = False) -> str:
    """Every setting (or those set here) with its value here, what it takes, who reads it and why."""
    lines = ["hpdl settings: the HPDL_* environment variables the kit reads (docs/SETTINGS.md)"]
    for key, title in GROUPS.items():
        rows = [s for s in declared() if group(s) == key and (not only_set or _value(s, env).endswith("(set)"))]
        if rows:
            lines += ["", f"{title}:"]
        for s in rows:
            lines.append(f"  {s.var} = {_value(s, env)}")
            lines.append(textwrap.fill(f"{s.takes()}; read by {', '.join(s.readers)}. {s.help}", 100,
                                       initial_indent=" " * 6, subsequent_indent=" " * 6))
    bad, unknown = problems(env)
    if bad or unknown:
        lines += ["", "Problems:", *(f"  {m}" for m in bad),
                  *(f"  {n} is not a setting of the kit: a misspelling?" for n in unknown)]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def render_markdown() -> str:
    """docs/SETTINGS.md: every declaration, nothing of this environment (the page is generated)."""
    lines = ["# Settings", "",
             "<!-- generated from hpdl/settings.py by `hpdl settings --markdown > docs/SETTINGS.md`; "
             "tests/test_settings.py fails when it drifts -->", "",
             "Every `HPDL_*` environment variable the kit reads, declared once in `hpdl/settings.py`. "
             "`hpdl settings` prints each with its value here (set or default); `hpdl doctor` shows the ones "
             "set and fails on a value that does not parse.", ""]
    for key, title in GROUPS.items():
        lines += [f"## {title}", "", "| variable | takes | default | read by | what for |", "|---|---|---|---|---|"]
        for s in (s for s in declared() if group(s) == key):
            default = s.default_text or (f"`{s.default}`" if s.default else "unset")
            lines.append(f"| `{s.var}` | {_cell(s.takes())} | {_cell(default)} | {', '.join(s.readers)} "
                         f"| {_cell(s.help)} |")
        lines.append("")
    lines += ["Read by: " + "; ".join(f"**{k}**: {v}" for k, v in READERS.items()) + "."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """`hpdl settings`: the list, with this environment's values, or the docs page."""
    ap = argparse.ArgumentParser(
        prog="hpdl settings",
        description="Print every HPDL_* setting the kit reads: its value here (set or default), what it "
                    "takes, who reads it and what it is for. Exit 1 when a value set here does not parse.")
    ap.add_argument("--set", dest="only_set", action="store_true", help="only the settings set here")
    ap.add_argument("--markdown", action="store_true",
                    help="the docs page (docs/SETTINGS.md), from the declarations alone")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(render_markdown())
        return 0
    print(render_text(only_set=args.only_set))
    return 1 if problems()[0] else 0


if __name__ == "__main__":
    sys.exit(main())
