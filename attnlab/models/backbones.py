"""Backbones: the NS-Attn paper's CIFAR ViT and Swin (Section 3.1) as timm builds them, a tiny ViT for the embedded
digits demo, and any timm model by name. Every one can be built with any attention variant spec."""

from __future__ import annotations

import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable

import timm
from timm.layers import DropPath
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn

from ..errors import ConfigError, ModelNotFoundError, did_you_mean
from .blocks import PostNormBlock
from .convert import SUPPORTED_TYPES, convert
from .gpt import GPT, GPT_PRESETS
from .gpt_loaders import load_gpt_file
from .hf_decoder import load_hf_decoder
from .ladder import LADDER_PRESETS, LadderLlama
from .llama import LLAMA_PRESETS, Llama
from .pretrained import create_pretrained, load_strict, read_state_dict
from .sequence import SequenceClassifier
from .timesformer import TimeSformer, init_timesformer


@dataclass(frozen=True)
class Preset:
    """A named backbone: the timm class, its keyword arguments, and how drop-path is laid over the blocks."""

    cls: type[nn.Module]
    kwargs: dict[str, Any]
    num_classes: int | None  # None: the model has no classifier (a language model sizes its head by vocab_size)
    doc: str
    fixed_drop_path: bool = False  # same rate in every block (the paper's ViT) instead of timm's linear rise
    load_file: Callable[[nn.Module, str], nn.Module] | None = None  # reads pretrained_file by meaning; None: strict
    #: init(model, state_dict, source) reads a pretrained file by meaning instead of loading it strictly, and
    #: ``pretrained=True`` feeds it timm's weights of ``image_model`` (TimeSformer starts from an image ViT)
    init: Callable[[nn.Module, dict, str], Any] | None = None
    image_model: str | None = None


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
    # Long Range Arena (the Nystromformer authors' small configuration); the trainer sizes length and vocabulary
    "seq_listops": Preset(
        SequenceClassifier,
        dict(vocab_size=16, max_length=2000, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, pool="mean",
             drop_rate=0.1, attn_drop_rate=0.1),
        num_classes=10,
        doc="LRA ListOps sequence classifier: token embedding + learned positions (2000), dim 64, depth 2, 2 heads "
            "(D=32), MLP 128, mean pooling over every position, padding attended: the unmasked ablation (model option "
            "pool=token: class token; the lra preset, which the lra_listops recipe trains, masks the padding)",
    ),
    # the Nyströmformer authors' LRA model as their code builds it (mlpen/Nystromformer, LRA/code)
    "lra": Preset(
        SequenceClassifier,
        dict(vocab_size=16, max_length=2000, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, pool="mean",
             drop_rate=0.1, attn_drop_rate=0.1, norm_eps=1e-5, pad_id=0, pad_multiple=64, head="mlp"),
        num_classes=10,
        doc="the Nystromformer authors' LRA model: as seq_listops, with the padding (id 0) masked in every block and "
            "in the mean pooling, sequences padded to a multiple of 64 (2000 -> 2048), LayerNorm eps 1e-5, an MLP "
            "head (64 -> 128 -> classes, ReLU); their Nystromformer is --attn 'nystrom(conv=35)'",
    ),
    "seq_text": Preset(
        SequenceClassifier,
        dict(vocab_size=257, max_length=4000, embed_dim=64, depth=2, num_heads=2, mlp_ratio=2.0, pool="mean",
             drop_rate=0.1, attn_drop_rate=0.1),
        num_classes=2,
        doc="LRA byte-level text classifier: as seq_listops, 257 ids (bytes + padding), 4000 positions, 2 classes",
    ),
    # TimeSformer (arXiv 2102.05095): clips (B, C, T, H, W); model option attention=divided|joint|space_only
    "timesformer_tiny": Preset(
        TimeSformer,
        dict(img_size=16, patch_size=8, in_chans=1, embed_dim=64, depth=2, num_heads=4, mlp_ratio=2.0,
             num_frames=8, attention="divided", drop_path_rate=0.0, weight_init="xavier"),
        num_classes=4, init=init_timesformer,
        doc="tiny TimeSformer for the embedded moving digits (8 frames of 16x16, 1 channel): patch 8 (4 patches "
            "per frame, 33 tokens per clip), dim 64, depth 2, 4 heads (D=16), divided space-time attention, "
            "xavier-initialised Linears (std 0.02 leaves attention at this width uniform, blind to frame order)",
    ),
    "timesformer_base": Preset(
        TimeSformer,
        dict(img_size=224, patch_size=16, in_chans=3, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0,
             num_frames=8, attention="divided", drop_path_rate=0.1),
        num_classes=400, init=init_timesformer, image_model="vit_base_patch16_224",
        doc="TimeSformer (ViT-B/16, 8 frames of 224x224, divided space-time attention); pretrained: timm's "
            "vit_base_patch16_224 (temporal attention copied from the spatial), or a file: an image ViT or a "
            "TimeSformer checkpoint",
    ),
}
PRESETS.update({name: Preset(GPT, kwargs, None, doc, load_file=load_gpt_file)
                for name, (kwargs, doc) in GPT_PRESETS.items()})
PRESETS.update({name: Preset(Llama, kwargs, None, doc, load_file=load_hf_decoder)
                for name, (kwargs, doc) in LLAMA_PRESETS.items()})
PRESETS.update({name: Preset(LadderLlama, kwargs, None, doc, load_file=load_hf_decoder)
                for name, (kwargs, doc) in LADDER_PRESETS.items()})


def _fix_drop_path(model: nn.Module, rate: float) -> None:
    """Give every block the same stochastic-depth rate (timm's drop_path_rate rises linearly from 0)."""
    for block in getattr(model, "blocks", []):
        for name in ("drop_path1", "drop_path2"):
            if hasattr(block, name):
                setattr(block, name, DropPath(rate) if rate > 0 else nn.Identity())


def build_model(name: str, num_classes: int | None = None, attn: str | None = "standard", norm: str = "pre",
                pretrained: bool = False, pretrained_file: str | None = None, **overrides) -> nn.Module:
    """Build a backbone with the attention variant ``attn`` (a spec string; ``None`` leaves timm's modules untouched).

    ``name`` is a preset (``vit_cifar``, ``swin_cifar``, ``vit_digits``, ``seq_*``, the language models ``gpt_tiny``,
    ``gpt_mini``, ``gpt2_small``, which take no ``num_classes``), a detector preset (``vitdet_tiny`` ...,
    :func:`attnlab.models.detection.build_detector`), or any timm model name (random init).
    ``overrides`` go to the timm constructor (e.g. ``drop_path_rate=0.0``, ``img_size=64``, ``in_chans=1``).
    ``norm="post"`` builds ViT-family models with post-LN blocks (:class:`~attnlab.models.blocks.PostNormBlock`);
    ``norm="none"`` replaces every LayerNorm by the identity (the no-LayerNorm ablation; ViT and sequence models).
    Attention modules run fused SDPA (timm's Swin leaves it off by default); the model's weights are drawn before the
    conversion, so the same seed gives the same shared weights whatever the variant.
    ``pretrained=True`` loads timm's weights (hub cache, or ``pretrained_file``: safetensors or a weights-only torch
    file) before the conversion, so ``attn="dna(init=copy)"`` warm-starts from them. A preset takes ``pretrained_file``
    alone, loaded strictly, or by meaning for the GPT presets (:func:`~attnlab.models.gpt_loaders.load_gpt_file`) and
    the TimeSformer presets (an image ViT or a TimeSformer checkpoint; ``timesformer_base`` also takes
    ``pretrained=True``: timm's ``vit_base_patch16_224``).
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
    except (TypeError, AttributeError) as err:  # AttributeError: timm's Swin reads its norms' weights as it builds
        typed = isinstance(err, TypeError)
        if norm == "none" and ("norm_layer" if typed else "'Identity' object") in str(err):
            raise ConfigError(f"norm='none' is available for ViT-family and sequence models, not {name!r}.") from None
        if not typed:
            raise
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
    for module in model.modules():
        if type(module) in SUPPORTED_TYPES:
            module.fused_attn = True
    model.attnlab_model = name
    if attn is not None:
        convert(model, attn)
    return model


def _build(name: str, num_classes: int | None, overrides: dict, pretrained: bool = False,
           pretrained_file: str | None = None) -> nn.Module:
    if name in PRESETS and pretrained and pretrained_file is None and PRESETS[name].image_model is None:
        raise ConfigError(f"the preset {name} has no published weights; give pretrained_file (--pretrained-file), "
                          f"or a timm model name.")
    if name in PRESETS:
        preset = PRESETS[name]
        kwargs = {**preset.kwargs, **overrides}
        if preset.num_classes is not None:
            kwargs["num_classes"] = preset.num_classes if num_classes is None else num_classes
        elif num_classes is not None:
            raise ConfigError(f"the preset {name} has no classifier, so it takes no num_classes; size it with its "
                              f"own options (vocab_size for a language model).")
        model = preset.cls(**kwargs)
        if preset.fixed_drop_path:
            _fix_drop_path(model, kwargs.get("drop_path_rate", 0.0))
        if preset.init is not None and (pretrained or pretrained_file is not None):
            model.attnlab_model = name
            if pretrained_file is not None:
                preset.init(model, read_state_dict(pretrained_file), f"pretrained file {pretrained_file}")
            else:
                image = create_pretrained(preset.image_model, {}).state_dict()
                preset.init(model, image, f"timm's weights for {preset.image_model}")
        elif pretrained_file is not None:
            model.attnlab_model = name
            if preset.load_file is not None:
                preset.load_file(model, pretrained_file)
            else:
                load_strict(model, read_state_dict(pretrained_file, model), f"pretrained file {pretrained_file}")
    else:
        kwargs = overrides if num_classes is None else {**overrides, "num_classes": num_classes}
        if pretrained or pretrained_file is not None:
            model = create_pretrained(name, kwargs, pretrained_file)
        elif timm.is_model(name):
            model = timm.create_model(name, pretrained=False, **kwargs)
        else:
            raise ModelNotFoundError(f"unknown model {name!r}: use a preset ({', '.join(PRESETS)}) or a timm model "
                                     f"name (see timm.list_models()).")
    return model
