"""Parameter and operation counts per attention variant (DnA paper Tables 7 and 12).

Models are built on PyTorch's ``meta`` device, so nothing is allocated or computed: parameters are counted from
shapes, and operations by ``torch.utils.flop_counter.FlopCounterMode`` over one batch-1 forward run under
``sdpa_kernel(SDPBackend.MATH)`` (the fused CPU SDPA kernel is not counted by FlopCounterMode; the math kernel is
plain matmuls, which are).

Convention. FlopCounterMode counts a multiply-add as 2 FLOPs. The DnA paper's "GFLOPs" (17.6 for ViT-B/16,
21.1 for its Q±V±) are multiply-adds (fvcore's and timm's convention), so each row reports both: ``gmacs`` is the
paper's "GFLOPs" column, ``gflops`` = 2 x ``gmacs``.

``gmacs`` counts the default fused path (two SDPA calls for every DnA variant); ``gmacs_explicit`` counts the
explicit path, which forms a shared query's q k^T and a shared value's product once, as Table 12's operation counts
do (e.g. Q±V: 19.3).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


def count_macs(model: nn.Module, input_shape: tuple[int, ...] | torch.Tensor | list[torch.Tensor]) -> int:
    """Multiply-adds of one forward of ``model`` on a (meta or real) input of ``input_shape`` (or that input
    itself, e.g. token ids, or a detector's list of images), SDPA as math."""
    device = next(model.parameters()).device
    if isinstance(input_shape, list):
        x = [t.to(device) for t in input_shape]
    else:
        x = input_shape.to(device) if isinstance(input_shape, torch.Tensor) else torch.empty(input_shape,
                                                                                             device=device)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        model(x)
    return counter.get_total_flops() // 2  # FlopCounterMode counts 2 FLOPs per multiply-add


def variant_costs(model_name: str, variants: list[str], img_size: int | tuple[int, int] | None = None,
                  num_classes: int | None = None) -> list[dict]:
    """Parameters and forward operations of ``model_name`` with each attention spec in ``variants``, batch 1.

    Returns one dict per variant: ``{"variant", "params", "params_m", "gmacs", "gflops", "gmacs_explicit",
    "params_ratio", "gmacs_ratio"}`` where the ratios are against the first variant; ``gmacs`` is the paper's
    "GFLOPs" (multiply-adds), ``gflops`` twice that. ``img_size`` defaults to the model's own input size.
    """
    from ..models import build_model  # analysis sits above models
    from ..models.convert import attention_modules
    from ..models.inputs import example_input

    rows = []
    for spec in variants:
        kwargs = {} if img_size is None else {"img_size": img_size}
        with torch.device("meta"):
            model = build_model(model_name, num_classes=num_classes, attn=spec, **kwargs).eval()
        shape = example_input(model, 1, img_size=img_size)
        macs = count_macs(model, shape)
        for _, module in attention_modules(model):
            module.use_backend("explicit")
        macs_explicit = count_macs(model, shape)
        params = sum(p.numel() for p in model.parameters())
        rows.append({"variant": spec, "params": params, "params_m": params / 1e6, "gmacs": macs / 1e9,
                     "gflops": 2 * macs / 1e9, "gmacs_explicit": macs_explicit / 1e9})
    for row in rows:
        row["params_ratio"] = row["params"] / rows[0]["params"]
        row["gmacs_ratio"] = row["gmacs"] / rows[0]["gmacs"]
    return rows


def format_costs(rows: list[dict], model_name: str = "") -> str:
    """A Markdown table of :func:`variant_costs` rows."""
    lines = [f"Parameters and forward operations{' of ' + model_name if model_name else ''}, batch 1 "
             "(GMACs = the DnA paper's 'GFLOPs'; GFLOPs = 2 x GMACs):", "",
             "| Variant | Params | GMACs | GFLOPs | GMACs (explicit path) | x params | x GMACs |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['params_m']:.2f}M | {r['gmacs']:.2f} | {r['gflops']:.2f} | "
                     f"{r['gmacs_explicit']:.2f} | {r['params_ratio']:.3f} | {r['gmacs_ratio']:.3f} |")
    return "\n".join(lines) + "\n"


__all__ = ["count_macs", "format_costs", "variant_costs"]
