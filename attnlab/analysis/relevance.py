"""Signed relevance maps (DnA paper, "DnA: Denoising Attention for Visual Tasks", Sec. 4.3 and Appendix C.5 (E);
the rule of Chefer, Gur and Wolf, "Generic Attention-model Explainability for Interpreting Bi-Modal and
Encoder-Decoder Transformers", arXiv:2103.15679, eq. 5-6).

For the target class c (default: the model's prediction) with logit y_c, at every attention layer l and for one
branch with effective map M_h = c_h W_h (see :mod:`attnlab.analysis.maps`: W the branch's attention weights, c_h 1
for softmax maps, alpha_h for DnA's softmin branch, -lambda for Differential's second map):

    A_bar_l = mean_h( ReLU(dy_c / dM_h) * M_h )        (Hadamard product, ReLU-filtered gradients, head mean)
    R = I_N;   R <- R + A_bar_l R   for l = 1..L         (identity for the skip connection, recursive products)

Each branch of DnA and Differential is propagated on its own; the sign of its relevance is that of its contribution
to the output (c_h M_h-weighted): positive for softmax maps and for DnA heads with alpha_h > 0, negative for
Differential's subtracted map. The map shown for an image is the row of R that the classifier reads: the class
token's row over the patch tokens, or for mean-pooled models the mean of the patch tokens' rows; it is reshaped to
the patch grid and overlaid on the input.

Swin is refused: its windows cover different tokens from one block to the next (shifted windows) and patch merging
changes the token set between stages, so no N x N product runs from the input tokens to the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..errors import ConfigError, UnsupportedModelError
from .maps import capture_maps, eval_mode, map_modules
from .figures import agg_figure, save_png


def layer_relevance(effective: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """A_bar = mean_h(ReLU(grad) * M) for M, grad: (B, H, N, N); returns (B, N, N)."""
    return (grad.clamp_min(0) * effective).mean(dim=1)


def rollout(layers: list[torch.Tensor]) -> torch.Tensor:
    """R = prod over layers (first to last) of the updates R <- R + A_bar R from R = I; A_bar: (B, N, N) each."""
    B, N, _ = layers[0].shape
    R = torch.eye(N, dtype=layers[0].dtype, device=layers[0].device).expand(B, N, N).clone()
    for a_bar in layers:
        R = R + a_bar @ R
    return R


@dataclass
class Relevance:
    """Per branch: ``matrices`` (B, N, N) R; ``maps`` (B, gh, gw) the classifier's row over the patch grid;
    ``classes`` (B,) the target classes; ``prefix`` the number of class/prefix tokens."""

    matrices: dict[str, torch.Tensor]
    maps: dict[str, torch.Tensor]
    classes: torch.Tensor
    prefix: int


def relevance_matrices(model: nn.Module, images: torch.Tensor, classes: torch.Tensor | None = None
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """({branch: R (B, N, N)}, target classes (B,)) for ``images`` (B, C, H, W), eval mode, float32."""
    if not images.is_floating_point():
        raise UnsupportedModelError("relevance explains a classifier's class logits over image patches; this model "
                                    "reads token ids (a language model), whose output is a next-token distribution "
                                    "per position.")
    if images.dim() != 4:
        raise UnsupportedModelError(f"relevance explains an image classifier's logits over one image's patches; this "
                                    f"model takes inputs of {images.dim()} dimensions (a video model's clips, whose "
                                    f"spatial and temporal attentions cover different token sets), so no N x N "
                                    f"rollout runs from its input tokens to its output.")
    for name, module in map_modules(model):
        if getattr(module, "window_size", None) is not None:
            raise UnsupportedModelError(
                f"relevance rollout needs one token set through every layer, but {name!r} attends within shifted "
                f"windows and patch merging changes the tokens between stages (Swin); use a ViT-style model.")
    maps: dict[int, dict] = {}

    def record(index, name, module, branches):
        maps[index] = {b: branch.effective for b, branch in branches.items()}

    with capture_maps(model, record), eval_mode(model) as device, torch.enable_grad():
        x = images.to(device).detach().requires_grad_(True)  # the maps enter the graph whatever the parameters
        logits = model(x)
        if logits.dim() != 2:
            raise UnsupportedModelError(f"relevance explains a classifier's logits, but this model outputs shape "
                                        f"{tuple(logits.shape)} (a detector's backbone); use a classification run.")
        if classes is None:
            classes = logits.argmax(dim=-1)
        classes = classes.to(logits.device)
        if classes.shape != logits.shape[:1]:
            raise ConfigError(f"give one target class per image ({logits.shape[0]}), got shape {tuple(classes.shape)}.")
        layers = [maps[i] for i in sorted(maps)]
        names = set(layers[0])
        if any(set(layer) != names for layer in layers):
            raise UnsupportedModelError("relevance needs the same branches in every layer; this model mixes "
                                        "one-map and two-branch attention layers.")
        flat = [layer[b] for layer in layers for b in sorted(names)]
        grads = torch.autograd.grad(logits.gather(1, classes.view(-1, 1)).sum(), flat, allow_unused=True)
    grads_by = iter(grads)
    per_branch: dict[str, list[torch.Tensor]] = {b: [] for b in sorted(names)}
    for layer in layers:
        for b in sorted(names):
            g = next(grads_by)
            m = layer[b].detach()
            per_branch[b].append(layer_relevance(m, torch.zeros_like(m) if g is None else g))
    return {b: rollout(ls).cpu() for b, ls in per_branch.items()}, classes.cpu()


def relevance_maps(model: nn.Module, images: torch.Tensor, classes: torch.Tensor | None = None,
                   batch_size: int = 8) -> Relevance:
    """Signed relevance of each branch on the patch grid for ``images`` (n, C, H, W); see the module docstring.
    UnsupportedModelError for Swin (windowed attention) and for modules whose maps cannot be read."""
    prefix = int(getattr(model, "num_prefix_tokens", 0) or 0)
    grid = getattr(getattr(model, "patch_embed", None), "grid_size", None)
    parts, targets = [], []
    for start in range(0, images.shape[0], batch_size):
        chunk_classes = None if classes is None else classes[start:start + batch_size]
        R, c = relevance_matrices(model, images[start:start + batch_size], chunk_classes)
        parts.append(R)
        targets.append(c)
    matrices = {b: torch.cat([p[b] for p in parts]) for b in parts[0]}
    pooled = getattr(model, "global_pool", "token") != "token" or prefix == 0
    maps = {}
    for b, R in matrices.items():
        rows = R[:, prefix:, prefix:].mean(dim=1) if pooled else R[:, 0, prefix:]
        n = rows.shape[-1]
        gh, gw = tuple(grid) if grid is not None and grid[0] * grid[1] == n else (1, n)
        maps[b] = rows.reshape(-1, gh, gw)
    return Relevance(matrices=matrices, maps=maps, classes=torch.cat(targets), prefix=prefix)


def plot_relevance(images: torch.Tensor, relevance: Relevance, path, title: str = "") -> None:
    """One row per image: the input, then each branch's relevance (red positive, blue negative, zero white,
    one colour scale per image) over the greyed input; written to ``path``."""
    import torch.nn.functional as F

    branches = sorted(relevance.maps)
    n = images.shape[0]
    fig = agg_figure(figsize=(2.2 * (1 + len(branches)), 2.2 * n))
    for i in range(n):
        img = images[i].detach().cpu().float()
        img = (img - img.min()) / (img.max() - img.min()).clamp_min(1e-12)
        shown = img.permute(1, 2, 0).numpy() if img.shape[0] == 3 else img.mean(0).numpy()
        ax = fig.add_subplot(n, 1 + len(branches), i * (1 + len(branches)) + 1)
        ax.imshow(shown, cmap=None if img.shape[0] == 3 else "gray")
        ax.set_axis_off()
        ax.set_title(f"class {int(relevance.classes[i])}", fontsize="small")
        # one symmetric scale per image across branches, so branch magnitudes compare
        up = {b: F.interpolate(relevance.maps[b][i][None, None].float(), size=img.shape[1:], mode="bilinear",
                               align_corners=False)[0, 0] for b in branches}
        # the rollout's identity gives every token relevance >= 1; the image shows what the layers add
        up = {b: m - (m.min() if m.min() >= 0 else 0) for b, m in up.items()}
        vmax = max(float(m.abs().max()) for m in up.values()) or 1.0
        for j, b in enumerate(branches):
            ax = fig.add_subplot(n, 1 + len(branches), i * (1 + len(branches)) + 2 + j)
            ax.imshow(img.mean(0).numpy(), cmap="gray", alpha=0.5)
            ax.imshow(up[b].numpy(), cmap="bwr", vmin=-vmax, vmax=vmax, alpha=0.6)
            ax.set_axis_off()
            if i == 0:
                ax.set_title(b, fontsize="small")
    if title:
        fig.suptitle(title, fontsize="small")
    fig.tight_layout()
    save_png(fig, path, dpi=100)


__all__ = ["Relevance", "layer_relevance", "plot_relevance", "relevance_matrices", "relevance_maps", "rollout"]
