"""Models to compare in one benchmark: every variant loads the same parameters (Section 3.5 of the NS-Attn paper:
"both configurations load identical parameters and buffers"), on one device, optionally compiled and in bf16."""

from __future__ import annotations

import torch
from torch import nn

from ..errors import ConfigError
from ..models import build_model
from ..models.inputs import image_size
from ..spec import parse_spec
from ..train.run import resolve_device
from .latency import measure_latency


class Autocast(nn.Module):
    """Runs the wrapped model under ``torch.autocast`` (bf16 inference as in training)."""

    def __init__(self, model: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model = model
        self.dtype = dtype

    def forward(self, x):
        with torch.autocast(x.device.type, dtype=self.dtype):
            return self.model(x)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matched_models(model: str, specs: list[str], *, num_classes: int | None = None, seed: int = 0,
                   device: str | torch.device = "cpu", dtype: str = "fp32", compile: bool = False,
                   compile_backend: str = "inductor", **overrides) -> dict[str, nn.Module]:
    """``{spec: model}`` for each spec, all carrying the first spec's parameters wherever names and shapes agree.

    Parameters a variant adds (DnA's negative branch, for example) keep their own seeded initialisation.
    ``compile_backend``: torch.compile's backend when ``compile`` (``aot_eager`` traces without generating code).
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
            net = torch.compile(net, backend=compile_backend)
        models[str(parse_spec(spec))] = net
    return models


def input_shape(model: nn.Module) -> tuple[int, int, int]:
    """(channels, height, width) a timm image model expects."""
    return image_size(model)


def bench_variants(model: str, specs: list[str], *, batch_size: int = 128, warmup: int = 50, iters: int = 200,
                   rounds: int = 3, device: str = "auto", dtype: str = "fp32", compile: bool = False, seed: int = 0,
                   num_classes: int | None = None, progress: bool = True, compile_backend: str = "inductor",
                   model_options: dict | None = None) -> dict:
    """The NS-Attn paper's latency protocol for ``specs`` on ``model`` (first spec = baseline), identical parameters;
    ``model_options``: build_model keyword arguments for every model (``{"depth": 1}``)."""
    dev = resolve_device(device)
    options = model_options or {}
    models = matched_models(model, specs, num_classes=num_classes, seed=seed, device=dev, dtype=dtype,
                            compile=compile, compile_backend=compile_backend, **options)
    shape = input_shape(build_model(model, num_classes=num_classes, attn=None, **options))
    inputs = torch.randn(batch_size, *shape, generator=torch.Generator().manual_seed(seed)).to(dev)
    result = measure_latency(models, inputs, warmup=warmup, iters=iters, rounds=rounds, progress=progress)
    result.update(model=model, dtype=dtype, compiled=compile)
    return result
