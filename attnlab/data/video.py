"""Video clips for action classification: video files (decoded with PyAV) and folders of extracted frames.

Layouts, transforms and what is checked when a dataset is built: docs/training.md, "Video". In short: clips in
``<data_dir>/train|val/<class>/`` or listed in ``<lists>/train.csv`` and ``val.csv`` ("path label" lines); a clip
is a video file (``VIDEO_EXTENSIONS``) or a folder of its frames numbered consecutively.

Frame sampling (:func:`sample_indices`): the clip's L frames are cut into T equal segments [t L/T, (t+1) L/T);
view v of V takes the point at fraction (v + 1/2)/V of every segment, training a uniformly random point of each (a
clip shorter than T repeats frames by the same rule, as the authors' TimeSformer sampler does). Items: training
``(clip (C, T, H, W) float32, label)``; evaluation with several views ``(views (V, C, T, H, W), label)``, V = clips x
crops, clip-major.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from attnlab.data.registry import DatasetInfo, resolve_options
from attnlab.errors import DatasetError

VIDEO_EXTENSIONS = (".mp4", ".avi", ".mkv", ".webm", ".mov", ".m4v", ".mpg", ".mpeg")
FRAME_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
MEAN, STD = (0.45, 0.45, 0.45), (0.225, 0.225, 0.225)  # TimeSformer's (and SlowFast's) DATA.MEAN / DATA.STD
JITTER = (8 / 7, 10 / 7)  # TimeSformer's TRAIN_JITTER_SCALES [256, 320] for crops of 224

CHANNELS = (1, 3)
CROPS = (1, 3)


@dataclass(frozen=True)
class VideoInfo(DatasetInfo):
    """What a model needs to know about a video dataset: the image datasets' fields plus frames and class names;
    ``model_args`` size a TimeSformer (num_classes, in_chans, img_size, num_frames)."""

    num_frames: int = 8
    classes: tuple[str, ...] = ()


def video_info_of(name: str, classes: tuple[str, ...], image_size: int, in_chans: int, mean: tuple, std: tuple,
                  num_frames: int) -> VideoInfo:
    args = (("num_classes", len(classes)), ("in_chans", in_chans), ("img_size", image_size),
            ("num_frames", num_frames))
    return VideoInfo(name, len(classes), image_size, in_chans, mean, std, "video", args, num_frames, classes)


@dataclass(frozen=True)
class Clip:
    path: Path
    label: int


# ---- frame sampling ------------------------------------------------------------------------------------------------
def sample_indices(length: int, num_frames: int, *, train: bool = False, view: int = 0, views: int = 1,
                   generator: torch.Generator | None = None) -> list[int]:
    """``num_frames`` frame indices of a clip of ``length`` frames (module docstring): the point at fraction
    (view + 1/2) / views of each of T equal segments, or with ``train=True`` a uniform random point of each."""
    if length < 1:
        raise DatasetError("a clip has no frames; every clip needs at least one.")
    if not 0 <= view < views:
        raise DatasetError(f"view {view} of {views} is not valid; views are numbered 0 to {views - 1}.")
    if train:
        offsets = torch.rand(num_frames, generator=generator, dtype=torch.float64).tolist()
    else:
        offsets = [(view + 0.5) / views] * num_frames
    segment = length / num_frames
    return [min(int(segment * (t + offset)), length - 1) for t, offset in enumerate(offsets)]


# ---- reading clips -------------------------------------------------------------------------------------------------
def _av():
    try:
        import av
    except ImportError:
        raise DatasetError("reading video files needs PyAV; pip install 'attnlab[video]' (or extract the frames "
                           "into one folder per clip).") from None
    return av


def frame_files(folder: Path) -> list[Path]:
    """The frames of a frame folder in order of the trailing number in their names; a gap, a repeated number, a
    name without a number, or no frame at all is a DatasetError."""
    files = [p for p in folder.iterdir() if p.suffix.lower() in FRAME_EXTENSIONS and p.is_file()]
    if not files:
        raise DatasetError(f"frame folder {folder} holds no frames ({' '.join(FRAME_EXTENSIONS)}); put the "
                           f"clip's frames in it, numbered from the first.")
    numbered = []
    for p in files:
        m = re.search(r"(\d+)$", p.stem)
        if m is None:
            raise DatasetError(f"frame {p} has no frame number at the end of its name; name frames like "
                               f"img_00001.jpg, numbered consecutively.")
        numbered.append((int(m[1]), p))
    numbered.sort()
    numbers = [n for n, _ in numbered]
    for previous, n in zip(numbers, numbers[1:]):
        if n == previous:
            raise DatasetError(f"frame folder {folder} holds frame {n} twice; keep one file per frame number.")
        if n != previous + 1:
            raise DatasetError(f"frame folder {folder} has a gap: frame {previous + 1} is missing (frames "
                               f"{previous} and {n} exist); extract every frame, numbered consecutively.")
    return [p for _, p in numbered]


def _read_frames(files: list[Path], indices: list[int], in_chans: int) -> torch.Tensor:
    from PIL import Image, UnidentifiedImageError

    mode = "L" if in_chans == 1 else "RGB"
    frames = {}
    for i in sorted(set(indices)):
        try:
            with Image.open(files[i]) as image:
                frames[i] = np.asarray(image.convert(mode))
        except (OSError, UnidentifiedImageError) as err:
            raise DatasetError(f"frame {files[i]} of clip {files[i].parent} cannot be decoded "
                               f"({str(err).splitlines()[0][:80]}); replace it with a readable image.") from None
    return _stack([frames[i] for i in indices], files[0].parent)


def _stack(frames: list[np.ndarray], clip: Path) -> torch.Tensor:
    """(T, C, H, W) uint8 from T arrays (H, W) or (H, W, C); frames of different sizes are an error."""
    if len({f.shape for f in frames}) > 1:
        raise DatasetError(f"the frames of clip {clip} have different sizes ({frames[0].shape} and another); give "
                           f"clips whose frames share one size.")
    video = torch.from_numpy(np.stack(frames))
    return video.unsqueeze(1) if video.ndim == 3 else video.permute(0, 3, 1, 2)


def check_frames(folder: Path) -> None:
    """Every frame of a frame folder read by its header (no pixel decoded): an image of 8 bits per sample, all of
    one size; DatasetError naming the clip and the frame otherwise."""
    from attnlab.data.images import image_size

    files = frame_files(folder)
    first = image_size(files[0], f"frame of clip {folder}:")
    for path in files[1:]:
        size = image_size(path, f"frame of clip {folder}:")
        if size != first:
            raise DatasetError(f"frame {path.name} of clip {folder} is {size[0]} x {size[1]} pixels, but "
                               f"{files[0].name} is {first[0]} x {first[1]}; give clips whose frames share one size.")


def probe_video(path: Path) -> None:
    """DatasetError unless PyAV opens ``path`` and finds a video stream (reads the header, decodes nothing)."""
    av = _av()
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise DatasetError(f"video file {path} has no video stream; give a file with one.")
    except (av.FFmpegError, OSError, UnicodeDecodeError) as err:
        raise DatasetError(f"video file {path} cannot be opened by PyAV ({str(err).splitlines()[0][:80]}); give a "
                           f"decodable video or a folder of its frames.") from None


def decode_video(path: Path) -> list:
    """Every frame of the first video stream of ``path`` as PyAV frames (converted to arrays only when picked)."""
    av = _av()
    try:
        with av.open(str(path)) as container:
            frames = list(container.decode(container.streams.video[0]))  # one thread: workers decode in parallel
    except (av.FFmpegError, OSError, IndexError, UnicodeDecodeError) as err:
        raise DatasetError(f"video file {path} cannot be decoded ({str(err).splitlines()[0][:80] or 'no video'}); "
                           f"give a decodable video or a folder of its frames.") from None
    if not frames:
        raise DatasetError(f"video file {path} holds no decodable frame; give a clip with at least one.")
    return frames


def _pick(frames: list, indices: list[int], in_chans: int, path: Path) -> torch.Tensor:
    fmt = "gray" if in_chans == 1 else "rgb24"
    arrays = {i: frames[i].to_ndarray(format=fmt) for i in set(indices)}
    return _stack([arrays[i] for i in indices], path)


# ---- transforms ----------------------------------------------------------------------------------------------------
def train_transform(image_size: int, mean=MEAN, std=STD):
    """TimeSformer's training transform on a (T, C, H, W) uint8 clip: short-side scale jitter, random crop, flip."""
    from torchvision.transforms import v2

    low, high = (round(image_size * s) for s in JITTER)
    return v2.Compose([v2.RandomResize(low, high + 1), v2.RandomCrop(image_size), v2.RandomHorizontalFlip(),
                       v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def eval_views(video: torch.Tensor, image_size: int, crops: int, mean=MEAN, std=STD) -> list[torch.Tensor]:
    """The ``crops`` evaluation crops of a (T, C, H, W) uint8 clip, each normalised (T, C, S, S): the short side
    resized to S, then S x S crops at the start, centre and end of the long side (crops=3) or the centre (1)."""
    from torchvision import tv_tensors
    from torchvision.transforms.v2 import functional as F

    video = F.resize(tv_tensors.Video(video), [image_size])
    h, w = video.shape[-2:]
    long = max(h, w) - image_size
    offsets = [long // 2] if crops == 1 else [0, long // 2, long]
    views = []
    for o in offsets:
        top, left = (o, (w - image_size) // 2) if h > w else ((h - image_size) // 2, o)
        view = F.crop(video, top, left, image_size, image_size)
        views.append(F.normalize(F.to_dtype(view, torch.float32, scale=True), mean, std).as_subclass(torch.Tensor))
    return views


# ---- the dataset ---------------------------------------------------------------------------------------------------
class VideoDataset(Dataset):
    """Clips (video files or frame folders) with labels, sampled and transformed as the module docstring says.

    Args:
        clips: the (path, label) records. num_frames: T. image_size: the crop S. in_chans: 1 (grey) or 3 (RGB).
        train: training sampling (temporal jitter) and, with ``augment="recipe"``, the recipe's spatial transform;
            otherwise the evaluation views (``clips`` temporal x ``crops`` spatial).
        classes: the class names, index = label.
    """

    def __init__(self, clips: list[Clip], *, num_frames: int, image_size: int, in_chans: int = 3, train: bool,
                 augment: str = "none", clips_per_video: int = 1, crops: int = 3,
                 classes: tuple[str, ...] = ()) -> None:
        self.clips, self.classes = clips, tuple(classes)
        self.num_frames, self.image_size, self.in_chans = num_frames, image_size, in_chans
        self.train, self.augment = train, augment
        self.views = (1, 1) if train else (clips_per_video, crops)
        self.mean, self.std = MEAN[:in_chans], STD[:in_chans]
        self.transform = train_transform(image_size, self.mean, self.std) if train and augment == "recipe" else None

    def __len__(self) -> int:
        return len(self.clips)

    def __getitem__(self, index: int):
        clip = self.clips[index]
        temporal, crops = self.views
        jitter = self.transform is not None
        folder = clip.path.is_dir()
        if folder:
            frames, read = frame_files(clip.path), _read_frames
        else:
            frames = decode_video(clip.path)
            read = lambda f, i, c: _pick(f, i, c, clip.path)  # noqa: E731
        videos = [read(frames, sample_indices(len(frames), self.num_frames, train=jitter, view=v, views=temporal),
                       self.in_chans) for v in range(temporal)]  # one (T, C, H, W) uint8 clip per temporal view
        if self.transform is not None:
            from torchvision import tv_tensors

            out = self.transform(tv_tensors.Video(videos[0])).as_subclass(torch.Tensor)
            return out.transpose(0, 1).contiguous(), clip.label
        views = [v.transpose(0, 1) for video in videos
                 for v in eval_views(video, self.image_size, crops, self.mean, self.std)]
        return (views[0].contiguous() if len(views) == 1 else torch.stack(views)), clip.label


# ---- layouts -------------------------------------------------------------------------------------------------------
def _is_clip(path: Path) -> bool:
    return path.is_dir() or path.suffix.lower() in VIDEO_EXTENSIONS


def _split_file(folder: Path, train: bool) -> Path | None:
    names = ("train",) if train else ("val", "test")
    return next((folder / f"{n}{ext}" for n in names for ext in (".csv", ".txt") if (folder / f"{n}{ext}").is_file()),
                None)


def _read_list(path: Path) -> list[tuple[int, str, str]]:
    """(line number, clip path, label text) of every non-empty line: "path label" or "path,label"."""
    rows = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        parts = next(csv.reader([line])) if "," in line else line.split()
        parts = [p.strip() for p in parts if p.strip()]
        if len(parts) != 2:
            raise DatasetError(f"{path} line {number} has {len(parts)} fields; write one clip per line as "
                               f"'path label' or 'path,label'.")
        rows.append((number, parts[0], parts[1]))
    if not rows:
        raise DatasetError(f"{path} lists no clips; write one clip per line as 'path label'.")
    return rows


def _list_classes(rows: list[tuple[int, str, str]], num_classes: int, path: Path) -> tuple[str, ...]:
    integers = [re.fullmatch(r"[+-]?\d+", label) is not None for _, _, label in rows]
    if any(integers):
        bad = next(((n, label) for (n, _, label), i in zip(rows, integers) if i and int(label) < 0), None)
        if bad is not None:
            raise DatasetError(f"{path} line {bad[0]}: label {bad[1]} is negative; class indices run from 0 to the "
                               f"number of classes - 1.")
        if not all(integers):
            n, label = next((n, label) for (n, _, label), i in zip(rows, integers) if not i)
            raise DatasetError(f"{path} line {n}: label {label!r} is a name, but other lines give class indices; "
                               f"label every clip by index or every clip by name.")
    if all(re.fullmatch(r"\d+", label) for _, _, label in rows):
        count = num_classes or 1 + max(int(label) for _, _, label in rows)
        return tuple(str(i) for i in range(count))
    return tuple(sorted({label for _, _, label in rows}))


def _label(path: Path, number: int, label: str, classes: tuple[str, ...]) -> int:
    index = {name: i for i, name in enumerate(classes)}.get(label)
    if index is None and re.fullmatch(r"\d+", label) and all(c.isdigit() for c in classes):
        raise DatasetError(f"{path} line {number}: label {label} is outside the {len(classes)} classes "
                           f"(0 to {len(classes) - 1}); give a class index below {len(classes)} or set num_classes.")
    if index is None:
        shown = ", ".join(classes[:5]) + (", ..." if len(classes) > 5 else "")
        raise DatasetError(f"{path} line {number}: label {label!r} is not one of the training list's classes "
                           f"({shown}); use a class of the training split.")
    return index


def _root(data_dir) -> Path:
    root = Path(data_dir).expanduser().resolve()
    if not root.is_dir():
        raise DatasetError(f"video data folder {root} does not exist; pass --data-dir with train/ and val/ (one "
                           f"subfolder per class) or train.csv and val.csv.")
    return root


def _layout(root: Path, lists: str) -> tuple[str, Path]:
    folder = root / lists if lists else root
    if _split_file(folder, True) or _split_file(folder, False):
        return "lists", folder
    if lists:  # asked for lists: the folder layout beside them is not what was meant
        what = "has no train.csv/.txt nor val.csv/.txt" if folder.is_dir() else "does not exist"
        raise DatasetError(f"video lists folder {folder} {what}; give the lists option a folder under {root} that "
                           f"holds them, or lists '' for the train/ and val/ class folders.")
    if any((root / n).is_dir() for n in ("train", "val", "test")):
        return "folders", root
    raise DatasetError(f"video data folder {folder} has neither train.csv/.txt and val.csv/.txt nor train/ and val/ "
                       f"class folders; lay the clips out one way or the other.")


def _folder_split(root: Path, train: bool) -> Path:
    names = ("train",) if train else ("val", "test")
    path = next((root / n for n in names if (root / n).is_dir()), None)
    if path is None:
        raise DatasetError(f"video data folder {root} has no {' or '.join(names)} folder; put that split's clips "
                           f"in one subfolder per class.")
    return path


def video_classes(data_dir, lists: str = "", num_classes: int = 0) -> tuple[str, ...]:
    """Class names (index = label) without reading a clip: the training split's class folders (or its list's
    labels: indices 0..max, or the sorted names), the evaluation split's when there is no training split."""
    root = _root(data_dir)
    kind, folder = _layout(root, lists)
    if kind == "lists":
        path = _split_file(folder, True) or _split_file(folder, False)
        return _list_classes(_read_list(path), num_classes, path)
    split = root / "train" if (root / "train").is_dir() else _folder_split(root, train=False)
    classes = tuple(sorted(p.name for p in split.iterdir() if p.is_dir()))
    if not classes:
        raise DatasetError(f"{split} has no class subfolders; put each class's clips in its own subfolder.")
    return classes


def scan_clips(data_dir, train: bool, *, lists: str = "", num_classes: int = 0, verify: bool = True
               ) -> tuple[list[Clip], tuple[str, ...]]:
    """The split's clips and the class names, every path, frame folder and label checked (module docstring)."""
    root = _root(data_dir)
    kind, folder = _layout(root, lists)
    classes = video_classes(root, lists, num_classes)
    clips: list[Clip] = []
    if kind == "lists":
        path = _split_file(folder, train)
        if path is None:
            raise DatasetError(f"{folder} has no {'train' if train else 'val or test'} list (.csv or .txt); write "
                               f"one clip per line as 'path label'.")
        for number, name, label in _read_list(path):
            clip = (root / name) if not Path(name).is_absolute() else Path(name)
            if not clip.exists():
                raise DatasetError(f"{path} line {number}: {clip} does not exist; give paths relative to {root}.")
            clips.append(Clip(clip, _label(path, number, label, classes)))
    else:
        split = _folder_split(root, train)
        for name in sorted(p.name for p in split.iterdir() if p.is_dir()):
            if name not in classes:
                raise DatasetError(f"{split / name} is not a class of the training split ({len(classes)} classes); "
                                   f"use the training split's class folders.")
            found = [Clip(p, classes.index(name)) for p in sorted((split / name).iterdir()) if _is_clip(p)]
            if not found:
                raise DatasetError(f"class folder {split / name} holds no clips; put its video files "
                                   f"({' '.join(VIDEO_EXTENSIONS)}) or frame folders in it, or remove it.")
            clips += found
        if not clips:
            raise DatasetError(f"{split} holds no clips; put video files ({' '.join(VIDEO_EXTENSIONS)}) or frame "
                               f"folders in one subfolder per class.")
    from tqdm.auto import tqdm

    for clip in tqdm(clips, desc=f"checking the {'training' if train else 'evaluation'} clips", unit="clip",
                     leave=False, disable=len(clips) < 500):
        if clip.path.is_dir():
            check_frames(clip.path) if verify else frame_files(clip.path)
        elif clip.path.suffix.lower() not in VIDEO_EXTENSIONS:
            raise DatasetError(f"{clip.path} is neither a frame folder nor a video file "
                               f"({' '.join(VIDEO_EXTENSIONS)}); give one of those.")
        elif verify:
            probe_video(clip.path)
    return clips, classes


def video_fingerprint(data_dir="data", **options) -> dict[str, str]:
    """The class list (index = label) and, per split, the clips and their labels as a count and a digest (a renamed
    class folder or a clip moved to another class changes them); each clip's path relative to the data folder (a
    copy elsewhere is the same data) and its content (registry.part_stamp of a video file, of every frame of a frame
    folder) go into the digest."""
    import hashlib

    from attnlab.data.registry import folder_stamp, part_stamp

    opts = _check(options)
    root = _root(data_dir)
    out = {}

    def where(path: Path) -> str:
        return path.relative_to(root).as_posix() if path.is_relative_to(root) else str(path)

    for train, split in ((True, "training clips"), (False, "evaluation clips")):
        clips, classes = scan_clips(root, train, lists=opts["lists"], num_classes=opts["num_classes"],
                                    verify=False)
        out["classes"] = ", ".join(classes) if len(classes) <= 20 else \
            f"{len(classes)} classes, sha256 {hashlib.sha256(repr(classes).encode()).hexdigest()[:16]}"
        lines = sorted(f"{where(c.path)} {c.label} {folder_stamp(c.path) if c.path.is_dir() else part_stamp(c.path)}"
                       for c in clips)
        out[split] = f"{len(clips)} clips, sha256 {hashlib.sha256(chr(10).join(lines).encode()).hexdigest()[:16]}"
    return out


def _check(options: dict) -> dict:
    """The table's options (defaults, types, bounds) with the choices of the two integer options checked."""
    opts = resolve_options("video", options)
    if opts["in_chans"] not in CHANNELS or opts["crops"] not in CROPS:
        raise DatasetError(f"video options in_chans and crops take 1 or 3, not {opts['in_chans']} and "
                           f"{opts['crops']}.")
    return opts


def video_info(data_dir="data", **options) -> VideoInfo:
    """Classes, frames, crop size, channels and normalisation of a video dataset, reading no clip."""
    opts = _check(options)
    classes = video_classes(data_dir, opts["lists"], opts["num_classes"])
    c = opts["in_chans"]
    return video_info_of("video", classes, opts["image_size"], c, MEAN[:c], STD[:c], opts["num_frames"])


def build_video(train: bool, *, data_dir="data", download: bool = False, augment: str = "none",
                **options) -> VideoDataset:
    """The video dataset of a split (module docstring), checked before any clip is decoded."""
    opts = _check(options)
    if download:
        raise DatasetError("video data cannot be downloaded by attnlab; lay the clips out under --data-dir.")
    clips, classes = scan_clips(data_dir, train, lists=opts["lists"], num_classes=opts["num_classes"],
                                verify=opts["verify"])
    c = opts["in_chans"]
    return VideoDataset(clips, num_frames=opts["num_frames"], image_size=opts["image_size"], in_chans=c, train=train,
                        augment=augment, clips_per_video=opts["clips"], crops=opts["crops"], classes=classes)


__all__ = ["Clip", "FRAME_EXTENSIONS", "VIDEO_EXTENSIONS", "VideoDataset", "VideoInfo", "build_video",
           "check_frames", "decode_video", "eval_views", "frame_files", "probe_video", "sample_indices", "scan_clips",
           "train_transform", "video_classes", "video_info"]
