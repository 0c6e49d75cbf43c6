"""Backbones: the NS-Attn paper's CIFAR ViT and Swin (Section 3.1) as timm builds them, a tiny ViT for the embedded
digits demo, and any timm model by name. Every one can be built with any attention variant spec."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any

import timm
from timm.layers import DropPath
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..attention.base import SUPPORTED_TYPES
from ..errors import ConfigError, ModelNotFoundError, did_you_mean
from .blocks import PostNormBlock
from .convert import convert
from .pretrained import create_pretrained, load_strict, read_state_dict
from .sequence import SequenceClassifier


@dataclass(frozen=True)
class Preset:
    """A named backbone: the timm class, its keyword arguments, and how drop-path is laid over the blocks."""

    cls: type[nn.Module]
    kwargs: dict[str, Any]
    num_classes: int
    doc: str
    fixed_drop_path: bool = False  # same rate in every block (the paper's ViT) instead of timm's linear rise


PRESETS: dict[str, Preset] = {
    "vit_cifar": Preset(
        VisionTransformer,
        dict(img_size=32, patch_size=4, embed_dim=192, depth=9, num_heads=12, mlp_ratio=2.0, qkv_bias=True,
             class_token=True, global_pool="token", drop_path_rate=0.1),
        num_classes=10, fixed_drop_path=True,
        doc="NS-Attn paper's CIFAR ViT: 32x32, patch 4, dim 192, depth 9, 12 heads (D=16), MLP ratio 2, drop-path 0.1 in every block",
    ),
    "swin_cifar": Preset(
        SwinTransformer,
        dict(img_size=32, patch_size=2, embed_dim=96, depths=(2, 6, 4), num_heads=(3, 6, 12), head_dim=32,
             window_size=4, mlp_ratio=2.0, drop_path_rate=0.1),
        num_classes=10,
        doc="NS-Attn paper's CIFAR Swin: 32x32, patch 2, dims 96/192/384, depths 2/6/4, heads 3/6/12 (D=32), window 4, drop-path 0 to 0.1",
    ),
    "vit_digits": Preset(
        VisionTransformer,
        dict(img_size=8, patch_size=2, in_chans=1, embed_dim=48, depth=2, num_heads=3, mlp_ratio=2.0, qkv_bias=True,
             class_token=False, global_pool="avg", drop_path_rate=0.0),
        num_classes=10,
        doc="tiny ViT for scikit-learn's 8x8 digits (the embedded demo): patch 2 (16 tokens), dim 48, depth 2, "
            "3 heads (D=16), mean-pooled (learns in fewer steps than a class token here)",
    ),
    # Long Range Arena: the small configuration of the Nystromformer authors' LRA code (dim 64, MLP 128, 2 layers,
    # 2 heads of 32, mean pooling); the trainer sizes length and vocabulary from the dataset
    "seq_listops": Preset(
        SequenceClassifier,
        dict(vocab_size=16, max_length=2000, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, pool="mean",
             drop_rate=0.1, attn_drop_rate=0.1),
        num_classes=10,
        doc="LRA ListOps sequence classifier: token embedding + learned positions (2000), dim 64, depth 2, 2 heads "
            "(D=32), MLP 128, mean pooling (model option pool=token: class token)",
    ),
    "seq_text": Preset(
        SequenceClassifier,
        dict(vocab_size=257, max_length=4000, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, pool="mean",
             drop_rate=0.1, attn_drop_rate=0.1),
        num_classes=2,
        doc="LRA byte-level text classifier: as seq_listops, 257 ids (bytes + padding), 4000 positions, 2 classes",
    ),
}


def _fix_drop_path(model: nn.Module, rate: float) -> None:
    """Give every block the same stochastic-depth rate (timm's drop_path_rate rises linearly from 0)."""
    for block in getattr(model, "blocks", []):
        for name in ("drop_path1", "drop_path2"):
            if hasattr(block, name):
                setattr(block, name, DropPath(rate) if rate > 0 else nn.Identity())


def build_model(name: str, num_classes: int | None = None, attn: str | None = "standard", norm: str = "pre",
                pretrained: bool = False, pretrained_file: str | None = None, **overrides) -> nn.Module:
    """Build a backbone with the attention variant ``attn`` (a spec string; ``None`` leaves timm's modules untouched).

    ``name`` is a preset (``vit_cifar``, ``swin_cifar``, ``vit_digits``), a detector preset (``vitdet_tiny`` ...,
    :func:`attnlab.models.detection.build_detector`), or any timm model name (random init).
    ``overrides`` go to the timm constructor (e.g. ``drop_path_rate=0.0``, ``img_size=64``, ``in_chans=1``).
    ``norm="post"`` builds ViT-family models with post-LN blocks (:class:`~attnlab.models.blocks.PostNormBlock`);
    ``norm="none"`` replaces every LayerNorm by the identity (the no-LayerNorm ablation; ViT and sequence models).
    Attention modules run fused SDPA (timm's Swin leaves it off by default); the model's weights are drawn before the
    conversion, so the same seed gives the same shared weights whatever the variant.
    ``pretrained=True`` loads timm's weights (hub cache, or ``pretrained_file``: safetensors or a weights-only torch
    file) before the conversion, so ``attn="dna(init=copy)"`` warm-starts from them; a preset takes
    ``pretrained_file`` alone (its own state dict, loaded strictly).
    """
    if norm not in ("pre", "post", "none"):
        raise ConfigError(f"norm must be 'pre', 'post' or 'none', not {norm!r}.")
    from .detection import DETECTOR_PRESETS, build_detector  # detection builds its backbone through this function

    if name in DETECTOR_PRESETS:
        return build_detector(name, num_classes, attn, norm=norm, pretrained=pretrained,
                              pretrained_file=pretrained_file, **overrides)
    if norm == "post":
        overrides["block_fn"] = PostNormBlock
    if norm == "none":
        overrides["norm_layer"] = nn.Identity
    try:
        model = _build(name, num_classes, overrides, pretrained, pretrained_file)
    except TypeError as err:
        if norm == "none" and "norm_layer" in str(err):
            raise ConfigError(f"norm='none' is available for ViT-family and sequence models, not {name!r}.") from None
        if norm == "post" and "block_fn" in str(err):
            raise ConfigError(f"norm='post' is available for ViT-family models (timm's VisionTransformer), "
                              f"not {name!r}.") from None
        bad = re.search(r"unexpected keyword argument '(\w+)'", str(err))
        if bad and bad[1] in overrides:  # a typo in model_options, not a bug
            cls = PRESETS[name].cls if name in PRESETS else None
            valid = inspect.signature(cls).parameters if cls else ()
            raise ConfigError(f"model option {bad[1]!r} is not an argument of {name}{did_you_mean(bad[1], valid)}; "
                              f"give keyword arguments of timm's {cls.__name__ if cls else name}.") from None
        raise
    except AttributeError as err:  # timm's Swin reads its norms' weights while it builds
        if norm == "none" and "'Identity' object" in str(err):
            raise ConfigError(f"norm='none' is available for ViT-family and sequence models, not {name!r}.") from None
        raise
    for module in model.modules():
        if type(module) in SUPPORTED_TYPES:
            module.fused_attn = True
    model.attnlab_model = name
    if attn is not None:
        convert(model, attn)
    return model


def _build(name: str, num_classes: int | None, overrides: dict, pretrained: bool = False,
           pretrained_file: str | None = None) -> nn.Module:
    if name in PRESETS and pretrained and pretrained_file is None:
        raise ConfigError(f"the preset {name} has no published weights; give pretrained_file (--pretrained-file), "
                          f"or a timm model name.")
    if name in PRESETS:
        preset = PRESETS[name]
        kwargs = {**preset.kwargs, **overrides}
        kwargs["num_classes"] = preset.num_classes if num_classes is None else num_classes
        model = preset.cls(**kwargs)
        if preset.fixed_drop_path:
            _fix_drop_path(model, kwargs.get("drop_path_rate", 0.0))
        if pretrained_file is not None:
            model.attnlab_model = name
            load_strict(model, read_state_dict(pretrained_file), f"pretrained file {pretrained_file}")
    elif pretrained or pretrained_file is not None:
        if num_classes is not None:
            overrides = {**overrides, "num_classes": num_classes}
        model = create_pretrained(name, overrides, pretrained_file)
    elif timm.is_model(name):
        kwargs = dict(overrides)
        if num_classes is not None:
            kwargs["num_classes"] = num_classes
        model = timm.create_model(name, pretrained=False, **kwargs)
    else:
        raise ModelNotFoundError(
            f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}) or a timm model name "
            f"(see timm.list_models()).")
    return model
