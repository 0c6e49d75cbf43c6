"""Relevance of VisCoP's visual probes over the video tokens (DnA paper, "DnA: Denoising Attention for Visual Tasks",
Sec. 4.3 and Appendix C.5 (E)(ii), Figures 4(b) and 14; the rule of Chefer, Gur and Wolf, arXiv:2103.15679, eq. 5,
as the image relevance of :mod:`attnlab.analysis.relevance`).

For a target score y (with the LLM: the logit of the token the model predicts at the last prompt position, as the
authors' ``viscop/evaluation/lrp.py`` picks it; without one: each probe's final norm, y = sum_p ||P_p||), at every
interaction module l (probes x video tokens, keys over all frames of the clip) and for each branch with effective map
M_h = c_h W_h (standard: softmax, c = 1; DnA: "pos" softmax, c = 1 and "neg" softmin, c = alpha_h):

    R_l = mean_h( ReLU(dy / dM_h) * M_h )       (P, T * N): one row per probe, one column per video token

No rollout: the interaction module's output replaces the probes (no identity path), its keys are the encoder's
hidden states, so the authors sum the per-layer maps (``total = sum_l R_l``, over probes for one map per clip).
The authors' script sums heads where attnlab (and Chefer's eq. 5) averages them: a factor H. Their script also
multiplies the map by itself (it reads the saved attention where it means its gradient) and recomputes every module
as softmax cross-attention (so it cannot read DnA's branches); attnlab uses the gradient and the module's own
branches, the paper's method (Sec. 4.3: "we extend this method to propagate and visualize signed relevance
independently"). Columns are laid out on the frames' patch grids (SigLIP-NaViT's merge-block order undone; a timm
ViT's prefix tokens kept apart), padded frames are zero.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from ..attention.base import Intermediates, Want
from ..errors import ConfigError, UnsupportedModelError
from ..ops.rotary2d import grid_positions
from .figures import agg_figure, save_png
from .maps import eval_mode
from .relevance import layer_relevance

#: score(visual tokens (B, T * n, dim), their validity (B, T * n), probes (B, P, dim)) -> (B,)
Score = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def probe_norm(visual: torch.Tensor, valid: torch.Tensor, probes: torch.Tensor) -> torch.Tensor:
    """The default target without an LLM: y = sum_p ||P_p|| per sample (each probe explains its own output)."""
    return probes.norm(dim=-1).sum(dim=-1)


@contextmanager
def interaction_intermediates(vision: nn.Module, want: Want, record: Callable[[int, Intermediates], None]
                              ) -> Iterator[list[nn.Module]]:
    """While open, every forward of ``vision``'s interaction modules (a :class:`VisCoPEncoder` or its
    :class:`VisualProbes`) computes what ``want`` asks and calls ``record(k, intermediates)`` for module k (the
    attention contract's observer: every cross-attention is an attnlab mechanism)."""
    probes = getattr(vision, "probes", vision)
    modules = list(getattr(probes, "interaction_modules", ()))
    if not modules:
        raise UnsupportedModelError(f"{type(vision).__name__} has no visual probes; give a VisCoPEncoder (or a "
                                    f"VisionLanguageModel's .vision).")
    handles = [module.observe(want, lambda mod, found, k=k: record(k, found)) for k, module in enumerate(modules)]
    try:
        yield modules
    finally:
        for h in handles:
            h.remove()


def token_layout(encoder: nn.Module, height: int, width: int, merge_size: int) -> tuple[int, int, int, torch.Tensor]:
    """(prefix tokens, h, w, raster index (h * w,) of each patch token) of one frame's hidden states: SigLIP-NaViT's
    tokens are in merge-block order, a timm ViT's in raster order after its prefix tokens."""
    patch = encoder.patch_size
    h, w = height // patch, width // patch
    if hasattr(encoder, "rotary"):  # SigLIP-NaViT
        rows_cols = grid_positions(h, w, merge_size)
        return 0, h, w, rows_cols[:, 0] * w + rows_cols[:, 1]
    return int(getattr(getattr(encoder, "vit", encoder), "num_prefix_tokens", 0)), h, w, torch.arange(h * w)


@dataclass
class ProbeRelevance:
    """Per branch (``attn``; DnA: ``pos``, ``neg``): ``tokens`` (B, L, P, T * N) R_l over the keys (prefix tokens
    included), ``maps`` (B, L, P, T, h, w) on the frames' patch grids; ``layers`` the blocks the modules follow,
    ``scores`` (B,) the explained targets, ``targets`` (B,) the target token ids (with an LLM, else None),
    ``num_frames`` (B,) the real frames, ``prefix`` the prefix tokens per frame (timm's class token)."""

    tokens: dict[str, torch.Tensor]
    maps: dict[str, torch.Tensor]
    layers: tuple[int, ...]
    scores: torch.Tensor
    num_frames: torch.Tensor
    prefix: int = 0
    targets: torch.Tensor | None = None

    def total(self, branch: str, probes: Sequence[int] | None = None) -> torch.Tensor:
        """sum over layers (and ``probes``, default all) of ``maps[branch]``: (B, T, h, w), the authors' map."""
        m = self.maps[branch]
        return (m if probes is None else m[:, :, list(probes)]).sum(dim=(1, 2))


def _relevance(vision: nn.Module, clips: torch.Tensor, num_frames, merge_size: int,
               run: Callable[[torch.Tensor], torch.Tensor], targets=None) -> ProbeRelevance:
    if not clips.is_floating_point() or clips.dim() != 5:
        raise ConfigError(f"probe relevance takes clips (B, T, C, H, W) of pixels; got shape {tuple(clips.shape)} "
                          f"of {clips.dtype}.")
    B, T = clips.shape[:2]
    found: dict[int, dict] = {}
    with interaction_intermediates(vision, Want(weights=True), lambda k, f: found.__setitem__(k, f.weights)) as mods, \
            eval_mode(vision) as device, torch.enable_grad():
        x = clips.to(device).detach().requires_grad_(True)  # the maps enter the graph whatever the parameters
        scores = run(x)
        if scores.shape != (B,):
            raise ConfigError(f"the relevance score must give one value per clip ({B}), not shape "
                              f"{tuple(scores.shape)}.")
        if len(found) != len(mods):
            raise UnsupportedModelError("the probes' interaction modules were not all called; run the clips through "
                                        "the VisCoPEncoder's forward.")
        names = sorted(found[0])
        flat = [found[k][b].effective for k in range(len(mods)) for b in names]
        grads = torch.autograd.grad(scores.sum(), flat, allow_unused=True)
    tokens: dict[str, list[torch.Tensor]] = {b: [] for b in names}
    for (k, b), g in zip(((k, b) for k in range(len(mods)) for b in names), grads):
        m = found[k][b].effective.detach()
        tokens[b].append(layer_relevance(m, torch.zeros_like(m) if g is None else g).cpu())
    encoder = vision.encoder
    prefix, h, w, order = token_layout(encoder, clips.shape[-2], clips.shape[-1], merge_size)
    out_tokens, maps = {}, {}
    for b, per_layer in tokens.items():
        r = torch.stack(per_layer, dim=1)  # (B, L, P, T * N)
        out_tokens[b] = r
        patches = r.unflatten(-1, (T, -1))[..., prefix:]
        grid = torch.zeros_like(patches)
        grid[..., order] = patches
        maps[b] = grid.unflatten(-1, (h, w))
    frames = torch.full((B,), T) if num_frames is None else torch.as_tensor(num_frames).cpu()
    return ProbeRelevance(tokens=out_tokens, maps=maps, layers=tuple(vision.probes.layers),
                          scores=scores.detach().cpu(), num_frames=frames, prefix=prefix,
                          targets=None if targets is None else targets.cpu())


def probe_relevance(vision: nn.Module, clips: torch.Tensor, num_frames: torch.Tensor | None = None,
                    merge_size: int = 1, score: Score | None = None) -> ProbeRelevance:
    """Relevance of every probe over the video tokens at every interaction module of the :class:`VisCoPEncoder`
    ``vision`` (module docstring), for clips (B, T, C, H, W) with ``num_frames`` real frames each; ``score`` maps
    the encoder's outputs to the (B,) targets (default :func:`probe_norm`). Eval mode, float as the model."""
    score = score or probe_norm

    def run(x):
        return score(*vision(x, num_frames, merge_size))

    return _relevance(vision, clips, num_frames, merge_size, run)


def vlm_probe_relevance(model: nn.Module, tokens: torch.Tensor, clips: torch.Tensor,
                        num_frames: torch.Tensor | None = None, position: int | torch.Tensor = -1,
                        target: torch.Tensor | None = None) -> ProbeRelevance:
    """:func:`probe_relevance` for a :class:`VisionLanguageModel` and its prompts ``tokens`` (B, L): the target is
    the logit of token ``target`` (default: the model's argmax) at ``position`` (an int or one per prompt; default
    the last, the first answer token, as the authors' ``lrp.py``)."""
    B, L = tokens.shape
    pos = torch.as_tensor(position).expand(B).clone()
    pos = torch.where(pos < 0, pos + L, pos)
    if bool(((pos < 0) | (pos >= L)).any()):
        raise ConfigError(f"position must index the prompts' {L} tokens; got {torch.as_tensor(position).tolist()}.")
    chosen: list[torch.Tensor] = []

    def run(x):
        logits = model(tokens.to(x.device), x, num_frames)
        at = logits[torch.arange(B, device=x.device), pos.to(x.device)]  # (B, vocab)
        t = at.argmax(dim=-1) if target is None else torch.as_tensor(target, device=x.device).expand(B)
        chosen.append(t)
        return at.gather(1, t[:, None])[:, 0]

    with eval_mode(model):
        result = _relevance(model.vision, clips, num_frames, model.merge_size, run)
    result.targets = chosen[0].cpu()
    return result


def plot_probe_relevance(clips: torch.Tensor, relevance: ProbeRelevance, path: str | Path, sample: int = 0,
                         probes: Sequence[int] | None = None, frames: int = 4, title: str = "") -> Path:
    """A figure like the paper's Figures 4(b) and 14: ``frames`` frames of clip ``sample`` sampled uniformly (its
    real frames), then per branch a row of relevance summed over layers and probes and a row per probe of
    ``probes`` (default the first min(P, 4)); red positive, blue negative, zero white, one symmetric scale per row
    so that frames compare. Written to ``path``; returns it."""
    n_real = int(relevance.num_frames[sample])
    picks = torch.linspace(0, n_real - 1, min(frames, n_real)).round().long().unique().tolist()
    P = next(iter(relevance.maps.values())).shape[2]
    probes = list(range(min(P, 4))) if probes is None else list(probes)
    if any(not 0 <= p < P for p in probes):
        raise ConfigError(f"probes are indices from 0 to {P - 1}; got {probes}.")
    rows = [(b, None) for b in sorted(relevance.maps)] + [(b, p) for p in probes for b in sorted(relevance.maps)]
    clip = clips[sample].detach().cpu().float()
    fig = agg_figure(figsize=(2.0 * len(picks) + 0.8, 1.8 * (1 + len(rows))))
    grid = fig.add_gridspec(1 + len(rows), len(picks))

    def shown(img):
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-12)
        return img.permute(1, 2, 0).numpy() if img.shape[0] == 3 else img.mean(0).numpy()

    for j, t in enumerate(picks):
        ax = fig.add_subplot(grid[0, j])
        img = clip[t]
        ax.imshow(shown(img), cmap=None if img.shape[0] == 3 else "gray")
        ax.set_axis_off()
        ax.set_title(f"frame {t}", fontsize="small")
    for i, (b, p) in enumerate(rows):
        m = relevance.total(b, None if p is None else [p])[sample]  # (T, h, w)
        up = F.interpolate(m[picks][:, None].float(), size=clip.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        vmax = float(up.abs().max()) or 1.0
        for j, t in enumerate(picks):
            ax = fig.add_subplot(grid[1 + i, j])
            ax.imshow(clip[t].mean(0).numpy(), cmap="gray", alpha=0.5)
            ax.imshow(up[j].numpy(), cmap="bwr", vmin=-vmax, vmax=vmax, alpha=0.6)
            ax.set_axis_off()
            if j == 0:
                ax.text(-0.05, 0.5, f"{b}\n{'all probes' if p is None else f'probe {p}'}", transform=ax.transAxes,
                        ha="right", va="center", fontsize="small")
    head = f"target token {int(relevance.targets[sample])}, " if relevance.targets is not None else ""
    fig.suptitle(title or f"{head}relevance summed over layers {list(relevance.layers)}", fontsize="small")
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.25 / (1 + len(rows))))  # the title above the frames' own titles
    return save_png(fig, path, dpi=100)


__all__ = ["ProbeRelevance", "interaction_intermediates", "plot_probe_relevance", "probe_norm", "probe_relevance",
           "token_layout", "vlm_probe_relevance"]
