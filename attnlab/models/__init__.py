"""Backbones and model surgery."""

from .backbones import PRESETS, build_model
from .convert import attention_modules, convert
from .gpt import GPT, generate
from .gpt_loaders import gpt_from_file, load_gpt2_hf, load_gpt_file, load_nanogpt
from .timesformer import TimeSformer, init_from_image, load_timesformer

__all__ = ["PRESETS", "build_model", "convert", "attention_modules", "GPT", "generate", "gpt_from_file", "load_gpt2_hf",
           "load_gpt_file", "load_nanogpt", "TimeSformer", "init_from_image", "load_timesformer"]
