"""The video LLM (VisCoP probes on a Llama / Qwen decoder; docs/training.md, "Video LLM"): instruction tuning on
conversations about clips, the loss on the answer tokens only, evaluated by multiple-choice accuracy overall and per
category (Ego-in-Exo PerceptionMCQ's report).

A batch is ``(tokens (B, L), labels (B, L), clips (B, T, C, H, W), num_frames (B,))``, right-padded (labels IGNORE
past each sequence and outside answers; causal attention needs no mask for right padding). Epoch e's order is a
permutation drawn from (seed, e) alone, so a resumed run sees the batches of the uninterrupted one. The run's
``--attn`` spec is the probes' interaction modules' (the encoder and the decoder keep their standard attention).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from attnlab.errors import ConfigError
from attnlab.train.section import Section, at_least, non_negative, option, within

from .base import Task

if TYPE_CHECKING:  # pragma: no cover
    import torch

#: the demo's frame encoder: a timm ViT on the embedded set's 24 x 24 grey frames (4 x 4 patches)
ENCODER_PRESETS = {"vit_frames_tiny": dict(patch_size=4, embed_dim=64, depth=4, num_heads=4, mlp_ratio=2.0)}
MODEL_NAME = "viscop"


@dataclass(frozen=True)
class VLMConfig(Section):
    """vlm: keys of video-LLM runs (VisCoP probes; the run's --attn is the probes' interaction modules' spec)."""

    encoder: str = option("vit_frames_tiny", "vision encoder: 'vit_frames_tiny' (the demo's), a timm ViT name, or "
                                             "a SigLIP-NaViT Hugging Face folder (config.json, model.safetensors)")
    decoder: str = option("llama_tiny", "decoder: a Llama preset (llama_tiny, qwen3_tiny, ...; the built-in byte "
                                        "chat template) or a Hugging Face Qwen2/Llama folder (its tokenizer.json and "
                                        "chat template: Qwen's ChatML)")
    num_probes: int = option(16, "VisCoP's learnable probes (the authors: 16)", at_least(1))
    probe_layers: str = option("all", "encoder blocks whose output the probes cross-attend to: 'all' or indices "
                                      "such as '3,7,11'; --attn sets these interaction modules' attention "
                                      "(standard, dna(...))")
    use_visual_tokens: bool = option(True, "pass the encoder's (merged) visual tokens to the LLM")
    use_probes: bool = option(True, "pass the probes to the LLM")
    merge_size: int = option(2, "merge the encoder's tokens m x m per frame (VisCoP: 2)", at_least(1))
    frames_per_clip: int = option(40, "the most frames of a clip (the authors: 40 at 1 fps)", at_least(1))
    freeze_encoder: bool = option(True, "keep the vision encoder's weights fixed (VisCoP trains probes, projectors "
                                        "and the LLM)")
    encoder_pretrain_steps: int = option(0, "the embedded set only: first train the encoder this many steps to "
                                            "name the digits in a frame (multi-label), then freeze it (0: none)",
                                         non_negative)
    lora_rank: int = option(0, "LoRA rank on the decoder's linear layers through peft (0: full fine-tuning)",
                            non_negative)
    lora_alpha: float = option(16.0, "LoRA's alpha (the update is scaled by alpha / rank)",
                               lambda v: None if v > 0 else "be positive")
    lora_dropout: float = option(0.05, "dropout on LoRA's input", within(0, 1, open_high=True))
    gradient_checkpointing: bool = option(False, "recompute each decoder block in the backward pass (less memory)")
    eval_mode: str = option("likelihood", "how an answer is chosen: 'likelihood' (the most likely option letter) or "
                                          "'generate' (greedy generation, the first option letter parsed)",
                            choices=("likelihood", "generate"))
    max_new_tokens: int = option(16, "tokens generated per answer in eval_mode generate", at_least(1))


def _decoder_is_hf(name: str) -> bool:
    return "/" in name or Path(name).is_dir()


class VideoQA(Task):
    """Instruction tuning of a VisCoP video LLM, multiple-choice accuracy (module docstring)."""

    name = "vlm"
    section = VLMConfig
    trains = "a video language model"
    other_models = f"{MODEL_NAME} (the vlm section names its encoder and decoder)"
    metrics = ("accuracy", "test_loss")
    headline = "accuracy"
    report_columns = ("test_loss",)
    percent = True
    labelled_inputs = False
    curve_panels = (("train_loss", "train loss"), ("test_loss", "test loss"), ("accuracy", "test accuracy (%)"))
    default_instruments = False  # compare's default (spectra) reads self-attention; the probes': --analyze relevance

    def __init__(self, run) -> None:
        super().__init__(run)
        self._items: dict[bool, list] = {}
        self._encoded: dict[bool, list] = {}
        self._template = None

    # ---- what the data and the model agree on -----------------------------------------------------------------
    @property
    def template(self):
        """The chat template: the decoder folder's tokenizer and chat template, else the built-in byte template."""
        if self._template is None:
            from attnlab.data.video_qa import ByteChat, HFChat

            decoder = self.options.decoder
            self._template = HFChat(decoder) if _decoder_is_hf(decoder) else ByteChat()
        return self._template

    def _encoder_geometry(self) -> tuple[int, int]:
        """(patch size, depth) of the configured encoder, read without building it where possible."""
        import json

        name = self.options.encoder
        if name in ENCODER_PRESETS:
            return ENCODER_PRESETS[name]["patch_size"], ENCODER_PRESETS[name]["depth"]
        path = Path(name)
        if path.is_dir():
            try:
                config = json.loads((path / "config.json").read_text())
                config = config.get("vision_config", config)
                return int(config.get("patch_size", 14)), int(config["num_hidden_layers"])
            except (OSError, ValueError, KeyError, TypeError):
                raise ConfigError(f"encoder folder {path} has no readable config.json with patch_size and "
                                  f"num_hidden_layers; give a SigLIP-NaViT folder written by save_pretrained.") \
                    from None
        encoder = self._build_encoder(meta=True)
        return encoder.patch_embed.patch_size[0], len(encoder.blocks)

    def _block_size(self) -> int:
        import json

        decoder = self.options.decoder
        if _decoder_is_hf(decoder):
            try:
                return int(json.loads((Path(decoder) / "config.json").read_text()).get("max_position_embeddings", 2048))
            except (OSError, ValueError):
                raise ConfigError(f"decoder folder {decoder} has no readable config.json; give a Hugging Face "
                                  f"Qwen2/Llama folder.") from None
        from attnlab.models.llama import LLAMA_PRESETS

        if decoder not in LLAMA_PRESETS:
            raise ConfigError(f"decoder {decoder!r} is neither a Llama preset ({', '.join(LLAMA_PRESETS)}) nor a "
                              f"Hugging Face folder; give one of them.")
        return int(self.cfg.model_options.get("block_size", 512))

    def _visual_count(self, frames: int) -> int:
        patch, _ = self._encoder_geometry()
        side = patch * self.options.merge_size
        size = self.run.info.image_size
        if size % side:
            raise ConfigError(f"frames of {size} pixels do not split into {side}-pixel blocks (patch {patch} x merge "
                              f"{self.options.merge_size}); give --data-options '{{image_size: "
                              f"{max(side, size // side * side)}}}'.")
        return frames * (size // side) ** 2

    def _media(self, frames: int) -> list[int]:
        t, o = self.template, self.options
        return [t.image_id] * (self._visual_count(frames) if o.use_visual_tokens else 0) + \
            [t.probe_id] * (o.num_probes if o.use_probes else 0)

    def _source(self, train: bool) -> str:
        return f"dataset {self.cfg.dataset} ({'train' if train else 'test'} split)"

    def items(self, train: bool) -> list:
        if train not in self._items:
            from attnlab.data import build_dataset

            self._items[train] = build_dataset(self.cfg.dataset, train, data_dir=self.cfg.run.data_dir,
                                               **self.cfg.data_options)
        return self._items[train]

    def _frames_of(self, item) -> int:
        from attnlab.data.video import frame_files

        cap = min(self.run.info.num_frames, self.options.frames_per_clip)
        if item.clip is not None:
            return min(item.clip.shape[0], cap)
        if item.kind == "image":
            return 1
        if item.media.is_dir():
            return min(len(frame_files(item.media)), cap)
        return cap  # a video file: at most the sampled frames (counted without decoding it)

    def encoded(self, train: bool) -> list:
        """Each item as (ids, labels, prompt ids, frames), every item checked first (media, placeholders, length)."""
        if train not in self._encoded:
            from attnlab.data.video_qa import IGNORE, check_media

            block, source, out = self._block_size(), self._source(train), []
            for item in self.items(train):
                check_media(item, source)
                frames = self._frames_of(item)
                media = self._media(frames)
                ids, labels = self.template.encode(item.turns, media)
                if len(ids) > block:
                    raise ConfigError(f"{item.where(source)} is {len(ids)} tokens long with its {frames} frames, "
                                      f"more than the decoder's {block}; use fewer frames (num_frames), a larger "
                                      f"merge_size, or a shorter conversation.")
                if all(x == IGNORE for x in labels):
                    raise ConfigError(f"{item.where(source)} has no answer tokens; give its gpt turn a text.")
                out.append((ids, labels, self.template.prompt(item.turns[:_first_answer(item.turns)], media), frames))
            self._encoded[train] = out
        return self._encoded[train]

    # ---- checks ------------------------------------------------------------------------------------------------
    def check(self, cache: dict) -> None:
        if self.cfg.model != MODEL_NAME:
            raise ConfigError(f"the vlm family trains model {MODEL_NAME} (its encoder and decoder are the vlm "
                              f"section's keys), not {self.cfg.model}; give --model {MODEL_NAME}.")
        o = self.options
        if not (o.use_visual_tokens or o.use_probes):
            raise ConfigError("the LLM receives visual tokens, probes or both; set use_visual_tokens or use_probes.")
        if self.run.info.num_frames > o.frames_per_clip:
            raise ConfigError(f"the data samples {self.run.info.num_frames} frames per clip, more than "
                              f"frames_per_clip={o.frames_per_clip}; give --data-options '{{num_frames: "
                              f"{o.frames_per_clip}}}' or a larger frames_per_clip.")
        if o.encoder_pretrain_steps and self.cfg.dataset != "digits_qa":
            raise ConfigError("encoder_pretrain_steps trains the encoder on the embedded digits_qa set's digits; give "
                              "a pretrained encoder (a SigLIP-NaViT folder) for other data, and 0.")
        if o.lora_rank:
            try:
                import peft  # noqa: F401
            except ImportError:
                raise ConfigError("LoRA needs peft; pip install 'attnlab[vlm]' (or give lora_rank 0 for full "
                                  "fine-tuning).") from None
        from attnlab.models.probes import resolve_layers

        resolve_layers(o.probe_layers, self._encoder_geometry()[1])
        key = ("vlm-data", self.cfg.dataset, self.cfg.run.data_dir, repr(sorted(self.cfg.data_options.items())),
               o.encoder, o.decoder, o.merge_size, o.num_probes, o.use_probes, o.use_visual_tokens)
        if key not in cache:
            for train in (True, False):
                self.encoded(train)
            cache[key] = True

    # ---- the model ---------------------------------------------------------------------------------------------
    def _build_encoder(self, meta: bool = False):
        import torch

        from attnlab.models.siglip_navit import navit_from_hf

        name, info = self.options.encoder, self.run.info
        if Path(name).is_dir():
            return navit_from_hf(name)
        import timm
        from timm.models.vision_transformer import VisionTransformer

        kwargs = dict(img_size=info.image_size, in_chans=info.in_chans, num_classes=0)
        with torch.device("meta") if meta else _nullcontext():
            if name in ENCODER_PRESETS:
                return VisionTransformer(**ENCODER_PRESETS[name], **kwargs)
            try:
                model = timm.create_model(name, pretrained=self.cfg.pretrained and not meta, **kwargs)
            except RuntimeError as err:
                raise ConfigError(f"encoder {name!r} is not a timm model ({err}); give vit_frames_tiny, a timm ViT "
                                  f"or a SigLIP-NaViT folder.") from None
        if not isinstance(model, VisionTransformer):
            raise ConfigError(f"encoder {name} is a {type(model).__name__}; the probes read a timm "
                              f"VisionTransformer's blocks or SigLIP-NaViT's.")
        return model

    def _build_decoder(self):
        from attnlab.models import build_model
        from attnlab.models.hf_decoder import llama_from_hf

        name = self.options.decoder
        if _decoder_is_hf(name):
            decoder = llama_from_hf(name)
            if decoder.vocab_size < self.template.vocab_size:
                raise ConfigError(f"decoder {name} embeds {decoder.vocab_size} tokens, fewer than its tokenizer's "
                                  f"{self.template.vocab_size} with <image> and <probe>; give a checkpoint whose "
                                  f"embedding has room for them (Qwen2's has).")
            return decoder
        options = {"block_size": 512, **self.cfg.model_options, "vocab_size": self.template.vocab_size}
        return build_model(name, attn=None, **options)

    def build_model(self, pretrained: bool = True):
        from attnlab.models.viscop import VisCoPEncoder
        from attnlab.models.vlm import VisionLanguageModel

        o = self.options
        if self.cfg.model != MODEL_NAME:
            raise ConfigError(f"the vlm family trains model {MODEL_NAME}, not {self.cfg.model}; give --model "
                              f"{MODEL_NAME}.")
        encoder = self._build_encoder()
        meta = next(encoder.parameters()).device.type == "meta"
        if pretrained and o.encoder_pretrain_steps and not meta:
            pretrain_encoder(encoder, self.items(True), steps=o.encoder_pretrain_steps, seed=self.cfg.seed)
        vision = VisCoPEncoder(encoder, num_probes=o.num_probes, layers=o.probe_layers, attn=self.run.spec,
                               freeze_encoder=o.freeze_encoder)
        decoder = self._build_decoder()
        if o.lora_rank:
            decoder = add_lora(decoder, o.lora_rank, o.lora_alpha, o.lora_dropout)
        model = VisionLanguageModel(vision, decoder, image_token_id=self.template.image_id,
                                    probe_token_id=self.template.probe_id, merge_size=o.merge_size,
                                    frames_per_clip=o.frames_per_clip, use_visual_tokens=o.use_visual_tokens,
                                    use_probes=o.use_probes, gradient_checkpointing=o.gradient_checkpointing)
        return model

    # ---- training ----------------------------------------------------------------------------------------------
    def _collate(self, rows: list[tuple], train: bool, indices: list[int]):
        import torch

        from attnlab.data.video_qa import IGNORE, load_clip

        info, items = self.run.info, self.items(train)
        length = max(len(r[0]) for r in rows)
        tokens = torch.full((len(rows), length), self.template.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE, dtype=torch.long)
        for b, (ids, lab, _, _) in enumerate(rows):
            tokens[b, :len(ids)] = torch.tensor(ids)
            labels[b, :len(lab)] = torch.tensor(lab)
        clips = [load_clip(items[i], r[3], info.image_size, info.mean[0], info.std[0])[:r[3]]
                 for i, r in zip(indices, rows)]
        frames = torch.tensor([c.shape[0] for c in clips])
        video = torch.zeros(len(clips), int(frames.max()), *clips[0].shape[1:])
        for b, c in enumerate(clips):
            video[b, :c.shape[0]] = c
        return tokens, labels, video, frames

    def train_data(self, batch_size: int, device: torch.device):
        return _Batches(self, batch_size, device)

    def loss(self, model, batch):
        import torch.nn.functional as F

        from attnlab.data.video_qa import IGNORE

        tokens, labels, clips, frames = batch
        logits = model(tokens, clips, frames)
        target = labels[:, 1:]
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target.flatten(), ignore_index=IGNORE)
        return loss, {"seen": (target != IGNORE).sum()}

    # ---- evaluation --------------------------------------------------------------------------------------------
    def prepare_eval(self) -> None:
        self.encoded(False)

    def evaluate(self, model, *, device, amp_dtype, static_shapes: bool = False) -> dict[str, float]:
        import torch

        items, rows = self.items(False), self.encoded(False)
        per = max(1, self.cfg.batch_size)
        chosen, losses = [], []
        was = model.training
        model.eval()
        with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype or torch.float32,
                                             enabled=amp_dtype is not None):
            for start in range(0, len(rows), per):
                idx = list(range(start, min(start + per, len(rows))))
                prompts = [rows[i][2] for i in idx]
                tokens, clips, frames = (t.to(device) for t in self.prompt_batch(idx))
                if self.options.eval_mode == "generate":
                    chosen += [self._generate_choice(model, tokens[b:b + 1, :len(prompts[b])], clips[b:b + 1],
                                                     frames[b:b + 1], items[i]) for b, i in enumerate(idx)]
                    continue
                logits = model(tokens, clips, frames).float()
                for b, i in enumerate(idx):
                    last = logits[b, len(prompts[b]) - 1]
                    letters = torch.tensor(self.template.letter_ids(items[i].options), device=device)
                    chosen.append(int(last[letters].argmax()))
                    if items[i].answer >= 0:
                        losses.append(float(torch.nn.functional.cross_entropy(last[None], letters[items[i].answer,
                                                                                                  None])))
        model.train(was)
        return mcq_metrics(items, chosen, losses)

    def prompt_batch(self, indices: list[int]):
        """The evaluation prompts ``indices`` (up to the first answer) as (tokens (B, L) right-padded, clips (B, T,
        C, H, W), real frames (B,)): what evaluation and ``attnlab analyze`` feed the model."""
        rows = self.encoded(False)
        prompts = [(rows[i][2], rows[i][2], rows[i][2], rows[i][3]) for i in indices]
        tokens, _, clips, frames = self._collate(prompts, False, indices)
        return tokens, clips, frames

    def _generate_choice(self, model, tokens, clips, frames, item) -> int:
        """Greedy generation (no cache: the answers are short), then the first option letter in the text."""
        import torch

        from attnlab.data.video_qa import ByteChat

        new: list[int] = []
        stop = ByteChat.END if isinstance(self.template, ByteChat) else getattr(self.template.tok, "eos_token_id", -1)
        limit = model.decoder.block_size
        for _ in range(self.options.max_new_tokens):
            if tokens.shape[1] >= limit:
                break
            nxt = int(model(tokens, clips, frames)[0, -1].argmax())
            if nxt == stop:
                break
            new.append(nxt)
            tokens = torch.cat([tokens, tokens.new_tensor([[nxt]])], dim=1)
        text = bytes(t for t in new if t < 256).decode("utf-8", "replace") if isinstance(self.template, ByteChat) \
            else self.template.tok.decode(new, skip_special_tokens=True)
        return parse_choice(text, item.options)

    def example_input(self, batch: int = 1, device="cpu"):
        import torch

        if str(device) == "meta":  # the forward counts placeholders (a value on the host): no meta check
            raise NotImplementedError("the video LLM's forward reads values")
        return torch.zeros(batch, 8, dtype=torch.long, device=device)  # text alone: the decoder's path

    def inputs(self, n: int):
        """The first ``n`` evaluation prompts' text (right-padded; their clips are not part of it)."""
        import torch

        rows = self.encoded(False)[:n]
        tokens = torch.full((len(rows), max(len(r[2]) for r in rows)), self.template.pad_id, dtype=torch.long)
        for b, r in enumerate(rows):
            media = {self.template.image_id, self.template.probe_id}
            text = [t if t not in media else self.template.pad_id for t in r[2]]
            tokens[b, :len(text)] = torch.tensor(text)
        return tokens

    def instrument_inputs(self, n: int):
        """The first ``n`` evaluation prompts with their clips (:class:`~attnlab.models.vlm.VideoPrompts`)."""
        import torch

        from attnlab.models.vlm import VideoPrompts

        rows = self.encoded(False)[:n]
        lengths = torch.tensor([len(r[2]) for r in rows])
        return VideoPrompts(*self.prompt_batch(list(range(len(rows)))), lengths)

    def result(self, record: dict[str, Any]) -> dict[str, Any]:
        out = super().result(record)
        out.update({k: v for k, v in record.items() if k.startswith("acc_")})
        return out

    @staticmethod
    def columns_of(run: dict) -> list[str]:
        """The report's further columns of a run: its per-category accuracies, then the test loss."""
        return sorted(k for k in run if k.startswith("acc_")) + ["test_loss"]

    def line(self, record: dict[str, Any]) -> str:
        cats = "  ".join(f"{k[4:]} {record[k]:.1f}" for k in sorted(record) if k.startswith("acc_"))
        return (f"train_loss {record['train_loss']:.4f}  test_loss {record['test_loss']:.4f}  accuracy "
                f"{record['accuracy']:.2f}  ({cats})")

    def eval_table(self, metrics: dict[str, float]) -> list[str]:
        """The per-category table ``attnlab eval`` prints (PerceptionMCQ's report)."""
        counts: dict[str, int] = {}
        for item in self.items(False):
            if item.answer >= 0:
                counts[item.category or "all"] = counts.get(item.category or "all", 0) + 1
        width = max([len("category"), *map(len, counts)])
        lines = [f"{'category':<{width}}  {'items':>5}  accuracy"]
        for cat in sorted(counts):
            lines.append(f"{cat:<{width}}  {counts[cat]:>5}  {metrics.get('acc_' + _key(cat), float('nan')):8.2f}")
        lines.append(f"{'overall':<{width}}  {sum(counts.values()):>5}  {metrics['accuracy']:8.2f}")
        return lines


def _first_answer(turns) -> int:
    return next(k for k, (r, _) in enumerate(turns) if r == "assistant")


def _key(category: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", category.lower()).strip("_") or "all"


def parse_choice(text: str, letters: str) -> int:
    """The option a generated answer names: its first standalone option letter ("B", "(B)", "B. ..."), -1 if
    none (counted wrong)."""
    m = re.search(rf"(?<![A-Za-z])([{letters}])(?![A-Za-z])", text)
    return letters.index(m[1]) if m else -1


def mcq_metrics(items, chosen: list[int], losses: list[float]) -> dict[str, float]:
    """Accuracy (%) over the items with an answer, overall and per category (``acc_<category>``), and the mean
    loss of the answer letter."""
    right: dict[str, list[bool]] = {}
    for item, pick in zip(items, chosen):
        if item.answer >= 0:
            right.setdefault(_key(item.category) if item.category else "all", []).append(pick == item.answer)
    every = [x for v in right.values() for x in v]
    if not every:
        raise ConfigError("no evaluation item has a multiple-choice answer (a gpt value starting with an option "
                          "letter); give answers such as 'B'.")
    out = {"accuracy": 100.0 * sum(every) / len(every), "test_loss": sum(losses) / max(len(losses), 1)}
    if len(right) > 1 or "all" not in right:
        out.update({f"acc_{k}": 100.0 * sum(v) / len(v) for k, v in sorted(right.items())})
    return out


class _Batches:
    """The train split in batches (module docstring): epoch e's permutation from (seed, e), this rank's share."""

    def __init__(self, task: VideoQA, batch_size: int, device) -> None:
        self.task, self.batch_size, self.device = task, batch_size, device
        rows = task.encoded(True)
        ranks = task.run.ranks
        self.steps = len(rows) // ranks.world_size // batch_size
        if self.steps < 1:
            raise ConfigError(f"the train split holds {len(rows)} conversations, fewer than one batch of "
                              f"{batch_size} per process; give a smaller batch_size or more data.")

    def batches(self, epoch: int):
        import torch

        task, ranks = self.task, self.task.run.ranks
        rows = task.encoded(True)
        order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(task.cfg.seed * 1000 + epoch))
        mine = order[ranks.rank::ranks.world_size].tolist()
        for s in range(self.steps):
            idx = mine[s * self.batch_size:(s + 1) * self.batch_size]
            batch = task._collate([rows[i] for i in idx], True, idx)
            yield tuple(t.to(self.device, non_blocking=True) for t in batch)


def add_lora(decoder, rank: int, alpha: float, dropout: float):
    """LoRA adapters (peft) on the decoder blocks' linear layers (attention and MLP); the decoder's own weights
    frozen, as LLaVA's and VisCoP's LoRA runs."""
    from peft import LoraConfig, inject_adapter_in_model

    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout,
                        target_modules=r".*blocks\.\d+\.(attn\.(qkv|proj)|mlp\.(gate_proj|up_proj|down_proj))")
    return inject_adapter_in_model(config, decoder)


def pretrain_encoder(encoder, items, *, steps: int, seed: int, batch_size: int = 64, lr: float = 2e-3) -> None:
    """Train ``encoder`` (a timm ViT) to name the digits a frame shows (multi-label, a linear head on its mean
    token) and to give back each patch's pixels from its own token (a linear head per token, so that the tokens
    keep what is where); the heads are dropped afterwards. The demo's stand-in for a pretrained encoder, seeded by
    the run's seed alone (so that standard and DnA probes of one seed read the same encoder)."""
    import torch

    gen = torch.Generator().manual_seed(seed + 12345)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 12345)
        head = torch.nn.Linear(encoder.embed_dim, 10)
        p = encoder.patch_embed.patch_size[0]
        pixels = torch.nn.Linear(encoder.embed_dim, p * p * items[0].clip.shape[1])
        params = [*encoder.parameters(), *head.parameters(), *pixels.parameters()]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.1)
        targets = torch.zeros(len(items), 10)
        for i, item in enumerate(items):
            targets[i, item.digits] = 1
        encoder.train()
        for _ in range(steps):
            idx = torch.randint(0, len(items), (batch_size,), generator=gen)
            t = torch.randint(0, items[0].clip.shape[0], (batch_size,), generator=gen)
            frames = torch.stack([items[i].clip[f] for i, f in zip(idx.tolist(), t.tolist())])
            tokens = encoder.forward_features(frames)[:, encoder.num_prefix_tokens:]
            patches = torch.nn.functional.unfold(frames, p, stride=p).transpose(1, 2)  # (B, N, C p p), raster order
            loss = torch.nn.functional.binary_cross_entropy_with_logits(head(tokens.mean(1)), targets[idx]) + \
                torch.nn.functional.mse_loss(pixels(tokens), patches) * 10
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
        encoder.zero_grad(set_to_none=True)  # no gradient outlives the warm-up (a resumed run has none)
        encoder.eval()


class _nullcontext:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


__all__ = ["VLMConfig", "VideoQA", "add_lora", "mcq_metrics", "parse_choice", "pretrain_encoder"]
