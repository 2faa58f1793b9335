"""`hpdl doctor` on this machine, for real: its report agrees with what the libraries say, and a
broken environment (an MPI library mpi4py cannot load, a foreign mpiexec first on PATH) makes it
exit non-zero with a fix that, applied, makes it pass again."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl import doctor

BIN = Path(sys.executable).parent


def run_doctor(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hpdl.cli", "doctor", *args], capture_output=True, text=True,
                          env=env, timeout=300, stdin=subprocess.DEVNULL)


def clean_env(**extra: str) -> dict[str, str]:
    """This session's environment without Slurm or MPI-library overrides, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "HPDL_SLURM_")) and k not in ("MPI4PY_LIBMPI", "HPDL_SITE", "HPDL_LAUNCHER")}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra)
    return env


def failed(text: str) -> list[str]:
    return [line.split()[1] for line in text.splitlines() if line.startswith(" FAIL ")]


@pytest.fixture(scope="module")
def healthy():
    """The doctor's JSON report for this (working) environment."""
    p = run_doctor(clean_env(), "--json")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    return json.loads(p.stdout)


def test_report_agrees_with_the_libraries(healthy):
    from mpi4py import MPI
    import ipyparallel
    import torch

    assert healthy["ok"] and not [c for c in healthy["checks"] if c["status"] == "fail"]
    assert healthy["python"]["executable"] == sys.executable
    assert healthy["torch"]["version"] == torch.__version__
    assert healthy["torch"]["cuda_build"] == torch.version.cuda
    assert healthy["torch"]["gpus"] == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    mpi = healthy["mpi"]
    assert mpi["vendor"] == MPI.get_vendor()[0]
    assert mpi["library_version"] == MPI.Get_library_version().strip()
    assert mpi["library_files"] and all(Path(p).exists() for p in mpi["library_files"])
    assert mpi["cuda_aware"] in (True, False, None)
    assert healthy["packages"]["ipyparallel"] == ipyparallel.__version__
    kit = healthy["mpiexec"]["mpiexec"]
    assert kit["two_ranks"] == [[0, 2], [1, 2]]  # mpiexec really started one MPI job of 2
    assert healthy["hardware"]["cores"] == len(os.sched_getaffinity(0))
    assert healthy["launcher"]["auto"] == "local"  # no Slurm allocation in this environment


def test_horovod_is_probed_in_a_subprocess_and_reports_its_controllers(healthy):
    hvd = healthy["horovod"]
    if "error" in hvd:
        pytest.fail(f"Horovod does not import here: {hvd['error']}")
    # the kit's Horovod is built with MPI and Gloo (cluster/build/horovod.sh)
    assert hvd["mpi_built"] is True and hvd["gloo_built"] is True
    # ...against the very MPI library mpi4py loads
    same = ({os.path.realpath(p) for p in hvd["library_files"]}
            & {os.path.realpath(p) for p in healthy["mpi"]["library_files"]})
    assert same


def test_screen_report_is_one_line_per_check(healthy):
    text = doctor.render(healthy)
    names = [c["name"] for c in healthy["checks"]]
    assert len(text.splitlines()) <= 25
    for name in ("Python", "torch", "MPI", "mpiexec", "packages", "Horovod", "hardware", "launcher"):
        assert name in names
    assert text.rstrip().endswith("everything the kit needs is here.")


def test_mpi_library_that_cannot_load_fails_with_the_fix(healthy, tmp_path):
    missing = tmp_path / "no" / "libmpi.so.12"
    p = run_doctor(clean_env(MPI4PY_LIBMPI=str(missing)))
    assert p.returncode == 1, p.stdout
    assert failed(p.stdout) == ["MPI"]
    assert "mpi4py cannot load its MPI library" in p.stdout and str(missing) in p.stdout
    assert "unset MPI4PY_LIBMPI" in p.stdout  # the fix names the variable at fault
    # following the hint's other half (point it at a real libmpi) makes the doctor happy again
    real = healthy["mpi"]["library_files"][0]
    again = run_doctor(clean_env(MPI4PY_LIBMPI=real))
    assert again.returncode == 0, again.stdout


def test_foreign_mpiexec_first_on_path_fails_with_the_fix(tmp_path):
    fake = tmp_path / "openmpi" / "bin"
    fake.mkdir(parents=True)
    (fake / "mpiexec").write_text(  # what Open MPI 4.1's mpiexec prints for --version
        "#!/bin/sh\necho 'mpiexec (OpenRTE) 4.1.4'\necho\necho 'Report bugs to http://www.open-mpi.org/community/help/'\n"
    )
    (fake / "mpiexec").chmod(0o755)
    env = clean_env()
    env["PATH"] = f"{fake}{os.pathsep}{env['PATH']}"
    p = run_doctor(env)
    assert p.returncode == 1, p.stdout
    assert failed(p.stdout) == ["mpiexec"]  # "mpiexec on PATH"
    assert f"{fake}/mpiexec is Open MPI" in p.stdout and "mpi4py uses MPICH" in p.stdout
    fix = f"export PATH={BIN}:$PATH"
    assert fix in p.stdout
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"  # the fix, applied
    assert run_doctor(env).returncode == 0


def test_bad_site_profile_fails_the_launcher_check(tmp_path):
    site = tmp_path / "site.toml"
    site.write_text('[slurm]\npartition = "gpu"\nnodes = 4\n')
    p = run_doctor(clean_env(HPDL_SITE=str(site)))
    assert p.returncode == 1
    assert failed(p.stdout) == ["launcher"]
    assert "slurm.nodes" in p.stdout


def test_doctor_shows_the_settings_set_and_fails_on_a_bad_value():
    p = run_doctor(clean_env(HPDL_DEVICE="cpu", HPDL_CELL_TIMEOUT="soon"))
    assert p.returncode == 1, p.stdout
    assert failed(p.stdout) == ["settings"]
    row = next(line for line in p.stdout.splitlines() if line.split()[1:2] == ["settings"])
    assert "HPDL_DEVICE=cpu" in row and "HPDL_CELL_TIMEOUT='soon': it takes a number of seconds > 0" in row
    assert "`hpdl settings` says what each takes" in p.stdout
    again = run_doctor(clean_env(HPDL_DEVICE="cpu", HPDL_CELL_TIMEOUT="60"), "--json")  # the fix, applied
    assert again.returncode == 0, again.stdout
    shown = json.loads(again.stdout)["settings"]["set"]
    assert shown["HPDL_DEVICE"] == "cpu" and shown["HPDL_CELL_TIMEOUT"] == "60"


def _requirements_pins(text: str) -> dict[str, str]:
    """requirements.txt's `name==version` lines, read here without the doctor's parser."""
    lines = (line.split("#")[0].strip() for line in text.splitlines())
    return {name.lower(): version for name, _, version in (line.partition("==") for line in lines) if version}


def test_pins_come_from_requirements_txt():
    real = _requirements_pins((doctor.REQUIREMENTS).read_text())
    assert doctor.REQUIREMENTS == Path(doctor.__file__).resolve().parents[1] / "requirements.txt"
    assert doctor.pins() == real and {"torch", "mpich"} <= set(real)
    # no version is written in the doctor itself: requirements.txt is the one place
    assert not re.findall(r"[A-Za-z]==\d", Path(doctor.__file__).read_text())  # e.g. torch==2.13.0


def test_fixes_quote_requirements_txt_and_say_when_it_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("MPI4PY_LIBMPI", raising=False)
    cpu_torch = {"version": "2.0.0", "cuda_build": None, "gpus": 0}
    other = tmp_path / "requirements.txt"
    other.write_text("torch==9.8.7   # a comment\nnumpy\nmpich == 1.2.3\n")
    monkeypatch.setattr(doctor, "REQUIREMENTS", other)
    assert "`pip install torch==9.8.7`" in doctor.gpu_torch_check(2, cpu_torch)[1]
    assert "pip install mpich==1.2.3 " in doctor._mpi_fix("cannot load")
    # installed without requirements.txt beside the kit: no version, and the fix says why
    monkeypatch.setattr(doctor, "REQUIREMENTS", tmp_path / "gone" / "requirements.txt")
    assert doctor.pins() == {}
    fix = doctor.gpu_torch_check(2, cpu_torch)[1]
    assert "`pip install torch`" in fix and f"no requirements.txt at {tmp_path}/gone" in fix
    assert "pip install mpich " in doctor._mpi_fix("cannot load")
