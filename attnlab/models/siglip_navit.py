"""VideoLLaMA3's vision encoder, SigLIP-NaViT (Zhang et al., "VideoLLaMA 3", arXiv:2501.13106), as VisCoP (Reilly et
al., arXiv:2510.13808) and the DnA paper's video LLM use it: a SigLIP ViT at any resolution.

    frame (C, H, W) --patch_embedding (conv p x p, stride p)--> h x w tokens, merge-block order (no position table)
    depth x block (pre-norm):  x = x + attn(LN1(x));   x = x + fc2(gelu_tanh(fc1(LN2(x))))
        attn: softmax self-attention over the h * w tokens of ONE frame, 2-D rotary q and k in every layer
    --post_layernorm--> tokens --merge (bilinear, h/m x w/m per frame, raster order)--> the LLM's visual tokens

Token order: VideoLLaMA3's processor cuts each frame into m x m blocks (m: the merge size) and lists the blocks in
raster order, the m x m patches of each block in raster order (:func:`attnlab.ops.rotary2d.grid_positions`);
attention does not depend on the order, the rotary angles and the final merge do. The merge interpolates bilinearly
(``align_corners=False``) from h x w to h/m x w/m, which is the mean of each block for m = 1, 2.

The attention of every block is attnlab's ``standard`` module (q, k, v fused in ``qkv``, the output projection
``proj``) with the shared :class:`~attnlab.ops.rotary2d.Rotary2D` as its ``rotary``, so a spec converts it or refuses
in one line. :func:`navit_from_hf` reads a checkpoint as Hugging Face writes it (``config.json`` and
``model.safetensors``, VideoLLaMA3's names: ``embeddings.patch_embedding``, ``encoder.layers.{i}.self_attn.q_proj``,
..., ``post_layernorm``).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from timm.layers import Mlp
from torch import nn

from ..attention.standard import StandardAttention
from ..errors import ConfigError
from ..ops.rotary2d import Rotary2D
from .hf_decoder import checkpoint_files, read_config
from .pretrained import load_strict, read_state_dict

#: the config.json model types of VideoLLaMA3's encoder and of VisCoP's copy of it
MODEL_TYPES = ("videollama3_vision_encoder", "viscop_vision_encoder")
ACTIVATIONS = {"gelu_pytorch_tanh": partial(nn.GELU, approximate="tanh"), "gelu": nn.GELU}


class NaViTBlock(nn.Module):
    """Pre-norm SigLIP block: rotary self-attention over one frame's tokens, then the GELU MLP."""

    def __init__(self, dim: int, num_heads: int, mlp_hidden: int, norm_eps: float, act: str, rotary: Rotary2D,
                 layer_index: int, num_layers: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = StandardAttention(dim, num_heads, qkv_bias=True, layer_index=layer_index, num_layers=num_layers)
        self.attn.rotary = rotary
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, hidden_features=mlp_hidden, act_layer=ACTIVATIONS[act])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class SigLIPNaViT(nn.Module):
    """SigLIP-NaViT (module docstring). Defaults: VideoLLaMA3's VL3-SigLIP-NaViT (SigLIP so400m, patch 14).

    Args:
        embed_dim, depth, num_heads, mlp_hidden: width, blocks, heads (head dim a multiple of 4), MLP width.
        patch_size, in_chans: the patch embedding's kernel and input channels.
        norm_eps: every LayerNorm's epsilon; act: ``gelu_pytorch_tanh`` (SigLIP's) or ``gelu``.
        rope_theta: the 2-D rotary base.
    """

    def __init__(self, embed_dim: int = 1152, depth: int = 27, num_heads: int = 16, mlp_hidden: int = 4304,
                 patch_size: int = 14, in_chans: int = 3, norm_eps: float = 1e-6, act: str = "gelu_pytorch_tanh",
                 rope_theta: float = 10000.0) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ConfigError(f"SigLIP-NaViT's activation is one of {', '.join(ACTIVATIONS)}, not {act!r}.")
        head_dim = embed_dim // num_heads
        if embed_dim % num_heads or head_dim % 4:
            raise ConfigError(f"SigLIP-NaViT needs embed_dim divisible by num_heads with a head dim that is a multiple "
                              f"of 4 (2-D rotary); got embed_dim={embed_dim}, num_heads={num_heads}.")
        self.embed_dim, self.depth, self.patch_size = embed_dim, depth, patch_size
        self.geometry = dict(embed_dim=embed_dim, depth=depth, num_heads=num_heads, mlp_hidden=mlp_hidden,
                             patch_size=patch_size, in_chans=in_chans, norm_eps=norm_eps, act=act,
                             rope_theta=float(rope_theta))
        self.patch_embedding = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)
        self.rotary = Rotary2D(head_dim, rope_theta)
        self.blocks = nn.ModuleList(NaViTBlock(embed_dim, num_heads, mlp_hidden, norm_eps, act, self.rotary, i, depth)
                                    for i in range(depth))
        self.post_layernorm = nn.LayerNorm(embed_dim, eps=norm_eps)

    def grid(self, frames: torch.Tensor, merge_size: int) -> tuple[int, int]:
        """(h, w) patches of frames (F, C, H, W); ConfigError unless the sides are multiples of patch x merge."""
        H, W = frames.shape[-2:]
        side = self.patch_size * merge_size
        if H % side or W % side:
            raise ConfigError(f"frames of {H}x{W} pixels do not split into {merge_size}x{merge_size} blocks of "
                              f"{self.patch_size}-pixel patches; resize them to multiples of {side} pixels.")
        return H // self.patch_size, W // self.patch_size

    def embed(self, frames: torch.Tensor, merge_size: int = 1) -> torch.Tensor:
        """Frames (F, C, H, W) -> patch tokens (F, h * w, dim) in merge-block order."""
        h, w = self.grid(frames, merge_size)
        m = merge_size
        x = self.patch_embedding(frames)  # (F, dim, h, w)
        x = x.view(x.shape[0], self.embed_dim, h // m, m, w // m, m).permute(0, 2, 4, 3, 5, 1)
        return x.reshape(x.shape[0], h * w, self.embed_dim)

    def encode(self, frames: torch.Tensor, merge_size: int = 1) -> tuple[list[torch.Tensor], torch.Tensor]:
        """Frames (F, C, H, W) -> (each block's raw output (F, h * w, dim), in order; the visual tokens
        (F, h/m * w/m, dim)): what the visual probes and the LLM read."""
        h, w = self.grid(frames, merge_size)
        self.rotary.set_grid(h, w, merge_size)
        x, hidden = self.embed(frames, merge_size), []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        return hidden, merge_tokens(self.post_layernorm(x), h, w, merge_size)

    def forward(self, frames: torch.Tensor, merge_size: int = 1) -> torch.Tensor:
        """Frames (F, C, H, W) -> visual tokens (F, h/m * w/m, dim), raster order."""
        return self.encode(frames, merge_size)[1]


def merge_tokens(x: torch.Tensor, h: int, w: int, merge_size: int) -> torch.Tensor:
    """Tokens (F, h * w, dim) in merge-block order -> (F, h/m * w/m, dim) in raster order: the grid bilinearly
    resized to h/m x w/m (``align_corners=False``, VideoLLaMA3's; the block mean for m = 1, 2)."""
    m, (F_, _, dim) = merge_size, x.shape
    grid = x.view(F_, h // m, w // m, m, m, dim).permute(0, 5, 1, 3, 2, 4).reshape(F_, dim, h, w)
    if m > 1:
        grid = F.interpolate(grid, size=(h // m, w // m), mode="bilinear")
    return grid.flatten(2).transpose(1, 2)


# ---- Hugging Face checkpoints ---------------------------------------------------------------------------------------
#: per layer: VideoLLaMA3's name -> attnlab's (q, k, v are fused into ``attn.qkv``)
_LAYER = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj", "mlp.fc1": "mlp.fc1",
          "mlp.fc2": "mlp.fc2"}
#: where a full VideoLLaMA3 / VisCoP checkpoint keeps the encoder
_PREFIXES = ("model.vision_encoder.vision_encoder.", "model.vision_encoder.", "vision_encoder.")


def navit_geometry(config: Mapping, source: str) -> dict:
    """:class:`SigLIPNaViT`'s keyword arguments for a config.json; ConfigError (one line) for what does not fit."""
    if config.get("model_type") not in MODEL_TYPES:
        raise ConfigError(f"{source} is a {config.get('model_type')!r} model; attnlab reads SigLIP-NaViT configs of "
                          f"model_type {' or '.join(MODEL_TYPES)}.")
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "patch_size")
    missing = [k for k in keys if not isinstance(config.get(k), int) or isinstance(config.get(k), bool)]
    if missing:
        raise ConfigError(f"{source}'s config.json has no integer {', '.join(missing)}; give the config.json "
                          f"save_pretrained wrote.")
    act = config.get("hidden_act", "gelu_pytorch_tanh")
    if act not in ACTIVATIONS:
        raise ConfigError(f"{source} uses hidden_act {act!r}; attnlab's SigLIP-NaViT computes "
                          f"{' or '.join(ACTIVATIONS)}.")
    return dict(embed_dim=config["hidden_size"], depth=config["num_hidden_layers"],
                num_heads=config["num_attention_heads"], mlp_hidden=config["intermediate_size"],
                patch_size=config["patch_size"], in_chans=config.get("num_channels", 3),
                norm_eps=float(config.get("layer_norm_eps", 1e-6)), act=act)


def navit_to_attnlab(state: Mapping[str, torch.Tensor], depth: int, source: str) -> dict[str, torch.Tensor]:
    """A VideoLLaMA3 encoder state dict under attnlab's names; ConfigError naming a key with no place."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[int, str, str], torch.Tensor] = {}
    for key, tensor in state.items():
        key = next((key.removeprefix(p) for p in _PREFIXES if key.startswith(p)), key)
        if key.startswith("embeddings.patch_embedding."):
            out[key.removeprefix("embeddings.")] = tensor
        elif key.startswith("post_layernorm."):
            out[key] = tensor
        elif key.startswith("encoder.layers."):
            _, _, index, rest = key.split(".", 3)
            name, _, part = rest.rpartition(".")
            if name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv[(int(index), part, name[-6])] = tensor
            elif name in _LAYER:
                out[f"blocks.{index}.{_LAYER[name]}.{part}"] = tensor
            else:
                raise ConfigError(f"{source} holds {key!r}, which attnlab's SigLIP-NaViT has no place for.")
        else:
            raise ConfigError(f"{source} holds {key!r}, which attnlab's SigLIP-NaViT has no place for; give a "
                              f"VideoLLaMA3 vision encoder checkpoint.")
    for i in range(depth):
        for part in ("weight", "bias"):
            pieces = [qkv.get((i, part, p)) for p in "qkv"]
            if all(t is not None for t in pieces):
                out[f"blocks.{i}.attn.qkv.{part}"] = torch.cat(pieces)
    return out


def navit_from_hf(path: str | Path, **overrides) -> SigLIPNaViT:
    """A :class:`SigLIPNaViT` of the checkpoint's geometry and weights (in their dtype), from a directory with
    ``config.json`` and ``model.safetensors`` (or the safetensors file with its config beside it)."""
    config, weights = read_config(path), checkpoint_files(path)[1]
    source = f"SigLIP-NaViT checkpoint {path}"
    geometry = {**navit_geometry(config, source), **overrides}
    model = SigLIPNaViT(**geometry)
    model.attnlab_model = "siglip_navit"
    state = read_state_dict(weights)
    model.to(next(t.dtype for t in state.values() if t.is_floating_point()))
    return load_strict(model, navit_to_attnlab(state, geometry["depth"], source), source)


__all__ = ["NaViTBlock", "SigLIPNaViT", "merge_tokens", "navit_from_hf", "navit_geometry", "navit_to_attnlab"]
