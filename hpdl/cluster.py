"""Client side: start, watch and stop the engines that are the learner's MPI ranks.

`start(n)` launches an ipyparallel controller and `n` engines as ranks of one MPI job
(`mpiexec` here, `srun` on Slurm; see launchers.py), waits until every rank is set up
(rank.py runs on each), and activates `%%px`. A `%%px` cell then runs with a time limit:
if ranks do not finish, the kit asks each one where it is (watchdog.py) and names the stuck
ranks and their lines; if a rank dies, it says which. `stop()` ends everything it started,
and a watchman process (reaper.py) does the same if the kernel itself is killed.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hpdl import launchers, mpilib
from hpdl.errors import ClusterNotRunning, HpdlError, RankDied, RankHang

DEFAULT_CELL_TIMEOUT = float(os.environ.get("HPDL_CELL_TIMEOUT", "300"))
DEFAULT_FRAMEWORKS = ("torch", "horovod")
KNOWN_FRAMEWORKS = {"torch", "horovod"}


def home() -> Path:
    """Where the kit keeps its IPython profile and run files ($HPDL_HOME, else ~/.hpdl)."""
    return Path(os.environ.get("HPDL_HOME", Path.home() / ".hpdl"))


@dataclass
class Cluster:
    """The running set of ranks: what was started, and how to reach and stop it."""

    n: int
    launcher: str
    frameworks: tuple[str, ...]
    cell_timeout: float
    env: dict
    ipp: Any  # ipyparallel.Cluster
    client: Any  # ipyparallel.Client
    run_dir: Path
    state_file: Path
    reaper: subprocess.Popen | None
    ranks: list[dict] = field(default_factory=list)
    started_at: float = field(default_factory=time.time)
    start_seconds: float = 0.0
    wedged: dict = field(default_factory=dict)  # msg_id -> rank, for cells that timed out

    def __repr__(self) -> str:
        health = self.problem() or "healthy"
        return f"<hpdl cluster: {self.n} ranks via {self.launcher}, {health}>"

    @property
    def view(self):
        return self.client[:]

    # -- health -----------------------------------------------------------------------
    def engine_pids(self) -> dict[int, int]:
        return {r["rank"]: r["pid"] for r in self.ranks}

    def dead_ranks(self) -> list[int]:
        """Ranks whose engine is gone (checked by pid here, by registration elsewhere)."""
        import psutil

        dead = []
        local = self.launcher == "local"
        registered = set(self.client.ids) if self.client is not None else set()
        for r in self.ranks:
            if local:
                try:
                    gone = psutil.Process(r["pid"]).status() == psutil.STATUS_ZOMBIE
                except psutil.Error:
                    gone = True
            else:
                gone = r["engine_id"] not in registered
            if gone:
                dead.append(r["rank"])
        return dead

    def problem(self) -> str | None:
        """Why this cluster cannot take more work, or None when it is healthy."""
        dead = self.dead_ranks()
        if dead:
            return f"rank{'s' if len(dead) > 1 else ''} {_ranks_text(dead)} no longer running"
        if self.wedged and set(self.wedged) & set(self.client.outstanding):
            return f"rank{'s' if len(set(self.wedged.values())) > 1 else ''} {_ranks_text(sorted(set(self.wedged.values())))} still stuck in a cell that timed out"
        return None

    def launcher_output(self) -> str:
        out = []
        for es in getattr(self.ipp, "engines", {}).values():
            try:
                out.append(es.get_output(remove=False))
            except Exception:
                pass
        return "\n".join(out)


_current: Cluster | None = None


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}–{ranks[-1]}"
    return ", ".join(str(r) for r in ranks)


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
    cell_timeout: float = DEFAULT_CELL_TIMEOUT,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
    quiet: bool = False,
) -> Cluster:
    """Start `n` engines as MPI ranks and make `%%px` run cells on all of them.

    Called again with the same settings while the ranks are healthy, it reuses them (your
    variables on the engines survive); if a rank died or is stuck, or settings differ, it
    stops the old ranks and starts fresh ones.

    `env` sets environment variables on every rank before MPI, torch.distributed and Horovod
    start — the way to try knobs such as HOROVOD_FUSION_THRESHOLD, NCCL_ALGO or MV2_USE_CUDA.
    """
    global _current
    launcher = launchers.resolve(launcher)
    if n is None:
        n = launchers.default_n(launcher)
    n, frameworks, cell_timeout = _check_args(n, frameworks, cell_timeout)
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) for k in env)):
        raise HpdlError(f"env is a dict of environment variables, e.g. {{'HOROVOD_CYCLE_TIME': '5'}}; got {env!r}.")
    env = {k: str(v) for k, v in (env or {}).items()}

    if _current is not None:
        old = _current
        why = old.problem()
        same = (old.n, old.launcher, old.env) == (n, launcher, env) and set(frameworks) <= set(old.frameworks)
        if why is None and same:
            old.cell_timeout = cell_timeout
            _activate(old)
            _say(f"hpdl: reusing the {n} running ranks (started {time.time() - old.started_at:.0f} s ago).", quiet)
            return old
        _say(f"hpdl: {'restarting: ' + why if why else 'stopping the old ranks for the new settings'}.", quiet)
        stop(quiet=True)

    t0 = time.perf_counter()
    cluster = _launch(n, launcher, frameworks, cell_timeout, timeout, env, quiet)
    cluster.start_seconds = time.perf_counter() - t0
    _current = cluster
    _activate(cluster)
    _say(_summary(cluster), quiet)
    return cluster


def _launch(n, launcher, frameworks, cell_timeout, timeout, env, quiet) -> Cluster:
    import ipyparallel as ipp
    from traitlets.config import Config

    os.environ.setdefault("IPP_NONINTERACTIVE", "1")
    config = Config()
    kwargs = launchers.configure(launcher, config, n)
    config.EngineLauncher.environment = {**launchers.engine_env(), **env}
    cluster_id = f"hpdl-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    profile_dir = home() / "profile"
    run_dir = home() / "runs" / cluster_id
    run_dir.mkdir(parents=True, exist_ok=True)
    profile_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(home(), 0o700)
    if timeout is None:
        timeout = kwargs.pop("start_timeout", 60 + 5 * n)
    else:
        kwargs.pop("start_timeout", None)
    ipp_cluster = ipp.Cluster(
        n=n,
        cluster_id=cluster_id,
        profile_dir=str(profile_dir),
        config=config,
        log_level=40,
        engine_timeout=max(60, timeout),
        shutdown_atexit=True,
        **kwargs,
    )

    state_file = run_dir / "reaper.json"
    cluster = Cluster(n, launcher, frameworks, cell_timeout, env, ipp_cluster, None, run_dir, state_file, None)
    try:
        bar = _progress(n + 1, quiet)
        ipp_cluster.start_controller_sync()
        launchers.secure_profile(profile_dir)  # the connection files are keys to run code as you
        _record(cluster)
        cluster.reaper = subprocess.Popen(
            [sys.executable, "-m", "hpdl.reaper", str(state_file)],
            start_new_session=True,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        ipp_cluster.start_engines_sync(n)
        _record(cluster)
        client = ipp_cluster.connect_client_sync()
        cluster.client = client
        _wait_for_engines(cluster, n, timeout, bar)
        _record(cluster)
        _setup_ranks(cluster, timeout)
        _record(cluster)
        bar.update(1)
        bar.close()
    except BaseException:
        _force_stop(cluster)
        raise
    return cluster


def _progress(total: int, quiet: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="starting ranks", leave=False, disable=quiet or None)


def _record(cluster: Cluster) -> None:
    """Tell the reaper what to kill should the kernel die: process trees and Slurm jobs."""
    from hpdl.reaper import shared_memory_of

    pids, jobs = [], []
    ctl = getattr(cluster.ipp, "controller", None)
    if ctl is not None and getattr(ctl, "pid", None):
        pids.append(ctl.pid)
    for es in getattr(cluster.ipp, "engines", {}).values():
        if getattr(es, "pid", None):
            pids.append(es.pid)
        job = getattr(es, "job_id", None)
        if job:
            jobs.append(job)
    ranks = [r["pid"] for r in cluster.ranks if cluster.launcher == "local"]
    pids += ranks
    # MPI's shared-memory segments between ranks: a killed job leaves them in RAM (/dev/shm),
    # and once its ranks are gone nothing maps them any more, so remember them now.
    shm = sorted(shared_memory_of(ranks))
    state = {"watch_pid": os.getpid(), "pids": pids, "pgids": pids[:2], "slurm_jobs": jobs, "shm": shm}
    tmp = cluster.state_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, cluster.state_file)


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
                + ("On Slurm the job may still be queued (see `squeue --me`); " if cluster.launcher == "slurm" else "")
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


def _first_remote_error(exc: Exception) -> str:
    for attr in ("elist",):
        for item in getattr(exc, attr, []) or []:
            name, value = item[0], item[1]
            return f"{name}: {value}"
    return f"{type(exc).__name__}: {exc}"


def _summary(c: Cluster) -> str:
    # the ranks report their MPI: importing mpi4py.MPI here would start MPI in the kernel too
    mpi = c.ranks[0].get("mpi", "MPI") if c.ranks else "MPI"
    lines = [
        f"hpdl: {c.n} rank{'s' if c.n > 1 else ''} ready in {c.start_seconds:.1f} s "
        f"({'mpiexec' if c.launcher == 'local' else 'Slurm'}, {mpi}); "
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
    lines += [f"  note: {n}" for n in sorted({r["device_note"] for r in c.ranks if r.get("device_note")})]
    return "\n".join(lines)


def _activate(cluster: Cluster) -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    from hpdl.errors import install_handler
    from hpdl.magics import register_px

    install_handler(ip)
    register_px(ip, cluster)


# -- running cells with a time limit ----------------------------------------------------

def current() -> Cluster:
    if _current is None:
        raise ClusterNotRunning("No ranks are running. Start them with hpdl.start(n=2) (or %hpdl start -n 2).")
    return _current


def wait(ar, timeout: float, cluster: Cluster | None = None, code: str | None = None) -> None:
    """Wait for an AsyncResult on the ranks, raising RankHang or RankDied with details.

    Polls rather than blocking so that a dead rank is noticed within a fraction of a second.
    """
    cluster = cluster or current()
    deadline = time.monotonic() + timeout
    while not ar.ready():
        ar.wait(0.1)
        if ar.ready():
            break
        dead = cluster.dead_ranks()
        if dead:
            time.sleep(0.5)  # let the MPI launcher finish its report
            raise RankDied(_death_report(cluster, dead))
        if time.monotonic() > deadline:
            raise RankHang(_hang_report(cluster, ar, timeout, code))
    dead = cluster.dead_ranks()
    if dead:
        raise RankDied(_death_report(cluster, dead))


def _engine_to_rank(cluster: Cluster) -> dict[int, int]:
    return {r["engine_id"]: r["rank"] for r in cluster.ranks}


def _pending_ranks(cluster: Cluster, ar) -> tuple[list[int], list[int]]:
    e2r = _engine_to_rank(cluster)
    targets = ar._targets if isinstance(getattr(ar, "_targets", None), list) else cluster.client.ids
    outstanding = cluster.client.outstanding
    done, stuck = [], []
    for msg_id, engine in zip(ar.msg_ids, targets):
        (stuck if msg_id in outstanding else done).append(e2r.get(engine, engine))
    return sorted(done), sorted(stuck)


def ask_where(cluster: Cluster, ranks: list[int], wait_s: float = 2.5) -> dict[int, dict]:
    """Ask ranks where they are (watchdog.py answers from a side thread), waiting briefly."""
    token = uuid.uuid4().hex
    (cluster.run_dir / "dump-request").write_text(token)
    found: dict[int, dict] = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and len(found) < len(ranks):
        for r in ranks:
            if r in found:
                continue
            try:
                data = json.loads((cluster.run_dir / "stacks" / f"rank{r}.json").read_text())
            except (OSError, ValueError):
                continue
            if data.get("token") == token:
                found[r] = data
        time.sleep(0.1)
    return found


def _where_text(w: dict | None, code: str | None) -> str:
    if not w or not w.get("where"):
        return "(did not answer; it may be holding the Python lock inside a C call)"
    f = w["where"]
    place = "the cell" if f["func"] == "<module>" else f"{f['func']}()"
    text = f.get("code") or ""
    if not text and code and f["func"] == "<module>":
        lines = code.splitlines()
        if 0 < f["line"] <= len(lines):
            text = lines[f["line"] - 1].strip()
    return f"line {f['line']} of {place}: {text}" if text else f"line {f['line']} of {place}"


def _hang_report(cluster: Cluster, ar, timeout: float, code: str | None, headline: str | None = None) -> str:
    done, stuck = _pending_ranks(cluster, ar)
    where = ask_where(cluster, stuck)
    for msg_id, engine in zip(ar.msg_ids, getattr(ar, "_targets", []) or []):
        if msg_id in cluster.client.outstanding:
            cluster.wedged[msg_id] = _engine_to_rank(cluster).get(engine, engine)
    lines = [headline or f"the cell did not finish on every rank within {timeout:g} s."]
    if done:
        lines.append(f"  finished: rank{'s' if len(done) > 1 else ''} {_ranks_text(done)}")
    for r in stuck:
        lines.append(f"  stuck:    rank {r} at {_where_text(where.get(r), code)}")
    errors = _errors_by_rank(cluster, ar)
    for r, e in errors.items():
        lines.append(f"  error:    rank {r} raised {e}")
    lines.append(
        "A rank waiting in an MPI call waits for a partner that never comes (a send with no "
        "receive, or a collective some ranks skipped)."
    )
    lines.append(
        "Stuck ranks cannot be interrupted: run hpdl.restart() for fresh ranks (variables on the "
        "engines are lost), then re-run your set-up cells. To allow more time: %%px --timeout 600."
    )
    return "\n".join(lines)


def _errors_by_rank(cluster: Cluster, ar) -> dict[int, str]:
    e2r = _engine_to_rank(cluster)
    out = {}
    for msg_id, engine in zip(ar.msg_ids, getattr(ar, "_targets", []) or []):
        if msg_id in cluster.client.outstanding:
            continue
        res = cluster.client.results.get(msg_id)
        if isinstance(res, BaseException):
            ename = getattr(res, "ename", type(res).__name__)
            evalue = getattr(res, "evalue", str(res))
            out[e2r.get(engine, engine)] = f"{ename}: {evalue}"
    return out


_NANNY_RE = re.compile(r"KernelNanny\.(\d+)\] Pipe closed")
_EXIT_RE = re.compile(r"EXIT STRING: ([^\n]+)|EXIT CODE: (\d+)")


def _death_report(cluster: Cluster, dead: list[int]) -> str:
    """Name the rank that died first; each engine's nanny logs the moment its rank goes."""
    time.sleep(0.3)  # let the nannies and the MPI launcher write their reports
    out = cluster.launcher_output()
    e2r = _engine_to_rank(cluster)
    order = [e2r.get(int(m.group(1)), int(m.group(1))) for m in _NANNY_RE.finditer(out)]
    first = order[0] if order else dead[0]
    m = _EXIT_RE.search(out)
    how = ""
    if m:
        how = f", {m.group(1).strip()}" if m.group(1) else f", exit code {m.group(2)}"
    pid = cluster.engine_pids().get(first, "?")
    lines = [f"rank {first} (pid {pid}{how}) died while this cell was running."]
    others = [r["rank"] for r in cluster.ranks if r["rank"] != first]
    if others:
        lines.append(
            f"Ranks {_ranks_text(others)} belong to the same MPI job, which ends when one of its ranks dies."
            if len(others) > 1 else
            f"Rank {others[0]} belongs to the same MPI job, which ends when one of its ranks dies."
        )
    lines.append("Run hpdl.start() for fresh ranks, then re-run your set-up cells.")
    return "\n".join(lines)


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
        try:  # Horovod's background thread would otherwise keep engines alive
            cluster.client[:].execute("_hpdl_rank.teardown()", block=False).get(timeout=10)
        except Exception:
            pass
    _force_stop(cluster)
    _say(f"hpdl: stopped {cluster.n} ranks in {time.perf_counter() - t0:.1f} s.", quiet)


def _force_stop(cluster: Cluster) -> None:
    from hpdl.reaper import kill_all

    try:
        state = json.loads(cluster.state_file.read_text())
    except (OSError, ValueError):
        state = {"pids": [], "pgids": [], "slurm_jobs": []}
    if cluster.client is not None:
        try:
            cluster.client.close()
        except Exception:
            pass
    try:
        for es in list(cluster.ipp.engines.values()):
            try:
                es.signal(15) if hasattr(es, "signal") else None
            except Exception:
                pass
    except Exception:
        pass
    kill_all(state, grace=3.0)
    try:
        cluster.ipp.stop_cluster_sync()
    except Exception:
        pass
    try:
        cluster.state_file.unlink()
    except OSError:
        pass
    if cluster.reaper is not None:
        try:
            cluster.reaper.wait(timeout=3)
        except subprocess.TimeoutExpired:
            cluster.reaper.kill()
            cluster.reaper.wait()
    _remove_tree(cluster.run_dir)
    for f in (home() / "profile" / "log").glob(f"*{cluster.ipp.cluster_id}*"):
        f.unlink(missing_ok=True)


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def restart(**kwargs) -> Cluster:
    """Fresh ranks with the same settings (or new ones given as keyword arguments)."""
    old = _current
    settings = dict(n=old.n, launcher=old.launcher, frameworks=old.frameworks, cell_timeout=old.cell_timeout, env=old.env) if old else {}
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
        "problem": c.problem(),
        "ranks": [{k: r.get(k) for k in ("rank", "host", "pid", "device", "threads")} for r in c.ranks],
        "start_seconds": round(c.start_seconds, 2),
    }


def view():
    """The ipyparallel DirectView on every rank (view.apply, view.execute, view.pull ...)."""
    return current().view


# -- `hpdl cleanup` -------------------------------------------------------------------------

def main(argv: list[str]) -> int:
    """Kill clusters whose kernel is gone (the reaper normally does this by itself)."""
    from hpdl.reaper import _alive, kill_all

    runs = home() / "runs"
    n = 0
    for state_file in sorted(runs.glob("*/reaper.json")):
        try:
            state = json.loads(state_file.read_text())
        except (OSError, ValueError):
            continue
        if "--all" in argv or not _alive(int(state["watch_pid"])):
            kill_all(state)
            _remove_tree(state_file.parent)
            n += 1
    print(f"hpdl cleanup: ended {n} cluster{'s' if n != 1 else ''}.")
    return 0
