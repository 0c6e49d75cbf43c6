"""Config sections: a frozen dataclass of training config keys, each declared with :func:`option` (its default, its
help line and its bound), in the manner of detectron2's ``_C.SOLVER`` / ``_C.INPUT`` nodes and timm's argument
groups. The common sections live in :mod:`attnlab.train.config`; each task family's section lives with its Task
(:mod:`attnlab.train.tasks`). Torch-free, so that the config and ``--help`` load without torch.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from attnlab.errors import ConfigError

# A bound: value -> None when it holds, else the clause after "but it must" ("be at least 1", "lie in [0, 1]")
Bound = Callable[[Any], "str | None"]


def option(default: Any, help: str, bound: Bound | None = None, choices: tuple[str, ...] | None = None) -> Any:
    """A section field: ``default`` (a dict default is copied per instance), the ``help`` line of its flag, and what
    its values must satisfy (``bound`` on a non-null value, or one of ``choices``)."""
    meta = {"help": help, "bound": bound, "choices": choices}
    if isinstance(default, dict):
        return field(default_factory=lambda: dict(default), metadata=meta)
    return field(default=default, metadata=meta)


def at_least(least: float) -> Bound:
    return lambda v: None if v >= least else f"be at least {least:g}"


def non_negative(v: Any) -> str | None:
    return None if v >= 0 else "not be negative"


def within(low: float, high: float, *, open_low: bool = False, open_high: bool = False, hint: str = "") -> Bound:
    """``low <= v <= high``, either end open; ``hint`` says which value is usual."""
    text = f"lie in {'(' if open_low else '['}{low:g}, {high:g}{')' if open_high else ']'}" + (f" ({hint})" if hint
                                                                                               else "")

    def bound(v: Any) -> str | None:
        ok = (low < v if open_low else low <= v) and (v < high if open_high else v <= high)
        return None if ok else text
    return bound


@dataclass(frozen=True)
class Section:
    """A group of config keys (subclasses declare them with :func:`option`); :meth:`check` tests each value against
    its field's bound and choices, and a subclass adds the checks that relate its keys to each other."""

    def check(self, cfg: Any) -> None:
        check_fields(self)


def check_fields(obj: Any) -> None:
    """ConfigError for the first field of dataclass ``obj`` whose value is not one of its choices or breaks its
    bound."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        choices, bound = f.metadata.get("choices"), f.metadata.get("bound")
        if choices is not None and value not in choices:
            raise ConfigError(f"config key '{f.name}' is {value!r}, but it must be one of {', '.join(choices)}.")
        why = bound(value) if bound is not None and value is not None else None
        if why:
            raise ConfigError(f"config key '{f.name}' is {value!r}, but it must {why}"
                              f"{' (or null)' if is_optional(type(obj), f.name) else ''}.")


@dataclass(frozen=True)
class NoKeys(Section):
    """A family without keys of its own."""


def is_optional(cls: type, name: str) -> bool:
    return type(None) in typing.get_args(typing.get_type_hints(cls)[name])


def keys_of(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def title(cls: type) -> str:
    """The first line of a section's docstring: its argument group's title in ``--help``."""
    return (cls.__doc__ or cls.__name__).strip().splitlines()[0].rstrip(".")


__all__ = ["NoKeys", "Section", "at_least", "check_fields", "is_optional", "keys_of", "non_negative", "option", "title", "within"]
