"""Errors a user can cause. Each carries one clear sentence; the CLI prints it and exits with code 2."""

from __future__ import annotations

from collections.abc import Iterable


class AttnlabError(Exception):
    """Base class of every error a user can cause (bad spec, model, dataset, config key...)."""


class SpecError(AttnlabError, ValueError):
    """The attention variant spec string is malformed, names an unknown method or key, or combines terms that cannot mean anything."""


class UnsupportedModelError(AttnlabError, TypeError):
    """The model has no attention module that attnlab knows how to replace."""


class ModelNotFoundError(AttnlabError, ValueError):
    """The model name is neither an attnlab preset nor a timm model."""


class DatasetError(AttnlabError, ValueError):
    """The dataset name is unknown, or its files are missing or malformed."""


class ConfigError(AttnlabError, ValueError):
    """A config file or option has an unknown key or an invalid value."""


class NonFiniteLossError(AttnlabError, RuntimeError):
    """Training produced a NaN or infinite loss; raised with the epoch and step."""

    exit_code = 3


def did_you_mean(name: object, valid: Iterable[str]) -> str:
    """' (did you mean 'x'?)' for the valid name nearest to ``name``, or '' if none is near enough."""
    import difflib

    close = difflib.get_close_matches(str(name), list(valid), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""
