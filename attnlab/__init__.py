"""attnlab: attention variants of four recent papers as one-word options on timm's ViT and Swin.

    import attnlab
    model = attnlab.build_model("vit_cifar", num_classes=100, attn="ns")
    attnlab.convert(model, "standard")
"""

from __future__ import annotations

import importlib

from .errors import AttnlabError, ConfigError, DatasetError, ModelNotFoundError, SpecError, UnsupportedModelError
from .spec import Spec, Term, parse_spec
from .variants import list_variants

__version__ = "0.1.0"

_LAZY = {
    "AttentionMask": ("attnlab.attention.mask", "AttentionMask"),
    "build_model": ("attnlab.models", "build_model"),
    "convert": ("attnlab.models", "convert"),
    "fold": ("attnlab.reparam", "fold"),
}
_SUBMODULES = ("ops", "attention", "reparam", "models", "data", "train", "analysis", "bench", "report")


def __getattr__(name: str):
    # heavy layers (timm, torchvision, matplotlib) load on first use, so `import attnlab` and the CLI stay quick
    if name in _LAZY:
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    if name in _SUBMODULES:
        return importlib.import_module(f"attnlab.{name}")
    raise AttributeError(f"module 'attnlab' has no attribute {name!r}")


__all__ = [
    "__version__", "AttnlabError", "ConfigError", "DatasetError", "ModelNotFoundError", "SpecError",
    "UnsupportedModelError", "Spec", "Term", "parse_spec", "list_variants", "AttentionMask", "build_model", "convert",
    "fold",
]
