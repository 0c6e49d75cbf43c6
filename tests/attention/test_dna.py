"""`dna`: every Table 12 variant against a float64 per-head loop (ViT, Swin with shift mask, cross), reductions,
masks, warm start, checkpoint layouts, gradients."""

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import attnlab
from attnlab.attention.mask import AttentionMask
from attnlab.attention import DnAAttention, DnACrossAttention
from attnlab.attention.base import Want
from attnlab.attention.mask import Mask
from attnlab.attention.standard import StandardAttention
from attnlab.errors import SpecError
from attnlab.models.pretrained import dna_authors_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_dna as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)

VARIANTS = ["qv", "q", "v", "shared", "sum"]
# the documented row order of the fused projection, per variant (authors' order Q+, Q-, K, V+, V-)
LAYOUT = {"qv": ("q_pos", "q_neg", "k", "v_pos", "v_neg"), "q": ("q_pos", "q_neg", "k", "v"),
          "v": ("q", "k", "v_pos", "v_neg"), "shared": ("q", "k", "v"), "sum": ("q", "k", "v")}


def _blocks(linear, variant, A):
    """Weights / biases of each branch, sliced from the fused Linear by the documented layout (numpy float64)."""
    w = linear.weight.detach().double().numpy()
    b = None if linear.bias is None else linear.bias.detach().double().numpy()
    W, Bs = {}, {}
    for i, name in enumerate(LAYOUT[variant]):
        for target in ({"q": ("q_pos", "q_neg"), "v": ("v_pos", "v_neg")}.get(name, (name,))):
            W[target] = w[i * A:(i + 1) * A]
            Bs[target] = None if b is None else b[i * A:(i + 1) * A]
    return W, (None if b is None else Bs)


def _randomise(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
        if getattr(module, "alpha", None) is not None:  # mixed-sign alphas, one per head
            module.alpha.copy_(torch.linspace(-0.7, 1.3, module.alpha.numel(), dtype=module.alpha.dtype))
    return module


def _alpha(module):
    return None if module.alpha is None else module.alpha.detach().double().numpy()


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("scale", ["both", "neg_only"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_vit_module_matches_float64_loop(variant, scale, fused):
    m = _randomise(DnAAttention(24, 3, qkv_bias=True, variant=variant, scale=scale, backend="auto" if fused else "explicit")).double().eval()
    x = torch.randn(2, 7, 24, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        y = m(x).numpy()
    W, Bs = _blocks(m.qkv, variant, 24)
    D = 8
    s_neg = D ** -0.5
    s_pos = s_neg if scale == "both" else 1.0
    for b in range(2):
        expected = ref.dna_self_attention(x[b].numpy(), W, Bs, m.proj.weight.detach().numpy(),
                                          m.proj.bias.detach().numpy(), 3, _alpha(m), s_pos, s_neg)
        np.testing.assert_allclose(y[b], expected, rtol=1e-9, atol=1e-10)


def _swin_mask(num_win, N, seed=0):
    """A 0 / -100 mask like Swin's shifted windows: random blocked pairs, the diagonal always allowed."""
    g = torch.Generator().manual_seed(seed)
    blocked = torch.rand(num_win, N, N, generator=g) < 0.4
    blocked &= ~torch.eye(N, dtype=torch.bool)
    return torch.zeros(num_win, N, N, dtype=torch.float64).masked_fill(blocked, -100.0)


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_swin_window_module_matches_float64_loop(variant, fused):
    m = DnAAttention(16, 2, qkv_bias=True, window_size=(2, 2), variant=variant, backend="auto" if fused else "explicit")
    m = _randomise(m, seed=2).double().eval()
    num_win, N = 3, 4
    mask = _swin_mask(num_win, N)
    x = torch.randn(2 * num_win, N, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        y = m(x, mask=mask).numpy()
    table = m.relative_position_bias_table.detach().numpy()
    index = m.relative_position_index.numpy()
    rel = table[index.reshape(-1)].reshape(N, N, 2).transpose(2, 0, 1)  # (H, N, N), timm's indexing
    W, Bs = _blocks(m.qkv, variant, 16)
    for b in range(2 * num_win):
        w = mask[b % num_win].numpy()  # windows are the fastest-varying part of the batch
        expected = ref.dna_self_attention(x[b].numpy(), W, Bs, m.proj.weight.detach().numpy(),
                                          m.proj.bias.detach().numpy(), 2, _alpha(m), 8 ** -0.5, 8 ** -0.5,
                                          rel_bias=rel, mask_add=w, allowed=w == 0)
        np.testing.assert_allclose(y[b], expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
@pytest.mark.parametrize("variant", VARIANTS)
def test_cross_attention_matches_float64_loop(variant, fused):
    m = DnACrossAttention(24, 3, kv_dim=10, qkv_bias=True, variant=variant, backend="auto" if fused else "explicit")
    m = _randomise(m, seed=4).double().eval()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 5, 24, dtype=torch.float64, generator=g)
    ctx = torch.randn(2, 6, 10, dtype=torch.float64, generator=g)
    allowed = torch.rand(5, 6, generator=g) < 0.7
    allowed[:, 0] = True
    with torch.no_grad():
        y = m(x, ctx, attn_mask=allowed).numpy()
    # the cross module splits the documented layout into its q rows (on x) and its k, v rows (on the context)
    nq = 2 if variant in ("qv", "q") else 1
    names = LAYOUT[variant]
    W, Bs = {}, {}
    qw, qb = m.q.weight.detach().numpy(), m.q.bias.detach().numpy()
    kw, kb = m.kv.weight.detach().numpy(), m.kv.bias.detach().numpy()
    for rows, bias, part in ((qw, qb, names[:nq]), (kw, kb, names[nq:])):
        for i, name in enumerate(part):
            for t in {"q": ("q_pos", "q_neg"), "v": ("v_pos", "v_neg")}.get(name, (name,)):
                W[t], Bs[t] = rows[i * 24:(i + 1) * 24], bias[i * 24:(i + 1) * 24]
    for b in range(2):
        expected = ref.dna_cross_attention(x[b].numpy(), ctx[b].numpy(), W, Bs, m.proj.weight.detach().numpy(),
                                           m.proj.bias.detach().numpy(), 3, _alpha(m), 8 ** -0.5, 8 ** -0.5,
                                           allowed=allowed.numpy())
        np.testing.assert_allclose(y[b], expected, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("window", [None, (2, 2)], ids=["vit", "swin"])
def test_alpha_zero_is_standard_attention_with_positive_branch(window):
    torch.manual_seed(0)
    dna = DnAAttention(16, 2, qkv_bias=True, window_size=window).eval()
    with torch.no_grad():
        dna.alpha.zero_()
    std = StandardAttention(16, 2, qkv_bias=True, window_size=window).eval()
    with torch.no_grad():  # Q+, K, V+ rows (layout Q+, Q-, K, V+, V-) become the standard q, k, v
        w, b = dna.qkv.weight, dna.qkv.bias
        std.qkv.weight.copy_(torch.cat([w[0:16], w[32:48], w[48:64]]))
        std.qkv.bias.copy_(torch.cat([b[0:16], b[32:48], b[48:64]]))
        std.proj.load_state_dict(dna.proj.state_dict())
        if window:
            std.relative_position_bias_table.copy_(dna.relative_position_bias_table)
    x = torch.randn(6, 4, 16)
    mask = _swin_mask(3, 4).float() if window else None
    with torch.no_grad():
        torch.testing.assert_close(dna(x, mask=mask), std(x, mask=mask))


def test_sum_is_softmax_plus_softmin_times_v():
    torch.manual_seed(0)
    m = DnAAttention(16, 2, variant="sum").double().eval()
    assert m.alpha is None and not any(p.numel() == 2 for p in m.parameters())
    x = torch.randn(3, 5, 16, dtype=torch.float64)
    with torch.no_grad():
        q, k, v = m.qkv(x).view(3, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        s = q @ k.transpose(-2, -1) / math.sqrt(8)
        w = torch.exp(s) / torch.exp(s).sum(-1, keepdim=True) + torch.exp(-s) / torch.exp(-s).sum(-1, keepdim=True)
        o = (w @ v).transpose(1, 2).reshape(3, 5, 16)
        torch.testing.assert_close(m(x), m.proj(o))


@pytest.mark.parametrize("fused", [True, False], ids=["sdpa", "explicit"])
def test_masked_positions_get_exactly_zero_softmin_weight(fused):
    """With V- = identity over tokens, the softmin branch's output IS its weight matrix."""
    N = 4
    m = DnAAttention(8, 2, window_size=(2, 2), backend="auto" if fused else "explicit").double().eval()
    mask = _swin_mask(2, N, seed=7)
    q = torch.randn(4, 2, N, 4, dtype=torch.float64) * 3
    k = torch.randn(4, 2, N, 4, dtype=torch.float64) * 3
    # make the masked keys the most attractive ones for softmin: very negative logits
    eye = torch.eye(N, dtype=torch.float64).expand(4, 2, N, N)
    backend = "sdpa" if fused else "explicit"
    heads = torch.cat([q, q], 1), k, torch.cat([eye, eye], 1)  # as project stacks them: Q+ then Q-, V+ then V-
    with torch.no_grad():
        resolved = Mask.resolve(window=mask, B=4, N=N, M=N, device=q.device, bias=m.rel_pos_bias())
        w_neg = m.kernel(*heads, resolved, Want(branches=True), backend)[1].branches[1]
    blocked = (mask < 0).repeat(2, 1, 1).unsqueeze(1).expand(-1, 2, -1, -1)
    assert torch.all(w_neg[blocked] == 0)
    assert torch.all(w_neg[~blocked] > 0)
    torch.testing.assert_close(w_neg.sum(-1), torch.ones(4, 2, N, dtype=torch.float64))
    # ViT-style bool attn_mask through the kernel function as well
    allowed = torch.rand(N, N) < 0.5
    allowed |= torch.eye(N, dtype=torch.bool)
    with torch.no_grad():
        resolved = Mask.resolve(allowed, B=4, N=N, M=N, device=q.device)
        w = m.kernel(*heads, resolved, Want(branches=True), backend)[1].branches[1]
    assert torch.all(w[..., ~allowed] == 0) and torch.all(w[..., allowed] > 0)


def test_spec_registered_and_errors():
    spec = attnlab.parse_spec("dna(variant=q,scale=neg_only)")
    assert str(spec) == "dna(variant=q,scale=neg_only)"
    with pytest.raises(SpecError, match="variant"):
        attnlab.parse_spec("dna(variant=qk)")
    with pytest.raises(SpecError, match="alpha"):
        DnAAttention(16, 2, variant="sum", alpha_init=0.3)
    for cls in (DnAAttention, DnACrossAttention):  # the cross-attention module checks its options as DnA's does
        with pytest.raises(SpecError, match=r"dna\(init=bogus\) is not valid; init is one of: random, copy"):
            cls(16, 2, init="bogus")


@pytest.mark.parametrize("variant", ["qv", "v"])
def test_warm_start_copy_stays_close_to_the_pretrained_model(variant):
    torch.manual_seed(0)
    original = attnlab.build_model("vit_cifar", num_classes=10, attn=None).eval()
    converted = attnlab.convert(copy.deepcopy(original), f"dna(init=copy,variant={variant})").eval()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        a, b = original(x), converted(x)
    assert ((b - a).norm() / a.norm()).item() <= 1e-3
    # the pretrained projections are Q+, K, V+; Q- = 1e-4 Q and V- = 1e-4 V
    old, new = original.blocks[3].attn.qkv, converted.blocks[3].attn
    q, k, v = old.weight.chunk(3)
    if variant == "qv":
        torch.testing.assert_close(new.projection("q_pos")[0], q)
        torch.testing.assert_close(new.projection("q_neg")[0], 1e-4 * q)
    torch.testing.assert_close(new.projection("k")[0], k)
    torch.testing.assert_close(new.projection("v_pos")[0], v)
    torch.testing.assert_close(new.projection("v_neg")[0], 1e-4 * v)
    torch.testing.assert_close(new.projection("v_neg")[1], 1e-4 * old.bias.chunk(3)[2])


def test_negative_neg_init_flips_only_v_neg():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None)
    q, _, v = model.blocks[0].attn.qkv.weight.detach().clone().chunk(3)
    attnlab.convert(model, "dna(init=copy,neg_init=-0.01)")
    attn = model.blocks[0].attn
    torch.testing.assert_close(attn.projection("q_neg")[0], 0.01 * q)
    torch.testing.assert_close(attn.projection("v_neg")[0], -0.01 * v)


def test_random_init_draws_fresh_negative_branch_and_keeps_positive():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None)
    qkv = model.blocks[0].attn.qkv.weight.detach().clone()
    attnlab.convert(model, "dna")
    attn = model.blocks[0].attn
    torch.testing.assert_close(torch.cat([attn.projection(n)[0] for n in ("q_pos", "k", "v_pos")]), qkv)
    w = attn.projection("q_neg")[0]
    assert 0.017 < w.std().item() < 0.023 and abs(w.mean().item()) < 0.003  # timm's trunc_normal_(std=0.02)
    assert torch.all(attn.projection("v_neg")[1] == 0)
    torch.testing.assert_close(attn.alpha, torch.full((4,), 0.5))


def test_authors_loader_reads_separate_negative_projections():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="dna")
    sd = model.state_dict()
    separate = {}
    for key, value in sd.items():  # the straightforward layout: qkv (Q+, K, V+) plus q_neg, v_neg Linears
        if key.endswith("attn.qkv.weight") or key.endswith("attn.qkv.bias"):
            prefix, kind = key[: -len("qkv.weight" if key.endswith("weight") else "qkv.bias")], key.rsplit(".", 1)[1]
            qp, qn, k, vp, vn = value.chunk(5)
            separate[key] = torch.cat([qp, k, vp])
            separate[f"{prefix}q_neg.{kind}"] = qn
            separate[f"{prefix}v_neg.{kind}"] = vn
        else:
            separate[key] = value
    fresh = attnlab.build_model("vit_digits", **TINY_VIT, attn="dna")
    fresh.load_state_dict(dna_authors_state_dict(fresh, separate), strict=True)  # layout auto: "separate"
    x = torch.randn(2, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval()(x), model.eval()(x), rtol=0, atol=0)


def test_swin_trains_one_step_and_reconverts():
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", num_classes=10, attn="dna(variant=q)")
    assert isinstance(model.layers[0].blocks[1].attn, DnAAttention)
    loss = model(torch.randn(2, 3, 32, 32)).logsumexp(-1).mean()
    loss.backward()
    alpha = model.layers[0].blocks[1].attn.alpha
    assert alpha.grad is not None and torch.isfinite(alpha.grad).all()
    # converting again (to qv) keeps Q+, Q-, K, V and alpha; V- is new
    attn = model.layers[1].blocks[0].attn
    q_neg = attn.projection("q_neg")[0].detach().clone()
    attnlab.convert(model, "dna")
    assert model.layers[1].blocks[0].attn.head_dim == 32
    torch.testing.assert_close(model.layers[1].blocks[0].attn.projection("q_neg")[0], q_neg)
    model(torch.randn(1, 3, 32, 32))


@pytest.mark.parametrize("backend", ["sdpa", "explicit"])
def test_dna_kernel_gradcheck_float64(backend):
    g = torch.Generator().manual_seed(0)
    shape = (1, 2, 4, 3)
    inputs = [torch.randn(shape, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(5)]
    bias = torch.randn(1, 2, 4, 4, dtype=torch.float64, generator=g)  # a position bias in both branches
    keep = torch.ones(4, 4, dtype=torch.bool)
    keep[0, 1] = False  # and one excluded key
    mask = Mask(AttentionMask(attn_mask=keep), 1, 4, 4, bias.device, bias=bias)
    m = DnAAttention(6, 2, alpha_init=0.7).double()
    m.scale_pos, m.scale_neg = 0.6, 0.4

    def f(qp, qn, k, vp, vn):
        return m.kernel(torch.cat([qp, qn], 1), k, torch.cat([vp, vn], 1), mask, Want(), backend)[0]

    assert torch.autograd.gradcheck(f, inputs)


def test_fused_and_explicit_paths_agree_in_float32_with_gradients():
    torch.manual_seed(0)
    m = DnAAttention(32, 4, qkv_bias=True, window_size=(2, 2))
    x = torch.randn(4, 4, 32, requires_grad=True)
    mask = _swin_mask(2, 4).float()
    outs = []
    for fused in (True, False):
        m.use_backend("auto" if fused else "explicit")
        y = m(x, mask=mask)
        gx, ga = torch.autograd.grad(y.square().sum(), (x, m.alpha))
        outs.append((y.detach(), gx, ga))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("head_dim", [16, 8], ids=["kernel", "kernel-refused"])
@pytest.mark.parametrize("variant", ["qv", "shared"])
def test_deferred_bias_reaches_every_backend_and_the_kv_cache(variant, head_dim):
    """A float32 CPU forward without gradient leaves the projection's bias to the C kernel; where the kernel cannot
    take the call (head dim 8) the bias joins before the other backend, and a KV cache (prompt, then a token at a
    time) gives the causal forward's outputs."""
    from attnlab.attention.base import LayerCache

    m = _randomise(DnAAttention(2 * head_dim, 2, qkv_bias=True, variant=variant), seed=8).eval()
    reference = copy.deepcopy(m).double()
    reference.use_backend("explicit")
    x = torch.randn(2, 9, 2 * head_dim, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        assert m.deferred_bias() is not None
        want = reference(x.double(), is_causal=True)
        torch.testing.assert_close(m(x, is_causal=True).double(), want, rtol=1e-5, atol=1e-5)
        cache = LayerCache()
        steps = [m(x[:, :5], cache=cache)] + [m(x[:, i:i + 1], cache=cache) for i in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, dim=1).double(), want, rtol=1e-5, atol=1e-5)


def test_a_forward_computes_a_parametrised_projection_once():
    """Reading a parametrised weight runs its parametrisation (sigma's power iteration): the C kernel's forward,
    bias deferred, reads ``qkv.weight`` once, for the GEMM, and checks device and dtype on the bias."""
    from torch.nn.utils import parametrize

    class Counted(torch.nn.Module):
        calls = 0

        def forward(self, w):
            Counted.calls += 1
            return w

    m = DnAAttention(16, 2, qkv_bias=True).eval()
    parametrize.register_parametrization(m.qkv, "weight", Counted())
    with torch.no_grad():
        assert m.deferred_bias() is not None  # the path whose checks must not read the weight
        Counted.calls = 0
        m(torch.randn(2, 5, 16))
    assert Counted.calls == 1
