"""CIFAR-10 and CIFAR-100 from the original python pickles, with the NS-Attn paper's transforms.

The pickles are read by :class:`CifarUnpickler`, which refuses any object the CIFAR format never holds before it is
created, and their md5 sums are checked unless ``verify_md5: false`` (then a layout check still applies): why and
how, docs/training.md, "CIFAR files: no code runs, md5 checked".
"""

from __future__ import annotations

import codecs
import os
import pickle
from functools import partial
from pathlib import Path

import numpy as np
import torch
import torchvision
from torchvision import transforms as T
from torchvision.datasets.utils import check_integrity, download_and_extract_archive

from attnlab.data.registry import DatasetInfo, DeviceData
from attnlab.errors import DatasetError

# Per-channel mean and (population) std of the 50,000 training images, pixels in [0, 1].
CIFAR10_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR10_STD = (0.2470, 0.2435, 0.2616)
CIFAR100_MEAN = (0.5071, 0.4865, 0.4409)
CIFAR100_STD = (0.2673, 0.2564, 0.2762)

_UINT8 = np.dtype(np.uint8)
_np_reconstruct = np.zeros(0).__reduce__()[0]  # numpy's _reconstruct, wherever this numpy keeps it


class RefusedPickle(pickle.UnpicklingError):
    """A CIFAR file names an object that the CIFAR python format never contains."""


def _refuse(what: str):
    raise RefusedPickle(f"it holds {what}, which a CIFAR python file never contains")


def _dtype(spec, *args):
    if spec not in ("u1", "uint8"):
        _refuse(f"a numpy array of dtype {spec!r}")
    return np.dtype(spec, *args)


def _reconstruct(cls, shape, typecode):
    if cls is not np.ndarray:
        _refuse(f"an array of class {cls!r}")
    return _np_reconstruct(np.ndarray, shape, typecode)


def _frombuffer(buf, dtype, shape, order):
    if np.dtype(dtype) != _UINT8:
        _refuse(f"a numpy array of dtype {dtype}")
    return np.frombuffer(buf, dtype=_UINT8).reshape(shape, order=order)


def _encode(text, encoding="utf-8"):
    # protocol-2 pickles written by Python 3 spell bytes as _codecs.encode(str, "latin1")
    if not isinstance(text, str) or codecs.lookup(encoding).name != "iso8859-1":
        _refuse(f"a call _codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


# (module, name) -> the guarded callable the unpickler hands out; numpy 1 and 2 spell the module differently.
_ALLOWED = {
    ("numpy", "dtype"): _dtype,
    ("numpy", "ndarray"): np.ndarray,
    ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
    ("numpy.core.numeric", "_frombuffer"): _frombuffer,
    ("numpy._core.numeric", "_frombuffer"): _frombuffer,
    ("_codecs", "encode"): _encode,
}


class CifarUnpickler(pickle.Unpickler):
    """An unpickler for the CIFAR python format: every global a pickle names goes through :meth:`find_class`;
    anything outside ``_ALLOWED`` is refused before it is imported or called."""

    def find_class(self, module: str, name: str):
        try:
            return _ALLOWED[module, name]
        except KeyError:
            _refuse(f"a reference to {module}.{name}")


def read_cifar_pickle(path: str | os.PathLike):
    """The object in one CIFAR python file, read with :class:`CifarUnpickler` (Python 2 strings as latin1)."""
    with open(path, "rb") as f:
        return CifarUnpickler(f, encoding="latin1").load()


class _SafeCifar:
    """Mixin for torchvision's CIFAR classes whose ``__init__`` reads every file through :func:`read_cifar_pickle`
    (torchvision's uses ``pickle.load``) into torchvision's attributes, which its ``__getitem__`` serves."""

    def __init__(self, root, train: bool = True, transform=None, target_transform=None) -> None:
        torchvision.datasets.VisionDataset.__init__(self, root, transform=transform, target_transform=target_transform)
        self.train = train
        data, self.targets = [], []
        for name, _ in self.train_list if train else self.test_list:
            entry = self._entry(name)
            data.append(entry["data"])
            self.targets.extend(entry["labels"] if "labels" in entry else entry["fine_labels"])
        self.data = np.vstack(data).reshape(-1, 3, 32, 32).transpose((0, 2, 3, 1))  # HWC, as torchvision
        self.classes = list(self._entry(self.meta["filename"])[self.meta["key"]])
        self.class_to_idx = {c: i for i, c in enumerate(self.classes)}

    def _entry(self, name: str) -> dict:
        path = Path(self.root, self.base_folder, name)
        try:
            entry = read_cifar_pickle(path)
        except RefusedPickle as err:
            raise DatasetError(f"refused to load {path}: {err}; nothing in it was run. Delete the folder and pass "
                               f"--download") from None
        except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
                MemoryError) as err:
            raise DatasetError(f"{path} is not in the CIFAR python pickle layout ({type(err).__name__}: {err}); "
                               f"delete the folder and pass --download") from None
        if not isinstance(entry, dict):
            raise DatasetError(f"{path} is not in the CIFAR python pickle layout (a {type(entry).__name__}, not a "
                               f"dict); delete the folder and pass --download")
        return entry

    @classmethod
    def missing_files(cls, root) -> list[str]:
        folder = Path(root, cls.base_folder)
        names = [f for f, _ in cls.train_list + cls.test_list] + [cls.meta["filename"]]
        return [f for f in names if not (folder / f).is_file()]

    @classmethod
    def md5_mismatches(cls, root) -> list[str]:
        folder = Path(root, cls.base_folder)
        pairs = cls.train_list + cls.test_list + [[cls.meta["filename"], cls.meta["md5"]]]
        return [f for f, md5 in pairs if not check_integrity(str(folder / f), md5)]


class CIFAR10(_SafeCifar, torchvision.datasets.CIFAR10):
    """torchvision's CIFAR10, its files read by the restricted unpickler (see module docstring)."""

    title, num_classes, mean, std = "CIFAR-10", 10, CIFAR10_MEAN, CIFAR10_STD


class CIFAR100(_SafeCifar, torchvision.datasets.CIFAR100):
    """torchvision's CIFAR100 (fine labels), its files read by the restricted unpickler."""

    title, num_classes, mean, std = "CIFAR-100", 100, CIFAR100_MEAN, CIFAR100_STD


def cifar_transform(train: bool, augment: str, mean, std, *, auto_augment: bool = True,
                    random_erasing: float = 0.25, image_size: int = 32):
    """The NS-Attn paper's CIFAR pipeline (section 4, "Training setup").

    recipe (train split): RandomCrop(32, padding=4), RandomHorizontalFlip, AutoAugment(CIFAR10 policy),
    ToTensor, Normalize(mean, std), RandomErasing(p=random_erasing). Otherwise ToTensor + Normalize; a Resize
    before ToTensor when ``image_size != 32``. Mixup, CutMix and repeated augmentation live in ``attnlab.train``.
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
               verify_md5: bool = True):
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
            raise DatasetError(f"{cls.title} files in {folder} fail the md5 check of the official files "
                               f"({', '.join(bad)}); delete the folder and pass --download, or, for a repacked or "
                               f"generated copy, set the data option verify_md5: false")
    try:
        ds = cls(str(root), train=train, transform=transform)
    except DatasetError:
        raise
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError, TypeError, AttributeError, IndexError) as err:
        raise DatasetError(f"{cls.title} files in {folder} are not in the CIFAR python pickle layout "
                           f"({type(err).__name__}: {err}); delete the folder and pass --download") from None
    n = ds.data.shape[0]
    problem = None
    if ds.data.dtype != np.uint8:
        problem = f"pixel data has dtype {ds.data.dtype}, expected uint8"
    elif len(ds.targets) != n:
        problem = f"{n} images of 3072 bytes but {len(ds.targets)} labels"
    elif not all(type(t) is int and 0 <= t < cls.num_classes for t in ds.targets):
        problem = f"labels outside 0..{cls.num_classes - 1}"
    elif len(ds.classes) != cls.num_classes or not all(isinstance(c, str) for c in ds.classes):
        problem = f"{len(ds.classes)} class names in {cls.meta['filename']}, expected {cls.num_classes}"
    if problem:
        raise DatasetError(f"{cls.title} files in {folder} are malformed ({problem}); "
                           f"delete the folder and pass --download")
    return ds


# ---- the dataset table's entries (attnlab.data.registry): cifar10 and cifar100 share these, by class
def _info(cls: type, data_dir, *, image_size: int, **_recipe) -> DatasetInfo:
    return DatasetInfo(cls.__name__.lower(), cls.num_classes, image_size, 3, cls.mean, cls.std)


def _transform(cls: type, train: bool, augment: str, *, auto_augment: bool, random_erasing: float, image_size: int,
               verify_md5: bool):
    return cifar_transform(train, augment, cls.mean, cls.std, auto_augment=auto_augment,
                           random_erasing=random_erasing, image_size=image_size)


def _build(cls: type, train: bool, *, data_dir, download: bool, augment: str, verify_md5: bool, **options):
    transform = _transform(cls, train, augment, verify_md5=verify_md5, **options)
    return load_cifar(cls, data_dir, train, transform, download=download, verify_md5=verify_md5)


def _device(cls: type, *, data_dir, download: bool, augment: str, auto_augment: bool, random_erasing: float,
            image_size: int, verify_md5: bool) -> DeviceData:
    """uint8 pixels (n, 3, 32, 32); the recipe's crop, flip, AutoAugment and random erasing run on the device."""
    ds = load_cifar(cls, data_dir, True, None, download=download, verify_md5=verify_md5)
    images = torch.from_numpy(ds.data).permute(0, 3, 1, 2).contiguous()
    recipe = dict(auto_augment=auto_augment, random_erasing=random_erasing) if augment == "recipe" else None
    return DeviceData(images, ds.targets, recipe, dict(mean=cls.mean, std=cls.std, out_size=image_size))


info_cifar10, info_cifar100 = partial(_info, CIFAR10), partial(_info, CIFAR100)
build_cifar10, build_cifar100 = partial(_build, CIFAR10), partial(_build, CIFAR100)
transform_cifar10, transform_cifar100 = partial(_transform, CIFAR10), partial(_transform, CIFAR100)
device_cifar10, device_cifar100 = partial(_device, CIFAR10), partial(_device, CIFAR100)
