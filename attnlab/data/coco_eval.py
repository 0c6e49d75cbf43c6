"""COCO box and mask AP with pycocotools' ``COCOeval`` (the reference implementation; faster-coco-eval gives the
same numbers faster but is not used, so that no second implementation can disagree).

    predictions (torchvision's dicts) --coco_results--> COCO result records --coco_evaluate--> AP, AP50, AP75,
    APs, APm, APl for boxes and masks, in per cent

A record carries the json's own category id (labels mapped back), the box as [x, y, width, height], the score,
and the mask thresholded at 0.5 as a compressed RLE. Mask AP is computed from records without the box, so that
pycocotools sizes each instance by its mask area when it sorts them into small / medium / large (with a box present
it would take the box's area), as detectron2's evaluator does. A metric with no ground truth of its size is nan
(pycocotools' -1).
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from attnlab.data.coco import collate, require_pycocotools, to_device

METRICS = ("AP", "AP50", "AP75", "APs", "APm", "APl")
IOU_TYPES = {"box": "bbox", "mask": "segm"}


def coco_results(predictions: Sequence[dict], image_ids: Sequence[int], label_to_category: Sequence[int], *,
                 mask_threshold: float = 0.5) -> list[dict]:
    """COCO result records of torchvision detector outputs (``boxes`` XYXY, ``labels``, ``scores``, optional
    ``masks`` (N, 1, H, W) probabilities) for the images ``image_ids``, labels mapped to category ids."""
    require_pycocotools()
    from pycocotools import mask as mask_utils

    records = []
    for pred, image_id in zip(predictions, image_ids, strict=True):
        boxes = pred["boxes"].detach().float().cpu()
        if not len(boxes):
            continue
        xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).tolist()
        cats = [int(label_to_category[int(label)]) for label in pred["labels"].tolist()]
        scores = pred["scores"].detach().float().cpu().tolist()
        rles = [None] * len(boxes)
        if "masks" in pred:
            binary = (pred["masks"].detach()[:, 0] > mask_threshold).cpu().numpy().astype(np.uint8)
            rles = mask_utils.encode(np.asfortranarray(binary.transpose(1, 2, 0)))  # (H, W, N), column-major
            for rle in rles:
                rle["counts"] = rle["counts"].decode("ascii")
        for box, cat, score, rle in zip(xywh, cats, scores, rles):
            record = {"image_id": int(image_id), "category_id": cat, "bbox": [round(v, 3) for v in box],
                      "score": score}
            if rle is not None:
                record["segmentation"] = rle
            records.append(record)
    return records


def coco_evaluate(coco_gt, results: list[dict], image_ids: Iterable[int] | None = None,
                  kinds: Sequence[str] = ("box", "mask")) -> dict[str, float]:
    """``box_AP``, ``box_AP50``, ... ``mask_APl`` (per cent) of ``results`` against the ``COCO`` index
    ``coco_gt``, over ``image_ids`` (default: every image of ``coco_gt``). ``kinds``: ``box`` and/or ``mask``;
    ``mask`` is skipped when no record has a mask."""
    require_pycocotools()
    from pycocotools.cocoeval import COCOeval

    ids = sorted(set(image_ids)) if image_ids is not None else sorted(coco_gt.getImgIds())
    out: dict[str, float] = {}
    for kind in kinds:
        if kind not in IOU_TYPES:
            raise ValueError(f"kind {kind!r} is not 'box' or 'mask'")
        records = results
        if kind == "mask":
            if results and "segmentation" not in results[0]:
                continue
            records = [{k: v for k, v in r.items() if k != "bbox"} for r in results]
        if not records:  # pycocotools cannot load an empty result list; nothing detected scores 0
            out.update({f"{kind}_{m}": 0.0 for m in METRICS})
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            dt = coco_gt.loadRes(records)
            ev = COCOeval(coco_gt, dt, IOU_TYPES[kind])
            ev.params.imgIds = ids
            ev.evaluate()
            ev.accumulate()
            ev.summarize()
        out.update({f"{kind}_{m}": float("nan") if s < 0 else 100.0 * float(s) for m, s in zip(METRICS, ev.stats)})
    return out


@torch.no_grad()
def evaluate_detector(model, dataset, *, device: torch.device | str = "cpu", batch_size: int = 2,
                      num_workers: int = 0, limit: int | None = None, amp_dtype: torch.dtype | None = None
                      ) -> dict[str, float]:
    """COCO AP of ``model`` (a torchvision detector) on a :class:`~attnlab.data.coco.CocoInstances` split: its
    images in order (the first ``limit`` when given), predictions in the json's coordinates, mask AP when the model
    predicts masks. The model is put in eval mode and left there."""
    from torch.utils.data import DataLoader, Subset

    device = torch.device(device)
    subset = dataset if limit is None else Subset(dataset, range(min(limit, len(dataset))))
    loader = DataLoader(subset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=collate)
    model.eval()
    predictions, ids = [], []
    for images, targets in loader:
        images, _ = to_device(images, [], device)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            outputs = model(images)
        predictions += [{k: v.float().cpu() for k, v in o.items()} for o in outputs]
        ids += [int(t["image_id"]) for t in targets]
    results = coco_results(predictions, ids, dataset.label_to_category)
    kinds = ("box", "mask") if getattr(model, "roi_heads", None) is not None and model.roi_heads.has_mask() \
        else ("box",)
    return coco_evaluate(dataset.coco, results, ids, kinds)


__all__ = ["METRICS", "coco_evaluate", "coco_results", "evaluate_detector"]
