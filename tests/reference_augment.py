"""The NS-Attn CIFAR recipe sample by sample, through torchvision's and timm's own transforms, with given parameters.

Imports nothing from attnlab. Each function takes the random parameters as arguments, so a batched implementation
can be checked image by image: the random draws are replaced, never the operations.
"""

from __future__ import annotations

from unittest import mock

import torch
import torchvision.transforms as T
import torchvision.transforms.functional as TF
from timm.data import Mixup


def crop_flip(img: torch.Tensor, i: int, j: int, flip: bool, padding: int, fill: float = 0.0) -> torch.Tensor:
    """RandomCrop(H, padding, fill) returning the window at (i, j) of the padded image, then RandomHorizontalFlip."""
    h, w = img.shape[-2:]
    out = TF.crop(TF.pad(img, [padding], fill=fill), i, j, h, w)
    return TF.hflip(out) if flip else out


def auto_augment(img: torch.Tensor, policy_id: int, probs, signs) -> torch.Tensor:
    """torchvision's AutoAugment(CIFAR10).forward on one uint8 image, its get_params returning these values."""
    aa = T.AutoAugment(T.AutoAugmentPolicy.CIFAR10)
    params = (int(policy_id), torch.tensor([float(p) for p in probs]), torch.tensor([int(s) for s in signs]))
    with mock.patch.object(T.AutoAugment, "get_params", staticmethod(lambda n: params)):
        return aa(img)


def to_normalised(img: torch.Tensor, mean, std) -> torch.Tensor:
    """ToTensor on a uint8 CHW tensor (what ToTensor does to a PIL image's bytes) then Normalize."""
    return TF.normalize(img.float().div(255), list(mean), list(std))


def erase(img: torch.Tensor, i: int, j: int, h: int, w: int) -> torch.Tensor:
    """RandomErasing(value=0) with the box (i, j, h, w); h = 0 leaves the image untouched."""
    return TF.erase(img, i, j, h, w, torch.tensor(0.0)) if h > 0 else img


def mix(images: torch.Tensor, labels: torch.Tensor, lam: float, box, *, num_classes: int, smoothing: float):
    """timm's Mixup(mode='batch') with this lam (Mixup) or this CutMix box; returns (images, soft targets)."""
    mixer = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=1.0, switch_prob=0.5, mode="batch",
                  label_smoothing=smoothing, num_classes=num_classes)
    cutmix = box is not None
    with mock.patch.object(mixer, "_params_per_batch", lambda: (lam if not cutmix else 0.5, cutmix)), \
            mock.patch("timm.data.mixup.rand_bbox", lambda *a, **k: box):
        return mixer(images.clone(), labels)
