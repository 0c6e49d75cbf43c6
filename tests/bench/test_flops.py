"""Training FLOPs per token (PaLM's 6N + 12 L T d_attn) against torch.utils.flop_counter.FlopCounterMode on one
forward and backward of tiny models, and the device peak table against real device names."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import attnlab
from attnlab.models.ladder import LADDER_PRESETS, count_parameters
from attnlab.ops.model_flops import lm_flops_per_token, mfu, model_flops_per_token, peak_bf16

B, T = 2, 24


def counted(model, vocab: int) -> int:
    """FlopCounterMode's total for one forward and backward of B x T tokens (the loss and embedding count 0)."""
    tokens = torch.randint(0, vocab, (B, T + 1))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1)).backward()
    return counter.get_total_flops()


# (preset, build options, geometry for the formula): GQA and a tied head; a ladder rung (untied, MHA); GPT-2's shape
CASES = [
    ("llama_tiny", {}, dict(depth=4, embed_dim=128, num_heads=4, head_dim=32, num_kv_heads=2, mlp_hidden=352,
                            vocab_size=256, mlp_matrices=3)),
    ("ladder_d128", {"vocab_size": 300}, dict(depth=2, embed_dim=128, num_heads=2, head_dim=64, num_kv_heads=2,
                                              mlp_hidden=352, vocab_size=300, mlp_matrices=3)),
    ("gpt_tiny", {}, dict(depth=4, embed_dim=128, num_heads=4, head_dim=32, num_kv_heads=4, mlp_hidden=512,
                          vocab_size=256, mlp_matrices=2)),
]


@pytest.mark.parametrize("name,options,geometry", CASES, ids=[c[0] for c in CASES])
def test_formula_is_what_flop_counter_counts_with_explicit_attention(name, options, geometry):
    torch.manual_seed(0)
    model = attnlab.build_model(name, attn="standard(backend=explicit)", **options)
    per_token = lm_flops_per_token(seq_len=T, **geometry)
    assert counted(model, geometry["vocab_size"]) == B * T * per_token
    assert model_flops_per_token(model, T) == per_token


def test_fused_sdpa_counts_its_recomputed_scores_too():
    """FlopCounterMode counts SDPA's backward as recomputing q k^T (5 products, not 4): 14 L T d_attn in place of the
    model FLOPs' 12; the formula counts model FLOPs, as MFU does."""
    torch.manual_seed(0)
    model = attnlab.build_model("llama_tiny", attn="standard(backend=sdpa)")
    g = CASES[0][2]
    per_token = lm_flops_per_token(seq_len=T, **g)
    recompute = 2 * g["depth"] * T * g["num_heads"] * g["head_dim"]
    assert counted(model, 256) == B * T * (per_token + recompute)


def test_six_n_for_the_ladder():
    """Without the attention term the count is 6 x (parameters without embeddings, norms out, + the head)."""
    for name, (kwargs, _) in LADDER_PRESETS.items():
        d, depth = kwargs["embed_dim"], kwargs["depth"]
        body, _ = count_parameters(d)
        matmul = body - depth * 2 * d - d + kwargs["vocab_size"] * d  # norms are no product; the head is one
        geometry = dict(depth=depth, embed_dim=d, num_heads=depth, head_dim=64, num_kv_heads=depth,
                        mlp_hidden=kwargs["mlp_hidden"], vocab_size=kwargs["vocab_size"])
        assert lm_flops_per_token(seq_len=0, **geometry) == 6 * matmul
        assert lm_flops_per_token(seq_len=512, **geometry) - 6 * matmul == 12 * depth * 512 * d
        with torch.device("meta"):
            assert model_flops_per_token(attnlab.build_model(name), 512) == lm_flops_per_token(seq_len=512,
                                                                                              **geometry)


@pytest.mark.parametrize("name,peak", [
    ("NVIDIA H100 80GB HBM3", 989.4e12), ("NVIDIA H100 PCIe", 756.5e12), ("NVIDIA H100 NVL", 835.5e12),
    ("NVIDIA H200", 989.4e12), ("NVIDIA H200 NVL", 835.5e12), ("NVIDIA GH200 480GB", 989.4e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-PCIE-40GB", 312e12), ("NVIDIA A100 80GB PCIe", 312e12),
    ("NVIDIA L40S", 362.05e12), ("NVIDIA L40", 181.05e12), ("NVIDIA L4", 121e12),
    ("AMD Instinct MI300X", 1307.4e12), ("NVIDIA GeForce GTX 1080", None), ("cpu", None)])
def test_peak_table(name, peak):
    assert peak_bf16(name) == peak


def test_mfu():
    assert mfu(1e5, 6e9, 989.4e12) == pytest.approx(1e5 * 6e9 / 989.4e12)
    assert mfu(1e5, 6e9, None) is None
