"""Evaluate a trained run or a model with given weights: top-1, top-5, loss, RMS calibration error and AURRA (and,
with --ood, AUROC of -max softmax against out-of-distribution images), printed as one JSON line. The metrics are the
DnA paper's robustness metrics (Table 4: ImageNet-A; Table 10: ImageNet-O and -R); docs/methods.md states them.

Examples:
  attnlab eval runs/demo/vit_digits-digits-dna-s0
  attnlab eval runs/demo/vit_digits-digits-dna-s0 --noise 0.5
  attnlab eval runs/vitdet_tiny-shapes-dna-s0      # a detection run: COCO box and mask AP on its val split
  attnlab eval --model vit_digits --attn dna --checkpoint weights.safetensors --dataset digits
  attnlab eval --model vit_base_patch16_224 --attn dna --checkpoint theirs.pth --dna-layout legacy --folder val
  attnlab eval --model deit_tiny_patch16_224 --pretrained --folder imagenet-a --classes imagenet_wnids.txt
  attnlab eval --model deit_tiny_patch16_224 --pretrained-file w.safetensors --folder val --ood imagenet-o
  attnlab eval runs/c10/vit_cifar-cifar10-dna-s0 --ood svhn_images

--folder DIR reads one subfolder of images per class (ImageNet-A/-R/-O as you bring them); with --classes FILE (the
model's class names, one per line in output order, e.g. the 1000 ImageNet wnids) each subfolder name is looked up
and the logits are restricted to those classes, as Hendrycks et al. evaluate ImageNet-A and -R; without it the sorted
subfolders are the model's classes 0, 1, ... Images are read in the model's channels, resized and centre-cropped to
its input size; a file that is not an image, or has more than 64 megapixels, is refused before any is evaluated.
--model needs weights (--checkpoint, --pretrained, --pretrained-file); --random-weights evaluates its seeded random
initialisation on purpose.
--ood DIR is an image folder (any subfolders) compared with --folder's images, or with the dataset split's, in
which case it is read like the dataset (its channels, size and normalisation).
A run of another task family (detection) prints the metrics its training logs, on its own evaluation split."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ConfigError, DatasetError
from .checks import count, run_dir


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="run directory (config.yaml + checkpoint)")
    p.add_argument("--model", default=None, help="a preset or timm model name, instead of RUN_DIR")
    p.add_argument("--attn", default="standard", help="variant spec of --model (default standard)")
    p.add_argument("--checkpoint", default=None, metavar="FILE",
                   help="weights of --model (built with --attn): safetensors or a weights-only torch file")
    p.add_argument("--dna-layout", choices=("auto", "forward", "legacy", "separate"), default=None,
                   help="read --checkpoint as a DnA authors' state dict of this layout (docs/methods.md)")
    p.add_argument("--dna-sign", choices=("+", "-"), default="+",
                   help="with --dna-layout: '-' for their files that subtract the softmin branch")
    p.add_argument("--pretrained", action="store_true", help="timm's pretrained weights for --model (hub cache)")
    p.add_argument("--pretrained-file", default=None, metavar="FILE",
                   help="timm-format weights for --model, loaded before --attn converts it")
    p.add_argument("--random-weights", action="store_true",
                   help="evaluate --model's random initialisation (seeded by --seed), e.g. as a chance baseline; "
                        "without it --model needs weights")
    p.add_argument("--dataset", default=None, help="dataset whose test split is evaluated (default: the run's, or "
                                                   "digits)")
    p.add_argument("--data-dir", default=None, help="dataset directory (default: the run's, or data/); for a run, "
                                                    "where its data lies now if it has moved")
    p.add_argument("--split", choices=("test", "train"), default="test", help="split of --dataset (default test)")
    p.add_argument("--folder", default=None, metavar="DIR", help="evaluate on this image folder (one subfolder per "
                                                                 "class) instead of a dataset split")
    p.add_argument("--classes", default=None, metavar="FILE",
                   help="the model's class names, one per line in output order, to map --folder's subfolders")
    p.add_argument("--ood", default=None, metavar="DIR", help="image folder of out-of-distribution images: AUROC")
    p.add_argument("--num-classes", type=count(1), default=None, help="classes of --model (default: the dataset's)")
    p.add_argument("--image-size", type=count(1), default=None,
                   help="input size of --model and of folder images (default: the dataset's, else the model's own)")
    p.add_argument("--noise", type=float, default=0.0, metavar="STD",
                   help="Gaussian noise N(0, STD^2) added to each normalised input (default 0)")
    p.add_argument("--images", type=count(1), default=None, help="evaluate only the first N images of each set")
    p.add_argument("--batch-size", type=count(1), default=64, help="images per forward (default 64)")
    p.add_argument("--seed", type=int, default=0, help="seed of the noise draw (and of a fresh --model)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")


def _folder(path: str, what: str):
    root = Path(path)
    if not root.is_dir():
        raise DatasetError(f"{what} {root} is not a directory; give a folder with one subfolder of images per class.")
    if not any(p.is_dir() for p in root.iterdir()):
        raise DatasetError(f"{what} {root} has no subfolders; put the images in one subfolder per class.")
    return root


def _class_indices(classes_file: str, folder_classes: list[str], outputs: int | None) -> list[int]:
    path = Path(classes_file)
    if not path.is_file():
        raise ConfigError(f"--classes {path} is not a file; give a text file of class names, one per line.")
    names = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    if outputs is not None and len(names) > outputs:
        raise ConfigError(f"--classes {path} has {len(names)} names, but the model has {outputs} outputs; give one "
                          "name per output, in output order.")
    seen: dict[str, int] = {}
    for line, name in enumerate(names, start=1):
        if name in seen:
            raise ConfigError(f"--classes {path} names {name!r} twice (names {seen[name] + 1} and {line}); each "
                              "output has one name.")
        seen[name] = line - 1
    missing = next((c for c in folder_classes if c not in seen), None)
    if missing is not None:
        raise ConfigError(f"--folder's subfolder {missing!r} is not among the {len(names)} names in --classes "
                          f"{path}; give the model's class names (e.g. ImageNet wnids), one per line.")
    return [seen[c] for c in folder_classes]


def _input_shape(model) -> tuple[int, int, int] | None:
    """(channels, height, width) of an image model's input, None for a model without a patch embedding."""
    from ..bench.matched import input_shape

    return input_shape(model) if getattr(model, "patch_embed", None) is not None else None


def _shape_words(chans: int, size) -> str:
    h, w = (size, size) if isinstance(size, int) else size
    return f"{chans}-channel {h} x {w}"


def _check_dataset(model, info, trained_on: str | None) -> None:
    """ConfigError unless ``info``'s images (channels, size) and classes fit ``model`` (trained on ``trained_on``)."""
    shape, outputs = _input_shape(model), getattr(model, "num_classes", None)
    wanted = None if shape is None else (shape[0], tuple(shape[1:]))
    size = (info.image_size,) * 2 if isinstance(info.image_size, int) else tuple(info.image_size)
    if (wanted is not None and wanted != (info.in_chans, size)) or (outputs is not None
                                                                     and info.num_classes > outputs):
        what = f"the run's model (trained on {trained_on})" if trained_on else "the model"
        takes = f"takes {_shape_words(shape[0], tuple(shape[1:]))} images and " if shape else ""
        raise ConfigError(f"--dataset {info.name} has {_shape_words(info.in_chans, size)} images in "
                          f"{info.num_classes} classes, but {what} {takes}has {outputs} outputs; evaluate on a "
                          "dataset of that shape, or on an image folder with --folder.")


def _folder_norm(info, chans: int) -> dict:
    """Normalisation of folder images: the dataset's when there is one, else timm's ImageNet statistics (averaged
    over the colours for a 1-channel model)."""
    from ..data.registry import IMAGENET_MEAN, IMAGENET_STD

    if info is not None and len(info.mean) == chans:
        return dict(mean=tuple(info.mean), std=tuple(info.std))
    if chans == 1:
        return dict(mean=(sum(IMAGENET_MEAN) / 3,), std=(sum(IMAGENET_STD) / 3,))
    return dict(mean=IMAGENET_MEAN, std=IMAGENET_STD)


def run(args) -> int:
    if bool(args.run_dir) == bool(args.model):
        raise ConfigError("give a run directory, or --model (with --checkpoint, --pretrained or --pretrained-file), "
                          "not both.")
    weights = next((f for f, v in (("--checkpoint", args.checkpoint), ("--pretrained", args.pretrained),
                                   ("--pretrained-file", args.pretrained_file)) if v), None)
    if args.run_dir:
        run_dir(args.run_dir)
        if weights or args.random_weights:
            raise ConfigError(f"{weights or '--random-weights'} goes with --model; a run directory brings its own "
                              "weights.")
    elif args.checkpoint and (args.pretrained or args.pretrained_file):
        raise ConfigError("give --checkpoint (weights of the converted model) or --pretrained/--pretrained-file "
                          "(timm weights converted after loading), not both.")
    if args.dna_layout and not args.checkpoint:
        raise ConfigError("--dna-layout says how to read --checkpoint; give --checkpoint (the DnA authors' file) "
                          "as well.")
    if args.model and not weights and not args.random_weights:
        raise ConfigError(f"--model {args.model} has no weights to evaluate; give --checkpoint FILE, --pretrained or "
                          "--pretrained-file FILE (or --random-weights to measure a random initialisation on "
                          "purpose).")
    if args.model and weights and args.random_weights:
        raise ConfigError(f"--random-weights evaluates a fresh initialisation; drop it, or drop {weights}.")
    if args.classes and not args.folder:
        raise ConfigError("--classes maps --folder's subfolders to the model's outputs; give --folder as well.")
    folder = _folder(args.folder, "--folder") if args.folder else None
    ood = _folder(args.ood, "--ood") if args.ood else None

    import torch

    from ..analysis.evaluation import evaluate, image_folder
    from ..data import build_dataset, dataset_info
    from ..data.folder import folder_transform
    from ..train.run import resolve_device

    device = resolve_device(args.device)
    if args.run_dir:
        from ..train import load_run
        from ..train.run import Run

        opened = Run.open(args.run_dir, data_dir=args.data_dir)
        if not args.folder and (args.dataset or opened.cfg.dataset) == opened.cfg.dataset:
            # evaluated on the run's own data, which must be what it trained on (files only training reads aside)
            opened.check_data("eval", skip=("train.bin", "train shards", "training clips"))
        if not opened.task.robustness_eval:  # detection, video, language models: the metrics their training logs
            return _task_eval(args, opened, device)

        model, cfg = load_run(args.run_dir, map_location=device)
        dataset, data_dir = args.dataset or cfg.dataset, args.data_dir or cfg.run.data_dir
        # the run's data options are its dataset's: another dataset starts from its own defaults
        data_opts = cfg.data_options if dataset == cfg.dataset else {}
        trained_on = cfg.dataset
        label = {"run": str(args.run_dir), "attn": cfg.attn}
    else:
        from ..models import build_model
        from ..models.pretrained import load_dna_authors, load_strict, read_state_dict

        dataset, data_dir, data_opts, trained_on = args.dataset or "digits", args.data_dir or "data", {}, None
        info = dataset_info(dataset, data_dir=data_dir) if not folder or args.dataset else None
        kwargs = {} if info is None else dict(in_chans=info.in_chans, img_size=info.image_size)
        if args.image_size:
            kwargs["img_size"] = args.image_size
        from_file = args.pretrained or args.pretrained_file
        num_classes = args.num_classes or (info.num_classes if info is not None and not from_file else None)
        torch.manual_seed(args.seed)
        model = build_model(args.model, num_classes=num_classes, attn=args.attn, pretrained=args.pretrained,
                            pretrained_file=args.pretrained_file, **kwargs)
        if args.checkpoint and args.dna_layout:
            load_dna_authors(model, args.checkpoint, layout=args.dna_layout, sign=args.dna_sign)
        elif args.checkpoint:
            load_strict(model, read_state_dict(args.checkpoint), f"checkpoint {args.checkpoint}")
        model = model.to(device).eval()
        label = {"model": args.model, "attn": args.attn}
        if args.random_weights:
            label["weights"] = "random"

    class_indices = None
    shape = _input_shape(model)
    if args.run_dir and args.image_size and shape and (args.image_size, args.image_size) != tuple(shape[1:]):
        raise ConfigError(f"--image-size {args.image_size} does not fit the run's model, which takes "
                          f"{_shape_words(shape[0], tuple(shape[1:]))} images; drop --image-size.")
    if folder is not None:
        info = dataset_info(dataset, data_dir=data_dir, **data_opts) if args.run_dir or args.dataset else None
        chans = shape[0] if shape else 3
        size = args.image_size or (shape[1] if shape else 224)  # the model's own input size
        transform = folder_transform(False, "none", image_size=size, **_folder_norm(info, chans))
        data = image_folder(folder, transform, channels=chans, what="--folder")
        if args.classes:
            class_indices = _class_indices(args.classes, data.classes, getattr(model, "num_classes", None))
        ood_data = image_folder(ood, transform, channels=chans, what="--ood") if ood else None
        label["folder"] = str(folder)
    else:
        info = dataset_info(dataset, data_dir=data_dir, **data_opts)
        _check_dataset(model, info, trained_on)
        data = build_dataset(dataset, args.split == "train", data_dir=data_dir, augment="none", **data_opts)
        ood_data = None
        if ood:  # read like the dataset's own images (channels, size, normalisation): only the content differs
            transform = folder_transform(False, "none", image_size=info.image_size, mean=info.mean, std=info.std)
            ood_data = image_folder(ood, transform, channels=info.in_chans, what="--ood")
        label.update(dataset=dataset, split=args.split)
    result = evaluate(model, data, ood=ood_data, batch_size=args.batch_size, device=device, noise_std=args.noise,
                      seed=args.seed, limit=args.images, class_indices=class_indices)
    print(json.dumps({**label, **result}))
    return 0


def _task_eval(args, run, device) -> int:
    """A run of a family that is not classification, evaluated as its training evaluates it (``Task.evaluate``
    on its evaluation split, found under ``--data-dir`` when the data has moved), printed as one JSON line; the
    classification-only flags are refused."""
    from ..train.run import resolve_amp

    task, cfg = run.task, run.cfg
    given = [flag for flag, value in (("--folder", args.folder), ("--ood", args.ood), ("--classes", args.classes),
                                      ("--noise", args.noise), ("--images", args.images),
                                      ("--image-size", args.image_size), ("--num-classes", args.num_classes),
                                      ("--split train", args.split == "train"), ("--dataset", args.dataset))
             if value]
    if given:
        raise ConfigError(f"{given[0]} applies to image and sequence classification runs; a {task.name} run is "
                          "evaluated on its own evaluation split as in training, so drop it.")
    model = run.load_model(device)
    task.prepare_eval()
    metrics = task.evaluate(model, device=device, amp_dtype=resolve_amp(cfg.run.amp, device))
    print(json.dumps({"run": str(args.run_dir), "attn": cfg.attn, "dataset": cfg.dataset, "task": task.name,
                      **metrics}))
    for line in getattr(task, "eval_table", lambda _: [])(metrics):  # a family's own table (vlm: per category)
        print(line)
    return 0
