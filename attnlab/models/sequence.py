"""A small sequence-classification transformer for the Long Range Arena tasks (ListOps, byte-level text).

    tokens (B, N) --[pad to a multiple]--> embedding + learned positions --> [class token] --timm Blocks--> norm
        --mean over real tokens | class token--> head (one Linear, or the Nyströmformer authors' two-layer MLP)

Built from timm's ``Block`` and ``Attention``, so :func:`attnlab.convert` finds every attention module and every
spec term applies. ``norm_layer=nn.Identity`` (``build_model(..., norm="none")``) is the spectral-conditioning
paper's no-LayerNorm ablation (its Appendix A.3, Table 8). With ``pad_id`` set the padding is masked in every block
and in the pooling, and ``pad_multiple`` pads each batch at the end (the Nyströmformer authors' 2000 -> 2048 for 64
landmarks); docs/methods.md (Low-rank kernels) compares this with the authors' code.
"""

from __future__ import annotations

from functools import partial

import torch
from timm.layers import trunc_normal_
from timm.models.vision_transformer import Block
from torch import nn

from ..attention.mask import AttentionMask
from ..errors import ConfigError

POOLS = ("mean", "token", "padded_mean")
HEADS = ("linear", "mlp")


class SequenceClassifier(nn.Module):
    """Token embedding, learned positions, pre-LN timm blocks, pooling, a classification head.

    Args:
        vocab_size, num_classes: number of token ids, of output classes.
        max_length: longest input sequence N (the learned positions cover it, rounded up to ``pad_multiple``).
        embed_dim, depth, num_heads, mlp_ratio, qkv_bias: the blocks' geometry (timm's Block).
        pool: ``"mean"`` over the real tokens, ``"token"`` (a learned class token in front), or ``"padded_mean"``
            (padded tokens' features zeroed, then the mean over all N positions: the Nyströmformer authors' LRA code).
        drop_rate, attn_drop_rate, drop_path_rate: dropout after embedding / projections, on attention weights,
            stochastic depth (the same rate in every block).
        norm_layer: the normalisation (default LayerNorm of eps ``norm_eps``, 1e-6 as timm's ViT; the authors' LRA
            code: PyTorch's 1e-5; ``nn.Identity``: none).
        pad_id: the padding token id (masked everywhere), or None for no mask.
        pad_multiple: pad each batch at the end with ``pad_id`` to a multiple of this many tokens (1: none).
        head: ``"linear"`` (one Linear) or ``"mlp"`` (Linear, ReLU, Linear: the authors' LRA head).
        head_hidden: the MLP head's width (default ``embed_dim * mlp_ratio``, the authors' choice).
        block_fn: the block class (``PostNormBlock`` for post-LN).
        img_size, in_chans: the names the trainer sizes every model by: given, they replace ``max_length`` and
            ``vocab_size``.
    """

    def __init__(self, vocab_size: int = 16, max_length: int = 2000, num_classes: int = 10, embed_dim: int = 64,
                 depth: int = 2, num_heads: int = 2, mlp_ratio: float = 2.0, qkv_bias: bool = True,
                 pool: str = "mean", drop_rate: float = 0.0, attn_drop_rate: float = 0.0,
                 drop_path_rate: float = 0.0, norm_layer: type[nn.Module] | None = None, norm_eps: float = 1e-6,
                 pad_id: int | None = None, pad_multiple: int = 1, head: str = "linear",
                 head_hidden: int | None = None, block_fn: type[nn.Module] = Block, img_size: int | None = None,
                 in_chans: int | None = None) -> None:
        super().__init__()
        if pool not in POOLS:
            raise ConfigError(f"pool must be one of {', '.join(POOLS)}, not {pool!r}.")
        if head not in HEADS:
            raise ConfigError(f"head must be one of {', '.join(HEADS)}, not {head!r}.")
        if pad_id is None and (pool == "padded_mean" or pad_multiple != 1):
            raise ConfigError("pool='padded_mean' and pad_multiple need a pad_id (the padding token to mask).")
        if not isinstance(pad_multiple, int) or pad_multiple < 1:
            raise ConfigError(f"pad_multiple must be a whole number >= 1, not {pad_multiple!r}.")
        vocab_size = in_chans if in_chans is not None else vocab_size
        max_length = img_size if img_size is not None else max_length
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=norm_eps)
        self.pool, self.max_length, self.num_classes = pool, max_length, num_classes
        self.pad_id, self.pad_multiple = pad_id, pad_multiple
        self.token_embed = nn.Embedding(vocab_size, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "token" else None
        positions = -(-max_length // pad_multiple) * pad_multiple
        self.pos_embed = nn.Parameter(torch.zeros(1, positions + (pool == "token"), embed_dim))
        self.pos_drop = nn.Dropout(drop_rate)
        self.blocks = nn.Sequential(*[
            block_fn(dim=embed_dim, num_heads=num_heads, mlp_ratio=mlp_ratio, qkv_bias=qkv_bias, proj_drop=drop_rate,
                     attn_drop=attn_drop_rate, drop_path=drop_path_rate, norm_layer=norm_layer)
            for _ in range(depth)])
        self.norm = norm_layer(embed_dim)
        hidden = head_hidden or int(embed_dim * mlp_ratio)
        self.head = nn.Linear(embed_dim, num_classes) if head == "linear" else nn.Sequential(
            nn.Linear(embed_dim, hidden), nn.ReLU(), nn.Linear(hidden, num_classes))
        trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.token_embed.weight, std=0.02)

    def padded(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) padded at the end with ``pad_id`` to a multiple of ``pad_multiple``."""
        extra = -tokens.shape[-1] % self.pad_multiple
        return tokens if not extra else nn.functional.pad(tokens, (0, extra), value=self.pad_id)

    def mask(self, tokens: torch.Tensor) -> AttentionMask | None:
        """The blocks' key-padding mask for (padded) tokens (B, N), a class token in front counting as real."""
        if self.pad_id is None:
            return None
        real = tokens != self.pad_id
        if self.cls_token is not None:
            real = torch.cat([real.new_ones(real.shape[0], 1), real], dim=1)
        return AttentionMask(key_padding=real)

    def example_input(self, batch: int = 1, device=None) -> torch.Tensor:
        """Token ids (batch, max_length), zeros (operation counts, shape checks)."""
        return torch.zeros(batch, self.max_length, dtype=torch.long, device=device)

    def forward_features(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (B, N) integer ids, N <= max_length -> (B, N' [+ 1], embed_dim), N' = N padded to the multiple."""
        if tokens.shape[-1] > self.max_length:
            raise ConfigError(f"a sequence of {tokens.shape[-1]} tokens is longer than the model's max_length "
                              f"{self.max_length}; build the model with max_length >= {tokens.shape[-1]}.")
        tokens = self.padded(tokens.long())
        x = self.token_embed(tokens)
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.pos_embed[:, : x.shape[1]])
        mask = self.mask(tokens)
        if mask is None:
            return self.norm(self.blocks(x))
        for block in self.blocks:
            x = block(x, attn_mask=mask)
        return self.norm(x) * mask.key_padding.unsqueeze(-1).to(x.dtype)

    def pooled(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        """(B, embed_dim) from the features of :meth:`forward_features` (padded positions already zero)."""
        if self.pool == "token":
            return x[:, 0]
        if self.pool == "padded_mean" or self.pad_id is None:
            return x.mean(dim=1)
        real = (self.padded(tokens.long()) != self.pad_id).sum(dim=1, keepdim=True).clamp_min(1)
        return x.sum(dim=1) / real.to(x.dtype)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.pooled(self.forward_features(tokens), tokens))


__all__ = ["HEADS", "POOLS", "SequenceClassifier"]
