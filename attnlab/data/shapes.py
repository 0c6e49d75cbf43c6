"""Synthetic shapes: a detection and instance-segmentation set generated locally by seed, written as a real COCO
dataset (``annotations/instances_{train,val}.json`` plus PNGs under ``<root>``, and ``generator.json``, the options
that wrote them: a set is regenerated when they change), so that the COCO code path runs on it unchanged.

Each image is a noisy background with 0 to ``max_objects`` filled squares, disks and triangles of several sizes and
colours, placed at random: later shapes occlude earlier ones, each instance's mask, box and area are what stays
visible, and a placement that leaves an instance less than half visible is drawn again. About one image in twenty
has no object (an image with no boxes must still train). Masks are stored as COCO RLE.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from attnlab.errors import DatasetError

CATEGORIES = ({"id": 1, "name": "square"}, {"id": 2, "name": "disk"}, {"id": 3, "name": "triangle"})
GENERATOR_FILE = "generator.json"
SPLITS = ("train", "val")


@dataclass(frozen=True)
class ShapesOptions:
    """What a shapes set is generated from (written to ``generator.json``)."""

    seed: int = 0
    train_images: int = 512
    val_images: int = 128
    image_size: int = 128
    max_objects: int = 4
    min_size: int = 12  # shape side / diameter, pixels
    max_size: int = 48
    empty_fraction: float = 0.05


def _shape_mask(kind: str, cx: int, cy: int, s: int, angle: float, size: int) -> np.ndarray:
    """A filled shape of side/diameter ``s`` centred at (cx, cy) on a ``size`` x ``size`` canvas, bool (H, W)."""
    canvas = Image.new("L", (size, size), 0)
    draw = ImageDraw.Draw(canvas)
    h = s / 2
    if kind == "square":
        draw.rectangle([cx - h, cy - h, cx + h - 1, cy + h - 1], fill=1)
    elif kind == "disk":
        draw.ellipse([cx - h, cy - h, cx + h - 1, cy + h - 1], fill=1)
    else:  # an equilateral triangle of side s, turned by angle
        r = s / np.sqrt(3)
        pts = [(cx + r * np.cos(angle + k * 2 * np.pi / 3), cy + r * np.sin(angle + k * 2 * np.pi / 3))
               for k in range(3)]
        draw.polygon(pts, fill=1)
    return np.asarray(canvas, dtype=bool)


def _image(rng: np.random.Generator, opt: ShapesOptions,
           empty: bool) -> tuple[np.ndarray, list[tuple[int, np.ndarray]]]:
    """One image (H, W, 3) uint8 and its instances [(category id, visible bool mask)], painter's order."""
    size = opt.image_size
    background = rng.integers(0, 90, 3)
    while True:
        pixels = np.clip(background + rng.normal(0, 12, (size, size, 3)), 0, 255)
        owner = np.zeros((size, size), dtype=np.int32)  # 0: background, i + 1: the i-th shape
        shapes = []
        for i in range(0 if empty else int(rng.integers(1, opt.max_objects + 1))):
            cat = CATEGORIES[int(rng.integers(len(CATEGORIES)))]
            s = int(rng.integers(opt.min_size, opt.max_size + 1))
            cx, cy = (int(v) for v in rng.integers(s // 2, size - s // 2, 2))
            mask = _shape_mask(cat["name"], cx, cy, s, float(rng.uniform(0, 2 * np.pi)), size)
            colour = rng.integers(110, 256, 3) * rng.permutation([1.0, rng.uniform(0.2, 1), rng.uniform(0, 1)])
            pixels[mask] = np.clip(colour + rng.normal(0, 6, (int(mask.sum()), 3)), 0, 255)
            owner[mask] = i + 1
            shapes.append((cat["id"], mask))
        visible = [(cat, owner == i + 1) for i, (cat, _) in enumerate(shapes)]
        if all(v.sum() >= 0.5 * m.sum() and v.any() for (_, m), (_, v) in zip(shapes, visible)):
            return pixels.astype(np.uint8), visible


def _annotation(mask: np.ndarray, cat: int, image_id: int, ann_id: int) -> dict:
    from pycocotools import mask as mask_utils

    rle = mask_utils.encode(np.asfortranarray(mask.astype(np.uint8)))
    ys, xs = np.nonzero(mask)
    x0, y0 = int(xs.min()), int(ys.min())
    return {"id": ann_id, "image_id": image_id, "category_id": cat, "iscrowd": 0, "area": int(mask.sum()),
            "bbox": [x0, y0, int(xs.max()) + 1 - x0, int(ys.max()) + 1 - y0],
            "segmentation": {"size": rle["size"], "counts": rle["counts"].decode("ascii")}}


def _write_split(root: Path, split: str, count: int, rng: np.random.Generator, opt: ShapesOptions) -> None:
    (root / split).mkdir(parents=True)
    images, annotations = [], []
    for image_id in range(1, count + 1):
        pixels, instances = _image(rng, opt, empty=rng.random() < opt.empty_fraction)
        name = f"{image_id:06d}.png"
        Image.fromarray(pixels).save(root / split / name)
        images.append({"id": image_id, "file_name": name, "width": opt.image_size, "height": opt.image_size})
        for cat, mask in instances:
            annotations.append(_annotation(mask, cat, image_id, len(annotations) + 1))
    coco = {"info": {"description": f"attnlab synthetic shapes, {split}", "seed": opt.seed},
            "images": images, "annotations": annotations, "categories": [dict(c) for c in CATEGORIES]}
    (root / "annotations").mkdir(exist_ok=True)
    (root / "annotations" / f"instances_{split}.json").write_text(json.dumps(coco))


def set_dir(data_dir: str | os.PathLike, options: ShapesOptions) -> Path:
    """``<data_dir>/shapes/seed<seed>-<hash>``: one folder per set of options, so that runs of different sets never
    rewrite each other's files."""
    import hashlib

    digest = hashlib.sha256(json.dumps(asdict(options), sort_keys=True).encode()).hexdigest()[:8]
    return Path(data_dir).expanduser() / "shapes" / f"seed{options.seed}-{digest}"


def generate_shapes(root: str | os.PathLike, options: ShapesOptions | None = None) -> Path:
    """Write the shapes set of ``options`` under ``root`` (module docstring) unless it is already there, and
    return ``root``. Written into a temporary sibling and renamed, so a reader never sees half a set."""
    from attnlab.data.coco import require_pycocotools

    require_pycocotools()
    opt = options or ShapesOptions()
    if not 1 <= opt.min_size <= opt.max_size < opt.image_size:
        raise DatasetError(f"shapes sizes must satisfy 1 <= min_size <= max_size < image_size, not "
                           f"{opt.min_size}, {opt.max_size}, {opt.image_size}.")
    root = Path(root).expanduser()
    record = root / GENERATOR_FILE
    if record.is_file():  # ours: kept when written from the same options, else written again
        if _written_from(record, opt):
            return root
    elif root.exists() and any(root.iterdir()):
        raise DatasetError(f"{root} exists and is not a shapes set (no {GENERATOR_FILE}); give an empty or new "
                           f"folder.")
    _remove_orphans(root)
    tmp = root.with_name(f".{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    rng = np.random.default_rng(opt.seed)
    try:
        for split, count in zip(SPLITS, (opt.train_images, opt.val_images)):
            _write_split(tmp, split, count, rng, opt)
        (tmp / GENERATOR_FILE).write_text(json.dumps(asdict(opt)))
    except BaseException:  # Ctrl-C, SIGTERM (raised as an exception by attnlab's handler), a full disk
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # another process (a grid's runs, DDP ranks: they start together) may have written the same set meanwhile:
    # it is kept, never removed under a reader; only a set of other options is replaced whole
    if _written_from(record, opt):
        shutil.rmtree(tmp, ignore_errors=True)
        return root
    if root.exists():
        shutil.rmtree(root)
    root.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.replace(root)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not _written_from(record, opt):
            raise
    return root


def _remove_orphans(root: Path) -> None:
    """Remove the temporary folders ``.<name>.tmp<pid>`` that a process killed while writing left beside ``root``
    (its pid no longer runs); a live writer's folder is left alone."""
    for tmp in root.parent.glob(f".{root.name}.tmp*") if root.parent.is_dir() else ():
        pid = tmp.name.rpartition(".tmp")[2]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(tmp, ignore_errors=True)
        except OSError:  # a process of another user: alive
            pass


def _written_from(record: Path, opt: ShapesOptions) -> bool:
    try:
        return json.loads(record.read_text()) == asdict(opt)
    except (OSError, ValueError):
        return False


__all__ = ["CATEGORIES", "ShapesOptions", "generate_shapes", "set_dir"]
