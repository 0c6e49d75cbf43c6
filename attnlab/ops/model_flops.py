"""Training FLOPs per token of a decoder-only language model, device peaks, and model FLOPs utilisation (MFU).

PaLM's accounting (Chowdhery et al., "PaLM: Scaling Language Modeling with Pathways", arXiv:2204.02311, Appendix B;
the same terms as Chinchilla's, Hoffmann et al., arXiv:2203.15556, Appendix F, without its non-matmul terms):

    FLOPs per token (forward + backward) = 6 N + 12 L T d_attn

N counts the weights that multiply activations: every Linear of the blocks and the output head (V d, tied or not);
the input embedding is a lookup and counts nothing. A weight W (d_in x d_out) costs 2 d_in d_out per token forward
and twice that backward (the gradients of input and weight): 6 per weight. Attention adds, per layer and token,
q k^T and A v over the T keys of a length-T sequence: 2 x 2 T d_attn forward (d_attn = heads x head_dim, the query
heads: grouped keys save projection weights, not attention products), times 3 with the backward. The full T x T is
counted, the causal half included, as PaLM and FlopCounterMode count it. Norms, softmax, rotary, the loss and
optimizer are left out (a few percent at these widths). These are *model* FLOPs: a backward that recomputes the
scores (fused SDPA, activation checkpointing) does more work than it counts.

MFU = tokens per second x FLOPs per token / the device's peak (dense bfloat16 tensor-core FLOP/s, :data:`PEAK_BF16`,
keyed by ``torch.cuda.get_device_name()``).
"""

from __future__ import annotations

import re

#: dense (no 2:4 sparsity) bfloat16 tensor-core peaks in FLOP/s from the vendors' datasheets, matched against
#: ``torch.cuda.get_device_name()`` in this order (the first pattern found wins: "H100 PCIe" before "H100")
PEAK_BF16: tuple[tuple[str, float, str], ...] = (
    (r"GH200", 989.4e12, "NVIDIA GH200 (H100 SXM compute)"),
    (r"H200 NVL", 835.5e12, "NVIDIA H200 NVL"),
    (r"H200", 989.4e12, "NVIDIA H200 SXM"),
    (r"H100 NVL", 835.5e12, "NVIDIA H100 NVL"),
    (r"H100 PCIe", 756.5e12, "NVIDIA H100 PCIe"),
    (r"H100", 989.4e12, "NVIDIA H100 SXM"),
    (r"H800", 989.4e12, "NVIDIA H800 SXM"),
    (r"A100", 312e12, "NVIDIA A100 (SXM and PCIe)"),
    (r"A800", 312e12, "NVIDIA A800"),
    (r"L40S", 362.05e12, "NVIDIA L40S"),
    (r"\bL40\b", 181.05e12, "NVIDIA L40"),
    (r"\bL4\b", 121e12, "NVIDIA L4"),
    (r"MI300X", 1307.4e12, "AMD Instinct MI300X"),
)


def peak_bf16(device_name: str) -> float | None:
    """The dense bfloat16 peak (FLOP/s) of ``device_name`` (``torch.cuda.get_device_name()``), None when unknown."""
    for pattern, peak, _ in PEAK_BF16:
        if re.search(pattern, device_name):
            return peak
    return None


def lm_flops_per_token(*, depth: int, embed_dim: int, num_heads: int, head_dim: int, num_kv_heads: int,
                       mlp_hidden: int, vocab_size: int, seq_len: int, mlp_matrices: int = 3) -> int:
    """Training FLOPs per token (module docstring) of a decoder of ``depth`` blocks: q (H D), k and v (H_kv D each),
    the output projection, ``mlp_matrices`` d x hidden MLP matrices (3 for SwiGLU, 2 for a GELU MLP), the head."""
    attn_dim, kv_dim = num_heads * head_dim, num_kv_heads * head_dim
    per_block = embed_dim * (attn_dim + 2 * kv_dim) + attn_dim * embed_dim + mlp_matrices * embed_dim * mlp_hidden
    n = depth * per_block + vocab_size * embed_dim
    return 6 * n + 12 * depth * seq_len * attn_dim


def model_flops_per_token(model, seq_len: int) -> int:
    """:func:`lm_flops_per_token` read off a built model (attnlab's GPT or Llama, any attention spec): N from its
    Linear layers plus the head, the attention term from each attention module's query heads x head_dim."""
    from torch import nn

    n = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    if getattr(model, "lm_head", None) is None and hasattr(model, "wte"):
        n += model.wte.weight.numel()  # the tied head multiplies by the embedding matrix
    attn = 0
    for m in model.modules():
        if hasattr(m, "num_heads") and hasattr(m, "head_dim") and hasattr(m, "qkv"):
            attn += m.num_heads * m.head_dim
    return 6 * n + 12 * seq_len * attn


def mfu(tokens_per_second: float, flops_per_token: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: the fraction of ``peak`` the counted FLOPs reach; None without a peak."""
    if not peak:
        return None
    return tokens_per_second * flops_per_token / peak


__all__ = ["PEAK_BF16", "lm_flops_per_token", "mfu", "model_flops_per_token", "peak_bf16"]
