"""JupyterHub for an hpdl workshop on Slurm: each attendee's JupyterLab is a Slurm job of theirs.

    .venv-hub/bin/jupyterhub -f cluster/jupyterhub/jupyterhub_config.py      (as root, or see README)

Learners log in with their cluster account (PAM; members of HPDL_HUB_GROUP). batchspawner's
SlurmSpawner submits singleuser.sbatch as the learner: JupyterLab runs in the job's batch step and
a notebook's `hpdl.start()` puts its ranks on the job's tasks (one `srun` step). Stopping a server
cancels the job; jupyterhub-idle-culler stops servers nobody has used for HPDL_HUB_IDLE_TIMEOUT.

Settings come from the environment (HPDL_HUB_*, HPDL_SITE, HPDL_DIR, ...), so the file itself needs
no edits: `hpdl settings` lists them with their defaults, as does docs/SETTINGS.md (both generated
from hpdl/settings.py, which this file reads them through).
"""
import os
import shlex
import socket
import sysconfig
from pathlib import Path

from hpdl import settings
from hpdl.sites import load_site, resource_options

c = get_config()  # noqa: F821  (JupyterHub's config loader provides it)

HERE = Path(__file__).resolve().parent
KIT = settings.DIR.get() or HERE.parents[1]
KIT_VENV = settings.KIT_VENV.get() or KIT / ".venv"
HUB_ENV = settings.HUB_ENV.get() or KIT / ".venv-hub"
STATE = settings.HUB_STATE.get()
IDLE_TIMEOUT = settings.HUB_IDLE_TIMEOUT.get()
CULL_EVERY = settings.HUB_CULL_EVERY.get()
# How fresh the hub's idea of "last used" is: well inside the idle timeout.
ACTIVITY_EVERY = max(5, min(300, IDLE_TIMEOUT // 4))


# -- the hub ------------------------------------------------------------------------------------
STATE.mkdir(mode=0o700, parents=True, exist_ok=True)
c.JupyterHub.db_url = f"sqlite:///{STATE / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(STATE / "jupyterhub_cookie_secret")
c.ConfigurableHTTPProxy.pid_file = str(STATE / "jupyterhub-proxy.pid")
c.ConfigurableHTTPProxy.command = [str(HUB_ENV / "node_modules" / ".bin" / "configurable-http-proxy")]
# Single-user servers run on compute nodes and call the hub's API: it listens beyond localhost.
c.JupyterHub.hub_ip = "0.0.0.0"
c.JupyterHub.hub_connect_ip = settings.HUB_CONNECT_HOST.get() or socket.gethostname()
c.JupyterHub.last_activity_interval = ACTIVITY_EVERY
c.JupyterHub.cleanup_servers = True  # stopping the hub cancels every learner's job

# -- who may log in -----------------------------------------------------------------------------
# The machine's own accounts (PAM), members of one group. Sites with LDAP or OAuth set
# c.JupyterHub.authenticator_class in HPDL_HUB_SITE_CONFIG; the spawner needs only that the hub's
# user name is the learner's Unix account on the cluster.
c.JupyterHub.authenticator_class = "pam"
c.PAMAuthenticator.allowed_groups = {settings.HUB_GROUP.get()}
c.Authenticator.admin_users = {u.strip() for u in settings.HUB_ADMINS.get().split(",") if u.strip()}

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
SITE = load_site(SITE_SPEC)  # with this environment's HPDL_SLURM_* overrides, passed on to the job below
SITE_OVERRIDES = settings.SLURM.members()
c.SlurmSpawner.req_nprocs = str(settings.HUB_RANKS.get())
c.SlurmSpawner.req_runtime = settings.HUB_TIME.get() or SITE.time or "02:00:00"
c.SlurmSpawner.req_partition = settings.HUB_PARTITION.get() or SITE.partition
c.SlurmSpawner.req_account = settings.HUB_ACCOUNT.get() or SITE.account
c.SlurmSpawner.req_qos = settings.HUB_QOS.get() or SITE.qos
c.SlurmSpawner.req_options = " ".join([*resource_options(SITE), *SITE.sbatch, settings.HUB_SBATCH.get()]).strip()
hub_site = sysconfig.get_paths(vars={"base": str(HUB_ENV), "platbase": str(HUB_ENV)})["purelib"]
c.SlurmSpawner.req_prologue = "\n".join(
    ([f"module load {settings.HUB_MODULES.get()}"] if settings.HUB_MODULES.get() else [])
    + [f'export {settings.DIR.name}="{KIT}" {settings.PYTHON.name}="{KIT_VENV / "bin" / "python"}"',
       f'export {settings.HUB_ENV.name}="{HUB_ENV}" {settings.HUB_SITE_PACKAGES.name}="{hub_site}"',
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
c.JupyterHub.services = [{
    "name": "idle-culler",
    "command": [str(HUB_ENV / "bin" / "python"), "-m", "jupyterhub_idle_culler",
                f"--timeout={IDLE_TIMEOUT}", f"--cull-every={CULL_EVERY}"],
}]
c.JupyterHub.load_roles = [{
    "name": "idle-culler",
    "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"],
    "services": ["idle-culler"],
}]

if settings.HUB_SITE_CONFIG.is_set():
    load_subconfig(str(settings.HUB_SITE_CONFIG.get()))  # noqa: F821  (JupyterHub's config loader provides it)
