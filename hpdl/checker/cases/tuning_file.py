"""Checks for lesson 07's second exercise: a selection table turned into MPICH's own tuning file.

    def tuning_file(table) -> dict
        # table: [(up_to_bytes, algorithm), ..., (None, algorithm)], sizes growing;
        # return the JSON object MPICH reads from MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE

The check is MPICH itself, run on the checker's side (verify(), in the reference job: nothing
in the learner's process decides, hpdl.tune included). Rank 0 writes what the learner returned
to a file and starts a fresh 4-rank `mpiexec` job with MPIR_CVAR_COLL_SELECTION_TUNING_JSON_FILE pointing at it; there
an MPI_Allreduce with a user-defined sum records how MPICH calls it, which tells the algorithm
MPICH really ran (hpdl.tune.classify). Each table row is probed at its boundary, 16 bytes past
it and inside it; every probe must show the row's algorithm. A file MPICH refuses, a missing
`=any` branch, `<` for `<=`, rows in the wrong order, unknown algorithm names: each shows up as
the wrong algorithm (or a refused file) at some probe. hpdl.tune.problems() words the hint.
MPICH needs rules for every collective, so the learner's allreduce tree is written into MPICH's
own rules (hpdl.tune.write_tuning_file). The tables use recursive doubling and the ring:
MPICH runs reduce-scatter + allgather only for built-in operations (with the probe's
user-defined sum it stops: "Assertion failed ... HANDLE_IS_BUILTIN(op)").
"""
from __future__ import annotations

import json
import os
import re
import tempfile

from hpdl.checker.cases import Case, Wrong, nonce_seed

SIGNATURE = "tuning_file(table: list[tuple[int | None, str]]) -> dict   # MPICH's selection JSON"
RANKS = (1, 2)
TIMEOUT = 90.0
PRIVATE_INPUTS = True  # the table's boundaries drawn with the check's nonce where there is one (inputs())
PROBE_RANKS = 4
PROBE_TIMEOUT = 75.0  # s: MPICH's run on the checker's side
VERIFY_TIMEOUT = PROBE_TIMEOUT + 20  # s: the checker's time for verify(), which runs it
MAX_JSON = 1 << 20  # characters: MPICH reads the file on the checker's side
# bytes per rank: the open-ended last row is probed this far too (probed up to 4× its start only, a file that
# ran another algorithm from there on scored 8/8)
LARGE_PROBE = 1 << 20


def cases(size):
    slow = 1e6
    return [
        Case("2 KiB: recursive doubling, then the ring",
             {"table": [[2048, "recursive_doubling"], [None, "ring"]]}, slow_factor=slow),
        Case("three rows", {"table": [[1024, "ring"], [65536, "recursive_doubling"], [None, "ring"]]},
             slow_factor=slow),
        Case("one row: ring for every size", {"table": [[None, "ring"]]}, slow_factor=slow),
        Case("four rows", {"table": [[512, "recursive_doubling"], [8192, "ring"], [131072, "recursive_doubling"],
                                     [None, "ring"]]}, hidden=True, slow_factor=slow),
    ]


def probes(table) -> list[tuple[int, str]]:
    """(bytes per rank, the algorithm the table picks there): each boundary, 16 B past it, and inside.

    Sizes stay multiples of 16 B and at least 64 B, so every algorithm has a few elements per rank.
    """
    out, low = [], 0
    for upto, name in table:
        if upto is None:  # and far beyond the last boundary, where a training's gradients are (MiB)
            out += [(max(low + 16, 64), name), (max(low * 4, 1024), name), (max(low * 64, LARGE_PROBE), name)]
        else:
            out += [(upto, name), (max(64, (low + upto) // 32 * 16), name)] + ([(low + 16, name)] if low else [])
            low = upto
    return sorted(set(out))


def inputs(case, rank, size):
    """The case's table; with the check's nonce (grading, PRIVATE_INPUTS) each boundary moved to 1/2, 1 or 2
    times itself, plus a multiple of 16 B, still growing: a file made beforehand for the public tables
    (the kit's own tools run outside the check, or a stripped kit's *.expected) fits no graded case."""
    import random

    table = [list(row) for row in case.params["table"]]
    if case.params.get("nonce") is not None:
        rng, low = random.Random(nonce_seed({**case.params, "seed": case.name})), 0
        for row in table:
            if row[0] is not None:
                row[0] = max(low + 64, int(row[0] * rng.choice((0.5, 1, 2))) // 16 * 16 + 16 * rng.randrange(1, 8))
                low = row[0]
    return ([tuple(row) for row in table],)


def call(fn, comm, args):
    """Everyone builds the file and hands it back as data: MPICH runs it on the checker's side (verify)."""
    (table,) = args
    obj = fn([tuple(row) for row in table])
    try:
        text = json.dumps(obj)  # the file MPICH reads is JSON: anything else is refused here
    except (TypeError, ValueError) as exc:
        return {"error": f"what tuning_file returned cannot be written as JSON: {exc}"}
    if len(text) > MAX_JSON:
        return {"error": f"what tuning_file returned is {len(text)} characters of JSON; a selection table "
                         f"is a few hundred"}
    return {"json": obj}


def reference(comm, table):
    return {"table": [list(row) for row in table]}


def probe(table, obj) -> dict:
    """MPICH run with the learner's file (a fresh job of PROBE_RANKS ranks): the algorithm at each probe."""
    from hpdl import tune
    from hpdl.errors import HpdlError

    fd, path = tempfile.mkstemp(prefix="hpdl-tuning-", suffix=".json")
    os.close(fd)
    try:
        tune.write_tuning_file(obj, path)
        points = probes(table)
        seen = tune.probe([n for n, _ in points], ranks=PROBE_RANKS, tuning_file=path, timeout=PROBE_TIMEOUT)
        return {"probe": [[n, name, tune.classify(seen[n], max(1, n // 4))] for n, name in points]}
    except HpdlError as exc:
        return {"error": f"MPICH did not run with this file: {exc}"}
    finally:
        os.remove(path)


def verify(case, ctx):
    """On the checker's side, so nothing in the learner's process (hpdl.tune included) has a say."""
    from hpdl import tune

    got = ctx.got if isinstance(ctx.got, dict) else {"error": f"the check got {type(ctx.got).__name__} back"}
    obj = got.get("json")
    (table,) = ctx.args  # the table asked (drawn with the nonce in grading)
    test = _beyond_size(obj) if "error" not in got and isinstance(obj, dict) else None
    if test is not None:  # the same on every rank: none goes on to the collective below
        return Wrong(f"your file chooses allreduce's algorithm by {test!r} as well as by message size, with "
                     "different algorithms behind it; the table says which algorithm runs for each size, whatever "
                     "the call", hint="one level of 'avg_msg_size' tests under 'comm_type=intra', nothing else: "
                                      "the check's probe is one kind of call, your gradients' all-reduces another "
                                      "(MPI_SUM, built in), and each must run the table's algorithm.")
    ran = probe(table, obj) if ctx.rank == 0 and "error" not in got and isinstance(obj, dict) \
        else None
    ran = ctx.comm.bcast(ran, root=0)  # collective: every rank, before any return
    problems = tune.problems(obj) if isinstance(obj, dict) else [f"returned {type(obj).__name__}, not a dict"]
    hint = "; ".join(problems) or None
    if got.get("error") or (ran or {}).get("error"):
        return Wrong(_first_words(got.get("error") or ran["error"]), hint=hint)
    if ran is None:
        return Wrong(hint) if hint and ctx.rank == 0 else None
    wrong = [(n, want, algo) for n, want, algo in ran["probe"] if want not in algo.split("|")]
    if not wrong:
        return None
    n, want, algo = wrong[0]
    return Wrong(f"{len(wrong)} of {len(ran['probe'])} probes ran the wrong algorithm; e.g. at {n} B per rank "
                 f"the table says {want}, MPICH ran {algo}", hint=hint or _guess(table, ran))


def _first_words(text: str) -> str:
    """An error's first lines, without the backtrace MPICH prints when it stops (lines of library paths)."""
    lines = [line for line in str(text).splitlines() if line.strip() and not line.lstrip().startswith(("/", "["))]
    return " ".join(lines[:3])[:600]


def _beyond_size(obj: dict) -> str | None:
    """The first test in the learner's allreduce tree that picks by something other than the message size
    (is_op_built_in, comm_size, is_sbuf_inplace...: MPICH knows many) with different branches behind it;
    None where only avg_msg_size (and comm_type, intra or inter) decides. The probe makes one kind of call
    at one rank count: a branch on anything else ran the table for the probe and something else for the
    calls a training makes (helper-found: 8/8 with the table behind is_op_built_in=no)."""
    def name(key) -> str | None:  # what a test asks about; None for a catch-all ("any", "...=any": csel.c)
        key = str(key).replace(" ", "")
        return None if key == "any" or key.endswith("=any") else re.split(r"[<=]", key, maxsplit=1)[0]

    def walk(node) -> str | None:
        if not isinstance(node, dict) or any(str(k).replace(" ", "").startswith("algorithm=") for k in node):
            return None
        branches = {json.dumps(child, sort_keys=True) for child in node.values()}
        other = [str(k) for k in node if name(k) not in (None, "avg_msg_size", "comm_type")]
        if other and len(branches) > 1:
            return other[0]
        return next((found for child in node.values() if (found := walk(child)) is not None), None)

    return walk(obj.get("collective=allreduce"))


def _guess(table, got) -> str:
    bounds = {upto for upto, _ in table if upto is not None}
    off = [n for n, want, ran in got["probe"] if want not in ran.split("|")]
    if off and all(n in bounds for n in off):
        return ("wrong exactly at the boundaries: a row 'up to N bytes' includes N, so the test is "
                "'avg_msg_size<=N', not '<'.")
    if any(n // 4 in bounds for n in off):
        return "avg_msg_size counts bytes per rank, not elements."
    return ("MPICH tries the keys of each level in order and takes the first that holds: rows from small to "
            "large, the last one 'avg_msg_size=any', each leading to {'algorithm=MPIR_Allreduce_intra_<name>': {}}.")
