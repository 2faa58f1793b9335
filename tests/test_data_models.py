"""hpdl.data and hpdl.models: real data, the right shapes, the published sizes, and learning."""
from __future__ import annotations

import pytest
import torch

from hpdl import data, models
from hpdl.errors import HpdlError


def test_digits_split_is_complete_and_seeded():
    train, test = data.digits()
    assert (len(train), len(test)) == (1438, 359)
    x, y = train.tensors
    assert x.shape == (1438, 1, 8, 8) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert 0.0 <= float(x.min()) and float(x.max()) == 1.0
    assert set(y.tolist()) == set(range(10))
    # the two parts together are the whole data set: every label count adds up
    from sklearn.datasets import load_digits

    full = torch.bincount(torch.tensor(load_digits().target), minlength=10)
    assert torch.equal(torch.bincount(y, minlength=10) + torch.bincount(test.tensors[1], minlength=10), full)
    again, _ = data.digits()
    assert torch.equal(again.tensors[0], x)
    other, _ = data.digits(seed=1)
    assert not torch.equal(other.tensors[0], x)


def test_digits_rejects_a_bad_split():
    with pytest.raises(HpdlError, match="between 0 and 1"):
        data.digits(test_fraction=1.5)


def test_synthetic_imagenet_samples_are_stable_contiguous_images():
    ds = data.SyntheticImageNet(length=4)
    x, label = ds[2]
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    # NCHW memory, like a decoder's output: a channels-last stride here would send every
    # convolution of an ordinary model down a different (and here slower) kernel path
    assert x.is_contiguous()
    assert 0 <= label < 1000
    x2, label2 = ds[2]
    assert torch.equal(x, x2) and label == label2
    assert not torch.equal(x, ds[3][0])
    assert abs(float(x.mean())) < 0.5  # normalised around zero
    with pytest.raises(IndexError):
        ds[4]
    batch = next(iter(torch.utils.data.DataLoader(ds, batch_size=4)))
    assert batch[0].shape == (4, 3, 224, 224)


def test_synthetic_batch_is_seeded():
    x, y = data.synthetic_batch(3, size=32, classes=10, seed=5)
    assert x.shape == (3, 3, 32, 32) and y.shape == (3,) and int(y.max()) < 10
    assert torch.equal(x, data.synthetic_batch(3, size=32, classes=10, seed=5)[0])


def test_resnets_have_the_published_sizes():
    # torchvision's counts for the same architectures
    assert models.parameter_count(models.resnet50()) == 25_557_032
    assert models.parameter_count(models.resnet(18)) == 11_689_512
    with pytest.raises(HpdlError, match="choose a depth"):
        models.resnet(depth=7)


def test_train_flops_of_resnet50():
    forward = models.train_flops(models.resnet50, (1, 3, 224, 224), backward=False)
    total = models.train_flops(models.resnet50, (1, 3, 224, 224))
    assert forward == pytest.approx(8.18e9, rel=0.01)  # 4.09 G multiply-adds, the usual figure
    assert 2.8 < total / forward < 3.1  # backward costs about twice the forward
    assert models.train_flops(models.resnet50, (2, 3, 224, 224)) == pytest.approx(2 * total, rel=1e-6)


def test_model_outputs():
    assert models.DigitsMLP()(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert models.DigitsCNN()(torch.zeros(5, 1, 8, 8)).shape == (5, 10)
    assert models.resnet_tiny(num_classes=7)(torch.zeros(2, 3, 64, 64)).shape == (2, 7)


def test_digits_cnn_learns_the_digits():
    torch.manual_seed(0)
    train, test = data.digits()
    model = models.DigitsCNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = torch.utils.data.DataLoader(train, batch_size=64, shuffle=True)
    for _ in range(4):
        for x, y in loader:
            optimizer.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    x, y = test.tensors
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    assert accuracy > 0.85


def test_resnet_tiny_fits_a_batch():
    torch.manual_seed(0)
    net = models.resnet_tiny(num_classes=10)
    x, y = data.synthetic_batch(8, size=64, classes=10)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(8):
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
