"""A decoder-only language model in the shape of Llama and Qwen, for the sigma-Reparam / QK-norm / QK-clip study.

    tokens (B, N) --embed--> depth x Block --RMSNorm--> head (tied to the embedding, or its own) --> logits
    Block (pre-norm):  x = x + attn(RMSNorm(x), causal);   x = x + SwiGLU(RMSNorm(x))
    attn: grouped-query attention (num_kv_heads key/value heads), QK-norm per head (RMSNorm over head_dim, Qwen3)
          then rotary positions, no biases (Qwen2: q, k, v biases)
    SwiGLU(x) = down(silu(gate(x)) * up(x))

The pieces: RMSNorm (Zhang and Sennrich, "Root Mean Square Layer Normalization", arXiv:1910.07467), SwiGLU
(Shazeer, "GLU Variants Improve Transformer", arXiv:2002.05202), rotary position embeddings (Su et al., "RoFormer",
arXiv:2104.09864; :class:`attnlab.ops.rotary.Rotary`, applied after QK-norm as Qwen3 does), grouped-query attention
(Ainslie et al., "GQA", arXiv:2305.13245). The attention is attnlab's own contract-based module (``standard`` with
``num_kv_heads`` and ``rotary``), so every spec term converts it or refuses in one line, and the KV cache keeps the
grouped keys. Hugging Face ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM`` weights load and
export through :mod:`attnlab.models.hf_decoder`. Initialisation is theirs: N(0, 0.02) for every matrix, norms at 1.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import LayerCache
from ..attention.standard import StandardAttention
from ..ops.rotary import THETA_MAX, THETA_MIN, Rotary
from .gpt import DecoderLM
from .options import divisors, finite_above, flag, is_int, listed, positive_int, refuse

#: the presets: kwargs of :class:`Llama` and a line of documentation
LLAMA_PRESETS: dict[str, tuple[dict, str]] = {
    "llama_tiny": (dict(vocab_size=256, block_size=256, embed_dim=128, depth=4, num_heads=4, num_kv_heads=2,
                        mlp_hidden=352),
                   "Llama-shaped, for 2 CPU cores: 4 layers, 4 query / 2 key-value heads (D=32), dim 128, SwiGLU 352, "
                   "RoPE theta 10000, RMSNorm, tied head, bytes (vocab 256); about 0.8M parameters"),
    "qwen3_tiny": (dict(vocab_size=256, block_size=256, embed_dim=128, depth=4, num_heads=4, num_kv_heads=2,
                        mlp_hidden=352, qk_norm=True, rope_theta=1e6),
                   "llama_tiny with Qwen3's per-head QK-norm (RMSNorm over head_dim, before RoPE) and RoPE theta 1e6"),
    "llama_mini": (dict(vocab_size=256, block_size=256, embed_dim=384, depth=6, num_heads=6, num_kv_heads=2,
                        mlp_hidden=1024),
                   "Llama-shaped, nanoGPT Shakespeare-char size: 6 layers, 6 query / 2 key-value heads (D=64), dim 384, "
                   "SwiGLU 1024, vocab 256; about 9.5M parameters"),
    "llama_small": (dict(vocab_size=50257, block_size=1024, embed_dim=768, depth=12, num_heads=12, num_kv_heads=4,
                         mlp_hidden=2048),
                    "Llama-shaped at GPT-2 small's size for GPUs: 12 layers, 12 query / 4 key-value heads (D=64), "
                    "dim 768, SwiGLU 2048, 1024 positions, GPT-2's 50257 tokens; about 114M parameters"),
}


class SwiGLU(nn.Module):
    """down(silu(gate(x)) * up(x)), Hugging Face's names (``gate_proj``, ``up_proj``, ``down_proj``)."""

    def __init__(self, dim: int, hidden: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """Pre-norm block: grouped-query attention with rotary positions and a SwiGLU MLP, RMSNorm before each."""

    def __init__(self, dim: int, num_heads: int, num_kv_heads: int, head_dim: int, mlp_hidden: int, rope_theta: float,
                 norm_eps: float, qkv_bias: bool, proj_bias: bool, qk_norm: bool, layer_index: int,
                 num_layers: int) -> None:
        super().__init__()
        norm = partial(nn.RMSNorm, eps=norm_eps)
        self.norm1 = norm(dim)
        self.attn = StandardAttention(dim, num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, qkv_bias=qkv_bias,
                                      proj_bias=proj_bias, qk_norm=qk_norm, norm_layer=norm, layer_index=layer_index,
                                      num_layers=num_layers)
        self.attn.rotary = Rotary(head_dim, rope_theta)
        self.norm2 = norm(dim)
        self.mlp = SwiGLU(dim, mlp_hidden)

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), is_causal=True, cache=cache)
        return x + self.mlp(self.norm2(x))


def default_mlp_hidden(embed_dim: int) -> int:
    """SwiGLU's default hidden width: 8/3 embed_dim rounded up to a multiple of 32 (Llama's rule)."""
    return -(-8 * embed_dim // 3 // 32) * 32


def llama_geometry(values: Mapping[str, object], owner: str = "Llama", names: Mapping[str, str] | None = None,
                   hints: Mapping[str, object] | None = None, unset: str = "leave it unset") -> dict:
    """:class:`Llama`'s keyword arguments checked value by value and completed (the one check of every value the
    decoder reads, from the constructor, ``build_model``'s options or a Hugging Face ``config.json``): ConfigError in
    one sentence naming the key (``names``: attnlab's key -> the user's, e.g. ``num_attention_heads``), the value and
    a right one (``hints``: attnlab's key -> a right value known from elsewhere, e.g. the weights' shapes).

    Sizes are positive integers; ``None`` (``unset``: how the user gets it) leaves ``num_kv_heads`` (num_heads),
    ``head_dim`` (embed_dim / num_heads, which must then be an even integer) and ``mlp_hidden`` at their defaults,
    and zero is refused rather than read as one. ``head_dim`` is even (rotary positions pair features);
    ``num_kv_heads`` divides ``num_heads``; ``rope_theta`` is a finite number above 1 that float32 holds
    (:mod:`attnlab.ops.rotary`); ``norm_eps`` a finite number above 0; the four flags True or False."""
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    def hint(key: str, example: object) -> object:
        return (hints or {}).get(key, example)

    g = {key: positive_int(owner, name(key), values.get(key), hint(key, example))
         for key, example in (("vocab_size", 256), ("block_size", 256), ("embed_dim", 128), ("depth", 4))}
    dim, heads, head_dim = g["embed_dim"], values.get("num_heads"), values.get("head_dim")
    if head_dim is None:  # the default head_dim dim / heads must be an even integer
        fits = [h for h in divisors(dim) if dim // h % 2 == 0]
        if not (is_int(heads) and heads in fits):
            near = (lambda h: abs(h - heads)) if is_int(heads) and heads > 0 else (lambda h: abs(dim // h - 64))
            best = min(fits, key=near, default=None)
            right = (f"one such as {best} (head_dim {dim // best}), or set {name('head_dim')}" if best else
                     f"one such as 4 and set {name('head_dim')}, as {name('embed_dim')} {dim} is odd")
            raise refuse(owner, name("num_heads"), heads, f"a positive integer dividing {name('embed_dim')} {dim} into "
                         f"even head_dims (rotary positions pair features)", right)
        head_dim = dim // heads
    else:
        per = head_dim if is_int(head_dim) and head_dim > 0 and dim % head_dim == 0 else dim
        heads = positive_int(owner, name("num_heads"), heads, f"{dim // per} ({name('embed_dim')} / {name('head_dim')})"
                             if per != dim else 4)
        if not (is_int(head_dim) and head_dim >= 2 and head_dim % 2 == 0):
            raise refuse(owner, name("head_dim"), head_dim, "a positive even integer (rotary positions pair features)",
                         f"one such as {max(2, dim // heads // 2 * 2)} (or {unset} for {name('embed_dim')} / "
                         f"{name('num_heads')})")
    kv = values.get("num_kv_heads")
    if kv is None:
        kv = heads
    elif not (is_int(kv) and kv >= 1 and heads % kv == 0):
        raise refuse(owner, name("num_kv_heads"), kv, f"a positive integer dividing {name('num_heads')} {heads}",
                     f"{listed(divisors(heads))} (or {unset} for {heads})")
    mlp = values.get("mlp_hidden")
    mlp = default_mlp_hidden(dim) if mlp is None else positive_int(
        owner, name("mlp_hidden"), mlp, hint("mlp_hidden", f"{default_mlp_hidden(dim)} (or {unset} for that default)"))
    theta = finite_above(owner, name("rope_theta"), values.get("rope_theta"), THETA_MIN,
                         "one such as 10000.0 (Llama 2; Llama 3: 500000.0, Qwen: 1000000.0)", high=THETA_MAX)
    eps = finite_above(owner, name("norm_eps"), values.get("norm_eps"), 0.0, "one such as 1.0e-06 (Llama: 1.0e-05)")
    flags = {key: flag(owner, name(key), values.get(key))
             for key in ("qkv_bias", "proj_bias", "qk_norm", "tie_embeddings")}
    return dict(g, num_heads=heads, num_kv_heads=kv, head_dim=head_dim, mlp_hidden=mlp, rope_theta=theta,
                norm_eps=eps, **flags)


class Llama(DecoderLM):
    """Llama- and Qwen-shaped decoder-only language model (module docstring); the interface of
    :class:`~attnlab.models.gpt.DecoderLM`, as GPT's (its training task, sampling and KV cache take either).

    Args:
        vocab_size, block_size, embed_dim, depth, num_heads: as :class:`GPT` (``block_size``: the longest sequence;
            rotary positions have no table, but training and sampling keep to it).
        num_kv_heads: key/value heads, a divisor of num_heads (grouped-query attention; None: num_heads, multi-head).
        head_dim: features per head, even (None: embed_dim // num_heads, which must divide evenly; Qwen3 sets it
            apart).
        mlp_hidden: SwiGLU's hidden width (None: 8/3 embed_dim rounded up to a multiple of 32).
        rope_theta: the rotary base, finite and above 1 (Llama 2: 1e4, Llama 3: 5e5, Qwen: 1e6).
        norm_eps: RMSNorm's epsilon, finite and above 0 (every norm, QK-norm included).
        qkv_bias, proj_bias: biases of the q, k, v and of the output projection (Qwen2: q, k, v only).
        qk_norm: Qwen3's QK-norm, RMSNorm over head_dim on each head's query and key before the rotation.
        tie_embeddings: the head is the embedding matrix (True) or a Linear of its own.

    Every value is checked by :func:`llama_geometry` (zero is no default; flags are True or False).
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 256, embed_dim: int = 128, depth: int = 4,
                 num_heads: int = 4, num_kv_heads: int | None = None, head_dim: int | None = None,
                 mlp_hidden: int | None = None, rope_theta: float = 10000.0, norm_eps: float = 1e-6,
                 qkv_bias: bool = False, proj_bias: bool = False, qk_norm: bool = False,
                 tie_embeddings: bool = True) -> None:
        g = llama_geometry(dict(vocab_size=vocab_size, block_size=block_size, embed_dim=embed_dim, depth=depth,
                                num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                mlp_hidden=mlp_hidden, rope_theta=rope_theta, norm_eps=norm_eps, qkv_bias=qkv_bias,
                                proj_bias=proj_bias, qk_norm=qk_norm, tie_embeddings=tie_embeddings))
        super().__init__(g["vocab_size"], g["block_size"], g["embed_dim"])
        self.geometry = g
        self.wte = nn.Embedding(g["vocab_size"], g["embed_dim"])
        self.blocks = nn.ModuleList(
            LlamaBlock(g["embed_dim"], g["num_heads"], g["num_kv_heads"], g["head_dim"], g["mlp_hidden"],
                       g["rope_theta"], g["norm_eps"], g["qkv_bias"], g["proj_bias"], g["qk_norm"], i, g["depth"])
            for i in range(g["depth"]))
        self.norm = nn.RMSNorm(g["embed_dim"], eps=g["norm_eps"])
        self.lm_head = None if g["tie_embeddings"] else nn.Linear(g["embed_dim"], g["vocab_size"], bias=False)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if isinstance(module, nn.Linear) and module.bias is not None:
                    nn.init.zeros_(module.bias)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The token embeddings alone: positions enter as rotations of q and k (from ``start`` under a KV cache)."""
        return self.wte(tokens)

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab) of hidden states (..., embed_dim): the tied embedding, or the head's own weight."""
        return F.linear(h, self.wte.weight if self.lm_head is None else self.lm_head.weight)


__all__ = ["LLAMA_PRESETS", "Llama", "LlamaBlock", "SwiGLU", "default_mlp_hidden", "llama_geometry"]
