"""One mask for every term and backend: causal order and key padding are honoured (changing later or padded tokens
leaves the outputs they must not reach unchanged, exactly where the path allows) or refused with one line that says
why. The model is a tiny stack of timm Blocks with ``is_causal`` / an ``AttentionMask``, converted per spec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from timm.models.vision_transformer import Block
from torch import nn

import attnlab
from attnlab.attention.dna import DnAAttention
from attnlab.attention.base import Want
from attnlab.attention.mask import AttentionMask, Mask
from attnlab.errors import ConfigError, UnsupportedModelError
from attnlab.models import attention_modules
from tests import reference_dna as ref_dna
from tests.reference_lowrank import favor_masked, masked_softmax_attention

DIM, HEADS, N = 32, 2, 12


class Blocks(nn.Module):
    """A tiny sequence model of timm Blocks: what a causal or padded model passes its blocks, in miniature."""

    def __init__(self, depth: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(DIM, HEADS, mlp_ratio=2.0, qkv_bias=True) for _ in range(depth))

    def forward(self, x, attn_mask=None, is_causal=False):
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask, is_causal=is_causal)
        return x


def _need(path: str) -> None:
    """Skip, saying why, a case pinned to the fused CPU kernel where it cannot run (.ci/run's kernel-less passes)."""
    if path == "kernel":
        from attnlab.ops import dna_cpu

        why = dna_cpu.unavailable()
        if why:
            pytest.skip(why)


def _model(spec: str, path: str, dtype=torch.float64) -> nn.Module:
    _need(path)
    torch.manual_seed(0)
    model = attnlab.convert(Blocks(), spec).to(dtype).eval()
    for _, m in attention_modules(model):
        if path == "explicit" or isinstance(m, DnAAttention) and path in ("sdpa", "kernel"):
            m.use_backend(path)
    return model


def _run(model, x, path, **kwargs):
    with torch.no_grad():
        return model(x.float() if path == "kernel" else x, **kwargs)


def _dtype(path):
    return torch.float32 if path == "kernel" else torch.float64


def _padding():
    real = torch.ones(2, N, dtype=torch.bool)
    real[0, -3:] = False  # right padding
    real[1, :4] = False  # left padding
    return real


@pytest.mark.parametrize("spec", ["ns", "nystrom", "dna+ns", "nystrom+speccond"])
def test_terms_that_cannot_be_causal_say_why(spec):
    model = _model(spec, "sdpa")
    with pytest.raises(UnsupportedModelError, match="cannot honour a causal mask|cannot honour this attention mask"
                       ) as info:
        _run(model, torch.randn(1, N, DIM, dtype=torch.float64), "sdpa", is_causal=True)
    assert "\n" not in str(info.value) and ("every token" in str(info.value) or "all N tokens" in str(info.value))


def test_a_sequence_of_padding_only_and_left_padded_causal_rows_give_zeros_not_nan():
    for spec, path in [("standard", "sdpa"), ("standard", "explicit"), ("dna", "explicit"), ("dna", "sdpa"),
                       ("cog(all_layers=true)", "explicit"), ("diff", "sdpa"),
                       ("performer(features=16,backend=explicit)", "sdpa"), ("nystrom(landmarks=4)", "sdpa"), ("ns", "sdpa")]:
        model = _model(spec, path)
        real = torch.ones(2, N, dtype=torch.bool)
        real[0] = False  # nothing to attend to at all
        real[1, :3] = False  # left padding: under causality the first rows see only padding
        causal = not any(t in spec for t in ("ns", "nystrom"))
        x = torch.randn(2, N, DIM, dtype=torch.float64, requires_grad=True)
        attn = attention_modules(model)[0][1]
        seen = []
        handle = attn.register_forward_hook(lambda m, a, o: seen.append(o))
        out = model(x, attn_mask=AttentionMask(is_causal=causal, key_padding=real))
        handle.remove()
        out.sum().backward()
        assert torch.isfinite(out).all() and torch.isfinite(x.grad).all(), spec
        # a padded query's attention output is exactly the projection's bias: its head outputs are zero
        torch.testing.assert_close(seen[0][~real], attn.proj.bias.detach().expand(int((~real).sum()), -1),
                                   rtol=0, atol=0)


def test_causal_fast_path_is_sdpa_is_causal_and_equals_the_explicit_path(monkeypatch):
    calls = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("attn_mask"), kwargs.get("is_causal")))
        return real_sdpa(*args, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    for spec in ("standard", "diff", "dna"):
        calls.clear()
        fast = _run(_model(spec, "sdpa"), x, "sdpa", is_causal=True)
        assert calls and all(m is None and c for m, c in calls), spec  # no mask in memory
        explicit = _run(_model(spec, "explicit"), x, "explicit", is_causal=True)
        torch.testing.assert_close(fast, explicit, rtol=1e-12, atol=1e-12)


def test_standard_causal_and_padded_matches_a_float64_loop():
    model = _model("standard", "sdpa", torch.float64)
    attn = attention_modules(model)[0][1]
    real = _padding()
    x = torch.randn(2, N, DIM, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = attn.project(x)
        mask = Mask.resolve(AttentionMask(is_causal=True, key_padding=real), B=2, N=N, M=N, device=x.device)
        got = attn.kernel(q, k, v, mask, Want(), "sdpa")[0]
    for b in range(2):
        keep = np.tril(np.ones((N, N), dtype=bool)) & real[b].numpy()[None, :]
        want = masked_softmax_attention(q[b], k[b], v[b], keep)
        want[:, ~real[b].numpy()] = 0.0  # padded queries: zero (the module zeroes them after attend)
        np.testing.assert_allclose(torch.where(real[b][None, :, None], got[b], 0).numpy(), want, rtol=1e-10,
                                   atol=1e-12)


@pytest.mark.parametrize("variant", ["qv", "shared"])
@pytest.mark.parametrize("path", ["sdpa", "explicit", "kernel"])
def test_dna_both_branches_see_only_allowed_keys_against_the_reference(variant, path):
    """softmax over allowed keys (-inf) and softmin over allowed keys (excluded, weight 0), against the per-row loop."""
    _need(path)
    dtype = _dtype(path)
    torch.manual_seed(4)
    m = DnAAttention(DIM, HEADS, variant=variant, qkv_bias=True, backend=path).to(dtype).eval()
    with torch.no_grad():
        m.alpha.uniform_(-1, 1)
    real = _padding()
    x = torch.randn(2, N, DIM, dtype=dtype)
    with torch.no_grad():
        got = m(x, attn_mask=AttentionMask(is_causal=True, key_padding=real))
    w, b = m.qkv.weight.detach().double().numpy(), m.qkv.bias.detach().double().numpy()
    rows = {name: slice(i * DIM, (i + 1) * DIM) for i, name in enumerate(m.qkv_blocks)}
    alias = {"q_pos": "q", "q_neg": "q", "v_pos": "v", "v_neg": "v"}
    names = ("q_pos", "q_neg", "k", "v_pos", "v_neg")
    weights = {n: w[rows[n if n in rows else alias[n]]] for n in names}
    biases = {n: b[rows[n if n in rows else alias[n]]] for n in names}
    for s in range(2):
        keep = np.tril(np.ones((N, N), dtype=bool)) & real[s].numpy()[None, :]
        keep |= ~keep.any(axis=1, keepdims=True)  # padded rows without a key: open (their output is zeroed)
        proj_w, proj_b, alpha = (t.detach().double().numpy() for t in (m.proj.weight, m.proj.bias, m.alpha))
        scale = (DIM // HEADS) ** -0.5
        want = ref_dna.dna_self_attention(x[s].double().numpy(), weights, biases, proj_w, proj_b, HEADS, alpha, scale,
                                          scale, mask_add=np.where(keep, 0.0, -np.inf), allowed=keep)
        ok = real[s].numpy()
        tol = 1e-5 if path == "kernel" else 1e-10
        np.testing.assert_allclose(got[s].double().numpy()[ok], want[ok], rtol=tol, atol=tol)


def test_performer_causal_and_padded_match_the_literal_favor():
    torch.manual_seed(5)
    from attnlab.ops.lowrank import orthogonal_gaussian, performer_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 37, 8, generator=g, dtype=torch.float64) for _ in range(3))
    w = orthogonal_gaussian(16, 8, generator=g, dtype=torch.float64)
    real = torch.ones(2, 37, dtype=torch.bool)
    real[1, 30:] = False
    for causal in (False, True):
        for chunk in (1, 5, 64):  # 37 tokens: uneven chunks, one chunk, one token per chunk
            got = performer_attention(q, k, v, w, key_padding=real[:, None, :], causal=causal, chunk=chunk)
            for b in range(2):
                want = favor_masked(q[b], k[b], v[b], w, causal=causal, real=real[b].numpy())
                np.testing.assert_allclose(got[b].numpy(), want, rtol=1e-10, atol=1e-12)


def test_fused_kernels_refuse_masks_with_the_reason_and_auto_falls_back():
    model = _model("performer(features=32,backend=kernel)", "sdpa", torch.float32)
    x = torch.randn(1, N, DIM)
    with pytest.raises(ConfigError, match="bidirectional FAVOR\\+ without a mask"):
        _run(model, x, "kernel", is_causal=True)
    auto = _model("performer(features=32)", "sdpa", torch.float32)
    torch_path = _model("performer(features=32,backend=explicit)", "sdpa", torch.float32)
    torch.testing.assert_close(_run(auto, x, "kernel", is_causal=True), _run(torch_path, x, "kernel", is_causal=True))


def test_dna_triton_refuses_masks_so_auto_takes_sdpa(monkeypatch):
    from attnlab.attention.base import Call

    monkeypatch.setenv("ATTNLAB_DNA_TRITON", "1")
    m = DnAAttention(DIM, HEADS).eval()
    call = Call(torch.device("cuda"), torch.float16, False, False, False, True, 16, 4, N, N, 80, Want(), False)
    assert m.choose(call) == "sdpa"
    assert m.supports("triton", call) == "the Triton DnA kernel takes no attention bias or mask"
    assert "runs on the CPU" in m.supports("kernel", call)
    m.use_backend("triton")
    with pytest.raises(ConfigError, match="takes no attention bias or mask"):
        m.choose(call)


def test_channel_attention_refuses_masks_in_one_line():
    model = attnlab.build_model("xcit_nano_12_p16_224", num_classes=10, attn="standard", depth=1, img_size=32)
    xca = next(m for _, m in attention_modules(model) if type(m).__name__ == "XCAttention")
    with pytest.raises(UnsupportedModelError, match="takes no attention mask") as info:
        xca(torch.randn(1, 4, xca.dim), is_causal=True)
    assert "\n" not in str(info.value)


def test_key_padding_shape_and_dtype_are_checked():
    model = _model("standard", "sdpa")
    with pytest.raises(ConfigError, match="bool tensor of shape"):
        _run(model, torch.randn(2, N, DIM, dtype=torch.float64), "sdpa",
             attn_mask=AttentionMask(key_padding=torch.ones(2, N)))


@pytest.mark.parametrize("spec", ["standard", "dna", "performer(features=16)"])
def test_a_compiled_forward_honours_the_mask(spec):
    attn = attention_modules(_model(spec, "sdpa", torch.float32))[0][1]
    x = torch.randn(2, N, DIM)
    mask = AttentionMask(is_causal=True, key_padding=_padding())
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(attn, fullgraph=True, backend="eager")
        torch.testing.assert_close(compiled(x, attn_mask=mask), attn(x, attn_mask=mask), rtol=1e-6, atol=1e-6)


def test_dna_cross_attention_honours_context_padding():
    from attnlab.attention.dna_cross import DnACrossAttention

    torch.manual_seed(6)
    m = DnACrossAttention(DIM, HEADS, kv_dim=24, qkv_bias=True).double().eval()
    x, ctx = torch.randn(2, 5, DIM, dtype=torch.float64), torch.randn(2, 9, 24, dtype=torch.float64)
    real = torch.ones(2, 9, dtype=torch.bool)
    real[0, 6:] = False
    real[1] = False  # a context of padding only
    other = torch.where(real[..., None], ctx, torch.randn_like(ctx) * 4)
    for fused in (True, False):
        m.use_backend("auto" if fused else "explicit")
        with torch.no_grad():
            a = m(x, ctx, attn_mask=AttentionMask(key_padding=real))
            b = m(x, other, attn_mask=AttentionMask(key_padding=real))
        assert torch.equal(a, b)
        torch.testing.assert_close(a[1], m.proj.bias.detach().expand(5, -1), rtol=0, atol=0)  # no keys: zeros
        keep = real[:1, None, None, :]  # the same context padding as a caller's boolean or finfo.min mask
        lowest = torch.zeros(keep.shape, dtype=torch.float64).masked_fill(~keep, torch.finfo(torch.float64).min)
        with torch.no_grad():
            by_bool, by_float = m(x[:1], ctx[:1], attn_mask=keep), m(x[:1], other[:1], attn_mask=lowest)
        torch.testing.assert_close(by_bool, a[:1], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(by_float, a[:1], rtol=1e-12, atol=1e-12)
    with pytest.raises(UnsupportedModelError, match="no causal mask"):
        m(x, ctx, attn_mask=AttentionMask(is_causal=True))
