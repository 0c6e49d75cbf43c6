"""Language modelling: next-token prediction on a token stream (text, the standard library, nanoGPT's .bin) or
MQAR, in nanoGPT's manner (step-based: ``max_steps``, ``eval_every``, ``eval_iters``).

A batch is ``(x, y)`` int64 (B, T) on the device: blocks of the stream and their next tokens (MQAR: targets at the
queries, -100 elsewhere). Micro-batch j of optimizer step s on rank r is ``batch(s * grad_accum + j)`` of the data,
a function of (seed, step, rank) alone, so a resumed run sees exactly the data of the uninterrupted one.
Evaluation: ``eval_iters`` fixed validation batches (MQAR: its test split in order): loss, perplexity, next-token
accuracy, bits per byte where the bytes per token are known. The headline is the validation loss (lower is better).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from attnlab.errors import ConfigError
from attnlab.train.section import Section, at_least, option, within

from .base import Task

if TYPE_CHECKING:  # pragma: no cover
    import torch


@dataclass(frozen=True)
class LMConfig(Section):
    """lm: keys of language-model runs (nanoGPT's manner)."""

    block_size: int | None = option(None, "tokens per training block (default: the data's, else the model "
                                          "preset's)", at_least(1))
    eval_iters: int = option(20, "validation batches per evaluation (the same blocks every time)", at_least(1))
    z_loss: float = option(0.0, "weight of the z-loss, mean (log sum exp logits)^2 (Wortsman et al. use 1e-4)",
                           within(0, 1, open_high=True, hint="Wortsman et al.: 1e-4"))


class _StreamData:
    """The train split as a stream: ``steps`` None (the config's eval_every sets an "epoch")."""

    steps = None

    def __init__(self, task: LanguageModelling, source, batch_size: int, device: torch.device) -> None:
        self.task, self.source, self.batch_size, self.device = task, source, batch_size, device

    def batches(self, epoch: int):
        cfg, ranks = self.task.cfg, self.task.run.ranks
        first = (epoch - 1) * cfg.eval_every * cfg.grad_accum  # epoch e starts at step (e - 1) * eval_every
        for micro in range(first, first + cfg.eval_every * cfg.grad_accum):
            x, y = self.source.batch(micro, self.batch_size, self.task.block_size, seed=cfg.seed, rank=ranks.rank)
            yield x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)


class LanguageModelling(Task):
    """Causal language modelling with attnlab's GPT presets."""

    name = "lm"
    section = LMConfig
    trains = "a language model"
    model_classes = ("attnlab.models.gpt:GPT",)
    metrics = ("val_loss", "perplexity", "accuracy", "bits_per_byte")
    headline = "val_loss"
    higher_is_better = False
    report_columns = ("perplexity", "bits_per_byte", "accuracy")
    percent = False
    eval_at_init = True  # the loss at initialisation, for the learning-rate sensitivity
    labelled_inputs = False  # instruments read validation blocks (token ids), no labels
    curve_panels = (("train_loss", "train loss"), ("val_loss", "validation loss"), ("accuracy", "next-token accuracy"))

    def __init__(self, run) -> None:
        super().__init__(run)
        self._splits: dict[bool, object] = {}

    def _split(self, train: bool):
        if train not in self._splits:  # built once (augment is "none": the config refuses others for token streams)
            self._splits[train] = super()._split(train)
        return self._splits[train]

    @property
    def block_size(self) -> int:
        """The training context: the config's ``block_size``, else the data's (MQAR), else the model's preset."""
        fixed = dict(self.run.info.model_args).get("block_size")
        if self.options.block_size is not None:
            return self.options.block_size
        if fixed:
            return fixed
        from attnlab.models import PRESETS

        preset = PRESETS.get(self.cfg.model)
        return (preset.kwargs.get("block_size") if preset else None) or 256

    def build_model(self, pretrained: bool = True):
        from attnlab.data.lm import check_vocab
        from attnlab.models.gpt import check_block_size

        model = super().build_model(pretrained)
        vocab = getattr(model, "vocab_size", None)
        if vocab is None:
            raise ConfigError(f"the lm task trains attnlab's GPT presets (gpt_tiny, gpt_mini, gpt2_small), not "
                              f"{self.cfg.model}.")
        check_vocab(self.run.info.num_classes, vocab, f"dataset {self.cfg.dataset}")
        check_block_size(model, self.block_size)
        return model

    def check(self, cache: dict) -> None:
        cfg = self.cfg
        key = ("lm-data", cfg.dataset, cfg.run.data_dir, repr(sorted(cfg.data_options.items())))
        if key not in cache:
            for train in (True, False):
                self._split(train).check_block_size(self.block_size)
            cache[key] = True
        if not cfg.eval_every or not cfg.max_steps:
            raise ConfigError("a language model trains for a number of steps; give max_steps and eval_every "
                              "(the lm recipe sets both).")

    def prepare_eval(self) -> None:
        self._split(False)

    def train_data(self, batch_size: int, device: torch.device):
        if self.cfg.eval_every is None:
            raise ConfigError("a language model's data is a stream without epochs; set eval_every.")
        return _StreamData(self, self._split(True), batch_size, device)

    def loss(self, model, batch):
        from attnlab.data.lm_metrics import IGNORE, lm_loss

        x, y = batch
        loss = lm_loss(model(x), y, z_loss=self.options.z_loss)
        return loss, {"seen": (y != IGNORE).sum()}

    def train_stats(self, sums, seconds):
        return {**super().train_stats(sums, seconds),
                "tokens_per_s": sums.get("seen", 0.0) / seconds if seconds > 0 else 0.0}

    def evaluate(self, model, *, device, amp_dtype, static_shapes: bool = False) -> dict[str, float]:
        from attnlab.data.lm_metrics import evaluate_lm

        val = self._split(False)
        batches = val.eval_batches(self.cfg.batch_size, self.block_size, self.options.eval_iters, seed=self.cfg.seed)
        out = evaluate_lm(model, batches, bytes_per_token=val.bytes_per_token, device=device, amp_dtype=amp_dtype)
        return {"val_loss": out["loss"], "perplexity": out["perplexity"], "accuracy": out["accuracy"],
                **({"bits_per_byte": out["bits_per_byte"]} if "bits_per_byte" in out else {})}

    def example_input(self, batch: int = 1, device="cpu") -> torch.Tensor:
        import torch

        return torch.zeros(batch, self.block_size, dtype=torch.long, device=device)

    def inputs(self, n: int) -> torch.Tensor:
        return next(iter(self._split(False).eval_batches(n, self.block_size, 1, seed=self.cfg.seed)))[0]

    def line(self, record) -> str:
        bpb = f"  bpb {record['bits_per_byte']:.3f}" if "bits_per_byte" in record else ""
        return (f"train_loss {record['train_loss']:.4f}  val_loss {record['val_loss']:.4f}  ppl "
                f"{record['perplexity']:.2f}  acc {record['accuracy']:.3f}{bpb}  {record['tokens_per_s']:.0f} tok/s")


__all__ = ["LMConfig", "LanguageModelling"]
