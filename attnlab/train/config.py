"""Training configuration: the NS-Attn paper's CIFAR recipe (Sec. 3.1) as one dataclass, plus named recipes.

Every number of the recipe lives here, named as the paper names it. A config is built from a named recipe
(``RECIPES``), then a YAML file, then explicit overrides (CLI flags), each layer replacing the one before.
"""

from __future__ import annotations

import dataclasses
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from attnlab.errors import ConfigError, did_you_mean


@dataclass
class TrainConfig:
    """One training run. Defaults are the ``ns_cifar`` recipe of the NS-Attn paper (Sec. 3.1: AdamW, warm-up then
    cosine decay, AutoAugment, Mixup/CutMix, label smoothing, repeated augmentation); docs/training.md, "The
    recipe", gives each value and its source."""

    # --- what is trained
    recipe: str = field(default="ns_cifar", metadata={"help": "named recipe the other defaults come from"})
    model: str = field(default="vit_cifar", metadata={"help": "model preset (vit_cifar, swin_cifar, vit_digits) or timm model name"})
    dataset: str = field(default="cifar100", metadata={"help": "dataset name (cifar10, cifar100, digits, ...)"})
    attn: str = field(default="standard", metadata={"help": "attention variant spec, e.g. 'ns' or 'dna(variant=q)+sigma'"})
    seed: int = field(default=0, metadata={"help": "seed for weights, data order, augmentation and mixing"})
    tag: str = field(default="", metadata={"help": "label of a recipe variation in a grid (e.g. no_warmup): part of the "
                                                    "run name, and reports compare variants within each tag"})
    # --- recipe (NS-Attn Sec. 3.1; unstated values from the DeiT/timm defaults the SPT/LSA code uses)
    epochs: int = field(default=100, metadata={"help": "training epochs"})
    batch_size: int = field(default=128, metadata={"help": "training batch size"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate"})
    weight_decay: float = field(default=0.05, metadata={"help": "AdamW weight decay (not applied to biases, norms, embeddings, 1-D params)"})
    warmup_epochs: float = field(default=10, metadata={"help": "epochs of linear warm-up before cosine decay"})
    warmup_lr: float = field(default=1e-6, metadata={"help": "learning rate at the first step of warm-up"})
    min_lr: float = field(default=1e-5, metadata={"help": "learning rate at the end of the cosine decay"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the (mixed) targets"})
    augment: str = field(default="recipe", metadata={"help": "'recipe' (AutoAugment, crop, flip, random erasing) or 'none'"})
    mixup: float = field(default=0.8, metadata={"help": "Mixup beta alpha (0 disables Mixup)"})
    cutmix: float = field(default=1.0, metadata={"help": "CutMix beta alpha (0 disables CutMix)"})
    mixup_prob: float = field(default=0.5, metadata={"help": "probability that a batch is mixed (Mixup or CutMix)"})
    mixup_switch_prob: float = field(default=0.5, metadata={"help": "probability of CutMix rather than Mixup when a batch is mixed"})
    repeated_aug: int = field(default=3, metadata={"help": "repeated augmentation count (1 disables it)"})
    max_steps: int | None = field(default=None, metadata={
        "help": "train this many optimizer steps instead of `epochs` epochs (step-based recipes such as a language "
                "model's); evaluation and a checkpoint every `eval_every` steps"})
    eval_every: int | None = field(default=None, metadata={
        "help": "optimizer steps between evaluations and checkpoints (default: an epoch, one pass over the training "
                "set; required for token streams, which have no passes)"})
    warmup_steps: int | None = field(default=None, metadata={
        "help": "linear warm-up in optimizer steps (replaces warmup_epochs)"})
    block_size: int | None = field(default=None, metadata={
        "help": "language models: tokens per training block (default: the data's, else the model preset's)"})
    eval_iters: int = field(default=20, metadata={
        "help": "language models: validation batches per evaluation (the same blocks every time)"})
    z_loss: float = field(default=0.0, metadata={
        "help": "language models: weight of the z-loss, mean (log sum exp logits)^2 (Wortsman et al. use 1e-4)"})
    beta2: float = field(default=0.999, metadata={"help": "AdamW's second-moment decay (nanoGPT's language models: 0.95)"})
    grad_accum: int = field(default=1, metadata={
        "help": "micro-batches per optimizer step; batch_size stays the global batch, each micro-batch is "
                "batch_size / (grad_accum x ranks)"})
    data_on_device: bool | None = field(default=None, metadata={
        "help": "keep the train set on the device and augment it there per sample (cifar10, cifar100, digits, "
                "synthetic; default: on for those on CUDA, off on the CPU, where torchvision/timm is the reference)"})
    ema: bool = field(default=False, metadata={"help": "also keep, evaluate and checkpoint an exponential moving "
                                                       "average of the weights (timm's ModelEmaV3)"})
    ema_decay: float = field(default=0.9998, metadata={"help": "EMA decay per optimizer step (timm's default)"})
    norm: str = field(default="pre", metadata={"help": "'pre' (timm's pre-LN blocks), 'post' (post-LN, ViT only) or "
                                                     "'none' (no LayerNorm; ViT and sequence models)"})
    optimizer: str = field(default="adamw", metadata={"help": "'adamw', 'lars' (timm's LARS, SGD momentum with layer-wise trust ratio) or 'sgd' (momentum SGD, TimeSformer's)"})
    momentum: float = field(default=0.9, metadata={"help": "momentum of the LARS and SGD optimizers"})
    drop_path: float | None = field(default=None, metadata={"help": "stochastic-depth rate (default: the model preset's)"})
    layer_decay: float | None = field(default=None, metadata={
        "help": "layer-wise learning-rate decay (ViTDet, BEiT): transformer block i of L trains at lr x "
                "layer_decay^(L+1-i), the embeddings at layer_decay^(L+1), heads at lr (default: none)"})
    lr_schedule: str = field(default="cosine", metadata={
        "help": "'cosine' (warm-up, then cosine decay to min_lr) or 'step' (ViTDet's: warm-up, then lr x 0.1 at 8/9 "
                "and again at 26/27 of training)"})
    clip_grad: float | None = field(default=None, metadata={"help": "clip the gradient norm to this value (default: no clipping)"})
    pretrained: bool = field(default=False, metadata={"help": "start from timm's pretrained weights (hub cache, or "
                                                              "--pretrained-file), then apply --attn"})
    pretrained_file: str | None = field(default=None, metadata={"help": "weights to start from: safetensors or a "
                                                                   "weights-only torch file (implies --pretrained)"})
    model_options: dict = field(default_factory=dict, metadata={"help": "extra keyword arguments for build_model"})
    data_options: dict = field(default_factory=dict, metadata={"help": "extra keyword arguments for the dataset"})
    video_metric: str = field(default="top1", metadata={
        "help": "video runs: the metric result.json reports first and a report compares, 'top1' (NTU60, Kinetics) "
                "or 'mean_class_accuracy' (Toyota Smarthome)"})
    # --- how it runs (may change between a run and its resumption)
    device: str = field(default="auto", metadata={"help": "'auto' (cuda if available, else cpu), 'cpu', 'cuda', 'cuda:1', ..."})
    amp: str = field(default="auto", metadata={"help": "'auto' (bf16 autocast on CUDA, fp32 on CPU), 'bf16' or 'none'"})
    compile: bool = field(default=False, metadata={"help": "train and evaluate the model through torch.compile"})
    compile_mode: str = field(default="auto", metadata={
        "help": "torch.compile mode: 'auto' (reduce-overhead, i.e. CUDA graphs, on CUDA; default on the CPU), "
                "'default', 'reduce-overhead', 'max-autotune' or 'max-autotune-no-cudagraphs'"})
    data_dir: str = field(default="data", metadata={"help": "where datasets are stored"})
    download: bool = field(default=False, metadata={"help": "download missing datasets"})
    runs_dir: str = field(default="runs", metadata={"help": "parent directory of run directories"})
    name: str | None = field(default=None, metadata={"help": "run directory name (default: model-dataset-attn-sSEED)"})
    num_workers: int = field(default=2, metadata={"help": "DataLoader worker processes"})
    threads: int | None = field(default=None, metadata={"help": "torch intra-op CPU threads during the run (default: torch's, one per core)"})
    log_every: int = field(default=10, metadata={"help": "update the progress bar every this many steps"})
    probe_every: int = field(default=0, metadata={"help": "every this many steps log attention entropy, max logits and "
                                                          "W_Q W_K^T spectral norms into metrics.jsonl (0: off)"})
    probe_images: int = field(default=64, metadata={"help": "test images the probe runs on (the first ones, in order)"})
    progress: bool = field(default=True, metadata={"help": "show a progress bar per epoch"})
    resume: bool = field(default=False, metadata={"help": "continue the run from its last completed epoch"})
    accept_data_change: bool = field(default=False, metadata={
        "help": "with --resume: continue on data that differs from what the run recorded in data.json (a corpus, "
                "tokenizer, class list or annotation file replaced on purpose), recording the new data"})
    log: str = field(default="none", metadata={"help": "'tensorboard' also writes metrics as TensorBoard scalars into "
                                                       "RUN_DIR/tensorboard (pip install attnlab[tensorboard]), or 'none'"})
    # --- recorded, not configured: the trainer writes it into config.yaml
    world_size: int = field(default=1, metadata={"help": "processes the run trains with (recorded from torchrun's "
                                                         "WORLD_SIZE; a value given here is replaced)"})


# Keys that may differ between a run and its resumption without changing what is computed
# (device and amp do change rounding; they are allowed so that a run can move machines).
RUNTIME_KEYS = frozenset({"device", "amp", "compile", "compile_mode", "data_dir", "download", "runs_dir", "name",
                          "num_workers", "threads", "log_every", "probe_every", "probe_images", "progress",
                          "resume", "log", "world_size", "accept_data_change"})

RECIPES: dict[str, TrainConfig] = {
    # NS-Attn paper Sec. 3.1 (CIFAR-10/100, ViT and Swin).
    "ns_cifar": TrainConfig(),
    # sklearn's 8x8 digits with the tiny vit_digits preset, a few seconds per run on 2 CPU cores. Tuned by hand:
    # the model needs about 1,000 updates, hence batch 16; label smoothing 0.1 was worth about a point; the
    # dataset's 1-pixel shift ("recipe") hurt badly at this resolution; 15 epochs reach about 95% (10 reach 92-95%).
    "demo": TrainConfig(
        recipe="demo", model="vit_digits", dataset="digits", epochs=20, batch_size=64, lr=5e-3,
        weight_decay=0.05, warmup_epochs=1, warmup_lr=1e-4, min_lr=1e-5, label_smoothing=0.1,
        augment="none", mixup=0.0, cutmix=0.0, mixup_prob=0.0, repeated_aug=1, num_workers=0,
        threads=1,  # this model's ops are too small to split: 2 threads cost >10x the CPU time on a busy machine
    ),
    # Moving digits with timesformer_tiny (divided space-time attention), 1-2 minutes per run on 2 CPU cores: batch
    # 16 for enough updates (256 per epoch of 4,096 clips); 192 updates told the sense of motion at 98% (seed 0,
    # docs/methods.md); no augmentation (a flip would reverse the label), no smoothing
    "moving_digits": TrainConfig(
        recipe="moving_digits", model="timesformer_tiny", dataset="moving_digits", epochs=2, batch_size=16, lr=1e-3,
        weight_decay=0.05, warmup_epochs=0.1, warmup_lr=1e-5, min_lr=1e-5, label_smoothing=0.0, augment="none",
        mixup=0.0, cutmix=0.0, mixup_prob=0.0, repeated_aug=1, num_workers=0, threads=1,
    ),
    # TimeSformer fine-tuning as the DnA authors' video configs (Smarthome, NTU): SGD momentum 0.9, lr 0.005, weight
    # decay 1e-4, batch 8, 15 epochs, 8 frames, scale jitter + crop + flip; their step decay (x0.1 at epochs 11 and
    # 14) is a cosine here, the schedule the trainer has
    "timesformer": TrainConfig(
        recipe="timesformer", model="timesformer_base", dataset="video", epochs=15, batch_size=8, lr=0.005,
        optimizer="sgd", momentum=0.9, weight_decay=1e-4, warmup_epochs=0, warmup_lr=0.005, min_lr=5e-5,
        label_smoothing=0.0, augment="recipe", mixup=0.0, cutmix=0.0, mixup_prob=0.0, repeated_aug=1,
    ),
    # LRA ListOps (generated locally) with the lra preset (the padding masked, as LRA and every peer; seq_listops is
    # the unmasked ablation), close to the Nystromformer authors' LRA settings
    # (batch 32, lr 1e-4, about 1,000 warm-up and 5,000 total steps on 96,000 sequences); token sequences take no
    # image augmentation or mixing
    "lra_listops": TrainConfig(
        recipe="lra_listops", model="lra", dataset="listops", epochs=2, batch_size=32, lr=1e-4,
        weight_decay=0.01, warmup_epochs=0.33, warmup_lr=1e-6, min_lr=1e-6, label_smoothing=0.0,
        augment="none", mixup=0.0, cutmix=0.0, mixup_prob=0.0, repeated_aug=1, num_workers=0,
    ),
    # nanoGPT's manner (its train.py, scaled to gpt_tiny on the embedded byte corpus): step-based, AdamW beta2 0.95,
    # weight decay 0.1 on matrices only, linear warm-up then cosine to lr / 10, gradient clipping at 1
    "lm": TrainConfig(
        recipe="lm", model="gpt_tiny", dataset="stdlib", epochs=1, max_steps=2000, eval_every=250, eval_iters=20,
        warmup_steps=100, batch_size=16, block_size=256, lr=1e-3, warmup_lr=0.0, min_lr=1e-4, weight_decay=0.1,
        beta2=0.95, clip_grad=1.0, label_smoothing=0.0, augment="none", mixup=0.0, cutmix=0.0, mixup_prob=0.0,
        repeated_aug=1, num_workers=0, drop_path=None,
    ),
    # the LR-sensitivity study cut to 2 CPU cores (`attnlab compare --preset lm_demo`): gpt_tiny, 64-byte blocks,
    # 150 steps, no warm-up, one thread per run; the training probe every 25 steps (the report's per-layer max logit)
    "lm_demo": TrainConfig(
        recipe="lm_demo", model="gpt_tiny", dataset="stdlib", epochs=1, max_steps=150, eval_every=50, eval_iters=4,
        warmup_steps=0, batch_size=8, block_size=64, lr=1e-3, warmup_lr=0.0, min_lr=1e-4, weight_decay=0.1,
        beta2=0.95, clip_grad=1.0, z_loss=1e-4, label_smoothing=0.0, augment="none", mixup=0.0, cutmix=0.0,
        mixup_prob=0.0, repeated_aug=1, num_workers=0, threads=1, probe_every=25, probe_images=16,
    ),
    # the same study on the Llama-shaped decoder (`attnlab compare --preset lm_demo_llama`): llama_tiny (RoPE,
    # RMSNorm, SwiGLU, 2 key-value heads for 4 query heads), 100 steps of 8 x 64 bytes, so that its 12 runs fit in
    # 3 minutes on 2 cores; the training probe every 20 steps (the per-layer max logit over training)
    "lm_demo_llama": TrainConfig(
        recipe="lm_demo_llama", model="llama_tiny", dataset="stdlib", epochs=1, max_steps=100, eval_every=50,
        eval_iters=4, warmup_steps=0, batch_size=8, block_size=64, lr=1e-3, warmup_lr=0.0, min_lr=1e-4,
        weight_decay=0.1, beta2=0.95, clip_grad=1.0, z_loss=1e-4, label_smoothing=0.0, augment="none", mixup=0.0,
        cutmix=0.0, mixup_prob=0.0, repeated_aug=1, num_workers=0, threads=1, probe_every=20, probe_images=16,
    ),
    # ViTDet's recipe (Li et al., arXiv 2203.16527; detectron2's ViT-B Mask R-CNN: AdamW, lr 1e-4, weight decay 0.1,
    # layer-wise decay 0.7, drop-path 0.1, 250 warm-up iterations from 0.001 x lr, x0.1 at 8/9 and 26/27 of
    # training, large-scale jitter) in the DnA paper's Table 9 setting: ViT-B at 224x224, 50 epochs, batch 32
    # (its Table 5); no Mixup, label smoothing or repeated augmentation in detection
    "vitdet": TrainConfig(
        recipe="vitdet", model="vitdet_base_224", dataset="coco", epochs=50, batch_size=32, lr=1e-4,
        weight_decay=0.1, layer_decay=0.7, lr_schedule="step", warmup_epochs=0, warmup_steps=250, warmup_lr=1e-7,
        min_lr=0.0, drop_path=0.1, label_smoothing=0.0, augment="recipe", mixup=0.0, cutmix=0.0, mixup_prob=0.0,
        repeated_aug=1, num_workers=4,
    ),
    # the tiny ViTDet on the synthetic shapes set from scratch, on 2 CPU cores: box AP 25.7, AP50 42.2, mask AP 25.4
    # after these 4 epochs (256 steps of 8 images; 24 min on a loaded machine, docs/training.md); a larger
    # learning rate and a cosine schedule, as a from-scratch model needs
    "detect_demo": TrainConfig(
        recipe="detect_demo", model="vitdet_tiny", dataset="shapes", epochs=4, batch_size=8, lr=5e-4,
        weight_decay=0.05, warmup_epochs=0, warmup_steps=20, warmup_lr=1e-6, min_lr=1e-6, label_smoothing=0.0,
        augment="recipe", mixup=0.0, cutmix=0.0, mixup_prob=0.0, repeated_aug=1, clip_grad=1.0, num_workers=0,
        threads=1,
    ),
}

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
    # NS-Attn Table 1: both backbones and datasets, seeds 0, 1, 3 (hours per run on a GPU)
    "ns_table1": {"recipe": "ns_cifar", "variants": ["standard", "ns"], "seeds": [0, 1, 3],
                  "datasets": ["cifar10", "cifar100"], "models": ["vit_cifar", "swin_cifar"],
                  "runs_dir": "runs/ns_attn_table1"},
}

_CHOICES = {"amp": ("auto", "bf16", "none"), "augment": ("recipe", "none"), "norm": ("pre", "post", "none"),
            "optimizer": ("adamw", "lars", "sgd"), "log": ("none", "tensorboard"),
            "video_metric": ("top1", "mean_class_accuracy"), "lr_schedule": ("cosine", "step"),
            "compile_mode": ("auto", "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")}


GRID_KEYS = ("variants", "seeds", "datasets", "models", "runs_dir", "variations", "jobs", "launcher", "base")


def check_grid(grid: dict[str, Any], extra_keys: Any, source: str) -> None:
    """ConfigError unless the grid's own values (see ``attnlab.train.grid.load_grid``) have their types and
    ``extra_keys`` (top-level keys left for TrainConfig) are config keys; ``source`` names where they came from."""
    for key in extra_keys:
        if key not in config_keys():
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


def config_keys() -> list[str]:
    return [f.name for f in dataclasses.fields(TrainConfig)]


_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string",
               dict: "a mapping such as '{depth: 2}'"}


def type_words(key: str) -> str:
    """What config key ``key`` accepts, in words ('an integer', 'a number or null', ...)."""
    typ = typing.get_type_hints(TrainConfig)[key]
    args = [a for a in typing.get_args(typ) if a is not type(None)]
    words = _TYPE_WORDS.get(args[0] if args else typ, getattr(typ, "__name__", str(typ)))
    return words + (" or null" if len(args) < len(typing.get_args(typ)) else "")


def coerce(key: str, value: Any) -> Any:
    """``value`` (YAML or command-line text) converted to config key ``key``'s type, or ConfigError."""
    typ = typing.get_type_hints(TrainConfig)[key]
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
                value = yaml.safe_load(value) or {}
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


MAX_SEED = 2**63 - 1  # the largest seed every generator takes (torch's is 64-bit, int64 in tensors)


def validate(cfg: TrainConfig) -> TrainConfig:
    """Check value ranges; return cfg unchanged or raise ConfigError with one sentence."""
    for key, allowed in _CHOICES.items():
        if getattr(cfg, key) not in allowed:
            raise ConfigError(f"config key '{key}' is {getattr(cfg, key)!r}, but it must be one of {', '.join(allowed)}.")
    if cfg.threads is not None and cfg.threads < 1:
        raise ConfigError(f"config key 'threads' is {cfg.threads}, but it must be at least 1 (or null for torch's default).")
    for key in ("epochs", "batch_size", "repeated_aug", "log_every", "probe_images", "eval_iters", "grad_accum"):
        if getattr(cfg, key) < 1:
            raise ConfigError(f"config key '{key}' is {getattr(cfg, key)}, but it must be at least 1.")
    for key in ("lr", "weight_decay", "warmup_epochs", "warmup_lr", "min_lr", "mixup", "cutmix", "num_workers",
                "momentum", "probe_every"):
        if getattr(cfg, key) < 0:
            raise ConfigError(f"config key '{key}' is {getattr(cfg, key)}, but it must not be negative.")
    for key in ("label_smoothing", "mixup_prob", "mixup_switch_prob", "drop_path"):
        if getattr(cfg, key) is not None and not 0.0 <= getattr(cfg, key) <= 1.0:
            raise ConfigError(f"config key '{key}' is {getattr(cfg, key)}, but it must lie in [0, 1].")
    if not 0 <= cfg.seed <= MAX_SEED:
        raise ConfigError(f"config key 'seed' is {cfg.seed}, but it must be an integer from 0 to 2**63 - 1 (torch and "
                          "NumPy seed their generators with non-negative integers).")
    for key, hint in (("momentum", "LARS keeps that share of the previous step; 0.9 is usual"),
                      ("ema_decay", "0.9998 averages about the last 5,000 steps"), ("z_loss", "Wortsman et al.: 1e-4")):
        if not 0.0 <= getattr(cfg, key) < 1.0:
            raise ConfigError(f"config key '{key}' is {getattr(cfg, key)}, but it must lie in [0, 1) ({hint}).")
    if cfg.min_lr > cfg.lr:
        raise ConfigError(f"config key 'min_lr' is {cfg.min_lr}, above lr {cfg.lr}; the cosine decay ends at min_lr, "
                          f"so give --min-lr at most {cfg.lr} (or a larger --lr).")
    if cfg.warmup_steps is None and cfg.max_steps is None and cfg.warmup_epochs > cfg.epochs:
        raise ConfigError(f"config key 'warmup_epochs' is {cfg.warmup_epochs:g}, longer than the {cfg.epochs} epochs "
                          f"of training; give --warmup-epochs at most {cfg.epochs} (or more --epochs).")
    if cfg.warmup_steps is not None and cfg.max_steps is not None and cfg.warmup_steps > cfg.max_steps:
        raise ConfigError(f"config key 'warmup_steps' is {cfg.warmup_steps}, longer than the {cfg.max_steps} steps of "
                          f"training (max_steps); give --warmup-steps at most {cfg.max_steps}.")
    if not 0.0 < cfg.beta2 < 1.0:
        raise ConfigError(f"config key 'beta2' is {cfg.beta2}, but it must lie in (0, 1).")
    if cfg.layer_decay is not None and not 0.0 < cfg.layer_decay <= 1.0:
        raise ConfigError(f"config key 'layer_decay' is {cfg.layer_decay}, but it must lie in (0, 1] (ViTDet uses 0.7 "
                          "for ViT-B; null for none).")
    if cfg.clip_grad is not None and not cfg.clip_grad > 0:
        raise ConfigError(f"config key 'clip_grad' is {cfg.clip_grad}, but it must be positive (or null for no "
                          "clipping).")
    for key, least in (("max_steps", 1), ("eval_every", 1), ("warmup_steps", 0), ("block_size", 1)):
        if getattr(cfg, key) is not None and getattr(cfg, key) < least:
            raise ConfigError(f"config key '{key}' is {getattr(cfg, key)}, but it must be at least {least} "
                              "(or null).")
    if cfg.batch_size % cfg.grad_accum:
        raise ConfigError(f"batch_size {cfg.batch_size} must split evenly into grad_accum={cfg.grad_accum} "
                          f"micro-batches; use a multiple of {cfg.grad_accum}.")
    _check_data(cfg)
    _check_family_keys(cfg)
    from attnlab.spec import parse_spec  # torch-free: a spec typo is one line before any model code loads

    parse_spec(cfg.attn)
    if uses_mixing(cfg) and cfg.batch_size % 2:
        raise ConfigError(f"batch_size is {cfg.batch_size}, but Mixup/CutMix pair each image with the batch "
                          "reversed and need an even batch size.")
    return cfg


def _check_data(cfg: TrainConfig) -> None:
    """The dataset is in the table and takes the recipe's augmentation and mixing (the table is torch-free)."""
    from attnlab.data.registry import dataset

    entry = dataset(cfg.dataset)
    if (uses_mixing(cfg) and not entry.mixing) or cfg.augment not in entry.augments:
        what = "image augmentation and Mixup/CutMix" if entry.task != "image" else "Mixup/CutMix"
        recipes = [name for name, r in RECIPES.items() if dataset(r.dataset).task == entry.task
                   and (not uses_mixing(r) or entry.mixing) and r.augment in entry.augments]
        use = f"--recipe {' or '.join(recipes)}, or " if recipes else ""
        raise ConfigError(f"dataset {entry.name} ({entry.summary}) cannot take {what}; use {use}--augment none "
                          f"--mixup-prob 0.")


# config keys that only one task family reads: given (away from their defaults) to another family, they would be
# ignored without a word, so they are refused naming the family
FAMILY_KEYS = {"z_loss": "lm", "block_size": "lm", "eval_iters": "lm", "video_metric": "video"}


def _check_family_keys(cfg: TrainConfig) -> None:
    """ConfigError for a key of ``FAMILY_KEYS`` set on a run of another task family."""
    from attnlab.data.registry import dataset

    task = dataset(cfg.dataset).task
    defaults = TrainConfig()
    for key, family in FAMILY_KEYS.items():
        if family != task and getattr(cfg, key) != getattr(defaults, key):
            raise ConfigError(f"--{key.replace('_', '-')} (config key '{key}', {getattr(cfg, key)} here) applies to "
                              f"{family} runs only, and dataset {cfg.dataset} makes this a {task} run; drop it.")


def uses_mixing(cfg: TrainConfig) -> bool:
    return cfg.mixup_prob > 0 and (cfg.mixup > 0 or cfg.cutmix > 0)


def make_config(base: TrainConfig | str | None = None, **overrides: Any) -> TrainConfig:
    """``base`` (a TrainConfig or recipe name; a ``recipe`` override picks it) with ``overrides`` applied.

    Unknown keys raise ConfigError naming the valid keys; values are converted to the field types.
    """
    valid = config_keys()
    unknown = sorted((str(k) for k in set(overrides) - set(valid)), key=str)
    if unknown:
        raise ConfigError(f"unknown config key {unknown[0]!r}{did_you_mean(unknown[0], valid)}; valid keys are: "
                          f"{', '.join(valid)}.")
    base = overrides.get("recipe", base)
    if base is None:
        base = "ns_cifar"
    if isinstance(base, str):
        if base not in RECIPES:
            raise ConfigError(f"unknown recipe {base!r}{did_you_mean(base, RECIPES)}; valid recipes are: "
                              f"{', '.join(RECIPES)}.")
        base = RECIPES[base]
    values = {k: coerce(k, v) for k, v in overrides.items()}
    cfg, note = fit_warmup(dataclasses.replace(base, **values), given=set(values))
    cfg = validate(cfg)
    if note and note not in _noted:  # said once the config is known to be good, once per process
        _noted.add(note)
        print(note, file=sys.stderr, flush=True)
    return cfg


def _count(n: float, unit: str) -> str:
    return f"{n:g} {unit}{'' if n == 1 else 's'}"


_noted: set[str] = set()  # each note once per process (a grid builds the same config for every variant and seed)


def fit_warmup(cfg: TrainConfig, given: set[str]) -> tuple[TrainConfig, str | None]:
    """``cfg`` with a recipe's warm-up that is longer than the run cut at the run's end, and the line for stderr
    that says so (a one-epoch or two-step smoke run, as timm and nanoGPT run it), or None. A warm-up the user gave
    (a flag, a config file's key) is left to :func:`validate`, which refuses it."""
    if cfg.warmup_steps is None and cfg.max_steps is None and cfg.warmup_epochs > cfg.epochs \
            and "warmup_epochs" not in given:
        key, old, cut = "warmup_epochs", _count(cfg.warmup_epochs, "epoch"), _count(cfg.epochs, "epoch")
        cfg = dataclasses.replace(cfg, warmup_epochs=float(cfg.epochs))
    elif cfg.warmup_steps is not None and cfg.max_steps is not None and cfg.warmup_steps > cfg.max_steps \
            and "warmup_steps" not in given:
        key, old, cut = "warmup_steps", _count(cfg.warmup_steps, "step"), _count(cfg.max_steps, "step")
        cfg = dataclasses.replace(cfg, warmup_steps=cfg.max_steps)
    else:
        return cfg, None
    return cfg, (f"attnlab: note: the {cfg.recipe} recipe's warm-up of {old} is longer than this run, so it is cut "
                 f"to the run's {cut} (the learning rate reaches its peak at the end); give "
                 f"--{key.replace('_', '-')} to set it.")


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


def load_config(path: str | Path | None = None, **overrides: Any) -> TrainConfig:
    """Read a YAML config (a mapping of TrainConfig keys; ``recipe:`` picks the base) and apply ``overrides``
    (keyword arguments, e.g. CLI flags): recipe defaults < YAML file < overrides."""
    data: dict[str, Any] = {}
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
        data.update(loaded)
    data.update(overrides)
    return make_config(None, **data)


def config_to_dict(cfg: TrainConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


MAX_NAME = 200  # a run directory's name, leaving room for the temporary ".<name>.<12 hex>.tmp" (255 bytes)


def run_name(cfg: TrainConfig, spec: str | None = None) -> str:
    """``cfg.name`` or ``<model>-<dataset>-<spec>-s<seed>``, made safe as one path component.

    The spec should be the canonical ``str(parse_spec(cfg.attn))``; characters outside ``[A-Za-z0-9._=,+-]``
    become ``_`` (so ``dna(variant=q)+sigma`` -> ``dna_variant=q+sigma``).
    """
    if cfg.name:  # a name the user gives is used as it is, or refused: never silently rewritten
        bad = sorted(set(re.sub(r"[A-Za-z0-9._=,+-]", "", cfg.name)))
        if bad or cfg.name.strip(".") == "":
            suggestion = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", cfg.name).strip("_.") or "my_run"
            raise ConfigError(f"run name {cfg.name!r} has characters a run directory name cannot carry portably "
                              f"({''.join(bad) or 'dots only'}); use letters, digits and . _ = , + -, such as "
                              f"{suggestion!r}.")
        safe = cfg.name
    else:
        spec = cfg.attn if spec is None else spec
        name = "-".join(x for x in (cfg.model, cfg.dataset, cfg.tag, spec) if x) + f"-s{cfg.seed}"
        safe = re.sub(r"[^A-Za-z0-9._=,+-]+", "_", name.replace(" ", "").replace(")", "")).strip("_.")
    if len(safe) > MAX_NAME:
        raise ConfigError(f"run name {safe[:40]}... is {len(safe)} characters long; file systems take names of "
                          f"at most {MAX_NAME} here, so give a shorter --name.")
    return safe
