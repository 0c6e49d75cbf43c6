"""Detection and instance segmentation: torchvision's Mask R-CNN (Faster R-CNN with ``masks: false``) around a
ViTDet or Swin backbone carrying the run's spec (:func:`attnlab.models.build_detector`), on COCO-format data
(:mod:`attnlab.data.coco`: COCO itself, or the synthetic shapes set); docs/training.md, "Detection".

A batch is ``(images, targets)`` on the device, lists as torchvision's detectors take them; the loss is the sum of
torchvision's loss dict, each part logged per epoch. Evaluation: COCO box and mask AP (pycocotools' COCOeval),
null for a size without objects; the headline is box AP.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnlab.errors import ConfigError
from attnlab.train.section import Section, option

from .base import Task
from .classify import _HostData, check_steps, train_sampler

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn


@dataclass(frozen=True)
class DetectConfig(Section):
    """detect: keys of detection runs (ViTDet's recipe)."""

    augment: str = option("recipe", "'recipe' (large-scale jitter and flip, ViTDet's) or 'none'",
                          choices=("recipe", "none"))

BOX = ("box_AP", "box_AP50", "box_AP75", "box_APs", "box_APm", "box_APl")
MASK = tuple(k.replace("box_", "mask_") for k in BOX)
LOSSES = ("loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg")


class _DetectionData(_HostData):
    """The classification task's seeded, rank-sharded loader (:class:`~attnlab.train.tasks.classify._HostData`),
    batching lists (images differ in size, ``attnlab.data.coco.collate``) and moving them to the device."""

    def batches(self, epoch: int):
        from attnlab.data.coco import to_device

        super().batches(epoch)  # seeds the epoch's order and workers
        return (to_device(images, targets, self.device) for images, targets in self.loader)


class Detection(Task):
    """COCO-format detection with torchvision's R-CNNs (module docstring)."""

    name = "detect"
    section = DetectConfig
    trains = "a detector"
    also_trains = ("image",)  # an image preset is a backbone
    other_models = "a timm ViT/DeiT/Swin name"
    repeats = 1
    metrics = BOX + MASK
    headline = "box_AP"
    higher_is_better = True
    #: the report's further columns beside the headline (mean, SD, gain), as the DnA paper's Table 9 shows them
    report_columns = ("mask_AP", "box_AP50", "box_AP75", "mask_AP50", "mask_AP75")
    #: the training-curve panels (metric, title)
    curve_panels = (("train_loss", "train loss"), ("box_AP", "box AP (%)"), ("box_AP50", "box AP50 (%)"))

    def val_set(self):
        if getattr(self, "_val", None) is None:  # built once
            self._val = self._split(False)
        return self._val

    def prepare_eval(self) -> None:
        self.val_set()

    @classmethod
    def presets(cls) -> list[str]:
        from attnlab.models import DETECTOR_PRESETS

        return list(DETECTOR_PRESETS)

    def check(self, cache: dict) -> None:
        import torch

        from attnlab.data.coco import check_same_categories

        cfg = self.cfg
        key = ("data", cfg.dataset, cfg.run.data_dir, self.options.augment, repr(sorted(cfg.data_options.items())))
        if key not in cache:
            train = self._split(True)  # each split checks its json, images and categories as it is built
            check_same_categories(train, self.val_set())
            cache[key] = len(train)
        if self.cfg.model_options.get("masks", False) and not self._data_masks():
            raise ConfigError("model option masks is true but the dataset's masks option is false; a Mask R-CNN "
                              "needs instance masks, so drop one of them.")
        check_steps(cfg, len(train_sampler(1, range(cache[key]), torch.Generator())))

    def build_model(self, pretrained: bool = True) -> nn.Module:
        """``attnlab.models.build_detector(cfg.model, ...)``: a detector preset or a timm ViT/DeiT/Swin name, sized
        by the dataset (categories, canvas); any other model is one line saying what the task takes."""
        from attnlab import models

        kwargs = self._model_kwargs(pretrained)
        kwargs.setdefault("masks", self._data_masks())
        return models.build_detector(self.cfg.model, attn=self.run.spec, norm=self.cfg.norm, **kwargs)

    def _data_masks(self) -> bool:
        from attnlab.data.registry import resolve_options

        return resolve_options(self.cfg.dataset, self.cfg.data_options)["masks"]

    def train_data(self, batch_size: int, device: torch.device):
        from attnlab.data.coco import collate

        return _DetectionData(self, self._split(True), batch_size, device, mixup_fn=None, collate_fn=collate)

    def loss(self, model, batch):
        images, targets = batch
        parts = model(images, targets)
        n = len(images)
        return sum(parts.values()), {"seen": n, **{k: v.detach() * n for k, v in parts.items()}}

    def train_stats(self, sums: dict[str, float], seconds: float) -> dict[str, float]:
        seen = max(sums.get("seen", 0.0), 1.0)
        parts = {f"train_{k}": sums[k] / seen for k in LOSSES if k in sums}
        return {"train_loss": sums.get("loss", 0.0) / seen, **parts, "train_seconds": seconds,
                "img_per_s": sums.get("seen", 0.0) / seconds if seconds > 0 else 0.0}

    def evaluate(self, model, *, device, amp_dtype, static_shapes: bool = False) -> dict[str, float | None]:
        from attnlab.data.coco_eval import evaluate_detector

        metrics = evaluate_detector(model, self.val_set(), device=device, amp_dtype=amp_dtype,
                                    batch_size=max(1, self.cfg.batch_size // max(self.cfg.grad_accum, 1)),
                                    num_workers=self.cfg.run.num_workers)
        return {k: (None if v != v else v) for k, v in metrics.items()}  # nan (no object of a size) -> null

    def example_input(self, batch: int = 1, device="cpu") -> list[torch.Tensor]:
        import torch

        size = self.run.info.image_size
        return [torch.zeros(3, size, size, device=device) for _ in range(batch)]

    def inputs(self, n: int) -> torch.Tensor:
        """The first ``n`` evaluation images fitted into the square canvas (the longer side resized to it, the
        rest padded), in [0, 1]: what :meth:`instrument_model` takes."""
        import torch
        import torch.nn.functional as F

        size, val = self.run.info.image_size, self.val_set()
        out = torch.zeros(min(n, len(val)), 3, size, size)
        for i in range(len(out)):
            image = val[i][0].as_subclass(torch.Tensor)
            scale = size / max(image.shape[-2:])
            h, w = (min(size, round(d * scale)) for d in image.shape[-2:])
            out[i, :, :h, :w] = F.interpolate(image[None], size=(h, w), mode="bilinear", antialias=True)[0]
        return out

    def instrument_model(self, model: nn.Module) -> nn.Module:
        """What the backbone instruments (spectra, entropy, the DnA instruments, Jacobian) measure: the detector's
        transformer behind its own input normalisation, taking :meth:`inputs`."""
        from attnlab.models.detection import BackboneProbe

        return BackboneProbe(model)

    def line(self, record: dict[str, Any]) -> str:
        shown = [f"train_loss {record['train_loss']:.4f}"]
        shown += [f"{k} {record[k]:.2f}" for k in ("box_AP", "box_AP50", "mask_AP") if record.get(k) is not None]
        return "  ".join(shown + [f"{record.get('img_per_s', 0.0):.1f} img/s"])


__all__ = ["BOX", "DetectConfig", "Detection", "LOSSES", "MASK"]
