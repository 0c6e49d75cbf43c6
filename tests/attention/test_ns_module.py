"""The `ns` term changes a model only at one place: each head's output right before head merge."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import attnlab
from attnlab.attention.base import AttnlabAttention
from attnlab.ops import ns_transform
from attnlab.ops.ns_cpu import kernel_error

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference as ref  # noqa: E402


class Recorder(nn.Module):
    """Stands in for head_transform: records its input, then applies `fn`."""

    def __init__(self, fn):
        super().__init__()
        self.fn, self.seen = fn, []

    def forward(self, o):
        self.seen.append(o.detach().clone())
        return self.fn(o)


def _literal_ns(o, steps=1, eps=1e-6):
    """Algorithm 1 per sample and head, written out with explicit loops in float64."""
    a, b, c = 3.4445, -4.7750, 2.0315
    out = torch.empty_like(o, dtype=torch.float64)
    for i in range(o.shape[0]):
        for h in range(o.shape[1]):
            m = o[i, h].double().T
            r = m.norm()
            z = m / max(r, eps)
            for _ in range(steps):
                A = z @ z.T
                z = a * z + (b * A + c * A @ A) @ z
            out[i, h] = (r * z / max(z.norm(), eps)).T
    return out.to(o.dtype)


@pytest.mark.parametrize(
    "name,shape,steps",
    [(name, (2, 3, 32, 32), steps) for name in ("vit_cifar", "swin_cifar") for steps in (1, 2)]
    + [("vit_cifar", (2, 3, 32, 32), 6)],  # many steps once: the literal loop over Swin's windows is slow
)
def test_ns_differs_from_standard_only_before_head_merge(name, shape, steps):
    torch.manual_seed(0)
    ns_model = attnlab.build_model(name, attn=f"ns(steps={steps})").eval()
    standard = attnlab.build_model(name, attn="standard").eval()
    standard.load_state_dict(ns_model.state_dict(), strict=True)  # no new parameters
    attn = [m for m in standard.modules() if isinstance(m, AttnlabAttention)]
    recorders = []
    for m in attn:
        m.head_transform = Recorder(lambda o: _literal_ns(o, steps))
        recorders.append(m.head_transform)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, patched = ns_model(x), standard(x)
    torch.testing.assert_close(ours, patched, rtol=1e-4, atol=1e-5)
    assert all(len(r.seen) == 1 for r in recorders)
    # and the transform really acts: without it the output moves
    for m in attn:
        m.head_transform = nn.Identity()
    with torch.no_grad():
        assert not torch.allclose(standard(x), ours, atol=1e-3)


def test_ns_head_transform_sees_the_premerge_tensor_with_window_layout():
    model = attnlab.build_model("swin_cifar", attn="ns").eval()
    attn = model.layers[0].blocks[1].attn
    seen = {}
    attn.head_transform.register_forward_hook(lambda mod, inp, out: seen.update(inp=inp[0], out=out))
    with torch.no_grad():
        model(torch.randn(2, 3, 32, 32))
    B, H, N, D = seen["inp"].shape
    assert (B, H, N, D) == (2 * 16, 3, 16, 32)  # 16 windows of 4x4 tokens per image, 3 heads of 32
    torch.testing.assert_close(seen["out"], ns_transform(seen["inp"], impl="reference"), rtol=1e-5, atol=1e-6)
    # in eval without gradient the fused CPU kernel ran (where it can): it keeps the attention kernel's layout
    if kernel_error(seen["inp"]) is None:
        assert seen["out"].stride() == seen["inp"].stride() and seen["out"].transpose(1, 2).is_contiguous()


@pytest.mark.parametrize("name", ["vit_cifar", "swin_cifar"])
def test_ns_many_steps_in_bf16_autocast_training(name):
    # What GPU training runs (the fast path with a gradient, under bf16 autocast), on the CPU: every head output
    # of ns(steps=8) against the float64 SVD reference of the head output it received.
    torch.manual_seed(0)
    model = attnlab.build_model(name, attn="ns(steps=8)").train()
    seen = []
    for m in model.modules():
        if isinstance(m, AttnlabAttention):
            m.head_transform.register_forward_hook(lambda mod, inp, out: seen.append((inp[0].detach(), out.detach())))
    x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x).float().sum().backward()
    assert seen and all(o.grad_fn is None for _, o in seen)
    for inp, out in seen:
        assert out.dtype == inp.dtype
        want = torch.from_numpy(ref.ns_svd_reference(inp.double().numpy(), steps=8))
        err = (out.double() - want).abs().amax(dim=(-2, -1)) / want.abs().amax(dim=(-2, -1))
        assert err.max() <= (8e-3 if inp.dtype == torch.bfloat16 else 1e-4), (inp.dtype, err.max().item())


def test_ns_spec_options():
    assert str(attnlab.parse_spec("ns(steps=2)")) == "ns(steps=2)"
    assert str(attnlab.parse_spec("ns(eps=1e-8)")) == "ns(eps=1e-8)"
    with pytest.raises(attnlab.SpecError, match="at least 1"):
        attnlab.parse_spec("ns(steps=0)")
    with pytest.raises(attnlab.AttnlabError):
        attnlab.build_model("vit_digits", attn="ns(eps=-1)")


def test_ns_attention_traces_without_graph_breaks_in_shifted_windows():
    """torch.compile sees one graph per attention module with Swin's bias and mask (ViT: tests/attention/
    test_registry.py traces every term)."""
    import torch._dynamo

    model = attnlab.build_model("swin_cifar", attn="ns").eval()
    block = model.layers[0].blocks[1]  # shifted windows: bias + mask
    args, kwargs = (torch.randn(2 * 16, 16, 96),), {"mask": block.attn_mask}
    attn = block.attn
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(attn)(*args, **kwargs)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1
