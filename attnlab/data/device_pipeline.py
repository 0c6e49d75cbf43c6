"""Device-resident training data: the NS-Attn recipe's augmentation, per sample, on batched tensors.

The train split lives on one device (CIFAR as uint8 (n, 3, 32, 32)); each epoch :class:`DevicePipeline` yields
full batches ``(images, targets, labels)`` built there, sample by sample in the order of ``cifar_transform``:

1. RandomCrop(32, padding=4, fill 0) and RandomHorizontalFlip(0.5): one gather per chunk, the offsets
   (i, j) ~ U{0..2p} and the flip drawn per sample.
2. AutoAugment(CIFAR10 policy), NEAREST, fill 0 (torchvision's ``AutoAugment.forward``): per sample a sub-policy
   k ~ U{0..24}, and for op s = 1, 2 of it ``u_s <= p_s`` decides whether it applies, a fair coin its sign when
   signed; the magnitude is bin m of torchvision's 10-bin table. Samples are grouped by (op, magnitude, sign),
   at most a few dozen groups per stage, and each colour group goes through torchvision's own functional op as
   one batch; the geometric ops (Shear, Translate, Rotate) of a stage go through one ``grid_sample`` with one
   grid per sample, built with torchvision's inverse affine matrix and grid arithmetic. Every image is exactly
   what torchvision gives it (no loop over samples).
3. ToTensor + Normalize: x = (u / 255 - mean) / std.
4. RandomErasing(p=0.25, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0): per sample up to 10 attempts
   (area ~ U(scale) * H * W, log r ~ U(log ratio), h = round(sqrt(area r)), w = round(sqrt(area / r)), the first
   with h < H and w < W wins), then i ~ U{0..H-h}, j ~ U{0..W-w}; no erasing if no attempt fits.
5. Mixup / CutMix per batch with timm's ``Mixup(mode="batch")`` numbers: with probability ``mix_prob`` the batch
   is mixed with its reverse, by CutMix with probability ``switch_prob`` (lam ~ Beta(cutmix, cutmix), a box of
   side H sqrt(1 - lam) centred uniformly and clipped, lam corrected to the kept area), else by Mixup
   (lam ~ Beta(mixup, mixup)); targets are smoothed one-hots, y = lam y_i + (1 - lam) y_{B-1-i}, with
   off = smoothing / K and on = 1 - smoothing + off.

Sample order is timm's ``RepeatAugSampler`` (each image ``repeated_aug`` times in a row, the epoch length kept,
``num_replicas``/``rank`` for DDP) shuffled with the seed ``SeedSequence([seed, epoch])``, as the CPU loader does;
with ``repeated_aug=1`` a permutation from the same seed, strided by rank. Every random parameter is drawn on the
host from ``numpy.random.default_rng([seed, epoch, rank])``, so an epoch's images are a function of
(seed, epoch, rank) alone (what resume and DDP need), and CPU and CUDA draw the same parameters. A chunk's
parameters reach the device in one copy (:func:`host_to_device`) and nothing in the chunk path reads the device:
the host never waits for it. Numbers and measurements: ``docs/perf.md``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torchvision.transforms import AutoAugment, AutoAugmentPolicy

from attnlab.errors import ConfigError, DatasetError

# torchvision's AutoAugment(CIFAR10) sub-policies: ((op, probability, magnitude bin), (op, probability, bin)) each.
CIFAR10_POLICY = tuple(AutoAugment(AutoAugmentPolicy.CIFAR10).policies)
NUM_BINS = 10


@functools.lru_cache(maxsize=64)  # asked 50 times a batch (2 stages x 25 sub-policies), once per image size
def magnitudes(op: str, height: int, width: int) -> tuple[tuple[float, ...], bool]:
    """(the 10 magnitudes of ``op``, whether its sign is random): torchvision's ``_augmentation_space(10, (H, W))``
    (float32, as torchvision draws them), zeros for the ops without a magnitude."""
    mags, signed = AutoAugment()._augmentation_space(NUM_BINS, (height, width)).get(op, (torch.tensor(0.0), False))
    return tuple(mags.tolist() if mags.ndim else [0.0] * NUM_BINS), signed


def apply_op(images: torch.Tensor, op: str, magnitude: float) -> torch.Tensor:
    """torchvision's ``autoaugment._apply_op`` (NEAREST, fill None = 0) on uint8 (B, C, H, W), one magnitude for all.

    torchvision's functional ops treat leading dimensions as a batch, image by image (per-image means, ranges and
    histograms); equalize uses the v2 kernel, which is vectorised over the batch where v1 loops in Python,
    sharpness :func:`adjust_sharpness`, the same numbers without a depthwise convolution, and the geometric ops
    :func:`warp_nearest` (torchvision's grid, without its tensor built from a Python list per call).
    """
    import torchvision.transforms.functional as TF
    import torchvision.transforms.v2.functional as TF2

    if op in GEOMETRIC:  # torchvision's TF.affine / TF.rotate, the grid built as in warp_nearest
        theta = torch.from_numpy(affine_thetas([op], [magnitude], *images.shape[-2:])).to(images.device)
        return warp_nearest(images, theta.expand(images.shape[0], 3, 2))
    colour = {
        "Brightness": lambda: TF.adjust_brightness(images, 1.0 + magnitude),
        "Color": lambda: TF.adjust_saturation(images, 1.0 + magnitude),
        "Contrast": lambda: TF.adjust_contrast(images, 1.0 + magnitude),
        "Sharpness": lambda: adjust_sharpness(images, 1.0 + magnitude),
        "Posterize": lambda: TF.posterize(images, int(magnitude)),
        "Solarize": lambda: TF.solarize(images, magnitude),
        "AutoContrast": lambda: TF.autocontrast(images),
        "Equalize": lambda: TF2.equalize(images),
        "Invert": lambda: TF.invert(images),
    }
    if op in colour:
        return colour[op]()
    raise ValueError(f"unknown AutoAugment op {op!r}")


GEOMETRIC = ("ShearX", "ShearY", "TranslateX", "TranslateY", "Rotate")


def affine_thetas(ops, magnitudes, height: int, width: int) -> np.ndarray:
    """(m, 3, 2) float32: each (op, signed magnitude)'s inverse affine matrix as ``TF.affine`` / ``TF.rotate`` form
    it for ``_apply_op`` (torchvision's ``_get_inverse_affine_matrix`` in float64, rounded to float32), transposed
    and divided by (W / 2, H / 2) in float32, as torchvision's ``_gen_affine_grid`` scales it before its product."""
    from torchvision.transforms.functional import _get_inverse_affine_matrix

    rows = []
    for op, magnitude in zip(ops, magnitudes):
        if op in ("ShearX", "ShearY"):  # _apply_op shears about center=[0, 0], which TF.affine moves by -(W/2, H/2)
            angle = math.degrees(math.atan(magnitude))
            shear = [angle, 0.0] if op == "ShearX" else [0.0, angle]
            rows.append(_get_inverse_affine_matrix([-0.5 * width, -0.5 * height], 0.0, [0.0, 0.0], 1.0, shear))
        elif op in ("TranslateX", "TranslateY"):
            shift = [float(int(magnitude)), 0.0] if op == "TranslateX" else [0.0, float(int(magnitude))]
            rows.append(_get_inverse_affine_matrix([0.0, 0.0], 0.0, shift, 1.0, [0.0, 0.0]))
        elif op == "Rotate":  # TF.rotate negates the angle
            rows.append(_get_inverse_affine_matrix([0.0, 0.0], -magnitude, [0.0, 0.0], 1.0, [0.0, 0.0]))
        else:
            raise ValueError(f"{op!r} is not a geometric AutoAugment op")
    theta = np.asarray(rows, dtype=np.float64).astype(np.float32).reshape(-1, 2, 3)
    return (theta.transpose(0, 2, 1) / np.array([0.5 * width, 0.5 * height], dtype=np.float32)).astype(np.float32)


def _base_grid(height: int, width: int, device) -> torch.Tensor:
    """(1, H W, 3) pixel-centre coordinates and ones: torchvision's ``_gen_affine_grid`` base grid, term by term."""
    base = torch.empty(1, height, width, 3, dtype=torch.float32, device=device)
    base[..., 0].copy_(torch.linspace(-width * 0.5 + 0.5, width * 0.5 + 0.5 - 1, steps=width, device=device))
    base[..., 1].copy_(torch.linspace(-height * 0.5 + 0.5, height * 0.5 + 0.5 - 1, steps=height,
                                      device=device).unsqueeze_(-1))
    base[..., 2].fill_(1)
    return base.view(1, height * width, 3)


def warp_nearest(images: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Each uint8 image (m, C, H, W) resampled through its own grid, nearest, zeros outside: torchvision's
    ``_apply_grid_transform`` with ``fill=None``; ``theta`` (m, 3, 2) float32 from :func:`affine_thetas`."""
    m, _, height, width = images.shape
    grid = _base_grid(height, width, images.device).expand(m, height * width, 3).bmm(theta)
    out = F.grid_sample(images.float(), grid.view(m, height, width, 2), mode="nearest", padding_mode="zeros",
                        align_corners=False)
    return out.round_().to(images.dtype)


# ------------------------------------------------------------------------------------------ per-sample params
@dataclass(frozen=True)
class AugmentRecipe:
    """The augmentation numbers, named as ``TrainConfig`` and ``cifar_transform`` name them.

    ``crop_padding`` 0 and ``flip`` 0 switch crop and flip off; ``random_erasing`` is a probability; mixing is on
    when ``mix_prob > 0`` and ``mixup`` or ``cutmix`` is positive (``attnlab.train.tasks.classify.ImageConfig.mixing``).
    """

    crop_padding: int = 4
    flip: float = 0.5
    auto_augment: bool = True
    random_erasing: float = 0.25
    mixup: float = 0.8
    cutmix: float = 1.0
    mix_prob: float = 0.5
    switch_prob: float = 0.5
    label_smoothing: float = 0.1
    erasing_scale: tuple[float, float] = (0.02, 0.33)
    erasing_ratio: tuple[float, float] = (0.3, 3.3)

    @classmethod
    def plain(cls, **mixing) -> "AugmentRecipe":
        """No per-image augmentation; Mixup/CutMix from ``mixing`` (mixup, cutmix, mix_prob, ...) or the defaults."""
        return cls(crop_padding=0, flip=0.0, auto_augment=False, random_erasing=0.0, **mixing)

    @property
    def mixing(self) -> bool:
        return self.mix_prob > 0 and (self.mixup > 0 or self.cutmix > 0)

    def check(self) -> None:
        for key in ("flip", "random_erasing", "mix_prob", "switch_prob", "label_smoothing"):
            value = getattr(self, key)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"{key}={value} is not a probability; use a number between 0 and 1")
        for key in ("crop_padding", "mixup", "cutmix"):
            if getattr(self, key) < 0:
                raise ConfigError(f"{key}={getattr(self, key)} is negative; use 0 to switch it off")


def draw_params(rng: np.random.Generator, n: int, height: int, width: int, recipe: AugmentRecipe,
                erase_size: tuple[int, int] | None = None) -> dict[str, np.ndarray]:
    """Every per-sample random number of steps 1-4 for ``n`` samples (module docstring), drawn on the host.

    ``erase_size``: (H, W) the erasing box is drawn for, when a resize makes it differ from (height, width).
    """
    p = recipe.crop_padding
    out = {
        "crop_i": rng.integers(0, 2 * p + 1, n), "crop_j": rng.integers(0, 2 * p + 1, n),
        "flip": rng.random(n) < recipe.flip,
        "policy": rng.integers(0, len(CIFAR10_POLICY), n), "op_u": rng.random((n, 2)),
        "op_sign": rng.integers(0, 2, (n, 2)),
    }
    height, width = erase_size or (height, width)
    area = height * width * rng.uniform(*recipe.erasing_scale, (n, 10))
    ratio = np.exp(rng.uniform(math.log(recipe.erasing_ratio[0]), math.log(recipe.erasing_ratio[1]), (n, 10)))
    h, w = np.round(np.sqrt(area * ratio)).astype(np.int64), np.round(np.sqrt(area / ratio)).astype(np.int64)
    fits = (h < height) & (w < width)
    first = fits.argmax(1)
    erase = (rng.random(n) < recipe.random_erasing) & fits.any(1)
    eh, ew = np.where(erase, h[np.arange(n), first], 0), np.where(erase, w[np.arange(n), first], 0)
    u = rng.random((n, 2))
    out.update(erase_h=eh, erase_w=ew, erase_i=(u[:, 0] * (height - eh + 1)).astype(np.int64),
               erase_j=(u[:, 1] * (width - ew + 1)).astype(np.int64))
    return out


def draw_mix(rng: np.random.Generator, height: int, width: int, recipe: AugmentRecipe) -> tuple[float, tuple | None]:
    """(lam, CutMix box (yl, yh, xl, xh) or None) for one batch: timm's ``Mixup._params_per_batch`` and
    ``cutmix_bbox_and_lam`` (correct_lam=True)."""
    if not recipe.mixing or rng.random() >= recipe.mix_prob:
        return 1.0, None
    cutmix = bool(rng.random() < recipe.switch_prob) if recipe.mixup > 0 and recipe.cutmix > 0 else recipe.cutmix > 0
    alpha = recipe.cutmix if cutmix else recipe.mixup
    lam = float(rng.beta(alpha, alpha))
    if not cutmix:
        return lam, None
    return cutmix_box(lam, int(rng.integers(0, height)), int(rng.integers(0, width)), height, width)


def cutmix_box(lam: float, cy: int, cx: int, height: int, width: int) -> tuple[float, tuple[int, int, int, int]]:
    """(lam corrected to the box's area, (yl, yh, xl, xh)): timm's ``rand_bbox`` centred at (cy, cx)."""
    ratio = math.sqrt(1.0 - lam)
    cut_h, cut_w = int(height * ratio), int(width * ratio)
    yl, yh = min(max(cy - cut_h // 2, 0), height), min(max(cy + (cut_h + 1) // 2, 0), height)
    xl, xh = min(max(cx - cut_w // 2, 0), width), min(max(cx + (cut_w + 1) // 2, 0), width)
    return 1.0 - (yh - yl) * (xh - xl) / float(height * width), (yl, yh, xl, xh)


# ------------------------------------------------------------------------------------------ batched ops
def crop_flip(images: torch.Tensor, i: torch.Tensor, j: torch.Tensor, flip_rows: torch.Tensor, padding: int,
              fill: float = 0.0) -> torch.Tensor:
    """RandomCrop(H, padding, fill) at offsets (i, j) of the padded image, then a horizontal flip of ``flip_rows``.

    images: (B, C, H, W) any dtype; i, j: (B,) int64 in 0..2 padding; flip_rows: int64 indices into the batch.
    """
    b, _, h, w = images.shape
    out = images
    if padding:
        windows = F.pad(images, (padding,) * 4, value=fill).unfold(2, h, 1).unfold(3, w, 1)  # a view
        out = windows[torch.arange(b, device=images.device), :, i, j]
    if flip_rows.numel():
        out = out.index_copy(0, flip_rows, out.index_select(0, flip_rows).flip(-1))
    return out


def adjust_sharpness(images: torch.Tensor, factor: float) -> torch.Tensor:
    """torchvision's ``adjust_sharpness`` on uint8 (B, C, H, W), in integer arithmetic.

    The smoothed image is round(S / 13) with S the 3x3 sum weighted 5 at the centre (border pixels kept);
    S / 13 is never a half, so floor((2 S + 13) / 26) is exactly torchvision's rounded float convolution, and
    costs far less than its depthwise conv2d on the CPU.
    """
    if images.shape[-1] <= 2 or images.shape[-2] <= 2:
        return images
    x = images.to(torch.int16)  # 13 * 255 * 2 + 13 < 2 ** 15
    s = (x[..., :-2, :-2] + x[..., :-2, 1:-1] + x[..., :-2, 2:] + x[..., 1:-1, :-2] + 5 * x[..., 1:-1, 1:-1]
         + x[..., 1:-1, 2:] + x[..., 2:, :-2] + x[..., 2:, 1:-1] + x[..., 2:, 2:])
    smooth = images.clone()
    smooth[..., 1:-1, 1:-1] = torch.div(2 * s + 13, 26, rounding_mode="floor").to(torch.uint8)
    ratio = float(factor)  # torchvision's _blend, term by term
    return (ratio * images + (1.0 - ratio) * smooth).clamp(0, 255).to(torch.uint8)


def plan_auto_augment(policy: np.ndarray, op_u: np.ndarray, op_sign: np.ndarray, height: int,
                      width: int) -> list[tuple[list[tuple[str, float, np.ndarray]], np.ndarray, np.ndarray]]:
    """Per stage of AutoAugment(CIFAR10), on the host: the colour groups ``[(op, signed magnitude, rows)]`` and the
    geometric samples ``(rows, thetas (m, 3, 2))`` (:func:`affine_thetas`); samples that skip the stage appear in
    neither. policy: (B,) sub-policy ids; op_u: (B, 2) uniforms, op s applies where u_s <= p_s; op_sign: (B, 2),
    0 = negative."""
    stages = []
    for stage in range(2):
        # (op, signed magnitude) -> the samples that apply it; sub-policies sharing an op and bin share one group
        groups: dict[tuple[str, float], np.ndarray] = {}
        for k, sub in enumerate(CIFAR10_POLICY):
            name, prob, bin_ = sub[stage]
            mags, signed = magnitudes(name, height, width)
            magnitude = mags[bin_] if bin_ is not None else 0.0
            hit = (policy == k) & (op_u[:, stage] <= prob)
            for sign in (0, 1) if signed else (1,):
                rows = hit & (op_sign[:, stage] == sign) if signed else hit
                what = (name, -magnitude if sign == 0 else magnitude)
                groups[what] = groups[what] | rows if what in groups else rows
        colour, geo_rows, geo_thetas = [], [np.zeros(0, np.int64)], [np.zeros((0, 3, 2), np.float32)]
        for (name, magnitude), rows in groups.items():
            at = np.flatnonzero(rows)
            if not len(at):
                continue
            if name in GEOMETRIC:
                geo_rows.append(at)
                geo_thetas.append(np.repeat(affine_thetas([name], [magnitude], height, width), len(at), axis=0))
            else:
                colour.append((name, magnitude, at))
        stages.append((colour, np.concatenate(geo_rows), np.concatenate(geo_thetas)))
    return stages


def plan_arrays(stages) -> dict[str, np.ndarray]:
    """The host arrays of a :func:`plan_auto_augment` plan, named for :func:`apply_auto_augment`."""
    out = {}
    for s, (colour, rows, thetas) in enumerate(stages):
        out.update({f"aa{s}_{k}": at for k, (_, _, at) in enumerate(colour)})
        out.update({f"aa{s}_geo": rows, f"aa{s}_theta": thetas})
    return out


def apply_auto_augment(images: torch.Tensor, stages, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
    """The plan on uint8 (B, C, H, W) images, in place; ``arrays``: :func:`plan_arrays` on the images' device."""
    for s, (colour, _, _) in enumerate(stages):
        for k, (name, magnitude, _) in enumerate(colour):
            at = arrays[f"aa{s}_{k}"]
            images.index_copy_(0, at, apply_op(images.index_select(0, at), name, magnitude))
        at = arrays[f"aa{s}_geo"]
        if at.numel():  # a shape, known on the host
            images.index_copy_(0, at, warp_nearest(images.index_select(0, at), arrays[f"aa{s}_theta"]))
    return images


def auto_augment(images: torch.Tensor, policy: np.ndarray, op_u: np.ndarray, op_sign: np.ndarray) -> torch.Tensor:
    """torchvision's AutoAugment(CIFAR10) with per-sample (sub-policy, u, sign); uint8 (B, C, H, W), in place
    (arguments as :func:`plan_auto_augment`)."""
    stages = plan_auto_augment(policy, op_u, op_sign, *images.shape[-2:])
    return apply_auto_augment(images, stages, host_to_device(plan_arrays(stages), images.device))


def host_to_device(arrays: dict[str, np.ndarray], device) -> dict[str, torch.Tensor]:
    """Host arrays (integers as int64, floats as float32) on ``device`` through ONE buffer and one non-blocking copy
    (pinned on CUDA, so that the copy does not wait for the host): every copy from pageable memory or from a Python
    list would be a transfer of its own, and a blocking one."""
    device = torch.device(device)
    words, spans, at = [], {}, 0
    for key, a in arrays.items():
        a = np.asarray(a)
        floating = a.dtype.kind == "f"
        if floating:  # float32 pairs stored as int64 words, viewed back as float32 on the device
            flat = np.ascontiguousarray(a, dtype=np.float32).reshape(-1)
            w = np.concatenate([flat, np.zeros(flat.size % 2, np.float32)]).view(np.int64)
        else:
            w = np.ascontiguousarray(a, dtype=np.int64).reshape(-1)
        spans[key] = (at, w.size, a.shape, floating)
        words.append(w)
        at += w.size
    host = torch.from_numpy(np.concatenate(words) if words else np.zeros(0, np.int64))
    if device.type == "cuda":
        host = host.pin_memory()
    buf = host.to(device, non_blocking=True)
    out = {}
    for key, (start, n, shape, floating) in spans.items():
        t = buf[start:start + n]
        out[key] = (t.view(torch.float32)[:math.prod(shape)] if floating else t).view(shape)
    return out


def random_erase(images: torch.Tensor, i: torch.Tensor, j: torch.Tensor, h: torch.Tensor, w: torch.Tensor,
                 value: float = 0.0) -> torch.Tensor:
    """Set the box rows i..i+h-1, columns j..j+w-1 of each image to ``value`` (h = 0: untouched); in place.

    images: (B, C, H, W) float; i, j, h, w: (B,) int64 on the images' device.
    """
    _, _, height, width = images.shape
    r = torch.arange(height, device=images.device)
    c = torch.arange(width, device=images.device)
    in_rows = (r[None] >= i[:, None]) & (r[None] < (i + h)[:, None])
    in_cols = (c[None] >= j[:, None]) & (c[None] < (j + w)[:, None])
    return images.masked_fill_((in_rows[:, :, None] & in_cols[:, None, :])[:, None], value)


def mix_batch(images: torch.Tensor, labels: torch.Tensor, lam: float, box: tuple | None, num_classes: int,
              smoothing: float) -> tuple[torch.Tensor, torch.Tensor]:
    """timm's ``Mixup._mix_batch`` and ``mixup_target``: images mixed with their reverse in place, soft targets."""
    if lam != 1.0:
        if box is not None:
            yl, yh, xl, xh = box
            images[:, :, yl:yh, xl:xh] = images.flip(0)[:, :, yl:yh, xl:xh]
        else:
            flipped = images.flip(0).mul_(1.0 - lam)
            images.mul_(lam).add_(flipped)
    from timm.data.mixup import mixup_target

    return images, mixup_target(labels, num_classes, lam, smoothing)


# ------------------------------------------------------------------------------------------ the pipeline
def epoch_order(n: int, seed: int, epoch: int, *, repeated_aug: int = 1, num_replicas: int = 1,
                rank: int = 0) -> torch.Tensor:
    """This rank's sample indices of one epoch (int64 (m,)): timm's RepeatAugSampler, or a permutation."""
    order_seed = int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])  # = attnlab.train's epoch_seed
    if repeated_aug > 1:
        from timm.data.distributed_sampler import RepeatAugSampler

        sampler = RepeatAugSampler(range(n), num_replicas=num_replicas, rank=rank, shuffle=True,
                                   num_repeats=repeated_aug)
        sampler.set_epoch(order_seed)
        return torch.tensor(list(sampler), dtype=torch.int64)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(order_seed))
    return perm[rank:n - n % num_replicas:num_replicas]


class DeviceBatch(NamedTuple):
    images: torch.Tensor   # (B, C, H, W) float32, normalised
    targets: torch.Tensor  # (B, K) float soft targets when mixing, else (B,) int64 labels
    labels: torch.Tensor   # (B,) int64, the unmixed labels (for training accuracy)


class DevicePipeline:
    """The train split on ``device`` and the recipe applied there per sample; one epoch is ``pipeline.epoch(e)``.

    Args:
        images: (n, C, H, W) uint8 pixels, or float32 already normalised (digits, synthetic: crop, flip and
            erasing only, AutoAugment needs uint8).
        labels: n integers in 0..num_classes-1.
        mean, std: per-channel normalisation of pixels / 255 (ignored for float images).
        batch_size: images per batch on this rank; only full batches are yielded, as the CPU loader's drop_last.
        recipe: the augmentation numbers (:class:`AugmentRecipe`); ``None`` = no augmentation and no mixing.
        seed, repeated_aug, num_replicas, rank: the sample order and the random streams (module docstring).
        pad_value: what the crop's padding holds, in the stored units (0 = black for uint8).
        out_size: resize after AutoAugment (``image_size`` other than the stored size; bilinear, antialiased).
        chunk: images augmented together (a multiple of batch_size; larger amortises per-group calls).
    """

    def __init__(self, images: torch.Tensor, labels, *, num_classes: int, batch_size: int, device="cpu",
                 mean=None, std=None, recipe: AugmentRecipe | None = None, seed: int = 0, repeated_aug: int = 1,
                 num_replicas: int = 1, rank: int = 0, pad_value: float = 0.0, out_size: int | None = None,
                 chunk: int = 8192):
        self.device = torch.device(device)
        self.recipe = recipe if recipe is not None else AugmentRecipe.plain(mix_prob=0.0)
        self.recipe.check()
        if images.ndim != 4:
            raise DatasetError(f"device pipeline images have shape {tuple(images.shape)}; expected (n, C, H, W)")
        self.raw = images.dtype == torch.uint8
        if self.recipe.auto_augment and not self.raw:
            raise ConfigError("AutoAugment works on uint8 pixels, but these images are float; switch auto_augment off")
        if int(batch_size) < 1 or (self.recipe.mixing and int(batch_size) % 2):
            raise ConfigError(f"batch_size is {batch_size}; use a positive{' even' if self.recipe.mixing else ''} "
                              f"number (Mixup/CutMix pair each image with the batch reversed)")
        if not (0 <= int(rank) < int(num_replicas)):
            raise ConfigError(f"rank {rank} is outside 0..{int(num_replicas) - 1} of {num_replicas} replicas")
        self.images = images.to(self.device).contiguous()
        self.labels = torch.as_tensor(list(labels) if not torch.is_tensor(labels) else labels,
                                      dtype=torch.int64).to(self.device)
        if self.labels.shape[0] != self.images.shape[0]:
            raise DatasetError(f"{self.images.shape[0]} images but {self.labels.shape[0]} labels")
        c = self.images.shape[1]
        mean = torch.tensor(mean if mean is not None else (0.0,) * c, dtype=torch.float32)
        std = torch.tensor(std if std is not None else (1.0,) * c, dtype=torch.float32)
        self.mean, self.std = mean.view(1, c, 1, 1).to(self.device), std.view(1, c, 1, 1).to(self.device)
        self.num_classes, self.batch_size = int(num_classes), int(batch_size)
        self.seed, self.repeated_aug = int(seed), int(repeated_aug)
        self.num_replicas, self.rank = int(num_replicas), int(rank)
        self.pad_value, self.out_size = float(pad_value), out_size
        self.chunk = max(1, int(chunk) // self.batch_size) * self.batch_size
        self.samples_per_epoch = len(epoch_order(self.images.shape[0], self.seed, 0, repeated_aug=self.repeated_aug,
                                                 num_replicas=self.num_replicas, rank=self.rank))
        if len(self) == 0:
            raise ConfigError(f"batch_size {self.batch_size} is larger than the {self.samples_per_epoch} training "
                              f"images of an epoch; use a smaller batch size.")

    def __len__(self) -> int:
        """Batches per epoch (full batches only)."""
        return self.samples_per_epoch // self.batch_size

    def epoch(self, epoch: int) -> Iterator[DeviceBatch]:
        """The batches of epoch ``epoch``: a function of (seed, epoch, rank) alone."""
        order = epoch_order(self.images.shape[0], self.seed, epoch, repeated_aug=self.repeated_aug,
                            num_replicas=self.num_replicas, rank=self.rank)
        order = order[:len(order) // self.batch_size * self.batch_size]
        rng = np.random.default_rng([self.seed, epoch, self.rank])
        for start in range(0, len(order), self.chunk):
            index = order[start:start + self.chunk]
            images, labels = self.augment(index, rng)
            for b in range(0, len(index), self.batch_size):
                x, y = images[b:b + self.batch_size], labels[b:b + self.batch_size]
                if self.recipe.mixing:
                    lam, box = draw_mix(rng, x.shape[-2], x.shape[-1], self.recipe)
                    x, targets = mix_batch(x, y, lam, box, self.num_classes, self.recipe.label_smoothing)
                else:
                    targets = y
                yield DeviceBatch(x, targets, y)

    def augment(self, index: torch.Tensor, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """Steps 1-4 on the images ``index``: (float normalised (m, C, H', W'), labels (m,)).

        On the CPU the chunk is split among ``torch.get_num_threads()`` Python threads, each running its ops on one
        intra-op thread: the ops are small, and OpenMP's hand-offs between them cost more than they save.
        """
        height, width = self.images.shape[-2:]
        size = self.out_size or height
        p = draw_params(rng, len(index), height, width, self.recipe, erase_size=(size, size))
        threads = torch.get_num_threads()
        if self.device.type != "cpu" or threads == 1 or len(index) < 2 * threads:
            return self._augment(index, p)
        from concurrent.futures import ThreadPoolExecutor

        bounds = np.linspace(0, len(index), threads + 1).astype(int)
        parts = [(index[a:b], {k: v[a:b] for k, v in p.items()}) for a, b in zip(bounds[:-1], bounds[1:])]
        torch.set_num_threads(1)
        try:
            with ThreadPoolExecutor(threads) as pool:
                done = list(pool.map(lambda part: self._augment(*part), parts))
        finally:
            torch.set_num_threads(threads)
        return torch.cat([x for x, _ in done]), torch.cat([y for _, y in done])

    def _augment(self, index: torch.Tensor, p: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.recipe
        height, width = self.images.shape[-2:]
        size = self.out_size or height
        arrays = {"index": index.numpy(), "crop_i": p["crop_i"], "crop_j": p["crop_j"],
                  "flip": np.flatnonzero(p["flip"])}
        stages = plan_auto_augment(p["policy"], p["op_u"], p["op_sign"], height, width) if r.auto_augment else []
        arrays.update(plan_arrays(stages))
        if r.random_erasing > 0:
            arrays.update({f"erase_{k}": p[f"erase_{k}"] for k in "ijhw"})
        on = host_to_device(arrays, self.device)  # the chunk's one transfer
        x, labels = self.images.index_select(0, on["index"]), self.labels.index_select(0, on["index"])
        if r.crop_padding or r.flip:
            x = crop_flip(x, on["crop_i"], on["crop_j"], on["flip"], r.crop_padding, self.pad_value)
        if r.auto_augment:
            x = apply_auto_augment(x.contiguous(), stages, on)
        if size != height:
            import torchvision.transforms.functional as TF

            x = TF.resize(x, [size, size], antialias=True)
        if self.raw:
            x = x.float().div_(255).sub_(self.mean).div_(self.std)
        if r.random_erasing > 0:
            x = random_erase(x, on["erase_i"], on["erase_j"], on["erase_h"], on["erase_w"])
        return x, labels


def build_device_pipeline(name: str, *, device, batch_size: int, seed: int, data_dir="data", download: bool = False,
                          augment: str = "recipe", repeated_aug: int = 1, num_replicas: int = 1, rank: int = 0,
                          mixup: float = 0.8, cutmix: float = 1.0, mix_prob: float = 0.5, switch_prob: float = 0.5,
                          label_smoothing: float = 0.1, chunk: int = 8192, **options) -> DevicePipeline:
    """The train split of a device-resident dataset (its table entry's ``device`` function) on ``device``, with
    the augmentation ``build_dataset`` would apply (docs/training.md, "Device-resident data"); Mixup/CutMix take
    ``TrainConfig``'s numbers (``mixup``, ``cutmix``, ``mixup_prob``, ``mixup_switch_prob``, ``label_smoothing``)."""
    from attnlab.data.registry import dataset_info, device_data

    split = device_data(name, data_dir=data_dir, download=download, augment=augment, **options)
    info = dataset_info(name, data_dir=data_dir, **options)
    mixing = dict(mixup=float(mixup), cutmix=float(cutmix), mix_prob=float(mix_prob), switch_prob=float(switch_prob),
                  label_smoothing=float(label_smoothing))
    recipe = AugmentRecipe.plain(**mixing) if split.recipe is None else AugmentRecipe(**split.recipe, **mixing)
    return DevicePipeline(split.images, split.labels, num_classes=info.num_classes, batch_size=batch_size,
                          device=device, recipe=recipe, seed=seed, repeated_aug=repeated_aug,
                          num_replicas=num_replicas, rank=rank, chunk=chunk, **split.extra)
