"""Client side: site profiles — what the kit must know about one cluster to put ranks on it.

A site profile is a TOML file (cluster/sites/NAME.toml, chosen by HPDL_SITE=NAME or a path) with
the Slurm settings (partition, account, PMI flavour, resources per rank) and the environment every
rank needs (module loads, shell set-up lines, variables, the site's MPI library), and optionally
[expect]: the numbers `hpdl preflight` checks the nodes against, and [emulated]: this machine
as several nodes joined by links of a set rate (nodes, link). HPDL_SLURM_<KEY> variables
override single [slurm] keys. Two things are built here from one profile so they can
never disagree: the resources a job asks for and the resources its engines' step asks for, and the
shell lines that give every rank the site's environment, whichever way the ranks are started.

    python -m hpdl.sites [NAME]      # the profile in force, and the sbatch options it implies
"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
import shlex
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from hpdl import settings
from hpdl.errors import HpdlError

SITES_DIR = Path(__file__).resolve().parent.parent / "cluster" / "sites"

# key: (type, what it is) — the [slurm] table of a site profile; HPDL_SLURM_<KEY> overrides each.
SLURM_KEYS: dict[str, tuple[type, str]] = {
    "partition": (str, "partition (queue) for the engines' job"),
    "account": (str, "account to charge"),
    "qos": (str, "quality of service"),
    "reservation": (str, "Slurm reservation the course's jobs run in (sbatch --reservation)"),
    "time": (str, 'wall-time limit of the engines\' job, e.g. "02:00:00"'),
    "pmi": (str, 'srun --mpi flavour: "pmi2" (MPICH, MVAPICH2, Intel MPI), "pmix" (Open MPI), "cray_shasta"'),
    "ranks_per_node": (int, "ranks per node (0: let Slurm place them)"),
    "cpus_per_rank": (int, "cores per rank (0: Slurm's default)"),
    "gpus_per_rank": (int, "GPUs per rank (0: none asked for)"),
    "sbatch": (list, 'extra sbatch options, e.g. ["--constraint=gpu", "--exclusive"]'),
    "srun": (list, 'extra srun options, e.g. ["--cpu-bind=cores"]'),
    "wrap": (list, 'command put before each engine, e.g. ["apptainer", "exec", "--nv", "/opt/hpdl.sif"]'),
    "controller_host": (str, "host name or address compute nodes use to reach this machine (the login node; a kernel "
                        "inside a job uses its own node's name)"),
    "start_timeout": (int, "seconds to wait for ranks, queue time included"),
    "learners_per_node": (int, "learners whose jobs share one node (0: not planned; 1: a node each)"),
}
LESSON_RANKS = 4  # the ranks a learner's job holds for the lessons (the hub's and the form's default)
# key: (type, unit and meaning) — the optional [expect] table: what `hpdl preflight` compares the
# site's ranks with. A key left out is reported, not judged. GB/s are 10^9 bytes per second.
EXPECT_KEYS: dict[str, tuple[type, str]] = {
    "gpus_per_node": (int, "GPUs in use on every node, one per rank (0: a CPU site)"),
    "cuda_aware_mpi": (bool, "the MPI library each rank loads says it is CUDA-aware"),
    "mpi_library_contains": (str, 'text in the first line of MPI_Get_library_version(), e.g. "MVAPICH2-GDR"'),
    "within_node_8B_us_max": (float, "µs, at most: median 8-byte MPI_Allreduce among the ranks of one node"),
    "across_nodes_8B_us_max": (float, "µs, at most: median 8-byte MPI_Allreduce among one rank per node"),
    "within_node_busbw_GBps_min": (float, "GB/s, at least: allreduce bus bandwidth within a node, largest size"),
    "across_nodes_busbw_GBps_min": (float, "GB/s, at least: allreduce bus bandwidth across nodes, largest size"),
}
# [emulated]: this machine as several nodes (hpdl/emulated.py), for hpdl.start() on the local launcher
EMULATED_KEYS: dict[str, tuple[type, str]] = {
    "nodes": (int, "emulated nodes hpdl.start() puts its ranks on (1-64), in blocks: 4 ranks on 2 nodes = 2 × 2"),
    "link": (str, "each node's link rate, in tc's spelling (200mbit, 1gbit)"),
}
TOP_KEYS = {"description": str, "modules": list, "build_modules": list, "setup": str, "mpi_library": str,
            "slurm": dict, "env": dict, "expect": dict, "emulated": dict}

# site field -> the sbatch/srun option that asks for it; the job and its steps use the same three
RESOURCES = (("ranks_per_node", "ntasks-per-node"), ("cpus_per_rank", "cpus-per-task"),
             ("gpus_per_rank", "gpus-per-task"))
# the same option -> the variable Slurm sets inside a job that asked for it
JOB_VARS = {"ntasks-per-node": "SLURM_NTASKS_PER_NODE", "cpus-per-task": "SLURM_CPUS_PER_TASK",
            "gpus-per-task": "SLURM_GPUS_PER_TASK"}


@dataclass
class SlurmSite:
    """Everything site-specific about putting engines on Slurm."""

    name: str = "default"
    source: str = "built-in defaults"
    description: str = ""
    partition: str = ""
    account: str = ""
    qos: str = ""
    reservation: str = ""
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
    learners_per_node: int = 0
    modules: list[str] = field(default_factory=list)
    build_modules: list[str] = field(default_factory=list)  # for building (cluster/build), never loaded by ranks
    setup: str = ""
    mpi_library: str = ""
    env: dict[str, str] = field(default_factory=dict)
    expect: dict[str, int | float | bool | str] = field(default_factory=dict)
    emulated_nodes: int = 0   # [emulated] nodes: 0 = the machine as it is
    emulated_link: str = ""   # [emulated] link


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
    accepted = (int, float) if kind is float else kind  # a TOML 20 is as good as 20.0
    ok = isinstance(value, accepted) and (kind is bool or not isinstance(value, bool))
    if kind is list:
        ok = ok and all(isinstance(v, str) for v in value)
    if kind in (int, float):
        ok = ok and value >= 0
    if not ok:
        want = {str: "a string", int: "a whole number ≥ 0", float: "a number ≥ 0", bool: "true or false",
                list: "a list of strings", dict: "a table"}[kind]
        raise HpdlError(f"{where}: {key} must be {want}; got {value!r}.")


def _read_emulated(site: SlurmSite, where: str, table: dict) -> None:
    """A profile's [emulated] table into `site`, checked."""
    for key, value in table.items():
        if key not in EMULATED_KEYS:
            raise HpdlError(f"{where}: unknown key emulated.{key}; known: {', '.join(EMULATED_KEYS)}.")
        _check_type(where, f"emulated.{key}", value, EMULATED_KEYS[key][0])
        setattr(site, f"emulated_{key}", value)
    if not 0 <= site.emulated_nodes <= 64:
        raise HpdlError(f"{where}: emulated.nodes must be between 1 and 64; got {site.emulated_nodes}.")


def load_site(spec: str | None = None) -> SlurmSite:
    """The site profile named by HPDL_SITE (or `spec`), then HPDL_SLURM_* overrides; validated."""
    spec = (settings.SITE.get() or "") if spec is None else spec
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
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
                raise HpdlError(f"{where}: env.{key} is not a variable name.")
            site.env[key] = str(value)
        for key, value in data.get("expect", {}).items():
            if key not in EXPECT_KEYS:
                raise HpdlError(f"{where}: unknown key expect.{key}; known: {', '.join(EXPECT_KEYS)}.")
            _check_type(where, f"expect.{key}", value, EXPECT_KEYS[key][0])
            site.expect[key] = value
        _read_emulated(site, where, data.get("emulated", {}))
        site.name, site.source = path.stem, where
        site.description = data.get("description", "")
        site.modules = list(data.get("modules", []))
        site.build_modules = list(data.get("build_modules", []))
        site.setup = data.get("setup", "")
        site.mpi_library = data.get("mpi_library", "")
    for key, (kind, _) in SLURM_KEYS.items():
        var = settings.SLURM.of(key).name
        raw = settings.SLURM.of(key).raw()
        if raw is None:
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
    _check_sharing(site)
    if not re.fullmatch(r"[A-Za-z0-9_]+", site.pmi):
        raise HpdlError(f"{site.source}: slurm.pmi={site.pmi!r} is not a PMI name (`srun --mpi=list` shows them).")
    return site


def _check_sharing(site: SlurmSite) -> None:
    """A node planned for several learners must not be asked for whole: with --exclusive each
    learner's job would hold a node, and forty learners forty nodes."""
    whole = [o for o in site.sbatch if o == "--exclusive" or o.startswith("--exclusive=")]
    if site.learners_per_node > 1 and whole:
        raise HpdlError(f"{site.source}: learners_per_node = {site.learners_per_node} but sbatch asks for "
                        f"{whole[0]}, which gives each learner a whole node. Remove it (shared nodes), or set "
                        "learners_per_node = 1.")


def learner_share(site: SlurmSite, ranks: int = LESSON_RANKS) -> str:
    """What one learner's job of `ranks` ranks holds, and what a node holds for all the learners it
    is planned for, in words: for the instructor planning a course (`python -m hpdl.sites`)."""
    cores, gpus = max(site.cpus_per_rank, 1), site.gpus_per_rank
    text = f"a learner's {ranks} ranks hold {ranks * cores} core(s)" + (f" and {ranks * gpus} GPU(s)" if gpus else "")
    on_node = min(ranks, site.ranks_per_node or ranks)  # a learner's ranks on any one node
    if on_node < ranks:
        text += f", {on_node} rank(s) on each of {-(-ranks // on_node)} nodes"
    if site.learners_per_node:
        n = site.learners_per_node
        text += (f"; {n} learner(s) per node need {n * on_node * cores} core(s)"
                 + (f" and {n * on_node * gpus} GPU(s)" if gpus else "") + " on each node")
    return text


# -- resources: one source for the job and its steps --------------------------------------------

def resource_options(site: SlurmSite) -> list[str]:
    """The per-rank resources the site asks for, as options both sbatch and srun understand.

    The engines' job asks for these, and so does the srun step inside it: since Slurm 22.05 a step
    no longer inherits --cpus-per-task from its job, and a step asking for more than its job holds
    is refused ("More processors requested than permitted")."""
    return [f"--{flag}={getattr(site, key)}" for key, flag in RESOURCES if getattr(site, key)]


def job_resource_options(environ: dict[str, str] | None = None) -> list[str]:
    """Inside an allocation: the same options, with the values the job actually holds.

    A step may ask only for what its job holds; Slurm says what that is in SLURM_* variables,
    which is what an srun step started from a kernel inside a job (jupyter.sbatch, Open OnDemand,
    salloc) asks for, whatever the site profile would have liked."""
    environ = os.environ if environ is None else environ
    opts = []
    for flag, var in JOB_VARS.items():
        value = environ.get(var, "").split("(")[0]  # SLURM_NTASKS_PER_NODE may read "2(x3)"
        if value.isdigit() and int(value) > 0:
            opts.append(f"--{flag}={value}")
    return opts


def resource_mismatch(site: SlurmSite, environ: dict[str, str] | None = None) -> str:
    """What the site profile asks per rank beyond what the job around this kernel holds ('' if nothing)."""
    held = dict(o[2:].split("=") for o in job_resource_options(environ))
    defaults = {"cpus-per-task": "1", "gpus-per-task": "none"}  # a job that asked for nothing
    short = []
    for key, flag in RESOURCES[1:]:  # ranks per node is placement, not an amount held
        want, has = getattr(site, key), held.get(flag, defaults[flag])
        if want and (not has.isdigit() or int(has) < want):
            short.append(f"--{flag}={want} (the job holds {has})")
    return ", ".join(short)


def sbatch_args(site: SlurmSite) -> list[str]:
    """sbatch options for a job whose tasks will be the ranks: what the site profile asks for.

    For jupyter.sbatch, run.sbatch and Open OnDemand, so their jobs hold what the engines' step
    of the site will use: `sbatch $(python -m hpdl.sites --sbatch) -n 4 cluster/slurm/jupyter.sbatch`."""
    opts = [f"--{flag}={value}" for flag, value in (("partition", site.partition), ("account", site.account),
                                                    ("qos", site.qos), ("reservation", site.reservation),
                                                    ("time", site.time)) if value]
    return opts + resource_options(site) + list(site.sbatch)


# -- the environment of every rank ----------------------------------------------------------------

_FIND_MODULE = (
    "if ! command -v module >/dev/null 2>&1; then\n"
    "  for f in /etc/profile.d/lmod.sh /etc/profile.d/modules.sh /usr/share/lmod/lmod/init/bash; do\n"
    "    [ -r \"$f\" ] && . \"$f\" && break\n"
    "  done\n"
    "fi"
)


def kit_folder() -> Path:
    """The kit's folder: $HPDL_DIR, else the one this package belongs to (shared with the nodes)."""
    return settings.DIR.get() or SITES_DIR.parent.parent


def rank_prologue(site: SlurmSite, keep: Iterable[str] = ()) -> str:
    """Shell lines run on every rank before its engine starts, in every launch mode.

    In order: module loads, the site's set-up lines (with HPDL_DIR set to the kit's folder when the
    kernel did not set it, since a shared kit's profile sources "$HPDL_DIR/.venv/bin/activate"), its
    [env], then the variables named in `keep` (the engines' own: the learner's hpdl.start(env=...),
    ipyparallel's connection info) put back as the rank inherited them, so they win over the site's;
    then the site's MPI library put first:
    LD_PRELOAD loads it before anything else and MPI4PY_LIBMPI points mpi4py at it. Without that,
    mpi4py's loader tries the venv's lib/ (where the `mpich` wheel's libmpi.so.12 lives) before
    LD_LIBRARY_PATH, and the ranks silently run the wheel's MPI instead of, say, MVAPICH2-GDR.

    Only the names of `keep` are written here, never their values: this text becomes a command
    line (`bash -c ...`) that every user on the node can read (`ps`), and ipyparallel's connection
    info holds the key that lets a client drive the ranks. The values reach the rank through its
    environment (the step exports the kernel's, see launchers.slurm.STEP_EXPORT)."""
    names = [k for k in dict.fromkeys(keep) if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k)]
    lines = []
    saving = (site.modules or site.setup.strip() or site.env) and names
    if saving:  # what the site's lines could change: saved first, as `declare -px` quotes it
        lines.append(f"hpdl_kept=$(declare -px {' '.join(names)} 2>/dev/null)")
    if site.modules:
        lines += [_FIND_MODULE, "module load " + " ".join(shlex.quote(m) for m in site.modules)]
    if site.setup.strip():  # the kit's folder for its lines ($HPDL_DIR/.venv/bin/activate), as the kernel's
        lines.append(f'[ -n "${{{settings.DIR.name}:-}}" ] || {settings.DIR.name}={shlex.quote(str(kit_folder()))}; '
                     f'export {settings.DIR.name}')
        lines.append(site.setup.strip())
    for key, value in site.env.items():
        lines.append(f"export {key}={shlex.quote(value)}")
    if saving:
        lines.append('eval "$hpdl_kept"; unset hpdl_kept')
    if site.mpi_library:
        into = _container_env_prefix(site)
        # the path may name variables a module set ($MV2_PATH): expand on the node, keep quoted
        lib = '"' + site.mpi_library.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
        lines += [f"hpdl_libmpi={lib}",
                  '[ -r "$hpdl_libmpi" ] || { echo "hpdl: mpi_library $hpdl_libmpi: no such file on $(hostname)" >&2;'
                  " exit 2; }",
                  f'export {into}LD_PRELOAD="$hpdl_libmpi${{{into}LD_PRELOAD:+:${into}LD_PRELOAD}}" '
                  f'{into}MPI4PY_LIBMPI="$hpdl_libmpi"']
    return "\n".join(lines)


def _container_env_prefix(site: SlurmSite) -> str:
    """Where the prologue's MPI library goes when the ranks run in a container (`wrap`): this prologue runs
    on the host, before `apptainer exec`, so a plain LD_PRELOAD would load the site's libmpi into apptainer
    itself. APPTAINERENV_X (SINGULARITYENV_X) sets X inside the container only."""
    runtime = Path(site.wrap[0]).name if site.wrap else ""
    return {"apptainer": "APPTAINERENV_", "singularity": "SINGULARITYENV_"}.get(runtime, "")


def rank_wrapper(site: SlurmSite, keep: Iterable[str] = ()) -> list[str]:
    """A command prefix that runs the prologue on the rank, then execs the rest of the line."""
    prologue = rank_prologue(site, keep)
    if not prologue:
        return []
    return ["bash", "-c", prologue + '\nexec "$@"', "hpdl-rank"]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    names = [a for a in argv if not a.startswith("-")]
    try:
        site = load_site(names[0] if names else None)
    except HpdlError as exc:
        print(f"hpdl.sites: {exc}", file=sys.stderr)
        return 2
    if "--sbatch" in argv:
        print(" ".join(shlex.quote(o) for o in sbatch_args(site)))
        return 0
    print(f"site profile {site.name} ({site.source}){': ' + site.description if site.description else ''}")
    print("sbatch options:  " + (" ".join(sbatch_args(site)) or "(none)"))
    print("per-rank step:   srun --mpi=" + " ".join([site.pmi, *resource_options(site), *site.srun]))
    print("per learner:     " + learner_share(site))
    prologue = rank_prologue(site)
    print("on every rank:\n" + ("\n".join("    " + line for line in prologue.splitlines()) or "    (nothing)"))
    if site.build_modules:
        print("to build (hpdl wheelhouse build, cluster/build; never on the ranks): module load "
              + " ".join(site.build_modules))
    if site.expect:
        print("expected (hpdl preflight): " + ", ".join(f"{k} = {v}" for k, v in site.expect.items()))
    if site.emulated_nodes:
        print(f"emulated nodes (hpdl.start on this machine): {site.emulated_nodes}, "
              f"joined by {site.emulated_link or 'the default'} links")
    return 0


if __name__ == "__main__":
    sys.exit(main())


def outward_address(host: str) -> str:
    """`host`'s IPv4 address that other nodes can reach: the first that is not loopback.

    Debian-style /etc/hosts maps a machine's own name to 127.0.1.1, so `gethostbyname(gethostname())`
    hands other nodes an address that is theirs too. Raises socket.gaierror if `host` does not resolve."""
    found = [info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)]
    outward = [a for a in found if not ipaddress.ip_address(a).is_loopback]
    return (outward or found)[0]
