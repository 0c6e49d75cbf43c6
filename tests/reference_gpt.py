"""GPT-2's forward written from the architecture in float64, for the GPT tests; imports nothing from attnlab."""

from __future__ import annotations

import math

import torch


def reference_gpt(w: dict, tokens: torch.Tensor, n_head: int, gelu: str = "exact", eps: float = 1e-5) -> torch.Tensor:
    """GPT-2's forward in float64 from nanoGPT-named weights: x_t = wte[tok_t] + wpe[t]; per block
    x += c_proj(causal softmax attention of ln_1(x)), x += c_proj(gelu(c_fc(ln_2(x)))); logits = ln_f(x) lm_head^T."""
    w = {k: v.double() for k, v in w.items()}

    def ln(x, name):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + eps) * w[f"{name}.weight"] + w.get(f"{name}.bias", 0.0)

    def linear(x, name):
        return x @ w[f"{name}.weight"].T + w.get(f"{name}.bias", 0.0)

    def act(x):
        if gelu == "tanh":
            return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
        return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))

    B, N = tokens.shape
    x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][:N]
    depth = len({k.split(".")[2] for k in w if k.startswith("transformer.h.")})
    C = x.shape[-1]
    D = C // n_head
    for i in range(depth):
        p = f"transformer.h.{i}"
        h = ln(x, f"{p}.ln_1")
        q, k, v = linear(h, f"{p}.attn.c_attn").split(C, dim=-1)
        out = torch.zeros_like(h)
        for b in range(B):
            for head in range(n_head):
                cols = slice(head * D, (head + 1) * D)
                for t in range(N):  # query t sees keys 0..t
                    s = (k[b, : t + 1, cols] @ q[b, t, cols]) / math.sqrt(D)
                    a = torch.exp(s - s.max())
                    out[b, t, cols] = (a / a.sum()) @ v[b, : t + 1, cols]
        x = x + linear(out, f"{p}.attn.c_proj")
        x = x + linear(act(linear(ln(x, f"{p}.ln_2"), f"{p}.mlp.c_fc")), f"{p}.mlp.c_proj")
    return ln(x, "transformer.ln_f") @ w["lm_head.weight"].T
