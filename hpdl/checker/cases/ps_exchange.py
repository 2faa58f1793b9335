"""Checks for lesson 02's exercise: one exchange with a parameter server, point-to-point.

    def ps_exchange(comm, grads, params, lr) -> np.ndarray:
        # rank 0 is the server and holds no data (its `grads` is None); every other rank is a
        # worker. Workers send their gradients to the server; the server averages them over
        # the workers, takes one SGD step (params - lr * average) and sends the new parameters
        # back to every worker. Every rank returns the new parameters.

Built from Send/Recv (or send/recv): collectives are rejected, and workers may talk only to
the server. The server's parameters are the current ones; a worker's `params` is its own copy, of
the same shape and dtype but out of date (its values drawn apart): the new parameters reach a worker
from the server or not at all (a server that sent the average gradient, each worker stepping alone,
scored 12/12 wherever the recorder could not read what its messages began with: a list, a count and
displacement). The gradients are drawn with the check's nonce: a rank cannot draw the others' and
send zeros in their place.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong
from hpdl.checker.cases._sums import LARGE_TIMEOUT

SIGNATURE = "ps_exchange(comm, grads, params, lr) -> np.ndarray   # rank 0 serves; grads is None there"
RANKS = (2, 3, 4)
TIMEOUT = 5.0
METERED = True  # the bytes each rank sends are counted outside its process (meter.py), against the recorder
PRIVATE_INPUTS = True  # each rank gets its gradients as data, drawn with the check's nonce: none can draw another's
FORBIDDEN = {name: "this exercise builds the exchange from point-to-point messages (Send and Recv)"
             for name in hooks.DATA_COLLECTIVES}
HINT_ONLY_ROOT = ("only the server ends with the new parameters: each worker receives them from the server and "
                  "returns them (a worker's own params is an out-of-date copy: a step taken on it is not the "
                  "server's).")


def cases(size):
    return [
        Case("n=1", {"n": 1, "lr": 0.5}),
        # float32 here too: receive buffers made with np.empty(n) (float64 whatever was sent) failed one case of four
        Case("n=10, float32", {"n": 10, "lr": 0.1, "dtype": "float32"}),
        Case("n=1000, float32", {"n": 1000, "lr": 0.01, "dtype": "float32"}),
        # a pickled list of numpy scalars (list(params)) took 3.6-7.7 s here on a busy host, and HANG is no verdict
        # on right code
        Case("n=100000", {"n": 100_000, "lr": 0.05}, hidden=True, witness=True, timeout=LARGE_TIMEOUT),
    ]


def _grads(case, rank):
    p = case.params
    rng = np.random.default_rng([p.get("nonce", 0), 1000 + rank])
    return rng.standard_normal(p["n"]).astype(p.get("dtype", "float64"))


def _params(case, rank: int = 0):
    """The server's parameters (rank 0), or a worker's out-of-date copy of them."""
    p = case.params
    rng = np.random.default_rng([p.get("nonce", 0), 7] if rank == 0 else [p.get("nonce", 0), 8, rank])
    return rng.standard_normal(p["n"]).astype(p.get("dtype", "float64"))


def inputs(case, rank, size):
    grads = None if rank == 0 else _grads(case, rank)
    return grads, _params(case, rank), case.params["lr"]


def reference(comm, grads, params, lr):
    rank, size = comm.Get_rank(), comm.Get_size()
    if rank == 0:
        total = np.zeros_like(params)
        incoming = np.empty_like(params)
        for worker in range(1, size):
            comm.Recv(incoming, source=worker, tag=0)
            total += incoming
        new = params - lr * total / (size - 1)
        for worker in range(1, size):
            comm.Send(new, dest=worker, tag=1)
        return new
    comm.Send(grads, dest=0, tag=0)
    new = np.empty_like(params)
    comm.Recv(new, source=0, tag=1)
    return new


def verify(case, ctx):
    if ctx.rank == 0:
        workers = set(range(1, ctx.size))
        pattern = hooks.only_peers(ctx, workers | {0}, "the server talks to its workers")
    else:
        pattern = hooks.only_peers(ctx, {0}, "in a parameter server, workers talk only to the server (rank 0)")
    everyone = hooks.gather_calls(ctx)  # collective: on every rank, before any early return
    # the server's step needs every worker's gradient, a worker's result the server's parameters: as messages
    need = (ctx.size - 1) * ctx.expected.nbytes if ctx.rank == 0 else ctx.expected.nbytes
    return (hooks.wire_agrees(ctx) or hooks.compare(ctx.got, ctx.expected, what="the new parameters") or pattern
            or hooks.received_at_least(ctx, need, "the workers' gradients" if ctx.rank == 0 else "the new parameters")
            or _one_vector_each_way(ctx, everyone) or _sends_the_new_parameters(ctx))


def _sends_the_new_parameters(ctx):
    """What the server's messages to each worker carried begins as the new parameters do (the recorder notes the
    first values of each array a rank sends): a server that sent the average gradient, each worker stepping
    alone, moved as many values and scored 12/12. Beside a header (METADATA values or fewer), where n is more."""
    n = ctx.expected.size
    if ctx.rank != 0 or n <= METADATA:
        return None
    for worker in range(1, ctx.size):
        heads = [hooks.readings(c.head) for c in ctx.calls if c.dest == worker and c.head and (c.count or 0) > METADATA]
        heads = [h for h in heads if h]
        if heads and not any(np.allclose(h, ctx.expected[:len(h)], rtol=1e-4, atol=1e-6) for h in heads[0]):
            return Wrong(f"the server sent worker {worker} values that are not the new parameters (its message "
                         f"began {_shown(heads[0][-1])}; the new parameters begin {_shown(ctx.expected)})",
                         hint="the server takes the step itself (params - lr * average) and sends the result: the "
                              "workers do not step on their own.")
    return None


def _shown(values) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in list(values)[:3]) + ", …]"


def _one_vector_each_way(ctx, everyone: list[list]):
    """The server sends each worker its new parameters, n values, and a worker receives nothing else: a server
    that relays every worker's gradients to every worker, each worker stepping alone, moved (p-1)·n to each and
    scored 12/12. The recorder counts the values in each message; the kernel, what reached a worker: at most the
    n values in float64, or what the server's messages to it were recorded to carry, where more (a pickled list
    of numpy scalars, 19 bytes a float64: list(new_params) failed 100000 values, and with them every case)."""
    n = ctx.expected.size
    if ctx.rank == 0:
        item = ctx.expected.itemsize  # a buffer's values by its bytes; a pickled list of floats's by its count
        for worker in range(1, ctx.size):  # (n: its bytes are more); pickled bytes (x.tobytes()) by their bytes
            # the fewer of the two: a float64 message of the n values holds the bytes of 2n float32 ones (6/12)
            values = [min((v for v in (hooks.typed_values(c, item), hooks.pickled_bytes_values(c, item), c.count)
                           if isinstance(v, int)), default=None)
                      for c in ctx.calls if c.dest == worker]
            values = [v for v in values if isinstance(v, int)]
            if sum(values) > n + METADATA * (len(values) - 1):  # a shape or a length first, say
                return Wrong(f"the server sent worker {worker} {sum(values)} values; the new parameters are {n}",
                             hint="the server averages the gradients and takes the step itself, then sends each "
                                  "worker the new parameters: one vector, not the workers' gradients.")
        return None
    # room for the n values in float64 whatever their dtype, or for what the server's messages to this worker
    # carried (held to n values above, and to what the kernel saw it send: wire_agrees)
    recorded = hooks.recorded_with_peers(everyone[0], 0).get(ctx.rank, [0, 0])[0] if everyone else 0
    return hooks.received_at_most(ctx, max(int(1.25 * ctx.expected.size * 8), recorded) + hooks.WIRE_SLACK,
                                  "the new parameters from the server",
                                  hint="the server sends each worker the new parameters, one vector.")


METADATA = 4  # values each message beside the vector's may carry: a shape or a length first (one vector of n=1
# and a message of one value cannot be told apart)


_DTYPES = ("np.empty(n) and np.zeros(n) are float64 whatever was sent: make each receive buffer in the dtype the "
           "message is sent in (np.empty_like(params)); a float32 message received into float64 reads its bytes as "
           "other numbers.")


def diagnose(case, ctx):
    got = ctx.got
    if isinstance(got, np.ndarray) and got.dtype != ctx.expected.dtype:
        return _DTYPES
    if not isinstance(got, np.ndarray) or got.shape != ctx.expected.shape:
        return None
    if np.issubdtype(got.dtype, np.floating) and not (np.abs(got) < 1e30).all():
        return "values of 1e30 and more, or NaN: " + _DTYPES
    _, mine, lr = ctx.args
    if np.allclose(got, mine):
        if ctx.rank == 0:
            return "the server returned the old parameters: apply params - lr * average gradient."
        return "this worker returned its own copy of the parameters: it must receive the new ones from the server."
    total = sum(_grads(ctx.case, r) for r in range(1, ctx.size)).astype(np.float64)
    if ctx.rank != 0 and np.allclose(got, mine - lr * total / (ctx.size - 1), rtol=1e-4, atol=1e-5):
        return ("this worker took the step itself, on its own copy of the parameters, which is out of date: the "
                "server's are the current ones. The server takes the step and sends each worker the result.")
    params = _params(ctx.case)
    if np.allclose(got, params - lr * total / (ctx.size - 1), rtol=1e-4, atol=1e-5):
        return None  # right values (with one worker, its sum is its average): the mistake is elsewhere
    for label, step in (
        ("you summed the gradients: divide by the number of workers, size - 1.", lr * total),
        ("you divided by size; the server holds no gradient, so average over the size - 1 workers.",
         lr * total / ctx.size),
        ("the learning rate is missing: params - lr * average.", total / (ctx.size - 1)),
        ("the sign is flipped: SGD steps against the gradient, params - lr * average.", -lr * total / (ctx.size - 1)),
    ):
        if np.allclose(got, params - step, rtol=1e-4, atol=1e-5):
            return label
    return None
