"""JupyterHub for an hpdl workshop on Slurm: each attendee's JupyterLab is a Slurm job of theirs.

    sudo cluster/jupyterhub/install.sh            # once per kit update: a root-owned copy in /opt/hpdl-hub
    /opt/hpdl-hub/bin/hpdl-hub                    # as root (or the hpdl-hub.service unit it writes)
    /opt/hpdl-hub/bin/hpdl-hub-stop               # stops it: every learner's job is cancelled

Learners log in with their cluster account (PAM; members of HPDL_HUB_GROUP). batchspawner's
SlurmSpawner submits singleuser.sbatch as the learner: JupyterLab runs in the job's batch step and
a notebook's `hpdl.start()` puts its ranks on the job's tasks (one `srun` step). Stopping a server
cancels the job; jupyterhub-idle-culler stops servers nobody has used for HPDL_HUB_IDLE_TIMEOUT.

Fit for a real network: it refuses to start without TLS (HPDL_HUB_SSL_CERT/_KEY, or HPDL_HUB_TLS_PROXY=1
and a loopback or internal address); its API listens on an internal address (HPDL_HUB_API_IP), never
0.0.0.0; run as root, it refuses any file it would run that someone other than root can change;
instructors (HPDL_HUB_INSTRUCTORS) may list and stop servers but never open one; its log goes to
HPDL_HUB_LOG_DIR, rotated.

Settings come from the environment (HPDL_HUB_*, HPDL_SITE, HPDL_DIR, ...), so the file itself needs
no edits: `hpdl settings` lists them with their defaults, as does docs/SETTINGS.md (both generated
from hpdl/settings.py, which this file reads them through).
"""
import ipaddress
import json
import os
import shlex
import socket
import stat
import sys
import sysconfig
from pathlib import Path
from urllib.parse import urlparse

from hpdl import settings
from hpdl.errors import HpdlError
from hpdl.sites import SITES_DIR, load_site, resource_options

c = get_config()  # noqa: F821  (JupyterHub's config loader provides it)

HERE = Path(__file__).resolve().parent
# install.sh copies this file to PREFIX/etc and notes there where the kit and its venv are
INSTALLED = json.loads((HERE / "install.json").read_text()) if (HERE / "install.json").is_file() else {}
PREFIX = HERE.parent if INSTALLED else None
KIT = settings.DIR.get() or Path(INSTALLED.get("kit") or HERE.parents[1])
KIT_VENV = settings.KIT_VENV.get() or Path(INSTALLED.get("kit_venv") or KIT / ".venv")
# the hub's packages for the learner's side (jupyterhub-singleuser, batchspawner), put on their
# PYTHONPATH; a hub run from the kit (no install; not as root) has them in its own venv
SINGLEUSER = PREFIX / "singleuser" if PREFIX else Path(sys.prefix)
SINGLEUSER_SITE = SINGLEUSER if PREFIX else Path(sysconfig.get_paths()["purelib"])
PROXY = (PREFIX / "proxy" if PREFIX else Path(sys.prefix)) / "node_modules" / ".bin" / "configurable-http-proxy"
STATE = settings.HUB_STATE.get()
LOG_DIR = settings.HUB_LOG_DIR.get()
IDLE_TIMEOUT = settings.HUB_IDLE_TIMEOUT.get()
CULL_EVERY = settings.HUB_CULL_EVERY.get()
# How fresh the hub's idea of "last used" is: well inside the idle timeout.
ACTIVITY_EVERY = max(5, min(300, IDLE_TIMEOUT // 4))
LOG_BYTES, LOG_KEEP = 20 * 2**20, 10  # each log rotated at 20 MB, ten old ones kept


def refuse(message: str) -> None:
    """Stop the hub before it starts, saying what to do (a clean message, not a traceback)."""
    print(f"hpdl hub: cannot start: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def _is_wildcard(host: str) -> bool:
    return host in ("", "0.0.0.0", "::", "[::]", "*")


def _is_internal(host: str) -> bool:
    """A loopback or private address (or a name that resolves to one): not on the open network."""
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        try:
            ip = ipaddress.ip_address(socket.gethostbyname(host))
        except OSError:
            return False
    return ip.is_loopback or ip.is_private


# -- the hub's front door: TLS, or a TLS proxy in front and an internal address -----------------------
def front_door() -> None:
    """Set where browsers reach the hub; refuse plain HTTP on an open address."""
    cert, key = settings.HUB_SSL_CERT.get(), settings.HUB_SSL_KEY.get()
    if cert or key:
        if not (cert and key):
            refuse(f"set both {settings.HUB_SSL_CERT.name} and {settings.HUB_SSL_KEY.name} "
                   "(the certificate and its key)")
        for path in (cert, key):
            if not path.is_file():
                refuse(f"no file {path}: {settings.HUB_SSL_CERT.name}/{settings.HUB_SSL_KEY.name} name PEM files")
        if key.stat().st_mode & 0o004:
            refuse(f"the hub's private key {key} is readable by everyone: `chmod o-r {key}` (0600, root's)")
        c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = str(cert), str(key)
    proxy = settings.HUB_TLS_PROXY.get()
    url = settings.HUB_BIND_URL.get() or ("http://127.0.0.1:8000" if proxy else "https://:443")
    c.JupyterHub.bind_url = url


def check_front_door() -> None:
    """After the site's config: TLS on, or a TLS proxy declared and the hub on an internal address."""
    hub = c.JupyterHub  # .get(): reading an unset name from a Config would set it (to a lazy value)
    url = urlparse(hub.get("bind_url", ""))
    if hub.get("ssl_cert") and hub.get("ssl_key"):
        if url.scheme != "https":
            refuse(f"{settings.HUB_BIND_URL.name}={hub.bind_url}: with a certificate the hub serves https://")
        return
    if not settings.HUB_TLS_PROXY.get():
        refuse(f"no TLS: learners' passwords would cross the network in clear. Set {settings.HUB_SSL_CERT.name} "
               f"and {settings.HUB_SSL_KEY.name} (PEM files), or, if a TLS-terminating proxy is in front, "
               f"{settings.HUB_TLS_PROXY.name}=1 (the hub then listens on 127.0.0.1 or an internal address only)")
    if url.scheme != "http" or _is_wildcard(url.hostname or "") or not _is_internal(url.hostname or ""):
        refuse(f"{settings.HUB_BIND_URL.name}={hub.get('bind_url')}: behind a TLS proxy the hub listens on "
               f"http:// at 127.0.0.1 or an internal address the proxy reaches, e.g. http://127.0.0.1:8000")


front_door()

# -- the hub's API: on an internal address the compute nodes reach -------------------------------------
CONNECT_HOST = settings.HUB_CONNECT_HOST.get() or socket.gethostname()
API_IP = settings.HUB_API_IP.get()
if API_IP is None:
    try:
        API_IP = socket.gethostbyname(CONNECT_HOST)
    except OSError:
        refuse(f"{CONNECT_HOST!r} does not resolve: set {settings.HUB_API_IP.name} to this host's address on the "
               f"network its compute nodes reach (and {settings.HUB_CONNECT_HOST.name} to its name there)")
if _is_wildcard(API_IP):
    refuse(f"{settings.HUB_API_IP.name}={API_IP}: the hub's API must not listen on every interface; name this "
           f"host's address on the cluster's internal network (the one compute nodes reach)")
API_PORT = settings.HUB_API_PORT.get()
c.JupyterHub.hub_bind_url = f"http://{API_IP}:{API_PORT}"
c.JupyterHub.hub_connect_url = f"http://{CONNECT_HOST}:{API_PORT}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:8001"  # the proxy's own API: this host only

# -- the hub's state and logs ---------------------------------------------------------------------------
for folder, mode in ((STATE, 0o700), (LOG_DIR, 0o750)):
    try:
        folder.mkdir(mode=mode, parents=True, exist_ok=True)
    except OSError as exc:
        refuse(f"cannot make {folder} ({exc.strerror}): run the hub as root, or set "
               f"{settings.HUB_STATE.name} / {settings.HUB_LOG_DIR.name} to folders it may write")
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(STATE / "jupyterhub.pid")  # what hpdl-hub-stop signals
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
c.ConfigurableHTTPProxy.command = [str(PROXY)]
# The hub's own log (with tornado's), rotated; its console output goes to the journal as well.
# (JupyterHub's extra_log_file is deprecated: a logging handler, through traitlets' logging_config.)
c.JupyterHub.logging_config = {
    "formatters": {"file": {"format": "[%(levelname)1.1s %(asctime)s %(name)s %(module)s:%(lineno)d] %(message)s"}},
    "handlers": {"file": {"class": "logging.handlers.RotatingFileHandler", "formatter": "file", "level": "INFO",
                          "filename": str(LOG_DIR / "jupyterhub.log"), "maxBytes": LOG_BYTES,
                          "backupCount": LOG_KEEP, "encoding": "utf-8"}},
    "loggers": {"JupyterHub": {"handlers": ["console", "file"]}},
}
c.JupyterHub.last_activity_interval = ACTIVITY_EVERY
c.JupyterHub.cleanup_servers = True  # stopping the hub cancels every learner's job

# -- who may log in, and what they may do -----------------------------------------------------------
# The machine's own accounts (PAM), members of one group. Sites with LDAP or OAuth set
# c.JupyterHub.authenticator_class in HPDL_HUB_SITE_CONFIG; the spawner needs only that the hub's
# user name is the learner's Unix account on the cluster.
INSTRUCTORS = sorted({u.strip() for u in settings.HUB_INSTRUCTORS.get().split(",") if u.strip()})
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.allowed_groups = {settings.HUB_GROUP.get()}
c.Authenticator.allowed_users = set(INSTRUCTORS)  # they log in even outside the learners' group
c.Authenticator.admin_users = set()  # nobody is admin: an admin may open (act in) any learner's server
c.JupyterHub.load_groups = {"instructors": {"users": INSTRUCTORS}}
c.JupyterHub.load_roles = [
    {"name": "user", "scopes": ["self"]},  # a learner: their own server and nothing else
    # instructors see everyone and stop servers (the admin page too), but never open a learner's
    # server (no access:servers), start one, or take a learner's tokens
    {"name": "instructor", "groups": ["instructors"],
     "scopes": ["self", "admin-ui", "list:users", "read:users", "read:servers", "delete:servers", "read:groups"]},
]

# -- each learner's JupyterLab: a Slurm job of theirs ---------------------------------------------
c.JupyterHub.spawner_class = "batchspawner.SlurmSpawner"
c.SlurmSpawner.batch_script = (HERE / "singleuser.sbatch").read_text()
# Submitting, querying and cancelling run as the learner: `sudo -E -u NAME` (a hub running as a
# service user with a sudoers rule for sbatch/squeue/scancel), or runuser when the hub is root.
c.SlurmSpawner.exec_prefix = "runuser -u {username} --" if os.geteuid() == 0 else "sudo -E -u {username}"
# The job's log in the learner's home is theirs alone (sbatch hands its umask to the job).
c.SlurmSpawner.batch_submit_cmd = "sh -c 'umask 077; exec sbatch --parsable'"
c.SlurmSpawner.req_srun = ""  # JupyterLab in the batch step: the ranks' srun step gets the job's tasks
# The job holds what its ranks' step will ask for: one task per rank, each with the site profile's
# resources per rank (cores, GPUs, ranks per node) and extra sbatch options, as a job submitted
# with `sbatch $(python -m hpdl.sites --sbatch)` would. Inside the job the step asks for what the
# job holds (hpdl.launchers.slurm), so the two cannot disagree.
SITE_SPEC = settings.SITE.get() or "generic"
try:
    SITE = load_site(SITE_SPEC)  # with this environment's HPDL_SLURM_* overrides, passed on to the job below
except HpdlError as exc:
    refuse(str(exc))
SITE_OVERRIDES = settings.SLURM.members()
c.SlurmSpawner.req_nprocs = str(settings.HUB_RANKS.get())
c.SlurmSpawner.req_runtime = settings.HUB_TIME.get() or SITE.time or "02:00:00"
c.SlurmSpawner.req_partition = settings.HUB_PARTITION.get() or SITE.partition
c.SlurmSpawner.req_account = settings.HUB_ACCOUNT.get() or SITE.account
c.SlurmSpawner.req_qos = settings.HUB_QOS.get() or SITE.qos
c.SlurmSpawner.req_reservation = settings.HUB_RESERVATION.get() or ""
c.SlurmSpawner.req_options = " ".join([*resource_options(SITE), *SITE.sbatch, settings.HUB_SBATCH.get()]).strip()
c.SlurmSpawner.req_prologue = "\n".join(
    ([f"module load {settings.HUB_MODULES.get()}"] if settings.HUB_MODULES.get() else [])
    + [f'export {settings.DIR.name}="{KIT}" {settings.PYTHON.name}="{KIT_VENV / "bin" / "python"}"',
       f'export {settings.HUB_ENV.name}="{SINGLEUSER}" '
       f'{settings.HUB_SITE_PACKAGES.name}="{SINGLEUSER_SITE}"',
       f'export {settings.SITE.name}="{SITE_SPEC}"']
    + [f"export {k}={shlex.quote(v)}" for k, v in sorted(SITE_OVERRIDES.items())]
)
c.SlurmSpawner.batchspawner_singleuser_cmd = '"$PY" -m batchspawner.singleuser'
c.SlurmSpawner.cmd = ["jupyterhub-singleuser"]
c.SlurmSpawner.default_url = "/lab/tree/notebooks/00_welcome.ipynb"
c.SlurmSpawner.environment = {"JUPYTERHUB_ACTIVITY_INTERVAL": str(ACTIVITY_EVERY)}
c.SlurmSpawner.start_timeout = 600  # a queued job is still starting
c.SlurmSpawner.http_timeout = 180  # JupyterLab's first start on a busy node
c.SlurmSpawner.startup_poll_interval = 1.0

# -- idle servers are stopped (their jobs cancelled) ----------------------------------------------
# Its log goes beside the hub's, rotated the same way. It reads a config file (by default
# ./idle_culler_config.py): it is given its own, written here, in the hub's root-only state folder.
CULLER_CONFIG = STATE / "idle_culler_config.py"
CULLER_CONFIG.write_text("c.IdleCuller.logging_config = " + repr({
    "handlers": {"file": {"class": "logging.handlers.RotatingFileHandler", "formatter": "console",
                          "level": "INFO", "filename": str(LOG_DIR / "idle-culler.log"),
                          "maxBytes": LOG_BYTES, "backupCount": LOG_KEEP}},
    "loggers": {"IdleCuller": {"handlers": ["console", "file"]}},
}) + "\n")
c.JupyterHub.services = [{
    "name": "idle-culler",
    "command": [sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={IDLE_TIMEOUT}",
                f"--cull-every={CULL_EVERY}", f"--config={CULLER_CONFIG}"],
    "cwd": str(STATE),
}]
c.JupyterHub.load_roles.append({
    "name": "idle-culler",
    "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    "services": ["idle-culler"],
})


# -- run as root, nothing it runs may be changed by anyone else ------------------------------------------
def _changeable_by_others(path: Path) -> str | None:
    """Why someone other than root could change `path` (it, or a folder above it), else None."""
    path = Path(os.path.abspath(path))
    for p in (path, *path.parents):
        try:
            st = p.stat()
        except OSError:
            continue
        if st.st_uid != 0:
            return f"{p} belongs to uid {st.st_uid}"
        sticky_dir = stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
        if st.st_mode & 0o022 and not (sticky_dir and p != path):
            return f"{p} is writable by its group or everyone (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def check_root_runs_only_roots_files() -> None:
    """As root: the config, the site's config, the interpreter, every folder of sys.path and the proxy
    must be root's alone (install.sh makes such a copy: run it after each update of the kit)."""
    if os.geteuid() != 0:
        return
    site_config = settings.HUB_SITE_CONFIG.get()
    paths = [Path(__file__), HERE / "singleuser.sbatch", Path(sys.executable).resolve(), PROXY, SITES_DIR,
             *[Path(p or os.getcwd()) for p in sys.path if os.path.exists(p or os.getcwd())],
             *([site_config] if site_config else [])]
    for path in paths:
        why = _changeable_by_others(path)
        if why:
            refuse(f"the hub runs as root and would run {path}, but {why}. Install the hub root-owned, outside "
                   f"the kit: `sudo cluster/jupyterhub/install.sh` (into {settings.HUB_PREFIX.default}), and run "
                   f"{settings.HUB_PREFIX.default}/bin/hpdl-hub; or run it as a service user (README)")


if settings.HUB_SITE_CONFIG.is_set():
    check_root_runs_only_roots_files()  # before running the site's file
    load_subconfig(str(settings.HUB_SITE_CONFIG.get()))  # noqa: F821  (JupyterHub's config loader provides it)
check_root_runs_only_roots_files()
check_front_door()
