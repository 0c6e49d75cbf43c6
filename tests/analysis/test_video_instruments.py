"""Instruments on TimeSformer report the spatial and the temporal attentions apart (the groups the model declares)
as well as together; the per-group means are those of the layers named in the detail."""

from __future__ import annotations

import pytest
import torch

import attnlab
from attnlab.analysis.instruments import analyze_model


def test_spatial_and_temporal_summaries():
    torch.manual_seed(0)
    model = attnlab.build_model("timesformer_tiny", attn="dna").eval()
    clips = torch.randn(4, 1, 8, 16, 16, generator=torch.Generator().manual_seed(1))
    out = analyze_model(model, clips, ["spectra", "branches"])
    s = out["summary"]
    blocks = out["spectra"]["blocks"]
    spatial = [b["p1"] for b in blocks if b["layer"].endswith(".attn")]
    temporal = [b["p1"] for b in blocks if b["layer"].endswith(".temporal_attn")]
    assert len(spatial) == len(temporal) == 2
    assert s["p1_spatial"] == pytest.approx(sum(spatial) / 2) and s["p1_temporal"] == pytest.approx(sum(temporal) / 2)
    assert s["p1"] == pytest.approx((s["p1_spatial"] + s["p1_temporal"]) / 2)  # two of each: the overall mean
    for key in ("branch_cosine_mean", "value_similarity_mean", "intruders_mean"):  # pooled over unequal counts
        assert all(torch.isfinite(torch.tensor(s[f"{key}_{g}"])) for g in ("spatial", "temporal"))
    image = analyze_model(attnlab.build_model("vit_digits").eval(), torch.randn(4, 1, 8, 8), ["spectra"])
    assert not any(k.endswith(("_spatial", "_temporal")) for k in image["summary"])
