"""Backbones and model surgery."""

from .backbones import PRESETS, build_model
from .convert import attention_modules, convert

__all__ = ["PRESETS", "build_model", "convert", "attention_modules"]
