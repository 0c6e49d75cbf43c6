"""Backbones and model surgery."""

from .backbones import PRESETS, build_model
from .convert import attention_modules, convert


def __getattr__(name: str):
    # torchvision's detection models load on first use
    if name in ("DETECTOR_PRESETS", "build_detector"):
        from . import detection
        return getattr(detection, name)
    raise AttributeError(f"module 'attnlab.models' has no attribute {name!r}")


__all__ = ["PRESETS", "DETECTOR_PRESETS", "build_detector", "build_model", "convert", "attention_modules"]
