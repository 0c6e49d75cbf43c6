"""Backbones and model surgery."""

from .backbones import PRESETS, build_model
from .convert import attention_modules, convert
from .timesformer import TimeSformer, init_from_image, load_timesformer

__all__ = ["PRESETS", "build_model", "convert", "attention_modules", "TimeSformer", "init_from_image",
           "load_timesformer"]
