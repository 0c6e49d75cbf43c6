"""A toy attention mechanism for the registry suite: one file and one registry entry make a method, and the suite
(build, forward, backward, state dict, tracing, masks, map instruments) runs on it like on every registered term.

    o_h = softmax(q_h k_h^T / (sqrt(D) * temperature) + bias) v_h
"""

from __future__ import annotations

from attnlab.attention.base import AttnlabAttention, Branch, Capabilities


class ToyAttention(AttnlabAttention):
    """Softmax attention at a temperature; arguments as :class:`AttnlabAttention` plus ``temperature``."""

    capabilities = Capabilities(explicit_maps=True)  # every mask honoured; maps; the explicit path

    def __init__(self, dim: int, num_heads: int = 8, *, temperature: float = 2.0, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.temperature = temperature

    def weights(self, q, k, mask=None):
        return self.add_bias((q * (self.scale / self.temperature)) @ k.transpose(-2, -1), mask).softmax(dim=-1)

    def attend(self, q, k, v, mask=None):
        return self.attn_drop(self.weights(q, k, mask)) @ v

    def explicit_maps(self, x, mask=None):
        q, k, v = self.project(x)
        w = self.weights(q, k, mask)
        return self.finish(w @ v, mask, x), {"attn": Branch(w, w)}
