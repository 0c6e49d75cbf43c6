"""DnA's instruments (DnA paper Sec. 4.4, Appendix C.5 (D); :mod:`attnlab.analysis.dna`) on VisCoP's interaction
modules, the probes' cross-DnA (Sec. 3.3, "Video LLM"): per interaction module, clip and head, from the real forward's
branch outputs O+, O- (P probes x D, before alpha) and values V+, V- (the clip's real video tokens x D):

- intruder dimensions between O+ and O- (k = 10, at most min(P, D); eps = cos(pi/3)),
- C(V+, V-) = <V+, V->_F / (||V+||_F ||V-||_F) over the clip's real tokens (padded frames left out),
- the branch cosine <O+, O->_F / (||O+||_F ||O-||_F),
- alpha's mean, max, min and SD over heads per module.

The measures are :mod:`attnlab.analysis.dna`'s functions; only the forward differs (clips through a
:class:`VisCoPEncoder`, the interaction modules read by
:func:`attnlab.analysis.probe_relevance.interaction_intermediates`).
"""

from __future__ import annotations

import torch
from torch import nn

from ..attention.base import Want
from ..errors import UnsupportedModelError
from .dna import (DEFAULT_EPS, DEFAULT_K, MEASURES, BranchInstruments, alpha_stats, branch_cosine, intruder_dimensions,
                  value_similarity)
from .maps import eval_mode
from .probe_relevance import interaction_intermediates, token_layout


@torch.no_grad()
def probe_branch_instruments(vision: nn.Module, clips: torch.Tensor, num_frames: torch.Tensor | None = None,
                             merge_size: int = 1, k: int = DEFAULT_K, eps: float = DEFAULT_EPS,
                             batch_size: int = 8) -> BranchInstruments:
    """Run the :class:`VisCoPEncoder` ``vision`` (eval mode, no grad) on clips (B, T, C, H, W) with ``num_frames``
    real frames each, and measure every DnA interaction module per clip and head (module docstring). The layers are
    named ``interaction_modules.{k} (block l)``. UnsupportedModelError for standard probes."""
    probes = vision.probes
    if probes.term.name != "dna":
        raise UnsupportedModelError(f"the probes' interaction modules are {probes.term.name} cross-attention; DnA's "
                                    f"instruments need two branches: build the probes with attn='dna(...)'.")
    n = len(probes.interaction_modules)
    parts = [{key: [] for key in MEASURES} for _ in range(n)]
    frames = None if num_frames is None else torch.as_tensor(num_frames)
    T = clips.shape[1]
    prefix, h, w, _ = token_layout(vision.encoder, clips.shape[-2], clips.shape[-1], merge_size)
    per_frame = prefix + h * w  # keys per frame: every block's output over one frame
    current: dict = {}

    def record(index, found):
        (o_pos, o_neg), (v_pos, v_neg) = found.branches, found.values
        real = current["keys"].to(v_pos.device)  # (b, M): the clip's real tokens
        sims = torch.stack([value_similarity(v_pos[i][:, real[i]], v_neg[i][:, real[i]]) for i in range(len(real))])
        values = intruder_dimensions(o_pos, o_neg, k, eps), sims, branch_cosine(o_pos, o_neg)
        for key, value in zip(MEASURES, values):
            parts[index][key].append(value.cpu())

    with interaction_intermediates(vision, Want(branches=True), record), eval_mode(vision) as device:
        for start in range(0, clips.shape[0], batch_size):
            chunk = clips[start:start + batch_size].to(device)
            nf = None if frames is None else frames[start:start + batch_size]
            valid = torch.ones(len(chunk), T, dtype=torch.bool) if nf is None else torch.arange(T) < nf[:, None]
            current["keys"] = valid.repeat_interleave(per_frame, dim=1)
            vision(chunk, nf, merge_size)
    result = BranchInstruments(layers=[f"interaction_modules.{i} (block {layer})" for i, layer in
                                       enumerate(probes.layers)], k=k, eps=eps, alpha=alpha_stats(probes))
    for key in MEASURES:
        getattr(result, key).extend(torch.cat(p[key]) for p in parts)
    return result


__all__ = ["probe_branch_instruments"]
