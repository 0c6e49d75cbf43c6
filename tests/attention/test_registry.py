"""One suite over the registry (as timm's tests/test_models.py runs its checks once per registered model): for every
registered term, a set of compositions and a toy method registered by this file (one file, one entry), build, a
forward and a backward, the state-dict round trip, a build and forward on the meta device, tracing with
torch.compile (fullgraph, eager backend), causal and key-padding masks (honoured or refused in one line), and the
map instruments (read from the module's own explicit maps, or refused in one line)."""

from __future__ import annotations

import math

import pytest
import torch
from timm.models.vision_transformer import Block
from torch import nn

import attnlab
from attnlab.analysis.maps import capture_maps
from attnlab.analysis.redundancy import head_redundancy
from attnlab.attention.mask import AttentionMask
from attnlab.errors import SpecError, UnsupportedModelError
from attnlab.models import attention_modules
from attnlab.models.convert import term_support
from attnlab.variants import VARIANTS, Option, Variant, register

TOY = Variant("toy", "kernel", "softmax at a temperature (the registry suite's toy method)", "attnlab's tests",
              "tests.attention.toy_attention:ToyAttention",
              options={"temperature": Option(2.0, float, above=0.0, help="divides every logit")})
COMPOSITIONS = ["dna+ns", "dna(variant=q)+speccond", "ns+sigma", "qknorm+speccond", "qkclip+ns",
                "performer(features=16)+sigma", "nystrom(landmarks=4)+ns", "cog(all_layers=true)+ns", "cog(all_layers=true)",
                "diff+qknorm", "toy(temperature=3)+ns+sigma"]
SPECS = [*VARIANTS, "toy", *COMPOSITIONS]
DIGITS = dict(embed_dim=32, num_heads=2, depth=2)  # vit_digits, tiny: 16 tokens, head dim 16


@pytest.fixture(scope="module", autouse=True)
def toy_method():
    register(TOY)
    yield
    del VARIANTS["toy"]


def _build(spec, seed=0, **kwargs):
    torch.manual_seed(seed)
    return attnlab.build_model("vit_digits", attn=spec, **{**DIGITS, **kwargs})


def _images(n=2):
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("spec", SPECS)
def test_build_forward_backward_and_state_dict_round_trip(spec):
    assert str(attnlab.parse_spec(str(attnlab.parse_spec(spec)))) == str(attnlab.parse_spec(spec))
    model = _build(spec).train()
    out = model(_images())
    assert out.shape == (2, 10) and torch.isfinite(out).all()
    out.square().mean().backward()
    attn = attention_modules(model)[0][1]
    grads = [p.grad for p in attn.parameters() if p.requires_grad]
    assert grads and all(g is not None and torch.isfinite(g).all() for g in grads)
    model.eval()
    other = _build(spec, seed=1).eval()
    other.load_state_dict(model.state_dict(), strict=True)
    with torch.no_grad():
        torch.testing.assert_close(other(_images()), model(_images()), rtol=0, atol=0)


@pytest.mark.parametrize("spec", SPECS)
def test_meta_device_and_compile_tracing(spec):
    with torch.device("meta"):  # shapes only, no values: what a run's plan checks before it starts
        out = _build(spec).train()(torch.empty(2, 1, 8, 8))
    assert out.shape == (2, 10) and out.is_meta
    attn = attention_modules(_build(spec).eval())[0][1]
    x = torch.randn(2, 16, attn.dim)
    torch._dynamo.reset()
    with torch.no_grad():
        traced = torch.compile(attn, fullgraph=True, backend="eager")(x)
        torch.testing.assert_close(traced, attn(x), rtol=1e-5, atol=1e-6)


class _Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(32, 2, mlp_ratio=2.0, qkv_bias=True) for _ in range(2))

    def forward(self, x, attn_mask=None, is_causal=False):
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask, is_causal=is_causal)
        return x


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("kind", ["causal", "padding"])
def test_masks_are_honoured_or_refused_in_one_line(spec, kind):
    torch.manual_seed(0)
    model = attnlab.convert(_Blocks(), spec).double().eval()
    g = torch.Generator().manual_seed(2)
    x = torch.randn(2, 10, 32, generator=g, dtype=torch.float64)
    changed = x.clone()
    if kind == "causal":
        mask, seen = AttentionMask(is_causal=True), torch.zeros(2, 10, dtype=torch.bool)
        seen[:, :4] = True  # outputs up to position 3 must not see positions 4 on
    else:
        seen = torch.ones(2, 10, dtype=torch.bool)
        seen[0, 7:] = False
        seen[1, :2] = False
        mask = AttentionMask(key_padding=seen)
    changed[~seen] = torch.randn(int((~seen).sum()), 32, generator=g, dtype=torch.float64) * 3
    try:
        with torch.no_grad():
            a, b = model(x, attn_mask=mask), model(changed, attn_mask=mask)
    except UnsupportedModelError as err:
        assert "\n" not in str(err) and "cannot honour" in str(err) and kind == "causal", str(err)
        return
    torch.testing.assert_close(a[seen], b[seen], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("spec", SPECS)
def test_map_instruments_ask_the_module(spec):
    model = _build(spec)
    modules = [m for _, m in attention_modules(model)]
    if not all("weights" in m.capabilities.intermediates for m in modules):
        with pytest.raises(UnsupportedModelError, match="no attention weight maps"):
            head_redundancy(model, _images())
        return
    model.eval()
    with torch.no_grad():
        plain = model(_images())
        seen = []
        with capture_maps(model, lambda index, name, module, branches: seen.append(branches)):
            measured = model(_images())  # the forward runs on the very maps it records
    assert len(seen) == len(modules)
    torch.testing.assert_close(measured, plain, rtol=1e-4, atol=1e-5)
    for branches in seen:
        for branch in branches.values():  # every map a distribution over keys (cog: of |weights|)
            torch.testing.assert_close(branch.weights.abs().sum(-1), torch.ones(branch.weights.shape[:-1]))
    layers = head_redundancy(model, _images())
    assert len(layers) == len(modules)
    for layer in layers:
        for branch in layer["branches"].values():
            assert 0.0 <= branch["distance"] <= 2.0 and math.isfinite(branch["distance"])


def test_the_toy_method_is_one_file_and_one_entry():
    assert {"toy", "temperature"} <= {VARIANTS["toy"].name, *VARIANTS["toy"].options}
    model = _build("toy(temperature=4)")
    assert attention_modules(model)[0][1].temperature == 4.0
    with pytest.raises(SpecError, match="above 0"):
        attnlab.parse_spec("toy(temperature=0)")


@pytest.mark.parametrize("spec,words", [
    ("qkclip(alpha=7)", "alpha must be at least 0 and at most 1"),
    ("qkclip(tau=0)", "tau must be above 0"),
    ("sigma(gamma_init=nan)", "gamma_init must be a finite number"),
    ("dna(alpha_init=inf)", "alpha_init must be a finite number"),
    ("ns(eps=0)", "eps must be above 0"),
    ("performer(features=0)", "features must be at least 1"),
    ("speccond(lam=-1)", "lam must be at least 0"),
])
def test_option_ranges_are_checked_when_the_spec_is_read(spec, words):
    with pytest.raises(SpecError, match=words):
        attnlab.parse_spec(spec)


def _mask_forms(keep: torch.Tensor, dtype: torch.dtype) -> dict:
    """The same key mask (B, 1, 1, M), True = attend, in every form a caller may pass it."""
    zeros = torch.zeros(keep.shape, dtype=dtype)
    lowest = zeros.masked_fill(~keep, torch.finfo(dtype).min)  # Hugging Face's padding mask
    return {"bool": keep, "additive -inf": zeros.masked_fill(~keep, float("-inf")), "additive finfo.min": lowest,
            "additive -1e9": zeros.masked_fill(~keep, -1e9), "AttentionMask(finfo.min)": AttentionMask(attn_mask=lowest)}


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("path", ["fused", "explicit"])
@pytest.mark.parametrize("causal", [False, True], ids=["bidirectional", "causal"])
def test_every_mask_form_excludes_a_key_from_every_branch(spec, path, causal):
    """A boolean key mask, an additive 0/-inf mask, an additive 0/finfo.min mask (and -1e9) give one output and one
    gradient, in float64 and float32, and the masked keys reach no real output (a branch that negates or takes |s|
    would make a finfo.min key its most attended one); a term that cannot honour the mask refuses every form alike."""
    keep = torch.ones(2, 1, 1, 10, dtype=torch.bool)
    keep[0, ..., 7:] = False  # right padding
    keep[1, ..., 3] = keep[1, ..., 5] = False  # holes; every query keeps key 0, so no row is empty under causality
    real = keep[:, 0, 0]
    for dtype, tol in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
        torch.manual_seed(0)
        model = attnlab.convert(_Blocks(), spec).to(dtype).eval()
        for _, m in attention_modules(model):
            m.use_backend("auto" if path == "fused" else "explicit")
        g = torch.Generator().manual_seed(2)
        x = torch.randn(2, 10, 32, generator=g, dtype=torch.float64)
        changed = torch.where(real[..., None], x, torch.randn(2, 10, 32, generator=g, dtype=torch.float64) * 4)
        for grad in (False, True):
            outs, grads, refusals = {}, {}, {}
            for form, mask in _mask_forms(keep, dtype).items():
                inp = x.to(dtype).requires_grad_(grad)
                try:
                    with torch.set_grad_enabled(grad):
                        out = model(inp, attn_mask=mask, is_causal=causal)
                except UnsupportedModelError as err:
                    refusals[form] = str(err)
                    continue
                if grad:
                    out[real].square().sum().backward()
                    grads[form] = inp.grad
                outs[form] = out.detach()
                with torch.no_grad():
                    moved = model(changed.to(dtype), attn_mask=mask, is_causal=causal)
                torch.testing.assert_close(moved[real], outs[form][real], rtol=tol, atol=tol,
                                           msg=lambda m: f"{form}: a masked key reached a real output: {m}")
            if refusals:
                assert not outs, f"refused {sorted(refusals)} but honoured {sorted(outs)}"
                assert all("\n" not in why and "cannot honour" in why for why in refusals.values()), refusals
                continue
            for form in outs:
                torch.testing.assert_close(outs[form][real], outs["bool"][real], rtol=tol, atol=tol,
                                           msg=lambda m: f"{form} against bool ({dtype}, grad={grad}): {m}")
                if grad:
                    torch.testing.assert_close(grads[form], grads["bool"], rtol=tol, atol=tol,
                                               msg=lambda m: f"{form} gradient against bool ({dtype}): {m}")


@pytest.mark.parametrize("term", [name for name, v in VARIANTS.items() if v.kind in ("kernel", "head")])
def test_a_causal_model_refuses_a_term_without_a_causal_form_when_it_is_built(term):
    """What a term declares (its record's ``causal``) is what its forward does under ``is_causal``: a term that refuses
    there is refused by ``build_model`` and ``convert`` on a causal model (GPT), in one line; a term with a causal
    form builds it, and its outputs never see later tokens."""
    torch.manual_seed(0)
    plain = attnlab.convert(_Blocks(), term).double().eval()
    x = torch.randn(1, 10, 32, dtype=torch.float64)
    try:
        with torch.no_grad():
            plain(x, is_causal=True)
        honoured = True
    except UnsupportedModelError:
        honoured = False
    gpt = dict(vocab_size=32, block_size=8, embed_dim=16, depth=1, num_heads=2)
    if not honoured:
        for build in (lambda: attnlab.build_model("gpt_tiny", attn=term, **gpt),
                      lambda: attnlab.convert(attnlab.build_model("gpt_tiny", **gpt), term)):
            with pytest.raises(UnsupportedModelError, match="cannot honour a causal mask") as info:
                build()
            assert "\n" not in str(info.value) and "use a term with a causal form" in str(info.value)
        return
    model = attnlab.build_model("gpt_tiny", attn=term, **gpt).double().eval()
    tokens = torch.randint(0, 32, (2, 8), generator=torch.Generator().manual_seed(1))
    later = tokens.clone()
    later[:, 5:] = (later[:, 5:] + 1) % 32
    with torch.no_grad():
        torch.testing.assert_close(model(tokens)[:, :5], model(later)[:, :5], rtol=1e-12, atol=1e-12)
    support = term_support(attnlab.build_model("gpt_tiny", **gpt))
    assert term in support[0]["applies"]


def test_variants_support_and_train_name_the_causal_refusal(tmp_path):
    from tests.cli_runner import in_process

    listed = in_process(["variants", "--support", "gpt_tiny"])
    assert listed.returncode == 0 and "ns: ns cannot honour a causal mask" in listed.stdout
    assert "nystrom: nystrom cannot honour a causal mask" in listed.stdout
    run = in_process(["train", "--recipe", "lm", "--attn", "ns", "--runs-dir", tmp_path / "runs"], cwd=tmp_path)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and "cannot honour a causal mask" in run.stderr
    assert not (tmp_path / "runs").exists()  # refused before anything is created


def test_the_toy_method_gets_the_kv_cache_and_the_jacobian_its_record_declares():
    """One file and one registry entry: the toy's record declares a KV cache and single heads, so a GPT converted to
    it generates with the cache (the tokens and logits of recomputing) and the attention Jacobian measures it."""
    from attnlab.analysis.jacobian import jacobian_conditioning
    from attnlab.models.gpt import generate, supports_kv_cache

    torch.manual_seed(0)
    gpt = attnlab.build_model("gpt_tiny", attn="toy(temperature=3)", embed_dim=32, depth=2, num_heads=2).double()
    assert supports_kv_cache(gpt)
    prompt = torch.randint(0, 256, (2, 4))
    assert torch.equal(generate(gpt, prompt, 10, temperature=0, kv_cache=True),
                       generate(gpt, prompt, 10, temperature=0, kv_cache=False))
    vit = _build("toy(temperature=3)").double()
    jac = jacobian_conditioning(vit, _images(1).double(), heads=[0])
    assert jac.kappa.shape == (2, 1, 1) and torch.isfinite(jac.kappa).all() and (jac.kappa > 1).all()


def test_specs_written_before_the_backend_option_still_read():
    """Runs and checkpoints made before the one dispatcher name ns's and performer's option impl: it reads as
    backend (torch as explicit), so their config.yaml and checkpoint metadata still load."""
    assert str(attnlab.parse_spec("performer(features=16,impl=torch)")) == "performer(features=16,backend=explicit)"
    assert str(attnlab.parse_spec("ns(impl=reference)+sigma")) == "ns(backend=reference)+sigma"
    assert str(attnlab.parse_spec("dna(backend=sdpa)")) == "dna(backend=sdpa)"
    with pytest.raises(SpecError, match="backend is one of: auto, kernel, triton, sdpa, explicit"):
        attnlab.parse_spec("dna(backend=flash)")
