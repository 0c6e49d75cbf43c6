"""Signed relevance (DnA Sec. 4.3 / App. C.5 (E), Chefer et al.'s rule): known answers and the float64 reference."""

import pytest
import torch
from torch import nn

import attnlab
from attnlab.analysis import relevance_maps, rollout
from attnlab.analysis.maps import capture_maps, eval_mode
from attnlab.analysis.relevance import layer_relevance, plot_relevance, relevance_matrices
from attnlab.errors import UnsupportedModelError
from tests import reference_instruments as ref


class IdentityAttention(nn.Module):
    """A ViT whose every attention map is the identity: each token may attend only to itself."""

    def __init__(self, vit):
        super().__init__()
        self.vit = vit

    def forward(self, x):
        n = self.vit.patch_embed.num_patches + self.vit.num_prefix_tokens
        return self.vit(x, attn_mask=torch.eye(n, dtype=torch.bool))


@pytest.mark.parametrize("attn", ["standard", "dna", "diff"])
def test_identity_attention_lights_up_only_the_token_itself(attn):
    torch.manual_seed(0)
    model = IdentityAttention(attnlab.build_model("vit_digits", num_classes=10, attn=attn, in_chans=1, img_size=8))
    R, classes = relevance_matrices(model, torch.randn(3, 1, 8, 8))
    assert set(R) == ({"attn"} if attn == "standard" else {"pos", "neg"}) and classes.shape == (3,)
    for matrix in R.values():
        off = matrix - torch.diag_embed(matrix.diagonal(dim1=-2, dim2=-1))
        assert off.abs().max().item() == 0.0
        if attn != "diff":  # diff's second map enters with -lambda: its diagonal may fall below 1
            assert matrix.diagonal(dim1=-2, dim2=-1).min().item() >= 1.0


def test_rules_against_reference():
    torch.manual_seed(0)
    maps = [torch.randn(2, 3, 4, 4) for _ in range(3)]
    grads = [torch.randn(2, 3, 4, 4) for _ in range(3)]
    got = rollout([layer_relevance(m, g) for m, g in zip(maps, grads)])
    for b in range(2):
        want = ref.rollout([m[b] for m in maps], [g[b] for g in grads])
        assert torch.allclose(got[b].double(), want, atol=1e-5)


@pytest.mark.parametrize("attn", ["dna", "diff"])
def test_model_relevance_against_reference(attn):
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", num_classes=10, attn=attn, in_chans=1, img_size=8)
    images = torch.randn(2, 1, 8, 8)
    got, classes = relevance_matrices(model, images)
    layers = []
    with capture_maps(model, lambda i, n, m, branches: layers.append(branches)), eval_mode(model), \
            torch.enable_grad():
        logits = model(images.clone().requires_grad_(True))
        flat = [layer[b].effective for layer in layers for b in ("pos", "neg")]
        grads = torch.autograd.grad(logits.gather(1, classes.view(-1, 1)).sum(), flat)
    assert torch.equal(classes, logits.argmax(-1))
    for j, b in enumerate(("pos", "neg")):
        for i in range(2):
            want = ref.rollout([flat[2 * k + j][i].detach() for k in range(2)],
                               [grads[2 * k + j][i] for k in range(2)])
            assert torch.allclose(got[b][i].double(), want, atol=1e-5)
    if attn == "diff":  # -lambda A2: the subtracted branch carries negative relevance
        assert (got["neg"] - torch.eye(16)).min() < 0


def test_class_token_readout_and_overlay(tmp_path):
    import timm

    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=3)
    attnlab.convert(vit, "standard")
    images = torch.randn(3, 3, 32, 32)
    rel = relevance_maps(vit, images, classes=torch.tensor([0, 1, 2]), batch_size=2)
    assert rel.prefix == 1 and rel.maps["attn"].shape == (3, 4, 4) and rel.classes.tolist() == [0, 1, 2]
    assert torch.equal(rel.maps["attn"].reshape(3, 16), rel.matrices["attn"][:, 0, 1:])
    plot_relevance(images, rel, tmp_path / "r.png")
    assert (tmp_path / "r.png").stat().st_size > 1000


def test_swin_is_refused_with_the_reason():
    model = attnlab.build_model("swin_cifar", num_classes=10)
    with pytest.raises(UnsupportedModelError, match="shifted windows") as err:
        relevance_maps(model, torch.randn(1, 3, 32, 32))
    assert "\n" not in str(err.value)
