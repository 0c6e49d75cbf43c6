"""The size ladder: docs/methods.md's table checked against the parameter formula restated here and against the
built models (meta device: no memory), and the two initialisations' statistics against their definitions."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch
from torch import nn

import attnlab
from attnlab.errors import ConfigError
from attnlab.models.ladder import LADDER_PRESETS

DOCS = Path(__file__).resolve().parents[2] / "docs" / "methods.md"
ROW = re.compile(r"^\| `(ladder_d\d+)` \| (\d+) \| (\d+) \| (\d+) \| (\d+) \| ([\d,]+) \| ([\d,]+) \|$", re.M)


def documented() -> dict[str, tuple[int, ...]]:
    return {m[1]: tuple(int(g.replace(",", "")) for g in m.groups()[1:]) for m in ROW.finditer(DOCS.read_text())}


def test_docs_table_lists_every_preset():
    assert set(documented()) == set(LADDER_PRESETS) and len(LADDER_PRESETS) >= 8


@pytest.mark.parametrize("name", sorted(LADDER_PRESETS, key=lambda n: int(n.split("_d")[1])))
def test_parameter_count_is_the_documented_one(name):
    d, layers, heads, hidden, body, total = documented()[name]
    # the rule, restated: head dim 64, heads = layers = d/64, SwiGLU 8d/3 up to a multiple of 32, untied, vocab 32000
    assert layers == heads == d // 64 and d % 64 == 0
    assert hidden == math.ceil(8 * d / 3 / 32) * 32
    per_layer = 4 * d * d + 3 * d * hidden + 2 * d  # q, k, v, o; gate, up, down; two RMSNorm weights
    assert body == layers * per_layer + d
    assert total == body + 2 * 32000 * d
    with torch.device("meta"):
        model = attnlab.build_model(name)
    assert sum(p.numel() for p in model.parameters()) == total
    assert not [n for n, _ in model.named_parameters() if n.endswith("bias")]
    assert model.lm_head is not None and model.lm_head.weight is not model.wte.weight  # untied
    g = model.geometry
    assert (g["depth"], g["num_heads"], g["num_kv_heads"], g["head_dim"], g["block_size"]) == (layers, heads, heads,
                                                                                                 64, 512)


def test_ladder_spans_10m_to_1b():
    sizes = sorted(body for _, _, _, _, body, _ in documented().values())
    assert any(9e6 <= s <= 12e6 for s in sizes) and 0.9e9 <= sizes[-1] <= 1.3e9


def _linears(model):
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


def test_wortsman_init_is_truncated_normal_with_variance_one_over_fan_in():
    torch.manual_seed(0)
    model = attnlab.build_model("ladder_d256", vocab_size=2000)
    for layer in _linears(model):
        w = layer.weight.detach().double()
        fan_in = w.shape[1]
        assert abs(w.var().item() * fan_in - 1) < 0.03, (layer, w.var().item() * fan_in)
        # JAX's truncated normal: cut at 2 standard deviations of the normal before its rescaling by 1/0.8796
        bound = 2 / math.sqrt(fan_in) / 0.87962566103423978
        assert w.abs().max().item() <= bound + 1e-7 and w.abs().max().item() > 0.97 * bound
    emb = model.wte.weight.detach().double()
    assert abs(emb.var().item() * 256 - 1) < 0.02 and emb.abs().max().item() > 4 / math.sqrt(256)  # a plain normal
    norms = [p.detach() for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(float(p.min()) == 1.0 == float(p.max()) for p in norms)


def test_llama_init_is_normal_0_02_and_bad_init_is_refused():
    torch.manual_seed(0)
    model = attnlab.build_model("ladder_d256", vocab_size=2000, init="llama")
    for w in [layer.weight for layer in _linears(model)] + [model.wte.weight]:
        assert abs(w.detach().double().std().item() / 0.02 - 1) < 0.03
    with pytest.raises(ConfigError, match="wortsman, llama"):
        attnlab.build_model("ladder_d128", init="xavier")


def test_a_rung_trains_and_takes_the_spec_terms():
    torch.manual_seed(0)
    model = attnlab.build_model("ladder_d128", vocab_size=300, attn="qknorm")
    tokens = torch.randint(0, 300, (2, 33))
    logits = model(tokens[:, :-1])
    loss = nn.functional.cross_entropy(logits.reshape(-1, 300), tokens[:, 1:].reshape(-1))
    loss.backward()
    assert logits.shape == (2, 32, 300) and torch.isfinite(loss)
    assert abs(loss.item() - math.log(300)) < 1.5  # near uniform at initialisation
