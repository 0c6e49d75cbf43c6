"""Helpers for the training tests: a tiny digits config (imported as `from train_helpers import ...`)."""

from __future__ import annotations

import dataclasses

from safetensors.torch import load_file

from attnlab.train import RECIPES

# digits has 1437 training images (80% of 1797): 1437 // 64 = 22 full batches of 64 per epoch.
STEPS_PER_EPOCH_64 = 22


def tiny(runs_dir, **overrides):
    """The demo recipe cut to 2 epochs of batch 64 (about a second per epoch on one free core)."""
    base = dict(epochs=2, batch_size=64, runs_dir=str(runs_dir), progress=False)
    base.update(overrides)
    return dataclasses.replace(RECIPES["demo"], **base)


def weights(path):
    return load_file(str(path))
