"""Training: the NS-Attn paper's recipe, checkpoint and resume, metrics, and grids of runs.

    from attnlab.train import RECIPES, train
    result = train(RECIPES["demo"].replace(attn="ns", seed=1))

The config names load eagerly (they need only PyYAML); the loop, optimizer and grid runner, which import torch
and timm, load on first use so that ``attnlab --help`` stays quick.
"""

import importlib

from .config import GRID_PRESETS, RECIPES, TrainConfig, load_config, make_config, run_name

_LAZY = {
    "train": "loop", "Run": "run", "Plan": "run", "run_dir_of": "run", "load_run": "run", "resolve_device": "run",
    "evaluate": "tasks.classify",
    "run_grid": "grid", "load_grid": "grid", "split_specs": "grid", "demo_variants": "grid",
    "param_groups": "optim", "no_weight_decay": "optim", "build_optimizer": "optim", "build_scheduler": "optim",
    "save_checkpoint": "checkpoint", "load_checkpoint": "checkpoint", "atomic_write": "checkpoint",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GRID_PRESETS", "RECIPES", "TrainConfig", "load_config", "make_config", "run_name", *_LAZY]
