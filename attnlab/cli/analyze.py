"""Run the papers' instruments on trained runs (or on a fresh model) and write analysis.json plus PNG plots.

Inputs follow the NS-Attn paper's protocol: the first --images test images (default 160) of the run's dataset, in
batches of --batch-size (default 32), eval mode, torch.inference_mode(). Models and images go to --device (default
auto: cuda if available, else cpu).

Examples:
  attnlab analyze runs/demo/vit_digits-digits-ns-s0 --what spectra
  attnlab analyze runs/ns_attn_table1/vit_cifar-cifar100-* --what spectra --out figures/   # Figure 2, per variant
  attnlab analyze --model vit_cifar --attn ns --dataset synthetic --what spectra,entropy
  attnlab analyze runs/demo/vit_digits-digits-ns-s0 --what jacobian --device cuda:1
  attnlab analyze runs/demo/vit_digits-digits-dna-s0 --what redundancy,robustness,relevance
  attnlab analyze runs/demo/* --what curves --out figures/   # train/test loss and top-1 per variant
  attnlab analyze runs/vitdet_tiny-shapes-dna-s0 --what predictions,spectra   # a detection run: its backbone

--what all runs every instrument. An instrument that does not apply to a model (relevance on Swin, entropy on
DnA...) is reported in one line on stderr and the others go on; entries that are not run directories (the report
files compare writes beside the runs) are passed over with one note. A progress bar over instruments and images
shows on a terminal.

On a detection run the model instruments measure the detector's transformer (its backbone) on the first evaluation
images fitted into the detector's square canvas; predictions draws the first 8 evaluation images' detections
(score >= 0.5) beside their ground truth, as the DnA paper's Figure 10, into predictions_<image id>.png.

On a language-model run (a GPT) the instruments read the first --images validation blocks (token ids) and measure
the causal order the model passes its blocks: a later key is in no entropy, maximum or Jacobian; robustness and
relevance, which perturb or explain image inputs, do not apply."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..errors import ConfigError, UnsupportedModelError, did_you_mean
from ..train.files import CONFIG
from .checks import count, output_dir, run_dir

# attnlab.analysis.instruments.INSTRUMENTS by name: that module imports torch, which --help must not wait for
INSTRUMENTS = ("spectra", "entropy", "qk", "branches", "jacobian", "redundancy", "robustness", "relevance",
               "curves", "predictions")
PREDICTION_IMAGES = 8  # images drawn per detection run by --what predictions (the DnA paper's Figure 10)


def configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="*", metavar="RUN_DIR", help="run directories (each with config.yaml and a checkpoint)")
    p.add_argument("--what", default="spectra",
                   help=f"comma-separated instruments: {', '.join(INSTRUMENTS)}, or all (default: spectra)")
    p.add_argument("--model", default=None, help="analyse a freshly built model instead of runs (preset or timm name)")
    p.add_argument("--attn", default="standard", help="variant spec for --model")
    p.add_argument("--dataset", default="digits", help="dataset whose test images feed the model (with --model)")
    p.add_argument("--data-dir", default=None, help="dataset directory (default: the run's, or data/)")
    p.add_argument("--seed", type=int, default=0, help="seed of the fresh model (with --model)")
    p.add_argument("--images", type=count(1), default=160, help="number of test images, taken in order (default 160)")
    p.add_argument("--batch-size", type=count(1), default=32, help="images per forward (default 32)")
    p.add_argument("--out", default=None, help="output directory (default: the run directory, or analysis/)")
    p.add_argument("--device", default="auto", help="auto (cuda if available, else cpu), cpu, cuda or cuda:N")


def run(args) -> int:
    what = [w.strip() for w in args.what.split(",") if w.strip()]
    what = list(INSTRUMENTS) if what == ["all"] else what
    bad = next((w for w in what if w not in INSTRUMENTS), None) if what else args.what
    if bad is not None:
        raise ConfigError(f"unknown instrument {bad!r} in --what{did_you_mean(bad, [*INSTRUMENTS, 'all'])}; choose "
                          f"from: {', '.join(INSTRUMENTS)}, or all.")
    if not args.runs and not args.model:
        raise ConfigError("give run directories to analyse, or --model (with --attn and --dataset) for a fresh model.")
    # `analyze runs/demo/*` also matches what compare writes beside the runs (report.md, its PNGs): passed over,
    # with a note; when nothing is left, the first entry's error says why
    runs = [path for path in args.runs if (Path(path) / CONFIG).is_file()]
    not_runs = [path for path in args.runs if path not in runs]
    if not_runs and not runs:
        run_dir(not_runs[0])
    if not_runs:
        n = len(not_runs)
        shown = ", ".join(Path(p).name for p in not_runs[:4]) + (f" and {n - 4} more" if n > 4 else "")
        print(f"attnlab analyze: passed over {n} {'entry that is' if n == 1 else 'entries that are'} not a run "
              f"directory (no config.yaml): {shown}", file=sys.stderr)
    out = Path(args.out) if args.out else (Path(runs[0]) if len(runs) == 1 and not args.model else Path("analysis"))
    output_dir(out, "--out")

    import torch

    from ..analysis.instruments import analyze_model, plot_results
    from ..data import build_dataset, dataset_info
    from ..spec import parse_spec
    from ..train.checkpoint import atomic_write_json
    from ..train.run import resolve_device

    device = resolve_device(args.device)

    model_what = [w for w in what if w not in ("curves", "predictions")]
    targets = []  # (label, attn, model, dataset, data_dir)
    if args.model and "curves" in what:
        print(f"{args.model}: curves does not apply to a fresh model (no metrics.jsonl); give run directories.",
              file=sys.stderr)
    if args.model and model_what:
        from ..models import build_model

        info = dataset_info(args.dataset, data_dir=args.data_dir or "data")
        torch.manual_seed(args.seed)
        model = build_model(args.model, num_classes=info.num_classes, attn=args.attn, in_chans=info.in_chans,
                            img_size=info.image_size).to(device)
        targets.append((f"{args.model}-{parse_spec(args.attn)}", str(parse_spec(args.attn)), model, args.dataset,
                        args.data_dir or "data"))
    from ..train.run import Run

    # (images, labels) by (dataset, data_dir), or by label for a run whose task gives its own inputs
    image_cache = {}
    drawn = []  # detection runs' Figure-10 panels
    for path in runs if model_what or "predictions" in what else []:
        opened = Run.open(path, data_dir=args.data_dir)  # --data-dir: where the run's data lies now
        opened.warn_data_changed("analyze")
        model, cfg, task = opened.load_model(device), opened.cfg, opened.task
        label = Path(path).name
        if "predictions" in what:
            drawn += _predictions(label, model, task, out, device, len(runs) > 1)
        if not model_what:
            continue
        # a detector (its transformer measured) or a language model (its first validation blocks, token ids)
        if hasattr(task, "instrument_model") or not task.labelled_inputs:
            image_cache[label] = (task.instrument_inputs(args.images).to(device), None)
        if hasattr(task, "instrument_model"):
            model = task.instrument_model(model)
        targets.append((label, cfg.attn, model, cfg.dataset, args.data_dir or cfg.run.data_dir))
    if "predictions" in what and not drawn:
        print("predictions: no detection run given; it draws a detector's boxes and masks.", file=sys.stderr)

    results = {}
    progress = sys.stderr.isatty()
    skipped = []  # (label, instrument, reason)
    for label, attn, model, dataset, data_dir in targets:
        key = label if label in image_cache else (dataset, data_dir)
        if key not in image_cache:
            test = build_dataset(dataset, False, data_dir=data_dir)
            n = min(args.images, len(test))
            samples = [test[i] for i in range(n)]
            image_cache[key] = (torch.stack([s[0] for s in samples]).to(device),
                                torch.as_tensor([int(s[1]) for s in samples]))
        images, labels = image_cache[key]
        results[label] = {"attn": attn, **analyze_model(
            model, images, model_what, batch_size=args.batch_size, labels=labels, out_dir=out,
            prefix="" if len(targets) == 1 else f"{label}-", skip_unsupported=True, progress=progress)}
        skipped += [(label, name, why) for name, why in results[label].get("skipped", {}).items()]
        if results[label]["summary"]:  # relevance and predictions draw figures and summarise nothing
            print(f"{label}: " + ", ".join(f"{k} {v:.4g}" for k, v in results[label]["summary"].items()))
    if skipped and len(skipped) == len(targets) * len(model_what) and not (runs and "curves" in what) and not drawn:
        raise UnsupportedModelError(skipped[0][2])  # nothing was measured: the reason is the error
    for label, name, why in skipped:
        print(f"{label}: {name} does not apply: {why}", file=sys.stderr)
    out.mkdir(parents=True, exist_ok=True)
    if "curves" in what and runs:
        from ..analysis.curves import plot_training_curves, training_curves

        curves = training_curves(runs)
        plot_training_curves(curves, out / "curves.png")
        results["curves"] = curves
        print(f"wrote {out / 'curves.png'}")
    atomic_write_json(out / "analysis.json", results)
    for path in plot_results({k: v for k, v in results.items() if k != "curves"}, out):
        print(f"wrote {path}")
    for path in [*(p for r in results.values() for p in r.get("figures", [])), *drawn]:
        print(f"wrote {path}")
    print(f"wrote {out / 'analysis.json'}")
    return 0


def _predictions(label, model, task, out, device, prefixed: bool) -> list:
    """Figure-10 panels of a detection run (its first evaluation images), or [] with a note for other runs."""
    from ..data.coco import CocoInstances

    if not isinstance(getattr(task, "val_set", lambda: None)(), CocoInstances):
        print(f"{label}: predictions does not apply: it draws a detector's boxes and masks, and this is a "
              f"{task.name} run.", file=sys.stderr)
        return []
    from ..analysis.predictions import predictions_figures

    val = task.val_set()
    return predictions_figures(model, val, range(min(PREDICTION_IMAGES, len(val))),
                               out / label if prefixed else out, device=device)
