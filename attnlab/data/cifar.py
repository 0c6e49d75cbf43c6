"""CIFAR-10 and CIFAR-100 from the original python pickles, with the NS-Attn paper's transforms.

torchvision's CIFAR classes check the md5 sum of every batch file before loading. attnlab keeps torchvision's
download (the archive is still md5-checked by ``download_and_extract_archive``) and its loading code, but replaces
the per-file integrity check by a layout check: the expected files exist, unpickle, and hold ``data`` as uint8
(n, 3072) with n labels in range. That lets a re-packed or test-generated archive load, and a wrong one still fails
with a clear ``DatasetError``. ``verify_md5=True`` restores torchvision's per-file md5 check.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import torchvision
from torchvision import transforms as T
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from attnlab.errors import DatasetError

# Per-channel mean and (population) std of the 50,000 training images, pixels in [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)


class _LayoutChecked:
    """Mixin for torchvision's CIFAR classes: integrity = files present; meta read without its md5."""

    def _check_integrity(self) -> bool:
        return not self.missing_files(self.root)

    def _load_meta(self) -> None:
        path = os.path.join(self.root, self.base_folder, self.meta["filename"])
        with open(path, "rb") as f:
            self.classes = list(pickle.load(f, encoding="latin1")[self.meta["key"]])
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    @classmethod
    def expected_files(cls) -> list[str]:
        return [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]

    @classmethod
    def missing_files(cls, root) -> list[str]:
        folder = Path(root, cls.base_folder)
        return [f for f in cls.expected_files() if not (folder / f).is_file()]

    @classmethod
    def md5_mismatches(cls, root) -> list[str]:
        folder = Path(root, cls.base_folder)
        pairs = cls.train_list + cls.test_list + [[cls.meta["filename"], cls.meta["md5"]]]
        return [f for f, md5 in pairs if not check_integrity(str(folder / f), md5)]


class CIFAR10(_LayoutChecked, torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10 with a layout check in place of per-file md5 sums (see module docstring)."""

    title, num_classes, mean, std = "CIFAR-10", 10, CIFAR10_MEAN, CIFAR10_STD


class CIFAR100(_LayoutChecked, torchvision.datasets.CIFAR100):
    """torchvision's CIFAR100 (fine labels) with a layout check in place of per-file md5 sums."""

    title, num_classes, mean, std = "CIFAR-100", 100, CIFAR100_MEAN, CIFAR100_STD


def cifar_transform(train: bool, augment: str, mean, std, *, auto_augment: bool = True,
                    random_erasing: float = 0.25, image_size: int = 32):
    """The NS-Attn paper's CIFAR pipeline (section 4, "Training setup").

    recipe (train split): RandomCrop(32, padding=4), RandomHorizontalFlip, AutoAugment(CIFAR10 policy),
    ToTensor, Normalize(mean, std), RandomErasing(p=random_erasing). Otherwise ToTensor + Normalize.
    Mixup, CutMix and repeated augmentation act on batches and samplers and live in ``attnlab.train``.
    ``image_size != 32`` inserts a Resize before ToTensor (for backbones that expect larger inputs).
    """
    recipe = train and augment == "recipe"
    ops = []
    if recipe:
        ops += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
        if auto_augment:
            ops.append(T.AutoAugment(T.AutoAugmentPolicy.CIFAR10))
    if image_size != 32:
        ops.append(T.Resize(image_size, antialias=True))
    ops += [T.ToTensor(), T.Normalize(mean, std)]
    if recipe and random_erasing > 0:
        ops.append(T.RandomErasing(p=random_erasing))
    return T.Compose(ops)


def load_cifar(cls: type, data_dir: str | os.PathLike, train: bool, transform, *, download: bool = False,
               verify_md5: bool = False):
    """``cls`` (CIFAR10 or CIFAR100) from ``<data_dir>/<cls.base_folder>``; any problem raises DatasetError."""
    root = Path(data_dir).expanduser().resolve()
    folder = root / cls.base_folder
    if download and cls.missing_files(root):
        try:  # torchvision's download: the archive's md5 is checked before it is extracted
            download_and_extract_archive(cls.url, str(root), filename=cls.filename, md5=cls.tgz_md5)
        except (OSError, RuntimeError) as err:
            raise DatasetError(
                f"could not download {cls.title} from {cls.url} into {root} ({err}); check the network, or "
                f"extract {cls.filename} by hand so that {folder} exists") from None
    missing = cls.missing_files(root)
    if missing:
        what = f"no folder {folder}" if not folder.is_dir() else f"{', '.join(missing)} missing from {folder}"
        raise DatasetError(
            f"{cls.title} files not found ({what}); pass --download (download=True) to fetch them, or --data-dir "
            f"pointing at the folder that contains {cls.base_folder}/")
    if verify_md5:
        bad = cls.md5_mismatches(root)
        if bad:
            raise DatasetError(f"{cls.title} files in {folder} fail torchvision's md5 check ({', '.join(bad)}); "
                               f"delete the folder and pass --download, or drop verify_md5")
    try:
        ds = cls(str(root), train=train, transform=transform, download=False)
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise DatasetError(f"{cls.title} files in {folder} are not in the CIFAR python pickle layout "
                           f"({type(err).__name__}: {err}); delete the folder and pass --download") from None
    n = ds.data.shape[0]
    problem = None
    if ds.data.dtype != np.uint8:
        problem = f"pixel data has dtype {ds.data.dtype}, expected uint8"
    elif len(ds.targets) != n:
        problem = f"{n} images of 3072 bytes but {len(ds.targets)} labels"
    elif n and not all(0 <= int(t) < cls.num_classes for t in (min(ds.targets), max(ds.targets))):
        problem = f"labels outside 0..{cls.num_classes - 1}"
    elif len(ds.classes) != cls.num_classes:
        problem = f"{len(ds.classes)} class names in {cls.meta['filename']}, expected {cls.num_classes}"
    if problem:
        raise DatasetError(f"{cls.title} files in {folder} are malformed ({problem}); "
                           f"delete the folder and pass --download")
    return ds
