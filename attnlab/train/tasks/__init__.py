"""Task families, one :class:`~attnlab.train.tasks.base.Task` subclass each (image and sequence classification,
language modelling, detection, video), named by a dataset's table entry. Adding a family is one file plus one line
below; targets are "module:Class" strings imported on first use, so that this table loads no torch.
"""

from __future__ import annotations

import importlib

from attnlab.errors import ConfigError

TASKS: dict[str, str] = {
    "image": "attnlab.train.tasks.classify:ImageClassification",
    "sequence": "attnlab.train.tasks.classify:SequenceClassification",
    "lm": "attnlab.train.tasks.lm:LanguageModelling",
    "video": "attnlab.train.tasks.video:VideoClassification",
    "detect": "attnlab.train.tasks.detect:Detection",
}


def task_class(name: str) -> type:
    """The Task subclass of family ``name``."""
    if name not in TASKS:
        raise ConfigError(f"no task family {name!r} is registered; known families are {', '.join(TASKS)}.")
    module, _, attr = TASKS[name].partition(":")
    return getattr(importlib.import_module(module), attr)


__all__ = ["TASKS", "task_class"]
