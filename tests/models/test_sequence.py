"""The LRA sequence models: the authors' ``lra`` preset (padding masked in every block and in the pooling, padded to
a multiple of the landmarks, LayerNorm eps 1e-5, the two-layer head) against an independent float64 forward."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.errors import ConfigError


def _reference(model, tokens):
    """The authors' model on one sequence, by hand (float64): embedding + positions, per block pre-LN softmax
    attention over the real keys and a GELU MLP, final LayerNorm, mean over the real tokens, Linear-ReLU-Linear."""
    real = tokens != 0
    x = model.token_embed.weight[tokens] + model.pos_embed[0, : tokens.shape[0]]
    for blk in model.blocks:
        h = torch.nn.functional.layer_norm(x, (x.shape[-1],), blk.norm1.weight, blk.norm1.bias, 1e-5)
        qkv = h @ blk.attn.qkv.weight.T + blk.attn.qkv.bias
        H, D = blk.attn.num_heads, blk.attn.head_dim
        heads = []
        for head in range(H):
            q, k, v = (qkv[:, p * H * D + head * D: p * H * D + (head + 1) * D] for p in range(3))
            logits = (q @ k.T) / math.sqrt(D)
            logits = logits.masked_fill(~real[None, :], float("-inf"))
            heads.append(logits.softmax(-1) @ v)
        x = x + torch.cat(heads, -1) @ blk.attn.proj.weight.T + blk.attn.proj.bias
        h = torch.nn.functional.layer_norm(x, (x.shape[-1],), blk.norm2.weight, blk.norm2.bias, 1e-5)
        h = torch.nn.functional.gelu(h @ blk.mlp.fc1.weight.T + blk.mlp.fc1.bias)
        x = x + h @ blk.mlp.fc2.weight.T + blk.mlp.fc2.bias
    x = torch.nn.functional.layer_norm(x, (x.shape[-1],), model.norm.weight, model.norm.bias, 1e-5)
    pooled = x[real].mean(0)
    first, _, last = model.head
    return torch.relu(pooled @ first.weight.T + first.bias) @ last.weight.T + last.bias


def test_lra_preset_is_the_authors_model_with_padding_masked():
    torch.manual_seed(0)
    model = attnlab.build_model("lra", attn="standard", max_length=20, depth=2).double().eval()
    assert model.pos_embed.shape[1] == 64 and model.norm.eps == 1e-5  # 20 padded up to a multiple of 64
    assert [type(m).__name__ for m in model.head] == ["Linear", "ReLU", "Linear"] and model.head[0].out_features == 128
    tokens = torch.randint(1, 16, (3, 20))
    tokens[0, 12:] = 0
    tokens[2, 3:] = 0
    with torch.no_grad():
        out = model(tokens)
        for b in range(3):
            torch.testing.assert_close(out[b], _reference(model, torch.nn.functional.pad(tokens[b], (0, 44))),
                                       rtol=1e-10, atol=1e-10)
        # more padding, or other padding ids' neighbours: the same logits
        torch.testing.assert_close(model(torch.nn.functional.pad(tokens, (0, 30))[:, :20]), out)


@pytest.mark.parametrize("attn", ["nystrom(landmarks=4,conv=35)", "performer(features=16)", "dna", "standard+ns"])
def test_every_kernel_sees_no_padding(attn):
    torch.manual_seed(1)
    model = attnlab.build_model("lra", attn=attn, max_length=30, pad_multiple=16, depth=1).double().eval()
    tokens = torch.randint(1, 16, (2, 30))
    tokens[:, 21:] = 0
    with torch.no_grad():
        a = model(tokens)
        b = model(tokens[:, :21])  # the same real tokens with less padding: padded to 32 either way
        c = model(torch.cat([tokens[:, :21], torch.zeros(2, 2, dtype=torch.long)], 1))
    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(a, c, rtol=1e-12, atol=1e-12)


def test_pooling_choices_and_errors():
    torch.manual_seed(2)
    tokens = torch.tensor([[3, 4, 0, 0]])
    model = attnlab.build_model("lra", attn="standard", max_length=4, pad_multiple=1, pool="padded_mean").eval()
    with torch.no_grad():
        feats = model.forward_features(tokens)
        assert torch.equal(feats[0, 2:], torch.zeros_like(feats[0, 2:]))  # padded features zero, as the authors
        torch.testing.assert_close(model.pooled(feats, tokens), feats.mean(1))  # then the mean over all 4
    with pytest.raises(ConfigError, match="need a pad_id"):
        attnlab.build_model("seq_listops", pad_multiple=64)
    with pytest.raises(ConfigError, match="pool must be one of"):
        attnlab.build_model("lra", pool="max")
    seq = attnlab.build_model("seq_listops", attn="standard", max_length=8).eval()  # kept as it was: no mask
    assert seq.mask(tokens) is None
