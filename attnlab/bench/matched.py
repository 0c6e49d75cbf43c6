"""Models to compare in one benchmark: every variant loads the same parameters (Section 3.5 of the NS-Attn paper:
"both configurations load identical parameters and buffers"), on one device, optionally compiled and in bf16."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..models import build_model
from ..spec import parse_spec


class Autocast(nn.Module):
    """Runs the wrapped model under ``torch.autocast`` (bf16 inference as in training)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, x):
        device_type = x.device.type
        with torch.autocast(device_type, dtype=self.dtype):
            return self.model(x)


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {device!r} was asked for but CUDA is not available here; use --device cpu.")
    return torch.device(device)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matched_models(model: str, specs: list[str], *, num_classes: int | None = None, seed: int = 0,
                   device: str | torch.device = "cpu", dtype: str = "fp32", compile: bool = False,
                   **overrides) -> dict[str, nn.Module]:
    """``{spec: model}`` for each spec, all carrying the first spec's parameters wherever names and shapes agree.

    Parameters a variant adds (DnA's negative branch, for example) keep their own seeded initialisation.
    """
    if dtype not in DTYPES:
        raise ConfigError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)}.")
    device = resolve_device(device) if isinstance(device, str) else device
    models: dict[str, nn.Module] = {}
    reference = None
    for spec in specs:
        torch.manual_seed(seed)
        net = build_model(model, num_classes=num_classes, attn=spec, **overrides)
        if reference is None:
            reference = {k: v.clone() for k, v in net.state_dict().items()}
        else:
            own = net.state_dict()
            shared = {k: v for k, v in reference.items() if k in own and own[k].shape == v.shape}
            net.load_state_dict(shared, strict=False)
        net = net.to(device).eval()
        if dtype != "fp32":
            net = Autocast(net, DTYPES[dtype])
        if compile:
            net = torch.compile(net)
        models[str(parse_spec(spec))] = net
    return models
