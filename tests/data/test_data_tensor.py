"""digits (scikit-learn's 8x8 digits) and synthetic: in-memory datasets."""

from collections import Counter

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader

import attnlab.data.tensor as tensor_module
from attnlab.data import build_dataset, dataset_info


def all_items(ds):
    images = torch.stack([ds[i][0] for i in range(len(ds))])
    labels = [ds[i][1] for i in range(len(ds))]
    return images, labels


def test_digits_split_sizes_and_stratification():
    train, test = build_dataset("digits", True), build_dataset("digits", False)
    assert (len(train), len(test)) == (1437, 360)  # 1797 * 0.2 = 359.4 -> 360 test images
    total = Counter(load_digits().target.tolist())
    test_counts = Counter(all_items(test)[1])
    train_counts = Counter(all_items(train)[1])
    for c in range(10):
        assert train_counts[c] + test_counts[c] == total[c]
        assert abs(test_counts[c] - 0.2 * total[c]) <= 1  # stratified: each class keeps its 20% share


def test_digits_images_are_the_dataset_normalised_by_train_statistics():
    info = dataset_info("digits")
    assert (info.num_classes, info.image_size, info.in_chans) == (10, 8, 1)
    train_x, train_y = all_items(build_dataset("digits", True))
    test_x, test_y = all_items(build_dataset("digits", False))
    assert train_x.shape == (1437, 1, 8, 8) and train_x.dtype == torch.float32
    assert isinstance(train_y[0], int)
    # Normalised with the train split's statistics: train pixels have mean 0 and population std 1.
    assert abs(train_x.double().mean().item()) < 1e-5
    assert abs(train_x.double().std(unbiased=False).item() - 1) < 1e-5
    # Undoing the normalisation gives back exactly the 1797 digits (pixels / 16) with their labels.
    raw = torch.cat([train_x, test_x]).double() * info.std[0] + info.mean[0]
    assert torch.allclose(raw * 16, (raw * 16).round(), atol=1e-4)
    got = sorted(tuple(np.round(img.flatten().numpy() * 16).astype(int)) + (y,)
                 for img, y in zip(raw, train_y + test_y))
    digits = load_digits()
    want = sorted(tuple(img.flatten().astype(int)) + (int(y),) for img, y in zip(digits.images, digits.target))
    assert got == want


def test_digits_split_is_deterministic():
    a, b = build_dataset("digits", False), build_dataset("digits", False)
    xa, ya = all_items(a)
    xb, yb = all_items(b)
    assert ya == yb and torch.equal(xa, xb)


def test_digits_recipe_shifts_by_at_most_one_pixel():
    info = dataset_info("digits")
    plain = build_dataset("digits", True)
    shifted = build_dataset("digits", True, augment="recipe")
    background = (0.0 - info.mean[0]) / info.std[0]  # a black pixel after normalisation
    torch.manual_seed(0)
    seen = set()
    for i in range(40):
        image, label = shifted[i]
        assert image.shape == (1, 8, 8) and label == plain[i][1]
        padded = torch.full((1, 10, 10), background)
        padded[:, 1:9, 1:9] = plain[i][0]
        matches = [(dy, dx) for dy in range(3) for dx in range(3)
                   if torch.allclose(image, padded[:, dy:dy + 8, dx:dx + 8])]
        assert matches
        seen.update(matches)
    assert len(seen) > 1  # the shift is random, not fixed


def test_digits_image_size_option_upsamples():
    ds = build_dataset("digits", True, image_size=32, augment="recipe")
    assert ds[0][0].shape == (1, 32, 32)
    assert dataset_info("digits", image_size=32).image_size == 32


def test_digits_epoch_in_a_dataloader():
    loader = DataLoader(build_dataset("digits", True, augment="recipe"), batch_size=128, shuffle=True)
    batches = list(loader)
    assert sum(len(y) for _, y in batches) == 1437
    x, y = batches[0]
    assert x.shape == (128, 1, 8, 8) and y.dtype == torch.int64


def test_synthetic_shapes_labels_and_info():
    ds = build_dataset("synthetic", True, num_classes=7, image_size=12, in_chans=2, length=50, seed=3)
    info = dataset_info("synthetic", num_classes=7, image_size=12, in_chans=2)
    assert info == type(info)("synthetic", 7, 12, 2, (0.0, 0.0), (1.0, 1.0))
    x, y = all_items(ds)
    assert len(ds) == 50 and x.shape == (50, 2, 12, 12) and x.dtype == torch.float32
    assert all(isinstance(v, int) and 0 <= v < 7 for v in y) and len(set(y)) > 1


def test_synthetic_is_deterministic_and_seeded():
    a = all_items(build_dataset("synthetic", True, length=20, seed=1))
    b = all_items(build_dataset("synthetic", True, length=20, seed=1))
    c = all_items(build_dataset("synthetic", True, length=20, seed=2))
    t = all_items(build_dataset("synthetic", False, length=20, seed=1))
    assert torch.equal(a[0], b[0]) and a[1] == b[1]
    assert not torch.equal(a[0], c[0])
    assert not torch.equal(a[0], t[0])  # train and test are different draws


def test_synthetic_on_demand_equals_in_memory(monkeypatch):
    small = build_dataset("synthetic", True, length=8, image_size=8)
    monkeypatch.setattr(tensor_module, "SYNTHETIC_MAX_BYTES", 0)
    lazy = build_dataset("synthetic", True, length=8, image_size=8)
    assert small.images is not None and lazy.images is None
    for i in (0, 5, 7, -1):
        assert torch.equal(small[i][0], lazy[i][0]) and small[i][1] == lazy[i][1]
    with pytest.raises(IndexError):
        lazy[8]


def test_synthetic_pixels_are_standard_normal():
    x, y = all_items(build_dataset("synthetic", True, length=64))
    assert abs(x.mean().item()) < 0.02 and abs(x.std().item() - 1) < 0.02  # 196,608 draws: SE about 0.002
    counts = Counter(y)
    assert set(counts) <= set(range(10)) and len(counts) >= 8
