"""TimeSformer: a ViT for video with divided space-time attention (Bertasius, Wang and Torresani, "Is Space-Time
Attention All You Need for Video Understanding?", ICML 2021, arXiv 2102.05095, Sec. 3 and Fig. 1).

A clip x of shape (B, C, T, H, W) is cut into N = HW / P^2 patches per frame, embedded, and given a learned spatial
position e^pos_p (shared by the frames) and a learned time embedding e^time_t (patches only):

    z^0_(p,t) = E x_(p,t) + e^pos_p + e^time_t,          z^0_cls = w_cls + e^pos_0

Each divided block (``attention="divided"``, the paper's default) runs, with its own LayerNorms:

    temporal   a_(p,t) = z_(p,t) + W_tfc TA( LN(z_(p,.)) )_t     attention over the T frames of one patch position p,
                                                                 class token excluded; W_tfc (``temporal_fc``) zero
    spatial    s_(.,t) = SA( LN([z_cls ; a_(.,t)]) )             attention within frame t, with the class token
               z'_(p,t) = a_(p,t) + s_(p,t),  z'_cls = z_cls + mean_t s_(cls,t)
    MLP        z'' = z' + MLP(LN(z'))

``temporal_fc`` starts at zero, so a fresh block computes exactly the image model's block on every frame. ``joint``
runs one attention over all 1 + T*N tokens per block; ``space_only`` runs the image ViT on every frame and averages
the frames' tokens before the final norm. The class token's final state, after LayerNorm, goes to the linear head.

Both attentions of a block are timm ``Attention`` modules (``attn`` spatial, ``temporal_attn`` temporal), so
``attnlab.convert`` replaces both or one group (``only="spatial"`` / ``"temporal"``); parameter names are the authors'
(``timesformer/models/vit.py``). docs/methods.md (TimeSformer) gives the initialisation, where this module differs
from the authors' code, and how :func:`init_from_image` and :func:`load_timesformer` read weights.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Mapping

import torch
import torch.nn.functional as F
from timm.layers import Attention, DropPath, LayerNorm, Mlp, PatchEmbed, resample_abs_pos_embed, trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

from ..errors import ConfigError
from ..variants import VARIANTS
from .pretrained import dna_authors_state_dict, load_strict, read_state_dict

ATTENTIONS = ("divided", "joint", "space_only")
WEIGHT_INITS = ("trunc_normal", "xavier")
#: module-name globs of the two attentions of a divided block, for ``convert(model, spec, only=...)``
ATTENTION_GROUPS = {"spatial": "blocks.*.attn", "temporal": "blocks.*.temporal_attn"}


class DividedBlock(nn.Module):
    """One divided space-time block (module docstring): temporal attention, spatial attention, MLP, pre-norm; the
    arguments are timm's ViT ``Block``'s."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, qkv_bias: bool = True,
                 proj_drop: float = 0.0, attn_drop: float = 0.0, drop_path: float = 0.0,
                 norm_layer: type[nn.Module] = LayerNorm) -> None:
        super().__init__()
        attn = dict(num_heads=num_heads, qkv_bias=qkv_bias, attn_drop=attn_drop, proj_drop=proj_drop)
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, **attn)
        self.temporal_norm1 = norm_layer(dim)
        self.temporal_attn = Attention(dim, **attn)
        self.temporal_fc = nn.Linear(dim, dim)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = norm_layer(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), drop=proj_drop)

    def forward(self, x: torch.Tensor, num_frames: int) -> torch.Tensor:
        """x: (B, 1 + T*N, dim), the class token first, then the patches frame by frame."""
        B, L, D = x.shape
        T = num_frames
        N = (L - 1) // T
        cls, patches = x[:, :1], x[:, 1:]
        # temporal: the T tokens of one patch position form one sequence
        xt = patches.reshape(B, T, N, D).transpose(1, 2).reshape(B * N, T, D)
        res = self.temporal_attn(self.temporal_norm1(xt)).reshape(B, N, T, D).transpose(1, 2).reshape(B, T * N, D)
        patches = patches + self.drop_path(self.temporal_fc(res))
        # spatial: each frame with its own copy of the class token
        xs = torch.cat([cls.expand(B, T, D).reshape(B * T, 1, D), patches.reshape(B * T, N, D)], dim=1)
        res = self.attn(self.norm1(xs))
        res_cls = res[:, 0].reshape(B, T, D).mean(dim=1, keepdim=True)  # the frames' class tokens, averaged
        x = torch.cat([cls, patches], dim=1) + self.drop_path(torch.cat([res_cls, res[:, 1:].reshape(B, T * N, D)], 1))
        return x + self.drop_path(self.mlp(self.norm2(x)))


class TimeSformer(nn.Module):
    """TimeSformer (module docstring); input (B, C, T, H, W) as the authors' model, output (B, num_classes).

    Args:
        img_size, patch_size, in_chans, num_classes, embed_dim, depth, num_heads, mlp_ratio, qkv_bias: as timm's
            ``VisionTransformer`` (a class token is always used: the head reads it).
        num_frames: T the time embedding is learned for (a clip of other length gets it resampled, nearest).
        attention: ``divided`` (temporal then spatial attention per block), ``joint`` or ``space_only``.
        drop_rate, attn_drop_rate, drop_path_rate: dropout after the embeddings and in the MLPs, on attention
            weights, stochastic depth (rising linearly); norm_layer: LayerNorm (eps 1e-6, timm's and the authors').
        weight_init: the Linears' weights: ``trunc_normal`` (std 0.02, the authors' and timm's default) or
            ``xavier`` (timm's ``jax`` ViT init; ``timesformer_tiny``: std 0.02 at width 64 leaves attention over
            the frames uniform, blind to their order); ``temporal_fc`` starts at zero either way.
    """

    def __init__(self, img_size: int = 224, patch_size: int = 16, in_chans: int = 3, num_classes: int = 400,
                 embed_dim: int = 768, depth: int = 12, num_heads: int = 12, mlp_ratio: float = 4.0,
                 qkv_bias: bool = True, num_frames: int = 8, attention: str = "divided", drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, drop_path_rate: float = 0.1,
                 norm_layer: type[nn.Module] = LayerNorm, weight_init: str = "trunc_normal") -> None:
        super().__init__()
        if attention not in ATTENTIONS:
            raise ConfigError(f"attention={attention!r} is not a TimeSformer attention; use one of: "
                              f"{', '.join(ATTENTIONS)}.")
        if weight_init not in WEIGHT_INITS:
            raise ConfigError(f"weight_init={weight_init!r} is not valid; use one of: {', '.join(WEIGHT_INITS)}.")
        if num_frames < 1:
            raise ConfigError(f"num_frames={num_frames} is not valid; a clip has at least 1 frame.")
        self.attention, self.num_frames, self.num_classes, self.in_chans = attention, num_frames, num_classes, in_chans
        self.num_features = self.embed_dim = embed_dim
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, self.patch_embed.num_patches + 1, embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        if attention != "space_only":
            self.time_embed = nn.Parameter(torch.zeros(1, num_frames, embed_dim))
            self.time_drop = nn.Dropout(drop_rate)
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]  # timm's linear rise, meta-safe
        block = dict(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=drop_rate,
                     attn_drop=attn_drop_rate, norm_layer=norm_layer)
        make = DividedBlock if attention == "divided" else Block
        self.blocks = nn.ModuleList([make(drop_path=r, **block) for r in rates])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.attention_groups = ATTENTION_GROUPS if attention == "divided" else {}
        self._init_weights(weight_init)

    def _init_weights(self, weight_init: str) -> None:
        trunc_normal_(self.pos_embed, std=0.02)
        trunc_normal_(self.cls_token, std=0.02)
        if self.attention != "space_only":
            trunc_normal_(self.time_embed, std=0.02)  # zeroed by init_from_image (docs/methods.md)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                if weight_init == "xavier":
                    nn.init.xavier_uniform_(m.weight)
                else:
                    trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for block in self.blocks:
            if isinstance(block, DividedBlock):
                nn.init.zeros_(block.temporal_fc.weight)
                nn.init.zeros_(block.temporal_fc.bias)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"pos_embed", "cls_token", "time_embed"}

    def _check(self, x: torch.Tensor) -> None:
        want = (self.in_chans, *self.patch_embed.img_size)
        if x.ndim != 5 or (x.shape[1], *x.shape[3:]) != want:
            raise ConfigError(f"TimeSformer takes clips (B, C, T, H, W) with C, H, W = {want}, not "
                              f"{tuple(x.shape)}; give the dataset the model's image_size and channels.")

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """The class token after the final norm, (B, embed_dim)."""
        self._check(x)
        B, _, T = x.shape[:3]
        x = self.patch_embed(x.transpose(1, 2).flatten(0, 1))  # (B*T, N, D), frame-major
        N, D = x.shape[1:]
        x = self.pos_drop(x + self.pos_embed[:, 1:])
        cls = self.cls_token + self.pos_embed[:, :1]
        if self.attention == "space_only":  # every frame is an image with its own class token
            x = torch.cat([cls.expand(B * T, 1, D), x], dim=1)
            for block in self.blocks:
                x = block(x)
            return self.norm(x.reshape(B, T, N + 1, D).mean(dim=1))[:, 0]
        time = self.time_embed
        if T != time.shape[1]:  # the authors' model resamples the time embedding (nearest) for other clip lengths
            time = F.interpolate(time.transpose(1, 2), size=T, mode="nearest").transpose(1, 2)
        x = self.time_drop(x.reshape(B, T, N, D) + time.reshape(1, T, 1, D)).reshape(B, T * N, D)
        x = torch.cat([cls.expand(B, 1, D), x], dim=1)
        for block in self.blocks:
            x = block(x, T) if isinstance(block, DividedBlock) else block(x)
        return self.norm(x)[:, 0]

    def example_input(self, batch: int = 1, device=None) -> torch.Tensor:
        """Clips (batch, C, T, H, W), zeros (operation counts, shape checks)."""
        return torch.zeros(batch, self.in_chans, self.num_frames, *self.patch_embed.img_size, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.forward_features(x))


# ---- weights from elsewhere ----------------------------------------------------------------------------------------
_TEMPORAL_COPIES = (("temporal_attn.", "attn."), ("temporal_norm1.", "norm1."))


def init_from_image(model: TimeSformer, state_dict: Mapping[str, torch.Tensor],
                    source: str = "the image model's weights") -> TimeSformer:
    """Start ``model`` from an image ViT's state dict in timm's layout, as the authors' loader does (docs/methods.md):
    ``temporal_attn`` and ``temporal_norm1`` copies of each block's ``attn`` and ``norm1``, ``temporal_fc`` and the
    time embedding zero. The position embedding is resampled to another patch grid; the head is taken when it has
    ``num_classes`` outputs, else kept fresh; anything else that does not fit is a ConfigError naming the key."""
    state = {re.sub(r"^module\.", "", k): v for k, v in state_dict.items()}
    if "cls_token" not in state:
        raise ConfigError(f"{source} has no class token (cls_token); TimeSformer's head reads one, so start it "
                          f"from a ViT with a class token.")
    if any(".temporal_attn." in k for k in state):
        raise ConfigError(f"{source} already holds temporal attention (a video checkpoint); load it with "
                          f"attnlab.models.load_timesformer.")
    own = model.state_dict()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in own.items():
        key = name
        for video, image in _TEMPORAL_COPIES:
            key = key.replace(video, image)
        if name == "time_embed" or ".temporal_fc." in name:
            out[name] = torch.zeros_like(tensor)  # the temporal branch and the frames' tags start silent
        elif name.startswith("head.") and (key not in state or state[key].shape != tensor.shape):
            out[name] = tensor  # a new classifier for another label set, as timm does for num_classes
        elif key not in state:
            raise ConfigError(f"{source} lacks {key!r}, which TimeSformer's {name!r} is initialised from; give "
                              f"the weights of a ViT of the same width and depth.")
        elif name == "pos_embed" and state[key].shape != tensor.shape:
            grid = model.patch_embed.grid_size
            out[name] = resample_abs_pos_embed(state[key], new_size=list(grid), num_prefix_tokens=1)
        else:
            out[name] = state[key]
    used = {name for name in own} | {name.replace(v, i) for name in own for v, i in _TEMPORAL_COPIES}
    extra = next((k for k in state if k not in used), None)
    if extra is not None:
        raise ConfigError(f"{source} holds {extra!r}, which TimeSformer has no place for; give the weights of a "
                          f"plain ViT (class token, no register or distillation tokens).")
    return load_strict(model, out, source)


def timesformer_state_dict(model: nn.Module, state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint of the authors' released TimeSformer models (every parameter ``model.<name>``, or
    ``module.model.<name>``) rewritten for ``model``: the time embedding resampled to its frames, a head of another
    size left as ``model`` has it, and, for a model converted to ``dna``, the DnA authors' video layout read through
    :func:`attnlab.models.pretrained.dna_authors_state_dict` (docs/methods.md, TimeSformer)."""
    state = {re.sub(r"^(module\.)?(model\.)?", "", k): v for k, v in state_dict.items()}
    own = model.state_dict()
    has_temporal = any(".temporal_attn." in k for k in state)
    wants_temporal = any(".temporal_attn." in k for k in own)
    if has_temporal != wants_temporal:
        kind = "divided space-time" if has_temporal else "joint or space-only"
        raise ConfigError(f"the checkpoint holds a {kind} TimeSformer but the model is built with attention="
                          f"{getattr(model, 'attention', '?')!r}; build it with the checkpoint's attention.")
    if "time_embed" in state and "time_embed" in own and state["time_embed"].shape[1] != own["time_embed"].shape[1]:
        frames = own["time_embed"].shape[1]
        state["time_embed"] = F.interpolate(state["time_embed"].transpose(1, 2), size=frames,
                                            mode="nearest").transpose(1, 2)
    for key in ("head.weight", "head.bias"):
        if key in own and key in state and state[key].shape != own[key].shape:
            state[key] = own[key]
    if any(isinstance(m, VARIANTS["dna"].load()) for m in model.modules()):  # the registry's class
        state = dna_authors_state_dict(model, state)
    return state


def load_timesformer(model: nn.Module, source: str | Path | Mapping[str, torch.Tensor]) -> nn.Module:
    """Load a checkpoint in the layout of the authors' released TimeSformer models (a path, read without running
    code, or a state dict) into ``model`` by meaning (:func:`timesformer_state_dict`), strictly, and return it."""
    name = f"checkpoint {source}" if isinstance(source, (str, Path)) else "the checkpoint"
    state = read_state_dict(source) if isinstance(source, (str, Path)) else source
    return load_strict(model, timesformer_state_dict(model, state), name)


def init_timesformer(model: TimeSformer, state_dict: Mapping[str, torch.Tensor], source: str) -> TimeSformer:
    """Initialise ``model`` from a file's state dict: a video checkpoint (it has temporal attention, or a time
    embedding) through :func:`load_timesformer`, an image ViT through :func:`init_from_image`."""
    plain = {re.sub(r"^(module\.)?(model\.)?", "", k): v for k, v in state_dict.items()}
    if any(k.endswith(("q_neg.weight", "v_neg.weight", "neg_scalers")) for k in plain):
        raise ConfigError(f"{source} holds DnA attention (q_neg, v_neg); build the model with attn='dna' and load "
                          f"it with attnlab.models.load_timesformer(model, path).")
    if "time_embed" in plain or any(".temporal_attn." in k for k in plain):
        return load_strict(model, timesformer_state_dict(model, plain), source)
    return init_from_image(model, plain, source)


__all__ = ["ATTENTIONS", "ATTENTION_GROUPS", "DividedBlock", "TimeSformer", "init_from_image", "init_timesformer",
           "load_timesformer", "timesformer_state_dict"]
