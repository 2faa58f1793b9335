"""`hpdl preflight`: one short job on a site's nodes that says, before the course, whether they are ready.

    hpdl preflight --site cluster/sites/mysite.toml --nodes 2 [--ranks-per-node 4] [--out hpdl-preflight]

The job goes through the site's Slurm as the kit's ranks do (the profile's sbatch options, `srun
--mpi=<pmi>`, the rank prologue); `--launcher local` runs `mpiexec` on this machine instead. Every
rank reports its host, rank and local rank, the GPU the kit would give it (hpdl.rank.place: one per
rank, else "none"), torch's CUDA/NCCL versions, the MPI library it really loaded and whether that
is CUDA-aware (hpdl.mpilib). Then MPI_Allreduce is timed from 8 B to the largest size (hpdl.bench)
among the ranks of each node and among one rank per node. The numbers meet the profile's [expect]
table (hpdl.sites.EXPECT_KEYS, units in the key names) in a go/no-go table, printed and written as
one HTML page (index.html, and preflight.json). Exit status 1 on no-go.

Nothing waits forever: each rank writes its progress to a file in the output folder (compute nodes
must see it, as they see the submit folder on clusters), so a rank that does not answer is named
with its node and what it was doing; a job still pending after --queue-timeout is cancelled.
"""
from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import html
import json
import os
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from hpdl import procs
from hpdl.errors import HpdlError
from hpdl.sites import EXPECT_KEYS, SlurmSite, load_site, rank_wrapper, resource_options, sbatch_args
from hpdl.tables import html_table

GRACE = 15  # seconds the client waits beyond --timeout, so a stuck rank's own stack dump reaches the output
RANK_VARS = ("SLURM_PROCID", "PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")  # who I am before MPI starts


# -- on every rank ---------------------------------------------------------------------------------

def _device(comm) -> dict:
    """The device the kit would give this rank, and torch's CUDA/NCCL versions. Collective."""
    from mpi4py import MPI

    info = {"device": "none", "gpu": None, "memory_GB": None, "torch": None, "cuda": None, "nccl": None,
            "device_note": ""}
    try:
        import torch
    except ImportError as exc:
        torch, info["device_note"] = None, f"torch does not import: {exc}"
    if not comm.allreduce(torch is not None, op=MPI.LAND):  # every rank takes the same path
        return info
    from hpdl.rank import place

    device, _, note = place(comm.allgather, policy="auto")
    info.update(torch=torch.__version__, cuda=torch.version.cuda, device_note=note)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(device=f"{props.name} (cuda:{device.index})", memory_GB=round(props.total_memory / 1e9, 1),
                    gpu=gpu_identity(props, device.index))
    if torch.version.cuda:
        try:
            v = torch.cuda.nccl.version()
            info["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except (AttributeError, RuntimeError) as exc:
            info["device_note"] += f" (NCCL version unknown: {exc})"
    return info


def _allreduce_sweep(comm, sizes: list[int], budget: float) -> dict | None:
    """MPI_Allreduce timed at each size on `comm`, with bus bandwidth; None with nothing to measure."""
    from mpi4py import MPI

    from hpdl import bench

    if comm == MPI.COMM_NULL or comm.Get_size() < 2:
        return None
    s = bench.sweep(bench.library_allreduce(), comm, sizes, budget=budget)
    return {**s, "busbw": [float(b) for b in bench.busbw(s["sizes"], s["seconds"], comm.Get_size())]}


def rank_main(folder: str, largest: int, budget: float, timeout: float) -> None:
    """What every rank runs; after each phase its progress is in folder/rank-NNNNN.json."""
    state: dict = {"host": socket.gethostname(), "pid": os.getpid()}
    rank = next((int(os.environ[v]) for v in RANK_VARS if os.environ.get(v, "").isdigit()), None)

    def note(phase: str, **fields) -> None:
        state.update(phase=phase, **fields)
        if rank is not None:
            tmp = Path(folder) / f".rank-{rank:05d}.tmp"
            tmp.write_text(json.dumps(state))
            os.replace(tmp, Path(folder) / f"rank-{rank:05d}.json")  # the client never reads half a file

    faulthandler.dump_traceback_later(timeout, exit=True)  # a stuck rank prints where, then ends the job
    note("starting MPI")
    from mpi4py import MPI

    from hpdl import bench, mpilib

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    hosts = comm.allgather(state["host"])
    node = comm.Split(list(dict.fromkeys(hosts)).index(state["host"]), rank)  # the ranks of my host
    lib = mpilib.loaded()
    note("finding its GPU", rank=rank, size=comm.Get_size(), local_rank=node.Get_rank(), mpi=lib["library_version"],
         mpi_file=(lib["files"] or [""])[0], cuda_aware=lib["cuda_aware"], cuda_aware_how=lib["how"])
    note("timing MPI_Allreduce within its node", **_device(comm))
    sizes = sorted({*bench.message_sizes(8, largest, 16), largest})
    note("timing MPI_Allreduce across nodes", within=_allreduce_sweep(node, sizes, budget))
    leaders = comm.Split(0 if node.Get_rank() == 0 else MPI.UNDEFINED, rank)  # one rank per node
    across = _allreduce_sweep(leaders, sizes, budget)
    bench.idle_wait(comm)
    note("done", across=comm.bcast(across, root=0))
    faulthandler.cancel_dump_traceback_later()


# -- the job, through the site's launcher ----------------------------------------------------------

def _answers(folder: Path) -> dict[int, dict]:
    return {int(p.stem.split("-")[1]): json.loads(p.read_text()) for p in folder.glob("rank-*.json")}


def _all_done(folder: Path, n: int) -> bool:
    answers = _answers(folder)
    return len(answers) == n and all(a["phase"] == "done" for a in answers.values())


STACK_DUMP = "Timeout ("  # faulthandler's first line when a rank's time is up (rank_main's dump_traceback_later)
THREAD_LINES = ("Thread 0x", "Current thread 0x")  # then each thread's header, its frames, a blank line between
FRAME_LINES = ("  File ", "  <no Python frame>", "  ...")


def _last_stack_dump(lines: list[str], most: int = 24) -> list[str]:
    """The last faulthandler dump in a job's output, every thread of it (at most `most` lines), without
    what followed it (an MPI launcher's banner after the dump ended the rank); [] when there is none."""
    start = max((i for i, s in enumerate(lines) if s.startswith(STACK_DUMP)), default=None)
    if start is None:
        return []
    end = start + 1
    while end < len(lines) and (lines[end].startswith(THREAD_LINES + FRAME_LINES) or (
            not lines[end] and end + 1 < len(lines) and lines[end + 1].startswith(THREAD_LINES))):
        end += 1
    return lines[start:min(end, start + most)]


def _silent(folder: Path, n: int, why: str, output: Path) -> HpdlError:
    """The error that names every rank which did not finish: its node and what it was doing."""
    seen, lines = _answers(folder), [why]
    for r in range(n):
        if r not in seen:
            lines.append(f"  rank {r}: never started (no word from it)")
        elif seen[r]["phase"] != "done":
            lines.append(f"  rank {r} on {seen[r]['host']}: stuck {seen[r]['phase']}")
    if not seen:
        lines.append(f"  (no rank wrote to {folder}: if the job ran, that folder is not on a file system the "
                     "compute nodes see; run from one they do, or pass --out there)")
    text = output.read_text(errors="replace") if output.exists() else ""
    shown = [s for s in text.strip().splitlines() if "<frozen " not in s]  # a stack dump: our lines
    dump = _last_stack_dump(shown)
    if dump:  # a stuck rank's own stack, not the banner its launcher printed after it ended
        return HpdlError("\n".join(lines + [f"the job's output ({output}) shows where:"] + ["    " + s for s in dump]))
    return HpdlError("\n".join(lines + ([f"the job's output ({output}) ends with:"] if shown else [])
                               + ["    " + s for s in shown[-12:]]))


def batch_script(site: SlurmSite, nodes: int, per_node: int, program: list[str], output: Path, minutes: int) -> str:
    """The preflight job: the profile's sbatch options and rank prologue, `nodes` x `per_node` tasks."""
    from hpdl.launchers.slurm import STEP_EXPORT  # here: the ranks import this module, not the launchers

    job = dataclasses.replace(site, ranks_per_node=per_node, time=str(minutes))
    opts = ["--job-name=hpdl-preflight", f"--nodes={nodes}", f"--ntasks={nodes * per_node}",
            f"--output={output}", *sbatch_args(job)]
    step = ["srun", f"--mpi={site.pmi}", "--kill-on-bad-exit=1", STEP_EXPORT, *resource_options(job), *site.srun,
            *rank_wrapper(site), *site.wrap, *program]
    return "\n".join(["#!/bin/bash", *(f"#SBATCH {o}" for o in opts), shlex.join(step)]) + "\n"


# Why a job pends (squeue %r) when waiting will not help: the request exceeds what the partition,
# account or QOS allows. Other reasons (Resources, Priority, BeginTime, ...) pass with time.
NEVER_STARTS = {"PartitionNodeLimit", "PartitionTimeLimit", "PartitionConfig", "BadConstraints", "InvalidAccount",
                "InvalidQOS", "AssocMaxNodesPerJobLimit", "AssocMaxCpuPerJobLimit", "AssocMaxWallDurationPerJobLimit",
                "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit", "QOSMaxWallDurationPerJobLimit"}


def _pending_reason(job: str) -> str:
    p = subprocess.run(["squeue", "-h", "-j", job, "-o", "%r"], capture_output=True, text=True, timeout=30)
    return p.stdout.strip()


def _slurm(site: SlurmSite, nodes: int, per_node: int, program: list[str], folder: Path,
           timeout: float, queue_timeout: float) -> str:
    from hpdl.launchers._slurm_queue import cancel_job, job_state, still_listed

    if not shutil.which("sbatch"):
        raise HpdlError("no Slurm here (sbatch is not on PATH): run this on the cluster's login node (or "
                        "`module load slurm`), or check this machine with `--launcher local`.")
    output, script, n = folder / "job.out", folder / "preflight.sbatch", nodes * per_node
    script.write_text(batch_script(site, nodes, per_node, program, output, int(timeout // 60) + 5))
    p = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=120)
    if p.returncode:
        asked = "\n    ".join(s for s in script.read_text().splitlines() if s.startswith("#SBATCH"))
        raise HpdlError(f"sbatch refused the preflight job: {(p.stderr or p.stdout).strip()}\nFix the [slurm] "
                        f"settings of {site.source}; the job asked for:\n    {asked}")
    job, finished, started, queued_until = p.stdout.strip().split(";")[0], False, None, time.monotonic() + queue_timeout
    try:
        while not _all_done(folder / "ranks", n):
            state = job_state(job)
            if state is None:
                raise _silent(folder / "ranks", n, f"Slurm job {job} ended before every rank answered:", output)
            why = _pending_reason(job) if state == "PENDING" else ""
            if why in NEVER_STARTS:
                raise HpdlError(f"Slurm job {job} can never start as asked (reason: {why}) and was cancelled: ask "
                                f"for fewer --nodes or --ranks-per-node, or fix the [slurm] settings of {site.source}.")
            if state == "PENDING" and time.monotonic() > queued_until:
                raise HpdlError(f"Slurm job {job} was still pending after {queue_timeout:.0f} s (reason: {why or '?'})"
                                " and was cancelled. Run it when the queue is quieter, ask for fewer --nodes or "
                                "another partition, or wait longer with --queue-timeout.")
            started = started or (time.monotonic() if state not in ("PENDING", "") else None)
            if started and time.monotonic() - started > timeout + GRACE:
                raise _silent(folder / "ranks", n, f"not every rank of Slurm job {job} answered within "
                              f"{timeout:.0f} s; the job was cancelled:", output)
            time.sleep(0.5)
        finished = True
        return job
    finally:
        if still_listed([job], 30 if finished else 0):  # a finished job leaves the queue by itself
            cancel_job(job)


def _local(n: int, program: list[str], folder: Path, timeout: float) -> str:
    """Preflight's job on this machine: a side job like a check's (hpdl.sidejob), its output kept."""
    from hpdl import launchers, sidejob

    output, cmd = folder / "job.out", launchers.side_job_command(n)
    with sidejob.SideJob(cmd + program, output=output, env=sidejob.job_env(),
                         timeout=timeout + GRACE) as job:
        code = job.wait(poll=0.2)
        if code is None:
            job.end(now=True)
            raise _silent(folder / "ranks", n, f"not every rank answered within {timeout:.0f} s; the job was "
                          "stopped:", output)
    if not _all_done(folder / "ranks", n):
        raise _silent(folder / "ranks", n, f"the job ended (exit code {code}) before every rank "
                      "answered:", output)
    return f"{os.path.basename(cmd[0])} -n {n}"


# -- verdicts, the table, the page -----------------------------------------------------------------

def _row(check: str, where: str, measured: str, expected: list[str], problems: list[str], na: str = "") -> dict:
    verdict = "n/a" if na else ("no-go" if problems else "go")
    reason = na or "; ".join(problems) or ("as expected" if expected else "not judged: no [expect] key for it")
    return {"verdict": verdict, "check": check, "where": where, "measured": measured,
            "expected": ", ".join(expected) or "—", "reason": reason}


def _sweep_row(check: str, where: str, s: dict | None, expect: dict, prefix: str, na: str) -> dict:
    from hpdl.plots import size_label

    if s is None:
        return _row(check, where, "—", [], [], na=na)
    us, gbps = s["seconds"][0] * 1e6, s["busbw"][-1] / 1e9
    most, least = expect.get(f"{prefix}_8B_us_max"), expect.get(f"{prefix}_busbw_GBps_min")
    expected, problems = [], []
    if most is not None:
        expected.append(f"8 B ≤ {most} µs")
        if us > most:
            problems.append(f"8 B allreduce took {us:.3g} µs, more than {most} µs")
    if least is not None:
        expected.append(f"busbw ≥ {least} GB/s")
        if gbps < least:
            problems.append(f"bus bandwidth {gbps:.3g} GB/s, less than {least} GB/s")
    measured = f"8 B: {us:.3g} µs · {size_label(s['sizes'][-1])}: {gbps:.3g} GB/s busbw ({s['ranks']} ranks)"
    return _row(check, where, measured, expected, problems)


def gpu_identity(props, index: int) -> str:
    """What tells one physical GPU from another across ranks: its UUID (else its PCI bus id).

    Under per-task binding (`srun --gpus-per-task=1`) every rank sees its own GPU as cuda:0, so
    the device's name and index say nothing about how many GPUs a node's ranks use."""
    for attr in ("uuid", "pci_bus_id"):
        value = getattr(props, attr, None)
        if value not in (None, ""):
            return str(value)
    return f"{props.name} (cuda:{index})"


def judge(ranks: list[dict], expect: dict) -> list[dict]:
    """Go/no-go rows: one per rank, per node (its GPUs), per allreduce measurement. Pure."""
    rows, gpus = [], expect.get("gpus_per_node")
    aware, lib = expect.get("cuda_aware_mpi"), expect.get("mpi_library_contains")
    for r in ranks:
        expected, problems = [], []
        if gpus is not None:
            expected.append("a GPU" if gpus else "no GPU needed")
            if gpus and r["device"] == "none":
                problems.append(f"no GPU of its own ({r['device_note'] or 'torch sees no GPU'})")
        if aware:
            expected.append("CUDA-aware MPI")
            if r["cuda_aware"] is not True:
                problems.append(f"its MPI is not CUDA-aware ({r['cuda_aware_how'] or 'nothing says it is'})")
        if lib:
            expected.append(f"MPI {lib}")
            if lib.lower() not in (r["mpi"] or "").lower():
                problems.append(f"its MPI library is not {lib}")
        memory = f" {r['memory_GB']} GB" if r["memory_GB"] else ""
        aware_text = {True: "yes", False: "no", None: "unknown"}[r["cuda_aware"]]
        rows.append(_row(f"rank {r['rank']} (local {r['local_rank']})", r["host"],
                         f"{r['device']}{memory} · CUDA {r['cuda'] or '—'} · NCCL {r['nccl'] or '—'} · "
                         f"{r['mpi'] or '?'} · CUDA-aware {aware_text}", expected, problems))
    hosts = list(dict.fromkeys(r["host"] for r in ranks))
    for host in hosts:
        mine = [r for r in ranks if r["host"] == host]
        used = len({r.get("gpu") or r["device"] for r in mine if r["device"] != "none"})  # by UUID, not cuda:i
        rows.append(_row("GPUs of the node", host, f"{len(mine)} rank(s), {used} GPU(s) in use",
                         [] if gpus is None else [f"{gpus} GPU(s)"],
                         [f"{used} GPU(s) in use, {gpus} expected"] if gpus is not None and used < gpus else []))
    for host in hosts:
        rows.append(_sweep_row("allreduce within a node", host, next(r for r in ranks if r["host"] == host)["within"],
                               expect, "within_node", "one rank on this node: nothing to measure within it"))
    rows.append(_sweep_row("allreduce across nodes", f"{len(hosts)} node(s)", ranks[0]["across"], expect,
                           "across_nodes", "one node: nothing to measure across nodes"))
    return rows


def render(result: dict) -> str:
    """The go/no-go table as text, for the terminal."""
    rows = result["rows"]
    w = [max(len(r[k]) for r in rows) for k in ("check", "where")]
    lines = [f"hpdl preflight · {result['site']} · {result['launched']} · {result['when']}", ""]
    for r in rows:
        lines.append(f"{r['verdict'].upper():<6} {r['check']:<{w[0]}}  {r['where']:<{w[1]}}  {r['measured']}")
        if r["reason"] != "as expected":
            lines.append(f"{'':<7}→ {r['reason']}")
    bad = sum(r["verdict"] == "no-go" for r in rows)
    return "\n".join(lines + ["", f"NO-GO: {bad} check(s) failed (reasons above)." if bad else "GO: no check failed."])


def _text(v) -> str:
    """A value as a table shows it: — for none, yes/no, three figures and no exponents for floats."""
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if v < 1000 else f"{v:,.0f}"  # 5.59, 0.0172, 8,830
    return str(v)


def _table(head: list[str], body: list[list], classes: list[str] | None = None) -> str:
    return html_table(head, [[_text(v) for v in r] for r in body],
                      row_attrs=[{"class": c} for c in classes] if classes else None)


RANK_COLUMNS = ("rank", "host", "local_rank", "device", "gpu", "memory_GB", "torch", "cuda", "nccl", "mpi", "mpi_file",
                "cuda_aware", "cuda_aware_how", "device_note")


def write_html(result: dict, folder: Path) -> Path:
    """One page, no external assets: the verdict, the go/no-go table, the ranks, the sweeps, [expect]."""
    from hpdl.plots import size_label

    rows, ranks, verdict = result["rows"], result["ranks"], "GO" if result["go"] else "NO-GO"
    sweeps = [(f"within {r['host']}", r["within"]) for r in ranks if r["local_rank"] == 0 and r["within"]]
    sweeps += [("across nodes", ranks[0]["across"])] if ranks[0]["across"] else []
    sweep_html = "".join(f"<h3>MPI_Allreduce {html.escape(name)}, {s['ranks']} ranks</h3>" + _table(
        ["size", "median µs", "busbw GB/s"],
        [[size_label(n), t * 1e6, b / 1e9] for n, t, b in zip(s["sizes"], s["seconds"], s["busbw"])])
        for name, s in sweeps)
    keys = ["verdict", "check", "where", "measured", "expected", "reason"]
    page = f"""<!doctype html><meta charset="utf-8"><title>hpdl preflight: {verdict}</title>
<style>body{{font-family:sans-serif;max-width:80em;margin:2em auto}}table{{border-collapse:collapse;margin:1em 0}}
td,th{{border:1px solid #ccc;padding:.2em .6em;text-align:left}}.go{{background:#e3f4e3}}.no-go{{background:#fbe0e0}}
.n\\/a{{background:#f0f0f0}}</style>
<h1>hpdl preflight: <span class="{verdict.lower()}">{verdict}</span></h1>
<p>{html.escape(result['site'])} · {html.escape(result['launched'])} · {html.escape(result['when'])}</p>
<h2>Go / no-go</h2>{_table(keys, [[r[k] for k in keys] for r in rows], [r["verdict"] for r in rows])}
<h2>Ranks</h2>{_table([c.replace("_", " ") for c in RANK_COLUMNS], [[r[c] for c in RANK_COLUMNS] for r in ranks])}
<h2>Allreduce sweeps</h2><p>Median of the slowest rank, float32 sums in host memory; bus bandwidth as nccl-tests
defines it (algorithm bandwidth × 2(p−1)/p); GB/s are 10<sup>9</sup> B/s.</p>{sweep_html}
<h2>Expected: the site profile's [expect]</h2>{_table(["key", "value", "meaning"],
    [[k, result["expect"].get(k, "not set"), doc] for k, (_, doc) in EXPECT_KEYS.items()])}
"""
    (folder / "index.html").write_text(page)
    return folder / "index.html"


def run(site: SlurmSite, *, nodes: int = 1, ranks_per_node: int = 2, launcher: str = "slurm",
        out: Path = Path("hpdl-preflight"), largest: int = 16 << 20, budget: float = 0.05,
        timeout: float = 300, queue_timeout: float = 600) -> dict:
    """Run the preflight job, judge it, write out/index.html and out/preflight.json; returns the result."""
    if launcher not in ("slurm", "local"):
        raise HpdlError(f"--launcher {launcher!r}: use slurm (the site's nodes) or local (mpiexec on this machine).")
    if nodes < 1 or ranks_per_node < 1 or (launcher == "local" and nodes != 1):
        raise HpdlError("use --nodes ≥ 1 and --ranks-per-node ≥ 1; --launcher local runs on this machine only "
                        "(--nodes 1).")
    out = Path(out).resolve()
    (out / "ranks").mkdir(parents=True, exist_ok=True)
    for old in (out / "ranks").glob("rank-*.json"):
        old.unlink()
    program = [sys.executable, "-m", "hpdl.preflight", "_rank", str(out / "ranks"), str(largest), str(budget),
               str(timeout)]
    if launcher == "slurm":
        launched = f"Slurm job {_slurm(site, nodes, ranks_per_node, program, out, timeout, queue_timeout)}"
    else:
        launched = _local(nodes * ranks_per_node, program, out, timeout)
    ranks = [a for _, a in sorted(_answers(out / "ranks").items())]
    rows = judge(ranks, site.expect)
    result = {"site": f"{site.name} ({site.source})", "launched": f"{launched}, {nodes} node(s) × {ranks_per_node}",
              "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "expect": site.expect,
              "go": all(r["verdict"] != "no-go" for r in rows), "rows": rows, "ranks": ranks}
    (out / "preflight.json").write_text(json.dumps(result, indent=1))
    return {**result, "html": str(write_html(result, out))}


def main(argv: list[str]) -> int:
    if argv[:1] == ["_rank"]:  # on the ranks of the job run() started
        rank_main(argv[1], int(argv[2]), float(argv[3]), float(argv[4]))
        return 0
    ap = argparse.ArgumentParser(prog="hpdl preflight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--site", help="site profile: a name in cluster/sites or a .toml path (default: $HPDL_SITE)")
    ap.add_argument("--nodes", type=int, default=1, help="nodes to check (default 1)")
    ap.add_argument("--ranks-per-node", type=int, default=0,
                    help="ranks per node (default: the profile's ranks_per_node, else [expect] gpus_per_node, else 2)")
    ap.add_argument("--launcher", default="slurm", help="slurm (default: a job on the site) or local (mpiexec here)")
    ap.add_argument("--out", type=Path, default=Path("hpdl-preflight"), help="report folder (default ./hpdl-preflight)")
    ap.add_argument("--largest-mib", type=int, default=16, help="largest allreduce message in MiB (default 16)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds the running job may take (default 300)")
    ap.add_argument("--queue-timeout", type=float, default=600, help="seconds it may wait in the queue (default 600)")
    args = ap.parse_args(argv)
    site = load_site(args.site)
    per_node = args.ranks_per_node or site.ranks_per_node or int(site.expect.get("gpus_per_node", 0)) or 2
    with procs.sigterm_exits():  # e.g. `timeout`: cancel the job first
        result = run(site, nodes=args.nodes, ranks_per_node=per_node, launcher=args.launcher, out=args.out,
                     largest=args.largest_mib << 20, timeout=args.timeout, queue_timeout=args.queue_timeout)
    print(render(result) + f"\nreport: {result['html']}")
    return 0 if result["go"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
