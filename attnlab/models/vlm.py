"""A video language model with visual probes: VisCoP (Reilly et al., arXiv:2510.13808) on VideoLLaMA3
(arXiv:2501.13106), the DnA paper's video LLM (Sec. 4.2, "Video LLM", Table 5(b)).

    clips --VisCoPEncoder--> visual tokens (B, T*n, d_v), probes (B, P, d_v)
          --projector (mlp2x_gelu: Linear, GELU, Linear)-->        (B, T*n, d)   into the image placeholders
          --probe_projector (its own mlp2x_gelu)-->                (B, P, d)     into the probe placeholders
    tokens (B, L) --decoder's embedding, placeholders replaced--> decoder blocks --> norm --> logits (B, L, vocab)

The prompt holds one ``image_token_id`` per visual token of the sample (its real frames, in order, each frame's
tokens in raster order) and ``num_probes`` ``probe_token_id`` (VisCoP's processor writes both); a count that does
not match is refused in one line (VisCoP's own code then silently skips the visual tokens). The decoder is attnlab's
:class:`~attnlab.models.llama.Llama` (a preset, or Hugging Face Llama / Qwen2 weights through
:func:`~attnlab.models.hf_decoder.llama_from_hf`). LoRA on the decoder (the authors' recipe) is for the training
task to add through ``peft``; full fine-tuning needs nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, fields

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import ConfigError
from .llama import Llama
from .viscop import VisCoPEncoder


@dataclass
class VideoPrompts:
    """Prompts and their clips as :meth:`VisionLanguageModel.forward` takes them: ``tokens`` (B, L) right-padded,
    ``clips`` (B, T, C, H, W), ``num_frames`` (B,) real frames per clip, ``lengths`` (B,) tokens per prompt (what
    the instruments of ``attnlab analyze`` read on a video LLM run)."""

    tokens: torch.Tensor
    clips: torch.Tensor
    num_frames: torch.Tensor
    lengths: torch.Tensor

    def to(self, device) -> "VideoPrompts":
        return VideoPrompts(*(getattr(self, f.name).to(device) for f in fields(self)))

    def __getitem__(self, rows: slice) -> "VideoPrompts":
        return VideoPrompts(*(getattr(self, f.name)[rows] for f in fields(self)))

    def __len__(self) -> int:
        return len(self.tokens)


class Projector(nn.Module):
    """VideoLLaMA3's projector ``mlp{N}x_gelu`` (Linear, then N-1 times GELU and Linear; VisCoP: mlp2x_gelu) or
    ``linear``, its Linears in ``readout`` as theirs (``readout.0``, ``readout.2``)."""

    def __init__(self, kind: str, in_dim: int, out_dim: int) -> None:
        super().__init__()
        match = re.fullmatch(r"mlp([1-9]\d*)x_gelu", kind)
        if kind != "linear" and not match:
            raise ConfigError(f"the projector is 'linear' or 'mlp<N>x_gelu' (VisCoP's: mlp2x_gelu), not {kind!r}.")
        layers: list[nn.Module] = [nn.Linear(in_dim, out_dim)]
        for _ in range((int(match[1]) if match else 1) - 1):
            layers += [nn.GELU(), nn.Linear(out_dim, out_dim)]
        self.kind, self.readout = kind, nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.readout(x)


class VisionLanguageModel(nn.Module):
    """VisCoP's video LLM (module docstring).

    Args:
        vision: a :class:`~attnlab.models.viscop.VisCoPEncoder` (encoder, probes, warm start, frozen or not).
        decoder: a :class:`~attnlab.models.llama.Llama`.
        image_token_id, probe_token_id: the placeholder ids (tokens the tokenizer added for ``<image>`` and the
            probes).
        projector: ``mlp2x_gelu`` (VisCoP's) or another :class:`Projector` kind, for both projectors.
        use_visual_tokens, use_probes: which of the two the LLM receives (VisCoP's DnA script: both).
        merge_size: m, the encoder's tokens merged m x m per frame (VisCoP: 2 for images and videos).
        frames_per_clip: the most frames a clip may hold (VisCoP's DnA script: 40 at 1 fps); longer is refused.
        gradient_checkpointing: recompute each decoder block in the backward pass instead of keeping its
            activations (the authors' script turns it on); training only.
    """

    def __init__(self, vision: VisCoPEncoder, decoder: Llama, *, image_token_id: int, probe_token_id: int,
                 projector: str = "mlp2x_gelu", use_visual_tokens: bool = True, use_probes: bool = True,
                 merge_size: int = 2, frames_per_clip: int = 40, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        if not isinstance(decoder, Llama):
            raise ConfigError(f"the video LLM's decoder is a Llama / Qwen model (a preset or Hugging Face weights), "
                              f"not {type(decoder).__name__}.")
        if not (use_visual_tokens or use_probes):
            raise ConfigError("the LLM receives visual tokens, probes or both; set use_visual_tokens or use_probes.")
        for name, value in (("image_token_id", image_token_id), ("probe_token_id", probe_token_id)):
            if not 0 <= value < decoder.vocab_size:
                raise ConfigError(f"{name}={value} is outside the decoder's {decoder.vocab_size} tokens.")
        if image_token_id == probe_token_id:
            raise ConfigError("image_token_id and probe_token_id must differ.")
        if merge_size < 1 or frames_per_clip < 1:
            raise ConfigError(f"merge_size and frames_per_clip must be at least 1; got {merge_size} and "
                              f"{frames_per_clip}.")
        self.vision, self.decoder = vision, decoder
        self.image_token_id, self.probe_token_id = image_token_id, probe_token_id
        self.use_visual_tokens, self.use_probes = use_visual_tokens, use_probes
        self.merge_size, self.frames_per_clip = merge_size, frames_per_clip
        self.gradient_checkpointing = gradient_checkpointing
        weight = decoder.wte.weight
        self.projector = Projector(projector, vision.embed_dim, decoder.embed_dim).to(weight.device, weight.dtype)
        self.probe_projector = Projector(projector, vision.embed_dim, decoder.embed_dim).to(weight.device,
                                                                                             weight.dtype)
        # the authors start the probe projector as a copy of the visual one (train_viscop.py)
        self.probe_projector.load_state_dict(self.projector.state_dict())

    def embed(self, tokens: torch.Tensor, clips: torch.Tensor | None = None,
              num_frames: torch.Tensor | None = None) -> torch.Tensor:
        """The decoder's input (B, L, d): token embeddings, the placeholders replaced by the projected visual tokens
        and probes of each sample's clip."""
        x = self.decoder.wte(tokens)
        unused = [(i, what) for i, what, used in ((self.image_token_id, "visual tokens", self.use_visual_tokens),
                                                  (self.probe_token_id, "probes", self.use_probes))
                  if (clips is None or not used) and bool((tokens == i).any())]
        if unused:
            i, what = unused[0]
            why = "no clips were given" if clips is None else f"the model passes no {what} to the LLM"
            raise ConfigError(f"the tokens hold placeholders (id {i}) for {what}, but {why}; drop them from the prompt.")
        if clips is None:
            return x
        if clips.shape[1] > self.frames_per_clip:
            raise ConfigError(f"clips of {clips.shape[1]} frames are longer than frames_per_clip="
                              f"{self.frames_per_clip}; sample at most that many frames.")
        visual, valid, probes = self.vision(clips, num_frames, self.merge_size)
        parts = []
        if self.use_visual_tokens:
            parts.append((self.image_token_id, self.projector(visual), valid, "visual tokens"))
        if self.use_probes:
            parts.append((self.probe_token_id, self.probe_projector(probes), None, "probes"))
        x = x.clone()
        for token_id, values, keep, what in parts:
            where = tokens == token_id
            want = values.shape[1] if keep is None else keep.sum(dim=1)
            have = where.sum(dim=1)
            if bool((have != want).any()):
                count = want if keep is None else want.tolist()
                raise ConfigError(f"the prompts hold {have.tolist()} placeholders (id {token_id}) for {count} {what} "
                                  f"per sample; write one placeholder per {what[:-1]}.")
            x[where] = (values.flatten(0, 1) if keep is None else values[keep]).to(x.dtype)
        return x

    def forward(self, tokens: torch.Tensor, clips: torch.Tensor | None = None,
                num_frames: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (B, L) with placeholders, clips (B, T, C, H, W), num_frames (B,) -> next-token logits
        (B, L, vocab); right padding (after each prompt) needs no mask under causal attention."""
        if tokens.shape[1] > self.decoder.block_size:
            raise ConfigError(f"a sequence of {tokens.shape[1]} tokens is longer than the decoder's block_size "
                              f"{self.decoder.block_size}; use fewer frames or a larger merge size.")
        x = self.embed(tokens, clips, num_frames)
        for block in self.decoder.blocks:
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.decoder.head(self.decoder.norm(x))

    def visual_token_count(self, num_frames: int, height: int, width: int) -> int:
        """Image placeholders a prompt needs for a clip of ``num_frames`` frames of height x width pixels."""
        side = self.vision.encoder.patch_size * self.merge_size
        return num_frames * (height // side) * (width // side)


__all__ = ["Projector", "VisionLanguageModel"]
