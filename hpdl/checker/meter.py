"""Caller's side: the bytes each learner rank put on the wire, counted by the kernel.

The recorder (recording.py) lives in the learner's process, so a learner can rewrite what it
noted. For the exercises whose verdict rests on which messages a rank sent (METERED in the case
module: the allreduce and broadcast algorithms by hand), the learner's ranks talk over TCP on
loopback instead of shared memory (OVER_TCP), and this module, in the checker's process, reads the kernel's
counters of every connection they hold: `ss -tin` inside the sandbox's network namespace
(entered with nsenter), each socket mapped to the rank process that holds it (/proc/PID/fd) and
to the rank at its other end. No code in the learner's process can lower those counters; the
deciding side compares them with what the recorder says (hooks.wire_agrees).

The learner's ranks wait at the start (after every rank reported its pid, before the learner's
code is unpacked) and after each case until this side has read the counters (`release`), so a
case's window holds that case's messages. MPICH (built with libfabric), Open MPI and Intel MPI
are metered; with another MPI, or without ss/nsenter, checks decide on the recorder alone.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass

#: environment that makes each MPI's ranks on one node talk over TCP on loopback, not shared memory
OVER_TCP = {
    "MPICH": {"MPICH_NOLOCAL": "1", "MPICH_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"},  # libfabric's tcp
    "Open MPI": {"OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "tcp,self", "OMPI_MCA_btl_tcp_if_include": "lo"},
    # and its collectives too: by default they share memory between a node's ranks whatever the fabric
    "Intel MPI": {"I_MPI_FABRICS": "ofi", "FI_PROVIDER": "tcp", "I_MPI_COLL_INTRANODE": "pt2pt"},
}
# and, for ranks that share no memory (isolate.py): Open MPI's PMIx client then takes the job's data by
# message, not from its server's shared-memory segment. Intel MPI's start-up maps one segment for a
# node's ranks whatever the fabric (MPIDU_Init_shm_init): its ranks each start on a node of their own
# (launchers.nodes_apart, runner.job_launch), where a rank alone on its node polls without pause: with more
# ranks than cores the spinning ranks kept the core from the one whose message had come (13.5 ms a Sendrecv of
# 256 values at 4 ranks on 2 cores, 0.05 ms in wait mode: benchmarks/apart_latency.py)
APART = {"MPICH": {}, "Open MPI": {"PMIX_MCA_gds": "hash"}, "Intel MPI": {"I_MPI_WAIT_MODE": "1"}}
SS_TIMEOUT = 10.0  # s
# readings again, SETTLE_SECONDS apart, while the kernel counts connections no listing showed yet: one being
# made when the ranks stopped (SYN sent, or not yet accepted) shows a moment later; one closed never does
SETTLE_READINGS, SETTLE_SECONDS = 20, 0.05
NS_GET_USERNS = 0xB701  # ioctl on a namespace's file: a new descriptor of the user namespace that owns it


def transport_env(implementation: str, version: str = "") -> dict[str, str] | None:
    """The variables that put this MPI's ranks on TCP, or None where the kit cannot meter them:
    MPICH built with libfabric (its mpiexec's --version shows `--with-device=ch4:...ofi`), Open
    MPI, Intel MPI; and ss and nsenter on PATH. (Should the ranks still not talk over TCP, Meter
    says so at start-up and the check decides on the recorder alone.)"""
    if not (shutil.which("ss") and shutil.which("nsenter")):
        return None
    return _over_tcp(implementation, version)


def _over_tcp(implementation: str, version: str) -> dict[str, str] | None:
    device = re.search(r"--with-device=(\S+)", version)
    if implementation == "MPICH" and not (device and "ofi" in device.group(1)):
        return None
    return dict(OVER_TCP[implementation]) if implementation in OVER_TCP else None


def tcp_transport() -> dict[str, str] | None:
    """The variables that put this node's ranks on TCP whether or not the wire can be read, for ranks
    that share no memory (an isolated learner job's, isolate.py); None where this MPI cannot run so."""
    from hpdl.launchers.mpiexec import mpiexec_implementation, mpiexec_version

    try:
        which = mpiexec_implementation()
        env = _over_tcp(which, mpiexec_version())
    except Exception:  # no local mpiexec: the check's jobs go through the batch system
        return None
    return None if env is None or which not in APART else {**env, **APART[which]}


def node_transport(library: dict[str, dict[str, str]] | None = None) -> tuple[dict[str, str] | None, str | None]:
    """This node's check jobs: the variables that put a learner job's ranks on TCP (with this MPI's of
    `library`, a case module's LIBRARY_ALGORITHMS), or None and why not (for a check's note and the
    grading report)."""
    from hpdl.launchers.mpiexec import mpiexec_implementation, mpiexec_version

    try:
        which, version = mpiexec_implementation(), mpiexec_version()
    except Exception as exc:  # no local mpiexec (Cray MPICH): the check's jobs go through the batch system
        return None, f"no local mpiexec: {str(exc).splitlines()[0]}"
    env = transport_env(which, version)
    if env is None:
        return None, f"that needs ss and nsenter, and MPICH built with libfabric, Open MPI or Intel MPI; here {which}"
    return {**env, **(library or {}).get(which, {})}, None


def unavailable() -> str | None:
    """Why this node's checks cannot count what learner ranks send (None: they can), for a report."""
    return node_transport()[1]


def implementation() -> str:
    """The learner ranks' MPI, as its mpiexec names it ("MPICH", "Open MPI", ...; "" where unknown): what an MPI
    adds on the wire besides the learner's messages differs (hooks.WIRE_PER_COMMUNICATOR)."""
    from hpdl.launchers.mpiexec import mpiexec_implementation

    try:
        return mpiexec_implementation()
    except Exception:
        return ""


def closed_counted() -> bool:
    """Whether this node's learner ranks keep every connection they make during a case, so that one opened
    and closed between two readings is the learner's (Meter's `closed`): MPICH's and Open MPI's do; Intel
    MPI's ranks opened and closed two of their own in a case of overlap_allreduce, so there only UDP counts."""
    which = implementation()
    return bool(which) and which != "Intel MPI"


def host_pid(sandbox_pid: int, candidates: list[int]) -> int | None:
    """The pid, as this process sees it, of the process that is `sandbox_pid` in the sandbox's PID
    namespace (the kernel's NSpid line, which the learner cannot change: this process's pid first, then
    the sandbox's, then, for an isolated rank (isolate.py), 1 in its own; outside a sandbox, the first)."""
    for pid in candidates:
        try:
            with open(f"/proc/{pid}/status") as f:
                line = next((x for x in f if x.startswith("NSpid:")), "")
        except OSError:
            continue
        ids = [int(x) for x in line.split()[1:]]
        if ids and ids[min(1, len(ids) - 1)] == sandbox_pid:
            return pid
    return None


@dataclass
class Connection:
    inode: int
    local: str
    peer: str
    sent: int = 0  # bytes this end sent, retransmissions included
    received: int = 0  # bytes this end received, each once: what the other end sent
    data_segs_in: int = 0  # TCP segments that brought data to this end: about one per message sent to it


_STATES = "ESTAB|FIN-WAIT-1|FIN-WAIT-2|CLOSE-WAIT|LAST-ACK|CLOSING"  # a connection, not a listener
_HEADER = re.compile(rf"^(?:{_STATES})\s+\d+\s+\d+\s+(\S+)\s+(\S+).*\bino:(\d+)")
_COUNTS = re.compile(r"\b(bytes_sent|bytes_received|data_segs_in):(\d+)")


def connections(pid: int) -> dict[int | tuple[str, str], Connection]:
    """Every TCP connection in `pid`'s network namespace, by socket inode, with its bytes sent; one not yet
    accepted (no socket, inode 0) by its two ends."""
    cmd = ["ss", "-tinHe"]
    net = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    fds = [net]
    try:
        if os.readlink(f"/proc/{pid}/ns/net") != os.readlink("/proc/self/ns/net"):
            # the namespace's owner: the sandbox's outer user namespace, which we own (the rank itself may
            # sit in a nested one that has no rights over the network)
            owner = fcntl.ioctl(net, NS_GET_USERNS)
            fds.append(owner)
            enter = ["nsenter", f"--net=/proc/self/fd/{net}"]
            if os.readlink(f"/proc/self/fd/{owner}") != os.readlink("/proc/self/ns/user"):
                enter[1:1] = [f"--user=/proc/self/fd/{owner}", "--preserve-credentials"]
            cmd = [*enter, *cmd]
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=SS_TIMEOUT, check=True,
                             pass_fds=fds).stdout
    finally:
        for fd in fds:
            os.close(fd)
    found: dict[int | tuple[str, str], Connection] = {}
    current: Connection | None = None
    for line in out.splitlines():
        head = _HEADER.match(line)
        if not line[:1].isspace():
            current = None
        if head:
            current = Connection(int(head.group(3)), head.group(1), head.group(2))
            found[current.inode or (current.local, current.peer)] = current
        elif current is not None:
            for kind, value in _COUNTS.findall(line):
                setattr(current, kind.removeprefix("bytes_"), int(value))
    return found


def opened(pid: int) -> tuple[int, int]:
    """The kernel's counts for `pid`'s network namespace so far: (TCP connection ends established,
    ActiveOpens + PassiveOpens − AttemptFails: a connection opened and closed between two readings is counted
    here and listed nowhere in ss; UDP datagrams sent over IPv4 and IPv6). A rank may open a UDP socket (Open
    MPI asks one for the list of interfaces), not send on it."""
    with open(f"/proc/{pid}/net/snmp") as f:
        rows = [line.split() for line in f if line.startswith(("Tcp:", "Udp:"))]
    counts = {f"{head[0]}{k}": int(v) for head, values in zip(rows[::2], rows[1::2])
              for k, v in zip(head[1:], values[1:])}
    try:
        with open(f"/proc/{pid}/net/snmp6") as f:
            counts.update((k, int(v)) for k, v in (line.split()[:2] for line in f if line.strip()))
    except OSError:  # no IPv6 here
        pass
    tcp = counts["Tcp:ActiveOpens"] + counts["Tcp:PassiveOpens"] - counts["Tcp:AttemptFails"]
    return tcp, counts["Udp:OutDatagrams"] + counts.get("Udp6OutDatagrams", 0)


def socket_inodes(pid: int | str) -> set[int]:
    """The sockets a process holds open ("self": this one)."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


class Meter:
    """The bytes each rank sent to each other rank since the last reading, from the kernel.

    Counted at the receiving end (bytes received, each byte once, as TCP delivered it; bytes sent
    count retransmissions too): what rank q received on its connection with rank r is what r sent
    q. Connections whose other end is no rank count under "?": bytes a rank sent there, and, as
    "from ?", bytes it received from there (a helper process relaying data).

    Messages are counted too, as the data segments that reached each rank from the others (on
    loopback, one per message sent, whatever its size up to 64 KiB), apart for the connections
    each rank opened in its case module's set_up() (`grouped`: torch.distributed's, say) and for
    all the others (MPI's): how many all-reduces a case ran shows there (hooks.allreduces_on_wire).

    A connection opened and closed between two readings is in no listing: the kernel's count of the
    connections established in the namespace (opened()), against the connections ever listed, shows it;
    a UDP datagram shows in the kernel's count of them ("unseen", job-wide: every rank's row)."""

    def __init__(self, pids: dict[int, int], grouped: dict[int, set[int]] | None = None, closed: bool = True):
        self.pids = dict(pids)  # rank -> pid as this process sees it
        self.mpi = implementation()  # every reading names it: row["mpi"]
        self.closed = closed  # count connections opened and closed unseen (not under Intel MPI: closed_counted)
        self.grouped = {r: set(inodes) for r, inodes in (grouped or {}).items()}  # rank -> its set_up's sockets
        self.listed: set[tuple[str, str]] = set()  # every connection end ever listed, by its two addresses
        self.last = self._read()  # socket inode -> (rank, sent, received, segments in) at the last reading
        self.opened_at_start, self.listed_at_start = self.opened, set(self.listed)  # the kernel's counts then
        ends = {c.local for c in self.held}
        talking = {self.last[c.inode][0] for c in self.held if c.peer in ends}
        if talking != set(self.pids):  # the communicators made at start-up connect every rank
            raise ValueError(f"ranks {sorted(set(self.pids) - talking)} hold no TCP connection: this MPI's ranks "
                             "do not talk over TCP here, so their bytes cannot be counted")

    def _read(self) -> dict[int, tuple[int, int, int, int]]:
        owner: dict[int, int] = {}  # socket inode -> rank
        for rank, pid in self.pids.items():
            for inode in socket_inodes(pid):
                owner.setdefault(inode, rank)
        pid = next(iter(self.pids.values()))
        self.opened = opened(pid)  # before the listing: what it counts is listed, unless closed already
        found = connections(pid)
        self.listed |= {(c.local, c.peer) for c in found.values()}  # accepted or not
        self.held = [c for c in found.values() if c.inode in owner]
        return {c.inode: (owner[c.inode], c.sent, c.received, c.data_segs_in) for c in self.held}

    def take(self) -> dict[str, dict]:
        """{rank: {peer rank, "?", "from ?", "closed" or "received": bytes, "all segments": {"set_up" or
        "other": data segments every rank received from the other ranks}}} since the last reading; "closed"
        counts connections of the rank that went away in between (their last bytes were not seen), "received"
        the bytes the other ranks sent it."""
        now = self._read()
        for _ in range(SETTLE_READINGS):  # a connection still being made (SYN sent) is in no listing yet
            if self._unseen() <= 0:
                break
            time.sleep(SETTLE_SECONDS)
            now = self._read()
        by_endpoint = {c.local: now[c.inode][0] for c in self.held}
        sent: dict[str, dict] = {str(r): {} for r in self.pids}
        segments = {"set_up": 0, "other": 0}  # over every rank: how many all-reduces ran is the job's

        def add(rank: int, key: str, n: int) -> None:
            if n > 0:
                sent[str(rank)][key] = sent[str(rank)].get(key, 0) + n

        for c in self.held:
            holder = now[c.inode][0]
            _, was_sent, was_received, was_segments = self.last.get(c.inode, (0, 0, 0, 0))
            other = by_endpoint.get(c.peer)
            if other is None:
                add(holder, "?", c.sent - was_sent)
                add(holder, "from ?", c.received - was_received)
            else:
                add(other, str(holder), c.received - was_received)
                kind = "set_up" if c.inode in self.grouped.get(holder, ()) else "other"
                segments[kind] += max(0, c.data_segs_in - was_segments)
        for inode in set(self.last) - set(now):
            add(self.last[inode][0], "closed", 1)
        unseen = self._unseen()
        for r in self.pids:  # what reached each rank from the other ranks
            sent[str(r)]["received"] = sum(row.get(str(r), 0) for q, row in sent.items() if q != str(r))
            sent[str(r)]["all segments"] = segments
            if unseen > 0:
                sent[str(r)]["unseen"] = unseen
        self.last = now
        return sent

    def _unseen(self) -> int:
        """Connection ends established and datagrams sent since the start that no listing showed."""
        connections, datagrams = (now - start for now, start in zip(self.opened, self.opened_at_start))
        return (connections - len(self.listed - self.listed_at_start) if self.closed else 0) + datagrams

    def peek(self) -> dict[str, dict]:
        """What take() would return now, the window left open (the next take() counts from the same reading)."""
        last = self.last
        try:
            return self.take()
        finally:
            self.last = last


def released(tag: str) -> str:
    """The file that lets the learner's ranks go on past the point `tag` (learner_job waits for it in
    each rank's folder; jobs.Job.release writes it there)."""
    return f"metered-{tag}"
