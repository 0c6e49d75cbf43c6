"""QK-clip (Kimi K2's MuonClip, without Muon): cap each head's largest attention logit by rescaling W_q and W_k.

During every training forward, each attention module records per head h

    S_max,h = max over the batch, query i and key j of  (q_h,i . k_h,j) / sqrt(D)

(running maximum since the last optimizer step, so gradient-accumulation micro-batches all count; exact for every
head that could exceed tau, the Cauchy-Schwarz bound max_i ||q_i|| max_j ||k_j|| / sqrt(D) <= tau for the others,
so the clip is the same as with exact maxima everywhere). After each optimizer step, every head with
S_max,h > tau is rescaled with gamma_h = tau / S_max,h:

    W_q,h <- gamma_h^alpha W_q,h,        W_k,h <- gamma_h^(1 - alpha) W_k,h        (defaults tau = 100, alpha = 0.5)

so that the logits the step recorded become exactly tau for that head's worst query-key pair. Heads at or below tau
are untouched (multiplied by exactly 1.0: bit-identical), W_v is never touched, and the record is reset.

Only the positions the forward's mask allows count, and no additive bias (the rescaling can only move q . k). The
bias entries of the scaled rows of the fused ``qkv`` are scaled with them. The maximum is taken in float32, tile by
tile (at most :data:`CHUNK_ELEMENTS` elements per intermediate), from a forward hook on ``qkv``; per-rank maxima are
all-reduced (MAX) under ``torch.distributed``. Only softmax kernels are supported. These choices where the Kimi K2
report leaves room, with their reasons, and the refused terms: docs/methods.md, "qkclip".

The trainer creates the optimizer after ``convert``; it calls :func:`attach_optimizer_hooks` (a no-op for models
without ``qkclip``). A custom loop may call :func:`clip_` after each ``optimizer.step()`` instead.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parametrize

from ..errors import SpecError
from ..ops.sdpa import causal_keep
from ..variants import TrainingHooks
from .qknorm import has_qk_norm

#: the most float32 elements any intermediate of the logit pass holds (64 MiB): a tile of logits, or the float32
#: copy of a tile of q or k. The full (B, H, N, N) logits never exist (ViT-B/16, batch 256: 0.5 GB per layer)
CHUNK_ELEMENTS = 1 << 24


def _tile_sizes(B: int, H: int, N: int, M: int, D: int, block: int) -> tuple[int, int, int, int]:
    """(images, heads, queries, keys) per tile such that the tile's logits (b h r c elements) and its float32 q and
    k slices (b h r D, b h c D) each hold at most max(block, D) elements; the largest tiles that do."""
    c = min(M, max(1, block // D))
    r = min(N, max(1, block // max(c, D)))
    per_head = max(r * max(c, D), c * D)
    h = min(H, max(1, block // per_head))
    b = min(B, max(1, block // (h * per_head)))
    return b, h, r, c


def max_scaled_logits(q: torch.Tensor, k: torch.Tensor, scale: float, heads: torch.Tensor | None = None,
                      block: int | None = None, allowed=None) -> torch.Tensor:
    """Per-head max of (q_i . k_j) * scale over batch, i and j, in float32, computed tile by tile.

    q: (B, N, H, D), k: (B, M, H, D) (the layout of the fused projection's output; Swin: B = images x windows).
    ``heads``: indices of the heads to compute (default all). ``allowed(b0, b1, r0, r1, c0, c1)``: a bool map of the
    positions that count in that tile of images, queries and keys (ends within the tensors), broadcastable to
    (b, 1, r, c) (a mask's allowed
    positions), or None for all. Returns (len(heads),) or (H,); -inf for a head without any allowed position. Tiles
    of images, heads, queries and keys are cast to float32 and multiplied one at a time, so no intermediate holds
    more than ``block`` (default :data:`CHUNK_ELEMENTS`) elements when ``block >= D``; the maximum of the tiles'
    maxima is the maximum of the whole logit tensor, and each logit is the same float32 dot product.
    """
    block = CHUNK_ELEMENTS if block is None else block
    B, N, H, D = q.shape
    M = k.shape[1]
    count = H if heads is None else heads.numel()
    tb, th, tr, tc = _tile_sizes(B, count, N, M, D, block)
    out = torch.full((count,), float("-inf"), device=q.device, dtype=torch.float32)
    with torch.autocast(q.device.type, enabled=False):  # under autocast the matmul would run in bf16 / fp16
        for h0 in range(0, count, th):
            h1 = min(h0 + th, count)
            idx = None if heads is None else heads[h0:h1]
            for b0 in range(0, B, tb):
                for r0 in range(0, N, tr):
                    qt = q[b0:b0 + tb, r0:r0 + tr]
                    qt = (qt[:, :, h0:h1] if idx is None else qt.index_select(2, idx)).transpose(1, 2).float()
                    for c0 in range(0, M, tc):
                        kt = k[b0:b0 + tb, c0:c0 + tc]
                        kt = (kt[:, :, h0:h1] if idx is None else kt.index_select(2, idx)).transpose(1, 2).float()
                        logits = qt @ kt.transpose(-2, -1)  # (b, h, r, c)
                        if allowed is not None:
                            ok = allowed(b0, min(b0 + tb, B), r0, min(r0 + tr, N), c0, min(c0 + tc, M))
                            logits = logits.masked_fill(~ok, float("-inf"))
                        torch.maximum(out[h0:h1], logits.amax(dim=(0, 2, 3)), out=out[h0:h1])
    return out * scale


def allowed_positions(mask, device):
    """The ``allowed`` tile function of :func:`max_scaled_logits` for an AttentionMask (None: every position): the
    positions the mask lets a real query attend, each tile formed on its own from the mask's parts (causal order,
    key padding, Swin's windows, a caller's attn_mask), so no (N, M) map is ever held."""
    if mask is None:
        return None
    user = mask.attn_mask
    if user is not None:
        user = user if user.dtype == torch.bool else ~torch.isneginf(user)
        user = user.reshape((1,) * (4 - user.ndim) + tuple(user.shape))
        if user.shape[1] > 1:  # a per-head mask: a position counts if any head may attend it (never too low a max)
            user = user.any(dim=1, keepdim=True)

    def allowed(b0, b1, r0, r1, c0, c1):
        ok = torch.ones((), dtype=torch.bool, device=device)
        if mask.is_causal:
            ok = ok & causal_keep(r1 - r0, c1 - c0, device, offset=r0 - c0)
        if mask.key_padding is not None:
            kp = mask.key_padding
            ok = ok & kp[b0:b1, None, r0:r1, None] & kp[b0:b1, None, None, c0:c1]
        if mask.window is not None:  # image-major batch, windows fastest: sample b is window b % num_windows
            windows = torch.arange(b0, b1, device=device)
            ok = ok & (mask.window[windows % mask.window.shape[0], r0:r1, c0:c1] == 0)[:, None]
        if user is not None:
            ok = ok & user[b0:b1 if user.shape[0] > 1 else 1, :, r0:r1 if user.shape[2] > 1 else 1,
                           c0:c1 if user.shape[3] > 1 else 1]
        return ok
    return allowed


#: relative margin on the Cauchy-Schwarz bound, so float32 rounding cannot certify a head that is in fact over tau
BOUND_MARGIN = 1e-4


def _max_norms(qk: torch.Tensor, block: int) -> torch.Tensor:
    """max over tokens of ||q_i|| and ||k_j|| per image and head: (B, 2, H) float32, from tiles of images and tokens
    whose float32 copies hold at most max(block, 2 H D) elements."""
    B, N, _, H, D = qk.shape
    tokens = min(N, max(1, block // (2 * H * D)))
    images = min(B, max(1, block // (tokens * 2 * H * D)))
    out = torch.full((B, 2, H), float("-inf"), device=qk.device, dtype=torch.float32)
    for b0 in range(0, B, images):
        for n0 in range(0, N, tokens):
            norms = torch.linalg.vector_norm(qk[b0:b0 + images, n0:n0 + tokens].float(), dim=-1).amax(dim=1)
            torch.maximum(out[b0:b0 + images], norms, out=out[b0:b0 + images])
    return out


def screened_max_logits(qk: torch.Tensor, scale: float, tau: float, select: bool | None = None,
                        block: int | None = None, mask=None) -> torch.Tensor:
    """Per-head max logit where it matters for the clip: exact S_max,h for every head that could exceed ``tau``, and
    for the others the Cauchy-Schwarz bound (<= tau) that shows it cannot.

        bound_h = (1 + margin) * scale * max_b (max_i ||q_b,h,i|| * max_j ||k_b,h,j||)  >=  S_max,h

    Heads with bound_h > tau get :func:`max_scaled_logits`. ``select`` (default: on the CPU) computes the exact
    maximum for those heads only, which needs their indices on the host; otherwise (GPU: no host sync) every head's
    exact maximum is computed and ``where(bound > tau, exact, bound)`` is returned. Both give the same values.
    qk: (B, N, 2, H, D), queries then keys (a view of the fused projection's output). ``mask``: the forward's
    AttentionMask, whose excluded positions (and padded tokens, as queries and keys) do not count. Returns (H,)
    float32. No intermediate holds more than ``block`` (default :data:`CHUNK_ELEMENTS`) elements when
    ``block >= 2 H D``.
    """
    block = CHUNK_ELEMENTS if block is None else block
    if select is None:  # torch.compile: the dense path, one graph (selecting needs a data-dependent shape)
        select = qk.device.type == "cpu" and not torch.compiler.is_compiling()
    allowed = allowed_positions(mask, qk.device)
    q, k = qk[:, :, 0], qk[:, :, 1]
    if mask is not None and mask.key_padding is not None:  # padded tokens out of the bound as well
        qk = qk * mask.key_padding[:, :, None, None, None].to(qk.dtype)
    norms = _max_norms(qk, block)  # (B, 2, H): one pass over q and k
    bound = (norms[:, 0] * norms[:, 1]).amax(dim=0) * (scale * (1 + BOUND_MARGIN))
    over = bound > tau
    if not select:
        return torch.where(over, max_scaled_logits(q, k, scale, block=block, allowed=allowed), bound)
    heads = over.nonzero().flatten()
    if heads.numel() == 0:
        return bound
    out = bound.clone()
    out[heads] = max_scaled_logits(q, k, scale, heads=heads, block=block, allowed=allowed)
    return out


class QKClip(nn.Module):
    """Per-module QK-clip state: ``tau``, ``alpha`` and the running per-head maximum logit ``max_logit`` (H,).

    ``max_logit`` is a non-persistent buffer (it follows ``.to(device)`` but is not in the state dict, so a
    ``qkclip`` checkpoint loads into a ``standard`` model); ``last_max_logit`` keeps the value the last clip used
    and ``last_clipped`` how many heads it rescaled, for logging.
    """

    def __init__(self, num_heads: int, tau: float = 100.0, alpha: float = 0.5) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.tau = float(tau)
        self.alpha = float(alpha)
        self.register_buffer("max_logit", torch.full((num_heads,), float("-inf")), persistent=False)
        self.register_buffer("last_max_logit", torch.full((num_heads,), float("-inf")), persistent=False)
        self.register_buffer("last_clipped", torch.zeros((), dtype=torch.long), persistent=False)
        self.pending_mask = None  # the mask of the training forward whose projection is being recorded

    def extra_repr(self) -> str:
        return f"num_heads={self.num_heads}, tau={self.tau:g}, alpha={self.alpha:g}"


def _check(module: nn.Module, index: int) -> None:
    if has_qk_norm(module):
        raise SpecError(
            f"qkclip cannot act on attention module {index}: it normalises q and k after the projection (QK-norm), "
            f"which divides out any rescaling of W_q and W_k, so the clip would have no effect; use qknorm or qkclip.")
    if not module.capabilities.plain_softmax:
        raise SpecError(
            f"qkclip needs softmax attention (the standard kernel, optionally with ns), but attention module {index} "
            f"is {type(module).__name__}, whose logits are not q_h k_h^T / sqrt(D) of the fused projection.")


def apply(model: nn.Module, modules: list[nn.Module], tau: float = 100.0, alpha: float = 0.5) -> None:
    """Give every attention module a :class:`QKClip` state ``qk_clip`` and a recording hook on its ``qkv``.

    The weights change only when the clip runs: after ``optimizer.step()`` through :func:`attach_optimizer_hooks`,
    or by calling :func:`clip_`. Raises SpecError for modules with QK-norm or a non-softmax kernel.
    """
    for index, module in enumerate(modules):
        _check(module, index)
    for module in modules:
        weight = module.qkv.weight
        module.qk_clip = QKClip(module.num_heads, tau, alpha).to(weight.device)
        # callable objects, not closures: copy.deepcopy(model) then gives the copy's hooks the copy's module
        module.register_forward_pre_hook(_MaskHook(), with_kwargs=True)
        module.qkv.register_forward_hook(_RecordHook(module))


class _RecordHook:
    """Forward hook on ``attn.qkv``, holding its attention module (deep-copies along with it)."""

    def __init__(self, attn: nn.Module) -> None:
        self.attn = attn

    def __call__(self, qkv, inputs, output: torch.Tensor) -> None:
        """Fold this forward's per-head max logit into ``attn.qk_clip.max_logit``."""
        attn = self.attn
        if not attn.training or output.is_meta:  # a meta model (shapes only) has no logits to record
            return
        H, D = attn.num_heads, attn.head_dim
        B, N = output.shape[0], output.shape[1]
        with torch.no_grad():
            qk = output.detach()[..., : 2 * H * D].reshape(B, N, 2, H, D)
            state = attn.qk_clip
            m = screened_max_logits(qk, attn.scale, state.tau, mask=state.pending_mask)
            state.pending_mask = None
            torch.maximum(state.max_logit, m.to(state.max_logit.dtype), out=state.max_logit)


class _MaskHook:
    """Forward pre-hook on the attention module: hands the training forward's mask to the recording hook."""

    def __call__(self, module, args, kwargs):
        if module.training:
            module.qk_clip.pending_mask = module.forward_mask(args, kwargs)[1]


def clipped_modules(model: nn.Module) -> list[nn.Module]:
    """The attention modules of ``model`` that carry QK-clip state, in forward order."""
    return [m for m in model.modules() if isinstance(getattr(m, "qk_clip", None), QKClip)]


@torch.no_grad()
def clip_(model: nn.Module) -> None:
    """Apply QK-clip to every module of ``model`` that has it, from the maxima recorded since the last call.

    For head h with S_max,h > tau: q rows and q bias of head h times gamma^alpha, k rows and k bias times
    gamma^(1 - alpha), gamma = tau / S_max,h. Other heads are multiplied by exactly 1.0 (so no host sync is needed
    on a GPU). Resets the record. Modules that recorded nothing (-inf) are left alone.
    """
    modules = clipped_modules(model)
    if not modules:
        return
    if dist.is_available() and dist.is_initialized():
        stacked = torch.cat([m.qk_clip.max_logit for m in modules])
        dist.all_reduce(stacked, op=dist.ReduceOp.MAX)
        for m, part in zip(modules, stacked.split([m.num_heads for m in modules])):
            m.qk_clip.max_logit.copy_(part)
    for module in modules:
        state: QKClip = module.qk_clip
        qkv = module.qkv
        if parametrize.is_parametrized(qkv, "weight"):
            raise SpecError("qkclip rescales the rows of qkv.weight, but this model reparametrises it "
                            "(sigma-Reparam, spectral norm or conditioning); drop one of the two terms.")
        H, D = module.num_heads, module.head_dim
        s = state.max_logit
        over = s > state.tau
        # on the CPU a host check is free and spares the multiplications in the common case (no head over tau);
        # on a GPU it would be a sync per module, so there every step multiplies (unclipped rows by exactly 1.0)
        if s.device.type != "cpu" or bool(over.any()):
            ones = torch.ones_like(s)
            gamma = torch.where(over, state.tau / s, ones)
            q_factor = torch.where(over, gamma.pow(state.alpha), ones)
            k_factor = torch.where(over, gamma.pow(1.0 - state.alpha), ones)
            # one factor per output row of qkv: q block, k block, then 1.0 for the v block
            rows = torch.cat([q_factor.repeat_interleave(D), k_factor.repeat_interleave(D),
                              torch.ones(qkv.out_features - 2 * H * D, device=s.device, dtype=s.dtype)])
            qkv.weight.mul_(rows.to(qkv.weight.dtype).unsqueeze(1))
            if qkv.bias is not None:
                qkv.bias.mul_(rows.to(qkv.bias.dtype))
        state.last_max_logit.copy_(s)
        state.last_clipped.copy_(over.sum())
        s.fill_(float("-inf"))


def attach_optimizer_hooks(model: nn.Module, optimizer: torch.optim.Optimizer):
    """Run :func:`clip_` on ``model`` after every ``optimizer.step()``; returns the hook handle, or None (and does
    nothing) when ``model`` has no ``qkclip`` term. The trainer calls this for every model once it has built the
    optimizer. A step the AMP GradScaler skips does not call the hook; its maxima stay recorded for the next one."""
    if not clipped_modules(model):
        return None
    return optimizer.register_step_post_hook(lambda opt, args, kwargs: clip_(model))


def clip_stats(model: nn.Module) -> dict[str, float]:
    """What the last clip saw: ``qkclip/max_logit`` (largest recorded S_max over heads: exact when it exceeds tau,
    otherwise a bound <= tau) and ``qkclip/clipped_heads``.
    Empty for models without ``qkclip``. Reads device tensors (a host sync on a GPU): call it when logging."""
    modules = clipped_modules(model)
    if not modules:
        return {}
    return {
        "qkclip/max_logit": max(float(m.qk_clip.last_max_logit.max()) for m in modules),
        "qkclip/clipped_heads": float(sum(int(m.qk_clip.last_clipped) for m in modules)),
    }


#: how the trainer runs QK-clip (through the variant registry): the clip after each step, and its metrics
TRAINING = TrainingHooks(attach=attach_optimizer_hooks, stats=clip_stats)

__all__ = ["QKClip", "TRAINING", "apply", "attach_optimizer_hooks", "clip_", "clip_stats", "clipped_modules", "max_scaled_logits",
           "screened_max_logits"]
