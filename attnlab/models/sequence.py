"""A small sequence-classification transformer for the Long Range Arena tasks (ListOps, byte-level text).

    tokens (B, N) --embedding + learned positions--> [class token] --timm Blocks--> norm --mean | class token--> head

Built from timm's ``Block`` and ``Attention``, so :func:`attnlab.convert` finds every attention module and every
spec term applies (``nystrom``, ``performer``, ``speccond``...). ``norm_layer=nn.Identity`` (``build_model(...,
norm="none")``) removes every LayerNorm: the spectral-conditioning paper's Nyströmformer ablation (its Appendix A.3,
Table 8) of conditioning without LayerNorm. No padding mask: padding tokens (id 0) are attended like the others,
so every term runs on plain global attention.
"""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

from ..errors import ConfigError


class SequenceClassifier(nn.Module):
    """Token embedding, learned positions, pre-LN timm blocks, mean or class-token pooling, linear head.

    Args:
        vocab_size: number of token ids (0 is padding).
        max_length: longest input sequence N (the learned positions' length).
        num_classes: output classes.
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the blocks' geometry (timm's Block).
        pool: ``"mean"`` over the tokens or ``"token"`` (a learned class token in front).
        drop_rate, attn_drop_rate, drop_path_rate: dropout after embedding / projections, on attention weights,
            stochastic depth (the same rate in every block).
        norm_layer: the blocks' and final normalisation (default LayerNorm, eps 1e-6; ``nn.Identity``: none).
        block_fn: the block class (``PostNormBlock`` for post-LN).
        img_size, in_chans: the trainer sizes every model by these names; for a sequence model they are
            ``max_length`` and ``vocab_size`` (given, they replace those).
    """

    def __init__(self, vocab_size: int = 16, max_length: int = 2000, num_classes: int = 10, embed_dim: int = 64,
                 depth: int = 2, num_heads: int = 2, mlp_ratio: float = 2.0, qkv_bias: bool = True,
                 pool: str = "mean", drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, norm_layer: type[nn.Module] | None = None,
                 block_fn: type[nn.Module] = Block, img_size: int | None = None, in_chans: int | None = None) -> None:
        super().__init__()
        if pool not in ("mean", "token"):
            raise ConfigError(f"pool must be 'mean' or 'token', not {pool!r}.")
        vocab_size = in_chans if in_chans is not None else vocab_size
        max_length = img_size if img_size is not None else max_length
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-6)
        self.pool, self.max_length, self.num_classes = pool, max_length, num_classes
        self.token_embed = nn.Embedding(vocab_size, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "token" else None
        self.pos_embed = nn.Parameter(torch.zeros(1, max_length + (pool == "token"), embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.Sequential(*[
            block_fn(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=drop_rate,
                     attn_drop=attn_drop_rate, drop_path=drop_path_rate, norm_layer=norm_layer)
            for _ in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)
        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.token_embed.weight, std=0.02)

    def forward_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) integer ids, N <= max_length -> (B, N [+ 1], embed_dim)."""
        if tokens.shape[-1] > self.max_length:
            raise ConfigError(f"a sequence of {tokens.shape[-1]} tokens is longer than the model's max_length "
                              f"{self.max_length}; build the model with max_length >= {tokens.shape[-1]}.")
        x = self.token_embed(tokens.long())
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed[:, : x.shape[1]])
        return self.norm(self.blocks(x))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.forward_features(tokens)
        return self.head(x[:, 0] if self.pool == "token" else x.mean(dim=1))


__all__ = ["SequenceClassifier"]
