"""Helpers for the tests against Hugging Face transformers models."""

from __future__ import annotations

import torch


def move_norms_and_biases(model):
    """A transformers model with its norms drawn from [0.5, 1.5] and its biases from N(0, 1), in place (they start at
    1 and 0, where a dropped or misplaced one would not show); returns the model."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_()
    return model
