"""Independent float64 references for the video models and metrics (imports nothing from attnlab).

TimeSformer (Bertasius et al., arXiv 2102.05095, Sec. 3, Fig. 1) written as loops: over frames and patch positions
for the divided attention, over heads inside each attention, with an explicit softmax; the patch embedding as a dot
product per patch. Weights come as a dict of numpy arrays under the authors' parameter names (their
``timesformer/models/vit.py``: ``blocks.i.attn``, ``temporal_attn``, ``temporal_norm1``, ``temporal_fc``, ...).
"""

from __future__ import annotations

import math

import numpy as np

_erf = np.vectorize(math.erf)


def layer_norm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu(x):
    return 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)))


def attention(x, p, prefix, heads):
    """Multi-head softmax self-attention of one sequence x (L, D), one head at a time."""
    L, D = x.shape
    hd = D // heads
    qkv = x @ p[prefix + "qkv.weight"].T + p[prefix + "qkv.bias"]
    q, k, v = qkv[:, :D], qkv[:, D:2 * D], qkv[:, 2 * D:]
    out = np.zeros((L, D))
    for h in range(heads):
        s = slice(h * hd, (h + 1) * hd)
        logits = q[:, s] @ k[:, s].T / math.sqrt(hd)
        w = np.exp(logits - logits.max(-1, keepdims=True))
        w /= w.sum(-1, keepdims=True)
        out[:, s] = w @ v[:, s]
    return out @ p[prefix + "proj.weight"].T + p[prefix + "proj.bias"]


def mlp(x, p, prefix):
    h = gelu(x @ p[prefix + "fc1.weight"].T + p[prefix + "fc1.bias"])
    return h @ p[prefix + "fc2.weight"].T + p[prefix + "fc2.bias"]


def plain_block(seq, p, b, heads):
    """A pre-norm ViT block on one sequence (L, D)."""
    ln = lambda z, n: layer_norm(z, p[f"{b}{n}.weight"], p[f"{b}{n}.bias"])  # noqa: E731
    seq = seq + attention(ln(seq, "norm1"), p, f"{b}attn.", heads)
    return seq + mlp(ln(seq, "norm2"), p, f"{b}mlp.")


def divided_block(cls, x, p, b, heads):
    """One divided space-time block on one clip: cls (D,), x (T, N, D) -> (cls, x)."""
    T, N, _ = x.shape
    ln = lambda z, n: layer_norm(z, p[f"{b}{n}.weight"], p[f"{b}{n}.bias"])  # noqa: E731
    a = x.copy()
    for n in range(N):  # temporal: patch position n across the T frames, no class token
        res = attention(ln(x[:, n], "temporal_norm1"), p, f"{b}temporal_attn.", heads)
        a[:, n] += res @ p[f"{b}temporal_fc.weight"].T + p[f"{b}temporal_fc.bias"]
    out, cls_res = a.copy(), np.zeros_like(cls)
    for t in range(T):  # spatial: frame t with its own copy of the class token
        s = attention(ln(np.concatenate([cls[None], a[t]]), "norm1"), p, f"{b}attn.", heads)
        out[t] += s[1:]
        cls_res += s[0] / T
    cls = cls + cls_res
    cls = cls + mlp(ln(cls, "norm2"), p, f"{b}mlp.")
    for t in range(T):
        out[t] = out[t] + mlp(ln(out[t], "norm2"), p, f"{b}mlp.")
    return cls, out


def timesformer_logits(clip, p, *, heads, depth, patch, attention_type):
    """Logits of one clip (C, T, H, W) under ``attention_type`` divided / joint / space_only."""
    C, T, H, W = clip.shape
    w = p["patch_embed.proj.weight"].reshape(p["patch_embed.proj.weight"].shape[0], -1)
    tokens = []
    for t in range(T):
        frame = []
        for i in range(H // patch):
            for j in range(W // patch):
                piece = clip[:, t, i * patch:(i + 1) * patch, j * patch:(j + 1) * patch].reshape(-1)
                frame.append(w @ piece + p["patch_embed.proj.bias"])
        tokens.append(frame)
    x = np.array(tokens) + p["pos_embed"][0, 1:][None]  # (T, N, D)
    cls = p["cls_token"][0, 0] + p["pos_embed"][0, 0]
    if attention_type == "space_only":
        seqs = [np.concatenate([cls[None], x[t]]) for t in range(T)]
        for i in range(depth):
            seqs = [plain_block(s, p, f"blocks.{i}.", heads) for s in seqs]
        final = np.mean(seqs, axis=0)[0]
    else:
        x = x + p["time_embed"][0][:, None]
        if attention_type == "divided":
            for i in range(depth):
                cls, x = divided_block(cls, x, p, f"blocks.{i}.", heads)
            final = cls
        else:
            seq = np.concatenate([cls[None], x.reshape(-1, x.shape[-1])])
            for i in range(depth):
                seq = plain_block(seq, p, f"blocks.{i}.", heads)
            final = seq[0]
    final = layer_norm(final, p["norm.weight"], p["norm.bias"])
    return final @ p["head.weight"].T + p["head.bias"]
