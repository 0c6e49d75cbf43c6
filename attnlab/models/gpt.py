"""A decoder-only language model in the shape of GPT-2 (Radford et al., 2019, "Language Models are Unsupervised
Multitask Learners"), laid out as nanoGPT's ``model.py`` writes it, and its sampling loop.

    tokens (B, N) --wte + wpe--> dropout --depth x Block--> LayerNorm --x wte^T (tied head)--> logits (B, N, vocab)
    Block (pre-LN):  x = x + attn(LN1(x), causal);   x = x + mlp(LN2(x))      mlp = Linear, GELU, Linear (4x)

Attention is timm's ``Attention`` called with ``is_causal=True``, so :func:`attnlab.convert` finds every one.
Initialisation is nanoGPT's: N(0, 0.02), biases 0, the residual projections (``attn.proj``, ``mlp.fc2``)
N(0, 0.02 / sqrt(2 depth)). The head is ``wte`` itself, one parameter, which weight terms on ``nn.Linear`` leave
alone. :func:`generate` uses a key/value cache where every attention module allows it (:func:`supports_kv_cache`);
docs/methods.md (Language models) gives the details.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import Attention, Mlp
from torch import nn

from ..attention.base import LayerCache
from ..attention.capabilities import capabilities_of
from ..errors import ConfigError
from .convert import attention_modules

GELU = ("exact", "tanh")  # nanoGPT's nn.GELU(), or Hugging Face GPT-2's tanh approximation ("gelu_new")

#: the presets (GPT-2's geometry as timm names it): kwargs of :class:`GPT` and a line of documentation
GPT_PRESETS: dict[str, tuple[dict, str]] = {
    "gpt_tiny": (dict(vocab_size=256, block_size=256, embed_dim=128, depth=4, num_heads=4),
                 "tiny GPT for 2 CPU cores: 4 layers, 4 heads (D=32), dim 128, 256 positions, bytes (vocab 256); "
                 "about 0.9M parameters"),
    "gpt_mini": (dict(vocab_size=256, block_size=256, embed_dim=384, depth=6, num_heads=6),
                 "nanoGPT's Shakespeare-char shape: 6 layers, 6 heads (D=64), dim 384, 256 positions, vocab 256; "
                 "about 10.8M parameters"),
    "gpt2_small": (dict(vocab_size=50257, block_size=1024, embed_dim=768, depth=12, num_heads=12),
                   "GPT-2 small (124M): 12 layers, 12 heads (D=64), dim 768, 1024 positions, GPT-2's 50257 tokens"),
}


class Block(nn.Module):
    """Pre-LN transformer block with causal self-attention (timm's ``Attention``) and a GELU MLP; ``cache`` (a
    :class:`LayerCache`) makes the attention read and extend the earlier tokens' keys and values."""

    def __init__(self, dim: int, num_heads: int, mlp_ratio: float = 4.0, bias: bool = True, drop: float = 0.0,
                 attn_drop: float = 0.0, act_layer: type[nn.Module] = nn.GELU,
                 norm_layer: type[nn.Module] = nn.LayerNorm) -> None:
        super().__init__()
        self.norm1 = norm_layer(dim)
        self.attn = Attention(dim, num_heads, qkv_bias=bias, proj_bias=bias, attn_drop=attn_drop, proj_drop=drop)
        self.norm2 = norm_layer(dim)
        # nanoGPT drops out after the output projection only
        self.mlp = Mlp(dim, int(dim * mlp_ratio), act_layer=act_layer, bias=bias, drop=(0.0, drop))

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        h = self.norm1(x)
        x = x + (self.attn(h, is_causal=True) if cache is None else self.attn(h, cache=cache))
        del h  # the normalised input is not kept alive through the MLP (as nanoGPT's Block does not)
        return x + self.mlp(self.norm2(x))


class GPT(nn.Module):
    """GPT-2-shaped decoder-only language model (module docstring).

    Args:
        vocab_size: token ids 0 .. vocab_size - 1 (the logits' width).
        block_size: the longest sequence (learned positions).
        embed_dim, depth, num_heads, mlp_ratio: the blocks' geometry (GPT-2: MLP 4x).
        bias: biases in every Linear and LayerNorm (GPT-2: yes; nanoGPT's ``bias=False`` drops them).
        drop_rate, attn_drop_rate: dropout on the embeddings and after each residual projection (nanoGPT's
            ``dropout``), on the attention weights.
        gelu: ``exact`` (nanoGPT's ``nn.GELU()``) or ``tanh`` (Hugging Face GPT-2's ``gelu_new``).
        norm_layer: the normalisation (default LayerNorm, eps 1e-5; ``nn.Identity``: none).
    """

    #: every attention is causal: :func:`attnlab.convert` refuses a term without a causal form when it is built
    causal = True

    def __init__(self, vocab_size: int = 256, block_size: int = 256, embed_dim: int = 128, depth: int = 4,
                 num_heads: int = 4, mlp_ratio: float = 4.0, bias: bool = True, drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, gelu: str = "exact", norm_layer: type[nn.Module] | None = None) -> None:
        super().__init__()
        for key, value in (("vocab_size", vocab_size), ("block_size", block_size), ("embed_dim", embed_dim),
                           ("depth", depth), ("num_heads", num_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"GPT's {key} must be a positive integer, not {value!r}.")
        if embed_dim % num_heads:
            raise ConfigError(f"GPT's embed_dim {embed_dim} is not divisible by num_heads {num_heads}; give a "
                              f"multiple of num_heads.")
        if gelu not in GELU:
            raise ConfigError(f"GPT's gelu must be one of {', '.join(GELU)}, not {gelu!r}.")
        norm_layer = norm_layer or partial(nn.LayerNorm, eps=1e-5, bias=bias)
        self.vocab_size, self.block_size, self.embed_dim = vocab_size, block_size, embed_dim
        self.wte = nn.Embedding(vocab_size, embed_dim)
        self.wpe = nn.Embedding(block_size, embed_dim)
        self.drop = nn.Dropout(drop_rate)
        act = partial(nn.GELU, approximate="none" if gelu == "exact" else "tanh")
        self.blocks = nn.ModuleList([
            Block(embed_dim, num_heads, mlp_ratio, bias, drop_rate, attn_drop_rate, act, norm_layer)
            for _ in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.apply(_init_weights)
        for block in self.blocks:  # GPT-2's scaled init of the projections that write to the residual stream
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    def forward_features(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """tokens (B, N) int -> hidden states after the final norm (B, N, embed_dim). With ``cache``, the tokens
        continue the ``cache.length`` tokens it holds (positions start there) and their keys and values join it."""
        start = 0 if cache is None else cache.length
        N = tokens.shape[-1]
        if start + N > self.block_size:
            raise ConfigError(f"a sequence of {start + N} tokens is longer than the model's block_size "
                              f"{self.block_size}; give at most {self.block_size} tokens or build the model with a "
                              f"larger block_size.")
        x = self.embed(tokens, start)
        for i, block in enumerate(self.blocks):
            x = block(x, None if cache is None else cache.layers[i])
        if cache is not None:
            cache.length += N
        return self.norm(x)

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The blocks' input for tokens (B, N) at positions start, start + 1, ...: token and learned positions."""
        return self.drop(self.wte(tokens) + self.wpe(torch.arange(start, start + tokens.shape[-1],
                                                                  device=tokens.device)))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab) of hidden states (..., embed_dim): the tied head, h wte^T."""
        return F.linear(h, self.wte.weight)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int (B, N), N <= block_size -> next-token logits (B, N, vocab_size); position i sees tokens 0..i."""
        return self.head(self.forward_features(tokens))

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, block_size={self.block_size}"

    def example_input(self, batch: int = 1, device=None) -> torch.Tensor:
        """Token ids (batch, block_size), zeros (operation counts, shape checks)."""
        return torch.zeros(batch, self.block_size, dtype=torch.long, device=device)


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
    if isinstance(module, nn.Linear) and module.bias is not None:
        nn.init.zeros_(module.bias)


def check_block_size(model: nn.Module, block_size: int) -> None:
    """ConfigError unless ``model`` (a :class:`GPT`) takes sequences of ``block_size`` tokens."""
    limit = getattr(model, "block_size", None)
    if limit is not None and block_size > limit:
        name = getattr(model, "attnlab_model", None) or type(model).__name__
        raise ConfigError(f"block size {block_size} is above {name}'s {limit} positions; give a block size of at "
                          f"most {limit}, or build the model with block_size={block_size}.")


# ---- key/value cache ------------------------------------------------------------------------------------------------
class KVCache:
    """Per-layer :class:`LayerCache` and the number of tokens they hold."""

    def __init__(self, num_layers: int) -> None:
        self.layers = [LayerCache() for _ in range(num_layers)]
        self.length = 0


def supports_kv_cache(model: nn.Module) -> bool:
    """Whether every attention module of ``model`` declares ``kv_cache`` in its record (a new token's query against
    the earlier keys is its exact causal output), and so does each of its head transforms."""
    found = attention_modules(model)
    return bool(found) and all(capabilities_of(m).kv_cache and all(capabilities_of(h).kv_cache for h in m.heads())
                               for _, m in found)


# ---- sampling -------------------------------------------------------------------------------------------------------
def _prompt(model: GPT, tokens) -> torch.Tensor:
    """The prompt as int64 (B, T) on the model's device; ConfigError for an empty one or ids outside the vocabulary."""
    t = torch.as_tensor(tokens)
    if t.numel() == 0:
        raise ConfigError("the prompt is empty; give at least one token.")
    if t.dtype.is_floating_point or t.dtype == torch.bool or t.dim() not in (1, 2):
        raise ConfigError(f"the prompt must be integer token ids of shape (T,) or (B, T), not {t.dtype} of shape "
                          f"{tuple(t.shape)}.")
    t = t.long() if t.dim() == 2 else t.long()[None]
    low, high = int(t.min()), int(t.max())
    if low < 0 or high >= model.vocab_size:
        bad = low if low < 0 else high
        raise ConfigError(f"the prompt holds token id {bad}, outside the model's vocabulary 0..{model.vocab_size - 1};"
                          f" encode it with the tokenizer the model was trained with.")
    return t.to(model.wte.weight.device)


def _check_sampling(max_new_tokens, temperature, top_k) -> None:
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ConfigError(f"max_new_tokens must be an integer >= 0, not {max_new_tokens!r}.")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"temperature must be a finite number >= 0 (0: greedy), not {temperature!r}.")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ConfigError(f"top_k must be an integer >= 1 or None, not {top_k!r}.")


def sample_next(logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None,
                generator: torch.Generator | None = None) -> torch.Tensor:
    """Next token ids (B, 1) from last-position logits (B, vocab): argmax for ``temperature == 0``, else a draw from
    softmax(logits / temperature) restricted to the ``top_k`` largest (nanoGPT's sampling)."""
    if temperature == 0:
        return logits.argmax(dim=-1, keepdim=True)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return torch.multinomial(logits.softmax(dim=-1), num_samples=1, generator=generator)


@torch.no_grad()
def generate(model: GPT, tokens, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, kv_cache: bool | None = None) -> torch.Tensor:
    """The prompt ``tokens`` ((T,) or (B, T) ids) followed by ``max_new_tokens`` sampled tokens, int64 (B, T + new).

    ``temperature`` 0 is greedy; ``top_k`` keeps the k most likely tokens; ``generator`` (on the model's device)
    makes the draws reproducible. ``kv_cache``: None uses the cache where :func:`supports_kv_cache`, False always
    recomputes, True insists (ConfigError where the attention cannot). Runs in eval mode and restores the mode.
    """
    if not isinstance(model, GPT):
        raise ConfigError(f"generate takes an attnlab GPT model (build_model('gpt_tiny', ...)), not "
                          f"{type(model).__name__}.")
    _check_sampling(max_new_tokens, temperature, top_k)
    idx = _prompt(model, tokens)
    can_cache = supports_kv_cache(model)
    if kv_cache and not can_cache:
        raise ConfigError(f"the attention {getattr(model, 'attnlab_spec', 'as built')!r} cannot use a KV cache (its "
                          f"output for a new token is not its query against the earlier keys); use kv_cache=None.")
    cache = KVCache(len(model.blocks)) if (can_cache if kv_cache is None else kv_cache) else None
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            if cache is not None and idx.shape[1] <= model.block_size:
                h = model.forward_features(idx if cache.length == 0 else idx[:, -1:], cache)
            else:  # no cache, or the context outgrew the positions: recompute the last block_size tokens
                cache = None
                h = model.forward_features(idx[:, -model.block_size:])
            idx = torch.cat([idx, sample_next(model.head(h[:, -1]), temperature, top_k, generator)], dim=1)
    finally:
        model.train(was_training)
    return idx


__all__ = ["GELU", "GPT", "GPT_PRESETS", "Block", "KVCache", "LayerCache", "check_block_size", "generate",
           "sample_next", "supports_kv_cache"]
