"""A toy attention mechanism for the registry suite: one file and one registry entry make a method, and the suite
(build, forward, backward, state dict, tracing, masks, map instruments, the attention Jacobian, the KV cache) runs on
it like on every registered term, as far as its record declares.

    o_h = softmax(q_h k_h^T / (sqrt(D) * temperature) + bias) v_h
"""

from __future__ import annotations

from attnlab.attention.base import AttnlabAttention, Branch, Capabilities, Intermediates


class ToyAttention(AttnlabAttention):
    """Softmax attention at a temperature; arguments as :class:`AttnlabAttention` plus ``temperature``."""

    #: every mask honoured; a KV cache; weight maps and single heads; the explicit backend
    capabilities = Capabilities(kv_cache=True, intermediates=("weights", "head"))

    def __init__(self, dim: int, num_heads: int = 8, *, temperature: float = 2.0, **kwargs) -> None:
        super().__init__(dim, num_heads, **kwargs)
        self.temperature = temperature

    def kernel(self, q, k, v, mask, want, backend):
        w = self.softmax((q * (self.scale / self.temperature)) @ k.transpose(-2, -1), mask)
        return self.attn_drop(w) @ v, Intermediates(weights={"attn": Branch(w, w)} if want.weights else None)
