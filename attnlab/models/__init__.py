"""Backbones and model surgery."""

from .backbones import PRESETS, build_model
from .convert import attention_modules, convert
from .gpt import GPT, generate
from .gpt_loaders import gpt_from_file, load_gpt2_hf, load_gpt_file, load_nanogpt
from .hf_decoder import export_hf, llama_from_hf, load_hf_decoder
from .llama import Llama
from .timesformer import TimeSformer, init_from_image, load_timesformer
from .siglip_navit import SigLIPNaViT, navit_from_hf
from .viscop import VisCoPEncoder
from .vlm import VisionLanguageModel


def __getattr__(name: str):
    # torchvision's detection models load on first use
    if name in ("DETECTOR_PRESETS", "build_detector"):
        from . import detection
        return getattr(detection, name)
    raise AttributeError(f"module 'attnlab.models' has no attribute {name!r}")


__all__ = ["PRESETS", "DETECTOR_PRESETS", "build_detector", "build_model", "convert", "attention_modules", "GPT",
           "generate", "gpt_from_file", "load_gpt2_hf", "load_gpt_file", "load_nanogpt", "Llama", "export_hf",
           "llama_from_hf", "load_hf_decoder", "TimeSformer", "init_from_image", "load_timesformer", "SigLIPNaViT",
           "navit_from_hf", "VisCoPEncoder", "VisionLanguageModel"]
