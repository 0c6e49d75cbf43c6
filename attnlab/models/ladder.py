"""The size ladder: Llama-shaped decoders from about 10M to about 1B parameters, scaled as Wortsman et al. scale
theirs ("Small-scale proxies for large-scale Transformer training instabilities", arXiv:2309.14322, Section 2.1).

    width d, head dimension 64, heads = d / 64, depth L = d / 64 (width and depth grow together)
    SwiGLU hidden h = 8d/3 rounded up to a multiple of 32 (3 d h = the 8 d^2 of a 4d GELU MLP, to rounding)
    no biases, untied input and output embeddings, 512 positions, a 32k vocabulary (their T5 tokenizer's size;
    a run's dataset sets the real one), multi-head attention (no grouped keys), RoPE theta 1e4, RMSNorm

    parameters = 2 V d (embeddings) + L (4 d^2 + 3 d h + 2 d) + d (final norm)

Initialisation (``init``): ``wortsman`` (their default, as JAX/Flax draws it): every Linear W ~ truncated normal
with variance 1/fan_in (cut at two standard deviations of the untruncated normal, whose std is raised by
1/0.8796 so that the truncated one has variance 1/fan_in), the embedding N(0, 1/d), norms at 1; or ``llama``:
N(0, 0.02) for every matrix, norms at 1 (Llama's, and :class:`~attnlab.models.llama.Llama`'s default).

docs/methods.md ("The size ladder") gives every rung's width, depth, heads and parameter count, and says which of
the rule is read from the paper's summaries and which is attnlab's choice (the list of widths).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..errors import ConfigError
from .llama import Llama

INITS = ("wortsman", "llama")
HEAD_DIM = 64
#: widths of the ladder: d / 64 heads and layers each; d128 to d256 are the CPU-sized rungs of the same rule
WIDTHS = (128, 192, 256, 384, 512, 640, 768, 1024, 1280, 1536, 1792)
VOCAB = 32000
BLOCK = 512
_TRUNC_STD = 0.87962566103423978  # std of a unit normal truncated to [-2, 2] (jax.nn.initializers.variance_scaling)


def swiglu_hidden(width: int) -> int:
    """8 width / 3 rounded up to a multiple of 32 (:class:`Llama`'s default)."""
    return -(-8 * width // 3 // 32) * 32


def rung(width: int) -> dict:
    """The :class:`LadderLlama` keyword arguments of the rung of ``width``."""
    depth = width // HEAD_DIM
    return dict(vocab_size=VOCAB, block_size=BLOCK, embed_dim=width, depth=depth, num_heads=depth,
                num_kv_heads=depth, mlp_hidden=swiglu_hidden(width), tie_embeddings=False)


def count_parameters(width: int, vocab: int = VOCAB) -> tuple[int, int]:
    """(parameters without the two embedding matrices, all parameters) of the rung of ``width`` (module docstring)."""
    depth, hidden = width // HEAD_DIM, swiglu_hidden(width)
    body = depth * (4 * width * width + 3 * width * hidden + 2 * width) + width
    return body, body + 2 * vocab * width


def init_wortsman(model: nn.Module) -> None:
    """Wortsman et al.'s initialisation in place: Linear ~ truncated normal, variance 1/fan_in; embeddings N(0, 1/d);
    norms at 1 and biases at 0 (module docstring)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                std = 1.0 / math.sqrt(module.in_features) / _TRUNC_STD
                nn.init.trunc_normal_(module.weight, std=std, a=-2 * std, b=2 * std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.embedding_dim))


class LadderLlama(Llama):
    """:class:`Llama` with the ladder's initialisation choice: ``init="wortsman"`` (default) or ``"llama"``;
    every other argument is :class:`Llama`'s."""

    def __init__(self, *args, init: str = "wortsman", **kwargs) -> None:
        if init not in INITS:
            raise ConfigError(f"the ladder's init must be one of {', '.join(INITS)}, not {init!r}.")
        super().__init__(*args, **kwargs)
        self.init = init
        if init == "wortsman":
            init_wortsman(self)


def _doc(width: int) -> str:
    kw, (body, total) = rung(width), count_parameters(width)
    return (f"size ladder (Wortsman et al. 2023's scaling: head dim 64, heads = layers = width/64): {kw['depth']} "
            f"layers, {kw['num_heads']} heads, dim {width}, SwiGLU {kw['mlp_hidden']}, untied, no biases, 512 "
            f"positions, vocab 32000; {body / 1e6:.1f}M parameters without embeddings, {total / 1e6:.1f}M with; "
            f"init=wortsman (default) or llama")


#: the presets: kwargs of :class:`LadderLlama` and a line of documentation
LADDER_PRESETS: dict[str, tuple[dict, str]] = {f"ladder_d{w}": (rung(w), _doc(w)) for w in WIDTHS}

__all__ = ["INITS", "LADDER_PRESETS", "LadderLlama", "WIDTHS", "count_parameters", "init_wortsman", "rung",
           "swiglu_hidden"]
