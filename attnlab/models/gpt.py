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
from collections.abc import Mapping
from functools import partial

import torch
import torch.nn.functional as F
from timm.layers import Attention, Mlp
from torch import nn

from ..attention.base import LayerCache
from ..attention.capabilities import capabilities_of
from ..errors import ConfigError
from .convert import attention_modules
from .options import divisors, finite_above, flag, is_int, positive_int, real, refuse

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


class DecoderLM(nn.Module):
    """What GPT and Llama share: a causal decoder over token ids whose ``forward_features`` runs ``embed``, the
    blocks (each with an optional :class:`LayerCache`) and the final norm, and whose logits are ``head`` of that.
    A subclass builds ``wte``, ``blocks`` and ``norm`` and defines ``embed`` (its positions) and ``head``; the
    language-model task, :func:`generate` and the KV cache take any subclass. Holds no parameters of its own, so
    the subclasses' state-dict names are theirs."""

    #: every attention is causal: :func:`attnlab.convert` refuses a term without a causal form when it is built
    causal = True

    def __init__(self, vocab_size: int, block_size: int, embed_dim: int) -> None:
        super().__init__()
        self.vocab_size, self.block_size, self.embed_dim = vocab_size, block_size, embed_dim

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The blocks' input for tokens (B, N) at positions start, start + 1, ..."""
        raise NotImplementedError

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab) of hidden states (..., embed_dim)."""
        raise NotImplementedError

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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int (B, N), N <= block_size -> next-token logits (B, N, vocab_size); position i sees tokens 0..i."""
        return self.head(self.forward_features(tokens))

    def extra_repr(self) -> str:
        return f"vocab_size={self.vocab_size}, block_size={self.block_size}"

    def example_input(self, batch: int = 1, device=None) -> torch.Tensor:
        """Token ids (batch, block_size), zeros (operation counts, shape checks)."""
        return torch.zeros(batch, self.block_size, dtype=torch.long, device=device)


def gpt_options(values: Mapping[str, object], owner: str = "GPT", names: Mapping[str, str] | None = None) -> dict:
    """:class:`GPT`'s keyword arguments checked value by value (the one check of every value it reads, from the
    constructor, ``build_model``'s options or a checkpoint's recorded geometry; ``names``: attnlab's key -> the
    key the user wrote, e.g. nanoGPT's ``n_head``): ConfigError in one sentence naming the key, the value and a
    right one. Sizes are positive integers, ``num_heads`` divides ``embed_dim``, ``mlp_ratio`` a finite number above
    0 giving at least one hidden unit, dropout rates in [0, 1), ``bias`` True or False, ``gelu`` exact or tanh."""
    def name(key: str) -> str:
        return (names or {}).get(key, key)

    g = {key: positive_int(owner, name(key), values.get(key), example)
         for key, example in (("vocab_size", 256), ("block_size", 256), ("embed_dim", 128), ("depth", 4))}
    dim, heads = g["embed_dim"], values.get("num_heads")
    if not (is_int(heads) and heads >= 1 and dim % heads == 0):
        best = min(divisors(dim), key=lambda h: abs(dim // h - 64))
        raise refuse(owner, name("num_heads"), heads, f"a positive integer dividing {name('embed_dim')} {dim}",
                     f"one such as {best} (head_dim {dim // best})")
    ratio = finite_above(owner, name("mlp_ratio"), values.get("mlp_ratio"), 0.0, "one such as 4.0 (GPT-2)")
    if int(dim * ratio) < 1:
        raise refuse(owner, name("mlp_ratio"), values.get("mlp_ratio"), f"a ratio giving {name('embed_dim')} {dim} "
                     f"at least one hidden unit", "one such as 4.0 (GPT-2)")
    for key in ("drop_rate", "attn_drop_rate"):
        rate = real(values.get(key))
        if rate is None or not 0.0 <= rate < 1.0:
            raise refuse(owner, name(key), values.get(key), "a probability in [0, 1)", "one such as 0.0 or 0.1")
        g[key] = rate
    gelu = values.get("gelu")
    if not isinstance(gelu, str) or gelu not in GELU:
        raise refuse(owner, name("gelu"), gelu, f"one of {', '.join(GELU)}", "exact (nanoGPT) or tanh (Hugging Face "
                     "GPT-2's gelu_new)")
    norm = values.get("norm_layer")
    if norm is not None and not callable(norm):
        raise refuse(owner, name("norm_layer"), norm, "a module class", "None for LayerNorm (norm='none' for none)")
    return dict(g, num_heads=heads, mlp_ratio=ratio, bias=flag(owner, name("bias"), values.get("bias")), gelu=gelu,
                norm_layer=norm)


class GPT(DecoderLM):
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

    Every value is checked by :func:`gpt_options`.
    """

    def __init__(self, vocab_size: int = 256, block_size: int = 256, embed_dim: int = 128, depth: int = 4,
                 num_heads: int = 4, mlp_ratio: float = 4.0, bias: bool = True, drop_rate: float = 0.0,
                 attn_drop_rate: float = 0.0, gelu: str = "exact", norm_layer: type[nn.Module] | None = None) -> None:
        o = gpt_options(dict(vocab_size=vocab_size, block_size=block_size, embed_dim=embed_dim, depth=depth,
                             num_heads=num_heads, mlp_ratio=mlp_ratio, bias=bias, drop_rate=drop_rate,
                             attn_drop_rate=attn_drop_rate, gelu=gelu, norm_layer=norm_layer))
        super().__init__(o["vocab_size"], o["block_size"], o["embed_dim"])
        bias, depth, embed_dim = o["bias"], o["depth"], o["embed_dim"]
        norm_layer = o["norm_layer"] or partial(nn.LayerNorm, eps=1e-5, bias=bias)
        self.wte = nn.Embedding(o["vocab_size"], embed_dim)
        self.wpe = nn.Embedding(o["block_size"], embed_dim)
        self.drop = nn.Dropout(o["drop_rate"])
        act = partial(nn.GELU, approximate="none" if o["gelu"] == "exact" else "tanh")
        self.blocks = nn.ModuleList([
            Block(embed_dim, o["num_heads"], o["mlp_ratio"], bias, o["drop_rate"], o["attn_drop_rate"], act,
                  norm_layer)
            for _ in range(depth)])
        self.norm = norm_layer(embed_dim)
        self.apply(_init_weights)
        for block in self.blocks:  # GPT-2's scaled init of the projections that write to the residual stream
            for proj in (block.attn.proj, block.mlp.fc2):
                nn.init.normal_(proj.weight, mean=0.0, std=0.02 / math.sqrt(2 * depth))

    def embed(self, tokens: torch.Tensor, start: int) -> torch.Tensor:
        """The blocks' input for tokens (B, N) at positions start, start + 1, ...: token and learned positions."""
        return self.drop(self.wte(tokens) + self.wpe(torch.arange(start, start + tokens.shape[-1],
                                                                  device=tokens.device)))

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits (..., vocab) of hidden states (..., embed_dim): the tied head, h wte^T."""
        return F.linear(h, self.wte.weight)


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
def _prompt(model: DecoderLM, tokens) -> torch.Tensor:
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
def generate(model: DecoderLM, tokens, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
             generator: torch.Generator | None = None, kv_cache: bool | None = None) -> torch.Tensor:
    """The prompt ``tokens`` ((T,) or (B, T) ids) followed by ``max_new_tokens`` sampled tokens, int64 (B, T + new).

    ``temperature`` 0 is greedy; ``top_k`` keeps the k most likely tokens; ``generator`` (on the model's device)
    makes the draws reproducible. ``kv_cache``: None uses the cache where :func:`supports_kv_cache`, False always
    recomputes, True insists (ConfigError where the attention cannot). Runs in eval mode and restores the mode.
    """
    if not isinstance(model, DecoderLM):
        raise ConfigError(f"generate takes an attnlab language model (build_model('gpt_tiny') or 'llama_tiny'), "
                          f"not {type(model).__name__}.")
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


__all__ = ["GELU", "GPT", "DecoderLM", "gpt_options", "GPT_PRESETS", "Block", "KVCache", "LayerCache",
           "check_block_size", "generate",
           "sample_next", "supports_kv_cache"]
