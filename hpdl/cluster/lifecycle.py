"""Client side: start the engines that are the learner's MPI ranks, reuse them, stop them.

`start(n)` launches an ipyparallel controller and `n` engines as ranks of one MPI job
(`mpiexec` here, `srun` on Slurm; see hpdl/launchers/), waits until every rank is set up
(rank.py runs on each), and activates `%%px` (px.py). Every call into hpdl.launchers is in
`_launch` and `start`; the one place that asks what a launcher is, is `_launcher_traits`.
"""
from __future__ import annotations

import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpdl import emulated, emulated_userns, hang, launchers, mpilib, procs, settings, sites
from hpdl.cluster import cleanup
from hpdl.errors import ClusterNotRunning, HpdlError

log = logging.getLogger(__name__)

DEFAULT_CELL_TIMEOUT = settings.CELL_TIMEOUT.default_value()
DEFAULT_FRAMEWORKS = ("torch", "horovod")
KNOWN_FRAMEWORKS = {"torch", "horovod"}
ENGINE_HEARTBEAT_MISSES = 175  # checks with no ping from the hub before an engine gives up (see _launch)


# Intel MPI runs a collective across nodes as a step through each node's shared memory plus one
# over the network. Horovod's MPI thread runs an all-reduce of its own every cycle, on its own
# communicator, while a cell's mpi4py collective runs: across nodes the two deadlock in that
# shared-memory step. Measured on 2 emulated nodes x 2 ranks (Intel MPI 2021.18, libfabric tcp):
# 7 of 10 jobs hung in their first Allreduce after hvd.init(); 0 of 10 with the node's step made of
# point-to-point messages, as here; 0 of 10 on one node. MPICH, Open MPI and MVAPICH2 ignore it.
HOROVOD_ACROSS_NODES_ENV = {"I_MPI_COLL_INTRANODE": "pt2pt"}


def _rank_env(launcher: str, frameworks: tuple[str, ...], env: dict[str, str], across_nodes: bool) -> dict[str, str]:
    """The ranks' environment: the launcher's, HOROVOD_ACROSS_NODES_ENV where Horovod's thread shares
    the ranks with the learner's collectives and the ranks may sit on several nodes (emulated, or a
    launcher such as srun), then the learner's own `env`, which wins."""
    spread = across_nodes or not _launcher_traits(launcher)[0]
    return {**launchers.engine_env(), **(HOROVOD_ACROSS_NODES_ENV if "horovod" in frameworks and spread else {}),
            **env}


def _launcher_traits(launcher: str) -> tuple[bool, str, str]:
    """(ranks run on this machine, what started them, a hint when they are slow to register),
    from the launcher's class in the registry (hpdl/launchers/)."""
    cls = launchers.get(launcher)
    return cls.ranks_are_local, cls.label or cls.name, cls.queue_hint


@dataclass(eq=False)
class Cluster:
    """The running set of ranks: what was started, and how to reach and stop it.

    Also a context manager for scripts: `with hpdl.start(n=2) as c: ...` stops the ranks on exit.
    """

    n: int
    launcher: str
    frameworks: tuple[str, ...]
    cell_timeout: float
    env: dict
    ipp: Any  # ipyparallel.Cluster
    client: Any  # ipyparallel.Client
    run_dir: Path
    state_file: Path
    reaper: Any  # subprocess.Popen of hpdl.reaper, or None
    ranks: list[dict] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    start_seconds: float = 0.0
    wedged: dict = field(default_factory=dict)  # msg_id -> rank, for cells that timed out
    rank_procs: dict = field(default_factory=dict)  # rank -> procs.Proc, where the ranks run here
    stopped: bool = False
    network: Any = None  # emulated.Network when the ranks run on emulated nodes, else None

    def __repr__(self) -> str:  # cheap: no health probe (a rank may be stuck)
        state = "stopped" if self.stopped else f"started {time.time() - self.started_at:.0f} s ago"
        nodes = f" on {self.network.nodes} emulated nodes ({self.network.link})" if self.network else ""
        return f"<hpdl cluster: {self.n} rank{'s' if self.n != 1 else ''}{nodes} via {self.launcher}, {state}>"

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> bool:
        if running() is self:
            stop(quiet=True)
        return False

    @property
    def view(self):
        from hpdl.cluster.rankview import rank_view

        return rank_view(self.client, current)

    @property
    def local(self) -> bool:
        return _launcher_traits(self.launcher)[0]

    # -- health -----------------------------------------------------------------------
    def engine_pids(self) -> dict[int, int]:
        return {r["rank"]: r["pid"] for r in self.ranks}

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone (checked by process here, by registration elsewhere)."""
        if self.local:
            return [r["rank"] for r in self.ranks
                    if r["rank"] not in self.rank_procs or not procs.is_alive(self.rank_procs[r["rank"]])]
        registered = set(self.client.ids) if self.client is not None else set()
        return [r["rank"] for r in self.ranks if r["engine_id"] not in registered]

    def problem(self) -> str | None:
        """Why this cluster cannot take more work, or None when it is healthy."""
        if self.stopped:
            return "stopped"
        dead = self.dead_ranks()
        if dead:
            return f"{hang.rank_word(dead)} no longer running"
        if self.wedged and set(self.wedged) & set(self.client.outstanding):
            return f"{hang.rank_word(set(self.wedged.values()))} still stuck in a cell that timed out"
        return None

    def launcher_output(self) -> str:
        out = []
        for es in getattr(self.ipp, "engines", {}).values():
            try:
                out.append(es.get_output(remove=False))
            except Exception as exc:
                log.debug("no output from %s: %s", es, exc)
        return "\n".join(out)


_current: Cluster | None = None


def running() -> Cluster | None:
    """The running cluster, or None: the public way for other modules to find it."""
    return _current


def current() -> Cluster:
    """The running cluster; ClusterNotRunning (with what to do) when there is none."""
    if _current is None:
        raise ClusterNotRunning("No ranks are running. Start them with hpdl.start(n=2) (or %hpdl start -n 2).")
    return _current


def _check_args(n, frameworks, cell_timeout) -> tuple[int, tuple[str, ...], float]:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise HpdlError(f"n is the number of ranks, a whole number ≥ 1; got {n!r}. Try hpdl.start(n=2).")
    if n > 256:
        raise HpdlError(f"n={n} ranks is more than this kit starts at once (256).")
    if isinstance(frameworks, str):
        frameworks = (frameworks,)
    frameworks = tuple(frameworks or ())
    unknown = set(frameworks) - KNOWN_FRAMEWORKS
    if unknown:
        raise HpdlError(
            f"frameworks={frameworks!r}: {', '.join(sorted(unknown))} unknown; choose from "
            f"{sorted(KNOWN_FRAMEWORKS)} (or () for MPI only)."
        )
    if cell_timeout is None:  # read now, not at import: a notebook may set it before hpdl.start()
        cell_timeout = settings.CELL_TIMEOUT.get()
    try:
        cell_timeout = float(cell_timeout)
    except (TypeError, ValueError):
        raise HpdlError(f"cell_timeout is in seconds; got {cell_timeout!r}.") from None
    if cell_timeout <= 0:
        raise HpdlError(f"cell_timeout must be positive seconds; got {cell_timeout}.")
    return n, frameworks, cell_timeout


def _say(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def start(
    n: int | None = None,
    launcher: str = "auto",
    *,
    frameworks: tuple[str, ...] | list[str] | str = DEFAULT_FRAMEWORKS,
    cell_timeout: float | None = None,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    nodes: int | None = None,
    link: str | int | float | None = None,
    quiet: bool = False,
) -> Cluster:
    """Start `n` engines as MPI ranks and make `%%px` run cells on all of them.

    Called again with the same settings while the ranks are healthy, it reuses them (your
    variables on the engines survive); if a rank died or is stuck, or settings differ, it
    stops the old ranks and starts fresh ones.

    `cell_timeout`: seconds a %%px cell or a blocking hpdl.view() call may run; default $HPDL_CELL_TIMEOUT.
    `env` sets environment variables on every rank before MPI, torch.distributed and Horovod
    start — the way to try knobs such as HOROVOD_FUSION_THRESHOLD, NCCL_ALGO or MV2_USE_CUDA.
    In a script, `with hpdl.start(n=2) as c:` stops the ranks when the block ends.
    `nodes` puts the ranks on that many emulated nodes joined by links of rate `link` ("1gbit"; as
    root or in a user namespace; hpdl/emulated.py); defaults $HPDL_NODES (0: none) and $HPDL_LINK,
    else the site profile's [emulated] table ($HPDL_SITE), read at this call.
    """
    global _current
    launcher = launchers.resolve(launcher)
    if n is None:
        n = launchers.default_n(launcher)
    n, frameworks, cell_timeout = _check_args(n, frameworks, cell_timeout)
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        raise HpdlError(f"env is a dict of environment variables, e.g. {{'HOROVOD_CYCLE_TIME': '5'}}; got {env!r}.")
    env = {k: str(v) for k, v in (env or {}).items()}
    layout = _check_nodes(n, launcher, nodes, link)

    if _current is not None:
        old = _current
        why = old.problem()
        same = (old.n, old.launcher, old.env, _layout(old)) == (n, launcher, env, layout) \
            and set(frameworks) <= set(old.frameworks)
        if why is None and same:
            old.cell_timeout = cell_timeout
            _activate(old)
            _say(f"hpdl: reusing the {n} running ranks (started {time.time() - old.started_at:.0f} s ago).", quiet)
            return old
        _say(f"hpdl: {'restarting: ' + why if why else 'stopping the old ranks for the new settings'}.", quiet)
        stop(quiet=True)

    t0 = time.perf_counter()
    swept = procs.remove_orphaned_shared_memory()  # e.g. a kernel restarted after it had started MPI
    if swept:
        log.info("removed MPI shared memory nothing used any more: %s", swept)
    cluster = _launch(n, launcher, frameworks, cell_timeout, timeout, env, quiet, layout)
    cluster.start_seconds = time.perf_counter() - t0
    _current = cluster
    _activate(cluster)
    _say(_summary(cluster), quiet)
    return cluster


def _check_nodes(n: int, launcher: str, nodes, link) -> tuple | None:
    """(nodes, link) for emulated nodes, checked; None for ranks on this machine as they are. Each
    comes from the argument, else $HPDL_NODES / $HPDL_LINK, else the site profile's [emulated]."""
    site = sites.load_site() if settings.SITE.get() and (nodes is None or link is None) else None
    if nodes is None:
        nodes = settings.NODES.get() or (site.emulated_nodes if site else 0) or None
    if nodes is None:
        return None
    if link is None:
        link = site.emulated_link if site and site.emulated_link and not settings.LINK.is_set() else settings.LINK.get()
    emulated.placement(n, nodes)
    emulated.link_bits_per_second(link)
    if not _launcher_traits(launcher)[0]:
        raise HpdlError(f"nodes={nodes} emulates nodes on this machine, but launcher={launcher!r} starts ranks "
                        "elsewhere: use launcher='local' (or leave out nodes= to use the real nodes).")
    problem = nodes_missing()
    if problem:
        raise HpdlError(problem)
    return nodes, str(link)


def _layout(cluster: Cluster) -> tuple | None:
    net = cluster.network
    return None if net is None else (net.nodes, net.link)


def _on_nodes(n: int, config, kwargs: dict, layout: tuple, run_dir: Path):
    """Create the emulated nodes; point the engines' mpiexec and the controller at them."""
    which = emulated.require_launcher(config.MPIEngineSetLauncher.mpi_cmd[0])
    if left := cleanup.sweep_emulated_nodes():
        log.info("removed emulated nodes no running cluster owned: %s", left)
    network = emulated.create(n, layout[0], layout[1], run_dir)
    config.MPIEngineSetLauncher.mpi_cmd = [*network.prefix, *config.MPIEngineSetLauncher.mpi_cmd,
                                           *network.mpiexec_flags(which)]
    config.EngineLauncher.environment = {**emulated.RANK_ENV, **config.EngineLauncher.environment}
    if network.userns:  # no TCP from the nodes' network to the host's: the ranks reach the hub by Unix sockets
        path = emulated_userns.engine_socket_path(run_dir)
        kwargs["controller_args"] = [*kwargs.get("controller_args", []), "--IPController.engine_transport=ipc",
                                     f"--IPController.engine_ip={path}"]
    else:
        kwargs["controller_ip"] = network.bridge_address
    return network


def _heartbeats(config, kwargs: dict) -> None:
    """The hub admits an engine at its first heartbeat, and pings every 3 s by default: pinged every 0.5 s,
    ranks are ready ~4 s sooner; 60 missed pings still mean the same 30 s of silence before the hub gives an
    engine up. An engine gives up on the hub after max_heartbeat_misses checks with no ping, one check every
    period + 0.5 s: at 0.5 s its default 50 would be 50 s, which learners starting side by side on a small node
    can go without a ping; ENGINE_HEARTBEAT_MISSES keeps ipyparallel's own patience (50 x 3.5 s)."""
    kwargs["controller_args"] = [*kwargs.get("controller_args", []), "--HeartMonitor.period=500",
                                 "--HeartMonitor.max_heartmonitor_misses=60"]
    config.EngineLauncher.engine_args.append(f"--IPEngine.max_heartbeat_misses={ENGINE_HEARTBEAT_MISSES}")


def _fork_engines(config, run_dir: Path) -> None:
    """The engines as forks of one process that imported torch once (hpdl.forkserver): every rank
    imports it to set up torch.distributed, ~1 s of CPU each, all at once on the same cores. Only
    where the ranks are this machine's own processes under its mpiexec (no emulated nodes, whose
    ranks live in other network namespaces; no batch system, whose ranks may be on other nodes);
    not with HPDL_FORKSERVER=0 or a run folder too deep for a Unix socket (forkserver.commands)."""
    from hpdl import forkserver

    forked = forkserver.commands(str(run_dir), ["torch"], "ipyparallel.engine")
    if forked:
        config.MPIEngineSetLauncher.mpi_cmd = [*forked[0], *config.MPIEngineSetLauncher.mpi_cmd]
        config.MPIEngineSetLauncher.engine_cmd = forked[1]


def _link_engine_sockets(ipp_cluster, timeout: float) -> None:
    """On nodes in a user namespace: once the controller has written its engines' connection file,
    give its Unix sockets the names the engines will ask for (emulated_userns.link_engine_sockets)."""
    path = Path(ipp_cluster.controller.connection_files["engine"])
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline and ipp_cluster.controller.running:
        time.sleep(0.05)
    if path.exists():
        emulated_userns.link_engine_sockets(path)


def _launch(n, launcher, frameworks, cell_timeout, timeout, env, quiet, layout=None) -> Cluster:
    import ipyparallel as ipp
    from traitlets.config import Config

    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    config = Config()
    kwargs = launchers.configure(launcher, config, n)
    config.EngineLauncher.environment = _rank_env(launcher, tuple(frameworks), env, layout is not None)
    cluster_id = f"hpdl-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    profile_dir = cleanup.home() / "profile"
    run_dir = cleanup.home() / "runs" / cluster_id
    run_dir.mkdir(parents=True, exist_ok=True)
    profile_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(cleanup.home(), 0o700)
    if timeout is None:
        timeout = kwargs.pop("start_timeout", 60 + 5 * n)
    else:
        kwargs.pop("start_timeout", None)
    _heartbeats(config, kwargs)
    network = _on_nodes(n, config, kwargs, layout, run_dir) if layout else None
    if network is None and launcher == "local" and "torch" in frameworks:
        _fork_engines(config, run_dir)
    try:
        ipp_cluster = ipp.Cluster(n=n, cluster_id=cluster_id, profile_dir=str(profile_dir), config=config,
                                  log_level=40, engine_timeout=max(60, timeout), shutdown_atexit=True, **kwargs)
    except BaseException:
        if network is not None:
            emulated.remove(network.to_dict())
        raise

    state_file = run_dir / "reaper.json"
    cluster = Cluster(n, launcher, frameworks, cell_timeout, env, ipp_cluster, None, run_dir, state_file, None,
                      network=network)
    try:
        bar = _progress(n + 1, quiet)
        ipp_cluster.start_controller_sync()
        launchers.secure_profile(profile_dir)  # the connection files are keys to run code as you
        cleanup.record(cluster)
        cluster.reaper = cleanup.start_reaper(state_file)
        if network is not None and network.userns:
            _link_engine_sockets(ipp_cluster, timeout)
        _start_engines(ipp_cluster, n, kwargs.get("controller_ip"))
        cleanup.record(cluster)
        cluster.client = ipp_cluster.connect_client_sync()
        _wait_for_engines(cluster, n, timeout, bar)
        cleanup.record(cluster)
        _setup_ranks(cluster, timeout)
        cleanup.record(cluster)
        bar.update(1)
        bar.close()
    except BaseException:
        cleanup.force_stop(cluster)
        raise
    return cluster


def _start_engines(ipp_cluster, n: int, address: str | None) -> None:
    """ipyparallel's start_engines, with a controller that died as it started said plainly: it
    waits for the controller's connection files and raises a RuntimeError of its internals."""
    try:
        ipp_cluster.start_engines_sync(n)
    except RuntimeError as exc:
        if "Controller stopped" not in str(exc):
            raise
        try:
            output = ipp_cluster.controller.get_output(remove=False)
        except Exception:  # its output is only the message's detail
            output = ""
        raise HpdlError(
            f"The ranks' controller (the hub they connect to{f', on {address}' if address else ''}) stopped as it "
            f"started, so no rank could start. It said:\n{_tail(output, 1)}\nOn a cluster, an address this "
            "machine does not have is the usual cause: see the site profile's controller_host."
        ) from None


def _progress(total: int, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="starting ranks", leave=False, disable=quiet or None)


def _wait_for_engines(cluster: Cluster, n: int, timeout: float, bar) -> None:
    deadline = time.monotonic() + timeout
    seen = 0
    while True:
        ids = cluster.client.ids
        if len(ids) > seen:
            bar.update(len(ids) - seen)
            seen = len(ids)
        if len(ids) >= n:
            return
        for es in cluster.ipp.engines.values():
            if getattr(es, "state", "running") == "after":
                raise HpdlError(
                    f"The MPI job that starts the engines ended before all {n} ranks registered "
                    f"({seen} did).\nIts output:\n{_tail(cluster.launcher_output())}\n"
                    "Run `hpdl doctor` to check the MPI installation."
                )
        if time.monotonic() > deadline:
            raise HpdlError(
                f"Only {seen} of {n} ranks registered within {timeout:.0f} s. "
                + _launcher_traits(cluster.launcher)[2]
                + f"try hpdl.start(n={n}, timeout=...) with more time, or fewer ranks.\n"
                + _tail(cluster.launcher_output())
            )
        time.sleep(0.1)


def _tail(text: str, lines: int = 15) -> str:
    return "\n".join(("    " + s) for s in text.strip().splitlines()[-lines:]) if text.strip() else "    (no output)"


_SETUP = """
import hpdl.rank as _hpdl_rank
_hpdl_info = _hpdl_rank.setup(globals(), run_dir={run_dir!r}, frameworks={frameworks!r})
"""


def _setup_ranks(cluster: Cluster, timeout: float) -> None:
    """Run rank.setup() on every engine; map engine ids to ranks and check they agree."""
    view = cluster.client[:]
    code = _SETUP.format(run_dir=str(cluster.run_dir), frameworks=cluster.frameworks)
    ar = view.execute(code, block=False)
    try:
        ar.get(timeout=timeout)
    except Exception as exc:  # ipyparallel wraps remote errors; show the first one plainly
        raise HpdlError(f"Setting up the ranks failed: {_first_remote_error(exc)}") from None
    infos = view.pull("_hpdl_info", block=False).get(timeout=30)
    for engine_id, info in zip(view.targets if isinstance(view.targets, list) else cluster.client.ids, infos):
        info["engine_id"] = engine_id
    infos.sort(key=lambda i: i["rank"])
    ranks = [i["rank"] for i in infos]
    if ranks != list(range(cluster.n)) or any(i["world_size"] != cluster.n for i in infos):
        raise HpdlError(
            f"The engines are not one MPI job of {cluster.n} ranks (they report ranks {ranks}, sizes "
            f"{sorted({i['world_size'] for i in infos})}). Usually mpi4py and mpiexec come from different "
            "MPI libraries: run `hpdl doctor`."
        )
    for i in infos:
        if i.get("horovod_error"):
            raise HpdlError(i["horovod_error"])
    cluster.ranks = infos
    if cluster.local:  # recorded now, so a reused pid is never taken for a rank
        cluster.rank_procs = {i["rank"]: p for i in infos if (p := procs.record(i["pid"])) is not None}


def _first_remote_error(exc: Exception) -> str:
    for item in getattr(exc, "elist", None) or []:
        name, value = item[0], item[1]
        return f"{name}: {value}"
    return f"{type(exc).__name__}: {exc}"


def _summary(c: Cluster) -> str:
    # the ranks report their MPI: importing mpi4py.MPI here would start MPI in the kernel too
    mpi = c.ranks[0].get("mpi", "MPI") if c.ranks else "MPI"
    lines = [
        f"hpdl: {c.n} rank{'s' if c.n > 1 else ''} ready in {c.start_seconds:.1f} s "
        f"({_launcher_traits(c.launcher)[1]}, {mpi}); "
        "%%px runs a cell on every rank."
    ]
    hosts = sorted({r["host"] for r in c.ranks})
    devices = sorted({r["device"] for r in c.ranks})
    threads = sorted({r["threads"] for r in c.ranks if r.get("threads")})
    extra = []
    if c.ranks and c.ranks[0].get("backend"):
        extra.append(f"torch.distributed: {c.ranks[0]['backend']}")
    if c.ranks and "hvd_size" in c.ranks[0]:
        ctl = "MPI" if c.ranks[0].get("mpi_built") else "Gloo"
        extra.append(f"Horovod: {ctl}{' + NCCL' if c.ranks[0].get('nccl_built') else ''}")
    lines.append(
        f"  hosts: {', '.join(hosts)} · devices: {', '.join(devices)}"
        + (f" · torch threads per rank: {', '.join(map(str, threads))}" if threads else "")
        + ("" if not extra else " · " + " · ".join(extra))
    )
    libs = sorted({mpilib.describe(r["mpi_library"]) for r in c.ranks if r.get("mpi_library")})
    if len(libs) > 1 or any(r.get("mpi_library", {}).get("cuda_aware") for r in c.ranks) or \
            any(r["device"].startswith("cuda") for r in c.ranks):
        lines += [f"  MPI library: {lib}" for lib in libs]  # on GPUs, or when ranks disagree, show which
    if c.network is not None:
        per_node = "/".join(map(str, sorted(set(c.network.ranks_per_node))))
        lines.append(f"  emulated nodes: {c.network.nodes} × {per_node} ranks, joined by {c.network.link} links "
                     "(shared memory within a node, TCP between" + ("; in a user namespace of yours)"
                                                                     if c.network.userns else ")"))
    lines += [f"  note: {n}" for n in sorted({r["device_note"] for r in c.ranks if r.get("device_note")})]
    return "\n".join(lines)


def _activate(cluster: Cluster) -> None:
    """In IPython: show HpdlError as a message, and point %px/%%px at these ranks."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    from hpdl.cluster import px
    from hpdl.errors import install_handler

    install_handler(ip)
    px.register_px(ip, cluster, current)


# -- stopping -------------------------------------------------------------------------------

def stop(quiet: bool = False) -> None:
    """End the ranks, the controller and the watchman; safe to call when nothing runs."""
    global _current
    cluster, _current = _current, None
    if cluster is None:
        _say("hpdl: no ranks were running.", quiet)
        return
    t0 = time.perf_counter()
    if cluster.client is not None and cluster.problem() is None:
        try:  # Horovod's background thread would otherwise keep engines alive; then SIGTERM ends them at once
            cluster.client[:].execute("_hpdl_rank.teardown(); _hpdl_rank.exit_on_term()", block=False).get(timeout=10)
            _leave_together(cluster)
        except Exception as exc:
            log.warning("the ranks' teardown did not finish (%s); ending them anyway", exc)
    cluster.stopped = True
    cleanup.force_stop(cluster)
    _say(f"hpdl: stopped {cluster.n} ranks in {time.perf_counter() - t0:.1f} s.", quiet)


def nodes_missing() -> str | None:
    """Why `start(nodes=...)` cannot run here, worded as what to do (no root, no iproute2, an MPI
    whose launcher the kit does not start on emulated nodes); None when it can. A lesson asks
    first and runs its cells on one node instead, saying why, rather than stopping at an error."""
    from hpdl.launchers.mpiexec import find_mpiexec

    why = emulated.missing()
    if why is None:
        try:
            emulated.require_launcher(find_mpiexec())
        except HpdlError as exc:
            why = str(exc)
    return why


def _leave_together(cluster: Cluster, timeout: float = 10.0) -> None:
    """Every rank finalizes MPI and exits, all at once, before anything is signalled: MPI_Finalize
    removes the ranks' shared memory, which a signalled rank may not live to do (rank.leave).
    The request never answers; the hub fails it for each engine as that engine goes."""
    ar = cluster.client[:].execute("_hpdl_rank.leave()", block=False)
    if not ar.wait(timeout):
        log.warning("ranks still running %.0f s after they were asked to leave; ending them", timeout)


def restart(**kwargs) -> Cluster:
    """Fresh ranks with the same settings (or new ones given as keyword arguments)."""
    old = _current
    settings = {}
    if old is not None:
        settings = dict(n=old.n, launcher=old.launcher, frameworks=old.frameworks,
                        cell_timeout=old.cell_timeout, env=old.env)
        if old.network is not None:
            settings.update(nodes=old.network.nodes, link=old.network.link)
    settings.update(kwargs)
    stop(quiet=True)
    return start(**settings)


def status() -> dict:
    """What is running: ranks, hosts, devices, health."""
    if _current is None:
        return {"running": False}
    c = _current
    return {
        "running": True,
        "n": c.n,
        "launcher": c.launcher,
        "frameworks": list(c.frameworks),
        "env": dict(c.env),
        "nodes": None if c.network is None else {"nodes": c.network.nodes, "link": c.network.link,
                                                 "ranks_per_node": list(c.network.ranks_per_node)},
        "problem": c.problem(),
        "ranks": [{k: r.get(k) for k in ("rank", "host", "pid", "device", "threads")} for r in c.ranks],
        "start_seconds": round(c.start_seconds, 2),
    }


def view():
    """The ipyparallel DirectView on every rank (view.apply, view.execute, view.pull ...), whose blocking
    calls wait at most the cell time limit, then name the ranks that did not answer (cluster/rankview.py)."""
    return current().view
