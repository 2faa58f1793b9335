"""Collective tuning with MPICH: sweep its allreduce algorithms, pick per size, write its tuning file.

    hpdl tune [--ranks 4] [--largest 64M] [--out hpdl-tuning]

MPICH chooses an allreduce algorithm per call. `MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM=<name>`
forces one (the names: `mpich_algorithms()`, read from MPICH's own `mpivars`); left at `auto`,
MPICH walks a decision tree read from the JSON file named by
`MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE` (format: MPICH's maint/tuning/coll/mpir/generic.json
and src/mpi/coll/src/csel.c). Its keys, in order, are tests; the first that holds is taken:

    {"collective=allreduce": {
        "comm_type=intra": {
            "avg_msg_size<=2048": {"algorithm=MPIR_Allreduce_intra_recursive_doubling": {}},
            "avg_msg_size=any":   {"algorithm=MPIR_Allreduce_intra_reduce_scatter_allgather": {}}},
        "comm_type=inter": {"algorithm=MPIR_Allreduce_inter_reduce_exchange_bcast": {}}}}

`avg_msg_size` is the bytes each rank contributes (count x datatype size); a level of size
tests must end with an `=any` branch. The file must hold rules for every collective (MPICH
stops at the first it cannot find), so `write_tuning_file` puts the allreduce tree into
MPICH's own rules, read from its library (`mpich_defaults`).

Which algorithm MPICH really ran is read back from MPICH itself (`probe`): a user-defined
reduction operation records how many elements MPICH hands it at each call on each rank, and
each algorithm leaves its own pattern (recursive doubling: lg p calls of the whole vector;
reduce-scatter + allgather: halves, quarters, ...; ring: p-1 calls of n/p).

Everything that starts ranks here runs a fresh side job (hpdl.sidejob; the engines keep running).
"""
from __future__ import annotations

import argparse
import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import Iterable, Sequence

from hpdl.errors import HpdlError

log = logging.getLogger(__name__)

ENV_ALGORITHM = "MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM"
ENV_TUNING_FILE = "MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE"
# The value of ENV_ALGORITHM -> the container name MPICH's tuning file uses for it.
CONTAINERS = {
    "recursive_doubling": "MPIR_Allreduce_intra_recursive_doubling",
    "reduce_scatter_allgather": "MPIR_Allreduce_intra_reduce_scatter_allgather",
    "ring": "MPIR_Allreduce_intra_ring",
}
# (tree, recexch and the k-ary ones take parameters in the file, e.g. "k=2"; left at 0 they
# compute wrong sums here, so tables stick to the three above.)
# The ones `hpdl tune` builds its table from (the tree also has a fingerprint in `classify`).
TABLE_ALGORITHMS = ("recursive_doubling", "reduce_scatter_allgather", "ring")


def _bindir() -> Path:
    return Path(sys.executable).parent


def mpich_algorithms(collective: str = "allreduce") -> list[str]:
    """The algorithm names MPICH accepts in MPIR_CVAR_<COLLECTIVE>_INTRA_ALGORITHM, from `mpivars`."""
    mpivars = _bindir() / "mpivars"
    if not mpivars.exists():
        raise HpdlError(f"no {mpivars}: this needs MPICH (pip install mpich) in the kit's venv.")
    from hpdl import sidejob

    text = sidejob.run([str(mpivars)], 60).output
    names, inside = [], False
    head = f"MPIR_CVAR_{collective.upper()}_INTRA_ALGORITHM"
    for line in text.splitlines():
        if line.startswith("\t"):
            inside = line.strip().startswith(head + " ") or line.strip().startswith(head + "=")
            continue
        m = re.match(r"^([a-z_0-9]+)\s+-", line)
        if inside and m:
            names.append(m.group(1))
    return names


# -- the selection table and the tuning file --------------------------------------------------

def selection_table(sweeps: Sequence[dict], *, keep: float = 1.0,
                    incumbent=None) -> list[tuple[int | None, str]]:
    """[(up_to_bytes, algorithm), ..., (None, algorithm)] from sweeps measured on the same sizes.

    Each sweep is an `hpdl.bench` dict named after its algorithm. For every size the fastest
    wins; neighbouring sizes with the same winner merge into one row; the boundary between two
    rows is the larger size of the first one. `keep` > 1 keeps an algorithm while it is within
    that factor of the fastest (fewer switches on noisy measurements): first the `incumbent`'s
    choice at that size (a function bytes -> algorithm, e.g. `mpich_choice`: change the
    library's own pick only where something is clearly faster), then the previous row's.
    """
    if not sweeps:
        raise ValueError("give at least one sweep")
    sizes = list(sweeps[0]["sizes"])
    for s in sweeps:
        if list(s["sizes"]) != sizes:
            raise ValueError("all sweeps must be measured on the same sizes")
    winners: list[str] = []
    for i in range(len(sizes)):
        best = min(sweeps, key=lambda s: s["seconds"][i])
        own = next((s for s in sweeps if incumbent and s["name"] == incumbent(sizes[i])), None)
        prev = next((s for s in sweeps if winners and s["name"] == winners[-1]), None)
        if own is not None and own["seconds"][i] <= keep * best["seconds"][i]:
            best = own
        elif prev is not None and prev["seconds"][i] <= keep * best["seconds"][i]:
            best = prev
        winners.append(best["name"])
    table: list[tuple[int | None, str]] = []
    for i, name in enumerate(winners):
        if i + 1 < len(winners) and winners[i + 1] == name:
            continue
        table.append((sizes[i] if i + 1 < len(winners) else None, name))
    return table


def tuning_json(table: Sequence[tuple[int | None, str]]) -> dict:
    """MPICH's selection tree for allreduce from a table [(up_to_bytes, algorithm), ..., (None, alg)]."""
    intra: dict = {}
    for upto, name in table:
        if name not in CONTAINERS:
            raise HpdlError(f"{name!r} is not an allreduce algorithm MPICH's tuning file knows: {sorted(CONTAINERS)}")
        key = "avg_msg_size=any" if upto is None else f"avg_msg_size<={int(upto)}"
        intra[key] = {f"algorithm={CONTAINERS[name]}": {}}
    if "avg_msg_size=any" not in intra:
        raise HpdlError("the table's last row must cover all larger sizes: (None, algorithm)")
    return {"collective=allreduce": {"comm_type=intra": intra,
                                     "comm_type=inter": {"algorithm=MPIR_Allreduce_inter_reduce_exchange_bcast": {}}}}


def mpich_choice(nbytes: int, ranks: int, rules: dict | None = None, itemsize: int = 4) -> str:
    """The allreduce algorithm MPICH's own rules pick for a float sum of `nbytes` per rank on
    `ranks` ranks of one node (its built-in tree, walked as csel.c walks it), e.g. 'ring'.

    `rules`: a whole tuning tree (default: MPICH's built-in one, `mpich_defaults()`). Tests the
    tree does not depend on for a plain MPI_SUM (commutative, built in, not in place) take
    their first branch.
    """
    count = max(1, nbytes // itemsize)
    pof2 = 1 << (max(1, ranks).bit_length() - 1)
    facts = {"avg_msg_size": count * itemsize, "total_msg_size": count * itemsize * ranks, "comm_size": ranks,
             "count": count}
    yes = {"comm_type": "intra", "collective": "allreduce", "is_commutative": "yes", "is_op_built_in": "yes",
           "is_sbuf_inplace": "no", "is_multi_threaded": "no"}
    node = (rules if rules is not None else mpich_defaults()).get("collective=allreduce", {})
    while node:
        for key, child in node.items():
            k = key.replace(" ", "")
            if k.startswith("algorithm="):
                name = k[len("algorithm="):]
                return next((a for a, c in CONTAINERS.items() if c == name), name.replace("MPIR_Allreduce_intra_", ""))
            m = _SIZE_KEY.match(k)
            if m:
                value, bound = facts[m.group(1)], int(m.group(3))
                if value <= bound if m.group(2) == "<=" else value < bound:
                    node = child
                    break
            elif k == "count<pow2":
                if count < pof2:
                    node = child
                    break
            elif k.endswith("=any") or yes.get(k.split("=")[0]) == k.split("=")[1]:
                node = child
                break
        else:
            node = next(iter(node.values()))  # a test this walk does not know: its first branch
    return "unknown"


def guarded(tree: dict) -> dict:
    """The allreduce tree with each reduce-scatter + allgather leaf behind the guard MPICH's own rules use.

    That algorithm needs at least one element per rank of the power-of-two group and a built-in
    operation; called otherwise, MPICH stops the job ("Assertion failed ... count >= pof2"). Its
    built-in rules therefore send such calls (a 1-element allreduce, a user-defined op) to
    recursive doubling. A size table says nothing about this, so the kit adds the same guard to
    any tree it writes; a leaf already under a count or op test is left alone.
    """
    rsag = f"algorithm={CONTAINERS['reduce_scatter_allgather']}"
    rd = {f"algorithm={CONTAINERS['recursive_doubling']}": {}}

    def walk(node):
        if not isinstance(node, dict):
            return node
        if list(node) == [rsag]:
            return {"is_op_built_in=yes": {"count<pow2": rd, "count=any": node}, "is_op_built_in=no": rd}
        if any(k.startswith(("count", "is_op_built_in")) for k in node):
            return node
        return {k: walk(v) for k, v in node.items()}

    if not isinstance(tree, dict) or not isinstance(tree.get("collective=allreduce"), dict):
        return tree
    return {**tree, "collective=allreduce": walk(tree["collective=allreduce"])}


def mpich_defaults() -> dict:
    """MPICH's own selection rules (all collectives), as compiled into this venv's libmpi.

    A tuning file replaces MPICH's rules for every collective, and MPICH stops ("Assertion
    failed ... cnt") on the first collective the file has no rule for; so the kit writes its
    allreduce tree into these defaults. {} when no MPICH library with them is found.
    """
    libs = [p for p in (_bindir().parent / "lib").glob("libmpi.so*") if p.is_file()]
    if not libs:
        return {}
    lib = max(libs, key=lambda p: p.stat().st_size)  # libmpi.so itself may be a 20-byte linker script
    data = lib.read_bytes()
    for m in re.finditer(rb'\{"collective=[\x20-\x7e]{200,}', data):
        text = m.group(0).decode()
        if "algorithm=MPIR_Allreduce_intra" in text:
            try:
                return json.loads(text)
            except ValueError:
                log.debug("a selection string in %s did not parse", lib)
    return {}


def write_tuning_file(table_or_json, path: str | Path) -> Path:
    """Write MPICH's tuning file: its own rules, with allreduce's from a table or a JSON tree.

    Returns the path. Reduce-scatter + allgather leaves get MPICH's own guard (`guarded`);
    otherwise whatever the tree holds (even something MPICH will refuse) is written, so that
    MPICH, not this function, has the last word on it.
    """
    obj = table_or_json if isinstance(table_or_json, dict) else tuning_json(table_or_json)
    if isinstance(obj, dict):
        obj = {**mpich_defaults(), **guarded(obj)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n")
    return path


_SIZE_KEY = re.compile(r"^(avg_msg_size|total_msg_size|comm_size|count)(<=|<)(\d+)$")


def problems(obj) -> list[str]:
    """What MPICH's parser (csel.c) would refuse or misread in an allreduce tuning tree, in words.

    Not a replacement for running MPICH on it (see `probe`): a quick reading for clear hints.
    """
    if not isinstance(obj, dict):
        return [f"the tuning file is a JSON object (a dict), not {type(obj).__name__}"]
    out: list[str] = []
    if "collective=allreduce" not in obj:
        out.append('no "collective=allreduce" key at the top')
        return out

    def walk(node, where):
        if not isinstance(node, dict):
            out.append(f"{where}: every value is a JSON object, found {type(node).__name__}")
            return
        keys = [k.replace(" ", "") for k in node]
        leaves = [k for k in keys if k.startswith("algorithm=")]
        if leaves:
            for k in leaves:
                if k[len("algorithm="):] not in CONTAINERS.values() and "inter" not in k:
                    out.append(f"{where}: unknown algorithm {k!r}; MPICH names them like "
                               f"'algorithm=MPIR_Allreduce_intra_ring'")
            return
        if not keys:
            out.append(f"{where}: empty: a branch must end in an 'algorithm=...' entry")
            return
        sized = [k for k in keys if _SIZE_KEY.match(k) or k.endswith("=any")]
        if sized and not keys[-1].endswith("=any"):
            out.append(f"{where}: the size tests must end with an '=any' branch (e.g. 'avg_msg_size=any')")
        bounds = [int(_SIZE_KEY.match(k).group(3)) for k in keys if _SIZE_KEY.match(k)]
        if bounds != sorted(bounds):
            out.append(f"{where}: size tests are tried in order, so they must grow: {bounds}")
        for k in keys:
            if k == "count<pow2":  # MPICH's own test: fewer elements than the power-of-two group
                continue
            if not (_SIZE_KEY.match(k) or "=" in k):
                out.append(f"{where}: {k!r} is not a test MPICH knows (e.g. 'avg_msg_size<=1024')")
            elif "=" in k and not _SIZE_KEY.match(k):
                name = k.split("=")[0].rstrip("<")
                if name not in ("avg_msg_size", "total_msg_size", "comm_size", "count", "comm_type", "collective",
                                "is_commutative", "is_op_built_in", "is_sbuf_inplace", "comm_hierarchy",
                                "is_multi_threaded", "is_node_consecutive", "comm_avg_ppn", "is_block_regular"):
                    out.append(f"{where}: {k!r} is not a test MPICH knows (e.g. 'avg_msg_size<=1024')")
        for key, child in node.items():
            walk(child, f"{where} > {key}")

    walk(obj["collective=allreduce"], "collective=allreduce")
    top = obj["collective=allreduce"]
    kinds = [k.replace(" ", "") for k in top] if isinstance(top, dict) else []
    if any(k.startswith("comm_type=") for k in kinds) and not {"comm_type=inter", "comm_type=any", "any"} & set(kinds):
        out.append("no 'comm_type=inter' branch: MPICH finds no rule for an allreduce between two groups of ranks "
                   "(an inter-communicator) and stops (\"Assertion failed ... cnt\"); keep the example's inter branch")
    return out


def algorithm_for(table: Sequence[tuple[int | None, str]], nbytes: int) -> str:
    """The algorithm a table picks for a message of `nbytes` per rank (first row that holds)."""
    for upto, name in table:
        if upto is None or nbytes <= upto:
            return name
    raise ValueError("the table has no last row (None, algorithm)")


# -- running fresh MPI jobs with a setting ----------------------------------------------------

def run_job(ranks: int, args: list[str], env: dict[str, str] | None = None, timeout: float = 120.0,
            nodes: tuple[int, str] | None = None) -> str:
    """Run `python -m hpdl.tune ARGS` as a fresh `ranks`-rank side job; rank 0's JSON line back.

    Started as every side job is (hpdl.launchers: mpiexec here, an overlapping srun step inside a
    Slurm allocation) and supervised by hpdl.sidejob: at the time limit or on an interrupt the
    whole job is ended and its MPI shared memory removed. `nodes` = (count, link): on that many
    emulated nodes of this machine instead (hpdl.emulated), made for this job and removed after."""
    from hpdl import emulated_job, launchers, sidejob

    program = [sys.executable, "-m", "hpdl.tune", *args]
    if nodes is None:
        done = sidejob.run([*launchers.side_job_command(ranks, gpus=False), *program], timeout,
                           env=sidejob.job_env(env))
    else:
        done = emulated_job.run(program, ranks, nodes[0], nodes[1], timeout, env=sidejob.job_env(env))
    if done.timed_out:
        raise HpdlError(f"the MPI job `{' '.join(args)}` did not finish in {timeout:.0f} s; it was stopped")
    for line in done.output.splitlines():
        if line.startswith("HPDL-TUNE "):
            return line[len("HPDL-TUNE "):]
    lines = done.output.strip().splitlines()
    causes = [line for line in lines if "Assertion" in line or "rror" in line][:4]   # MPICH's own words first
    tail = "\n".join(causes + lines[-8:])
    raise HpdlError(f"the MPI job ended (exit code {done.returncode}) without a result:\n{tail}")


def probe(sizes: Iterable[int], *, ranks: int = 4, tuning_file: str | Path | None = None,
          algorithm: str | None = None, timeout: float = 60.0) -> dict[int, list[list[int]]]:
    """Per message size (bytes per rank), the element counts MPICH handed the reduction on each rank.

    Runs a fresh job with the tuning file (or a forced algorithm): what MPICH really did.
    """
    env = {}
    if tuning_file is not None:
        env[ENV_TUNING_FILE] = str(Path(tuning_file).resolve())
    if algorithm is not None:
        env[ENV_ALGORITHM] = algorithm
    sizes = [int(s) for s in sizes]
    out = json.loads(run_job(ranks, ["_probe", ",".join(map(str, sizes))], env, timeout))
    return {int(k): v for k, v in out.items()}


def classify(calls: list[list[int]], count: int) -> str:
    """Which allreduce algorithm left this pattern of reduction calls (counts per rank), or 'unknown'.

    p ranks (a power of two), `count` elements, as MPICH 5 calls a user-defined operation:
    recursive doubling: every rank lg p calls of `count`; ring: every rank p-1 calls of about
    count/p; tree (k-nomial, k = 2): whole-vector calls on the inner nodes only (rank 0 lg p,
    leaves none); reduce-scatter + allgather: lg p calls of count/2, count/4, ...
    (MPICH runs reduce-scatter + allgather only for built-in operations: forced by
    MPIR_CVAR_ALLREDUCE_INTRA_ALGORITHM it falls back to recursive doubling for a user-defined
    one; chosen by a tuning file it stops with "Assertion failed ... HANDLE_IS_BUILTIN(op)".
    So probes avoid sizes where a table picks it.)
    """
    p = len(calls)
    if p < 2 or p & (p - 1):
        raise ValueError("classify needs a power-of-two number of ranks")
    lg = p.bit_length() - 1
    if all(c == [count] * lg for c in calls):
        return "recursive_doubling"
    if p > 2 and all(len(c) == p - 1 and all(abs(x - count / p) <= 1 for x in c) for c in calls):
        return "ring"
    lengths = [len(c) for c in calls]
    if (p > 2 and all(x == count for c in calls for x in c) and lengths[0] == lg == max(lengths) and 0 in lengths
            and len(set(lengths)) > 1):
        return "tree"
    halves = all(len(c) == lg and all(abs(x - count / 2 ** (j + 1)) <= j + 1 for j, x in enumerate(c)) for c in calls)
    if halves and p > 2:
        return "reduce_scatter_allgather"
    if halves:  # at p = 2 the ring and reduce-scatter + allgather leave the same trace
        return "reduce_scatter_allgather|ring"
    return "unknown"


def _probe_on_ranks(sizes: list[int]) -> dict:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    calls: list[int] = []

    def add(a, b, datatype):
        x, y = np.frombuffer(a, np.float32), np.frombuffer(b, np.float32)
        calls.append(len(x))
        y += x

    op = MPI.Op.Create(add, commute=True)
    out = {}
    for nbytes in sizes:
        x = np.ones(max(1, nbytes // 4), np.float32)
        y = np.empty_like(x)
        calls.clear()
        comm.Allreduce(x, y, op=op)
        if y[0] != comm.Get_size():
            raise RuntimeError(f"wrong allreduce result {y[0]} at {nbytes} B")
        out[nbytes] = comm.gather(list(calls), root=0)
    op.Free()
    if comm.Get_size() > 1:  # and between two groups: with no rule for comm_type=inter, MPICH stops ("... cnt")
        half = comm.Split(comm.Get_rank() % 2, comm.Get_rank())
        inter = half.Create_intercomm(0, comm, 1 - comm.Get_rank() % 2, tag=11)
        x = np.ones(4, np.float32)
        inter.Allreduce(x, np.empty_like(x))
        inter.Free()
        half.Free()
    return out


def sweep_algorithm(algorithm: str | None, *, ranks: int = 2, sizes: Sequence[int] = (), budget: float = 0.05,
                    tuning_file: str | Path | None = None, timeout: float = 300.0, nodes: int = 0,
                    link: str = "1gbit", env: dict[str, str] | None = None) -> dict:
    """One fresh job: MPI_Allreduce (float32 sum) over `sizes` with a forced algorithm, a tuning
    file, or MPICH's default (both None). Returns an `hpdl.bench` dict named after the setting.
    `nodes` > 0: the ranks on that many emulated nodes joined by `link` (a network, not shared memory);
    `env`: more of MPICH's variables for the job."""
    env = dict(env or {})
    if algorithm:
        env[ENV_ALGORITHM] = algorithm
    if tuning_file:
        env[ENV_TUNING_FILE] = str(Path(tuning_file).resolve())
    from hpdl.bench import message_sizes

    sizes = list(sizes) or message_sizes(8, 64 << 20, 4)
    out = json.loads(run_job(ranks, ["_sweep", ",".join(map(str, sizes)), str(budget)], env, timeout,
                             (nodes, link) if nodes else None))
    out["name"] = algorithm or ("tuned" if tuning_file else "default")
    return out


def _sweep_on_ranks(sizes: list[int], budget: float) -> dict:
    from mpi4py import MPI

    from hpdl import bench

    return bench.sweep(bench.library_allreduce(), MPI.COMM_WORLD, sizes, budget=budget)


# -- the report folder ------------------------------------------------------------------------

def report(folder: str | Path, sweeps: Sequence[dict], table: Sequence[tuple[int | None, str]], *,
           tuned: dict | None = None, default: dict | None = None, fit: dict | None = None) -> Path:
    """Write the measured sweeps (CSV), the plot, the selection table, MPICH's tuning file and an
    index.html summing them up into `folder`; returns the HTML page's path."""
    from hpdl import plots
    from hpdl.tables import html_table

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["setting,ranks,bytes,seconds"]
    for s in [*sweeps, *(x for x in (tuned, default) if x)]:
        lines += [f"{s['name']},{s['ranks']},{n},{t:.9g}" for n, t in zip(s["sizes"], s["seconds"])]
    (folder / "allreduce.csv").write_text("\n".join(lines) + "\n")
    write_tuning_file(table, folder / "mpich-allreduce.json")
    fig = plots.latency_bandwidth(list(sweeps), title=f"MPI_Allreduce, {sweeps[0]['ranks']} ranks")
    fig.savefig(folder / "allreduce.png", dpi=90)
    selection = html_table(["message per rank", "algorithm"],
                           [["≤ " + plots.size_label(u) if u else "larger", a] for u, a in table])
    ratio = ""
    if tuned and default:
        ratio = "<h2>Tuned against MPICH's default (time ratio, &gt; 1: tuned faster)</h2>" + html_table(
            None, [[plots.size_label(n), f"{d / t:.2f}×"]
                   for n, t, d in zip(tuned["sizes"], tuned["seconds"], default["seconds"])])
    model = ""
    if fit:
        model = (f"<h2>α-β-γ on these ranks</h2><p>α = {fit['alpha'] * 1e6:.2f} µs, β = 1/({1 / fit['beta'] / 1e9:.2f}"
                 f" GB/s), γ = 1/({1 / fit['gamma'] / 1e9:.2f} GB/s)</p>")
    page = f"""<!doctype html><meta charset="utf-8"><title>hpdl tuning report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td{{padding:0 1em}}</style>
<h1>Collective tuning report</h1><p>{time.strftime('%Y-%m-%d %H:%M')} · {sweeps[0]['ranks']} ranks ·
MPI_Allreduce of float32 sums. Files: <a href="allreduce.csv">allreduce.csv</a>,
<a href="mpich-allreduce.json">mpich-allreduce.json</a> (use it with
<code>{ENV_TUNING_FILE}=$PWD/mpich-allreduce.json</code>).</p>
<img src="allreduce.png" style="max-width:100%"><h2>Selection table</h2>
{selection}{ratio}{model}
"""
    path = folder / "index.html"
    path.write_text(page)
    return path


def _parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*([KMG]?)i?B?", text.strip(), re.I)
    if not m:
        raise HpdlError(f"{text!r} is not a size (e.g. 64M, 512K, 4096)")
    return int(m.group(1)) << {"": 0, "K": 10, "M": 20, "G": 30}[m.group(2).upper()]


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("_probe", "_sweep"):  # run on the ranks of a job started by run_job()
        from mpi4py import MPI

        sizes = [int(s) for s in argv[1].split(",")]
        result = _probe_on_ranks(sizes) if argv[0] == "_probe" else _sweep_on_ranks(sizes, float(argv[2]))
        if MPI.COMM_WORLD.Get_rank() == 0:
            print("HPDL-TUNE " + json.dumps(result), flush=True)
        return 0
    ap = argparse.ArgumentParser(prog="hpdl tune", description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4, help="ranks of each measuring job (default 4)")
    ap.add_argument("--largest", default="64M", help="largest message per rank (default 64M)")
    ap.add_argument("--algorithms", default=",".join(TABLE_ALGORITHMS), help="comma-separated MPICH algorithm names")
    ap.add_argument("--budget", type=float, default=0.05, help="seconds of timing per size and setting")
    ap.add_argument("--out", type=Path, default=Path("hpdl-tuning"), help="report folder (default ./hpdl-tuning)")
    args = ap.parse_args(argv)
    from hpdl.bench import message_sizes

    known = set(mpich_algorithms())
    chosen = [a for a in args.algorithms.split(",") if a]
    unknown = [a for a in chosen if a not in known or a not in CONTAINERS]
    if unknown:
        raise HpdlError(f"unknown algorithm(s) {unknown}; MPICH here offers {sorted(known & set(CONTAINERS))}")
    sizes = message_sizes(8, _parse_size(args.largest), 4)
    sweeps = []
    for alg in chosen:
        print(f"hpdl tune: {alg} on {args.ranks} ranks, {len(sizes)} sizes", flush=True)
        sweeps.append(sweep_algorithm(alg, ranks=args.ranks, sizes=sizes, budget=args.budget))
    table = selection_table(sweeps, keep=1.05)
    tuning = write_tuning_file(table, args.out / "mpich-allreduce.json")
    print("hpdl tune: tuned against default, same ranks, one after the other", flush=True)
    default = sweep_algorithm(None, ranks=args.ranks, sizes=sizes, budget=args.budget)
    tuned = sweep_algorithm(None, ranks=args.ranks, sizes=sizes, budget=args.budget, tuning_file=tuning)
    page = report(args.out, sweeps, table, tuned=tuned, default=default)
    for upto, alg in table:
        print(f"  up to {upto if upto else 'any':>10} B: {alg}")
    ratios = [d / t for d, t in zip(default["seconds"], tuned["seconds"])]
    print(f"hpdl tune: tuned/default speed ratio min {min(ratios):.2f}× max {max(ratios):.2f}×; report: {page}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
