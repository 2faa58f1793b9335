"""Every command in the instructor docs (cluster/*.md, cluster/*/*.md) is checked as written.

Each fenced block is listed below with what can be done with it here and why: run as written
("run"), its `hpdl` commands' flags checked against their --help ("help"), its make targets
dry-run ("make-n"), or its paths checked only ("paths", e.g. module loads of a GPU site);
outputs and TOML are not commands ("skip"). In every command block, each path it names in the
kit (cluster/..., benchmarks/..., .venv/bin/..., and /shared/courses/hpdl/... — the docs' example
install, which is this kit) must exist. A block the list does not know fails the test, so a new
block gets a decision; a placeholder such as <yoursite> is filled with a profile that works here.
Cheap by design (about 15 s): nothing that takes minutes runs; what does is named.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from test_slurm import slurm  # noqa: F401  (the local Slurm: started once, stopped at the end if we started it)

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted(ROOT.glob("cluster/*.md")) + sorted(ROOT.glob("cluster/*/*.md"))
SHARED_KIT = "/shared/courses/hpdl"  # the docs' example install folder: this kit
# $KIT: the install of §1; the wheelhouse holds a copy of cluster/build/offline-install.sh
PLACEHOLDERS = {"<yoursite>": "local-slurm", "$KIT": SHARED_KIT,
                "$WHEELS/offline-install.sh": "cluster/build/offline-install.sh"}

# (doc, the start of the block's first line) -> (what is done with it here, why)
BLOCKS = {
    ("cluster/MPI.md", "make lab MPI=openmpi"): ("make-n", "each installs another MPI and Horovod (minutes); "
                                                 "`make test-mpi` runs them"),
    ("cluster/MPI.md", "hpdl doctor — /work/wt/mpi/.venv/bin"): ("skip", "the doctor's output"),
    ("cluster/MPI.md", "hpdl doctor — /work/wt/mpi/.venv-open"): ("skip", "the doctor's output"),
    ("cluster/MPI.md", "hpdl doctor — /work/wt/mpi/.venv-impi"): ("skip", "the doctor's output"),
    ("cluster/MPI.md", " FAIL  mpiexec on PATH"): ("skip", "the doctor's output"),
    ("cluster/MPI.md", 'modules = ["cray-mpich"]'): ("skip", "a site profile's lines (TOML)"),
    ("cluster/README.md", "WHEELS=/shared/hpdl-wheels"): ("paths", "tests/test_offline_install.py runs it as written, "
                                                          "offline (minutes)"),
    ("cluster/README.md", "module load cuda/12.6 openmpi/5.0"): ("paths", "a GPU site's modules and CUDA build"),
    ("cluster/README.md", "HPDL_SITE=<yoursite> $KIT/.venv/bin/hpdl"): ("run", "the profile check, cheap here"),
    ("cluster/README.md", "$KIT/.venv/bin/hpdl preflight --site"): ("help", "2 nodes; tests/test_preflight.py runs it "
                                                               "on the local Slurm"),
    ("cluster/README.md", "$ hpdl preflight --site local.toml"): ("skip", "preflight's output"),
    ("cluster/README.md", "NO-GO  rank 0 (local 0)"): ("skip", "preflight's output"),
    ("cluster/README.md", "salloc -n 4 -t 10"): ("paths", "an interactive allocation; tests/test_slurm.py starts "
                                                 "ranks inside one"),
    ("cluster/build/README.md", "# NCCL (nccl-gpu.toml), on a login"): ("paths", "a GPU site's wheelhouse (CUDA "
                                                                          "modules, download.pytorch.org)"),
    ("cluster/build/README.md", "module load cuda/12.6"): ("paths", "a GPU site's CUDA build of torch"),
    ("cluster/build/README.md", "# NCCL (NVLink in a node"): ("paths", "GPU builds of Horovod (NCCL, MVAPICH2-GDR)"),
    ("cluster/build/README.md", 'python -c "import horovod.torch'): ("run", "Horovod's build report, seconds"),
    ("cluster/build/README.md", "sbatch -N 2 --ntasks-per-node=4"): ("paths", "two GPU nodes"),
    ("cluster/jupyterhub/README.md", "# 1. The kit, once"): ("paths", "root, accounts, a certificate and a hub: "
                                                                 "tests/test_hub.py runs them"),
    ("cluster/jupyterhub/README.md", "# /etc/sudoers.d/hpdl-hub"): ("skip", "a sudoers rule (a file's lines)"),
    ("cluster/ood/README.md", "sudo cp -r cluster/ood/hpdl-jupyter"): ("paths", "an OnDemand web node; "
                                                                        "tests/test_ood.py runs the app"),
    ("cluster/README.md", "$KIT/.venv/bin/hpdl rehearse --site"): ("help", "4 learners' jobs (minutes); "
                                                              "tests/test_course.py rehearses on the local Slurm"),
    ("cluster/README.md", "$KIT/.venv/bin/hpdl course end --site"): ("help", "needs the course's learners' group; "
                                                               "tests/test_course.py runs a dry run and a teardown"),
    ("cluster/README.md", "echo '0 6 * * * root"): ("paths", "a cron line for the teardown's date"),
    ("cluster/README.md", "$KIT/.venv/bin/hpdl keys export --to"): ("help", "it would strip this kit; tests/"
                                                                  "test_keys.py exports, strips and grades a copy"),
    ("cluster/README.md", "# once, as root: a cgroup for the instructor"): ("skip", "root's cgroups for an instructor "
                                                                               "account; tests/test_grade_hostile.py "
                                                                               "grades so as nobody"),
    ("cluster/slurm/README.md", "cluster/slurm/local-slurm.sh start"): ("run", "the local Slurm the tests use; its "
                                                                        "`stop` line is left out (below)"),
}
# lines of a "run" block left out here, and why
NOT_RUN = [
    (re.compile(r"local-slurm\.sh stop"), "it would end every job on this machine, other tests' too"),
    (re.compile(r"\bhpdl doctor\b"), "tests/test_doctor.py runs the doctor (20 s here); its flags are checked"),
    (re.compile(r"^horovodrun --check-build"), "imports every framework again (20-80 s here); the line above "
                                               "reports the same build"),
]
PATH_TOKEN = re.compile(r"^(?:\./)?(?:(?:cluster|benchmarks|notebooks|exercises|solutions|hpdl|tests|docs)/[\w./-]+"
                        r"|\.venv/bin/[\w.-]+|requirements\.txt|environment\.yml|Makefile|pyproject\.toml"
                        r"|[\w.-]+/[\w./-]*\.(?:toml|sh|py|ipynb|sbatch|yml|def|txt))$")  # any relative file path


def blocks() -> list[tuple[str, int, str, str]]:
    """(doc, line of the fence, first line, text) of every fenced block in the instructor docs."""
    found = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
            first = m.group(2).splitlines()[0] if m.group(2).strip() else ""
            found.append((str(doc.relative_to(ROOT)), text.count("\n", 0, m.start()) + 1, first, m.group(2)))
    return found


def entry(doc: str, first: str) -> tuple[str, str]:
    keys = [k for k in BLOCKS if k[0] == doc and first.startswith(k[1])]
    assert len(keys) == 1, f"{doc}: the block starting {first!r} is not in BLOCKS: say what runs here, and why"
    return BLOCKS[keys[0]]


def commands(text: str) -> list[str]:
    """The block's commands: continuation lines joined, comments and blank lines dropped, the
    placeholders filled and the example install mapped to this kit."""
    joined = re.sub(r"\\\n\s*", " ", text)
    out = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            for k, v in PLACEHOLDERS.items():
                line = line.replace(k, v)
            out.append(line.replace(SHARED_KIT, str(ROOT)))
    return out


def named_paths(line: str) -> list[str]:
    tokens = re.split(r"[\s=;&|()\"'`$]+", line)
    return [t.rstrip(".,:") for t in tokens if PATH_TOKEN.match(t.rstrip(".,:"))
            or t.startswith(str(ROOT) + "/")]


def environment() -> dict[str, str]:
    """The shell an instructor has in the kit's folder: its venv first, this kit's package."""
    return {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": str(ROOT)}


def run_line(line: str) -> None:
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", line], cwd=ROOT, env=environment(), capture_output=True,
                       text=True, timeout=120, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, f"`{line}` failed ({p.returncode}):\n{p.stdout[-1500:]}{p.stderr[-1500:]}"


def check_help(line: str) -> None:
    """An `hpdl VERB ...` line: the verb exists and every --flag it passes is in the verb's --help."""
    words = shlex.split(line)
    at = next((i for i, w in enumerate(words) if w == "hpdl" or w.endswith("/hpdl")), None)
    if at is None or at + 1 >= len(words):
        return
    verb = words[at + 1]
    p = subprocess.run([sys.executable, "-m", "hpdl.cli", verb, "--help"], cwd=ROOT, env=environment(),
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"`hpdl {verb} --help` failed: {p.stderr[-1000:]}"
    for flag in (w.split("=")[0] for w in words[at + 2:] if w.startswith("--")):
        assert flag in p.stdout, f"`{line}`: hpdl {verb} has no {flag}:\n{p.stdout}"


def check_make(line: str) -> None:
    p = subprocess.run(["make", "-n", *shlex.split(line)[1:]], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, f"`{line}`: make -n failed:\n{p.stderr[-1000:]}"


def test_every_block_of_the_instructor_docs_is_known_and_every_block_listed_exists():
    found = blocks()
    kinds = {(doc, first): entry(doc, first)[0] for doc, _, first, _ in found}
    assert set(k for k, _ in BLOCKS.values()) <= {"run", "help", "make-n", "paths", "skip"}
    listed_but_gone = [k for k in BLOCKS if not any(d == k[0] and f.startswith(k[1]) for d, f in kinds)]
    assert not listed_but_gone, f"BLOCKS names blocks the docs no longer have: {listed_but_gone}"
    assert sum(kind == "run" for kind in kinds.values()) >= 3


@pytest.mark.parametrize("doc, line, first, text", blocks(), ids=[f"{b[0]}:{b[1]}" for b in blocks()])
def test_the_docs_block_runs_here_or_names_only_paths_that_exist(doc, line, first, text, request):
    kind, why = entry(doc, first)
    if kind == "skip":
        pytest.skip(f"not commands: {why}")
    if kind == "run" and "local-slurm.sh" in text:
        request.getfixturevalue("slurm")  # started (and later stopped) as for every Slurm test
    lines = commands(text)
    missing = sorted({p for line in lines for p in named_paths(line) if not (ROOT / p).exists()})
    assert not missing, f"{doc}: the block starting {first!r} names paths the kit does not have: {missing}"
    for command in lines:
        left_out = next((reason for pattern, reason in NOT_RUN if pattern.search(command)), None)
        if kind == "run" and not left_out:
            run_line(command)
        elif kind == "help" or (kind == "run" and "hpdl" in command):
            check_help(command)
        elif kind == "make-n" and command.startswith("make "):
            check_make(command)
