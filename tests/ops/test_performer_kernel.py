"""The fused CPU kernel of Performer's FAVOR+ (attnlab.ops.performer_cpu) against the literal float64 FAVOR+ of
tests/reference_lowrank.py, and the module's choice between it and the torch path."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnlab
from attnlab.errors import ConfigError, SpecError
from attnlab.models import attention_modules
from attnlab.ops import performer_cpu
from attnlab.ops.lowrank import orthogonal_gaussian, performer_attention
from tests.reference_lowrank import favor_attention



def _qkv(B, H, N, D, *, scale=1.0, seed=0):
    """q, k, v as attention's projection leaves them: strided views of one (B, N, 3, H, D) buffer."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, N, 3, H, D, generator=g) * scale).permute(2, 0, 3, 1, 4).unbind(0)


def _projection(M, D, seed=1):
    return orthogonal_gaussian(M, D, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("B,H,N,D,M", [
    (1, 2, 1, 32, 256),    # one token: a tile of one real row and three padded ones
    (2, 3, 37, 16, 64),    # N not a multiple of the 4-token tile
    (1, 2, 5, 64, 48),     # an odd number of 16-feature blocks
    (2, 1, 130, 48, 1024), # the largest feature count
    (1, 2, 300, 32, 16),   # one feature block
])
def test_matches_float64_favor(performer_kernel, B, H, N, D, M):
    q, k, v = _qkv(B, H, N, D)
    w = _projection(M, D)
    with torch.no_grad():
        got = performer_cpu.performer_kernel(q, k, v, w, eps=0.0)
    np.testing.assert_allclose(got.numpy(), favor_attention(q, k, v, w), rtol=2e-4, atol=2e-5)
    assert got.transpose(1, 2).is_contiguous()  # (B, N, H, D): the head merge is a view


def test_rising_key_exponents_rescale_exactly(performer_kernel):
    # keys sorted by growing norm raise the running maximum at nearly every tile, so phi(k)^T v and phi(k)^T 1
    # are rescaled again and again; and long vectors (|k| up to ~35) whose unstabilised exp overflows float32
    q, k, v = _qkv(1, 2, 203, 32, seed=2)
    k = k * torch.linspace(0.1, 6.0, 203).view(1, 1, -1, 1)
    w = _projection(128, 32)
    ref = favor_attention(q, k, v, w)
    assert np.isfinite(ref).all()
    with torch.no_grad():
        got = performer_cpu.performer_kernel(q.contiguous(), k.contiguous(), v.contiguous(), w, eps=0.0)
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-3, atol=1e-4)


def test_three_dimensional_inputs(performer_kernel):
    q, k, v = (t[0] for t in _qkv(1, 3, 20, 16))  # (H, N, D)
    w = _projection(32, 16)
    with torch.no_grad():
        got = performer_cpu.performer_kernel(q, k, v, w, eps=0.0)
    assert got.shape == (3, 20, 16)
    np.testing.assert_allclose(got.numpy(), favor_attention(q, k, v, w), rtol=2e-4, atol=2e-5)


def test_kernel_and_python_agree_on_supported_shapes(performer_kernel):
    supports = performer_cpu.KERNEL.library().attnlab_performer_supports
    supports.argtypes = [ctypes.c_int64, ctypes.c_int64]
    for D in range(8, 80, 8):
        for M in (0, 8, 16, 24, 32, 1024, 1040):
            assert bool(supports(D, M)) == performer_cpu.supports(D, M), (D, M)


def test_reasons_it_cannot_run():
    q, k, v = _qkv(1, 2, 8, 32)
    w = _projection(64, 32)
    assert "float32" in performer_cpu.kernel_error(q.double(), k.double(), v.double(), w.double())
    assert "head dim" in performer_cpu.kernel_error(q[..., :24], k[..., :24], v[..., :24], _projection(64, 24))
    assert "multiple of 16" in performer_cpu.kernel_error(q, k, v, _projection(40, 32))
    q.requires_grad_(True)
    assert "gradient" in performer_cpu.kernel_error(q, k, v, w)


def _model(backend):
    torch.manual_seed(0)
    return attnlab.build_model("seq_listops", attn=f"performer(features=64,backend={backend})", max_length=64,
                               drop_rate=0.0, attn_drop_rate=0.0).eval()


def test_module_uses_the_kernel_without_gradient_and_torch_with_it(performer_kernel, monkeypatch):
    tokens = torch.randint(1, 16, (2, 64), generator=torch.Generator().manual_seed(0))
    calls = []
    real = performer_cpu.performer_kernel
    monkeypatch.setattr(performer_cpu, "performer_kernel", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    auto, plain = _model("auto"), _model("explicit")
    with torch.no_grad():
        got, want = auto(tokens), plain(tokens)
    assert len(calls) == len(auto.blocks)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    calls.clear()
    auto(tokens).sum().backward()  # a gradient: the torch path, which autograd differentiates
    assert not calls and auto.blocks[0].attn.qkv.weight.grad is not None


def test_a_forced_kernel_refuses_a_call_it_cannot_serve(performer_kernel):
    model = _model("kernel")
    with pytest.raises(ConfigError, match="kernel backend cannot run this call: .*gradient; use backend=auto"):
        model(torch.randint(1, 16, (1, 64)))
    with pytest.raises(SpecError, match="backend is one of: auto, kernel, explicit"):
        _model("fast")


def test_fake_tensor_shape_and_flop_count():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 3, 40, 32)
        out = torch.ops.attnlab.performer_fused(q, q, q, torch.empty(64, 32), 1e-6)
        assert out.shape == (2, 3, 40, 32) and out.transpose(1, 2).is_contiguous()
    # 4 (N, D) x (D, M)-sized products per head and the two normaliser contractions, 2 flops per multiply-add
    B, H, N, D, M = 2, 3, 40, 32, 64
    with FakeTensorMode(), FlopCounterMode(display=False) as counter, torch.no_grad():
        q = torch.empty(B, H, N, D)
        torch.ops.attnlab.performer_fused(q, q, q, torch.empty(M, D), 1e-6)
    assert counter.get_total_flops() == B * H * (4 * 2 * N * M * D + 2 * 2 * N * M)


def test_flop_count_is_the_same_with_and_without_gradient(performer_kernel):
    model = _model("auto")
    tokens = torch.randint(1, 16, (2, 64))
    counts = []
    for grad in (False, True):
        with torch.set_grad_enabled(grad), FlopCounterMode(display=False) as counter:
            model(tokens)
        counts.append(counter.get_total_flops())
    assert counts[0] == counts[1]


def test_compile_fullgraph_traces_the_op(performer_kernel):
    import torch._dynamo

    torch._dynamo.reset()
    model = _model("kernel")
    graphs = []

    def backend(gm, inputs):
        graphs.append(gm)
        return gm.forward

    tokens = torch.randint(1, 16, (2, 64))
    with torch.no_grad():
        want = model(tokens)
        got = torch.compile(model, fullgraph=True, backend=backend)(tokens)
    torch.testing.assert_close(got, want)
    ops = {str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
    assert "attnlab.performer_fused.default" in ops, sorted(ops)
    assert [m.backend for _, m in attention_modules(model)] == ["kernel"] * 2
