"""Video question answering for the video LLM (``vlm`` family): the VisCoP / LLaVA instruction format and the
embedded moving-digits QA set.

An instruction file is a JSON list; each item names its media and holds the conversation::

    {"video": "clips/a.mp4" | "frames/a/" , "category": "tool use",          # or "image": "img/b.jpg"
     "conversations": [{"from": "human", "value": "<video>\\nWhich ...?\\nA. ...\\nB. ...\\nC. ...\\nD. ..."},
                       {"from": "gpt", "value": "B"}]}

Paths are relative to the file's folder (or absolute). The first human turn holds one ``<video>`` or ``<image>``
placeholder, which becomes the clip's visual-token placeholders, then ``num_probes`` probe placeholders (VisCoP's
processor writes both). The loss is on the answer (gpt) tokens only. For multiple-choice evaluation the answer is
the letter a gpt value starts with, the options are the question's lines ``A. ...`` (else A-D), and ``category``
(optional) groups the accuracy, as Ego-in-Exo PerceptionMCQ reports it.

The embedded set (:func:`digits_qa`) is made from :mod:`attnlab.data.moving_digits`' generator: one moving digit and
0-3 still ones per clip, four questions (which digit moves, which way, where it ends, how many digits), four options
each, one category per question; a training conversation asks all four in turn, an evaluation item one.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from attnlab.errors import DatasetError

IGNORE = -100
ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system"}
PLACEHOLDERS = ("<video>", "<image>")
LETTERS = "ABCDEFGHIJ"
_OPTION = re.compile(r"^\s*\(?([A-J])[\.\)]\s", re.M)
_ANSWER = re.compile(r"^\s*\(?([A-J])(?:[\.\):\s]|$)")


# ---- tokenizers and chat templates ---------------------------------------------------------------------------------
class ByteChat:
    """The built-in template of the demo's tiny decoder: bytes 0-255 and special tokens; a turn is ``<|user|>`` or
    ``<|assistant|>``, its text as UTF-8 bytes, then ``<|end|>``."""

    IMAGE, PROBE, SYSTEM, USER, ASSISTANT, END, PAD = range(256, 263)
    vocab_size = 264  # a multiple of 8
    name = "bytes"

    @property
    def image_id(self) -> int:
        return self.IMAGE

    @property
    def probe_id(self) -> int:
        return self.PROBE

    @property
    def pad_id(self) -> int:
        return self.PAD

    def letter_ids(self, letters: str) -> list[int]:
        return [ord(c) for c in letters]

    def encode(self, turns: list[tuple[str, str]], media: list[int]) -> tuple[list[int], list[int]]:
        """(ids, labels) of ``turns`` [(role, text)], the placeholder in the first user turn replaced by
        ``media`` (the visual and probe placeholder ids); labels are IGNORE outside assistant turns."""
        ids: list[int] = []
        labels: list[int] = []
        role_id = {"system": self.SYSTEM, "user": self.USER, "assistant": self.ASSISTANT}
        for role, text in turns:
            head, body = [role_id[role]], []
            for i, part in enumerate(_split_placeholder(text)):
                if i:
                    body += media
                body += list(part.encode("utf-8"))
            body.append(self.END)
            ids += head + body
            labels += [IGNORE] * len(head) + (body if role == "assistant" else [IGNORE] * len(body))
        return ids, labels

    def prompt(self, turns: list[tuple[str, str]], media: list[int]) -> list[int]:
        """The ids up to the answer: the turns, then the assistant's opening."""
        return self.encode(turns, media)[0] + [self.ASSISTANT]


class HFChat:
    """A Hugging Face tokenizer (tokenizer.json) with its chat template (tokenizer_config.json's ``chat_template``,
    Qwen's ChatML for Qwen checkpoints); the image and probe placeholders are its tokens ``<image>`` and
    ``<probe>`` (added as special tokens when the tokenizer lacks them, so ids at the end of the vocabulary)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        if not (folder / "tokenizer.json").is_file():
            raise DatasetError(f"tokenizer folder {folder} has no tokenizer.json; give the decoder's Hugging Face "
                               f"folder.")
        try:
            from transformers import PreTrainedTokenizerFast
        except ImportError:
            raise DatasetError("a Hugging Face chat template needs transformers; pip install transformers.") from None
        config = {}
        if (folder / "tokenizer_config.json").is_file():
            config = json.loads((folder / "tokenizer_config.json").read_text())
        self.tok = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
        self.tok.chat_template = config.get("chat_template")
        if not self.tok.chat_template:
            raise DatasetError(f"tokenizer folder {folder} has no chat_template in tokenizer_config.json; give the "
                               f"checkpoint's tokenizer_config.json (Qwen's holds ChatML).")
        self.tok.add_special_tokens({"additional_special_tokens": ["<image>", "<probe>"]})
        self.name = str(folder)
        self.vocab_size = len(self.tok)
        self.image_id, self.probe_id = self.tok.convert_tokens_to_ids(["<image>", "<probe>"])
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0

    def letter_ids(self, letters: str) -> list[int]:
        return [self.tok.encode(c, add_special_tokens=False)[0] for c in letters]

    def _render(self, turns, media_text: str, generation: bool) -> list[int]:
        messages = [{"role": r, "content": media_text.join(_split_placeholder(t))} for r, t in turns]
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation)
        return self.tok.encode(text, add_special_tokens=False)

    def encode(self, turns, media):
        media_text = "".join("<image>" if i == self.image_id else "<probe>" for i in media)
        ids = self._render(turns, media_text, False)
        labels = [IGNORE] * len(ids)
        for k, (role, _) in enumerate(turns):  # each answer: the tokens its turn adds after the generation prompt
            if role == "assistant":
                start = len(self._render(turns[:k], media_text, True))
                end = len(self._render(turns[:k + 1], media_text, False))
                labels[start:end] = ids[start:end]
        return ids, labels

    def prompt(self, turns, media):
        media_text = "".join("<image>" if i == self.image_id else "<probe>" for i in media)
        return self._render(turns, media_text, True)


def _split_placeholder(text: str) -> list[str]:
    return re.split(r"<video>|<image>", text)


# ---- items ---------------------------------------------------------------------------------------------------------
@dataclass
class QAItem:
    """One conversation: its media (a path, or a clip already in memory (T, C, H, W)), turns [(role, text)], its
    category and the multiple-choice answer (letter index, -1: none) among ``options`` letters."""

    index: int
    media: Path | None
    kind: str  # "video" or "image"
    turns: list[tuple[str, str]]
    category: str = ""
    answer: int = -1
    options: str = "ABCD"
    clip: torch.Tensor | None = field(default=None, repr=False)
    digits: list[int] = field(default_factory=list)  # the embedded set: the digits shown (the encoder's labels)
    file: str = ""  # the instruction file it came from

    def where(self, source: str) -> str:
        return f"item {self.index} of {self.file or source}" + (f" ({self.media})" if self.media is not None else "")


def _parse_turns(raw: Any, where: str) -> list[tuple[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise DatasetError(f"{where} has no 'conversations' list; give [{{\"from\": \"human\", \"value\": ...}}, "
                           f"{{\"from\": \"gpt\", \"value\": ...}}].")
    turns = []
    for turn in raw:
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise DatasetError(f"{where} has a turn without a text 'value'; each turn is {{\"from\": ..., "
                               f"\"value\": \"...\"}}.")
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))))
        if role is None:
            raise DatasetError(f"{where} has a turn from {turn.get('from')!r}, an unknown role; use human or gpt.")
        turns.append((role, turn["value"]))
    if not any(r == "assistant" for r, _ in turns):
        raise DatasetError(f"{where} has no gpt turn, so nothing to learn or answer; add the answer.")
    first_user = next((t for r, t in turns if r == "user"), "")
    count = sum(len(re.findall(r"<video>|<image>", t)) for _, t in turns)
    if count != 1 or len(_split_placeholder(first_user)) != 2:
        raise DatasetError(f"{where} holds {count} <video>/<image> placeholders; the first human turn needs "
                           f"exactly one, where the clip goes.")
    return turns


def _mcq(turns: list[tuple[str, str]]) -> tuple[int, str]:
    """(answer letter index or -1, option letters) of a conversation."""
    question = next(t for r, t in turns if r == "user")
    letters = "".join(dict.fromkeys(_OPTION.findall(question))) or "ABCD"
    answer = next(t for r, t in turns if r == "assistant")
    m = _ANSWER.match(answer)
    return (letters.index(m[1]) if m and m[1] in letters else -1), letters


def read_instructions(path: str | Path) -> list[QAItem]:
    """The items of a VisCoP/LLaVA instruction file; DatasetError naming the item and file for a bad one (the
    media are checked by :func:`check_media`)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DatasetError(f"instruction file {path} does not exist; give a JSON list of conversations.") from None
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as err:
        raise DatasetError(f"instruction file {path} cannot be read as JSON ({str(err).splitlines()[0][:80]}).") \
            from None
    if not isinstance(data, list) or not data:
        raise DatasetError(f"instruction file {path} must hold a non-empty JSON list of items.")
    items = []
    for i, raw in enumerate(data):
        where = f"item {i} of {path}"
        if not isinstance(raw, dict):
            raise DatasetError(f"{where} is not a JSON object; each item holds a video or image and conversations.")
        kinds = [k for k in ("video", "image") if k in raw]
        if len(kinds) != 1 or not isinstance(raw[kinds[0]], str):
            raise DatasetError(f"{where} must name one 'video' (file or frame folder) or 'image' (a path).")
        media = Path(raw[kinds[0]])
        media = media if media.is_absolute() else path.parent / media
        turns = _parse_turns(raw.get("conversations"), f"{where} ({media})")
        answer, letters = _mcq(turns)
        items.append(QAItem(i, media, kinds[0], turns, str(raw.get("category", "")), answer, letters, file=str(path)))
    return items


def check_media(item: QAItem, source: str) -> None:
    """DatasetError naming the item when its video file, frame folder or image is missing or unreadable (headers
    only)."""
    from attnlab.data.images import image_size

    from .video import check_frames, probe_video

    media = item.media
    if media is None:
        return
    if not media.exists():
        raise DatasetError(f"{item.where(source)}: the {item.kind} does not exist; fix the path (relative to the "
                           f"file's folder).")
    try:
        if media.is_dir():
            check_frames(media)
        elif item.kind == "image":
            image_size(media, f"image of {item.where(source)}:")
        else:
            probe_video(media)
    except DatasetError as err:
        raise DatasetError(f"{item.where(source)}: {err}") from None


def load_clip(item: QAItem, num_frames: int, image_size: int, mean: float, std: float) -> torch.Tensor:
    """The item's frames (T <= num_frames, sampled uniformly; an image: T = 1) as (T, 3, S, S) float, resized to
    ``image_size`` and normalised."""
    import torch.nn.functional as F

    if item.clip is not None:
        return item.clip
    from .video import _pick, _read_frames, decode_video, frame_files, sample_indices

    media = item.media
    if media.is_dir():
        files = frame_files(media)
        video = _read_frames(files, sample_indices(len(files), min(num_frames, len(files))), 3)
    elif item.kind == "image":
        from PIL import Image

        with Image.open(media) as image:
            video = torch.from_numpy(np.asarray(image.convert("RGB"))).permute(2, 0, 1)[None]
    else:
        frames = decode_video(media)
        video = _pick(frames, sample_indices(len(frames), min(num_frames, len(frames))), 3, media)
    video = F.interpolate(video.float() / 255, size=(image_size, image_size), mode="bilinear", antialias=True)
    return (video - mean) / std


# ---- the embedded set ----------------------------------------------------------------------------------------------
CATEGORIES = ("digit", "direction", "end", "count")
DIRECTION_WORDS = ("right", "left", "down", "up")
ENDS = ("top left", "top right", "bottom left", "bottom right")


def digits_qa(train: bool, *, num_items: int, num_frames: int, image_size: int, seed: int) -> list[QAItem]:
    """The moving-digits QA set of one split (module docstring): clips (T, 1, S, S) in [0, 1] with pixels of
    several digits maxed, one question per item, the category cycling through :data:`CATEGORIES`."""
    from .moving_digits import generate
    from .tensor import digits_split

    x_tr, y_tr, x_te, y_te = digits_split()
    digits, labels = (x_tr, y_tr) if train else (x_te, y_te)
    rng = np.random.default_rng(np.random.SeedSequence([seed, 7, 0 if train else 1]))
    common = dict(num_frames=num_frames, image_size=image_size, directions=4, label="digit_direction", rng=rng)
    moving, move_label, direction = generate(digits, labels, num_items, speed=1, **common)
    extra = rng.integers(0, 4, num_items)  # still digits beside the moving one: 0-3
    clips = moving.copy()
    present = [{int(d)} for d in move_label // 4]
    for k in range(3):
        still, still_label, _ = generate(digits, labels, num_items, speed=0, **common)
        on = extra > k
        clips[on] = np.maximum(clips[on], still[on])
        for i in np.flatnonzero(on):
            present[i].add(int(still_label[i] // 4))
    items = []
    for i in range(num_items):
        digit = int(move_label[i] // 4)
        qa = {}
        for category in CATEGORIES:
            if category == "digit":
                others = rng.permutation([d for d in range(10) if d != digit])[:3]
                options = sorted([digit, *others.tolist()])
                question, answer = "Which digit moves?", options.index(digit)
                texts = [str(d) for d in options]
            elif category == "direction":
                question, answer, texts = "Which way does the digit move?", int(direction[i]), list(DIRECTION_WORDS)
            elif category == "end":
                ys, xs = np.nonzero(moving[i, -1] > 0)
                cy, cx = (ys.mean(), xs.mean()) if len(ys) else (0, 0)
                centre = (image_size - 1) / 2
                answer = 2 * int(cy > centre) + int(cx > centre)
                question, texts = "Where does the moving digit end?", list(ENDS)
            else:
                question, answer, texts = "How many digits are there?", int(extra[i]), ["1", "2", "3", "4"]
            lines = "\n".join(f"{LETTERS[k]}. {t}" for k, t in enumerate(texts))
            qa[category] = (f"{question}\n{lines}", answer)
        # training: every question about the clip, in a random order, as turns of one conversation (LLaVA's
        # multi-turn format: four answers learnt per clip); evaluation: one question per clip, the category in turn
        asked = [CATEGORIES[k] for k in rng.permutation(4)] if train else [CATEGORIES[i % 4]]
        turns = []
        for k, category in enumerate(asked):
            turns += [("user", ("<video>\n" if k == 0 else "") + qa[category][0]),
                      ("assistant", LETTERS[qa[category][1]])]
        clip = torch.from_numpy(clips[i]).unsqueeze(1)  # (T, 1, S, S)
        items.append(QAItem(i, None, "video", turns, asked[0], qa[asked[0]][1], "ABCD", clip=clip,
                            digits=sorted(present[i])))
    return items


# ---- the table's entries (attnlab.data.registry) -------------------------------------------------------------------
def _info(name: str, image_size: int, in_chans: int, mean: float, std: float, num_frames: int):
    from .video import VideoInfo

    return VideoInfo(name, 0, image_size, in_chans, (mean,), (std,), "vlm", (), num_frames, ())


def digits_qa_info(data_dir=None, **options):
    from .registry import resolve_options

    opts = resolve_options("digits_qa", options)
    return _info("digits_qa", opts["image_size"], 1, 0.0, 1.0, opts["num_frames"])


def build_digits_qa(train: bool, *, data_dir=None, download: bool = False, augment: str = "none", **options):
    """The embedded moving-digits QA split (``data_dir`` is not used: nothing is read)."""
    from .registry import resolve_options

    opts = resolve_options("digits_qa", options)
    need = 8 + opts["num_frames"] - 1
    if opts["image_size"] < need:
        raise DatasetError(f"digits_qa with num_frames={opts['num_frames']} needs image_size of at least {need} (the "
                           f"digit's 8 pixels plus its path); raise image_size or lower num_frames.")
    return digits_qa(train, num_items=opts["num_train" if train else "num_test"], num_frames=opts["num_frames"],
                     image_size=opts["image_size"], seed=opts["seed"])


def _file(data_dir, name: str) -> Path:
    path = Path(name)
    return path if path.is_absolute() else Path(data_dir or ".") / path


def video_qa_info(data_dir="data", **options):
    from .registry import resolve_options

    opts = resolve_options("video_qa", options)
    return _info("video_qa", opts["image_size"], 3, opts["mean"], opts["std"], opts["num_frames"])


def build_video_qa(train: bool, *, data_dir="data", download: bool = False, augment: str = "none", **options):
    """The items of ``<data_dir>/<train|val>`` (a VisCoP/LLaVA instruction JSON; media checked when a run starts)."""
    from .registry import resolve_options

    opts = resolve_options("video_qa", options)
    return read_instructions(_file(data_dir, opts["train_file" if train else "val_file"]))


def video_qa_fingerprint(data_dir="data", **options) -> dict[str, str]:
    """The instruction files' content hashes and each split's media stamps (a replaced clip changes it)."""
    import hashlib

    from .registry import file_sha256, file_stamp, folder_stamp, resolve_options

    opts = resolve_options("video_qa", options)
    out = {}
    for split in ("train", "val"):
        path = _file(data_dir, opts[f"{split}_file"])
        out[f"{split} instructions"] = file_sha256(path)
        try:
            items = read_instructions(path)
        except DatasetError:
            continue
        stamps = sorted({f"{i.media} {folder_stamp(i.media) if i.media.is_dir() else file_stamp(i.media)}"
                         for i in items})
        out[f"{split} media"] = (f"{len(stamps)} files, stamps sha256 "
                                 f"{hashlib.sha256(chr(10).join(stamps).encode()).hexdigest()[:16]}")
    return out


def digits_qa_fingerprint(data_dir=None, **options) -> dict[str, str]:
    """The generated set is a function of its options and the digits: the options, as the generator saw them."""
    from .registry import resolve_options

    opts = resolve_options("digits_qa", options)
    return {"generator": "moving digits QA v2 " + ", ".join(f"{k}={v}" for k, v in sorted(opts.items()))}


__all__ = ["ByteChat", "CATEGORIES", "HFChat", "IGNORE", "QAItem", "check_media", "digits_qa", "load_clip",
           "read_instructions", "build_digits_qa", "build_video_qa", "digits_qa_info", "video_qa_info",
           "digits_qa_fingerprint", "video_qa_fingerprint"]
