"""attnlab export: a sigma run's weights folded into a plain model that gives the same outputs."""

import os
import stat

import torch
from safetensors.torch import load_file

import attnlab
from attnlab.cli import main
from attnlab.train import RECIPES, load_run, train


def test_export_folds_sigma_into_plain_weights(tmp_path, capsys):
    result = train(RECIPES["demo"].replace(attn="ns+sigma", epochs=1, runs_dir=str(tmp_path),
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


def test_export_follows_the_umask_and_keeps_the_runs_files(tmp_path, capsys):
    """Files follow the umask, as README says (safetensors' own writer made them 0600); an --out inside the run
    may be a new name or an earlier export, never one of the run's files, also through a symlink."""
    result = train(RECIPES["demo"].replace(epochs=1, runs_dir=str(tmp_path), progress=False))
    run = tmp_path / result["name"]
    checkpoint = (run / "checkpoint.safetensors").read_bytes()
    files = sorted(p.name for p in run.iterdir())
    old = os.umask(0o027)
    try:
        assert main(["export", str(run)]) == 0
        assert main(["export", str(run)]) == 0  # the earlier export (RUN/folded.safetensors) is rewritten
    finally:
        os.umask(old)
    assert stat.S_IMODE((run / "folded.safetensors").stat().st_mode) == 0o640
    (tmp_path / "link.safetensors").symlink_to(run / "checkpoint.safetensors")
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(tmp_path / "link.safetensors")]) == 2
    assert "would replace the run's own checkpoint.safetensors" in capsys.readouterr().err
    assert (run / "checkpoint.safetensors").read_bytes() == checkpoint
    assert sorted(p.name for p in run.iterdir()) == sorted([*files, "folded.safetensors"])
