"""Launchers are objects in a registry; site profiles give every rank the site's environment.

A launcher class defined here, in a test file, must be found by name, chosen by "auto" when it
detects its environment, listed when a name is wrong, and really start ranks through hpdl.start();
an entry point that names something else than a launcher is refused with a message, the registry
unchanged (a whole outside package, installed, is tests/test_launcher_plugin.py). The rest needs no
Slurm: side jobs, the
resource options a job and its step share, and the prologue that makes a site's MPI library the
one mpi4py loads (shown with a copy of the venv's own libmpi standing in for MVAPICH2-GDR).
"""
from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import hpdl
from hpdl import launchers, sites
from hpdl.errors import HpdlError

VENV_LIB = Path(sys.prefix) / "lib"


@pytest.fixture
def tiny(monkeypatch):
    """A tiny extra launcher: the local mpiexec, but every rank gets a variable saying who started it."""
    for var in ("SLURM_JOB_ID", "HPDL_LAUNCHER", "HPDL_SITE"):
        monkeypatch.delenv(var, raising=False)

    class Tiny(launchers.Launcher):
        name = "tiny"
        label = "tiny mpiexec"
        priority = 50
        ranks_are_local = True
        here = False

        def detect(self) -> bool:
            return Tiny.here

        def configure(self, config, n: int) -> dict:
            config.MPIEngineSetLauncher.mpi_cmd = [launchers.find_mpiexec()]
            config.MPIEngineSetLauncher.mpi_args = ["-genv", "HPDL_T_STARTED_BY", "tiny"]
            return {"engines": "mpi", "controller_ip": "127.0.0.1"}

    yield Tiny
    launchers._REGISTRY.pop("tiny", None)


def test_a_launcher_class_defined_anywhere_is_picked_up_by_name(tiny, monkeypatch):
    assert "tiny" in launchers.known() and {"local", "slurm"} <= set(launchers.known())
    assert isinstance(launchers.get("tiny"), tiny)
    assert launchers.resolve("TINY") == "tiny"
    assert launchers.resolve("auto") == "local"  # it does not detect its environment here
    tiny.here = True
    assert launchers.resolve("auto") == "tiny"  # now it does, and outranks local
    tiny.here = False
    monkeypatch.setenv("HPDL_LAUNCHER", "tiny")
    assert launchers.resolve("auto") == "tiny"


def test_unknown_launcher_names_are_an_error_listing_the_known_ones(tiny):
    for wrong in ("pbs", "", "slurm2"):
        with pytest.raises(HpdlError) as err:
            launchers.resolve(wrong or "nonsense")
        message = str(err.value)
        assert "not one we know" in message
        assert all(name in message for name in ("local", "slurm", "tiny", "'auto'")), message
    with pytest.raises(HpdlError, match="tiny"):
        hpdl.start(n=2, launcher="pbs", quiet=True)


def test_hpdl_start_starts_ranks_through_the_new_launcher(tiny, no_strays):
    c = hpdl.start(n=2, launcher="tiny", frameworks=(), quiet=True)
    try:
        assert c.launcher == "tiny" and hpdl.status()["launcher"] == "tiny"
        view = hpdl.view()
        view.execute("import os; who = (rank, os.environ.get('HPDL_T_STARTED_BY'), comm.allreduce(rank + 1))",
                     block=True)
        assert sorted(view.pull("who", block=True)) == [(0, "tiny", 3), (1, "tiny", 3)]
        assert c.dead_ranks() == []  # watched by pid, as ranks_are_local says
    finally:
        hpdl.stop(quiet=True)


def test_the_shipped_launchers_describe_themselves(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    assert launchers.describe("local").startswith("mpiexec on this machine")
    assert "sbatch" in launchers.describe("slurm")
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    assert launchers.describe("slurm") == "srun in Slurm job 4242"


def test_side_job_outside_slurm_is_the_venvs_mpiexec(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    cmd = launchers.side_job_command(3)
    assert cmd[0] == launchers.find_mpiexec() and cmd[-2:] == ["-n", "3"]
    out = subprocess.run([*cmd, sys.executable, "-c", "from mpi4py import MPI; c = MPI.COMM_WORLD; "
                          "got = c.gather((c.rank, c.size, c.allreduce(c.rank + 1))); c.rank or print(got)"],
                         capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "[(0, 3, 6), (1, 3, 6), (2, 3, 6)]", out.stderr
    # what a lesson's `!{hpdl.job_command(3)} python ...` line runs is this very command
    assert shlex.split(hpdl.job_command(3)) == cmd


def inside_an_allocation(monkeypatch, tmp_path) -> None:
    """As a kernel inside a Slurm job sees it: SLURM_JOB_ID set, an `srun` on PATH (one that fails)."""
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    (fake_bin / "srun").write_text("#!/bin/sh\nexit 1\n")
    (fake_bin / "srun").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_ID", "77")


def test_side_job_inside_an_allocation_overlaps_the_engines_step(monkeypatch, tmp_path):
    """Pure construction (a real run beside the engines is in test_slurm.py)."""
    inside_an_allocation(monkeypatch, tmp_path)
    monkeypatch.delenv("HPDL_SITE", raising=False)
    monkeypatch.setenv("HPDL_SLURM_PMI", "pmix")
    assert launchers.side_job_command(4)[:7] == ["srun", "--overlap", "--mpi=pmix", "--kill-on-bad-exit=1",
                                                  "--job-name=hpdl-side", "-n", "4"]
    # a job that uses no GPU (tuning, probes) asks for none: Slurm < 22.05 overlaps CPUs only
    assert "--gres=none" in launchers.side_job_command(4, gpus=False)
    assert "--gres=none" not in launchers.side_job_command(4)
    # a lesson's `!` line inside JupyterLab's Slurm job: an overlapping step, not an mpiexec that queues
    assert hpdl.job_command(4).startswith("srun --overlap --mpi=pmix ")


def test_a_checks_job_inside_an_allocation_is_the_local_mpiexec_without_the_batch_variables(monkeypatch, tmp_path):
    """A check's jobs run in a sandbox with no network: inside a Slurm job they are this node's
    mpiexec, its ranks forked here, from an environment that no longer says "Slurm" (pure construction;
    the real run inside a Slurm job is in test_slurm.py)."""
    inside_an_allocation(monkeypatch, tmp_path)
    monkeypatch.delenv("HPDL_LAUNCHER", raising=False)
    assert launchers.detected().name == "slurm" and launchers.side_job_command(2)[0] == "srun"
    cmd = launchers.local_job_command(2)
    assert cmd[0] == launchers.find_mpiexec() and cmd[-2:] == ["-n", "2"] and "srun" not in cmd
    flags = launchers.local_flags(launchers.mpiexec_implementation(cmd[0]))
    assert cmd[1:-2] == [*launchers.launch_flags(cmd[0]), *flags]
    assert launchers.local_flags("MPICH") == ["-launcher", "fork"]
    assert launchers.local_flags("Intel MPI") == ["-bootstrap", "fork"] and launchers.local_flags("Open MPI") == []
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "SLURMD_NODENAME": "n1", "SRUN_DEBUG": "3",
           "PMI_RANK": "0", "PMIX_NAMESPACE": "slurm.pmix.77.0", "I_MPI_PMI_LIBRARY": "/usr/lib64/libpmi2.so",
           "HYDRA_LAUNCHER": "slurm", "PATH": "/bin", "HPDL_HOME": "/h", "CUDA_VISIBLE_DEVICES": "0,1",
           "OMPI_MCA_btl": "self,vader", "MPIR_CVAR_CH4_NETMOD": "ofi"}
    assert launchers.local_job_env(env) == {k: env[k] for k in
                                             ("PATH", "HPDL_HOME", "CUDA_VISIBLE_DEVICES", "OMPI_MCA_btl",
                                              "MPIR_CVAR_CH4_NETMOD")}
    # a launcher that says nothing of it (a site's PBS package) gets the local mpiexec, env unchanged
    plain = launchers.get("local")
    assert plain.local_job_command(2) == launchers.mpiexec_command(2) and plain.local_job_env(env) == env
    # the forked ranks really start, from that environment, with Slurm's variables still in this one
    code = ("from mpi4py import MPI; c = MPI.COMM_WORLD; "
            "got = c.gather((c.rank, c.size, c.allreduce(c.rank + 1))); c.rank or print(got)")
    out = subprocess.run([*cmd, sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=launchers.local_job_env({**os.environ, "SLURM_NTASKS": "2", "SLURM_NODELIST": "nowhere"}))
    assert out.stdout.strip() == "[(0, 2, 3), (1, 2, 3)]", out.stderr


def test_a_local_jobs_ranks_keep_a_shared_memory_transport_whatever_ucx_tls_the_nodes_ranks_were_given():
    """A check's job runs sandboxed on one node with no network: emulated nodes' UCX_TLS=tcp,self
    would keep its ranks apart ('Destination is unreachable'; tests/test_emulated_slurm.py runs a
    check so); a site's list with shared memory in it, or one that only excludes, is kept."""
    assert launchers.local_job_env({"UCX_TLS": "tcp,self", "PATH": "/bin"}) == {"PATH": "/bin"}
    for kept in ("rc,sm,self", "^cma", "tcp,posix,self"):
        assert launchers.local_job_env({"UCX_TLS": kept})["UCX_TLS"] == kept


# -- one source for the job's and the step's resources --------------------------------------------

def test_job_and_step_resources_come_from_the_same_site_fields():
    site = sites.SlurmSite(ranks_per_node=4, cpus_per_rank=8, gpus_per_rank=1, partition="gpu")
    opts = ["--ntasks-per-node=4", "--cpus-per-task=8", "--gpus-per-task=1"]
    assert sites.resource_options(site) == opts
    assert sites.sbatch_args(site) == ["--partition=gpu", *opts]
    script = launchers.sbatch_template(site)
    assert [f"#SBATCH {o}" in script for o in opts] == [True] * 3
    srun_line = next(line for line in script.splitlines() if line.startswith("srun "))
    assert srun_line.split()[3:7] == ["--export=ALL", *opts]  # srun --mpi=... --kill-on-bad-exit=1 ... the same three


def test_inside_an_allocation_the_step_asks_only_for_what_the_job_holds():
    assert sites.job_resource_options({"SLURM_NTASKS": "2"}) == []
    held = {"SLURM_CPUS_PER_TASK": "2", "SLURM_NTASKS_PER_NODE": "2(x3)", "SLURM_GPUS_PER_TASK": "1"}
    assert sites.job_resource_options(held) == ["--ntasks-per-node=2", "--cpus-per-task=2", "--gpus-per-task=1"]
    site = sites.SlurmSite(ranks_per_node=4, cpus_per_rank=8, gpus_per_rank=1)
    assert sites.resource_mismatch(site, {"SLURM_NTASKS": "4"}) == (
        "--cpus-per-task=8 (the job holds 1), --gpus-per-task=1 (the job holds none)")
    assert sites.resource_mismatch(site, {"SLURM_CPUS_PER_TASK": "8", "SLURM_GPUS_PER_TASK": "1"}) == ""


# -- the site's environment on every rank ----------------------------------------------------------

def _run_prologue(site: sites.SlurmSite, exports: dict, program: list[str], env: dict | None = None):
    """The rank's wrapper as a step runs it: the engines' variables (`exports`) in its environment."""
    return subprocess.run([*sites.rank_wrapper(site, exports), *program], capture_output=True, text=True,
                          timeout=120, env={**os.environ, **exports, **(env or {})})


def test_rank_prologue_order_site_then_learner(tmp_path):
    site = sites.SlurmSite(setup='export HPDL_T_A="set up"\nexport HPDL_T_B=setup\nexport HPDL_T_D=setup',
                           env={"HPDL_T_B": "site", "HPDL_T_C": "it's"})
    learner = {"HPDL_T_C": "learner's\n$secret \"key\"", "HPDL_T_D": ""}
    out = _run_prologue(site, learner,
                        ["sh", "-c", 'echo "$HPDL_T_A|$HPDL_T_B|$HPDL_T_C|$HPDL_T_D|$0|$1"', "x", "y"])
    assert out.stdout.strip() == "set up|site|learner's\n$secret \"key\"||x|y", out.stderr
    assert sites.rank_wrapper(sites.SlurmSite(), {}) == []  # nothing to run: no wrapper at all
    # the engines' values (ipyparallel's connection key among them) never appear on its command line
    assert "secret" not in " ".join(sites.rank_wrapper(site, learner))


def test_site_mpi_library_is_what_mpi4py_loads_not_the_venvs(tmp_path):
    """The MVAPICH2-GDR trap without a GPU: a second libmpi (a copy of the venv's) stands in for the
    site's. On LD_LIBRARY_PATH alone mpi4py still loads the venv's; named as mpi_library it wins."""
    venv_libmpi = VENV_LIB / "libmpi.so.12"
    if not venv_libmpi.exists():
        pytest.skip(f"no {venv_libmpi}: this venv's MPI is not the mpich wheel")
    site_dir = tmp_path / "site-mpi" / "lib64"
    site_dir.mkdir(parents=True)
    shutil.copy2(venv_libmpi.resolve(), site_dir / "libmpi.so.12")
    (site_dir / "mpich").symlink_to(VENV_LIB / "mpich")  # its own dependencies ($ORIGIN/mpich)
    probe = [sys.executable, "-c", "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; "
             "MPI.Get_library_version(); "
             "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libmpi.so' in l}))"]
    plain = subprocess.run(probe, capture_output=True, text=True, timeout=60,
                           env={**os.environ, "LD_LIBRARY_PATH": str(site_dir)})
    assert plain.stdout.strip() == str([str(venv_libmpi.resolve())]), plain.stderr  # the trap
    site = sites.SlurmSite(setup=f"export SITE_MPI_HOME={tmp_path / 'site-mpi'}",
                           mpi_library="$SITE_MPI_HOME/lib64/libmpi.so.12")
    chosen = _run_prologue(site, {}, probe)
    assert chosen.stdout.strip() == str([str(site_dir / "libmpi.so.12")]), chosen.stderr
    missing = _run_prologue(sites.SlurmSite(mpi_library="/nowhere/libmpi.so"), {}, probe)
    assert missing.returncode == 2 and "mpi_library /nowhere/libmpi.so: no such file" in missing.stderr


def test_in_a_container_the_site_mpi_library_is_set_inside_it_not_on_apptainer(tmp_path):
    """The prologue runs on the host before `apptainer exec`: the site's libmpi must reach the ranks inside
    the container (APPTAINERENV_*), not be preloaded into apptainer itself. A stand-in `apptainer` on PATH
    (no container runtime here) prints what it was started with, as apptainer would hand it in."""
    lib = tmp_path / "libmpi.so.12"
    lib.write_bytes(b"")
    stub = tmp_path / "bin" / "apptainer"
    stub.parent.mkdir()
    stub.write_text('#!/bin/sh\necho "runtime:${LD_PRELOAD:-}|${MPI4PY_LIBMPI:-}"\n'
                    'echo "inside:${APPTAINERENV_LD_PRELOAD:-}|${APPTAINERENV_MPI4PY_LIBMPI:-}"\n')
    stub.chmod(0o755)
    site = sites.SlurmSite(mpi_library=str(lib), wrap=["apptainer", "exec", "/opt/hpdl.sif"])
    env = {"PATH": f"{stub.parent}:{os.environ['PATH']}", "LD_PRELOAD": "", "MPI4PY_LIBMPI": ""}
    out = _run_prologue(site, {}, [*site.wrap, "python", "-m", "ipyparallel.engine"], env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["runtime:|", f"inside:{lib}|{lib}"], out.stdout
    bare = sites.rank_prologue(sites.SlurmSite(mpi_library=str(lib)))  # no container: as before
    assert 'export LD_PRELOAD="$hpdl_libmpi' in bare and "APPTAINERENV_" not in bare


def test_site_profiles_still_read_and_comments_are_harmless(tmp_path, monkeypatch):
    monkeypatch.delenv("HPDL_SITE", raising=False)
    for name in ("generic", "mvapich2-gdr", "nccl-gpu"):
        text = (sites.SITES_DIR / f"{name}.toml").read_text()
        tuned = tmp_path / f"{name}.toml"
        tuned.write_text(text + "\n# -- collective tuning (lesson 07) --\n# [env]\n# NCCL_ALGO = \"Ring\"\n")
        assert sites.load_site(str(tuned)).env == sites.load_site(name).env
    assert sites.main(["generic"]) == 0


def test_a_bad_entry_point_is_refused_with_a_message_and_changes_nothing(tmp_path, monkeypatch):
    from importlib import metadata

    from hpdl.launchers import base

    (tmp_path / "hpdl_t_site.py").write_text(
        "from hpdl.launchers import Launcher\n\n\n"
        "class Lsf(Launcher):\n    name = 'lsf-old'\n\n\n"
        "class MyLocal(Launcher):\n    name = 'local'\n\n\n"
        "def not_a_class():\n    pass\n\n\n"
        "class Flaky(Launcher):\n    name = 'flaky'\n    priority = 99\n\n"
        "    def detect(self):\n        raise RuntimeError('no batch system here')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    before = dict(launchers._REGISTRY)
    cases = {"lsf = hpdl_t_site:Lsf": "whose name is 'lsf-old': give both the same name",
             "local = hpdl_t_site:MyLocal": "takes the name of hpdl.launchers.local.Local",
             "odd = hpdl_t_site:not_a_class": "not a subclass of hpdl.launchers.Launcher",
             "gone = hpdl_t_nowhere:Gone": "ModuleNotFoundError"}
    try:
        for line, says in cases.items():
            name, _, value = (part.strip() for part in line.partition("="))
            problem = base._load(metadata.EntryPoint(name, value, base.GROUP))
            assert problem and says in problem and f"entry point `{line}`" in problem, problem
            assert launchers._REGISTRY == before  # the module's classes registered on import went again
        assert launchers.get("local").__class__.__module__ == "hpdl.launchers.local"
        # a launcher whose detect() fails is passed over by "auto", not fatal to it
        assert base._load(metadata.EntryPoint("flaky", "hpdl_t_site:Flaky", base.GROUP)) is None
        monkeypatch.delenv("SLURM_JOB_ID", raising=False)
        monkeypatch.delenv("HPDL_LAUNCHER", raising=False)
        assert launchers.resolve("auto") == "local" and "flaky" in launchers.known()
    finally:
        launchers._REGISTRY.clear()
        launchers._REGISTRY.update(before)


def test_the_address_other_nodes_are_given_is_not_debians_loopback_alias(monkeypatch):
    """Debian's /etc/hosts maps the machine's own name to 127.0.1.1: rank 0's rendezvous address and
    the controller's are the name's first address that is not loopback (and loopback only if that is all)."""
    import socket

    from hpdl import sites

    answers = {"node01": ["127.0.1.1", "10.1.2.3"], "laptop": ["127.0.1.1"]}
    monkeypatch.setattr(socket, "getaddrinfo", lambda host, *a, **k: [
        (socket.AF_INET, socket.SOCK_STREAM, 6, "", (addr, 0)) for addr in answers[host]])
    assert sites.outward_address("node01") == "10.1.2.3"
    assert sites.outward_address("laptop") == "127.0.1.1"
    monkeypatch.setenv("HPDL_SLURM_CONTROLLER_HOST", "node01")
    monkeypatch.delenv("HPDL_SITE", raising=False)
    from hpdl.launchers import slurm

    assert slurm.controller_address(sites.load_site()) == "10.1.2.3"
    # a kernel inside a job (the hub's) is on a compute node: the login node's name is not its own
    monkeypatch.setattr(socket, "gethostname", lambda: "laptop")
    assert slurm.controller_address(sites.load_site(), inside=True) == "127.0.1.1"



def test_a_controller_that_cannot_listen_is_said_plainly_and_leaves_nothing(monkeypatch, no_strays):
    """An address this machine does not have (a login node's name inside a job, a wrong controller_host):
    ipyparallel's own error is a RuntimeError about connection files; the learner reads what happened."""
    real = launchers.configure
    monkeypatch.setattr(launchers, "configure", lambda *a, **k: {**real(*a, **k), "controller_ip": "203.0.113.9"})
    with pytest.raises(HpdlError, match=r"on 203\.0\.113\.9\) stopped as it started(.|\n)*controller_host"):
        hpdl.start(n=2, launcher="local", frameworks=(), quiet=True, timeout=60)
    assert hpdl.status() == {"running": False}


def test_nodes_are_refused_before_anything_starts_where_the_mpi_cannot_place_them(monkeypatch, no_strays):
    """An mpiexec the kit does not start on nodes (Cray MPICH's, were it to have one): nodes_missing()
    says so, and start(nodes=...) refuses with those words before a controller or a rank exists; lesson
    04 asks first and runs on one node instead."""
    from hpdl import emulated
    from hpdl.launchers import mpiexec

    if emulated.missing():
        pytest.skip(emulated.missing())
    assert hpdl.nodes_missing() is None  # root and the kit's MPI: nothing missing
    monkeypatch.setitem(mpiexec._IMPLEMENTATION, mpiexec.find_mpiexec(), "Cray MPICH")
    why = hpdl.nodes_missing()
    assert why and "is Cray MPICH" in why and "make lab" in why
    from hpdl.cluster import home

    runs = set((home() / "runs").glob("*")) if (home() / "runs").exists() else set()
    with pytest.raises(HpdlError) as err:
        hpdl.start(n=2, nodes=2, frameworks=(), quiet=True)
    assert str(err.value) == why
    assert not hpdl.status()["running"]
    assert set((home() / "runs").glob("*")) <= runs  # no run folder: refused before a controller was started


def test_intel_mpi_ranks_that_share_no_memory_each_start_on_a_node_of_their_own(monkeypatch, tmp_path):
    """Intel MPI maps one start-up segment for a node's ranks: a check's isolated ranks each get a name
    (a node) and a proxy of their own, started through a remote shell that runs the proxy here. The
    real runs are test-mpi's (`make test-mpi MPI=impi`: test_a_rank_sees_no_other_ranks_files_nor_processes)."""
    import subprocess

    from hpdl.checker import runner

    local = ["/x/mpiexec", "-genv", "I_MPI_PIN", "0", "-bootstrap", "fork", "-n", "3"]
    monkeypatch.setattr(launchers, "mpiexec_implementation", lambda *a: "MPICH")
    assert runner._nodes_apart(local, 3, str(tmp_path)) == local and not list(tmp_path.iterdir())
    monkeypatch.setattr(launchers, "mpiexec_implementation", lambda *a: "Intel MPI")
    shell = tmp_path / "remote-shell-here"
    assert runner._nodes_apart(local, 3, str(tmp_path)) == [
        "/x/mpiexec", "-genv", "I_MPI_PIN", "0", "-bootstrap", "ssh", "-bootstrap-exec", str(shell),
        "-hosts", "hpdl-rank0,hpdl-rank1,hpdl-rank2", "-ppn", "1", "-n", "3"]
    assert shell.stat().st_mode & 0o777 == 0o700
    # called as ssh is by Hydra: options, the node's name, then the command, which runs here
    ran = subprocess.run([str(shell), "-q", "-x", "hpdl-rank1", "echo", "proxy", "$((1+1))"], capture_output=True,
                         text=True, timeout=10)
    assert ran.stdout == "proxy 2\n", ran
