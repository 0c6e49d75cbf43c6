"""The video LLM family's model (SigLIP-NaViT, VisCoP probes with standard or DnA interaction modules, projectors,
the VisionLanguageModel) against the float64 loops of ``tests/reference_vlm.py`` on shared random weights in the
authors' names, which also tests the loaders (a tiny SigLIP-NaViT checkpoint as Hugging Face writes it; the
authors' VisCoP state dict). ``tests/models/test_viscop_public.py`` compares the same weights with the authors' own
code where ``$ATTNLAB_PUBLIC_CODE`` holds it."""

from __future__ import annotations

import json

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file

import attnlab
from attnlab.errors import ConfigError, SpecError
from attnlab.models.llama import Llama
from attnlab.models.probes import VisualProbes
from attnlab.models.siglip_navit import SigLIPNaViT, navit_from_hf
from attnlab.models.viscop import VisCoPEncoder
from attnlab.models.viscop_weights import load_viscop_authors, probes_to_attnlab
from attnlab.models.vlm import VisionLanguageModel
from tests import reference_vlm as ref

DIM, HEADS, DEPTH, MLP, PATCH, CHANS, PROBES = 16, 2, 3, 24, 4, 3, 3
KINDS = {"standard": "cross_attention", "dna": "cross_denoising_attention"}


def their_weights(kind: str, n_modules: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float64 weights of the authors' ViSCoP_VisionEncoderModel, by name; norms near 1, biases nonzero,
    DnA's neg_scalers per head away from their init 0.5 (a wrong sign or head order shows)."""
    rng = np.random.default_rng(seed)
    W = {"embeddings.patch_embedding.weight": rng.normal(0, 0.2, (DIM, CHANS, PATCH, PATCH)),
         "embeddings.patch_embedding.bias": rng.normal(0, 0.1, DIM),
         "post_layernorm.weight": rng.uniform(0.5, 1.5, DIM), "post_layernorm.bias": rng.normal(0, 0.1, DIM),
         "encoder.visual_probes": rng.normal(0, 0.5, (1, PROBES, DIM))}
    lin = {"q_proj": (DIM, DIM), "k_proj": (DIM, DIM), "v_proj": (DIM, DIM), "out_proj": (DIM, DIM)}
    for i in range(DEPTH):
        pre = f"encoder.layers.{i}"
        for n in ("layer_norm1", "layer_norm2"):
            W[f"{pre}.{n}.weight"], W[f"{pre}.{n}.bias"] = rng.uniform(0.5, 1.5, DIM), rng.normal(0, 0.1, DIM)
        for n, shape in {**{f"self_attn.{k}": s for k, s in lin.items()}, "mlp.fc1": (MLP, DIM),
                         "mlp.fc2": (DIM, MLP)}.items():
            W[f"{pre}.{n}.weight"], W[f"{pre}.{n}.bias"] = rng.normal(0, 0.3, shape), rng.normal(0, 0.1, shape[0])
    names = ["q_proj", "k_proj", "v_proj", "out_proj"] if kind == "standard" else \
        ["q_pos_proj", "q_neg_proj", "k_proj", "v_pos_proj", "v_neg_proj", "out_proj"]
    for k in range(n_modules):
        pre = f"encoder.interaction_modules.{k}"
        for n in names:
            W[f"{pre}.{n}.weight"], W[f"{pre}.{n}.bias"] = rng.normal(0, 0.4, (DIM, DIM)), rng.normal(0, 0.1, DIM)
        if kind == "dna":
            W[f"{pre}.neg_scalers"] = rng.uniform(0.2, 1.2, HEADS)
    return W


def write_navit(W: dict, path) -> None:
    """The encoder's part of ``W`` as Hugging Face writes VideoLLaMA3's encoder: config.json + model.safetensors."""
    path.mkdir()
    config = {"model_type": "videollama3_vision_encoder", "hidden_size": DIM, "intermediate_size": MLP,
              "num_hidden_layers": DEPTH, "num_attention_heads": HEADS, "num_channels": CHANS, "patch_size": PATCH,
              "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6}
    (path / "config.json").write_text(json.dumps(config))
    save_file({k: torch.from_numpy(v).contiguous() for k, v in W.items() if "interaction" not in k
               and "visual_probes" not in k}, str(path / "model.safetensors"))


def ours(W: dict, attn: str, layers, tmp_path) -> VisCoPEncoder:
    vision = VisCoPEncoder(navit_from_hf(tmp_path / "navit"), num_probes=PROBES, layers=layers, attn=attn,
                           warm_start="none")
    return load_viscop_authors(vision, {k: torch.from_numpy(v) for k, v in W.items()})


def clips(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Two clips of up to 3 frames of 8 x 16 pixels (a 2 x 4 patch grid: two 2 x 2 merge blocks side by side, so
    merge-block order is not raster order), the second with 2 real frames."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 3, CHANS, 8, 16, generator=g, dtype=torch.float64), torch.tensor([3, 2])


@pytest.mark.parametrize("layers", ["all", [0, 2]])
@pytest.mark.parametrize("attn", ["standard", "dna"])
def test_navit_and_probes_equal_the_float64_reference(attn, layers, tmp_path):
    """The whole probe encoder (patch embedding in merge-block order, 2-D rotary self-attention per frame, merge 2,
    probes over all real frames of a clip, replacing updates) equals the loops, from the authors' weight names."""
    module_layers = list(range(DEPTH)) if layers == "all" else layers
    W = their_weights(attn, len(module_layers))
    write_navit(W, tmp_path / "navit")
    vision = ours(W, attn, layers, tmp_path).eval()
    x, num_frames = clips()
    with torch.no_grad():
        visual, valid, probes = vision(x, num_frames, merge_size=2)
    assert visual.dtype == torch.float64 and valid.tolist() == [[True] * 6, [True] * 4 + [False] * 2]
    for b in range(2):
        frames = x[b, :num_frames[b]].numpy()
        hidden, tokens = ref.navit(frames, W, depth=DEPTH, H=HEADS, p=PATCH, m=2)
        np.testing.assert_allclose(visual[b][valid[b]].numpy(), np.concatenate(tokens), rtol=1e-9, atol=1e-10)
        keys = [np.concatenate(h) for h in hidden]
        want = ref.probes(keys, W, layers=module_layers, kind=KINDS[attn], H=HEADS)
        np.testing.assert_allclose(probes[b].numpy(), want, rtol=1e-9, atol=1e-10)


def test_the_probe_path_on_a_timm_vit_equals_the_reference():
    """Any timm ViT: the probes read each block's output over the clip's frames (prefix tokens included); given
    those hidden states, the DnA probe path equals the loops (the authors' sign, neg_scalers as alpha)."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=DIM, depth=DEPTH,
                            num_heads=HEADS, num_classes=0).double().eval()
    vision = VisCoPEncoder(vit, num_probes=PROBES, layers=[1, 2], attn="dna", warm_start="none").double().eval()
    W = their_weights("dna", 2, seed=3)
    vision.probes.load_state_dict(probes_to_attnlab({k: torch.from_numpy(v) for k, v in W.items()}, vision.probes))
    with torch.no_grad():
        x, num_frames = clips(seed=4)
        x = torch.nn.functional.interpolate(x.flatten(0, 1), size=(16, 16)).view(2, 3, CHANS, 16, 16)
        _, _, probes = vision(x, num_frames)
        for b in range(2):
            h, hidden = vit.norm_pre(vit._pos_embed(vit.patch_embed(x[b, :num_frames[b]]))), []
            for block in vit.blocks:
                h = block(h)
                hidden.append(h.reshape(-1, DIM).numpy())
            want = ref.probes(hidden, W, layers=[1, 2], kind="cross_denoising_attention", H=HEADS)
            np.testing.assert_allclose(probes[b].numpy(), want, rtol=1e-9, atol=1e-10)


@pytest.mark.parametrize("attn,neg", [("standard", None), ("dna", 1e-4), ("dna(neg_init=1e-2)", 1e-2),
                                      ("dna(neg_init=-1e-4)", -1e-4), ("dna(variant=q)", 1e-4)])
def test_the_warm_start_copies_each_blocks_self_attention_and_scales_the_negative_branch(attn, neg):
    """Module k <- the block it follows: Q(+), K, V(+), proj and biases; DnA's Q- = |neg_init| Q, V- = neg_init V
    (Table 13's scales by the term's neg_init); ``position`` is the authors' rule, module k <- block k."""
    torch.manual_seed(0)
    enc = SigLIPNaViT(embed_dim=DIM, depth=DEPTH, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH).double()
    for rule, sources in (("block", [1, 2]), ("position", [0, 1])):
        probes = VisCoPEncoder(enc, num_probes=PROBES, layers=[1, 2], attn=attn, warm_start=rule).probes
        for module, i in zip(probes.interaction_modules, sources):
            src = enc.blocks[i].attn
            q, k, v = src.qkv.weight.chunk(3)
            qb, kb, vb = src.qkv.bias.chunk(3)
            torch.testing.assert_close(module.proj.weight, src.proj.weight, rtol=0, atol=0)
            torch.testing.assert_close(module.proj.bias, src.proj.bias, rtol=0, atol=0)
            torch.testing.assert_close(module.q.weight[:DIM], q, rtol=0, atol=0)
            torch.testing.assert_close(module.q.bias[:DIM], qb, rtol=0, atol=0)
            torch.testing.assert_close(module.kv.weight[:2 * DIM], torch.cat([k, v]), rtol=0, atol=0)
            torch.testing.assert_close(module.kv.bias[:2 * DIM], torch.cat([kb, vb]), rtol=0, atol=0)
            if neg is None:
                assert module.q.weight.shape[0] == DIM and module.kv.weight.shape[0] == 2 * DIM
                continue
            torch.testing.assert_close(module.q.weight[DIM:], abs(neg) * q, rtol=1e-15, atol=0)
            torch.testing.assert_close(module.q.bias[DIM:], abs(neg) * qb, rtol=1e-15, atol=0)
            if "variant=q" in attn:  # a shared V: no V- to fill
                assert module.kv.weight.shape[0] == 2 * DIM
            else:
                torch.testing.assert_close(module.kv.weight[2 * DIM:], neg * v, rtol=1e-15, atol=0)
                torch.testing.assert_close(module.kv.bias[2 * DIM:], neg * vb, rtol=1e-15, atol=0)
            torch.testing.assert_close(module.alpha, torch.full((HEADS,), 0.5, dtype=torch.float64))


def test_a_converted_encoder_keeps_its_rotary_and_standard_changes_nothing():
    torch.manual_seed(0)
    enc = SigLIPNaViT(embed_dim=DIM, depth=DEPTH, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH).double().eval()
    x = torch.randn(3, CHANS, 16, 8, dtype=torch.float64)
    with torch.no_grad():
        want = enc(x, 2)
        attnlab.convert(enc, "standard")
        torch.testing.assert_close(enc(x, 2), want, rtol=0, atol=0)
        attnlab.convert(enc, "dna(init=copy)")
        assert all(b.attn.rotary is enc.rotary for b in enc.blocks)
        torch.testing.assert_close(enc(x, 2), want, rtol=1e-3, atol=1e-3)


def _hf_qwen2(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tests.hf_models import move_norms_and_biases

    torch.manual_seed(1)
    config = transformers.Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rope_theta=5000.0, tie_word_embeddings=False)
    hf = move_norms_and_biases(transformers.Qwen2ForCausalLM(config).double().eval())
    hf.save_pretrained(tmp_path / "qwen2")
    return hf


def test_the_vlm_on_a_hugging_face_qwen2_gives_transformers_logits(tmp_path, float64_rms_norm):
    """Text alone: the logits of transformers' Qwen2. With a clip: transformers' logits for the same embeddings with
    the placeholders replaced by the projected visual tokens and probes (in order, per sample)."""
    hf = _hf_qwen2(tmp_path)
    torch.manual_seed(2)
    enc = SigLIPNaViT(embed_dim=DIM, depth=DEPTH, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH).double()
    vision = VisCoPEncoder(enc, num_probes=PROBES, attn="dna(neg_init=1e-2)")
    model = VisionLanguageModel(vision, attnlab.models.llama_from_hf(tmp_path / "qwen2"), image_token_id=62,
                                probe_token_id=63, merge_size=2, frames_per_clip=3).eval()
    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, 60, (2, 20), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(model(text), hf(text).logits, rtol=1e-12, atol=1e-12)
    x, num_frames = clips()
    n = model.visual_token_count(1, 8, 16)
    tokens = torch.randint(0, 60, (2, 6 + 3 * n + PROBES), generator=g)
    tokens[0, 2:2 + 3 * n] = 62
    tokens[1, 2:2 + 2 * n] = 62
    tokens[:, -PROBES - 1:-1] = 63
    with torch.no_grad():
        logits = model(tokens, x, num_frames)
        visual, valid, probes = vision(x, num_frames, 2)
        embeds = hf.model.embed_tokens(tokens).clone()
        for b in range(2):
            embeds[b, tokens[b] == 62] = model.projector(visual[b][valid[b]])
            embeds[b, tokens[b] == 63] = model.probe_projector(probes[b])
        torch.testing.assert_close(logits, hf(inputs_embeds=embeds).logits, rtol=1e-12, atol=1e-12)
        assert not torch.allclose(logits, hf(tokens).logits)  # the placeholders were replaced


def test_the_projectors_are_mlp2x_gelu_and_the_probe_projector_starts_as_a_copy():
    torch.manual_seed(0)
    enc = SigLIPNaViT(embed_dim=DIM, depth=1, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH)
    model = VisionLanguageModel(VisCoPEncoder(enc, num_probes=2), Llama(vocab_size=40, embed_dim=32, depth=1),
                                image_token_id=38, probe_token_id=39)
    layers = [type(m).__name__ for m in model.projector.readout]
    assert layers == ["Linear", "GELU", "Linear"] and model.projector.readout[1].approximate == "none"
    for a, b in zip(model.projector.parameters(), model.probe_projector.parameters()):
        assert torch.equal(a, b) and a is not b
    assert not any(p.requires_grad for p in enc.parameters())
    assert all(p.requires_grad for p in model.vision.probes.parameters())
    model.train()
    assert not enc.training and model.vision.probes.training and model.decoder.training


@pytest.mark.parametrize("attn,words", [("ns", "one attention term"), ("diff", "no cross-attention form"),
                                        ("dna+sigma", "one attention term"), ("dna(variant=x)", "variant"),
                                        ("qknorm", "one attention term")])
def test_terms_without_a_cross_attention_form_are_refused_in_one_line(attn, words):
    with pytest.raises(SpecError, match=words) as err:
        VisualProbes(DIM, HEADS, DEPTH, attn=attn)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("layers", [[3], [0, 0], [], "x", [-1]])
def test_bad_probe_layers_are_refused(layers):
    with pytest.raises(ConfigError, match="probe layers"):
        VisualProbes(DIM, HEADS, DEPTH, layers=layers)


def test_a_prompt_whose_placeholders_do_not_fit_the_clip_is_refused(tmp_path):
    torch.manual_seed(0)
    enc = SigLIPNaViT(embed_dim=DIM, depth=1, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH).double()
    model = VisionLanguageModel(VisCoPEncoder(enc, num_probes=2), Llama(vocab_size=40, embed_dim=32, depth=1).double(),
                                image_token_id=38, probe_token_id=39, frames_per_clip=3).double()
    x, num_frames = clips()
    tokens = torch.zeros(2, 20, dtype=torch.long)
    tokens[:, :6] = 38
    tokens[:, 10:12] = 39
    with pytest.raises(ConfigError, match=r"\[6, 6\] placeholders .* for \[6, 4\] visual tokens"):
        model(tokens, x, num_frames)
    with pytest.raises(ConfigError, match="no clips were given"):
        model(tokens)
    with pytest.raises(ConfigError, match="passes no probes to the LLM"):
        VisionLanguageModel(model.vision, model.decoder, image_token_id=38, probe_token_id=39, use_probes=False,
                            frames_per_clip=3)(tokens, x, num_frames)
    with pytest.raises(ConfigError, match="block_size 8"):
        VisionLanguageModel(model.vision, Llama(vocab_size=40, embed_dim=32, depth=1, block_size=8).double(),
                            image_token_id=38, probe_token_id=39, frames_per_clip=3)(tokens, x, num_frames)
    with pytest.raises(ConfigError, match="frames_per_clip=2"):
        VisionLanguageModel(model.vision, model.decoder, image_token_id=38, probe_token_id=39,
                            frames_per_clip=2)(tokens, x, num_frames)
    with pytest.raises(ConfigError, match="multiples of 8 pixels"):
        enc(torch.zeros(1, CHANS, 12, 8, dtype=torch.float64), 2)


@pytest.mark.parametrize("change,words", [({"model_type": "siglip_vision_model"}, "model_type"),
                                          ({"hidden_act": "relu"}, "hidden_act"),
                                          ({"hidden_size": None}, "no integer hidden_size")])
def test_a_navit_config_that_does_not_fit_is_refused_in_one_line(change, words, tmp_path):
    W = their_weights("standard", 0)
    write_navit(W, tmp_path / "navit")
    config = json.loads((tmp_path / "navit" / "config.json").read_text())
    (tmp_path / "navit" / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(ConfigError, match=words) as err:
        navit_from_hf(tmp_path / "navit")
    assert "\n" not in str(err.value)


def test_a_navit_checkpoint_with_a_foreign_key_is_refused(tmp_path):
    W = their_weights("standard", 0)
    W["encoder.layers.0.self_attn.rel_pos.weight"] = np.zeros(3)
    write_navit(W, tmp_path / "navit")
    with pytest.raises(ConfigError, match="rel_pos"):
        navit_from_hf(tmp_path / "navit")


@pytest.mark.parametrize("spec", ["standard", "dna(variant=v)"])
def test_the_warm_start_reads_a_timm_vit_and_a_dna_converted_encoder(spec):
    """timm's fused qkv (thirds) and a DnA self-attention's positive branch (Q+, K, V+; a shared Q serves both)."""
    torch.manual_seed(0)
    vit = timm.create_model("vit_tiny_patch16_224", img_size=16, patch_size=8, embed_dim=DIM, depth=DEPTH,
                            num_heads=HEADS, num_classes=0)
    attnlab.convert(vit, spec)
    probes = VisCoPEncoder(vit, num_probes=PROBES, layers=[2], attn="standard").probes
    src = vit.blocks[2].attn
    q, k, v = src.qkv.weight.chunk(3) if spec == "standard" else (src.projection(n)[0] for n in ("q_pos", "k", "v_pos"))
    module = probes.interaction_modules[0]
    assert torch.equal(module.q.weight, q) and torch.equal(module.kv.weight, torch.cat([k, v]))
    assert torch.equal(module.proj.weight, src.proj.weight)


@pytest.mark.parametrize("visual,probes", [(True, True), (True, False), (False, True)])
def test_a_training_step_reaches_the_probes_projectors_and_decoder_but_not_the_frozen_encoder(visual, probes):
    """VisCoP trains the probes, their interaction modules, the projectors in use and the LLM; the encoder stays
    frozen. A prompt holds placeholders only for what the LLM receives."""
    torch.manual_seed(0)
    enc = SigLIPNaViT(embed_dim=DIM, depth=2, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH)
    model = VisionLanguageModel(VisCoPEncoder(enc, num_probes=2, layers=[1], attn="dna"),
                                Llama(vocab_size=40, embed_dim=32, depth=1), image_token_id=38, probe_token_id=39,
                                use_visual_tokens=visual, use_probes=probes, frames_per_clip=3)
    x, num_frames = clips()
    tokens = torch.randint(0, 30, (2, 16))
    if visual:
        tokens[0, 1:7], tokens[1, 1:5] = 38, 38
    if probes:
        tokens[:, 10:12] = 39
    model(tokens, x.float(), num_frames).logsumexp(-1).mean().backward()
    assert all(p.grad is None for p in enc.parameters())
    for part, used in (("vision.probes", probes), ("projector", visual), ("probe_projector", probes),
                       ("decoder", True)):
        grads = [p.grad for n, p in model.named_parameters() if n.startswith(part + ".")]
        assert grads and all((g is not None and bool(g.abs().sum() > 0)) == used for g in grads), part


def test_gradient_checkpointing_gives_the_same_gradients():
    torch.manual_seed(0)
    enc = SigLIPNaViT(embed_dim=DIM, depth=2, num_heads=HEADS, mlp_hidden=MLP, patch_size=PATCH).double()
    model = VisionLanguageModel(VisCoPEncoder(enc, num_probes=2, attn="dna"),
                                Llama(vocab_size=40, embed_dim=32, depth=2).double(), image_token_id=38,
                                probe_token_id=39, frames_per_clip=3)
    x, num_frames = clips()
    tokens = torch.randint(0, 30, (2, 16))
    tokens[0, 1:7], tokens[1, 1:5], tokens[:, 10:12] = 38, 38, 39
    grads = []
    for on in (False, True):
        model.zero_grad()
        model.gradient_checkpointing = on
        model(tokens, x, num_frames).logsumexp(-1).mean().backward()
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    assert len(grads[0]) == len(grads[1]) > 0
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
