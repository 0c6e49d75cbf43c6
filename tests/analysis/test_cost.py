"""Parameter and operation counts: exact counts from the architecture's formula, and the DnA paper's Table 12."""

import pytest

from attnlab.analysis.cost import format_costs, variant_costs

# ViT-B/16: 12 blocks, dim 768, qkv with bias; every extra projection block is a 768x768 weight + 768 bias
DIM, DEPTH, HEADS = 768, 12, 12
VIT_B_STANDARD = 86_567_656  # timm's vit_base_patch16_224 (1000 classes)


def _extra(blocks):  # extra projection blocks per layer + one alpha per head
    return DEPTH * (blocks * (DIM * DIM + DIM) + HEADS)


def test_vit_b_parameters_and_operations_match_the_paper():
    rows = variant_costs("vit_base_patch16_224", ["standard", "dna", "dna(variant=q)", "dna(variant=v)",
                                                  "dna(variant=shared)", "dna(variant=sum)"])
    params = {r["variant"]: r["params"] for r in rows}
    assert params == {"standard": VIT_B_STANDARD, "dna": VIT_B_STANDARD + _extra(2),
                      "dna(variant=q)": VIT_B_STANDARD + _extra(1), "dna(variant=v)": VIT_B_STANDARD + _extra(1),
                      "dna(variant=shared)": VIT_B_STANDARD + DEPTH * HEADS, "dna(variant=sum)": VIT_B_STANDARD}
    # the paper's Table 12 (millions, one decimal): 86.6, 93.6 (ours 93.65), 100.7
    for spec, paper in (("standard", 86.6), ("dna", 100.7), ("dna(variant=q)", 93.6), ("dna(variant=v)", 93.6)):
        assert abs(params[spec] / 1e6 - paper) / paper < 1e-3
    gmacs = {r["variant"]: r for r in rows}
    # the paper's "GFLOPs" are multiply-adds: 17.6 standard, 21.1 Q±V±, 19.3 Q±V and QV±, 17.6 Â± (within 2%)
    assert abs(gmacs["standard"]["gmacs"] / 17.6 - 1) < 0.02
    assert abs(gmacs["dna"]["gmacs"] / 21.1 - 1) < 0.02
    for spec in ("dna(variant=q)", "dna(variant=v)"):
        assert abs(gmacs[spec]["gmacs_explicit"] / 19.3 - 1) < 0.02
    assert abs(gmacs["dna(variant=shared)"]["gmacs_explicit"] / 17.6 - 1) < 0.02
    assert gmacs["dna"]["gflops"] == pytest.approx(2 * gmacs["dna"]["gmacs"])
    # the extra work of Q±V± worked out by hand: 2 projections of 197 tokens + one more attention core (QK^T, PV)
    N = 197
    extra = DEPTH * (2 * N * DIM * DIM + 2 * N * N * DIM)
    assert (gmacs["dna"]["gmacs"] - gmacs["standard"]["gmacs"]) * 1e9 == pytest.approx(extra, rel=1e-9)
    assert gmacs["dna"]["gmacs_ratio"] == pytest.approx(21.07 / 17.56, abs=0.01)
    assert "| dna |" in format_costs(rows)


def test_language_model_operations_are_counted_on_token_ids():
    """gpt_tiny (N=256 positions, L=4 blocks, d=128, vocab V=256) on one full block of tokens, by hand: per token
    12 L d^2 (qkv 3d^2, projection d^2, MLP 8d^2) and the tied head V d; per layer QK^T and PV, 2 N^2 d."""
    N, L, d, V = 256, 4, 128, 256
    (row,) = variant_costs("gpt_tiny", ["standard"])
    assert row["gmacs"] * 1e9 == pytest.approx(N * (12 * L * d * d + V * d) + L * 2 * N * N * d, rel=1e-9)
