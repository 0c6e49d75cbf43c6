"""The variant spec: one string names a model's attention.

``name(key=value, ...)`` terms joined by ``+``, e.g. ``"ns"``, ``"ns(steps=2)"``, ``"dna(variant=q)+ns+sigma"``.
Whitespace is ignored. Each term's name and keys come from the registry in :mod:`attnlab.variants`; values are
coerced to the option's type, and options equal to their default are dropped, so that ``str(parse_spec(s))`` is a
canonical name: ``parse_spec(str(spec)) == spec`` always, and ``str(parse_spec(s)) == s`` for canonical ``s``.

A list of specs (``--attn standard,dna(variant=q,alpha_init=1)``, a grid's ``variants:``) is split by
:func:`split_specs` at the commas outside parentheses, the commas inside separating a term's options.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from .errors import SpecError
from .variants import KIND_ORDER, VARIANTS, Variant

_TERM = re.compile(r"^([A-Za-z_][A-Za-z0-9_]*)(?:\((.*)\))?$")


def format_value(value: Any) -> str:
    """Spec-syntax text of an option value: ``1e-8`` not ``1e-08``, ``true`` not ``True``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if value.is_integer() and abs(value) < 1e15:
            return str(int(value))
        text = repr(value)
        if "e" in text:
            mantissa, exponent = text.split("e")
            text = f"{mantissa}e{int(exponent)}"
        return text
    return str(value)


@dataclass(frozen=True)
class Term:
    """One ``name(key=value, ...)`` term; ``options`` holds only the keys that differ from their defaults."""

    name: str
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def variant(self) -> Variant:
        return VARIANTS[self.name]

    @property
    def kind(self) -> str:
        return self.variant.kind

    def resolved(self) -> dict[str, Any]:
        """Every option of this term, defaults filled in."""
        out = {key: opt.default for key, opt in self.variant.options.items()}
        out.update(self.options)
        return out

    def __str__(self) -> str:
        if not self.options:
            return self.name
        return f"{self.name}({','.join(f'{k}={format_value(v)}' for k, v in self.options)})"


@dataclass(frozen=True)
class Spec:
    """A parsed variant spec: at most one attention kernel, then head-output, q/k and weight terms."""

    terms: tuple[Term, ...] = field(default_factory=tuple)

    def of_kind(self, kind: str) -> tuple[Term, ...]:
        return tuple(t for t in self.terms if t.kind == kind)

    @property
    def kernel(self) -> Term:
        """The attention-function term; ``standard`` when the spec names none."""
        kernels = self.of_kind("kernel")
        return kernels[0] if kernels else Term("standard")

    def get(self, name: str) -> Term | None:
        return next((t for t in self.terms if t.name == name), None)

    def __contains__(self, name: str) -> bool:
        return self.get(name) is not None

    def __str__(self) -> str:
        shown = [t for t in self.terms if not (t.name == "standard" and len(self.terms) > 1)]
        return "+".join(str(t) for t in shown) or "standard"


def _parse_term(text: str) -> Term:
    match = _TERM.match(text)
    if not match:
        raise SpecError(f"cannot read spec term {text!r}: write name or name(key=value, ...), e.g. 'ns(steps=2)'.")
    name, body = match.group(1), match.group(2)
    if name not in VARIANTS:
        raise SpecError(f"unknown attention variant {name!r}; valid names are: {', '.join(VARIANTS)}.")
    variant = VARIANTS[name]
    given: dict[str, Any] = {}
    for item in filter(None, (body or "").split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not key or not raw:
            raise SpecError(f"cannot read option {item!r} of {name!r}: write key=value, e.g. '{name}(key=value)'.")
        if key == "impl" and "backend" in variant.options:  # the option's name before the one dispatcher
            key, raw = "backend", {"torch": "explicit"}.get(raw, raw)
        if key not in variant.options:
            valid = ", ".join(variant.options) or "none"
            raise SpecError(f"{name!r} has no option {key!r}; its options are: {valid}.")
        if key in given:
            raise SpecError(f"option {key!r} of {name!r} is given twice.")
        given[key] = variant.options[key].parse(name, key, raw)
    # keys in the registry's order, defaults dropped: one experiment, one name
    options = tuple((k, given[k]) for k in variant.options if k in given and given[k] != variant.options[k].default)
    return Term(name, options)


def parse_spec(spec: str | Spec | None) -> Spec:
    """Parse a variant spec string (``"dna(variant=q)+ns+sigma"``) into a :class:`Spec`.

    Raises :class:`~attnlab.errors.SpecError` naming the valid choices for unknown names, keys or values, and
    explaining why for combinations that cannot mean anything (two kernels, ``sigma+specnorm``, ``qkclip+qknorm``).
    """
    if isinstance(spec, Spec):
        return spec
    if spec is None:
        spec = "standard"
    if not isinstance(spec, str):
        raise SpecError(f"a variant spec is a string like 'ns+sigma', not {type(spec).__name__}.")
    text = re.sub(r"\s+", "", spec)
    if not text:
        raise SpecError("the variant spec is empty; use 'standard' for plain softmax attention.")
    terms = [_parse_term(part) for part in re.split(r"\+(?![^()]*\))", text)]  # '+' inside (...) is a value
    names = [t.name for t in terms]
    for name in set(names):
        if names.count(name) > 1:
            raise SpecError(f"{name!r} appears more than once in spec {spec!r}.")
    kernels = [t.name for t in terms if t.kind == "kernel"]
    if len(kernels) > 1:
        raise SpecError(f"spec {spec!r} names {len(kernels)} attention kernels ({', '.join(kernels)}); a model has one.")
    for term in terms:
        for other, why in term.variant.conflicts.items():
            if other in names:
                raise SpecError(f"'{term.name}' cannot be combined with '{other}': {why}.")
    # canonical order: kernel, head-output transforms, q/k terms, weight terms; stable within a kind
    terms.sort(key=lambda t: KIND_ORDER.index(t.kind))
    return Spec(tuple(terms))


def split_specs(text: str) -> list[str]:
    """Split a comma-separated list of specs at the commas outside parentheses, dropping empty items and whitespace
    around them: ``"standard, dna(variant=q,alpha_init=1)+ns"`` -> ``["standard", "dna(variant=q,alpha_init=1)+ns"]``.

    Every place that reads a list of specs from text (the CLI's ``--attn``, grid files) splits with this function.
    Unbalanced parentheses are left for :func:`parse_spec` to report.
    """
    parts, current, depth = [], [], 0
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth = max(depth - 1, 0)  # a stray ')' must not swallow the commas after it
        elif ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
            continue
        current.append(ch)
    parts.append("".join(current))
    return [p.strip() for p in parts if p.strip()]
