"""Detection and instance segmentation: torchvision's ``MaskRCNN`` (``FasterRCNN`` for boxes only) around a timm
backbone carrying any attention spec: a ViT / DeiT through ViTDet's simple feature pyramid
(:mod:`attnlab.models.vitdet`; Li et al., arXiv 2203.16527), or Swin's four stages, a LayerNorm each, through
torchvision's FPN with ``LastLevelMaxPool`` (docs/methods.md, Detection backbones).

The spec is applied to the backbone's transformer (``model.backbone.trunk``) alone, so weight terms (``sigma``,
``speccond``) reparametrise its layers, not the pyramid's or the heads'; pretrained weights (timm's, a file, or the
DnA authors' layouts) initialise it before the conversion, so ``dna(init=copy)`` warm-starts from them.
``num_classes`` counts object categories: label 0 is torchvision's background, so a dataset's labels are 1..num_classes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import timm
from timm.layers import LayerNorm2d
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer
from torch import nn
from torchvision.models.detection import FasterRCNN, MaskRCNN
from torchvision.models.detection.anchor_utils import AnchorGenerator
from torchvision.models.detection.faster_rcnn import FastRCNNConvFCHead, FastRCNNPredictor, TwoMLPHead
from torchvision.models.detection.mask_rcnn import MaskRCNNHeads, MaskRCNNPredictor
from torchvision.models.detection.rpn import RPNHead
from torchvision.ops import FeaturePyramidNetwork
from torchvision.ops.feature_pyramid_network import LastLevelMaxPool

from ..errors import ConfigError, UnsupportedModelError, did_you_mean
from .convert import convert
from .pretrained import load_dna_authors, read_state_dict
from .vitdet import ViTDetBackbone, ViTDetTrunk

HEADS = ("vitdet", "classic", "light")


@dataclass(frozen=True)
class DetectorConfig:
    """A detector's shape; defaults are the DnA paper's ViTDet setting (its Table 5 and Table 9: ViT-B at 224x224,
    all blocks global, Mask R-CNN, post-NMS top-1000 proposals in training).

    Args:
        backbone: a timm ViT/DeiT or Swin name (``attnlab.build_model`` builds it).
        num_classes: object categories (background is added).
        img_size: square input side: the ViT position embedding's grid, Swin's window layout, and the size
            torchvision's transform resizes images to (``min_size = max_size = img_size``).
        masks: Mask R-CNN (True) or Faster R-CNN (boxes only).
        window_size: ViT window side in tokens (0: every block global, as the DnA paper's "window size 0").
        global_blocks: ViT blocks that stay global when ``window_size`` > 0 (ViTDet-B: 2, 5, 8, 11).
        rel_pos: ViTDet's decomposed relative positions in every ViT block's attention (detectron2's
            ``use_rel_pos``; the ViTDet presets' default).
        abs_pos: how the ViT position embedding meets the detection grid: ``resample`` (once, timm's antialiased
            bicubic) or ``interpolate`` (detectron2's plain bicubic on every forward, stored as pretrained).
        scale_factors: the simple feature pyramid's levels (ViT).
        fpn_channels: channels of every pyramid level.
        heads: ``vitdet`` (ViTDet's, each conv with a LayerNorm, torchvision's ``*_v2`` layout: docs/methods.md),
            ``classic`` (torchvision's Mask R-CNN defaults) or ``light`` (the CPU preset's: 1-conv RPN, one 256-wide
            fc, 2-conv mask head at ``fpn_channels``).
        anchor_sizes: one anchor size per level (p2..p6), aspect ratios 0.5, 1, 2.
        drop_path_rate: the backbone's stochastic depth (timm's linear rise over the blocks).
        rpn_post_nms_top_n_train, rpn_post_nms_top_n_test: proposals kept per image after the RPN's NMS, in
            training and in evaluation (Table 5: 1000 and 1000).
        box_batch_size_per_image: RoIs sampled per image for the box head in training.
        detections_per_img: most detections kept per image (COCO's evaluation reads at most 100).
        backbone_options: further keyword arguments of the timm constructor (e.g. ``depth``, ``embed_dim``).
    """

    backbone: str = "deit_base_patch16_224"
    num_classes: int = 80
    img_size: int = 224
    masks: bool = True
    window_size: int = 0
    global_blocks: tuple[int, ...] = ()
    rel_pos: bool = False
    abs_pos: str = "resample"
    scale_factors: tuple[float, ...] = (4.0, 2.0, 1.0, 0.5)
    fpn_channels: int = 256
    heads: str = "vitdet"
    anchor_sizes: tuple[int, ...] = (32, 64, 128, 256, 512)
    drop_path_rate: float = 0.1
    rpn_post_nms_top_n_train: int = 1000
    rpn_post_nms_top_n_test: int = 1000
    box_batch_size_per_image: int = 512
    detections_per_img: int = 100
    backbone_options: dict[str, Any] = field(default_factory=dict)


#: named detectors (``attnlab.build_model(name)`` and ``build_detector(name)``): DetectorConfig fields
DETECTOR_PRESETS: dict[str, dict[str, Any]] = {
    # for 2 CPU cores and the synthetic shapes set (128x128, patch 16: 8x8 tokens)
    "vitdet_tiny": dict(
        backbone="vit_tiny_patch16_224", num_classes=3, img_size=128, window_size=4, global_blocks=(1, 3),
        fpn_channels=64, heads="light", anchor_sizes=(8, 16, 32, 64, 128), drop_path_rate=0.0,
        rpn_post_nms_top_n_train=300, rpn_post_nms_top_n_test=300, box_batch_size_per_image=128,
        detections_per_img=20, backbone_options=dict(embed_dim=96, depth=4, num_heads=3), rel_pos=True,
    ),
    # the DnA paper's Table 9: DeiT-B (a supervised ViT-B) at 224x224, every block global, ViTDet's heads
    "vitdet_base_224": dict(backbone="deit_base_patch16_224", rel_pos=True),
    # ViTDet-B as its paper: ViT-B at 1024x1024, windows of 14, blocks 2, 5, 8, 11 global
    "vitdet_base": dict(backbone="vit_base_patch16_224", img_size=1024, window_size=14,
                        global_blocks=(2, 5, 8, 11), rel_pos=True),
    # Swin-S / Swin-B (window 7) + FPN, the classic Mask R-CNN heads, 1024x1024, mmdetection's drop-path
    "swin_small_maskrcnn": dict(backbone="swin_small_patch4_window7_224", img_size=1024, heads="classic",
                                drop_path_rate=0.2),
    "swin_base_maskrcnn": dict(backbone="swin_base_patch4_window7_224", img_size=1024, heads="classic",
                               drop_path_rate=0.3),
}


class SwinFPNBackbone(nn.Module):
    """timm Swin's four stage outputs, each LayerNorm-ed, into torchvision's FPN (p2..p5) and a max-pool p6."""

    def __init__(self, trunk: SwinTransformer, out_channels: int = 256) -> None:
        super().__init__()
        trunk.prune_intermediate_layers(len(trunk.layers), prune_norm=True, prune_head=True)
        self.trunk = trunk
        channels = [info["num_chs"] for info in trunk.feature_info]
        self.norms = nn.ModuleList(LayerNorm2d(c, eps=1e-5) for c in channels)
        self.fpn = FeaturePyramidNetwork(channels, out_channels, extra_blocks=LastLevelMaxPool())
        self.out_channels = out_channels
        self.strides = tuple(float(info["reduction"]) for info in trunk.feature_info)

    def forward(self, x):
        stages = self.trunk.forward_intermediates(x, intermediates_only=True)
        return self.fpn({str(i): norm(f) for i, (norm, f) in enumerate(zip(self.norms, stages))})


def detector_config(name: str, **options) -> DetectorConfig:
    """The :class:`DetectorConfig` of a preset (or of a timm backbone name) with ``options`` over it; options that
    are not fields go to the timm constructor (``backbone_options``)."""
    fields = {f.name for f in dataclasses.fields(DetectorConfig)}
    base = dict(DETECTOR_PRESETS[name]) if name in DETECTOR_PRESETS else {"backbone": name}
    extra = {k: options.pop(k) for k in list(options) if k not in fields}
    base.update({k: v for k, v in options.items() if v is not None})
    base["backbone_options"] = {**base.get("backbone_options", {}), **options.get("backbone_options", {}), **extra}
    cfg = DetectorConfig(**base)
    if cfg.heads not in HEADS:
        raise ConfigError(f"heads={cfg.heads!r} is not valid{did_you_mean(cfg.heads, HEADS)}; use one of: "
                          f"{', '.join(HEADS)}.")
    if cfg.num_classes < 1:
        raise ConfigError(f"num_classes={cfg.num_classes} must count at least one object category.")
    if len(cfg.anchor_sizes) != 5:
        raise ConfigError(f"anchor_sizes needs one size for each of the 5 pyramid levels (p2..p6), not "
                          f"{len(cfg.anchor_sizes)}.")
    return cfg


def _trunk(cfg: DetectorConfig, norm: str, pretrained: bool, pretrained_file: str | None,
           dna_layout: str | None) -> nn.Module:
    from .backbones import PRESETS, build_model  # backbones routes detector presets here

    if cfg.backbone in PRESETS or cfg.backbone in DETECTOR_PRESETS or not timm.is_model(cfg.backbone):
        raise UnsupportedModelError(
            f"the detection backbone must be a timm ViT/DeiT or Swin model name (e.g. deit_base_patch16_224, "
            f"swin_small_patch4_window7_224), not {cfg.backbone!r}.")
    options = dict(cfg.backbone_options, drop_path_rate=cfg.drop_path_rate)
    is_swin = timm.models.is_model_in_modules(cfg.backbone, ["swin_transformer"])
    if is_swin:  # windows and shifts laid out for the detection input; masks built for each input's padding
        options.update(img_size=cfg.img_size, dynamic_img_size=True)
    authors = dna_layout is not None
    if authors and pretrained_file is None:
        raise ConfigError("dna_layout reads the DnA authors' checkpoint given as pretrained_file; give one.")
    model = build_model(cfg.backbone, num_classes=0, attn=None, norm=norm, pretrained=pretrained and not authors,
                        pretrained_file=None if authors else pretrained_file, **options)
    if not isinstance(model, (VisionTransformer, SwinTransformer)):
        raise UnsupportedModelError(
            f"the detect task takes ViT/DeiT backbones (through ViTDet's simple feature pyramid) or Swin backbones "
            f"(through an FPN); {cfg.backbone} is a {type(model).__name__}.")
    return model


def build_detector(backbone: str = "vitdet_tiny", num_classes: int | None = None, attn: str | None = "standard", *,
                   norm: str = "pre", pretrained: bool = False, pretrained_file: str | None = None,
                   dna_layout: str | None = None, dna_sign: str = "+", **options) -> MaskRCNN | FasterRCNN:
    """A torchvision ``MaskRCNN`` (``masks=False``: ``FasterRCNN``) whose backbone is ``backbone`` with the attention
    spec ``attn`` (``None`` leaves timm's modules); ``backbone`` and ``options`` as :func:`detector_config`.

    ``pretrained`` / ``pretrained_file`` load timm's weights (or a file of them) into the transformer before the
    conversion; with ``dna_layout`` (and ``dna_sign``, as :func:`~attnlab.models.pretrained.dna_authors_state_dict`)
    ``pretrained_file`` is a DnA authors' checkpoint, loaded after the transformer is converted to ``attn`` (a ``dna``
    spec of the checkpoint's variant).
    """
    cfg = detector_config(backbone, num_classes=num_classes, **options)
    trunk = _trunk(cfg, norm, pretrained, pretrained_file, dna_layout)
    mean, std = (timm.data.resolve_model_data_config(trunk)[k] for k in ("mean", "std"))
    if dna_layout is not None:
        convert(trunk, attn or "standard")
        state = {k: v for k, v in read_state_dict(pretrained_file).items() if not k.startswith("head.")}
        load_dna_authors(trunk, state, layout=dna_layout, sign=dna_sign)
    if isinstance(trunk, VisionTransformer):
        body = ViTDetBackbone(ViTDetTrunk(trunk, cfg.img_size, cfg.window_size, cfg.global_blocks,
                                          rel_pos=cfg.rel_pos, abs_pos=cfg.abs_pos),
                              cfg.fpn_channels, cfg.scale_factors)
    else:
        body = SwinFPNBackbone(trunk, cfg.fpn_channels)
    if attn is not None and dna_layout is None:
        convert(body.trunk, attn)
    model = _detector(cfg, body, mean, std)
    model.attnlab_model = backbone
    model.attnlab_spec = getattr(body.trunk, "attnlab_spec", None) or getattr(trunk, "attnlab_spec", None)
    model.detector_config = cfg
    return model


def _detector(cfg: DetectorConfig, body: nn.Module, mean, std) -> MaskRCNN | FasterRCNN:
    ch, k = cfg.fpn_channels, cfg.num_classes + 1
    anchors = AnchorGenerator(tuple((s,) for s in cfg.anchor_sizes), ((0.5, 1.0, 2.0),) * len(cfg.anchor_sizes))
    heads: dict[str, nn.Module] = {}
    if cfg.heads == "vitdet":
        heads["rpn_head"] = RPNHead(ch, anchors.num_anchors_per_location()[0], conv_depth=2)
        heads["box_head"] = FastRCNNConvFCHead((ch, 7, 7), [256] * 4, [1024], norm_layer=LayerNorm2d)
        mask = MaskRCNNHeads(ch, [256] * 4, 1, norm_layer=LayerNorm2d)
    elif cfg.heads == "light":
        heads["rpn_head"] = RPNHead(ch, anchors.num_anchors_per_location()[0])
        heads["box_head"] = TwoMLPHead(ch * 7 * 7, 256)
        heads["box_predictor"] = FastRCNNPredictor(256, k)
        mask = MaskRCNNHeads(ch, [ch, ch], 1)
        if cfg.masks:
            heads["mask_predictor"] = MaskRCNNPredictor(ch, ch, k)
    else:  # classic: torchvision's defaults
        mask = None
    # torchvision takes num_classes only when it builds the predictors itself
    common = dict(
        num_classes=None if "box_predictor" in heads else k, min_size=cfg.img_size, max_size=cfg.img_size,
        image_mean=list(mean), image_std=list(std), rpn_anchor_generator=anchors,
        rpn_post_nms_top_n_train=cfg.rpn_post_nms_top_n_train, rpn_post_nms_top_n_test=cfg.rpn_post_nms_top_n_test,
        box_batch_size_per_image=cfg.box_batch_size_per_image, box_detections_per_img=cfg.detections_per_img,
        **heads)
    if not cfg.masks:
        return FasterRCNN(body, **common)
    return MaskRCNN(body, mask_head=mask, **common)


class BackboneProbe(nn.Module):
    """A detector's transformer behind the detector's own input normalisation: (B, 3, H, W) images in [0, 1] ->
    the transformer's output. What the backbone instruments measure on a detection run."""

    def __init__(self, detector: nn.Module) -> None:
        super().__init__()
        if getattr(getattr(detector, "backbone", None), "trunk", None) is None:
            raise UnsupportedModelError(f"{type(detector).__name__} is not a detector built by attnlab.build_detector.")
        self.detector = detector

    def forward(self, x):
        return self.detector.backbone.trunk(self.detector.transform.normalize(x))


__all__ = ["BackboneProbe", "DETECTOR_PRESETS", "DetectorConfig", "HEADS", "SwinFPNBackbone", "build_detector",
           "detector_config"]
