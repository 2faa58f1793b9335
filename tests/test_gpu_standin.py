"""The GPU path on CPU ranks: every rank as if it had its own GPU behind NCCL, under Slurm's per-task binding.

tests/fixtures/gpu_standin/ is loaded into every Python started with it on PYTHONPATH (its
sitecustomize): torch.cuda reports the GPUs CUDA_VISIBLE_DEVICES leaves each rank (one per task, as
`srun --gpus-per-task=1` sets it, or all of them), every tensor carries where it would live, and a
collective, a send/recv or DDP handed a tensor that is not on the rank's GPU fails as NCCL would, naming
the line (a notebook's cell) and the tensor. Real ranks, real torch.distributed (Gloo underneath).

What it catches, each seen failing on the code before its fix: a lesson handing a CPU model or tensor
to DDP or to dist.send/recv; `set_device(local_rank)` where a rank sees one GPU (train_ddp.py); counting
GPUs by label (preflight); a CPU tensor all-reduced in benchmarks/synthetic.py.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError, CellTimeoutError
from test_train_script import as_srun_tasks
from traitlets.config import Config

from hpdl import cli, devices

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
STANDIN = ROOT / "tests" / "fixtures" / "gpu_standin"
TIMEOUT = 300
# what uses torch.distributed or Horovod on the ranks: the cells the stand-in must see
USES_COLLECTIVES = re.compile(r"\bdist\.|\bDDP\(|\bhvd\.|torch\.distributed|hpdl\.start\(")


def standin_env(mode: str = "per-task", gpus: int = 4, base: dict | None = None) -> dict:
    env = dict(base if base is not None else os.environ)
    env.update(GPU_STANDIN=mode, GPU_STANDIN_GPUS=str(gpus),
               PYTHONPATH=os.pathsep.join([str(STANDIN), str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def _run(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT} s:\n{exc.stdout}\n{exc.stderr}")


def _errors(stderr: str) -> str:
    """The error lines of the ranks' output (each rank's exception, not its whole traceback)."""
    lines = [s for s in stderr.splitlines() if re.search(r"\w(Error|Exit)\b:", s)]
    return "\n".join(dict.fromkeys(lines)) or stderr[-3000:]


# -- the stand-in itself refuses what NCCL and CUDA refuse ---------------------------------------

PROBE = r"""
import json, os, torch, torch.distributed as dist
from mpi4py import MPI
from hpdl import rank as hr
comm = MPI.COMM_WORLD
device, _, _ = hr.place()
hr.init_torch_distributed(comm.rank, comm.size, device)
refused = {}
def attempt(name, fn):
    try:
        fn()
    except RuntimeError as exc:
        refused[name] = str(exc)
ok = torch.ones(3, device=device)
dist.all_reduce(ok)
attempt("cpu_allreduce", lambda: dist.all_reduce(torch.ones(3)))
attempt("cpu_ddp", lambda: torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2)))
attempt("mixing", lambda: torch.nn.Linear(3, 2).to(device)(torch.ones(1, 3)))
attempt("local_rank", lambda: torch.cuda.set_device(1))
gpu = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 2).to(device))
gpu(ok.unsqueeze(0)).sum().backward()
report = {"rank": comm.rank, "device": str(device), "sum": ok.tolist(), "refused": refused,
          "count": torch.cuda.device_count()}
os.write(1, (json.dumps(report) + "\n").encode())  # one write: the ranks' lines never interleave
hr.finish()
"""


@pytest.mark.slow
def test_the_stand_in_refuses_cpu_tensors_to_nccl_and_a_gpu_a_rank_cannot_see(tmp_path, no_strays):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    r = _run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(script)], standin_env("per-task"))
    assert r.returncode == 0, r.stderr[-3000:]
    reports = [json.loads(s) for s in r.stdout.splitlines() if s.startswith("{")]
    assert len(reports) == 2
    for d in reports:
        assert d["device"] == "cuda:0" and d["count"] == 1 and d["sum"] == [2.0, 2.0, 2.0]
        why = d["refused"]
        assert "dist.all_reduce got a tensor float32[3] on the CPU" in why["cpu_allreduce"]
        where = 'probe.py:16: attempt("cpu_allreduce", lambda: dist.all_reduce(torch.ones(3)))'
        assert why["cpu_allreduce"].endswith(where)  # the caller's file, line and source
        assert "DistributedDataParallel got a module whose `weight` is float32[2, 3] on the CPU" in why["cpu_ddp"]
        assert "found at least two devices, cuda:0 and cpu" in why["mixing"]
        assert "invalid device ordinal: cuda:1, but this rank sees 1 GPU(s)" in why["local_rank"]


# -- the placement rule -------------------------------------------------------------------------

@pytest.mark.parametrize("ranks,gpus,bound", [(4, 4, True), (4, 4, False), (2, 8, False), (3, 2, False)])
def test_one_rank_placement_is_the_node_rule(ranks, gpus, bound):
    uuids = [f"GPU-{i}" for i in range(gpus)]
    seen = [[uuids[r]] for r in range(ranks)] if bound else [uuids] * ranks
    node = devices.assign(seen)
    mine = [devices.own_index(r, len(seen[r])) for r in range(ranks)]
    assert mine == (node if node is not None else [r if r < gpus else None for r in range(ranks)])


def test_every_text_on_placement_says_the_one_rule():
    """Where a lesson or a guide names cuda:<local_rank> or hvd.local_rank() as the device, it says in the
    same paragraph that under per-task binding (--gpus-per-task) each rank's GPU is cuda:0."""
    texts = [p for folder in ("notebooks", "solutions") for p in (ROOT / folder).glob("*.ipynb")]
    texts += list((ROOT / "cluster").rglob("*.md")) + [ROOT / "README.md"] + list((ROOT / "docs").glob("*.md"))
    found = 0
    for path in texts:
        if path.suffix == ".ipynb":
            paragraphs = [p for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown"
                          for p in c.source.split("\n\n")]
        else:
            paragraphs = path.read_text().split("\n\n")
        for p in paragraphs:
            if re.search(r"cuda:<local_rank>|cuda:local_rank|set_device\((hvd\.)?local_rank\(?\)?\)", p):
                found += 1
                assert "cuda:0" in p and "--gpus-per-task" in p, f"{path.relative_to(ROOT)}: {p}"
    assert found >= 2  # lesson 06 and the build guide say it


# -- notebooks/scripts/train_ddp.py, benchmarks/synthetic.py, preflight ---------------------------

@pytest.mark.slow
@pytest.mark.parametrize("mode,expected", [("per-task", ["cuda:0", "cuda:0"]), ("node", ["cuda:0", "cuda:1"])])
def test_train_ddp_takes_each_tasks_own_gpu(mode, expected, tmp_path, no_strays):
    ran = as_srun_tasks(["--epochs", "2", "--out", str(tmp_path / "out")], standin_env(mode))
    failed = [f"rank {r} (exit {code}): {err.strip().splitlines()[-1] if err.strip() else ''}"
              for r, (code, _, err) in enumerate(ran) if code != 0]
    assert not failed, f"train_ddp.py under {mode} GPUs: " + "; ".join(failed)
    results = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in range(2)]
    assert [d["device"] for d in results] == expected
    assert results[0]["digest"] == results[1]["digest"] and results[0]["accuracy"] > 0.8


@pytest.mark.slow
def test_synthetic_reduces_on_each_ranks_gpu(no_strays):
    r = _run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(ROOT / "benchmarks" / "synthetic.py"),
              "--framework", "ddp", "--model", "digits_cnn", "--num-iters", "2", "--num-batches-per-iter", "1",
              "--num-warmup-batches", "1", "--scaling"], standin_env("per-task"))
    assert r.returncode == 0, f"benchmarks/synthetic.py under stand-in GPUs: {_errors(r.stderr)}"
    assert "Device: cuda:0" in r.stdout
    assert re.search(r"scaling efficiency \d", r.stdout), r.stdout


@pytest.mark.slow
def test_preflight_counts_per_task_gpus_as_distinct(tmp_path, monkeypatch, capsys, no_strays):
    for k, v in standin_env("per-task", gpus=2, base={}).items():
        monkeypatch.setenv(k, v)
    site = tmp_path / "site.toml"
    site.write_text('description = "two GPUs, one per task"\n[expect]\ngpus_per_node = 2\n')
    out = tmp_path / "report"
    rc = cli.main(["preflight", "--site", str(site), "--launcher", "local", "--ranks-per-node", "2",
                   "--out", str(out), "--largest-mib", "1", "--timeout", "120"])
    printed = capsys.readouterr().out
    result = json.loads((out / "preflight.json").read_text())
    assert [r["device"] for r in result["ranks"]] == ["Stand-in GPU (cuda:0)"] * 2, printed
    node = next(r for r in result["rows"] if r["check"] == "GPUs of the node")
    assert node["verdict"] == "go" and "2 GPU(s) in use" in node["measured"], printed
    assert rc == 0, printed


# -- the lessons -----------------------------------------------------------------------------------

def _notebooks() -> list[Path]:
    found = []
    for folder in ("notebooks", "solutions"):
        for path in sorted((ROOT / folder).glob("[0-9][0-9]_*.ipynb")):
            nb = nbformat.read(path, as_version=4)
            if any(c.cell_type == "code" and re.search(r"\bdist\.|\bDDP\(|\bhvd\.", c.source) for c in nb.cells):
                found.append(path)
    return found


def _failed_cell(nb) -> str:
    for i, cell in enumerate(nb.cells):
        for out in cell.get("outputs", []):
            if out.get("output_type") == "error":
                return f"cell {i} (id {cell.get('id')})"
    return "a cell"


ON_GPUS = 'assert {str(d) for d in hpdl.view().pull("device", block=True)} == {"cuda:0"}, "ranks not on their GPUs"'


# Cells that start jobs of their own, where the stand-in has nothing to see: a benchmark run as a program
# (08's Horovod grid and autotuner, whose GPU paths the script tests here cover); an exercise's check, whose
# jobs run the learner's function on CPU ranks (gloo) whatever the engines hold; the tuning sweeps and
# probes, MPI side jobs that ask for no GPU. The plain headless run (test_notebooks.py) runs them all.
OWN_JOBS = re.compile(r"hpdl\.run_job\(|hpdl\.check\(|hpdl\.tune\.(sweep_algorithm|probe)\(")


def kept_cells(cells: list) -> list:
    """All but the cells that start jobs of their own (OWN_JOBS) and the cells that read what those defined."""
    import ast

    skipped: set[str] = set()
    kept = []
    for cell in cells:
        code = "\n".join(line for line in cell.source.splitlines() if not line.lstrip().startswith(("%", "!")))
        try:
            names = [n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.Name)]
        except SyntaxError:
            names = []
        stores = {n.id for n in names if isinstance(n.ctx, ast.Store)}
        reads = {n.id for n in names if isinstance(n.ctx, ast.Load)} - stores
        on_ranks = cell.source.lstrip().startswith("%%px")  # the ranks' names, not the notebook's
        if cell.cell_type == "code" and (OWN_JOBS.search(cell.source) or (skipped & reads and not on_ranks)):
            skipped |= stores
            continue
        kept.append(cell)
    return kept


def last_needed_cell(nb) -> int:
    """Cells after the last one that uses torch.distributed or Horovod teach nothing more to the stand-in."""
    return max(i for i, c in enumerate(nb.cells) if c.cell_type == "code" and USES_COLLECTIVES.search(c.source))


@pytest.mark.slow
@pytest.mark.parametrize("path", _notebooks(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_lesson_runs_on_stand_in_gpus(path: Path, tmp_path, monkeypatch, no_strays):
    for k, v in standin_env("per-task", gpus=4, base={}).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HPDL_WORKSPACE", str(tmp_path / "workspace"))
    # a rank refused by the stand-in leaves the others waiting in their next collective: %%px's own
    # limit reports where they wait well before the notebook's
    monkeypatch.setenv("HPDL_CELL_TIMEOUT", "150")
    log = tmp_path / "refused.txt"  # what any rank refused, shown even where the notebook shows a hang only
    monkeypatch.setenv("GPU_STANDIN_LOG", str(log))
    nb = nbformat.read(path, as_version=4)
    cells = []
    for cell in kept_cells(nb.cells[:last_needed_cell(nb) + 1]):
        cells.append(cell)
        on_cpu = "frameworks=()" in cell.source or '"HPDL_DEVICE": "cpu"' in cell.source  # CPU ranks on purpose
        if cell.cell_type == "code" and "hpdl.start(" in cell.source and not on_cpu:
            cells.append(nbformat.v4.new_code_cell(ON_GPUS))  # a silent fall-back to the CPU would prove nothing
    nb.cells = cells + [nbformat.v4.new_code_cell("hpdl.stop()")]
    client = NotebookClient(nb, config=Config({"KernelManager": {"shutdown_wait_time": 30.0}}), timeout=TIMEOUT,
                            kernel_name="python3", resources={"metadata": {"path": str(path.parent)}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except (CellExecutionError, CellTimeoutError) as exc:
        plain = re.sub(r"\x1b\[[0-9;]*m", "", str(exc))
        refused = log.read_text().splitlines() if log.exists() else []
        refused += [line.strip() for line in plain.splitlines() if re.search(r"^\s*RankHang\b", line)]
        pytest.fail(f"{path.parent.name}/{path.name}, {_failed_cell(nb)}, on stand-in GPUs:\n"
                    + ("\n".join(dict.fromkeys(refused)) or plain[-2500:]))
    finally:
        print(f"{path.parent.name}/{path.name} on stand-in GPUs: {time.perf_counter() - t0:.1f} s")
    assert not log.exists(), f"{path.name} caught what the stand-in refused:\n{log.read_text()}"
