"""Model surgery: ``convert(model, spec)`` swaps every supported attention module for attnlab's mechanism of the
spec's kind, taking over its weights, then applies the spec's q/k and weight terms."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase

from timm.layers import Attention as TimmAttention
from timm.models.davit import ChannelAttention as TimmChannelAttention
from timm.models.davit import ChannelAttentionV2 as TimmChannelAttentionV2
from timm.models.davit import WindowAttention as TimmDaViTWindowAttention
from timm.models.swin_transformer import WindowAttention as TimmWindowAttention
from timm.models.xcit import XCA as TimmXCA
from torch import nn

from ..attention.base import AttnlabAttention
from ..attention.channel import ChannelMapAttention, DaViTChannelAttention
from ..attention.xca import XCAttention
from ..errors import ConfigError, SpecError, UnsupportedModelError
from ..spec import Spec, parse_spec
from ..variants import VARIANTS

#: module types :func:`convert` replaces (exact types: subclasses may change the forward); DaViT's window attention
#: is token softmax attention without a bias; XCA and the channel attentions keep their own formula
SUPPORTED_TYPES: tuple[type, ...] = (TimmAttention, TimmWindowAttention, TimmDaViTWindowAttention, TimmXCA,
                                     TimmChannelAttention, TimmChannelAttentionV2)
#: the attnlab class that computes each timm channel map
CHANNEL_MECHANISMS = {TimmXCA: XCAttention, TimmChannelAttention: DaViTChannelAttention,
                      TimmChannelAttentionV2: DaViTChannelAttention}


def is_supported(module: nn.Module) -> bool:
    """Whether :func:`convert` replaces ``module``: a timm type of :data:`SUPPORTED_TYPES` or attnlab's
    self-attention."""
    return type(module) in SUPPORTED_TYPES or isinstance(module, AttnlabAttention) and not module.takes_context


def channel_mechanism(module: nn.Module) -> type[ChannelMapAttention] | None:
    """The attnlab class that computes ``module``'s channel map (timm's XCA / DaViT channel attention, or an attnlab
    one), or None for token attention."""
    return type(module) if isinstance(module, ChannelMapAttention) else CHANNEL_MECHANISMS.get(type(module))


def attention_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every attention module attnlab can replace or has replaced, in forward order."""
    return [(name, m) for name, m in model.named_modules() if is_supported(m)]


def _unsupported(model: nn.Module) -> UnsupportedModelError:
    seen = sorted({type(m).__name__ for m in model.modules() if re.search(r"attn|attention", type(m).__name__, re.I)})
    found = f"attention-like modules found: {', '.join(seen)}" if seen else "no attention-like module found"
    return UnsupportedModelError(
        f"{type(model).__name__} has no attention module attnlab can replace ({found}); supported are timm's "
        f"Attention (ViT, DeiT and other models built from it), WindowAttention (Swin), XCA (XCiT) and DaViT's.")


def _head_transform(spec: Spec) -> nn.Module:
    heads = [t.variant.load()(**t.resolved()) for t in spec.of_kind("head")]
    if not heads:
        return nn.Identity()
    return heads[0] if len(heads) == 1 else nn.Sequential(*heads)


def refusal(module: nn.Module, spec: Spec, name: str = "") -> str | None:
    """Why ``spec`` cannot act on ``module`` (a channel map refuses token-attention terms), or None when it can."""
    mechanism = channel_mechanism(module)
    if mechanism is None:
        return None
    for term in spec.terms:
        reason = mechanism.refusal(term.name, term.kind)
        if reason:
            where = f" ({name})" if name else ""
            return f"{term.name} does not apply to {mechanism.family}{where}: {reason}"
    return None


def causal_refusal(spec: Spec) -> str | None:
    """Why ``spec`` has no causal form (its kernel's or a head term's reason, one sentence), or None."""
    for term in (spec.kernel, *spec.of_kind("head")):
        why = term.variant.load().capabilities.causal
        if why:
            return why
    return None


def _layers(found: list[tuple[str, nn.Module]]) -> tuple[list[int], int]:
    """Each attention module's layer index and the number of layers: its block's index when every module sits in a
    top-level ``blocks`` list (TimeSformer's spatial and temporal attention share their block's depth), else its
    position in forward order."""
    blocks = [re.match(r"blocks\.(\d+)\.", name) for name, _ in found]
    if all(blocks):
        index = [int(m[1]) for m in blocks]
        return index, max(index) + 1
    return list(range(len(found))), len(found)


def _select(model: nn.Module, found: list[tuple[str, nn.Module]], only: str) -> list[bool]:
    """Which of ``found`` the module-name glob ``only`` (or a group the model names in ``attention_groups``) picks."""
    groups = getattr(model, "attention_groups", None) or {}
    pattern = groups.get(only, only)
    picked = [fnmatchcase(name, pattern) for name, _ in found]
    if not any(picked):
        named = f"; this model's groups are {', '.join(groups)}" if groups else ""
        raise ConfigError(f"only={only!r} matches none of the attention modules ({found[0][0]}, ...){named}; give a "
                          f"glob over their names, e.g. 'blocks.*.attn'.")
    return picked


def convert(model: nn.Module, spec: str | Spec, only: str | None = None) -> nn.Module:
    """Give ``model`` the attention variant ``spec`` in place and return it.

    Every timm ``Attention`` / ``WindowAttention`` (or attnlab module from an earlier conversion) is replaced by the
    spec's kernel built from it, keeping its parameters and their state-dict names; head terms (``ns``) become the
    module's ``head_transform``; q/k and weight terms are applied last. ``convert(model, "standard")`` leaves every
    output bit unchanged. ``only`` converts just the modules whose names match a glob or a group the model declares
    in ``attention_groups`` (:func:`_select`); each keeps the layer index it has in the whole model.
    """
    spec = parse_spec(spec)
    previous = getattr(model, "attnlab_spec", None)
    if previous is not None and any(parse_spec(previous).of_kind(k) for k in ("qk", "weight")):
        raise SpecError(f"this model already carries {previous!r} with weight-side terms; convert a fresh model.")
    found = attention_modules(model)
    if not found:
        raise _unsupported(model)
    layers, num_layers = _layers(found)
    if only is not None:
        wide = next((t for t in spec.of_kind("weight") if t.resolved().get("targets") == "all"), None)
        if wide is not None:
            raise SpecError(f"{wide.name}(targets=all) reparametrises every Linear of the model, not only the "
                            f"attention modules only={only!r} picks; use {wide.name}(targets=attn).")
        picked = _select(model, found, only)
        layers = [i for i, keep in zip(layers, picked) if keep]
        found = [f for f, keep in zip(found, picked) if keep]
    for name, old in found:
        reason = refusal(old, spec, name)
        if reason:
            raise SpecError(f"{reason}; `attnlab variants --support MODEL` lists the terms each module takes.")
    why = causal_refusal(spec) if getattr(model, "causal", False) else None
    if why:
        raise UnsupportedModelError(f"{why}, and every attention of {type(model).__name__} is causal; use a term with "
                                    f"a causal form ({', '.join(_causal_terms())}).")
    cls, options = spec.kernel.variant.load(), spec.kernel.resolved()
    modules = []
    for index, (name, old) in zip(layers, found):
        # a channel map keeps its own formula under the standard kernel (the only kernel it takes)
        mechanism = channel_mechanism(old) or cls
        new: AttnlabAttention = mechanism.from_module(old, layer_index=index, num_layers=num_layers,
                                                      **({} if mechanism is not cls else options))
        new.head_transform = _head_transform(spec)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        modules.append(new)
    for kind in ("qk", "weight"):
        for term in spec.of_kind(kind):
            term.variant.load()(model, modules, **term.resolved())
    model.attnlab_spec = str(spec)
    model.attnlab_only = only
    return model


def _causal_terms() -> list[str]:
    """The kernel and head terms that have a causal form."""
    return [name for name, v in VARIANTS.items() if v.kind in ("kernel", "head") and not v.load().capabilities.causal]


def term_support(model: nn.Module) -> list[dict]:
    """Which registered spec terms act on which of ``model``'s attention modules, grouped by module type.

    One dict per group: ``type`` (the module's class), ``family`` (what it computes), ``modules`` (names),
    ``applies`` (term names) and ``refused`` ({term: reason}); attention-like modules convert leaves alone (XCiT's
    class-attention layers) are one last group with ``family`` "left as built" and no terms.
    """
    groups: dict[str, dict] = {}
    causal = getattr(model, "causal", False)
    found = attention_modules(model)
    if not found:
        raise _unsupported(model)
    for name, module in found:
        mechanism = channel_mechanism(module)
        group = groups.setdefault(type(module).__name__, {
            "type": type(module).__name__,
            "family": mechanism.family if mechanism else "token softmax attention",
            "modules": [], "applies": [], "refused": {}})
        group["modules"].append(name)
        if len(group["modules"]) == 1:
            for term, variant in VARIANTS.items():
                reason = None
                if mechanism:
                    reason = mechanism.refusal(term, variant.kind)
                elif variant.kind == "kernel" and AttnlabAttention.geometry(module).get("window_size") is not None:
                    reason = variant.load().capabilities.window  # what the mechanism's constructor would refuse
                if not reason and causal and variant.kind in ("kernel", "head"):
                    reason = variant.load().capabilities.causal
                if reason:
                    group["refused"][term] = reason
                else:
                    group["applies"].append(term)
    converted = {id(m) for _, m in found}
    inner = {id(sub) for _, m in found for sub in m.modules()}
    left = [(n, m) for n, m in model.named_modules() if id(m) not in converted and id(m) not in inner
            and re.search(r"(attn|attention)$", type(m).__name__, re.I)]
    if left:
        groups["(left)"] = {"type": ", ".join(sorted({type(m).__name__ for _, m in left})),
                            "family": "left as built (not an attention attnlab converts)",
                            "modules": [n for n, _ in left], "applies": [], "refused": {}}
    return list(groups.values())
