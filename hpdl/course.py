"""`hpdl course end`: after the course, cancel its jobs, stop the hub, archive then remove what learners left.

    hpdl course end --site S [--date YYYY-MM-DD] [--users NAME ... | --group G | --homes GLOB | --workspaces GLOB]
                    [--archive DIR] [--yes]

A dry run by default: it lists every action and changes nothing; --yes carries them out. Before
--date it says what it will do on that date and does nothing, --yes or not, so one cron line
written on the last day of the course does it when the date comes (and nothing again after):

    0 6 * * *  /shared/hpdl/.venv/bin/hpdl course end --site mysite --group hpdl-learners --date 2026-12-20 --yes

In order: (1) stop the hub (`find_hub`), which cancels its learners' jobs; (2) cancel the course's
Slurm jobs: the kit's job names (COURSE_JOB) in the profile's partition, account, QoS and
reservation where it names them, of the learners where they are accounts (--users, --group);
(3) for each learner, their workspace (`workspace_folders`) and the kit's per-user state
(`per_user_state`: ~/.hpdl, the hub's job logs) go into ARCHIVE/<learner>.tar.gz (0600, in a
0700 folder, owned by the instructor: with sudo, the one who ran sudo), which is read back and
compared file by file; then exactly the files it holds, unchanged since, are removed. Anything
else (a file written since, a socket) is left and named: nothing is deleted that is not archived.
(4) The hub's state ($HPDL_HUB_STATE: its database and cookie secret) is archived and removed alike.
"""
from __future__ import annotations

import argparse
import glob
import grp
import hashlib
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import tarfile
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Callable

from hpdl import settings
from hpdl.errors import HpdlError
from hpdl.sites import SlurmSite, load_site

KIT = Path(__file__).resolve().parents[1]
# The kit's Slurm job names: jupyter.sbatch, the hub's singleuser.sbatch, run.sbatch, preflight,
# rehearse, the engines' job of a login-node kernel (lifecycle's cluster id), Open OnDemand's app.
COURSE_JOB = re.compile(r"hpdl-(jupyter|hub|run|preflight|rehearse-\d+|\d+-[0-9a-f]{6})|.*/hpdl-jupyter")
HUB_UNIT = "hpdl-hub"  # the systemd unit, where the site runs the hub as one
HUB_CONFIG = KIT / "cluster" / "jupyterhub" / "jupyterhub_config.py"
LIVE_STATES = ("PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING")


# -- where a learner's things are ---------------------------------------------------------------------

def workspace_folders(home: Path) -> list[Path]:
    """A learner's workspace in their home: the hub's ~/hpdl (their copy of the lessons and the
    exercises' workspace/, cluster/jupyterhub/singleuser.sbatch) and ~/hpdl-workspace, the other
    place it may be. The one place to change when the workspace moves."""
    return [home / "hpdl", home / "hpdl-workspace"]


def per_user_state(home: Path) -> list[Path]:
    """The kit's state in a learner's home: HPDL_HOME's default (IPython profile, run folders,
    JupyterLab connection files) and the hub's job logs."""
    return [home / ".hpdl", *sorted(home.glob("hpdl-hub-*.log"))]


@dataclass
class Learner:
    """One learner's things to archive, named as they will be in the archive (relative to `base`)."""

    name: str
    base: Path
    paths: list[Path]
    kind: str = "learner"  # or "hub": the hub's state


def _account_homes(users: list[str], group: str | None) -> list[tuple[str, Path]]:
    names = list(users)
    if group:
        try:
            g = grp.getgrnam(group)
        except KeyError:
            raise HpdlError(f"--group {group}: no such group here.") from None
        names += list(g.gr_mem) + [p.pw_name for p in pwd.getpwall() if p.pw_gid == g.gr_gid]
    homes = []
    for name in dict.fromkeys(names):
        try:
            homes.append((name, Path(pwd.getpwnam(name).pw_dir)))
        except KeyError:
            raise HpdlError(f"--users {name}: no such account here (`getent passwd {name}` says nothing).") from None
    return homes


def learners_of(users: list[str] = (), group: str | None = None, homes: str | None = None,
                workspaces: str | None = None) -> list[Learner]:
    """The learners named by account (--users, --group), by home folders (--homes GLOB) or by
    workspace folders (--workspaces GLOB: the workspace alone, no per-user state)."""
    found = _account_homes(list(users), group)
    found += [(Path(p).name, Path(p)) for p in sorted(glob.glob(homes))] if homes else []
    out = []
    for name, home in found:
        paths = [p for p in workspace_folders(home) + per_user_state(home) if os.path.lexists(p)]
        out.append(Learner(name, home, paths))
    for p in sorted(glob.glob(workspaces)) if workspaces else []:
        path = Path(p).absolute()
        out.append(Learner("-".join(path.parts[1:]) or "root", path.parent, [path]))
    hub_state = settings.HUB_STATE.get()
    if os.path.lexists(hub_state):
        out.append(Learner("hub-state", hub_state.parent, [hub_state], kind="hub"))
    return out


# -- the hub --------------------------------------------------------------------------------------------

@dataclass
class Hub:
    """A running hub: how it was found, and how to stop it."""

    what: str
    stop: Callable[[], str]


def _is_hub(cmdline: list[str], cwd: str, ours_only: bool) -> bool:
    """A `jupyterhub` process (running this kit's config, with ours_only)."""
    if not any(os.path.basename(a) == "jupyterhub" for a in cmdline[:3]):
        return False
    return not ours_only or any(a.endswith("jupyterhub_config.py") and (Path(cwd) / a).resolve() == HUB_CONFIG
                                for a in cmdline)


def _stop_process(pid: int) -> str:
    from hpdl import procs

    rec = procs.record(pid)
    if rec is None or not procs.signal_process(rec, signal.SIGTERM):
        return f"pid {pid} had already ended"
    deadline = time.monotonic() + 60  # JupyterHub stops its servers (their jobs) before it exits
    while procs.is_alive(rec) and time.monotonic() < deadline:
        time.sleep(0.5)
    if procs.is_alive(rec):
        procs.signal_process(rec, signal.SIGKILL)
        return f"pid {pid} did not end within 60 s of SIGTERM: killed"
    return f"pid {pid} ended"


def find_hub() -> Hub | None:
    """How the hub runs here, and how to stop it; None when it does not run. The one place to
    change when the hub's deployment changes: a systemd unit called HUB_UNIT, else the stop command
    cluster/jupyterhub/install.sh installs (which also cancels the learners' jobs), else the pid in
    $HPDL_HUB_STATE/jupyterhub.pid, else a `jupyterhub` process running this kit's config."""
    import psutil

    if shutil.which("systemctl"):
        p = subprocess.run(["systemctl", "is-active", "--quiet", HUB_UNIT], capture_output=True, timeout=30)
        if p.returncode == 0:
            return Hub(f"systemctl stop {HUB_UNIT}", lambda: _run(["systemctl", "stop", HUB_UNIT]))
    pid_file = settings.HUB_STATE.get() / "jupyterhub.pid"
    stop = settings.HUB_PREFIX.get() / "bin" / "hpdl-hub-stop"
    if pid_file.is_file() and os.access(stop, os.X_OK):
        return Hub(str(stop), lambda: _run([str(stop)]))
    pids = [int(pid_file.read_text().strip())] if pid_file.is_file() and pid_file.read_text().strip().isdigit() else []
    for pid in pids + [p.pid for p in psutil.process_iter()]:
        try:
            cmdline, cwd = psutil.Process(pid).cmdline(), psutil.Process(pid).cwd()
        except psutil.Error:
            continue
        if _is_hub(cmdline, cwd, ours_only=pid not in pids):
            return Hub(f"SIGTERM to the hub, pid {pid}: {' '.join(cmdline)[:120]}", lambda: _stop_process(pid))
    return None


def _run(cmd: list[str]) -> str:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return "done" if p.returncode == 0 else f"failed: {(p.stderr or p.stdout).strip()}"


# -- the course's Slurm jobs ----------------------------------------------------------------------------

def _reservation(site: SlurmSite) -> str:
    for opt in site.sbatch:
        if opt.startswith("--reservation="):
            return opt.split("=", 1)[1]
    return str(getattr(site, "reservation", "") or "")


def course_jobs(site: SlurmSite, users: list[str] = ()) -> list[dict]:
    """Jobs Slurm lists under one of the kit's names, in the profile's partition, account, QoS and
    reservation where it names them, of `users` when given."""
    if not shutil.which("squeue"):
        return []
    cmd = ["squeue", "-h", "-o", "%i|%j|%u|%P|%a|%q|%v|%T"] + (["-u", ",".join(users)] if users else [])
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    if p.returncode:
        raise HpdlError(f"squeue failed: {(p.stderr or p.stdout).strip()}; is Slurm reachable from here?")
    want = {"partition": site.partition, "account": site.account, "qos": site.qos, "reservation": _reservation(site)}
    jobs = []
    for line in p.stdout.splitlines():
        job = dict(zip(("id", "name", "user", "partition", "account", "qos", "reservation", "state"), line.split("|")))
        if len(job) == 8 and COURSE_JOB.fullmatch(job["name"]) and job["state"] in LIVE_STATES \
                and all(not v or job[k].lower() in v.lower().split(",") for k, v in want.items()):
            jobs.append(job)
    return jobs


def cancel_jobs(jobs: list[dict], wait: float = 60.0) -> list[str]:
    """scancel each job; wait until Slurm lists none of them. Returns the ids still listed."""
    from hpdl.launchers._slurm_queue import cancel_and_wait

    return cancel_and_wait([j["id"] for j in jobs], wait)


# -- archive, then remove what the archive holds ------------------------------------------------------

def _entries(learner: Learner) -> dict[str, tuple]:
    """Everything under the learner's paths, by archive name: (kind, size, mtime, link target).
    A socket, fifo or device is "special": never archived, so never removed."""
    found = {}
    for top in learner.paths:
        walk = [(str(top), [], [])] if not top.is_dir() or top.is_symlink() else os.walk(top)
        for folder, dirs, files in walk:
            for path in [Path(folder)] + [Path(folder) / n for n in dirs + files]:
                st = path.lstat()
                kind = "dir" if stat.S_ISDIR(st.st_mode) else "file" if stat.S_ISREG(st.st_mode) else \
                    "link" if stat.S_ISLNK(st.st_mode) else "special"
                found[str(path.relative_to(learner.base))] = (
                    kind, st.st_size if kind == "file" else 0, int(st.st_mtime),
                    os.readlink(path) if kind == "link" else "")
    return found


def _digest(f) -> str:
    h = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        h.update(chunk)
    return h.hexdigest()


def _archived(path: Path, learner: Learner, want: dict[str, tuple]) -> dict[str, tuple]:
    """Read the archive back: what it holds that equals the files on disk (kind, size, mtime, and
    the bytes of every file). Anything missing or different is left out."""
    held = {}
    with tarfile.open(path, "r:gz") as tar:
        for m in tar:
            kind = "dir" if m.isdir() else "file" if m.isfile() else "link" if m.issym() else None
            entry = (kind, m.size if kind == "file" else 0, int(m.mtime), m.linkname if kind == "link" else "")
            if want.get(m.name) != entry:
                continue
            if kind == "file":
                with tar.extractfile(m) as a, open(learner.base / m.name, "rb") as b:
                    if _digest(a) != _digest(b):
                        continue
            held[m.name] = entry
    return held


def _owner() -> tuple[int, int] | None:
    """With sudo, the instructor who ran it: the archive is theirs, not root's."""
    uid, gid = os.environ.get("SUDO_UID", ""), os.environ.get("SUDO_GID", "")
    return (int(uid), int(gid)) if os.geteuid() == 0 and uid.isdigit() and gid.isdigit() else None


def archive(learner: Learner, folder: Path) -> tuple[Path, dict[str, tuple]]:
    """ARCHIVE/<name>.tar.gz (a new name if taken), 0600; returns it and what it verifiably holds."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    os.chmod(folder, 0o700)
    n, dest = 1, folder / f"{learner.name}.tar.gz"
    while dest.exists():
        n += 1
        dest = folder / f"{learner.name}-{n}.tar.gz"
    want = _entries(learner)
    tmp = folder / f".{dest.name}.part"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f, tarfile.open(fileobj=f, mode="w:gz") as tar:
            for name in (n for n, e in want.items() if e[0] != "special"):  # parents first, links as links
                tar.add(learner.base / name, arcname=name, recursive=False)
        os.rename(tmp, dest)
    finally:
        if tmp.exists():
            tmp.unlink()
    owner = _owner()
    for path in (folder, dest) if owner else ():
        os.chown(path, *owner)
    return dest, _archived(dest, learner, want)


def remove_archived(learner: Learner, held: dict[str, tuple]) -> list[str]:
    """Remove what the archive holds and is still as archived, deepest first; the rest is named."""
    now = _entries(learner)
    left = [name + (" (a socket or fifo)" if now[name][0] == "special" else "") for name in now
            if held.get(name) != now[name] and now[name][0] != "dir"]
    for name in sorted(now, key=lambda n: n.count("/"), reverse=True):
        path = learner.base / name
        if held.get(name) != now[name]:
            continue
        try:
            path.rmdir() if now[name][0] == "dir" else path.unlink()
        except OSError as exc:  # a folder still holding what was left
            if now[name][0] != "dir":
                left.append(f"{name} ({exc.strerror})")
    return left


# -- the command ----------------------------------------------------------------------------------------

@dataclass
class Plan:
    site: SlurmSite
    when: date
    hub: Hub | None
    jobs: list[dict]
    learners: list[Learner]
    archive: Path
    lines: list[str] = field(default_factory=list)


def describe(plan: Plan) -> list[str]:
    """Every action, one line each, as the dry run lists it."""
    lines = [f"stop the hub: {plan.hub.what}" if plan.hub else "the hub: not running here (nothing to stop)"]
    lines += [f"cancel Slurm job {j['id']} {j['name']} (user {j['user']}, partition {j['partition']}, {j['state']})"
              for j in plan.jobs] or ["Slurm: no job of the course is listed"]
    for learner in plan.learners:
        if not learner.paths:
            lines.append(f"{learner.name}: nothing of the kit's in {learner.base}")
            continue
        lines.append(f"archive {learner.name}: {', '.join(str(p) for p in learner.paths)} → "
                     f"{plan.archive / (learner.name + '.tar.gz')}, then remove what it holds")
    return lines


def carry_out(plan: Plan, say=print) -> int:
    """Do the plan, saying what each step did; returns how many steps could not be done in full."""
    problems = 0
    if plan.hub:
        say(f"stop the hub: {plan.hub.what}: {plan.hub.stop()}")
    left = cancel_jobs(plan.jobs) if plan.jobs else []
    for job in plan.jobs:
        say(f"cancel Slurm job {job['id']} {job['name']}: " + ("still listed after 60 s" if job["id"] in left
                                                               else "gone"))
    problems += len(left)
    for learner in (x for x in plan.learners if x.paths):
        try:
            dest, held = archive(learner, plan.archive)
        except OSError as exc:
            say(f"{learner.name}: NOT removed: archiving failed ({exc}); run as root (sudo) to read every "
                "learner's files, or fix the archive folder")
            problems += 1
            continue
        kept = remove_archived(learner, held)
        say(f"{learner.name}: archived {len(held)} entries in {dest}; removed" + (
            f", except {len(kept)} not in the archive as they are now (left): {', '.join(kept[:5])}" if kept else ""))
        problems += bool(kept)
    return problems


def plan_of(args) -> Plan:
    """What `course end` would do, found now: the hub, the jobs, the learners' files."""
    site = load_site(args.site)
    try:
        when = date.fromisoformat(args.date) if args.date else date.today()
    except ValueError:
        raise HpdlError(f"--date {args.date!r}: write it as YYYY-MM-DD, e.g. 2026-12-20.") from None
    learners = learners_of(args.users or [], args.group, args.homes, args.workspaces)
    users = [name for name, _ in _account_homes(args.users or [], args.group)]
    if users:  # and the instructor's own: rehearsals, preflights
        users.append(pwd.getpwuid(os.getuid()).pw_name)
    home = Path(pwd.getpwuid(_owner()[0]).pw_dir) if _owner() else Path.home()  # the instructor's, under sudo
    archive_dir = (args.archive or home / "hpdl-course-archive" / when.isoformat()).absolute()
    return Plan(site, when, find_hub(), course_jobs(site, users), learners, archive_dir)


def end(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="hpdl course end", description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", help="site profile: a name in cluster/sites or a .toml path (default: $HPDL_SITE)")
    ap.add_argument("--date", help="do it on this day or later, YYYY-MM-DD (default: today)")
    ap.add_argument("--users", nargs="+", help="the learners' accounts")
    ap.add_argument("--group", help=f"the learners' Unix group (the hub's is {settings.HUB_GROUP.get()})")
    ap.add_argument("--homes", help="the learners' home folders, a glob: '/home/course*'")
    ap.add_argument("--workspaces", help="the learners' workspace folders, a glob (without per-user state)")
    ap.add_argument("--archive", type=Path, help="where the archives go (default ~/hpdl-course-archive/DATE)")
    ap.add_argument("--yes", action="store_true", help="do it (without: list what it would do, change nothing)")
    args = ap.parse_args(argv)
    plan = plan_of(args)
    lines = describe(plan)
    if not (args.users or args.group or args.homes or args.workspaces):
        lines.append("no learners named (--users, --group, --homes, --workspaces): no workspace is touched")
    elif not [x for x in plan.learners if x.kind == "learner"]:
        lines.append("the learners named have nothing here (no such homes, or an empty group)")
    today = date.today()
    if today < plan.when:
        print(f"hpdl course end: on {plan.when} or later (today is {today}) this will:")
        print("\n".join("  " + s for s in lines) + "\nNothing done before that date.")
        return 0
    if not args.yes:
        print(f"hpdl course end (site {plan.site.name}): this would:")
        print("\n".join("  " + s for s in lines) + "\nDry run: nothing was changed. Run again with --yes to do it.")
        return 0
    print(f"hpdl course end (site {plan.site.name}):")
    problems = carry_out(plan, say=lambda s: print("  " + s))
    print(f"{problems} step(s) not done in full (above)." if problems else f"Done; archives in {plan.archive}.")
    return 1 if problems else 0


def main(argv: list[str]) -> int:
    if argv[:1] != ["end"]:
        print("usage: hpdl course end --site S [--date YYYY-MM-DD] [--users ...|--group G|--homes GLOB|"
              "--workspaces GLOB] [--archive DIR] [--yes]\n(`hpdl course end -h` for more)")
        return 0 if argv[:1] in (["-h"], ["--help"]) else 2
    return end(argv[1:])
