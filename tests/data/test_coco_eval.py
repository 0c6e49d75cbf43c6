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


# ---- evaluate_detector end to end: a detector whose outputs the test sets ------------------------------------------
# Three images of different sizes, one category (id 5). The detector resizes each image with torchvision's
# GeneralizedRCNNTransform (min = max = 96: 48x64 -> 72x96, 80x40 -> 96x48, 64x64 -> 96x96) and pads the batch
# to a multiple of 32; its "network" answers in the resized frame and the transform maps the boxes back, as
# torchvision's detectors do, so the json's coordinates have been through a resize and a pad.
SIZES = {1: (48, 64), 2: (80, 40), 3: (64, 64)}  # image id: (height, width)
TRUTH = [(1, [4, 4, 20, 12]), (2, [8, 10, 16, 30]), (3, [10, 10, 24, 24]), (3, [40, 40, 16, 16])]  # (image, xywh)


def _rect(image_id, xywh):
    h, w = SIZES[image_id]
    m = np.zeros((h, w), dtype=np.uint8)
    x, y, bw, bh = xywh
    m[y:y + bh, x:x + bw] = 1
    return m


def _dataset(tmp_path):
    from PIL import Image

    from attnlab.data.coco import CocoInstances, detection_transforms

    (tmp_path / "val").mkdir()
    images, anns = [], []
    for image_id, (h, w) in SIZES.items():
        pixels = np.random.default_rng(image_id).integers(0, 255, (h, w, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(tmp_path / "val" / f"{image_id}.png")
        images.append({"id": image_id, "width": w, "height": h, "file_name": f"{image_id}.png"})
    for ann_id, (image_id, xywh) in enumerate(TRUTH, 1):
        rle = mask_utils.encode(np.asfortranarray(_rect(image_id, xywh)))
        rle["counts"] = rle["counts"].decode("ascii")
        anns.append(dict(_box(ann_id, image_id, 5, xywh), segmentation=rle))
    path = tmp_path / "instances_val.json"
    path.write_text(json.dumps({"images": images, "annotations": anns, "categories": [{"id": 5, "name": "box"}]}))
    return CocoInstances(tmp_path / "val", path, transforms=detection_transforms(False, 96))


class _Scripted(torch.nn.Module):
    """A torchvision-shaped detector: ``plan`` {image id: [(xywh, score), ...]} in the json's coordinates, each
    detection's mask the rectangle of its box (a full-image mask in the json's coordinates, set after the transform
    has mapped the boxes back; torchvision's RoI-mask pasting is not under test)."""

    def __init__(self, plan, masks=True):
        from types import SimpleNamespace

        from torchvision.models.detection.transform import GeneralizedRCNNTransform

        super().__init__()
        self.transform = GeneralizedRCNNTransform(96, 96, [0.5] * 3, [0.25] * 3)
        self.roi_heads = SimpleNamespace(has_mask=lambda: masks)
        self.plan, self.masks, self.padded = plan, masks, []

    def forward(self, images):
        originals = [tuple(im.shape[-2:]) for im in images]
        batch, _ = self.transform(images)
        self.padded.append(tuple(batch.tensors.shape[-2:]))
        ids = [next(i for i, s in SIZES.items() if s == hw) for hw in originals]
        outs = []
        for image_id, (h, w), (rh, rw) in zip(ids, originals, batch.image_sizes):
            dets = self.plan.get(image_id, [])
            xyxy = torch.tensor([[x, y, x + bw, y + bh] for (x, y, bw, bh), _ in dets], dtype=torch.float32)
            outs.append({"boxes": xyxy.view(-1, 4) * torch.tensor([rw / w, rh / h, rw / w, rh / h]),
                         "labels": torch.ones(len(dets), dtype=torch.int64),
                         "scores": torch.tensor([s for _, s in dets], dtype=torch.float32)})
        outs = self.transform.postprocess(outs, batch.image_sizes, originals)
        for image_id, out in zip(ids, outs):
            dets = self.plan.get(image_id, [])
            assert torch.allclose(out["boxes"], torch.tensor([[x, y, x + bw, y + bh] for (x, y, bw, bh), _ in dets],
                                                             dtype=torch.float32).view(-1, 4), atol=1e-4)
            if self.masks:
                out["masks"] = torch.stack([torch.from_numpy(_rect(image_id, xywh)).float()[None]
                                            for xywh, _ in dets]) if dets else torch.zeros(0, 1, *SIZES[image_id])
        return outs


def _pycocotools_directly(gt, plan, kinds):
    """The same detections as COCO result records, evaluated by pycocotools' COCOeval without attnlab."""
    import contextlib
    import io

    from pycocotools.cocoeval import COCOeval

    records = []
    for image_id, dets in plan.items():
        for xywh, score in dets:
            rle = mask_utils.encode(np.asfortranarray(_rect(image_id, xywh)))
            records.append({"image_id": image_id, "category_id": 5, "bbox": list(map(float, xywh)), "score": score,
                            "segmentation": rle})
    out = {}
    for kind, iou_type in (("box", "bbox"), ("mask", "segm")):
        if kind not in kinds:
            continue
        rec = records if kind == "box" else [{k: v for k, v in r.items() if k != "bbox"} for r in records]
        with contextlib.redirect_stdout(io.StringIO()):
            ev = COCOeval(gt, gt.loadRes(rec), iou_type)
            ev.evaluate(), ev.accumulate(), ev.summarize()
        out.update({f"{kind}_{m}": float("nan") if s < 0 else 100 * s
                    for m, s in zip(("AP", "AP50", "AP75", "APs", "APm", "APl"), ev.stats)})
    return out


EXACT = {i: [(xywh, 0.9 - 0.1 * n)] for n, (i, xywh) in enumerate(TRUTH) if i != 3}
EXACT[3] = [(TRUTH[2][1], 0.7), (TRUTH[3][1], 0.6)]
# C shifted right by 4: IoU (24 - 4) / (24 + 4) = 0.714, a match at the thresholds 0.50 ... 0.70 (5 of 10); at the
# others it is a false positive that comes last (score 0.5): recall 3/4 with precision 1 -> 76 of the 101 recall
# points. AP = (5 + 5 * 76/101) / 10, AP75 = 76/101, boxes and masks alike (the masks are the boxes' rectangles).
SHIFTED = {**EXACT, 3: [([14, 10, 24, 24], 0.5), (TRUTH[3][1], 0.6)]}
# a false positive above every true one (score 0.95, no overlap): precisions 1/2, 2/3, 3/4, 4/5 at recalls 1/4 ...
# 1, interpolated (the best precision at any higher recall) to 0.8 at every recall point, at every threshold -> 80
FALSE_FIRST = {**EXACT, 1: EXACT[1] + [([40, 30, 10, 10], 0.95)]}
CASES = {"exact": (EXACT, 100.0, 100.0), "shifted": (SHIFTED, 100 * (5 + 5 * 76 / 101) / 10, 100 * 76 / 101),
         "false_positive_first": (FALSE_FIRST, 80.0, 80.0)}


@pytest.mark.parametrize("case", list(CASES))
def test_evaluate_detector_through_resize_and_pad_by_hand(tmp_path, case):
    from attnlab.data.coco_eval import evaluate_detector

    plan, ap, ap75 = CASES[case]
    dataset = _dataset(tmp_path)
    model = _Scripted(plan)
    got = evaluate_detector(model, dataset, batch_size=2)
    assert model.padded == [(96, 96), (96, 96)]  # 72x96 and 96x48 padded to one 96x96 batch; then 96x96
    want = _pycocotools_directly(dataset.coco, plan, ("box", "mask"))
    assert set(got) == set(want)
    for key, value in want.items():
        assert got[key] == pytest.approx(value, nan_ok=True), key
    for kind in ("box", "mask"):  # every object is small (area < 32^2): APs is AP, APm and APl have no objects
        assert got[f"{kind}_AP"] == pytest.approx(ap) and got[f"{kind}_APs"] == pytest.approx(ap)
        assert got[f"{kind}_AP50"] == pytest.approx(100.0 if case != "false_positive_first" else 80.0)
        assert got[f"{kind}_AP75"] == pytest.approx(ap75)
        assert np.isnan(got[f"{kind}_APm"]) and np.isnan(got[f"{kind}_APl"])
