"""Checks for lesson 10's first exercise: one 1F1B training step of a pipeline stage, over mpi4py.

    def pipeline_step(comm, stage, batch, targets, m) -> float | None:
        # rank s of comm holds stage s of the model (an nn.Module: its consecutive layers).
        # batch (B, W): on rank 0 the inputs; on the other ranks zeros of the shape of what
        #   arrives from the previous stage: receive into its micro-batches.
        # targets (B,): the labels, on every rank (the last stage uses them).
        # Micro-batch i is batch.tensor_split(m)[i] (the first B % m have one row more).
        # 1F1B: stage s runs min(p-s-1, m) forwards to fill the pipe, then one forward and one
        # backward at a time, then the backwards left; backwards in micro-batch order. Messages
        # with comm.Send/Isend/Recv of tensor.numpy(): activations forward, gradients backward.
        # Afterwards every p.grad of the stage is the gradient of F.cross_entropy(model(batch),
        # targets), the whole batch's mean loss. Return that loss (a float) on the last rank;
        # None on the others.

The check runs the learner's stage on 1-4 ranks and decides on behaviour, observed while it runs:
- on every rank, each gradient against the single-device model's (the whole model on the whole
  batch), and the loss on the last rank;
- the order in which the stage ran its micro-batches forward and backward: the case's call()
  hooks the stage's last layer (a forward hook, then a hook on the output's gradient) in the
  learner's own job, so the order is what autograd did, not what the source says. GPipe's order
  (all forwards, then all backwards) gives the right gradients but holds m micro-batches'
  activations where 1F1B holds at most p - s: rejected, with the peak it held;
- the same order, seen from outside the learner's processes in one case ("hold", checker/hold.py):
  the checker holds the last stage still (SIGSTOP) before its code runs and reads from the kernel
  the bytes each stage sends the next meanwhile. No gradient can come back then: 1F1B's stage s
  sends min(p-s, m) micro-batches' activations and waits, GPipe's sends all m. More than 1F1B's
  while the hooks said 1F1B is a forged order, and so is a last stage that skipped being held: the
  check scores nothing. A stage that sends nothing meanwhile waited on a later stage before its
  first forward: the case is WRONG (a barrier first, say). And in that case, before each forward 1F1B
  runs only after a gradient came back, the stage waits while the checker reads the wire ("pause":
  "alone"): that many gradients must have come back from the next stage, and no more activations than
  it has made gone to it. A stage that sends 1F1B's first forwards, waits, then runs GPipe's order
  (or GPipe with blocking Sends, which on 2 ranks wait for a held receiver after the first) has no
  gradient back by its next forward: the hooks' order was not the order run, and the check scores
  nothing;
- each micro-batch each way, of its size (tensor_split's, also when B is not divisible by m), in one
  message or in parts one after another (a header of a few values, its shape, first is fine), between
  neighbouring stages only;
- the bytes each stage sent to each rank, counted by the kernel outside the learner's process
  (METERED), against what its recorded sends account for, and what reached it against what the
  activations and gradients need: a stage that took the others' layers by a message hidden from
  the recorder, or its values through files, scores nothing. How many messages carried them is
  the recorder's word (a learner who splits one in two behind it gains nothing).
A send/recv order that deadlocks ends as HANG, naming the stuck ranks and their lines. One that finishes
only because MPI sent small messages at once (eager), and hangs once each Send waits for its receive, as
it does past the eager limit with real activations, is WRONG (checker/rendezvous.py replays the ranks'
recorded calls so, an Isend waited for at once counted as the Send it is). The kit's own schedule
(hpdl.pipeline.one_f_one_b) is refused inside the check (hooks.KIT_ANSWERS).
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks, rendezvous
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points

SIGNATURE = "pipeline_step(comm, stage, batch, targets, m) -> float | None   # 1F1B; the loss on the last rank"
RANKS = (1, 2, 3, 4)
PRIVATE_INPUTS = True  # each rank gets its own layers (and rank 0 the batch) as data: the rest come by message
METERED = True  # the bytes each stage sends to each rank, counted by the kernel (meter.py), against its recording
TIMEOUT = 30.0  # the first case of a job pays for importing torch
WIDTH, CLASSES = 16, 10
HINT_ONLY_ROOT = None  # ranks differ in what they return (the loss on the last, None elsewhere): the case's own hints
SELF_REPORTED = ("when the first stage ran its backwards, as the hooks on its last layer record it: it sends no "
                 "gradient, so no other rank shows it (the later stages' order is read on the wire), and what it "
                 "holds meanwhile does not stand out of what MPI's and the allocator's buffers hold")
# a blocking Send here sends at once, as MPI's eager protocol does (not hooks.SYNCHRONOUS): the evidence of the
# order (a stage held still while the others' activations are counted) reads what the stages send while it waits
SEND_WAITS = False
FORBIDDEN = {name: "a pipeline stage exchanges activations and gradients with its neighbours in point-to-point "
                   "messages (Send/Isend and Recv)" for name in hooks.DATA_COLLECTIVES}


def cases(size):
    slow = 1e6  # tiny stages: timing says nothing here
    points = one_rank_points(size)  # on one rank, code with nothing distributed in it is right
    # in every case of more than one micro-batch, each stage waits before each forward 1F1B runs only after a
    # gradient came back, while the checker reads the wire ("pause": "alone", _gradients_before_forwards): GPipe
    # run where only the hooks' list saw it, rewritten, scored 18/18 when the wire was read in the held case alone
    read = {"pause": "alone"}
    return [
        Case("8 layers, 12 rows in 4 micro-batches", {"layers": 8, "rows": 12, "micro": 4, "seed": 1, **read},
             slow_factor=slow, points=points),
        Case("4 layers, 10 rows in 4 micro-batches (3, 3, 2, 2)", {"layers": 4, "rows": 10, "micro": 4, "seed": 2,
                                                                  **read}, slow_factor=slow, points=points),
        Case("6 layers, 6 rows in 4 micro-batches (2, 2, 1, 1)", {"layers": 6, "rows": 6, "micro": 4, "seed": 3,
                                                                 **read}, slow_factor=slow, points=points),
        Case("4 layers, 5 rows in 1 micro-batch", {"layers": 4, "rows": 5, "micro": 1, "seed": 4}, slow_factor=slow,
             points=points),
        # wide enough that the model outweighs the activations: a stage that took the other stages' layers
        # by a message hidden from the recorder sends more than its recorded sends account for (metered)
        # and held: the checker stops the last stage before its code runs and reads, outside the learner's
        # processes, how many micro-batches' activations each stage sends before a gradient could come back
        Case("8 layers of width 128, 16 rows in 4 micro-batches", {"layers": 8, "rows": 16, "micro": 4, "seed": 6,
                                                                  "width": 128, "hold": True, **read},
             slow_factor=slow, points=points),
        Case("8 layers, 19 rows in 8 micro-batches", {"layers": 8, "rows": 19, "micro": 8, "seed": 5, **read},
             hidden=True, slow_factor=slow, points=points),
    ]


def model(layers: int, seed: int, width: int = WIDTH):
    """The whole model: layers-1 blocks Linear(W, W)+Tanh, then Linear(W, 10). Same seed on every rank."""
    import torch
    from torch import nn

    torch.manual_seed(seed)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers - 1)]
    return nn.Sequential(*blocks, nn.Linear(width, CLASSES))


def layers_of(stage: int, stages: int, layers: int) -> tuple[int, int]:
    """Stage s holds layers [lo, hi): contiguous, as even as can be."""
    bounds = np.linspace(0, layers, stages + 1).round().astype(int)
    return int(bounds[stage]), int(bounds[stage + 1])


def one_f_one_b(stages: int, micro: int, stage: int) -> list[tuple[str, int]]:
    """The order 1F1B runs one stage's ops in: what the learner's stage is compared with."""
    warm = min(stages - stage - 1, micro)
    ops = [("F", i) for i in range(warm)]
    for i in range(micro - warm):
        ops += [("F", warm + i), ("B", i)]
    return ops + [("B", i) for i in range(micro - warm, micro)]


def inputs(case, rank, size):
    """(layers, batch, targets, m) as plain data: this rank's layers as (weight, bias) arrays, which
    call() makes its stage of; the batch on rank 0 (zeros of its shape elsewhere); the labels.
    Nothing of another rank's layers, nor the batch beyond rank 0: what a stage needs of them
    comes by message, and with the check's nonce no rank can draw them again."""
    import torch
    from torch import nn

    p = case.params
    width = p.get("width", WIDTH)
    lo, hi = layers_of(rank, size, p["layers"])
    linears = [mod for mod in model(p["layers"], nonce_seed(p), width).modules() if isinstance(mod, nn.Linear)][lo:hi]
    g = torch.Generator().manual_seed(100 + nonce_seed(p))
    x = torch.randn(p["rows"], width, generator=g)
    y = torch.randint(0, CLASSES, (p["rows"],), generator=g)
    batch = x.numpy() if rank == 0 else np.zeros((p["rows"], width), np.float32)
    return ([(mod.weight.detach().numpy().copy(), mod.bias.detach().numpy().copy()) for mod in linears],
            batch, y.numpy(), p["micro"])


def stage_module(layers: list, last: bool):
    """An nn.Sequential of these (weight, bias) layers, as model() builds them: Linear+Tanh blocks,
    the model's last Linear bare (`last`: this part ends the model)."""
    import torch
    from torch import nn

    mods = []
    for i, (w, b) in enumerate(layers):
        linear = nn.Linear(w.shape[1], w.shape[0])
        with torch.no_grad():
            linear.weight.copy_(torch.as_tensor(w))
            linear.bias.copy_(torch.as_tensor(b))
        mods.append(linear if last and i == len(layers) - 1 else nn.Sequential(linear, nn.Tanh()))
    return nn.Sequential(*mods)


def _grads(module) -> list:
    return [None if q.grad is None else q.grad.detach().numpy().copy() for q in module.parameters()]


def _watch(stage, m: int) -> tuple[list, list, object]:
    """Record ("F", i) when the stage's last layer runs forward with autograd on, ("B", i) when
    autograd computes the gradient of that output: the stage's schedule as it really ran. A reentrant
    activation checkpoint (torch.utils.checkpoint, use_reentrant=True) runs the forward without autograd,
    then again inside backward: the first is the forward, the second only brings its gradient, for the
    oldest such forward (1F1B's backwards run in its forwards' order). So does recomputation by hand: a
    forward under torch.no_grad(), then the stage run again with autograd, before its backward, for the
    oldest such forward (3/18 once: the recomputations were read as the forwards). Returns the order, the
    forwards whose gradients are still to come that way, and the hook."""
    import torch

    ops: list = []
    pending: list[int] = []  # forwards run without autograd (a checkpoint's, or by hand): gradients to come

    def forward_hook(module, args, out):
        grad = getattr(out, "requires_grad", False)
        if torch._C._current_autograd_node() is not None or (grad and pending):  # recomputing one: its gradient
            if grad and pending:
                i = pending.pop(0)
                out.register_hook(lambda g, i=i: ops.append(("B", i)))
            return
        i = sum(1 for kind, _ in ops if kind == "F")
        if not grad and i >= m:  # a pass without autograd once every micro-batch went forward: the loss, say
            return
        ops.append(("F", i))
        if grad:
            out.register_hook(lambda g, i=i: ops.append(("B", i)))
        else:
            pending.append(i)

    return ops, pending, stage[-1].register_forward_hook(forward_hook)


def _read_before_forwards(stage, rank: int, p: int, m: int, pending: list):
    """Before each forward that 1F1B runs only after a gradient came back (stage s's forward j, for
    min(p-s-1, m) < j < m), this rank waits while the checker reads the wire (a case with "pause": "alone";
    a no-op elsewhere): by then the next stage's gradients of micro-batches 0..j-warm-1 have reached it,
    and it can have sent the activations of 0..j-1 only (_gradients_before_forwards)."""
    import torch

    from hpdl.checker.cases import read_wire_here

    warm, count = min(p - rank - 1, m), [0]

    def before(module, args):  # a forward of the schedule, not a recomputation of one (_watch)
        if torch._C._current_autograd_node() is None and not (torch.is_grad_enabled() and pending):
            j, count[0] = count[0], count[0] + 1
            if rank < p - 1 and warm < j < m:
                read_wire_here(f"f{j}")

    return stage[0].register_forward_pre_hook(before)


def call(fn, comm, args):
    """The learner's stage, then its gradients and the order its micro-batches ran in."""
    import torch

    layers, batch, targets, m = args
    stage = stage_module(layers, last=comm.Get_rank() == comm.Get_size() - 1)
    batch, targets = torch.as_tensor(batch), torch.as_tensor(targets)
    ops, pending, handle = _watch(stage, m)
    reads = _read_before_forwards(stage, comm.Get_rank(), comm.Get_size(), m, pending)
    try:
        returned = fn(comm, stage, batch, targets, m)
    finally:
        handle.remove()
        reads.remove()
    return {"loss": returned, "grads": _grads(stage), "ops": [list(op) for op in ops]}


def _grads_of(full, lo: int, hi: int, loss) -> list:
    for q in full.parameters():
        q.grad = None
    loss.backward()
    return _grads(full[lo:hi])


def reference(comm, layers, batch, targets, m):
    """The single-device model on the whole batch; this rank's share of its gradients. Also two
    wrong answers the diagnosis recognises: the last micro-batch's share alone, and every
    micro-batch's mean loss weighted 1/m whatever its size."""
    import torch
    import torch.nn.functional as F

    rank = comm.Get_rank()
    every = comm.allgather(layers)  # each stage's layers, in order: the whole model
    full = stage_module([layer for part in every for layer in part], last=True)
    lo = sum(len(part) for part in every[:rank])
    hi = lo + len(layers)
    x = torch.as_tensor(comm.bcast(batch if rank == 0 else None, root=0))
    targets = torch.as_tensor(targets)
    loss = F.cross_entropy(full(x), targets)
    grads = _grads_of(full, lo, hi, loss)
    xs, ts = x.tensor_split(m), targets.tensor_split(m)
    last_only = _grads_of(full, lo, hi, F.cross_entropy(full(xs[-1]), ts[-1], reduction="sum") / len(x))
    equal = _grads_of(full, lo, hi, sum(F.cross_entropy(full(a), b) for a, b in zip(xs, ts)) / m)
    last = comm.Get_rank() == comm.Get_size() - 1
    return {"loss": loss.item() if last else None, "grads": grads, "last_only": last_only, "equal_weights": equal}


def model_solution(comm, stage, batch, targets, m):
    """The model solution (1F1B over mpi4py), used by the tests."""
    import torch
    import torch.nn.functional as F

    rank, p = comm.Get_rank(), comm.Get_size()
    first, last = rank == 0, rank == p - 1
    xs, ts = batch.tensor_split(m), targets.tensor_split(m)
    inputs, outputs, sends, loss = {}, {}, [], 0.0

    def forward(i):
        nonlocal loss
        x = xs[i]
        if not first:
            comm.Recv(x.numpy(), source=rank - 1)
            x.requires_grad_()
        y = stage(x)
        if last:
            y = F.cross_entropy(y, ts[i], reduction="sum") / len(batch)
            loss += y.item()
        else:
            sends.append(comm.Isend(y.detach().numpy(), dest=rank + 1))
        inputs[i], outputs[i] = x, y

    def backward(i):
        x, y, grad = inputs.pop(i), outputs.pop(i), None
        if not last:
            grad = torch.empty_like(y)
            comm.Recv(grad.numpy(), source=rank + 1)
        y.backward(grad)
        if not first:
            sends.append(comm.Isend(x.grad.numpy(), dest=rank - 1))

    warm = min(p - rank - 1, m)
    for i in range(warm):
        forward(i)
    for i in range(m - warm):
        forward(warm + i)
        backward(i)
    for i in range(m - warm, m):
        backward(i)
    for request in sends:
        request.Wait()
    return loss if last else None


def _messages(ctx) -> Wrong | None:
    r, p, params = ctx.rank, ctx.size, ctx.case.params
    m, rows = params["micro"], params["rows"]
    w = hooks.only_peers(ctx, {r - 1, r + 1}, "a pipeline stage talks only to its neighbouring stages")
    if w is not None:
        return w
    sizes = [len(part) * params.get("width", WIDTH) for part in np.array_split(np.arange(rows), m)]
    for peer, what in ((r + 1, "activations to the next"), (r - 1, "gradients to the previous")):
        if not 0 <= peer < p:
            continue
        sent = [c.count for c in ctx.calls if c.dest == peer]
        # a Probe or an Iprobe (a receive sized by Get_count) dequeues nothing: a probe and its Recv were counted
        # as two messages received (0/18); a matched probe (Mprobe, Improbe) is the receive, its Mrecv not recorded
        received = [c.count for c in ctx.calls if c.source == peer and c.name not in PROBES]
        if _in_micro_batches(sent, sizes) and _in_micro_batches(received, sizes):
            continue
        if len(sent) != m or len(received) != m:
            return Wrong(f"rank {r} sent {len(sent)} and received {len(received)} message(s) exchanging {what} "
                         f"stage (rank {peer}); with {m} micro-batch(es) it takes {m} each way, one per "
                         f"micro-batch",
                         hint="split the batch with tensor_split(m), which always gives m parts (chunk(m) gives "
                              "fewer when B is not divisible by m), and send each micro-batch on its own."
                         if len(sent) < m or len(received) < m else
                         "send each micro-batch's tensor, whole or in parts one after another (a shape first is "
                         "fine), and nothing else: the messages to a neighbour must add up to the micro-batches.")
        if all(isinstance(n, int) for n in sent) and sent != sizes:
            return Wrong(f"rank {r} sent {what} stage messages of {sent} values; micro-batches of "
                         f"tensor_split's sizes send {sizes}",
                         hint="micro-batch i is batch.tensor_split(m)[i]: the first B % m have one row more.")
    return None


PROBES = ("Probe", "Iprobe", "probe", "iprobe")
# values: a message this small is a header (a micro-batch's shape sent first), never a micro-batch (WIDTH a row)
HEADER = 4


def _in_micro_batches(counts: list, sizes: list[int]) -> bool:
    """Whether the messages to (or from) one neighbour, in order, carry the micro-batches in order: each in one
    message or in parts one after another, a header of at most HEADER values before any left out. Only
    activations go forward and only gradients back, so consecutive messages to a neighbour are one kind."""
    if not all(isinstance(n, int) for n in counts) or min(sizes) <= HEADER:
        return False
    k = held = 0
    for n in counts:
        if n <= HEADER and held == 0:
            continue
        held += n
        if k == len(sizes) or held > sizes[k]:
            return False
        if held == sizes[k]:
            k, held = k + 1, 0
    return k == len(sizes) and held == 0


def _in_flight(ops) -> int:
    """The most micro-batches whose forward had run and whose backward had not, at any moment."""
    held = peak = 0
    for kind, _ in ops:
        held += 1 if kind == "F" else -1
        peak = max(peak, held)
    return peak


def _schedule(ctx) -> Wrong | None:
    r, p, m = ctx.rank, ctx.size, ctx.case.params["micro"]
    got = [(str(kind), int(i)) for kind, i in ctx.got["ops"]]
    want = one_f_one_b(p, m, r)
    if got == want:
        return None
    show = lambda ops: " ".join(f"{k}{i}" for k, i in ops)  # noqa: E731
    forwards = sum(1 for kind, _ in got if kind == "F")
    if forwards != m:
        return Wrong(f"stage {r} ran its layers forward (with autograd) {forwards} time(s); with {m} micro-batches "
                     f"1F1B runs each micro-batch forward once: {show(want)}",
                     hint="call stage(x) once per micro-batch of batch.tensor_split(m).")
    peak = _in_flight(got)
    if peak > min(m, p - r):
        return Wrong(f"stage {r} of {p} held {peak} micro-batches' activations at once (forwards whose backward had "
                     f"not run yet); 1F1B holds at most p - s = {p - r}. It ran {show(got)}; 1F1B runs {show(want)}",
                     hint="that is GPipe's memory: right gradients, but every activation kept until the end. Start "
                          "each backward as soon as its gradient can arrive: p-s-1 forwards, then alternate.")
    return Wrong(f"stage {r} of {p} ran {show(got)}; 1F1B runs {show(want)}",
                 hint="fill the pipe with min(p-s-1, m) forwards, then one forward and one backward at a time, "
                      "then the backwards left, in micro-batch order; fewer forwards first leave the next stages idle.")


def _loss(ctx) -> Wrong | None:
    loss, expected = ctx.got["loss"], ctx.expected["loss"]
    if loss is None or not isinstance(loss, (int, float, np.floating)) or isinstance(loss, bool):
        return Wrong(f"the last stage returned {type(loss).__name__}, not the loss as a float",
                     hint="return the whole batch's mean loss as a float (the sum of the micro-batches' .item()).")
    if not np.isclose(loss, expected, rtol=1e-4, atol=1e-6):
        return Wrong(f"the last stage returned loss {loss:.6g}; the single device's is {expected:.6g}",
                     max_error=abs(loss - expected),
                     hint="return F.cross_entropy of the whole batch: each micro-batch's mean loss weighted by "
                          "its share of the rows.")
    return None


def verify(case, ctx):
    """Gradients first (their diagnosis names the mistake), then the loss, the messages, the order."""
    got = ctx.got
    everyone = hooks.gather_calls(ctx)  # collective: first, on every rank
    waits = ctx.comm.allgather(list(ctx.waits))  # where each rank's Isends and Irecvs completed
    if any(g is None for g in got["grads"]):
        return Wrong(f"rank {ctx.rank}: some parameters of the stage have no gradient after the step "
                     f"(p.grad is None)")
    forged = hooks.wire_agrees(ctx)  # the recorded calls against the bytes the kernel saw this rank send
    if forged is not None:
        return forged
    w = hooks.compare(got["grads"], ctx.expected["grads"], what=f"rank {ctx.rank}'s gradients", rtol=1e-4,
                      atol=1e-6)
    if w is None and ctx.rank == ctx.size - 1:
        w = _loss(ctx)
    elif w is None and got.get("loss") is not None:  # a driver tells the stage with the loss by `is not None`
        w = Wrong(f"rank {ctx.rank} returned {hooks._describe(got['loss'])}; only the last stage returns the loss, "
                  "every other stage returns None")
    return (w or _messages(ctx) or _schedule(ctx) or _sent_while_held(ctx) or _gradients_before_forwards(ctx)
            or _received(ctx) or _waits_forever(ctx, everyone, waits))


def _waits_forever(ctx, everyone: list[list], waits: list[list]) -> Wrong | None:
    """The recorded calls replayed with every blocking Send waiting for its receive (rendezvous.stuck)."""
    left = rendezvous.stuck(everyone, waits)
    if left is None or ctx.rank not in left:
        return None
    words = {"send": "in a Send to", "recv": "in a Recv from", "wait-post": "for its Isend to",
             "wait-irecv": "for its Irecv from"}
    said = "; ".join(f"rank {r} waits {words[kind]} rank {peer}" for r, (kind, peer) in sorted(left.items()))
    return Wrong(f"it finished here only because MPI sent these small messages at once (eager); with real "
                 f"activations each blocking Send waits until its receive is posted (rendezvous), and then {said}:"
                 f" the step hangs on a cluster",
                 hint="send with comm.Isend and Wait for the requests at the end of the step (an Isend waited for "
                      "at once is a Send), or exchange with Sendrecv: two neighbouring stages that both Send "
                      "before they Recv wait for each other (lesson 03: eager and rendezvous).")


def _sent_while_held(ctx) -> Wrong | None:
    """A case with "hold" (checker/hold.py): the checker held the last stage still before its code ran, and
    read from the kernel the bytes each stage sent the next meanwhile. No gradient can come back then: a
    1F1B stage s sends min(p-s, m) micro-batches' activations and waits for the first; GPipe's sends all m."""
    params, r, p = ctx.case.params, ctx.rank, ctx.size
    held = (ctx.wire or {}).get("held")
    if not params.get("hold") or held is None:
        return None
    if held == "never":
        return Wrong(f"rank {r}, the last stage, ran its code without first letting the checker hold it still, as "
                     "every check of this case does: the order of the stages' messages could not be observed",
                     forged=True) if r == p - 1 else None
    m, width = params["micro"], params.get("width", WIDTH)
    rows = [len(part) for part in np.array_split(np.arange(params["rows"]), m)]
    allowed = min(p - r, m)
    sent = held.get(str(r + 1), 0) if isinstance(held, dict) and r < p - 1 else 0
    if r < p - 1 and isinstance(sent, int) and sent < 4 * width * rows[0]:
        return _waited_first(r, p, sent)
    if allowed >= m or not isinstance(sent, int) or sent < 4 * width * sum(rows[:allowed + 1]):
        return None
    k = max(i for i in range(m + 1) if 4 * width * sum(rows[:i]) <= sent)
    return Wrong(f"stage {r} of {p} sent stage {r + 1} {sent} bytes, {k} micro-batches' activations, before any "
                 f"gradient could come back (the checker held the last stage still, and counted the bytes outside "
                 f"your processes); a 1F1B stage sends {allowed}, then waits for the first micro-batch's gradient",
                 forged=True,
                 hint="that is GPipe's order: every forward first, every activation kept until the end. Fill the pipe "
                      "with min(p-s-1, m) forwards, then one forward and one backward at a time.")


# bytes on the wire a message may take beyond its values (MPI's headers: ~50 seen; a torch tensor pickled by
# mpi4py's lower-case calls: ~400), but never as much as 3/4 of the next micro-batch's activations, which a
# reading taken after that forward would show
PER_MESSAGE = 512


def _gradients_before_forwards(ctx) -> Wrong | None:
    """A case with "pause": "alone" (_read_before_forwards): the checker read, outside the learner's process,
    what stage s had received from the next stage and sent it when each forward j > warm began. 1F1B ran
    backward j-warm-1 before it, so that many micro-batches' gradients had come back; and no stage can have
    sent activations it had not made yet. Fewer gradients, more activations, or a reading never taken: the
    order the hooks recorded is not the order that ran (GPipe after 1F1B's first forwards, say)."""
    params, r, p = ctx.case.params, ctx.rank, ctx.size
    m, width = params["micro"], params.get("width", WIDTH)
    warm = min(p - r - 1, m)
    if params.get("pause") != "alone" or ctx.wire is None or r == p - 1 or warm + 1 >= m:
        return None
    seen, nxt = ctx.wire.get("paused"), str(r + 1)
    tags = [f"f{j}" for j in range(warm + 1, m)]
    if not isinstance(seen, dict) or any(t not in seen for t in tags):
        return Wrong(f"stage {r}'s forwards ran without the checker's readings of the wire before each one after "
                     "the pipe filled: the order the stage ran in could not be observed", forged=True)
    nbytes = [4 * width * len(part) for part in np.array_split(np.arange(params["rows"]), m)]
    total = ctx.wire.get(nxt)  # all this stage sent the next in the case
    for j in range(warm + 1, m):
        reading = seen[f"f{j}"]
        if not isinstance(reading, dict):
            continue  # read, but the wire could not be
        back, sent = reading["from"].get(nxt, 0), reading["to"].get(nxt, 0)
        if isinstance(total, int) and total - sent < sum(nbytes[j:]):
            return Wrong(f"as stage {r} of {p} began micro-batch {j}'s forward, it had sent stage {r + 1} {sent} of "
                         f"the {total} bytes it sent in all (counted outside your processes): less than the "
                         f"activations of micro-batches {j}..{m - 1}, made after it, were left to cross: the checker's "
                         "reading was not taken before that forward", forged=True)
        if back < sum(nbytes[:j - warm]):
            return Wrong(f"as stage {r} of {p} began micro-batch {j}'s forward, {back} bytes had come back from stage "
                         f"{r + 1} (counted outside your processes); 1F1B has run the backward of micro-batch "
                         f"{j - warm - 1} by then, on its gradient ({nbytes[j - warm - 1]} bytes): the order your "
                         "stage's hooks recorded is not the order it ran in", forged=True)
        # where micro-batches are small, MPI's headers on the messages before (~40 bytes each) are as much as one
        # of them: the held case's are large enough (and the check above holds in every case)
        if params.get("hold") and sent > sum(nbytes[:j]) + min(PER_MESSAGE * j, 3 * nbytes[j] // 4):
            return Wrong(f"as stage {r} of {p} began micro-batch {j}'s forward, it had already sent stage {r + 1} "
                         f"{sent} bytes (counted outside your processes): more than the activations of micro-batches "
                         f"0..{j - 1} carry: the checker's reading was not taken before that forward", forged=True)
    return None


def _waited_first(r: int, p: int, sent: int) -> Wrong:
    """Not one micro-batch's activations sent while the last stage was held: a 1F1B stage's first forward
    needs nothing from the stages after it, so this one waited on one of them first. A wrong order, not a
    forged one: an honest 1F1B behind a barrier waits so too (and so does GPipe behind one)."""
    return Wrong(f"stage {r} of {p} sent stage {r + 1} {sent} bytes while the last stage was held still (the checker "
                 "stopped it before its code ran, until the other stages stopped sending, and counted the bytes "
                 "outside your processes): not one micro-batch's activations. A 1F1B stage's first forward needs "
                 "nothing from the stages after it",
                 hint="your stage waits for a later stage before its first forward: a barrier, a communicator made "
                      "first (comm.Dup() and comm.Split() wait for every rank), or a receive from the next stage "
                      "first? Run the forward of micro-batch 0 and send its activations at once.")


def _received(ctx) -> Wrong | None:
    """Every micro-batch's activations reach each stage but the first, and their gradients each stage but
    the last: 9/10 of those bytes, by the kernel's count (a stage's values taken through files score nothing)."""
    r, p, params = ctx.rank, ctx.size, ctx.case.params
    one_way = 4 * params["rows"] * params.get("width", WIDTH)
    ways = (r > 0) + (r < p - 1)
    return hooks.received_at_least(ctx, one_way * ways * 9 // 10,
                                   "the activations from the previous stage and the gradients from the next")


def _like(x: np.ndarray, grads) -> bool:
    y = np.concatenate([g.ravel() for g in grads]).astype(np.float64)
    return bool(np.any(y)) and np.allclose(x, y, rtol=1e-4, atol=1e-6)


def diagnose(case, ctx):
    got, expected = ctx.got["grads"], ctx.expected
    m = case.params["micro"]
    if any(g is None for g in got):
        if ctx.rank < ctx.size - 1:
            return ("backward never reached this stage: the next stage must send back the gradient of its input "
                    "(x.grad, after y.backward(grad)), and this stage must receive it and call y.backward(grad).")
        return "call backward on every micro-batch's loss."
    x = np.concatenate([g.ravel() for g in got]).astype(np.float64)
    y = np.concatenate([e.ravel() for e in expected["grads"]]).astype(np.float64)
    if not np.any(x) and np.any(y):
        return ("this stage's gradients are all zero: backward never reached it. Every stage but the first must "
                "send the gradient of its input (x.grad) back to the previous stage.")
    if m > 1 and _like(x, expected["last_only"]):
        return ("these are the last micro-batch's gradients alone: the earlier ones were lost. Gradients accumulate "
                "in p.grad over the m backwards; do not zero them (or replace p.grad) between micro-batches.")
    if m > 1 and _like(x, expected["equal_weights"]) and not np.allclose(x, y, rtol=1e-4, atol=1e-6):
        return (f"each micro-batch's mean loss weighted 1/{m}: with micro-batches of different sizes that is not the "
                f"batch's mean. Weight micro-batch i by its rows / B (or use reduction='sum' and divide by B).")
    if np.dot(y, y) > 0:
        k = float(np.dot(x, y) / np.dot(y, y))
        if m > 1 and abs(k - m) < 0.1 * m:
            return (f"the gradients are about {m} times the single device's: gradients of the {m} micro-batches add "
                    f"up in p.grad, so scale each micro-batch's loss by its share of the batch (about 1/{m}).")
    return None


def explain(results):
    hung = [r for r in results if getattr(r, "verdict", None) == "HANG"]
    if hung:
        return ("a HANG means two stages wait for each other: each Recv needs a matching Send that the other rank "
                "reaches without first waiting for this one. Forward: receive from the previous stage, compute, "
                "send to the next. Backward: receive the gradient from the next stage, backward, send to the previous."
                " In 1F1B a stage sends an activation while its neighbour sends a gradient back: Isend (and Wait at "
                "the end) keeps two sends towards each other from waiting on each other.")
    return None
