"""The fused CPU kernel of DnA's two branches (dna_kernel.c) against the float64 per-head loop of
tests/reference_dna.py, and the DnA modules with the kernel on and off."""

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from attnlab.attention import DnAAttention, DnACrossAttention
from attnlab.errors import ConfigError
from attnlab.ops import dna_cpu
from attnlab.ops.dna_cpu import dna_attention, kernel_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_dna as ref  # noqa: E402

pytestmark = pytest.mark.usefixtures("dna_kernel")


def _inputs(B, H, N, M, D, seed=0):
    """q+, q-, k, v+, v-: strided (B, H, ., D) views of projection-like (B, tokens, 2 or 3, H, D) buffers."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, N, 2, H, D, generator=g).permute(2, 0, 3, 1, 4)
    kv = torch.randn(B, M, 3, H, D, generator=g).permute(2, 0, 3, 1, 4)
    return q[0], q[1], kv[0], kv[1], kv[2]


def _reference(qp, qn, k, vp, vn, alpha, s_pos, s_neg, rel=None, mask_add=None, allowed=None):
    out = []
    for b in range(qp.shape[0]):
        o, _, _ = ref.dna_heads(*(t[b].double().numpy() for t in (qp, qn, k, vp, vn)),
                                None if alpha is None else alpha.double().numpy(), s_pos, s_neg,
                                rel_bias=rel, mask_add=None if mask_add is None else mask_add[b],
                                allowed=None if allowed is None else allowed[b])
        out.append(o)
    return torch.from_numpy(np.stack(out))


@pytest.mark.parametrize("shared", ["none", "q", "v", "both"])
@pytest.mark.parametrize("D", [16, 32, 48, 64])
@pytest.mark.parametrize("N,M", [(37, 37), (9, 21), (20, 3)])  # self-attention, and cross with M > N, M < 16
def test_matches_float64_loop(shared, D, N, M):
    qp, qn, k, vp, vn = _inputs(2, 3, N, M, D, seed=D + N)
    if shared in ("q", "both"):
        qn = qp
    if shared in ("v", "both"):
        vn = vp
    alpha = torch.tensor([0.5, -0.3, 1.2])
    s_neg = D ** -0.5
    got = dna_attention(qp, qn, k, vp, vn, alpha, scale_pos=1.0, scale_neg=s_neg)  # scale=neg_only
    torch.testing.assert_close(got.double(), _reference(qp, qn, k, vp, vn, alpha, 1.0, s_neg), rtol=1e-4, atol=1e-5)
    # the result is (B, H, N, D) in head-merge layout: (B, N, H * D) is a free view
    assert got.shape == (2, 3, N, D) and got.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("shared", ["none", "both"])
def test_input_bias_is_added_to_every_token_of_its_input(shared):
    # the projection bias the kernel adds itself: q+, q-, k, v+, v- each get their own (H, D) vector (None: none)
    B, H, N, M, D = 2, 3, 19, 23, 32
    qp, qn, k, vp, vn = _inputs(B, H, N, M, D, seed=11)
    g = torch.Generator().manual_seed(12)
    bias = [torch.randn(H, D, generator=g) for _ in range(5)]
    if shared == "both":  # one query and one value, each with its one bias, passed in both slots
        qn, vn, bias[1], bias[4] = qp, vp, bias[0], bias[3]
    else:
        bias[2] = None
    alpha = torch.tensor([0.5, -0.3, 1.2])
    got = dna_attention(qp, qn, k, vp, vn, alpha, scale_pos=0.2, scale_neg=0.2, input_bias=bias)
    biased = [t if b is None else t + b.view(1, H, 1, D) for t, b in zip((qp, qn, k, vp, vn), bias)]
    torch.testing.assert_close(got.double(), _reference(*biased, alpha, 0.2, 0.2), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("alpha", [None, torch.tensor([0.0, 0.0])], ids=["sum", "alpha0"])
def test_alpha_none_is_one_and_zero_drops_the_softmin_branch(alpha):
    qp, qn, k, vp, vn = _inputs(2, 2, 17, 17, 16, seed=1)
    got = dna_attention(qp, qn, k, vp, vn, alpha, scale_pos=0.25, scale_neg=0.25)
    torch.testing.assert_close(got.double(), _reference(qp, qn, k, vp, vn, alpha, 0.25, 0.25), rtol=1e-4, atol=1e-5)


def test_position_bias_and_mask_exclude_positions_from_both_branches():
    # Swin-like: a relative-position bias in both logits, a 0 / -100 mask in the softmax branch and, in the
    # softmin branch (negated-logit form), -inf: the masked keys carry huge values that must not leak into o
    B, H, N, D = 3, 2, 16, 32
    qp, qn, k, vp, vn = _inputs(B, H, N, N, D, seed=2)
    g = torch.Generator().manual_seed(3)
    rel = torch.randn(H, N, N, generator=g)
    blocked = (torch.rand(B, N, N, generator=g) < 0.4) & ~torch.eye(N, dtype=torch.bool)
    blocked[:, 1:, 0] = True  # key 0 is blocked for every query but itself
    vn = vn.clone()
    vn[:, :, 0] = 1e6
    mask_add = torch.zeros(B, N, N).masked_fill(blocked, -100.0)
    bias_pos = rel.unsqueeze(0) + mask_add.unsqueeze(1)
    # the softmin branch's bias in negated-logit form: -rel where allowed, -inf where blocked
    bias_neg = (-rel.unsqueeze(0)).masked_fill(blocked.unsqueeze(1), float("-inf"))
    alpha = torch.tensor([0.7, -0.4])
    got = dna_attention(qp, qn, k, vp, vn, alpha, scale_pos=D ** -0.5, scale_neg=D ** -0.5, bias_pos=bias_pos,
                        bias_neg=bias_neg)
    want = _reference(qp, qn, k, vp, vn, alpha, D ** -0.5, D ** -0.5, rel=rel.double().numpy(),
                      mask_add=mask_add.double().numpy(), allowed=(~blocked).numpy())
    assert got[:, :, 1:].abs().max() < 1e3  # nothing of key 0's 1e6 values came through the softmin branch
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(dtype=torch.float64), "float32"),
        (dict(D=24), "head dim"),
        (dict(M=1100), "1024 keys"),
        (dict(grad=True), "needs a gradient"),
    ],
)
def test_kernel_error_says_why(kwargs, needle):
    D, M = kwargs.get("D", 16), kwargs.get("M", 8)
    q = torch.randn(1, 2, 8, D, dtype=kwargs.get("dtype", torch.float32), requires_grad=kwargs.get("grad", False))
    k = torch.randn(1, 2, M, D, dtype=q.dtype)
    assert needle in kernel_error(q, k)


@pytest.mark.parametrize(
    "change,needle",
    [
        (lambda t: dict(t, k=t["k"].to(torch.bfloat16)), "k is torch.bfloat16"),
        (lambda t: dict(t, v_neg=t["v_neg"][:, :, :3]), "v_neg has shape"),
        (lambda t: dict(t, alpha=torch.ones(5)), "alpha has 5 values"),
        (lambda t: dict(t, bias_pos=torch.zeros(4, 4, dtype=torch.float64)), "bias_pos is torch.float64"),
        (lambda t: dict(t, input_bias=[torch.zeros(3, 16)] * 4), "input_bias takes 5 tensors"),
        (lambda t: dict(t, input_bias=[torch.zeros(2, 16)] * 5), "input_bias takes 5 tensors"),
    ],
)
def test_kernel_refuses_tensors_it_would_misread(change, needle):
    # the kernel reads raw float32 memory: another dtype or a wrong shape must raise, not corrupt memory
    qp, qn, k, vp, vn = _inputs(1, 3, 4, 4, 16)
    call = change(dict(q_pos=qp, q_neg=qn, k=k, v_pos=vp, v_neg=vn, alpha=torch.ones(3)))
    with pytest.raises(ValueError, match=needle):
        dna_attention(**call, scale_pos=0.25, scale_neg=0.25)


def test_module_under_cpu_autocast_leaves_the_kernel_out(monkeypatch):
    # bf16 autocast makes the projection bf16, which the float32 kernel must never see
    m = _randomise(DnAAttention(32, 2, qkv_bias=True), seed=10)
    x = torch.randn(2, 17, 32, generator=torch.Generator().manual_seed(11))
    calls = _spy(monkeypatch)
    with torch.no_grad():
        want = m(x)
        calls.clear()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = m(x)
    assert not calls
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.02 * want.abs().max().item())  # bf16 rounding


def test_a_subclass_with_its_own_kernel_keeps_it_on_cpu_inference(monkeypatch):
    # every forward runs through the one kernel, on the backend the dispatcher chose: a subclass's kernel sees it
    seen = []

    class Traced(DnAAttention):
        capabilities = DnAAttention.capabilities

        def kernel(self, q, k, v, mask, want, backend):
            seen.append(backend)
            return super().kernel(q, k, v, mask, want, backend)

    m = _randomise(Traced(32, 2, qkv_bias=True), seed=12)
    calls = _spy(monkeypatch)
    with torch.no_grad():
        m(torch.randn(2, 9, 32))
    assert seen == ["kernel"] and len(calls) == 1


def test_a_pinned_backend_runs_or_says_why_it_cannot(monkeypatch):
    m = _randomise(DnAAttention(32, 2, qkv_bias=True), seed=13)
    x = torch.randn(2, 9, 32)
    calls = _spy(monkeypatch)
    m.use_backend("sdpa")
    with torch.no_grad():
        sdpa = m(x)
    assert not calls
    m.use_backend("kernel")
    with torch.no_grad():
        torch.testing.assert_close(m(x), sdpa, rtol=1e-4, atol=1e-5)
    assert len(calls) == 1
    with pytest.raises(ConfigError, match="kernel backend cannot run this call: .*needs a gradient; use backend=auto"):
        m(x.requires_grad_())
    with pytest.raises(ConfigError, match="has no 'gpu' backend; it has: auto, kernel, triton, sdpa, explicit"):
        m.use_backend("gpu")


def _spy(monkeypatch):
    """The keyword arguments of every call into the kernel."""
    calls = []
    real = dna_cpu.dna_attention
    monkeypatch.setattr(dna_cpu, "dna_attention", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    return calls


def _randomise(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return module.eval()


@pytest.mark.parametrize("variant", ["qv", "q", "v", "shared", "sum"])
@pytest.mark.parametrize("window", [None, (4, 4)], ids=["vit", "swin-shifted"])
def test_module_with_kernel_equals_module_with_sdpa(variant, window, monkeypatch):
    m = _randomise(DnAAttention(32, 2, qkv_bias=True, window_size=window, variant=variant), seed=4)
    g = torch.Generator().manual_seed(5)
    if window is None:
        x, kwargs = torch.randn(3, 17, 32, generator=g), {}
    else:  # 2 images x 4 windows of 16 tokens, a Swin-like 0 / -100 shift mask per window
        blocked = (torch.rand(4, 16, 16, generator=g) < 0.3) & ~torch.eye(16, dtype=torch.bool)
        x, kwargs = torch.randn(8, 16, 32, generator=g), {"mask": torch.zeros(4, 16, 16).masked_fill(blocked, -100.0)}
    calls = _spy(monkeypatch)
    with torch.no_grad():
        fused = m(x, **kwargs)
        assert calls, "the kernel did not run"
        assert calls[0].get("input_bias") is not None, "the projection bias was not left to the kernel"
        monkeypatch.setenv("ATTNLAB_KERNELS", "0")
        sdpa = m(x, **kwargs)
    assert len(calls) == 1
    torch.testing.assert_close(fused, sdpa, rtol=1e-4, atol=1e-5)
    with torch.enable_grad():  # with a gradient the kernel stays out of the way
        monkeypatch.delenv("ATTNLAB_KERNELS")
        assert m(x, **kwargs).grad_fn is not None and len(calls) == 1


def test_module_with_qk_norm_adds_the_bias_before_normalising(monkeypatch):
    # QK-norm acts on the biased projection, so the bias cannot be left to the kernel; the result stays the same
    m = _randomise(DnAAttention(32, 2, qkv_bias=True, qk_norm=True), seed=8)
    x = torch.randn(3, 17, 32, generator=torch.Generator().manual_seed(9))
    calls = _spy(monkeypatch)
    with torch.no_grad():
        fused = m(x)
        monkeypatch.setenv("ATTNLAB_KERNELS", "0")
        sdpa = m(x)
    assert len(calls) == 1 and calls[0].get("input_bias") is None
    torch.testing.assert_close(fused, sdpa, rtol=1e-4, atol=1e-5)


def test_cross_attention_with_kernel_equals_sdpa(monkeypatch):
    m = _randomise(DnACrossAttention(32, 2, kv_dim=24, qkv_bias=True), seed=6)
    g = torch.Generator().manual_seed(7)
    x, ctx = torch.randn(2, 9, 32, generator=g), torch.randn(2, 30, 24, generator=g)
    allowed = torch.rand(9, 30, generator=g) < 0.7
    allowed[:, 0] = True
    calls = _spy(monkeypatch)
    with torch.no_grad():
        fused = m(x, ctx, attn_mask=allowed)
        monkeypatch.setenv("ATTNLAB_KERNELS", "0")
        sdpa = m(x, ctx, attn_mask=allowed)
    assert len(calls) == 1
    torch.testing.assert_close(fused, sdpa, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_compiled_module_traces_without_graph_breaks(grad):
    # the kernel's checks fold away at trace time and the kernel itself is a custom op in the graph (no_grad);
    # with a gradient the graph holds the SDPA path instead
    import torch._dynamo

    m = DnAAttention(32, 2, qkv_bias=True).eval()
    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        explanation = torch._dynamo.explain(m)(torch.randn(2, 17, 32))
    assert explanation.graph_break_count == 0, explanation.break_reasons
    code = "\n".join(g.code for g in explanation.graphs)
    assert ("dna_fused" in code) != grad
