"""`sigma` / `specnorm`: power iteration against a full SVD, W_hat = W at step 0, eval forwards leave u alone,
gradients against autograd of the plain formula, state dicts save and load, targets, the sigma+specnorm error."""

import copy
import io
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save
from torch import nn
from torch.nn.utils import parametrize

import attnlab
from attnlab.errors import SpecError
from attnlab.reparam.sigma import SigmaReparam, _ScaleBySigma, apply_sigma, apply_specnorm, sigma_modules

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_reparam as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _layer(out_f=40, in_f=24, seed=0, **kw):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(in_f, out_f))
    apply_sigma(model, [], **kw)
    return model


def _param(layer) -> SigmaReparam:
    return layer.parametrizations.weight[0]


def _raw(layer) -> torch.Tensor:
    return layer.parametrizations.weight.original


def test_power_iteration_converges_to_spectral_norm():
    model = _layer(40, 24)
    layer, p = model[0], _param(model[0])
    with torch.no_grad():  # a well-separated top singular value, so convergence is quick and certain
        u0, s0, vh0 = torch.linalg.svd(_raw(layer), full_matrices=False)
        s0[0] = 2.0 * s0[1]
        _raw(layer).copy_(u0 @ torch.diag(s0) @ vh0)
        p.u.copy_(torch.nn.functional.normalize(torch.randn(24), dim=0))
    truth = float(torch.linalg.matrix_norm(_raw(layer).detach(), 2))
    assert abs(float(p.sigma_of(_raw(layer))) - truth) / truth > 0.01  # the start is off, so the test can fail
    model.train()
    x = torch.randn(5, 24)
    for _ in range(30):
        model(x)
    estimate = float(p.sigma_of(_raw(layer)))
    assert abs(estimate - truth) / truth < 0.01
    assert abs(truth - ref.spectral_norm(_raw(layer).detach().numpy())) / truth < 1e-5


def test_one_iteration_per_training_forward():
    """One forward = one power iteration: u <- normalize(W^T normalize(W u)), done here by hand in float64."""
    model = _layer(16, 12)
    p, w = _param(model[0]), _raw(model[0]).detach().double()
    with torch.no_grad():
        p.u.copy_(torch.nn.functional.normalize(torch.randn(12), dim=0))
    u = p.u.double().clone()
    v = w @ u / (w @ u).norm()
    expected = w.T @ v / (w.T @ v).norm()
    model.train()
    model(torch.randn(3, 12))
    torch.testing.assert_close(p.u.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("attn", ["standard", "dna", "diff"])
@pytest.mark.parametrize("name", ["vit_digits", "swin_cifar"])
def test_one_iteration_per_training_forward_under_every_attention(name, attn):
    """Every path that reads qkv.weight reads it once per forward (a second read would move u twice)."""
    from attnlab.bench import input_shape

    torch.manual_seed(0)
    model = attnlab.build_model(name, **(TINY_VIT if name == "vit_digits" else {}), attn=f"{attn}+sigma(targets=attn)")
    layers = {n: model.get_submodule(n) for n, _ in sigma_modules(model)}
    assert any(n.endswith("qkv") for n in layers)
    with torch.no_grad():  # off the fixed point (u starts as the exact singular vector, which one step keeps)
        for m in layers.values():
            _param(m).u.copy_(torch.nn.functional.normalize(torch.randn_like(_param(m).u), dim=0))
    before = {n: (_param(m).u.double().clone(), _raw(m).detach().double()) for n, m in layers.items()}
    model.train()
    model(torch.randn(2, *input_shape(model)))
    for n, m in layers.items():
        u, w = before[n]
        v = w @ u / (w @ u).norm()
        torch.testing.assert_close(_param(m).u.double(), w.T @ v / (w.T @ v).norm(), rtol=1e-5, atol=1e-6, msg=n)


@pytest.mark.parametrize("name", ["vit_digits", "swin_cifar"])
def test_default_init_leaves_model_unchanged(name):
    torch.manual_seed(0)
    base = attnlab.build_model(name, attn="standard").eval()
    conv = attnlab.convert(copy.deepcopy(base), "sigma").eval()
    n_layers = sum(isinstance(m, (nn.Linear, nn.Conv2d)) for m in base.modules())
    assert len(sigma_modules(conv)) == n_layers
    layers = [(n, m, conv.get_submodule(n)) for n, m in base.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    for n, m0, m1 in layers:
        assert parametrize.is_parametrized(m1, "weight"), n
        assert torch.equal(m1.weight, m0.weight), n  # eval: gamma / sigma is exactly 1
    shape = (2, 1, 8, 8) if name == "vit_digits" else (2, 3, 32, 32)
    x = torch.randn(shape)
    with torch.no_grad():
        torch.testing.assert_close(conv(x), base(x), rtol=0, atol=0)
        conv.train()  # the first training forward moves u once; the exact SVD start keeps W_hat at W
        for _, p in sigma_modules(conv):
            p.train()
        for n, m0, m1 in layers:
            torch.testing.assert_close(m1.weight, m0.weight, rtol=1e-4, atol=1e-6)


def test_gamma_init_number_and_conv():
    model = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.Flatten(), nn.Linear(8, 5))
    apply_sigma(model, [], gamma_init=1.0)
    for layer in (model[0], model[2]):
        assert float(_param(layer).gamma.detach()) == 1.0
        w_hat = layer.weight.detach().numpy()  # gamma = 1: W_hat = W / sigma(W), spectral norm 1
        assert abs(ref.spectral_norm(w_hat) - 1.0) < 1e-4
    assert _param(model[0]).u.shape == (3 * 4 * 4,)  # conv weight read as (out, in * kh * kw)


def test_eval_forwards_do_not_move_u():
    model = _layer()
    p = _param(model[0])
    with torch.no_grad():
        p.u.copy_(torch.nn.functional.normalize(torch.randn(24), dim=0))
    before = p.u.clone()
    model.eval()
    for _ in range(3):
        model(torch.randn(4, 24))
    with torch.no_grad():
        model.train()
        model(torch.randn(4, 24))  # no_grad alone does not freeze it: training mode does
    model.eval()
    moved = p.u.clone()
    assert not torch.equal(moved, before)
    model(torch.randn(4, 24))
    assert torch.equal(p.u, moved)


def test_gradients_reach_gamma_and_w_and_match_plain_autograd():
    model = _layer(12, 9).double()
    layer, p = model[0], _param(model[0])
    with torch.no_grad():
        p.gamma.fill_(1.7)
    model.eval()  # u fixed, so the plain formula below uses the same u
    x, c = torch.randn(6, 9, dtype=torch.float64), torch.randn(6, 12, dtype=torch.float64)
    (model(x) * c).sum().backward()
    # reference: gamma * W / (v^T W u) with v = W u / ||W u||, u and v constants, autograd through W and gamma
    w = _raw(layer).detach().clone().requires_grad_(True)
    gamma = torch.tensor(1.7, dtype=torch.float64, requires_grad=True)
    u = p.u.detach()
    v = (w @ u / (w @ u).norm()).detach()
    w_hat = gamma * w / (v @ w @ u)
    ((x @ w_hat.T + layer.bias.detach()) * c).sum().backward()
    assert p.gamma.grad is not None and _raw(layer).grad is not None
    assert float(p.gamma.grad.abs()) > 0 and float(_raw(layer).grad.abs().sum()) > 0
    torch.testing.assert_close(_raw(layer).grad, w.grad)
    torch.testing.assert_close(p.gamma.grad, gamma.grad)


@pytest.mark.parametrize("contiguous", [True, False])
def test_scale_by_sigma_backward_matches_plain_formula(contiguous):
    w = torch.randn(5, 2, 3, dtype=torch.float64, requires_grad=True)  # conv-shaped weight
    gamma = torch.tensor(0.8, dtype=torch.float64, requires_grad=True)
    u = torch.nn.functional.normalize(torch.randn(6, dtype=torch.float64), dim=0)
    v = torch.nn.functional.normalize(torch.randn(5, dtype=torch.float64), dim=0)

    def f(w, gamma):  # sigma = v^T W u carried with its gradient into the custom backward
        return _ScaleBySigma.apply(w, gamma, u, v, v @ w.detach().reshape(5, -1) @ u)

    # the custom backward treats sigma's W-dependence analytically: check it against the plain formula
    def plain(w, gamma):
        return gamma * w / (v @ w.reshape(5, -1) @ u)

    g = torch.randn(5, 2, 3, dtype=torch.float64)
    if not contiguous:  # a gradient in another memory layout (e.g. channels-last conv)
        g = torch.randn(3, 2, 5, dtype=torch.float64).permute(2, 1, 0)
    ours = torch.autograd.grad((f(w, gamma) * g).sum(), (w, gamma))
    theirs = torch.autograd.grad((plain(w, gamma) * g).sum(), (w, gamma))
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
def test_state_dict_saves_and_loads(fmt):
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="sigma").train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(4, 1, 8, 8)
    model(x).square().mean().backward()
    opt.step()
    model(x)  # u moves again after the step
    state = model.state_dict()
    assert any(k.endswith(".gamma") for k in state) and any(k.endswith(".u") for k in state)
    if fmt == "torch":
        buf = io.BytesIO()
        torch.save(state, buf)
        buf.seek(0)
        loaded = torch.load(buf)
    else:
        loaded = load(save({k: v.contiguous() for k, v in state.items()}))
    torch.manual_seed(1)
    fresh = attnlab.build_model("vit_digits", **TINY_VIT, attn="sigma")
    fresh.load_state_dict(loaded, strict=True)
    for (name, p0), (_, p1) in zip(sigma_modules(model), sigma_modules(fresh)):
        assert torch.equal(p0.u, p1.u) and torch.equal(p0.gamma, p1.gamma), name
    model.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(model(x), fresh(x))


def test_specnorm_has_no_gamma_and_unit_norm():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="specnorm").eval()
    assert not any(k.endswith(".gamma") for k in model.state_dict())
    assert not any("gamma" in n for n, _ in model.named_parameters())
    qkv = model.blocks[0].attn.qkv
    assert abs(ref.spectral_norm(qkv.weight.detach().numpy()) - 1.0) < 1e-4


def test_targets_attn():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="sigma(targets=attn)")
    names = sorted(n for n, _ in sigma_modules(model))
    expected = sorted(f"blocks.{i}.attn.{p}" for i in range(3) for p in ("qkv", "proj"))
    assert names == expected
    assert not parametrize.is_parametrized(model.blocks[0].mlp.fc1)


def test_sigma_with_specnorm_is_an_error_saying_why():
    with pytest.raises(SpecError, match="'sigma' cannot be combined with 'specnorm'.*gamma"):
        attnlab.parse_spec("sigma+specnorm")


def test_bad_gamma_init():
    with pytest.raises(SpecError, match="gamma_init"):
        attnlab.parse_spec("sigma(gamma_init=one)")


def test_autocast_keeps_power_iteration_in_float32():
    model = _layer()
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = model(torch.randn(3, 24))
    assert y.dtype == torch.bfloat16 and _param(model[0]).u.dtype == torch.float32
    assert _raw(model[0]).dtype == torch.float32


def test_specnorm_function_direct():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 4)).eval()
    raw = model[0].weight.detach().clone()
    apply_specnorm(model, [])
    assert not _param(model[0]).learn_gamma
    # W_hat = W / sigma(W), sigma by numpy's SVD: the layer's output is that of W_hat
    w_hat = raw.double().numpy() / ref.spectral_norm(raw.numpy())
    x = torch.randn(3, 6)
    with torch.no_grad():
        want = x.double().numpy() @ w_hat.T + model[0].bias.double().numpy()
        torch.testing.assert_close(model(x).double(), torch.from_numpy(want), rtol=1e-5, atol=1e-6)


# ---- eval-mode sigma estimate: stored ||W u|| (default) or the authors' refreshed ||W^T v|| (issue 14) ----------
def _eval_sigma_reference(w: torch.Tensor, u: torch.Tensor, estimate: str) -> float:
    """float64, from the formulas: v = W u / ||W u||; stored: ||W u||; refresh: ||W^T v||."""
    w, u = w.double(), u.double()
    wu = w @ u
    if estimate == "stored":
        return float(wu.norm())
    return float((w.T @ (wu / wu.norm())).norm())


@pytest.mark.parametrize("estimate", ["stored", "refresh"])
def test_eval_sigma_estimate_follows_its_formula_and_saves_nothing(estimate):
    torch.manual_seed(0)
    layer = nn.Linear(12, 9)
    model = nn.Sequential(layer)
    apply_sigma(model, [], estimate=estimate)
    p = layer.parametrizations.weight[0]
    w = layer.parametrizations.weight.original.detach()
    with torch.no_grad():  # an unconverged u, as after a few training steps
        p.u.add_(0.3 * torch.randn_like(p.u)).div_(p.u.norm())
    u_before = p.u.clone()
    layer.eval()
    w_hat = layer.weight.detach()
    expected = float(p.gamma.detach()) / _eval_sigma_reference(w, u_before, estimate)
    torch.testing.assert_close(w_hat.double(), w.double() * expected, rtol=1e-5, atol=1e-7)
    assert torch.equal(p.u, u_before)  # the refreshed step is not saved
    assert float(p.sigma_of(w)) == pytest.approx(_eval_sigma_reference(w, u_before, estimate), rel=1e-5)


def test_eval_sigma_estimates_differ_while_u_has_not_converged_and_refresh_is_closer():
    torch.manual_seed(1)
    w = torch.randn(9, 12)
    u = torch.randn(12)
    u = u / u.norm()
    stored, refresh = _eval_sigma_reference(w, u, "stored"), _eval_sigma_reference(w, u, "refresh")
    exact = float(torch.linalg.matrix_norm(w.double(), 2))
    assert stored < refresh <= exact + 1e-9
    assert str(attnlab.parse_spec("sigma(estimate=refresh)")) == "sigma(estimate=refresh)"
    with pytest.raises(SpecError, match="estimate"):
        attnlab.parse_spec("sigma(estimate=fresh)")


def test_a_head_tied_to_the_embedding_stays_plain_and_no_weight_is_reparametrised_twice():
    from timm.models.vision_transformer import Block

    class TinyLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = torch.nn.Embedding(11, 16)
            self.block = Block(16, 2, qkv_bias=True)
            self.twin_a, self.twin_b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)
            self.twin_b.weight = self.twin_a.weight  # one matrix, two layers
            self.head = torch.nn.Linear(16, 11, bias=False)
            self.head.weight = self.wte.weight  # tied, as GPT-2 and nanoGPT tie them

        def forward(self, tokens):
            x = self.block(self.wte(tokens))
            return self.head(self.twin_b(self.twin_a(x)))

    model = attnlab.convert(TinyLM(), "sigma")
    assert not parametrize.is_parametrized(model.head, "weight") and model.head.weight is model.wte.weight
    assert parametrize.is_parametrized(model.twin_a, "weight") != parametrize.is_parametrized(model.twin_b, "weight")
    assert parametrize.is_parametrized(model.block.attn.qkv, "weight")
    assert len(sigma_modules(model)) == 5  # qkv, proj, fc1, fc2 and one of the twins
