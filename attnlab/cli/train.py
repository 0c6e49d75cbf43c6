"""`attnlab train`: one training run from a recipe, a YAML config and flags (flags win)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import sys
import typing
from pathlib import Path
from typing import Any

from attnlab.errors import AttnlabError, ConfigError, NonFiniteLossError
from attnlab.train.files import CONFIG, DATA, METRICS, TB_DIR, TOKENIZER

from . import current_rank

# TrainConfig keys that `attnlab train` does not expose as --flags (resume has its own flag below)
_HIDDEN = {"resume", "world_size"}  # world_size is recorded from torchrun, not set


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _converter(key: str):
    """argparse ``type=`` converting a flag's text as config key ``key`` (so the error names the flag)."""
    from attnlab.train.config import coerce

    def convert(text: str) -> Any:
        try:
            return coerce(key, text)
        except ConfigError as err:  # "config key 'k' got ..." -> "argument --k: got ..."
            raise argparse.ArgumentTypeError(str(err).removeprefix(f"config key '{key}' ").rstrip(".")) from None

    convert.__name__ = key
    return convert


def add_config_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup,
                     only: typing.Iterable[str] | None = None) -> None:
    """One --flag per TrainConfig field (help from the field's metadata); unset flags leave the config alone."""
    from attnlab.data.registry import DATASET_TABLE, describe
    from attnlab.train.config import RECIPES, TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    defaults = RECIPES["ns_cifar"]
    for f in dataclasses.fields(TrainConfig):
        if f.name in _HIDDEN or (only is not None and f.name not in only):
            continue
        help_text = f.metadata.get("help", "")
        default = getattr(defaults, f.name)
        if hints[f.name] in (bool, bool | None):  # None: the default that depends on the run
            parser.add_argument(_flag(f.name), dest=f.name, action=argparse.BooleanOptionalAction,
                                default=argparse.SUPPRESS, help=f"{help_text} (ns_cifar: {default})")
            continue
        typ = next((a for a in typing.get_args(hints[f.name]) if a is not type(None)), hints[f.name])
        metavar = {dict: "YAML", str: "TEXT", int: "N", float: "X"}.get(typ, "X")
        if f.name == "recipe":
            help_text += f" ({', '.join(RECIPES)}; default {default})"
        elif f.name == "data_options":
            help_text += (" as a YAML mapping, e.g. '{image_size: 64}'; each dataset's options, with defaults and "
                          "bounds: " + "; ".join(describe(name) for name in DATASET_TABLE))
        elif typ is dict:
            help_text += " as a YAML mapping, e.g. '{depth: 2}'"
        if default not in (None, {}) and f.name != "recipe":
            help_text += f" (ns_cifar: {default})"
        parser.add_argument(_flag(f.name), dest=f.name, metavar=metavar, default=argparse.SUPPRESS, help=help_text,
                            type=_converter(f.name))


def config_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The TrainConfig keys given on the command line (converted to the keys' types by the flags)."""
    from attnlab.train.config import config_keys

    return {k: getattr(args, k) for k in config_keys() if k not in _HIDDEN and hasattr(args, k)}


def _missing_dirs(run_dir: Path) -> list[Path]:
    """``run_dir`` and those of its parents that do not exist yet, deepest first."""
    missing = []
    while not run_dir.exists() and run_dir != run_dir.parent:
        missing.append(run_dir)
        run_dir = run_dir.parent
    return missing


def _remove_unstarted(made: list[Path]) -> None:
    """Undo a run that failed before its first epoch: remove the directories it created, if they hold no more than
    set-up writes (config.yaml, data.json, the tokenizer's copy, an empty metrics.jsonl, TensorBoard's first
    events); a run with a checkpoint or a logged epoch stays, to be resumed."""
    run_dir = made[0] if made else None
    setup = (CONFIG, DATA, TOKENIZER, METRICS)
    if (run_dir is not None and run_dir.is_dir() and {p.name for p in run_dir.iterdir()} <= {*setup, TB_DIR}
            and (not (run_dir / METRICS).exists() or (run_dir / METRICS).stat().st_size == 0)):
        for name in setup:
            (run_dir / name).unlink(missing_ok=True)
        shutil.rmtree(run_dir / TB_DIR, ignore_errors=True)
    for directory in made:
        try:
            directory.rmdir()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: keep it and what holds it
            return


def configure(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Train one model with the NS-Attn paper's CIFAR recipe (or another named recipe) into\n"
        "<runs-dir>/<model>-<dataset>-<attn>-s<seed>/: config.yaml, metrics.jsonl, checkpoint.safetensors,\n"
        "trainer_state.pt and, when finished, result.json. Precedence: recipe < --config file < flags.")
    parser.epilog = ("examples:\n"
                     "  attnlab train --model vit_cifar --dataset cifar100 --attn ns --seed 0 --download\n"
                     "  attnlab train --recipe demo --attn ns\n"
                     "  attnlab train --config configs/x.yaml --epochs 10\n"
                     "  attnlab train --resume runs/vit_cifar-cifar100-ns-s0")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("--config", metavar="YAML", help="YAML file of training config keys (see the flags below)")
    parser.add_argument("--resume", nargs="?", const=True, default=False, metavar="RUN_DIR",
                        help="continue from the last completed epoch: of RUN_DIR (its config.yaml is used) or of the "
                             "run the other options name; starts afresh if there is no checkpoint yet")
    group = parser.add_argument_group("training config (each overrides the recipe and --config)")
    add_config_flags(group)


def run(args: argparse.Namespace) -> int:
    from attnlab.cli.checks import output_dir
    from attnlab.train.config import load_config

    overrides = config_overrides(args)
    config_path = args.config
    if isinstance(args.resume, str):
        run_dir = Path(args.resume)
        if not (run_dir / CONFIG).exists():
            raise ConfigError(f"--resume {run_dir}: no {CONFIG} there; give a run directory made by attnlab train.")
        if config_path is not None:
            raise ConfigError("--resume RUN_DIR reads the run's own config.yaml; drop --config or give --resume alone.")
        for key, value in (("name", run_dir.name), ("runs_dir", str(run_dir.parent))):
            if key in overrides and Path(overrides[key]) != Path(value):
                raise ConfigError(f"--resume {run_dir} continues that run in place, so --{key.replace('_', '-')} "
                                  f"{overrides[key]} would train another; drop --{key.replace('_', '-')}.")
        config_path = run_dir / CONFIG
        overrides.update(runs_dir=str(run_dir.parent), name=run_dir.name)
    cfg = dataclasses.replace(load_config(config_path, **overrides), resume=bool(args.resume))
    output_dir(cfg.runs_dir, "runs_dir")
    notes = _notes(cfg)

    from attnlab.train import run_dir_of, train  # torch loads only once the options are known to be good

    if notes:  # a note is for a run that starts: an error found by the checks stays the one line
        from attnlab.train.run import Run

        Run(cfg).plan()
        print(*notes, sep="\n", file=sys.stderr)

    made = _missing_dirs(run_dir_of(cfg))
    probe = None
    if cfg.probe_every > 0:
        from attnlab.analysis import training_probe as probe
    try:
        result = train(cfg, probe)  # NonFiniteLossError -> attnlab.cli.main: one stderr line, exit code 3
    except AttnlabError as err:
        # rank 0 writes the run's files, so it alone removes them: two ranks would race in iterdir and rmdir
        if not isinstance(err, NonFiniteLossError) and not current_rank():
            _remove_unstarted(made)
        raise
    if not current_rank():  # under torchrun, rank 0 speaks for the run
        from attnlab.train.files import result_line

        print(f"{result_line(result)}  ({result['params'] / 1e6:.2f}M params, {result['seconds']:.1f} s) -> "
              f"{run_dir_of(cfg)}")
    return 0


def _notes(cfg) -> list[str]:
    """Lines for stderr on settings that are valid but probably not meant: more threads than cores, and a dataset
    trained with a recipe made for another when one exists for it."""
    from attnlab.train.config import RECIPES

    notes = []
    cores = os.cpu_count() or 1
    if cfg.threads and cfg.threads > cores:
        notes.append(f"attnlab train: note: --threads {cfg.threads} on {cores} cores oversubscribes them (torch's "
                     f"threads then wait on each other, often several times slower); use --threads {cores} or "
                     f"fewer.")
    recipe = RECIPES[cfg.recipe]
    if cfg.dataset != recipe.dataset:
        made_for = [name for name, r in RECIPES.items() if r.dataset == cfg.dataset]
        if made_for:
            notes.append(f"attnlab train: note: the {cfg.recipe} recipe is tuned for {recipe.dataset}; --recipe "
                         f"{made_for[0]} is the one made for {cfg.dataset}.")
    return notes
