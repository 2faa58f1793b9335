"""Emulated nodes: several "machines" on this one, joined by links of a known bandwidth.

Why: on one machine every rank shares memory, so communication is nearly free and the lessons
cannot show what a network costs. Linux can give each group of ranks a machine of its own as far
as networking goes: a network namespace per node (its own interface and address) and a UTS
namespace (its own hostname), joined to the others by a veth pair into a bridge on the host,
with a token-bucket filter (`tc ... tbf`) limiting each node's link to the rate asked for, in
both directions. Ranks of one node still share memory (MPI sees one host); between nodes their
traffic crosses TCP over the limited link. No added latency: `netem` is not in every kernel.

    hpdl.start(n=4, nodes=2, link="1gbit")    # 2 nodes x 2 ranks, 1 Gbit/s between them

How the ranks get there: an MPI's launcher starts one daemon per host through a remote shell
(normally ssh); we name a small script of ours instead, which runs the daemon inside that node's
namespaces (`ip netns exec` + `unshare --uts`): MPICH's Hydra proxy (`-launcher ssh
-launcher-exec`), Open MPI's prted (`--prtemca prte_ssh_agent`), Intel MPI's bootstrap proxy
(`-bootstrap ssh -bootstrap-exec`). `ip netns exec`
also mounts /etc/netns/<namespace>/hosts over /etc/hosts, which is how the nodes know each
other's names (and the host's, which Intel MPI's proxies call back on) without touching the
real /etc/hosts. The ipyparallel controller listens on the
bridge's address, which every node reaches.

Without root, where the kernel allows user namespaces, the same nodes are made inside a user
namespace of one's own instead (emulated_userns.py): nothing on the host's network, and nothing
left to remove when the launcher ends.

Every kernel object is named with the kit's prefix and a tag of the cluster (namespaces
`hpdl-<tag>-n<i>`, links `hpv-<tag>-<i>`, bridge `hpb-<tag>`), recorded in the reaper's state,
removed by `remove()` at stop, by the reaper when the kernel dies, and by `sweep()` (hpdl cleanup).
Needs root (CAP_NET_ADMIN in the host's namespace), or user namespaces, and `ip`, `tc`, `unshare`.
"""
from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import tempfile
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from hpdl import emulated_userns, procs
from hpdl.errors import HpdlError

log = logging.getLogger(__name__)

PREFIX = "hpdl-"          # network namespaces: hpdl-<tag>-n<i>
LINK_PREFIX = "hpv-"      # the host's end of each node's veth pair: hpv-<tag>-<i>
BRIDGE_PREFIX = "hpb-"    # the bridge joining the nodes: hpb-<tag>
NETNS_ETC = Path("/etc/netns")  # where `ip netns exec` finds a namespace's own /etc/hosts
# the process that made each set of nodes, by tag (not in /etc/netns: `ip netns exec` mounts
# every file there over /etc)
OWNERS = Path("/run/hpdl-emulated")
SUBNETS = ipaddress.ip_network("10.231.0.0/16")  # one /24 of it per emulated cluster
MTU = 9000                # jumbo frames: TCP headers cost ~1 % of the link instead of ~4 %
# Hydra's environment for every rank: UCX would take the nodes for one machine (same boot id)
# and use shared memory between them; TCP only between nodes. Within a node MPICH's own shared
# memory still carries the traffic.
RANK_ENV = {"UCX_TLS": "tcp,self"}
#: the MPIs whose launchers the kit starts on emulated nodes (mpiexec_implementation's names)
LAUNCHES = ("MPICH", "MVAPICH2", "Open MPI", "Intel MPI")

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(k|m|g)?(bit|bps)\s*$", re.IGNORECASE)
_SCALE = {None: 1, "k": 1e3, "m": 1e6, "g": 1e9}


def link_bits_per_second(link: str | int | float) -> float:
    """"1gbit" -> 1e9, "200mbit" -> 2e8, "100mbps" (bytes) -> 8e8; a number is bits per second.
    The spelling is tc's, so a lesson's rate reads the same as the command that sets it."""
    if isinstance(link, (int, float)) and not isinstance(link, bool) and link > 0:
        return float(link)
    m = _RATE.match(str(link)) if isinstance(link, str) else None
    if not m or float(m.group(1)) <= 0:
        raise HpdlError(f"link={link!r} is not a rate: write it as tc does, e.g. link='1gbit', '200mbit' "
                        "or '50mbps' (bytes per second), or a number of bits per second.")
    bits = float(m.group(1)) * _SCALE[(m.group(2) or "").lower() or None]
    return bits * (8 if m.group(3).lower() == "bps" else 1)


def missing() -> str | None:
    """What this machine lacks for emulated nodes, worded as what to do; None when nothing."""
    need = [tool for tool in ("ip", "tc", "unshare", "hostname") if emulated_userns.which(tool) is None]
    if need:
        return (f"Emulated nodes need {', '.join(need)} (Debian: apt-get install iproute2 util-linux hostname), "
                "which this machine does not have.")
    if os.geteuid() != 0 and not emulated_userns.works():
        return ("Emulated nodes create network namespaces, veth links and a bridge, which needs root "
                "(CAP_NET_ADMIN on the host's network) or user namespaces, which this machine's kernel refuses "
                "to your account (see `sysctl user.max_user_namespaces`, and on Ubuntu "
                "kernel.apparmor_restrict_unprivileged_userns). Run JupyterLab as root in a container or VM of "
                "your own (e.g. `sudo make lab`), or use hpdl.start(n=...) without nodes=.")
    return None


def placement(n: int, nodes: int) -> list[int]:
    """Ranks per node, in blocks as a batch system places them: 5 ranks on 2 nodes -> [3, 2]."""
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1:
        raise HpdlError(f"nodes is the number of emulated nodes, a whole number ≥ 1; got {nodes!r}.")
    if nodes > n:
        raise HpdlError(f"nodes={nodes} but only n={n} ranks: every node needs a rank; try nodes={n}.")
    if nodes > 64:
        raise HpdlError(f"nodes={nodes} is more than the kit emulates at once (64).")
    return [n // nodes + (i < n % nodes) for i in range(nodes)]


@dataclass
class Network:
    """One cluster's emulated nodes: what was created, enough to remove it again (to_dict)."""

    tag: str
    subnet: str             # e.g. "10.231.7.0/24": node i is .i+1, the bridge .254
    ranks_per_node: list[int]
    link: str               # tc's rate, as given
    script: str = ""        # the script the MPI's launcher runs instead of ssh
    userns: bool = False    # made inside a user namespace (no root): nothing on the host
    prefix: list[str] = field(default_factory=list)  # what starts the launcher there (userns)

    @property
    def nodes(self) -> int:
        return len(self.ranks_per_node)

    @property
    def namespaces(self) -> list[str]:
        return [f"{PREFIX}{self.tag}-n{i}" for i in range(self.nodes)]

    @property
    def links(self) -> list[str]:
        return [f"{LINK_PREFIX}{self.tag}-{i}" for i in range(self.nodes)]

    @property
    def bridge(self) -> str:
        return f"{BRIDGE_PREFIX}{self.tag}"

    def address(self, i: int) -> str:
        return str(ipaddress.ip_network(self.subnet)[i + 1])

    @property
    def bridge_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[254])

    @staticmethod
    def hostname(i: int) -> str:
        return f"node{i}"

    def hosts_text(self) -> str:
        """A node's /etc/hosts: the nodes by name, and the host (the bridge) by its own name too,
        which Intel MPI's proxies call back on."""
        lines = ["127.0.0.1 localhost", f"{self.bridge_address} hpdl-host {socket.gethostname()}"]
        return "\n".join(lines + [f"{self.address(j)} {self.hostname(j)}" for j in range(self.nodes)]) + "\n"

    def mpiexec_flags(self, implementation: str = "MPICH") -> list[str]:
        """The launcher's flags: our script instead of ssh, the nodes' addresses with their rank counts.
        Hydra also needs the address its proxies call back on (the host's name resolves to nothing
        in a node). Open MPI is told which network its daemons and ranks use (the nodes' subnet,
        not the host's other interfaces), and leaves out its hierarchical collectives (HAN): across
        these links HAN's all-reduce of 32 MiB took 4.2 s at 1 Gbit/s where the flat one took 0.46 s
        (MPICH's 0.37 s), so a lesson would measure HAN's segmenting rather than the link."""
        hosts = ",".join(f"{self.address(i)}:{k}" for i, k in enumerate(self.ranks_per_node))
        if implementation == "Intel MPI":  # its -hosts list fills each host up to its cores: a machine file
            # of HOST:RANKS lines places ranks as asked. Its proxies call back on the host's name (in
            # the nodes' hosts files).
            machines = Path(self.script).with_name("machines")
            machines.write_text("".join(f"{self.address(i)}:{k}\n" for i, k in enumerate(self.ranks_per_node)))
            return ["-bootstrap", "ssh", "-bootstrap-exec", self.script, "-machinefile", str(machines)]
        if implementation == "Open MPI":
            return ["--prtemca", "prte_ssh_agent", self.script, "--host", hosts,
                    "--prtemca", "oob_tcp_if_include", self.subnet, "--mca", "oob_tcp_if_include", self.subnet,
                    "--mca", "btl_tcp_if_include", self.subnet, "--mca", "coll", "^han"]
        return ["-launcher", "ssh", "-launcher-exec", self.script, "-localhost", self.bridge_address, "-hosts", hosts]

    def job_command(self) -> list[str]:
        """`mpiexec` for a job of one rank per slot on these nodes (append the program); run it
        with RANK_ENV in its environment. For benchmarks and lessons' `!` lines beside the ranks."""
        from hpdl.launchers.mpiexec import find_mpiexec, launch_flags

        exe = find_mpiexec()
        which = require_launcher(exe)
        return [*self.prefix, exe, *launch_flags(exe), *self.mpiexec_flags(which), "-n", str(sum(self.ranks_per_node))]

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Network":
        return cls(str(d["tag"]), str(d["subnet"]), [int(k) for k in d["ranks_per_node"]], str(d["link"]),
                   str(d.get("script", "")), bool(d.get("userns", False)), [str(a) for a in d.get("prefix", [])])


def require_launcher(mpiexec: str) -> str:
    """The MPI of `mpiexec` (mpiexec_implementation's name) if the kit starts its daemons on emulated
    nodes (LAUNCHES); else HpdlError naming the MPI found and what to use instead."""
    from hpdl.launchers.mpiexec import mpiexec_implementation

    which = mpiexec_implementation(mpiexec)
    if which not in LAUNCHES:
        raise HpdlError(f"Emulated nodes start ranks through the launcher of MPICH, Open MPI or Intel MPI, but "
                        f"{mpiexec} is {which if which != 'unknown' else 'an MPI the kit does not recognise'}, which "
                        "the kit does not start on emulated nodes. Use the kit's MPICH (`make lab`) for nodes=.")
    return which


# -- creating and removing -------------------------------------------------------------------------

def _ip(*args: str, check: bool = True) -> str:
    """Run `ip ARGS` (or `tc` when args start with "tc"); HpdlError with its message when it fails."""
    cmd = list(args) if args[0] in ("tc", "ip") else ["ip", *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and p.returncode != 0:
        raise HpdlError(f"Setting up the emulated nodes failed at `{shlex.join(cmd)}`: {p.stderr.strip()}")
    return p.stdout


def _free_subnet() -> str:
    """A /24 of SUBNETS that no interface here uses yet (another cluster's, or the site's)."""
    used = set()
    for addr in re.findall(r"inet (\d+\.\d+\.\d+\.\d+)", _ip("-4", "-o", "addr", "show")):
        if ipaddress.ip_address(addr) in SUBNETS:
            used.add(ipaddress.ip_network(f"{addr}/24", strict=False))
    for net in SUBNETS.subnets(new_prefix=24):
        if net.network_address.packed[2] and net not in used:
            return str(net)
    raise HpdlError(f"No free /24 left in {SUBNETS} for emulated nodes: run `hpdl cleanup` to remove leftovers.")


def _tbf(rate_bits: float) -> list[str]:
    """tc's token bucket for `rate_bits`: a burst of 10 ms of traffic (at least 256 KiB and a frame:
    a smaller bucket than the kernel's timer tick empties caps the rate below what was asked)."""
    burst = max(256 * 1024, int(rate_bits / 8 / 100)) + MTU
    return ["tbf", "rate", f"{int(rate_bits)}bit", "burst", str(burst), "latency", "50ms"]


# the launcher's remote shell on the host's network: enter the node's namespace, take its hostname
_ENTER = 'exec ip netns exec "$ns" unshare --uts sh -c "hostname $name && $run"\n'


def _write_script(net: Network, run_dir: Path) -> str:
    cases = "\n".join(f"  {net.address(i)}|{net.hostname(i)}) ns={ns}; name={net.hostname(i)} ;;"
                      for i, ns in enumerate(net.namespaces))
    path = run_dir / "node-exec.sh"
    path.write_text(emulated_userns.remote_shell(cases, _ENTER))
    path.chmod(0o700)
    return str(path)


def _add_node(net: Network, i: int, rate_bits: float) -> None:
    ns, link = net.namespaces[i], net.links[i]
    _ip("netns", "add", ns)
    _ip("link", "add", link, "mtu", str(MTU), "type", "veth", "peer", "name", "eth0", "mtu", str(MTU), "netns", ns)
    _ip("link", "set", link, "master", net.bridge, "up")
    _ip("-n", ns, "addr", "add", f"{net.address(i)}/24", "dev", "eth0")
    _ip("-n", ns, "link", "set", "eth0", "up")
    _ip("-n", ns, "link", "set", "lo", "up")
    _ip("tc", "qdisc", "add", "dev", link, "root", *_tbf(rate_bits))              # into the node
    _ip("tc", "-n", ns, "qdisc", "add", "dev", "eth0", "root", *_tbf(rate_bits))  # out of it
    (NETNS_ETC / ns).mkdir(parents=True, exist_ok=True)
    (NETNS_ETC / ns / "hosts").write_text(net.hosts_text())


def create(n: int, nodes: int, link: str | int | float, run_dir: Path) -> Network:
    """The nodes for `n` ranks: namespaces, veth links limited to `link`, a bridge, the hosts
    files and Hydra's script. On any failure what was made is removed again."""
    per_node = placement(n, nodes)
    rate_bits = link_bits_per_second(link)
    problem = missing()
    if problem:
        raise HpdlError(problem)
    if os.geteuid() != 0:  # a network of one's own: any subnet is free there
        net = Network(uuid.uuid4().hex[:6], str(next(SUBNETS.subnets(new_prefix=24))), per_node, str(link), userns=True)
        net.prefix, net.script = emulated_userns.write_scripts(net, run_dir, _tbf(rate_bits), MTU)
        return net
    net = Network(uuid.uuid4().hex[:6], _free_subnet(), per_node, str(link))
    try:
        _ip("link", "add", net.bridge, "mtu", str(MTU), "type", "bridge")
        _ip("addr", "add", f"{net.bridge_address}/24", "dev", net.bridge)
        _ip("link", "set", net.bridge, "up")
        for i in range(nodes):
            _add_node(net, i, rate_bits)
        OWNERS.mkdir(mode=0o700, exist_ok=True)
        (OWNERS / f"{net.tag}.json").write_text(json.dumps(procs.record(os.getpid()).to_dict()))
        net.script = _write_script(net, run_dir)
    except BaseException:
        remove(net.to_dict())
        raise
    return net


@contextlib.contextmanager
def nodes(n: int, count: int, link: str | int | float,
          end_processes: Callable[[list[int]], None] | None = None) -> Iterator[Network]:
    """Emulated nodes for the length of a `with` block, without ranks of the kit's: a benchmark's
    or a script's own MPI jobs run on them through `Network.job_command()`."""
    with tempfile.TemporaryDirectory(prefix="hpdl-nodes-") as folder:
        net = create(n, count, link, Path(folder))
        try:
            yield net
        finally:
            remove(net.to_dict(), end_processes)


def _pids_in(ns: str) -> list[int]:
    return [int(p) for p in _ip("netns", "pids", ns, check=False).split() if p.isdigit()]


def remove(state: dict, end_processes: Callable[[list[int]], None] | None = None) -> None:
    """Remove one cluster's nodes (Network.to_dict()); what is already gone is skipped, and
    what cannot be removed is logged, never raised: this runs while stopping. Processes still
    in a namespace keep it and its link alive: `end_processes(pids)` ends them first (the
    reaper's, since only it and hpdl.procs end processes)."""
    net = Network.from_dict(state)
    if net.userns:
        return  # its namespaces end with the launcher's processes: nothing was made on the host
    _remove_names([*net.namespaces, *net.links, net.bridge], end_processes)
    (OWNERS / f"{net.tag}.json").unlink(missing_ok=True)
    left = leftovers({net.tag})
    if left:
        log.warning("could not remove emulated nodes' %s", ", ".join(left))


_TAGGED = re.compile(r"^(?:hpdl-([0-9a-f]{6})-n\d+|hpv-([0-9a-f]{6})-\d+|hpb-([0-9a-f]{6}))$")


def _tagged(names) -> dict[str, str]:
    """name -> tag, for the kit's namespaces, links, bridges and /etc/netns folders among `names`."""
    out = {}
    for name in names:
        m = _TAGGED.match(name)
        if m:
            out[name] = next(g for g in m.groups() if g)
    return out


def leftovers(tags: set[str] | None = None) -> list[str]:
    """The kit's namespaces and links on this machine (of `tags` only, if given)."""
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    names += os.listdir("/sys/class/net") if os.path.isdir("/sys/class/net") else []
    return sorted(name for name, tag in _tagged(names).items() if tags is None or tag in tags)


def _remove_names(names: list[str], end_processes: Callable[[list[int]], None] | None) -> None:
    """Remove the kit's namespaces (with what runs in them), links and /etc/netns folders by name."""
    for name in names:
        if name.startswith(PREFIX):
            if (Path("/run/netns") / name).exists():
                if end_processes is not None and (pids := _pids_in(name)):
                    log.warning("ending %d process(es) left in %s", len(pids), name)
                    end_processes(pids)
                _ip("netns", "del", name, check=False)
            shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        elif Path(f"/sys/class/net/{name}").exists():
            _ip("link", "del", name, check=False)


def _owner_alive(tag: str) -> bool:
    """Whether the process that made these nodes still runs (another kernel's, another user's
    HPDL_HOME: not ours to sweep); False when unknown."""
    try:
        owner = procs.Proc.from_dict(json.loads((OWNERS / f"{tag}.json").read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return False
    return procs.is_alive(owner)


def sweep(keep: set[str] = frozenset(), end_processes: Callable[[list[int]], None] | None = None,
          *, even_if_owned: bool = False) -> list[str]:
    """Remove every emulated node of the kit whose tag is not in `keep` and whose maker is gone
    (`hpdl cleanup`, a test's end), ending what still runs in them through `end_processes`;
    returns the tags removed. `even_if_owned`: also those whose maker runs (a test's own)."""
    names = leftovers() + (os.listdir(NETNS_ETC) if NETNS_ETC.is_dir() else [])
    tags = {tag for tag in _tagged(names).values() if tag not in keep and (even_if_owned or not _owner_alive(tag))}
    found = {name: tag for name, tag in _tagged(names).items() if tag in tags}
    _remove_names(sorted(found, key=lambda name: not name.startswith(PREFIX)), end_processes)
    for tag in tags:
        (OWNERS / f"{tag}.json").unlink(missing_ok=True)
    return sorted(set(found.values()))
