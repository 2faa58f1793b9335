"""Small models for the lessons, written out in plain torch (no torchvision).

- `DigitsMLP`, `DigitsCNN`: classify the 8×8 digits of `hpdl.data.digits()` in seconds.
- `resnet(...)`: a ResNet of any depth and width; `resnet50()` is the real thing (25.6 M
  parameters, for counting FLOPs and for timing on a GPU); `resnet_tiny()` keeps the same
  shape of computation (stem, four stages, global pool) but is small enough for a 2-core
  laptop to train on ImageNet-shaped 3×224×224 tensors at hundreds of images per second.
- `train_flops(make_model, shape)`: the floating-point operations of one forward and backward
  pass, counted by torch on the meta device (no memory, no compute).
"""
from __future__ import annotations

from typing import Sequence

import torch
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


def resnet_tiny(num_classes: int = 1000, width: int = 16) -> ResNet:
    """ResNet-18's layout, one block per stage, at 1/4 of its width: ImageNet-shaped input,
    laptop-sized compute (about 1/60 of ResNet-50's FLOPs per image)."""
    return ResNet(BasicBlock, (1, 1, 1, 1), width, num_classes)


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
            out.sum().backward()
    return int(counter.get_total_flops())
