"""Independent float64 references for the video LLM family: VideoLLaMA3's SigLIP-NaViT encoder and VisCoP's visual
probes, written from the papers' formulas and VideoLLaMA3's processor layout with per-token, per-head loops in numpy.
Weights are dicts under the authors' names (``encoder.layers.0.self_attn.q_proj.weight``, ...). Imports nothing
from attnlab.

Only the rotary angles are float32, as VideoLLaMA3 computes them (f_j = theta^(-4j/D) and r f_j, c f_j); their
cosines and everything else are float64.
"""

from __future__ import annotations

import math

import numpy as np

from tests.reference_dna import dna_cross_attention, softmax_row, split_heads


def layer_norm(x, w, b, eps):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + eps) * w + b


def gelu_tanh(x):
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def frame_patches(frame, p, m):
    """One frame (C, H, W) -> (patches (N, C*p*p), rows (N,), cols (N,)), in merge-block order: m x m blocks in
    raster order, the patches of each block in raster order; a patch flattened as (C, p, p)."""
    _, H, W = frame.shape
    patches, rows, cols = [], [], []
    for br in range(H // p // m):
        for bc in range(W // p // m):
            for i in range(m):
                for j in range(m):
                    r, c = br * m + i, bc * m + j
                    patches.append(frame[:, r * p:(r + 1) * p, c * p:(c + 1) * p].reshape(-1))
                    rows.append(r)
                    cols.append(c)
    return np.stack(patches), np.array(rows), np.array(cols)


def rotary_angles(rows, cols, head_dim, theta=10000.0):
    """(N, D/2) angles: [r f_0 .. r f_{D/4-1}, c f_0 .. c f_{D/4-1}], f_j = theta^(-4j/D), in float32."""
    half = head_dim // 2
    inv = (np.float32(1.0) / (np.float32(theta) ** (np.arange(0, half, 2, dtype=np.float32) / np.float32(half))))
    r = rows.astype(np.float32)[:, None] * inv[None, :]
    c = cols.astype(np.float32)[:, None] * inv[None, :]
    return np.concatenate([r, c], axis=1).astype(np.float64)


def rotate(x, angles):
    """x (N, D) (one head), feature i paired with i + D/2 at angle angles[:, i]."""
    half = x.shape[1] // 2
    out = np.empty_like(x)
    for n in range(x.shape[0]):
        for i in range(half):
            a, x1, x2 = angles[n, i], x[n, i], x[n, i + half]
            out[n, i] = x1 * math.cos(a) - x2 * math.sin(a)
            out[n, i + half] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def linear(x, W, name):
    return x @ W[f"{name}.weight"].T + W[f"{name}.bias"]


def self_attention(x, W, prefix, H, angles):
    """One frame's tokens x (N, dim): rotary multi-head softmax self-attention."""
    q, k, v = (split_heads(linear(x, W, f"{prefix}.{n}_proj"), H) for n in "qkv")
    D = q.shape[2]
    out = np.zeros_like(q)
    for h in range(H):
        qh, kh = rotate(q[h], angles), rotate(k[h], angles)
        for i in range(x.shape[0]):
            w = softmax_row(np.array([qh[i] @ kh[j] for j in range(x.shape[0])]) / math.sqrt(D))
            out[h, i] = w @ v[h]
    return linear(out.transpose(1, 0, 2).reshape(x.shape[0], -1), W, f"{prefix}.out_proj")


def navit(frames, W, *, depth, H, p, m, eps=1e-6):
    """SigLIP-NaViT on frames (F, C, H, W): (each block's output per frame [layer][frame] (N, dim), the merged
    visual tokens per frame [frame] (N / m^2, dim), the block mean for m <= 2)."""
    hidden = [[] for _ in range(depth)]
    tokens = []
    conv_w = W["embeddings.patch_embedding.weight"]
    for frame in frames:
        patches, rows, cols = frame_patches(frame, p, m)
        x = patches @ conv_w.reshape(conv_w.shape[0], -1).T + W["embeddings.patch_embedding.bias"]
        angles = rotary_angles(rows, cols, x.shape[1] // H)
        for layer in range(depth):
            pre = f"encoder.layers.{layer}"
            x = x + self_attention(layer_norm(x, W[f"{pre}.layer_norm1.weight"], W[f"{pre}.layer_norm1.bias"], eps),
                                   W, f"{pre}.self_attn", H, angles)
            h = layer_norm(x, W[f"{pre}.layer_norm2.weight"], W[f"{pre}.layer_norm2.bias"], eps)
            x = x + linear(gelu_tanh(linear(h, W, f"{pre}.mlp.fc1")), W, f"{pre}.mlp.fc2")
            hidden[layer].append(x)
        out = layer_norm(x, W["post_layernorm.weight"], W["post_layernorm.bias"], eps)
        tokens.append(out.reshape(-1, m * m, out.shape[1]).mean(axis=1))  # a block's m*m tokens are consecutive
    return hidden, tokens


def cross_attention(x, ctx, W, prefix, H):
    """Softmax cross-attention: queries from x (N, dim), keys and values from ctx (M, dim)."""
    q = split_heads(linear(x, W, f"{prefix}.q_proj"), H)
    k, v = (split_heads(linear(ctx, W, f"{prefix}.{n}_proj"), H) for n in "kv")
    D = q.shape[2]
    out = np.zeros_like(q)
    for h in range(H):
        for i in range(x.shape[0]):
            out[h, i] = softmax_row(np.array([q[h, i] @ k[h, j] for j in range(ctx.shape[0])]) / math.sqrt(D)) @ v[h]
    return linear(out.transpose(1, 0, 2).reshape(x.shape[0], -1), W, f"{prefix}.out_proj")


def probes(keys, W, *, layers, kind, H):
    """VisCoP's probes of ONE sample: ``keys[layer]`` (M, dim), that block's output over the sample's real frames;
    P^0 = ``encoder.visual_probes``; after block l = layers[k], P = IM_k(P, keys[l]), replacing P. ``kind``:
    ``cross_attention`` or ``cross_denoising_attention`` (o+ - neg_scalers_h * o-, the authors' sign)."""
    P = W["encoder.visual_probes"][0]
    for k, layer in enumerate(layers):
        pre = f"encoder.interaction_modules.{k}"
        if kind == "cross_attention":
            P = cross_attention(P, keys[layer], W, pre, H)
        else:
            names = {"q_pos": "q_pos_proj", "q_neg": "q_neg_proj", "k": "k_proj", "v_pos": "v_pos_proj",
                     "v_neg": "v_neg_proj"}
            weights = {n: W[f"{pre}.{t}.weight"] for n, t in names.items()}
            biases = {n: W[f"{pre}.{t}.bias"] for n, t in names.items()}
            D = P.shape[1] // H
            P = dna_cross_attention(P, keys[layer], weights, biases, W[f"{pre}.out_proj.weight"],
                                    W[f"{pre}.out_proj.bias"], H, -W[f"{pre}.neg_scalers"], D ** -0.5, D ** -0.5)
    return P
