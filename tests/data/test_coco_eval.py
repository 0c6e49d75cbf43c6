"""COCO AP through pycocotools on cases worked out by hand: category ids mapped back, XYXY boxes written as
[x, y, w, h], masks thresholded and RLE-encoded column-major."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("pycocotools")
from pycocotools import mask as mask_utils  # noqa: E402

from attnlab.data.coco import read_coco  # noqa: E402
from attnlab.data.coco_eval import coco_evaluate, coco_results  # noqa: E402

THRESHOLDS = np.linspace(0.5, 0.95, 10)


def _write(tmp_path, name, images, annotations, categories):
    path = tmp_path / name
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return read_coco(path)


def _box(ann_id, image_id, cat, xywh):
    return {"id": ann_id, "image_id": image_id, "category_id": cat, "bbox": xywh, "area": xywh[2] * xywh[3],
            "iscrowd": 0, "segmentation": []}


def test_box_ap_by_hand(tmp_path):
    # Categories 3 and 7 (labels 1 and 2). Image 1: two disks (7) and one square (3); image 2 has a disk that is
    # left out of the evaluation (image_ids=[1]), so missing it must not count as a miss.
    gt = _write(tmp_path, "gt.json",
                [{"id": 1, "width": 64, "height": 64, "file_name": "a.png"},
                 {"id": 2, "width": 64, "height": 64, "file_name": "b.png"}],
                [_box(1, 1, 7, [0, 0, 10, 10]), _box(2, 1, 7, [20, 20, 10, 10]), _box(3, 1, 3, [40, 40, 12, 8]),
                 _box(4, 2, 7, [5, 5, 10, 10])],
                [{"id": 3, "name": "square"}, {"id": 7, "name": "disk"}])
    prediction = {  # torchvision's output: XYXY boxes, contiguous labels
        "boxes": torch.tensor([[0, 0, 10, 8.8], [20, 20, 30, 26.3], [50, 0, 60, 10], [40, 40, 52, 48]]),
        "labels": torch.tensor([2, 2, 2, 1]),
        "scores": torch.tensor([0.9, 0.8, 0.7, 0.6]),
    }
    results = coco_results([prediction], [1], label_to_category=[0, 3, 7])
    assert [r["category_id"] for r in results] == [7, 7, 7, 3]
    assert results[1]["bbox"] == pytest.approx([20, 20, 10, 6.3])
    metrics = coco_evaluate(gt, results, image_ids=[1], kinds=("box",))

    # Disks: IoUs 0.88 (score 0.9) and 0.63 (score 0.8), then a false positive (0.7). At IoU thresholds up to 0.6
    # both match: precision 1 at every recall -> AP 1. From 0.65 to 0.85 only the first matches: recall stops at
    # 0.5 with precision 1, so 51 of COCO's 101 recall points (0, 0.01, ..., 0.50) have precision 1 -> 51/101.
    # At 0.9 and 0.95 nothing matches -> 0. The square matches exactly (IoU 1) at every threshold -> 1.
    disk = np.array([1.0 if t <= 0.6 else 51 / 101 if t <= 0.85 else 0.0 for t in np.round(THRESHOLDS, 2)])
    square = np.ones(10)
    assert metrics["box_AP"] == pytest.approx(100 * (disk.mean() + square.mean()) / 2)
    assert metrics["box_AP50"] == pytest.approx(100.0)
    assert metrics["box_AP75"] == pytest.approx(100 * (51 / 101 + 1) / 2)
    assert metrics["box_APs"] == pytest.approx(metrics["box_AP"])  # every object is small (area < 32^2)
    assert np.isnan(metrics["box_APm"]) and np.isnan(metrics["box_APl"])  # no medium or large objects

    # with image 2 evaluated too its disk is missed: the disk recall halves
    assert coco_evaluate(gt, results, kinds=("box",))["box_AP"] < metrics["box_AP"]


def test_mask_ap_by_hand(tmp_path):
    # One 12 x 6 rectangle (columns 4..15, rows 10..15), given to pycocotools as an RLE of the mask.
    h, w = 32, 40
    truth = np.zeros((h, w), dtype=np.uint8)
    truth[10:16, 4:16] = 1
    rle = mask_utils.encode(np.asfortranarray(truth))
    rle["counts"] = rle["counts"].decode("ascii")
    gt = _write(tmp_path, "gt.json", [{"id": 5, "width": w, "height": h, "file_name": "a.png"}],
                [{"id": 1, "image_id": 5, "category_id": 4, "bbox": [4, 10, 12, 6], "area": 72, "iscrowd": 0,
                  "segmentation": rle}],
                [{"id": 4, "name": "bar"}])
    # The prediction: the rectangle shifted right by one column (probability 0.9), plus one more column at 0.4
    # that the 0.5 threshold must drop. Intersection 6 x 11 = 66, union 6 x 13 = 78, IoU 0.846: a match at the
    # thresholds 0.5 ... 0.8 (7 of 10) -> mask AP 70. Transposed (row-major RLE) it would not overlap at all.
    prob = torch.full((1, 1, h, w), 0.1)
    prob[0, 0, 10:16, 5:17] = 0.9
    prob[0, 0, 10:16, 17] = 0.4
    prediction = {"boxes": torch.tensor([[5.0, 10, 17, 16]]), "labels": torch.tensor([1]),
                  "scores": torch.tensor([0.95]), "masks": prob}
    results = coco_results([prediction], [5], label_to_category=[0, 4])
    assert mask_utils.area(results[0]["segmentation"]) == 72
    metrics = coco_evaluate(gt, results, kinds=("mask",))
    assert metrics["mask_AP"] == pytest.approx(70.0)
    assert metrics["mask_AP50"] == pytest.approx(100.0)
    assert metrics["mask_AP75"] == pytest.approx(100.0)
    assert set(metrics) == {f"mask_{m}" for m in ("AP", "AP50", "AP75", "APs", "APm", "APl")}


def test_nothing_detected_scores_zero(tmp_path):
    gt = _write(tmp_path, "gt.json", [{"id": 1, "width": 8, "height": 8, "file_name": "a.png"}],
                [_box(1, 1, 1, [1, 1, 4, 4])], [{"id": 1, "name": "x"}])
    empty = {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.int64), "scores": torch.zeros(0),
             "masks": torch.zeros(0, 1, 8, 8)}
    results = coco_results([empty], [1], label_to_category=[0, 1])
    assert results == []
    metrics = coco_evaluate(gt, results)
    assert metrics["box_AP"] == 0.0 and metrics["mask_AP"] == 0.0
