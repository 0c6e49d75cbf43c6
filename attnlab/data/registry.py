"""Datasets as one table: one :class:`Dataset` entry per dataset, read by the trainer, the device pipeline, the
command line (``--help``, ``attnlab train``) and the instruments. Adding a dataset is one :func:`register` call
below plus its builder file.

An entry names its task family (the :mod:`attnlab.train.tasks` entry that trains it), its options with defaults
and bounds, and "module:function" targets imported on first use, so that this table loads no torch:

    info(data_dir, **options) -> DatasetInfo       classes, sizes and statistics, reading no data where it can
    build(train, *, data_dir, download, augment, **options) -> torch Dataset    the split, normalised
    transform(train, augment, **options)           (optional) the PIL -> tensor transform of an image dataset
    device(*, data_dir, download, augment, **options) -> DeviceData             (optional) the train split as
                                                   tensors plus its augmentation, for the device pipeline
"""

from __future__ import annotations

import importlib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from attnlab.errors import ConfigError, DatasetError, did_you_mean

DEFAULT_DATASET = "digits"
AUGMENTS: tuple[str, ...] = ("none", "recipe")

IMAGENET_MEAN = (0.485, 0.456, 0.406)  # timm.data.IMAGENET_DEFAULT_MEAN / _STD, repeated to keep timm's import lazy
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Option:
    """One dataset option: its default (whose type the option takes), bounds and choices, and a line of help.

    Booleans take true/false (any case, 1/0, yes/no, on/off); integers and floats are checked against
    ``minimum``/``maximum``; strings against ``choices`` when given (a ``None`` default accepts a string too).
    """

    default: Any
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[str, ...] | None = None
    help: str = ""

    def parse(self, dataset: str, key: str, value: Any) -> Any:
        where = f"dataset option {key}={value!r} for {dataset}"
        default = self.default
        if isinstance(default, bool):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ConfigError(f"{where} is not a boolean; use true or false")
        if isinstance(default, (int, float)):
            integer = isinstance(default, int)
            try:
                if isinstance(value, bool) or (integer and isinstance(value, float) and not value.is_integer()):
                    raise ValueError
                number = int(value) if integer else float(value)
                if not integer and not math.isfinite(number):
                    raise ValueError
            except (TypeError, ValueError):
                raise ConfigError(f"{where} is not {'an integer' if integer else 'a finite number'}") from None
            return self._bounded(where, number)
        if value is None or isinstance(value, str) and default is None and value.lower() in ("none", "null"):
            return None
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where} is not a string")
        text = str(value)
        if self.choices is not None and text not in self.choices:
            raise ConfigError(f"{where} is not valid{did_you_mean(text, self.choices)}; use one of "
                              f"{', '.join(self.choices)}")
        return text

    def _bounded(self, where: str, number):
        low, high = self.minimum, self.maximum
        if (low is not None and number < low) or (high is not None and number > high):
            if low is not None and high is not None:
                raise ConfigError(f"{where} must lie between {low:g} and {high:g}")
            raise ConfigError(f"{where} must be at least {low:g}" if low is not None else
                              f"{where} must be at most {high:g}")
        return number

    def describe(self) -> str:
        """``default`` with its bounds, for --help."""
        bounds = ""
        if self.choices:
            bounds = f" ({'|'.join(self.choices)})"
        elif self.minimum is not None or self.maximum is not None:
            bounds = f" [{'' if self.minimum is None else f'{self.minimum:g}'}, " \
                     f"{'' if self.maximum is None else f'{self.maximum:g}'}]"
        return f"{self.default}{bounds}"


@dataclass(frozen=True)
class DatasetInfo:
    """What a model needs to know about a dataset: classes, input size and channels, the normalisation used, its
    task family, and ``model_args``: the keyword arguments that size a model for it (``num_classes``, ``in_chans``,
    ``img_size`` for images; ``vocab_size`` and ``max_length`` for token sequences; ...), as (key, value) pairs so
    that the info stays hashable."""

    name: str
    num_classes: int
    image_size: int
    in_chans: int
    mean: tuple
    std: tuple
    task: str = "image"
    model_args: tuple[tuple[str, Any], ...] = ()

    def model_kwargs(self) -> dict[str, Any]:
        if self.model_args:
            return dict(self.model_args)
        return {"num_classes": self.num_classes, "in_chans": self.in_chans, "img_size": self.image_size}


@dataclass(frozen=True)
class DeviceData:
    """A train split for :class:`attnlab.data.device_pipeline.DevicePipeline`: ``images`` (n, C, H, W), uint8 pixels
    (then ``mean``/``std`` in ``extra`` normalise them on the device) or float images already normalised, integer
    ``labels``, the augmentation as :class:`~attnlab.data.device_pipeline.AugmentRecipe` keyword arguments (None:
    none, only Mixup/CutMix), and further ``DevicePipeline`` keyword arguments (``mean``, ``std``, ``out_size``,
    ``pad_value``)."""

    images: Any
    labels: Any
    recipe: Mapping[str, Any] | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Dataset:
    """One entry of the table (see the module docstring)."""

    name: str
    task: str
    summary: str
    info: str
    build: str
    options: Mapping[str, Option] = field(default_factory=dict)
    augments: tuple[str, ...] = ("none",)
    transform: str | None = None
    device: str | None = None
    download: bool = False  # --download fetches its files
    mixing: bool = False  # Mixup/CutMix apply (image classification)
    #: (optional) "module:function" (data_dir, **options) -> {what: description}: what a run records of the data it
    #: trains on (docs/training.md, "What a run records of its data"), compared on resume, eval and sample
    fingerprint: str | None = None

    def call(self, what: str, *args, **kwargs):
        target = getattr(self, what)
        module, _, attr = target.partition(":")
        return getattr(importlib.import_module(module), attr)(*args, **kwargs)


DATASET_TABLE: dict[str, Dataset] = {}


def register(entry: Dataset) -> Dataset:
    DATASET_TABLE[entry.name] = entry
    return entry


def dataset(name: str) -> Dataset:
    """The table entry of ``name`` (any case, spaces ignored), or DatasetError listing the valid names."""
    key = str(name).strip().lower()
    if key not in DATASET_TABLE:
        raise DatasetError(f"unknown dataset {name!r}{did_you_mean(key, DATASET_TABLE)}; valid names are "
                           f"{', '.join(DATASET_TABLE)}")
    return DATASET_TABLE[key]


def resolve_options(name: str, options: Mapping) -> dict:
    """The dataset's defaults updated by ``options``; unknown keys or bad values raise ConfigError."""
    entry = dataset(name)
    unknown = sorted(set(options) - set(entry.options))
    if unknown:
        valid = ", ".join(entry.options) or "none"
        raise ConfigError(f"unknown option {', '.join(map(str, unknown))} for dataset {entry.name}"
                          f"{did_you_mean(str(unknown[0]), entry.options)}; valid options are {valid}")
    return {k: opt.parse(entry.name, k, options[k]) if k in options else opt.default
            for k, opt in entry.options.items()}


def check_augment(name: str, augment: str) -> str:
    entry = dataset(name)
    if augment not in AUGMENTS:
        raise ConfigError(f"unknown augment {augment!r}; valid values are {', '.join(AUGMENTS)}")
    if augment not in entry.augments:
        raise DatasetError(f"dataset {entry.name} takes no augmentation ({entry.summary}); use augment='none'.")
    return augment


def dataset_info(name: str, *, data_dir="data", **options) -> DatasetInfo:
    """Classes, sizes, channels and normalisation of a dataset, without loading its examples where it can."""
    return dataset(name).call("info", data_dir, **resolve_options(name, options))


def build_transform(name: str, train: bool, *, augment: str = "none", **options):
    """The PIL -> normalised tensor transform of an image dataset read from files (cifar10, cifar100,
    imagefolder); DatasetError for the others."""
    entry = dataset(name)
    opts = resolve_options(name, options)
    if entry.transform is None:
        raise DatasetError(f"dataset {entry.name} has no PIL transform; build_transform takes "
                           f"{', '.join(e.name for e in DATASET_TABLE.values() if e.transform)}")
    return entry.call("transform", train, check_augment(name, augment), **opts)


def build_dataset(name: str, train: bool, *, data_dir="data", download=False, augment: str = "none", **options):
    """One split of a dataset as a map-style torch Dataset (the train split for ``train=True``, else the test
    split), normalised by :func:`dataset_info`'s statistics. ``augment``: ``"none"`` or ``"recipe"`` (the NS-Attn
    paper's training transforms for images; applied to the train split only). What an item is depends on the task
    family: (image (C, H, W) float, label int) for images, (token ids (N,) int64, label) for sequences."""
    opts = resolve_options(name, options)
    return dataset(name).call("build", train, data_dir=data_dir, download=download,
                              augment=check_augment(name, augment), **opts)


def device_data(name: str, *, data_dir="data", download=False, augment: str = "recipe", **options) -> DeviceData:
    """The train split of a device-resident dataset (``Dataset.device``) as tensors, or DatasetError."""
    entry = dataset(name)
    opts = resolve_options(name, options)
    if entry.device is None:
        raise DatasetError(f"the device pipeline holds {', '.join(on_device_datasets())}, not {entry.name}; train "
                           f"{entry.name} with the CPU loader (data_on_device off)")
    return entry.call("device", data_dir=data_dir, download=download, augment=check_augment(name, augment), **opts)


def data_fingerprint(name: str, *, data_dir="data", **options) -> dict[str, str] | None:
    """What identifies the data a run of ``name`` reads (its files' sizes and content hashes, whole or sampled:
    :func:`content_stamp`; its class list), as {what: description}; None for a dataset that records nothing (fixed
    sets). docs/training.md, "What a run records of its data", says why hashes and how much is read."""
    entry = dataset(name)
    if entry.fingerprint is None:
        return None
    return entry.call("fingerprint", data_dir, **resolve_options(name, options))


def data_changes(recorded: Mapping[str, str], current: Mapping[str, str], shown: int = 3) -> str:
    """The differences of two fingerprints in words ("train.bin: was 4096 bytes ..., is now ..."), the first
    ``shown`` of them; empty when they agree."""
    keys = [k for k in dict.fromkeys([*recorded, *current]) if recorded.get(k) != current.get(k)]
    words = [f"{k}: was {recorded.get(k, 'absent')}, is now {current.get(k, 'absent')}" for k in keys[:shown]]
    return "; ".join(words) + (f"; and {len(keys) - shown} more" if len(keys) > shown else "")


WHOLE = 1 << 26  # files up to 64 MiB are hashed whole; a larger one (a nanoGPT .bin) by SAMPLES blocks of BLOCK
SAMPLES, BLOCK = 64, 1 << 16  # 4 MiB read of a file of any size: a re-encoded corpus changes nearly every block
PART = 1 << 14  # a file among many (frames, images, clips): hashed whole up to 3 x 16 KiB, else head, middle, tail


def _digest(path, whole: int, samples: int, block: int) -> str:
    """sha256 of a file's content (16 hex digits): all of it up to ``whole`` bytes, else ``samples`` blocks of
    ``block`` bytes spread evenly from its start to its end; OSError if it cannot be read."""
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size <= whole:
            return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()[:16]
        for i in range(samples):
            f.seek((size - block) * i // (samples - 1))
            h.update(f.read(block))
    return "sampled sha256 " + h.hexdigest()[:16]


def content_stamp(path) -> str:
    """A file's size and content hash in words, "4096 bytes, sha256 ..." (what a run records of a corpus file, a
    token file or a list): the whole content up to ``WHOLE`` bytes, else ``SAMPLES`` evenly spread blocks ("sampled
    sha256"), so that a 17 GB token file costs a 4 MiB read; the modification time is left out, so that a copy
    of the data (another disk, ``--data-dir``) is the same data. "missing" if it cannot be read."""
    try:
        return f"{os.stat(path).st_size} bytes, {_digest(path, WHOLE, SAMPLES, BLOCK)}"
    except OSError:
        return "missing"


def part_stamp(path) -> str:
    """A file among many (a frame, an image, a video clip) by size and the hash of its head, middle and tail
    (``PART`` bytes each; the whole file when it is small, as frames and most images are)."""
    try:
        return f"{os.stat(path).st_size} {_digest(path, 3 * PART, 3, PART)}"
    except OSError:
        return "missing"


def folder_stamp(folder) -> str:
    """Every file of ``folder`` (recursively) by relative name and :func:`part_stamp`, as a count and one digest:
    what a run records of an image or frame folder (a replaced file changes it, even with the count the same)."""
    import hashlib
    from pathlib import Path

    folder = Path(folder)
    if not folder.is_dir():
        return "missing"
    lines = sorted(f"{p.relative_to(folder).as_posix()} {part_stamp(p)}" for p in folder.rglob("*") if p.is_file())
    return f"{len(lines)} files, content sha256 {hashlib.sha256(chr(10).join(lines).encode()).hexdigest()[:16]}"


def file_sha256(path) -> str:
    """The sha256 of a (small) file's content, shortened to 16 hex digits; "missing" if it cannot be read."""
    import hashlib

    try:
        with open(path, "rb") as f:
            return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()[:16]
    except OSError:
        return "missing"


def on_device_datasets() -> tuple[str, ...]:
    """Names of the datasets the device pipeline can hold."""
    return tuple(n for n, e in DATASET_TABLE.items() if e.device)


def describe(name: str) -> str:
    """One line for ``--help``: the dataset, its task and its options with defaults."""
    entry = dataset(name)
    opts = ", ".join(f"{k}={o.describe()}" for k, o in entry.options.items()) or "no options"
    return f"{entry.name} ({entry.task}): {entry.summary}; options: {opts}"


# ---- the table: one entry per dataset ----------------------------------------------------------------------------
_CIFAR_OPTIONS = {
    "auto_augment": Option(True, help="CIFAR AutoAugment in the recipe"),
    "random_erasing": Option(0.25, 0.0, 1.0, help="probability of random erasing in the recipe"),
    "image_size": Option(32, 1, help="resize to this size (backbones that expect larger inputs)"),
    "verify_md5": Option(True, help="check the files against the official md5 sums (false: a repacked copy)"),
}
for _n in ("10", "100"):  # one builder file for both
    _at = f"attnlab.data.cifar:{{}}_cifar{_n}".format
    register(Dataset(f"cifar{_n}", "image", f"CIFAR-{_n} (torchvision; --download)", _at("info"), _at("build"),
                     _CIFAR_OPTIONS, AUGMENTS, _at("transform"), _at("device"), download=True, mixing=True))
register(Dataset("digits", "image", "scikit-learn's 8x8 digits, the embedded default", "attnlab.data.tensor:info_digits",
                 "attnlab.data.tensor:build_digits", {"image_size": Option(8, 1, help="upsample to this size")},
                 AUGMENTS, device="attnlab.data.tensor:device_digits", mixing=True))
register(Dataset("synthetic", "image", "random normal images and labels (benchmarks)",
                 "attnlab.data.tensor:info_synthetic", "attnlab.data.tensor:load_synthetic",
                 {"num_classes": Option(10, 1), "image_size": Option(32, 1), "in_chans": Option(3, 1),
                  "length": Option(1024, 0, help="images per split"),
                  "seed": Option(0, 0, 2**62 - 1, help="images keyed by 2 * seed + split, a uint64")},
                 AUGMENTS, device="attnlab.data.tensor:device_synthetic", mixing=True))
register(Dataset("imagefolder", "image", "an ImageNet-style folder tree <data_dir>/train|val/<class>/",
                 "attnlab.data.folder:info", "attnlab.data.folder:build",
                 {"image_size": Option(224, 1), "auto_augment": Option(True, help="RandAugment in the recipe"),
                  "random_erasing": Option(0.25, 0.0, 1.0)}, AUGMENTS, "attnlab.data.folder:folder_transform",
                 mixing=True))
# Long Range Arena: token sequences, LRA's defaults
register(Dataset("listops", "sequence", "LRA ListOps, generated locally once", "attnlab.data.listops:info",
                 "attnlab.data.listops:build",
                 {"max_length": Option(2000, 1), "min_length": Option(500, 1), "max_depth": Option(10, 1),
                  "max_args": Option(10, 2), "num_train": Option(96000, 1), "num_val": Option(2000, 0),
                  "num_test": Option(2000, 1), "seed": Option(0, 0, 2**62 - 1)}))
register(Dataset("lra_text", "sequence", "LRA byte-level IMDb reviews from <data_dir>/aclImdb",
                 "attnlab.data.lra_text:info", "attnlab.data.lra_text:build", {"max_length": Option(4000, 1)}))

# Language modelling: token streams (attnlab.data.lm) and Zoology's MQAR (attnlab.data.mqar)
_VAL_FRACTION = Option(0.1, 0.001, 0.5, help="the last fraction of the stream held out for validation")
register(Dataset("stdlib", "lm", "the Python standard library's own source as bytes, the embedded LM default",
                 "attnlab.data.lm:stdlib_info", "attnlab.data.lm:build_stdlib", {"val_fraction": _VAL_FRACTION},
                 fingerprint="attnlab.data.lm:stdlib_fingerprint"))
register(Dataset("text", "lm", "a text file or folder (--data-dir) as bytes, or through a tokenizer.json",
                 "attnlab.data.lm:text_info", "attnlab.data.lm:build_text",
                 {"tokenizer": Option("", help="a Hugging Face tokenizer.json (empty: bytes, vocabulary 256)"),
                  "val_fraction": _VAL_FRACTION}, fingerprint="attnlab.data.lm:text_fingerprint"))
register(Dataset("nanogpt", "lm", "nanoGPT's prepared train.bin / val.bin in --data-dir, or the shards and "
                 "manifest.json of attnlab data prepare", "attnlab.data.lm:nanogpt_info",
                 "attnlab.data.lm:build_nanogpt",
                 {"vocab_size": Option(0, 0, 1 << 32, help="ids the .bin files use (0: manifest.json's or meta.pkl's, "
                                                           "else GPT-2's 50257)"),
                  "dtype": Option("uint16", choices=("uint16", "uint32"),
                                  help="bytes per token of the .bin files: uint16 (nanoGPT's) or uint32 (a "
                                       "manifest.json's own wins)")},
                 fingerprint="attnlab.data.lm:nanogpt_fingerprint"))
register(Dataset("stdlib_bpe", "lm", "the standard library's source through a 2,048-id BPE tokenizer trained on it, "
                 "prepared once into <data_dir>/stdlib_bpe/ by attnlab data prepare (needs tokenizers)",
                 "attnlab.data.stdlib_bpe:stdlib_bpe_info", "attnlab.data.stdlib_bpe:build_stdlib_bpe",
                 fingerprint="attnlab.data.stdlib_bpe:stdlib_bpe_fingerprint"))
register(Dataset("mqar", "lm", "Zoology's multi-query associative recall, generated by seed", "attnlab.data.mqar:mqar_info",
                 "attnlab.data.mqar:build_mqar",
                 {"vocab_size": Option(8192, 4, 1 << 20, help="keys from the lower half, values from the upper"),
                  "seq_len": Option(64, 4, 1 << 16, help="tokens per example (even)"),
                  "num_kv_pairs": Option(8, 1, 1 << 14, help="key-value pairs per example (4 x pairs <= seq_len)"),
                  "power_a": Option(0.01, 1e-6, 1.0, help="query gaps ~ g^(power_a - 1); 1: uniform"),
                  "random_non_queries": Option(True, help="filler tokens uniform over the vocabulary (else 0)"),
                  "num_train": Option(100_000, 1, 1 << 40), "num_test": Option(3_000, 1, 1 << 40),
                  "seed": Option(0, 0, 2**62 - 1, help="the generator's seed")}))

# Video (TimeSformer): clips (C, T, H, W); evaluation items may hold several views (V, C, T, H, W)
register(Dataset("video", "video", "video files or frame folders, <data_dir>/train|val/<class>/<clip> or lists",
                 "attnlab.data.video:video_info", "attnlab.data.video:build_video",
                 {"num_frames": Option(8, 1, help="frames T sampled uniformly over each clip"),
                  "image_size": Option(224, 1, help="crop size"), "in_chans": Option(3, 1, 3, help="1 (grey) or 3"),
                  "clips": Option(1, 1, help="temporal views per clip at test time"),
                  "crops": Option(3, 1, 3, help="spatial views per clip at test time (1 or 3)"),
                  "lists": Option("", help="folder under data_dir with train.csv and val.csv (or .txt); '': none"),
                  "num_classes": Option(0, 0, help="classes of integer-labelled lists (0: the largest label + 1)"),
                  "verify": Option(True, help="open every video file and read every frame's header when the dataset is "
                                              "built")}, AUGMENTS, fingerprint="attnlab.data.video:video_fingerprint"))
register(Dataset("moving_digits", "video", "scikit-learn's digits moving across a canvas, generated by seed",
                 "attnlab.data.moving_digits:moving_digits_info",
                 "attnlab.data.moving_digits:build_moving_digits",
                 {"num_frames": Option(8, 1), "image_size": Option(16, 8, help="canvas side"),
                  "directions": Option(4, 4, 8, help="4 or 8 (with the diagonals)"),
                  "label": Option("direction", choices=("direction", "digit_direction")),
                  "speed": Option(1, 0, help="pixels per frame"), "num_train": Option(4096, 1),
                  "num_test": Option(1024, 1), "seed": Option(0, 0, 2**62 - 1)}))

# Video LLM (VisCoP probes): instruction-tuning conversations about clips (attnlab.data.video_qa), the task "vlm"
_QA = "attnlab.data.video_qa:{}".format
register(Dataset("digits_qa", "vlm", "multiple-choice questions about moving digits (which digit moves, which way, "
                 "where it ends, how many), generated by seed", _QA("digits_qa_info"), _QA("build_digits_qa"),
                 {"num_frames": Option(8, 1, 17), "image_size": Option(24, 16, help="canvas side"),
                  "num_train": Option(3000, 1), "num_test": Option(400, 1), "seed": Option(0, 0, 2**62 - 1)},
                 fingerprint=_QA("digits_qa_fingerprint")))
register(Dataset("video_qa", "vlm", "VisCoP/LLaVA instruction JSON (video files, frame folders or images with "
                 "conversations) under --data-dir", _QA("video_qa_info"), _QA("build_video_qa"),
                 {"train_file": Option("train.json", help="training conversations (relative to data_dir)"),
                  "val_file": Option("val.json", help="evaluation conversations with multiple-choice answers"),
                  "num_frames": Option(40, 1, help="frames sampled uniformly per video (the authors: 1 fps, at most "
                                                   "40)"),
                  "image_size": Option(384, 14, help="frames resized to this square side"),
                  "mean": Option(0.5, help="pixel mean (SigLIP: 0.5)"), "std": Option(0.5, 1e-6, help="pixel std")},
                 fingerprint=_QA("video_qa_fingerprint")))

# Detection and instance segmentation: COCO-format instance sets (attnlab.data.coco), the task "detect"
_DETECT_OPTIONS = {
    "masks": Option(True, help="instance masks (Mask R-CNN); false: boxes only (Faster R-CNN)"),
    "jitter_min": Option(0.1, 0.01, 10.0, help="large-scale jitter: smallest scale of the fitted size (recipe)"),
    "jitter_max": Option(2.0, 0.01, 10.0, help="large-scale jitter: largest scale (recipe)"),
}
register(Dataset("shapes", "detect", "synthetic squares, disks and triangles with instance masks, the embedded "
                 "default, written once as COCO json + PNGs", "attnlab.data.coco:info_shapes",
                 "attnlab.data.coco:build_shapes",
                 {"image_size": Option(128, 32, 1024, help="image side and the detector's canvas"),
                  **_DETECT_OPTIONS, "jitter_min": Option(0.5, 0.01, 10.0), "jitter_max": Option(1.5, 0.01, 10.0),
                  "seed": Option(0, 0, 2**62 - 1, help="the set's generator seed"),
                  "train_images": Option(512, 1), "val_images": Option(128, 1),
                  "max_objects": Option(4, 1, 20), "min_size": Option(12, 1), "max_size": Option(48, 1),
                  "empty_fraction": Option(0.05, 0.0, 1.0, help="share of images without objects")},
                 AUGMENTS, fingerprint="attnlab.data.coco:shapes_fingerprint"))
register(Dataset("coco", "detect", "a COCO-format instance set, MS-COCO 2017 by default: "
                 "<data_dir>/annotations/instances_<split>.json + <data_dir>/<split>/",
                 "attnlab.data.coco:info_coco", "attnlab.data.coco:build_coco",
                 {"image_size": Option(224, 32, 4096, help="the square canvas (the DnA paper's Table 9: 224)"),
                  **_DETECT_OPTIONS, "train_split": Option("train2017"), "val_split": Option("val2017"),
                  "empty_boxes": Option("refuse", choices=("refuse", "drop"),
                                        help="boxes of zero width or height: refuse the set, or drop them from the "
                                             "targets as torchvision's references do (COCO 2017's train split "
                                             "holds two)")},
                 AUGMENTS, fingerprint="attnlab.data.coco:coco_fingerprint"))

DATASETS: tuple[str, ...] = tuple(DATASET_TABLE)
