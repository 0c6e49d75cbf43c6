"""The registry of attention variants: one entry per method, the single place a new method is announced.

Adding a method is one new file (its module or function) plus one ``register(Variant(...))`` line below. Targets
are ``"module:attribute"`` strings imported on first use, so this file imports nothing from the layers above it.

Kinds, in the order a spec applies them:
- ``kernel``: the attention function itself, an :class:`attnlab.attention.base.AttnlabAttention` subclass;
- ``head``: a transform of each head's output before head merge (``nn.Module`` built from the options);
- ``qk``: changes to queries/keys or their weights, ``apply(model, modules, **options)``;
- ``weight``: weight-side reparametrisations, ``apply(model, modules, **options)``.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any, Callable

from .errors import SpecError

KIND_ORDER = ("kernel", "head", "qk", "weight")


@dataclass(frozen=True)
class Option:
    """One ``key=value`` option of a term: its default (from the paper's main text), type and allowed values."""

    default: Any
    type: type | tuple[type, ...] = float
    choices: tuple[Any, ...] | None = None
    help: str = ""
    minimum: float | None = None

    def parse(self, term: str, key: str, raw: str) -> Any:
        """Coerce the text ``raw`` to this option's type, or raise SpecError naming what is valid."""
        types = self.type if isinstance(self.type, tuple) else (self.type,)
        value: Any = None
        for typ in types:
            try:
                if typ is bool:
                    if raw.lower() not in ("true", "false", "1", "0"):
                        continue
                    value = raw.lower() in ("true", "1")
                elif typ is int:
                    value = int(raw)
                elif typ is float:
                    value = float(raw)
                else:
                    value = typ(raw)
                break
            except ValueError:
                continue
        else:
            if self.choices:
                raise SpecError(f"{term}({key}={raw}) is not valid; {key} is one of: {', '.join(map(str, self.choices))}.")
            names = " or ".join(t.__name__ for t in types)
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} takes a {names}.")
        if self.choices is not None and isinstance(value, str) and value not in self.choices:
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} is one of: {', '.join(map(str, self.choices))}.")
        if self.minimum is not None and not isinstance(value, str) and value < self.minimum:
            raise SpecError(f"{term}({key}={raw}) is not valid; {key} must be at least {self.minimum}.")
        return value


@dataclass(frozen=True)
class Variant:
    """A registry entry: what a spec term means and where its code lives."""

    name: str
    kind: str
    summary: str
    paper: str
    target: str
    options: dict[str, Option] = field(default_factory=dict)
    conflicts: dict[str, str] = field(default_factory=dict)
    demo: bool = True  # trained in `make demo`

    def load(self) -> Callable[..., Any]:
        module, _, attr = self.target.partition(":")
        return getattr(importlib.import_module(module), attr)


VARIANTS: dict[str, Variant] = {}


def register(variant: Variant) -> Variant:
    if variant.kind not in KIND_ORDER:
        raise ValueError(f"unknown variant kind {variant.kind!r}")
    VARIANTS[variant.name] = variant
    return variant


def list_variants() -> list[dict[str, Any]]:
    """The spec table as data: one dict per registered term with its kind, summary, paper and options."""
    return [
        {
            "name": v.name,
            "kind": v.kind,
            "summary": v.summary,
            "paper": v.paper,
            "options": {k: {"default": o.default, "choices": o.choices, "help": o.help} for k, o in v.options.items()},
        }
        for v in VARIANTS.values()
    ]


# ---------------------------------------------------------------------------------------------------------------
# The registry. One line (one entry) per method.
# ---------------------------------------------------------------------------------------------------------------
register(Variant(
    "standard", "kernel", "softmax attention, fused SDPA (timm's)", "Vaswani et al. 2017",
    "attnlab.attention.standard:StandardAttention",
))
