"""A private Slurm over emulated nodes (hpdl/emulated_slurm.py): one slurmd per node, so the kit's
multi-node Slurm paths cross a real, rate-limited network on one machine.

Real slurmctld and slurmd, real MPI ranks, real ipyparallel engines: `srun -N2` places tasks on
both nodes, preflight's across-node row measures the link that was set (not shared memory), the
kit's Slurm launcher starts engines on both nodes whose MPI and Gloo all-reduces agree while a
check's sandboxed job still runs on the login node, and nothing — daemon, namespace, job — is
left when the block ends."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest
from test_emulated_nodes import needs_root, no_leftovers  # noqa: F401  (a fixture)
from test_slurm import slurm  # noqa: F401  (the local Slurm: it starts munged)

from hpdl import emulated_slurm

ROOT = Path(__file__).resolve().parents[1]
LINK_BYTES_PER_S = 200e6 / 8  # "200mbit"
KIT_RANKS = textwrap.dedent("""
    import json, sys
    import hpdl
    hpdl.start(n=4, launcher="slurm", frameworks=("torch",), quiet=True)
    try:
        v = hpdl.view()
        v.execute("import socket; host = socket.gethostname(); s = comm.allreduce(rank + 1); "
                  "t = torch.tensor([rank + 1.0]); dist.all_reduce(t); ts = t.item()", block=True)
        pulled = [v.pull(k, block=True) for k in ("host", "s", "ts")]
        sys.path.insert(0, sys.argv[1])
        import learner_ring  # a right ring: the check's own local job, sandboxed, must run beside the nodes
        result = hpdl.check("ring_allreduce", learner_ring.ring_ok, ranks=[2], timeout=60)
        print(json.dumps([*pulled, sorted(set(result.verdicts.values()))]))
    finally:
        hpdl.stop(quiet=True)
""")


def _daemons(conf: str) -> list[int]:
    """slurmctld/slurmd processes of the cluster whose configuration is `conf`."""
    return [p.pid for p in psutil.process_iter(["name", "cmdline"])
            if p.info["name"] in ("slurmctld", "slurmd") and conf in " ".join(p.info["cmdline"] or [])]


@needs_root
@pytest.mark.slurm
@pytest.mark.timeout(420)
@pytest.mark.usefixtures("slurm", "no_leftovers", "no_strays")
def test_jobs_preflight_and_the_kits_ranks_span_two_emulated_nodes(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HPDL_HOME": str(tmp_path / "home")}
    site = tmp_path / "two-nodes.toml"
    site.write_text('description = "2 emulated nodes"\n[slurm]\npartition = "debug"\ntime = "00:10:00"\n'
                    'pmi = "pmi2"\nranks_per_node = 2\ncpus_per_rank = 1\nstart_timeout = 200\n')
    with emulated_slurm.cluster(nodes=2, link="200mbit") as slurm_env:
        env.update(slurm_env)
        conf = slurm_env["SLURM_CONF"]
        assert len(_daemons(conf)) == 3  # the controller on node0, a slurmd on each node
        # tasks in blocks over the nodes, one MPI job across them
        p = subprocess.run(["srun", "-N2", "-n4", sys.executable, "-c",
                            "import socket; from mpi4py import MPI; c = MPI.COMM_WORLD; "
                            "print(c.rank, socket.gethostname(), c.allreduce(c.rank + 1))"],
                           env=env, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr
        rows = sorted(line.split() for line in p.stdout.splitlines())
        assert rows == [["0", "node0", "10"], ["1", "node0", "10"], ["2", "node1", "10"], ["3", "node1", "10"]], rows

        # preflight through the site's Slurm: its across-node row is the link's rate, its within-node rows are not
        out = tmp_path / "preflight"
        p = subprocess.run([sys.executable, "-m", "hpdl.cli", "preflight", "--site", str(site), "--nodes", "2",
                            "--largest-mib", "4", "--out", str(out), "--timeout", "200"],
                           env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        report = json.loads((out / "preflight.json").read_text())
        ranks = report["ranks"]
        assert sorted(r["host"] for r in ranks) == ["node0", "node0", "node1", "node1"], ranks
        across, within = ranks[0]["across"], ranks[0]["within"]
        assert across["sizes"][-1] == within["sizes"][-1] == 4 << 20, (across, within)
        # tbf lets no more through than the rate (a burst of 10 ms at most): bytes that crossed the link
        assert across["busbw"][-1] < 1.15 * LINK_BYTES_PER_S < within["busbw"][-1], (across, within)

        # the kit's Slurm launcher, as in a learner's kernel on the login node
        p = subprocess.run([sys.executable, "-c", KIT_RANKS, str(ROOT / "tests" / "fixtures")],
                           env={**env, "HPDL_SITE": str(site)}, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout + p.stderr
        hosts, sums, gloo, verdicts = json.loads(p.stdout.strip().splitlines()[-1])
        assert hosts == ["node0", "node0", "node1", "node1"] and sums == [10] * 4 and gloo == [10.0] * 4, p.stdout
        assert verdicts == ["PASS"], p.stdout
    assert _daemons(conf) == []
