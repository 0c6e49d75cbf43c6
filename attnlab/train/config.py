"""Training configuration: a common section (what is trained, ``optim``, ``sched``, ``run``) and one section per task
family (``image``, ``sequence``, ``lm``, ``video``, ``detect``, each declared by its Task in
:mod:`attnlab.train.tasks`), plus named recipes.

A config is built from a named recipe (``RECIPES``), then a YAML file, then explicit overrides (CLI flags), each
layer replacing the one before. Keys are given flat (``lr: 1e-3``, ``block_size: 256``, as every flag is) or nested
by section (``optim: {lr: 1e-3}``, ``lm: {block_size: 256}``); a key of another family's section than the run's is
refused in one line naming the family that reads it. A recipe states only what differs from the defaults: the
common defaults and the image family's are the NS-Attn paper's CIFAR recipe (Sec. 3.1), the other families carry
their own. docs/training.md, "The config", shows the layout.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, Iterator

import yaml

from attnlab.errors import ConfigError, did_you_mean

from .section import Section, at_least, check_fields, keys_of, non_negative, option, within


@dataclass(frozen=True)
class OptimConfig(Section):
    """optim: the optimizer (AdamW by default, as the NS-Attn paper's recipe)."""

    optimizer: str = option("adamw", "'adamw', 'lars' (timm's LARS, SGD momentum with layer-wise trust ratio) or "
                                     "'sgd' (momentum SGD, TimeSformer's)", choices=("adamw", "lars", "sgd"))
    lr: float = option(1e-3, "peak learning rate", non_negative)
    weight_decay: float = option(0.05, "weight decay (not applied to biases, norms, embeddings, 1-D params)",
                                 non_negative)
    beta2: float = option(0.999, "AdamW's second-moment decay (nanoGPT's language models: 0.95)",
                          within(0, 1, open_low=True, open_high=True))
    momentum: float = option(0.9, "momentum of the LARS and SGD optimizers",
                             within(0, 1, open_high=True, hint="LARS keeps that share of the previous step; 0.9 is "
                                                               "usual"))
    layer_decay: float | None = option(None, "layer-wise learning-rate decay (ViTDet, BEiT): transformer block i of "
                                             "L trains at lr x layer_decay^(L+1-i), the embeddings at "
                                             "layer_decay^(L+1), heads at lr (default: none)",
                                       within(0, 1, open_low=True, hint="ViTDet uses 0.7 for ViT-B"))
    clip_grad: float | None = option(None, "clip the total gradient norm of the trained tensors to this value "
                                           "(default: no clipping)", lambda v: None if v > 0 else "be positive")


@dataclass(frozen=True)
class SchedConfig(Section):
    """sched: the learning-rate schedule (linear warm-up, then cosine decay)."""

    lr_schedule: str = option("cosine", "'cosine' (warm-up, then cosine decay to min_lr) or 'step' (ViTDet's: "
                                        "warm-up, then lr x 0.1 at 8/9 and again at 26/27 of training)",
                              choices=("cosine", "step"))
    warmup_epochs: float = option(10, "epochs of linear warm-up before the decay", non_negative)
    warmup_steps: int | None = option(None, "linear warm-up in optimizer steps (replaces warmup_epochs)",
                                      at_least(0))
    warmup_lr: float = option(1e-6, "learning rate at the first step of warm-up", non_negative)
    min_lr: float = option(1e-5, "learning rate at the end of the cosine decay", non_negative)


@dataclass(frozen=True)
class RunConfig(Section):
    """run: how it runs (may change between a run and its resumption: devices, paths, logging)."""

    device: str = option("auto", "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ...")
    amp: str = option("auto", "'auto' (bf16 autocast on CUDA, fp32 on CPU), 'bf16' or 'none'",
                      choices=("auto", "bf16", "none"))
    compile: bool = option(False, "train and evaluate the model through torch.compile")
    compile_mode: str = option("auto", "torch.compile mode: 'auto' (reduce-overhead, i.e. CUDA graphs, on CUDA; "
                                       "default on the CPU), 'default', 'reduce-overhead', 'max-autotune' or "
                                       "'max-autotune-no-cudagraphs'",
                               choices=("auto", "default", "reduce-overhead", "max-autotune",
                                        "max-autotune-no-cudagraphs"))
    data_dir: str = option("data", "where datasets are stored")
    download: bool = option(False, "download missing datasets")
    runs_dir: str = option("runs", "parent directory of run directories")
    name: str | None = option(None, "run directory name (default: model-dataset-attn-sSEED)")
    num_workers: int = option(2, "DataLoader worker processes", non_negative)
    threads: int | None = option(None, "torch intra-op CPU threads during the run (default: torch's, one per core)",
                                 at_least(1))
    log_every: int = option(10, "update the progress bar every this many steps", at_least(1))
    probe_every: int = option(0, "every this many steps log attention entropy, max logits and W_Q W_K^T spectral "
                                 "norms into metrics.jsonl (0: off)", non_negative)
    probe_images: int = option(64, "test images the probe runs on (the first ones, in order)", at_least(1))
    progress: bool = option(True, "show a progress bar per epoch")
    resume: bool = option(False, "continue the run from its last completed epoch")
    accept_data_change: bool = option(False, "with --resume: continue on data that differs from what the run "
                                             "recorded in data.json (a corpus, tokenizer, class list or annotation "
                                             "file replaced on purpose), recording the new data")
    log: str = option("none", "'tensorboard' also writes metrics as TensorBoard scalars into RUN_DIR/tensorboard "
                              "(pip install attnlab[tensorboard]), or 'none'", choices=("none", "tensorboard"))
    parallel: str = option("ddp", "several processes (torchrun): 'ddp' (each rank holds the whole model, gradients "
                                  "all-reduced) or 'fsdp' (parameters, gradients and optimizer state sharded over "
                                  "the ranks, FSDP2's fully_shard per block, for models that outgrow one device)",
                           choices=("ddp", "fsdp"))
    activation_checkpointing: bool = option(False, "recompute each transformer block's activations in the backward "
                                                   "(less memory for about a third more compute)")
    world_size: int = option(1, "processes the run trains with (recorded from torchrun's WORLD_SIZE; a value given "
                                "here is replaced)", at_least(1))


#: the common sub-sections, by the name a config file nests them under
COMMON_SECTIONS: dict[str, type] = {"optim": OptimConfig, "sched": SchedConfig, "run": RunConfig}


def family_sections() -> dict[str, type]:
    """Each task family's section class, from the Task registry (:func:`attnlab.train.tasks.sections`)."""
    from .tasks import sections

    return sections()


def _default_families() -> dict[str, Section]:
    return {family: cls() for family, cls in family_sections().items()}


@dataclass
class TrainConfig:
    """One training run: what is trained, and its sections ``optim``, ``sched``, ``run`` and one per task family
    (``cfg.image``, ``cfg.lm``, ...: :attr:`families`, of which the run reads its dataset's). Defaults are the
    ``ns_cifar`` recipe of the NS-Attn paper (Sec. 3.1: AdamW, warm-up then cosine decay, AutoAugment,
    Mixup/CutMix, label smoothing, repeated augmentation); docs/training.md, "The recipe", gives each value and its
    source."""

    recipe: str = option("ns_cifar", "named recipe the other defaults come from")
    model: str = option("vit_cifar", "model preset (vit_cifar, swin_cifar, vit_digits, gpt_tiny, ...) or timm model "
                                     "name")
    dataset: str = option("cifar100", "dataset name (cifar10, cifar100, digits, stdlib, ...); its family says which "
                                      "section the run reads")
    attn: str = option("standard", "attention variant spec, e.g. 'ns' or 'dna(variant=q)+sigma'")
    seed: int = option(0, "seed for weights, data order, augmentation and mixing")
    tag: str = option("", "label of a recipe variation in a grid (e.g. no_warmup): part of the run name, and "
                          "reports compare variants within each tag")
    epochs: int = option(100, "training epochs", at_least(1))
    max_steps: int | None = option(None, "train this many optimizer steps instead of `epochs` epochs (step-based "
                                         "recipes such as a language model's); evaluation and a checkpoint every "
                                         "`eval_every` steps", at_least(1))
    eval_every: int | None = option(None, "optimizer steps between evaluations and checkpoints (default: an epoch, "
                                          "one pass over the training set; required for token streams, which have "
                                          "no passes)", at_least(1))
    batch_size: int = option(128, "training batch size", at_least(1))
    grad_accum: int = option(1, "micro-batches per optimizer step; batch_size stays the global batch, each "
                                "micro-batch is batch_size / (grad_accum x ranks)", at_least(1))
    norm: str = option("pre", "'pre' (timm's pre-LN blocks), 'post' (post-LN, ViT only) or 'none' (no LayerNorm; ViT "
                              "and sequence models)", choices=("pre", "post", "none"))
    drop_path: float | None = option(None, "stochastic-depth rate (default: the model preset's)", within(0, 1))
    pretrained: bool = option(False, "start from timm's pretrained weights (hub cache, or --pretrained-file), then "
                                     "apply --attn")
    pretrained_file: str | None = option(None, "weights to start from: safetensors or a weights-only torch file "
                                               "(implies --pretrained)")
    model_options: dict = option({}, "extra keyword arguments for build_model")
    data_options: dict = option({}, "extra keyword arguments for the dataset")
    ema: bool = option(False, "also keep, evaluate and checkpoint an exponential moving average of the weights "
                              "(timm's ModelEmaV3)")
    ema_decay: float = option(0.9998, "EMA decay per optimizer step (timm's default)",
                              within(0, 1, open_high=True, hint="0.9998 averages about the last 5,000 steps"))
    optim: OptimConfig = field(default_factory=OptimConfig)
    sched: SchedConfig = field(default_factory=SchedConfig)
    run: RunConfig = field(default_factory=RunConfig)
    #: one section per registered task family (defaults for the families the run is not of)
    families: dict[str, Section] = field(default_factory=_default_families)

    def __getattr__(self, name: str) -> Section:
        """``cfg.image``, ``cfg.lm``, ...: the family's section."""
        families = self.__dict__.get("families")
        if families is not None and name in families:
            return families[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def family(self) -> str:
        """The run's task family: its dataset's (which section it reads)."""
        from attnlab.data.registry import dataset

        return dataset(self.dataset).task

    def replace(self, **values: Any) -> "TrainConfig":
        """A copy with ``values`` set, each a key (``lr``, ``block_size``: into its section, the run family's for a
        family key) or a section name with a mapping (``run={"name": "x"}``); unchecked, as ``dataclasses.replace``."""
        return _apply(self, _layer(values, "replace"))[0]


TOP_KEYS = tuple(f.name for f in dataclasses.fields(TrainConfig) if f.name not in (*COMMON_SECTIONS, "families"))
# Keys that may differ between a run and its resumption without changing what is computed: the run section
# (device and amp do change rounding; they are allowed so that a run can move machines).
RUNTIME_KEYS = frozenset(keys_of(RunConfig))


# ---- keys and where they live ----------------------------------------------------------------------------------------
@cache
def key_places() -> dict[str, tuple[str, ...]]:
    """Each flat key (every flag) -> the sections that hold it: ``""`` (the top level), a common section, or the
    families whose sections declare it (``label_smoothing``: image, sequence, video)."""
    places: dict[str, tuple[str, ...]] = {k: ("",) for k in TOP_KEYS}
    for name, cls in COMMON_SECTIONS.items():
        places.update({k: (name,) for k in keys_of(cls)})
    common = set(places)
    for family, cls in family_sections().items():
        for key in keys_of(cls):
            if key in common:  # a family key must not shadow a common one: flat keys would become ambiguous
                raise TypeError(f"{cls.__name__}.{key} repeats a key of the common config")
            places[key] = places.get(key, ()) + (family,)
    return places


def config_keys() -> list[str]:
    """Every flat key: the top level's, the common sections', then each family's (once)."""
    return list(key_places())


def section_names() -> list[str]:
    return [*COMMON_SECTIONS, *family_sections()]


def _section_class(name: str) -> type:
    return TrainConfig if name == "" else COMMON_SECTIONS.get(name) or family_sections()[name]


def _hint(key: str) -> Any:
    return typing.get_type_hints(_section_class(key_places()[key][0]))[key]


def _families_words(families: tuple[str, ...]) -> str:
    names = ", ".join(families[:-1]) + (" and " if len(families) > 1 else "") + families[-1]
    return f"the {names} famil{'ies' if len(families) > 1 else 'y'}"


def _not_read(what: str, families: tuple[str, ...], recipe: str, dataset: str, family: str) -> ConfigError:
    from .tasks import task_class

    return ConfigError(f"{what} belongs to {_families_words(families)}; {recipe} trains "
                       f"{task_class(family).trains} (dataset {dataset}, the {family} family), which does not read "
                       f"it; drop it.")


# An entry of a layer: (where, key, value); where is "" (top level), a section name, or "*" (a family key given
# flat: the run's family's section, known once the dataset is)
Entry = tuple[str, str, Any]


def _layer(values: dict[str, Any], source: str) -> list[Entry]:
    """The entries of one layer (a recipe, a file, the flags), flat keys and nested sections alike, each value
    converted to its key's type; ConfigError for an unknown key or a section that is not a mapping."""
    places, sections = key_places(), section_names()
    entries: list[Entry] = []
    for key, value in values.items():
        if key in sections:
            if value is None:  # `lm:` with nothing under it
                continue
            if not isinstance(value, dict):
                raise ConfigError(f"config section '{key}' in {source} is {value!r}, but it must be a mapping of its "
                                  f"keys, such as {key}: {{{keys_of(_section_class(key))[0]}: ...}}.")
            own = keys_of(_section_class(key))
            for inner, v in value.items():
                if inner not in own:
                    raise ConfigError(f"unknown key {inner!r} in config section '{key}'"
                                      f"{did_you_mean(str(inner), own)}; its keys are: {', '.join(own)}.")
                entries.append((key, inner, coerce(inner, v)))
        elif key in places:
            where = places[key][0] if places[key][0] in ("", *COMMON_SECTIONS) else "*"
            entries.append((where, key, coerce(key, value)))
        else:
            valid = config_keys()
            raise ConfigError(f"unknown config key {str(key)!r}{did_you_mean(str(key), valid)}; valid keys are: "
                              f"{', '.join(valid)} (or nested under {', '.join(sections)}).")
    return entries


def _apply(base: TrainConfig, entries: list[Entry], record: bool = False) -> tuple[TrainConfig, set[str]]:
    """``base`` with the entries set, and the keys they set. A key or section of another family than the run's
    (from the final dataset) is refused naming the family that reads it; ``record``: dropped instead (a run's
    config.yaml from before sections lists every family's keys, of which the run read its own)."""
    from attnlab.data.registry import dataset

    top = {k: v for where, k, v in entries if where == ""}
    name = top.get("dataset", base.dataset)
    family = dataset(name).task
    recipe = top.get("recipe", base.recipe)
    common: dict[str, dict[str, Any]] = {n: {} for n in COMMON_SECTIONS}
    own: dict[str, Any] = {}
    for where, key, value in entries:
        if where in common:
            common[where][key] = value
        elif where == "*" and family not in key_places()[key]:
            if not record:
                raise _not_read(f"config key '{key}' (--{key.replace('_', '-')})", key_places()[key], recipe,
                                name, family)
        elif where not in ("", "*") and where != family:
            if not record:
                raise _not_read(f"config section '{where}'", (where,), recipe, name, family)
        elif where != "":
            own[key] = value
    families = dict(base.families)
    if own:
        families[family] = dataclasses.replace(families[family], **own)
    cfg = dataclasses.replace(base, **top, **{n: dataclasses.replace(getattr(base, n), **v)
                                              for n, v in common.items() if v}, families=families)
    return cfg, {k for _, k, _ in entries}


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
               dict: "a mapping such as '{depth: 2}'"}


def type_words(key: str) -> str:
    """What config key ``key`` accepts, in words ('an integer', 'a number or null', ...)."""
    typ = _hint(key)
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    words = _TYPE_WORDS.get(args[0] if args else typ, getattr(typ, "__name__", str(typ)))
    return words + (" or null" if len(args) < len(typing.get_args(typ)) else "")


def coerce(key: str, value: Any) -> Any:
    """``value`` (YAML or command-line text) converted to config key ``key``'s type, or ConfigError."""
    typ = _hint(key)
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        typ = next(a for a in typing.get_args(typ) if a is not type(None))
    try:
        if typ is bool:
            if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                return value.lower() in ("1", "true", "yes", "on")
            if isinstance(value, (bool, int)) and value in (0, 1):
                return bool(value)
            raise ValueError
        if typ is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if typ is float:
            if isinstance(value, bool) or not math.isfinite(float(value)):
                raise ValueError
            return float(value)
        if typ is str:
            if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                raise ValueError
            return str(value)
        if typ is dict:
            if isinstance(value, str):
                value = yaml.load(value, Loader=_BoundedLoader) or {}
            if not isinstance(value, dict):
                raise ValueError
            for k, v in value.items():
                if not isinstance(k, str):
                    raise ValueError
                if v is None and ":" in k:  # YAML reads '{depth:2}' as the key 'depth:2' with no value
                    raise ConfigError(f"config key '{key}' got {{{k}}}, a key without a value; YAML needs a space "
                                      f"after the colon, as in '{{{k.replace(':', ': ', 1)}}}'.")
            return dict(value)
    except ConfigError:
        raise
    except (TypeError, ValueError, yaml.YAMLError):
        raise ConfigError(f"config key '{key}' got {value!r}, but it must be {type_words(key)}.") from None
    return value


# ---- recipes ---------------------------------------------------------------------------------------------------------
# Each recipe as the keys where it differs from the defaults (the common ones, and its family's section's): flat
# keys, each mapped to its section. ns_cifar is the defaults themselves.
RECIPE_VALUES: dict[str, dict[str, Any]] = {
    # NS-Attn paper Sec. 3.1 (CIFAR-10/100, ViT and Swin).
    "ns_cifar": {},
    # sklearn's 8x8 digits with the tiny vit_digits preset, a few seconds per run on 2 CPU cores. Tuned by hand:
    # the model needs about 1,000 updates, hence batch 16; label smoothing 0.1 was worth about a point; the
    # dataset's 1-pixel shift ("recipe") hurt badly at this resolution; 15 epochs reach about 95% (10 reach 92-95%).
    "demo": dict(
        model="vit_digits", dataset="digits", epochs=20, batch_size=64, lr=5e-3, warmup_epochs=1, warmup_lr=1e-4,
        augment="none", mixup=0.0, cutmix=0.0, mixup_prob=0.0, repeated_aug=1, num_workers=0,
        threads=1,  # this model's ops are too small to split: 2 threads cost >10x the CPU time on a busy machine
    ),
    # Moving digits with timesformer_tiny (divided space-time attention), 1-2 minutes per run on 2 CPU cores: batch
    # 16 for enough updates (256 per epoch of 4,096 clips); 192 updates told the sense of motion at 98% (seed 0,
    # docs/methods.md); no augmentation (a flip would reverse the label), no smoothing
    "moving_digits": dict(
        model="timesformer_tiny", dataset="moving_digits", epochs=2, batch_size=16, warmup_epochs=0.1,
        warmup_lr=1e-5, augment="none", num_workers=0, threads=1,
    ),
    # TimeSformer fine-tuning as the DnA authors' video configs (Smarthome, NTU): SGD momentum 0.9, lr 0.005, weight
    # decay 1e-4, batch 8, 15 epochs, 8 frames, scale jitter + crop + flip; their step decay (x0.1 at epochs 11 and
    # 14) is a cosine here, the schedule the trainer has
    "timesformer": dict(
        model="timesformer_base", dataset="video", epochs=15, batch_size=8, lr=0.005, optimizer="sgd",
        weight_decay=1e-4, warmup_epochs=0, warmup_lr=0.005, min_lr=5e-5,
    ),
    # LRA ListOps (generated locally) with the lra preset (the padding masked, as LRA and every peer; seq_listops is
    # the unmasked ablation), close to the Nystromformer authors' LRA settings
    # (batch 32, lr 1e-4, about 1,000 warm-up and 5,000 total steps on 96,000 sequences)
    "lra_listops": dict(
        model="lra", dataset="listops", epochs=2, batch_size=32, lr=1e-4, weight_decay=0.01, warmup_epochs=0.33,
        min_lr=1e-6, num_workers=0,
    ),
    # nanoGPT's manner (its train.py, scaled to gpt_tiny on the embedded byte corpus): step-based, AdamW beta2 0.95,
    # weight decay 0.1 on matrices only, linear warm-up then cosine to lr / 10, gradient clipping at 1
    "lm": dict(
        model="gpt_tiny", dataset="stdlib", epochs=1, max_steps=2000, eval_every=250, warmup_steps=100,
        batch_size=16, block_size=256, warmup_lr=0.0, min_lr=1e-4, weight_decay=0.1, beta2=0.95, clip_grad=1.0,
        num_workers=0,
    ),
    # the LR-sensitivity study cut to 2 CPU cores (`attnlab compare --preset lm_demo`): gpt_tiny, 64-byte blocks,
    # 150 steps, no warm-up, one thread per run; the training probe every 25 steps (the report's per-layer max logit)
    "lm_demo": dict(
        model="gpt_tiny", dataset="stdlib", epochs=1, max_steps=150, eval_every=50, eval_iters=4, warmup_steps=0,
        batch_size=8, block_size=64, warmup_lr=0.0, min_lr=1e-4, weight_decay=0.1, beta2=0.95, clip_grad=1.0,
        z_loss=1e-4, num_workers=0, threads=1, probe_every=25, probe_images=16,
    ),
    # the same study on the Llama-shaped decoder (`attnlab compare --preset lm_demo_llama`): llama_tiny (RoPE,
    # RMSNorm, SwiGLU, 2 key-value heads for 4 query heads), 100 steps of 8 x 64 bytes, so that its 12 runs fit in
    # 3 minutes on 2 cores; the training probe every 20 steps (the per-layer max logit over training)
    "lm_demo_llama": dict(
        model="llama_tiny", dataset="stdlib", epochs=1, max_steps=100, eval_every=50, eval_iters=4, warmup_steps=0,
        batch_size=8, block_size=64, warmup_lr=0.0, min_lr=1e-4, weight_decay=0.1, beta2=0.95, clip_grad=1.0,
        z_loss=1e-4, num_workers=0, threads=1, probe_every=20, probe_images=16,
    ),
    # the size ladder's three CPU rungs on a BPE corpus (`attnlab compare --preset lm_ladder_demo`): ladder_d128 /
    # d192 / d256 (the ladder's rule at CPU size) on stdlib_bpe (2,048 ids, prepared once), 100 steps of 8 x 64
    # tokens, no warm-up, z-loss 1e-4, one thread per run, so that its 18 runs fit in 10 minutes on 2 cores; the
    # training probe every 20 steps (the per-layer max logit over training)
    "lm_ladder_demo": dict(
        model="ladder_d128", dataset="stdlib_bpe", epochs=1, max_steps=100, eval_every=50, eval_iters=4,
        warmup_steps=0, batch_size=8, block_size=64, warmup_lr=0.0, min_lr=1e-4, weight_decay=0.1, beta2=0.95,
        clip_grad=1.0, z_loss=1e-4, num_workers=0, threads=1, probe_every=20, probe_images=16,
    ),
    # ViTDet's recipe (Li et al., arXiv 2203.16527; detectron2's ViT-B Mask R-CNN: AdamW, lr 1e-4, weight decay 0.1,
    # layer-wise decay 0.7, drop-path 0.1, 250 warm-up iterations from 0.001 x lr, x0.1 at 8/9 and 26/27 of
    # training, large-scale jitter) in the DnA paper's Table 9 setting: ViT-B at 224x224, 50 epochs, batch 32
    # (its Table 5); no Mixup, label smoothing or repeated augmentation in detection
    "vitdet": dict(
        model="vitdet_base_224", dataset="coco", epochs=50, batch_size=32, lr=1e-4, weight_decay=0.1,
        layer_decay=0.7, lr_schedule="step", warmup_epochs=0, warmup_steps=250, warmup_lr=1e-7, min_lr=0.0,
        drop_path=0.1, num_workers=4,
    ),
    # the tiny ViTDet on the synthetic shapes set from scratch, on 2 CPU cores: box AP 25.7, AP50 42.2, mask AP 25.4
    # after these 4 epochs (256 steps of 8 images; 24 min on a loaded machine, docs/training.md); a larger
    # learning rate and a cosine schedule, as a from-scratch model needs
    "detect_demo": dict(
        model="vitdet_tiny", dataset="shapes", epochs=4, batch_size=8, lr=5e-4, warmup_epochs=0, warmup_steps=20,
        min_lr=1e-6, clip_grad=1.0, num_workers=0, threads=1,
    ),
    # the video LLM on the embedded moving-digits QA set, on 2 CPU cores: the tiny frame encoder first learns to name
    # the digits of a frame (encoder_pretrain_steps), then is frozen; 8 probes at every encoder block, the
    # projectors and llama_tiny (trained from scratch, full fine-tuning) learn the questions; peak rate 5e-4 (seed 0,
    # standard: 3e-4 40.0, 5e-4 44.5, 7e-4 40.0, 1e-3 40.25, 2e-3 33.25)
    "vlm_demo": dict(
        model="viscop", dataset="digits_qa", epochs=1, batch_size=8, lr=5e-4, weight_decay=0.01, warmup_epochs=0.1,
        warmup_lr=1e-5, clip_grad=1.0, num_probes=8, frames_per_clip=8, encoder_pretrain_steps=300,
        num_workers=0, threads=1,
    ),
}
RECIPES: dict[str, TrainConfig] = {
    name: _apply(TrainConfig(recipe=name), _layer(values, f"recipe {name}"))[0]
    for name, values in RECIPE_VALUES.items()}

# Named grids for `attnlab compare --preset NAME`. variants=None means every registered variant marked for the demo.
GRID_PRESETS: dict[str, dict[str, Any]] = {
    # seconds per run on 2 CPU cores: the tiny ViT on scikit-learn's digits, three seeds
    "demo": {"recipe": "demo", "variants": None, "seeds": [0, 1, 2], "datasets": ["digits"], "models": ["vit_digits"],
             "jobs": 2,  # two single-threaded runs at a time: twice the work of one two-threaded run on 2 cores
             "runs_dir": "runs/demo"},
    # a small version of configs/lm_lr_sensitivity.yaml: three peak rates over 1.5 orders of magnitude, no warm-up
    "lm_demo": {"recipe": "lm_demo", "variants": ["standard", "qknorm", "sigma"], "seeds": [0],
                "datasets": ["stdlib"], "models": ["gpt_tiny"], "jobs": 2, "runs_dir": "runs/lm_demo",
                "variations": {"lr_1e-3": {"lr": 1e-3, "min_lr": 1e-4}, "lr_1e-2": {"lr": 1e-2, "min_lr": 1e-3},
                               "lr_3e-2": {"lr": 3e-2, "min_lr": 3e-3}}},
    # the note's comparison on a modern decoder: standard, QK-norm, QK-clip and sigma-Reparam on llama_tiny
    "lm_demo_llama": {"recipe": "lm_demo_llama", "variants": ["standard", "qknorm", "qkclip", "sigma"], "seeds": [0],
                      "datasets": ["stdlib"], "models": ["llama_tiny"], "jobs": 2, "runs_dir": "runs/lm_demo_llama",
                      "variations": {"lr_1e-3": {"lr": 1e-3, "min_lr": 1e-4}, "lr_1e-2": {"lr": 1e-2, "min_lr": 1e-3},
                                     "lr_3e-2": {"lr": 3e-2, "min_lr": 3e-3}}},
    # three sizes of the ladder (Wortsman et al.'s Figure 1 at toy size): LR sensitivity against size over two
    # orders of magnitude of peak rate, standard attention against QK-norm
    "lm_ladder_demo": {"recipe": "lm_ladder_demo", "variants": ["standard", "qknorm"], "seeds": [0],
                       "datasets": ["stdlib_bpe"], "models": ["ladder_d128", "ladder_d192", "ladder_d256"],
                       "jobs": 2, "runs_dir": "runs/lm_ladder_demo",
                       "variations": {"lr_1e-3": {"lr": 1e-3, "min_lr": 1e-4}, "lr_1e-2": {"lr": 1e-2, "min_lr": 1e-3},
                                      "lr_1e-1": {"lr": 1e-1, "min_lr": 1e-2}}},
    # the video LLM's probes, standard versus DnA cross-attention, on the embedded moving-digits QA set
    "vlm_demo": {"recipe": "vlm_demo", "variants": ["standard", "dna"], "seeds": [0], "datasets": ["digits_qa"],
                 "models": ["viscop"], "jobs": 2, "runs_dir": "runs/vlm_demo"},
    # NS-Attn Table 1: both backbones and datasets, seeds 0, 1, 3 (hours per run on a GPU)
    "ns_table1": {"recipe": "ns_cifar", "variants": ["standard", "ns"], "seeds": [0, 1, 3],
                  "datasets": ["cifar10", "cifar100"], "models": ["vit_cifar", "swin_cifar"],
                  "runs_dir": "runs/ns_attn_table1"},
}


GRID_KEYS = ("variants", "seeds", "datasets", "models", "runs_dir", "variations", "jobs", "launcher", "base")


def check_grid(grid: dict[str, Any], extra_keys: Any, source: str) -> None:
    """ConfigError unless the grid's own values (see ``attnlab.train.grid.load_grid``) have their types and
    ``extra_keys`` (top-level keys left for TrainConfig) are config keys; ``source`` names where they came from."""
    for key in extra_keys:
        if key not in config_keys() and key not in section_names():
            raise ConfigError(f"unknown key {key!r} in {source}{did_you_mean(key, [*GRID_KEYS, *config_keys()])}; "
                              f"a grid file holds {', '.join(GRID_KEYS)} and training config keys.")
    for key in ("variants", "datasets", "models"):
        value = grid[key]
        if value is not None and not (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
            raise ConfigError(f"{key} in {source} is {value!r}, but it must be a list of names such as [a, b].")
    if not isinstance(grid["runs_dir"], (str, Path)):
        raise ConfigError(f"runs_dir in {source} is {grid['runs_dir']!r}, but it must be a directory path.")
    jobs = grid["jobs"]
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs in {source} is {jobs!r}, but it must be an integer of at least 1.")
    for tag, overrides in (grid["variations"] or {}).items():
        if not isinstance(overrides, (dict, type(None))):
            raise ConfigError(f"variation {tag!r} in {source} is {overrides!r}, but it must map training config "
                              "keys to values, e.g. no_warmup: {warmup_epochs: 0}.")



MAX_SEED = 2**63 - 1  # the largest seed every generator takes (torch's is 64-bit, int64 in tensors)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check value ranges (each section's, the run family's among them); return cfg unchanged or raise ConfigError
    with one sentence."""
    check_fields(cfg)
    for name in COMMON_SECTIONS:
        getattr(cfg, name).check(cfg)
    optim, sched = cfg.optim, cfg.sched
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"config key 'seed' is {cfg.seed}, but it must be an integer from 0 to 2**63 - 1 (torch and "
                          "NumPy seed their generators with non-negative integers).")
    if sched.min_lr > optim.lr:
        raise ConfigError(f"config key 'min_lr' is {sched.min_lr}, above lr {optim.lr}; the cosine decay ends at "
                          f"min_lr, so give --min-lr at most {optim.lr} (or a larger --lr).")
    if sched.warmup_steps is None and cfg.max_steps is None and sched.warmup_epochs > cfg.epochs:
        raise ConfigError(f"config key 'warmup_epochs' is {sched.warmup_epochs:g}, longer than the {cfg.epochs} "
                          f"epochs of training; give --warmup-epochs at most {cfg.epochs} (or more --epochs).")
    if sched.warmup_steps is not None and cfg.max_steps is not None and sched.warmup_steps > cfg.max_steps:
        raise ConfigError(f"config key 'warmup_steps' is {sched.warmup_steps}, longer than the {cfg.max_steps} steps "
                          f"of training (max_steps); give --warmup-steps at most {cfg.max_steps}.")
    if cfg.batch_size % cfg.grad_accum:
        raise ConfigError(f"batch_size {cfg.batch_size} must split evenly into grad_accum={cfg.grad_accum} "
                          f"micro-batches; use a multiple of {cfg.grad_accum}.")
    _check_data(cfg)
    getattr(cfg, cfg.family).check(cfg)
    from attnlab.spec import parse_spec  # torch-free: a spec typo is one line before any model code loads

    parse_spec(cfg.attn)
    return cfg


def _check_data(cfg: TrainConfig) -> None:
    """The dataset is in the table and takes the run's augmentation and mixing, and the recipe's when the recipe is
    made for another family (its augmentation or mixing would be dropped without a word; the table is torch-free)."""
    from attnlab.data.registry import dataset

    entry = dataset(cfg.dataset)
    recipe = RECIPES.get(cfg.recipe)
    if recipe is not None and recipe.family != entry.task:
        made = getattr(recipe, recipe.family)
        mixing, augment = getattr(made, "mixing", False), getattr(made, "augment", "none") != "none"
        if mixing or augment:
            fits = " or ".join(n for n, r in RECIPES.items() if r.family == entry.task)
            what = "image augmentation and Mixup/CutMix" if mixing else f"{recipe.family} augmentation"
            raise ConfigError(f"dataset {entry.name} ({entry.summary}) cannot take {what}; use --recipe {fits} (the "
                              f"{cfg.recipe} recipe is made for {recipe.family} runs).")
    options = getattr(cfg, entry.task)
    augment = getattr(options, "augment", "none")
    mixing = getattr(options, "mixing", False)
    if augment not in entry.augments:
        raise ConfigError(f"dataset {entry.name} ({entry.summary}) takes no augmentation; give --augment none.")
    if mixing and not entry.mixing:
        raise ConfigError(f"dataset {entry.name} ({entry.summary}) cannot take Mixup/CutMix; give --mixup-prob 0.")


@contextmanager
def deferred_notes() -> Iterator[list[str]]:
    """Within the block, the notes :func:`make_config` would print go into the list yielded instead, for the caller
    to print with :func:`say_notes` once every check has passed (a refused command prints its one line, and nothing
    else)."""
    global _deferred
    outer, _deferred = _deferred, []
    try:
        yield _deferred
    finally:
        _deferred = outer


_deferred: list[str] | None = None
_noted: set[str] = set()  # each note once per process (a grid builds the same config for every variant and seed)


def _note(note: str | None) -> None:
    if not note or note in _noted:
        return
    if _deferred is not None:
        if note not in _deferred:
            _deferred.append(note)
    else:
        say_notes([note])


def say_notes(notes: list[str]) -> None:
    """Print each note on stderr, a note of :func:`make_config` once per process."""
    for note in notes:
        if note not in _noted:
            print(note, file=sys.stderr, flush=True)
        if note.startswith("attnlab: note:"):
            _noted.add(note)


def _build(base: TrainConfig | str | None, entries: list[Entry], record: bool = False) -> TrainConfig:
    """The recipe ``base`` (a ``recipe`` entry picks it) with the entries applied, its warm-up fitted, checked."""
    base = next((v for where, k, v in reversed(entries) if (where, k) == ("", "recipe")), base)
    if base is None:
        base = "ns_cifar"
    if isinstance(base, str):
        if base not in RECIPES:
            raise ConfigError(f"unknown recipe {base!r}{did_you_mean(base, RECIPES)}; valid recipes are: "
                              f"{', '.join(RECIPES)}.")
        base = RECIPES[base]
    cfg, given = _apply(base, entries, record)
    family = cfg.family  # the sections of other families hold their defaults: the run reads none of them
    cfg = dataclasses.replace(cfg, families={f: s if f == family else type(s)() for f, s in cfg.families.items()})
    cfg, note = fit_warmup(cfg, given)
    cfg = validate(cfg)
    _note(note)  # said once the config is known to be good, once per process
    return cfg


def make_config(base: TrainConfig | str | None = None, **overrides: Any) -> TrainConfig:
    """``base`` (a TrainConfig or recipe name; a ``recipe`` override picks it) with ``overrides`` applied: flat
    keys (``lr=1e-2``, ``block_size=64``) or sections (``optim={"lr": 1e-2}``).

    Unknown keys raise ConfigError naming the valid keys, a key of another family than the run's one naming the
    family that reads it; values are converted to the field types.
    """
    return _build(base, _layer(overrides, "the overrides"))


def _count(n: float, unit: str) -> str:
    return f"{n:g} {unit}{'' if n == 1 else 's'}"


def fit_warmup(cfg: TrainConfig, given: set[str]) -> tuple[TrainConfig, str | None]:
    """``cfg`` with a recipe's warm-up that is longer than the run cut at the run's end, and the line for stderr
    that says so (a one-epoch or two-step smoke run, as timm and nanoGPT run it), or None. A warm-up the user gave
    (a flag, a config file's key) is left to :func:`validate`, which refuses it."""
    sched = cfg.sched
    if sched.warmup_steps is None and cfg.max_steps is None and sched.warmup_epochs > cfg.epochs \
            and "warmup_epochs" not in given:
        key, old, cut = "warmup_epochs", _count(sched.warmup_epochs, "epoch"), _count(cfg.epochs, "epoch")
        sched = dataclasses.replace(sched, warmup_epochs=float(cfg.epochs))
    elif sched.warmup_steps is not None and cfg.max_steps is not None and sched.warmup_steps > cfg.max_steps \
            and "warmup_steps" not in given:
        key, old, cut = "warmup_steps", _count(sched.warmup_steps, "step"), _count(cfg.max_steps, "step")
        sched = dataclasses.replace(sched, warmup_steps=cfg.max_steps)
    else:
        return cfg, None
    return dataclasses.replace(cfg, sched=sched), (
        f"attnlab: note: the {cfg.recipe} recipe's warm-up of {old} is longer than this run, so it is cut to the "
        f"run's {cut} (the learning rate reaches its peak at the end); give --{key.replace('_', '-')} to set it.")


MAX_YAML_NODES = 100_000  # a config or grid file holds hundreds; aliases can make a 1 KB file expand to 10^9


class _TooLarge(yaml.YAMLError):
    pass


class _BoundedLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a document whose aliases (``*name``) expand it past ``MAX_YAML_NODES``
    values ("billion laughs": each alias is one node to the parser, a whole copy to ``dataclasses.asdict``)."""

    def compose_document(self):
        node = super().compose_document()
        sizes: dict[int, int] = {}

        def size(n: yaml.Node) -> int:  # the node's values with every alias expanded, each shared node once
            if id(n) not in sizes:
                sizes[id(n)] = MAX_YAML_NODES + 1  # while counted: a node that contains itself is unbounded
                children = [c for pair in n.value for c in pair] if isinstance(n, yaml.MappingNode) else \
                    n.value if isinstance(n, yaml.SequenceNode) else []
                total = 1
                for child in children:
                    total += size(child)
                    if total > MAX_YAML_NODES:
                        raise _TooLarge(f"its aliases expand it to more than {MAX_YAML_NODES} values")
                sizes[id(n)] = total
            return sizes[id(n)]

        if node is not None:
            size(node)
        return node


# YAML 1.2's floats without a dot or an exponent sign (1e6, 3e-4): YAML 1.1, which PyYAML follows, reads them as text
_BoundedLoader.add_implicit_resolver("tag:yaml.org,2002:float",
                                     re.compile(r"^[-+]?[0-9][0-9_]*(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
                                     list("-+0123456789"))


def read_yaml(path: str | Path, what: str) -> Any:
    """The YAML document in file ``path`` (None if the file is empty), or ConfigError naming ``what`` and the path
    when it is missing, a directory, unreadable, not text or not YAML, or when its aliases would expand it past
    ``MAX_YAML_NODES`` values."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist; give the path of a YAML file.") from None
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory; give the path of a YAML file in it.") from None
    except PermissionError:
        raise ConfigError(f"{what} {path} cannot be read (permission denied); make it readable.") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{what} {path} is not a text file; give a YAML file of config keys.") from None
    except OSError as err:
        raise ConfigError(f"{what} {path} cannot be read ({err.strerror or err}); give a readable YAML file.") from None
    try:
        return yaml.load(text, Loader=_BoundedLoader)
    except _TooLarge as err:
        raise ConfigError(f"{what} {path} is refused: {err}; write the values out, or use fewer aliases.") from None
    except RecursionError:
        raise ConfigError(f"{what} {path} is nested too deeply to read; a config is a flat mapping of keys.") from None
    except yaml.YAMLError as err:
        raise ConfigError(f"{what} {path} is not valid YAML ({str(err).splitlines()[0]}).") from None


def is_flat_record(data: dict) -> bool:
    """Whether ``data`` is a run's config.yaml written before sections: flat, with the ``world_size`` only the
    trainer records, and every family's keys side by side (the run read its own family's)."""
    return "world_size" in data and not any(isinstance(data.get(n), dict) for n in section_names())


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Read a YAML config (a mapping of config keys, flat or nested by section; ``recipe:`` picks the base) and
    apply ``overrides`` (keyword arguments, e.g. CLI flags): recipe defaults < YAML file < overrides. A run's
    config.yaml from before sections loads too (:func:`is_flat_record`: its other families' keys are dropped)."""
    entries: list[Entry] = []
    record = False
    if path is not None:
        loaded = read_yaml(path, "config file")
        if loaded is None:
            raise ConfigError(f"config file {path} is empty; write config keys into it, such as 'epochs: 10'.")
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {path} must hold a mapping of config keys such as 'epochs: 10', not "
                              f"a {type(loaded).__name__}.")
        bad = next((k for k in loaded if not isinstance(k, str)), None)
        if bad is not None:
            raise ConfigError(f"config file {path} has the key {bad!r}; config keys are names such as 'epochs'.")
        record = is_flat_record(loaded)
        entries += _layer(loaded, f"config file {path}")
    entries += _layer(overrides, "the overrides")
    return _build(None, entries, record)


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    """What config.yaml holds: the top-level keys, then ``optim``, ``sched``, the run's family section (if it has
    keys) and ``run``, each a mapping."""
    import copy

    out: dict[str, Any] = {k: copy.deepcopy(getattr(cfg, k)) for k in TOP_KEYS}
    out.update(optim=dataclasses.asdict(cfg.optim), sched=dataclasses.asdict(cfg.sched))
    own = dataclasses.asdict(getattr(cfg, cfg.family))
    if own:
        out[cfg.family] = own
    out["run"] = dataclasses.asdict(cfg.run)
    return out


def flat_dict(cfg: TrainConfig) -> dict[str, Any]:
    """Every key the run reads, flat (``lr``, ``block_size``, ``device``): the top level, the common sections and
    its family's section."""
    data = config_to_dict(cfg)
    return {k: v for name, value in data.items()
            for k, v in (value.items() if name in section_names() else [(name, value)])}


def flat_settings(data: dict[str, Any]) -> dict[str, Any]:
    """A run's config.yaml (flat from before sections, or sectioned) as the flat keys its run reads, over its
    recipe's values for those it leaves out; lenient, for reports of old runs: a value this version would refuse
    stays as written, and keys of other families than the run's are left out."""
    from attnlab.data.registry import dataset
    from attnlab.errors import AttnlabError

    flat: dict[str, Any] = {}
    for key, value in data.items():
        if key in section_names() and isinstance(value, dict):
            flat.update(value)
        else:
            flat[str(key)] = value
    base = RECIPES.get(str(flat.get("recipe")), TrainConfig())
    try:
        base = base.replace(dataset=str(flat.get("dataset", base.dataset)))
        settings = flat_dict(base)
    except AttnlabError:  # a dataset this version does not know: its keys as written
        return flat
    places = key_places()
    for key, value in flat.items():
        if key in places and "" not in places[key] and not set(places[key]) & {*COMMON_SECTIONS, base.family}:
            continue  # another family's key, which the run did not read
        try:
            settings[key] = coerce(key, value) if key in places else value
        except ConfigError:  # a value this version would refuse still names what was trained
            settings[key] = value
    return settings


MAX_NAME = 200  # a run directory's name, leaving room for the temporary ".<name>.<12 hex>.tmp" (255 bytes)


def run_name(cfg: TrainConfig, spec: str | None = None) -> str:
    """``cfg.run.name`` or ``<model>-<dataset>-<spec>-s<seed>``, made safe as one path component.

    The spec should be the canonical ``str(parse_spec(cfg.attn))``; characters outside ``[A-Za-z0-9._=,+-]``
    become ``_`` (so ``dna(variant=q)+sigma`` -> ``dna_variant=q+sigma``).
    """
    if cfg.run.name:  # a name the user gives is used as it is, or refused: never silently rewritten
        bad = sorted(set(re.sub(r"[A-Za-z0-9._=,+-]", "", cfg.run.name)))
        if bad or cfg.run.name.strip(".") == "":
            suggestion = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", cfg.run.name).strip("_.") or "my_run"
            raise ConfigError(f"run name {cfg.run.name!r} has characters a run directory name cannot carry portably "
                              f"({''.join(bad) or 'dots only'}); use letters, digits and . _ = , + -, such as "
                              f"{suggestion!r}.")
        safe = cfg.run.name
    else:
        spec = cfg.attn if spec is None else spec
        name = "-".join(x for x in (cfg.model, cfg.dataset, cfg.tag, spec) if x) + f"-s{cfg.seed}"
        safe = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", name.replace(" ", "").replace(")", "")).strip("_.")
    if len(safe) > MAX_NAME:
        raise ConfigError(f"run name {safe[:40]}... is {len(safe)} characters long; file systems take names of "
                          f"at most {MAX_NAME} here, so give a shorter --name.")
    return safe
