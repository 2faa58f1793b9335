"""Rank side: checks on *how* a learner's code works, not only on what it returns.

Case modules call these from verify() on every rank. The client imports case modules too (for
their cases and hints), so nothing here imports mpi4py.MPI (that would start MPI in the
learner's kernel) or torch: both are only touched through the objects handed in.

- KIT_ANSWERS: the kit's own implementations of exercises; refused in every learner job.
- REDUCTIONS / DATA_COLLECTIVES: name lists for a case module's FORBIDDEN (recording.py, in the
  learner's job, records every call and refuses these, on any communicator and through
  torch.distributed).
- compare(): a result against the expected one, with dtype-aware tolerances and plain words.
- only_peers() / max_sends() / gather_calls() / broadcast_rounds(): the pattern of
  point-to-point messages (ring neighbours, a tree's fan-out and depth).
- wire_agrees() / received_at_least() / received_at_most() / allreduces_on_wire(): for a METERED module
  (meter.py), the bytes the kernel saw each rank send against its recorded calls (exercises built from
  messages), what reached a rank against what its result needs, at least or at most, and how many
  all-reduces its messages amount to.
- same_on_all_ranks() / same_as_root(): parameters identical across ranks (after a DDP or
  Horovod step), or equal to the root's (initial parameters broadcast).
- check_shards(): a distributed sampler's shards are disjoint, cover the data, equal length.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

from hpdl.checker.cases import Wrong


COLLECTIVES = [
    "Barrier", "barrier", "Bcast", "bcast", "Reduce", "reduce", "Allreduce", "allreduce",
    "Gather", "Gatherv", "gather", "Allgather", "Allgatherv", "allgather", "Scatter", "Scatterv",
    "scatter", "Alltoall", "Alltoallv", "Alltoallw", "alltoall", "Reduce_scatter",
    "Reduce_scatter_block", "Scan", "scan", "Exscan", "exscan", "Ibarrier", "Ibcast", "Ireduce",
    "Iallreduce", "Igather", "Igatherv", "Iallgather", "Iallgatherv", "Iscatter", "Iscatterv",
    "Ialltoall", "Ialltoallv", "Ialltoallw", "Ireduce_scatter", "Ireduce_scatter_block", "Iscan",
    "Iexscan", "Bcast_init", "Reduce_init", "Allreduce_init", "Allgather_init", "Gather_init",
    "Scatter_init", "Alltoall_init", "Reduce_scatter_init", "Reduce_scatter_block_init",
    # the rest of MPI-4's (an Allgatherv_init of every rank's gradients, then a mean, scored 12/12 unrecorded)
    "Allgatherv_init", "Gatherv_init", "Scatterv_init", "Alltoallv_init", "Alltoallw_init", "Scan_init",
    "Exscan_init", "Barrier_init",
    "Neighbor_allgather", "Neighbor_alltoall", "Neighbor_allgatherv", "Neighbor_alltoallv", "Neighbor_alltoallw",
    "neighbor_allgather", "neighbor_alltoall", "Ineighbor_allgather", "Ineighbor_allgatherv", "Ineighbor_alltoall",
    "Ineighbor_alltoallv", "Ineighbor_alltoallw", "Neighbor_allgather_init", "Neighbor_allgatherv_init",
    "Neighbor_alltoall_init", "Neighbor_alltoallv_init", "Neighbor_alltoallw_init",
]
_OWN = "this exercise asks you to write it yourself: the kit's version is not available while your code is checked"
#: The kit's own implementations of exercises (module.function -> why): in the learner's check
#: job each is replaced by a function that refuses, as a forbidden MPI call is (learner_job.py).
KIT_ANSWERS = {
    "hpdl.predict.predict_step_time": _OWN,
    "hpdl.predict.allreduce_seconds": _OWN + " (the α-β-γ cost of an all-reduce is part of the answer)",
    "hpdl.predict.comm_seconds": _OWN + " (the α-β-γ cost of an all-reduce is part of the answer)",
    "hpdl.predict.hierarchical_seconds": _OWN + " (the α-β-γ cost of an all-reduce is part of the answer)",
    "hpdl.predict.step": _OWN,
    "hpdl.tune.tuning_json": _OWN,
    "hpdl.tune.algorithm_for": _OWN,
    "hpdl.dp.throughput": _OWN,
    "hpdl.pipeline.one_f_one_b": _OWN + " (the 1F1B order of a stage's forwards and backwards is the exercise)",
}
#: torch's own data parallelism, which hooks backward and all-reduces the gradients for the learner:
#: DistributedDataParallel and the C++ Reducer under it (which a learner could drive by hand), and FSDP, whose
#: NO_SHARD strategy is DDP by another road. Refused where an exercise asks for what they do (DDP: 8/8 on
#: overlap_allreduce, its bucket caps set to the exercise's; FSDP wrapping each Linear passed its case of a
#: bucket per tensor)
TORCH_DATA_PARALLEL = {
    name: "this exercise asks you to write what torch's data parallelism does (buckets, hooks, all-reduces): "
          "DistributedDataParallel, its Reducer and FSDP are not available while your code is checked"
    for name in ("torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel",
                 "torch._C._distributed_c10d.Reducer", "torch.distributed.fsdp.FullyShardedDataParallel",
                 "torch.distributed.fsdp.fully_sharded_data_parallel.FullyShardedDataParallel",
                 "torch.distributed.fsdp.fully_shard")}
#: The allreduce family: what a hand-written allreduce must not call.
REDUCTIONS = [n for n in COLLECTIVES if "educe" in n or n in ("Scan", "scan", "Exscan", "exscan", "Iscan", "Iexscan")]
#: Every collective that moves data: what a point-to-point-only exercise must not call.
DATA_COLLECTIVES = [n for n in COLLECTIVES if "arrier" not in n]
#: The all-gathers (each rank's part to every rank; the recorder counts this rank's part), and the broadcasts
#: (MPI's, and torch.distributed's as the recorder names it; counted whole).
ALL_GATHERS = [n for n in COLLECTIVES if "llgather" in n]
BROADCASTS = ("Bcast", "bcast", "Ibcast", "Bcast_init", "broadcast")
#: Every call that sends a message (and so every way a message moves by hand): what an exercise built from
#: collectives must not call beside them.
SENDS = ["Send", "Ssend", "Bsend", "Rsend", "Isend", "Issend", "Ibsend", "Irsend", "Send_init", "Ssend_init",
         "Bsend_init", "Rsend_init", "Psend_init", "send", "ssend", "bsend", "isend", "issend", "ibsend",
         "Sendrecv", "sendrecv", "Sendrecv_replace", "Isendrecv", "Isendrecv_replace"]
#: calls that make a communicator: recorded (never refused), since the ranks exchange messages to agree on it
# in a check (recording._wrap) a blocking send of the standard mode runs as the synchronous one: MPI lets Send
# wait until its receive is posted, and does so past an eager limit. Over TCP (meter.OVER_TCP) every message went
# at once, so ranks that all Send before they Recv finished, and a ring, recursive doubling, ZeRO-1 and ZeRO-3 by
# hand so (the unsafe order lesson 03 shows hanging) scored full marks; now they hang, as on a cluster's large
# messages. Not in pipeline_step (its SEND_WAITS): the evidence of its order reads what eager sends put on the wire
SYNCHRONOUS = {"Send": "Ssend", "send": "ssend"}
# the point-to-point calls that return only once their message is in (the recorder, rendezvous.py)
BLOCKING_RECEIVES = ("Recv", "recv", "Sendrecv", "sendrecv", "Sendrecv_replace")

COMMUNICATOR_MAKERS = ["Dup", "Idup", "Dup_with_info", "Idup_with_info", "Split", "Split_type", "Create",
                       "Create_group", "Create_cart", "Create_graph", "Create_dist_graph",
                       "Create_dist_graph_adjacent", "Create_intercomm", "Merge"]


# -- results -----------------------------------------------------------------------------

def _describe(x: Any) -> str:
    if isinstance(x, np.ndarray):
        return f"an array of shape {x.shape} and dtype {x.dtype}"
    if x is None:
        return "None (did the function forget to `return`?)"
    if type(x).__name__ == "Opaque":  # wire.Opaque: something that is not plain data
        return f"a {x.type_name}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)} items"
    return f"a {type(x).__name__}"


def _as_array(x: Any):
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "detach") and hasattr(x, "numpy"):  # a torch tensor
        return x.detach().cpu().numpy()
    return None


def tolerance(dtype: np.dtype, scale: float) -> tuple[float, float]:
    """(rtol, atol) for sums computed in a different order than the reference's."""
    eps = np.finfo(dtype).eps if np.issubdtype(dtype, np.floating) else 0.0
    return 200 * eps, 200 * eps * max(1.0, scale)


def compare(got: Any, expected: Any, *, what: str = "result", rtol: float | None = None,
            atol: float | None = None, check_dtype: bool = True) -> Wrong | None:
    """None when `got` matches `expected` (array, tensor, or list/tuple of them), else a Wrong."""
    if isinstance(expected, (list, tuple)):
        if not isinstance(got, (list, tuple)):
            return Wrong(f"{what} is {_describe(got)}; expected a list of {len(expected)} arrays")
        if len(got) != len(expected):
            return Wrong(f"{what} has {len(got)} items; expected {len(expected)}")
        worst: Wrong | None = None
        for i, (g, e) in enumerate(zip(got, expected)):
            w = compare(g, e, what=f"{what}[{i}]", rtol=rtol, atol=atol, check_dtype=check_dtype)
            if w is not None and (worst is None or (w.max_error or np.inf) > (worst.max_error or -1)):
                worst = w
        return worst
    e = _as_array(expected)
    if e is None:
        return None if got == expected else Wrong(f"{what} is {got!r}; expected {expected!r}")
    g = _as_array(got)
    if g is None:
        return Wrong(f"{what} is {_describe(got)}; expected {_describe(e)}")
    if g.shape != e.shape:
        return Wrong(f"{what} has shape {g.shape}; expected {e.shape}")
    if check_dtype and g.dtype != e.dtype:
        return Wrong(f"{what} has dtype {g.dtype}; expected {e.dtype} (keep the input's dtype)")
    if e.size == 0:
        return None
    ef = e.astype(np.float64, copy=False)
    gf = g.astype(np.float64, copy=False)
    scale = float(np.max(np.abs(ef)))
    r, a = tolerance(e.dtype, scale)
    r, a = (rtol if rtol is not None else r), (atol if atol is not None else a)
    err = np.abs(gf - ef)
    apart = np.isnan(gf) != np.isnan(ef)  # a value where NaN was expected (an entry "held elsewhere"), or the reverse
    err = np.where(apart, np.inf, np.nan_to_num(err, nan=0.0))
    bad = apart | (err > a + r * np.abs(np.nan_to_num(ef, nan=0.0)))
    if not bad.any():
        return None
    flat = np.flatnonzero(bad.ravel())
    first = np.unravel_index(flat[0], e.shape)
    first_text = str(first[0]) if len(first) == 1 else str(tuple(int(i) for i in first))
    digits = next((d for d in (6, 9, 12) if f"{gf[first]:.{d}g}" != f"{ef[first]:.{d}g}"), 17)  # a difference shown
    return Wrong(
        f"{what}: {flat.size} of {e.size} values wrong (first at index {first_text}: got "
        f"{gf[first]:.{digits}g}, expected {ef[first]:.{digits}g})",
        max_error=float(err.max()),
    )


# -- message patterns ----------------------------------------------------------------------

def only_peers(ctx, allowed: Iterable[int], why: str) -> Wrong | None:
    """WRONG when this rank sent to or received from a rank outside `allowed`."""
    allowed = set(allowed)
    for c in ctx.calls:
        for peer, verb in ((c.dest, "sent to"), (c.source, "received from")):
            if peer is not None and peer not in allowed and peer != ctx.rank:
                return Wrong(f"rank {ctx.rank} {verb} rank {peer} ({c.name}); {why}")
    return None


# What an MPI adds on a TCP connection besides the data (measured here: MPICH ~75 bytes a message and
# ~60 back per large message received; Intel MPI ~6 KB to each peer for one Split at 4 ranks), with room.
# Calls earn room up to a cap, so a learner cannot buy room for hidden traffic with empty calls.
WIRE_SLACK = 16384  # bytes per peer: connection set-up, a barrier or two, MPI's own control messages
WIRE_PER_MESSAGE = 128  # per send recorded to the peer (its header), per receive from it (a reply)
WIRE_PER_COMMUNICATOR = 8192  # per communicator made (Dup, Split, ...): the ranks agree on its id
# MPICH's, measured with ss -ti over libfabric's tcp: a Dup, Split, Create_group, Create_cart or Idup ~200-400
# bytes to each peer at 2 and 4 ranks, Split_type ~800; with room. 8 Dups bought a cheat 64 KiB to hide, now 16
WIRE_PER_COMMUNICATOR_OF = {"MPICH": 2048}
WIRE_MESSAGES_CAP, WIRE_COMMUNICATORS_CAP = 64, 8


def wire_agrees(ctx) -> Wrong | None:
    """WRONG (forged: no case of the check counts) when the bytes this rank sent to a rank, as the
    kernel counted them outside the learner's process (ctx.wire), are not what the MPI calls
    recorded in the learner's process account for: more than those sends (calls hidden from the
    recorder, or messages bigger than recorded), much less (sends recorded that never happened),
    a connection to a process that is no rank, or a connection closed mid-check."""
    wire = ctx.wire
    if wire is None or ctx.size == 1:
        return None
    r = ctx.rank
    made = min(sum(1 for c in ctx.calls if c.name in COMMUNICATOR_MAKERS), WIRE_COMMUNICATORS_CAP)
    recorded = recorded_with_peers(ctx.calls, r)
    why = ("what your rank sent, counted by the system outside your process, is not what the MPI calls "
           "recorded in your process say: the recording was changed or bypassed")
    if wire.get("closed"):
        return Wrong(f"rank {r} closed a network connection to another rank during the check; {why}", forged=True)
    for peer, sent in sorted(wire.items()):
        if not isinstance(sent, int) or peer in ("closed", "received", "unseen"):  # not a peer's bytes
            continue
        mine, messages = recorded.get(int(peer), [0, 0]) if peer.isdigit() else (0, 0)
        allowed = (mine + WIRE_SLACK + WIRE_PER_MESSAGE * min(messages, WIRE_MESSAGES_CAP)
                   + WIRE_PER_COMMUNICATOR_OF.get(wire.get("mpi"), WIRE_PER_COMMUNICATOR) * made)
        if sent > allowed:  # a send the recorder could not size counts nothing: its object pickled only once
            if peer == "from ?":
                return Wrong(f"rank {r} received {sent} bytes from a process that is no rank; {why}", forged=True)
            whom = f"rank {peer}" if peer.isdigit() else "a process that is no rank"
            return Wrong(f"rank {r} sent {sent} bytes to {whom}, but its recorded calls account for at most "
                         f"{allowed} ({mine} bytes in {messages} messages with it); {why}", forged=True)
    for peer, (mine, messages) in sorted(recorded.items()):
        sent = wire.get(str(peer), 0)
        if mine > WIRE_SLACK and sent < 0.9 * mine:
            return Wrong(f"rank {r} recorded {mine} bytes sent to rank {peer}, but only {sent} went out; {why}",
                         forged=True)
    return None


def unseen_connections(ctx) -> Wrong:
    """WRONG (forged) for every rank when the job's ranks carried data the checker could not count: TCP
    connections gone before it could list them, or UDP datagrams (meter.opened: the kernel's counts, against
    the connections it listed). No honest way needs either: MPI and torch.distributed keep their connections."""
    n = ctx.wire.get("unseen")
    return Wrong(f"{n} network connection end(s) or datagram(s) that the checker could not count crossed between "
                 "the ranks (a connection opened and closed between two of its readings, or UDP): values must "
                 "move by your MPI calls", forged=True)


SYNC_ACK = 40  # bytes a receiver answers a synchronous send with (MPICH over tcp, measured): no data


def _received(ctx) -> int | None:
    """Bytes the other ranks sent this rank in this case, by the kernel's count, less the answers to its
    blocking sends (SYNCHRONOUS: 40 bytes back from a server that sent nothing passed for 10 values
    of new parameters); None where not read."""
    if ctx.wire is None or ctx.size == 1:
        return None
    answered = sum(1 for c in ctx.calls if c.name in SYNCHRONOUS and c.dest is not None and c.dest != ctx.rank)
    return max(0, int(ctx.wire.get("received", 0)) - SYNC_ACK * answered)


def allreduces_on_wire(ctx) -> float | None:
    """How many all-reduces the messages between the ranks in this case amount to, by the kernel's count
    (ctx.wire): on torch.distributed's connections (made in the case module's set_up()) and on the others
    (MPI's), the data segments every rank received over what one all-reduce took there at the job's start
    (its calibrate(), before any learner's code); the larger of the two. The larger, not the sum: a few
    small collectives on the other connections (a barrier or two beside torch's all-reduce) are worth a
    fraction of one all-reduce each, as is one all-reduce of a few values. None where not read."""
    wire = ctx.wire
    if wire is None or ctx.size == 1:
        return None
    seen, one = wire.get("all segments"), wire.get("calibration")
    if not isinstance(seen, dict) or not isinstance(one, dict) or not any(one.values()):
        return None
    # a kind one all-reduce took no segment on (no set_up(), say) but the case did: each segment one
    return max((n / max(1, one.get(kind, 0)) for kind, n in seen.items()), default=0.0)


READ_UP_TO = 4096  # values of each rank's vector a message's first values are looked for in (passed_on)


def vectors_to_read(ctx) -> list[np.ndarray]:
    """Every rank's vector (the case's first argument), for passed_on; a collective on ctx.comm, so every rank
    calls it before any early return. Empty where nothing is read: 2 ranks or fewer, an unmetered check (no
    send's first values noted), or vectors longer than READ_UP_TO (whose bytes the wire's slack cannot hide)."""
    x = np.asarray(ctx.args[0]).reshape(-1)
    wanted = ctx.size > 2 and ctx.wire is not None and x.size <= READ_UP_TO
    vectors = ctx.comm.allgather(x.astype(np.float64) if wanted else None)
    return [] if any(v is None for v in vectors) else vectors


def passed_on(ctx, vectors: list[np.ndarray], algorithm: str, apart: int | None = None) -> Wrong | None:
    """WRONG when no message this rank sent carried a sum, where the algorithm has every rank pass on
    partial sums (its values plus what it received): two or more messages, each carrying the rank's own values
    alone or values in no sum of the ranks' vectors (zeros, noise, text), to more than one partner (recursive
    doubling), or, with `apart` (the ring: a chunk's width, n // p), from places in its vector that far apart or
    not read at all (its own chunk goes out once, in the first step; every later message carries a sum).
    Read by the first values each send carried as it started (recording.HEAD; bytes read as values, readings),
    looked for (consecutive, or every k-th up to p) in the sums of every subset of the ranks' vectors, exact in
    the sum cases (_sums.vector). A show of the pattern (right partners, right sizes, nothing received used)
    beside a sum got some other way (MPI_Allreduce called by address through a CFUNCTYPE prototype, no Python
    lookup to refuse, within the wire's slack) scored 36/36 and 18/18: each message cut from the rank's own x,
    then each of zeros. One message that carries a sum, or another rank's values passed along (another
    algorithm, which the other checks name), clears the rank. Forged where a message carried no values found
    in any sum (zeros, noise, text); where each carried the rank's own values, another algorithm (telling: a
    chain's first rank sends only its own values on), which voids the check all the same."""
    r = ctx.rank
    if not vectors:
        return None
    totals = [(mask, np.sum([vectors[i] for i in range(ctx.size) if mask >> i & 1], axis=0))
              for mask in range(1, 1 << ctx.size)]
    starts, peers, in_no_sum = [], set(), 0  # own values alone at these places; values in no sum
    for c in ctx.calls:
        if c.dest in (None, r) or not (c.head or c.nbytes):
            continue
        found = [(mask, at) for head in readings(c.head) for mask, total in totals
                 for at in [_carries(total, head, ctx.size)] if at is not None]
        if any(mask != 1 << r for mask, _ in found):
            return None  # a sum, or another rank's values
        peers.add(c.dest)
        if found:
            starts.append(found[0][1])
        else:
            in_no_sum += 1  # zeros, noise, text, or what could not be read
    spread = max(starts, default=0) - min(starts, default=0)
    if len(starts) + in_no_sum < 2 or (len(peers) < 2 if apart is None else not in_no_sum and spread < max(1, apart)):
        return None
    why = f"in {algorithm} a rank passes on partial sums (its own values plus what it received) after its first message"
    if not in_no_sum:  # its own values, each: another algorithm (a chain's first rank), or a show of this one
        return Wrong(f"rank {r} sent {len(starts)} messages, each of its own values only, and none carried a sum: "
                     f"{why}. These are another algorithm's (a chain or a tree sends a rank's own values on), or a "
                     "show of its pattern beside a sum made some other way", telling=True)
    return Wrong(f"rank {r} sent {len(starts) + in_no_sum} messages and none carried a sum: {why}, so the sum it "
                 "returned was made some other way than these messages", forged=True)


def readings(head) -> list[tuple]:
    """What a send's first values may be (Call.head): its values as noted; or, for a message of bytes (noted
    as hex), those bytes read as float64 and as float32 values."""
    if isinstance(head, tuple):
        return [head] if head else []
    if not isinstance(head, str):
        return []
    raw = bytes.fromhex(head)
    return [tuple(float(v) for v in np.frombuffer(raw[:len(raw) // k * k], dtype))
            for dtype, k in ((np.float64, 8), (np.float32, 4)) if len(raw) >= k]


def _carries(total: np.ndarray, head, strides: int = 1) -> int | None:
    """Where `head` (a message's first values), or its first half at least, starts as a run of values of `total`,
    consecutive or every k-th for k up to `strides` (chunks cut as x[i::p], every p-th value, are chunks too: an
    honest ring of them read as no sum carried, 0/27), if it does. Its first half: a staging buffer of the widest
    chunk sends a shorter chunk with what its tail held before, and such a ring was read as forged."""
    starts = np.flatnonzero(total == head[0]) if len(head) else []
    for h in range(min(len(head), total.size), (len(head) + 1) // 2 - 1, -1):
        part = np.asarray(head[:h], dtype=total.dtype)
        at = next((int(s) for s in starts[:64] for k in range(1, max(1, strides) + 1)
                   if s + k * (h - 1) < total.size and np.array_equal(total[s:s + k * (h - 1) + 1:k], part)), None)
        if at is not None:
            return at
    return None


def received_at_least(ctx, nbytes: int, what: str) -> Wrong | None:
    """WRONG (forged) when, by the kernel's count (ctx.wire), fewer than `nbytes` reached this rank from
    the other ranks: the values it returned came some other way than messages between the ranks (files the ranks
    share, say). Nothing to say where the wire was not read."""
    got = _received(ctx)
    if got is None or got >= nbytes:
        return None
    return Wrong(f"rank {ctx.rank} received {got} bytes from the other ranks over the network, but {what} needs at "
                 f"least {nbytes}: the values reached it some other way than messages between the ranks", forged=True)


def received_for_allreduce(ctx, nbytes: int, what: str) -> Wrong | None:
    """received_at_least for an all-reduce of `nbytes` per rank: whatever the algorithm, a rank's result
    needs the other ranks' share of it, (p-1)/p of the bytes, to reach it."""
    return received_at_least(ctx, nbytes * (ctx.size - 1) // ctx.size, what)


def received_at_most(ctx, nbytes: int, what: str, hint: str | None = None) -> Wrong | None:
    """WRONG when, by the kernel's count (ctx.wire), more than `nbytes` reached this rank from the other
    ranks: more than `what` needs, so the algorithm moves something it should not (the weights, say)."""
    got = _received(ctx)
    if got is None or got <= nbytes:
        return None
    return Wrong(f"rank {ctx.rank} received {got} bytes from the other ranks over the network; {what} needs at most "
                 f"about {nbytes}", hint=hint)


def recorded_with_peers(calls, rank: int) -> dict[int, list[int]]:
    """{peer: [bytes rank's recorded sends put in messages to it, messages with it]} (a probe moves nothing)."""
    recorded: dict[int, list[int]] = {}
    for c in calls:
        for peer in {c.dest, c.source} - {None, rank}:
            row = recorded.setdefault(int(peer), [0, 0])
            row[0] += (c.nbytes or 0) if peer == c.dest else 0
            row[1] += 0 if peer != c.dest and "probe" in c.name.lower() else 1
    return recorded


def carried_by_calls(ctx, nbytes: int, what: str, everyone: list[list] | None = None) -> Wrong | None:
    """WRONG (forged: no case of the check counts) when the values this rank got right are more than its
    recorded messages could carry: at least half of `nbytes` (the values at half their precision) must
    have gone out in this rank's recorded sends, or, given every rank's calls (`everyone`, gather_calls),
    come in by the other ranks' recorded sends to it. For exercises of point-to-point messages only: MPI's
    collectives called by address in its C library (no Python name to refuse) move small cases within
    wire_agrees' slack, and a ring of no recorded message scored 27/27. Only where the wire was read (METERED,
    recording.install(sized=True)): elsewhere no send's bytes are noted."""
    if ctx.size == 1 or nbytes <= 0 or ctx.wire is None:  # unmetered: no send's bytes were noted
        return None
    r = ctx.rank
    if everyone is None:
        moved = sum(sent for sent, _ in recorded_with_peers(ctx.calls, r).values())
        way = "sent"
    else:
        moved = sum(recorded_with_peers(calls, peer).get(r, [0, 0])[0] for peer, calls in enumerate(everyone)
                    if peer != r)
        way = "received"
    if 2 * moved >= nbytes:
        return None
    return Wrong(f"rank {r} {way} {moved} bytes in the messages your MPI calls recorded, but {what} needs at least "
                 f"{nbytes} to move between the ranks: the values moved some other way than your MPI calls",
                 forged=True)


def brought_by_collectives(calls, size: int, part_slack: int = 1) -> int:
    """The most values this rank's recorded collective calls could bring it from the other ranks, by the recorder's
    counts: an all-gather or a gather, each other rank's part at `part_slack` values more than this rank's
    (torch.tensor_split's uneven parts; a rank with none all-gathers an empty part and gets the others'); any
    other collective (a reduction, a broadcast, an all-to-all, what this rank got of a reduce-scatter), its whole
    count. Generous: it is held against what a right result needs from the other ranks, so that a result no
    recorded call could have brought is told (MPI's collectives called at their address in its library have no
    Python name to record; in exercises built of collectives, the recorder alone saw them, and 15/15 and 6/6
    were scored with none recorded)."""
    moved = 0
    for c in calls:
        if c.dest is not None or not isinstance(c.count, int) or c.count < 0:
            continue
        called = c.name.split(":")[0]
        if called in ALL_GATHERS or called.lstrip("I").startswith(("Gather", "gather")):
            moved += (size - 1) * (c.count + part_slack)
        elif called in COLLECTIVES:
            moved += c.count
    return moved


def brought_too_little(ctx, moved: int, needed: int, what: str) -> Wrong | None:
    """WRONG (forged: no case counts) when the values this rank's recorded calls could bring it (`moved`:
    brought_by_collectives, brought_by_sends) are fewer than its right result needs from the other ranks (`what`:
    the result and its verb, "its right y needs")."""
    if moved >= needed:
        return None
    return Wrong(f"rank {ctx.rank}'s recorded MPI calls could bring it at most {moved} values from the other ranks, "
                 f"but {what} at least {needed} of theirs: the values moved some other way than your MPI calls",
                 forged=True)


def brought_by_sends(everyone: list[list], rank: int, item: int) -> int:
    """Values of `item` bytes the other ranks' recorded point-to-point sends to this rank carried (everyone:
    gather_calls)."""
    return sum(recorded_with_peers(calls, peer).get(rank, [0, 0])[0] for peer, calls in enumerate(everyone)
               if peer != rank) // max(1, item)


PICKLE_SLACK = 512  # bytes mpi4py's pickle of an array or tensor adds to its data (its header), per message
PICKLED_BYTES_FRAMING = 22  # bytes pickle adds to bytes or a bytearray (protocol 5, measured: 9 to 22)


def values_sent(ctx) -> dict[int, list[int]]:
    """{rank: the values in each message this rank sent it}: the recorded element count, or the message's
    bytes in the case's dtype when they say more (a pickled message's header, up to PICKLE_SLACK, aside).
    The bytes are what wire_agrees holds against the kernel's count, so an object that claims fewer
    elements than it carries (a vector wrapped in a dict, a bytes object) is measured by what it moves."""
    item = max(1, int(getattr(ctx.expected, "itemsize", 8)))
    out: dict[int, list[int]] = {}
    for c in ctx.calls:
        if c.dest is None or c.dest == ctx.rank:
            continue
        by_bytes = typed_values(c, item)  # a buffer's values, or pickled bytes' (x.tobytes()), read by their bytes
        if by_bytes is None:
            by_bytes = pickled_bytes_values(c, item)
        # a pickled list spends one byte more a value than the value's own (a Python float: 9 bytes): x.tolist()
        # sent by comm.sendrecv read as 1.125 times the vector and failed right code
        # and a numpy scalar's 11 (list(chunk): recording._framing)
        framing = c.exact if c.name[:1].islower() and isinstance(c.exact, int) else 1
        data = (c.nbytes or 0) - PICKLE_SLACK - (c.count or 0) * framing
        out.setdefault(int(c.dest), []).append(by_bytes if by_bytes is not None else max(c.count or 0, data // item))
    return out


def pickled_bytes_values(c, item: int) -> int | None:
    """The values of `item` bytes each that pickled bytes carry (x.tobytes() sent by comm.send): bytes whose
    first bytes were noted (recording.RAW) and whose pickle is their length and pickle's few bytes around them.
    Counted as one value a byte (the recorded count of bytes), an honest ring of chunk.tobytes() sent 8 times a
    chunk and scored 0/27. None for anything else (a big whole number's pickle is 4 bytes a counted word)."""
    if not (c.name[:1].islower() and isinstance(c.head, str) and isinstance(c.nbytes, int)
            and isinstance(c.count, int)):
        return None
    return -(-c.count // item) if 0 <= c.nbytes - c.count <= PICKLED_BYTES_FRAMING else None


def typed_values(c, item: int) -> int | None:
    """The values of `item` bytes each that a typed message (mpi4py's uppercase calls: a buffer) carries, from
    its bytes: the same chunk viewed as bytes or uint8 (a bytearray, .view(np.uint8)) counts as many elements
    as it has bytes, 4 or 8 times its values, and failed right code. None for a pickled object (lowercase
    calls), whose bytes are a pickle's, or where the bytes are unknown."""
    if c.name[:1].isupper() and isinstance(c.nbytes, int) and c.nbytes > 0:
        if isinstance(c.exact, int) and 0 < c.exact <= item and isinstance(c.count, int):
            return c.count  # a float64 copy of float32 values: each one value still (recording._exact)
        return c.nbytes // item
    return None


def sends(calls) -> list[int]:
    """The destinations of the point-to-point sends in `calls` (Sendrecv counts as a send)."""
    return [c.dest for c in calls if c.dest is not None]


def gather_calls(ctx) -> list[list]:
    """Every rank's recorded calls, indexed by rank. Collective on ctx.comm: call it on every rank."""
    return ctx.comm.allgather(list(ctx.calls))


def broadcast_rounds(calls_by_rank: list[list], root: int) -> int | None:
    """The rounds a broadcast needs along the tree the messages form (each rank sending one
    message per round, to its children in the order it sent to them: the smallest subtree first
    takes a round more, 3 at 4 ranks, and was once scored as the best order); None when they form
    no tree from `root` (a rank receiving twice or never, or from a rank that had nothing yet)."""
    p = len(calls_by_rank)
    parent: dict[int, int] = {}
    children: dict[int, list[int]] = {r: [] for r in range(p)}
    for r, calls in enumerate(calls_by_rank):
        for c in calls:
            if c.dest is not None and 0 <= c.dest < p and c.dest != r:
                if parent.get(c.dest) == r:
                    continue  # more messages to the same child (its shape first, a segmented send): one edge
                if c.dest in parent or c.dest == root:
                    return None
                parent[c.dest] = r
                children[r].append(c.dest)
    if set(parent) != set(range(p)) - {root}:
        return None

    def rounds(v: int, depth: int = 0) -> int | None:
        if depth > p:
            return None  # a cycle
        below = [rounds(c, depth + 1) for c in children[v]]
        if any(b is None for b in below):
            return None
        return max((i + 1 + b for i, b in enumerate(below)), default=0)

    return rounds(root)


def max_sends(ctx, limit: int, why: str) -> Wrong | None:
    """WRONG when this rank sent to more than `limit` other ranks: a tree's children, a
    butterfly's partners. Ranks, not messages: a message of metadata first (shape, dtype) or a
    long array sent in segments is still one edge of the pattern."""
    peers = sorted(set(sends(ctx.calls)) - {ctx.rank})
    if len(peers) > limit:
        return Wrong(f"rank {ctx.rank} sent to {len(peers)} ranks {peers}; {why} (at most {limit} with "
                     f"{ctx.size} ranks)")
    return None


# -- parameters across ranks ---------------------------------------------------------------

def params_of(obj: Any) -> list[np.ndarray]:
    """Arrays from a torch module, a state dict, a tensor, an array, or a list of these."""
    if hasattr(obj, "parameters") and callable(obj.parameters):
        return [p.detach().cpu().numpy() for p in obj.parameters()]
    if isinstance(obj, dict):
        return [a for v in obj.values() for a in params_of(v)]
    if isinstance(obj, (list, tuple)):
        return [a for v in obj for a in params_of(v)]
    a = _as_array(obj)
    if a is not None:
        return [a]
    if obj is None:
        raise TypeError("None holds no parameters")
    a = np.asarray(obj)
    if a.dtype == object:
        raise TypeError(f"{type(obj).__name__} holds no numbers")
    return [a]


def _flat(obj: Any) -> np.ndarray | None:
    """All values as one float64 vector; None when `obj` holds no numbers."""
    try:
        arrays = params_of(obj)
        if not arrays:
            return np.zeros(0)
        return np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in arrays])
    except (TypeError, ValueError):
        return None


def same_as_root(comm, obj: Any, *, root: int = 0, what: str = "parameters", atol: float = 0.0) -> Wrong | None:
    """Every rank's `obj` equals the root's (e.g. initial parameters after a broadcast).

    Collective on `comm`: call it on every rank, before any check that may return early.
    Returns a Wrong on the ranks that differ (or that hold no numbers at all).
    """
    rank = comm.Get_rank()
    mine = _flat(obj)
    sizes = comm.allgather(-1 if mine is None else mine.size)
    if mine is None:
        return Wrong(f"rank {rank} holds no {what} (got {_describe(obj)})")
    if min(sizes) < 0:  # those ranks report it; no rank goes on to the Bcast below
        return None
    if len(set(sizes)) > 1:
        return Wrong(f"ranks hold different numbers of {what} values: {sizes}")
    theirs = mine.copy() if rank == root else np.empty_like(mine)
    comm.Bcast(theirs, root=root)
    diff = float(np.max(np.abs(mine - theirs))) if mine.size else 0.0
    if np.isnan(mine).any() != np.isnan(theirs).any():
        diff = float("inf")
    if diff > atol:
        return Wrong(f"rank {rank}'s {what} differ from rank {root}'s by up to {diff:.3g}", max_error=diff)
    return None


def same_on_all_ranks(comm, obj: Any, *, what: str = "parameters", atol: float = 0.0) -> Wrong | None:
    """Every rank holds identical `obj` (after a data-parallel step they must not drift)."""
    return same_as_root(comm, obj, root=0, what=what, atol=atol)


def check_shards(comm, indices: Iterable[int], n: int, *, disjoint: bool = True, cover: bool = True,
                 equal_length: bool = True) -> Wrong | None:
    """A distributed sampler's shards: disjoint, covering range(n), all the same length.

    Collective on `comm`. Returns a Wrong on each rank involved in a problem.
    """
    rank = comm.Get_rank()
    mine = [int(i) for i in indices]
    shards = comm.allgather(mine)
    problems = []
    if equal_length:
        lengths = [len(s) for s in shards]
        if len(set(lengths)) > 1 and len(mine) != max(lengths):
            problems.append(f"rank {rank} has {len(mine)} indices, others up to {max(lengths)} (lengths {lengths})")
    if disjoint:
        seen = {}
        for r, s in enumerate(shards):
            for i in s:
                seen.setdefault(i, set()).add(r)
        shared = sorted(i for i in mine if len(seen[i]) > 1)
        dups = len(mine) - len(set(mine))
        if shared:
            others = sorted(set().union(*(seen[i] for i in shared)) - {rank})
            problems.append(f"rank {rank} shares {len(shared)} indices with rank(s) {others} (e.g. {shared[0]})")
        elif dups:
            problems.append(f"rank {rank} has {dups} repeated indices")
    if cover:
        union = set().union(*map(set, shards)) if shards else set()
        missing = sorted(set(range(n)) - union)
        outside = sorted(i for i in set(mine) if not 0 <= i < n)
        if missing:
            problems.append(f"no rank has {len(missing)} of the {n} samples (e.g. {missing[0]})")
        if outside:
            problems.append(f"rank {rank} has indices outside 0..{n - 1} (e.g. {outside[0]})")
    return Wrong("; ".join(problems)) if problems else None
