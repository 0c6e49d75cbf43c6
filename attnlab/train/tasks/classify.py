"""Classification: images (the NS-Attn paper's CIFAR recipe and its variations) and token sequences (LRA).

A batch is ``(inputs, targets, labels)`` on the device: ``targets`` are the labels, or soft targets when Mixup /
CutMix mix the batch (label smoothing folded in); accuracy is counted against the unmixed ``labels``. Images come
from torchvision/timm transforms in DataLoader workers (the reference) or from the device-resident pipeline
(``data_on_device``); token sequences from the CPU loader. Evaluation: test loss (plain cross-entropy), top-1 and
top-5 accuracy in percent.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from attnlab.errors import ConfigError
from attnlab.train.section import Section, at_least, non_negative, option, within

from .base import Task

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

SMOOTHING_HELP = "label smoothing of the (mixed) targets"


@dataclass(frozen=True)
class ImageConfig(Section):
    """image: keys of image classification runs (defaults: the NS-Attn paper's CIFAR recipe, Sec. 3.1)."""

    augment: str = option("recipe", "'recipe' (AutoAugment, crop, flip, random erasing) or 'none'",
                          choices=("recipe", "none"))
    label_smoothing: float = option(0.1, SMOOTHING_HELP, within(0, 1))
    mixup: float = option(0.8, "Mixup beta alpha (0 disables Mixup)", non_negative)
    cutmix: float = option(1.0, "CutMix beta alpha (0 disables CutMix)", non_negative)
    mixup_prob: float = option(0.5, "probability that a batch is mixed (Mixup or CutMix)", within(0, 1))
    mixup_switch_prob: float = option(0.5, "probability of CutMix rather than Mixup when a batch is mixed",
                                      within(0, 1))
    repeated_aug: int = option(3, "repeated augmentation count (1 disables it)", at_least(1))
    data_on_device: bool | None = option(None, "keep the train set on the device and augment it there per sample "
                                               "(cifar10, cifar100, digits, synthetic; default: on for those on CUDA, "
                                               "off on the CPU, where torchvision/timm is the reference)")

    @property
    def mixing(self) -> bool:
        """Whether batches are mixed (Mixup or CutMix)."""
        return self.mixup_prob > 0 and (self.mixup > 0 or self.cutmix > 0)

    def check(self, cfg) -> None:
        super().check(cfg)
        if self.mixing and cfg.batch_size % 2:
            raise ConfigError(f"batch_size is {cfg.batch_size}, but Mixup/CutMix pair each image with the batch "
                              "reversed and need an even batch size.")


@dataclass(frozen=True)
class SequenceConfig(Section):
    """sequence: keys of token-sequence classification runs (LRA)."""

    label_smoothing: float = option(0.0, SMOOTHING_HELP, within(0, 1))


def host_batches(loader, device: torch.device, mixup_fn=None) -> Iterator[tuple[torch.Tensor, torch.Tensor,
                                                                                  torch.Tensor]]:
    """(inputs, targets, labels) on ``device`` from a CPU loader: ``targets`` mixed by ``mixup_fn`` (soft, label
    smoothing folded in) or the labels; the device pipeline yields the same triples."""
    for inputs, labels in loader:
        inputs = inputs.to(device, non_blocking=True)
        labels = labels.to(device, non_blocking=True)
        targets = labels
        if mixup_fn is not None:
            inputs, targets = mixup_fn(inputs, labels)
        yield inputs, targets, labels


def classification_step(criterion):
    """``loss(model, batch)`` of a classification batch: ``criterion(logits, targets)`` in float32, and the
    device-side count of correct predictions against the unmixed labels."""
    def step(model: nn.Module, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        inputs, targets, labels = batch
        logits = model(inputs)
        loss = criterion(logits.float(), targets)
        return loss, {"correct": (logits.detach().argmax(-1) == labels).sum(), "seen": labels.shape[0]}
    return step


def classification_stats(sums: dict[str, float], seconds: float) -> dict[str, float]:
    seen = max(sums.get("seen", 0.0), 1.0)
    return {"train_loss": sums.get("loss", 0.0) / seen, "train_acc": 100.0 * sums.get("correct", 0.0) / seen,
            "train_seconds": seconds, "img_per_s": sums.get("seen", 0.0) / seconds if seconds > 0 else 0.0}


def evaluate(model, loader, *, device, amp_dtype, num_classes: int, pad_to: int | None = None) -> dict[str, float]:
    """Test loss (plain cross-entropy, no smoothing) and top-1 / top-5 accuracy in percent.

    ``pad_to``: pad a smaller last batch with zero inputs to this size and drop their logits, so that a compiled
    model sees one shape (in eval mode every input is computed on its own, so the others' logits are unchanged).
    """
    import torch
    import torch.nn.functional as F

    with torch.no_grad():  # the decorator would need torch when this module loads
        model.eval()
        autocast = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype is not None else nullcontext()
        k = min(5, num_classes)
        sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, top-1 hits, top-k hits: read once at the end
        seen = 0
        for inputs, labels in loader:
            inputs = inputs.to(device, non_blocking=True)
            labels = labels.to(device, non_blocking=True)
            n = labels.shape[0]
            if pad_to is not None and n < pad_to:
                inputs = torch.cat([inputs, inputs.new_zeros((pad_to - n, *inputs.shape[1:]))])
            with autocast:
                logits = model(inputs)
            logits = logits[:n].float()
            hits = logits.topk(k, dim=-1).indices == labels[:, None]
            sums += torch.stack([F.cross_entropy(logits, labels, reduction="sum").double(),
                                 hits[:, 0].sum().double(), hits.any(dim=-1).sum().double()])
            seen += n
        loss_sum, top1, topk = sums.tolist()
        seen = max(seen, 1)
        return {"test_loss": loss_sum / seen, "top1": 100.0 * top1 / seen, "top5": 100.0 * topk / seen}


class _HostData:
    """The train split through a DataLoader: the epoch's order from a generator seeded by (seed, epoch) alike on
    every rank (so N ranks split the one-process order), the workers' seeds from another seeded by (seed, epoch)
    or, under torchrun, (seed, epoch, rank); workers are not persistent, so each epoch's are seeded anew."""

    def __init__(self, task: Task, train_set, batch_size: int, device: torch.device, mixup_fn,
                 collate_fn=None) -> None:
        import torch
        from torch.utils.data import DataLoader

        cfg, ranks = task.cfg, task.run.ranks
        self.cfg, self.ranks, self.device, self.mixup_fn, self.repeats = cfg, ranks, device, mixup_fn, task.repeats
        self.order_gen, self.data_gen = torch.Generator(), torch.Generator()
        self.sampler = train_sampler(self.repeats, train_set, self.order_gen, ranks)
        self.loader = DataLoader(train_set, batch_size=batch_size, sampler=self.sampler, drop_last=True,
                                 num_workers=cfg.run.num_workers, pin_memory=device.type == "cuda",
                                 generator=self.data_gen, collate_fn=collate_fn)
        self.steps = check_steps(cfg, len(self.sampler) * ranks.world_size)

    def batches(self, epoch: int):
        from .. import distributed
        from ..loop import epoch_seed

        seed = epoch_seed(self.cfg.seed, epoch)
        self.order_gen.manual_seed(seed)
        self.data_gen.manual_seed(distributed.rank_seed(self.cfg.seed, epoch, self.ranks.rank)
                                  if self.ranks.distributed else seed)
        if self.repeats > 1:
            self.sampler.set_epoch(seed)  # timm's sampler shuffles with seed = its "epoch"
        return host_batches(self.loader, self.device, self.mixup_fn)


class _DeviceData:
    """The device pipeline (its epoch is a function of (seed, epoch, rank) and needs no generator)."""

    def __init__(self, pipe, accum: int) -> None:
        self.pipe, self.steps = pipe, len(pipe) // accum

    def batches(self, epoch: int):
        return self.pipe.epoch(epoch)


def train_sampler(repeats: int, train_set, generator: torch.Generator, ranks=None):
    """This rank's share of the epoch's order (the whole order in one process), each example ``repeats`` times
    (repeated augmentation); timm's RepeatAugSampler strides its list over the ranks, and the plain shuffle is
    strided the same way (``distributed.ShardedSampler``)."""
    from torch.utils.data import RandomSampler

    from .. import distributed

    ranks = distributed.SINGLE if ranks is None else ranks
    if repeats > 1:
        from timm.data.distributed_sampler import RepeatAugSampler

        return RepeatAugSampler(train_set, num_replicas=ranks.world_size, rank=ranks.rank, shuffle=True,
                                num_repeats=repeats)
    order = RandomSampler(train_set, generator=generator)
    return distributed.ShardedSampler(order, ranks.world_size, ranks.rank) if ranks.distributed else order


def check_steps(cfg, sampled: int) -> int:
    """Optimizer steps per epoch (full batches only); raises ConfigError if there are none."""
    if sampled // cfg.batch_size == 0:
        raise ConfigError(f"batch_size {cfg.batch_size} is larger than the {sampled} training examples of an "
                          f"epoch of {cfg.dataset}; use a smaller batch size.")
    return sampled // cfg.batch_size


class Classification(Task):
    """Cross-entropy classification, evaluated by test loss, top-1 and top-5."""

    metrics = ("test_loss", "top1", "top5")
    headline = "top1"
    higher_is_better = True
    robustness_eval = True
    repeats = 1  # times each example is drawn per epoch (repeated augmentation: images only)
    mixing = False  # Mixup / CutMix (images only)

    def prepare_eval(self) -> None:
        self.test_set()

    def test_set(self):
        if getattr(self, "_test_set", None) is None:  # built once
            self._test_set = self._split(False)
        return self._test_set

    def check(self, cache: dict) -> None:
        import torch

        cfg = self.cfg
        key = ("data", cfg.dataset, cfg.run.data_dir, cfg.run.download, getattr(self.options, "augment", "none"),
               repr(sorted(cfg.data_options.items())))
        if key not in cache:
            n_train = len(self._split(True))
            self.test_set()
            cache[key] = n_train
        check_steps(cfg, len(train_sampler(self.repeats, range(cache[key]), torch.Generator())))

    def on_device(self) -> bool:
        """Whether the train split lives on the device: never here; for images ``data_on_device`` (None: on CUDA for
        the datasets the device pipeline holds)."""
        return False

    def train_data(self, batch_size: int, device: torch.device):
        from torch import nn

        cfg, ranks, mixing, opts = self.cfg, self.run.ranks, self.mixing, self.options
        if mixing and batch_size % 2:
            raise ConfigError(f"batch_size {cfg.batch_size} over {ranks.world_size} rank(s) and {cfg.grad_accum} "
                              f"micro-batch(es) gives {batch_size} images per micro-batch, but Mixup/CutMix pair "
                              f"each micro-batch's images and need an even number; use a multiple of "
                              f"{2 * ranks.world_size * cfg.grad_accum}.")
        if mixing:
            from timm.loss import SoftTargetCrossEntropy

            self.criterion = SoftTargetCrossEntropy()
        else:
            self.criterion = nn.CrossEntropyLoss(label_smoothing=opts.label_smoothing)
        self.step = classification_step(self.criterion)
        if self.on_device():
            from attnlab.data import build_device_pipeline

            pipe = build_device_pipeline(
                cfg.dataset, device=device, batch_size=batch_size, seed=cfg.seed, data_dir=cfg.run.data_dir,
                download=cfg.run.download, augment=opts.augment, repeated_aug=opts.repeated_aug,
                num_replicas=ranks.world_size, rank=ranks.rank, mixup=opts.mixup, cutmix=opts.cutmix,
                mix_prob=opts.mixup_prob, switch_prob=opts.mixup_switch_prob, label_smoothing=opts.label_smoothing,
                **cfg.data_options)  # the pipeline mixes itself, with the same numbers
            return _DeviceData(pipe, cfg.grad_accum)
        mixup_fn = None
        if mixing:
            from timm.data import Mixup

            mixup_fn = Mixup(mixup_alpha=opts.mixup, cutmix_alpha=opts.cutmix, prob=opts.mixup_prob,
                             switch_prob=opts.mixup_switch_prob, mode="batch", label_smoothing=opts.label_smoothing,
                             num_classes=self.run.info.num_classes)
        return _HostData(self, self._split(True), batch_size, device, mixup_fn)

    def loss(self, model, batch):
        return self.step(model, batch)

    train_stats = staticmethod(classification_stats)

    def evaluate(self, model, *, device, amp_dtype, static_shapes: bool = False) -> dict[str, float]:
        import torch
        from torch.utils.data import DataLoader

        if getattr(self, "_test_loader", None) is None:
            self._test_loader = DataLoader(self.test_set(), batch_size=2 * self.cfg.batch_size, shuffle=False,
                                           num_workers=self.cfg.run.num_workers, pin_memory=device.type == "cuda",
                                           generator=torch.Generator().manual_seed(0))
        return evaluate(model, self._test_loader, device=device, amp_dtype=amp_dtype,
                        num_classes=self.run.info.num_classes,
                        pad_to=self._test_loader.batch_size if static_shapes else None)

    def example_input(self, batch: int = 1, device="cpu") -> torch.Tensor:
        import torch

        info = self.run.info
        return torch.zeros(batch, info.in_chans, info.image_size, info.image_size, device=device)

    def inputs(self, n: int) -> torch.Tensor:
        import torch

        test = self.test_set()
        return torch.stack([test[i][0] for i in range(min(n, len(test)))])

    def line(self, record: dict[str, Any]) -> str:
        return (f"train_loss {record['train_loss']:.4f}  test_loss {record['test_loss']:.4f}  top1 "
                f"{record['top1']:.2f}  top5 {record['top5']:.2f}  {record['img_per_s']:.0f} img/s")


class ImageClassification(Classification):
    """Images: augmentation, Mixup / CutMix, repeated augmentation, the device pipeline (``cfg.image``)."""

    name = "image"
    section = ImageConfig
    trains = "an image classifier"
    other_models = "a timm ViT/DeiT/Swin name"

    @classmethod
    def presets(cls) -> list[str]:
        """Every attnlab preset that no other family trains (the CIFAR and digits ViT and Swin)."""
        from attnlab.models import PRESETS

        from . import TASKS, task_class

        others = {n for f in TASKS if f != cls.name for n in task_class(f).presets()}
        return [n for n in PRESETS if n not in others]

    @property
    def repeats(self) -> int:
        return self.options.repeated_aug

    @property
    def mixing(self) -> bool:
        return self.options.mixing

    def on_device(self) -> bool:
        from attnlab.data.registry import dataset, on_device_datasets

        cfg, wanted = self.cfg, self.options.data_on_device
        held = dataset(cfg.dataset).device is not None
        if wanted is None:
            return held and self.run.device.type == "cuda"
        if wanted and not held:
            raise ConfigError(f"data_on_device is on, but the device pipeline holds "
                              f"{', '.join(on_device_datasets())}, not {cfg.dataset}; drop --data-on-device.")
        return wanted


class SequenceClassification(Classification):
    """Token sequences (LRA ListOps, byte-level text): no image augmentation or mixing (``cfg.sequence``)."""

    name = "sequence"
    section = SequenceConfig
    trains = "a sequence classifier"
    model_classes = ("attnlab.models.sequence:SequenceClassifier",)

    def example_input(self, batch: int = 1, device="cpu") -> torch.Tensor:
        import torch

        return torch.zeros(batch, self.run.info.model_kwargs()["max_length"], dtype=torch.long, device=device)


__all__ = ["Classification", "ImageClassification", "ImageConfig", "SequenceClassification", "SequenceConfig", "check_steps", "classification_step",
           "classification_stats", "evaluate", "host_batches", "train_sampler"]
