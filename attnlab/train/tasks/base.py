"""The Task seam: everything about a run that depends on its task family, in one object per run; what the loop
owns and what it asks the Task: docs/training.md, "A run, its task, its data". It asks, in this order: ``check``,
``build_model``, ``train_data``, then per step ``loss`` and per epoch ``train_stats``, ``evaluate`` and ``line``, at
the end ``result``. A subclass sets ``name``, ``metrics``, ``headline``, ``higher_is_better`` (and for the report
``report_columns`` and ``percent``), and declares its family's config section (``section``: the keys only its runs
read, with their defaults and help; ``cfg.<name>`` in a run's config) and the models it trains. A module here
imports no torch at load time: the config reads the sections from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Iterator, Protocol

from attnlab.errors import ConfigError
from attnlab.train.section import NoKeys

if TYPE_CHECKING:  # pragma: no cover
    import torch
    from torch import nn

    from attnlab.train.run import Run


class TrainData(Protocol):
    """A task's train split: ``steps`` optimizer steps per full pass (None for a stream without passes, which
    needs ``eval_every``), and ``batches(epoch)``: that epoch's batches on the device, a function of (seed, epoch,
    rank) alone so that a resumed run sees the same data."""

    steps: int | None

    def batches(self, epoch: int) -> Iterator[Any]: ...


class Task:
    """One run's task family; see the module docstring."""

    name: ClassVar[str] = ""
    #: the family's config section (a :class:`~attnlab.train.section.Section` subclass defined beside the Task)
    section: ClassVar[type] = NoKeys
    #: what the family trains, in words ("a language model"), for the one line that refuses another family's model
    trains: ClassVar[str] = ""
    #: "module:Class" of the attnlab model classes whose presets the family trains (:meth:`presets`)
    model_classes: ClassVar[tuple[str, ...]] = ()
    #: the families whose presets this one trains too (a detector's backbone is an image model)
    also_trains: ClassVar[tuple[str, ...]] = ()
    #: further models it takes, in words (a timm model name), after its presets
    other_models: ClassVar[str] = ""
    metrics: ClassVar[tuple[str, ...]] = ()
    headline: ClassVar[str] = ""
    higher_is_better: ClassVar[bool] = True
    #: the further metrics a report shows beside the headline (each with mean, SD and gain), and whether the
    #: metrics are percentages (gains in percentage points)
    report_columns: ClassVar[tuple[str, ...]] = ()
    percent: ClassVar[bool] = True
    #: ``attnlab eval``'s classification protocol (noise, out-of-distribution folders, calibration) applies; else
    #: eval prints what :meth:`evaluate` gives on the evaluation split
    robustness_eval: ClassVar[bool] = False
    #: evaluate once before the first step too (result.json's ``init``: the loss at initialisation that the
    #: learning-rate sensitivity of Wortsman et al. 2023 caps each final loss at)
    eval_at_init: ClassVar[bool] = False
    #: the evaluation split is (input, label) pairs that the instruments index (``attnlab analyze``); False: the
    #: instruments take :meth:`inputs` and no labels (a language model's token blocks)
    labelled_inputs: ClassVar[bool] = True
    #: ``attnlab compare`` runs its default instruments (spectra) on the family's runs
    default_instruments: ClassVar[bool] = True

    def __init__(self, run: Run) -> None:
        self.run = run
        self.cfg = run.cfg
        self.options = run.cfg.families[self.name]  # the run's own section (cfg.<name>)

    # ---- which models ------------------------------------------------------------------------------------------
    @classmethod
    def presets(cls) -> list[str]:
        """The attnlab model presets this family trains: those whose class is one of ``model_classes``."""
        import importlib

        from attnlab.models import PRESETS

        bases = tuple(getattr(importlib.import_module(m), c) for m, _, c in (t.partition(":") for t in cls.model_classes))
        return [n for n, p in PRESETS.items() if bases and issubclass(p.cls, bases)]

    def check_model_name(self) -> None:
        """ConfigError when the model is a preset of another family than the run's (a GPT for video clips, a
        detector for text), naming both families and the models that fit."""
        from . import TASKS, family_of_model, task_class

        family = family_of_model(self.cfg.model)
        if family is None or family == self.name or family in self.also_trains:
            return
        fits = [n for f in (self.name, *self.also_trains) for n in task_class(f).presets()]
        names = ", ".join(fits + ([self.other_models] if self.other_models else []))
        other = task_class(family) if family in TASKS else None
        raise ConfigError(f"model {self.cfg.model} is {other.trains if other else family} ({family} family), but "
                          f"dataset {self.cfg.dataset} trains {self.trains} ({self.name} family); use one of {names}.")

    # ---- before training -------------------------------------------------------------------------------------
    def check(self, cache: dict) -> None:
        """Raise the AttnlabError training would raise for the data (files, options, at least one step)."""

    def build_model(self, pretrained: bool = True) -> nn.Module:
        """The model the run trains: the preset or timm model sized for the dataset, the run's spec, drop-path,
        norm and model options applied, from the configured pretrained weights (``pretrained=False``: none read,
        as when a checkpoint replaces them)."""
        from attnlab import models  # looked up at call time, so that a test can wrap build_model

        return models.build_model(self.cfg.model, attn=self.run.spec, norm=self.cfg.norm,
                                  **self._model_kwargs(pretrained))

    def _model_kwargs(self, pretrained: bool) -> dict[str, Any]:
        """The model's keyword arguments: sized for the dataset, then pretrained, drop-path and model options."""
        cfg = self.cfg
        kwargs = dict(self.run.info.model_kwargs())
        if pretrained and (cfg.pretrained or cfg.pretrained_file):
            kwargs.update(pretrained=True, pretrained_file=cfg.pretrained_file)
        if cfg.drop_path is not None:
            kwargs["drop_path_rate"] = cfg.drop_path
        return {**kwargs, **cfg.model_options}

    def _split(self, train: bool):
        """The dataset's train or evaluation split (augmented as configured when training)."""
        from attnlab.data import build_dataset

        cfg = self.cfg
        augment = getattr(self.options, "augment", "none")  # a family without augmentation has no such key
        return build_dataset(cfg.dataset, train, data_dir=cfg.run.data_dir, download=cfg.run.download,
                             augment=augment if train else "none", **cfg.data_options)

    # ---- training ----------------------------------------------------------------------------------------------
    def train_data(self, batch_size: int, device: torch.device) -> TrainData:  # pragma: no cover - abstract
        """This rank's train split in batches of ``batch_size`` on ``device``."""
        raise NotImplementedError

    def loss(self, model: nn.Module, batch: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(mean loss, sums) of one batch, called under the run's autocast; ``sums["seen"]`` counts what the loss
        is a mean over, and the loop adds ``loss`` x seen to ``sums["loss"]``. Nothing here may read a value on
        the host (the step does not wait for the device)."""
        raise NotImplementedError  # pragma: no cover - abstract

    def train_stats(self, sums: dict[str, float], seconds: float) -> dict[str, float]:
        """An epoch's training numbers from the summed ``sums`` (over ranks and steps) and its duration."""
        seen = max(sums.get("seen", 0.0), 1.0)
        return {"train_loss": sums.get("loss", 0.0) / seen, "train_seconds": seconds}

    # ---- evaluation ---------------------------------------------------------------------------------------------
    def prepare_eval(self) -> None:
        """Load what evaluation needs, before the run directory is made (so bad input leaves none behind)."""

    def evaluate(self, model: nn.Module, *, device: torch.device, amp_dtype: torch.dtype | None,
                 static_shapes: bool = False) -> dict[str, float]:  # pragma: no cover - abstract
        """The ``metrics`` of ``model`` on the evaluation split (``static_shapes``: a compiled model, which should
        see one batch shape)."""
        raise NotImplementedError

    def example_input(self, batch: int = 1, device: torch.device | str = "cpu") -> Any:  # pragma: no cover
        """An input of ``batch`` examples as the model takes them (zeros; FLOP counts, compile warm-up)."""
        raise NotImplementedError

    def inputs(self, n: int) -> Any:  # pragma: no cover - abstract
        """The first ``n`` test inputs, as the model takes them (probes, instruments)."""
        raise NotImplementedError

    def instrument_inputs(self, n: int) -> Any:
        """What the instruments of ``attnlab analyze`` read: the first ``n`` test inputs (:meth:`inputs`), unless a
        family's model takes more than one tensor (the video LLM: its prompts with their clips)."""
        return self.inputs(n)

    def line(self, record: dict[str, Any]) -> str:
        """One progress line for an epoch's metrics record."""
        shown = [f"train_loss {record['train_loss']:.4f}"] + [f"{k} {record[k]:.4f}" for k in self.metrics
                                                              if isinstance(record.get(k), float)]
        return "  ".join(shown)

    def result(self, record: dict[str, Any]) -> dict[str, Any]:
        """The numbers result.json reports from the last epoch's record: the ``metrics``, headline first."""
        keys = [self.headline, *[k for k in self.metrics if k != self.headline]]
        return {k: record[k] for k in keys if k in record}


__all__ = ["Task", "TrainData"]
