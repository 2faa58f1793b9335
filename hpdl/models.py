"""Small models for the lessons, written out in plain torch (no torchvision).

- `DigitsMLP`, `DigitsCNN`: classify the 8×8 digits of `hpdl.data.digits()` in seconds.
- `resnet(...)`: a ResNet of any depth and width; `resnet50()` is the real thing (25.6 M
  parameters, for counting FLOPs and for timing on a GPU), `resnet101()` too; `resnet_tiny()` keeps the same
  shape of computation (stem, four stages, global pool) but is small enough for a 2-core
  laptop to train on ImageNet-shaped 3×224×224 tensors at hundreds of images per second.
- `vgg16()`, `inception_v3()`: the other models of published scaling benchmarks (lesson 09),
  layer for layer as torchvision defines them, so their parameter counts match torchvision's.
- `train_flops(make_model, shape)`: the floating-point operations of one forward and backward
  pass, counted by torch on the meta device (no memory, no compute); `gradient_ready(...)`,
  when backward produces each gradient.
- `tiny_transformer(...)`: a GPT-style decoder (token and position embeddings, pre-norm blocks of
  causal self-attention and a 4× MLP, a head), small enough to train on CPU in a lesson; the
  running model of lesson 11.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


class DigitsMLP(nn.Sequential):
    """64 pixels → hidden → 10 classes."""

    def __init__(self, hidden: int = 128):
        super().__init__(nn.Flatten(), nn.Linear(64, hidden), nn.ReLU(), nn.Linear(hidden, 10))


class DigitsCNN(nn.Sequential):
    """Two 3×3 convolutions, a pooling, two linear layers: ~40 k parameters."""

    def __init__(self, channels: int = 16, hidden: int = 64):
        c = channels
        super().__init__(
            nn.Conv2d(1, c, 3, padding=1), nn.ReLU(),
            nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU(),
            nn.MaxPool2d(2),  # 8×8 → 4×4
            nn.Flatten(),
            nn.Linear(2 * c * 16, hidden), nn.ReLU(),
            nn.Linear(hidden, 10),
        )


class BasicBlock(nn.Module):
    """Two 3×3 convolutions and a shortcut (ResNet-18/34)."""

    expansion = 1

    def __init__(self, c_in: int, c: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.shortcut = _shortcut(c_in, c, stride)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1×1 down, 3×3, 1×1 up (×4) and a shortcut (ResNet-50/101/152)."""

    expansion = 4

    def __init__(self, c_in: int, c: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c)
        self.conv2 = nn.Conv2d(c, c, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c)
        self.conv3 = nn.Conv2d(c, 4 * c, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(4 * c)
        self.shortcut = _shortcut(c_in, 4 * c, stride)

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


def _shortcut(c_in: int, c_out: int, stride: int) -> nn.Module:
    if stride == 1 and c_in == c_out:
        return nn.Identity()
    return nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))


class ResNet(nn.Module):
    """Stem (7×7/2 conv, 3×3/2 pool), four stages (the first keeps the resolution, each later
    one halves it and doubles the width), global average pool, one linear classifier."""

    def __init__(self, block: type, layers: Sequence[int], width: int = 64, num_classes: int = 1000):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, width, 7, 2, 3, bias=False), nn.BatchNorm2d(width), nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        stages, c_in = [], width
        for i, n in enumerate(layers):
            c = width * 2**i
            blocks = []
            for j in range(n):
                blocks.append(block(c_in, c, stride=2 if (i > 0 and j == 0) else 1))
                c_in = c * block.expansion
            stages.append(nn.Sequential(*blocks))
        self.stages = nn.Sequential(*stages)
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, num_classes))

    def forward(self, x):
        return self.head(self.stages(self.stem(x)))


def resnet(depth: int = 50, width: int = 64, num_classes: int = 1000) -> ResNet:
    """The ResNet of He et al. (2016) with `depth` in 18, 34, 50, 101, 152."""
    table = {
        18: (BasicBlock, (2, 2, 2, 2)),
        34: (BasicBlock, (3, 4, 6, 3)),
        50: (Bottleneck, (3, 4, 6, 3)),
        101: (Bottleneck, (3, 4, 23, 3)),
        152: (Bottleneck, (3, 8, 36, 3)),
    }
    if depth not in table:
        from hpdl.errors import HpdlError

        raise HpdlError(f"resnet(depth={depth!r}): choose a depth among {sorted(table)}.")
    block, layers = table[depth]
    return ResNet(block, layers, width, num_classes)


def resnet50(num_classes: int = 1000) -> ResNet:
    """ResNet-50 as benchmarked everywhere: 25.6 M parameters, ~4.1 G multiply-adds per image."""
    return resnet(50, 64, num_classes)


def resnet101(num_classes: int = 1000) -> ResNet:
    """ResNet-101: 44.5 M parameters, ~7.8 G multiply-adds per image (Horovod's benchmark model)."""
    return resnet(101, 64, num_classes)


def resnet_tiny(num_classes: int = 1000, width: int = 16) -> ResNet:
    """ResNet-18's layout, one block per stage, at 1/4 of its width: ImageNet-shaped input,
    laptop-sized compute (about 1/60 of ResNet-50's FLOPs per image)."""
    return ResNet(BasicBlock, (1, 1, 1, 1), width, num_classes)


class VGG(nn.Sequential):
    """Simonyan & Zisserman (2014): 3×3 convolutions in five stages, then three large linear
    layers. VGG-16 has 138 M parameters, 90% of them in the first linear layer: the
    model that makes gradient communication expensive."""

    def __init__(self, stages: Sequence[Sequence[int]] = ((64, 64), (128, 128), (256,) * 3, (512,) * 3, (512,) * 3),
                 num_classes: int = 1000):
        layers, c_in = [], 3
        for stage in stages:
            for c in stage:
                layers += [nn.Conv2d(c_in, c, 3, padding=1), nn.ReLU(inplace=True)]
                c_in = c
            layers.append(nn.MaxPool2d(2))
        super().__init__(
            nn.Sequential(*layers), nn.AdaptiveAvgPool2d(7), nn.Flatten(),
            nn.Linear(c_in * 49, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, 4096), nn.ReLU(inplace=True), nn.Dropout(),
            nn.Linear(4096, num_classes),
        )


def vgg16(num_classes: int = 1000) -> VGG:
    """VGG-16 (configuration D): 138,357,544 parameters, ~15.5 G multiply-adds per 224×224 image."""
    return VGG(num_classes=num_classes)


class _Conv(nn.Sequential):
    """Inception's unit: convolution without bias, batch norm, ReLU."""

    def __init__(self, c_in: int, c_out: int, kernel, stride=1, padding=0):
        super().__init__(nn.Conv2d(c_in, c_out, kernel, stride, padding, bias=False),
                         nn.BatchNorm2d(c_out, eps=0.001), nn.ReLU(inplace=True))


class _Branches(nn.Module):
    """Run every branch on the same input and concatenate along the channels."""

    def __init__(self, *branches: nn.Module):
        super().__init__()
        self.branches = nn.ModuleList(branches)

    def forward(self, x):
        return torch.cat([b(x) for b in self.branches], 1)


class _Split(nn.Module):
    """One stem, then two parallel convolutions concatenated (Inception-E's 1×3 and 3×1)."""

    def __init__(self, stem: nn.Module, a: nn.Module, b: nn.Module):
        super().__init__()
        self.stem, self.a, self.b = stem, a, b

    def forward(self, x):
        x = self.stem(x)
        return torch.cat([self.a(x), self.b(x)], 1)


def _pool_branch(c_in: int, c_out: int) -> nn.Module:
    return nn.Sequential(nn.AvgPool2d(3, 1, 1), _Conv(c_in, c_out, 1))


def _inception_a(c_in: int, pool: int) -> nn.Module:
    return _Branches(_Conv(c_in, 64, 1),
                     nn.Sequential(_Conv(c_in, 48, 1), _Conv(48, 64, 5, padding=2)),
                     nn.Sequential(_Conv(c_in, 64, 1), _Conv(64, 96, 3, padding=1), _Conv(96, 96, 3, padding=1)),
                     _pool_branch(c_in, pool))


def _inception_b(c_in: int) -> nn.Module:  # 35×35 → 17×17
    return _Branches(_Conv(c_in, 384, 3, stride=2),
                     nn.Sequential(_Conv(c_in, 64, 1), _Conv(64, 96, 3, padding=1), _Conv(96, 96, 3, stride=2)),
                     nn.MaxPool2d(3, 2))


def _inception_c(c_in: int, c7: int) -> nn.Module:  # 7×7 convolutions factored into 1×7 and 7×1
    row, col = ((1, 7), (0, 3)), ((7, 1), (3, 0))
    return _Branches(_Conv(c_in, 192, 1),
                     nn.Sequential(_Conv(c_in, c7, 1), _Conv(c7, c7, row[0], padding=row[1]),
                                   _Conv(c7, 192, col[0], padding=col[1])),
                     nn.Sequential(_Conv(c_in, c7, 1), _Conv(c7, c7, col[0], padding=col[1]),
                                   _Conv(c7, c7, row[0], padding=row[1]), _Conv(c7, c7, col[0], padding=col[1]),
                                   _Conv(c7, 192, row[0], padding=row[1])),
                     _pool_branch(c_in, 192))


def _inception_d(c_in: int) -> nn.Module:  # 17×17 → 8×8
    return _Branches(nn.Sequential(_Conv(c_in, 192, 1), _Conv(192, 320, 3, stride=2)),
                     nn.Sequential(_Conv(c_in, 192, 1), _Conv(192, 192, (1, 7), padding=(0, 3)),
                                   _Conv(192, 192, (7, 1), padding=(3, 0)), _Conv(192, 192, 3, stride=2)),
                     nn.MaxPool2d(3, 2))


def _inception_e(c_in: int) -> nn.Module:
    def split(stem):
        c = 384
        return _Split(stem, _Conv(c, c, (1, 3), padding=(0, 1)), _Conv(c, c, (3, 1), padding=(1, 0)))

    return _Branches(_Conv(c_in, 320, 1),
                     split(_Conv(c_in, 384, 1)),
                     split(nn.Sequential(_Conv(c_in, 448, 1), _Conv(448, 384, 3, padding=1))),
                     _pool_branch(c_in, 192))


class InceptionV3(nn.Module):
    """Szegedy et al. (2015), as torchvision builds it for 299×299 images: a convolutional stem,
    three Inception-A, B, four Inception-C, D, two Inception-E blocks, and (for training) an
    auxiliary classifier after the last Inception-C block."""

    def __init__(self, num_classes: int = 1000, aux_logits: bool = True):
        super().__init__()
        self.stem = nn.Sequential(
            _Conv(3, 32, 3, stride=2), _Conv(32, 32, 3), _Conv(32, 64, 3, padding=1), nn.MaxPool2d(3, 2),
            _Conv(64, 80, 1), _Conv(80, 192, 3), nn.MaxPool2d(3, 2))
        self.mixed_5_6 = nn.Sequential(
            _inception_a(192, 32), _inception_a(256, 64), _inception_a(288, 64), _inception_b(288),
            _inception_c(768, 128), _inception_c(768, 160), _inception_c(768, 160), _inception_c(768, 192))
        self.aux = nn.Sequential(
            nn.AvgPool2d(5, 3), _Conv(768, 128, 1), _Conv(128, 768, 5), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
            nn.Linear(768, num_classes)) if aux_logits else None
        self.mixed_7 = nn.Sequential(_inception_d(768), _inception_e(1280), _inception_e(2048))
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Dropout(0.5), nn.Flatten(), nn.Linear(2048, num_classes))

    def forward(self, x):
        x = self.mixed_5_6(self.stem(x))
        out = self.head(self.mixed_7(x))
        if self.aux is not None and self.training:
            return out, self.aux(x)  # as torchvision: train on loss(out) + 0.4 · loss(aux)
        return out


def inception_v3(num_classes: int = 1000, aux_logits: bool = True) -> InceptionV3:
    """Inception V3: 27,161,264 parameters with the auxiliary classifier, 23,834,568 without."""
    return InceptionV3(num_classes, aux_logits)


def parameter_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def train_flops(make_model, input_shape: Sequence[int], backward: bool = True) -> int:
    """FLOPs (multiply and add counted separately) of one training step's forward and backward
    pass on a batch of `input_shape`, counted without allocating or computing anything.

    `make_model` is a zero-argument callable (e.g. `hpdl.models.resnet50`) so the model can be
    built directly on the meta device.
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = make_model()
        x = torch.empty(*input_shape)
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        if backward:
            outs = out if isinstance(out, tuple) else (out,)
            sum(o.sum() for o in outs).backward()
    return int(counter.get_total_flops())


def gradient_ready(make_model, input_shape: Sequence[int]) -> list[tuple[int, float]]:
    """When each gradient exists during backward: (values in the tensor, share of backward's
    FLOPs done when it is accumulated), in the order backward produces them — the last layer's
    first. Counted on the meta device, like train_flops().

    Why: a data-parallel framework can start a tensor's all-reduce only then, so this order and
    these times decide how much communication backward can hide (hpdl.predict.serial_schedule).
    Backward's time is taken as proportional to its FLOPs (convolutions and matrix products;
    the element-wise work of batch norm and activations is not counted).
    """
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        model = make_model()
        x = torch.empty(*input_shape)
    marks: list[tuple[int, int]] = []
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        forward = counter.get_total_flops()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda t: marks.append((t.numel(), counter.get_total_flops())))
        outs = out if isinstance(out, tuple) else (out,)
        sum(o.sum() for o in outs).backward()
        backward = counter.get_total_flops() - forward
    return [(n, (flops - forward) / backward) for n, flops in marks]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention, each position seeing only itself and earlier ones."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)   # query, key and value of every head in one matrix
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class TransformerBlock(nn.Module):
    """Pre-norm block: x + attention(LN(x)), then x + MLP(LN(x)); the MLP is d → 4d → d."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(d), CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """Token embedding plus learned position embedding."""

    def __init__(self, vocab: int, d: int, seq: int):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(seq, d)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos.weight[: idx.shape[1]]  # positions 0..T-1: the table's first T rows


class Head(nn.Module):
    """Final LayerNorm and the projection to the vocabulary."""

    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.ln, self.out = nn.LayerNorm(d), nn.Linear(d, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln(x))


def tiny_transformer(vocab: int = 64, d: int = 64, heads: int = 4, layers: int = 4, seq: int = 32,
                     seed: int = 0) -> nn.Sequential:
    """Embeddings, `layers` TransformerBlocks, Head: a Sequential, so each part is a unit to shard,
    checkpoint or place on its own. About 12·d² parameters per block (d=64: 50 k)."""
    torch.manual_seed(seed)
    return nn.Sequential(Embeddings(vocab, d, seq), *[TransformerBlock(d, heads) for _ in range(layers)],
                         Head(vocab, d))
