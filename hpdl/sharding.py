"""Plumbing for lesson 11 (sharding and memory): the concept — who holds which shard, which
collective moves it — stays in the notebook's cells; this module only keeps the bookkeeping out
of the way.

- `Unit`: one piece of a model (an embedding, a transformer block, the head) whose parameters
  live in one flat buffer, padded to a multiple of the rank count, so that rank r's shard is the
  contiguous slice [r·n, (r+1)·n) — the layout of ZeRO and FSDP. Its parameters are views into
  the buffer, so the model computes with whatever the buffer holds; `free()` / `alloc()` give
  the buffer's memory back and take it again (ZeRO-3 between uses).
- `held_bytes(...)`: the bytes of every distinct tensor reachable from some objects — on CPU an
  exact count of what a rank holds (RSS would also count Python, torch and MPI themselves).
- `count_traffic()`: counts what each collective call moves per rank, by wrapping
  torch.distributed's functions, so the cells call `dist.*` as usual (and FSDP2 is counted too).
- `counting_tokens(...)`: a small next-token task a tiny transformer learns in a few steps.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch import nn


class Unit:
    """A module's parameters in one flat buffer of `dtype`, padded to a multiple of `world`."""

    def __init__(self, module: nn.Module, world: int, rank: int, dtype: torch.dtype = torch.bfloat16):
        self.module, self.world, self.rank = module, world, rank
        self.params = list(module.parameters())
        self.numel = sum(p.numel() for p in self.params)
        self.n = -(-self.numel // world)                       # shard size: ceil(numel / world)
        self.flat = torch.zeros(self.n * world, dtype=dtype)
        offset = 0
        for p in self.params:
            k = p.numel()
            self.flat[offset:offset + k].copy_(p.detach().reshape(-1))
            p.data = self.flat[offset:offset + k].view_as(p)  # the module now computes with the buffer
            offset += k

    def shard(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full-size flat tensor (a view)."""
        return flat[self.rank * self.n:(self.rank + 1) * self.n]

    def flat_grads(self) -> torch.Tensor:
        """Every parameter's gradient in one padded flat tensor (a new tensor: a copy)."""
        pad = torch.zeros(self.n * self.world - self.numel, dtype=self.flat.dtype)
        return torch.cat([p.grad.reshape(-1) for p in self.params] + [pad])

    def drop_grads(self) -> None:
        for p in self.params:
            p.grad = None

    def free(self) -> None:
        """Give the full buffer's memory back; the parameters keep pointing at it (now empty)."""
        self.flat.untyped_storage().resize_(0)

    def alloc(self) -> None:
        """Take the full buffer's memory again (its values are garbage until filled)."""
        self.flat.untyped_storage().resize_(self.flat.numel() * self.flat.element_size())


def units_of(model: nn.Sequential, world: int, rank: int, dtype: torch.dtype = torch.bfloat16) -> list[Unit]:
    """One Unit per top-level child of a Sequential (embeddings, each block, the head)."""
    return [Unit(child, world, rank, dtype) for child in model]


def _tensors(obj: Any, seen: set[int]) -> Iterator[torch.Tensor]:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        local = getattr(obj, "_local_tensor", None)           # a DTensor: count this rank's part
        yield obj if local is None else local
        if obj.grad is not None:
            yield from _tensors(obj.grad, seen)
    elif isinstance(obj, nn.Module):
        for t in [*obj.parameters(), *obj.buffers()]:
            yield from _tensors(t, seen)
    elif isinstance(obj, torch.optim.Optimizer):
        for state in obj.state.values():
            yield from _tensors(state, seen)
        for group in obj.param_groups:
            yield from _tensors(group["params"], seen)
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v, seen)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v, seen)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from _tensors(v, seen)


def held_bytes(*objects: Any) -> int:
    """Bytes of the distinct storages of every tensor reachable from `objects` (modules, optimizers,
    tensors, lists, dicts, plain objects' attributes). A view counts with its storage, once."""
    storages: dict[int, int] = {}
    for t in _tensors(objects, set()):
        if t.device.type == "meta":
            continue
        s = t.untyped_storage()
        if s.nbytes():
            storages[s.data_ptr()] = s.nbytes()
    return sum(storages.values())


class Traffic:
    """Per collective: calls and elements/bytes this rank sends, at the ring's lower bound
    (all-gather and reduce-scatter (N−1)/N of the full tensor, all-reduce twice that)."""

    def __init__(self, world: int):
        self.world = world
        self.calls: dict[str, int] = {}
        self.elements = 0
        self.bytes = 0

    def add(self, name: str, full: torch.Tensor, factor: float) -> None:
        share = factor * (self.world - 1) / self.world
        self.calls[name] = self.calls.get(name, 0) + 1
        self.elements += share * full.numel()
        self.bytes += share * full.numel() * full.element_size()


_FULL = {  # collective: (position and name of the full-size tensor argument, passes over it)
    "all_reduce": (0, "tensor", 2), "reduce_scatter_single": (1, "input", 1),
    "reduce_scatter_tensor": (1, "input", 1), "all_gather_single": (0, "output_tensor", 1),
    "all_gather_into_tensor": (0, "output_tensor", 1),
}


@contextlib.contextmanager
def count_traffic(world: int) -> Iterator[Traffic]:
    """Count what torch.distributed's collectives move while the block runs (then restore them)."""
    import torch.distributed as dist

    traffic, saved = Traffic(world), {}
    for name, (arg, key, factor) in _FULL.items():
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        saved[name] = fn

        def counted(*args, _fn=fn, _name=name, _arg=arg, _key=key, _factor=factor, **kwargs):
            full = args[_arg] if len(args) > _arg else kwargs[_key]
            traffic.add(_name, full, _factor)
            return _fn(*args, **kwargs)

        setattr(dist, name, counted)
    try:
        yield traffic
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def counting_tokens(batch: int, seq: int, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences that count up by a stride of their own, modulo `vocab` (3, 8, 13, 18, ...):
    inputs and next-token targets. Predictable from the two previous tokens, so loss falls fast."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(vocab, (batch, 1), generator=g)
    stride = torch.randint(1, 8, (batch, 1), generator=g)
    tokens = (start + stride * torch.arange(seq + 1)) % vocab
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
