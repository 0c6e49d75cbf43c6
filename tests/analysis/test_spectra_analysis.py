"""head_output_spectra collects the right tensors and averages per matrix, then per block."""

import math

import pytest
import torch

import attnlab
from attnlab.analysis import head_output_spectra, plot_spectra


def _by_hand(o):
    """p1 and effective rank of each (N, D) head output via the SVD, float64, per matrix."""
    p1, er = [], []
    for mat in o.reshape(-1, *o.shape[-2:]).double():
        s2 = torch.linalg.svdvals(mat) ** 2
        p = torch.zeros(mat.shape[-1], dtype=torch.float64)
        p[: s2.numel()] = s2 / s2.sum()
        p1.append(p.max().item())
        er.append(math.exp(-sum(x * math.log(x) for x in p.tolist() if x > 0)))
    return p1, er


@pytest.mark.parametrize("name,attn", [("vit_digits", "standard"), ("vit_digits", "ns"), ("swin_cifar", "ns")])
def test_matches_svd_of_recorded_outputs(name, attn):
    torch.manual_seed(0)
    model = attnlab.build_model(name, attn=attn)
    shape = (3, 1, 8, 8) if name == "vit_digits" else (2, 3, 32, 32)
    images = torch.randn(7 if name == "vit_digits" else 2, *shape[1:])
    recorded = []
    handles = [m.head_transform.register_forward_hook(lambda mod, i, o: recorded.append(o.detach().clone()))
               for m in model.modules() if isinstance(m, attnlab.attention.base.AttnlabAttention)]
    result = head_output_spectra(model, images, batch_size=3)
    for h in handles:
        h.remove()
    n_layers = len(result.layers)
    batches = math.ceil(len(images) / 3)
    assert len(recorded) == n_layers * batches
    block_p1, block_er = [], []
    for layer in range(n_layers):
        outs = torch.cat([recorded[b * n_layers + layer] for b in range(batches)])
        p1, er = _by_hand(outs)
        block_p1.append(sum(p1) / len(p1))
        block_er.append(sum(er) / len(er))
        assert result.p1[layer].shape == outs.shape[:2]
    summary = result.summary()
    assert summary["p1"] == pytest.approx(sum(block_p1) / n_layers, rel=1e-6)
    assert summary["eff_rank"] == pytest.approx(sum(block_er) / n_layers, rel=1e-6)
    assert model.training  # mode restored after the eval-mode pass
    spectrum = torch.tensor(summary["mean_spectrum"])
    assert spectrum.sum().item() == pytest.approx(1.0) and torch.all(spectrum[:-1] >= spectrum[1:])


def test_ns_flattens_the_spectrum_of_the_same_weights():
    """NS-Attn's design goal (Section 3.4): lower p1, higher effective rank, on identical weights and inputs."""
    torch.manual_seed(0)
    std = attnlab.build_model("vit_digits", attn="standard")
    ns = attnlab.build_model("vit_digits", attn="ns")
    ns.load_state_dict(std.state_dict())
    images = torch.randn(16, 1, 8, 8)
    a, b = head_output_spectra(std, images).summary(), head_output_spectra(ns, images).summary()
    # the first block sees identical inputs, so its comparison is exact cause and effect
    assert b["blocks"][0]["p1"] < a["blocks"][0]["p1"]
    assert b["blocks"][0]["eff_rank"] > a["blocks"][0]["eff_rank"]


def test_plot_and_errors(tmp_path):
    model = attnlab.build_model("vit_digits")
    res = head_output_spectra(model, torch.randn(4, 1, 8, 8))
    path = plot_spectra({"standard": res, "flat": [1 / 16] * 16}, tmp_path / "spectra.png")
    assert path.stat().st_size > 1000
    with pytest.raises(attnlab.UnsupportedModelError):
        head_output_spectra(attnlab.build_model("vit_digits", attn=None), torch.randn(2, 1, 8, 8))
