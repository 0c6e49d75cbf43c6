"""TimeSformer: the three attentions against a float64 loop over frames and patch positions, the start from an image
ViT (a silent temporal branch gives the image model's logits), convert on both or one attention, and the presets."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file

import attnlab
from attnlab.errors import AttnlabError, ConfigError
from attnlab.models import attention_modules, init_from_image
from tests.reference_video import timesformer_logits

SMALL = dict(img_size=8, patch_size=4, in_chans=2, embed_dim=16, depth=2, num_heads=2, mlp_ratio=2.0,
             num_frames=3, drop_path_rate=0.0)


def _randomised(model):
    """Every parameter drawn afresh (temporal_fc and the time embedding too, so every path counts)."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
    return model


@pytest.mark.parametrize("attention", ["divided", "joint", "space_only"])
def test_forward_equals_a_loop_over_frames_and_positions(attention):
    model = _randomised(attnlab.models.TimeSformer(num_classes=5, attention=attention, **SMALL)).double().eval()
    clips = torch.randn(2, 2, 3, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    params = {k: v.numpy() for k, v in model.state_dict().items()}
    want = [timesformer_logits(c.numpy(), params, heads=2, depth=2, patch=4, attention_type=attention) for c in clips]
    with torch.no_grad():
        got = model(clips)
    torch.testing.assert_close(got, torch.tensor(np.array(want)), rtol=1e-10, atol=1e-10)


def test_divided_attention_sees_frame_order_and_space_only_does_not():
    clips = torch.randn(1, 2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    reverse = clips.flip(2)
    for attention, order_matters in (("divided", True), ("joint", True), ("space_only", False)):
        model = _randomised(attnlab.models.TimeSformer(num_classes=5, attention=attention, **SMALL)).eval()
        with torch.no_grad():
            same = torch.allclose(model(clips), model(reverse), atol=1e-5)
        assert same != order_matters, attention


def _image_model():
    torch.manual_seed(0)
    image = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, in_chans=1, embed_dim=64, depth=2,
                              num_heads=4, mlp_ratio=2.0, num_classes=4).eval()
    with torch.no_grad():  # a trained-looking head and class token, not timm's zero / 1e-6 init
        image.head.weight.normal_(0, 0.5)
        image.cls_token.normal_(0, 0.5)
    return image


def test_silent_temporal_branch_gives_the_image_models_logits_for_every_frame():
    image = _image_model()
    video = init_from_image(attnlab.build_model("timesformer_tiny", attn=None), image.state_dict()).eval()
    frames = torch.randn(3, 1, 16, 16, generator=torch.Generator().manual_seed(2))
    clips = frames[:, :, None].expand(3, 1, 8, 16, 16)  # clip b is frame b repeated over its 8 frames
    with torch.no_grad():
        torch.testing.assert_close(video(clips), image(frames), rtol=1e-5, atol=1e-5)
    block = video.blocks[1]
    assert torch.equal(block.temporal_attn.qkv.weight, image.blocks[1].attn.qkv.weight)  # TimeSformer's copy
    assert torch.equal(block.temporal_norm1.weight, image.blocks[1].norm1.weight)
    assert not block.temporal_fc.weight.any() and not video.time_embed.any()
    with torch.no_grad():
        block.temporal_fc.weight.normal_()  # a live temporal branch changes what the clip shows
        assert not torch.allclose(video(clips), image(frames), atol=1e-3)


def test_pretrained_file_of_an_image_model_and_the_dna_warm_start(tmp_path):
    image = _image_model()
    save_file(image.state_dict(), tmp_path / "image.safetensors")
    frames = torch.randn(2, 1, 16, 16, generator=torch.Generator().manual_seed(4))
    clips = frames[:, :, None].expand(2, 1, 8, 16, 16)
    video = attnlab.build_model("timesformer_tiny", pretrained_file=tmp_path / "image.safetensors").eval()
    dna = attnlab.build_model("timesformer_tiny", attn="dna(init=copy,neg_init=-1e-4)",
                              pretrained_file=tmp_path / "image.safetensors").eval()
    with torch.no_grad():
        want = image(frames)
        torch.testing.assert_close(video(clips), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dna(clips), want, rtol=0, atol=2e-3)  # the negative branch starts at 1e-4
    assert {type(m).__name__ for _, m in attention_modules(dna)} == {"DnAAttention"}


def test_image_models_that_do_not_fit_are_refused():
    video = attnlab.build_model("timesformer_tiny", attn=None)
    pooled = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, in_chans=1, embed_dim=64, depth=2,
                               num_heads=4, class_token=False, global_pool="avg")
    with pytest.raises(ConfigError, match="class token"):
        init_from_image(video, pooled.state_dict())
    deeper = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, in_chans=1, embed_dim=64, depth=3,
                               num_heads=4)
    with pytest.raises(ConfigError, match="blocks.2"):
        init_from_image(video, deeper.state_dict())
    shallow = {k: v for k, v in _image_model().state_dict().items() if not k.startswith("blocks.1.")}
    with pytest.raises(ConfigError, match="lacks 'blocks.1"):
        init_from_image(video, shallow)


def test_position_embedding_is_resampled_for_another_grid():
    image = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, in_chans=1, embed_dim=64, depth=2,
                              num_heads=4, mlp_ratio=2.0, num_classes=4)  # a 4 x 4 grid for the model's 2 x 2
    video = init_from_image(attnlab.build_model("timesformer_tiny", attn=None), image.state_dict())
    assert video.pos_embed.shape == (1, 5, 64)
    assert torch.equal(video.pos_embed[:, 0], image.pos_embed[:, 0])


def test_convert_reaches_both_attentions_or_one():
    both = attnlab.build_model("timesformer_tiny", attn="dna")
    assert [type(m).__name__ for _, m in attention_modules(both)] == ["DnAAttention"] * 4
    layers = [(m.layer_index, m.num_layers) for _, m in attention_modules(attnlab.build_model("timesformer_tiny",
                                                                                              attn="diff"))]
    assert layers == [(0, 2), (0, 2), (1, 2), (1, 2)]  # both attentions of a block are at its depth
    for group, converted in (("temporal", "temporal_attn"), ("spatial", "attn"), ("blocks.1.*", "blocks.1.")):
        model = attnlab.convert(attnlab.build_model("timesformer_tiny", attn=None), "cog", only=group)
        kinds = {name: type(m).__name__ for name, m in attention_modules(model)}
        for name, kind in kinds.items():
            picked = name.endswith("." + converted) if not converted.endswith(".") else name.startswith(converted)
            assert kind == ("CogAttention" if picked else "Attention"), (group, name)
    with pytest.raises(ConfigError, match="matches none"):
        attnlab.convert(attnlab.build_model("timesformer_tiny"), "dna", only="temporal_attn")
    with pytest.raises(AttnlabError, match="targets=attn"):
        attnlab.convert(attnlab.build_model("timesformer_tiny"), "sigma", only="temporal")
    x = torch.randn(2, 1, 8, 16, 16)
    for spec in ("ns", "dna+ns", "diff", "cog", "qknorm", "qkclip", "sigma", "speccond", "nystrom", "performer"):
        model = attnlab.build_model("timesformer_tiny", attn=spec)
        model(x).sum().backward()  # every term of global attention acts in both attentions


def test_presets_and_wrong_inputs():
    with torch.device("meta"):  # ViT-B's shapes without its memory
        base = attnlab.build_model("timesformer_base", num_classes=400, attn=None)
    assert sum(p.numel() for p in base.parameters()) == pytest.approx(121.6e6, rel=0.01)  # the paper's 121.4M
    assert (base.num_frames, base.patch_embed.img_size, base.attention) == (8, (224, 224), "divided")
    tiny = attnlab.build_model("timesformer_tiny")
    assert tiny.time_embed.std() > 0.01  # trained from scratch the frames get tags (zero only from an image model)
    with pytest.raises(ConfigError, match=r"\(B, C, T, H, W\)"):
        tiny(torch.randn(2, 1, 16, 16))
    with pytest.raises(ConfigError, match="attention="):
        attnlab.build_model("timesformer_tiny", attention="axial")
    with pytest.raises(ConfigError, match="weight_init="):
        attnlab.build_model("timesformer_tiny", weight_init="kaiming")
    with pytest.raises(ConfigError, match="no published weights"):
        attnlab.build_model("timesformer_tiny", pretrained=True)
    longer = tiny(torch.randn(2, 1, 12, 16, 16))  # another clip length: the time embedding is resampled
    assert longer.shape == (2, 4)
