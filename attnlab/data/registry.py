"""Dataset names, their options, ``dataset_info`` and ``build_dataset``."""

from __future__ import annotations

from dataclasses import dataclass

from attnlab.errors import ConfigError, DatasetError

DATASETS: tuple[str, ...] = ("cifar10", "cifar100", "digits", "synthetic", "imagefolder", "listops", "lra_text")
SEQUENCE_DATASETS: tuple[str, ...] = ("listops", "lra_text")  # token ids (N,) per example, not images
DEFAULT_DATASET = "digits"
AUGMENTS: tuple[str, ...] = ("none", "recipe")

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm.data.IMAGENET_DEFAULT_MEAN / _STD, repeated to keep timm's import lazy
IMAGENET_STD = (0.229, 0.224, 0.225)

# Options each dataset accepts, with defaults. Recipe options only change the train split with augment="recipe".
_CIFAR_OPTIONS = {"auto_augment": True, "random_erasing": 0.25, "image_size": 32, "verify_md5": True}
OPTIONS: dict[str, dict[str, object]] = {
    "cifar10": _CIFAR_OPTIONS,
    "cifar100": _CIFAR_OPTIONS,
    "digits": {"image_size": 8},
    "synthetic": {"num_classes": 10, "image_size": 32, "in_chans": 3, "length": 1024, "seed": 0},
    "imagefolder": {"image_size": 224, "auto_augment": True, "random_erasing": 0.25},
    # Long Range Arena (sequence datasets): LRA's defaults
    "listops": {"max_length": 2000, "min_length": 500, "max_depth": 10, "max_args": 10, "num_train": 96000,
                "num_val": 2000, "num_test": 2000, "seed": 0},
    "lra_text": {"max_length": 4000},
}
# Bounds of the integer options (seed >= 0: numpy's SeedSequence takes non-negative integers).
_MIN = {"image_size": 1, "num_classes": 1, "in_chans": 1, "length": 0, "seed": 0,
        "max_length": 1, "min_length": 1, "max_depth": 1, "max_args": 2, "num_train": 1, "num_val": 0, "num_test": 1}
_MAX = {"seed": 2**62 - 1}  # synthetic images are keyed by 2 * seed + split, a uint64


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset: classes, input size and channels, the normalisation used."""

    name: str
    num_classes: int
    image_size: int
    in_chans: int
    mean: tuple
    std: tuple


def _name(name: str) -> str:
    key = str(name).strip().lower()
    if key not in DATASETS:
        raise DatasetError(f"unknown dataset {name!r}; valid names are {', '.join(DATASETS)}")
    return key


def _coerce(name: str, key: str, value, default):
    """Convert ``value`` to the type of ``default`` (strings from the command line included), checking its range."""
    where = f"dataset option {key}={value!r} for {name}"
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("1", "true", "yes", "on"):
            return True
        if text in ("0", "false", "no", "off"):
            return False
        raise ConfigError(f"{where} is not a boolean; use true or false")
    if isinstance(default, int):
        try:
            number = int(value) if not isinstance(value, float) or value.is_integer() else None
            if isinstance(value, bool) or number is None:
                raise ValueError
        except (TypeError, ValueError):
            raise ConfigError(f"{where} is not an integer") from None
        low, high = _MIN.get(key, 0), _MAX.get(key)
        if number < low or (high is not None and number > high):
            raise ConfigError(f"{where} must be at least {low}" + (f" and at most {high}" if high else ""))
        return number
    try:
        number = float(value)
        if isinstance(value, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{where} is not a number") from None
    if not 0.0 <= number <= 1.0:  # random_erasing is a probability
        raise ConfigError(f"{where} must be a probability between 0 and 1")
    return number


def resolve_options(name: str, options: dict) -> dict:
    """The dataset's defaults updated by ``options``; unknown keys or bad values raise ConfigError."""
    key = _name(name)
    defaults = OPTIONS[key]
    unknown = sorted(set(options) - set(defaults))
    if unknown:
        valid = ", ".join(defaults) or "none"
        raise ConfigError(f"unknown option {', '.join(unknown)} for dataset {key}; valid options are {valid}")
    return {k: _coerce(key, k, options[k], v) if k in options else v for k, v in defaults.items()}


def dataset_info(name: str, *, data_dir="data", **options) -> DatasetInfo:
    """Classes, image size, channels and normalisation of a dataset, without loading its images.

    ``imagefolder`` counts the class subfolders of ``<data_dir>/train`` (or val/test); the others need no files.
    """
    key, opts = _name(name), resolve_options(name, options)
    if key in ("cifar10", "cifar100"):
        from attnlab.data import cifar

        cls = cifar.CIFAR10 if key == "cifar10" else cifar.CIFAR100
        return DatasetInfo(key, cls.num_classes, opts["image_size"], 3, cls.mean, cls.std)
    if key == "digits":
        from attnlab.data.tensor import digits_stats

        mean, std = digits_stats()
        return DatasetInfo(key, 10, opts["image_size"], 1, (mean,), (std,))
    if key in SEQUENCE_DATASETS:  # a sequence model reads image_size as the length, in_chans as the vocabulary
        from attnlab.data import listops, lra_text

        vocab = len(listops.VOCAB) if key == "listops" else lra_text.VOCAB_SIZE
        return DatasetInfo(key, 10 if key == "listops" else 2, opts["max_length"], vocab, (), ())
    if key == "synthetic":
        c = opts["in_chans"]
        return DatasetInfo(key, opts["num_classes"], opts["image_size"], c, (0.0,) * c, (1.0,) * c)
    from attnlab.data.folder import folder_classes

    return DatasetInfo(key, len(folder_classes(data_dir)), opts["image_size"], 3, IMAGENET_MEAN, IMAGENET_STD)


def _check_augment(augment: str) -> str:
    if augment not in AUGMENTS:
        raise ConfigError(f"unknown augment {augment!r}; valid values are {', '.join(AUGMENTS)}")
    return augment


def build_transform(name: str, train: bool, *, augment: str = "none", **options):
    """The PIL -> normalised tensor transform of ``cifar10``, ``cifar100`` or ``imagefolder``.

    Raises DatasetError for ``digits`` and ``synthetic``, which hold tensors and have no PIL transform.
    """
    key, opts, augment = _name(name), resolve_options(name, options), _check_augment(augment)
    if key in ("cifar10", "cifar100"):
        from attnlab.data import cifar

        cls = cifar.CIFAR10 if key == "cifar10" else cifar.CIFAR100
        return cifar.cifar_transform(train, augment, cls.mean, cls.std, auto_augment=opts["auto_augment"],
                                     random_erasing=opts["random_erasing"], image_size=opts["image_size"])
    if key == "imagefolder":
        from attnlab.data.folder import folder_transform

        return folder_transform(train, augment, image_size=opts["image_size"], auto_augment=opts["auto_augment"],
                                random_erasing=opts["random_erasing"], mean=IMAGENET_MEAN, std=IMAGENET_STD)
    raise DatasetError(f"dataset {key} holds tensors and has no PIL transform; build_transform takes "
                       f"cifar10, cifar100 or imagefolder")


def build_dataset(name: str, train: bool, *, data_dir="data", download=False, augment: str = "none", **options):
    """A map-style dataset of (image, label): image a float tensor (C, H, W) normalised by ``dataset_info``'s
    mean/std, label an int.

    augment: ``"none"`` (ToTensor + Normalize) or ``"recipe"`` (the NS-Attn paper's training transforms; applied
    to the train split only, the test split always gets ``"none"``). Files are looked for in ``data_dir``:
    ``<data_dir>/cifar-10-batches-py``, ``<data_dir>/cifar-100-python``, ``<data_dir>/train`` and ``val``/``test``.
    ``download=True`` fetches CIFAR through torchvision; the other datasets need no download.
    ``listops`` and ``lra_text`` yield (token ids int64 (max_length,), label): ListOps is generated into
    ``<data_dir>/listops`` on first use (train split for ``train=True``, else test); ``lra_text`` reads
    ``<data_dir>/aclImdb`` (see :mod:`attnlab.data.lra_text`).
    """
    key, opts, augment = _name(name), resolve_options(name, options), _check_augment(augment)
    if key in ("cifar10", "cifar100"):
        from attnlab.data import cifar

        cls = cifar.CIFAR10 if key == "cifar10" else cifar.CIFAR100
        transform = build_transform(key, train, augment=augment, **options)
        return cifar.load_cifar(cls, data_dir, train, transform, download=download, verify_md5=opts["verify_md5"])
    if key == "digits":
        from attnlab.data.tensor import build_digits

        return build_digits(train, augment, image_size=opts["image_size"])
    if key in SEQUENCE_DATASETS:
        if augment != "none":
            raise DatasetError(f"dataset {key} holds token sequences and takes no augmentation; use augment='none'.")
        if key == "listops":
            from attnlab.data.listops import load_listops

            return load_listops(data_dir, "train" if train else "test", **opts)
        from attnlab.data.lra_text import load_lra_text

        return load_lra_text(data_dir, "train" if train else "test", **opts)
    if key == "synthetic":
        from attnlab.data.tensor import SyntheticDataset

        return SyntheticDataset(train=train, **opts)
    from attnlab.data.folder import build_folder

    return build_folder(data_dir, train, build_transform(key, train, augment=augment, **options))
