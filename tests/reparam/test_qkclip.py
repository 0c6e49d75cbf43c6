"""`qkclip`: what is recorded (against float64 loops), the blockwise logit pass and its memory bound, the clip after an
optimizer step, untouched heads, errors."""

import copy
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import attnlab
from attnlab.errors import SpecError
from attnlab.attention import base as attention_base
from attnlab.models import attention_modules
from attnlab.ops import logits as logit_ops
from attnlab.reparam import qkclip

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import reference_qk as ref  # noqa: E402

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)

TAU = 100.0


def _model(spec="qkclip", seed=0):
    torch.manual_seed(seed)
    return attnlab.build_model("vit_digits", **TINY_VIT, attn=spec)  # 8x8x1, dim 64, 3 layers, 4 heads (D=16), no dropout


def _images(n=6, seed=1):
    return torch.randn(n, 1, 8, 8, generator=torch.Generator().manual_seed(seed))


def _modules(model):
    return [m for _, m in attention_modules(model)]


def _capture(model, x):
    """Inputs (tokens) each attention module saw during one training forward, and the loss of that forward."""
    seen = []
    handles = [m.register_forward_pre_hook(lambda mod, args: seen.append(args[0].detach().clone()))
               for m in _modules(model)]
    model.train()
    loss = model(x).logsumexp(dim=-1).mean()
    for h in handles:
        h.remove()
    return seen, loss


def _ref_max(module, tokens):
    return ref.max_logit(module.qkv.weight, module.qkv.bias, tokens, module.num_heads)


def _boost(model, x, targets):
    """Scale head h's q and k rows of layer l so that its max logit on x becomes `targets[(l, h)]` (> tau)."""
    for (layer, head), target in sorted(targets.items()):
        seen, _ = _capture(model, x)
        module = _modules(model)[layer]
        current = _ref_max(module, seen[layer])[head]
        assert current > 0
        H, D = module.num_heads, module.head_dim
        factor = math.sqrt(target / current)
        with torch.no_grad():
            for block in (0, 1):
                rows = slice(block * H * D + head * D, block * H * D + (head + 1) * D)
                module.qkv.weight[rows] *= factor
                module.qkv.bias[rows] *= factor
    for module in _modules(model):  # the forwards above were training forwards: forget what they recorded
        module.qk_clip.max_logit.fill_(float("-inf"))


BOOSTED = {(0, 1): 400.0, (2, 3): 250.0}


def test_clip_brings_every_head_to_at_most_tau():
    """SGD with lr=0: the only change is the clip, so on the recorded batch each clipped head's max logit is tau."""
    model = _model()
    x = _images()
    _boost(model, x, BOOSTED)
    before = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    assert qkclip.attach_optimizer_hooks(model, opt) is not None
    seen, loss = _capture(model, x)
    loss.backward()
    opt.step()
    clipped = 0
    for layer, (m_before, m_after) in enumerate(zip(_modules(before), _modules(model))):
        s_before = _ref_max(m_before, seen[layer])
        # what the module recorded: the true float64 maximum for heads over tau, an upper bound <= tau for the rest
        recorded = m_after.qk_clip.last_max_logit.double().numpy()
        over = s_before > TAU
        np.testing.assert_allclose(recorded[over], s_before[over], rtol=1e-5)
        assert (recorded[~over] <= TAU).all() and (recorded[~over] >= s_before[~over] * (1 - 1e-6)).all()
        s_after = _ref_max(m_after, seen[layer])
        assert (s_after <= TAU * (1 + 1e-5)).all(), (layer, s_after)
        for head in range(m_after.num_heads):
            if (layer, head) in BOOSTED:
                assert s_before[head] > TAU
                assert s_after[head] == pytest.approx(TAU, rel=1e-5)
                clipped += 1
            else:
                assert s_before[head] < TAU and s_after[head] == s_before[head]
    assert clipped == len(BOOSTED)
    assert qkclip.clip_stats(model) == {"qkclip/max_logit": pytest.approx(400.0, rel=1e-4),
                                        "qkclip/clipped_heads": 2.0}
    # a fresh forward of the same batch: layer 0 sees the same input, so its maximum is now tau
    _capture(model, x)
    assert float(_modules(model)[0].qk_clip.max_logit.max()) == pytest.approx(TAU, rel=1e-5)


@pytest.mark.parametrize("alpha", [0.5, 1.0])
def test_heads_below_tau_are_bit_identical(alpha):
    """Same AdamW step with and without the clip: unclipped heads, W_v and everything else are equal bit for bit;
    clipped heads' q rows (and bias) are scaled by gamma^alpha, k rows by gamma^(1 - alpha)."""
    base = _model(f"qkclip(alpha={alpha})" if alpha != 0.5 else "qkclip")
    x = _images()
    _boost(base, x, BOOSTED)
    with_clip, without = copy.deepcopy(base), copy.deepcopy(base)
    results = []
    for model, attach in ((with_clip, True), (without, False)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if attach:
            qkclip.attach_optimizer_hooks(model, opt)
        seen, loss = _capture(model, x)
        loss.backward()
        opt.step()
        results.append(seen)
    s_pre = [_ref_max(m, results[0][i]) for i, m in enumerate(_modules(base))]
    names_a = dict(with_clip.named_parameters())
    for name, p in without.named_parameters():
        if not name.endswith(("attn.qkv.weight", "attn.qkv.bias")):
            assert torch.equal(names_a[name], p), name
    for layer, (ma, mb) in enumerate(zip(_modules(with_clip), _modules(without))):
        H, D = ma.num_heads, ma.head_dim
        for tensor_a, tensor_b in ((ma.qkv.weight, mb.qkv.weight), (ma.qkv.bias, mb.qkv.bias)):
            assert torch.equal(tensor_a[2 * H * D:], tensor_b[2 * H * D:])  # W_v
            for head in range(H):
                gamma = TAU / s_pre[layer][head]
                for block, power in ((0, alpha), (1, 1 - alpha)):
                    rows = slice(block * H * D + head * D, block * H * D + (head + 1) * D)
                    if (layer, head) in BOOSTED and power != 0:
                        torch.testing.assert_close(tensor_a[rows].double(), tensor_b[rows].double() * gamma ** power,
                                                   rtol=1e-5, atol=0)
                    else:
                        assert torch.equal(tensor_a[rows], tensor_b[rows]), (layer, head, block)


def test_record_is_running_max_over_training_forwards_only():
    model = _model("qkclip(tau=0.001)")  # every head's bound exceeds tau: all maxima are exact
    mods = _modules(model)
    a, b = _images(seed=2), _images(seed=3) * 3
    seen_a, _ = _capture(model, a)
    seen_b, _ = _capture(model, b)  # gradient accumulation: two micro-batches before one step
    model.eval()
    with torch.no_grad():
        model(_images(seed=4) * 50)  # an evaluation forward records nothing
    for layer, m in enumerate(mods):
        expected = np.maximum(_ref_max(m, seen_a[layer]), _ref_max(m, seen_b[layer]))
        np.testing.assert_allclose(m.qk_clip.max_logit.double().numpy(), expected, rtol=1e-5)
    qkclip.clip_(model)  # all below tau: nothing changes, the record resets
    assert all(torch.isneginf(m.qk_clip.max_logit).all() for m in mods)


def test_swin_records_q_dot_k_without_position_bias_over_allowed_positions():
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", attn="qkclip(tau=0.001)")
    block = model.layers[0].blocks[1]  # shifted windows: the positions the mask excludes do not count
    seen = []
    h = block.attn.register_forward_pre_hook(lambda mod, args, kwargs: seen.append(args[0].detach().clone()),
                                             with_kwargs=True)
    model.train()
    model(torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0)))
    h.remove()
    allowed = _window_allowed(block, 1).numpy()
    assert not allowed.all()
    expected = ref.max_logit(block.attn.qkv.weight, block.attn.qkv.bias, seen[0], block.attn.num_heads,
                             allowed=allowed)
    np.testing.assert_allclose(block.attn.qk_clip.max_logit.double().numpy(), expected, rtol=1e-5)


def test_chunked_max_equals_one_shot(monkeypatch):
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(7, 9, 3, 4, generator=g), torch.randn(7, 9, 3, 4, generator=g)
    whole = logit_ops.max_scaled_logits(q.transpose(1, 2), k.transpose(1, 2), 0.5)
    monkeypatch.setattr(logit_ops, "CHUNK_ELEMENTS", 3 * 9 * 9 * 2)  # two images per chunk
    assert torch.equal(logit_ops.max_scaled_logits(q.transpose(1, 2), k.transpose(1, 2), 0.5), whole)
    expected = (torch.einsum("bnhd,bmhd->hbnm", q.double(), k.double()) * 0.5).amax(dim=(1, 2, 3))
    torch.testing.assert_close(whole.double(), expected, rtol=1e-6, atol=1e-6)


def test_state_dict_and_deepcopy():
    model = _model()
    plain = _model("standard")
    assert list(model.state_dict()) == list(plain.state_dict())
    plain.load_state_dict(model.state_dict(), strict=True)
    twin = copy.deepcopy(model)
    _capture(twin, _images())
    assert all(torch.isneginf(m.qk_clip.max_logit).all() for m in _modules(model))  # the copy records in itself
    assert all(torch.isfinite(m.qk_clip.max_logit).all() for m in _modules(twin))


def test_no_op_without_qkclip():
    model = _model("standard")
    assert qkclip.attach_optimizer_hooks(model, torch.optim.SGD(model.parameters(), lr=0.1)) is None
    assert qkclip.clip_stats(model) == {}


@pytest.mark.parametrize("spec,words", [
    ("qkclip+qknorm", "no effect"),
    ("qknorm+qkclip(tau=30)", "no effect"),
])
def test_spec_conflicts(spec, words):
    with pytest.raises(SpecError, match="cannot be combined") as info:
        attnlab.parse_spec(spec)
    assert words in str(info.value)


@pytest.mark.parametrize("kernel", ["cog", "diff", "dna", "nystrom", "performer"])
def test_kernels_are_refused_by_capability_at_conversion(kernel):
    # one rule (plain_softmax), no list of kernels: each is refused with the module it cannot act on
    with pytest.raises(SpecError, match="needs softmax attention"):
        attnlab.build_model("vit_digits", attn=f"{kernel}+qkclip")


def test_qk_norm_model_refused_at_apply():
    torch.manual_seed(0)
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn=None, qk_norm=True)  # timm's own QK-norm
    with pytest.raises(SpecError, match="no effect"):
        attnlab.convert(model, "qkclip")


def test_record_under_bf16_autocast_is_float32_max():
    """Under autocast q, k arrive in bfloat16; the record is the exact maximum of those q, k (computed in float32,
    not in bfloat16, which would round the logits to 3 significant digits)."""
    model = _model("qkclip(tau=0.001)")
    m = _modules(model)[0]
    outputs = []
    h = m.qkv.register_forward_hook(lambda mod, args, out: outputs.append(out.detach()))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _capture(model, _images())
    h.remove()
    out = outputs[0]
    assert out.dtype == torch.bfloat16 and m.qk_clip.max_logit.dtype == torch.float32
    H, D = m.num_heads, m.head_dim
    q = out[..., :H * D].double().unflatten(-1, (H, D))
    k = out[..., H * D:2 * H * D].double().unflatten(-1, (H, D))
    expected = (torch.einsum("bnhd,bmhd->hbnm", q, k) * m.scale).amax(dim=(1, 2, 3))
    torch.testing.assert_close(m.qk_clip.max_logit.double(), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("select", [True, False], ids=["host-select", "no-sync"])
def test_screening_is_exact_where_it_matters(select):
    """Heads whose Cauchy-Schwarz bound exceeds tau get the exact maximum; the others a bound in [S_max, tau]."""
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(5, 11, 4, 8, generator=g), torch.randn(5, 11, 4, 8, generator=g)
    q[:, :, 1] *= 40  # head 1: huge logits
    k[:, :, 1] *= 40
    q[:, :, 3] *= 2   # head 3: tau is placed between its maximum and its bound
    k[:, :, 3] *= 2
    scale = 8 ** -0.5
    exact = (torch.einsum("bnhd,bmhd->hbnm", q.double(), k.double()) * scale).amax(dim=(1, 2, 3))
    bound = (q.double().norm(dim=-1).amax(1) * k.double().norm(dim=-1).amax(1)).amax(0) * scale
    tau = float((exact[3] * bound[3]).sqrt())
    assert exact[1] > tau and bound[3] > tau > exact[3] and (bound[[0, 2]] < tau).all()
    got = logit_ops.screened_max_logits(q.transpose(1, 2), k.transpose(1, 2), scale, tau, select=select).double()
    torch.testing.assert_close(got[[1, 3]], exact[[1, 3]], rtol=1e-5, atol=0)
    torch.testing.assert_close(got[[0, 2]], bound[[0, 2]], rtol=2e-4, atol=0)


class LargestAllocation(TorchDispatchMode):
    """Bytes of the largest tensor any aten op allocates while active (outputs that are views of, or written into,
    one of the op's tensor arguments allocate nothing)."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs:
                if t.untyped_storage().nbytes() > self.largest:
                    self.largest, self.op = t.untyped_storage().nbytes(), str(func)
        return out


def _exact_max(q, k, scale, allowed=None):
    """Per-head max of the float64 logits, every (B, H, N, M) logit materialised at once; ``allowed`` (B, N, M):
    the positions that count."""
    logits = torch.einsum("bnhd,bmhd->bhnm", q.double(), k.double()) * scale
    if allowed is not None:
        logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    return logits.amax(dim=(0, 2, 3))


def _window_allowed(block, batch):
    """Swin's shifted-window mask of ``block`` as the (batch * windows, N, N) positions that may attend."""
    mask = block.attn_mask
    return (mask == 0).repeat(batch, 1, 1) if mask is not None else None


BLOCK = 512  # float32 elements: below one image's logits of one head (40 x 40), and below q or k of one image


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("how", ["max_scaled_logits", "screened-select", "screened-no-sync"])
def test_logit_pass_is_exact_and_never_holds_more_than_a_block(monkeypatch, dtype, how):
    """The blockwise maximum equals the maximum of the whole float64 logit tensor, and no intermediate (logit
    tile, float32 copy of q or k, head selection) exceeds BLOCK float32 elements."""
    monkeypatch.setattr(logit_ops, "CHUNK_ELEMENTS", BLOCK)
    g = torch.Generator().manual_seed(0)
    B, N, H, D = 3, 40, 4, 16
    qk = torch.randn(B, N, 2, H, D, generator=g)
    qk[:, :, :, 2] *= 6  # head 2 lies far above tau, the others below it
    qk[-1, -1, :, 0] = qk[-1, -1, 0, 0] * 1.5  # head 0's maximum: the last image's last query and last key
    qk = qk.to(dtype)
    q, k, scale = qk[:, :, 0], qk[:, :, 1], D ** -0.5
    exact = _exact_max(q, k, scale)
    head0 = torch.einsum("bnd,bmd->bnm", q[:, :, 0].double(), k[:, :, 0].double())
    assert head0.flatten().argmax() == head0.numel() - 1  # so that a tile left out at the end shows
    tau = float(exact[2]) / 2
    assert H * N * N > BLOCK and N * H * D > BLOCK
    with LargestAllocation() as seen:
        if how == "max_scaled_logits":
            got = logit_ops.max_scaled_logits(q.transpose(1, 2), k.transpose(1, 2), scale)
        else:
            got = logit_ops.screened_max_logits(q.transpose(1, 2), k.transpose(1, 2), scale, tau,
                                                select=how == "screened-select")
    assert seen.largest <= BLOCK * 4, (seen.largest, seen.op)
    assert got.dtype == torch.float32
    if how == "max_scaled_logits":
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=0)
    else:
        torch.testing.assert_close(got[2].double(), exact[2], rtol=1e-5, atol=0)
        others = [0, 1, 3]
        assert (got[others].double() >= exact[others] * (1 - 1e-5)).all() and (got[others] <= tau).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["vit_digits", "swin_cifar"])
def test_record_in_small_blocks_is_the_exact_max(monkeypatch, name, dtype):
    """A training forward with 256-element blocks (one head's logits of one image or window) records, for every
    layer and head (tau tiny: all exact), the maximum of that layer's float64 q k^T / sqrt(D) (Swin: over every
    window, without position bias, over the positions its shifted-window mask allows), and the recording never
    holds more than a block."""
    monkeypatch.setattr(logit_ops, "CHUNK_ELEMENTS", 256)
    largest = []
    screened = logit_ops.screened_max_logits

    def measured(*args, **kwargs):
        with LargestAllocation() as seen:
            out = screened(*args, **kwargs)
        largest.append((seen.largest, seen.op))
        return out

    monkeypatch.setattr(attention_base, "screened_max_logits", measured)  # what the forward's intermediates call
    torch.manual_seed(0)
    if name == "vit_digits":
        model, x = attnlab.build_model(name, **TINY_VIT, attn="qkclip(tau=0.001)"), _images(4)
    else:
        # two stages of a regular and a shifted-window block; 16 then 4 windows of 16 tokens per image
        model = attnlab.build_model(name, depths=(2, 2), num_heads=(2, 4), embed_dim=64, attn="qkclip(tau=0.001)")
        x = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    mods = _modules(model)
    outputs = []
    handles = [m.qkv.register_forward_hook(lambda mod, args, out: outputs.append(out.detach())) for m in mods]
    model.train()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        model(x)
    for h in handles:
        h.remove()
    assert len(outputs) == len(mods) == len(largest)
    assert max(largest)[0] <= 256 * 4, max(largest)
    blocks = [b for s in model.layers for b in s.blocks] if name != "vit_digits" else [None] * len(mods)
    for m, out, block in zip(mods, outputs, blocks):
        assert out.dtype == dtype
        H, D = m.num_heads, m.head_dim
        q = out[..., :H * D].unflatten(-1, (H, D))
        k = out[..., H * D:2 * H * D].unflatten(-1, (H, D))
        allowed = None if block is None else _window_allowed(block, x.shape[0])
        torch.testing.assert_close(m.qk_clip.max_logit.double(), _exact_max(q, k, m.scale, allowed), rtol=1e-5,
                                   atol=0)


def test_the_max_logit_is_over_allowed_positions_only():
    """A causal, padded forward records the max over real queries' allowed keys (j <= i, real j), nothing else."""
    from timm.models.vision_transformer import Block

    from attnlab.attention.mask import AttentionMask

    torch.manual_seed(0)
    model = attnlab.convert(torch.nn.ModuleList([Block(16, 2, qkv_bias=True)]), "qkclip(tau=0.001)").train()
    attn = model[0].attn
    x = torch.randn(2, 7, 16)
    real = torch.ones(2, 7, dtype=torch.bool)
    real[0, 5:] = False
    real[1, :2] = False
    attn(x, attn_mask=AttentionMask(is_causal=True, key_padding=real))
    allowed = np.tril(np.ones((7, 7), dtype=bool))[None] & real.numpy()[:, :, None] & real.numpy()[:, None, :]
    want = ref.max_logit(attn.qkv.weight, attn.qkv.bias, x, 2, allowed=allowed)
    np.testing.assert_allclose(attn.qk_clip.max_logit.double().numpy(), want, rtol=1e-5)
    assert not np.allclose(want, _ref_max(attn, x))  # the excluded positions held larger logits


@pytest.mark.parametrize("shape", [(7, 7), (1, 7, 7), (2, 1, 7, 7), (2, 2, 7, 7)])
def test_the_max_logit_takes_a_bool_attn_mask_of_every_rank(shape):
    """An SDPA-style bool attn_mask of rank 2, 3 or 4 (per head too: a position counts where any head may attend)
    restricts the recorded maximum to its allowed positions."""
    from timm.models.vision_transformer import Block

    torch.manual_seed(2)
    model = attnlab.convert(torch.nn.ModuleList([Block(16, 2, qkv_bias=True)]), "qkclip(tau=0.001)").train()
    attn = model[0].attn
    x = torch.randn(2, 7, 16)
    keep = torch.rand(shape) < 0.15
    keep[..., 0] = True  # every query attends a key
    attn(x, attn_mask=keep)
    allowed = keep.reshape((1,) * (4 - keep.ndim) + keep.shape).any(dim=1).expand(2, 7, 7).numpy()
    want = ref.max_logit(attn.qkv.weight, attn.qkv.bias, x, 2, allowed=allowed)
    np.testing.assert_allclose(attn.qk_clip.max_logit.double().numpy(), want, rtol=1e-5)
    assert not np.allclose(want, _ref_max(attn, x))  # the excluded positions held larger logits
