"""`hpdl preflight` on real ranks: one Slurm job on the local Slurm (2 CPU ranks) that reports every
rank and goes against a lenient profile; a local mpiexec run that is a no-go against impossible
expectations; a rank that never starts, named; a job pending past its deadline, cancelled; bad site
files and a machine without Slurm, told in one line. No GPU here: GPU fields must read "none".
"""
from __future__ import annotations

import json
import re
import socket
import textwrap
from pathlib import Path

import pytest
from test_slurm import outside_slurm, slurm, squeue  # noqa: F401  (the local Slurm and a login-node environment)

from hpdl import cli, preflight, sites
from hpdl.errors import HpdlError

LENIENT = """
description = "this machine, judged leniently"
[slurm]
time = "00:10:00"
[expect]
gpus_per_node = 0
within_node_8B_us_max = 1e6
within_node_busbw_GBps_min = 1e-6
across_nodes_8B_us_max = 1e6
"""

IMPOSSIBLE = """
description = "what no machine can do: 8-byte allreduce in a nanosecond, and a GPU per rank"
[expect]
gpus_per_node = 1
cuda_aware_mpi = true
mpi_library_contains = "MVAPICH2-GDR"
within_node_8B_us_max = 0.001
within_node_busbw_GBps_min = 1e-6
"""


def _site(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "site.toml"
    path.write_text(text)
    return path


def _rows(result: dict) -> dict[tuple[str, str], dict]:
    return {(r["check"], r["where"]): r for r in result["rows"]}


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm", "outside_slurm")
@pytest.mark.parametrize("sbatch_export", [None, "HOME,USER"], ids=["default", "sbatch-export-list"])
def test_preflight_job_on_slurm_reports_every_rank_and_goes(sbatch_export, tmp_path, capsys, monkeypatch, no_strays):
    """Also where sbatch is told to pass a list of variables without PATH (batchspawner does so,
    some sites' defaults too): Slurm hands that list to every step of the job, and a site's rank
    prologue (bash) would not even start unless the step asks for the script's own environment."""
    text = LENIENT
    if sbatch_export:
        monkeypatch.setenv("SBATCH_EXPORT", sbatch_export)
        text += '[env]\nHPDL_PREFLIGHT_PROBE = "1"\n'  # a prologue: bash, found through PATH
    out = tmp_path / "report"
    rc = cli.main(["preflight", "--site", str(_site(tmp_path, text)), "--nodes", "1", "--ranks-per-node", "2",
                   "--out", str(out), "--largest-mib", "1", "--timeout", "120", "--queue-timeout", "120"])
    printed = capsys.readouterr()
    assert rc == 0, printed.out + printed.err
    result = json.loads((out / "preflight.json").read_text())
    job = re.fullmatch(r"Slurm job (\d+), 1 node\(s\) × 2", result["launched"]).group(1)
    assert squeue("-j", job, "-o", "%i") == ""  # the job has ended, nothing left queued
    ranks = result["ranks"]
    assert [(r["rank"], r["local_rank"], r["size"]) for r in ranks] == [(0, 0, 2), (1, 1, 2)]
    assert {r["host"] for r in ranks} == {socket.gethostname()}
    assert [(r["device"], r["memory_GB"], r["cuda"], r["nccl"]) for r in ranks] == [("none", None, None, None)] * 2
    assert [(r["mpi"].split()[0], r["cuda_aware"]) for r in ranks] == [("MPICH", False)] * 2
    within = ranks[0]["within"]
    assert within == ranks[1]["within"] and within["ranks"] == 2
    assert within["sizes"][0] == 8 and within["sizes"][-1] == 1 << 20
    assert all(t > 0 for t in within["seconds"]) and all(b > 0 for b in within["busbw"])
    assert ranks[0]["across"] is None  # one node
    rows = _rows(result)
    host = socket.gethostname()
    assert rows[("allreduce within a node", host)]["verdict"] == "go"
    assert rows[("allreduce across nodes", "1 node(s)")]["verdict"] == "n/a"
    assert rows[("rank 1 (local 1)", host)]["measured"].startswith("none · CUDA — · NCCL — · MPICH")
    assert result["go"] and not [r for r in result["rows"] if r["verdict"] == "no-go"]
    assert "GO: no check failed." in printed.out
    page = (out / "index.html").read_text()
    assert "<h1>hpdl preflight: <span class=\"go\">GO</span></h1>" in page
    assert "<td>rank 0 (local 0)</td>" in page and "<td>within_node_8B_us_max</td><td>1,000,000</td>" in page
    assert "src=" not in page and "href=" not in page  # one page, nothing to fetch


def test_local_run_is_a_no_go_against_impossible_expectations(tmp_path, capsys, no_strays):
    out = tmp_path / "report"
    rc = cli.main(["preflight", "--site", str(_site(tmp_path, IMPOSSIBLE)), "--launcher", "local",
                   "--ranks-per-node", "2", "--out", str(out), "--largest-mib", "1", "--timeout", "60"])
    printed = capsys.readouterr().out
    assert rc == 1, printed
    result = json.loads((out / "preflight.json").read_text())
    rows, host = _rows(result), socket.gethostname()
    within = rows[("allreduce within a node", host)]
    assert within["verdict"] == "no-go"
    assert re.search(r"8 B allreduce took [\d.e+-]+ µs, more than 0\.001 µs", within["reason"])
    assert "bus bandwidth" not in within["reason"]  # that expectation is met
    for rank in (0, 1):
        reason = rows[(f"rank {rank} (local {rank})", host)]["reason"]
        assert "no GPU of its own" in reason and "not CUDA-aware (MPIX_Query_cuda_support())" in reason
        assert "not MVAPICH2-GDR" in reason
    assert rows[("GPUs of the node", host)]["reason"] == "0 GPU(s) in use, 1 expected"
    assert "NO-GO: 4 check(s) failed" in printed
    assert "<span class=\"no-go\">NO-GO</span>" in (out / "index.html").read_text()


def test_a_rank_that_never_starts_is_named(tmp_path, monkeypatch, no_strays):
    stall = tmp_path / "stall"
    stall.mkdir()
    (stall / "sitecustomize.py").write_text(textwrap.dedent("""
        import os, time
        if os.environ.get("PMI_RANK") == "1":  # rank 1 never gets as far as the kit's code
            time.sleep(120)
    """))
    monkeypatch.setenv("PYTHONPATH", str(stall))
    with pytest.raises(HpdlError) as err:
        preflight.run(sites.load_site(str(_site(tmp_path, LENIENT))), launcher="local", out=tmp_path / "r",
                      largest=1 << 10, timeout=3)
    text = str(err.value)
    # rank 0's stack dump ends the job (usually first), or the client's own time limit does (on a loaded
    # machine, when rank 0's imports take most of it): either way the same ranks are named
    assert re.search(r"before every rank answered|not every rank answered within 3 s", text), text
    assert "rank 1: never started" in text
    assert f"rank 0 on {socket.gethostname()}: stuck starting MPI" in text
    # rank 0's own stack dump, from the job's output, even when MPI's launcher printed a banner after it
    assert "Timeout" in text and "in rank_main" in text and "BAD TERMINATION" not in text, text


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm", "outside_slurm")
def test_a_job_that_pends_too_long_or_can_never_start_is_cancelled_with_slurms_reason(tmp_path, no_strays):
    site = sites.load_site(str(_site(tmp_path, LENIENT)))
    with pytest.raises(HpdlError) as never:  # the local Slurm has one node
        preflight.run(site, nodes=2, ranks_per_node=1, out=tmp_path / "r")
    site.sbatch = ["--begin=now+3600"]  # queued for an hour
    with pytest.raises(HpdlError) as late:
        preflight.run(site, out=tmp_path / "r", queue_timeout=2)
    assert re.search(r"can never start as asked \(reason: Partition(NodeLimit|Config)\)", str(never.value))
    assert "still pending after 2 s (reason: BeginTime)" in str(late.value) and "--queue-timeout" in str(late.value)
    for err in (never, late):
        job = re.search(r"Slurm job (\d+)", str(err.value)).group(1)
        assert squeue("-j", job, "-o", "%i") == ""


@pytest.mark.parametrize("text, named", [
    ('[expect]\nwithin_node_8B_us_max = "fast"\n', "expect.within_node_8B_us_max must be a number"),
    ('[expect]\nlatency_us = 3\n', "unknown key expect.latency_us"),
    ('[expect]\ncuda_aware_mpi = "yes"\n', "expect.cuda_aware_mpi must be true or false"),
    ('[expect]\ngpus_per_node = 1.5\n', "expect.gpus_per_node must be a whole number"),
    ('[slurm]\npartition = \n', "not valid TOML"),
])
def test_a_bad_site_file_is_one_line_naming_the_key(text, named, tmp_path, capsys):
    rc = cli.main(["preflight", "--site", str(_site(tmp_path, text)), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 1 and named in err and str(tmp_path / "site.toml") in err
    assert "Traceback" not in err


def test_without_slurm_it_says_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))  # no sbatch anywhere
    rc = cli.main(["preflight", "--site", str(_site(tmp_path, LENIENT)), "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 1 and "no Slurm here (sbatch is not on PATH)" in err and "--launcher local" in err


def test_gpus_of_a_node_are_counted_by_uuid_as_per_task_binding_shows_them():
    """Under `srun --gpus-per-task=1` each rank sees its own GPU as cuda:0: four ranks, four GPUs,
    one label. Counted by label that was one GPU in use (a NO-GO on a healthy node); by UUID, four."""
    from types import SimpleNamespace

    def rank(i: int, uuid: str) -> dict:
        return {"rank": i, "host": "gpu01", "local_rank": i, "device": "NVIDIA H100 80GB HBM3 (cuda:0)",
                "gpu": uuid, "memory_GB": 85.0, "torch": "2.13.0", "cuda": "12.6", "nccl": "2.27.3",
                "mpi": "Open MPI v5.0.5", "mpi_file": "/opt/openmpi/lib/libmpi.so.40", "cuda_aware": None,
                "cuda_aware_how": "", "device_note": "", "within": None, "across": None}

    def gpus_row(ranks: list[dict]) -> dict:
        return next(r for r in preflight.judge(ranks, {"gpus_per_node": 4}) if r["check"] == "GPUs of the node")

    healthy = gpus_row([rank(i, f"GPU-{i:08x}-1111-2222-3333-444455556666") for i in range(4)])
    assert healthy["verdict"] == "go" and "4 GPU(s) in use" in healthy["measured"], healthy
    shared = gpus_row([rank(i, "GPU-00000000-1111-2222-3333-444455556666") for i in range(4)])
    assert shared["verdict"] == "no-go" and "1 GPU(s) in use, 4 expected" in shared["reason"]  # one GPU: NO-GO
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", uuid="GPU-abc", pci_bus_id="0000:1b:00.0")
    assert preflight.gpu_identity(props, 0) == "GPU-abc"
    assert preflight.gpu_identity(SimpleNamespace(name="T4", uuid="", pci_bus_id="0000:3b:00.0"), 0) == "0000:3b:00.0"


def test_a_stuck_ranks_stack_is_shown_not_the_banner_its_launcher_printed_after_it(tmp_path):
    """What MPICH's Hydra printed after rank 0's faulthandler dump ended the job (seen in a full run):
    the message shows the dump, where the rank was, not the last lines of the banner."""
    out = tmp_path / "job.out"
    out.write_text("Timeout (0:00:03)!\nThread 0x00007f845cffeb80 (most recent call first):\n"
                   '  File "/kit/hpdl/preflight.py", line 100 in rank_main\n'
                   '  File "/kit/hpdl/preflight.py", line 402 in main\n\n' + "=" * 83 + "\n"
                   + "".join(f"=   {w}\n" for w in ("BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES",
                                                    "PID 7531 RUNNING AT vm", "EXIT CODE: 9",
                                                    "CLEANING UP REMAINING PROCESSES",
                                                    "YOU CAN IGNORE THE BELOW CLEANUP MESSAGES"))
                   + "=" * 83 + "\nYOUR APPLICATION TERMINATED WITH THE EXIT STRING: Killed (signal 9)\n")
    text = str(preflight._silent(tmp_path / "ranks", 2, "the job ended before every rank answered:", out))
    assert "rank 0: never started" in text and "shows where:" in text
    assert "line 100 in rank_main" in text and "BAD TERMINATION" not in text, text
    out.write_text("".join(f"line {i}\n" for i in range(30)))  # no dump: the output's last lines
    text = str(preflight._silent(tmp_path / "ranks", 1, "the job ended:", out))
    assert "ends with:" in text and "line 29" in text and "line 17" not in text, text
