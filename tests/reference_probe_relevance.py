"""Independent float64 references for the probes' instruments: Chefer's relevance (arXiv:2103.15679, eq. 5) of every
probe over one clip's video tokens at every interaction module, and the DnA branch measures (DnA paper Sec. 4.4), on
VisCoP's probes under the authors' weight names (``encoder.interaction_modules.{k}.q_proj``, ...; DnA: ``q_pos_proj``,
``q_neg_proj``, ``k_proj``, ``v_pos_proj``, ``v_neg_proj``, ``neg_scalers``, o = o+ - neg_scalers_h o-). Per-head,
per-entry loops; each map keeps its gradient (``retain_grad``): dy/dM through every later module, M's own inputs
held. Imports nothing from attnlab.
"""

from __future__ import annotations

import math

import numpy as np
import torch


def _t(a) -> torch.Tensor:
    return torch.as_tensor(np.asarray(a), dtype=torch.float64)


def _lin(x, W, name):
    return x @ _t(W[f"{name}.weight"]).T + _t(W[f"{name}.bias"])


def _heads(x, H):
    """(N, H * D) -> list of H tensors (N, D)."""
    D = x.shape[1] // H
    return [x[:, h * D:(h + 1) * D] for h in range(H)]


def _softmax_rows(s):
    out = torch.empty_like(s)
    for i in range(s.shape[0]):
        e = torch.exp(s[i] - s[i].max())
        out[i] = e / e.sum()
    return out


def probe_maps(keys, W, *, layers, kind, H, score):
    """One sample: ``keys[layer]`` (M, dim) numpy, the block's output over the clip's real frames; ``score`` maps the
    final probes (P, dim) to a scalar. Returns ({branch: [per module (H, P, M) effective maps]}, {branch: [grads]},
    the final probes). Branches: ``attn`` (softmax); DnA ``pos`` (softmax) and ``neg`` (neg_scalers_h * softmin)."""
    P = _t(W["encoder.visual_probes"][0]).requires_grad_(True)  # so that every map is in the graph
    maps = {b: [] for b in (("attn",) if kind == "cross_attention" else ("pos", "neg"))}
    for k, layer in enumerate(layers):
        pre = f"encoder.interaction_modules.{k}"
        X = _t(keys[layer])
        outs = []
        if kind == "cross_attention":
            q, kk, v = (_heads(_lin(t, W, f"{pre}.{n}_proj"), H) for t, n in ((P, "q"), (X, "k"), (X, "v")))
            per_head = []
            for h in range(H):
                D = q[h].shape[1]
                m = _softmax_rows(q[h] @ kk[h].T / math.sqrt(D))
                m.retain_grad()
                per_head.append(m)
                outs.append(m @ v[h])
            maps["attn"].append(per_head)
        else:
            qp, qn = (_heads(_lin(P, W, f"{pre}.{n}"), H) for n in ("q_pos_proj", "q_neg_proj"))
            kk, vp, vn = (_heads(_lin(X, W, f"{pre}.{n}"), H) for n in ("k_proj", "v_pos_proj", "v_neg_proj"))
            alpha = W[f"{pre}.neg_scalers"]
            pos, neg = [], []
            for h in range(H):
                D = qp[h].shape[1]
                mp = _softmax_rows(qp[h] @ kk[h].T / math.sqrt(D))
                mn = (float(alpha[h]) * _softmax_rows(-(qn[h] @ kk[h].T) / math.sqrt(D)))
                mp.retain_grad()
                mn.retain_grad()
                pos.append(mp)
                neg.append(mn)
                outs.append(mp @ vp[h] - mn @ vn[h])  # the authors' sign: the softmin branch subtracted
            maps["pos"].append(pos)
            maps["neg"].append(neg)
        P = _lin(torch.cat(outs, dim=1), W, f"{pre}.out_proj")
    y = score(P)
    y.backward()
    out_maps = {b: [torch.stack([m.detach() for m in layer]) for layer in maps[b]] for b in maps}
    out_grads = {b: [torch.stack([m.grad for m in layer]) for layer in maps[b]] for b in maps}
    return out_maps, out_grads, P.detach()


def relevance(maps, grads):
    """Chefer's eq. 5 per module: R[p, j] = (1/H) sum_h max(dy/dM_h[p, j], 0) * M_h[p, j]; (P, M) per module."""
    out = []
    for m, g in zip(maps, grads):
        H, P, M = m.shape
        r = torch.zeros(P, M, dtype=torch.float64)
        for h in range(H):
            for p in range(P):
                for j in range(M):
                    r[p, j] += max(float(g[h, p, j]), 0.0) * float(m[h, p, j]) / H
        out.append(r)
    return out


def branch_measures(keys, W, *, layers, H, k=10, eps=0.5):
    """One sample's DnA measures per module and head: (intruder count, C(V+, V-), cosine(O+, O-)), with O+ =
    softmax(s+) V+ and O- = softmin(s-) V- before neg_scalers, V the authors' values (C(V+, V-) and the cosine as
    attnlab's V- = -V-: their sign enters both)."""
    P = _t(W["encoder.visual_probes"][0])
    out = []
    for kk_, layer in enumerate(layers):
        pre = f"encoder.interaction_modules.{kk_}"
        X = _t(keys[layer])
        qp, qn = (_heads(_lin(P, W, f"{pre}.{n}"), H) for n in ("q_pos_proj", "q_neg_proj"))
        kk, vp, vn = (_heads(_lin(X, W, f"{pre}.{n}"), H) for n in ("k_proj", "v_pos_proj", "v_neg_proj"))
        alpha = W[f"{pre}.neg_scalers"]
        per_head, outs = [], []
        for h in range(H):
            D = qp[h].shape[1]
            op = _softmax_rows(qp[h] @ kk[h].T / math.sqrt(D)) @ vp[h]
            on = _softmax_rows(-(qn[h] @ kk[h].T) / math.sqrt(D)) @ (-vn[h])
            ua = np.linalg.svd(op.numpy(), full_matrices=False)[0][:, :min(k, *op.shape)]
            ub = np.linalg.svd(on.numpy(), full_matrices=False)[0][:, :min(k, *on.shape)]
            intruders = sum(all(abs(float(ua[:, i] @ ub[:, j])) < eps for j in range(ub.shape[1]))
                            for i in range(ua.shape[1]))

            def cos(a, b):
                return float((a * b).sum() / (a.norm() * b.norm()))
            per_head.append((intruders, cos(vp[h], -vn[h]), cos(op, on)))
            outs.append(op + float(alpha[h]) * on)
        out.append(per_head)
        P = _lin(torch.cat(outs, dim=1), W, f"{pre}.out_proj")
    return out
