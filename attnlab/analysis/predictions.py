"""Predicted boxes and masks beside the ground truth, as the DnA paper's Figure 10 shows ViTDet's detections ("DnA:
Denoising Attention for Visual Tasks", Appendix C.4): for each image, the prediction on the left and the ground
truth on the right, drawn with torchvision's ``draw_segmentation_masks`` and ``draw_bounding_boxes``; one colour
per category, the same on both sides.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

# matplotlib's tab10, so categories keep their colour from one figure to the next
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")


def draw_instances(image: torch.Tensor, boxes: torch.Tensor, labels: torch.Tensor, masks: torch.Tensor | None = None,
                   scores: torch.Tensor | None = None, names: Sequence[str] | None = None,
                   alpha: float = 0.45) -> torch.Tensor:
    """``image`` (3, H, W; float in [0, 1] or uint8) with ``masks`` (N, H, W, boolean) filled and ``boxes``
    (N, 4, XYXY) outlined, each in its label's colour and captioned by ``names[label]`` and the score; uint8."""
    from torchvision.utils import draw_bounding_boxes, draw_segmentation_masks

    out = image.detach().cpu()
    if out.dtype != torch.uint8:
        out = (out.float().clamp(0, 1) * 255).round().to(torch.uint8)
    labels = [int(v) for v in labels]
    colours = [PALETTE[label % len(PALETTE)] for label in labels]
    if masks is not None and len(masks):
        out = draw_segmentation_masks(out, masks.detach().cpu().bool(), alpha=alpha, colors=colours)
    if len(boxes):
        captions = [names[label] if names is not None and label < len(names) else str(label) for label in labels]
        if scores is not None:
            captions = [f"{c} {float(s):.2f}" for c, s in zip(captions, scores)]
        out = draw_bounding_boxes(out, boxes.detach().cpu().float(), labels=captions, colors=colours, width=2)
    return out


def prediction_figure(image: torch.Tensor, prediction: dict, target: dict, names: Sequence[str] | None = None, *,
                      score_threshold: float = 0.5, mask_threshold: float = 0.5, gap: int = 8) -> torch.Tensor:
    """One Figure-10 panel: the detections scoring at least ``score_threshold`` (masks thresholded at
    ``mask_threshold``) beside the ground truth ``target`` (``boxes``, ``labels``, optional ``masks``), a white
    ``gap`` between; uint8 (3, H, 2W + gap). ``names[label]`` captions the boxes (index 0: background)."""
    keep = prediction["scores"].detach().cpu() >= score_threshold
    masks = prediction.get("masks")
    if masks is not None:
        masks = masks.detach().cpu()[keep][:, 0] > mask_threshold
    left = draw_instances(image, prediction["boxes"].cpu()[keep], prediction["labels"].cpu()[keep], masks,
                          prediction["scores"].cpu()[keep], names)
    right = draw_instances(image, target["boxes"], target["labels"], target.get("masks"), None, names)
    spacer = torch.full((3, left.shape[1], gap), 255, dtype=torch.uint8)
    return torch.cat([left, spacer, right], dim=2)


@torch.no_grad()
def predictions_figures(model, dataset, indices: Sequence[int], out_dir: str | Path, *, device="cpu",
                        score_threshold: float = 0.5) -> list[Path]:
    """PNG files of :func:`prediction_figure` for ``dataset[i]`` (a :class:`~attnlab.data.coco.CocoInstances`
    split, evaluation transforms) for each ``i`` in ``indices``, written to ``out_dir``; their paths."""
    from torchvision.io import write_png

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = ["background"] + [c["name"] for c in dataset.categories]
    model.eval()
    paths = []
    for i in indices:
        image, target = dataset[i]
        [prediction] = model([image.as_subclass(torch.Tensor).to(device)])
        figure = prediction_figure(image, {k: v.cpu() for k, v in prediction.items()}, target, names,
                                   score_threshold=score_threshold)
        path = out_dir / f"predictions_{int(target['image_id']):06d}.png"
        write_png(figure, str(path))
        paths.append(path)
    return paths


__all__ = ["PALETTE", "draw_instances", "prediction_figure", "predictions_figures"]
