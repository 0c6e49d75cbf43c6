"""In-memory datasets: scikit-learn's 8x8 digits (the embedded default) and synthetic images for benchmarks.

Both hold their images as one float tensor, so an epoch in a DataLoader costs only indexing and collation.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from attnlab.data.registry import DatasetInfo, DeviceData

# Fixed split of the 1,797 digits: 20% test, stratified by class, same every run.
DIGITS_TEST_SIZE, DIGITS_SPLIT_SEED = 0.2, 0
# Synthetic datasets up to this size are generated once and kept in memory; larger ones draw each image on demand.
SYNTHETIC_MAX_BYTES = 256 * 2**20


class TensorImageDataset(Dataset):
    """Images (n, C, H, W) float32, already normalised, and integer labels.

    With ``shift = s > 0`` each item is a random translation by up to s pixels in each direction: the images are
    stored zero-padded (the pad value is the normalised value of a black pixel) and a random (H, W) window is
    cut per item, drawn from torch's global RNG so that DataLoader workers get their own streams.
    """

    def __init__(self, images: torch.Tensor, labels, *, shift: int = 0, pad_value: float = 0.0):
        self.images, self.labels, self.shift = images, [int(y) for y in labels], int(shift)
        if self.shift:
            self.padded = F.pad(images, (self.shift,) * 4, value=float(pad_value))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if not self.shift:
            return self.images[index], self.labels[index]
        dy, dx = torch.randint(0, 2 * self.shift + 1, (2,)).tolist()
        h, w = self.images.shape[-2:]
        return self.padded[index, :, dy:dy + h, dx:dx + w], self.labels[index]


@lru_cache(maxsize=1)
def digits_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x_train, y_train, x_test, y_test): pixels / 16 as float64 (n, 8, 8), stratified 80/20 split, seed 0."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x, y = digits.images / 16.0, digits.target
    x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=DIGITS_TEST_SIZE, stratify=y,
                                              random_state=DIGITS_SPLIT_SEED)
    return x_tr, y_tr, x_te, y_te


def digits_stats() -> tuple[float, float]:
    """Mean and population std over every pixel of the training split (pixels / 16)."""
    x_tr = digits_split()[0]
    return float(x_tr.mean()), float(x_tr.std())


def build_digits(train: bool, *, data_dir=None, download: bool = False, augment: str = "none",
                 image_size: int = 8) -> TensorImageDataset:
    """The table's builder (digits need no files): (1, image_size, image_size) images normalised by the train
    split's mean/std.

    ``image_size != 8`` upsamples bilinearly once, in memory. ``augment="recipe"`` on the train split shifts each
    image by up to one original pixel (``image_size // 8`` pixels) in each direction; nothing else.
    """
    x_tr, y_tr, x_te, y_te = digits_split()
    mean, std = digits_stats()
    x, y = (x_tr, y_tr) if train else (x_te, y_te)
    images = torch.from_numpy((x - mean) / std).float().unsqueeze(1)
    if image_size != 8:
        images = F.interpolate(images, size=(image_size, image_size), mode="bilinear", align_corners=False)
    shift = max(1, image_size // 8) if (train and augment == "recipe") else 0
    return TensorImageDataset(images.contiguous(), y, shift=shift, pad_value=(0.0 - mean) / std)


def info_digits(data_dir, *, image_size: int) -> DatasetInfo:
    mean, std = digits_stats()
    return DatasetInfo("digits", 10, image_size, 1, (mean,), (std,))


def device_digits(*, data_dir, download: bool, augment: str, image_size: int) -> DeviceData:
    """The train split for the device pipeline; the recipe is build_digits' shift: a crop padded with the
    normalised black."""
    ds = build_digits(True, image_size=image_size)
    if augment != "recipe":
        return DeviceData(ds.images, ds.labels, None)
    mean, std = digits_stats()
    return DeviceData(ds.images, ds.labels, dict(crop_padding=max(1, image_size // 8), flip=0.0, auto_augment=False,
                                                 random_erasing=0.0), dict(pad_value=(0.0 - mean) / std))


class SyntheticDataset(Dataset):
    """Standard-normal images (in_chans, image_size, image_size) and uniform labels in 0..num_classes-1.

    Deterministic: labels come from ``numpy.random.default_rng([seed, split])`` and image i from numpy's
    counter-based Philox generator keyed by ``(i, 2 * seed + split)`` (split 0 = train, 1 = test), so image i is
    the same whether the set is materialised (up to SYNTHETIC_MAX_BYTES) or drawn on demand, and costs no
    more to draw alone. Already normalised: mean 0, std 1.
    """

    def __init__(self, *, train: bool, num_classes: int = 10, image_size: int = 32, in_chans: int = 3,
                 length: int = 1024, seed: int = 0):
        split = 0 if train else 1
        self.stream = 2 * int(seed) + split
        self.shape = (in_chans, image_size, image_size)
        self.labels = np.random.default_rng([int(seed), split]).integers(num_classes, size=length).tolist()
        self.images = None
        if length * in_chans * image_size * image_size * 4 <= SYNTHETIC_MAX_BYTES:
            self.images = torch.stack([self._draw(i) for i in range(length)]) if length else torch.empty(0, *self.shape)

    def _draw(self, index: int) -> torch.Tensor:
        # torch's CPU generator keeps only 32 bits of its seed; Philox takes a 128-bit key.
        key = np.array([index, self.stream], dtype=np.uint64)
        rng = np.random.Generator(np.random.Philox(key=key))
        return torch.from_numpy(rng.standard_normal(self.shape, dtype=np.float32))

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        if index < 0:
            index += len(self.labels)
        if not 0 <= index < len(self.labels):
            raise IndexError(f"index {index} out of range for a synthetic dataset of length {len(self.labels)}")
        image = self.images[index] if self.images is not None else self._draw(index)
        return image, self.labels[index]


def info_synthetic(data_dir, *, num_classes: int, image_size: int, in_chans: int, **_options) -> DatasetInfo:
    return DatasetInfo("synthetic", num_classes, image_size, in_chans, (0.0,) * in_chans, (1.0,) * in_chans)


def load_synthetic(train: bool, *, data_dir, download: bool, augment: str, **options) -> SyntheticDataset:
    """The table's builder (synthetic images are already normalised and take no augmentation)."""
    return SyntheticDataset(train=train, **options)


def device_synthetic(*, data_dir, download: bool, augment: str, **options) -> DeviceData:
    ds = SyntheticDataset(train=True, **options)
    images = ds.images if ds.images is not None else torch.stack([ds[i][0] for i in range(len(ds))])
    return DeviceData(images, ds.labels, None)
