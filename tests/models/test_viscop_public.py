"""The video LLM's vision side against the authors' own code (the DnA repository, rjccv/DnA, ``viscop/``), read as test
data through ``tests/public_code.py`` (skips without it; ``tests/models/test_viscop.py`` compares the same weights
with the float64 loops of ``tests/reference_vlm.py`` everywhere).

Their ``ViSCoP_VisionEncoderModel`` (``modeling_viscop_vision_encoder.py``) is built at a small shape in float64 with
the random weights of ``test_viscop.their_weights``. Their FlashAttention path is the one trained (the interaction
modules call ``flash_attn_varlen_func`` whatever the setting); FlashAttention is not installed here, so the test
gives the module a dense ``flash_attn_varlen_func`` of its own (:func:`dense_varlen`: each packed sequence attends
its own keys, scale 1/sqrt(D)), and the encoder layers run their FlashAttention class on it. Their rotary rotates in
float32 even in a float64 model, so the comparison allows float32 rounding amplified over the layers (measured: 1.3e-7
on the visual tokens, up to 2.1e-5 on probes of magnitude ~30; the float64 references agree to 1e-9). The warm start is
``train_viscop.py``'s own loop, cut out of ``train()`` and run on their encoder.
"""

from __future__ import annotations

import textwrap
import types

import numpy as np
import pytest
import timm
import torch

from attnlab.models.siglip_navit import SigLIPNaViT
from attnlab.models.viscop import VisCoPEncoder
from attnlab.models.viscop_weights import probes_to_attnlab, viscop_to_attnlab
from tests.models.test_viscop import CHANS, DEPTH, DIM, HEADS, MLP, PATCH, PROBES, clips, ours, their_weights, \
    write_navit
from tests.public_code import load_module, read_source

pytest.importorskip("einops")  # their modeling file imports it

REPO = "rjccv/DnA"
BASE = "viscop/viscop/model/viscop_vision_encoder/"
KINDS = {"standard": "cross_attention", "dna": "cross_denoising_attention"}


def dense_varlen(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
    """FlashAttention's ``flash_attn_varlen_func`` (no dropout, not causal) computed densely: packed sequence i,
    query rows cu_q[i]:cu_q[i+1], attends key rows cu_k[i]:cu_k[i+1]; q (total_q, H, D) -> (total_q, H, D)."""
    assert dropout_p == 0.0 and not causal
    scale = softmax_scale or q.shape[-1] ** -0.5
    out = torch.empty(q.shape[0], q.shape[1], v.shape[2], dtype=q.dtype)
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (t[a:b].transpose(0, 1) for t, a, b in ((q, cu_q[i], cu_q[i + 1]), (k, cu_k[i], cu_k[i + 1]),
                                                              (v, cu_k[i], cu_k[i + 1])))
        out[cu_q[i]:cu_q[i + 1]] = ((qs @ ks.transpose(-2, -1) * scale).softmax(-1) @ vs).transpose(0, 1)
    return out


@pytest.fixture(scope="module")
def theirs():
    config = load_module(REPO, BASE + "configuration_viscop_vision_encoder.py",
                         "viscop_ve.configuration_viscop_vision_encoder")
    module = load_module(REPO, BASE + "modeling_viscop_vision_encoder.py", "viscop_ve.modeling_viscop_vision_encoder",
                         stubs={"viscop_ve.configuration_viscop_vision_encoder": config})
    module.flash_attn_varlen_func = dense_varlen
    return module


def their_model(theirs, attn: str, layers, W: dict | None = None):
    config = theirs.ViSCoP_VisionEncoderConfig(hidden_size=DIM, intermediate_size=MLP, num_hidden_layers=DEPTH,
                                               num_attention_heads=HEADS, num_channels=CHANS, patch_size=PATCH)
    config._attn_implementation = "sdpa"
    model = theirs.ViSCoP_VisionEncoderModel(config, model_cfg=types.SimpleNamespace(
        num_visual_probes=PROBES, interaction_module_layers=None if layers == "all" else layers,
        interaction_module=KINDS[attn])).double().eval()
    for layer in model.encoder.layers:  # their FlashAttention class (same weights), on dense_varlen
        layer.self_attn.__class__ = theirs.VisionFlashAttention2
    if W is not None:
        model.load_state_dict({k: torch.from_numpy(v) for k, v in W.items()})
    return model


def processor_patches(frames: torch.Tensor, m: int) -> torch.Tensor:
    """VideoLLaMA3's processor layout of frames (t, C, H, W): (t * h * w, C * p * p), merge-block order."""
    t, c, H, W = frames.shape
    h, w = H // PATCH, W // PATCH
    x = frames.reshape(t, c, h // m, m, PATCH, w // m, m, PATCH).permute(0, 2, 5, 3, 6, 1, 4, 7)
    return x.reshape(t * h * w, c * PATCH * PATCH)


@pytest.mark.parametrize("layers", ["all", [0, 2]])
@pytest.mark.parametrize("attn", ["standard", "dna"])
def test_the_probe_encoder_equals_the_authors_vision_encoder(theirs, attn, layers, tmp_path):
    W = their_weights(attn, DEPTH if layers == "all" else len(layers), seed=5)
    write_navit(W, tmp_path / "navit")
    vision = ours(W, attn, layers, tmp_path).eval()
    model = their_model(theirs, attn, layers, W)
    x, num_frames = clips(seed=6)
    m = 2
    pixels = torch.cat([processor_patches(x[b, :num_frames[b]], m) for b in range(2)])
    grid = torch.tensor([[int(t), x.shape[-2] // PATCH, x.shape[-1] // PATCH] for t in num_frames])
    with torch.no_grad():
        their_tokens, their_probes = model(pixels, grid, torch.tensor([m, m]))
        visual, valid, probes = vision(x, num_frames, merge_size=m)
    # their q, k rounded to float32 in every layer: measured 1.3e-7 on the tokens, up to 2.1e-5 on probes of size ~30
    torch.testing.assert_close(visual[valid], their_tokens, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(probes.reshape(-1, DIM), their_probes, rtol=1e-4, atol=1e-4)
    assert (probes - probes.mean()).abs().max() > 0.1  # not a degenerate output


def test_the_probe_path_equals_theirs_on_a_timm_vits_hidden_states(theirs):
    """Given the per-layer hidden states of any encoder (a timm ViT here), attnlab's probe path equals the authors'
    interaction modules run as their encoder runs them (varlen: one key sequence per sample, all its frames)."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=DIM, depth=DEPTH,
                            num_heads=HEADS, num_classes=0).double().eval()
    vision = VisCoPEncoder(vit, num_probes=PROBES, layers=[0, 2], attn="dna", warm_start="none").double().eval()
    W = their_weights("dna", 2, seed=7)
    model = their_model(theirs, "dna", [0, 2], W)
    vision.probes.load_state_dict(probes_to_attnlab({k: torch.from_numpy(v) for k, v in W.items()}, vision.probes))
    x, num_frames = clips(seed=8)
    x = torch.nn.functional.interpolate(x.flatten(0, 1), size=(16, 16)).view(2, 3, CHANS, 16, 16)
    with torch.no_grad():
        _, _, probes = vision(x, num_frames)
        hidden = [[] for _ in range(DEPTH)]
        for b in range(2):
            h = vit.norm_pre(vit._pos_embed(vit.patch_embed(x[b, :num_frames[b]])))
            for i, block in enumerate(vit.blocks):
                h = block(h)
                hidden[i].append(h.reshape(-1, DIM))
        kv_lens = torch.tensor([0] + [len(t) for t in hidden[0]]).cumsum(0).int()
        q_lens = torch.tensor([0, PROBES, 2 * PROBES]).int()
        enc = model.encoder
        p = enc.visual_probes.repeat(2, 1, 1).view(2 * PROBES, DIM)
        for i in range(DEPTH):
            if i in enc.interaction_module_layers:
                p = enc.interaction_modules[enc.interaction_module_mapping[i]](p, torch.cat(hidden[i]), q_lens,
                                                                              kv_lens, None)
    torch.testing.assert_close(probes.reshape(-1, DIM), p, rtol=1e-12, atol=1e-12)


def _their_warm_start(encoder, interaction_module: str, warm: bool = True, value: float = 1e-4) -> None:
    """``train_viscop.py``'s warm-start loop (cut out of ``train()``, from ``new_state_dict = {}`` to the encoder's
    ``load_state_dict``) run on ``encoder``."""
    source = read_source(REPO, "viscop/viscop/train_viscop.py")
    start = source.index("        new_state_dict = {}")
    end_mark = "encoder.load_state_dict(new_state_dict)"
    snippet = textwrap.dedent(source[start:source.index(end_mark) + len(end_mark)])
    inner = types.SimpleNamespace(encoder=encoder)
    model = types.SimpleNamespace(get_model=lambda: types.SimpleNamespace(
        vision_encoder=types.SimpleNamespace(vision_encoder=inner)))
    args = types.SimpleNamespace(warm_init_interaction_module=warm, warm_init_value_im=value,
                                 interaction_module=interaction_module)
    exec(compile(snippet, "train_viscop.py", "exec"), {"model": model, "model_args": args, "print": lambda *a: None})


# (their interaction module, layers, their warm_init (None: warm_init_interaction_module=False), our spec, our rule)
WARM = {
    "standard-all": ("standard", "all", 1e-4, "standard", "block"),
    "dna-all-1e-4": ("dna", "all", 1e-4, "dna(neg_init=-1e-4)", "block"),
    "dna-all-1e-2": ("dna", "all", 1e-2, "dna(neg_init=-1e-2)", "block"),
    "dna-all-disabled": ("dna", "all", None, "dna(neg_init=-1)", "block"),
    "standard-list-by-position": ("standard", [1, 2], 1e-4, "standard", "position"),
}


@pytest.mark.parametrize("case", WARM)
def test_the_warm_start_equals_train_viscops_rule_where_it_runs(theirs, case, tmp_path):
    """Their rule subtracts the softmin branch, so their scale s is attnlab's neg_init = -s; disabled, their rule
    copies at scale 1 (neg_init=-1); with a layer list it copies by position (attnlab's ``position`` rule)."""
    attn, layers, value, spec, rule = WARM[case]
    n = DEPTH if layers == "all" else len(layers)
    W = their_weights(attn, n, seed=9)
    for key in [k for k in W if k.endswith("neg_scalers")]:  # their init, which their warm start keeps
        W[key] = np.full(HEADS, 0.5)
    write_navit(W, tmp_path / "navit")
    model = their_model(theirs, attn, layers, W)
    _their_warm_start(model.encoder, KINDS[attn], value is not None, value or 1e-4)
    want = viscop_to_attnlab(model.state_dict(), ours(W, attn, layers, tmp_path))
    vision = VisCoPEncoder(ours(W, attn, layers, tmp_path).encoder, num_probes=PROBES, layers=layers, attn=spec,
                           warm_start=rule)
    got = vision.state_dict()
    modules = [k for k in want if k.startswith("probes.interaction_modules.")]
    assert modules and set(modules) == {k for k in got if k.startswith("probes.interaction_modules.")}
    for key in modules:
        torch.testing.assert_close(got[key], want[key], rtol=1e-15, atol=0, msg=key)


def test_their_rule_fails_for_dna_with_fewer_modules_than_layers(theirs):
    """Documented in docs/methods.md: the DnA keys of layers without a module make their strict load raise."""
    W = their_weights("dna", 2, seed=9)
    model = their_model(theirs, "dna", [1, 2], W)
    with pytest.raises(RuntimeError, match="Unexpected key"):
        _their_warm_start(model.encoder, "cross_denoising_attention")


def test_a_siglip_navit_of_their_shape_has_their_parameter_count(theirs):
    model = their_model(theirs, "standard", "all")
    ours_ = SigLIPNaViT(embed_dim=DIM, depth=DEPTH, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH)
    encoder = sum(p.numel() for n, p in model.named_parameters() if "interaction" not in n and "probes" not in n)
    assert sum(p.numel() for p in ours_.parameters()) == encoder
