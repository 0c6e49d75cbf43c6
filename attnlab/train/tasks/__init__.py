"""Task families, one :class:`~attnlab.train.tasks.base.Task` subclass each (image and sequence classification,
language modelling, detection, video), named by a dataset's table entry. Each declares its config section (the keys
only its runs read) and the models it trains beside it. Adding a family is one file plus one line below; targets
are "module:Class" strings imported on first use, and the modules import torch only inside their methods, so that
the config reads the sections without torch.
"""

from __future__ import annotations

import importlib
from functools import cache

from attnlab.errors import ConfigError

TASKS: dict[str, str] = {
    "image": "attnlab.train.tasks.classify:ImageClassification",
    "sequence": "attnlab.train.tasks.classify:SequenceClassification",
    "lm": "attnlab.train.tasks.lm:LanguageModelling",
    "video": "attnlab.train.tasks.video:VideoClassification",
    "detect": "attnlab.train.tasks.detect:Detection",
    "vlm": "attnlab.train.tasks.vlm:VideoQA",
}


@cache
def task_class(name: str) -> type:
    """The Task subclass of family ``name``."""
    if name not in TASKS:
        raise ConfigError(f"no task family {name!r} is registered; known families are {', '.join(TASKS)}.")
    module, _, attr = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


def sections() -> dict[str, type]:
    """Each family's config section class, in the order of :data:`TASKS`."""
    return {name: task_class(name).section for name in TASKS}


def family_of_model(name: str) -> str | None:
    """The family whose presets include model ``name`` (a detector preset: detect; a GPT: lm; ...), None for a name
    that is no preset (a timm model, or a typo that building names)."""
    return next((family for family in TASKS if name in task_class(family).presets()), None)


__all__ = ["TASKS", "family_of_model", "sections", "task_class"]
