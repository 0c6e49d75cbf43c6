"""The VisCoP authors' vision-encoder weights (their ``ViSCoP_VisionEncoderModel``, in the DnA repository's
``viscop/`` folder) in attnlab's :class:`~attnlab.models.viscop.VisCoPEncoder` with a SigLIP-NaViT encoder.

Their names -> attnlab's:

    embeddings.*, encoder.layers.*, post_layernorm.*       encoder.* (:func:`.siglip_navit.navit_to_attnlab`)
    encoder.visual_probes (1, P, dim)                      probes.probes
    encoder.interaction_modules.{k}.q_proj / k_proj / v_proj / out_proj                     (cross_attention)
        -> probes.interaction_modules.{k}.q, .kv (rows K, V), .proj
    encoder.interaction_modules.{k}.q_pos_proj / q_neg_proj / k_proj / v_pos_proj / v_neg_proj / out_proj,
        neg_scalers (H,)                                                           (cross_denoising_attention)
        -> .q (rows Q+, Q-), .kv (rows K, V+, -V-), .proj, .alpha = neg_scalers

Their DnA module subtracts the softmin branch (o+ - neg_scalers * o-); attnlab adds it (o+ + alpha * o-), so V- and its
bias are negated on the way in (alpha = neg_scalers keeps alpha's sign and init, 0.5). A full VideoLLaMA3 / VisCoP
checkpoint keeps these names under ``model.vision_encoder.vision_encoder.``, which is dropped.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..errors import ConfigError
from .pretrained import load_strict
from .siglip_navit import SigLIPNaViT, navit_to_attnlab
from .probes import VisualProbes
from .viscop import VisCoPEncoder

_PREFIX = "model.vision_encoder.vision_encoder."
_STANDARD = {"q": ("q_proj",), "kv": ("k_proj", "v_proj")}
_DNA = {"q": ("q_pos_proj", "q_neg_proj"), "kv": ("k_proj", "v_pos_proj", "v_neg_proj")}


def probes_to_attnlab(state: Mapping[str, torch.Tensor], probes: VisualProbes, source: str = "VisCoP weights"
                      ) -> dict[str, torch.Tensor]:
    """The authors' probes and interaction modules (``encoder.visual_probes``, ``encoder.interaction_modules.*``,
    any other key ignored) under :class:`VisualProbes`' names; ConfigError (one line) when they do not fit."""
    term = probes.term
    if term.name == "dna" and term.resolved()["variant"] != "qv":
        raise ConfigError(f"{source} hold Q±V± interaction modules; build the probes with dna(variant=qv).")
    names, count = _DNA if term.name == "dna" else _STANDARD, len(probes.interaction_modules)
    fits = f"give the weights of a model with {count} {term} interaction modules and visual probes"
    out = {"probes": state.get("encoder.visual_probes")}
    for k in range(count):
        prefix = f"encoder.interaction_modules.{k}."
        for part in ("weight", "bias"):
            for ours, theirs in names.items():
                keys = [f"{prefix}{n}.{part}" for n in theirs]
                missing = next((key for key in keys if key not in state), None)
                if missing:
                    raise ConfigError(f"{source} have no {missing!r}; {fits}.")
                pieces = [-state[key] if "v_neg" in key else state[key] for key in keys]  # their minus, our plus
                out[f"interaction_modules.{k}.{ours}.{part}"] = torch.cat(pieces)
            out[f"interaction_modules.{k}.proj.{part}"] = state.get(f"{prefix}out_proj.{part}")
        if term.name == "dna":
            out[f"interaction_modules.{k}.alpha"] = state.get(f"{prefix}neg_scalers")
    unused = sorted(k for k in state if k.startswith("encoder.interaction_modules.") and int(k.split(".")[2]) >= count)
    if unused or any(v is None for v in out.values()):
        what = unused[0] if unused else next(k for k, v in out.items() if v is None)
        raise ConfigError(f"{source} do not fit the probes ({what!r}); {fits}.")
    return out


def viscop_to_attnlab(state: Mapping[str, torch.Tensor], vision: VisCoPEncoder, source: str = "VisCoP weights"
                      ) -> dict[str, torch.Tensor]:
    """The authors' ``ViSCoP_VisionEncoderModel`` state dict under ``vision``'s names (``vision``: a SigLIP-NaViT
    encoder with probes of the same kind); ConfigError (one line) when it does not fit."""
    if not isinstance(vision.encoder, SigLIPNaViT):
        raise ConfigError(f"{source} hold a SigLIP-NaViT encoder; build the VisCoPEncoder on SigLIPNaViT.")
    state = {k.removeprefix(_PREFIX): v for k, v in state.items()}
    encoder = {k: v for k, v in state.items() if not k.startswith(("encoder.interaction_modules.",
                                                                    "encoder.visual_probes"))}
    out = {f"encoder.{k}": v for k, v in navit_to_attnlab(encoder, vision.encoder.depth, source).items()}
    return {**out, **{f"probes.{k}": v for k, v in probes_to_attnlab(state, vision.probes, source).items()}}


def load_viscop_authors(vision: VisCoPEncoder, state: Mapping[str, torch.Tensor],
                        source: str = "VisCoP weights") -> VisCoPEncoder:
    """Load the authors' vision-encoder weights into ``vision`` (strict: every tensor has its place)."""
    return load_strict(vision, viscop_to_attnlab(state, vision, source), source)


__all__ = ["load_viscop_authors", "probes_to_attnlab", "viscop_to_attnlab"]
