"""DnA's instruments: intruder dimensions, C(V+, V-), branch cosine and alpha statistics on inputs with known
answers, then end to end on DnA and diff models (ViT and Swin)."""

import math

import pytest
import torch

import attnlab
from attnlab.attention.base import Want
from attnlab.attention.mask import AttentionMask
from attnlab.analysis.dna import (alpha_stats, branch_cosine, branch_instruments, compare_branches,
                                  intruder_dimensions, value_similarity)
from attnlab.errors import UnsupportedModelError

# a fixed 3-block, 4-head geometry, independent of the demo preset's size
TINY_VIT = dict(embed_dim=64, depth=3, num_heads=4)


def _orthonormal(n, generator):
    q, _ = torch.linalg.qr(torch.randn(n, n, dtype=torch.float64, generator=generator))
    return q


def _matrix(cols, singular, generator):
    """cols: (N, r) orthonormal left vectors, singular: (r,) descending -> cols diag(s) W^T, W random orthonormal."""
    w = _orthonormal(cols.shape[1], generator)
    return cols @ torch.diag(singular) @ w.T


def test_intruders_orthogonal_identical_and_partial():
    g = torch.Generator().manual_seed(0)
    U = _orthonormal(40, g)
    s = torch.linspace(16, 1, 16, dtype=torch.float64)
    a = _matrix(U[:, :16], s, g)
    orth = _matrix(U[:, 16:32], s, g)           # column spaces orthogonal: every top-10 vector is an intruder
    same = a.clone()                            # identical: none
    # b shares a's top 4 left singular vectors; its next 6 are orthogonal to a's column space -> 6 intruders
    partial = _matrix(torch.cat([U[:, :4], U[:, 20:32]], dim=1), s, g)
    counts = intruder_dimensions(torch.stack([a, a, a]), torch.stack([orth, same, partial]), k=10,
                                 eps=math.cos(math.pi / 3))
    assert counts.tolist() == [10, 0, 6]
    # k is capped by the rank: D = 16 columns but k = 20 -> at most 16
    assert intruder_dimensions(a, orth, k=20).item() == 16


def test_intruder_threshold_at_sixty_degrees():
    """b's directions at 50 and 70 degrees from a's: with eps = cos(60 deg) only the 70-degree one intrudes."""
    e = torch.eye(4, dtype=torch.float64)
    a = torch.stack([e[0] * 2, e[1]], dim=1)  # (N=4, D=2): left vectors e0, e1
    t50, t70 = math.radians(50), math.radians(70)
    b = torch.stack([(math.cos(t50) * e[0] + math.sin(t50) * e[2]) * 2, math.cos(t70) * e[1] + math.sin(t70) * e[3]],
                    dim=1)
    assert intruder_dimensions(a, b, k=2).item() == 1


def test_value_similarity_and_branch_cosine_by_hand():
    v = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    assert value_similarity(v, v).item() == pytest.approx(1.0)
    assert value_similarity(v, -v).item() == pytest.approx(-1.0)
    w = torch.tensor([[2.0, -1.0], [4.0, -3.0]])  # <v, w> = 2 - 2 + 12 - 12 = 0
    assert value_similarity(v, w).item() == pytest.approx(0.0, abs=1e-12)
    u = torch.tensor([[1.0, 0.0], [0.0, 0.0]])   # <v, u> = 1, |v| = sqrt(30), |u| = 1
    assert branch_cosine(v, u).item() == pytest.approx(1 / math.sqrt(30))


def test_alpha_stats_by_hand():
    model = attnlab.build_model("vit_digits", **TINY_VIT, attn="dna")
    with torch.no_grad():
        model.blocks[1].attn.alpha.copy_(torch.tensor([1.0, 2.0, 3.0, 6.0]))
    stats = alpha_stats(model)
    assert [s["layer"] for s in stats] == [0, 1, 2]
    s = stats[1]
    assert (s["mean"], s["max"], s["min"]) == (3.0, 6.0, 1.0)
    assert s["sd"] == pytest.approx(math.sqrt(((2) ** 2 + 1 + 0 + 9) / 3))
    assert stats[0]["mean"] == pytest.approx(0.5) and stats[0]["sd"] == 0.0
    sums = alpha_stats(attnlab.build_model("vit_digits", **TINY_VIT, attn="dna(variant=sum)"))
    assert sums[0]["values"] == [1.0] * 4


def test_end_to_end_dna_versus_diff_vit(tmp_path):
    torch.manual_seed(0)
    images = torch.randn(6, 1, 8, 8)
    models = {"dna": attnlab.build_model("vit_digits", **TINY_VIT, attn="dna"),
              "diff": attnlab.build_model("vit_digits", **TINY_VIT, attn="diff")}
    result = branch_instruments(models["dna"], images, batch_size=4)
    assert len(result.layers) == 3
    for t in result.intruders:
        assert t.shape == (6, 4) and t.min() >= 0 and t.max() <= 10
    summary = compare_branches(models, images, out_dir=tmp_path, batch_size=4)
    # diff's two branches share V: C(V+, V-) is exactly 1
    assert summary["diff"]["value_similarity_mean"] == pytest.approx(1.0)
    assert summary["dna"]["value_similarity_mean"] < 0.9
    assert sum(summary["dna"]["intruders_hist"]) == 6 * 4 * 3
    d0 = models["diff"].blocks[0].attn  # diff reports its lambda: exp(lq1.lk1) - exp(lq2.lk2) + lambda_init(0)
    with torch.no_grad():
        lam = (math.exp(float((d0.lambda_q1 * d0.lambda_k1).sum())) - math.exp(float((d0.lambda_q2 * d0.lambda_k2).sum()))
               + 0.8 - 0.6)
    assert summary["diff"]["alpha_mean_per_layer"][0] == pytest.approx(lam, rel=1e-5)
    for name in ("intruders.png", "value_similarity.png", "branch_cosine.png", "alpha.png"):
        assert (tmp_path / name).stat().st_size > 0


def test_the_observed_branches_recombine_to_the_module_output_on_swin():
    """The branch outputs a shifted Swin block's forward reports, recombined with alpha, are what it put out."""
    torch.manual_seed(0)
    model = attnlab.build_model("swin_cifar", num_classes=10, attn="dna").eval()
    attn = model.layers[0].blocks[1].attn  # a shifted block: the window mask is passed as `mask`
    seen = {}

    def capture(module, args, kwargs, output):
        seen["x"], seen["mask"], seen["out"] = args[0], kwargs.get("mask"), output

    handles = [attn.register_forward_hook(capture, with_kwargs=True),
               attn.observe(Want(branches=True), lambda module, found: seen.update(found=found))]
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))
        for h in handles:
            h.remove()
        assert seen["mask"] is not None and seen["found"].mask.parts.window is not None
        o_pos, o_neg = seen["found"].branches
        o = o_pos + attn.alpha.view(-1, 1, 1) * o_neg
        torch.testing.assert_close(attn.finish(o, seen["found"].mask, seen["x"]), seen["out"])
    result = branch_instruments(model, torch.randn(1, 3, 32, 32))
    assert result.intruders[0].shape == (16, 3)  # 16 windows of 4x4 in stage 1


def test_no_two_branch_model_is_an_error():
    with pytest.raises(UnsupportedModelError, match="dna"):
        branch_instruments(attnlab.build_model("vit_digits", **TINY_VIT), torch.randn(1, 1, 8, 8))
