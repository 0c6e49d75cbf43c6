"""VisCoP's visual probes (Reilly et al., "VisCoP: Visual Probing for Domain Adaptation of Vision Language
Models", arXiv:2510.13808), with the interaction module of a spec term (DnA, Sec. 3.3, "Video LLM").

    P^0 = probes (P learnable tokens, N(0, 0.02)), the same for every sample
    P <- IM_l(P, X^l)   after encoder block l, for l in ``layers`` (``all``: every block), in block order

X^l: block l's raw output (no norm, no rotary) over ALL frames of the sample, padded frames excluded (key padding).
The module's output REPLACES the probes: no residual, no norm. The encoder's own path does not depend on the probes,
so the probes run after the encoder on its per-layer hidden states (what the authors' interleaved loop computes).

Warm start (the authors' ``train_viscop.py``, default on): interaction module k takes the self-attention weights of
an encoder block, W_Q, W_K, W_V and the output projection (DnA: as Q+, K, V+, and Q- = |neg_init| Q, V- = neg_init V,
the term's ``neg_init``, 1e-4 by default, Table 13's scales selectable). ``warm_start="block"`` copies from the block
the module sits after; ``"position"`` is the authors' rule literally (module k from block k, which is the same for
``all``); ``"none"`` keeps the fresh init. docs/methods.md, "Video LLM: VisCoP probes", says where the authors' rule
fails or differs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..attention.mask import AttentionMask
from ..errors import ConfigError
from ..spec import Spec
from .interaction import build_interaction, interaction_term

WARM_STARTS = ("block", "position", "none")


def resolve_layers(layers: str | Sequence[int], depth: int) -> tuple[int, ...]:
    """The blocks after which a probe update runs: ``"all"`` or indices in [0, depth), sorted, each once."""
    if isinstance(layers, str):
        if layers == "all":
            return tuple(range(depth))
        try:
            layers = [int(t) for t in layers.split(",") if t.strip()]
        except ValueError:
            raise ConfigError(f"probe layers are 'all' or block indices like '3,7,11', not {layers!r}.") from None
    layers = [int(i) for i in layers]
    bad = [i for i in layers if not 0 <= i < depth]
    if bad or not layers or len(set(layers)) != len(layers):
        raise ConfigError(f"probe layers must be distinct block indices from 0 to {depth - 1} (or 'all'); got "
                          f"{list(layers)}.")
    return tuple(sorted(layers))


def attention_projections(attn: nn.Module) -> tuple[nn.Linear, nn.Linear, nn.Linear, nn.Linear]:
    """(q, k, v, proj) Linears holding a self-attention's weights: an attnlab module (DnA: its Q+, K, V+) or timm's
    ``Attention`` (fused ``qkv``)."""
    if getattr(attn, "num_kv_heads", attn.num_heads) != attn.num_heads:
        raise ConfigError("the warm start copies an encoder block's keys into the probes' cross-attention, which has "
                          "one key head per query head; this encoder groups its keys (warm_start='none').")
    if hasattr(attn, "projection"):  # DnA self-attention: its positive branch (a shared Q or V serves as both)
        parts = [attn.projection(n) for n in ("q_pos", "k", "v_pos")]
    else:
        w, b = attn.qkv.weight.detach(), attn.qkv.bias
        parts = list(zip(w.chunk(3), b.detach().chunk(3) if b is not None else (None,) * 3))
    linears = []
    for weight, bias in parts:
        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                        dtype=weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias)
        linears.append(lin)
    return (*linears, attn.proj)


class VisualProbes(nn.Module):
    """The probes and their interaction modules (module docstring).

    Args:
        dim: the encoder's width (probes, keys and values).
        num_heads: heads of each interaction module (VisCoP: the encoder's).
        depth: the encoder's blocks.
        num_probes: P (VisCoP's DnA script: 16).
        layers: ``"all"``, ``"3,7,11"`` or a list of block indices.
        attn: the interaction modules' spec term: ``standard`` or ``dna(...)``.
    """

    def __init__(self, dim: int, num_heads: int, depth: int, num_probes: int = 16,
                 layers: str | Sequence[int] = "all", attn: str | Spec = "standard") -> None:
        super().__init__()
        if num_probes < 1:
            raise ConfigError(f"num_probes must be at least 1, not {num_probes}.")
        self.layers = resolve_layers(layers, depth)
        self.term = interaction_term(attn)
        self.probes = nn.Parameter(torch.empty(1, num_probes, dim))
        nn.init.normal_(self.probes, std=0.02)
        self.interaction_modules = nn.ModuleList(build_interaction(self.term, dim, num_heads) for _ in self.layers)

    @property
    def num_probes(self) -> int:
        return self.probes.shape[1]

    def forward(self, hidden_states: Sequence[torch.Tensor | None], key_padding: torch.Tensor | None = None
                ) -> torch.Tensor:
        """``hidden_states[l]``: block l's output over all frames of each sample (B, M, dim) (None for blocks
        without a module); ``key_padding``: (B, M) bool, True at real tokens. Returns the probes (B, P, dim)."""
        B = next(h for h in hidden_states if h is not None).shape[0]
        mask = None if key_padding is None or bool(key_padding.all()) else AttentionMask(key_padding=key_padding)
        probes = self.probes.expand(B, -1, -1)
        for layer, module in zip(self.layers, self.interaction_modules):
            probes = module(probes, hidden_states[layer], attn_mask=mask)
        return probes

    @torch.no_grad()
    def warm_start(self, attentions: Sequence[nn.Module], rule: str = "block") -> "VisualProbes":
        """Copy the encoder blocks' self-attentions ``attentions`` (one per block) into the interaction modules by
        ``rule`` (module docstring); DnA's negative branch becomes the scaled copy of its ``neg_init``. Returns
        self."""
        if rule not in WARM_STARTS:
            raise ConfigError(f"warm_start is one of {', '.join(WARM_STARTS)}, not {rule!r}.")
        if rule == "none":
            return self
        for k, module in enumerate(self.interaction_modules):
            source = attentions[self.layers[k] if rule == "block" else k]
            if hasattr(module, "init"):  # DnA: Q-, V- as scaled copies, whatever the term's init for conversion
                module.init = "copy"
            module.copy_from(*attention_projections(source))
        return self


__all__ = ["VisualProbes", "WARM_STARTS", "attention_projections", "resolve_layers"]
