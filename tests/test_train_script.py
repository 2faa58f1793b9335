"""notebooks/scripts/train_ddp.py, lesson 05's training as a script, under each launcher.

Each run writes one JSON file per rank; the test asserts that training happened (accuracy, loss
going down), that every rank ended with the same parameters, and that a run resumed from rank 0's
checkpoint ends exactly where an uninterrupted run does.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "notebooks" / "scripts" / "train_ddp.py"
BIN = Path(sys.executable).parent
TIMEOUT = 240


def _run(cmd: list[str], env: dict | None = None) -> str:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT, env=env or os.environ.copy())
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{' '.join(cmd)} did not finish in {TIMEOUT} s:\n{exc.stdout}\n{exc.stderr}")
    assert done.returncode == 0, f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout


def _results(out: Path, ranks: int) -> list[dict]:
    files = sorted(out.glob("rank*.json"))
    assert len(files) == ranks, f"expected {ranks} result files, found {[f.name for f in files]}"
    return [json.loads(f.read_text()) for f in files]


def _assert_trained_and_agree(results: list[dict], launcher: str, epochs: int) -> None:
    assert [r["rank"] for r in results] == list(range(len(results)))
    assert {r["world_size"] for r in results} == {len(results)}
    assert {r["launcher"] for r in results} == {launcher}
    digests = {r["digest"] for r in results}
    assert len(digests) == 1, f"ranks ended with different parameters: {digests}"
    losses = results[0]["losses"]
    assert len(losses) == epochs and losses[-1] < losses[0], losses
    assert all(r["losses"] == losses for r in results), "the averaged loss differs between ranks"
    assert results[0]["accuracy"] > 0.9, results[0]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mpiexec_two_ranks_train_and_agree(tmp_path, no_strays):
    out = tmp_path / "out"
    stdout = _run([str(BIN / "mpiexec"), "-n", "2", sys.executable, str(SCRIPT), "--epochs", "3", "--out", str(out)])
    assert "2 ranks via mpiexec" in stdout
    _assert_trained_and_agree(_results(out, 2), "mpiexec", 3)


def test_torchrun_two_processes_train_and_agree(tmp_path, no_strays):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("PMI_RANK", "OMPI_COMM_WORLD_RANK")}
    stdout = _run([str(BIN / "torchrun"), "--standalone", "--nproc-per-node", "2", str(SCRIPT),
                   "--epochs", "3", "--out", str(out)], env=env)
    assert "2 ranks via torchrun" in stdout
    _assert_trained_and_agree(_results(out, 2), "torchrun", 3)


def as_srun_tasks(args: list[str], env: dict, ranks: int = 2) -> list[tuple[int, str, str]]:
    """train_ddp.py on `ranks` processes given what srun gives each task (SLURM_PROCID, SLURM_NTASKS,
    SLURM_LOCALID), without Slurm itself: (exit code, stdout, stderr) per rank."""
    base = {k: v for k, v in env.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_"))}
    base.update(SLURM_NTASKS=str(ranks), SLURM_JOB_ID="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), *args],
                              env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(ranks)]
    try:
        outputs = [p.communicate(timeout=TIMEOUT) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return [(p.returncode, stdout, stderr) for p, (stdout, stderr) in zip(procs, outputs)]


def test_slurm_variables_are_enough(tmp_path, no_strays):
    out = tmp_path / "out"
    ran = as_srun_tasks(["--epochs", "3", "--out", str(out)], dict(os.environ))
    for code, _, stderr in ran:
        assert code == 0, stderr[-3000:]
    assert "2 ranks via srun" in ran[0][1]
    _assert_trained_and_agree(_results(out, 2), "srun", 3)


def test_resume_from_rank0_checkpoint_matches_uninterrupted_run(tmp_path, no_strays):
    mpiexec = [str(BIN / "mpiexec"), "-n", "2", sys.executable, str(SCRIPT)]
    _run(mpiexec + ["--epochs", "3", "--out", str(tmp_path / "whole")])
    checkpoint = tmp_path / "digits.pt"
    _run(mpiexec + ["--epochs", "2", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "first")])
    assert checkpoint.exists()
    _run(mpiexec + ["--epochs", "3", "--checkpoint", str(checkpoint), "--out", str(tmp_path / "resumed")])
    whole, resumed = _results(tmp_path / "whole", 2), _results(tmp_path / "resumed", 2)
    assert {r["first_epoch"] for r in resumed} == {2}, "every rank must learn the epoch from rank 0's checkpoint"
    assert {r["digest"] for r in resumed} == {whole[0]["digest"]}, "resumed run differs from the uninterrupted one"
    assert resumed[0]["losses"] == whole[0]["losses"][2:]
