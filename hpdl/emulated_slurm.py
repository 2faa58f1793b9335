"""A private Slurm over emulated nodes: one slurmd per node, so multi-node paths cross a network.

    python -m hpdl.emulated_slurm --nodes 2 --link 1gbit -- hpdl preflight --site local-slurm --nodes 2

Why: the local Slurm (cluster/slurm/local-slurm.sh) is one node, so a job's steps never leave it —
`srun -N2`, preflight's across-node row, a rehearsal over several nodes are only ever tried where a
site has nodes. Here each emulated node (hpdl.emulated: a network namespace, its own address and
hostname, a rate-limited link) runs a slurmd of its own, the controller runs on the first node as
on a small cluster, and this machine is the login node: `srun`, `sbatch` and the kit's Slurm
launcher reach the nodes over the bridge, and the nodes reach this machine at the bridge's
address (where the kit's ipyparallel controller listens); the file system is the same everywhere.

The daemons are side jobs (hpdl.sidejob) that live inside the nodes' namespaces: leaving the block,
a crash, or a killed owner (the reaper's sweep of the namespaces) ends them with the nodes. The
command runs with SLURM_CONF pointing at this cluster's configuration only; the machine's own
Slurm, if any, is not touched. Needs root (as emulated nodes do) and a running munged (the local
Slurm starts it).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from hpdl import emulated, emulated_job, reaper, settings, sidejob
from hpdl.errors import HpdlError

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
PARTITION = "debug"  # the name the local-slurm site profile asks for, so its jobs run here unchanged
READY_WITHIN = 90.0  # s for every slurmd to register with the controller

CONFIG = """\
# A private Slurm over emulated nodes, written by hpdl.emulated_slurm; gone when it ends.
ClusterName=hpdl-emulated
SlurmctldHost={first}({first_address})
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmctldPidFile={run}/slurmctld.pid
SlurmdPidFile={run}/slurmd-%n.pid
SlurmctldLogFile={run}/slurmctld.log
SlurmdLogFile={run}/slurmd-%n.log
StateSaveLocation={run}/state
SlurmdSpoolDir={run}/spool-%n
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmi2
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
InactiveLimit=0
KillWait=5
MinJobAge=30
{nodes}
PartitionName={partition} Nodes={names} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


def write_config(net: emulated.Network, run: Path, cpus: int) -> Path:
    """slurm.conf for these nodes: node i at its namespace's address, the controller on node 0."""
    names = [net.hostname(i) for i in range(net.nodes)]
    nodes = "\n".join(f"NodeName={name} NodeAddr={net.address(i)} CPUs={cpus} RealMemory=2000 State=UNKNOWN"
                      for i, name in enumerate(names))
    (run / "state").mkdir(exist_ok=True)
    for name in names:
        (run / f"spool-{name}").mkdir(exist_ok=True)
    conf = run / "slurm.conf"
    conf.write_text(CONFIG.format(first=names[0], first_address=net.address(0), run=run, nodes=nodes,
                                  partition=PARTITION, names=",".join(names)))
    return conf


def _on_node(net: emulated.Network, i: int, command: str) -> list[str]:
    """`command` in node i's network namespace, with its hostname and its /etc/hosts (the nodes'
    names: a job's ranks find rank 0 by name). nsenter and a bind mount, not `ip netns exec`:
    that one also mounts a fresh /sys, where slurmd no longer finds the machine's cgroups."""
    hosts = emulated.NETNS_ETC / net.namespaces[i] / "hosts"
    return ["nsenter", f"--net=/run/netns/{net.namespaces[i]}", "unshare", "--uts", "--mount", "sh", "-c",
            f"mount --bind {hosts} /etc/hosts && hostname {net.hostname(i)} && exec {command}"]


def _states(env: dict) -> dict[str, str]:
    p = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T"], env=env, capture_output=True, text=True, timeout=30)
    return dict(line.split(None, 1) for line in p.stdout.splitlines() if " " in line)


def _wait_ready(net: emulated.Network, env: dict, daemons: list[sidejob.SideJob], run: Path) -> None:
    deadline = time.monotonic() + READY_WITHIN
    states: dict[str, str] = {}
    while time.monotonic() < deadline:
        states = _states(env)
        if len(states) == net.nodes and all(s.startswith(("idle", "mix", "alloc")) for s in states.values()):
            return
        dead = [d for d in daemons if not d.running()]
        if dead:
            break
        time.sleep(0.5)
    tails = (d.output_text(tail_bytes=400).strip() for d in daemons)
    logs = "\n".join(f"  {tail}" for tail in tails if tail)
    raise HpdlError(f"The emulated nodes' Slurm did not come up within {READY_WITHIN:.0f} s (nodes: "
                    f"{states or 'none answered'}); its logs are in {run}:\n{logs}")


@contextlib.contextmanager
def cluster(nodes: int = 2, link: str = "1gbit", cpus: int = 2, timeout: float = 3600) -> Iterator[dict]:
    """A running Slurm of `nodes` emulated nodes with `cpus` CPUs each; yields the environment its
    commands need: SLURM_CONF; emulated.RANK_ENV, which jobs pass on to their ranks (UCX would
    otherwise see one machine and carry the traffic between nodes in shared memory); and the
    address the nodes reach this machine at, for the kit's Slurm launcher's controller (this
    machine's name may resolve to 127.0.0.1, which is each node's own). Everything it started
    is ended when the block ends."""
    if not MUNGE_SOCKET.exists():
        raise HpdlError("munged is not running, and Slurm authenticates with it: start the local Slurm once "
                        "(`bash cluster/slurm/local-slurm.sh start`), which starts munged, then try again.")
    with tempfile.TemporaryDirectory(prefix="hpdl-slurm-nodes-") as folder, \
            emulated.nodes(nodes * cpus, nodes, link, reaper.end_pids) as net:
        run = Path(folder)
        conf = write_config(net, run, cpus)
        env = {**os.environ, "SLURM_CONF": str(conf)}
        with contextlib.ExitStack() as stack:
            daemons = [stack.enter_context(sidejob.SideJob(_on_node(net, 0, f"slurmctld -D -f {conf}"), env=env,
                                                           output=run / "slurmctld.out", timeout=timeout))]
            daemons += [stack.enter_context(sidejob.SideJob(_on_node(net, i, f"slurmd -D -f {conf}"), env=env,
                                                            output=run / f"slurmd-{i}.out", timeout=timeout))
                        for i in range(nodes)]
            _wait_ready(net, env, daemons, run)
            yield {"SLURM_CONF": str(conf), **emulated.RANK_ENV,
                   settings.SLURM.of("controller_host").name: net.bridge_address}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hpdl.emulated_slurm", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", type=int, default=2, help="emulated nodes, one slurmd each (default 2)")
    ap.add_argument("--link", default="1gbit", help="each node's link rate, tc's spelling (default 1gbit)")
    ap.add_argument("--cpus", type=int, default=2, help="CPUs each node declares (default 2)")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds before everything is ended (default 3600)")
    ap.add_argument("command", nargs=argparse.REMAINDER,
                    help="what to run against this Slurm (after --), e.g. srun -N2 hostname")
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("name the command to run against the nodes' Slurm, e.g. -- srun -N2 hostname")
    if args.nodes < 1 or args.cpus < 1:
        ap.error("--nodes and --cpus are at least 1")
    try:
        with cluster(args.nodes, args.link, args.cpus, args.timeout) as env:
            done = sidejob.run(command, args.timeout, env={**os.environ, **env}, shared_memory=False)
    except HpdlError as exc:
        print(f"hpdl: {exc}", file=sys.stderr)
        return 2
    return emulated_job.finish(done, args.timeout)


if __name__ == "__main__":
    sys.exit(main())
