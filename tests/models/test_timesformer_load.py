"""``load_timesformer``: a checkpoint written here in the layout of the authors' released TimeSformer models (a
``torch.save`` of epoch / model_state / optimizer_state / cfg, every parameter named ``model.<name>``), read without
running code, by meaning; the DnA authors' video layout (qkv + q_neg + v_neg + neg_scalers) into a ``dna`` model."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

import attnlab
from attnlab.errors import ConfigError
from attnlab.models import load_timesformer
from tests.reference_video import timesformer_logits

D, HEADS, DEPTH, C, P, IMG = 16, 2, 2, 2, 4, 8
N = (IMG // P) ** 2


def _authors_state(frames: int, classes: int, dna: bool = False, seed: int = 0) -> dict[str, torch.Tensor]:
    """Every parameter of their divided-space-time VisionTransformer, by their names, drawn at random."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.3  # noqa: E731
    state = {"cls_token": r(1, 1, D), "pos_embed": r(1, N + 1, D), "time_embed": r(1, frames, D),
             "patch_embed.proj.weight": r(D, C, P, P), "patch_embed.proj.bias": r(D),
             "norm.weight": 1 + r(D), "norm.bias": r(D), "head.weight": r(classes, D), "head.bias": r(classes)}
    for i in range(DEPTH):
        b = f"blocks.{i}."
        for norm in ("norm1", "temporal_norm1", "norm2"):
            state[f"{b}{norm}.weight"], state[f"{b}{norm}.bias"] = 1 + r(D), r(D)
        for attn in ("attn", "temporal_attn"):
            state[f"{b}{attn}.qkv.weight"], state[f"{b}{attn}.qkv.bias"] = r(3 * D, D), r(3 * D)
            state[f"{b}{attn}.proj.weight"], state[f"{b}{attn}.proj.bias"] = r(D, D), r(D)
            if dna:
                for neg in ("q_neg", "v_neg"):
                    state[f"{b}{attn}.{neg}.weight"], state[f"{b}{attn}.{neg}.bias"] = r(D, D), r(D)
                state[f"{b}{attn}.neg_scalers"] = torch.full((HEADS,), 0.5) + r(HEADS)
        state[f"{b}temporal_fc.weight"], state[f"{b}temporal_fc.bias"] = r(D, D), r(D)
        state[f"{b}mlp.fc1.weight"], state[f"{b}mlp.fc1.bias"] = r(2 * D, D), r(2 * D)
        state[f"{b}mlp.fc2.weight"], state[f"{b}mlp.fc2.bias"] = r(D, 2 * D), r(D)
    return state


def _pyth(path, state):
    """Their checkpoint file: SlowFast's save_checkpoint, the wrapper's ``model.`` prefix on every name."""
    torch.save({"epoch": 15, "model_state": {f"model.{k}": v for k, v in state.items()},
                "optimizer_state": {"state": {0: {"momentum_buffer": torch.zeros(3)}}, "param_groups": [{"lr": 0.005}]},
                "cfg": "TRAIN:\n  BATCH_SIZE: 8\n"}, path)
    return path


def _model(frames=3, classes=5, attn="standard", **kw):
    return attnlab.build_model("timesformer_tiny", num_classes=classes, attn=attn, img_size=IMG, patch_size=P,
                               in_chans=C, embed_dim=D, depth=DEPTH, num_heads=HEADS, num_frames=frames, **kw)


def test_released_layout_loads_by_name_and_computes_their_forward(tmp_path):
    state = _authors_state(frames=3, classes=5)
    model = load_timesformer(_model().double(), _pyth(tmp_path / "TimeSformer_divST.pyth", state)).eval()
    assert torch.equal(model.blocks[1].temporal_fc.weight.float(), state["blocks.1.temporal_fc.weight"])
    clip = torch.randn(C, 3, IMG, IMG, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    params = {k: v.double().numpy() for k, v in state.items()}
    want = timesformer_logits(clip.numpy(), params, heads=HEADS, depth=DEPTH, patch=P, attention_type="divided")
    with torch.no_grad():
        torch.testing.assert_close(model(clip[None])[0], torch.tensor(np.asarray(want)), rtol=1e-6, atol=1e-6)


def test_other_frame_count_and_head_size(tmp_path):
    state = _authors_state(frames=6, classes=400)
    model = _model(frames=3, classes=5)
    head = model.head.weight.clone()
    load_timesformer(model, _pyth(tmp_path / "k400.pyth", state))
    assert torch.equal(model.time_embed, state["time_embed"][:, ::2])  # nearest of 6 -> 3: frames 0, 2, 4
    assert torch.equal(model.head.weight, head)  # 400 Kinetics classes -> a fresh head for 5
    assert torch.equal(model.blocks[0].attn.qkv.weight, state["blocks.0.attn.qkv.weight"])


def test_dna_authors_video_layout(tmp_path):
    state = _authors_state(frames=3, classes=5, dna=True)
    model = load_timesformer(_model(attn="dna"), _pyth(tmp_path / "dna.pyth", state))
    attn = model.blocks[1].temporal_attn
    pre = "blocks.1.temporal_attn."
    assert torch.equal(attn.projection("q_pos")[0], state[pre + "qkv.weight"][:D])
    assert torch.equal(attn.projection("k")[0], state[pre + "qkv.weight"][D:2 * D])
    assert torch.equal(attn.projection("q_neg")[0], state[pre + "q_neg.weight"])
    assert torch.equal(attn.projection("v_neg")[1], state[pre + "v_neg.bias"])
    assert torch.equal(attn.branch_coefficients()[1], state[pre + "neg_scalers"])
    with pytest.raises(ConfigError, match="attn='dna'"):  # build_model reads the file before converting
        _model(pretrained_file=tmp_path / "dna.pyth")


def test_pretrained_file_takes_a_video_checkpoint_too(tmp_path):
    state = _authors_state(frames=3, classes=5)
    model = _model(pretrained_file=_pyth(tmp_path / "ts.pyth", state))
    assert torch.equal(model.blocks[0].temporal_attn.proj.weight, state["blocks.0.temporal_attn.proj.weight"])


def test_mismatches_and_hostile_files_are_one_line_errors(tmp_path):
    state = _authors_state(frames=3, classes=5)
    with pytest.raises(ConfigError, match="divided space-time"):
        load_timesformer(_model(attention="joint"), state)
    wider = dict(state, **{"blocks.0.mlp.fc1.weight": torch.zeros(3 * D, D)})
    with pytest.raises(ConfigError, match="blocks.0.mlp.fc1.weight"):
        load_timesformer(_model(), wider)

    class Payload:
        def __reduce__(self):
            return (print, ("ran code",))

    with open(tmp_path / "evil.pyth", "wb") as f:
        pickle.dump({"model_state": Payload()}, f, protocol=2)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_timesformer(_model(), tmp_path / "evil.pyth")
