"""attnlab analyze end to end on a tiny trained digits run with the DnA paper's instruments and the curves."""

import json
import math

import pytest
import torch

from attnlab.cli import main
from attnlab.train import RECIPES, train


@pytest.mark.slow
def test_analyze_trained_dna_run(tmp_path, capsys):
    cfg = RECIPES["demo"].replace(epochs=2, attn="dna", runs_dir=str(tmp_path / "runs"), progress=False)
    run = tmp_path / "runs" / train(cfg)["name"]
    out = tmp_path / "out"
    assert main(["analyze", str(run), "--what", "redundancy,entropy,robustness,relevance,curves", "--images", "16",
                 "--batch-size", "8", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    # entropy does not apply to DnA: one line says so, and the other instruments ran
    assert [line for line in captured.err.splitlines() if "does not apply" in line] == [
        line for line in captured.err.splitlines() if line.startswith(f"{run.name}: entropy does not apply")]
    data = json.loads((out / "analysis.json").read_text())
    result = data[run.name]
    assert set(result["skipped"]) == {"entropy"}
    assert 0 <= result["summary"]["head_distance_pos"] <= 1 and 0 <= result["summary"]["head_distance_neg"] <= 1
    assert len(result["redundancy"]) == 2 and len(result["robustness"]["clean"]) == 2
    assert all(math.isfinite(r["psnr"]) and "top1_drop" in r for r in result["robustness"]["noisy"])
    assert set(result["relevance"]["maps"]) == {"pos", "neg"}
    assert data["curves"]["dna"]["epochs"] == [1, 2] and data["curves"]["dna"]["runs"] == 1
    for name in ("redundancy.png", "robustness.png", "relevance.png", "curves.png"):
        assert (out / name).stat().st_size > 1000, name


def test_instruments_see_vitdet_blocks_with_relative_positions_and_the_jacobian_refuses_them():
    """ViTDet's relative positions go through the attention module's forward (a position bias), so the instruments
    measure those blocks, bias included (the measures move when the tables do); the Jacobian, which would hold a
    bias computed from the queries fixed, refuses in one line."""
    import attnlab
    from attnlab.analysis.instruments import analyze_model
    from attnlab.analysis.jacobian import jacobian_conditioning
    from attnlab.errors import UnsupportedModelError

    images = torch.rand(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    geo = dict(num_classes=3, global_blocks=(1,), backbone_options=dict(embed_dim=24, depth=2, num_heads=2))
    torch.manual_seed(0)
    model = attnlab.build_model("vitdet_tiny", attn="dna", rel_pos=True, **geo).eval()
    flat = analyze_model(model, images, ["branches", "redundancy"], skip_unsupported=False)
    assert "skipped" not in flat and flat["summary"]
    with torch.no_grad():  # tables start at zero; give the relative positions weight
        for name, p in model.named_parameters():
            if "rel_pos" in name:
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(1))
    moved = analyze_model(model, images, ["branches", "redundancy"], skip_unsupported=False)
    assert moved["summary"] != flat["summary"]
    standard = attnlab.build_model("vitdet_tiny", attn="standard", rel_pos=True, **geo).eval()
    with pytest.raises(UnsupportedModelError, match="position bias computed from its queries") as err:
        jacobian_conditioning(standard.backbone.trunk, images)
    assert "\n" not in str(err.value)
