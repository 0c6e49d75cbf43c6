"""Any folder tree of images (ImageNet layout): ``<data_dir>/train/<class>/*`` and ``<data_dir>/val/<class>/*``."""

from __future__ import annotations

from pathlib import Path

from timm.data import create_transform
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes

from attnlab.data.registry import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo
from attnlab.errors import DatasetError

# timm's DeiT-style training pipeline: RandomResizedCrop, flip, RandAugment, random erasing.
RANDAUGMENT = "rand-m9-mstd0.5-inc1"


def split_dir(data_dir, train: bool) -> Path:
    """``<data_dir>/train``, or ``<data_dir>/val`` falling back to ``<data_dir>/test`` (absolute)."""
    root = Path(data_dir).expanduser().resolve()
    if train:
        path = root / "train"
    else:
        path = next((root / n for n in ("val", "test") if (root / n).is_dir()), root / "val")
    if not path.is_dir():
        looked = path if train else f"{root / 'val'} or {root / 'test'}"
        raise DatasetError(f"imagefolder found no folder {looked}; it expects <data_dir>/train and <data_dir>/val "
                           f"(or test), each with one subfolder of images per class: pass --data-dir")
    return path


def folder_classes(data_dir) -> list[str]:
    """Class names: the sorted subfolders of the train split, or of val/test when there is no train folder."""
    root = Path(data_dir).expanduser().resolve()
    path = root / "train" if (root / "train").is_dir() else split_dir(root, train=False)
    try:
        return find_classes(str(path))[0]
    except FileNotFoundError:
        raise DatasetError(f"imagefolder found no class subfolders in {path}; put each class's images "
                           f"in its own subfolder") from None


class _ImageFolder(ImageFolder):
    """ImageFolder whose class list is given, so that val labels index the train split's classes."""

    def __init__(self, root, classes: list[str], transform, allow_empty: bool):
        self._given = list(classes)
        super().__init__(root, transform=transform, allow_empty=allow_empty)

    def find_classes(self, directory):
        return self._given, {c: i for i, c in enumerate(self._given)}


def folder_transform(train: bool, augment: str, *, image_size: int = 224, auto_augment: bool = True,
                     random_erasing: float = 0.25, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """timm's ``create_transform``: recipe on train = RandomResizedCrop, flip, RandAugment (rand-m9-mstd0.5-inc1)
    unless ``auto_augment=False`` (then timm's colour jitter), random erasing; otherwise resize + centre crop."""
    if train and augment == "recipe":
        return create_transform(image_size, is_training=True, auto_augment=RANDAUGMENT if auto_augment else None,
                                re_prob=random_erasing, mean=mean, std=std)
    return create_transform(image_size, is_training=False, mean=mean, std=std)


# ---- the dataset table's entry (attnlab.data.registry)
def info(data_dir, *, image_size: int, **_recipe) -> DatasetInfo:
    """The class count of ``<data_dir>/train`` (or val/test), ImageNet's statistics."""
    return DatasetInfo("imagefolder", len(folder_classes(data_dir)), image_size, 3, IMAGENET_MEAN, IMAGENET_STD)


def build(train: bool, *, data_dir, download: bool, augment: str, **options) -> ImageFolder:
    path = split_dir(data_dir, train)
    try:
        ds = _ImageFolder(str(path), folder_classes(data_dir), folder_transform(train, augment, **options),
                          allow_empty=not train)
    except FileNotFoundError as err:
        raise DatasetError(f"imagefolder found no images in {path} ({err}); accepted extensions are "
                           f"{' '.join(IMG_EXTENSIONS)}") from None
    if len(ds) == 0:
        raise DatasetError(f"imagefolder found no images in {path}; put images ({' '.join(IMG_EXTENSIONS)}) "
                           f"in one subfolder per class")
    return ds
