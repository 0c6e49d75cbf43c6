"""Augmented CIFAR images per second: the device pipeline against the torchvision/timm loader, in one run.

Both run the full recipe on the same uint8 images (random CIFAR-sized pixels): RandomCrop(32, 4), flip, CIFAR10
AutoAugment, normalise, RandomErasing(0.25), timm's Mixup/CutMix, repeated augmentation (3). The reference is
attnlab's CPU path: PIL transforms in a DataLoader with ``--threads`` worker processes, Mixup in the main process.
The device pipeline runs with ``torch.set_num_threads(--threads)`` on ``--device``. An epoch is timed whole (the
reference's worker start-up included, as in training); rounds alternate the order, the median is reported.

    python benchmarks/data_pipeline.py                       # 2 threads, CPU tensors
    python benchmarks/data_pipeline.py --threads 1 --images 5000
    python benchmarks/data_pipeline.py --device cuda --threads 8
    python benchmarks/data_pipeline.py --libraries           # also kornia and torchvision v2 on batched tensors
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from attnlab.data.cifar import CIFAR100_MEAN, CIFAR100_STD, cifar_transform
from attnlab.data.device_pipeline import AugmentRecipe, DevicePipeline


class PixelDataset(Dataset):
    """uint8 (n, 32, 32, 3) pixels served as torchvision's CIFAR does: a PIL image through the transform."""

    def __init__(self, pixels: np.ndarray, labels: np.ndarray, transform):
        self.pixels, self.labels, self.transform = pixels, labels, transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int):
        return self.transform(Image.fromarray(self.pixels[i])), int(self.labels[i])


def reference_epoch(pixels, labels, args, epoch: int) -> float:
    from timm.data import Mixup
    from timm.data.distributed_sampler import RepeatAugSampler

    ds = PixelDataset(pixels, labels, cifar_transform(True, "recipe", CIFAR100_MEAN, CIFAR100_STD))
    sampler = RepeatAugSampler(ds, num_replicas=1, rank=0, shuffle=True, num_repeats=3)
    sampler.set_epoch(epoch)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, prob=0.5, switch_prob=0.5, mode="batch", label_smoothing=0.1,
                  num_classes=100)
    loader = DataLoader(ds, batch_size=args.batch_size, sampler=sampler, drop_last=True, num_workers=args.threads)
    start, seen = time.perf_counter(), 0
    for x, y in loader:
        x, y = mixup(x, y)
        seen += x.shape[0]
    return seen / (time.perf_counter() - start)


def device_epoch(pipe: DevicePipeline, epoch: int) -> float:
    start, seen = time.perf_counter(), 0
    for batch in pipe.epoch(epoch):
        seen += batch.images.shape[0]
    if pipe.device.type == "cuda":
        torch.cuda.synchronize(pipe.device)
    return seen / (time.perf_counter() - start)


def libraries(pixels, args) -> None:
    """kornia's and torchvision v2's recipe on one batched tensor: what a maintained library gives."""
    device = torch.device(args.device)
    x = torch.from_numpy(pixels[: args.batch_size]).permute(0, 3, 1, 2).contiguous().to(device)
    rows = []
    try:
        import kornia.augmentation as K
        from kornia.augmentation.auto import AutoAugment

        aug = K.AugmentationSequential(K.RandomCrop((32, 32), padding=4), K.RandomHorizontalFlip(),
                                       AutoAugment("cifar10"), K.RandomErasing(p=0.25))
        rows.append(("kornia AugmentationSequential + AutoAugment('cifar10')",
                     lambda: aug(x.float().div(255)), "crop, flip, erasing yes; sub-policy no (one per batch)"))
    except ImportError:
        print("# kornia is not installed (pip install kornia); skipped")
    from torchvision.transforms import v2

    tv = v2.Compose([v2.RandomCrop(32, padding=4), v2.RandomHorizontalFlip(), v2.AutoAugment(v2.AutoAugmentPolicy.CIFAR10),
                     v2.ToDtype(torch.float32, scale=True), v2.Normalize(CIFAR100_MEAN, CIFAR100_STD),
                     v2.RandomErasing(0.25)])
    rows.append(("torchvision v2 Compose on a (B, C, H, W) tensor", lambda: tv(x), "no: one draw per batch"))
    print("| library | img/s | per sample |")
    print("|---|---:|---|")
    for name, fn, per_sample in rows:
        fn()
        start, n = time.perf_counter(), 0
        while time.perf_counter() - start < 2.0:
            fn()
            n += args.batch_size
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        print(f"| {name} | {n / (time.perf_counter() - start):.0f} | {per_sample} |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="loader workers / torch threads of the device pipeline")
    p.add_argument("--images", type=int, default=10_000)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--device", default="cpu")
    p.add_argument("--chunk", type=int, default=8192, help="images the device pipeline augments together")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--libraries", action="store_true", help="also time kornia and torchvision v2 on a batch")
    args = p.parse_args()

    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    pixels = rng.integers(0, 256, (args.images, 32, 32, 3), dtype=np.uint8)
    labels = rng.integers(0, 100, args.images)
    pipe = DevicePipeline(torch.from_numpy(pixels).permute(0, 3, 1, 2), labels, num_classes=100,
                          batch_size=args.batch_size, device=args.device, mean=CIFAR100_MEAN, std=CIFAR100_STD,
                          recipe=AugmentRecipe(), seed=0, repeated_aug=3, chunk=args.chunk)
    print(f"# {datetime.date.today()} torch {torch.__version__}, {platform.machine()} {platform.processor()}, "
          f"threads {args.threads}, device {args.device}, {args.images} images, batch {args.batch_size}")
    device_epoch(pipe, 0)  # first calls (imports, kernels) out of the timing
    rates: dict[str, list[float]] = {"torchvision/timm loader": [], "device pipeline": []}
    for r in range(args.rounds):
        runs = [("torchvision/timm loader", lambda: reference_epoch(pixels, labels, args, r + 1)),
                ("device pipeline", lambda: device_epoch(pipe, r + 1))]
        for name, run in runs if r % 2 == 0 else runs[::-1]:
            rates[name].append(run())
    base = statistics.median(rates["torchvision/timm loader"])
    print("| pipeline | img/s (median of rounds) | per thread | ratio |")
    print("|---|---:|---:|---:|")
    for name, values in rates.items():
        med = statistics.median(values)
        print(f"| {name} | {med:.0f} | {med / args.threads:.0f} | {med / base:.2f} |", flush=True)
    if args.libraries:
        libraries(pixels, args)


if __name__ == "__main__":
    main()
