"""The value rules of the language models' constructor options, shared by :class:`~attnlab.models.gpt.GPT` and
:class:`~attnlab.models.llama.Llama` and by the loaders that read a checkpoint's own config (a Hugging Face
``config.json``, nanoGPT's ``model_args``). Each rule refuses a value in one :class:`ConfigError` sentence that names
the key as the user wrote it, the value, and a value that would be right:

    <owner>'s <key> is <value>, not <rule>; give <right>.

Zero is never a default (an unset option is ``None``), booleans are ``True`` / ``False`` only, and sizes are integers,
so that what a run records in ``config.yaml`` is what it trained.
"""

from __future__ import annotations

import math
from numbers import Real

from ..errors import ConfigError


def refuse(owner: str, key: str, value: object, rule: str, right: str) -> ConfigError:
    """The one-sentence refusal of ``value`` for ``key``."""
    return ConfigError(f"{owner}'s {key} is {value!r}, not {rule}; give {right}.")


def is_int(value: object) -> bool:
    """An integer that is not a boolean (YAML's ``true`` is not a size)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(owner: str, key: str, value: object, right: object) -> int:
    """``value`` if it is an integer >= 1, else the refusal with ``right`` as the example."""
    if not is_int(value) or value < 1:
        raise refuse(owner, key, value, "a positive integer", f"one such as {right}")
    return value


def flag(owner: str, key: str, value: object) -> bool:
    """``value`` if it is ``True`` or ``False`` (not 0, 1, 'yes' or 'maybe')."""
    if not isinstance(value, bool):
        raise refuse(owner, key, value, "a boolean", "true or false")
    return value


def real(value: object) -> float | None:
    """``value`` as a float if it is a real number (not a boolean, not a string), else None."""
    if isinstance(value, bool) or not isinstance(value, Real):
        return None
    return float(value)


def finite_above(owner: str, key: str, value: object, low: float, right: str, high: float = math.inf) -> float:
    """``value`` as a float if it is a finite real number in (low, high], else the refusal."""
    x = real(value)
    if x is None or not (math.isfinite(x) and low < x <= high):
        rule = f"a finite number above {low:g}" + (f" and at most {high:.4g}" if math.isfinite(high) else "")
        raise refuse(owner, key, value, rule, right + _yaml_text(value))
    return x


def _yaml_text(value: object) -> str:
    """A note for a number given as text (quoted in YAML, a string in a config.json), with the spelling that is the
    number."""
    try:
        number = float(value) if isinstance(value, str) else None
    except ValueError:
        return ""
    if number is None:
        return ""
    mantissa, _, exponent = repr(number).partition("e")
    spelled = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{exponent}" if exponent else repr(number)
    return f" ('{value}' is text; write the number {spelled} without quotes)"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def listed(values: list[int]) -> str:
    """'1, 2 or 4'; the first and last four of a long list."""
    words = [str(v) for v in values]
    if len(words) > 8:
        words = words[:4] + ["..."] + words[-4:]
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"


__all__ = ["divisors", "finite_above", "flag", "is_int", "listed", "positive_int", "real", "refuse"]
