"""The probes' instruments (issue 47 item 6): relevance of each probe over the video tokens at every interaction
module (DnA paper Figures 4(b), 14; Chefer's eq. 5) and DnA's branch measures on the interaction modules, against
float64 loops (tests/reference_probe_relevance.py) on the authors' weight names."""

from __future__ import annotations

import numpy as np
import pytest
import timm
import torch

from attnlab.analysis.probe_dna import probe_branch_instruments
from attnlab.analysis.probe_relevance import plot_probe_relevance, probe_relevance, vlm_probe_relevance
from attnlab.errors import ConfigError, UnsupportedModelError
from attnlab.models.llama import Llama
from attnlab.models.viscop import VisCoPEncoder
from attnlab.models.viscop_weights import probes_to_attnlab
from attnlab.models.vlm import VisionLanguageModel
from tests import reference_probe_relevance as rp
from tests import reference_vlm as ref
from tests.models.test_viscop import CHANS, DEPTH, DIM, HEADS, KINDS, PATCH, PROBES, clips, ours, their_weights, \
    write_navit

BRANCHES = {"standard": ("attn",), "dna": ("neg", "pos")}


def _navit(attn, layers, tmp_path, seed=0):
    module_layers = list(range(DEPTH)) if layers == "all" else layers
    W = their_weights(attn, len(module_layers), seed=seed)
    if attn == "dna":  # one head adds its softmin branch: the relevance's sign follows alpha_h (c_h M_h)
        W["encoder.interaction_modules.0.neg_scalers"][0] = -0.7
    write_navit(W, tmp_path / "navit")
    return ours(W, attn, layers, tmp_path), W, module_layers


def _grid_of(frames, m):
    """Per real frame, the (row, column) of each key token: VideoLLaMA3's merge-block layout (the reference's)."""
    return [ref.frame_patches(f, PATCH, m)[1:] for f in frames]


def _norm_score(P):
    return P.norm(dim=-1).sum()


@pytest.mark.parametrize("layers", ["all", [0, 2]])
@pytest.mark.parametrize("attn", ["standard", "dna"])
def test_probe_relevance_equals_the_float64_loops_on_the_frames_grids(attn, layers, tmp_path):
    """Per module, probe and branch: (1/H) sum_h ReLU(dy/dM_h) M_h over the clip's real tokens (padded frames 0),
    y = sum_p ||P_p||; the maps put token j of frame t at its (row, column) of the patch grid (merge-block order
    undone)."""
    vision, W, module_layers = _navit(attn, layers, tmp_path)
    x, num_frames = clips()
    r = probe_relevance(vision, x, num_frames, merge_size=2)
    assert sorted(r.maps) == list(BRANCHES[attn]) and r.layers == tuple(module_layers)
    assert r.maps[BRANCHES[attn][0]].shape == (2, len(module_layers), PROBES, 3, 2, 4)
    for b in range(2):
        frames = x[b, :num_frames[b]].numpy()
        hidden, _ = ref.navit(frames, W, depth=DEPTH, H=HEADS, p=PATCH, m=2)
        keys = [np.concatenate(h) for h in hidden]
        maps, grads, P = rp.probe_maps(keys, W, layers=module_layers, kind=KINDS[attn], H=HEADS, score=_norm_score)
        assert abs(float(r.scores[b]) - float(_norm_score(P))) < 1e-9
        positions = _grid_of(frames, 2)
        N = len(positions[0][0])
        for branch in BRANCHES[attn]:
            want = rp.relevance(maps[branch], grads[branch])
            got_tokens, got_maps = r.tokens[branch][b], r.maps[branch][b]
            for li, w in enumerate(want):
                M = w.shape[1]
                np.testing.assert_allclose(got_tokens[li, :, :M].numpy(), w.numpy(), rtol=1e-9, atol=1e-12)
                assert not got_tokens[li, :, M:].any() and not got_maps[li, :, int(num_frames[b]):].any()
                for t, (rows, cols) in enumerate(positions):
                    np.testing.assert_allclose(got_maps[li, :, t, rows, cols].numpy(), w[:, t * N:(t + 1) * N].numpy(),
                                               rtol=1e-9, atol=1e-12)
            assert float(torch.stack(want).abs().sum()) > 0  # a test that sees nonzero relevance
        if attn == "dna":
            assert float(r.tokens["neg"][b, 0].min()) < 0 < float(r.tokens["neg"][b, 0].max())


def test_probe_relevance_on_a_timm_vit_keeps_the_class_token_apart():
    """A timm ViT's keys are [class token, raster patches] per frame: the tokens hold both, the maps the patches."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=DIM, depth=DEPTH,
                            num_heads=HEADS, num_classes=0).double().eval()
    vision = VisCoPEncoder(vit, num_probes=PROBES, layers=[1, 2], attn="dna", warm_start="none").double()
    W = their_weights("dna", 2, seed=3)
    vision.probes.load_state_dict(probes_to_attnlab({k: torch.from_numpy(v) for k, v in W.items()}, vision.probes))
    x, num_frames = clips(seed=4)
    x = torch.nn.functional.interpolate(x.flatten(0, 1), size=(16, 16)).view(2, 3, CHANS, 16, 16)
    r = probe_relevance(vision, x, num_frames)
    assert r.prefix == 1 and r.maps["pos"].shape == (2, 2, PROBES, 3, 2, 2)
    for b in range(2):
        with torch.no_grad():
            h, hidden = vit.norm_pre(vit._pos_embed(vit.patch_embed(x[b, :num_frames[b]]))), []
            for block in vit.blocks:
                h = block(h)
                hidden.append(h.reshape(-1, DIM).numpy())
        maps, grads, _ = rp.probe_maps(hidden, W, layers=[1, 2], kind=KINDS["dna"], H=HEADS, score=_norm_score)
        for branch in ("pos", "neg"):
            for li, w in enumerate(rp.relevance(maps[branch], grads[branch])):
                M = w.shape[1]
                np.testing.assert_allclose(r.tokens[branch][b, li, :, :M].numpy(), w.numpy(), rtol=1e-9, atol=1e-12)
                per_frame = w.view(PROBES, -1, 5)[:, :, 1:].reshape(PROBES, -1, 2, 2)
                np.testing.assert_allclose(r.maps[branch][b, li, :, :M // 5].numpy(), per_frame.numpy(), rtol=1e-9,
                                           atol=1e-12)


def test_vlm_relevance_explains_the_predicted_tokens_logit(tmp_path):
    """With the LLM, y is the logit of the argmax token at the last prompt position (the authors' lrp.py target)."""
    vision, W, module_layers = _navit("dna", [0, 2], tmp_path)
    torch.manual_seed(0)
    model = VisionLanguageModel(vision, Llama(vocab_size=40, embed_dim=32, depth=1).double(), image_token_id=38,
                                probe_token_id=39, frames_per_clip=3).double()
    x, num_frames = clips()
    tokens = torch.randint(0, 30, (2, 14))
    tokens[0, 1:7], tokens[1, 1:5] = 38, 38
    tokens[:, 8:8 + PROBES] = 39
    r = vlm_probe_relevance(model, tokens, x, num_frames)
    with torch.no_grad():
        visual, valid, _ = model.vision(x, num_frames, 2)
        logits = model(tokens, x, num_frames)
    assert r.targets.tolist() == logits[:, -1].argmax(-1).tolist()
    for b in range(2):
        def logit(P, b=b):  # the decoder on the prompt with the reference's final probes in place
            e = model.decoder.wte(tokens[b:b + 1]).clone()
            e[0, tokens[b] == 38] = model.projector(visual[b][valid[b]])
            e[0, tokens[b] == 39] = model.probe_projector(P)
            for block in model.decoder.blocks:
                e = block(e)
            return model.decoder.head(model.decoder.norm(e))[0, -1, int(r.targets[b])]
        frames = x[b, :num_frames[b]].numpy()
        hidden, _ = ref.navit(frames, W, depth=DEPTH, H=HEADS, p=PATCH, m=2)
        maps, grads, _ = rp.probe_maps([np.concatenate(h) for h in hidden], W, layers=module_layers,
                                       kind=KINDS["dna"], H=HEADS, score=logit)
        for branch in ("pos", "neg"):
            for li, w in enumerate(rp.relevance(maps[branch], grads[branch])):
                np.testing.assert_allclose(r.tokens[branch][b, li, :, :w.shape[1]].numpy(), w.numpy(), rtol=1e-8,
                                           atol=1e-12)


def test_dna_instruments_on_the_interaction_modules_equal_the_loops(tmp_path):
    """Intruder dimensions, C(V+, V-) over the clip's real tokens and the branch cosine per clip, module and head;
    alpha statistics per module (attnlab's alpha = the authors' neg_scalers)."""
    vision, W, module_layers = _navit("dna", "all", tmp_path, seed=5)
    x, num_frames = clips()
    result = probe_branch_instruments(vision, x, num_frames, merge_size=2, k=2, batch_size=1)
    assert result.layers == [f"interaction_modules.{i} (block {i})" for i in range(DEPTH)]
    for b in range(2):
        hidden, _ = ref.navit(x[b, :num_frames[b]].numpy(), W, depth=DEPTH, H=HEADS, p=PATCH, m=2)
        want = rp.branch_measures([np.concatenate(h) for h in hidden], W, layers=module_layers, H=HEADS, k=2)
        for li, per_head in enumerate(want):
            for h, (intruders, vsim, bcos) in enumerate(per_head):
                assert int(result.intruders[li][b, h]) == intruders
                assert abs(float(result.value_similarity[li][b, h]) - vsim) < 1e-9
                assert abs(float(result.branch_cosine[li][b, h]) - bcos) < 1e-9
    for li, a in enumerate(result.alpha):
        assert np.allclose(a["values"], W[f"encoder.interaction_modules.{li}.neg_scalers"], rtol=1e-12)


def test_the_figure_and_the_refusals(tmp_path):
    vision, _, _ = _navit("standard", [1], tmp_path)
    x, num_frames = clips()
    r = probe_relevance(vision, x, num_frames, merge_size=2)
    path = plot_probe_relevance(x, r, tmp_path / "probes.png", sample=1, probes=[0, 2])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ConfigError, match="probes are indices from 0 to 2"):
        plot_probe_relevance(x, r, tmp_path / "bad.png", probes=[3])
    with pytest.raises(UnsupportedModelError, match="attn='dna"):
        probe_branch_instruments(vision, x, num_frames, merge_size=2)
    with pytest.raises(ConfigError, match=r"clips \(B, T, C, H, W\)"):
        probe_relevance(vision, x[0], merge_size=2)
    with pytest.raises(ConfigError, match="one value per clip"):
        probe_relevance(vision, x, num_frames, merge_size=2, score=lambda v, ok, p: p.sum())
    with pytest.raises(UnsupportedModelError, match="no visual probes"):
        probe_relevance(vision.encoder, x)
