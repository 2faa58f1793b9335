"""Checks for lesson 11's second exercise: ZeRO-3's forward through sharded layers, with mpi4py.

    def zero3_unit(comm, shards, shapes, x):
        # A stack of layers x → tanh(x @ W.T + b). Layer l's parameters, flattened (W row by row,
        # then b: out·in + out values), are split over the ranks by torch.tensor_split: this rank
        # holds only shards[l], its part (the first ranks get one more value when it does not divide).
        # shapes[l] = (out, in). x (B, in of layer 0): the same on every rank.
        # For each layer in order: all-gather its shards into the whole flat vector (Allgatherv),
        # take W and b from it, compute, and FREE the gathered layer before gathering the next:
        # a rank must never hold the whole model at once.
        # Return the output of the last layer (the same on every rank).

Compared on every rank, 1–4 ranks, with the layers run on one device. While the learner's function runs,
what it holds is followed (the torch tensors it makes, through weak references, and what Python and
numpy allocate, through tracemalloc, but for MPI's pickles in flight inside an MPI call; sampled at
every torch operation and every MPI call): a rank that keeps the gathered layers alive holds the whole
model and is rejected, whatever its output. In a hidden case (grading) of 4 MiB layers the kernel counts
it too, outside the learner's processes: the most each rank's own memory cgroup held at once during the
case (reset while every rank waits before it; jobs.Job.memory_held_by), over what it held then; where
ranks cannot have cgroups of their own (cgroup v2), the check job's, for all ranks together. That case
is its job's first, counted from before the learner's code is unpacked: memory kept from an earlier case
(an arena made there, the whole model's worth) would be in what a later one counts from. Beyond its
shards, more than OUTSIDE_LAYERS layers' worth on a rank (the whole model is 16) while the count in the
learner's process saw less is memory hidden from it: the check scores nothing. The layers are drawn with
the check's nonce, and the kernel counts what reaches each rank (the other ranks' shards of every layer
at least): layers drawn again, or shards read from files the ranks share, score nothing.
"""
from __future__ import annotations

import numpy as np

from hpdl.checker import hooks
from hpdl.checker.cases import Case, Wrong, nonce_seed, one_rank_points

SIGNATURE = "zero3_unit(comm, shards, shapes, x) -> y"
RANKS = (1, 2, 3, 4)
TIMEOUT = 30.0  # the first case of a job pays for importing torch
PRIVATE_INPUTS = True  # each rank gets its own shards as data: no rank can draw the whole layers
METERED = True  # the bytes that reach each rank are counted by the kernel (meter.py): gathered layers need them
SELF_REPORTED = ("the memory held at once, as tracemalloc and the tensors torch made show it, but for a hidden case's "
                 "layers of 4 MiB, where each rank's memory cgroup counts it (where it has one)")
MEASURED_FROM = 64 * 1024   # layers of at least this many bytes: their memory is checked
# layers' worth of bytes a rank may hold at once: the layer in use, the next one (prefetched), and
# room for a pickled comm.allgather of the shards as tensors and their torch.cat (3.5-3.7 here). Index
# bookkeeping is no layer and is not counted (_Held.note: floating-point tensors only): torch.arange(n) for
# tensor_split's counts is int64, two layers' worth, and the last layer's index alive while the next is
# made put a rank holding one gathered layer at 4.0-4.2
# the smaller cases' memory is read in the learner's process, where memory mapped apart is not seen (an anonymous
# mmap holding every layer passed them while the one case read outside raised on purpose: 12/15)
UNSEEN_IN_SMALL = ("what your ranks held at once (counted in their own processes, where memory can be kept out of "
                   "sight; the case of 16 layers counts it outside them)")
LAYERS_AT_ONCE = 4.0
IN_FLIGHT = 1.5  # layers' worth of Python's growth inside one MPI call taken for its pickles (_Peak)
OUTSIDE_FROM = 2**20  # layers of at least this many bytes: what all ranks held at once is read outside them too
# layers' worth each rank may hold at once by that count, beyond its shards (the model has 16): an honest rank
# held 1-5 (counted a rank apart; the model solution 1; a pickled allgather of tensors and torch.cat 3.7-4.5; the
# last layer's int64 index alive while the next is made 4-5), one holding the whole model 16.4
OUTSIDE_LAYERS = 7  # (at 10, a rank gathering 8 layers at a time into MPI's own memory scored 15/15)


def cases(size):
    slow = 1e6
    points = one_rank_points(size)  # on one rank, code with nothing distributed in it is right
    # layers of 4 MiB: what all ranks hold at once is also read outside their processes (METERED jobs, 2 ranks
    # on). In grading only: drawing and gathering 64 MiB adds about 1 s a rank count. The job's first case: its
    # count starts before the learner's code is unpacked, so no memory held from an earlier case (an arena)
    # or from unpacking is in what it counts from
    big = [] if size < 2 else [
        Case("16 layers of 1024 × 1024, batch 2: memory counted by the system", {"widths": [1024] * 17, "batch": 2,
                                                                                "seed": 5}, hidden=True,
             slow_factor=slow, points=points, witness=True)]
    return big + [
        Case("3 layers 8 → 6 → 5 → 4, batch 3", {"widths": [8, 6, 5, 4], "batch": 3, "seed": 1}, slow_factor=slow,
             points=points),
        Case("6 layers of 192 × 192, batch 4: memory measured", {"widths": [192] * 7, "batch": 4, "seed": 2},
             slow_factor=slow, points=points),
        Case("2 layers 2 → 1 → 1: fewer values than ranks in a layer", {"widths": [2, 1, 1], "batch": 2, "seed": 3},
             hidden=True, slow_factor=slow, points=points),
        Case("5 layers of 161 × 161, batch 2: memory measured", {"widths": [161] * 6, "batch": 2, "seed": 4},
             hidden=True, slow_factor=slow, points=points),
    ]


def _layers(params):
    import torch

    g = torch.Generator().manual_seed(nonce_seed(params))
    widths = params["widths"]
    layers = [(torch.randn(o, i, generator=g) / i ** 0.5, torch.randn(o, generator=g) * 0.1)
              for i, o in zip(widths[:-1], widths[1:])]
    return layers, torch.randn(params["batch"], widths[0], generator=g)


def inputs(case, rank, size):
    """This rank's shard of each layer's flat (W, b), the shapes, and x."""
    import torch

    layers, x = _layers(case.params)
    shards = [torch.tensor_split(torch.cat([w.reshape(-1), b]), size)[rank].clone() for w, b in layers]
    return shards, [tuple(w.shape) for w, _ in layers], x


class _Held:
    """What the learner's function holds now, in bytes: the floating-point torch tensors made while it runs
    (each storage once, while any such tensor made on it lives: followed by weak references) plus what Python
    and numpy have allocated since it started (tracemalloc), taken at each sample (note), plus what
    MPI.Alloc_mem holds (_MpiMemory). MPI's own buffers are not counted, nor are integer and bool tensors
    and numpy arrays: a layer's values are floats, and the index a learner makes to count each rank's share
    (torch.arange or np.arange of a layer's size, int64) is twice a layer's bytes without being one. A numpy
    array is one the running code's variables hold (or a list or tuple they hold), counted where the memory
    it views is its own and of integers: an integer view of a layer's floats is the layer."""

    def __init__(self, given=()):
        import tracemalloc

        import torch

        self.tensors, self.peak, self.mpi, self.samples, self.tampered = [], 0, 0, 0, False
        self.python = 0  # what Python and numpy held at the last sample
        self.calling = None  # while a communicator call runs: what Python held as it began (see _Peak)
        self.in_flight = 0  # and what of Python's growth in it is MPI's pickles, at most (set by call())
        self.nested = False  # a communicator call made inside that one: the learner's code runs in it
        # the storages handed in (the shards, x): an op that returns its input (.contiguous(), .cpu() on a tensor
        # that already is) made nothing, and a learner's code that grows one (resize_, set_) has moved it
        self.given = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                      for a in given for t in (a if isinstance(a, (list, tuple)) else [a])
                      if isinstance(t, torch.Tensor)}
        tracemalloc.start()
        self.base = tracemalloc.get_traced_memory()[0]
        self.sentinel = bytearray(64)  # traced from here: tracemalloc stopped, or started afresh, forgets it

    def made(self, out) -> None:
        import weakref

        import torch

        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.tensors.append(weakref.ref(t))

    def note(self) -> None:
        import tracemalloc

        self.samples += 1
        if tracemalloc.get_object_traceback(self.sentinel) is None:  # stopped or restarted by the learner's code
            self.tampered = True
        ints = _integer_arrays()  # first: reading a frame's variables lets go of those it no longer holds
        storages = {}
        for ref in self.tensors:
            t = ref()
            if t is not None and (t.is_floating_point() or t.is_complex()):
                s = t.untyped_storage()
                if s.nbytes() > self.given.get(s.data_ptr(), -1):
                    storages[s.data_ptr()] = s.nbytes()
        self.tensors = [ref for ref in self.tensors if ref() is not None]
        python = tracemalloc.get_traced_memory()[0] - self.base - ints
        if self.calling is not None and not self.nested:  # MPI's pickles in flight are its buffers, not counted
            python = max(min(python, self.calling), python - self.in_flight)
        self.python = python
        self.peak = max(self.peak, sum(storages.values()) + python + self.mpi)

    def stop(self) -> int:
        import tracemalloc

        self.note()
        tracemalloc.stop()
        return self.peak


def _integer_arrays() -> int:
    """Bytes of the integer and bool numpy arrays that the variables of the running frames hold (each array whose
    memory is its own once, by itself or through a list or tuple of up to 1024 items). A function's variables
    are read as a copy that Python keeps with its frame, holding what they held until read again (an index the
    code has let go of, a layer it deleted): the copy is emptied once read, so this holds nothing."""
    import inspect
    import sys

    owners: dict[int, int] = {}

    def take(value) -> None:
        if isinstance(value, np.ndarray):
            owner = value
            while isinstance(owner.base, np.ndarray):
                owner = owner.base
            if owner.base is None and owner.dtype.kind in "biu":
                owners[id(owner)] = owner.nbytes

    frame = sys._getframe(1)
    while frame is not None:
        names = frame.f_locals
        values = list(names.values())
        if frame.f_code.co_flags & inspect.CO_OPTIMIZED:  # a function's copy; a module's are its globals
            names.clear()
        for value in values:
            take(value)
            if isinstance(value, (list, tuple)) and len(value) <= 1024:
                for item in value:
                    take(item)
        frame = frame.f_back
    del values
    return sum(owners.values())


class _Peak:
    """The learner's communicator, noting what is held before and after every MPI call. While a call runs, up to
    IN_FLIGHT layers of what Python allocates are MPI's, not the learner's: a pickled comm.allgather holds the
    pickles it sent and received, a layer's worth and a shard, until it returns (a loop holding one gathered
    layer read 4.1-4.9 layers at once with them, 3.8 without). More is the learner's: code run inside the call
    (an object's __reduce__) that held the whole model there, in numpy, scored 15/15 while all of it was
    left out; and none of it once the learner's code makes a call inside the call. Tensors the call unpickles
    are counted, in it and after it: they are what it returns."""

    def __init__(self, comm, held: _Held):
        self._comm, self._held = comm, held

    def _call(self, attr, args, kwargs):
        held = self._held
        if held.calling is not None:  # a call inside a call: the learner's code runs in the outer one
            held.nested = True
            return attr(*args, **kwargs)
        held.calling, held.nested = held.python, False
        try:
            return attr(*args, **kwargs)
        finally:
            held.calling = None

    def __getattr__(self, name):
        attr = getattr(self._comm, name)
        if not callable(attr):
            return attr

        def sampled(*args, **kwargs):
            self._held.note()
            try:
                return self._call(attr, args, kwargs)
            finally:
                self._held.note()

        return sampled


class _MpiMemory:
    """MPI.Alloc_mem and MPI.Free_mem, noting what MPI's own memory holds (neither torch nor tracemalloc sees it: a
    rank gathering every layer there, its copies of each freed in turn, held the whole model unseen)."""

    def __init__(self, held: _Held):
        from mpi4py import MPI

        self.MPI, self.held, self.sizes = MPI, held, {}
        self.alloc, self.free = MPI.Alloc_mem, MPI.Free_mem

    def __enter__(self):
        def alloc(size, *args, **kwargs):
            mem = self.alloc(size, *args, **kwargs)
            self.sizes[mem.address] = len(mem)
            self.held.mpi += len(mem)
            self.held.note()
            return mem

        def free(mem):
            self.held.mpi -= self.sizes.pop(mem.address, 0)
            return self.free(mem)

        self.MPI.Alloc_mem, self.MPI.Free_mem = alloc, free
        return self

    def __exit__(self, *exc):
        self.MPI.Alloc_mem, self.MPI.Free_mem = self.alloc, self.free


def call(fn, comm, args):
    """Run the learner's function while following the peak of what it holds (see _Held)."""
    from torch.overrides import TorchFunctionMode

    held = _Held(given=args)
    shapes = args[1] if len(args) > 1 else []
    held.in_flight = int(IN_FLIGHT * max(_sizes(shapes), default=0))

    class Sampling(TorchFunctionMode):
        def __torch_function__(self, func, types, fargs=(), kwargs=None):
            out = func(*fargs, **(kwargs or {}))
            held.made(out)
            held.note()
            return out

    try:
        with Sampling(), _MpiMemory(held):
            y = fn(_Peak(comm, held), *args)
        samples = held.samples
    finally:
        peak = held.stop()
    return {"y": hooks._as_array(y) if hooks._as_array(y) is not None else y, "peak": int(peak),
            "samples": samples, "tampered": held.tampered}


def reference(comm, shards, shapes, x):
    """The layers on one device (rebuilt from every rank's shards)."""
    import torch

    for shard, (o, i) in zip(shards, shapes):
        flat = torch.cat([torch.from_numpy(a) for a in comm.allgather(shard.numpy())])
        x = torch.tanh(x @ flat[:o * i].view(o, i).T + flat[o * i:])
    return x.numpy()


def model_solution(comm, shards, shapes, x):
    """The model solution: per layer, Allgatherv into a fresh buffer, compute, drop the buffer."""
    import torch

    size = comm.Get_size()
    for shard, (o, i) in zip(shards, shapes):
        base, extra = divmod(o * i + o, size)               # torch.tensor_split's counts
        counts = [base + (1 if r < extra else 0) for r in range(size)]
        full = torch.empty(o * i + o)
        comm.Allgatherv(shard.numpy(), [full.numpy(), counts])
        x = torch.tanh(x @ full[:o * i].view(o, i).T + full[o * i:])
        del full                                      # freed: the next layer may take its place
    return x


def _sizes(shapes) -> list[int]:
    """Each layer's bytes, W and b in float32, from its (out, in)."""
    return [4 * (o * i + o) for o, i in shapes]


def _layer_bytes(case) -> int:
    widths = case.params["widths"]
    return max(_sizes(zip(widths[1:], widths[:-1])))


def verify(case, ctx):
    got = ctx.got
    if not isinstance(got, dict) or "y" not in got:
        return Wrong(f"returned {hooks._describe(got)}; expected the last layer's output")
    w = hooks.compare(got["y"], ctx.expected, what=f"rank {ctx.rank}'s output", rtol=1e-4, atol=1e-5)
    if w is not None:
        return w
    layer = _layer_bytes(case)
    widths = case.params["widths"]
    measured = layer >= MEASURED_FROM and ctx.size > 1  # a case whose memory the learner's process counts
    if measured and got.get("tampered"):
        return Wrong("the count of the memory your function held (tracemalloc, in your process) was stopped or "
                     "started afresh while it ran: what it held is unknown", forged=True)
    if measured and not got.get("samples"):
        return Wrong("the memory your function held could not be followed: it made no torch operation and no call "
                     "on the communicator it was given", hint="gather each layer with the comm your function is "
                                                              "given (comm.Allgatherv), not another communicator.")
    if measured and got["peak"] > LAYERS_AT_ONCE * layer:
        return Wrong(f"rank {ctx.rank} held {got['peak'] / 2**10:.0f} KiB at once, {got['peak'] / layer:.1f} layers' "
                     f"worth ({layer / 2**10:.0f} KiB each, {len(widths) - 1} layers, at most {LAYERS_AT_ONCE:g} "
                     "at once): the gathered layers were never freed, or not before the next was gathered",
                     hint="drop the gathered layer (del it, and the views W and b taken from it) before "
                     "gathering the next one: ZeRO-3 holds one whole layer at a time, never the whole model. A "
                     "pickled comm.allgather returns each shard as a tensor of its own, a layer's worth beside "
                     "the one torch.cat makes of them: free the last layer first, or gather into one buffer with "
                     "comm.Allgatherv.")
    shards, shapes, _ = ctx.args
    w = _held_outside(ctx, layer, _sizes(shapes))
    if w is not None:
        return w
    others = sum(o * i + o - shard.numel() for shard, (o, i) in zip(shards, shapes))
    # 9/10 of it: an Allgatherv receives just that (plus headers), so the bound leaves room for counting slips;
    # shards read from files leave a rank with MPI's own few hundred bytes
    return hooks.received_at_least(ctx, 4 * others * 9 // 10, "every layer's shards held by the other ranks")


def _held_outside(ctx, layer: int, sizes: list[int]) -> Wrong | None:
    """What this rank held at once while the case ran, over what it held before it, as the kernel counts it for a
    memory cgroup of the rank's own (jobs.Job.memory_held_by), outside the learner's processes: its shards,
    then a layer or two. Where the ranks have no cgroups of their own, what all of them held together (the
    check job's cgroup), over their shards: one rank holding every layer fits the room all have together. More
    than OUTSIDE_LAYERS a rank while the count in the learner's process saw less is memory hidden from it."""
    memory = (ctx.wire or {}).get("memory") or {}
    if layer < OUTSIDE_FROM or ctx.size < 2:
        return None
    mine, held, model = memory.get("rank"), memory.get("held"), sum(sizes)
    if isinstance(mine, int):
        shards = sum(4 * shard.numel() for shard in ctx.args[0])
        each, who = (mine - shards) / layer, f"rank {ctx.rank} held {mine / 2**20:.0f} MiB"
        beyond = f"beyond its shards, about {each:.0f} of the {len(sizes)} layers"
    elif isinstance(held, int):
        each, who = (held - model) / ctx.size / layer, f"the {ctx.size} ranks together held {held / 2**20:.0f} MiB"
        beyond = f"beyond their shards, about {each:.0f} of the {len(sizes)} layers each"
    else:
        return None
    if each <= OUTSIDE_LAYERS:
        return None
    return Wrong(f"{who} at once in this case, by the count of the system outside your processes (a memory cgroup): "
                 f"{beyond}, where ZeRO-3 holds one or two",
                 forged=True, hint="drop each gathered layer before gathering the next one: ZeRO-3 never holds the "
                                   "whole model at once.")


def diagnose(case, ctx):
    got = ctx.got
    y = hooks._as_array(got.get("y")) if isinstance(got, dict) else None
    if y is None or y.shape != ctx.expected.shape:
        return "return the last layer's output, a (batch, out) tensor."
    if np.isnan(y).any():
        return "NaN in the output: the gathered buffer was used before every shard arrived in it."
    if any(c.name.lower().startswith(("iallgather", "allgather_init", "allgatherv_init")) for c in ctx.calls):
        return ("with a prefetch, each layer in flight needs a buffer of its own: the next layer's gather writes "
                "into its buffer from the moment it starts, so one buffer shared with the layer still computing "
                "mixes the two layers' values. Wait for a gather before reading its buffer.")
    return ("the output differs from the layers run on one device: gather the layers in order (layer 0 first), and "
            "place the shards in rank order — rank r's shard is torch.tensor_split(flat, p)[r], so Allgatherv with "
            "every rank's count rebuilds W (out × in, row by row) followed by b.")
