"""Three MPI implementations, one kit: MPICH (default), Open MPI 5 and Intel MPI from PyPI.

The first tests are units (no MPI started): how a version text is named, which flags each
implementation's mpiexec gets, and the doctor's words when mpiexec and libmpi disagree. The last
one runs only under `make test-mpi MPI=...` (HPDL_TEST_MPI set) and checks, for real, that this
venv's mpiexec, mpi4py's library and Horovod are the one implementation that was asked for.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from hpdl import doctor, launchers, mpilib

TEXTS = {  # what each MPI prints (`mpiexec --version` or MPI_Get_library_version), trimmed
    "Open MPI": "mpiexec (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/",
    "Intel MPI": "Intel(R) MPI Library for Linux* OS, Version 2021.18.1 Build 20260626 (id: b44796a)",
    "MPICH": "HYDRA build details:\n    Version:                                 5.0.2",
    "MVAPICH2": "MVAPICH2 Version      :\t2.3.7\nMVAPICH2 Release date :\tWed March 02 22:00:00 EST 2022",
    "Cray MPICH": "MPI VERSION    : CRAY MPICH version 8.1.28.2 (ANL base 3.4a2)",
}


def test_each_implementation_is_named_and_flagged_as_it_needs():
    for name, text in TEXTS.items():
        assert mpilib.implementation(text) == name
    assert {mpilib.abi(n) for n in TEXTS if n != "Open MPI"} == {"MPICH"}
    assert mpilib.implementation("some launcher 1.0") == "unknown"

    ompi = launchers.mpiexec_flags("Open MPI", ["PATH", "HPDL_HOME"], as_root=True)
    assert "--oversubscribe" in ompi and "--allow-run-as-root" in ompi
    assert ompi[ompi.index("--bind-to") + 1] == "none"
    assert [ompi[i + 1] for i, f in enumerate(ompi) if f == "-x"] == ["PATH", "HPDL_HOME"]
    assert "--allow-run-as-root" not in launchers.mpiexec_flags("Open MPI", [], as_root=False)
    assert launchers.mpiexec_flags("Intel MPI") == ["-genv", "I_MPI_PIN", "0"]
    assert launchers.mpiexec_flags("MPICH", ["PATH"], as_root=True) == []  # Hydra needs none of it
    # lesson 08's placements: one binding, each MPI's spelling (Open MPI runs `-bind-to none` as a program)
    bound = launchers.mpiexec_flags("Open MPI", [], bind="core")
    assert bound.count("--bind-to") == 1 and bound[bound.index("--bind-to") + 1] == "core" and "-bind-to" not in bound
    assert launchers.mpiexec_flags("MPICH", bind="core") == ["-bind-to", "core"]
    assert launchers.mpiexec_flags("MPICH", bind="none") == ["-bind-to", "none"]
    intel = launchers.mpiexec_flags("Intel MPI", bind="core")
    assert intel == ["-genv", "I_MPI_PIN", "1", "-genv", "I_MPI_PIN_DOMAIN", "core"]
    assert launchers.mpiexec_flags("Intel MPI", bind="none") == ["-genv", "I_MPI_PIN", "0"]


def test_doctor_mismatch_says_what_happens_and_what_to_do():
    detail, fix = doctor.mismatch("/opt/ompi/bin/mpiexec", "Open MPI", "mpiexec (Open MPI) 5.0.11",
                                  "Intel MPI", "/x/lib/libmpi.so.12")
    assert "/opt/ompi/bin/mpiexec is Open MPI" in detail and "mpi4py uses Intel MPI" in detail
    assert "2 separate one-rank jobs" in detail
    # an mpiexec beside this Python wins when there is one; otherwise the kit's venv per MPI
    if (doctor.VENV_BIN / "mpiexec").exists():
        assert fix.startswith(f"export PATH={doctor.VENV_BIN}:$PATH")
    else:
        assert "MPI=openmpi" in fix and "MPI4PY_LIBMPI" in fix


@pytest.mark.skipif(not os.environ.get("HPDL_TEST_MPI"), reason="only under `make test-mpi MPI=...`")
def test_this_venv_is_one_implementation_throughout(no_strays):
    """mpiexec, the library mpi4py loads on the ranks, and Horovod's library are the asked-for MPI."""
    want = {"mpich": "MPICH", "openmpi": "Open MPI", "impi": "Intel MPI"}[os.environ["HPDL_TEST_MPI"]]
    p = subprocess.run([sys.executable, "-m", "hpdl.cli", "doctor", "--json"], capture_output=True, text=True,
                       timeout=300, stdin=subprocess.DEVNULL)
    info = json.loads(p.stdout)
    assert info["ok"], doctor.render(info)
    assert info["mpi"]["implementation"] == want
    assert info["mpiexec"]["mpiexec"]["implementation"] == want
    assert info["mpiexec"]["mpiexec"]["two_ranks"] == [[0, 2], [1, 2]]
    lib = {os.path.realpath(f) for f in info["mpi"]["library_files"]}
    assert lib and all(f.startswith(os.path.realpath(sys.prefix)) for f in lib)  # this venv's MPI
    assert info["horovod"]["mpi_built"] and {os.path.realpath(f) for f in info["horovod"]["library_files"]} & lib
    # the kit's own mpiexec line: 3 ranks on 2 cores, each on the asked-for library
    code = ("import os; from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "os.write(1, f'{c.rank} {c.size} {MPI.Get_library_version().splitlines()[0]}\\n'.encode())")
    out = subprocess.run([*launchers.mpiexec_command(3), sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=120, stdin=subprocess.DEVNULL).stdout
    lines = sorted(s for s in out.splitlines() if s[:1].isdigit())
    assert [s.split()[:2] for s in lines] == [["0", "3"], ["1", "3"], ["2", "3"]], out
    assert all(mpilib.implementation(s) == want for s in lines)
    assert Path(launchers.find_mpiexec()).parent == Path(sys.executable).parent
