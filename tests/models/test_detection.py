"""Detection models: ViTDet's simple feature pyramid and window attention, Swin + FPN, Mask R-CNN around them,
and every spec term on their backbones."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from timm.models.swin_transformer import SwinTransformer
from timm.models.vision_transformer import VisionTransformer

import attnlab
from attnlab.errors import AttnlabError, ConfigError, SpecError, UnsupportedModelError
from attnlab.models import attention_modules, build_detector, convert
from attnlab.models.convert import term_support
from attnlab.models.vitdet import SimpleFeaturePyramid, ViTDetTrunk
from attnlab.variants import VARIANTS

torch.set_num_threads(1)

TINY_VIT = dict(img_size=128, patch_size=16, embed_dim=48, depth=2, num_heads=3, mlp_ratio=2.0, qkv_bias=True)
# a Swin small enough for CPU tests: two stages of windows 4 at 64 px (grids 16, 8, 4, 2)
TINY_SWIN = dict(backbone="swin_tiny_patch4_window7_224", img_size=64, fpn_channels=32, heads="light",
                 anchor_sizes=(8, 16, 32, 64, 128), detections_per_img=10, rpn_post_nms_top_n_test=100,
                 backbone_options=dict(embed_dim=24, depths=(1, 1, 2, 1), num_heads=(1, 2, 2, 4), window_size=4))


def _targets(n_images: int, size: int = 128, empty_last: bool = False):
    out = []
    for i in range(n_images):
        boxes = torch.tensor([[10.0, 12, 50, 60], [60, 64, 100, 92]])
        masks = torch.zeros(2, size, size, dtype=torch.uint8)
        masks[0, 12:60, 10:50] = 1
        masks[1, 64:92, 60:100] = 1
        labels = torch.tensor([1, 3])
        if empty_last and i == n_images - 1:
            boxes, masks, labels = boxes[:0], masks[:0], labels[:0]
        out.append({"boxes": boxes, "labels": labels, "masks": masks})
    return out


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return build_detector("vitdet_tiny", attn=None)


# ---- the simple feature pyramid -------------------------------------------------------------------------------
def test_pyramid_shapes_and_strides():
    pyramid = SimpleFeaturePyramid(in_channels=48, out_channels=32)
    feats = pyramid(torch.randn(2, 48, 6, 10))  # a stride-16 map of a 96 x 160 image
    assert list(feats) == ["0", "1", "2", "3", "pool"]  # torchvision FPN's names (its anchors and RoI pools)
    assert {k: tuple(v.shape) for k, v in feats.items()} == {
        "0": (2, 32, 24, 40), "1": (2, 32, 12, 20), "2": (2, 32, 6, 10), "3": (2, 32, 3, 5), "pool": (2, 32, 2, 3)}
    # the paper's stages: two stride-2 deconvolutions to 1/4, one to 1/8, none at 1/16, a max-pool to 1/32
    deconvs = [sum(isinstance(m, torch.nn.ConvTranspose2d) for m in s.modules()) for s in pyramid.stages]
    pools = [sum(isinstance(m, torch.nn.MaxPool2d) for m in s.modules()) for s in pyramid.stages]
    assert deconvs == [2, 1, 0, 0] and pools == [0, 0, 0, 1]


def test_pyramid_levels_by_hand():
    # ViTDet, Section 3: each level is a 1x1 conv then a 3x3 conv, no bias, each followed by a LayerNorm over
    # channels; the 1/4 level is deconv -> LN -> GELU -> deconv first, the 1/32 level a 2x2 max-pool.
    torch.manual_seed(1)
    pyramid = SimpleFeaturePyramid(in_channels=16, out_channels=8)
    for m in pyramid.modules():  # non-trivial norms, so that a missing one would show
        if isinstance(m, torch.nn.LayerNorm):
            torch.nn.init.normal_(m.weight)
            torch.nn.init.normal_(m.bias)
    x = torch.randn(1, 16, 4, 6)

    def ln(t, norm):  # LayerNorm over the channel dimension of (B, C, H, W)
        return F.layer_norm(t.permute(0, 2, 3, 1), (t.shape[1],), norm.weight, norm.bias, 1e-6).permute(0, 3, 1, 2)

    def convs(t, stage):
        c1, n1 = stage[-2][0], stage[-2][1]
        c3, n3 = stage[-1][0], stage[-1][1]
        assert c1.bias is None and c3.bias is None and c1.kernel_size == (1, 1) and c3.kernel_size == (3, 3)
        t = ln(F.conv2d(t, c1.weight), n1)
        return ln(F.conv2d(t, c3.weight, padding=1), n3)

    s0, s1, s2, s3 = pyramid.stages
    d1, norm, _, d2 = s0[0], s0[1], s0[2], s0[3]
    up = F.conv_transpose2d(F.gelu(ln(F.conv_transpose2d(x, d1.weight, d1.bias, stride=2), norm)), d2.weight,
                            d2.bias, stride=2)
    expected = [convs(up, s0), convs(F.conv_transpose2d(x, s1[0].weight, s1[0].bias, stride=2), s1), convs(x, s2),
                convs(F.max_pool2d(x, 2, 2), s3)]
    feats = pyramid(x)
    for level, want in zip("0123", expected):
        torch.testing.assert_close(feats[level], want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(feats["pool"], expected[3][..., ::2, ::2])  # p6: stride-2 subsampling of p5


def test_detector_strides_follow_input(tiny):
    feats = tiny.backbone(torch.randn(1, 3, 128, 192))
    assert [(128 / v.shape[-2], 192 / v.shape[-1]) for v in feats.values()] == [(s, s) for s in (4, 8, 16, 32, 64)]
    assert tiny.backbone.strides == (4.0, 8.0, 16.0, 32.0)


# ---- the ViTDet trunk ------------------------------------------------------------------------------------------
def test_global_trunk_is_timm_vit_bit_for_bit():
    torch.manual_seed(0)
    vit = VisionTransformer(**TINY_VIT, class_token=False, global_pool="avg").eval()
    trunk = ViTDetTrunk(copy.deepcopy(vit), img_size=128, window_size=0).eval()
    x = torch.randn(2, 3, 128, 128)
    with torch.no_grad():
        want = vit.forward_intermediates(x, indices=1, norm=False, intermediates_only=True)[0]
        assert torch.equal(trunk(x), want)


def _window_reference(vit, x, window):
    """A pre-LN ViT on (B, H, W, C) tokens with attention inside zero-padded windows, one window at a time."""
    B, H, W, C = x.shape
    for block in vit.blocks:
        y = block.norm1(x)
        Hp, Wp = -(-H // window) * window, -(-W // window) * window
        y = F.pad(y, (0, 0, 0, Wp - W, 0, Hp - H))
        out = torch.zeros_like(y)
        for i in range(0, Hp, window):
            for j in range(0, Wp, window):
                tokens = y[:, i:i + window, j:j + window].reshape(B, window * window, C)
                out[:, i:i + window, j:j + window] = block.attn(tokens).reshape(B, window, window, C)
        x = x + out[:, :H, :W]
        x = x + block.mlp(block.norm2(x))
    return x


@pytest.mark.parametrize("size", [(128, 128), (96, 160)])  # 8x8 tokens, and 6x10 (padded to windows of 4)
def test_window_attention_by_hand(size):
    torch.manual_seed(0)
    vit = VisionTransformer(**TINY_VIT, class_token=False, global_pool="avg").eval()
    trunk = ViTDetTrunk(copy.deepcopy(vit), img_size=128, window_size=4).eval()
    x = torch.randn(1, 3, *size)
    with torch.no_grad():
        tokens = vit.patch_embed.proj(x).permute(0, 2, 3, 1)
        pos = vit.pos_embed.reshape(1, 8, 8, -1).permute(0, 3, 1, 2)
        pos = F.interpolate(pos, size=tokens.shape[1:3], mode="bicubic", antialias=True).permute(0, 2, 3, 1)
        want = _window_reference(vit, tokens + pos, 4).permute(0, 3, 1, 2)
        torch.testing.assert_close(trunk(x), want, rtol=1e-5, atol=1e-5)


def test_global_blocks_and_position_embedding_resized():
    torch.manual_seed(0)
    vit = VisionTransformer(img_size=224, patch_size=16, embed_dim=48, depth=4, num_heads=3)  # with a class token
    trunk = ViTDetTrunk(copy.deepcopy(vit), img_size=128, window_size=4, global_blocks=(1, 3))
    assert [b.window_size for b in trunk.blocks] == [4, 0, 4, 0]
    grid = vit.pos_embed[:, 1:].reshape(1, 14, 14, -1).permute(0, 3, 1, 2)  # the class token's entry is dropped
    want = F.interpolate(grid, size=(8, 8), mode="bicubic", antialias=True).permute(0, 2, 3, 1).reshape(1, 64, -1)
    torch.testing.assert_close(trunk.pos_embed.data, want)
    assert "cls_token" not in dict(trunk.named_parameters())
    # timm's names are kept, so a timm state dict's blocks load by name
    assert set(trunk.blocks.state_dict()) == set(vit.blocks.state_dict())


# ---- conversion ------------------------------------------------------------------------------------------------
def test_convert_finds_only_the_backbone(tiny):
    names = [n for n, _ in attention_modules(tiny)]
    assert names == [f"backbone.trunk.blocks.{i}.attn" for i in range(4)]
    swin = build_detector(attn=None, **TINY_SWIN)
    names = [n for n, _ in attention_modules(swin)]
    assert len(names) == 5 and all(n.startswith("backbone.trunk.layers.") for n in names)


@pytest.mark.parametrize("which", ["vit", "swin"])
def test_converted_standard_backbone_is_bit_identical(tiny, which):
    plain = tiny if which == "vit" else build_detector(attn=None, **TINY_SWIN)
    converted = convert(copy.deepcopy(plain), "standard")
    assert all(type(m).__module__.startswith("attnlab") for _, m in attention_modules(converted))
    plain.eval(), converted.eval()
    size = 128 if which == "vit" else 64
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        a, b = plain.backbone(x), converted.backbone(x)
    assert all(torch.equal(a[k], b[k]) for k in a)


def _groups(model):
    return [(g["family"], sorted(g["applies"]), g["refused"]) for g in term_support(model)]


@pytest.mark.parametrize("term", sorted(VARIANTS))
def test_every_term_applies_as_on_the_plain_backbone(tiny, term):
    vit = attnlab.build_model("vit_tiny_patch16_224", num_classes=0, attn=None, embed_dim=96, depth=4, num_heads=3)
    [(family, applies, refused)] = _groups(vit)
    assert _groups(tiny) == [(family, applies, refused)]
    detector = copy.deepcopy(tiny)
    if term in refused:
        with pytest.raises(AttnlabError) as err:
            convert(detector, term)
        with pytest.raises(AttnlabError) as plain_err:
            convert(vit, term)
        assert str(err.value) == str(plain_err.value)
        return
    convert(detector.backbone.trunk, term)
    detector.eval()
    with torch.no_grad():
        if term in ("nystrom", "performer"):  # no additive bias, and the preset's relative positions add one
            with pytest.raises(UnsupportedModelError, match="rel_pos=False") as err:
                detector.backbone(torch.randn(1, 3, 128, 128))
            assert "\n" not in str(err.value) and str(err.value).startswith(term)
            detector = convert(copy.deepcopy(build_detector("vitdet_tiny", attn=None, rel_pos=False)).eval(), term)
        feats = detector.backbone(torch.randn(1, 3, 128, 128))
    assert all(torch.isfinite(f).all() for f in feats.values())


@pytest.mark.parametrize("term", ["nystrom", "performer"])
def test_swin_refuses_global_kernels_with_the_same_reason(term):
    swin_detector = build_detector(attn=None, **TINY_SWIN)
    plain = attnlab.build_model(TINY_SWIN["backbone"], num_classes=0, attn=None, img_size=64,
                                **TINY_SWIN["backbone_options"])
    with pytest.raises(AttnlabError) as err:
        convert(swin_detector.backbone.trunk, term)
    with pytest.raises(AttnlabError) as plain_err:
        convert(plain, term)
    assert str(err.value) == str(plain_err.value) and "window" in str(err.value)


def test_build_detector_applies_the_spec_to_the_trunk_only():
    model = build_detector("vitdet_tiny", attn="dna+sigma")
    assert model.attnlab_spec == attnlab.parse_spec("dna+sigma").__str__()
    parametrized = [n for n, m in model.named_modules() if torch.nn.utils.parametrize.is_parametrized(m)]
    assert parametrized and all(n.startswith("backbone.trunk.") for n in parametrized)


# ---- Mask R-CNN ------------------------------------------------------------------------------------------------
def test_mask_rcnn_train_and_eval(tiny):
    model = copy.deepcopy(tiny)
    images = [torch.rand(3, 128, 128) for _ in range(2)]
    model.train()
    losses = model(images, _targets(2, empty_last=True))  # an image without objects trains too
    assert set(losses) == {"loss_classifier", "loss_box_reg", "loss_mask", "loss_objectness", "loss_rpn_box_reg"}
    total = sum(losses.values())
    assert torch.isfinite(total)
    total.backward()
    assert model.backbone.trunk.blocks[0].attn.qkv.weight.grad is not None
    model.eval()
    with torch.no_grad():
        [pred, _] = model([torch.rand(3, 128, 128), torch.rand(3, 100, 90)])
    n = len(pred["boxes"])
    assert n <= 20 and pred["boxes"].shape == (n, 4) and pred["masks"].shape == (n, 1, 128, 128)
    assert set(pred["labels"].tolist()) <= {1, 2, 3}


def test_faster_rcnn_boxes_only():
    model = build_detector("vitdet_tiny", masks=False)
    assert type(model).__name__ == "FasterRCNN"
    model.train()
    targets = [{k: v for k, v in t.items() if k != "masks"} for t in _targets(1)]
    assert "loss_mask" not in model([torch.rand(3, 128, 128)], targets)
    model.eval()
    with torch.no_grad():
        assert "masks" not in model([torch.rand(3, 128, 128)])[0]


def test_swin_mask_rcnn_forward():
    model = build_detector(attn="speccond", **TINY_SWIN)
    assert isinstance(model.backbone.trunk, SwinTransformer)
    model.train()
    losses = model([torch.rand(3, 64, 64)], _targets(1, size=64))
    assert torch.isfinite(sum(losses.values()))


# ---- weights and presets ---------------------------------------------------------------------------------------
def test_pretrained_file_initialises_the_trunk(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(3)
    source = VisionTransformer(img_size=224, patch_size=16, embed_dim=48, depth=2, num_heads=3, num_classes=5)
    path = tmp_path / "vit.safetensors"
    save_file(source.state_dict(), str(path))
    model = build_detector("vit_tiny_patch16_224", num_classes=2, img_size=224, pretrained_file=str(path),
                           heads="light", fpn_channels=16, embed_dim=48, depth=2, num_heads=3)
    trunk = model.backbone.trunk
    assert torch.equal(trunk.blocks[1].attn.qkv.weight, source.blocks[1].attn.qkv.weight)
    assert torch.equal(trunk.patch_embed.proj.weight, source.patch_embed.proj.weight)
    assert torch.equal(trunk.pos_embed, source.pos_embed[:, 1:])  # same grid: the class token's entry dropped


def test_dna_authors_checkpoint_initialises_the_trunk(tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(4)
    dim, heads = 48, 3
    vit = VisionTransformer(img_size=224, patch_size=16, embed_dim=dim, depth=1, num_heads=heads, num_classes=7)
    state = {k: v for k, v in vit.state_dict().items() if ".attn.qkv." not in k}
    qqkvv = torch.randn(5 * dim, dim)  # the authors' fused rows: Q+, Q-, K, V+, V-
    state["blocks.0.attn.qqkvv.weight"] = qqkvv
    state["blocks.0.attn.qqkvv.bias"] = torch.randn(5 * dim)
    state["blocks.0.attn.neg_scalers"] = torch.tensor([0.1, 0.2, 0.3])
    path = tmp_path / "dna.safetensors"
    save_file(state, str(path))
    model = build_detector("vit_tiny_patch16_224", attn="dna", pretrained_file=str(path), dna_layout="forward",
                           heads="light", fpn_channels=16, embed_dim=dim, depth=1, num_heads=heads)
    attn = model.backbone.trunk.blocks[0].attn
    assert torch.equal(attn.qkv.weight, qqkvv)  # attnlab's order is the authors' forward order
    assert torch.equal(attn.alpha.detach(), torch.tensor([0.1, 0.2, 0.3]))


def test_presets_through_build_model():
    model = attnlab.build_model("vitdet_tiny", num_classes=5, attn="ns")
    assert type(model).__name__ == "MaskRCNN" and model.roi_heads.box_predictor.cls_score.out_features == 6
    assert model.attnlab_spec == "ns"
    cfg = model.detector_config
    assert (cfg.img_size, cfg.window_size, cfg.global_blocks) == (128, 4, (1, 3))


@pytest.mark.parametrize("name, kwargs, error", [
    ("xcit_nano_12_p16_224", {}, UnsupportedModelError),  # neither ViT nor Swin
    ("vit_cifar", {}, UnsupportedModelError),  # an attnlab preset, not a timm backbone
    ("vitdet_tiny", {"heads": "big"}, ConfigError),
    ("vitdet_tiny", {"global_blocks": (4,)}, UnsupportedModelError),
    ("vitdet_tiny", {"img_size": 100}, UnsupportedModelError),
    ("vitdet_tiny", {"anchor_sizes": (8, 16)}, ConfigError),
    ("vitdet_tiny", {"dna_layout": "forward"}, ConfigError),  # an authors' layout without their file
])
def test_backbones_and_options_the_task_cannot_take(name, kwargs, error):
    with pytest.raises(error) as err:
        build_detector(name, attn=None, **kwargs)
    assert "\n" not in str(err.value) and str(err.value).endswith(".")


def test_spec_error_is_the_convert_one(tiny):
    with pytest.raises(SpecError):
        build_detector("vitdet_tiny", attn="nonsense")


@pytest.mark.parametrize("name, millions", [
    ("vitdet_base_224", 111),  # the ViTDet paper's ViT-B Mask R-CNN (its Table 5)
    ("swin_small_maskrcnn", 69),  # the Swin paper's Mask R-CNN with Swin-S
])
def test_paper_shapes_have_the_papers_parameter_counts(name, millions):
    with torch.device("meta"):
        model = attnlab.build_model(name, attn=None)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6) == millions
