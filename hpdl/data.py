"""Teaching data that needs no download.

- `digits()`: scikit-learn's bundled handwritten digits (1797 real 8×8 images, 10 classes),
  as torch datasets split into train and test.
- `SyntheticImageNet`: ImageNet-shaped samples (3×224×224, 1000 classes) made up on the fly.
  Each sample goes through the work a real input pipeline does per image (a stored uint8
  image larger than the crop, a random crop, a flip, conversion to float, normalisation), so
  "time spent on data" is real time spent, just without disk and JPEG decoding.
- `synthetic_batch()`: one ready-made batch, for measuring the model alone.

On a cluster, real data sets live in staged folders; nothing here reaches the network.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGENET_TRAIN_IMAGES = 1_281_167


def digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of (image 1×8×8 float32 in [0, 1], label int64).

    The 1797 images are shuffled with `seed` (not stratified); 20% are held out by default.
    """
    from sklearn.datasets import load_digits

    if not 0.0 < test_fraction < 1.0:
        from hpdl.errors import HpdlError

        raise HpdlError(f"test_fraction is a share of the 1797 images, between 0 and 1; got {test_fraction!r}.")
    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(round(test_fraction * len(y)))
    test, train = order[:n_test], order[n_test:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[test], y[test])


class SyntheticImageNet(Dataset):
    """`length` ImageNet-shaped samples: (3×size×size float32, normalised; label in [0, classes)).

    Sample i is the same every time it is read (seeded by i), like a file on disk.
    """

    def __init__(self, length: int = 256, size: int = 224, classes: int = 1000, stored: int | None = None,
                 seed: int = 0):
        self.length, self.size, self.classes, self.seed = length, size, classes, seed
        self.stored = stored or (size * 8) // 7  # 224 → 256, as ImageNet images are resized
        self.mean = torch.tensor(IMAGENET_MEAN).view(3, 1, 1)
        self.std = torch.tensor(IMAGENET_STD).view(3, 1, 1)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        if not 0 <= i < self.length:
            raise IndexError(i)
        rng = np.random.default_rng(self.seed * 1_000_003 + i)
        image = rng.integers(0, 256, (self.stored, self.stored, 3), dtype=np.uint8)  # "decoded" HWC
        top, left = rng.integers(0, self.stored - self.size + 1, 2)
        crop = image[top : top + self.size, left : left + self.size]
        if rng.random() < 0.5:
            crop = crop[:, ::-1]
        x = torch.from_numpy(np.ascontiguousarray(crop)).permute(2, 0, 1).float().div_(255.0)
        x = ((x - self.mean) / self.std).contiguous()  # NCHW, as a real decoder's output would be
        return x, int(rng.integers(self.classes))


def synthetic_batch(batch_size: int = 32, size: int = 224, classes: int = 1000, seed: int = 0,
                    device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of random ImageNet-shaped inputs and labels, already on `device`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, 3, size, size, generator=g)
    y = torch.randint(0, classes, (batch_size,), generator=g)
    return x.to(device), y.to(device)
