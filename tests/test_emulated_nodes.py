"""Ranks on emulated nodes (hpdl/emulated.py): network namespaces joined by rate-limited links.

Real namespaces, real MPI ranks, real Gloo: the ranks must sit on two hosts, agree on lesson
00's all-reduces, really send their bytes over the limited link, report a hang across nodes
with rank and line, and leave no namespace, link or process after a stop, an error or a
killed kernel."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

import hpdl
from hpdl import emulated, reaper
from hpdl.errors import HpdlError, RankHang

from test_cluster import _kernel_with_cluster, run, wait_gone
from test_cluster import ip  # noqa: F401  (a fixture)

needs_root = pytest.mark.skipif(os.geteuid() != 0 or emulated.missing() is not None,
                                reason=f"the host's bridge needs root: {emulated.missing() or 'not root'}")
FRAMEWORKS = ("torch", "horovod") if importlib.util.find_spec("horovod") else ("torch",)

ALLREDUCES = textwrap.dedent("""
    import socket, torch
    from mpi4py import MPI
    x = torch.tensor([rank + 1.0, 10.0 * rank])
    a = x.clone(); comm.Allreduce(MPI.IN_PLACE, a.numpy(), op=MPI.SUM)
    b = x.clone(); dist.all_reduce(b)
    h = hvd.allreduce(x, op=hvd.Sum).tolist() if 'hvd' in globals() else b.tolist()
    big = torch.ones(1 << 20); comm.Allreduce(MPI.IN_PLACE, big.numpy(), op=MPI.SUM)  # 4 MiB
    out = (a.tolist(), b.tolist(), h, big[0].item(), socket.gethostname())
""")


def _sent_bytes(link: str) -> int:
    """Bytes the token bucket on `link` (the host's end: traffic into that node) let through."""
    text = subprocess.run(["tc", "-s", "qdisc", "show", "dev", link], capture_output=True, text=True).stdout
    return int(text.split("Sent ")[1].split()[0])


@pytest.fixture
def no_leftovers():
    """Fail a test that leaves the kit's namespaces or links behind (and remove them)."""
    before = set(emulated.leftovers())
    yield
    left = sorted(set(emulated.leftovers()) - before)
    if left:
        emulated.sweep(end_processes=reaper.end_pids, even_if_owned=True)
    assert not left, f"emulated nodes left behind: {left}"


@needs_root
def test_ranks_on_two_nodes_agree_and_cross_the_link(no_strays, no_leftovers):
    c = hpdl.start(n=4, nodes=2, link="1gbit", frameworks=FRAMEWORKS, quiet=True)
    try:
        net = c.network
        assert net.ranks_per_node == [2, 2] and sorted(emulated.leftovers({net.tag})) == sorted(
            [*net.namespaces, *net.links, net.bridge])
        into_node1 = _sent_bytes(net.links[1])
        hpdl.view().execute(ALLREDUCES, block=True)
        outs = hpdl.view().pull("out", block=True)
        crossed = _sent_bytes(net.links[1]) - into_node1
    finally:
        hpdl.stop(quiet=True)
    assert [o[4] for o in outs] == ["node0", "node0", "node1", "node1"]
    assert [r["host"] for r in c.ranks] == ["node0", "node0", "node1", "node1"]
    for a, b, h, big, _ in outs:
        assert a == b == h == [10.0, 60.0]
        assert big == 4.0
    # a ring or tree all-reduce of 4 MiB moves at least half of it into each node: over the link,
    # not through memory the "nodes" share
    assert crossed > 2 * 2**20, f"only {crossed} bytes crossed into node1"
    assert emulated.leftovers({net.tag}) == []


@needs_root
def test_a_hang_across_nodes_names_rank_and_line(ip, no_strays, no_leftovers):  # noqa: F811  (ip: the fixture)
    hpdl.start(n=4, nodes=2, link="200mbit", frameworks=(), quiet=True)
    try:
        res = run(ip, "%%px --timeout 3\nimport numpy as np\nbuf = np.zeros(1)\n"
                      "if rank == 0:\n    comm.Recv(buf, source=3)\nx = 1")
        err = res.error_in_exec
        assert isinstance(err, RankHang), err
        assert "stuck:    rank 0 at line 4 of the cell: comm.Recv(buf, source=3)" in str(err), str(err)
        assert "finished: ranks 1–3" in str(err) or "finished: ranks 1, 2, 3" in str(err), str(err)
    finally:
        hpdl.stop(quiet=True)


@needs_root
def test_an_error_in_the_with_block_removes_the_nodes(no_strays, no_leftovers):
    with pytest.raises(ZeroDivisionError):
        with hpdl.start(n=2, nodes=2, link="1gbit", frameworks=(), quiet=True) as c:
            assert hpdl.view().apply_sync(socket.gethostname) == ["node0", "node1"]
            1 / 0
    assert c.stopped and emulated.leftovers({c.network.tag}) == []


@needs_root
def test_a_killed_kernel_leaves_no_node_or_process(no_strays, no_leftovers):
    code = ("import hpdl, json\nc = hpdl.start(n=2, nodes=2, frameworks=(), quiet=True)\n"
            "print(json.dumps(sorted(c.engine_pids().values()) + [c.ipp.controller.pid]))\n"
            "print('TAG', c.network.tag)")
    runs = Path(os.environ["HPDL_HOME"], "runs")
    before = set(runs.glob("*"))
    km, kc, pids = _kernel_with_cluster(code)
    try:
        assert len(pids) == 3
        run_dirs = set(runs.glob("*")) - before
        assert len(run_dirs) == 1 and all((d / "node-exec.sh").exists() for d in run_dirs)
        tags = {n.split("-")[1] for n in emulated.leftovers() if n.startswith(emulated.PREFIX)}
        os.kill(km.provisioner.pid, signal.SIGKILL)  # no exit handlers run; the reaper acts
        assert wait_gone(pids, timeout=20) == []
        deadline = time.monotonic() + 20  # the reaper removes the nodes, then the folder, after the processes
        while (emulated.leftovers(tags) or any(d.exists() for d in run_dirs)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert tags and emulated.leftovers(tags) == []
        assert not any(d.exists() for d in run_dirs), "the killed kernel's run folder was left"
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


# what each rank's node sent over its link: its end of the veth pair, counted inside the node
SENT = "sent = lambda: int(open('/sys/class/net/eth0/statistics/tx_bytes').read())\nbefore = sent()\n"
# (the node's own /sys: /proc/net/dev would say the same, whatever is mounted there)
USERNS_RUN = textwrap.dedent("""
    import json, os, signal, sys, time
    import hpdl
    c = hpdl.start(n=4, nodes=2, link="200mbit", frameworks=("torch",), quiet=True)
    hpdl.view().execute(SENT + ALLREDUCES + "crossed = sent() - before", block=True)
    outs, crossed = hpdl.view().pull("out", block=True), hpdl.view().pull("crossed", block=True)
    status = hpdl.status()
    run_dir = str(c.run_dir)
    hpdl.stop(quiet=True)
    killed = hpdl.start(n=2, nodes=2, frameworks=(), quiet=True)
    pids = sorted(killed.engine_pids().values())
    print(json.dumps({"outs": outs, "crossed": crossed, "userns": c.network.userns, "status": status,
                      "run_dir": run_dir, "killed_run_dir": str(killed.run_dir), "pids": pids}), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # a killed kernel: no exit handlers; the reaper acts
""")


@pytest.mark.skipif(os.geteuid() != 0, reason="becomes another account (nobody) to be unprivileged")
def test_without_root_the_nodes_live_in_a_user_namespace(no_strays, no_leftovers):
    """An account without root (nobody) starts ranks on 2 emulated nodes in a user namespace of its
    own: lesson 00's all-reduces agree across them (MPI and Gloo), each node's link carries its
    bytes, and after a stop, and after a killed kernel, none of its processes is left, nor any
    namespace, link or run folder on the host."""
    from test_shared_kit import learners_venv

    venv = learners_venv()
    home = tempfile.mkdtemp(prefix="hpdl-userns-")
    os.chmod(home, 0o777)
    try:
        script = Path(home) / "run.py"
        script.write_text(f"SENT = {SENT!r}\nALLREDUCES = {ALLREDUCES!r}\n" + USERNS_RUN)
        env = {"PATH": f"{venv}/bin:/usr/bin:/bin", "HOME": home, "HPDL_HOME": f"{home}/h", "IPP_NONINTERACTIVE": "1"}
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                            str(venv / "bin" / "python"), str(script)], env=env, cwd=home, capture_output=True,
                           text=True, timeout=180)
        lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
        assert lines, p.stdout[-2000:] + p.stderr[-3000:]
        got = json.loads(lines[-1])
        assert got["userns"] and got["status"]["nodes"]["ranks_per_node"] == [2, 2]
        for a, b, h, big, host in got["outs"]:
            assert a == b == h == [10.0, 60.0] and big == 4.0
        assert [o[4] for o in got["outs"]] == ["node0", "node0", "node1", "node1"]
        # a 4 MiB all-reduce sends at least half of it out of each node, over its link
        assert all(c > 2 * 2**20 for c in got["crossed"]), got["crossed"]
        assert wait_gone(got["pids"], timeout=20) == [], "the killed kernel's ranks outlived it"
        deadline = time.monotonic() + 20  # the reaper ends the controller and the launcher after the ranks
        while (left := subprocess.run(["pgrep", "-u", "nobody"], capture_output=True, text=True).stdout.split()) \
                and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"processes of the account left: {left}"
        assert not Path(got["run_dir"]).exists()
        assert not Path(got["killed_run_dir"]).exists(), "the killed kernel's run folder (sockets, nodes) was left"
    finally:
        shutil.rmtree(home, ignore_errors=True)


@pytest.mark.parametrize("kwargs, words", [
    ({"n": 2, "nodes": 3}, "every node needs a rank"),
    ({"n": 2, "nodes": 0}, "whole number"),
    ({"n": 2, "nodes": 2, "link": "fast"}, "link='fast' is not a rate"),
    ({"n": 2, "nodes": 2, "link": "-1gbit"}, "is not a rate"),
])
def test_bad_layouts_are_refused_before_anything_starts(kwargs, words):
    with pytest.raises(HpdlError, match=words):
        hpdl.start(quiet=True, **kwargs)
    assert hpdl.status() == {"running": False}


def test_rates_read_as_tc_writes_them():
    assert emulated.link_bits_per_second("1gbit") == 1e9
    assert emulated.link_bits_per_second("200Mbit") == 2e8
    assert emulated.link_bits_per_second("50mbps") == 4e8
    assert emulated.link_bits_per_second(1e6) == 1e6
    assert emulated.placement(5, 2) == [3, 2]


def test_horovod_across_nodes_keeps_intel_mpis_collectives_off_the_shared_memory_step():
    """Intel MPI's hierarchical collectives deadlock between Horovod's thread and a cell's collective
    across nodes (lifecycle.HOROVOD_ACROSS_NODES_ENV; shown on real ranks by the test above under
    `make test-mpi MPI=impi`). Ranks that may span nodes with Horovod get the setting; one node, or
    no Horovod, keeps Intel MPI's defaults; a learner's own env= wins."""
    from hpdl.cluster import lifecycle

    key, value = next(iter(lifecycle.HOROVOD_ACROSS_NODES_ENV.items()))
    assert lifecycle._rank_env("local", ("torch", "horovod"), {}, across_nodes=True)[key] == value
    assert lifecycle._rank_env("slurm", ("torch", "horovod"), {}, across_nodes=False)[key] == value
    assert key not in lifecycle._rank_env("local", ("torch", "horovod"), {}, across_nodes=False)
    assert key not in lifecycle._rank_env("local", ("torch",), {}, across_nodes=True)
    assert lifecycle._rank_env("local", ("horovod",), {key: "shm"}, across_nodes=True)[key] == "shm"


def test_an_mpiexec_the_kit_does_not_start_on_nodes_is_refused_with_what_to_use(tmp_path):
    """MPICH's, Open MPI's and Intel MPI's launchers start on emulated nodes, known from their
    `--version` text (as each prints it); any other MPI is refused before any namespace is made."""
    kit = shutil.which("mpiexec", path=os.path.dirname(sys.executable))
    assert emulated.require_launcher(kit) in emulated.LAUNCHES
    for name, text in [("Open MPI", "mpiexec (Open MPI) 5.0.7"), ("Intel MPI", "Intel(R) MPI Library for Linux"),
                       ("Cray MPICH", "MPICH Version: 8.1.28 CRAY MPICH"), (None, "some mpirun 1.0")]:
        other = tmp_path / (name or "other").replace(" ", "")
        other.write_text(f"#!/bin/sh\necho '{text}'\n")
        other.chmod(0o755)
        if name in emulated.LAUNCHES:
            assert emulated.require_launcher(str(other)) == name
            continue
        with pytest.raises(HpdlError, match=f"is {name or 'an MPI the kit does not recognise'}, which the kit "
                                            "does not start on emulated nodes"):
            emulated.require_launcher(str(other))


def test_without_root_or_user_namespaces_the_message_says_what_is_missing(tmp_path, monkeypatch):
    """As an unprivileged user whose kernel refuses user namespaces no namespace can be made: a
    clear message, not a traceback."""
    if os.geteuid() != 0:
        monkeypatch.setattr(emulated.emulated_userns, "works", lambda: False)  # what such a kernel answers
        problem = emulated.missing()
    else:
        code = ("from hpdl import emulated, emulated_userns\n"
                "emulated_userns.works = lambda: False  # what such a kernel answers\n"
                "print(emulated.missing())")
        p = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                           capture_output=True, text=True, env={**os.environ, "HPDL_HOME": str(tmp_path)},
                           cwd="/", timeout=60)
        assert p.returncode == 0, p.stderr
        problem = p.stdout
    assert "needs root" in problem and "user namespaces" in problem and "without nodes=" in problem


def test_a_sweep_recognises_only_the_kits_names():
    names = ["hpdl-0a1b2c-n0", "hpv-0a1b2c-1", "hpb-0a1b2c", "hpdl-12-abcdef", "eth0", "hpb-xyz"]
    assert emulated._tagged(names) == {"hpdl-0a1b2c-n0": "0a1b2c", "hpv-0a1b2c-1": "0a1b2c", "hpb-0a1b2c": "0a1b2c"}
    net = emulated.Network("0a1b2c", "10.231.3.0/24", [2, 2], "1gbit")
    assert emulated.Network.from_dict(json.loads(json.dumps(net.to_dict()))) == net
    assert net.namespaces == ["hpdl-0a1b2c-n0", "hpdl-0a1b2c-n1"] and net.bridge_address == "10.231.3.254"


@needs_root
def test_the_benchmark_prints_its_claims(no_strays, no_leftovers):
    """benchmarks/emulated_nodes.py once, quickly: its lines, not its numbers (the machine is shared)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cmd = [sys.executable, "benchmarks/emulated_nodes.py", "--rates", "1gbit", "--sizes-mib", "0.25", "4",
           "--iters", "2", "--rounds", "1"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=root)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lines = done.stdout.strip().splitlines()
    number = r"[-+]?\d+(?:\.\d+)?"
    assert re.fullmatch(rf"max \|busbw / link - 1\| = {number} %", lines[-1]), lines[-1]
    assert any(re.match(rf"\s+1gbit\s+4 MiB: busbw\s+{number}\s+link\s+125.0", s) for s in lines), lines
    assert any(re.match(rf"\s+measured / predicted ratio - 1 = {number} %", s) for s in lines), lines


@needs_root
def test_a_tuning_sweep_runs_across_the_nodes(monkeypatch, no_strays, no_leftovers):
    """hpdl.tune.sweep_algorithm(nodes=2) (lesson 07's section 4): the sweep's ranks sit on two
    emulated nodes, and a ring all-reduce of 4 MiB over 4 ranks sends its 1.5 × 4 MiB into node1
    through the link (the host's token bucket counts it), and the nodes are gone after."""
    import hpdl.tune

    seen = {}
    remove = emulated.remove

    def counted_remove(state, *args, **kwargs):  # the bytes the link let into node1, before it goes
        net = emulated.Network.from_dict(state)
        seen[net.tag] = _sent_bytes(net.links[1])
        return remove(state, *args, **kwargs)

    monkeypatch.setattr(emulated, "remove", counted_remove)
    got = hpdl.tune.sweep_algorithm("ring", ranks=4, sizes=[4 << 20], budget=0.01, nodes=2, link="1gbit")
    assert got["name"] == "ring" and got["ranks"] == 4 and len(got["seconds"]) == 1
    assert len(seen) == 1 and min(seen.values()) >= 1.5 * (4 << 20), seen
    assert emulated.leftovers(set(seen)) == []


@needs_root
def test_one_job_on_emulated_nodes_from_the_shell(no_strays, no_leftovers):
    """`python -m hpdl.emulated_job`: a script's own MPI job on the nodes, which go with it."""
    code = ("from mpi4py import MPI; import socket; c = MPI.COMM_WORLD; "
            "print(f'RANK {c.rank} {socket.gethostname()} {c.allreduce(c.rank + 1)} END', flush=True)")
    done = subprocess.run([sys.executable, "-m", "hpdl.emulated_job", "--nodes", "2", "--link", "200mbit", "-n", "3",
                           "--timeout", "120", sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    # Hydra forwards each node's output in chunks of its own: lines of two nodes may run together
    got = sorted(list(m) for m in re.findall(r"RANK (\d+) (\S+) (\d+) END", done.stdout))
    assert got == [["0", "node0", "6"], ["1", "node0", "6"], ["2", "node1", "6"]]
    bad = subprocess.run([sys.executable, "-m", "hpdl.emulated_job", "--link", "fast", "true"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "is not a rate" in bad.stderr


def test_the_layout_can_come_from_the_environment_or_a_site_profile(monkeypatch, tmp_path, capsys):
    """HPDL_NODES and HPDL_LINK stand in for nodes= and link= (a lesson's default), and a site
    profile's [emulated] table for both (cluster/sites/emulated-2x2.toml: "2 nodes × 2 ranks,
    1 Gbit/s"); an argument beats the environment, which beats the profile."""
    from hpdl import sites
    from hpdl.cluster import lifecycle

    monkeypatch.setenv("HPDL_NODES", "3")
    with pytest.raises(HpdlError, match="nodes=3 but only n=2"):
        hpdl.start(n=2, quiet=True)
    monkeypatch.setenv("HPDL_NODES", "2")
    monkeypatch.setenv("HPDL_LINK", "fast")
    with pytest.raises(HpdlError, match="link='fast' is not a rate"):
        hpdl.start(n=2, quiet=True)
    assert hpdl.status() == {"running": False}

    monkeypatch.setattr(lifecycle, "nodes_missing", lambda: None)  # the layout alone, wherever this runs
    monkeypatch.delenv("HPDL_NODES")
    monkeypatch.delenv("HPDL_LINK")
    monkeypatch.setenv("HPDL_SITE", "emulated-2x2")
    assert lifecycle._check_nodes(4, "local", None, None) == (2, "1gbit")
    assert sites.main([]) == 0 and "emulated nodes (hpdl.start on this machine): 2, joined by 1gbit links" \
        in capsys.readouterr().out
    assert lifecycle._check_nodes(4, "local", 4, "200mbit") == (4, "200mbit")
    monkeypatch.setenv("HPDL_LINK", "200mbit")
    assert lifecycle._check_nodes(4, "local", None, None) == (2, "200mbit")
    monkeypatch.setenv("HPDL_NODES", "1")
    assert lifecycle._check_nodes(4, "local", None, None) == (1, "200mbit")
    for table, words in [("nodes = 2\nlink = 5", "emulated.link must be a string"),
                         ("nodes = 99", "between 1 and 64"), ("racks = 2", "unknown key emulated.racks")]:
        bad = tmp_path / "site.toml"
        bad.write_text(f"[emulated]\n{table}\n")
        monkeypatch.setenv("HPDL_SITE", str(bad))
        monkeypatch.delenv("HPDL_NODES")
        with pytest.raises(HpdlError, match=words):
            lifecycle._check_nodes(4, "local", None, None)
        monkeypatch.setenv("HPDL_NODES", "1")


@needs_root
def test_hpdl_cleanup_removes_nodes_no_cluster_owns_with_what_runs_in_them(tmp_path, capsys, no_leftovers):
    """What a crash leaves (nodes whose maker died, a process still inside one) goes with
    `hpdl cleanup`; nodes whose maker still runs stay."""
    from hpdl.cluster import cleanup

    make = ("import json, sys; from pathlib import Path; from hpdl import emulated; "
            "print(json.dumps(emulated.create(2, 2, '1gbit', Path(sys.argv[1])).to_dict()))")
    made = subprocess.run([sys.executable, "-c", make, str(tmp_path)], capture_output=True, text=True, timeout=60)
    assert made.returncode == 0, made.stderr
    net = emulated.Network.from_dict(json.loads(made.stdout))
    mine = emulated.create(2, 2, "1gbit", tmp_path)  # this process made them: still alive
    inside = subprocess.Popen(["ip", "netns", "exec", net.namespaces[1], "sleep", "60"])
    try:
        assert cleanup.main([]) == 0
        assert "removed 1 set(s) of emulated nodes" in capsys.readouterr().out
        assert inside.wait(timeout=10) != 0  # ended, not finished
        assert emulated.leftovers({net.tag}) == [] and not (emulated.NETNS_ETC / net.namespaces[0]).exists()
        assert len(emulated.leftovers({mine.tag})) == 5
    finally:
        inside.kill()
        inside.wait()
        emulated.remove(mine.to_dict())
