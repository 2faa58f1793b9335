"""Lesson 11's plumbing (hpdl.sharding) and running model, in one process: the bookkeeping the
lesson's memory and traffic numbers rest on must count exactly what is there."""
from __future__ import annotations

import torch

import hpdl.models
import hpdl.sharding
from hpdl.sharding import Unit, held_bytes


def test_tiny_transformer_shape_and_size():
    model = hpdl.models.tiny_transformer(vocab=64, d=64, heads=4, layers=4, seq=32)
    assert len(model) == 6                                     # embeddings, 4 blocks, head: the units
    per_block = sum(p.numel() for p in model[1].parameters())
    assert per_block == 12 * 64 * 64 + 13 * 64                 # 12·d² weights, biases and LayerNorms
    logits = model(torch.randint(64, (2, 32)))
    assert logits.shape == (2, 32, 64)


def test_causal_attention_does_not_look_ahead():
    model = hpdl.models.tiny_transformer(layers=1)
    a, b = torch.randint(64, (1, 32)), torch.randint(64, (1, 32))
    b[:, :10] = a[:, :10]
    assert torch.allclose(model(a)[:, :10], model(b)[:, :10])
    assert not torch.allclose(model(a)[:, 10:], model(b)[:, 10:])


def test_unit_parameters_are_views_of_its_padded_buffer():
    layer = torch.nn.Linear(5, 3)                              # 18 values: 5 on each of 4 ranks, 2 padding
    before = layer(torch.ones(1, 5)).detach()
    unit = Unit(layer, world=4, rank=3, dtype=torch.float32)
    assert unit.n == 5 and unit.flat.numel() == 20
    assert torch.equal(layer(torch.ones(1, 5)), before)
    unit.flat.zero_()                                          # the module computes with the buffer
    assert torch.equal(layer(torch.ones(1, 5)), torch.zeros(1, 3))
    assert unit.shard(unit.flat).numel() == 5


def test_held_bytes_counts_storages_once_and_sees_free():
    layer = torch.nn.Linear(64, 64, bias=False)
    unit = Unit(layer, world=2, rank=0, dtype=torch.bfloat16)
    assert held_bytes(unit) == 64 * 64 * 2                     # the buffer, not also each parameter view
    assert held_bytes(unit, layer, [unit.flat[:10]]) == 64 * 64 * 2
    unit.free()
    assert held_bytes(unit) == 0
    unit.alloc()
    assert held_bytes(unit) == 64 * 64 * 2


def test_flat_grads_pads_and_drop_grads_clears():
    layer = torch.nn.Linear(3, 1)                              # 4 values on 3 ranks: shard 2, 2 padding
    unit = Unit(layer, world=3, rank=0, dtype=torch.float32)
    layer(torch.ones(2, 3)).sum().backward()
    g = unit.flat_grads()
    assert g.numel() == 6 and torch.equal(g[4:], torch.zeros(2))
    assert torch.equal(g[:3], torch.full((3,), 2.0)) and g[3] == 2.0
    unit.drop_grads()
    assert all(p.grad is None for p in layer.parameters())


def test_counting_tokens_are_next_tokens():
    x, y = hpdl.sharding.counting_tokens(8, 16, 64)
    assert torch.equal(x[:, 1:], y[:, :-1])
    step = (x[:, 1] - x[:, 0]) % 64
    assert torch.equal((x + step[:, None]) % 64, y)
