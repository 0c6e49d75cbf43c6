"""The attention contract, generated from the capability records (docs/methods.md, "Adding a method").

Every registered kernel and head term (and the registry suite's toy method) x every backend its record declares x
{float64, float32, bfloat16 autocast} x {no mask, causal, key padding, additive -inf, additive finfo.min, Swin's
window bias}: the output equals the term's own explicit float64 path within the dtype's tolerance (:data:`TOLERANCE`),
or the call is refused with one line of UnsupportedModelError, the sentence the record holds. Whether a cell is
refused is what the record says: a term that declares it honours a mask and raises fails, and so does one that
declares a refusal and runs. The float64 reference itself, and every backend in float32, is checked to honour each
mask it takes: what causality or padding hides reaches no output it must not; Swin's window mask changes exactly the
windows it masks (a head transform such as ns mixes a window's tokens after attention by design, so hidden regions
may meet there). A forced
backend that cannot run a cell (the C kernel in float64 or with a mask, Triton without CUDA, kernels switched off)
refuses it in one line, which the cell checks. A new registered term enters every cell with no edit here.

The intermediates are generated the same way, term x every form of a mask the forward takes (SDPA's bool masks of
rank 2, 3 and 4 among them): the logits and max logits (QK-clip's, the entropy instrument's) against q k^T computed
here; each branch's weight map (the maps instruments' and relevance's) zero where the form excludes a key.
"""

from __future__ import annotations

import copy

import pytest
import torch
from timm.models.swin_transformer import WindowAttention
from timm.models.vision_transformer import Block
from torch import nn

import attnlab
from attnlab.attention.base import AttnlabAttention, Want
from attnlab.attention.capabilities import Capabilities, capabilities_of
from attnlab.attention.mask import AttentionMask
from attnlab.errors import ConfigError, UnsupportedModelError
from attnlab.models import attention_modules
from attnlab.variants import VARIANTS, register

from tests.attention.test_registry import TOY

#: what the registry says an attention term is: the kernels and the head transforms (toy: registered below)
TERMS = [name for name, v in VARIANTS.items() if v.kind in ("kernel", "head")] + ["toy"]
DTYPES = ["float64", "float32", "bf16-autocast"]
MASKS = ["none", "causal", "key padding", "additive -inf", "additive finfo.min", "window bias"]
#: |output - float64 explicit| <= tol (1 + |reference|) per dtype, inputs and weights O(1) (measured worst: 2e-15,
#: 7e-7, 1.4e-2). In bf16 up to 1% of the elements may lie beyond, within :data:`BF16_CEILING`: rounding a logit near 0
#: can flip Cog's sign(s), which moves that output by about 0.1
TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "bf16-autocast": 5e-2}
BF16_CEILING = 0.25
#: which record field predicts each mask's refusal
FIELD = {"causal": "causal", "key padding": "key_padding", "additive -inf": "attn_mask",
         "additive finfo.min": "attn_mask", "window bias": "window"}
N, DIM, WINDOW = 10, 32, (2, 5)


@pytest.fixture(scope="module", autouse=True)
def toy_method():
    register(TOY)
    yield
    del VARIANTS["toy"]


def _spec(term: str) -> str:
    """The term as the registry's demo builds it (cog: signed in every layer, or the 2-block model has no signed one)."""
    demo = VARIANTS[term].demo if term in VARIANTS else TOY.demo
    return demo if isinstance(demo, str) else term


def _backends(term: str) -> tuple[str, ...]:
    """The backends the term's kernel record declares, read from the class (collection time: toy is not registered)."""
    v = VARIANTS.get(term, TOY)
    kernel = v.load() if v.kind == "kernel" else VARIANTS["standard"].load()
    return kernel.capabilities.backends


CELLS = [(t, b) for t in TERMS for b in _backends(t)]


class _Blocks(nn.Module):
    """Two timm ViT blocks (dim 32, 2 heads), as the registry suite's."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block(DIM, 2, mlp_ratio=2.0, qkv_bias=True) for _ in range(2))

    def forward(self, x, attn_mask=None, is_causal=False):
        for block in self.blocks:
            x = block(x, attn_mask=attn_mask, is_causal=is_causal)
        return x


class _Window(nn.Module):
    """One Swin window attention (timm's WindowAttention, window 2 x 5) with its relative-position bias."""

    def __init__(self):
        super().__init__()
        self.attn = WindowAttention(DIM, num_heads=2, window_size=WINDOW, qkv_bias=True)
        with torch.no_grad():  # make the relative-position bias matter (timm's init is trunc-normal 0.02)
            self.attn.relative_position_bias_table.normal_(0, 1)

    def forward(self, x, mask=None):
        return self.attn(x, mask=mask)


_MODELS: dict = {}


def _model(term: str, window: bool) -> nn.Module:
    """The converted float64 model (built once per term and geometry, copied per cell); raises what convert raises."""
    key = (term, window)
    if key not in _MODELS:
        torch.manual_seed(0)
        try:
            _MODELS[key] = attnlab.convert(_Window() if window else _Blocks(), _spec(term)).double().eval()
        except UnsupportedModelError as err:
            _MODELS[key] = err
    if isinstance(_MODELS[key], Exception):
        raise _MODELS[key]
    return copy.deepcopy(_MODELS[key])


def _keep() -> torch.Tensor:
    keep = torch.ones(2, N, dtype=torch.bool)
    keep[0, 7:] = False  # right padding
    keep[1, 3] = keep[1, 5] = False  # holes; every query keeps key 0, so no row is empty under causality
    return keep


def _window_mask() -> torch.Tensor:
    """Swin's shifted-window mask for 2 windows (num_windows, N, N): window 0 holds two regions of 5 tokens, 0 within
    a region and -100 across; window 1 is one region."""
    region = torch.zeros(2, N, dtype=torch.long)
    region[0, 5:] = 1
    return (region[:, :, None] != region[:, None, :]).double() * -100.0


def _call(model: nn.Module, x: torch.Tensor, mask: str) -> torch.Tensor:
    """``model`` on x with the mask named ``mask``, formed in x's dtype (finfo.min of the dtype the caller computes
    in: float32 under autocast)."""
    if mask == "window bias":
        return model(x, mask=_window_mask().to(x.dtype))
    if mask == "none":
        return model(x)
    if mask == "causal":
        return model(x, is_causal=True)
    keep = _keep()
    if mask == "key padding":
        return model(x, attn_mask=AttentionMask(key_padding=keep))
    fill = float("-inf") if mask == "additive -inf" else torch.finfo(x.dtype).min
    return model(x, attn_mask=torch.zeros(2, 1, 1, N, dtype=x.dtype).masked_fill(~keep[:, None, None, :], fill))


def _input() -> torch.Tensor:
    return torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(2), dtype=torch.float64)


def _records(model: nn.Module) -> list[Capabilities]:
    """The kernel's record and its head transforms' records, in the order the forward asks them."""
    attn = attention_modules(model)[0][1]
    return [attn.capabilities, *(capabilities_of(h) for h in attn.heads())]


def _predicted(records: list[Capabilities], mask: str) -> str | None:
    """The refusal sentence the records predict for ``mask``, or None (honoured)."""
    if mask == "none":
        return None
    return next((getattr(r, FIELD[mask]) for r in records if getattr(r, FIELD[mask])), None)


def _hidden(mask: str) -> torch.Tensor | None:
    """(2, N) bool: tokens whose inputs ``mask`` hides from the outputs of :func:`_seen`'s tokens, or None."""
    if mask in ("key padding", "additive -inf", "additive finfo.min"):
        return ~_keep()
    if mask == "causal":
        hidden = torch.zeros(2, N, dtype=torch.bool)
        hidden[:, 6:] = True
        return hidden
    return None


def _seen(mask: str) -> torch.Tensor:
    """(2, N) bool: the outputs that must not depend on the hidden tokens."""
    if mask == "causal":
        return ~_hidden(mask)
    return _keep()


_REFERENCE: dict = {}


def _reference(term: str, mask: str) -> torch.Tensor | UnsupportedModelError:
    """The term's explicit float64 output for ``mask`` (the refusal, if it refuses), checked to honour the mask."""
    key = (term, mask)
    if key in _REFERENCE:
        return _REFERENCE[key]
    try:
        model = _model(term, mask == "window bias")
        backends = _records(model)[0].backends
        for _, m in attention_modules(model):
            m.use_backend("explicit" if "explicit" in backends else backends[0])
        x = _input()
        with torch.no_grad():
            out = _call(model, x, mask)
            hidden = _hidden(mask)
            if mask == "window bias":  # window 1's mask is all zero: as unmasked; window 0's regions: not
                plain = model(x)
                torch.testing.assert_close(out[1], plain[1], rtol=1e-12, atol=1e-12)
                assert not torch.allclose(out[0], plain[0]), f"{term} ignores the window mask"
            if hidden is not None:  # what the mask hides reaches no output it must not
                moved = x.clone()
                moved[hidden] = torch.randn(int(hidden.sum()), DIM, generator=torch.Generator().manual_seed(3),
                                            dtype=torch.float64) * 4
                seen = _seen(mask)
                torch.testing.assert_close(_call(model, moved, mask)[seen], out[seen], rtol=1e-10, atol=1e-10,
                                           msg=lambda m: f"{term} does not honour {mask}: {m}")
        _REFERENCE[key] = out
    except UnsupportedModelError as err:
        _REFERENCE[key] = err
    return _REFERENCE[key]


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("term,backend", CELLS, ids=[f"{t}-{b}" for t, b in CELLS])
def test_cell_matches_the_float64_explicit_path_or_is_refused_as_the_record_says(term, backend, dtype, mask):
    reference = _reference(term, mask)
    try:
        model = _model(term, mask == "window bias")
    except UnsupportedModelError as err:
        model, built = None, err
    if model is not None:
        predicted = _predicted(_records(model), mask)
    else:  # refused when it was built (a geometry the mechanism does not take): only the window geometry is one
        predicted = _predicted(_records(_model(term, False)), mask)
        assert mask == "window bias" and predicted is not None, f"{term} refused to build: {built}"
        assert str(built) == f"{predicted}.", str(built)
        return
    if isinstance(reference, UnsupportedModelError):
        assert predicted is not None, f"{term}'s record says it honours {mask}, but it refused: {reference}"
    for _, m in attention_modules(model):
        m.use_backend(backend)
    x = _input()
    if dtype == "float32":
        model, x = model.float(), x.float()
    if dtype == "bf16-autocast":
        model, x = model.float(), x.float()
    try:
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == "bf16-autocast"):
            out = _call(model, x, mask)
    except UnsupportedModelError as err:
        assert predicted is not None, f"{term}'s record says it honours {mask}, but it refused: {err}"
        assert "\n" not in str(err) and str(err) == f"{predicted}.", str(err)
        return
    except ConfigError as err:  # a forced backend that cannot run this call (dtype, mask, opt-in) says why
        if backend in ("sdpa", "explicit"):
            raise
        assert "\n" not in str(err) and "cannot run" in str(err), str(err)
        return
    assert predicted is None, f"{term}'s record refuses {mask} ({predicted}), but it ran"
    hidden = _hidden(mask)
    if hidden is not None and dtype == "float32":  # on this backend too, what the mask hides reaches no output
        moved = x.clone()
        moved[hidden] = torch.randn(int(hidden.sum()), DIM, generator=torch.Generator().manual_seed(3)) * 4
        with torch.no_grad():
            again = _call(model, moved, mask)
        torch.testing.assert_close(again[_seen(mask)], out[_seen(mask)], rtol=1e-6, atol=1e-6,
                                   msg=lambda m: f"{term} on {backend} does not honour {mask}: {m}")
    err = (out.double() - reference).abs() / (1 + reference.abs())
    beyond = float((err > TOLERANCE[dtype]).double().mean())
    where = f"{term} on {backend} in {dtype} with {mask}: largest error {err.max():.3g}"
    if dtype == "bf16-autocast":
        assert beyond <= 0.01 and err.max() <= BF16_CEILING, f"{where}, {beyond:.1%} beyond {TOLERANCE[dtype]}"
    else:
        assert beyond == 0, where


@pytest.mark.parametrize("term", TERMS)
def test_the_record_is_frozen_and_the_backend_option_offers_what_it_declares(term):
    """The record is data (frozen); a kernel's ``backend`` spec option offers ``auto`` and exactly the backends its
    record declares (a kernel with one backend has no option); a head term's likewise."""
    v = VARIANTS.get(term, TOY)
    cls = v.load() if v.kind == "kernel" else VARIANTS["standard"].load()
    assert issubclass(cls, AttnlabAttention)
    record = v.load().capabilities
    assert isinstance(record, Capabilities)
    with pytest.raises(AttributeError):
        record.causal = None  # frozen
    if v.kind == "kernel":
        assert record.backends and set(record.backends) <= {"sdpa", "explicit", "kernel", "triton"}
    option = v.options.get("backend")
    if len(record.backends) > 1:
        assert option is not None and set(option.choices) == {"auto", *record.backends}, term
    else:
        assert option is None, term


#: every form of a mask the forward takes, for the intermediates' test: (2, N, N) keep maps, True where query i may
#: attend key j (a padded query's row counts nowhere)
FORMS = ["none", "causal", "key padding", "causal + key padding", "additive -inf", "bool (N, N)",
         "bool per head (H, N, N)", "bool per sample (B, 1, N, N)", "window bias"]


def _form(mask: str, dtype: torch.dtype) -> tuple[dict, torch.Tensor]:
    """(forward arguments, keep map (B, H or 1, N, N)) of the mask form named ``mask``: the keys each query may attend
    (a padded query's row keeps the real keys: its output row is zeroed after); SDPA's broadcasting reads a 3-D mask
    as (H, N, M)."""
    real, causal = _keep(), torch.ones(N, N, dtype=torch.bool).tril()
    keys = real[:, None, :].expand(2, N, N)
    holes = torch.rand(2, N, N, generator=torch.Generator().manual_seed(4)) < 0.6
    holes[:, :, 0] = True  # every query attends a key
    if mask == "none":
        return {}, torch.ones(2, 1, N, N, dtype=torch.bool)
    if mask == "causal":
        return {"is_causal": True}, causal.expand(2, 1, N, N)
    if mask in ("key padding", "causal + key padding"):
        both = mask != "key padding"
        return ({"attn_mask": AttentionMask(is_causal=both, key_padding=real)}, (keys & causal if both else keys)[:, None])
    if mask == "additive -inf":
        return ({"attn_mask": torch.zeros(2, 1, N, N, dtype=dtype).masked_fill(~holes[:, None], float("-inf"))},
                holes[:, None])
    if mask == "bool (N, N)":
        return {"attn_mask": holes[0]}, holes[0].expand(2, 1, N, N)
    if mask == "window bias":  # the attention takes Swin's mask positionally (timm's WindowAttention.forward)
        return {"window": _window_mask().to(dtype)}, (_window_mask() == 0)[:, None]
    if mask == "bool per head (H, N, N)":
        return {"attn_mask": holes}, holes.expand(2, 2, N, N)
    return {"attn_mask": holes[:, None]}, holes[:, None]


def _predicted_form(model: nn.Module, mask: str) -> str | None:
    """The refusal the records predict for a form of :data:`FORMS`, or None."""
    parts = [m for m in ("causal", "key padding", "window bias", "none") if m in mask] or ["additive -inf"]
    return next((why for why in (_predicted(_records(model), m) for m in parts) if why), None)


@pytest.mark.parametrize("mask", FORMS)
@pytest.mark.parametrize("term", TERMS)
def test_logit_intermediates_match_an_independent_reference_under_every_mask_form(term, mask):
    """Every plain-softmax term (its record says so) reports float32 logits q k^T / sqrt(D) and, for every mask form,
    per-head max logits over the positions that form allows (never the position bias), computed here from the fused
    projection's q and k; a term whose record does not say so refuses in one line."""
    try:
        model = _model(term, mask == "window bias")
    except UnsupportedModelError:
        return  # the window geometry, refused as the contract cells check
    attn = attention_modules(model)[0][1]
    x = _input()
    kwargs, keep = _form(mask, x.dtype)
    keep = keep.any(dim=1)  # a position counts for every head's maximum where any head may attend it
    if "key padding" in mask:  # and only a real query's
        keep = keep & _keep()[:, :, None]
    want = Want(logits=True, max_logits=float("-inf"))
    predicted = _predicted_form(model, mask)
    if not attn.capabilities.plain_softmax or predicted is not None:
        with pytest.raises(UnsupportedModelError) as refused:
            attn.run(x, **kwargs, want=want)
        assert "\n" not in str(refused.value)
        return
    H, D = attn.num_heads, attn.head_dim

    def reference(x):  # q k^T / sqrt(D) from the fused projection's first two blocks, and its masked maxima
        with torch.no_grad():
            q, k = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in attn.qkv(x)[..., :2 * H * D].chunk(2, dim=-1))
        logits = q @ k.transpose(-2, -1) / D ** 0.5
        return logits, logits.masked_fill(~keep[:, None], float("-inf")).amax(dim=(0, 2, 3))

    # the first input whose unmasked maximum lies where the form excludes it, so that the cell can fail
    for seed in range(100):
        x = torch.randn(2, N, DIM, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        logits, expected = reference(x)
        if mask == "none" or not torch.equal(expected, logits.amax(dim=(0, 2, 3))):
            break
    else:
        raise AssertionError(f"no input puts a maximum where {mask} excludes it")
    with torch.no_grad():
        found = attn.run(x, **kwargs, want=want)[1]
    torch.testing.assert_close(found.logits.double(), logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(found.max_logits.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mask", FORMS)
@pytest.mark.parametrize("term", TERMS)
def test_weight_maps_honour_every_mask_form(term, mask):
    """Every term whose record declares the ``weights`` intermediate reports, per branch, (B, H, N, M) maps that are
    0 wherever the form excludes a key (exactly; Swin's -100 below 1e-40, as a softmax gives it), and whose rows'
    absolute values sum to 1 (softmax, softmin, Cog's signed weights); the output is linear in them: o_h is
    sum_b c_b W_b V_b (checked by the instruments' tests)."""
    try:
        model = _model(term, mask == "window bias")
    except UnsupportedModelError:
        return
    attn = attention_modules(model)[0][1]
    if "weights" not in attn.capabilities.intermediates or _predicted_form(model, mask) is not None:
        return
    kwargs, keep = _form(mask, torch.float64)
    with torch.no_grad():
        found = attn.run(_input(), **kwargs, want=Want(weights=True))[1]
    assert found.weights, f"{term} declares weights but returned none"
    for branch, maps in found.weights.items():
        w = maps.weights
        assert w.shape == (2, attn.num_heads, N, N), (branch, w.shape)
        excluded = w.masked_fill(keep, 0.0).abs().max()
        assert float(excluded) <= (1e-40 if mask == "window bias" else 0.0), f"{term} {branch}: {float(excluded):.3g}"
        torch.testing.assert_close(w.abs().sum(dim=-1), torch.ones(2, attn.num_heads, N, dtype=w.dtype))
