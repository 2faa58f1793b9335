"""Emulated nodes without root: the nodes' network inside a user namespace of the learner's own.

Why: emulated.py makes the bridge in the host's network, which needs root (CAP_NET_ADMIN there),
and most learners have no root on their laptop. A user namespace gives its creator every
capability over the namespaces made inside it (where the kernel allows unprivileged user
namespaces, as Debian, Ubuntu and Fedora do by default): `unshare --map-root-user --net --mount`
starts a process that is root over a network of its own, in which MACHINE makes the bridge,
a network namespace per node (held by a bind mount on a file of the run folder, since
/run/netns is root's), the veth links and tc's rate limits, as emulated.py does on the host,
then runs the MPI's launcher there. The launcher starts each node's daemon through NODE_EXEC,
which enters that node's network (nsenter) with the node's hostname, /etc/hosts and /sys (a UTS
and a mount namespace, a bind mount over /etc/hosts, and the node's own sysfs, where MPI
libraries look for network interfaces), as `ip netns exec` does for the host's.

What does not cross into that network is TCP from the host, where the ipyparallel controller
stays with the kernel: the ranks reach it through Unix sockets in the run folder instead
(engine_transport "ipc", see link_engine_sockets). When the launcher ends, the namespaces end
with it: nothing is left on the host to remove.
"""
from __future__ import annotations

import functools
import json
import shlex
import shutil
import subprocess
from pathlib import Path

#: What an unprivileged user needs, besides the kernel's consent (util-linux, iproute2)
TOOLS = ("unshare", "nsenter", "ip", "tc", "hostname", "mount")
SBIN = "/usr/sbin:/sbin"  # where Debian puts ip and tc, outside a user's PATH
UNIX_PATH_MAX = 107  # bytes in a Unix socket's path (sun_path, less its NUL)

MACHINE = """#!/bin/sh
# Written by hpdl for one cluster's emulated nodes. Run as root of a fresh user namespace, in its
# own network and mount namespaces (unshare --map-root-user --net --mount): make the nodes, then
# run the MPI launcher given as arguments here.
set -e
export PATH="$PATH:{sbin}"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1  # root only of this namespace
ip link set lo up
ip link add br0 mtu {mtu} type bridge
ip addr add {bridge}/24 dev br0
ip link set br0 up
{nodes}
exec "$@"
"""

NODE = """: > {held}
unshare --net={held} true
nsenter --net={held} ip link add eth0 mtu {mtu} type veth peer name v{i} mtu {mtu} netns $$
ip link set v{i} master br0 up
nsenter --net={held} sh -c 'ip addr add {address}/24 dev eth0 && ip link set eth0 up && ip link set lo up \
  && tc qdisc add dev eth0 root {tbf}'
tc qdisc add dev v{i} root {tbf}"""

REMOTE_SHELL = """#!/bin/sh
# Written by hpdl for one cluster's emulated nodes. The MPI's launcher runs it instead of ssh:
#   SCRIPT [ssh options] HOST COMMAND...
# and it runs COMMAND in HOST's network, with the node's hostname. Hydra's COMMAND is one program
# (exec'd: the launcher's child is the proxy itself); Open MPI's sets variables first
# (`PRTE_PREFIX=...;export PRTE_PREFIX;...;prted ...`), which a shell runs as written.
export PATH="$PATH:{sbin}"
while [ "${{1#-}}" != "$1" ]; do shift; done
host=${{1%%:*}}; shift   # Intel MPI may pass HOST:SLOTS as it was given
case "$host" in
{cases}
  *) echo "hpdl: $host is not one of this cluster's emulated nodes" >&2; exit 1 ;;
esac
case "$1" in
  *=*) run="$*" ;;
  *) run="exec $*" ;;
esac
"""
# in a user namespace: the node's network (held by a file), hostname, hosts file and sysfs
ENTER = ('exec nsenter --net="$held" unshare --uts --mount sh -c \\\n'
         '  "hostname $name && mount --bind $hosts /etc/hosts && mount -t sysfs sysfs /sys && $run"\n')


def remote_shell(cases: str, enter: str) -> str:
    """The script an MPI's launcher runs instead of ssh: `cases` (shell case arms) set the node's
    variables from HOST, `enter` runs COMMAND ($run) inside that node. Both routes use it."""
    return REMOTE_SHELL.format(sbin=SBIN, cases=cases) + enter


def which(tool: str) -> str | None:
    """`tool` on PATH, or in /usr/sbin or /sbin (ip and tc, for a user whose PATH leaves them out)."""
    return shutil.which(tool) or shutil.which(tool, path=SBIN)


@functools.lru_cache(maxsize=1)
def works() -> bool:
    """Whether this user may make a user namespace with a network of its own and a bridge in it."""
    if any(which(t) is None for t in TOOLS):
        return False
    try:
        p = subprocess.run(["unshare", "--map-root-user", "--net", "--mount", "sh", "-c",
                            f"PATH=$PATH:{SBIN}; ip link add hpdl-probe type bridge && ip link del hpdl-probe"],
                           capture_output=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return p.returncode == 0


def write_scripts(net, run_dir: Path, tbf: list[str], mtu: int) -> tuple[list[str], str]:
    """(the command prefix that starts the machine, the launcher's remote-shell script) for `net`
    (an emulated.Network), written into run_dir/nodes."""
    folder = run_dir / "nodes"
    folder.mkdir(mode=0o700, exist_ok=True)
    rate = " ".join(tbf)
    blocks, cases = [], []
    for i in range(net.nodes):
        held = folder / f"net{i}"
        hosts = folder / f"hosts{i}"
        hosts.write_text(net.hosts_text())
        blocks.append(NODE.format(held=shlex.quote(str(held)), i=i, mtu=mtu, address=net.address(i), tbf=rate))
        cases.append(f"  {net.address(i)}|{net.hostname(i)}) held={shlex.quote(str(held))}; "
                     f"name={net.hostname(i)}; hosts={shlex.quote(str(hosts))} ;;")
    machine = folder / "machine.sh"
    machine.write_text(MACHINE.format(sbin=SBIN, mtu=mtu, bridge=net.bridge_address, nodes="\n".join(blocks)))
    node_exec = folder / "node-exec.sh"
    node_exec.write_text(remote_shell("\n".join(cases), ENTER))
    for script in (machine, node_exec):
        script.chmod(0o700)
    # --kill-child: if the kernel's side ends this process, the launcher is told to end too
    prefix = ["unshare", "--map-root-user", "--net", "--mount", "--kill-child=TERM", str(machine)]
    return prefix, str(node_exec)


def engine_socket_path(run_dir: Path) -> str:
    """The path the controller's engine-facing Unix sockets are named after (`<path>-<port>`)."""
    path = str(run_dir / "e")
    if len(path.encode()) + 7 > UNIX_PATH_MAX:
        from hpdl.errors import HpdlError

        raise HpdlError(f"The run folder {run_dir} is too long a path for the ranks' Unix sockets (emulated nodes "
                        "without root): set HPDL_HOME to a shorter folder, e.g. ~/.hpdl.")
    return path


def link_engine_sockets(engine_json: Path) -> None:
    """Make the engines' names of the controller's ipc sockets point at them. ipyparallel's
    controller binds `ipc://<path>-<port>`, and its engines connect to `ipc://<path>:<port>`
    (ipyparallel 9.2: controller/app.py construct_url and engine/app.py disagree on the
    separator); a symlink per port from the one name to the other settles it."""
    info = json.loads(engine_json.read_text())
    transport, _, path = str(info["interface"]).partition("://")
    if transport != "ipc":
        return
    for value in info.values():
        for port in value if isinstance(value, list) else [value]:
            if isinstance(port, int) and not isinstance(port, bool):
                link = Path(f"{path}:{port}")
                if not link.is_symlink():
                    link.symlink_to(Path(f"{path}-{port}").name)
