"""The GPT presets against a float64 GPT-2 written from the architecture (tests/reference_gpt.py), causality, the
registry and generation with and without the KV cache."""

from __future__ import annotations

import math

import pytest
import torch

import attnlab
from attnlab.errors import AttnlabError, ConfigError, UnsupportedModelError
from attnlab.models.gpt import generate, supports_kv_cache
from tests.reference_gpt import reference_gpt
from tests.backends import set_fused

GEO = dict(vocab_size=23, block_size=16, embed_dim=24, depth=2, num_heads=3)

# attnlab's names of nanoGPT's weights (the layout the model documents), for the reference below
NAMES = {"transformer.wte.weight": "wte.weight", "transformer.wpe.weight": "wpe.weight",
         "transformer.ln_f.weight": "norm.weight", "transformer.ln_f.bias": "norm.bias"}
BLOCK = {"ln_1": "norm1", "attn.c_attn": "attn.qkv", "attn.c_proj": "attn.proj", "ln_2": "norm2",
         "mlp.c_fc": "mlp.fc1", "mlp.c_proj": "mlp.fc2"}


def nanogpt_names(state: dict, depth: int) -> dict:
    """The model's state dict renamed to nanoGPT's keys (lm_head tied to wte)."""
    table = dict(NAMES)
    for i in range(depth):
        for theirs, ours in BLOCK.items():
            for p in ("weight", "bias"):
                table[f"transformer.h.{i}.{theirs}.{p}"] = f"blocks.{i}.{ours}.{p}"
    out = {k: state[v] for k, v in table.items() if v in state}
    out["lm_head.weight"] = state["wte.weight"]
    return out


def tokens(B=2, N=GEO["block_size"], seed=0):
    return torch.randint(0, GEO["vocab_size"], (B, N), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("attn,fused", [(None, True), ("standard", True), ("standard", False)])
def test_matches_reference(attn, fused):
    """timm's Attention (is_causal SDPA), attnlab's standard through SDPA and its explicit path: GPT-2's function."""
    torch.manual_seed(0)
    model = attnlab.build_model("gpt_tiny", attn=attn, **GEO).double().eval()
    set_fused(model, fused)
    x = tokens()
    ref = reference_gpt(nanogpt_names(model.state_dict(), GEO["depth"]), x, GEO["num_heads"])
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-10, atol=1e-10)


def test_tanh_gelu_and_no_bias_match_reference():
    torch.manual_seed(1)
    model = attnlab.build_model("gpt_tiny", gelu="tanh", bias=False, **GEO).double().eval()
    assert not any(name.endswith(".bias") for name in model.state_dict())
    x = tokens(seed=1)
    ref = reference_gpt(nanogpt_names(model.state_dict(), GEO["depth"]), x, GEO["num_heads"], gelu="tanh")
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=1e-10, atol=1e-10)


def test_position_i_ignores_later_tokens():
    """timm's own attention (no spec): changing the tokens after position i leaves the logits up to i bit-identical
    (float64); every registered term is checked below."""
    torch.manual_seed(0)
    model = attnlab.build_model("gpt_tiny", attn=None, **GEO).double().eval()
    x = tokens(B=2)
    with torch.no_grad():
        base = model(x)
        for i in (0, 5, GEO["block_size"] - 2):
            y = x.clone()
            y[:, i + 1:] = (y[:, i + 1:] + 1 + torch.arange(y.shape[1] - i - 1)) % GEO["vocab_size"]
            out = model(y)
            assert torch.equal(out[:, : i + 1], base[:, : i + 1])
            assert not torch.equal(out[:, i + 1:], base[:, i + 1:])


def _registered_specs():
    """Every registered term as the demo trains it (its demo spec where it names one, else its bare name)."""
    from attnlab.variants import VARIANTS

    return [v.demo if isinstance(v.demo, str) else name for name, v in VARIANTS.items()]


# documented refusals (docs/methods.md, causal forms): ns's transform mixes every token of a head; Nystrom's
# landmarks are segment means over the whole sequence
REFUSE_CAUSAL = {"ns", "nystrom"}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "explicit"])
@pytest.mark.parametrize("spec", _registered_specs())
def test_every_term_is_causal_or_refuses(spec, fused):
    """For every registered term and both paths: the logits up to position i do not change, bit for bit in
    float64, when the tokens after i do; a term that cannot be causal refuses in one line saying why."""
    torch.manual_seed(0)
    name = spec.split("(")[0]
    if name in REFUSE_CAUSAL:  # refused when the model is built, not at its first forward
        with pytest.raises(AttnlabError, match="causal") as err:
            attnlab.build_model("gpt_tiny", attn=spec, **GEO)
        assert "\n" not in str(err.value) and str(err.value).startswith(name)
        return
    model = attnlab.build_model("gpt_tiny", attn=spec, **GEO).double().eval()
    for block in model.blocks:
        block.attn.use_backend("auto" if fused else "explicit")
    x = tokens(B=2)
    with torch.no_grad():
        base = model(x)
        for i in (0, 6, GEO["block_size"] - 2):
            y = x.clone()
            y[:, i + 1:] = (y[:, i + 1:] + 1 + torch.arange(y.shape[1] - i - 1)) % GEO["vocab_size"]
            out = model(y)
            assert torch.equal(out[:, : i + 1], base[:, : i + 1]), f"{spec}: position <= {i} saw a later token"
            assert not torch.equal(out[:, i + 1:], base[:, i + 1:])


def test_presets_have_gpt2_geometry():
    """gpt2_small has GPT-2 small's 124,439,808 parameters (tied head counted once); gpt_mini is ~10M."""
    with torch.device("meta"):
        small = attnlab.build_model("gpt2_small", attn=None)
        mini = attnlab.build_model("gpt_mini", attn=None)
    assert sum(p.numel() for p in small.parameters()) == 124_439_808
    assert 9e6 < sum(p.numel() for p in mini.parameters()) < 12e6
    assert (small.vocab_size, small.block_size, len(small.blocks)) == (50257, 1024, 12)


def test_build_model_api_and_timm_names():
    model = attnlab.build_model("gpt_tiny", vocab_size=256, block_size=256, attn="dna")
    assert model(torch.randint(0, 256, (2, 256))).shape == (2, 256, 256)
    names = attnlab.build_model("gpt_tiny", attn=None).state_dict().keys()
    assert {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.3.mlp.fc2.weight"} <= set(names)
    assert "head.weight" not in names  # the tied head is the embedding itself
    assert len(attnlab.models.attention_modules(model)) == 4


def test_converted_state_dict_round_trips():
    torch.manual_seed(0)
    converted = attnlab.build_model("gpt_tiny", attn="standard", **GEO).eval()
    plain = attnlab.build_model("gpt_tiny", attn=None, **GEO).eval()
    plain.load_state_dict(converted.state_dict(), strict=True)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(plain(x), converted(x))


def test_residual_projections_get_the_scaled_init():
    torch.manual_seed(0)
    model = attnlab.build_model("gpt_mini", attn=None)
    expect = 0.02 / math.sqrt(2 * 6)
    for w in (model.blocks[2].attn.proj.weight, model.blocks[2].mlp.fc2.weight):
        assert abs(w.std().item() / expect - 1) < 0.03
    assert abs(model.blocks[2].mlp.fc1.weight.std().item() / 0.02 - 1) < 0.03
    assert abs(model.wte.weight.std().item() / 0.02 - 1) < 0.03


def test_errors_are_one_sentence():
    model = attnlab.build_model("gpt_tiny", **GEO)
    with pytest.raises(AttnlabError, match="longer than the model's block_size 16"):
        model(tokens(N=17))
    with pytest.raises(ConfigError, match="takes no num_classes"):
        attnlab.build_model("gpt_tiny", num_classes=10)
    with pytest.raises(ConfigError, match="num_heads is 4, not a positive integer dividing embed_dim 30; give one"):
        attnlab.build_model("gpt_tiny", embed_dim=30, num_heads=4)
    with pytest.raises(ConfigError, match="gelu"):
        attnlab.build_model("gpt_tiny", gelu="fast")
    with pytest.raises(ConfigError, match="block size 300 is above gpt_tiny's 256"):
        attnlab.models.gpt.check_block_size(attnlab.build_model("gpt_tiny"), 300)


# ---- generation ---------------------------------------------------------------------------------------------------
def naive_greedy(model, x, n):
    """Greedy decoding by recomputing the whole (cropped) context at every step."""
    for _ in range(n):
        logits = model(x[:, -model.block_size:])[:, -1]
        x = torch.cat([x, logits.argmax(-1, keepdim=True)], dim=1)
    return x


def _cached_specs():
    """Every registered term whose modules keep a KV cache (the kernels and the q/k and weight terms on standard),
    each DnA variant, and QK-norm on DnA's two queries (a term that cannot cache recomputes, as the reference)."""
    specs = []
    for spec in _registered_specs() + [f"dna(variant={v})" for v in ("q", "v", "shared", "sum")] + ["dna+qknorm"]:
        if spec.split("(")[0] in REFUSE_CAUSAL:  # refused when a GPT is built with it
            continue
        torch.manual_seed(0)
        if supports_kv_cache(attnlab.build_model("gpt_tiny", attn=spec, **GEO)):
            specs.append(spec)
    return specs


def _logits_per_step(model, run):
    """``run()``'s tokens and the last-position logits of every generation step (read at the final norm)."""
    seen = []
    handle = model.norm.register_forward_hook(lambda m, args, h: seen.append(model.head(h[:, -1])))
    try:
        out = run()
    finally:
        handle.remove()
    return out, torch.stack(seen, 1)


@pytest.mark.parametrize("attn", _cached_specs())
def test_cached_generation_equals_recomputation(attn):
    """Greedy in float64, 40 tokens past a prompt of 5 with block_size 16: the cached decode gives the tokens and
    the logits (to 1e-6; measured: at most 4e-15) of recomputing the whole context at every step. Past block_size
    the context is the last block_size tokens, recomputed (nanoGPT's crop: learned positions restart at 0 for the
    window's first token, so the old keys cannot be reused); the reference crops the same way."""
    torch.manual_seed(0)
    model = attnlab.build_model("gpt_tiny", attn=attn, **{**GEO, "num_heads": 2}).double().eval()
    assert supports_kv_cache(model)
    prompt, new = tokens(B=2, N=5), 40
    cached, cached_logits = _logits_per_step(model, lambda: generate(model, prompt, new, temperature=0))
    with torch.no_grad():
        naive, naive_logits = _logits_per_step(model, lambda: naive_greedy(model, prompt, new))
    assert cached.shape[1] == 5 + new > GEO["block_size"]
    assert torch.equal(cached, naive)
    print(f"{attn}: max |cached - recomputed logit| {(cached_logits - naive_logits).abs().max().item():.1e}")
    torch.testing.assert_close(cached_logits, naive_logits, rtol=0, atol=1e-6)
    assert torch.equal(cached, generate(model, prompt, new, temperature=0, kv_cache=False))


def test_sampling_is_reproducible_with_a_generator():
    torch.manual_seed(0)
    model = attnlab.build_model("gpt_tiny", **GEO).double()
    model.train()
    prompt = tokens(B=3, N=4)
    runs = [generate(model, prompt, 10, temperature=0.8, top_k=5, generator=torch.Generator().manual_seed(7),
                     kv_cache=cache) for cache in (True, False)]
    assert torch.equal(runs[0], runs[1])
    assert model.training  # mode restored
    assert torch.equal(generate(model, prompt, 6, top_k=1), generate(model, prompt, 6, temperature=0))


def test_token_mixing_head_transform_recomputes():
    from attnlab.attention.ns import NSTransform

    # ns mixes every token of a head, so a causal model refuses it when it is built (the plan does so too) ...
    with pytest.raises(UnsupportedModelError, match="ns cannot honour a causal mask"):
        attnlab.build_model("gpt_tiny", attn="ns", **GEO)
    # ... and a head transform that mixes tokens, set by hand, still keeps generation off the KV cache
    model = attnlab.build_model("gpt_tiny", **GEO).double()
    for block in model.blocks:
        block.attn.head_transform = NSTransform()
    assert not supports_kv_cache(model)
    with pytest.raises(ConfigError, match="cannot use a KV cache"):
        generate(model, [1, 2], 3, kv_cache=True)


def test_prompt_errors():
    model = attnlab.build_model("gpt_tiny", **GEO)
    with pytest.raises(ConfigError, match="token id 23, outside the model's vocabulary 0..22"):
        generate(model, [1, 23], 2)
    with pytest.raises(ConfigError, match="empty"):
        generate(model, [], 2)
    with pytest.raises(ConfigError, match="integer token ids"):
        generate(model, torch.ones(3), 2)
    for bad in (dict(max_new_tokens=-1), dict(max_new_tokens=2, temperature=-1.0),
                dict(max_new_tokens=2, top_k=0)):
        with pytest.raises(ConfigError):
            generate(model, [1], **bad)
    assert generate(model, [1, 2], 0).tolist() == [[1, 2]]
