"""Jacobian conditioning: jacrev's Jacobian and its condition number against central finite differences of a float64
loop implementation of one head, on a tiny block and on a real (tiny) model's block; Swin windows; rejections."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab.analysis.jacobian import head_function
from attnlab.attention.mask import AttentionMask, Mask
from attnlab.attention.standard import StandardAttention
from attnlab.analysis.jacobian import attention_jacobian, condition_number, jacobian_conditioning
from attnlab.errors import ConfigError, UnsupportedModelError

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_baselines as ref_baselines  # noqa: E402
import reference_reparam as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _np(t):
    return t.detach().double().numpy()


def _reference(x, w_q, w_k, w_v, b_q, b_k, b_v, scale, bias=None):
    """Finite-difference Jacobian and its condition number (numpy SVD)."""
    def f(wq, wk, wv):
        return ref.head_attention(x, wq, wk, wv, b_q, b_k, b_v, scale, bias)

    j = ref.finite_difference_jacobian(f, [w_q, w_k, w_v])
    return j, ref.kappa(j)


def test_tiny_block_against_finite_differences():
    g = torch.Generator().manual_seed(0)
    n_tok, c, d = 4, 6, 3
    x = torch.randn(n_tok, c, generator=g, dtype=torch.float64)
    w = [torch.randn(d, c, generator=g, dtype=torch.float64) * 0.7 for _ in range(3)]
    b = [torch.randn(d, generator=g, dtype=torch.float64) * 0.1 for _ in range(3)]
    bias = torch.randn(n_tok, n_tok, generator=g, dtype=torch.float64)
    # one head of a standard module (head_dim d: scale d^-0.5), the bias a position bias of the call's mask
    module = StandardAttention(c, 2, head_dim=d).double()
    mask = Mask(AttentionMask(), 1, n_tok, n_tok, x.device, bias=bias[None, None])
    j = attention_jacobian(x, *w, head_function(module, 0, mask), b_q=b[0], b_k=b[1], b_v=b[2])
    assert j.shape == (n_tok * d, 3 * d * c)
    j_ref, kappa_ref = _reference(_np(x), *map(_np, w), *map(_np, b), d ** -0.5, _np(bias))
    np.testing.assert_allclose(j.numpy(), j_ref, rtol=1e-6, atol=1e-8)
    kappa, s_max, s_min = condition_number(j)
    assert float(kappa) == pytest.approx(kappa_ref, rel=1e-6)
    assert float(s_max / s_min) == pytest.approx(float(kappa))


def test_model_block_against_finite_differences():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="standard")
    images = torch.randn(2, 1, 8, 8)
    captured = {}
    attn = model.blocks[1].attn
    handle = attn.register_forward_pre_hook(lambda m, args: captured.setdefault("x", args[0].detach()))
    with torch.no_grad():
        model.eval()(images)
    handle.remove()
    model.train()
    result = jacobian_conditioning(model, images, blocks=[1], heads=[2], sequences=[1])
    assert result.kappa.shape == (1, 1, 1) and result.blocks == ["blocks.1.attn"]
    assert model.training  # the mode is restored
    d, a = attn.head_dim, attn.attn_dim
    w, bias = _np(attn.qkv.weight), _np(attn.qkv.bias)
    rows = [slice(p * a + 2 * d, p * a + 3 * d) for p in range(3)]  # head 2's rows of q, k and v
    x = _np(captured["x"][1])
    j_ref, kappa_ref = _reference(x, *(w[r] for r in rows), *(bias[r] for r in rows), d ** -0.5)
    assert float(result.sigma_max[0, 0, 0]) == pytest.approx(np.linalg.norm(j_ref, 2), rel=1e-6)
    # kappa is ~1e8 here: sigma_min ~1e-8 sigma_max carries the finite differences' error (~1e-10 per entry)
    assert float(result.kappa[0, 0, 0]) == pytest.approx(kappa_ref, rel=1e-3)


def test_uses_the_effective_weights():
    """Under speccond the Jacobian is taken at W + lam I_k: the measured kappa differs from the plain model's."""
    torch.manual_seed(0)
    plain = attnlab.build_model("vit_digits", **TINY_VIT, attn="standard")
    torch.manual_seed(0)
    conditioned = attnlab.build_model("vit_digits", **TINY_VIT, attn="speccond(lam=2)")
    images = torch.randn(1, 1, 8, 8)
    k0 = jacobian_conditioning(plain, images, blocks=[0], heads=[0]).kappa
    k1 = jacobian_conditioning(conditioned.double(), images.double(), blocks=[0], heads=[0]).kappa
    assert not torch.allclose(k0, k1, rtol=1e-3)
    # k1 against autograd through a float64 head on W + 2 I_k (each of the q, k, v blocks), SVD by numpy
    attn = conditioned.blocks[0].attn
    seen = {}
    handle = attn.register_forward_pre_hook(lambda m, args: seen.setdefault("x", args[0].detach()))
    with torch.no_grad():
        conditioned.eval()(images.double())
    handle.remove()
    d, a = 16, 64  # 4 heads of 16
    w = torch.from_numpy(ref.add_identity_blocks(_np(attn.qkv.parametrizations.weight.original), 2.0, 3))
    bias = attn.qkv.bias.detach().double()
    rows = [slice(p * a, p * a + d) for p in range(3)]  # head 0's rows of q, k and v
    parts = torch.autograd.functional.jacobian(
        lambda wq, wk, wv: ref.head_attention_autograd(seen["x"][0], wq, wk, wv, *(bias[r] for r in rows), d ** -0.5),
        tuple(w[r] for r in rows), vectorize=True)
    j = torch.cat([p.reshape(seen["x"].shape[1] * d, -1) for p in parts], dim=1).numpy()
    assert k1[0, 0, 0].item() == pytest.approx(ref.kappa(j), rel=1e-6)


def test_swin_windows_and_missing_heads():
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", attn="standard", img_size=16, depths=(2, 2), num_heads=(2, 4),
                                embed_dim=32, head_dim=8)
    images = torch.randn(1, 3, 16, 16)
    # stage 1: 8x8 tokens in four 4x4 windows, block 1 shifted (masked); stage 2: one window
    result = jacobian_conditioning(model, images, blocks=[1, 2], heads=[1, 3])
    assert result.kappa.shape == (2, 2, 1) and result.heads == [1, 3]
    assert torch.isnan(result.kappa[0, 1]).all()  # the first stage has 2 heads: head 3 does not exist there
    assert torch.isfinite(result.kappa[0, 0]).all() and torch.isfinite(result.kappa[1]).all()
    assert (result.kappa[torch.isfinite(result.kappa)] >= 1).all()
    assert torch.isfinite(result.log10_mean()).all()
    # a shifted, masked window: kappa against central differences with bias = B_rel[h] + mask[window] by hand
    attn = model.layers[0].blocks[1].attn
    seen = {}
    handle = attn.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0], mask=kwargs["mask"]),
                                            with_kwargs=True)
    with torch.no_grad():
        model.eval()(images)
    handle.remove()
    assert (seen["mask"][3] != 0).any()
    masked = jacobian_conditioning(model, images, blocks=[1], heads=[0], sequences=[3])
    d, a = 8, 2 * 8  # stage 1: 2 heads of head_dim 8
    w, bias = _np(attn.qkv.weight), _np(attn.qkv.bias)
    rows = [slice(p * a, p * a + d) for p in range(3)]  # head 0's rows of q, k and v
    b_rel = ref_baselines.rel_pos_bias(attn.relative_position_bias_table.detach().double(), 4, 4)[0]
    _, kappa_ref = _reference(_np(seen["x"][3]), *(w[r] for r in rows), *(bias[r] for r in rows), d ** -0.5,
                              _np(b_rel + seen["mask"][3].double()))
    assert masked.kappa[0, 0, 0].item() == pytest.approx(kappa_ref, rel=1e-5)
    with pytest.raises(ConfigError, match="out of range"):
        jacobian_conditioning(model, images, blocks=[2], sequences=[3])


def test_non_softmax_kernel_is_rejected():
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None)  # timm's own modules: convert first
    with pytest.raises(UnsupportedModelError, match="softmax"):
        jacobian_conditioning(model, torch.randn(1, 1, 8, 8))


def test_result_holds_no_autograd_graph():
    """The model's parameters require gradients; the measurement must not keep a graph back into them."""
    torch.manual_seed(0)
    # the low-rank kernels' head formulas apply the float32 QK-norm to float64 inputs (they once raised)
    for name, kwargs, images, kernel in (
            ("vit_digits", TINY_VIT, torch.randn(1, 1, 8, 8), None),
            ("vit_digits", TINY_VIT, torch.randn(1, 1, 8, 8), "nystrom(landmarks=4)"),
            ("vit_digits", TINY_VIT, torch.randn(1, 1, 8, 8), "performer(features=16)"),
            ("xcit_nano_12_p16_224", dict(img_size=32, depth=1, cls_attn_layers=1, num_classes=5),
             torch.randn(1, 3, 32, 32), None)):
        model = attnlab.build_model(name, **kwargs, attn="+".join(filter(None, (kernel, "speccond+qknorm"))))
        assert any(p.requires_grad for p in model.parameters())
        result = jacobian_conditioning(model, images, blocks=[0], heads=[0])
        assert not result.kappa.requires_grad and result.kappa.grad_fn is None, (name, kernel)
        assert torch.isfinite(result.kappa).all()


def test_padded_positions_are_not_rows_of_the_jacobian():
    torch.manual_seed(0)
    model = attnlab.build_model("lra", attn="standard", max_length=6, pad_multiple=1, depth=1, embed_dim=8,
                                num_heads=2).double()
    tokens = torch.tensor([[3, 5, 7, 2, 0, 0]])
    attn = model.blocks[0].attn
    seen = {}
    handle = attn.register_forward_pre_hook(lambda m, args, kwargs: seen.update(x=args[0].detach()) and None,
                                            with_kwargs=True)
    result = jacobian_conditioning(model, tokens, blocks=[0], heads=[1])
    handle.remove()
    d, a = attn.head_dim, attn.attn_dim
    w, bias = _np(attn.qkv.weight), _np(attn.qkv.bias)
    rows = [slice(p * a + d, p * a + 2 * d) for p in range(3)]
    real = (tokens[0] != 0).numpy()
    key_bias = np.where(real[None, :], 0.0, -np.inf)

    def head(wq, wk, wv):  # the head's outputs at the real tokens only
        return ref.head_attention(_np(seen["x"][0]), wq, wk, wv, *(bias[r] for r in rows), d ** -0.5,
                                  np.broadcast_to(key_bias, (6, 6)))[real]

    j_ref = ref.finite_difference_jacobian(head, [w[r] for r in rows])
    assert j_ref.shape[0] == int(real.sum()) * d
    assert float(result.sigma_max[0, 0, 0]) == pytest.approx(np.linalg.norm(j_ref, 2), rel=1e-6)
    assert float(result.kappa[0, 0, 0]) == pytest.approx(ref.kappa(j_ref), rel=1e-4)
