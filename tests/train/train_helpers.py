"""Helpers for the training tests: a tiny digits config (imported as `from train_helpers import ...`)."""

from __future__ import annotations

from safetensors.torch import load_file

from attnlab.train import RECIPES

# digits has 1437 training images (80% of 1797): 1437 // 64 = 22 full batches of 64 per epoch.
STEPS_PER_EPOCH_64 = 22


def tiny(runs_dir, **overrides):
    """The demo recipe cut to 2 epochs of batch 64 (about a second per epoch on one free core)."""
    base = dict(epochs=2, batch_size=64, runs_dir=str(runs_dir), progress=False)
    base.update(overrides)
    return RECIPES["demo"].replace(**base)


def weights(path):
    return load_file(str(path))


def arm_kill(builder: str = "build_model") -> str:
    """The start of a training script run as a process of its own (argv[-1] = kill_at): ``attnlab.models.<builder>``
    is wrapped so that the process SIGKILLs itself at the kill_at-th training forward (0: never). Used by the
    SIGKILL-then-resume tests of every task family."""
    return _ARM_KILL.replace("build_model", builder)


_ARM_KILL = """
import dataclasses, json, os, signal, sys
import attnlab.models as models
from attnlab.train import RECIPES, make_config, train

kill_at = int(sys.argv[-1])
build = models.build_model

def build_and_arm(*args, **kwargs):
    model = build(*args, **kwargs)
    count = [0]
    def hook(module, inputs, output):
        if module.training:
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
    model.register_forward_hook(hook)
    return model

models.build_model = build_and_arm
"""
ARM_KILL = arm_kill()
