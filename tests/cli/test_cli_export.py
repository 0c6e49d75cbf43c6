"""attnlab export: a sigma run's weights folded into a plain model that gives the same outputs."""

import dataclasses

import torch
from safetensors.torch import load_file

import attnlab
from attnlab.cli import main
from attnlab.train import RECIPES, load_run, train


def test_export_folds_sigma_into_plain_weights(tmp_path, capsys):
    result = train(dataclasses.replace(RECIPES["demo"], attn="ns+sigma", epochs=1, runs_dir=str(tmp_path),
                                       progress=False))
    run = tmp_path / result["name"]
    out = tmp_path / "folded.safetensors"
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "attn='ns'" in capsys.readouterr().out
    trained, _ = load_run(run)
    plain = attnlab.build_model("vit_digits", attn="ns").eval()
    plain.load_state_dict(load_file(out), strict=True)
    x = torch.randn(8, 1, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(plain(x), trained(x), rtol=1e-5, atol=1e-5)
    assert main(["export", str(tmp_path / "missing")]) == 2
