"""Client side: how engines become MPI ranks — `mpiexec` here, `srun` on Slurm.

Each launcher fills in the ipyparallel configuration for one way of starting engines.
`hpdl.cluster` decides when to start and stop; this module only says how. The Slurm part also
reads the site profile (cluster/sites/*.toml, chosen by HPDL_SITE) that holds a site's
partition, account, PMI flavour, module loads and environment.
"""
from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hpdl.errors import HpdlError

LAUNCHERS = ("local", "slurm")


def find_mpiexec() -> str:
    """The mpiexec that belongs to this Python's MPI (the venv's first), else the one on PATH."""
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if found:
        return found
    raise HpdlError(
        "No mpiexec found: this Python has no MPI launcher next to it and none is on PATH.\n"
        "Run `make lab` from the kit's folder (it installs MPI into .venv), or on a cluster "
        "`module load` your site's MPI before starting JupyterLab."
    )


def resolve(launcher: str) -> str:
    """'auto' means Slurm inside a Slurm allocation, the local mpiexec everywhere else."""
    launcher = (launcher or "auto").lower()
    if launcher == "auto":
        launcher = os.environ.get("HPDL_LAUNCHER", "").lower() or (
            "slurm" if os.environ.get("SLURM_JOB_ID") and shutil.which("srun") else "local"
        )
    if launcher not in LAUNCHERS:
        raise HpdlError(f"launcher={launcher!r} is not one we know; use one of {', '.join(LAUNCHERS)} or 'auto'.")
    return launcher


def default_n(launcher: str) -> int:
    if launcher == "slurm" and os.environ.get("SLURM_NTASKS"):
        return int(os.environ["SLURM_NTASKS"])
    return min(4, os.cpu_count() or 1)


def engine_env() -> dict[str, str]:
    """Environment every engine starts with: one thread until the rank sets its share."""
    env = {"OMP_NUM_THREADS": "1", "IPP_NONINTERACTIVE": "1", "PYTHONUNBUFFERED": "1"}
    # The venv's bin first, so ranks find the same MPI and Python as the kernel.
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    return env


def configure_local(config, n: int) -> dict:
    """Engines as ranks of one `mpiexec -n N` job on this machine."""
    config.MPIEngineSetLauncher.mpi_cmd = [find_mpiexec()]
    config.MPIEngineSetLauncher.mpi_args = []
    return {"engines": "mpi", "controller_ip": "127.0.0.1"}


# -- Slurm ------------------------------------------------------------------------------------
#
# Two ways onto Slurm, chosen by where the kernel runs:
#   inside an allocation (SLURM_JOB_ID set: JupyterLab started by jupyter.sbatch or Open
#     OnDemand, or under salloc) -> the engines are one `srun --mpi=pmi2 -n N` step of that job;
#   outside one (a login node)  -> the engines are one submitted batch job whose script runs
#     `srun --mpi=pmi2 ipengine --mpi`; the kernel waits while it queues.
# Either way the controller listens on every interface and tells engines this host's name, so
# ranks on compute nodes can reach it. Site settings come from a site profile (HPDL_SITE, a TOML
# file in cluster/sites/) and HPDL_SLURM_* variables, the variables winning.

SITES_DIR = Path(__file__).resolve().parent.parent / "cluster" / "sites"

# key: (type, what it is) — the [slurm] table of a site profile; HPDL_SLURM_<KEY> overrides each.
SLURM_KEYS: dict[str, tuple[type, str]] = {
    "partition": (str, "partition (queue) for the engines' job"),
    "account": (str, "account to charge"),
    "qos": (str, "quality of service"),
    "time": (str, 'wall-time limit of the engines\' job, e.g. "02:00:00"'),
    "pmi": (str, 'srun --mpi flavour: "pmi2" (MPICH, MVAPICH2, Intel MPI), "pmix" (Open MPI), "cray_shasta"'),
    "ranks_per_node": (int, "ranks per node (0: let Slurm place them)"),
    "cpus_per_rank": (int, "cores per rank (0: Slurm's default)"),
    "gpus_per_rank": (int, "GPUs per rank (0: none asked for)"),
    "sbatch": (list, 'extra sbatch options, e.g. ["--constraint=gpu", "--exclusive"]'),
    "srun": (list, 'extra srun options, e.g. ["--cpu-bind=cores"]'),
    "wrap": (list, 'command put before each engine, e.g. ["apptainer", "exec", "--nv", "/opt/hpdl.sif"]'),
    "controller_host": (str, "host name or address compute nodes use to reach this machine"),
    "start_timeout": (int, "seconds to wait for ranks, queue time included"),
}
TOP_KEYS = {"description": str, "modules": list, "setup": str, "slurm": dict, "env": dict}


@dataclass
class SlurmSite:
    """Everything site-specific about putting engines on Slurm."""

    name: str = "default"
    source: str = "built-in defaults"
    description: str = ""
    partition: str = ""
    account: str = ""
    qos: str = ""
    time: str = ""
    pmi: str = "pmi2"
    ranks_per_node: int = 0
    cpus_per_rank: int = 0
    gpus_per_rank: int = 0
    sbatch: list[str] = field(default_factory=list)
    srun: list[str] = field(default_factory=list)
    wrap: list[str] = field(default_factory=list)
    controller_host: str = ""
    start_timeout: int = 0
    modules: list[str] = field(default_factory=list)
    setup: str = ""
    env: dict[str, str] = field(default_factory=dict)


def _site_file(spec: str) -> Path:
    path = Path(spec).expanduser()
    if path.suffix == ".toml" or os.sep in spec:
        if not path.is_file():
            raise HpdlError(f"HPDL_SITE={spec!r}: no such file.")
        return path
    path = SITES_DIR / f"{spec}.toml"
    if not path.is_file():
        known = sorted(p.stem for p in SITES_DIR.glob("*.toml"))
        raise HpdlError(
            f"HPDL_SITE={spec!r}: no site profile {path}. Known: {', '.join(known) or 'none'}; "
            "or give the path of a .toml file."
        )
    return path


def _read_toml(path: Path) -> dict:
    try:
        import tomllib
    except ImportError:  # Python 3.10
        try:
            import tomli as tomllib
        except ImportError:
            raise HpdlError(f"Reading {path} needs Python ≥ 3.11 (or `pip install tomli`).") from None
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise HpdlError(f"{path} is not valid TOML: {exc}. Compare with cluster/sites/generic.toml.") from None


def _check_type(where: str, key: str, value, kind: type) -> None:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is list:
        ok = ok and all(isinstance(v, str) for v in value)
    if kind is int:
        ok = ok and value >= 0
    if not ok:
        want = {str: "a string", int: "a whole number ≥ 0", list: "a list of strings", dict: "a table"}[kind]
        raise HpdlError(f"{where}: {key} must be {want}; got {value!r}.")


def load_site(spec: str | None = None) -> SlurmSite:
    """The site profile named by HPDL_SITE (or `spec`), then HPDL_SLURM_* overrides; validated."""
    spec = os.environ.get("HPDL_SITE", "") if spec is None else spec
    site = SlurmSite()
    if spec:
        path = _site_file(spec)
        data = _read_toml(path)
        where = str(path)
        for key, value in data.items():
            if key not in TOP_KEYS:
                raise HpdlError(f"{where}: unknown key {key!r}; a site profile has {', '.join(TOP_KEYS)}.")
            _check_type(where, key, value, TOP_KEYS[key])
        for key, value in data.get("slurm", {}).items():
            if key not in SLURM_KEYS:
                raise HpdlError(f"{where}: unknown key slurm.{key}; known: {', '.join(SLURM_KEYS)}.")
            _check_type(where, f"slurm.{key}", value, SLURM_KEYS[key][0])
            setattr(site, key, value)
        for key, value in data.get("env", {}).items():
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise HpdlError(f"{where}: env.{key} must be a string or a number; got {value!r}.")
            site.env[key] = str(value)
        site.name, site.source = path.stem, where
        site.description = data.get("description", "")
        site.modules = list(data.get("modules", []))
        site.setup = data.get("setup", "")
    for key, (kind, _) in SLURM_KEYS.items():
        var = f"HPDL_SLURM_{key.upper()}"
        raw = os.environ.get(var)
        if raw is None or raw == "":
            continue
        if kind is int:
            try:
                value = int(raw)
            except ValueError:
                raise HpdlError(f"{var}={raw!r}: {key} must be a whole number.") from None
        elif kind is list:
            value = shlex.split(raw)
        else:
            value = raw
        _check_type(var, key, value, kind)
        setattr(site, key, value)
    if not re.fullmatch(r"[A-Za-z0-9_]+", site.pmi):
        raise HpdlError(f"{site.source}: slurm.pmi={site.pmi!r} is not a PMI name (`srun --mpi=list` shows them).")
    return site


def _fmt_escape(text: str) -> str:
    """ipyparallel fills the batch template with str.format: keep the site's braces literal."""
    return text.replace("{", "{{").replace("}", "}}")


def sbatch_template(site: SlurmSite) -> str:
    """The engines' batch script, with ipyparallel's {n}, {cluster_id}, {output_file},
    {program} and {program_args} left for it to fill in."""
    opts = ["--job-name={cluster_id}", "--ntasks={n}", "--output={output_file}", "--export=ALL"]
    for flag, value in (("partition", site.partition), ("account", site.account), ("qos", site.qos),
                        ("time", site.time), ("ntasks-per-node", site.ranks_per_node),
                        ("cpus-per-task", site.cpus_per_rank), ("gpus-per-task", site.gpus_per_rank)):
        if value:
            opts.append(f"--{flag}={_fmt_escape(str(value))}")
    opts += [_fmt_escape(o) for o in site.sbatch]
    lines = ["#!/bin/bash"] + [f"#SBATCH {o}" for o in opts]
    lines += [
        f"# hpdl engines for a notebook kernel on {socket.gethostname()}; hpdl.stop() cancels this job.",
        f"# site profile: {_fmt_escape(site.source)}",
    ]
    if site.modules:
        lines.append("module load " + " ".join(shlex.quote(_fmt_escape(m)) for m in site.modules))
    if site.setup.strip():
        lines.append(_fmt_escape(site.setup.strip()))
    for key, value in site.env.items():
        lines.append(f"export {key}={shlex.quote(_fmt_escape(value))}")
    lines.append("{hpdl_exports}")  # hpdl.start(env=...): the learner's settings win over the site's
    lines.append("echo \"hpdl: job $SLURM_JOB_ID: $SLURM_NTASKS ranks on $SLURM_JOB_NODELIST\"")
    srun = ["srun", f"--mpi={site.pmi}", "--kill-on-bad-exit=1"] + [shlex.quote(_fmt_escape(a)) for a in site.srun]
    wrap = " ".join(shlex.quote(_fmt_escape(w)) for w in site.wrap)
    lines.append(" ".join(srun) + (f" {wrap}" if wrap else "") + " {program} --mpi {program_args}")
    return "\n".join(lines) + "\n"


def secure_profile(profile_dir: str | os.PathLike) -> None:
    """Connection files hold the key that lets a process run code as you: owner-only modes.

    ipyparallel writes its ipcontroller-*.json 0600 but the cluster file with the umask; on a
    shared cluster file system that matters, so make the security folder 0700 and files 0600.
    """
    security = Path(profile_dir) / "security"
    if not security.is_dir():
        return
    os.chmod(security, 0o700)
    for f in security.iterdir():
        if f.is_file():
            os.chmod(f, 0o600)


def _squeue(*args: str) -> tuple[int, str]:
    try:
        p = subprocess.run(["squeue", "-h", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return 1, str(exc)
    return p.returncode, p.stdout.strip() or p.stderr.strip()


def job_state(job_id: str) -> str | None:
    """'PENDING', 'RUNNING', ... while Slurm lists the job; None once it has left the queue;
    '' when squeue could not answer (the controller busy: ask again later)."""
    rc, out = _squeue("-j", str(job_id), "-o", "%T")
    if rc == 0:
        return out.splitlines()[0] if out else None
    return None if "Invalid job id" in out else ""


def _launcher_classes():
    """Our two ipyparallel engine launchers (defined lazily: ipyparallel is a heavy import)."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from ipyparallel.cluster.launcher import MPIEngineSetLauncher, SlurmEngineSetLauncher
    from traitlets import CRegExp, Dict, Integer, List

    class SrunEngineSetLauncher(MPIEngineSetLauncher):
        """Engines as one `srun` step of the allocation this kernel runs in."""

        site_env = Dict(config=True, help="variables the site profile adds for the engines")
        wrap = List(config=True, help="command put before each engine (a container runtime)")

        def get_env(self):
            return {**self.site_env, **super().get_env()}

        @property
        def program(self):
            return list(self.wrap) + self.engine_cmd + ["--mpi"]

        def find_args(self):
            # name the step after the cluster so it can be found (and cancelled) by name
            cmd = super().find_args()
            return cmd[:1] + [f"--job-name={self.cluster_id}"] + cmd[1:]

        def start(self, n):
            secure_profile(self.profile_dir)
            return super().start(n)

        @property
        def job_id(self) -> str | None:
            """JOB.STEP of the engines' step, for scancel should the kernel die."""
            if getattr(self, "_step", None) is None and self.state == "running":
                job = os.environ.get("SLURM_JOB_ID", "")
                rc, out = _squeue("-s", "-j", job, "-o", "%i %j")
                for line in out.splitlines() if rc == 0 else []:
                    step, _, name = line.partition(" ")
                    if name.strip() == self.cluster_id:
                        self._step = step
            return getattr(self, "_step", None)

    class SbatchEngineSetLauncher(SlurmEngineSetLauncher):
        """Engines as one submitted batch job; notices when the job ends or is cancelled."""

        site_env = Dict(config=True, help="variables the site profile adds for the engines")
        job_id_regexp = CRegExp(r"Submitted batch job (\d+)")
        job_id_regexp_group = Integer(1)
        poll_seconds = 2.0

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            # the script beside the engines' log, not in the notebook's folder
            self.batch_file = os.path.join(self.profile_dir, "log", f"{self.cluster_id}-engines.sbatch")

        def get_env(self):
            return {**self.site_env, **super().get_env()}

        def _run_command(self, command, **kwargs):
            # ipyparallel's version lets sbatch's stderr (the reason it refused) go to the terminal
            p = subprocess.run(command, capture_output=True, text=True, stdin=subprocess.DEVNULL, timeout=120, **kwargs)
            if p.returncode != 0 and command[:1] == self.submit_command[:1]:
                site = os.environ.get("HPDL_SITE")
                raise HpdlError(
                    f"sbatch refused the engines' job: {(p.stderr or p.stdout).strip()}\n"
                    "Check the partition/account/time settings (HPDL_SLURM_* variables"
                    + (f" or the site profile {site}" if site else ", or a site profile via HPDL_SITE")
                    + "). It asked for:\n    " + "\n    ".join(self._directives())
                )
            return p.stdout

        def _directives(self) -> list[str]:
            try:
                with open(self.batch_file) as f:
                    return [line.strip() for line in f if line.startswith("#SBATCH")]
            except OSError:
                return []

        def start(self, n=1):
            secure_profile(self.profile_dir)
            os.makedirs(os.path.dirname(self.batch_file), exist_ok=True)
            exports = [f"export {k}={shlex.quote(v)}" for k, v in self.environment.items() if k != "PATH"]
            self.namespace = {**self.namespace, "hpdl_exports": "\n".join(exports)}
            job = super().start(n)
            self.queue_state = "PENDING"
            threading.Thread(target=self._watch, daemon=True, name=f"hpdl-watch-{job}").start()
            return job

        def _watch(self) -> None:
            """Mark the engines stopped as soon as Slurm no longer lists the job: every 2 s
            while it queues and starts, every 30 s once it has run a while (squeue is shared)."""
            running_since = None
            while self.state == "running":
                state = job_state(self.job_id)
                if state is None:
                    self.notify_stop({"job_id": self.job_id, "state": self.queue_state})
                    return
                if state:
                    self.queue_state = state
                if state == "RUNNING" and running_since is None:
                    running_since = time.monotonic()
                settled = running_since is not None and time.monotonic() - running_since > 60
                time.sleep(30 if settled else self.poll_seconds)

        def signal(self, sig):
            subprocess.run(["scancel", "-s", str(sig), str(self.job_id)], capture_output=True, timeout=30)

        def stop(self):
            """Cancel the job and wait (bounded) until it has left the queue."""
            out = ""
            if self.job_id:
                p = subprocess.run(["scancel", str(self.job_id)], capture_output=True, text=True, timeout=30)
                out = p.stdout + p.stderr
                deadline = time.monotonic() + 30
                while job_state(self.job_id) is not None and time.monotonic() < deadline:
                    time.sleep(0.3)
            return self.notify_stop({"job_id": self.job_id, "output": out})

    for cls in (SrunEngineSetLauncher, SbatchEngineSetLauncher):
        cls.__qualname__ = cls.__name__  # importable as hpdl.launchers.<name> (cluster files name it)
    _CLASSES = (SrunEngineSetLauncher, SbatchEngineSetLauncher)
    return _CLASSES


_CLASSES = None


def __getattr__(name: str):
    # `hpdl.launchers.SbatchEngineSetLauncher` resolves without importing ipyparallel up front
    if name in ("SrunEngineSetLauncher", "SbatchEngineSetLauncher"):
        return dict(zip(("SrunEngineSetLauncher", "SbatchEngineSetLauncher"), _launcher_classes()))[name]
    raise AttributeError(f"module 'hpdl.launchers' has no attribute {name!r}")


def configure_slurm(config, n: int) -> dict:
    """Engines as ranks of one Slurm job step (srun inside an allocation, or a submitted job)."""
    if not shutil.which("srun") or not shutil.which("sbatch"):
        raise HpdlError(
            "launcher='slurm' needs Slurm's commands (srun, sbatch) and none are on PATH. On a "
            "cluster, `module load slurm` (or ask your admins); here, use launcher='local'."
        )
    site = load_site()
    srun_cls, sbatch_cls = _launcher_classes()
    kwargs = {"controller_ip": "*", "controller_location": site.controller_host or socket.gethostname()}
    if os.environ.get("SLURM_JOB_ID"):
        tasks = os.environ.get("SLURM_NTASKS")
        if tasks and tasks.isdigit() and n > int(tasks):
            raise HpdlError(
                f"This Slurm allocation (job {os.environ['SLURM_JOB_ID']}) has {tasks} tasks, fewer than "
                f"n={n} ranks. Start with hpdl.start(n={tasks}) or ask for more tasks (sbatch -n {n})."
            )
        args = ["--kill-on-bad-exit=1"]
        if os.environ.get("SLURM_STEP_ID"):  # the kernel itself runs in a step: share its CPUs
            args.append("--overlap")
        for flag, value in (("ntasks-per-node", site.ranks_per_node), ("cpus-per-task", site.cpus_per_rank),
                            ("gpus-per-task", site.gpus_per_rank)):
            if value:
                args.append(f"--{flag}={value}")
        config.SrunEngineSetLauncher.mpi_cmd = ["srun", f"--mpi={site.pmi}"]
        config.SrunEngineSetLauncher.mpi_args = args + site.srun
        config.SrunEngineSetLauncher.site_env = dict(site.env)
        config.SrunEngineSetLauncher.wrap = list(site.wrap)
        kwargs.update(engines=srun_cls, start_timeout=site.start_timeout or 120 + 5 * n)
    else:
        config.SbatchEngineSetLauncher.batch_template = sbatch_template(site)
        config.SbatchEngineSetLauncher.site_env = dict(site.env)
        kwargs.update(engines=sbatch_cls, start_timeout=site.start_timeout or 900)
    return kwargs


def configure(launcher: str, config, n: int) -> dict:
    """Fill `config` for `launcher`; returns keyword arguments for ipyparallel.Cluster."""
    if launcher == "local":
        return configure_local(config, n)
    return configure_slurm(config, n)
