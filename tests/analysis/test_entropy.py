"""Attention entropy against hand-computed distributions, max logits and W_q^T W_k spectral norms against float64
references, the training probe, and the refusals."""

import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab.analysis import entropy as E
from attnlab.attention.standard import StandardAttention
from attnlab.errors import UnsupportedModelError
from attnlab.models import attention_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_qk as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _module(dim, num_heads, q_weight, k_weight):
    """A bare attention module (it is its own model: input tokens (B, N, dim)) with given per-block q, k weights."""
    m = StandardAttention(dim, num_heads, qkv_bias=False)
    with torch.no_grad():
        m.qkv.weight.zero_()
        m.qkv.weight[:dim] = q_weight
        m.qkv.weight[dim:2 * dim] = k_weight
    return m


def test_uniform_attention_has_entropy_log_n():
    """W_q = 0: every logit is 0, attention is uniform over N = 5 keys, entropy log 5 in every row and head."""
    m = _module(8, 2, torch.zeros(8, 8), torch.randn(8, 8))
    (layer,) = E.attention_entropy(m, torch.randn(3, 5, 8))
    assert layer["log_n"] == pytest.approx(math.log(5))
    torch.testing.assert_close(layer["mean"], torch.full((2,), math.log(5), dtype=torch.float64))
    torch.testing.assert_close(layer["low"], torch.full((2,), math.log(5), dtype=torch.float64))


def _one_hot_tokens(batch, n):
    return torch.eye(n).expand(batch, n, n).clone()


def test_one_hot_attention_has_entropy_zero():
    """Tokens e_1..e_4, W_q = W_k = 60 I, head dim 4: logit_ij = 3600 delta_ij / 2, so each query attends only to
    itself (the other weights are exp(-1800) = 0 in float32) and the entropy is exactly 0."""
    m = _module(4, 1, 60 * torch.eye(4), 60 * torch.eye(4))
    (layer,) = E.attention_entropy(m, _one_hot_tokens(2, 4))
    assert layer["mean"].tolist() == [0.0] and layer["low"].tolist() == [0.0]


def test_two_point_distribution():
    """Two tokens e_1, e_2, head dim 2, W_q = I, W_k = a I with a = sqrt(2) ln 3: logits (ln 3, 0) and (0, ln 3),
    weights (3/4, 1/4): H = -(3/4) ln(3/4) - (1/4) ln(1/4) = ln 4 - (3/4) ln 3 = 0.5623351446 nats."""
    a = math.sqrt(2) * math.log(3)
    m = _module(2, 1, torch.eye(2), a * torch.eye(2))
    (layer,) = E.attention_entropy(m, _one_hot_tokens(1, 2))
    assert layer["mean"].item() == pytest.approx(0.5623351446, abs=1e-6)
    assert layer["log_n"] == pytest.approx(math.log(2))
    (maxima,) = E.max_logits(m, _one_hot_tokens(1, 2))
    assert maxima["max"].item() == pytest.approx(math.log(3), rel=1e-6)


def test_low_tail_is_the_lowest_rows():
    """Image 1: zero tokens (uniform, log 4 per row); image 2: one-hot tokens (entropy 0). 8 rows, half at 0:
    mean = log(4) / 2, the 50 % tail is 0, the 100 % 'tail' is the mean, a 60 % tail (5 rows) is log(4) / 5."""
    m = _module(4, 1, 60 * torch.eye(4), 60 * torch.eye(4))
    images = torch.cat([torch.zeros(1, 4, 4), _one_hot_tokens(1, 4)])
    for percent, expected in ((50, 0.0), (100, math.log(4) / 2), (60, math.log(4) / 5), (1, 0.0)):
        (layer,) = E.attention_entropy(m, images, topk_percent=percent, batch_size=1)
        assert layer["mean"].item() == pytest.approx(math.log(4) / 2, abs=1e-6)
        assert layer["low"].item() == pytest.approx(expected, abs=1e-6), percent


def _inputs(model, images):
    seen = []
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
               for _, m in attention_modules(model)]
    with torch.no_grad():
        model.eval()(images)
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("spec", ["standard", "qknorm+ns"])
def test_vit_entropy_and_max_logits_match_reference(spec):
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=spec)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # attention far from uniform, QK-norm weights not the identity
        for _, m in attention_modules(model):
            m.qkv.weight[: 2 * m.attn_dim] *= 8
            for norm in (m.q_norm, m.k_norm):
                if isinstance(norm, torch.nn.LayerNorm):
                    norm.weight.copy_(2 + torch.randn(norm.weight.shape, generator=g))
                    norm.bias.copy_(torch.randn(norm.bias.shape, generator=g))
    images = torch.randn(5, 1, 8, 8, generator=torch.Generator().manual_seed(1))
    seen = _inputs(model, images)
    entropy = E.attention_entropy(model, images, topk_percent=20, batch_size=2)
    maxima = E.max_logits(model, images, batch_size=3)
    for layer, ((name, m), tokens) in enumerate(zip(attention_modules(model), seen)):
        norms = {}
        if spec != "standard":
            norms = {key: (n.weight, n.bias, n.eps) for key, n in (("q_norm", m.q_norm), ("k_norm", m.k_norm))}
        rows = ref.row_entropies(m.qkv.weight, m.qkv.bias, tokens, m.num_heads, **norms)  # (B, H, N)
        rows = rows.transpose(1, 0, 2).reshape(m.num_heads, -1)
        k = math.ceil(rows.shape[1] * 0.2)
        assert entropy[layer]["layer"] == name
        np.testing.assert_allclose(entropy[layer]["mean"].numpy(), rows.mean(axis=1), rtol=1e-5)
        np.testing.assert_allclose(entropy[layer]["low"].numpy(), np.sort(rows, axis=1)[:, :k].mean(axis=1),
                                   rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(maxima[layer]["max"].numpy(),
                                   ref.max_logit(m.qkv.weight, m.qkv.bias, tokens, m.num_heads, **norms), rtol=1e-5)
    assert entropy[0]["mean"].min() < 0.8 * math.log(17)  # the test is not about uniform attention


def test_swin_entropy_includes_position_bias_and_mask():
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", attn="standard")
    block = model.layers[0].blocks[1]  # shifted: mask applies
    attn = block.attn
    seen = []
    h = attn.register_forward_pre_hook(lambda mod, args, kwargs: seen.append((args[0], kwargs["mask"])),
                                       with_kwargs=True)
    images = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    entropy = E.attention_entropy(model, images)
    h.remove()
    tokens, mask = seen[0]
    table = attn.relative_position_bias_table.detach().double().numpy()
    index = attn.relative_position_index.numpy()
    N = tokens.shape[1]
    pos = table[index.reshape(-1)].reshape(N, N, -1).transpose(2, 0, 1)  # (H, N, N)
    nw = mask.shape[0]
    bias = pos[None] + mask.double().numpy()[np.arange(tokens.shape[0]) % nw][:, None]  # windows fastest in B
    rows = ref.row_entropies(attn.qkv.weight, attn.qkv.bias, tokens, attn.num_heads, bias)
    np.testing.assert_allclose(entropy[1]["mean"].numpy(), rows.transpose(1, 0, 2).reshape(attn.num_heads, -1).mean(1),
                               rtol=1e-5)


def test_qk_spectral_norms_match_svd():
    torch.manual_seed(0)
    for spec in ("standard", None):  # attnlab modules and timm's own
        model = attnlab.build_model("vit_digits", **TINY_VIT, attn=spec)
        norms = E.qk_spectral_norms(model)
        for (name, m), got in zip(attention_modules(model), norms):
            assert got["layer"] == name
            np.testing.assert_allclose(got["norm"].numpy(), ref.qk_spectral_norm(m.qkv.weight, m.num_heads),
                                       rtol=1e-10)


def test_training_probe_keys_and_side_effects():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="qkclip").train()
    model.blocks[1].eval()  # mixed modes are restored as they were
    images = torch.randn(4, 1, 8, 8)
    probe = E.training_probe(model, images)
    assert model.training and model.blocks[0].attn.training and not model.blocks[1].attn.training
    assert all(torch.isneginf(m.qk_clip.max_logit).all() for _, m in attention_modules(model))
    entropy = E.attention_entropy(model, images)
    means = torch.cat([layer["mean"] for layer in entropy])
    assert probe["entropy/mean"] == pytest.approx(float(means.mean()))
    assert probe["entropy/min_head"] == pytest.approx(float(means.min()))
    assert probe["entropy/layer_2"] == pytest.approx(float(entropy[2]["mean"].mean()))
    maxima = torch.cat([r["max"] for r in E.max_logits(model, images)])
    assert probe["max_logit/max"] == pytest.approx(float(maxima.max()))
    assert probe["qk_spectral_norm/max"] == pytest.approx(
        float(torch.cat([r["norm"] for r in E.qk_spectral_norms(model)]).max()))
    assert probe["max_logit/layer_1"] == pytest.approx(float(E.max_logits(model, images)[1]["max"].max()))
    assert set(probe) == {"entropy/mean", "entropy/min_head", "entropy/low", "max_logit/max", "max_logit/mean",
                          "qk_spectral_norm/max", "qk_spectral_norm/mean"} | {
        f"{k}/layer_{i}" for i in range(3) for k in ("entropy", "max_logit")}


def test_unsupported_kernels():
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="cog")
    images = torch.randn(2, 1, 8, 8)
    with pytest.raises(UnsupportedModelError, match="standard kernel"):
        E.attention_entropy(model, images)
    kept = E.attention_entropy(model, images, skip_unsupported=True)  # cog keeps first and last layers softmax...
    assert [r["layer"] for r in kept] == []  # ...but they are CogAttention modules, so none is measured
    probe = E.training_probe(model, images)
    assert "entropy/mean" not in probe and "qk_spectral_norm/max" in probe
    with pytest.raises(UnsupportedModelError, match="attnlab.convert"):
        E.max_logits(attnlab.build_model("vit_digits", **TINY_VIT, attn=None), images)


def _padded_lra_model():
    torch.manual_seed(0)  # the authors' LRA model, tiny: its forward passes its blocks the key-padding mask
    model = attnlab.build_model("lra", attn="standard", max_length=10, pad_multiple=1, depth=1).eval()
    tokens = torch.randint(1, 16, (2, 10))
    tokens[0, 7:] = 0
    tokens[1, 4:] = 0
    return model, tokens


def test_padded_positions_are_not_measured():
    model, tokens = _padded_lra_model()
    attn = attention_modules(model)[0][1]
    seen = []
    handle = attn.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].detach()), with_kwargs=True)
    with torch.no_grad():
        model(tokens)
    handle.remove()
    x, real = seen[0], (tokens != 0).numpy()
    bias = np.where(real[:, None, None, :], 0.0, -np.inf)  # padded keys: weight 0
    rows = ref.row_entropies(attn.qkv.weight, attn.qkv.bias, x, attn.num_heads, bias=bias)  # (B, H, N)
    want = np.stack([rows[:, h][real].mean() for h in range(attn.num_heads)])  # real queries only
    (layer,) = E.attention_entropy(model, tokens)
    np.testing.assert_allclose(layer["mean"].numpy(), want, rtol=1e-5)
    allowed = real[:, :, None] & real[:, None, :]  # a real query and a real key
    (top,) = E.max_logits(model, tokens)
    np.testing.assert_allclose(top["max"].numpy(), ref.max_logit(attn.qkv.weight, attn.qkv.bias, x, attn.num_heads,
                                                                 allowed=allowed), rtol=1e-5)


class _Causal(torch.nn.Module):
    """A causal stack of timm blocks (what a GPT passes its blocks)."""

    def __init__(self):
        super().__init__()
        from timm.models.vision_transformer import Block

        self.blocks = torch.nn.ModuleList([Block(16, 2, qkv_bias=True)])

    def forward(self, x):
        for block in self.blocks:
            x = block(x, is_causal=True)
        return x


def test_causal_models_are_measured_over_allowed_keys():
    torch.manual_seed(1)
    model = attnlab.convert(_Causal(), "standard").eval()
    x = torch.randn(3, 6, 16)
    attn = attention_modules(model)[0][1]
    causal = np.where(np.tril(np.ones((6, 6), dtype=bool)), 0.0, -np.inf)
    (layer,) = E.attention_entropy(model, x)
    rows = ref.row_entropies(attn.qkv.weight, attn.qkv.bias, model.blocks[0].norm1(x),
                             attn.num_heads, bias=causal)
    np.testing.assert_allclose(layer["mean"].numpy(), rows.mean(axis=(0, 2)), rtol=1e-5)
    assert layer["low"].min() == 0.0  # the first query sees one key: entropy exactly 0


def test_training_probe_on_a_gpt_takes_token_ids_and_the_causal_order():
    """A GPT's probe: token ids in, each layer's max logit over the allowed (j <= i) positions only."""
    torch.manual_seed(2)
    model = attnlab.build_model("gpt_tiny", attn="standard", vocab_size=11, block_size=8, embed_dim=16, depth=2,
                                num_heads=2).train()
    with torch.no_grad():  # logits of order 1 (GPT-2's init gives ~0.01, where every maximum is near a tie)
        for _, attn in attention_modules(model):
            attn.qkv.weight.normal_(0.0, 0.5)
    tokens = torch.randint(0, 11, (3, 8))
    seen = []
    handles = [m.register_forward_pre_hook(lambda m, args, kwargs: seen.append(args[0].detach()), with_kwargs=True)
               for _, m in attention_modules(model)]
    probe = E.training_probe(model, tokens)
    for h in handles:
        h.remove()
    assert model.training
    causal = np.broadcast_to(np.tril(np.ones((8, 8), dtype=bool)), (3, 8, 8))
    raised = []
    for i, ((_, attn), x) in enumerate(zip(attention_modules(model), seen)):
        want = ref.max_logit(attn.qkv.weight, attn.qkv.bias, x, attn.num_heads, allowed=causal).max()
        everywhere = ref.max_logit(attn.qkv.weight, attn.qkv.bias, x, attn.num_heads).max()
        assert probe[f"max_logit/layer_{i}"] == pytest.approx(want, rel=1e-5)
        raised.append(want < everywhere)
    assert any(raised)  # in some layer the later keys would have raised it: the mask is what keeps them out
