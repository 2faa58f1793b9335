"""Checks for lesson 05's third exercise: a minimal DDP — buckets all-reduced while backward runs.

    def overlap_allreduce(comm, model, bucket_mb) -> finish:
        # like DDP's constructor: broadcast rank 0's parameters; group the parameters, in reverse
        # order, into buckets of at most bucket_mb MiB (a larger tensor gets a bucket of its own);
        # register hooks that start a bucket's asynchronous all-reduce as soon as backward has
        # produced all of its gradients. Return finish(): wait for them, average, put the
        # results back into p.grad, and get ready for the next step.

`call()` builds it on a model whose initial parameters differ per rank, then trains three steps
on different data per rank (zero_grad, backward, finish(), SGD step), counting all-reduces
launched during backward and in total. Checked: parameters broadcast at the start; after
every finish() the gradients are the average over ranks; parameters identical everywhere; all
buckets but at most one all-reduced while backward ran (counted in values, not calls); no more
all-reduces than buckets, and the buckets those asked for (the sizes each all-reduce carried: buckets
filled from the first parameter, or closed only once past the cap, are not). Each rank's initial
parameters and batches are drawn with the check's nonce, and the kernel counts what reaches each rank:
gradients averaged through files the ranks share, behind a recording changed to show all-reduces during
backward, score nothing.

When the all-reduces ran is read from the wire too, outside the learner's process ("pause" cases): in
the second step every rank waits, while the checker reads the bytes each has received, at the step's
start, where backward reaches the third Linear (the second, where the first bucket is larger; a kit node
in the model: by then the gradients of the layers after it exist, and none before), when backward returns
and at the step's end; in the hidden case too. The buckets
complete at the cut must have crossed there (else WRONG: launched at the end of backward is no
overlap); what the recording says backward launched must have crossed when it returns, and no more
than the gradients made by the cut can carry may have crossed there, or the reading was skipped or
moved (forged: no case counts). A learner who times a by-hand copy of the bucket schedule to those
readings, rather than to backward, still passes.

Whether a hook waits for its all-reduce is read from the checker's clock ("hold" cases): in the third step
the last rank is held still (stopped from outside, hold.py) before its forward, and the others run theirs
and their backward. An all-reduce launched and left to run cannot finish without the held rank, but
backward goes on past it; one waited for at once (all_reduce without async_op, or .wait() in the hook)
stops backward at the first complete bucket until the held rank is let go. Each other rank tells the
checker when its backward reaches the first Linear's output, after every other layer's hooks; only what
the checker hears before it lets the last rank go counts. A wait at the very end of backward, as
DDP's own queued callback does, gets there first and passes.
"""
from __future__ import annotations

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points
from hpdl.checker.cases import _dp

SIGNATURE = "overlap_allreduce(comm, model, bucket_mb) -> finish   # finish() after each backward"
# DDP does the exercise (its bucket caps can be set to the exercise's); and the exercise's values move by its
# all-reduces (and the parameters' broadcast) alone: hooks that all-reduced float64 zeros of each bucket's size while
# backward ran, the average taken after it by an MPI Allgather, scored 8/8
_ONLY = ("a minimal DDP moves the gradients by its buckets' all-reduces (and the parameters by one broadcast at the "
         "start): other collectives and messages by hand are refused here")
_ALLOWED = ("Allreduce", "allreduce", "Iallreduce", "Allreduce_init", *hooks.BROADCASTS)
FORBIDDEN = {**hooks.TORCH_DATA_PARALLEL,
             **{name: _ONLY for name in hooks.DATA_COLLECTIVES + hooks.SENDS if name not in _ALLOWED}}
RANKS = (1, 2, 3)
TIMEOUT = 30.0
PRIVATE_INPUTS = True  # each rank gets its own initial parameters and batches as data: no rank can draw the others'
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): averages need them
WIDTHS = (64, 48, 32, 24, 16, 10)  # 10 tensors, 24 KiB of gradients
STEPS = 3
LR = 0.1
CUT = 5  # the wire is read where backward reaches the input of the MLP's third Linear (model[5]): "cut"
READ_STEP = 1  # in the second step (the first may set things up; each reading costs ~0.15 s)
LOW = 0.5  # at that reading, at least this share of the bytes the buckets complete by then carry has crossed
HIGH = 1.5  # and at most this share of what the gradients made by then could carry (+ SLACK): their share
# of the values, or, where small tensors make each all-reduce's own bytes count, their share of the buckets
SLACK = 4096  # bytes
HOLD_STEP = 2  # the last rank held still before this step's forward (no reading of the wire in it)


def cases(size):
    kw = {"slow_factor": 1e6, "points": one_rank_points(size)}  # on one rank a finish() doing nothing is right
    read = {"pause": "together", "cut": CUT}  # the wire read in backward, every rank waiting (_wire_in_backward)
    held = {"hold": "here"}  # the last rank held back in step HOLD_STEP (_backward_waited)
    return [
        Case("5-layer MLP, buckets of 0.004 MiB (several buckets)", {"bucket_mb": 0.004, "seed": 1, **read, **held},
             **kw),
        Case("5-layer MLP, buckets of 25 MiB (one bucket)", {"bucket_mb": 25.0, "seed": 2}, **kw),
        Case("5-layer MLP, buckets of 1e-6 MiB (one tensor each)", {"bucket_mb": 1e-6, "seed": 3, **read, **held},
             **kw),
        # its first bucket is complete only when backward reaches the second Linear (model[3]): read there. A cap
        # read as MB (0.0054e6 bytes, not 0.0054 × 2**20) cuts other buckets here, and nowhere in the cases above
        Case("5-layer MLP, buckets of 0.0054 MiB", {"bucket_mb": 0.0054, "seed": 4, **read, "cut": 3, **held},
             hidden=True, **kw),
    ]


def inputs(case, rank, size):
    """This rank's own initial parameters (they differ on every rank) and batches, as data; and where the
    wire is read in backward (the case's "cut", on more than one rank)."""
    def seeded(seed):
        return nonce_seed({**case.params, "seed": seed})

    seed = case.params["seed"]
    model = _dp.mlp(WIDTHS, seed=seeded(100 * seed + rank))
    batches = [_dp.batch(6, WIDTHS[0], WIDTHS[-1], seed=seeded(10_000 * seed + 100 * step + rank))
               for step in range(STEPS)]
    cut = case.params.get("cut") if size > 1 else None  # one rank all-reduces nothing: no reading
    held = case.params.get("hold") == "here" and size > 1
    return [p.detach().clone() for p in model.parameters()], case.params["bucket_mb"], batches, cut, held


def _model(state):
    """The MLP with these parameters."""
    import torch

    model = _dp.mlp(WIDTHS, seed=0)
    with torch.no_grad():
        for p, value in zip(model.parameters(), state):
            p.copy_(torch.as_tensor(value))
    return model


def buckets_of(params, bucket_mb: float) -> list[list]:
    """Parameters in reverse order, cut into buckets of at most bucket_mb MiB."""
    cap = bucket_mb * 2**20
    out, current, used = [], [], 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        if current and used + nbytes > cap:
            out.append(current)
            current, used = [], 0
        current.append(p)
        used += nbytes
    if current:
        out.append(current)
    return out


def model_solution(comm, model, bucket_mb):
    """The reference: broadcast, buckets, hooks launching async all-reduces, finish()."""
    import torch
    import torch.distributed as dist

    size = comm.Get_size()
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p, src=0)
    buckets = buckets_of(model.parameters(), bucket_mb)
    home = {id(p): i for i, b in enumerate(buckets) for p in b}
    state = {"left": [len(b) for b in buckets], "pending": []}

    def ready(p):
        i = home[id(p)]
        state["left"][i] -= 1
        if state["left"][i] == 0:
            flat = torch.cat([q.grad.reshape(-1) for q in buckets[i]])
            state["pending"].append((i, flat, _dp.all_reduce(flat, async_op=True)))

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(ready)

    def finish():
        for i, flat, work in state["pending"]:
            work.wait()
            flat /= size
            offset = 0
            for q in buckets[i]:
                q.grad.copy_(flat[offset: offset + q.numel()].view_as(q.grad))
                offset += q.numel()
        state["pending"].clear()
        state["left"] = [len(b) for b in buckets]

    finish.buckets = len(buckets)
    return finish


def _forward(model, x, cut: int | None, held: bool = False):
    """The model's output; with a cut, the wire is read where backward reaches model[cut]; held, each rank
    says when backward reaches the first Linear's output (_dp)."""
    if held:
        return model[2:](_dp.passed_in_backward(model[:2](x), "first"))  # model[1]: the first Linear
    if cut is None:
        return model(x)
    return model[cut:](_dp.read_wire_in_backward(model[:cut](x), "m"))


def _train(build, comm, model, bucket_mb, batches, cut=None, held=False) -> dict:
    """Three steps; with a cut, in step READ_STEP every rank also waits for the checker's reading of the wire
    at the start ("b"), at the cut in backward ("m"), when backward has returned ("e", before finish()) and
    at the end ("after"); held, in step HOLD_STEP the last rank is held still before its forward."""
    import torch
    import torch.nn.functional as F

    from hpdl.checker.cases import hold_here, read_wire_here

    finish = build(comm, model, bucket_mb)
    if not callable(finish):
        return {"error": f"the function returned {type(finish).__name__}; return finish, a function that "
                         "completes the all-reduces after backward"}
    out = {"init": _dp.params(model), "steps": []}
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step, (x, y) in enumerate(batches):
        read = cut is not None and step == READ_STEP
        if read:
            read_wire_here("b")
        opt.zero_grad()
        hold = held and step == HOLD_STEP
        if hold:
            hold_here()
        start, elements, in_torch = _dp.launches(), _dp.launched_elements(), _dp.launched_elements(mpi=False)
        mark = _dp.calls_so_far()
        F.cross_entropy(_forward(model, x, cut if read else None, hold), y).backward()
        during = _dp.launches() - start
        values = None if elements is None else _dp.launched_elements() - elements
        torch_values = None if in_torch is None else _dp.launched_elements(mpi=False) - in_torch
        if read:
            read_wire_here("e")
        finish()
        out["steps"].append({"during": during, "total": _dp.launches() - start, "grads": _dp.grads(model),
                             "values_during": values, "torch_during": torch_values,
                             "reduced": _dp.reductions_since(mark)})
        opt.step()
        if read:
            read_wire_here("after")
    out["params"] = _dp.params(model)
    return out


def set_up():
    """The process group, before the meter's first reading and any learner's code: its connections are counted
    apart, and once the learner's code runs no socket may be bound (confine.no_new_endpoints)."""
    _dp.ensure_process_group()


def call(fn, comm, args):
    _dp.ensure_process_group()
    state, bucket_mb, batches, cut, held = args
    return _train(fn, comm, _model(state), bucket_mb, batches, cut, held)


def reference(comm, state, bucket_mb, batches, cut, held):
    _dp.ensure_process_group()
    model = _model(state)
    out = _train(model_solution, comm, model, bucket_mb, batches)
    buckets = buckets_of(model.parameters(), bucket_mb)
    out["buckets"] = len(buckets)
    out["gradient_values"] = sum(p.numel() for p in model.parameters())
    out["largest_bucket"] = max(sum(p.numel() for p in b) for b in buckets)
    out["bucket_values"] = [sum(p.numel() for p in b) for b in buckets]
    if cut is not None:  # at the cut in backward: the gradients made by then, and the buckets they complete
        made = {id(p) for p in model[cut:].parameters()}
        out["made_at_cut"] = sum(p.numel() for p in model[cut:].parameters())
        complete = [b for b in buckets if all(id(p) in made for p in b)]
        out["complete_at_cut"] = sum(p.numel() for b in complete for p in b)
        out["buckets_at_cut"] = len(complete)
    return out


def _flat(arrays):
    import numpy as np

    return np.concatenate([np.asarray(a, np.float64).ravel() for a in arrays]) if arrays else np.zeros(0)


def verify(case, ctx):
    import numpy as np

    got, expected, size = ctx.got, ctx.expected, ctx.size
    mine = None if "error" in got else (_flat(got["init"]), _flat(got["params"]))
    everyone = ctx.comm.allgather(mine)  # one collective, on every rank, before any verdict
    if "error" in got:
        return Wrong(got["error"])
    if any(e is None for e in everyone):
        return Wrong(f"rank {next(r for r, e in enumerate(everyone) if e is None)} could not run the steps")
    root = everyone[0][0]
    apart = [r for r, e in enumerate(everyone) if e[0].shape != root.shape or not np.array_equal(e[0], root)]
    if apart:
        return Wrong(f"right after your function, the parameters of rank{'s' if len(apart) > 1 else ''} "
                     f"{', '.join(map(str, apart))} differ from rank 0's",
                     hint="like DDP's constructor, broadcast rank 0's parameters first "
                          "(dist.broadcast(p.data, src=0) for every p): ranks that start apart stay apart.")
    for i, (g, e) in enumerate(zip(got["steps"], expected["steps"])):
        err = _dp.close(g["grads"], e["grads"], rtol=1e-5, atol=1e-6)
        if err is not None:
            return Wrong(f"after finish() in step {i + 1}, p.grad is not the average over the ranks "
                         f"(largest difference {err:.3g})", max_error=err)
    if any(not np.array_equal(mine[1], other[1]) for other in everyone):
        return Wrong("after three steps the ranks' parameters differ")
    buckets = expected["buckets"]
    if size > 1 and buckets > 1 and not any(s["during"] for s in got["steps"]):
        return Wrong(f"no all-reduce started while backward ran ({buckets} buckets expected)",
                     hint="launch each bucket's all-reduce from a hook (p.register_post_accumulate_grad_hook) with "
                          "async_op=True as soon as its last gradient is ready; only wait for them in finish().")
    wrong = _overlapped(got, expected) if size > 1 and buckets > 1 else None
    if wrong is not None:
        return wrong
    most = max(s["total"] for s in got["steps"])
    if size > 1 and most > buckets + 1:
        return Wrong(f"{most} all-reduces in a step where buckets of ≤ {case.params['bucket_mb']:g} MiB give {buckets}",
                     hint="pack the gradients of a bucket into one flat buffer (torch.cat) and all-reduce that once, "
                          "instead of one all-reduce per tensor.")
    # the evidence first: a record the wire contradicts voids the check, whatever its buckets
    return _wire_in_backward(case, ctx) or _broadcast_once(ctx, expected) or _backward_waited(case, ctx) or \
        hooks.received_for_allreduce(ctx, STEPS * 4 * expected["gradient_values"],
                                     f"the average gradient of {STEPS} steps") or _buckets_as_asked(case, got, expected)


def _broadcast_once(ctx, expected) -> Wrong | None:
    """The broadcasts carry the parameters once, at the start, by the recorder's counts: every rank's gradients
    broadcast in turn after backward is an allgather of them."""
    values = sum(c.count for c in ctx.calls if c.name in hooks.BROADCASTS and isinstance(c.count, int))
    if ctx.size < 2 or values <= 1.5 * expected["gradient_values"] + 16:
        return None
    return Wrong(f"rank {ctx.rank}'s broadcasts carried {values} values; the parameters, broadcast once at the start, "
                 f"are {expected['gradient_values']}",
                 hint="broadcast rank 0's parameters once when the buckets are built; after that only the buckets' "
                      "all-reduces move gradients.")


def _buckets_as_asked(case, got, expected) -> Wrong | None:
    """The buckets' sizes, from what each all-reduce carried: those of buckets_of() (one all-reduce more, of
    anything, is let be). Buckets filled from the first parameter, or closed only once past the cap, all-reduce
    the right sums too, and overlap, but are not the buckets asked for. Decided where every reduction was one
    all-reduce of a known size (not a reduce-scatter and all-gather, which carry a bucket in two parts)."""
    want = sorted(expected["bucket_values"])
    for i, step in enumerate(got["steps"]):
        sent = step.get("reduced")
        if not sent or any(name not in _dp.ALLREDUCES or not isinstance(n, int) for name, n in sent):
            continue
        counts = sorted(n for _, n in sent)
        if counts == want or any(counts[:j] + counts[j + 1:] == want for j in range(len(counts))):
            continue
        return Wrong(f"in step {i + 1} the all-reduces carried {', '.join(map(str, counts))} gradient values; "
                     f"buckets of ≤ {case.params['bucket_mb']:g} MiB carry {', '.join(map(str, want))}",
                     hint="walk the parameters in reverse order (reversed(list(model.parameters()))), as backward "
                          "makes their gradients, and close a bucket before the tensor that would take it past "
                          "bucket_mb (a tensor larger than that gets a bucket of its own).")
    return None


def _backward_waited(case, ctx) -> Wrong | None:
    """A "hold" case: in step HOLD_STEP the last rank was held still before its forward; this rank's backward
    must have reached the first Linear's output meanwhile (the checker's clock, ctx.wire["passed_held"])."""
    if case.params.get("hold") != "here" or ctx.size == 1 or ctx.wire is None:
        return None
    passed, last, s = ctx.wire.get("passed_held"), ctx.size - 1, HOLD_STEP
    if passed == "never":
        return Wrong(f"in step {s + 1} rank {last} was not held back where the checker holds it (the kit's call "
                     "before its forward): whether backward waits for the other ranks is unknown", forged=True)
    if not isinstance(passed, list) or ctx.rank == last or ctx.rank in passed:
        return None  # could not be held here; or the held rank itself; or it went on
    return Wrong(f"in step {s + 1}, while rank {last} was held back before its forward, rank {ctx.rank}'s backward "
                 "stopped before reaching the first Linear: a hook waited for its all-reduce, which cannot end "
                 f"before rank {last} gets there, so backward computed nothing while the bytes were on the wire",
                 hint="in the hook, launch dist.all_reduce(flat, async_op=True) and keep the work it returns, "
                      "without waiting; wait for all of them in finish(), after backward.")


def _wire_in_backward(case, ctx) -> Wrong | None:
    """A case with "pause": in step READ_STEP the checker read, outside the learner's process, the bytes each
    rank had received at the step's start ("b"), at the cut in backward ("m"), when backward returned ("e")
    and at the step's end ("after"), every rank waiting meanwhile (cases.read_wire_here). When backward
    returned, what the recording says it all-reduced had crossed; at the cut, the buckets complete by then,
    and no more than the gradients made by then. A reading skipped, or one against the recording, is forged."""
    if case.params.get("cut") is None or ctx.size == 1 or ctx.wire is None:
        return None
    seen, e, r, s = ctx.wire.get("paused"), ctx.expected, ctx.rank, READ_STEP
    if not isinstance(seen, dict) or any(t not in seen for t in ("b", "m", "e", "after")):
        return Wrong("backward ran without waiting where the checker reads the wire (the kit's readings in the "
                     "model and around the step): when the all-reduces ran is unknown", forged=True)
    if not all(isinstance(seen[t], dict) for t in ("b", "m", "e", "after")):
        return None  # waited there, but the wire could not be read
    nth = {1: "first", 3: "second", 5: "third", 7: "fourth"}.get(case.params["cut"], "a")
    total, where = e["gradient_values"], f"in step {s + 1}, when backward reached the {nth} Linear"
    step, at_cut, at_end = (_received(seen[k]) - _received(seen["b"]) for k in ("after", "m", "e"))
    claimed, in_torch = ctx.got["steps"][s]["values_during"], ctx.got["steps"][s].get("torch_during")
    in_torch = claimed if in_torch is None else in_torch
    if isinstance(in_torch, int) and at_end < LOW * step * min(in_torch, total) / total:
        return Wrong(f"in step {s + 1} the recording shows {in_torch} of the {total} gradient values all-reduced "
                     f"while backward ran, but when backward returned rank {r} had received {at_end} of the step's "
                     f"{step} bytes", forged=True)
    if isinstance(claimed, int) and at_end < LOW * step * min(claimed, total) / total:  # MPI's, launched: not moved
        return Wrong(f"in step {s + 1} your MPI all-reduces of {claimed} gradient values started while backward "
                     f"ran, but when it returned rank {r} had received {at_end} of the step's {step} bytes: they "
                     "had not moved", hint=_MPI_WAITS)
    most = max(e["made_at_cut"] / total, e["buckets_at_cut"] / e["buckets"])
    if at_cut > HIGH * most * step + SLACK:
        return Wrong(f"{where}, rank {r} had received {at_cut} of the step's {step} bytes: more than the "
                     f"{e['made_at_cut']} gradient values made by then carry", forged=True)
    if at_cut < LOW * step * e["complete_at_cut"] / total:
        mpi = isinstance(claimed, int) and isinstance(in_torch, int) and claimed > in_torch  # MPI's launched
        return Wrong(f"{where}, rank {r} had received {at_cut} of the step's {step} bytes; the buckets complete by "
                     f"then ({e['complete_at_cut']} of the {total} gradient values) had not crossed",
                     hint=_MPI_WAITS if mpi else "launch a bucket's all-reduce from the hook that completes it, while "
                                                 "backward goes on; not all at the end of backward.")
    return None


# why MPI's nonblocking all-reduces launched from backward's hooks overlap nothing here
_MPI_WAITS = ("MPI moves a nonblocking collective's data only inside MPI calls here (no progress thread): launched "
              "from a hook, it waits for finish(). torch.distributed's all_reduce(async_op=True) runs on a thread "
              "of its own while backward goes on.")


def _received(reading: dict) -> int:
    """The bytes a rank had received from the other ranks at a reading (hold.readings)."""
    return sum(reading["from"].values())


def _overlapped(got, expected) -> Wrong | None:
    """All buckets but at most one all-reduced while backward ran, counted in gradient values (one
    tiny all-reduce from a hook, the rest after backward, overlaps nothing)."""
    need = expected["gradient_values"] - expected["largest_bucket"]
    for i, step in enumerate(got["steps"]):
        values = step.get("values_during")
        if isinstance(values, int) and values < need:
            return Wrong(f"in step {i + 1} only {values} of the {expected['gradient_values']} gradient values were "
                         f"all-reduced while backward ran; all buckets but the last start there",
                         hint="start each bucket's all-reduce from the hook that completes it, on the bucket's whole "
                              "flat buffer; finish() only waits for them.")
    return None


def diagnose(case, ctx):
    got, expected, size = ctx.got, ctx.expected, ctx.size
    if "error" in got or size == 1:
        return None
    first_got, first_expected = got["steps"][0]["grads"], expected["steps"][0]["grads"]
    k = _dp.ratio_to(first_got, first_expected)
    if k is not None and abs(k - size) < 1e-3:
        return "the gradients look summed, not averaged: divide each bucket by comm.Get_size() after waiting."
    if _dp.close(got["steps"][0]["grads"], expected["steps"][0]["grads"], rtol=1e-5, atol=1e-6) is None:
        return ("step 1 is right but a later one is not: reset the buckets' state in finish() "
                "(pending work, gradients still to come) for the next step.")
    if any(s["total"] == 0 for s in got["steps"]):
        return "a step launched no all-reduce: are the hooks registered on the model's parameters?"
    right = [_dp.close([g], [e], rtol=1e-5, atol=1e-6) is None for g, e in zip(first_got, first_expected)]
    if any(right) and not all(right):
        left = [i for i, ok in enumerate(right) if not ok]
        return (f"after step 1, {len(left)} of the {len(right)} gradient tensors (model.parameters()[i] for i in "
                f"{left}) are not the average while the others are: put every parameter in a bucket, the last, "
                "partial bucket too, and make sure each bucket's all-reduce is launched and waited for.")
    return ("wait for each all-reduce before reading its buffer, then copy the averaged slices back into p.grad "
            "(the flat buffer from torch.cat is a copy, not a view).")


def explain(results) -> str | None:
    """p.grad read in a tensor hook: p.register_hook runs before the gradient is stored, so p.grad is None (or
    last step's) there; the error alone said nothing of why."""
    if any(getattr(r, "verdict", None) == "ERROR" and "'NoneType' object has no attribute" in (r.message or "")
           for r in results):
        return ("p.grad was None in your hook: a tensor hook (p.register_hook) runs before the gradient is stored "
                "in p.grad. Register p.register_post_accumulate_grad_hook(hook): it is called with p once p.grad "
                "holds this backward's gradient.")
    return None
