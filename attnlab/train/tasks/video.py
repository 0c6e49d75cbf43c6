"""Video classification (TimeSformer on clips): the image task's training with clips for images (no Mixup/CutMix),
and the video evaluation, the softmax of several views per clip averaged (top-1, top-5 and mean class accuracy;
docs/training.md, "Video"). The run's ``video_metric`` (top1, or mean_class_accuracy for Smarthome) is what
result.json reports first and a report compares.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from attnlab.errors import ConfigError
from attnlab.train.section import Section, option, within

from .classify import SMOOTHING_HELP, Classification, classification_stats

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class VideoConfig(Section):
    """video: keys of video classification runs (TimeSformer)."""

    augment: str = option("recipe", "'recipe' (scale jitter, crop, flip) or 'none'", choices=("recipe", "none"))
    label_smoothing: float = option(0.0, SMOOTHING_HELP, within(0, 1))
    video_metric: str = option("top1", "the metric result.json reports first and a report compares, 'top1' (NTU60, "
                                       "Kinetics) or 'mean_class_accuracy' (Toyota Smarthome)",
                               choices=("top1", "mean_class_accuracy"))


class VideoClassification(Classification):
    """Cross-entropy on clips, evaluated by test loss, top-1, top-5 and mean class accuracy over the views."""

    name = "video"
    section = VideoConfig
    trains = "a video model"
    model_classes = ("attnlab.models.timesformer:TimeSformer",)
    metrics = ("test_loss", "top1", "top5", "mean_class_accuracy")
    headline = "top1"
    report_columns = ("top1", "mean_class_accuracy", "top5")  # the one result.json names is the headline
    robustness_eval = False  # clips in several views: eval reports the task's own metrics

    def __init__(self, run) -> None:
        super().__init__(run)
        self.headline = self.options.video_metric

    def build_model(self, pretrained: bool = True):
        """The TimeSformer of the run; a crop size that its patches do not tile is refused, as the detector refuses
        it (timm's patch embedding would drop the border pixels without a word)."""
        model = super().build_model(pretrained)
        embed = getattr(model, "patch_embed", None)
        patch, size = getattr(embed, "patch_size", None), getattr(embed, "img_size", None)
        if patch is not None and size is not None and any(s % p for s, p in zip(size, patch)):
            raise ConfigError(f"the video image_size {size[0]} is not a multiple of {self.cfg.model}'s patch size "
                              f"{patch[0]}, so the border pixels past the last whole patch would be dropped; give "
                              f"--data-options '{{image_size: {max(patch[0], size[0] // patch[0] * patch[0])}}}' or "
                              f"another multiple of {patch[0]}.")
        return model

    def train_stats(self, sums, seconds):
        stats = classification_stats(sums, seconds)
        stats["clips_per_s"] = stats.pop("img_per_s")
        return stats

    def _views(self) -> int:
        item = self.test_set()[0][0]
        return item.shape[0] if item.ndim == 5 else 1

    def evaluate(self, model, *, device, amp_dtype, static_shapes: bool = False) -> dict[str, float]:
        import torch
        from torch.utils.data import DataLoader

        from attnlab.data.video_metrics import predict_video, video_metrics

        if getattr(self, "_test_loader", None) is None:
            per_batch = max(1, 2 * self.cfg.batch_size // self._views())  # about 2 x batch_size clips per forward
            self._test_loader = DataLoader(self.test_set(), batch_size=per_batch, shuffle=False,
                                           num_workers=self.cfg.run.num_workers, pin_memory=device.type == "cuda",
                                           generator=torch.Generator().manual_seed(0))
        pad = self._test_loader.batch_size * self._views() if static_shapes else None
        return video_metrics(*predict_video(model, self._test_loader, device, amp_dtype=amp_dtype, pad_to=pad))

    def example_input(self, batch: int = 1, device="cpu") -> torch.Tensor:
        import torch

        info = self.run.info
        return torch.zeros(batch, info.in_chans, info.num_frames, info.image_size, info.image_size, device=device)

    def inputs(self, n: int) -> torch.Tensor:
        """The first ``n`` test clips (C, T, H, W); of several views, the middle one (the centre crop)."""
        import torch

        test = self.test_set()
        clips = [test[i][0] for i in range(min(n, len(test)))]
        return torch.stack([c[c.shape[0] // 2] if c.ndim == 5 else c for c in clips])

    def line(self, record: dict[str, Any]) -> str:
        return (f"train_loss {record['train_loss']:.4f}  test_loss {record['test_loss']:.4f}  top1 "
                f"{record['top1']:.2f}  top5 {record['top5']:.2f}  mca {record['mean_class_accuracy']:.2f}  "
                f"{record['clips_per_s']:.1f} clips/s")


__all__ = ["VideoClassification", "VideoConfig"]
