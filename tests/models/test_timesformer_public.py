"""TimeSformer against the authors' own code (facebookresearch/TimeSformer, ``timesformer/models/vit.py``), read as
test data through ``tests/public_code.py`` (skips without it; ``tests/models/test_timesformer_load.py`` compares
the same layout with the float64 loops of ``tests/reference_video.py`` everywhere).

Their ``VisionTransformer`` is built at a small shape with random weights in float64, saved in their released
layout (``model_state`` with every name ``model.<name>``) and read by ``load_timesformer``: the logits agree for
all three attentions. Their image-to-video loader (``helpers.load_pretrained``) and ``init_from_image`` start from
the same image ViT and agree too, and at step 0 the video model is the image model on every frame (the paper's
warm start: ``temporal_fc`` and the time embedding at zero).

Stubs: their ``vit_utils`` imports ``torch._six`` (gone from PyTorch 2), so ``DropPath``, ``to_2tuple`` and
``trunc_normal_`` come from timm (the same code: identity in eval mode, and initialisation only, which the random
weights overwrite); their model registry (fvcore) is a no-op decorator; ``helpers``' feature-extraction imports are
unused by ``load_pretrained``.
"""

from __future__ import annotations

from functools import partial

import pytest
import timm
import torch
from timm.layers import DropPath, to_2tuple, trunc_normal_
from torch import nn

import attnlab
from attnlab.models import load_timesformer
from attnlab.models.timesformer import init_from_image
from tests.public_code import load_module, stub

pytest.importorskip("einops")  # their vit.py's only dependency besides torch (in the test extra)

REPO = "facebookresearch/TimeSformer"
D, HEADS, DEPTH, C, P, IMG, T, CLASSES = 16, 2, 2, 2, 4, 8, 3, 5
ATTENTIONS = {"divided_space_time": "divided", "joint_space_time": "joint", "space_only": "space_only"}


class _Registry:
    def register(self):
        return lambda cls: cls


@pytest.fixture(scope="module")
def theirs():
    helpers = load_module(REPO, "timesformer/models/helpers.py", "timesformer.models.helpers", stubs={
        "timesformer.models.features": stub("timesformer.models.features", FeatureListNet=None, FeatureDictNet=None,
                                            FeatureHookNet=None),
        "timesformer.models.conv2d_same": stub("timesformer.models.conv2d_same", Conv2dSame=None),
        "timesformer.models.linear": stub("timesformer.models.linear", Linear=nn.Linear)})
    utils = stub("timesformer.models.vit_utils", IMAGENET_DEFAULT_MEAN=(0.485, 0.456, 0.406),
                 IMAGENET_DEFAULT_STD=(0.229, 0.224, 0.225), DropPath=DropPath, to_2tuple=to_2tuple,
                 trunc_normal_=trunc_normal_)
    return load_module(REPO, "timesformer/models/vit.py", "timesformer.models.vit", stubs={
        "timesformer.models.vit_utils": utils, "timesformer.models.helpers": helpers,
        "timesformer.models.build": stub("timesformer.models.build", MODEL_REGISTRY=_Registry())})


def _their_model(vit, attention_type: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = vit.VisionTransformer(img_size=IMG, patch_size=P, in_chans=C, num_classes=CLASSES, embed_dim=D,
                                  depth=DEPTH, num_heads=HEADS, mlp_ratio=2.0, qkv_bias=True,
                                  norm_layer=partial(nn.LayerNorm, eps=1e-6), num_frames=T,
                                  attention_type=attention_type).double().eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():  # every weight random, temporal_fc included (theirs starts at zero)
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    return model


def _ours(attention: str, in_chans: int = C) -> nn.Module:
    return attnlab.build_model("timesformer_tiny", num_classes=CLASSES, img_size=IMG, patch_size=P, in_chans=in_chans,
                               embed_dim=D, depth=DEPTH, num_heads=HEADS, mlp_ratio=2.0, num_frames=T,
                               attention=attention).double().eval()


@pytest.mark.parametrize("attention_type", list(ATTENTIONS))
def test_released_layout_gives_their_logits(theirs, attention_type, tmp_path):
    model = _their_model(theirs, attention_type)
    path = tmp_path / "released.pyth"
    torch.save({"epoch": 1, "model_state": {f"model.{k}": v for k, v in model.state_dict().items()}}, path)
    ours = load_timesformer(_ours(ATTENTIONS[attention_type]), path)
    clip = torch.randn(2, C, T, IMG, IMG, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = model(clip), ours(clip)
    assert want.abs().max() > 0.1  # logits that carry the weights, not a collapsed output
    print(f"TimeSformer {attention_type}: max |logit difference| {(got - want).abs().max().item():.2e}")
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_warm_start_from_an_image_vit_is_theirs_and_the_image_model_per_frame(theirs, tmp_path):
    """Both loaders start from one image ViT (timm's layout, as their ``load_pretrained`` reads it; 3 channels, or
    their loader drops the patch embedding): the two video
    models agree, and at step 0 (``temporal_fc`` and ``time_embed`` zero) each frame's patch tokens are the image
    model's on that frame, so a clip of one repeated frame gives exactly the image model's logits."""
    image = timm.create_model("vit_tiny_patch16_224", img_size=IMG, patch_size=P, in_chans=3, embed_dim=D,
                              depth=DEPTH, num_heads=HEADS, mlp_ratio=2.0, num_classes=CLASSES).double().eval()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in image.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    path = tmp_path / "image_vit.pth"
    torch.save({"model": image.state_dict()}, path)

    torch.manual_seed(0)
    model = theirs.VisionTransformer(img_size=IMG, patch_size=P, in_chans=3, num_classes=CLASSES, embed_dim=D,
                                     depth=DEPTH, num_heads=HEADS, mlp_ratio=2.0, qkv_bias=True,
                                     norm_layer=partial(nn.LayerNorm, eps=1e-6), num_frames=T).double().eval()
    assert all(not b.temporal_fc.weight.any() for b in model.blocks)  # their init: every temporal_fc at zero
    model.default_cfg = {"url": "unused: the file is given", "num_classes": CLASSES, "first_conv": "patch_embed.proj",
                         "classifier": "head"}
    theirs.load_pretrained(model, num_classes=CLASSES, in_chans=3, img_size=IMG, num_frames=T,
                           num_patches=(IMG // P) ** 2, attention_type="divided_space_time",
                           pretrained_model=str(path))
    ours = init_from_image(_ours("divided", in_chans=3), image.state_dict())

    clip = torch.randn(2, 3, T, IMG, IMG, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    static = clip[:, :, :1].expand(-1, -1, T, -1, -1)
    with torch.no_grad():
        moving = (model(clip) - ours(clip)).abs().max().item()
        per_frame = image(static[:, :, 0])
        repeated = (ours(static) - per_frame).abs().max().item()
        theirs_repeated = (model(static) - per_frame).abs().max().item()
        # each frame's patch tokens: the image model's on that frame after the first block (frame-major here);
        # later blocks differ on a moving clip, since every frame's patches attend the one class token, the mean
        # of the frames' class-token updates
        first, last = ([(_tokens(ours, i, clip)[:, 1:].reshape(2, T, -1, D)
                         - torch.stack([_tokens(image, i, clip[:, :, t])[:, 1:] for t in range(T)], 1)).abs().max()
                        .item() for i in (0, DEPTH - 1)])
    print(f"TimeSformer warm start: |ours - theirs| {moving:.2e} on a moving clip; a repeated frame against the image "
          f"model: ours {repeated:.2e}, theirs {theirs_repeated:.2e}; patch tokens per frame against the image "
          f"model's: {first:.2e} after block 1, {last:.2e} after block {DEPTH}")
    assert moving < 1e-10 and repeated < 1e-10 and theirs_repeated < 1e-10 and first < 1e-10
    assert last > 1e-3


def _tokens(model: nn.Module, block: int, x: torch.Tensor) -> torch.Tensor:
    """The tokens leaving ``model.blocks[block]``."""
    seen = []
    handle = model.blocks[block].register_forward_hook(lambda m, args, out: seen.append(out))
    model(x)
    handle.remove()
    return seen[0]
