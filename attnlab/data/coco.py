"""COCO-format instance datasets (``<data_dir>/annotations/instances_<split>.json`` and ``<data_dir>/<split>/``),
read by pycocotools through torchvision's ``CocoDetection`` and ``wrap_dataset_for_transforms_v2``, augmented with
``transforms.v2``, batched as lists for torchvision's detectors; docs/training.md, "Detection and instance
segmentation", says what is checked (:func:`check_coco`) and how training images are jittered (ViTDet's).

A sample is ``(image, target)``: ``image`` float (3, H, W) in [0, 1], ``target`` a dict of ``boxes`` (N, 4) XYXY
pixels, ``labels`` (N,) in 1..K (the json's categories sorted by id; 0 is torchvision's background), ``masks``
(N, H, W) uint8, ``image_id``; crowd regions are left out (the evaluation reads them from the json), an image
without objects gives empty tensors. Evaluation images keep their size: the detector's transform resizes them to
the canvas and maps its predictions back to the json's coordinates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import math
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils.data import Dataset
from torchvision.datasets import CocoDetection, VisionDataset

from attnlab.data.registry import IMAGENET_MEAN, IMAGENET_STD, DatasetInfo
from attnlab.data.shapes import CATEGORIES, ShapesOptions, generate_shapes, set_dir
from attnlab.errors import DatasetError, did_you_mean


def require_pycocotools():
    """The pycocotools package, or a DatasetError naming the extra that installs it."""
    try:
        import pycocotools.coco  # noqa: F401
        import pycocotools.mask  # noqa: F401
    except ImportError:
        raise DatasetError("COCO datasets and metrics need pycocotools; install it with "
                           "`pip install attnlab[detect]`.") from None
    return pycocotools


def split_paths(data_dir: str | Path, split: str) -> tuple[Path, Path]:
    """(image folder, annotation json) of ``split`` in COCO's layout under ``data_dir``."""
    root = Path(data_dir).expanduser().resolve()
    return root / split, root / "annotations" / f"instances_{split}.json"


def read_coco(annotations: str | Path):
    """A pycocotools ``COCO`` index of ``annotations`` (its progress lines silenced); DatasetError for a missing,
    unreadable or malformed file."""
    require_pycocotools()
    from pycocotools.coco import COCO

    path = Path(annotations)
    if not path.is_file():
        raise DatasetError(f"COCO annotation file {path} does not exist; give <data_dir>/annotations/"
                           f"instances_<split>.json.")
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            coco = COCO(str(path))
    except (ValueError, OSError, UnicodeDecodeError) as err:  # json.JSONDecodeError is a ValueError
        raise DatasetError(f"COCO annotation file {path} is not valid JSON ({str(err)[:80]}); give an "
                           f"instances json as COCO writes it.") from None
    except AssertionError:  # pycocotools asserts that the top level is an object
        raise DatasetError(f"COCO annotation file {path} does not hold a JSON object at its top level; COCO instance "
                           f"files are an object with 'images', 'annotations' and 'categories' lists.") from None
    except (KeyError, TypeError, AttributeError) as err:
        raise DatasetError(f"COCO annotation file {path} lacks COCO's structure ({type(err).__name__}: "
                           f"{str(err)[:60]}); it needs 'images', 'annotations' and 'categories' lists.") from None
    return coco


def _finite(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def rle_counts(counts: str) -> list[int]:
    """The run lengths of COCO's compressed RLE string (pycocotools' ``rleFrString``: 5 bits per character from
    '0', a continuation bit, a sign bit, each count after the second stored as the difference to the one two
    before); ValueError for a character outside the code or a string that ends inside a number."""
    out: list[int] = []
    p = 0
    while p < len(counts):
        x = k = 0
        while True:
            c = ord(counts[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"character {counts[p]!r} at {p} is not in COCO's RLE code")
            x |= (c & 0x1F) << (5 * k)
            p, k = p + 1, k + 1
            if not c & 0x20:
                if c & 0x10:
                    x |= -1 << (5 * k)
                break
            if p == len(counts):
                raise ValueError("it ends inside a number")
        out.append(x + out[-2] if len(out) > 2 else x)
    return out


def _segmentation_fault(seg, height: int, width: int) -> str | None:
    """Why ``seg`` is not a usable COCO segmentation of a ``height`` x ``width`` image, or None: polygons of at least
    3 finite points, or an RLE of the image's size whose run lengths are non-negative and cover the image."""
    if isinstance(seg, list):
        if seg and all(isinstance(p, list) and len(p) >= 6 and len(p) % 2 == 0 and _finite(p) for p in seg):
            return None
        return "its polygons are not lists of at least 3 finite x, y points"
    if not isinstance(seg, dict):
        return "it is neither polygons nor RLE"
    size, counts = seg.get("size"), seg.get("counts")
    if size != [height, width]:
        return f"its RLE size {size!r} is not the image's [height, width] [{height}, {width}]"
    try:
        runs = rle_counts(counts) if isinstance(counts, str) else counts
        if not isinstance(runs, list) or not all(isinstance(r, int) and not isinstance(r, bool) for r in runs):
            raise ValueError("its counts are not a string or a list of integers")
    except ValueError as err:
        return f"its RLE counts cannot be read ({err})"
    if any(r < 0 for r in runs) or sum(runs) != height * width:
        return (f"its RLE counts cover {sum(runs)} pixels{' with a negative run' if any(r < 0 for r in runs) else ''}"
                f", not the image's {height} x {width} = {height * width}")
    return None


def _duplicate(items: list, what: str, name: str) -> None:
    seen: set = set()
    for item in items:
        key = item.get("id") if isinstance(item, dict) else None
        if key in seen:
            raise DatasetError(f"{name} lists {what} id {key!r} twice; COCO ids are unique (pycocotools would keep "
                               f"the last and drop the other without a word).")
        seen.add(key)


def check_coco(coco, images: str | Path, name: str = "the annotation file", masks: bool = True,
               empty_boxes: str = "refuse") -> None:
    """What training and evaluation need, checked before they start: categories, annotations that name known
    images and categories with valid boxes (and, with ``masks``, segmentations), at least one annotation, and
    every listed image in ``images``. A box of zero width or height, which torchvision's detection models refuse,
    is a DatasetError unless ``empty_boxes`` is "drop" (then :class:`CocoInstances` leaves it out of the targets,
    as torchvision's detection references do). ``iscrowd`` and ``area``, which COCO's evaluation reads, default to 0
    and the box's area where an annotation leaves them out."""
    data = coco.dataset
    for key in ("images", "annotations", "categories"):
        if not isinstance(data.get(key), list):
            raise DatasetError(f"{name} has no {key!r} list; COCO instance files hold images, annotations and "
                               f"categories.")
    if not data["categories"]:
        raise DatasetError(f"{name} lists no categories; a detection set needs at least one.")
    if not data["images"]:
        raise DatasetError(f"{name} lists no images.")
    if not data["annotations"]:
        raise DatasetError(f"{name} has no annotations at all; a detection set needs objects (images without "
                           f"any are fine, a set without any is not).")
    for key, what in (("images", "image"), ("annotations", "annotation"), ("categories", "category")):
        _duplicate(data[key], what, name)
    for img in data["images"]:
        if not (isinstance(img.get("width"), int) and isinstance(img.get("height"), int) and img["width"] > 0
                and img["height"] > 0):
            raise DatasetError(f"{name}: image {img.get('id')!r} ({img.get('file_name')}) has width "
                               f"{img.get('width')!r} and height {img.get('height')!r}; COCO images give both as "
                               f"positive integers, the size of the file.")
    cats, image_ids = set(coco.cats), set(coco.imgs)
    for ann in data["annotations"]:
        if ann.get("category_id") not in cats:
            raise DatasetError(f"{name}: annotation {ann.get('id')} has category_id {ann.get('category_id')!r}, "
                               f"which is not among its categories ({', '.join(map(str, sorted(cats)))}).")
        if ann.get("image_id") not in image_ids:
            raise DatasetError(f"{name}: annotation {ann.get('id')} names image_id {ann.get('image_id')!r}, "
                               f"which is not among its images.")
        box = ann.get("bbox")
        if not (isinstance(box, list) and len(box) == 4 and _finite(box) and box[2] >= 0 and box[3] >= 0):
            raise DatasetError(f"{name}: annotation {ann.get('id')} has bbox {box!r}; COCO boxes are "
                               f"[x, y, width, height], finite numbers with width and height >= 0.")
        if (box[2] == 0 or box[3] == 0) and empty_boxes != "drop":
            side = "width" if box[2] == 0 else "height"
            raise DatasetError(f"{name}: annotation {ann.get('id')} has bbox {box!r}, of {side} 0, which "
                               f"torchvision's detection models refuse; give the object a positive width and "
                               f"height, remove the annotation, or pass the data option empty_boxes: drop to leave "
                               f"such boxes out of the training targets.")
        if masks or ann.get("iscrowd"):  # crowd regions reach the evaluation as masks even for boxes only
            img = coco.imgs[ann["image_id"]]
            fault = _segmentation_fault(ann.get("segmentation"), img["height"], img["width"])
            if fault:
                raise DatasetError(f"{name}: annotation {ann.get('id')} has no usable segmentation ({fault}); give "
                                   f"polygons or an RLE of its image for every object, or train boxes only "
                                   f"(masks=False, Faster R-CNN).")
        ann.setdefault("iscrowd", 0)
        ann.setdefault("area", box[2] * box[3])
    folder = Path(images)
    if not folder.is_dir():
        raise DatasetError(f"image folder {folder} does not exist; give the folder of {name}'s images.")
    missing = [img.get("file_name") for img in data["images"] if not (folder / str(img.get("file_name"))).is_file()]
    if missing:
        raise DatasetError(f"{len(missing)} of the {len(data['images'])} images {name} lists are missing from "
                           f"{folder} (first: {missing[0]}); give the image folder that goes with it.")
    check_image_files(data["images"], folder, name)


def check_image_files(images: list[dict], folder: Path, name: str) -> None:
    """Every listed image read by its header alone (no pixel decoded; a progress bar past a few thousand): an image
    file, 8 bits per sample, and the json's ``width`` x ``height``, which the masks and boxes are drawn on."""
    from tqdm.auto import tqdm

    from attnlab.data.images import image_size

    for img in tqdm(images, desc=f"checking {name}'s images", unit="img", leave=False,
                    disable=len(images) < 5000):
        path = folder / str(img["file_name"])
        size = image_size(path, "COCO image")
        if size != (img["width"], img["height"]):
            raise DatasetError(f"COCO image {path} is {size[0]} x {size[1]} pixels, but {name} gives it width "
                               f"{img['width']} and height {img['height']}; its boxes and masks are drawn on the "
                               f"json's size, so give the image that goes with it (or fix its width and height).")


def check_same_categories(train: "CocoInstances", val: "CocoInstances") -> None:
    """The two splits must name the same categories under the same ids, or labels would mean different things."""
    a, b = ([(c["id"], c["name"]) for c in ds.categories] for ds in (train, val))
    if a != b:
        only = next((c for c in a if c not in b), None) or next(c for c in b if c not in a)
        raise DatasetError(f"the train and val annotation files list different categories (e.g. id {only[0]} "
                           f"{only[1]!r} is in one only); give both splits of the same dataset.")


def detection_transforms(train: bool, img_size: int, *, jitter: Sequence[float] = (0.1, 2.0), flip: float = 0.5,
                         mean: Sequence[float] = IMAGENET_MEAN):
    """transforms.v2 for (image, target) samples: ViTDet's large-scale jitter on train (a flip, ``ScaleJitter`` of
    the fitted size by ``jitter``, a ``RandomCrop`` of the canvas padded with the mean pixel, emptied boxes removed),
    only the float conversion on evaluation."""
    from torchvision import tv_tensors
    from torchvision.transforms import v2

    to_float = v2.ToDtype({tv_tensors.Image: torch.float32, "others": None}, scale=True)
    if not train:
        return v2.Compose([v2.ToImage(), to_float])
    fill = {tv_tensors.Image: tuple(round(255 * m) for m in mean), "others": 0}
    return v2.Compose([
        v2.ToImage(),
        v2.RandomHorizontalFlip(flip),
        v2.ScaleJitter((img_size, img_size), scale_range=tuple(jitter), antialias=True),
        v2.RandomCrop((img_size, img_size), pad_if_needed=True, fill=fill),
        v2.SanitizeBoundingBoxes(min_size=1),
        to_float,
    ])


class _IndexedCocoDetection(CocoDetection):
    """torchvision's CocoDetection over an index already read (its own constructor would read the json again)."""

    def __init__(self, root: str, coco) -> None:
        VisionDataset.__init__(self, root)
        self.coco = coco
        self.ids = sorted(coco.imgs)


class CocoInstances(Dataset):
    """A COCO instance split: ``images`` (folder) and ``annotations`` (json), as (image, target) pairs (module
    docstring), checked when built.

    Args:
        images: the image folder the json's ``file_name`` entries are relative to.
        annotations: the ``instances_*.json``.
        transforms: a transforms.v2 callable on (image, target), e.g. :func:`detection_transforms`.
        masks: decode instance masks (False: boxes only, for Faster R-CNN; faster).
    """

    def __init__(self, images: str | Path, annotations: str | Path, transforms=None, masks: bool = True,
                 empty_boxes: str = "refuse") -> None:
        from torchvision.datasets import wrap_dataset_for_transforms_v2

        self.coco = read_coco(annotations)
        check_coco(self.coco, images, name=Path(annotations).name, masks=masks, empty_boxes=empty_boxes)
        self.images, self.annotations = Path(images), Path(annotations)
        self.categories = [self.coco.cats[i] for i in sorted(self.coco.cats)]
        #: label -> COCO category id (index 0: background)
        self.label_to_category = [0] + [c["id"] for c in self.categories]
        self._label = {cat: label for label, cat in enumerate(self.label_to_category) if label}
        self.masks = masks
        base = _IndexedCocoDetection(str(images), self.coco)
        self.image_ids: list[int] = base.ids
        keys = {"image_id", "boxes", "labels", "iscrowd", *(("masks",) if masks else ())}
        self._data = wrap_dataset_for_transforms_v2(base, target_keys=keys)
        self.transforms = transforms

    @property
    def num_classes(self) -> int:
        return len(self.categories)

    def __len__(self) -> int:
        return len(self._data)

    def __getitem__(self, index: int):
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as F

        image, raw = self._data[index]
        h, w = F.get_size(image)
        keep = torch.tensor([not c for c in raw.get("iscrowd", [])], dtype=torch.bool)
        boxes = raw.get("boxes")
        if boxes is not None:  # boxes without area (COCO holds a few) are left out, as torchvision's references do
            keep &= (boxes[:, 2] > boxes[:, 0]) & (boxes[:, 3] > boxes[:, 1])
        target = {"image_id": raw["image_id"]}
        if boxes is None:  # an image without annotations: the wrapper returns its id alone
            keep = torch.zeros(0, dtype=torch.bool)
            boxes = torch.zeros(0, 4)
        target["boxes"] = tv_tensors.BoundingBoxes(boxes[keep].float(), format="XYXY", canvas_size=(h, w))
        labels = raw["labels"].tolist() if "labels" in raw else []
        target["labels"] = torch.tensor([self._label[c] for c in labels], dtype=torch.int64)[keep]
        if self.masks:
            masks = raw["masks"] if "masks" in raw else torch.zeros(0, h, w, dtype=torch.uint8)
            target["masks"] = tv_tensors.Mask(masks[keep])
        if self.transforms is not None:
            image, target = self.transforms(image, target)
        return image, target


def collate(batch):
    """(list of images, list of targets): torchvision's detection models take lists, since sizes differ."""
    images, targets = zip(*batch)
    return list(images), list(targets)


def to_device(images, targets, device: torch.device):
    """A batch on ``device`` as plain tensors (torchvision's models do not need the tv_tensor subclasses)."""
    images = [im.as_subclass(torch.Tensor).to(device, non_blocking=True) for im in images]
    targets = [{k: v.as_subclass(torch.Tensor).to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
                for k, v in t.items()} for t in targets]
    return images, targets


def detection_loss(model, images, targets) -> tuple[torch.Tensor, dict[str, float]]:
    """The summed torchvision loss dict of a train-mode detector on a batch, and its parts as floats."""
    parts = model(images, targets)
    return sum(parts.values()), {k: float(v.detach()) for k, v in parts.items()}


def info_coco(data_dir, *, image_size: int, val_split: str, **_options) -> DatasetInfo:
    """Categories (read from the evaluation split's json) and the canvas size, for ``attnlab.data.registry``."""
    _, annotations = split_paths(data_dir, val_split)
    categories = read_coco(annotations).cats
    if not categories:
        raise DatasetError(f"{annotations.name} lists no categories; a detection set needs at least one.")
    return _detect_info("coco", len(categories), image_size)


def _detect_info(name: str, num_classes: int, image_size: int) -> DatasetInfo:
    return DatasetInfo(name, num_classes, image_size, 3, IMAGENET_MEAN, IMAGENET_STD, task="detect",
                       model_args=(("num_classes", num_classes), ("img_size", image_size)))


def build_coco(train: bool, *, data_dir, download: bool = False, augment: str = "recipe", image_size: int = 224,
               masks: bool = True, train_split: str = "train2017", val_split: str = "val2017",
               jitter_min: float = 0.1, jitter_max: float = 2.0, empty_boxes: str = "refuse") -> CocoInstances:
    """A COCO-format split under ``data_dir`` (COCO 2017's ``train2017`` / ``val2017`` unless the splits name
    other folders): ViTDet's jitter on train unless ``augment`` is ``none``; nothing is downloaded. Boxes of zero
    width or height: :func:`check_coco`."""
    images, annotations = split_paths(data_dir, train_split if train else val_split)
    transforms = detection_transforms(train and augment != "none", image_size, jitter=(jitter_min, jitter_max))
    return CocoInstances(images, annotations, transforms=transforms, masks=masks, empty_boxes=empty_boxes)


def coco_fingerprint(data_dir, *, train_split: str = "train2017", val_split: str = "val2017", **_options
                     ) -> dict[str, str]:
    """The content hash of both splits' annotation files and of every image file (registry.part_stamp: its size and
    its head, middle and tail)."""
    from attnlab.data.registry import file_sha256, folder_stamp

    out = {}
    for split in dict.fromkeys((train_split, val_split)):
        images, annotations = split_paths(data_dir, split)
        out[annotations.name] = file_sha256(annotations)
        out[f"{split}/"] = folder_stamp(images)
    return out


def shapes_fingerprint(data_dir, *, image_size: int = 128, masks: bool = True, jitter_min: float = 0.5,
                       jitter_max: float = 1.5, **options) -> dict[str, str]:
    """The shapes set's own COCO fingerprint (its folder is named by the generator's options)."""
    root = set_dir(data_dir, ShapesOptions(image_size=image_size, **options))
    return coco_fingerprint(root, train_split="train", val_split="val")


def info_shapes(data_dir, *, image_size: int, **_options) -> DatasetInfo:
    return _detect_info("shapes", len(CATEGORIES), image_size)


def build_shapes(train: bool, *, data_dir, download: bool = False, augment: str = "recipe", image_size: int = 128,
                 masks: bool = True, jitter_min: float = 0.5, jitter_max: float = 1.5, **options) -> CocoInstances:
    """The synthetic shapes set (:mod:`attnlab.data.shapes`), generated under ``<data_dir>/shapes`` on first use
    (``options``: :class:`~attnlab.data.shapes.ShapesOptions` fields; ``image_size`` is both the images' size and
    the canvas) and read as COCO; its images already fill the canvas, so the jitter is milder than ViTDet's."""
    valid = [f.name for f in dataclasses.fields(ShapesOptions)]
    bad = next((k for k in options if k not in valid), None)
    if bad is not None:
        raise DatasetError(f"shapes has no option {bad!r}{did_you_mean(bad, valid)}; its options are "
                           f"{', '.join(valid)}.")
    opt = ShapesOptions(image_size=image_size, **options)
    root = generate_shapes(set_dir(data_dir, opt), opt)
    images, annotations = split_paths(root, "train" if train else "val")
    transforms = detection_transforms(train and augment != "none", image_size, jitter=(jitter_min, jitter_max))
    return CocoInstances(images, annotations, transforms=transforms, masks=masks)


__all__ = ["CocoInstances", "build_coco", "build_shapes", "check_coco", "check_image_files", "check_same_categories",
           "coco_fingerprint", "collate", "rle_counts", "shapes_fingerprint",
           "detection_loss", "detection_transforms", "info_coco", "info_shapes", "read_coco", "require_pycocotools",
           "split_paths", "to_device"]
